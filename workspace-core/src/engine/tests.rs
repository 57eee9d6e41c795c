//! The first learning cycle's reservation, against a backend that records what
//! the engine asks of it (the engine never touches memory, so its blocks are
//! plain numbers).

use std::sync::{Arc, Mutex};

use super::*;
use crate::config::{AllocationPolicy, LearningPolicy, SpillPolicy};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Arena,
    Spill,
    Reserved,
}

#[derive(Debug)]
struct FakeBlock {
    base: usize,
    len: usize,
    kind: Kind,
}

// SAFETY: the engine never dereferences a base (it deals in offsets) and these
// tests only compare the numbers, so fake addresses describe no memory anyone touches.
unsafe impl Block for FakeBlock {
    type Base = usize;
    fn base(&self) -> usize {
        self.base
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// What the engine asked for, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Arena(usize),
    Spill(usize),
    Reserve { at_least: usize },
    Adopt { base: usize, bytes: usize },
    Release(Kind, usize),
}

struct Recording {
    calls: Arc<Mutex<Vec<Call>>>,
    /// Length of the reservations handed out; `None`: the backend has none.
    reservation: Option<usize>,
    next_base: usize,
    /// Arenas larger than this are refused (out of memory).
    refuse_above: Arc<Mutex<usize>>,
}

impl Recording {
    fn block(&mut self, len: usize, kind: Kind) -> FakeBlock {
        self.next_base += 1 << 32;
        FakeBlock { base: self.next_base, len, kind }
    }
}

// SAFETY: as for `FakeBlock`: the blocks are numbers the tests compare, never memory.
unsafe impl ArenaBackend for Recording {
    type Block = FakeBlock;
    fn kind(&self) -> &'static str {
        "recording"
    }
    fn base_alignment(&self) -> usize {
        4096
    }
    fn allocate_arena(&mut self, bytes: usize, _align: usize) -> Result<FakeBlock, BackendError> {
        self.calls.lock().unwrap().push(Call::Arena(bytes));
        if bytes > *self.refuse_above.lock().unwrap() {
            return Err(BackendError::OutOfMemory { bytes, align: _align });
        }
        Ok(self.block(bytes, Kind::Arena))
    }
    fn allocate_spill(&mut self, bytes: usize, _align: usize) -> Result<FakeBlock, BackendError> {
        self.calls.lock().unwrap().push(Call::Spill(bytes));
        Ok(self.block(bytes, Kind::Spill))
    }
    fn reserve(&mut self, at_least: usize, _at_most: usize, _align: usize) -> Option<FakeBlock> {
        let len = self.reservation?;
        self.calls.lock().unwrap().push(Call::Reserve { at_least });
        Some(self.block(len, Kind::Reserved))
    }
    fn adopt(&mut self, block: FakeBlock, bytes: usize) -> Result<FakeBlock, FakeBlock> {
        self.calls.lock().unwrap().push(Call::Adopt { base: block.base, bytes });
        if block.kind == Kind::Reserved && bytes <= block.len {
            Ok(FakeBlock { base: block.base, len: bytes, kind: Kind::Arena })
        } else {
            Err(block)
        }
    }
    fn release(&mut self, block: FakeBlock) {
        self.calls.lock().unwrap().push(Call::Release(block.kind, block.len));
    }
}

/// What the engine asked its backend for, shared with the test.
type Calls = Arc<Mutex<Vec<Call>>>;

fn engine(config: WorkspaceConfig, reservation: Option<usize>) -> (Engine<Recording>, Calls) {
    let (e, calls, _) = refusing_engine(config, reservation, usize::MAX);
    (e, calls)
}

/// As [`engine`], with a backend that refuses arenas larger than `refuse_above` bytes
/// (the limit can be changed through the returned handle).
fn refusing_engine(
    config: WorkspaceConfig,
    reservation: Option<usize>,
    refuse_above: usize,
) -> (Engine<Recording>, Calls, Arc<Mutex<usize>>) {
    let calls = Arc::new(Mutex::new(Vec::new()));
    let limit = Arc::new(Mutex::new(refuse_above));
    let backend = Recording { calls: calls.clone(), reservation, next_base: 0, refuse_above: limit.clone() };
    (Engine::new("R", config, backend).unwrap(), calls, limit)
}

fn take(calls: &Mutex<Vec<Call>>) -> Vec<Call> {
    std::mem::take(&mut *calls.lock().unwrap())
}

fn strict() -> crate::config::WorkspaceConfigBuilder {
    WorkspaceConfig::builder().allocation(AllocationPolicy::Strict)
}

/// One cycle allocating `sizes` bytes; returns (base, offset) of each.
fn cycle(e: &Engine<Recording>, sizes: &[usize]) -> Vec<(usize, usize)> {
    e.enter().unwrap();
    let placed = sizes.iter().map(|&n| e.alloc(n, 8).unwrap()).collect();
    // SAFETY: the scope counted by `enter` above; nothing refers to the memory.
    unsafe { e.exit() };
    placed
}

#[test]
fn the_first_cycle_runs_in_a_reservation_that_becomes_the_arena() {
    let (e, calls) = engine(strict().build().unwrap(), Some(1 << 20));
    let first = cycle(&e, &[100, 5000, 64]);
    // All three in the one reservation, packed at the engine's alignment (64).
    let base = first[0].0;
    assert_eq!(first, vec![(base, 0), (base, 128), (base, 5184)]);
    assert_eq!(
        take(&calls),
        vec![Call::Reserve { at_least: 100 }, Call::Adopt { base, bytes: 5248 }],
        "no arena allocated, nothing released: the reservation is the arena"
    );
    assert_eq!(e.capacity(), 5248);
    assert_eq!(e.arena_extent(), Some((base, 5248)));
    let stats = e.stats();
    assert_eq!((stats.bytes_spilled, stats.external_allocations, stats.learned_size), (5164, 3, Some(5248)));
    // The second cycle reuses the same memory from the arena, asking for nothing.
    assert_eq!(cycle(&e, &[100, 5000, 64]), first);
    assert!(take(&calls).is_empty());
    assert_eq!(e.stats().external_allocations, 3);
}

#[test]
fn a_first_cycle_larger_than_the_reservation_gets_a_fresh_arena() {
    let (e, calls) = engine(strict().build().unwrap(), Some(8192));
    let first = cycle(&e, &[4096, 4096, 10_000]);
    assert_eq!(first[0].0, first[1].0, "the first two fit in the reservation");
    assert_ne!(first[2].0, first[0].0, "the third spills to a chunk");
    assert_eq!(
        take(&calls),
        vec![
            Call::Reserve { at_least: 4096 },
            // Chunks start at 64 KiB.
            Call::Spill(64 << 10),
            Call::Adopt { base: first[0].0, bytes: 18_240 },
            Call::Release(Kind::Reserved, 8192),
            Call::Arena(18_240),
            Call::Release(Kind::Spill, 64 << 10),
        ]
    );
    assert_eq!(e.capacity(), 18_240);
}

#[test]
fn learning_over_several_cycles_adopts_only_the_last_reservation() {
    let config = strict().learning(LearningPolicy::OverTime { cycles: 2 }).build().unwrap();
    let (e, calls) = engine(config, Some(1 << 20));
    let one = cycle(&e, &[1000]);
    assert_eq!(take(&calls), vec![Call::Reserve { at_least: 1000 }, Call::Release(Kind::Reserved, 1 << 20)]);
    assert_eq!(e.capacity(), 0);
    let two = cycle(&e, &[3000]);
    assert_ne!(one[0].0, two[0].0, "each learning cycle has a reservation of its own");
    assert_eq!(take(&calls), vec![Call::Reserve { at_least: 3000 }, Call::Adopt { base: two[0].0, bytes: 3008 }]);
    assert_eq!(e.capacity(), 3008);
}

#[test]
fn without_learning_or_with_an_arena_nothing_is_reserved() {
    // No learning: spills go to chunks and are freed at the reset.
    let config = strict().learning(LearningPolicy::None).spill(SpillPolicy::External).build().unwrap();
    let (e, calls) = engine(config, Some(1 << 20));
    cycle(&e, &[100]);
    assert_eq!(take(&calls), vec![Call::Spill(64 << 10), Call::Release(Kind::Spill, 64 << 10)]);
    // An initial arena: learning grows it from chunks as before.
    let (e, calls) = engine(strict().initial_size(4096).build().unwrap(), Some(1 << 20));
    assert_eq!(take(&calls), vec![Call::Arena(4096)]);
    cycle(&e, &[5000]);
    assert_eq!(
        take(&calls),
        vec![
            Call::Spill(64 << 10),
            Call::Arena(5056),
            Call::Release(Kind::Arena, 4096),
            Call::Release(Kind::Spill, 64 << 10)
        ]
    );
    // Spill-everything (a debugging aid) keeps one block per allocation.
    let (e, calls) = engine(strict().build().unwrap(), Some(1 << 20));
    e.set_spill_everything(true).unwrap();
    cycle(&e, &[100, 200]);
    let calls = take(&calls);
    assert_eq!(&calls[..2], &[Call::Spill(100), Call::Spill(200)]);
    assert!(!calls.iter().any(|c| matches!(c, Call::Reserve { .. } | Call::Adopt { .. })), "{calls:?}");
}

#[test]
fn a_backend_without_reservations_learns_from_chunks() {
    let (e, calls) = engine(strict().build().unwrap(), None);
    cycle(&e, &[100, 5000]);
    assert_eq!(take(&calls), vec![Call::Spill(64 << 10), Call::Arena(5184), Call::Release(Kind::Spill, 64 << 10)]);
}

#[test]
fn a_reservation_too_small_for_the_first_request_is_given_back() {
    let (e, calls) = engine(strict().build().unwrap(), Some(4096));
    cycle(&e, &[10_000]);
    assert_eq!(
        take(&calls),
        vec![
            Call::Reserve { at_least: 10_000 },
            Call::Release(Kind::Reserved, 4096),
            Call::Spill(64 << 10),
            Call::Arena(10_048),
            Call::Release(Kind::Spill, 64 << 10),
        ]
    );
}

/// Opens a cycle, allocates `sizes` and closes it; the error of the `enter`, if any.
fn try_cycle(e: &Engine<Recording>, sizes: &[usize]) -> Result<()> {
    e.enter()?;
    for &n in sizes {
        e.alloc(n, 8).unwrap();
    }
    // SAFETY: the scope counted by `enter` above; nothing refers to the memory.
    unsafe { e.exit() };
    Ok(())
}

#[test]
fn a_refused_growth_is_reported_once_and_retried_only_after_a_back_off() {
    // The default configuration (learning in the first cycle, Reallocate) with a backend
    // that can never back the learned arena.
    let (e, calls, _) = refusing_engine(WorkspaceConfig::default(), None, 1000);
    let outcomes: Vec<bool> = (0..40).map(|_| try_cycle(&e, &[3000, 3000]).is_ok()).collect();
    // The refusal at the end of the first cycle makes the second enter fail; every
    // other enter succeeds and its cycle runs from spill blocks.
    let mut expected = vec![true; 40];
    expected[1] = false;
    assert_eq!(outcomes, expected);
    let arenas = take(&calls).iter().filter(|c| matches!(c, Call::Arena(_))).count();
    // 39 cycles ran: the first refusal, then retries after 2, 4, 8 and 16 cycles.
    assert_eq!(arenas, 5, "the same growth is not asked for every cycle");
    let stats = e.stats();
    assert_eq!((stats.failed_growths, stats.capacity, stats.cycles), (5, 0, 39));
    assert_eq!(stats.cycles_spilled_after_learning, 38);
}

#[test]
fn a_larger_growth_waits_for_the_back_off_and_memory_that_comes_back_is_used() {
    let config = strict().learning(LearningPolicy::None).spill(SpillPolicy::Reallocate).build().unwrap();
    let (e, calls, limit) = refusing_engine(config, None, 5000);
    try_cycle(&e, &[10_000]).unwrap();
    assert_eq!(take(&calls), vec![Call::Spill(64 << 10), Call::Arena(10_048), Call::Release(Kind::Spill, 64 << 10)]);
    let err = try_cycle(&e, &[]).expect_err("the refusal is reported");
    assert!(matches!(err, Error::Backend { source: BackendError::OutOfMemory { bytes: 10_048, .. }, .. }), "{err:?}");
    // A larger cycle wants a larger arena, which would be refused too: not asked for yet.
    try_cycle(&e, &[20_000]).unwrap();
    assert!(!take(&calls).iter().any(|c| matches!(c, Call::Arena(_))));
    // Memory comes back: the growth succeeds at the next retry, with no error on the way.
    *limit.lock().unwrap() = usize::MAX;
    let mut cycles = 0;
    while e.capacity() == 0 {
        try_cycle(&e, &[20_000]).unwrap();
        cycles += 1;
        assert!(cycles <= 4, "retried within the back-off");
    }
    assert_eq!(e.capacity(), 20_032);
    let stats = e.stats();
    assert_eq!((stats.growth_events, stats.failed_growths), (1, 1));
}

#[test]
fn restoring_the_arena_after_trim_is_reported_once() {
    let config = strict().learning(LearningPolicy::None).initial_size(4096).build().unwrap();
    let (e, _calls, limit) = refusing_engine(config, None, usize::MAX);
    try_cycle(&e, &[100]).unwrap();
    e.trim().unwrap();
    *limit.lock().unwrap() = 1000;
    assert!(try_cycle(&e, &[100]).is_err(), "the arena could not come back: said once");
    for _ in 0..10 {
        try_cycle(&e, &[100]).unwrap();
    }
    // Meanwhile Reallocate grew a small arena for the cycle (smaller than the size
    // refused, so tried at once); the configured size stays refused.
    assert_eq!(e.capacity(), 128);
    *limit.lock().unwrap() = usize::MAX;
    // Tried again after the back-off, silently; then the arena is back.
    let mut cycles = 0;
    while e.capacity() != 4096 {
        try_cycle(&e, &[100]).unwrap();
        cycles += 1;
        assert!(cycles <= 16, "retried within the back-off");
    }
    assert!(e.stats().failed_growths >= 2);
}

/// A cycle allocating `sizes`, whatever each allocation gives; the error of the enter.
fn cycle_allowing_refusals(e: &Engine<Recording>, sizes: &[usize]) -> Result<usize> {
    e.enter()?;
    let handed_out = sizes.iter().filter(|&&n| e.alloc(n, 8).is_ok()).count();
    // SAFETY: the scope counted by `enter` above; nothing refers to the memory.
    unsafe { e.exit() };
    Ok(handed_out)
}

#[test]
fn a_refused_growth_is_asked_for_again_whatever_the_spill_policy() {
    for spill in [SpillPolicy::Fail, SpillPolicy::External] {
        let (e, calls, limit) = refusing_engine(strict().spill(spill).build().unwrap(), None, 1000);
        cycle_allowing_refusals(&e, &[3000]).unwrap(); // learned, refused
        assert!(cycle_allowing_refusals(&e, &[100]).is_err(), "{spill:?}: reported once");
        // Without an arena a Fail workspace refuses; an External one spills.
        let handed_out = cycle_allowing_refusals(&e, &[100]).unwrap();
        assert_eq!(handed_out, usize::from(spill == SpillPolicy::External), "{spill:?}");
        take(&calls);
        // Memory comes back: the size learned is asked for again within the back-off.
        *limit.lock().unwrap() = usize::MAX;
        let mut cycles = 0;
        while e.capacity() == 0 {
            cycle_allowing_refusals(&e, &[100]).unwrap();
            cycles += 1;
            assert!(cycles <= 8, "{spill:?}: retried within the back-off");
        }
        assert_eq!(e.capacity(), 3008, "{spill:?}");
        assert_eq!(cycle_allowing_refusals(&e, &[3000]).unwrap(), 1, "{spill:?}: served by the arena");
        assert_eq!(e.stats().growth_events, 1, "{spill:?}");
    }
}
