//! Training: the network and the prefetcher of each mode, and one epoch of a mode with
//! its measurements and progress.

use std::time::Instant;

use carve::async_iter::{InMemory, Prefetcher, Threading};
use carve::nn::{dry::BatchShape, dry::DryPass, dry::MemoryEstimate, Network, NetworkConfig, Updater};
use carve::WorkspaceMode;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use ndarray::{Ix1, Ix2};

use crate::args::Args;
use crate::data::Dataset;
use carve::workspace_core::alloc_check::{reset_thread_peak, thread_counts};

use crate::measure::{minor_faults, RssMeter};
use crate::{Res, CLASSES, COLUMNS, FEATURES};

pub(crate) fn mode_name(mode: WorkspaceMode) -> &'static str {
    mode.name()
}

pub(crate) fn build_network(args: &Args, mode: WorkspaceMode) -> carve::Result<Network> {
    let mut builder = NetworkConfig::builder(FEATURES);
    for &width in &args.hidden {
        builder = builder.dense(width).relu();
    }
    let config = builder
        .dense(CLASSES)
        .seed(args.seed)
        .updater(Updater::adam(args.lr))
        .device(args.device)
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode)
        .build()?;
    Network::new(config)
}

/// What was measured, per iteration and per epoch.
#[derive(Default)]
pub(crate) struct Trace {
    pub(crate) loss: Vec<f32>,
    pub(crate) iter_ns: Vec<u64>,
    pub(crate) allocs: Vec<u64>,
    pub(crate) alloc_bytes: Vec<u64>,
    /// The most heap bytes the training thread held at once during `fit_batch`, above
    /// what it held when the call started.
    pub(crate) heap_bytes: Vec<u64>,
    pub(crate) faults: Vec<u64>,
    pub(crate) workspace_bytes: Vec<u64>,
    pub(crate) epoch_ms: Vec<f64>,
    pub(crate) epoch_loss: Vec<f64>,
    /// Test accuracy after each epoch.
    pub(crate) epoch_accuracy: Vec<f64>,
    /// The largest high-water mark of this mode's epochs (when measured per epoch).
    pub(crate) peak_rss: Option<u64>,
}

impl Trace {
    /// A trace with room for every iteration, so that recording never allocates.
    pub(crate) fn with_capacity(iterations: usize, epochs: usize) -> Res<Trace> {
        let mut trace = Trace::default();
        let too_many = |_| format!("cannot hold the measurements of {iterations} iterations: fewer epochs, please");
        trace.loss.try_reserve_exact(iterations).map_err(too_many)?;
        for v in [
            &mut trace.iter_ns,
            &mut trace.allocs,
            &mut trace.alloc_bytes,
            &mut trace.heap_bytes,
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

/// One mode's network, prefetched batches, measurements and progress bar.
pub(crate) struct Run {
    pub(crate) mode: WorkspaceMode,
    pub(crate) net: Network,
    pub(crate) batches: Prefetcher<InMemory<f32, u32>>,
    pub(crate) batches_per_epoch: usize,
    pub(crate) batch_size: usize,
    pub(crate) trace: Trace,
    /// The run's progress bar, on a terminal.
    pub(crate) bar: Option<ProgressBar>,
    /// The dry run's estimate of the run, made before the first step (none on a
    /// device).
    pub(crate) estimate: Option<MemoryEstimate>,
}

/// The passes of the demo's run, in order: per epoch, its training steps (batches of
/// `batch` rows, the last one short), then the evaluation of the test set in batches
/// as large. What the dry run sizes the network from.
pub(crate) fn run_passes(train_rows: usize, test_rows: usize, batch: usize, epochs: usize) -> Vec<DryPass> {
    let cut = |rows: usize| (0..rows).step_by(batch.max(1)).map(move |start| (rows - start).min(batch));
    let epoch: Vec<DryPass> = cut(train_rows)
        .map(|rows| DryPass::Train(BatchShape::flat(rows)))
        .chain(cut(test_rows).map(|rows| DryPass::Infer(BatchShape::flat(rows))))
        .collect();
    epoch.repeat(epochs)
}

/// The prefetcher of one mode's training batches: the rows shuffled every epoch from
/// `seed` (the same order in both modes), filled `depth` batches ahead into a ring
/// workspace (fresh heap blocks with workspaces off); depth 0 fills inline.
pub(crate) fn prefetcher(
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

/// Width of a progress bar's bar, between its brackets.
const BAR_WIDTH: usize = 20;
/// Room for a progress bar's message: the line is the mode's name (7 columns), the
/// bar in brackets, then the message, in [`COLUMNS`] in all.
const BAR_MESSAGE: usize = COLUMNS - (7 + 2 + BAR_WIDTH + 2);

/// How training shows its progress.
pub(crate) enum Progress {
    /// On a terminal: one bar per run (mode) over all of its iterations, its message
    /// the epoch, its loss and test accuracy.
    Bars { multi: MultiProgress, style: ProgressStyle },
    /// Without a terminal: a plain line per mode on epoch 1, every 10th and the last.
    Plain,
    /// Nothing (`--json`).
    Quiet,
}

impl Progress {
    pub(crate) fn new(json: bool, stderr_tty: bool) -> Res<Progress> {
        Ok(match (json, stderr_tty) {
            (true, _) => Progress::Quiet,
            (false, false) => Progress::Plain,
            (false, true) => Progress::Bars {
                multi: MultiProgress::with_draw_target(ProgressDrawTarget::stderr()),
                style: ProgressStyle::with_template(&format!("{{prefix:>7}} [{{bar:{BAR_WIDTH}.cyan/blue}}] {{msg}}"))?
                    .progress_chars("=> "),
            },
        })
    }

    /// The progress bar of a run of `iterations` iterations in `mode` (on a terminal).
    pub(crate) fn bar(&self, mode: WorkspaceMode, iterations: usize) -> Option<ProgressBar> {
        match self {
            Progress::Bars { multi, style } => {
                let bar = ProgressBar::new(iterations as u64).with_style(style.clone()).with_prefix(mode_name(mode));
                Some(multi.add(bar))
            }
            Progress::Plain | Progress::Quiet => None,
        }
    }
}

/// `message` cut to fit a progress bar's line.
fn bar_message(message: String) -> String {
    if message.chars().count() <= BAR_MESSAGE {
        message
    } else {
        message.chars().take(BAR_MESSAGE).collect()
    }
}

/// Trains one epoch of `run`, then evaluates it on the test set. Only the training
/// loop is timed and only `fit_batch` calls are counted; the evaluation comes after
/// both, inside the epoch's peak-RSS window.
pub(crate) fn train_epoch(
    run: &mut Run,
    (epoch, epochs): (usize, usize),
    test: &Dataset,
    progress: &Progress,
    rss: &mut RssMeter,
) -> Res<()> {
    rss.epoch_starts();
    let start = Instant::now();
    let batches = run.batches_per_epoch;
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
        let heap0 = reset_thread_peak(); // the peak of live bytes restarts here
        let t0 = Instant::now();
        if epoch == 1 && b == 1 {
            // Recorded for the memory plan of the report (in the warm-up epoch: the
            // recording itself allocates).
            run.net.record_next_iteration();
        }
        let loss = run.net.fit_batch(x, y);
        let elapsed = t0.elapsed();
        let heap1 = thread_counts();
        let faults1 = minor_faults();

        let loss =
            loss.map_err(|e| format!("training ({} mode), epoch {epoch}, batch {}: {e}", mode_name(run.mode), b + 1))?;
        let t = &mut run.trace;
        t.loss.push(loss);
        t.iter_ns.push(elapsed.as_nanos() as u64);
        t.allocs.push(heap1.allocations - heap0.allocations);
        t.alloc_bytes.push(heap1.bytes - heap0.bytes);
        t.heap_bytes.push((heap1.peak_live_bytes - heap0.live_bytes).max(0) as u64);
        t.faults.push(faults1 - faults0);
        t.workspace_bytes.push(run.net.last_iteration_workspace_bytes() as u64);
        loss_sum += f64::from(loss);

        if let Some(bar) = &run.bar {
            bar.inc(1);
            if (b + 1) % message_every == 0 || b + 1 == batches {
                let running = loss_sum / (b + 1) as f64;
                bar.set_message(bar_message(format!("epoch {epoch}/{epochs}  running loss {}", loss_text(running))));
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
    if let Some(bar) = &run.bar {
        let loss = loss_text(epoch_loss);
        let message = bar_message(format!("epoch {epoch}/{epochs}  loss {loss}  test acc {accuracy:.4}"));
        if epoch == epochs {
            bar.finish_with_message(message);
        } else {
            bar.set_message(message);
        }
    } else if matches!(progress, Progress::Plain) && (epoch == 1 || epoch == epochs || epoch.is_multiple_of(10)) {
        eprintln!(
            "{:>7} epoch {epoch:>4}/{epochs}: loss {}  test accuracy {accuracy:.4}  {ms:.1} ms",
            mode_name(run.mode),
            loss_text(epoch_loss)
        );
    }
    Ok(())
}

/// A loss with 4 decimals, in scientific notation from 10,000 on (so that a diverging
/// run's lines stay short).
pub(crate) fn loss_text(loss: f64) -> String {
    if loss.abs() < 1e4 {
        format!("{loss:.4}")
    } else {
        format!("{loss:.4e}")
    }
}
