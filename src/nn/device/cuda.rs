//! The CUDA compute: products through cuBLAS on the step's stream, every other operation
//! a kernel of `kernels.cu`, compiled once by NVRTC and launched with the driver's raw
//! launch (`cuLaunchKernel` with the arguments on the stack: cudarc's `launch_builder`
//! allocates per launch, which a steady step must not).
//!
//! cudarc loads the CUDA libraries at run time (`dynamic-loading`, bindings of the CUDA
//! 13.0 API) and tries the names of either major version (`libnvrtc.so.13`,
//! `libnvrtc.so.12`, `libcublas.so.13`, ...), on the loader's path: point
//! `LD_LIBRARY_PATH` at a CUDA toolkit's `lib64`, or at the `nvidia/cu13/lib` folder of
//! the `nvidia-cuda-nvrtc` and `nvidia-cublas` wheels. A library that is missing is an
//! error naming it, never a panic.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use workspace_core::WorkspaceMode;
use workspace_cuda::cudarc::cublas::{sys as cublas_sys, CudaBlas};
use workspace_cuda::cudarc::driver::{result as driver, sys as driver_sys, CudaModule, CudaStream};
use workspace_cuda::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use workspace_cuda::CudaDevice;

use crate::{Error, Result};

use super::super::updater::{adam_step, Updater};
use super::kernel::{Gemm, Kernel};
use super::train::{DeviceStep, Plan, Trainer};
use super::Compute;

/// The CUDA C source of carve's device kernels.
pub const KERNELS_SOURCE: &str = include_str!("kernels.cu");

/// The kernels of [`KERNELS_SOURCE`], as the step looks them up.
pub const KERNEL_NAMES: [&str; 24] = [
    "carve_bias_rows",
    "carve_relu",
    "carve_relu_backward",
    "carve_sum_rows",
    "carve_softmax_xent",
    "carve_sum_f64",
    "carve_adam_check",
    "carve_adam_commit",
    "carve_sgd_check",
    "carve_sgd_commit",
    "carve_gelu",
    "carve_gelu_backward",
    "carve_layer_norm",
    "carve_layer_norm_backward_rows",
    "carve_layer_norm_backward_params",
    "carve_embedding",
    "carve_embedding_backward",
    "carve_add_positions",
    "carve_positions_backward",
    "carve_add",
    "carve_add_assign",
    "carve_causal_softmax",
    "carve_causal_softmax_backward",
    "carve_scale",
];

/// A kernel argument, as the launch wants it.
macro_rules! arg {
    ($v:expr) => {
        (&mut $v) as *mut _ as *mut c_void
    };
}

/// Indices into [`KERNEL_NAMES`].
#[derive(Clone, Copy)]
enum Function {
    BiasRows,
    Relu,
    ReluBackward,
    SumRows,
    SoftmaxXent,
    SumF64,
    AdamCheck,
    AdamCommit,
    SgdCheck,
    SgdCommit,
    Gelu,
    GeluBackward,
    LayerNorm,
    LayerNormBackwardRows,
    LayerNormBackwardParams,
    Embedding,
    EmbeddingBackward,
    AddPositions,
    PositionsBackward,
    Add,
    AddAssign,
    CausalSoftmax,
    CausalSoftmaxBackward,
    #[allow(dead_code)] // compiled and checked; no operation launches it yet
    Scale,
}

/// A row-major product of `count` matrices at a fixed stride: `C ← alpha·op(A)·op(B) +
/// beta·C`, each matrix's rows `ld` values apart.
#[derive(Clone, Copy)]
struct Batched {
    m: usize,
    n: usize,
    k: usize,
    a: (u64, usize, bool, i64),
    b: (u64, usize, bool, i64),
    c: (u64, usize, i64),
    alpha: f32,
    beta: f32,
    count: usize,
}

/// Bytes of the step's working memory handed to cuBLAS as its workspace for each product
/// (cuBLAS's own default before Hopper; it needs none, and uses more when it has it).
const CUBLAS_WORKSPACE: usize = 4 << 20;

/// Threads per block of the elementwise kernels and of the softmax's rows.
const BLOCK: u32 = 256;

/// Whether a library cudarc loads on demand can be loaded; a panic of its loader (a
/// library without the symbols asked for) is a "no".
fn library_present(present: unsafe fn() -> bool) -> bool {
    // SAFETY: `is_culib_present` only tries to load the library; it calls nothing in it.
    catch_unwind(|| unsafe { present() }).unwrap_or(false)
}

fn missing(library: &str) -> Error {
    Error::InvalidConfig {
        reason: format!(
            "the CUDA library {library} (CUDA 12 or 13) was not found on the loader's path; add the folder holding \
             it to LD_LIBRARY_PATH (a CUDA toolkit's lib64, or the nvidia/cu13/lib folder of its PyPI wheel)"
        ),
    }
}

/// Compiles [`KERNELS_SOURCE`] to PTX for the virtual architecture `arch` (as
/// `compute_90`) with NVRTC: no GPU needed, only `libnvrtc`.
///
/// ```no_run
/// let ptx = carve::nn::device::compile_kernels("compute_90")?;
/// assert!(ptx.contains(".entry carve_adam_commit"));
/// # Ok::<(), carve::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::InvalidConfig`] when NVRTC cannot be loaded, or when a kernel does not
/// compile (with NVRTC's log).
pub fn compile_kernels(arch: &str) -> Result<String> {
    compile(arch).map(|ptx| ptx.to_src())
}

fn compile(arch: &str) -> Result<Ptx> {
    if !library_present(workspace_cuda::cudarc::nvrtc::sys::is_culib_present) {
        return Err(missing("libnvrtc"));
    }
    let options = CompileOptions {
        // The host's arithmetic: no fused multiply-adds the host does not use, IEEE
        // division and square root.
        fmad: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        options: vec![format!("--gpu-architecture={arch}")],
        name: Some("carve_kernels.cu".into()),
        ..CompileOptions::default()
    };
    catch_unwind(AssertUnwindSafe(|| compile_ptx_with_opts(KERNELS_SOURCE, options)))
        .map_err(|_| missing("libnvrtc"))?
        .map_err(|e| Error::InvalidConfig {
            reason: format!("NVRTC failed to compile carve's kernels for {arch}: {e}"),
        })
}

/// The CUDA compute of one stream.
pub(crate) struct CudaCompute {
    gpu: CudaDevice,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    functions: [driver_sys::CUfunction; KERNEL_NAMES.len()],
    /// Keeps the functions loaded.
    _module: Arc<CudaModule>,
}

fn driver_error(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::InvalidConfig { reason: format!("CUDA: {what} failed: {e:?}") }
}

impl CudaCompute {
    fn new(ordinal: usize) -> Result<CudaCompute> {
        let gpu = CudaDevice::new(ordinal)?;
        let context = gpu.context().clone();
        let (major, minor) =
            context.compute_capability().map_err(|e| driver_error("asking the compute capability", e))?;
        let ptx = compile(&format!("compute_{major}{minor}"))?;
        let module = context.load_module(ptx).map_err(|e| driver_error("loading carve's kernels", e))?;
        let mut functions = [std::ptr::null_mut(); KERNEL_NAMES.len()];
        for (slot, name) in functions.iter_mut().zip(KERNEL_NAMES) {
            *slot = module.load_function(name).map_err(|e| driver_error(name, e))?.cu_function();
        }
        if !library_present(workspace_cuda::cudarc::cublas::sys::is_culib_present) {
            return Err(missing("libcublas"));
        }
        let stream = workspace_cuda::Device::default_stream(&gpu);
        let blas = catch_unwind(AssertUnwindSafe(|| CudaBlas::new(stream.clone())))
            .map_err(|_| missing("libcublas"))?
            .map_err(|e| driver_error("creating a cuBLAS handle", e))?;
        Ok(CudaCompute { gpu, stream, blas, functions, _module: module })
    }

    /// Hands cuBLAS `len` values at `at` (the step's working memory, allocated for the
    /// products about to be issued) as its workspace; none when `len` is 0.
    ///
    /// # Safety
    ///
    /// `at..at + 4·len` is device memory that stays allocated, and is used by nothing
    /// else, until every product issued with it completes in the stream's order.
    unsafe fn set_workspace(&self, at: u64, len: usize) -> Result<()> {
        let (pointer, bytes) = match len {
            0 => (std::ptr::null_mut(), 0),
            _ => (at as *mut c_void, len * size_of::<f32>()),
        };
        // SAFETY: per this function's contract; the handle is this compute's.
        unsafe { cublas_sys::cublasSetWorkspace_v2(*self.blas.handle(), pointer, bytes) }
            .result()
            .map_err(|e| driver_error("setting cuBLAS's workspace", e))
    }

    /// Launches `function` with `args` (pointers to each argument's value).
    ///
    /// # Safety
    ///
    /// `args` must match the kernel's parameters, and the kernel's memory accesses must be
    /// valid (see [`Compute::run`]).
    unsafe fn launch(&self, function: Function, grid: u32, block: u32, args: &mut [*mut c_void]) -> Result<()> {
        // SAFETY: per this function's contract.
        unsafe {
            driver::launch_kernel(
                self.functions[function as usize],
                (grid.max(1), 1, 1),
                (block, 1, 1),
                0,
                self.stream.cu_stream(),
                args,
            )
        }
        .map_err(|e| driver_error(KERNEL_NAMES[function as usize], e))
    }

    /// # Safety
    ///
    /// As [`Compute::run`] for the product's three matrices.
    unsafe fn gemm(&self, g: Gemm) -> Result<()> {
        use cublas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        // SAFETY: the product's buffer is the step's, allocated for this product (the
        // contract of `Compute::run`).
        unsafe { self.set_workspace(g.scratch, g.scratch_len) }?;
        let dim =
            |v: usize| i32::try_from(v).map_err(|_| driver_error("a product", format!("{v} exceeds cuBLAS's int")));
        let (m, n, k) = (dim(g.m)?, dim(g.n)?, dim(g.k)?);
        // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ.
        let (op_b, ldb) = if g.b_t { (CUBLAS_OP_T, k) } else { (CUBLAS_OP_N, n) };
        let (op_a, lda) = if g.a_t { (CUBLAS_OP_T, m) } else { (CUBLAS_OP_N, k) };
        // SAFETY: the handle is on this compute's stream; the matrices are valid per the
        // contract, with the leading dimensions of their stored shapes.
        unsafe {
            workspace_cuda::cudarc::cublas::result::sgemm(
                *self.blas.handle(),
                op_b,
                op_a,
                n,
                m,
                k,
                &g.alpha,
                g.b as *const f32,
                ldb.max(1),
                g.a as *const f32,
                lda.max(1),
                &g.beta,
                g.c as *mut f32,
                n.max(1),
            )
        }
        .map_err(|e| driver_error("cuBLAS sgemm", e))
    }

    /// # Safety
    ///
    /// As [`Compute::run`] for every matrix of the batch.
    unsafe fn batched(&self, p: Batched) -> Result<()> {
        use cublas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        let dim =
            |v: usize| i32::try_from(v).map_err(|_| driver_error("a product", format!("{v} exceeds cuBLAS's int")));
        let (m, n, k, count) = (dim(p.m)?, dim(p.n)?, dim(p.k)?, dim(p.count)?);
        let ((a, lda, a_t, stride_a), (b, ldb, b_t, stride_b), (c, ldc, stride_c)) = (p.a, p.b, p.c);
        let op = |t: bool| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
        // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: the same leading
        // dimensions (the rows' strides), the operands swapped.
        // SAFETY: the handle is on this compute's stream; the matrices are valid per the
        // contract, with the leading dimensions and strides of their storage.
        unsafe {
            workspace_cuda::cudarc::cublas::result::sgemm_strided_batched(
                *self.blas.handle(),
                op(b_t),
                op(a_t),
                n,
                m,
                k,
                &p.alpha,
                b as *const f32,
                dim(ldb)?.max(1),
                stride_b,
                a as *const f32,
                dim(lda)?.max(1),
                stride_a,
                &p.beta,
                c as *mut f32,
                dim(ldc)?.max(1),
                stride_c,
                count,
            )
        }
        .map_err(|e| driver_error("cuBLAS sgemm_strided_batched", e))
    }

    /// The attention core's forward pass: per head, every sequence's scores by one
    /// batched product (the sequences `steps · 3 · width` values apart in `qkv`, their
    /// probability blocks `heads · per_head` apart), the causal softmax of every block at
    /// once, then per head the outputs by another batched product.
    ///
    /// # Safety
    ///
    /// As [`Compute::run`].
    unsafe fn attention_forward(&self, a: super::kernel::Attention) -> Result<()> {
        // SAFETY: the core's buffer is the step's, allocated for it.
        unsafe { self.set_workspace(a.scratch, a.scratch_len) }?;
        let (t, d, heads, batch) = (a.steps as usize, a.width as usize, a.heads as usize, a.batch as usize);
        let (hd, per_head) = (d / heads.max(1), a.per_head());
        let scale = 1.0 / (hd as f32).sqrt();
        let f = |values: usize| (values * size_of::<f32>()) as u64;
        // Strides from one sequence to the next.
        let (seq_qkv, seq_probs, seq_att) = ((t * 3 * d) as i64, (heads * per_head) as i64, (t * d) as i64);
        for h in 0..heads {
            // S = scale · Q·Kᵀ.
            let q = (a.qkv + f(h * hd), 3 * d, false, seq_qkv);
            let k = (a.qkv + f(d + h * hd), 3 * d, true, seq_qkv);
            let s = (a.probs + f(h * per_head + 2 * t), t, seq_probs);
            // SAFETY: per this function's contract (as each product and launch below).
            unsafe {
                self.batched(Batched { m: t, n: t, k: hd, a: q, b: k, c: s, alpha: scale, beta: 0.0, count: batch })
            }?;
        }
        let (mut p, mut blocks, mut steps, mut per) = (a.probs, (batch * heads) as u64, t as u64, per_head as u64);
        let rows = row_blocks(batch * heads * t)?;
        // SAFETY: as above.
        unsafe {
            self.launch(Function::CausalSoftmax, rows, BLOCK, &mut [arg!(p), arg!(blocks), arg!(steps), arg!(per)])
        }?;
        for h in 0..heads {
            // O = P·V.
            let pm = (a.probs + f(h * per_head + 2 * t), t, false, seq_probs);
            let v = (a.qkv + f(2 * d + h * hd), 3 * d, false, seq_qkv);
            let o = (a.att + f(h * hd), d, seq_att);
            // SAFETY: as above.
            unsafe {
                self.batched(Batched { m: t, n: hd, k: t, a: pm, b: v, c: o, alpha: 1.0, beta: 0.0, count: batch })
            }?;
        }
        Ok(())
    }

    /// The attention core's backward pass, batched over the sequences per head as the
    /// forward pass; `work` holds every sequence's and head's `dP` (`steps²` values each,
    /// sequence-major as the probabilities).
    ///
    /// # Safety
    ///
    /// As [`Compute::run`].
    unsafe fn attention_backward(&self, a: super::kernel::Attention) -> Result<()> {
        // SAFETY: the core's buffer is the step's, allocated for it.
        unsafe { self.set_workspace(a.scratch, a.scratch_len) }?;
        let (t, d, heads, batch) = (a.steps as usize, a.width as usize, a.heads as usize, a.batch as usize);
        let (hd, per_head) = (d / heads.max(1), a.per_head());
        let mut scale = 1.0 / (hd as f32).sqrt();
        let f = |values: usize| (values * size_of::<f32>()) as u64;
        let (seq_qkv, seq_probs, seq_att) = ((t * 3 * d) as i64, (heads * per_head) as i64, (t * d) as i64);
        let seq_work = (heads * t * t) as i64;
        let product = |m, n, k, a, b, c| Batched { m, n, k, a, b, c, alpha: 1.0, beta: 0.0, count: batch };
        for h in 0..heads {
            let d_o = (a.d_att + f(h * hd), d, false, seq_att);
            let dp = (a.work + f(h * t * t), t, seq_work);
            // dP = dO·Vᵀ, dV = Pᵀ·dO.
            let v_t = (a.qkv + f(2 * d + h * hd), 3 * d, true, seq_qkv);
            // SAFETY: per this function's contract (as each product and launch below).
            unsafe { self.batched(product(t, t, hd, d_o, v_t, dp)) }?;
            let p_t = (a.probs + f(h * per_head + 2 * t), t, true, seq_probs);
            let dv = (a.d_qkv + f(2 * d + h * hd), 3 * d, seq_qkv);
            // SAFETY: as above.
            unsafe { self.batched(product(t, hd, t, p_t, d_o, dv)) }?;
        }
        let (mut p, mut dp, mut blocks, mut steps, mut per) =
            (a.probs, a.work, (batch * heads) as u64, t as u64, per_head as u64);
        let rows = row_blocks(batch * heads * t)?;
        let mut args = [arg!(p), arg!(dp), arg!(blocks), arg!(steps), arg!(per), arg!(scale)];
        // SAFETY: as above.
        unsafe { self.launch(Function::CausalSoftmaxBackward, rows, BLOCK, &mut args) }?;
        for h in 0..heads {
            // dQ = dS·K, dK = dSᵀ·Q.
            let ds = (a.work + f(h * t * t), t, false, seq_work);
            let k = (a.qkv + f(d + h * hd), 3 * d, false, seq_qkv);
            let dq = (a.d_qkv + f(h * hd), 3 * d, seq_qkv);
            // SAFETY: as above.
            unsafe { self.batched(product(t, hd, t, ds, k, dq)) }?;
            let ds_t = (a.work + f(h * t * t), t, true, seq_work);
            let q = (a.qkv + f(h * hd), 3 * d, false, seq_qkv);
            let dk = (a.d_qkv + f(d + h * hd), 3 * d, seq_qkv);
            // SAFETY: as above.
            unsafe { self.batched(product(t, hd, t, ds_t, q, dk)) }?;
        }
        Ok(())
    }
}

/// One block per row, for the kernels that reduce along rows.
fn row_blocks(rows: usize) -> Result<u32> {
    u32::try_from(rows.max(1)).map_err(|_| driver_error("a row kernel", format!("{rows} rows")))
}

/// Blocks for `n` elements at [`BLOCK`] threads each (grid-stride loops cover the rest).
fn grid(n: usize) -> u32 {
    u32::try_from(n.div_ceil(BLOCK as usize)).unwrap_or(u32::MAX).clamp(1, 65_535)
}

impl Compute for CudaCompute {
    type D = CudaDevice;

    fn device(&self) -> &CudaDevice {
        &self.gpu
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn gemm_scratch(&self, _m: usize, _n: usize, _k: usize) -> usize {
        CUBLAS_WORKSPACE / size_of::<f32>()
    }

    fn attention_scratch(&self, _steps: usize, _head_width: usize) -> usize {
        CUBLAS_WORKSPACE / size_of::<f32>()
    }

    unsafe fn run(&mut self, kernel: Kernel) -> Result<()> {
        self.stream.context().bind_to_thread().map_err(|e| driver_error("binding the context", e))?;
        // SAFETY: every launch below passes the kernel's parameters in `kernels.cu`'s
        // order and types (u64 addresses and sizes, f32 scalars), and the memory they
        // name is valid per this function's contract.
        unsafe {
            match kernel {
                Kernel::Gemm(g) => self.gemm(g),
                Kernel::BiasRows { mut bias, mut out, rows, cols } => {
                    let (mut r, mut c) = (rows as u64, cols as u64);
                    self.launch(
                        Function::BiasRows,
                        grid(rows * cols),
                        BLOCK,
                        &mut [arg!(bias), arg!(out), arg!(r), arg!(c)],
                    )
                }
                Kernel::Relu { mut x, mut y, n } => {
                    let mut n64 = n as u64;
                    self.launch(Function::Relu, grid(n), BLOCK, &mut [arg!(x), arg!(y), arg!(n64)])
                }
                Kernel::ReluBackward { mut y, mut dy, mut dx, n } => {
                    let mut n64 = n as u64;
                    self.launch(Function::ReluBackward, grid(n), BLOCK, &mut [arg!(y), arg!(dy), arg!(dx), arg!(n64)])
                }
                Kernel::SumRows { mut x, mut sum, rows, cols } => {
                    let (mut r, mut c) = (rows as u64, cols as u64);
                    self.launch(Function::SumRows, grid(cols), BLOCK, &mut [arg!(x), arg!(sum), arg!(r), arg!(c)])
                }
                Kernel::SoftmaxCrossEntropy {
                    mut logits,
                    mut labels,
                    mut grad,
                    mut row_loss,
                    mut loss,
                    rows,
                    classes,
                    mut scale,
                } => {
                    let (mut r, mut c) = (rows as u64, classes as u64);
                    let blocks = u32::try_from(rows).map_err(|_| driver_error("the loss", "too many rows"))?;
                    self.launch(
                        Function::SoftmaxXent,
                        blocks,
                        BLOCK,
                        &mut [arg!(logits), arg!(labels), arg!(grad), arg!(row_loss), arg!(r), arg!(c), arg!(scale)],
                    )?;
                    self.launch(Function::SumF64, 1, 1, &mut [arg!(row_loss), arg!(loss), arg!(r)])
                }
                Kernel::Gelu { mut x, mut y, n } => {
                    let mut n64 = n as u64;
                    self.launch(Function::Gelu, grid(n), BLOCK, &mut [arg!(x), arg!(y), arg!(n64)])
                }
                Kernel::GeluBackward { mut x, mut dy, mut dx, n } => {
                    let mut n64 = n as u64;
                    self.launch(Function::GeluBackward, grid(n), BLOCK, &mut [arg!(x), arg!(dy), arg!(dx), arg!(n64)])
                }
                Kernel::LayerNorm { mut x, mut params, mut y, rows, cols, mut eps } => {
                    let (mut r, mut c) = (rows as u64, cols as u64);
                    let blocks = row_blocks(rows)?;
                    let mut args = [arg!(x), arg!(params), arg!(y), arg!(r), arg!(c), arg!(eps)];
                    self.launch(Function::LayerNorm, blocks, BLOCK, &mut args)
                }
                Kernel::LayerNormBackward {
                    mut x,
                    mut params,
                    mut dy,
                    mut grads,
                    mut dx,
                    mut stats,
                    rows,
                    cols,
                    mut eps,
                } => {
                    let (mut r, mut c) = (rows as u64, cols as u64);
                    let blocks = row_blocks(rows)?;
                    let mut args =
                        [arg!(x), arg!(params), arg!(dy), arg!(dx), arg!(stats), arg!(r), arg!(c), arg!(eps)];
                    self.launch(Function::LayerNormBackwardRows, blocks, BLOCK, &mut args)?;
                    let mut args = [arg!(x), arg!(dy), arg!(stats), arg!(grads), arg!(r), arg!(c)];
                    self.launch(Function::LayerNormBackwardParams, grid(cols), BLOCK, &mut args)
                }
                Kernel::Embedding { mut ids, mut table, mut out, rows, width, vocabulary } => {
                    let (mut r, mut w, mut v) = (rows as u64, width as u64, vocabulary as u64);
                    let mut args = [arg!(ids), arg!(table), arg!(out), arg!(r), arg!(w), arg!(v)];
                    self.launch(Function::Embedding, grid(rows * width), BLOCK, &mut args)
                }
                Kernel::EmbeddingBackward { mut ids, mut dy, mut dtable, rows, width, vocabulary } => {
                    let (mut r, mut w, mut v) = (rows as u64, width as u64, vocabulary as u64);
                    let mut args = [arg!(ids), arg!(dy), arg!(dtable), arg!(r), arg!(w), arg!(v)];
                    self.launch(Function::EmbeddingBackward, grid(width), BLOCK, &mut args)
                }
                Kernel::AddPositions { mut x, mut table, mut y, batch, steps, width } => {
                    let (mut b, mut t, mut w) = (batch as u64, steps as u64, width as u64);
                    let mut args = [arg!(x), arg!(table), arg!(y), arg!(b), arg!(t), arg!(w)];
                    self.launch(Function::AddPositions, grid(batch * steps * width), BLOCK, &mut args)
                }
                Kernel::PositionsBackward { mut dy, mut dtable, batch, steps, width, context } => {
                    let (mut b, mut t, mut w, mut c) = (batch as u64, steps as u64, width as u64, context as u64);
                    let mut args = [arg!(dy), arg!(dtable), arg!(b), arg!(t), arg!(w), arg!(c)];
                    self.launch(Function::PositionsBackward, grid(context * width), BLOCK, &mut args)
                }
                Kernel::Add { mut a, mut b, mut y, n } => {
                    let mut n64 = n as u64;
                    self.launch(Function::Add, grid(n), BLOCK, &mut [arg!(a), arg!(b), arg!(y), arg!(n64)])
                }
                Kernel::AddAssign { mut acc, mut x, n } => {
                    let mut n64 = n as u64;
                    self.launch(Function::AddAssign, grid(n), BLOCK, &mut [arg!(acc), arg!(x), arg!(n64)])
                }
                Kernel::Copy { x, y, n } => {
                    driver::memcpy_dtod_async(y, x, n * size_of::<f32>(), self.stream.cu_stream())
                        .map_err(|e| driver_error("a device copy", e))
                }
                Kernel::AttentionForward(a) => self.attention_forward(a),
                Kernel::AttentionBackward(a) => self.attention_backward(a),
                Kernel::Update { updater, t, mut values, mut grads, mut first, mut second, decay, n, mut status } => {
                    let mut decay = decay;
                    let mut n64 = n as u64;
                    driver::memset_d8_async(status, 0, size_of::<u32>(), self.stream.cu_stream())
                        .map_err(|e| driver_error("clearing the update's status", e))?;
                    match updater.core() {
                        Updater::Adam { learning_rate, beta1, beta2, epsilon } => {
                            let (mut b1, mut b2, mut eps) = (beta1, beta2, epsilon);
                            let mut step = adam_step(learning_rate, beta1, beta2, t);
                            let mut args = [
                                arg!(values),
                                arg!(grads),
                                arg!(first),
                                arg!(second),
                                arg!(n64),
                                arg!(b1),
                                arg!(b2),
                                arg!(eps),
                                arg!(step),
                                arg!(status),
                                arg!(decay),
                            ];
                            self.launch(Function::AdamCheck, grid(n), BLOCK, &mut args)?;
                            self.launch(Function::AdamCommit, grid(n), BLOCK, &mut args)
                        }
                        Updater::Sgd { learning_rate, momentum } => {
                            let (mut lr, mut mu) = (learning_rate, momentum);
                            let mut args =
                                [arg!(values), arg!(grads), arg!(first), arg!(n64), arg!(lr), arg!(mu), arg!(status)];
                            self.launch(Function::SgdCheck, grid(n), BLOCK, &mut args)?;
                            self.launch(Function::SgdCommit, grid(n), BLOCK, &mut args)
                        }
                        Updater::AdamW { .. } => unreachable!("AdamW steps as Adam (`Updater::core`)"),
                    }
                }
            }
        }
    }
}

/// The device step on CUDA device `ordinal`.
pub(crate) fn trainer(ordinal: usize, plan: Plan, params: &[f32], mode: WorkspaceMode) -> Result<Box<dyn DeviceStep>> {
    Ok(Box::new(Trainer::new(CudaCompute::new(ordinal)?, plan, params, mode)?))
}
