//! Loom models of the prefetcher's hand-off: every interleaving of the producer
//! thread and the consumer (up to `LOOM_MAX_PREEMPTIONS` preemptions) of the code that
//! ships, built with loom's primitives in place of std's.
//!
//! Besides the assertions below, loom fails a model when the producer writes a slot
//! while the consumer still holds its lease, when a ring block is given back under a
//! lease (both are loom cell accesses in the crate), on a deadlock (a wait nobody
//! wakes), and on a leaked `Arc`.
//!
//! Time does not pass under loom: a join timeout of zero has always expired, any other
//! never does. The models with a zero timeout explore the paths where the consumer
//! stops waiting for the producer thread (a stop that fails, a drop that detaches).
//!
//! Run: `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom LOOM_MAX_PREEMPTIONS=2 \
//!       cargo test -p async-iter --release --test loom`

#![cfg(loom)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_iter::{BatchLayout, BatchMut, BatchSource, Error, Lease, Prefetcher, SourceError};
use ndarray::Ix1;

/// The value every element of batch `index` of `epoch` holds.
fn value(epoch: u64, index: usize) -> u32 {
    1 + index as u32 + 100 * epoch as u32
}

/// Batches of `sizes[i]` `u32` features, filled with [`value`]; fails at `fail_at`.
struct Source {
    sizes: Vec<usize>,
    fail_at: Option<usize>,
    epoch: u64,
    /// The model's main thread: when set, dropping the source notes on which thread it
    /// was dropped.
    main: Option<loom::thread::ThreadId>,
}

impl Source {
    fn new(sizes: &[usize]) -> Source {
        Source { sizes: sizes.to_vec(), fail_at: None, epoch: 0, main: None }
    }
}

/// Paths the models with a zero join timeout took, over all their runs (std atomics:
/// not part of any model).
static STOP_FAILED: AtomicBool = AtomicBool::new(false);
static STOP_SUCCEEDED: AtomicBool = AtomicBool::new(false);
static DROPPED_BY_THE_PRODUCER: AtomicBool = AtomicBool::new(false);
static DROPPED_BY_THE_CONSUMER: AtomicBool = AtomicBool::new(false);

impl Drop for Source {
    fn drop(&mut self) {
        if let Some(main) = self.main {
            let by_producer = loom::thread::current().id() != main;
            let path = if by_producer { &DROPPED_BY_THE_PRODUCER } else { &DROPPED_BY_THE_CONSUMER };
            path.store(true, Ordering::Relaxed);
        }
    }
}

impl BatchSource for Source {
    fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
        if self.fail_at == Some(index) {
            return Err("injected failure".into());
        }
        Ok(self.sizes.get(index).map(|&n| BatchLayout::new().features::<u32, _>(n)))
    }

    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
        let value = value(self.epoch, batch.index());
        batch.features::<u32, Ix1>()?.fill(value);
        Ok(())
    }

    fn reset(&mut self) -> Result<(), SourceError> {
        self.epoch += 1;
        Ok(())
    }
}

/// Asserts that the lease shows batch `index` of `epoch`, untouched.
fn check(lease: &Lease<'_>, epoch: u64, index: usize) {
    assert_eq!((lease.epoch(), lease.index()), (epoch, index));
    let features = lease.features::<u32, Ix1>().unwrap();
    assert!(features.iter().all(|&v| v == value(epoch, index)), "batch {index} was overwritten: {features}");
}

fn prefetcher(source: Source, depth: usize) -> Prefetcher<Source> {
    Prefetcher::builder(source).depth(depth).build().unwrap()
}

#[test]
fn in_order_delivery_with_two_slots() {
    loom::model(|| {
        let mut batches = prefetcher(Source::new(&[4, 4, 4]), 1);
        for index in 0..3 {
            check(&batches.next().unwrap().unwrap(), 0, index);
        }
        assert!(batches.next().is_none());
        let stats = batches.stats();
        assert_eq!((stats.batches_produced, stats.batches_consumed, stats.slots), (3, 3, 2));
    });
}

#[test]
fn consumer_holds_the_most_leases_while_the_producer_waits() {
    loom::model(|| {
        let mut batches = prefetcher(Source::new(&[4, 4, 4]), 1);
        {
            // One lease (the most a consumer can hold) plus one queued batch fill both
            // slots: the producer must wait for this lease before batch 2.
            let lease = batches.next().unwrap().unwrap();
            loom::thread::yield_now();
            check(&lease, 0, 0);
        }
        check(&batches.next().unwrap().unwrap(), 0, 1);
        check(&batches.next().unwrap().unwrap(), 0, 2);
        assert!(batches.next().is_none());
    });
}

#[test]
fn growth_while_a_lease_is_out() {
    loom::model(|| {
        // 16 bytes (a 64-byte slot), then 256 bytes: the ring grows while batch 0 is
        // leased, and batch 2 goes to the new block. With three slots the producer
        // reaches batch 2 (and could give the old block back) while batch 0 is leased.
        let mut batches = prefetcher(Source::new(&[4, 64, 4]), 2);
        {
            let lease = batches.next().unwrap().unwrap();
            loom::thread::yield_now();
            check(&lease, 0, 0);
        }
        check(&batches.next().unwrap().unwrap(), 0, 1);
        check(&batches.next().unwrap().unwrap(), 0, 2);
        assert!(batches.next().is_none());
        let stats = batches.stats();
        assert_eq!((stats.ring_growths, stats.ring_bytes, stats.first_batch_bytes), (1, 3 * 256, 64));
    });
}

#[test]
fn producer_failure_reaches_the_consumer_at_its_batch() {
    loom::model(|| {
        let mut source = Source::new(&[4, 4, 4]);
        source.fail_at = Some(1);
        let mut batches = prefetcher(source, 1);
        check(&batches.next().unwrap().unwrap(), 0, 0);
        match batches.next() {
            Some(Err(Error::Source { batch: 1, epoch: 0, .. })) => {}
            other => panic!("expected the failure at batch 1, got {other:?}"),
        }
        assert!(batches.next().is_none(), "the error is reported once, then the epoch is over");
    });
}

#[test]
fn early_drop_of_the_consumer_stops_the_producer() {
    loom::model(|| {
        let mut batches = prefetcher(Source::new(&[4, 4, 4, 4]), 1);
        check(&batches.next().unwrap().unwrap(), 0, 0);
        drop(batches); // the producer may be filling, waiting for room, or done
    });
}

#[test]
fn early_drop_while_holding_nothing() {
    loom::model(|| {
        drop(prefetcher(Source::new(&[4, 4, 4]), 1));
    });
}

#[test]
fn reset_mid_epoch_restarts_and_reuses_the_ring() {
    loom::model(|| {
        let mut batches = prefetcher(Source::new(&[4, 4, 4]), 1);
        check(&batches.next().unwrap().unwrap(), 0, 0);
        batches.reset().unwrap();
        check(&batches.next().unwrap().unwrap(), 1, 0);
        check(&batches.next().unwrap().unwrap(), 1, 1);
        let stats = batches.stats();
        assert_eq!((stats.epoch, stats.ring_growths, stats.ring_bytes), (1, 0, 2 * 64));
    });
}

#[test]
fn a_stop_that_does_not_wait_fails_until_the_producer_is_back_then_reset_works() {
    loom::model(|| {
        let mut batches =
            Prefetcher::builder(Source::new(&[4, 4, 4])).depth(1).join_timeout(Duration::ZERO).build().unwrap();
        check(&batches.next().unwrap().unwrap(), 0, 0);
        match batches.stop() {
            Ok(()) => STOP_SUCCEEDED.store(true, Ordering::Relaxed),
            Err(Error::SourceStuck { .. }) => STOP_FAILED.store(true, Ordering::Relaxed),
            Err(other) => panic!("unexpected {other:?}"),
        }
        assert!(batches.next().is_none(), "stopped either way");
        // Each reset looks once; the producer hands its state back at some point.
        while let Err(err) = batches.reset() {
            assert!(matches!(err, Error::SourceStuck { .. }), "{err:?}");
            loom::thread::yield_now();
        }
        check(&batches.next().unwrap().unwrap(), 1, 0);
    });
    assert!(STOP_FAILED.load(Ordering::Relaxed) && STOP_SUCCEEDED.load(Ordering::Relaxed), "both paths explored");
}

#[test]
fn a_drop_that_does_not_wait_detaches_or_joins_the_producer() {
    loom::model(|| {
        let mut source = Source::new(&[4, 4, 4]);
        source.main = Some(loom::thread::current().id());
        let mut batches = Prefetcher::builder(source).depth(1).join_timeout(Duration::ZERO).build().unwrap();
        check(&batches.next().unwrap().unwrap(), 0, 0);
        // The producer may be filling, waiting for room, handing back, or gone: a
        // detached one drops the source and the ring itself (loom fails the model if
        // the ring or the shared state leaked, or a block was freed under a lease).
        drop(batches);
    });
    let (detached, joined) =
        (DROPPED_BY_THE_PRODUCER.load(Ordering::Relaxed), DROPPED_BY_THE_CONSUMER.load(Ordering::Relaxed));
    assert!(detached && joined, "both paths explored (detached {detached}, joined {joined})");
}
