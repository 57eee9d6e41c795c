//! Single-precision matrix multiply whose packing buffers come from the caller.
//!
//! `carve::ndarray::linalg::general_mat_mul` (the `matrixmultiply` crate) and `gemm` allocate
//! their packing buffers on every call; a training step that must make no heap
//! allocation cannot use them. [`sgemm`] takes the buffers as a slice instead — the
//! reference network carves it from layer working memory — and [`scratch_len`] says
//! how long it must be.
//!
//! The algorithm is the GotoBLAS/BLIS loop nest (Goto & van de Geijn, "Anatomy of
//! High-Performance Matrix Multiplication", ACM TOMS 2008): for each `KC`-deep slice
//! of the shared dimension, a `KC × NC` block of B is packed into `NR`-wide panels
//! (kept in L2/L3), then each `MC × KC` block of A into `MR`-tall panels (kept in L2),
//! and a register-blocked micro-kernel (module `kernel`) multiplies one panel pair into an
//! `MR × NR` tile of C. Packing makes every operand layout (row-major, transposed,
//! strided views) run the same unit-stride kernel.
//!
//! A product of few rows (at most 16: a one-row inference request, a generated token's
//! step, a step of 16 streams) reads a row-major B where it lies instead of packing it,
//! since each of B's values then serves at most three row panels, too few to repay the
//! copy; on x86 it reads A where it lies too when `alpha == 1` (its packing would only
//! copy it), through few-row kernels that take A's strides. Up to four rows on AVX2 or
//! AVX-512 run in tiles as wide as the registers hold rather than the 6×16 or 8×32 tile,
//! whose padding rows would be most of its arithmetic. A causal product packs only the
//! steps of A its triangle holds.
//!
//! The summation order depends on the shapes only, never on where the buffers are or
//! which tile computes an element (each element's products are added in step order with
//! fused multiply-adds, then one fused `beta·C + acc`), so the result is bit-identical
//! whether the scratch comes from a workspace or the heap, and a row's values are the
//! same in a product of one row as in a product of many.

mod kernel;
mod pack;
pub(crate) mod pool;

use std::mem::MaybeUninit;

use crate::{Error, Result};
use ndarray::{ArrayView2, ArrayViewMut2};

use kernel::{Kernel, Tile};

/// Depth of one packed slice: an `MR × KC` panel of A and a `KC × NR` panel of B
/// (8 KiB + 32 KiB for the 8×32 kernel) fit the 48 KiB L1 data cache together.
pub(crate) const KC: usize = 256;
/// Rows of A packed at once (96 KiB at `KC`): fits L2. A multiple of every kernel's `MR`
/// (6, 8, 16).
const MC: usize = 96;
/// Columns of B packed at once (2 MiB at `KC`): fits L2 on large-L2 parts, L3
/// elsewhere. A multiple of every kernel's `NR`.
const NC: usize = 2048;
/// Products of at most this many rows read a row-major B where it lies instead of
/// packing it: each of B's values then serves at most three row panels of A (of 6, 8 or
/// 16 rows), too few to repay a copy (one-row inference requests, a token's step
/// through a network, a step of 16 generation streams). The kernel reads the same values
/// in the same order either way: the same bits.
const FEW_ROWS: usize = 16;
/// Packed buffers start on a cache line.
const ALIGN_ELEMENTS: usize = 64 / std::mem::size_of::<f32>();

fn round_up(value: usize, multiple: usize) -> usize {
    value.div_ceil(multiple) * multiple
}

/// Sizes of the two packed blocks for an `m × n × k` product with `kernel`'s tiles.
fn packed_sizes(kernel: Kernel, m: usize, n: usize, k: usize) -> (usize, usize) {
    let kc = k.clamp(1, KC);
    (round_up(m.clamp(1, MC), kernel.mr()) * kc, round_up(n.clamp(1, NC), kernel.nr()) * kc)
}

/// Scratch elements [`sgemm`] needs for an `m × k` by `k × n` product.
///
/// ```
/// use carve::nn::gemm::scratch_len;
/// assert!(scratch_len(32, 128, 64) >= 32 * 64 + 64 * 128);
/// // Bounded by the blocking, whatever the shapes:
/// assert_eq!(scratch_len(100_000, 100_000, 100_000), scratch_len(4096, 4096, 4096));
/// ```
pub fn scratch_len(m: usize, n: usize, k: usize) -> usize {
    // The same on every CPU: enough for any kernel's tile shape.
    let sizes = Kernel::SHAPES.map(|kernel| {
        let (a, b) = packed_sizes(kernel, m, n, k);
        a + b
    });
    sizes.into_iter().max().unwrap_or(0) + ALIGN_ELEMENTS
}

/// `C = alpha·A·B + beta·C` for `A: m × k`, `B: k × n`, `C: m × n`, any strides
/// (transposed views included). When `beta == 0`, C is overwritten without being read.
///
/// `scratch` holds the packing buffers (at least [`scratch_len`]`(m, n, k)` elements);
/// its contents do not matter and are overwritten.
///
/// ```
/// use std::mem::MaybeUninit;
/// use carve::nn::gemm::{scratch_len, sgemm};
/// use carve::ndarray::array;
///
/// let a = array![[1.0f32, 2.0], [3.0, 4.0]];
/// let b = array![[5.0f32, 6.0], [7.0, 8.0]];
/// let mut c = carve::ndarray::Array2::<f32>::zeros((2, 2));
/// let mut scratch = vec![MaybeUninit::uninit(); scratch_len(2, 2, 2)];
/// sgemm(1.0, a.view(), b.t(), 0.0, c.view_mut(), &mut scratch)?; // A·Bᵀ
/// assert_eq!(c, array![[17.0, 23.0], [39.0, 53.0]]);
/// # Ok::<(), carve::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::ShapeMismatch`] when the shapes do not chain, and
/// [`Error::InvalidInput`] when `scratch` is shorter than [`scratch_len`]; C is then
/// untouched.
pub fn sgemm(
    alpha: f32,
    a: ArrayView2<'_, f32>,
    b: ArrayView2<'_, f32>,
    beta: f32,
    c: ArrayViewMut2<'_, f32>,
    scratch: &mut [MaybeUninit<f32>],
) -> Result<()> {
    sgemm_tri(alpha, a, b, beta, c, scratch, Triangle::Full)
}

/// Which zeros of a product's operands, or which elements of its result, a causal
/// product may skip (attention's scores and probabilities are lower triangular).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Triangle {
    /// Every element of C, every step of the shared dimension.
    Full,
    /// Only C's lower triangle (`j ≤ i`) is wanted: tiles wholly above the diagonal
    /// are not computed, and C's elements there are left as they were or set to any
    /// value (C square).
    LowerC,
    /// A is lower triangular (`A[i][p] = 0` for `p > i`; A square): row `i`'s sum
    /// stops after step `i`'s tile.
    LowerA,
    /// A is upper triangular (`A[i][p] = 0` for `p < i`; A square): row `i`'s sum
    /// starts at its tile's first row.
    UpperA,
}

impl Triangle {
    /// The steps `from..to` of the `kc`-step slice from step `pc` that rows `row ..=
    /// last_row` of A hold: all of them but where A is zero. The micro-kernel reads
    /// these steps of a panel, and packing writes only these.
    #[inline]
    fn steps(self, row: usize, last_row: usize, pc: usize, kc: usize) -> (usize, usize) {
        match self {
            Triangle::Full | Triangle::LowerC => (0, kc),
            Triangle::LowerA => (0, (last_row + 1).saturating_sub(pc).min(kc)),
            Triangle::UpperA => (row.saturating_sub(pc).min(kc), kc),
        }
    }
}

/// [`sgemm`] of a causal product: the steps and tiles `tri` says are zero or unwanted
/// are skipped. Each element kept is the same sum as [`sgemm`]'s but for terms that
/// are exactly zero (`0·x`, so its bits but for the sign of a zero, as long as B is
/// finite); `tri` is trusted, not checked against the values.
///
/// # Errors
///
/// As [`sgemm`], and [`Error::ShapeMismatch`] when the triangle's matrix is not square.
pub(crate) fn sgemm_tri(
    alpha: f32,
    a: ArrayView2<'_, f32>,
    b: ArrayView2<'_, f32>,
    beta: f32,
    c: ArrayViewMut2<'_, f32>,
    scratch: &mut [MaybeUninit<f32>],
    tri: Triangle,
) -> Result<()> {
    let _span = crate::nn::profile::span(crate::nn::profile::Part::MatMul);
    sgemm_full(Kernel::detect(b.ncols()), alpha, a, b, beta, c, scratch, tri)
}

/// [`sgemm`] with a given micro-kernel (one this CPU supports), for the tests.
#[cfg(test)]
fn sgemm_with(
    kernel: Kernel,
    alpha: f32,
    a: ArrayView2<'_, f32>,
    b: ArrayView2<'_, f32>,
    beta: f32,
    c: ArrayViewMut2<'_, f32>,
    scratch: &mut [MaybeUninit<f32>],
) -> Result<()> {
    sgemm_full(kernel, alpha, a, b, beta, c, scratch, Triangle::Full)
}

/// [`sgemm_tri`] with a given micro-kernel (one this CPU supports).
#[allow(clippy::too_many_arguments)] // sgemm's arguments and the triangle
fn sgemm_full(
    kernel: Kernel,
    alpha: f32,
    a: ArrayView2<'_, f32>,
    b: ArrayView2<'_, f32>,
    beta: f32,
    mut c: ArrayViewMut2<'_, f32>,
    scratch: &mut [MaybeUninit<f32>],
    tri: Triangle,
) -> Result<()> {
    let need = check(&a, &b, c.shape(), scratch.len(), tri)?;
    let ((m, k), n) = (a.dim(), b.ncols());
    // A dry run issues no arithmetic (see `nn::dry::running`): checked, then nothing.
    if m == 0 || n == 0 || crate::nn::kernels::running() {
        return Ok(());
    }
    if k == 0 || alpha == 0.0 {
        // Nothing to add: scale C (BLAS semantics: beta == 0 overwrites, NaN included).
        if beta == 0.0 {
            c.fill(0.0);
        } else {
            c.mapv_inplace(|x| beta * x);
        }
        return Ok(());
    }
    let strides = [c.strides()[0], c.strides()[1]];
    // SAFETY: `c` is a live, exclusive view of `m × n` elements with these strides,
    // borrowed until this returns; `check` passed; `m, n, k > 0`.
    unsafe { product(kernel, alpha, &a, &b, beta, c.as_mut_ptr(), strides, &mut scratch[..need], tri) };
    Ok(())
}

/// `C = alpha·A·B` into `c`, uninitialised, for a product that writes every element
/// anyway: the same bits as [`sgemm`] with `beta == 0`, without zeros written first
/// (a dry run, and a product with nothing to add, fill it with zeros); `c` initialised.
///
/// # Errors
///
/// As [`sgemm`].
pub(crate) fn sgemm_uninit<'c>(
    alpha: f32,
    a: ArrayView2<'_, f32>,
    b: ArrayView2<'_, f32>,
    mut c: ArrayViewMut2<'c, MaybeUninit<f32>>,
    scratch: &mut [MaybeUninit<f32>],
) -> Result<ArrayViewMut2<'c, f32>> {
    let _span = crate::nn::profile::span(crate::nn::profile::Part::MatMul);
    let kernel = Kernel::detect(b.ncols());
    let need = check(&a, &b, c.shape(), scratch.len(), Triangle::Full)?;
    let ((m, k), n) = (a.dim(), b.ncols());
    if m == 0 || n == 0 || k == 0 || alpha == 0.0 || crate::nn::kernels::running() {
        c.fill(MaybeUninit::new(0.0));
    } else {
        let strides = [c.strides()[0], c.strides()[1]];
        // SAFETY: as in `sgemm_full`; C is only written, never read, with `beta == 0`
        // (the kernels read C only when `beta != 0`, and the later slices of the shared
        // dimension add to what the first wrote).
        unsafe {
            product(
                kernel,
                alpha,
                &a,
                &b,
                0.0,
                c.as_mut_ptr().cast::<f32>(),
                strides,
                &mut scratch[..need],
                Triangle::Full,
            )
        };
    }
    // SAFETY: every element was written: by `fill`, or by the full product, whose first
    // slice of the shared dimension runs every tile of C (`multiply`; split across the
    // pool, every part's), each tile storing all its elements.
    Ok(unsafe { c.assume_init() })
}

/// The shapes chain, the triangle's matrix is square and `scratch` is long enough:
/// the scratch elements the product uses, or the error saying what does not fit.
fn check(
    a: &ArrayView2<'_, f32>,
    b: &ArrayView2<'_, f32>,
    c: &[usize],
    scratch: usize,
    tri: Triangle,
) -> Result<usize> {
    let (m, k) = a.dim();
    let n = b.ncols();
    if b.nrows() != k || c != [m, n] {
        return Err(Error::ShapeMismatch {
            context: format!("sgemm of A {:?} and B {:?} into C", a.shape(), b.shape()),
            expected: vec![m, n],
            actual: if b.nrows() != k { vec![b.nrows(), usize::MAX] } else { c.to_vec() },
        });
    }
    let square = match tri {
        Triangle::Full => true,
        Triangle::LowerC => m == n,
        Triangle::LowerA | Triangle::UpperA => m == k,
    };
    if !square {
        return Err(Error::ShapeMismatch {
            context: format!(
                "a {tri:?} product of A {:?} and B {:?}: the triangle's matrix is square",
                a.shape(),
                b.shape()
            ),
            expected: vec![m, m],
            actual: if tri == Triangle::LowerC { vec![m, n] } else { vec![m, k] },
        });
    }
    let need = scratch_len(m, n, k);
    if scratch < need {
        return Err(Error::InvalidInput(format!(
            "sgemm of {m}×{k} by {k}×{n} needs {need} scratch elements, got {scratch}: size it with `scratch_len`"
        )));
    }
    Ok(need)
}

/// The product proper: `C = alpha·A·B + beta·C` (C read only when `beta != 0`).
///
/// # Safety
///
/// `c` with `c_strides` addresses `m × n` elements (`a`'s rows, `b`'s columns), live
/// and exclusively borrowed until this returns, initialised unless `beta == 0`; `m, n,
/// k > 0`; [`check`] passed for these shapes and `scratch` (its first `need`
/// elements); `kernel` came from [`Kernel::detect`].
#[allow(clippy::too_many_arguments)] // sgemm's arguments, C in raw parts
unsafe fn product(
    kernel: Kernel,
    alpha: f32,
    a: &ArrayView2<'_, f32>,
    b: &ArrayView2<'_, f32>,
    beta: f32,
    c: *mut f32,
    c_strides: [isize; 2],
    scratch: &mut [MaybeUninit<f32>],
    tri: Triangle,
) {
    let ((m, k), n) = (a.dim(), b.ncols());
    let skip = scratch.as_ptr().align_offset(64).min(ALIGN_ELEMENTS);
    let (a_len, _) = packed_sizes(kernel, m, n, k);
    let (a_buf, b_buf) = scratch[skip..].split_at_mut(a_len);
    let operands = Operands {
        a: Matrix::of(a),
        b: Matrix::of(b),
        c,
        c_row_stride: c_strides[0],
        c_col_stride: c_strides[1],
        m,
        n,
        k,
    };
    // SAFETY: `a` and `b` are live views of `m × k` and `k × n` elements and `c` a
    // live, exclusive view of `m × n`, described exactly by `operands`, borrowed until
    // this returns; the buffers have at least the sizes `packed_sizes` gives for these
    // shapes and this kernel. Split across this thread's pool when there is one (the
    // same bits), or here.
    // A causal product stays on this thread (they are small: attention's heads).
    if tri != Triangle::Full || !unsafe { pool::split(kernel, alpha, beta, &operands, a_buf, b_buf) } {
        // SAFETY: as above.
        unsafe { multiply(kernel, alpha, beta, &operands, a_buf, b_buf, tri) };
    }
}

/// A read-only strided matrix.
#[derive(Clone, Copy)]
struct Matrix {
    ptr: *const f32,
    row_stride: isize,
    col_stride: isize,
}

impl Matrix {
    fn of(view: &ArrayView2<'_, f32>) -> Matrix {
        Matrix { ptr: view.as_ptr(), row_stride: view.strides()[0], col_stride: view.strides()[1] }
    }

    /// # Safety
    ///
    /// `(row, col)` lies inside the matrix.
    #[inline(always)]
    unsafe fn at(&self, row: usize, col: usize) -> *const f32 {
        // SAFETY: inside the matrix, per the caller.
        unsafe { self.ptr.offset(row as isize * self.row_stride + col as isize * self.col_stride) }
    }
}

#[derive(Clone, Copy)]
struct Operands {
    a: Matrix,
    b: Matrix,
    c: *mut f32,
    c_row_stride: isize,
    c_col_stride: isize,
    m: usize,
    n: usize,
    k: usize,
}

/// The loop nest.
///
/// # Safety
///
/// `ops` describes live matrices (C exclusively borrowed) with `m, n, k > 0`;
/// `a_buf` and `b_buf` are at least as long as [`packed_sizes`] says for `kernel`,
/// which came from [`Kernel::detect`]; the triangle's matrix is square (`m == n` for
/// [`Triangle::LowerC`], `m == k` for the others).
unsafe fn multiply(
    kernel: Kernel,
    alpha: f32,
    beta: f32,
    ops: &Operands,
    a_buf: &mut [MaybeUninit<f32>],
    b_buf: &mut [MaybeUninit<f32>],
    tri: Triangle,
) {
    let (mr, nr) = (kernel.mr(), kernel.nr());
    let vector = kernel.has_avx();
    #[cfg(not(target_arch = "x86_64"))]
    let _ = vector;
    let (a_dst, b_dst) = (a_buf.as_mut_ptr().cast::<f32>(), b_buf.as_mut_ptr().cast::<f32>());
    // B read where it lies, but for a last panel narrower than the kernel's (packed,
    // with its zeros, so that no read runs past B's columns).
    let direct = ops.m <= FEW_ROWS && ops.b.col_stride == 1 && tri == Triangle::Full;
    // Up to four rows on AVX2 or AVX-512: tiles as wide as the registers allow (see
    // `avx2_rows`, `avx512_rows`).
    let wide_tiles = direct && ops.m <= 4 && wide_tiles_kernel(kernel);
    // A read where it lies too when its packing would only copy it (`alpha == 1`): each
    // tile's rows through the few-row kernels, which take A's strides (x86 only).
    let a_in_place = cfg!(target_arch = "x86_64") && wide_tiles_kernel(kernel) && direct && alpha == 1.0;
    for jc in (0..ops.n).step_by(NC) {
        let nc = NC.min(ops.n - jc);
        for pc in (0..ops.k).step_by(KC) {
            let kc = KC.min(ops.k - pc);
            // Later slices of the shared dimension add to what the first one wrote.
            let beta = if pc == 0 { beta } else { 1.0 };
            // Panels from column `jc + packed_from` are packed: all of them, or the last
            // narrow one.
            let packed_from = if direct { nc / nr * nr } else { 0 };
            if packed_from < nc {
                // SAFETY: rows `pc..pc+kc` and columns `jc..jc+nc` lie inside B, and the
                // buffer holds `round_up(nc, nr)·kc` elements (`nc <= NC`, `kc <= KC`),
                // panel `packed_from / nr` starting at `packed_from·kc`.
                unsafe {
                    pack_b(&ops.b, pc, kc, jc + packed_from, nc - packed_from, nr, vector, b_dst.add(packed_from * kc))
                };
            }
            for ic in (0..ops.m).step_by(MC) {
                let mc = MC.min(ops.m - ic);
                if !a_in_place {
                    // SAFETY: as for B, with `mc <= MC`.
                    unsafe { pack_a(&ops.a, alpha, ic, mc, pc, kc, mr, vector, tri, a_dst) };
                }
                // The columns the wide tiles took.
                #[cfg(target_arch = "x86_64")]
                let first_jr = if wide_tiles && packed_from > 0 {
                    // A's `m` rows from step `pc` (`ic == 0`: `m <= 4 < MC`): where they
                    // lie, or A's one packed panel, `kc` steps of `mr` values, the first
                    // `m` of them A's rows.
                    let a = if a_in_place {
                        // SAFETY: row 0, column `pc < k` lies in A.
                        (unsafe { ops.a.at(0, pc) }, ops.a.row_stride, ops.a.col_stride)
                    } else {
                        (a_dst.cast_const(), 1, mr as isize)
                    };
                    // SAFETY: AVX2 and FMA, or AVX-512F (the kernel `detect` chose); A as
                    // just said; columns `jc .. jc + packed_from` of B's rows `pc .. pc +
                    // kc` and of C's `m` rows lie inside them.
                    unsafe {
                        match kernel {
                            Kernel::Avx512Wide => few_rows_avx512(ops, kc, a, pc, jc, packed_from, beta),
                            _ => few_rows(ops, kc, a, pc, jc, packed_from, beta),
                        }
                    };
                    packed_from
                } else {
                    0
                };
                #[cfg(not(target_arch = "x86_64"))]
                let first_jr = {
                    let _ = wide_tiles;
                    0
                };
                for jr in (first_jr..nc).step_by(nr) {
                    for ir in (0..mc).step_by(mr) {
                        let (row, col) = (ic + ir, jc + jr);
                        let last_row = row + mr.min(mc - ir) - 1;
                        // The tile's steps `from..to` of this slice (all but zeros of A).
                        if tri == Triangle::LowerC && col > last_row {
                            continue;
                        }
                        let (from, to) = tri.steps(row, last_row, pc, kc);
                        if from == to && pc > 0 {
                            // Nothing to add to what the earlier slices wrote.
                            continue;
                        }
                        let tile = Tile {
                            // SAFETY: `row < m`, `col < n`: inside C.
                            ptr: unsafe {
                                ops.c.offset(row as isize * ops.c_row_stride + col as isize * ops.c_col_stride)
                            },
                            row_stride: ops.c_row_stride,
                            col_stride: ops.c_col_stride,
                            rows: mr.min(mc - ir),
                            cols: nr.min(nc - jr),
                        };
                        // Steps `from..to` of panel `jr / nr` of B: packed, each step's
                        // `nr` values one after another; or B's own rows `pc + from ..`,
                        // columns `col .. col + nr` (a whole panel: `jr < packed_from`).
                        let (b_panel, b_step) = if jr < packed_from {
                            // SAFETY: row `pc + from` (a full product's `from == 0 < kc`)
                            // and column `col < n` lie in B.
                            (unsafe { ops.b.at(pc + from, col) }, ops.b.row_stride)
                        } else {
                            // SAFETY: inside the packed buffer, as in `pack_b`.
                            (unsafe { b_dst.add(jr * kc + from * nr) }.cast_const(), nr as isize)
                        };
                        #[cfg(target_arch = "x86_64")]
                        if a_in_place {
                            // SAFETY: a full product (`from == 0`, `to == kc`): A's rows
                            // `row .. row + tile.rows` hold steps `pc .. pc + kc` where
                            // they lie; B's panel as below; the kernel came from `detect`
                            // and reads A's strides.
                            unsafe { rows_in_place(kernel, ops, row, pc, kc, b_panel, b_step, beta, tile) };
                            continue;
                        }
                        // SAFETY: panel `ir / mr` of A holds steps `from..to` as
                        // `pack_a` wrote them (the same `Triangle::steps`; rows past A's
                        // padded with zeros), and B's panel, packed or in place, `nr`
                        // values at each of steps `from..to`, `b_step` apart;
                        // the tile is the part of C that exists; the kernel came from
                        // `detect`. Steps `from..to` of the panels (`from <= to <= kc`):
                        // A's panel holds each step's `mr` values one after another.
                        unsafe { kernel.run(to - from, a_dst.add(ir * kc + from * mr), b_panel, b_step, beta, tile) };
                    }
                }
            }
        }
    }
}

/// Whether `kernel` has few-row twins that read B where it lies (and A by its strides):
/// [`kernel::x86::avx2_rows`] for the 6×16 kernel, [`kernel::x86::avx512_rows`] for the
/// 8×32 one.
fn wide_tiles_kernel(kernel: Kernel) -> bool {
    matches!(kernel, Kernel::Avx2Fma | Kernel::Avx512Wide)
}

/// One tile of C, `tile.rows` rows from row `row` (at most the kernel's `mr`) by the
/// kernel's `nr` columns of B's panel at `b` (`b_step` apart: packed, or B where it
/// lies), over steps `pc .. pc + kc` of A's rows read where they lie: the few-row twin of
/// `kernel` for that many rows, whose sums are the kernel's (the same bits as a packed A
/// with `alpha == 1`).
///
/// # Safety
///
/// `kernel` is [`Kernel::Avx2Fma`] or [`Kernel::Avx512Wide`], from [`Kernel::detect`];
/// rows `row .. row + tile.rows` and columns `pc .. pc + kc` lie in `ops.a`; `b + p·b_step`
/// holds `nr` readable values for `p < kc`; `tile` is as [`Kernel::run`] says.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)] // one tile of one product
unsafe fn rows_in_place(
    kernel: Kernel,
    ops: &Operands,
    row: usize,
    pc: usize,
    kc: usize,
    b: *const f32,
    b_step: isize,
    beta: f32,
    tile: Tile,
) {
    use kernel::x86::{avx2_rows, avx512_rows};
    debug_assert!((1..=kernel.mr()).contains(&tile.rows), "{} rows of a {kernel:?} tile", tile.rows);
    // SAFETY: row `row`, column `pc` lie in A.
    let (a, r, p) = (unsafe { ops.a.at(row, pc) }, ops.a.row_stride, ops.a.col_stride);
    // SAFETY: in every arm, the caller's contract, with `M == tile.rows` rows of A and
    // the kernel's `nr` columns of B (`16·2` on AVX-512, `8·2` on AVX2).
    unsafe {
        match (kernel, tile.rows) {
            (Kernel::Avx512Wide, 1) => avx512_rows::<1, 2>(kc, a, r, p, b, b_step, beta, tile),
            (Kernel::Avx512Wide, 2) => avx512_rows::<2, 2>(kc, a, r, p, b, b_step, beta, tile),
            (Kernel::Avx512Wide, 3) => avx512_rows::<3, 2>(kc, a, r, p, b, b_step, beta, tile),
            (Kernel::Avx512Wide, 4) => avx512_rows::<4, 2>(kc, a, r, p, b, b_step, beta, tile),
            (Kernel::Avx512Wide, 5) => avx512_rows::<5, 2>(kc, a, r, p, b, b_step, beta, tile),
            (Kernel::Avx512Wide, 6) => avx512_rows::<6, 2>(kc, a, r, p, b, b_step, beta, tile),
            (Kernel::Avx512Wide, 7) => avx512_rows::<7, 2>(kc, a, r, p, b, b_step, beta, tile),
            (Kernel::Avx512Wide, _) => avx512_rows::<8, 2>(kc, a, r, p, b, b_step, beta, tile),
            (Kernel::Avx2Fma, 1) => avx2_rows::<1, 2>(kc, a, r, p, b, b_step, beta, tile),
            (Kernel::Avx2Fma, 2) => avx2_rows::<2, 2>(kc, a, r, p, b, b_step, beta, tile),
            (Kernel::Avx2Fma, 3) => avx2_rows::<3, 2>(kc, a, r, p, b, b_step, beta, tile),
            (Kernel::Avx2Fma, 4) => avx2_rows::<4, 2>(kc, a, r, p, b, b_step, beta, tile),
            (Kernel::Avx2Fma, 5) => avx2_rows::<5, 2>(kc, a, r, p, b, b_step, beta, tile),
            (Kernel::Avx2Fma, _) => avx2_rows::<6, 2>(kc, a, r, p, b, b_step, beta, tile),
            // The caller's contract: no other kernel comes here.
            (other, _) => unreachable!("{other:?} has no few-row twin"),
        }
    }
}

/// Columns `jc .. jc + cols` (`cols` a multiple of 16) of the `m <= 4` rows of C, from
/// steps `pc .. pc + kc`: A's values at `a = (ptr, a_row, a_step)` (row `i`, step `p`
/// at `ptr + i·a_row + p·a_step`: A's packed panel, or A where it lies) by B's rows read
/// where they lie, in the widest tiles of [`kernel::x86::avx2_rows`] for `m` rows, then
/// 16 columns at a time.
///
/// # Safety
///
/// The CPU has AVX2 and FMA; `ops` describes live matrices (C exclusively borrowed),
/// B with unit column stride; `ptr + i·a_row + p·a_step` is readable for `i < m`, `p <
/// kc`; rows `pc .. pc + kc` and columns `jc .. jc + cols` lie in B, and columns `jc ..
/// jc + cols` in C.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)] // one slice of one product
unsafe fn few_rows(
    ops: &Operands,
    kc: usize,
    a: (*const f32, isize, isize),
    pc: usize,
    jc: usize,
    cols: usize,
    beta: f32,
) {
    /// Tiles `M × 8·V` while they fit, then `M × 16`.
    ///
    /// # Safety
    ///
    /// As [`few_rows`], with `M == ops.m`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn run<const M: usize, const V: usize>(
        ops: &Operands,
        kc: usize,
        a: (*const f32, isize, isize),
        pc: usize,
        jc: usize,
        cols: usize,
        beta: f32,
    ) {
        let mut j = 0;
        while j < cols {
            let width = if j + 8 * V <= cols { 8 * V } else { 16 };
            let col = jc + j;
            let tile = Tile {
                ptr: ops.c.wrapping_offset(col as isize * ops.c_col_stride),
                row_stride: ops.c_row_stride,
                col_stride: ops.c_col_stride,
                rows: M,
                cols: width,
            };
            // SAFETY: columns `col .. col + width <= jc + cols` of B's rows `pc ..` and
            // of C's `M` rows lie inside them (the contract; `cols` a multiple of 16, so
            // a 16-wide tile fits whenever a wider one does not); A as the contract says.
            unsafe {
                let (b, (a, a_row, a_step)) = (ops.b.at(pc, col), a);
                if width == 8 * V {
                    kernel::x86::avx2_rows::<M, V>(kc, a, a_row, a_step, b, ops.b.row_stride, beta, tile);
                } else {
                    kernel::x86::avx2_rows::<M, 2>(kc, a, a_row, a_step, b, ops.b.row_stride, beta, tile);
                }
            }
            j += width;
        }
    }
    debug_assert!((1..=4).contains(&ops.m) && cols.is_multiple_of(16), "{} rows, {cols} columns", ops.m);
    // At most 16 registers: `M·V` accumulators, `M` broadcasts of A, one load of B.
    match ops.m {
        // SAFETY: the contract, with `M == ops.m`.
        1 => unsafe { run::<1, 12>(ops, kc, a, pc, jc, cols, beta) },
        // SAFETY: as above.
        2 => unsafe { run::<2, 6>(ops, kc, a, pc, jc, cols, beta) },
        // SAFETY: as above.
        3 => unsafe { run::<3, 4>(ops, kc, a, pc, jc, cols, beta) },
        // SAFETY: as above (`m <= 4`, the caller's `wide_tiles`).
        _ => unsafe { run::<4, 2>(ops, kc, a, pc, jc, cols, beta) },
    }
}

/// [`few_rows`] on AVX-512: columns `jc .. jc + cols` (`cols` a multiple of 16) of the
/// `m <= 4` rows of C in the widest tiles of [`kernel::x86::avx512_rows`] for `m` rows
/// that fit what is left, down to 16 columns.
///
/// # Safety
///
/// As [`few_rows`], on a CPU with AVX-512F.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)] // one slice of one product
unsafe fn few_rows_avx512(
    ops: &Operands,
    kc: usize,
    a: (*const f32, isize, isize),
    pc: usize,
    jc: usize,
    cols: usize,
    beta: f32,
) {
    /// One tile of `M × 16·V` at column `col`.
    ///
    /// # Safety
    ///
    /// As [`few_rows_avx512`], with `M == ops.m` and columns `col .. col + 16·V` inside
    /// those it covers.
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const M: usize, const V: usize>(
        ops: &Operands,
        kc: usize,
        (a, a_row, a_step): (*const f32, isize, isize),
        pc: usize,
        col: usize,
        beta: f32,
    ) {
        let tile = Tile {
            ptr: ops.c.wrapping_offset(col as isize * ops.c_col_stride),
            row_stride: ops.c_row_stride,
            col_stride: ops.c_col_stride,
            rows: M,
            cols: 16 * V,
        };
        // SAFETY: the contract: B's rows `pc ..` and C's `M` rows hold columns `col ..
        // col + 16·V`; A as `few_rows_avx512`'s contract says; `avx512_rows` checks
        // `M·16·V <= MAX_TILE` when it is compiled.
        unsafe {
            kernel::x86::avx512_rows::<M, V>(kc, a, a_row, a_step, ops.b.at(pc, col), ops.b.row_stride, beta, tile)
        };
    }
    /// Tiles `M × 16·V` while they fit, then `M × 16·H` (when `H` is narrower than
    /// `V` and wider than 2), 32 and 16 columns.
    ///
    /// # Safety
    ///
    /// As [`few_rows_avx512`], with `M == ops.m`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn run<const M: usize, const V: usize, const H: usize>(
        ops: &Operands,
        kc: usize,
        a: (*const f32, isize, isize),
        pc: usize,
        jc: usize,
        cols: usize,
        beta: f32,
    ) {
        let mut j = 0;
        while j < cols {
            let (left, col) = (cols - j, jc + j);
            // SAFETY: each tile's columns `col .. col + width` lie within `jc .. jc +
            // cols` (`left >= width`; `cols` a multiple of 16, so 16 always fits).
            let width = unsafe {
                if left >= 16 * V {
                    tile::<M, V>(ops, kc, a, pc, col, beta);
                    16 * V
                } else if H < V && H > 2 && left >= 16 * H {
                    tile::<M, H>(ops, kc, a, pc, col, beta);
                    16 * H
                } else if left >= 32 {
                    tile::<M, 2>(ops, kc, a, pc, col, beta);
                    32
                } else {
                    tile::<M, 1>(ops, kc, a, pc, col, beta);
                    16
                }
            };
            j += width;
        }
    }
    debug_assert!((1..=4).contains(&ops.m) && cols.is_multiple_of(16), "{} rows, {cols} columns", ops.m);
    // At most 32 registers (`M·V` accumulators, `M` broadcasts, one load of B), and
    // a tile of at most `MAX_TILE` elements (a strided C's buffer).
    match ops.m {
        // SAFETY: the contract, with `M == ops.m`.
        1 => unsafe { run::<1, 16, 8>(ops, kc, a, pc, jc, cols, beta) },
        // SAFETY: as above.
        2 => unsafe { run::<2, 8, 2>(ops, kc, a, pc, jc, cols, beta) },
        // SAFETY: as above.
        3 => unsafe { run::<3, 5, 2>(ops, kc, a, pc, jc, cols, beta) },
        // SAFETY: as above (`m <= 4`, the caller's `wide_tiles`).
        _ => unsafe { run::<4, 4, 2>(ops, kc, a, pc, jc, cols, beta) },
    }
}

/// Packs `alpha · A[ic..ic+mc, pc..pc+kc]` into `mr`-tall panels at `dst`: panel `r`
/// holds, for each step `p`, the `mr` values of rows `r·mr ..` at column `pc + p`
/// (zeros past the last row). Of a causal product's A only the steps `tri` says a
/// panel's rows hold ([`Triangle::steps`], the steps the micro-kernel reads) are
/// written; the panel's other slots are left as they were. `vector`: the CPU has AVX
/// (see the `pack` module).
///
/// # Safety
///
/// The block lies inside `a`; `dst` is writable for `round_up(mc, mr)·kc` elements;
/// `vector` only where the CPU has AVX.
#[allow(clippy::too_many_arguments)] // one block of one matrix: the loop nest's indices
unsafe fn pack_a(
    a: &Matrix,
    alpha: f32,
    ic: usize,
    mc: usize,
    pc: usize,
    kc: usize,
    mr: usize,
    vector: bool,
    tri: Triangle,
    dst: *mut f32,
) {
    for ir in (0..mc).step_by(mr) {
        let rows = mr.min(mc - ir);
        let (from, to) = tri.steps(ic + ir, ic + ir + rows - 1, pc, kc);
        if from < to {
            // SAFETY: panel `ir / mr` starts at `ir·kc` and spans `mr·kc` elements, of
            // which steps `from..to` (`to <= kc`) start at `from·mr`; rows `ic+ir ..
            // +rows` and columns `pc+from .. pc+to` lie in the block.
            unsafe {
                pack_a_panel(a, alpha, ic + ir, rows, pc + from, to - from, mr, vector, dst.add(ir * kc + from * mr))
            };
        }
    }
}

/// Packs `alpha · A[row..row+rows, pc..pc+kc]` into one `mr`-tall panel at `panel`
/// (zeros in the rows past `rows`).
///
/// # Safety
///
/// The block lies inside `a`; `rows <= mr`; `panel` is writable for `mr·kc` elements;
/// `vector` only where the CPU has AVX.
#[allow(clippy::too_many_arguments)] // one panel of one matrix
#[inline]
unsafe fn pack_a_panel(
    a: &Matrix,
    alpha: f32,
    row: usize,
    rows: usize,
    pc: usize,
    kc: usize,
    mr: usize,
    vector: bool,
    panel: *mut f32,
) {
    let mut from = 0;
    #[cfg(target_arch = "x86_64")]
    if vector && a.col_stride == 1 && rows == mr && a.row_stride != 1 && pack::x86::usable(mr) {
        // Row-major A: each row contiguous along the steps. SAFETY: AVX per the
        // caller; rows `row ..+mr` hold `kc` steps from column `pc`; the panel spans
        // `mr·kc` elements.
        from = unsafe { pack::x86::interleave(a.at(row, pc), a.row_stride, mr, kc, alpha, panel) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = vector;
    if from > 0 {
        for p in from..kc {
            for i in 0..mr {
                // SAFETY: row `row + i`, column `pc + p` lie in the block; `p·mr + i <
                // mr·kc`.
                unsafe { *panel.add(p * mr + i) = alpha * *a.at(row + i, pc + p) };
            }
        }
        return;
    }
    if a.row_stride == 1 && rows == mr {
        // Transposed A (a weight gradient's `xᵀ`): each step's `mr` values are
        // contiguous; a tile height known to the compiler moves them as vectors.
        match mr {
            // Rows `row .. row+mr` of the block, `kc` steps from column `pc`, unit row
            // stride; the panel spans `mr·kc` elements.
            // SAFETY: as just said.
            6 => unsafe { copy_steps::<6>(a, alpha, row, pc, kc, panel) },
            // SAFETY: as above.
            8 => unsafe { copy_steps::<8>(a, alpha, row, pc, kc, panel) },
            // SAFETY: as above.
            16 => unsafe { copy_steps::<16>(a, alpha, row, pc, kc, panel) },
            // SAFETY: as above.
            _ => unsafe { copy_steps_any(a, alpha, row, pc, kc, mr, panel) },
        }
        return;
    }
    if a.row_stride == 1 {
        // Transposed A, the last rows (fewer than a tile): each step's values
        // contiguous, zeros after them.
        for p in 0..kc {
            // SAFETY: rows `row .. row+rows`, column `pc + p` lie in the block,
            // contiguous (unit row stride).
            let src = unsafe { a.at(row, pc + p) };
            for i in 0..mr {
                // SAFETY: `i < rows` lies in the block, as above; `p·mr + i < mr·kc`.
                unsafe { *panel.add(p * mr + i) = if i < rows { alpha * *src.add(i) } else { 0.0 } };
            }
        }
        return;
    }
    if rows < mr {
        // The rows past A's are zeros: the whole panel zeroed at once, A's rows then
        // written over it (one fill, not one per step).
        // SAFETY: the panel spans `mr·kc` writable elements.
        unsafe { std::ptr::write_bytes(panel, 0, mr * kc) };
    }
    for i in 0..rows {
        // SAFETY: row `row + i` lies in the block, from column `pc`.
        let src = unsafe { a.at(row + i, pc) };
        for p in 0..kc {
            // SAFETY: column `pc + p` lies in the block; `p·mr + i < mr·kc`.
            unsafe { *panel.add(p * mr + i) = alpha * *src.offset(p as isize * a.col_stride) };
        }
    }
}

/// `panel[p·MR + i] = alpha · A[row + i, pc + p]` for `p < kc`, `i < MR`.
///
/// # Safety
///
/// `a`'s row stride is 1; rows `row .. row + MR` and columns `pc .. pc + kc` lie in
/// it; `panel` is writable for `MR·kc` elements.
#[inline(always)]
unsafe fn copy_steps<const MR: usize>(a: &Matrix, alpha: f32, row: usize, pc: usize, kc: usize, panel: *mut f32) {
    if kc == 0 {
        return;
    }
    // SAFETY: `(row, pc)` lies in A (the contract, `kc > 0`).
    let mut src = unsafe { a.at(row, pc) };
    // The scaling decided once, not per step; each step's column one stride on
    // (`wrapping_offset`: past the last step the pointer is not read).
    if alpha == 1.0 {
        for p in 0..kc {
            // SAFETY: `MR` contiguous values of column `pc + p` from `row` (unit row
            // stride), per the contract; step `p` of the panel.
            unsafe { panel.add(p * MR).cast::<[f32; MR]>().write_unaligned(src.cast::<[f32; MR]>().read_unaligned()) };
            src = src.wrapping_offset(a.col_stride);
        }
    } else {
        for p in 0..kc {
            // SAFETY: as above.
            unsafe {
                let mut v = src.cast::<[f32; MR]>().read_unaligned();
                v.iter_mut().for_each(|x| *x *= alpha);
                panel.add(p * MR).cast::<[f32; MR]>().write_unaligned(v);
            }
            src = src.wrapping_offset(a.col_stride);
        }
    }
}

/// [`copy_steps`] for a tile height the compiler does not know.
///
/// # Safety
///
/// As [`copy_steps`] with `MR = mr`.
unsafe fn copy_steps_any(a: &Matrix, alpha: f32, row: usize, pc: usize, kc: usize, mr: usize, panel: *mut f32) {
    for p in 0..kc {
        // SAFETY: as in `copy_steps`.
        let src = unsafe { a.at(row, pc + p) };
        for i in 0..mr {
            // SAFETY: as above, and `p·mr + i < mr·kc`.
            unsafe { *panel.add(p * mr + i) = alpha * *src.add(i) };
        }
    }
}

/// Packs `B[pc..pc+kc, jc..jc+nc]` into `nr`-wide panels at `dst`: panel `c` holds,
/// for each step `p`, the `nr` values of columns `c·nr ..` in row `pc + p` (zeros past
/// the last column). `vector`: the CPU has AVX (see the `pack` module).
///
/// # Safety
///
/// The block lies inside `b`; `dst` is writable for `round_up(nc, nr)·kc` elements;
/// `vector` only where the CPU has AVX.
#[allow(clippy::too_many_arguments)] // one block of one matrix: the loop nest's indices
unsafe fn pack_b(b: &Matrix, pc: usize, kc: usize, jc: usize, nc: usize, nr: usize, vector: bool, dst: *mut f32) {
    for jr in (0..nc).step_by(nr) {
        let cols = nr.min(nc - jr);
        // SAFETY: panel `jr / nr` starts at `jr·kc` and spans `nr·kc` elements.
        let panel = unsafe { dst.add(jr * kc) };
        let mut from = 0;
        #[cfg(target_arch = "x86_64")]
        if vector && b.row_stride == 1 && cols == nr && b.col_stride != 1 && pack::x86::usable(nr) {
            // Transposed B: each column contiguous along the steps. SAFETY: AVX per the
            // caller; columns `jc+jr ..+nr` hold `kc` steps from row `pc`; the panel
            // spans `nr·kc` elements.
            from = unsafe { pack::x86::interleave(b.at(pc, jc + jr), b.col_stride, nr, kc, 1.0, panel) };
        }
        if from > 0 {
            for p in from..kc {
                for j in 0..nr {
                    // SAFETY: row `pc + p`, column `jc + jr + j` lie in the block;
                    // `p·nr + j < nr·kc`.
                    unsafe { *panel.add(p * nr + j) = *b.at(pc + p, jc + jr + j) };
                }
            }
            continue;
        }
        if b.col_stride == 1 && cols == nr && (nr == 16 || nr == 32) {
            // Row-major B, a whole panel: each step's values copied as one fixed-size
            // block (vector moves, where a copy of a run-time length calls `memmove`).
            // SAFETY: as below, with `cols == nr`.
            unsafe {
                match nr {
                    16 => copy_rows::<16>(b, pc, kc, jc + jr, panel),
                    _ => copy_rows::<32>(b, pc, kc, jc + jr, panel),
                }
            }
            continue;
        }
        if b.col_stride == 1 {
            // Row-major B (weights in a forward pass): each step's values are contiguous.
            for p in 0..kc {
                // SAFETY: row `pc + p`, columns `jc+jr .. jc+jr+cols` lie in the block;
                // the panel row `p` has `nr >= cols` elements.
                unsafe {
                    let src = b.at(pc + p, jc + jr);
                    let out = panel.add(p * nr);
                    std::ptr::copy_nonoverlapping(src, out, cols);
                    std::ptr::write_bytes(out.add(cols), 0, nr - cols);
                }
            }
            continue;
        }
        for j in 0..nr {
            if j < cols {
                // SAFETY: column `jc + jr + j` lies in the block, from row `pc`.
                let src = unsafe { b.at(pc, jc + jr + j) };
                for p in 0..kc {
                    // SAFETY: row `pc + p` lies in the block; `p·nr + j < nr·kc`.
                    unsafe { *panel.add(p * nr + j) = *src.offset(p as isize * b.row_stride) };
                }
            } else {
                for p in 0..kc {
                    // SAFETY: `p·nr + j < nr·kc`.
                    unsafe { *panel.add(p * nr + j) = 0.0 };
                }
            }
        }
    }
}

/// `panel[p·N ..][..N] = B[pc + p, col .. col + N]` for `p < kc` (B row-major).
///
/// # Safety
///
/// Rows `pc .. pc + kc` of B hold columns `col .. col + N` with unit column stride;
/// `panel` is writable for `N·kc` elements.
#[inline(always)]
unsafe fn copy_rows<const N: usize>(b: &Matrix, pc: usize, kc: usize, col: usize, panel: *mut f32) {
    for p in 0..kc {
        // SAFETY: the caller's promise; `[f32; N]` has alignment 4, as `f32`.
        unsafe {
            let src = b.at(pc + p, col).cast::<[f32; N]>();
            panel.add(p * N).cast::<[f32; N]>().write_unaligned(src.read_unaligned());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{s, Array2, ShapeBuilder};

    fn matrix(rows: usize, cols: usize, seed: u64) -> Array2<f32> {
        let mut rng = carve_rng::Rng::new(seed);
        Array2::from_shape_simple_fn((rows, cols), || rng.uniform(-1.0, 1.0))
    }

    /// Products in f64, the reference (on plain row-major copies: indexing the views
    /// element by element costs most of these tests' time in a debug build, and far more
    /// under valgrind).
    fn reference(
        alpha: f32,
        a: &ArrayView2<'_, f32>,
        b: &ArrayView2<'_, f32>,
        beta: f32,
        c: &Array2<f32>,
    ) -> Array2<f64> {
        let (m, k) = a.dim();
        let n = b.ncols();
        let rows: Vec<f64> = a.iter().map(|&v| f64::from(v)).collect(); // m × k, row-major
        let columns: Vec<f64> = b.t().iter().map(|&v| f64::from(v)).collect(); // n × k
        let start: Vec<f64> = c.iter().map(|&v| f64::from(v)).collect(); // m × n
        Array2::from_shape_fn((m, n), |(i, j)| {
            let (row, column) = (&rows[i * k..(i + 1) * k], &columns[j * k..(j + 1) * k]);
            let dot: f64 = row.iter().zip(column).map(|(x, y)| x * y).sum();
            let scaled = if beta == 0.0 { 0.0 } else { f64::from(beta) * start[i * n + j] };
            f64::from(alpha) * dot + scaled
        })
    }

    /// Every kernel of this machine against the reference, computed once.
    fn check(m: usize, n: usize, k: usize, alpha: f32, beta: f32, layout: u8) {
        let a_store = if layout & 1 == 0 { matrix(m, k, 1) } else { matrix(k, m, 1) };
        let b_store = if layout & 2 == 0 { matrix(k, n, 2) } else { matrix(n, k, 2) };
        let a = if layout & 1 == 0 { a_store.view() } else { a_store.t() };
        let b = if layout & 2 == 0 { b_store.view() } else { b_store.t() };
        let start = matrix(m, n, 3);
        let expected = reference(alpha, &a, &b, beta, &start);
        for kernel in Kernel::all_available() {
            // C column-major when layout & 4, to exercise strided stores.
            let mut c = if layout & 4 == 0 { start.clone() } else { Array2::zeros((m, n).f()) };
            if layout & 4 != 0 {
                c.assign(&start);
            }
            if beta == 0.0 {
                c.fill(f32::NAN); // must be overwritten, never read
            }
            let mut scratch = vec![MaybeUninit::new(f32::NAN); scratch_len(m, n, k)];
            sgemm_with(kernel, alpha, a, b, beta, c.view_mut(), &mut scratch).unwrap();
            for ((i, j), &want) in expected.indexed_iter() {
                let got = f64::from(c[[i, j]]);
                let tolerance = 1e-5 * (k as f64 + 1.0) * (1.0 + want.abs());
                assert!(
                    (got - want).abs() <= tolerance,
                    "{kernel:?}: {m}×{n}×{k} layout {layout} at ({i}, {j}): {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn matches_the_reference_across_edges_and_layouts() {
        let sizes = [1, 2, 5, 6, 7, 15, 16, 17, 33, 97];
        for (t, &m) in sizes.iter().enumerate() {
            for &n in &sizes {
                let k = sizes[(t * 3 + n) % sizes.len()];
                for layout in 0..8 {
                    check(m, n, k, 1.0, 0.0, layout);
                }
                check(m, n, k, 0.5, 1.0, (m + n) as u8 % 8);
                check(m, n, k, -2.0, 0.25, (m * n) as u8 % 8);
            }
        }
    }

    #[test]
    fn crosses_every_blocking_boundary() {
        // k beyond KC (several slices, beta applied once), m beyond MC, n beyond NC.
        check(MC + 7, 35, 2 * KC + 9, 1.0, 0.5, 0);
        check(13, NC + 5, KC + 1, 1.0, 0.0, 3);
        check(2 * MC + 1, 40, 300, 1.5, 1.0, 5);
    }

    #[test]
    fn a_one_step_b_of_any_row_stride_multiplies_on_every_kernel() {
        // A length-1 axis may have any stride (ndarray counts `(len - 1) · stride`): the
        // few-row kernels' prefetch address must not overflow computing it. (The
        // overflow was a panic in builds with overflow checks, on AVX-512 CPUs, whose
        // one- and two-row kernels prefetch; elsewhere this checks the product only.)
        let data: Vec<f32> = (0..32).map(|v| v as f32).collect();
        let b = ArrayView2::from_shape((1, 32).strides((1usize << 60, 1)), &data[..]).unwrap();
        let a = Array2::from_elem((1, 1), 2.0f32);
        for kernel in Kernel::all_available() {
            let mut c = Array2::<f32>::zeros((1, 32));
            let mut scratch = vec![MaybeUninit::uninit(); scratch_len(1, 32, 1)];
            sgemm_with(kernel, 1.0, a.view(), b, 0.0, c.view_mut(), &mut scratch).unwrap();
            assert_eq!(c.row(0).to_vec(), data.iter().map(|v| 2.0 * v).collect::<Vec<_>>(), "{kernel:?}");
        }
    }

    #[test]
    fn every_kernel_agrees_with_its_portable_twin_bit_for_bit() {
        let (m, n, k) = (13, 35, 70);
        let a = matrix(m, k, 4);
        let b = matrix(k, n, 5);
        for kernel in Kernel::all_available() {
            let mut out = [matrix(m, n, 6), matrix(m, n, 6)];
            for (which, c) in [kernel, kernel.generic_twin()].into_iter().zip(&mut out) {
                let mut scratch = vec![MaybeUninit::uninit(); scratch_len(m, n, k)];
                sgemm_with(which, 1.0, a.view(), b.view(), 0.5, c.view_mut(), &mut scratch).unwrap();
            }
            assert_eq!(out[0], out[1], "{kernel:?} and its portable twin round differently");
        }
    }

    #[test]
    fn few_rows_read_b_in_place_and_give_the_bits_of_packed_rows() {
        // A product of at most `FEW_ROWS` rows reads a row-major B where it lies (but
        // for a last narrow panel), and A too when alpha is 1; its rows must be the bits
        // of the same rows of a taller product, which packs both. Widths below, at and
        // past a panel, a KC slice crossed, B with a row stride past its width and
        // reversed, A row-major, column-major and with its rows reversed (by the number
        // of rows), C row- and column-major, beta 0 and 1 (alpha 1) and 0.5 (alpha 0.5),
        // every kernel; the packing buffers poisoned with NaN, so that a panel read from
        // the buffer that was never packed shows.
        let tall = 3 * FEW_ROWS;
        // (`NC + 52`: a second block of columns, whose 48 whole ones take the wide tiles.)
        // (`(300, 300)`: the AVX-512 wide tiles of every width across a KC slice.)
        for &(n, k) in
            &[(1, 1), (15, 5), (16, 3), (17, 300), (40, 7), (77, 33), (130, 20), (200, 9), (300, 300), (NC + 52, 3)]
        {
            let a_tall = matrix(tall, k, 11);
            // The same values column-major (A's steps strided).
            let mut a_columns = Array2::zeros((tall, k).f());
            a_columns.assign(&a_tall);
            // A's rows in reverse (a negative row stride).
            let a_reversed = a_tall.slice(s![..;-1, ..]);
            let b_store = matrix(k + 3, n + 5, 12);
            let wide = b_store.slice(s![..k, 2..n + 2]);
            let reversed = b_store.slice(s![..k;-1, ..n]);
            // Exactly `k × n`: a read past B's last column would leave its allocation
            // (valgrind's runs of these tests see it).
            let exact = matrix(k, n, 14);
            for (which, b) in [wide, reversed, exact.view()].into_iter().enumerate() {
                for kernel in Kernel::all_available() {
                    for beta in [0.0f32, 1.0, 0.5] {
                        let once = which == 2 && beta == 0.5;
                        if (n > NC && !once) || (k > KC && n > 256 && !once && (which < 2 || beta != 0.0)) {
                            // The second column block once, and the wide tiles across a
                            // KC slice once with alpha 1 and once with 0.5: each case is a
                            // tenth of a second in a debug build, far more under valgrind.
                            continue;
                        }
                        let alpha = if beta == 0.5 { 0.5 } else { 1.0 };
                        let start = matrix(tall, n, 13);
                        let mut scratch = vec![MaybeUninit::new(f32::NAN); scratch_len(tall, n, k)];
                        // The tall products (packed), of A's rows and (with the first B)
                        // of its rows reversed.
                        let [mut packed, mut packed_reversed] = [start.clone(), start.clone()];
                        sgemm_with(kernel, alpha, a_tall.view(), b, beta, packed.view_mut(), &mut scratch).unwrap();
                        let layouts = if which == 0 { 3 } else { 2 };
                        if which == 0 {
                            let c = packed_reversed.view_mut();
                            sgemm_with(kernel, alpha, a_reversed, b, beta, c, &mut scratch).unwrap();
                        }
                        for m in 1..=FEW_ROWS + 1 {
                            // A's layout by the number of rows: each layout meets the wide
                            // tiles (up to four rows) and the kernel's (more).
                            let (a, packed) = match m % layouts {
                                0 => (a_tall.slice(s![..m, ..]), &packed),
                                1 => (a_columns.slice(s![..m, ..]), &packed),
                                _ => (a_reversed.slice(s![..m, ..]), &packed_reversed),
                            };
                            let mut few = start.slice(s![..m, ..]).to_owned();
                            scratch.fill(MaybeUninit::new(f32::NAN));
                            sgemm_with(kernel, alpha, a, b, beta, few.view_mut(), &mut scratch).unwrap();
                            // And into a column-major C (its tiles stored through a buffer).
                            let mut columns = Array2::zeros((m, n).f());
                            columns.assign(&start.slice(s![..m, ..]));
                            scratch.fill(MaybeUninit::new(f32::NAN));
                            sgemm_with(kernel, alpha, a, b, beta, columns.view_mut(), &mut scratch).unwrap();
                            for ((i, j), x) in few.indexed_iter() {
                                let want = packed[[i, j]].to_bits();
                                let what = format!("{kernel:?} m {m} n {n} k {k} beta {beta}: ({i}, {j})");
                                assert_eq!(x.to_bits(), want, "{what}");
                                assert_eq!(columns[[i, j]].to_bits(), want, "{what}, C column-major");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn vector_packing_gives_the_bits_of_the_portable_packing() {
        // Row-major and transposed operands, steps that are and are not multiples of the
        // eight-step blocks (with the last block's overflow into the next step), a
        // scaled A, a reversed (negative-stride) view: the AVX kernel packs with register
        // transposes, its portable twin one value at a time, and the kernels' own
        // arithmetic is the same (see the twin test above).
        for (m, n, k) in [(12, 32, 8), (13, 35, 9), (18, 48, 16), (24, 17, 17), (7, 64, 70), (64, 64, 32)] {
            for layout in 0..4u8 {
                for alpha in [1.0f32, 0.5] {
                    let a_store = if layout & 1 == 0 { matrix(m, k, 9) } else { matrix(k, m, 9) };
                    let b_store = if layout & 2 == 0 { matrix(k, n, 10) } else { matrix(n, k, 10) };
                    let a = if layout & 1 == 0 { a_store.view() } else { a_store.t() };
                    let b = if layout & 2 == 0 { b_store.view() } else { b_store.t() };
                    let b = if k % 2 == 0 { b.slice_move(s![.., ..;-1]) } else { b };
                    for kernel in Kernel::all_available() {
                        let mut out = [Array2::zeros((m, n)), Array2::zeros((m, n))];
                        for (which, c) in [kernel, kernel.generic_twin()].into_iter().zip(&mut out) {
                            let mut scratch = vec![MaybeUninit::new(f32::NAN); scratch_len(m, n, k)];
                            sgemm_with(which, alpha, a, b, 0.0, c.view_mut(), &mut scratch).unwrap();
                        }
                        assert_eq!(out[0], out[1], "{kernel:?}: {m}×{n}×{k} layout {layout} alpha {alpha}");
                    }
                }
            }
        }
    }

    #[test]
    fn subviews_with_offsets_and_negative_strides() {
        let big = matrix(40, 50, 7);
        let a = big.slice(s![3..20;2, 5..37]); // 9 × 32, row stride 100
        let b_store = matrix(32, 21, 8);
        let b = b_store.slice(s![.., ..;-1]); // reversed columns
        let mut c = Array2::<f32>::zeros((9, 21));
        let mut scratch = vec![MaybeUninit::uninit(); scratch_len(9, 21, 32)];
        sgemm(1.0, a, b, 0.0, c.view_mut(), &mut scratch).unwrap();
        let expected = reference(1.0, &a, &b, 0.0, &c);
        for ((i, j), &want) in expected.indexed_iter() {
            assert!((f64::from(c[[i, j]]) - want).abs() < 1e-4, "({i}, {j})");
        }
    }

    #[test]
    fn degenerate_shapes_follow_blas() {
        let a = Array2::<f32>::zeros((3, 0));
        let b = Array2::<f32>::zeros((0, 4));
        let mut c = Array2::<f32>::from_elem((3, 4), f32::NAN);
        let mut scratch = vec![MaybeUninit::uninit(); scratch_len(3, 4, 0)];
        sgemm(1.0, a.view(), b.view(), 0.0, c.view_mut(), &mut scratch).unwrap();
        assert!(c.iter().all(|&x| x == 0.0), "beta = 0 overwrites C even when k = 0");
        c.fill(2.0);
        sgemm(1.0, a.view(), b.view(), 0.5, c.view_mut(), &mut scratch).unwrap();
        assert!(c.iter().all(|&x| x == 1.0));
    }

    #[test]
    fn bad_shapes_and_short_scratch_are_errors() {
        let a = matrix(4, 5, 1);
        let b = matrix(6, 3, 2);
        let mut c = Array2::<f32>::from_elem((4, 3), 7.0);
        let mut scratch = vec![MaybeUninit::uninit(); scratch_len(4, 3, 6)];
        let err = sgemm(1.0, a.view(), b.view(), 0.0, c.view_mut(), &mut scratch).unwrap_err();
        assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
        let b = matrix(5, 3, 2);
        let mut short = vec![MaybeUninit::uninit(); scratch_len(4, 3, 5) - 1];
        let err = sgemm(1.0, a.view(), b.view(), 0.0, c.view_mut(), &mut short).unwrap_err();
        assert!(err.to_string().contains("scratch_len"), "{err}");
        assert!(c.iter().all(|&x| x == 7.0), "C untouched on error");
    }

    #[test]
    fn causal_products_give_the_full_products_values() {
        // Square triangles across tile edges, MC blocks (m > 96) and KC slices (k > 256),
        // with transposed operands as attention takes them; every kernel; beta 0 and 1.
        for &(m, other) in &[(1, 3), (7, 5), (64, 32), (64, 64), (131, 17), (300, 9)] {
            let lower = |seed| {
                let mut a = matrix(m, m, seed);
                a.indexed_iter_mut().for_each(|((i, p), v)| *v = if p > i { 0.0 } else { *v });
                a
            };
            for kernel in Kernel::all_available() {
                for beta in [0.0, 1.0] {
                    let check = |tri: Triangle, a: ArrayView2<'_, f32>, b: ArrayView2<'_, f32>| {
                        let (rows, n, k) = (a.nrows(), b.ncols(), a.ncols());
                        let start = matrix(rows, n, 9);
                        let mut scratch = vec![MaybeUninit::uninit(); scratch_len(rows, n, k)];
                        let mut full = start.clone();
                        sgemm_with(kernel, 0.5, a, b, beta, full.view_mut(), &mut scratch).unwrap();
                        // NaN in every packing slot: a step the causal product skips
                        // when packing must be one its micro-kernel skips too.
                        scratch.fill(MaybeUninit::new(f32::NAN));
                        let mut causal = start.clone();
                        sgemm_full(kernel, 0.5, a, b, beta, causal.view_mut(), &mut scratch, tri).unwrap();
                        for ((i, j), &x) in full.indexed_iter() {
                            if tri == Triangle::LowerC && j > i {
                                continue;
                            }
                            // `==`: the same values (a zero's sign may differ).
                            assert!(causal[[i, j]] == x, "{kernel:?} {tri:?} m {m} beta {beta}: ({i}, {j})");
                        }
                    };
                    let (l, b) = (lower(1), matrix(m, other, 2));
                    check(Triangle::LowerA, l.view(), b.view());
                    check(Triangle::UpperA, l.t(), b.view());
                    let (q, k) = (matrix(m, other, 3), matrix(m, other, 4));
                    check(Triangle::LowerC, q.view(), k.t());
                }
            }
        }
        // The triangle's matrix must be square.
        let (a, b) = (matrix(4, 5, 1), matrix(5, 4, 2));
        let mut c = Array2::<f32>::zeros((4, 4));
        let mut scratch = vec![MaybeUninit::uninit(); scratch_len(4, 4, 5)];
        let err = sgemm_tri(1.0, a.view(), b.view(), 0.0, c.view_mut(), &mut scratch, Triangle::LowerA).unwrap_err();
        assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
        assert!(sgemm_tri(1.0, a.view(), b.view(), 0.0, c.view_mut(), &mut scratch, Triangle::LowerC).is_ok());
    }
}
