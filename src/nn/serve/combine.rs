//! Flat combining of independent callers' steps over one shared engine (a
//! [`StreamBatch`](super::StreamBatch)'s arena and its streams).
//!
//! Each caller owns a slot. To step, it marks its slot requested and then, while its
//! result is not there: if the engine is idle and the batch is complete (every reserved
//! slot requested but those whose thread is itself waiting for another slot's step, or
//! `max_wait` gone since the first request of the batch), it takes
//! the engine out of the shared state, marks every requested slot running, and runs
//! them all as one batch with the lock released; then it posts each slot's result, puts
//! the engine back and wakes every waiter. Otherwise it waits. The last caller to
//! queue, or the first whose wait runs out, does the work of all who wait (Hendler,
//! Incze, Shavit and Tzafrir, "Flat Combining and the Synchronization-Parallelism
//! Tradeoff", SPAA 2010), so steps of independent callers go together, with no thread
//! of the pool's own and no wake-up per request.
//!
//! **Nothing is lost.** The engine is out of the state only while its taker runs a batch
//! or a closure of its own ([`Combiner::with_engine`]), and it is put back whatever
//! that code does: a failure or a panic of the batch is posted to every slot of the
//! batch as a typed error, and the panic of a closure goes on in its caller after the
//! engine is back. A slot's result is taken only by its owner; a slot left
//! ([`Combiner::leave`]) is free for the next caller. No memory is shared but through
//! the lock: the engine moves in and out of it.
//!
//! **A thread does not wait for itself.** Each slot records the thread that last stepped
//! it (or joined with it, [`Combiner::claim`]). A thread waiting for one slot's step
//! cannot step its other slots meanwhile, so a batch does not wait for them: one thread
//! stepping several streams in turn runs each step at once, rather than after `max_wait`.
//! A stream moved to another thread before it steps there is then waited for no longer
//! than its former thread's next step: a batch that goes without it, never a lost step.
//!
//! Nothing is allocated per step: the batch's membership and results are buffers that
//! move with the engine (a failure's message, and each report of it, allocate).
//!
//! Its loom models are in `src/nn/loom.rs`.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use async_iter::panics::{drop_quietly, panic_message};
use std::time::Duration;

use async_iter::sync::{self, Condvar, Deadline, Mutex, ThreadId};

use crate::{Error, Result};

/// How long a join with no timeout waits while every slot holds a stream of its own
/// thread (or a forgotten one) before it is refused as a wait for itself
/// ([`Combiner::reserve`]): long enough for streams the thread handed to others to take
/// a step there (which makes them those threads').
pub(crate) const SELF_WAIT_GRACE: Duration = Duration::from_secs(1);

/// The engine and the buffers of the batch it runs, moved out of the lock together.
struct Held<E> {
    engine: E,
    /// Which slots are in the batch.
    batch: Vec<bool>,
    /// Each slot's result of the batch: its value, or its own failure (`None`: not
    /// written by the run, itself a failure).
    results: Vec<Option<Result<u32>>>,
}

/// A batch's run: over the engine, which slots are in the batch, and a result per slot
/// to write, each of the batch's `None` until it is (a slot's error fails that slot
/// alone; the run's error, every slot of the batch).
pub(crate) type RunBatch<'r, E> = dyn FnMut(&mut E, &[bool], &mut [Option<Result<u32>>]) -> Result<()> + 'r;

/// Where a slot stands.
#[derive(Debug)]
enum Slot {
    /// Free to reserve.
    Vacant,
    /// Reserved by a caller, and not yet requesting.
    Idle,
    /// Waiting to be taken into a batch.
    Requested,
    /// In the batch that runs.
    Running,
    /// Its batch ran: the result, for its owner to take.
    Done(u32),
    /// A batch it was in failed; every later request fails alike.
    Failed(Failure),
}

/// Why a batch failed, posted to each of its slots, or why one slot's step failed.
#[derive(Clone, Debug)]
struct Failure {
    panicked: bool,
    message: String,
    /// The slot's own failure, not its batch's.
    own: bool,
}

impl Failure {
    fn of(error: &Error, own: bool) -> Failure {
        match error {
            Error::Panicked { message } => Failure { panicked: true, message: message.clone(), own },
            other => Failure { panicked: false, message: other.to_string(), own },
        }
    }

    fn error(&self) -> Error {
        let whose = if self.own { "this stream's step" } else { "a step of this stream's batch" };
        if self.panicked {
            Error::Panicked { message: self.message.clone() }
        } else {
            Error::InvalidInput(format!("{whose} failed ({}); the stream is over: start a new one", self.message))
        }
    }
}

struct State<E> {
    /// The engine, `None` while a caller runs it.
    held: Option<Held<E>>,
    slots: Vec<Slot>,
    /// Each slot's thread: the one that last stepped it or claimed it (`None`: none
    /// yet, or the slot is vacant).
    owners: Vec<Option<ThreadId>>,
    /// When the queued steps' batch goes whoever has not queued yet: `max_wait` after
    /// the first of them was queued.
    due: Option<Deadline>,
    /// Whether `due` was put off once already by a use of the engine outside a batch
    /// (see [`Combiner::with_engine`]): it is put off at most once per batch.
    put_off: bool,
}

/// Callers' steps over one engine, each caller's in a slot, combined into batches.
pub(crate) struct Combiner<E> {
    state: Mutex<State<E>>,
    max_wait: Duration,
    /// A batch's results posted, the engine put back, or a slot left: for the callers
    /// that wait for a result or for the engine.
    changed: Condvar,
    /// A slot left: for the callers that wait for one (not woken at every step).
    vacated: Condvar,
}

impl<E> State<E> {
    /// Whether no slot's step is still to come: each slot is queued (or vacant), or its
    /// thread waits for a step of another slot (and so cannot step this one meanwhile).
    fn complete(&self) -> bool {
        let pending = |s: &Slot| matches!(s, Slot::Idle | Slot::Done(_));
        if !self.slots.iter().any(pending) {
            return true;
        }
        let waiting = |thread: ThreadId| {
            self.slots.iter().zip(&self.owners).any(|(s, o)| matches!(s, Slot::Requested) && *o == Some(thread))
        };
        self.slots.iter().zip(&self.owners).all(|(s, owner)| !pending(s) || owner.is_some_and(waiting))
    }
}

impl<E> Combiner<E> {
    /// `engine` with `slots` slots, all vacant. A batch runs once every stream in a slot
    /// has queued its step, or `max_wait` after the first step was queued, whichever
    /// comes first (0: as soon as the engine is idle, with whatever is queued).
    pub(crate) fn new(engine: E, slots: usize, max_wait: Duration) -> Combiner<E> {
        let held = Held { engine, batch: vec![false; slots], results: (0..slots).map(|_| None).collect() };
        let owners = vec![None; slots];
        let slots = (0..slots).map(|_| Slot::Vacant).collect();
        let state = Mutex::new(State { held: Some(held), slots, owners, due: None, put_off: false });
        Combiner { state, max_wait, changed: Condvar::new(), vacated: Condvar::new() }
    }

    /// The number of slots.
    pub(crate) fn slots(&self) -> usize {
        sync::lock(&self.state).slots.len()
    }

    /// The slots in use.
    pub(crate) fn in_use(&self) -> usize {
        sync::lock(&self.state).slots.iter().filter(|s| !matches!(s, Slot::Vacant)).count()
    }

    /// The slots waiting to be taken into a batch.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn requested(&self) -> usize {
        sync::lock(&self.state).slots.iter().filter(|s| matches!(s, Slot::Requested)).count()
    }

    /// Reserves a vacant slot, waiting until `deadline` (`None`: as long as it takes)
    /// while every slot is in use; `Ok(None)` when none came free in time.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] when there is no deadline and every slot has been the
    /// calling thread's (its streams, or forgotten ones) for [`SELF_WAIT_GRACE`] with
    /// none of them freed: it would wait for itself. (A stream moved to another thread
    /// counts as this thread's until it steps there: the grace lets a thread that hands
    /// its streams to others join again once they have.)
    pub(crate) fn reserve(&self, deadline: Option<Deadline>) -> Result<Option<usize>> {
        let mut state = sync::lock(&self.state);
        // Since when every slot has been this thread's, with no slot freed.
        let mut mine_since: Option<Deadline> = None;
        loop {
            if let Some(s) = state.slots.iter().position(|s| matches!(s, Slot::Vacant)) {
                state.slots[s] = Slot::Idle;
                return Ok(Some(s));
            }
            let me = Some(sync::current().id());
            let all_mine = state.owners.iter().all(|&owner| owner == me);
            if !all_mine {
                mine_since = None;
            }
            state = match deadline {
                None if all_mine => {
                    let grace = *mine_since.get_or_insert_with(|| Deadline::after(SELF_WAIT_GRACE));
                    match grace.remaining() {
                        // A slot freed wakes this wait; a stream stepping on another
                        // thread is seen when it ends.
                        Some(left) => sync::wait_timeout(&self.vacated, state, left),
                        None => {
                            return Err(Error::InvalidInput(format!(
                                "every slot of the stream batch ({}) holds a stream of this thread (or a forgotten \
                                 one), and none came free in {SELF_WAIT_GRACE:?}: waiting for one would wait for \
                                 itself; drop a stream first, or use join_timeout",
                                state.slots.len()
                            )))
                        }
                    }
                }
                None => sync::wait(&self.vacated, state),
                Some(deadline) => match deadline.remaining() {
                    Some(left) => sync::wait_timeout(&self.vacated, state, left),
                    None => return Ok(None),
                },
            };
        }
    }

    /// Records the calling thread as `slot`'s, as a step of it does: while this thread
    /// waits for a step of another slot, batches do not wait for this one.
    pub(crate) fn claim(&self, slot: usize) {
        sync::lock(&self.state).owners[slot] = Some(sync::current().id());
    }

    /// Frees `slot` (its owner's last call).
    pub(crate) fn leave(&self, slot: usize) {
        let mut state = sync::lock(&self.state);
        state.slots[slot] = Slot::Vacant;
        state.owners[slot] = None;
        drop(state);
        self.vacated.notify_all();
        // A batch that waited for this slot's stream may be complete now.
        self.changed.notify_all();
    }

    /// Runs `f` on the engine alone, waiting while a batch runs (a slot's start, a read
    /// of a slot's state). A panic of `f` goes on once the engine is back.
    pub(crate) fn with_engine<R>(&self, f: impl FnOnce(&mut E) -> R) -> R {
        let mut state = sync::lock(&self.state);
        let mut held = loop {
            match state.held.take() {
                Some(held) => break held,
                None => state = sync::wait(&self.changed, state),
            }
        };
        drop(state);
        let result = catch_unwind(AssertUnwindSafe(|| f(&mut held.engine)));
        let mut state = sync::lock(&self.state);
        state.held = Some(held);
        // Steps queued before a use of the engine that outlasted their deadline (a join's
        // prompt, say) wait for the others from its end, rather than going alone and
        // splitting the batch; once per batch, so that callers that read a slot's state
        // or join more often than `max_wait` cannot put a waiting batch off for as long
        // as they go on.
        let queued = state.slots.iter().any(|s| matches!(s, Slot::Requested));
        let passed = state.due.is_none_or(|due| due.remaining().is_none());
        if queued && passed && !state.put_off {
            state.due = Some(Deadline::after(self.max_wait));
            state.put_off = true;
        }
        drop(state);
        self.changed.notify_all();
        result.unwrap_or_else(|panic| resume_unwind(panic))
    }

    /// [`Combiner::with_engine`] for the owner of `slot`, unless a batch of the slot's
    /// failed.
    ///
    /// # Errors
    ///
    /// The slot's failure, as [`Combiner::next`] gives it; `f`'s.
    pub(crate) fn with_slot<R>(&self, slot: usize, f: impl FnOnce(&mut E) -> Result<R>) -> Result<R> {
        if let Slot::Failed(failure) = &sync::lock(&self.state).slots[slot] {
            return Err(failure.error());
        }
        self.with_engine(f)
    }

    /// The next result of `slot`: the slot is requested, and its caller runs batches
    /// with `run` (over the engine, which slots are in the batch, and a result per slot
    /// to write) whenever it finds the engine idle, until the slot's is posted. A
    /// batch's error or panic is every slot's of the batch, a slot's own error its
    /// alone, then and at every later request.
    ///
    /// # Errors
    ///
    /// The slot's failure or its batch's, as [`Error::Panicked`] for a panic, or
    /// [`Error::InvalidInput`] saying what failed; [`Error::InvalidInput`] for a slot
    /// that is not reserved.
    pub(crate) fn next(&self, slot: usize, run: &mut RunBatch<'_, E>) -> Result<u32> {
        let mut state = sync::lock(&self.state);
        match &state.slots[slot] {
            Slot::Idle => {
                state.slots[slot] = Slot::Requested;
                state.owners[slot] = Some(sync::current().id());
                if state.due.is_none() {
                    state.due = Some(Deadline::after(self.max_wait));
                }
            }
            Slot::Failed(failure) => return Err(failure.error()),
            other => return Err(Error::InvalidInput(format!("slot {slot} is {other:?}, not a caller's to step"))),
        }
        loop {
            match std::mem::replace(&mut state.slots[slot], Slot::Idle) {
                Slot::Done(result) => return Ok(result),
                Slot::Failed(failure) => {
                    let error = failure.error();
                    state.slots[slot] = Slot::Failed(failure);
                    return Err(error);
                }
                other => state.slots[slot] = other,
            }
            if state.held.is_none() {
                state = sync::wait(&self.changed, state);
                continue;
            }
            // Every stream in a slot queued (none between its steps, none with a result
            // it has not taken, but those whose thread waits for a step of its own), or
            // the first queued has waited long enough: the batch goes. Otherwise the last
            // to queue, or the deadline, will run it. (The last to queue finds the batch
            // complete itself: no one is woken per step.)
            let complete = state.complete();
            let left = state.due.and_then(|due| due.remaining());
            if let (false, Some(left)) = (complete, left) {
                state = sync::wait_timeout(&self.changed, state, left);
                continue;
            }
            let mut held = state.held.take().expect("checked above");
            state.due = None;
            state.put_off = false;
            for (s, member) in state.slots.iter_mut().zip(held.batch.iter_mut()) {
                *member = matches!(s, Slot::Requested);
                if *member {
                    *s = Slot::Running;
                }
            }
            drop(state);
            let Held { engine, batch, results } = &mut held;
            // A result the run does not write is not one of an earlier batch's.
            results.iter_mut().for_each(|r| *r = None);
            let outcome = catch_unwind(AssertUnwindSafe(|| run(engine, batch, results)));
            let failure = match outcome {
                Ok(Ok(())) => None,
                Ok(Err(error)) => Some(Failure::of(&error, false)),
                Err(panic) => {
                    let message = panic_message(&*panic);
                    // A payload whose drop panics too must not unwind past the engine's
                    // return.
                    drop_quietly(panic);
                    Some(Failure { panicked: true, message, own: false })
                }
            };
            state = sync::lock(&self.state);
            for (s, (slot, &member)) in state.slots.iter_mut().zip(&held.batch).enumerate() {
                if member {
                    *slot = match (&failure, &held.results[s]) {
                        (None, Some(Ok(result))) => Slot::Done(*result),
                        (None, Some(Err(error))) => Slot::Failed(Failure::of(error, true)),
                        (None, None) => Slot::Failed(Failure {
                            panicked: false,
                            message: format!("the batch's run gave slot {s} no result"),
                            own: true,
                        }),
                        (Some(failure), _) => Slot::Failed(failure.clone()),
                    };
                }
            }
            state.held = Some(held);
            // Steps queued while this batch ran wait for the rest of theirs from now, not
            // from when they queued (or a step longer than `max_wait` would split the
            // callers into batches that alternate for good).
            if state.slots.iter().any(|s| matches!(s, Slot::Requested)) {
                state.due = Some(Deadline::after(self.max_wait));
            }
            self.changed.notify_all();
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A batch's results: the batch's number and the slot, so that a result says which
    /// batch it came from.
    fn count(engine: &mut u32, batch: &[bool], results: &mut [Option<Result<u32>>]) -> Result<()> {
        *engine += 1;
        for (s, (&member, result)) in batch.iter().zip(results).enumerate() {
            if member {
                *result = Some(Ok(*engine * 100 + s as u32));
            }
        }
        Ok(())
    }

    #[test]
    fn each_caller_gets_its_own_result_and_batches_combine_what_waits() {
        let combiner = Arc::new(Combiner::new(0u32, 4, Duration::ZERO));
        let slots: Vec<usize> = (0..4).map(|_| combiner.reserve(None).unwrap().unwrap()).collect();
        assert_eq!(combiner.in_use(), 4);
        assert_eq!(combiner.reserve(Some(Deadline::after(Duration::ZERO))).unwrap(), None, "every slot is in use");
        let threads: Vec<_> = slots
            .into_iter()
            .map(|slot| {
                let combiner = Arc::clone(&combiner);
                std::thread::spawn(move || {
                    (0..50).map(|_| combiner.next(slot, &mut count).unwrap()).collect::<Vec<u32>>()
                })
            })
            .collect();
        let results: Vec<Vec<u32>> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let batches = combiner.with_engine(|e| *e);
        for (slot, results) in results.iter().enumerate() {
            assert!(results.iter().all(|r| r % 100 == slot as u32), "slot {slot}: {results:?}");
            // Each of a slot's results from a later batch than the one before.
            assert!(results.windows(2).all(|w| w[0] / 100 < w[1] / 100), "slot {slot}: {results:?}");
        }
        assert!((50..=200).contains(&batches), "{batches} batches for 200 steps");
    }

    #[test]
    fn requests_that_arrive_while_the_engine_is_busy_run_as_one_batch() {
        let combiner = Combiner::new(0u32, 3, Duration::ZERO);
        let slots: Vec<usize> = (0..3).map(|_| combiner.reserve(None).unwrap().unwrap()).collect();
        let combiner = &combiner;
        let results = std::thread::scope(|scope| {
            let (held, holds) = std::sync::mpsc::channel();
            // The engine is busy until two callers have queued their steps.
            let busy = scope.spawn(move || {
                combiner.with_engine(|_| {
                    held.send(()).unwrap();
                    let waited = std::time::Instant::now();
                    while combiner.requested() < 2 {
                        assert!(waited.elapsed() < Duration::from_secs(10), "the callers never queued");
                        std::thread::yield_now();
                    }
                })
            });
            holds.recv().unwrap();
            let callers: Vec<_> =
                slots[..2].iter().map(|&slot| scope.spawn(move || combiner.next(slot, &mut count))).collect();
            busy.join().unwrap();
            callers.into_iter().map(|c| c.join().unwrap().unwrap()).collect::<Vec<u32>>()
        });
        // One batch, the first, ran both.
        assert_eq!(results, [100 + slots[0] as u32, 100 + slots[1] as u32]);
        assert_eq!(combiner.next(slots[2], &mut count).unwrap(), 200 + slots[2] as u32);
    }

    #[test]
    fn a_batch_waits_at_most_max_wait_for_the_streams_that_have_not_queued() {
        let max_wait = Duration::from_millis(30);
        let combiner = Combiner::new(0u32, 3, max_wait);
        let slots: Vec<usize> = (0..3).map(|_| combiner.reserve(None).unwrap().unwrap()).collect();
        // The others never queue: the step goes alone once the wait is over.
        let started = std::time::Instant::now();
        assert_eq!(combiner.next(slots[0], &mut count).unwrap(), 100 + slots[0] as u32);
        assert!(started.elapsed() >= max_wait, "{:?}", started.elapsed());
        // With the others gone, a lone stream's batch is complete at once: it waits for no one.
        combiner.leave(slots[1]);
        combiner.leave(slots[2]);
        let started = std::time::Instant::now();
        assert_eq!(combiner.next(slots[0], &mut count).unwrap(), 200 + slots[0] as u32);
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn a_thread_stepping_its_slots_in_turn_never_waits_for_itself() {
        // A wait that would be seen: each step must go at once, alone.
        let combiner = &Combiner::new(0u32, 3, Duration::from_secs(60));
        let (a, b) = (combiner.reserve(None).unwrap().unwrap(), combiner.reserve(None).unwrap().unwrap());
        combiner.claim(a);
        combiner.claim(b);
        let started = std::time::Instant::now();
        let results: Vec<u32> = [a, b, a, b].iter().map(|&slot| combiner.next(slot, &mut count).unwrap()).collect();
        assert!(started.elapsed() < Duration::from_secs(30), "a step waited: {:?}", started.elapsed());
        assert_eq!(results, [100 + a as u32, 200 + b as u32, 300 + a as u32, 400 + b as u32]);
        // A slot of another thread is still waited for (whether its thread has claimed it
        // yet or not), and both steps go as one batch.
        let c = combiner.reserve(None).unwrap().unwrap();
        let results = std::thread::scope(|scope| {
            let other = scope.spawn(|| {
                combiner.claim(c);
                combiner.next(c, &mut count)
            });
            let mine = combiner.next(a, &mut count).unwrap();
            (mine, other.join().unwrap().unwrap())
        });
        // Slot `b` (this thread's, idle) is not waited for; `c` is.
        assert_eq!(results, (500 + a as u32, 500 + c as u32));
    }

    #[test]
    fn a_step_queued_while_the_engine_was_busy_waits_for_the_others_from_its_return() {
        // A step queued while the engine is busy for longer than `max_wait` (a join's
        // prompt, a long step) still waits for the other streams once the engine is
        // back, rather than going alone and splitting the batch.
        let max_wait = Duration::from_millis(200);
        let combiner = &Combiner::new(0u32, 3, max_wait);
        let slots: Vec<usize> = (0..3).map(|_| combiner.reserve(None).unwrap().unwrap()).collect();
        let results = std::thread::scope(|scope| {
            let early = combiner.with_engine(|_| {
                let early = scope.spawn(|| combiner.next(slots[0], &mut count));
                let waited = std::time::Instant::now();
                while combiner.requested() < 1 {
                    assert!(waited.elapsed() < Duration::from_secs(10), "the caller never queued");
                    std::thread::yield_now();
                }
                std::thread::sleep(max_wait + Duration::from_millis(100));
                early
            });
            let late: Vec<_> =
                slots[1..].iter().map(|&slot| scope.spawn(move || combiner.next(slot, &mut count))).collect();
            let mut results = vec![early.join().unwrap().unwrap()];
            results.extend(late.into_iter().map(|c| c.join().unwrap().unwrap()));
            results
        });
        assert_eq!(results, slots.iter().map(|&s| 100 + s as u32).collect::<Vec<_>>(), "one batch of all three");
    }

    #[test]
    fn a_failed_or_panicking_batch_fails_its_slots_and_the_engine_goes_on() {
        let combiner = Combiner::new(0u32, 2, Duration::ZERO);
        let (a, b) = (combiner.reserve(None).unwrap().unwrap(), combiner.reserve(None).unwrap().unwrap());
        let panics = combiner.next(a, &mut |_, _, _| panic!("a layer broke"));
        assert!(matches!(&panics, Err(Error::Panicked { message }) if message.contains("a layer broke")), "{panics:?}");
        // The slot stays failed; the other slot and the engine go on.
        assert!(matches!(combiner.next(a, &mut count), Err(Error::Panicked { .. })));
        assert_eq!(combiner.next(b, &mut count).unwrap(), 100 + b as u32);
        let fails = combiner.next(b, &mut |_, _, _| Err(Error::InvalidInput("no".into())));
        assert!(matches!(&fails, Err(Error::InvalidInput(m)) if m.contains("no")), "{fails:?}");
        // Left and reserved again, a slot starts afresh.
        combiner.leave(a);
        assert_eq!(combiner.reserve(None).unwrap(), Some(a));
        assert_eq!(combiner.next(a, &mut count).unwrap(), 200 + a as u32);
        // A closure's panic goes on in its caller, the engine back in place.
        let caught = catch_unwind(AssertUnwindSafe(|| combiner.with_engine(|_| panic!("read"))));
        assert!(caught.is_err());
        assert_eq!(combiner.with_engine(|e| *e), 2);
        // A slot that is not reserved is not stepped.
        combiner.leave(b);
        assert!(matches!(combiner.next(b, &mut count), Err(Error::InvalidInput(_))));
    }

    #[test]
    fn a_slots_own_failure_fails_it_alone_in_its_batch() {
        // Two callers in one batch (it waits for both), whose run fails slot `a` only.
        let combiner = Combiner::new(0u32, 2, Duration::from_secs(60));
        let (a, b) = (combiner.reserve(None).unwrap().unwrap(), combiner.reserve(None).unwrap().unwrap());
        let fail_a = move |engine: &mut u32, batch: &[bool], results: &mut [Option<Result<u32>>]| {
            count(engine, batch, results)?;
            results[a] = Some(Err(Error::InvalidInput("slot a's logits are NaN".into())));
            Ok(())
        };
        let (got_a, got_b) = std::thread::scope(|scope| {
            let other = scope.spawn(|| combiner.next(b, &mut fail_a.clone()));
            (combiner.next(a, &mut fail_a.clone()), other.join().unwrap())
        });
        assert!(matches!(&got_a, Err(Error::InvalidInput(m)) if m.contains("NaN")), "{got_a:?}");
        assert_eq!(got_b.unwrap(), 100 + b as u32, "the other slot of the batch has its result");
        // `a` stays failed at every later request; `b` goes on alone.
        assert!(matches!(combiner.next(a, &mut count), Err(Error::InvalidInput(m)) if m.contains("NaN")));
        combiner.leave(a);
        assert_eq!(combiner.next(b, &mut count).unwrap(), 200 + b as u32);
        // A run that writes no result for a slot fails it, rather than posting an
        // earlier batch's.
        let silent = combiner.next(b, &mut |engine, _, _| {
            *engine += 1;
            Ok(())
        });
        assert!(matches!(&silent, Err(Error::InvalidInput(m)) if m.contains("no result")), "{silent:?}");
    }
}
