//! The replay protocol, as a member of each workspace of the group (the engine's
//! [`Member`]): a recording records every event; a replay lends the window of each run
//! of the plan when its step comes, checks every close against the plan's next step,
//! and leaves the plan at the first event the plan does not hold there.

use std::sync::Arc;

use super::group::{GroupShared, Mode};
use crate::backend::ArenaBackend;
use crate::engine::{Lent, Member, Miss, Opened};
use crate::figures::PlannedStats;
use crate::plan::Event;

/// A workspace's membership of a group. Every hook reaches the group's state only on
/// the group's thread ([`GroupShared::state`]); elsewhere the workspace allocates as an
/// unplanned one.
pub(super) struct GroupMember<B: ArenaBackend>(pub(super) Arc<GroupShared<B>>);

impl<B: ArenaBackend> Member<B> for GroupMember<B>
where
    B::Block: Send,
{
    fn group_id(&self) -> Option<u64> {
        Some(self.0.id())
    }

    /// Between iterations (or off the group's thread) the fast path serves the own
    /// arena; while the group records (or runs off the plan), the slow path sees every
    /// allocation; while it replays and the plan's next step is a run of this cycle,
    /// that run's window opens now.
    fn opened(&self, owner: u64, holds: bool) -> Opened<B> {
        let Some(mut state) = self.0.state() else { return Opened::Own };
        match state.mode {
            Mode::Idle => Opened::Own,
            Mode::Replaying { .. } => state.take_run(owner, holds).map_or(Opened::Slow, Opened::Window),
            Mode::Recording | Mode::OffPlan => Opened::Slow,
        }
    }

    /// While replaying: the window of the plan's next step when it is `owner`'s run,
    /// and otherwise the request leaves the plan. In any other mode the workspace
    /// allocates as an unplanned one (a recording learns of it by its event).
    fn miss(&self, owner: u64, holds: bool) -> Miss<B> {
        let Some(mut state) = self.0.state() else { return Miss::Own };
        match state.mode {
            Mode::Replaying { .. } => state.take_run(owner, holds).map_or(Miss::Leave, Miss::Window),
            Mode::Idle | Mode::Recording | Mode::OffPlan => Miss::Own,
        }
    }

    fn lend(&self, owner: u64, size: usize, align: usize, holds: bool) -> Option<Lent<B>> {
        self.0.state()?.lend(owner, size, align, holds)
    }

    fn leave(&self) {
        if let Some(mut state) = self.0.state() {
            state.diverge();
        }
    }

    fn event(&self, event: Event) {
        if let Some(mut state) = self.0.state() {
            state.step(event);
        }
    }

    #[inline]
    fn cycle_closed(&self, owner: u64, holds: bool) {
        if let Some(mut state) = self.0.state() {
            state.step(Event::Close { owner });
            if holds {
                state.live -= 1;
            }
        }
    }

    /// Off the group's thread the cycle stays counted: the group never replays from the
    /// top again, which is safe.
    fn release(&self) {
        if let Some(mut state) = self.0.state() {
            state.live -= 1;
        }
    }

    fn stats(&self) -> Option<PlannedStats> {
        self.0.stats()
    }
}
