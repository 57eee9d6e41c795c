//! Inference and evaluation, in the inference workspaces.

use std::ptr::NonNull;

use async_iter::{BatchSource, Prefetcher};
use ndarray::{ArrayView1, ArrayView2, ArrayViewMut2, Axis, Ix1};
use workspace_core::{ArenaBackend, ArrayType, Block, Scope};

use crate::{Error, Result};

use super::super::layer::{Activations, ForwardCtx};
use super::train::{lease_input, validate, NO_HEAD};
use super::{check_label_count, Input, Network};

impl Network {
    /// The class probabilities of `x`, computed in the inference workspaces and
    /// handed to `f` while they are alive.
    fn infer<R>(&mut self, x: Input<'_>, f: impl FnOnce(ArrayView2<'_, f32>) -> Result<R>) -> Result<R> {
        let x = x.reborrow();
        self.check_batch(&x, None)?;
        let mask = x.mask();
        let Network { layers, loss, infer: mgr, .. } = self;
        let act = mgr.enter(ArrayType::Activations)?;
        let mut input = x.activations();
        for layer in layers.iter_mut() {
            let working = mgr.enter(ArrayType::FfWorkingMem)?;
            let ctx = ForwardCtx { activations: &act, working: &working, mgr, training: false };
            let y = match input {
                Activations::Flat(v) => Activations::Flat(layer.forward(v, &ctx)?),
                Activations::Sequence(v) => layer.forward_sequence(v, mask, &ctx)?,
            };
            validate(mgr, layer.name(), y)?;
            input = y;
        }
        let probs = loss.probabilities(input.flat(NO_HEAD)?, &act)?;
        f(probs)
    }

    /// Class probabilities of `x`, detached into an owned array.
    ///
    /// # Errors
    ///
    /// Shape errors and workspace errors.
    pub fn output<'x>(&mut self, x: impl Into<Input<'x>>) -> Result<ndarray::Array2<f32>> {
        self.infer(x.into(), |probs| Ok(probs.to_owned()))
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
        self.infer(x.into(), |probs| Ok(target.copy_of(&probs)?))
    }

    /// Predicted classes of `x` (the most probable per row), written to `out`.
    ///
    /// # Errors
    ///
    /// Shape errors and workspace errors.
    pub fn predict_into<'x>(&mut self, x: impl Into<Input<'x>>, out: &mut [u32]) -> Result<()> {
        let x = x.into();
        if out.len() != x.rows() {
            return Err(Error::ShapeMismatch {
                context: "prediction buffer (one per input row)".to_string(),
                expected: vec![x.rows()],
                actual: vec![out.len()],
            });
        }
        self.infer(x, |probs| {
            for (slot, row) in out.iter_mut().zip(probs.axis_iter(Axis(0))) {
                *slot = argmax(row);
            }
            Ok(())
        })
    }

    /// Fraction of rows of `x` whose predicted class is the label, in batches of
    /// `batch_size` rows.
    ///
    /// # Errors
    ///
    /// Shape errors; [`Error::InvalidInput`] for a zero batch size or no rows.
    pub fn evaluate<'x>(
        &mut self,
        x: impl Into<Input<'x>>,
        labels: ArrayView1<'_, u32>,
        batch_size: usize,
    ) -> Result<f64> {
        let x = x.into();
        let rows = x.rows();
        if batch_size == 0 || rows == 0 {
            return Err(Error::InvalidInput("evaluate needs at least one row and a batch size above 0".into()));
        }
        check_label_count(rows, &labels)?;
        let mut correct = 0usize;
        for start in (0..rows).step_by(batch_size) {
            let end = (start + batch_size).min(rows);
            let yb = labels.slice(ndarray::s![start..end]);
            correct += self.infer(x.rows_slice(start..end), |probs| Ok(count_correct(probs, yb)))?;
        }
        Ok(correct as f64 / rows as f64)
    }

    /// Fraction of the examples of every remaining batch of a [`Prefetcher`]'s epoch
    /// whose predicted class is the label (features and masks as
    /// [`Network::fit`] reads them); the prefetcher is then reset for its next epoch.
    ///
    /// # Errors
    ///
    /// As [`Network::fit`]: the prefetcher's errors, shape errors, an epoch with no
    /// batches.
    pub fn evaluate_batches<S, B>(&mut self, batches: &mut Prefetcher<S, B>) -> Result<f64>
    where
        S: BatchSource,
        B: ArenaBackend + 'static,
        B::Block: Block<Base = NonNull<u8>>,
    {
        let (mut correct, mut rows) = (0usize, 0usize);
        while let Some(batch) = batches.next() {
            let batch = batch?;
            let x = lease_input(&batch)?;
            let y = batch.labels::<u32, Ix1>()?;
            check_label_count(x.rows(), &y)?;
            correct += self.infer(x, |probs| Ok(count_correct(probs, y)))?;
            rows += x.rows();
        }
        if rows == 0 {
            return Err(Error::InvalidInput(format!(
                "evaluate_batches was given an epoch with no batches (epoch {} of the prefetcher had ended)",
                batches.epoch()
            )));
        }
        batches.reset()?;
        Ok(correct as f64 / rows as f64)
    }
}

/// Rows of `probs` whose most probable class is the label.
fn count_correct(probs: ArrayView2<'_, f32>, labels: ArrayView1<'_, u32>) -> usize {
    probs.axis_iter(Axis(0)).zip(labels.iter()).filter(|(row, &y)| argmax(row.view()) == y).count()
}

/// Index of the largest value (the first on ties).
fn argmax(row: ArrayView1<'_, f32>) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}
