//! A user-written layer on `LayerWorkspaceMgr`: inverted dropout, and what happens
//! when a layer hands back memory from the wrong place.
//!
//! Run: `cargo run --release --example custom_layer` (no flags; `--help` says so, an
//! error is one line, `custom_layer: error: <message>`, and exit status 1).
//!
//! `Dropout` keeps nothing between its forward and backward pass but a seed: the mask
//! is drawn into forward working memory, and drawn again from the same seed into
//! backward working memory. Its output goes to `ctx.activations`, the only scope
//! that lives long enough — returning the working-memory mask instead does not
//! compile:
//!
//! ```text
//! let mask = ctx.working.zeros::<f32, _>(input.raw_dim())?;
//! Ok(freeze(mask))   // error: lifetime may not live long enough
//! ```
//!
//! (The `compile_fail` doctests on `carve::nn::Layer` hold the compiler to this.)
//!
//! What the compiler cannot see, the manager checks: a lazy `Dropout` returns its input
//! unchanged at inference time. Placed first in a network, its input is the caller's
//! array, not the activations workspace, and `Network::output` fails with an error
//! naming the layer, the array type, the expected and the actual workspace. The fix
//! is one call: `ctx.activations.leverage(input)` (no copy when the input is already
//! there).

use std::process::ExitCode;

use carve::nn::{BackwardCtx, ForwardCtx, Layer, Network, NetworkConfig, Rng, Updater};
use carve::{freeze, WorkspaceMode};
use clap::Parser;
use ndarray::{Array1, Array2, ArrayView2, ArrayViewMut2, Zip};

#[path = "common/cli.rs"]
mod cli;

/// A user-written layer on LayerWorkspaceMgr (inverted dropout), and the error
/// a layer gets when it hands back memory from the wrong place.
#[derive(Parser)]
#[command(name = "custom_layer", verbatim_doc_comment)]
struct Args {}

/// Inverted dropout: in training, each value is kept with probability `1 - rate` and
/// scaled by `1 / (1 - rate)`; at inference the layer is the identity.
struct Dropout {
    name: String,
    rate: f32,
    seeds: Rng,
    /// Seed of the mask of the last forward pass.
    mask_seed: u64,
    /// Return the input itself at inference (the bug this example shows).
    lazy: bool,
}

impl Dropout {
    fn new(name: &str, rate: f32, seed: u64) -> Dropout {
        Dropout { name: name.to_string(), rate, seeds: Rng::new(seed), mask_seed: 0, lazy: false }
    }

    /// The mask of the last forward pass, drawn into `scope`.
    fn mask<'s>(
        &self,
        scope: &'s carve::TypedScope,
        shape: ndarray::Ix2,
    ) -> carve::Result<ndarray::ArrayViewMut2<'s, f32>> {
        let mut rng = Rng::new(self.mask_seed);
        let keep = 1.0 - self.rate;
        Ok(scope.from_shape_fn(shape, |_| if rng.next_f32() < keep { 1.0 / keep } else { 0.0 })?)
    }
}

impl Layer for Dropout {
    fn name(&self) -> &str {
        &self.name
    }

    fn output_size(&self, inputs: usize) -> carve::Result<usize> {
        if !(0.0..1.0).contains(&self.rate) {
            return Err(carve::Error::InvalidConfig {
                reason: format!("dropout rate {} of layer '{}' must be in [0, 1)", self.rate, self.name),
            });
        }
        Ok(inputs)
    }

    fn forward<'a>(
        &mut self,
        input: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> carve::Result<ArrayView2<'a, f32>> {
        if !ctx.training {
            if self.lazy {
                return Ok(input); // compiles, and the manager catches it
            }
            return Ok(ctx.activations.leverage(input)?);
        }
        self.mask_seed = self.seeds.next_u64();
        let mask = self.mask(ctx.working, input.raw_dim())?; // reset when this call returns
        let mut out = ctx.activations.copy_of(&input)?; // kept for backprop
        out *= &mask;
        Ok(freeze(out))
    }

    fn backward(
        &mut self,
        _input: ArrayView2<'_, f32>,
        _output: ArrayView2<'_, f32>,
        grad_output: ArrayView2<'_, f32>,
        grad_input: Option<ArrayViewMut2<'_, f32>>,
        ctx: &BackwardCtx<'_>,
    ) -> carve::Result<()> {
        if let Some(grad_input) = grad_input {
            let mask = self.mask(ctx.working, grad_output.raw_dim())?;
            Zip::from(grad_input).and(&grad_output).and(&mask).for_each(|gi, &g, &m| *gi = g * m);
        }
        Ok(())
    }
}

/// Two noisy rings of points in 16 dimensions, one per class.
fn data(rows: usize, seed: u64) -> (Array2<f32>, Array1<u32>) {
    let mut rng = Rng::new(seed);
    let labels: Array1<u32> = (0..rows).map(|i| (i % 2) as u32).collect();
    let x = Array2::from_shape_fn((rows, 16), |(i, j)| {
        let radius = 1.0 + 2.0 * labels[i] as f32;
        let angle = (i as f32 * 0.37 + j as f32) * 0.7;
        radius * angle.sin() + rng.uniform(-0.3, 0.3)
    });
    (x, labels)
}

fn network(lazy_input_dropout: bool) -> carve::Result<Network> {
    let mut input_dropout = Dropout::new("input_dropout", 0.1, 1);
    input_dropout.lazy = lazy_input_dropout;
    let config = NetworkConfig::builder(16)
        .layer(input_dropout)
        .dense(64)
        .relu()
        .layer(Dropout::new("hidden_dropout", 0.2, 2))
        .dense(2)
        .seed(5)
        .updater(Updater::adam(5e-3))
        .training_workspace_mode(WorkspaceMode::Enabled)
        .inference_workspace_mode(WorkspaceMode::Enabled)
        .build()?;
    Network::new(config)
}

fn main() -> ExitCode {
    let Args {} = cli::parse();
    cli::exit_status::<Args, _>(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let (x, y) = data(512, 7);
    let (test_x, test_y) = data(256, 8);

    let mut net = network(false)?;
    for epoch in 1..=30 {
        let mut total = 0.0;
        for (xb, yb) in x.axis_chunks_iter(ndarray::Axis(0), 32).zip(y.axis_chunks_iter(ndarray::Axis(0), 32)) {
            total += net.fit_batch(xb, yb)?;
        }
        if epoch % 10 == 0 {
            println!("epoch {epoch:>2}: mean loss {:.4}", total / 16.0);
        }
    }
    let accuracy = net.evaluate(test_x.view(), test_y.view(), 64)?;
    println!("Dropout layers on LayerWorkspaceMgr: test accuracy {accuracy:.3}");
    println!("{}", carve::stats_table(&net.training_mgr().stats()));

    // The lazy variant trains the same way, but its inference shortcut hands back
    // the caller's array as if it were an activation.
    let mut lazy = network(true)?;
    for (xb, yb) in x.axis_chunks_iter(ndarray::Axis(0), 32).zip(y.axis_chunks_iter(ndarray::Axis(0), 32)) {
        lazy.fit_batch(xb, yb)?;
    }
    match lazy.output(test_x.view()) {
        Ok(_) => return Err("the misplaced activation was not detected".into()),
        Err(e) => println!("lazy Dropout at inference:\n  error: {e}"),
    }
    Ok(())
}
