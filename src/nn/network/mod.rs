//! The network: a configuration builder ([`config`]), training ([`train`]: `fit` over a
//! prefetcher, `fit_batch`, `fit_iter`), and inference and evaluation ([`infer`]), with
//! workspaces laid out as DL4J lays them out.

mod config;
mod infer;
mod train;

use ndarray::{ArrayView1, ArrayView2};
use workspace_core::{ArrayType, LayerWorkspaceMgr, Workspace, WorkspaceMode};

use crate::{Error, Result};

use super::layer::Layer;
use super::loss::SoftmaxCrossEntropy;
use super::updater::{Updater, UpdaterState};
use super::Rng;

use config::{inference_mgr, training_mgrs};
pub use config::{names, workspace_config, NetworkConfig, NetworkConfigBuilder};

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

    /// Total arena capacity of the training workspaces (0 with workspaces off).
    pub fn workspace_capacity(&self) -> usize {
        self.sum_over_training_workspaces(|ws| ws.capacity())
    }

    /// `f` summed over the training workspaces: those of the first manager, and the
    /// second manager's gradient workspace (the rest it shares with the first).
    fn sum_over_training_workspaces(&self, f: impl Fn(&Workspace) -> usize) -> usize {
        let second = self.train[1].workspace(ArrayType::ActivationGrad).map_or(0, |ws| f(ws));
        self.train[0].workspaces().map(|ws| f(ws)).sum::<usize>() + second
    }

    /// Workspace bytes in use at the peaks of the last training iteration, summed over
    /// the training workspaces (0 with workspaces off).
    pub fn last_iteration_workspace_bytes(&self) -> usize {
        self.last_workspace_bytes
    }

    fn check_batch(&self, x: &ArrayView2<'_, f32>, labels: Option<&ArrayView1<'_, u32>>) -> Result<()> {
        if x.ncols() != self.inputs {
            return Err(Error::ShapeMismatch {
                context: "network input".to_string(),
                expected: vec![x.nrows(), self.inputs],
                actual: x.shape().to_vec(),
            });
        }
        if x.nrows() == 0 {
            return Err(Error::InvalidInput("an empty batch (0 rows) cannot be fed to the network".to_string()));
        }
        match labels {
            Some(labels) => check_label_count(x, labels),
            None => Ok(()),
        }
    }
}

/// One label per input row.
pub(super) fn check_label_count(x: &ArrayView2<'_, f32>, labels: &ArrayView1<'_, u32>) -> Result<()> {
    if labels.len() != x.nrows() {
        return Err(Error::ShapeMismatch {
            context: "labels (one per input row)".to_string(),
            expected: vec![x.nrows()],
            actual: vec![labels.len()],
        });
    }
    Ok(())
}
