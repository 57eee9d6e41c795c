//! Inference as one trait: whatever computes class probabilities (a [`Network`], a
//! frozen [`Model`], an [`InferencePool`] or one of its leases) does it through
//! [`Infer::infer`], and the ways to take its result (an owned array, the caller's
//! buffer, the most probable classes) are written once, here.
//!
//! [`Network`]: super::Network
//! [`Model`]: super::serve::Model
//! [`InferencePool`]: super::serve::InferencePool

use ndarray::{Array2, ArrayView1, ArrayView2, ArrayViewMut2, Axis};

use super::network::Input;
use crate::{Error, Result};

/// Computes class probabilities: implemented by [`Network`](super::Network) (in its
/// inference workspaces), [`Model`](super::serve::Model) and `&Model` (in the calling thread's
/// serving workspaces), [`InferencePool`](super::serve::InferencePool) and `&InferencePool` (in
/// a leased arena, or a batch), and [`PoolLease`](super::serve::PoolLease) (in its arena).
///
/// The methods take `&mut self`, as a network's inference does; the shared forms are
/// implemented for shared references too (as `std::io::Read` is for `&File`), so that a
/// model or a pool shared by [`Arc`](std::sync::Arc) serves generic code from any thread.
/// `Model`, `InferencePool` and `Network` also have these methods of their own, so that
/// calling them needs no import of this trait.
///
/// ```
/// use std::sync::Arc;
/// use carve::nn::{Infer, serve::InferencePool, Network, NetworkConfig, serve::PoolConfig};
/// use carve::ndarray::Array2;
///
/// /// The most probable class of each row, from anything that infers.
/// fn classify(engine: &mut impl Infer, x: &Array2<f32>) -> carve::Result<Vec<u32>> {
///     let mut classes = vec![0; x.nrows()];
///     engine.predict_into(x.view(), &mut classes)?;
///     Ok(classes)
/// }
///
/// let mut net = Network::new(NetworkConfig::builder(4).dense(8).relu().dense(3).seed(5).build()?)?;
/// let x = Array2::from_shape_fn((6, 4), |(r, c)| (r * 4 + c) as f32 / 24.0);
/// let model = Arc::new(net.freeze()?);
/// let pool = InferencePool::new(Arc::clone(&model), PoolConfig::direct(2))?;
/// let expected = classify(&mut net, &x)?;
/// assert_eq!(classify(&mut &*model, &x)?, expected);
/// assert_eq!(classify(&mut &pool, &x)?, expected);
/// assert_eq!(classify(&mut pool.lease()?, &x)?, expected);
/// # Ok::<(), carve::Error>(())
/// ```
pub trait Infer {
    /// Hands the class probabilities of `x` (one row per example, or per example and
    /// step for a sequence model without a head) to `f` while they are alive, and
    /// returns what `f` returns.
    ///
    /// # Errors
    ///
    /// Shape errors; [`Error::NonFinite`] naming the input for a NaN or infinite value
    /// (a frozen model and a pool); [`Error::InvalidInput`] for an empty batch;
    /// [`Error::Panicked`] when a layer panics (a frozen model and a pool); workspace
    /// errors; a pool's errors ([`Error::PoolClosed`]); `f`'s.
    fn infer<'x, R>(&mut self, x: impl Into<Input<'x>>, f: impl FnOnce(ArrayView2<'_, f32>) -> Result<R>) -> Result<R>;

    /// Class probabilities of `x`, in an owned array.
    ///
    /// # Errors
    ///
    /// As [`Infer::infer`].
    fn output<'x>(&mut self, x: impl Into<Input<'x>>) -> Result<Array2<f32>> {
        self.infer(x, |probs| Ok(probs.to_owned()))
    }

    /// Class probabilities of `x`, written into `out` (`[rows, classes]`): no heap
    /// allocation once the workspaces have a plan for the shape (a frozen model and a
    /// pool; a network whose inference is planned).
    ///
    /// # Errors
    ///
    /// As [`Infer::infer`]; [`Error::ShapeMismatch`] when `out` has the wrong shape.
    fn output_into<'x>(&mut self, x: impl Into<Input<'x>>, out: ArrayViewMut2<'_, f32>) -> Result<()> {
        self.infer(x, |probs| copy_into(probs, out))
    }

    /// The most probable class of each row of `x` (the first on ties), written to `out`.
    ///
    /// # Errors
    ///
    /// As [`Infer::infer`]; [`Error::ShapeMismatch`] when `out` has the wrong length.
    fn predict_into<'x>(&mut self, x: impl Into<Input<'x>>, out: &mut [u32]) -> Result<()> {
        self.infer(x, |probs| predictions_into(probs, out))
    }
}

/// Copies `probs` into `out`, of the same shape: [`Infer::output_into`]'s result.
pub(crate) fn copy_into(probs: ArrayView2<'_, f32>, mut out: ArrayViewMut2<'_, f32>) -> Result<()> {
    if out.dim() != probs.dim() {
        return Err(Error::ShapeMismatch {
            context: "output buffer ([rows, classes]: one row per example, or per example and step for a model \
                      without a sequence head)"
                .into(),
            expected: probs.shape().to_vec(),
            actual: out.shape().to_vec(),
        });
    }
    out.assign(&probs);
    Ok(())
}

/// The most probable class of each row of `probs`, written to `out` (one per row):
/// [`Infer::predict_into`]'s result.
pub(crate) fn predictions_into(probs: ArrayView2<'_, f32>, out: &mut [u32]) -> Result<()> {
    if probs.nrows() != out.len() {
        return Err(Error::ShapeMismatch {
            context: "prediction buffer (one per row of the network's output: per example and step for a network \
                      without a head)"
                .to_string(),
            expected: vec![probs.nrows()],
            actual: vec![out.len()],
        });
    }
    for (slot, row) in out.iter_mut().zip(probs.axis_iter(Axis(0))) {
        *slot = argmax(row);
    }
    Ok(())
}

/// Index of the largest value (the first on ties).
pub(crate) fn argmax(row: ArrayView1<'_, f32>) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}
