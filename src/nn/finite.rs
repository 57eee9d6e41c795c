//! Finding values that are not finite (NaN or ±infinity) in a training step.
//!
//! A NaN does not announce itself: ReLU maps it to 0, a maximum skips it and the loss
//! clamps it, so one bad batch can turn every weight into NaN while the reported loss
//! stays finite. The network therefore looks at the input, every layer's output and
//! gradients, the loss and what the updater would store, and refuses the step at the
//! first value that is not finite. The scans allocate nothing (an error's message is
//! built only when there is one) and change no number.

use crate::Error;
use ndarray::ArrayView2;

use super::layer::Activations;

/// Whether every value of `values` is finite. Branch-free within chunks, so that it
/// vectorises; stops at the first chunk that holds a non-finite value.
fn all_finite(values: &[f32]) -> bool {
    values.chunks(64).all(|chunk| chunk.iter().fold(true, |ok, v| ok & v.is_finite()))
}

/// The first value of `values` that is not finite: its index and the value.
pub(crate) fn first_in_slice(values: &[f32]) -> Option<(usize, f32)> {
    if all_finite(values) {
        return None;
    }
    values.iter().copied().enumerate().find(|(_, v)| !v.is_finite())
}

/// The first element of `a` (in row-major order) that is not finite: its row, column
/// and value.
pub(crate) fn first_in_matrix(a: ArrayView2<'_, f32>) -> Option<(usize, usize, f32)> {
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
/// named by sequence, step and column).
pub(crate) fn check_activations(layer: &str, what: &str, a: Activations<'_>) -> Result<(), Error> {
    match a {
        Activations::Flat(a) => check_matrix(layer, what, a),
        Activations::Sequence(a) => {
            for (r, sequence) in a.outer_iter().enumerate() {
                if let Some((t, c, v)) = first_in_matrix(sequence) {
                    return Err(error(layer, format!("{what} (sequence {r}, step {t}, column {c}) is {v}")));
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
}
