//! Host backends: RAM on bumpalo (arenas of a huge page or more on a fresh anonymous
//! mapping advised to use transparent huge pages) and memory maps on memmap2
//! (file-backed or anonymous).
//!
//! `unsafe` code in this crate lives here and in `engine` (the `Send` argument, the
//! contract of `exit`), `workspace` and `scope` (building scopes), `handle` and
//! `alloc_api`; every other module denies it.

use std::alloc::Layout;
use std::fs::{File, OpenOptions, TryLockError};
use std::path::Path;
use std::ptr::NonNull;

use bumpalo::Bump;
use memmap2::{MmapMut, MmapOptions};

use super::{ArenaBackend, Block};
use crate::config::{Location, MappedFile};
use crate::error::BackendError;

/// Size of a transparent huge page on x86-64 and most aarch64 kernels.
const HUGE_PAGE: usize = 2 << 20;
/// Arena blocks are at least page-aligned.
const PAGE: usize = 4096;

/// Who owns the memory of a [`HostBlock`].
#[derive(Debug)]
enum Owner {
    /// One bumpalo chunk; the block is its only allocation.
    Bump { _chunk: Bump },
    /// A memory map (file-backed or anonymous).
    Map { _map: MmapMut },
    /// A file mapping and the file, held open for its exclusive lock (released when
    /// the file is closed, after the mapping is gone: fields drop in order).
    File { _map: MmapMut, _locked: File },
    /// A reservation of address space (see [`ArenaBackend::reserve`]).
    Reserved(Reservation),
}

/// A first request at least this large suggests a cycle of MiB: its reservation
/// uses huge pages from the start.
const HUGE_FIRST_REQUEST: usize = HUGE_PAGE / 8;

/// Largest reservation for a first cycle of unknown size; a cycle that needs more
/// spills the rest into chunks, and its arena is allocated afresh. (Giving back the
/// unused tail of a reservation costs more the larger it is.)
const RESERVATION_CAP: usize = 256 << 20;

/// An anonymous private mapping made with `MAP_NORESERVE`: only the pages touched
/// cost memory (and count against nothing until then). It is advised to use
/// transparent huge pages, so a cycle of many MiB takes a few page faults; but when
/// the cycle's first request is small (under [`HUGE_FIRST_REQUEST`]), its first huge
/// page is left to 4 KiB pages, so that a cycle of a few KiB does not fault in (and
/// keep) a whole huge page. Unmapped on drop.
#[derive(Debug)]
struct Reservation {
    /// Invariant: `map..map + map_len` is one mapping this value owns.
    map: NonNull<u8>,
    map_len: usize,
    /// The huge-page-aligned start of the usable range, inside the mapping.
    start: NonNull<u8>,
    /// Usable bytes from `start`; `start + len <= map + map_len`.
    len: usize,
    /// Whether the first huge page is advised to use a huge page too.
    huge_from_start: bool,
}

impl Reservation {
    /// Maps `bytes` rounded up to a huge page, starting on a huge-page boundary (the
    /// mapping is one huge page longer, and the slack stays mapped: trimming it
    /// would cost two more system calls on the cold path). Huge pages are advised
    /// from the start when `huge_from_start`, else past the first huge page.
    #[cfg(target_os = "linux")]
    fn new(bytes: usize, huge_from_start: bool) -> Option<Reservation> {
        let len = bytes.checked_next_multiple_of(HUGE_PAGE)?;
        let map_len = len.checked_add(HUGE_PAGE)?;
        if map_len > isize::MAX as usize {
            return None;
        }
        // SAFETY: a fresh anonymous mapping at an address of the kernel's choosing
        // aliases nothing; the result is checked against MAP_FAILED.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return None;
        }
        let map = NonNull::new(raw.cast::<u8>())?;
        let head = map.as_ptr().align_offset(HUGE_PAGE);
        // SAFETY: `head < HUGE_PAGE`, so `head + len <= map_len`: the usable range
        // lies inside the mapping.
        let start = unsafe { map.add(head) };
        if huge_from_start {
            advise_huge_pages(start, len);
        } else if len > HUGE_PAGE {
            // SAFETY: `HUGE_PAGE < len`, so the advised range lies inside it too.
            advise_huge_pages(unsafe { start.add(HUGE_PAGE) }, len - HUGE_PAGE);
        }
        Some(Reservation { map, map_len, start, len, huge_from_start })
    }

    #[cfg(not(target_os = "linux"))]
    fn new(_bytes: usize, _huge_from_start: bool) -> Option<Reservation> {
        None
    }

    /// Keeps the first `bytes` of the usable range and unmaps everything after it:
    /// rounded up to a page when they fit in the first huge page and that one was
    /// left to 4 KiB pages, else to a huge page (so that a huge page already
    /// faulted in is not split).
    fn shrink_to(&mut self, bytes: usize) {
        let unit = if bytes > HUGE_PAGE || self.huge_from_start { HUGE_PAGE } else { PAGE };
        let keep = bytes.next_multiple_of(unit).min(self.len);
        let head = self.start.as_ptr() as usize - self.map.as_ptr() as usize;
        let end = head + keep;
        if end < self.map_len {
            // SAFETY: `end..map_len` is the tail of the mapping this value owns, and
            // `end` is page-aligned (`start` is a huge page boundary, `keep` a
            // multiple of a page).
            unsafe { libc::munmap(self.map.as_ptr().add(end).cast(), self.map_len - end) };
            self.map_len = end;
        }
        self.len = keep;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // SAFETY: the mapping is owned by this value (invariant) and nothing refers
        // to it once the block holding it is dropped.
        unsafe { libc::munmap(self.map.as_ptr().cast(), self.map_len) };
    }
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
        if !machine_can_back(bytes) {
            return Err(oom());
        }
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

    /// A RAM arena aligned to `align` (at least a page). Arenas of a huge page or more
    /// get a fresh anonymous mapping of their own, aligned to a huge page and advised to
    /// use transparent huge pages: memory from the process heap may already be backed
    /// by 4 KiB pages (glibc hands out reused heap memory once its mmap threshold has
    /// adapted), and then the kernel cannot back it with huge pages at the first touch.
    /// Smaller arenas and all spills come from bumpalo.
    fn ram_arena(bytes: usize, align: usize) -> Result<HostBlock, BackendError> {
        let block = if !cfg!(target_os = "linux") || bytes < HUGE_PAGE {
            HostBlock::ram(bytes, align.max(PAGE))?
        } else {
            let block = HostBlock::anonymous(bytes, align.max(HUGE_PAGE))?;
            advise_huge_pages(block.ptr, bytes);
            block
        };
        Ok(block)
    }

    /// A fresh anonymous mapping of `bytes`, its start aligned to `align` (a power of
    /// two, at least a page): the mapping is `align - PAGE` bytes longer and the block
    /// starts at its first `align` boundary. Treated as uninitialised like any RAM
    /// arena, although a fresh anonymous mapping reads as zeros.
    fn anonymous(bytes: usize, align: usize) -> Result<HostBlock, BackendError> {
        let oom = || BackendError::OutOfMemory { bytes, align };
        if !machine_can_back(bytes) {
            return Err(oom());
        }
        let padded = bytes.checked_add(align.saturating_sub(PAGE)).ok_or_else(oom)?;
        let mut map = MmapMut::map_anon(padded).map_err(|_| oom())?;
        let start = map.as_mut_ptr();
        let skip = start.align_offset(align);
        if skip > padded - bytes {
            return Err(oom()); // mappings are page-aligned, so this does not happen
        }
        // SAFETY: `skip + bytes <= padded`, checked above, so the block stays inside the
        // mapping, which lives as long as the block owns it.
        let ptr = NonNull::new(unsafe { start.add(skip) }).ok_or_else(oom)?;
        Ok(HostBlock { ptr, len: bytes, initialised: false, _owner: Owner::Map { _map: map } })
    }

    /// A whole memory map; with `locked`, the file behind it, held for its lock.
    fn mapped(mut map: MmapMut, locked: Option<File>) -> HostBlock {
        let (ptr, len) = (NonNull::new(map.as_mut_ptr()).expect("a non-empty memory map is not null"), map.len());
        let owner = match locked {
            None => Owner::Map { _map: map },
            Some(file) => Owner::File { _map: map, _locked: file },
        };
        HostBlock { ptr, len, initialised: true, _owner: owner }
    }
}

// SAFETY: `ptr..ptr + len` is memory that `_owner` (a bumpalo chunk no one else
// allocates from, a memory map or a reservation, none of them shared) owns and keeps
// valid until the block is dropped; neither field changes after construction, and
// the memory stays put when the block moves. Only maps (whose bytes are initialised)
// report `is_initialised`.
unsafe impl Block for HostBlock {
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

/// Whether `bytes` could ever be backed by this machine: no more than its memory and
/// swap together. (A `MAP_NORESERVE` mapping or an overcommitting kernel would grant a
/// larger request and the process would be killed when it touched the memory.)
fn machine_can_back(bytes: usize) -> bool {
    // Requests below 1 GiB never need the system call.
    bytes < (1 << 30) || machine_memory_bytes().is_none_or(|total| bytes as u128 <= total)
}

/// This machine's memory and swap together, in bytes (`None` where it cannot be told):
/// the most that any set of buffers a process holds at once can ever be backed by. A
/// caller about to make several large buffers checks their sum against it, since an
/// overcommitting kernel grants each one alone and kills the process once their pages
/// are touched.
#[cfg(target_os = "linux")]
pub fn machine_memory_bytes() -> Option<u128> {
    use std::sync::OnceLock;
    static TOTAL: OnceLock<Option<u128>> = OnceLock::new();
    *TOTAL.get_or_init(|| {
        // SAFETY: `sysinfo` only writes the struct it is given, which is plain data
        // for which all-zero bytes are a valid value.
        let mut info: libc::sysinfo = unsafe { std::mem::zeroed() };
        // SAFETY: `info` is a valid, writable `struct sysinfo`.
        if unsafe { libc::sysinfo(&mut info) } != 0 {
            return None; // unknown: let the allocator decide
        }
        let unit = u128::from(info.mem_unit.max(1));
        let swap = u128::from(info.totalswap) * unit;
        let machine = u128::from(info.totalram) * unit + swap;
        // A container's memory limit (its cgroup's), when lower: past it the kernel
        // kills the process as it does past the machine's.
        Some(cgroup_limit(swap).map_or(machine, |limit| limit.min(machine)))
    })
}

/// The memory this process's cgroup may take, with the swap it may use (at most
/// `swap`), in bytes: `None` where no limit is set or none can be read. cgroup v2
/// (`memory.max`, `memory.swap.max`), then v1 (`memory.limit_in_bytes`).
#[cfg(target_os = "linux")]
fn cgroup_limit(swap: u128) -> Option<u128> {
    let read = |path: &str| -> Option<u128> { std::fs::read_to_string(path).ok()?.trim().parse().ok() };
    if let Some(memory) = read("/sys/fs/cgroup/memory.max") {
        let swap = read("/sys/fs/cgroup/memory.swap.max").map_or(swap, |limit| limit.min(swap));
        return Some(memory + swap);
    }
    // v1 says "no limit" with a vast number, which the machine's size is below.
    read("/sys/fs/cgroup/memory/memory.limit_in_bytes").map(|memory| memory.saturating_add(swap))
}

/// This machine's memory and swap together (see the Linux form): unknown here.
#[cfg(not(target_os = "linux"))]
pub fn machine_memory_bytes() -> Option<u128> {
    None
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
#[non_exhaustive]
pub enum HostBackend {
    /// Host RAM: bumpalo, and fresh huge-page-aligned anonymous mappings for large arenas.
    Ram,
    /// A file mapping; the file is created or extended to the arena size, and locked
    /// for as long as it is mapped. Made from a [`MappedFile`], whose `unsafe`
    /// constructor carries the caller's promise about the file.
    MmapFile(MappedFile),
    /// An anonymous mapping.
    MmapAnonymous,
    /// Host RAM for a dry run's shape-only workspaces
    /// ([`Workspace::is_shape_only`](crate::Workspace::is_shape_only)): RAM's arenas and
    /// spill blocks, without RAM's first-cycle reservation (a mapping and its page
    /// faults per cycle while a workspace learns) and without prefaulting a learned
    /// arena. Where memory comes from only: the accounting, learning and planning are
    /// RAM's.
    ShapeOnly,
}

impl HostBackend {
    /// The backend for a configured location.
    pub fn for_location(location: &Location) -> HostBackend {
        match location {
            Location::Ram => HostBackend::Ram,
            Location::Mmap(file) => HostBackend::MmapFile(file.clone()),
            Location::MmapAnonymous => HostBackend::MmapAnonymous,
        }
    }
}

/// Opens, locks, sizes and maps the file of a file-backed arena.
fn map_file(path: &Path, bytes: usize) -> Result<HostBlock, BackendError> {
    let io = |source| BackendError::Mmap { path: path.display().to_string(), source };
    let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path).map_err(io)?;
    // Exclusive for the life of the mapping: two workspaces on one file would hand out
    // aliasing mutable views of the same bytes.
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => return Err(BackendError::FileInUse { path: path.display().to_string() }),
        Err(TryLockError::Error(source)) => return Err(io(source)),
    }
    let len = file.metadata().map_err(io)?.len();
    let wanted = u64::try_from(bytes).map_err(|_| BackendError::OutOfMemory { bytes, align: PAGE })?;
    if len < wanted {
        file.set_len(wanted).map_err(io)?;
    }
    // SAFETY: memmap2 requires that the file is not truncated or modified by other
    // code while mapped. The caller of the `unsafe` `MappedFile::new` promised that for
    // the life of the workspace, and the exclusive lock taken above (held by the block
    // as long as the mapping) keeps every other carve workspace off the file.
    let map = unsafe { MmapOptions::new().len(bytes).map_mut(&file) }.map_err(io)?;
    Ok(HostBlock::mapped(map, Some(file)))
}

// SAFETY: RAM blocks are bumpalo chunks or fresh mappings laid out for exactly the
// requested size and alignment (arenas at least page-aligned, see `ram_arena`), maps
// are page-aligned by the kernel, reservations are huge-page-aligned and `adopt` keeps
// their first `bytes`; every block is a fresh allocation of its own.
unsafe impl ArenaBackend for HostBackend {
    type Block = HostBlock;

    fn kind(&self) -> &'static str {
        match self {
            HostBackend::Ram => "ram",
            HostBackend::ShapeOnly => "shape-only",
            HostBackend::MmapFile(_) => "mmap-file",
            HostBackend::MmapAnonymous => "mmap-anon",
        }
    }

    fn base_alignment(&self) -> usize {
        PAGE
    }

    fn fixed_size(&self) -> bool {
        matches!(self, HostBackend::MmapFile(_))
    }

    fn allocate_arena(&mut self, bytes: usize, align: usize) -> Result<HostBlock, BackendError> {
        match self {
            HostBackend::Ram | HostBackend::ShapeOnly => HostBlock::ram_arena(bytes, align),
            HostBackend::MmapFile(file) => {
                if align > PAGE {
                    // The file's contents start at the mapping's (page-aligned) start.
                    return Err(BackendError::Unaligned { kind: "mmap-file", align, guaranteed: PAGE });
                }
                map_file(file.path(), bytes)
            }
            HostBackend::MmapAnonymous if align > PAGE => {
                let mut block = HostBlock::anonymous(bytes, align)?;
                block.initialised = true; // a fresh anonymous mapping reads as zeros
                Ok(block)
            }
            HostBackend::MmapAnonymous => MmapMut::map_anon(bytes)
                .map(|map| HostBlock::mapped(map, None))
                .map_err(|source| BackendError::Mmap { path: "<anonymous>".into(), source }),
        }
    }

    fn allocate_spill(&mut self, bytes: usize, align: usize) -> Result<HostBlock, BackendError> {
        HostBlock::ram(bytes, align)
    }

    /// Host RAM only: a huge-page-aligned `MAP_NORESERVE` mapping of up to 256 MiB,
    /// advised to use transparent huge pages, so a first cycle of a few MiB takes a
    /// few page faults instead of one per 4 KiB page (past its first huge page when
    /// the first request is small, so that a cycle of a few KiB keeps 4 KiB pages).
    ///
    /// A first request larger than that cap, or than the machine's memory and swap
    /// together, gets no reservation: it is served (or refused, with an error) like any
    /// spill, so a request the machine cannot back fails as it would without learning.
    fn reserve(&mut self, at_least: usize, at_most: usize, align: usize) -> Option<HostBlock> {
        if !matches!(self, HostBackend::Ram) || at_least > RESERVATION_CAP || align > HUGE_PAGE {
            return None;
        }
        let bytes = at_most.min(RESERVATION_CAP).max(at_least);
        let reservation = Reservation::new(bytes, at_least >= HUGE_FIRST_REQUEST)?;
        let (ptr, len) = (reservation.start, reservation.len);
        Some(HostBlock { ptr, len, initialised: false, _owner: Owner::Reserved(reservation) })
    }

    /// Host RAM: writes zeros over the block, so that every page is mapped now (for a
    /// huge-page arena, every huge page). Maps are left alone.
    unsafe fn prefault(&mut self, block: &HostBlock) {
        if matches!(self, HostBackend::Ram) {
            // SAFETY: the block owns `len` writable bytes at `ptr`, and the caller
            // guarantees that nothing reads or writes them meanwhile.
            unsafe { block.ptr.as_ptr().write_bytes(0, block.len) };
        }
    }

    fn adopt(&mut self, block: HostBlock, bytes: usize) -> Result<HostBlock, HostBlock> {
        match block {
            HostBlock { ptr, len, initialised, _owner: Owner::Reserved(mut reservation) } if bytes <= len => {
                reservation.shrink_to(bytes);
                Ok(HostBlock { ptr, len: bytes, initialised, _owner: Owner::Reserved(reservation) })
            }
            block => Err(block),
        }
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
        let arena = backend.allocate_arena(3 * HUGE_PAGE, PAGE).unwrap();
        assert_eq!(arena.base().as_ptr() as usize % HUGE_PAGE, 0);
    }

    #[test]
    fn huge_requests_fail_without_panicking() {
        let mut backend = HostBackend::Ram;
        assert!(matches!(backend.allocate_spill(usize::MAX - 10, 64), Err(BackendError::OutOfMemory { .. })));
        assert!(matches!(backend.allocate_arena(isize::MAX as usize, PAGE), Err(BackendError::OutOfMemory { .. })));
    }

    /// Whether the page at `ptr` is mapped (`mincore` fails with ENOMEM when not).
    #[cfg(target_os = "linux")]
    fn mapped(ptr: *const u8) -> bool {
        let page = (ptr as usize) & !(PAGE - 1);
        let mut resident = 0u8;
        // SAFETY: mincore only reads the page tables for one page and writes one byte.
        unsafe { libc::mincore(page as *mut libc::c_void, PAGE, &mut resident) == 0 }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn reservations_are_aligned_and_shrink_to_what_they_become() {
        let mut backend = HostBackend::Ram;
        // Within the first huge page, the arena keeps whole 4 KiB pages.
        let block = backend.reserve(1, 8 << 20, PAGE).expect("a reservation");
        let base = block.base().as_ptr();
        assert_eq!((block.len(), base as usize % HUGE_PAGE), (8 << 20, 0));
        // SAFETY: both bytes lie inside the reservation.
        unsafe { base.add(5 << 20).write(7) };
        let arena = backend.adopt(block, 10_000).expect("a reservation can become the arena");
        assert_eq!((arena.base().as_ptr(), arena.len()), (base, 10_000));
        // SAFETY: inside the arena.
        unsafe { base.add(9_999).write(1) };
        assert!(mapped(base.wrapping_add(8192)) && !mapped(base.wrapping_add(12_288)));
        assert!(!mapped(base.wrapping_add(5 << 20)), "the tail is given back");
        drop(arena);
        assert!(!mapped(base), "dropping the arena unmaps it");

        // A large first request: huge pages from the start, so even a small arena
        // keeps its whole first huge page.
        let block = backend.reserve(HUGE_FIRST_REQUEST, 8 << 20, PAGE).expect("a reservation");
        let base = block.base().as_ptr();
        let arena = backend.adopt(block, 10_000).unwrap();
        assert_eq!(arena.len(), 10_000);
        assert!(mapped(base.wrapping_add(HUGE_PAGE - 1)) && !mapped(base.wrapping_add(HUGE_PAGE)));
        drop(arena);

        // Past the first huge page, it keeps whole huge pages (none is split).
        let block = backend.reserve(HUGE_PAGE + 1, usize::MAX, PAGE).expect("a reservation");
        assert_eq!(block.len(), RESERVATION_CAP);
        let base = block.base().as_ptr();
        let arena = backend.adopt(block, 3 << 20).unwrap();
        assert_eq!(arena.len(), 3 << 20);
        assert!(mapped(base.wrapping_add((4 << 20) - 1)) && !mapped(base.wrapping_add(4 << 20)));
        backend.release(arena);
    }

    #[test]
    fn only_reservations_are_adopted_and_only_when_large_enough() {
        let mut backend = HostBackend::Ram;
        let spill = backend.allocate_spill(4096, 64).unwrap();
        assert!(backend.adopt(spill, 100).is_err(), "a spill chunk is not a reservation");
        if let Some(block) = backend.reserve(1, 1 << 20, PAGE) {
            let len = block.len();
            let block = backend.adopt(block, len + 1).expect_err("larger than the reservation");
            assert_eq!(block.len(), len, "handed back unchanged");
        }
        // SAFETY: the file is never mapped (the directory does not exist).
        let file = unsafe { MappedFile::new("/nonexistent/x") };
        for mut other in [HostBackend::MmapAnonymous, HostBackend::MmapFile(file)] {
            assert!(other.reserve(1, 1 << 20, PAGE).is_none(), "memory maps have fixed arenas");
        }
    }

    #[test]
    fn unwritable_mmap_path_is_an_error() {
        // SAFETY: the file cannot be created, so nothing is mapped.
        let mut backend = HostBackend::MmapFile(unsafe { MappedFile::new("/proc/definitely/not/here.ws") });
        let err = backend.allocate_arena(4096, PAGE).unwrap_err();
        assert!(matches!(err, BackendError::Mmap { .. }));
        assert!(err.to_string().contains("/proc/definitely/not/here.ws"), "{err}");
    }
}
