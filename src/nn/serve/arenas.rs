//! K planned arenas, leased one request at a time from any thread.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use async_iter::panics::{drop_quietly, panic_message};
use workspace_core::planned::PortableMgr;
use workspace_core::LayerWorkspaceMgr;

use super::stack::ArenaStack;
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

/// How long a waiter may wait before the arenas go round in turn (see [`Free`]).
const STARVING_AFTER: Duration = Duration::from_millis(1);

/// Condition variables the waiters are spread over (a waiter waits on the one of its
/// ticket), so that waking one waiter wakes a few threads, not all of them.
const STRIPES: usize = 64;

/// The free list and the waiters' queue.
///
/// Normally a caller takes any free arena, even while others wait (an arena given back
/// goes on at once with whoever runs first, which keeps the cores busy), and the
/// oldest waiter is woken to try. Once the oldest waiter has waited more than
/// [`STARVING_AFTER`] the arenas are *starving*: each one given back is granted to the
/// oldest waiter, and callers that arrive later queue, until a waiter is served
/// within the bound or none is left (Go's `sync.Mutex` does the same). The tail
/// latency stays bounded under any number of callers, and the throughput is the
/// free-for-all's otherwise.
#[derive(Debug)]
struct Free {
    /// Indices of the arenas no lease holds and none was granted (capacity K: pushing
    /// never allocates).
    stack: Vec<usize>,
    /// The tickets of the waiters, oldest first (room for [`STRIPES`] made up front;
    /// beyond that it grows to the most callers that ever waited at once, and keeps it).
    queue: VecDeque<u64>,
    /// Arenas granted to waiters that have not picked them up: (ticket, arena)
    /// (capacity K).
    granted: Vec<(u64, usize)>,
    next_ticket: u64,
    closed: bool,
    starving: bool,
    /// The thread holding each arena (a warm-up must not wait for its own thread).
    holders: Vec<Option<ThreadId>>,
    /// The arena a warm-up waits for, and whether it was given to it.
    wanted: Option<usize>,
    reserved: bool,
}

impl Free {
    /// A free arena for a caller that did not wait: none while starving with waiters.
    fn take(&mut self) -> Option<usize> {
        if self.starving && !self.queue.is_empty() {
            return None;
        }
        self.stack.pop()
    }

    /// Takes ticket `ticket` out of the queue.
    fn leave(&mut self, ticket: u64) {
        if let Some(at) = self.queue.iter().position(|&t| t == ticket) {
            self.queue.remove(at);
        }
    }
}

/// K arenas, each a planned manager of the inference workspaces ([`PortableMgr`]),
/// leased by RAII ([`ArenaGuard`]).
#[derive(Debug)]
pub(crate) struct Arenas {
    slots: Box<[Mutex<Slot>]>,
    /// Each arena's capacity after its last request (for statistics without a lease).
    capacity: Box<[AtomicUsize]>,
    free: Mutex<Free>,
    /// Waiter `t` waits on `freed[t % STRIPES]`.
    freed: Box<[Condvar]>,
    /// A warm-up waits on this for the arena it wants.
    warm: Condvar,
    plans: usize,
    pub(crate) counters: Counters,
}

/// An arena: its planned manager, and the stack its requests run on.
#[derive(Debug)]
struct Slot {
    mgr: PortableMgr,
    stack: ArenaStack,
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
        let slots = (0..k)
            .map(|_| Ok(Mutex::new(Slot { mgr: arena(plans)?, stack: ArenaStack::new()? })))
            .collect::<Result<Vec<_>>>()?;
        Ok(Arenas {
            slots: slots.into_boxed_slice(),
            capacity: (0..k).map(|_| AtomicUsize::new(0)).collect(),
            free: Mutex::new(Free {
                stack: (0..k).rev().collect(),
                // Room for as many waiters as there are stripes before the queue grows
                // (once, to a new most): waiting allocates nothing.
                queue: VecDeque::with_capacity(STRIPES),
                granted: Vec::with_capacity(k),
                next_ticket: 0,
                closed: false,
                starving: false,
                holders: vec![None; k],
                wanted: None,
                reserved: false,
            }),
            warm: Condvar::new(),
            freed: (0..STRIPES).map(|_| Condvar::new()).collect(),
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

    /// Leases a free arena, waiting as `wait` says (no waiter waits much longer than
    /// [`STARVING_AFTER`] past its turn: see [`Free`]).
    ///
    /// # Errors
    ///
    /// [`Error::PoolClosed`] once [`Arenas::close`] ran; [`Error::PoolBusy`] and
    /// [`Error::Timeout`] as `wait` says.
    pub(crate) fn lease(&self, wait: Wait) -> Result<ArenaGuard<'_>> {
        let mut free = self.free();
        if free.closed {
            return Err(Error::PoolClosed);
        }
        let taken = free.take();
        let (mut free, index) = match taken {
            Some(index) => (free, Ok(index)),
            None => self.wait(free, wait),
        };
        let index = index?;
        free.holders[index] = Some(std::thread::current().id());
        drop(free);
        self.counters.leases.fetch_add(1, Ordering::Relaxed);
        let slot = self.slots[index].lock().unwrap_or_else(PoisonError::into_inner);
        Ok(ArenaGuard { arenas: self, index, slot: Some(slot) })
    }

    /// Arena `index` for a warm-up: taken from the free list if it is there, or handed
    /// over as soon as its lessee gives it back (ahead of any waiter). The warm-up holds
    /// no other arena meanwhile, so it cannot deadlock with callers that hold leases,
    /// and a caller never waits on an arena the warm-up holds (it is not free).
    ///
    /// # Errors
    ///
    /// [`Error::PoolClosed`]; [`Error::InvalidInput`] when the calling thread holds the
    /// arena (it would wait for itself).
    pub(crate) fn reserve(&self, index: usize) -> Result<ArenaGuard<'_>> {
        let me = std::thread::current().id();
        let mut free = self.free();
        loop {
            if free.closed {
                if free.reserved && free.wanted == Some(index) {
                    free.stack.push(index);
                }
                free.wanted = None;
                free.reserved = false;
                return Err(Error::PoolClosed);
            }
            if free.reserved && free.wanted == Some(index) {
                free.reserved = false;
                free.wanted = None;
                break;
            }
            if let Some(at) = free.stack.iter().position(|&i| i == index) {
                free.stack.remove(at);
                free.wanted = None;
                break;
            }
            if free.holders[index] == Some(me) {
                free.wanted = None;
                return Err(Error::InvalidInput(
                    "warm_up called from a thread that holds a lease of this pool: it would wait for itself; drop \
                     the lease first"
                        .into(),
                ));
            }
            free.wanted = Some(index);
            free = self.warm.wait(free).unwrap_or_else(PoisonError::into_inner);
        }
        free.holders[index] = Some(me);
        drop(free);
        let slot = self.slots[index].lock().unwrap_or_else(PoisonError::into_inner);
        Ok(ArenaGuard { arenas: self, index, slot: Some(slot) })
    }

    /// Waits in the queue for an arena to come free or be granted (or the close), as
    /// `wait` says.
    #[cold]
    fn wait<'a>(&self, mut free: MutexGuard<'a, Free>, wait: Wait) -> (MutexGuard<'a, Free>, Result<usize>) {
        let arenas = self.len();
        let timeout = match wait {
            Wait::No => {
                self.counters.busy.fetch_add(1, Ordering::Relaxed);
                return (free, Err(Error::PoolBusy { arenas }));
            }
            Wait::Forever => None,
            Wait::For(timeout) => Some(timeout),
        };
        self.counters.waited.fetch_add(1, Ordering::Relaxed);
        let ticket = free.next_ticket;
        free.next_ticket += 1;
        free.queue.push_back(ticket);
        let freed = &self.freed[(ticket % STRIPES as u64) as usize];
        let start = Instant::now();
        let outcome = loop {
            let timed_out = match timeout {
                None => {
                    free = freed.wait(free).unwrap_or_else(PoisonError::into_inner);
                    false
                }
                Some(timeout) => {
                    let left = timeout.saturating_sub(start.elapsed());
                    if !left.is_zero() {
                        free = freed.wait_timeout(free, left).unwrap_or_else(PoisonError::into_inner).0;
                    }
                    start.elapsed() >= timeout
                }
            };
            if free.closed {
                free.leave(ticket);
                // A grant it will not take goes back to the free list.
                if let Some(at) = free.granted.iter().position(|&(t, _)| t == ticket) {
                    let (_, index) = free.granted.swap_remove(at);
                    free.stack.push(index);
                }
                break Err(Error::PoolClosed);
            }
            let waited = start.elapsed();
            // An arena granted is taken even at the deadline (leaving it would strand
            // it); a free one is anyone's while not starving.
            let index = match free.granted.iter().position(|&(t, _)| t == ticket) {
                Some(at) => Some(free.granted.swap_remove(at).1),
                None if !free.starving => free.stack.pop().inspect(|_| free.leave(ticket)),
                None => None,
            };
            if let Some(index) = index {
                // Served within the bound, or the last waiter: back to normal.
                if waited < STARVING_AFTER || free.queue.is_empty() {
                    free.starving = false;
                }
                // More arenas came back than woke waiters: pass the wake-up on.
                if !free.stack.is_empty() {
                    if let Some(&next) = free.queue.front() {
                        self.freed[(next % STRIPES as u64) as usize].notify_all();
                    }
                }
                break Ok(index);
            }
            if waited >= STARVING_AFTER && free.queue.front() == Some(&ticket) {
                free.starving = true;
            }
            if timed_out {
                free.leave(ticket);
                self.counters.timeouts.fetch_add(1, Ordering::Relaxed);
                break Err(Error::Timeout { arenas, waited });
            }
        };
        (free, outcome)
    }

    /// Closes the arenas: waiting and later leases fail with [`Error::PoolClosed`];
    /// leases held go on to the end of their requests.
    pub(crate) fn close(&self) {
        self.free().closed = true;
        for freed in self.freed.iter() {
            freed.notify_all();
        }
        self.warm.notify_all();
    }

    fn give_back(&self, index: usize) {
        let mut free = self.free();
        free.holders[index] = None;
        if free.wanted == Some(index) && !free.reserved {
            // A warm-up waits for this one.
            free.reserved = true;
            drop(free);
            self.warm.notify_all();
            return;
        }
        // Starving: granted to the oldest waiter. Otherwise free for whoever comes
        // first, and the oldest waiter woken to try.
        let wake = if free.starving {
            free.queue.pop_front().inspect(|&ticket| free.granted.push((ticket, index)))
        } else {
            None
        };
        let wake = wake.or_else(|| {
            free.stack.push(index);
            free.queue.front().copied()
        });
        drop(free);
        if let Some(ticket) = wake {
            // Everyone on the oldest waiter's stripe: it is among them.
            self.freed[(ticket % STRIPES as u64) as usize].notify_all();
        }
    }
}

/// A leased arena: given back when dropped (a forgotten guard keeps its arena for
/// good: the pool then has one arena fewer, nothing else).
#[derive(Debug)]
pub(crate) struct ArenaGuard<'a> {
    arenas: &'a Arenas,
    index: usize,
    slot: Option<MutexGuard<'a, Slot>>,
}

impl ArenaGuard<'_> {
    /// Runs `f` in the arena on this thread. A panic in `f` is [`Error::Panicked`]
    /// (the scopes it held were closed as it unwound); an arena that `f` kept a
    /// reference to is replaced by a new one.
    pub(crate) fn run<R>(&mut self, f: impl FnOnce(&LayerWorkspaceMgr) -> Result<(R, bool)>) -> Result<R> {
        let counters = &self.arenas.counters;
        let Slot { mgr: slot, stack } = &mut **self.slot.as_mut().expect("held until dropped");
        // On the arena's stack: what a request touches is the arena's, not its caller's.
        let ran = stack.run(|| {
            slot.with(|mgr| {
                let result = catch_unwind(AssertUnwindSafe(|| f(mgr)));
                (result, mgr.capacity())
            })
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
            self.slot.as_mut().expect("held until dropped").mgr = fresh;
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
