//! Elementwise loops compiled for the widest vectors the CPU has (AVX-512, AVX2, or the
//! baseline), chosen at run time. The arithmetic is the same in every version: each
//! operation is IEEE-754 single precision, correctly rounded whatever the vector width,
//! and nothing is fused (Rust never contracts `a * b + c` into an FMA), so every version
//! gives the same bits; the tests check it.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

/// One parameter (or a range of the flat parameters) and its gradient, as a step
/// stores it.
pub(crate) struct Param<'p> {
    /// The values, updated in place.
    pub(crate) value: &'p mut [f32],
    /// The gradient of the loss with respect to `value`.
    pub(crate) grad: &'p [f32],
}

/// Adam's hyper-parameters for one step, the bias correction folded into `step`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamStep {
    pub(crate) beta1: f32,
    pub(crate) beta2: f32,
    pub(crate) epsilon: f32,
    pub(crate) step: f32,
}

/// One Adam step of one value: the new first and second moments, and the update. A
/// moment that falls below the smallest normal `f32` (1.2·10⁻³⁸) in magnitude is
/// stored as 0 (see [`flush`]).
#[inline(always)]
pub(crate) fn adam(a: AdamStep, m: f32, v: f32, g: f32) -> (f32, f32, f32) {
    let m = flush(a.beta1 * m + (1.0 - a.beta1) * g);
    let v = flush(a.beta2 * v + (1.0 - a.beta2) * g * g);
    (m, v, -a.step * m / (v.sqrt() + a.epsilon))
}

/// `x`, or 0 when it is subnormal. The moments of a weight whose gradient stays 0 (a
/// pixel that is blank in almost every image) decay geometrically through the
/// subnormal range, where x86 cores take a microcode assist of about a hundred cycles
/// for each operation: without this, the demo's updater took twice as long by its
/// 40th epoch. A moment that small moves no weight (its update is at most
/// `step · 1.2·10⁻³⁸ / ε`). A comparison and a select, the same in every vector width,
/// so the bits stay the same everywhere; a NaN is kept (the check sees it).
#[inline(always)]
pub(crate) fn flush(x: f32) -> f32 {
    if x.abs() < f32::MIN_POSITIVE {
        0.0
    } else {
        x
    }
}

/// Whether `x` is finite: [`f32::is_finite`]'s answer, as an integer test of the bits
/// (the exponent not all ones). In the vectorised checks (here and the updater's) it is
/// integer compares.
/// `is_finite` vectorises to an ordered not-equal compare (`vcmpneq_oqps`), which
/// valgrind (3.19) runs as an unordered one, taking a NaN for finite: under memcheck
/// the release build's checks then passed a NaN that they refuse on the CPU.
#[inline(always)]
pub(crate) fn finite(x: f32) -> bool {
    x.to_bits() & 0x7fff_ffff < 0x7f80_0000
}

#[inline(always)]
fn adam_finite_body(a: AdamStep, w: &[f32], m: &[f32], v: &[f32], g: &[f32]) -> bool {
    w.chunks(64).zip(m.chunks(64)).zip(v.chunks(64)).zip(g.chunks(64)).all(|(((w, m), v), g)| {
        w.iter().zip(m).zip(v).zip(g).fold(true, |ok, (((&w, &m), &v), &g)| {
            let (m, v, u) = adam(a, m, v, g);
            ok & finite(m) & finite(v) & finite(u) & finite(w + u)
        })
    })
}

/// Stores the step and returns the largest `|m|` and `|v|` it stored (as [`Moments`]; a
/// NaN, which a checked step never stores, would be the largest).
#[inline(always)]
fn adam_commit_body(a: AdamStep, w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) -> Moments {
    // The maxima of the magnitudes, kept as bits: for non-negative floats their order is
    // the order of the values, and an integer maximum vectorises where a float one
    // (whose NaN rules make it order-dependent) does not. A NaN's magnitude is above
    // every other.
    let (mut m_max, mut v_max) = (0u32, 0u32);
    for (((w, m), v), &g) in w.iter_mut().zip(m).zip(v).zip(g) {
        let (m_new, v_new, u) = adam(a, *m, *v, g);
        (*m, *v) = (m_new, v_new);
        *w += u;
        m_max = m_max.max(m_new.abs().to_bits());
        v_max = v_max.max(v_new.abs().to_bits());
    }
    Moments { m: f32::from_bits(m_max), v: f32::from_bits(v_max) }
}

/// The largest `|m|` and the largest `v` of an Adam state (0 for none), what a
/// bounds check ([`adam_step_is_finite`]) starts from.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub(crate) struct Moments {
    pub(crate) m: f32,
    pub(crate) v: f32,
}

impl Moments {
    /// The maxima of a state held elsewhere (a restored or handed-over one): one scan.
    /// `None` when a value is not finite or a second moment is negative, which no
    /// checked step stores.
    pub(crate) fn of(m: &[f32], v: &[f32]) -> Option<Moments> {
        let sound = m.iter().chain(v).all(|&x| finite(x)) && v.iter().all(|&x| x >= 0.0);
        sound.then(|| Moments {
            m: m.iter().fold(0f32, |a, x| a.max(x.abs())),
            v: v.iter().fold(0f32, |a, &x| a.max(x)),
        })
    }
}

/// What a bounds scan of a parameter found: whether every value is within
/// [`VALUE_LIMIT`] and every gradient finite, and the largest `|gradient|`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Scan {
    pub(crate) in_range: bool,
    pub(crate) g_max: f32,
}

/// The largest `|value|` for which an Adam step of a bounded update is known finite
/// without computing it (see [`adam_step_is_finite`]).
pub(crate) const VALUE_LIMIT: f32 = 1e38;

#[inline(always)]
fn scan_body(w: &[f32], g: &[f32]) -> Scan {
    // The largest magnitude as bits (see `adam_commit_body`).
    let (mut ok, mut g_max) = (true, 0u32);
    for (&w, &g) in w.iter().zip(g) {
        let a = g.abs();
        // Comparisons with a NaN are false: a NaN gradient or value fails `ok`.
        ok &= (a <= f32::MAX) & (w.abs() <= VALUE_LIMIT);
        g_max = g_max.max(a.to_bits());
    }
    Scan { in_range: ok, g_max: f32::from_bits(g_max) }
}

/// Whether an Adam step whose state holds at most `moments` and whose gradients are at
/// most `g_max` in magnitude, applied to values within [`VALUE_LIMIT`], gives finite
/// moments, updates and values everywhere — known from these bounds alone, before any
/// element is computed. `false` means "not known", not "not finite": the step is then
/// checked element by element.
///
/// With `0 ≤ β₁, β₂ ≤ 1` and `ε > 0`, each stored value is at most (the computed
/// roundings each add a relative 2⁻²⁴, far inside the margins below):
/// - `|m'| ≤ β₁·|m| + (1 − β₁)·|g| =: M`,
/// - `0 ≤ v' ≤ β₂·v + (1 − β₂)·g² =: V` (so `√v' + ε ≥ ε > 0`),
/// - `|step·m'| ≤ |step|·M` (the kernel's numerator) and
///   `|u| = |step·m' / (√v' + ε)| ≤ |step|·M / ε =: U`,
/// - `|w + u| ≤ VALUE_LIMIT + U`.
///
/// With `M, V, |step|·M ≤ 10³⁷` and `U ≤ 10³⁸` every one is below `f32::MAX`
/// (3.4·10³⁸).
pub(crate) fn adam_step_is_finite(a: AdamStep, moments: Moments, g_max: f32) -> bool {
    let (b1, b2, eps, step) = (f64::from(a.beta1), f64::from(a.beta2), f64::from(a.epsilon), f64::from(a.step));
    // The complements as the kernel computes them (in f32).
    let (c1, c2) = (f64::from(1.0 - a.beta1), f64::from(1.0 - a.beta2));
    let (m, v, g) = (f64::from(moments.m), f64::from(moments.v), f64::from(g_max));
    let hyper = (0.0..=1.0).contains(&b1)
        && (0.0..=1.0).contains(&b2)
        && c1 >= 0.0
        && c2 >= 0.0
        && eps > 0.0
        && eps.is_finite()
        && step.is_finite();
    if !(hyper && m.is_finite() && v.is_finite() && g.is_finite() && v >= 0.0) {
        return false;
    }
    let big_m = b1 * m + c1 * g;
    let big_v = b2 * v + c2 * g * g;
    // The kernel multiplies `step · m'` before it divides: that product is bounded too.
    let numerator = step.abs() * big_m;
    big_m <= 1e37 && big_v <= 1e37 && numerator <= 1e37 && numerator / eps <= 1e38
}

/// The vector width a loop runs at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Width {
    Baseline,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Width {
    /// The widest this CPU runs.
    pub(crate) fn detect() -> Width {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Width::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Width::Avx2;
            }
        }
        Width::Baseline
    }
}

#[inline(always)]
#[allow(clippy::eq_op)] // `x − x` is the test: 0, or NaN for a value that is not finite
fn all_finite_body(values: &[f32]) -> bool {
    // `x − x` is 0 for a finite `x` and NaN for an infinity or a NaN, and a sum that
    // meets a NaN stays NaN: a run of 1,024 values is finite when its 32 lanes' sums are
    // all 0. Two operations a value in four independent vector chains, one test a run.
    // Plain loops: an iterator adapter's fold would be compiled apart from the caller's
    // target features, at the baseline's width.
    const LANES: usize = 32;
    const RUN: usize = 1024 / LANES;
    let (blocks, rest) = values.as_chunks::<LANES>();
    for run in blocks.chunks(RUN) {
        let mut acc = [0.0f32; LANES];
        for c in run {
            for l in 0..LANES {
                acc[l] += c[l] - c[l];
            }
        }
        let mut ok = true;
        for a in acc {
            ok &= a == 0.0;
        }
        if !ok {
            return false;
        }
    }
    let mut ok = true;
    for &v in rest {
        ok &= finite(v);
    }
    ok
}

/// Whether every value of `values` is finite. Branch-free within runs of 1,024, at the
/// widest vectors the CPU has; stops at the first run that holds a non-finite value.
/// Long slices are split across the thread's matrix-multiply pool when it has one.
pub(crate) fn all_finite(values: &[f32]) -> bool {
    if values.len() >= SPLIT_MIN {
        let ok = AtomicBool::new(true);
        let part = |s: usize, e: usize| {
            if !all_finite_at(&values[s..e]) {
                ok.store(false, Ordering::Relaxed);
            }
        };
        if super::gemm::pool::for_parts(values.len(), SPLIT_MIN, 16, &part) {
            return ok.into_inner();
        }
    }
    all_finite_at(values)
}

fn all_finite_at(values: &[f32]) -> bool {
    match Width::detect() {
        Width::Baseline => all_finite_body(values),
        // SAFETY: as in `adam_finite`.
        #[cfg(target_arch = "x86_64")]
        Width::Avx2 => unsafe { x86::all_finite_avx2(values) },
        // SAFETY: as in `adam_finite`.
        #[cfg(target_arch = "x86_64")]
        Width::Avx512 => unsafe { x86::all_finite_avx512(values) },
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;

    #[target_feature(enable = "avx512f")]
    pub(super) fn all_finite_avx512(values: &[f32]) -> bool {
        all_finite_body(values)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn all_finite_avx2(values: &[f32]) -> bool {
        all_finite_body(values)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn adam_finite_avx512(a: AdamStep, w: &[f32], m: &[f32], v: &[f32], g: &[f32]) -> bool {
        adam_finite_body(a, w, m, v, g)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn adam_finite_avx2(a: AdamStep, w: &[f32], m: &[f32], v: &[f32], g: &[f32]) -> bool {
        adam_finite_body(a, w, m, v, g)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn adam_commit_avx512(a: AdamStep, w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) -> Moments {
        adam_commit_body(a, w, m, v, g)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn adam_commit_avx2(a: AdamStep, w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) -> Moments {
        adam_commit_body(a, w, m, v, g)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn scan_avx512(w: &[f32], g: &[f32]) -> Scan {
        scan_body(w, g)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn scan_avx2(w: &[f32], g: &[f32]) -> Scan {
        scan_body(w, g)
    }
}

/// Parameters shorter than this are stepped on the calling thread; longer ones are
/// split across the thread's matrix-multiply pool when it has one (each element's
/// arithmetic is the same wherever it runs).
const SPLIT_MIN: usize = 1 << 16;

/// Whether one Adam step of values `w` (gradients `g`, state `m`, `v`) is finite everywhere: the new moments,
/// the updates and the new values. Stores nothing.
pub(crate) fn adam_finite(width: Width, a: AdamStep, w: &[f32], g: &[f32], m: &[f32], v: &[f32]) -> bool {
    let n = w.len();
    let (g, m, v) = (&g[..n], &m[..n], &v[..n]);
    let ok = AtomicBool::new(true);
    let part = |s: usize, e: usize| {
        if !adam_finite_at(width, a, &w[s..e], &m[s..e], &v[s..e], &g[s..e]) {
            ok.store(false, Ordering::Relaxed);
        }
    };
    if super::gemm::pool::for_parts(n, SPLIT_MIN, 16, &part) {
        return ok.into_inner();
    }
    adam_finite_at(width, a, w, m, v, g)
}

fn adam_finite_at(width: Width, a: AdamStep, w: &[f32], m: &[f32], v: &[f32], g: &[f32]) -> bool {
    match width {
        Width::Baseline => adam_finite_body(a, w, m, v, g),
        // SAFETY: `Width::detect` found the feature on this CPU (a `Width` is made only
        // by it, or by the tests after the same check).
        #[cfg(target_arch = "x86_64")]
        Width::Avx2 => unsafe { x86::adam_finite_avx2(a, w, m, v, g) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Width::Avx512 => unsafe { x86::adam_finite_avx512(a, w, m, v, g) },
    }
}

/// The four arrays of an Adam step, for the threads that each store a range of them.
#[derive(Clone, Copy)]
struct Arrays {
    w: *mut f32,
    m: *mut f32,
    v: *mut f32,
    g: *const f32,
}

impl Arrays {
    /// The elements `s..e` of the four arrays.
    ///
    /// # Safety
    ///
    /// `s..e` lies within every array, and nothing else reaches those elements while
    /// the slices live.
    #[allow(clippy::type_complexity)]
    unsafe fn range<'a>(&self, s: usize, e: usize) -> (&'a mut [f32], &'a mut [f32], &'a mut [f32], &'a [f32]) {
        // SAFETY: the caller's promise.
        unsafe {
            (
                std::slice::from_raw_parts_mut(self.w.add(s), e - s),
                std::slice::from_raw_parts_mut(self.m.add(s), e - s),
                std::slice::from_raw_parts_mut(self.v.add(s), e - s),
                std::slice::from_raw_parts(self.g.add(s), e - s),
            )
        }
    }
}

// SAFETY: used only by `adam_commit`, whose threads each write a range of the arrays that
// no other thread reads or writes (`for_parts` gives every range to one thread), while
// `adam_commit` keeps them borrowed.
unsafe impl Send for Arrays {}
// SAFETY: as above.
unsafe impl Sync for Arrays {}

/// The larger of `value` and a non-negative `f32` held as bits in `max` (for such
/// floats the order of the bits is the order of the values).
fn atomic_max(max: &AtomicU32, value: f32) {
    max.fetch_max(value.max(0.0).to_bits(), Ordering::Relaxed);
}

/// Stores one Adam step of `p`: the new moments into `m` and `v`, each value plus its
/// update. Returns the largest `|m|` and `v` stored.
pub(crate) fn adam_commit(width: Width, a: AdamStep, p: Param<'_>, m: &mut [f32], v: &mut [f32]) -> Moments {
    let n = p.value.len();
    let (w, g, m, v) = (p.value, &p.grad[..n], &mut m[..n], &mut v[..n]);
    if n >= SPLIT_MIN {
        let arrays = Arrays { w: w.as_mut_ptr(), m: m.as_mut_ptr(), v: v.as_mut_ptr(), g: g.as_ptr() };
        let (m_max, v_max) = (AtomicU32::new(0), AtomicU32::new(0));
        let part = |s: usize, e: usize| {
            // SAFETY: `s..e` lies within the `n` elements of each array (`for_parts` cuts
            // `0..n`); this range is this call's alone (every range goes to one thread),
            // and the arrays stay borrowed, unused otherwise, until every part is done.
            let (w, m, v, g) = unsafe { arrays.range(s, e) };
            let moments = adam_commit_at(width, a, w, m, v, g);
            atomic_max(&m_max, moments.m);
            atomic_max(&v_max, moments.v);
        };
        if super::gemm::pool::for_parts(n, SPLIT_MIN, 16, &part) {
            return Moments { m: f32::from_bits(m_max.into_inner()), v: f32::from_bits(v_max.into_inner()) };
        }
    }
    adam_commit_at(width, a, w, m, v, g)
}

/// A bounds scan of values `w` and gradients `g` (see [`Scan`]): split across the thread's pool for long
/// parameters, as the step is.
pub(crate) fn scan(width: Width, w: &[f32], g: &[f32]) -> Scan {
    let n = w.len();
    let g = &g[..n];
    if n >= SPLIT_MIN {
        let (ok, g_max) = (AtomicBool::new(true), AtomicU32::new(0));
        let part = |s: usize, e: usize| {
            let found = scan_at(width, &w[s..e], &g[s..e]);
            if !found.in_range {
                ok.store(false, Ordering::Relaxed);
            }
            atomic_max(&g_max, found.g_max);
        };
        if super::gemm::pool::for_parts(n, SPLIT_MIN, 16, &part) {
            return Scan { in_range: ok.into_inner(), g_max: f32::from_bits(g_max.into_inner()) };
        }
    }
    scan_at(width, w, g)
}

fn scan_at(width: Width, w: &[f32], g: &[f32]) -> Scan {
    match width {
        Width::Baseline => scan_body(w, g),
        // SAFETY: as in `adam_finite`.
        #[cfg(target_arch = "x86_64")]
        Width::Avx2 => unsafe { x86::scan_avx2(w, g) },
        // SAFETY: as in `adam_finite`.
        #[cfg(target_arch = "x86_64")]
        Width::Avx512 => unsafe { x86::scan_avx512(w, g) },
    }
}

fn adam_commit_at(width: Width, a: AdamStep, w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) -> Moments {
    match width {
        Width::Baseline => adam_commit_body(a, w, m, v, g),
        // SAFETY: as in `adam_finite`.
        #[cfg(target_arch = "x86_64")]
        Width::Avx2 => unsafe { x86::adam_commit_avx2(a, w, m, v, g) },
        // SAFETY: as in `adam_finite`.
        #[cfg(target_arch = "x86_64")]
        Width::Avx512 => unsafe { x86::adam_commit_avx512(a, w, m, v, g) },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32).map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 10_007) as f32 / 997.0 - 5.0).collect()
    }

    /// Every vector width this CPU runs.
    fn widths() -> Vec<Width> {
        let mut widths = vec![Width::Baseline];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                widths.push(Width::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                widths.push(Width::Avx512);
            }
        }
        widths
    }

    #[test]
    fn a_step_split_across_a_pool_is_the_same_bits() {
        let a = AdamStep { beta1: 0.9, beta2: 0.999, epsilon: 1e-8, step: 0.0013 };
        let n = SPLIT_MIN * 2 + 37;
        let run = |pool: Option<&crate::nn::gemm::pool::Pool>| {
            let _in_use = crate::nn::gemm::pool::use_pool(pool);
            let (mut w, g) = (values(n, 1), values(n, 2));
            let (mut m, mut v) = (values(n, 3), values(n, 4).iter().map(|x| x.abs()).collect::<Vec<_>>());
            let width = Width::detect();
            let finite = adam_finite(width, a, &w, &g, &m, &v);
            let scanned = scan(width, &w, &g);
            let moments = adam_commit(width, a, Param { value: &mut w, grad: &g }, &mut m, &mut v);
            // The maxima returned are those of what was stored.
            assert_eq!(Some(moments), Moments::of(&m, &v));
            w[n - 1] = f32::NAN;
            let bad = adam_finite(width, a, &w, &g, &m, &v);
            let bad_scan = scan(width, &w, &g);
            let all = all_finite(&w);
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            (finite, bad, bits(&w), bits(&m), bits(&v), moments, scanned, bad_scan, all)
        };
        let alone = run(None);
        assert!(alone.0 && !alone.1);
        assert_eq!(alone.6, Scan { in_range: true, g_max: values(n, 2).iter().fold(0f32, |a, g| a.max(g.abs())) });
        assert!(!alone.7.in_range && !alone.8);
        for threads in [2, 3] {
            let pool = crate::nn::gemm::pool::Pool::new(threads).unwrap();
            assert_eq!(run(Some(&pool)), alone, "{threads} threads");
        }
    }

    /// `finite` answers as `f32::is_finite` for every class of value, and the vectorised
    /// checks built on it find a NaN or an infinity in any lane, at every width (under
    /// valgrind too, which runs `is_finite`'s vector compare wrongly).
    #[test]
    fn finite_is_is_finite_and_the_vector_checks_see_every_lane() {
        let nan_payloads = [f32::NAN, -f32::NAN, f32::from_bits(0x7f80_0001), f32::from_bits(0xffc0_1234)];
        let others = [0.0, -0.0, 1.0, -1.0, f32::MAX, f32::MIN, f32::MIN_POSITIVE, 1e-45, -1e-45];
        for x in nan_payloads.into_iter().chain([f32::INFINITY, f32::NEG_INFINITY]).chain(others) {
            assert_eq!(finite(x), x.is_finite(), "{x:e} ({:#x})", x.to_bits());
        }
        let a = AdamStep { beta1: 0.9, beta2: 0.999, epsilon: 1e-8, step: 0.001 };
        for n in [1, 7, 31, 32, 33, 100, 1024 + 40] {
            for at in [0, n / 2, n - 1] {
                for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                    let mut w = values(n, 5);
                    let (g, m, v) = (values(n, 6), values(n, 7), vec![0.5f32; n]);
                    assert!(all_finite(&w) && adam_finite(Width::detect(), a, &w, &g, &m, &v));
                    w[at] = bad;
                    assert!(!all_finite(&w) && !all_finite_body(&w), "all_finite: {bad} at {at} of {n}");
                    for width in widths() {
                        assert!(!adam_finite(width, a, &w, &g, &m, &v), "{width:?}: {bad} at {at} of {n}");
                    }
                }
            }
        }
    }

    /// Moments decaying under a zero gradient reach 0 without passing through the
    /// subnormal range, at every width, with the same bits.
    #[test]
    fn moments_never_store_a_subnormal() {
        let a = AdamStep { beta1: 0.9, beta2: 0.999, epsilon: 1e-8, step: 0.001 };
        let widths = widths();
        let n = 67;
        let mut results = Vec::new();
        for &width in &widths {
            let (mut w, g) = (values(n, 1), vec![0.0f32; n]);
            let mut m: Vec<f32> = (0..n).map(|i| if i % 2 == 0 { 1e-30 } else { -3e-35 }).collect();
            let mut v = vec![2e-37f32; n];
            for step in 0..4000 {
                adam_commit(width, a, Param { value: &mut w, grad: &g }, &mut m, &mut v);
                for x in m.iter().chain(&v) {
                    assert!(*x == 0.0 || x.is_normal(), "{width:?} step {step}: {x:e}");
                }
            }
            assert!(m.iter().all(|&x| x == 0.0), "{width:?}: the first moments decayed to 0");
            assert!(v.iter().all(|&x| x == 0.0), "{width:?}: the second moments decayed to 0");
            results.push(w.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        }
        assert!(results.iter().all(|r| *r == results[0]));
        assert_eq!(flush(f32::MIN_POSITIVE), f32::MIN_POSITIVE);
        assert_eq!(flush(-f32::MIN_POSITIVE / 2.0).to_bits(), 0.0f32.to_bits());
        assert!(flush(f32::NAN).is_nan() && flush(f32::INFINITY) == f32::INFINITY);
    }

    #[test]
    fn every_width_gives_the_same_bits() {
        let a = AdamStep { beta1: 0.9, beta2: 0.999, epsilon: 1e-8, step: 0.0013 };
        let n = 1000 + 7;
        let widths = widths();
        let mut results = Vec::new();
        for &width in &widths {
            let (mut w, g) = (values(n, 1), values(n, 2));
            let (mut m, mut v) = (values(n, 3), values(n, 4).iter().map(|x| x.abs()).collect::<Vec<_>>());
            let finite = adam_finite(width, a, &w, &g, &m, &v);
            let scanned = scan(width, &w, &g);
            let moments = adam_commit(width, a, Param { value: &mut w, grad: &g }, &mut m, &mut v);
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            results.push((finite, bits(&w), bits(&m), bits(&v), moments, scanned));
        }
        for (width, r) in widths.iter().zip(&results) {
            assert_eq!(r, &results[0], "{width:?} against the baseline");
        }
        assert!(results[0].0);
        // The finite scan, at the CPU's width, against the plain one.
        let len = 2 * 1024 + 37;
        let mut scanned = values(len, 5);
        assert!(all_finite(&scanned) && all_finite_body(&scanned));
        scanned[1] = f32::MAX;
        scanned[2] = -f32::MAX;
        assert!(all_finite(&scanned) && all_finite_body(&scanned), "the largest finite values are finite");
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            // Every lane, both sides of a run's edge, the tail past the last 32.
            for at in [0, 5, 31, 32, 63, 64, 1023, 1024, 1025, 2047, 2048, len - 1] {
                let keep = std::mem::replace(&mut scanned[at], bad);
                assert!(!all_finite(&scanned) && !all_finite_body(&scanned), "{bad} at {at}");
                scanned[at] = keep;
            }
        }
        // The bounds scan, at every width: a value beyond the limit, a gradient that is
        // not finite.
        for &width in &widths {
            let (mut w, mut g) = (values(n, 1), values(n, 2));
            assert!(scan(width, &w, &g).in_range, "{width:?}");
            for (at, value) in [(0, 2e38f32), (n - 1, -f32::MAX), (64, f32::NAN)] {
                let keep = std::mem::replace(&mut w[at], value);
                assert!(!scan(width, &w, &g).in_range, "{width:?} {value} at {at}");
                w[at] = keep;
            }
            for (at, bad) in [(5, f32::INFINITY), (n - 1, f32::NAN)] {
                let keep = std::mem::replace(&mut g[at], bad);
                assert!(!scan(width, &w, &g).in_range, "{width:?} {bad} at {at}");
                g[at] = keep;
            }
            g[700] = -3e30;
            assert_eq!(scan(width, &w, &g).g_max, 3e30, "{width:?}");
        }
        // A value that would overflow is seen at every width.
        for &width in &widths {
            let (mut w, g) = (values(n, 1), values(n, 2));
            w[n - 3] = f32::MAX;
            let (m, v) = (vec![-1e30f32; n], vec![0.0f32; n]);
            let big = AdamStep { step: 1e30, ..a };
            assert!(!adam_finite(width, big, &w, &g, &m, &v), "{width:?}");
        }
    }
}
