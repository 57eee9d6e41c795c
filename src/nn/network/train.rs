//! Training: one step on a batch, an epoch from a prefetcher, an epoch from slices.

use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use async_iter::{BatchSource, Prefetcher};
use ndarray::{ArrayView1, ArrayView2, Axis};

use super::super::device::StepInput;
use workspace_core::backend::{ArenaBackend, Block};
use workspace_core::plan::{Plan, Trace};
use workspace_core::ArrayType;

use crate::{Error, Result};

use super::super::gemm;
use super::super::limits::check_threads;
use super::super::profile::{self, Part, StepBreakdown};
use super::super::step::{self, Run, StepLayers};
use super::batch::shape_key;
use super::{label, lease_input, lease_labels, pass_bytes, training_workspaces, Input, Labels, Network};

impl Network {
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
    /// value the updater would store. Steps that a features mask marks as padding are
    /// not checked and not used: they are zeroed before the first layer, so whatever
    /// they hold, the loss and the step are those of the zero-padded batch. After an
    /// error the network is unchanged (its parameters and its updater's state are as
    /// they were before the call) and usable.
    pub fn fit_batch<'x, 'l>(&mut self, x: impl Into<Input<'x>>, labels: impl Into<Labels<'l>>) -> Result<f32> {
        if self.device_step.is_some() {
            return self.fit_batch_on_device(x.into(), labels.into());
        }
        let measured = profile::start(self.breakdown.is_some());
        let _pool = gemm::pool::use_pool(self.pool.as_ref());
        let loss = self.fit_batch_unmeasured(x.into(), labels.into());
        self.end_timeline_iteration();
        let loss = loss?;
        if let Some(breakdown) = self.breakdown.as_mut() {
            measured.finish(breakdown);
        }
        Ok(loss)
    }

    /// [`Network::fit_batch`] on the network's device: the batch checked here (shapes,
    /// labels, token ids, finite features, steps within the context), then the device
    /// step.
    fn fit_batch_on_device(&mut self, x: Input<'_>, labels: Labels<'_>) -> Result<f32> {
        self.check_batch(&x, Some(&labels))?;
        let device = self.device;
        let unsupported = |what: &str| {
            Error::InvalidInput(format!(
                "a network training on {device} takes {what} so far; train it on the host (Device::Host) for the rest"
            ))
        };
        let step = self.device_step.as_mut().expect("checked by the caller");
        let (input, labels) = match (x, labels) {
            (Input::Flat(x), Labels::PerExample(labels)) => (StepInput::Flat(x), labels.insert_axis(Axis(1))),
            (Input::Sequences { features, mask: None }, Labels::PerStep { labels, mask: None }) => {
                (StepInput::Sequences(features), labels)
            }
            (Input::Tokens { ids, mask: None }, Labels::PerStep { labels, mask: None }) => {
                (StepInput::Tokens(ids), labels)
            }
            (Input::Sequences { mask: Some(_), .. } | Input::Tokens { mask: Some(_), .. }, _)
            | (_, Labels::PerStep { mask: Some(_), .. }) => return Err(unsupported("batches without masks")),
            _ => {
                return Err(unsupported(
                    "a flat batch with one label per example, or sequences or token ids with one label per step",
                ))
            }
        };
        if let StepInput::Sequences(features) = input {
            if !features.is_standard_layout() {
                return Err(unsupported("sequences in standard (row-major) layout"));
            }
        }
        if matches!(input, StepInput::Tokens(_)) != step.takes_tokens() {
            return Err(Error::InvalidInput(format!(
                "this network's first layer {} token ids: give it {}",
                if step.takes_tokens() { "takes" } else { "does not take" },
                if step.takes_tokens() { "Input::Tokens" } else { "features" }
            )));
        }
        if let (StepInput::Tokens(ids), Some(vocabulary)) = (input, step.vocabulary()) {
            if let Some(((b, t), &id)) = ids.indexed_iter().find(|(_, &id)| id as usize >= vocabulary) {
                return Err(Error::InvalidInput(format!(
                    "token id {id} (sequence {b}, step {t}) is not a token of the embedding's vocabulary of {vocabulary}"
                )));
            }
        }
        if let Some(((r, c), &label)) = labels.indexed_iter().find(|(_, &l)| l as usize >= self.classes) {
            return Err(Error::InvalidInput(format!(
                "label {label} (at [{r}, {c}]) is not a class of this network ({} classes)",
                self.classes
            )));
        }
        let steps = labels.ncols();
        if let Some(context) = step.max_steps().filter(|&context| steps > context) {
            return Err(Error::InvalidInput(format!(
                "sequences of {steps} steps are longer than the position embedding's context of {context}"
            )));
        }
        let non_finite = match input {
            StepInput::Flat(x) => {
                super::super::finite::first_in_matrix(x).map(|(r, c, v)| format!("[{r}, {c}] is {v}"))
            }
            StepInput::Sequences(x) => {
                x.indexed_iter().find(|(_, v)| !v.is_finite()).map(|(at, v)| format!("{at:?} is {v}"))
            }
            StepInput::Tokens(_) => None,
        };
        if let Some(what) = non_finite {
            return Err(Error::NonFinite { layer: "input".into(), what: format!("element {what}") });
        }
        if self.params_set {
            // Set since the device's last step (a checkpoint restored): its step starts
            // from them, as the host's would.
            step.send_params(&self.params)?;
            self.params_set = false;
        }
        let loss = step.fit(input, labels, Arc::make_mut(&mut self.params).as_mut_slice(), &mut self.grads)?;
        self.iterations += 1;
        Ok(loss)
    }

    /// [`Network::fit_batch`] without its breakdown.
    fn fit_batch_unmeasured(&mut self, x: Input<'_>, labels: Labels<'_>) -> Result<f32> {
        let Some(group) = self.train[0].plan_group().cloned() else {
            return self.recorded_step(x, labels);
        };
        // Planned: the iteration replays the plan of its shape (or is recorded).
        let key = shape_key(&x, Some(&labels));
        let (loss, on_plan) = group.iteration(key, || self.recorded_step(x, labels))?;
        if on_plan {
            // On the plan: the plan's bytes were the iteration's memory.
            self.last_workspace_bytes = pass_bytes(training_workspaces(&self.train), Some(group.plan_bytes()));
        }
        Ok(loss)
    }

    /// Switches the breakdown of each training step's time on (from zero) or off. On, a
    /// step costs two clock reads per part it enters (about 30 of them for a
    /// three-layer MLP).
    ///
    /// ```
    /// use carve::nn::{Network, NetworkConfig};
    /// use carve::ndarray::{Array1, Array2};
    ///
    /// let mut net = Network::new(NetworkConfig::builder(8).dense(16).relu().dense(3).build()?)?;
    /// net.set_breakdown(true);
    /// let (x, y) = (Array2::<f32>::ones((4, 8)), Array1::<u32>::zeros(4));
    /// for _ in 0..3 {
    ///     net.fit_batch(x.view(), y.view())?;
    /// }
    /// let breakdown = net.breakdown().expect("switched on");
    /// assert_eq!(breakdown.steps, 3);
    /// assert!(breakdown.matmul_ns > 0 && breakdown.updater_ns > 0);
    /// # Ok::<(), carve::Error>(())
    /// ```
    pub fn set_breakdown(&mut self, on: bool) {
        self.breakdown = on.then(StepBreakdown::default);
    }

    /// Splits a training step's large matrix multiplies across `threads` threads (the
    /// caller's and `threads - 1` more, started now and kept until the network drops or
    /// this is called again; 1: none). Each product's columns are cut into blocks of
    /// whole tiles, one per thread, each computed in the same order as on one thread:
    /// the losses are the same bits whatever the number of threads. Products under 8
    /// MFLOP (the demo's) stay on the calling thread, where the hand-off would cost
    /// more than it gives. A step allocates nothing either way.
    ///
    /// ```
    /// use carve::nn::{Network, NetworkConfig};
    /// use carve::ndarray::{Array1, Array2};
    ///
    /// let config = || NetworkConfig::builder(256).dense(512).relu().dense(4).seed(2).build();
    /// let (mut one, mut two) = (Network::new(config()?)?, Network::new(config()?)?);
    /// two.set_threads(2)?;
    /// let x = Array2::from_shape_fn((64, 256), |(r, c)| ((r * 7 + c) % 13) as f32 / 13.0);
    /// let y = Array1::from_shape_fn(64, |r| (r % 4) as u32);
    /// for _ in 0..3 {
    ///     let (a, b) = (one.fit_batch(x.view(), y.view())?, two.fit_batch(x.view(), y.view())?);
    ///     assert_eq!(a.to_bits(), b.to_bits());
    /// }
    /// # Ok::<(), carve::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for 0 threads or more than [`MAX_THREADS`](crate::nn::limits::MAX_THREADS), or a
    /// thread that cannot start.
    pub fn set_threads(&mut self, threads: usize) -> Result<()> {
        self.pool = None;
        check_threads("a network's training threads", threads)?;
        match threads {
            1 => Ok(()),
            n => {
                self.pool = Some(gemm::pool::Pool::new(n)?);
                Ok(())
            }
        }
    }

    /// The threads a training step's large matrix multiplies split across.
    pub fn threads(&self) -> usize {
        self.pool.as_ref().map_or(1, |p| p.threads())
    }

    /// Where the training steps' time went since [`Network::set_breakdown`] (`None`
    /// when off): each part's nanoseconds, over the steps that succeeded.
    pub fn breakdown(&self) -> Option<StepBreakdown> {
        self.breakdown
    }

    /// One training iteration, recorded when [`Network::record_next_iteration`] asked.
    fn recorded_step(&mut self, x: Input<'_>, labels: Labels<'_>) -> Result<f32> {
        if !self.record_next {
            return self.step(x, labels, false);
        }
        self.record_next = false;
        let trace = Arc::new(Mutex::new(Trace::new()));
        // Detaches the recorder from every workspace it reached however the step ends:
        // an error while attaching it, the step's error, a layer's panic.
        let mut recording = Recording(training_workspaces(&self.train).cloned().collect());
        for ws in &recording.0 {
            ws.record_into(Some(trace.clone()))?;
        }
        let result = self.step(x, labels, false);
        // Every scope of the step has closed, whatever it returned.
        recording.detach()?;
        if result.is_ok() {
            let trace = trace.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if !trace.events().is_empty() {
                self.memory_plan = Some(Plan::new(&trace).stats("training"));
                self.recorded = Some(trace.clone());
            }
        }
        result
    }

    /// One training iteration (see [`Network::fit_batch`]); with `dry`, a dry run of
    /// one in the shape-only workspaces of [`Network::dry_run`]: the same allocations
    /// and scopes, in the same order, and no arithmetic (the layers skip theirs in
    /// shape-only scopes; the checks, the loss and the update are skipped here), so
    /// nothing of the network changes.
    pub(super) fn step(&mut self, x: Input<'_>, labels: Labels<'_>, dry: bool) -> Result<f32> {
        let x = x.reborrow();
        // Labels per step without a mask of their own are masked like the features.
        let labels = labels.reborrow().or_mask(x.mask());
        self.check_batch(&x, Some(&labels))?;
        let count = counted(&labels);
        if count == 0 && !dry {
            return Err(Error::InvalidInput("the labels mask selects no label: there is nothing to learn from".into()));
        }
        let Network { layers, layout, params, grads, tapes, updater, train, dry_run, timeline, .. } = self;
        let train = match (dry, dry_run.as_deref()) {
            (false, _) => &*train,
            (true, Some(shadow)) => &shadow.train,
            (true, None) => return Err(Error::InvalidInput("a dry run needs its shape-only workspaces".into())),
        };
        train[0].reset_peaks();
        train[1].reset_peaks();
        let run = Run { train, labels: timeline.as_deref(), count };
        let mut step_layers = StepLayers {
            layers,
            params: layout,
            values: params,
            grads: Some(grads),
            tapes: Some(tapes),
            streams: None,
        };
        let loss_sum = step::passes(&mut step_layers, x, labels, &run, &mut 0)?;
        // The update reads no activation: their bytes are free for its working memory.
        {
            label(run.labels, |l| Some(l.updater));
            let working = train[0].enter(ArrayType::UpdaterWorkingMem)?;
            if !dry {
                let _span = profile::span(Part::Updater);
                updater.apply(params, grads, layout, layers, &working)?;
            }
        }
        if dry {
            return Ok(0.0);
        }
        self.last_workspace_bytes = pass_bytes(training_workspaces(&self.train), None);
        self.iterations += 1;
        Ok((loss_sum / count as f64) as f32)
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
        fit_epoch(batches, |x, y| self.fit_batch(x, y))
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
        fit_pairs(batches, |x, y| self.fit_batch(x, y))
    }
}

/// One epoch of a prefetcher's batches, each trained in place in the ring by `step`
/// (a network's or a data-parallel trainer's `fit_batch`): the mean batch loss, and the
/// prefetcher reset for the next epoch (see [`Network::fit`]).
pub(crate) fn fit_epoch<S, B>(
    batches: &mut Prefetcher<S, B>,
    mut step: impl FnMut(Input<'_>, Labels<'_>) -> Result<f32>,
) -> Result<f32>
where
    S: BatchSource,
    B: ArenaBackend + 'static,
    B::Block: Block<Base = NonNull<u8>>,
{
    let data = Error::from;
    let (mut total, mut count) = (0.0f64, 0usize);
    while let Some(batch) = batches.next() {
        let batch = batch.map_err(data)?;
        let x = lease_input(&batch)?;
        let y = lease_labels(&batch)?;
        total += f64::from(step(x, y)?);
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

/// Every `(features, labels)` pair trained once by `step`: the mean batch loss (see
/// [`Network::fit_iter`]).
pub(crate) fn fit_pairs<'d, I>(batches: I, mut step: impl FnMut(Input<'d>, Labels<'d>) -> Result<f32>) -> Result<f32>
where
    I: IntoIterator<Item = (ArrayView2<'d, f32>, ArrayView1<'d, u32>)>,
{
    let (mut total, mut count) = (0.0f64, 0usize);
    for (x, y) in batches {
        total += f64::from(step(x.into(), y.into())?);
        count += 1;
    }
    if count == 0 {
        return Err(Error::InvalidInput("fit_iter was given no batches".to_string()));
    }
    Ok((total / count as f64) as f32)
}

/// The labels a batch counts: every label, or those its mask keeps.
pub(crate) fn counted(labels: &Labels<'_>) -> usize {
    match labels {
        Labels::PerExample(y) => y.len(),
        Labels::PerStep { labels, mask: None } => labels.len(),
        Labels::PerStep { mask: Some(mask), .. } => mask.iter().filter(|&&m| m != 0.0).count(),
    }
}

/// The training workspaces recording into a trace for one step: detached from it by
/// [`Recording::detach`], or when dropped (errors ignored: a workspace a caller holds
/// open is left as it is).
struct Recording(Vec<std::rc::Rc<workspace_core::Workspace>>);

impl Recording {
    /// Detaches the recorder from every workspace.
    ///
    /// # Errors
    ///
    /// The first workspace's error ([`Error::StillOpen`](crate::Error) for one a caller
    /// holds open); every other workspace is detached all the same.
    fn detach(&mut self) -> Result<()> {
        let mut first = Ok(());
        for ws in std::mem::take(&mut self.0) {
            if let Err(e) = ws.record_into(None) {
                first = first.and(Err(e.into()));
            }
        }
        first
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        let _ = self.detach();
    }
}
