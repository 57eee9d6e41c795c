//! Whose turn it is with each of K arenas: the free list, the queue of waiting callers,
//! grants to the oldest waiter once it starves, a warm-up's reservation of one arena,
//! and the close. Indices only: what an index leases (an arena and its stack) is
//! [`Arenas`](super::arenas::Arenas)' business.
//!
//! Normally a caller takes any free arena, even while others wait (an arena given back
//! goes on at once with whoever runs first, which keeps the cores busy), and the oldest
//! waiter is woken to try. Once the oldest waiter has waited more than the starving
//! bound (1 ms in a pool) the arenas are *starving*: each one given back is granted to
//! the oldest waiter, and callers that arrive later queue, until a waiter is served
//! within the bound or none is left (Go's `sync.Mutex` does the same). The tail latency
//! stays bounded under any number of callers, and the throughput is the
//! free-for-all's otherwise.
//!
//! **What must hold.** An index is held by one lease at a time; an index given back is
//! on the free list, granted to a queued waiter, or reserved for the warm-up that waits
//! for it; a waiter that leaves (a timeout, the close) gives back a grant it will not
//! take; a close wakes every waiter. Its primitives come from `async_iter::sync`, so
//! the loom model in `src/nn/loom.rs` checks this code: a grant racing a returning lease
//! and the close.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_iter::sync::{self, Condvar, Deadline, Mutex, MutexGuard, Stopwatch, ThreadId};

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

/// What the arenas count (all monotonic, read without locking; statistics, not part of
/// the protocol).
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

/// What a request that would wait for its own thread's leases is told.
pub(crate) fn waits_for_itself() -> String {
    "this thread holds every arena of the pool (PoolLease, or a forgotten one) and would wait for itself; drop a \
     lease first, make requests through the lease, or use output_timeout"
        .into()
}

/// What a warm-up from a thread that holds an arena is told.
pub(crate) fn warms_up_while_holding() -> String {
    "warm_up called from a thread that holds a lease of this pool (a PoolLease, a stream, or a request's closure): \
     it would wait for itself; drop the lease first"
        .into()
}

/// How long a pool's waiter may wait before the arenas go round in turn.
pub(crate) const STARVING_AFTER: Duration = Duration::from_millis(1);

/// Condition variables the waiters are spread over (a waiter waits on the one of its
/// ticket), so that waking one waiter wakes a few threads, not all of them. Two under
/// loom, whose models have fewer threads than that.
const STRIPES: usize = if cfg!(loom) { 2 } else { 64 };

/// The free list and the waiters' queue (see the module's documentation).
#[derive(Debug)]
struct Free {
    /// Indices no lease holds and none was granted (capacity K: pushing never
    /// allocates).
    stack: Vec<usize>,
    /// The tickets of the waiters, oldest first (room for [`STRIPES`] made up front;
    /// beyond that it grows to the most callers that ever waited at once, and keeps it).
    queue: VecDeque<u64>,
    /// Indices granted to waiters that have not picked them up: (ticket, index)
    /// (capacity K).
    granted: Vec<(u64, usize)>,
    next_ticket: u64,
    closed: bool,
    starving: bool,
    /// The thread holding each index (a warm-up must not wait for its own thread).
    holders: Vec<Option<ThreadId>>,
    /// Whether each index is held by a batch worker (a batch of requests runs in it), not
    /// by a caller's lease or stream.
    by_worker: Vec<bool>,
    /// The index a warm-up waits for, and whether it was given to it.
    wanted: Option<usize>,
    reserved: bool,
}

impl Free {
    /// A free index for a caller that did not wait: none while starving with waiters.
    fn take(&mut self) -> Option<usize> {
        if self.starving && !self.queue.is_empty() {
            return None;
        }
        self.stack.pop()
    }

    /// Whether thread `me` holds every index (so that it would wait for itself).
    fn all_held_by(&self, me: ThreadId) -> bool {
        self.holders.iter().all(|&holder| holder == Some(me))
    }

    /// Takes ticket `ticket` out of the queue.
    fn leave(&mut self, ticket: u64) {
        if let Some(at) = self.queue.iter().position(|&t| t == ticket) {
            self.queue.remove(at);
        }
    }
}

/// The turns of K arenas (see the module's documentation).
#[derive(Debug)]
pub(crate) struct Turns {
    free: Mutex<Free>,
    /// Waiter `t` waits on `freed[t % STRIPES]`.
    freed: Box<[Condvar]>,
    /// A warm-up waits on this for the index it wants.
    warm: Condvar,
    /// How long the oldest waiter waits before the indices go round in turn.
    starving_after: Duration,
}

impl Turns {
    /// The turns of `k` indices, all free, going round in turn once the oldest waiter
    /// has waited `starving_after`.
    pub(crate) fn new(k: usize, starving_after: Duration) -> Turns {
        Turns {
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
                by_worker: vec![false; k],
                wanted: None,
                reserved: false,
            }),
            freed: (0..STRIPES).map(|_| Condvar::new()).collect(),
            warm: Condvar::new(),
            starving_after,
        }
    }

    fn free(&self) -> MutexGuard<'_, Free> {
        sync::lock(&self.free)
    }

    fn stripe(&self, ticket: u64) -> &Condvar {
        &self.freed[(ticket % STRIPES as u64) as usize]
    }

    /// Leases a free index for a batch worker (`worker`) or a caller, waiting as `wait`
    /// says (no waiter waits much longer than the starving bound past its turn).
    ///
    /// # Errors
    ///
    /// [`Error::PoolClosed`] once [`Turns::close`] ran; [`Error::PoolBusy`] and
    /// [`Error::Timeout`] as `wait` says; [`Error::InvalidInput`] when it would wait
    /// without a deadline while the calling thread holds every index.
    pub(crate) fn lease(&self, wait: Wait, counters: &Counters, worker: bool) -> Result<usize> {
        let mut free = self.free();
        if free.closed {
            return Err(Error::PoolClosed);
        }
        let taken = free.take();
        let (mut free, index) = match taken {
            Some(index) => (free, Ok(index)),
            None => self.wait(free, wait, counters),
        };
        let index = index?;
        free.holders[index] = Some(sync::current().id());
        free.by_worker[index] = worker;
        Ok(index)
    }

    /// Index `index` for a warm-up: taken from the free list if it is there, or handed
    /// over as soon as its lessee gives it back (ahead of any waiter). The warm-up holds
    /// no other index meanwhile, so it cannot deadlock with callers that hold leases,
    /// and a caller never waits on an index the warm-up holds (it is not free).
    ///
    /// # Errors
    ///
    /// [`Error::PoolClosed`]; [`Error::InvalidInput`] when the calling thread holds the
    /// index (it would wait for itself).
    pub(crate) fn reserve(&self, index: usize) -> Result<()> {
        let me = sync::current().id();
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
                return Err(Error::InvalidInput(warms_up_while_holding()));
            }
            free.wanted = Some(index);
            free = sync::wait(&self.warm, free);
        }
        free.holders[index] = Some(me);
        free.by_worker[index] = false;
        Ok(())
    }

    /// Waits in the queue for an index to come free or be granted (or the close), as
    /// `wait` says.
    #[cold]
    fn wait<'a>(
        &self,
        mut free: MutexGuard<'a, Free>,
        wait: Wait,
        counters: &Counters,
    ) -> (MutexGuard<'a, Free>, Result<usize>) {
        let arenas = free.holders.len();
        let deadline = match wait {
            Wait::No => {
                counters.busy.fetch_add(1, Ordering::Relaxed);
                return (free, Err(Error::PoolBusy { arenas }));
            }
            Wait::Forever => None,
            Wait::For(timeout) => Some(Deadline::after(timeout)),
        };
        if deadline.is_none() && free.all_held_by(sync::current().id()) {
            return (free, Err(Error::InvalidInput(waits_for_itself())));
        }
        counters.waited.fetch_add(1, Ordering::Relaxed);
        let ticket = free.next_ticket;
        free.next_ticket += 1;
        free.queue.push_back(ticket);
        let freed = self.stripe(ticket);
        let waited = Stopwatch::start();
        let starving = Deadline::after(self.starving_after);
        // Starving from the start when the bound is zero.
        let mut starved = starving.remaining().is_none();
        if starved && free.queue.front() == Some(&ticket) {
            free.starving = true;
        }
        let outcome = loop {
            let timed_out = match deadline {
                None => {
                    free = sync::wait(freed, free);
                    false
                }
                Some(deadline) => {
                    if let Some(left) = deadline.remaining() {
                        free = sync::wait_timeout(freed, free, left);
                    }
                    deadline.remaining().is_none()
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
            starved = starved || starving.remaining().is_none();
            // An index granted is taken even at the deadline (leaving it would strand
            // it); a free one is anyone's while not starving.
            let index = match free.granted.iter().position(|&(t, _)| t == ticket) {
                Some(at) => Some(free.granted.swap_remove(at).1),
                None if !free.starving => free.stack.pop().inspect(|_| free.leave(ticket)),
                None => None,
            };
            if let Some(index) = index {
                // Served within the bound, or the last waiter: back to normal.
                if !starved || free.queue.is_empty() {
                    free.starving = false;
                }
                // More indices came back than woke waiters: pass the wake-up on.
                if !free.stack.is_empty() {
                    if let Some(&next) = free.queue.front() {
                        self.stripe(next).notify_all();
                    }
                }
                break Ok(index);
            }
            if starved && free.queue.front() == Some(&ticket) {
                free.starving = true;
            }
            if timed_out {
                free.leave(ticket);
                counters.timeouts.fetch_add(1, Ordering::Relaxed);
                break Err(Error::Timeout { arenas, waited: waited.elapsed() });
            }
        };
        (free, outcome)
    }

    /// Whether every index is held by callers (leases, streams, warm-ups), none by a batch
    /// worker: then a batch queued now waits for a caller to give one back.
    pub(crate) fn all_held_by_callers(&self) -> bool {
        let free = self.free();
        free.holders.iter().zip(&free.by_worker).all(|(holder, &worker)| holder.is_some() && !worker)
    }

    /// Whether the calling thread holds any index: then a warm-up, which waits for each
    /// index in turn, would wait for itself.
    pub(crate) fn any_held_here(&self) -> bool {
        let me = sync::current().id();
        self.free().holders.contains(&Some(me))
    }

    /// Whether the calling thread holds every index: then a request that needs one and
    /// waits without a deadline would wait for itself.
    pub(crate) fn all_held_here(&self) -> bool {
        self.free().all_held_by(sync::current().id())
    }

    /// Closes the turns: waiting and later leases fail with [`Error::PoolClosed`];
    /// leases held go on to their ends.
    pub(crate) fn close(&self) {
        self.free().closed = true;
        for freed in self.freed.iter() {
            freed.notify_all();
        }
        self.warm.notify_all();
    }

    /// Gives index `index` back: to the warm-up that waits for it, granted to the
    /// oldest waiter (starving), or onto the free list.
    pub(crate) fn give_back(&self, index: usize) {
        let mut free = self.free();
        free.holders[index] = None;
        free.by_worker[index] = false;
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
            self.stripe(ticket).notify_all();
        }
    }

    /// Indices on the free list (for the loom model: every index comes back).
    #[cfg(all(test, loom))]
    pub(crate) fn free_count(&self) -> usize {
        self.free().stack.len()
    }
}
