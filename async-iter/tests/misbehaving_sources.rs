//! Sources that misbehave in ways a safe `BatchSource` may: panics whose payload
//! panics again when dropped, a call that never returns. Each must end as a typed error
//! at its batch or a bounded wait, never as a panic escaping `next()`, a prefetcher
//! that cannot be used again, or a drop that hangs.
//!
//! Every wait on the code under test runs on a watchdog thread, so a regression fails
//! the test instead of hanging it.

use std::panic::{self, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread;
use std::time::{Duration, Instant};

use async_iter::{BatchLayout, BatchMut, BatchSource, Error, Prefetcher, SourceCall, SourceError, Threading};
use ndarray::Ix1;

#[path = "common/misbehaving.rs"]
mod misbehaving;

use misbehaving::{Bomb, Detonating, Gate, Note, Stuck};

/// Longest any single call of the code under test may take before the test calls it hung.
const HUNG: Duration = Duration::from_secs(20);

/// Runs `f` on another thread and returns its result, or fails the test if it has not
/// returned within [`HUNG`] (the thread is left behind).
fn within_bound<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (done, finished) = mpsc::channel();
    let worker = thread::spawn(move || {
        let _ = done.send(f());
    });
    match finished.recv_timeout(HUNG) {
        Ok(value) => {
            worker.join().unwrap();
            value
        }
        Err(RecvTimeoutError::Disconnected) => match worker.join() {
            Err(payload) => panic::resume_unwind(payload),
            Ok(()) => unreachable!("the worker sends before it returns"),
        },
        Err(RecvTimeoutError::Timeout) => panic!("{what} hung for {HUNG:?}"),
    }
}

// ---- panics whose payload panics when dropped ---------------------------------------------

/// Four `u32` batches per epoch, each filled with its index and epoch (the source
/// [`Detonating`] wraps).
struct Indexed {
    epoch: u64,
}

impl BatchSource for Indexed {
    fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
        Ok((index < 4).then(|| BatchLayout::new().features::<u32, _>(16)))
    }

    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
        batch.features::<u32, Ix1>()?.fill(batch.index() as u32 + 100 * self.epoch as u32);
        Ok(())
    }

    fn reset(&mut self) -> Result<(), SourceError> {
        self.epoch += 1;
        Ok(())
    }
}

fn detonating(call: SourceCall, at: usize) -> Detonating<Indexed> {
    Detonating::new(Indexed { epoch: 0 }, call, at)
}

/// The indices of the batches of the current epoch, checking their contents.
fn drain(batches: &mut Prefetcher<Detonating<Indexed>>, epoch: u32) -> Vec<usize> {
    let mut seen = Vec::new();
    while let Some(batch) = batches.next() {
        let batch = batch.unwrap();
        let features = batch.features::<u32, Ix1>().unwrap();
        assert!(features.iter().all(|&v| v == batch.index() as u32 + 100 * epoch), "batch {}", batch.index());
        seen.push(batch.index());
    }
    seen
}

#[test]
fn a_panic_whose_payload_panics_on_drop_is_source_panicked_at_its_batch() {
    for threading in [Threading::Shield, Threading::Background] {
        for (call, at) in [(SourceCall::Fill, 2), (SourceCall::NextLayout, 1), (SourceCall::Fill, 0)] {
            let case = format!("{threading:?}, {call} at batch {at}");
            let outcome = panic::catch_unwind(AssertUnwindSafe(|| {
                let source = detonating(call, at);
                let mut batches = Prefetcher::builder(source).threading(threading).build().unwrap();
                for index in 0..at {
                    assert_eq!(batches.next().unwrap().unwrap().index(), index, "{case}");
                }
                match batches.next() {
                    Some(Err(Error::SourcePanicked { epoch: 0, batch, call: c, message })) => {
                        assert_eq!((batch, c), (at, call), "{case}");
                        assert!(message.contains("not a string"), "{case}: {message}");
                    }
                    other => panic!("{case}: expected SourcePanicked at batch {at}, got {other:?}"),
                }
                assert!(batches.next().is_none(), "{case}: the epoch is over");
                batches.reset().unwrap_or_else(|err| panic!("{case}: the prefetcher resets: {err}"));
                assert_eq!(drain(&mut batches, 1), [0, 1, 2, 3], "{case}: the next epoch runs in full");
            }));
            if let Err(payload) = outcome {
                // A payload of the test's own assertions is a `String`; anything else is
                // the source's panic (or its payload's) that escaped the prefetcher.
                match payload.downcast::<String>() {
                    Ok(message) => panic!("{message}"),
                    Err(payload) => {
                        std::mem::forget(payload); // a `Bomb`: dropping it would panic again
                        panic!("{case}: the source's panic escaped `next()`");
                    }
                }
            }
        }
    }
}

#[test]
fn a_panic_in_reset_whose_payload_panics_on_drop_is_an_error_of_reset() {
    for threading in [Threading::Shield, Threading::Background] {
        let source = detonating(SourceCall::Reset, 0);
        let mut batches = Prefetcher::builder(source).threading(threading).build().unwrap();
        assert_eq!(drain(&mut batches, 0), [0, 1, 2, 3]);
        let outcome = panic::catch_unwind(AssertUnwindSafe(|| batches.reset()));
        let Ok(reset) = outcome else {
            panic!("{threading:?}: the panic of the source's reset escaped `reset()`");
        };
        match reset {
            Err(Error::SourcePanicked { call: SourceCall::Reset, epoch: 1, batch: 0, .. }) => {}
            other => panic!("{threading:?}: expected SourcePanicked in reset, got {other:?}"),
        }
        assert!(batches.next().is_none(), "{threading:?}: no epoch after a failed reset");
        batches.reset().unwrap();
        assert_eq!(drain(&mut batches, 1), [0, 1, 2, 3], "{threading:?}: the next reset works");
    }
}

// ---- a source stuck in `fill` -------------------------------------------------------------

/// Batches of 4096 bytes, each filled with its index and epoch and read back intact (the
/// source [`Stuck`] wraps).
struct Bytes {
    epoch: u64,
}

impl BatchSource for Bytes {
    fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
        Ok((index < 6).then(|| BatchLayout::new().features::<u8, _>(4096)))
    }

    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
        let value = (batch.index() + 10 * self.epoch as usize) as u8;
        let mut features = batch.features::<u8, Ix1>()?;
        features.fill(value);
        assert!(features.iter().all(|&v| v == value));
        Ok(())
    }

    fn reset(&mut self) -> Result<(), SourceError> {
        self.epoch += 1;
        Ok(())
    }
}

/// [`Bytes`], whose `fill` of batch `stuck_at` in epoch 0 waits at the gate.
fn stuck_source(stuck_at: usize) -> (Stuck<Bytes>, Gate, Receiver<Note>) {
    misbehaving::stuck_source(Bytes { epoch: 0 }, stuck_at)
}

fn expect_note(noted: &Receiver<Note>, note: Note) {
    assert_eq!(noted.recv_timeout(HUNG).ok(), Some(note));
}

/// The join timeout of these tests: short, so that they run quickly.
const JOIN_TIMEOUT: Duration = Duration::from_millis(200);

#[test]
fn dropping_a_prefetcher_whose_source_is_stuck_in_fill_returns() {
    for depth in [1, 2] {
        let (source, gate, noted) = stuck_source(1);
        let mut batches = Prefetcher::builder(source).depth(depth).join_timeout(JOIN_TIMEOUT).build().unwrap();
        assert_eq!(batches.next().unwrap().unwrap().index(), 0);
        expect_note(&noted, Note::Entered(1));
        let started = Instant::now();
        within_bound("dropping the prefetcher", move || drop(batches));
        let waited = started.elapsed();
        assert!(waited >= JOIN_TIMEOUT, "drop gave the source its join timeout ({waited:?})");
        // The thread is detached, still inside `fill`, and still owns the source.
        assert_eq!(noted.try_recv().ok(), None, "the stuck thread still holds the source");
        gate.open();
        // It writes its batch into memory that is still alive, then ends and drops the
        // source (and the ring) on its own.
        expect_note(&noted, Note::Filled(1));
        expect_note(&noted, Note::Dropped);
    }
}

/// `batches.reset()` on a watchdog thread; the prefetcher comes back with the result.
fn reset_within_bound(mut batches: Prefetcher<Stuck<Bytes>>) -> (Prefetcher<Stuck<Bytes>>, Result<(), Error>) {
    within_bound("reset", move || {
        let reset = batches.reset();
        (batches, reset)
    })
}

/// Checks that `err` says the source is stuck in `fill` at `batch` of epoch 0.
fn assert_stuck_in_fill(err: &Error, batch: usize) {
    match err {
        Error::SourceStuck { source_type, epoch: 0, batch: b, call: Some(SourceCall::Fill), waited } => {
            assert_eq!(*source_type, std::any::type_name::<Stuck<Bytes>>());
            assert_eq!((*b, *waited), (batch, JOIN_TIMEOUT));
        }
        other => panic!("expected SourceStuck in fill at batch {batch}, got {other:?}"),
    }
    let text = err.to_string();
    for part in [
        "misbehaving_sources::misbehaving::Stuck<misbehaving_sources::Bytes>",
        "`fill` for batch",
        "of epoch 0",
        "200ms",
        "reset()",
    ] {
        assert!(text.contains(part), "the message names {part:?}: {text}");
    }
}

#[test]
fn reset_and_stop_with_a_source_stuck_in_fill_fail_in_bounded_time_then_work_once_it_returns() {
    let (source, gate, noted) = stuck_source(2);
    let mut batches = Prefetcher::builder(source).depth(1).join_timeout(JOIN_TIMEOUT).build().unwrap();
    for index in 0..2 {
        assert_eq!(batches.next().unwrap().unwrap().index(), index);
    }
    expect_note(&noted, Note::Entered(2));
    let started = Instant::now();
    let (mut batches, reset) = reset_within_bound(batches);
    assert!(started.elapsed() >= JOIN_TIMEOUT, "reset waited its join timeout");
    assert_stuck_in_fill(&reset.expect_err("no new epoch while the source is stuck"), 2);
    assert!(batches.next().is_none(), "no epoch runs meanwhile");
    // Still stuck: a stop and a second reset fail the same way, in bounded time.
    let (batches, stop) = within_bound("stop", move || {
        let stop = batches.stop();
        (batches, stop)
    });
    assert_stuck_in_fill(&stop.expect_err("the source is still stuck"), 2);
    let (mut batches, reset) = reset_within_bound(batches);
    assert_stuck_in_fill(&reset.expect_err("the source is still stuck"), 2);
    assert!(batches.next().is_none());
    assert_eq!(noted.try_recv().ok(), None, "the source is neither done nor dropped");
    gate.open();
    expect_note(&noted, Note::Filled(2));
    // Once the source has returned, a later reset starts the next epoch in the same ring.
    let deadline = Instant::now() + HUNG;
    loop {
        let (returned, reset) = reset_within_bound(batches);
        batches = returned;
        match reset {
            Ok(()) => break,
            // A loaded machine (or valgrind) may not have run the thread to its end yet.
            Err(Error::SourceStuck { .. }) if Instant::now() < deadline => {}
            Err(err) => panic!("reset fails after the source returned: {err}"),
        }
    }
    let mut seen = Vec::new();
    while let Some(batch) = batches.next() {
        let batch = batch.unwrap();
        let features = batch.features::<u8, Ix1>().unwrap();
        assert!(features.iter().all(|&v| v as usize == batch.index() + 10), "batch {} of epoch 1", batch.index());
        seen.push(batch.index());
    }
    assert_eq!(seen, [0, 1, 2, 3, 4, 5], "the epoch after the stuck one runs in full");
    assert_eq!(batches.stats().ring_growths, 0);
    drop(batches);
    expect_note(&noted, Note::Dropped);
}

#[test]
fn dropping_after_a_reset_timed_out_does_not_wait_again() {
    // A long join timeout: a drop that waited for it again would show.
    let long = Duration::from_secs(3);
    let (source, gate, noted) = stuck_source(0);
    let mut batches = Prefetcher::builder(source).join_timeout(long).build().unwrap();
    expect_note(&noted, Note::Entered(0));
    let (batches, reset) = within_bound("reset", move || {
        let reset = batches.reset();
        (batches, reset)
    });
    assert!(matches!(reset, Err(Error::SourceStuck { batch: 0, call: Some(SourceCall::Fill), .. })), "{reset:?}");
    let started = Instant::now();
    within_bound("dropping the prefetcher", move || drop(batches));
    let waited = started.elapsed();
    assert!(waited < long / 2, "the drop waited {waited:?} after the reset had waited {long:?}");
    gate.open();
    expect_note(&noted, Note::Filled(0));
    expect_note(&noted, Note::Dropped);
}

/// Batches of one `u8`; `fill` blocks on the gate, and dropping the source panics with
/// a [`Bomb`].
struct StuckAndDetonating {
    gate: Gate,
    notes: Sender<Note>,
}

impl BatchSource for StuckAndDetonating {
    fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
        Ok((index < 2).then(|| BatchLayout::new().features::<u8, _>(1)))
    }

    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
        let _ = self.notes.send(Note::Entered(batch.index()));
        self.gate.wait();
        Ok(())
    }
}

impl Drop for StuckAndDetonating {
    fn drop(&mut self) {
        let _ = self.notes.send(Note::Dropped);
        panic::panic_any(Bomb);
    }
}

#[test]
fn a_detached_thread_contains_the_panic_of_the_source_it_drops() {
    let (notes, noted) = mpsc::channel();
    let gate = Gate::default();
    let source = StuckAndDetonating { gate: gate.clone(), notes };
    let batches = Prefetcher::builder(source).join_timeout(JOIN_TIMEOUT).build().unwrap();
    expect_note(&noted, Note::Entered(0));
    within_bound("dropping the prefetcher", move || drop(batches));
    gate.open();
    // The thread drops the source, whose destructor panics with a payload that panics
    // again: the thread contains both, and the process goes on.
    expect_note(&noted, Note::Dropped);
}

// ---- a source whose answers are wrong ------------------------------------------------------

/// Asks for its arrays with the wrong types, twice, or absent, ignoring the errors, and
/// describes batch 1 with a layout already laid out for another batch (offsets and all).
struct Lying {
    borrowed: async_iter::DetachedBatch,
}

impl BatchSource for Lying {
    fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
        Ok(match index {
            0 => Some(BatchLayout::new().features::<u32, _>((4, 4))),
            1 => Some(*self.borrowed.layout()),
            _ => None,
        })
    }

    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
        assert!(batch.features::<u8, Ix1>().is_err(), "wrong element type");
        assert!(batch.features::<u32, ndarray::Ix3>().is_err(), "wrong dimensionality");
        assert!(batch.labels_mask::<u32, Ix1>().is_err(), "no such array");
        let mut features = batch.features::<u32, ndarray::IxDyn>()?;
        assert!(batch.features::<u32, ndarray::IxDyn>().is_err(), "already borrowed");
        features.fill(batch.index() as u32 + 1);
        Ok(())
    }
}

#[test]
fn wrong_answers_of_a_source_are_errors_or_its_own_data_never_other_memory() {
    // A layout laid out for a batch of another shape: the prefetcher lays out every
    // layout itself, whatever the source hands it.
    let other = BatchLayout::new().features::<u32, _>(1000).labels::<u64, _>(3);
    let borrowed = async_iter::DetachedBatch::read_from(other, 7, 0, |_| Ok::<_, Error>(())).unwrap();
    for threading in [Threading::Shield, Threading::Background] {
        let source = Lying { borrowed: borrowed.clone() };
        let mut batches = Prefetcher::builder(source).threading(threading).build().unwrap();
        let sums: Vec<_> = std::iter::from_fn(|| {
            let batch = batches.next()?.unwrap();
            let features = batch.features::<u32, ndarray::IxDyn>().unwrap();
            let labels = batch.labels::<u64, Ix1>().ok().map(|labels| labels.sum());
            Some((features.shape().to_vec(), features.sum(), labels, batch.bytes()))
        })
        .collect();
        assert_eq!(
            sums,
            // Batch 1: 4000 bytes of features (to 4032), then 24 of labels, unfilled (to 4096).
            [(vec![4, 4], 16, None, 64), (vec![1000], 2000, Some(0), 4096)],
            "{threading:?}"
        );
    }
}
