//! Frames: release points inside a cycle.
//!
//! A frame is opened inside an open cycle and hands out memory like the cycle does;
//! when it closes, the arena bytes it took are handed out again by the same cycle
//! (the cursor goes back to where the frame opened). The host's
//! [`Frame`](crate::Frame) borrows its scope and its views borrow the frame, so the
//! compiler proves them dead when the frame closes, as it does for a scope.
//!
//! Frames nest; each has a *level* (1 for the first, one more for each frame opened
//! while another is open), and the innermost open frame is the *top*. The rules that
//! make the rewind sound whatever order frames close in, and whatever the rest of the
//! cycle allocates meanwhile:
//!
//! - Only the top frame allocates on the fast path (`try_alloc_frame` checks its
//!   level); while any frame is open the cycle's own fast path is off (`fast_limit`
//!   is 0), so every other allocation takes the slow path.
//! - An allocation on the slow path by anything but the top frame (the cycle itself,
//!   another scope of it, a frame below the top) raises the *floor* to the cursor
//!   after it: no frame rewinds below the floor, so that allocation outlives every
//!   frame.
//! - Only the top frame rewinds when it closes, to the larger of its start and the
//!   floor. Everything above that was taken after it opened, by itself or by frames
//!   opened after it, which are all closed (a frame opened after it has a larger
//!   level, and the top only comes back down to a level when the frame at each level
//!   above has closed). A frame that closes while it is not the top gives nothing
//!   back: its bytes wait for the end of the cycle. Levels are unique among open
//!   frames, since the top is at least the level of every open frame.
//! - A frame that is never closed (`mem::forget`) keeps its level, and its bytes are
//!   kept to the end of the cycle; the end of the cycle forgets every frame.
//!
//! Each frame is an owner of its own in a recorded trace ([`Engine::owner_at`]): its
//! allocations die at its close, which the planner sees as that owner's
//! [`Close`](crate::plan::Event::Close). A member of a plan group checks the close
//! against the plan like the end of a cycle.

use std::cell::Cell;

use super::Engine;
use crate::backend::ArenaBackend;
use crate::error::{Error, Result};
use crate::plan::Event;

/// Bits of a frame owner that hold the workspace's id (the level is above them).
const LEVEL_SHIFT: u32 = 48;

/// The deepest frame level.
pub(crate) const MAX_LEVEL: u32 = u16::MAX as u32;

/// The frames of the open cycle (besides `frame_top` and `frame_limit`, which the fast
/// path reads).
#[derive(Default)]
pub(super) struct Frames {
    /// Frames open now (closed ones are not counted; forgotten ones stay counted).
    open: Cell<u32>,
    /// No frame rewinds the cursor below this (see the module docs).
    floor: Cell<usize>,
    /// Nor the cycle's contiguous size (`virtual_cursor`) below this.
    virtual_floor: Cell<usize>,
    /// The most bytes the cycle held before a rewind gave some back.
    pub(super) high: Cell<usize>,
}

/// What a frame needs to close: given by [`Engine::open_frame`], taken back by
/// [`Engine::close_frame`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameMark {
    level: u32,
    /// The own arena's cursor when the frame opened.
    start: usize,
    /// The cycle's contiguous size so far when the frame opened (the virtual cursor,
    /// or the arena bytes before any spill).
    virtual_start: usize,
    /// Wraps of a circular workspace when the frame opened.
    wraps: u64,
    generation: u64,
}

impl FrameMark {
    /// The frame's level: 1 for the outermost frame of a cycle.
    pub fn level(&self) -> u32 {
        self.level
    }
}

impl<B: ArenaBackend> Engine<B> {
    /// The owner id of the allocations made at `level` (0: the cycle itself, otherwise
    /// the frame of that level) in a recorded trace. Distinct for every workspace and
    /// level (ids below 2^48: one new workspace per nanosecond would take nine years to
    /// reach that).
    pub fn owner_at(&self, level: u32) -> u64 {
        (self.id & ((1 << LEVEL_SHIFT) - 1)) | u64::from(level) << LEVEL_SHIFT
    }

    /// Opens a frame in the open cycle; see the module docs.
    ///
    /// # Errors
    ///
    /// [`Error::NotOpen`] when the workspace is closed; [`Error::InvalidInput`] when
    /// 65,535 frames are open already.
    pub fn open_frame(&self) -> Result<FrameMark> {
        if self.depth.get() == 0 {
            return Err(Error::NotOpen { workspace: self.name.clone(), action: "opening a frame" });
        }
        let top = self.frame_top.get();
        if top >= MAX_LEVEL {
            return Err(Error::InvalidInput(format!(
                "workspace '{}' has {MAX_LEVEL} frames open at once: close some before opening more",
                self.name
            )));
        }
        if top == 0 {
            // The cycle's fast path is off while frames are open; the top frame's is on.
            self.frame_limit.set(self.fast_limit.replace(0));
        }
        if self.grouped.get() {
            // An open window is the run of another owner: the frame's first allocation
            // takes the slow path, to the plan's next step. (The window stays open: a
            // frame's open is no event, so the run may go on after it.)
            self.frame_limit.set(0);
        }
        self.frame_top.set(top + 1);
        self.frames.open.set(self.frames.open.get() + 1);
        // The end of this cycle forgets the frames (`end_frames`), on the long path.
        self.plain_close.set(false);
        Ok(FrameMark {
            level: top + 1,
            start: self.own_cursor(),
            virtual_start: self.virtual_position(),
            wraps: self.counters.wraps.get(),
            generation: self.generation.get(),
        })
    }

    /// The fast path of an allocation by the frame of `level`: a bump while it is the
    /// top frame, otherwise `None` (the slow path, [`Engine::alloc_slow_at`]).
    #[inline(always)]
    pub fn try_alloc_frame(
        &self,
        level: u32,
        size: usize,
        align: usize,
    ) -> Option<(<B::Block as crate::backend::Block>::Base, usize)> {
        if self.frame_top.get() != level {
            return None;
        }
        self.bump(size, align, self.frame_limit.get())
    }

    /// Sets the limit of whichever fast path serves now: the top frame's while a frame
    /// is open, the cycle's otherwise.
    pub(super) fn set_limit(&self, limit: usize) {
        if self.frame_top.get() > 0 {
            self.frame_limit.set(limit);
        } else {
            self.fast_limit.set(limit);
        }
    }

    /// After an allocation on the slow path by `level`: raises the floor when it is not
    /// the top frame's, so that no frame's close gives its bytes back.
    pub(super) fn pin(&self, level: u32) {
        if self.frames.open.get() > 0 && level != self.frame_top.get() {
            self.frames.floor.set(self.frames.floor.get().max(self.own_cursor()));
            self.frames.virtual_floor.set(self.frames.virtual_floor.get().max(self.virtual_position()));
        }
    }

    /// Where the cycle's contiguous size stands: the virtual cursor once something
    /// spilled, the arena bytes before.
    fn virtual_position(&self) -> usize {
        self.virtual_cursor.get().unwrap_or_else(|| self.open_bytes())
    }

    /// Closes the frame opened with `mark`: the top frame's arena bytes are handed out
    /// again (see the module docs).
    ///
    /// # Safety
    ///
    /// `mark` comes from [`Engine::open_frame`] on this engine, this is its only close,
    /// and nothing refers any more to memory handed out at the frame's level since it
    /// opened.
    pub unsafe fn close_frame(&self, mark: FrameMark) {
        if self.depth.get() == 0 || mark.generation != self.generation.get() || mark.level == 0 {
            // Not a frame of this cycle (a cycle ends only when its scopes, which a
            // frame borrows, have closed): nothing to give back.
            return;
        }
        let owner = self.owner_at(mark.level);
        if self.grouped.get() {
            self.close_window();
            self.step_close(owner);
        }
        if self.recording.get() {
            self.record(Event::Close { owner });
        }
        let open = self.frames.open.get().saturating_sub(1);
        self.frames.open.set(open);
        let top = self.frame_top.get();
        if mark.level == top {
            // A circular workspace that wrapped meanwhile keeps everything to the end of
            // the cycle.
            if mark.wraps == self.counters.wraps.get() {
                let to = mark.start.max(self.frames.floor.get());
                if to < self.cursor.get() {
                    self.frames.high.set(self.frames.high.get().max(self.open_bytes()));
                    self.cursor.set(to);
                }
                // A cycle that spilled counts what it needs laid out contiguously (what
                // learning sizes the arena to): the frame's bytes are not needed twice.
                // Its spill blocks stay held, and counted by the budget, to the end of
                // the cycle.
                if let Some(size) = self.virtual_cursor.get() {
                    let to = mark.virtual_start.max(self.frames.virtual_floor.get());
                    if to < size {
                        self.frames.high.set(self.frames.high.get().max(size));
                        self.virtual_cursor.set(Some(to));
                    }
                }
            }
            self.frame_top.set(top - 1);
        }
        if open == 0 {
            self.frame_top.set(0);
        }
        if self.frame_top.get() == 0 {
            self.fast_limit.set(self.frame_limit.replace(0));
        }
    }

    /// The end of a cycle: every frame is forgotten (a frame never closed keeps its
    /// level to here).
    pub(super) fn end_frames(&self) {
        self.frame_top.set(0);
        self.frame_limit.set(0);
        self.frames.open.set(0);
        self.frames.floor.set(0);
        self.frames.virtual_floor.set(0);
        self.frames.high.set(0);
    }
}
