//! The carve demo: an MLP trained on the UCI handwritten digits, with workspaces on
//! (or off, or both), showing what workspaces change — and what they do not.
//!
//! The reference network [`carve::nn`] (64-128-64-10 by default, ReLU, softmax
//! cross-entropy, Adam) is trained on `examples/data/digits.csv.gz` (1797 8×8 images,
//! pixels scaled to 0..1) with a stratified 80/20 train/test split. Batches come from an
//! [`async_iter::Prefetcher`](carve::async_iter::Prefetcher) over the training rows
//! ([`InMemory`](carve::async_iter::InMemory), shuffled every epoch from the seed): a
//! producer thread fills them `--prefetch-depth` batches ahead into a ring workspace, and
//! `fit_batch` reads each one in place (with `--workspace-mode none` the prefetcher, too,
//! gives every batch a fresh heap block). A counting global allocator counts the training
//! thread's heap allocations, the bytes they request and the most bytes it holds at once
//! around every `fit_batch` call, and `getrusage(RUSAGE_THREAD)` its minor page faults.
//! After each epoch, outside that bracket and outside the epoch's time, the network is
//! evaluated on the test set. On a terminal, one progress bar per mode shows the epoch,
//! its mean loss and that test accuracy; without one, a plain line every 10 epochs does.
//! At the end a table shows, per workspace mode, the test accuracy, the median time of an
//! epoch and of an iteration, the workspace capacity and bytes in use, the heap bytes in
//! use, heap allocations, bytes and page faults per steady-state iteration (every
//! iteration after epoch 1, the warm-up in which workspaces learn their sizes) and the
//! peak RSS. Everything it prints fits 80 columns.
//!
//! What it shows: with workspaces enabled a steady iteration makes **no heap
//! allocation**; with `--workspace-mode none` every temporary array is its own
//! allocation, and the memory the workspaces hold is on the heap instead; and the
//! arithmetic is the same — with `--compare` the three modes (enabled, planned, none) train in one process from the
//! same seed, epoch by epoch in turn, and their loss traces must be bit-identical (the
//! demo fails otherwise).
//!
//! Run: `cargo run --release --example train_digits -- [FLAGS]`
//!
//! | flag | default | meaning |
//! |---|---|---|
//! | `--workspace-mode enabled\|planned\|none` | `enabled` | workspaces in training and evaluation (unused with `--compare`); `planned`: the training role workspaces served from one arena planned from the first iteration |
//! | `--device host\|sim\|cuda[:N]` | `host` | where each training step runs: the CPU, the simulated device (the host's arithmetic in simulated device memory: the same losses) or a GPU (an error naming why where there is none); not with `--workers`, `--timeline` or `--breakdown` |
//! | `--compare` | off | train the three modes (same seed, interleaved by epoch); check that the losses are bit-identical |
//! | `--epochs N` | 80 | passes over the training set (1 or more) |
//! | `--batch-size N` | 32 | rows per iteration, 1 or more (the last batch of an epoch may be smaller; more than the training rows is one batch of all of them, and the header says so) |
//! | `--hidden 128,64` | `128,64` | hidden layer widths, comma-separated, each 1 or more; at most 16,777,216 parameters in all |
//! | `--lr X` | 0.001 | Adam learning rate (finite, above 0) |
//! | `--seed N` | 0 | seed of the split, the weights and the batch order |
//! | `--prefetch-depth N` | 2 | batches the prefetcher fills ahead on its thread, 0 to 1024; 0: inline in the training thread (shield mode) |
//! | `--json` | off | print one JSON object (the results) as the last line of stdout; no progress bars |
//! | `--plot FILE` | none | train the three modes, as `--compare` does, and plot them to FILE (`.svg` or `.png`) |
//! | `--threads N` | 1 | threads of each training step, 1 to 64 (`Network::set_threads`: large matrix multiplies and updater passes split, the same bits); not with `--workers` |
//! | `--timeline FILE` | none | record a timeline of the run's workspace memory and write it to FILE as a Chrome trace (open it in Perfetto or `chrome://tracing`); with `--compare` or `--plot`, on in odd epochs and off in even ones; not with `--workers` |
//! | `--breakdown` | off | measure where each steady step's time goes, and the matrix multiply alone on the step's shapes (JSON: `breakdown_us`, `step_gflops`, `gemm_gflops_same_shapes`); with `--workers`, the N workers' steps after epoch 1 (JSON: `breakdown_us`) |
//! | `--workers N` | none | train data-parallel with N workers (1 to 256; 2 when only `--reducer` is given) |
//! | `--reducer threads\|sequential\|mpi` | `threads` | how the workers reduce: a thread each; one thread running the N shards in turn (the same bits); a process each under `mpirun -np N` (`--features mpi`) |
//!
//! `--help` prints the flags and exits 0, running nothing. A usage error (an unknown flag,
//! a bad or out-of-range value) is one line on stderr naming the flag and what is valid,
//! and exit status 2; nothing is clamped silently. An error while running is one line,
//! `train_digits: error: <what>`, and exit status 1.
//!
//! The network's size is checked with the flags: its parameters, all layers together,
//! may number at most 16,777,216 (256 MiB with their gradients and Adam's two moments),
//! so `--hidden 65536,65536` is an error naming the total, not an out-of-memory kill.
//!
//! `--plot` implies `--compare` (so `--workspace-mode` is unused). It draws, per
//! iteration of every mode, the workspace bytes in use, the heap bytes in use (the most
//! the training thread held at once during `fit_batch`) on the same scale, and the heap
//! allocations; each panel's legend is beside it. The file name's extension is checked
//! when the flags are parsed; before training, its directory must exist and the file
//! must open for writing.
//!
//! Environment: `TRAIN_DIGITS_DATA` overrides the path of the data file.
//!
//! ## Data-parallel training (`--workers`, `--reducer`)
//!
//! With either flag the network trains through [`carve::nn::parallel::DataParallel`]: each batch of
//! the prefetcher is cut into N shards of consecutive rows, views of the prefetch ring
//! (nothing is copied), one per worker; the weights and Adam's state are held once;
//! each worker writes its gradients into its gradient buckets, which are reduced in
//! rank order. A one-worker trainer trains alongside on the same batches, so that the
//! speedup is measured in the same run. `--compare` and `--plot` do not combine with
//! it. The JSON adds, at the top level and under the workspace mode's key:
//! `workers`, `reducer`, `bytes_copied_for_reduction` (0: backward writes where the
//! reduction reads), `gradient_bucket_bytes` (one worker's buckets),
//! `speedup_vs_one_worker` (samples per second after epoch 1, against the one-worker
//! trainer), `loss_trace_sha256`, and the memory: `weight_bytes`,
//! `updater_state_bytes`, `worker_plan_bytes`, `worker_arena_bytes`, `memory_bytes`
//! (all of it) and `dl4j_design_bytes` (a copy of the weights, the state and the
//! gradients per worker, plus the same workspaces, as DL4J's `ParallelWrapper` holds).
//! `--reducer sequential` gives the same `loss_trace_sha256` as `--reducer threads` with
//! as many workers, and `mpirun -np N ... --reducer mpi` the same again.
//!
//! ## Peak RSS
//!
//! Per mode, the peak resident memory while that mode trained: at the start of each of
//! the mode's epochs the process's high-water mark is reset (`5` written to
//! `/proc/self/clear_refs`), at the end of the epoch (after its evaluation) `VmHWM` is
//! read from `/proc/self/status`, and the mode's figure is the largest of those reads.
//! It is the whole process's resident memory during those epochs: with `--compare` it
//! includes what the other mode holds meanwhile (its network and workspaces), the data,
//! and heap that the allocator kept from earlier epochs. Where the mark cannot be reset
//! (no writable `/proc/self/clear_refs`), every mode shows the process's peak over the
//! whole run instead, and a note under the table says so.
//!
//! ## `--json`
//!
//! The last line of stdout is one JSON object: `epochs`, `batch_size` (as given),
//! `batch_size_used` (at most the training rows), `hidden`, `threads`, `seed`,
//! `lr`, `train_rows`, `test_rows`, `iter_time_ratio_enabled_over_none` (median time of
//! an iteration, enabled over none; `null` with one mode), `loss_traces_identical`
//! (`null` with one mode), and one object per mode trained, under `enabled`, `planned` and `none`
//! (only the chosen mode's without `--compare` or `--plot`):
//!
//! | key | meaning |
//! |---|---|
//! | `test_accuracy` | fraction of the test set classified correctly after the last epoch |
//! | `final_loss` | mean loss of the last epoch: the mean of its batch losses (each before its batch's update) |
//! | `loss_trace_sha256` | SHA-256 of every iteration's loss as little-endian `f32` bits, in order |
//! | `steady_state_allocs_per_iter` | heap allocations per `fit_batch` call after epoch 1 (mean; `null` if 1 epoch) |
//! | `steady_state_alloc_bytes_per_iter` | bytes those allocations requested (mean; `null` with one epoch) |
//! | `iter_us_median` | median µs of a `fit_batch` call after epoch 1 (of every call with one epoch) |
//! | `epoch_ms_median` | median ms of an epoch after epoch 1: waiting for batches and training (not the evaluation) |
//! | `workspace_bytes` | capacity of the training workspaces at the end (0 with workspaces off) |
//! | `peak_rss_bytes` | peak RSS as above, in bytes (`null` where `/proc/self/status` cannot be read) |
//! | `peak_rss_scope` | `"mode_epochs"` (per mode, as above) or `"process"` (the fallback) |
//! | `test_accuracy_per_epoch` | the test accuracy after each epoch, as shown by the progress bars |
//!
//! Further keys (`train_accuracy`, `steady_state_iterations`, `prefetch` (depth, ring
//! bytes, growths, batches, waits),
//! `steady_state_faults_per_iter`, `steady_state_allocs_max`, `warmup_allocs`,
//! `workspace_bytes_in_use` (the most workspace bytes an iteration used over the whole
//! run, the first iteration's spills included, so it may exceed the capacity),
//! `steady_state_workspace_bytes_in_use` (the same after epoch 1, what the table shows;
//! `null` with one epoch), `steady_state_heap_peak_bytes` (the most heap bytes held at
//! once during a steady iteration's `fit_batch`; `null` with one epoch)) add detail.
//!
//! With `--timeline FILE`, at the top level: `timeline_events` (events recorded),
//! `timeline_bytes` (heap the history holds), `timeline_iterations`, `timeline_scripts`
//! (distinct iterations, each stored once), `timeline_snapshot_us`,
//! `timeline_slices_exported` and `iter_time_ratio_timeline_over_off` (with
//! `--compare` or `--plot`: the enabled mode's median iteration time in the odd epochs
//! from 3 on, recorded, over the even ones, not; `null` without, or with fewer than 3
//! epochs); per mode, `timeline_events` (its
//! network's), `timeline_bytes` and its own `iter_time_ratio_timeline_over_off`.

mod args;
#[path = "../common/breakdown.rs"]
mod breakdown;
#[path = "../common/cli.rs"]
mod cli;
mod data;
mod data_parallel;
#[path = "../common/faults.rs"]
mod faults;
mod measure;
#[path = "../common/parallel.rs"]
mod parallel;
#[path = "../common/plot.rs"]
mod plot;
mod report;
#[path = "../common/timeline.rs"]
mod timeline;
mod train;

use std::error::Error;
use std::io::IsTerminal;
use std::process::ExitCode;

use carve::workspace_core::timeline::Timeline;
use carve::WorkspaceMode;

use args::Args;
use measure::{peak_rss_bytes, RssMeter};
use report::{summarize, summary_json, table, wrap};
use train::{build_network, mode_name, prefetcher, run_passes, train_epoch, Progress, Run, Trace};

type Res<T> = Result<T, Box<dyn Error>>;

/// Pixels per image and classes.
const FEATURES: usize = 64;
const CLASSES: usize = 10;
/// Columns the demo's output fits in.
const COLUMNS: usize = 80;

fn main() -> ExitCode {
    let args = Args::parse_checked();
    cli::exit_status::<Args, _>(run(&args))
}

fn run(args: &Args) -> Res<()> {
    if let Some(path) = &args.plot {
        plot::check_plot_path(path)?;
    }
    if let Some(path) = &args.save {
        cli::check_writable(path, "--save", "the model")?;
    }
    if let Some(path) = &args.timeline {
        cli::check_writable(path, "--timeline", "the timeline")?;
    }
    let data = data::load_digits(&data::data_path())?;
    let (train_rows, test_rows) = data::stratified_split(&data.y, args.seed);
    let (train, test) = (data::subset(&data, &train_rows), data::subset(&data, &test_rows));
    drop(data);
    if train.y.is_empty() || test.y.is_empty() {
        return Err(format!(
            "{}: {} rows are too few for a train/test split ({} training, {} test rows)",
            data::data_path().display(),
            train.y.len() + test.y.len(),
            train.y.len(),
            test.y.len()
        )
        .into());
    }

    if args.data_parallel() {
        return data_parallel::run(args, &train, &test);
    }

    let modes: &[WorkspaceMode] = if args.both_modes() {
        &[WorkspaceMode::Enabled, WorkspaceMode::Planned, WorkspaceMode::None]
    } else {
        std::slice::from_ref(&args.workspace_mode)
    };
    let batch = args.batch_size.min(train.y.len());
    let iters_per_epoch = train.y.len().div_ceil(batch);
    let iterations = iters_per_epoch
        .checked_mul(args.epochs)
        .ok_or_else(|| format!("{} epochs of {iters_per_epoch} iterations is too many", args.epochs))?;

    let mut runs = Vec::with_capacity(modes.len());
    for &mode in modes {
        let mut net =
            build_network(args, mode).map_err(|e| format!("building the network ({} mode): {e}", mode_name(mode)))?;
        net.set_threads(args.threads).map_err(|e| format!("starting {} training threads: {e}", args.threads))?;
        // The run's memory, known before its first step.
        let passes = run_passes(train.y.len(), test.y.len(), batch, args.epochs);
        // On a device the steps hold device memory of their own, which the host's
        // workspaces do not predict: no dry run there.
        let estimate = match net.device() {
            carve::nn::Device::Host => {
                Some(net.dry_run(&passes).map_err(|e| format!("sizing the network ({} mode): {e}", mode_name(mode)))?)
            }
            _ => None,
        };
        let batches = prefetcher(&train, batch, args.seed, args.prefetch_depth, mode)
            .map_err(|e| format!("starting the prefetcher ({} mode): {e}", mode_name(mode)))?;
        runs.push(Run {
            mode,
            net,
            batches,
            batches_per_epoch: iters_per_epoch,
            batch_size: batch,
            trace: Trace::with_capacity(iterations, args.epochs)?,
            bar: None,
            estimate,
        });
    }

    // Everything but the JSON goes to stdout, or to stderr with --json; at most
    // COLUMNS wide.
    let out = |text: &str| {
        let fit =
            |line: &str| if line.chars().count() <= COLUMNS { line.to_string() } else { wrap(line, COLUMNS, "  ") };
        let text = text.lines().map(fit).collect::<Vec<_>>().join("\n");
        if args.json {
            eprintln!("{text}")
        } else {
            println!("{text}")
        }
    };
    let hidden: Vec<String> = args.hidden.iter().map(usize::to_string).collect();
    let batch_text = if batch < args.batch_size {
        format!("batch {batch} (all training rows: --batch-size {} is more)", args.batch_size)
    } else {
        format!("batch {batch}")
    };
    out(&format!(
        "train_digits: MLP {FEATURES}-{}-{CLASSES}, Adam lr {}, {batch_text}, seed {}",
        hidden.join("-"),
        args.lr,
        args.seed,
    ));
    out(&format!(
        "{} epochs of {iters_per_epoch} iterations; {} training rows, {} test rows",
        args.epochs,
        train.y.len(),
        test.y.len(),
    ));
    out(&format!("workspaces: {}", modes.iter().map(|&m| mode_name(m)).collect::<Vec<_>>().join(" and ")));

    // The timeline records every mode's network; with --compare, in odd epochs only.
    let timeline = match &args.timeline {
        Some(_) => {
            let timeline = Timeline::start()?;
            for run in runs.iter_mut() {
                run.net.attach_timeline(&timeline)?;
            }
            Some(timeline)
        }
        None => None,
    };
    let toggle_timeline = timeline.is_some() && args.both_modes();
    // The events each mode's network recorded.
    let mut mode_events = vec![0u64; runs.len()];

    let progress = Progress::new(args.json, std::io::stderr().is_terminal())?;
    for run in runs.iter_mut() {
        run.bar = progress.bar(run.mode, iterations);
    }
    let mut rss = RssMeter::new();
    for epoch in 1..=args.epochs {
        if args.breakdown && epoch <= 2 {
            // Measured from the start, and again from epoch 2 (the steady steps).
            for run in runs.iter_mut() {
                run.net.set_breakdown(true);
            }
        }
        for (r, run) in runs.iter_mut().enumerate() {
            if let (Some(timeline), true) = (&timeline, toggle_timeline) {
                match epoch % 2 {
                    1 => run.net.attach_timeline(timeline)?,
                    _ => run.net.detach_timeline(timeline)?,
                }
            }
            let before = timeline.as_ref().map_or(0, Timeline::events);
            train_epoch(run, (epoch, args.epochs), &test, &progress, &mut rss)?;
            mode_events[r] += timeline.as_ref().map_or(0, Timeline::events) - before;
        }
    }
    let widths = breakdown::widths(FEATURES, &args.hidden, CLASSES);
    let gemm_gflops = match args.breakdown {
        true => Some(breakdown::gemm_gflops(&widths, batch, 200)?),
        false => None,
    };
    if let Some(gemm) = gemm_gflops {
        for run in &runs {
            if let Some(b) = run.net.breakdown() {
                out(&breakdown::breakdown_lines(mode_name(run.mode), &b));
            }
        }
        out(&format!("carve's matrix multiply alone on the step's shapes: {gemm:.1} GFLOP/s"));
    }

    let mut summaries = Vec::with_capacity(runs.len());
    for (r, run) in runs.iter_mut().enumerate() {
        // Its evaluations are iterations of the timeline too.
        let before = timeline.as_ref().map_or(0, Timeline::events);
        summaries.push(summarize(run, iters_per_epoch, &test, &train, batch)?);
        mode_events[r] += timeline.as_ref().map_or(0, Timeline::events) - before;
    }
    if let RssMeter::Process(_) = rss {
        let peak_rss = peak_rss_bytes();
        for s in summaries.iter_mut() {
            s.peak_rss_bytes = peak_rss;
        }
    }

    out("");
    out(&table(&summaries, &rss));
    match (&rss, summaries.len()) {
        (RssMeter::PerEpoch, 1) => out(
            "peak RSS: the highest VmHWM of the epochs (reset through /proc/self/clear_refs as each epoch starts), \
             the process's resident memory while training",
        ),
        (RssMeter::PerEpoch, _) => out(
            "peak RSS: per mode, the highest VmHWM of its epochs (reset through /proc/self/clear_refs as each epoch \
             starts); it is the whole process's resident memory meanwhile, the other mode's network and workspaces \
             included",
        ),
        (RssMeter::Process(why), 1) => {
            out(&format!("peak RSS: the process's peak over the whole run (it could not be reset per epoch: {why})"))
        }
        (RssMeter::Process(why), _) => out(&format!(
            "peak RSS: the process's peak over the whole run, the same for every mode, not one mode's (it could \
             not be reset per epoch: {why})"
        )),
    }
    for s in &summaries {
        if let (WorkspaceMode::Enabled | WorkspaceMode::Planned, Some(allocs)) = (s.mode, s.steady_allocs_max) {
            if allocs > 0 {
                out(&format!(
                    "warning: workspaces {}, yet steady-state iterations allocated (up to {allocs} allocations in \
                     one iteration)",
                    mode_name(s.mode)
                ));
            }
        }
    }

    // Every mode's losses against the first mode's (enabled).
    let identical = match &runs[..] {
        [a, rest @ ..] if !rest.is_empty() => {
            let mut same = true;
            for (b, s) in rest.iter().zip(&summaries[1..]) {
                let equal = a.trace.loss.len() == b.trace.loss.len()
                    && a.trace.loss.iter().zip(&b.trace.loss).all(|(x, y)| x.to_bits() == y.to_bits());
                if !equal {
                    let first = a.trace.loss.iter().zip(&b.trace.loss).position(|(x, y)| x.to_bits() != y.to_bits());
                    out(&format!(
                        "loss traces: {} DIFFERS from {} (first difference at iteration {})",
                        mode_name(b.mode),
                        mode_name(a.mode),
                        first.map_or_else(|| "n/a (lengths differ)".to_string(), |i| (i + 1).to_string()),
                    ));
                    out(&format!("  sha256 {} ({})", summaries[0].loss_trace_sha256, mode_name(a.mode)));
                    out(&format!("  sha256 {} ({})", s.loss_trace_sha256, mode_name(b.mode)));
                }
                same &= equal;
            }
            if same {
                out(&format!("loss traces: bit-identical in every mode ({} iterations)", a.trace.loss.len()));
                out(&format!("  sha256 {}", summaries[0].loss_trace_sha256));
            }
            Some(same)
        }
        _ => None,
    };

    if let Some(path) = &args.plot {
        let series: Vec<plot::Series<'_>> = runs
            .iter()
            .map(|run| plot::Series {
                mode: run.mode,
                workspace_bytes: &run.trace.workspace_bytes,
                heap_bytes: &run.trace.heap_bytes,
                allocs: &run.trace.allocs,
            })
            .collect();
        plot::plot(path, "carve train_digits: memory per training iteration", &series)?;
        out(&format!("plot written to {}", path.display()));
    }

    if let Some(path) = &args.save {
        runs[0].net.save(path).map_err(|e| format!("saving the model: {e}"))?;
        out(&format!("model saved to {} (serve it: serve_digits --model {})", path.display(), path.display()));
    }

    // After the model is saved: a failure to write the timeline does not lose it.
    // Each mode's iteration time with the timeline on over off, where it was toggled.
    let timeline_ratios: Vec<Option<f64>> = runs
        .iter()
        .map(|run| toggle_timeline.then(|| timeline::on_over_off(&run.trace.iter_ns, iters_per_epoch)).flatten())
        .collect();
    let timeline_figures = match (&timeline, &args.timeline) {
        (Some(timeline), Some(path)) => {
            let figures = timeline::export(timeline, path, timeline_ratios[0])?;
            out(&figures.line(path));
            Some(figures)
        }
        _ => None,
    };

    if args.json {
        let us = |mode| summaries.iter().find(|s| s.mode == mode).map(|s| s.iter_us_median);
        let ratio = match (us(WorkspaceMode::Enabled), us(WorkspaceMode::None)) {
            (Some(enabled), Some(none)) => Some(enabled / none),
            _ => None,
        };
        // The learning rate as typed (an f32 widened to f64 would print 0.0010000000474974513).
        let lr: f64 = args.lr.to_string().parse()?;
        let mut object = serde_json::json!({
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "batch_size_used": batch,
            "hidden": args.hidden,
            "threads": args.threads,
            "device": args.device.to_string(),
            "seed": args.seed,
            "lr": lr,
            "train_rows": train.y.len(),
            "test_rows": test.y.len(),
            "iter_time_ratio_enabled_over_none": ratio,
            "loss_traces_identical": identical,
            "saved": args.save.as_ref().map(|p| p.display().to_string()),
        });
        if let Some(figures) = &timeline_figures {
            figures.add_to(&mut object);
        }
        for (r, (s, run)) in summaries.iter().zip(&runs).enumerate() {
            object[mode_name(s.mode)] = summary_json(s, &rss);
            if let Some(figures) = &timeline_figures {
                let mode = &mut object[mode_name(s.mode)];
                timeline::add_to_mode(mode, mode_events[r], figures.bytes, timeline_ratios[r]);
            }
            if let (Some(b), Some(gemm)) = (run.net.breakdown(), gemm_gflops) {
                let step_gflops = breakdown::step_flops(&widths, batch) / (s.iter_us_median * 1e-6) / 1e9;
                let keys = [
                    ("breakdown_us", breakdown::breakdown_json(&b)),
                    ("step_gflops", step_gflops.into()),
                    ("gemm_gflops_same_shapes", gemm.into()),
                    ("step_over_gemm", (step_gflops / gemm).into()),
                ];
                for (key, value) in keys {
                    if object.get(key).is_none() {
                        // The first mode's at the top level too.
                        object[key] = value.clone();
                    }
                    object[mode_name(s.mode)][key] = value;
                }
            }
        }
        println!("{}", serde_json::to_string(&object)?);
    }

    if identical == Some(false) {
        return Err("the loss traces of the workspace modes differ: workspaces changed the arithmetic".into());
    }
    Ok(())
}
