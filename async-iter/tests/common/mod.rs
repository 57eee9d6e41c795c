//! Shared by the integration-test binaries: what they read of workspace-core's counting
//! allocator, which each binary that measures heap use installs as its global allocator
//! (it counts what the code under test does, never the test harness: allocation calls
//! per thread, and live bytes over every thread but the harness's), a batch source
//! whose every element is known in advance, and scaling for valgrind.

// Each test binary uses part of this module.
#![allow(dead_code)]

use async_iter::{BatchLayout, BatchMut, BatchSource, Lease, SourceError};
use ndarray::{Ix1, Ix2};
use workspace_core::alloc_check::{process_counts, thread_counts, Threads};

// ---- heap use ------------------------------------------------------------------------------

/// Heap allocation calls made by the current thread so far.
pub(crate) fn thread_allocs() -> u64 {
    thread_counts().allocations
}

/// Bytes allocated and not yet freed, by every thread of the process but the
/// harness's: libtest's main thread starts each test on a thread of its own and then
/// waits, times (the "has been running for over 60 seconds" notes) and reports, and
/// what it allocates meanwhile is not the code under test's.
pub(crate) fn live_bytes() -> i64 {
    process_counts(Threads::ExceptMain).live_bytes
}

/// Threads of this process now (`/proc/self/task`).
pub(crate) fn live_threads() -> usize {
    std::fs::read_dir("/proc/self/task").map(|dir| dir.count()).unwrap_or(0)
}

/// Producer threads of prefetchers now: the threads of this process named
/// `carve-prefetch` (the harness's and the tests' own threads do not count).
pub(crate) fn producer_threads() -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return 0 };
    tasks
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim_end() == "carve-prefetch")
        .count()
}

/// Scales iteration counts down under valgrind (`CARVE_SOAK_SCALE=10` divides by 10).
pub(crate) fn scaled(n: usize) -> usize {
    let scale: usize = std::env::var("CARVE_SOAK_SCALE").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    (n / scale.max(1)).max(10)
}

// ---- a source whose contents are known ---------------------------------------------------

/// splitmix64: a well-mixed hash of one word.
pub(crate) fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Element `at` of the features (`role` 0) or labels (`role` 1) of a batch.
pub(crate) fn element(seed: u64, epoch: u64, index: usize, role: u64, at: usize) -> u32 {
    mix(seed ^ mix(epoch << 40 ^ (index as u64) << 8 ^ role) ^ (at as u64).wrapping_mul(0x1000_0001)) as u32
}

/// Width of the features of every [`Pattern`] batch.
pub(crate) const COLS: usize = 5;

/// Batches of `rows(epoch, index)` rows (0 ends the epoch): `u32` features of
/// `rows × COLS` and `u16` labels of `rows`, every element given by [`element`].
pub(crate) struct Pattern<F> {
    pub(crate) seed: u64,
    pub(crate) epoch: u64,
    pub(crate) rows: F,
}

impl<F: FnMut(u64, usize) -> usize + Send + 'static> Pattern<F> {
    pub(crate) fn new(seed: u64, rows: F) -> Self {
        Pattern { seed, epoch: 0, rows }
    }
}

impl<F: FnMut(u64, usize) -> usize + Send + 'static> BatchSource for Pattern<F> {
    fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
        let rows = (self.rows)(self.epoch, index);
        Ok((rows > 0).then(|| BatchLayout::new().features::<u32, _>((rows, COLS)).labels::<u16, _>(rows)))
    }

    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
        let (seed, epoch, index) = (self.seed, self.epoch, batch.index());
        for (at, x) in batch.features::<u32, Ix2>()?.iter_mut().enumerate() {
            *x = element(seed, epoch, index, 0, at);
        }
        for (at, y) in batch.labels::<u16, Ix1>()?.iter_mut().enumerate() {
            *y = element(seed, epoch, index, 1, at) as u16;
        }
        Ok(())
    }

    fn reset(&mut self) -> Result<(), SourceError> {
        self.epoch += 1;
        Ok(())
    }
}

/// A checksum of a batch's features and labels as the lease shows them.
pub(crate) fn checksum(lease: &Lease<'_>) -> u64 {
    let x = lease.features::<u32, Ix2>().expect("u32 features");
    let y = lease.labels::<u16, Ix1>().expect("u16 labels");
    let sum = x.iter().enumerate().fold(0_u64, |s, (at, &v)| s.wrapping_add(mix(v as u64 ^ at as u64)));
    y.iter().enumerate().fold(sum, |s, (at, &v)| s.wrapping_add(mix((v as u64) << 32 ^ at as u64)))
}

/// The checksum batch `index` of `epoch` must have, computed from the pattern alone.
pub(crate) fn expected_checksum(seed: u64, epoch: u64, index: usize, rows: usize) -> u64 {
    let sum = (0..rows * COLS)
        .fold(0_u64, |s, at| s.wrapping_add(mix(element(seed, epoch, index, 0, at) as u64 ^ at as u64)));
    (0..rows)
        .fold(sum, |s, at| s.wrapping_add(mix((element(seed, epoch, index, 1, at) as u16 as u64) << 32 ^ at as u64)))
}
