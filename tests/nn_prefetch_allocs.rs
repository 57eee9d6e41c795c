//! With workspaces enabled, an epoch of `Network::fit` over a prefetcher allocates the
//! same whatever its number of batches: nothing per batch, on the training thread or
//! on the producer thread (a global counter counts both; the constant is the
//! per-epoch restart of the producer). With workspaces off the count grows with the
//! batches, which shows the counter counts. The counter leaves out the harness's
//! thread (which starts, times and reports the test while it runs), and the binary
//! holds one test, so that nothing but the code under test is counted.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use carve::async_iter::{InMemory, Prefetcher};
use carve::nn::{Network, NetworkConfig, Updater};
use carve::WorkspaceMode;
use ndarray::{Array1, Array2};

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Whether this thread is the harness's: unknown until its first allocation.
    static HARNESS: Cell<Option<bool>> = const { Cell::new(None) };
}

/// Counts an allocation unless the harness made it: libtest's main thread starts each
/// test on a thread of its own and then waits, times and reports; what it allocates
/// meanwhile is not the code under test's. Never allocates.
fn count() {
    let harness = HARNESS
        .try_with(|harness| match harness.get() {
            Some(known) => known,
            None => {
                let known = is_main_thread();
                harness.set(Some(known));
                known
            }
        })
        .unwrap_or(false);
    if !harness {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(target_os = "linux")]
fn is_main_thread() -> bool {
    // SAFETY: gettid takes nothing, cannot fail and touches no memory of ours.
    let tid = unsafe { libc::gettid() };
    tid as u32 == std::process::id() // the main thread's id is the process's
}

#[cfg(not(target_os = "linux"))]
fn is_main_thread() -> bool {
    false
}

// SAFETY: forwards to `System` unchanged; the counter is an atomic and a
// const-initialised thread-local without destructor, and telling the harness's thread
// apart is one system call: none of it allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

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
            let before = ALLOCS.load(Ordering::Relaxed);
            net.fit(&mut prefetcher).unwrap();
            ALLOCS.load(Ordering::Relaxed) - before
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
