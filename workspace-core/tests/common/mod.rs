//! A counting global allocator shared by the test binaries that measure heap use.
//!
//! Each binary that includes this module installs it as its global allocator. The
//! counters are process-wide (live bytes) and per thread (allocation calls).

// Each test binary uses part of this module.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicIsize, Ordering};

pub(crate) struct Counting;

static LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);
thread_local! {
    static THREAD_ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards to `System` unchanged; the counters are plain atomics and a
// const-initialised thread-local, neither of which allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        let _ = THREAD_ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE_BYTES.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        let _ = THREAD_ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Heap allocation calls made by the current thread so far.
pub(crate) fn thread_allocs() -> u64 {
    THREAD_ALLOCS.with(Cell::get)
}

/// Bytes allocated and not yet freed, by every thread of the process.
pub(crate) fn live_bytes() -> isize {
    LIVE_BYTES.load(Ordering::SeqCst)
}

/// Scales iteration counts down under valgrind (`CARVE_SOAK_SCALE=10` divides by 10).
pub(crate) fn scaled(n: usize) -> usize {
    let scale: usize = std::env::var("CARVE_SOAK_SCALE").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    (n / scale.max(1)).max(10)
}
