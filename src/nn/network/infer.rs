//! Inference and evaluation, in the inference workspaces.

use std::ptr::NonNull;

use async_iter::{BatchSource, Prefetcher};
use ndarray::{ArrayView2, ArrayViewMut2, Axis};
use workspace_core::backend::{ArenaBackend, Block};
use workspace_core::{ArrayType, LayerWorkspaceMgr, Scope};

use crate::{Error, Result};

use super::super::infer::{argmax, Infer};
use super::super::layer::Activations;
use super::super::loss::SoftmaxCrossEntropy;
use super::super::step::{self, StepLayers};
use super::batch::{lease_input, lease_labels, shape_key, standard_input, steps_as_rows};
use super::{check_labels, pass_bytes, Input, Labels, Network};
use super::{label, LayerLabels};

impl Network {
    /// The class probabilities of `x`, computed in the inference workspaces and
    /// handed to `f` while they are alive. Planned: the inference replays the plan of
    /// its input's shape (or is recorded).
    fn run_inference<R>(&mut self, x: Input<'_>, f: impl FnOnce(ArrayView2<'_, f32>) -> Result<R>) -> Result<R> {
        self.infer.reset_peaks();
        let result = match self.infer.plan_group().cloned() {
            None => self.forward_probabilities(x, f).map(|r| (r, None)),
            Some(group) => {
                let key = shape_key(&x, None);
                group
                    .iteration(key, || self.forward_probabilities(x, f))
                    .map(|(r, on_plan)| (r, on_plan.then(|| group.plan_bytes())))
            }
        };
        self.end_timeline_iteration();
        let (result, plan) = result?;
        self.last_inference_bytes = pass_bytes(self.infer.workspaces(), plan);
        Ok(result)
    }

    /// [`Network::run_inference`]'s forward pass.
    fn forward_probabilities<R>(
        &mut self,
        x: Input<'_>,
        f: impl FnOnce(ArrayView2<'_, f32>) -> Result<R>,
    ) -> Result<R> {
        let x = x.reborrow();
        self.check_input(&x)?;
        let Network { layers, layout, params, infer: mgr, timeline, .. } = self;
        let mut layers = StepLayers { layers, params: layout, values: params, grads: None, tapes: None, streams: None };
        probabilities(&mut layers, mgr, x, timeline.as_deref(), f)
    }
}

/// The class probabilities of `x` (checked) through `layers`, computed in `mgr`'s
/// inference workspaces and handed to `f` while they are alive: the forward pass of a
/// network's inference and of a served model's.
pub(crate) fn probabilities<R>(
    layers: &mut StepLayers<'_>,
    mgr: &LayerWorkspaceMgr,
    x: Input<'_>,
    labels: Option<&LayerLabels>,
    f: impl FnOnce(ArrayView2<'_, f32>) -> Result<R>,
) -> Result<R> {
    let x = x.reborrow();
    let mask = x.mask();
    let act = mgr.enter(ArrayType::Activations)?;
    label(labels, |l| Some(l.input));
    let x = standard_input(x, &act)?;
    let input = step::forward(layers, mgr, &act, x.activations(), mask, (false, labels), &mut 0, |_, _| Ok(()))?;
    label(labels, |l| Some(l.loss));
    // A sequence output (labels per step) gives a row per example and step.
    let logits = match input {
        Activations::Flat(logits) => logits,
        Activations::Sequence(logits) => steps_as_rows(logits)?,
    };
    let probs = SoftmaxCrossEntropy.probabilities(logits, &act)?;
    f(probs)
}

/// A network infers in its inference workspaces, on the thread that owns it.
impl Infer for Network {
    fn infer<'x, R>(&mut self, x: impl Into<Input<'x>>, f: impl FnOnce(ArrayView2<'_, f32>) -> Result<R>) -> Result<R> {
        self.run_inference(x.into(), f)
    }
}

impl Network {
    /// Class probabilities of `x`, detached into an owned array ([`Infer::output`]).
    ///
    /// # Errors
    ///
    /// Shape errors and workspace errors; [`Error::InvalidInput`] for an empty batch or
    /// a features mask that is not 0 and 1, or holds a row of no step.
    pub fn output<'x>(&mut self, x: impl Into<Input<'x>>) -> Result<ndarray::Array2<f32>> {
        Infer::output(self, x)
    }

    /// Class probabilities of `x`, written into `out` (`[rows, classes]`;
    /// [`Infer::output_into`]).
    ///
    /// # Errors
    ///
    /// Shape errors and workspace errors; [`Error::ShapeMismatch`] for `out`'s shape.
    pub fn output_into<'x>(&mut self, x: impl Into<Input<'x>>, out: ArrayViewMut2<'_, f32>) -> Result<()> {
        Infer::output_into(self, x, out)
    }

    /// Class probabilities of `x`, copied into the caller's open scope (for example
    /// a workspace the caller keeps open across several calls).
    ///
    /// # Errors
    ///
    /// Shape errors and workspace errors (of the inference workspaces and of `target`).
    pub fn output_to<'s, 'x>(
        &mut self,
        x: impl Into<Input<'x>>,
        target: &'s Scope<'_>,
    ) -> Result<ArrayViewMut2<'s, f32>> {
        self.run_inference(x.into(), |probs| Ok(target.copy_of(&probs)?))
    }

    /// Predicted classes of `x` (the most probable per row), written to `out`
    /// ([`Infer::predict_into`]).
    ///
    /// # Errors
    ///
    /// As [`Network::output`]; [`Error::ShapeMismatch`] when `out` does not hold one
    /// class per row.
    pub fn predict_into<'x>(&mut self, x: impl Into<Input<'x>>, out: &mut [u32]) -> Result<()> {
        Infer::predict_into(self, x, out)
    }

    /// Fraction of rows of `x` whose predicted class is the label, in batches of
    /// `batch_size` rows.
    ///
    /// # Errors
    ///
    /// Shape errors; [`Error::InvalidInput`] for a zero batch size, no rows, a label
    /// that is not a class (as [`Network::fit_batch`] refuses it), or labels per step
    /// whose mask selects no step (there is nothing to evaluate, as
    /// [`Network::fit_batch`] finds nothing to learn from).
    pub fn evaluate<'x, 'l>(
        &mut self,
        x: impl Into<Input<'x>>,
        labels: impl Into<Labels<'l>>,
        batch_size: usize,
    ) -> Result<f64> {
        let (x, labels) = (x.into(), labels.into());
        let x = x.reborrow();
        let labels = labels.reborrow().or_mask(x.mask());
        let rows = x.rows();
        if batch_size == 0 || rows == 0 {
            return Err(Error::InvalidInput("evaluate needs at least one row and a batch size above 0".into()));
        }
        // The batches themselves are checked as they are fed (`run_inference`).
        check_labels(&x, &labels)?;
        let (mut correct, mut total) = (0usize, 0usize);
        for start in (0..rows).step_by(batch_size) {
            let end = (start + batch_size).min(rows);
            let (c, t) = self.count_correct(x.rows_slice(start..end), labels.rows_slice(start..end))?;
            correct += c;
            total += t;
        }
        if total == 0 {
            return Err(no_labelled_step("evaluate was given", rows));
        }
        Ok(correct as f64 / total as f64)
    }

    /// Labelled rows (examples, or labelled steps) of one batch whose most probable
    /// class is the label, and how many are labelled.
    fn count_correct(&mut self, x: Input<'_>, labels: Labels<'_>) -> Result<(usize, usize)> {
        // Labels and mask in logical order (example-major, as the output's rows), in
        // whatever layout they were given, as `fit_batch` takes them; nothing allocated.
        let all = || std::iter::repeat(true);
        self.run_inference(x, |probs| match labels {
            Labels::PerExample(y) => tally(probs, y.len(), y.iter().copied(), all()),
            Labels::PerStep { labels, mask: None } => tally(probs, labels.len(), labels.iter().copied(), all()),
            Labels::PerStep { labels, mask: Some(m) } => {
                tally(probs, labels.len(), labels.iter().copied(), m.iter().map(|&v| v != 0.0))
            }
        })
    }

    /// Fraction of the examples of every remaining batch of a [`Prefetcher`]'s epoch
    /// whose predicted class is the label (features and masks as
    /// [`Network::fit`] reads them); the prefetcher is then reset for its next epoch.
    ///
    /// # Errors
    ///
    /// As [`Network::fit`]: the prefetcher's errors, shape errors, an epoch with no
    /// batches; [`Error::InvalidInput`] for an epoch whose batches have labels per step
    /// and no labelled step (every labels mask all 0; the prefetcher is reset then, as
    /// after any whole epoch).
    pub fn evaluate_batches<S, B>(&mut self, batches: &mut Prefetcher<S, B>) -> Result<f64>
    where
        S: BatchSource,
        B: ArenaBackend + 'static,
        B::Block: Block<Base = NonNull<u8>>,
    {
        let (mut correct, mut labelled, mut batch_count, mut rows) = (0usize, 0usize, 0usize, 0usize);
        while let Some(batch) = batches.next() {
            let batch = batch?;
            let x = lease_input(&batch)?;
            let y = lease_labels(&batch)?.or_mask(x.mask());
            check_labels(&x, &y)?;
            let (c, t) = self.count_correct(x.reborrow(), y)?;
            correct += c;
            labelled += t;
            batch_count += 1;
            rows += x.rows();
        }
        if batch_count == 0 {
            return Err(Error::InvalidInput(format!(
                "evaluate_batches was given an epoch with no batches (epoch {} of the prefetcher had ended)",
                batches.epoch()
            )));
        }
        batches.reset()?;
        if labelled == 0 {
            return Err(no_labelled_step(&format!("evaluate_batches was given {batch_count} batches with"), rows));
        }
        Ok(correct as f64 / labelled as f64)
    }
}

/// The error for batches of `rows` examples whose labels mask selects no step.
fn no_labelled_step(given: &str, rows: usize) -> Error {
    Error::InvalidInput(format!(
        "{given} {rows} sequences and no labelled step (the labels mask is 0 at every step): there is nothing to \
         evaluate; give labels at least one step with mask 1"
    ))
}

/// Of `probs`' rows, those `counted` says, whose most probable class is their label, and
/// how many were counted (`count` labels, one per row).
///
/// # Errors
///
/// [`Error::ShapeMismatch`] for labels that are not one per row; [`Error::InvalidInput`]
/// for a counted label that is not a class (an accuracy would hide it).
fn tally(
    probs: ArrayView2<'_, f32>,
    count: usize,
    labels: impl Iterator<Item = u32>,
    counted: impl Iterator<Item = bool>,
) -> Result<(usize, usize)> {
    if probs.nrows() != count {
        return Err(Error::ShapeMismatch {
            context: "labels (one per row of the network's output)".into(),
            expected: vec![probs.nrows()],
            actual: vec![count],
        });
    }
    let classes = probs.ncols();
    let (mut correct, mut total) = (0, 0);
    for ((row, y), counted) in probs.axis_iter(Axis(0)).zip(labels).zip(counted) {
        if !counted {
            continue;
        }
        if y as usize >= classes {
            return Err(Error::InvalidInput(format!(
                "label {y} is not a class: the network's output has {classes} classes (0..{classes})"
            )));
        }
        total += 1;
        correct += usize::from(argmax(row) == y);
    }
    Ok((correct, total))
}
