//! A plan as replay reads it: the steps (runs and closes) made from a recorded
//! iteration's events, with the figures of its recording.

use std::sync::Arc;
use std::time::Duration;

use crate::plan::{Event, Plan, Trace};

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
    /// Plans the recorded `events`: runs (consecutive allocations of one owner) become
    /// one block each, laid out as the owner's bump allocation lays them out. `None`
    /// when no plan fits in the address space (sizes no allocation that succeeded
    /// reaches; the iteration then stays unplanned).
    pub(super) fn new(key: u64, events: &[Event]) -> Option<Script> {
        let recorded = Trace::from_events(events.to_vec());
        let allocations = events.iter().filter(|e| matches!(e, Event::Alloc { .. })).count();
        let runs = recorded.runs();
        let align_max = runs.events().iter().fold(1, |max, e| match *e {
            Event::Alloc { align, .. } => max.max(align),
            Event::Close { .. } => max,
        });
        let plan = Plan::new(&runs);
        let steps = plan
            .events()
            .iter()
            .enumerate()
            .map(|(i, event)| match *event {
                Event::Alloc { owner, bytes, .. } => {
                    let start = plan.offset(i)?;
                    Some(Step::Run { owner, start, end: start.checked_add(bytes)? })
                }
                Event::Close { owner } => Some(Step::Close { owner }),
            })
            .collect::<Option<Arc<[Step]>>>()?;
        if plan.bytes() == usize::MAX {
            return None;
        }
        Some(Script {
            key,
            steps,
            bytes: plan.bytes(),
            align: align_max,
            lower_bound: recorded.lower_bound(),
            per_role_bytes: recorded.per_owner_bytes(),
            allocations,
            planning: plan.planning_time(),
            stale: false,
            last_used: 0,
        })
    }
}
