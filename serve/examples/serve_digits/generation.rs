//! `POST /generate` through a stream batch (`--stream-batch S`): the streams of up to S
//! requests stepped together in one arena of their own, whoever their clients are.
//!
//! A [`StreamBatch`] stays on the thread that made it (its arena's turn records that
//! thread) and is shared by reference with the threads that join it, so the batch lives
//! on a thread of its own: it makes the batch, then runs S workers in a scope around it,
//! each serving one request at a time (join, step, leave). The route hands a request to
//! the workers through a bounded queue and awaits its answer on a oneshot channel, so no
//! runtime thread ever waits on the batch. A worker checks the request's deadline and
//! whether its client is still there before it joins and before every token: a request
//! that waited out its time in the queue is answered 503 without a stream, and a client
//! that goes away ends its stream at the next token, freeing its slot.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use carve::nn::serve::{InferencePool, Model, PoolConfig, Sampling, StreamBatch};
use tokio::sync::oneshot;

/// How long a step of the batch waits for the streams that have not queued theirs.
const MAX_WAIT: Duration = Duration::from_millis(1);

/// One request's generation.
pub(crate) struct Job {
    pub(crate) prompt: String,
    pub(crate) tokens: usize,
    pub(crate) sampling: Sampling,
    pub(crate) deadline: Instant,
    /// Set when the request is gone (its client disconnected, or its time ran out).
    pub(crate) cancelled: Arc<AtomicBool>,
    pub(crate) reply: oneshot::Sender<Outcome>,
}

/// How a job ended.
pub(crate) enum Outcome {
    /// The tokens drawn.
    Tokens(Vec<u32>),
    /// The prompt cannot start a stream (a symbol outside the model's characters).
    BadPrompt(String),
    /// The batch refused or failed the stream.
    Refused(carve::Error),
    /// The request's time ran out, or its client went away.
    Gone,
}

/// The queue to the batch's workers.
pub(crate) struct Batcher {
    jobs: SyncSender<Job>,
    slots: usize,
}

impl Batcher {
    /// A stream batch of `slots` slots over `model` in an arena of its own (a pool of
    /// one), its `slots` workers started, and a queue of at most `queue` waiting jobs.
    ///
    /// # Errors
    ///
    /// The pool's or the batch's error (the model cannot generate, or `slots` is out of
    /// range), or the thread's.
    pub(crate) fn start(model: Arc<Model>, slots: usize, queue: usize) -> Result<Batcher, Box<dyn std::error::Error>> {
        let (jobs, waiting) = sync_channel::<Job>(queue.max(1));
        let (ready, started) = sync_channel::<Result<(), String>>(1);
        std::thread::Builder::new().name("stream-batch".into()).spawn(move || {
            let pool = match InferencePool::new(Arc::clone(&model), PoolConfig::direct(1)) {
                Ok(pool) => pool,
                Err(e) => return drop(ready.send(Err(e.to_string()))),
            };
            let batch = match pool.stream_batch(slots, MAX_WAIT) {
                Ok(batch) => batch,
                Err(e) => return drop(ready.send(Err(e.to_string()))),
            };
            let _ = ready.send(Ok(()));
            let waiting = Mutex::new(waiting);
            std::thread::scope(|scope| {
                for _ in 0..slots {
                    scope.spawn(|| work(&model, &batch, &waiting));
                }
            });
        })?;
        started.recv().map_err(|_| "the stream batch's thread ended before it started")??;
        Ok(Batcher { jobs, slots })
    }

    /// The slots of the batch.
    pub(crate) fn slots(&self) -> usize {
        self.slots
    }

    /// Queues `job`; gives it back when the queue is full.
    pub(crate) fn submit(&self, job: Job) -> Result<(), Job> {
        self.jobs.try_send(job).map_err(|e| match e {
            TrySendError::Full(job) | TrySendError::Disconnected(job) => job,
        })
    }
}

/// A worker: the next job of the queue, until the queue is gone.
fn work(model: &Model, batch: &StreamBatch<'_>, waiting: &Mutex<Receiver<Job>>) {
    loop {
        // A worker that panicked while holding the lock leaves it poisoned; the queue
        // itself is sound, so the others go on.
        let next = waiting.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).recv();
        let Ok(job) = next else { return };
        let outcome = run(model, batch, &job);
        // A client that went away reads nothing: its answer is dropped.
        let _ = job.reply.send(outcome);
    }
}

/// One job's stream in the batch.
fn run(model: &Model, batch: &StreamBatch<'_>, job: &Job) -> Outcome {
    let gone = || job.cancelled.load(Ordering::Relaxed) || Instant::now() >= job.deadline;
    if gone() {
        return Outcome::Gone;
    }
    let prompt = match model.encode(&job.prompt) {
        Ok(prompt) => prompt,
        Err(e) => return Outcome::BadPrompt(format!("the prompt: {e}")),
    };
    let wait = job.deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let mut stream = match batch.join_timeout(&prompt, job.sampling, wait) {
        Ok(stream) => stream,
        Err(e) => return Outcome::Refused(e),
    };
    let mut out = Vec::with_capacity(job.tokens);
    for _ in 0..job.tokens {
        if gone() {
            // No one reads the answer: the stream ends, its slot is free.
            return Outcome::Gone;
        }
        match stream.next_token() {
            Ok(token) => out.push(token),
            Err(e) => return Outcome::Refused(e),
        }
    }
    Outcome::Tokens(out)
}
