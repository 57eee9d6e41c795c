//! Results: each mode's summary, as a table of at most 80 columns and as JSON.

use carve::async_iter::PrefetchStats;
use carve::WorkspaceMode;
use sha2::{Digest, Sha256};

use crate::data::Dataset;
use crate::measure::RssMeter;
use crate::train::{mode_name, Run};
use crate::Res;

pub(crate) struct Summary {
    pub(crate) mode: WorkspaceMode,
    pub(crate) test_accuracy: f64,
    pub(crate) train_accuracy: f64,
    pub(crate) final_loss: f64,
    pub(crate) loss_trace_sha256: String,
    pub(crate) steady_iterations: usize,
    pub(crate) steady_allocs_per_iter: Option<f64>,
    pub(crate) steady_bytes_per_iter: Option<f64>,
    pub(crate) steady_heap_peak_bytes: Option<u64>,
    pub(crate) steady_faults_per_iter: Option<f64>,
    pub(crate) steady_allocs_max: Option<u64>,
    pub(crate) warmup_allocs: u64,
    pub(crate) iter_us_median: f64,
    pub(crate) epoch_ms_median: f64,
    pub(crate) workspace_bytes: usize,
    /// The most workspace bytes one iteration used, over the whole run: the first
    /// iteration's spills included (it runs before the workspaces have learned their
    /// size), so it may exceed the capacity.
    pub(crate) workspace_bytes_in_use: u64,
    /// The same over the steady iterations (after epoch 1): at most the capacity.
    pub(crate) steady_workspace_bytes_in_use: Option<u64>,
    pub(crate) peak_rss_bytes: Option<u64>,
    pub(crate) test_accuracy_per_epoch: Vec<f64>,
    pub(crate) prefetch: PrefetchStats,
    /// The memory plan of iteration 2 (workspaces enabled).
    pub(crate) plan: Option<carve::nn::workspaces::PlannedStats>,
    /// The dry run's estimate, made before the first step (none on a device).
    pub(crate) estimate: Option<carve::nn::dry::MemoryEstimate>,
    /// What the step holds on its device (`--device sim|cuda`).
    pub(crate) device: Option<carve::nn::DeviceStats>,
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

pub(crate) fn summarize(
    run: &mut Run,
    iters_per_epoch: usize,
    test: &Dataset,
    train: &Dataset,
    batch: usize,
) -> Res<Summary> {
    let what = |set: &str, e: carve::Error| format!("evaluating on the {set} set ({} mode): {e}", mode_name(run.mode));
    let test_accuracy = run.net.evaluate(test.x.view(), test.y.view(), batch).map_err(|e| what("test", e))?;
    let train_accuracy = run.net.evaluate(train.x.view(), train.y.view(), batch).map_err(|e| what("training", e))?;
    let t = &run.trace;
    let warmup = iters_per_epoch.min(t.loss.len());
    let steady = warmup..t.loss.len();
    let steady_range = steady.clone();
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
        steady_heap_peak_bytes: t.heap_bytes[steady.clone()].iter().copied().max(),
        steady_faults_per_iter: mean(&t.faults[steady.clone()]),
        steady_allocs_max: t.allocs[steady].iter().copied().max(),
        warmup_allocs: t.allocs[..warmup].iter().sum(),
        iter_us_median: median(t.iter_ns[timed].iter().map(|&ns| ns as f64 / 1e3)),
        epoch_ms_median: median(timed_epochs.iter().copied()),
        workspace_bytes: run.net.workspace_capacity(),
        workspace_bytes_in_use: t.workspace_bytes.iter().copied().max().unwrap_or(0),
        steady_workspace_bytes_in_use: t.workspace_bytes[steady_range.clone()].iter().copied().max(),
        peak_rss_bytes: t.peak_rss,
        test_accuracy_per_epoch: t.epoch_accuracy.clone(),
        prefetch: run.batches.stats(),
        plan: run.net.memory_plan(),
        estimate: run.estimate.clone(),
        device: run.net.device_stats(),
    })
}

pub(crate) fn summary_json(s: &Summary, rss: &RssMeter) -> serde_json::Value {
    serde_json::json!({
        "test_accuracy": s.test_accuracy,
        "device_name": s.device.as_ref().map(|d| d.device.clone()),
        "device_bytes": s.device.as_ref().map(|d| d.bytes),
        "device_allocations": s.device.as_ref().map(|d| d.allocations),
        "device_plan_bytes": s.device.as_ref().and_then(|d| d.plan_bytes),
        "device_lower_bound_bytes": s.device.as_ref().and_then(|d| d.lower_bound_bytes),
        "final_loss": s.final_loss,
        "loss_trace_sha256": s.loss_trace_sha256,
        "steady_state_allocs_per_iter": s.steady_allocs_per_iter,
        "steady_state_alloc_bytes_per_iter": s.steady_bytes_per_iter,
        "steady_state_heap_peak_bytes": s.steady_heap_peak_bytes,
        "iter_us_median": s.iter_us_median,
        "epoch_ms_median": s.epoch_ms_median,
        "workspace_bytes": s.workspace_bytes,
        // The dry run's, before the first step: the arenas after the run (to compare
        // with workspace_bytes) and the bytes of the largest step (with
        // steady_state_workspace_bytes_in_use).
        "predicted_bytes": s.estimate.as_ref().map(|e| e.workspace_bytes),
        "predicted_step_bytes": s.estimate.as_ref().map(|e| e.step_bytes()),
        "predicted_bytes_in_use": s.estimate.as_ref().map(|e| e.peak_step_bytes),
        "predicted_total_bytes": s.estimate.as_ref().map(|e| e.total_bytes()),
        "dry_run_us": s.estimate.as_ref().map(|e| e.dry_run_us),
        "dry_run_passes": s.estimate.as_ref().map(|e| e.passes_run),
        "peak_rss_bytes": s.peak_rss_bytes,
        "train_accuracy": s.train_accuracy,
        "steady_state_iterations": s.steady_iterations,
        "steady_state_faults_per_iter": s.steady_faults_per_iter,
        "steady_state_allocs_max": s.steady_allocs_max,
        "warmup_allocs": s.warmup_allocs,
        "workspace_bytes_in_use": s.workspace_bytes_in_use,
        "steady_state_workspace_bytes_in_use": s.steady_workspace_bytes_in_use,
        "peak_rss_scope": match rss {
            RssMeter::PerEpoch => "mode_epochs",
            RssMeter::Process(_) => "process",
        },
        "test_accuracy_per_epoch": s.test_accuracy_per_epoch,
        "prefetch": s.prefetch,
        // One recorded iteration: its roles laid out per role, one arena planned from
        // its lifetimes, and the bytes live at once; planned, the plan it trains on,
        // re-plans and divergences (0 in the other modes).
        "per_role_bytes": s.plan.as_ref().map(|p| p.per_role_bytes),
        "plan_bytes": s.plan.as_ref().map(|p| p.plan_bytes),
        "lower_bound_bytes": s.plan.as_ref().map(|p| p.lower_bound_bytes),
        "plan_to_bound": s.plan.as_ref().map(|p| p.plan_to_bound),
        "planning_us": s.plan.as_ref().map(|p| p.planning_us),
        "replans": s.plan.as_ref().map(|p| p.replans),
        "divergences": s.plan.as_ref().map(|p| p.divergences),
    })
}

/// Bytes in B, KiB, MiB, GiB or TiB, one decimal from KiB on.
pub(crate) fn bytes_human(bytes: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
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

/// `n` with a comma every three digits.
pub(crate) fn thousands(n: u128) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn opt(value: Option<f64>, f: impl Fn(f64) -> String) -> String {
    value.map_or_else(|| "n/a".to_string(), f)
}

/// `text` broken at spaces into lines of at most `width` columns (a word longer than
/// that is cut); lines after the first start with `indent`.
pub(crate) fn wrap(text: &str, width: usize, indent: &str) -> String {
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        let mut word = word.to_string();
        loop {
            let start = if lines.is_empty() { "" } else { indent };
            let used = if line.is_empty() { start.chars().count() } else { line.chars().count() + 1 };
            if used + word.chars().count() <= width {
                if line.is_empty() {
                    line = start.to_string();
                } else {
                    line.push(' ');
                }
                line += &word;
                break;
            }
            if !line.is_empty() {
                lines.push(std::mem::take(&mut line));
                continue;
            }
            // A word wider than a line: cut it.
            let room = width.saturating_sub(start.chars().count()).max(1);
            let head: String = word.chars().take(room).collect();
            word = word.chars().skip(room).collect();
            lines.push(format!("{start}{head}"));
            if word.is_empty() {
                break;
            }
        }
    }
    if !line.is_empty() || lines.is_empty() {
        lines.push(line);
    }
    lines.join("\n")
}

pub(crate) fn table(summaries: &[Summary], rss: &RssMeter) -> String {
    type Cell = fn(&Summary) -> String;
    let rss_label = match rss {
        RssMeter::PerEpoch => "peak RSS during its epochs (VmHWM)",
        RssMeter::Process(_) => "peak RSS (VmHWM, whole process)",
    };
    let rows: [(&str, Cell); 16] = [
        ("test accuracy", |s| format!("{:.4}", s.test_accuracy)),
        ("train accuracy", |s| format!("{:.4}", s.train_accuracy)),
        ("final loss (last epoch mean)", |s| {
            if s.final_loss.abs() < 1e4 {
                format!("{:.5}", s.final_loss)
            } else {
                format!("{:.3e}", s.final_loss)
            }
        }),
        ("ms per epoch (median)", |s| format!("{:.2}", s.epoch_ms_median)),
        ("µs per iteration (median)", |s| format!("{:.1}", s.iter_us_median)),
        ("workspace bytes (capacity)", |s| bytes_human(s.workspace_bytes as f64)),
        ("  predicted before step 1 (dry run)", |s| {
            opt(s.estimate.as_ref().map(|e| e.workspace_bytes as f64), bytes_human)
        }),
        ("workspace bytes in use (steady peak)", |s| {
            opt(s.steady_workspace_bytes_in_use.map(|b| b as f64), bytes_human)
        }),
        ("heap bytes in use (steady peak)", |s| opt(s.steady_heap_peak_bytes.map(|b| b as f64), bytes_human)),
        ("heap allocs / steady iteration", |s| opt(s.steady_allocs_per_iter, |v| format!("{v:.2}"))),
        ("heap bytes allocated / steady iter", |s| opt(s.steady_bytes_per_iter, bytes_human)),
        ("page faults / steady iteration", |s| opt(s.steady_faults_per_iter, |v| format!("{v:.2}"))),
        ("heap allocs in epoch 1 (warm-up)", |s| s.warmup_allocs.to_string()),
        ("prefetch ring bytes (growths)", |s| {
            format!("{} ({})", bytes_human(s.prefetch.ring_bytes as f64), s.prefetch.ring_growths)
        }),
        ("ms waited for batches (all epochs)", |s| format!("{:.2}", s.prefetch.consumer_wait_ns as f64 / 1e6)),
        ("", |s| opt(s.peak_rss_bytes.map(|b| b as f64), bytes_human)),
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
