//! The network: a configuration builder ([`config`]), training ([`train`]: `fit` over a
//! prefetcher, `fit_batch`, `fit_iter`), and inference and evaluation ([`infer`]), with
//! workspaces laid out as DL4J lays them out.

mod config;
mod infer;
mod train;

use std::sync::{Arc, Mutex};

use ndarray::{ArrayView1, ArrayView2, ArrayView3};
use workspace_core::plan::Trace;
use workspace_core::planned::PlannedStats;
use workspace_core::{ArrayType, LayerWorkspaceMgr, Workspace, WorkspaceMode};

use super::finite;
use super::layer::Activations;

use crate::{Error, Result};

use super::layer::Layer;
use super::loss::SoftmaxCrossEntropy;
use super::updater::{Updater, UpdaterState};
use super::Rng;

use config::{inference_mgr, training_mgrs};
pub use config::{names, planned_workspace_config, workspace_config, NetworkConfig, NetworkConfigBuilder};

/// A batch the network is fed: rows `[batch, features]`, or sequences `[batch, time,
/// features]` with their mask `[batch, time]` (1 where a step holds data, 0 for
/// padding; `None`: every step holds data), as DL4J's `DataSet` holds them in its
/// `RNNFormat.NWC` layout. (DL4J's default, NCW, is `[batch, features, time]`: pass
/// `x.permuted_axes([0, 2, 1])`; sequences in any layout are copied into standard
/// layout once per batch.)
///
/// Every method that takes a batch takes `impl Into<Input>`: a 2-D view, a 3-D view,
/// or a `(features, mask)` pair.
///
/// ```
/// use carve::nn::Input;
/// use carve::ndarray::{Array2, Array3};
///
/// let rows = Array2::<f32>::zeros((4, 3));
/// assert!(matches!(Input::from(rows.view()), Input::Flat(_)));
/// let (x, mask) = (Array3::<f32>::zeros((4, 7, 3)), Array2::<f32>::ones((4, 7)));
/// assert!(matches!(Input::from((x.view(), mask.view())), Input::Sequences { mask: Some(_), .. }));
/// ```
#[derive(Clone, Copy, Debug)]
pub enum Input<'a> {
    /// `[batch, features]`.
    Flat(ArrayView2<'a, f32>),
    /// `[batch, time, features]` and the mask `[batch, time]`.
    Sequences {
        /// The steps' features.
        features: ArrayView3<'a, f32>,
        /// 1 where a step holds data, 0 where it is padding.
        mask: Option<ArrayView2<'a, f32>>,
    },
}

impl<'a> Input<'a> {
    /// Examples in the batch.
    pub fn rows(&self) -> usize {
        match self {
            Input::Flat(x) => x.nrows(),
            Input::Sequences { features, .. } => features.shape()[0],
        }
    }

    /// The same batch, borrowed for as long as `self` is.
    pub(crate) fn reborrow(&self) -> Input<'_> {
        match self {
            Input::Flat(x) => Input::Flat(x.view()),
            Input::Sequences { features, mask } => {
                Input::Sequences { features: features.view(), mask: mask.as_ref().map(|m| m.view()) }
            }
        }
    }

    /// The batch as the first layer's input.
    pub(crate) fn activations(&self) -> Activations<'a> {
        match *self {
            Input::Flat(x) => Activations::Flat(x),
            Input::Sequences { features, .. } => Activations::Sequence(features),
        }
    }

    /// The mask (sequences only).
    pub(crate) fn mask(&self) -> Option<ArrayView2<'a, f32>> {
        match *self {
            Input::Flat(_) => None,
            Input::Sequences { mask, .. } => mask,
        }
    }

    /// Rows `range` of the batch.
    pub(crate) fn rows_slice(&self, range: std::ops::Range<usize>) -> Input<'a> {
        use ndarray::s;
        match *self {
            Input::Flat(x) => Input::Flat(x.slice_move(s![range, ..])),
            Input::Sequences { features, mask } => Input::Sequences {
                features: features.slice_move(s![range.clone(), .., ..]),
                mask: mask.map(|m| m.slice_move(s![range, ..])),
            },
        }
    }
}

impl<'a> From<ArrayView2<'a, f32>> for Input<'a> {
    fn from(x: ArrayView2<'a, f32>) -> Input<'a> {
        Input::Flat(x)
    }
}

impl<'a> From<ArrayView3<'a, f32>> for Input<'a> {
    fn from(features: ArrayView3<'a, f32>) -> Input<'a> {
        Input::Sequences { features, mask: None }
    }
}

impl<'a> From<(ArrayView3<'a, f32>, ArrayView2<'a, f32>)> for Input<'a> {
    fn from((features, mask): (ArrayView3<'a, f32>, ArrayView2<'a, f32>)) -> Input<'a> {
        Input::Sequences { features, mask: Some(mask) }
    }
}

impl<'a> From<(ArrayView3<'a, f32>, Option<ArrayView2<'a, f32>>)> for Input<'a> {
    fn from((features, mask): (ArrayView3<'a, f32>, Option<ArrayView2<'a, f32>>)) -> Input<'a> {
        Input::Sequences { features, mask }
    }
}

/// The labels of a batch: one class per example, or, for a network whose output is a
/// sequence (recurrent layers without a head), one class per example and step
/// `[batch, time]`, with a labels mask `[batch, time]` (1 where the step has a label;
/// `None`: the steps the features mask marks as data), as DL4J's `RnnOutputLayer`
/// takes them. The loss is then the mean over the labelled steps (DL4J divides by the
/// number of examples instead, so its gradients differ by the steps per example).
///
/// Every method that takes labels takes `impl Into<Labels>`: a 1-D view, a 2-D view,
/// or a `(labels, mask)` pair.
#[derive(Clone, Copy, Debug)]
pub enum Labels<'a> {
    /// `[batch]`.
    PerExample(ArrayView1<'a, u32>),
    /// `[batch, time]` and the mask `[batch, time]`.
    PerStep {
        /// The class of each example's step.
        labels: ArrayView2<'a, u32>,
        /// 1 where the step has a label, 0 where it does not.
        mask: Option<ArrayView2<'a, f32>>,
    },
}

impl<'a> From<ArrayView1<'a, u32>> for Labels<'a> {
    fn from(labels: ArrayView1<'a, u32>) -> Labels<'a> {
        Labels::PerExample(labels)
    }
}

impl<'a> From<ArrayView2<'a, u32>> for Labels<'a> {
    fn from(labels: ArrayView2<'a, u32>) -> Labels<'a> {
        Labels::PerStep { labels, mask: None }
    }
}

impl<'a> From<(ArrayView2<'a, u32>, ArrayView2<'a, f32>)> for Labels<'a> {
    fn from((labels, mask): (ArrayView2<'a, u32>, ArrayView2<'a, f32>)) -> Labels<'a> {
        Labels::PerStep { labels, mask: Some(mask) }
    }
}

impl<'a> From<(ArrayView2<'a, u32>, Option<ArrayView2<'a, f32>>)> for Labels<'a> {
    fn from((labels, mask): (ArrayView2<'a, u32>, Option<ArrayView2<'a, f32>>)) -> Labels<'a> {
        Labels::PerStep { labels, mask }
    }
}

impl<'a> Labels<'a> {
    /// Examples labelled.
    pub fn rows(&self) -> usize {
        match self {
            Labels::PerExample(y) => y.len(),
            Labels::PerStep { labels, .. } => labels.nrows(),
        }
    }

    /// Labels per step without a mask of their own take `mask` (the features mask: a
    /// padded step has no label), as DL4J hands the features mask to its output layer.
    pub fn or_mask(self, mask: Option<ArrayView2<'a, f32>>) -> Labels<'a> {
        match self {
            Labels::PerStep { labels, mask: None } => Labels::PerStep { labels, mask },
            other => other,
        }
    }

    /// The same labels, borrowed for as long as `self` is.
    pub(crate) fn reborrow(&self) -> Labels<'_> {
        match self {
            Labels::PerExample(y) => Labels::PerExample(y.view()),
            Labels::PerStep { labels, mask } => {
                Labels::PerStep { labels: labels.view(), mask: mask.as_ref().map(|m| m.view()) }
            }
        }
    }

    /// Rows `range`.
    pub(crate) fn rows_slice(&self, range: std::ops::Range<usize>) -> Labels<'a> {
        use ndarray::s;
        match *self {
            Labels::PerExample(y) => Labels::PerExample(y.slice_move(s![range])),
            Labels::PerStep { labels, mask } => Labels::PerStep {
                labels: labels.slice_move(s![range.clone(), ..]),
                mask: mask.map(|m| m.slice_move(s![range, ..])),
            },
        }
    }

    /// As one label per row of the loss's `[rows, classes]` input (example-major for
    /// per-step labels: row `b · time + t`), with the mask of those rows.
    pub(crate) fn flat(&self) -> Result<(ArrayView1<'a, u32>, Option<ArrayView1<'a, f32>>)> {
        match *self {
            Labels::PerExample(y) => Ok((y, None)),
            Labels::PerStep { labels, mask } => {
                let n = labels.len();
                let not_standard = || {
                    Error::InvalidInput("per-step labels and their mask must be in standard (row-major) layout".into())
                };
                let labels = labels.into_shape_with_order(n).map_err(|_| not_standard())?;
                let mask = mask.map(|m| m.into_shape_with_order(n).map_err(|_| not_standard())).transpose()?;
                Ok((labels, mask))
            }
        }
    }
}

/// A feed-forward classifier: layers, then softmax cross-entropy.
///
/// Parameters live in the layers (outside workspaces). In a training iteration
/// ([`Network::fit_batch`]) the input and all activations live in
/// `WS_ALL_LAYERS_ACT` until the update is done; each layer's forward and backward
/// scratch in `WS_LAYER_WORKING_MEM`, reset after the layer; input gradients in
/// `WS_LAYER_ACT_GRAD_1` and `_2` alternately; the updater's scratch in
/// `WS_UPDATER_WORKING_MEM`. With [`WorkspaceMode::None`] every one of those arrays
/// is its own heap allocation instead, and the numbers are bit-identical.
///
/// A network belongs to the thread that created it (its workspaces do).
pub struct Network {
    inputs: usize,
    classes: usize,
    layers: Vec<Box<dyn Layer>>,
    loss: SoftmaxCrossEntropy,
    updater: UpdaterState,
    training_mode: WorkspaceMode,
    inference_mode: WorkspaceMode,
    train: [LayerWorkspaceMgr; 2],
    infer: LayerWorkspaceMgr,
    iterations: u64,
    last_workspace_bytes: usize,
    /// Whether the next training iteration is recorded for a memory plan.
    record_next: bool,
    memory_plan: Option<MemoryPlan>,
    recorded: Option<Trace>,
}

/// What one recorded training iteration says about memory: the bytes its role
/// workspaces take laid out per role, the bytes one arena planned from its lifetimes
/// would take, and the physical minimum (see [`workspace_core::plan`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    /// Allocations in the iteration.
    pub allocations: usize,
    /// Each role workspace's peak in the iteration, summed (the per-role layout).
    pub per_role_bytes: usize,
    /// The planned arena.
    pub plan_bytes: usize,
    /// The most bytes live at one moment.
    pub lower_bound_bytes: usize,
    /// Planning time, in microseconds.
    pub planning_us: u64,
    /// Plans made again after a divergence (planned networks; 0 otherwise).
    pub replans: u64,
    /// Iterations that left their plan (planned networks; 0 otherwise).
    pub divergences: u64,
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
    /// thread already has a workspace of the same name with another configuration).
    pub fn new(config: NetworkConfig) -> Result<Network> {
        let NetworkConfig { inputs, mut layers, seed, updater, training_workspace_mode, inference_workspace_mode } =
            config;
        let mut rng = Rng::new(seed);
        let mut width = inputs;
        for layer in layers.iter_mut() {
            layer.init(&mut rng);
            width = layer.output_size(width)?;
        }
        let updater = UpdaterState::new(updater, &mut layers);
        Ok(Network {
            inputs,
            classes: width,
            layers,
            loss: SoftmaxCrossEntropy,
            updater,
            training_mode: training_workspace_mode,
            inference_mode: inference_workspace_mode,
            train: training_mgrs(training_workspace_mode)?,
            infer: inference_mgr(inference_workspace_mode)?,
            iterations: 0,
            last_workspace_bytes: 0,
            record_next: false,
            memory_plan: None,
            recorded: None,
        })
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

    /// The layers, mutably (for tests that set weights).
    pub fn layers_mut(&mut self) -> &mut [Box<dyn Layer>] {
        &mut self.layers
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
        let planned = self.train[0].plan_group().map_or(0, |group| group.capacity());
        planned + self.sum_over_training_workspaces(|ws| ws.capacity())
    }

    /// `f` summed over the training workspaces: those of the first manager, and the
    /// second manager's gradient workspace (the rest it shares with the first).
    fn sum_over_training_workspaces(&self, f: impl Fn(&Workspace) -> usize) -> usize {
        let second = self.train[1].workspace(ArrayType::ActivationGrad).map_or(0, |ws| f(ws));
        self.train[0].workspaces().map(|ws| f(ws)).sum::<usize>() + second
    }

    /// Records the next training iteration's allocations and scope closes in the
    /// training workspaces and plans one arena from their lifetimes; the result is
    /// [`Network::memory_plan`]. Recording only observes: the step's numbers are those
    /// of an unrecorded step. (With workspaces off there is nothing to record.)
    pub fn record_next_iteration(&mut self) {
        self.record_next = true;
    }

    /// What the last recorded iteration says about memory (see
    /// [`Network::record_next_iteration`]); for a planned network
    /// ([`WorkspaceMode::Planned`]), the figures of the plan it trains on.
    pub fn memory_plan(&self) -> Option<MemoryPlan> {
        match self.plan_stats() {
            Some(s) if s.plans > 0 => Some(MemoryPlan {
                allocations: s.allocations,
                per_role_bytes: s.per_role_bytes,
                plan_bytes: s.plan_bytes,
                lower_bound_bytes: s.lower_bound_bytes,
                planning_us: s.planning_us,
                replans: s.replans,
                divergences: s.divergences,
            }),
            _ => self.memory_plan,
        }
    }

    /// The figures of the training workspaces' plan group, for a network that trains
    /// planned.
    pub fn plan_stats(&self) -> Option<PlannedStats> {
        self.train[0].plan_group().map(|group| group.stats())
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

    /// Starts (`Some`) or stops (`None`) recording in every training workspace.
    fn record_training_workspaces(&self, trace: Option<&Arc<Mutex<Trace>>>) -> Result<()> {
        let second = self.train[1].workspace(ArrayType::ActivationGrad);
        for ws in self.train[0].workspaces().chain(second) {
            ws.record_into(trace.cloned())?;
        }
        Ok(())
    }

    /// Workspace bytes in use at the peaks of the last training iteration, summed over
    /// the training workspaces (0 with workspaces off).
    pub fn last_iteration_workspace_bytes(&self) -> usize {
        self.last_workspace_bytes
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
        let (rows, features) = match x {
            Input::Flat(x) => (x.nrows(), x.ncols()),
            Input::Sequences { features, .. } => (features.shape()[0], features.shape()[2]),
        };
        if features != self.inputs {
            let mut expected = x.activations().shape().to_vec();
            *expected.last_mut().expect("2 or 3 dimensions") = self.inputs;
            return Err(Error::ShapeMismatch {
                context: "network input".to_string(),
                expected,
                actual: x.activations().shape().to_vec(),
            });
        }
        if rows == 0 {
            return Err(Error::InvalidInput("an empty batch (0 rows) cannot be fed to the network".to_string()));
        }
        if let Input::Sequences { features, mask } = x {
            let steps = features.shape()[1];
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
}

/// Checks `labels` against the batch `x`: one per row, or per step of sequences with a
/// labels mask of their shape holding 0 and 1 only.
fn check_labels(x: &Input<'_>, labels: &Labels<'_>) -> Result<()> {
    match labels {
        Labels::PerExample(labels) => check_label_count(x.rows(), labels),
        Labels::PerStep { labels, mask } => {
            let Input::Sequences { features, .. } = x else {
                return Err(Error::InvalidInput(
                    "labels per step [batch, time] need a batch of sequences [batch, time, features]".into(),
                ));
            };
            let steps = (x.rows(), features.shape()[1]);
            if labels.dim() != steps {
                return Err(Error::ShapeMismatch {
                    context: "labels per step [batch, time]".to_string(),
                    expected: vec![steps.0, steps.1],
                    actual: labels.shape().to_vec(),
                });
            }
            match mask {
                Some(mask) => check_mask(mask, steps, "labels", "a step has a label and 0 where it has none"),
                None => Ok(()),
            }
        }
    }
}

/// Checks that the `what` mask is shaped `dims` (`[batch, time]`) and holds only 0 and
/// 1 (1 where `meaning`).
fn check_mask(mask: &ArrayView2<'_, f32>, dims: (usize, usize), what: &str, meaning: &str) -> Result<()> {
    if mask.dim() != dims {
        return Err(Error::ShapeMismatch {
            context: format!("{what} mask [batch, time]"),
            expected: vec![dims.0, dims.1],
            actual: mask.shape().to_vec(),
        });
    }
    // A value repeated along an axis (a broadcast mask) is looked at once, at its first index.
    if let Some(((r, t), &v)) = finite::distinct(mask.view()).indexed_iter().find(|(_, &v)| v != 0.0 && v != 1.0) {
        return Err(Error::InvalidInput(format!(
            "the {what} mask holds {v} at sequence {r}, step {t}: a mask holds 1 where {meaning}"
        )));
    }
    Ok(())
}

/// One label per input row.
pub(super) fn check_label_count(rows: usize, labels: &ArrayView1<'_, u32>) -> Result<()> {
    if labels.len() != rows {
        return Err(Error::ShapeMismatch {
            context: "labels (one per input row)".to_string(),
            expected: vec![rows],
            actual: vec![labels.len()],
        });
    }
    Ok(())
}
