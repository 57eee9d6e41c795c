//! The one error type of async-iter.
//!
//! Every message says what happened, to which batch of which epoch, and what to do
//! about it. Errors of the batch source travel from the producer thread to the
//! consumer unchanged, as the `source()` of [`Error::Source`].

use std::panic::{self, AssertUnwindSafe};

use crate::role::Role;

/// The error type batch sources return: any error that can cross threads.
///
/// `?` converts every `std::error::Error + Send + Sync` (and `String`/`&str`) into it.
pub type SourceError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Which call of a [`BatchSource`](crate::BatchSource) failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SourceCall {
    /// [`BatchSource::next_layout`](crate::BatchSource::next_layout).
    NextLayout,
    /// [`BatchSource::fill`](crate::BatchSource::fill).
    Fill,
    /// [`BatchSource::reset`](crate::BatchSource::reset).
    Reset,
}

impl std::fmt::Display for SourceCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SourceCall::NextLayout => "next_layout",
            SourceCall::Fill => "fill",
            SourceCall::Reset => "reset",
        })
    }
}

/// A problem with a [`BatchLayout`](crate::BatchLayout) that a source described.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LayoutError {
    /// The layout has no features array.
    #[error("it has no features array: describe one with `BatchLayout::features`")]
    NoFeatures,
    /// An array has no elements.
    #[error(
        "its {role} array has shape {shape:?}, which has no elements; end the epoch by returning \
         `Ok(None)` from `next_layout` instead of describing an empty batch"
    )]
    Empty {
        /// The array.
        role: Role,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// The byte size of an array (or of the whole batch) does not fit in `usize`.
    #[error("its {role} array of shape {shape:?} and {element_size}-byte elements overflows the address space")]
    Overflow {
        /// The array.
        role: Role,
        /// Its shape.
        shape: Vec<usize>,
        /// Bytes per element.
        element_size: usize,
    },
    /// An array has more dimensions than a batch can describe.
    #[error("its {role} array has {ndim} dimensions; at most {max} are supported")]
    TooManyDimensions {
        /// The array.
        role: Role,
        /// Dimensions asked for.
        ndim: usize,
        /// [`MAX_DIMS`](crate::MAX_DIMS).
        max: usize,
    },
    /// An element type needs a larger alignment than the ring gives.
    #[error("its {role} array has element type {element} aligned to {align} bytes; at most {max} is supported")]
    OverAligned {
        /// The array.
        role: Role,
        /// The element type's name.
        element: &'static str,
        /// Its alignment.
        align: usize,
        /// [`ARRAY_ALIGN`](crate::ARRAY_ALIGN).
        max: usize,
    },
}

/// Errors from configuring a prefetcher, from its batch source, and from reading a
/// batch.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A builder setting is out of range; nothing was created.
    #[error("invalid prefetcher configuration: {reason}")]
    InvalidConfig {
        /// What is wrong, and how to fix it.
        reason: String,
    },

    /// The producer thread could not be started.
    #[error("the prefetch producer thread could not be started: {source}; reduce the number of threads")]
    Spawn {
        /// What the operating system reported.
        #[source]
        source: std::io::Error,
    },

    /// The batch source returned an error.
    #[error(
        "the batch source failed in `{call}` for batch {batch} of epoch {epoch}: {source}; the epoch \
         ends here (call `reset()` to start a new one)"
    )]
    Source {
        /// The epoch (0 for the first).
        epoch: u64,
        /// The batch's index in its epoch.
        batch: usize,
        /// The call that failed.
        call: SourceCall,
        /// The source's error.
        #[source]
        source: SourceError,
    },

    /// The batch source panicked.
    #[error(
        "the batch source panicked in `{call}` for batch {batch} of epoch {epoch}: {message}; the \
         epoch ends here (call `reset()` to start a new one if the source can recover)"
    )]
    SourcePanicked {
        /// The epoch (0 for the first).
        epoch: u64,
        /// The batch's index in its epoch.
        batch: usize,
        /// The call that panicked.
        call: SourceCall,
        /// The panic message (or a note that the payload was not a string).
        message: String,
    },

    /// The source described a batch that cannot be laid out.
    #[error("batch {batch} of epoch {epoch} cannot be laid out: {reason}")]
    InvalidLayout {
        /// The epoch (0 for the first).
        epoch: u64,
        /// The batch's index in its epoch.
        batch: usize,
        /// What is wrong with it.
        #[source]
        reason: LayoutError,
    },

    /// A batch needs a ring larger than the configured maximum.
    #[error(
        "batch {batch} of epoch {epoch} needs {batch_bytes} bytes, so the ring would need {ring_bytes} \
         bytes, over its max_ring_bytes of {max_ring_bytes}; raise `max_ring_bytes`, lower the depth, \
         or make the batches smaller"
    )]
    BatchTooLarge {
        /// The epoch (0 for the first).
        epoch: u64,
        /// The batch's index in its epoch.
        batch: usize,
        /// Bytes of the batch (arrays aligned to [`ARRAY_ALIGN`](crate::ARRAY_ALIGN)).
        batch_bytes: usize,
        /// Bytes the ring would need (`usize::MAX` when that overflows).
        ring_bytes: usize,
        /// The configured maximum.
        max_ring_bytes: usize,
    },

    /// The memory backend could not provide the ring.
    #[error("no memory for batch {batch} of epoch {epoch}: {source}")]
    Backend {
        /// The epoch (0 for the first).
        epoch: u64,
        /// The batch's index in its epoch.
        batch: usize,
        /// What the backend reported.
        #[source]
        source: workspace_core::BackendError,
    },

    /// The producer thread did not stop within the prefetcher's
    /// [`join_timeout`](crate::PrefetcherBuilder::join_timeout), because the source has
    /// not returned from a call (or, rarely, the thread was not scheduled in time).
    ///
    /// The epoch is over (`next()` returns `None`). The thread goes on with the call,
    /// owning the source and the ring, so whatever it writes stays valid; a later
    /// [`reset`](crate::Prefetcher::reset) or [`stop`](crate::Prefetcher::stop) waits for
    /// it again and succeeds once the source has returned, and dropping the prefetcher
    /// returns at once, leaving the thread detached: it finishes on its own, and the
    /// source and the ring are dropped when it ends.
    #[error(
        "the batch source `{source_type}` {where_it_is}, so the prefetch producer thread did not stop \
         within {waited:?}; it goes on in the background and releases the source and its ring memory \
         when the call returns. The epoch is over: `reset()` starts the next one once the source has \
         returned, dropping the prefetcher does not wait again, and a longer `join_timeout` gives a slow \
         source more time",
        where_it_is = Position(*.call, *.batch, *.epoch)
    )]
    SourceStuck {
        /// The source's type name.
        source_type: &'static str,
        /// The epoch the producer was in (0 for the first).
        epoch: u64,
        /// The batch it was at.
        batch: usize,
        /// The call into the source it had not returned from; `None` when it was not
        /// inside the source (its thread was only slow to end).
        call: Option<SourceCall>,
        /// How long this call waited for the thread.
        waited: std::time::Duration,
    },

    /// The producer thread stopped without reporting a result: a bug in async-iter.
    #[error(
        "the prefetch producer thread ended unexpectedly ({detail}); the prefetcher cannot continue, \
         build a new one (and please report this)"
    )]
    ProducerLost {
        /// What is known about it.
        detail: String,
    },

    /// A batch has no array of the requested role.
    #[error("batch {batch} has no {role} array; check `layout().has({role:?})` before asking for it")]
    MissingArray {
        /// The batch's index in its epoch.
        batch: usize,
        /// The role asked for.
        role: Role,
    },

    /// An array was requested with an element type other than the one it holds.
    #[error("the {role} array of batch {batch} holds {stored}, not {requested}: ask for it as `{stored}`")]
    WrongElementType {
        /// The batch's index in its epoch.
        batch: usize,
        /// The array.
        role: Role,
        /// The element type it holds.
        stored: &'static str,
        /// The element type asked for.
        requested: &'static str,
    },

    /// An array was requested with a dimensionality other than the one it has.
    #[error(
        "the {role} array of batch {batch} has {stored} dimensions (shape {shape:?}), not {requested}: \
         ask for it as `Ix{stored}` or `IxDyn`"
    )]
    WrongDimensionality {
        /// The batch's index in its epoch.
        batch: usize,
        /// The array.
        role: Role,
        /// Its number of dimensions.
        stored: usize,
        /// The number asked for.
        requested: usize,
        /// Its shape.
        shape: Vec<usize>,
    },

    /// A source asked twice for the writable view of the same array of one batch.
    #[error(
        "the {role} array of batch {batch} was already handed out for filling; keep the first view \
         (each array can be borrowed mutably once per batch)"
    )]
    AlreadyBorrowed {
        /// The batch's index in its epoch.
        batch: usize,
        /// The array.
        role: Role,
    },
}

/// Where a producer that did not stop was, in words.
struct Position(Option<SourceCall>, usize, u64);

impl std::fmt::Display for Position {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Position(call, batch, epoch) = *self;
        match call {
            Some(call) => write!(f, "has not returned from `{call}` for batch {batch} of epoch {epoch}"),
            None => write!(f, "was between calls at batch {batch} of epoch {epoch}"),
        }
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The message of a panic payload.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic payload that is not a string".to_owned()
    }
}

/// Drops `value` (a panic payload, or anything holding user code's destructors) where
/// a panic of its destructor must not escape: on the producer thread, in `next()`, in
/// `Drop`. Such a panic is caught, and its own payload dropped the same way; a chain of
/// payloads that all panic when dropped is cut after a few links by leaking the last.
pub fn drop_quietly<T>(value: T) {
    const LINKS: usize = 8;
    let Err(mut payload) = panic::catch_unwind(AssertUnwindSafe(move || drop(value))) else { return };
    for _ in 0..LINKS {
        match panic::catch_unwind(AssertUnwindSafe(move || drop(payload))) {
            Ok(()) => return,
            Err(next) => payload = next,
        }
    }
    std::mem::forget(payload);
}

/// The message, as for `Display`: what `main` prints for an error it returns.
impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_batch_and_the_fix() {
        let err = Error::Source { epoch: 2, batch: 7, call: SourceCall::Fill, source: "disk gone".into() };
        let text = err.to_string();
        assert!(text.contains("`fill`") && text.contains("batch 7 of epoch 2") && text.contains("disk gone"), "{text}");
        assert!(text.contains("reset()"), "{text}");
        let err = Error::WrongElementType { batch: 1, role: Role::Labels, stored: "u32", requested: "f32" };
        assert_eq!(err.to_string(), "the labels array of batch 1 holds u32, not f32: ask for it as `u32`");
        let err = Error::InvalidLayout { epoch: 0, batch: 3, reason: LayoutError::NoFeatures };
        assert!(err.to_string().contains("batch 3 of epoch 0 cannot be laid out: it has no features"), "{err}");
    }

    #[test]
    fn a_stuck_source_is_named_with_its_call_or_its_absence() {
        let waited = std::time::Duration::from_millis(1500);
        let stuck = |call| Error::SourceStuck { source_type: "my::Reader", epoch: 3, batch: 9, call, waited };
        let text = stuck(Some(SourceCall::Fill)).to_string();
        assert!(text.starts_with("the batch source `my::Reader` has not returned from `fill` for batch 9 of epoch 3"));
        assert!(text.contains("within 1.5s") && text.contains("`reset()`") && text.contains("join_timeout"), "{text}");
        let text = stuck(None).to_string();
        assert!(text.contains("was between calls at batch 9 of epoch 3"), "{text}");
    }

    #[test]
    fn quiet_drops_contain_panicking_destructors_and_payloads() {
        struct Bomb(u32);
        impl Drop for Bomb {
            fn drop(&mut self) {
                match self.0 {
                    0 => panic!("last"),
                    n => std::panic::panic_any(Bomb(n - 1)),
                }
            }
        }
        // (A chain longer than `LINKS` is cut by leaking its last payload, which valgrind
        // would report; it is not exercised here.)
        for links in [0, 3] {
            drop_quietly(Bomb(links)); // returns, every payload dropped
        }
        drop_quietly(String::from("fine"));
    }

    #[test]
    fn panic_messages_are_recovered() {
        let payload = std::panic::catch_unwind(|| panic!("boom {}", 42)).unwrap_err();
        assert_eq!(panic_message(payload.as_ref()), "boom 42");
        let payload = std::panic::catch_unwind(|| std::panic::panic_any(7_u8)).unwrap_err();
        assert_eq!(panic_message(payload.as_ref()), "a panic payload that is not a string");
    }
}
