//! The seam between the engine and what a workspace is a member of: a plan group that
//! serves its allocations from windows of a planned arena, or a recorder of its events.
//!
//! The engine knows a [`Member`], never a group or a plan. It tells the member what
//! happens (a cycle opened, an allocation its open window could not place, an event, a
//! cycle's windows given back) and carries out what the member answers with its
//! window primitives (`window.rs`): open a window of memory the member lends, or
//! allocate as an unplanned workspace would. The replay protocol, the group's state and
//! the trace recorder live above the engine, in the planned layer, which implements
//! this trait; nothing under `engine/` names them.
//!
//! A member is called only from the engine's thread, while the engine is in the call
//! that the hook is named after; it never calls back into the engine.

use crate::backend::{ArenaBackend, Block};
use crate::error::Result;
use crate::figures::PlannedStats;
use crate::plan::Event;

/// The base of a block of backend `B`.
pub(crate) type Base<B> = <<B as ArenaBackend>::Block as Block>::Base;

/// A window a member lends: `[start, end)` of the block at `base`, for one run of an
/// owner's allocations.
pub(crate) struct Lent<B: ArenaBackend> {
    /// The base of the lent block (the group's arena).
    pub(crate) base: Base<B>,
    /// The alignment of `base`: requests aligned beyond it are not placed in the window.
    pub(crate) base_align: usize,
    pub(crate) start: usize,
    pub(crate) end: usize,
}

/// What a member says when a cycle opens.
pub(crate) enum Opened<B: ArenaBackend> {
    /// Allocate as an unplanned workspace, on the fast path where it serves.
    Own,
    /// Take every allocation to the slow path, which asks the member ([`Member::miss`]).
    Slow,
    /// Open this window for the cycle's first run.
    Window(Lent<B>),
}

/// What a member says about a request on the slow path that the open window (if any)
/// did not place.
pub(crate) enum Miss<B: ArenaBackend> {
    /// Allocate as an unplanned workspace (no window).
    Own,
    /// Open this window for the requesting owner and place the request in it.
    Window(Lent<B>),
    /// The request leaves the member's plan: decide as an unplanned workspace would,
    /// and only when that succeeds call [`Member::leave`] and carry it out (a request
    /// the workspace's policy refuses changes nothing, so the plan stays good).
    Leave,
}

/// What a workspace is a member of; see the module docs.
///
/// `holds` says whether the open cycle already holds a window lent by this member: a
/// member that lends the cycle's first window counts the cycle as holding its memory
/// until [`Member::release`].
pub(crate) trait Member<B: ArenaBackend>: Send {
    /// The id of the plan group, for a member that is one (a workspace is a member of
    /// one group at most).
    fn group_id(&self) -> Option<u64> {
        None
    }
    /// A cycle of `owner` opened.
    fn opened(&self, _owner: u64, _holds: bool) -> Opened<B> {
        Opened::Own
    }
    /// A request of `owner` on the slow path that the open window did not place.
    fn miss(&self, _owner: u64, _holds: bool) -> Miss<B> {
        Miss::Own
    }
    /// A spill chunk of `size` bytes for the cycle `owner`, its start aligned to
    /// `align`, lent from memory the member holds if it lends one (a recording
    /// iteration's, where no live allocation is). The cycle holds it to its end.
    fn lend(&self, _owner: u64, _size: usize, _align: usize, _holds: bool) -> Option<Lent<B>> {
        None
    }
    /// A request left the plan (after [`Miss::Leave`], or a lent window too small).
    fn leave(&self) {}
    /// An allocation was made (padded to the workspace's alignment unit), or an owner
    /// (the cycle, or a frame of it) closed.
    fn event(&self, event: Event);
    /// The cycle `owner` closed, holding windows this member lent it or not (`holds`):
    /// [`Member::event`] and [`Member::release`] in one call.
    fn cycle_closed(&self, owner: u64, holds: bool) {
        self.event(Event::Close { owner });
        if holds {
            self.release();
        }
    }
    /// The open cycle no longer holds the windows this member lent it (its end, or the
    /// workspace dropped with a cycle open).
    fn release(&self) {}
    /// The group's figures, for a plan group.
    fn stats(&self) -> Option<PlannedStats> {
        None
    }
    /// The member is removed (or replaced) by `workspace`: an error keeps it.
    fn detach(&self, _workspace: &str) -> Result<()> {
        Ok(())
    }
    /// The workspace is dropped.
    fn dropped(&self) {}
}
