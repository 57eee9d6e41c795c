//! One matrix multiply split across threads: C's columns (or, when C has more rows than
//! columns, its rows) cut into blocks of whole tiles, one block per thread, each computed by the same kernel with the same loop
//! nest, so every element is the same sum in the same order as on one thread (the same
//! bits). The helper threads are made once and wait at a gate between products; a
//! product allocates nothing (a helper's packing buffers grow to the largest product it
//! has seen, then stay).
//!
//! A network uses its pool for the products of its training steps
//! ([`Network::set_threads`](crate::nn::Network::set_threads)); the pool is found
//! through a thread-local handle (an `Arc`, so a handle that outlives its guard keeps
//! the pool alive rather than dangling), and a product too small to repay the hand-off
//! stays on the calling thread.

use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use crate::nn::sync::{panic_message, Gate};
use crate::{Error, Result};

use super::kernel::Kernel;
use super::{multiply, packed_sizes, Matrix, Operands, ALIGN_ELEMENTS};

/// Products smaller than this (2·m·n·k floating-point operations) stay on one thread:
/// the hand-off costs a few µs, a product of 8 MFLOP tens of µs.
const MIN_FLOPS: usize = 8 << 20;

/// One product as the threads share it.
#[derive(Clone, Copy)]
struct Job {
    kernel: Kernel,
    alpha: f32,
    beta: f32,
    ops: Operands,
    parts: usize,
    /// Cut C's rows rather than its columns: each thread then packs its own rows of A
    /// and all of B, where a column split would have every thread pack all of A (the
    /// larger operand when C is tall: `dy·Wᵀ`, `x·W` over many tokens).
    by_rows: bool,
}

// SAFETY: a job's pointers are dereferenced only between the start and done gates of
// its product, while the caller of `Shared::split` keeps the matrices borrowed (it
// returns only after the done gate) and each thread writes only its own part of C.
unsafe impl Send for Job {}

impl Job {
    /// The rows (or columns) of part `p`: cut at multiples of the kernel's tile height
    /// (or width).
    fn range(&self, p: usize) -> (usize, usize) {
        let (len, unit) = if self.by_rows { (self.ops.m, self.kernel.mr()) } else { (self.ops.n, self.kernel.nr()) };
        let tiles = len.div_ceil(unit);
        let cut = |p: usize| (tiles * p / self.parts * unit).min(len);
        (cut(p), cut(p + 1))
    }

    /// Part `p` of the product, or `None` when it is empty.
    fn part(&self, p: usize) -> Option<Operands> {
        let (start, end) = self.range(p);
        if start == end {
            return None;
        }
        let o = &self.ops;
        Some(if self.by_rows {
            // SAFETY: rows `start..end` lie inside A and C (`end <= m`).
            let (a_ptr, c_ptr) = unsafe {
                (o.a.ptr.offset(start as isize * o.a.row_stride), o.c.offset(start as isize * o.c_row_stride))
            };
            Operands { a: Matrix { ptr: a_ptr, ..o.a }, c: c_ptr, m: end - start, ..*o }
        } else {
            // SAFETY: columns `start..end` lie inside B and C (`end <= n`).
            let (b_ptr, c_ptr) = unsafe {
                (o.b.ptr.offset(start as isize * o.b.col_stride), o.c.offset(start as isize * o.c_col_stride))
            };
            Operands { b: Matrix { ptr: b_ptr, ..o.b }, c: c_ptr, n: end - start, ..*o }
        })
    }

    /// Multiplies part `p` with the packing buffers `scratch`.
    ///
    /// # Safety
    ///
    /// The job's matrices are live (A and B readable, C's part `p` writable by this
    /// thread alone) and `scratch` is at least `packed_sizes` long for the part (plus
    /// the alignment slack).
    unsafe fn run(&self, p: usize, scratch: &mut [MaybeUninit<f32>]) {
        let Some(ops) = self.part(p) else { return };
        let skip = scratch.as_ptr().align_offset(64).min(ALIGN_ELEMENTS);
        let (a_len, b_len) = packed_sizes(self.kernel, ops.m, ops.n, ops.k);
        let (a_buf, rest) = scratch[skip..].split_at_mut(a_len);
        let b_buf = &mut rest[..b_len];
        // SAFETY: `ops` describes the part of live matrices (the caller's promise), the
        // buffers have the sizes `packed_sizes` gives for it, the kernel came from
        // `Kernel::detect`.
        unsafe { multiply(self.kernel, self.alpha, self.beta, &ops, a_buf, b_buf, super::Triangle::Full) };
    }

    /// Packing buffers part `p` needs.
    fn scratch_len(&self, p: usize) -> usize {
        let (m, n) = self.part(p).map_or((1, 1), |o| (o.m, o.n));
        let (a, b) = packed_sizes(self.kernel, m, n, self.ops.k);
        a + b + ALIGN_ELEMENTS
    }
}

/// A range-split loop as the threads share it: `f(part, start, end)` for each thread's
/// range (part 0 is the caller's).
#[derive(Clone, Copy)]
struct Parts {
    f: *const (dyn Fn(usize, usize, usize) + Sync + 'static),
    len: usize,
    parts: usize,
    align: usize,
}

// SAFETY: `f` is called only between the start and done gates of its loop, while the
// caller of `for_parts` keeps it borrowed (it returns only after the done gate); it is
// `Sync`, so calls from several threads at once are allowed.
unsafe impl Send for Parts {}

impl Parts {
    /// The range of part `p`: cut at multiples of `align`.
    fn range(&self, p: usize) -> (usize, usize) {
        let blocks = self.len.div_ceil(self.align);
        let cut = |p: usize| (blocks * p / self.parts * self.align).min(self.len);
        (cut(p), cut(p + 1))
    }
}

/// What the helpers run.
#[derive(Clone, Copy)]
enum Task {
    Gemm(Job),
    Parts(Parts),
}

/// What a pool's threads share.
pub(crate) struct Shared {
    helpers: usize,
    start: Gate,
    /// Never broken: the caller passes it only once every helper has finished its part.
    done: Gate,
    /// Set while a caller uses the pool; another caller meanwhile multiplies alone.
    busy: AtomicBool,
    stop: AtomicBool,
    job: Mutex<Option<Task>>,
    /// A helper's panic message (the product then fails on the caller).
    failed: Mutex<Option<String>>,
}

/// Threads that split matrix multiplies: the caller and `helpers` more.
pub(crate) struct Pool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("threads", &(self.shared.helpers + 1)).finish()
    }
}

impl Pool {
    /// A pool of `threads` threads, the caller's included (`threads - 1` started).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for fewer than 2 threads or a thread that cannot start.
    pub(crate) fn new(threads: usize) -> Result<Pool> {
        if threads < 2 {
            return Err(Error::InvalidConfig {
                reason: format!("a pool of {threads} threads: a matrix multiply splits across 2 or more"),
            });
        }
        let helpers = threads - 1;
        let shared = Arc::new(Shared {
            helpers,
            start: Gate::new(threads),
            done: Gate::new(threads),
            busy: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            job: Mutex::new(None),
            failed: Mutex::new(None),
        });
        let mut pool = Pool { shared, threads: Vec::with_capacity(helpers) };
        for p in 1..threads {
            let shared = Arc::clone(&pool.shared);
            let spawned = std::thread::Builder::new().name(format!("carve-gemm-{p}")).spawn(move || helper(&shared, p));
            match spawned {
                Ok(handle) => pool.threads.push(handle),
                Err(e) => {
                    // The threads started wait at the start gate: dropping the pool stops them.
                    return Err(Error::InvalidConfig { reason: format!("starting matrix-multiply thread {p}: {e}") });
                }
            }
        }
        Ok(pool)
    }

    /// Threads, the caller's included.
    pub(crate) fn threads(&self) -> usize {
        self.shared.helpers + 1
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.start.break_all();
        for handle in self.threads.drain(..) {
            let _ = handle.join();
        }
    }
}

/// A helper thread: part `p` of each product, until the pool stops.
fn helper(shared: &Shared, p: usize) {
    let mut scratch: Vec<MaybeUninit<f32>> = Vec::new();
    loop {
        if !shared.start.wait() || shared.stop.load(Ordering::Acquire) {
            return;
        }
        let task = *shared.job.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(task) = task {
            let ran = catch_unwind(AssertUnwindSafe(|| match task {
                Task::Gemm(job) => {
                    let need = job.scratch_len(p);
                    if scratch.len() < need {
                        // The largest product so far: its buffers stay for the next ones.
                        // Reserved fallibly: a size the machine cannot give fails the
                        // product, never the process.
                        if let Err(e) = scratch.try_reserve_exact(need - scratch.len()) {
                            return Err(format!(
                                "a matrix multiply's packing buffer of {need} values cannot be allocated ({e})"
                            ));
                        }
                        scratch.resize(need, MaybeUninit::uninit());
                    }
                    // SAFETY: the caller keeps the job's matrices borrowed until the done
                    // gate, which this thread reaches only after this call; part `p` of C
                    // is this thread's alone; the buffer was just sized for the part.
                    unsafe { job.run(p, &mut scratch) };
                    Ok(())
                }
                Task::Parts(parts) => {
                    let (start, end) = parts.range(p);
                    if start < end {
                        // SAFETY: the caller keeps `f` borrowed until the done gate, which
                        // this thread reaches only after this call.
                        unsafe { (*parts.f)(p, start, end) };
                    }
                    Ok(())
                }
            }));
            let failure = match ran {
                Ok(Ok(())) => None,
                Ok(Err(message)) => Some(message),
                Err(panic) => Some(panic_message(panic)),
            };
            if let Some(message) = failure {
                *shared.failed.lock().unwrap_or_else(PoisonError::into_inner) = Some(message);
            }
        }
        shared.done.wait();
    }
}

impl Shared {
    /// Multiplies `ops` across the pool, part 0 on this thread with the buffers
    /// `a_buf`, `b_buf` (sized for the whole product). `false` when the pool is busy or
    /// stopped, or the product too small: then nothing was done.
    ///
    /// # Safety
    ///
    /// As [`multiply`]: `ops` describes live matrices (C exclusively borrowed by the
    /// caller) with `m, n, k > 0`, the buffers are at least as long as `packed_sizes`
    /// says for the whole product and `kernel`, which came from `Kernel::detect`.
    unsafe fn split(
        &self,
        kernel: Kernel,
        alpha: f32,
        beta: f32,
        ops: &Operands,
        a_buf: &mut [MaybeUninit<f32>],
        b_buf: &mut [MaybeUninit<f32>],
    ) -> bool {
        let parts = self.helpers + 1;
        let flops = 2usize.saturating_mul(ops.m).saturating_mul(ops.n).saturating_mul(ops.k);
        let by_rows = ops.m > ops.n;
        let enough = match by_rows {
            true => ops.m >= 2 * parts * kernel.mr(),
            false => ops.n >= 2 * parts * kernel.nr(),
        };
        if flops < MIN_FLOPS || !enough {
            return false;
        }
        if self.busy.swap(true, Ordering::AcqRel) {
            return false;
        }
        let job = Job { kernel, alpha, beta, ops: *ops, parts, by_rows };
        *self.job.lock().unwrap_or_else(PoisonError::into_inner) = Some(Task::Gemm(job));
        if !self.start.wait() {
            // Stopped: the helpers are gone.
            *self.job.lock().unwrap_or_else(PoisonError::into_inner) = None;
            self.busy.store(false, Ordering::Release);
            return false;
        }
        let mine = catch_unwind(AssertUnwindSafe(|| {
            if let Some(ops) = job.part(0) {
                // SAFETY: part 0 of live matrices (the caller's promise), this thread's
                // rows or columns alone; the whole product's buffers are at least the
                // part's.
                unsafe { multiply(kernel, alpha, beta, &ops, a_buf, b_buf, super::Triangle::Full) }
            }
        }));
        // Every helper has finished with the matrices once this returns.
        self.done.wait();
        *self.job.lock().unwrap_or_else(PoisonError::into_inner) = None;
        self.busy.store(false, Ordering::Release);
        if let Err(panic) = mine {
            resume_unwind(panic);
        }
        if let Some(message) = self.failed.lock().unwrap_or_else(PoisonError::into_inner).take() {
            panic!("a matrix-multiply thread failed: {message}");
        }
        true
    }
}

impl Shared {
    /// Runs `f(part, start, end)` over `len` elements cut into one range per thread (at
    /// multiples of `align`), part 0 on this thread. `false` when the pool is busy or
    /// stopped: then nothing was done.
    fn for_parts(&self, len: usize, align: usize, f: &(dyn Fn(usize, usize, usize) + Sync)) -> bool {
        if self.busy.swap(true, Ordering::AcqRel) {
            return false;
        }
        // SAFETY: erasing `f`'s lifetime: the helpers call it only between the start and
        // done gates below, and this function passes the done gate before it
        // returns (its own part's panic is caught until then), so `f` outlives every
        // call; the job is cleared before `f`'s borrow ends.
        let f: *const (dyn Fn(usize, usize, usize) + Sync + 'static) = unsafe {
            std::mem::transmute::<
                *const (dyn Fn(usize, usize, usize) + Sync + '_),
                *const (dyn Fn(usize, usize, usize) + Sync),
            >(f)
        };
        let parts = Parts { f, len, parts: self.helpers + 1, align: align.max(1) };
        *self.job.lock().unwrap_or_else(PoisonError::into_inner) = Some(Task::Parts(parts));
        if !self.start.wait() {
            *self.job.lock().unwrap_or_else(PoisonError::into_inner) = None;
            self.busy.store(false, Ordering::Release);
            return false;
        }
        let (start, end) = parts.range(0);
        // SAFETY: `f` is the caller's, alive for this call.
        let mine = catch_unwind(AssertUnwindSafe(|| unsafe { (*parts.f)(0, start, end) }));
        self.done.wait();
        *self.job.lock().unwrap_or_else(PoisonError::into_inner) = None;
        self.busy.store(false, Ordering::Release);
        if let Err(panic) = mine {
            resume_unwind(panic);
        }
        if let Some(message) = self.failed.lock().unwrap_or_else(PoisonError::into_inner).take() {
            panic!("a pool thread panicked: {message}");
        }
        true
    }
}

/// Runs `f(start, end)` over `len` elements cut into one range per thread of this
/// thread's pool (at multiples of `align`), when there is a pool and `len` is at least
/// `min_len`; `false` when it was not done (then the caller runs `f(0, len)` itself).
/// Every range is given to one thread, so `f` may write the elements of its range.
pub(crate) fn for_parts(len: usize, min_len: usize, align: usize, f: &(dyn Fn(usize, usize) + Sync)) -> bool {
    for_each_part(len, min_len, align, &|_, start, end| f(start, end))
}

/// [`for_parts`] telling `f` which part it runs: `f(part, start, end)`, part 0 on this
/// thread, part `p ≥ 1` always on the pool's helper thread `p` (so a part may keep
/// working buffers of its thread between loops).
pub(crate) fn for_each_part(
    len: usize,
    min_len: usize,
    align: usize,
    f: &(dyn Fn(usize, usize, usize) + Sync),
) -> bool {
    if len < min_len.max(1) {
        return false;
    }
    let Some(shared) = CURRENT.with(|current| current.borrow().clone()) else {
        return false;
    };
    shared.for_parts(len, align, f)
}

thread_local! {
    /// The pool this thread's matrix multiplies split across, while a network that has
    /// one trains here.
    static CURRENT: RefCell<Option<Arc<Shared>>> = const { RefCell::new(None) };
}

/// The pool in use on this thread until this drops (then the previous one again).
pub(crate) struct InUse(Option<Arc<Shared>>);

/// Makes `pool` (or none) the one this thread's matrix multiplies split across.
pub(crate) fn use_pool(pool: Option<&Pool>) -> InUse {
    CURRENT.with(|current| InUse(current.replace(pool.map(|p| Arc::clone(&p.shared)))))
}

impl Drop for InUse {
    fn drop(&mut self) {
        let previous = self.0.take();
        CURRENT.with(|current| *current.borrow_mut() = previous);
    }
}

/// Whether this thread has a pool to split work across (one that may still be busy or
/// stopped: `for_parts` then runs nothing and says so).
pub(crate) fn has_pool() -> bool {
    CURRENT.with(|current| current.borrow().as_ref().is_some_and(|shared| shared.helpers > 0))
}

/// Multiplies `ops` across this thread's pool when there is one and the product is
/// large enough; `false` when it was not done.
///
/// # Safety
///
/// As [`Shared::split`].
pub(super) unsafe fn split(
    kernel: Kernel,
    alpha: f32,
    beta: f32,
    ops: &Operands,
    a_buf: &mut [MaybeUninit<f32>],
    b_buf: &mut [MaybeUninit<f32>],
) -> bool {
    let Some(shared) = CURRENT.with(|current| current.borrow().clone()) else {
        return false;
    };
    // SAFETY: the caller's promise.
    unsafe { shared.split(kernel, alpha, beta, ops, a_buf, b_buf) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::gemm::{scratch_len, sgemm};
    use ndarray::Array2;

    fn matrix(r: usize, c: usize, seed: usize) -> Array2<f32> {
        Array2::from_shape_fn((r, c), |(i, j)| (((i * 37 + j * 11 + seed * 7) % 101) as f32 / 101.0) - 0.5)
    }

    #[test]
    fn a_split_product_is_the_same_bits_as_one_thread() {
        // (m, n, k), transposed A or B, beta: each at least MIN_FLOPS, n not a multiple
        // of the tile width in some.
        // Taller than wide (split by rows) in the last two, m not a multiple of the tile
        // height in one.
        let cases = [
            (64, 256, 256, false, false, 0.0),
            (48, 333, 300, true, false, 1.0),
            (40, 517, 210, false, true, 0.5),
            (769, 128, 96, false, true, 0.0),
            (500, 77, 260, true, false, 1.0),
        ];
        for threads in [2, 3] {
            let pool = Pool::new(threads).unwrap();
            for &(m, n, k, ta, tb, beta) in &cases {
                let a = if ta { matrix(k, m, 1) } else { matrix(m, k, 1) };
                let b = if tb { matrix(n, k, 2) } else { matrix(k, n, 2) };
                let (a, b) = (if ta { a.t() } else { a.view() }, if tb { b.t() } else { b.view() });
                let mut scratch = vec![MaybeUninit::uninit(); scratch_len(m, n, k)];
                let mut one = matrix(m, n, 3);
                sgemm(0.75, a, b, beta, one.view_mut(), &mut scratch).unwrap();
                let mut split = matrix(m, n, 3);
                {
                    let _in_use = use_pool(Some(&pool));
                    sgemm(0.75, a, b, beta, split.view_mut(), &mut scratch).unwrap();
                }
                let same = one.iter().zip(split.iter()).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{threads} threads, {m}×{n}×{k}, transposed {ta}/{tb}, beta {beta}");
            }
            assert_eq!(pool.threads(), threads);
        }
        // Out of the guard, no pool; a pool that stopped is not used.
        assert!(CURRENT.with(|c| c.borrow().is_none()));
        let pool = Pool::new(2).unwrap();
        let forgotten = use_pool(Some(&pool));
        std::mem::forget(forgotten);
        drop(pool); // the thread-local handle keeps the shared state, not the threads
        let (a, b) = (matrix(64, 256, 1), matrix(256, 256, 2));
        let mut scratch = vec![MaybeUninit::uninit(); scratch_len(64, 256, 256)];
        let (mut one, mut again) = (Array2::zeros((64, 256)), Array2::zeros((64, 256)));
        sgemm(1.0, a.view(), b.view(), 0.0, one.view_mut(), &mut scratch).unwrap();
        let _none = use_pool(None);
        sgemm(1.0, a.view(), b.view(), 0.0, again.view_mut(), &mut scratch).unwrap();
        assert_eq!(one, again);
        assert!(Pool::new(1).is_err());
    }
}
