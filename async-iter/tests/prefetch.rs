//! The prefetcher end to end: contents of every batch over many epochs, the last
//! partial batch, failures at their batch, growth, lifecycle, bad input, heap
//! allocations in steady state, and property tests against a model.
//!
//! `PROPTEST_CASES` sets the number of property cases and `CARVE_SOAK_SCALE` divides
//! the long loops (both for valgrind).

mod common;

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use async_iter::{
    BatchLayout, BatchMut, BatchSource, Error, LayoutError, Prefetcher, Role, SourceCall, SourceError, Threading,
};
use common::{checksum, expected_checksum, mix, scaled, thread_allocs, Pattern, COLS};
use ndarray::{Ix1, Ix2, IxDyn};
use proptest::prelude::*;
use workspace_core::WorkspaceMode;

#[global_allocator]
static GLOBAL: workspace_core::alloc_check::CountingAllocator =
    workspace_core::alloc_check::CountingAllocator::system();

/// Bytes of a [`Pattern`] batch of `rows` rows in the ring: `u32` features and `u16`
/// labels, each rounded up to 64 bytes.
fn batch_bytes(rows: usize) -> usize {
    (rows * COLS * 4).next_multiple_of(64) + (rows * 2).next_multiple_of(64)
}

/// The slot a batch of `bytes` sizes: `bytes × (1 + headroom)`, rounded up to 64.
fn slot_for(bytes: usize, headroom: f64) -> usize {
    (((bytes as f64) * (1.0 + headroom)).ceil() as usize).max(bytes).next_multiple_of(64)
}

/// Busy work standing in for a training step: a slow consumer.
fn step(work: u64) -> u64 {
    (0..work).fold(0_u64, |acc, i| black_box(acc.wrapping_mul(31).wrapping_add(i)))
}

/// Rows of batch `index` of `epoch`: 1 to 64, pseudo-random, `batches` per epoch.
fn random_rows(seed: u64, batches: usize) -> impl FnMut(u64, usize) -> usize + Send + 'static {
    move |epoch, index| if index < batches { 1 + (mix(seed ^ epoch << 32 ^ index as u64) % 64) as usize } else { 0 }
}

const ALL_MODES: [(WorkspaceMode, Threading); 3] = [
    (WorkspaceMode::Enabled, Threading::Background),
    (WorkspaceMode::None, Threading::Background),
    (WorkspaceMode::Enabled, Threading::Shield),
];

#[test]
fn every_batch_is_intact_over_ten_epochs_of_random_sizes_with_a_slow_consumer() {
    let batches_per_epoch = scaled(60);
    for (depth, (mode, threading)) in [(1, ALL_MODES[0]), (2, ALL_MODES[0]), (3, ALL_MODES[1]), (2, ALL_MODES[2])] {
        let seed = 7 + depth as u64;
        let mut rows = random_rows(seed, batches_per_epoch);
        let source = Pattern::new(seed, random_rows(seed, batches_per_epoch));
        let mut batches =
            Prefetcher::builder(source).depth(depth).workspace_mode(mode).threading(threading).build().unwrap();
        for epoch in 0..10 {
            let mut seen = 0;
            while let Some(lease) = batches.next() {
                let lease = lease.unwrap();
                let index = lease.index();
                assert_eq!((lease.epoch(), index), (epoch, seen), "batches arrive in order");
                let expected = expected_checksum(seed, epoch, index, rows(epoch, index));
                assert_eq!(checksum(&lease), expected, "batch {index} of epoch {epoch} on arrival ({mode:?})");
                // The producer runs ahead meanwhile; nothing it does may touch this batch.
                black_box(step(20_000));
                assert_eq!(checksum(&lease), expected, "batch {index} of epoch {epoch} after the step ({mode:?})");
                seen += 1;
            }
            assert_eq!(seen, batches_per_epoch);
            if epoch < 9 {
                batches.reset().unwrap();
            }
        }
        let stats = batches.stats();
        assert_eq!(stats.batches_consumed, 10 * batches_per_epoch as u64);
        assert_eq!(stats.batches_produced, stats.batches_consumed);
    }
}

#[test]
fn the_last_partial_batch_arrives_whole() {
    // 100 rows in batches of 32.
    let source = Pattern::new(0, |_, index| [32, 32, 32, 4, 0][index.min(4)]);
    let mut batches = Prefetcher::builder(source).build().unwrap();
    let mut shapes = Vec::new();
    while let Some(lease) = batches.next() {
        let lease = lease.unwrap();
        shapes.push(lease.features::<u32, Ix2>().unwrap().dim());
        assert_eq!(checksum(&lease), expected_checksum(0, 0, lease.index(), shapes.last().unwrap().0));
    }
    assert_eq!(shapes, [(32, COLS), (32, COLS), (32, COLS), (4, COLS)]);
    let stats = batches.stats();
    assert_eq!(stats.first_batch_bytes, batch_bytes(32));
    assert_eq!((stats.ring_growths, stats.ring_bytes), (0, 3 * batch_bytes(32)));
    assert!(batches.next().is_none(), "the epoch stays over");
}

/// A source that fails at batch `at`, in `call`, by panicking or returning an error.
struct Failing {
    at: usize,
    call: SourceCall,
    panic: bool,
    armed: bool,
}

impl Failing {
    fn fail(&mut self, call: SourceCall, index: usize) -> Result<(), SourceError> {
        if self.armed && self.call == call && self.at == index {
            if self.panic {
                panic!("source exploded at batch {index}");
            }
            return Err(format!("source failed at batch {index}").into());
        }
        Ok(())
    }
}

impl BatchSource for Failing {
    fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
        self.fail(SourceCall::NextLayout, index)?;
        Ok((index < 8).then(|| BatchLayout::new().features::<u64, _>(3)))
    }

    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
        self.fail(SourceCall::Fill, batch.index())?;
        batch.features::<u64, Ix1>()?.fill(batch.index() as u64);
        Ok(())
    }

    fn reset(&mut self) -> Result<(), SourceError> {
        self.armed = false; // the next epoch recovers
        Ok(())
    }
}

#[test]
fn a_producer_panic_or_error_on_batch_k_is_reported_at_batch_k() {
    for threading in [Threading::Background, Threading::Shield] {
        for (k, call, panic) in [
            (0, SourceCall::Fill, true),
            (3, SourceCall::Fill, true),
            (5, SourceCall::NextLayout, true),
            (2, SourceCall::Fill, false),
            (7, SourceCall::NextLayout, false),
        ] {
            let source = Failing { at: k, call, panic, armed: true };
            let mut batches = Prefetcher::builder(source).threading(threading).build().unwrap();
            for index in 0..k {
                let lease = batches.next().unwrap().unwrap();
                assert_eq!(lease.features::<u64, Ix1>().unwrap()[0], index as u64);
            }
            let err = batches.next().expect("the failure is not a silent end").unwrap_err();
            match (&err, panic) {
                (Error::SourcePanicked { batch, call: c, message, epoch: 0 }, true) => {
                    assert_eq!((*batch, *c), (k, call));
                    assert_eq!(message, &format!("source exploded at batch {k}"));
                }
                (Error::Source { batch, call: c, source, epoch: 0 }, false) => {
                    assert_eq!((*batch, *c), (k, call));
                    assert_eq!(source.to_string(), format!("source failed at batch {k}"));
                }
                _ => panic!("batch {k}, {call}, panic {panic}: unexpected {err:?}"),
            }
            assert!(batches.next().is_none(), "the error is reported once, then the epoch is over");
            batches.reset().unwrap();
            let mut count = 0;
            batches
                .try_for_each(|_| -> Result<(), Error> {
                    count += 1;
                    Ok(())
                })
                .unwrap();
            assert_eq!(count, 8, "the next epoch runs in full");
        }
    }
}

#[test]
fn variable_sizes_with_a_rare_spike_grow_the_ring_once_then_stay_flat() {
    // 48 rows first, then 1 to 48, with one batch of 300 rows in epoch 1.
    let rows = |epoch: u64, index: usize| match (epoch, index) {
        (_, 0) => 48,
        (1, 17) => 300,
        (_, i) if i < 40 => 1 + (mix(epoch << 32 ^ i as u64) % 48) as usize,
        _ => 0,
    };
    let source = Pattern::new(3, rows);
    let mut batches = Prefetcher::builder(source).depth(2).build().unwrap();
    let mut ring_after_epoch = Vec::new();
    for epoch in 0..6 {
        batches
            .try_for_each(|lease| -> Result<(), Error> {
                assert_eq!(checksum(&lease), expected_checksum(3, epoch, lease.index(), rows(epoch, lease.index())));
                Ok(())
            })
            .unwrap();
        let stats = batches.stats();
        ring_after_epoch.push((stats.ring_bytes, stats.ring_growths));
        batches.reset().unwrap();
    }
    let (first, spike) = (batch_bytes(48), batch_bytes(300));
    assert_eq!(ring_after_epoch[0], (3 * first, 0));
    assert!(ring_after_epoch[1..].iter().all(|&r| r == (3 * spike, 1)), "{ring_after_epoch:?}");
    assert_eq!(batches.stats().first_batch_bytes, first);
}

/// A source that records the producer thread's allocation count at every fill.
struct Recording {
    batches: usize,
    rows: usize,
    allocs_at_fill: Arc<Vec<AtomicU64>>,
}

impl BatchSource for Recording {
    fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
        let rows = if index + 1 == self.batches { self.rows / 2 } else { self.rows };
        Ok((index < self.batches).then(|| BatchLayout::new().features::<f32, _>((rows, 16)).labels::<u32, _>(rows)))
    }

    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
        self.allocs_at_fill[batch.index()].store(thread_allocs(), Ordering::Relaxed);
        batch.features::<f32, Ix2>()?.fill(batch.index() as f32);
        batch.labels::<u32, Ix1>()?.fill(1);
        Ok(())
    }
}

/// Heap allocations per batch in steady state: (producer thread, consumer thread).
fn allocations_per_batch(mode: WorkspaceMode) -> (u64, u64) {
    let batches = scaled(2_000);
    let warm_up = 5;
    let allocs_at_fill = Arc::new((0..batches).map(|_| AtomicU64::new(0)).collect::<Vec<_>>());
    let source = Recording { batches, rows: 32, allocs_at_fill: allocs_at_fill.clone() };
    let mut prefetcher = Prefetcher::builder(source).workspace_mode(mode).build().unwrap();
    let mut consumer_before = 0;
    let mut sum = 0.0;
    for index in 0..batches {
        if index == warm_up {
            consumer_before = thread_allocs();
        }
        let lease = prefetcher.next().unwrap().unwrap();
        sum += lease.features::<f32, Ix2>().unwrap()[[0, 0]] + lease.labels::<u32, Ix1>().unwrap()[0] as f32;
    }
    let consumer = thread_allocs() - consumer_before;
    assert!(prefetcher.next().is_none());
    assert!(sum > 0.0);
    let at = |i: usize| allocs_at_fill[i].load(Ordering::Relaxed);
    let producer = at(batches - 1) - at(warm_up);
    let steady = (batches - 1 - warm_up) as u64;
    (producer.div_ceil(steady), consumer.div_ceil(steady))
}

#[test]
fn no_heap_allocation_per_batch_in_steady_state_with_workspaces() {
    assert_eq!(allocations_per_batch(WorkspaceMode::Enabled), (0, 0));
    // The counter counts: without workspaces every batch is a fresh allocation.
    let (producer, consumer) = allocations_per_batch(WorkspaceMode::None);
    assert!(producer >= 1, "WorkspaceMode::None allocates per batch on the producer thread ({producer})");
    assert_eq!(consumer, 0);
}

/// A source that notes when it is dropped, and fills slowly.
struct Noting {
    dropped: Arc<AtomicBool>,
    filled: Arc<AtomicUsize>,
}

impl BatchSource for Noting {
    fn next_layout(&mut self, _: usize) -> Result<Option<BatchLayout>, SourceError> {
        Ok(Some(BatchLayout::new().features::<u8, _>(4096))) // endless
    }

    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
        black_box(step(50_000));
        batch.features::<u8, Ix1>()?.fill(7);
        self.filled.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

impl Drop for Noting {
    fn drop(&mut self) {
        self.dropped.store(true, Ordering::SeqCst);
    }
}

#[test]
fn dropping_or_stopping_early_stops_and_joins_the_producer() {
    for hold in [0, 1, 5] {
        let dropped = Arc::new(AtomicBool::new(false));
        let filled = Arc::new(AtomicUsize::new(0));
        let source = Noting { dropped: dropped.clone(), filled: filled.clone() };
        let mut batches = Prefetcher::builder(source).depth(2).build().unwrap();
        for _ in 0..hold {
            assert_eq!(batches.next().unwrap().unwrap().features::<u8, Ix1>().unwrap()[4095], 7);
        }
        if hold == 5 {
            batches.stop().unwrap();
            assert!(batches.next().is_none(), "stopped: the epoch is over");
            let filled_at_stop = filled.load(Ordering::SeqCst);
            // With no lease out, all depth + 1 slots may be filled ahead.
            assert!(filled_at_stop <= hold + 3, "the producer ran at most 3 ahead ({filled_at_stop})");
            batches.reset().unwrap();
            assert!(batches.next().unwrap().is_ok(), "a new epoch after stop");
        }
        drop(batches);
        assert!(dropped.load(Ordering::SeqCst), "the producer thread was joined and the source dropped");
    }
}

#[test]
fn a_leaked_lease_neither_hangs_nor_corrupts() {
    let source = Pattern::new(5, random_rows(5, 40));
    let mut rows = random_rows(5, 40);
    let mut batches = Prefetcher::builder(source).depth(1).build().unwrap();
    for index in 0..40 {
        let lease = batches.next().unwrap().unwrap();
        assert_eq!(checksum(&lease), expected_checksum(5, 0, index, rows(0, index)));
        if index % 3 == 0 {
            std::mem::forget(lease); // its slot returns at the next `next()`
        }
    }
    assert!(batches.next().is_none());
}

#[test]
fn detached_batches_outlive_the_prefetcher() {
    let source = Pattern::new(11, |_, index| if index < 4 { 3 + index } else { 0 });
    let mut batches = Prefetcher::builder(source).build().unwrap();
    let mut kept = Vec::new();
    while let Some(lease) = batches.next() {
        let lease = lease.unwrap();
        let labels = lease.to_array::<u16, Ix1>(Role::Labels).unwrap();
        kept.push((lease.detach(), labels));
    }
    drop(batches);
    for (index, (batch, labels)) in kept.iter().enumerate() {
        assert_eq!(batch.index(), index);
        let x = batch.features::<u32, Ix2>().unwrap();
        assert_eq!(x.dim(), (3 + index, COLS));
        assert_eq!(x[[1, 2]], common::element(11, 0, index, 0, COLS + 2));
        assert_eq!(batch.labels::<u16, Ix1>().unwrap(), labels.view());
        let owned: ndarray::Array2<u32> = batch.to_array(Role::Features).unwrap();
        assert_eq!(owned, x);
    }
    let moved = std::thread::spawn(move || kept.len()).join().unwrap();
    assert_eq!(moved, 4, "detached batches are Send");
}

#[test]
fn a_prefetcher_can_move_to_another_thread() {
    let mut batches = Prefetcher::builder(Pattern::new(2, |_, index| if index < 3 { 4 } else { 0 })).build().unwrap();
    let first = checksum(&batches.next().unwrap().unwrap());
    let rest = std::thread::spawn(move || {
        let mut sums = Vec::new();
        while let Some(lease) = batches.next() {
            sums.push(checksum(&lease.unwrap()));
        }
        sums
    });
    let rest = rest.join().unwrap();
    assert_eq!(first, expected_checksum(2, 0, 0, 4));
    assert_eq!(rest, [expected_checksum(2, 0, 1, 4), expected_checksum(2, 0, 2, 4)]);
}

/// One batch of the given layout, filled by nobody.
struct Single(BatchLayout);

impl BatchSource for Single {
    fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
        Ok((index == 0).then_some(self.0))
    }
    fn fill(&mut self, _: &mut BatchMut<'_>) -> Result<(), SourceError> {
        Ok(())
    }
}

#[test]
fn bad_input_is_a_typed_error_not_a_panic() {
    let empty = || Single(BatchLayout::new().features::<f32, _>(1));
    for builder in [
        Prefetcher::builder(empty()).depth(0),
        Prefetcher::builder(empty()).depth(async_iter::MAX_DEPTH + 1),
        Prefetcher::builder(empty()).headroom(f64::NAN),
        Prefetcher::builder(empty()).headroom(-0.5),
        Prefetcher::builder(empty()).headroom(f64::INFINITY),
        Prefetcher::builder(empty()).max_ring_bytes(0),
    ] {
        let err = builder.build().unwrap_err();
        assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
    }
    // The same errors whatever the mode: a mode changes where batches live, never which
    // are refused.
    for mode in [WorkspaceMode::Enabled, WorkspaceMode::None] {
        let first_error = |layout: BatchLayout| {
            let builder = Prefetcher::builder(Single(layout)).workspace_mode(mode);
            let mut batches = builder.max_ring_bytes(1 << 20).build().unwrap();
            let err = batches.next().unwrap().unwrap_err();
            assert!(batches.next().is_none());
            assert_eq!(batches.stats().first_batch_bytes, 0, "{mode:?}: a refused batch sized nothing");
            err
        };
        let err = first_error(BatchLayout::new().features::<f32, _>((0, 4)));
        assert!(matches!(err, Error::InvalidLayout { batch: 0, reason: LayoutError::Empty { .. }, .. }), "{err}");
        // Elements of no bytes: nothing to hold either.
        let err = first_error(BatchLayout::new().features::<[f32; 0], _>(8));
        assert!(matches!(err, Error::InvalidLayout { batch: 0, reason: LayoutError::Empty { .. }, .. }), "{err}");
        let err = first_error(BatchLayout::new().features::<f64, _>((usize::MAX / 4, 4)));
        assert!(matches!(err, Error::InvalidLayout { reason: LayoutError::Overflow { .. }, .. }), "{err}");
        // Past what any allocation may hold (`isize::MAX` bytes), though `usize` holds it.
        let err = first_error(BatchLayout::new().features::<u8, _>(isize::MAX as usize + 1));
        assert!(matches!(err, Error::InvalidLayout { reason: LayoutError::Overflow { .. }, .. }), "{err}");
        let err = first_error(BatchLayout::new().labels::<f64, _>(4));
        assert!(matches!(err, Error::InvalidLayout { reason: LayoutError::NoFeatures, .. }), "{err}");
        let err = first_error(BatchLayout::new().features::<f32, _>((1024, 1024)));
        assert!(matches!(err, Error::BatchTooLarge { batch: 0, max_ring_bytes: 1_048_576, .. }), "{mode:?}: {err}");
        assert!(err.to_string().contains("raise `max_ring_bytes`"), "{err}");
    }
}

#[test]
fn typed_access_checks_element_type_dimensionality_and_presence() {
    let layout = BatchLayout::new().features::<f32, _>((2, 3)).labels::<u8, _>(2).labels_mask::<f32, _>(2);
    let mut batches = Prefetcher::builder(Single(layout)).build().unwrap();
    let lease = batches.next().unwrap().unwrap();
    assert_eq!(lease.features::<f32, Ix2>().unwrap().dim(), (2, 3));
    assert_eq!(lease.features::<f32, IxDyn>().unwrap().shape(), &[2, 3]);
    assert!(matches!(lease.features::<u32, Ix2>(), Err(Error::WrongElementType { stored: "f32", .. })));
    assert!(matches!(lease.features::<f32, Ix1>(), Err(Error::WrongDimensionality { stored: 2, requested: 1, .. })));
    assert!(lease.features_mask::<f32, Ix1>().unwrap().is_none());
    assert_eq!(lease.labels_mask::<f32, Ix1>().unwrap().unwrap().sum(), 0.0, "arrays start zeroed");
    assert!(matches!(lease.labels_mask::<u8, Ix1>(), Err(Error::WrongElementType { .. })));
    assert_eq!(lease.layout().spec(Role::Labels).unwrap().shape(), &[2]);
    assert_eq!(lease.bytes(), 3 * 64, "each array starts on a 64-byte boundary");
    let text = format!("{lease:?}");
    assert!(text.contains("index: 0"), "{text}");
}

#[test]
fn statistics_count_both_sides_and_serialise() {
    let source = Pattern::new(1, |_, index| if index < 20 { 8 } else { 0 });
    let mut batches = Prefetcher::builder(source).depth(3).headroom(0.5).build().unwrap();
    batches.try_for_each(|_| -> Result<(), Error> { Ok(()) }).unwrap();
    let stats = batches.stats();
    assert_eq!((stats.batches_produced, stats.batches_consumed, stats.depth, stats.slots), (20, 20, 3, 4));
    assert_eq!(stats.first_batch_bytes, 256);
    assert_eq!(stats.slot_bytes, 384, "256 bytes and half again");
    assert_eq!(stats.ring_bytes, 4 * 384);
    let json = serde_json::to_value(&stats).unwrap();
    for key in ["ring_bytes", "first_batch_bytes", "ring_growths", "batches_produced", "batches_consumed"] {
        assert!(json.get(key).is_some(), "{key} in {json}");
    }
    assert!(json["consumer_wait_ns"].is_u64() && json["producer_wait_ns"].is_u64());
    assert!(stats.to_string().contains("| batches produced / consumed | 20 / 20 |"));
}

// ---- property tests against a model ----------------------------------------------------------

/// What the consumer does with one batch.
#[derive(Clone, Debug)]
enum Action {
    /// Checks the batch, works, checks again.
    Take { work: u64 },
    /// Copies the batch out and keeps the copy to the end of the epoch.
    Detach,
    /// Leaks the lease.
    Forget,
    /// Ends the epoch here (the batch is not taken).
    StopEarly,
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => (0_u64..2_000).prop_map(|work| Action::Take { work }),
        2 => Just(Action::Detach),
        1 => Just(Action::Forget),
        1 => Just(Action::StopEarly),
    ]
}

proptest! {
    // Cases: `PROPTEST_CASES` (256 by default).
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn batches_match_the_model_under_random_programs(
        depth in 1_usize..=4,
        mode in prop_oneof![Just(WorkspaceMode::Enabled), Just(WorkspaceMode::None)],
        threading in prop_oneof![3 => Just(Threading::Background), 1 => Just(Threading::Shield)],
        headroom in prop_oneof![Just(0.0), Just(0.5)],
        epochs in proptest::collection::vec(
            (proptest::collection::vec(1_usize..40, 0..12), proptest::collection::vec(action(), 0..14)),
            1..4,
        ),
    ) {
        let plan: Vec<Vec<usize>> = epochs.iter().map(|(sizes, _)| sizes.clone()).collect();
        let sizes = plan.clone();
        let rows = move |epoch: u64, index: usize| sizes[epoch as usize].get(index).copied().unwrap_or(0);
        let mut batches = Prefetcher::builder(Pattern::new(99, rows))
            .depth(depth)
            .workspace_mode(mode)
            .threading(threading)
            .headroom(headroom)
            .build()
            .unwrap();
        let mut consumed = 0_u64;
        let mut largest_consumed = 0;
        let mut stopped_early = false;
        for (epoch, (sizes, actions)) in epochs.iter().enumerate() {
            let epoch = epoch as u64;
            if epoch > 0 {
                batches.reset().unwrap();
            }
            let mut kept = Vec::new();
            let mut actions = actions.iter().cycle();
            for (index, &rows) in sizes.iter().enumerate() {
                let action = actions.next().cloned().unwrap_or(Action::Take { work: 0 });
                if let Action::StopEarly = action {
                    batches.stop().unwrap();
                    stopped_early = true;
                    break;
                }
                let lease = batches.next().expect("a batch the model has").unwrap();
                consumed += 1;
                largest_consumed = largest_consumed.max(batch_bytes(rows));
                let expected = expected_checksum(99, epoch, index, rows);
                prop_assert_eq!((lease.epoch(), lease.index()), (epoch, index));
                prop_assert_eq!(checksum(&lease), expected);
                match action {
                    Action::Take { work } => {
                        black_box(step(work));
                        prop_assert_eq!(checksum(&lease), expected);
                    }
                    Action::Detach => kept.push((lease.detach(), expected, rows)),
                    Action::Forget => std::mem::forget(lease),
                    Action::StopEarly => unreachable!("handled above"),
                }
            }
            prop_assert!(batches.next().is_none(), "the model has no more batches");
            for (batch, expected, rows) in kept {
                let x = batch.features::<u32, Ix2>().unwrap();
                prop_assert_eq!(x.dim(), (rows, COLS));
                prop_assert_eq!(x[[0, 0]], common::element(99, epoch, batch.index(), 0, 0));
                prop_assert!(expected != 0);
            }
        }
        let stats = batches.stats();
        prop_assert_eq!(stats.batches_consumed, consumed);
        prop_assert!(stats.batches_produced >= consumed);
        // The ring: sized from the first batch, grown by every batch larger than a
        // slot. Which batches the producer described beyond those consumed depends on
        // timing when an epoch stopped early, so the model is exact only without that.
        let (mut model_growths, mut model_slot) = (0, None);
        for bytes in plan.iter().flatten().map(|&r| batch_bytes(r)) {
            match model_slot {
                Some(slot) if bytes <= slot => {}
                Some(_) => (model_growths, model_slot) = (model_growths + 1, Some(slot_for(bytes, headroom))),
                None => model_slot = Some(slot_for(bytes, headroom)),
            }
        }
        let largest_slot = plan.iter().flatten().map(|&r| slot_for(batch_bytes(r), headroom)).max();
        if mode == WorkspaceMode::None {
            prop_assert_eq!((stats.ring_growths, stats.ring_bytes), (0, 0));
        } else if !stopped_early {
            prop_assert_eq!(stats.ring_growths, model_growths);
            prop_assert_eq!(stats.slot_bytes, model_slot.unwrap_or(0));
            prop_assert_eq!(stats.ring_bytes, (depth + 1) * model_slot.unwrap_or(0));
        } else if consumed > 0 {
            prop_assert!(stats.slot_bytes >= largest_consumed);
            prop_assert!(stats.slot_bytes <= largest_slot.unwrap_or(0));
            prop_assert_eq!(stats.ring_bytes, (depth + 1) * stats.slot_bytes);
        }
    }
}
