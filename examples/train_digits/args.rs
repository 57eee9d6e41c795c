//! The demo's command line: flags, their parsers and the checks made before training.

use std::path::PathBuf;

use carve::async_iter::MAX_DEPTH;
use std::str::FromStr;

use carve::nn::Device;
use carve::WorkspaceMode;
use clap::Parser;

use crate::parallel::{parse_reducer, parse_workers, ReducerArg};
use crate::plot::parse_plot_path;
use crate::report::{bytes_human, thousands};
use crate::{CLASSES, FEATURES};

/// The most parameters the network may have, all layers together: with a gradient and
/// Adam's two moments each, [`BYTES_PER_PARAMETER`] bytes apiece, 256 MiB in all.
pub(crate) const MAX_PARAMETERS: u128 = 1 << 24;

/// Bytes held per parameter: its value, its gradient and the updater's two moments
/// (Adam), all `f32`.
pub(crate) const BYTES_PER_PARAMETER: u128 = 4 * 4;

/// Trains the reference MLP on the UCI digits with carve workspaces on or off,
/// and reports heap allocations, page faults, timings and memory per iteration.
#[derive(Parser, Debug)]
#[command(name = "train_digits", version, verbatim_doc_comment, next_line_help = true)]
pub(crate) struct Args {
    /// Workspaces during training and evaluation: `enabled`, `planned`
    /// (one arena planned from the first iteration) or `none`
    /// (ignored with --compare or --plot)
    #[arg(long, value_name = "MODE", default_value = "enabled", value_parser = parse_mode, verbatim_doc_comment)]
    pub(crate) workspace_mode: WorkspaceMode,

    /// Where each training step runs: `host` (the CPU), `sim` (the
    /// simulated device: the host's arithmetic in simulated device
    /// memory, so the same losses) or `cuda`/`cuda:N` (a GPU; where
    /// there is none, an error naming why)
    #[arg(long, value_name = "DEVICE", default_value = "host", value_parser = Device::from_str, verbatim_doc_comment)]
    pub(crate) device: Device,

    /// Train the three modes in one process (same seed, interleaved by
    /// epoch) and check that their loss traces are bit-identical
    #[arg(long, verbatim_doc_comment)]
    pub(crate) compare: bool,

    /// Passes over the training set (1 or more)
    #[arg(long, value_name = "N", default_value_t = 80, value_parser = parse_count)]
    pub(crate) epochs: usize,

    /// Rows per training iteration (1 or more; more than the training
    /// rows is one batch of all of them, and the header says
    /// so)
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = parse_count, verbatim_doc_comment)]
    pub(crate) batch_size: usize,

    /// Hidden layer widths, comma-separated, each followed by a ReLU
    /// (each 1 or more; at most 16,777,216 parameters in
    /// all)
    #[arg(
        long,
        value_name = "W,W,...",
        value_delimiter = ',',
        default_value = "128,64",
        value_parser = parse_count,
        verbatim_doc_comment
    )]
    pub(crate) hidden: Vec<usize>,

    /// Adam learning rate (finite, above 0)
    #[arg(long, value_name = "X", default_value_t = 1e-3, value_parser = parse_lr, allow_negative_numbers = true)]
    pub(crate) lr: f32,

    /// Seed of the train/test split, the weights and the batch
    /// order
    #[arg(long, value_name = "N", default_value_t = 0, verbatim_doc_comment)]
    pub(crate) seed: u64,

    /// Batches the prefetcher fills ahead on its own thread (0 to
    /// 1024); 0 fills them inline in the training thread (the
    /// prefetcher's shield mode)
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = parse_depth, verbatim_doc_comment)]
    pub(crate) prefetch_depth: usize,

    /// Print the results as one JSON object on the last line of
    /// stdout (no progress bars)
    #[arg(long, verbatim_doc_comment)]
    pub(crate) json: bool,

    /// Plot memory (workspace and heap bytes) and heap allocations
    /// per iteration of every mode to FILE (.svg or .png); trains
    /// the three modes, as --compare does
    #[arg(long, value_name = "FILE", value_parser = parse_plot_path, verbatim_doc_comment)]
    pub(crate) plot: Option<PathBuf>,

    /// Save the trained network to FILE as a safetensors model
    /// (`serve_digits --model FILE` serves it); with --compare,
    /// the first mode's (all modes train the same weights)
    #[arg(long, value_name = "FILE", verbatim_doc_comment)]
    pub(crate) save: Option<PathBuf>,

    /// Record a timeline of the run's workspace memory and write it
    /// to FILE as a Chrome trace (open it in https://ui.perfetto.dev
    /// or chrome://tracing): a counter track per workspace, a slice
    /// per allocation with its role and layer; adds
    /// `timeline_events` and `timeline_bytes` to the JSON. With
    /// --compare (or --plot) the timeline is on in odd epochs and
    /// off in even ones, for `iter_time_ratio_timeline_over_off`
    /// (from 3 epochs on; null with fewer)
    #[arg(long, value_name = "FILE", verbatim_doc_comment)]
    pub(crate) timeline: Option<PathBuf>,

    /// Measure where each training step's time goes (matrix
    /// multiply, elementwise, loss, updater, checks, copies,
    /// bookkeeping) after epoch 1, and carve's matrix multiply
    /// alone on the step's shapes; adds `breakdown_us`,
    /// `step_gflops` and `gemm_gflops_same_shapes` to the JSON
    #[arg(long, verbatim_doc_comment)]
    pub(crate) breakdown: bool,

    /// Threads of each training step (1 to 64): the step's large
    /// matrix multiplies and updater passes split across them
    /// (`Network::set_threads`), the same bits as one thread; the
    /// default MLP's are too small to gain from it
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = parse_threads, verbatim_doc_comment)]
    pub(crate) threads: usize,

    /// Train data-parallel with N workers (1 to 256; default 2 with
    /// --reducer, the number of processes with --reducer mpi): each
    /// batch is cut into N shards, the gradients reduced in rank
    /// order; a one-worker trainer trains alongside for the speedup
    #[arg(long, value_name = "N", value_parser = parse_workers, verbatim_doc_comment)]
    pub(crate) workers: Option<usize>,

    /// How the workers reduce: `threads` (a thread each),
    /// `sequential` (one thread running the N shards in turn: the
    /// same bits as N threads) or `mpi` (a process each, under
    /// `mpirun -np N`; built with `--features mpi`)
    #[arg(long, value_name = "REDUCER", value_parser = parse_reducer, verbatim_doc_comment)]
    pub(crate) reducer: Option<ReducerArg>,
}

impl Args {
    /// The command line, checked: exits with status 0 after `--help` or `--version`,
    /// with status 2 and one line on stderr if it is not valid.
    pub(crate) fn parse_checked() -> Args {
        let args: Args = crate::cli::parse();
        if let Err(what) = args.check() {
            crate::cli::usage_error::<Args>(&what);
        }
        args
    }

    /// What the parsers of single values cannot see: the size of the whole network,
    /// flags that do not go together.
    fn check(&self) -> Result<(), String> {
        if self.data_parallel() && self.both_modes() {
            return Err("--workers and --reducer train one data-parallel run, --compare and --plot compare \
                        workspace modes: use one or the other"
                .to_string());
        }
        if self.device != Device::Host && (self.data_parallel() || self.timeline.is_some() || self.breakdown) {
            return Err(format!(
                "--device {} trains on the device: --workers, --reducer, --timeline and --breakdown measure host \
                 steps; leave them out, or train on the host",
                self.device
            ));
        }
        if let Some(timeline) = &self.timeline {
            if [&self.save, &self.plot].into_iter().flatten().any(|p| p == timeline) {
                return Err(
                    "--timeline writes a file of its own: give it a path other than --save's and --plot's".to_string()
                );
            }
        }
        if self.data_parallel() && self.timeline.is_some() {
            return Err("--timeline records the workspaces of the training thread's network, --workers and \
                        --reducer train on a thread or process per worker: use one or the other"
                .to_string());
        }
        if self.data_parallel() && self.threads > 1 {
            return Err("--threads splits one network's steps, --workers and --reducer train data-parallel \
                        (a thread per worker): use one or the other"
                .to_string());
        }
        let parameters = parameter_count(&self.hidden);
        if parameters > MAX_PARAMETERS {
            let widths: Vec<String> = self.hidden.iter().map(usize::to_string).collect();
            return Err(format!(
                "invalid value '{}' for '--hidden <W,W,...>': the network would have {} parameters, {} with \
                 their gradients and Adam's two moments; the limit is {} parameters ({})",
                widths.join(","),
                thousands(parameters),
                bytes_human((parameters * BYTES_PER_PARAMETER) as f64),
                thousands(MAX_PARAMETERS),
                bytes_human((MAX_PARAMETERS * BYTES_PER_PARAMETER) as f64),
            ));
        }
        Ok(())
    }

    /// Training is data-parallel: with `--workers` or `--reducer`.
    pub(crate) fn data_parallel(&self) -> bool {
        self.workers.is_some() || self.reducer.is_some()
    }

    /// Both modes train: with `--compare`, and with `--plot`, which draws both.
    pub(crate) fn both_modes(&self) -> bool {
        self.compare || self.plot.is_some()
    }
}

/// Weights and biases of the MLP `FEATURES`-`hidden`-`CLASSES`, all layers together.
pub(crate) fn parameter_count(hidden: &[usize]) -> u128 {
    let mut inputs = FEATURES as u128;
    let mut total = 0u128;
    for &width in hidden.iter().chain(&[CLASSES]) {
        let width = width as u128;
        total = total.saturating_add((inputs + 1).saturating_mul(width));
        inputs = width;
    }
    total
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

/// The most threads `--threads` takes.
const MAX_THREADS: usize = 64;

fn parse_threads(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_THREADS).contains(&n) => Ok(n),
        _ => Err(format!("'{s}' is not a number of threads from 1 to {MAX_THREADS}")),
    }
}

fn parse_depth(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n > MAX_DEPTH => {
            Err(format!("a prefetch depth of {n} is above the limit of {MAX_DEPTH} (valid: 0 to {MAX_DEPTH})"))
        }
        Ok(n) => Ok(n),
        Err(e) => Err(format!("'{s}' is not an integer from 0 to {MAX_DEPTH} ({e})")),
    }
}

fn parse_lr(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        Ok(x) => Err(format!("the learning rate must be finite and positive, not {x}")),
        Err(e) => Err(format!("'{s}' is not a number ({e})")),
    }
}
