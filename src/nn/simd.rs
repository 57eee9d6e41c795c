//! Elementwise loops compiled for the widest vectors the CPU has (AVX-512, AVX2, or the
//! baseline), chosen at run time. The arithmetic is the same in every version: each
//! operation is IEEE-754 single precision, correctly rounded whatever the vector width,
//! and nothing is fused (Rust never contracts `a * b + c` into an FMA), so every version
//! gives the same bits; the tests check it.

use super::layer::Param;

/// Adam's hyper-parameters for one step, the bias correction folded into `step`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamStep {
    pub(crate) beta1: f32,
    pub(crate) beta2: f32,
    pub(crate) epsilon: f32,
    pub(crate) step: f32,
}

/// One Adam step of one value: the new first and second moments, and the update.
#[inline(always)]
pub(crate) fn adam(a: AdamStep, m: f32, v: f32, g: f32) -> (f32, f32, f32) {
    let m = a.beta1 * m + (1.0 - a.beta1) * g;
    let v = a.beta2 * v + (1.0 - a.beta2) * g * g;
    (m, v, -a.step * m / (v.sqrt() + a.epsilon))
}

#[inline(always)]
fn adam_finite_body(a: AdamStep, w: &[f32], m: &[f32], v: &[f32], g: &[f32]) -> bool {
    w.chunks(64).zip(m.chunks(64)).zip(v.chunks(64)).zip(g.chunks(64)).all(|(((w, m), v), g)| {
        w.iter().zip(m).zip(v).zip(g).fold(true, |ok, (((&w, &m), &v), &g)| {
            let (m, v, u) = adam(a, m, v, g);
            ok & m.is_finite() & v.is_finite() & u.is_finite() & (w + u).is_finite()
        })
    })
}

#[inline(always)]
fn adam_commit_body(a: AdamStep, w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
    for (((w, m), v), &g) in w.iter_mut().zip(m).zip(v).zip(g) {
        let (m_new, v_new, u) = adam(a, *m, *v, g);
        (*m, *v) = (m_new, v_new);
        *w += u;
    }
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
fn all_finite_body(values: &[f32]) -> bool {
    values.chunks(64).all(|chunk| chunk.iter().fold(true, |ok, v| ok & v.is_finite()))
}

/// Whether every value of `values` is finite. Branch-free within chunks of 64, at the
/// widest vectors the CPU has; stops at the first chunk that holds a non-finite value.
pub(crate) fn all_finite(values: &[f32]) -> bool {
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
    pub(super) fn adam_commit_avx512(a: AdamStep, w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
        adam_commit_body(a, w, m, v, g)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn adam_commit_avx2(a: AdamStep, w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
        adam_commit_body(a, w, m, v, g)
    }
}

/// Parameters shorter than this are stepped on the calling thread; longer ones are
/// split across the thread's matrix-multiply pool when it has one (each element's
/// arithmetic is the same wherever it runs).
const SPLIT_MIN: usize = 1 << 16;

/// Whether one Adam step of `p` (state `m`, `v`) is finite everywhere: the new moments,
/// the updates and the new values. Stores nothing.
pub(crate) fn adam_finite(width: Width, a: AdamStep, p: &Param<'_>, m: &[f32], v: &[f32]) -> bool {
    let n = p.value.len();
    let (w, g, m, v) = (&p.value[..n], &p.grad[..n], &m[..n], &v[..n]);
    let ok = std::sync::atomic::AtomicBool::new(true);
    let part = |s: usize, e: usize| {
        if !adam_finite_at(width, a, &w[s..e], &m[s..e], &v[s..e], &g[s..e]) {
            ok.store(false, std::sync::atomic::Ordering::Relaxed);
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

/// Stores one Adam step of `p`: the new moments into `m` and `v`, each value plus its
/// update.
pub(crate) fn adam_commit(width: Width, a: AdamStep, p: Param<'_>, m: &mut [f32], v: &mut [f32]) {
    let n = p.value.len();
    let (w, g, m, v) = (p.value, &p.grad[..n], &mut m[..n], &mut v[..n]);
    if n >= SPLIT_MIN {
        let arrays = Arrays { w: w.as_mut_ptr(), m: m.as_mut_ptr(), v: v.as_mut_ptr(), g: g.as_ptr() };
        let part = |s: usize, e: usize| {
            // SAFETY: `s..e` lies within the `n` elements of each array (`for_parts` cuts
            // `0..n`); this range is this call's alone (every range goes to one thread),
            // and the arrays stay borrowed, unused otherwise, until every part is done.
            let (w, m, v, g) = unsafe { arrays.range(s, e) };
            adam_commit_at(width, a, w, m, v, g);
        };
        if super::gemm::pool::for_parts(n, SPLIT_MIN, 16, &part) {
            return;
        }
    }
    adam_commit_at(width, a, w, m, v, g)
}

fn adam_commit_at(width: Width, a: AdamStep, w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
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

    #[test]
    fn a_step_split_across_a_pool_is_the_same_bits() {
        let a = AdamStep { beta1: 0.9, beta2: 0.999, epsilon: 1e-8, step: 0.0013 };
        let n = SPLIT_MIN * 2 + 37;
        let run = |pool: Option<&crate::nn::gemm::pool::Pool>| {
            let _in_use = crate::nn::gemm::pool::use_pool(pool);
            let (mut w, g) = (values(n, 1), values(n, 2));
            let (mut m, mut v) = (values(n, 3), values(n, 4).iter().map(|x| x.abs()).collect::<Vec<_>>());
            let width = Width::detect();
            let finite = adam_finite(width, a, &Param { value: &mut w, grad: &g }, &m, &v);
            adam_commit(width, a, Param { value: &mut w, grad: &g }, &mut m, &mut v);
            w[n - 1] = f32::NAN;
            let bad = adam_finite(width, a, &Param { value: &mut w, grad: &g }, &m, &v);
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            (finite, bad, bits(&w), bits(&m), bits(&v))
        };
        let alone = run(None);
        assert!(alone.0 && !alone.1);
        for threads in [2, 3] {
            let pool = crate::nn::gemm::pool::Pool::new(threads).unwrap();
            assert_eq!(run(Some(&pool)), alone, "{threads} threads");
        }
    }

    #[test]
    fn every_width_gives_the_same_bits() {
        let a = AdamStep { beta1: 0.9, beta2: 0.999, epsilon: 1e-8, step: 0.0013 };
        let n = 1000 + 7;
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
        let mut results = Vec::new();
        for &width in &widths {
            let (mut w, g) = (values(n, 1), values(n, 2));
            let (mut m, mut v) = (values(n, 3), values(n, 4).iter().map(|x| x.abs()).collect::<Vec<_>>());
            let finite = adam_finite(width, a, &Param { value: &mut w, grad: &g }, &m, &v);
            adam_commit(width, a, Param { value: &mut w, grad: &g }, &mut m, &mut v);
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            results.push((finite, bits(&w), bits(&m), bits(&v)));
        }
        for (width, r) in widths.iter().zip(&results) {
            assert_eq!(r, &results[0], "{width:?} against the baseline");
        }
        assert!(results[0].0);
        // The finite scan, at the CPU's width, against the plain one.
        let mut scan = values(n, 5);
        assert!(all_finite(&scan) && all_finite_body(&scan));
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0, 63, 64, n - 1] {
                let keep = std::mem::replace(&mut scan[at], bad);
                assert!(!all_finite(&scan) && !all_finite_body(&scan), "{bad} at {at}");
                scan[at] = keep;
            }
        }
        // A value that would overflow is seen at every width.
        for &width in &widths {
            let (mut w, g) = (values(n, 1), values(n, 2));
            w[n - 3] = f32::MAX;
            let (m, v) = (vec![-1e30f32; n], vec![0.0f32; n]);
            let big = AdamStep { step: 1e30, ..a };
            assert!(!adam_finite(width, big, &Param { value: &mut w, grad: &g }, &m, &v), "{width:?}");
        }
    }
}
