//! The trace recorder: a [`Member`] that appends every event of the workspace to a
//! shared [`Trace`] (see [`Engine::record_into`]).

use std::cell::RefCell;
use std::sync::{Arc, Mutex};

use super::member::Member;
use super::Engine;
use crate::backend::ArenaBackend;
use crate::error::{Error, Result};
use crate::plan::{Event, Trace};

/// Appends events to `trace`. The trace's lock is only tried: while someone holds it
/// (the caller itself, between two allocations, must not wait for itself) the events
/// wait here, in order, for the next event or the end of the recording.
pub(super) struct Recorder {
    trace: Arc<Mutex<Trace>>,
    /// Events the trace could not take yet, with when they happened.
    unrecorded: RefCell<Vec<(u64, Event)>>,
}

impl Recorder {
    /// Moves the waiting events into the trace if its lock is free; whether it was.
    fn flush(&self) -> bool {
        let mut trace = match self.trace.try_lock() {
            Ok(trace) => trace,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        trace.push_all_stamped(std::mem::take(&mut *self.unrecorded.borrow_mut()));
        true
    }
}

impl<B: ArenaBackend> Member<B> for Recorder {
    #[cold]
    fn event(&self, event: Event) {
        self.unrecorded.borrow_mut().push((crate::plan::stamps(1), event));
        self.flush();
    }

    fn detach(&self, workspace: &str) -> Result<()> {
        if self.unrecorded.borrow().is_empty() {
            return Ok(());
        }
        // Another thread may hold the lock for a moment: a few tries before giving up.
        let taken = (0..1000).any(|_| {
            self.flush() || {
                std::thread::yield_now();
                false
            }
        });
        if taken {
            return Ok(());
        }
        Err(Error::InvalidInput(format!(
            "workspace '{workspace}' recorded events while its trace was locked, and the trace is still locked: \
             release the trace's lock, then start or stop the recording again"
        )))
    }

    fn dropped(&self) {
        // Events still waiting go in if the trace is free now (else they are lost).
        self.flush();
    }
}

impl<B: ArenaBackend> Engine<B> {
    /// Records every later allocation (its padded size and alignment) and the end of
    /// every later cycle into `trace`, as events of owner [`Engine::owner`], until
    /// called with `None`: the lifetime trace a plan is made from
    /// ([`plan`](crate::plan)). Several workspaces may record into one trace, which
    /// then holds their events in the order they happened. Only where memory comes
    /// from is unchanged: recording takes every allocation through the slow path.
    ///
    /// # Errors
    ///
    /// [`Error::StillOpen`] while a scope is open; [`Error::InvalidInput`] when events
    /// recorded while the trace was locked cannot be handed over because it still is.
    pub fn record_into(&self, trace: Option<Arc<Mutex<Trace>>>) -> Result<()> {
        let recorder = trace.map(|trace| Box::new(Recorder { trace, unrecorded: RefCell::new(Vec::new()) }) as _);
        self.record_with(recorder)
    }
}
