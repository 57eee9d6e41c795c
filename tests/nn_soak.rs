//! 10,000 training iterations with workspaces enabled: flat workspace memory and no
//! heap allocation per iteration after warm-up, counted by a global allocator; with
//! workspaces off the same loop allocates (proof that the counter counts).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use carve::nn::{Network, NetworkConfig, Rng, Updater};
use carve::WorkspaceMode;
use ndarray::{s, Array1, Array2};

struct Counting;

thread_local! {
    static THREAD_ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards to `System` unchanged; the counter is a const-initialised
// thread-local, which does not allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = THREAD_ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = THREAD_ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn thread_allocs() -> u64 {
    THREAD_ALLOCS.with(Cell::get)
}

/// Scales iteration counts down under valgrind (`CARVE_SOAK_SCALE=10` divides by 10).
fn scaled(n: usize) -> usize {
    let scale: usize = std::env::var("CARVE_SOAK_SCALE").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    (n / scale.max(1)).max(10)
}

fn data(rows: usize) -> (Array2<f32>, Array1<u32>) {
    let mut rng = Rng::new(3);
    let y: Array1<u32> = (0..rows).map(|i| (i % 4) as u32).collect();
    let x = Array2::from_shape_fn((rows, 12), |(i, j)| (y[i] as f32 - 1.5) * (j % 3) as f32 + rng.uniform(-0.3, 0.3));
    (x, y)
}

fn network(mode: WorkspaceMode) -> Network {
    let config = NetworkConfig::builder(12)
        .dense(24)
        .relu()
        .dense(16)
        .relu()
        .dense(4)
        .seed(9)
        .updater(Updater::adam(1e-3))
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode)
        .build()
        .unwrap();
    Network::new(config).unwrap()
}

#[test]
fn ten_thousand_iterations_allocate_nothing_and_stay_flat() {
    let (x, y) = data(100);
    let batches: Vec<(usize, usize)> = (0..100).step_by(16).map(|start| (start, (start + 16).min(100))).collect();
    let mut net = network(WorkspaceMode::Enabled);
    // Warm-up: three epochs, including the ragged last batch (4 rows); the
    // workspaces learn over their first 16 cycles.
    for _ in 0..3 {
        for &(a, b) in &batches {
            net.fit_batch(x.slice(s![a..b, ..]), y.slice(s![a..b])).unwrap();
        }
    }
    let capacity = net.workspace_capacity();
    assert!(capacity > 0);
    let iterations = scaled(10_000);
    let before = thread_allocs();
    let mut last_loss = f32::NAN;
    for i in 0..iterations {
        let (a, b) = batches[i % batches.len()];
        last_loss = net.fit_batch(x.slice(s![a..b, ..]), y.slice(s![a..b])).unwrap();
    }
    let allocs = thread_allocs() - before;
    assert_eq!(allocs, 0, "{allocs} heap allocations in {iterations} steady-state iterations");
    assert_eq!(net.workspace_capacity(), capacity, "workspace memory grew after warm-up");
    assert!(last_loss.is_finite() && last_loss < 0.5, "the network did not learn: loss {last_loss}");
    // Evaluation with workspaces allocates nothing either, once its workspaces have
    // learned.
    for _ in 0..5 {
        net.evaluate(x.view(), y.view(), 32).unwrap();
    }
    let before = thread_allocs();
    let accuracy = net.evaluate(x.view(), y.view(), 32).unwrap();
    assert_eq!(thread_allocs() - before, 0);
    assert!(accuracy > 0.9, "accuracy {accuracy}");

    // The same loop without workspaces allocates every iteration.
    let mut off = network(WorkspaceMode::None);
    off.fit_batch(x.slice(s![0..16, ..]), y.slice(s![0..16])).unwrap();
    let before = thread_allocs();
    off.fit_batch(x.slice(s![0..16, ..]), y.slice(s![0..16])).unwrap();
    assert!(thread_allocs() - before >= 10, "WorkspaceMode::None should allocate per array");
}
