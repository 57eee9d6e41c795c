//! 1,000 prefetchers created, partly consumed and dropped leave no thread and no
//! memory behind.
//!
//! The measurement counts every thread and every live byte of the process, so this
//! binary holds this one test only: another test running or finishing meanwhile (the
//! harness frees its output and thread) would show up in the counts.

mod common;

use async_iter::{Prefetcher, Threading};
use common::{live_bytes, live_threads, mix, scaled, Pattern};
use workspace_core::WorkspaceMode;

#[global_allocator]
static GLOBAL: common::Counting = common::Counting;

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
    let threads_before = live_threads();
    let bytes_before = live_bytes();
    assert!(threads_before >= 1, "/proc/self/task is readable");
    for cycle in 1..=cycles {
        life(cycle);
        // Dropping joined the producer thread and freed its ring: nothing is left,
        // not even for a moment, of a thread that was joined rather than detached.
        let leaked = live_bytes() - bytes_before;
        assert_eq!(leaked, 0, "prefetcher {cycle} left {leaked} bytes behind");
        let threads = threads_once_reaped(threads_before);
        assert_eq!(threads, threads_before, "prefetcher {cycle} left its thread behind");
    }
}

/// Threads now, once the kernel has reaped exited ones: a joined thread can linger in
/// `/proc/self/task` for a moment after `pthread_join` returns.
fn threads_once_reaped(expected: usize) -> usize {
    let mut threads = live_threads();
    for _ in 0..1000 {
        if threads == expected {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
        threads = live_threads();
    }
    threads
}
