//! Data-parallel training against one worker, in one run: for each network, a
//! [`DataParallel`] of N threads, the single-thread shard mode of N shards and one
//! worker train on the same batches, in interleaved rounds (each round times a few steps
//! of every trainer in turn), so that the machine's state is shared. Prints a table and,
//! with `--json`, one JSON line: per network, samples per second of each trainer and
//! their ratio to one worker (`speedup_vs_one_worker`, the median of the rounds'
//! ratios), `bytes_copied_for_reduction`, `gradient_bucket_bytes`, the heap
//! allocations of the steady steps, whether threads and shard mode gave the same loss
//! bits, and the memory: what the trainer holds (`memory_bytes`: the weights and the
//! updater's state once, each worker's arena) against what a copy of the model per
//! worker holds (`dl4j_design_bytes`: N × (weights + updater state + gradients) + the
//! same workspaces, DL4J's `ParallelWrapper`), from the same sizes.
//!
//! Networks: 784-1024-1024-10 at 128 rows per worker (the target: 2 threads ≥
//! 1.6× the samples per second of one worker on the 2-core machine), and the demo's
//! 64-128-64-10 at its batch of 32 (too small to scale: a step is ~100 µs, and a
//! reduction's two barriers cost a few µs each).
//!
//! Run: `cargo run --release --example data_parallel -- --json`

use std::time::Instant;

use carve::alloc_check::{process_counts, CountingAllocator, Threads};
use carve::nn::{
    parallel::DataParallel, parallel::ParallelConfig, parallel::ParallelStats, Network, NetworkConfig, Updater,
};
use clap::Parser;
use ndarray::{Array1, Array2};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::system();

#[derive(Parser, Debug)]
#[command(about = "Data-parallel training (threads, shard mode) against one worker; a table and, with --json, JSON")]
struct Args {
    /// Workers (threads, and shards of the shard mode).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(2..=64))]
    workers: u32,
    /// Rounds; each times `--steps` steps of every trainer in turn.
    #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Steps per trainer per round.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    steps: u32,
    /// Print one JSON line after the table.
    #[arg(long)]
    json: bool,
}

struct Case {
    name: &'static str,
    widths: &'static [usize],
    /// Rows per worker.
    rows_per_worker: usize,
}

const CASES: [Case; 2] = [
    Case { name: "784-1024-1024-10", widths: &[784, 1024, 1024, 10], rows_per_worker: 128 },
    Case { name: "64-128-64-10", widths: &[64, 128, 64, 10], rows_per_worker: 16 },
];

fn network(widths: &[usize]) -> carve::Result<Network> {
    let mut builder = NetworkConfig::builder(widths[0]);
    for &w in &widths[1..widths.len() - 1] {
        builder = builder.dense(w).relu();
    }
    Network::new(builder.dense(widths[widths.len() - 1]).seed(1).updater(Updater::adam(1e-3)).build()?)
}

fn batches(widths: &[usize], rows: usize, count: usize) -> Vec<(Array2<f32>, Array1<u32>)> {
    let (features, classes) = (widths[0], widths[widths.len() - 1]);
    (0..count)
        .map(|b| {
            let x = Array2::from_shape_fn((rows, features), |(r, c)| {
                (((r * 131 + c * 71 + b * 37) % 257) as f32 / 257.0) - 0.5
            });
            let y = Array1::from_shape_fn(rows, |r| ((r * 7 + b) % classes) as u32);
            (x, y)
        })
        .collect()
}

/// One trainer's figures.
struct Trainer {
    label: &'static str,
    trainer: DataParallel,
    ns: Vec<u64>,
    losses: Vec<u32>,
    steady_allocs: u64,
    steady_steps: u64,
}

impl Trainer {
    fn new(label: &'static str, widths: &[usize], config: ParallelConfig, steps: usize) -> carve::Result<Trainer> {
        let trainer = DataParallel::new(network(widths)?, config)?;
        // Room for every measurement up front: recording allocates nothing.
        let (ns, losses) = (Vec::with_capacity(steps), Vec::with_capacity(steps));
        Ok(Trainer { label, trainer, ns, losses, steady_allocs: 0, steady_steps: 0 })
    }

    /// `steps` steps; returns their nanoseconds.
    fn run(&mut self, data: &[(Array2<f32>, Array1<u32>)], steps: u32, steady: bool) -> carve::Result<u64> {
        let allocs0 = process_counts(Threads::All).allocations;
        let t0 = Instant::now();
        for s in 0..steps as usize {
            let (x, y) = &data[(self.losses.len() + s) % data.len()];
            let loss = self.trainer.fit_batch(x.view(), y.view())?;
            self.losses.push(loss.to_bits());
        }
        let ns = t0.elapsed().as_nanos() as u64;
        if steady {
            self.ns.push(ns);
            self.steady_allocs += process_counts(Threads::All).allocations - allocs0;
            self.steady_steps += u64::from(steps);
        }
        Ok(ns)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn memory(stats: &ParallelStats) -> serde_json::Value {
    serde_json::json!({
        "weight_bytes": stats.weight_bytes,
        "updater_state_bytes": stats.updater_state_bytes,
        "gradient_bucket_bytes": stats.gradient_bucket_bytes,
        "worker_plan_bytes": stats.worker_plan_bytes,
        "worker_arena_bytes": stats.worker_arena_bytes,
        "memory_bytes": stats.total_bytes(),
        "dl4j_design_bytes": stats.replicated_bytes(),
        "memory_over_dl4j_design": stats.total_bytes() as f64 / stats.replicated_bytes() as f64,
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let workers = args.workers as usize;
    let mut cases = Vec::new();
    for case in &CASES {
        let rows = case.rows_per_worker * workers;
        let data = batches(case.widths, rows, 8);
        let steps = 3 + (args.rounds * args.steps) as usize;
        let mut trainers = [
            Trainer::new("one_worker", case.widths, ParallelConfig::threads(1), steps)?,
            Trainer::new("threads", case.widths, ParallelConfig::threads(workers), steps)?,
            Trainer::new("sequential", case.widths, ParallelConfig::sequential(workers), steps)?,
        ];
        // Warm-up: planning, the first growths.
        for t in trainers.iter_mut() {
            t.run(&data, 3, false)?;
        }
        let mut ratios = Vec::new();
        for round in 0..args.rounds {
            // Alternate which goes first, so that neither always follows the other.
            let mut ns = [0u64; 3];
            let order: [usize; 3] = if round % 2 == 0 { [0, 1, 2] } else { [2, 1, 0] };
            for i in order {
                ns[i] = trainers[i].run(&data, args.steps, true)?;
            }
            ratios.push(ns[0] as f64 / ns[1] as f64);
        }
        let rate = |t: &Trainer| (t.steady_steps as f64 * rows as f64) / (t.ns.iter().sum::<u64>() as f64 / 1e9);
        let speedup = median(ratios);
        let one = rate(&trainers[0]);
        let stats = trainers[1].trainer.stats();
        let same_bits = trainers[1].losses == trainers[2].losses;
        println!(
            "{:<18} batch {rows:>4}: one worker {:>8.0} samples/s; {workers} threads {:>8.0} ({speedup:.2}x); shard mode \
             {:>8.0} ({:.2}x); same bits {same_bits}; memory {} B vs a copy per worker {} B",
            case.name,
            one,
            rate(&trainers[1]),
            rate(&trainers[2]),
            rate(&trainers[2]) / one,
            stats.total_bytes(),
            stats.replicated_bytes(),
        );
        cases.push(serde_json::json!({
            "network": case.name,
            "batch": rows,
            "workers": workers,
            "samples_per_second": {
                "one_worker": one,
                "threads": rate(&trainers[1]),
                "sequential": rate(&trainers[2]),
            },
            "speedup_vs_one_worker": speedup,
            "sequential_vs_one_worker": rate(&trainers[2]) / one,
            "bytes_copied_for_reduction": stats.bytes_copied_for_reduction,
            "gradient_bucket_bytes": stats.gradient_bucket_bytes,
            "gradient_buckets": stats.buckets,
            "steady_allocs_per_step": trainers.iter().map(|t| (t.label.to_string(), serde_json::Value::from(t.steady_allocs as f64 / t.steady_steps as f64))).collect::<serde_json::Map<_, _>>(),
            "threads_match_sequential": same_bits,
            "memory": memory(&stats),
        }));
    }
    if args.json {
        println!("{}", serde_json::json!({ "cases": cases }));
    }
    Ok(())
}
