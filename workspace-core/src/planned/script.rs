//! A plan as replay reads it: the steps (runs and closes) made from a recorded
//! iteration's events, with the figures of its recording.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::plan::{Event, Planner};

/// One step of a plan's replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Step {
    /// A run of allocations of `owner`, laid out in `[start, end)` of the arena.
    Run { owner: u64, start: usize, end: usize },
    /// The end of a cycle of `owner`.
    Close { owner: u64 },
}

/// A plan as replay reads it, with what it was made from.
#[derive(Debug)]
pub(super) struct Script {
    pub(super) key: u64,
    pub(super) steps: Arc<[Step]>,
    pub(super) bytes: usize,
    /// The largest alignment of any allocation: the arena's base alignment.
    pub(super) align: usize,
    pub(super) lower_bound: usize,
    pub(super) per_role_bytes: usize,
    pub(super) allocations: usize,
    pub(super) planning: Duration,
    /// Diverged in a replay: the next iteration of the key is recorded again.
    pub(super) stale: bool,
    pub(super) last_used: u64,
}

impl Script {
    /// The plan's figures with its steps, for a copy whose steps differ (a twin
    /// group's, its owners mapped).
    pub(super) fn clone_figures(&self) -> Script {
        Script {
            key: self.key,
            steps: self.steps.clone(),
            bytes: self.bytes,
            align: self.align,
            lower_bound: self.lower_bound,
            per_role_bytes: self.per_role_bytes,
            allocations: self.allocations,
            planning: self.planning,
            stale: self.stale,
            last_used: self.last_used,
        }
    }

    /// Plans the recorded `events`: runs (consecutive allocations of one owner) become
    /// one block each, laid out as the owner's bump allocation lays them out. `None`
    /// when no plan fits in the address space (sizes no allocation that succeeded
    /// reaches; the iteration then stays unplanned).
    pub(super) fn new(key: u64, events: &[Event], planner: &mut Planner, steps: &mut Vec<Step>) -> Option<Script> {
        let started = Instant::now();
        let allocations = events.iter().filter(|e| matches!(e, Event::Alloc { .. })).count();
        let lower_bound = planner.lower_bound(events);
        let per_role_bytes = planner.per_owner_bytes(events);
        let runs = planner.take_runs(events);
        let align_max = runs.iter().fold(1, |max, e| match *e {
            Event::Alloc { align, .. } => max.max(align),
            Event::Close { .. } => max,
        });
        let (bytes, _) = planner.plan(&runs);
        // The steps are built in a list the group keeps, then copied once into the
        // plan's own: the plan is the only thing a new shape allocates.
        steps.clear();
        let built = runs.iter().zip(planner.offsets()).try_for_each(|(event, &start)| {
            steps.push(match *event {
                Event::Alloc { owner, bytes, .. } => {
                    let start = (start != usize::MAX).then_some(start)?;
                    Step::Run { owner, start, end: start.checked_add(bytes)? }
                }
                Event::Close { owner } => Step::Close { owner },
            });
            Some(())
        });
        planner.keep_runs(runs);
        built?;
        if bytes == usize::MAX {
            return None;
        }
        Some(Script {
            key,
            steps: Arc::from(&steps[..]),
            bytes,
            align: align_max,
            lower_bound,
            per_role_bytes,
            allocations,
            planning: started.elapsed(),
            stale: false,
            last_used: 0,
        })
    }
}
