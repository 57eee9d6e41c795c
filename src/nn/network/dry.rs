//! Sizing before the first step: a shape-only dry run of training steps and
//! inferences ([`Network::dry_run`]).
//!
//! A dry pass runs the network's own code — the same layers, scopes and allocations in
//! the same order — in shape-only workspaces
//! ([`WorkspaceManager::shape_only`](workspace_core::WorkspaceManager::shape_only)) made
//! with the configurations of the network's own, and computes nothing: the layers skip
//! their arithmetic in shape-only scopes, and the checks, the loss and the update are
//! skipped. The shadow workspaces are twins of the network's as they are when the dry
//! run starts (their arenas, how far they have learned, the plans of its groups), so
//! they account, learn their sizes and plan exactly as the network's will, and a dry
//! pass reports what the real pass will, to the byte, through the one figure both
//! compute (`network::pass_bytes`).
//!
//! What a dry run may be used for: sizing (budgets, `fits`, the arenas a run ends
//! with) and the holders of a pass's peak. What it may not: timing (nothing is
//! computed), and any prediction once something else changes the thread's workspaces
//! between the dry run and the run (another network's passes).

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ndarray::{Array1, Array2, Array3};
use workspace_core::plan::{Plan, Trace};
use workspace_core::timeline::{self, Holder, Timeline};
use workspace_core::WorkspaceMode;

use crate::{Error, Result};

use super::super::kernels;
use super::super::step::StepLayers;
use super::config::PLANS;
use super::shadow::Shadow;
use super::{inference_capacity, pass_bytes, probabilities, shape_key, training_capacity, training_workspaces};
use super::{Input, Labels, LayerLabels, Network};

/// The shape of a batch for a dry run ([`Network::dry_run`]); its features are as wide
/// as the network's inputs. The batch is taken as the prefetchers give it: in standard
/// layout, its padded steps zero (a batch in another layout, or whose padding holds
/// values, is copied into the activations workspace first, and takes that copy too).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BatchShape {
    /// `rows` examples, a label each.
    Flat {
        /// Examples.
        rows: usize,
    },
    /// `batch` sequences of `steps` steps, as one padded batch.
    Sequences {
        /// Sequences.
        batch: usize,
        /// Steps (the longest sequence's).
        steps: usize,
        /// Whether the batch has a features mask (padded batches do).
        masked: bool,
        /// Labels per step (a network without a head); otherwise one per sequence.
        labels_per_step: bool,
    },
}

impl BatchShape {
    /// A flat batch of `rows` examples.
    pub fn flat(rows: usize) -> BatchShape {
        BatchShape::Flat { rows }
    }

    /// A padded batch of `batch` sequences of `steps` steps, with its mask, a label per
    /// sequence (what a prefetcher of [`Sequences`](crate::async_iter::Sequences) gives).
    pub fn sequences(batch: usize, steps: usize) -> BatchShape {
        BatchShape::Sequences { batch, steps, masked: true, labels_per_step: false }
    }

    /// `batch` windows of `steps` steps, unmasked, with a label per step: a language
    /// model's batch (what a prefetcher of
    /// [`TokenWindows`](crate::async_iter::TokenWindows) gives). A network whose first
    /// layer reads token ids ([`Layer::reads_tokens`](crate::nn::Layer::reads_tokens):
    /// an [`Embedding`](crate::nn::Embedding), or a user's token layer) takes
    /// [`Input::Tokens`], and its dry runs feed it token ids of the shape.
    pub fn tokens(batch: usize, steps: usize) -> BatchShape {
        BatchShape::Sequences { batch, steps, masked: false, labels_per_step: true }
    }
}

impl fmt::Display for BatchShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            BatchShape::Flat { rows } => write!(f, "{rows} rows"),
            BatchShape::Sequences { batch, steps, masked, labels_per_step } => write!(
                f,
                "{batch} sequences of {steps} steps{}{}",
                if masked { ", masked" } else { "" },
                if labels_per_step { ", labels per step" } else { "" }
            ),
        }
    }
}

/// One pass of a dry run: a training step or an inference of a batch shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DryPass {
    /// A training step ([`Network::fit_batch`]).
    Train(BatchShape),
    /// An inference ([`Network::output`], [`Network::evaluate`] per batch).
    Infer(BatchShape),
}

impl DryPass {
    /// Whether it is a training step.
    fn is_training(self) -> bool {
        matches!(self, DryPass::Train(_))
    }

    /// Its kind as an index: 0 for a training step, 1 for an inference.
    fn kind(self) -> usize {
        usize::from(!self.is_training())
    }
}

impl fmt::Display for DryPass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DryPass::Train(shape) => write!(f, "training step of {shape}"),
            DryPass::Infer(shape) => write!(f, "inference of {shape}"),
        }
    }
}

/// What a dry run found for one distinct pass.
#[derive(Clone, Debug, PartialEq)]
pub struct PassEstimate {
    /// The pass.
    pub pass: DryPass,
    /// What the real pass of this shape reports at its last in the run: for a training
    /// step, [`Network::last_iteration_workspace_bytes`]; for an inference,
    /// [`Network::last_inference_workspace_bytes`] (0 with workspaces off). Enabled
    /// workspaces report the same bytes at every pass of a shape, learning or not;
    /// planned, a shape's first pass (recorded) reports what its workspaces held, and
    /// once the shape repeats the plan's bytes ([`PassEstimate::plan_bytes`]). Every
    /// pass's figure is in [`MemoryEstimate::per_pass_bytes`].
    pub bytes: usize,
    /// The pass laid out per role: each workspace an arena of its own, sized to its
    /// peak (what workspaces enabled take).
    pub per_role_bytes: usize,
    /// One arena planned from the pass's lifetimes (what workspaces planned take).
    pub plan_bytes: usize,
    /// The most bytes live at one moment of the pass: no layout takes less.
    pub lower_bound_bytes: usize,
    /// Allocations the pass makes in workspaces.
    pub allocations: usize,
}

/// What a dry run ([`Network::dry_run`]) says a run of its passes will take.
#[derive(Clone, Debug)]
pub struct MemoryEstimate {
    /// The network's training workspace mode.
    pub training_mode: WorkspaceMode,
    /// The network's inference workspace mode.
    pub inference_mode: WorkspaceMode,
    /// One per distinct pass, in the order they first came.
    pub passes: Vec<PassEstimate>,
    /// The bytes the training workspaces' arenas will hold after these passes: what
    /// [`Network::workspace_capacity`] then reports (0 with workspaces off).
    pub workspace_bytes: usize,
    /// The bytes of the inference workspaces' arenas that the training workspaces do
    /// not already count, after these passes: what
    /// [`Network::inference_workspace_capacity`] then reports (0 with inference
    /// workspaces off).
    pub inference_workspace_bytes: usize,
    /// Weights, gradients and the updater's state (outside workspaces).
    pub parameter_bytes: usize,
    /// Each arena after these passes, largest first: a workspace's (by name) or a plan
    /// group's; those of 0 bytes left out.
    pub arenas: Vec<(String, usize)>,
    /// Per pass of the run, in its order: what the real pass reports after it
    /// ([`Network::last_iteration_workspace_bytes`] for a training step,
    /// [`Network::last_inference_workspace_bytes`] for an inference).
    pub per_pass_bytes: Vec<usize>,
    /// The most workspace bytes any training step of the run reports, its first steps
    /// included: the largest training figure of [`MemoryEstimate::per_pass_bytes`]
    /// (planned, a shape's recorded first step takes more than its plan).
    pub peak_step_bytes: usize,
    /// Dry passes run: each pass of the run that could change what the workspaces hold
    /// (while they learn their sizes or grow; planned, a shape's first pass) or whose
    /// figures were not known yet, and one more for [`MemoryEstimate::peak_holders`].
    /// The others repeat a pass that changed nothing, exactly, and are not run.
    pub passes_run: usize,
    /// How long the dry run took, in microseconds.
    pub dry_run_us: f64,
    /// The five largest holders, by workspace, role and layer, at the moment of the
    /// largest pass with the most bytes live (the dry run records that pass once more
    /// with a timeline of its own).
    pub peak_holders: Vec<Holder>,
}

impl MemoryEstimate {
    /// All the network will hold after the run: parameters, the training and inference
    /// arenas the run ends with, and with workspaces off the heap a pass holds at its
    /// peak (its lower bound: its arrays are heap allocations, freed when their role's
    /// outermost scope closes, as a workspace's cycle ends).
    pub fn total_bytes(&self) -> usize {
        let heap = |off: bool, training: bool| match off {
            false => 0,
            true => self
                .passes
                .iter()
                .filter(|p| p.pass.is_training() == training)
                .map(|p| p.lower_bound_bytes)
                .max()
                .unwrap_or(0),
        };
        let heap = heap(self.training_mode == WorkspaceMode::None, true)
            .max(heap(self.inference_mode == WorkspaceMode::None, false));
        self.parameter_bytes
            .saturating_add(self.workspace_bytes)
            .saturating_add(self.inference_workspace_bytes)
            .saturating_add(heap)
    }

    /// The most workspace bytes one training step reports at the last of its shape in
    /// the run (see [`PassEstimate::bytes`]): the steady figure of the run's largest
    /// step; never above [`MemoryEstimate::peak_step_bytes`].
    pub fn step_bytes(&self) -> usize {
        self.passes.iter().filter(|p| p.pass.is_training()).map(|p| p.bytes).max().unwrap_or(0)
    }

    /// The estimate of `pass`, when it was run.
    pub fn pass(&self, pass: DryPass) -> Option<&PassEstimate> {
        self.passes.iter().find(|p| p.pass == pass)
    }

    /// Whether everything the network will hold ([`MemoryEstimate::total_bytes`]) fits
    /// in `budget` bytes: the bytes to spare, or what is short and by how much.
    ///
    /// # Errors
    ///
    /// A [`Shortfall`] naming the bytes needed, the budget, the difference and the
    /// largest arenas.
    pub fn fits(&self, budget: usize) -> std::result::Result<usize, Shortfall> {
        let needed = self.total_bytes();
        match budget.checked_sub(needed) {
            Some(spare) => Ok(spare),
            None => Err(Shortfall {
                needed,
                budget,
                short_by: needed - budget,
                parameter_bytes: self.parameter_bytes,
                workspace_bytes: self.workspace_bytes,
                inference_workspace_bytes: self.inference_workspace_bytes,
                largest: self.arenas.iter().take(5).cloned().collect(),
                lower_bound_bytes: self.passes.iter().map(|p| p.lower_bound_bytes).max().unwrap_or(0),
                planned: self.training_mode == WorkspaceMode::Planned,
                holders: self.peak_holders.clone(),
            }),
        }
    }
}

/// What does not fit in a budget ([`MemoryEstimate::fits`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shortfall {
    /// Bytes the network will hold.
    pub needed: usize,
    /// The budget asked about.
    pub budget: usize,
    /// `needed - budget`.
    pub short_by: usize,
    /// Of `needed`: weights, gradients and the updater's state.
    pub parameter_bytes: usize,
    /// Of `needed`: the training workspaces' arenas.
    pub workspace_bytes: usize,
    /// Of `needed`: the inference workspaces' arenas.
    pub inference_workspace_bytes: usize,
    /// The five largest arenas, by name.
    pub largest: Vec<(String, usize)>,
    /// The most bytes any one pass holds live at once: what its workspaces could
    /// shrink to at best (planned workspaces come closest).
    pub lower_bound_bytes: usize,
    /// Whether the network trains planned already.
    pub planned: bool,
    /// The five largest live holders by workspace, role and layer at the peak of the
    /// largest pass ([`MemoryEstimate::peak_holders`]).
    pub holders: Vec<Holder>,
}

impl fmt::Display for Shortfall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the network needs {} bytes and the budget is {}: {} bytes short ({} of parameters, gradients and \
             updater state, {} of training workspaces, {} of inference workspaces",
            self.needed,
            self.budget,
            self.short_by,
            self.parameter_bytes,
            self.workspace_bytes,
            self.inference_workspace_bytes
        )?;
        if !self.largest.is_empty() {
            let largest: Vec<String> = self.largest.iter().map(|(name, bytes)| format!("'{name}' {bytes}")).collect();
            write!(f, "; largest arenas: {}", largest.join(", "))?;
        }
        write!(f, "); a pass holds at most {} bytes live at once", self.lower_bound_bytes)?;
        match self.planned {
            true => write!(f, ", which its planned workspaces come close to: try a smaller batch or a larger budget")?,
            false => write!(
                f,
                ", which planned workspaces come closest to: try WorkspaceMode::Planned, a smaller batch, or a \
                 larger budget"
            )?,
        }
        if !self.holders.is_empty() {
            let holders: Vec<String> = self.holders.iter().map(Holder::to_string).collect();
            write!(f, ". At the largest pass's peak the largest live holders are {}", holders.join(", "))?;
        }
        Ok(())
    }
}

impl std::error::Error for Shortfall {}

/// A distinct pass of a dry run: its figures from its first pass, and what it reported
/// at its last.
struct Distinct {
    pass: DryPass,
    figures: PassEstimate,
}

/// The arrays of a dry pass's batch: zeros of the shape (a mask of ones, labels of
/// class 0).
struct DryBatch {
    tokens: Option<Array2<u32>>,
    flat: Option<Array2<f32>>,
    features: Option<Array3<f32>>,
    mask: Option<Array2<f32>>,
    labels: Option<Array1<u32>>,
    step_labels: Option<Array2<u32>>,
}

impl DryBatch {
    /// A batch of `shape` for a network of `inputs` input columns; with `tokens` (a
    /// network whose first layer is an embedding), token ids in place of features.
    fn new(shape: BatchShape, inputs: usize, tokens: bool) -> Result<DryBatch> {
        let empty = || Error::InvalidInput(format!("a dry run of {shape}: a batch needs at least one row and step"));
        let too_large = || Error::InvalidInput(format!("a dry run of {shape}: the batch overflows the address space"));
        let check = |dims: &[usize]| -> Result<()> {
            let elements = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).ok_or_else(too_large)?;
            elements.checked_mul(4).filter(|&b| b <= isize::MAX as usize).map(|_| ()).ok_or_else(too_large)
        };
        // The batch's arrays, refused with an error rather than an abort when the machine
        // cannot hold them.
        fn filled<T: Clone>(shape: BatchShape, len: usize, value: T) -> Result<Vec<T>> {
            let mut v = Vec::new();
            v.try_reserve_exact(len).map_err(|e| {
                Error::InvalidInput(format!("a dry run of {shape}: the batch itself cannot be allocated ({e})"))
            })?;
            v.resize(len, value);
            Ok(v)
        }
        let shaped = |e: ndarray::ShapeError| Error::InvalidInput(format!("a dry run of {shape}: {e}"));
        Ok(match shape {
            BatchShape::Flat { rows } => {
                if rows == 0 {
                    return Err(empty());
                }
                check(&[rows, inputs])?;
                DryBatch {
                    tokens: None,
                    flat: Some(
                        Array2::from_shape_vec((rows, inputs), filled(shape, rows * inputs, 0.0f32)?)
                            .map_err(shaped)?,
                    ),
                    features: None,
                    mask: None,
                    labels: Some(Array1::from(filled(shape, rows, 0u32)?)),
                    step_labels: None,
                }
            }
            BatchShape::Sequences { batch, steps, masked, labels_per_step } => {
                if batch == 0 || steps == 0 {
                    return Err(empty());
                }
                let width = if tokens { 0 } else { inputs };
                check(&[batch, steps, width.max(1)])?;
                let features = filled(shape, batch * steps * width, 0.0f32)?;
                let ids = match tokens {
                    true => Some(
                        Array2::from_shape_vec((batch, steps), filled(shape, batch * steps, 0u32)?).map_err(shaped)?,
                    ),
                    false => None,
                };
                let mask = match masked {
                    true => Some(
                        Array2::from_shape_vec((batch, steps), filled(shape, batch * steps, 1.0f32)?)
                            .map_err(shaped)?,
                    ),
                    false => None,
                };
                let (per_sequence, per_step) = match labels_per_step {
                    false => (Some(Array1::from(filled(shape, batch, 0u32)?)), None),
                    true => (
                        None,
                        Some(
                            Array2::from_shape_vec((batch, steps), filled(shape, batch * steps, 0u32)?)
                                .map_err(shaped)?,
                        ),
                    ),
                };
                DryBatch {
                    tokens: ids,
                    flat: None,
                    features: Some(Array3::from_shape_vec((batch, steps, width), features).map_err(shaped)?),
                    mask,
                    labels: per_sequence,
                    step_labels: per_step,
                }
            }
        })
    }

    fn input(&self) -> Input<'_> {
        if let Some(ids) = &self.tokens {
            return Input::Tokens { ids: ids.view(), mask: self.mask.as_ref().map(|m| m.view()) };
        }
        match (&self.flat, &self.features) {
            (Some(x), _) => Input::Flat(x.view()),
            (None, Some(features)) => {
                Input::Sequences { features: features.view(), mask: self.mask.as_ref().map(|m| m.view()) }
            }
            (None, None) => unreachable!("a dry batch has features"),
        }
    }

    fn labels(&self) -> Labels<'_> {
        match (&self.labels, &self.step_labels) {
            (Some(y), _) => Labels::PerExample(y.view()),
            (None, Some(y)) => Labels::PerStep { labels: y.view(), mask: None },
            (None, None) => unreachable!("a dry batch has labels"),
        }
    }
}

impl Network {
    /// Sizes the network's memory before its first step: a dry run of `passes` (the
    /// training steps and inferences of a run, in the order the run makes them) in
    /// shape-only workspaces of the network's configuration. The layers allocate as
    /// they will, scope by scope, and the built-in ones compute nothing; the network's
    /// weights, updater state, workspaces and counters do not change.
    ///
    /// The estimate is of exactly these passes, run next, from the workspaces as they
    /// are now, and it is exact: per pass, what the real pass then reports
    /// ([`MemoryEstimate::per_pass_bytes`]: [`Network::last_iteration_workspace_bytes`]
    /// after a training step, [`Network::last_inference_workspace_bytes`] after an
    /// inference); per distinct pass, that figure at its last pass, its plan and lower
    /// bound ([`PassEstimate`]); after the run, every arena
    /// ([`MemoryEstimate::arenas`]), those of the training workspaces
    /// ([`MemoryEstimate::workspace_bytes`], what [`Network::workspace_capacity`] then
    /// reports) and those of inference ([`MemoryEstimate::inference_workspace_bytes`],
    /// what [`Network::inference_workspace_capacity`] then reports);
    /// [`MemoryEstimate::fits`] says whether a budget holds it all.
    ///
    /// Enabled workspaces learn their sizes from their first cycles (16 that allocate,
    /// unless [`NetworkConfigBuilder::workspace_learning`](super::NetworkConfigBuilder::workspace_learning)
    /// says otherwise), and grow when a later cycle is larger, so the order and the
    /// length of the run matter: pass the whole run (a run shorter than learning ends
    /// with smaller arenas, which the estimate says). A pass is run dry unless it
    /// repeats one that found the workspaces as they are now and left them so: that one
    /// would change nothing again, and its figures are known. So a long run costs about
    /// the passes that learn, and one of each shape.
    ///
    /// Where it starts from:
    /// - Enabled workspaces are the thread's, shared by name with the thread's other
    ///   networks: the dry run starts from them as those networks and this one's earlier
    ///   passes have left them (their arenas, and how far they have learned). Another
    ///   network that runs on the thread between the dry run and the run changes what
    ///   the run will take.
    /// - A planned network's plan groups are its own: the dry run starts from the plans
    ///   they hold (the shapes the network has run replay them).
    /// - Batches as the prefetchers give them (see [`BatchShape`]).
    /// - No arithmetic: carve's kernels (the matrix multiply, its layers' elementwise
    ///   kernels, the loss, the finite checks) skip theirs while
    ///   [`dry::running`](crate::nn::dry::running) says a dry run runs on the thread, so
    ///   a custom layer built on them computes nothing either. A custom layer's own
    ///   loops run on the zeros of the dry batch unless they ask: the prediction holds,
    ///   and whatever state of its own the pass changes (a counter) changes.
    /// - Memory for it: the shape-only workspaces take the memory they predict while
    ///   the dry run lasts, and give it back when it returns. A shape that the machine
    ///   cannot hold is the allocation's error, not an estimate.
    ///
    /// ```
    /// use carve::nn::{dry::BatchShape, dry::DryPass, Network, NetworkConfig};
    /// use carve::ndarray::{Array1, Array2};
    ///
    /// let mut net = Network::new(NetworkConfig::builder(64).dense(128).relu().dense(10).build()?)?;
    /// let run = [DryPass::Train(BatchShape::flat(32)); 20];
    /// let estimate = net.dry_run(&run)?;
    /// assert!(estimate.fits(1 << 30).is_ok());
    /// let short = estimate.fits(1000).unwrap_err();
    /// assert_eq!(short.short_by, estimate.total_bytes() - 1000);
    ///
    /// // The real steps then take exactly what was predicted, step by step.
    /// let (x, y) = (Array2::<f32>::zeros((32, 64)), Array1::<u32>::zeros(32));
    /// for predicted in &estimate.per_pass_bytes {
    ///     net.fit_batch(x.view(), y.view())?;
    ///     assert_eq!(net.last_iteration_workspace_bytes(), *predicted);
    /// }
    /// assert_eq!(net.last_iteration_workspace_bytes(), estimate.step_bytes());
    /// assert_eq!(net.workspace_capacity(), estimate.workspace_bytes);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for no passes, or a shape with no rows or steps, or too
    /// large to lay out, or a training pass of a network that trains on a device (its
    /// steps do not use the host's workspaces); the errors a real pass of the shape would return for it
    /// (shapes the layers refuse); workspace errors ([`StillOpen`](workspace_core::Error::StillOpen)
    /// while one of the network's workspaces is open).
    pub fn dry_run(&mut self, passes: &[DryPass]) -> Result<MemoryEstimate> {
        if passes.is_empty() {
            return Err(Error::InvalidInput("a dry run needs at least one pass".into()));
        }
        if self.device() != crate::nn::Device::Host && passes.iter().any(|p| matches!(p, DryPass::Train(_))) {
            return Err(Error::InvalidInput(format!(
                "a dry run sizes the host's workspaces, and this network trains on {}: its steps hold device memory \
                 of their own (Network::device_stats); dry-run its inferences, which run on the host",
                self.device()
            )));
        }
        // A timeline recording on this thread records none of it (and labels nothing).
        let _paused = timeline::suspend();
        let started = Instant::now();
        self.dry_run = Some(Box::new(Shadow::of(self)?));
        // carve's kernels issue no arithmetic while it runs (see `dry::running`).
        let estimate = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            kernels::dry_run(|| self.dry_run_in_shadow(passes, started))
        }));
        // The shadow and its memory go, whatever the passes did (a layer's panic goes on
        // from here): the next dry run starts from the workspaces as they are then.
        self.dry_run = None;
        estimate.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }

    /// [`Network::dry_run`] of passes that are there, in its shadow.
    fn dry_run_in_shadow(&mut self, passes: &[DryPass], started: Instant) -> Result<MemoryEstimate> {
        let mut distinct: Vec<Distinct> = Vec::new();
        let mut per_pass_bytes = Vec::with_capacity(passes.len());
        // The passes run that left the shadow's state unchanged, with what each reported:
        // a repeat of one runs the same way, to the byte, and changes nothing, so it is
        // not run (see `ShadowState` for why the state's growing since does not matter).
        let mut unchanged: Vec<(DryPass, usize)> = Vec::new();
        // A plan group keeps `PLANS` plans and drops the one used least recently, which
        // a pass that is not run would not touch: repeats are left out only where the
        // plans kept and the run's shapes of that kind all fit in the cache (nothing is
        // ever dropped).
        let kinds = |kind: usize| {
            let mut seen: Vec<DryPass> = Vec::new();
            for &pass in passes.iter().filter(|p| p.kind() == kind) {
                if !seen.contains(&pass) {
                    seen.push(pass);
                }
            }
            let kept = self.shadow().mgr(kind).plan_group().map_or(0, |group| group.stats().cached_plans);
            kept + seen.len() <= PLANS
        };
        let skips = [kinds(0), kinds(1)];
        let mut run = 0;
        for &pass in passes {
            let index = distinct.iter().position(|d| d.pass == pass);
            if let Some(&(_, bytes)) = unchanged.iter().find(|(p, _)| *p == pass) {
                per_pass_bytes.push(bytes);
                if let Some(i) = index {
                    distinct[i].figures.bytes = bytes;
                }
                continue;
            }
            let before = self.shadow().state();
            let (bytes, figures) = self.dry_pass(pass, index.is_none())?;
            run += 1;
            per_pass_bytes.push(bytes);
            match (index, figures) {
                (Some(i), _) => distinct[i].figures.bytes = bytes,
                (None, Some(figures)) => distinct.push(Distinct { pass, figures }),
                (None, None) => unreachable!("a first pass gives its figures"),
            }
            let after = self.shadow().state();
            if after.spoilt != before.spoilt {
                unchanged.clear();
            } else if skips[pass.kind()] && after.grown == before.grown {
                unchanged.push((pass, bytes));
            }
        }
        // What the run ends with, read before the holders' pass below runs.
        let (workspace_bytes, inference_workspace_bytes, arenas) =
            arenas(self.shadow(), self.training_mode, self.inference_mode);
        let figures: Vec<PassEstimate> = distinct.into_iter().map(|d| d.figures).collect();
        let largest = figures.iter().max_by_key(|p| p.bytes.max(p.lower_bound_bytes)).map(|p| p.pass);
        let peak_holders = match largest {
            Some(pass) => {
                run += 1;
                self.peak_holders(pass)?
            }
            None => Vec::new(),
        };
        let peak_step_bytes =
            passes.iter().zip(&per_pass_bytes).filter(|(p, _)| p.is_training()).map(|(_, &b)| b).max().unwrap_or(0);
        Ok(MemoryEstimate {
            training_mode: self.training_mode,
            inference_mode: self.inference_mode,
            passes: figures,
            workspace_bytes,
            inference_workspace_bytes,
            parameter_bytes: self.parameter_bytes(),
            arenas,
            per_pass_bytes,
            peak_step_bytes,
            passes_run: run,
            dry_run_us: started.elapsed().as_secs_f64() * 1e6,
            peak_holders,
        })
    }

    /// The shadow of the dry run under way.
    fn shadow(&self) -> &Shadow {
        self.dry_run.as_deref().expect("made by dry_run")
    }

    /// The five largest holders, by role and layer, at the peak of `pass`: the pass once
    /// more, recorded by a timeline of its own (a user's recording on this thread is
    /// paused by `dry_run`). Only the holders come of it: the dry run's figures were
    /// read before.
    fn peak_holders(&mut self, pass: DryPass) -> Result<Vec<Holder>> {
        let recording = Timeline::start()?;
        for ws in &self.shadow().all {
            recording.attach(ws)?;
        }
        // The network's labels for this timeline while the pass runs.
        let labels = Box::new(LayerLabels::new(&self.layers, recording.id()));
        let attached = self.timeline.replace(labels);
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.dry_pass(pass, false)));
        recording.end_iteration();
        // The caller's labels back, whatever the pass did (a layer's panic goes on from
        // here).
        self.timeline = attached;
        ran.unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
        let snapshot = recording.snapshot();
        let script = snapshot.records().first().and_then(|r| r.script);
        Ok(script.and_then(|s| snapshot.peak(s)).map(|peak| peak.holders).unwrap_or_default())
    }

    /// Does nothing: each dry run starts from the network's workspaces as they are, and
    /// gives its own back when it returns.
    #[deprecated(note = "each dry run starts from the workspaces as they are and keeps no memory: nothing to reset")]
    pub fn reset_dry_run(&mut self) {}

    /// Weights, gradients and the updater's state, in bytes.
    fn parameter_bytes(&self) -> usize {
        let params: usize = self.layout.layout.total;
        let per = match self.updater.updater() {
            super::super::Updater::Adam { .. } | super::super::Updater::AdamW { .. } => 4,
            super::super::Updater::Sgd { .. } => 3,
        };
        params.saturating_mul(per * size_of::<f32>())
    }

    /// One dry pass: what the real pass would report after it (as
    /// [`Network::last_iteration_workspace_bytes`] and
    /// [`Network::last_inference_workspace_bytes`] compute it), and with `first` the
    /// figures of its shape (its bytes the same): planned, its group's plan (the pass
    /// is the shape's first, so it was recorded and planned); otherwise recorded here
    /// and planned as a group would plan it (recording only observes).
    fn dry_pass(&mut self, pass: DryPass, first: bool) -> Result<(usize, Option<PassEstimate>)> {
        let (shape, training) = match pass {
            DryPass::Train(shape) => (shape, true),
            DryPass::Infer(shape) => (shape, false),
        };
        let off = match training {
            true => self.training_mode == WorkspaceMode::None,
            false => self.inference_mode == WorkspaceMode::None,
        };
        let tokens = self.layers.first().is_some_and(|l| l.reads_tokens());
        let batch = DryBatch::new(shape, self.inputs, tokens)?;
        let shadow = self.shadow();
        let group = shadow.mgr(pass.kind()).plan_group().cloned();
        let workspaces = shadow.workspaces_of(pass.kind()).to_vec();
        let trace = (first && group.is_none()).then(|| Arc::new(Mutex::new(Trace::new())));
        if let Some(trace) = &trace {
            for ws in &workspaces {
                ws.record_into(Some(trace.clone()))?;
            }
        }
        let ran = match &group {
            None => self.dry_pass_once(&batch, training).map(|()| None),
            Some(group) => {
                let key = shape_key(&batch.input(), training.then(|| batch.labels()).as_ref());
                let ((), on_plan) = group.iteration(key, || self.dry_pass_once(&batch, training))?;
                Ok(on_plan.then(|| group.plan_bytes()))
            }
        };
        if trace.is_some() {
            for ws in &workspaces {
                ws.record_into(None)?;
            }
        }
        let plan = ran?;
        let bytes = if off { 0 } else { pass_bytes(workspaces.iter(), plan) };
        let figures = match (first, group, trace) {
            (false, _, _) => None,
            (true, Some(group), _) => {
                let stats = group.stats();
                Some(PassEstimate {
                    pass,
                    bytes,
                    per_role_bytes: stats.per_role_bytes,
                    plan_bytes: stats.plan_bytes,
                    lower_bound_bytes: stats.lower_bound_bytes,
                    allocations: stats.allocations,
                })
            }
            (true, None, trace) => {
                let trace = trace.expect("a first unplanned pass is recorded");
                let trace = trace.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                // Planned as a plan group plans: each run of allocations that live and die
                // together as one (the same bytes and bound, in less time).
                let stats = Plan::new(&trace.runs()).stats("dry run");
                Some(PassEstimate {
                    pass,
                    bytes,
                    per_role_bytes: stats.per_role_bytes,
                    plan_bytes: stats.plan_bytes,
                    lower_bound_bytes: stats.lower_bound_bytes,
                    allocations: stats.allocations,
                })
            }
        };
        Ok((bytes, figures))
    }

    /// One dry training step or inference of `batch`.
    fn dry_pass_once(&mut self, batch: &DryBatch, training: bool) -> Result<()> {
        if training {
            return self.step(batch.input(), batch.labels(), true).map(|_| ());
        }
        self.check_input(&batch.input())?;
        let Network { layers, layout, params, dry_run, .. } = self;
        let shadow = dry_run.as_deref().expect("made by dry_run");
        shadow.infer.reset_peaks();
        let mut layers = StepLayers { layers, params: layout, values: params, grads: None, tapes: None, streams: None };
        probabilities(&mut layers, &shadow.infer, batch.input(), None, |_| Ok(()))
    }
}

/// The arenas the shadow's workspaces hold: the training workspaces' (what
/// [`Network::workspace_capacity`] counts; 0 with `training` off), the inference ones
/// (what [`Network::inference_workspace_capacity`] counts; 0 with `inference` off), and
/// each arena by name, largest first.
fn arenas(shadow: &Shadow, training: WorkspaceMode, inference: WorkspaceMode) -> (usize, usize, Vec<(String, usize)>) {
    let mut named: Vec<(String, usize)> = Vec::new();
    let training_bytes = match training {
        WorkspaceMode::None => 0,
        _ => {
            if let Some(group) = shadow.train[0].plan_group() {
                named.push((group.stats().name, group.capacity()));
            }
            for ws in training_workspaces(&shadow.train) {
                named.push((ws.name().to_string(), ws.capacity()));
            }
            training_capacity(&shadow.train)
        }
    };
    let inference_bytes = match inference {
        WorkspaceMode::None => 0,
        _ => {
            if let Some(group) = shadow.infer.plan_group() {
                named.push((group.stats().name, group.capacity()));
            }
            // Those training counted already: the working memory both modes share.
            let counted: Vec<u64> = match training {
                WorkspaceMode::None => Vec::new(),
                _ => training_workspaces(&shadow.train).map(|ws| ws.id()).collect(),
            };
            for ws in shadow.infer.workspaces().filter(|ws| !counted.contains(&ws.id())) {
                named.push((ws.name().to_string(), ws.capacity()));
            }
            inference_capacity(&shadow.train, training, &shadow.infer)
        }
    };
    named.retain(|(_, bytes)| *bytes > 0);
    named.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    (training_bytes, inference_bytes, named)
}
