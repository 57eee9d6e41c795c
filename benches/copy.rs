//! Copying data out of a cycle against a plain `memcpy` of the same bytes, at 64 KiB
//! (fits in L2) and 4 MiB (L3): `view.detach()` (an owned `ndarray::Array`) and
//! `view.leverage_to(&outer_scope)` (a copy in another open workspace) of a contiguous
//! f32 view in a workspace, against `copy_from_slice` of the same view's slice into a
//! preallocated buffer, and `to_vec()` of it (a memcpy that allocates its result, as
//! `detach()` must), and an element-wise copy loop (what `leverage_to` did before it
//! became a memcpy). Every variant reads the same source bytes. The goal is ≥ 0.8× the
//! bandwidth of `memcpy`; criterion prints each variant's throughput.
//!
//! Run: `cargo bench --bench copy`

use std::hint::black_box;
use std::mem::MaybeUninit;

use carve::{Workspace, WorkspaceArrayExt, WorkspaceConfig};
use criterion::{criterion_main, Criterion, Throughput};

fn copy(c: &mut Criterion) {
    // (label, rows, cols) of f32: 64 KiB and 4 MiB.
    for (label, rows, cols) in [("64KiB", 128, 128), ("4MiB", 1024, 1024)] {
        let bytes = rows * cols * size_of::<f32>();
        let source_ws = Workspace::new("SOURCE", WorkspaceConfig::default()).expect("workspace");
        let source_scope = source_ws.enter().expect("enter");
        let source = source_scope.from_shape_fn((rows, cols), |(r, c)| (r * cols + c) as f32).expect("allocation");
        let source = source.view();
        let from = source.as_slice().expect("a workspace array is contiguous");
        let outer = Workspace::new("OUTER", WorkspaceConfig::default()).expect("workspace");

        let mut g = c.benchmark_group(format!("copy_{label}"));
        g.throughput(Throughput::Bytes(bytes as u64));
        let mut to = vec![0f32; rows * cols];
        g.bench_function("memcpy", |b| {
            b.iter(|| {
                to.copy_from_slice(black_box(from));
                black_box(to.as_ptr());
            })
        });
        // What `Scope::copy_of` (behind `leverage_to`) did until 2026-11-23: an
        // element-wise loop into uninitialised slots, which LLVM compiles to a 16-byte
        // SSE loop instead of a memcpy.
        let mut slots = vec![MaybeUninit::<f32>::uninit(); rows * cols];
        g.bench_function("elementwise_loop", |b| {
            b.iter(|| {
                for (slot, value) in slots.iter_mut().zip(black_box(from)) {
                    *slot = MaybeUninit::new(*value);
                }
                black_box(slots.as_ptr());
            })
        });
        g.bench_function("to_vec", |b| b.iter(|| black_box(black_box(from).to_vec())));
        g.bench_function("detach", |b| b.iter(|| black_box(black_box(&source).detach())));
        g.bench_function("leverage_to", |b| {
            b.iter(|| {
                let scope = outer.enter().expect("enter");
                let kept = black_box(&source).leverage_to(&scope).expect("allocation");
                black_box(kept.as_ptr());
            })
        });
        g.finish();
        // Both results hold the source's bytes.
        assert_eq!(to.as_slice(), from);
        let scope = outer.enter().expect("enter");
        assert_eq!(source.leverage_to(&scope).expect("allocation"), source);
        assert_eq!(source.detach(), source);
    }
}

mod group {
    criterion::criterion_group!(benches, super::copy);
}
criterion_main!(group::benches);
