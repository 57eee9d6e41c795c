//! How long sizing a network before its first step takes (`Network::dry_run`): a
//! training step and an inference of the demos' batch shapes (the digits MLP
//! 64-128-64-10 at 32 rows; the sequences LSTM 12-64-9 at 16 sequences of 26 steps,
//! the longest batch), in every workspace mode, each on a new network (so the first
//! dry run of each, as a user makes it), median and maximum over the rounds. A table,
//! then one JSON line with `--json`.
//!
//! Run: `cargo run --release --example dry_run -- --json`

use std::time::Instant;

use carve::nn::{dry::BatchShape, dry::DryPass};
use carve::WorkspaceMode;

#[path = "demo_networks.rs"]
mod demo_networks;

use demo_networks::network;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let json = std::env::args().any(|a| a == "--json");
    let rounds = 30;
    let mut cases = Vec::new();
    for (name, lstm, shape) in [
        ("digits MLP 64-128-64-10", false, BatchShape::flat(32)),
        ("sequences LSTM 12-64-9", true, BatchShape::sequences(16, 26)),
    ] {
        for mode in [WorkspaceMode::Enabled, WorkspaceMode::Planned, WorkspaceMode::None] {
            let mut times = Vec::with_capacity(rounds);
            let mut passes = 0;
            for _ in 0..rounds {
                let mut net = network(lstm, mode)?;
                let start = Instant::now();
                let estimate = net.dry_run(&[DryPass::Train(shape), DryPass::Infer(shape)])?;
                times.push(start.elapsed().as_secs_f64() * 1e6);
                passes = estimate.passes_run;
            }
            times.sort_by(f64::total_cmp);
            let (median, max) = (times[times.len() / 2], times[times.len() - 1]);
            println!("{name:<26} {:<8} {median:8.1} µs median, {max:8.1} µs max ({passes} passes)", mode.name());
            cases.push(serde_json::json!({
                "network": name,
                "mode": mode.name(),
                "shape": shape.to_string(),
                "dry_run_us_median": median,
                "dry_run_us_max": max,
                "passes": passes,
            }));
        }
    }
    if json {
        println!("{}", serde_json::json!({ "rounds": rounds, "cases": cases }));
    }
    Ok(())
}
