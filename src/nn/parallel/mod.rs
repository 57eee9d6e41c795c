//! Data-parallel training: [`DataParallel`], DL4J's `ParallelWrapper` in carve's terms.
//!
//! - The weights and the updater's state are held **once**, in flat buffers laid out in
//!   backward order (the last layer's parameters first), and read by every worker
//!   through `&` during forward and backward.
//! - Each worker is a thread with its own planned arena (its training workspaces and its
//!   gradient buckets, one plan group): the backward pass writes each layer's gradients
//!   straight into the worker's buckets, contiguous ranges of that backward-order layout,
//!   so nothing is copied between backward and the reduction.
//! - A [`Reducer`] sums the buckets over the workers in rank order; each worker then
//!   checks and applies the update of the range it reduced (the update is element by
//!   element, so it splits without changing a bit), and the next step starts.
//! - A batch is cut into one shard of consecutive rows per worker, each a view of the
//!   batch (of the prefetch ring, with [`DataParallel::fit`]): nothing is copied.
//!
//! **Determinism.** The losses depend on the number of workers and on nothing else:
//! every reducer sums in rank order, and the single-thread shard mode
//! ([`ParallelConfig::sequential`]) runs the same shards on one thread and adds their
//! gradients in the same order, so it gives the same bits as that many threads. Each
//! worker runs the network's own training step on its shard (`nn::step`: the same
//! passes, loss reduction and checks), so one worker gives the bits of a [`Network`]
//! trained on whole batches; with more, the losses agree to floating-point tolerance
//! (the shards' matrix products sum in another order).
//!
//! **Breakdown.** [`DataParallel::set_breakdown`] measures the steps on the calling
//! thread, part by part, as [`Network::set_breakdown`] does.

#[cfg(feature = "mpi")]
#[allow(unsafe_code)]
mod mpi;
#[allow(unsafe_code)]
pub(crate) mod reduce;
#[allow(unsafe_code)]
pub(crate) mod shared;
#[allow(unsafe_code)]
mod trainer;
#[allow(unsafe_code)]
mod worker;

#[cfg(feature = "mpi")]
pub use mpi::Mpi;
pub use reduce::{Reducer, Report};
pub use trainer::{DataParallel, ParallelConfig, ParallelStats, ReducerKind};

#[cfg(doc)]
use super::Network;

/// The timeout of each collective call that `CARVE_MPI_TIMEOUT_MS` (`value`, when set)
/// asks for: 1 ms to a day; unset, 60 s. (Here, not in the `mpi` module, so that its
/// test runs without the feature.)
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn mpi_timeout(value: Option<&str>) -> crate::Result<std::time::Duration> {
    let Some(value) = value else { return Ok(std::time::Duration::from_secs(60)) };
    match value.trim().parse::<u64>() {
        Ok(ms @ 1..=86_400_000) => Ok(std::time::Duration::from_millis(ms)),
        _ => Err(crate::Error::Reduction {
            message: format!(
                "CARVE_MPI_TIMEOUT_MS is '{value}': give the milliseconds a collective call may take, 1 to 86400000 \
                 (0 would end every job at its first call)"
            ),
        }),
    }
}

#[cfg(test)]
mod timeout_tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_timeout_variable_is_read_or_refused_naming_it() {
        assert_eq!(mpi_timeout(None).unwrap(), Duration::from_secs(60));
        assert_eq!(mpi_timeout(Some(" 1500 ")).unwrap(), Duration::from_millis(1500));
        for bad in ["0", "-1", "soon", "", "86400001"] {
            let err = mpi_timeout(Some(bad)).unwrap_err().to_string();
            assert!(err.contains("CARVE_MPI_TIMEOUT_MS") && err.contains(&format!("'{bad}'")), "{err}");
        }
    }
}
