//! The operations of a device step, as plain data: device addresses, sizes and scalars.
//! The CUDA compute launches each as cuBLAS or as a kernel of `kernels.cu`; the
//! simulator runs each as the host arithmetic of the network's own step (the same
//! functions: `gemm::sgemm`, the loss, the updater's check and commit) on its memory, so
//! a step on the simulated device gives the host's numbers.

use std::mem::MaybeUninit;

use ndarray::{ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2};
use workspace_cuda::device::sim::{Bytes, SimAccess, SimKernel};

use ndarray::s;

use super::super::attention::{head_backward, head_columns, head_forward, Head};
use super::super::gelu::GeluForm;
use super::super::gemm::sgemm;
use super::super::kernels::{gelu_backward, layer_norm_backward};
use super::super::loss::SoftmaxCrossEntropy;
use super::super::updater::{self, Updater};
use super::super::vector::{gelu_new, layer_norm_new, sum_rows};

/// A row-major product `C ← alpha · op(A) · op(B) + beta · C`, `C` being `m × n`, the
/// shared dimension `k`. `A` is stored `m × k`, or `k × m` when `a_t` (the product
/// reads its transpose); `B` is stored `k × n`, or `n × k` when `b_t`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gemm {
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) a: u64,
    pub(crate) a_t: bool,
    pub(crate) b: u64,
    pub(crate) b_t: bool,
    pub(crate) c: u64,
    pub(crate) alpha: f32,
    pub(crate) beta: f32,
    /// The host product's packing buffer ([`gemm::scratch_len`](super::super::gemm::scratch_len)
    /// values), in device memory; unused by cuBLAS (its workspace is its own).
    pub(crate) scratch: u64,
    pub(crate) scratch_len: usize,
}

/// One operation of a device step; see the module docs.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Kernel {
    Gemm(Gemm),
    /// `out[r, c] = bias[c]`.
    BiasRows {
        bias: u64,
        out: u64,
        rows: usize,
        cols: usize,
    },
    /// `y = max(x, 0)`.
    Relu {
        x: u64,
        y: u64,
        n: usize,
    },
    /// `dx = dy` where `y > 0`, else 0.
    ReluBackward {
        y: u64,
        dy: u64,
        dx: u64,
        n: usize,
    },
    /// `sum[c] = Σ_r x[r, c]`, in row order.
    SumRows {
        x: u64,
        sum: u64,
        rows: usize,
        cols: usize,
    },
    /// Softmax cross-entropy of `rows` rows of `classes` logits against `labels` (u32):
    /// the gradient (scaled by `scale`) into `grad`, the summed loss (f64) into `loss`;
    /// `row_loss` holds one f64 per row for devices that sum in a second pass.
    SoftmaxCrossEntropy {
        logits: u64,
        labels: u64,
        grad: u64,
        row_loss: u64,
        loss: u64,
        rows: usize,
        classes: usize,
        scale: f32,
    },
    /// `y = gelu(x)` (the tanh form).
    Gelu {
        x: u64,
        y: u64,
        n: usize,
    },
    /// `dx = dy · gelu'(x)`.
    GeluBackward {
        x: u64,
        dy: u64,
        dx: u64,
        n: usize,
    },
    /// Layer normalisation of `rows` rows of `cols`: `gamma` then `beta` (`cols` each) at
    /// `params`.
    LayerNorm {
        x: u64,
        params: u64,
        y: u64,
        rows: usize,
        cols: usize,
        eps: f32,
    },
    /// Its backward pass: `dgamma`, `dbeta` at `grads` (every element), `dx` unless 0;
    /// `stats` holds two values per row for devices that keep them between passes.
    LayerNormBackward {
        x: u64,
        params: u64,
        dy: u64,
        grads: u64,
        dx: u64,
        stats: u64,
        rows: usize,
        cols: usize,
        eps: f32,
    },
    /// `out[r] = table[ids[r]]` (ids u32, checked below `vocabulary` before they came).
    Embedding {
        ids: u64,
        table: u64,
        out: u64,
        rows: usize,
        width: usize,
        vocabulary: usize,
    },
    /// `dtable[v] = Σ dy[r]` over the rows `r` of token `v`, in row order (every element).
    EmbeddingBackward {
        ids: u64,
        dy: u64,
        dtable: u64,
        rows: usize,
        width: usize,
        vocabulary: usize,
    },
    /// `y[b, t] = x[b, t] + table[t]`.
    AddPositions {
        x: u64,
        table: u64,
        y: u64,
        batch: usize,
        steps: usize,
        width: usize,
    },
    /// `dtable[t] = Σ_b dy[b, t]`, in batch order; the rows past `steps` are zeroed
    /// (every element written).
    PositionsBackward {
        dy: u64,
        dtable: u64,
        batch: usize,
        steps: usize,
        width: usize,
        context: usize,
    },
    /// `y = a + b` (a residual join).
    Add {
        a: u64,
        b: u64,
        y: u64,
        n: usize,
    },
    /// `acc += x` (a residual join's gradient into its block's input's).
    AddAssign {
        acc: u64,
        x: u64,
        n: usize,
    },
    /// `y = x`.
    Copy {
        x: u64,
        y: u64,
        n: usize,
    },
    /// Causal multi-head attention between the projections, per sequence and head:
    /// `P = softmax(scale · Q·Kᵀ)` (causal) into `probs` (per sequence and head: the
    /// softmax statistics, `2 · steps`, then `P`, `steps²`), `O = P·V` into `att`
    /// (`[rows, width]`); `qkv` is `[rows, 3 · width]`.
    AttentionForward(Attention),
    /// Its backward pass: from `d_att` into `d_qkv` (every element), with `work`
    /// (`batch · heads · steps²` values: a GPU's every sequence's and head's `dP` at once,
    /// the host's one at a time).
    AttentionBackward(Attention),
    /// One updater step over the `n` flat parameter `values` with their `grads` and the
    /// updater's state (`first`; `second` for Adam), at step `t`, stored only when every
    /// new value is finite; `status` (u32) ends as `n − i` for the first element `i` that
    /// is not, 0 when none is. With `decay` (not 0), the values are multiplied by its
    /// factors (AdamW's decay: `1 − lr · wd` for matrices, 1 elsewhere) once checked.
    Update {
        updater: Updater,
        t: i32,
        values: u64,
        grads: u64,
        first: u64,
        second: u64,
        decay: u64,
        n: usize,
        status: u64,
    },
}

/// The arrays and shape of an attention core (see [`Kernel::AttentionForward`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Attention {
    pub(crate) qkv: u64,
    pub(crate) att: u64,
    pub(crate) probs: u64,
    /// Backward only: the gradients of `att` and of `qkv`, and the work values.
    pub(crate) d_att: u64,
    pub(crate) d_qkv: u64,
    pub(crate) work: u64,
    pub(crate) batch: u32,
    pub(crate) steps: u32,
    pub(crate) width: u32,
    pub(crate) heads: u32,
    /// The host products' packing buffer.
    pub(crate) scratch: u64,
    pub(crate) scratch_len: usize,
}

impl Attention {
    pub(crate) fn per_head(&self) -> usize {
        let t = self.steps as usize;
        2 * t + t * t
    }

    pub(crate) fn probs_len(&self) -> usize {
        self.batch as usize * self.heads as usize * self.per_head()
    }

    pub(crate) fn rows(&self) -> usize {
        self.batch as usize * self.steps as usize
    }
}

fn f32s(n: usize, at: u64) -> Result<Bytes, String> {
    Bytes::of::<f32>(at, n).ok_or_else(|| format!("{n} values overflow the address space"))
}

fn cast(bytes: &[u8]) -> Result<&[f32], String> {
    bytemuck::try_cast_slice(bytes).map_err(|e| format!("device memory is not f32-aligned: {e}"))
}

fn cast_mut(bytes: &mut [u8]) -> Result<&mut [f32], String> {
    bytemuck::try_cast_slice_mut(bytes).map_err(|e| format!("device memory is not f32-aligned: {e}"))
}

fn matrix(values: &[f32], rows: usize, cols: usize, transposed: bool) -> Result<ArrayView2<'_, f32>, String> {
    let shape = if transposed { (cols, rows) } else { (rows, cols) };
    let view = ArrayView2::from_shape(shape, values).map_err(|e| e.to_string())?;
    Ok(if transposed { view.reversed_axes() } else { view })
}

impl SimKernel for Kernel {
    fn name(&self) -> &'static str {
        match self {
            Kernel::Gemm(_) => "gemm",
            Kernel::BiasRows { .. } => "bias_rows",
            Kernel::Relu { .. } => "relu",
            Kernel::ReluBackward { .. } => "relu_backward",
            Kernel::SumRows { .. } => "sum_rows",
            Kernel::SoftmaxCrossEntropy { .. } => "softmax_xent",
            Kernel::Update { .. } => "update",
            Kernel::Gelu { .. } => "gelu",
            Kernel::GeluBackward { .. } => "gelu_backward",
            Kernel::LayerNorm { .. } => "layer_norm",
            Kernel::LayerNormBackward { .. } => "layer_norm_backward",
            Kernel::Embedding { .. } => "embedding",
            Kernel::EmbeddingBackward { .. } => "embedding_backward",
            Kernel::AddPositions { .. } => "add_positions",
            Kernel::PositionsBackward { .. } => "positions_backward",
            Kernel::Add { .. } => "add",
            Kernel::AddAssign { .. } => "add_assign",
            Kernel::Copy { .. } => "copy",
            Kernel::AttentionForward(_) => "attention_forward",
            Kernel::AttentionBackward(_) => "attention_backward",
        }
    }

    fn run(&self, memory: &mut SimAccess<'_>) -> Result<(), String> {
        match *self {
            Kernel::Gemm(g) => {
                let ([a, b], [c, scratch]) = memory.io(
                    [f32s(g.m * g.k, g.a)?, f32s(g.k * g.n, g.b)?],
                    [f32s(g.m * g.n, g.c)?, f32s(g.scratch_len, g.scratch)?],
                )?;
                let a = matrix(cast(a)?, g.m, g.k, g.a_t)?;
                let b = matrix(cast(b)?, g.k, g.n, g.b_t)?;
                let c = ArrayViewMut2::from_shape((g.m, g.n), cast_mut(c)?).map_err(|e| e.to_string())?;
                // SAFETY: the product's packing stores only the values it packs.
                let scratch = unsafe { as_scratch(cast_mut(scratch)?) };
                sgemm(g.alpha, a, b, g.beta, c, scratch).map_err(|e| e.to_string())
            }
            Kernel::BiasRows { bias, out, rows, cols } => {
                let ([bias], [out]) = memory.io([f32s(cols, bias)?], [f32s(rows * cols, out)?])?;
                let bias = cast(bias)?;
                if cols > 0 {
                    for row in cast_mut(out)?.chunks_exact_mut(cols) {
                        row.copy_from_slice(bias);
                    }
                }
                Ok(())
            }
            Kernel::Relu { x, y, n } => {
                let ([x], [y]) = memory.io([f32s(n, x)?], [f32s(n, y)?])?;
                for (y, &v) in cast_mut(y)?.iter_mut().zip(cast(x)?) {
                    *y = if v > 0.0 { v } else { 0.0 };
                }
                Ok(())
            }
            Kernel::ReluBackward { y, dy, dx, n } => {
                let ([y, dy], [dx]) = memory.io([f32s(n, y)?, f32s(n, dy)?], [f32s(n, dx)?])?;
                for ((dx, &y), &g) in cast_mut(dx)?.iter_mut().zip(cast(y)?).zip(cast(dy)?) {
                    *dx = if y > 0.0 { g } else { 0.0 };
                }
                Ok(())
            }
            Kernel::SumRows { x, sum, rows, cols } => {
                let ([x], [sum]) = memory.io([f32s(rows * cols, x)?], [f32s(cols, sum)?])?;
                let x = ArrayView2::from_shape((rows, cols), cast(x)?).map_err(|e| e.to_string())?;
                sum_rows(ArrayViewMut1::from(cast_mut(sum)?), x);
                Ok(())
            }
            Kernel::SoftmaxCrossEntropy { logits, labels, grad, row_loss, loss, rows, classes, scale } => {
                let labels_bytes = Bytes::of::<u32>(labels, rows).ok_or("labels overflow the address space")?;
                let loss_bytes = Bytes::of::<f64>(loss, 1).ok_or("overflow")?;
                // The rows' losses are a GPU's (summed in a second pass): checked here, as
                // every range a device writes.
                let rows_bytes = Bytes::of::<f64>(row_loss, rows).ok_or("overflow")?;
                let ([logits, labels], [grad, loss, _]) = memory.io(
                    [f32s(rows * classes, logits)?, labels_bytes],
                    [f32s(rows * classes, grad)?, loss_bytes, rows_bytes],
                )?;
                let logits = ArrayView2::from_shape((rows, classes), cast(logits)?).map_err(|e| e.to_string())?;
                let labels: &[u32] = bytemuck::try_cast_slice(labels).map_err(|e| e.to_string())?;
                let grad = ArrayViewMut2::from_shape((rows, classes), cast_mut(grad)?).map_err(|e| e.to_string())?;
                let total = SoftmaxCrossEntropy
                    .loss_sum_and_gradient(logits, ArrayView1::from(labels), None, scale, grad)
                    .map_err(|e| e.to_string())?;
                let loss: &mut [f64] = bytemuck::try_cast_slice_mut(loss).map_err(|e| e.to_string())?;
                loss[0] = total;
                Ok(())
            }
            Kernel::Update { updater, t, values, grads, first, second, decay, n, status } => {
                let second_len = if matches!(updater, Updater::Sgd { .. }) { 0 } else { n };
                let decay_len = if decay == 0 { 0 } else { n };
                let status_bytes = Bytes::of::<u32>(status, 1).ok_or("overflow")?;
                let ([grads, decay], [values, first, second, status]) = memory.io(
                    [f32s(n, grads)?, f32s(decay_len, decay)?],
                    [f32s(n, values)?, f32s(n, first)?, f32s(second_len, second)?, status_bytes],
                )?;
                let second = (second_len > 0).then(|| cast_mut(second)).transpose()?;
                let decay = (decay_len > 0).then(|| cast(decay)).transpose()?;
                let (values, grads, first) = (cast_mut(values)?, cast(grads)?, cast_mut(first)?);
                let bad = updater::step_or_first_non_finite(updater, t, values, grads, first, second, decay);
                let status: &mut [u32] = bytemuck::try_cast_slice_mut(status).map_err(|e| e.to_string())?;
                status[0] = bad.map_or(0, |i| (n - i) as u32);
                Ok(())
            }
            Kernel::Gelu { x, y, n } => {
                let ([x], [y]) = memory.io([f32s(n, x)?], [f32s(n, y)?])?;
                let x = ArrayView2::from_shape((1, n), cast(x)?).map_err(|e| e.to_string())?;
                // SAFETY: `gelu_new` writes every element with a value it computed.
                let y = unsafe { as_scratch(cast_mut(y)?) };
                let y = ArrayViewMut2::from_shape((1, n), y).map_err(|e| e.to_string())?;
                gelu_new(x, y, GeluForm::Tanh);
                Ok(())
            }
            Kernel::GeluBackward { x, dy, dx, n } => {
                let ([x, dy], [dx]) = memory.io([f32s(n, x)?, f32s(n, dy)?], [f32s(n, dx)?])?;
                let row = |v| ArrayView2::from_shape((1, n), v).map_err(|e| e.to_string());
                let dx = ArrayViewMut2::from_shape((1, n), cast_mut(dx)?).map_err(|e| e.to_string())?;
                gelu_backward(row(cast(x)?)?, row(cast(dy)?)?, dx, GeluForm::Tanh);
                Ok(())
            }
            Kernel::LayerNorm { x, params, y, rows, cols, eps } => {
                let ([x, p], [y]) =
                    memory.io([f32s(rows * cols, x)?, f32s(2 * cols, params)?], [f32s(rows * cols, y)?])?;
                let (gamma, beta) = cast(p)?.split_at(cols);
                let x = ArrayView2::from_shape((rows, cols), cast(x)?).map_err(|e| e.to_string())?;
                // SAFETY: `layer_norm_new` writes every element with a value it computed.
                let y = unsafe { as_scratch(cast_mut(y)?) };
                let y = ArrayViewMut2::from_shape((rows, cols), y).map_err(|e| e.to_string())?;
                layer_norm_new(x, ArrayView1::from(gamma), ArrayView1::from(beta), eps, y);
                Ok(())
            }
            Kernel::LayerNormBackward { x, params, dy, grads, dx, stats, rows, cols, eps } => {
                let n = rows * cols;
                let dx_len = if dx == 0 { 0 } else { n };
                // The rows' statistics are a GPU's: checked, not needed here.
                let ([x, p, dy], [g, dx, _]) = memory.io(
                    [f32s(n, x)?, f32s(cols, params)?, f32s(n, dy)?],
                    [f32s(2 * cols, grads)?, f32s(dx_len, dx)?, f32s(2 * rows, stats)?],
                )?;
                let (dgamma, dbeta) = cast_mut(g)?.split_at_mut(cols);
                let x = ArrayView2::from_shape((rows, cols), cast(x)?).map_err(|e| e.to_string())?;
                let dy = ArrayView2::from_shape((rows, cols), cast(dy)?).map_err(|e| e.to_string())?;
                let dx = match dx_len {
                    0 => None,
                    _ => Some(ArrayViewMut2::from_shape((rows, cols), cast_mut(dx)?).map_err(|e| e.to_string())?),
                };
                let gamma = ArrayView1::from(cast(p)?);
                layer_norm_backward(x, gamma, eps, dy, ArrayViewMut1::from(dgamma), ArrayViewMut1::from(dbeta), dx);
                Ok(())
            }
            Kernel::Embedding { ids, table, out, rows, width, vocabulary } => {
                let ids_bytes = Bytes::of::<u32>(ids, rows).ok_or("overflow")?;
                let ([ids, table], [out]) =
                    memory.io([ids_bytes, f32s(vocabulary * width, table)?], [f32s(rows * width, out)?])?;
                let ids: &[u32] = bytemuck::try_cast_slice(ids).map_err(|e| e.to_string())?;
                let table = cast(table)?;
                if width > 0 {
                    for (row, &id) in cast_mut(out)?.chunks_exact_mut(width).zip(ids) {
                        let id = id as usize;
                        let from = table.get(id * width..(id + 1) * width).ok_or("a token id beyond the vocabulary")?;
                        row.copy_from_slice(from);
                    }
                }
                Ok(())
            }
            Kernel::EmbeddingBackward { ids, dy, dtable, rows, width, vocabulary } => {
                let ids_bytes = Bytes::of::<u32>(ids, rows).ok_or("overflow")?;
                let ([ids, dy], [dtable]) =
                    memory.io([ids_bytes, f32s(rows * width, dy)?], [f32s(vocabulary * width, dtable)?])?;
                let ids: &[u32] = bytemuck::try_cast_slice(ids).map_err(|e| e.to_string())?;
                let (dy, dtable) = (cast(dy)?, cast_mut(dtable)?);
                dtable.fill(0.0);
                if width > 0 {
                    for (g, &id) in dy.chunks_exact(width).zip(ids) {
                        let id = id as usize;
                        let acc =
                            dtable.get_mut(id * width..(id + 1) * width).ok_or("a token id beyond the vocabulary")?;
                        acc.iter_mut().zip(g).for_each(|(acc, &g)| *acc += g);
                    }
                }
                Ok(())
            }
            Kernel::AddPositions { x, table, y, batch, steps, width } => {
                let n = batch * steps * width;
                let ([x, table], [y]) = memory.io([f32s(n, x)?, f32s(steps * width, table)?], [f32s(n, y)?])?;
                let (x, table) = (cast(x)?, cast(table)?);
                if !table.is_empty() {
                    for ((y, x), p) in cast_mut(y)?.iter_mut().zip(x).zip(table.iter().cycle()) {
                        *y = x + p;
                    }
                }
                Ok(())
            }
            Kernel::PositionsBackward { dy, dtable, batch, steps, width, context } => {
                let ([dy], [dtable]) =
                    memory.io([f32s(batch * steps * width, dy)?], [f32s(context * width, dtable)?])?;
                let (dy, dtable) = (cast(dy)?, cast_mut(dtable)?);
                dtable.fill(0.0);
                let per_sequence = steps * width;
                if per_sequence > 0 {
                    for sequence in dy.chunks_exact(per_sequence) {
                        dtable[..per_sequence].iter_mut().zip(sequence).for_each(|(acc, &g)| *acc += g);
                    }
                }
                Ok(())
            }
            Kernel::Add { a, b, y, n } => {
                let ([a, b], [y]) = memory.io([f32s(n, a)?, f32s(n, b)?], [f32s(n, y)?])?;
                for ((y, a), b) in cast_mut(y)?.iter_mut().zip(cast(a)?).zip(cast(b)?) {
                    *y = a + b;
                }
                Ok(())
            }
            Kernel::AddAssign { acc, x, n } => {
                let ([x], [acc]) = memory.io([f32s(n, x)?], [f32s(n, acc)?])?;
                cast_mut(acc)?.iter_mut().zip(cast(x)?).for_each(|(acc, &x)| *acc += x);
                Ok(())
            }
            Kernel::Copy { x, y, n } => {
                let ([x], [y]) = memory.io([f32s(n, x)?], [f32s(n, y)?])?;
                y.copy_from_slice(x);
                Ok(())
            }
            Kernel::AttentionForward(a) => attention_forward(a, memory),
            Kernel::AttentionBackward(a) => attention_backward(a, memory),
        }
    }
}

/// `values` as a host kernel's output of `MaybeUninit`s (a packing buffer, a new array).
///
/// # Safety
///
/// Whatever writes through the result writes only initialised values (never
/// `MaybeUninit::uninit()`): the bytes are simulated device memory, read later as
/// initialised `u8`s. The host kernels it is handed to (the product's packing,
/// `gelu_new`, `layer_norm_new`) only store values they computed.
#[allow(unsafe_code)]
unsafe fn as_scratch(values: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: `MaybeUninit<f32>` has `f32`'s layout; the caller keeps the bytes
    // initialised (this function's contract).
    unsafe { &mut *(values as *mut [f32] as *mut [MaybeUninit<f32>]) }
}

/// The attention core's forward pass on the host: per sequence and head, the layer's
/// own [`head_forward`] (so the same bits).
fn attention_forward(a: Attention, memory: &mut SimAccess<'_>) -> Result<(), String> {
    let (t, d, heads) = (a.steps as usize, a.width as usize, a.heads as usize);
    let (rows, hd) = (a.rows(), d / heads.max(1));
    let ([qkv], [att, probs, scratch]) = memory.io(
        [f32s(rows * 3 * d, a.qkv)?],
        [f32s(rows * d, a.att)?, f32s(a.probs_len(), a.probs)?, f32s(a.scratch_len, a.scratch)?],
    )?;
    let qkv = ArrayView2::from_shape((rows, 3 * d), cast(qkv)?).map_err(|e| e.to_string())?;
    let mut att = ArrayViewMut2::from_shape((rows, d), cast_mut(att)?).map_err(|e| e.to_string())?;
    // SAFETY: the products' packing stores only the values it packs.
    let (probs, scratch) = (cast_mut(probs)?, unsafe { as_scratch(cast_mut(scratch)?) });
    let scale = 1.0 / (hd as f32).sqrt();
    for (i, slot) in probs.chunks_exact_mut(a.per_head()).enumerate() {
        let (b, h) = (i / heads, i % heads);
        let (rows, columns) = (b * t..(b + 1) * t, head_columns(d, hd, h));
        let o = att.slice_mut(s![rows.clone(), columns.0.clone()]);
        let head = Head::of(qkv, rows, columns);
        let (stats, p) = slot.split_at_mut(2 * t);
        let p = ArrayViewMut2::from_shape((t, t), p).map_err(|e| e.to_string())?;
        head_forward(scale, head, None, stats, p, o, scratch).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The attention core's backward pass on the host: per sequence and head, the layer's
/// own [`head_backward`].
fn attention_backward(a: Attention, memory: &mut SimAccess<'_>) -> Result<(), String> {
    let (t, d, heads) = (a.steps as usize, a.width as usize, a.heads as usize);
    let (rows, hd) = (a.rows(), d / heads.max(1));
    let ([qkv, probs, d_att], [d_qkv, work, scratch]) = memory.io(
        [f32s(rows * 3 * d, a.qkv)?, f32s(a.probs_len(), a.probs)?, f32s(rows * d, a.d_att)?],
        [f32s(rows * 3 * d, a.d_qkv)?, f32s(a.rows() * heads * t, a.work)?, f32s(a.scratch_len, a.scratch)?],
    )?;
    let qkv = ArrayView2::from_shape((rows, 3 * d), cast(qkv)?).map_err(|e| e.to_string())?;
    let d_att = ArrayView2::from_shape((rows, d), cast(d_att)?).map_err(|e| e.to_string())?;
    let mut d_qkv = ArrayViewMut2::from_shape((rows, 3 * d), cast_mut(d_qkv)?).map_err(|e| e.to_string())?;
    // A GPU's work holds every sequence's and head's `dP`; one at a time here.
    let mut d_probs = ArrayViewMut2::from_shape((t, t), &mut cast_mut(work)?[..t * t]).map_err(|e| e.to_string())?;
    // SAFETY: the products' packing stores only the values it packs.
    let (probs, scratch) = (cast(probs)?, unsafe { as_scratch(cast_mut(scratch)?) });
    let scale = 1.0 / (hd as f32).sqrt();
    for (i, slot) in probs.chunks_exact(a.per_head()).enumerate() {
        let (b, h) = (i / heads, i % heads);
        let rows = b * t..(b + 1) * t;
        let (qc, kc, vc) = head_columns(d, hd, h);
        let head = Head::of(qkv, rows.clone(), (qc.clone(), kc.clone(), vc.clone()));
        let p = ArrayView2::from_shape((t, t), &slot[2 * t..]).map_err(|e| e.to_string())?;
        let d_o = d_att.slice(s![rows.clone(), qc.clone()]);
        let grads = d_qkv.multi_slice_mut((s![rows.clone(), qc], s![rows.clone(), kc], s![rows, vc]));
        head_backward(scale, head, p, d_o, d_probs.view_mut(), grads, scratch).map_err(|e| e.to_string())?;
    }
    Ok(())
}
