//! Inference and evaluation, in the inference workspaces.

use ndarray::{ArrayView1, ArrayView2, ArrayViewMut2, Axis};
use workspace_core::{ArrayType, Scope};

use crate::{Error, Result};

use super::super::layer::ForwardCtx;
use super::{check_label_count, Network};

impl Network {
    /// The class probabilities of `x`, computed in the inference workspaces and
    /// handed to `f` while they are alive.
    fn infer<R>(&mut self, x: ArrayView2<'_, f32>, f: impl FnOnce(ArrayView2<'_, f32>) -> Result<R>) -> Result<R> {
        self.check_batch(&x, None)?;
        let Network { layers, loss, infer: mgr, .. } = self;
        let act = mgr.enter(ArrayType::Activations)?;
        let mut input = x.view();
        for layer in layers.iter_mut() {
            let working = mgr.enter(ArrayType::FfWorkingMem)?;
            let ctx = ForwardCtx { activations: &act, working: &working, mgr, training: false };
            let y = layer.forward(input, &ctx)?;
            mgr.validate(ArrayType::Activations, layer.name(), &y)?;
            input = y;
        }
        let probs = loss.probabilities(input, &act)?;
        f(probs)
    }

    /// Class probabilities of `x`, detached into an owned array.
    ///
    /// # Errors
    ///
    /// Shape errors and workspace errors.
    pub fn output(&mut self, x: ArrayView2<'_, f32>) -> Result<ndarray::Array2<f32>> {
        self.infer(x, |probs| Ok(probs.to_owned()))
    }

    /// Class probabilities of `x`, copied into the caller's open scope (for example
    /// a workspace the caller keeps open across several calls).
    ///
    /// # Errors
    ///
    /// Shape errors and workspace errors (of the inference workspaces and of `target`).
    pub fn output_to<'s>(&mut self, x: ArrayView2<'_, f32>, target: &'s Scope<'_>) -> Result<ArrayViewMut2<'s, f32>> {
        self.infer(x, |probs| Ok(target.copy_of(&probs)?))
    }

    /// Predicted classes of `x` (the most probable per row), written to `out`.
    ///
    /// # Errors
    ///
    /// Shape errors and workspace errors.
    pub fn predict_into(&mut self, x: ArrayView2<'_, f32>, out: &mut [u32]) -> Result<()> {
        if out.len() != x.nrows() {
            return Err(Error::ShapeMismatch {
                context: "prediction buffer (one per input row)".to_string(),
                expected: vec![x.nrows()],
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
    pub fn evaluate(&mut self, x: ArrayView2<'_, f32>, labels: ArrayView1<'_, u32>, batch_size: usize) -> Result<f64> {
        if batch_size == 0 || x.nrows() == 0 {
            return Err(Error::InvalidInput("evaluate needs at least one row and a batch size above 0".into()));
        }
        check_label_count(&x, &labels)?;
        let mut correct = 0usize;
        for (xb, yb) in x.axis_chunks_iter(Axis(0), batch_size).zip(labels.axis_chunks_iter(Axis(0), batch_size)) {
            correct += self.infer(xb, |probs| {
                Ok(probs.axis_iter(Axis(0)).zip(yb.iter()).filter(|(row, &y)| argmax(row.view()) == y).count())
            })?;
        }
        Ok(correct as f64 / x.nrows() as f64)
    }
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
