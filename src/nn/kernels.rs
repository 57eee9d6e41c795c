//! Where a pass's arithmetic is issued, and the one place a dry run turns it off.
//!
//! A dry run ([`Network::dry_run`](crate::nn::Network::dry_run)) runs the real passes
//! in shape-only workspaces: every allocation and scope as a real pass makes them, and
//! no arithmetic. The decision is made here, where arithmetic is issued, and nowhere
//! else: [`sgemm`](crate::nn::gemm::sgemm), the elementwise kernels below (a dense
//! layer's bias gradient, the LSTM cell, GELU, layer normalisation), the loss and the
//! finite checks each ask
//! [`running`] and return at once while a dry run runs on the thread. A layer's own code
//! allocates and moves data as in a real pass, on the zeros of the dry batch, and asks
//! nothing (cubecl-runtime's dry-run mode works the same way: kernels are not launched,
//! everything else runs).
//!
//! The flag belongs to the thread that runs the dry run: a dry run's passes run on the
//! calling thread, and the matrix multiply asks before it hands work to its helpers.

use std::cell::Cell;

use ndarray::{ArrayView1, ArrayView2, ArrayViewMut, ArrayViewMut1, ArrayViewMut2, Dimension, Zip};

use super::gelu::GeluForm;
use super::vector;

thread_local! {
    /// Whether a dry run runs on this thread.
    static DRY: Cell<bool> = const { Cell::new(false) };
}

/// Whether a dry run ([`Network::dry_run`](crate::nn::Network::dry_run)) is running on
/// the calling thread. carve's kernels (the matrix multiply, the elementwise kernels of
/// its layers, the loss, the finite checks) issue no arithmetic while it is; a custom
/// layer's own loops run on the zeros of the dry batch unless they ask this.
///
/// ```
/// use carve::nn::{dry::{running, BatchShape, DryPass}, Network, NetworkConfig};
///
/// assert!(!running());
/// let mut net = Network::new(NetworkConfig::builder(4).dense(3).build()?)?;
/// net.dry_run(&[DryPass::Train(BatchShape::flat(2))])?;
/// assert!(!running()); // only while the dry run's passes run
/// # Ok::<(), carve::Error>(())
/// ```
pub fn running() -> bool {
    DRY.with(Cell::get)
}

/// Runs `f` as a dry run's passes: [`running`] says so on this thread until `f` returns
/// or unwinds, then says what it said before.
pub(crate) fn dry_run<R>(f: impl FnOnce() -> R) -> R {
    /// Puts the flag back, on return and on unwinding alike.
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            DRY.with(|d| d.set(self.0));
        }
    }
    let _restore = Restore(DRY.with(|d| d.replace(true)));
    f()
}

/// Sets every element of `a` to `value`.
pub(crate) fn fill<D: Dimension>(mut a: ArrayViewMut<'_, f32, D>, value: f32) {
    if !running() {
        a.fill(value);
    }
}

/// `acc += Σ rows` (a bias's gradient from its output's gradient), summed in row order
/// (deterministic).
pub(crate) fn add_rows(mut acc: ArrayViewMut1<'_, f32>, rows: ArrayView2<'_, f32>) {
    if running() {
        return;
    }
    for row in rows.rows() {
        Zip::from(&mut acc).and(&row).for_each(|acc, &g| *acc += g);
    }
}

/// The logistic function.
#[inline]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The LSTM cell of one sequence at one step, in place: `state` holds the
/// pre-activations of the gates (g, f, o, i: `4 · h`) and gets the activated gates, the
/// cell `c` and the hidden state `h` (`6 · h` in all); `previous` is the step before's
/// state row (its `c` read), `output` gets `h`.
pub(crate) fn lstm_cell_forward(
    h: usize,
    state: &mut [f32],
    previous: Option<&[f32]>,
    mut output: ArrayViewMut1<'_, f32>,
) {
    if running() {
        return;
    }
    const G: usize = 4;
    for j in 0..h {
        let g = state[j].tanh();
        let f = sigmoid(state[h + j]);
        let o = sigmoid(state[2 * h + j]);
        let i = sigmoid(state[3 * h + j]);
        let c_prev = previous.map_or(0.0, |p| p[G * h + j]);
        let c = f * c_prev + i * g;
        let hv = o * c.tanh();
        state[j] = g;
        state[h + j] = f;
        state[2 * h + j] = o;
        state[3 * h + j] = i;
        state[G * h + j] = c;
        state[(G + 1) * h + j] = hv;
        output[j] = hv;
    }
}

/// The LSTM cell's backward pass for one sequence at one step: from its `state` (as
/// [`lstm_cell_forward`] left it), the step before's cell `c_prev` (`h` values, or
/// none at the first step), the gradient of its output `g_out` and the gradients
/// carried from the step after (`carry`: of `h`, then of `c`), writes the gradient of
/// the gates' pre-activations into `dz` and the gradient of the previous cell into the
/// second half of `carry`.
pub(crate) fn lstm_cell_backward(
    h: usize,
    state: &[f32],
    c_prev: Option<ArrayView1<'_, f32>>,
    g_out: ArrayView1<'_, f32>,
    carry: &mut [f32],
    dz: &mut [f32],
) {
    if running() {
        return;
    }
    const G: usize = 4;
    for j in 0..h {
        let (g, f, o, i) = (state[j], state[h + j], state[2 * h + j], state[3 * h + j]);
        let c = state[G * h + j];
        let c_prev = c_prev.as_ref().map_or(0.0, |c| c[j]);
        let dh = carry[j] + g_out[j];
        let tc = c.tanh();
        let d_o = dh * tc;
        let dc = carry[h + j] + dh * o * (1.0 - tc * tc);
        dz[j] = dc * i * (1.0 - g * g);
        dz[h + j] = dc * c_prev * f * (1.0 - f);
        dz[2 * h + j] = d_o * o * (1.0 - o);
        dz[3 * h + j] = dc * g * i * (1.0 - i);
        carry[h + j] = dc * f;
    }
}

/// The gradient of GELU's input ([`vector::gelu_new`]): `dx = dy · gelu'(x)`.
pub(crate) fn gelu_backward(
    x: ArrayView2<'_, f32>,
    dy: ArrayView2<'_, f32>,
    mut dx: ArrayViewMut2<'_, f32>,
    form: GeluForm,
) {
    if running() {
        return;
    }
    if let (Some(x), Some(dy), Some(dx)) = (x.as_slice(), dy.as_slice(), dx.as_slice_mut()) {
        let n = x.len().min(dy.len()).min(dx.len());
        return vector::split(dx, n, 1, &|s, e, dx| vector::gelu_backward_slices(&x[s..e], &dy[s..e], dx, form));
    }
    Zip::from(&mut dx).and(&x).and(&dy).for_each(|dx, &x, &g| *dx = g * vector::gelu_slope_in(form, x));
}

/// The backward pass of layer normalisation ([`vector::layer_norm_new`]), each row's
/// statistics rebuilt from its input (nothing kept from the forward pass): `dgamma =
/// Σ dy·x̂`, `dbeta = Σ dy` over the rows, in row order, and, when asked, `dx =
/// rstd·(dx̂ − mean(dx̂) − x̂·mean(dx̂·x̂))` with `dx̂ = dy·gamma`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_norm_backward(
    x: ArrayView2<'_, f32>,
    gamma: ArrayView1<'_, f32>,
    eps: f32,
    dy: ArrayView2<'_, f32>,
    mut dgamma: ArrayViewMut1<'_, f32>,
    mut dbeta: ArrayViewMut1<'_, f32>,
    mut dx: Option<ArrayViewMut2<'_, f32>>,
) {
    if running() {
        return;
    }
    dgamma.fill(0.0);
    dbeta.fill(0.0);
    let n = x.ncols();
    if n > 0 && gamma.len() == n && dgamma.len() == n && dbeta.len() == n {
        if let (Some(xs), Some(dys), Some(g)) = (x.as_slice(), dy.as_slice(), gamma.as_slice()) {
            if let (Some(dg), Some(db)) = (dgamma.as_slice_mut(), dbeta.as_slice_mut()) {
                match dx.as_mut().map(|d| d.as_slice_mut()) {
                    None => {
                        if !vector::layer_norm_backward_split(xs, dys, g, eps, dg, db, None) {
                            vector::layer_norm_backward_slices(xs, dys, g, eps, dg, db, None);
                        }
                        return;
                    }
                    Some(Some(dxs)) => {
                        if !vector::layer_norm_backward_split(xs, dys, g, eps, dg, db, Some(&mut *dxs)) {
                            vector::layer_norm_backward_slices(xs, dys, g, eps, dg, db, Some(dxs));
                        }
                        return;
                    }
                    Some(None) => {}
                }
            }
        }
    }
    for (r, (x, dy)) in x.rows().into_iter().zip(dy.rows()).enumerate() {
        let dx = dx.as_mut().map(|d| d.row_mut(r));
        vector::strided::layer_norm_backward_row(x, dy, gamma, eps, dgamma.view_mut(), dbeta.view_mut(), dx);
    }
}

/// The causal softmax of one sequence's and head's scores `s` (`[T, T]`, query rows,
/// key columns), in place: row `i` over the keys `j ≤ i` that are not padding; the
/// other entries, and every entry of a padded query's row, become 0. Each row's
/// maximum and the reciprocal of its sum go into `stats` (`[T, 2]`: what
/// [`causal_softmax_again`] rebuilds the row from, to the bit).
pub(crate) fn causal_softmax(mut s: ArrayViewMut2<'_, f32>, mask: Option<ArrayView1<'_, f32>>, stats: &mut [f32]) {
    if running() {
        return;
    }
    softmax_block(s.view_mut(), mask, vector::Stats::Write(stats));
}

/// The causal softmax of the scores of a sequence's new steps `first..` against its
/// steps so far, in place: `s` is `[new steps, width]`, contiguous, and row `r` attends
/// to steps `0..=first + r` (`first + r < width`); the rest of the row becomes 0. Each
/// row gets the same bits as the same step's row of [`causal_softmax`] without a mask.
pub(crate) fn causal_softmax_from(mut s: ArrayViewMut2<'_, f32>, first: usize) {
    if running() {
        return;
    }
    let width = s.ncols();
    assert!(first + s.nrows() <= width, "a new step's row holds every step up to it");
    let scores = s.as_slice_mut().expect("a score block is contiguous");
    vector::causal_softmax_from_slices(scores, width, first);
}

/// Every head of one new step attending to its stream's steps so far (see
/// [`vector::attend_one_slices`]; `scores` holds `heads` rows of as many values as
/// there are steps): `out` gets the bits the whole sequence's products and softmax give
/// that step.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_one(
    q: &[f32],
    heads: usize,
    scale: f32,
    keys: &[f32],
    key_stride: usize,
    values: &[f32],
    value_stride: usize,
    scores: &mut [f32],
    out: &mut [f32],
) {
    if running() || scores.is_empty() {
        return;
    }
    let width = q.len();
    assert!(heads > 0 && width.is_multiple_of(heads), "heads share the width");
    assert!(scores.len().is_multiple_of(heads), "one row of scores per head");
    let steps = scores.len() / heads;
    assert!(out.len() == width, "one value per feature");
    assert!(keys.len() >= (width - 1) * key_stride + steps, "every feature's keys of every step");
    assert!(values.len() >= (steps - 1) * value_stride + width, "every step's values");
    vector::attend_one_slices(q, heads, scale, keys, key_stride, values, value_stride, scores, out);
}

/// [`causal_softmax`] of scores computed again, from the `stats` it left: the same
/// operations on the same values, so the same probabilities, bit for bit.
pub(crate) fn causal_softmax_again(mut s: ArrayViewMut2<'_, f32>, mask: Option<ArrayView1<'_, f32>>, stats: &[f32]) {
    if running() {
        return;
    }
    softmax_block(s.view_mut(), mask, vector::Stats::Read(stats));
}

/// A square, contiguous score block (attention allocates them so) through
/// [`vector::causal_softmax_slices`]; a mask row that is not contiguous takes the same
/// operations through the baseline loop.
fn softmax_block(mut s: ArrayViewMut2<'_, f32>, mask: Option<ArrayView1<'_, f32>>, stats: vector::Stats<'_>) {
    let t = s.ncols();
    assert_eq!(s.nrows(), t, "a score block is square");
    let held = match &stats {
        vector::Stats::Write(s) => s.len(),
        vector::Stats::Read(s) => s.len(),
    };
    assert!(held >= 2 * t, "two statistics per row");
    let scores = s.as_slice_mut().expect("a score block is contiguous");
    match mask {
        None => vector::causal_softmax_slices(scores, t, None, stats),
        Some(m) => match m.as_slice() {
            Some(m) => vector::causal_softmax_slices(scores, t, Some(m), stats),
            None => vector::causal_softmax_by(scores, t, |j| m[j] != 0.0, stats),
        },
    }
}

/// The gradient of a causal softmax's scores from its probabilities `p` (row `i` zero
/// past step `i`) and the gradient of the probabilities `dp`, in place of `dp`:
/// `ds_ij = p_ij · (dp_ij − Σ_k p_ik·dp_ik)`, times `scale`, for `j ≤ i`, and 0 past
/// the diagonal, where `dp` is not read (a causal product may not have written it).
pub(crate) fn causal_softmax_backward(p: ArrayView2<'_, f32>, mut dp: ArrayViewMut2<'_, f32>, scale: f32) {
    if running() {
        return;
    }
    let t = p.ncols();
    if let (Some(ps), Some(ds)) = (p.as_slice(), dp.as_slice_mut()) {
        if t > 0 {
            return vector::causal_softmax_backward_slices(ps, ds, t, scale);
        }
    }
    for (i, (p, mut d)) in p.rows().into_iter().zip(dp.rows_mut()).enumerate() {
        let head = (i + 1).min(t);
        let dot = vector::lane_sum_iter(p.iter().zip(d.iter()).take(head).map(|(&p, &d)| p * d));
        Zip::from(&mut d).and(&p).for_each(|d, &p| *d = scale * p * (*d - dot));
        d.slice_mut(ndarray::s![head..]).fill(0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{array, Array1};

    #[test]
    fn a_dry_run_issues_nothing_and_ends_with_its_closure_even_by_unwinding() {
        let mut acc = Array1::<f32>::from_elem(2, 7.0);
        let rows = array![[1.0f32, 2.0], [3.0, 4.0]];
        dry_run(|| {
            assert!(running());
            vector::sum_rows(acc.view_mut(), rows.view());
        });
        assert_eq!(acc, array![7.0, 7.0], "a dry run leaves the numbers alone");
        assert!(!running());
        vector::sum_rows(acc.view_mut(), rows.view());
        assert_eq!(acc, array![4.0, 6.0]);
        let unwound = std::panic::catch_unwind(|| dry_run(|| panic!("a layer panicked")));
        assert!(unwound.is_err());
        assert!(!running(), "the flag is put back when a dry run unwinds");
        dry_run(|| dry_run(|| assert!(running())));
        assert!(!running(), "nested dry runs put back what was before");
    }

    #[test]
    fn the_lstm_cell_is_skipped_in_a_dry_run() {
        let h = 1;
        let mut state = [0.5f32, 0.25, -0.5, 1.0, 9.0, 9.0];
        let mut out = Array1::<f32>::zeros(1);
        dry_run(|| lstm_cell_forward(h, &mut state, None, out.view_mut()));
        assert_eq!(state, [0.5, 0.25, -0.5, 1.0, 9.0, 9.0]);
        lstm_cell_forward(h, &mut state, None, out.view_mut());
        let (g, i, o) = (0.5f32.tanh(), sigmoid(1.0), sigmoid(-0.5));
        assert_eq!(state[4], i * g);
        assert_eq!(out[0], o * (i * g).tanh());
    }
}
