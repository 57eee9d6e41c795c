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
//!
//! # Files
//!
//! `mod.rs`: the state (the allocation fast path's fields first, then the spill,
//! debug, learning and statistics state, each a struct of its own) and the accessors;
//! `alloc.rs`: handing out memory (the fast path, spilling, the budget); `cycle.rs`:
//! opening and closing cycles, learning and growth; `frame.rs`: release points inside
//! a cycle; `arena.rs`: replacing and giving back blocks, `trim`; `member.rs`: the
//! seam to what a workspace is a member of (a plan group, a recorder), which the engine
//! knows only as a [`Member`]; `observer.rs`: the one list of what is told each event
//! (the recorder, the member and a tap, an [`Observer`] such as a timeline) and the one
//! emit; `window.rs`: the windows a member lends a cycle (the engine's side of a plan
//! group); `recorder.rs`: the trace recorder, a member that sees every event; `sizing.rs`: the state that decides the arena from here on, read
//! and adopted; `stats.rs`: statistics; `tests.rs`: the engine against a backend
//! that records what it is asked.
//!
//! # The fast path's limit
//!
//! The fast path bumps `cursor` up to `fast_limit` (or, while a frame is open, the top
//! frame's `frame_limit`) in the block at `fast_base`. The limit is 0, so that every
//! allocation takes the slow path, while the workspace is closed, under a debug mode,
//! while a recorder is set, after the first spill of a cycle (learning counts what
//! follows), while a member says so (a plan group recording or off its plan), and for
//! any allocation but the top frame's while frames are open. While a member's window is
//! open the limit is the window's end and `fast_base` the lent block's base.

mod alloc;
mod arena;
mod cycle;
mod frame;
mod member;
mod observer;
mod recorder;
mod sizing;
mod stats;
mod window;

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::backend::{ArenaBackend, Block};
use crate::config::{LearningPolicy, ResetPolicy, WorkspaceConfig};
use crate::error::{BackendError, Error, Result};
use crate::memory_report::MemoryReport;
use crate::refusals::Refusals;
use crate::roles::{ArrayType, NO_ROLE};

pub use frame::FrameMark;
pub(crate) use member::{Lent, Member, Miss, Opened};
pub(crate) use observer::{Observer, Tap};
pub use sizing::Sizing;
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
    /// Base of the block the fast path serves from: `arena_base`, or a member's block
    /// while a window it lent is open (see `window.rs`).
    fast_base: Cell<Option<<B::Block as Block>::Base>>,
    /// Level of the innermost open frame (0: none; see `frame.rs`). While a frame is
    /// open `fast_limit` is 0 and the top frame's fast path serves `[cursor,
    /// frame_limit)` instead.
    frame_top: Cell<u32>,
    /// The limit of the top frame's fast path (0 while no frame is open).
    frame_limit: Cell<usize>,
    /// Base of `arena`; `None` when there is no arena.
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
    /// `BlockLeft` reset, no cycle history and no spill-everything: a cycle without spills
    /// closes on the short path.
    plain_close: Cell<bool>,
    /// As `plain_close`, for a member: its cycles without spills, frames or learning
    /// close on the general close's short branch.
    plain_member: Cell<bool>,
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
    /// Once anything spilled this cycle: the contiguous size the cycle needs so far.
    virtual_cursor: Cell<Option<usize>>,
    /// Allocations that did not fit in the arena this cycle.
    spill: Spill<B>,
    /// Spill-everything and bypass-everything (see [`Debug`](struct@Debug)).
    debug: Debug<B>,
    /// How the arena's size is learned.
    learning: Learning,
    /// Whether `pending` or `learning.restore_to` needs handling at the next enter.
    attention: Cell<bool>,
    /// An error from work done where it could not be reported (closing in `Drop`),
    /// reported by the next `enter`.
    pending: Cell<Option<BackendError>>,
    /// The sizes of the last `cycle_history_len` cycles, oldest first.
    cycle_history: RefCell<VecDeque<usize>>,
    counters: Counters,
    /// The recorder, the plan group's member and the tap (see `observer.rs`).
    observers: observer::Observers<B>,
    /// The role of the open cycle ([`crate::ArrayType::index`]), as the layer manager
    /// entered it (`NO_ROLE`: none), for the observers and the report of a failure.
    role: Cell<u8>,
    /// The windows the member lent the open cycle.
    window: window::Window<B>,
    /// The frames of the open cycle.
    frames: frame::Frames,
}

/// The spill blocks of the open cycle and the free range in the last one.
struct Spill<B: ArenaBackend> {
    /// Spill blocks of the open cycle, freed at the next reset.
    blocks: RefCell<Vec<B::Block>>,
    /// Whether the first spill block came from [`ArenaBackend::reserve`] (and may
    /// become the arena when learning ends).
    reserved: Cell<bool>,
    /// Free range `[cursor, limit)` in the last spill block.
    cursor: Cell<usize>,
    limit: Cell<usize>,
    base: Cell<Option<<B::Block as Block>::Base>>,
    /// Alignment of the last spill block's base.
    align: Cell<usize>,
    /// Sum of spill block lengths held now.
    held: Cell<usize>,
    /// The contiguous size the spills of this cycle need beyond the arena (laid out as
    /// an arena would lay them out): what the budget counts besides the arena.
    need: Cell<usize>,
    /// Bytes handed out from spill blocks this cycle (as requested, without padding).
    in_use: Cell<usize>,
}

/// Debugging aid: memory comes from a block of its own for every allocation. The
/// accounting (capacity, cursor, learning, budget, spill policy) runs exactly as
/// without it, so every call succeeds or fails as it would; only where the memory
/// comes from changes. While on, the arena exists in the accounting only: `arena`
/// and `arena_base` are `None` whatever `capacity` says (except for a fixed-size
/// arena, which is kept and keeps serving: its contents are the program's data).
struct Debug<B: ArenaBackend> {
    on: Cell<bool>,
    /// The blocks standing in for arena memory this cycle.
    blocks: RefCell<Vec<B::Block>>,
}

/// Learning: cycles left to watch, the largest cycle so far, the size learned.
struct Learning {
    left: Cell<u32>,
    max: Cell<usize>,
    /// `Some` once learned.
    learned: Cell<Option<usize>>,
    /// Set by `trim` without learning: the arena size to restore at the next enter.
    restore_to: Cell<usize>,
    /// Growths the backend refused since the last one that covered them, in cycles
    /// (see [`crate::refusals`]).
    refusals: Cell<Refusals>,
}

/// Statistics counters over the workspace's life.
#[derive(Default)]
struct Counters {
    growth_events: Cell<u64>,
    wraps: Cell<u64>,
    peak: Cell<usize>,
    bytes_spilled: Cell<u64>,
    external_allocations: Cell<u64>,
    last_cycle_bytes: Cell<usize>,
    /// Cycles that spilled although learning was complete when they began.
    spilled_after_learning: Cell<u64>,
    /// Growths of the arena that the backend refused (see [`crate::refusals`]).
    failed_growths: Cell<u64>,
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
        let cycle_history = VecDeque::with_capacity(config.cycle_history_len());
        let engine = Engine {
            id: next_id(),
            name: Arc::from(name),
            base_alignment: backend.base_alignment().max(config.alignment()),
            min_align: config.alignment().max(MIN_ALIGN_FLOOR),
            align_mask: config.alignment().max(MIN_ALIGN_FLOOR) - 1,
            plain_close: Cell::new(config.reset() == ResetPolicy::BlockLeft && config.cycle_history_len() == 0),
            plain_member: Cell::new(false),
            backend: RefCell::new(backend),
            arena: RefCell::new(None),
            fast_base: Cell::new(None),
            frame_top: Cell::new(0),
            frame_limit: Cell::new(0),
            arena_base: Cell::new(None),
            capacity: Cell::new(0),
            cursor: Cell::new(0),
            fast_limit: Cell::new(0),
            open_start: Cell::new(0),
            wrapped: Cell::new(false),
            wrap_waste: Cell::new(0),
            depth: Cell::new(0),
            generation: Cell::new(0),
            virtual_cursor: Cell::new(None),
            spill: Spill {
                blocks: RefCell::new(Vec::new()),
                reserved: Cell::new(false),
                cursor: Cell::new(0),
                limit: Cell::new(0),
                base: Cell::new(None),
                align: Cell::new(0),
                held: Cell::new(0),
                need: Cell::new(0),
                in_use: Cell::new(0),
            },
            debug: Debug { on: Cell::new(false), blocks: RefCell::new(Vec::new()) },
            learning: Learning {
                left: Cell::new(learning_left),
                max: Cell::new(0),
                learned: Cell::new(None),
                restore_to: Cell::new(0),
                refusals: Cell::new(Refusals::default()),
            },
            attention: Cell::new(false),
            pending: Cell::new(None),
            cycle_history: RefCell::new(cycle_history),
            counters: Counters::default(),
            observers: observer::Observers::new(),
            role: Cell::new(NO_ROLE),
            window: window::Window::new(),
            frames: frame::Frames::default(),
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

    /// Whether `test` holds for the address and length of the arena, of a spill block
    /// held now, or of a planned window of the open cycle. `test` gets copies, so nothing it does can reach the engine's blocks
    /// while they are borrowed; it must not enter or leave this workspace.
    pub(crate) fn any_block(&self, test: impl Fn(u64, usize) -> bool) -> bool {
        use crate::backend::Address;
        if self.arena_extent().is_some_and(|(base, len)| test(base.address(), len)) {
            return true;
        }
        if self.observers.grouped.get() && self.any_window(&test) {
            return true;
        }
        self.spill
            .blocks
            .borrow()
            .iter()
            .chain(self.debug.blocks.borrow().iter())
            .any(|block| test(block.base().address(), block.len()))
    }

    pub(crate) fn backend_error(&self, source: BackendError) -> Error {
        let requested = match &source {
            BackendError::OutOfMemory { bytes, .. } => *bytes,
            _ => 0,
        };
        self.backend_error_for(source, requested)
    }

    /// The backend's refusal of memory for a request of `requested` bytes (the
    /// backend's own figure, a spill chunk, stays in `source`).
    pub(crate) fn backend_error_for(&self, source: BackendError, requested: usize) -> Error {
        let report = self.report(requested);
        Error::Backend { workspace: self.name.clone(), source, report }
    }

    /// Bytes the open cycle has in use as the budget counts them: the arena's handed
    /// out, and the spills laid out as an arena would lay them out.
    pub(super) fn budget_in_use(&self) -> usize {
        self.open_bytes() + self.spill.need.get()
    }

    /// The report of a failed request of `requested` bytes (see
    /// [`MemoryReport`]): what the workspace knows, and
    /// what its tap fills in.
    #[cold]
    pub(crate) fn report(&self, requested: usize) -> Box<MemoryReport> {
        let in_use = if self.depth.get() > 0 { self.budget_in_use() } else { 0 };
        let role = ArrayType::from_index(self.role.get());
        let mut report = MemoryReport::of_workspace(&self.name, role, requested, self.capacity.get(), in_use);
        self.fill_report(&mut report);
        Box::new(report)
    }

    /// The open cycle serves `role` (what the layer manager entered it for): the label
    /// of its allocations in a timeline and in a failure's report.
    #[inline]
    pub(crate) fn note_role(&self, role: ArrayType) {
        // A nested enter (another role of a workspace already open) leaves the cycle's.
        if self.role.get() == NO_ROLE {
            self.role.set(role.index() as u8);
        }
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
        if on == self.debug.on.get() {
            return Ok(());
        }
        self.debug.on.set(on);
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
                self.debug.on.set(true);
                return Err(self.backend_error(source));
            }
        }
        self.refresh_plain_close();
        Ok(())
    }

    /// Tells `recorder` every later allocation (its padded size and alignment) and the
    /// close of every later cycle and frame, as events of owner [`Engine::owner_at`],
    /// until called with `None`. Only where memory comes from is unchanged: recording
    /// takes every allocation through the slow path.
    ///
    /// # Errors
    ///
    /// [`Error::StillOpen`] while a scope is open; the error of the old recorder's
    /// [`Member::detach`] (it is then kept).
    pub(super) fn record_with(&self, recorder: Option<Box<dyn Member<B>>>) -> Result<()> {
        self.require_closed("starting or stopping a recording")?;
        if let Some(old) = self.observers.recorder.borrow().as_ref() {
            old.detach(&self.name)?;
        }
        self.observers.recording.set(recorder.is_some());
        *self.observers.recorder.borrow_mut() = recorder;
        self.refresh_plain_close();
        Ok(())
    }

    /// The owner id of this workspace's events in a recorded trace: its cycles'
    /// allocations. Frames have owners of their own ([`Engine::owner_at`]).
    pub fn owner(&self) -> u64 {
        self.owner_at(0)
    }

    /// The short close paths are taken only without a debug mode, a cycle history, a
    /// recording or a refused growth (whose retry is on the general close):
    /// `plain_close` outside a plan group, `plain_member` (a branch of the general
    /// close) inside one.
    fn refresh_plain_close(&self) {
        let plain = !self.debug.on.get()
            && !self.observers.recording.get()
            && !self.learning.refusals.get().stand()
            && self.config.reset() == ResetPolicy::BlockLeft
            && self.config.cycle_history_len() == 0;
        self.plain_close.set(plain && !self.observers.grouped.get());
        self.plain_member.set(plain && self.observers.grouped.get());
    }

    fn require_closed(&self, action: &'static str) -> Result<()> {
        match self.depth.get() {
            0 => Ok(()),
            depth => Err(Error::StillOpen { workspace: self.name.clone(), depth, action }),
        }
    }
}

// SAFETY: the only non-`Send` fields are the cached base addresses (`arena_base`,
// `fast_base`, the spill's `base`, the window's base), which point into blocks that this
// engine owns (`arena`, `spills`), or into a block its member lent (a plan group's
// arena), which the member (`Send`, held by the engine) keeps alive while the cycle holds
// a window of it; moving the engine moves its blocks and its member with it. Nothing outside the engine can hold a
// reference into its memory while it moves: every view borrows a scope, and every
// scope borrows the engine (or holds an `Rc`, which is `!Send`). The engine stays
// `!Sync` (its `Cell`s), so it is used by one thread at a time.
unsafe impl<B: ArenaBackend> Send for Engine<B> where B::Block: Send {}

impl<B: ArenaBackend> Drop for Engine<B> {
    fn drop(&mut self) {
        self.forget_window();
        if let Some(recorder) = self.observers.recorder.get_mut().take() {
            recorder.dropped();
        }
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
mod tests;
