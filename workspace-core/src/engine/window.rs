//! Windows: the engine's side of a [`Member`] (see `member.rs`), which may lend the
//! open cycle windows of memory it holds (a plan group's arena).
//!
//! A window is one run of an owner's allocations: `[start, end)` of the lent block,
//! which the fast path bumps through (`fast_base`, `cursor`, `fast_limit` point into it
//! meanwhile). The member's own arena is not used while a window is open: its cursor
//! is kept in `own_cursor` and put back when the window closes. The bytes a cycle takes
//! from windows count as if they were in its own arena (`window_bytes`), so that the
//! budget, the spill policy and the statistics see what an unplanned workspace would.

use super::member::{Base, Lent, Member, Miss, Opened};
use super::{align_up, Engine};
use crate::backend::ArenaBackend;
use crate::config::ResetPolicy;
use crate::error::{Error, Result};
use crate::figures::PlannedStats;

/// A member's window state; see the module docs.
pub(super) struct Window<B: ArenaBackend> {
    /// Start of the open window (meaningful while `end > 0`).
    start: std::cell::Cell<usize>,
    /// End of the open window; 0 when none is open.
    end: std::cell::Cell<usize>,
    /// The owner whose run the open window is (the cycle, or one of its frames).
    owner: std::cell::Cell<u64>,
    /// The lent block's base, from the first window of the cycle to its end.
    base: std::cell::Cell<Option<Base<B>>>,
    /// The alignment of `base`.
    base_align: std::cell::Cell<usize>,
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
    /// Whether this cycle holds a window (counted by the member until `release`).
    holds: std::cell::Cell<bool>,
    /// The windows of this cycle, for [`Engine::any_block`].
    regions: Regions,
}

impl<B: ArenaBackend> Window<B> {
    pub(super) fn new() -> Window<B> {
        Window {
            base_align: std::cell::Cell::new(1),
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

type Placed<B> = (Base<B>, usize);

impl<B: ArenaBackend> Engine<B> {
    /// Makes `member` the workspace's member (`None`: none): a plan group whose windows
    /// serve its allocations.
    ///
    /// # Errors
    ///
    /// [`Error::StillOpen`] while open; [`Error::InvalidConfig`] for a circular
    /// workspace, or one that is a member of another group; the old member's
    /// [`Member::detach`] error.
    pub(crate) fn join(&self, member: Option<Box<dyn Member<B>>>) -> Result<()> {
        self.require_closed("joining or leaving a plan group")?;
        if let Some(member) = &member {
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
            let current = self.group_id();
            if current.is_some() && current != member.group_id() {
                return Err(Error::InvalidConfig {
                    reason: format!("workspace '{}' is already a member of another plan group", self.name),
                });
            }
        }
        if let Some(old) = self.observers.member.borrow().as_ref() {
            old.detach(&self.name)?;
        }
        self.observers.grouped.set(member.is_some());
        *self.observers.member.borrow_mut() = member;
        self.refresh_plain_close();
        Ok(())
    }

    /// The id of the group this workspace is a member of.
    pub(crate) fn group_id(&self) -> Option<u64> {
        self.observers.member.borrow().as_ref().and_then(|m| m.group_id())
    }

    /// The figures of the group this workspace is a member of (on the group's thread).
    pub(crate) fn member_stats(&self) -> Option<PlannedStats> {
        self.observers.member.borrow().as_ref().and_then(|m| m.stats())
    }

    /// A member's cycle opens (the fast path is off): the member says whether the fast
    /// path serves the own arena (`fast_limit`), every allocation takes the slow path,
    /// or a window opens now (so that the cycle's first allocation takes the fast path
    /// too).
    #[cold]
    pub(super) fn enter_grouped(&self, fast_limit: usize) {
        let opened = match self.observers.member.borrow().as_ref() {
            Some(member) => member.opened(self.owner(), self.window.holds.get()),
            None => Opened::Own,
        };
        match opened {
            Opened::Own => self.fast_limit.set(fast_limit),
            Opened::Slow => {}
            Opened::Window(lent) => self.open_window(lent, self.owner()),
        }
    }

    /// [`Engine::alloc_slow`] for a member of a group: in the open window when it is
    /// `owner`'s and has room, in a window the member lends, or as an unplanned
    /// workspace.
    #[cold]
    #[inline(never)]
    pub(super) fn alloc_grouped(&self, size: usize, align: usize, level: u32) -> Result<Placed<B>> {
        self.check_request(size, align)?;
        let align = align.max(self.min_align);
        let owner = self.owner_at(level);
        if let Some(placed) = self.place_in_window(size, align, owner)? {
            return Ok(placed);
        }
        let miss = match self.observers.member.borrow().as_ref() {
            Some(member) => member.miss(owner, self.window.holds.get()),
            None => Miss::Own,
        };
        match miss {
            Miss::Own => {
                self.close_window();
                return self.alloc_slow_unrecorded(size, align);
            }
            Miss::Window(lent) => {
                self.open_window(lent, owner);
                if let Some(placed) = self.place_in_window(size, align, owner)? {
                    return Ok(placed);
                }
            }
            Miss::Leave => {}
        }
        // Off the plan: the member's own arena or a spill block, never lent bytes, as an
        // unplanned workspace with its configuration would place it (the bytes its
        // windows hold count as if in its arena). A request its policy refuses changes
        // nothing, so the plan stays good: the recording did not hold it either.
        let decision = self.decide(size, align)?;
        if let Some(member) = self.observers.member.borrow().as_ref() {
            member.leave();
        }
        self.close_window();
        self.apply(decision, size, align)
    }

    /// Places `size` bytes in the open window, if it is `owner`'s and has room (and
    /// `align` is no more than the lent block's base alignment).
    fn place_in_window(&self, size: usize, align: usize, owner: u64) -> Result<Option<Placed<B>>> {
        let end = self.window.end.get();
        if end == 0 || align > self.window.base_align.get() || owner != self.window.owner.get() {
            return Ok(None);
        }
        let Some(start) = align_up(self.cursor.get(), align) else { return Ok(None) };
        if start.checked_add(size).is_none_or(|e| e > end) {
            return Ok(None);
        }
        let placed = if self.debug.on.get() {
            // Under a debug mode the memory comes from a block of its own; the plan's
            // accounting runs as without it.
            self.debug_block(size, align)?
        } else {
            let base = self.window.base.get().expect("an open window has the lent block's base");
            (base, start)
        };
        self.cursor.set(align_up(start + size, self.min_align).unwrap_or(end).min(end));
        Ok(Some(placed))
    }

    /// Opens the window `lent` for `owner`'s run.
    fn open_window(&self, lent: Lent<B>, owner: u64) {
        self.close_window();
        // The cycle's first window: the member counted the cycle as holding its memory
        // (the block stays where it is while the cycle holds a window).
        self.window.holds.set(true);
        self.window.base.set(Some(lent.base));
        self.window.base_align.set(lent.base_align);
        self.window.own_cursor.set(self.cursor.get());
        self.window.start.set(lent.start);
        self.window.end.set(lent.end);
        self.window.owner.set(owner);
        self.window.regions.push(lent.start, lent.end);
        self.cursor.set(lent.start);
        // `cursor` counts in the lent block now: no fast path may go on serving the own
        // arena (a frame opened, or a cycle entered, before the replay started has the
        // own arena's limit). The fast path serves the window when `owner` is whoever
        // allocates on it now (the top frame, or the cycle when no frame is open);
        // anyone else's window is served on the slow path, which checks the owner.
        let serves =
            !self.debug.on.get() && !self.observers.recording.get() && owner == self.owner_at(self.frame_top.get());
        if serves {
            self.fast_base.set(Some(lent.base));
        }
        self.set_limit(if serves { lent.end } else { 0 });
    }

    /// A spill chunk of `size` bytes at `align`, lent by the member
    /// instead of taken from the backend, if it lends one (a recording iteration's, in
    /// memory where no live allocation is). It is the cycle's until its end, as a
    /// spill block is, and counted as one: only where the memory comes from differs.
    pub(super) fn lend_spill(&self, size: usize, align: usize) -> Option<Lent<B>> {
        if !self.observers.grouped.get() || self.debug.on.get() {
            return None;
        }
        let holds = self.window.holds.get();
        let lent = self.observers.member.borrow().as_ref()?.lend(self.owner(), size, align, holds)?;
        self.window.holds.set(true);
        self.window.base.set(Some(lent.base));
        self.window.regions.push(lent.start, lent.end);
        Some(lent)
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
        if self.observers.grouped.get() {
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
    #[inline]
    pub(super) fn window_bytes(&self) -> usize {
        let open = if self.window.end.get() > 0 { self.cursor.get() - self.window.start.get() } else { 0 };
        self.window.used.get() + open
    }

    /// The end of a member's cycle: the member is told of the close, and given back the
    /// windows it lent the cycle.
    pub(super) fn close_grouped(&self) {
        self.close_window();
        let holds = self.window.holds.replace(false);
        if let Some(member) = self.observers.member.borrow().as_ref() {
            member.cycle_closed(self.owner(), holds);
        }
        self.window.regions.clear();
        self.window.base.set(None);
    }

    /// A member dropped while its cycle holds a window (a raw `enter` never closed): the
    /// member stops counting it. No view can outlive the workspace it borrows, so the
    /// window's bytes are free.
    pub(super) fn forget_window(&mut self) {
        if let Some(member) = self.observers.member.get_mut().take() {
            if self.window.holds.replace(false) {
                member.release();
            }
            member.dropped();
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
