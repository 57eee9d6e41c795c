//! Planned workspaces against the per-role layout on two networks, in one run: the
//! digits MLP 64-128-64-10 at batch 32 and 784-1024-1024-10 at batch 128, each trained
//! for a few iterations with `WorkspaceMode::Enabled` (one bump arena per role) and
//! with `WorkspaceMode::Planned` (one arena, offsets planned from the recorded
//! lifetimes, frames releasing each update and the activations closed before the
//! update). Prints a table, then one JSON line (`--json`) with, per network: the
//! planned arena (`plan_bytes`), the lower bound of its recording
//! (`lower_bound_bytes`), their ratio (`plan_to_bound`), what the recording takes laid
//! out per role (`per_role_bytes`), the per-role workspaces' capacity in enabled mode
//! (`enabled_bytes`), `planning_us`, `replans`, `divergences`, the heap allocations
//! and minor page faults of each mode's steady iterations, their median times and
//! ratio, and whether the losses of the two modes are bit-identical.
//!
//! Goals (issue 13): plan ≤ 1.05× the lower bound; 784-1024-1024-10 at batch 128 ≤
//! 4.52 MB with the finer release points; 0 allocations and 0 page faults per steady
//! planned iteration; wall time per iteration no worse than the per-role layout.
//!
//! Run: `cargo run --release --example planned_networks -- --json`

use std::time::Instant;

use carve::alloc_check::CountingAllocator;
use carve::nn::Network;
use carve::workspace_core::alloc_check::thread_counts;
use carve::WorkspaceMode;
use clap::Parser;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::system();

#[path = "../examples/common/faults.rs"]
mod faults;
mod workloads;

#[derive(Parser, Debug)]
#[command(
    about = "Planned against per-role workspaces on two networks; prints a table and, with --json, one JSON line"
)]
struct Args {
    /// Training iterations per network and mode (the first two warm up: learning,
    /// recording and planning).
    #[arg(long, default_value_t = 40, value_parser = clap::value_parser!(u32).range(4..))]
    iterations: u32,
    /// Print one JSON line after the table.
    #[arg(long)]
    json: bool,
}

/// One mode's run of one network.
struct Run {
    losses: Vec<f32>,
    times_ns: Vec<u64>,
    allocs: Vec<u64>,
    faults: Vec<u64>,
    net: Network,
}

fn network(widths: &[usize], mode: WorkspaceMode) -> Network {
    let config = workloads::mlp(widths)
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode)
        .seed(7)
        .build()
        .expect("a valid network");
    Network::new(config).expect("a network")
}

fn train(widths: &[usize], batch: usize, mode: WorkspaceMode, iterations: u32) -> Run {
    let net = network(widths, mode);
    let (x, y) = workloads::mlp_batch(widths, batch);
    let mut run = Run { losses: Vec::new(), times_ns: Vec::new(), allocs: Vec::new(), faults: Vec::new(), net };
    for _ in 0..iterations {
        let (faults0, heap0) = (faults::minor_faults(), thread_counts());
        let t0 = Instant::now();
        let loss = run.net.fit_batch(x.view(), y.view()).expect("a training step");
        let elapsed = t0.elapsed();
        let (heap1, faults1) = (thread_counts(), faults::minor_faults());
        run.losses.push(loss);
        run.times_ns.push(elapsed.as_nanos() as u64);
        run.allocs.push(heap1.allocations - heap0.allocations);
        run.faults.push(faults1 - faults0);
    }
    run
}

fn median(values: &[u64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_unstable();
    v[v.len() / 2] as f64
}

fn main() {
    let args = Args::parse();
    let mut rows = Vec::new();
    for (name, widths, batch) in workloads::PLANNED_NETWORKS {
        // Interleaved per network, so that both modes see the same machine state.
        let enabled = train(widths, batch, WorkspaceMode::Enabled, args.iterations);
        let planned = train(widths, batch, WorkspaceMode::Planned, args.iterations);
        let stats = planned.net.memory_plan().expect("a planned network has a plan group");
        let steady = 2..args.iterations as usize;
        let max = |v: &[u64]| v[steady.clone()].iter().copied().max().unwrap_or(0);
        let (enabled_ns, planned_ns) =
            (median(&enabled.times_ns[steady.clone()]), median(&planned.times_ns[steady.clone()]));
        let identical = enabled.losses.iter().zip(&planned.losses).all(|(a, b)| a.to_bits() == b.to_bits());
        let row = serde_json::json!({
            "network": name,
            "plan_bytes": stats.plan_bytes,
            "lower_bound_bytes": stats.lower_bound_bytes,
            "plan_to_bound": stats.plan_to_bound,
            "per_role_bytes": stats.per_role_bytes,
            "enabled_bytes": enabled.net.workspace_capacity(),
            "planned_arena_bytes": planned.net.workspace_capacity(),
            "allocations": stats.allocations,
            "planning_us": stats.planning_us,
            "plans": stats.plans,
            "replans": stats.replans,
            "divergences": stats.divergences,
            "planned_steady_allocs_max": max(&planned.allocs),
            "planned_steady_faults_max": max(&planned.faults),
            "enabled_steady_allocs_max": max(&enabled.allocs),
            "enabled_iteration_median_us": enabled_ns / 1e3,
            "planned_iteration_median_us": planned_ns / 1e3,
            "planned_to_enabled_time": planned_ns / enabled_ns,
            "losses_bit_identical": identical,
        });
        rows.push(row);
    }
    println!(
        "{:<30} {:>12} {:>12} {:>8} {:>12} {:>12} {:>10} {:>7} {:>7} {:>9} {:>9} {:>6}",
        "network",
        "plan B",
        "bound B",
        "ratio",
        "per role B",
        "enabled B",
        "plan µs",
        "allocs",
        "faults",
        "enab µs",
        "plan µs",
        "same"
    );
    for r in &rows {
        println!(
            "{:<30} {:>12} {:>12} {:>8.4} {:>12} {:>12} {:>10} {:>7} {:>7} {:>9.1} {:>9.1} {:>6}",
            r["network"].as_str().unwrap_or(""),
            r["plan_bytes"],
            r["lower_bound_bytes"],
            r["plan_to_bound"].as_f64().unwrap_or(0.0),
            r["per_role_bytes"],
            r["enabled_bytes"],
            r["planning_us"],
            r["planned_steady_allocs_max"],
            r["planned_steady_faults_max"],
            r["enabled_iteration_median_us"].as_f64().unwrap_or(0.0),
            r["planned_iteration_median_us"].as_f64().unwrap_or(0.0),
            r["losses_bit_identical"],
        );
    }
    if args.json {
        println!("{}", serde_json::json!({ "iterations": args.iterations, "networks": rows }));
    }
}
