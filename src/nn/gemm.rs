//! Matrix multiply (placeholder: naive loops until the blocked kernel lands).

use std::mem::MaybeUninit;

/// Scratch elements `sgemm` needs for an m×k·k×n product.
pub fn scratch_len(_m: usize, _n: usize, _k: usize) -> usize {
    1
}

/// `C = alpha·A·B + beta·C`.
///
/// # Panics
///
/// On mismatched shapes.
pub fn sgemm(
    alpha: f32,
    a: ndarray::ArrayView2<'_, f32>,
    b: ndarray::ArrayView2<'_, f32>,
    beta: f32,
    mut c: ndarray::ArrayViewMut2<'_, f32>,
    _scratch: &mut [MaybeUninit<f32>],
) {
    let (m, k) = a.dim();
    let n = b.ncols();
    assert_eq!(b.nrows(), k);
    assert_eq!(c.dim(), (m, n));
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f32;
            for p in 0..k {
                acc += a[[i, p]] * b[[p, j]];
            }
            c[[i, j]] = if beta == 0.0 { alpha * acc } else { alpha * acc + beta * c[[i, j]] };
        }
    }
}
