//! The reference network: a small but real multilayer perceptron built the way a
//! user's custom layers are, on [`LayerWorkspaceMgr`](crate::LayerWorkspaceMgr).
//!
//! - [`Layer`]: the trait a custom layer implements; [`ForwardCtx`] and
//!   [`BackwardCtx`] hand it the open workspaces of each array role.
//! - Layers: [`Dense`] (Glorot-uniform weights), [`Relu`], [`Gelu`], [`LayerNorm`],
//!   [`Embedding`] and [`PositionEmbedding`] (token input), causal [`Attention`], residual
//!   blocks ([`NetworkConfigBuilder::residual`]), [`Lstm`] (over
//!   variable-length, masked sequences); the sequence heads [`LastStep`] and
//!   [`MaskedMean`] turn a sequence into one row per example; the output stage is
//!   [`SoftmaxCrossEntropy`].
//! - Updaters: [`Updater::Sgd`] with momentum, [`Updater::Adam`] and [`Updater::AdamW`]
//!   (decoupled weight decay on matrices).
//! - [`NetworkConfig`] → [`Network`]: `fit` (one epoch from an
//!   [`async_iter::Prefetcher`], batches used in place in its ring), `fit_batch`,
//!   `fit_iter`, `output`, `output_to`, `predict_into`, `evaluate`; an [`Input`] is a
//!   matrix of rows or a batch of padded sequences with its mask.
//! - [`Infer`]: the one trait of inference (`output`, `output_into`, `predict_into`),
//!   implemented by [`Network`], [`serve::Model`], [`serve::InferencePool`] and
//!   [`serve::PoolLease`].
//! - Workspace modes: `Enabled` gives each array role a learned arena; `Planned` serves
//!   the roles of an iteration from one arena planned per batch shape from a recorded
//!   iteration ([`workspaces::planned_workspace_config`], [`workspaces::PlannedStats`],
//!   [`Network::memory_plan`]); `None` allocates every array on the heap.
//! - [`gemm`]: the matrix multiply, which takes its packing buffers from the caller
//!   (layer working memory), so that a steady-state iteration allocates nothing.
//!
//! The root holds the layer API and the network; the rest is in modules of its own:
//!
//! | module | what |
//! |---|---|
//! | [`serve`] | [`Network::freeze`] → [`serve::Model`] (weights shared, `Send + Sync`), served to any number of threads by an [`serve::InferencePool`]; [`Network::save`], `Model::save`, `Model::load` and `Model::load_pytorch` keep models in safetensors |
//! | [`parallel`] | data-parallel training: [`parallel::DataParallel`] over threads, one thread's shards, or MPI processes |
//! | [`dry`] | memory before the first step: [`Network::dry_run`] and its [`dry::MemoryEstimate`] |
//! | [`workspaces`] | the workspaces' names (DL4J's) and configurations |
//! | [`limits`] | the bounds on thread and rank counts |
//!
//! A training step in which any value is not finite (NaN or infinite: in the input, a
//! layer's output or gradients, the loss, or what the updater would store) is refused
//! with [`Error::NonFinite`](crate::Error::NonFinite) naming the layer, before any
//! parameter or updater state changes; the next good batch trains as if the bad one had
//! never been offered.
//!
//! Workspaces never change the numbers: networks trained with
//! [`WorkspaceMode::Enabled`](crate::WorkspaceMode), `Planned` and `None` from the same
//! seed produce bit-identical losses and predictions.

mod attention;
mod dense;
#[allow(unsafe_code)] // the seam's launches (device::cuda) and the product's buffer (device::kernel)
pub mod device;
mod embedding;
mod file;
mod finite;
mod gelu;
#[allow(unsafe_code)]
pub mod gemm;
pub mod gradcheck;
mod infer;
mod kept;
mod kernels;
mod layer;
pub mod limits;
mod loss;
// The loom models of the protocols below (`--cfg loom`).
#[cfg(all(test, loom))]
mod loom;
mod lstm;
mod network;
mod norm;
pub mod parallel;
mod params;
mod pool;
mod profile;
mod relu;
mod residual;
pub mod serve;
#[allow(unsafe_code)]
mod simd;
mod step;
mod sync;
mod updater;
#[allow(unsafe_code)] // calls to its `#[target_feature]` loops only
mod vector;

pub use attention::Attention;
pub use dense::Dense;
pub use device::{Device, DeviceForm, DeviceStats};
pub use embedding::{Embedding, PositionEmbedding};
pub use gelu::{Gelu, GeluForm};
pub use infer::Infer;
pub use layer::{
    initial_params, Activations, BackwardCtx, ForwardCtx, GradInput, Init, Layer, ParamShape, Pass, RowsPass,
    StreamState, Tape, UninitGradInput,
};
pub use loss::SoftmaxCrossEntropy;
pub use lstm::Lstm;
pub use network::{Input, Labels, Network, NetworkConfig, NetworkConfigBuilder};
pub use norm::LayerNorm;
pub use pool::{LastStep, MaskedMean};
pub use profile::StepBreakdown;
pub use relu::Relu;
pub use updater::Updater;

/// Memory before the first step: a dry run of a network's passes in shape-only
/// workspaces ([`Network::dry_run`]), and what it predicts.
///
/// Which figure predicts which method:
///
/// | figure of a [`MemoryEstimate`](dry::MemoryEstimate) | predicts |
/// |---|---|
/// | [`workspace_bytes`](dry::MemoryEstimate::workspace_bytes) | [`Network::workspace_capacity`] after the run |
/// | [`inference_workspace_bytes`](dry::MemoryEstimate::inference_workspace_bytes) | [`Network::inference_workspace_capacity`] after the run |
/// | [`per_pass_bytes`](dry::MemoryEstimate::per_pass_bytes) | after each pass, [`Network::last_iteration_workspace_bytes`] (a training step) or [`Network::last_inference_workspace_bytes`] (an inference) |
/// | [`peak_step_bytes`](dry::MemoryEstimate::peak_step_bytes) | the largest [`Network::last_iteration_workspace_bytes`] of the run |
/// | [`fits`](dry::MemoryEstimate::fits) | whether the run's arenas fit a budget, or by how much they do not |
///
/// The field-by-field meaning is on [`MemoryEstimate`](dry::MemoryEstimate).
pub mod dry {
    pub use super::kernels::running;
    pub use super::network::{BatchShape, DryPass, MemoryEstimate, PassEstimate, Shortfall};
}

/// The workspaces a network trains and infers in: their names (DL4J's), and the
/// configurations carve gives them.
pub mod workspaces {
    pub use super::network::{names, planned_workspace_config, workspace_config, workspace_config_with};
    pub use workspace_core::planned::PlannedStats;
}
