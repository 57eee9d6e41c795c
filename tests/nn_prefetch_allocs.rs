//! With workspaces enabled, an epoch of `Network::fit` over a prefetcher allocates the
//! same whatever its number of batches: nothing per batch, on the training thread or
//! on the producer thread (carve's counting allocator counts both; the constant is the
//! per-epoch restart of the producer). With workspaces off the count grows with the
//! batches, which shows the counter counts. The count leaves out the harness's thread
//! (the process's main thread, which starts, times and reports the test while it runs),
//! and the binary holds one test, so that nothing but the code under test is counted.

use carve::async_iter::{InMemory, Prefetcher};
use carve::nn::{Network, NetworkConfig, Updater};
use carve::workspace_core::alloc_check::CountingAllocator;
use carve::workspace_core::alloc_check::{process_counts, Threads};
use carve::WorkspaceMode;
use ndarray::{Array1, Array2};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::system();

/// Heap allocations so far by every thread but the harness's.
fn allocations() -> u64 {
    process_counts(Threads::ExceptMain).allocations
}

/// Allocations per epoch of `fit` (after two warm-up epochs) with `batches` batches.
fn allocs_per_epoch(mode: WorkspaceMode, batches: usize) -> Vec<u64> {
    let rows = batches * 8;
    let x = Array2::from_shape_fn((rows, 10), |(i, j)| ((i * 3 + j) % 7) as f32 / 7.0);
    let y = Array1::from_shape_fn(rows, |i| (i % 4) as u32);
    let config = NetworkConfig::builder(10)
        .dense(12)
        .relu()
        .dense(4)
        .updater(Updater::adam(1e-3))
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode)
        .build()
        .unwrap();
    let mut net = Network::new(config).unwrap();
    let mut prefetcher =
        Prefetcher::builder(InMemory::new(x, y, 8).unwrap().shuffled(4)).workspace_mode(mode).build().unwrap();
    for _ in 0..2 {
        net.fit(&mut prefetcher).unwrap();
    }
    (0..4)
        .map(|_| {
            let before = allocations();
            net.fit(&mut prefetcher).unwrap();
            allocations() - before
        })
        .collect()
}

#[test]
fn an_epoch_allocates_nothing_per_batch_with_workspaces_enabled() {
    let short = allocs_per_epoch(WorkspaceMode::Enabled, 4);
    let long = allocs_per_epoch(WorkspaceMode::Enabled, 64);
    // The producer's restart is the same every epoch; a single allocation per batch
    // anywhere would add 60 to the long epochs.
    let (short_max, long_min) = (*short.iter().max().unwrap(), *long.iter().min().unwrap());
    assert!(long_min <= short_max, "allocations per epoch: 4 batches {short:?}, 64 batches {long:?}");
    assert!(short_max < 60, "the per-epoch constant is small: {short:?}");

    let short = allocs_per_epoch(WorkspaceMode::None, 4);
    let long = allocs_per_epoch(WorkspaceMode::None, 64);
    assert!(
        long.iter().min().unwrap() >= &(short.iter().max().unwrap() + 60 * 10),
        "workspaces off: every batch allocates ({short:?} vs {long:?})"
    );
}
