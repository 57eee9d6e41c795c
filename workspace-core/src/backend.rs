//! The arena backend trait: where workspace memory comes from.
//!
//! What a backend author needs; a user of workspaces needs none of it.
//!
//! The cycle, learning, spill and statistics logic ([`Engine`]) is
//! written once against this trait. A backend only hands out and takes back
//! contiguous blocks; the engine bumps offsets inside them. Host RAM (bumpalo) and
//! memory maps (memmap2) are [`HostBackend`]; device memory and pinned host memory
//! implement the same trait in `workspace-cuda`, which is how the device path reuses
//! every semantic test.
//!
//! # The shell
//!
//! What every kind of workspace does around the engine, written once.
//!
//! A host [`Workspace`](crate::Workspace), a device workspace and a pinned workspace
//! (both in `workspace-cuda`) are each a [`Shell`] over their backend plus a few methods
//! of their own. The shell opens and closes cycles ([`Shell::open`], whose [`Open`] count closes the scope when dropped),
//! settles what the last cycle left before the next one opens, checks handles against
//! the generation ([`Shell::check_handle`]), says where memory lies
//! ([`Shell::placement`], [`Shell::contains`]), and reads the statistics. What a kind
//! of workspace adds around the cycles (a device orders the other streams that used the
//! memory before the reset; a pinned workspace waits for its transfers before the memory
//! is handed out again) are its [`CycleHooks`].
//!
//! The scopes stay per kind, because what one allocates differs (ndarray views on the
//! host, device views on a device); each holds the [`Open`] count that [`Shell::open`]
//! or [`Shell::open_borrowed`] returns, whose drop closes it.

mod host;

pub use crate::engine::{Engine, Entered, FrameMark};
pub use crate::shell::{checked_bytes, CycleHooks, Open, OpenFrame, Placement, ScopeKind, Shell};
pub use host::{machine_memory_bytes, HostBackend, HostBlock};

use crate::error::BackendError;

/// A block's base address: a host pointer or a device address, readable as a number
/// (for placement and containment tests, never to reach the memory).
pub trait Address: Copy {
    /// The address as a number.
    fn address(self) -> u64;
}

impl Address for std::ptr::NonNull<u8> {
    #[inline(always)]
    fn address(self) -> u64 {
        self.as_ptr() as usize as u64
    }
}

impl Address for *const u8 {
    #[inline(always)]
    fn address(self) -> u64 {
        self as usize as u64
    }
}

impl Address for *mut u8 {
    #[inline(always)]
    fn address(self) -> u64 {
        self as usize as u64
    }
}

impl Address for usize {
    #[inline(always)]
    fn address(self) -> u64 {
        self as u64
    }
}

impl Address for u64 {
    #[inline(always)]
    fn address(self) -> u64 {
        self
    }
}

/// One contiguous block of memory owned by a backend.
///
/// # Safety
///
/// Unsafe code (the engine's callers, the prefetch ring) reads and writes the memory a
/// block describes, so an implementation promises, for as long as the block value
/// lives (until it is dropped or given back with [`ArenaBackend::release`]):
///
/// - [`Block::base`] and [`Block::len`] return the same values on every call;
/// - the `len()` bytes from `base()` are valid memory that the block owns exclusively:
///   nothing else (no reference, no other block, no other thread) reads or writes them
///   except through this block's base address; for host memory, they are valid for
///   reads and writes of any value;
/// - moving the block, also to another thread, neither moves nor invalidates that
///   memory.
///
/// [`Block::is_initialised`] may return `true` only when every byte holds an
/// initialised value.
///
/// A safe implementation, which could point the ring's writes at any address, does not
/// compile:
///
/// ```compile_fail,E0200
/// struct Anywhere;
/// impl workspace_core::backend::Block for Anywhere {
///     type Base = std::ptr::NonNull<u8>;
///     fn base(&self) -> std::ptr::NonNull<u8> {
///         std::ptr::NonNull::new(0x40 as *mut u8).unwrap()
///     }
///     fn len(&self) -> usize {
///         4096
///     }
/// }
/// ```
pub unsafe trait Block: Send {
    /// Address type of the block's first byte: a host pointer or a device address.
    type Base: Address;
    /// The block's first byte.
    fn base(&self) -> Self::Base;
    /// Usable length in bytes.
    fn len(&self) -> usize;
    /// Whether the block has no bytes (never true for blocks the engine asks for).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Whether every byte holds an initialised value from the start (a memory map
    /// does; fresh RAM or device memory does not). Only such arenas can give their
    /// contents back through [`Scope::retained`](crate::Scope::retained).
    fn is_initialised(&self) -> bool {
        false
    }
}

/// A source of arena and spill blocks.
///
/// # Safety
///
/// The engine turns offsets inside the blocks a backend returns into memory that safe
/// code reads and writes, so an implementation promises:
///
/// - [`ArenaBackend::base_alignment`] returns the same power of two on every call;
/// - a block from [`ArenaBackend::allocate_arena`], [`ArenaBackend::allocate_spill`]
///   or [`ArenaBackend::reserve`] is at least as long as requested and its base is
///   aligned to the `align` asked for; one from [`ArenaBackend::adopt`] is the same
///   memory as the block it was given, at least `bytes` long;
/// - no two blocks that are alive at the same time overlap, and each meets the
///   contract of [`Block`].
///
/// Implementing it needs `unsafe impl`:
///
/// ```compile_fail,E0200
/// struct Lying;
/// impl workspace_core::backend::ArenaBackend for Lying {
///     type Block = workspace_core::backend::HostBlock;
///     fn kind(&self) -> &'static str {
///         "lying"
///     }
///     fn base_alignment(&self) -> usize {
///         1 << 20
///     }
///     fn allocate_arena(&mut self, bytes: usize, align: usize) -> Result<Self::Block, workspace_core::BackendError> {
///         unimplemented!("{bytes} {align}")
///     }
///     fn allocate_spill(&mut self, bytes: usize, align: usize) -> Result<Self::Block, workspace_core::BackendError> {
///         unimplemented!("{bytes} {align}")
///     }
/// }
/// ```
pub unsafe trait ArenaBackend: Send {
    /// The block type.
    type Block: Block;

    /// A short name for statistics tables ("ram", "mmap-file", "device", ...).
    fn kind(&self) -> &'static str;

    /// Alignment every arena block's base has; the engine aligns offsets relative to
    /// the base, so requests up to this alignment are served from the arena.
    fn base_alignment(&self) -> usize;

    /// Whether the arena has a fixed size (a file mapping): learning and growth are
    /// then refused by configuration, and `trim` keeps the arena.
    fn fixed_size(&self) -> bool {
        false
    }

    /// Reserves the arena block of `bytes` (> 0) bytes, its base aligned to `align`: a
    /// power of two, at least [`ArenaBackend::base_alignment`] (larger when the
    /// workspace's configured alignment is).
    ///
    /// # Errors
    ///
    /// When the memory cannot be provided, or not at that alignment.
    fn allocate_arena(&mut self, bytes: usize, align: usize) -> Result<Self::Block, BackendError>;

    /// Reserves a spill block of `bytes` (> 0) bytes aligned to `align`.
    ///
    /// # Errors
    ///
    /// When the memory cannot be provided.
    fn allocate_spill(&mut self, bytes: usize, align: usize) -> Result<Self::Block, BackendError>;

    /// Reserves address space for a cycle whose size nobody knows yet: the first
    /// cycle of a learning workspace, which has no arena. The block is at least
    /// `at_least` bytes long, at most about `at_most` (the budget left), aligned to
    /// `align` (as for [`ArenaBackend::allocate_arena`]), and costs memory only where it
    /// is touched.
    /// The engine spills into it, and at the end of the cycle hands it to
    /// [`ArenaBackend::adopt`] to become the learned arena, so the memory the first
    /// cycle touched is the memory every later cycle reuses.
    ///
    /// `None` (the default) when the backend has no such thing; the engine then
    /// spills into chunks from [`ArenaBackend::allocate_spill`].
    fn reserve(&mut self, at_least: usize, at_most: usize, align: usize) -> Option<Self::Block> {
        let _ = (at_least, at_most, align);
        None
    }

    /// Maps `block`'s memory now, so that the cycles that later reach deeper into it
    /// than any before take no page faults (the engine calls it on an arena it sized
    /// from the cycles it learned, never on a configured initial size). The default
    /// does nothing.
    ///
    /// # Safety
    ///
    /// Nothing may read or write the block's memory during the call: the block is an
    /// arena between cycles, none of whose memory has been handed out.
    unsafe fn prefault(&mut self, block: &Self::Block) {
        let _ = block;
    }

    /// Turns a block from [`ArenaBackend::reserve`] into an arena of exactly `bytes`
    /// (no more than its length) and gives the rest of the reservation back; or
    /// returns the block unchanged when it cannot (the default).
    ///
    /// # Errors
    ///
    /// The block itself, when it cannot become the arena.
    fn adopt(&mut self, block: Self::Block, bytes: usize) -> Result<Self::Block, Self::Block> {
        let _ = bytes;
        Err(block)
    }

    /// Gives a block back. Device backends order this after pending work on their
    /// stream; host backends simply free it.
    fn release(&mut self, block: Self::Block) {
        drop(block);
    }
}
