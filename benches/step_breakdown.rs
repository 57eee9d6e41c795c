//! Where a training step's time goes, for the demo's MLP (64-128-64-10, batch 32) and
//! the wide one (784-1024-1024-10, batch 128): each part's µs per steady step and its
//! share ([`StepBreakdown`](carve::nn::StepBreakdown)), the step's GFLOP/s over its
//! median time, and carve's matrix multiply alone on the step's shapes in the same run.
//! Adam, `WorkspaceMode::Enabled`, synthetic batches. A table, then one JSON line with
//! `--json`.
//!
//! Run: `cargo run --release --example step_breakdown -- --json`

use std::time::Instant;

use carve::nn::{Network, NetworkConfig, Updater};
use clap::Parser;
use ndarray::{Array1, Array2};

#[path = "../examples/common/breakdown.rs"]
mod breakdown;

#[derive(Parser, Debug)]
#[command(
    about = "Where a training step's time goes, for the demo's MLP and the wide one; a table and, with --json, JSON"
)]
struct Args {
    /// Steady steps measured per network (after 20 warm-up steps).
    #[arg(long, default_value_t = 400, value_parser = clap::value_parser!(u32).range(10..))]
    steps: u32,
    /// Threads of the networks broken down (`Network::set_threads`; the comparison of 1
    /// and 2 threads at the end runs either way).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    threads: u32,
    /// Print one JSON line after the table.
    #[arg(long)]
    json: bool,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let mut cases = Vec::new();
    for (name, hidden, inputs, classes, batch, steps) in [
        ("64-128-64-10", &[128usize, 64][..], 64, 10, 32, args.steps),
        ("784-1024-1024-10", &[1024, 1024][..], 784, 10, 128, (args.steps / 8).max(10)),
    ] {
        let mut builder = NetworkConfig::builder(inputs);
        for &w in hidden {
            builder = builder.dense(w).relu();
        }
        let mut net = Network::new(builder.dense(classes).seed(1).updater(Updater::adam(1e-3)).build()?)?;
        net.set_threads(args.threads as usize)?;
        let batches: Vec<(Array2<f32>, Array1<u32>)> = (0..8)
            .map(|b| {
                let x =
                    Array2::from_shape_fn((batch, inputs), |(r, c)| ((r * 131 + c * 71 + b * 37) % 257) as f32 / 257.0);
                (x, Array1::from_shape_fn(batch, |r| ((r * 7 + b) % classes) as u32))
            })
            .collect();
        for s in 0..20 {
            let (x, y) = &batches[s % batches.len()];
            net.fit_batch(x.view(), y.view())?;
        }
        net.set_breakdown(true);
        let mut times = Vec::with_capacity(steps as usize);
        for s in 0..steps as usize {
            let (x, y) = &batches[s % batches.len()];
            let t0 = Instant::now();
            net.fit_batch(x.view(), y.view())?;
            times.push(t0.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        let median_s = times[times.len() / 2];
        let widths = breakdown::widths(inputs, hidden, classes);
        let step_gflops = breakdown::step_flops(&widths, batch) / median_s / 1e9;
        let gemm = breakdown::gemm_gflops(&widths, batch, if batch > 64 { 30 } else { 200 })?;
        let b = net.breakdown().expect("switched on");
        println!("{}", breakdown::breakdown_lines(&format!("{name}, batch {batch}"), &b));
        println!(
            "  median step {:.1} µs: {step_gflops:.1} GFLOP/s; the matrix multiply alone {gemm:.1} GFLOP/s ({:.0}%)",
            median_s * 1e6,
            100.0 * step_gflops / gemm
        );
        cases.push(serde_json::json!({
            "network": name,
            "batch": batch,
            "threads": args.threads,
            "steps": b.steps,
            "step_us_median": median_s * 1e6,
            "breakdown_us": breakdown::breakdown_json(&b),
            "step_gflops": step_gflops,
            "gemm_gflops_same_shapes": gemm,
            "step_over_gemm": step_gflops / gemm,
        }));
    }
    // The wide MLP on 1 and 2 threads (`Network::set_threads`), interleaved rounds of
    // 4 steps each; the same batches, so the same losses are expected, bit for bit.
    let threads = {
        let make = |threads: usize| -> Result<Network, Box<dyn std::error::Error>> {
            let config = NetworkConfig::builder(784)
                .dense(1024)
                .relu()
                .dense(1024)
                .relu()
                .dense(10)
                .seed(1)
                .updater(Updater::adam(1e-3));
            let mut net = Network::new(config.build()?)?;
            net.set_threads(threads)?;
            Ok(net)
        };
        let (mut one, mut two) = (make(1)?, make(2)?);
        let batches: Vec<(Array2<f32>, Array1<u32>)> = (0..4)
            .map(|b| {
                let x = Array2::from_shape_fn((128, 784), |(r, c)| ((r * 131 + c * 71 + b * 37) % 257) as f32 / 257.0);
                (x, Array1::from_shape_fn(128, |r| ((r * 7 + b) % 10) as u32))
            })
            .collect();
        let (mut same, mut ratios, mut step) = (true, Vec::new(), 0usize);
        for round in 0..(args.steps / 40).max(4) + 1 {
            let mut ns = [0f64; 2];
            for (i, net) in [&mut one, &mut two].into_iter().enumerate() {
                let t0 = Instant::now();
                for s in 0..4 {
                    let (x, y) = &batches[(step + s) % batches.len()];
                    net.fit_batch(x.view(), y.view())?;
                }
                ns[i] = t0.elapsed().as_secs_f64();
            }
            for s in 0..1 {
                let (x, y) = &batches[(step + s) % batches.len()];
                same &= one.fit_batch(x.view(), y.view())?.to_bits() == two.fit_batch(x.view(), y.view())?.to_bits();
            }
            step += 5;
            if round > 0 {
                ratios.push(ns[0] / ns[1]);
            }
        }
        ratios.sort_by(f64::total_cmp);
        let speedup = ratios[ratios.len() / 2];
        println!(
            "784-1024-1024-10, batch 128: 2 threads {speedup:.2}x one thread's steps per second; same losses {same}"
        );
        serde_json::json!({ "network": "784-1024-1024-10", "batch": 128, "two_threads_over_one": speedup, "same_bits": same })
    };
    if args.json {
        println!("{}", serde_json::json!({ "cases": cases, "threads": threads }));
    }
    Ok(())
}
