//! What the demo measures besides time: the training thread's heap allocations, bytes
//! and live bytes (workspace-core's counting allocator), minor page faults, and peak RSS.

use carve::workspace_core::alloc_check::CountingAllocator;

// ---------------------------------------------------------------------------------
// Heap: every allocation, counted per thread (the training thread's counts are what
// the trace records, read with `alloc_check::thread_counts` and
// `alloc_check::reset_thread_peak`; the prefetcher's producer thread counts its own).

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::system();

pub(crate) use crate::faults::minor_faults;

// ---------------------------------------------------------------------------------
// Peak RSS.

/// How peak RSS is measured (see "Peak RSS" in the docs of `main.rs`).
#[derive(Debug)]
pub(crate) enum RssMeter {
    /// Per mode: the high-water mark is reset as each epoch starts and read as it ends.
    PerEpoch,
    /// The process's peak over the whole run: the mark could not be reset (why).
    Process(String),
}

impl RssMeter {
    /// Per epoch if the high-water mark can be reset here.
    pub(crate) fn new() -> RssMeter {
        match reset_peak_rss() {
            Ok(()) => RssMeter::PerEpoch,
            Err(why) => RssMeter::Process(why),
        }
    }

    /// Resets the high-water mark before an epoch; falls back to the process's peak
    /// for good if that fails.
    pub(crate) fn epoch_starts(&mut self) {
        if let RssMeter::PerEpoch = self {
            if let Err(why) = reset_peak_rss() {
                *self = RssMeter::Process(why);
            }
        }
    }

    /// The high-water mark of the epoch that just ended, when measured per epoch.
    pub(crate) fn epoch_peak(&self) -> Option<u64> {
        match self {
            RssMeter::PerEpoch => peak_rss_bytes(),
            RssMeter::Process(_) => None,
        }
    }
}

/// Resets the process's peak RSS (`VmHWM`) to its current RSS (Linux 4.0 and later).
fn reset_peak_rss() -> Result<(), String> {
    std::fs::write("/proc/self/clear_refs", "5").map_err(|e| format!("/proc/self/clear_refs: {e}"))
}

/// Peak resident set size of the process (`VmHWM` in /proc/self/status), in bytes.
pub(crate) fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.trim_start_matches("VmHWM:").trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}
