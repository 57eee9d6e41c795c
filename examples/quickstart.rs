//! A training-shaped loop on a workspace: prints what each cycle allocated, the size
//! the workspace learned, and the statistics table.
//!
//! Run: `cargo run --release --example quickstart` (no flags; `--help` says so, an
//! error is one line, `quickstart: error: <message>`, and exit status 1).

use std::process::ExitCode;

use carve::{stats_table, LearningPolicy, SpillPolicy, Workspace, WorkspaceArrayExt, WorkspaceConfig};
use clap::Parser;

#[path = "common/cli.rs"]
mod cli;

/// A training-shaped loop on a workspace: prints what each cycle allocated, the
/// size the workspace learned, and the statistics table.
#[derive(Parser)]
#[command(name = "quickstart", verbatim_doc_comment)]
struct Args {}

/// Sizes of an MLP 784-256-10 step at batch 64: activations forward, gradients back.
const BATCH: usize = 64;
const LAYERS: [usize; 3] = [784, 256, 10];

fn train_step(ws: &Workspace, step: usize) -> carve::Result<f32> {
    let scope = ws.enter()?;
    let input = scope.from_shape_fn((BATCH, LAYERS[0]), |(i, j)| ((i * 31 + j * 7 + step) % 17) as f32 / 17.0)?;
    let mut activations = vec![input];
    for &width in &LAYERS[1..] {
        let previous = activations.last().expect("input is there");
        let mut next = scope.zeros::<f32, _>((BATCH, width))?;
        // A stand-in for a matrix multiply: every output reads its row of the input.
        for (mut row, prev) in next.rows_mut().into_iter().zip(previous.rows()) {
            let mean = prev.mean().unwrap_or(0.0);
            row.fill(mean.max(0.0));
        }
        activations.push(next);
    }
    let mut loss = 0.0;
    for pair in activations.windows(2).rev() {
        let grad = scope.filled::<f32, _>(pair[1].raw_dim(), 0.01)?;
        let scratch = scope.zeros::<f32, _>((pair[0].ncols(), pair[1].ncols()))?;
        loss += (&grad * &pair[1]).sum() + scratch.sum();
    }
    let logits = activations.last().expect("output layer").detach(); // survives the reset
    Ok(loss + logits.sum() * 0.0)
}

fn main() -> ExitCode {
    let Args {} = cli::parse();
    cli::exit_status::<Args, _>(run())
}

fn run() -> carve::Result<()> {
    let config = WorkspaceConfig::builder()
        .learning(LearningPolicy::FirstLoop)
        .spill(SpillPolicy::Reallocate)
        .cycle_history_len(64)
        .build()?;
    let ws = Workspace::new("WS_TRAIN_STEP", config)?;
    println!("{:>5}  {:>12}  {:>12}  {:>12}  {:>10}", "cycle", "allocated", "spilled", "capacity", "loss");
    let mut spilled_before = 0;
    for step in 0..10 {
        let loss = train_step(&ws, step)?;
        let s = ws.stats();
        println!(
            "{:>5}  {:>10} B  {:>10} B  {:>10} B  {:>10.4}",
            s.cycles,
            s.last_cycle_bytes,
            s.bytes_spilled - spilled_before,
            s.capacity,
            loss
        );
        spilled_before = s.bytes_spilled;
    }
    let s = ws.stats();
    println!();
    println!(
        "learned size: {} bytes (from the first cycle); capacity {} bytes; {} growth event(s); \
         {} arrays spilled while learning",
        s.learned_size.unwrap_or(0),
        s.capacity,
        s.growth_events,
        s.external_allocations
    );
    println!();
    print!("{}", stats_table(&[s]));
    Ok(())
}
