//! `carve::nn::gemm::sgemm` (caller-provided packing buffers) against ndarray's
//! `general_mat_mul` (the `matrixmultiply` crate, which allocates them per call), on
//! the reference network's shapes: the demo's MLP 64-128-64-10 at batch 32 and a
//! 784-1024 layer at batch 128, forward (`x·W`, beta = 1) and backward (`xᵀ·dy` and
//! `dy·Wᵀ`, beta = 0, transposed views).
//!
//! Run: `cargo bench --bench gemm -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::mem::MaybeUninit;

use carve::nn::gemm::{scratch_len, sgemm};
use criterion::{criterion_main, Criterion};
use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, ArrayView2};

mod workloads;

/// How op(A) and op(B) are stored.
#[derive(Clone, Copy)]
enum Form {
    /// `A·B`, both row-major (forward: `x·W`).
    Nn,
    /// `Aᵀ·B`, A stored k×m (weight gradient: `xᵀ·dy`).
    Tn,
    /// `A·Bᵀ`, B stored n×k (input gradient: `dy·Wᵀ`).
    Nt,
}

fn matrix(rows: usize, cols: usize, seed: u32) -> Array2<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761) | 1;
    Array2::from_shape_simple_fn((rows, cols), || {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
    })
}

fn bench_shape(c: &mut Criterion, m: usize, k: usize, n: usize, form: Form) {
    let (a, b) = match form {
        Form::Nn => (matrix(m, k, 1), matrix(k, n, 2)),
        Form::Tn => (matrix(k, m, 1), matrix(k, n, 2)),
        Form::Nt => (matrix(m, k, 1), matrix(n, k, 2)),
    };
    let (av, bv): (ArrayView2<'_, f32>, ArrayView2<'_, f32>) = match form {
        Form::Nn => (a.view(), b.view()),
        Form::Tn => (a.t(), b.view()),
        Form::Nt => (a.view(), b.t()),
    };
    let (name, beta) = match form {
        Form::Nn => ("nn", 1.0),
        Form::Tn => ("tn", 0.0),
        Form::Nt => ("nt", 0.0),
    };
    let mut out = Array2::<f32>::zeros((m, n));
    let mut scratch = vec![MaybeUninit::<f32>::uninit(); scratch_len(m, n, k)];
    let mut g = c.benchmark_group(format!("gemm_{m}x{k}x{n}_{name}"));
    g.bench_function("carve", |bench| {
        bench.iter(|| {
            sgemm(1.0, black_box(av), black_box(bv), beta, out.view_mut(), &mut scratch).unwrap();
            black_box(&mut out);
        })
    });
    g.bench_function("ndarray", |bench| {
        bench.iter(|| {
            general_mat_mul(1.0, &black_box(av), &black_box(bv), beta, &mut out);
            black_box(&mut out);
        })
    });
    g.finish();
}

fn gemm(c: &mut Criterion) {
    // MLP 64-128-64-10 at batch 32.
    bench_shape(c, 32, 64, 128, Form::Nn);
    bench_shape(c, 32, 128, 64, Form::Nn);
    bench_shape(c, 32, 64, 10, Form::Nn);
    bench_shape(c, 64, 32, 128, Form::Tn);
    bench_shape(c, 128, 32, 64, Form::Tn);
    bench_shape(c, 64, 32, 10, Form::Tn);
    bench_shape(c, 32, 64, 128, Form::Nt);
    bench_shape(c, 32, 10, 64, Form::Nt);
    // A 784-1024 layer at batch 128.
    let (batch, inputs, hidden) = (workloads::BATCH, workloads::INPUTS, workloads::HIDDEN);
    bench_shape(c, batch, inputs, hidden, Form::Nn);
    bench_shape(c, inputs, batch, hidden, Form::Tn);
    bench_shape(c, batch, hidden, inputs, Form::Nt);
}

// The macro defines an undocumented function.
#[allow(missing_docs)]
mod group {
    criterion::criterion_group!(benches, super::gemm);
}
criterion_main!(group::benches);
