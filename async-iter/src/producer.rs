//! The producer: asks the source for each batch's layout, reserves its region in the
//! ring, lets the source fill it, and publishes it — on its own thread, or inline in
//! the consumer's `next()` in shield mode.
//!
//! Calls into the [`BatchSource`] run under `catch_unwind`: an error or a panic of the
//! source becomes the epoch's outcome at the batch it happened, delivered by the
//! consumer after every batch published before it. The panic's payload is user code
//! too (its destructor may panic again), so it is dropped where that cannot escape.

use std::panic::{self, AssertUnwindSafe};
use std::ptr::NonNull;

use workspace_core::backend::{ArenaBackend, Block};

use crate::error::{drop_quietly, panic_message, Error, SourceCall, SourceError};
use crate::handoff::{Descriptor, Shared};
use crate::ring::Ring;
use crate::source::BatchSource;
use crate::stats::{Position, ProducerCounters};
use crate::view::BatchMut;

/// What one [`Producer::step`] did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// A batch was published.
    Published,
    /// The epoch ended (end of data or a failure) and the consumer was told.
    Finished,
    /// The consumer asked to stop; nothing more will be published this epoch.
    Stopped,
}

/// The producer's state. It moves into the producer thread for an epoch and back to
/// the prefetcher through the thread's exit (or, when the prefetcher gave up waiting
/// for a stuck source, stays with the thread until it ends); the ring inside it owns
/// the memory of every batch, so it is never dropped while a batch is queued, leased
/// or being filled.
pub(crate) struct Producer<S, B: ArenaBackend> {
    source: S,
    ring: Ring<B>,
    epoch: u64,
    /// Index of the next batch in this epoch.
    next: usize,
}

impl<S, B> Producer<S, B>
where
    S: BatchSource,
    B: ArenaBackend,
    B::Block: Block<Base = NonNull<u8>>,
{
    pub(crate) fn new(source: S, ring: Ring<B>) -> Self {
        Producer { source, ring, epoch: 0, next: 0 }
    }

    /// Produces the next batch, or ends the epoch.
    pub(crate) fn step(&mut self, shared: &Shared) -> Step {
        if shared.stop_requested() {
            return Step::Stopped;
        }
        let (epoch, index) = (self.epoch, self.next);
        let source = &mut self.source;
        let at = Some(&*shared.counters.producer);
        let mut layout = match guarded(at, epoch, index, SourceCall::NextLayout, || source.next_layout(index)) {
            Ok(Some(layout)) => layout,
            Ok(None) => return finish(shared, None),
            Err(err) => return finish(shared, Some(err)),
        };
        let bytes = match layout.plan() {
            Ok(bytes) => bytes,
            Err(reason) => return finish(shared, Some(Error::InvalidLayout { epoch, batch: index, reason })),
        };
        let Some(released) = shared.wait_for_room(index) else {
            return Step::Stopped;
        };
        self.ring.free_released(released);
        let region = match self.ring.reserve(epoch, index, bytes, &shared.counters.producer) {
            Ok(region) => region,
            Err(err) => return finish(shared, Some(err)),
        };
        let slot = shared.claim(index);
        // SAFETY: the region is aligned, holds the planned bytes of `layout`, zeroed by
        // the ring, and is this batch's alone until published and released: the slot's
        // previous batch is released (`wait_for_room`), and the claim above is the
        // producer's unique access to the slot.
        let mut batch = unsafe { BatchMut::new(region.base, &layout, index) };
        let filled = guarded(at, epoch, index, SourceCall::Fill, || source.fill(&mut batch));
        if let Err(err) = filled {
            return finish(shared, Some(err));
        }
        slot.publish(Descriptor { region, layout, index });
        self.next += 1;
        Step::Published
    }

    /// Runs an epoch on the producer thread until it ends or is stopped.
    pub(crate) fn run(mut self, shared: &Shared) -> Self {
        // A panic in async-iter's own code (a bug) must neither hang the consumer nor
        // drop the ring under a lease: it is caught, reported as the epoch's outcome,
        // and the state goes back to the prefetcher, which keeps it until no lease can
        // be alive. Under loom such a panic is a model failure and is left to loom.
        #[cfg(not(loom))]
        {
            let caught = panic::catch_unwind(AssertUnwindSafe(|| self.run_epoch(shared)));
            if let Err(payload) = caught {
                let detail = format!("it panicked: {}", panic_message(payload.as_ref()));
                drop_quietly(payload);
                shared.finish(Some(Error::ProducerLost { detail }));
            }
        }
        #[cfg(loom)]
        self.run_epoch(shared);
        self
    }

    fn run_epoch(&mut self, shared: &Shared) {
        while self.step(shared) == Step::Published {}
    }

    /// Prepares a new epoch: the ring's retired blocks go, the source rewinds.
    ///
    /// # Errors
    ///
    /// The source's error or panic in `reset`.
    pub(crate) fn reset(&mut self, epoch: u64) -> Result<(), Error> {
        self.ring.end_epoch();
        self.epoch = epoch;
        self.next = 0;
        let source = &mut self.source;
        guarded(None, epoch, 0, SourceCall::Reset, || source.reset())
    }
}

fn finish(shared: &Shared, outcome: Option<Error>) -> Step {
    shared.finish(outcome);
    Step::Finished
}

/// Runs one call into the source, turning its error or panic into an [`Error`]; notes
/// the call in `at` while it runs (on the producer thread).
fn guarded<T>(
    at: Option<&ProducerCounters>,
    epoch: u64,
    batch: usize,
    call: SourceCall,
    f: impl FnOnce() -> Result<T, SourceError>,
) -> Result<T, Error> {
    if let Some(at) = at {
        at.set_position(Position { call: Some(call), batch });
    }
    let result = match panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(source)) => Err(Error::Source { epoch, batch, call, source }),
        Err(payload) => {
            let message = panic_message(payload.as_ref());
            // The payload is the source's: its destructor may panic too, which must
            // neither escape `next()` (shield mode) nor end the producer thread.
            drop_quietly(payload);
            Err(Error::SourcePanicked { epoch, batch, call, message })
        }
    };
    if let Some(at) = at {
        at.set_position(Position { call: None, batch });
    }
    result
}
