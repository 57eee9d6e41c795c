//! Loom models of `carve::nn`'s concurrent protocols: every interleaving (up to
//! `LOOM_MAX_PREEMPTIONS` preemptions) of the code that ships, whose primitives come
//! from `async_iter::sync` and are loom's under `--cfg loom`. One protocol per model,
//! two or three threads, in the manner of tokio's `loom_oneshot.rs`:
//!
//! - the batcher's tickets: a caller's `submit` (and its leaving, on a timeout) against
//!   a worker's settle, with the close racing them;
//! - the arenas' turns: a grant to the oldest waiter against a returning lease and the
//!   close;
//! - the workers' barrier ([`Gate`]): a break against a turn;
//! - the reducer's double-buffered buckets ([`Threads::reduce`]): two workers, two
//!   steps.
//!
//! Besides each model's assertion, loom fails a model on a deadlock (a park or wait
//! nobody ends) and on a leaked loom object.
//!
//! Time does not pass under loom: a zero timeout (or starving bound, or batching wait)
//! has expired at once, any other never does.
//!
//! Run: `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom LOOM_MAX_PREEMPTIONS=2 \
//!       cargo test -p carve --lib --release nn::loom`

use std::sync::Arc;
use std::time::Duration;

use async_iter::sync::AtomicBool;
use loom::thread;
use ndarray::Array2;
use std::sync::atomic::Ordering;

use super::parallel::reduce::{Reducer, Threads};
use super::parallel::shared::Gate;
use super::serve::batcher::{BatchBuffers, Batcher};
use super::serve::turns::{Counters, Turns, Wait};
use super::PoolConfig;
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
                batcher.work(buffers, |x, scatter| {
                    scatter(x.mapv(|v| v * 2.0).view());
                    Ok(())
                })
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
        let held = turns.lease(Wait::Forever, &counters).unwrap();
        in_use.store(true, Ordering::SeqCst);
        let waiter = {
            let (turns, in_use) = (Arc::clone(&turns), Arc::clone(&in_use));
            thread::spawn(move || {
                let leased = turns.lease(Wait::Forever, &Counters::default());
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
