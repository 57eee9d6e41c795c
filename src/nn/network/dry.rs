//! Sizing before the first step: a shape-only dry run of training steps and
//! inferences ([`Network::dry_run`]).
//!
//! A dry pass runs the network's own code — the same layers, scopes and allocations in
//! the same order — in shape-only workspaces ([`WorkspaceManager::shape_only`]) made
//! with the configurations of the network's own, and computes nothing: the layers skip
//! their arithmetic in shape-only scopes, and the checks, the loss and the update are
//! skipped. So the shadow workspaces account, learn their sizes and plan exactly as the
//! network's will, and what they report is what the real passes will take, to the byte.

use std::fmt;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ndarray::{Array1, Array2, Array3};
use workspace_core::plan::{Plan, Trace};
use workspace_core::timeline::{self, Holder, Timeline};
use workspace_core::{LayerWorkspaceMgr, LearningPolicy, Workspace, WorkspaceManager, WorkspaceMode};

use crate::{Error, Result};

use super::config::{inference_mgr_in, training_mgrs_in};
use super::{probabilities, shape_key, sum_over_training_workspaces, training_capacity, training_workspaces};
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
    /// Workspace bytes a real pass of this shape uses: for a training step, what
    /// [`Network::last_iteration_workspace_bytes`] reports after it (the training
    /// workspaces' peaks, summed; planned, the plan's bytes; 0 with workspaces off);
    /// for an inference, the same of the inference workspaces.
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
    /// not already count.
    pub inference_workspace_bytes: usize,
    /// Weights, gradients and the updater's state (outside workspaces).
    pub parameter_bytes: usize,
    /// Each arena, largest first: a workspace's (by name) or a plan group's.
    pub arenas: Vec<(String, usize)>,
    /// The most workspace bytes any training step of the run reports
    /// ([`Network::last_iteration_workspace_bytes`]), its first steps included: while
    /// the workspaces learn their sizes (enabled) or a shape is recorded for its plan
    /// (planned) a step may take more than in the steady state
    /// ([`MemoryEstimate::step_bytes`]).
    pub peak_step_bytes: usize,
    /// Dry passes run: those of the run that its workspaces still learned from (or,
    /// planned, the recording and the first replay of each shape), and one more per
    /// distinct unplanned pass for its steady figures.
    pub passes_run: usize,
    /// How long the dry run took, in microseconds.
    pub dry_run_us: f64,
    /// The five largest holders, by workspace, role and layer, at the moment of the
    /// largest pass with the most bytes live (the dry run records that pass once more
    /// with a timeline of its own).
    pub peak_holders: Vec<Holder>,
}

impl MemoryEstimate {
    /// All the network will hold: parameters, training and inference arenas, and with
    /// workspaces off the heap a pass holds at its peak (its lower bound: its arrays are
    /// heap allocations, freed as they die).
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

    /// The most workspace bytes one training step uses (see [`PassEstimate::bytes`]).
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

/// The shape-only workspaces a network's dry runs use: a registry of their own and the
/// network's managers over it, with the same names, configurations and modes as the
/// network's (workspaces off: enabled ones, so that the figures of each pass are known
/// all the same).
pub(super) struct Shadow {
    pub(super) train: [LayerWorkspaceMgr; 2],
    pub(super) infer: LayerWorkspaceMgr,
    /// Whether every workspace a training step (`[0]`) or an inference (`[1]`) uses
    /// has learned its size (once true, it stays: learning does not start again).
    learned: [bool; 2],
    /// The most bytes a dry training step would have reported as the real one does.
    peak_step_bytes: usize,
    /// Whether a training step (`[0]`) or an inference (`[1]`) has run: the
    /// workspaces a pass of that kind uses have then allocated (what they hold does not
    /// depend on the shape), so that `learned` says they learned their sizes.
    ran: [bool; 2],
}

impl Shadow {
    fn new(training: WorkspaceMode, inference: WorkspaceMode) -> Result<Shadow> {
        let registry = WorkspaceManager::shape_only();
        // Training and inference share workspaces by name in one registry, as on the
        // network's thread; a mode that has no workspaces gets its figures from
        // workspaces of its own, which the other mode's do not see.
        let off = training == WorkspaceMode::None || inference == WorkspaceMode::None;
        let inference_registry = if off { WorkspaceManager::shape_only() } else { registry.clone() };
        let on = |mode| if mode == WorkspaceMode::None { WorkspaceMode::Enabled } else { mode };
        Ok(Shadow {
            train: training_mgrs_in(on(training), Some(&registry))?,
            infer: inference_mgr_in(on(inference), Some(&inference_registry))?,
            learned: [false; 2],
            peak_step_bytes: 0,
            ran: [false; 2],
        })
    }

    /// Whether every workspace that `pass` uses, and that has allocated, has learned its
    /// size (a cycle that allocates nothing teaches nothing).
    fn learned(&mut self, pass: DryPass) -> bool {
        let kind = pass.kind();
        if !self.learned[kind] {
            let learned = |ws: &Rc<Workspace>| {
                let stats = ws.stats();
                ws.config().learning() == LearningPolicy::None
                    || stats.learned_size.is_some()
                    || stats.bytes_spilled == 0
            };
            self.learned[kind] = match kind {
                0 => training_workspaces(&self.train).all(learned),
                _ => self.infer.workspaces().all(learned),
            };
        }
        self.learned[kind]
    }

    /// The bytes of every arena of the shadow (its workspaces' and its groups').
    fn arena_bytes(&self) -> usize {
        let groups = [self.train[0].plan_group(), self.infer.plan_group()];
        self.workspaces().iter().map(|ws| ws.capacity()).sum::<usize>()
            + groups.iter().flatten().map(|g| g.capacity()).sum::<usize>()
    }

    /// Whether every workspace of the shadow has learned its size.
    fn all_learned(&mut self, passes: &[DryPass]) -> bool {
        passes.iter().all(|&pass| self.learned(pass))
    }

    /// Every workspace of the shadow, each once.
    fn workspaces(&self) -> Vec<Rc<Workspace>> {
        let mut all: Vec<Rc<Workspace>> = Vec::new();
        for ws in training_workspaces(&self.train).chain(self.infer.workspaces()) {
            if !all.iter().any(|w| w.id() == ws.id()) {
                all.push(ws.clone());
            }
        }
        all
    }
}

/// A distinct pass of a dry run: how often the run made it so far, whether the run has
/// a steady repeat of it (one that mirrors nothing new), and its figures when known.
struct Distinct {
    pass: DryPass,
    count: usize,
    steady_repeat: bool,
    figures: Option<PassEstimate>,
}

/// The arrays of a dry pass's batch: zeros of the shape (a mask of ones, labels of
/// class 0).
struct DryBatch {
    flat: Option<Array2<f32>>,
    features: Option<Array3<f32>>,
    mask: Option<Array2<f32>>,
    labels: Option<Array1<u32>>,
    step_labels: Option<Array2<u32>>,
}

impl DryBatch {
    fn new(shape: BatchShape, inputs: usize) -> Result<DryBatch> {
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
                check(&[batch, steps, inputs])?;
                let features = filled(shape, batch * steps * inputs, 0.0f32)?;
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
                    flat: None,
                    features: Some(Array3::from_shape_vec((batch, steps, inputs), features).map_err(shaped)?),
                    mask,
                    labels: per_sequence,
                    step_labels: per_step,
                }
            }
        })
    }

    fn input(&self) -> Input<'_> {
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
    /// weights, updater state, workspaces and counters do not change. The estimate
    /// says, per distinct pass, the workspace bytes a real pass of that shape will use
    /// ([`PassEstimate::bytes`], equal to the byte to what the real pass then reports),
    /// its plan and lower bound, and what the training workspaces will hold after the
    /// run ([`MemoryEstimate::workspace_bytes`], what
    /// [`Network::workspace_capacity`] will report); [`MemoryEstimate::fits`] says
    /// whether a budget holds it all.
    ///
    /// Workspaces learn their sizes from their first cycles (16 that allocate), so the
    /// order matters: a pass seen before is run again only while some workspace still
    /// learns. After the passes given, the workspaces still learning end their learning
    /// as a run that repeats these passes would (the repeats teach them nothing
    /// larger): the estimate is of a run past learning; a run shorter than that (16
    /// steps, 16 inferences) may hold less. Each dry run continues the last: call
    /// [`Network::reset_dry_run`] to start afresh.
    ///
    /// What it assumes:
    /// - The network alone on its thread, from new workspaces. Enabled workspaces are
    ///   the thread's, by name: another network on the thread, or earlier training,
    ///   leaves them at least the size it taught them.
    /// - Batches as the prefetchers give them (see [`BatchShape`]).
    /// - Layers that ask [`Scope::is_shape_only`](workspace_core::Scope::is_shape_only)
    ///   skip their arithmetic, as carve's do. A custom layer that does not runs its
    ///   whole pass on the zeros of the dry batch: the prediction holds, and whatever
    ///   state of its own the pass changes (its gradients, a counter) changes.
    /// - Memory for it: the shape-only workspaces take the memory they predict, and keep
    ///   it until [`Network::reset_dry_run`] (or the network drops). A shape that the
    ///   machine cannot hold is the allocation's error, not an estimate.
    ///
    /// ```
    /// use carve::nn::{BatchShape, DryPass, Network, NetworkConfig};
    /// use carve::ndarray::{Array1, Array2};
    ///
    /// let mut net = Network::new(NetworkConfig::builder(64).dense(128).relu().dense(10).build()?)?;
    /// let estimate = net.dry_run(&[DryPass::Train(BatchShape::flat(32))])?;
    /// assert!(estimate.fits(1 << 30).is_ok());
    /// let short = estimate.fits(1000).unwrap_err();
    /// assert_eq!(short.short_by, estimate.total_bytes() - 1000);
    ///
    /// // The real steps then take exactly what was predicted.
    /// let (x, y) = (Array2::<f32>::zeros((32, 64)), Array1::<u32>::zeros(32));
    /// for _ in 0..20 {
    ///     net.fit_batch(x.view(), y.view())?;
    /// }
    /// assert_eq!(net.last_iteration_workspace_bytes(), estimate.step_bytes());
    /// assert_eq!(net.workspace_capacity(), estimate.workspace_bytes);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for no passes, or a shape with no rows or steps, or too
    /// large to lay out; the errors a real pass of the shape would return for it
    /// (shapes the layers refuse); workspace errors.
    pub fn dry_run(&mut self, passes: &[DryPass]) -> Result<MemoryEstimate> {
        if passes.is_empty() {
            return Err(Error::InvalidInput("a dry run needs at least one pass".into()));
        }
        // A timeline recording on this thread records none of it (and labels nothing).
        let _paused = timeline::suspend();
        let estimate = self.dry_run_passes(passes);
        if estimate.is_err() {
            // A pass that failed half-way taught the shadow workspaces a part of itself:
            // the next dry run starts afresh.
            self.dry_run = None;
        }
        estimate
    }

    /// [`Network::dry_run`] of passes that are there.
    fn dry_run_passes(&mut self, passes: &[DryPass]) -> Result<MemoryEstimate> {
        let started = Instant::now();
        if self.dry_run.is_none() {
            self.dry_run = Some(Box::new(Shadow::new(self.training_mode, self.inference_mode)?));
        }
        // The passes in order, mirroring the run: each pass the run makes while its
        // workspaces still learn their sizes (enabled), and the first two of each shape
        // (planned: the recording, and the first replay, which sizes the arena for its
        // plan). The other passes are steady repeats, which change nothing.
        let mut distinct: Vec<Distinct> = Vec::new();
        let mut run = 0;
        let shadow = self.dry_run.as_deref_mut().expect("made above");
        shadow.peak_step_bytes = 0;
        for &pass in passes {
            let i = match distinct.iter().position(|d| d.pass == pass) {
                Some(i) => i,
                None => {
                    distinct.push(Distinct { pass, count: 0, steady_repeat: false, figures: None });
                    // A new pass may be the first to allocate in a workspace: ask again.
                    self.dry_run.as_deref_mut().expect("made above").learned = [false; 2];
                    distinct.len() - 1
                }
            };
            distinct[i].count += 1;
            let planned = self.dry_mgr(pass).plan_group().is_some();
            let shadow = self.dry_run.as_deref_mut().expect("made above");
            let mirrored = match planned {
                true => distinct[i].count <= 2,
                false => distinct[i].count == 1 || !shadow.learned(pass),
            };
            if !mirrored {
                distinct[i].steady_repeat = true;
                continue;
            }
            // A new unplanned pass whose workspaces learned already runs as it will run
            // again: its figures are the steady ones, unless it grew an arena.
            let first = distinct[i].count == 1;
            let steady_first = first && !planned && shadow.ran[pass.kind()] && shadow.learned(pass);
            let arenas_before = steady_first.then(|| shadow.arena_bytes());
            let figures = self.dry_pass(pass, (planned && first) || steady_first, true)?;
            let shadow = self.dry_run.as_deref_mut().expect("made above");
            if (planned && first) || arenas_before.is_some_and(|before| before == shadow.arena_bytes()) {
                distinct[i].figures = Some(figures);
            }
            run += 1;
        }
        // A run of many passes repeats these: its workspaces end learning with the
        // largest cycle seen, every pass having run (repeats would teach them nothing
        // larger), so learning ends here without running them.
        let shadow = self.dry_run.as_deref_mut().expect("made above");
        let all: Vec<DryPass> = distinct.iter().map(|d| d.pass).collect();
        if !shadow.all_learned(&all) {
            for ws in shadow.workspaces() {
                ws.finish_learning()?;
            }
            shadow.learned = [false; 2];
        }
        // The figures of each distinct pass in the steady state: planned, its plan's (from
        // its recording); otherwise a pass once more, as its steady repeats run (which
        // count in the peak when the run has one).
        let mut figures = Vec::with_capacity(distinct.len());
        for d in &mut distinct {
            let estimate = match d.figures.take() {
                Some(estimate) => estimate,
                None => {
                    run += 1;
                    let estimate = self.dry_pass(d.pass, true, false)?;
                    if d.steady_repeat && d.pass.is_training() {
                        let shadow = self.dry_run.as_deref_mut().expect("made above");
                        shadow.peak_step_bytes = shadow.peak_step_bytes.max(estimate.bytes);
                    }
                    estimate
                }
            };
            figures.push(estimate);
        }
        let largest = figures.iter().max_by_key(|p| p.bytes.max(p.lower_bound_bytes)).map(|p| p.pass);
        let peak_holders = match largest {
            Some(pass) => self.peak_holders(pass)?,
            None => Vec::new(),
        };
        let shadow = self.dry_run.as_deref().expect("made above");
        let off = self.training_mode == WorkspaceMode::None;
        let (workspace_bytes, inference_workspace_bytes, arenas) = arenas(shadow, off, self.inference_mode);
        Ok(MemoryEstimate {
            training_mode: self.training_mode,
            inference_mode: self.inference_mode,
            passes: figures,
            workspace_bytes,
            inference_workspace_bytes,
            parameter_bytes: self.parameter_bytes(),
            arenas,
            peak_step_bytes: if off { 0 } else { shadow.peak_step_bytes },
            passes_run: run,
            dry_run_us: started.elapsed().as_secs_f64() * 1e6,
            peak_holders,
        })
    }

    /// The five largest holders, by role and layer, at the peak of `pass`: the pass once
    /// more (a steady repeat, which changes no figure), recorded by a timeline of its
    /// own (a user's recording on this thread is paused by `dry_run`).
    fn peak_holders(&mut self, pass: DryPass) -> Result<Vec<Holder>> {
        let recording = Timeline::start()?;
        for ws in self.dry_run.as_deref().expect("made by dry_run").workspaces() {
            recording.attach(&ws)?;
        }
        // The network's labels for this timeline while the pass runs.
        let labels = Box::new(LayerLabels::new(&self.layers, recording.id()));
        let attached = self.timeline.replace(labels);
        let ran = self.dry_pass(pass, false, false);
        recording.end_iteration();
        self.timeline = attached;
        ran?;
        let snapshot = recording.snapshot();
        let script = snapshot.records().first().and_then(|r| r.script);
        Ok(script.and_then(|s| snapshot.peak(s)).map(|peak| peak.holders).unwrap_or_default())
    }

    /// Forgets what earlier dry runs taught the shape-only workspaces and gives their
    /// memory back: the next [`Network::dry_run`] starts from new ones, as a new network
    /// would.
    pub fn reset_dry_run(&mut self) {
        self.dry_run = None;
    }

    /// Weights, gradients and the updater's state, in bytes.
    fn parameter_bytes(&self) -> usize {
        let params: usize = self.layers.iter().map(|l| l.param_count()).sum();
        let per = match self.updater.updater() {
            super::super::Updater::Adam { .. } => 4,
            super::super::Updater::Sgd { .. } => 3,
        };
        params.saturating_mul(per * size_of::<f32>())
    }

    /// The shadow manager a pass runs in.
    fn dry_mgr(&self, pass: DryPass) -> &LayerWorkspaceMgr {
        let shadow = self.dry_run.as_deref().expect("made by dry_run");
        match pass {
            DryPass::Train(_) => &shadow.train[0],
            DryPass::Infer(_) => &shadow.infer,
        }
    }

    /// One dry pass, mirroring a pass of the run (a training step's bytes, as the real
    /// step reports them, go into the peak), and its figures when `figures`: planned,
    /// its plan's (made at the end of a recording); otherwise recorded and planned here
    /// (the passes that only mirror the run skip that).
    fn dry_pass(&mut self, pass: DryPass, figures: bool, mirrored: bool) -> Result<PassEstimate> {
        let (shape, training) = match pass {
            DryPass::Train(shape) => (shape, true),
            DryPass::Infer(shape) => (shape, false),
        };
        self.dry_run.as_deref_mut().expect("made by dry_run").ran[pass.kind()] = true;
        let batch = DryBatch::new(shape, self.inputs)?;
        let nothing =
            PassEstimate { pass, bytes: 0, per_role_bytes: 0, plan_bytes: 0, lower_bound_bytes: 0, allocations: 0 };
        let estimate = match self.dry_mgr(pass).plan_group().cloned() {
            Some(group) => {
                let key = shape_key(&batch.input(), training.then(|| batch.labels()).as_ref());
                let ((), on_plan) = group.iteration(key, || self.dry_pass_once(&batch, training))?;
                if training && mirrored {
                    // As the real step reports it: on its plan, the plan's bytes.
                    let shadow = self.dry_run.as_deref_mut().expect("made by dry_run");
                    let bytes = match on_plan {
                        true => group.plan_bytes(),
                        false => sum_over_training_workspaces(&shadow.train, |ws| ws.peak_bytes()),
                    };
                    shadow.peak_step_bytes = shadow.peak_step_bytes.max(bytes);
                }
                match figures {
                    false => nothing,
                    true => {
                        let stats = group.stats();
                        PassEstimate {
                            pass,
                            bytes: stats.plan_bytes,
                            per_role_bytes: stats.per_role_bytes,
                            plan_bytes: stats.plan_bytes,
                            lower_bound_bytes: stats.lower_bound_bytes,
                            allocations: stats.allocations,
                        }
                    }
                }
            }
            None if !figures => {
                self.dry_pass_once(&batch, training)?;
                self.unplanned_pass_bytes(training, mirrored);
                nothing
            }
            None => {
                let trace = Arc::new(Mutex::new(Trace::new()));
                let shadow = self.dry_run.as_deref().expect("made by dry_run");
                let recorded: Vec<Rc<Workspace>> = match training {
                    true => training_workspaces(&shadow.train).cloned().collect(),
                    false => shadow.infer.workspaces().cloned().collect(),
                };
                for ws in &recorded {
                    ws.record_into(Some(trace.clone()))?;
                }
                let result = self.dry_pass_once(&batch, training);
                for ws in &recorded {
                    ws.record_into(None)?;
                }
                result?;
                let bytes = self.unplanned_pass_bytes(training, mirrored);
                let trace = trace.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                // Planned as a plan group plans: each run of allocations that live and die
                // together as one (the same bytes and bound, in less time).
                let stats = Plan::new(&trace.runs()).stats("dry run");
                let off = match training {
                    true => self.training_mode == WorkspaceMode::None,
                    false => self.inference_mode == WorkspaceMode::None,
                };
                PassEstimate {
                    pass,
                    bytes: if off { 0 } else { bytes },
                    per_role_bytes: stats.per_role_bytes,
                    plan_bytes: stats.plan_bytes,
                    lower_bound_bytes: stats.lower_bound_bytes,
                    allocations: stats.allocations,
                }
            }
        };
        Ok(estimate)
    }

    /// After an unplanned dry pass: the bytes it held, as a real pass reports them (a
    /// training step's into the peak, when it mirrors one of the run).
    fn unplanned_pass_bytes(&mut self, training: bool, mirrored: bool) -> usize {
        let shadow = self.dry_run.as_deref_mut().expect("made by dry_run");
        if !training {
            return shadow.infer.peak_bytes();
        }
        let bytes = sum_over_training_workspaces(&shadow.train, |ws| ws.peak_bytes());
        if mirrored {
            shadow.peak_step_bytes = shadow.peak_step_bytes.max(bytes);
        }
        bytes
    }

    /// One dry training step or inference of `batch`.
    fn dry_pass_once(&mut self, batch: &DryBatch, training: bool) -> Result<()> {
        if training {
            return self.step(batch.input(), batch.labels(), true).map(|_| ());
        }
        self.check_input(&batch.input())?;
        let Network { layers, dry_run, .. } = self;
        let shadow = dry_run.as_deref().expect("made by dry_run");
        shadow.infer.reset_peaks();
        probabilities(layers.iter_mut(), &shadow.infer, batch.input(), None, |_| Ok(()))
    }
}

/// The arenas the shadow's workspaces hold: the training workspaces' (what
/// [`Network::workspace_capacity`] counts; 0 when `training_off`), the inference ones
/// not among them (0 when inference is off), and each arena by name, largest first.
fn arenas(shadow: &Shadow, training_off: bool, inference: WorkspaceMode) -> (usize, usize, Vec<(String, usize)>) {
    let training = if training_off { 0 } else { training_capacity(&shadow.train) };
    let mut named: Vec<(String, usize)> = Vec::new();
    let mut inference_bytes = 0;
    if !training_off {
        if let Some(group) = shadow.train[0].plan_group() {
            named.push((group.stats().name, group.capacity()));
        }
        for ws in training_workspaces(&shadow.train) {
            named.push((ws.name().to_string(), ws.capacity()));
        }
    }
    if inference != WorkspaceMode::None {
        if let Some(group) = shadow.infer.plan_group() {
            named.push((group.stats().name, group.capacity()));
            inference_bytes += group.capacity();
        }
        let counted: Vec<u64> = training_workspaces(&shadow.train).map(|ws| ws.id()).collect();
        for ws in shadow.infer.workspaces() {
            if training_off || !counted.contains(&ws.id()) {
                named.push((ws.name().to_string(), ws.capacity()));
                inference_bytes += ws.capacity();
            }
        }
    }
    named.retain(|(_, bytes)| *bytes > 0);
    named.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    (training, inference_bytes, named)
}
