//! The operations of a device step, as plain data: device addresses, sizes and scalars.
//! The CUDA compute launches each as cuBLAS or as a kernel of `kernels.cu`; the
//! simulator runs each as the host arithmetic of the network's own step (the same
//! functions: `gemm::sgemm`, the loss, the updater's check and commit) on its memory, so
//! a step on the simulated device gives the host's numbers.

use std::mem::MaybeUninit;

use ndarray::{ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2};
use workspace_cuda::device::sim::{Bytes, SimAccess, SimKernel};

use super::super::gemm::sgemm;
use super::super::loss::SoftmaxCrossEntropy;
use super::super::updater::{self, Updater};
use super::super::vector::sum_rows;

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
    /// One updater step over the `n` flat parameter `values` with their `grads` and the
    /// updater's state (`first`; `second` for Adam), at step `t`, stored only when every
    /// new value is finite; `status` (u32) ends as `n − i` for the first element `i` that
    /// is not, 0 when none is.
    Update {
        updater: Updater,
        t: i32,
        values: u64,
        grads: u64,
        first: u64,
        second: u64,
        n: usize,
        status: u64,
    },
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
                let scratch = as_scratch(cast_mut(scratch)?);
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
            Kernel::SoftmaxCrossEntropy { logits, labels, grad, loss, rows, classes, scale, .. } => {
                let labels_bytes = Bytes::of::<u32>(labels, rows).ok_or("labels overflow the address space")?;
                let loss_bytes = Bytes::of::<f64>(loss, 1).ok_or("overflow")?;
                let ([logits, labels], [grad, loss]) = memory
                    .io([f32s(rows * classes, logits)?, labels_bytes], [f32s(rows * classes, grad)?, loss_bytes])?;
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
            Kernel::Update { updater, t, values, grads, first, second, n, status } => {
                let second_len = if matches!(updater, Updater::Sgd { .. }) { 0 } else { n };
                let status_bytes = Bytes::of::<u32>(status, 1).ok_or("overflow")?;
                let ([grads], [values, first, second, status]) = memory.io(
                    [f32s(n, grads)?],
                    [f32s(n, values)?, f32s(n, first)?, f32s(second_len, second)?, status_bytes],
                )?;
                let second = (second_len > 0).then(|| cast_mut(second)).transpose()?;
                let bad = updater::step_or_first_non_finite(
                    updater,
                    t,
                    cast_mut(values)?,
                    cast(grads)?,
                    cast_mut(first)?,
                    second,
                );
                let status: &mut [u32] = bytemuck::try_cast_slice_mut(status).map_err(|e| e.to_string())?;
                status[0] = bad.map_or(0, |i| (n - i) as u32);
                Ok(())
            }
        }
    }
}

/// `values` as the product's packing buffer.
#[allow(unsafe_code)]
fn as_scratch(values: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: `MaybeUninit<f32>` has `f32`'s layout, and the product writes only
    // initialised values into its packing buffer (it packs f32s; it never stores an
    // uninitialised value), so the bytes are initialised f32s for whatever reads them
    // next, as the simulator's memory requires.
    unsafe { &mut *(values as *mut [f32] as *mut [MaybeUninit<f32>]) }
}
