//! The workspace shell (see the `backend` module's docs, "The shell").

use std::mem::{size_of, ManuallyDrop};
use std::sync::Arc;

use ndarray::Dimension;

use crate::backend::{Address, ArenaBackend};
use crate::config::WorkspaceConfig;
use crate::engine::{Engine, Entered, FrameMark, WorkspaceStats};
use crate::error::{Error, Result};

/// How a scope came to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScopeKind {
    /// Opened the workspace: a new cycle and generation.
    Opened,
    /// Entered a workspace that was already open, without resetting.
    Nested,
    /// Borrowed an open workspace as allocation target.
    Borrowed,
    /// Scoped out: allocations go to the heap and are freed with the scope.
    Heap,
}

/// Where an array's memory lives, as far as a scope can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// In the arena, at this byte offset.
    Arena(usize),
    /// Elsewhere: a spill block, the heap, or another workspace.
    Elsewhere,
}

/// What a kind of workspace does around the engine's cycles, beyond handing out memory
/// (which is its [`ArenaBackend`]'s job). The host needs nothing (`()`); a device
/// workspace orders other streams before a reset; a pinned workspace waits for transfers
/// before the memory is handed out again.
///
/// The shell's own guarantee (memory is reused only once no scope is open) does not
/// rest on the hooks, but a kind of workspace's unsafe code may rest on its hooks
/// running exactly when the shell runs them (a pinned workspace's memory is handed out
/// only after `before_open` waited for the transfers): so the hooks are `unsafe` to
/// call, and only the shell calls them. For the same reason a shell with hooks does not
/// expose its engine (whose `enter` would open a cycle without them); the host's does
/// ([`Shell::engine`]).
pub trait CycleHooks {
    /// The error opening and trimming report: the hooks' own failures and the engine's.
    type Error: From<Error>;

    /// Before a cycle opens (the workspace is closed): settle what the last cycle left
    /// (work that may still use its memory, errors recorded where they could not be
    /// returned). An error keeps the workspace closed; the next open retries.
    ///
    /// # Errors
    ///
    /// The hook's own; `workspace` names the workspace.
    ///
    /// # Safety
    ///
    /// Called by the shell only, while the workspace is closed, right before it opens.
    unsafe fn before_open(&self, workspace: &Arc<str>) -> Result<(), Self::Error>;

    /// When the last scope of a cycle is about to close, before the engine resets the
    /// arena. Cannot fail: what goes wrong is kept for [`CycleHooks::before_open`].
    ///
    /// # Safety
    ///
    /// Called by the shell only, as the last scope of a cycle closes.
    unsafe fn before_reset(&self);

    /// When a frame of the open cycle (opened with [`Open::frame`]) closes, before the
    /// engine hands its bytes out again. Returns whether it may: `false` keeps them to
    /// the end of the cycle, as a frame that is never closed (`mem::forget`) keeps them,
    /// for the work the hooks could not order (what goes wrong is kept for
    /// [`CycleHooks::before_open`]). `level` is the frame's level.
    ///
    /// # Safety
    ///
    /// Called by the shell only, as a frame of the open cycle closes.
    unsafe fn before_frame_close(&self, level: u32) -> bool {
        let _ = level;
        true
    }

    /// After the engine reserved `bytes` bytes at `address` for a scope or a frame of
    /// the open cycle ([`Open::alloc`], [`OpenFrame::alloc`]), before the address is
    /// handed out: order what must come before any use of them (a device workspace in a
    /// plan group waits for the other streams that used those bytes of the group's
    /// arena). An error withholds the address (the bytes stay reserved, unused, to the
    /// end of the scope or frame).
    ///
    /// # Errors
    ///
    /// The hook's own.
    #[inline(always)]
    fn after_alloc(&self, address: u64, bytes: usize) -> Result<(), Self::Error> {
        let _ = (address, bytes);
        Ok(())
    }

    /// Before the workspace (its engine and its memory) is dropped. Returns whether the
    /// memory may be freed; `false` leaks it (memory that other work may still use).
    ///
    /// # Safety
    ///
    /// Called by the shell only, as it is dropped.
    unsafe fn before_drop(&mut self) -> bool;

    /// Adds what the hooks count to a statistics snapshot.
    fn amend_stats(&self, stats: &mut WorkspaceStats) {
        let _ = stats;
    }
}

/// The host's hooks: none.
impl CycleHooks for () {
    type Error = Error;

    #[inline(always)]
    unsafe fn before_open(&self, _: &Arc<str>) -> Result<()> {
        Ok(())
    }

    #[inline(always)]
    unsafe fn before_reset(&self) {}

    #[inline(always)]
    unsafe fn before_drop(&mut self) -> bool {
        true
    }
}

/// The engine over a backend `B`, with the hooks `H` of its kind of workspace; see the
/// module docs.
///
/// `Send` when the backend's blocks and the hooks are, and `!Sync` (the engine's
/// `Cell`s): one thread uses it at a time.
pub struct Shell<B: ArenaBackend, H: CycleHooks = ()> {
    /// Dropped by hand: leaked instead when [`CycleHooks::before_drop`] says the memory
    /// may still be in use.
    engine: ManuallyDrop<Engine<B>>,
    hooks: H,
}

impl<B: ArenaBackend, H: CycleHooks> Shell<B, H> {
    /// A workspace named `name` over `backend`, reserving the configured initial size.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] when the initial arena cannot be reserved.
    pub fn new(name: &str, config: WorkspaceConfig, backend: B, hooks: H) -> Result<Self> {
        Ok(Shell { engine: ManuallyDrop::new(Engine::new(name, config, backend)?), hooks })
    }

    /// Opens a cycle (a new generation), after [`CycleHooks::before_open`], or nests in
    /// the open one. The scope of a kind of workspace holds the [`Open`] count this
    /// returns; dropping it closes the scope, and the last one ends the cycle.
    ///
    /// # Errors
    ///
    /// When opening: the hook's error, or one the engine recorded since the last cycle (a
    /// failed arena growth). The workspace stays closed and usable; opening again retries.
    #[inline]
    pub fn open(&self) -> Result<Open<'_, B, H>, H::Error> {
        let kind = self.open_raw()?;
        Ok(Open { shell: self, kind })
    }

    /// Counts one more scope of the open cycle, without nesting: the workspace becomes an
    /// allocation target for a while and still resets only when its last scope closes.
    ///
    /// # Errors
    ///
    /// [`Error::NotOpen`] when the workspace is closed: allocating into a closed workspace
    /// is an error, never a silent no-op.
    pub fn open_borrowed(&self) -> Result<Open<'_, B, H>> {
        let kind = self.open_borrowed_raw()?;
        Ok(Open { shell: self, kind })
    }

    /// [`Shell::open`] for a scope that gives its count back itself, with
    /// [`Shell::close_raw`] (the host's two-word scope, which may own its workspace).
    #[inline]
    pub(crate) fn open_raw(&self) -> Result<ScopeKind, H::Error> {
        if !self.engine.is_open() {
            // SAFETY: closed, and about to open.
            unsafe { self.hooks.before_open(self.engine.name())? };
        }
        Ok(match self.engine.enter()? {
            Entered::Opened => ScopeKind::Opened,
            Entered::Nested => ScopeKind::Nested,
        })
    }

    /// [`Shell::open_borrowed`] for a scope that gives its count back itself.
    pub(crate) fn open_borrowed_raw(&self) -> Result<ScopeKind> {
        self.engine.borrow_open("borrowing it as an allocation target")?;
        Ok(ScopeKind::Borrowed)
    }

    /// Gives back one count of [`Shell::open_raw`] or [`Shell::open_borrowed_raw`]; the
    /// last one runs [`CycleHooks::before_reset`] and ends the cycle.
    ///
    /// # Safety
    ///
    /// As [`Engine::exit`]: the caller gives up one counted scope, and once the count is
    /// zero nothing may refer to memory this cycle handed out.
    #[inline(always)]
    pub(crate) unsafe fn close_raw(&self) {
        if self.engine.depth() == 1 {
            // SAFETY: the last scope of the cycle closes.
            unsafe { self.hooks.before_reset() };
        }
        // SAFETY: the caller's contract.
        unsafe { self.engine.exit() };
    }

    /// Gives memory back: spill blocks, and the arena down to `min_size`; the size is
    /// learned again. A workspace never shrinks by itself.
    ///
    /// # Errors
    ///
    /// [`Error::StillOpen`] while a scope is open; the hook's error (what
    /// [`Shell::open`] would report).
    pub fn trim(&self) -> Result<(), H::Error> {
        if !self.engine.is_open() {
            // SAFETY: closed; trimming may hand the memory back to the backend, which,
            // like opening, needs what the last cycle left settled first.
            unsafe { self.hooks.before_open(self.engine.name())? };
        }
        Ok(self.engine.trim()?)
    }

    /// What decides the arena from now on: its size and where learning is (see
    /// [`Sizing`](crate::Sizing)).
    pub fn sizing(&self) -> crate::Sizing {
        self.engine.sizing()
    }

    /// Checks that an array allocated by workspace `owner` at `generation` (named
    /// `array_workspace`) may be used now, in this workspace.
    ///
    /// # Errors
    ///
    /// [`Error::WrongWorkspace`] when it belongs to another workspace,
    /// [`Error::StaleHandle`] when its cycle has ended.
    pub fn check_handle(&self, owner: u64, generation: u64, array_workspace: &Arc<str>) -> Result<()> {
        check_identity((owner, generation), array_workspace, (self.id(), self.generation()), self.name())
    }

    /// Where the memory at `address` lies relative to the arena.
    pub fn placement(&self, address: impl Address) -> Placement {
        let address = address.address();
        match self.engine.arena_extent() {
            Some((base, len)) if address.wrapping_sub(base.address()) < len as u64 => {
                Placement::Arena((address - base.address()) as usize)
            }
            _ => Placement::Elsewhere,
        }
    }

    /// Whether the `bytes` bytes at `address` lie inside this workspace's memory (its
    /// arena or a block it holds now). Says nothing about the generation: memory of a
    /// closed cycle is still inside.
    pub fn contains(&self, address: impl Address, bytes: usize) -> bool {
        let address = address.address();
        let Some(end) = address.checked_add(bytes as u64) else { return false };
        self.engine.any_block(|base, len| address >= base && end <= base + len as u64)
    }

    /// The workspace's name.
    pub fn name(&self) -> &Arc<str> {
        self.engine.name()
    }
    /// Process-unique id.
    pub fn id(&self) -> u64 {
        self.engine.id()
    }
    /// The configuration the workspace runs with.
    pub fn config(&self) -> &WorkspaceConfig {
        self.engine.config()
    }
    /// Current generation (one per cycle opened).
    pub fn generation(&self) -> u64 {
        self.engine.generation()
    }
    /// Whether a scope is open.
    pub fn is_open(&self) -> bool {
        self.engine.is_open()
    }
    /// Arena capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.engine.capacity()
    }
    /// Arena bytes handed out in the open cycle.
    pub fn bytes_in_use(&self) -> usize {
        self.engine.bytes_in_use()
    }
    /// A statistics snapshot; cheap, and readable while arrays are alive.
    pub fn stats(&self) -> WorkspaceStats {
        let mut stats = self.engine.stats();
        self.hooks.amend_stats(&mut stats);
        stats
    }
    /// Forgets the peak so far.
    pub fn reset_peak(&self) {
        self.engine.reset_peak()
    }
    /// Largest bytes in use (arena and spills, the spills padded as the arena pads
    /// them) since creation or [`Shell::reset_peak`]; cheaper than [`Shell::stats`] (no
    /// allocation).
    pub fn peak_bytes(&self) -> usize {
        self.engine.peak()
    }
    /// The sizes of the last cycles, oldest first (see
    /// [`WorkspaceConfigBuilder::cycle_history_len`](crate::WorkspaceConfigBuilder::cycle_history_len)).
    pub fn cycle_history(&self) -> Vec<usize> {
        self.engine.cycle_history()
    }

    /// The former name of [`Shell::cycle_history`].
    #[deprecated(note = "renamed cycle_history: the sizes of the last cycles are not a Timeline")]
    pub fn timeline(&self) -> Vec<usize> {
        self.cycle_history()
    }
    /// The hooks of this kind of workspace (their cycle methods are `unsafe` to call:
    /// only the shell runs them).
    pub fn hooks(&self) -> &H {
        &self.hooks
    }

    /// Records every later allocation and cycle end into `trace`, until called with
    /// `None` (see [`Engine::record_into`] and [`plan`](crate::plan)).
    ///
    /// # Errors
    ///
    /// [`Error::StillOpen`] while a scope is open.
    pub fn record_into(&self, trace: Option<Arc<std::sync::Mutex<crate::plan::Trace>>>) -> Result<()> {
        self.engine.record_into(trace)
    }

    /// The owner id of this workspace's events in a recorded trace.
    pub fn record_owner(&self) -> u64 {
        self.engine.owner()
    }

    /// Open scopes now (0 when closed).
    pub fn depth(&self) -> usize {
        self.engine.depth()
    }

    /// `placed` (a block's base and an offset), once [`CycleHooks::after_alloc`] has
    /// ordered the `size` bytes there: what [`Open::alloc`] and [`OpenFrame::alloc`]
    /// return.
    #[inline(always)]
    fn after_alloc(
        &self,
        placed: (<B::Block as crate::backend::Block>::Base, usize),
        size: usize,
    ) -> Result<(<B::Block as crate::backend::Block>::Base, usize), H::Error> {
        self.hooks.after_alloc(placed.0.address() + placed.1 as u64, size)?;
        Ok(placed)
    }

    /// The engine, for this crate's layers above it (a plan group joins it). Not
    /// public: its `enter` would open a cycle without the hooks.
    pub(crate) fn engine_ref(&self) -> &Engine<B> {
        &self.engine
    }

    /// The id of the plan group this workspace is a member of, if any.
    pub fn group_id(&self) -> Option<u64> {
        self.engine.group_id()
    }
}

/// The host's shell has no hooks, so its engine, which opens cycles without any, may be
/// used directly (backends, diagnostics, benchmarks of the raw allocation path).
impl<B: ArenaBackend> Shell<B, ()> {
    /// The engine.
    pub fn engine(&self) -> &Engine<B> {
        &self.engine
    }
}

/// Byte size of the `dim` elements of `T` an array of every kind of workspace holds:
/// the one shape-to-bytes computation of the project, checked. Zero-sized elements
/// take 0 bytes (a device rejects them; the host needs no memory for them).
///
/// # Errors
///
/// [`Error::ZeroLength`] for no elements; [`Error::ShapeOverflow`] when the element
/// count overflows `usize` or the byte size (or, for zero-sized elements, the count)
/// exceeds `isize::MAX`. `workspace` names the workspace in the error.
#[inline(always)]
pub fn checked_bytes<T, Dim: Dimension>(dim: &Dim, workspace: impl FnOnce() -> Arc<str>) -> Result<usize> {
    // One compare against a constant: `n * size_of::<T>()` fits in `isize`.
    let max_elements = isize::MAX as usize / size_of::<T>().max(1);
    match dim.size_checked() {
        // One compare for both bounds: 0 wraps around to `usize::MAX`. `unchecked_mul`
        // tells the optimiser the product is in range, which lets it drop the engine's
        // own size test after inlining.
        // SAFETY: `0 < n <= isize::MAX / size_of::<T>()`, so the product fits.
        Some(n) if n.wrapping_sub(1) < max_elements => Ok(unsafe { n.unchecked_mul(size_of::<T>()) }),
        found => Err(bad_shape(dim.slice(), found, size_of::<T>(), workspace())),
    }
}

#[cold]
#[inline(never)]
fn bad_shape(shape: &[usize], elements: Option<usize>, element_size: usize, workspace: Arc<str>) -> Error {
    match elements {
        Some(0) => Error::ZeroLength { workspace, shape: shape.to_vec() },
        _ => Error::ShapeOverflow { workspace, shape: shape.to_vec(), element_size },
    }
}

/// Checks a handle's `(owner, generation)` against a scope's: the one handle check of
/// every kind of workspace.
pub(crate) fn check_identity(
    handle: (u64, u64),
    array_workspace: &Arc<str>,
    scope: (u64, u64),
    scope_workspace: &Arc<str>,
) -> Result<()> {
    if handle.0 != scope.0 {
        return Err(Error::WrongWorkspace {
            array_workspace: array_workspace.clone(),
            scope_workspace: scope_workspace.clone(),
        });
    }
    if handle.1 != scope.1 {
        return Err(Error::StaleHandle {
            workspace: array_workspace.clone(),
            array_generation: handle.1,
            workspace_generation: scope.1,
        });
    }
    Ok(())
}

/// One open scope's count of a [`Shell`]'s cycle, from [`Shell::open`] or
/// [`Shell::open_borrowed`]: the scope of a kind of workspace holds it, and dropping it
/// closes the scope (the last one runs [`CycleHooks::before_reset`] and resets the
/// arena). Whatever refers to memory of the cycle borrows the scope, hence this count.
///
/// `!Send` and `!Sync`, like the shell it borrows.
#[must_use = "dropping the count closes the scope at once"]
pub struct Open<'s, B: ArenaBackend, H: CycleHooks = ()> {
    shell: &'s Shell<B, H>,
    kind: ScopeKind,
}

impl<'s, B: ArenaBackend, H: CycleHooks> Open<'s, B, H> {
    /// How the scope came to be: opened the cycle, nested in it, or borrowed it.
    pub fn kind(&self) -> ScopeKind {
        self.kind
    }

    /// Reserves `size` bytes aligned to `align` in the open cycle (see
    /// [`Engine::alloc`]): the block's base and the offset of the first byte, handed out
    /// again once the cycle ends. Only raw addresses: turning them into references is
    /// the caller's unsafe code, tied to the scope holding this count.
    ///
    /// Whatever the kind of workspace orders before memory is used
    /// ([`CycleHooks::after_alloc`]) is done before this returns.
    ///
    /// # Errors
    ///
    /// As [`Engine::alloc`], and the hook's.
    #[inline(always)]
    pub fn alloc(
        &self,
        size: usize,
        align: usize,
    ) -> Result<(<B::Block as crate::backend::Block>::Base, usize), H::Error> {
        let placed = self.shell.engine.alloc(size, align)?;
        self.shell.after_alloc(placed, size)
    }

    /// The shell this count belongs to.
    pub fn shell(&self) -> &'s Shell<B, H> {
        self.shell
    }

    /// Opens a frame in the open cycle: a release point whose allocations
    /// ([`OpenFrame::alloc`]) are handed out again when it closes (the engine's frames,
    /// as the host's [`Frame`](crate::Frame) uses them). The frame borrows this count,
    /// so it closes before the scope holding it.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] when 65,535 frames of the workspace are open already.
    pub fn frame(&self) -> Result<OpenFrame<'_, B, H>> {
        OpenFrame::open(self.shell)
    }
}

/// An open frame of a [`Shell`]'s cycle, from [`Open::frame`] or [`OpenFrame::frame`]:
/// the frame of a kind of workspace holds it, and dropping it closes the frame (after
/// [`CycleHooks::before_frame_close`], which may keep its bytes to the end of the
/// cycle). Whatever refers to memory the frame handed out borrows the frame, hence this
/// value. Closing frames out of order, or never (`mem::forget`), is safe, as for the
/// host's [`Frame`](crate::Frame).
///
/// `!Send` and `!Sync`, like the shell it borrows.
#[must_use = "dropping the frame closes it at once"]
pub struct OpenFrame<'f, B: ArenaBackend, H: CycleHooks = ()> {
    shell: &'f Shell<B, H>,
    mark: FrameMark,
}

impl<'f, B: ArenaBackend, H: CycleHooks> OpenFrame<'f, B, H> {
    fn open(shell: &'f Shell<B, H>) -> Result<Self> {
        let mark = shell.engine.open_frame()?;
        Ok(OpenFrame { shell, mark })
    }

    /// Opens a frame while this one is open, as the scope's `frame` does: its level is one
    /// more than the top frame's (the newest open one, which may be another).
    ///
    /// # Errors
    ///
    /// As [`Open::frame`].
    pub fn frame(&self) -> Result<OpenFrame<'_, B, H>> {
        OpenFrame::open(self.shell)
    }

    /// The frame's level in its cycle: 1 for a frame opened while no other frame of the
    /// workspace was open, one more for each frame open when it opened.
    pub fn level(&self) -> u32 {
        self.mark.level()
    }

    /// The shell this frame belongs to.
    pub fn shell(&self) -> &'f Shell<B, H> {
        self.shell
    }

    /// Reserves `size` bytes aligned to `align` at the frame's level: handed out again
    /// once the frame closes (or, when it is not the top frame then, once the frames
    /// above it have closed too). Only raw addresses, as [`Open::alloc`].
    ///
    /// # Errors
    ///
    /// As [`Open::alloc`].
    #[inline(always)]
    pub fn alloc(
        &self,
        size: usize,
        align: usize,
    ) -> Result<(<B::Block as crate::backend::Block>::Base, usize), H::Error> {
        let engine = &self.shell.engine;
        let level = self.mark.level();
        let placed = match engine.try_alloc_frame(level, size, align) {
            Some(placed) => placed,
            None => engine.alloc_slow_at(size, align, level)?,
        };
        self.shell.after_alloc(placed, size)
    }
}

impl<B: ArenaBackend, H: CycleHooks> Drop for OpenFrame<'_, B, H> {
    fn drop(&mut self) {
        // SAFETY: a frame of the open cycle closes (it borrows a count of the cycle).
        if unsafe { self.shell.hooks.before_frame_close(self.mark.level()) } {
            // SAFETY: the mark is this frame's, closed once (here). The engine hands out
            // raw addresses only, which unsafe code turns into references tied to the
            // frame holding this value, so none of the frame's memory is referred to.
            unsafe { self.shell.engine.close_frame(self.mark) };
        }
        // Otherwise the frame stays open in the engine, as a forgotten one: its bytes
        // are kept to the end of the cycle.
    }
}

impl<B: ArenaBackend, H: CycleHooks> std::fmt::Debug for OpenFrame<'_, B, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenFrame").field("workspace", self.shell.name()).field("level", &self.mark.level()).finish()
    }
}

impl<B: ArenaBackend, H: CycleHooks> Drop for Open<'_, B, H> {
    #[inline]
    fn drop(&mut self) {
        // SAFETY: this value holds one count of `open_raw`/`open_borrowed_raw` and gives it
        // up once, here. Memory of the cycle is reached only through references that
        // borrow the scope holding this count (the engine hands out raw addresses, which
        // only unsafe code can turn into references, tied to the scope), so none is left.
        unsafe { self.shell.close_raw() };
    }
}

impl<B: ArenaBackend, H: CycleHooks> std::fmt::Debug for Open<'_, B, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Open").field("workspace", self.shell.name()).field("kind", &self.kind).finish()
    }
}

impl<B: ArenaBackend, H: CycleHooks> Drop for Shell<B, H> {
    fn drop(&mut self) {
        // SAFETY: the shell is being dropped.
        if unsafe { self.hooks.before_drop() } {
            // SAFETY: dropped once, here; nothing uses the engine after this.
            unsafe { ManuallyDrop::drop(&mut self.engine) };
        }
        // Otherwise the memory is leaked on purpose: other work may still use it, and
        // freeing it could hand it to someone else meanwhile.
    }
}

impl<B: ArenaBackend, H: CycleHooks> std::fmt::Debug for Shell<B, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&*self.engine, f)
    }
}

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};

    use super::*;
    use crate::backend::HostBackend;
    use crate::config::Location;

    /// Records what the shell asks of its hooks; fails `before_open` while `refuse` is set.
    #[derive(Default)]
    struct Recorder {
        calls: RefCell<Vec<&'static str>>,
        refuse: Cell<bool>,
    }

    impl CycleHooks for Recorder {
        type Error = Error;

        unsafe fn before_open(&self, workspace: &Arc<str>) -> Result<()> {
            self.calls.borrow_mut().push("open");
            if self.refuse.get() {
                return Err(Error::InvalidInput(format!("'{workspace}' refused")));
            }
            Ok(())
        }

        unsafe fn before_reset(&self) {
            self.calls.borrow_mut().push("reset");
        }

        unsafe fn before_drop(&mut self) -> bool {
            true
        }

        fn amend_stats(&self, stats: &mut WorkspaceStats) {
            stats.pinned_allocations = 7;
        }
    }

    fn shell(hooks: Recorder) -> Shell<HostBackend, Recorder> {
        let config = WorkspaceConfig::default();
        Shell::new("S", config, HostBackend::for_location(&Location::Ram), hooks).unwrap()
    }

    #[test]
    fn hooks_run_once_per_cycle_around_nested_and_borrowed_scopes() {
        let s = shell(Recorder::default());
        let opened = s.open().unwrap();
        let nested = s.open().unwrap();
        let borrowed = s.open_borrowed().unwrap();
        assert_eq!(
            [opened.kind(), nested.kind(), borrowed.kind()],
            [ScopeKind::Opened, ScopeKind::Nested, ScopeKind::Borrowed]
        );
        // Scopes may close in any order; the last one ends the cycle.
        drop(opened);
        drop(borrowed);
        assert!(s.is_open());
        assert_eq!(*s.hooks().calls.borrow(), ["open"]);
        drop(nested);
        assert!(!s.is_open());
        assert_eq!(*s.hooks().calls.borrow(), ["open", "reset"]);
        assert_eq!(s.stats().pinned_allocations, 7);
    }

    #[test]
    fn a_failing_open_hook_keeps_the_workspace_closed_and_the_next_open_retries() {
        let s = shell(Recorder::default());
        s.hooks().refuse.set(true);
        let err = s.open().unwrap_err();
        assert!(err.to_string().contains("'S' refused"), "{err}");
        assert!(!s.is_open());
        assert_eq!(s.generation(), 0);
        assert!(s.trim().is_err(), "trim settles first, as open does");
        s.hooks().refuse.set(false);
        assert_eq!(s.open().unwrap().kind(), ScopeKind::Opened);
        assert_eq!(s.generation(), 1);
        assert!(!s.is_open(), "the count was dropped at once");
        assert!(matches!(s.open_borrowed(), Err(Error::NotOpen { .. })));
    }

    #[test]
    fn handles_are_checked_against_the_workspace_and_the_generation() {
        let s = shell(Recorder::default());
        let first = s.open().unwrap();
        let name: Arc<str> = Arc::from("S");
        assert!(s.check_handle(s.id(), 1, &name).is_ok());
        assert!(matches!(s.check_handle(s.id() + 1, 1, &name), Err(Error::WrongWorkspace { .. })));
        drop(first);
        let _second = s.open().unwrap();
        let err = s.check_handle(s.id(), 1, &name).unwrap_err();
        assert!(matches!(err, Error::StaleHandle { array_generation: 1, workspace_generation: 2, .. }), "{err:?}");
    }

    #[test]
    fn placement_and_containment_read_the_arena() {
        let config = WorkspaceConfig::builder().initial_size(4096).build().unwrap();
        let s = Shell::new("S", config, HostBackend::for_location(&Location::Ram), ()).unwrap();
        let _open = s.open().unwrap();
        let (base, offset) = s.engine().alloc(64, 16).unwrap();
        let at = base.as_ptr().wrapping_add(offset);
        assert_eq!(s.placement(at.cast_const()), Placement::Arena(offset));
        assert!(s.contains(at, 64));
        assert!(!s.contains(at, usize::MAX));
        assert_eq!(s.placement(0x10usize), Placement::Elsewhere);
    }

    #[test]
    fn shape_to_bytes_is_checked_for_every_element_size() {
        let name = || Arc::<str>::from("W");
        assert_eq!(checked_bytes::<f32, _>(&ndarray::Ix2(3, 4), name).unwrap(), 48);
        assert_eq!(checked_bytes::<(), _>(&ndarray::Ix1(5), name).unwrap(), 0);
        assert!(matches!(checked_bytes::<f32, _>(&ndarray::Ix2(3, 0), name), Err(Error::ZeroLength { .. })));
        let huge = ndarray::Ix2(usize::MAX / 2, 3);
        assert!(matches!(checked_bytes::<u8, _>(&huge, name), Err(Error::ShapeOverflow { .. })));
        let over = ndarray::Ix1(isize::MAX as usize / 4 + 1);
        assert!(matches!(checked_bytes::<f32, _>(&over, name), Err(Error::ShapeOverflow { element_size: 4, .. })));
        let zst_over = ndarray::Ix1(isize::MAX as usize + 1);
        assert!(matches!(checked_bytes::<(), _>(&zst_over, name), Err(Error::ShapeOverflow { .. })));
    }

    #[test]
    fn the_drop_hook_runs_before_the_memory_is_freed() {
        let dropped = std::rc::Rc::new(Cell::new(false));
        struct Flag(std::rc::Rc<Cell<bool>>);
        impl CycleHooks for Flag {
            type Error = Error;
            unsafe fn before_open(&self, _: &Arc<str>) -> Result<()> {
                Ok(())
            }
            unsafe fn before_reset(&self) {}
            unsafe fn before_drop(&mut self) -> bool {
                self.0.set(true);
                true
            }
        }
        let s = Shell::new(
            "S",
            WorkspaceConfig::default(),
            HostBackend::for_location(&Location::Ram),
            Flag(dropped.clone()),
        )
        .unwrap();
        drop(s);
        assert!(dropped.get());
    }
}
