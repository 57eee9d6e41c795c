//! Packing the two layouts whose panels run across memory, with register transposes.
//!
//! A panel interleaves `lines` lines of an operand step by step: `panel[p·lines + l]`
//! is line `l` at step `p`. When the lines are contiguous in the step direction — the
//! rows of a row-major A (every forward product's activations), the columns of a
//! transposed B (`dy·Wᵀ` in every backward pass, `Kᵀ` in attention's scores) — the
//! portable loop reads one line at a time and writes it `lines` elements apart, one
//! scalar at a time; for the small products of a transformer (a head's `64 × 32` by
//! `32 × 64`) that cost a third of the time the micro-kernel took. Here eight lines are
//! read eight steps at a time and transposed in registers (the 8×8 transpose of
//! Intel's optimisation manual, 24 shuffles), and each step's eight values are stored
//! with one write.
//!
//! Packing moves values (and multiplies A by `alpha`, one rounding as in the portable
//! loop), so both paths give the same bits; the parent module's tests compare them.

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::{
        __m256, _mm256_loadu_ps, _mm256_mul_ps, _mm256_permute2f128_ps, _mm256_set1_ps, _mm256_setzero_ps,
        _mm256_shuffle_ps, _mm256_storeu_ps, _mm256_unpackhi_ps, _mm256_unpacklo_ps,
    };

    /// Whether [`interleave`] takes panels of `lines` lines.
    pub(in crate::nn::gemm) fn usable(lines: usize) -> bool {
        (4..8).contains(&lines) || (lines > 0 && lines.is_multiple_of(8))
    }

    /// `out[j]` = element `j` of every `r[i]`, in `i` order.
    #[target_feature(enable = "avx")]
    #[inline]
    fn transpose(r: [__m256; 8]) -> [__m256; 8] {
        let t = [
            _mm256_unpacklo_ps(r[0], r[1]),
            _mm256_unpackhi_ps(r[0], r[1]),
            _mm256_unpacklo_ps(r[2], r[3]),
            _mm256_unpackhi_ps(r[2], r[3]),
            _mm256_unpacklo_ps(r[4], r[5]),
            _mm256_unpackhi_ps(r[4], r[5]),
            _mm256_unpacklo_ps(r[6], r[7]),
            _mm256_unpackhi_ps(r[6], r[7]),
        ];
        let s = [
            _mm256_shuffle_ps::<0x44>(t[0], t[2]),
            _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
            _mm256_shuffle_ps::<0x44>(t[1], t[3]),
            _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
            _mm256_shuffle_ps::<0x44>(t[4], t[6]),
            _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
            _mm256_shuffle_ps::<0x44>(t[5], t[7]),
            _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
        ];
        [
            _mm256_permute2f128_ps::<0x20>(s[0], s[4]),
            _mm256_permute2f128_ps::<0x20>(s[1], s[5]),
            _mm256_permute2f128_ps::<0x20>(s[2], s[6]),
            _mm256_permute2f128_ps::<0x20>(s[3], s[7]),
            _mm256_permute2f128_ps::<0x31>(s[0], s[4]),
            _mm256_permute2f128_ps::<0x31>(s[1], s[5]),
            _mm256_permute2f128_ps::<0x31>(s[2], s[6]),
            _mm256_permute2f128_ps::<0x31>(s[3], s[7]),
        ]
    }

    /// Eight steps from `p0` of the `lanes` (at most 8) lines from line `first`, times
    /// `alpha`; the rows past `lanes` zero.
    ///
    /// # Safety
    ///
    /// The CPU has AVX; for every `i < lanes`, `src + (first + i)·line_stride` is
    /// readable for steps `p0 .. p0 + 8`.
    #[target_feature(enable = "avx")]
    #[inline]
    unsafe fn load_block(
        src: *const f32,
        line_stride: isize,
        first: usize,
        lanes: usize,
        p0: usize,
        alpha: f32,
    ) -> [__m256; 8] {
        let scale = _mm256_set1_ps(alpha);
        let mut r = [_mm256_setzero_ps(); 8];
        for (i, r) in r.iter_mut().enumerate().take(lanes) {
            // SAFETY: line `first + i`, steps `p0 .. p0 + 8`, readable per the contract.
            let v = unsafe { _mm256_loadu_ps(src.offset((first + i) as isize * line_stride).add(p0)) };
            *r = if alpha == 1.0 { v } else { _mm256_mul_ps(scale, v) };
        }
        r
    }

    /// Writes `panel[p·lines + l] = alpha · src[l·line_stride + p]` for the leading
    /// steps `p` it can take eight at a time, and returns how many it wrote: the caller
    /// packs steps from there to `kc` one at a time. When `lines` is not a multiple of
    /// 8 the last group's eight-wide stores run into the next step's slots (rewritten
    /// by that step's store), so such a block is stored so only while a step follows
    /// it (the block ending at `kc` goes through a buffer); such a group must be the
    /// only one (`lines < 8`), or a later group's overflow would land on an earlier
    /// group's values of the next step, and at least 4 lines wide, so that the last
    /// store's overflow (`8 − lines` slots) stays within the next step's slots.
    ///
    /// # Safety
    ///
    /// The CPU has AVX; [`usable`]`(lines)` (`4 <= lines < 8`, or a multiple of 8); for
    /// every `l < lines`, `src + l·line_stride` is readable for `kc` elements; `panel` is
    /// writable for `lines·kc` elements.
    #[target_feature(enable = "avx")]
    pub(in crate::nn::gemm) unsafe fn interleave(
        src: *const f32,
        line_stride: isize,
        lines: usize,
        kc: usize,
        alpha: f32,
        panel: *mut f32,
    ) -> usize {
        debug_assert!(usable(lines), "{lines} lines");
        let whole = lines.is_multiple_of(8);
        let mut p0 = 0;
        while p0 + 8 < kc || (whole && p0 + 8 == kc) {
            for g in (0..lines).step_by(8) {
                // SAFETY: lines `g .. g + min(8, lines - g)` exist, steps `p0 .. p0 + 8 <= kc`.
                let r = unsafe { load_block(src, line_stride, g, (lines - g).min(8), p0, alpha) };
                for (q, column) in transpose(r).into_iter().enumerate() {
                    // SAFETY: slots `(p0+q)·lines + g .. + 8`: inside the panel when the
                    // group is whole (`g + 8 <= lines`); otherwise the last `8 - lanes`
                    // fall on step `p0 + q + 1 < kc`'s first slots (the loop's bound).
                    unsafe { _mm256_storeu_ps(panel.add((p0 + q) * lines + g), column) };
                }
            }
            p0 += 8;
        }
        if !whole && p0 + 8 == kc {
            // The last eight steps of a group narrower than 8 (the only group): no step
            // follows to take the overflow, so each step's values go through a buffer.
            // SAFETY: lines `0 .. lines`, steps `p0 .. p0 + 8 == kc`.
            let r = unsafe { load_block(src, line_stride, 0, lines, p0, alpha) };
            for (q, column) in transpose(r).into_iter().enumerate() {
                let mut values = [0.0f32; 8];
                // SAFETY: `values` holds eight values.
                unsafe { _mm256_storeu_ps(values.as_mut_ptr(), column) };
                for (l, &v) in values.iter().enumerate().take(lines) {
                    // SAFETY: slot `(p0+q)·lines + l` lies in the panel (`p0 + q < kc`,
                    // `l < lines`).
                    unsafe { *panel.add((p0 + q) * lines + l) = v };
                }
            }
            p0 += 8;
        }
        p0
    }
}
