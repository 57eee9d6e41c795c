//! The transformer layers' elementwise and row kernels (GELU, layer normalisation, the
//! causal softmax and its gradient), written once as loops over contiguous slices and
//! compiled three times: for AVX-512, for AVX2 and for the baseline, chosen at run time
//! as [`simd`](super::simd) chooses its loops.
//!
//! The bits are the same in every version and on every machine:
//! - every operation is a plain `f32` operation or a fused multiply-add written as
//!   `mul_add`, each correctly rounded whatever the vector width: a fused multiply-add
//!   is one rounding, whether an FMA instruction computes it (the AVX2 loops, which
//!   run only where the CPU has FMA, and the AVX-512 ones) or the C library's correctly
//!   rounded `fmaf` (the baseline loop, slower; this relies on the platform's `fmaf`
//!   being correctly rounded, as `f32::mul_add` documents and glibc and musl provide);
//!   nothing else is fused (Rust never contracts `a * b + c`);
//! - sums are taken in eight interleaved lanes, element `j` into lane `j % 8`, the
//!   lanes then added in one fixed tree ([`lane_sum`]): an order the compiler can
//!   vectorise at any width without reassociating anything;
//! - `tanh` and `exp` are rational and polynomial approximations in those operations
//!   ([`fast_tanh`], [`fast_exp`]) rather than the C library's, which differ between
//!   libraries and cannot be vectorised.
//!
//! A row that is not contiguous (a view a caller built with strides) runs the same
//! operations in the same order element by element ([`lane_sum_iter`]), so the result
//! does not depend on the layout either.

use std::cell::RefCell;
use std::mem::MaybeUninit;

use ndarray::{ArrayView, ArrayView1, ArrayView2, ArrayViewMut, ArrayViewMut1, ArrayViewMut2, Dimension, Zip};
use std::sync::{Mutex, PoisonError};

use super::gelu::GeluForm;
use super::gemm::KC;

/// Lanes of a sum (see the module documentation).
const LANES: usize = 8;

/// The lanes' partial sums added in a fixed tree.
#[inline(always)]
fn fold_lanes(acc: [f32; LANES]) -> f32 {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// `Σ f(j)` for `j < n`: term `j` into lane `j % 8` in order, then the lanes in a fixed
/// tree. Eight terms at a time, so the compiler makes each eight one vector operation.
#[inline(always)]
pub(crate) fn lane_sum_by(n: usize, f: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let whole = n - n % LANES;
    for c in (0..whole).step_by(LANES) {
        for (l, a) in acc.iter_mut().enumerate() {
            *a += f(c + l);
        }
    }
    for j in whole..n {
        acc[j - whole] += f(j);
    }
    fold_lanes(acc)
}

/// `Σ f(x_j)` in [`lane_sum_by`]'s order. Over slices cut in arrays of eight, where an
/// index into a slice would leave a bounds check in each term and the loop scalar.
#[inline(always)]
pub(crate) fn lane_sum(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    lane_sum3(x, x, x, |x, _, _| f(x))
}

/// `Σ a_j·b_j` in [`lane_sum_by`]'s order.
#[inline(always)]
fn lane_dot(a: &[f32], b: &[f32]) -> f32 {
    lane_sum3(a, b, b, |a, b, _| a * b)
}

/// `Σ f(a_j, b_j, c_j)` over the shortest slice's length, in [`lane_sum_by`]'s order.
#[inline(always)]
fn lane_sum3(a: &[f32], b: &[f32], c: &[f32], f: impl Fn(f32, f32, f32) -> f32) -> f32 {
    let n = a.len().min(b.len()).min(c.len());
    let (a, b, c) = (&a[..n], &b[..n], &c[..n]);
    let (a8, a_rest) = a.as_chunks::<LANES>();
    let (b8, b_rest) = b.as_chunks::<LANES>();
    let (c8, c_rest) = c.as_chunks::<LANES>();
    let mut acc = [0.0f32; LANES];
    for ((a, b), c) in a8.iter().zip(b8).zip(c8) {
        for l in 0..LANES {
            acc[l] += f(a[l], b[l], c[l]);
        }
    }
    for (l, ((&a, &b), &c)) in a_rest.iter().zip(b_rest).zip(c_rest).enumerate() {
        acc[l] += f(a, b, c);
    }
    fold_lanes(acc)
}

/// [`lane_sum`] over values in any layout: the same order, so the same bits.
pub(crate) fn lane_sum_iter(values: impl Iterator<Item = f32>) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (j, v) in values.enumerate() {
        acc[j % LANES] += v;
    }
    fold_lanes(acc)
}

/// `tanh(x)` as a rational function (Eigen's `generic_fast_tanh_float`: a degree-13/6
/// odd/even pair on `x` clamped to ±7.9988, where `tanh` is 1 in `f32`): within 4·10⁻⁷
/// of `tanh` everywhere (3.6·10⁻⁷ at worst, near ±6), about forty times faster than the C library's `tanhf`, and
/// vectorisable.
#[inline(always)]
#[allow(clippy::excessive_precision)] // Eigen's coefficients as published; each rounds to its f32
pub(crate) fn fast_tanh(x: f32) -> f32 {
    let x = x.clamp(-7.998_811_7, 7.998_811_7);
    let x2 = x * x;
    let mut p = x2.mul_add(-2.760_768_5e-16, 2.000_187_9e-13);
    p = x2.mul_add(p, -8.604_671_5e-11);
    p = x2.mul_add(p, 5.122_297e-8);
    p = x2.mul_add(p, 1.485_722_4e-5);
    p = x2.mul_add(p, 6.372_619_3e-4);
    p = x2.mul_add(p, 4.893_524_6e-3);
    p *= x;
    let mut q = x2.mul_add(1.198_258_4e-6, 1.185_347_1e-4);
    q = x2.mul_add(q, 2.268_434_6e-3);
    q = x2.mul_add(q, 4.893_525_2e-3);
    p / q
}

/// `eˣ` for `x` in [−87.3, 88] (clamped there; a NaN stays NaN): Cephes' `expf` —
/// `x = n·ln 2 + r` with `n` rounded to nearest by the 1.5·2²³ trick and `ln 2` split in
/// two, a degree-5 polynomial for `eʳ`, `2ⁿ` built in the exponent bits — within 2 ulp
/// of `eˣ`, in operations that vectorise (the C library's `expf` is a call per value).
/// Below −87.3 it returns about 1.2·10⁻³⁸ rather than less: a softmax's terms there
/// are beneath its sum's last bit.
#[inline(always)]
#[allow(clippy::excessive_precision)] // Cephes' coefficients as published
pub(crate) fn fast_exp(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5·2²³: adding it rounds to an integer
    let x = x.clamp(-87.336_55, 88.0);
    let t = x.mul_add(std::f32::consts::LOG2_E, ROUND);
    let n = t - ROUND;
    let r = n.mul_add(2.121_944_4e-4, (-n).mul_add(0.693_359_375, x));
    let mut p = 1.987_569_1e-4f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 5.000_000_1e-1);
    let y = p.mul_add(r * r, r) + 1.0;
    // `t`'s low bits hold `n` (|n| ≤ 127): the exponent field of 2ⁿ is n + 127 ≥ 1.
    let n_int = t.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    y * f32::from_bits(((n_int + 127) as u32) << 23)
}

/// √(2/π), GELU's tanh form's constant.
const GELU_C: f32 = 0.797_884_6;
/// The cubic term's weight in GELU's tanh form.
const GELU_A: f32 = 0.044_715;

/// GELU of one value.
#[inline(always)]
pub(crate) fn gelu(x: f32) -> f32 {
    let u = GELU_C * (GELU_A * x * x).mul_add(x, x);
    let h = 0.5 * x;
    h.mul_add(fast_tanh(u), h)
}

/// GELU's derivative at `x`.
#[inline(always)]
pub(crate) fn gelu_slope(x: f32) -> f32 {
    let x2 = x * x;
    let t = fast_tanh(GELU_C * (GELU_A * x2).mul_add(x, x));
    let sech2 = (-t).mul_add(t, 1.0);
    let inner = x2.mul_add(3.0 * GELU_A, 1.0);
    ((0.5 * GELU_C) * x * sech2).mul_add(inner, t.mul_add(0.5, 0.5))
}

/// `erf(x)` by Abramowitz and Stegun's 7.1.26 (within 1.5·10⁻⁷ in exact arithmetic,
/// about 5·10⁻⁷ in f32 near 0, where `1 − t·r·e` cancels), with [`fast_exp`], in
/// operations that vectorise; ±1 at ±∞, NaN for NaN.
#[inline(always)]
#[allow(clippy::excessive_precision)] // the published coefficients
pub(crate) fn fast_erf(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / 0.327_591_1f32.mul_add(a, 1.0);
    let mut r = 1.061_405_429f32.mul_add(t, -1.453_152_027);
    r = r.mul_add(t, 1.421_413_741);
    r = r.mul_add(t, -0.284_496_736);
    r = r.mul_add(t, 0.254_829_592);
    let e = (-(t * fast_exp(-(a * a)))).mul_add(r, 1.0);
    e.copysign(x)
}

/// `1/√(2π)`, the standard normal density at 0.
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// GELU's exact form at `x`: `x·Φ(x) = ½·x·(1 + erf(x/√2))` (PyTorch's `nn.GELU()`).
#[inline(always)]
pub(crate) fn gelu_exact(x: f32) -> f32 {
    let h = 0.5 * x;
    h.mul_add(fast_erf(x * std::f32::consts::FRAC_1_SQRT_2), h)
}

/// The exact form's derivative at `x`: `Φ(x) + x·φ(x)` (`φ` taken as 0 where it is
/// below f32's normal range, `|x| > 13.2`: [`fast_exp`] stops at about 10⁻³⁸, which a
/// huge `x` would multiply back up).
#[inline(always)]
pub(crate) fn gelu_exact_slope(x: f32) -> f32 {
    let cdf = 0.5f32.mul_add(fast_erf(x * std::f32::consts::FRAC_1_SQRT_2), 0.5);
    let pdf = fast_exp(-0.5 * x * x) * INV_SQRT_2PI;
    let pdf = if x.abs() > 13.2 { 0.0 } else { pdf };
    x.mul_add(pdf, cdf)
}

/// GELU of one value in `form`.
#[inline(always)]
pub(crate) fn gelu_in(form: GeluForm, x: f32) -> f32 {
    match form {
        GeluForm::Tanh => gelu(x),
        GeluForm::Exact => gelu_exact(x),
    }
}

/// GELU's derivative at `x` in `form`.
#[inline(always)]
pub(crate) fn gelu_slope_in(form: GeluForm, x: f32) -> f32 {
    match form {
        GeluForm::Tanh => gelu_slope(x),
        GeluForm::Exact => gelu_exact_slope(x),
    }
}

/// `y = gelu(x)` in `form`, every element of `y` written (the slices are as long). Each
/// form is its own loop (the form chosen once, not per value).
#[inline(always)]
fn gelu_body(x: &[f32], y: &mut [MaybeUninit<f32>], form: GeluForm) {
    assert_eq!(x.len(), y.len(), "gelu's output is as long as its input");
    match form {
        GeluForm::Tanh => y.iter_mut().zip(x).for_each(|(y, &x)| {
            y.write(gelu(x));
        }),
        GeluForm::Exact => y.iter_mut().zip(x).for_each(|(y, &x)| {
            y.write(gelu_exact(x));
        }),
    }
}

#[inline(always)]
fn gelu_backward_body(x: &[f32], dy: &[f32], dx: &mut [f32], form: GeluForm) {
    match form {
        GeluForm::Tanh => dx.iter_mut().zip(x).zip(dy).for_each(|((dx, &x), &g)| *dx = g * gelu_slope(x)),
        GeluForm::Exact => dx.iter_mut().zip(x).zip(dy).for_each(|((dx, &x), &g)| *dx = g * gelu_exact_slope(x)),
    }
}

/// [`gelu_backward_body`] into an uninitialised `dx` (every element written: the three
/// slices are as long).
#[inline(always)]
fn gelu_backward_new_body(x: &[f32], dy: &[f32], dx: &mut [MaybeUninit<f32>], form: GeluForm) {
    assert!(x.len() == dx.len() && dy.len() == dx.len(), "gelu's gradients are as long as its input");
    match form {
        GeluForm::Tanh => dx.iter_mut().zip(x).zip(dy).for_each(|((dx, &x), &g)| {
            dx.write(g * gelu_slope(x));
        }),
        GeluForm::Exact => dx.iter_mut().zip(x).zip(dy).for_each(|((dx, &x), &g)| {
            dx.write(g * gelu_exact_slope(x));
        }),
    }
}

/// One row's mean and reciprocal standard deviation (the biased variance, as
/// `nn.LayerNorm` normalises with).
#[inline(always)]
pub(crate) fn row_statistics(x: &[f32], eps: f32) -> (f32, f32) {
    let n = x.len() as f32;
    let mean = lane_sum(x, |v| v) / n;
    let var = lane_sum(x, |v| (v - mean) * (v - mean)) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// Layer normalisation of the rows of `x` (`n` wide, contiguous) into `y`, every
/// element of `y` written (`x` and `y` whole rows of `gamma`'s width, as `beta`).
#[inline(always)]
fn layer_norm_body(x: &[f32], gamma: &[f32], beta: &[f32], eps: f32, y: &mut [MaybeUninit<f32>]) {
    let n = gamma.len();
    assert!(
        n > 0 && beta.len() == n && x.len() == y.len() && x.len().is_multiple_of(n),
        "layer norm's rows are whole and as wide as its parameters"
    );
    for (x, y) in x.chunks_exact(n).zip(y.chunks_exact_mut(n)) {
        let (mean, rstd) = row_statistics(x, eps);
        for (((y, &x), &g), &b) in y.iter_mut().zip(x).zip(gamma).zip(beta) {
            y.write((x - mean) * rstd * g + b);
        }
    }
}

/// One row's input gradient from its statistics: `dx = rstd·(dx̂ − mean(dx̂) −
/// x̂·mean(dx̂·x̂))` with `dx̂ = dy·gamma`.
#[inline(always)]
fn layer_norm_input_grad_row(x: &[f32], dy: &[f32], gamma: &[f32], (mean, rstd): (f32, f32), dx: &mut [f32]) {
    let n = x.len();
    let (dy, gamma) = (&dy[..n], &gamma[..n]);
    let nf = n as f32;
    let m1 = lane_sum3(dy, gamma, x, |dy, g, _| dy * g) / nf;
    let m2 = lane_sum3(dy, gamma, x, |dy, g, x| (dy * g) * ((x - mean) * rstd)) / nf;
    for (((dx, &x), &g), &w) in dx.iter_mut().zip(x).zip(dy).zip(gamma) {
        let xhat = (x - mean) * rstd;
        *dx = rstd * (g * w - m1 - xhat * m2);
    }
}

/// One row's terms of `dgamma` (`dy·x̂`) and `dbeta` (`dy`), added, over the columns
/// the slices hold (`x` and `dy` cut to the same columns).
#[inline(always)]
fn layer_norm_add_param_grads_row(
    x: &[f32],
    dy: &[f32],
    (mean, rstd): (f32, f32),
    dgamma: &mut [f32],
    dbeta: &mut [f32],
) {
    for (((dw, db), &x), &g) in dgamma.iter_mut().zip(dbeta.iter_mut()).zip(x).zip(dy) {
        *dw += g * ((x - mean) * rstd);
        *db += g;
    }
}

/// One row of layer normalisation's backward pass: adds the row's terms to `dgamma`
/// and `dbeta` and, when asked, writes the row's input gradient.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn layer_norm_backward_row(
    x: &[f32],
    dy: &[f32],
    gamma: &[f32],
    eps: f32,
    dgamma: &mut [f32],
    dbeta: &mut [f32],
    dx: Option<&mut [f32]>,
) {
    let stats = row_statistics(x, eps);
    layer_norm_add_param_grads_row(x, dy, stats, dgamma, dbeta);
    if let Some(dx) = dx {
        layer_norm_input_grad_row(x, dy, gamma, stats, dx);
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn layer_norm_backward_body(
    x: &[f32],
    dy: &[f32],
    gamma: &[f32],
    eps: f32,
    dgamma: &mut [f32],
    dbeta: &mut [f32],
    dx: Option<&mut [f32]>,
) {
    let n = gamma.len();
    match dx {
        Some(dx) => {
            for ((x, dy), dx) in x.chunks_exact(n).zip(dy.chunks_exact(n)).zip(dx.chunks_exact_mut(n)) {
                layer_norm_backward_row(x, dy, gamma, eps, dgamma, dbeta, Some(dx));
            }
        }
        None => {
            for (x, dy) in x.chunks_exact(n).zip(dy.chunks_exact(n)) {
                layer_norm_backward_row(x, dy, gamma, eps, dgamma, dbeta, None);
            }
        }
    }
}

/// The causal softmax of one score row `row` (query `i`: keys `0..=i` count, the rest
/// become 0) over the keys `live` admits (dead ones become 0), in place; returns the
/// row's maximum and the reciprocal of its sum. `again`: rebuild the row from those
/// (given) instead of computing them.
#[inline(always)]
fn softmax_row(row: &mut [f32], i: usize, live: impl Fn(usize) -> bool, again: Option<(f32, f32)>) -> (f32, f32) {
    let (head, tail) = row.split_at_mut(i + 1);
    let (max, inv) = match again {
        Some(stats) => {
            let (max, _) = stats;
            for (j, v) in head.iter_mut().enumerate() {
                let e = fast_exp(*v - max);
                *v = if live(j) { e } else { 0.0 };
            }
            stats
        }
        None => {
            let max = row_max(head, &live);
            for (j, v) in head.iter_mut().enumerate() {
                let e = fast_exp(*v - max);
                *v = if live(j) { e } else { 0.0 };
            }
            (max, 1.0 / lane_sum(head, |v| v))
        }
    };
    for v in head.iter_mut() {
        *v *= inv;
    }
    tail.fill(0.0);
    (max, inv)
}

/// The largest live value of `x` (NaN skipped; −∞ when none is live), the bits of
/// the strict left fold `if live(j) && v > m { v } else { m }` from −∞: where equal
/// values differ in bits (+0 and −0) the first one stays, whatever order a vectorised
/// fold would take (`f32::max` may return either). Taken in lanes, element `j` into lane
/// `j % 16` by the same strict comparison, so that it vectorises: the lanes' largest is
/// the fold's value, and only a largest value of zero needs the first zero's sign.
#[inline(always)]
fn row_max(x: &[f32], live: impl Fn(usize) -> bool) -> f32 {
    const WIDTH: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; WIDTH];
    let (whole, rest) = x.as_chunks::<WIDTH>();
    for (c, chunk) in whole.iter().enumerate() {
        for (l, (m, &v)) in lanes.iter_mut().zip(chunk).enumerate() {
            if live(c * WIDTH + l) && v > *m {
                *m = v;
            }
        }
    }
    for (l, (m, &v)) in lanes.iter_mut().zip(rest).enumerate() {
        if live(whole.len() * WIDTH + l) && v > *m {
            *m = v;
        }
    }
    let max = lanes.iter().fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    if max == 0.0 {
        // Every live value before the first zero is negative: the fold met that zero
        // first and kept it.
        return x.iter().enumerate().find(|&(j, &v)| live(j) && v == 0.0).map_or(max, |(_, &v)| v);
    }
    max
}

/// A softmax's per-row statistics (`[T, 2]`: each row's maximum and the reciprocal of
/// its sum): written by the first pass over the scores, read when they are rebuilt.
pub(crate) enum Stats<'s> {
    /// Compute them, and store them here.
    Write(&'s mut [f32]),
    /// Rebuild the probabilities from these.
    Read(&'s [f32]),
}

/// The causal softmax of a `[T, T]` score block (rows contiguous, `t` wide) in place;
/// `mask` marks live steps.
#[inline(always)]
fn causal_softmax_body(s: &mut [f32], t: usize, mask: Option<&[f32]>, stats: Stats<'_>) {
    match mask {
        None => causal_softmax_by(s, t, |_| true, stats),
        Some(m) => causal_softmax_by(s, t, |j| m[j] != 0.0, stats),
    }
}

/// [`causal_softmax_body`] with the live steps given by `live`.
#[inline(always)]
pub(crate) fn causal_softmax_by(s: &mut [f32], t: usize, live: impl Fn(usize) -> bool + Copy, mut stats: Stats<'_>) {
    for (i, row) in s.chunks_exact_mut(t).enumerate() {
        let given = match &stats {
            Stats::Read(stats) => Some((stats[2 * i], stats[2 * i + 1])),
            Stats::Write(_) => None,
        };
        let (max, inv) = if live(i) {
            softmax_row(row, i, live, given)
        } else {
            row.fill(0.0);
            (0.0, 0.0)
        };
        if let Stats::Write(stats) = &mut stats {
            stats[2 * i] = max;
            stats[2 * i + 1] = inv;
        }
    }
}

/// `dp ← scale · p ⊙ (dp − Σ p⊙dp)` row by row (`t` wide) for a causal softmax's
/// probabilities: row `i`'s terms past step `i` (where `p` is 0) are not read, and
/// its gradient there is 0.
#[inline(always)]
fn causal_softmax_backward_body(p: &[f32], dp: &mut [f32], t: usize, scale: f32) {
    for (i, (p, d)) in p.chunks_exact(t).zip(dp.chunks_exact_mut(t)).enumerate() {
        let (head, tail) = d.split_at_mut((i + 1).min(t));
        let p = &p[..head.len()];
        let dot = lane_dot(p, head);
        for (d, &p) in head.iter_mut().zip(p) {
            *d = scale * p * (*d - dot);
        }
        tail.fill(0.0);
    }
}

/// Generates the dispatching function `$name` and its AVX2 and AVX-512 twins, each
/// compiling `$body` for its target.
macro_rules! multiversion {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) => $body:ident;) => {
        $(#[$doc])*
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                #[allow(clippy::too_many_arguments)]
                fn avx512($($arg: $ty),*) {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn avx2($($arg: $ty),*) {
                    $body($($arg),*)
                }
                match super::simd::Width::detect() {
                    // SAFETY: the CPU has the feature the function is compiled for.
                    super::simd::Width::Avx512 => return unsafe { avx512($($arg),*) },
                    super::simd::Width::Avx2 if std::arch::is_x86_feature_detected!("fma") => {
                        // SAFETY: as above (AVX2 and FMA).
                        return unsafe { avx2($($arg),*) };
                    }
                    _ => {}
                }
            }
            $body($($arg),*)
        }
    };
}

multiversion! {
    /// `y = gelu(x)` elementwise.
    fn gelu_slices(x: &[f32], y: &mut [MaybeUninit<f32>], form: GeluForm) => gelu_body;
}

multiversion! {
    /// `dx = dy · gelu'(x)` elementwise.
    fn gelu_backward_slices(x: &[f32], dy: &[f32], dx: &mut [f32], form: GeluForm) => gelu_backward_body;
}

multiversion! {
    /// `dx = dy · gelu'(x)` elementwise, into an uninitialised `dx`.
    fn gelu_backward_new_slices(x: &[f32], dy: &[f32], dx: &mut [MaybeUninit<f32>], form: GeluForm) => gelu_backward_new_body;
}

multiversion! {
    /// Layer normalisation of contiguous rows `gamma.len()` wide.
    fn layer_norm_slices(x: &[f32], gamma: &[f32], beta: &[f32], eps: f32, y: &mut [MaybeUninit<f32>]) => layer_norm_body;
}

multiversion! {
    /// Layer normalisation's backward pass over contiguous rows: `dgamma` and `dbeta`
    /// are added to, `dx` written.
    fn layer_norm_backward_slices(
        x: &[f32],
        dy: &[f32],
        gamma: &[f32],
        eps: f32,
        dgamma: &mut [f32],
        dbeta: &mut [f32],
        dx: Option<&mut [f32]>,
    ) => layer_norm_backward_body;
}

multiversion! {
    /// The causal softmax of a contiguous `[T, T]` block (see `kernels::causal_softmax`).
    fn causal_softmax_slices(s: &mut [f32], t: usize, mask: Option<&[f32]>, stats: Stats<'_>) => causal_softmax_body;
}

multiversion! {
    /// Every head of one new step of a stream attending to the stream's `steps` steps
    /// so far (itself the last): per head `h` (features `h·hd .. (h + 1)·hd`, `hd =
    /// q.len() / heads`), the scores `scale·q·kⱼ` into `scores[h·steps ..][..steps]`
    /// (`keys` holds the keys transposed, a row of `key_stride` per feature, each step's
    /// in its column), their causal softmax, and `out = Σⱼ pⱼ·vⱼ` (`values` a row of
    /// `value_stride` per step). Each value is the same sequence of operations as the
    /// matrix multiply's and [`causal_softmax_slices`]' for the same step of the whole
    /// sequence (the products of each sum in step order, fused, from 0, a fresh sum per
    /// slice of `KC` terms added to the slices before; the query scaled first, as the
    /// multiply scales A as it packs it): the same bits. The sums of several heads and
    /// blocks run interleaved (each its own chain of fused adds, in its own order), so
    /// that the adds' latency overlaps.
    fn attend_one_slices(
        q: &[f32],
        heads: usize,
        scale: f32,
        keys: &[f32],
        key_stride: usize,
        values: &[f32],
        value_stride: usize,
        scores: &mut [f32],
        out: &mut [f32],
    ) => attend_one_body;
}

/// See [`attend_one_slices`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_one_body(
    q: &[f32],
    heads: usize,
    scale: f32,
    keys: &[f32],
    key_stride: usize,
    values: &[f32],
    value_stride: usize,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let (width, steps) = (q.len(), scores.len() / heads);
    let hd = width / heads;
    // The query scaled once (the value each product reads), held in `out` until the
    // values' sums overwrite it.
    for (o, &x) in out.iter_mut().zip(q) {
        *o = scale * x;
    }
    // The scores 16 steps at a time; the last steps as a whole block too when the keys'
    // rows reach past them (values of other steps, or zeros: finite, their lanes
    // unused).
    let whole = steps / BLOCK * BLOCK;
    let tail_block =
        steps > whole && whole + BLOCK <= key_stride && (width - 1) * key_stride + whole + BLOCK <= keys.len();
    let blocks = whole / BLOCK + usize::from(tail_block);
    let a: &[f32] = out;
    interleaved(
        heads * blocks,
        hd,
        |i| {
            let (h, b) = (i / blocks, i % blocks);
            (h * hd, h * hd * key_stride + b * BLOCK)
        },
        a,
        keys,
        key_stride,
        |i, sums| {
            let (h, b) = (i / blocks, i % blocks);
            let n = BLOCK.min(steps - b * BLOCK);
            scores[h * steps + b * BLOCK..][..n].copy_from_slice(&sums[..n]);
        },
    );
    if !tail_block {
        // Each remaining score alone, the same sums.
        for h in 0..heads {
            for j in blocks * BLOCK..steps {
                scores[h * steps + j] = sliced(hd, |c| (out[h * hd + c], keys[(h * hd + c) * key_stride + j]));
            }
        }
    }
    for row in scores.chunks_exact_mut(steps) {
        softmax_row(row, steps - 1, |_| true, None);
    }
    // The output 16 features at a time, likewise over the steps.
    let blocks = hd / BLOCK;
    let s: &[f32] = scores;
    interleaved(
        heads * blocks,
        steps,
        |i| {
            let (h, b) = (i / blocks, i % blocks);
            (h * steps, h * hd + b * BLOCK)
        },
        s,
        values,
        value_stride,
        |i, sums| {
            let (h, b) = (i / blocks, i % blocks);
            out[h * hd + b * BLOCK..][..BLOCK].copy_from_slice(sums);
        },
    );
    for h in 0..heads {
        for i in blocks * BLOCK..hd {
            out[h * hd + i] = sliced(steps, |j| (scores[h * steps + j], values[j * value_stride + h * hd + i]));
        }
    }
}

/// Lanes of [`attend_one_body`]'s blocks.
const BLOCK: usize = 16;

/// `count` sums of `BLOCK` lanes, sum `i` over `terms` products `a[a_at + t] ·
/// rows[row_at + t·row_stride + lane]` (`(a_at, row_at) = at(i)`), each the matrix
/// multiply's sum: the products in term order from 0, a fresh sum per slice of `KC`
/// terms added to the slices before. Up to four sums run at once, interleaved; `done`
/// gets each sum's lanes.
#[inline(always)]
fn interleaved(
    count: usize,
    terms: usize,
    at: impl Fn(usize) -> (usize, usize),
    a: &[f32],
    rows: &[f32],
    row_stride: usize,
    mut done: impl FnMut(usize, &[f32; BLOCK]),
) {
    let mut first = 0;
    while first < count {
        let left = count - first;
        let taken = match left {
            4.. => group::<4>(first, terms, &at, a, rows, row_stride, &mut done),
            2.. => group::<2>(first, terms, &at, a, rows, row_stride, &mut done),
            _ => group::<1>(first, terms, &at, a, rows, row_stride, &mut done),
        };
        first += taken;
    }
}

/// Sums `first .. first + G` of [`interleaved`]; returns `G`.
#[inline(always)]
fn group<const G: usize>(
    first: usize,
    terms: usize,
    at: &impl Fn(usize) -> (usize, usize),
    a: &[f32],
    rows: &[f32],
    row_stride: usize,
    done: &mut impl FnMut(usize, &[f32; BLOCK]),
) -> usize {
    let ats: [(usize, usize); G] = std::array::from_fn(|g| at(first + g));
    // Every term's reads lie inside `a` and `rows`, checked once here rather than at
    // each term (whose checks would outnumber the arithmetic).
    for &(a_at, row_at) in &ats {
        assert!(a_at + terms <= a.len(), "a sum's terms lie in `a`");
        let end = terms.checked_sub(1).map(|t| t.checked_mul(row_stride).and_then(|r| r.checked_add(row_at + BLOCK)));
        assert!(end.is_none_or(|end| end.is_some_and(|end| end <= rows.len())), "a sum's rows lie in `rows`");
    }
    let mut total = [[0.0f32; BLOCK]; G];
    for (slice, from) in (0..terms).step_by(KC).enumerate() {
        let to = (from + KC).min(terms);
        let mut acc = [[0.0f32; BLOCK]; G];
        for t in from..to {
            for (acc, &(a_at, row_at)) in acc.iter_mut().zip(&ats) {
                // SAFETY: `t < terms`, so `a_at + t < a.len()` and `row_at + t·row_stride
                // + BLOCK <= rows.len()`, as asserted above.
                let (x, row) = unsafe {
                    (
                        *a.get_unchecked(a_at + t),
                        rows.get_unchecked(row_at + t * row_stride..row_at + t * row_stride + BLOCK),
                    )
                };
                for (acc, &r) in acc.iter_mut().zip(row) {
                    *acc = x.mul_add(r, *acc);
                }
            }
        }
        for (total, acc) in total.iter_mut().zip(&acc) {
            add_slice(total, acc, slice);
        }
    }
    for (g, total) in total.iter().enumerate() {
        done(first + g, total);
    }
    G
}

/// `total` after slice `slice` of a sum: the slice's sums (the first), or added to it.
#[inline(always)]
fn add_slice(total: &mut [f32; BLOCK], acc: &[f32; BLOCK], slice: usize) {
    if slice == 0 {
        *total = *acc;
    } else {
        for (t, &a) in total.iter_mut().zip(acc) {
            *t += a;
        }
    }
}

/// `Σ a·b` over `terms` products `term(i) = (a, b)` as the matrix multiply sums one
/// element: fused, in order from 0, a fresh sum per slice of `KC` terms added to the
/// slices before.
#[inline(always)]
fn sliced(terms: usize, term: impl Fn(usize) -> (f32, f32)) -> f32 {
    let mut total = 0.0f32;
    for (slice, from) in (0..terms).step_by(KC).enumerate() {
        let mut acc = 0.0f32;
        for i in from..(from + KC).min(terms) {
            let (a, b) = term(i);
            acc = a.mul_add(b, acc);
        }
        total = if slice == 0 { acc } else { total + acc };
    }
    total
}

multiversion! {
    /// The causal softmax of the score rows of new steps `first..` of a sequence
    /// (contiguous rows `width` wide; row `r`, step `first + r`, attends to steps
    /// `0..=first + r`, the rest of it becomes 0): each row the same operations as row
    /// `first + r` of [`causal_softmax_slices`] without a mask.
    fn causal_softmax_from_slices(s: &mut [f32], width: usize, first: usize) => causal_softmax_from_body;
}

/// See [`causal_softmax_from_slices`].
#[inline(always)]
fn causal_softmax_from_body(s: &mut [f32], width: usize, first: usize) {
    for (r, row) in s.chunks_exact_mut(width).enumerate() {
        softmax_row(row, first + r, |_| true, None);
    }
}

multiversion! {
    /// The softmax's gradient over contiguous rows `t` wide.
    fn causal_softmax_backward_slices(p: &[f32], dp: &mut [f32], t: usize, scale: f32) => causal_softmax_backward_body;
}

/// Loops shorter than this many elements stay on the calling thread: splitting costs a
/// hand-off of a few µs, a pass over 32 Ki values about as much.
const SPLIT_ELEMENTS: usize = 1 << 15;

/// An output shared by the threads of a split loop, each writing a range of its own.
struct SharedOut<T = f32> {
    ptr: *mut T,
    len: usize,
}

impl<T> Clone for SharedOut<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for SharedOut<T> {}

impl<T> SharedOut<T> {
    /// Elements `s..e`.
    ///
    /// # Safety
    ///
    /// `s <= e <= len`, and nothing else reaches those elements while the slice lives.
    unsafe fn range<'a>(&self, s: usize, e: usize) -> &'a mut [T] {
        debug_assert!(s <= e && e <= self.len);
        // SAFETY: the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(s), e - s) }
    }
}

// SAFETY: used only by the split loops of this module (`split`, `split_always`,
// `layer_norm_backward_split`, `split_with_work`), whose threads each write a range of
// the output that no other thread reads or writes (`for_parts` gives every range to one
// thread), while the loop keeps the output borrowed; when `for_parts` runs nothing, the
// pointer is not used. The elements are `f32` or `MaybeUninit<f32>`, both `Send`.
unsafe impl<T: Send> Send for SharedOut<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SharedOut<T> {}

/// Runs `f(s, e, out[s·unit .. e·unit])` over the units `0..units` of `out` (`unit`
/// elements each): across this thread's matrix-multiply pool in one range per thread
/// when there is a pool and the loop is long enough, else `f(0, units, out)` here. Each
/// unit is computed by the same code either way, so the bits do not depend on the
/// split.
pub(crate) fn split<T: Send>(out: &mut [T], units: usize, unit: usize, f: &(dyn Fn(usize, usize, &mut [T]) + Sync)) {
    let units = units.min(out.len() / unit.max(1));
    if units >= 2 && units * unit >= SPLIT_ELEMENTS {
        let shared = SharedOut { ptr: out.as_mut_ptr(), len: units * unit };
        let part = |s: usize, e: usize| {
            // SAFETY: `s..e` lies within `0..units` (`for_parts` cuts `0..units`), so the
            // elements `s·unit .. e·unit` lie within `out`; this range is this call's
            // alone (every range goes to one thread), and `out` stays borrowed, unused
            // otherwise, until every part is done.
            let out = unsafe { shared.range(s * unit, e * unit) };
            f(s, e, out);
        };
        let min_units = SPLIT_ELEMENTS.div_ceil(unit.max(1)).max(2);
        if super::gemm::pool::for_parts(units, min_units, 1, &part) {
            return;
        }
    }
    f(0, units, &mut out[..units * unit]);
}

/// Zeros written into `y` (an uninitialised array, a workspace's
/// [`uninit`](workspace_core::Scope::uninit)), split across this thread's pool as
/// [`split`] splits; `y` initialised. What [`Scope::zeros`](workspace_core::Scope::zeros)
/// gives, with the fill shared by the threads.
pub(crate) fn zeros_new<D: Dimension>(mut y: ArrayViewMut<'_, MaybeUninit<f32>, D>) -> ArrayViewMut<'_, f32, D> {
    match y.as_slice_mut() {
        Some(ys) => {
            let n = ys.len();
            split(ys, n, 1, &|_, _, ys| ys.fill(MaybeUninit::new(0.0)));
        }
        None => y.fill(MaybeUninit::new(0.0)),
    }
    // SAFETY: every element was written: `split` hands out ranges covering `0..n`, one
    // element per unit, each filled; otherwise `fill` wrote every element.
    unsafe { y.assume_init() }
}

/// A copy of `x` written into `y` (uninitialised, of `x`'s shape), split as
/// [`zeros_new`] splits; `y` initialised.
///
/// # Panics
///
/// When the shapes differ.
pub(crate) fn copy_new<'y, D: Dimension>(
    x: ArrayView<'_, f32, D>,
    mut y: ArrayViewMut<'y, MaybeUninit<f32>, D>,
) -> ArrayViewMut<'y, f32, D> {
    assert_eq!(x.shape(), y.shape(), "a copy has its source's shape");
    match (x.as_slice(), y.as_slice_mut()) {
        (Some(xs), Some(ys)) => {
            let n = xs.len();
            split(ys, n, 1, &|s, e, ys| {
                for (y, &x) in ys.iter_mut().zip(&xs[s..e]) {
                    y.write(x);
                }
            });
        }
        _ => y.zip_mut_with(&x, |y, &x| {
            y.write(x);
        }),
    }
    // SAFETY: as in `zeros_new`; the slices are as long (the same shape, both
    // contiguous), and `zip_mut_with` writes every element of `y`.
    unsafe { y.assume_init() }
}

/// `a + b` written into `y` (uninitialised, of their shape), split as [`zeros_new`]
/// splits; `y` initialised. A dry run writes zeros (it issues no arithmetic).
///
/// # Panics
///
/// When the shapes differ.
pub(crate) fn sum_new<'y, D: Dimension>(
    a: ArrayView<'_, f32, D>,
    b: ArrayView<'_, f32, D>,
    mut y: ArrayViewMut<'y, MaybeUninit<f32>, D>,
) -> ArrayViewMut<'y, f32, D> {
    assert!(a.shape() == y.shape() && b.shape() == y.shape(), "a sum has its terms' shape");
    if super::kernels::running() {
        return zeros_new(y);
    }
    match (a.as_slice(), b.as_slice(), y.as_slice_mut()) {
        (Some(a), Some(b), Some(ys)) => {
            let n = ys.len();
            split(ys, n, 1, &|s, e, ys| {
                for ((y, &a), &b) in ys.iter_mut().zip(&a[s..e]).zip(&b[s..e]) {
                    y.write(a + b);
                }
            });
        }
        _ => Zip::from(&mut y).and(&a).and(&b).for_each(|y, &a, &b| {
            y.write(a + b);
        }),
    }
    // SAFETY: as in `copy_new`.
    unsafe { y.assume_init() }
}

/// `acc += x`, elementwise, split as [`split`] splits (a dry run computes nothing).
///
/// # Panics
///
/// When the shapes differ.
pub(crate) fn add_assign<D: Dimension>(mut acc: ArrayViewMut<'_, f32, D>, x: ArrayView<'_, f32, D>) {
    assert_eq!(acc.shape(), x.shape(), "a sum has its terms' shape");
    if super::kernels::running() {
        return;
    }
    match (acc.as_slice_mut(), x.as_slice()) {
        (Some(acc), Some(xs)) => {
            let n = acc.len();
            split(acc, n, 1, &|s, e, acc| {
                for (a, &x) in acc.iter_mut().zip(&xs[s..e]) {
                    *a += x;
                }
            });
        }
        _ => Zip::from(&mut acc).and(&x).for_each(|a, &x| *a += x),
    }
}

/// `row` written into every row of `y` (uninitialised, `[rows, row.len()]`), split by
/// rows as [`split`] splits; `y` initialised: a bias broadcast over a batch.
///
/// # Panics
///
/// When `row` is not as long as `y`'s rows.
pub(crate) fn rows_new<'y>(
    row: ArrayView1<'_, f32>,
    mut y: ArrayViewMut2<'y, MaybeUninit<f32>>,
) -> ArrayViewMut2<'y, f32> {
    let n = y.ncols();
    assert_eq!(row.len(), n, "a row broadcast over rows as long as they are");
    match (row.as_slice(), y.as_slice_mut()) {
        (Some(r), Some(ys)) if n > 0 => {
            let rows = ys.len() / n;
            split(ys, rows, n, &|_, _, ys| {
                for y in ys.chunks_exact_mut(n) {
                    for (y, &v) in y.iter_mut().zip(r) {
                        y.write(v);
                    }
                }
            });
        }
        _ => {
            for mut out in y.rows_mut() {
                out.zip_mut_with(&row, |y, &v| {
                    y.write(v);
                });
            }
        }
    }
    // SAFETY: every element was written: `split` hands out whole rows covering all
    // `rows · n` elements, each row written from `row` (as long); otherwise every row
    // was written.
    unsafe { y.assume_init() }
}

/// `row` assigned to every row of `y`, split by rows as [`rows_new`] splits.
///
/// # Panics
///
/// When `row` is not as long as `y`'s rows.
pub(crate) fn fill_rows(mut y: ArrayViewMut2<'_, f32>, row: ArrayView1<'_, f32>) {
    let n = y.ncols();
    assert_eq!(row.len(), n, "a row broadcast over rows as long as they are");
    match (row.as_slice(), y.as_slice_mut()) {
        (Some(r), Some(ys)) if n > 0 => {
            let rows = ys.len() / n;
            split(ys, rows, n, &|_, _, ys| ys.chunks_exact_mut(n).for_each(|y| y.copy_from_slice(r)));
        }
        _ => y.rows_mut().into_iter().for_each(|mut out| out.assign(&row)),
    }
}

/// `acc = Σ rows`, each column summed in row order (the bits of one thread), the
/// columns split across this thread's pool when the rows are many.
///
/// # Panics
///
/// When `acc` is not as long as the rows.
pub(crate) fn sum_rows(mut acc: ArrayViewMut1<'_, f32>, rows: ArrayView2<'_, f32>) {
    let n = rows.ncols();
    assert_eq!(acc.len(), n, "the sum of rows is as long as they are");
    if super::kernels::running() {
        return;
    }
    match (acc.as_slice_mut(), rows.as_slice()) {
        (Some(acc), Some(xs)) if n > 0 => {
            if xs.len() >= SPLIT_ELEMENTS && super::gemm::pool::has_pool() {
                split_always(acc, n, 1, &|s, _, acc| column_sums(xs, n, s, acc));
            } else {
                column_sums(xs, n, 0, acc);
            }
        }
        _ => {
            acc.fill(0.0);
            for row in rows.rows() {
                Zip::from(&mut acc).and(&row).for_each(|a, &x| *a += x);
            }
        }
    }
}

multiversion! {
    /// Columns `c0 ..` of the rows `xs` (`n` wide), each summed in row order into `acc`.
    fn column_sums(xs: &[f32], n: usize, c0: usize, acc: &mut [f32]) => column_sums_body;
}

/// [`column_sums`]: 32 columns at a time, their sums held in registers down the rows.
#[inline(always)]
fn column_sums_body(xs: &[f32], n: usize, c0: usize, acc: &mut [f32]) {
    const BLOCK: usize = 32;
    let rows = xs.chunks_exact(n);
    let (blocks, rest) = acc.as_chunks_mut::<BLOCK>();
    for (b, block) in blocks.iter_mut().enumerate() {
        let c = c0 + b * BLOCK;
        let mut sums = [0.0f32; BLOCK];
        for row in rows.clone() {
            let row: &[f32; BLOCK] = row[c..c + BLOCK].try_into().expect("a block of columns");
            for j in 0..BLOCK {
                sums[j] += row[j];
            }
        }
        *block = sums;
    }
    let c = c0 + blocks.len() * BLOCK;
    rest.fill(0.0);
    for row in rows {
        for (a, &x) in rest.iter_mut().zip(&row[c..]) {
            *a += x;
        }
    }
}

/// GELU (Hendrycks & Gimpel) in `form`: the tanh form (GPT-2's, PyTorch's
/// `gelu(approximate="tanh")`), `y = ½·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` with
/// [`fast_tanh`], or the exact form `x·Φ(x)` with [`fast_erf`], into `y`, an uninitialised array of `x`'s shape (a workspace's
/// [`uninit`](workspace_core::Scope::uninit)), split as [`split`] splits; `y`
/// initialised. Writing it once saves the pass that zeroing it first would cost. In a
/// dry run, which issues no arithmetic, `y` is zeroed.
///
/// # Panics
///
/// When the shapes differ.
pub(crate) fn gelu_new<'y>(
    x: ArrayView2<'_, f32>,
    mut y: ArrayViewMut2<'y, MaybeUninit<f32>>,
    form: GeluForm,
) -> ArrayViewMut2<'y, f32> {
    assert_eq!(x.dim(), y.dim(), "gelu's output has its input's shape");
    let dry = super::kernels::running();
    match (x.as_slice(), y.as_slice_mut()) {
        (Some(xs), Some(ys)) if !dry => {
            let n = xs.len();
            split(ys, n, 1, &|s, e, ys| gelu_slices(&xs[s..e], ys, form));
        }
        _ => Zip::from(&mut y).and(&x).for_each(|y, &x| {
            y.write(if dry { 0.0 } else { gelu_in(form, x) });
        }),
    }
    // SAFETY: every element of `y` was written: the slices of `x` and `y` are as long
    // (the same shape, both contiguous), `split` hands out ranges covering `0..n` (one
    // element per unit), and `gelu_body` writes every element of its range; the `Zip`
    // writes every element.
    unsafe { y.assume_init() }
}

/// The gradient of GELU's input, `dx = dy · gelu'(x)`, written into `dx` (an
/// uninitialised array of `x`'s shape, as [`gelu_new`] writes GELU; zeros in a dry
/// run); `dx` initialised. The same bits as `kernels::gelu_backward`.
pub(crate) fn gelu_backward_new<'d>(
    x: ArrayView2<'_, f32>,
    dy: ArrayView2<'_, f32>,
    mut dx: ArrayViewMut2<'d, MaybeUninit<f32>>,
    form: GeluForm,
) -> ArrayViewMut2<'d, f32> {
    assert!(x.dim() == dx.dim() && dy.dim() == dx.dim(), "gelu's gradients have its input's shape");
    let dry = super::kernels::running();
    match (x.as_slice(), dy.as_slice(), dx.as_slice_mut()) {
        (Some(xs), Some(dys), Some(dxs)) if !dry => {
            let n = xs.len();
            split(dxs, n, 1, &|s, e, dxs| gelu_backward_new_slices(&xs[s..e], &dys[s..e], dxs, form));
        }
        _ => Zip::from(&mut dx).and(&x).and(&dy).for_each(|dx, &x, &g| {
            dx.write(if dry { 0.0 } else { g * gelu_slope_in(form, x) });
        }),
    }
    // SAFETY: every element of `dx` was written: the three slices are as long (the same
    // shape, all contiguous), `split` hands out ranges covering `0..n` (one element per
    // unit), and `gelu_backward_new_body` writes every element of its range; the `Zip`
    // writes every element.
    unsafe { dx.assume_init() }
}

/// Layer normalisation of each row, `y = (x − mean) / √(var + eps) · gamma + beta` with
/// the biased variance (as `nn.LayerNorm`), sums in lane order, into `y`, an
/// uninitialised array of `x`'s shape, as [`gelu_new`] writes GELU; `y` initialised.
///
/// # Panics
///
/// When the shapes differ, or `gamma` and `beta` are not as wide as the rows.
pub(crate) fn layer_norm_new<'y>(
    x: ArrayView2<'_, f32>,
    gamma: ArrayView1<'_, f32>,
    beta: ArrayView1<'_, f32>,
    eps: f32,
    mut y: ArrayViewMut2<'y, MaybeUninit<f32>>,
) -> ArrayViewMut2<'y, f32> {
    let n = x.ncols();
    assert!(
        x.dim() == y.dim() && gamma.len() == n && beta.len() == n,
        "layer norm's output has its input's shape, its parameters the rows' width"
    );
    let dry = super::kernels::running();
    match (x.as_slice(), gamma.as_slice(), beta.as_slice(), y.as_slice_mut()) {
        (Some(xs), Some(g), Some(b), Some(ys)) if !dry && n > 0 => {
            let rows = xs.len() / n;
            split(ys, rows, n, &|s, e, ys| layer_norm_slices(&xs[s * n..e * n], g, b, eps, ys));
        }
        _ => {
            for (x, mut y) in x.rows().into_iter().zip(y.rows_mut()) {
                let (mean, rstd) = if dry { (0.0, 0.0) } else { strided::row_statistics(x, eps) };
                Zip::from(&mut y).and(&x).and(&gamma).and(&beta).for_each(|y, &x, &g, &b| {
                    y.write(if dry { 0.0 } else { (x - mean) * rstd * g + b });
                });
            }
        }
    }
    // SAFETY: every element of `y` was written: with contiguous arrays `split` hands out
    // whole rows covering all `rows · n` elements (`x` and `y` have the same shape) and
    // `layer_norm_body` writes every element of its rows; otherwise the `Zip` over each
    // row (as long as `gamma` and `beta`, checked above) writes every element.
    unsafe { y.assume_init() }
}

/// One part's working arrays in [`split_with_work`]: values and a matrix multiply's
/// packing space.
pub(crate) struct PartWork<'w> {
    pub(crate) values: &'w mut [f32],
    pub(crate) packing: &'w mut [MaybeUninit<f32>],
}

thread_local! {
    /// A pool helper's working arrays for the parts of [`split_with_work`] it runs: they
    /// grow to the largest asked for and then stay, so a steady loop allocates nothing.
    /// Like the helpers' packing buffers (see `gemm::pool`), they live outside every
    /// workspace, for the pool's life: for a GPT's attention, two `[T, T]` blocks and a
    /// head product's packing space per helper.
    static HELPER_WORK: RefCell<(Vec<f32>, Vec<MaybeUninit<f32>>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// One part of [`split_with_work`]'s loop: `(start, end, a's units, b's units, work)`.
pub(crate) type SequencePart<'f> =
    dyn Fn(usize, usize, &mut [f32], &mut [f32], PartWork<'_>) -> crate::Result<()> + Sync + 'f;

/// Runs `f(s, e, a_units, b_units, work)` over the units `0..units` of `a` and `b` (each
/// cut into `units` equal units): across this thread's matrix-multiply pool in one
/// range per thread when there is a pool, else `f(0, units, a, b, own)` here. The
/// calling thread's part works in `own` (the caller's, from its workspace); a helper's
/// part in working arrays of the helper's own, as long as `own`'s. Each unit is
/// computed by the same code either way, so the bits do not depend on the split. The
/// first error of any part is returned (the other parts still run to their end).
pub(crate) fn split_with_work(
    a: &mut [f32],
    b: &mut [f32],
    units: usize,
    own: PartWork<'_>,
    f: &SequencePart<'_>,
) -> crate::Result<()> {
    let units = units.max(1);
    let (ua, ub) = (a.len() / units, b.len() / units);
    if units >= 2 && super::gemm::pool::has_pool() && !super::kernels::running() {
        let (values, packing) = (own.values.len(), own.packing.len());
        let (sa, sb) =
            (SharedOut { ptr: a.as_mut_ptr(), len: units * ua }, SharedOut { ptr: b.as_mut_ptr(), len: units * ub });
        let own = Mutex::new(Some(own));
        // The error of the earliest part that failed (the same error whatever the timing).
        let failed: Mutex<Option<(usize, crate::Error)>> = Mutex::new(None);
        let part = |p: usize, s: usize, e: usize| {
            if s == e {
                return;
            }
            // SAFETY: `s..e` lies within `0..units` (`for_each_part` cuts `0..units`), so
            // the elements `s·ua .. e·ua` lie within `a` and `s·ub .. e·ub` within `b`;
            // these ranges are this call's alone (every range goes to one thread), and `a`
            // and `b` stay borrowed, unused otherwise, until every part is done.
            let (pa, pb) = unsafe { (sa.range(s * ua, e * ua), sb.range(s * ub, e * ub)) };
            let result = if p == 0 {
                let work = own.lock().unwrap_or_else(PoisonError::into_inner).take();
                match work {
                    Some(work) => f(s, e, pa, pb, work),
                    None => Err(crate::Error::InvalidInput("a split loop ran its first part twice".into())),
                }
            } else {
                HELPER_WORK.with(|work| {
                    let mut work = work.borrow_mut();
                    let (v, k) = &mut *work;
                    if v.len() < values || k.len() < packing {
                        // Amortised growth: sizes that creep up grow the arrays rarely.
                        let grown = v
                            .try_reserve(values.saturating_sub(v.len()))
                            .and_then(|()| k.try_reserve(packing.saturating_sub(k.len())));
                        if let Err(e) = grown {
                            return Err(crate::Error::InvalidInput(format!(
                                "a pool thread's working arrays of {values} + {packing} values cannot be allocated ({e})"
                            )));
                        }
                        v.resize(v.len().max(values), 0.0);
                        k.resize(k.len().max(packing), MaybeUninit::uninit());
                    }
                    f(s, e, pa, pb, PartWork { values: &mut v[..values], packing: &mut k[..packing] })
                })
            };
            if let Err(e) = result {
                let mut failed = failed.lock().unwrap_or_else(PoisonError::into_inner);
                if failed.as_ref().is_none_or(|(first, _)| s < *first) {
                    *failed = Some((s, e));
                }
            }
        };
        if super::gemm::pool::for_each_part(units, 2, 1, &part) {
            return failed.into_inner().unwrap_or_else(PoisonError::into_inner).map_or(Ok(()), |(_, e)| Err(e));
        }
        return match own.into_inner().unwrap_or_else(PoisonError::into_inner) {
            Some(own) => f(0, units, &mut a[..units * ua], &mut b[..units * ub], own),
            None => Err(crate::Error::InvalidInput("a split loop lost its working arrays".into())),
        };
    }
    f(0, units, &mut a[..units * ua], &mut b[..units * ub], own)
}

/// Layer normalisation's input gradients, rows of `x`/`dy` into the rows of `dx`
/// (`gamma.len()` wide), as [`layer_norm_backward_row`] writes them.
#[inline(always)]
fn layer_norm_input_grads_body(x: &[f32], dy: &[f32], gamma: &[f32], eps: f32, dx: &mut [f32]) {
    let n = gamma.len();
    for ((x, dy), dx) in x.chunks_exact(n).zip(dy.chunks_exact(n)).zip(dx.chunks_exact_mut(n)) {
        layer_norm_input_grad_row(x, dy, gamma, row_statistics(x, eps), dx);
    }
}

/// Columns `c0 .. c0 + dgamma.len()` of layer normalisation's `dgamma` and `dbeta`,
/// added over every row (`n` wide) in row order, as [`layer_norm_backward_row`] adds
/// them (each row's statistics computed again).
#[inline(always)]
fn layer_norm_param_grads_body(
    x: &[f32],
    dy: &[f32],
    n: usize,
    eps: f32,
    c0: usize,
    dgamma: &mut [f32],
    dbeta: &mut [f32],
) {
    let c1 = c0 + dgamma.len();
    for (x, dy) in x.chunks_exact(n).zip(dy.chunks_exact(n)) {
        layer_norm_add_param_grads_row(&x[c0..c1], &dy[c0..c1], row_statistics(x, eps), dgamma, dbeta);
    }
}

multiversion! {
    /// [`layer_norm_input_grads_body`] at the widest vectors.
    fn layer_norm_input_grads(x: &[f32], dy: &[f32], gamma: &[f32], eps: f32, dx: &mut [f32]) => layer_norm_input_grads_body;
}

multiversion! {
    /// [`layer_norm_param_grads_body`] at the widest vectors.
    fn layer_norm_param_grads(x: &[f32], dy: &[f32], n: usize, eps: f32, c0: usize, dgamma: &mut [f32], dbeta: &mut [f32]) => layer_norm_param_grads_body;
}

/// Layer normalisation's backward pass split across this thread's pool, when it has
/// one and the rows are many: the input gradients by rows, then `dgamma` and `dbeta`
/// by columns (each column summed over the rows in row order: the bits of the fused
/// loop). `false` when it was not split (the caller runs the fused loop).
pub(crate) fn layer_norm_backward_split(
    x: &[f32],
    dy: &[f32],
    gamma: &[f32],
    eps: f32,
    dgamma: &mut [f32],
    dbeta: &mut [f32],
    dx: Option<&mut [f32]>,
) -> bool {
    let n = gamma.len();
    let rows = x.len() / n.max(1);
    let shapes_agree = dy.len() == x.len() && dx.as_ref().is_none_or(|dx| dx.len() == x.len());
    if n == 0
        || !shapes_agree
        || rows * n < SPLIT_ELEMENTS
        || dgamma.len() != n
        || dbeta.len() != n
        || !super::gemm::pool::has_pool()
    {
        return false;
    }
    if let Some(dx) = dx {
        split(dx, rows, n, &|s, e, dx| layer_norm_input_grads(&x[s * n..e * n], &dy[s * n..e * n], gamma, eps, dx));
    }
    // `dgamma` and `dbeta` side by side, cut by columns: both halves of a range go to
    // the same thread.
    let shared = SharedOut { ptr: dbeta.as_mut_ptr(), len: n };
    let part = |s: usize, e: usize, dgamma: &mut [f32]| {
        // SAFETY: `s..e` lies within `0..n` (`split_always` cuts `0..n` of `dgamma`,
        // which is `n` long, as `dbeta` is); this range is this call's alone, and `dbeta`
        // stays borrowed, unused otherwise, until every part is done.
        let dbeta = unsafe { shared.range(s, e) };
        layer_norm_param_grads(x, dy, n, eps, s, dgamma, dbeta);
    };
    split_always(dgamma, n, 1, &part);
    true
}

/// [`split`] whatever the loop's length (the caller decided it is worth it).
fn split_always(out: &mut [f32], units: usize, unit: usize, f: &(dyn Fn(usize, usize, &mut [f32]) + Sync)) {
    let units = units.min(out.len() / unit.max(1));
    let shared = SharedOut { ptr: out.as_mut_ptr(), len: units * unit };
    let part = |s: usize, e: usize| {
        // SAFETY: as in `split`.
        let out = unsafe { shared.range(s * unit, e * unit) };
        f(s, e, out);
    };
    if !super::gemm::pool::for_parts(units, 2, 1, &part) {
        f(0, units, &mut out[..units * unit]);
    }
}

/// Scalar versions of the row kernels for rows that are not contiguous: the same
/// operations in the same order.
pub(crate) mod strided {
    use super::{lane_sum_by, lane_sum_iter};
    use ndarray::{ArrayView1, ArrayViewMut1};

    /// [`super::row_statistics`] of a row in any layout.
    pub(crate) fn row_statistics(x: ArrayView1<'_, f32>, eps: f32) -> (f32, f32) {
        let n = x.len() as f32;
        let mean = lane_sum_iter(x.iter().copied()) / n;
        let var = lane_sum_iter(x.iter().map(|&v| (v - mean) * (v - mean))) / n;
        (mean, 1.0 / (var + eps).sqrt())
    }

    /// [`super::layer_norm_backward_row`] of rows in any layout.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layer_norm_backward_row(
        x: ArrayView1<'_, f32>,
        dy: ArrayView1<'_, f32>,
        gamma: ArrayView1<'_, f32>,
        eps: f32,
        mut dgamma: ArrayViewMut1<'_, f32>,
        mut dbeta: ArrayViewMut1<'_, f32>,
        dx: Option<ArrayViewMut1<'_, f32>>,
    ) {
        let n = x.len();
        let nf = n as f32;
        let (mean, rstd) = row_statistics(x, eps);
        let m1 = lane_sum_by(n, |j| dy[j] * gamma[j]) / nf;
        let m2 = lane_sum_by(n, |j| (dy[j] * gamma[j]) * ((x[j] - mean) * rstd)) / nf;
        for j in 0..n {
            dgamma[j] += dy[j] * ((x[j] - mean) * rstd);
            dbeta[j] += dy[j];
        }
        if let Some(mut dx) = dx {
            for j in 0..n {
                let xhat = (x[j] - mean) * rstd;
                dx[j] = rstd * (dy[j] * gamma[j] - m1 - xhat * m2);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `y` as the kernels' uninitialised output.
    fn uninit(y: &mut [f32]) -> &mut [MaybeUninit<f32>] {
        // SAFETY: `MaybeUninit<f32>` has `f32`'s layout, and the kernels write only
        // initialised values through it.
        unsafe { &mut *(y as *mut [f32] as *mut [MaybeUninit<f32>]) }
    }

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = carve_rng::Rng::new(seed);
        (0..n).map(|_| rng.uniform(-6.0, 6.0)).collect()
    }

    #[test]
    fn a_rows_maximum_in_lanes_is_the_strict_folds_bits() {
        let fold = |x: &[f32], live: &dyn Fn(usize) -> bool| {
            x.iter().enumerate().fold(f32::NEG_INFINITY, |m, (j, &v)| if live(j) && v > m { v } else { m })
        };
        let mut rng = carve_rng::Rng::new(11);
        // Values drawn from a few, so that ties, zeros of both signs, NaN and infinities
        // meet in one row, at every length across the lanes' edges.
        let pool = [-0.0f32, 0.0, -1.5, 2.0, -3.0, f32::NAN, f32::NEG_INFINITY, f32::INFINITY, -0.25];
        for n in 0..70 {
            for round in 0..40 {
                let spread = 1 + round % pool.len();
                let x: Vec<f32> =
                    (0..n).map(|_| pool[(rng.uniform(0.0, spread as f32) as usize).min(spread - 1)]).collect();
                let mask: Vec<bool> = (0..n).map(|_| rng.uniform(0.0, 1.0) < 0.7).collect();
                for live in [&(|_| true) as &dyn Fn(usize) -> bool, &|j| mask[j], &|_| false] {
                    let (want, got) = (fold(&x, live), row_max(&x, live));
                    assert_eq!(got.to_bits(), want.to_bits(), "{x:?}, {got} against {want}");
                }
            }
        }
    }

    #[test]
    fn fast_exp_is_within_two_ulp_of_exp_over_its_range() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let got = f64::from(fast_exp(x));
            let want = f64::from(x).exp();
            let ulp = f64::from(f32::EPSILON) * want;
            worst = worst.max((got - want).abs() / ulp);
            x += 0.001_3;
        }
        assert!(worst <= 2.0, "{worst} ulp");
        assert_eq!(fast_exp(0.0), 1.0);
        assert!(fast_exp(f32::NAN).is_nan());
        assert!(fast_exp(-1000.0) < 1.2e-38 && fast_exp(-1000.0) > 0.0);
        assert!(fast_exp(1000.0).is_finite());
    }

    #[test]
    fn fast_tanh_is_within_4e7_of_tanh() {
        let mut x = -10.0f32;
        while x < 10.0 {
            assert!((f64::from(fast_tanh(x)) - f64::from(x).tanh()).abs() < 4e-7, "{x}");
            x += 0.000_7;
        }
    }

    #[test]
    fn split_fills_copies_and_sums_give_the_bits_of_one_thread_in_every_layout() {
        use ndarray::{Array1, Array2};
        // Above the split threshold, with rows that do not divide evenly among threads.
        let (rows, n) = (SPLIT_ELEMENTS / 40 + 7, 41);
        let a = Array2::from_shape_vec((rows, n), values(rows * n, 1)).expect("rows × n");
        let b = Array2::from_shape_vec((rows, n), values(rows * n, 2)).expect("rows × n");
        let row = Array1::from(values(n, 3));
        let run = |a: ArrayView2<'_, f32>, b: ArrayView2<'_, f32>| {
            let mut y = Array2::from_elem(a.raw_dim(), f32::NAN);
            let zeros = zeros_new(uninit2(&mut y)).to_owned();
            let copy = copy_new(a, uninit2(&mut y)).to_owned();
            let sum = sum_new(a, b, uninit2(&mut y)).to_owned();
            let mut acc = a.to_owned();
            add_assign(acc.view_mut(), b);
            let broadcast = rows_new(row.view(), uninit2(&mut y)).to_owned();
            let mut filled = a.to_owned();
            fill_rows(filled.view_mut(), row.view());
            let mut column_sums = Array1::from_elem(n, f32::NAN);
            sum_rows(column_sums.view_mut(), a);
            [zeros, copy, sum, acc, broadcast, filled, column_sums.insert_axis(ndarray::Axis(0))]
        };
        let mut sums = Array1::<f32>::zeros(n);
        for r in a.rows() {
            sums += &r;
        }
        let expected = [
            Array2::zeros((rows, n)),
            a.clone(),
            &a + &b,
            &a + &b,
            row.broadcast((rows, n)).expect("rows").to_owned(),
            row.broadcast((rows, n)).expect("rows").to_owned(),
            sums.insert_axis(ndarray::Axis(0)),
        ];
        let same = |x: &[Array2<f32>; 7], what: &str| {
            for (i, (x, e)) in x.iter().zip(&expected).enumerate() {
                let bits = |v: &Array2<f32>| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(x), bits(e), "{what}: helper {i}");
            }
        };
        for threads in [1, 2, 3] {
            let pool = (threads > 1).then(|| super::super::gemm::pool::Pool::new(threads).expect("a pool"));
            let _in_use = super::super::gemm::pool::use_pool(pool.as_ref());
            same(&run(a.view(), b.view()), &format!("{threads} threads, contiguous"));
            // The same values through transposed (strided) views take the element loops.
            let (at, bt) = (a.t().to_owned(), b.t().to_owned());
            let strided = run(at.t(), bt.t());
            same(&strided, &format!("{threads} threads, strided"));
        }
    }

    /// `y`'s elements as an uninitialised array of its shape.
    fn uninit2(y: &mut ndarray::Array2<f32>) -> ArrayViewMut2<'_, MaybeUninit<f32>> {
        let dim = y.raw_dim();
        ArrayViewMut2::from_shape(dim, uninit(y.as_slice_mut().expect("standard layout"))).expect("its own shape")
    }

    #[test]
    fn lane_sums_are_the_same_in_every_layout() {
        for n in [0, 1, 7, 8, 9, 63, 64, 130] {
            let x = values(n, n as u64);
            let exact: f64 = x.iter().map(|&v| f64::from(v)).sum();
            let sum = lane_sum(&x, |v| v);
            assert_eq!(sum.to_bits(), lane_sum_iter(x.iter().copied()).to_bits(), "n = {n}");
            assert!((f64::from(sum) - exact).abs() < 1e-4, "n = {n}: {sum} vs {exact}");
            let y = values(n, 99);
            let dot = lane_dot(&x, &y);
            assert_eq!(dot.to_bits(), lane_sum_iter(x.iter().zip(&y).map(|(a, b)| a * b)).to_bits());
        }
    }

    #[test]
    fn the_exact_gelu_and_its_slope_are_x_phi_and_its_derivative_to_within_erfs_polynomial() {
        // (x, x·Φ(x), Φ(x) + x·φ(x)) in float64, by Python's `math.erf`.
        #[allow(clippy::excessive_precision)]
        let reference: [(f32, f64, f64); 13] = [
            (-10.0, -0.0, -7.694598626706419e-22),
            (-6.0, -5.919525869479969e-09, -3.546870945402639e-08),
            (-3.0, -0.00404969409489031, -0.011945647204183918),
            (-1.5, -0.10021080190328713, -0.12746919222997954),
            (-0.5, -0.15426876936299344, 0.13250487534383712),
            (-0.001, -0.000499601057786089, 0.4992021157051586),
            (0.0, 0.0, 0.5),
            (0.001, 0.000500398942213911, 0.5007978842948414),
            (0.5, 0.34573123063700656, 0.8674951246561629),
            (1.0, 0.8413447460685429, 1.0833154705876864),
            (2.5, 2.4844758366855597, 1.037611085908145),
            (4.0, 3.9998733150326675, 1.0005036496612265),
            (10.0, 10.0, 1.0),
        ];
        for (x, y, slope) in reference {
            // erf's polynomial is within 1.5e-7: y within ½·|x|·1.5e-7, plus rounding.
            let tolerance = 2e-7 * (1.0 + f64::from(x.abs()));
            let got = f64::from(gelu_exact(x));
            assert!((got - y).abs() <= tolerance, "gelu_exact({x}) = {got}, not {y}");
            let got = f64::from(gelu_exact_slope(x));
            assert!((got - slope).abs() <= tolerance, "gelu_exact_slope({x}) = {got}, not {slope}");
        }
        // The tanh form is not this one (its difference is far above the tolerance).
        assert!((f64::from(gelu(-1.5)) - -0.10021080190328713).abs() > 1e-4);
        assert!(gelu_exact(f32::NAN).is_nan() && fast_erf(f32::NAN).is_nan());
        assert_eq!((fast_erf(f32::INFINITY), fast_erf(f32::NEG_INFINITY)), (1.0, -1.0));
        // Far out the slope is Φ's 1 or 0, not φ's floor times a huge x.
        for (x, slope) in [(3e38, 1.0), (1e20, 1.0), (14.0, 1.0), (-14.0, 0.0), (-1e36, 0.0), (-3e38, 0.0)] {
            assert_eq!(gelu_exact_slope(x), slope, "slope at {x}");
        }
        // The slope is the derivative of the value, here in f32 by central differences.
        for i in -40..=40 {
            let x = i as f32 * 0.1;
            let h = 1e-2f32;
            let numeric = (f64::from(gelu_exact(x + h)) - f64::from(gelu_exact(x - h))) / (2.0 * f64::from(h));
            let analytic = f64::from(gelu_exact_slope(x));
            assert!((numeric - analytic).abs() < 1e-4, "slope at {x}: {analytic} vs {numeric}");
        }
    }

    #[test]
    fn every_width_gives_the_same_bits() {
        let (t, n) = (13, 40);
        let x = values(t * n, 1);
        let dy = values(t * n, 2);
        let gamma = values(n, 3);
        let beta = values(n, 4);
        let scores = values(t * t, 5);
        let mask: Vec<f32> = (0..t).map(|j| if j % 5 == 3 { 0.0 } else { 1.0 }).collect();
        type Outputs = Vec<Vec<f32>>;
        let run = |baseline: bool, form: GeluForm| -> Outputs {
            let mut out: Outputs = vec![vec![0.0; t * n]; 8];
            let mut stats = vec![0.0; 2 * t];
            let mut sm = scores.clone();
            let mut dg = vec![0.0; n];
            let mut db = vec![0.0; n];
            let mut dp = dy[..t * t].to_vec();
            if baseline {
                gelu_body(&x, uninit(&mut out[0]), form);
                gelu_backward_body(&x, &dy, &mut out[1], form);
                layer_norm_body(&x, &gamma, &beta, 1e-5, uninit(&mut out[2]));
                layer_norm_backward_body(&x, &dy, &gamma, 1e-5, &mut dg, &mut db, Some(&mut out[3]));
                causal_softmax_body(&mut sm, t, Some(&mask), Stats::Write(&mut stats));
                causal_softmax_backward_body(&sm, &mut dp, t, 0.5);
            } else {
                gelu_slices(&x, uninit(&mut out[0]), form);
                gelu_backward_slices(&x, &dy, &mut out[1], form);
                layer_norm_slices(&x, &gamma, &beta, 1e-5, uninit(&mut out[2]));
                layer_norm_backward_slices(&x, &dy, &gamma, 1e-5, &mut dg, &mut db, Some(&mut out[3]));
                causal_softmax_slices(&mut sm, t, Some(&mask), Stats::Write(&mut stats));
                causal_softmax_backward_slices(&sm, &mut dp, t, 0.5);
            }
            out[4] = sm;
            out[5] = stats;
            out[6] = [dg, db].concat();
            out[7] = dp;
            out
        };
        for form in [GeluForm::Tanh, GeluForm::Exact] {
            let (baseline, widest) = (run(true, form), run(false, form));
            for (k, (a, b)) in baseline.iter().zip(&widest).enumerate() {
                let (a, b): (Vec<u32>, Vec<u32>) =
                    (a.iter().map(|v| v.to_bits()).collect(), b.iter().map(|v| v.to_bits()).collect());
                let width = super::super::simd::Width::detect();
                assert_eq!(a, b, "output {k} ({form:?}) differs between the baseline and {width:?}");
            }
        }
    }
}
