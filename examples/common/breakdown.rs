//! Where a training step's time goes (included with `#[path]` by the demo's
//! `--breakdown` and by `benches/step_breakdown.rs`): the network's own
//! [`StepBreakdown`](carve::nn::StepBreakdown), the step's floating-point rate, and the
//! rate of carve's matrix multiply alone on the step's shapes, measured in the same run.

// Not every user needs every helper.
#![allow(dead_code)]

use std::mem::MaybeUninit;
use std::time::Instant;

use carve::nn::gemm::{scratch_len, sgemm};
use carve::nn::StepBreakdown;
use ndarray::Array2;

/// The layer widths of an MLP: inputs, the hidden widths, the classes.
pub(crate) fn widths(inputs: usize, hidden: &[usize], classes: usize) -> Vec<usize> {
    std::iter::once(inputs).chain(hidden.iter().copied()).chain(std::iter::once(classes)).collect()
}

/// The floating-point operations of one training step of `batch` rows: per dense layer
/// `in → out`, the forward product and the weights' gradient (2·batch·in·out each), and
/// the input's gradient but for the first layer.
pub(crate) fn step_flops(widths: &[usize], batch: usize) -> f64 {
    let products: Vec<f64> = widths.windows(2).map(|w| 2.0 * batch as f64 * w[0] as f64 * w[1] as f64).collect();
    let first = products.first().copied().unwrap_or(0.0);
    3.0 * products.iter().sum::<f64>() - first
}

/// GFLOP/s of carve's matrix multiply alone on the step's products (forward `x·W`, then
/// `xᵀ·dy` and `dy·Wᵀ` per layer), the median of `rounds` rounds of the whole set.
pub(crate) fn gemm_gflops(widths: &[usize], batch: usize, rounds: usize) -> carve::Result<f64> {
    let fill = |r: usize, c: usize, seed: usize| {
        Array2::from_shape_fn((r, c), |(i, j)| (((i * 31 + j * 17 + seed) % 97) as f32 / 97.0) - 0.5)
    };
    let layers: Vec<_> = widths
        .windows(2)
        .enumerate()
        .map(|(l, w)| (fill(batch, w[0], l), fill(w[0], w[1], l + 1), fill(batch, w[1], l + 2)))
        .collect();
    let need = widths
        .windows(2)
        .map(|w| scratch_len(batch, w[1], w[0]).max(scratch_len(w[0], w[1], batch)).max(scratch_len(batch, w[0], w[1])))
        .max()
        .unwrap_or(0);
    let mut scratch = vec![MaybeUninit::<f32>::uninit(); need];
    let mut outs: Vec<_> = widths.windows(2).map(|w| Array2::<f32>::zeros((batch, w[1]))).collect();
    let mut grads_w: Vec<_> = widths.windows(2).map(|w| Array2::<f32>::zeros((w[0], w[1]))).collect();
    let mut grads_x: Vec<_> = widths.windows(2).map(|w| Array2::<f32>::zeros((batch, w[0]))).collect();
    let mut times = Vec::with_capacity(rounds);
    for round in 0..rounds + 3 {
        let t0 = Instant::now();
        for (l, (x, w, _)) in layers.iter().enumerate() {
            sgemm(1.0, x.view(), w.view(), 1.0, outs[l].view_mut(), &mut scratch)?;
        }
        for (l, (x, w, dy)) in layers.iter().enumerate().rev() {
            sgemm(1.0, x.t(), dy.view(), 0.0, grads_w[l].view_mut(), &mut scratch)?;
            if l > 0 {
                sgemm(1.0, dy.view(), w.t(), 0.0, grads_x[l].view_mut(), &mut scratch)?;
            }
        }
        if round >= 3 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    Ok(step_flops(widths, batch) / median / 1e9)
}

/// The breakdown's JSON: each part's mean µs per step.
pub(crate) fn breakdown_json(breakdown: &StepBreakdown) -> serde_json::Value {
    let mut object = serde_json::Map::new();
    for (part, us) in breakdown.per_step_us() {
        object.insert(part.to_string(), us.into());
    }
    object.insert("steps".to_string(), breakdown.steps.into());
    serde_json::Value::Object(object)
}

/// The breakdown as lines of a table: part, µs per step, share.
pub(crate) fn breakdown_lines(mode: &str, breakdown: &StepBreakdown) -> String {
    let parts = breakdown.per_step_us();
    let total: f64 = parts.iter().map(|(_, us)| us).sum();
    let mut out = format!("{mode}: where a steady step's {total:.1} µs go ({} steps)", breakdown.steps);
    for (part, us) in parts {
        let share = if total > 0.0 { 100.0 * us / total } else { 0.0 };
        out += &format!("\n  {part:<12} {us:>9.2} µs  {share:>5.1}%");
    }
    out
}
