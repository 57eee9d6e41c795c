//! One worker of a data-parallel trainer: its planned arena, its tapes and its reducer,
//! and the step it runs on its shard of a batch.

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;
use std::sync::Arc;

use workspace_core::planned::PlanGroup;
use workspace_core::{ArrayType, LayerWorkspaceMgr, Workspace, WorkspaceMode};

use crate::{Error, Result};

use super::super::finite;
use super::super::layer::{Layer, Tape};
use super::super::network::{names, planned_workspace_config, shape_key, training_mgrs, Input, Labels};
use super::super::params::{Layout, Params};
use super::super::profile::{self, Part};
use super::super::step::{self, Run, StepLayers};
use super::super::sync::panic_message;
use super::super::updater::{check_range, commit_range, Updater};
use super::reduce::{share, Reducer, Report};
use super::shared::SharedBuf;

/// What every worker shares: the layers, the parameters and the updater's state, held
/// once.
pub(crate) struct Shared {
    pub(crate) layers: Arc<[Box<dyn Layer>]>,
    /// The network's layout of the layers' parameters.
    pub(crate) params_layout: Arc<Params>,
    /// The same regions, with the gradient buckets of this trainer.
    pub(crate) layout: Layout,
    pub(crate) params: SharedBuf,
    /// Velocity (SGD) or first moment (Adam), in the parameters' layout.
    pub(crate) first: SharedBuf,
    /// Second moment (Adam; empty for SGD).
    pub(crate) second: SharedBuf,
    pub(crate) updater: Updater,
}

impl Shared {
    /// A shared part of no layers: what a trainer is left with once
    /// [`DataParallel::into_network`](crate::nn::parallel::DataParallel::into_network) took its own.
    pub(crate) fn empty() -> Shared {
        Shared {
            layers: Arc::from(Vec::<Box<dyn Layer>>::new()),
            params_layout: Arc::new(Params::of(0, &[]).expect("no layers to check")),
            layout: Layout::new(&[], 1),
            params: SharedBuf::new(Vec::new()),
            first: SharedBuf::new(Vec::new()),
            second: SharedBuf::new(Vec::new()),
            updater: Updater::default(),
        }
    }
}

/// One step as the coordinator describes it to every worker.
#[derive(Clone, Copy)]
pub(crate) struct StepDesc<'x> {
    pub(crate) x: Input<'x>,
    pub(crate) labels: Labels<'x>,
    /// The labels the whole batch counts: each shard's loss gradient is scaled by its
    /// inverse, so that the sum over shards is the gradient of the batch's mean loss.
    pub(crate) count: usize,
    /// Shards the batch is cut into.
    pub(crate) shards: usize,
    /// The updater's step (from 1).
    pub(crate) t: i32,
}

impl StepDesc<'_> {
    /// The rows of shard `s`.
    pub(crate) fn rows(&self, s: usize) -> Range<usize> {
        let n = self.x.rows();
        n * s / self.shards..n * (s + 1) / self.shards
    }
}

/// Why a worker's step failed: the worker (or shard), where (a layer's name, or
/// "input", "loss", "update"), and, on the worker that failed, the error.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) worker: usize,
    pub(crate) layer: usize,
    pub(crate) error: Option<Error>,
}

/// The worker of a [`Failure`] made from a plan group's error, before the step knows
/// whose it is.
const THIS_WORKER: usize = usize::MAX;

impl From<workspace_core::Error> for Failure {
    /// A plan group's error, outside every layer (starting the worker's iteration); the
    /// step names the worker.
    fn from(error: workspace_core::Error) -> Failure {
        Failure { worker: THIS_WORKER, layer: usize::MAX, error: Some(error.into()) }
    }
}

impl Failure {
    /// The failure with the plan group's placeholders filled in: `rank` the worker,
    /// outside every layer.
    fn of(self, rank: usize, shared: &Shared) -> Failure {
        match self.worker {
            THIS_WORKER => Failure { worker: rank, layer: outside(shared), error: self.error },
            _ => self,
        }
    }
}

/// How far a worker got through a step's collective calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Before the first exchange: a failure here is reported to the others by an
    /// exchange made after it.
    Passes,
    /// In the collective calls: a failure here leaves them unfinished, and the worker
    /// abandons the group.
    Collective,
    /// Every worker knows the step's outcome.
    Agreed,
}

/// A worker: its own planned arena (the training workspaces and its gradient buckets,
/// one plan group), its layers' tapes, its reducer.
pub(crate) struct Worker {
    train: [LayerWorkspaceMgr; 2],
    group: PlanGroup,
    buckets: Rc<Workspace>,
    tapes: Vec<Tape>,
    pub(crate) reducer: Box<dyn Reducer>,
    /// The reducer's rank, checked once.
    rank: usize,
    /// Whether the reducer's workers are threads sharing the parameters (each updates
    /// its share of every bucket), or this worker updates them all.
    shares: bool,
    reports: Vec<Report>,
    /// The ranges whose update this worker checks and stores, with the worker (shard)
    /// each belongs to, in the order failures are reported: by worker, then bucket.
    owned: Vec<(usize, Range<usize>)>,
}

/// The failure "layer" of what is outside every layer: the input, the loss, the update.
fn outside(shared: &Shared) -> usize {
    shared.layers.len()
}

impl Worker {
    /// A worker of `shared`'s layers that reduces through `reducer`, made on the thread
    /// that runs it. `shares`: the reducer's workers are threads of this process that
    /// share the parameters. `shards`: the shards it runs in the single-thread mode.
    pub(crate) fn new(shared: &Shared, reducer: Box<dyn Reducer>, shares: bool, shards: usize) -> Result<Worker> {
        let train = training_mgrs(WorkspaceMode::Planned)?;
        let group = train[0].plan_group().cloned().expect("planned training workspaces have a plan group");
        let buckets = group.workspace(names::GRADIENT_BUCKETS, &planned_workspace_config())?;
        let (workers, rank) = (reducer.workers(), reducer.rank());
        if rank >= workers {
            return Err(Error::InvalidConfig { reason: format!("a reducer of rank {rank} among {workers} workers") });
        }
        Ok(Worker {
            train,
            group,
            buckets,
            tapes: shared.layers.iter().map(|layer| layer.tape()).collect(),
            reducer,
            rank,
            shares,
            reports: vec![Report::default(); workers],
            owned: Vec::with_capacity(shared.layout.buckets.len() * shards.max(1)),
        })
    }

    /// The bytes of this worker's plan for its last shape (the largest iteration it
    /// planned), and its arena's capacity.
    pub(crate) fn plan_bytes(&self) -> (usize, usize) {
        (self.group.plan_bytes(), self.group.capacity())
    }

    /// One step as rank `rank` of the reducer's workers: forward and backward on this
    /// rank's shard into its gradient buckets, the reports exchanged, the buckets reduced,
    /// this worker's ranges of the update checked, the checks exchanged, the ranges
    /// updated. Returns the batch's mean loss; every worker returns the same.
    ///
    /// Whatever fails, this worker takes part in every collective call the others make,
    /// or abandons the group: no worker is left waiting.
    pub(crate) fn step(&mut self, shared: &Shared, desc: &StepDesc<'_>) -> std::result::Result<f32, Failure> {
        let rank = self.rank;
        let rows = desc.rows(rank);
        let (x, labels) = (desc.x.rows_slice(rows.clone()), desc.labels.rows_slice(rows));
        let key = shape_key(&x, Some(&labels));
        let group = self.group.clone();
        let mut stage = Stage::Passes;
        let run = catch_unwind(AssertUnwindSafe(|| {
            group.iteration(key, || self.collective_step(shared, desc, x, labels, &mut stage))
        }));
        let result = match run {
            Ok(Ok((loss, _))) => return Ok(loss),
            Ok(Err(failure)) => failure,
            Err(panic) => Failure {
                worker: rank,
                layer: outside(shared),
                error: Some(Error::LayerPanicked { message: format!("outside the layers: {}", panic_message(panic)) }),
            },
        };
        let failure = result.of(rank, shared);
        match stage {
            Stage::Agreed => Err(failure),
            Stage::Passes => {
                // Failed before telling the others: tell them, so that every worker
                // abandons the step.
                let report = Report { loss_sum: 0.0, status: 1 + failure.layer as u64 };
                match self.reducer.exchange(report, &mut self.reports) {
                    Ok(()) => Err(first_failure(&self.reports, Some(failure)).expect("this worker's failure")),
                    Err(_) => {
                        self.reducer.abandon();
                        Err(failure)
                    }
                }
            }
            Stage::Collective => {
                self.reducer.abandon();
                Err(failure)
            }
        }
    }

    /// [`Worker::step`]'s work in its plan group's iteration; `stage` follows its
    /// collective calls. A failure or a panic in the middle of them abandons the group
    /// here, while this worker's buckets are still alive: the reducer's `abandon` returns
    /// only once no other worker reads them.
    fn collective_step(
        &mut self,
        shared: &Shared,
        desc: &StepDesc<'_>,
        x: Input<'_>,
        labels: Labels<'_>,
        stage: &mut Stage,
    ) -> std::result::Result<f32, Failure> {
        let rank = self.rank;
        let fail = |error: Error| Failure { worker: rank, layer: outside(shared), error: Some(error) };
        let buckets = Rc::clone(&self.buckets);
        let scope = buckets.enter().map_err(|e| fail(e.into()))?;
        let mut grads = scope.zeros::<f32, _>(shared.layout.total).map_err(|e| fail(e.into()))?;
        let grads = grads.as_slice_mut().expect("a new array is contiguous");
        let outcome = self.shard(shared, x, labels, desc.count, grads, rank);
        let run = catch_unwind(AssertUnwindSafe(|| self.collectives(shared, desc, grads, outcome, stage)));
        let result = match run {
            Ok(result) => result,
            Err(panic) => {
                *stage = Stage::Collective;
                Err(fail(Error::LayerPanicked { message: format!("in the reduction: {}", panic_message(panic)) }))
            }
        };
        if result.is_err() && *stage == Stage::Collective {
            self.reducer.abandon();
        }
        result
    }

    /// The collective calls of a step, after this worker's passes (`outcome`): the
    /// reports exchanged, the buckets reduced, the update checked, the checks exchanged,
    /// the update committed.
    fn collectives(
        &mut self,
        shared: &Shared,
        desc: &StepDesc<'_>,
        grads: &mut [f32],
        outcome: std::result::Result<f64, Failure>,
        stage: &mut Stage,
    ) -> std::result::Result<f32, Failure> {
        let rank = self.rank;
        let fail = |error: Error| Failure { worker: rank, layer: outside(shared), error: Some(error) };
        let report = match &outcome {
            Ok(loss_sum) => Report { loss_sum: *loss_sum, status: 0 },
            Err(f) => Report { loss_sum: 0.0, status: 1 + f.layer as u64 },
        };
        *stage = Stage::Collective;
        self.reducer.exchange(report, &mut self.reports).map_err(fail)?;
        if let Some(failure) = first_failure(&self.reports, outcome.err()) {
            *stage = Stage::Agreed;
            return Err(failure);
        }
        let loss = batch_loss(self.reports.iter().map(|r| r.loss_sum), desc.count);
        let (workers, len, base) = (self.reports.len(), grads.len(), grads.as_mut_ptr());
        self.owned.clear();
        for bucket in &shared.layout.buckets {
            assert!(bucket.end <= len, "a gradient bucket lies within the gradients");
            // SAFETY: `bucket` is within the gradients (asserted); no other reference to
            // them lives from here to the end of the step (`grads` is not used again), and
            // the buckets are disjoint, so this slice is the only one of its values. The
            // other workers read it through the reducer, which the reducer's own
            // contract covers.
            let values = unsafe { std::slice::from_raw_parts_mut(base.add(bucket.start), bucket.len()) };
            let range = self.reducer.reduce(values).map_err(fail)?;
            let expected = match self.shares {
                true => share(bucket.len(), workers, rank),
                false => 0..bucket.len(),
            };
            if range != expected {
                return Err(fail(Error::Reduction {
                    message: format!(
                        "the reducer left the sum of a bucket of {} values in {range:?}; worker {rank} of {workers} \
                         updates {expected:?}",
                        bucket.len()
                    ),
                }));
            }
            if self.shares {
                self.owned.push((rank, bucket.start + range.start..bucket.start + range.end));
            }
        }
        if !self.shares {
            // Every process updates everything; its checks run in the order the threads'
            // would report a failure (by worker share, then bucket).
            self.own_in_rank_order(shared, workers);
        }
        // SAFETY: as above; from here on the gradients are only read.
        let grads = unsafe { std::slice::from_raw_parts(base.cast_const(), len) };
        let checked = self.check_update_caught(shared, grads, desc.t);
        let report = Report { loss_sum: 0.0, status: checked.as_ref().err().map_or(0, |f| 1 + f.layer as u64) };
        self.reducer.exchange(report, &mut self.reports).map_err(fail)?;
        *stage = Stage::Agreed;
        match (self.shares, checked) {
            // Every process checked the same values: its own failure is everyone's.
            (false, Err(failure)) => return Err(failure),
            (_, checked) => {
                if let Some(failure) = first_failure(&self.reports, checked.err()) {
                    return Err(failure);
                }
            }
        }
        self.commit_update(shared, grads, desc.t);
        Ok(loss)
    }

    /// The whole update as `workers` shares of every bucket, by share (worker), then by
    /// bucket: the order failures are reported in.
    fn own_in_rank_order(&mut self, shared: &Shared, workers: usize) {
        self.owned.clear();
        for w in 0..workers {
            for bucket in &shared.layout.buckets {
                let part = share(bucket.len(), workers, w);
                self.owned.push((w, bucket.start + part.start..bucket.start + part.end));
            }
        }
    }

    /// One step of the single-thread shard mode: this worker runs every shard of the
    /// batch in turn, shard 0 into the gradient buckets and each later one into a second
    /// set that is then added to the first, element by element, in shard order (the
    /// arithmetic of a reduction in rank order, so the same bits as `shards` workers);
    /// then the whole update, checked in the order the workers would report failures.
    pub(crate) fn step_sequential(
        &mut self,
        shared: &Shared,
        desc: &StepDesc<'_>,
        partials: &mut [f64],
    ) -> std::result::Result<f32, Failure> {
        let key = shape_key(&desc.x, Some(&desc.labels)) ^ (desc.shards as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let group = self.group.clone();
        let fail = |error: Error| Failure { worker: 0, layer: outside(shared), error: Some(error) };
        let buckets = Rc::clone(&self.buckets);
        let run = catch_unwind(AssertUnwindSafe(|| {
            group.iteration(key, || {
                let scope = buckets.enter().map_err(|e| fail(e.into()))?;
                let mut acc = scope.zeros::<f32, _>(shared.layout.total).map_err(|e| fail(e.into()))?;
                let acc = acc.as_slice_mut().expect("a new array is contiguous");
                let mut next = match desc.shards {
                    1 => None,
                    _ => Some(scope.zeros::<f32, _>(shared.layout.total).map_err(|e| fail(e.into()))?),
                };
                for (s, partial) in partials.iter_mut().enumerate().take(desc.shards) {
                    let rows = desc.rows(s);
                    let (x, labels) = (desc.x.rows_slice(rows.clone()), desc.labels.rows_slice(rows));
                    let target = match (s, next.as_mut()) {
                        (0, _) | (_, None) => &mut *acc,
                        (_, Some(next)) => {
                            next.fill(0.0);
                            next.as_slice_mut().expect("a new array is contiguous")
                        }
                    };
                    *partial = self.shard(shared, x, labels, desc.count, target, s)?;
                    if let (true, Some(next)) = (s > 0, next.as_ref()) {
                        for (a, &g) in acc.iter_mut().zip(next.iter()) {
                            *a += g;
                        }
                    }
                }
                let loss = batch_loss(partials.iter().copied(), desc.count);
                self.own_in_rank_order(shared, desc.shards);
                self.check_update_caught(shared, acc, desc.t)?;
                self.commit_update(shared, acc, desc.t);
                Ok::<f32, Failure>(loss)
            })
        }));
        match run {
            Ok(Ok((loss, _))) => Ok(loss),
            Ok(Err(failure)) => Err(failure.of(0, shared)),
            Err(panic) => Err(Failure {
                worker: 0,
                layer: outside(shared),
                error: Some(Error::LayerPanicked { message: format!("outside the layers: {}", panic_message(panic)) }),
            }),
        }
    }

    /// Stores this worker's ranges of the update, checked by [`Worker::check_update`] and
    /// agreed by every worker.
    fn commit_update(&self, shared: &Shared, grads: &[f32], t: i32) {
        let _span = profile::span(Part::Updater);
        for (_, range) in &self.owned {
            // SAFETY: every worker has finished its forward and backward passes (the
            // step's exchanges wait for all of them; in the single-thread mode there is
            // one worker), so nothing reads the parameters or the state; the workers'
            // ranges are disjoint (each is the share `reduce::share` gives its rank, which
            // the step checked), and nothing else reaches this one until the step ends.
            let (values, m, v) = unsafe {
                let v = (shared.second.len() != 0).then(|| shared.second.range_mut(range.clone()));
                (shared.params.range_mut(range.clone()), shared.first.range_mut(range.clone()), v)
            };
            commit_range(shared.updater, t, values, range.start, &shared.params_layout, &grads[range.clone()], m, v);
        }
    }

    /// [`Worker::check_update`], a panic in it (a layer's `name`) a failure of the
    /// update.
    fn check_update_caught(&self, shared: &Shared, grads: &[f32], t: i32) -> std::result::Result<(), Failure> {
        catch_unwind(AssertUnwindSafe(|| self.check_update(shared, grads, t))).unwrap_or_else(|panic| {
            Err(Failure {
                worker: self.rank,
                layer: outside(shared),
                error: Some(Error::LayerPanicked { message: format!("checking the update: {}", panic_message(panic)) }),
            })
        })
    }

    /// Checks this worker's ranges of the update; the first element that would not be
    /// finite fails it, naming its worker and its layer.
    fn check_update(&self, shared: &Shared, grads: &[f32], t: i32) -> std::result::Result<(), Failure> {
        let _span = profile::span(Part::Updater);
        let working =
            self.train[0].enter(ArrayType::UpdaterWorkingMem).map_err(|e| self.update_failure(shared, e.into()))?;
        for (worker, range) in &self.owned {
            // SAFETY: as for the commit: the passes are over, the ranges disjoint.
            let (values, m, v) = unsafe {
                let v = (shared.second.len() != 0).then(|| &*shared.second.range_mut(range.clone()));
                (shared.params.range_mut(range.clone()), &*shared.first.range_mut(range.clone()), v)
            };
            let found = check_range(shared.updater, t, values, &grads[range.clone()], m, v, &working)
                .map_err(|e| self.update_failure(shared, e))?;
            if let Some((i, what, value)) = found {
                let index = range.start + i;
                let (layer, element) = shared.layout.locate(index);
                let (param, element) = shared.params_layout.param_of(layer, element);
                let name = shared.layers.get(layer).map_or("update", |l| l.name());
                return Err(Failure {
                    worker: *worker,
                    layer,
                    error: Some(finite::error(
                        name,
                        format!(
                            "the updater's {what} of its parameter {param} (element {element}) would be {value} (gradient \
                             {:e})",
                            grads[index]
                        ),
                    )),
                });
            }
        }
        Ok(())
    }

    fn update_failure(&self, shared: &Shared, error: Error) -> Failure {
        Failure { worker: self.rank, layer: outside(shared), error: Some(error) }
    }

    /// Forward and backward over one shard, its parameters' gradients written into
    /// `grads`; returns the shard's loss sum. A panic in a layer is caught and fails the
    /// shard, naming the layer.
    pub(crate) fn shard(
        &mut self,
        shared: &Shared,
        x: Input<'_>,
        labels: Labels<'_>,
        count: usize,
        grads: &mut [f32],
        worker: usize,
    ) -> std::result::Result<f64, Failure> {
        if x.rows() == 0 {
            // A batch of fewer rows than workers: this worker's gradients stay 0.
            return Ok(0.0);
        }
        let mut at = outside(shared);
        let result = catch_unwind(AssertUnwindSafe(|| self.passes(shared, x, labels, count, grads, &mut at)));
        match result {
            Ok(Ok(loss)) => Ok(loss),
            Ok(Err(error)) => Err(Failure { worker, layer: at, error: Some(error) }),
            Err(panic) => {
                Err(Failure { worker, layer: at, error: Some(Error::LayerPanicked { message: panic_message(panic) }) })
            }
        }
    }

    /// [`Worker::shard`]'s passes: the training step's ([`step::passes`]), with the
    /// parameters read from `shared` and their gradients written into `grads`; `at`
    /// follows the layer being run (the number of layers outside them).
    #[allow(clippy::too_many_arguments)]
    fn passes(
        &mut self,
        shared: &Shared,
        x: Input<'_>,
        labels: Labels<'_>,
        count: usize,
        grads: &mut [f32],
        at: &mut usize,
    ) -> Result<f64> {
        // SAFETY: parameters are written only in the update, which no worker starts
        // before every worker has finished these passes (the step's first exchange).
        #[allow(unsafe_code)]
        let params = unsafe { shared.params.read() };
        let Worker { train, tapes, .. } = self;
        let mut layers = StepLayers {
            layers: &shared.layers,
            params: &shared.params_layout,
            values: params,
            grads: Some(grads),
            tapes: Some(tapes),
            streams: None,
        };
        let run = Run { train, labels: None, count };
        step::passes(&mut layers, x, labels, &run, at)
    }
}

/// The batch's mean loss from its shards' loss sums, added in shard (rank) order.
fn batch_loss(sums: impl Iterator<Item = f64>, count: usize) -> f32 {
    let total = sums.fold(0.0f64, |acc, s| acc + s);
    (total / count as f64) as f32
}

/// The failure of the lowest rank that reports one: `local`, when it is this worker's.
fn first_failure(reports: &[Report], local: Option<Failure>) -> Option<Failure> {
    let rank = reports.iter().position(|r| r.status != 0)?;
    match local {
        Some(f) if f.worker == rank => Some(f),
        _ => Some(Failure { worker: rank, layer: (reports[rank].status - 1) as usize, error: None }),
    }
}
