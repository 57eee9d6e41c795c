//! Planning with `workspace_core::plan`: the memory plans of two real networks' recorded
//! training iterations (the digits MLP 64-128-64-10 at batch 32, and 784-1024-1024-10
//! at batch 128), printed against their per-role layout and lower bound, and the
//! planning time for those and for synthetic iterations of 100 and 1,000 allocations
//! shaped like a network's (layer cycles opening and closing in order, activations kept
//! until the end, gradients alternating between two owners). Goals (issue 13): plan ≤
//! 1.05× the lower bound; ≤ 50 µs for ≤ 100 allocations, ≤ 5 ms for 1,000.
//!
//! The networks are planned per allocation and, as `WorkspaceMode::Planned` plans them,
//! per run (`Trace::runs`).
//!
//! Run: `cargo bench --bench plan`

use std::hint::black_box;

use carve::nn::Network;
use carve::workspace_core::plan::{Event, Plan, Trace};
use ndarray::{Array1, Array2};

mod workloads;

/// The recorded second training iteration of an MLP `widths[0]-...-widths[last]` at
/// `batch`.
fn recorded(widths: &[usize], batch: usize) -> Trace {
    let mut net = Network::new(workloads::mlp(widths).build().expect("a valid network")).expect("a network");
    let x = Array2::<f32>::from_elem((batch, widths[0]), 0.5);
    let y = Array1::<u32>::zeros(batch);
    net.fit_batch(x.view(), y.view()).expect("a step");
    net.record_next_iteration();
    net.fit_batch(x.view(), y.view()).expect("a recorded step");
    net.recorded_iteration().expect("a recording").clone()
}
use criterion::{criterion_main, Criterion};

/// A training iteration of `layers` layers: per layer a forward working-memory cycle
/// (owner 1) and an activation (owner 0, live to the end); then per layer, from the
/// top, a backward working-memory cycle and a gradient in one of two owners (2, 3),
/// each freed after the layer below has used it; then the updater's cycle (owner 4).
fn network_trace(layers: usize) -> Trace {
    let mut t = Trace::new();
    let size = |i: usize| 4096 * (1 + (i * 7) % 13);
    for i in 0..layers {
        t.push(Event::Alloc { owner: 1, bytes: size(i) / 2, align: 64 });
        t.push(Event::Close { owner: 1 });
        t.push(Event::Alloc { owner: 0, bytes: size(i), align: 64 });
    }
    for i in (0..layers).rev() {
        let grad = 2 + (i % 2) as u64;
        t.push(Event::Alloc { owner: 1, bytes: size(i) / 2, align: 64 });
        t.push(Event::Close { owner: 1 });
        t.push(Event::Alloc { owner: grad, bytes: size(i), align: 64 });
        t.push(Event::Close { owner: 5 - grad });
    }
    t.push(Event::Close { owner: 2 });
    t.push(Event::Close { owner: 3 });
    t.push(Event::Alloc { owner: 4, bytes: 8192, align: 64 });
    t.push(Event::Close { owner: 4 });
    t.push(Event::Close { owner: 0 });
    t
}

fn plan(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan");
    let (digits, wide) = (recorded(&[64, 128, 64, 10], 32), recorded(&[784, 1024, 1024, 10], 128));
    // As a planned network plans them: each run (consecutive allocations of one
    // workspace or frame) one block.
    let networks = [("digits_runs", digits.runs()), ("wide_runs", wide.runs()), ("digits", digits), ("wide", wide)];
    // 4 · layers + 1 allocations: 101 and 1,001.
    let synthetic = [25, 250].map(|layers| ("synthetic", network_trace(layers)));
    for (name, trace) in networks.into_iter().chain(synthetic) {
        let allocations = trace.lifetimes().len();
        let planned = Plan::new(&trace);
        planned.check().expect("a sound plan");
        eprintln!(
            "{name}, {allocations} allocations: plan {} B, lower bound {} B ({:.4}x), per role {} B",
            planned.bytes(),
            trace.lower_bound(),
            planned.bytes() as f64 / trace.lower_bound() as f64,
            trace.per_owner_bytes()
        );
        g.bench_function(format!("{name}_{allocations}_allocations"), |b| {
            b.iter(|| black_box(Plan::new(black_box(&trace))))
        });
    }
    g.finish();
}

fn benches() {
    let mut c = Criterion::default().configure_from_args();
    plan(&mut c);
}

criterion_main!(benches);
