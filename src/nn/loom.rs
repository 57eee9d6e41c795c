//! Loom models of `carve::nn`'s concurrent protocols: every interleaving (up to
//! `LOOM_MAX_PREEMPTIONS` preemptions) of the code that ships, whose primitives come
//! from `async_iter::sync` and are loom's under `--cfg loom`. One protocol per model,
//! two or three threads, in the manner of tokio's `loom_oneshot.rs`:
//!
//! - the batcher's tickets: a caller's `submit` (and its leaving, on a timeout) against
//!   a worker's settle, with the close racing them; a request split across two batches
//!   against the close;
//! - the arenas' turns: a grant to the oldest waiter against a returning lease and the
//!   close; two arenas given back to two waiters (the wake-up passed on); a warm-up's
//!   reservation against a returning lease;
//! - the workers' barrier ([`Gate`]): a break against a turn;
//! - the inference pool's start ([`Latch`]): two batch workers arriving while the
//!   starter waits;
//! - the reducer's double-buffered buckets ([`Threads::reduce`]): two workers, two
//!   steps;
//! - a stream batch's flat combining ([`Combiner`]): two callers' steps, in one batch or
//!   two; a join's start and a leave against a step and a caller waiting for a slot;
//!   one thread stepping its slots in turn (it never waits for itself), and callers
//!   claiming their own slots (still one batch).
//!
//! Besides each model's assertion, loom fails a model on a deadlock (a park or wait
//! nobody ends) and on a leaked loom object.
//!
//! Time does not pass under loom: a zero timeout (or starving bound, or batching wait)
//! has expired at once, any other never does.
//!
//! Run (CI's bound): `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom LOOM_MAX_PREEMPTIONS=3 \
//!       cargo test -p carve --lib --release nn::loom`

use std::sync::Arc;
use std::time::Duration;

use async_iter::sync::AtomicBool;
use loom::thread;
use ndarray::Array2;
use std::sync::atomic::Ordering;

use super::parallel::reduce::{Reducer, Threads};
use super::serve::batcher::{BatchBuffers, Batcher};
use super::serve::combine::Combiner;
use super::serve::turns::{Counters, Turns, Wait};
use super::serve::PoolConfig;
use super::sync::{Gate, Latch};
use crate::Error;

/// A caller's request of one row, queued with a timeout that has expired at once,
/// against a worker that settles it and a close. Whatever the order, `submit` returns
/// only when no worker may write the caller's output any more: what the caller saw when
/// it returned is what its output holds once the other threads are done (and a success
/// holds the worker's result).
#[test]
fn a_request_returns_only_when_its_rows_are_no_longer_written() {
    loom::model(|| {
        let config = PoolConfig::batched(1, 2, Duration::ZERO);
        let batcher = Arc::new(Batcher::new(&config, 1, 1));
        let buffers = BatchBuffers::new(&config, 1).unwrap();
        let worker = {
            let batcher = Arc::clone(&batcher);
            thread::spawn(move || {
                batcher.work(
                    buffers,
                    || Ok(()),
                    |(), x, scatter| {
                        scatter(x.mapv(|v| v * 2.0).view());
                        Ok(())
                    },
                )
            })
        };
        let closer = {
            let batcher = Arc::clone(&batcher);
            thread::spawn(move || batcher.close())
        };
        let x = Array2::from_elem((1, 1), 3.0f32);
        let mut out = Array2::from_elem((1, 1), -1.0f32);
        let result = batcher.submit(x.view(), out.view_mut(), Wait::For(Duration::ZERO), &Counters::default());
        let seen = out[[0, 0]];
        worker.join().unwrap();
        closer.join().unwrap();
        assert!(out[[0, 0]] == seen && (result.is_err() || seen == 6.0), "{result:?}: saw {seen}, then {out}");
    });
}

/// A request of two rows, split across two batches of one row each (the worker takes a
/// ticket's rows in two goes), waiting without a deadline, against the close: it gets
/// both rows' results, or `PoolClosed` once no worker holds a row of it.
#[test]
fn a_request_split_across_batches_gets_every_row_or_the_close() {
    loom::model(|| {
        let config = PoolConfig::batched(1, 1, Duration::ZERO);
        let batcher = Arc::new(Batcher::new(&config, 1, 1));
        let buffers = BatchBuffers::new(&config, 1).unwrap();
        let worker = {
            let batcher = Arc::clone(&batcher);
            thread::spawn(move || {
                batcher.work(
                    buffers,
                    || Ok(()),
                    |(), x, scatter| {
                        scatter(x.mapv(|v| v * 2.0).view());
                        Ok(())
                    },
                )
            })
        };
        let closer = {
            let batcher = Arc::clone(&batcher);
            thread::spawn(move || batcher.close())
        };
        let x = Array2::from_shape_vec((2, 1), vec![3.0f32, 4.0]).unwrap();
        let mut out = Array2::from_elem((2, 1), -1.0f32);
        let result = batcher.submit(x.view(), out.view_mut(), Wait::Forever, &Counters::default());
        let seen = out.clone();
        worker.join().unwrap();
        closer.join().unwrap();
        let whole = seen.as_slice() == Some(&[6.0, 8.0][..]);
        assert!(
            out == seen && (whole || matches!(result, Err(Error::PoolClosed))),
            "{result:?}: saw {seen}, then {out}"
        );
    });
}

/// One arena, held; a second caller waits for it (starving from the start, so that the
/// arena given back is granted to it); the close races both. The waiter gets the arena
/// or `PoolClosed`, never while another holds it, and in the end the arena is back on
/// the free list: a grant the waiter will not take is not lost.
#[test]
fn a_grant_racing_the_close_never_loses_the_arena() {
    loom::model(|| {
        let turns = Arc::new(Turns::new(1, Duration::ZERO));
        let in_use = Arc::new(AtomicBool::new(false));
        let counters = Counters::default();
        let held = turns.lease(Wait::Forever, &counters, false).unwrap();
        in_use.store(true, Ordering::SeqCst);
        let waiter = {
            let (turns, in_use) = (Arc::clone(&turns), Arc::clone(&in_use));
            thread::spawn(move || {
                let leased = turns.lease(Wait::Forever, &Counters::default(), false);
                if let Ok(index) = leased {
                    assert!(!in_use.swap(true, Ordering::SeqCst), "arena {index} leased twice");
                    in_use.store(false, Ordering::SeqCst);
                    turns.give_back(index);
                }
                leased.map(drop)
            })
        };
        let closer = {
            let turns = Arc::clone(&turns);
            thread::spawn(move || turns.close())
        };
        in_use.store(false, Ordering::SeqCst);
        turns.give_back(held);
        let leased = waiter.join().unwrap();
        closer.join().unwrap();
        assert!(matches!(leased, Ok(()) | Err(Error::PoolClosed)) && turns.free_count() == 1, "{leased:?}");
    });
}

/// Two workers meet at a gate of two while a third thread breaks it: both see it turn,
/// or neither does (a gate that turned and then broke did turn).
#[test]
fn a_break_racing_a_turn_is_seen_alike_by_every_waiter() {
    loom::model(|| {
        let gate = Arc::new(Gate::new(2));
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let gate = Arc::clone(&gate);
                thread::spawn(move || gate.wait())
            })
            .collect();
        gate.break_all();
        let turned: Vec<bool> = waiters.into_iter().map(|w| w.join().unwrap()).collect();
        assert_eq!(turned[0], turned[1], "one waiter saw the gate turn and the other saw it broken");
    });
}

/// An inference pool's start: the starter waits while two batch workers arrive; the
/// wait returns, and only once both have run up to their arrival (what each did before
/// arriving is seen).
#[test]
fn the_pools_start_returns_once_every_worker_runs() {
    loom::model(|| {
        let latch = Arc::new(Latch::new());
        let ran = Arc::new([AtomicBool::new(false), AtomicBool::new(false)]);
        let workers: Vec<_> = (0..2)
            .map(|i| {
                let (latch, ran) = (Arc::clone(&latch), Arc::clone(&ran));
                thread::spawn(move || {
                    ran[i].store(true, Ordering::Relaxed);
                    latch.arrive();
                })
            })
            .collect();
        latch.wait_for(2);
        assert!(ran.iter().all(|r| r.load(Ordering::Relaxed)), "the start returned before a worker ran");
        for worker in workers {
            worker.join().unwrap();
        }
    });
}

/// Two workers reduce two steps' buckets (each kept alive, as the trainer keeps them,
/// until the end): each worker's share holds the sum of both workers' values of that
/// step, in rank order. A worker that runs ahead into the next step publishes its new
/// bucket in the other buffer, so the slower one still reads this step's.
#[test]
fn two_workers_two_steps_sum_their_own_steps_buckets() {
    const LEN: usize = 32;
    let value = |rank: usize, step: usize, i: usize| (1 + rank * 100 + step * 10_000 + i) as f32;
    loom::model(move || {
        let workers: Vec<_> = Threads::group(2)
            .into_iter()
            .enumerate()
            .map(|(rank, mut reducer)| {
                thread::spawn(move || {
                    let mut buckets: Vec<Vec<f32>> =
                        (0..2).map(|step| (0..LEN).map(|i| value(rank, step, i)).collect()).collect();
                    let mut wrong = Vec::new();
                    for (step, bucket) in buckets.iter_mut().enumerate() {
                        let share = reducer.reduce(bucket).unwrap();
                        for i in share {
                            if bucket[i] != value(0, step, i) + value(1, step, i) {
                                wrong.push((step, i, bucket[i]));
                            }
                        }
                    }
                    // The buckets live until every worker is done with them.
                    (wrong, buckets)
                })
            })
            .collect();
        let outcomes: Vec<_> = workers.into_iter().map(|w| w.join().unwrap()).collect();
        let wrong: Vec<_> = outcomes.iter().flat_map(|(wrong, _)| wrong.iter()).collect();
        assert!(wrong.is_empty(), "sums other than this step's (step, index, value): {wrong:?}");
    });
}

/// Two arenas, both held; two callers wait (the arenas go to whoever comes first: the
/// starving bound never passes). Both arenas come back one after the other, and the
/// waiters keep what they get: each gets one, though each give-back wakes only the
/// oldest waiter's stripe (the first woken passes the wake-up on).
#[test]
fn two_arenas_given_back_reach_two_waiters() {
    loom::model(|| {
        let turns = Arc::new(Turns::new(2, Duration::MAX));
        let counters = Counters::default();
        let held = [0, 1].map(|_| turns.lease(Wait::Forever, &counters, false).unwrap());
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let turns = Arc::clone(&turns);
                // Each keeps its arena: the other is served by the give-backs alone.
                thread::spawn(move || turns.lease(Wait::Forever, &Counters::default(), false).unwrap())
            })
            .collect();
        for index in held {
            turns.give_back(index);
        }
        let mut got: Vec<usize> = waiters.into_iter().map(|waiter| waiter.join().unwrap()).collect();
        got.sort_unstable();
        for &index in &got {
            turns.give_back(index);
        }
        assert!(got == [0, 1] && turns.free_count() == 2, "{got:?}");
    });
}

/// A warm-up reserves the one arena while its lessee gives it back: the warm-up gets it
/// (ahead of any waiter), and gives it back to the free list.
#[test]
fn a_reservation_racing_a_returning_lease_gets_the_arena() {
    loom::model(|| {
        let turns = Arc::new(Turns::new(1, Duration::ZERO));
        let held = turns.lease(Wait::Forever, &Counters::default(), false).unwrap();
        let warm_up = {
            let turns = Arc::clone(&turns);
            thread::spawn(move || {
                let reserved = turns.reserve(0);
                if reserved.is_ok() {
                    turns.give_back(0);
                }
                reserved
            })
        };
        turns.give_back(held);
        let reserved = warm_up.join().unwrap();
        assert!(reserved.is_ok() && turns.free_count() == 1, "{reserved:?}");
    });
}

/// A batch's results for [`Combiner`]'s models: the batch's number and the slot.
fn count_batch(engine: &mut u32, batch: &[bool], results: &mut [Option<crate::Result<u32>>]) -> crate::Result<()> {
    *engine += 1;
    for (s, (&member, result)) in batch.iter().zip(results).enumerate() {
        if member {
            *result = Some(Ok(*engine * 100 + s as u32));
        }
    }
    Ok(())
}

/// A combiner of two slots, both reserved, whose batches wait at most `max_wait`.
fn two_slots(max_wait: Duration) -> (Arc<Combiner<u32>>, usize, usize) {
    let combiner = Arc::new(Combiner::new(0u32, 2, max_wait));
    let (a, b) = (combiner.reserve(None).unwrap().unwrap(), combiner.reserve(None).unwrap().unwrap());
    (combiner, a, b)
}

/// `f` on a thread of its own, with a handle of `combiner`.
fn with_thread<T: Send + 'static>(
    combiner: &Arc<Combiner<u32>>,
    f: impl FnOnce(&Combiner<u32>) -> T + Send + 'static,
) -> thread::JoinHandle<T> {
    let combiner = Arc::clone(combiner);
    thread::spawn(move || f(&combiner))
}

/// Two callers step their slots at once: whichever finds the engine idle runs the
/// batch, with the other's step in it or not; each gets its own slot's result, from
/// one batch together or from two in turn, and neither waits for good.
#[test]
fn two_callers_steps_each_get_their_own_result_in_one_batch_or_two() {
    loom::model(|| {
        let (combiner, a, b) = two_slots(Duration::ZERO);
        let other = with_thread(&combiner, move |combiner| combiner.next(b, &mut count_batch));
        let mine = combiner.next(a, &mut count_batch).unwrap();
        let theirs = other.join().unwrap().unwrap();
        assert_eq!((mine % 100, theirs % 100), (a as u32, b as u32));
        match combiner.with_engine(|batches| *batches) {
            1 => assert_eq!((mine / 100, theirs / 100), (1, 1)),
            2 => assert_ne!(mine / 100, theirs / 100),
            other => panic!("{other} batches for two steps"),
        }
    });
}

/// A full batch: a caller waits for a slot while one stream steps and another starts
/// (the engine taken by each in turn) and then leaves; the waiter gets the slot left,
/// and the step its result.
#[test]
fn a_caller_waiting_for_a_slot_gets_the_one_left_while_a_step_runs() {
    loom::model(|| {
        let (combiner, a, b) = two_slots(Duration::ZERO);
        let stepper = with_thread(&combiner, move |combiner| combiner.next(a, &mut count_batch));
        let leaver = with_thread(&combiner, move |combiner| {
            combiner.with_engine(|engine| *engine += 10);
            combiner.leave(b);
        });
        // No time passes under loom: this waits until a slot is left.
        let joined = combiner.reserve(Some(async_iter::sync::Deadline::after(Duration::from_secs(1))));
        assert_eq!(joined.unwrap(), Some(b));
        leaver.join().unwrap();
        let stepped = stepper.join().unwrap().unwrap();
        assert_eq!(stepped % 100, a as u32);
    });
}

/// A batch that waits for every stream: two callers step with a wait that (under loom)
/// never ends, so that whichever queues first waits for the other, and the second to
/// queue runs both steps as one batch.
#[test]
fn a_batch_that_waits_for_every_stream_runs_both_steps_together() {
    loom::model(|| {
        let (combiner, a, b) = two_slots(Duration::from_secs(1));
        let other = with_thread(&combiner, move |combiner| combiner.next(b, &mut count_batch));
        let mine = combiner.next(a, &mut count_batch).unwrap();
        let theirs = other.join().unwrap().unwrap();
        assert_eq!((mine, theirs), (100 + a as u32, 100 + b as u32));
        assert_eq!(combiner.with_engine(|batches| *batches), 1);
    });
}

/// A step racing two reads of the engine (a slot's state, a join's prompt) with a
/// wait that has passed (under loom a put-off deadline has passed too): the step runs
/// in one batch, before, between or after them, and gets its own result; the reads
/// return, and neither the step nor a read waits for good.
#[test]
fn a_step_racing_reads_of_the_engine_runs_and_the_reads_return() {
    loom::model(|| {
        let (combiner, a, _) = two_slots(Duration::ZERO);
        let stepper = with_thread(&combiner, move |combiner| combiner.next(a, &mut count_batch));
        let reads = [0, 1].map(|_| combiner.with_engine(|engine| *engine));
        let stepped = stepper.join().unwrap().unwrap();
        assert_eq!((stepped / 100, stepped % 100), (1, a as u32));
        assert!(reads.iter().all(|&batches| batches <= 1), "{reads:?}");
        assert_eq!(combiner.with_engine(|batches| *batches), 1);
    });
}

/// One thread stepping its two slots in turn, with a wait that (under loom) never
/// ends: a step does not wait for the thread's other slot (the thread cannot step it
/// while it waits), so each goes at once, alone; waiting for it would never end.
#[test]
fn a_thread_stepping_its_two_slots_in_turn_never_waits_for_itself() {
    loom::model(|| {
        let (combiner, a, b) = two_slots(Duration::from_secs(1));
        combiner.claim(a);
        combiner.claim(b);
        let steps = [a, b, a].map(|slot| combiner.next(slot, &mut count_batch).unwrap());
        assert_eq!(steps, [100 + a as u32, 200 + b as u32, 300 + a as u32]);
    });
}

/// Two callers that each claim their own slot and step it, with a wait that never
/// ends: whichever queues first waits for the other's slot (its thread is not waiting
/// for a step of its own, or has not claimed the slot yet), and both go as one batch.
#[test]
fn callers_claiming_their_own_slots_still_step_as_one_batch() {
    loom::model(|| {
        let (combiner, a, b) = two_slots(Duration::from_secs(1));
        let other = with_thread(&combiner, move |combiner| {
            combiner.claim(b);
            combiner.next(b, &mut count_batch)
        });
        combiner.claim(a);
        let mine = combiner.next(a, &mut count_batch).unwrap();
        let theirs = other.join().unwrap().unwrap();
        assert_eq!((mine, theirs), (100 + a as u32, 100 + b as u32));
    });
}

/// Two callers, two steps each, a step as soon as the engine is idle: a slot's result
/// taken (`Done`), then its next step queued again, against the other's batch; each
/// gets its own results, the second from a later batch than the first.
#[test]
fn two_callers_two_steps_each_get_their_own_results_in_order() {
    loom::model(|| {
        let (combiner, a, b) = two_slots(Duration::ZERO);
        let other = with_thread(&combiner, move |combiner| {
            let first = combiner.next(b, &mut count_batch).unwrap();
            (first, combiner.next(b, &mut count_batch).unwrap())
        });
        let mine = (combiner.next(a, &mut count_batch).unwrap(), combiner.next(a, &mut count_batch).unwrap());
        let theirs = other.join().unwrap();
        for ((first, second), slot) in [(mine, a), (theirs, b)] {
            assert_eq!((first % 100, second % 100), (slot as u32, slot as u32));
            assert!(first / 100 < second / 100, "{first} then {second}");
        }
    });
}
