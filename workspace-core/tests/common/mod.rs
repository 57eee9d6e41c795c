//! Shared by the test binaries that measure heap use. Each installs workspace-core's
//! counting allocator as its global allocator:
//!
//! ```ignore
//! #[global_allocator]
//! static GLOBAL: workspace_core::alloc_check::CountingAllocator = workspace_core::alloc_check::CountingAllocator::system();
//! ```
//!
//! and counts what the code under test does, never the test harness: allocations of
//! the calling thread (`AllocationGuard`), and live bytes over every thread but the
//! harness's (the process's main thread, which starts, times and reports the tests
//! while they run).

// Each test binary uses part of this module.
#![allow(dead_code)]

use workspace_core::alloc_check::{process_counts, Threads};

/// Bytes allocated and not yet freed, by every thread of the process but the
/// harness's: libtest's main thread starts each test on a thread of its own and then
/// waits, times (the "has been running for over 60 seconds" notes) and reports, and
/// what it allocates meanwhile is not the code under test's.
pub(crate) fn live_bytes() -> i64 {
    process_counts(Threads::ExceptMain).live_bytes
}

/// Scales iteration counts down under valgrind (`CARVE_SOAK_SCALE=10` divides by 10).
pub(crate) fn scaled(n: usize) -> usize {
    let scale: usize = std::env::var("CARVE_SOAK_SCALE").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    (n / scale.max(1)).max(10)
}
