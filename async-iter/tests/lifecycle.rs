//! 1,000 prefetchers created, partly consumed and dropped leave no thread and no
//! memory behind.
//!
//! The measurement counts the producer threads (`carve-prefetch`) and the live bytes of
//! every thread but the harness's (which starts, times and reports the test while it
//! runs), so this binary holds this one test only: another test running or finishing
//! meanwhile would show up in the bytes.

mod common;

use async_iter::{Prefetcher, Threading};
use common::{live_bytes, mix, producer_threads, scaled, Pattern};
use workspace_core::WorkspaceMode;

#[global_allocator]
static GLOBAL: workspace_core::alloc_check::CountingAllocator =
    workspace_core::alloc_check::CountingAllocator::system();

/// One prefetcher's life: build, take `take` batches (holding some, detaching some),
/// maybe reset, drop.
fn life(cycle: u64) {
    let r = mix(cycle);
    let mode = if r & 1 == 0 { WorkspaceMode::Enabled } else { WorkspaceMode::None };
    let threading = if r.is_multiple_of(7) { Threading::Shield } else { Threading::Background };
    let batches_per_epoch = 1 + (r >> 8) as usize % 6;
    let rows = move |epoch: u64, index: usize| {
        if index < batches_per_epoch {
            1 + (mix(cycle ^ epoch << 20 ^ index as u64) % 300) as usize
        } else {
            0
        }
    };
    let depth = 1 + (r >> 16) as usize % 3;
    let mut batches = Prefetcher::builder(Pattern::new(cycle, rows))
        .depth(depth)
        .workspace_mode(mode)
        .threading(threading)
        .build()
        .unwrap();
    let take = (r >> 24) as usize % 8;
    let mut kept = Vec::new();
    for _ in 0..take {
        let epoch_over = match batches.next() {
            Some(lease) if r & 2 == 0 => {
                kept.push(lease.unwrap().detach());
                false
            }
            Some(lease) => {
                assert!(lease.unwrap().bytes() > 0);
                false
            }
            None => true,
        };
        if epoch_over {
            batches.reset().unwrap();
        }
    }
    drop(batches); // mid-epoch, at its end, or before the first batch was taken
    assert!(kept.iter().all(|batch| batch.layout().has(async_iter::Role::Labels)));
}

#[test]
fn create_use_drop_cycles_leave_no_thread_and_no_memory_behind() {
    life(0); // warm up lazy runtime state (thread bookkeeping, the panic machinery)
    let cycles = scaled(1_000) as u64;
    assert_eq!(producers_once_reaped(), 0, "no producer before the first prefetcher");
    let bytes_before = live_bytes();
    for cycle in 1..=cycles {
        life(cycle);
        // Dropping joined the producer thread and freed its ring: nothing is left,
        // not even for a moment, of a thread that was joined rather than detached.
        let leaked = live_bytes() - bytes_before;
        assert_eq!(leaked, 0, "prefetcher {cycle} left {leaked} bytes behind");
        assert_eq!(producers_once_reaped(), 0, "prefetcher {cycle} left its thread behind");
    }

    // Both counts see what they are to see: a producer while it runs, and bytes left
    // behind by a thread other than the test's own.
    let mut running = Prefetcher::builder(Pattern::new(1, |_, _| 8)) // endless: the producer waits for room
        .threading(Threading::Background)
        .build()
        .unwrap();
    assert!(running.next().is_some());
    assert_eq!(producer_threads(), 1, "a background prefetcher's producer is counted");
    drop(running);
    assert_eq!(producers_once_reaped(), 0);
    let before = live_bytes();
    // Kept reachable (valgrind reports an unreachable block as definitely lost).
    static KEPT: std::sync::Mutex<Option<Vec<u8>>> = std::sync::Mutex::new(None);
    std::thread::spawn(|| *KEPT.lock().unwrap() = Some(std::hint::black_box(vec![0u8; 1000]))).join().unwrap();
    assert_eq!(live_bytes() - before, 1000, "a thread's leak is counted");
}

/// Producer threads now, once the kernel has reaped exited ones: a joined thread can
/// linger in `/proc/self/task` for a moment after `pthread_join` returns (longer on a
/// loaded machine, so the wait is generous; it ends as soon as the count is 0).
fn producers_once_reaped() -> usize {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut threads = producer_threads();
    while threads > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
        threads = producer_threads();
    }
    threads
}
