//! The device prefetcher: every batch arrives intact over epochs of random sizes, the
//! copy of the next batch is under way while the consumer holds the current one, a slot
//! is not overwritten while the consumer's stream may still read it, and failures and
//! early ends neither hang nor leak — a source stuck in `fill`, or one whose panic
//! payload panics again when dropped, included.
//!
//! The tests generic over the device run twice, in `prefetch::sim` and `prefetch::cuda`
//! (skipped without a GPU); those that hold or bypass streams run on the simulator only.

use std::panic::{self, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver};
use std::thread;
use std::time::{Duration, Instant};

use async_iter::{BatchArrays, BatchLayout, BatchMut, BatchSource, Role, SourceCall, SourceError, Threading};
use ndarray::{Array1, Array2, Ix1, Ix2};
use workspace_cuda::device::sim::SimDevice;
use workspace_cuda::{Device, DevicePrefetcher, Error};

use crate::misbehaving::{self, Detonating, Gate, Note, Stuck};

/// Rows of batch `index` of `epoch`: pseudo-random in 1..=64, except the very first
/// batch (16 rows), so that later batches grow both rings.
fn random_rows(epoch: u64, index: usize) -> Option<usize> {
    let batches = 9 + epoch as usize;
    if index >= batches {
        return None;
    }
    if (epoch, index) == (0, 0) {
        return Some(16);
    }
    let mixed = (epoch.wrapping_mul(7919) ^ (index as u64).wrapping_mul(104_729)).wrapping_mul(2_654_435_761);
    Some(1 + ((mixed >> 7) % 64) as usize)
}

/// 10 batches of 64 rows, the last of 16.
fn partial_last(_epoch: u64, index: usize) -> Option<usize> {
    match index {
        0..=8 => Some(64),
        9 => Some(16),
        _ => None,
    }
}

const COLUMNS: usize = 5;

fn feature(epoch: u64, index: usize, row: usize, column: usize) -> f32 {
    (epoch as usize * 100_000 + index * 1000 + row * 8 + column) as f32
}

fn label(epoch: u64, index: usize, row: usize) -> u32 {
    (epoch as usize * 100_000 + index * 1000 + row) as u32
}

fn expected_features(epoch: u64, index: usize, rows: usize) -> Array2<f32> {
    Array2::from_shape_fn((rows, COLUMNS), |(r, c)| feature(epoch, index, r, c))
}

fn expected_labels(epoch: u64, index: usize, rows: usize) -> Array1<u32> {
    Array1::from_shape_fn(rows, |r| label(epoch, index, r))
}

/// Batches of `rows(epoch, index)` rows of known values; with `masks`, odd batches
/// carry a features mask. It can panic or fail at one batch.
struct Numbers {
    rows: fn(u64, usize) -> Option<usize>,
    masks: bool,
    epoch: u64,
    panic_at: Option<(u64, usize)>,
    fail_at: Option<(u64, usize)>,
    fill_delay: Duration,
}

impl Numbers {
    fn new(rows: fn(u64, usize) -> Option<usize>) -> Numbers {
        Numbers { rows, masks: false, epoch: 0, panic_at: None, fail_at: None, fill_delay: Duration::ZERO }
    }
}

impl BatchSource for Numbers {
    fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
        Ok((self.rows)(self.epoch, index).map(|rows| {
            let layout = BatchLayout::new().features::<f32, _>((rows, COLUMNS)).labels::<u32, _>(rows);
            if self.masks && index % 2 == 1 {
                layout.features_mask::<u8, _>(rows)
            } else {
                layout
            }
        }))
    }

    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
        let index = batch.index();
        if self.panic_at == Some((self.epoch, index)) {
            panic!("the source broke at batch {index}");
        }
        if self.fail_at == Some((self.epoch, index)) {
            return Err(format!("no data for batch {index}").into());
        }
        thread::sleep(self.fill_delay);
        let mut x = batch.features::<f32, Ix2>()?;
        let rows = x.nrows();
        x.assign(&expected_features(self.epoch, index, rows));
        batch.labels::<u32, Ix1>()?.assign(&expected_labels(self.epoch, index, rows));
        if self.masks && index % 2 == 1 {
            batch.features_mask::<u8, Ix1>()?.fill(1);
        }
        Ok(())
    }

    fn reset(&mut self) -> Result<(), SourceError> {
        self.epoch += 1;
        Ok(())
    }
}

/// Runs `f` on another thread and fails the test if it has not returned in 30 s.
fn within_30s(f: impl FnOnce() + Send + 'static) {
    let (done, finished) = mpsc::channel();
    let worker = thread::spawn(move || {
        f();
        let _ = done.send(());
    });
    match finished.recv_timeout(Duration::from_secs(30)) {
        Ok(()) => worker.join().unwrap(),
        Err(mpsc::RecvTimeoutError::Disconnected) => worker.join().unwrap(), // it panicked: rethrow
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("hung for 30 s"),
    }
}

/// What a batch holds, read through [`BatchArrays`] wherever it lives (a device lease,
/// a device batch, a host batch): its features and labels copied to the host, and
/// whether it has a features mask.
fn read_back<B: BatchArrays>(batch: &B) -> (Array2<f32>, Array1<u32>, bool) {
    let x = batch.to_array::<f32, Ix2>(Role::Features).unwrap();
    let y = batch.to_array::<u32, Ix1>(Role::Labels).unwrap();
    assert_eq!(batch.layout().has(Role::Labels), batch.labels::<u32, Ix1>().is_ok());
    (x, y, batch.features_mask::<u8, Ix1>().unwrap().is_some())
}

// ---- on both devices --------------------------------------------------------------

pub(crate) fn checksums_over_epochs_with_random_sizes_and_a_slow_consumer<D: Device>(device: &D) {
    let source = Numbers { masks: true, ..Numbers::new(random_rows) };
    let mut batches = DevicePrefetcher::builder(source, device).depth(2).build().unwrap();
    let (mut total, mut bytes, mut kept) = (0, 0, Vec::new());
    for epoch in 0..3_u64 {
        let mut seen = 0;
        while let Some(batch) = batches.next() {
            let batch = batch.unwrap();
            let (index, rows) = (batch.index(), random_rows(epoch, seen).unwrap());
            assert_eq!((batch.epoch(), index), (epoch, seen));
            bytes += batch.bytes() as u64;
            thread::sleep(Duration::from_millis(2)); // the consumer is the slow side
            let x = batch.features::<f32, Ix2>().unwrap();
            assert_eq!(x.shape(), &[rows, COLUMNS]);
            assert_eq!(x.to_host().unwrap(), expected_features(epoch, index, rows), "epoch {epoch} batch {index}");
            let mask = batch.features_mask::<u8, Ix1>().unwrap();
            assert_eq!(mask.is_some(), index % 2 == 1);
            let expected = (expected_features(epoch, index, rows), expected_labels(epoch, index, rows), index % 2 == 1);
            assert_eq!(read_back(&batch), expected, "the lease through BatchArrays");
            match index % 3 {
                0 => kept.push(batch.detach().unwrap()), // outlives the ring slot and the prefetcher
                1 => {
                    let host = batch.to_host().unwrap();
                    assert_eq!(read_back(&host), expected, "the host copy through BatchArrays");
                    assert_eq!(host.labels::<u32, Ix1>().unwrap(), expected_labels(epoch, index, rows));
                    assert_eq!(host.features::<f32, Ix2>().unwrap(), expected_features(epoch, index, rows));
                }
                _ => {
                    let y = batch.labels::<u32, Ix1>().unwrap();
                    assert_eq!(y.to_host().unwrap(), expected_labels(epoch, index, rows));
                }
            }
            seen += 1;
        }
        assert_eq!(seen, 9 + epoch as usize, "every batch of epoch {epoch} arrived");
        total += seen as u64;
        if epoch < 2 {
            batches.reset().unwrap();
        }
    }
    let stats = batches.stats();
    assert_eq!((stats.copies_issued, stats.bytes_copied), (total, bytes));
    assert_eq!(stats.host.batches_consumed, total);
    assert!(stats.device_ring_growths >= 1, "batches larger than the first grow the device ring: {stats:?}");
    assert!(stats.host.ring_growths >= 1, "{stats:?}");
    assert_eq!(stats.device_ring_bytes, 3 * stats.device_slot_bytes);
    drop(batches);
    for batch in &kept {
        let rows = random_rows(batch.epoch(), batch.index()).unwrap();
        let (x, y, masked) = read_back(batch);
        assert_eq!(
            (x, y),
            (
                expected_features(batch.epoch(), batch.index(), rows),
                expected_labels(batch.epoch(), batch.index(), rows)
            )
        );
        assert_eq!(masked, batch.index() % 2 == 1, "the device batch through BatchArrays");
        assert_eq!(batch.features_mask::<u8, Ix1>().unwrap().is_some(), masked, "and its own method");
        assert!(batch.labels_mask::<u8, Ix1>().unwrap().is_none());
        let host = batch.to_host().unwrap();
        assert_eq!(host.features::<f32, Ix2>().unwrap(), expected_features(batch.epoch(), batch.index(), rows));
        let y = batch.labels::<u32, Ix1>().unwrap().to_host().unwrap();
        assert_eq!(y, expected_labels(batch.epoch(), batch.index(), rows));
    }
}

/// Waits until the producer has produced `n` batches of the epoch.
fn produced<S: BatchSource, D: Device>(batches: &DevicePrefetcher<S, D>, n: u64) {
    let deadline = Instant::now() + NOTED;
    while batches.stats().host.batches_produced < n {
        assert!(Instant::now() < deadline, "the producer never produced {n} batches");
        thread::sleep(Duration::from_micros(100));
    }
}

pub(crate) fn the_next_copy_is_issued_before_a_batch_is_handed_out<D: Device>(device: &D) {
    let mut batches = DevicePrefetcher::builder(Numbers::new(partial_last), device).depth(1).build().unwrap();
    let mut issued_at_hand_out = Vec::new();
    loop {
        // The producer is ahead (as a steady training loop finds it): batch k + 1, or the
        // end of the epoch, is there when batch k is asked for. (A batch that is not
        // ready is not waited for: `a_source_that_needs_the_batch_before_to_be_used_...`.)
        // (Taken from the host: the batch handed out last and the one staged after it; the
        // first call takes two.)
        let consumed = batches.stats().host.batches_consumed;
        produced(&batches, if consumed == 0 { 2 } else { (consumed + 1).min(10) });
        match batches.next() {
            Some(batch) => drop(batch.unwrap()),
            None => break,
        }
        // Nothing was issued since the lease was handed out: this is the count then.
        issued_at_hand_out.push(batches.stats().copies_issued);
    }
    assert_eq!(issued_at_hand_out, [2, 3, 4, 5, 6, 7, 8, 9, 10, 10], "batch k is handed out after copy k + 1");
}

pub(crate) fn the_last_partial_batch_arrives_whole<D: Device>(device: &D) {
    let mut batches = DevicePrefetcher::builder(Numbers::new(partial_last), device).build().unwrap();
    let mut rows = Vec::new();
    while let Some(batch) = batches.next() {
        let batch = batch.unwrap();
        let host = batch.to_host().unwrap();
        let x = host.features::<f32, Ix2>().unwrap();
        assert_eq!(x, expected_features(0, host.index(), x.nrows()));
        rows.push(x.nrows());
    }
    assert_eq!(rows, [64, 64, 64, 64, 64, 64, 64, 64, 64, 16]);
    let stats = batches.stats();
    assert_eq!((stats.device_ring_growths, stats.host.ring_growths), (0, 0), "a smaller batch fits its slot");
    assert!(batches.next().is_none(), "the epoch stays over");
}

pub(crate) fn source_panics_and_errors_arrive_at_their_batch<D: Device>(device: &D) {
    let mut source = Numbers::new(partial_last);
    source.panic_at = Some((0, 4));
    source.fail_at = Some((1, 0));
    let mut batches = DevicePrefetcher::builder(source, device).build().unwrap();
    for expected in 0..4 {
        assert_eq!(batches.next().unwrap().unwrap().index(), expected);
    }
    match batches.next() {
        Some(Err(Error::Prefetch(async_iter::Error::SourcePanicked { epoch: 0, batch: 4, call, message }))) => {
            assert_eq!(call, SourceCall::Fill);
            assert!(message.contains("broke at batch 4"), "{message}");
        }
        other => panic!("expected the panic at batch 4, got {other:?}"),
    }
    assert!(batches.next().is_none(), "after the failure the epoch is over");
    batches.reset().unwrap();
    let err = batches.next().unwrap().unwrap_err();
    assert!(matches!(err, Error::Prefetch(async_iter::Error::Source { epoch: 1, batch: 0, .. })), "{err}");
    assert!(err.to_string().contains("no data for batch 0"), "{err}");
    batches.reset().unwrap();
    assert_eq!(std::iter::from_fn(|| batches.next().map(|b| b.unwrap().index())).count(), 10, "epoch 2 is whole");
}

pub(crate) fn dropping_or_stopping_mid_epoch_joins_without_hanging<D: Device>(device: &D) {
    let device = device.clone();
    within_30s(move || {
        // Dropped with the producer blocked on a full ring and a copy in flight.
        let mut batches = DevicePrefetcher::builder(Numbers::new(partial_last), &device).depth(2).build().unwrap();
        assert_eq!(batches.next().unwrap().unwrap().index(), 0);
        thread::sleep(Duration::from_millis(20)); // the producer fills the ring and waits
        drop(batches);

        // A leaked lease, then a stop, a reset, and a drop with a slow source mid-batch.
        let mut source = Numbers::new(partial_last);
        source.fill_delay = Duration::from_millis(5);
        let mut batches = DevicePrefetcher::builder(source, &device).depth(1).build().unwrap();
        std::mem::forget(batches.next().unwrap().unwrap()); // its slot comes back at the next `next()`
        let second = batches.next().unwrap().unwrap();
        assert_eq!(second.index(), 1);
        let x = second.features::<f32, Ix2>().unwrap().to_host().unwrap();
        assert_eq!(x, expected_features(0, 1, 64));
        drop(second);
        batches.stop().unwrap();
        assert!(batches.next().is_none(), "stopped");
        batches.reset().unwrap();
        assert_eq!(batches.epoch(), 1);
        let first = batches.next().unwrap().unwrap();
        assert_eq!((first.epoch(), first.index()), (1, 0));
        drop(first);
        drop(batches);
    });
}

pub(crate) fn misuse_is_a_typed_error<D: Device>(device: &D) {
    let stream = device.default_stream();
    let same =
        DevicePrefetcher::builder(Numbers::new(partial_last), device).stream(&stream).copy_stream(&stream).build();
    let err = same.unwrap_err();
    assert!(matches!(err, Error::Prefetch(async_iter::Error::InvalidConfig { .. })), "{err}");
    assert!(err.to_string().contains("copy stream"), "{err}");
    let err = DevicePrefetcher::builder(Numbers::new(partial_last), device).depth(0).build().unwrap_err();
    assert!(matches!(err, Error::Prefetch(async_iter::Error::InvalidConfig { .. })), "{err}");

    let mut batches = DevicePrefetcher::builder(Numbers::new(partial_last), device).build().unwrap();
    let batch = batches.next().unwrap().unwrap();
    let err = batch.features::<u32, Ix2>().unwrap_err();
    assert!(matches!(err, Error::Prefetch(async_iter::Error::WrongElementType { stored: "f32", .. })), "{err}");
    let err = batch.features::<f32, Ix1>().unwrap_err();
    assert!(matches!(err, Error::Prefetch(async_iter::Error::WrongDimensionality { stored: 2, .. })), "{err}");
    assert!(batch.labels_mask::<u8, Ix1>().unwrap().is_none());
    let err = batch.detach().unwrap().array::<u8, Ix1>(async_iter::Role::LabelsMask).unwrap_err();
    assert!(matches!(err, Error::Prefetch(async_iter::Error::MissingArray { batch: 0, .. })), "{err}");
}

pub(crate) fn a_panic_whose_payload_panics_on_drop_arrives_at_its_batch<D: Device>(device: &D) {
    for threading in [Threading::Shield, Threading::Background] {
        let outcome = panic::catch_unwind(AssertUnwindSafe(|| {
            // Panics with a `Bomb` in `fill` of batch 3 of the first epoch.
            let source = Detonating::new(Numbers::new(partial_last), SourceCall::Fill, 3);
            let mut batches = DevicePrefetcher::builder(source, device).threading(threading).build().unwrap();
            // Batch k is handed out once batch k + 1 is staged, so the panic at batch 3
            // arrives after batch 2.
            for expected in 0..3 {
                assert_eq!(batches.next().unwrap().unwrap().index(), expected, "{threading:?}");
            }
            match batches.next() {
                Some(Err(Error::Prefetch(async_iter::Error::SourcePanicked { epoch: 0, batch: 3, call, .. }))) => {
                    assert_eq!(call, SourceCall::Fill, "{threading:?}");
                }
                other => panic!("{threading:?}: expected the panic at batch 3, got {other:?}"),
            }
            assert!(batches.next().is_none(), "{threading:?}: the epoch is over");
            batches.reset().unwrap_or_else(|err| panic!("{threading:?}: the prefetcher resets: {err}"));
            let epoch: Vec<_> = std::iter::from_fn(|| batches.next().map(|b| b.unwrap().index())).collect();
            assert_eq!(epoch, (0..10).collect::<Vec<_>>(), "{threading:?}: the next epoch is whole");
        }));
        if let Err(payload) = outcome {
            match payload.downcast::<String>() {
                Ok(message) => panic!("{message}"),
                Err(payload) => {
                    std::mem::forget(payload); // the source's: dropping it may panic again
                    panic!("{threading:?}: the source's panic escaped `next()`");
                }
            }
        }
    }
}

macro_rules! on_both {
    ($($name:ident),* $(,)?) => {
        /// On the simulated device.
        mod sim {
            $( #[test] fn $name() { crate::on_sim(super::$name::<workspace_cuda::device::sim::SimDevice>) } )*
        }
        /// On a real GPU, skipped without one.
        mod cuda {
            $( #[test] fn $name() { crate::on_gpu(super::$name::<workspace_cuda::CudaDevice>) } )*
        }
    };
}

on_both!(
    checksums_over_epochs_with_random_sizes_and_a_slow_consumer,
    the_next_copy_is_issued_before_a_batch_is_handed_out,
    the_last_partial_batch_arrives_whole,
    source_panics_and_errors_arrive_at_their_batch,
    dropping_or_stopping_mid_epoch_joins_without_hanging,
    misuse_is_a_typed_error,
    a_panic_whose_payload_panics_on_drop_arrives_at_its_batch,
);

// ---- on the simulator: held and bypassed streams ------------------------------------

/// Bytes of one device slot for `partial_last`'s first batch: 64×5 f32 and 64 u32,
/// each rounded up to 64 bytes, the slot to 256.
const SLOT: u64 = (1280 + 256_u64).next_multiple_of(256);

#[test]
fn the_next_copy_runs_while_the_consumer_stream_is_busy() {
    crate::on_sim(|sim| {
        let mut batches = DevicePrefetcher::builder(Numbers::new(partial_last), sim).depth(1).build().unwrap();
        let consumer = batches.stream().clone();
        let first = batches.next().unwrap().unwrap();
        let x = first.features::<f32, Ix2>().unwrap();
        let hold = sim.hold(&consumer); // a long kernel on batch 0
        let pending = x.detach().unwrap(); // queued behind it
        sim.quiesce();
        let next_slot = sim.read_now(x.device_ptr() + SLOT, 64 * COLUMNS * 4).unwrap();
        let expected = expected_features(0, 1, 64);
        assert_eq!(
            next_slot,
            bytemuck::cast_slice::<f32, u8>(expected.as_slice().unwrap()),
            "batch 1 is on the device"
        );
        drop(hold);
        assert_eq!(pending.to_host().unwrap(), expected_features(0, 0, 64));
        drop(first);
    });
}

/// How the consumer's read of batch 0 is delayed.
#[derive(Clone, Copy)]
enum Delay {
    /// Its stream is held until everything else that can run has run.
    Hold,
    /// Its stream sleeps before each copy.
    Sleep,
}

/// With two device slots, batch 2 goes where batch 0 was. The consumer's stream reads
/// batch 0 late; returns the first value that read saw.
fn delayed_read_of_batch_0_sees(delay: Delay, ignore_waits: bool) -> f32 {
    let sim = SimDevice::new().unwrap();
    let mut batches = DevicePrefetcher::builder(Numbers::new(partial_last), &sim).depth(1).build().unwrap();
    let consumer = batches.stream().clone();
    let first = batches.next().unwrap().unwrap();
    sim.synchronize(&consumer).unwrap(); // batch 0 is in place: only the read is late
    sim.ignore_stream_waits(ignore_waits);
    let hold = match delay {
        Delay::Hold => Some(sim.hold(&consumer)),
        Delay::Sleep => {
            sim.set_delay(&consumer, Duration::from_millis(30));
            None
        }
    };
    let x = first.features::<f32, Ix2>().unwrap();
    let read = x.detach().unwrap(); // the late read, queued on the consumer's stream
    let slot_of_batch_0 = x.device_ptr();
    drop(first);
    produced(&batches, 3); // batch 2 is ready, so the next call stages it
    let second = batches.next().unwrap().unwrap(); // issues the copy of batch 2 into slot 0
    assert_eq!(second.index(), 1);
    sim.quiesce();
    drop(hold);
    drop(second);
    sim.synchronize(&consumer).unwrap();
    let third = batches.next().unwrap().unwrap();
    assert_eq!(third.features::<f32, Ix2>().unwrap().device_ptr(), slot_of_batch_0, "batch 2 reuses slot 0");
    drop(third);
    let seen = read.to_host().unwrap()[[0, 0]];
    sim.ignore_stream_waits(false);
    drop(batches);
    sim.quiesce();
    assert!(sim.faults().is_empty(), "{:?}", sim.faults());
    seen
}

#[test]
fn a_slot_is_not_overwritten_while_a_held_read_is_pending() {
    assert_eq!(delayed_read_of_batch_0_sees(Delay::Hold, false), feature(0, 0, 0, 0));
}

#[test]
fn a_slot_is_not_overwritten_while_a_slow_read_is_pending() {
    assert_eq!(delayed_read_of_batch_0_sees(Delay::Sleep, false), feature(0, 0, 0, 0));
}

#[test]
fn without_the_wait_the_pending_read_sees_the_next_batch() {
    // The hazard the wait prevents, made visible by the simulator.
    assert_eq!(delayed_read_of_batch_0_sees(Delay::Hold, true), feature(0, 2, 0, 0));
}

#[test]
fn a_pinned_slot_goes_back_to_the_producer_only_after_its_copy() {
    crate::on_sim(|sim| {
        // Two host slots: batch 2 is filled where batch 0 was, once batch 0's slot is back.
        let mut batches = DevicePrefetcher::builder(Numbers::new(partial_last), sim).depth(1).build().unwrap();
        let hold = sim.hold(batches.copy_stream()); // the copy of batch 0 cannot run yet
        let release = thread::spawn(move || {
            thread::sleep(Duration::from_millis(100));
            drop(hold);
        });
        let first = batches.next().unwrap().unwrap(); // waits for the copy of batch 0
        assert_eq!(first.features::<f32, Ix2>().unwrap().to_host().unwrap(), expected_features(0, 0, 64));
        drop(first);
        release.join().unwrap();
    });
}

// ---- on the simulator: a source stuck in `fill` ---------------------------------------

const JOIN_TIMEOUT: Duration = Duration::from_millis(200);
const NOTED: Duration = Duration::from_secs(20);

/// [`Numbers`] over `partial_last`, whose `fill` of batch `stuck_at` in the first epoch
/// waits at the gate.
fn stuck_source(stuck_at: usize) -> (Stuck<Numbers>, Gate, Receiver<Note>) {
    misbehaving::stuck_source(Numbers::new(partial_last), stuck_at)
}

/// Waits until the simulator holds no pinned memory (a detached producer frees its ring
/// just after it drops its source).
fn pinned_memory_released(sim: &SimDevice) {
    let deadline = Instant::now() + NOTED;
    while sim.live_pinned_bytes() != 0 {
        assert!(Instant::now() < deadline, "{} pinned bytes never released", sim.live_pinned_bytes());
        thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn dropping_with_a_source_stuck_in_fill_returns_and_its_pinned_ring_outlives_the_drop() {
    crate::on_sim(|sim| {
        let (source, gate, noted) = stuck_source(2);
        let mut batches = DevicePrefetcher::builder(source, sim).depth(2).join_timeout(JOIN_TIMEOUT).build().unwrap();
        assert_eq!(batches.next().unwrap().unwrap().index(), 0); // batch 1 is staged
        assert_eq!(noted.recv_timeout(NOTED).ok(), Some(Note::Entered(2)));
        let pinned = sim.live_pinned_bytes();
        assert!(pinned > 0);
        within_30s(move || drop(batches));
        // The producer thread is detached inside `fill`, and owns the pinned ring.
        assert_eq!(noted.try_recv().ok(), None, "the stuck thread still holds the source");
        assert_eq!(sim.live_pinned_bytes(), pinned, "the pinned ring lives while the stuck thread does");
        gate.open();
        assert_eq!(noted.recv_timeout(NOTED).ok(), Some(Note::Filled(2)));
        assert_eq!(noted.recv_timeout(NOTED).ok(), Some(Note::Dropped));
        pinned_memory_released(sim);
    });
}

#[test]
fn stop_and_reset_with_a_source_stuck_in_fill_fail_then_work_once_it_returns() {
    crate::on_sim(|sim| {
        let (source, gate, noted) = stuck_source(3);
        let mut batches = DevicePrefetcher::builder(source, sim).depth(1).join_timeout(JOIN_TIMEOUT).build().unwrap();
        for expected in 0..2 {
            assert_eq!(batches.next().unwrap().unwrap().index(), expected); // then batch 2 is staged
        }
        assert_eq!(noted.recv_timeout(NOTED).ok(), Some(Note::Entered(3)));
        let (send, receive) = mpsc::channel();
        within_30s(move || {
            let mut batches = batches;
            let stuck = |err: Error| match err {
                Error::Prefetch(async_iter::Error::SourceStuck {
                    batch: 3,
                    call: Some(SourceCall::Fill),
                    epoch: 0,
                    waited,
                    source_type,
                }) => {
                    assert_eq!(waited, JOIN_TIMEOUT);
                    assert_eq!(source_type, std::any::type_name::<Stuck<Numbers>>());
                }
                other => panic!("expected the source stuck in fill at batch 3, got {other:?}"),
            };
            stuck(batches.stop().unwrap_err());
            stuck(batches.reset().unwrap_err());
            assert!(batches.next().is_none(), "no epoch meanwhile");
            send.send(batches).unwrap();
        });
        let mut batches = receive.recv().unwrap();
        gate.open();
        assert_eq!(noted.recv_timeout(NOTED).ok(), Some(Note::Filled(3)));
        let deadline = Instant::now() + NOTED;
        while let Err(err) = batches.reset() {
            assert!(Instant::now() < deadline, "reset still fails after the source returned: {err}");
        }
        let mut seen = 0;
        while let Some(batch) = batches.next() {
            let batch = batch.unwrap();
            let rows = partial_last(1, batch.index()).unwrap();
            let x = batch.features::<f32, Ix2>().unwrap().to_host().unwrap();
            assert_eq!(x, expected_features(1, batch.index(), rows));
            seen += 1;
        }
        assert_eq!(seen, 10, "the epoch after the stuck one is whole");
        drop(batches);
        assert_eq!(noted.recv_timeout(NOTED).ok(), Some(Note::Dropped));
    });
}

// ---- on the simulator: a source paced by the consumer, and a drop after a stuck reset ---

/// Batches of 8 rows whose batch `k + 1` is produced only once the consumer has used
/// batch `k` (it says so on `used`), as a source fed by the training loop's own results
/// would be. Gives up with an error after 20 s instead of hanging.
struct Paced {
    used: Receiver<usize>,
}

impl BatchSource for Paced {
    fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
        Ok((index < 5).then(|| BatchLayout::new().features::<f32, _>((8, COLUMNS))))
    }

    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
        let index = batch.index();
        if index > 0 {
            match self.used.recv_timeout(NOTED) {
                Ok(used) if used == index - 1 => {}
                other => return Err(format!("batch {index}: the consumer said {other:?}").into()),
            }
        }
        batch.features::<f32, Ix2>()?.assign(&expected_features(0, index, 8));
        Ok(())
    }
}

#[test]
fn a_source_that_needs_the_batch_before_to_be_used_does_not_deadlock() {
    crate::on_sim(|sim| {
        for threading in [Threading::Background, Threading::Shield] {
            let (used, receive) = mpsc::channel();
            let mut batches =
                DevicePrefetcher::builder(Paced { used: receive }, sim).threading(threading).depth(2).build().unwrap();
            let sim = sim.clone();
            within_30s(move || {
                let mut seen = 0;
                while let Some(batch) = batches.next() {
                    let batch = batch.unwrap();
                    let x = batch.features::<f32, Ix2>().unwrap().to_host().unwrap();
                    assert_eq!(x, expected_features(0, batch.index(), 8), "{threading:?}");
                    let _ = used.send(batch.index());
                    seen += 1;
                }
                assert_eq!(seen, 5, "{threading:?}");
                drop(batches);
                sim.quiesce();
            });
        }
    });
}

#[test]
fn dropping_after_a_reset_that_found_the_source_stuck_does_not_wait_again() {
    crate::on_sim(|sim| {
        const LONG: Duration = Duration::from_secs(2);
        let (source, gate, noted) = stuck_source(2);
        let mut batches = DevicePrefetcher::builder(source, sim).depth(2).join_timeout(LONG).build().unwrap();
        assert_eq!(batches.next().unwrap().unwrap().index(), 0);
        assert_eq!(noted.recv_timeout(NOTED).ok(), Some(Note::Entered(2)));
        let err = batches.reset().unwrap_err();
        assert!(err.to_string().contains("has not returned"), "{err}");
        let started = Instant::now();
        drop(batches);
        // The reset waited its join timeout; the drop returns without a second wait.
        assert!(started.elapsed() < LONG, "the drop waited {:?} again", started.elapsed());
        gate.open();
        assert_eq!(noted.recv_timeout(NOTED).ok(), Some(Note::Filled(2)));
        assert_eq!(noted.recv_timeout(NOTED).ok(), Some(Note::Dropped));
        pinned_memory_released(sim);
    });
}
