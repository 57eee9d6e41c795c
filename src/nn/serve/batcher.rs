//! Batched mode: requests queued by their callers, coalesced by the pool's worker
//! threads into batches of up to `max_batch` rows (or whatever arrived within
//! `max_wait` of the oldest), run as one inference each, and scattered back.
//!
//! A request is a [`Ticket`] on its caller's stack: the caller queues a pointer to it
//! and parks; a worker leases an arena, then takes tickets from the front of the queue
//! (a ticket of more rows than fit is split across batches, in order), copies their
//! rows from the caller's input into its batch buffer, runs the batch in the arena,
//! writes each ticket's rows of the result straight into the caller's output and
//! unparks it. Rows are taken only once the arena is held, so that no request waits on
//! a worker that waits for an arena: a request's timeout holds whatever the arenas do.
//! Nothing is allocated per request or per calling thread, and nothing is copied but
//! the rows into the batch and the probabilities out of it.
//!
//! **Why the pointers stay valid.** A ticket is reachable from other threads only while
//! it is queued (`Ticket::queued`, changed with the queue's lock held) or while a worker
//! holds some of its rows (`taken > settled`). [`Batcher::submit`] neither returns nor
//! unwinds before both are over: [`Leave`], a guard in its own frame, takes the ticket
//! out of the queue and waits for the rows in flight. A worker settles every row it
//! takes, whatever happens to its batch (a layer's panic is caught by the arena), and
//! touches the ticket last when it adds its rows to `settled`: it wakes the caller
//! through its own handle of the caller's thread.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_iter::panics::{drop_quietly, panic_message};
// The protocol's primitives are loom's under `--cfg loom` (its model: `src/nn/loom.rs`);
// the batch and row counts are statistics, std atomics.
use async_iter::sync::{self, AtomicBool, AtomicUsize, Condvar, Deadline, Mutex, MutexGuard, Stopwatch, Thread};
use ndarray::{ArrayView2, ArrayViewMut2};

use super::arenas::{ArenaGuard, Arenas, Counters, Wait};
use super::config::PoolConfig;
use super::model::Model;
use super::turns::waits_for_itself;
use crate::nn::limits::reserve;
use crate::nn::network::Input;
use crate::{Error, Result};

/// One request, on its caller's stack: where its rows are read from and its
/// probabilities written to, and its progress.
struct Ticket {
    /// The caller's input `[rows, inputs]`: element `(r, c)` at `input + r·s0 + c·s1`.
    input: *const f32,
    input_strides: [isize; 2],
    /// The caller's output `[rows, classes]`, likewise; each row written by the one
    /// worker that took it.
    output: *mut f32,
    output_strides: [isize; 2],
    rows: usize,
    /// When the batch it is the oldest of must go (its arrival + `max_wait`).
    batch_by: Deadline,
    /// Since its arrival, for a timeout's report.
    waited: Stopwatch,
    /// The caller's thread, unparked as rows settle.
    caller: Thread,
    /// In the batcher's queue (changed with the queue's lock held).
    queued: AtomicBool,
    /// Rows handed to workers (changed with the queue's lock held).
    taken: AtomicUsize,
    /// Rows written or failed: a worker's last touch of the ticket (`Release`).
    settled: AtomicUsize,
    error: Mutex<Option<Error>>,
}

/// A queued ticket.
///
/// # Safety
///
/// The ticket lives on a caller's stack in [`Batcher::submit`], which neither returns
/// nor unwinds while the ticket is queued or has rows in flight (see the module's
/// documentation): it may be dereferenced while either holds. Its input is read and
/// its output rows written from worker threads: `f32` data the caller lent for the
/// call, each output row written by the one worker that took it, and read by the
/// caller only after it saw the row settled (`Acquire` on `settled`).
#[derive(Clone, Copy)]
struct TicketRef(NonNull<Ticket>);

// SAFETY: see `TicketRef`: what other threads touch of a ticket is `Sync` (atomics, a
// mutex, a thread handle) or rows lent for the call as described there.
unsafe impl Send for TicketRef {}

impl TicketRef {
    /// The ticket.
    ///
    /// # Safety
    ///
    /// The ticket must be queued, or the caller of this must hold rows of it not yet
    /// settled.
    unsafe fn get(&self) -> &Ticket {
        // SAFETY: the caller's contract: the ticket's frame is alive.
        unsafe { self.0.as_ref() }
    }
}

impl Ticket {
    /// Records `error` (the first one wins).
    fn fail(&self, error: Error) {
        sync::lock(&self.error).get_or_insert(error);
    }

    /// Adds `rows` settled rows and wakes the caller: the last use of the ticket by
    /// whoever holds those rows.
    fn settle(&self, rows: usize) {
        // The caller may return once the count is complete: wake it through a handle
        // of our own (a reference count, no allocation).
        let caller = self.caller.clone();
        self.settled.fetch_add(rows, Ordering::Release);
        caller.unpark();
    }
}

struct Queue {
    pending: VecDeque<TicketRef>,
    /// Rows of the pending tickets not yet taken.
    rows: usize,
    closed: bool,
}

/// The batched mode's queue, settings and counts.
pub(crate) struct Batcher {
    queue: Mutex<Queue>,
    arrived: Condvar,
    max_batch: usize,
    max_wait: Duration,
    max_queued_rows: usize,
    /// The width of a request's rows, and of its probabilities.
    inputs: usize,
    classes: usize,
    /// The pool's arenas (K), for errors.
    arenas: usize,
    batches: AtomicU64,
    rows: AtomicU64,
}

impl std::fmt::Debug for Batcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher").field("batches", &self.batches).field("rows", &self.rows).finish_non_exhaustive()
    }
}

/// The error a request of a failed batch gets.
fn for_request(error: &Error) -> Error {
    match error {
        Error::PoolClosed => Error::PoolClosed,
        Error::Panicked { message } => Error::Panicked { message: message.clone() },
        other => Error::BatchFailed { message: other.to_string() },
    }
}

/// Ends other threads' use of a ticket when [`Batcher::submit`] leaves, however it
/// leaves: out of the queue, and no rows in flight.
struct Leave<'a> {
    batcher: &'a Batcher,
    ticket: &'a Ticket,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        let ticket = self.ticket;
        // `queued` and `taken` change with the queue's lock held.
        let mut queue = self.batcher.queue();
        if ticket.queued.load(Ordering::Relaxed) {
            let me = NonNull::from(ticket);
            if let Some(i) = queue.pending.iter().position(|t| t.0 == me) {
                queue.pending.remove(i);
            }
            queue.rows -= ticket.rows - ticket.taken.load(Ordering::Relaxed);
            ticket.queued.store(false, Ordering::Relaxed);
        }
        // Out of the queue: no more rows are taken. Wait for those in flight (bounded by
        // their batch).
        let taken = ticket.taken.load(Ordering::Relaxed);
        drop(queue);
        while ticket.settled.load(Ordering::Acquire) < taken {
            sync::park();
        }
    }
}

impl Batcher {
    /// The queue of a pool of `config` whose requests have rows of `inputs` values and
    /// probabilities of `classes`.
    pub(crate) fn new(config: &PoolConfig, inputs: usize, classes: usize) -> Batcher {
        Batcher {
            // Room for a ticket per queued row: queuing never allocates.
            queue: Mutex::new(Queue {
                pending: VecDeque::with_capacity(config.max_queued_rows.clamp(1024, 1 << 16)),
                rows: 0,
                closed: false,
            }),
            arrived: Condvar::new(),
            max_batch: config.max_batch,
            max_wait: config.max_wait,
            max_queued_rows: config.max_queued_rows,
            inputs,
            classes,
            arenas: config.workers,
            batches: AtomicU64::new(0),
            rows: AtomicU64::new(0),
        }
    }

    fn queue(&self) -> MutexGuard<'_, Queue> {
        sync::lock(&self.queue)
    }

    /// A worker thread's body: runs batches of `model` in `arenas` until the close (see
    /// [`Batcher::work`]).
    pub(crate) fn serve(&self, buffers: BatchBuffers, arenas: &Arenas, model: &Model) {
        self.work(
            buffers,
            || arenas.lease_for_batch(Wait::Forever),
            |arena, x, scatter| run_in_arena(model, arena, x, scatter),
        );
    }

    pub(crate) fn counts(&self) -> (u64, u64) {
        (self.batches.load(Ordering::Relaxed), self.rows.load(Ordering::Relaxed))
    }

    pub(crate) fn close(&self) {
        self.queue().closed = true;
        self.arrived.notify_all();
    }

    /// Checks `x` for `model` (here, so that a bad request fails alone), queues it and
    /// waits for its rows' probabilities (computed in `arenas`), written into `out`.
    pub(crate) fn submit_request(
        &self,
        model: &Model,
        arenas: &Arenas,
        x: Input<'_>,
        out: ArrayViewMut2<'_, f32>,
        wait: Wait,
    ) -> Result<()> {
        model.check_request(&x)?;
        // What no batch can run is refused first, whoever holds the arenas.
        let Input::Flat(x) = x else {
            return Err(Error::InvalidInput(
                "a batched pool coalesces flat rows [batch, features]; serve a sequence model from a direct pool \
                 (PoolMode::Direct)"
                    .into(),
            ));
        };
        // The workers need an arena to run the batch: none comes while this thread holds
        // them all.
        if !matches!(wait, Wait::For(_)) && arenas.all_held_here() {
            return Err(Error::InvalidInput(waits_for_itself()));
        }
        // A request that may not wait is refused while callers hold every arena: queued,
        // it would wait for one of them to give theirs back, for as long as they hold it.
        if matches!(wait, Wait::No) && arenas.all_held_by_callers() {
            arenas.counters.busy.fetch_add(1, Ordering::Relaxed);
            return Err(Error::PoolBusy { arenas: arenas.len() });
        }
        self.submit(x, out, wait, &arenas.counters)
    }

    /// Queues the rows of `x` (`[rows, inputs]`) and waits, as `wait` says, for their
    /// probabilities, written into `out` (`[rows, classes]`).
    ///
    /// # Errors
    ///
    /// [`Error::ShapeMismatch`] for the shapes; [`Error::PoolBusy`] (`Wait::No` with
    /// `max_queued_rows` rows waiting); [`Error::Timeout`]; [`Error::PoolClosed`]; the
    /// error of the batch the rows ran in.
    pub(crate) fn submit(
        &self,
        x: ArrayView2<'_, f32>,
        mut out: ArrayViewMut2<'_, f32>,
        wait: Wait,
        counters: &Counters,
    ) -> Result<()> {
        if x.ncols() != self.inputs {
            return Err(Error::ShapeMismatch {
                context: "input rows ([rows, inputs])".into(),
                expected: vec![x.nrows(), self.inputs],
                actual: x.shape().to_vec(),
            });
        }
        let expected = (x.nrows(), self.classes);
        if out.dim() != expected {
            return Err(Error::ShapeMismatch {
                context: "output buffer ([rows, classes])".into(),
                expected: vec![expected.0, expected.1],
                actual: out.shape().to_vec(),
            });
        }
        let strides = |s: &[isize]| [s[0], s[1]];
        let ticket = Ticket {
            input: x.as_ptr(),
            input_strides: strides(x.strides()),
            output: out.as_mut_ptr(),
            output_strides: strides(out.strides()),
            rows: x.nrows(),
            batch_by: Deadline::after(self.max_wait),
            waited: Stopwatch::start(),
            caller: sync::current(),
            queued: AtomicBool::new(false),
            taken: AtomicUsize::new(0),
            settled: AtomicUsize::new(0),
            error: Mutex::new(None),
        };
        {
            let mut queue = self.queue();
            if queue.closed {
                return Err(Error::PoolClosed);
            }
            // A request alone in the queue is always taken (whatever its rows): refused,
            // it would be refused as busy forever.
            if matches!(wait, Wait::No) && queue.rows > 0 && queue.rows + x.nrows() > self.max_queued_rows {
                counters.busy.fetch_add(1, Ordering::Relaxed);
                return Err(Error::PoolBusy { arenas: self.arenas });
            }
            queue.rows += x.nrows();
            ticket.queued.store(true, Ordering::Relaxed);
            queue.pending.push_back(TicketRef(NonNull::from(&ticket)));
        }
        // From here the ticket is shared: `leave` ends that before this frame ends, on
        // every way out (an unwind included).
        let leave = Leave { batcher: self, ticket: &ticket };
        self.arrived.notify_all();
        let failed = || sync::lock(&ticket.error).is_some();
        let deadline = match wait {
            Wait::For(timeout) => Some(Deadline::after(timeout)),
            Wait::No | Wait::Forever => None,
        };
        let outcome = loop {
            if ticket.settled.load(Ordering::Acquire) == ticket.rows || failed() {
                break Ok(());
            }
            match deadline.map(|d| d.remaining()) {
                Some(None) => {
                    counters.timeouts.fetch_add(1, Ordering::Relaxed);
                    break Err(Error::Timeout { arenas: self.arenas, waited: ticket.waited.elapsed() });
                }
                Some(Some(left)) => sync::park_timeout(left),
                None => sync::park(),
            }
        };
        drop(leave);
        // Every row settled or abandoned: `out` is the caller's alone again.
        let error = sync::lock(&ticket.error).take();
        match (outcome, error) {
            (Err(timeout), _) => Err(timeout),
            (Ok(()), Some(error)) => Err(error),
            (Ok(()), None) => Ok(()),
        }
    }
}

/// What a worker thread keeps from batch to batch: room for one batch's input rows and
/// its parts. Made by [`InferencePool::new`](super::InferencePool::new) on the caller's
/// thread, so that a batch size the machine cannot hold is refused there.
pub(crate) struct BatchBuffers {
    input: Vec<f32>,
    parts: Vec<Part>,
}

impl BatchBuffers {
    /// Room for `config.max_batch` rows of `inputs` values, reserved fallibly.
    pub(crate) fn new(config: &PoolConfig, inputs: usize) -> Result<BatchBuffers> {
        let rows = config.max_batch;
        let refused = |kind: &'static str| {
            move |why: String| Error::InvalidConfig {
                reason: format!(
                    "a batch worker's {kind} for max_batch {rows} rows of {inputs} inputs: {why}; lower max_batch"
                ),
            }
        };
        Ok(BatchBuffers {
            input: reserve(rows.saturating_mul(inputs)).map_err(refused("input rows"))?,
            parts: reserve(rows).map_err(refused("request parts"))?,
        })
    }
}

/// Runs one batch of `model` in `arena` and hands its probabilities to `scatter`.
fn run_in_arena(
    model: &Model,
    arena: &mut ArenaGuard<'_>,
    x: ArrayView2<'_, f32>,
    scatter: &mut dyn FnMut(ArrayView2<'_, f32>),
) -> Result<()> {
    arena.run(|mgr| {
        model.infer_in(mgr, Input::Flat(x), |probs| {
            scatter(probs);
            Ok(())
        })
    })
}

impl Batcher {
    /// A worker's loop: takes batches until the close, then fails what is left.
    ///
    /// For each batch it first waits for a request (and for the batch to fill or its
    /// oldest request to have waited `max_wait`), then leases an arena with `lease`,
    /// and only then takes the rows: a worker never holds a request's rows while it
    /// waits for an arena, so a request that times out (or whose caller holds the only
    /// arena) leaves the queue at its deadline. `run` runs the batch (`[rows, inputs]`)
    /// in the arena and hands its probabilities (`[rows, classes]`) to the scatter it is
    /// given, which writes each request's rows into its caller's output; a lease that
    /// fails fails the batch's requests with its error.
    pub(crate) fn work<A>(
        &self,
        buffers: BatchBuffers,
        mut lease: impl FnMut() -> Result<A>,
        mut run: impl FnMut(&mut A, ArrayView2<'_, f32>, &mut dyn FnMut(ArrayView2<'_, f32>)) -> Result<()>,
    ) {
        let BatchBuffers { mut input, mut parts } = buffers;
        loop {
            if !self.wait_for_batch() {
                return self.fail_pending();
            }
            let arena = lease();
            let rows = self.take(&mut input, &mut parts);
            if rows == 0 {
                // Every request left while this worker waited for an arena.
                continue;
            }
            // Whatever happens below, every part is settled after it (a panic here would
            // otherwise leave its callers waiting for ever).
            let x = ArrayView2::from_shape((rows, self.inputs), &input[..]).expect("rows × inputs values");
            let result = match arena {
                Err(e) => Err(e),
                Ok(mut arena) => {
                    let mut scattered = false;
                    let ran = catch_unwind(AssertUnwindSafe(|| {
                        run(&mut arena, x, &mut |probs| {
                            self.scatter(probs, &parts);
                            scattered = true;
                        })
                    }));
                    match ran {
                        Ok(Ok(())) if !scattered => {
                            Err(Error::InvalidInput("the batch's inference gave no probabilities".into()))
                        }
                        Ok(result) => result,
                        Err(payload) => {
                            let message = panic_message(&*payload);
                            drop_quietly(payload);
                            Err(Error::Panicked { message })
                        }
                    }
                }
            };
            self.batches.fetch_add(1, Ordering::Relaxed);
            self.rows.fetch_add(rows as u64, Ordering::Relaxed);
            for part in parts.drain(..) {
                // SAFETY: this worker holds the part's rows, not yet settled.
                let ticket = unsafe { part.ticket.get() };
                if let Err(e) = &result {
                    ticket.fail(for_request(e));
                }
                // The last touch of the ticket.
                ticket.settle(part.rows);
            }
            input.clear();
        }
    }

    /// Waits for a request, then for the batch to fill or the oldest request to have
    /// waited `max_wait`: `false` once the batcher is closed.
    fn wait_for_batch(&self) -> bool {
        let mut queue = self.queue();
        loop {
            if queue.closed {
                return false;
            }
            let Some(front) = queue.pending.front() else {
                queue = sync::wait(&self.arrived, queue);
                continue;
            };
            // SAFETY: queued.
            let batch_by = unsafe { front.get() }.batch_by;
            if queue.rows >= self.max_batch {
                return true;
            }
            match batch_by.remaining() {
                None => return true,
                Some(left) => queue = sync::wait_timeout(&self.arrived, queue, left),
            }
        }
    }

    /// Takes up to `max_batch` rows from the front of the queue: their values into
    /// `input`, their places into `parts`. Returns the rows taken (none when every
    /// request left meanwhile).
    fn take(&self, input: &mut Vec<f32>, parts: &mut Vec<Part>) -> usize {
        let mut queue = self.queue();
        let mut rows = 0;
        while rows < self.max_batch {
            let Some(&front) = queue.pending.front() else { break };
            // SAFETY: queued (and its rows taken here are in flight until settled by the
            // worker).
            let ticket = unsafe { front.get() };
            let from = ticket.taken.load(Ordering::Relaxed);
            let n = (ticket.rows - from).min(self.max_batch - rows);
            let [s0, s1] = ticket.input_strides;
            for r in from..from + n {
                for c in 0..self.inputs {
                    // SAFETY: (r, c) is inside the caller's input `[rows, inputs]`, lent
                    // for the call, which lasts while the ticket is queued.
                    input.push(unsafe { *ticket.input.offset(r as isize * s0 + c as isize * s1) });
                }
            }
            parts.push(Part { ticket: front, from, rows: n, at: rows });
            ticket.taken.store(from + n, Ordering::Relaxed);
            rows += n;
            if from + n == ticket.rows {
                ticket.queued.store(false, Ordering::Relaxed);
                queue.pending.pop_front();
            }
        }
        queue.rows -= rows;
        rows
    }

    /// Writes each part's rows of `probs` (the batch's probabilities) into its caller's
    /// output.
    ///
    /// # Panics
    ///
    /// When `probs` is not `[rows of the parts, classes]` (caught by the worker: the
    /// batch fails, nothing is written out of bounds).
    fn scatter(&self, probs: ArrayView2<'_, f32>, parts: &[Part]) {
        let rows = parts.last().map_or(0, |p| p.at + p.rows);
        assert_eq!(probs.dim(), (rows, self.classes), "a batch's probabilities are [rows, classes]");
        for part in parts {
            // SAFETY: this worker holds the part's rows, not yet settled.
            let ticket = unsafe { part.ticket.get() };
            let [s0, s1] = ticket.output_strides;
            for r in 0..part.rows {
                for (c, &p) in probs.row(part.at + r).iter().enumerate() {
                    let at = (part.from + r) as isize * s0 + c as isize * s1;
                    // SAFETY: inside the caller's output `[rows, classes]` (the shape was
                    // checked when it was queued and above), a row this worker alone
                    // writes (it took it), which the caller reads only once it is settled.
                    unsafe { *ticket.output.offset(at) = p };
                }
            }
        }
    }

    /// Fails every request still queued once the pool closed.
    fn fail_pending(&self) {
        let mut queue = self.queue();
        queue.rows = 0;
        while let Some(front) = queue.pending.pop_front() {
            // SAFETY: queued until the store below; the caller's `Leave` waits for the
            // queue's lock, held here, before it can return.
            let ticket = unsafe { front.get() };
            ticket.queued.store(false, Ordering::Relaxed);
            ticket.fail(Error::PoolClosed);
            ticket.caller.unpark();
        }
    }
}

/// A part of a batch: `rows` rows of `ticket` from its row `from`, at row `at` of the
/// batch.
struct Part {
    ticket: TicketRef,
    from: usize,
    rows: usize,
    at: usize,
}
