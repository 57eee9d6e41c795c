//! Batched mode: requests queued by their callers, coalesced by the pool's worker
//! threads into batches of up to `max_batch` rows (or whatever arrived within
//! `max_wait` of the oldest), run as one inference each, and scattered back.
//!
//! A caller copies its rows into a ticket of its thread (made once per thread and
//! reused: no heap allocation per request), queues it and sleeps on it; a worker takes
//! tickets from the front of the queue (a ticket of more rows than fit is split across
//! batches, in order), copies their rows into its batch buffer, runs the batch in an
//! arena it leases, writes each ticket's rows of the result back and wakes it.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ndarray::{ArrayView2, ArrayViewMut2};

use super::arenas::Wait;
use super::pool::{PoolConfig, Shared};
use crate::nn::network::Input;
use crate::{Error, Result};

/// One request: its rows in, its probabilities out.
#[derive(Debug, Default)]
struct Ticket {
    state: Mutex<TicketState>,
    done: Condvar,
}

#[derive(Debug, Default)]
struct TicketState {
    /// The request's rows, row-major.
    input: Vec<f32>,
    rows: usize,
    /// `rows × classes`, row-major.
    output: Vec<f32>,
    /// Rows handed to batches, and rows whose results are written.
    taken: usize,
    finished: usize,
    error: Option<Error>,
    arrived: Option<Instant>,
}

impl Ticket {
    fn state(&self) -> MutexGuard<'_, TicketState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

thread_local! {
    /// The calling thread's ticket, reused from request to request.
    static TICKET: RefCell<Option<Arc<Ticket>>> = const { RefCell::new(None) };
}

#[derive(Debug)]
struct Queue {
    pending: VecDeque<Arc<Ticket>>,
    /// Rows of the pending tickets not yet taken.
    rows: usize,
    closed: bool,
}

/// The batched mode's queue and counts.
#[derive(Debug)]
pub(crate) struct Batcher {
    queue: Mutex<Queue>,
    arrived: Condvar,
    batches: AtomicU64,
    rows: AtomicU64,
}

/// The error a request of a failed batch gets.
fn for_request(error: &Error) -> Error {
    match error {
        Error::PoolClosed => Error::PoolClosed,
        Error::Panicked { message } => Error::Panicked { message: message.clone() },
        other => Error::InvalidInput(format!("the batch this request ran in failed: {other}")),
    }
}

impl Batcher {
    pub(crate) fn new(config: &PoolConfig) -> Batcher {
        Batcher {
            // Room for a ticket per queued row: queuing never allocates.
            queue: Mutex::new(Queue {
                pending: VecDeque::with_capacity(config.max_queued_rows.clamp(1024, 1 << 16)),
                rows: 0,
                closed: false,
            }),
            arrived: Condvar::new(),
            batches: AtomicU64::new(0),
            rows: AtomicU64::new(0),
        }
    }

    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts the worker threads, one per arena.
    pub(crate) fn start(shared: &Arc<Shared>) -> Result<Vec<JoinHandle<()>>> {
        (0..shared.arenas.len())
            .map(|i| {
                let shared = Arc::clone(shared);
                std::thread::Builder::new()
                    .name(format!("carve-batcher-{i}"))
                    .spawn(move || work(&shared))
                    .map_err(|e| Error::InvalidConfig { reason: format!("cannot start a batch worker thread: {e}") })
            })
            .collect()
    }

    pub(crate) fn counts(&self) -> (u64, u64) {
        (self.batches.load(Ordering::Relaxed), self.rows.load(Ordering::Relaxed))
    }

    pub(crate) fn close(&self) {
        self.queue().closed = true;
        self.arrived.notify_all();
    }

    /// Queues `x` (checked here, so that a bad request fails alone) and waits for its
    /// rows' probabilities, written into `out`.
    pub(crate) fn submit(
        &self,
        shared: &Shared,
        x: Input<'_>,
        mut out: ArrayViewMut2<'_, f32>,
        wait: Wait,
    ) -> Result<()> {
        let model = &shared.model;
        model.check_request(&x)?;
        let Input::Flat(x) = x else {
            return Err(Error::InvalidInput(
                "a batched pool coalesces flat rows [batch, features]; serve a sequence model from a direct pool \
                 (PoolMode::Direct)"
                    .into(),
            ));
        };
        let expected = (x.nrows(), model.classes());
        if out.dim() != expected {
            return Err(Error::ShapeMismatch {
                context: "output buffer ([rows, classes])".into(),
                expected: vec![expected.0, expected.1],
                actual: out.shape().to_vec(),
            });
        }
        let ticket = TICKET.with(|t| t.borrow_mut().get_or_insert_with(Default::default).clone());
        {
            let mut state = ticket.state();
            state.input.clear();
            match x.as_slice() {
                Some(rows) => state.input.extend_from_slice(rows),
                None => state.input.extend(x.iter().copied()),
            }
            state.rows = x.nrows();
            state.output.clear();
            state.output.resize(expected.0 * expected.1, 0.0);
            state.taken = 0;
            state.finished = 0;
            state.error = None;
            state.arrived = Some(Instant::now());
        }
        let start = Instant::now();
        {
            let mut queue = self.queue();
            if queue.closed {
                return Err(Error::PoolClosed);
            }
            if matches!(wait, Wait::No) && queue.rows + x.nrows() > shared.config.max_queued_rows {
                shared.arenas.counters.busy.fetch_add(1, Ordering::Relaxed);
                return Err(Error::PoolBusy { arenas: shared.arenas.len() });
            }
            queue.rows += x.nrows();
            queue.pending.push_back(Arc::clone(&ticket));
        }
        self.arrived.notify_all();
        let mut state = ticket.state();
        while state.finished < state.rows && state.error.is_none() {
            state = match wait {
                Wait::For(timeout) => {
                    let waited = start.elapsed();
                    if waited >= timeout {
                        drop(state);
                        return Err(self.abandon(shared, &ticket, waited));
                    }
                    ticket.done.wait_timeout(state, timeout - waited).unwrap_or_else(PoisonError::into_inner).0
                }
                Wait::No | Wait::Forever => ticket.done.wait(state).unwrap_or_else(PoisonError::into_inner),
            };
        }
        if let Some(error) = state.error.take() {
            return Err(error);
        }
        let probs = ArrayView2::from_shape(expected, &state.output).expect("rows × classes values");
        out.assign(&probs);
        Ok(())
    }

    /// A request that timed out: taken out of the queue when no batch has its rows yet;
    /// otherwise left to its batch, and the thread takes a new ticket next time.
    #[cold]
    fn abandon(&self, shared: &Shared, ticket: &Arc<Ticket>, waited: Duration) -> Error {
        let mut queue = self.queue();
        let untouched = ticket.state().taken == 0;
        if untouched {
            if let Some(i) = queue.pending.iter().position(|t| Arc::ptr_eq(t, ticket)) {
                queue.pending.remove(i);
                queue.rows -= ticket.state().rows;
            }
        }
        drop(queue);
        if !untouched {
            TICKET.with(|t| *t.borrow_mut() = None);
        }
        shared.arenas.counters.timeouts.fetch_add(1, Ordering::Relaxed);
        Error::Timeout { arenas: shared.arenas.len(), waited }
    }
}

/// A part of a batch: `rows` rows of `ticket` from its row `from`, at row `at` of the
/// batch.
struct Part {
    ticket: Arc<Ticket>,
    from: usize,
    rows: usize,
    at: usize,
}

/// A worker thread: takes batches until the pool closes, then fails what is left.
fn work(shared: &Shared) {
    let batcher = shared.batcher.as_ref().expect("a batched pool");
    let (max_batch, max_wait) = (shared.config.max_batch, shared.config.max_wait);
    let (inputs, classes) = (shared.model.inputs(), shared.model.classes());
    let mut input = Vec::<f32>::with_capacity(max_batch * inputs);
    let mut parts = Vec::<Part>::with_capacity(max_batch);
    loop {
        let mut queue = batcher.queue();
        // Wait for a request, then for the batch to fill or the oldest to have waited
        // `max_wait`.
        loop {
            if queue.closed {
                drop(queue);
                return fail_pending(batcher);
            }
            let Some(front) = queue.pending.front() else {
                queue = batcher.arrived.wait(queue).unwrap_or_else(PoisonError::into_inner);
                continue;
            };
            let arrived = front.state().arrived.unwrap_or_else(Instant::now);
            let deadline = arrived + max_wait;
            let now = Instant::now();
            if queue.rows >= max_batch || now >= deadline {
                break;
            }
            queue = batcher.arrived.wait_timeout(queue, deadline - now).unwrap_or_else(PoisonError::into_inner).0;
        }
        // Take up to `max_batch` rows from the front.
        let mut rows = 0;
        while rows < max_batch {
            let Some(front) = queue.pending.front() else { break };
            let mut state = front.state();
            let n = (state.rows - state.taken).min(max_batch - rows);
            input.extend_from_slice(&state.input[state.taken * inputs..(state.taken + n) * inputs]);
            parts.push(Part { ticket: Arc::clone(front), from: state.taken, rows: n, at: rows });
            state.taken += n;
            rows += n;
            let whole = state.taken == state.rows;
            drop(state);
            if whole {
                queue.pending.pop_front();
            }
        }
        queue.rows -= rows;
        drop(queue);
        let x = ArrayView2::from_shape((rows, inputs), &input).expect("rows × inputs values");
        let result = shared.arenas.lease(Wait::Forever).and_then(|mut arena| {
            arena.run(|mgr| {
                shared.model.infer_in(mgr, Input::Flat(x), |probs| {
                    for part in &parts {
                        let mut state = part.ticket.state();
                        let out = &mut state.output[part.from * classes..(part.from + part.rows) * classes];
                        let src = probs.slice(ndarray::s![part.at..part.at + part.rows, ..]);
                        for (o, &p) in out.iter_mut().zip(src.iter()) {
                            *o = p;
                        }
                    }
                    Ok(())
                })
            })
        });
        batcher.batches.fetch_add(1, Ordering::Relaxed);
        batcher.rows.fetch_add(rows as u64, Ordering::Relaxed);
        for part in parts.drain(..) {
            let mut state = part.ticket.state();
            match &result {
                Ok(()) => state.finished += part.rows,
                Err(e) => state.error = Some(for_request(e)),
            }
            drop(state);
            part.ticket.done.notify_all();
        }
        input.clear();
    }
}

/// Fails every request still queued once the pool closed.
fn fail_pending(batcher: &Batcher) {
    let mut queue = batcher.queue();
    queue.rows = 0;
    while let Some(ticket) = queue.pending.pop_front() {
        ticket.state().error = Some(Error::PoolClosed);
        ticket.done.notify_all();
    }
}
