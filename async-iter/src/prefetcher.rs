//! The prefetcher: its builder, the consumer's `next()`, and the lifecycle of the
//! producer thread (one per epoch: started by `build()` and `reset()`, stopped and
//! joined by `stop()`, `reset()` and drop, each waiting at most the join timeout).

use std::mem;
use std::ptr::NonNull;
use std::time::Duration;

use workspace_core::backend::{ArenaBackend, Block, HostBackend};
use workspace_core::WorkspaceMode;

use crate::error::{drop_quietly, Error};
use crate::handoff::{Exit, Shared};
use crate::lease::{Consumer, Lease, Polled};
use crate::producer::Producer;
use crate::ring::Ring;
use crate::source::BatchSource;
use crate::stats::{Position, PrefetchStats};
use crate::sync::{self, Arc, Deadline, JoinHandle};

/// The largest prefetch depth a builder accepts.
pub const MAX_DEPTH: usize = 1024;

/// How long stopping, resetting or dropping waits for the producer thread by default.
const DEFAULT_JOIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Where batches are produced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Threading {
    /// On a producer thread that runs ahead of the consumer (the default).
    #[default]
    Background,
    /// Inline, in the consumer's `next()`: no thread, no overlap, the same API and
    /// the same ring. For debugging a source (its panics and backtraces happen on the
    /// caller's thread) and as the serial baseline.
    Shield,
}

/// Configures a [`Prefetcher`]; from [`Prefetcher::builder`].
///
/// ```
/// use async_iter::{Prefetcher, Threading};
/// use std::time::Duration;
/// use workspace_core::WorkspaceMode;
/// # use async_iter::{BatchLayout, BatchMut, BatchSource, SourceError};
/// # struct Empty;
/// # impl BatchSource for Empty {
/// #     fn next_layout(&mut self, _: usize) -> Result<Option<BatchLayout>, SourceError> { Ok(None) }
/// #     fn fill(&mut self, _: &mut BatchMut<'_>) -> Result<(), SourceError> { Ok(()) }
/// # }
///
/// let batches = Prefetcher::builder(Empty)
///     .depth(3)                                 // batches ready ahead (default 2)
///     .workspace_mode(WorkspaceMode::Enabled)   // ring memory (default); None: heap per batch
///     .headroom(0.25)                           // slots 25% larger than the first batch
///     .max_ring_bytes(1 << 30)                  // refuse batches that need a larger ring
///     .threading(Threading::Background)         // or Shield: no thread, for debugging
///     .join_timeout(Duration::from_secs(1))     // longest wait for a source stuck in a call
///     .build()?;
/// assert_eq!(batches.stats().slots, 4);
/// # Ok::<(), async_iter::Error>(())
/// ```
#[derive(Debug)]
#[must_use = "a builder does nothing until `build()`"]
pub struct PrefetcherBuilder<S, B = HostBackend> {
    source: S,
    backend: B,
    depth: usize,
    workspace_mode: WorkspaceMode,
    headroom: f64,
    max_ring_bytes: Option<usize>,
    threading: Threading,
    join_timeout: Duration,
}

impl<S, B> PrefetcherBuilder<S, B> {
    /// Batches the producer may have ready or in progress ahead of the one the
    /// consumer holds (default 2; 1 to [`MAX_DEPTH`]). The ring has `depth + 1` slots.
    pub fn depth(mut self, depth: usize) -> Self {
        self.depth = depth;
        self
    }

    /// `Enabled` (default): batches live in the ring. `None`: every batch is a fresh
    /// heap allocation, freed when released (the baseline workspaces are measured
    /// against).
    pub fn workspace_mode(mut self, mode: WorkspaceMode) -> Self {
        self.workspace_mode = mode;
        self
    }

    /// Extra room per slot, as a fraction of the batch that sizes it (default 0: a
    /// slot is exactly the first batch). Later batches up to `1 + headroom` times the
    /// first fit without growing the ring. Finite and at least 0.
    pub fn headroom(mut self, headroom: f64) -> Self {
        self.headroom = headroom;
        self
    }

    /// The largest ring allowed, in bytes (default: no limit). A batch that would
    /// need more ends the epoch with [`Error::BatchTooLarge`].
    pub fn max_ring_bytes(mut self, bytes: usize) -> Self {
        self.max_ring_bytes = Some(bytes);
        self
    }

    /// Background producer thread (default) or [`Threading::Shield`].
    pub fn threading(mut self, threading: Threading) -> Self {
        self.threading = threading;
        self
    }

    /// How long [`stop`](Prefetcher::stop), [`reset`](Prefetcher::reset) and dropping
    /// the prefetcher wait for the producer thread to end (default 5 s).
    ///
    /// The producer checks for a stop between calls into the source, so this bounds
    /// the wait for a call in progress. A source still inside a call when it expires
    /// makes `stop` and `reset` return [`Error::SourceStuck`] and makes the drop return
    /// anyway; see [`Prefetcher`] for what becomes of the thread. `Duration::ZERO`
    /// never waits: stopping then succeeds only if the thread has already ended.
    pub fn join_timeout(mut self, timeout: Duration) -> Self {
        self.join_timeout = timeout;
        self
    }

    /// The memory backend of the ring (default `HostBackend::Ram`). Any backend whose
    /// blocks are host memory works, such as a pinned-memory backend.
    pub fn backend<B2>(self, backend: B2) -> PrefetcherBuilder<S, B2> {
        let PrefetcherBuilder {
            source, depth, workspace_mode, headroom, max_ring_bytes, threading, join_timeout, ..
        } = self;
        PrefetcherBuilder { source, backend, depth, workspace_mode, headroom, max_ring_bytes, threading, join_timeout }
    }

    fn validate(&self) -> Result<(), Error> {
        let invalid = |reason: String| Err(Error::InvalidConfig { reason });
        if !(1..=MAX_DEPTH).contains(&self.depth) {
            return invalid(format!("depth is {}, it must be between 1 and {MAX_DEPTH}", self.depth));
        }
        if !self.headroom.is_finite() || self.headroom < 0.0 {
            return invalid(format!("headroom is {}, it must be a finite fraction of at least 0", self.headroom));
        }
        if self.max_ring_bytes == Some(0) {
            return invalid("max_ring_bytes is 0; leave it unset for no limit".into());
        }
        Ok(())
    }
}

impl<S, B> PrefetcherBuilder<S, B>
where
    S: BatchSource,
    B: ArenaBackend + 'static,
    B::Block: Block<Base = NonNull<u8>>,
{
    /// Builds the prefetcher and starts the first epoch (in background mode the
    /// producer thread starts filling at once).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a depth of 0 or above [`MAX_DEPTH`], a headroom
    /// that is negative or not finite, or a `max_ring_bytes` of 0;
    /// [`Error::Spawn`] when the thread cannot start.
    pub fn build(self) -> Result<Prefetcher<S, B>, Error> {
        self.validate()?;
        let slots = self.depth + 1;
        let ring = Ring::new(self.backend, self.workspace_mode, slots, self.headroom, self.max_ring_bytes);
        let mut prefetcher = Prefetcher {
            consumer: Consumer::new(Arc::new(Shared::new(slots))),
            producer: ProducerState::Lost("not started".into()),
            poisoned: false,
            stuck: false,
            threading: self.threading,
            workspace_mode: self.workspace_mode,
            depth: self.depth,
            join_timeout: self.join_timeout,
        };
        prefetcher.start(Producer::new(self.source, ring))?;
        Ok(prefetcher)
    }
}

/// Where the producer's state is.
enum ProducerState<S, B: ArenaBackend> {
    /// Not running: shield mode, or between epochs.
    Idle(Producer<S, B>),
    /// Running an epoch on its thread, which owns it until it hands it back.
    Running(ProducerThread<Producer<S, B>>),
    /// Gone: the thread could not be started.
    Lost(String),
}

/// A producer thread, and the way its state comes back.
struct ProducerThread<T> {
    handle: JoinHandle<()>,
    exit: Arc<Exit<T>>,
}

/// Batches filled ahead by a producer into a ring workspace; see the [crate docs](crate).
///
/// `next()` is a lending iterator: each [`Lease`] borrows the prefetcher and must be
/// dropped (or [detached](Lease::detach)) before the next batch.
///
/// # A source that does not return
///
/// The producer thread owns the source and the ring while it runs an epoch, and checks
/// for a stop between calls into the source. [`stop`](Self::stop),
/// [`reset`](Self::reset) and dropping the prefetcher ask it to stop and wait at most
/// the [`join_timeout`](PrefetcherBuilder::join_timeout) (5 s by default) for it to
/// end. When a source is stuck inside a call (`fill` waiting on a network read that
/// never completes, say):
///
/// - `stop()` and `reset()` return [`Error::SourceStuck`], naming the source, the
///   call, the batch and the time waited. The epoch is over (`next()` returns `None`),
///   and the prefetcher stays usable: each later `reset()` (or `stop()`) waits for the
///   thread again, fails the same way while the source is still stuck, and starts the
///   next epoch, in the same ring, once it has returned.
/// - Dropping the prefetcher returns after that wait, or at once if an earlier `stop()`
///   or `reset()` already timed out. The thread is then detached: it finishes on its
///   own when the source returns, and the source and the ring memory it writes into are
///   released when it ends, not before. A source that never returns keeps its thread
///   and its ring for the life of the process.
///
/// In [`Threading::Shield`] the source runs inside `next()`, on the caller's thread,
/// so a stuck source blocks that call instead.
pub struct Prefetcher<S, B: ArenaBackend = HostBackend> {
    consumer: Consumer,
    producer: ProducerState<S, B>,
    /// The producer reported a panic of async-iter's own code; its state is kept
    /// (it owns the ring) but never run again.
    poisoned: bool,
    /// The producer was asked to stop and did not within `join_timeout`: a drop does
    /// not wait for it again.
    stuck: bool,
    threading: Threading,
    workspace_mode: WorkspaceMode,
    depth: usize,
    join_timeout: Duration,
}

impl<S: BatchSource> Prefetcher<S, HostBackend> {
    /// A builder with the defaults: depth 2, workspaces enabled, no headroom, no ring
    /// limit, background thread, host RAM, a join timeout of 5 s.
    pub fn builder(source: S) -> PrefetcherBuilder<S, HostBackend> {
        PrefetcherBuilder {
            source,
            backend: HostBackend::Ram,
            depth: 2,
            workspace_mode: WorkspaceMode::Enabled,
            headroom: 0.0,
            max_ring_bytes: None,
            threading: Threading::Background,
            join_timeout: DEFAULT_JOIN_TIMEOUT,
        }
    }
}

impl<S, B> Prefetcher<S, B>
where
    S: BatchSource,
    B: ArenaBackend + 'static,
    B::Block: Block<Base = NonNull<u8>>,
{
    /// The next batch of the epoch, waiting for the producer if it is not ready.
    ///
    /// Returns `None` at the end of the epoch, `Some(Err)` once when the source failed
    /// or panicked (at the batch where it did, after every earlier batch) and `None`
    /// after that, until [`reset`](Self::reset) starts a new epoch.
    ///
    /// The lease borrows the prefetcher; dropping it returns its slot to the producer.
    ///
    /// # Errors
    ///
    /// [`Error::Source`] and [`Error::SourcePanicked`] from the source,
    /// [`Error::InvalidLayout`] for a layout that cannot be laid out,
    /// [`Error::BatchTooLarge`] and [`Error::Backend`] when the ring cannot hold the
    /// batch, [`Error::ProducerLost`] if the producer thread died.
    #[allow(clippy::should_implement_trait)] // a lending iterator: `Iterator` cannot lend
    pub fn next(&mut self) -> Option<Result<Lease<'_>, Error>> {
        self.consumer.settle();
        if let (Threading::Shield, ProducerState::Idle(producer), false) =
            (self.threading, &mut self.producer, self.consumer.ended())
        {
            producer.step(&self.consumer.shared);
        }
        match self.consumer.poll() {
            Polled::Batch => Some(Ok(self.consumer.lease())),
            Polled::Done(outcome) => {
                // The producer has raised DONE and only hands its state back now. If
                // that took longer than the timeout (an overloaded machine), the next
                // stop, reset or drop waits again.
                self.join(self.join_timeout);
                self.poisoned |= matches!(outcome, Some(Error::ProducerLost { .. }));
                outcome.map(Err)
            }
            Polled::Ended => None,
        }
    }

    /// Whether [`next`](Self::next) would return without waiting: the next batch (or the
    /// end of the epoch) is there. With a background producer this is a look at the
    /// hand-off; in [`Threading::Shield`] mode `next()` fills the batch itself, so this
    /// is false until the epoch ends. The slots of leases that ended go back to the
    /// producer first, as in `next()`.
    ///
    /// For a consumer that has something better to do than wait (the device prefetcher
    /// stages the next batch's copy ahead only when it is ready, so that a source that
    /// produces a batch only after the one before it was used is never waited for).
    pub fn ready(&mut self) -> bool {
        self.consumer.settle();
        self.consumer.ready()
    }

    /// Calls `f` on every remaining batch of the epoch, stopping at the first error
    /// (of the prefetcher, converted with `From`, or of `f`).
    ///
    /// # Errors
    ///
    /// The first error of [`next`](Self::next) or of `f`.
    pub fn try_for_each<E, F>(&mut self, mut f: F) -> Result<(), E>
    where
        E: From<Error>,
        F: FnMut(Lease<'_>) -> Result<(), E>,
    {
        while let Some(batch) = self.next() {
            f(batch?)?;
        }
        Ok(())
    }

    /// Ends the current epoch, early or not, and starts the next one from the first
    /// batch, reusing the ring (its size and growth are kept).
    ///
    /// # Errors
    ///
    /// [`Error::Source`] or [`Error::SourcePanicked`] from the source's `reset` (the
    /// new epoch then has no batches; `reset` may be called again);
    /// [`Error::SourceStuck`] when the producer thread did not end within the join
    /// timeout (no epoch starts; `reset` may be called again, see [`Prefetcher`]);
    /// [`Error::ProducerLost`] when the producer cannot run again; [`Error::Spawn`].
    pub fn reset(&mut self) -> Result<(), Error> {
        self.stop()?;
        let mut producer = match mem::replace(&mut self.producer, ProducerState::Lost(String::new())) {
            ProducerState::Idle(producer) if !self.poisoned => producer,
            ProducerState::Idle(producer) => {
                self.producer = ProducerState::Idle(producer);
                return Err(Error::ProducerLost { detail: "it panicked in an earlier epoch".into() });
            }
            ProducerState::Lost(detail) => {
                self.producer = ProducerState::Lost(detail.clone());
                return Err(Error::ProducerLost { detail });
            }
            ProducerState::Running(_) => unreachable!("stop() joins the producer"),
        };
        let epoch = self.consumer.epoch() + 1;
        self.consumer.shared.reset_epoch();
        self.consumer.start_epoch(epoch);
        if let Err(err) = producer.reset(epoch) {
            self.consumer.end();
            self.producer = ProducerState::Idle(producer);
            return Err(err);
        }
        self.start(producer)
    }

    fn start(&mut self, producer: Producer<S, B>) -> Result<(), Error> {
        if self.threading == Threading::Shield {
            self.producer = ProducerState::Idle(producer);
            return Ok(());
        }
        let shared = self.consumer.shared.clone();
        let exit = Arc::new(Exit::new());
        let way_back = exit.clone();
        let spawned = sync::spawn("carve-prefetch", move || {
            let producer = producer.run(&shared);
            if let Some(abandoned) = way_back.hand_back(producer) {
                // The prefetcher is gone: the source and the ring go with this thread.
                // The source's destructor is user code, and this thread has nobody to
                // report a panic to.
                drop_quietly(abandoned);
            }
            // Possibly the last owners, holding an unreported error of the source.
            drop_quietly((shared, way_back));
        });
        match spawned {
            Ok(handle) => {
                self.producer = ProducerState::Running(ProducerThread { handle, exit });
                Ok(())
            }
            Err(source) => {
                self.consumer.end();
                self.producer = ProducerState::Lost(format!("its thread could not be started: {source}"));
                Err(Error::Spawn { source })
            }
        }
    }
}

impl<S, B: ArenaBackend> Prefetcher<S, B> {
    /// Ends the epoch early: the producer stops after the call into the source in
    /// progress (if any) and its thread is joined. `next()` then returns `None` until
    /// [`reset`](Self::reset). Dropping the prefetcher does the same.
    ///
    /// # Errors
    ///
    /// [`Error::SourceStuck`] when the producer thread did not end within the join
    /// timeout; the epoch is over all the same (see [`Prefetcher`]).
    pub fn stop(&mut self) -> Result<(), Error> {
        self.consumer.end();
        if let ProducerState::Running(_) = self.producer {
            self.consumer.shared.request_stop();
            if !self.join(self.join_timeout) {
                self.stuck = true;
                return Err(self.stuck_error());
            }
        }
        Ok(())
    }

    /// Whether the producer thread did not end within the join timeout at the last
    /// [`stop`](Self::stop) or [`reset`](Self::reset) and has not been joined since:
    /// dropping the prefetcher then detaches it without waiting again.
    pub fn is_stuck(&self) -> bool {
        self.stuck && matches!(self.producer, ProducerState::Running(_))
    }

    /// Waits up to `timeout` for the running producer (finished, or asked to stop) to
    /// hand its state back, then joins its thread. False when it did not in time: it
    /// keeps running, and its state.
    fn join(&mut self, timeout: Duration) -> bool {
        let ProducerState::Running(thread) = &self.producer else { return true };
        let Some(producer) = thread.exit.wait(Deadline::after(timeout)) else { return false };
        let ProducerState::Running(thread) = mem::replace(&mut self.producer, ProducerState::Idle(producer)) else {
            unreachable!("matched above")
        };
        // The thread handed its state back as its last act, so this returns at once
        // (after the destructors of thread-locals the source may have set on it).
        if let Err(payload) = thread.handle.join() {
            drop_quietly(payload);
        }
        self.stuck = false;
        true
    }

    fn stuck_error(&self) -> Error {
        let Position { call, batch } = self.consumer.shared.counters.producer.position();
        let source_type = std::any::type_name::<S>();
        Error::SourceStuck { source_type, epoch: self.consumer.epoch(), batch, call, waited: self.join_timeout }
    }

    /// A snapshot of the statistics (cheap: a few relaxed loads).
    pub fn stats(&self) -> PrefetchStats {
        let threading = match self.threading {
            Threading::Background => "background",
            Threading::Shield => "shield",
        };
        // (The ring is not planned: under `Planned` it serves batches as under `Enabled`.)
        let mode = self.workspace_mode.name();
        PrefetchStats::snapshot(&self.consumer.shared.counters, threading, mode, self.depth, self.consumer.epoch())
    }

    /// The current epoch (0 for the first).
    pub fn epoch(&self) -> u64 {
        self.consumer.epoch()
    }
}

impl<S, B: ArenaBackend> Drop for Prefetcher<S, B> {
    fn drop(&mut self) {
        if let ProducerState::Idle(_) | ProducerState::Lost(_) = self.producer {
            return;
        }
        self.consumer.shared.request_stop();
        // After a stop that timed out, the caller has waited once already.
        let timeout = if self.stuck { Duration::ZERO } else { self.join_timeout };
        if self.join(timeout) {
            return;
        }
        let ProducerState::Running(thread) = mem::replace(&mut self.producer, ProducerState::Lost(String::new()))
        else {
            unreachable!("`join` leaves a producer that did not stop running")
        };
        match thread.exit.abandon() {
            // It handed its state back in the meantime, and ends at once.
            Some(producer) => {
                if let Err(payload) = thread.handle.join() {
                    drop_quietly(payload);
                }
                self.producer = ProducerState::Idle(producer);
            }
            // Detached: the thread drops the source and the ring when the source
            // returns. No lease is alive (a lease borrows the prefetcher), and nothing
            // the consumer holds points into the ring any more.
            None => drop(thread.handle),
        }
    }
}

impl<S, B: ArenaBackend> std::fmt::Debug for Prefetcher<S, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefetcher").field("stats", &self.stats()).finish_non_exhaustive()
    }
}
