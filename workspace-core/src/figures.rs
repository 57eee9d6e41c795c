//! The figures of a plan group, in a module of their own so that the engine can report
//! them (`WorkspaceStats::planned`) without knowing the planned layer.

use serde::Serialize;

/// A group's figures.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct PlannedStats {
    /// The group's name.
    pub name: String,
    /// Bytes of the planned arena (the largest plan made so far).
    pub arena_bytes: usize,
    /// The lower bound of the recording whose plan sized the arena (the largest).
    pub arena_lower_bound_bytes: usize,
    /// Bytes of the plan of the current (or last) iteration.
    pub plan_bytes: usize,
    /// The most bytes live at one moment in that plan's recording: no plan can be
    /// smaller.
    pub lower_bound_bytes: usize,
    /// `plan_bytes / lower_bound_bytes`.
    pub plan_to_bound: f64,
    /// What the recording takes laid out per workspace (each member an arena of its own,
    /// sized to its peak): the unplanned layout.
    pub per_role_bytes: usize,
    /// Allocations in that recording.
    pub allocations: usize,
    /// How long making that plan took, in microseconds.
    pub planning_us: u64,
    /// Plans made.
    pub plans: u64,
    /// Plans made again for a key whose plan diverged.
    pub replans: u64,
    /// Iterations that left their plan (each is recorded again next time).
    pub divergences: u64,
    /// Iterations replayed to their end on their plan.
    pub planned_iterations: u64,
    /// Iterations recorded.
    pub recorded_iterations: u64,
    /// Plans kept now.
    pub cached_plans: usize,
    /// Plans dropped to keep the cache bounded.
    pub evictions: u64,
    /// Iterations run off the plan from their start because a member's cycle still
    /// held a window of the iteration before (the plan stays good).
    pub blocked_iterations: u64,
    /// Iterations run off the plan from their start because the arena could not grow
    /// to their plan (the next start of the key tries again).
    pub failed_growths: u64,
    /// Iterations given up (`PlanGroup::abandon_iteration`: the work they did failed)
    /// while recorded or on their plan: neither planned nor counted as on or off their
    /// plan.
    pub abandoned_iterations: u64,
}
