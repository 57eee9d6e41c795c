//! Prefetch overlap: a synthetic batch source whose batches cost P to fill and a
//! training step that costs C (busy work on the batch, P ≈ C), run serially (the
//! prefetcher in shield mode: fill, then step) and with the prefetcher's background
//! thread (the fill of the next batches overlaps the step). Ideally the prefetched
//! epoch takes max(P, C) per batch, half the serial time.
//!
//! Also measured in the same run:
//! - the hand-off alone: batches that cost nothing to fill or consume, so the time per
//!   batch is the protocol's; against the same pipeline built on crossbeam channels
//!   (batch buffers travel to the consumer on a `bounded(2)` channel and back on
//!   another: one round trip per batch);
//! - heap allocations per batch in steady state, on the producer and the consumer
//!   thread, with workspaces enabled and with `WorkspaceMode::None`.
//!
//! Serial and prefetched epochs alternate over several rounds; medians are reported.
//! The machine has two cores: producer and consumer fill it, so run nothing else.
//!
//! Run: `cargo run --release --example prefetch_overlap -- [--json] [--batches N]
//! [--batch-us T] [--depth D] [--rounds R]` (`--help` lists the flags and their valid
//! ranges; a value out of range is an error, exit status 2).

use std::error::Error;
use std::hint::black_box;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_iter::{BatchLayout, BatchMut, BatchSource, Prefetcher, SourceError, Threading, MAX_DEPTH};
use carve::WorkspaceMode;
use clap::builder::RangedU64ValueParser;
use clap::Parser;
use ndarray::{Ix1, Ix2};

#[path = "common/cli.rs"]
mod cli;

type Res<T> = Result<T, Box<dyn Error>>;

// ---------------------------------------------------------------------------------
// Counting the default allocator's calls on each thread: carve's counting allocator
// (`carve::alloc_check`), which counts `alloc`, `alloc_zeroed` and `realloc` per thread.

#[global_allocator]
static GLOBAL: carve::alloc_check::CountingAllocator = carve::alloc_check::CountingAllocator::system();

/// Heap allocation calls of the calling thread so far.
fn heap_allocs() -> u64 {
    carve::alloc_check::thread_counts().allocations
}

// ---------------------------------------------------------------------------------
// The synthetic workload.

/// Prefetch overlap and hand-off cost of async-iter.
#[derive(Parser)]
#[command(name = "prefetch_overlap", verbatim_doc_comment, next_line_help = true)]
struct Args {
    /// Print one JSON object on the last line
    #[arg(long)]
    json: bool,
    /// Batches per epoch (8 to 1000000)
    #[arg(long, value_name = "N", default_value_t = 300,
          value_parser = RangedU64ValueParser::<usize>::new().range(8..=1_000_000))]
    batches: usize,
    /// Target cost of filling a batch and of one step on it (P and C), in
    /// microseconds (1 to 1000000)
    #[arg(long, value_name = "T", default_value_t = 1000, verbatim_doc_comment,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    batch_us: u64,
    /// Prefetch depth: batches filled ahead (1 to 1024)
    #[arg(long, value_name = "D", default_value_t = 2,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_DEPTH as u64))]
    depth: usize,
    /// Measured rounds: serial and prefetched epochs alternate, medians are
    /// reported (1 to 1000)
    #[arg(long, value_name = "R", default_value_t = 5, verbatim_doc_comment,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..=1000))]
    rounds: usize,
}

/// Features per batch: 64 rows of 256 `f32` (64 KiB), plus 64 `u32` labels.
const ROWS: usize = 64;
const COLS: usize = 256;

/// splitmix64: the unit of busy work.
#[inline(always)]
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// `rounds` mixes of `seed`: P and C are made of this, element by element.
#[inline(always)]
fn work(seed: u64, rounds: u32) -> u64 {
    (0..rounds).fold(seed, |h, _| mix(h))
}

/// The training step C: reads every feature and label, `rounds` mixes each.
fn step(lease: &async_iter::Lease<'_>, rounds: u32) -> Res<u64> {
    let x = lease.features::<f32, Ix2>()?;
    let y = lease.labels::<u32, Ix1>()?;
    let sum = x.iter().fold(0, |acc, v| acc ^ work(v.to_bits() as u64, rounds));
    Ok(y.iter().fold(sum, |acc, &v| acc ^ v as u64))
}

/// Batches of `ROWS × COLS` features, each element `rounds` mixes (the cost P).
struct Synthetic {
    batches: usize,
    rounds: u32,
    /// The producer thread's allocation count at each fill.
    allocs_at_fill: Arc<Vec<AtomicU64>>,
    /// Total time spent filling, in nanoseconds.
    fill_ns: Arc<AtomicU64>,
}

impl BatchSource for Synthetic {
    fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
        Ok((index < self.batches).then(|| BatchLayout::new().features::<f32, _>((ROWS, COLS)).labels::<u32, _>(ROWS)))
    }

    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
        let index = batch.index();
        if let Some(count) = self.allocs_at_fill.get(index) {
            count.store(heap_allocs(), Ordering::Relaxed);
        }
        let start = Instant::now();
        let seed = (index as u64) << 32;
        for (i, x) in batch.features::<f32, Ix2>()?.iter_mut().enumerate() {
            *x = (work(seed ^ i as u64, self.rounds) >> 40) as f32;
        }
        for (i, y) in batch.labels::<u32, Ix1>()?.iter_mut().enumerate() {
            *y = (index + i) as u32 % 10;
        }
        self.fill_ns.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(())
    }
}

/// Mixing rounds per element so that one batch takes about `target`.
fn calibrate(target: Duration) -> u32 {
    let elements = (ROWS * COLS) as u64;
    let probe = 64;
    let mut best = Duration::MAX;
    for _ in 0..5 {
        let start = Instant::now();
        black_box((0..elements).fold(0, |acc, i| acc ^ work(black_box(i), probe)));
        best = best.min(start.elapsed());
    }
    let per_round = best.as_secs_f64() / probe as f64;
    ((target.as_secs_f64() / per_round).round() as u32).max(1)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

// ---------------------------------------------------------------------------------
// One prefetcher, epoch after epoch.

/// A prefetcher over [`Synthetic`] and what it records.
struct Run {
    prefetcher: Prefetcher<Synthetic>,
    allocs_at_fill: Arc<Vec<AtomicU64>>,
    fill_ns: Arc<AtomicU64>,
    batches: usize,
    rounds: u32,
}

/// What one epoch measured.
struct Epoch {
    elapsed: Duration,
    /// Mean fill time (P) and step time (C) per batch.
    fill: Duration,
    step: Duration,
    /// Heap allocations per batch after the first few: producer thread, consumer thread.
    producer_allocs: f64,
    consumer_allocs: f64,
}

impl Run {
    fn new(batches: usize, rounds: u32, depth: usize, mode: WorkspaceMode, threading: Threading) -> Res<Run> {
        let allocs_at_fill = Arc::new((0..batches).map(|_| AtomicU64::new(0)).collect::<Vec<_>>());
        let fill_ns = Arc::new(AtomicU64::new(0));
        let source = Synthetic { batches, rounds, allocs_at_fill: allocs_at_fill.clone(), fill_ns: fill_ns.clone() };
        let prefetcher = Prefetcher::builder(source)
            .depth(depth)
            .workspace_mode(mode)
            .threading(threading)
            .build()
            .map_err(|e| format!("building the prefetcher: {e}"))?;
        Ok(Run { prefetcher, allocs_at_fill, fill_ns, batches, rounds })
    }

    /// One epoch: every batch through `step`. The first epoch starts at `build`, later
    /// ones at `reset`, just before the clock starts.
    fn epoch(&mut self, first: bool) -> Res<Epoch> {
        if !first {
            self.prefetcher.reset().map_err(|e| format!("starting an epoch: {e}"))?;
        }
        self.fill_ns.store(0, Ordering::Relaxed);
        let warm_up = 4.min(self.batches - 1);
        let (mut step_time, mut consumer_allocs, mut checksum) = (Duration::ZERO, 0, 0);
        let start = Instant::now();
        for index in 0..self.batches {
            if index == warm_up {
                consumer_allocs = heap_allocs();
            }
            let lease = match self.prefetcher.next() {
                Some(lease) => lease.map_err(|e| format!("batch {index}: {e}"))?,
                None => return Err(format!("the epoch ended after {index} batches, not {}", self.batches).into()),
            };
            let step_start = Instant::now();
            checksum ^= step(&lease, self.rounds)?;
            step_time += step_start.elapsed();
        }
        let elapsed = start.elapsed();
        if self.prefetcher.next().is_some() {
            return Err(format!("the epoch has more than {} batches", self.batches).into());
        }
        black_box(checksum);
        let consumer_allocs = heap_allocs() - consumer_allocs;
        let at = |i: usize| self.allocs_at_fill[i].load(Ordering::Relaxed);
        let steady = (self.batches - 1 - warm_up).max(1) as f64;
        Ok(Epoch {
            elapsed,
            fill: Duration::from_nanos(self.fill_ns.load(Ordering::Relaxed) / self.batches as u64),
            step: step_time / self.batches as u32,
            producer_allocs: at(self.batches - 1).saturating_sub(at(warm_up)) as f64 / steady,
            consumer_allocs: consumer_allocs as f64 / steady,
        })
    }
}

// ---------------------------------------------------------------------------------
// The hand-off alone.

/// Nanoseconds per batch of a prefetcher whose batches cost nothing (64 bytes, no
/// work), one epoch of `batches` after a `reset`.
fn handoff_carve(prefetcher: &mut Prefetcher<Tiny>, batches: usize) -> Res<f64> {
    prefetcher.reset()?;
    let start = Instant::now();
    let mut sum = 0.0;
    while let Some(lease) = prefetcher.next() {
        sum += lease?.features::<f32, Ix1>()?[0];
    }
    let elapsed = start.elapsed();
    if sum != batches as f32 {
        return Err(format!("hand-off: {sum} batches of {batches} arrived").into());
    }
    Ok(elapsed.as_nanos() as f64 / batches as f64)
}

/// `batches` batches of 16 `f32` that cost nothing to fill.
struct Tiny {
    batches: usize,
}

impl BatchSource for Tiny {
    fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
        Ok((index < self.batches).then(|| BatchLayout::new().features::<f32, _>(16)))
    }
    fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
        batch.features::<f32, Ix1>()?[0] = 1.0;
        Ok(())
    }
}

/// Nanoseconds per batch of the same pipeline on crossbeam channels: 3 buffers of 16
/// `f32` go to the consumer on a `bounded(2)` channel and come back on another.
fn handoff_crossbeam(batches: usize) -> Res<f64> {
    let (full_tx, full_rx) = crossbeam::channel::bounded::<Box<[f32; 16]>>(2);
    let (free_tx, free_rx) = crossbeam::channel::bounded::<Box<[f32; 16]>>(3);
    for _ in 0..3 {
        free_tx.send(Box::new([0.0; 16])).map_err(|_| "the crossbeam channel refused a buffer")?;
    }
    let start = Instant::now();
    let producer = std::thread::spawn(move || {
        for _ in 0..batches {
            let Ok(mut buffer) = free_rx.recv() else { return };
            buffer[0] = 1.0;
            if full_tx.send(buffer).is_err() {
                return;
            }
        }
    });
    let mut sum = 0.0;
    for _ in 0..batches {
        let Ok(buffer) = full_rx.recv() else { break };
        sum += buffer[0];
        let _ = free_tx.send(buffer); // the producer may be done: nothing to return it to
    }
    let elapsed = start.elapsed();
    producer.join().map_err(|_| "the crossbeam producer thread panicked")?;
    if sum != batches as f32 {
        return Err(format!("crossbeam hand-off: {sum} batches of {batches} arrived").into());
    }
    Ok(elapsed.as_nanos() as f64 / batches as f64)
}

// ---------------------------------------------------------------------------------

fn main() -> ExitCode {
    let args: Args = cli::parse();
    cli::exit_status::<Args, _>(run(&args))
}

fn run(args: &Args) -> Res<()> {
    let (batches, depth) = (args.batches, args.depth);
    let rounds = calibrate(Duration::from_micros(args.batch_us));

    let mut serial = Run::new(batches, rounds, depth, WorkspaceMode::Enabled, Threading::Shield)?;
    let mut enabled = Run::new(batches, rounds, depth, WorkspaceMode::Enabled, Threading::Background)?;
    let mut none = Run::new(batches, rounds, depth, WorkspaceMode::None, Threading::Background)?;
    // Warm-up epochs: rings sized, threads and caches warm.
    serial.epoch(true)?;
    enabled.epoch(true)?;
    none.epoch(true)?;
    let (mut serial_ms, mut enabled_ms, mut none_ms) = (Vec::new(), Vec::new(), Vec::new());
    let (mut fill_us, mut step_us) = (Vec::new(), Vec::new());
    let (mut last_enabled, mut last_none) = (None, None);
    for round in 0..args.rounds {
        let measure = |run: &mut Run, into: &mut Vec<f64>| -> Res<Epoch> {
            let epoch = run.epoch(false)?;
            into.push(epoch.elapsed.as_secs_f64() * 1e3);
            Ok(epoch)
        };
        // Alternate the order so that drift in the machine's speed hits both alike.
        let (s, e, n) = if round % 2 == 0 {
            let s = measure(&mut serial, &mut serial_ms)?;
            (s, measure(&mut enabled, &mut enabled_ms)?, measure(&mut none, &mut none_ms)?)
        } else {
            let n = measure(&mut none, &mut none_ms)?;
            let e = measure(&mut enabled, &mut enabled_ms)?;
            (measure(&mut serial, &mut serial_ms)?, e, n)
        };
        fill_us.push(s.fill.as_secs_f64() * 1e6);
        step_us.push(s.step.as_secs_f64() * 1e6);
        (last_enabled, last_none) = (Some(e), Some(n));
    }
    let (Some(last_enabled), Some(last_none)) = (last_enabled, last_none) else {
        return Err("no round was measured".into());
    };

    let handoff_batches = 50_000;
    let mut tiny = Prefetcher::builder(Tiny { batches: handoff_batches }).depth(depth).build()?;
    while tiny.next().is_some() {} // the first epoch sizes the ring
    let (mut carve_ns, mut crossbeam_ns) = (Vec::new(), Vec::new());
    for _ in 0..15 {
        carve_ns.push(handoff_carve(&mut tiny, handoff_batches)?);
        crossbeam_ns.push(handoff_crossbeam(handoff_batches)?);
    }

    let serial_ms = median(&mut serial_ms);
    let prefetch_ms = median(&mut enabled_ms);
    let none_ms = median(&mut none_ms);
    let (fill_us, step_us) = (median(&mut fill_us), median(&mut step_us));
    let handoff_us = median(&mut carve_ns) / 1e3;
    let crossbeam_us = median(&mut crossbeam_ns) / 1e3;
    let overlap_ratio = prefetch_ms / serial_ms;
    let stats = enabled.prefetcher.stats();

    let per_batch = |ms: f64| ms * 1e3 / batches as f64;
    println!("prefetch overlap: {batches} batches of {ROWS}×{COLS} f32 + {ROWS} u32, depth {depth}");
    println!("P (fill) ≈ {fill_us:.0} µs, C (step) ≈ {step_us:.0} µs per batch; medians of {} rounds", args.rounds);
    println!();
    println!("| variant | epoch ms | µs/batch | ratio to serial | heap allocs/batch (producer, consumer) |");
    println!("|---|---:|---:|---:|---:|");
    println!("| serial (shield: fill, then step) | {serial_ms:.1} | {:.1} | 1.00 | |", per_batch(serial_ms));
    let allocs = |e: &Epoch| format!("{:.2}, {:.2}", e.producer_allocs, e.consumer_allocs);
    println!(
        "| prefetch, workspaces enabled | {prefetch_ms:.1} | {:.1} | {overlap_ratio:.3} | {} |",
        per_batch(prefetch_ms),
        allocs(&last_enabled)
    );
    println!(
        "| prefetch, WorkspaceMode::None | {none_ms:.1} | {:.1} | {:.3} | {} |",
        per_batch(none_ms),
        none_ms / serial_ms,
        allocs(&last_none)
    );
    println!();
    println!("| hand-off alone ({handoff_batches} batches, no work; median of 15) | µs/batch |");
    println!("|---|---:|");
    println!("| async-iter prefetcher (depth {depth}) | {handoff_us:.3} |");
    println!("| crossbeam bounded(2) round trip (full + free channels) | {crossbeam_us:.3} |");
    println!();
    println!("{stats}");
    println!();
    let verdict = |ok: bool| if ok { "met" } else { "NOT MET" };
    println!("| target | measured | |");
    println!("|---|---:|---|");
    println!("| overlap_ratio ≤ 0.55 with P ≈ C | {overlap_ratio:.3} | {} |", verdict(overlap_ratio <= 0.55));
    println!("| hand-off ≤ 2 µs per batch | {handoff_us:.3} µs | {} |", verdict(handoff_us <= 2.0));
    let zero = last_enabled.producer_allocs == 0.0 && last_enabled.consumer_allocs == 0.0;
    println!("| 0 heap allocations per batch, workspaces enabled | {} | {} |", allocs(&last_enabled), verdict(zero));
    if args.json {
        let json = serde_json::json!({
            "serial_ms": serial_ms,
            "prefetch_ms": prefetch_ms,
            "overlap_ratio": overlap_ratio,
            "handoff_us_median": handoff_us,
            "first_batch_bytes": stats.first_batch_bytes,
            "ring_bytes": stats.ring_bytes,
            "ring_growths": stats.ring_growths,
        });
        println!("{json}");
    }
    Ok(())
}
