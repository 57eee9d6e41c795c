//! Cycles: opening (a new generation) and nesting, closing the last scope, and what
//! the end of a cycle does: the reset, the statistics, learning and growth.

use super::{align_up, Engine, Entered};
use crate::backend::ArenaBackend;
use crate::config::{LearningPolicy, ResetPolicy, SpillPolicy};
use crate::error::{Error, Result};

impl<B: ArenaBackend> Engine<B> {
    /// Opens the workspace (new cycle, new generation) or nests in the open one.
    ///
    /// # Errors
    ///
    /// A backend error recorded while closing the previous cycle: the backend refused
    /// to grow the arena. The workspace is then left closed and usable with its previous
    /// arena, and so it stays for every later cycle: a refusal is reported once (by one
    /// `enter`), later ones are only counted ([`WorkspaceStats::failed_growths`]), and
    /// the same growth is retried only after a back-off. Or the backend's error from
    /// reserving the arena again after `trim()`, reported the same way.
    ///
    /// [`WorkspaceStats::failed_growths`]: crate::WorkspaceStats::failed_growths
    #[inline]
    pub fn enter(&self) -> Result<Entered> {
        let depth = self.depth.get();
        if depth > 0 {
            self.depth.set(depth + 1);
            return Ok(Entered::Nested);
        }
        if self.attention.get() {
            self.settle()?;
        }
        self.generation.set(self.generation.get() + 1);
        if self.config.reset() == ResetPolicy::EndOfBuffer {
            // Scoped workspaces keep these at 0 / false: their cursor restarts at 0.
            self.open_start.set(self.cursor.get());
            self.wrapped.set(false);
            self.wrap_waste.set(0);
        }
        let slow_only = self.debug.on.get() || self.observers.recording.get();
        self.fast_base.set(self.arena_base.get());
        let fast_limit = if slow_only { 0 } else { self.capacity.get() };
        self.depth.set(1);
        if self.observers.grouped.get() {
            self.fast_limit.set(0);
            self.enter_grouped(fast_limit);
        } else {
            self.fast_limit.set(fast_limit);
        }
        Ok(Entered::Opened)
    }

    /// Deferred work before opening: report an error recorded while closing, or
    /// restore the arena after `trim()`.
    #[cold]
    #[inline(never)]
    pub(super) fn settle(&self) -> Result<()> {
        self.attention.set(false);
        if let Some(source) = self.pending.take() {
            return Err(self.backend_error(source));
        }
        let restore = self.learning.restore_to.take();
        if restore > self.capacity.get() {
            // Trimmed below the configured size: come back to it (or keep trying, with
            // the back-off of a refused growth, while running from spill blocks).
            match self.grow(restore) {
                Growth::Grew => {}
                refused => {
                    self.learning.restore_to.set(restore);
                    self.attention.set(true);
                    if let Growth::Refused(Some(source)) = refused {
                        return Err(self.backend_error(source));
                    }
                }
            }
        }
        Ok(())
    }

    /// Replaces the arena with one of `target` bytes (only while closed), unless the
    /// backend refused that size or a smaller one before and the back-off has not run
    /// out (see [`crate::refusals`]; the back-off counts cycles).
    #[cold]
    pub(super) fn grow(&self, target: usize) -> Growth {
        let mut refusals = self.learning.refusals.get();
        let now = self.generation.get();
        if refusals.defers(target, now) {
            return Growth::Deferred;
        }
        match self.replace_arena(target) {
            Ok(()) => {
                if refusals.granted(target) {
                    self.learning.refusals.set(refusals);
                    self.refresh_plain_close();
                }
                Growth::Grew
            }
            Err(source) => {
                self.counters.failed_growths.set(self.counters.failed_growths.get() + 1);
                let first = refusals.refused(target, now);
                self.learning.refusals.set(refusals);
                self.refresh_plain_close();
                Growth::Refused(first.then_some(source))
            }
        }
    }

    /// Adds a scope to an already open workspace without nesting a cycle.
    ///
    /// # Errors
    ///
    /// [`Error::NotOpen`] when the workspace is closed.
    pub fn borrow_open(&self, action: &'static str) -> Result<()> {
        match self.depth.get() {
            0 => Err(Error::NotOpen { workspace: self.name.clone(), action }),
            depth => {
                self.depth.set(depth + 1);
                Ok(())
            }
        }
    }

    /// Closes one scope; the last one ends the cycle and resets the arena.
    ///
    /// Never panics; a failure to grow the arena is reported by the next `enter`.
    ///
    /// # Safety
    ///
    /// The caller must hold one of the scopes counted by `enter`/`borrow_open` and
    /// give it up: once the count reaches zero, memory handed out by this cycle is
    /// reused, so nothing may still refer to it.
    #[inline(always)]
    pub unsafe fn exit(&self) {
        let depth = self.depth.get();
        debug_assert!(depth > 0, "exit without a matching enter");
        self.depth.set(depth.saturating_sub(1));
        if depth == 1 {
            self.close_cycle();
        }
    }

    /// Bytes this cycle needs in one contiguous arena (the most it held at once, where
    /// frames gave bytes back).
    pub(super) fn cycle_bytes(&self) -> usize {
        self.virtual_cursor.get().unwrap_or_else(|| self.open_bytes()).max(self.frames.high.get())
    }

    /// Arena bytes handed out since the workspace was last opened.
    pub(super) fn open_bytes(&self) -> usize {
        let start = self.open_start.get();
        if self.observers.grouped.get() {
            // A member of a plan group: its own arena's bytes and its planned windows'.
            return self.own_cursor().saturating_sub(start) + self.window_bytes();
        }
        let cursor = self.cursor.get();
        if self.wrapped.get() {
            (self.capacity.get() - self.wrap_waste.get()).saturating_sub(start) + cursor
        } else {
            cursor.saturating_sub(start)
        }
    }

    /// Forgets where the cursor was: the arena was replaced or released.
    pub(super) fn rewind(&self) {
        self.cursor.set(0);
        self.open_start.set(0);
        self.wrapped.set(false);
        self.wrap_waste.set(0);
    }

    #[inline(always)]
    pub(super) fn close_cycle(&self) {
        if self.observers.watch_closes() {
            // (A member hears of the close from `close_grouped`, with its windows.)
            self.emit(crate::plan::Event::Close { owner: self.owner() }, 0, false);
        }
        // The next cycle's role is what its enter says, if anything.
        self.role.set(crate::roles::NO_ROLE);
        // The common case: a scoped workspace whose cycle did not spill (so the fast
        // path is still on and `open_start` is 0), with no cycle history to record.
        if self.plain_close.get() && self.virtual_cursor.get().is_none() {
            // A cycle counts whole multiples of the alignment wherever it ran (the last
            // allocation may end unpadded at the end of an arena capped by `max_size`).
            let bytes = (self.cursor.get() + self.align_mask) & !self.align_mask;
            self.count_cycle(bytes, bytes);
            self.cursor.set(0);
            self.fast_limit.set(0);
            if self.learning.left.get() > 0 && bytes > 0 {
                self.learn(bytes);
            }
            return;
        }
        self.close_cycle_general();
    }

    /// Counts a cycle that held `in_use` bytes at most and needs `bytes` of arena.
    #[inline(always)]
    pub(super) fn count_cycle(&self, in_use: usize, bytes: usize) {
        self.counters.peak.set(self.counters.peak.get().max(in_use));
        self.counters.last_cycle_bytes.set(bytes);
    }

    /// The end of a cycle that the plain close does not serve.
    #[cold]
    #[inline(never)]
    pub(super) fn close_cycle_general(&self) {
        if self.observers.grouped.get() {
            // The member is told of the close and given its windows back in one call.
            self.close_grouped();
            if self.plain_member.get()
                && self.virtual_cursor.get().is_none()
                && !self.frames.used.get()
                && self.learning.left.get() == 0
            {
                // The common case of a member (a replayed cycle that ran in its windows,
                // or one in its own arena): nothing spilled, no frame, no learning left,
                // no debug mode, cycle history, recording or refused growth. What the rest of
                // this function does then: count the cycle and reset.
                // (`open_bytes` with the window closed: the own arena's bytes, from 0 in a
                // workspace that resets at each cycle's end, and the windows'.)
                debug_assert_eq!(self.open_start.get(), 0, "a member resets at each cycle's end");
                let in_use = self.cursor.get() + self.window_bytes();
                self.count_cycle(in_use, align_up(in_use, self.min_align).unwrap_or(usize::MAX));
                self.cursor.set(0);
                self.fast_limit.set(0);
                self.reset_window_bytes();
                return;
            }
        }
        let bytes = align_up(self.cycle_bytes(), self.min_align).unwrap_or(usize::MAX);
        let in_use = self.open_bytes().max(self.frames.high.get()) + self.spill.need.get();
        self.count_cycle(in_use, bytes);
        if self.config.cycle_history_len() > 0 {
            self.record_cycle(bytes);
        }
        // Every spill starts the virtual cursor, so no virtual cursor means no spills.
        let spilled = self.virtual_cursor.take().is_some();
        if spilled && self.learning.left.get() == 0 {
            self.counters.spilled_after_learning.set(self.counters.spilled_after_learning.get() + 1);
        }
        self.release_debug_blocks();
        if self.config.reset() == ResetPolicy::BlockLeft {
            self.cursor.set(0);
        }
        // A cycle that allocated nothing teaches nothing: it does not use up learning.
        let learning = self.learning.left.get() > 0 && bytes > 0;
        if learning || (spilled && self.config.spill() == SpillPolicy::Reallocate) {
            // Before the spills go: the new arena may be the reservation they sit in.
            self.learn(bytes);
        } else if self.learning.refusals.get().stand() {
            // The size learned was refused: asked for again (after the back-off) whatever
            // the spill policy, so that memory that comes back is used. (While a refusal
            // stands every cycle ends here: `refresh_plain_close`.)
            if let Some(learned) = self.learning.learned.get() {
                self.grow_at_close(self.config.capacity_for(learned), true);
            }
        }
        if spilled {
            self.release_spills();
        }
        self.fast_limit.set(0);
        if self.observers.grouped.get() {
            self.reset_window_bytes();
        }
        if self.frames.used.replace(false) {
            self.end_frames();
            self.refresh_plain_close();
        }
    }

    #[cold]
    pub(super) fn record_cycle(&self, bytes: usize) {
        let mut history = self.cycle_history.borrow_mut();
        if history.len() == self.config.cycle_history_len() {
            history.pop_front();
        }
        history.push_back(bytes);
    }

    /// Learning and Reallocate growth at the end of a cycle that needed `bytes`.
    #[cold]
    pub(super) fn learn(&self, bytes: usize) {
        let left = self.learning.left.get();
        let target = if left > 0 {
            let max = self.learning.max.get().max(bytes);
            self.learning.max.set(max);
            self.learning.left.set(left - 1);
            if left > 1 {
                return;
            }
            self.learning.learned.set(Some(max));
            self.config.capacity_for(max)
        } else {
            let learned = self.learning.learned.get().unwrap_or(0).max(bytes);
            self.learning.learned.set(Some(learned));
            self.config.capacity_for(learned)
        };
        // The arena's pages are mapped now, rather than by whichever later cycle first
        // reaches them, when no single cycle has touched them: after growth (the cycle
        // that outgrew the arena ran in spill blocks) and after learning over several
        // cycles (each reached a different depth). An arena learned from one cycle has
        // exactly the pages that cycle touched.
        let prefault = left == 0 || matches!(self.config.learning(), LearningPolicy::OverTime { cycles } if cycles > 1);
        self.grow_at_close(target, prefault);
    }

    /// Grows the arena to `target` bytes at the end of a cycle, if it is smaller; a
    /// refusal is reported by the next enter (once: see [`crate::refusals`]).
    #[cold]
    fn grow_at_close(&self, target: usize, prefault: bool) {
        if target > self.capacity.get() {
            match self.grow(target) {
                Growth::Grew => {
                    self.counters.growth_events.set(self.counters.growth_events.get() + 1);
                    if prefault {
                        if let Some(arena) = self.arena.borrow().as_ref() {
                            // SAFETY: the cycle has closed (this is its end) and the arena
                            // was just installed: none of its memory has been handed out.
                            unsafe { self.backend.borrow_mut().prefault(arena) };
                        }
                    }
                }
                // Reported once, by the next enter; the workspace stays usable with its
                // previous arena, and later cycles spill as this one did.
                Growth::Refused(Some(source)) => {
                    self.pending.set(Some(source));
                    self.attention.set(true);
                }
                Growth::Refused(None) | Growth::Deferred => {}
            }
        }
    }
}

/// What [`Engine::grow`] did.
pub(super) enum Growth {
    /// The arena was replaced.
    Grew,
    /// Not tried: the size was refused before and the back-off has not run out.
    Deferred,
    /// The backend refused; the error is there for the first refusal since the last
    /// growth (the one to report), `None` for later ones (only counted).
    Refused(Option<crate::error::BackendError>),
}
