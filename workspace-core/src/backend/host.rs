//! Host backends: RAM on bumpalo (arenas of a huge page or more on a fresh anonymous
//! mapping advised to use transparent huge pages) and memory maps on memmap2
//! (file-backed or anonymous).
//!
//! `unsafe` code in this crate lives here and in `engine` (the `Send` argument, the
//! contract of `exit`), `workspace` and `scope` (building scopes), `handle` and
//! `alloc_api`; every other module denies it.

use std::alloc::Layout;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use bumpalo::Bump;
use memmap2::{MmapMut, MmapOptions};

use super::{ArenaBackend, Block};
use crate::config::Location;
use crate::error::BackendError;

/// Size of a transparent huge page on x86-64 and most aarch64 kernels.
pub const HUGE_PAGE: usize = 2 << 20;
/// Arena blocks are at least page-aligned.
const PAGE: usize = 4096;

/// Who owns the memory of a [`HostBlock`].
#[derive(Debug)]
enum Owner {
    /// One bumpalo chunk; the block is its only allocation.
    Bump { _chunk: Bump },
    /// A memory map (file-backed or anonymous).
    Map { _map: MmapMut },
}

/// A block of host memory.
#[derive(Debug)]
pub struct HostBlock {
    /// Invariant: points to `len` bytes owned by `owner`, valid while `owner` lives.
    ptr: NonNull<u8>,
    len: usize,
    /// Whether every byte holds an initialised value (maps do; RAM chunks do not).
    initialised: bool,
    /// Held only to keep the memory alive; dropping it frees the block.
    _owner: Owner,
}

// SAFETY: a `HostBlock` exclusively owns its memory (a bumpalo chunk nobody else
// allocates from, or a memory map); the raw pointer is a view of that owned memory,
// so moving the block to another thread moves the ownership with it. `Bump` and
// `MmapMut` are themselves `Send`.
unsafe impl Send for HostBlock {}

impl HostBlock {
    fn ram(bytes: usize, align: usize) -> Result<HostBlock, BackendError> {
        let oom = || BackendError::OutOfMemory { bytes, align };
        // Large blocks start on a huge-page boundary so the kernel can back them with
        // transparent huge pages from the first touch: a 12 MB arena then takes a
        // handful of page faults instead of ~3,000.
        let align = if bytes >= HUGE_PAGE { align.max(HUGE_PAGE) } else { align };
        let layout = Layout::from_size_align(bytes, align).map_err(|_| oom())?;
        // An empty bump has no chunk; its first allocation makes a chunk sized and
        // aligned for exactly this layout.
        let bump = Bump::new();
        let ptr = bump.try_alloc_layout(layout).map_err(|_| oom())?;
        if bytes >= HUGE_PAGE {
            advise_huge_pages(ptr, bytes);
        }
        Ok(HostBlock { ptr, len: bytes, initialised: false, _owner: Owner::Bump { _chunk: bump } })
    }

    /// A RAM arena. Arenas of a huge page or more get a fresh anonymous mapping of
    /// their own, aligned to a huge page and advised to use transparent huge pages:
    /// memory from the process heap may already be backed by 4 KiB pages (glibc hands
    /// out reused heap memory once its mmap threshold has adapted), and then the kernel
    /// cannot back it with huge pages at the first touch. Smaller arenas and all
    /// spills come from bumpalo.
    fn ram_arena(bytes: usize) -> Result<HostBlock, BackendError> {
        if !cfg!(target_os = "linux") || bytes < HUGE_PAGE {
            return HostBlock::ram(bytes, PAGE);
        }
        let oom = || BackendError::OutOfMemory { bytes, align: HUGE_PAGE };
        let padded = bytes.checked_add(HUGE_PAGE - PAGE).ok_or_else(oom)?;
        let mut map = MmapMut::map_anon(padded).map_err(|_| oom())?;
        let start = map.as_mut_ptr();
        let skip = start.align_offset(HUGE_PAGE);
        debug_assert!(skip <= HUGE_PAGE - PAGE, "mappings are page-aligned");
        // SAFETY: `skip + bytes <= padded` (the mapping is page-aligned, so the next
        // huge-page boundary is at most `HUGE_PAGE - PAGE` bytes in), so the block
        // stays inside the mapping, which lives as long as the block owns it.
        let ptr = NonNull::new(unsafe { start.add(skip) }).expect("a mapping is not null");
        advise_huge_pages(ptr, bytes);
        // The block is treated as uninitialised like any RAM arena, although a fresh
        // anonymous mapping reads as zeros.
        Ok(HostBlock { ptr, len: bytes, initialised: false, _owner: Owner::Map { _map: map } })
    }

    fn map(map: MmapMut) -> HostBlock {
        let len = map.len();
        let mut map = map;
        let ptr = NonNull::new(map.as_mut_ptr()).expect("a non-empty memory map is not null");
        HostBlock { ptr, len, initialised: true, _owner: Owner::Map { _map: map } }
    }
}

impl Block for HostBlock {
    type Base = NonNull<u8>;
    #[inline(always)]
    fn base(&self) -> NonNull<u8> {
        self.ptr
    }
    #[inline(always)]
    fn len(&self) -> usize {
        self.len
    }
    /// True for memory maps, false for RAM.
    fn is_initialised(&self) -> bool {
        self.initialised
    }
}

#[cfg(target_os = "linux")]
fn advise_huge_pages(ptr: NonNull<u8>, bytes: usize) {
    // SAFETY: `ptr..ptr+bytes` is one live allocation we own, and `ptr` is aligned to
    // a huge page (hence to a page). MADV_HUGEPAGE only changes how the kernel backs
    // the range, never its contents; failure (THP disabled) is harmless, so the
    // result is ignored on purpose.
    unsafe {
        libc::madvise(ptr.as_ptr().cast(), bytes, libc::MADV_HUGEPAGE);
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_ptr: NonNull<u8>, _bytes: usize) {}

/// The host backend for a [`Location`].
#[derive(Debug)]
pub enum HostBackend {
    /// Host RAM: bumpalo, and fresh huge-page-aligned anonymous mappings for large arenas.
    Ram,
    /// A file mapping; the file is created or extended to the arena size.
    MmapFile {
        /// The backing file.
        path: PathBuf,
    },
    /// An anonymous mapping.
    MmapAnonymous,
}

impl HostBackend {
    /// The backend for a configured location.
    pub fn for_location(location: &Location) -> HostBackend {
        match location {
            Location::Ram => HostBackend::Ram,
            Location::Mmap { path } => HostBackend::MmapFile { path: path.clone() },
            Location::MmapAnonymous => HostBackend::MmapAnonymous,
        }
    }
}

fn map_file(path: &Path, bytes: usize) -> Result<MmapMut, BackendError> {
    let io = |source| BackendError::Mmap { path: path.display().to_string(), source };
    let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    let wanted = u64::try_from(bytes).map_err(|_| BackendError::OutOfMemory { bytes, align: PAGE })?;
    if len < wanted {
        file.set_len(wanted).map_err(io)?;
    }
    // SAFETY: memmap2 requires that the file is not truncated or modified by another
    // process while mapped; carve owns the workspace file for the workspace's
    // lifetime, as documented on `Location::Mmap`. The mapping is private to this
    // block.
    unsafe { MmapOptions::new().len(bytes).map_mut(&file) }.map_err(io)
}

impl ArenaBackend for HostBackend {
    type Block = HostBlock;

    fn kind(&self) -> &'static str {
        match self {
            HostBackend::Ram => "ram",
            HostBackend::MmapFile { .. } => "mmap-file",
            HostBackend::MmapAnonymous => "mmap-anon",
        }
    }

    fn base_alignment(&self) -> usize {
        PAGE
    }

    fn fixed_size(&self) -> bool {
        matches!(self, HostBackend::MmapFile { .. })
    }

    fn allocate_arena(&mut self, bytes: usize) -> Result<HostBlock, BackendError> {
        match self {
            HostBackend::Ram => HostBlock::ram_arena(bytes),
            HostBackend::MmapFile { path } => Ok(HostBlock::map(map_file(path, bytes)?)),
            HostBackend::MmapAnonymous => MmapMut::map_anon(bytes)
                .map(HostBlock::map)
                .map_err(|source| BackendError::Mmap { path: "<anonymous>".into(), source }),
        }
    }

    fn allocate_spill(&mut self, bytes: usize, align: usize) -> Result<HostBlock, BackendError> {
        HostBlock::ram(bytes, align)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ram_blocks_are_aligned_and_writable() {
        let mut backend = HostBackend::Ram;
        for (bytes, align) in [(1, 64), (4096, 4096), (HUGE_PAGE + 1, 64), (100, 1 << 16)] {
            let block = backend.allocate_spill(bytes, align).unwrap();
            assert_eq!(block.len(), bytes);
            assert_eq!(block.base().as_ptr() as usize % align, 0, "{bytes} bytes at {align}");
            // SAFETY: the block owns `bytes` writable bytes.
            unsafe { std::ptr::write_bytes(block.base().as_ptr(), 0xAB, bytes) };
            backend.release(block);
        }
        let arena = backend.allocate_arena(3 * HUGE_PAGE).unwrap();
        assert_eq!(arena.base().as_ptr() as usize % HUGE_PAGE, 0);
    }

    #[test]
    fn huge_requests_fail_without_panicking() {
        let mut backend = HostBackend::Ram;
        assert!(matches!(backend.allocate_spill(usize::MAX - 10, 64), Err(BackendError::OutOfMemory { .. })));
        assert!(matches!(backend.allocate_arena(isize::MAX as usize), Err(BackendError::OutOfMemory { .. })));
    }

    #[test]
    fn unwritable_mmap_path_is_an_error() {
        let mut backend = HostBackend::MmapFile { path: "/proc/definitely/not/here.ws".into() };
        let err = backend.allocate_arena(4096).unwrap_err();
        assert!(matches!(err, BackendError::Mmap { .. }));
        assert!(err.to_string().contains("/proc/definitely/not/here.ws"), "{err}");
    }
}
