//! A member of a plan group ([`crate::planned`]): allocations recorded, or served from
//! windows of the group's arena while the plan is replayed, and cycle ends checked
//! against the plan.
//!
//! A window is one run of the plan: `[start, end)` of the group's arena, which the fast
//! path bumps through (`fast_base`, `cursor`, `fast_limit` point into it meanwhile). The
//! member's own arena is not used while a window is open: its cursor is kept in
//! `own_cursor` and put back when the window closes.

use std::sync::Arc;

use super::{align_up, Engine};
use crate::backend::{ArenaBackend, Block};
use crate::config::ResetPolicy;
use crate::error::{Error, Result};
use crate::plan::Event;
use crate::planned::{GroupShared, GroupState, Mode, Step};

/// A member's window state; see the module docs.
pub(super) struct Window<B: ArenaBackend> {
    /// The group, while a member of one.
    pub(super) group: std::cell::RefCell<Option<Arc<GroupShared<B>>>>,
    /// Start of the open window (meaningful while `end > 0`).
    start: std::cell::Cell<usize>,
    /// End of the open window; 0 when none is open.
    end: std::cell::Cell<usize>,
    /// The owner whose run the open window is (the cycle, or one of its frames).
    owner: std::cell::Cell<u64>,
    /// The group arena's base, from the first window of the cycle to its end.
    base: std::cell::Cell<Option<<B::Block as Block>::Base>>,
    /// The own arena's cursor while a window is open.
    own_cursor: std::cell::Cell<usize>,
    /// Bytes handed out from the windows of this cycle that are closed (less those of
    /// frames that closed).
    used: std::cell::Cell<usize>,
    /// Of the bytes closed frames took from windows, those beyond the own arena: an
    /// unplanned workspace would have held them in spill blocks, which its budget counts
    /// to the end of the cycle (a frame gives back arena bytes only). Non-zero only in a
    /// cycle that used frames.
    spill_kept: std::cell::Cell<usize>,
    /// Whether this cycle holds a window (counted in the group's `live`).
    holds: std::cell::Cell<bool>,
    /// The windows of this cycle, for [`Engine::any_block`].
    regions: Regions,
}

impl<B: ArenaBackend> Window<B> {
    pub(super) fn new() -> Window<B> {
        Window {
            group: std::cell::RefCell::new(None),
            start: std::cell::Cell::new(0),
            end: std::cell::Cell::new(0),
            owner: std::cell::Cell::new(0),
            base: std::cell::Cell::new(None),
            own_cursor: std::cell::Cell::new(0),
            used: std::cell::Cell::new(0),
            spill_kept: std::cell::Cell::new(0),
            holds: std::cell::Cell::new(false),
            regions: Regions::default(),
        }
    }
}

/// The windows of a cycle, `[start, end)` each: the first kept inline (most cycles
/// have one), the others in a list.
#[derive(Default)]
struct Regions {
    first: std::cell::Cell<Option<(usize, usize)>>,
    more: std::cell::RefCell<Vec<(usize, usize)>>,
    /// Whether `more` holds any.
    has_more: std::cell::Cell<bool>,
}

impl Regions {
    #[inline]
    fn push(&self, start: usize, end: usize) {
        if self.first.get().is_none() {
            self.first.set(Some((start, end)));
        } else {
            self.more.borrow_mut().push((start, end));
            self.has_more.set(true);
        }
    }

    #[inline]
    fn clear(&self) {
        self.first.set(None);
        if self.has_more.replace(false) {
            self.more.borrow_mut().clear();
        }
    }

    fn any(&self, test: impl Fn(usize, usize) -> bool) -> bool {
        self.first.get().is_some_and(|(s, e)| test(s, e)) || self.more.borrow().iter().any(|&(s, e)| test(s, e))
    }
}

type Placed<B> = (<<B as ArenaBackend>::Block as Block>::Base, usize);

impl<B: ArenaBackend> Engine<B> {
    /// Joins `group` (`None`: leaves the current one).
    ///
    /// # Errors
    ///
    /// [`Error::StillOpen`] while open; [`Error::InvalidConfig`] for a circular
    /// workspace, or one that is a member of another group.
    pub(crate) fn join_group(&self, group: Option<Arc<GroupShared<B>>>) -> Result<()> {
        self.require_closed("joining or leaving a plan group")?;
        if let Some(group) = &group {
            if self.config.reset() != ResetPolicy::BlockLeft {
                return Err(Error::InvalidConfig {
                    reason: format!(
                        "workspace '{}' is circular (ResetPolicy::EndOfBuffer): only workspaces that reset at the end \
                         of each cycle can be planned",
                        self.name
                    ),
                });
            }
            if self.id >> crate::plan::FRAME_LEVEL_SHIFT != 0 {
                return Err(Error::InvalidConfig {
                    reason: format!(
                        "workspace '{}' has id {}: this process has made 2^48 workspaces, and the owners of a \
                         plan group's traces (an id with a frame's level above it) would no longer be distinct",
                        self.name, self.id
                    ),
                });
            }
            if self.window.group.borrow().as_ref().is_some_and(|g| g.id() != group.id()) {
                return Err(Error::InvalidConfig {
                    reason: format!("workspace '{}' is already a member of another plan group", self.name),
                });
            }
        }
        self.grouped.set(group.is_some());
        *self.window.group.borrow_mut() = group;
        self.refresh_plain_close();
        Ok(())
    }

    /// The id of the group this workspace is a member of.
    pub(crate) fn group_id(&self) -> Option<u64> {
        self.window.group.borrow().as_ref().map(|g| g.id())
    }

    /// The figures of the group this workspace is a member of (on the group's thread).
    pub(crate) fn group_stats(&self) -> Option<crate::planned::PlannedStats> {
        self.window.group.borrow().as_ref().and_then(|g| g.stats())
    }

    /// A member's cycle opens (the fast path is off): between iterations (or off the
    /// group's thread) the fast path serves the own arena; while the group records, the
    /// slow path sees every allocation; while it replays and the plan's next step is a
    /// run of this cycle, that run's window opens now, so that the cycle's first
    /// allocation takes the fast path too.
    #[cold]
    pub(super) fn enter_grouped(&self, fast_limit: usize) {
        let group = self.window.group.borrow();
        let Some(mut state) = group.as_ref().and_then(|g| g.state()) else {
            self.fast_limit.set(fast_limit);
            return;
        };
        if let Mode::Replaying { .. } = state.mode {
            self.take_run(&mut state, self.owner());
        } else if state.mode == Mode::Idle {
            self.fast_limit.set(fast_limit);
        }
    }

    /// [`Engine::alloc_slow`] for a member of a group.
    #[cold]
    #[inline(never)]
    pub(super) fn alloc_grouped(&self, size: usize, align: usize, level: u32) -> Result<Placed<B>> {
        self.check_request(size, align)?;
        let group = self.window.group.borrow();
        let Some(mut state) = group.as_ref().and_then(|g| g.state()) else {
            // Another thread (or the group is busy): an unplanned workspace.
            self.close_window();
            return self.alloc_slow_unrecorded(size, align);
        };
        match state.mode {
            Mode::Idle => {
                drop(state);
                self.close_window();
                self.alloc_slow_unrecorded(size, align)
            }
            Mode::Recording => {
                self.close_window();
                let placed = self.alloc_slow_unrecorded(size, align)?;
                let bytes = align_up(size, self.min_align).unwrap_or(usize::MAX);
                state.record(Event::Alloc { owner: self.owner_at(level), bytes, align: align.max(self.min_align) });
                Ok(placed)
            }
            Mode::Replaying { .. } | Mode::OffPlan => {
                self.alloc_planned(&mut state, size, align.max(self.min_align), self.owner_at(level))
            }
        }
    }

    /// An allocation by `owner` (this member's cycle or one of its frames) in a
    /// replayed iteration: in the open window when it is `owner`'s, in the window of the
    /// next step when that step is `owner`'s run, and otherwise off the plan.
    fn alloc_planned(&self, state: &mut GroupState<B>, size: usize, align: usize, owner: u64) -> Result<Placed<B>> {
        if let Some(placed) = self.place_in_window(size, align, owner, state.base_align)? {
            return Ok(placed);
        }
        if let Mode::Replaying { .. } = state.mode {
            if self.take_run(state, owner) {
                if let Some(placed) = self.place_in_window(size, align, owner, state.base_align)? {
                    return Ok(placed);
                }
            }
        }
        // Off the plan: the member's own arena or a spill block, never planned bytes, as
        // an unplanned workspace with its configuration would place it (the bytes its
        // windows hold count as if in its arena). A request its policy refuses changes
        // nothing, so the plan stays good: the recording did not hold it either.
        let decision = self.decide(size, align)?;
        state.diverge();
        self.close_window();
        self.apply(decision, size, align)
    }

    /// While replaying: when the plan's next step is a run of `owner`, takes it and
    /// opens its window. Whether it did.
    fn take_run(&self, state: &mut GroupState<B>, owner: u64) -> bool {
        let Mode::Replaying { .. } = state.mode else { return false };
        match state.steps.get(state.pos).copied() {
            // (An arena is there whenever a replay runs: the start grew it, and `trim`
            // ends the replay. Checked all the same: a window must lie in an arena.)
            Some(Step::Run { owner: planned, start, end }) if planned == owner && state.base.is_some() => {
                state.pos += 1;
                self.open_window(state, start, end, owner);
                true
            }
            _ => false,
        }
    }

    /// Places `size` bytes in the open window, if it is `owner`'s and has room (and
    /// `align` is no more than `base_align`, the group arena's base alignment).
    fn place_in_window(&self, size: usize, align: usize, owner: u64, base_align: usize) -> Result<Option<Placed<B>>> {
        let end = self.window.end.get();
        if end == 0 || align > base_align || owner != self.window.owner.get() {
            return Ok(None);
        }
        let Some(start) = align_up(self.cursor.get(), align) else { return Ok(None) };
        if start.checked_add(size).is_none_or(|e| e > end) {
            return Ok(None);
        }
        let placed = if self.debug.on.get() {
            // Under a debug mode the memory comes from a block of its own; the plan's
            // accounting runs as without it.
            let block = self.backend.borrow_mut().allocate_spill(size, align).map_err(|e| self.backend_error(e))?;
            let base = block.base();
            self.debug.blocks.borrow_mut().push(block);
            self.counters.bytes_spilled.set(self.counters.bytes_spilled.get() + size as u64);
            self.counters.external_allocations.set(self.counters.external_allocations.get() + 1);
            (base, 0)
        } else {
            let base = self.window.base.get().expect("an open window has the group arena's base");
            (base, start)
        };
        self.cursor.set(align_up(start + size, self.min_align).unwrap_or(end).min(end));
        Ok(Some(placed))
    }

    /// Opens the window `[start, end)` of the group's arena for `owner`'s run.
    fn open_window(&self, state: &mut GroupState<B>, start: usize, end: usize, owner: u64) {
        self.close_window();
        if !self.window.holds.replace(true) {
            // The cycle's first window. The arena stays where it is while the cycle
            // holds one (it is replaced only while no member holds a window).
            state.live += 1;
            self.window.base.set(state.base);
        }
        self.window.own_cursor.set(self.cursor.get());
        self.window.start.set(start);
        self.window.end.set(end);
        self.window.owner.set(owner);
        self.window.regions.push(start, end);
        self.cursor.set(start);
        // `cursor` counts in the group's arena now: no fast path may go on serving the
        // own arena (a frame opened, or a cycle entered, before the replay started has
        // the own arena's limit). The fast path serves the window when `owner` is
        // whoever allocates on it now (the top frame, or the cycle when no frame is
        // open); anyone else's window is served on the slow path, which checks the owner.
        let serves = !self.debug.on.get() && !self.recording.get() && owner == self.owner_at(self.frame_top.get());
        if serves {
            self.fast_base.set(state.base);
        }
        self.set_limit(if serves { end } else { 0 });
    }

    /// Closes the open window, if any: the fast path is off and the own cursor back.
    pub(super) fn close_window(&self) {
        if self.window.end.get() == 0 {
            return;
        }
        self.window.used.set(self.window.used.get() + (self.cursor.get() - self.window.start.get()));
        self.window.end.set(0);
        self.set_limit(0);
        self.fast_base.set(self.arena_base.get());
        self.cursor.set(self.window.own_cursor.get());
    }

    /// Whether a window is open.
    pub(super) fn window_is_open(&self) -> bool {
        self.window.end.get() > 0
    }

    /// The own arena's cursor, wherever a window has put `cursor`.
    pub(super) fn own_cursor(&self) -> usize {
        if self.window.end.get() > 0 {
            self.window.own_cursor.get()
        } else {
            self.cursor.get()
        }
    }

    /// [`Engine::window_bytes`] for a member of a group, 0 for other workspaces.
    pub(super) fn window_bytes_if_grouped(&self) -> usize {
        if self.grouped.get() {
            self.window_bytes()
        } else {
            0
        }
    }

    /// A frame closed: the bytes its runs took from windows count no more (only while
    /// no window is open: the frame's close closed it). Of those, the bytes beyond the own arena stay counted by the budget, as an
    /// unplanned workspace's spill blocks do. Called before the own cursor rewinds.
    pub(super) fn rewind_window_bytes(&self, to: usize) {
        debug_assert_eq!(self.window.end.get(), 0, "the closing frame's window was closed first");
        let (own, used, capacity) = (self.own_cursor(), self.window.used.get(), self.capacity.get());
        let to = to.min(used);
        let beyond = own.saturating_add(used).saturating_sub(capacity.max(own.saturating_add(to)));
        self.window.spill_kept.set(self.window.spill_kept.get().saturating_add(beyond));
        self.window.used.set(to);
    }

    /// Bytes of closed frames' windows beyond the own arena (see `Window::spill_kept`).
    pub(super) fn window_spill_kept(&self) -> usize {
        self.window.spill_kept.get()
    }

    /// Bytes handed out from windows in this cycle (less those of frames that closed).
    pub(super) fn window_bytes(&self) -> usize {
        let open = if self.window.end.get() > 0 { self.cursor.get() - self.window.start.get() } else { 0 };
        self.window.used.get() + open
    }

    /// The end of a member's cycle: checked against the plan (or recorded), and its
    /// windows given back.
    #[cold]
    pub(super) fn close_grouped(&self) {
        self.close_window();
        let group = self.window.group.borrow();
        if let Some(mut state) = group.as_ref().and_then(|g| g.state()) {
            Self::step(&mut state, self.owner());
            if self.window.holds.get() {
                state.live -= 1;
            }
        }
        // Off the group's thread `live` stays counted: the group never replays from the
        // top again, which is safe.
        self.end_windows();
    }

    /// The cycle's windows are given back (after `live` counted it).
    #[inline]
    fn end_windows(&self) {
        self.window.holds.set(false);
        self.window.regions.clear();
        self.window.base.set(None);
    }

    /// The end of a member's cycle in a replay's common case, on a short path: the cycle
    /// ran in its window (nothing spilled, no frame, no learning left; `plain_member`:
    /// no debug mode, timeline or recording) and the plan's next step is its close. Does
    /// what `close_cycle_general` does then and returns true; in any other case does
    /// nothing and returns false.
    #[inline]
    pub(super) fn close_replayed(&self) -> bool {
        if self.window.end.get() == 0
            || self.virtual_cursor.get().is_some()
            || self.frames.used.get()
            || self.learning.left.get() > 0
        {
            return false;
        }
        {
            let group = self.window.group.borrow();
            let Some(mut state) = group.as_ref().and_then(|g| g.state()) else { return false };
            if !Self::takes_close(&mut state, self.owner()) {
                return false;
            }
            if self.window.holds.get() {
                state.live -= 1;
            }
        }
        // `close_window`, `cycle_bytes` and the reset, for this case: the own arena
        // (`open_start` is 0) holds what was allocated before the window opened.
        let in_use =
            self.window.own_cursor.get() + self.window.used.get() + (self.cursor.get() - self.window.start.get());
        self.count_cycle(in_use, align_up(in_use, self.min_align).unwrap_or(usize::MAX));
        self.window.end.set(0);
        self.window.used.set(0);
        self.end_windows();
        self.cursor.set(0);
        self.fast_base.set(self.arena_base.get());
        self.fast_limit.set(0);
        true
    }

    /// A member dropped while its cycle holds a window (a raw `enter` never closed): the
    /// group stops counting it. No view can outlive the workspace it borrows, so the
    /// window's bytes are free.
    pub(super) fn forget_window(&self) {
        if self.window.holds.replace(false) {
            if let Some(mut state) = self.window.group.borrow().as_ref().and_then(|g| g.state()) {
                state.live -= 1;
            }
        }
    }

    /// The close of `owner` (the member's cycle, or one of its frames): recorded, or
    /// checked against the plan's next step.
    pub(super) fn step_close(&self, owner: u64) {
        let group = self.window.group.borrow();
        if let Some(mut state) = group.as_ref().and_then(|g| g.state()) {
            Self::step(&mut state, owner);
        };
    }

    /// The close of `owner` in `state`.
    #[inline]
    fn step(state: &mut GroupState<B>, owner: u64) {
        if let Mode::Replaying { .. } = state.mode {
            if !Self::takes_close(state, owner) {
                state.diverge();
            }
        } else if state.mode == Mode::Recording {
            state.record(Event::Close { owner });
        }
    }

    /// While replaying: when the plan's next step is the close of `owner`, takes it.
    /// Whether it did.
    #[inline(always)]
    fn takes_close(state: &mut GroupState<B>, owner: u64) -> bool {
        let Mode::Replaying { .. } = state.mode else { return false };
        match state.steps.get(state.pos) {
            Some(&Step::Close { owner: planned }) if planned == owner => {
                state.pos += 1;
                true
            }
            _ => false,
        }
    }

    /// Resets the per-cycle window accounting (after the cycle's statistics).
    pub(super) fn reset_window_bytes(&self) {
        self.window.used.set(0);
        self.window.spill_kept.set(0);
    }

    /// Whether `test` holds for one of this cycle's windows (address and length).
    pub(super) fn any_window(&self, test: &impl Fn(u64, usize) -> bool) -> bool {
        use crate::backend::Address;
        let Some(base) = self.window.base.get() else { return false };
        let base = base.address();
        self.window.regions.any(|start, end| test(base + start as u64, end - start))
    }
}
