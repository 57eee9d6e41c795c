//! The network: a configuration builder, training (`fit` over a prefetcher, `fit_batch`), inference (`output`) and
//! evaluation, with workspaces laid out as DL4J lays them out.

use std::ptr::NonNull;

use async_iter::{BatchSource, Prefetcher};
use ndarray::{ArrayView1, ArrayView2, ArrayViewMut2, Axis, Ix1, Ix2};
use workspace_core::{
    ArenaBackend, ArrayType, Block, Handle, LayerWorkspaceMgr, LearningPolicy, Scope, SpillPolicy, TypedScope,
    Workspace, WorkspaceConfig, WorkspaceMode,
};

use crate::{Error, Result};

use super::dense::Dense;
use super::finite;
use super::layer::{BackwardCtx, ForwardCtx, Layer};
use super::loss::SoftmaxCrossEntropy;
use super::relu::Relu;
use super::updater::{Updater, UpdaterState};
use super::Rng;

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
    /// Activations during inference.
    pub const INFERENCE_ACT: &str = "WS_INFERENCE_ACT";
}

/// The configuration of a [`Network`]: its layers (the last one produces the class
/// scores, followed by softmax cross-entropy), seed, updater and workspace modes.
pub struct NetworkConfig {
    inputs: usize,
    layers: Vec<Box<dyn Layer>>,
    seed: u64,
    updater: Updater,
    training_workspace_mode: WorkspaceMode,
    inference_workspace_mode: WorkspaceMode,
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
    training_workspace_mode: WorkspaceMode,
    inference_workspace_mode: WorkspaceMode,
    error: Option<Error>,
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
            training_workspace_mode: WorkspaceMode::Enabled,
            inference_workspace_mode: WorkspaceMode::Enabled,
            error: None,
        }
    }
}

impl NetworkConfigBuilder {
    /// Appends a layer (a user's custom layer, or one of [`Dense`], [`Relu`]).
    ///
    /// A layer that cannot take the current width, or that produces no columns, makes
    /// [`NetworkConfigBuilder::build`] fail.
    pub fn layer(mut self, layer: impl Layer + 'static) -> Self {
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

    /// Appends a [`Relu`], named after its position like the dense layers (`relu_1`
    /// after `dense_0`), so that a message names the one that failed.
    pub fn relu(self) -> Self {
        let name = format!("relu_{}", self.layers.len());
        self.layer(Relu::named(&name))
    }

    /// Seed of weight initialisation.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
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

    /// Workspaces during `output` and `evaluate`.
    pub fn inference_workspace_mode(mut self, mode: WorkspaceMode) -> Self {
        self.inference_workspace_mode = mode;
        self
    }

    /// Checks the configuration.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for no inputs, no layers, a layer that produces no
    /// columns, a dense layer too large to allocate, fewer than two classes or a bad
    /// learning rate; [`Error::ShapeMismatch`] when a layer cannot take the previous
    /// layer's width.
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
        let lr = match self.updater {
            Updater::Sgd { learning_rate, .. } | Updater::Adam { learning_rate, .. } => learning_rate,
        };
        if !(lr.is_finite() && lr > 0.0) {
            return invalid(format!("learning rate {lr} must be finite and positive"));
        }
        Ok(NetworkConfig {
            inputs: self.inputs,
            layers: self.layers,
            seed: self.seed,
            updater: self.updater,
            training_workspace_mode: self.training_workspace_mode,
            inference_workspace_mode: self.inference_workspace_mode,
        })
    }
}

/// The configuration of every network workspace: sized from the largest of the
/// first 16 cycles (working memory and gradient workspaces see cycles of different
/// sizes within one iteration, as DL4J's `cyclesBeforeInitialization` accounts for),
/// growing once more if a later cycle is larger (a bigger batch), never shrinking.
/// Fixed, so that networks of any depth share the workspaces of their thread.
pub fn workspace_config() -> WorkspaceConfig {
    WorkspaceConfig::builder()
        .learning(LearningPolicy::OverTime { cycles: 16 })
        .spill(SpillPolicy::Reallocate)
        .build()
        .expect("a valid workspace configuration")
}

/// Training-time workspace managers: two, differing only in where input gradients
/// go, so that a layer's input gradient and its output gradient are in different
/// workspaces and the older one can be reset as soon as it is consumed.
fn training_mgrs(mode: WorkspaceMode) -> Result<[LayerWorkspaceMgr; 2]> {
    if mode == WorkspaceMode::None {
        return Ok([LayerWorkspaceMgr::no_workspaces(), LayerWorkspaceMgr::no_workspaces()]);
    }
    let config = workspace_config();
    let base = |grad: &str| {
        LayerWorkspaceMgr::builder()
            .with(ArrayType::Input, names::ALL_LAYERS_ACT, config.clone())
            .with(ArrayType::Activations, names::ALL_LAYERS_ACT, config.clone())
            .with(ArrayType::FfCache, names::ALL_LAYERS_ACT, config.clone())
            .with(ArrayType::ActivationGrad, grad, config.clone())
            .with(ArrayType::UpdaterWorkingMem, names::UPDATER_WORKING_MEM, config.clone())
            .default_workspace(names::LAYER_WORKING_MEM, config.clone())
            .build()
    };
    Ok([base(names::ACT_GRAD_1)?, base(names::ACT_GRAD_2)?])
}

fn inference_mgr(mode: WorkspaceMode) -> Result<LayerWorkspaceMgr> {
    if mode == WorkspaceMode::None {
        return Ok(LayerWorkspaceMgr::no_workspaces());
    }
    let config = workspace_config();
    LayerWorkspaceMgr::builder()
        .with(ArrayType::Input, names::INFERENCE_ACT, config.clone())
        .with(ArrayType::Activations, names::INFERENCE_ACT, config.clone())
        .with(ArrayType::FfCache, names::INFERENCE_ACT, config.clone())
        .default_workspace(names::LAYER_WORKING_MEM, config)
        .build()
        .map_err(Error::from)
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

    /// One training iteration on a batch: forward, loss, backward, update. Returns
    /// the batch's mean loss (before the update).
    ///
    /// With workspaces enabled, a steady-state call makes no heap allocation.
    ///
    /// # Errors
    ///
    /// Shape and label errors; workspace errors; [`WrongLocation`](workspace_core::Error::WrongLocation) when a
    /// layer returns activations that are not in the activations workspace;
    /// [`Error::InvalidInput`] or [`Error::ShapeMismatch`] when a layer's parameters
    /// are not those it had when the network was built (then no parameter is updated);
    /// [`Error::NonFinite`], naming the layer, when a value of the step is not finite
    /// (NaN or infinite): an input element ("input"), a layer's output, the gradient
    /// of its input or of a parameter, the loss ("loss"), or a moment, update or new
    /// value the updater would store. After an error the network is unchanged (its
    /// parameters and its updater's state are as they were before the call) and usable.
    pub fn fit_batch(&mut self, x: ArrayView2<'_, f32>, labels: ArrayView1<'_, u32>) -> Result<f32> {
        self.check_batch(&x, Some(&labels))?;
        // A NaN would not surface by itself: ReLU maps it to 0, softmax's maximum skips
        // it, the loss clamps it, and the parameters would silently become NaN.
        finite::check_matrix("input", "the batch", x.view())?;
        let Network { layers, loss, updater, train, .. } = self;
        let mgr = &train[0];
        train[0].reset_peaks();
        train[1].reset_peaks();

        let act = mgr.enter(ArrayType::Activations)?;
        // The list of activations lives in the activations workspace too.
        let mut outputs = allocator_api2::vec::Vec::with_capacity_in(layers.len(), &*act);
        let mut input = x.view();
        for layer in layers.iter_mut() {
            let working = mgr.enter(ArrayType::FfWorkingMem)?;
            let ctx = ForwardCtx { activations: &act, working: &working, mgr, training: true };
            let y = layer.forward(input, &ctx)?;
            mgr.validate(ArrayType::Activations, layer.name(), &y)?;
            finite::check_matrix(layer.name(), "its output", y.view())?;
            outputs.push(y);
            input = y;
        }
        let probs = loss.probabilities(input, &act)?;
        let batch_loss = loss.loss(probs, labels)?;
        if !batch_loss.is_finite() {
            return Err(finite::error("loss", format!("the mean softmax cross-entropy is {batch_loss}")));
        }

        // Backward, from the loss down: the gradient of each layer's output is in one
        // of the two gradient workspaces, and the layer writes the gradient of its
        // input into the other (see `Gradient`).
        let depth = layers.len();
        let mut grad = Gradient::zeros(&train[0], probs.raw_dim())?;
        loss.backward(probs, labels, grad.view_mut()?)?;
        for (i, layer) in layers.iter_mut().enumerate().rev() {
            let layer_input = if i == 0 { x.view() } else { outputs[i - 1].view() };
            // The gradient of the first layer's input is not needed.
            let mut below = match i {
                0 => None,
                _ => Some(Gradient::zeros(&train[(depth - i) % 2], layer_input.raw_dim())?),
            };
            {
                let working = mgr.enter(ArrayType::BpWorkingMem)?;
                let ctx = BackwardCtx { working: &working, mgr };
                let grad_input = below.as_mut().map(Gradient::view_mut).transpose()?;
                layer.backward(layer_input, outputs[i], grad.view()?, grad_input, &ctx)?;
            }
            check_gradients(&mut **layer, below.as_ref().map(Gradient::view).transpose()?)?;
            match below {
                // The gradient just consumed closes its workspace here.
                Some(below) => grad = below,
                None => break,
            }
        }
        drop(grad);

        {
            let working = mgr.enter(ArrayType::UpdaterWorkingMem)?;
            updater.apply(layers, &working)?;
        }
        drop(outputs);
        drop(act);
        self.last_workspace_bytes = self.sum_over_training_workspaces(|ws| ws.peak_bytes());
        self.iterations += 1;
        Ok(batch_loss)
    }

    /// Trains one epoch on the batches of a [`Prefetcher`]: every remaining batch of
    /// its current epoch, each used in place in the prefetch ring (features
    /// `(rows, inputs)` of `f32`, labels `(rows,)` of `u32`, as
    /// [`InMemory`](async_iter::InMemory) gives them). Returns the mean of the batch
    /// losses.
    ///
    /// At the end of the epoch the prefetcher is [reset](Prefetcher::reset), so that
    /// the next epoch's first batches are filled while the caller evaluates or logs;
    /// call `fit` again for the next epoch.
    ///
    /// ```
    /// use carve::async_iter::{InMemory, Prefetcher};
    /// use carve::nn::{NetworkConfig, Network};
    /// use carve::ndarray::{Array1, Array2};
    ///
    /// let x = Array2::from_shape_fn((96, 4), |(r, c)| ((r * 7 + c * 3) % 11) as f32 / 11.0);
    /// let y = Array1::from_shape_fn(96, |r| (r % 3) as u32);
    /// let mut net = Network::new(NetworkConfig::builder(4).dense(16).relu().dense(3).build()?)?;
    /// let mut batches = Prefetcher::builder(InMemory::new(x, y, 32)?.shuffled(1)).build()?;
    /// let first = net.fit(&mut batches)?;
    /// for _ in 0..20 {
    ///     net.fit(&mut batches)?; // one epoch each, the ring reused
    /// }
    /// assert!(net.fit(&mut batches)? < first);
    /// assert_eq!(net.iterations(), 22 * 3);
    /// assert_eq!(batches.stats().ring_growths, 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Data`] wrapping the prefetcher's [`async_iter::Error`] (a source
    /// error or panic, at its batch; a batch without `f32` features of two dimensions
    /// or `u32` labels of one); the first error of [`Network::fit_batch`]. An epoch
    /// with no batches is [`Error::InvalidInput`]. After an error the prefetcher is
    /// where the error left it: call `reset()` on it to start the epoch again.
    pub fn fit<S, B>(&mut self, batches: &mut Prefetcher<S, B>) -> Result<f32>
    where
        S: BatchSource,
        B: ArenaBackend + 'static,
        B::Block: Block<Base = NonNull<u8>>,
    {
        let data = Error::from;
        let (mut total, mut count) = (0.0f64, 0usize);
        while let Some(batch) = batches.next() {
            let batch = batch.map_err(data)?;
            let x = batch.features::<f32, Ix2>().map_err(data)?;
            let y = batch.labels::<u32, Ix1>().map_err(data)?;
            total += f64::from(self.fit_batch(x, y)?);
            count += 1;
        }
        if count == 0 {
            return Err(Error::InvalidInput(format!(
                "fit was given an epoch with no batches (epoch {} of the prefetcher had ended; fit resets it after \
                 each epoch it trains, so reset it once if you consumed an epoch yourself)",
                batches.epoch()
            )));
        }
        batches.reset().map_err(data)?;
        Ok((total / count as f64) as f32)
    }

    /// Trains on every `(features, labels)` pair of `batches` once, in the caller's
    /// memory (no prefetching); returns the mean of the batch losses.
    ///
    /// # Errors
    ///
    /// The first error of [`Network::fit_batch`]; an empty iterator is
    /// [`Error::InvalidInput`].
    pub fn fit_iter<'d, I>(&mut self, batches: I) -> Result<f32>
    where
        I: IntoIterator<Item = (ArrayView2<'d, f32>, ArrayView1<'d, u32>)>,
    {
        let (mut total, mut count) = (0.0f64, 0usize);
        for (x, y) in batches {
            total += f64::from(self.fit_batch(x, y)?);
            count += 1;
        }
        if count == 0 {
            return Err(Error::InvalidInput("fit_iter was given no batches".to_string()));
        }
        Ok((total / count as f64) as f32)
    }

    /// The class probabilities of `x`, computed in the inference workspaces and
    /// handed to `f` while they are alive.
    fn infer<R>(&mut self, x: ArrayView2<'_, f32>, f: impl FnOnce(ArrayView2<'_, f32>) -> Result<R>) -> Result<R> {
        self.check_batch(&x, None)?;
        let Network { layers, loss, infer: mgr, .. } = self;
        let act = mgr.enter(ArrayType::Activations)?;
        let mut input = x.view();
        for layer in layers.iter_mut() {
            let working = mgr.enter(ArrayType::FfWorkingMem)?;
            let ctx = ForwardCtx { activations: &act, working: &working, mgr, training: false };
            let y = layer.forward(input, &ctx)?;
            mgr.validate(ArrayType::Activations, layer.name(), &y)?;
            input = y;
        }
        let probs = loss.probabilities(input, &act)?;
        f(probs)
    }

    /// Class probabilities of `x`, detached into an owned array.
    ///
    /// # Errors
    ///
    /// Shape errors and workspace errors.
    pub fn output(&mut self, x: ArrayView2<'_, f32>) -> Result<ndarray::Array2<f32>> {
        self.infer(x, |probs| Ok(probs.to_owned()))
    }

    /// Class probabilities of `x`, copied into the caller's open scope (for example
    /// a workspace the caller keeps open across several calls).
    ///
    /// # Errors
    ///
    /// Shape errors and workspace errors (of the inference workspaces and of `target`).
    pub fn output_to<'s>(&mut self, x: ArrayView2<'_, f32>, target: &'s Scope<'_>) -> Result<ArrayViewMut2<'s, f32>> {
        self.infer(x, |probs| Ok(target.copy_of(&probs)?))
    }

    /// Predicted classes of `x` (the most probable per row), written to `out`.
    ///
    /// # Errors
    ///
    /// Shape errors and workspace errors.
    pub fn predict_into(&mut self, x: ArrayView2<'_, f32>, out: &mut [u32]) -> Result<()> {
        if out.len() != x.nrows() {
            return Err(Error::ShapeMismatch {
                context: "prediction buffer (one per input row)".to_string(),
                expected: vec![x.nrows()],
                actual: vec![out.len()],
            });
        }
        self.infer(x, |probs| {
            for (slot, row) in out.iter_mut().zip(probs.axis_iter(Axis(0))) {
                *slot = argmax(row);
            }
            Ok(())
        })
    }

    /// Fraction of rows of `x` whose predicted class is the label, in batches of
    /// `batch_size` rows.
    ///
    /// # Errors
    ///
    /// Shape errors; [`Error::InvalidInput`] for a zero batch size or no rows.
    pub fn evaluate(&mut self, x: ArrayView2<'_, f32>, labels: ArrayView1<'_, u32>, batch_size: usize) -> Result<f64> {
        if batch_size == 0 || x.nrows() == 0 {
            return Err(Error::InvalidInput("evaluate needs at least one row and a batch size above 0".into()));
        }
        check_label_count(&x, &labels)?;
        let mut correct = 0usize;
        for (xb, yb) in x.axis_chunks_iter(Axis(0), batch_size).zip(labels.axis_chunks_iter(Axis(0), batch_size)) {
            correct += self.infer(xb, |probs| {
                Ok(probs.axis_iter(Axis(0)).zip(yb.iter()).filter(|(row, &y)| argmax(row.view()) == y).count())
            })?;
        }
        Ok(correct as f64 / x.nrows() as f64)
    }
}

/// Checks the gradients `layer`'s backward pass left: those of its parameters, and
/// `grad_input`, the gradient of its input.
/// The gradient flowing down the network in the backward pass: an array in one of the
/// two gradient workspaces, with the scope that keeps that workspace open.
///
/// It is a [`Handle`] and not a view because it moves from one loop iteration to the
/// next together with its scope, and a view cannot move with the scope it borrows.
/// Each access through the handle checks the generation, and the views it gives borrow
/// the scope, so nothing outlives the workspace's cycle.
struct Gradient {
    scope: TypedScope,
    array: Handle<f32, Ix2>,
}

impl Gradient {
    /// Zeros of `shape` in `mgr`'s gradient workspace.
    fn zeros(mgr: &LayerWorkspaceMgr, shape: Ix2) -> Result<Gradient> {
        let scope = mgr.enter(ArrayType::ActivationGrad)?;
        let array = scope.zeros_handle(shape)?;
        Ok(Gradient { scope, array })
    }

    fn view(&self) -> Result<ArrayView2<'_, f32>> {
        Ok(self.array.view(&self.scope)?)
    }

    fn view_mut(&mut self) -> Result<ArrayViewMut2<'_, f32>> {
        Ok(self.array.view_mut(&self.scope)?)
    }
}

fn check_gradients(layer: &mut dyn Layer, grad_input: Option<ArrayView2<'_, f32>>) -> Result<()> {
    if let Some(grad_input) = grad_input {
        finite::check_matrix(layer.name(), "the gradient of its input", grad_input)?;
    }
    let (mut param, mut bad) = (0, None);
    layer.params(&mut |p| {
        if bad.is_none() {
            bad = finite::first_in_slice(p.grad).map(|(element, value)| (param, element, value));
        }
        param += 1;
    });
    match bad {
        None => Ok(()),
        Some((param, element, value)) => Err(finite::error(
            layer.name(),
            format!("the gradient of its parameter {param} (element {element}) is {value}"),
        )),
    }
}

/// One label per input row.
fn check_label_count(x: &ArrayView2<'_, f32>, labels: &ArrayView1<'_, u32>) -> Result<()> {
    if labels.len() != x.nrows() {
        return Err(Error::ShapeMismatch {
            context: "labels (one per input row)".to_string(),
            expected: vec![x.nrows()],
            actual: vec![labels.len()],
        });
    }
    Ok(())
}

/// Index of the largest value (the first on ties).
fn argmax(row: ArrayView1<'_, f32>) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}
