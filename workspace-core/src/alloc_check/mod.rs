//! Proving a step allocation-free: a counting global allocator and a guard that reports
//! the heap allocations made while it is alive.
//!
//! A workspace step makes no heap allocation once its workspaces have learned their
//! size, as long as every array of the step comes from a workspace scope. One ndarray
//! method that returns an owned array (`&a + &b`, `a.dot(&b)`, `a.sum_axis(..)`,
//! `a.mapv(..)`, `a.to_owned()`) in a custom layer quietly costs a heap allocation per
//! step. This module lets a program prove its step allocation-free, in a test or in a
//! debugging build:
//!
//! 1. install [`CountingAllocator`] as the binary's global allocator (a test file, an
//!    example or `main.rs`: each is its own binary);
//! 2. wrap the step in an [`AllocationGuard`] (or [`assert_no_alloc`]), which counts
//!    the heap allocations the *calling thread* makes while it is alive;
//! 3. [`AllocationReport::check`] gives an [`Error::AllocationCheck`](crate::Error)
//!    saying how many allocations, how many bytes, the size of the first few and what
//!    to do instead; [`AllocationReport::assert_none`] panics with that message.
//!
//! ```
//! use workspace_core::{Workspace, WorkspaceConfig};
//! use workspace_core::alloc_check::{AllocationGuard, CountingAllocator};
//!
//! #[global_allocator]
//! static ALLOC: CountingAllocator = CountingAllocator::system();
//!
//! fn step(ws: &Workspace, a: &ndarray::Array1<f32>) -> workspace_core::Result<f32> {
//!     let scope = ws.enter()?;
//!     let mut sum = scope.zeros::<f32, _>(a.len())?; // from the workspace
//!     sum.assign(a);
//!     sum += a; // in place: no new array
//!     Ok(sum.sum())
//! }
//!
//! fn main() -> workspace_core::Result<()> {
//!     let ws = Workspace::new("STEP", WorkspaceConfig::default())?;
//!     let a = ndarray::Array1::<f32>::ones(1024);
//!     step(&ws, &a)?; // the first cycle sizes the workspace
//!
//!     let guard = AllocationGuard::begin()?;
//!     let total = step(&ws, &a)?;
//!     guard.finish().check()?; // no heap allocation
//!     assert_eq!(total, 2048.0);
//!
//!     // The same sum as an owned array costs a heap allocation of 4 KiB:
//!     let guard = AllocationGuard::begin()?;
//!     let owned = &a + &a;
//!     let report = guard.finish();
//!     assert_eq!((report.allocations(), report.bytes()), (1, 4096));
//!     let err = report.check().unwrap_err();
//!     assert!(err.to_string().contains("1 heap allocation (4096 bytes)"), "{err}");
//!     assert_eq!(owned.sum(), total);
//!
//!     // Or, for a closure: panics with the same message if it allocates.
//!     let total = workspace_core::alloc_check::assert_no_alloc(|| step(&ws, &a))?;
//!     assert_eq!(total, 2048.0);
//!     Ok(())
//! }
//! ```
//!
//! Without the allocator installed nothing could be counted, so
//! [`AllocationGuard::begin`] refuses with [`AllocationError::NotInstalled`] (which
//! shows the line to add) instead of reporting a count of zero.
//!
//! # What is counted
//!
//! - **Per thread** (what a guard reports): allocation calls (`alloc`, `alloc_zeroed`,
//!   `realloc`) and the bytes they asked for (the new size, for a `realloc`). Other
//!   threads' allocations are not the guard's: a data loader or a thread pool working
//!   during the step is not counted, and a check of their work belongs on their
//!   thread, or to [`process_counts`]. [`thread_counts`] also gives the thread's live
//!   bytes (what it allocated minus what it freed) and their peak, which
//!   [`reset_thread_peak`] restarts: the peak heap memory of one step.
//! - **Process-wide** ([`process_counts`]): allocation calls, bytes and live bytes
//!   (allocated and not yet freed) over every thread, or over every thread but the
//!   process's main thread ([`Threads::ExceptMain`]). Leaving the main thread out is
//!   what a test of live memory needs: libtest's main thread starts each test on a
//!   thread of its own and then allocates while the test runs (it records the running
//!   tests, notes one running for over 60 s), so process-wide live bytes drift with it.
//!   The main thread is told apart on Linux; elsewhere `ExceptMain` counts every thread.
//!
//! # Where an allocation was made
//!
//! An allocator is not told who called it, so its caller's location has a price: a
//! walk of the stack. What this module records, and what it costs:
//!
//! - **Always**, while a guard is alive: the size, alignment and kind of the first
//!   [`SAMPLES`] allocations, in a fixed array in the thread's state (no allocation;
//!   [`AllocationReport::samples`]). Sizes usually point to the array: 4096 bytes is a
//!   1024-element `f32` array.
//! - **The check's own location** ([`AllocationReport::location`]): where the guard was
//!   begun, from `#[track_caller]`, free.
//! - **Opt-in**, [`AllocationGuard::begin_traced`]: the return addresses of the stack of
//!   the first allocation the guard sees (up to [`TRACE_FRAMES`], Linux with glibc),
//!   walked by glibc's `backtrace`, which does not allocate once loaded (`begin_traced`
//!   loads it, outside the allocator) and takes no lock but, with older unwinders, the
//!   loader's, which is recursive (a thread allocating while it holds it takes it
//!   again). The report prints each frame as its object file and offset, with the
//!   `addr2line` command that names the functions and lines. Symbolising inside the
//!   allocator is what it cannot do: `std::backtrace` allocates and takes std's
//!   backtrace lock, which this thread may already hold (a panic being reported, an
//!   error capturing its backtrace), so it could deadlock.
//! - **Under a debugger**, any platform: the first allocation a guard sees calls
//!   `workspace_core::alloc_check::first_allocation_in_guard`, which is never inlined;
//!   a breakpoint on it stops there with the whole, symbolised stack: `gdb -ex 'break
//!   workspace_core::alloc_check::first_allocation_in_guard' -ex run -ex bt --args
//!   <test binary> <test name>`.
//!
//! # Cost and soundness
//!
//! The allocator forwards every call to the inner allocator unchanged, and then updates
//! const-initialised thread-locals without destructors and three relaxed atomics (one
//! for a free): it never allocates, locks or panics (a traced guard's first allocation
//! also walks the stack, as above). It is meant for tests and debugging
//! builds; the atomics are shared by every thread, a cost a release build need not pay.
//! The counters are the module's, not the allocator instance's: a process has one global
//! allocator, and a `CountingAllocator` used any other way counts into them too.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;
use std::panic::Location;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

use crate::error::{Error, Result};

pub(crate) mod failure;
mod stack;

pub use failure::{AllocationError, AllocationKind, AllocationSample};

/// How many allocations a guard describes one by one ([`AllocationReport::samples`]).
pub const SAMPLES: usize = 8;

/// The most stack frames [`AllocationGuard::begin_traced`] keeps of the first allocation.
pub const TRACE_FRAMES: usize = 32;

// ---- the allocator ---------------------------------------------------------------------

/// A global allocator that counts heap allocations, per thread and process-wide, and
/// otherwise forwards every call to the allocator it wraps (by default
/// [`std::alloc::System`]).
///
/// Install it in the binary whose allocations are to be checked:
///
/// ```
/// #[global_allocator]
/// static ALLOC: workspace_core::alloc_check::CountingAllocator = workspace_core::alloc_check::CountingAllocator::system();
/// # fn main() { assert!(workspace_core::alloc_check::is_installed()); }
/// ```
///
/// or around another allocator (any [`GlobalAlloc`] with a `const` constructor):
/// `CountingAllocator::new(MyAlloc::new())`. The counts are read with
/// [`AllocationGuard`], [`thread_counts`] and [`process_counts`].
#[derive(Debug, Default)]
pub struct CountingAllocator<A = System> {
    inner: A,
}

impl CountingAllocator<System> {
    /// Counts, and forwards to [`std::alloc::System`].
    pub const fn system() -> Self {
        CountingAllocator { inner: System }
    }
}

impl<A> CountingAllocator<A> {
    /// Counts, and forwards to `inner`.
    pub const fn new(inner: A) -> Self {
        CountingAllocator { inner }
    }

    /// The allocator it forwards to.
    pub const fn inner(&self) -> &A {
        &self.inner
    }
}

// SAFETY: every method forwards to `self.inner` with the arguments it was given and
// returns what the inner allocator returned, so the inner allocator's implementation of
// the `GlobalAlloc` contract is ours. The bookkeeping around each call touches only
// atomics and const-initialised thread-locals without destructors (never registered,
// never torn down), and glibc's `backtrace` into a stack buffer (loaded beforehand):
// it does not allocate or unwind, and takes no lock the allocating thread may hold.
unsafe impl<A: GlobalAlloc> GlobalAlloc for CountingAllocator<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: our caller keeps `alloc`'s contract (a layout of non-zero size), which
        // is the inner allocator's.
        let ptr = unsafe { self.inner.alloc(layout) };
        if !ptr.is_null() {
            allocated(AllocationKind::Alloc, layout.size(), layout.align(), size_delta(0, layout.size()));
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let ptr = unsafe { self.inner.alloc_zeroed(layout) };
        if !ptr.is_null() {
            allocated(AllocationKind::AllocZeroed, layout.size(), layout.align(), size_delta(0, layout.size()));
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: our caller keeps `dealloc`'s contract: `ptr` came from this allocator,
        // that is from the inner one, with `layout`.
        unsafe { self.inner.dealloc(ptr, layout) };
        freed(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: our caller keeps `realloc`'s contract: `ptr` came from this allocator,
        // that is from the inner one, with `layout`, and `new_size` is valid for it.
        let new = unsafe { self.inner.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            allocated(AllocationKind::Realloc, new_size, layout.align(), size_delta(layout.size(), new_size));
        }
        new
    }
}

/// `to - from` as a signed count of bytes (sizes are at most `isize::MAX`).
fn size_delta(from: usize, to: usize) -> i64 {
    to as i64 - from as i64
}

// ---- counters --------------------------------------------------------------------------

/// Process-wide counters of one group of threads.
struct Totals {
    allocations: AtomicU64,
    bytes: AtomicU64,
    live: AtomicI64,
}

impl Totals {
    const fn new() -> Self {
        Totals { allocations: AtomicU64::new(0), bytes: AtomicU64::new(0), live: AtomicI64::new(0) }
    }
}

/// The main thread's allocations, and every other thread's.
static MAIN: Totals = Totals::new();
static OTHERS: Totals = Totals::new();

/// Set once an allocation through the global allocator was seen counted.
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// One allocation a guard saw.
#[derive(Clone, Copy)]
struct Slot {
    /// The thread's allocation number (its count before this allocation).
    seq: u64,
    sample: AllocationSample,
}

/// The stack of the first allocation of a traced guard.
#[derive(Clone, Copy)]
struct Frames {
    /// The thread's allocation number it belongs to.
    seq: u64,
    len: usize,
    addrs: [usize; TRACE_FRAMES],
}

/// What a thread counts. Every field is a `Cell` of plain data: no destructor, so the
/// thread-local is const-initialised, never registered and never torn down, and the
/// allocator may touch it at any time, during the thread's exit included.
struct ThreadState {
    allocations: Cell<u64>,
    bytes: Cell<u64>,
    /// Bytes this thread allocated minus those it freed, and their highest value since
    /// the thread started or [`reset_thread_peak`].
    live: Cell<i64>,
    peak: Cell<i64>,
    /// Whether this is the main thread: unknown until its first allocation.
    main: Cell<Option<bool>>,
    /// The allocation number of the first allocation the innermost live guard sees.
    window: Cell<Option<u64>>,
    /// Whether the innermost live guard wants the stack of its first allocation.
    trace: Cell<bool>,
    /// The first [`SAMPLES`] allocations after `window`, slot `i` for number `window + i`.
    samples: [Cell<Option<Slot>>; SAMPLES],
    frames: Cell<Option<Frames>>,
    /// Set while the stack is walked, so that nothing the walk might allocate is traced.
    busy: Cell<bool>,
}

impl ThreadState {
    const fn new() -> ThreadState {
        ThreadState {
            allocations: Cell::new(0),
            bytes: Cell::new(0),
            live: Cell::new(0),
            peak: Cell::new(0),
            main: Cell::new(None),
            window: Cell::new(None),
            trace: Cell::new(false),
            samples: [const { Cell::new(None) }; SAMPLES],
            frames: Cell::new(None),
            busy: Cell::new(false),
        }
    }

    fn is_main(&self) -> bool {
        match self.main.get() {
            Some(main) => main,
            None => {
                let main = is_main_thread();
                self.main.set(Some(main));
                main
            }
        }
    }
}

// The allocator relies on this: a thread-local without drop glue has no destructor.
const _: () = assert!(!std::mem::needs_drop::<ThreadState>());

thread_local! {
    static STATE: ThreadState = const { ThreadState::new() };
}

/// Whether the calling thread is the process's main thread. Never allocates.
#[cfg(target_os = "linux")]
fn is_main_thread() -> bool {
    // SAFETY: `gettid` takes nothing, cannot fail and touches no memory of ours.
    let tid = unsafe { libc::gettid() };
    tid as u32 == std::process::id() // the main thread's id is the process's
}

#[cfg(not(target_os = "linux"))]
fn is_main_thread() -> bool {
    false
}

/// Counts an allocation that succeeded. Never allocates, locks or panics.
fn allocated(kind: AllocationKind, size: usize, align: usize, live_delta: i64) {
    let main = STATE
        .try_with(|state| {
            let seq = state.allocations.get();
            state.allocations.set(seq.wrapping_add(1));
            state.bytes.set(state.bytes.get().wrapping_add(size as u64));
            let live = state.live.get().wrapping_add(live_delta);
            state.live.set(live);
            state.peak.set(state.peak.get().max(live));
            if let Some(first) = state.window.get() {
                let offset = seq.wrapping_sub(first);
                if offset < SAMPLES as u64 {
                    let sample = AllocationSample { size, align, kind };
                    state.samples[offset as usize].set(Some(Slot { seq, sample }));
                    if offset == 0 {
                        first_allocation_in_guard(state, seq);
                    }
                }
            }
            state.is_main()
        })
        .unwrap_or(false);
    let totals = if main { &MAIN } else { &OTHERS };
    totals.allocations.fetch_add(1, Ordering::Relaxed);
    totals.bytes.fetch_add(size as u64, Ordering::Relaxed);
    totals.live.fetch_add(live_delta, Ordering::Relaxed);
}

/// Counts a free. Never allocates, locks or panics.
fn freed(size: usize) {
    let main = STATE
        .try_with(|state| {
            state.live.set(state.live.get().wrapping_sub(size as i64));
            state.is_main()
        })
        .unwrap_or(false);
    let totals = if main { &MAIN } else { &OTHERS };
    totals.live.fetch_sub(size as i64, Ordering::Relaxed);
}

/// Called by the allocator for the first allocation a guard sees: a place for a
/// debugger's breakpoint (`break workspace_core::alloc_check::first_allocation_in_guard`),
/// and where a traced guard's stack is walked. Never allocates or panics.
#[inline(never)]
fn first_allocation_in_guard(state: &ThreadState, seq: u64) {
    if state.trace.get() && !state.busy.get() {
        state.busy.set(true);
        let mut addrs = [0_usize; TRACE_FRAMES];
        let len = stack::walk(&mut addrs);
        state.frames.set(Some(Frames { seq, len, addrs }));
        state.busy.set(false);
    }
    std::hint::black_box(seq);
}

// ---- reading the counters ----------------------------------------------------------------

/// Heap allocation calls and the bytes they asked for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AllocationCounts {
    /// Calls to `alloc`, `alloc_zeroed` and `realloc` that succeeded.
    pub allocations: u64,
    /// The bytes they asked for (a `realloc`'s new size).
    pub bytes: u64,
}

/// One thread's heap use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ThreadCounts {
    /// Calls to `alloc`, `alloc_zeroed` and `realloc` that succeeded.
    pub allocations: u64,
    /// The bytes they asked for (a `realloc`'s new size).
    pub bytes: u64,
    /// Bytes the thread allocated minus those it freed. Memory that one thread
    /// allocates and another frees makes the first's go up and the other's down, so
    /// differences over a stretch of one thread's work are what mean something.
    pub live_bytes: i64,
    /// The highest `live_bytes` since the thread started or [`reset_thread_peak`].
    pub peak_live_bytes: i64,
}

impl ThreadCounts {
    /// The allocations and bytes alone.
    pub fn allocation_counts(&self) -> AllocationCounts {
        AllocationCounts { allocations: self.allocations, bytes: self.bytes }
    }
}

/// What the calling thread has allocated since it started (zero unless
/// [`CountingAllocator`] is the global allocator: see [`is_installed`]).
pub fn thread_counts() -> ThreadCounts {
    STATE
        .try_with(|state| ThreadCounts {
            allocations: state.allocations.get(),
            bytes: state.bytes.get(),
            live_bytes: state.live.get(),
            peak_live_bytes: state.peak.get(),
        })
        .unwrap_or_default()
}

/// Restarts the calling thread's peak of live bytes from its live bytes now (to measure
/// the peak of a stretch of work), and returns its counts, the peak so reset.
pub fn reset_thread_peak() -> ThreadCounts {
    let _ = STATE.try_with(|state| state.peak.set(state.live.get()));
    thread_counts()
}

/// Which threads [`process_counts`] covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Threads {
    /// Every thread of the process.
    All,
    /// Every thread but the process's main thread: the code under test in a libtest
    /// binary, whose main thread is the harness's (Linux; elsewhere every thread).
    ExceptMain,
}

/// Process-wide heap use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProcessCounts {
    /// Calls to `alloc`, `alloc_zeroed` and `realloc` that succeeded.
    pub allocations: u64,
    /// The bytes they asked for (a `realloc`'s new size).
    pub bytes: u64,
    /// Bytes allocated and not yet freed. With [`Threads::ExceptMain`]: allocated by the
    /// other threads minus freed by them (memory that the main thread frees for them
    /// stays counted).
    pub live_bytes: i64,
}

/// Heap use over `threads` since the process started (zero unless [`CountingAllocator`]
/// is the global allocator: see [`is_installed`]).
pub fn process_counts(threads: Threads) -> ProcessCounts {
    let read = |totals: &Totals| ProcessCounts {
        allocations: totals.allocations.load(Ordering::Relaxed),
        bytes: totals.bytes.load(Ordering::Relaxed),
        live_bytes: totals.live.load(Ordering::Relaxed),
    };
    let others = read(&OTHERS);
    match threads {
        Threads::ExceptMain => others,
        Threads::All => {
            let main = read(&MAIN);
            ProcessCounts {
                allocations: others.allocations.wrapping_add(main.allocations),
                bytes: others.bytes.wrapping_add(main.bytes),
                live_bytes: others.live_bytes.wrapping_add(main.live_bytes),
            }
        }
    }
}

/// Whether [`CountingAllocator`] is the global allocator: the first call checks that an
/// allocation through the global allocator is counted (one allocation of 8 bytes), and
/// the answer is kept once it is yes.
pub fn is_installed() -> bool {
    if INSTALLED.load(Ordering::Relaxed) {
        return true;
    }
    let before = thread_counts().allocations;
    drop(std::hint::black_box(Box::new(0_u64)));
    let counted = thread_counts().allocations != before;
    if counted {
        INSTALLED.store(true, Ordering::Relaxed);
    }
    counted
}

// ---- the guard -----------------------------------------------------------------------------

/// Counts the heap allocations the calling thread makes while it is alive.
///
/// [`begin`](Self::begin) it, run the code to check, and [`finish`](Self::finish) it
/// for an [`AllocationReport`]. Guards nest (each reports what was made while it was
/// alive); a guard is bound to the thread that began it. Dropping it without `finish`
/// reports nothing; forgetting it only leaves the thread describing allocations that
/// no report will show.
///
/// ```
/// use workspace_core::alloc_check::{AllocationGuard, CountingAllocator};
///
/// #[global_allocator]
/// static ALLOC: CountingAllocator = CountingAllocator::system();
///
/// fn main() -> workspace_core::Result<()> {
///     let guard = AllocationGuard::begin()?;
///     let v: Vec<u64> = Vec::with_capacity(100);
///     let report = guard.finish();
///     assert_eq!((report.allocations(), report.bytes()), (1, 800));
///     assert_eq!(report.samples()[0].size, 800);
///     drop(v);
///     Ok(())
/// }
/// ```
#[derive(Debug)]
#[must_use = "a guard counts until it is finished: `guard.finish().check()?`"]
pub struct AllocationGuard {
    start: AllocationCounts,
    location: &'static Location<'static>,
    traced: bool,
    /// The enclosing guard's window and trace wish, restored when this one ends.
    outer_window: Option<u64>,
    outer_trace: bool,
    /// The thread's state is the guard's: not `Send`.
    _thread: PhantomData<*const ()>,
}

impl AllocationGuard {
    /// Starts counting the calling thread's heap allocations.
    ///
    /// # Errors
    ///
    /// [`AllocationError::NotInstalled`] when [`CountingAllocator`] is not the global
    /// allocator (nothing would be counted).
    #[track_caller]
    pub fn begin() -> Result<Self> {
        Self::start(Location::caller(), false)
    }

    /// Starts counting, as [`begin`](Self::begin), and also keeps the stack of the first
    /// allocation ([`AllocationReport::trace`]), where the platform can walk it without
    /// allocating (Linux with glibc; elsewhere the report says it has none).
    ///
    /// # Errors
    ///
    /// As [`begin`](Self::begin).
    #[track_caller]
    pub fn begin_traced() -> Result<Self> {
        Self::start(Location::caller(), true)
    }

    fn start(location: &'static Location<'static>, traced: bool) -> Result<Self> {
        if !is_installed() {
            return Err(Error::AllocationCheck(AllocationError::NotInstalled { location: location.to_string() }));
        }
        if traced {
            stack::load_walker();
        }
        let start = thread_counts().allocation_counts();
        let (outer_window, outer_trace) = STATE.with(|state| {
            let outer = (state.window.replace(Some(start.allocations)), state.trace.replace(traced));
            state.frames.set(None);
            outer
        });
        Ok(AllocationGuard { start, location, traced, outer_window, outer_trace, _thread: PhantomData })
    }

    /// The allocations so far.
    pub fn counts(&self) -> AllocationCounts {
        let now = thread_counts();
        AllocationCounts {
            allocations: now.allocations.wrapping_sub(self.start.allocations),
            bytes: now.bytes.wrapping_sub(self.start.bytes),
        }
    }

    /// Stops counting and reports. Makes no allocation itself.
    pub fn finish(self) -> AllocationReport {
        let counts = self.counts();
        let first = self.start.allocations;
        let mut samples = [AllocationSample::NONE; SAMPLES];
        let mut len = 0;
        let mut trace = None;
        STATE.with(|state| {
            // Slots overwritten by a nested guard no longer hold this guard's numbers:
            // the samples stop at the first one that does not.
            let wanted = counts.allocations.min(SAMPLES as u64) as usize;
            for (i, (out, slot)) in samples.iter_mut().zip(&state.samples).take(wanted).enumerate() {
                match slot.get() {
                    Some(slot) if slot.seq == first.wrapping_add(i as u64) => {
                        *out = slot.sample;
                        len = i + 1;
                    }
                    _ => break,
                }
            }
            if self.traced && counts.allocations > 0 {
                trace = state.frames.get().filter(|frames| frames.seq == first);
            }
        });
        AllocationReport { counts, location: self.location, samples, len, traced: self.traced, trace }
    }
}

impl Drop for AllocationGuard {
    fn drop(&mut self) {
        let _ = STATE.try_with(|state| {
            state.window.set(self.outer_window);
            state.trace.set(self.outer_trace);
        });
    }
}

/// What an [`AllocationGuard`] saw: how many heap allocations the thread made while it
/// was alive, their bytes, the first few, and where the check was.
#[derive(Clone)]
pub struct AllocationReport {
    counts: AllocationCounts,
    location: &'static Location<'static>,
    samples: [AllocationSample; SAMPLES],
    /// How many of `samples` are this report's.
    len: usize,
    traced: bool,
    trace: Option<Frames>,
}

impl AllocationReport {
    /// The heap allocations (`alloc`, `alloc_zeroed` and `realloc` calls) made.
    pub fn allocations(&self) -> u64 {
        self.counts.allocations
    }

    /// The bytes they asked for.
    pub fn bytes(&self) -> u64 {
        self.counts.bytes
    }

    /// Whether no heap allocation was made.
    pub fn is_none(&self) -> bool {
        self.counts.allocations == 0
    }

    /// Where the guard was begun.
    pub fn location(&self) -> &'static Location<'static> {
        self.location
    }

    /// The first allocations, in order (at most [`SAMPLES`]; fewer where a nested guard
    /// described its own in their place).
    pub fn samples(&self) -> &[AllocationSample] {
        &self.samples[..self.len]
    }

    /// The return addresses of the stack of the first allocation, innermost first (the
    /// allocator's own frames first), for a guard begun with
    /// [`AllocationGuard::begin_traced`] that saw an allocation, on a platform that can
    /// walk the stack without allocating. `Display` prints them as object files and
    /// offsets for `addr2line`.
    pub fn trace(&self) -> Option<&[usize]> {
        self.trace.as_ref().filter(|frames| frames.len > 0).map(|frames| &frames.addrs[..frames.len])
    }

    /// `Ok` if no heap allocation was made.
    ///
    /// # Errors
    ///
    /// [`AllocationError::HeapAllocation`], saying how many allocations, how many
    /// bytes, the first ones and what to do instead.
    pub fn check(&self) -> Result<()> {
        if self.is_none() {
            return Ok(());
        }
        Err(Error::AllocationCheck(AllocationError::HeapAllocation {
            allocations: self.counts.allocations,
            bytes: self.counts.bytes,
            location: self.location.to_string(),
            first: self.samples().to_vec(),
            trace: self.trace_lines(),
        }))
    }

    /// Panics, with [`check`](Self::check)'s message, if a heap allocation was made.
    #[track_caller]
    pub fn assert_none(&self) {
        if let Err(error) = self.check() {
            panic!("{error}");
        }
    }

    /// The trace as lines for a message: nothing for an untraced guard.
    fn trace_lines(&self) -> Option<Vec<String>> {
        if !self.traced || self.is_none() {
            return None;
        }
        Some(self.trace().map(stack::resolve).unwrap_or_default())
    }
}

impl fmt::Debug for AllocationReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AllocationReport")
            .field("allocations", &self.counts.allocations)
            .field("bytes", &self.counts.bytes)
            .field("location", &format_args!("{}", self.location))
            .field("samples", &self.samples())
            .field("trace", &self.trace())
            .finish()
    }
}

/// "no heap allocation …" or the message of [`check`](AllocationReport::check)'s error.
impl fmt::Display for AllocationReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.check() {
            Ok(()) => write!(f, "no heap allocation on this thread in the check begun at {}", self.location),
            Err(error) => write!(f, "{error}"),
        }
    }
}

/// Runs `f` and panics if the calling thread made a heap allocation meanwhile (with the
/// message of [`AllocationReport::check`]), or if [`CountingAllocator`] is not the
/// global allocator. Returns what `f` returned.
///
/// ```
/// #[global_allocator]
/// static ALLOC: workspace_core::alloc_check::CountingAllocator = workspace_core::alloc_check::CountingAllocator::system();
///
/// # fn main() {
/// let mut buffer = [0_u32; 64];
/// let total = workspace_core::alloc_check::assert_no_alloc(|| {
///     buffer.iter_mut().enumerate().for_each(|(i, x)| *x = i as u32);
///     buffer.iter().sum::<u32>()
/// });
/// assert_eq!(total, 2016);
/// # }
/// ```
///
/// ```should_panic
/// #[global_allocator]
/// static ALLOC: workspace_core::alloc_check::CountingAllocator = workspace_core::alloc_check::CountingAllocator::system();
///
/// # fn main() {
/// workspace_core::alloc_check::assert_no_alloc(|| vec![1.0_f32; 64]); // panics: 1 heap allocation (256 bytes)
/// # }
/// ```
#[track_caller]
pub fn assert_no_alloc<R>(f: impl FnOnce() -> R) -> R {
    let guard = match AllocationGuard::begin() {
        Ok(guard) => guard,
        Err(error) => panic!("{error}"),
    };
    let value = f();
    guard.finish().assert_none();
    value
}
