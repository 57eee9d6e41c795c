//! K planned arenas, leased one request at a time from any thread.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use async_iter::panics::{drop_quietly, panic_message};
use workspace_core::planned::PortableMgr;
use workspace_core::LayerWorkspaceMgr;

use crate::nn::network::inference_builder;
use crate::{Error, Result};

/// How long a lease may wait for an arena.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Wait {
    /// Not at all: [`Error::PoolBusy`].
    No,
    /// Until one comes free (or the arenas close).
    Forever,
    /// At most this long: [`Error::Timeout`].
    For(Duration),
}

/// What the arenas count (all monotonic, read without locking).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) leases: AtomicU64,
    pub(crate) waited: AtomicU64,
    pub(crate) busy: AtomicU64,
    pub(crate) timeouts: AtomicU64,
    pub(crate) panics: AtomicU64,
    pub(crate) rebuilt: AtomicU64,
    pub(crate) on_plan: AtomicU64,
    pub(crate) off_plan: AtomicU64,
}

/// The free list.
#[derive(Debug)]
struct Free {
    /// Indices of the arenas no lease holds (capacity K: pushing never allocates).
    stack: Vec<usize>,
    closed: bool,
    waiting: usize,
}

/// K arenas, each a planned manager of the inference workspaces ([`PortableMgr`]),
/// leased by RAII ([`ArenaGuard`]).
#[derive(Debug)]
pub(crate) struct Arenas {
    slots: Box<[Mutex<PortableMgr>]>,
    /// Each arena's capacity after its last request (for statistics without a lease).
    capacity: Box<[AtomicUsize]>,
    free: Mutex<Free>,
    freed: Condvar,
    plans: usize,
    pub(crate) counters: Counters,
}

/// The name of a serving arena's plan group (in statistics).
const GROUP: &str = "WS_PLANNED_SERVING";

fn arena(plans: usize) -> Result<PortableMgr> {
    Ok(PortableMgr::build(GROUP, plans, inference_builder(true))?)
}

impl Arenas {
    /// `k` arenas (at least one), each keeping up to `plans` plans (one per shape of
    /// request). Nothing is reserved until the first request of a shape.
    pub(crate) fn new(k: usize, plans: usize) -> Result<Arenas> {
        if k == 0 {
            return Err(Error::InvalidConfig { reason: "an inference pool needs at least one worker (arena)".into() });
        }
        let slots = (0..k).map(|_| arena(plans).map(Mutex::new)).collect::<Result<Vec<_>>>()?;
        Ok(Arenas {
            slots: slots.into_boxed_slice(),
            capacity: (0..k).map(|_| AtomicUsize::new(0)).collect(),
            free: Mutex::new(Free { stack: (0..k).rev().collect(), closed: false, waiting: 0 }),
            freed: Condvar::new(),
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

    fn free(&self) -> MutexGuard<'_, Free> {
        self.free.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Leases a free arena, waiting as `wait` says.
    ///
    /// # Errors
    ///
    /// [`Error::PoolClosed`] once [`Arenas::close`] ran; [`Error::PoolBusy`] and
    /// [`Error::Timeout`] as `wait` says.
    pub(crate) fn lease(&self, wait: Wait) -> Result<ArenaGuard<'_>> {
        let mut free = self.free();
        let index = loop {
            if free.closed {
                return Err(Error::PoolClosed);
            }
            if let Some(index) = free.stack.pop() {
                break index;
            }
            free = self.wait(free, wait)?;
        };
        drop(free);
        self.counters.leases.fetch_add(1, Ordering::Relaxed);
        let slot = self.slots[index].lock().unwrap_or_else(PoisonError::into_inner);
        Ok(ArenaGuard { arenas: self, index, slot: Some(slot) })
    }

    /// Waits for an arena to come free (or the close), as `wait` says.
    #[cold]
    fn wait<'a>(&self, mut free: MutexGuard<'a, Free>, wait: Wait) -> Result<MutexGuard<'a, Free>> {
        let arenas = self.len();
        self.counters.waited.fetch_add(1, Ordering::Relaxed);
        let start = Instant::now();
        loop {
            match wait {
                Wait::No => {
                    self.counters.busy.fetch_add(1, Ordering::Relaxed);
                    return Err(Error::PoolBusy { arenas });
                }
                Wait::Forever => {
                    free.waiting += 1;
                    free = self.freed.wait(free).unwrap_or_else(PoisonError::into_inner);
                    free.waiting -= 1;
                }
                Wait::For(timeout) => {
                    let waited = start.elapsed();
                    if waited >= timeout {
                        self.counters.timeouts.fetch_add(1, Ordering::Relaxed);
                        return Err(Error::Timeout { arenas, waited });
                    }
                    free.waiting += 1;
                    free = self.freed.wait_timeout(free, timeout - waited).unwrap_or_else(PoisonError::into_inner).0;
                    free.waiting -= 1;
                }
            }
            if free.closed || !free.stack.is_empty() {
                return Ok(free);
            }
        }
    }

    /// Closes the arenas: waiting and later leases fail with [`Error::PoolClosed`];
    /// leases held go on to the end of their requests.
    pub(crate) fn close(&self) {
        self.free().closed = true;
        self.freed.notify_all();
    }

    fn give_back(&self, index: usize) {
        let mut free = self.free();
        free.stack.push(index);
        let waiting = free.waiting > 0;
        drop(free);
        if waiting {
            self.freed.notify_one();
        }
    }
}

/// A leased arena: given back when dropped (a forgotten guard keeps its arena for
/// good: the pool then has one arena fewer, nothing else).
#[derive(Debug)]
pub(crate) struct ArenaGuard<'a> {
    arenas: &'a Arenas,
    index: usize,
    slot: Option<MutexGuard<'a, PortableMgr>>,
}

impl ArenaGuard<'_> {
    /// Runs `f` in the arena on this thread. A panic in `f` is [`Error::Panicked`]
    /// (the scopes it held were closed as it unwound); an arena that `f` kept a
    /// reference to is replaced by a new one.
    pub(crate) fn run<R>(&mut self, f: impl FnOnce(&LayerWorkspaceMgr) -> Result<(R, bool)>) -> Result<R> {
        let counters = &self.arenas.counters;
        let slot = self.slot.as_mut().expect("held until dropped");
        let ran = slot.with(|mgr| {
            let result = catch_unwind(AssertUnwindSafe(|| f(mgr)));
            (result, mgr.capacity())
        });
        let result = match ran {
            Ok((Ok(Ok((value, on_plan))), capacity)) => {
                self.arenas.capacity[self.index].store(capacity, Ordering::Relaxed);
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
            self.rebuild();
        }
        result
    }

    /// Replaces an arena a request kept a reference to (leaked on its thread).
    #[cold]
    fn rebuild(&mut self) {
        if let Ok(fresh) = arena(self.arenas.plans) {
            **self.slot.as_mut().expect("held until dropped") = fresh;
            self.arenas.capacity[self.index].store(0, Ordering::Relaxed);
            self.arenas.counters.rebuilt.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for ArenaGuard<'_> {
    fn drop(&mut self) {
        drop(self.slot.take());
        self.arenas.give_back(self.index);
    }
}
