//! The prefetcher: its builder, the consumer's `next()`, and the lifecycle of the
//! producer thread (one per epoch: started by `build()` and `reset()`, stopped and
//! joined by `stop()`, `reset()` and drop).

use std::mem;
use std::ptr::NonNull;

use workspace_core::{ArenaBackend, Block, HostBackend, WorkspaceMode};

use crate::error::{panic_message, Error};
use crate::handoff::Shared;
use crate::lease::{Consumer, Lease, Polled};
use crate::producer::Producer;
use crate::ring::Ring;
use crate::source::BatchSource;
use crate::stats::PrefetchStats;
use crate::sync::{self, Arc, JoinHandle};

/// The largest prefetch depth a builder accepts.
pub const MAX_DEPTH: usize = 1024;

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

    /// The memory backend of the ring (default `HostBackend::Ram`). Any backend whose
    /// blocks are host memory works, such as a pinned-memory backend.
    pub fn backend<B2>(self, backend: B2) -> PrefetcherBuilder<S, B2> {
        let PrefetcherBuilder { source, depth, workspace_mode, headroom, max_ring_bytes, threading, .. } = self;
        PrefetcherBuilder { source, backend, depth, workspace_mode, headroom, max_ring_bytes, threading }
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
            threading: self.threading,
            workspace_mode: self.workspace_mode,
            depth: self.depth,
        };
        prefetcher.start(Producer::new(self.source, ring))?;
        Ok(prefetcher)
    }
}

/// Where the producer's state is.
enum ProducerState<S, B: ArenaBackend> {
    /// Not running: shield mode, or between epochs.
    Idle(Producer<S, B>),
    /// Running an epoch on its thread.
    Running(JoinHandle<Producer<S, B>>),
    /// Gone: the thread could not be started or joined.
    Lost(String),
}

/// Batches filled ahead by a producer into a ring workspace; see the [crate docs](crate).
///
/// `next()` is a lending iterator: each [`Lease`] borrows the prefetcher and must be
/// dropped (or [detached](Lease::detach)) before the next batch.
pub struct Prefetcher<S, B: ArenaBackend = HostBackend> {
    consumer: Consumer,
    producer: ProducerState<S, B>,
    /// The producer reported a panic of async-iter's own code; its state is kept
    /// (it owns the ring) but never run again.
    poisoned: bool,
    threading: Threading,
    workspace_mode: WorkspaceMode,
    depth: usize,
}

impl<S: BatchSource> Prefetcher<S, HostBackend> {
    /// A builder with the defaults: depth 2, workspaces enabled, no headroom, no ring
    /// limit, background thread, host RAM.
    pub fn builder(source: S) -> PrefetcherBuilder<S, HostBackend> {
        PrefetcherBuilder {
            source,
            backend: HostBackend::Ram,
            depth: 2,
            workspace_mode: WorkspaceMode::Enabled,
            headroom: 0.0,
            max_ring_bytes: None,
            threading: Threading::Background,
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
                self.join();
                self.poisoned |= matches!(outcome, Some(Error::ProducerLost { .. }));
                outcome.map(Err)
            }
            Polled::Ended => None,
        }
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
    /// [`Error::ProducerLost`] when the producer cannot run again; [`Error::Spawn`].
    pub fn reset(&mut self) -> Result<(), Error> {
        self.stop();
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
        match sync::spawn(move || producer.run(shared)) {
            Ok(handle) => {
                self.producer = ProducerState::Running(handle);
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
    pub fn stop(&mut self) {
        if let ProducerState::Running(_) = self.producer {
            self.consumer.shared.request_stop();
            self.join();
        }
        self.consumer.end();
    }

    /// Joins the producer thread, if it runs (it has finished or been asked to stop).
    fn join(&mut self) {
        if let ProducerState::Running(_) = self.producer {
            let ProducerState::Running(handle) = mem::replace(&mut self.producer, ProducerState::Lost(String::new()))
            else {
                unreachable!("matched above")
            };
            self.producer = match handle.join() {
                Ok(producer) => ProducerState::Idle(producer),
                Err(payload) => {
                    ProducerState::Lost(format!("its thread panicked: {}", panic_message(payload.as_ref())))
                }
            };
        }
    }

    /// A snapshot of the statistics (cheap: a few relaxed loads).
    pub fn stats(&self) -> PrefetchStats {
        let threading = match self.threading {
            Threading::Background => "background",
            Threading::Shield => "shield",
        };
        let mode = match self.workspace_mode {
            WorkspaceMode::Enabled => "enabled",
            WorkspaceMode::None => "none",
        };
        PrefetchStats::snapshot(&self.consumer.shared.counters, threading, mode, self.depth, self.consumer.epoch())
    }

    /// The current epoch (0 for the first).
    pub fn epoch(&self) -> u64 {
        self.consumer.epoch()
    }
}

impl<S, B: ArenaBackend> Drop for Prefetcher<S, B> {
    fn drop(&mut self) {
        self.stop();
    }
}

impl<S, B: ArenaBackend> std::fmt::Debug for Prefetcher<S, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefetcher").field("stats", &self.stats()).finish_non_exhaustive()
    }
}
