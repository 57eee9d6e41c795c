//! The reference network: a small but real multilayer perceptron built the way a
//! user's custom layers are, on [`LayerWorkspaceMgr`](crate::LayerWorkspaceMgr).
//!
//! - [`Layer`]: the trait a custom layer implements; [`ForwardCtx`] and
//!   [`BackwardCtx`] hand it the open workspaces of each array role.
//! - Layers: [`Dense`] (Glorot-uniform weights), [`Relu`], [`Lstm`] (over
//!   variable-length, masked sequences); the sequence heads [`LastStep`] and
//!   [`MaskedMean`] turn a sequence into one row per example; the output stage is
//!   [`SoftmaxCrossEntropy`].
//! - Updaters: [`Updater::Sgd`] with momentum and [`Updater::Adam`].
//! - [`NetworkConfig`] → [`Network`]: `fit` (one epoch from an
//!   [`async_iter::Prefetcher`], batches used in place in its ring), `fit_batch`,
//!   `fit_iter`, `output`, `output_to`, `predict_into`, `evaluate`; an [`Input`] is a
//!   matrix of rows or a batch of padded sequences with its mask.
//! - [`Infer`]: the one trait of inference (`output`, `output_into`, `predict_into`),
//!   implemented by [`Network`], [`Model`], [`InferencePool`] and [`PoolLease`].
//! - Workspace modes: `Enabled` gives each array role a learned arena; `Planned` serves
//!   the roles of an iteration from one arena planned per batch shape from a recorded
//!   iteration ([`planned_workspace_config`], [`PlannedStats`], [`Network::plan_stats`]);
//!   `None` allocates every array on the heap.
//! - Serving: [`Network::freeze`] → [`Model`] (weights held once, `Send + Sync`,
//!   inference through `&self`), served to any number of threads by an
//!   [`InferencePool`]; [`Network::save`], [`Model::save`], [`Model::load`] and
//!   [`Model::load_pytorch`] keep models in safetensors, in PyTorch's names and layouts.
//! - [`gemm`]: the matrix multiply, which takes its packing buffers from the caller
//!   (layer working memory), so that a steady-state iteration allocates nothing.
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

mod dense;
mod file;
mod finite;
#[allow(unsafe_code)]
pub mod gemm;
mod infer;
mod layer;
mod limits;
mod loss;
// The loom models of the protocols below (`--cfg loom`).
#[cfg(all(test, loom))]
mod loom;
mod lstm;
mod network;
mod parallel;
mod params;
mod pool;
mod profile;
mod relu;
mod rng;
mod serve;
#[allow(unsafe_code)]
mod simd;
mod step;
mod sync;
mod updater;

pub use dense::Dense;
pub use infer::Infer;
pub use layer::{
    initial_params, Activations, BackwardCtx, ForwardCtx, GradInput, Init, Layer, ParamShape, Pass, RowsPass, Tape,
};
pub use limits::{MAX_RANKS, MAX_THREADS};
pub use loss::SoftmaxCrossEntropy;
pub use lstm::Lstm;
pub use network::{
    names, planned_workspace_config, workspace_config, workspace_config_with, BatchShape, DryPass, Input, Labels,
    MemoryEstimate, Network, NetworkConfig, NetworkConfigBuilder, PassEstimate, Shortfall,
};
#[cfg(feature = "mpi")]
pub use parallel::Mpi;
pub use parallel::{DataParallel, ParallelConfig, ParallelStats, Reducer, ReducerKind, Report};
pub use pool::{LastStep, MaskedMean};
pub use profile::StepBreakdown;
pub use relu::Relu;
pub use rng::Rng;
pub use serve::{InferencePool, Model, PoolConfig, PoolLease, PoolMode, PoolStats};
pub use updater::Updater;
pub use workspace_core::planned::PlannedStats;
