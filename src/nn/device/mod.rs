//! Training on a device: the step's arithmetic through a small compute seam, its memory
//! in device workspaces.
//!
//! A network built with [`NetworkConfigBuilder::device`](crate::nn::NetworkConfigBuilder::device)
//! trains on [`Device::Simulated`] or [`Device::Cuda`] instead of the host: each
//! [`fit_batch`](crate::nn::Network::fit_batch) stages the batch through pinned memory,
//! runs the forward pass, the loss, the backward pass and the update as device
//! operations on one stream, and reads back the loss and the update's finite check.
//!
//! - **The seam** is one operation type (`Kernel`: device addresses, sizes and
//!   scalars) and one trait (`Compute`) with two implementations: the simulated device
//!   (the host arithmetic of the network's own step, run on the simulator's memory in
//!   its stream's order, so CI trains "on the device" end to end and matches the host)
//!   and CUDA (products through cuBLAS on the step's stream, every other operation a
//!   kernel of `kernels.cu` compiled once by NVRTC and launched without a heap
//!   allocation). The host step is the third: the network's own, whose functions the
//!   simulator runs.
//! - **Memory**: the parameters, their gradients and the updater's state are one device
//!   allocation; every array of a step lives in a device workspace that is reset, in
//!   stream order, when the step ends; batches are staged through a pinned workspace.
//!   After its first step, a step allocates no device memory.
//! - **Layers** say what they are on a device through
//!   [`Layer::device_form`](crate::nn::Layer::device_form) ([`DeviceForm`]); a network
//!   with a layer that has none is refused when it is built, naming the layer.
//!
//! What is on devices: dense, ReLU, GELU (its tanh form), layer-norm, embedding, position-embedding and
//! causal attention layers and residual blocks, softmax cross-entropy over examples or
//! steps, Adam, AdamW and SGD: the digits MLP and the GPT. Not yet: LSTMs and the
//! sequence heads, features masks, CUDA graphs. (`WorkspaceMode::Planned` trains in a
//! device plan group: one arena planned from a recorded step, `DeviceStats::plan_bytes`.)

mod cuda;
pub(crate) mod kernel;
mod train;

use std::fmt;
use std::str::FromStr;

use workspace_cuda::device::sim::{SimDevice, SimStream};

use crate::{Error, Result};

pub use cuda::{compile_kernels, KERNELS_SOURCE, KERNEL_NAMES};
use kernel::Kernel;
pub(crate) use train::{build, DeviceStep, StepInput};

/// Where a network's training step runs.
///
/// ```
/// use carve::nn::{Device, NetworkConfig};
///
/// let config = NetworkConfig::builder(8).dense(16).relu().dense(3).device(Device::simulated()).build()?;
/// assert_eq!(config.device(), Device::Simulated);
/// assert_eq!("cuda:1".parse::<Device>()?, Device::cuda(1));
/// # Ok::<(), carve::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Device {
    /// The host: the network's own step on the CPU.
    #[default]
    Host,
    /// The simulated device of `workspace-cuda`: device memory and streams in host
    /// memory, the host's arithmetic.
    Simulated,
    /// The CUDA device of this ordinal.
    Cuda(usize),
}

impl Device {
    /// The host.
    pub fn host() -> Device {
        Device::Host
    }

    /// The simulated device.
    pub fn simulated() -> Device {
        Device::Simulated
    }

    /// The CUDA device of this ordinal.
    pub fn cuda(ordinal: usize) -> Device {
        Device::Cuda(ordinal)
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Host => f.write_str("host"),
            Device::Simulated => f.write_str("sim"),
            Device::Cuda(0) => f.write_str("cuda"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for Device {
    type Err = Error;

    /// `host`, `sim` (or `simulated`), `cuda` (device 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Device> {
        match s {
            "host" | "cpu" => Ok(Device::Host),
            "sim" | "simulated" => Ok(Device::Simulated),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| Error::InvalidInput(format!("unknown device '{s}': host, sim, cuda or cuda:N"))),
        }
    }
}

/// What a layer is on a device: the device step runs each form with the seam's
/// operations. A layer returns one from
/// [`Layer::device_form`](crate::nn::Layer::device_form); the forms are carve's own
/// layers (a custom layer that computes as one of them, with its parameters laid out
/// the same way, may say so).
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum DeviceForm {
    /// `y = x · W + b`, the parameters laid out as [`Dense`](crate::nn::Dense)'s: the
    /// `inputs × outputs` weights row-major, then the `outputs` biases.
    Dense {
        /// Input width.
        inputs: usize,
        /// Output width.
        outputs: usize,
    },
    /// `y = max(x, 0)`, no parameters.
    Relu,
    /// GELU (the tanh form, as [`Gelu`](crate::nn::Gelu)), no parameters.
    Gelu,
    /// Layer normalisation over each row ([`LayerNorm`](crate::nn::LayerNorm)): the
    /// scale, then the bias, a row's width each.
    LayerNorm {
        /// Added to the variance.
        eps: f32,
    },
    /// A token embedding ([`Embedding`](crate::nn::Embedding)): the first layer, of
    /// token ids; its table `vocabulary × width`.
    Embedding {
        /// Tokens in the table.
        vocabulary: usize,
        /// Features per token.
        width: usize,
    },
    /// A learned position embedding ([`PositionEmbedding`](crate::nn::PositionEmbedding)):
    /// its table `context × width`.
    PositionEmbedding {
        /// The most steps a sequence may have.
        context: usize,
        /// Features per step.
        width: usize,
    },
    /// Causal multi-head self-attention ([`Attention`](crate::nn::Attention)), its
    /// parameters `qkv.weight`, `qkv.bias`, `proj.weight`, `proj.bias`.
    Attention {
        /// Features per step.
        width: usize,
        /// Heads (dividing the width).
        heads: usize,
    },
    /// The join of a residual block that starts at layer `from`
    /// ([`NetworkConfigBuilder::residual`](crate::nn::NetworkConfigBuilder::residual)'s
    /// own; no other layer may say it is one).
    Residual {
        /// The block's first layer.
        from: usize,
    },
}

/// What a network's device step holds ([`Network::device_stats`](crate::nn::Network::device_stats)).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceStats {
    /// The device, in words.
    pub device: String,
    /// Bytes of device memory: the parameters, gradients and updater state (one
    /// allocation), the step's workspace arena and what the step reads back.
    pub bytes: usize,
    /// Device allocations made so far: the state's, and the workspace's arena growths
    /// and spills. Once the step is steady, a step adds none.
    pub allocations: u64,
    /// Steps taken.
    pub steps: u64,
    /// `WorkspaceMode::Planned`: the bytes of the plan of the last step's shape.
    pub plan_bytes: Option<usize>,
    /// `WorkspaceMode::Planned`: the most bytes the last step's shape holds live at
    /// once, which no arena can go below.
    pub lower_bound_bytes: Option<usize>,
}

/// The compute seam: what a device step needs from a device beyond memory and copies.
pub(crate) trait Compute {
    /// The device whose memory the operations use.
    type D: workspace_cuda::Device;

    /// The device.
    fn device(&self) -> &Self::D;
    /// The stream every operation runs on.
    fn stream(&self) -> &<Self::D as workspace_cuda::Device>::Stream;
    /// The values of device memory a product of `m × k` by `k × n` needs as its buffer
    /// (the host product's packing, cuBLAS's workspace; 0: none).
    fn gemm_scratch(&self, m: usize, n: usize, k: usize) -> usize;
    /// The values an attention core over `steps` steps of heads `head_width` wide needs
    /// as its products' buffer.
    fn attention_scratch(&self, steps: usize, head_width: usize) -> usize;
    /// Issues `kernel` on [`Compute::stream`].
    ///
    /// # Errors
    ///
    /// A device error issuing it (errors of its execution come later, from the stream).
    ///
    /// # Safety
    ///
    /// Every range `kernel` reads or writes must lie in device memory of this device
    /// that stays allocated, and is used by no other stream, until the kernel completes
    /// in the stream's order; ranges it writes must not overlap the others.
    unsafe fn run(&mut self, kernel: Kernel) -> Result<()>;
}

/// The simulated device's compute: each operation a [`SimKernel`](workspace_cuda::device::sim::SimKernel)
/// on its stream.
pub(crate) struct SimCompute {
    sim: SimDevice,
    stream: SimStream,
}

impl SimCompute {
    pub(crate) fn new() -> Result<SimCompute> {
        let sim = SimDevice::new().map_err(|e| device_error("start", e))?;
        let stream = workspace_cuda::Device::default_stream(&sim);
        Ok(SimCompute { sim, stream })
    }
}

impl Compute for SimCompute {
    type D = SimDevice;

    fn device(&self) -> &SimDevice {
        &self.sim
    }

    fn stream(&self) -> &SimStream {
        &self.stream
    }

    fn gemm_scratch(&self, m: usize, n: usize, k: usize) -> usize {
        super::gemm::scratch_len(m, n, k)
    }

    fn attention_scratch(&self, steps: usize, head_width: usize) -> usize {
        super::attention::head_scratch(steps, head_width)
    }

    unsafe fn run(&mut self, kernel: Kernel) -> Result<()> {
        self.sim.launch(&self.stream, kernel).map_err(|e| device_error("launch", e))
    }
}

/// A device's error in a step, as carve's error.
pub(crate) fn device_error(action: &'static str, source: workspace_cuda::DeviceError) -> Error {
    Error::Device(workspace_cuda::Error::Device { workspace: "device step".into(), action, source })
}
