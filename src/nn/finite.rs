//! Finding values that are not finite (NaN or ±infinity) in a training step.
//!
//! A NaN does not announce itself: ReLU maps it to 0, a maximum skips it and the loss
//! clamps it, so one bad batch can turn every weight into NaN while the reported loss
//! stays finite. The network therefore looks at the input, every layer's output and
//! gradients, the loss and what the updater would store, and refuses the step at the
//! first value that is not finite. The scans allocate nothing (an error's message is
//! built only when there is one) and change no number.

use crate::Error;
use ndarray::{ArrayView, ArrayView2, Axis, Dimension, Slice};

use super::layer::Activations;

/// `a` with every axis along which it repeats one value (stride 0, as `broadcast`
/// makes) cut to its first index: the same values, each once. A scan of a view costs
/// what its memory holds, not what its shape claims (a `[1, 2^40, 3]` broadcast of one
/// value is one element).
pub(crate) fn distinct<'a, A, D: Dimension>(mut a: ArrayView<'a, A, D>) -> ArrayView<'a, A, D> {
    for axis in 0..a.ndim() {
        if a.strides()[axis] == 0 && a.len_of(Axis(axis)) > 1 {
            a.slice_axis_inplace(Axis(axis), Slice::from(0..1));
        }
    }
    a
}

use super::kernels::running;
use super::simd::all_finite;

/// The first value of `values` that is not finite: its index and the value (none in a
/// dry run, which checks nothing: see [`running`]).
pub(crate) fn first_in_slice(values: &[f32]) -> Option<(usize, f32)> {
    if running() || all_finite(values) {
        return None;
    }
    values.iter().copied().enumerate().find(|(_, v)| !v.is_finite())
}

/// The first element of `a` (in row-major order) that is not finite: its row, column
/// and value.
pub(crate) fn first_in_matrix(a: ArrayView2<'_, f32>) -> Option<(usize, usize, f32)> {
    // A repeated value is found at its first index.
    let a = distinct(a);
    let clean = match a.as_slice_memory_order() {
        Some(values) => all_finite(values),
        None => a.rows().into_iter().all(|row| match row.as_slice() {
            Some(values) => all_finite(values),
            None => row.iter().all(|v| v.is_finite()),
        }),
    };
    if clean {
        return None;
    }
    a.indexed_iter().find(|(_, v)| !v.is_finite()).map(|((r, c), &v)| (r, c, v))
}

/// The error for a non-finite value at `layer`.
pub(crate) fn error(layer: &str, what: String) -> Error {
    Error::NonFinite { layer: layer.to_string(), what }
}

/// Checks a matrix that belongs to `layer`; `what` describes it ("its output"), the
/// message adds where and what the first bad value is.
pub(crate) fn check_matrix(layer: &str, what: &str, a: ArrayView2<'_, f32>) -> Result<(), Error> {
    match first_in_matrix(a) {
        None => Ok(()),
        Some((r, c, v)) => Err(error(layer, format!("{what} (row {r}, column {c}) is {v}"))),
    }
}

/// As [`check_matrix`], for a flat batch or a batch of sequences (whose elements are
/// named by sequence, step and column). With a `mask` (`[batch, time]`, 0 where a step
/// is padding), padded steps are not checked: nothing uses them.
pub(crate) fn check_activations(
    layer: &str,
    what: &str,
    a: Activations<'_>,
    mask: Option<ArrayView2<'_, f32>>,
) -> Result<(), Error> {
    let _span = super::profile::span(super::profile::Part::Checks);
    // A dry run checks nothing (see `running`).
    if running() {
        return Ok(());
    }
    match a {
        Activations::Flat(a) => check_matrix(layer, what, a),
        Activations::Sequence(a) => {
            // Every value finite, padded steps' included: nothing to find, checked at
            // once (split across the thread's pool when it has one).
            if a.as_slice_memory_order().is_some_and(all_finite) {
                return Ok(());
            }
            let found = |r: usize, t: usize, c: usize, v: f32| {
                Err(error(layer, format!("{what} (sequence {r}, step {t}, column {c}) is {v}")))
            };
            let mask = mask.filter(|m| m.dim() == (a.shape()[0], a.shape()[1]));
            // Sequences that repeat one another (a broadcast batch) are checked once,
            // unless the mask tells them apart.
            let mut a = a;
            if a.strides()[0] == 0 && mask.is_none_or(|m| m.strides()[0] == 0) {
                a.slice_axis_inplace(Axis(0), Slice::from(0..1));
            }
            for (r, sequence) in a.outer_iter().enumerate() {
                let live = mask.as_ref().map(|m| m.row(r));
                if live.is_none_or(|steps| distinct(steps).iter().all(|&v| v != 0.0)) {
                    if let Some((t, c, v)) = first_in_matrix(sequence) {
                        return found(r, t, c, v);
                    }
                    continue;
                }
                for (t, step) in sequence.outer_iter().enumerate() {
                    if live.is_some_and(|steps| steps[t] == 0.0) {
                        continue;
                    }
                    if let Some((_, c, v)) = first_in_matrix(step.insert_axis(Axis(0))) {
                        return found(r, t, c, v);
                    }
                }
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{s, Array2};

    #[test]
    fn finds_the_first_non_finite_value_in_any_layout() {
        let mut a = Array2::<f32>::from_shape_fn((5, 70), |(r, c)| (r * 70 + c) as f32);
        assert_eq!(first_in_matrix(a.view()), None);
        assert_eq!(first_in_matrix(a.t()), None);
        a[[3, 66]] = f32::NAN;
        a[[4, 1]] = f32::INFINITY;
        assert!(matches!(first_in_matrix(a.view()), Some((3, 66, v)) if v.is_nan()));
        assert_eq!(first_in_matrix(a.slice(s![.., ..60])), Some((4, 1, f32::INFINITY)));
        assert_eq!(first_in_matrix(a.slice(s![..3, ..])), None);
        assert!(matches!(first_in_matrix(a.t()), Some((1, 4, f32::INFINITY))));
        assert!(matches!(first_in_matrix(a.slice(s![.., ..;2])), Some((3, 33, v)) if v.is_nan()));
        assert_eq!(first_in_slice(&[1.0, f32::MAX, -f32::MAX]), None);
        assert_eq!(first_in_slice(&[1.0, 2.0, f32::NEG_INFINITY]), Some((2, f32::NEG_INFINITY)));
    }

    #[test]
    fn a_broadcast_view_is_scanned_once_per_value() {
        let one = ndarray::arr1(&[1.0f32, f32::NAN, 2.0]);
        // 2^40 rows of one row: found at once, at the first row.
        let huge = one.broadcast((1usize << 40, 3)).unwrap();
        assert!(matches!(first_in_matrix(huge), Some((0, 1, v)) if v.is_nan()));
        let sequences = one.broadcast((1, 1usize << 40, 3)).unwrap();
        let err = check_activations("input", "the batch", Activations::Sequence(sequences), None).unwrap_err();
        assert!(err.to_string().contains("sequence 0, step 0, column 1"), "{err}");
    }

    #[test]
    fn padded_steps_are_not_checked() {
        let mut a = ndarray::Array3::<f32>::zeros((2, 3, 2));
        a[[1, 2, 0]] = f32::INFINITY; // padding
        let mut mask = Array2::<f32>::ones((2, 3));
        mask[[1, 2]] = 0.0;
        let seq = Activations::Sequence(a.view());
        assert!(check_activations("l", "its output", seq, Some(mask.view())).is_ok());
        assert!(check_activations("l", "its output", seq, None).is_err());
        a[[1, 1, 1]] = f32::NAN; // a live step
        let err = check_activations("l", "its output", Activations::Sequence(a.view()), Some(mask.view())).unwrap_err();
        assert!(err.to_string().contains("sequence 1, step 1, column 1"), "{err}");
    }
}
