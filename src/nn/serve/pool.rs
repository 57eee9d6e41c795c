//! The inference pool: K arenas serving one model to any number of threads, directly or
//! in coalesced batches.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use ndarray::{Array2, ArrayView2, ArrayViewMut2};

use super::arenas::{warms_up_while_holding, ArenaGuard, Arenas, StreamArena, Wait};
use super::batcher::{BatchBuffers, Batcher};
use super::config::{PoolConfig, PoolMode};
use super::model::{Model, SERVING_PLANS};
use crate::nn::infer::{copy_into, Infer};
use crate::nn::limits::{check_threads, config_filled, reserve_filled};
use crate::nn::network::Input;
use crate::nn::sync::Latch;
use crate::{Error, Result};

/// What an [`InferencePool`] has done (counts since it was made).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PoolStats {
    /// Arenas (K).
    pub workers: usize,
    /// `"direct"` or `"batched"`.
    pub mode: &'static str,
    /// Arenas leased: one per direct request or lease; batched, one per batch, and one
    /// per lease a worker took for requests that another worker's batch had taken
    /// meanwhile (every idle worker wakes for a request, and leases before it takes rows,
    /// so that no request's rows wait on an arena).
    pub leases: u64,
    /// Leases that found every arena in use and waited.
    pub waited: u64,
    /// Requests refused by a `try_` form.
    pub busy: u64,
    /// Requests that timed out.
    pub timeouts: u64,
    /// Requests in which a layer panicked.
    pub panics: u64,
    /// Arenas replaced because a request kept a reference to one.
    pub rebuilt_arenas: u64,
    /// Inferences that replayed their shape's plan, and those that did not (a
    /// recording, the first of a shape in an arena, or a divergence).
    pub on_plan: u64,
    /// See `on_plan`.
    pub off_plan: u64,
    /// Batched: inferences run, and the requests' rows they ran.
    pub batches: u64,
    /// See `batches`.
    pub batched_rows: u64,
    /// The arenas' bytes (K × the plan of the largest shape served, once every arena
    /// has served it).
    pub arena_bytes: usize,
    /// The arenas' generation buffers (each arena's streams' key/value caches, windows
    /// and logits, kept for its next streams: K × those of the most streams an arena
    /// ran at once).
    pub stream_bytes: usize,
    /// The model's parameter bytes, held once whatever K and the number of callers.
    pub weight_bytes: usize,
}

impl PoolStats {
    /// The statistics as one JSON object.
    pub fn to_json(&self) -> String {
        format!(
            "{{\"workers\":{},\"mode\":\"{}\",\"leases\":{},\"waited\":{},\"busy\":{},\"timeouts\":{},\"panics\":{},\
             \"rebuilt_arenas\":{},\"on_plan\":{},\"off_plan\":{},\"batches\":{},\"batched_rows\":{},\
             \"arena_bytes\":{},\"stream_bytes\":{},\"weight_bytes\":{}}}",
            self.workers,
            self.mode,
            self.leases,
            self.waited,
            self.busy,
            self.timeouts,
            self.panics,
            self.rebuilt_arenas,
            self.on_plan,
            self.off_plan,
            self.batches,
            self.batched_rows,
            self.arena_bytes,
            self.stream_bytes,
            self.weight_bytes
        )
    }
}

/// What the pool's callers and worker threads share.
#[derive(Debug)]
struct Shared {
    model: Arc<Model>,
    arenas: Arenas,
    config: PoolConfig,
    batcher: Option<Batcher>,
    /// One warm-up at a time: each holds every arena.
    warming: Mutex<()>,
}

impl Shared {
    /// Starts a batch worker thread per buffer (one per arena; none for a direct pool).
    /// If a thread cannot start, those started are stopped and joined before the error
    /// returns.
    fn start_workers(self: &Arc<Shared>, buffers: Vec<BatchBuffers>) -> Result<Vec<JoinHandle<()>>> {
        let mut threads = Vec::with_capacity(buffers.len());
        // Each worker says when it runs: `new` returns a pool whose workers have started
        // (a thread's start-up is not the first request's work).
        let started = Arc::new(Latch::new());
        for (i, buffers) in buffers.into_iter().enumerate() {
            let worker = Arc::clone(self);
            let started = Arc::clone(&started);
            let spawned = std::thread::Builder::new().name(format!("carve-batcher-{i}")).spawn(move || {
                started.arrive();
                drop(started);
                let batcher = worker.batcher.as_ref().expect("a batched pool");
                batcher.serve(buffers, &worker.arenas, &worker.model);
            });
            match spawned {
                Ok(thread) => threads.push(thread),
                Err(e) => {
                    if let Some(batcher) = &self.batcher {
                        batcher.close();
                    }
                    for thread in threads {
                        let _ = thread.join();
                    }
                    return Err(Error::InvalidConfig { reason: format!("cannot start a batch worker thread: {e}") });
                }
            }
        }
        started.wait_for(threads.len());
        Ok(threads)
    }
}

/// Runs the request `x` of `model` in `arena`: checked, then inferred, its
/// probabilities handed to `f`.
fn infer_in_arena<R>(
    arena: &mut ArenaGuard<'_>,
    model: &Model,
    x: Input<'_>,
    f: impl FnOnce(ArrayView2<'_, f32>) -> Result<R>,
) -> Result<R> {
    model.check_request(&x)?;
    infer_checked(arena, model, x, f)
}

/// [`infer_in_arena`] of a request its caller has checked ([`Model::check_request`]).
fn infer_checked<R>(
    arena: &mut ArenaGuard<'_>,
    model: &Model,
    x: Input<'_>,
    f: impl FnOnce(ArrayView2<'_, f32>) -> Result<R>,
) -> Result<R> {
    arena.run(|mgr| model.infer_in(mgr, x, f))
}

/// K planned arenas serving one [`Model`] to any number of threads (DL4J's
/// `ParallelInference`, with the weights held once): memory is the weights plus K ×
/// the plan of the largest request shape, whatever the number of callers.
///
/// Every method takes `&self`: share the pool by reference (scoped threads) or in an
/// [`Arc`]. When all K arenas are busy a caller waits; [`InferencePool::try_output`]
/// refuses instead ([`Error::PoolBusy`]) and [`InferencePool::output_timeout`] waits
/// at most a while ([`Error::Timeout`]). [`InferencePool::close`] (or dropping the
/// pool) fails every waiting request with [`Error::PoolClosed`].
///
/// ```
/// use std::sync::{Arc, Mutex, PoisonError};
/// use carve::nn::{serve::InferencePool, Network, NetworkConfig, serve::PoolConfig};
/// use carve::ndarray::Array2;
///
/// let net = Network::new(NetworkConfig::builder(4).dense(8).relu().dense(3).build()?)?;
/// let pool = InferencePool::new(Arc::new(net.freeze()?), PoolConfig::direct(2))?;
/// let x = Array2::<f32>::ones((5, 4));
/// let mut out = Array2::<f32>::zeros((5, 3));
/// std::thread::scope(|s| {
///     for _ in 0..8 {
///         s.spawn(|| pool.output(x.view()).unwrap());
///     }
/// });
/// pool.output_into(x.view(), out.view_mut())?; // no heap allocation once planned
/// assert_eq!(out, pool.output(x.view())?);
/// # Ok::<(), carve::Error>(())
/// ```
#[derive(Debug)]
pub struct InferencePool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl InferencePool {
    /// A pool of `config.workers` arenas serving `model` (batched: and as many worker
    /// threads, started here).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for 0 workers or more than [`MAX_THREADS`](crate::nn::limits::MAX_THREADS);
    /// batched: a `max_batch` of 0, or batch buffers (K × `max_batch` rows of the
    /// model's inputs) that the machine cannot allocate, naming their size.
    pub fn new(model: Arc<Model>, config: PoolConfig) -> Result<InferencePool> {
        let batched = config.mode == PoolMode::Batched;
        check_threads("an inference pool's workers (arenas)", config.workers)?;
        if batched && config.max_batch == 0 {
            return Err(Error::InvalidConfig { reason: "a batched pool needs max_batch of at least 1 row".into() });
        }
        if batched && config.max_queued_rows == 0 {
            return Err(Error::InvalidConfig {
                reason: "a batched pool needs max_queued_rows of at least 1 row (try_output refuses past it)".into(),
            });
        }
        // Everything a batch worker needs is reserved here, on the caller's thread: a
        // size the machine cannot give is an error now, not an abort in a worker.
        let buffers = match batched {
            true => (0..config.workers).map(|_| BatchBuffers::new(&config, model.inputs())).collect::<Result<_>>()?,
            false => Vec::new(),
        };
        let plans = SERVING_PLANS.max(if batched { config.max_batch.saturating_add(1) } else { 0 });
        let arenas = Arenas::new(config.workers, plans, config.arena_stacks)?;
        let batcher = batched.then(|| Batcher::new(&config, model.inputs(), model.classes()));
        let shared = Arc::new(Shared { model, arenas, config, batcher, warming: Mutex::new(()) });
        let threads = shared.start_workers(buffers)?;
        Ok(InferencePool { shared, threads })
    }

    /// The model served.
    pub fn model(&self) -> &Arc<Model> {
        &self.shared.model
    }

    /// The settings.
    pub fn config(&self) -> &PoolConfig {
        &self.shared.config
    }

    /// Leases an arena for requests of the caller's own (whatever the mode), waiting
    /// while all are busy. The lease borrows the pool, and what it computes borrows the
    /// lease:
    ///
    /// ```compile_fail,E0597
    /// # use std::sync::{Arc, Mutex, PoisonError};
    /// # use carve::nn::{serve::InferencePool, Network, NetworkConfig, serve::PoolConfig};
    /// # let net = Network::new(NetworkConfig::builder(4).dense(3).build().unwrap()).unwrap();
    /// # let model = Arc::new(net.freeze().unwrap());
    /// let lease = {
    ///     let pool = InferencePool::new(model, PoolConfig::direct(1)).unwrap();
    ///     pool.lease().unwrap()
    /// }; // the pool is gone here, so the lease may not outlive it
    /// # drop(lease);
    /// ```
    ///
    /// ```compile_fail
    /// # use std::sync::{Arc, Mutex, PoisonError};
    /// # use carve::nn::{serve::InferencePool, Network, NetworkConfig, serve::PoolConfig};
    /// # use carve::ndarray::Array2;
    /// # let net = Network::new(NetworkConfig::builder(4).dense(3).build().unwrap()).unwrap();
    /// # let pool = InferencePool::new(Arc::new(net.freeze().unwrap()), PoolConfig::direct(1)).unwrap();
    /// # let x = Array2::<f32>::ones((2, 4));
    /// let mut lease = pool.lease().unwrap();
    /// // The probabilities live in the arena only while the request runs.
    /// let kept = lease.infer(x.view(), |probs| Ok(probs)).unwrap();
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::PoolClosed`] once the pool is closed; [`Error::InvalidInput`] when the
    /// calling thread already holds every arena (leases, or streams that hold theirs),
    /// since it would wait for itself: drop one first, or wait at most a while
    /// ([`InferencePool::lease_timeout`]).
    pub fn lease(&self) -> Result<PoolLease<'_>> {
        self.lease_waiting(Wait::Forever)
    }

    /// As [`InferencePool::lease`], refusing at once when every arena is busy.
    ///
    /// # Errors
    ///
    /// [`Error::PoolBusy`]; [`Error::PoolClosed`].
    pub fn try_lease(&self) -> Result<PoolLease<'_>> {
        self.lease_waiting(Wait::No)
    }

    /// As [`InferencePool::lease`], waiting at most `timeout`.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`]; [`Error::PoolClosed`].
    pub fn lease_timeout(&self, timeout: Duration) -> Result<PoolLease<'_>> {
        self.lease_waiting(Wait::For(timeout))
    }

    fn lease_waiting(&self, wait: Wait) -> Result<PoolLease<'_>> {
        Ok(PoolLease { guard: self.shared.arenas.lease(wait)?, model: &self.shared.model })
    }

    /// Class probabilities of `x`, in an owned array; waits while the pool is busy
    /// ([`Infer::output`]).
    ///
    /// # Errors
    ///
    /// Shape errors (batched: a sequence input); [`Error::NonFinite`] naming the
    /// input; [`Error::InvalidInput`] for an empty batch; [`Error::Panicked`] when a
    /// layer panicked (direct: this request only; batched: every request of the batch
    /// it ran in); [`Error::BatchFailed`] when the batch it ran in failed otherwise
    /// (a workspace error); [`Error::PoolClosed`].
    pub fn output<'x>(&self, x: impl Into<Input<'x>>) -> Result<Array2<f32>> {
        Infer::output(&mut &*self, x)
    }

    /// As [`InferencePool::output`], written into `out` (`[rows, classes]`): no heap
    /// allocation once every arena has a plan for the shape, in either mode
    /// ([`Infer::output_into`]).
    ///
    /// # Errors
    ///
    /// As [`InferencePool::output`]; [`Error::ShapeMismatch`] for `out`'s shape.
    pub fn output_into<'x>(&self, x: impl Into<Input<'x>>, out: ArrayViewMut2<'_, f32>) -> Result<()> {
        Infer::output_into(&mut &*self, x, out)
    }

    /// The most probable class of each row of `x`, written to `out`
    /// ([`Infer::predict_into`]; batched, the probabilities are gathered in an owned
    /// array first).
    ///
    /// # Errors
    ///
    /// As [`InferencePool::output`]; [`Error::ShapeMismatch`] for `out`'s length.
    pub fn predict_into<'x>(&self, x: impl Into<Input<'x>>, out: &mut [u32]) -> Result<()> {
        Infer::predict_into(&mut &*self, x, out)
    }

    /// As [`InferencePool::output_into`], refusing at once when every arena is busy
    /// (batched: when `max_queued_rows` rows already wait, or when callers' leases and
    /// streams hold every arena at the call, so that no batch could run until one of
    /// them ends; a request queued before a caller takes the last arena waits for it).
    ///
    /// # Errors
    ///
    /// [`Error::PoolBusy`], and as [`InferencePool::output`].
    pub fn try_output<'x>(&self, x: impl Into<Input<'x>>, out: ArrayViewMut2<'_, f32>) -> Result<()> {
        self.run_into(x.into(), out, Wait::No)
    }

    /// As [`InferencePool::output_into`], waiting at most `timeout` for the result.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`], and as [`InferencePool::output`].
    pub fn output_timeout<'x>(
        &self,
        x: impl Into<Input<'x>>,
        out: ArrayViewMut2<'_, f32>,
        timeout: Duration,
    ) -> Result<()> {
        self.run_into(x.into(), out, Wait::For(timeout))
    }

    fn run_into(&self, x: Input<'_>, out: ArrayViewMut2<'_, f32>, wait: Wait) -> Result<()> {
        let Shared { model, arenas, batcher, .. } = &*self.shared;
        match batcher {
            Some(batcher) => batcher.submit_request(model, arenas, x, out, wait),
            None => {
                // A request that cannot run is refused before it waits for an arena.
                model.check_request(&x)?;
                infer_checked(&mut arenas.lease(wait)?, model, x, |probs| copy_into(probs, out))
            }
        }
    }

    /// A batched request's probabilities, in an owned array. The request is checked
    /// before its output is allocated (a broadcast input can claim any number of rows),
    /// and the output reserved fallibly.
    fn batched_output(&self, batcher: &Batcher, x: Input<'_>) -> Result<Array2<f32>> {
        let Shared { model, arenas, .. } = &*self.shared;
        model.check_request(&x)?;
        let (rows, classes) = (x.rows(), model.classes());
        let values = reserve_filled(rows.saturating_mul(classes), 0.0).map_err(|why| {
            Error::InvalidInput(format!("the probabilities of {rows} rows of {classes} classes: {why}"))
        })?;
        let mut out = Array2::from_shape_vec((rows, classes), values).expect("rows × classes values");
        batcher.submit_request(model, arenas, x, out.view_mut(), Wait::Forever)?;
        Ok(out)
    }

    /// Plans every arena for requests shaped as `x` (batched: for every batch a request
    /// of `x`'s features can land in, 1 to `max_batch` rows), so that no later request
    /// of that shape pays for planning, and the pool holds its K plans, K × the plan of
    /// the largest shape, from the start rather than as the load first reaches each
    /// arena. Call it once per request shape (rows, and steps for sequences) the pool
    /// will serve. It plans the arenas one after the other, each as soon as its running
    /// request (if any) ends, holding no other arena meanwhile, and runs each shape twice
    /// per arena (its recording and a first replay), so that no later request of the
    /// shape allocates. Batched, it runs `2 × max_batch` inferences per arena, two per
    /// batch size.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use carve::nn::{serve::InferencePool, Network, NetworkConfig, serve::PoolConfig};
    /// use carve::ndarray::Array2;
    ///
    /// let net = Network::new(NetworkConfig::builder(4).dense(8).relu().dense(3).build()?)?;
    /// let pool = InferencePool::new(Arc::new(net.freeze()?), PoolConfig::direct(2))?;
    /// pool.warm_up(Array2::<f32>::zeros((1, 4)).view())?;
    /// let planned = pool.stats().arena_bytes;
    /// assert!(planned > 0);
    /// pool.output(Array2::<f32>::ones((1, 4)).view())?;
    /// assert_eq!(pool.stats().arena_bytes, planned, "nothing new to plan");
    /// # Ok::<(), carve::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`InferencePool::output`] for `x`; [`Error::InvalidInput`] from a thread that
    /// holds a [`PoolLease`] of this pool (it would wait for its own lease).
    pub fn warm_up<'x>(&self, x: impl Into<Input<'x>>) -> Result<()> {
        let x = x.into();
        let model = &self.shared.model;
        model.check_request(&x)?;
        let batched = match (&self.shared.batcher, x) {
            (None, _) => None,
            (Some(_), Input::Flat(rows)) => {
                let most = self.shared.config.max_batch;
                let what = || format!("a warm-up batch of {most} rows of {} inputs", rows.ncols());
                let values = config_filled(most.saturating_mul(rows.ncols()), 0.0, what)?;
                let mut batch = Array2::from_shape_vec((most, rows.ncols()), values).expect("rows × inputs values");
                for (r, mut row) in batch.rows_mut().into_iter().enumerate() {
                    row.assign(&rows.row(r % rows.nrows()));
                }
                Some(batch)
            }
            // What a batched pool says of a sequence.
            (Some(_), sequences) => return self.output(sequences).map(drop),
        };
        // Refused before it queues behind another warm-up, which may be waiting for an
        // arena this thread holds.
        if self.shared.arenas.any_held_here() {
            return Err(Error::InvalidInput(warms_up_while_holding()));
        }
        let _one_at_a_time = self.shared.warming.lock().unwrap_or_else(PoisonError::into_inner);
        // One arena at a time, outside the free list: a warm-up holds nothing while it
        // waits, so it cannot deadlock with callers that hold leases.
        for index in 0..self.shared.arenas.len() {
            let mut arena = self.shared.arenas.reserve(index)?;
            // Each shape twice: the recording that plans it, then a first replay, whose
            // one-time costs (the engine's list of an iteration's windows grows to its
            // size) are paid here rather than by the first request of the load.
            match &batched {
                None => {
                    for _ in 0..2 {
                        infer_in_arena(&mut arena, model, x, |_| Ok(()))?;
                    }
                }
                Some(rows) => {
                    for n in 1..=rows.nrows() {
                        for _ in 0..2 {
                            infer_in_arena(&mut arena, model, Input::Flat(rows.slice(ndarray::s![..n, ..])), |_| {
                                Ok(())
                            })?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Closes the pool: requests waiting for an arena or a batch, and later ones, fail
    /// with [`Error::PoolClosed`]; requests already running finish.
    pub fn close(&self) {
        self.shared.arenas.close();
        if let Some(batcher) = &self.shared.batcher {
            batcher.close();
        }
    }

    /// What the pool has done.
    pub fn stats(&self) -> PoolStats {
        let c = &self.shared.arenas.counters;
        let (batches, batched_rows) = self.shared.batcher.as_ref().map_or((0, 0), Batcher::counts);
        PoolStats {
            workers: self.shared.arenas.len(),
            mode: match self.shared.config.mode {
                PoolMode::Direct => "direct",
                PoolMode::Batched => "batched",
            },
            leases: c.leases.load(Ordering::Relaxed),
            waited: c.waited.load(Ordering::Relaxed),
            busy: c.busy.load(Ordering::Relaxed),
            timeouts: c.timeouts.load(Ordering::Relaxed),
            panics: c.panics.load(Ordering::Relaxed),
            rebuilt_arenas: c.rebuilt.load(Ordering::Relaxed),
            on_plan: c.on_plan.load(Ordering::Relaxed),
            off_plan: c.off_plan.load(Ordering::Relaxed),
            batches,
            batched_rows,
            arena_bytes: self.shared.arenas.capacity(),
            stream_bytes: self.shared.arenas.stream_bytes(),
            weight_bytes: self.shared.model.weight_bytes(),
        }
    }
}

impl Drop for InferencePool {
    fn drop(&mut self) {
        self.close();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// An arena of an [`InferencePool`], leased for the caller's requests; given back
/// when dropped. See [`InferencePool::lease`].
#[derive(Debug)]
pub struct PoolLease<'p> {
    guard: ArenaGuard<'p>,
    model: &'p Model,
}

/// A pool infers in an arena leased for the request (direct), or in a batch with other
/// requests (batched); either way the same bits.
impl Infer for &InferencePool {
    /// Batched, the probabilities are gathered in an owned array first, and then handed
    /// to `f`.
    fn infer<'x, R>(&mut self, x: impl Into<Input<'x>>, f: impl FnOnce(ArrayView2<'_, f32>) -> Result<R>) -> Result<R> {
        let x = x.into();
        match &self.shared.batcher {
            Some(batcher) => f(self.batched_output(batcher, x)?.view()),
            None => {
                // A request that cannot run is refused before it waits for an arena.
                self.shared.model.check_request(&x)?;
                infer_checked(&mut self.shared.arenas.lease(Wait::Forever)?, &self.shared.model, x, f)
            }
        }
    }

    fn output<'x>(&mut self, x: impl Into<Input<'x>>) -> Result<Array2<f32>> {
        let x = x.into();
        match &self.shared.batcher {
            Some(batcher) => self.batched_output(batcher, x),
            None => self.infer(x, |probs| Ok(probs.to_owned())),
        }
    }

    fn output_into<'x>(&mut self, x: impl Into<Input<'x>>, out: ArrayViewMut2<'_, f32>) -> Result<()> {
        self.run_into(x.into(), out, Wait::Forever)
    }
}

/// As `&InferencePool` (so that an owned pool serves generic code too).
impl Infer for InferencePool {
    fn infer<'x, R>(&mut self, x: impl Into<Input<'x>>, f: impl FnOnce(ArrayView2<'_, f32>) -> Result<R>) -> Result<R> {
        Infer::infer(&mut &*self, x, f)
    }

    fn output<'x>(&mut self, x: impl Into<Input<'x>>) -> Result<Array2<f32>> {
        Infer::output(&mut &*self, x)
    }

    fn output_into<'x>(&mut self, x: impl Into<Input<'x>>, out: ArrayViewMut2<'_, f32>) -> Result<()> {
        Infer::output_into(&mut &*self, x, out)
    }
}

/// A lease infers in its arena.
impl Infer for PoolLease<'_> {
    fn infer<'x, R>(&mut self, x: impl Into<Input<'x>>, f: impl FnOnce(ArrayView2<'_, f32>) -> Result<R>) -> Result<R> {
        infer_in_arena(&mut self.guard, self.model, x.into(), f)
    }
}

impl<'p> PoolLease<'p> {
    /// The leased arena, for generation streams' life: a `TokenStream`'s (which stays
    /// on this thread, as the lease does) or a `StreamBatch`'s (which runs it from its
    /// callers' threads while this thread holds the batch).
    pub(crate) fn into_streams(self) -> StreamArena<'p> {
        self.guard.into_streams()
    }

    /// Class probabilities of `x`, in an owned array ([`Infer::output`]).
    ///
    /// # Errors
    ///
    /// As [`InferencePool::output`].
    pub fn output<'x>(&mut self, x: impl Into<Input<'x>>) -> Result<Array2<f32>> {
        Infer::output(self, x)
    }

    /// Class probabilities of `x`, written into `out` (`[rows, classes]`;
    /// [`Infer::output_into`]).
    ///
    /// # Errors
    ///
    /// As [`InferencePool::output_into`].
    pub fn output_into<'x>(&mut self, x: impl Into<Input<'x>>, out: ArrayViewMut2<'_, f32>) -> Result<()> {
        Infer::output_into(self, x, out)
    }

    /// The most probable class of each row of `x`, written to `out`
    /// ([`Infer::predict_into`]).
    ///
    /// # Errors
    ///
    /// As [`InferencePool::output`]; [`Error::ShapeMismatch`] for `out`'s length.
    pub fn predict_into<'x>(&mut self, x: impl Into<Input<'x>>, out: &mut [u32]) -> Result<()> {
        Infer::predict_into(self, x, out)
    }

    /// Hands the class probabilities of `x`, in the arena, to `f` (they live only
    /// while `f` runs), and returns what `f` returns ([`Infer::infer`]).
    ///
    /// # Errors
    ///
    /// As [`InferencePool::output`], and `f`'s.
    pub fn infer<'x, R>(
        &mut self,
        x: impl Into<Input<'x>>,
        f: impl FnOnce(ArrayView2<'_, f32>) -> Result<R>,
    ) -> Result<R> {
        Infer::infer(self, x, f)
    }
}
