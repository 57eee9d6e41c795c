//! Trains an LSTM classifier on the UCI Japanese Vowels sequences (270 training and 370
//! test utterances of 12 coefficients, 7 to 29 steps long, 9 speakers), with carve
//! workspaces on or off, from a prefetcher whose batches are padded only to their own
//! longest sequence: batch sizes vary, the prefetch ring grows for a longer batch, and
//! the network's workspaces settle once the longest batch has been seen.
//!
//! ```text
//! cargo run --release --example train_sequences
//! cargo run --release --example train_sequences -- --compare --json
//! ```
//!
//! | flag | default | what |
//! |---|---|---|
//! | `--workspace-mode MODE` | `enabled` | `enabled`, `planned` (one arena per batch shape, planned from its first iteration) or `none` (ignored with `--compare`) |
//! | `--compare` | off | train the three modes (same seed) and check that their loss traces are bit-identical |
//! | `--epochs N` | 40 | passes over the training set (at most 1,000,000) |
//! | `--batch-size N` | 16 | sequences per training iteration |
//! | `--hidden W,W,...` | `64` | LSTM widths, one stacked LSTM per width |
//! | `--head last\|mean` | `last` | the sequence head: last unmasked step, or masked mean |
//! | `--bucket N` | 0 | sort sequences by length within windows of N batches (0: off) |
//! | `--lr X` | 0.005 | Adam learning rate |
//! | `--seed N` | 0 | weights and batch order |
//! | `--prefetch-depth N` | 2 | batches filled ahead on the prefetcher's thread (0: inline) |
//! | `--plot FILE` | none | train the three modes and plot workspace bytes, heap bytes and allocations per iteration (`.svg` or `.png`) |
//! | `--workers N` | none | train data-parallel with N workers (1 to 256; 2 when only `--reducer` is given); not with `--compare` or `--plot` |
//! | `--reducer threads\|sequential\|mpi` | `threads` | a thread per worker; one thread running the N shards in turn (the same bits); a process per worker under `mpirun -np N` (`--features mpi`) |
//! | `--timeline FILE` | none | record a timeline of the run's workspace memory and write it to FILE as a Chrome trace (open it in Perfetto or `chrome://tracing`); JSON: `timeline_events`, `timeline_bytes` (top level and per mode); with `--compare` or `--plot` on in odd epochs only, for `iter_time_ratio_timeline_over_off` (from 3 epochs on); not with `--workers` |
//! | `--json` | off | one JSON object on stdout (the train_digits keys, plus `ring_growths`, `distinct_batch_shapes`, `max_steps`; planned: `new_shape_iterations`, the iterations after epoch 1 that recorded a new batch shape, and `new_shape_allocs`, the most heap allocations one of them made) |

#[path = "common/cli.rs"]
mod cli;
#[path = "common/faults.rs"]
mod faults;
#[path = "common/parallel.rs"]
mod parallel;
#[path = "common/plot.rs"]
mod plot;
#[path = "common/timeline.rs"]
mod timeline;
#[path = "common/vowels.rs"]
mod vowels;

use std::collections::BTreeSet;
use std::process::ExitCode;
use std::time::Instant;

use carve::alloc_check::{process_counts, reset_thread_peak, thread_counts, CountingAllocator, Threads};
use carve::async_iter::{BatchSource, Prefetcher, Role, Sequences, Threading, MAX_DEPTH};
use carve::nn::{dry::BatchShape, dry::DryPass, dry::MemoryEstimate, Input, Network, NetworkConfig, Updater};
use carve::workspace_core::timeline::Timeline;
use carve::WorkspaceMode;
use clap::Parser;
use ndarray::{Ix1, Ix2, Ix3};

use vowels::{Split, CLASSES, FEATURES};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::system();

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Trains an LSTM classifier on the UCI Japanese Vowels sequences
/// with carve workspaces on or off, from a prefetcher of batches
/// padded to their own longest sequence.
#[derive(Parser, Debug)]
#[command(name = "train_sequences", version, verbatim_doc_comment, next_line_help = true)]
struct Args {
    /// Workspaces during training and evaluation: `enabled`,
    /// `planned` or `none` (ignored with --compare)
    #[arg(long, value_name = "MODE", default_value = "enabled", value_parser = parse_mode, verbatim_doc_comment)]
    workspace_mode: WorkspaceMode,
    /// Train the three modes (same seed) and check that their
    /// loss traces are bit-identical
    #[arg(long, verbatim_doc_comment)]
    compare: bool,
    /// Passes over the training set (1 to 1000000)
    #[arg(long, value_name = "N", default_value_t = 40, value_parser = parse_epochs)]
    epochs: usize,
    /// Sequences per training iteration (1 or more)
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = parse_count)]
    batch_size: usize,
    /// LSTM widths, comma-separated, one stacked LSTM each
    /// (each 1 to 4096)
    #[arg(
        long,
        value_name = "W,W,...",
        value_delimiter = ',',
        default_value = "64",
        value_parser = parse_width,
        verbatim_doc_comment
    )]
    hidden: Vec<usize>,
    /// The sequence head: `last` (each sequence's last unmasked
    /// step) or `mean` (the mean over its unmasked steps)
    #[arg(long, value_name = "HEAD", default_value = "last", value_parser = parse_head, verbatim_doc_comment)]
    head: String,
    /// Sort sequences by length within windows of N batches, so
    /// that a batch pads less (0: off)
    #[arg(long, value_name = "N", default_value_t = 0, verbatim_doc_comment)]
    bucket: usize,
    /// Adam learning rate (finite, above 0)
    #[arg(long, value_name = "X", default_value_t = 5e-3, value_parser = parse_lr, allow_negative_numbers = true)]
    lr: f32,
    /// Seed of the weights and the batch order
    #[arg(long, value_name = "N", default_value_t = 0)]
    seed: u64,
    /// Batches the prefetcher fills ahead on its own thread
    /// (0 to 1024); 0 fills them inline in the training thread
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = parse_depth, verbatim_doc_comment)]
    prefetch_depth: usize,
    /// Print one JSON object on stdout (the rest goes to stderr)
    #[arg(long)]
    json: bool,
    /// Train the three modes, as --compare does, and plot
    /// workspace bytes, heap bytes and heap allocations per
    /// iteration of each to FILE (.svg or .png)
    #[arg(long, value_name = "FILE", value_parser = plot::parse_plot_path, verbatim_doc_comment)]
    plot: Option<std::path::PathBuf>,
    /// Save the trained network to FILE as a safetensors model
    /// (`carve::nn::serve::Model::load` serves it); with --compare, the
    /// first mode's (all modes train the same weights)
    #[arg(long, value_name = "FILE", verbatim_doc_comment)]
    save: Option<std::path::PathBuf>,
    /// Record a timeline of the run's workspace memory and write
    /// it to FILE as a Chrome trace (open it in
    /// https://ui.perfetto.dev or chrome://tracing); with
    /// --compare on in odd epochs only
    #[arg(long, value_name = "FILE", verbatim_doc_comment)]
    timeline: Option<std::path::PathBuf>,
    /// Train data-parallel with N workers (1 to 256; default 2 with
    /// --reducer, the number of processes with --reducer mpi)
    #[arg(long, value_name = "N", value_parser = parallel::parse_workers, verbatim_doc_comment)]
    workers: Option<usize>,
    /// How the workers reduce: `threads`, `sequential` (one thread
    /// running the N shards in turn: the same bits) or `mpi` (a
    /// process each under `mpirun -np N`; `--features mpi`)
    #[arg(long, value_name = "REDUCER", value_parser = parallel::parse_reducer, verbatim_doc_comment)]
    reducer: Option<parallel::ReducerArg>,
}

fn parse_head(s: &str) -> Result<String, String> {
    match s {
        "last" | "mean" => Ok(s.to_string()),
        _ => Err(format!("'{s}' is not a head: use `last` or `mean`")),
    }
}

fn parse_mode(s: &str) -> Result<WorkspaceMode, String> {
    s.parse::<WorkspaceMode>().map_err(|e| e.to_string())
}

/// The most epochs: a run plans every pass (its dry run, and the workers' schedule)
/// before the first.
fn parse_epochs(s: &str) -> Result<usize, String> {
    cli::bounded(s, 1, 1_000_000)
}

fn parse_count(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("'{s}' is not a whole number of 1 or more")),
    }
}

fn parse_width(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=4096).contains(&n) => Ok(n),
        _ => Err(format!("'{s}' is not a width from 1 to 4096")),
    }
}

fn parse_lr(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("'{s}' is not a finite learning rate above 0")),
    }
}

fn parse_depth(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n <= MAX_DEPTH => Ok(n),
        _ => Err(format!("'{s}' is not a depth from 0 to {MAX_DEPTH}")),
    }
}

fn mode_name(mode: WorkspaceMode) -> &'static str {
    mode.name()
}

/// What one mode's run measured.
#[derive(Default)]
struct Trace {
    loss: Vec<f32>,
    iter_ns: Vec<u64>,
    allocs: Vec<u64>,
    /// Planned mode: whether each iteration was recorded (a shape seen for the first
    /// time, or one whose plan diverged).
    recorded: Vec<bool>,
    heap_bytes: Vec<u64>,
    faults: Vec<u64>,
    workspace_bytes: Vec<u64>,
    epoch_ms: Vec<f64>,
    test_accuracy: Vec<f64>,
    /// Events the timeline recorded of this mode's network (with `--timeline`).
    timeline_events: u64,
    capacity_after_first_epoch: usize,
    capacity_final: usize,
    /// Heap allocations of the other threads (the prefetcher's producer) per epoch.
    producer_allocs: Vec<u64>,
    plan: Option<carve::nn::workspaces::PlannedStats>,
    /// Planned mode: plans made (one per batch shape, and one per re-plan), the arena's
    /// bytes and the lower bound of the plan that sized it (the largest).
    plans: Option<(u64, usize, usize)>,
    shapes: BTreeSet<(usize, usize)>,
    max_steps: usize,
    ring_growths: u64,
    /// The dry run's estimate, made before the first step.
    estimate: Option<MemoryEstimate>,
}

/// The batches of `split`, shuffled from `seed` (and bucketed, with `--bucket`).
fn source(split: &Split, args: &Args, seed: u64) -> Res<Sequences<f32, u32>> {
    let source = Sequences::new(split.sequences.clone(), split.labels.clone(), args.batch_size)?.shuffled(seed);
    Ok(if args.bucket > 0 { source.bucketed(args.bucket)? } else { source })
}

fn prefetcher(split: &Split, args: &Args, seed: u64, mode: WorkspaceMode) -> Res<Prefetcher<Sequences<f32, u32>>> {
    let builder = Prefetcher::builder(source(split, args, seed)?).workspace_mode(mode);
    let builder = match args.prefetch_depth {
        0 => builder.threading(Threading::Shield),
        depth => builder.depth(depth),
    };
    Ok(builder.build()?)
}

/// The passes of the run, in order: per epoch, the training batches in the order the
/// training prefetcher gives them, then the test set's as its evaluation does (each
/// batch padded to its longest sequence, masked). What the dry run sizes the network
/// from; the sources' layouts give the shapes without filling any batch.
fn run_passes(args: &Args, train_split: &Split, test: &Split) -> Res<Vec<DryPass>> {
    let (mut train, mut evaluation) = (source(train_split, args, args.seed)?, source(test, args, 0)?);
    let mut passes = Vec::new();
    for _ in 0..args.epochs {
        for (batches, training) in [(&mut train, true), (&mut evaluation, false)] {
            let mut index = 0;
            while let Some(layout) = batches.next_layout(index).map_err(|e| e.to_string())? {
                let shape = layout.spec(Role::Features).map(|spec| spec.shape().to_vec()).unwrap_or_default();
                let shape =
                    BatchShape::sequences(shape.first().copied().unwrap_or(0), shape.get(1).copied().unwrap_or(0));
                passes.push(if training { DryPass::Train(shape) } else { DryPass::Infer(shape) });
                index += 1;
            }
            batches.reset().map_err(|e| e.to_string())?;
        }
    }
    Ok(passes)
}

/// The LSTM classifier of the flags.
fn network(args: &Args, mode: WorkspaceMode) -> carve::Result<Network> {
    let mut builder = NetworkConfig::builder(FEATURES);
    for &width in &args.hidden {
        builder = builder.lstm(width);
    }
    builder = if args.head == "mean" { builder.masked_mean() } else { builder.last_step() };
    let config = builder
        .dense(CLASSES)
        .seed(args.seed)
        .updater(Updater::adam(args.lr))
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode)
        .build()?;
    Network::new(config)
}

/// `--workers`, `--reducer`: trains data-parallel, a one-worker trainer alongside;
/// prints the results (their JSON with `--json`).
fn run_parallel(args: &Args, train_split: &Split, test: &Split) -> Res<()> {
    let mut setup = parallel::Setup::new(args.workers, args.reducer)?;
    let root = setup.is_root();
    let say = |text: String| match (root, args.json) {
        (false, _) => {}
        (true, true) => eprintln!("{text}"),
        (true, false) => println!("{text}"),
    };
    let mode = args.workspace_mode;
    let widths: Vec<String> = args.hidden.iter().map(usize::to_string).collect();
    say(format!(
        "train_sequences: LSTM {FEATURES}-{}-{CLASSES} ({} head), Adam lr {}, batch {}, seed {}; {} workers ({})",
        widths.join("-"),
        args.head,
        args.lr,
        args.batch_size,
        args.seed,
        setup.workers,
        setup.reducer.name(),
    ));
    let per_epoch = train_split.labels.len().div_ceil(args.batch_size);
    let mut trainers = setup.trainers(|| network(args, mode))?;
    trainers.reserve(per_epoch.saturating_mul(args.epochs));
    let mut batches = prefetcher(train_split, args, args.seed, mode)?;
    // The one-worker trainer's batches: the same, in the same order.
    let mut baseline = match trainers.has_baseline() {
        true => Some(prefetcher(train_split, args, args.seed, mode)?),
        false => None,
    };
    for epoch in 1..=args.epochs {
        let start = Instant::now();
        let mut loss_sum = 0.0f64;
        let mut b = 0usize;
        while let Some(lease) = batches.next() {
            let lease = lease?;
            // Each worker's shard is a view of the batch in the prefetch ring.
            let x = lease.features::<f32, Ix3>()?;
            let mask = lease.features_mask::<f32, Ix2>()?;
            let y = lease.labels::<u32, Ix1>()?;
            let loss = trainers
                .fit(Input::Sequences { features: x, mask }, y.into())
                .map_err(|e| format!("epoch {epoch}, batch {}: {e}", b + 1))?;
            loss_sum += f64::from(loss);
            b += 1;
        }
        batches.reset()?;
        if let Some(baseline) = baseline.as_mut() {
            while let Some(lease) = baseline.next() {
                let lease = lease?;
                let features = lease.features::<f32, Ix3>()?;
                let mask = lease.features_mask::<f32, Ix2>()?;
                trainers.fit_one(Input::Sequences { features, mask }, lease.labels::<u32, Ix1>()?.into())?;
            }
            baseline.reset()?;
        }
        if !args.json && (epoch == 1 || epoch == args.epochs || epoch % 10 == 0) {
            say(format!(
                "epoch {epoch:>3}/{}: loss {:.4}  {:.1} ms",
                args.epochs,
                loss_sum / b.max(1) as f64,
                start.elapsed().as_secs_f64() * 1e3
            ));
        }
    }
    let summary = trainers.summary(&setup, per_epoch);
    let mut fields = trainers.json(&setup, per_epoch);
    let mut net = trainers.main.into_network()?;
    let mut test_batches = prefetcher(test, args, 0, mode)?;
    let accuracy = net.evaluate_batches(&mut test_batches)?;
    say(summary);
    say(format!(
        "test accuracy {accuracy:.4}; loss trace sha256 {}",
        fields["loss_trace_sha256"].as_str().unwrap_or("")
    ));
    if let (Some(path), true) = (&args.save, root) {
        net.save(path).map_err(|e| format!("saving the model: {e}"))?;
        say(format!("model saved to {}", path.display()));
    }
    if args.json && root {
        fields["test_accuracy"] = accuracy.into();
        fields["final_loss"] = trainers.loss.last().map(|&l| f64::from(l)).into();
        let object = serde_json::json!({
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "batch_size_used": args.batch_size.min(train_split.labels.len()),
            "hidden": args.hidden,
            "head": args.head,
            "seed": args.seed,
            "lr": args.lr.to_string().parse::<f64>()?,
            "train_rows": train_split.labels.len(),
            "test_rows": test.labels.len(),
            "saved": args.save.as_ref().map(|p| p.display().to_string()),
        });
        parallel::print_json(object, fields, mode_name(mode))?;
    }
    Ok(())
}

/// Trains in `mode`; saves the trained network to `save` when given.
fn train(
    args: &Args,
    mode: WorkspaceMode,
    train_split: &Split,
    test: &Split,
    save: Option<&std::path::Path>,
    timeline: Option<(&Timeline, bool)>,
) -> Res<Trace> {
    let mut net = network(args, mode)?;
    // The run's memory, known before its first step.
    let estimate = net.dry_run(&run_passes(args, train_split, test)?)?;
    let mut batches = prefetcher(train_split, args, args.seed, mode)?;
    let mut test_batches = prefetcher(test, args, 0, mode)?;
    let mut trace = Trace { estimate: Some(estimate), ..Trace::default() };
    for epoch in 1..=args.epochs {
        // Recording: every epoch, or the odd ones only (`toggle`).
        match timeline {
            Some((timeline, toggle)) if !toggle || epoch % 2 == 1 => net.attach_timeline(timeline)?,
            Some((timeline, _)) => net.detach_timeline(timeline)?,
            None => {}
        }
        let events0 = timeline.map_or(0, |(t, _)| t.events());
        // This example's main thread is the training thread: every other thread is the
        // prefetcher's producer.
        let producer0 = process_counts(Threads::ExceptMain).allocations;
        let start = Instant::now();
        while let Some(lease) = batches.next() {
            let lease = lease?;
            let x = lease.features::<f32, Ix3>()?;
            let mask = lease.features_mask::<f32, Ix2>()?;
            let y = lease.labels::<u32, Ix1>()?;
            trace.shapes.insert((x.shape()[0], x.shape()[1]));
            trace.max_steps = trace.max_steps.max(x.shape()[1]);
            let input = Input::Sequences { features: x, mask };
            if epoch == 1 && trace.loss.len() == 1 {
                // Recorded for the memory plan of the report (in the warm-up epoch: the
                // recording itself allocates).
                net.record_next_iteration();
            }
            // (Read outside the counted span: the figures carry the group's name.)
            let recorded0 = net.memory_plan().map(|s| s.recorded_iterations);
            let faults0 = faults::minor_faults();
            let before = reset_thread_peak(); // the peak of live bytes restarts here
            let t0 = Instant::now();
            let loss = net.fit_batch(input, y)?;
            let elapsed = t0.elapsed();
            let after = thread_counts();
            trace.faults.push(faults::minor_faults() - faults0);
            trace.loss.push(loss);
            trace.iter_ns.push(elapsed.as_nanos() as u64);
            trace.allocs.push(after.allocations - before.allocations);
            trace.recorded.push(net.memory_plan().map(|s| s.recorded_iterations) != recorded0);
            trace.heap_bytes.push((after.peak_live_bytes - before.live_bytes).max(0) as u64);
            trace.workspace_bytes.push(net.last_iteration_workspace_bytes() as u64);
        }
        batches.reset()?;
        trace.epoch_ms.push(start.elapsed().as_secs_f64() * 1e3);
        trace.producer_allocs.push(process_counts(Threads::ExceptMain).allocations - producer0);
        let accuracy = net.evaluate_batches(&mut test_batches)?;
        trace.test_accuracy.push(accuracy);
        trace.timeline_events += timeline.map_or(0, |(t, _)| t.events()) - events0;
        if epoch == 1 {
            // After the epoch's evaluation too: inference shares the working-memory
            // workspaces, and the test set's sequences are longer.
            trace.capacity_after_first_epoch = net.workspace_capacity();
        }
        if !args.json && (epoch == 1 || epoch == args.epochs || epoch % 10 == 0) {
            let loss = trace.loss.iter().rev().take(train_split.labels.len().div_ceil(args.batch_size));
            let mean =
                loss.map(|&l| f64::from(l)).sum::<f64>() / train_split.labels.len().div_ceil(args.batch_size) as f64;
            eprintln!(
                "{:>7} epoch {epoch:>3}/{}: loss {mean:.4}  test accuracy {accuracy:.4}  {:.1} ms",
                mode_name(mode),
                args.epochs,
                trace.epoch_ms.last().unwrap_or(&0.0)
            );
        }
    }
    trace.ring_growths = batches.stats().ring_growths;
    trace.capacity_final = net.workspace_capacity();
    trace.plan = net.memory_plan();
    trace.plans = net.memory_plan().map(|s| (s.plans, s.arena_bytes, s.arena_lower_bound_bytes));
    if let Some(path) = save {
        net.save(path).map_err(|e| format!("saving the model: {e}"))?;
    }
    Ok(trace)
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn run(args: &Args) -> Res<()> {
    if (args.workers.is_some() || args.reducer.is_some()) && (args.compare || args.plot.is_some()) {
        cli::usage_error::<Args>(
            "--workers and --reducer train one data-parallel run, --compare and --plot compare workspace modes: use \
             one or the other",
        );
    }
    if let Some(path) = &args.plot {
        plot::check_plot_path(path)?;
    }
    if let Some(path) = &args.save {
        cli::check_writable(path, "--save", "the model")?;
    }
    if (args.workers.is_some() || args.reducer.is_some()) && args.timeline.is_some() {
        cli::usage_error::<Args>(
            "--timeline records the workspaces of the training thread's network, --workers and --reducer train on a \
             thread or process per worker: use one or the other",
        );
    }
    if let Some(path) = &args.timeline {
        cli::check_writable(path, "--timeline", "the timeline")?;
        if [&args.save, &args.plot].into_iter().flatten().any(|p| p == path) {
            cli::usage_error::<Args>(
                "--timeline writes a file of its own: give it a path other than --save's and --plot's",
            );
        }
    }
    let (train_split, test) = vowels::load(&vowels::data_path())?;
    if args.workers.is_some() || args.reducer.is_some() {
        return run_parallel(args, &train_split, &test);
    }
    let modes: &[WorkspaceMode] = if args.compare || args.plot.is_some() {
        &[WorkspaceMode::Enabled, WorkspaceMode::Planned, WorkspaceMode::None]
    } else {
        std::slice::from_ref(&args.workspace_mode)
    };
    let say = |text: String| if args.json { eprintln!("{text}") } else { println!("{text}") };
    let widths: Vec<String> = args.hidden.iter().map(usize::to_string).collect();
    say(format!(
        "train_sequences: LSTM {FEATURES}-{}-{CLASSES} ({} head), Adam lr {}, batch {}, seed {}",
        widths.join("-"),
        args.head,
        args.lr,
        args.batch_size,
        args.seed
    ));
    say(format!(
        "{} epochs; {} training sequences, {} test sequences, {} to {} steps",
        args.epochs,
        train_split.labels.len(),
        test.labels.len(),
        train_split.sequences.iter().chain(&test.sequences).map(|s| s.nrows()).min().unwrap_or(0),
        train_split.sequences.iter().chain(&test.sequences).map(|s| s.nrows()).max().unwrap_or(0),
    ));
    // The timeline records every mode's network; with --compare, in odd epochs only.
    let timeline = match args.timeline {
        Some(_) => Some(Timeline::start()?),
        None => None,
    };
    let toggle = modes.len() > 1;
    let mut traces = Vec::new();
    for &mode in modes {
        let save = if traces.is_empty() { args.save.as_deref() } else { None };
        let recording = timeline.as_ref().map(|t| (t, toggle));
        traces.push((mode, train(args, mode, &train_split, &test, save, recording)?));
    }
    let per_epoch = train_split.labels.len().div_ceil(args.batch_size);
    // Each mode's iteration time with the timeline on over off, where it was toggled.
    let timeline_ratios: Vec<Option<f64>> =
        traces.iter().map(|(_, t)| toggle.then(|| timeline::on_over_off(&t.iter_ns, per_epoch)).flatten()).collect();
    let timeline_figures = match (&timeline, &args.timeline) {
        (Some(timeline), Some(path)) => {
            let figures = timeline::export(timeline, path, timeline_ratios[0])?;
            say(figures.line(path));
            Some(figures)
        }
        _ => None,
    };
    if let Some(path) = &args.save {
        say(format!("model saved to {}", path.display()));
    }
    let mut object = serde_json::json!({
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "batch_size_used": args.batch_size.min(train_split.labels.len()),
        "hidden": args.hidden,
        "head": args.head,
        "seed": args.seed,
        "lr": args.lr.to_string().parse::<f64>()?,
        "train_rows": train_split.labels.len(),
        "test_rows": test.labels.len(),
        "saved": args.save.as_ref().map(|p| p.display().to_string()),
    });
    for (mode, t) in &traces {
        let steady = &t.allocs[per_epoch.min(t.allocs.len())..];
        let steady_max = steady.iter().copied().max();
        // Planned: the steady iterations that recorded a plan (a new batch shape), and
        // the most heap allocations one of them made (the plan's own storage).
        let recorded = t.recorded.iter().skip(per_epoch);
        let new_shapes: Vec<u64> = steady.iter().zip(recorded).filter(|(_, &r)| r).map(|(&a, _)| a).collect();
        let steady_faults = &t.faults[per_epoch.min(t.faults.len())..];
        let iter_us: Vec<f64> = t.iter_ns.iter().map(|&ns| ns as f64 / 1e3).collect();
        let accuracy = t.test_accuracy.last().copied().unwrap_or(0.0);
        say(format!(
            "{:>7}: test accuracy {accuracy:.4}; median iteration {:.0} µs, epoch {:.1} ms; heap allocations per \
             steady iteration: max {}; workspace capacity {} after epoch 1, {} at the end; ring growths {}; {} batch \
             shapes, up to {} steps",
            mode_name(*mode),
            median(&iter_us),
            median(&t.epoch_ms),
            steady_max.map_or("n/a".into(), |m| m.to_string()),
            t.capacity_after_first_epoch,
            t.capacity_final,
            t.ring_growths,
            t.shapes.len(),
            t.max_steps,
        ));
        object[mode_name(*mode)] = serde_json::json!({
            "test_accuracy": accuracy,
            "final_loss": t.loss.last(),
            "test_accuracy_per_epoch": t.test_accuracy,
            "iter_us_median": median(&iter_us),
            "epoch_ms_median": median(&t.epoch_ms),
            "steady_state_iterations": steady.len(),
            "steady_state_allocs_max": steady_max,
            "new_shape_iterations": (*mode == WorkspaceMode::Planned).then_some(new_shapes.len()),
            "new_shape_allocs": (*mode == WorkspaceMode::Planned).then(|| new_shapes.iter().copied().max().unwrap_or(0)),
            "steady_state_faults_per_iter": if steady_faults.is_empty() { None } else {
                Some(steady_faults.iter().sum::<u64>() as f64 / steady_faults.len() as f64)
            },
            "steady_state_faults_max": steady_faults.iter().copied().max(),
            "steady_state_allocs_per_iter": if steady.is_empty() { None } else {
                Some(steady.iter().sum::<u64>() as f64 / steady.len() as f64)
            },
            "workspace_bytes": t.workspace_bytes.iter().copied().max(),
            // The dry run's, before the first step: the most bytes a step takes, its
            // first steps included (to compare with workspace_bytes), the arenas after the
            // run (with workspace_capacity).
            "predicted_bytes": t.estimate.as_ref().map(|e| e.peak_step_bytes),
            "predicted_steady_bytes": t.estimate.as_ref().map(MemoryEstimate::step_bytes),
            "predicted_capacity": t.estimate.as_ref().map(|e| e.workspace_bytes),
            "predicted_total_bytes": t.estimate.as_ref().map(MemoryEstimate::total_bytes),
            "dry_run_us": t.estimate.as_ref().map(|e| e.dry_run_us),
            "dry_run_passes": t.estimate.as_ref().map(|e| e.passes_run),
            // The producer restarts once per epoch (a constant), and allocates nothing
            // per batch: compare with the batches per epoch.
            "steady_state_producer_allocs_per_epoch_max": t.producer_allocs.iter().skip(1).copied().max(),
            "batches_per_epoch": per_epoch,
            // One recorded iteration (the second): its roles laid out per role, one arena
            // planned from its lifetimes, the bytes live at once; planned, the plan of the
            // last batch, re-plans and divergences (0 in the other modes).
            "per_role_bytes": t.plan.as_ref().map(|p| p.per_role_bytes),
            "plan_bytes": t.plan.as_ref().map(|p| p.plan_bytes),
            "lower_bound_bytes": t.plan.as_ref().map(|p| p.lower_bound_bytes),
            "plan_to_bound": t.plan.as_ref().map(|p| p.plan_to_bound),
            "planning_us": t.plan.as_ref().map(|p| p.planning_us),
            "replans": t.plan.as_ref().map(|p| p.replans),
            "divergences": t.plan.as_ref().map(|p| p.divergences),
            "plans": t.plans.map(|p| p.0),
            "arena_bytes": t.plans.map(|p| p.1),
            "arena_lower_bound_bytes": t.plans.map(|p| p.2),
            "workspace_capacity_after_epoch_1": t.capacity_after_first_epoch,
            "workspace_capacity": t.capacity_final,
            "ring_growths": t.ring_growths,
            "distinct_batch_shapes": t.shapes.len(),
            "max_steps": t.max_steps,
        });
    }
    // The keys every mode shares, at the top level too.
    if let Some((_, t)) = traces.first() {
        object["ring_growths"] = t.ring_growths.into();
        object["distinct_batch_shapes"] = t.shapes.len().into();
        object["max_steps"] = t.max_steps.into();
    }
    // Every mode's losses against the first mode's (enabled).
    let identical = match &traces[..] {
        [(first, a), rest @ ..] if !rest.is_empty() => {
            let mut same = true;
            for (mode, b) in rest {
                let equal =
                    a.loss.len() == b.loss.len() && a.loss.iter().zip(&b.loss).all(|(x, y)| x.to_bits() == y.to_bits());
                say(format!(
                    "loss traces, {} against {}: {} ({} iterations)",
                    mode_name(*mode),
                    mode_name(*first),
                    if equal { "bit-identical" } else { "DIFFERENT" },
                    a.loss.len()
                ));
                same &= equal;
            }
            if let Some((_, none)) = rest.iter().find(|(mode, _)| *mode == WorkspaceMode::None) {
                let ratio = median(&a.iter_ns.iter().map(|&n| n as f64).collect::<Vec<_>>())
                    / median(&none.iter_ns.iter().map(|&n| n as f64).collect::<Vec<_>>());
                object["iter_time_ratio_enabled_over_none"] = ratio.into();
            }
            Some(same)
        }
        _ => None,
    };
    object["loss_traces_identical"] = identical.into();
    if let Some(figures) = &timeline_figures {
        figures.add_to(&mut object);
        for ((mode, t), ratio) in traces.iter().zip(&timeline_ratios) {
            timeline::add_to_mode(&mut object[mode_name(*mode)], t.timeline_events, figures.bytes, *ratio);
        }
    }
    if let Some(path) = &args.plot {
        let series: Vec<plot::Series<'_>> = traces
            .iter()
            .map(|(mode, t)| plot::Series {
                mode: *mode,
                workspace_bytes: &t.workspace_bytes,
                heap_bytes: &t.heap_bytes,
                allocs: &t.allocs,
            })
            .collect();
        plot::plot(path, "carve train_sequences: memory per training iteration", &series)?;
        say(format!("plot written to {}", path.display()));
    }
    if args.json {
        println!("{}", serde_json::to_string(&object)?);
    }
    if identical == Some(false) {
        return Err("the loss traces of the workspace modes differ: workspaces changed the arithmetic".into());
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Args = cli::parse();
    cli::exit_status::<Args, _>(run(&args))
}
