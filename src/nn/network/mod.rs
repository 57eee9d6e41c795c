//! The network: a configuration builder ([`config`]), training ([`train`]: `fit` over a
//! prefetcher, `fit_batch`, `fit_iter`), and inference and evaluation ([`infer`]), with
//! workspaces laid out as DL4J lays them out.

mod batch;
mod config;
mod dry;
mod infer;
mod shadow;
mod train;

use std::rc::Rc;
use std::sync::Arc;

use workspace_core::plan::Trace;
use workspace_core::planned::PlannedStats;
use workspace_core::timeline::{self, LayerLabel, Timeline, TimelineId};
use workspace_core::{ArrayType, LayerWorkspaceMgr, LearningPolicy, Workspace, WorkspaceMode};

use super::device::{self, Device, DeviceStep};
use super::finite;
use crate::nn::embedding::MAX_VOCABULARY;

use crate::{Error, Result};

use super::layer::{Init, Layer, ParamShape, Tape};
use super::limits::{check_machine_holds, config_filled};
use super::params::Params;
use super::profile::StepBreakdown;
use super::updater::{Updater, UpdaterState};
use carve_rng::Rng;

use batch::check_mask;
pub(crate) use batch::shape_key;
pub(crate) use batch::{check_labels, lease_input, lease_labels, loss_input, standard_labels, training_input};
pub use batch::{Input, Labels};
pub(crate) use config::inference_builder;
use config::inference_mgr;
pub use config::{
    names, planned_workspace_config, workspace_config, workspace_config_with, NetworkConfig, NetworkConfigBuilder,
};
pub(crate) use config::{training_mgrs, WorkspaceLayout};
pub(crate) use config::{training_mgrs_in, LEARNING};
pub use dry::{BatchShape, DryPass, MemoryEstimate, PassEstimate, Shortfall};
pub(crate) use infer::probabilities;
pub(crate) use train::{counted, fit_epoch, fit_pairs};

/// A feed-forward classifier: layers, then softmax cross-entropy.
///
/// The network holds every layer's parameters in one flat buffer (outside workspaces;
/// the layers in backward order, see [`Network::layer_params`]), with their gradients
/// and the updater's state in the same layout, and each layer's [`Tape`]. In a training iteration
/// ([`Network::fit_batch`]) the input and all activations live in
/// `WS_ALL_LAYERS_ACT` until the update is done; each layer's forward and backward
/// scratch in `WS_LAYER_WORKING_MEM`, reset after the layer; input gradients in
/// `WS_LAYER_ACT_GRAD_1` and `_2` alternately; the updater's scratch in
/// `WS_UPDATER_WORKING_MEM`. With [`WorkspaceMode::None`] every one of those arrays
/// is its own heap allocation instead (in heap workspaces of the same names, freed as
/// their cycles end), and the numbers are bit-identical.
///
/// A network belongs to the thread that created it (its workspaces do).
pub struct Network {
    inputs: usize,
    classes: usize,
    layers: Arc<[Box<dyn Layer>]>,
    /// Each layer's input width, parameter shapes and region of the flat buffers.
    layout: Arc<Params>,
    /// The parameters, shared with the models frozen from this network until the next
    /// update writes them (copy on write).
    params: Arc<Vec<f32>>,
    /// The gradients of the last backward pass, in `params`' layout.
    grads: Vec<f32>,
    tapes: Vec<Tape>,
    updater: UpdaterState,
    training_mode: WorkspaceMode,
    inference_mode: WorkspaceMode,
    /// How the enabled workspaces learn their sizes.
    learning: LearningPolicy,
    train: [LayerWorkspaceMgr; 2],
    infer: LayerWorkspaceMgr,
    iterations: u64,
    /// What the last training step reports ([`Network::last_iteration_workspace_bytes`]).
    last_workspace_bytes: usize,
    /// What the last inference reports ([`Network::last_inference_workspace_bytes`]).
    last_inference_bytes: usize,
    /// Whether the next training iteration is recorded for a memory plan.
    record_next: bool,
    memory_plan: Option<PlannedStats>,
    recorded: Option<Trace>,
    /// Where the training steps' time goes, when measured.
    breakdown: Option<StepBreakdown>,
    /// The threads a training step's large matrix multiplies split across.
    pool: Option<super::gemm::pool::Pool>,
    /// The shape-only workspaces of the [`Network::dry_run`] under way.
    dry_run: Option<Box<shadow::Shadow>>,
    /// The labels of a [`Timeline`] recording this network's workspaces (`None`: none
    /// does): each training step and inference then ends one of its iterations.
    timeline: Option<Box<LayerLabels>>,
    /// Where the training step runs.
    device: Device,
    /// The step on a device (`None`: on the host).
    device_step: Option<Box<dyn DeviceStep>>,
    /// Whether parameters were set ([`Network::layer_params_mut`]) since the device
    /// step last had them: sent before its next step.
    params_set: bool,
}

/// The layer labels of a network that a timeline records, interned once.
pub(crate) struct LayerLabels {
    /// The timeline they label for (no other).
    pub(crate) timeline: TimelineId,
    pub(crate) layers: Vec<LayerLabel>,
    pub(crate) input: LayerLabel,
    pub(crate) loss: LayerLabel,
    pub(crate) updater: LayerLabel,
}

impl LayerLabels {
    fn new(layers: &[Box<dyn Layer>], timeline: TimelineId) -> LayerLabels {
        // A name two layers share (custom layers may) is told apart: `name#2`, ...; the
        // network's own parts keep theirs.
        let mut seen: Vec<&str> = vec!["input", "loss", "updater"];
        let names: Vec<String> = layers
            .iter()
            .map(|l| {
                let name = l.name();
                let count = seen.iter().filter(|&&n| n == name).count();
                seen.push(name);
                match count {
                    0 => name.to_string(),
                    n => format!("{name}#{}", n + 1),
                }
            })
            .collect();
        LayerLabels {
            timeline,
            layers: names.iter().map(|name| LayerLabel::new(name)).collect(),
            input: LayerLabel::new("input"),
            loss: LayerLabel::new("loss"),
            updater: LayerLabel::new("updater"),
        }
    }
}

/// Labels the allocations from here on as `pick`'s label, while a timeline records
/// this network (see [`LayerLabels`]; the end of the iteration clears the label).
#[inline]
pub(crate) fn label(labels: Option<&LayerLabels>, pick: impl FnOnce(&LayerLabels) -> Option<LayerLabel>) {
    if let Some(labels) = labels {
        labels.timeline.set_layer(pick(labels));
    }
}

impl std::fmt::Debug for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Network")
            .field("inputs", &self.inputs)
            .field("classes", &self.classes)
            .field("layers", &self.layers.iter().map(|l| l.name()).collect::<Vec<_>>())
            .field("training_mode", &self.training_mode)
            .field("inference_mode", &self.inference_mode)
            .field("iterations", &self.iterations)
            .finish()
    }
}

impl Network {
    /// Builds the network: initialises the layers from the seed and creates the
    /// workspaces its modes need (on this thread).
    ///
    /// # Errors
    ///
    /// Workspace creation errors (for example [`ConfigMismatch`](workspace_core::Error::ConfigMismatch) when this
    /// thread already has a workspace of the same name with another configuration);
    /// the layers' errors for widths that do not chain; [`Error::InvalidConfig`] for
    /// residual blocks that do not close, or a token embedding that is not the first
    /// layer; for a network that trains on a
    /// device, [`Error::Device`] when there is none (its reason) and
    /// [`Error::InvalidConfig`] naming a layer that has no device form.
    pub fn new(config: NetworkConfig) -> Result<Network> {
        let NetworkConfig {
            inputs,
            layers,
            seed,
            updater,
            training_workspace_mode,
            inference_workspace_mode,
            workspace_learning,
            device,
        } = config;
        let updater_kind = updater;
        let layout = Params::of(inputs, &layers)?;
        let total = layout.layout.total;
        let what = || format!("the network's {total} parameter values (check the layer widths)");
        // The parameters, their gradients and the updater's state, all held at once.
        check_machine_holds(total, 2 + UpdaterState::buffers(updater), what)?;
        let mut params = config_filled(total, 0.0, what)?;
        let mut rng = Rng::new(seed);
        let mut init = Init::new(&mut rng);
        for (i, layer) in layers.iter().enumerate() {
            layer.init(layout.widths[i], &mut params[layout.layout.regions[i].clone()], &mut init);
        }
        let updater = UpdaterState::new(updater, total)?;
        let workspaces = WorkspaceLayout {
            training: training_workspace_mode,
            inference: inference_workspace_mode,
            learning: workspace_learning,
        };
        let mut net = Network::from_parts(inputs, layers, Arc::new(layout), Arc::new(params), updater, 0, workspaces)?;
        net.device_step =
            device::build(device, &net.layers, &net.layout, &net.params, updater_kind, training_workspace_mode)?;
        net.device = device;
        Ok(net)
    }

    /// The network taken apart for a data-parallel trainer: its input columns, layers,
    /// their layout, parameters, updater state and iterations, and how it lays out its
    /// workspaces (which are dropped).
    #[allow(clippy::type_complexity)]
    pub(crate) fn into_parts(
        self,
    ) -> (usize, Arc<[Box<dyn Layer>]>, Arc<Params>, Arc<Vec<f32>>, UpdaterState, u64, WorkspaceLayout) {
        let workspaces = self.workspace_layout();
        (self.inputs, self.layers, self.layout, self.params, self.updater, self.iterations, workspaces)
    }

    /// How the network lays out its workspaces.
    fn workspace_layout(&self) -> WorkspaceLayout {
        WorkspaceLayout { training: self.training_mode, inference: self.inference_mode, learning: self.learning }
    }

    /// A network of these layers, laid out by `layout` (of `inputs` columns), with these
    /// parameters (initialised or trained) and updater state, and new workspaces laid out
    /// by `workspaces`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when the gradients cannot be allocated; workspace
    /// creation errors.
    pub(crate) fn from_parts(
        inputs: usize,
        layers: Arc<[Box<dyn Layer>]>,
        layout: Arc<Params>,
        params: Arc<Vec<f32>>,
        updater: UpdaterState,
        iterations: u64,
        workspaces: WorkspaceLayout,
    ) -> Result<Network> {
        let total = layout.layout.total;
        let grads = config_filled(total, 0.0, || format!("the gradients of {total} parameter values"))?;
        let tapes = layers.iter().map(|layer| layer.tape()).collect();
        Ok(Network {
            inputs,
            classes: layout.outputs,
            layers,
            layout,
            params,
            grads,
            tapes,
            updater,
            training_mode: workspaces.training,
            inference_mode: workspaces.inference,
            learning: workspaces.learning,
            train: training_mgrs_in(workspaces.training, workspaces.learning, None, None)?,
            infer: inference_mgr(workspaces.inference, workspaces.learning)?,
            iterations,
            last_workspace_bytes: 0,
            last_inference_bytes: 0,
            breakdown: None,
            pool: None,
            record_next: false,
            memory_plan: None,
            recorded: None,
            dry_run: None,
            timeline: None,
            device: Device::Host,
            device_step: None,
            params_set: false,
        })
    }

    /// Records this network's workspaces (training and inference) in `timeline`, the
    /// timeline recording on this thread, from the next step on: every training step
    /// and every inference is then one iteration of its history, its allocations
    /// labelled by role and layer (see [`workspace_core::timeline`]). Several networks
    /// of a thread may record in one timeline.
    ///
    /// ```
    /// use carve::nn::{Network, NetworkConfig};
    /// use carve::ndarray::{Array1, Array2};
    /// use carve::workspace_core::timeline::Timeline;
    ///
    /// let mut net = Network::new(NetworkConfig::builder(8).dense(16).relu().dense(3).build()?)?;
    /// let timeline = Timeline::start()?;
    /// net.attach_timeline(&timeline)?;
    /// let (x, y) = (Array2::<f32>::ones((4, 8)), Array1::<u32>::zeros(4));
    /// for _ in 0..10 {
    ///     net.fit_batch(x.view(), y.view())?;
    /// }
    /// let snapshot = timeline.snapshot();
    /// assert_eq!(snapshot.iterations_recorded(), 10);
    /// assert!(snapshot.scripts().len() <= 2); // the first steps learn; the rest repeat
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Workspace`] when `timeline` does not record on this thread or a
    /// workspace is open.
    pub fn attach_timeline(&mut self, timeline: &Timeline) -> Result<()> {
        for mgr in self.train.iter().chain(std::iter::once(&self.infer)) {
            timeline.attach_mgr(mgr)?;
        }
        self.timeline = Some(Box::new(LayerLabels::new(&self.layers, timeline.id())));
        Ok(())
    }

    /// Stops recording this network's workspaces in `timeline` (what it recorded stays).
    /// The networks of a thread in one workspace mode share their workspaces (by name,
    /// in the thread's registry): detaching one detaches those it shares with the
    /// others too.
    ///
    /// # Errors
    ///
    /// [`Error::Workspace`] when a workspace is open.
    pub fn detach_timeline(&mut self, timeline: &Timeline) -> Result<()> {
        for mgr in self.train.iter().chain(std::iter::once(&self.infer)) {
            mgr.workspaces().try_for_each(|ws| timeline.detach(ws))?;
        }
        self.timeline = None;
        Ok(())
    }

    /// Ends an iteration of the timeline recording this network, if one does.
    #[inline]
    fn end_timeline_iteration(&self) {
        match &self.timeline {
            Some(labels) => labels.timeline.end_iteration(),
            // Not attached, yet recorded through workspaces it shares with a network
            // that is (of the same mode, on this thread): its step is an iteration too.
            None => {
                if let Some(id) = self.train[0].workspaces().next().and_then(|ws| timeline::recording(ws)) {
                    id.end_iteration();
                }
            }
        }
    }

    /// Where the training step runs ([`NetworkConfigBuilder::device`](crate::nn::NetworkConfigBuilder::device)).
    pub fn device(&self) -> Device {
        self.device
    }

    /// What the training step holds on its device (`None` on the host).
    pub fn device_stats(&self) -> Option<device::DeviceStats> {
        self.device_step.as_ref().map(|step| step.stats())
    }

    /// Input columns.
    pub fn inputs(&self) -> usize {
        self.inputs
    }

    /// Output classes.
    pub fn classes(&self) -> usize {
        self.classes
    }

    /// The layers.
    pub fn layers(&self) -> &[Box<dyn Layer>] {
        &self.layers
    }

    /// Layer `i`'s input width (features per step for sequences).
    ///
    /// # Panics
    ///
    /// When there is no layer `i`.
    pub fn layer_inputs(&self, i: usize) -> usize {
        self.layout.widths[i]
    }

    /// Whether a training step lets layer `i`'s output go once the next layer has read
    /// it and computes it again in the backward pass (see
    /// [`Layer::rebuilt_in_backward`](crate::nn::Layer::rebuilt_in_backward)), rather
    /// than keep it through the step. `false` when there is no layer `i`.
    ///
    /// ```
    /// use carve::nn::{Network, NetworkConfig};
    ///
    /// let config = NetworkConfig::builder(8).layer_norm().dense(16).gelu().dense(4).build()?;
    /// let net = Network::new(config)?;
    /// let rebuilt: Vec<bool> = (0..4).map(|i| net.output_rebuilt(i)).collect();
    /// // The norm's and GELU's outputs, each read by a dense layer; not the last output.
    /// assert_eq!(rebuilt, [true, false, true, false]);
    /// # Ok::<(), carve::Error>(())
    /// ```
    pub fn output_rebuilt(&self, i: usize) -> bool {
        i < self.layers.len() && crate::nn::step::let_go_at(&self.layers, i)
    }

    /// Layer `i`'s parameters: their names and shapes, in the order of
    /// [`Network::layer_params`].
    ///
    /// # Panics
    ///
    /// When there is no layer `i`.
    pub fn param_shapes(&self, i: usize) -> &[ParamShape] {
        &self.layout.shapes[i]
    }

    /// Layer `i`'s parameters: its region of the network's flat parameter buffer, each
    /// parameter of [`Network::param_shapes`] in turn, row-major.
    ///
    /// ```
    /// use carve::nn::{Network, NetworkConfig};
    ///
    /// let net = Network::new(NetworkConfig::builder(4).dense(3).relu().dense(2).build()?)?;
    /// let shapes = net.param_shapes(0);
    /// assert_eq!((shapes[0].name.as_str(), shapes[0].shape.as_slice()), ("weight", &[4, 3][..]));
    /// assert_eq!(net.layer_params(0).len(), 4 * 3 + 3);
    /// assert!(net.layer_params(1).is_empty()); // a ReLU has none
    /// # Ok::<(), carve::Error>(())
    /// ```
    ///
    /// # Panics
    ///
    /// When there is no layer `i`.
    pub fn layer_params(&self, i: usize) -> &[f32] {
        &self.params[self.layout.layout.regions[i].clone()]
    }

    /// Layer `i`'s parameters, to set them (a model frozen from this network keeps the
    /// values it was frozen with: they are copied here first).
    ///
    /// # Panics
    ///
    /// When there is no layer `i`.
    pub fn layer_params_mut(&mut self, i: usize) -> &mut [f32] {
        let region = self.layout.layout.regions[i].clone();
        self.params_set = true;
        &mut Arc::make_mut(&mut self.params)[region]
    }

    /// The gradients of layer `i`'s parameters from the last backward pass, in
    /// [`Network::layer_params`]' layout.
    ///
    /// # Panics
    ///
    /// When there is no layer `i`.
    pub fn layer_grads(&self, i: usize) -> &[f32] {
        &self.grads[self.layout.layout.regions[i].clone()]
    }

    /// The layers, their layout and the parameters, shared (what a model holds).
    #[allow(clippy::type_complexity)]
    pub(crate) fn shared_parts(&self) -> (Arc<[Box<dyn Layer>]>, Arc<Params>, Arc<Vec<f32>>) {
        (Arc::clone(&self.layers), Arc::clone(&self.layout), Arc::clone(&self.params))
    }

    /// Every parameter value, in the flat buffer's layout (the layers in backward order:
    /// the last layer's first).
    pub fn params(&self) -> &[f32] {
        &self.params
    }

    /// The updater.
    pub fn updater(&self) -> Updater {
        self.updater.updater()
    }

    /// The training workspace mode.
    pub fn training_workspace_mode(&self) -> WorkspaceMode {
        self.training_mode
    }

    /// The inference workspace mode.
    pub fn inference_workspace_mode(&self) -> WorkspaceMode {
        self.inference_mode
    }

    /// How the enabled workspaces learn their sizes
    /// ([`NetworkConfigBuilder::workspace_learning`]).
    pub fn workspace_learning(&self) -> LearningPolicy {
        self.learning
    }

    /// Training iterations done.
    pub fn iterations(&self) -> u64 {
        self.iterations
    }

    /// The workspace manager of training (the one whose input gradients go to
    /// `WS_LAYER_ACT_GRAD_1`).
    pub fn training_mgr(&self) -> &LayerWorkspaceMgr {
        &self.train[0]
    }

    /// The workspace manager of inference.
    pub fn inference_mgr(&self) -> &LayerWorkspaceMgr {
        &self.infer
    }

    /// Total arena capacity of the training workspaces (0 with workspaces off); for a
    /// planned network, the plan's arena.
    pub fn workspace_capacity(&self) -> usize {
        training_capacity(&self.train)
    }

    /// Total arena capacity of the inference workspaces that training does not use (the
    /// working memory workspaces enabled training and inference share are counted by
    /// [`Network::workspace_capacity`]); planned, the inference plans' arena; 0 with
    /// inference workspaces off.
    pub fn inference_workspace_capacity(&self) -> usize {
        inference_capacity(&self.train, self.training_mode, &self.infer)
    }

    /// Records the next training iteration's allocations and scope closes in the
    /// training workspaces and plans one arena from their lifetimes; the result is
    /// [`Network::memory_plan`]. Recording only observes: the step's numbers are those
    /// of an unrecorded step. (With workspaces off there is nothing to record.)
    pub fn record_next_iteration(&mut self) {
        self.record_next = true;
    }

    /// What the last recorded iteration says about memory (see
    /// [`Network::record_next_iteration`]): the bytes its role workspaces take laid out
    /// per role, the bytes one arena planned from its lifetimes takes, and the lower
    /// bound, in the figures a plan group reports ([`PlannedStats`], named
    /// `"training"`, one plan). For a network that trains planned
    /// ([`WorkspaceMode::Planned`]), the figures of the plan group it trains on once it
    /// holds a plan. `None` before a recorded iteration. The one name of these figures
    /// (the inference's are [`Network::inference_plan_stats`]).
    pub fn memory_plan(&self) -> Option<PlannedStats> {
        match self.train[0].plan_group().map(|group| group.stats()) {
            Some(s) if s.plans > 0 => Some(s),
            _ => self.memory_plan.clone(),
        }
    }

    /// [`Network::memory_plan`], by its former second name.
    #[deprecated(since = "0.1.0", note = "one name per figure: use `memory_plan`, which returns the same")]
    #[doc(hidden)]
    pub fn plan_stats(&self) -> Option<PlannedStats> {
        self.memory_plan()
    }

    /// The figures of the inference workspaces' plan group: `Some` when inference is
    /// planned ([`WorkspaceMode::Planned`] as the inference workspace mode), where each
    /// call of [`Network::output`] (and the other inference methods) is an iteration,
    /// planned per shape of input.
    pub fn inference_plan_stats(&self) -> Option<PlannedStats> {
        self.infer.plan_group().map(|group| group.stats())
    }

    /// The events of the last recorded iteration (see
    /// [`Network::record_next_iteration`]), for planning with other settings.
    pub fn recorded_iteration(&self) -> Option<&Trace> {
        self.recorded.as_ref()
    }

    /// What the last training iteration took of its workspaces: the bytes each
    /// training workspace held at its peak, summed, every allocation counted as an arena
    /// counts it (padded to the alignment) whether it lay in the arena or spilled (while
    /// a workspace still learns its size, or grows); for a planned network an iteration
    /// replayed on its plan takes the plan's bytes, and one recorded (the first of its
    /// shape) what its workspaces held, as above; 0 with workspaces off. A dry run
    /// predicts it pass by pass ([`MemoryEstimate::per_pass_bytes`]).
    pub fn last_iteration_workspace_bytes(&self) -> usize {
        self.last_workspace_bytes
    }

    /// What the last inference ([`Network::output`], and each batch of
    /// [`Network::evaluate`]) took of the inference workspaces, counted as
    /// [`Network::last_iteration_workspace_bytes`] counts a training step's (planned:
    /// the plan's bytes when replayed on it); 0 with inference workspaces off.
    pub fn last_inference_workspace_bytes(&self) -> usize {
        self.last_inference_bytes
    }

    /// Checks a batch and, when given, its labels (see [`Network::check_input`] and
    /// [`check_labels`]).
    fn check_batch(&self, x: &Input<'_>, labels: Option<&Labels<'_>>) -> Result<()> {
        self.check_input(x)?;
        labels.map_or(Ok(()), |labels| check_labels(x, labels))
    }

    /// Checks a batch: its features against the network's inputs, no empty batch or
    /// sequence, a features mask of the batch's shape holding 0 and 1 only.
    fn check_input(&self, x: &Input<'_>) -> Result<()> {
        check_input(self.inputs, FirstLayer::of(&self.layers), x)
    }
}

/// The arenas of the training workspaces of `train` (see
/// [`Network::workspace_capacity`]).
pub(crate) fn training_capacity(train: &[LayerWorkspaceMgr; 2]) -> usize {
    let planned = train[0].plan_group().map_or(0, |group| group.capacity());
    planned + sum_over_training_workspaces(train, |ws| ws.capacity())
}

/// The arenas of the inference workspaces of `infer` that the training workspaces of
/// `train` (in `training` mode) do not count (see
/// [`Network::inference_workspace_capacity`]).
pub(crate) fn inference_capacity(
    train: &[LayerWorkspaceMgr; 2],
    training: WorkspaceMode,
    infer: &LayerWorkspaceMgr,
) -> usize {
    let counted =
        |ws: &Rc<Workspace>| training != WorkspaceMode::None && training_workspaces(train).any(|t| t.id() == ws.id());
    let planned = infer.plan_group().map_or(0, |group| group.capacity());
    planned + infer.workspaces().filter(|ws| !counted(ws)).map(|ws| ws.capacity()).sum::<usize>()
}

/// What a pass reports of `workspaces` (a training step's, or an inference's): on its
/// plan, the plan's bytes; otherwise the bytes each workspace held at its peak since the
/// pass began, summed (see
/// [`Network::last_iteration_workspace_bytes`]). The one figure real and dry passes
/// report.
pub(crate) fn pass_bytes<'m>(workspaces: impl Iterator<Item = &'m Rc<Workspace>>, plan: Option<usize>) -> usize {
    match plan {
        Some(bytes) => bytes,
        None => workspaces.map(|ws| ws.peak_bytes()).sum(),
    }
}

/// `f` summed over the training workspaces of `train`: those of the first manager, and
/// the second manager's gradient workspace (the rest it shares with the first).
pub(crate) fn sum_over_training_workspaces(train: &[LayerWorkspaceMgr; 2], f: impl Fn(&Workspace) -> usize) -> usize {
    let second = train[1].workspace(ArrayType::ActivationGrad).map_or(0, |ws| f(ws));
    train[0].workspaces().map(|ws| f(ws)).sum::<usize>() + second
}

/// The training workspaces of `train`, each once (the first manager's, and the
/// second's gradient workspace).
pub(crate) fn training_workspaces(train: &[LayerWorkspaceMgr; 2]) -> impl Iterator<Item = &Rc<Workspace>> {
    train[0].workspaces().chain(train[1].workspace(ArrayType::ActivationGrad))
}

/// A network's first layer, as a batch's check needs it (whether it reads token ids,
/// [`Layer::reads_tokens`], and its name for the error).
#[derive(Clone, Copy)]
pub(crate) struct FirstLayer<'l>(Option<&'l dyn Layer>);

impl<'l> FirstLayer<'l> {
    /// The first of `layers` (none: a network of no layers reads no token ids).
    pub(crate) fn of(layers: &'l [Box<dyn Layer>]) -> FirstLayer<'l> {
        FirstLayer(layers.first().map(|layer| &**layer))
    }
}

/// Checks a batch for a network of `inputs` whose first layer is `first`: features of
/// the network's width, or token ids of its vocabulary for a first layer that reads
/// them; no empty batch or sequence; a features mask of the batch's shape holding 0 and
/// 1 only.
pub(crate) fn check_input(inputs: usize, first: FirstLayer<'_>, x: &Input<'_>) -> Result<()> {
    if matches!(x, Input::Tokens { .. }) && !first.0.is_some_and(|layer| layer.reads_tokens()) {
        return Err(Error::InvalidInput(format!(
            "token ids for a network whose first layer ('{}') does not read them (an Embedding does): give it \
             features, [batch, {inputs}] or [batch, time, {inputs}]",
            first.0.map_or("none", |layer| layer.name())
        )));
    }
    let (rows, steps_and_mask) = match x {
        Input::Flat(flat) => {
            check_features(inputs, flat.ncols(), x)?;
            (flat.nrows(), None)
        }
        Input::Sequences { features, mask } => {
            check_features(inputs, features.shape()[2], x)?;
            (features.shape()[0], Some((features.shape()[1], mask)))
        }
        Input::Tokens { ids, mask } => {
            if inputs > MAX_VOCABULARY {
                return Err(Error::InvalidInput(format!(
                    "token ids for a network of {inputs} inputs: a vocabulary holds at most {MAX_VOCABULARY} tokens"
                )));
            }
            // Each id below the network's input width, its vocabulary; an id repeated
            // along a broadcast axis is looked at once.
            let distinct = finite::distinct(ids.view());
            if let Some(((r, t), id)) = distinct.indexed_iter().find(|(_, &id)| id as usize >= inputs) {
                return Err(Error::InvalidInput(format!(
                    "token id {id} (sequence {r}, step {t}) is not in the network's vocabulary of {inputs} tokens \
                     (0..{inputs})"
                )));
            }
            (ids.nrows(), Some((ids.ncols(), mask)))
        }
    };
    if rows == 0 {
        return Err(Error::InvalidInput("an empty batch (0 rows) cannot be fed to the network".to_string()));
    }
    if let Some((steps, mask)) = steps_and_mask {
        if steps == 0 {
            return Err(Error::InvalidInput("a batch of sequences of 0 steps cannot be fed to the network".into()));
        }
        if let Some(mask) = mask {
            check_mask(mask, (rows, steps), "features", "a step holds data and 0 where it is padding")?;
            // Rows that repeat one another (a broadcast mask) are looked at once.
            let distinct = finite::distinct(mask.view());
            if let Some(r) =
                (0..distinct.nrows()).find(|&r| finite::distinct(distinct.row(r)).iter().all(|&v| v == 0.0))
            {
                return Err(Error::InvalidInput(format!(
                    "sequence {r} of the batch has no step that holds data (its mask is all 0); leave empty \
                     sequences out of the batch"
                )));
            }
        }
    }
    Ok(())
}

/// Checks that a batch of `features` columns feeds a network of `inputs`.
fn check_features(inputs: usize, features: usize, x: &Input<'_>) -> Result<()> {
    if features != inputs {
        let mut expected = x.activations().shape().to_vec();
        *expected.last_mut().expect("2 or 3 dimensions") = inputs;
        return Err(Error::ShapeMismatch {
            context: "network input".to_string(),
            expected,
            actual: x.activations().shape().to_vec(),
        });
    }
    Ok(())
}
