//! Allocation: the one-add fast path in the arena, and everything else on the cold
//! path — wrapping a circular workspace, spilling to separate blocks (counted for
//! learning), and the errors.

use super::{align_up, Engine, FIRST_SPILL_CHUNK, MIN_ALIGN_FLOOR};
use crate::backend::{ArenaBackend, Block};
use crate::config::{ResetPolicy, SpillPolicy};
use crate::error::{Error, Result};

impl<B: ArenaBackend> Engine<B> {
    /// Reserves `size` bytes aligned to `align` in the open cycle and returns the
    /// block base and the offset of the first byte.
    ///
    /// The region belongs to the cycle of the scope the caller holds: it is handed
    /// out again once that cycle ends. Each allocation occupies a multiple of the
    /// configured alignment, so `bytes_in_use` includes the padding after the last one.
    ///
    /// # Errors
    ///
    /// [`Error::NotOpen`] when no scope is open, [`Error::ZeroLength`] for `size == 0`,
    /// [`Error::InvalidInput`] when `align` is not a power of two,
    /// [`Error::Exhausted`] (spill policy Fail), [`Error::BudgetExceeded`], or a
    /// backend error from reserving a spill block; the workspace is unchanged.
    #[inline(always)]
    pub fn alloc(&self, size: usize, align: usize) -> Result<(<B::Block as Block>::Base, usize)> {
        match self.try_alloc_fast(size, align) {
            Some(placed) => Ok(placed),
            None => self.alloc_slow(size, align),
        }
    }

    /// The fast path of [`Engine::alloc`]: a bump in the arena, or `None` when the
    /// request needs the slow path (which [`Engine::alloc_slow`] takes). Same
    /// preconditions as `alloc`.
    #[inline(always)]
    pub fn try_alloc_fast(&self, size: usize, align: usize) -> Option<(<B::Block as Block>::Base, usize)> {
        self.bump(size, align, self.fast_limit.get())
    }

    /// A bump of the cursor below `limit` (`fast_limit`, or the top frame's
    /// `frame_limit`).
    #[inline(always)]
    pub(super) fn bump(&self, size: usize, align: usize, limit: usize) -> Option<(<B::Block as Block>::Base, usize)> {
        // The cursor is kept a multiple of `min_align`, so a request aligned to at most
        // that starts right at the cursor, and the dependency from one allocation to
        // the next is a single add. (The alignment tests fold away for the constant
        // alignment of an element type; one compare covers `0 < size <= isize::MAX`.)
        // A closed workspace has `fast_limit == 0`, so nothing passes here then.
        if size.wrapping_sub(1) < isize::MAX as usize
            && align.is_power_of_two()
            && (align <= MIN_ALIGN_FLOOR || align <= self.min_align)
        {
            let cursor = self.cursor.get();
            // No overflow: `size <= isize::MAX`, `align_mask < 2^30`, `cursor <= isize::MAX`.
            let end = cursor + ((size + self.align_mask) & !self.align_mask);
            if end <= limit {
                debug_assert!(self.fast_limit.get() == 0 || self.frame_top.get() == 0);
                debug_assert!(self.fast_base.get().is_some() && cursor.is_multiple_of(self.min_align));
                // SAFETY: `end > 0`, so `limit > 0`. `limit` is `fast_limit` or
                // `frame_limit`, each non-zero only while `fast_base` is the base of a
                // block that `[cursor, limit)` lies in: 0 while closed; while open set to
                // `capacity` (or to `open_start <= capacity`) with `fast_base` the arena's
                // base (`capacity > 0` exactly when there is an arena, replaced or
                // released only while closed), or to the end of a planned window with
                // `fast_base` the group arena's base (the group replaces its arena only
                // while no member holds a window, and a window is held until its cycle
                // ends). Only one limit is non-zero at a time (`fast_limit` is 0 while a
                // frame is open, `frame_limit` while none is), and whenever `cursor` moves
                // into another block's coordinates (a window opens or closes) that limit
                // is set again with `fast_base` (`open_window`, `close_window`). A frame's
                // close moves `cursor` down, never below the start of the block's range.
                let base = unsafe { self.fast_base.get().unwrap_unchecked() };
                self.cursor.set(end);
                if self.observers.tapped() {
                    // Only the top frame (or the cycle, with none open) bumps here. A
                    // member is not told: its window served the allocation as planned.
                    self.emit_alloc(self.frame_top.get(), size, align, false);
                }
                return Some((base, cursor));
            }
        }
        None
    }

    /// Moves the cursor past an allocation ending at `end`, keeping it a multiple of
    /// `min_align` (or at the end of the arena).
    fn advance_to(&self, end: usize) {
        let aligned = align_up(end, self.min_align).unwrap_or(usize::MAX);
        self.cursor.set(aligned.min(self.capacity.get()));
    }

    /// Everything [`Engine::try_alloc_fast`] does not serve: spilling, wrapping,
    /// allocations after a spill (counted for learning), and errors.
    ///
    /// # Errors
    ///
    /// As [`Engine::alloc`].
    #[inline]
    pub fn alloc_slow(&self, size: usize, align: usize) -> Result<(<B::Block as Block>::Base, usize)> {
        self.alloc_slow_at(size, align, 0)
    }

    /// The slow path of an allocation made at `level`: 0 for the cycle itself (as
    /// [`Engine::alloc_slow`]), otherwise by the frame of that level (after
    /// `try_alloc_frame`).
    ///
    /// # Errors
    ///
    /// As [`Engine::alloc`].
    #[cold]
    #[inline(never)]
    pub(crate) fn alloc_slow_at(
        &self,
        size: usize,
        align: usize,
        level: u32,
    ) -> Result<(<B::Block as Block>::Base, usize)> {
        let placed = if self.observers.grouped.get() {
            self.alloc_grouped(size, align, level)?
        } else {
            self.alloc_slow_unrecorded(size, align)?
        };
        self.pin(level);
        if self.observers.any() {
            self.emit_alloc(level, size, align, true);
        }
        Ok(placed)
    }

    /// The errors of a request that no workspace serves.
    pub(super) fn check_request(&self, size: usize, align: usize) -> Result<()> {
        if self.depth.get() == 0 {
            return Err(Error::NotOpen { workspace: self.name.clone(), action: "allocating" });
        }
        if size == 0 {
            return Err(Error::ZeroLength { workspace: self.name.clone(), shape: vec![0] });
        }
        if !align.is_power_of_two() {
            return Err(Error::InvalidInput(format!(
                "allocation in workspace '{}' asked for alignment {align}, which is not a power of two",
                self.name
            )));
        }
        Ok(())
    }

    pub(super) fn alloc_slow_unrecorded(
        &self,
        size: usize,
        align: usize,
    ) -> Result<(<B::Block as Block>::Base, usize)> {
        self.check_request(size, align)?;
        let decision = self.decide(size, align)?;
        self.apply(decision, size, align)
    }

    /// Where the slow path puts a request, or the error it returns, without changing
    /// anything (so a plan group's member can learn that its policy refuses a request
    /// before it leaves its plan for it). After `check_request`.
    ///
    /// A member of a plan group decides as an unplanned workspace with its configuration
    /// would: the bytes its cycle holds in planned windows count as if they were in its
    /// own arena, before the bytes it holds there (`window_bytes_if_grouped`).
    pub(super) fn decide(&self, size: usize, align: usize) -> Result<Decision> {
        let align = align.max(self.min_align);
        let capacity = self.capacity.get();
        let cursor = self.own_cursor();
        // What an unplanned workspace would hold in its arena besides: a member's windows.
        let held_elsewhere = self.window_bytes_if_grouped();
        // The arena as the accounting sees it: under spill-everything it has no memory,
        // but allocations are placed in it all the same (see `arena_memory`).
        if capacity > 0 && align <= self.base_alignment {
            // Does it fit in the arena after all (the fast path was off)?
            let limit = if self.wrapped.get() { self.open_start.get() } else { capacity };
            let logical = cursor.checked_add(held_elsewhere).and_then(|c| align_up(c, align));
            if let (Some(start), Some(logical)) = (align_up(cursor, align), logical) {
                // `cursor <= cursor + held_elsewhere`: where the logical start fits, the
                // real one does.
                if logical.checked_add(size).is_some_and(|end| end <= limit) {
                    return Ok(Decision::Arena { start });
                }
            }
            // Circular: wrap to the start if that overwrites nothing handed out
            // since the workspace was opened.
            if self.config.reset() == ResetPolicy::EndOfBuffer && !self.wrapped.get() && size <= self.open_start.get() {
                return Ok(Decision::Wrap);
            }
        }
        let learning = self.learning.left.get() > 0;
        if !learning && self.config.spill() == SpillPolicy::Fail {
            return Err(self.exhausted(size, align, cursor.saturating_add(held_elsewhere)));
        }
        self.check_budget(size, align)?;
        Ok(Decision::Spill)
    }

    /// Carries out what [`Engine::decide`] decided (with nothing changed in between
    /// but a closed window).
    pub(super) fn apply(
        &self,
        decision: Decision,
        size: usize,
        align: usize,
    ) -> Result<(<B::Block as Block>::Base, usize)> {
        let align = align.max(self.min_align);
        match decision {
            Decision::Arena { start } => {
                let base = self.arena_memory(start, size, align)?;
                self.advance_to(start + size);
                self.count_virtual(size, align);
                Ok(base)
            }
            Decision::Wrap => {
                let (capacity, cursor) = (self.capacity.get(), self.cursor.get());
                let base = self.arena_memory(0, size, align)?;
                self.wrapped.set(true);
                self.wrap_waste.set(capacity - cursor);
                self.counters.wraps.set(self.counters.wraps.get() + 1);
                self.advance_to(size);
                if self.virtual_cursor.get().is_none() && !self.debug.on.get() && !self.observers.recording.get() {
                    self.set_limit(self.open_start.get());
                }
                self.count_virtual(size, align);
                Ok(base)
            }
            Decision::Spill => self.spill(size, align),
        }
    }

    /// The memory for arena offset `offset`: in the arena, or under spill-everything
    /// a block of its own (released at the reset, like the arena's contents). A
    /// fixed-size arena (a file mapping) keeps serving its own memory: its contents
    /// are data the program reads back, which a block of its own would not hold.
    fn arena_memory(&self, offset: usize, size: usize, align: usize) -> Result<(<B::Block as Block>::Base, usize)> {
        if !self.debug.on.get() || self.backend.borrow().fixed_size() {
            if let Some(base) = self.arena_base.get() {
                return Ok((base, offset));
            }
        }
        self.debug_block(size, align)
    }

    /// Under a debug mode: a block of its own for a request that the accounting places
    /// in the arena or a window (released at the reset, as their contents are).
    pub(super) fn debug_block(&self, size: usize, align: usize) -> Result<(<B::Block as Block>::Base, usize)> {
        let block =
            self.backend.borrow_mut().allocate_spill(size, align).map_err(|e| self.backend_error_for(e, size))?;
        let base = block.base();
        self.debug.blocks.borrow_mut().push(block);
        self.counters.bytes_spilled.set(self.counters.bytes_spilled.get() + size as u64);
        self.counters.external_allocations.set(self.counters.external_allocations.get() + 1);
        Ok((base, 0))
    }

    fn exhausted(&self, size: usize, align: usize, cursor: usize) -> Error {
        let capacity = self.capacity.get();
        let limit = if self.wrapped.get() { self.open_start.get() } else { capacity };
        Error::Exhausted {
            workspace: self.name.clone(),
            requested: size,
            available: limit.saturating_sub(align_up(cursor, align).unwrap_or(usize::MAX)),
            capacity,
            report: self.report(size),
        }
    }

    /// Counts a request toward the contiguous size this cycle needs, padded to the
    /// configured alignment as the arena pads it (so a cycle counts the same bytes
    /// wherever it runs). The first call in a cycle starts from the arena bytes used
    /// so far and turns the fast path off, so every later allocation is counted here
    /// too.
    fn count_virtual(&self, size: usize, align: usize) {
        if let Some(v) = self.virtual_cursor.get() {
            let end = align_up(v, align).and_then(|start| start.checked_add(size));
            let padded = end.and_then(|end| align_up(end, self.min_align));
            self.virtual_cursor.set(Some(padded.unwrap_or(usize::MAX)));
        }
    }

    fn start_virtual(&self) {
        if self.virtual_cursor.get().is_none() {
            self.virtual_cursor.set(Some(self.cycle_bytes()));
            self.set_limit(0);
        }
    }

    /// The first spill of a learning cycle without an arena goes to a reservation
    /// from the backend, which the end of the cycle can turn into the learned arena
    /// (see [`ArenaBackend::reserve`]). `None` in every other case, or when the
    /// backend has none to give.
    fn reservation_for(&self, size: usize, align: usize, room: usize) -> Option<B::Block> {
        let first_learning_spill = self.learning.left.get() > 0
            && self.arena_base.get().is_none()
            && !self.debug.on.get()
            && align <= self.base_alignment
            && self.spill.blocks.borrow().is_empty();
        if !first_learning_spill {
            return None;
        }
        let block = self.backend.borrow_mut().reserve(size, room, self.base_alignment)?;
        if block.len() < size {
            self.backend.borrow_mut().release(block);
            return None;
        }
        self.spill.reserved.set(true);
        Some(block)
    }

    /// The budget: the arena (or, for a plan group's member, what it holds in its arena
    /// and its windows, if more) and what the spills need laid out contiguously, padded
    /// as an arena pads them. A cycle that fits the budget once is then learned into an
    /// arena that holds all of it, within the budget.
    fn check_budget(&self, size: usize, align: usize) -> Result<()> {
        let max = self.config.max_size();
        let need_before = self.spill.need.get();
        let need = align_up(need_before, align).and_then(|start| start.checked_add(size));
        let arena = self.budget_arena();
        if need.and_then(|need| need.checked_add(arena)).is_none_or(|total| total > max) {
            return Err(Error::BudgetExceeded {
                workspace: self.name.clone(),
                requested: size,
                in_use: self.budget_in_use(),
                arena,
                max_size: max,
                report: self.report(size),
            });
        }
        Ok(())
    }

    /// What the budget counts for the arena: its capacity, or for a plan group's member
    /// the bytes its cycle holds in its own arena and its windows, where that is more.
    ///
    /// For a member this is what an unplanned workspace of its configuration counts
    /// whenever the windows' bytes would fit in its own arena, or it has none (the
    /// members of a planned network): the windows stand for the arena's first bytes.
    /// Where a plan was recorded while the member spilled past an arena of its own, an
    /// unplanned workspace may have left that arena's tail unused before spilling; the
    /// windows are counted as if packed into it, so the budget's edge can differ by that
    /// tail.
    fn budget_arena(&self) -> usize {
        let capacity = self.capacity.get();
        if !self.observers.grouped.get() {
            return capacity;
        }
        let arena = match self.window_bytes() {
            0 => capacity,
            windows => {
                capacity.max(align_up(self.own_cursor().saturating_add(windows), self.min_align).unwrap_or(usize::MAX))
            }
        };
        // Frames that closed gave back their windows' bytes within the arena; those
        // beyond it count to the end of the cycle, as spill blocks do.
        arena.saturating_add(self.window_spill_kept())
    }

    /// Places a request in a spill block. Only for a [`Decision::Spill`], which checked
    /// the budget ([`Engine::check_budget`]).
    fn spill(&self, size: usize, align: usize) -> Result<(<B::Block as Block>::Base, usize)> {
        let max = self.config.max_size();
        let capacity = self.budget_arena();
        let need_before = self.spill.need.get();
        let need = align_up(need_before, align).and_then(|start| start.checked_add(size));
        let held = capacity + need_before;
        // Room in the current spill block?
        let fits = self.spill.base.get().filter(|_| align <= self.spill.align.get()).and_then(|base| {
            let start = align_up(self.spill.cursor.get(), align)?;
            let end = start.checked_add(size)?;
            (end <= self.spill.limit.get()).then_some((base, start, end))
        });
        let (base, start) = match fits {
            Some((base, start, end)) if !self.debug.on.get() => {
                self.spill.cursor.set(end);
                (base, start)
            }
            _ => {
                let room = max.saturating_sub(held).max(size);
                let chunk = if self.debug.on.get() {
                    size
                } else {
                    let doubled = self.spill.held.get().max(FIRST_SPILL_CHUNK / 2).saturating_mul(2);
                    doubled.min(room).max(size)
                };
                let reserved = self.reservation_for(size, align, room);
                // A lent chunk holds the request alone: the lender packs what the cycles of
                // an iteration hold at once, where a doubling chunk would take its room.
                let lent = if reserved.is_none() { self.lend_spill(size, align) } else { None };
                // The chunk: its base, the request's offset in it, its length and end,
                // the alignment of its base.
                let (base, start, len, end, base_align) = match lent {
                    // A chunk the member lends: counted as a spill block, never released
                    // to the backend (the member takes it back at the cycle's end).
                    Some(lent) => (lent.base, lent.start, lent.end - lent.start, lent.end, lent.base_align),
                    None => {
                        let block = match reserved {
                            Some(block) => block,
                            None => self
                                .backend
                                .borrow_mut()
                                .allocate_spill(chunk, align)
                                .map_err(|e| self.backend_error_for(e, size))?,
                        };
                        let (base, len) = (block.base(), block.len());
                        self.spill.blocks.borrow_mut().push(block);
                        (base, 0, len, len, align)
                    }
                };
                self.spill.held.set(self.spill.held.get() + len);
                self.spill.base.set(Some(base));
                self.spill.align.set(base_align);
                self.spill.cursor.set(start + size);
                self.spill.limit.set(end);
                (base, start)
            }
        };
        self.start_virtual();
        self.count_virtual(size, align);
        let need = need.and_then(|need| align_up(need, self.min_align)).unwrap_or(usize::MAX);
        self.spill.need.set(need);
        self.spill.in_use.set(self.spill.in_use.get() + size);
        self.counters.bytes_spilled.set(self.counters.bytes_spilled.get() + size as u64);
        self.counters.external_allocations.set(self.counters.external_allocations.get() + 1);
        Ok((base, start))
    }
}

/// What the slow path does with a request ([`Engine::decide`]).
#[derive(Clone, Copy, Debug)]
pub(super) enum Decision {
    /// In the own arena, at `start`.
    Arena { start: usize },
    /// Circular: at the start of the buffer.
    Wrap,
    /// In a spill block.
    Spill,
}
