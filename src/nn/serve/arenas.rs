//! K planned arenas, leased one request at a time from any thread (whose turn it is
//! with each: [`Turns`]).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use async_iter::panics::{drop_quietly, panic_message};
use workspace_core::planned::PortableMgr;
use workspace_core::LayerWorkspaceMgr;

use super::stack::ArenaStack;
pub(crate) use super::turns::{warms_up_while_holding, Counters, Wait};
use super::turns::{Turns, STARVING_AFTER};
use crate::nn::network::inference_builder;
use crate::{Error, Result};

/// K arenas, each a planned manager of the inference workspaces ([`PortableMgr`]),
/// leased by RAII ([`ArenaGuard`]).
#[derive(Debug)]
pub(crate) struct Arenas {
    slots: Box<[Mutex<Slot>]>,
    /// Each arena's capacity after its last request (for statistics without a lease).
    capacity: Box<[AtomicUsize]>,
    /// Each arena's stream buffers' bytes, as of its last stream's start.
    stream_bytes: Box<[AtomicUsize]>,
    /// Which arena is whose.
    turns: Turns,
    plans: usize,
    pub(crate) counters: Counters,
}

/// An arena: its planned manager, the stack its requests run on (none: they run on the
/// stack of the thread that runs them), and what its generation streams keep between
/// their steps.
#[derive(Debug)]
struct Slot {
    mgr: PortableMgr,
    stack: Option<ArenaStack>,
    streams: StreamBuffers,
}

/// What generation streams keep between their steps (their key/value caches, windows of
/// tokens and logits; laid out by `generate`): held by the arena that runs them, so that
/// the arena's next streams reuse it, and a stream's start allocates nothing once its
/// arena has run one as large.
#[derive(Default)]
pub(crate) struct StreamBuffers {
    pub(crate) values: Vec<f32>,
    pub(crate) tokens: Vec<u32>,
}

impl std::fmt::Debug for StreamBuffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamBuffers").field("bytes", &self.bytes()).finish()
    }
}

impl StreamBuffers {
    /// The buffers sized to `values` and `tokens` elements (their contents are the
    /// caller's to write), growing only when they are smaller.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] naming the bytes when the machine cannot give them.
    pub(crate) fn fit(&mut self, values: usize, tokens: usize) -> Result<()> {
        let short = |what: &str, bytes: usize| {
            Error::InvalidInput(format!("generation streams' {what} ({bytes} bytes) cannot be allocated"))
        };
        if values > self.values.len() {
            self.values
                .try_reserve_exact(values - self.values.len())
                .map_err(|_| short("caches and logits", values.saturating_mul(4)))?;
            self.values.resize(values, 0.0);
        }
        if tokens > self.tokens.len() {
            self.tokens
                .try_reserve_exact(tokens - self.tokens.len())
                .map_err(|_| short("windows of tokens", tokens.saturating_mul(4)))?;
            self.tokens.resize(tokens, 0);
        }
        Ok(())
    }

    /// The bytes held.
    pub(crate) fn bytes(&self) -> usize {
        (self.values.capacity() + self.tokens.capacity()) * 4
    }
}

/// The name of a serving arena's plan group (in statistics).
const GROUP: &str = "WS_PLANNED_SERVING";

fn arena(plans: usize) -> Result<PortableMgr> {
    Ok(PortableMgr::build(GROUP, plans, inference_builder(true))?)
}

impl Arenas {
    /// `k` arenas (at least one), each keeping up to `plans` plans (one per shape of
    /// request), and with a call stack of its own for its requests when `stacks` (see
    /// [`PoolConfig::arena_stacks`](super::PoolConfig::arena_stacks)). Nothing is
    /// reserved until the first request of a shape.
    pub(crate) fn new(k: usize, plans: usize, stacks: bool) -> Result<Arenas> {
        if k == 0 {
            return Err(Error::InvalidConfig { reason: "an inference pool needs at least one worker (arena)".into() });
        }
        let slots = (0..k)
            .map(|_| {
                let stack = if stacks { Some(ArenaStack::new()?) } else { None };
                Ok(Mutex::new(Slot { mgr: arena(plans)?, stack, streams: StreamBuffers::default() }))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Arenas {
            slots: slots.into_boxed_slice(),
            capacity: (0..k).map(|_| AtomicUsize::new(0)).collect(),
            stream_bytes: (0..k).map(|_| AtomicUsize::new(0)).collect(),
            turns: Turns::new(k, STARVING_AFTER),
            plans,
            counters: Counters::default(),
        })
    }

    /// The number of arenas (K).
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    /// The arenas' capacities summed, as of their last requests.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// The arenas' stream buffers' bytes summed (see [`StreamBuffers`]).
    pub(crate) fn stream_bytes(&self) -> usize {
        self.stream_bytes.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// Leases a free arena, waiting as `wait` says (see [`Turns`]).
    ///
    /// # Errors
    ///
    /// [`Error::PoolClosed`] once [`Arenas::close`] ran; [`Error::PoolBusy`] and
    /// [`Error::Timeout`] as `wait` says.
    pub(crate) fn lease(&self, wait: Wait) -> Result<ArenaGuard<'_>> {
        self.lease_by(wait, false)
    }

    /// [`Arenas::lease`] for a batch worker, which runs a batch of requests in the arena
    /// (see [`Arenas::all_held_by_callers`]).
    ///
    /// # Errors
    ///
    /// As [`Arenas::lease`].
    pub(crate) fn lease_for_batch(&self, wait: Wait) -> Result<ArenaGuard<'_>> {
        self.lease_by(wait, true)
    }

    fn lease_by(&self, wait: Wait, worker: bool) -> Result<ArenaGuard<'_>> {
        let index = self.turns.lease(wait, &self.counters, worker)?;
        self.counters.leases.fetch_add(1, Ordering::Relaxed);
        Ok(self.guard(index))
    }

    /// Whether callers hold every arena, no batch worker one (see
    /// [`Turns::all_held_by_callers`]).
    pub(crate) fn all_held_by_callers(&self) -> bool {
        self.turns.all_held_by_callers()
    }

    /// Whether the calling thread holds every arena (see [`Turns::all_held_here`]).
    pub(crate) fn all_held_here(&self) -> bool {
        self.turns.all_held_here()
    }

    /// Whether the calling thread holds any arena (see [`Turns::any_held_here`]).
    pub(crate) fn any_held_here(&self) -> bool {
        self.turns.any_held_here()
    }

    /// Arena `index` for a warm-up (see [`Turns::reserve`]).
    ///
    /// # Errors
    ///
    /// As [`Turns::reserve`].
    pub(crate) fn reserve(&self, index: usize) -> Result<ArenaGuard<'_>> {
        self.turns.reserve(index)?;
        Ok(self.guard(index))
    }

    fn guard(&self, index: usize) -> ArenaGuard<'_> {
        let slot = self.slots[index].lock().unwrap_or_else(PoisonError::into_inner);
        ArenaGuard { arenas: self, index, slot: Some(slot) }
    }

    /// Closes the arenas: waiting and later leases fail with [`Error::PoolClosed`];
    /// leases held go on to the end of their requests.
    pub(crate) fn close(&self) {
        self.turns.close();
    }
}

/// A leased arena: given back when dropped. A forgotten guard keeps its arena for good:
/// the pool has one arena fewer, a `warm_up` from another thread waits for it until the
/// pool is closed, and a request from the forgetting thread that would wait for it
/// without a deadline is refused.
#[derive(Debug)]
pub(crate) struct ArenaGuard<'a> {
    arenas: &'a Arenas,
    index: usize,
    slot: Option<MutexGuard<'a, Slot>>,
}

impl<'a> ArenaGuard<'a> {
    /// Runs `f` in the arena on this thread (on the arena's stack, when it has one). A
    /// panic in `f` is [`Error::Panicked`] (the scopes it held were closed as it
    /// unwound); an arena that `f` kept a reference to is replaced by a new one.
    pub(crate) fn run<R>(&mut self, f: impl FnOnce(&LayerWorkspaceMgr) -> Result<(R, bool)>) -> Result<R> {
        self.run_with_streams(|mgr, _| f(mgr))
    }

    /// [`ArenaGuard::run`] with the arena's stream buffers handed to `f` too.
    pub(crate) fn run_with_streams<R>(
        &mut self,
        f: impl FnOnce(&LayerWorkspaceMgr, &mut StreamBuffers) -> Result<(R, bool)>,
    ) -> Result<R> {
        let Slot { mgr, stack, streams } = &mut **self.slot.as_mut().expect("held until dropped");
        run_in(self.arenas, self.index, mgr, stack, streams, f)
    }

    /// The arena for a generation stream's life, its stream buffers moved out so that
    /// it can run on any thread (see [`StreamArena`]).
    pub(crate) fn into_streams(mut self) -> StreamArena<'a> {
        let streams = std::mem::take(&mut self.slot.as_mut().expect("held until dropped").streams);
        // The arena's lock is let go; its turn stays taken, now the stream arena's.
        drop(self.slot.take());
        let arena = StreamArena { arenas: self.arenas, index: self.index, streams };
        // Nothing is left to give back but the turn, which the stream arena holds now.
        std::mem::forget(self);
        arena
    }
}

/// Runs `f` in arena `index` (its manager `mgr`, its stack) with `streams`, as
/// [`ArenaGuard::run`] says.
fn run_in<R>(
    arenas: &Arenas,
    index: usize,
    slot: &mut PortableMgr,
    stack: &mut Option<ArenaStack>,
    streams: &mut StreamBuffers,
    f: impl FnOnce(&LayerWorkspaceMgr, &mut StreamBuffers) -> Result<(R, bool)>,
) -> Result<R> {
    let counters = &arenas.counters;
    let body = || {
        slot.with(|mgr| {
            let result = catch_unwind(AssertUnwindSafe(|| f(mgr, streams)));
            (result, mgr.capacity())
        })
    };
    // On the arena's stack, when it has one: what a request touches is then the
    // arena's, not its caller's.
    let ran = match stack {
        Some(stack) => stack.run(body),
        None => body(),
    };
    let result = match ran {
        Ok((Ok(Ok((value, on_plan))), capacity)) => {
            arenas.capacity[index].store(capacity, Ordering::Relaxed);
            let counter = if on_plan { &counters.on_plan } else { &counters.off_plan };
            counter.fetch_add(1, Ordering::Relaxed);
            Ok(value)
        }
        Ok((Ok(Err(e)), _)) => Err(e),
        Ok((Err(payload), _)) => {
            counters.panics.fetch_add(1, Ordering::Relaxed);
            let message = panic_message(&*payload);
            drop_quietly(payload);
            Err(Error::Panicked { message })
        }
        Err(e) => Err(e.into()),
    };
    if slot.is_kept() {
        // Replaces an arena a request kept a reference to (leaked on its thread).
        if let Ok(fresh) = arena(arenas.plans) {
            *slot = fresh;
            arenas.capacity[index].store(0, Ordering::Relaxed);
            arenas.counters.rebuilt.fetch_add(1, Ordering::Relaxed);
        }
    }
    result
}

/// A leased arena held for generation streams' life (a pool's [`TokenStream`] or
/// [`StreamBatch`](super::StreamBatch)): its turn taken, its stream buffers moved out
/// and owned here, and its manager locked only while a step runs, so that the streams'
/// steps may run on any thread (a stream batch's run on whichever caller combines
/// them). The buffers go back to the arena, and the turn to the pool, when it is
/// dropped; forgotten, it keeps the arena for good, as a forgotten lease does, and its
/// buffers with it.
///
/// [`TokenStream`]: super::TokenStream
#[derive(Debug)]
pub(crate) struct StreamArena<'a> {
    arenas: &'a Arenas,
    index: usize,
    streams: StreamBuffers,
}

impl StreamArena<'_> {
    /// The stream buffers, sized to hold `values` and `tokens` elements.
    ///
    /// # Errors
    ///
    /// As [`StreamBuffers::fit`].
    pub(crate) fn stream_buffers(&mut self, values: usize, tokens: usize) -> Result<&mut StreamBuffers> {
        self.streams.fit(values, tokens)?;
        self.arenas.stream_bytes[self.index].store(self.streams.bytes(), Ordering::Relaxed);
        Ok(&mut self.streams)
    }

    /// The stream buffers as they are.
    pub(crate) fn streams(&self) -> &StreamBuffers {
        &self.streams
    }

    /// The stream buffers as they are, to write.
    pub(crate) fn streams_mut(&mut self) -> &mut StreamBuffers {
        &mut self.streams
    }

    /// [`ArenaGuard::run_with_streams`] on this thread: the arena's manager locked for the
    /// step (the turn is this stream arena's: no one else takes the lock).
    pub(crate) fn run_with_streams<R>(
        &mut self,
        f: impl FnOnce(&LayerWorkspaceMgr, &mut StreamBuffers) -> Result<(R, bool)>,
    ) -> Result<R> {
        let mut slot = self.arenas.slots[self.index].lock().unwrap_or_else(PoisonError::into_inner);
        let Slot { mgr, stack, .. } = &mut *slot;
        run_in(self.arenas, self.index, mgr, stack, &mut self.streams, f)
    }
}

impl Drop for StreamArena<'_> {
    fn drop(&mut self) {
        let mut slot = self.arenas.slots[self.index].lock().unwrap_or_else(PoisonError::into_inner);
        slot.streams = std::mem::take(&mut self.streams);
        drop(slot);
        self.arenas.turns.give_back(self.index);
    }
}

impl Drop for ArenaGuard<'_> {
    fn drop(&mut self) {
        drop(self.slot.take());
        self.arenas.turns.give_back(self.index);
    }
}
