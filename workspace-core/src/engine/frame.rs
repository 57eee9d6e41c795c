//! Frames: release points inside a cycle.
//!
//! A frame is opened inside an open cycle and hands out memory like the cycle does;
//! when it closes, the arena bytes it took are handed out again by the same cycle
//! (the cursor goes back to where the frame opened). The host's
//! [`Frame`](crate::Frame) borrows its scope and its views borrow the frame, so the
//! compiler proves them dead when the frame closes, as it does for a scope.
//!
//! Frames nest; each has a *level* (1 for the first, one more for each frame opened
//! while another is open), and the innermost open frame is the *top*. The engine keeps
//! a slot per level up to the top: open frames, and closed ones still below an open
//! one. The rules that make the rewind sound whatever order frames close in, and
//! whatever the rest of the cycle allocates meanwhile:
//!
//! - Only the top frame allocates on the fast path (`try_alloc_frame` checks its
//!   level); while any frame is open the cycle's own fast path is off (`fast_limit`
//!   is 0), so every other allocation takes the slow path.
//! - An allocation on the slow path by anything but the top frame (the cycle itself,
//!   another scope of it, a frame below the top) raises the *floor* to the cursor
//!   after it: no frame rewinds below the floor, so that allocation outlives every
//!   frame.
//! - A frame that closes while it is not the top only marks its slot closed. When the
//!   top closes, its slot and every closed slot right below it go, and the cursor goes
//!   back to the larger of the lowest of their starts and the floor. Everything above
//!   that was taken after that frame opened, by it or by frames opened after it, which
//!   are all closed (their slots are above it), or by allocations below the floor.
//!   Levels are unique among open frames: a level is given again only once its slot
//!   has gone.
//! - A frame that is never closed (`mem::forget`) keeps its slot, and its bytes are
//!   kept to the end of the cycle; the end of the cycle forgets every frame.
//! - Under a debug mode (every allocation a block of its own) the blocks taken above
//!   the same point are given back as well, so a use of a closed frame's memory is a
//!   use after free that valgrind reports.
//!
//! Each frame is an owner of its own in a recorded trace ([`Engine::owner_at`]): its
//! allocations die at its close, which the planner sees as that owner's
//! [`Close`](crate::plan::Event::Close). A member of a plan group checks the close
//! against the plan like the end of a cycle (its member is told of the close).

use std::cell::{Cell, RefCell};

use super::Engine;
use crate::backend::{ArenaBackend, Block};
use crate::error::{Error, Result};
use crate::plan::Event;

/// Bits of a frame owner that hold the workspace's id (the level is above them).
const LEVEL_SHIFT: u32 = crate::plan::FRAME_LEVEL_SHIFT;

/// The deepest frame level.
pub(crate) const MAX_LEVEL: u32 = u16::MAX as u32;

/// The frames of the open cycle (besides `frame_top` and `frame_limit`, which the fast
/// path reads).
#[derive(Default)]
pub(super) struct Frames {
    /// One per level from 1 to the top (index `level - 1`).
    slots: RefCell<Vec<Slot>>,
    /// No frame rewinds the cursor below this (see the module docs).
    floor: Cell<usize>,
    /// Nor the cycle's contiguous size (`virtual_cursor`) below this.
    virtual_floor: Cell<usize>,
    /// Nor a plan group member's count of bytes in windows below this.
    window_floor: Cell<usize>,
    /// Nor gives back debug blocks (or, under a debug mode, spill blocks) below these
    /// counts.
    debug_floor: Cell<usize>,
    spill_floor: Cell<usize>,
    /// The most bytes the cycle held before a rewind gave some back.
    pub(super) high: Cell<usize>,
    /// Whether a frame opened in this cycle (its end then forgets them).
    pub(super) used: Cell<bool>,
}

/// A level's frame: where the cycle stood when it opened.
#[derive(Clone, Copy, Debug)]
struct Slot {
    /// Still open (a closed slot waits for the frames above it).
    open: bool,
    /// The own arena's cursor.
    start: usize,
    /// The cycle's contiguous size so far (the virtual cursor, or the arena bytes
    /// before any spill).
    virtual_start: usize,
    /// Wraps of a circular workspace.
    wraps: u64,
    /// A plan group member's bytes in windows (0 for other workspaces): what the
    /// member counts as if it were in its arena, given back with the frame's own bytes.
    window_start: usize,
    /// Debug blocks and spill blocks held.
    debug_blocks: usize,
    spill_blocks: usize,
}

/// What a frame needs to close: given by [`Engine::open_frame`], taken back by
/// [`Engine::close_frame`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameMark {
    level: u32,
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
    /// the frame of that level) in a recorded trace: the workspace's id with the level
    /// above its low 48 bits. Distinct for every workspace and level while ids stay
    /// below 2^48, which a plan group checks when a workspace joins (a process that
    /// made 2^48 workspaces gets an error there, never a plan that confuses two).
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
        if self.observers.grouped.get() && self.window_is_open() {
            // The open window is the run of another owner: the frame's first allocation
            // takes the slow path, to the plan's next step. (The window stays open: a
            // frame's open is no event, so the run may go on after it.)
            self.frame_limit.set(0);
        }
        self.frames.slots.borrow_mut().push(Slot {
            open: true,
            start: self.own_cursor(),
            virtual_start: self.virtual_position(),
            wraps: self.counters.wraps.get(),
            window_start: self.window_bytes_if_grouped(),
            debug_blocks: self.debug.blocks.borrow().len(),
            spill_blocks: self.spill.blocks.borrow().len(),
        });
        self.frame_top.set(top + 1);
        // The end of this cycle forgets the frames (`end_frames`), on the long path.
        self.plain_close.set(false);
        self.frames.used.set(true);
        Ok(FrameMark { level: top + 1, generation: self.generation.get() })
    }

    /// The fast path of an allocation by the frame of `level`: a bump while it is the
    /// top frame, otherwise `None` (the slow path, `alloc_slow_at`).
    #[inline(always)]
    pub(crate) fn try_alloc_frame(
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
        let top = self.frame_top.get();
        if top > 0 && level != top {
            let f = &self.frames;
            f.floor.set(f.floor.get().max(self.own_cursor()));
            f.virtual_floor.set(f.virtual_floor.get().max(self.virtual_position()));
            f.window_floor.set(f.window_floor.get().max(self.window_bytes_if_grouped()));
            f.debug_floor.set(self.debug.blocks.borrow().len());
            f.spill_floor.set(self.spill.blocks.borrow().len());
        }
    }

    /// Where the cycle's contiguous size stands: the virtual cursor once something
    /// spilled, the arena bytes before.
    fn virtual_position(&self) -> usize {
        self.virtual_cursor.get().unwrap_or_else(|| self.open_bytes())
    }

    /// Closes the frame opened with `mark`: when it is the top, the arena bytes of the
    /// closed frames at the top are handed out again (see the module docs).
    ///
    /// # Safety
    ///
    /// `mark` comes from [`Engine::open_frame`] on this engine, this is its only close,
    /// and nothing refers any more to memory handed out at the frame's level since it
    /// opened.
    pub unsafe fn close_frame(&self, mark: FrameMark) {
        let level = mark.level as usize;
        if self.depth.get() == 0 || mark.generation != self.generation.get() || level == 0 {
            // Not a frame of this cycle (a cycle ends only when its scopes, which a
            // frame borrows, have closed): nothing to give back.
            return;
        }
        if !self.frames.slots.borrow().get(level - 1).is_some_and(|slot| slot.open) {
            return;
        }
        let owner = self.owner_at(mark.level);
        if self.observers.grouped.get() {
            // Before the top moves: the window's limit is the closing frame's.
            self.close_window();
        }
        if self.observers.any() {
            self.emit(Event::Close { owner }, 0, true);
        }
        let lowest = {
            let mut slots = self.frames.slots.borrow_mut();
            slots[level - 1].open = false;
            let mut lowest = None;
            while slots.last().is_some_and(|slot| !slot.open) {
                lowest = slots.pop();
            }
            self.frame_top.set(slots.len() as u32);
            lowest
        };
        if let Some(slot) = lowest {
            self.rewind_to(slot);
        }
        if self.frame_top.get() == 0 {
            self.fast_limit.set(self.frame_limit.replace(0));
        }
    }

    /// Gives back what the cycle took since `slot`'s frame opened, above the floors.
    fn rewind_to(&self, slot: Slot) {
        // A circular workspace that wrapped meanwhile keeps everything to the end of
        // the cycle.
        if slot.wraps != self.counters.wraps.get() {
            return;
        }
        let f = &self.frames;
        // A plan group member counts the bytes its windows hold as if they were in its
        // arena (`Engine::decide`): those of the frame's runs are given back too, as an
        // unplanned workspace's rewind gives back the frame's arena bytes. (Its window
        // was closed before this.)
        if self.observers.grouped.get() {
            let to = slot.window_start.max(f.window_floor.get());
            if to < self.window_bytes() {
                f.high.set(f.high.get().max(self.open_bytes()));
                self.rewind_window_bytes(to);
            }
        }
        let to = slot.start.max(f.floor.get());
        if to < self.cursor.get() {
            f.high.set(f.high.get().max(self.open_bytes()));
            self.cursor.set(to);
        }
        // A cycle that spilled counts what it needs laid out contiguously (what learning
        // sizes the arena to): the frame's bytes are not needed twice. Its spill blocks
        // stay held, and counted by the budget, to the end of the cycle.
        if let Some(size) = self.virtual_cursor.get() {
            let to = slot.virtual_start.max(f.virtual_floor.get());
            if to < size {
                f.high.set(f.high.get().max(size));
                self.virtual_cursor.set(Some(to));
            }
        }
        if self.debug.on.get() {
            // Every allocation was a block of its own: those of the closed frames go now.
            let mut backend = self.backend.borrow_mut();
            let mut blocks = self.debug.blocks.borrow_mut();
            let from = slot.debug_blocks.max(f.debug_floor.get());
            if blocks.len() > from {
                blocks.drain(from..).for_each(|block| backend.release(block));
            }
            let mut spills = self.spill.blocks.borrow_mut();
            let from = slot.spill_blocks.max(f.spill_floor.get());
            if spills.len() > from {
                for block in spills.drain(from..) {
                    self.spill.held.set(self.spill.held.get() - block.len());
                    backend.release(block);
                }
                // The last block's free range went with it (under a debug mode the next
                // spill takes a block of its own anyway).
                self.spill.base.set(None);
                self.spill.cursor.set(0);
                self.spill.limit.set(0);
            }
        }
    }

    /// The end of a cycle: every frame is forgotten (a frame never closed keeps its
    /// level to here).
    pub(super) fn end_frames(&self) {
        self.frame_top.set(0);
        self.frame_limit.set(0);
        self.frames.slots.borrow_mut().clear();
        self.frames.floor.set(0);
        self.frames.virtual_floor.set(0);
        self.frames.window_floor.set(0);
        self.frames.debug_floor.set(0);
        self.frames.spill_floor.set(0);
        self.frames.high.set(0);
    }
}
