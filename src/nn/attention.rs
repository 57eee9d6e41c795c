//! Causal multi-head self-attention (GPT-2's `CausalSelfAttention`, without dropout).

use std::mem::MaybeUninit;
use std::ops::Range;

use ndarray::{s, ArrayView1, ArrayView2, ArrayView3, ArrayViewMut1, ArrayViewMut2};
use workspace_core::freeze;

use crate::{Error, Result};

use super::gemm::{scratch_len, sgemm, sgemm_tri, sgemm_uninit, Triangle};
use super::kept::{fingerprint, Kept};
use super::kernels::{attend_one, causal_softmax, causal_softmax_again, causal_softmax_backward, causal_softmax_from};
use super::layer::{
    check_len, check_mask, rows_of_grad, sequence_as_rows_uninit, sequence_grad_input, steps_as_rows, steps_in,
    tape_of, Activations, BackwardCtx, ForwardCtx, GradInput, Init, Layer, ParamShape, Pass, StreamState, Tape,
    UninitGradInput,
};
use super::vector::{fill_rows, rows_new, split_with_work, sum_rows, zeros_new, PartWork};

/// Causal multi-head self-attention over a batch of sequences `[batch, time, width]`:
/// one projection to the queries, keys and values of every head (`qkv`, `width → 3 ·
/// width`), each head's scaled causal softmax (a step attends to itself and the steps
/// before it; padded steps, where the mask is 0, are attended to by no step and attend
/// to none), the heads' outputs side by side, and an output projection (`proj`, `width
/// → width`). Parameters, carve's layout (`[inputs, outputs]`, as [`Dense`]'s):
/// `qkv.weight`, `qkv.bias`, `proj.weight`, `proj.bias`.
///
/// What its training forward pass keeps for backward besides its input and output: the
/// queries, keys and values and the heads' outputs (`4 · width` values per step), and
/// then either every head's attention probabilities (`heads · time` per step: the
/// largest activation of a transformer) or, in the recompute form
/// ([`Attention::recomputing`]), only each row's softmax statistics (2 values per head
/// and step), the scores rebuilt in the backward pass one head at a time, as
/// flash-attention does. The two forms give the same bits.
///
/// [`Dense`]: crate::nn::Dense
#[derive(Clone, Debug)]
pub struct Attention {
    name: String,
    width: usize,
    heads: usize,
    recompute: bool,
}

/// What the training forward pass left.
#[derive(Debug, Default)]
struct AttentionTape {
    kept: Kept,
}

/// The parameters as the passes read them.
#[derive(Clone, Copy)]
struct Weights<'p> {
    qkv_w: ArrayView2<'p, f32>,
    qkv_b: ArrayView1<'p, f32>,
    proj_w: ArrayView2<'p, f32>,
    proj_b: ArrayView1<'p, f32>,
}

/// Where the kept values of one batch are, in one buffer: `qkv` `[rows, 3·width]`,
/// `att` `[rows, width]`, then per sequence and head the softmax statistics and (unless
/// recomputed) the probabilities.
#[derive(Clone, Copy, Debug)]
struct Layout {
    batch: usize,
    steps: usize,
    width: usize,
    heads: usize,
    recompute: bool,
}

impl Layout {
    fn rows(&self) -> usize {
        self.batch * self.steps
    }

    fn qkv(&self) -> usize {
        self.rows() * 3 * self.width
    }

    fn att(&self) -> usize {
        self.rows() * self.width
    }

    /// Per head and sequence: the softmax statistics (`[time, 2]`), then, unless
    /// recomputed, the probabilities (`[time, time]`).
    fn per_head(&self) -> usize {
        2 * self.steps + if self.recompute { 0 } else { self.steps * self.steps }
    }

    /// The buffer's values, or `None` when they overflow (every size above is then
    /// within `usize`, `per_head` included).
    fn len(&self) -> Option<usize> {
        let probabilities = if self.recompute { 0 } else { self.steps.checked_mul(self.steps)? };
        let per_head = self.steps.checked_mul(2)?.checked_add(probabilities)?;
        let rest = self.batch.checked_mul(self.heads)?.checked_mul(per_head)?;
        self.rows().checked_mul(4 * self.width)?.checked_add(rest)
    }
}

impl Attention {
    /// Self-attention of `heads` heads over `width` features per step.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for 0 heads or width, or a width the heads do not
    /// divide.
    pub fn named(name: &str, width: usize, heads: usize) -> Result<Attention> {
        if width == 0 || heads == 0 || !width.is_multiple_of(heads) {
            return Err(Error::invalid_config(format!(
                "attention layer '{name}': {heads} heads over a width of {width}: the heads must divide the width \
                 (both at least 1)"
            )));
        }
        if width.checked_mul(4).and_then(|w| w.checked_mul(width)).is_none() {
            return Err(Error::invalid_config(format!("attention layer '{name}': a width of {width} overflows")));
        }
        Ok(Attention { name: name.to_string(), width, heads, recompute: false })
    }

    /// The recompute form: the backward pass rebuilds the attention scores instead of
    /// keeping the probabilities (see [`Attention`]).
    pub fn recomputing(mut self) -> Attention {
        self.recompute = true;
        self
    }

    /// Features per step.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Heads.
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// Whether the backward pass rebuilds the scores (the recompute form).
    pub fn is_recomputing(&self) -> bool {
        self.recompute
    }

    /// Values kept for the backward pass of a batch of `batch` sequences of `steps`
    /// steps (besides the input and output the network keeps).
    pub fn kept_values(&self, batch: usize, steps: usize) -> Option<usize> {
        self.layout(batch, steps).len()
    }

    fn layout(&self, batch: usize, steps: usize) -> Layout {
        Layout { batch, steps, width: self.width, heads: self.heads, recompute: self.recompute }
    }

    fn head_width(&self) -> usize {
        self.width / self.heads
    }

    fn param_count(&self) -> usize {
        let d = self.width;
        d * 3 * d + 3 * d + d * d + d
    }

    fn weights<'p>(&self, params: &'p [f32]) -> Result<Weights<'p>> {
        check_len(&self.name, "parameters", params.len(), self.param_count())?;
        let d = self.width;
        let (qkv_w, rest) = params.split_at(d * 3 * d);
        let (qkv_b, rest) = rest.split_at(3 * d);
        let (proj_w, proj_b) = rest.split_at(d * d);
        Ok(Weights {
            qkv_w: ArrayView2::from_shape((d, 3 * d), qkv_w).expect("width × 3·width values"),
            qkv_b: ArrayView1::from(qkv_b),
            proj_w: ArrayView2::from_shape((d, d), proj_w).expect("width × width values"),
            proj_b: ArrayView1::from(proj_b),
        })
    }

    /// The scratch elements of the passes' matrix products for `steps` steps of
    /// `rows` rows in all.
    fn scratch(&self, rows: usize, steps: usize) -> usize {
        let (d, hd) = (self.width, self.head_width());
        [
            scratch_len(rows, 3 * d, d),
            scratch_len(rows, d, d),
            scratch_len(d, 3 * d, rows),
            scratch_len(rows, d, 3 * d),
            scratch_len(d, d, rows),
            scratch_len(steps, steps, hd),
            scratch_len(steps, hd, steps),
        ]
        .into_iter()
        .max()
        .unwrap_or(0)
    }

    /// Checks a batch of sequences against the layer.
    fn check(&self, input: &ArrayView3<'_, f32>, mask: Option<&ArrayView2<'_, f32>>) -> Result<()> {
        let (batch, steps, features) = check_mask(&self.name, input, mask)?;
        if features != self.width {
            return Err(Error::ShapeMismatch {
                context: format!("layer '{}' input [batch, time, features]", self.name),
                expected: vec![batch, steps, self.width],
                actual: input.shape().to_vec(),
            });
        }
        Ok(())
    }

    /// The forward pass of rows `x` (`[batch · steps, width]`) added to `out` (which
    /// holds the output projection's bias in every row), with the
    /// queries, keys and values in `qkv`, the heads' outputs in `att`, and per head and
    /// sequence the softmax statistics and (unless recomputed: then the scores are
    /// worked out in `scores`, `[steps, steps]`) the probabilities in `heads`. The
    /// sequences' heads are split across the thread's pool when it has one (each
    /// sequence computed by the same code: the same bits).
    #[allow(clippy::too_many_arguments)]
    fn run_forward(
        &self,
        p: Weights<'_>,
        x: ArrayView2<'_, f32>,
        l: Layout,
        mask: Option<ArrayView2<'_, f32>>,
        mut qkv: ArrayViewMut2<'_, f32>,
        att: &mut [f32],
        heads: &mut [f32],
        scores: &mut [f32],
        out: ArrayViewMut2<'_, f32>,
        scratch: &mut [MaybeUninit<f32>],
    ) -> Result<()> {
        let (d, hd, t) = (self.width, self.head_width(), l.steps);
        let scale = 1.0 / (hd as f32).sqrt();
        fill_rows(qkv.view_mut(), p.qkv_b);
        sgemm(1.0, x, p.qkv_w, 1.0, qkv.view_mut(), scratch)?;
        // A padded step's queries, keys and values are zero: no live step attends to it,
        // and a padded step's input (which nothing checks: it may be anything, NaN
        // included) then cannot reach a live step through a product by a zero
        // probability (`0 · NaN`), whatever the products skip. Their gradients are zero
        // either way.
        if let Some(mask) = mask.as_ref() {
            for ((b, step), &live) in mask.indexed_iter() {
                if live == 0.0 {
                    qkv.row_mut(b * t + step).fill(0.0);
                }
            }
        }
        let qkv = qkv.view();
        let head_scratch = self.head_scratch(t).min(scratch.len());
        let own = PartWork { values: scores, packing: &mut scratch[..head_scratch] };
        let sequences = |s: usize, e: usize, att: &mut [f32], heads: &mut [f32], work: PartWork<'_>| {
            let PartWork { values: scores, packing: scratch } = work;
            let mut att = ArrayViewMut2::from_shape(((e - s) * t, d), att).expect("rows × width values");
            for (i, slots) in heads.chunks_exact_mut(self.heads * l.per_head()).enumerate() {
                let b = s + i;
                let (rows, own_rows) = (b * t..(b + 1) * t, i * t..(i + 1) * t);
                let keys = mask.as_ref().map(|m| m.row(b));
                for (h, slot) in slots.chunks_exact_mut(l.per_head()).enumerate() {
                    let head = Head::of(qkv, rows.clone(), self.head_columns(h));
                    let (stats, probs) = slot.split_at_mut(2 * t);
                    let probs = if l.recompute { &mut scores[..t * t] } else { probs };
                    let probs = ArrayViewMut2::from_shape((t, t), probs).expect("steps × steps values");
                    let o = att.slice_mut(s![own_rows.clone(), self.head_columns(h).0]);
                    head_forward(scale, head, keys, stats, probs, o, scratch)?;
                }
            }
            Ok(())
        };
        split_with_work(att, heads, l.batch, own, &sequences)?;
        let att = ArrayView2::from_shape((l.rows(), d), &*att).expect("rows × width values");
        sgemm(1.0, att, p.proj_w, 1.0, out, scratch)?;
        Ok(())
    }

    /// Head `h`'s columns of the queries, the keys and the values in `qkv` (its
    /// queries' columns are also its output's columns in `att`).
    fn head_columns(&self, h: usize) -> (Range<usize>, Range<usize>, Range<usize>) {
        head_columns(self.width, self.head_width(), h)
    }

    /// Packing space for one head's products over `steps` steps.
    fn head_scratch(&self, steps: usize) -> usize {
        head_scratch(steps, self.head_width())
    }

    /// [`Attention::run_forward`] with its arrays in `kept`, laid out as `l` says.
    #[allow(clippy::too_many_arguments)]
    fn forward_into(
        &self,
        p: Weights<'_>,
        x: ArrayView2<'_, f32>,
        l: Layout,
        mask: Option<ArrayView2<'_, f32>>,
        kept: &mut [f32],
        scores: &mut [f32],
        out: ArrayViewMut2<'_, f32>,
        scratch: &mut [MaybeUninit<f32>],
    ) -> Result<()> {
        let (qkv, rest) = kept.split_at_mut(l.qkv());
        let (att, heads) = rest.split_at_mut(l.att());
        let qkv = ArrayViewMut2::from_shape((l.rows(), 3 * self.width), qkv).expect("rows × 3·width values");
        self.run_forward(p, x, l, mask, qkv, att, heads, scores, out, scratch)
    }

    /// The backward pass from the kept values (`qkv`, `att`, per head the statistics
    /// and the probabilities or, recomputed, the scores rebuilt in `scores`): the
    /// parameters' gradients into `g` (every element), the input's into `dx` (given
    /// back when it came uninitialised).
    #[allow(clippy::too_many_arguments)]
    fn run_backward<'g>(
        &self,
        p: Weights<'_>,
        g: &mut [f32],
        x: ArrayView2<'_, f32>,
        l: Layout,
        mask: Option<ArrayView2<'_, f32>>,
        kept: &[f32],
        dy: ArrayView2<'_, f32>,
        dx: Dx<'g>,
        work: Work<'_>,
    ) -> Result<Option<ArrayViewMut2<'g, f32>>> {
        let (d, hd, t) = (self.width, self.head_width(), l.steps);
        let scale = 1.0 / (hd as f32).sqrt();
        let Work { d_att, mut d_qkv, values: work_values, scratch } = work;
        let (qkv, rest) = kept.split_at(l.qkv());
        let (att, heads) = rest.split_at(l.att());
        let qkv = ArrayView2::from_shape((l.rows(), 3 * d), qkv).expect("rows × 3·width values");
        let att = ArrayView2::from_shape((l.rows(), d), att).expect("rows × width values");
        let (g_qkv_w, rest) = g.split_at_mut(d * 3 * d);
        let (g_qkv_b, rest) = rest.split_at_mut(3 * d);
        let (g_proj_w, g_proj_b) = rest.split_at_mut(d * d);
        let g_qkv_w = ArrayViewMut2::from_shape((d, 3 * d), g_qkv_w).expect("width × 3·width values");
        let g_proj_w = ArrayViewMut2::from_shape((d, d), g_proj_w).expect("width × width values");
        // The output projection.
        sgemm(1.0, att.t(), dy, 0.0, g_proj_w, scratch)?;
        sum_rows(ArrayViewMut1::from(g_proj_b), dy);
        let d_att = sgemm_uninit(1.0, dy, p.proj_w.t(), d_att, scratch)?;
        // Each head of each sequence, the sequences split across the thread's pool.
        let d_att = d_att.view();
        let head_scratch = self.head_scratch(t).min(scratch.len());
        let own = PartWork { values: work_values, packing: &mut scratch[..head_scratch] };
        let sequences = |s: usize, e: usize, d_qkv: &mut [f32], _: &mut [f32], work: PartWork<'_>| {
            let PartWork { values, packing: scratch } = work;
            let (scores, d_probs) = values.split_at_mut(t * t);
            let mut scores = ArrayViewMut2::from_shape((t, t), scores).expect("steps × steps values");
            let mut d_probs = ArrayViewMut2::from_shape((t, t), &mut d_probs[..t * t]).expect("steps × steps values");
            let mut d_qkv = ArrayViewMut2::from_shape(((e - s) * t, 3 * d), d_qkv).expect("rows × 3·width values");
            let per_sequence = self.heads * l.per_head();
            for b in s..e {
                let slots = &heads[b * per_sequence..(b + 1) * per_sequence];
                let (rows, own_rows) = (b * t..(b + 1) * t, (b - s) * t..(b - s + 1) * t);
                let keys = mask.as_ref().map(|m| m.row(b));
                for (h, slot) in slots.chunks_exact(l.per_head()).enumerate() {
                    let (qc, kc, vc) = self.head_columns(h);
                    let head = Head::of(qkv, rows.clone(), (qc.clone(), kc.clone(), vc.clone()));
                    let (stats, probs) = slot.split_at(2 * t);
                    let probs = match l.recompute {
                        true => {
                            sgemm_tri(scale, head.q, head.k.t(), 0.0, scores.view_mut(), scratch, Triangle::LowerC)?;
                            causal_softmax_again(scores.view_mut(), keys, stats);
                            scores.view()
                        }
                        false => ArrayView2::from_shape((t, t), probs).expect("steps × steps values"),
                    };
                    let d_o = d_att.slice(s![rows.clone(), qc.clone()]);
                    let grads = d_qkv.multi_slice_mut((
                        s![own_rows.clone(), qc],
                        s![own_rows.clone(), kc],
                        s![own_rows.clone(), vc],
                    ));
                    head_backward(scale, head, probs, d_o, d_probs.view_mut(), grads, scratch)?;
                }
            }
            Ok(())
        };
        let d_qkv_values = d_qkv.as_slice_mut().expect("a working array is contiguous");
        split_with_work(d_qkv_values, &mut [], l.batch, own, &sequences)?;
        let d_qkv = ArrayView2::from_shape((l.rows(), 3 * d), &*d_qkv_values).expect("rows × 3·width values");
        // The input projection.
        sgemm(1.0, x.t(), d_qkv.view(), 0.0, g_qkv_w, scratch)?;
        sum_rows(ArrayViewMut1::from(g_qkv_b), d_qkv.view());
        match dx {
            Dx::None => Ok(None),
            Dx::Zeroed(dx) => sgemm(1.0, d_qkv.view(), p.qkv_w.t(), 0.0, dx, scratch).map(|()| None),
            Dx::Uninit(dx) => sgemm_uninit(1.0, d_qkv.view(), p.qkv_w.t(), dx, scratch).map(Some),
        }
    }
}

/// Head `h`'s columns of the queries, the keys and the values in `qkv`, for a layer
/// `width` wide of heads `head_width` wide (its queries' columns are also its output's
/// columns in `att`). The layer's passes and the simulated device's attention share it.
pub(crate) fn head_columns(width: usize, head_width: usize, h: usize) -> (Range<usize>, Range<usize>, Range<usize>) {
    let (d, hd) = (width, head_width);
    (h * hd..(h + 1) * hd, d + h * hd..d + (h + 1) * hd, 2 * d + h * hd..2 * d + (h + 1) * hd)
}

/// Packing space for one head's products over `steps` steps.
pub(crate) fn head_scratch(steps: usize, head_width: usize) -> usize {
    scratch_len(steps, steps, head_width).max(scratch_len(steps, head_width, steps))
}

/// One head's queries, keys and values over one sequence: `[steps, head_width]` views.
#[derive(Clone, Copy)]
pub(crate) struct Head<'a> {
    pub(crate) q: ArrayView2<'a, f32>,
    pub(crate) k: ArrayView2<'a, f32>,
    pub(crate) v: ArrayView2<'a, f32>,
}

impl<'a> Head<'a> {
    /// The head at `columns` (as [`head_columns`] gives them) of the sequence at `rows`
    /// of `qkv`.
    pub(crate) fn of(
        qkv: ArrayView2<'a, f32>,
        rows: Range<usize>,
        (qc, kc, vc): (Range<usize>, Range<usize>, Range<usize>),
    ) -> Head<'a> {
        Head {
            q: qkv.slice_move(s![rows.clone(), qc]),
            k: qkv.slice_move(s![rows.clone(), kc]),
            v: qkv.slice_move(s![rows, vc]),
        }
    }
}

/// One head's forward pass over one sequence: `P = softmax(scale · Q·Kᵀ)` (causal, over
/// the keys `keys` marks live) into `probs`, its statistics into `stats`, then `O = P·V`
/// into `o`. Written once: the layer's passes and the simulated device's attention run it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn head_forward(
    scale: f32,
    head: Head<'_>,
    keys: Option<ArrayView1<'_, f32>>,
    stats: &mut [f32],
    mut probs: ArrayViewMut2<'_, f32>,
    o: ArrayViewMut2<'_, f32>,
    scratch: &mut [MaybeUninit<f32>],
) -> Result<()> {
    sgemm_tri(scale, head.q, head.k.t(), 0.0, probs.view_mut(), scratch, Triangle::LowerC)?;
    causal_softmax(probs.view_mut(), keys, stats);
    sgemm_tri(1.0, probs.view(), head.v, 0.0, o, scratch, Triangle::LowerA)
}

/// One head's backward pass over one sequence, from its probabilities `probs` and its
/// output's gradient `d_o`: `dP = dO·Vᵀ` into `d_probs` (work), `dV = Pᵀ·dO`, `dS = P ⊙
/// (dP − rowsum(P ⊙ dP)) · scale` in place, `dQ = dS·K`, `dK = dSᵀ·Q` into `grads`
/// (`dQ`, `dK`, `dV`). Written once, as [`head_forward`].
pub(crate) fn head_backward(
    scale: f32,
    head: Head<'_>,
    probs: ArrayView2<'_, f32>,
    d_o: ArrayView2<'_, f32>,
    mut d_probs: ArrayViewMut2<'_, f32>,
    (dq, dk, dv): (ArrayViewMut2<'_, f32>, ArrayViewMut2<'_, f32>, ArrayViewMut2<'_, f32>),
    scratch: &mut [MaybeUninit<f32>],
) -> Result<()> {
    sgemm_tri(1.0, d_o, head.v.t(), 0.0, d_probs.view_mut(), scratch, Triangle::LowerC)?;
    sgemm_tri(1.0, probs.t(), d_o, 0.0, dv, scratch, Triangle::UpperA)?;
    causal_softmax_backward(probs, d_probs.view_mut(), scale);
    sgemm_tri(1.0, d_probs.view(), head.k, 0.0, dq, scratch, Triangle::LowerA)?;
    sgemm_tri(1.0, d_probs.t(), head.q, 0.0, dk, scratch, Triangle::UpperA)
}

/// Where the backward pass writes the gradient of the input (as rows of steps).
enum Dx<'g> {
    /// Not wanted.
    None,
    /// Into an initialised array ([`Layer::backward`]).
    Zeroed(ArrayViewMut2<'g, f32>),
    /// Into an uninitialised one, given back written ([`Layer::backward_uninit`]).
    Uninit(ArrayViewMut2<'g, MaybeUninit<f32>>),
}

/// The backward pass's working arrays: `values` holds a head's rebuilt scores and the
/// probabilities' gradient (`[steps, steps]` each).
struct Work<'w> {
    d_att: ArrayViewMut2<'w, MaybeUninit<f32>>,
    d_qkv: ArrayViewMut2<'w, f32>,
    values: &'w mut [f32],
    scratch: &'w mut [MaybeUninit<f32>],
}

impl Layer for Attention {
    fn device_form(&self) -> Option<crate::nn::DeviceForm> {
        Some(crate::nn::DeviceForm::Attention { width: self.width, heads: self.heads })
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn output_size(&self, inputs: usize) -> Result<usize> {
        if inputs != self.width {
            return Err(Error::ShapeMismatch {
                context: format!("layer '{}' takes {} features per step", self.name, self.width),
                expected: vec![self.width],
                actual: vec![inputs],
            });
        }
        Ok(self.width)
    }

    fn param_shapes(&self, _inputs: usize) -> Vec<ParamShape> {
        let d = self.width;
        vec![
            ParamShape::new("qkv.weight", &[d, 3 * d]),
            ParamShape::new("qkv.bias", &[3 * d]),
            ParamShape::new("proj.weight", &[d, d]),
            ParamShape::new("proj.bias", &[d]),
        ]
    }

    fn init(&self, _inputs: usize, params: &mut [f32], init: &mut Init<'_>) {
        // Weights from N(0, 0.02²), biases 0 (GPT-2's and nanoGPT's, but for their
        // scaling of the output projection to 0.02 / √(2 · blocks), which carve does not
        // do: a layer does not know the depth of its network).
        let d = self.width;
        let (qkv_w, rest) = params.split_at_mut(d * 3 * d);
        let (qkv_b, rest) = rest.split_at_mut(3 * d);
        let (proj_w, proj_b) = rest.split_at_mut(d * d);
        init.fill_normal(qkv_w, 0.02);
        qkv_b.fill(0.0);
        init.fill_normal(proj_w, 0.02);
        proj_b.fill(0.0);
    }

    fn tape(&self) -> Tape {
        Tape::new(AttentionTape::default())
    }

    fn forward<'a>(
        &self,
        params: &[f32],
        input: Activations<'a>,
        mask: Option<ArrayView2<'a, f32>>,
        tape: &mut Tape,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>> {
        self.forward_any(params, input, mask, tape, ctx)
    }

    fn detaches(&self) -> bool {
        true
    }

    fn stream_state_len(&self, _inputs: usize, context: usize) -> Result<usize> {
        context.checked_mul(2 * self.width).ok_or_else(|| {
            Error::invalid_config(format!(
                "attention layer '{}': the keys and values of {context} steps overflow",
                self.name
            ))
        })
    }

    fn runs_in_stream(&self) -> bool {
        true
    }

    fn forward_stream<'a>(
        &self,
        params: &[f32],
        input: Activations<'a>,
        state: &mut StreamState<'_>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>> {
        self.forward_cached(params, input, state, ctx)
    }

    fn forward_detached<'a>(
        &self,
        params: &[f32],
        input: Activations<'_>,
        mask: Option<ArrayView2<'a, f32>>,
        tape: &mut Tape,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Option<Result<Activations<'a>>> {
        Some(self.forward_any(params, input, mask, tape, ctx))
    }

    fn backward(
        &self,
        params: &[f32],
        grads: &mut [f32],
        pass: Pass<'_>,
        grad_input: Option<GradInput<'_>>,
        tape: &mut Tape,
        ctx: &BackwardCtx<'_>,
    ) -> Result<()> {
        let name = &self.name;
        let dx = match grad_input {
            None => Dx::None,
            Some(g) => {
                let g = sequence_grad_input(g, name)?;
                let x = pass.input.sequence(name)?;
                if g.dim() != x.dim() {
                    return Err(wrong_grad_input(name, &x, g.shape()));
                }
                Dx::Zeroed(rows_of_grad(g, name)?)
            }
        };
        self.backward_with(params, grads, pass, dx, tape, ctx).map(|_| ())
    }

    fn backward_uninit<'g>(
        &self,
        params: &[f32],
        grads: &mut [f32],
        pass: Pass<'_>,
        grad_input: UninitGradInput<'g>,
        tape: &mut Tape,
        ctx: &BackwardCtx<'_>,
    ) -> Result<GradInput<'g>> {
        // The input projection's product writes every element of the input's gradient:
        // no zeros first.
        let name = &self.name;
        let x = pass.input.sequence(name)?;
        let g = match grad_input {
            UninitGradInput::Sequence(g) if g.dim() == x.dim() => g,
            UninitGradInput::Sequence(g) => return Err(wrong_grad_input(name, &x, g.shape())),
            UninitGradInput::Flat(g) => return Err(wrong_grad_input(name, &x, g.shape())),
        };
        let written = sequence_as_rows_uninit(g, name, |rows| {
            self.backward_with(params, grads, pass, Dx::Uninit(rows), tape, ctx)?.ok_or_else(|| {
                Error::InvalidInput(format!("layer '{name}': the gradient of its input was not written"))
            })
        })?;
        Ok(GradInput::Sequence(written))
    }
}

impl Attention {
    /// [`Layer::forward_stream`]: the new steps' keys and values appended to each
    /// stream's cache (the keys transposed, `[width, context]`, so that a query's
    /// scores are a product that reads them where they lie; then the values,
    /// `[context, width]`), and
    /// each new step attending to its stream's steps so far. Every product and the
    /// softmax compute a new step's values in the same order as the whole sequence's
    /// forward pass does, so a stream's outputs are those of the sequence run at once
    /// (and the same whatever other streams share the batch: each row's products are
    /// its own).
    fn forward_cached<'a>(
        &self,
        params: &[f32],
        input: Activations<'a>,
        state: &mut StreamState<'_>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>> {
        let name = &self.name;
        let x = self.sequence_input(input)?;
        let p = self.weights(params)?;
        let (streams, steps, features) = x.dim();
        if features != self.width || streams != state.streams() || steps == 0 {
            return Err(Error::ShapeMismatch {
                context: format!("layer '{name}' input [streams, new steps, features] (at least one new step)"),
                expected: vec![state.streams(), steps.max(1), self.width],
                actual: x.shape().to_vec(),
            });
        }
        let context = state.context();
        let (d, hd) = (self.width, self.head_width());
        for b in 0..streams {
            let len = state.state(b).len();
            if len != context * 2 * d {
                return Err(Error::ShapeMismatch {
                    context: format!("attention layer '{name}': a stream's keys and values (2 · width · context)"),
                    expected: vec![2 * d * context],
                    actual: vec![len],
                });
            }
            if state.position(b).checked_add(steps).is_none_or(|end| end > context) {
                return Err(Error::InvalidInput(format!(
                    "attention layer '{name}': a stream at step {} cannot take {steps} more: it holds at most {context}",
                    state.position(b)
                )));
            }
        }
        let (x, _) = steps_in(x, ctx, name)?;
        let rows = streams * steps;
        let scale = 1.0 / (hd as f32).sqrt();
        let w = ctx.working;
        let scratch = w.slice_uninit::<f32>(self.stream_scratch(rows, steps, context))?;
        let mut qkv = rows_new(p.qkv_b, w.uninit::<f32, _>((rows, 3 * d))?);
        sgemm(1.0, x, p.qkv_w, 1.0, qkv.view_mut(), scratch)?;
        // A row of scores per new step (at most `SCORE_ROWS` at a time), or per head for
        // one new step (its heads at once).
        let score_rows = if steps == 1 { self.heads } else { steps.min(SCORE_ROWS) };
        let mut scores = w.zeros::<f32, _>((score_rows, context))?;
        let mut att = w.zeros::<f32, _>((rows, d))?;
        if steps == 1 {
            // One new step a stream: its key and value written into the cache where
            // they lie, then each head straight over the cache (the same bits as the
            // products below, without their packing and views).
            let qkv = qkv.as_slice().expect("a new array is contiguous");
            let att = att.as_slice_mut().expect("a new array is contiguous");
            let scores = &mut scores.as_slice_mut().expect("a new array is contiguous");
            for ((b, row), out) in qkv.chunks_exact(3 * d).enumerate().zip(att.chunks_exact_mut(d)) {
                let first = state.position(b);
                let (keys, values) = state.state_mut(b).split_at_mut(d * context);
                let (q, new) = row.split_at(d);
                let (key, value) = new.split_at(d);
                // Keys are stored transposed, `[features, context]`: one column a step.
                for (cached, &k) in keys.iter_mut().skip(first).step_by(context).zip(key) {
                    *cached = k;
                }
                values[first * d..(first + 1) * d].copy_from_slice(value);
                let scores = &mut scores[..self.heads * (first + 1)];
                attend_one(q, self.heads, scale, keys, context, values, d, scores, out);
            }
        }
        for b in (0..streams).filter(|_| steps > 1) {
            let first = state.position(b);
            let end = first + steps;
            let (keys, values) = state.state_mut(b).split_at_mut(d * context);
            let mut keys = ArrayViewMut2::from_shape((d, context), keys).expect("checked length");
            let mut values = ArrayViewMut2::from_shape((context, d), values).expect("checked length");
            let own = b * steps..(b + 1) * steps;
            keys.slice_mut(s![.., first..end]).assign(&qkv.slice(s![own.clone(), d..2 * d]).t());
            values.slice_mut(s![first..end, ..]).assign(&qkv.slice(s![own.clone(), 2 * d..]));
            let (keys, values) = (keys.view(), values.view());
            for h in 0..self.heads {
                let (qc, _, _) = self.head_columns(h);
                let k_t = keys.slice(s![qc.clone(), ..end]);
                let v = values.slice(s![..end, qc.clone()]);
                // The new steps' rows a block at a time: each row's sums are those of the
                // whole block's products (a product's rows are independent), and the
                // scores take `SCORE_ROWS × context` values, not `steps × context`.
                for from in (0..steps).step_by(SCORE_ROWS) {
                    let rows = own.start + from..own.start + (from + SCORE_ROWS).min(steps);
                    let mut block = scores.slice_mut(s![..rows.len(), ..]);
                    let q = qkv.slice(s![rows.clone(), qc.clone()]);
                    sgemm(scale, q, k_t, 0.0, block.slice_mut(s![.., ..end]), scratch)?;
                    causal_softmax_from(block.view_mut(), first + from);
                    sgemm(1.0, block.slice(s![.., ..end]), v, 0.0, att.slice_mut(s![rows, qc.clone()]), scratch)?;
                }
            }
        }
        let mut out = rows_new(p.proj_b, ctx.activations.uninit::<f32, _>((rows, d))?);
        sgemm(1.0, att.view(), p.proj_w, 1.0, out.view_mut(), scratch)?;
        let out = out.into_shape_with_order((streams, steps, d)).expect("a new array is standard");
        Ok(Activations::Sequence(freeze(out)))
    }

    /// Packing space for [`Attention::forward_cached`]'s products: `rows` new steps in
    /// all, `steps` per stream (their scores at most [`SCORE_ROWS`] at a time), against
    /// at most `context` steps (the same for every position, so that a stream's every
    /// step allocates alike).
    fn stream_scratch(&self, rows: usize, steps: usize, context: usize) -> usize {
        let (d, hd) = (self.width, self.head_width());
        let steps = steps.min(SCORE_ROWS);
        [
            scratch_len(rows, 3 * d, d),
            scratch_len(steps, context, hd),
            scratch_len(steps, hd, context),
            scratch_len(rows, d, d),
        ]
        .into_iter()
        .max()
        .unwrap_or(0)
    }
}

/// The most new steps of a stream whose scores a cached pass (a prompt, a slide) holds
/// at once: its scores take `SCORE_ROWS × context` values, whatever the prompt's length
/// (a prompt of a long context's length would otherwise take `context²`).
const SCORE_ROWS: usize = 128;

/// The error of an input gradient of another shape than the input's.
fn wrong_grad_input(name: &str, x: &ArrayView3<'_, f32>, actual: &[usize]) -> Error {
    Error::ShapeMismatch {
        context: format!("layer '{name}' input gradient"),
        expected: x.shape().to_vec(),
        actual: actual.to_vec(),
    }
}

impl Attention {
    /// The backward pass ([`Layer::backward`]), the input's gradient into `dx` (its
    /// shape checked by the caller) and given back when it came uninitialised.
    fn backward_with<'g>(
        &self,
        params: &[f32],
        grads: &mut [f32],
        pass: Pass<'_>,
        dx: Dx<'g>,
        tape: &mut Tape,
        ctx: &BackwardCtx<'_>,
    ) -> Result<Option<ArrayViewMut2<'g, f32>>> {
        let name = &self.name;
        let tape = tape_of::<AttentionTape>(tape, name)?;
        let p = self.weights(params)?;
        check_len(name, "gradients", grads.len(), self.param_count())?;
        let x = pass.input.sequence(name)?;
        self.check(&x, pass.mask.as_ref())?;
        let dy = pass.grad_output.sequence(name)?;
        if dy.dim() != x.dim() {
            return Err(Error::ShapeMismatch {
                context: format!("layer '{name}' output gradient"),
                expected: x.shape().to_vec(),
                actual: dy.shape().to_vec(),
            });
        }
        let (batch, steps, _) = x.dim();
        let l = self.layout(batch, steps);
        let len = l.len().ok_or_else(|| Error::InvalidInput(format!("layer '{name}': the batch overflows")))?;
        let print = fingerprint(pass.mask.as_ref(), batch, steps);
        let rows = steps_as_rows(x, name)?;
        let dy = steps_as_rows(dy, name)?;
        let w = &ctx.working;
        let work = Work {
            d_att: w.uninit::<f32, _>((l.rows(), self.width))?,
            d_qkv: zeros_new(w.uninit::<f32, _>((l.rows(), 3 * self.width))?),
            values: w.slice_zeroed::<f32>(2 * steps * steps)?,
            scratch: w.slice_uninit::<f32>(self.scratch(l.rows(), steps))?,
        };
        tape.kept
            .with(len, print, ctx.mgr, name, |kept| self.run_backward(p, grads, rows, l, pass.mask, kept, dy, dx, work))
    }

    /// The forward pass, the output in `ctx.activations` whatever the input's lifetime.
    fn forward_any<'a>(
        &self,
        params: &[f32],
        input: Activations<'_>,
        mask: Option<ArrayView2<'a, f32>>,
        tape: &mut Tape,
        ctx: &ForwardCtx<'a, '_>,
    ) -> Result<Activations<'a>> {
        let x = self.sequence_input(input)?;

        self.check(&x, mask.as_ref())?;
        let p = self.weights(params)?;
        let (batch, steps, _) = x.dim();
        if batch == 0 || steps == 0 {
            return Err(Error::InvalidInput(format!(
                "layer '{}': a batch of {batch} sequences of {steps} steps has nothing to attend over",
                self.name
            )));
        }
        let l = self.layout(batch, steps);
        let len = l.len().ok_or_else(|| {
            Error::InvalidInput(format!("layer '{}': a batch of {batch} × {steps} steps overflows", self.name))
        })?;
        let rows = steps_as_rows(x, &self.name)?;
        // The output starts as the projection's bias in every row; the product adds to it.
        let mut out_rows = rows_new(p.proj_b, ctx.activations.uninit::<f32, _>((l.rows(), self.width))?);
        let scratch = ctx.working.slice_uninit::<f32>(self.scratch(l.rows(), steps))?;
        let scores = ctx.working.slice_zeroed::<f32>(steps * steps)?;
        if ctx.training {
            let tape = tape_of::<AttentionTape>(tape, &self.name)?;
            let print = fingerprint(mask.as_ref(), batch, steps);
            tape.kept.fill(len, print, ctx, |kept| {
                self.forward_into(p, rows, l, mask, kept, scores, out_rows.view_mut(), scratch)
            })?;
        } else {
            if let Some(tape) = tape.get_mut::<AttentionTape>() {
                tape.kept.clear();
            }
            // Inference: the same values in working memory, the probabilities of one
            // head at a time (the recompute form's layout).
            let l = Layout { recompute: true, ..l };
            let mut work = ctx.working.zeros::<f32, _>(l.len().unwrap_or(usize::MAX))?;
            let work = work.as_slice_mut().expect("a new array is contiguous");
            self.forward_into(p, rows, l, mask, work, scores, out_rows.view_mut(), scratch)?;
        }
        let out = out_rows.into_shape_with_order((batch, steps, self.width)).expect("a new array is standard");
        Ok(Activations::Sequence(freeze(out)))
    }

    /// The input as a batch of sequences, or the error saying attention needs one.
    fn sequence_input<'a>(&self, input: Activations<'a>) -> Result<ArrayView3<'a, f32>> {
        match input {
            Activations::Sequence(x) => Ok(x),
            Activations::Flat(x) => Err(Error::ShapeMismatch {
                context: format!(
                    "layer '{}' attends over time and takes batches of sequences [batch, time, features]",
                    self.name
                ),
                expected: vec![x.nrows(), 0, self.width],
                actual: x.shape().to_vec(),
            }),
        }
    }
}
