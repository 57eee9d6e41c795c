//! The arena and the blocks around it: giving spill and debug blocks back, replacing
//! the arena (the first cycle's reservation becomes it), and `trim`.

use super::{align_up, Engine};
use crate::backend::{ArenaBackend, Block};
use crate::config::LearningPolicy;
use crate::error::{BackendError, Result};

impl<B: ArenaBackend> Engine<B> {
    pub(super) fn release_debug_blocks(&self) {
        let mut blocks = self.debug.blocks.borrow_mut();
        if !blocks.is_empty() {
            let mut backend = self.backend.borrow_mut();
            for block in blocks.drain(..) {
                backend.release(block);
            }
        }
    }

    pub(super) fn release_spills(&self) {
        let mut spills = self.spill.blocks.borrow_mut();
        let mut backend = self.backend.borrow_mut();
        for block in spills.drain(..) {
            backend.release(block);
        }
        self.spill.reserved.set(false);
        self.spill.held.set(0);
        self.spill.need.set(0);
        self.spill.in_use.set(0);
        self.spill.cursor.set(0);
        self.spill.limit.set(0);
        self.spill.base.set(None);
    }

    /// Reserves a new arena of `size` bytes, then gives the old one back. Only while
    /// closed (nothing refers to the old arena).
    pub(super) fn replace_arena(&self, size: usize) -> Result<(), BackendError> {
        debug_assert_eq!(self.depth.get(), 0);
        let mut backend = self.backend.borrow_mut();
        if self.debug.on.get() {
            // The arena exists in the accounting only (see `Debug`). It is asked for all
            // the same, and given back at once, so that a size the backend refuses is
            // refused under the debug mode too (a debug mode never changes which calls
            // succeed).
            let probe = backend.allocate_arena(size, self.base_alignment)?;
            backend.release(probe);
            if let Some(reservation) = self.take_reservation() {
                backend.release(reservation);
            }
            if let Some(old) = self.arena.borrow_mut().take() {
                backend.release(old);
            }
            self.arena_base.set(None);
            self.capacity.set(size);
            self.rewind();
            return Ok(());
        }
        let block = match self.take_reservation() {
            // The first cycle's reservation becomes the arena: the pages that cycle
            // touched are the ones every later cycle reuses.
            Some(reservation) => match backend.adopt(reservation, size) {
                Ok(block) => block,
                Err(reservation) => {
                    backend.release(reservation);
                    backend.allocate_arena(size, self.base_alignment)?
                }
            },
            None => backend.allocate_arena(size, self.base_alignment)?,
        };
        self.arena_base.set(Some(block.base()));
        self.capacity.set(block.len());
        self.rewind();
        if let Some(old) = self.arena.borrow_mut().replace(block) {
            backend.release(old);
        }
        Ok(())
    }

    /// Takes the reservation out of the spill blocks, if the first one is one. Only
    /// while closed: nothing of the cycle that spilled into it is alive.
    pub(super) fn take_reservation(&self) -> Option<B::Block> {
        if !self.spill.reserved.replace(false) {
            return None;
        }
        let mut spills = self.spill.blocks.borrow_mut();
        debug_assert!(!spills.is_empty(), "a reservation is the first spill block");
        (!spills.is_empty()).then(|| spills.remove(0))
    }

    /// Gives memory back: spill blocks, and the arena down to `min_size` (a file
    /// mapping keeps its arena). Learning starts again, so the next cycles re-learn
    /// the size; without learning the arena comes back at its configured size on the
    /// next enter.
    ///
    /// # Errors
    ///
    /// [`Error::StillOpen`](crate::Error::StillOpen) while a scope is open; [`Error::Backend`](crate::Error::Backend) when the
    /// `min_size` arena cannot be reserved.
    pub fn trim(&self) -> Result<()> {
        self.require_closed("trim()")?;
        self.release_spills();
        if self.backend.borrow().fixed_size() {
            return Ok(());
        }
        let min = self.config.min_size();
        if min > 0 {
            let max = self.config.max_size();
            let size = align_up(min, self.config.alignment()).filter(|&s| s <= max).unwrap_or(min);
            if size != self.capacity.get() {
                self.replace_arena(size).map_err(|e| self.backend_error(e))?;
            }
        } else {
            if let Some(old) = self.arena.borrow_mut().take() {
                self.backend.borrow_mut().release(old);
            }
            self.arena_base.set(None);
            self.capacity.set(0);
            self.rewind();
            self.fast_limit.set(0);
        }
        let left = match self.config.learning() {
            LearningPolicy::None => 0,
            LearningPolicy::FirstLoop => 1,
            LearningPolicy::OverTime { cycles } => cycles,
        };
        self.learning.left.set(left);
        self.learning.max.set(0);
        self.learning.learned.set(None);
        // Memory was given back on request: a size refused before may fit now.
        self.learning.refusals.set(crate::refusals::Refusals::default());
        self.refresh_plain_close();
        if left == 0 {
            self.learning.restore_to.set(self.initial_capacity());
            self.attention.set(true);
        }
        Ok(())
    }
}
