//! `POST /generate` with continuous batching (`--stream-batch S`): the streams of the
//! requests in flight stepped together, S per arena, by one thread per arena.
//!
//! Each of the K threads (`--workers`) leases an arena of a pool of its own and keeps
//! [`StreamSlots`] of S slots in it (slots stay on the thread that made them). Between
//! two steps it ends the streams whose requests are answered, gone (their client
//! disconnected) or out of time, and starts the requests that wait in the queue in the
//! slots that came free; then one `next_tokens` runs every stream's next step as one
//! batch, whatever position each is at. A thread with no stream waits for the queue;
//! one with streams takes what is queued without waiting. So a request costs no thread
//! of its own and a token no wake-up, and each request's text is still the model's own
//! for its prompt (a stream draws the bits it draws alone). The route hands a request
//! to the threads through a bounded queue and awaits its answer on a oneshot channel, so
//! no runtime thread ever waits on a step.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use carve::nn::serve::{InferencePool, Model, PoolConfig, Sampling, StreamSlots};
use tokio::sync::oneshot;

/// One request's generation.
pub(crate) struct Job {
    /// The prompt's tokens (its last `context`: a stream keeps no more).
    pub(crate) prompt: Vec<u32>,
    pub(crate) tokens: usize,
    pub(crate) sampling: Sampling,
    pub(crate) deadline: Instant,
    /// Set when the request is gone (its client disconnected, or its time ran out).
    pub(crate) cancelled: Arc<AtomicBool>,
    pub(crate) reply: oneshot::Sender<Outcome>,
}

impl Job {
    fn gone(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed) || Instant::now() >= self.deadline
    }

    /// Sends `outcome` to the job's request (a client that went away reads nothing).
    fn answer(self, outcome: Outcome) {
        let _ = self.reply.send(outcome);
    }
}

/// How a job ended.
pub(crate) enum Outcome {
    /// The tokens drawn.
    Tokens(Vec<u32>),
    /// The stream was refused or failed alone (its logits were not finite): the route
    /// says which of these is the client's fault (none once its prompt is read).
    Refused(carve::Error),
    /// A step of its arena failed as a whole (a panicking layer, a workspace error):
    /// the server's fault.
    Failed(String),
    /// The request's time ran out, or its client went away.
    Gone,
}

/// Why a job was not queued.
pub(crate) enum NotQueued {
    /// The queue is full.
    Full,
    /// Every generation thread is gone.
    Gone,
}

/// The queue to the generation threads.
pub(crate) struct Batcher {
    jobs: SyncSender<Job>,
    slots: usize,
    arenas: usize,
    /// The pool whose arenas the threads hold (for its statistics).
    pool: Arc<InferencePool>,
}

impl Batcher {
    /// `arenas` threads, each with stream slots of `slots` slots in an arena of a pool
    /// of their own over `model`, and a queue of at most `queue` waiting jobs.
    ///
    /// # Errors
    ///
    /// The pool's or the slots' error (the model cannot generate, or the slots' caches
    /// cannot be held), or a thread's.
    pub(crate) fn start(
        model: Arc<Model>,
        arenas: usize,
        slots: usize,
        queue: usize,
    ) -> Result<Batcher, Box<dyn std::error::Error>> {
        let (jobs, waiting) = sync_channel::<Job>(queue.max(1));
        let waiting = Arc::new(Mutex::new(waiting));
        let pool = Arc::new(InferencePool::new(model, PoolConfig::direct(arenas))?);
        let (ready, started) = sync_channel::<Result<(), String>>(arenas);
        for i in 0..arenas {
            let (pool, waiting, ready) = (Arc::clone(&pool), Arc::clone(&waiting), ready.clone());
            std::thread::Builder::new().name(format!("generate-{i}")).spawn(move || {
                let mut streams = match pool.stream_slots(slots) {
                    Ok(streams) => streams,
                    Err(e) => return drop(ready.send(Err(e.to_string()))),
                };
                // Dropped once sent: a thread that dies before it says so ends the wait.
                let _ = ready.send(Ok(()));
                drop(ready);
                drive(&mut streams, &waiting);
            })?;
        }
        drop(ready);
        for _ in 0..arenas {
            started.recv().map_err(|_| "a generation thread ended before it started")??;
        }
        Ok(Batcher { jobs, slots, arenas, pool })
    }

    /// The slots of each arena.
    pub(crate) fn slots(&self) -> usize {
        self.slots
    }

    /// The arenas (and threads).
    pub(crate) fn arenas(&self) -> usize {
        self.arenas
    }

    /// The pool of the threads' arenas: its statistics count their memory (the stream
    /// slots' caches as `stream_bytes`), which the server's pool does not hold.
    pub(crate) fn pool(&self) -> &InferencePool {
        &self.pool
    }

    /// Queues `job`.
    pub(crate) fn submit(&self, job: Job) -> Result<(), NotQueued> {
        self.jobs.try_send(job).map_err(|e| match e {
            TrySendError::Full(_) => NotQueued::Full,
            TrySendError::Disconnected(_) => NotQueued::Gone,
        })
    }
}

/// A request in a slot, and the tokens it has drawn.
struct Running {
    job: Job,
    slot: usize,
    drawn: Vec<u32>,
}

/// A generation thread: steps its streams, taking queued jobs into free slots (one a
/// step while it has streams, so that a burst spreads over the threads), until the
/// queue is gone and its streams are done.
fn drive(streams: &mut StreamSlots<'_>, waiting: &Mutex<Receiver<Job>>) {
    let mut running: Vec<Running> = Vec::with_capacity(streams.slots());
    let mut out = streams.buffer();
    let mut open = true;
    loop {
        // Requests answered by now, or gone: their slots come free.
        let mut i = 0;
        while i < running.len() {
            let r = &running[i];
            if r.drawn.len() < r.job.tokens && !r.job.gone() {
                i += 1;
                continue;
            }
            let Running { job, slot, drawn } = running.swap_remove(i);
            let _ = streams.end(slot);
            let outcome = if drawn.len() == job.tokens { Outcome::Tokens(drawn) } else { Outcome::Gone };
            job.answer(outcome);
        }
        // Queued requests into the free slots: waiting for one when there is nothing to
        // step, taking one that is there otherwise.
        let mut admitted = false;
        while open && !admitted && running.len() < streams.slots() {
            let next = {
                // A thread that panicked holding the lock leaves it poisoned; the queue
                // itself is sound.
                let queue = if running.is_empty() {
                    waiting.lock().unwrap_or_else(|p| p.into_inner())
                } else {
                    match waiting.try_lock() {
                        Ok(queue) => queue,
                        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                        // Another thread waits on the queue: it takes what comes.
                        Err(std::sync::TryLockError::WouldBlock) => break,
                    }
                };
                if running.is_empty() {
                    // Woken now and then, so that a queue that is gone is seen.
                    match queue.recv_timeout(Duration::from_millis(100)) {
                        Ok(job) => Some(job),
                        Err(RecvTimeoutError::Timeout) => None,
                        Err(RecvTimeoutError::Disconnected) => {
                            open = false;
                            None
                        }
                    }
                } else {
                    match queue.try_recv() {
                        Ok(job) => Some(job),
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => {
                            open = false;
                            None
                        }
                    }
                }
            };
            let Some(job) = next else { continue };
            if job.gone() {
                job.answer(Outcome::Gone);
                continue;
            }
            match streams.start(&job.prompt, job.sampling) {
                Ok(slot) => {
                    admitted = true;
                    running.push(Running { drawn: Vec::with_capacity(job.tokens), job, slot });
                }
                Err(e @ carve::Error::Panicked { .. }) => job.answer(Outcome::Failed(e.to_string())),
                Err(e) => job.answer(Outcome::Refused(e)),
            }
        }
        if running.is_empty() {
            if open {
                continue;
            }
            return;
        }
        // One step of every stream; a stream that fails alone is answered with its
        // error, and every stream of a step that failed as a whole with the step's.
        let stepped = streams.next_tokens(&mut out);
        let whole = stepped.err().map(|e| e.to_string());
        let mut i = 0;
        while i < running.len() {
            let r = &mut running[i];
            match out[r.slot].take() {
                Some(Ok(token)) => r.drawn.push(token),
                Some(Err(e)) => {
                    let Running { job, slot, .. } = running.swap_remove(i);
                    let _ = streams.end(slot);
                    job.answer(match &whole {
                        Some(why) => Outcome::Failed(why.clone()),
                        None => Outcome::Refused(e),
                    });
                    continue;
                }
                None => {}
            }
            i += 1;
        }
    }
}
