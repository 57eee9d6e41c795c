//! Bounds on what a caller may ask `carve::nn` to make, checked before anything is
//! allocated or started.
//!
//! A size that comes from a caller (a thread count, a batch size, a layer width, a
//! tensor's shape in a file) never reaches an infallible allocation: the global
//! allocator's answer to a size it cannot give is to end the process, in whatever thread
//! asked. Every such buffer is reserved here, fallibly, on the caller's thread, and a
//! size the machine cannot give is [`Error::InvalidConfig`] (or the caller's own error)
//! naming the size.

use crate::{Error, Result};

pub use super::embedding::MAX_VOCABULARY;

/// The most threads (or inference arenas, or data-parallel workers in a process) that
/// one pool, trainer or network may ask for.
///
/// A count is memory and a thread each; beyond the cores a machine has, more only
/// queue. This bound keeps a mistaken count (`usize::MAX`, a negative number cast)
/// an error in microseconds instead of a machine brought down thread by thread.
///
/// ```
/// use std::sync::Arc;
/// use carve::nn::{serve::InferencePool, Network, NetworkConfig, serve::PoolConfig, limits::MAX_THREADS};
///
/// let model = Arc::new(Network::new(NetworkConfig::builder(4).dense(3).build()?)?.freeze()?);
/// let refused = InferencePool::new(model, PoolConfig::direct(MAX_THREADS + 1));
/// assert!(matches!(refused, Err(carve::Error::InvalidConfig { .. })));
/// # Ok::<(), carve::Error>(())
/// ```
pub const MAX_THREADS: usize = 4096;

/// The most workers (processes, typically MPI ranks) that a [`Reducer`](crate::nn::parallel::Reducer)
/// may report: a trainer keeps a report and a partial loss per worker and walks them
/// every step.
pub const MAX_RANKS: usize = 1 << 20;

/// Refuses a count of threads, arenas or workers above [`MAX_THREADS`] (and zero),
/// naming `what` asked for them.
pub(crate) fn check_threads(what: &str, count: usize) -> Result<()> {
    if count == 0 {
        return Err(Error::InvalidConfig { reason: format!("{what}: 0 asked for; at least 1 is needed") });
    }
    if count > MAX_THREADS {
        return Err(Error::InvalidConfig {
            reason: format!(
                "{what}: {count} asked for, more than the {MAX_THREADS} that carve starts at most \
                 (carve::nn::limits::MAX_THREADS); the machine's cores are a good choice"
            ),
        });
    }
    Ok(())
}

/// `len` elements of `value`, allocated fallibly: a length the machine cannot give (or
/// whose bytes overflow) is the reason, `"N bytes cannot be allocated (…)"`, for the
/// caller's own error.
pub(crate) fn reserve_filled<T: Clone>(len: usize, value: T) -> std::result::Result<Vec<T>, String> {
    let mut values = reserve(len)?;
    values.resize(len, value);
    Ok(values)
}

/// An empty vector with room for `len` elements, allocated fallibly (see
/// [`reserve_filled`]).
pub(crate) fn reserve<T>(len: usize) -> std::result::Result<Vec<T>, String> {
    let mut values = Vec::new();
    if let Err(e) = values.try_reserve_exact(len) {
        let bytes = len.checked_mul(size_of::<T>()).map_or_else(|| "more than usize::MAX".into(), |b| b.to_string());
        return Err(format!("{bytes} bytes cannot be allocated ({e})"));
    }
    Ok(values)
}

/// Refuses `buffers` buffers of `values` `f32`s each that together exceed this
/// machine's memory and swap ([`workspace_core::backend::machine_memory_bytes`]):
/// an overcommitting kernel grants each alone, and the process is killed once their
/// pages are written. `what` names them for the [`Error::InvalidConfig`].
pub(crate) fn check_machine_holds(values: usize, buffers: usize, what: impl FnOnce() -> String) -> Result<()> {
    let bytes = values as u128 * buffers as u128 * size_of::<f32>() as u128;
    match beyond_machine(bytes) {
        Some(machine) => Err(Error::InvalidConfig {
            reason: format!(
                "{}: {buffers} buffers of {values} values take {bytes} bytes, more than this machine's memory and \
                 swap ({machine} bytes)",
                what()
            ),
        }),
        _ => Ok(()),
    }
}

/// This machine's memory and swap in bytes ([`workspace_core::backend::machine_memory_bytes`])
/// when `bytes` exceed them: what an overcommitting kernel would grant, then kill the
/// process for once the pages are written. `None` when they fit, or the machine's
/// memory cannot be told.
pub(crate) fn beyond_machine(bytes: u128) -> Option<u128> {
    workspace_core::backend::machine_memory_bytes().filter(|&machine| bytes > machine)
}

/// [`reserve_filled`] for a configuration: the reason is [`Error::InvalidConfig`]
/// naming `what`.
pub(crate) fn config_filled<T: Clone>(len: usize, value: T, what: impl FnOnce() -> String) -> Result<Vec<T>> {
    reserve_filled(len, value).map_err(|why| Error::InvalidConfig { reason: format!("{}: {why}", what()) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_above_the_bound_and_zero_are_refused_with_the_count() {
        assert!(check_threads("a pool", 1).is_ok());
        assert!(check_threads("a pool", MAX_THREADS).is_ok());
        let e = check_threads("a pool's workers", MAX_THREADS + 1).unwrap_err().to_string();
        assert!(e.contains("4097 asked for") && e.contains("a pool's workers"), "{e}");
        assert!(check_threads("a pool", 0).is_err());
    }

    #[test]
    fn sizes_the_machine_cannot_give_are_errors_not_aborts() {
        let e = config_filled(1usize << 60, 0.0f32, || "a huge buffer".into()).unwrap_err().to_string();
        assert!(e.contains("a huge buffer: 4611686018427387904 bytes cannot be allocated"), "{e}");
        let e = reserve::<u64>(usize::MAX).unwrap_err();
        assert!(e.starts_with("more than usize::MAX bytes"), "{e}");
        assert_eq!(reserve_filled(3, 1.5f32).unwrap(), vec![1.5; 3]);
    }
}

#[cfg(test)]
mod machine_tests {
    use crate::nn::{Network, NetworkConfig, Updater};
    use crate::Error;

    #[test]
    fn a_network_whose_buffers_together_pass_the_machines_memory_is_refused_before_any_is_made() {
        let Some(machine) = workspace_core::backend::machine_memory_bytes() else {
            return; // a machine whose memory cannot be told: nothing to compare with
        };
        // One square layer whose parameters take a third of the machine: each buffer
        // alone fits, the parameters, gradients and Adam's two moments together do not.
        let width = ((machine / 3 / 4) as f64).sqrt() as usize;
        let config = NetworkConfig::builder(width).dense(width).updater(Updater::adam(1e-3)).build().unwrap();
        match Network::new(config) {
            Err(Error::InvalidConfig { reason }) => {
                assert!(reason.contains("4 buffers") && reason.contains("memory and swap"), "{reason}")
            }
            other => panic!("{:?}", other.map(|_| "a network")),
        }
    }
}
