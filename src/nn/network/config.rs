//! The network's configuration, its builder, and the workspaces it trains and infers in.

use std::sync::Arc;

use workspace_core::planned::PlanGroup;
use workspace_core::{
    ArrayType, LayerWorkspaceMgr, LayerWorkspaceMgrBuilder, LearningPolicy, SpillPolicy, WorkspaceConfig,
    WorkspaceManager, WorkspaceMode,
};

#[cfg(doc)]
use super::Network;
use crate::{Error, Result};

use super::super::attention::Attention;
use super::super::dense::Dense;
use super::super::device::Device;
use super::super::embedding::{Embedding, PositionEmbedding};
use super::super::gelu::{Gelu, GeluForm};
use super::super::layer::Layer;
use super::super::lstm::Lstm;
use super::super::norm::LayerNorm;
use super::super::pool::{LastStep, MaskedMean};
use super::super::relu::Relu;
use super::super::residual::{Residual, MAX_NESTING};
use super::super::updater::Updater;

/// Workspace names, as DL4J calls them.
pub mod names {
    /// Input and every layer's activations, kept for the backward pass.
    pub const ALL_LAYERS_ACT: &str = "WS_ALL_LAYERS_ACT";
    /// Per-layer forward and backward scratch, reset after each layer.
    pub const LAYER_WORKING_MEM: &str = "WS_LAYER_WORKING_MEM";
    /// Gradients with respect to layer inputs, alternating with [`ACT_GRAD_2`].
    pub const ACT_GRAD_1: &str = "WS_LAYER_ACT_GRAD_1";
    /// Gradients with respect to layer inputs, alternating with [`ACT_GRAD_1`].
    pub const ACT_GRAD_2: &str = "WS_LAYER_ACT_GRAD_2";
    /// The updater's per-step scratch.
    pub const UPDATER_WORKING_MEM: &str = "WS_UPDATER_WORKING_MEM";
    /// One cycle per time step of a recurrent layer, forward and backward
    /// ([`ArrayType::RnnFfLoopWorkingMem`](workspace_core::ArrayType),
    /// [`ArrayType::RnnBpLoopWorkingMem`](workspace_core::ArrayType)).
    pub const RNN_LOOP_WORKING_MEM: &str = "WS_RNN_LOOP_WORKING_MEM";
    /// Activations during inference.
    pub const INFERENCE_ACT: &str = "WS_INFERENCE_ACT";
    /// A data-parallel worker's gradient buckets (a member of its training plan group).
    pub const GRADIENT_BUCKETS: &str = "WS_GRADIENT_BUCKETS";
}

/// The configuration of a [`Network`]: its layers (the last one produces the class
/// scores, followed by softmax cross-entropy), seed, updater and workspace modes.
///
/// Layers hold no parameters, so a configuration is cheap to clone (its layers are
/// shared): the one a network was built from also loads its saved models
/// ([`Model::load_with`](crate::nn::serve::Model::load_with)).
#[derive(Clone)]
pub struct NetworkConfig {
    pub(super) inputs: usize,
    pub(super) layers: Arc<[Box<dyn Layer>]>,
    pub(super) seed: u64,
    pub(super) updater: Updater,
    pub(super) device: Device,
    pub(super) training_workspace_mode: WorkspaceMode,
    pub(super) inference_workspace_mode: WorkspaceMode,
    pub(super) workspace_learning: LearningPolicy,
}

/// How a network lays out its workspaces: the modes of training and inference, and how
/// its enabled workspaces learn their sizes. What a network's workspaces are made from
/// (and made again from, when a data-parallel trainer gives the network back).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct WorkspaceLayout {
    pub(crate) training: WorkspaceMode,
    pub(crate) inference: WorkspaceMode,
    pub(crate) learning: LearningPolicy,
}

impl std::fmt::Debug for NetworkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetworkConfig")
            .field("inputs", &self.inputs)
            .field("layers", &self.layers.iter().map(|l| l.name()).collect::<Vec<_>>())
            .field("seed", &self.seed)
            .field("updater", &self.updater)
            .field("training_workspace_mode", &self.training_workspace_mode)
            .field("inference_workspace_mode", &self.inference_workspace_mode)
            .field("workspace_learning", &self.workspace_learning)
            .finish()
    }
}

/// Builder of a [`NetworkConfig`].
///
/// ```
/// use carve::nn::{NetworkConfig, Updater};
/// use carve::WorkspaceMode;
///
/// let config = NetworkConfig::builder(64)
///     .dense(128)
///     .relu()
///     .dense(10)
///     .seed(7)
///     .updater(Updater::adam(1e-3))
///     .training_workspace_mode(WorkspaceMode::Enabled)
///     .inference_workspace_mode(WorkspaceMode::Enabled)
///     .build()?;
/// let mut net = carve::nn::Network::new(config)?;
/// let x = carve::ndarray::Array2::<f32>::ones((4, 64));
/// let y = carve::ndarray::Array1::<u32>::from(vec![0, 1, 2, 3]);
/// let loss = net.fit_batch(x.view(), y.view())?;
/// assert!(loss.is_finite());
/// assert_eq!(net.output(x.view())?.shape(), &[4, 10]);
/// # Ok::<(), carve::Error>(())
/// ```
pub struct NetworkConfigBuilder {
    inputs: usize,
    width: usize,
    layers: Vec<Box<dyn Layer>>,
    seed: u64,
    updater: Updater,
    device: Device,
    training_workspace_mode: WorkspaceMode,
    inference_workspace_mode: WorkspaceMode,
    workspace_learning: LearningPolicy,
    error: Option<Error>,
    /// Residual blocks under way (see [`NetworkConfigBuilder::residual`]).
    nesting: usize,
}

impl NetworkConfig {
    /// A builder for a network taking `inputs` columns.
    pub fn builder(inputs: usize) -> NetworkConfigBuilder {
        NetworkConfigBuilder {
            inputs,
            width: inputs,
            layers: Vec::new(),
            seed: 0,
            updater: Updater::default(),
            device: Device::Host,
            training_workspace_mode: WorkspaceMode::Enabled,
            inference_workspace_mode: WorkspaceMode::Enabled,
            workspace_learning: LEARNING,
            error: None,
            nesting: 0,
        }
    }

    /// Input columns (features per step for sequences).
    pub fn inputs(&self) -> usize {
        self.inputs
    }

    /// The layers, in order.
    pub fn layers(&self) -> &[Box<dyn Layer>] {
        &self.layers
    }

    /// Where the training step runs.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The layers, shared.
    pub(crate) fn shared_layers(&self) -> Arc<[Box<dyn Layer>]> {
        Arc::clone(&self.layers)
    }
}

impl NetworkConfigBuilder {
    /// Appends a layer (a user's custom layer, or one of [`Dense`], [`Relu`]); the
    /// network hands it the current width ([`Layer::output_size`],
    /// [`Layer::param_shapes`], [`Layer::init`]).
    ///
    /// A layer that cannot take the current width, or that produces no columns, makes
    /// [`NetworkConfigBuilder::build`] fail.
    pub fn layer(mut self, layer: impl Layer) -> Self {
        if self.error.is_none() {
            match layer.output_size(self.width) {
                Ok(0) => {
                    self.error = Some(Error::InvalidConfig {
                        reason: format!(
                            "layer '{}' (layer {} of the network) produces 0 columns; every layer needs at \
                             least one output column",
                            layer.name(),
                            self.layers.len()
                        ),
                    })
                }
                Ok(width) => self.width = width,
                Err(e) => self.error = Some(e),
            }
        }
        self.layers.push(Box::new(layer));
        self
    }

    /// Appends a [`Dense`] layer with `outputs` columns, taking the current width. It
    /// is named after its position: `dense_0` for the first layer, and so on.
    pub fn dense(mut self, outputs: usize) -> Self {
        let name = format!("dense_{}", self.layers.len());
        match Dense::try_named(&name, self.width, outputs) {
            Ok(dense) => self.layer(dense),
            Err(e) => {
                self.error.get_or_insert(e);
                self
            }
        }
    }

    /// Appends a residual block: the layers `block` appends, then a join that adds the
    /// block's input to their output, `y = x + f(x)`. A pre-LN transformer block reads
    /// as it is drawn:
    ///
    /// ```
    /// use carve::nn::NetworkConfig;
    ///
    /// let (d, heads) = (32, 4);
    /// let config = NetworkConfig::builder(65)
    ///     .embedding(d)
    ///     .position_embedding(16)
    ///     .residual(|b| b.layer_norm().attention(heads))
    ///     .residual(|b| b.layer_norm().dense(4 * d).gelu().dense(d))
    ///     .layer_norm()
    ///     .dense(65)
    ///     .build()?;
    /// let names: Vec<&str> = config.layers().iter().map(|l| l.name()).collect();
    /// assert_eq!(names[2..5], ["layer_norm_2", "attention_3", "residual_4"]);
    /// # Ok::<(), carve::Error>(())
    /// ```
    ///
    /// The block's layers are the network's (trained, saved and served as its other
    /// layers are); the join is named after its position (`residual_4`). Blocks may nest,
    /// 8 deep.
    ///
    /// # Errors (from [`NetworkConfigBuilder::build`])
    ///
    /// [`Error::InvalidConfig`] for a block with no layer, or one that changes the
    /// width.
    pub fn residual(mut self, block: impl FnOnce(NetworkConfigBuilder) -> NetworkConfigBuilder) -> Self {
        if self.error.is_some() {
            return self;
        }
        let (from, width) = (self.layers.len(), self.width);
        if self.nesting == MAX_NESTING {
            self.error = Some(Error::invalid_config(format!(
                "residual blocks nested more than {MAX_NESTING} deep (block at layer {from})"
            )));
            return self;
        }
        self.nesting += 1;
        let mut b = block(self);
        b.nesting -= 1;
        if b.error.is_some() {
            return b;
        }
        let reason = if b.layers.len() == from {
            Some(format!("the residual block at layer {from} has no layer"))
        } else if b.width != width {
            Some(format!(
                "the residual block of layers {from}..{} turns {width} features into {}: a block keeps the width, to \
                 add its input to its output",
                b.layers.len(),
                b.width
            ))
        } else {
            None
        };
        if let Some(reason) = reason {
            b.error = Some(Error::invalid_config(reason));
            return b;
        }
        let name = format!("residual_{}", b.layers.len());
        b.layer(Residual::new(&name, from))
    }

    /// Appends an [`Embedding`] of `width` features per token: the network's input
    /// width is its vocabulary, and its input token ids ([`Input::Tokens`]). Named
    /// after its position (`embedding_0`).
    ///
    /// [`Input::Tokens`]: crate::nn::Input::Tokens
    pub fn embedding(mut self, width: usize) -> Self {
        let name = format!("embedding_{}", self.layers.len());
        match Embedding::named(&name, self.width, width) {
            Ok(embedding) => self.layer(embedding),
            Err(e) => {
                self.error.get_or_insert(e);
                self
            }
        }
    }

    /// Appends a learned [`PositionEmbedding`] of `context` positions over the current
    /// width, named after its position (`position_embedding_1`).
    pub fn position_embedding(mut self, context: usize) -> Self {
        let name = format!("position_embedding_{}", self.layers.len());
        match PositionEmbedding::named(&name, context, self.width) {
            Ok(positions) => self.layer(positions),
            Err(e) => {
                self.error.get_or_insert(e);
                self
            }
        }
    }

    /// Appends causal self-attention of `heads` heads over the current width
    /// ([`Attention`], keeping the attention probabilities for the backward pass),
    /// named after its position (`attention_1`).
    pub fn attention(self, heads: usize) -> Self {
        self.attention_layer(heads, false)
    }

    /// As [`NetworkConfigBuilder::attention`], in the recompute form: only the softmax
    /// statistics are kept, and the backward pass rebuilds the scores
    /// ([`Attention::recomputing`]). The same bits, less memory, more arithmetic.
    pub fn attention_recompute(self, heads: usize) -> Self {
        self.attention_layer(heads, true)
    }

    fn attention_layer(mut self, heads: usize, recompute: bool) -> Self {
        let name = format!("attention_{}", self.layers.len());
        match Attention::named(&name, self.width, heads) {
            Ok(attention) if recompute => self.layer(attention.recomputing()),
            Ok(attention) => self.layer(attention),
            Err(e) => {
                self.error.get_or_insert(e);
                self
            }
        }
    }

    /// Appends a [`Gelu`] (the tanh form), named after its position (`gelu_2`).
    pub fn gelu(self) -> Self {
        let name = format!("gelu_{}", self.layers.len());
        self.layer(Gelu::named(&name))
    }

    /// Appends a [`Gelu`] in its exact form ([`GeluForm::Exact`]: PyTorch's `nn.GELU()`,
    /// nanoGPT's), named after its position (`gelu_2`). A nanoGPT's state dict loaded
    /// into blocks of this form gives PyTorch's outputs to within float rounding.
    pub fn gelu_exact(self) -> Self {
        let name = format!("gelu_{}", self.layers.len());
        self.layer(Gelu::with_form(&name, GeluForm::Exact))
    }

    /// Appends a [`LayerNorm`] over the current width (eps 1e-5), named after its
    /// position (`layer_norm_0`).
    pub fn layer_norm(self) -> Self {
        let name = format!("layer_norm_{}", self.layers.len());
        self.layer(LayerNorm::named(&name))
    }

    /// Appends a [`Relu`], named after its position like the dense layers (`relu_1`
    /// after `dense_0`), so that a message names the one that failed.
    pub fn relu(self) -> Self {
        let name = format!("relu_{}", self.layers.len());
        self.layer(Relu::named(&name))
    }

    /// Appends an [`Lstm`] of `hidden` units (named `lstm_<index>`): the network then
    /// takes batches of sequences `[batch, time, features]` with their mask, and needs a
    /// head ([`NetworkConfigBuilder::last_step`], [`NetworkConfigBuilder::masked_mean`])
    /// before its flat layers.
    pub fn lstm(mut self, hidden: usize) -> Self {
        let name = format!("lstm_{}", self.layers.len());
        match Lstm::named(&name, self.width, hidden) {
            Ok(lstm) => self.layer(lstm),
            Err(e) => {
                self.error.get_or_insert(e);
                self
            }
        }
    }

    /// Appends a [`LastStep`] head: each sequence's output at its last step that holds
    /// data.
    pub fn last_step(self) -> Self {
        let name = format!("last_step_{}", self.layers.len());
        self.layer(LastStep::named(&name))
    }

    /// Appends a [`MaskedMean`] head: each sequence's mean output over the steps that
    /// hold data.
    pub fn masked_mean(self) -> Self {
        let name = format!("masked_mean_{}", self.layers.len());
        self.layer(MaskedMean::named(&name))
    }

    /// Seed of weight initialisation.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Where the training step runs: the host (the default), the simulated device or a
    /// CUDA device (see [`crate::nn::device`]). A device runs layers that have a
    /// [`DeviceForm`](crate::nn::DeviceForm); [`Network::new`](crate::nn::Network::new)
    /// refuses a network with one that has none, and a CUDA device where there is none,
    /// with the reason. The parameters come back to the network after every step (its
    /// `params`, `evaluate`, `freeze` and `save` see them); the updater's state stays on
    /// the device. Inference, `set_threads` and data-parallel training (which refuses a
    /// device network) are the host's.
    pub fn device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// The updater.
    pub fn updater(mut self, updater: Updater) -> Self {
        self.updater = updater;
        self
    }

    /// Workspaces during `fit`.
    pub fn training_workspace_mode(mut self, mode: WorkspaceMode) -> Self {
        self.training_workspace_mode = mode;
        self
    }

    /// Workspaces during `output` and `evaluate`. [`WorkspaceMode::Planned`] plans each
    /// shape of input's inference into one arena
    /// ([`Network::inference_plan_stats`](super::Network::inference_plan_stats)).
    pub fn inference_workspace_mode(mut self, mode: WorkspaceMode) -> Self {
        self.inference_workspace_mode = mode;
        self
    }

    /// How the enabled workspaces ([`WorkspaceMode::Enabled`]) learn their sizes (by
    /// default from the largest of their first 16 cycles: see [`workspace_config`]).
    /// Networks of a thread share their enabled workspaces by name (and with workspaces
    /// off, [`WorkspaceMode::None`], their heap workspaces, which keep the policy too), so
    /// the networks of one thread in one mode take one policy: a second policy is the
    /// [`ConfigMismatch`](workspace_core::Error::ConfigMismatch) of [`Network::new`]
    /// (`WorkspaceManager::current().destroy_all()` lets the thread's workspaces go).
    /// Planned workspaces learn nothing: their plan sizes them.
    ///
    /// ```
    /// use carve::nn::{Network, NetworkConfig};
    /// use carve::LearningPolicy;
    ///
    /// let config = NetworkConfig::builder(8).dense(4).workspace_learning(LearningPolicy::FirstLoop).build()?;
    /// let net = Network::new(config)?;
    /// assert_eq!(net.workspace_learning(), LearningPolicy::FirstLoop);
    /// # Ok::<(), carve::Error>(())
    /// ```
    pub fn workspace_learning(mut self, learning: LearningPolicy) -> Self {
        self.workspace_learning = learning;
        self
    }

    /// Checks the configuration.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for no inputs, no layers, a layer that produces no
    /// columns, a dense layer too large to allocate, fewer than two classes, a bad
    /// learning rate or a workspace learning policy that watches no cycle;
    /// [`Error::ShapeMismatch`] when a layer cannot take the previous layer's width.
    pub fn build(self) -> Result<NetworkConfig> {
        if let Some(e) = self.error {
            return Err(e);
        }
        let invalid = |reason: String| Err(Error::InvalidConfig { reason });
        if self.inputs == 0 {
            return invalid("a network needs at least one input column".into());
        }
        if self.layers.is_empty() {
            return invalid("a network needs at least one layer".into());
        }
        if self.width < 2 {
            return invalid(format!(
                "the last layer produces {} column(s); softmax cross-entropy needs at least 2 classes",
                self.width
            ));
        }
        let lr = self.updater.learning_rate();
        if !(lr.is_finite() && lr > 0.0) {
            return invalid(format!("learning rate {lr} must be finite and positive"));
        }
        // The rest of the updater's constants: a NaN or an out-of-range value would make
        // every step's update non-finite (refused then, step after step), not train.
        match self.updater {
            Updater::Sgd { momentum, .. } if !(momentum.is_finite() && (0.0..1.0).contains(&momentum)) => {
                return invalid(format!("momentum {momentum} must be finite, at least 0 and below 1"));
            }
            Updater::Adam { beta1, beta2, epsilon, .. } | Updater::AdamW { beta1, beta2, epsilon, .. } => {
                for (name, beta) in [("beta1", beta1), ("beta2", beta2)] {
                    if !(beta.is_finite() && (0.0..1.0).contains(&beta)) {
                        return invalid(format!("Adam's {name} {beta} must be finite, at least 0 and below 1"));
                    }
                }
                if !(epsilon.is_finite() && epsilon > 0.0) {
                    return invalid(format!("Adam's epsilon {epsilon} must be finite and above 0"));
                }
            }
            _ => {}
        }
        if let Updater::AdamW { weight_decay, .. } = self.updater {
            if !(weight_decay.is_finite() && weight_decay >= 0.0 && lr * weight_decay <= 1.0) {
                return invalid(format!(
                    "weight decay {weight_decay} must be finite, at least 0, and at most 1 / the learning rate \
                     ({lr}): each step multiplies the weights by 1 − learning rate · weight decay"
                ));
            }
        }
        for i in 0..self.layers.len() {
            crate::nn::params::check_layer(&self.layers, i)?;
        }
        if let Err(e) = workspace_config_with(self.workspace_learning) {
            return invalid(format!("workspace learning {:?}: {e}", self.workspace_learning));
        }
        Ok(NetworkConfig {
            inputs: self.inputs,
            layers: self.layers.into(),
            seed: self.seed,
            updater: self.updater,
            device: self.device,
            training_workspace_mode: self.training_workspace_mode,
            inference_workspace_mode: self.inference_workspace_mode,
            workspace_learning: self.workspace_learning,
        })
    }
}

/// How enabled network workspaces learn their sizes unless told otherwise: from the
/// largest of their first 16 cycles (working memory and gradient workspaces see cycles
/// of different sizes within one iteration, as DL4J's `cyclesBeforeInitialization`
/// accounts for).
pub(crate) const LEARNING: LearningPolicy = LearningPolicy::OverTime { cycles: 16 };

/// The configuration of every enabled network workspace: sized from the largest of the
/// first 16 cycles, growing once more if a later cycle is larger (a bigger batch), never
/// shrinking. The same for every network (of the default learning), so that networks of
/// any depth share the workspaces of their thread.
pub fn workspace_config() -> WorkspaceConfig {
    workspace_config_with(LEARNING).expect("a valid workspace configuration")
}

/// [`workspace_config`] with another learning policy
/// ([`NetworkConfigBuilder::workspace_learning`]).
///
/// # Errors
///
/// [`Error::Workspace`] for a policy the workspaces refuse (`OverTime { cycles: 0 }`).
pub fn workspace_config_with(learning: LearningPolicy) -> Result<WorkspaceConfig> {
    Ok(WorkspaceConfig::builder().learning(learning).spill(SpillPolicy::Reallocate).build()?)
}

/// The configuration of a planned network's workspaces: no arena of their own (the
/// plan's arena serves them); a recorded iteration's arrays are counted as spills and
/// placed in the plan group's arena where it has room (elsewhere, and after a
/// divergence, in spill blocks given back at the end of each cycle).
pub fn planned_workspace_config() -> WorkspaceConfig {
    WorkspaceConfig::builder()
        .learning(LearningPolicy::None)
        .spill(SpillPolicy::External)
        .build()
        .expect("a valid workspace configuration")
}

/// Plans a planned network keeps: one per shape of batch it trains on.
pub(super) const PLANS: usize = 64;

/// Training-time workspace managers: two, differing only in where input gradients
/// go, so that a layer's input gradient and its output gradient are in different
/// workspaces and the older one can be reset as soon as it is consumed. Planned: the
/// workspaces are the network's own, members of one plan group.
pub(crate) fn training_mgrs(mode: WorkspaceMode) -> Result<[LayerWorkspaceMgr; 2]> {
    training_mgrs_in(mode, LEARNING, None, None)
}

/// A plan group named `name`, of [`PLANS`] plans: shape-only when `registry` is.
fn plan_group(name: &str, registry: Option<&WorkspaceManager>) -> PlanGroup {
    match registry.is_some_and(WorkspaceManager::is_shape_only) {
        true => PlanGroup::shape_only(name, PLANS),
        false => PlanGroup::with_plans(name, PLANS),
    }
}

/// [`training_mgrs`], enabled workspaces learning by `learning`, their workspaces in
/// `registry` when given (a shape-only one, for a dry run: then a planned network's
/// group is shape-only too), a planned network's in `group` when given (a dry run's
/// twin of the network's).
pub(crate) fn training_mgrs_in(
    mode: WorkspaceMode,
    learning: LearningPolicy,
    registry: Option<&WorkspaceManager>,
    group: Option<PlanGroup>,
) -> Result<[LayerWorkspaceMgr; 2]> {
    // One plan per batch shape: variable-length sequences have a few dozen.
    let group =
        (mode == WorkspaceMode::Planned).then(|| group.unwrap_or_else(|| plan_group("WS_PLANNED_ITERATION", registry)));
    let config = if group.is_some() { planned_workspace_config() } else { workspace_config_with(learning)? };
    let base = |grad: &str| {
        // Workspaces off: the same names, each the thread's heap workspace of that name,
        // so that what succeeds with them on succeeds with them off.
        let builder = match (mode, registry) {
            (WorkspaceMode::None, Some(heaps)) if heaps.is_heaps() => {
                LayerWorkspaceMgr::builder().workspaces_off().in_manager(heaps)
            }
            (WorkspaceMode::None, _) => LayerWorkspaceMgr::builder().workspaces_off(),
            (_, Some(registry)) => LayerWorkspaceMgr::builder().in_manager(registry),
            (_, None) => LayerWorkspaceMgr::builder(),
        };
        let builder = match &group {
            Some(group) => builder.planned(group),
            None => builder,
        };
        builder
            .with(ArrayType::Input, names::ALL_LAYERS_ACT, config.clone())
            .with(ArrayType::Activations, names::ALL_LAYERS_ACT, config.clone())
            .with(ArrayType::FfCache, names::ALL_LAYERS_ACT, config.clone())
            .with(ArrayType::ActivationGrad, grad, config.clone())
            .with(ArrayType::UpdaterWorkingMem, names::UPDATER_WORKING_MEM, config.clone())
            .with(ArrayType::RnnFfLoopWorkingMem, names::RNN_LOOP_WORKING_MEM, config.clone())
            .with(ArrayType::RnnBpLoopWorkingMem, names::RNN_LOOP_WORKING_MEM, config.clone())
            .default_workspace(names::LAYER_WORKING_MEM, config.clone())
            .build()
    };
    Ok([base(names::ACT_GRAD_1)?, base(names::ACT_GRAD_2)?])
}

/// The inference workspace manager, enabled workspaces learning by `learning`. Planned:
/// the workspaces are the network's own, members of a plan group of their own (an
/// inference is an iteration).
pub(super) fn inference_mgr(mode: WorkspaceMode, learning: LearningPolicy) -> Result<LayerWorkspaceMgr> {
    inference_mgr_in(mode, learning, None, None)
}

/// [`inference_mgr`], its workspaces in `registry` and `group` when given (as
/// [`training_mgrs_in`]).
pub(super) fn inference_mgr_in(
    mode: WorkspaceMode,
    learning: LearningPolicy,
    registry: Option<&WorkspaceManager>,
    group: Option<PlanGroup>,
) -> Result<LayerWorkspaceMgr> {
    let planned = mode == WorkspaceMode::Planned;
    let config = if planned { planned_workspace_config() } else { workspace_config_with(learning)? };
    let builder = inference_builder_of(config);
    if mode == WorkspaceMode::None {
        // As in `training_mgrs_in`.
        return builder.workspaces_off().build().map_err(Error::from);
    }
    let builder = match registry {
        Some(registry) => builder.in_manager(registry),
        None => builder,
    };
    let builder = match planned {
        true => builder.planned(&group.unwrap_or_else(|| plan_group("WS_PLANNED_INFERENCE", registry))),
        false => builder,
    };
    builder.build().map_err(Error::from)
}

/// The inference workspaces (planned: with the configuration of a plan group's
/// members), as a network's inference and a served model's arenas lay them out.
pub(crate) fn inference_builder(planned: bool) -> LayerWorkspaceMgrBuilder {
    inference_builder_of(if planned { planned_workspace_config() } else { workspace_config() })
}

/// The inference workspaces, each of `config`.
fn inference_builder_of(config: WorkspaceConfig) -> LayerWorkspaceMgrBuilder {
    LayerWorkspaceMgr::builder()
        .with(ArrayType::Input, names::INFERENCE_ACT, config.clone())
        .with(ArrayType::Activations, names::INFERENCE_ACT, config.clone())
        .with(ArrayType::FfCache, names::INFERENCE_ACT, config.clone())
        .with(ArrayType::RnnFfLoopWorkingMem, names::RNN_LOOP_WORKING_MEM, config.clone())
        .default_workspace(names::LAYER_WORKING_MEM, config)
}
