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
//! thread's heap allocations around every `fit_batch` call, and
//! `getrusage(RUSAGE_THREAD)` its minor page faults. After each epoch, outside that
//! bracket and outside the
//! epoch's time, the network is evaluated on the test set; the epoch's progress bar (or,
//! without a terminal, a plain line every 10 epochs) shows its mean loss and that test
//! accuracy. At the end a table shows, per workspace mode, the test accuracy, the median
//! time of an epoch and of an iteration, the workspace capacity, heap allocations, bytes
//! and page faults per steady-state iteration (every iteration after epoch 1, the warm-up
//! in which workspaces learn their sizes) and the peak RSS.
//!
//! What it shows: with workspaces enabled a steady iteration makes **no heap
//! allocation**; with `--workspace-mode none` every temporary array is its own
//! allocation; and the arithmetic is the same — with `--compare` both modes train in one
//! process from the same seed, epoch by epoch in turn, and their loss traces must be
//! bit-identical (the demo fails otherwise).
//!
//! Run: `cargo run --release --example train_digits -- [FLAGS]`
//!
//! | flag | default | meaning |
//! |---|---|---|
//! | `--workspace-mode enabled\|none` | `enabled` | workspaces in training and evaluation (unused with `--compare`) |
//! | `--compare` | off | train both modes (same seed, interleaved by epoch); check that the losses are bit-identical |
//! | `--epochs N` | 80 | passes over the training set |
//! | `--batch-size N` | 32 | rows per iteration (the last batch of an epoch may be smaller) |
//! | `--hidden 128,64` | `128,64` | hidden layer widths, comma-separated |
//! | `--lr X` | 0.001 | Adam learning rate |
//! | `--seed N` | 0 | seed of the split, the weights and the batch order |
//! | `--prefetch-depth N` | 2 | batches the prefetcher fills ahead on its thread; 0: inline in the training thread (shield mode) |
//! | `--json` | off | print one JSON object (the results) as the last line of stdout; no progress bars |
//! | `--plot FILE` | none | train both modes, as `--compare` does, and plot them to FILE (`.svg` or `.png`) |
//!
//! `--plot` implies `--compare` (so `--workspace-mode` is unused). It draws, per
//! iteration of both modes, the workspace bytes in use and the heap allocations. The
//! file name's extension is checked when the flags are parsed, its directory before
//! training starts.
//!
//! Environment: `TRAIN_DIGITS_DATA` overrides the path of the data file.
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
//! The last line of stdout is one JSON object: `epochs`, `batch_size`, `hidden`, `seed`,
//! `lr`, `train_rows`, `test_rows`, `iter_time_ratio_enabled_over_none` (median time of
//! an iteration, enabled over none; `null` with one mode), `loss_traces_identical`
//! (`null` with one mode), and one object per mode trained, under `enabled` and `none`
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
//! `workspace_bytes_in_use`) add detail.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::error::Error;
use std::fs::File;
use std::io::{BufReader, IsTerminal};
use std::path::{Path, PathBuf};
use std::time::Instant;

use carve::async_iter::{InMemory, PrefetchStats, Prefetcher, Threading, MAX_DEPTH};
use carve::nn::{Network, NetworkConfig, Rng, Updater};
use carve::WorkspaceMode;
use clap::Parser;
use flate2::read::GzDecoder;
use indicatif::{ProgressBar, ProgressStyle};
use ndarray::{Array1, Array2, Axis, Ix1, Ix2};
use plotters::coord::Shift;
use plotters::prelude::*;
use sha2::{Digest, Sha256};

type Res<T> = Result<T, Box<dyn Error>>;

/// Pixels per image and classes.
const FEATURES: usize = 64;
const CLASSES: usize = 10;
/// Largest accepted hidden width (a typo such as `--hidden 1280000` is an error, not
/// an out-of-memory abort).
const MAX_WIDTH: usize = 1 << 16;

// ---------------------------------------------------------------------------------
// Counting allocator: every allocation, counted per thread (the training thread's
// count is what the trace records; the prefetcher's producer thread counts its own).

struct CountingAlloc;

thread_local! {
    /// This thread's (allocations, bytes requested). Const-initialised and without a
    /// destructor, so reading it never allocates.
    static COUNTS: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

fn count(bytes: usize) {
    // `try_with`: a thread that is being torn down still allocates, uncounted.
    let _ = COUNTS.try_with(|c| {
        let (n, b) = c.get();
        c.set((n + 1, b + bytes as u64));
    });
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the
// bookkeeping only touches a const thread-local cell and never allocates.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which `System` shares.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        // SAFETY: `ptr` and `layout` come from this allocator, i.e. from `System`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` and `layout` come from this allocator, i.e. from `System`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

/// Allocations (including reallocations) and bytes requested so far by this thread.
fn alloc_counters() -> (u64, u64) {
    COUNTS.with(Cell::get)
}

/// Minor page faults of this thread so far (of the process where the OS cannot count
/// per thread).
fn minor_faults() -> u64 {
    // SAFETY: `getrusage` only writes into the struct it is given, for which all-zero
    // bytes are a valid value.
    unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        #[cfg(target_os = "linux")]
        let who = libc::RUSAGE_THREAD;
        #[cfg(not(target_os = "linux"))]
        let who = libc::RUSAGE_SELF;
        if libc::getrusage(who, &mut usage) != 0 {
            return 0;
        }
        usage.ru_minflt as u64
    }
}

/// How peak RSS is measured (see "Peak RSS" in the docs above).
#[derive(Debug)]
enum RssMeter {
    /// Per mode: the high-water mark is reset as each epoch starts and read as it ends.
    PerEpoch,
    /// The process's peak over the whole run: the mark could not be reset (why).
    Process(String),
}

impl RssMeter {
    /// Per epoch if the high-water mark can be reset here.
    fn new() -> RssMeter {
        match reset_peak_rss() {
            Ok(()) => RssMeter::PerEpoch,
            Err(why) => RssMeter::Process(why),
        }
    }

    /// Resets the high-water mark before an epoch; falls back to the process's peak
    /// for good if that fails.
    fn epoch_starts(&mut self) {
        if let RssMeter::PerEpoch = self {
            if let Err(why) = reset_peak_rss() {
                *self = RssMeter::Process(why);
            }
        }
    }

    /// The high-water mark of the epoch that just ended, when measured per epoch.
    fn epoch_peak(&self) -> Option<u64> {
        match self {
            RssMeter::PerEpoch => peak_rss_bytes(),
            RssMeter::Process(_) => None,
        }
    }
}

/// Resets the process's peak RSS (`VmHWM`) to its current RSS (Linux 4.0 and later).
fn reset_peak_rss() -> Result<(), String> {
    std::fs::write("/proc/self/clear_refs", "5").map_err(|e| format!("/proc/self/clear_refs: {e}"))
}

/// Peak resident set size of the process (`VmHWM` in /proc/self/status), in bytes.
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.trim_start_matches("VmHWM:").trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}

// ---------------------------------------------------------------------------------
// Command line.

/// Trains the reference MLP on the UCI digits with carve workspaces on or off, and
/// reports heap allocations, page faults, timings and memory per iteration.
#[derive(Parser, Debug)]
#[command(name = "train_digits", version)]
struct Args {
    /// Workspaces during training and evaluation: `enabled` or `none` (ignored with --compare or --plot)
    #[arg(long, value_name = "MODE", default_value = "enabled", value_parser = parse_mode)]
    workspace_mode: WorkspaceMode,

    /// Train both modes in one process (same seed, interleaved by epoch) and check that
    /// their loss traces are bit-identical
    #[arg(long)]
    compare: bool,

    /// Passes over the training set
    #[arg(long, value_name = "N", default_value_t = 80, value_parser = parse_count)]
    epochs: usize,

    /// Rows per training iteration
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = parse_count)]
    batch_size: usize,

    /// Hidden layer widths, comma-separated (each followed by a ReLU)
    #[arg(long, value_name = "W,W,...", value_delimiter = ',', default_value = "128,64", value_parser = parse_width)]
    hidden: Vec<usize>,

    /// Adam learning rate
    #[arg(long, value_name = "X", default_value_t = 1e-3, value_parser = parse_lr, allow_negative_numbers = true)]
    lr: f32,

    /// Seed of the train/test split, the weights and the batch order
    #[arg(long, value_name = "N", default_value_t = 0)]
    seed: u64,

    /// Batches the prefetcher fills ahead on its own thread; 0 fills them inline in the
    /// training thread (the prefetcher's shield mode)
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = parse_depth)]
    prefetch_depth: usize,

    /// Print the results as one JSON object on the last line of stdout (no progress bars)
    #[arg(long)]
    json: bool,

    /// Plot workspace bytes and heap allocations per iteration of both modes to FILE (.svg or .png); trains
    /// both modes, as --compare does
    #[arg(long, value_name = "FILE", value_parser = parse_plot_path)]
    plot: Option<PathBuf>,
}

impl Args {
    /// Both modes train: with `--compare`, and with `--plot`, which draws both.
    fn both_modes(&self) -> bool {
        self.compare || self.plot.is_some()
    }
}

fn parse_mode(s: &str) -> Result<WorkspaceMode, String> {
    s.parse::<WorkspaceMode>().map_err(|e| e.to_string())
}

fn parse_count(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".to_string()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("'{s}' is not a positive integer ({e})")),
    }
}

fn parse_depth(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n > MAX_DEPTH => Err(format!("a prefetch depth of {n} is above the limit of {MAX_DEPTH}")),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("'{s}' is not a non-negative integer ({e})")),
    }
}

fn parse_width(s: &str) -> Result<usize, String> {
    match parse_count(s)? {
        n if n > MAX_WIDTH => Err(format!("a hidden width of {n} is above the limit of {MAX_WIDTH}")),
        n => Ok(n),
    }
}

/// The image formats of `--plot`, by file name extension.
#[derive(Clone, Copy, Debug)]
enum PlotFormat {
    Svg,
    Png,
}

fn plot_format(path: &Path) -> Option<PlotFormat> {
    match path.extension()?.to_str()?.to_ascii_lowercase().as_str() {
        "svg" => Some(PlotFormat::Svg),
        "png" => Some(PlotFormat::Png),
        _ => None,
    }
}

fn parse_plot_path(s: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(s);
    match plot_format(&path) {
        Some(_) => Ok(path),
        None => Err(format!("'{s}' does not end in .svg or .png: the plot's format is taken from the file name")),
    }
}

fn parse_lr(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        Ok(x) => Err(format!("the learning rate must be finite and positive, not {x}")),
        Err(e) => Err(format!("'{s}' is not a number ({e})")),
    }
}

// ---------------------------------------------------------------------------------
// Data.

/// Images (one row each, pixels in 0..1) and their labels.
struct Dataset {
    x: Array2<f32>,
    y: Array1<u32>,
}

fn data_path() -> PathBuf {
    match std::env::var_os("TRAIN_DIGITS_DATA") {
        Some(path) => PathBuf::from(path),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/data/digits.csv.gz"),
    }
}

/// Reads the gzipped CSV: 64 pixel values 0..16, then the label 0..9, no header.
fn load_digits(path: &Path) -> Res<Dataset> {
    let file = File::open(path).map_err(|e| {
        format!(
            "cannot open the digits data at {}: {e} (it ships with the repository as \
             examples/data/digits.csv.gz; TRAIN_DIGITS_DATA overrides the path)",
            path.display()
        )
    })?;
    let mut reader =
        csv::ReaderBuilder::new().has_headers(false).flexible(true).from_reader(GzDecoder::new(BufReader::new(file)));
    let mut pixels = Vec::with_capacity(1797 * FEATURES);
    let mut labels = Vec::with_capacity(1797);
    let bad = |row: usize, what: String| format!("{}: row {row}: {what}", path.display());
    for (i, record) in reader.records().enumerate() {
        let row = i + 1;
        let record = record
            .map_err(|e| bad(row, format!("cannot read or decompress it ({e}); expected a gzip-compressed CSV")))?;
        if record.len() != FEATURES + 1 {
            return Err(bad(
                row,
                format!("{} fields, expected {} (64 pixels and a label)", record.len(), FEATURES + 1),
            )
            .into());
        }
        for field in record.iter().take(FEATURES) {
            match field.trim().parse::<f32>() {
                Ok(v) if (0.0..=16.0).contains(&v) => pixels.push(v / 16.0),
                _ => return Err(bad(row, format!("pixel value '{field}' is not a number in 0..16")).into()),
            }
        }
        let field = &record[FEATURES];
        match field.trim().parse::<u32>() {
            Ok(label) if (label as usize) < CLASSES => labels.push(label),
            _ => return Err(bad(row, format!("label '{field}' is not a class 0..9")).into()),
        }
    }
    if labels.is_empty() {
        return Err(format!("{}: no rows", path.display()).into());
    }
    let x = Array2::from_shape_vec((labels.len(), FEATURES), pixels)?;
    Ok(Dataset { x, y: Array1::from(labels) })
}

/// Stratified split: per class, the rows are shuffled and 20% (rounded) go to the
/// test set. Returns (train rows, test rows).
fn stratified_split(labels: &Array1<u32>, seed: u64) -> (Vec<usize>, Vec<usize>) {
    let mut rng = Rng::new(seed);
    let (mut train, mut test) = (Vec::new(), Vec::new());
    for class in 0..CLASSES as u32 {
        let mut rows: Vec<usize> = labels.iter().enumerate().filter(|&(_, &y)| y == class).map(|(i, _)| i).collect();
        rng.shuffle(&mut rows);
        let n_test = (rows.len() as f64 * 0.2).round() as usize;
        test.extend_from_slice(&rows[..n_test]);
        train.extend_from_slice(&rows[n_test..]);
    }
    (train, test)
}

fn subset(data: &Dataset, rows: &[usize]) -> Dataset {
    Dataset { x: data.x.select(Axis(0), rows), y: data.y.select(Axis(0), rows) }
}

// ---------------------------------------------------------------------------------
// Training.

fn mode_name(mode: WorkspaceMode) -> &'static str {
    match mode {
        WorkspaceMode::Enabled => "enabled",
        WorkspaceMode::None => "none",
    }
}

fn build_network(args: &Args, mode: WorkspaceMode) -> carve::Result<Network> {
    let mut builder = NetworkConfig::builder(FEATURES);
    for &width in &args.hidden {
        builder = builder.dense(width).relu();
    }
    let config = builder
        .dense(CLASSES)
        .seed(args.seed)
        .updater(Updater::adam(args.lr))
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode)
        .build()?;
    Network::new(config)
}

/// What was measured, per iteration and per epoch.
#[derive(Default)]
struct Trace {
    loss: Vec<f32>,
    iter_ns: Vec<u64>,
    allocs: Vec<u64>,
    alloc_bytes: Vec<u64>,
    faults: Vec<u64>,
    workspace_bytes: Vec<u64>,
    epoch_ms: Vec<f64>,
    epoch_loss: Vec<f64>,
    /// Test accuracy after each epoch.
    epoch_accuracy: Vec<f64>,
    /// The largest high-water mark of this mode's epochs (when measured per epoch).
    peak_rss: Option<u64>,
}

impl Trace {
    /// A trace with room for every iteration, so that recording never allocates.
    fn with_capacity(iterations: usize, epochs: usize) -> Res<Trace> {
        let mut trace = Trace::default();
        let too_many = |_| format!("cannot hold the measurements of {iterations} iterations: fewer epochs, please");
        trace.loss.try_reserve_exact(iterations).map_err(too_many)?;
        for v in [
            &mut trace.iter_ns,
            &mut trace.allocs,
            &mut trace.alloc_bytes,
            &mut trace.faults,
            &mut trace.workspace_bytes,
        ] {
            v.try_reserve_exact(iterations).map_err(too_many)?;
        }
        trace.epoch_ms.try_reserve_exact(epochs).map_err(too_many)?;
        trace.epoch_loss.try_reserve_exact(epochs).map_err(too_many)?;
        trace.epoch_accuracy.try_reserve_exact(epochs).map_err(too_many)?;
        Ok(trace)
    }
}

/// One mode's network, prefetched batches and measurements.
struct Run {
    mode: WorkspaceMode,
    net: Network,
    batches: Prefetcher<InMemory<f32, u32>>,
    batches_per_epoch: usize,
    batch_size: usize,
    trace: Trace,
}

/// The prefetcher of one mode's training batches: the rows shuffled every epoch from
/// `seed` (the same order in both modes), filled `depth` batches ahead into a ring
/// workspace (fresh heap blocks with workspaces off); depth 0 fills inline.
fn prefetcher(
    train: &Dataset,
    batch: usize,
    seed: u64,
    depth: usize,
    mode: WorkspaceMode,
) -> Res<Prefetcher<InMemory<f32, u32>>> {
    let source = InMemory::new(train.x.clone(), train.y.clone(), batch)?.shuffled(seed);
    let builder = Prefetcher::builder(source).workspace_mode(mode);
    let builder = match depth {
        0 => builder.threading(Threading::Shield),
        depth => builder.depth(depth),
    };
    Ok(builder.build()?)
}

struct Progress {
    enabled: bool,
    plain: bool,
    style: ProgressStyle,
}

/// Trains one epoch of `run`, then evaluates it on the test set. Only the training
/// loop is timed and only `fit_batch` calls are counted; the evaluation comes after
/// both, inside the epoch's peak-RSS window.
fn train_epoch(
    run: &mut Run,
    (epoch, epochs): (usize, usize),
    test: &Dataset,
    progress: &Progress,
    rss: &mut RssMeter,
) -> Res<()> {
    rss.epoch_starts();
    let start = Instant::now();
    let batches = run.batches_per_epoch;
    let pb = progress.enabled.then(|| {
        ProgressBar::new(batches as u64).with_style(progress.style.clone()).with_prefix(format!(
            "{:>7} epoch {epoch:>width$}/{epochs}",
            mode_name(run.mode),
            width = digits(epochs)
        ))
    });
    let message_every = batches.div_ceil(4).max(1);
    let mut loss_sum = 0.0f64;
    let mut b = 0;
    while let Some(lease) = run.batches.next() {
        let context = |e: &dyn std::fmt::Display| {
            format!("training data ({} mode), epoch {epoch}, batch {}: {e}", mode_name(run.mode), b + 1)
        };
        let lease = lease.map_err(|e| context(&e))?;
        // The batch, in place in the prefetch ring.
        let x = lease.features::<f32, Ix2>().map_err(|e| context(&e))?;
        let y = lease.labels::<u32, Ix1>().map_err(|e| context(&e))?;

        let faults0 = minor_faults();
        let (allocs0, bytes0) = alloc_counters();
        let t0 = Instant::now();
        let loss = run.net.fit_batch(x, y);
        let elapsed = t0.elapsed();
        let (allocs1, bytes1) = alloc_counters();
        let faults1 = minor_faults();

        let loss =
            loss.map_err(|e| format!("training ({} mode), epoch {epoch}, batch {}: {e}", mode_name(run.mode), b + 1))?;
        let t = &mut run.trace;
        t.loss.push(loss);
        t.iter_ns.push(elapsed.as_nanos() as u64);
        t.allocs.push(allocs1 - allocs0);
        t.alloc_bytes.push(bytes1 - bytes0);
        t.faults.push(faults1 - faults0);
        t.workspace_bytes.push(run.net.last_iteration_workspace_bytes() as u64);
        loss_sum += f64::from(loss);

        if let Some(pb) = &pb {
            pb.inc(1);
            if (b + 1) % message_every == 0 || b + 1 == batches {
                pb.set_message(format!("running loss {:.4}", loss_sum / (b + 1) as f64));
            }
        }
        b += 1;
    }
    let ms = start.elapsed().as_secs_f64() * 1e3;
    if b != batches {
        return Err(
            format!("{} mode, epoch {epoch}: {b} batches arrived, {batches} expected", mode_name(run.mode)).into()
        );
    }
    let epoch_loss = loss_sum / batches as f64;
    // The next epoch's first batches are filled while this one is evaluated.
    run.batches.reset().map_err(|e| {
        format!("starting epoch {} of the training data ({} mode): {e}", epoch + 1, mode_name(run.mode))
    })?;

    let accuracy = run
        .net
        .evaluate(test.x.view(), test.y.view(), run.batch_size)
        .map_err(|e| format!("evaluating on the test set ({} mode) after epoch {epoch}: {e}", mode_name(run.mode)))?;
    let t = &mut run.trace;
    t.epoch_ms.push(ms);
    t.epoch_loss.push(epoch_loss);
    t.epoch_accuracy.push(accuracy);
    if let Some(peak) = rss.epoch_peak() {
        t.peak_rss = t.peak_rss.max(Some(peak));
    }
    if let Some(pb) = pb {
        pb.finish_with_message(format!("loss {epoch_loss:.4}  test accuracy {accuracy:.4}  {ms:.1} ms"));
    } else if progress.plain && (epoch == 1 || epoch == epochs || epoch.is_multiple_of(10)) {
        eprintln!(
            "{:>7} epoch {epoch:>4}/{epochs}: loss {epoch_loss:.4}  test accuracy {accuracy:.4}  {ms:.1} ms",
            mode_name(run.mode)
        );
    }
    Ok(())
}

fn digits(n: usize) -> usize {
    n.to_string().len()
}

// ---------------------------------------------------------------------------------
// Results.

struct Summary {
    mode: WorkspaceMode,
    test_accuracy: f64,
    train_accuracy: f64,
    final_loss: f64,
    loss_trace_sha256: String,
    steady_iterations: usize,
    steady_allocs_per_iter: Option<f64>,
    steady_bytes_per_iter: Option<f64>,
    steady_faults_per_iter: Option<f64>,
    steady_allocs_max: Option<u64>,
    warmup_allocs: u64,
    iter_us_median: f64,
    epoch_ms_median: f64,
    workspace_bytes: usize,
    workspace_bytes_in_use: u64,
    peak_rss_bytes: Option<u64>,
    test_accuracy_per_epoch: Vec<f64>,
    prefetch: PrefetchStats,
}

fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

fn mean(values: &[u64]) -> Option<f64> {
    (!values.is_empty()).then(|| values.iter().map(|&v| v as f64).sum::<f64>() / values.len() as f64)
}

fn summarize(run: &mut Run, iters_per_epoch: usize, test: &Dataset, train: &Dataset, batch: usize) -> Res<Summary> {
    let what = |set: &str, e: carve::Error| format!("evaluating on the {set} set ({} mode): {e}", mode_name(run.mode));
    let test_accuracy = run.net.evaluate(test.x.view(), test.y.view(), batch).map_err(|e| what("test", e))?;
    let train_accuracy = run.net.evaluate(train.x.view(), train.y.view(), batch).map_err(|e| what("training", e))?;
    let t = &run.trace;
    let warmup = iters_per_epoch.min(t.loss.len());
    let steady = warmup..t.loss.len();
    let mut hasher = Sha256::new();
    for loss in &t.loss {
        hasher.update(loss.to_bits().to_le_bytes());
    }
    let loss_trace_sha256 = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    // Steady state excludes epoch 1; with a single epoch, the medians fall back to it.
    let timed = if steady.is_empty() { 0..t.loss.len() } else { steady.clone() };
    let timed_epochs = if t.epoch_ms.len() > 1 { &t.epoch_ms[1..] } else { &t.epoch_ms[..] };
    Ok(Summary {
        mode: run.mode,
        test_accuracy,
        train_accuracy,
        final_loss: t.epoch_loss.last().copied().unwrap_or(f64::NAN),
        loss_trace_sha256,
        steady_iterations: steady.len(),
        steady_allocs_per_iter: mean(&t.allocs[steady.clone()]),
        steady_bytes_per_iter: mean(&t.alloc_bytes[steady.clone()]),
        steady_faults_per_iter: mean(&t.faults[steady.clone()]),
        steady_allocs_max: t.allocs[steady].iter().copied().max(),
        warmup_allocs: t.allocs[..warmup].iter().sum(),
        iter_us_median: median(t.iter_ns[timed].iter().map(|&ns| ns as f64 / 1e3)),
        epoch_ms_median: median(timed_epochs.iter().copied()),
        workspace_bytes: run.net.workspace_capacity(),
        workspace_bytes_in_use: t.workspace_bytes.iter().copied().max().unwrap_or(0),
        peak_rss_bytes: t.peak_rss,
        test_accuracy_per_epoch: t.epoch_accuracy.clone(),
        prefetch: run.batches.stats(),
    })
}

fn summary_json(s: &Summary, rss: &RssMeter) -> serde_json::Value {
    serde_json::json!({
        "test_accuracy": s.test_accuracy,
        "final_loss": s.final_loss,
        "loss_trace_sha256": s.loss_trace_sha256,
        "steady_state_allocs_per_iter": s.steady_allocs_per_iter,
        "steady_state_alloc_bytes_per_iter": s.steady_bytes_per_iter,
        "iter_us_median": s.iter_us_median,
        "epoch_ms_median": s.epoch_ms_median,
        "workspace_bytes": s.workspace_bytes,
        "peak_rss_bytes": s.peak_rss_bytes,
        "train_accuracy": s.train_accuracy,
        "steady_state_iterations": s.steady_iterations,
        "steady_state_faults_per_iter": s.steady_faults_per_iter,
        "steady_state_allocs_max": s.steady_allocs_max,
        "warmup_allocs": s.warmup_allocs,
        "workspace_bytes_in_use": s.workspace_bytes_in_use,
        "peak_rss_scope": match rss {
            RssMeter::PerEpoch => "mode_epochs",
            RssMeter::Process(_) => "process",
        },
        "test_accuracy_per_epoch": s.test_accuracy_per_epoch,
        "prefetch": s.prefetch,
    })
}

fn bytes_human(bytes: f64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{value:.0} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

fn opt(value: Option<f64>, f: impl Fn(f64) -> String) -> String {
    value.map_or_else(|| "n/a".to_string(), f)
}

fn table(summaries: &[Summary], rss: &RssMeter) -> String {
    type Cell = fn(&Summary) -> String;
    let rss_label = match rss {
        RssMeter::PerEpoch => "peak RSS during its epochs (VmHWM)",
        RssMeter::Process(_) => "peak RSS (VmHWM, whole process)",
    };
    let rows: [(&str, Cell); 13] = [
        ("test accuracy", |s| format!("{:.4}", s.test_accuracy)),
        ("train accuracy", |s| format!("{:.4}", s.train_accuracy)),
        ("final loss (last epoch mean)", |s| format!("{:.5}", s.final_loss)),
        ("ms per epoch (median)", |s| format!("{:.2}", s.epoch_ms_median)),
        ("µs per iteration (median)", |s| format!("{:.1}", s.iter_us_median)),
        ("workspace bytes (capacity)", |s| {
            format!("{} ({})", s.workspace_bytes, bytes_human(s.workspace_bytes as f64))
        }),
        ("heap allocs / steady iteration", |s| opt(s.steady_allocs_per_iter, |v| format!("{v:.2}"))),
        ("heap bytes / steady iteration", |s| opt(s.steady_bytes_per_iter, |v| format!("{v:.0}"))),
        ("page faults / steady iteration", |s| opt(s.steady_faults_per_iter, |v| format!("{v:.2}"))),
        ("heap allocs in epoch 1 (warm-up)", |s| s.warmup_allocs.to_string()),
        ("prefetch ring bytes (growths)", |s| format!("{} ({})", s.prefetch.ring_bytes, s.prefetch.ring_growths)),
        ("ms waited for batches (all epochs)", |s| format!("{:.2}", s.prefetch.consumer_wait_ns as f64 / 1e6)),
        ("", |s| opt(s.peak_rss_bytes.map(|b| b as f64), |b| format!("{b:.0} ({})", bytes_human(b)))),
    ];
    let label = |i: usize| if i + 1 == rows.len() { rss_label } else { rows[i].0 };
    let label_width = (0..rows.len()).map(|i| label(i).chars().count()).max().unwrap_or(0);
    let cells: Vec<Vec<String>> = summaries.iter().map(|s| rows.iter().map(|(_, f)| f(s)).collect()).collect();
    let widths: Vec<usize> = summaries
        .iter()
        .zip(&cells)
        .map(|(s, c)| c.iter().map(|v| v.chars().count()).max().unwrap_or(0).max(mode_name(s.mode).len()))
        .collect();
    let mut out = format!("{:label_width$}", "");
    for (s, w) in summaries.iter().zip(&widths) {
        out += &format!("  {:>w$}", mode_name(s.mode));
    }
    out.push('\n');
    out += &"-".repeat(label_width + widths.iter().map(|w| w + 2).sum::<usize>());
    for i in 0..rows.len() {
        out += &format!("\n{:label_width$}", label(i));
        for (c, w) in cells.iter().zip(&widths) {
            out += &format!("  {:>w$}", c[i]);
        }
    }
    out
}

// ---------------------------------------------------------------------------------
// Plot.

fn series_color(mode: WorkspaceMode) -> RGBColor {
    match mode {
        WorkspaceMode::Enabled => RGBColor(31, 119, 180),
        WorkspaceMode::None => RGBColor(214, 39, 40),
    }
}

/// Registers DejaVu Sans (embedded by the `dejavu` crate) as plotters' "sans-serif",
/// so that text renders without system fonts or fontconfig.
fn register_fonts() -> Res<()> {
    for (style, bytes) in [(FontStyle::Normal, dejavu::sans::regular()), (FontStyle::Bold, dejavu::sans::bold())] {
        plotters::style::register_font("sans-serif", style, bytes)
            .map_err(|_| "the embedded DejaVu Sans font could not be loaded")?;
    }
    Ok(())
}

fn plot(path: &Path, runs: &[Run]) -> Res<()> {
    register_fonts()?;
    let size = (1200, 800);
    let drawn = match plot_format(path) {
        Some(PlotFormat::Svg) => draw(SVGBackend::new(path, size).into_drawing_area(), runs),
        Some(PlotFormat::Png) => draw(BitMapBackend::new(path, size).into_drawing_area(), runs),
        None => return Err(format!("--plot {}: use a .svg or .png file name", path.display()).into()),
    };
    drawn.map_err(|e| format!("drawing {}: {e}", path.display()).into())
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, runs: &[Run]) -> Res<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let root = root.titled("carve train_digits: memory per training iteration", ("sans-serif", 24))?;
    let panels = root.split_evenly((2, 1));
    let iterations = runs.iter().map(|r| r.trace.loss.len()).max().unwrap_or(0).max(2);
    type Pick = fn(&Trace) -> &[u64];
    let panels_spec: [(&str, &str, f64, Pick); 2] = [
        ("workspace bytes in use (peak of each iteration)", "KiB", 1024.0, |t| &t.workspace_bytes),
        ("heap allocations during fit_batch", "allocations", 1.0, |t| &t.allocs),
    ];
    for (area, (caption, unit, scale, pick)) in panels.iter().zip(panels_spec) {
        let top = runs.iter().flat_map(|r| pick(&r.trace).iter().map(|&v| v as f64 / scale)).fold(0.0f64, f64::max);
        let top = if top > 0.0 { top * 1.1 } else { 1.0 };
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(80)
            .build_cartesian_2d(0..iterations - 1, 0.0..top)?;
        chart
            .configure_mesh()
            .x_desc("iteration")
            .y_desc(unit)
            .y_label_formatter(&|v| format!("{v:.0}"))
            .label_style(("sans-serif", 14))
            .draw()?;
        for run in runs {
            let color = series_color(run.mode);
            let points = pick(&run.trace).iter().enumerate().map(|(i, &v)| (i, v as f64 / scale));
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(2)))?
                .label(mode_name(run.mode))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3)));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font(("sans-serif", 16))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

// ---------------------------------------------------------------------------------

fn main() {
    if let Err(e) = run() {
        eprintln!("train_digits: error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Res<()> {
    let args = Args::parse();
    if let Some(path) = &args.plot {
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
        if let Some(dir) = dir.filter(|d| !d.is_dir()) {
            return Err(format!("--plot {}: the directory {} does not exist", path.display(), dir.display()).into());
        }
    }
    let data = load_digits(&data_path())?;
    let (train_rows, test_rows) = stratified_split(&data.y, args.seed);
    let (train, test) = (subset(&data, &train_rows), subset(&data, &test_rows));
    drop(data);
    if train.y.is_empty() || test.y.is_empty() {
        return Err(format!(
            "{}: {} rows are too few for a train/test split ({} training, {} test rows)",
            data_path().display(),
            train.y.len() + test.y.len(),
            train.y.len(),
            test.y.len()
        )
        .into());
    }

    let modes: &[WorkspaceMode] = if args.both_modes() {
        &[WorkspaceMode::Enabled, WorkspaceMode::None]
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
        let net =
            build_network(&args, mode).map_err(|e| format!("building the network ({} mode): {e}", mode_name(mode)))?;
        let batches = prefetcher(&train, batch, args.seed, args.prefetch_depth, mode)
            .map_err(|e| format!("starting the prefetcher ({} mode): {e}", mode_name(mode)))?;
        runs.push(Run {
            mode,
            net,
            batches,
            batches_per_epoch: iters_per_epoch,
            batch_size: batch,
            trace: Trace::with_capacity(iterations, args.epochs)?,
        });
    }

    let out = |line: &str| if args.json { eprintln!("{line}") } else { println!("{line}") };
    let hidden: Vec<String> = args.hidden.iter().map(usize::to_string).collect();
    out(&format!(
        "train_digits: MLP {FEATURES}-{}-{CLASSES}, Adam lr {}, batch {}, {} epochs ({iters_per_epoch} iterations \
         each), seed {}; {} training rows, {} test rows; workspaces: {}",
        hidden.join("-"),
        args.lr,
        args.batch_size,
        args.epochs,
        args.seed,
        train.y.len(),
        test.y.len(),
        modes.iter().map(|&m| mode_name(m)).collect::<Vec<_>>().join(" and "),
    ));

    let stderr_tty = std::io::stderr().is_terminal();
    let progress = Progress {
        enabled: !args.json && stderr_tty,
        plain: !args.json && !stderr_tty,
        style: ProgressStyle::with_template("{prefix} [{bar:30.cyan/blue}] {pos:>3}/{len} {msg}")?
            .progress_chars("=> "),
    };
    let mut rss = RssMeter::new();
    for epoch in 1..=args.epochs {
        for run in runs.iter_mut() {
            train_epoch(run, (epoch, args.epochs), &test, &progress, &mut rss)?;
        }
    }

    let mut summaries = Vec::with_capacity(runs.len());
    for run in runs.iter_mut() {
        summaries.push(summarize(run, iters_per_epoch, &test, &train, batch)?);
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
            "peak RSS: the process's peak over the whole run, the same for both modes, not either mode's (it could \
             not be reset per epoch: {why})"
        )),
    }
    for s in &summaries {
        if let (WorkspaceMode::Enabled, Some(allocs)) = (s.mode, s.steady_allocs_max) {
            if allocs > 0 {
                out(&format!(
                    "warning: workspaces enabled, yet steady-state iterations allocated (up to {allocs} allocations in \
                     one iteration)"
                ));
            }
        }
    }

    let identical = match &runs[..] {
        [a, b] => {
            let same = a.trace.loss.len() == b.trace.loss.len()
                && a.trace.loss.iter().zip(&b.trace.loss).all(|(x, y)| x.to_bits() == y.to_bits());
            let line = if same {
                format!(
                    "loss traces: bit-identical ({} iterations, sha256 {})",
                    a.trace.loss.len(),
                    summaries[0].loss_trace_sha256
                )
            } else {
                let first = a.trace.loss.iter().zip(&b.trace.loss).position(|(x, y)| x.to_bits() != y.to_bits());
                format!(
                    "loss traces: DIFFERENT (first difference at iteration {}; sha256 {} vs {})",
                    first.map_or_else(|| "n/a (lengths differ)".to_string(), |i| (i + 1).to_string()),
                    summaries[0].loss_trace_sha256,
                    summaries[1].loss_trace_sha256
                )
            };
            out(&line);
            Some(same)
        }
        _ => None,
    };

    if let Some(path) = &args.plot {
        plot(path, &runs)?;
        out(&format!("plot written to {}", path.display()));
    }

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
            "hidden": args.hidden,
            "seed": args.seed,
            "lr": lr,
            "train_rows": train.y.len(),
            "test_rows": test.y.len(),
            "iter_time_ratio_enabled_over_none": ratio,
            "loss_traces_identical": identical,
        });
        for s in &summaries {
            object[mode_name(s.mode)] = summary_json(s, &rss);
        }
        println!("{}", serde_json::to_string(&object)?);
    }

    if identical == Some(false) {
        return Err("the loss traces of workspaces enabled and none differ: workspaces changed the arithmetic".into());
    }
    Ok(())
}
