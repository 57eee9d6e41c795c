//! The arena engine: cycles, generations, learning, spilling and statistics, written
//! once over an [`ArenaBackend`].
//!
//! The engine deals in offsets inside blocks; it never touches the memory itself.
//! Host workspaces ([`Workspace`](crate::Workspace)) turn offsets into ndarray views;
//! device workspaces turn them into device pointers. All state is in `Cell`s because
//! allocation takes `&self` (many views borrow the same scope at once); the engine is
//! therefore `!Sync`, and its single-threadedness is what makes the cells sound.
//!
//! # Why a reset is safe
//!
//! Memory is reused only in [`Engine::exit`] when the open-scope count drops to zero.
//! Every view borrows a scope and every scope holds one count, so a count of zero
//! proves that no view of this cycle is alive. Stored handles carry the generation
//! they were allocated in and are checked against [`Engine::generation`].

mod alloc;
mod stats;

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::backend::{ArenaBackend, Block};
use crate::config::{LearningPolicy, ResetPolicy, SpillPolicy, WorkspaceConfig};
use crate::error::{BackendError, Error, Result};

pub use stats::WorkspaceStats;

/// Every allocation is aligned to at least this many bytes (whatever the configured
/// alignment), which lets the fast path skip the alignment test for element types.
pub(crate) const MIN_ALIGN_FLOOR: usize = 16;

/// First spill chunk of a cycle; later chunks of the same cycle double.
const FIRST_SPILL_CHUNK: usize = 64 << 10;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A process-unique id for a workspace (or a heap scope).
pub(crate) fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// Rounds `value` up to `align` (a power of two); `None` on overflow.
#[inline(always)]
pub(crate) fn align_up(value: usize, align: usize) -> Option<usize> {
    debug_assert!(align.is_power_of_two());
    Some(value.checked_add(align - 1)? & !(align - 1))
}

/// What [`Engine::enter`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entered {
    /// Opened the workspace: a new cycle and a new generation.
    Opened,
    /// The workspace was already open: nested without resetting.
    Nested,
}

/// The engine under every workspace; see the module docs.
///
/// `repr(C)` keeps the fields of the allocation fast path together, in the first
/// cache line.
#[repr(C)]
pub struct Engine<B: ArenaBackend> {
    /// Next free offset in the arena. Invariants: `cursor <= capacity`, and `cursor` is
    /// a multiple of `min_align` unless it equals `capacity`.
    cursor: Cell<usize>,
    /// The fast path serves `[cursor, fast_limit)`. 0 while the workspace is closed (so
    /// nothing is handed out without an open scope); while open it equals `capacity`,
    /// except: 0 under
    /// spill-everything or after the first spill of a cycle (so the slow path sees
    /// every later allocation and learning counts them), and `open_start` after a
    /// circular workspace wrapped.
    fast_limit: Cell<usize>,
    /// Base of `arena`, cached for the fast path; `None` when there is no arena.
    arena_base: Cell<Option<<B::Block as Block>::Base>>,
    /// `config.alignment()` (at least [`MIN_ALIGN_FLOOR`]): the smallest alignment of
    /// any allocation.
    min_align: usize,
    /// `min_align - 1`.
    align_mask: usize,
    /// Alignment of the arena's base: the backend's base alignment or the configured
    /// alignment, whichever is larger (read once). Offsets are aligned relative to the
    /// base, so requests aligned beyond it spill.
    base_alignment: usize,
    /// `BlockLeft` reset, no timeline and no spill-everything: a cycle without spills
    /// closes on the short path.
    plain_close: Cell<bool>,
    id: u64,
    name: Arc<str>,
    config: WorkspaceConfig,
    backend: RefCell<B>,
    /// The arena. Replaced only while no scope is open.
    arena: RefCell<Option<B::Block>>,
    /// Length of `arena` (0 when none).
    capacity: Cell<usize>,
    /// Cursor when the workspace was opened (0 for BlockLeft).
    open_start: Cell<usize>,
    /// Circular only: wrapped during this open period.
    wrapped: Cell<bool>,
    /// Bytes of arena skipped at the buffer end when wrapping in this open period.
    wrap_waste: Cell<usize>,
    /// Open scopes (enters, nested enters and borrows). 0 means closed.
    depth: Cell<usize>,
    generation: Cell<u64>,
    /// Spill blocks of the open cycle, freed at the next reset.
    spills: RefCell<Vec<B::Block>>,
    /// Whether the first spill block came from [`ArenaBackend::reserve`] (and may
    /// become the arena when learning ends).
    reserved: Cell<bool>,
    /// Free range `[spill_cursor, spill_limit)` in the last spill block.
    spill_cursor: Cell<usize>,
    spill_limit: Cell<usize>,
    spill_base: Cell<Option<<B::Block as Block>::Base>>,
    /// Alignment of the last spill block's base.
    spill_align: Cell<usize>,
    /// Sum of spill block lengths held now.
    spill_held: Cell<usize>,
    /// Once anything spilled this cycle: the contiguous size the cycle needs so far.
    virtual_cursor: Cell<Option<usize>>,
    /// The contiguous size the spills of this cycle need beyond the arena (laid out as
    /// an arena would lay them out): what the budget counts besides the arena.
    spill_need: Cell<usize>,
    /// Debugging aid: memory comes from a block of its own for every allocation. The
    /// accounting (capacity, cursor, learning, budget, spill policy) runs exactly as
    /// without it, so every call succeeds or fails as it would; only where the memory
    /// comes from changes. While on, the arena exists in the accounting only: `arena`
    /// and `arena_base` are `None` whatever `capacity` says (except for a fixed-size
    /// arena, which is kept but not handed out).
    spill_everything: Cell<bool>,
    /// Spill-everything only: the blocks standing in for arena memory this cycle.
    debug_blocks: RefCell<Vec<B::Block>>,
    /// Learning: cycles seen and the largest cycle so far; `None` once learned.
    learning_left: Cell<u32>,
    learning_max: Cell<usize>,
    learned: Cell<Option<usize>>,
    /// Set by `trim` without learning: the arena size to restore at the next enter.
    restore_to: Cell<usize>,
    /// Whether `pending` or `restore_to` needs handling at the next enter.
    attention: Cell<bool>,
    /// An error from work done where it could not be reported (closing in `Drop`),
    /// reported by the next `enter`.
    pending: Cell<Option<BackendError>>,
    timeline: RefCell<VecDeque<usize>>,
    // Statistics.
    growth_events: Cell<u64>,
    wraps: Cell<u64>,
    peak: Cell<usize>,
    bytes_spilled: Cell<u64>,
    external_allocations: Cell<u64>,
    spilled_in_use: Cell<usize>,
    last_cycle_bytes: Cell<usize>,
    /// Cycles that spilled although learning was complete when they began.
    spilled_after_learning: Cell<u64>,
}

impl<B: ArenaBackend> Engine<B> {
    /// Creates an engine and reserves `initial_size` bytes.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] when the initial arena cannot be reserved.
    pub fn new(name: &str, config: WorkspaceConfig, backend: B) -> Result<Self> {
        let learning_left = match config.learning() {
            LearningPolicy::None => 0,
            LearningPolicy::FirstLoop => 1,
            LearningPolicy::OverTime { cycles } => cycles,
        };
        let timeline = VecDeque::with_capacity(config.timeline_len());
        let engine = Engine {
            id: next_id(),
            name: Arc::from(name),
            base_alignment: backend.base_alignment().max(config.alignment()),
            min_align: config.alignment().max(MIN_ALIGN_FLOOR),
            align_mask: config.alignment().max(MIN_ALIGN_FLOOR) - 1,
            plain_close: Cell::new(config.reset() == ResetPolicy::BlockLeft && config.timeline_len() == 0),
            backend: RefCell::new(backend),
            arena: RefCell::new(None),
            arena_base: Cell::new(None),
            capacity: Cell::new(0),
            cursor: Cell::new(0),
            fast_limit: Cell::new(0),
            open_start: Cell::new(0),
            wrapped: Cell::new(false),
            wrap_waste: Cell::new(0),
            depth: Cell::new(0),
            generation: Cell::new(0),
            spills: RefCell::new(Vec::new()),
            reserved: Cell::new(false),
            spill_cursor: Cell::new(0),
            spill_limit: Cell::new(0),
            spill_base: Cell::new(None),
            spill_align: Cell::new(0),
            spill_held: Cell::new(0),
            virtual_cursor: Cell::new(None),
            spill_need: Cell::new(0),
            spill_everything: Cell::new(false),
            debug_blocks: RefCell::new(Vec::new()),
            learning_left: Cell::new(learning_left),
            learning_max: Cell::new(0),
            learned: Cell::new(None),
            restore_to: Cell::new(0),
            attention: Cell::new(false),
            pending: Cell::new(None),
            timeline: RefCell::new(timeline),
            growth_events: Cell::new(0),
            wraps: Cell::new(0),
            peak: Cell::new(0),
            bytes_spilled: Cell::new(0),
            external_allocations: Cell::new(0),
            spilled_in_use: Cell::new(0),
            last_cycle_bytes: Cell::new(0),
            spilled_after_learning: Cell::new(0),
            config,
        };
        if engine.config.initial_size() > 0 {
            let size = engine.initial_capacity();
            engine.replace_arena(size).map_err(|source| engine.backend_error(source))?;
        }
        Ok(engine)
    }

    fn initial_capacity(&self) -> usize {
        let c = &self.config;
        let size = c.initial_size().max(c.min_size());
        align_up(size, c.alignment()).filter(|&s| s <= c.max_size()).unwrap_or(size)
    }

    /// Process-unique id.
    #[inline]
    pub fn id(&self) -> u64 {
        self.id
    }
    /// The name given at creation.
    pub fn name(&self) -> &Arc<str> {
        &self.name
    }
    /// The configuration.
    pub fn config(&self) -> &WorkspaceConfig {
        &self.config
    }
    /// Current generation: incremented by every enter that opens the workspace.
    #[inline]
    pub fn generation(&self) -> u64 {
        self.generation.get()
    }
    /// Number of open scopes (0: closed).
    #[inline]
    pub fn depth(&self) -> usize {
        self.depth.get()
    }
    /// Whether a scope is open.
    #[inline]
    pub fn is_open(&self) -> bool {
        self.depth.get() > 0
    }
    /// Arena capacity in bytes.
    #[inline]
    pub fn capacity(&self) -> usize {
        self.capacity.get()
    }
    /// The backend kind.
    pub fn backend_kind(&self) -> &'static str {
        self.backend.borrow().kind()
    }
    /// The arena's base and length, if there is an arena.
    #[inline]
    pub fn arena_extent(&self) -> Option<(<B::Block as Block>::Base, usize)> {
        self.arena_base.get().map(|base| (base, self.capacity.get()))
    }

    /// Whether every byte of the arena holds an initialised value (see
    /// [`Block::is_initialised`]); false without an arena.
    pub fn arena_is_initialised(&self) -> bool {
        self.arena.borrow().as_ref().is_some_and(Block::is_initialised)
    }

    /// Whether `test` holds for the base and length of the arena or of a spill block
    /// held now. `test` gets copies, so nothing it does can reach the engine's blocks
    /// while they are borrowed; it must not enter or leave this workspace.
    pub(crate) fn any_block(&self, test: impl Fn(<B::Block as Block>::Base, usize) -> bool) -> bool {
        if self.arena_extent().is_some_and(|(base, len)| test(base, len)) {
            return true;
        }
        self.spills
            .borrow()
            .iter()
            .chain(self.debug_blocks.borrow().iter())
            .any(|block| test(block.base(), block.len()))
    }

    pub(crate) fn backend_error(&self, source: BackendError) -> Error {
        Error::Backend { workspace: self.name.clone(), source }
    }

    /// Sends every later allocation to a block of its own (debugging aid). Only where
    /// memory comes from changes: sizes, learning, the budget and the spill policy are
    /// accounted exactly as without it, so every call succeeds or fails as it would.
    ///
    /// # Errors
    ///
    /// [`Error::StillOpen`] while a scope is open; [`Error::Backend`] when turning it
    /// off needs an arena for the size learned meanwhile and none can be reserved (the
    /// mode then stays on).
    pub fn set_spill_everything(&self, on: bool) -> Result<()> {
        self.require_closed("changing the debug mode")?;
        // Closed, so the fast path is off; `enter` turns it on according to the mode.
        if on == self.spill_everything.get() {
            return Ok(());
        }
        self.spill_everything.set(on);
        if on && !self.backend.borrow().fixed_size() {
            // The arena stays in the accounting; its memory is not used meanwhile. (A
            // fixed arena, a file mapping, is kept: its contents and its file lock
            // outlive the debug mode.)
            if let Some(old) = self.arena.borrow_mut().take() {
                self.backend.borrow_mut().release(old);
            }
            self.arena_base.set(None);
        } else if !on && self.capacity.get() > 0 && self.arena_base.get().is_none() {
            // The size learned or kept while on becomes a real arena again.
            if let Err(source) = self.replace_arena(self.capacity.get()) {
                self.spill_everything.set(true);
                return Err(self.backend_error(source));
            }
        }
        self.plain_close.set(!on && self.config.reset() == ResetPolicy::BlockLeft && self.config.timeline_len() == 0);
        Ok(())
    }

    fn require_closed(&self, action: &'static str) -> Result<()> {
        match self.depth.get() {
            0 => Ok(()),
            depth => Err(Error::StillOpen { workspace: self.name.clone(), depth, action }),
        }
    }

    /// Opens the workspace (new cycle, new generation) or nests in the open one.
    ///
    /// # Errors
    ///
    /// A backend error recorded while closing the previous cycle (the workspace is
    /// then left closed and usable with its previous arena), or one from reserving
    /// the arena after `trim()`.
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
        self.fast_limit.set(if self.spill_everything.get() { 0 } else { self.capacity.get() });
        self.depth.set(1);
        Ok(Entered::Opened)
    }

    /// Deferred work before opening: report an error recorded while closing, or
    /// restore the arena after `trim()`.
    #[cold]
    #[inline(never)]
    fn settle(&self) -> Result<()> {
        self.attention.set(false);
        if let Some(source) = self.pending.take() {
            return Err(self.backend_error(source));
        }
        let restore = self.restore_to.take();
        if restore > self.capacity.get() {
            // Trimmed below the configured size: come back to it.
            if let Err(source) = self.replace_arena(restore) {
                self.restore_to.set(restore);
                self.attention.set(true);
                return Err(self.backend_error(source));
            }
        }
        Ok(())
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

    /// Bytes this cycle needs in one contiguous arena.
    fn cycle_bytes(&self) -> usize {
        self.virtual_cursor.get().unwrap_or_else(|| self.open_bytes())
    }

    /// Arena bytes handed out since the workspace was last opened.
    fn open_bytes(&self) -> usize {
        let start = self.open_start.get();
        let cursor = self.cursor.get();
        if self.wrapped.get() {
            (self.capacity.get() - self.wrap_waste.get()).saturating_sub(start) + cursor
        } else {
            cursor.saturating_sub(start)
        }
    }

    /// Forgets where the cursor was: the arena was replaced or released.
    fn rewind(&self) {
        self.cursor.set(0);
        self.open_start.set(0);
        self.wrapped.set(false);
        self.wrap_waste.set(0);
    }

    #[inline(always)]
    fn close_cycle(&self) {
        // The common case: a scoped workspace whose cycle did not spill (so the fast
        // path is still on and `open_start` is 0), with no timeline to record.
        if self.plain_close.get() && self.virtual_cursor.get().is_none() {
            // A cycle counts whole multiples of the alignment wherever it ran (the last
            // allocation may end unpadded at the end of an arena capped by `max_size`).
            let bytes = (self.cursor.get() + self.align_mask) & !self.align_mask;
            self.peak.set(self.peak.get().max(bytes));
            self.last_cycle_bytes.set(bytes);
            self.cursor.set(0);
            self.fast_limit.set(0);
            if self.learning_left.get() > 0 && bytes > 0 {
                self.learn(bytes);
            }
            return;
        }
        self.close_cycle_general();
    }

    #[cold]
    #[inline(never)]
    fn close_cycle_general(&self) {
        let bytes = align_up(self.cycle_bytes(), self.min_align).unwrap_or(usize::MAX);
        let in_use = self.open_bytes() + self.spilled_in_use.get();
        self.peak.set(self.peak.get().max(in_use));
        self.last_cycle_bytes.set(bytes);
        if self.config.timeline_len() > 0 {
            self.record_timeline(bytes);
        }
        // Every spill starts the virtual cursor, so no virtual cursor means no spills.
        let spilled = self.virtual_cursor.take().is_some();
        if spilled && self.learning_left.get() == 0 {
            self.spilled_after_learning.set(self.spilled_after_learning.get() + 1);
        }
        self.release_debug_blocks();
        if self.config.reset() == ResetPolicy::BlockLeft {
            self.cursor.set(0);
        }
        // A cycle that allocated nothing teaches nothing: it does not use up learning.
        let learning = self.learning_left.get() > 0 && bytes > 0;
        if learning || (spilled && self.config.spill() == SpillPolicy::Reallocate) {
            // Before the spills go: the new arena may be the reservation they sit in.
            self.learn(bytes);
        }
        if spilled {
            self.release_spills();
        }
        self.fast_limit.set(0);
    }

    #[cold]
    fn record_timeline(&self, bytes: usize) {
        let mut timeline = self.timeline.borrow_mut();
        if timeline.len() == self.config.timeline_len() {
            timeline.pop_front();
        }
        timeline.push_back(bytes);
    }

    /// Learning and Reallocate growth at the end of a cycle that needed `bytes`.
    #[cold]
    fn learn(&self, bytes: usize) {
        let left = self.learning_left.get();
        let target = if left > 0 {
            let max = self.learning_max.get().max(bytes);
            self.learning_max.set(max);
            self.learning_left.set(left - 1);
            if left > 1 {
                return;
            }
            self.learned.set(Some(max));
            self.config.capacity_for(max)
        } else {
            let learned = self.learned.get().unwrap_or(0).max(bytes);
            self.learned.set(Some(learned));
            self.config.capacity_for(learned)
        };
        if target > self.capacity.get() {
            match self.replace_arena(target) {
                Ok(()) => self.growth_events.set(self.growth_events.get() + 1),
                Err(source) => {
                    self.pending.set(Some(source));
                    self.attention.set(true);
                }
            }
        }
    }

    fn release_debug_blocks(&self) {
        let mut blocks = self.debug_blocks.borrow_mut();
        if !blocks.is_empty() {
            let mut backend = self.backend.borrow_mut();
            for block in blocks.drain(..) {
                backend.release(block);
            }
        }
    }

    fn release_spills(&self) {
        let mut spills = self.spills.borrow_mut();
        let mut backend = self.backend.borrow_mut();
        for block in spills.drain(..) {
            backend.release(block);
        }
        self.reserved.set(false);
        self.spill_held.set(0);
        self.spill_need.set(0);
        self.spilled_in_use.set(0);
        self.spill_cursor.set(0);
        self.spill_limit.set(0);
        self.spill_base.set(None);
    }

    /// Reserves a new arena of `size` bytes, then gives the old one back. Only while
    /// closed (nothing refers to the old arena).
    fn replace_arena(&self, size: usize) -> Result<(), BackendError> {
        debug_assert_eq!(self.depth.get(), 0);
        let mut backend = self.backend.borrow_mut();
        if self.spill_everything.get() {
            // The arena exists in the accounting only (see `spill_everything`).
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
    fn take_reservation(&self) -> Option<B::Block> {
        if !self.reserved.replace(false) {
            return None;
        }
        let mut spills = self.spills.borrow_mut();
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
    /// [`Error::StillOpen`] while a scope is open; [`Error::Backend`] when the
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
        self.learning_left.set(left);
        self.learning_max.set(0);
        self.learned.set(None);
        if left == 0 {
            self.restore_to.set(self.initial_capacity());
            self.attention.set(true);
        }
        Ok(())
    }
}

// SAFETY: the only non-`Send` fields are the cached base addresses (`arena_base`,
// `spill_base`), which point into blocks that this engine owns (`arena`, `spills`);
// moving the engine moves those blocks with it. Nothing outside the engine can hold a
// reference into its memory while it moves: every view borrows a scope, and every
// scope borrows the engine (or holds an `Rc`, which is `!Send`). The engine stays
// `!Sync` (its `Cell`s), so it is used by one thread at a time.
unsafe impl<B: ArenaBackend> Send for Engine<B> where B::Block: Send {}

impl<B: ArenaBackend> Drop for Engine<B> {
    fn drop(&mut self) {
        self.release_spills();
        self.release_debug_blocks();
        if let Some(arena) = self.arena.get_mut().take() {
            self.backend.get_mut().release(arena);
        }
    }
}

impl<B: ArenaBackend> std::fmt::Debug for Engine<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("name", &self.name)
            .field("capacity", &self.capacity.get())
            .field("cursor", &self.cursor.get())
            .field("depth", &self.depth.get())
            .field("generation", &self.generation.get())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    //! The first learning cycle's reservation, against a backend that records what
    //! the engine asks of it (the engine never touches memory, so its blocks are
    //! plain numbers).

    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::config::{AllocationPolicy, LearningPolicy};

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Kind {
        Arena,
        Spill,
        Reserved,
    }

    #[derive(Debug)]
    struct FakeBlock {
        base: usize,
        len: usize,
        kind: Kind,
    }

    // SAFETY: the engine never dereferences a base (it deals in offsets) and these
    // tests only compare the numbers, so fake addresses describe no memory anyone touches.
    unsafe impl Block for FakeBlock {
        type Base = usize;
        fn base(&self) -> usize {
            self.base
        }
        fn len(&self) -> usize {
            self.len
        }
    }

    /// What the engine asked for, in order.
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Call {
        Arena(usize),
        Spill(usize),
        Reserve { at_least: usize },
        Adopt { base: usize, bytes: usize },
        Release(Kind, usize),
    }

    struct Recording {
        calls: Arc<Mutex<Vec<Call>>>,
        /// Length of the reservations handed out; `None`: the backend has none.
        reservation: Option<usize>,
        next_base: usize,
    }

    impl Recording {
        fn block(&mut self, len: usize, kind: Kind) -> FakeBlock {
            self.next_base += 1 << 32;
            FakeBlock { base: self.next_base, len, kind }
        }
    }

    // SAFETY: as for `FakeBlock`: the blocks are numbers the tests compare, never memory.
    unsafe impl ArenaBackend for Recording {
        type Block = FakeBlock;
        fn kind(&self) -> &'static str {
            "recording"
        }
        fn base_alignment(&self) -> usize {
            4096
        }
        fn allocate_arena(&mut self, bytes: usize, _align: usize) -> Result<FakeBlock, BackendError> {
            self.calls.lock().unwrap().push(Call::Arena(bytes));
            Ok(self.block(bytes, Kind::Arena))
        }
        fn allocate_spill(&mut self, bytes: usize, _align: usize) -> Result<FakeBlock, BackendError> {
            self.calls.lock().unwrap().push(Call::Spill(bytes));
            Ok(self.block(bytes, Kind::Spill))
        }
        fn reserve(&mut self, at_least: usize, _at_most: usize, _align: usize) -> Option<FakeBlock> {
            let len = self.reservation?;
            self.calls.lock().unwrap().push(Call::Reserve { at_least });
            Some(self.block(len, Kind::Reserved))
        }
        fn adopt(&mut self, block: FakeBlock, bytes: usize) -> Result<FakeBlock, FakeBlock> {
            self.calls.lock().unwrap().push(Call::Adopt { base: block.base, bytes });
            if block.kind == Kind::Reserved && bytes <= block.len {
                Ok(FakeBlock { base: block.base, len: bytes, kind: Kind::Arena })
            } else {
                Err(block)
            }
        }
        fn release(&mut self, block: FakeBlock) {
            self.calls.lock().unwrap().push(Call::Release(block.kind, block.len));
        }
    }

    fn engine(config: WorkspaceConfig, reservation: Option<usize>) -> (Engine<Recording>, Arc<Mutex<Vec<Call>>>) {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let backend = Recording { calls: calls.clone(), reservation, next_base: 0 };
        (Engine::new("R", config, backend).unwrap(), calls)
    }

    fn take(calls: &Mutex<Vec<Call>>) -> Vec<Call> {
        std::mem::take(&mut *calls.lock().unwrap())
    }

    fn strict() -> crate::config::WorkspaceConfigBuilder {
        WorkspaceConfig::builder().allocation(AllocationPolicy::Strict)
    }

    /// One cycle allocating `sizes` bytes; returns (base, offset) of each.
    fn cycle(e: &Engine<Recording>, sizes: &[usize]) -> Vec<(usize, usize)> {
        e.enter().unwrap();
        let placed = sizes.iter().map(|&n| e.alloc(n, 8).unwrap()).collect();
        // SAFETY: the scope counted by `enter` above; nothing refers to the memory.
        unsafe { e.exit() };
        placed
    }

    #[test]
    fn the_first_cycle_runs_in_a_reservation_that_becomes_the_arena() {
        let (e, calls) = engine(strict().build().unwrap(), Some(1 << 20));
        let first = cycle(&e, &[100, 5000, 64]);
        // All three in the one reservation, packed at the engine's alignment (64).
        let base = first[0].0;
        assert_eq!(first, vec![(base, 0), (base, 128), (base, 5184)]);
        assert_eq!(
            take(&calls),
            vec![Call::Reserve { at_least: 100 }, Call::Adopt { base, bytes: 5248 }],
            "no arena allocated, nothing released: the reservation is the arena"
        );
        assert_eq!(e.capacity(), 5248);
        assert_eq!(e.arena_extent(), Some((base, 5248)));
        let stats = e.stats();
        assert_eq!((stats.bytes_spilled, stats.external_allocations, stats.learned_size), (5164, 3, Some(5248)));
        // The second cycle reuses the same memory from the arena, asking for nothing.
        assert_eq!(cycle(&e, &[100, 5000, 64]), first);
        assert!(take(&calls).is_empty());
        assert_eq!(e.stats().external_allocations, 3);
    }

    #[test]
    fn a_first_cycle_larger_than_the_reservation_gets_a_fresh_arena() {
        let (e, calls) = engine(strict().build().unwrap(), Some(8192));
        let first = cycle(&e, &[4096, 4096, 10_000]);
        assert_eq!(first[0].0, first[1].0, "the first two fit in the reservation");
        assert_ne!(first[2].0, first[0].0, "the third spills to a chunk");
        assert_eq!(
            take(&calls),
            vec![
                Call::Reserve { at_least: 4096 },
                // Chunks start at 64 KiB.
                Call::Spill(64 << 10),
                Call::Adopt { base: first[0].0, bytes: 18_240 },
                Call::Release(Kind::Reserved, 8192),
                Call::Arena(18_240),
                Call::Release(Kind::Spill, 64 << 10),
            ]
        );
        assert_eq!(e.capacity(), 18_240);
    }

    #[test]
    fn learning_over_several_cycles_adopts_only_the_last_reservation() {
        let config = strict().learning(LearningPolicy::OverTime { cycles: 2 }).build().unwrap();
        let (e, calls) = engine(config, Some(1 << 20));
        let one = cycle(&e, &[1000]);
        assert_eq!(take(&calls), vec![Call::Reserve { at_least: 1000 }, Call::Release(Kind::Reserved, 1 << 20)]);
        assert_eq!(e.capacity(), 0);
        let two = cycle(&e, &[3000]);
        assert_ne!(one[0].0, two[0].0, "each learning cycle has a reservation of its own");
        assert_eq!(take(&calls), vec![Call::Reserve { at_least: 3000 }, Call::Adopt { base: two[0].0, bytes: 3008 }]);
        assert_eq!(e.capacity(), 3008);
    }

    #[test]
    fn without_learning_or_with_an_arena_nothing_is_reserved() {
        // No learning: spills go to chunks and are freed at the reset.
        let config = strict().learning(LearningPolicy::None).spill(SpillPolicy::External).build().unwrap();
        let (e, calls) = engine(config, Some(1 << 20));
        cycle(&e, &[100]);
        assert_eq!(take(&calls), vec![Call::Spill(64 << 10), Call::Release(Kind::Spill, 64 << 10)]);
        // An initial arena: learning grows it from chunks as before.
        let (e, calls) = engine(strict().initial_size(4096).build().unwrap(), Some(1 << 20));
        assert_eq!(take(&calls), vec![Call::Arena(4096)]);
        cycle(&e, &[5000]);
        assert_eq!(
            take(&calls),
            vec![
                Call::Spill(64 << 10),
                Call::Arena(5056),
                Call::Release(Kind::Arena, 4096),
                Call::Release(Kind::Spill, 64 << 10)
            ]
        );
        // Spill-everything (a debugging aid) keeps one block per allocation.
        let (e, calls) = engine(strict().build().unwrap(), Some(1 << 20));
        e.set_spill_everything(true).unwrap();
        cycle(&e, &[100, 200]);
        let calls = take(&calls);
        assert_eq!(&calls[..2], &[Call::Spill(100), Call::Spill(200)]);
        assert!(!calls.iter().any(|c| matches!(c, Call::Reserve { .. } | Call::Adopt { .. })), "{calls:?}");
    }

    #[test]
    fn a_backend_without_reservations_learns_from_chunks() {
        let (e, calls) = engine(strict().build().unwrap(), None);
        cycle(&e, &[100, 5000]);
        assert_eq!(take(&calls), vec![Call::Spill(64 << 10), Call::Arena(5184), Call::Release(Kind::Spill, 64 << 10)]);
    }

    #[test]
    fn a_reservation_too_small_for_the_first_request_is_given_back() {
        let (e, calls) = engine(strict().build().unwrap(), Some(4096));
        cycle(&e, &[10_000]);
        assert_eq!(
            take(&calls),
            vec![
                Call::Reserve { at_least: 10_000 },
                Call::Release(Kind::Reserved, 4096),
                Call::Spill(64 << 10),
                Call::Arena(10_048),
                Call::Release(Kind::Spill, 64 << 10),
            ]
        );
    }
}
