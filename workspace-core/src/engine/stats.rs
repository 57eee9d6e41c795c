//! Statistics: cheap snapshots readable while arrays are alive, the peak and the
//! history of the last cycles' sizes.

use serde::Serialize;

use super::Engine;
use crate::backend::ArenaBackend;
use crate::config::ResetPolicy;

/// A snapshot of one workspace's statistics.
///
/// Cheap to take and readable while arrays are alive (it needs only `&self`).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[non_exhaustive]
pub struct WorkspaceStats {
    /// The workspace's name.
    pub name: String,
    /// The backend kind ("ram", "mmap-file", ...).
    pub backend: &'static str,
    /// Arena capacity in bytes.
    pub capacity: usize,
    /// Arena bytes handed out since the workspace was opened (0 when closed, except
    /// for circular workspaces, which report bytes handed out in the last open period).
    pub bytes_in_use: usize,
    /// Bytes of the allocations held in spill blocks (as requested), freed at the next
    /// reset.
    pub spilled_in_use: usize,
    /// The most bytes in use at once since creation or `reset_peak`: the arena's
    /// (`bytes_in_use`) and the spilled allocations', each counted as the arena counts
    /// it (padded to the alignment), so that a cycle counts the same bytes whether it
    /// ran in the arena or spilled (while the workspace learns its size, or grows).
    pub peak_bytes: usize,
    /// Total bytes of allocations that spilled, over the workspace's life.
    pub bytes_spilled: u64,
    /// Number of allocations that spilled, over the workspace's life (under a debug
    /// mode, every allocation, each in a block of its own).
    pub external_allocations: u64,
    /// Number of pinned host allocations (device staging; always 0 on the host).
    pub pinned_allocations: u64,
    /// Completed cycles.
    pub cycles: u64,
    /// Current generation (one per real enter).
    pub generation: u64,
    /// Times the arena was reallocated larger.
    pub growth_events: u64,
    /// Times a circular workspace wrapped to the start of its buffer.
    pub wraps: u64,
    /// The size learned, once learning is complete.
    pub learned_size: Option<usize>,
    /// Bytes the last completed cycle needed.
    pub last_cycle_bytes: usize,
    /// Scopes open now (0: closed).
    pub open_scopes: usize,
    /// Cycles that spilled although learning was complete when they began: more than
    /// a few means the arena is too small for the loop (with `SpillPolicy::External`
    /// it never grows; `Reallocate`, the default, grows it to the largest cycle).
    pub cycles_spilled_after_learning: u64,
    /// Growths of the arena (learning, `Reallocate`, restoring the size after `trim`)
    /// that the backend refused. The first is reported by the next `enter`; the
    /// workspace keeps running each cycle from spill blocks, and retries the same size
    /// only after a back-off that doubles with each refusal in a row (a smaller size at
    /// once).
    pub failed_growths: u64,
    /// The figures of the plan group this workspace is a member of
    /// ([`crate::planned`]), read on the group's thread; `None` for other workspaces.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub planned: Option<crate::figures::PlannedStats>,
}

impl<B: ArenaBackend> Engine<B> {
    /// Arena bytes handed out in the current (or, when closed, the last) open period.
    pub fn bytes_in_use(&self) -> usize {
        if self.depth.get() == 0 && self.config.reset() == ResetPolicy::BlockLeft {
            return 0;
        }
        self.open_bytes()
    }

    /// Next free arena offset (for tests and diagnostics).
    pub fn cursor(&self) -> usize {
        self.cursor.get()
    }

    /// Bytes held in spill blocks of the open cycle, freed at the next reset.
    pub fn spilled_in_use(&self) -> usize {
        self.spill.in_use.get()
    }

    /// The most bytes in use at once since creation or `reset_peak`, spills padded as
    /// the arena pads them (as [`WorkspaceStats::peak_bytes`], without building the
    /// statistics).
    pub fn peak(&self) -> usize {
        self.counters.peak.get().max(self.bytes_in_use() + self.spill.need.get())
    }

    /// Restarts the peak from the bytes in use now.
    pub fn reset_peak(&self) {
        self.counters.peak.set(self.bytes_in_use() + self.spill.need.get());
    }

    /// The sizes of the last cycles, kept for plots
    /// ([`WorkspaceConfigBuilder::cycle_history_len`](crate::WorkspaceConfigBuilder::cycle_history_len)),
    /// oldest first.
    pub fn cycle_history(&self) -> Vec<usize> {
        self.cycle_history.borrow().iter().copied().collect()
    }

    /// The former name of [`Engine::cycle_history`].
    #[deprecated(note = "renamed cycle_history: the sizes of the last cycles are not a Timeline")]
    pub fn timeline(&self) -> Vec<usize> {
        self.cycle_history()
    }

    /// A statistics snapshot.
    pub fn stats(&self) -> WorkspaceStats {
        let in_use = self.bytes_in_use();
        let spilled = self.spill.in_use.get();
        WorkspaceStats {
            name: self.name.to_string(),
            backend: self.backend_kind(),
            capacity: self.capacity.get(),
            bytes_in_use: in_use,
            spilled_in_use: spilled,
            peak_bytes: self.counters.peak.get().max(in_use + self.spill.need.get()),
            bytes_spilled: self.counters.bytes_spilled.get(),
            external_allocations: self.counters.external_allocations.get(),
            pinned_allocations: 0,
            // Every real enter starts a generation; the open one has not completed.
            cycles: self.generation.get() - u64::from(self.depth.get() > 0),
            generation: self.generation.get(),
            growth_events: self.counters.growth_events.get(),
            wraps: self.counters.wraps.get(),
            learned_size: self.learning.learned.get(),
            last_cycle_bytes: self.counters.last_cycle_bytes.get(),
            open_scopes: self.depth.get(),
            cycles_spilled_after_learning: self.counters.spilled_after_learning.get(),
            failed_growths: self.counters.failed_growths.get(),
            planned: if self.observers.grouped.get() { self.member_stats() } else { None },
        }
    }
}
