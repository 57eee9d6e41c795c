//! Planning time of `workspace_core::plan::Plan::new` for iterations of 100 and 1,000
//! allocations shaped like a network's (layer cycles opening and closing in order,
//! activations kept until the end, gradients alternating between two owners). Goals
//! (issue 13): ≤ 50 µs for ≤ 100 allocations, ≤ 5 ms for 1,000.
//!
//! Run: `cargo bench --bench plan`

use std::hint::black_box;

use carve::workspace_core::plan::{Event, Plan, Trace};
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
        let grad = 2 + (i % 2) as u32;
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
    // 4 · layers + 1 allocations: 101 and 1,001.
    for layers in [25, 250] {
        let trace = network_trace(layers);
        let allocations = trace.lifetimes().len();
        let planned = Plan::new(&trace);
        planned.check().expect("a sound plan");
        eprintln!(
            "{allocations} allocations: plan {} B, lower bound {} B ({:.4}x), per owner {} B",
            planned.bytes(),
            trace.lower_bound(),
            planned.bytes() as f64 / trace.lower_bound() as f64,
            trace.per_owner_bytes()
        );
        g.bench_function(format!("{allocations}_allocations"), |b| b.iter(|| black_box(Plan::new(black_box(&trace)))));
    }
    g.finish();
}

fn benches() {
    let mut c = Criterion::default().configure_from_args();
    plan(&mut c);
}

criterion_main!(benches);
