//! Criterion benches of the allocation hot path, each against what a user would use
//! instead, in the same run. `benches/alloc_compare.rs` (`cargo run --release --example
//! alloc_compare`) prints the full table (faults, heap allocations, cold first
//! iterations); see `benches/README.md`.
//!
//! Run: `cargo bench --bench alloc`

use std::alloc::Layout;
use std::hint::black_box;
use std::mem::MaybeUninit;

use carve::{Workspace, WorkspaceConfig};
use criterion::{criterion_main, Criterion};

mod workloads;

use workloads::{small_sizes, training_sizes};

fn small(c: &mut Criterion) {
    let sizes = small_sizes();
    let mut group = c.benchmark_group("small_iteration_64_allocs");
    let ws = Workspace::new("BENCH", WorkspaceConfig::default()).expect("workspace");
    group.bench_function("carve_slice", |b| {
        b.iter(|| {
            let scope = ws.enter().expect("enter");
            for &n in &sizes {
                let s = scope.slice_uninit::<f32>(n).expect("allocation");
                s[0] = MaybeUninit::new(1.0);
                black_box(s.as_ptr());
            }
        })
    });
    group.bench_function("carve_view", |b| {
        b.iter(|| {
            let scope = ws.enter().expect("enter");
            for &n in &sizes {
                let mut v = scope.uninit::<f32, _>(n).expect("allocation");
                v[0] = MaybeUninit::new(1.0);
                black_box(v.as_ptr());
            }
        })
    });
    let mut bump = bumpalo::Bump::new();
    group.bench_function("bumpalo", |b| {
        b.iter(|| {
            bump.reset();
            for &n in &sizes {
                let p = bump.alloc_layout(Layout::array::<f32>(n).expect("layout")).cast::<MaybeUninit<f32>>();
                // SAFETY: bumpalo handed out `n` f32 slots, ours until the next reset.
                unsafe { p.as_ptr().write(MaybeUninit::new(1.0)) };
                black_box(p);
            }
        })
    });
    let mut held: Vec<Vec<f32>> = Vec::with_capacity(sizes.len());
    group.bench_function("std_vec", |b| {
        b.iter(|| {
            for &n in &sizes {
                let mut v = Vec::<f32>::with_capacity(n);
                v.spare_capacity_mut()[0] = MaybeUninit::new(1.0);
                held.push(v);
            }
            held.clear();
        })
    });
    group.finish();
}

fn training(c: &mut Criterion) {
    let sizes = training_sizes();
    let mut group = c.benchmark_group("training_iteration_19_arrays");
    group.sample_size(20);
    let ws = Workspace::new("BENCH_TRAIN", WorkspaceConfig::default()).expect("workspace");
    group.bench_function("carve", |b| {
        b.iter(|| {
            let scope = ws.enter().expect("enter");
            for &n in &sizes {
                let s = scope.slice_uninit::<f32>(n).expect("allocation");
                s.fill(MaybeUninit::new(1.0));
                black_box(s.as_ptr());
            }
        })
    });
    let mut prealloc: Vec<Vec<MaybeUninit<f32>>> = sizes.iter().map(|&n| vec![MaybeUninit::uninit(); n]).collect();
    group.bench_function("prealloc", |b| {
        b.iter(|| {
            for buffer in &mut prealloc {
                buffer.fill(MaybeUninit::new(1.0));
                black_box(buffer.as_ptr());
            }
        })
    });
    let mut held: Vec<Vec<f32>> = Vec::with_capacity(sizes.len());
    group.bench_function("std_vec", |b| {
        b.iter(|| {
            for &n in &sizes {
                let mut v = Vec::<f32>::with_capacity(n);
                v.spare_capacity_mut().fill(MaybeUninit::new(1.0));
                held.push(v);
            }
            held.clear();
        })
    });
    group.finish();
}

fn cycle(c: &mut Criterion) {
    let mut group = c.benchmark_group("empty_cycle");
    let ws = Workspace::new("BENCH_CYCLE", WorkspaceConfig::default()).expect("workspace");
    // The scope escapes by reference: `black_box(scope)` by value would time
    // black_box's own copy of the two-word guard through a vector register (a
    // store-forwarding stall), which no program does.
    group.bench_function("carve_enter_exit", |b| {
        b.iter(|| {
            let scope = ws.enter().expect("enter");
            black_box(&scope);
        })
    });
    let mut bump = bumpalo::Bump::new();
    group.bench_function("bumpalo_reset", |b| b.iter(|| bump.reset()));
    group.finish();
}

// The macro defines an undocumented `benches` function.
#[allow(missing_docs)]
mod group {
    criterion::criterion_group!(benches, super::small, super::training, super::cycle);
}
criterion_main!(group::benches);
