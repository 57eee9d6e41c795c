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

use ndarray::Ix1;
use workspace_core::WorkspaceConfig;
use workspace_cuda::cudarc::cublas::{sys as cublas_sys, CudaBlas};
use workspace_cuda::cudarc::driver::{result as driver, sys as driver_sys, CudaModule, CudaStream};
use workspace_cuda::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use workspace_cuda::{CudaDevice, DeviceArray};

use crate::{Error, Result};

use super::super::updater::{adam_step, Updater};
use super::kernel::{Gemm, Kernel};
use super::train::{DeviceStep, Plan, Trainer};
use super::Compute;

/// The CUDA C source of carve's device kernels.
pub const KERNELS_SOURCE: &str = include_str!("kernels.cu");

/// The kernels of [`KERNELS_SOURCE`], as the step looks them up.
pub const KERNEL_NAMES: [&str; 10] = [
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
];

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
}

/// Bytes of device memory handed to cuBLAS as its workspace (what it recommends on
/// Hopper; less on older GPUs is enough).
const CUBLAS_WORKSPACE: usize = 32 << 20;

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
    /// cuBLAS's workspace, set on its handle (freed after the handle, declared after it).
    _blas_workspace: DeviceArray<CudaDevice, u8, Ix1>,
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
        let workspace = DeviceArray::<CudaDevice, u8, Ix1>::zeros(&gpu, &stream, CUBLAS_WORKSPACE)?;
        // SAFETY: the workspace is device memory of this context that outlives the handle
        // (a later field) and is used by nothing else; cuBLAS uses it on the handle's
        // stream only.
        unsafe {
            cublas_sys::cublasSetWorkspace_v2(*blas.handle(), workspace.device_ptr() as *mut c_void, CUBLAS_WORKSPACE)
        }
        .result()
        .map_err(|e| driver_error("setting cuBLAS's workspace", e))?;
        Ok(CudaCompute { gpu, stream, blas, functions, _module: module, _blas_workspace: workspace })
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
}

/// Blocks for `n` elements at [`BLOCK`] threads each (grid-stride loops cover the rest).
fn grid(n: usize) -> u32 {
    u32::try_from(n.div_ceil(BLOCK as usize)).unwrap_or(u32::MAX).clamp(1, 65_535)
}

/// A kernel argument, as the launch wants it.
macro_rules! arg {
    ($v:expr) => {
        (&mut $v) as *mut _ as *mut c_void
    };
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
        0
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
                Kernel::Update { updater, t, mut values, mut grads, mut first, mut second, n, mut status } => {
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
pub(crate) fn trainer(
    ordinal: usize,
    plan: Plan,
    params: &[f32],
    config: WorkspaceConfig,
) -> Result<Box<dyn DeviceStep>> {
    Ok(Box::new(Trainer::new(CudaCompute::new(ordinal)?, plan, params, config)?))
}
