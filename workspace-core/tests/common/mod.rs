//! A counting global allocator shared by the test binaries that measure heap use.
//!
//! Each binary that includes this module installs it as its global allocator. It
//! counts what the code under test does, never the test harness: allocation calls per
//! thread, and live bytes over every thread but the harness's own (the process's main
//! thread, which starts, times and reports the tests while they run).

// Each test binary uses part of this module.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicIsize, Ordering};

pub(crate) struct Counting;

static LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);
thread_local! {
    static THREAD_ALLOCS: Cell<u64> = const { Cell::new(0) };
    /// Whether this thread is the harness's: unknown until its first allocation.
    static HARNESS: Cell<Option<bool>> = const { Cell::new(None) };
}

/// Whether the calling thread is the test harness's: the process's main thread, where
/// libtest starts each test on a thread of its own and then waits, times (the "has
/// been running for over 60 seconds" notes) and reports. What it allocates meanwhile is
/// not the code under test's, so live bytes leave it out. Never allocates.
fn on_harness_thread() -> bool {
    HARNESS
        .try_with(|harness| match harness.get() {
            Some(known) => known,
            None => {
                let known = is_main_thread();
                harness.set(Some(known));
                known
            }
        })
        .unwrap_or(false)
}

#[cfg(target_os = "linux")]
fn is_main_thread() -> bool {
    extern "C" {
        /// The kernel's id of the calling thread (glibc 2.30+, musl 1.2.2+).
        fn gettid() -> i32;
    }
    // SAFETY: gettid takes nothing, cannot fail and touches no memory of ours.
    let tid = unsafe { gettid() };
    tid as u32 == std::process::id() // the main thread's id is the process's
}

#[cfg(not(target_os = "linux"))]
fn is_main_thread() -> bool {
    false
}

// SAFETY: forwards to `System` unchanged; the counters are plain atomics and
// const-initialised thread-locals without destructors, and telling the harness's thread
// apart is one system call: none of it allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !on_harness_thread() {
            LIVE_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        let _ = THREAD_ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if !on_harness_thread() {
            LIVE_BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        }
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !on_harness_thread() {
            LIVE_BYTES.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        }
        let _ = THREAD_ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Heap allocation calls made by the current thread so far.
pub(crate) fn thread_allocs() -> u64 {
    THREAD_ALLOCS.with(Cell::get)
}

/// Bytes allocated and not yet freed, by every thread of the process but the
/// harness's (see `on_harness_thread`).
pub(crate) fn live_bytes() -> isize {
    LIVE_BYTES.load(Ordering::SeqCst)
}

/// Scales iteration counts down under valgrind (`CARVE_SOAK_SCALE=10` divides by 10).
pub(crate) fn scaled(n: usize) -> usize {
    let scale: usize = std::env::var("CARVE_SOAK_SCALE").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    (n / scale.max(1)).max(10)
}
