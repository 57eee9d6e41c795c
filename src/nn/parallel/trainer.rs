//! [`DataParallel`]: the trainer, its workers' threads, and what it reports.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use super::super::sync::{panic_message, Gate};
use std::thread::JoinHandle;

use async_iter::{BatchSource, Prefetcher};
use ndarray::{ArrayView1, ArrayView2};
use workspace_core::backend::{ArenaBackend, Block};

use crate::{Error, Result};

use super::super::limits::{check_threads, MAX_RANKS};
use super::super::network::{
    check_input, check_labels, counted, fit_epoch, fit_pairs, FirstLayer, Input, Labels, Network, WorkspaceLayout,
};
use super::super::params::{Layout, Params};
use super::super::profile::{self, StepBreakdown};
use super::super::serve::Model;
use super::super::updater::UpdaterState;
use super::reduce::{Alone, Reducer, Threads};
use super::shared::SharedBuf;
use super::worker::{Failure, Shared, StepDesc, Worker};

/// How the workers reduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReducerKind {
    /// One thread per worker, reducing through shared memory.
    Threads,
    /// One thread that runs the workers' shards in turn and adds their gradients in the
    /// same order: the same bits as [`ReducerKind::Threads`] with as many workers.
    Sequential,
    /// One worker in this process, reducing with the workers of other processes through
    /// a [`Reducer`] given to [`DataParallel::with_reducer`] (MPI: `carve::nn::parallel::Mpi`, the
    /// `mpi` feature).
    Process,
}

impl ReducerKind {
    /// The name the demos' `--reducer` flag and JSON use.
    pub fn name(self) -> &'static str {
        match self {
            ReducerKind::Threads => "threads",
            ReducerKind::Sequential => "sequential",
            ReducerKind::Process => "process",
        }
    }
}

/// A data-parallel trainer's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParallelConfig {
    /// Workers (shards per batch), at least 1.
    pub workers: usize,
    /// How they reduce.
    pub reducer: ReducerKind,
    /// The target size of a gradient bucket in bytes: buckets are cut at layer
    /// boundaries once they hold at least this much (a layer larger than it is a bucket
    /// of its own). Default 4 MiB.
    pub bucket_bytes: usize,
}

impl ParallelConfig {
    /// `workers` threads.
    pub fn threads(workers: usize) -> ParallelConfig {
        ParallelConfig { workers, reducer: ReducerKind::Threads, bucket_bytes: 4 << 20 }
    }

    /// One thread running `workers` shards in turn (the single-thread mode that checks
    /// the threads' determinism).
    pub fn sequential(workers: usize) -> ParallelConfig {
        ParallelConfig { workers, reducer: ReducerKind::Sequential, bucket_bytes: 4 << 20 }
    }
}

/// What a data-parallel trainer holds and did, in bytes where it says so.
#[derive(Clone, Debug, PartialEq)]
pub struct ParallelStats {
    /// Workers (shards per batch).
    pub workers: usize,
    /// The reducer's name ("threads", "sequential").
    pub reducer: &'static str,
    /// The parameters, held once.
    pub weight_bytes: usize,
    /// The updater's state (velocity, or Adam's two moments), held once.
    pub updater_state_bytes: usize,
    /// One worker's gradient buckets (every parameter's gradient, in backward order),
    /// part of its plan.
    pub gradient_bucket_bytes: usize,
    /// Buckets per worker.
    pub buckets: usize,
    /// Each worker's plan for its largest shape, gradient buckets included.
    pub worker_plan_bytes: Vec<usize>,
    /// Each worker's arena capacity.
    pub worker_arena_bytes: Vec<usize>,
    /// Bytes copied out of the gradient buckets before they were reduced, counted by the
    /// reducers (0: backward writes where the reduction reads).
    pub bytes_copied_for_reduction: u64,
    /// Training steps done.
    pub steps: u64,
}

impl ParallelStats {
    /// The memory the trainer holds: the weights and the updater's state once, and each
    /// worker's arena.
    pub fn total_bytes(&self) -> usize {
        self.weight_bytes + self.updater_state_bytes + self.worker_arena_bytes.iter().sum::<usize>()
    }

    /// What a trainer that copies the model into every worker (DL4J's
    /// `ParallelWrapper`) holds for the same model: per worker the weights, the updater's
    /// state, the gradients and the worker's workspaces (taken to be this trainer's plan
    /// without its buckets).
    pub fn replicated_bytes(&self) -> usize {
        let per_worker = self.weight_bytes + self.updater_state_bytes + self.gradient_bucket_bytes;
        let workspaces: usize =
            self.worker_arena_bytes.iter().map(|&a| a.saturating_sub(self.gradient_bucket_bytes)).sum();
        self.workers * per_worker + workspaces
    }
}

/// What the threads of a trainer share to run steps.
struct Control {
    /// Where the threads wait for a step; broken to stop them.
    start: Gate,
    /// Where a step ends. Never broken: the coordinator passes it only once every thread
    /// has finished reading the step's batch (every thread reaches it: a step's failures
    /// and panics are caught).
    end: Gate,
    stop: AtomicBool,
    /// The step the workers run, set before `start` and cleared after `end`.
    desc: Mutex<Option<StepDesc<'static>>>,
    /// A failing worker's error, for the coordinator to report.
    errors: Box<[Mutex<Option<Error>>]>,
    plan_bytes: Box<[AtomicUsize]>,
    arena_bytes: Box<[AtomicUsize]>,
}

/// A data-parallel trainer (DL4J's `ParallelWrapper`): `workers` shards per batch, run
/// by that many threads that share one copy of the weights and of the updater's state.
///
/// ```
/// use carve::nn::{parallel::DataParallel, Network, NetworkConfig, parallel::ParallelConfig};
/// use carve::ndarray::{Array1, Array2};
///
/// let x = Array2::from_shape_fn((64, 4), |(r, c)| ((r * 7 + c * 3) % 11) as f32 / 11.0);
/// let y = Array1::from_shape_fn(64, |r| (r % 3) as u32);
/// let config = || NetworkConfig::builder(4).dense(16).relu().dense(3).seed(7).build();
///
/// let mut threads = DataParallel::new(Network::new(config()?)?, ParallelConfig::threads(2))?;
/// let mut one_thread = DataParallel::new(Network::new(config()?)?, ParallelConfig::sequential(2))?;
/// for _ in 0..5 {
///     // Two threads, and one thread running the same two shards: the same bits.
///     assert_eq!(threads.fit_batch(x.view(), y.view())?.to_bits(), one_thread.fit_batch(x.view(), y.view())?.to_bits());
/// }
/// assert_eq!(threads.stats().bytes_copied_for_reduction, 0);
/// let network = threads.into_network()?; // evaluate, save or freeze it
/// assert_eq!(network.iterations(), 5);
/// # Ok::<(), carve::Error>(())
/// ```
///
/// The trainer belongs to the thread that made it (worker 0 runs there, on that
/// thread's workspaces).
pub struct DataParallel {
    shared: Arc<Shared>,
    me: Worker,
    config: ParallelConfig,
    control: Option<Arc<Control>>,
    threads: Vec<JoinHandle<()>>,
    /// Shard loss sums of the single-thread mode.
    partials: Vec<f64>,
    inputs: usize,
    step: u64,
    iterations: u64,
    modes: WorkspaceLayout,
    copied: u64,
    /// The reducer's name.
    name: &'static str,
    /// Where the steps' time goes on the calling thread, when measured.
    breakdown: Option<StepBreakdown>,
    /// A trainer stays on its thread (its worker 0's workspaces do).
    _thread_bound: std::marker::PhantomData<*const ()>,
}

impl std::fmt::Debug for DataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataParallel").field("config", &self.config).field("steps", &self.step).finish()
    }
}

impl DataParallel {
    /// A trainer of `network` (its layers, weights, updater state and iteration count;
    /// its workspaces are dropped): the weights and state moved into the trainer's shared
    /// buffers, and `config.workers - 1` threads started (none for the single-thread
    /// mode), each with its own planned workspaces.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for 0 workers or more than [`MAX_THREADS`](crate::nn::limits::MAX_THREADS),
    /// for [`ReducerKind::Process`] (a process per worker: use `DataParallel::with_reducer`),
    /// and for a network that trains on a device; workspace errors of a worker's
    /// planned arena; an error starting a thread.
    pub fn new(network: Network, config: ParallelConfig) -> Result<DataParallel> {
        check_threads("a data-parallel trainer's workers", config.workers)?;
        if config.reducer == ReducerKind::Process {
            return Err(Error::InvalidConfig {
                reason: "a trainer of one worker per process is made by DataParallel::with_reducer, with the \
                         processes' reducer"
                    .into(),
            });
        }
        let threads = config.reducer == ReducerKind::Threads && config.workers > 1;
        let reducers: Vec<Box<dyn Reducer>> = match threads {
            true => Threads::group(config.workers).into_iter().map(|r| Box::new(r) as Box<dyn Reducer>).collect(),
            false => vec![Box::new(Alone)],
        };
        DataParallel::build(network, config, reducers, threads)
    }

    /// A trainer of one worker in this process that reduces with the workers of other
    /// processes through `reducer` (MPI: `carve::nn::parallel::Mpi`, the `mpi` feature), each process holding
    /// its own copy of the weights and the updater's state. Every process runs the same
    /// steps on the same batches; worker `r` (this process, `reducer.rank()`) trains on
    /// the `r`-th of `reducer.workers()` shards of each, and updates every parameter from
    /// the reduced gradients, so that the copies stay equal bit for bit.
    ///
    /// # Errors
    ///
    /// As [`DataParallel::new`]; [`Error::InvalidConfig`] for a reducer of more than
    /// [`MAX_RANKS`] workers; the reducer's errors at each step
    /// ([`Error::Reduction`]).
    pub fn with_reducer(network: Network, reducer: Box<dyn Reducer>, bucket_bytes: usize) -> Result<DataParallel> {
        let workers = reducer.workers();
        if workers == 0 || reducer.rank() >= workers {
            return Err(Error::InvalidConfig {
                reason: format!("a reducer of rank {} among {workers} workers", reducer.rank()),
            });
        }
        if workers > MAX_RANKS {
            return Err(Error::InvalidConfig {
                reason: format!(
                    "a reducer of {workers} workers, more than the {MAX_RANKS} a trainer keeps reports for \
                     (carve::nn::limits::MAX_RANKS)"
                ),
            });
        }
        let config = ParallelConfig { workers, reducer: ReducerKind::Process, bucket_bytes };
        DataParallel::build(network, config, vec![reducer], false)
    }

    /// The trainer of `network` with `reducers`, one per worker of this process (rank 0
    /// first); `threads`: they are threads that share the parameters.
    fn build(
        network: Network,
        config: ParallelConfig,
        mut reducers: Vec<Box<dyn Reducer>>,
        threads: bool,
    ) -> Result<DataParallel> {
        if network.device() != crate::nn::Device::Host {
            return Err(Error::InvalidConfig {
                reason: format!(
                    "data-parallel training runs its workers on the host, but this network trains on {}: build it \
                     with Device::Host (the default) to train it data-parallel",
                    network.device()
                ),
            });
        }
        let (inputs, layers, params_layout, params, updater, iterations, modes) = network.into_parts();
        let (shared, step) = share(layers, params_layout, params, updater, config.bucket_bytes);
        let shared = Arc::new(shared);
        let (name, first_rank) = (reducers[0].name(), reducers[0].rank());
        let others = reducers.split_off(1);
        let reducer = reducers.pop().expect("rank 0's reducer");
        let me = match catch_unwind(AssertUnwindSafe(|| Worker::new(&shared, reducer, threads, config.workers))) {
            Ok(made) => made?,
            Err(panic) => {
                let message = format!("making the worker: {}", panic_message(panic));
                let source = Box::new(Error::LayerPanicked { message });
                return Err(Error::Worker { worker: first_rank, layer: "start".into(), source });
            }
        };
        let mut trainer = DataParallel {
            shared,
            me,
            config,
            control: None,
            threads: Vec::new(),
            partials: vec![0.0; config.workers],
            inputs,
            step,
            iterations,
            modes,
            copied: 0,
            name,
            breakdown: None,
            _thread_bound: std::marker::PhantomData,
        };
        if threads {
            trainer.start_threads(others)?;
        }
        Ok(trainer)
    }

    /// Starts a thread per reducer (ranks 1 and up), each making its worker on itself.
    /// Every thread started waits at the start gate, its worker made or not, so that
    /// stopping them never waits for one that is missing.
    fn start_threads(&mut self, reducers: Vec<Box<dyn Reducer>>) -> Result<()> {
        let workers = self.config.workers;
        let counters = || (0..workers).map(|_| AtomicUsize::new(0)).collect::<Box<[_]>>();
        let control = Arc::new(Control {
            start: Gate::new(workers),
            end: Gate::new(workers),
            stop: AtomicBool::new(false),
            desc: Mutex::new(None),
            errors: (0..workers).map(|_| Mutex::new(None)).collect(),
            plan_bytes: counters(),
            arena_bytes: counters(),
        });
        self.control = Some(Arc::clone(&control));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<(usize, Result<()>)>();
        let mut started = 0;
        let mut failed = None;
        for reducer in reducers {
            let rank = reducer.rank();
            let (shared, ready) = (Arc::clone(&self.shared), ready_tx.clone());
            let thread_control = Arc::clone(&control);
            let spawned = std::thread::Builder::new().name(format!("carve-worker-{rank}")).spawn(move || {
                let made = catch_unwind(AssertUnwindSafe(|| Worker::new(&shared, reducer, true, 1)));
                let mut worker = match made {
                    Ok(Ok(worker)) => {
                        let _ = ready.send((rank, Ok(())));
                        Some(worker)
                    }
                    Ok(Err(e)) => {
                        let _ = ready.send((rank, Err(e)));
                        None
                    }
                    Err(panic) => {
                        let message = format!("making the worker: {}", panic_message(panic));
                        let _ = ready.send((rank, Err(Error::LayerPanicked { message })));
                        None
                    }
                };
                drop(ready);
                run_worker(worker.as_mut(), &shared, &thread_control, rank);
            });
            match spawned {
                Ok(handle) => {
                    self.threads.push(handle);
                    started += 1;
                }
                Err(e) => {
                    let error = Error::InvalidConfig { reason: format!("starting data-parallel worker {rank}: {e}") };
                    failed = Some((rank, error));
                    break;
                }
            }
        }
        drop(ready_tx);
        for _ in 0..started {
            match ready_rx.recv() {
                Ok((_, Ok(()))) => {}
                Ok((rank, Err(e))) => {
                    if failed.as_ref().is_none_or(|(r, _)| rank < *r) {
                        failed = Some((rank, e));
                    }
                }
                Err(_) => break,
            }
        }
        if let Some((rank, error)) = failed {
            self.stop_threads();
            return Err(Error::Worker { worker: rank, layer: "start".into(), source: Box::new(error) });
        }
        Ok(())
    }

    /// Stops the threads: they leave the start gate, broken, and end.
    fn stop_threads(&mut self) {
        if let Some(control) = self.control.take() {
            control.stop.store(true, Ordering::Release);
            control.start.break_all();
        }
        for handle in self.threads.drain(..) {
            let _ = handle.join();
        }
    }

    /// One training step on a batch: each worker's shard forward and backward, the
    /// gradients reduced, one update. Returns the batch's mean loss.
    ///
    /// A steady step makes no heap allocation in any worker.
    ///
    /// # Errors
    ///
    /// The batch's shape and label errors, as [`Network::fit_batch`]'s;
    /// [`Error::Worker`] when a worker fails (a value that is not finite, a layer that
    /// panics or errs), naming the worker (its shard) and the layer, with the worker's
    /// error as its source. After an error the weights and the updater's state are as
    /// they were before the call, and the trainer is usable; except when a worker had to
    /// abandon the reduction (a panic outside its layers, in the middle of the step's
    /// collective calls): that step still changed nothing, but every later step fails
    /// with [`Error::Reduction`] (with threads, `into_network` gives the weights back;
    /// under MPI the peers wait in the abandoned step, so dropping the trainer or its
    /// `into_network` ends the job with `MPI_Abort`: save the weights first, from
    /// [`DataParallel::freeze`]). Under MPI, a peer that does not answer within the
    /// reducer's timeout ends the job instead (see `carve::nn::parallel::Mpi`).
    pub fn fit_batch<'x, 'l>(&mut self, x: impl Into<Input<'x>>, labels: impl Into<Labels<'l>>) -> Result<f32> {
        let measured = profile::start(self.breakdown.is_some());
        let loss = self.fit_batch_unmeasured(x.into(), labels.into())?;
        if let Some(breakdown) = self.breakdown.as_mut() {
            measured.finish(breakdown);
        }
        Ok(loss)
    }

    /// Switches the breakdown of each step's time on (from zero) or off, as
    /// [`Network::set_breakdown`] does: the parts of the step on the calling thread
    /// (worker 0's passes on its shard, its share of the update); the time it waits for
    /// the other workers and the reduction count as bookkeeping.
    ///
    /// ```
    /// use carve::nn::{parallel::DataParallel, Network, NetworkConfig, parallel::ParallelConfig};
    /// use carve::ndarray::{Array1, Array2};
    ///
    /// let net = Network::new(NetworkConfig::builder(8).dense(16).relu().dense(3).build()?)?;
    /// let mut trainer = DataParallel::new(net, ParallelConfig::threads(2))?;
    /// trainer.set_breakdown(true);
    /// let (x, y) = (Array2::<f32>::ones((8, 8)), Array1::<u32>::zeros(8));
    /// for _ in 0..3 {
    ///     trainer.fit_batch(x.view(), y.view())?;
    /// }
    /// let breakdown = trainer.breakdown().expect("switched on");
    /// assert_eq!(breakdown.steps, 3);
    /// assert!(breakdown.matmul_ns > 0 && breakdown.loss_ns > 0 && breakdown.updater_ns > 0);
    /// # Ok::<(), carve::Error>(())
    /// ```
    pub fn set_breakdown(&mut self, on: bool) {
        self.breakdown = on.then(StepBreakdown::default);
    }

    /// Where the steps' time went since [`DataParallel::set_breakdown`] (`None` when
    /// off), over the steps that succeeded.
    pub fn breakdown(&self) -> Option<StepBreakdown> {
        self.breakdown
    }

    /// [`DataParallel::fit_batch`] without its breakdown.
    fn fit_batch_unmeasured(&mut self, x: Input<'_>, labels: Labels<'_>) -> Result<f32> {
        let x = x.reborrow();
        let labels = labels.reborrow().or_mask(x.mask());
        check_input(self.inputs, FirstLayer::of(&self.shared.layers), &x)?;
        check_labels(&x, &labels)?;
        let count = counted(&labels);
        if count == 0 {
            return Err(Error::InvalidInput("the labels mask selects no label: there is nothing to learn from".into()));
        }
        let t = i32::try_from(self.step + 1).unwrap_or(i32::MAX);
        let desc = StepDesc { x, labels, count, shards: self.config.workers, t };
        let result = match (&self.control, self.config.reducer) {
            (Some(control), _) => {
                let control = Arc::clone(control);
                run_coordinated(&mut self.me, &self.shared, &control, desc)
            }
            (None, ReducerKind::Sequential) => self.me.step_sequential(&self.shared, &desc, &mut self.partials),
            (None, _) => self.me.step(&self.shared, &desc),
        };
        match result {
            Ok(loss) => {
                self.step += 1;
                self.iterations += 1;
                self.copied = self.copied.max(self.me.reducer.bytes_copied());
                Ok(loss)
            }
            Err(failure) => Err(self.error(failure)),
        }
    }

    /// The error of a failed step: the failing worker's own, or a description. When a
    /// worker abandoned the reduction, the others fail with [`Error::Reduction`]; the
    /// abandoning worker's own error is reported.
    fn error(&self, failure: Failure) -> Error {
        let Failure { mut worker, mut layer, mut error } = failure;
        let mut stored: Vec<(usize, Error)> = Vec::new();
        if let Some(control) = &self.control {
            for (w, slot) in control.errors.iter().enumerate() {
                if let Some(e) = slot.lock().unwrap_or_else(PoisonError::into_inner).take() {
                    stored.push((w, e));
                }
            }
        }
        if matches!(error, Some(Error::Reduction { .. }) | None) {
            let cause = stored.iter().position(|(_, e)| !matches!(e, Error::Reduction { .. }));
            let pick = match error {
                None => stored.iter().position(|(w, _)| *w == worker),
                Some(_) => cause,
            };
            if let Some(i) = pick {
                let (w, e) = stored.swap_remove(i);
                if w != worker {
                    layer = self.shared.layers.len();
                }
                worker = w;
                error = Some(e);
            }
        }
        let source = error.unwrap_or_else(|| {
            Error::InvalidInput(format!("worker {worker} failed; its own error is in its process's output"))
        });
        let layer = self.shared.layers.get(layer).map_or("input, loss or update", |l| l.name()).to_string();
        Error::Worker { worker, layer, source: Box::new(source) }
    }

    /// Trains one epoch on a prefetcher's batches (as [`Network::fit`]), each cut into
    /// shards that are views of the prefetch ring. Returns the mean batch loss.
    ///
    /// # Errors
    ///
    /// As [`Network::fit`] and [`DataParallel::fit_batch`].
    pub fn fit<S, B>(&mut self, batches: &mut Prefetcher<S, B>) -> Result<f32>
    where
        S: BatchSource,
        B: ArenaBackend + 'static,
        B::Block: Block<Base = NonNull<u8>>,
    {
        fit_epoch(batches, |x, y| self.fit_batch(x, y))
    }

    /// Trains on every `(features, labels)` pair once; returns the mean batch loss.
    ///
    /// # Errors
    ///
    /// As [`DataParallel::fit_batch`]; an empty iterator is [`Error::InvalidInput`].
    pub fn fit_iter<'d, I>(&mut self, batches: I) -> Result<f32>
    where
        I: IntoIterator<Item = (ArrayView2<'d, f32>, ArrayView1<'d, u32>)>,
    {
        fit_pairs(batches, |x, y| self.fit_batch(x, y))
    }

    /// Workers (shards per batch).
    pub fn workers(&self) -> usize {
        self.config.workers
    }

    /// The settings.
    pub fn config(&self) -> ParallelConfig {
        self.config
    }

    /// Training iterations of the network, this trainer's steps included.
    pub fn iterations(&self) -> u64 {
        self.iterations
    }

    /// What the trainer holds and did.
    pub fn stats(&self) -> ParallelStats {
        let (plan, arena) = self.me.plan_bytes();
        let (mut plans, mut arenas) = (vec![plan], vec![arena]);
        if let Some(control) = &self.control {
            for w in 1..self.config.workers {
                plans.push(control.plan_bytes[w].load(Ordering::Acquire));
                arenas.push(control.arena_bytes[w].load(Ordering::Acquire));
            }
        }
        let bytes = |n: usize| n * size_of::<f32>();
        ParallelStats {
            workers: self.config.workers,
            reducer: match self.config.reducer {
                ReducerKind::Process => self.name,
                kind => kind.name(),
            },
            weight_bytes: bytes(self.shared.params.len()),
            updater_state_bytes: bytes(self.shared.first.len() + self.shared.second.len()),
            gradient_bucket_bytes: bytes(self.shared.layout.total),
            buckets: self.shared.layout.buckets.len(),
            worker_plan_bytes: plans,
            worker_arena_bytes: arenas,
            bytes_copied_for_reduction: self.copied,
            steps: self.step,
        }
    }

    /// The parameters, in the trainer's layout (the last layer's first).
    fn params(&mut self) -> &mut [f32] {
        let shared = Arc::get_mut(&mut self.shared);
        shared.expect("the workers have stopped").params.get_mut()
    }

    /// The trained model for serving: the layers, shared, and a copy of the weights.
    ///
    /// # Errors
    ///
    /// As [`Network::freeze`].
    pub fn freeze(&self) -> Result<Model> {
        // SAFETY: no step runs (this takes `&self`, and a step `&mut self`), so nothing
        // writes the parameters.
        let params = unsafe { self.shared.params.read() };
        let shared = &self.shared;
        Model::from_parts(
            self.inputs,
            Arc::clone(&shared.layers),
            Arc::clone(&shared.params_layout),
            Arc::new(params.to_vec()),
        )
    }

    /// The network again, trained: the trainer's weights and updater state moved back
    /// into it, new workspaces of its modes. The worker threads stop.
    ///
    /// # Errors
    ///
    /// Allocation and workspace errors of the new network.
    pub fn into_network(mut self) -> Result<Network> {
        self.stop_threads();
        let _ = self.params();
        let shared = Arc::try_unwrap(std::mem::replace(&mut self.shared, Arc::new(Shared::empty())))
            .unwrap_or_else(|_| unreachable!("the workers have stopped"));
        let Shared { layers, params_layout, params, first, second, updater, .. } = shared;
        let updater = UpdaterState::from_parts(updater, self.step, first.into_vec(), second.into_vec());
        let params = Arc::new(params.into_vec());
        Network::from_parts(self.inputs, layers, params_layout, params, updater, self.iterations, self.modes)
    }
}

impl Drop for DataParallel {
    fn drop(&mut self) {
        self.stop_threads();
    }
}

/// The network's layers, parameters and updater state as the workers share them (the
/// network's flat buffers, in the layout the trainer reduces, moved; the parameters
/// copied only when a model still holds them), with gradient buckets of `bucket_bytes`;
/// and the updater's step count.
fn share(
    layers: Arc<[Box<dyn crate::nn::Layer>]>,
    params_layout: Arc<Params>,
    params: Arc<Vec<f32>>,
    updater: UpdaterState,
    bucket_bytes: usize,
) -> (Shared, u64) {
    let layout = Layout::new(&params_layout.layout.counts(), (bucket_bytes / size_of::<f32>()).max(1));
    let kind = updater.updater();
    let (step, first, second) = updater.into_parts();
    let values = Arc::try_unwrap(params).unwrap_or_else(|shared| (*shared).clone());
    let shared = Shared {
        layers,
        params_layout,
        layout,
        params: SharedBuf::new(values),
        first: SharedBuf::new(first),
        second: SharedBuf::new(second),
        updater: kind,
    };
    (shared, step)
}

/// A step run by every thread: the coordinator (worker 0, on the caller's thread) and
/// the others, between the start gate and the end gate.
fn run_coordinated(
    me: &mut Worker,
    shared: &Shared,
    control: &Control,
    desc: StepDesc<'_>,
) -> std::result::Result<f32, Failure> {
    // SAFETY: the workers read the batch only between the start gate and the end gate,
    // and this function passes both before it returns (the step's panics are caught
    // below, and the end gate is never broken); the description is cleared before the
    // batch's borrow ends.
    let desc_static = unsafe { std::mem::transmute::<StepDesc<'_>, StepDesc<'static>>(desc) };
    *control.desc.lock().unwrap_or_else(PoisonError::into_inner) = Some(desc_static);
    let started = control.start.wait();
    let result = match started {
        true => catch_unwind(AssertUnwindSafe(|| me.step(shared, &desc))).unwrap_or_else(|panic| {
            // Outside every collective call's own catch: the others must not wait for
            // this worker.
            me.reducer.abandon();
            Err(Failure {
                worker: 0,
                layer: shared.layers.len(),
                error: Some(Error::LayerPanicked {
                    message: format!("data-parallel worker 0 outside its layers: {}", panic_message(panic)),
                }),
            })
        }),
        false => Err(Failure {
            worker: 0,
            layer: shared.layers.len(),
            error: Some(Error::InvalidInput("the data-parallel trainer's worker threads have stopped".into())),
        }),
    };
    if started {
        control.end.wait();
    }
    *control.desc.lock().unwrap_or_else(PoisonError::into_inner) = None;
    result
}

/// A worker thread's loop: a step each time the coordinator starts one, until stopped.
/// Every step's failures and panics are caught, so the thread always reaches the end
/// barrier.
fn run_worker(mut worker: Option<&mut Worker>, shared: &Shared, control: &Control, rank: usize) {
    loop {
        if !control.start.wait() || control.stop.load(Ordering::Acquire) {
            return;
        }
        let desc = *control.desc.lock().unwrap_or_else(PoisonError::into_inner);
        if let (Some(desc), Some(worker)) = (desc, worker.as_deref_mut()) {
            let result = catch_unwind(AssertUnwindSafe(|| {
                let result = worker.step(shared, &desc);
                (result, worker.plan_bytes())
            }));
            let error = match result {
                Ok((result, (plan, arena))) => {
                    control.plan_bytes[rank].store(plan, Ordering::Release);
                    control.arena_bytes[rank].store(arena, Ordering::Release);
                    match result {
                        Err(Failure { worker: w, error, .. }) if w == rank => error,
                        _ => None,
                    }
                }
                Err(panic) => {
                    // Outside every collective call's own catch: the others must not wait
                    // for this worker.
                    worker.reducer.abandon();
                    Some(Error::LayerPanicked {
                        message: format!("data-parallel worker {rank} outside its layers: {}", panic_message(panic)),
                    })
                }
            };
            if error.is_some() {
                *control.errors[rank].lock().unwrap_or_else(PoisonError::into_inner) = error;
            }
        }
        control.end.wait();
    }
}
