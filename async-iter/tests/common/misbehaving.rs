//! Misbehaving batch sources, written once: wrappers that make any well-behaved source
//! panic with a payload that panics again when dropped ([`Detonating`]), or get stuck in
//! `fill` until the test opens a gate ([`Stuck`]). `async-iter/tests/misbehaving_sources.rs`
//! wraps host sources in them; `workspace-cuda/tests/device/prefetch.rs` (through
//! `tests/device/main.rs`, with `#[path]`) wraps the device suite's `Numbers`.

// Each test binary uses part of this module.
#![allow(dead_code)]

use std::panic;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};

use async_iter::{BatchLayout, BatchMut, BatchSource, SourceCall, SourceError};

/// A panic payload whose destructor panics too.
pub(crate) struct Bomb;

impl Drop for Bomb {
    fn drop(&mut self) {
        panic!("the panic payload's destructor panicked as well");
    }
}

/// `inner`, but panics with a [`Bomb`] in `call` at batch `at` (`reset`: at 0), once:
/// the first time that call reaches that batch.
pub(crate) struct Detonating<S> {
    pub(crate) inner: S,
    call: SourceCall,
    at: usize,
    armed: bool,
}

impl<S> Detonating<S> {
    pub(crate) fn new(inner: S, call: SourceCall, at: usize) -> Detonating<S> {
        Detonating { inner, call, at, armed: true }
    }

    fn maybe_explode(&mut self, call: SourceCall, index: usize) {
        if self.armed && call == self.call && index == self.at {
            self.armed = false;
            panic::panic_any(Bomb);
        }
    }
}

impl<S: BatchSource> BatchSource for Detonating<S> {
    fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
        self.maybe_explode(SourceCall::NextLayout, index);
        self.inner.next_layout(index)
    }

    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
        self.maybe_explode(SourceCall::Fill, batch.index());
        self.inner.fill(batch)
    }

    fn reset(&mut self) -> Result<(), SourceError> {
        self.maybe_explode(SourceCall::Reset, 0);
        self.inner.reset()
    }
}

/// A gate the test opens once it has checked what happens while the source is stuck.
#[derive(Clone, Default)]
pub(crate) struct Gate(Arc<(Mutex<bool>, Condvar)>);

impl Gate {
    pub(crate) fn open(&self) {
        *self.0 .0.lock().unwrap() = true;
        self.0 .1.notify_all();
    }

    pub(crate) fn wait(&self) {
        let (lock, cond) = &*self.0;
        let _open = cond.wait_while(lock.lock().unwrap(), |open| !*open).unwrap();
    }
}

/// What a [`Stuck`] source tells the test.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Note {
    /// It entered `fill` for the batch and waits at the gate.
    Entered(usize),
    /// It came back from the gate and filled its batch (the prefetcher may be gone by
    /// then: the batch's memory must still be there; valgrind checks the writes).
    Filled(usize),
    /// It was dropped (by whichever thread held it last).
    Dropped,
}

/// `inner`, whose `fill` of batch `stuck_at` in the first epoch waits at the gate.
pub(crate) struct Stuck<S> {
    inner: S,
    stuck_at: usize,
    gate: Gate,
    notes: Sender<Note>,
    epoch: u64,
}

impl<S: BatchSource> BatchSource for Stuck<S> {
    fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
        self.inner.next_layout(index)
    }

    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
        let index = batch.index();
        if (self.epoch, index) != (0, self.stuck_at) {
            return self.inner.fill(batch);
        }
        let _ = self.notes.send(Note::Entered(index));
        self.gate.wait();
        self.inner.fill(batch)?;
        let _ = self.notes.send(Note::Filled(index));
        Ok(())
    }

    fn reset(&mut self) -> Result<(), SourceError> {
        self.epoch += 1;
        self.inner.reset()
    }
}

impl<S> Drop for Stuck<S> {
    fn drop(&mut self) {
        let _ = self.notes.send(Note::Dropped);
    }
}

/// `inner` stuck at `stuck_at`, the gate that frees it and what it tells the test.
pub(crate) fn stuck_source<S>(inner: S, stuck_at: usize) -> (Stuck<S>, Gate, Receiver<Note>) {
    let (notes, noted) = mpsc::channel();
    let gate = Gate::default();
    (Stuck { inner, stuck_at, gate: gate.clone(), notes, epoch: 0 }, gate, noted)
}
