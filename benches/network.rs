//! One training iteration (`fit_batch`: forward, loss, backward, Adam update) of the
//! reference network with workspaces Enabled vs None, on the demo's shape and on a
//! training-sized MLP.
//!
//! Run: `cargo bench --bench network`

use std::hint::black_box;

use carve::nn::{Network, NetworkConfig, Updater};
use carve::WorkspaceMode;
use carve_rng::Rng;
use criterion::{criterion_main, Criterion};
use ndarray::{Array1, Array2};

mod workloads;

fn network(inputs: usize, hidden: &[usize], classes: usize, mode: WorkspaceMode) -> Network {
    let mut builder = NetworkConfig::builder(inputs);
    for &h in hidden {
        builder = builder.dense(h).relu();
    }
    let config = builder
        .dense(classes)
        .seed(1)
        .updater(Updater::adam(1e-3))
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode)
        .build()
        .expect("valid configuration");
    Network::new(config).expect("network")
}

fn data(rows: usize, cols: usize, classes: usize) -> (Array2<f32>, Array1<u32>) {
    let mut rng = Rng::new(2);
    let x = Array2::from_shape_fn((rows, cols), |_| rng.next_f32());
    let y = (0..rows).map(|i| (i % classes) as u32).collect();
    (x, y)
}

fn bench(c: &mut Criterion, group: &str, inputs: usize, hidden: &[usize], classes: usize, batch: usize) {
    let (x, y) = data(batch, inputs, classes);
    let mut g = c.benchmark_group(group);
    let mut nets: Vec<(&str, Network)> = [("enabled", WorkspaceMode::Enabled), ("none", WorkspaceMode::None)]
        .into_iter()
        .map(|(name, mode)| (name, network(inputs, hidden, classes, mode)))
        .collect();
    for (name, net) in &mut nets {
        for _ in 0..20 {
            net.fit_batch(x.view(), y.view()).expect("warm-up"); // workspaces learn
        }
        g.bench_function(*name, |b| b.iter(|| black_box(net.fit_batch(x.view(), y.view()).expect("step"))));
    }
    g.finish();
}

fn benches(c: &mut Criterion) {
    bench(c, "fit_batch_digits_64-128-64-10_b32", 64, &[128, 64], 10, 32);
    use workloads::{BATCH, CLASSES, HIDDEN, INPUTS};
    bench(c, "fit_batch_mlp_784-1024-1024-10_b128", INPUTS, &[HIDDEN, HIDDEN], CLASSES, BATCH);
}

// The macro defines an undocumented function.
#[allow(missing_docs)]
mod group {
    criterion::criterion_group! {
        name = benches;
        config = criterion::Criterion::default().sample_size(20);
        targets = super::benches
    }
}
criterion_main!(group::benches);
