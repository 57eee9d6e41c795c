//! Long-running memory behaviour, measured with a counting global allocator: flat
//! capacity and zero heap allocations per steady-state cycle, and plateaus under
//! variable sizes. (Whole-process memory left behind by threads is measured in
//! `threads.rs`, a binary of its own: no other test may run, or finish, meanwhile.)
//!
//! The tests in this binary share the allocator counters, so they run one at a time.

mod common;

use std::sync::Mutex;

use common::scaled;
use workspace_core::alloc_check::{AllocationGuard, CountingAllocator};
use workspace_core::{AllocationPolicy, DebugMode, LearningPolicy, SpillPolicy, Workspace, WorkspaceConfig};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::system();

static SERIAL: Mutex<()> = Mutex::new(());

/// One training-shaped step: forward activations, backward gradients, scratch.
fn step(ws: &Workspace, batch: usize) -> f32 {
    let scope = ws.enter().unwrap();
    let x = scope.filled::<f32, _>((batch, 64), 0.5).unwrap();
    let mut h1 = scope.zeros::<f32, _>((batch, 128)).unwrap();
    let mut h2 = scope.uninit::<f32, _>((batch, 64)).unwrap();
    h1.column_mut(0).assign(&x.column(0));
    h2.fill(std::mem::MaybeUninit::new(1.0));
    let grads = scope.slice_zeroed::<f32>(128 * 64).unwrap();
    grads[7] = h1[[0, 0]];
    let scratch = scope.zeros_handle::<f64, _>(256).unwrap();
    let mut total = grads[7];
    total += scratch.view(&scope).unwrap().len() as f32;
    total
}

#[test]
fn fixed_shape_soak_is_flat_and_allocation_free() {
    let _serial = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let ws = Workspace::with_debug_mode("SOAK", WorkspaceConfig::default(), DebugMode::Disabled).unwrap();
    for _ in 0..5 {
        step(&ws, 32);
    }
    let warm_capacity = ws.capacity();
    assert!(warm_capacity > 0);
    let cycles = scaled(10_000);
    let guard = AllocationGuard::begin().unwrap();
    let mut sink = 0.0;
    for _ in 0..cycles {
        sink += step(&ws, 32);
    }
    let report = guard.finish();
    assert!(report.is_none(), "over {cycles} steady cycles: {report}");
    assert_eq!(ws.capacity(), warm_capacity, "capacity changed after warm-up");
    let stats = ws.stats();
    assert_eq!(stats.external_allocations, 5, "only the learning cycle spilled (its 5 arrays)");
    assert_eq!(stats.growth_events, 1);
    assert!(sink > 0.0);
    // The counter does count: a plain Vec allocates.
    let guard = AllocationGuard::begin().unwrap();
    let v = std::hint::black_box(vec![0u8; 100]);
    assert_eq!(guard.finish().allocations(), 1);
    drop(v);
}

/// A deterministic xorshift generator.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn variable_run(spill: SpillPolicy) -> (Vec<usize>, Workspace, usize) {
    let config = WorkspaceConfig::builder()
        .allocation(AllocationPolicy::Overallocate(0.25))
        .learning(LearningPolicy::FirstLoop)
        .spill(spill)
        .build()
        .unwrap();
    let ws = Workspace::with_debug_mode("VARIABLE", config, DebugMode::Disabled).unwrap();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut capacities = Vec::new();
    let mut max_cycle = 0;
    let cycles = scaled(5_000);
    for i in 0..cycles {
        // Rare random spikes, and at least one even in a scaled-down run.
        let spike = (i > 100 && rng.next().is_multiple_of(500)) || i == cycles / 2;
        let elements = if spike { 1 << 20 } else { 20_000 + (rng.next() % 40_000) as usize };
        {
            let scope = ws.enter().unwrap();
            let mut a = scope.uninit::<f32, _>(elements).unwrap();
            a[elements - 1] = std::mem::MaybeUninit::new(1.0);
            let b = scope.zeros::<f32, _>(1000).unwrap();
            assert_eq!(b[999], 0.0);
        }
        max_cycle = max_cycle.max(ws.stats().last_cycle_bytes);
        capacities.push(ws.capacity());
    }
    (capacities, ws, max_cycle)
}

#[test]
fn variable_sizes_with_rare_spikes() {
    let _serial = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (caps, ws, max_cycle) = variable_run(SpillPolicy::Reallocate);
    let distinct: Vec<usize> = caps.windows(2).filter(|w| w[0] != w[1]).map(|w| w[1]).collect();
    let final_capacity = *caps.last().unwrap();
    assert_eq!(final_capacity, ws.config().capacity_for(max_cycle), "plateau at the spike's learned size");
    assert!(distinct.len() <= 3, "capacity changed too often: {distinct:?}");
    assert!(max_cycle > 4 << 20, "a spike happened");
    let first_at_final = caps.iter().position(|&c| c == final_capacity).unwrap();
    assert!(caps[first_at_final..].iter().all(|&c| c == final_capacity), "grew once, then flat");

    let (caps, ws, _) = variable_run(SpillPolicy::External);
    let learned = caps[0];
    assert!(caps.iter().all(|&c| c == learned), "under External nothing grows");
    assert!(ws.stats().external_allocations > 1, "spikes spilled");
    assert_eq!(ws.stats().spilled_in_use, 0);
}
