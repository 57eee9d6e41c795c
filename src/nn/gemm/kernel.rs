//! Micro-kernels: `C[MR×NR] = acc + beta·C` where `acc = Σ_p A_panel[p] ⊗ B_panel[p]`.
//!
//! The packed panels hold `kc` steps of `MR` values of A and `NR` values of B each
//! (see `pack_a`/`pack_b` in the parent module), so a kernel streams both panels with
//! unit stride and keeps the whole `MR×NR` accumulator in registers, as the BLIS
//! micro-kernels do (Van Zee & van de Geijn, "BLIS: A Framework for Rapidly
//! Instantiating BLAS Functionality", ACM TOMS 2015): 16 of the 32 AVX-512 registers
//! for an 8×32 tile (or 16×16 for outputs at most 16 wide, such as class scores, so
//! that narrow products do not pay for 32 columns), 12 of the 16 AVX registers for a
//! 6×16 tile (the shape of the BLIS Haswell kernel).
//!
//! Which kernel runs is decided per call by [`Kernel::detect`] from the CPU (std
//! caches its features) and the output width, so the same machine and shapes always
//! take the same path. Every kernel adds
//! the products of one output element in step order with fused multiply-adds and
//! finishes with one fused `beta·C + acc`, so all of them give the same bits.

/// Largest tile of any kernel, in elements.
pub(super) const MAX_TILE: usize = 8 * 32;

/// Where a tile's results go: `ptr` is element (0, 0); rows step by `row_stride`,
/// columns by `col_stride` (in elements); only the first `rows × cols` exist.
#[derive(Clone, Copy)]
pub(super) struct Tile {
    pub(super) ptr: *mut f32,
    pub(super) row_stride: isize,
    pub(super) col_stride: isize,
    pub(super) rows: usize,
    pub(super) cols: usize,
}

/// The micro-kernel chosen for this CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kernel {
    /// AVX-512F, 8×32 tiles (x86-64).
    Avx512Wide,
    /// AVX-512F, 16×16 tiles, for outputs at most 16 columns wide (x86-64).
    Avx512Narrow,
    /// AVX2 with fused multiply-add, 6×16 tiles (x86-64).
    Avx2Fma,
    /// Portable Rust with the given tile shape (8×32, 16×16 or 6×16).
    Generic {
        /// Rows of the tile.
        mr: usize,
        /// Columns of the tile.
        nr: usize,
    },
}

impl Kernel {
    /// The tile shapes of all kernels, as portable kernels (they size the scratch).
    pub(super) const SHAPES: [Kernel; 3] =
        [Kernel::Generic { mr: 8, nr: 32 }, Kernel::Generic { mr: 16, nr: 16 }, Kernel::Generic { mr: 6, nr: 16 }];

    /// The best kernel this CPU supports for outputs `n` columns wide.
    #[inline]
    pub(super) fn detect(n: usize) -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return if n <= 16 { Kernel::Avx512Narrow } else { Kernel::Avx512Wide };
            }
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                return Kernel::Avx2Fma;
            }
        }
        Kernel::Generic { mr: 6, nr: 16 }
    }

    /// Every kernel this CPU can run, the portable ones included (for tests).
    #[cfg(test)]
    pub(super) fn all_available() -> Vec<Kernel> {
        let mut kernels = Kernel::SHAPES.to_vec();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                kernels.extend([Kernel::Avx512Wide, Kernel::Avx512Narrow]);
            }
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                kernels.push(Kernel::Avx2Fma);
            }
        }
        kernels
    }

    /// The portable kernel with this kernel's tile shape (for tests).
    #[cfg(test)]
    pub(super) fn generic_twin(self) -> Kernel {
        Kernel::Generic { mr: self.mr(), nr: self.nr() }
    }

    /// Whether the CPU has AVX (every x86 kernel needs it): packing may use it.
    #[inline]
    pub(super) fn has_avx(self) -> bool {
        !matches!(self, Kernel::Generic { .. })
    }

    /// Rows of the tile.
    #[inline]
    pub(super) fn mr(self) -> usize {
        match self {
            Kernel::Avx512Wide => 8,
            Kernel::Avx512Narrow => 16,
            Kernel::Avx2Fma => 6,
            Kernel::Generic { mr, .. } => mr,
        }
    }

    /// Columns of the tile.
    #[inline]
    pub(super) fn nr(self) -> usize {
        match self {
            Kernel::Avx512Wide => 32,
            Kernel::Avx512Narrow => 16,
            Kernel::Avx2Fma => 16,
            Kernel::Generic { nr, .. } => nr,
        }
    }

    /// Runs the kernel over `kc` steps; step `p`'s `nr` values of B start at
    /// `b + p·b_step` (`b_step == nr` for a packed panel; B's row stride when the
    /// kernel reads a row-major B where it lies).
    ///
    /// # Safety
    ///
    /// `a` holds `kc·mr` readable, initialised values, and `b + p·b_step` holds `nr`
    /// for every `p < kc`; `tile`
    /// addresses `rows × cols` (at most `mr × nr`) writable elements, readable too
    /// unless `beta == 0`; `self` came from [`Kernel::detect`] on this CPU (or is one
    /// of [`Kernel::SHAPES`]).
    #[inline]
    pub(super) unsafe fn run(self, kc: usize, a: *const f32, b: *const f32, b_step: isize, beta: f32, tile: Tile) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `detect` saw AVX-512F; the rest is the caller's contract.
            Kernel::Avx512Wide => unsafe { x86::avx512::<8, 2>(kc, a, b, b_step, beta, tile) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Kernel::Avx512Narrow => unsafe { x86::avx512::<16, 1>(kc, a, b, b_step, beta, tile) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `detect` saw AVX2 and FMA; the rest is the caller's contract.
            Kernel::Avx2Fma => unsafe { x86::avx2_6x16(kc, a, b, b_step, beta, tile) },
            // SAFETY: the caller's contract.
            Kernel::Generic { mr: 8, nr: 32 } => unsafe { generic::<8, 32>(kc, a, b, b_step, beta, tile) },
            // SAFETY: the caller's contract.
            Kernel::Generic { mr: 16, nr: 16 } => unsafe { generic::<16, 16>(kc, a, b, b_step, beta, tile) },
            // The remaining shape, 6×16 (the x86 kernels exist only where they are
            // compiled, so nothing else reaches here).
            // SAFETY: the caller's contract.
            _ => unsafe { generic::<6, 16>(kc, a, b, b_step, beta, tile) },
        }
    }
}

/// Copies the tile's `rows × cols` elements of C into `buf` (row-major, `nr` wide).
///
/// # Safety
///
/// As [`Kernel::run`] for `tile`, which must be readable; `rows·nr <= buf.len()`.
#[inline(always)]
unsafe fn gather(tile: Tile, nr: usize, buf: &mut [f32]) {
    for i in 0..tile.rows {
        for j in 0..tile.cols {
            // SAFETY: `i < rows`, `j < cols`: inside the tile.
            buf[i * nr + j] = unsafe { *tile.ptr.offset(i as isize * tile.row_stride + j as isize * tile.col_stride) };
        }
    }
}

/// Copies `buf`'s first `rows × cols` elements (row-major, `nr` wide) into the tile.
///
/// # Safety
///
/// As [`Kernel::run`] for `tile`; `rows·nr <= buf.len()`.
#[inline(always)]
unsafe fn scatter(buf: &[f32], nr: usize, tile: Tile) {
    for i in 0..tile.rows {
        for j in 0..tile.cols {
            // SAFETY: `i < rows`, `j < cols`: inside the tile.
            unsafe { *tile.ptr.offset(i as isize * tile.row_stride + j as isize * tile.col_stride) = buf[i * nr + j] };
        }
    }
}

/// The portable kernel. Never reads C when `beta == 0` (it may hold anything, NaN
/// included).
///
/// # Safety
///
/// As [`Kernel::run`], with `MR × NR` the panels' shape.
unsafe fn generic<const MR: usize, const NR: usize>(
    kc: usize,
    a: *const f32,
    b: *const f32,
    b_step: isize,
    beta: f32,
    tile: Tile,
) {
    let mut acc = [0.0f32; MAX_TILE];
    for p in 0..kc {
        // SAFETY: `p < kc`: inside both panels.
        let (ap, bp) = unsafe { (a.add(p * MR), b.offset(p as isize * b_step)) };
        for i in 0..MR {
            // SAFETY: `i < MR`.
            let ai = unsafe { *ap.add(i) };
            for j in 0..NR {
                // SAFETY: `j < NR`.
                acc[i * NR + j] = ai.mul_add(unsafe { *bp.add(j) }, acc[i * NR + j]);
            }
        }
    }
    if beta != 0.0 {
        let mut c = [0.0f32; MAX_TILE];
        // SAFETY: the caller's contract; C is readable since `beta != 0`.
        unsafe { gather(tile, NR, &mut c) };
        for (acc, c) in acc.iter_mut().zip(&c) {
            *acc = beta.mul_add(*c, *acc);
        }
    }
    // SAFETY: the caller's contract.
    unsafe { scatter(&acc, NR, tile) };
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    use super::{gather, scatter, Tile, MAX_TILE};

    /// How many steps ahead [`avx512_rows`] of one or two rows asks for B's lines: a
    /// token's step reads every weight once, from L3, with too little arithmetic per
    /// line to hide the wait (one stream's step went from 44 to 41 µs at p50; more rows,
    /// bound by their arithmetic, only lost time to the extra instructions).
    const PREFETCH_STEPS: isize = 8;

    /// Stores one `V`-lane accumulator at `c`: `beta·C + acc`, or `acc` when `beta == 0`.
    macro_rules! store_rows {
        ($acc:expr, $tile:expr, $beta:expr, $nr:expr, $lanes:expr, $load:ident, $store:ident, $fmadd:ident, $set1:ident) => {{
            let tile: Tile = $tile;
            let beta: f32 = $beta;
            let vbeta = $set1(beta);
            if tile.rows * tile.cols == $acc.len() * $nr && tile.col_stride == 1 {
                for (i, row) in $acc.iter().enumerate() {
                    // SAFETY: a full tile with unit column stride: row `i` holds `nr`
                    // contiguous writable elements (readable when `beta != 0`).
                    unsafe {
                        let c = tile.ptr.offset(i as isize * tile.row_stride);
                        for (v, acc) in row.iter().enumerate() {
                            let c = c.add(v * $lanes);
                            let out = if beta == 0.0 { *acc } else { $fmadd(vbeta, $load(c), *acc) };
                            $store(c, out);
                        }
                    }
                }
            } else {
                // An edge tile or a strided C: through a buffer, with the same arithmetic.
                let mut buf = [0.0f32; MAX_TILE];
                if beta != 0.0 {
                    // SAFETY: the caller's contract; C is readable since `beta != 0`.
                    unsafe { gather(tile, $nr, &mut buf) };
                }
                for (i, row) in $acc.iter().enumerate() {
                    for (v, acc) in row.iter().enumerate() {
                        // SAFETY: `buf` has room for `MR` rows of `nr`; this is lane
                        // block `v` of row `i`.
                        unsafe {
                            let c = buf.as_mut_ptr().add(i * $nr + v * $lanes);
                            let out = if beta == 0.0 { *acc } else { $fmadd(vbeta, $load(c), *acc) };
                            $store(c, out);
                        }
                    }
                }
                // SAFETY: the caller's contract.
                unsafe { scatter(&buf, $nr, tile) };
            }
        }};
    }

    /// The AVX-512 kernel for `MR × 16·NV` tiles. Stores go through lane masks, so
    /// edge tiles with unit column stride need no buffer.
    ///
    /// # Safety
    ///
    /// As [`super::Kernel::run`], on a CPU with AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn avx512<const MR: usize, const NV: usize>(
        kc: usize,
        a: *const f32,
        b: *const f32,
        b_step: isize,
        beta: f32,
        tile: Tile,
    ) {
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        let (mut a, mut b) = (a, b);
        for _ in 0..kc {
            // SAFETY: each step reads `nr` values of B and `MR` of A, inside the panels
            // (`kc` steps in all, B's `b_step` apart), then moves both pointers one step
            // on (`wrapping_offset`: past the last step B's pointer is not read).
            unsafe {
                let mut bv = [_mm512_setzero_ps(); NV];
                for (v, slot) in bv.iter_mut().enumerate() {
                    *slot = _mm512_loadu_ps(b.add(16 * v));
                }
                for (i, row) in acc.iter_mut().enumerate() {
                    let ai = _mm512_set1_ps(*a.add(i));
                    for (acc, b) in row.iter_mut().zip(&bv) {
                        *acc = _mm512_fmadd_ps(ai, *b, *acc);
                    }
                }
                a = a.add(MR);
                b = b.wrapping_offset(b_step);
            }
        }
        // SAFETY: the caller's contract.
        unsafe { store(&acc, beta, tile) };
    }

    /// A few rows' tile, `M × 16·V`, of a product that reads a row-major B where it
    /// lies: the AVX-512 twin of [`avx2_rows`] (`M·V` accumulators, `M` broadcasts and
    /// one load of B at a time: at most 32 registers), stored as the AVX-512 kernel
    /// stores. Each element is the same sum as the AVX-512 kernel's: the same bits.
    ///
    /// # Safety
    ///
    /// On a CPU with AVX-512F: `a + i·a_row + p·a_step` is a readable value for every
    /// row `i < M` and step `p < kc` (a packed panel: `a_row == 1`; A where it lies: its
    /// strides), and `b + p·b_step` holds `16·V` readable values; `tile` addresses `rows
    /// × cols` (at most `M × 16·V`, and `M·16·V <= MAX_TILE`) writable elements, readable
    /// too unless `beta == 0`.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)] // the kernel's operands, A's in raw parts
    pub(in crate::nn::gemm) unsafe fn avx512_rows<const M: usize, const V: usize>(
        kc: usize,
        a: *const f32,
        a_row: isize,
        a_step: isize,
        b: *const f32,
        b_step: isize,
        beta: f32,
        tile: Tile,
    ) {
        // A tile a strided C's buffer (`store_strided`) holds; checked when compiled.
        const { assert!(M * 16 * V <= MAX_TILE, "an AVX-512 few-row tile larger than MAX_TILE") };
        let mut acc = [[_mm512_setzero_ps(); V]; M];
        let (mut a, mut b) = (a, b);
        for _ in 0..kc {
            // SAFETY: step `p < kc` reads `M` values of A and `16·V` of B, per the
            // contract; then both pointers move one step on (`wrapping_offset`: past the
            // last step they are not read).
            unsafe {
                let mut ai = [_mm512_setzero_ps(); M];
                for (i, ai) in ai.iter_mut().enumerate() {
                    *ai = _mm512_set1_ps(*a.offset(i as isize * a_row));
                }
                for v in 0..V {
                    if M <= 2 {
                        // A hint only: it reads nothing and never faults, past B's end
                        // included (`wrapping_offset`: the address is not dereferenced).
                        // (A wrapping product too: a one-step B may have any stride.)
                        let ahead = b.wrapping_offset(b_step.wrapping_mul(PREFETCH_STEPS)).wrapping_add(16 * v);
                        _mm_prefetch::<_MM_HINT_T0>(ahead.cast::<i8>());
                    }
                    let bv = _mm512_loadu_ps(b.add(16 * v));
                    for (row, ai) in acc.iter_mut().zip(&ai) {
                        row[v] = _mm512_fmadd_ps(*ai, bv, row[v]);
                    }
                }
                a = a.wrapping_offset(a_step);
                b = b.wrapping_offset(b_step);
            }
        }
        // SAFETY: the caller's contract.
        unsafe { store(&acc, beta, tile) };
    }

    /// The AVX-512 kernels' store of `MR × 16·NV` accumulators to `tile`: `beta·C + acc`
    /// (`acc` when `beta == 0`), through lane masks when C's columns are contiguous (an
    /// edge tile needs no buffer), else through [`store_strided`].
    ///
    /// # Safety
    ///
    /// As [`super::Kernel::run`] for the tile (`rows × cols`, at most `MR × 16·NV`,
    /// writable, readable unless `beta == 0`), on a CPU with AVX-512F.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store<const MR: usize, const NV: usize>(acc: &[[__m512; NV]; MR], beta: f32, tile: Tile) {
        if tile.col_stride != 1 {
            // SAFETY: the caller's contract.
            return unsafe { store_strided(acc, beta, tile) };
        }
        let vbeta = _mm512_set1_ps(beta);
        for (i, row) in acc.iter().enumerate().take(tile.rows) {
            for (v, acc) in row.iter().enumerate() {
                let lanes = tile.cols.saturating_sub(16 * v).min(16);
                if lanes == 0 {
                    break;
                }
                let mask: __mmask16 = if lanes == 16 { !0 } else { (1u16 << lanes) - 1 };
                // SAFETY: row `i < rows`; the mask covers columns `16v .. 16v + lanes`,
                // all `< cols`, contiguous (unit column stride) and writable, readable
                // when `beta != 0`.
                unsafe {
                    let c = tile.ptr.offset(i as isize * tile.row_stride).add(16 * v);
                    let out =
                        if beta == 0.0 { *acc } else { _mm512_fmadd_ps(vbeta, _mm512_maskz_loadu_ps(mask, c), *acc) };
                    _mm512_mask_storeu_ps(c, mask, out);
                }
            }
        }
    }

    /// The AVX-512 kernel's store for a tile whose columns are not contiguous: through
    /// buffers of a frame of its own, so that the kernel's frame (on every caller's
    /// stack) stays small.
    ///
    /// # Safety
    ///
    /// As [`super::Kernel::run`], on a CPU with AVX-512F.
    #[cold]
    #[inline(never)]
    #[target_feature(enable = "avx512f")]
    unsafe fn store_strided<const MR: usize, const NV: usize>(acc: &[[__m512; NV]; MR], beta: f32, tile: Tile) {
        let nr = 16 * NV;
        let mut buf = [0.0f32; MAX_TILE];
        for (i, row) in acc.iter().enumerate() {
            for (v, acc) in row.iter().enumerate() {
                // SAFETY: lane block `v` of row `i` lies inside `buf` (`MR·nr <= MAX_TILE`).
                unsafe { _mm512_storeu_ps(buf.as_mut_ptr().add(i * nr + 16 * v), *acc) };
            }
        }
        let mut c = [0.0f32; MAX_TILE];
        if beta != 0.0 {
            // SAFETY: the caller's contract; C is readable since `beta != 0`.
            unsafe { gather(tile, nr, &mut c) };
        }
        for (acc, c) in buf.iter_mut().zip(&c) {
            *acc = if beta == 0.0 { *acc } else { beta.mul_add(*c, *acc) };
        }
        // SAFETY: the caller's contract.
        unsafe { scatter(&buf, nr, tile) };
    }

    /// The 6×16 AVX2/FMA kernel.
    ///
    /// # Safety
    ///
    /// As [`super::Kernel::run`], on a CPU with AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn avx2_6x16(kc: usize, a: *const f32, b: *const f32, b_step: isize, beta: f32, tile: Tile) {
        const MR: usize = 6;
        const NR: usize = 16;
        let mut acc = [[_mm256_setzero_ps(); 2]; MR];
        let (mut a, mut b) = (a, b);
        for _ in 0..kc {
            // SAFETY: as in the AVX-512 kernel.
            unsafe {
                let b0 = _mm256_loadu_ps(b);
                let b1 = _mm256_loadu_ps(b.add(8));
                for (i, row) in acc.iter_mut().enumerate() {
                    let ai = _mm256_broadcast_ss(&*a.add(i));
                    row[0] = _mm256_fmadd_ps(ai, b0, row[0]);
                    row[1] = _mm256_fmadd_ps(ai, b1, row[1]);
                }
                a = a.add(MR);
                b = b.wrapping_offset(b_step);
            }
        }
        store_rows!(acc, tile, beta, NR, 8, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_fmadd_ps, _mm256_set1_ps);
    }

    /// A few rows' tile, `M × 8·V`, of a product that reads a row-major B where it lies
    /// (the parent module's `FEW_ROWS`): the 6×16 kernel would spend most of its fused
    /// multiply-adds on the zero rows that pad one or two rows to six, so these take as
    /// many columns as the registers hold for `M` rows instead (`M·V` accumulators, and
    /// `M` broadcasts with one load of B at a time, or for a tile of up to six rows by
    /// 16, A read where it lies, the `V` loads of B with one broadcast at a time: at
    /// most 16 registers either way). Each element is the same sum as the 6×16 kernel's
    /// (the products in step order, then one fused `beta·C + acc`): the same bits.
    ///
    /// # Safety
    ///
    /// On a CPU with AVX2 and FMA: `a + i·a_row + p·a_step` is a readable value for
    /// every row `i < M` and step `p < kc` (as in [`avx512_rows`]), and `b + p·b_step`
    /// holds `8·V` readable values; `tile` addresses `rows × cols` (at most `M × 8·V`)
    /// writable elements, readable too unless `beta == 0`.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)] // the kernel's operands, A's in raw parts
    pub(in crate::nn::gemm) unsafe fn avx2_rows<const M: usize, const V: usize>(
        kc: usize,
        a: *const f32,
        a_row: isize,
        a_step: isize,
        b: *const f32,
        b_step: isize,
        beta: f32,
        tile: Tile,
    ) {
        // A tile a strided C's buffer (`store_rows!`) holds; checked when compiled.
        const { assert!(M * 8 * V <= MAX_TILE, "an AVX2 few-row tile larger than MAX_TILE") };
        let mut acc = [[_mm256_setzero_ps(); V]; M];
        let (mut a, mut b) = (a, b);
        for _ in 0..kc {
            // SAFETY: step `p < kc` reads `M` values of A and `8·V` of B, per the
            // contract; then both pointers move one step on (`wrapping_offset`: past the
            // last step they are not read).
            unsafe {
                if M * V + V < 16 {
                    // B's values of the step held, then one broadcast of A at a time (the
                    // 6×16 kernel's order): `M·V + V + 1` registers.
                    let mut bv = [_mm256_setzero_ps(); V];
                    for (v, bv) in bv.iter_mut().enumerate() {
                        *bv = _mm256_loadu_ps(b.add(8 * v));
                    }
                    for (i, row) in acc.iter_mut().enumerate() {
                        let ai = _mm256_broadcast_ss(&*a.offset(i as isize * a_row));
                        for (acc, bv) in row.iter_mut().zip(&bv) {
                            *acc = _mm256_fmadd_ps(ai, *bv, *acc);
                        }
                    }
                } else {
                    // Wide tiles: A's values of the step held, then one load of B at a
                    // time: `M·V + M + 1` registers.
                    let mut ai = [_mm256_setzero_ps(); M];
                    for (i, ai) in ai.iter_mut().enumerate() {
                        *ai = _mm256_broadcast_ss(&*a.offset(i as isize * a_row));
                    }
                    for v in 0..V {
                        let bv = _mm256_loadu_ps(b.add(8 * v));
                        for (row, ai) in acc.iter_mut().zip(&ai) {
                            row[v] = _mm256_fmadd_ps(*ai, bv, row[v]);
                        }
                    }
                }
                a = a.wrapping_offset(a_step);
                b = b.wrapping_offset(b_step);
            }
        }
        store_rows!(acc, tile, beta, 8 * V, 8, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_fmadd_ps, _mm256_set1_ps);
    }
}
