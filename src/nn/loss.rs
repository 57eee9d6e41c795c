//! Softmax with cross-entropy loss, the network's output stage.

use crate::{Error, Result};
use ndarray::{ArrayView1, ArrayView2, ArrayViewMut2, Axis, Zip};
use workspace_core::{freeze, Scope};

use super::kernels::running;

/// Softmax over each row of the logits, with the mean cross-entropy against integer
/// class labels as the loss. Its gradient with respect to the logits is
/// `(softmax − onehot) / batch`.
///
/// Each row's loss is `−ln p` of its label's probability, with `p` at least `1e-12`
/// (as DL4J clips its softmax output): a row whose label is more than about 27.6 below
/// the row's log-sum-exp counts 27.63, where PyTorch's `cross_entropy` (exact
/// log-softmax) counts more. The gradient is not clipped.
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
        if running() {
            // A dry run: allocated, nothing computed.
            return Ok(freeze(probs));
        }
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
        check_gradient(&probs, &grad)?;
        if running() {
            return Ok(());
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

impl SoftmaxCrossEntropy {
    /// Softmax, the mean cross-entropy over the rows `mask` counts and its gradient
    /// with respect to the logits, in one pass over each row: the gradient is written
    /// into `grad` (0 in rows not counted) and the loss returned. The same arithmetic,
    /// in the same order, as [`Self::probabilities`], [`Self::loss_masked`] and
    /// [`Self::backward_masked`] one after the other, so the same bits, without the
    /// probabilities' array.
    ///
    /// # Errors
    ///
    /// As [`Self::backward_masked`].
    #[cfg(test)]
    pub(crate) fn loss_and_gradient(
        &self,
        logits: ArrayView2<'_, f32>,
        labels: ArrayView1<'_, u32>,
        mask: Option<ArrayView1<'_, f32>>,
        grad: ArrayViewMut2<'_, f32>,
    ) -> Result<f32> {
        let count = some(check_labels(&logits, &labels, mask.as_ref())?)?;
        let total = self.loss_sum_and_gradient(logits, labels, mask, 1.0 / count as f32, grad)?;
        Ok((total / count as f64) as f32)
    }

    /// Softmax, the sum of the cross-entropies of the rows `mask` counts (in row order,
    /// in `f64`) and their gradient with respect to the logits, each scaled by `scale`
    /// (one over the labels the whole batch counts, of which these rows may be a shard),
    /// in one pass over each row: the gradient is written into `grad` (0 in rows not
    /// counted) and the sum returned. The arithmetic of [`Self::probabilities`],
    /// [`Self::loss_sum`] and [`Self::backward_scaled`] one after the other, in the same
    /// order, so the same bits, without the probabilities' array. Every training step
    /// (a network's, a data-parallel worker's shard) takes its loss from here.
    ///
    /// # Errors
    ///
    /// As [`Self::backward_scaled`].
    pub(crate) fn loss_sum_and_gradient(
        &self,
        logits: ArrayView2<'_, f32>,
        labels: ArrayView1<'_, u32>,
        mask: Option<ArrayView1<'_, f32>>,
        scale: f32,
        mut grad: ArrayViewMut2<'_, f32>,
    ) -> Result<f64> {
        check_labels(&logits, &labels, mask.as_ref())?;
        check_gradient(&logits, &grad)?;
        // A dry run: checked, nothing computed (the gradient stays as allocated).
        if running() {
            return Ok(0.0);
        }
        let mut total = 0.0f64;
        for (r, (row, mut g)) in logits.rows().into_iter().zip(grad.rows_mut()).enumerate() {
            if mask.as_ref().is_some_and(|m| m[r] == 0.0) {
                g.fill(0.0);
                continue;
            }
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let mut sum = 0.0f32;
            Zip::from(&mut g).and(&row).for_each(|g, &v| {
                let e = (v - max).exp();
                sum += e;
                *g = e;
            });
            let inv = 1.0 / sum;
            g.mapv_inplace(|e| e * inv);
            let label = labels[r] as usize;
            total -= f64::from(g[label].max(1e-12)).ln();
            g.mapv_inplace(|p| p * scale);
            g[label] -= scale;
        }
        Ok(total)
    }
}

/// Checks that the gradient `grad` is shaped like the logits (or probabilities) `like`.
fn check_gradient(like: &ArrayView2<'_, f32>, grad: &ArrayViewMut2<'_, f32>) -> Result<()> {
    if grad.dim() != like.dim() {
        return Err(Error::ShapeMismatch {
            context: "softmax cross-entropy gradient".to_string(),
            expected: like.shape().to_vec(),
            actual: grad.shape().to_vec(),
        });
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{Array1, Array2};
    use workspace_core::{Workspace, WorkspaceConfig};

    /// The one-pass loss and gradient against softmax, the loss and its gradient one
    /// after the other: the same bits, with and without a mask, for ordinary, large,
    /// tied and extreme logits.
    #[test]
    fn one_pass_gives_the_bits_of_the_three_passes() {
        let ws = Workspace::new("LOSS", WorkspaceConfig::default()).unwrap();
        let loss = SoftmaxCrossEntropy;
        for (rows, classes) in [(1, 2), (32, 10), (7, 33), (64, 3)] {
            for kind in 0..4 {
                let logits = Array2::from_shape_fn((rows, classes), |(r, c)| {
                    let x = ((r * 37 + c * 11) % 23) as f32 / 7.0 - 1.5;
                    match kind {
                        0 => x,
                        1 => x * 1e3,        // softmax saturates: probabilities of 0 and 1
                        2 => (c % 2) as f32, // ties
                        _ => {
                            if c == 0 {
                                -f32::MAX
                            } else {
                                x * 40.0
                            }
                        }
                    }
                });
                let labels = Array1::from_shape_fn(rows, |r| ((r * 3 + kind) % classes) as u32);
                let mask = Array1::from_shape_fn(rows, |r| if r % 3 == 1 { 0.0 } else { 1.0 });
                for mask in [None, Some(mask.view())] {
                    if mask.is_some_and(|m| m.sum() == 0.0) {
                        continue;
                    }
                    let scope = ws.enter().unwrap();
                    let probs = loss.probabilities(logits.view(), &scope).unwrap();
                    let expected = loss.loss_masked(probs, labels.view(), mask).unwrap();
                    let mut expected_grad = Array2::from_elem((rows, classes), f32::NAN);
                    loss.backward_masked(probs, labels.view(), mask, expected_grad.view_mut()).unwrap();
                    let mut grad = Array2::from_elem((rows, classes), f32::NAN);
                    let got = loss.loss_and_gradient(logits.view(), labels.view(), mask, grad.view_mut()).unwrap();
                    let context = format!("{rows}x{classes}, kind {kind}, mask {}", mask.is_some());
                    assert_eq!(got.to_bits(), expected.to_bits(), "{context}");
                    let bits = |a: &Array2<f32>| a.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&grad), bits(&expected_grad), "{context}");
                }
            }
        }
        // The errors of the three passes: a label that is not a class, a mask that
        // selects nothing, a gradient of another shape.
        let logits = Array2::<f32>::zeros((2, 3));
        let mut grad = Array2::<f32>::zeros((2, 3));
        let bad = Array1::from(vec![0u32, 3]);
        assert!(matches!(
            loss.loss_and_gradient(logits.view(), bad.view(), None, grad.view_mut()),
            Err(Error::InvalidInput(_))
        ));
        let labels = Array1::from(vec![0u32, 1]);
        let none = Array1::from(vec![0.0f32, 0.0]);
        let err = loss.loss_and_gradient(logits.view(), labels.view(), Some(none.view()), grad.view_mut());
        assert!(matches!(err, Err(Error::InvalidInput(_))));
        let mut small = Array2::<f32>::zeros((2, 2));
        let err = loss.loss_and_gradient(logits.view(), labels.view(), None, small.view_mut());
        assert!(matches!(err, Err(Error::ShapeMismatch { .. })));
    }
}
