//! A user's own layer is one `impl Layer`: a learned per-feature scale, trained by a
//! `Network`, trained data-parallel by two workers, saved, loaded and served.
//!
//! Run: `cargo run --release --example custom_layer` (no flags; `--help` says so, an
//! error is one line, `custom_layer: error: <message>`, and exit status 1).
//!
//! `Scale` holds no parameters of its own: it names them (`weight`, one per feature) and
//! the network holds them, in one flat buffer with every layer's, and hands each pass
//! its part. So the same impl trains in a `Network`, in every worker of a
//! `DataParallel` trainer (two threads here, the same bits as one thread running the
//! two shards in turn), is saved under its parameter names (`scale.weight`), loaded
//! with the configuration that builds it (`Model::load_with`), and served from an
//! `InferencePool`. The last line of the output is one JSON object with the keys
//! `trained`, `data_parallel_bits_equal` and `served`.
//!
//! Its output goes to `ctx.activations`, the only scope that lives long enough:
//! returning an array of working memory instead does not compile (the `compile_fail`
//! doctests on `carve::nn::Layer` hold the compiler to this).

use std::process::ExitCode;
use std::sync::Arc;

use carve::nn::{
    parallel::DataParallel, parallel::ParallelConfig, serve::InferencePool, serve::Model, serve::PoolConfig,
    BackwardCtx, ForwardCtx, Init, Layer, Network, NetworkConfig, ParamShape, RowsPass, Updater,
};
use carve::{freeze, WorkspaceMode};
use clap::Parser;
use ndarray::{Array1, Array2, ArrayView2, ArrayViewMut2, Axis, Zip};

#[path = "common/cli.rs"]
mod cli;

/// A user's own layer (a learned per-feature scale), trained by a
/// network and by two data-parallel workers, saved, loaded and served;
/// prints one JSON line.
#[derive(Parser)]
#[command(name = "custom_layer", verbatim_doc_comment)]
struct Args {}

/// `y = x ⊙ s`: each feature scaled by a learned factor (`weight`, starting at 1).
struct Scale {
    name: String,
}

impl Layer for Scale {
    fn name(&self) -> &str {
        &self.name
    }

    fn output_size(&self, inputs: usize) -> carve::Result<usize> {
        Ok(inputs)
    }

    fn param_shapes(&self, inputs: usize) -> Vec<ParamShape> {
        vec![ParamShape::new("weight", &[inputs])]
    }

    fn init(&self, _inputs: usize, params: &mut [f32], _init: &mut Init<'_>) {
        params.fill(1.0);
    }

    fn forward_rows<'a>(
        &self,
        params: &[f32],
        input: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> carve::Result<ArrayView2<'a, f32>> {
        let mut out = ctx.activations.copy_of(&input)?; // kept for backprop
        for mut row in out.rows_mut() {
            Zip::from(&mut row).and(params).for_each(|y, &s| *y *= s);
        }
        Ok(freeze(out))
    }

    fn backward_rows(
        &self,
        params: &[f32],
        grads: &mut [f32],
        pass: RowsPass<'_>,
        grad_input: Option<ArrayViewMut2<'_, f32>>,
        _ctx: &BackwardCtx<'_>,
    ) -> carve::Result<()> {
        // ds = Σ_rows x ⊙ dy, summed in row order (the same bits on any number of workers
        // for a given shard).
        grads.fill(0.0);
        for (x, g) in pass.input.rows().into_iter().zip(pass.grad_output.rows()) {
            Zip::from(&mut *grads).and(&x).and(&g).for_each(|acc, &x, &g| *acc += x * g);
        }
        if let Some(mut grad_input) = grad_input {
            for (mut gi, g) in grad_input.rows_mut().into_iter().zip(pass.grad_output.rows()) {
                Zip::from(&mut gi).and(&g).and(params).for_each(|gi, &g, &s| *gi = g * s);
            }
        }
        Ok(())
    }
}

/// Two noisy rings of points in 16 dimensions, one per class.
fn data(rows: usize, seed: u32) -> (Array2<f32>, Array1<u32>) {
    let labels: Array1<u32> = (0..rows).map(|i| (i % 2) as u32).collect();
    let x = Array2::from_shape_fn((rows, 16), |(i, j)| {
        let radius = 1.0 + 2.0 * labels[i] as f32;
        let angle = (i as f32 * 0.37 + j as f32) * 0.7;
        let noise = ((i as u32 * 16 + j as u32).wrapping_mul(2_654_435_761) ^ seed) % 1000;
        radius * angle.sin() + (noise as f32 / 1000.0 - 0.5) * 0.6
    });
    (x, labels)
}

fn config() -> carve::Result<NetworkConfig> {
    NetworkConfig::builder(16)
        .layer(Scale { name: "scale".into() })
        .dense(64)
        .relu()
        .dense(2)
        .seed(5)
        .updater(Updater::adam(5e-3))
        .training_workspace_mode(WorkspaceMode::Enabled)
        .inference_workspace_mode(WorkspaceMode::Enabled)
        .build()
}

/// Every parameter of a trainer's network, as bits.
fn bits(net: &Network) -> Vec<u32> {
    net.params().iter().map(|v| v.to_bits()).collect()
}

fn main() -> ExitCode {
    let Args {} = cli::parse();
    cli::exit_status::<Args, _>(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let (x, y) = data(512, 7);
    let (test_x, test_y) = data(256, 8);
    let batches = || x.axis_chunks_iter(Axis(0), 32).zip(y.axis_chunks_iter(Axis(0), 32));

    // A network.
    let mut net = Network::new(config()?)?;
    for epoch in 1..=30 {
        let loss = net.fit_iter(batches())?;
        if epoch % 10 == 0 {
            println!("epoch {epoch:>2}: mean loss {loss:.4}");
        }
    }
    let accuracy = net.evaluate(test_x.view(), test_y.view(), 64)?;
    println!("Scale trained by a Network: test accuracy {accuracy:.3}");

    // Two data-parallel workers (threads), and one thread running the two shards in turn.
    let mut threads = DataParallel::new(Network::new(config()?)?, ParallelConfig::threads(2))?;
    let mut sequential = DataParallel::new(Network::new(config()?)?, ParallelConfig::sequential(2))?;
    for _ in 0..5 {
        threads.fit_iter(batches())?;
        sequential.fit_iter(batches())?;
    }
    let (threads, sequential) = (threads.into_network()?, sequential.into_network()?);
    let bits_equal = bits(&threads) == bits(&sequential);
    println!("Scale trained by 2 data-parallel workers: the same bits as sequential(2): {bits_equal}");

    // Saved under its parameters' names, loaded with the configuration that builds it,
    // served from a pool.
    let path = std::env::temp_dir().join(format!("carve-custom-layer-{}.safetensors", std::process::id()));
    net.save(&path)?;
    let loaded = Model::load_with(&path, &config()?);
    std::fs::remove_file(&path)?;
    let pool = InferencePool::new(Arc::new(loaded?), PoolConfig::direct(2))?;
    let served = pool.output(test_x.view())? == net.output(test_x.view())?;
    println!("Scale served from an InferencePool after save and load: the network's outputs: {served}");

    println!(
        "{}",
        serde_json::json!({ "trained": accuracy, "data_parallel_bits_equal": bits_equal, "served": served })
    );
    Ok(())
}
