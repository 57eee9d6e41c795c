//! Softmax with cross-entropy loss, the network's output stage.

use crate::{Error, Result};
use ndarray::{ArrayView1, ArrayView2, ArrayViewMut2, Axis, Zip};
use workspace_core::{freeze, Scope};

/// Softmax over each row of the logits, with the mean cross-entropy against integer
/// class labels as the loss. Its gradient with respect to the logits is
/// `(softmax − onehot) / batch`.
#[derive(Clone, Copy, Debug, Default)]
pub struct SoftmaxCrossEntropy;

impl SoftmaxCrossEntropy {
    /// Row-wise softmax of `logits`, allocated in `out` (numerically stable: the row
    /// maximum is subtracted first).
    ///
    /// # Errors
    ///
    /// Allocation errors of `out`.
    pub fn probabilities<'s>(&self, logits: ArrayView2<'_, f32>, out: &'s Scope<'_>) -> Result<ArrayView2<'s, f32>> {
        let mut probs = out.copy_of(&logits)?;
        for mut row in probs.axis_iter_mut(Axis(0)) {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let mut sum = 0.0f32;
            row.mapv_inplace(|v| {
                let e = (v - max).exp();
                sum += e;
                e
            });
            let inv = 1.0 / sum;
            row.mapv_inplace(|v| v * inv);
        }
        Ok(freeze(probs))
    }

    /// The mean cross-entropy of `probs` (from [`Self::probabilities`]) against
    /// `labels`.
    ///
    /// # Errors
    ///
    /// [`Error::ShapeMismatch`] when there is not one label per row;
    /// [`Error::InvalidInput`] for a label that is not a class.
    pub fn loss(&self, probs: ArrayView2<'_, f32>, labels: ArrayView1<'_, u32>) -> Result<f32> {
        self.loss_masked(probs, labels, None)
    }

    /// As [`Self::loss`], the mean over the rows whose `mask` is 1 only (rows of mask 0,
    /// padding, count for nothing and their labels are not read).
    ///
    /// # Errors
    ///
    /// As [`Self::loss`]; [`Error::InvalidInput`] when the mask selects no row.
    pub fn loss_masked(
        &self,
        probs: ArrayView2<'_, f32>,
        labels: ArrayView1<'_, u32>,
        mask: Option<ArrayView1<'_, f32>>,
    ) -> Result<f32> {
        let (total, count) = self.loss_sum(probs, labels, mask)?;
        Ok((total / some(count)? as f64) as f32)
    }

    /// The sum of the cross-entropies of the counted rows (in row order, in `f64`) and
    /// how many rows were counted (possibly none): a shard's part of a batch's loss.
    pub(crate) fn loss_sum(
        &self,
        probs: ArrayView2<'_, f32>,
        labels: ArrayView1<'_, u32>,
        mask: Option<ArrayView1<'_, f32>>,
    ) -> Result<(f64, usize)> {
        let count = check_labels(&probs, &labels, mask.as_ref())?;
        let mut total = 0.0f64;
        for (r, (row, &label)) in probs.rows().into_iter().zip(labels).enumerate() {
            if mask.as_ref().is_none_or(|m| m[r] != 0.0) {
                total -= f64::from(row[label as usize].max(1e-12)).ln();
            }
        }
        Ok((total, count))
    }

    /// Writes the gradient of the mean loss with respect to the logits into `grad`.
    ///
    /// # Errors
    ///
    /// As [`Self::loss`], and [`Error::ShapeMismatch`] when `grad` is not shaped like
    /// `probs`.
    pub fn backward(
        &self,
        probs: ArrayView2<'_, f32>,
        labels: ArrayView1<'_, u32>,
        grad: ArrayViewMut2<'_, f32>,
    ) -> Result<()> {
        self.backward_masked(probs, labels, None, grad)
    }

    /// The gradient of [`Self::loss_masked`]: 0 in the rows of mask 0.
    ///
    /// # Errors
    ///
    /// As [`Self::loss_masked`] and [`Self::backward`].
    pub fn backward_masked(
        &self,
        probs: ArrayView2<'_, f32>,
        labels: ArrayView1<'_, u32>,
        mask: Option<ArrayView1<'_, f32>>,
        grad: ArrayViewMut2<'_, f32>,
    ) -> Result<()> {
        let count = some(check_labels(&probs, &labels, mask.as_ref())?)?;
        self.backward_scaled(probs, labels, mask, 1.0 / count as f32, grad)
    }

    /// The gradient of the counted rows' cross-entropies, each scaled by `scale` (one over
    /// the whole batch's count, for a shard of it), into `grad`; 0 for rows not counted.
    pub(crate) fn backward_scaled(
        &self,
        probs: ArrayView2<'_, f32>,
        labels: ArrayView1<'_, u32>,
        mask: Option<ArrayView1<'_, f32>>,
        scale: f32,
        mut grad: ArrayViewMut2<'_, f32>,
    ) -> Result<()> {
        check_labels(&probs, &labels, mask.as_ref())?;
        if grad.dim() != probs.dim() {
            return Err(Error::ShapeMismatch {
                context: "softmax cross-entropy gradient".to_string(),
                expected: probs.shape().to_vec(),
                actual: grad.shape().to_vec(),
            });
        }
        Zip::from(&mut grad).and(&probs).for_each(|g, &p| *g = p * scale);
        for (r, (mut row, &label)) in grad.rows_mut().into_iter().zip(labels).enumerate() {
            if mask.as_ref().is_none_or(|m| m[r] != 0.0) {
                row[label as usize] -= scale;
            } else {
                row.fill(0.0);
            }
        }
        Ok(())
    }
}

/// Checks the labels (those the mask selects) and returns how many rows count.
fn check_labels(
    probs: &ArrayView2<'_, f32>,
    labels: &ArrayView1<'_, u32>,
    mask: Option<&ArrayView1<'_, f32>>,
) -> Result<usize> {
    if labels.len() != probs.nrows() {
        return Err(Error::ShapeMismatch {
            context: "labels (one per example)".to_string(),
            expected: vec![probs.nrows()],
            actual: vec![labels.len()],
        });
    }
    if let Some(mask) = mask {
        if mask.len() != probs.nrows() {
            return Err(Error::ShapeMismatch {
                context: "labels mask (one per label)".to_string(),
                expected: vec![probs.nrows()],
                actual: vec![mask.len()],
            });
        }
    }
    let classes = probs.ncols();
    let counted = |r: usize| mask.is_none_or(|m| m[r] != 0.0);
    if let Some(&bad) =
        labels.iter().enumerate().filter(|&(r, _)| counted(r)).map(|(_, l)| l).find(|&&l| l as usize >= classes)
    {
        return Err(Error::InvalidInput(format!(
            "label {bad} is not a class: the network's output has {classes} classes (0..{classes})"
        )));
    }
    Ok((0..labels.len()).filter(|&r| counted(r)).count())
}

/// `count` counted labels, refused when there are none (a mean over nothing).
fn some(count: usize) -> Result<usize> {
    if count == 0 {
        return Err(Error::InvalidInput("the labels mask selects no label: there is nothing to learn from".into()));
    }
    Ok(count)
}
