//! The hand-off between the producer thread and the consumer: which slot belongs to
//! whom, how each side waits for the other, how the end of an epoch travels, and how
//! the producer's state comes back ([`Exit`]).
//!
//! # The protocol
//!
//! It is a single-producer single-consumer ring in the manner of Lamport's bounded
//! queue, whose entries are the slots of the [`Ring`](crate::ring::Ring) themselves.
//! Two words carry all of it, one per direction:
//!
//! - `ready` (producer → consumer): the number of batches *published* this epoch,
//!   and the `DONE` flag, raised once after the last batch (end of data, or a
//!   failure, stored in `outcome` first);
//! - `room` (consumer → producer): the number of batches *released* this epoch, and
//!   the `STOP` flag, raised when the consumer ends the epoch early or goes away.
//!
//! The producer fills batch `i` in slot `i % slots` only once `released > i - slots`:
//! the slot's previous batch is neither queued nor leased. It writes the slot's
//! descriptor, then adds one to `ready` (release ordering publishes descriptor and
//! batch bytes). The consumer takes batch `i` once `ready` counts more than `i`
//! (acquire), and adds one to `room` when the lease ends. Counts only grow within an
//! epoch; [`Shared::reset_epoch`] zeroes them while no producer runs.
//!
//! # Waiting
//!
//! A side that finds the other's word not ready spins briefly (crossbeam's
//! `Backoff`), then yields its core until the wait has lasted [`PARK_AFTER`] (50 µs),
//! then parks on the word's condition variable: waking a parked thread costs the
//! other side a system call and the sleeper tens of microseconds, which would add to
//! every batch when producer and consumer run at about the same pace.
//!
//! To park, a side sets the word's `SLEEPING` bit with a compare-and-swap *under the
//! word's lock*, and only if
//! the word is unchanged since it last looked; every writer's read-modify-write then
//! sees the bit, takes the lock (so it cannot slip in between the swap and the wait),
//! clears the bit and notifies. Count and flags share the word, so no store can be
//! reordered past the sleeper's check. Every wait therefore wakes on a new batch, a
//! release, `DONE` or `STOP` — nothing hangs when the other side ends.
//!
//! # The way back
//!
//! When an epoch ends, the producer thread hands the source and the ring back through
//! an [`Exit`]: a lock, a condition variable and a three-state value (running,
//! returned, abandoned). The consumer waits there for at most its join timeout, and
//! only then joins the thread, which has nothing left to do; a thread that does not
//! hand back in time (a source stuck in a call) keeps its state, and if the consumer
//! gives up on it for good, drops that state itself when the call returns.
//!
//! # Loom
//!
//! Under `cfg(loom)` all of this runs on loom's primitives (`crate::sync`). The slot
//! cells are loom cells: the producer holds a unique access to a slot from the moment
//! it starts filling it until it publishes, and a lease holds a shared access until it
//! is dropped, so a producer that wrote a slot the consumer still holds would fail the
//! model; likewise the ring block a lease points into (see `Region::token`).

use std::mem;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam::utils::CachePadded;

use crate::error::{drop_quietly, Error};
use crate::layout::BatchLayout;
use crate::ring::Region;
use crate::stats::{add_wait, bump, Counters};
use crate::sync::{lock, wait_timeout, AtomicUsize, Backoff, Condvar, ConstPtr, Deadline, MutPtr, Mutex, UnsafeCell};
use crate::view::BatchRef;

/// The reader of the word is parked, or about to park, on the word's condition variable.
const SLEEPING: usize = 1;
/// `DONE` in `ready`, `STOP` in `room`.
const FLAG: usize = 2;
/// One batch in the count, which takes the bits above the two flags.
const ONE: usize = 4;
/// Spins of a wait before its time is measured (crossbeam's `Backoff` spins, without
/// yielding, for its first seven snoozes; under loom it parks at once).
const UNTIMED_SPINS: u32 = if cfg!(loom) { 0 } else { 7 };
/// How long a wait spins and yields before it parks (under loom it parks at once).
const PARK_AFTER: Duration = if cfg!(loom) { Duration::ZERO } else { Duration::from_micros(50) };
/// Counts are compared modulo `2^(usize::BITS - 2)`.
const COUNT_MASK: usize = usize::MAX >> 2;

/// How far count `to` is ahead of count `from`.
fn ahead(to: usize, from: usize) -> usize {
    to.wrapping_sub(from) & COUNT_MASK
}

fn count(word: usize) -> usize {
    word >> 2
}

/// One direction of the hand-off: a count plus a flag, and the lock and condition
/// variable its reader parks on.
struct Signal {
    word: CachePadded<AtomicUsize>,
    lock: Mutex<()>,
    cond: Condvar,
}

impl Signal {
    fn new() -> Signal {
        Signal { word: CachePadded::new(AtomicUsize::new(0)), lock: Mutex::new(()), cond: Condvar::new() }
    }

    /// Writer: adds `n` to the count (release), waking a parked reader.
    #[inline]
    fn advance(&self, n: usize) {
        let old = self.word.fetch_add(n.wrapping_mul(ONE), Ordering::AcqRel);
        if old & SLEEPING != 0 {
            self.wake();
        }
    }

    /// Writer: raises the flag, waking a parked reader.
    fn raise(&self) {
        let old = self.word.fetch_or(FLAG, Ordering::AcqRel);
        if old & SLEEPING != 0 {
            self.wake();
        }
    }

    #[cold]
    #[inline(never)]
    fn wake(&self) {
        // Under the lock the reader is either before its compare-and-swap (and will see
        // the new word) or inside `wait` (and gets the notification).
        let _guard = lock(&self.lock);
        self.word.fetch_and(!SLEEPING, Ordering::AcqRel);
        self.cond.notify_one();
    }

    /// Reader: the word once `ready(word)` holds (acquire), adding any time spent
    /// waiting to `waited_ns`.
    #[inline]
    fn wait(&self, ready: impl Fn(usize) -> bool, waited_ns: &AtomicU64) -> usize {
        let word = self.word.load(Ordering::Acquire);
        if ready(word) {
            return word;
        }
        self.wait_slow(&ready, waited_ns)
    }

    #[cold]
    #[inline(never)]
    fn wait_slow(&self, ready: &dyn Fn(usize) -> bool, waited_ns: &AtomicU64) -> usize {
        let backoff = Backoff::new();
        // The clock starts after the first few spins: a wait that ends within them
        // (well under a microsecond) would cost more to time than it lasts.
        let mut spins = 0;
        let mut start = None;
        let word = loop {
            let word = self.word.load(Ordering::Acquire);
            if ready(word) {
                break word;
            }
            if spins == UNTIMED_SPINS {
                start = Some(Instant::now());
            }
            spins += 1;
            // Spin, then yield the core, and park only once the wait has lasted a while:
            // waking a parked thread costs a system call on the other side and tens of
            // microseconds of latency, more than a short wait lasts.
            if !backoff.is_completed() || start.is_some_and(|start| start.elapsed() < PARK_AFTER) {
                backoff.snooze();
                continue;
            }
            let guard = lock(&self.lock);
            // Park only if nothing changed since `word` was read; otherwise look again.
            if self.word.compare_exchange(word, word | SLEEPING, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                drop(self.cond.wait(guard));
            }
        };
        if let Some(start) = start {
            add_wait(waited_ns, start.elapsed());
        }
        word
    }

    /// Zeroes the word. Only while the other side is gone (no producer thread runs).
    fn clear(&self) {
        self.word.store(0, Ordering::Release);
    }
}

/// What the consumer needs to read one published batch.
#[derive(Debug)]
pub(crate) struct Descriptor {
    pub(crate) region: Region,
    /// Planned.
    pub(crate) layout: BatchLayout,
    pub(crate) index: usize,
}

/// What [`Shared::wait_for_batch`] found.
pub(crate) enum Available {
    /// Batch `taken` is published.
    Batch,
    /// The producer finished this epoch after the batches already taken.
    Done,
}

/// The state both threads share; see the module docs.
pub(crate) struct Shared {
    ready: Signal,
    room: Signal,
    /// Descriptor of the batch in each ring slot (`None` before its first batch).
    slots: Box<[CachePadded<UnsafeCell<Option<Descriptor>>>]>,
    /// Why the epoch ended: `None` at the end of data. Written by the producer before
    /// it raises `DONE`, read by the consumer after it sees `DONE`.
    outcome: UnsafeCell<Option<Error>>,
    pub(crate) counters: Counters,
}

// SAFETY: `Shared` is the meeting point of exactly one producer and one consumer.
// Its raw pointers (in descriptors) point into ring blocks that the producer's ring
// owns and keeps alive while any batch in them is queued or leased. Every other
// field is an atomic, a lock or a condition variable, except the cells, whose
// accesses are ordered by the protocol: a slot cell is written by the producer only
// while it owns the slot (`released` shows the previous batch gone, acquire) and
// read by the consumer only after `ready` shows it published (acquire, paired with
// the producer's release); `outcome` is written before `DONE` is raised and read
// after it is seen. `Error` is `Send`, so moving it between threads is sound.
unsafe impl Send for Shared {}
// SAFETY: as for `Send`: all shared access goes through atomics, locks and the
// protocol-ordered cells described there.
unsafe impl Sync for Shared {}

impl Shared {
    pub(crate) fn new(slots: usize) -> Shared {
        Shared {
            ready: Signal::new(),
            room: Signal::new(),
            slots: (0..slots).map(|_| CachePadded::new(UnsafeCell::new(None))).collect(),
            outcome: UnsafeCell::new(None),
            counters: Counters::default(),
        }
    }

    pub(crate) fn slots(&self) -> usize {
        self.slots.len()
    }

    // ---- producer side -------------------------------------------------------------

    /// Whether the consumer asked the producer to stop.
    pub(crate) fn stop_requested(&self) -> bool {
        self.room.word.load(Ordering::Acquire) & FLAG != 0
    }

    /// Waits until batch `index` may be filled (batch `index - slots` is released);
    /// returns the number of released batches, or `None` when asked to stop.
    pub(crate) fn wait_for_room(&self, index: usize) -> Option<usize> {
        let slots = self.slots();
        let ready = |word: usize| word & FLAG != 0 || ahead(index, count(word)) < slots;
        let word = self.room.wait(ready, &self.counters.producer.wait_ns);
        (word & FLAG == 0).then_some(count(word))
    }

    /// Takes the slot of batch `index` for filling; the caller has waited for room.
    pub(crate) fn claim(&self, index: usize) -> SlotWriter<'_> {
        SlotWriter { shared: self, cell: self.slots[index % self.slots()].get_mut() }
    }

    /// Ends the epoch for the consumer: `outcome` is `None` at the end of data.
    pub(crate) fn finish(&self, outcome: Option<Error>) {
        // SAFETY: only the producer writes `outcome`, and only before raising DONE;
        // the consumer reads it only after seeing DONE, so the accesses never overlap.
        self.outcome.with_mut(|cell| unsafe { *cell = outcome });
        self.ready.raise();
    }

    // ---- consumer side -------------------------------------------------------------

    /// Waits until batch `taken` is published or the producer finished before it.
    pub(crate) fn wait_for_batch(&self, taken: usize) -> Available {
        let ready = |word: usize| word & FLAG != 0 || ahead(count(word), taken) > 0;
        let word = self.ready.wait(ready, &self.counters.consumer.wait_ns);
        // A batch published before DONE is delivered before the outcome.
        if ahead(count(word), taken) > 0 {
            Available::Batch
        } else {
            Available::Done
        }
    }

    /// Whether batch `taken` is published or the producer finished before it: whether
    /// [`wait_for_batch`](Self::wait_for_batch) would return at once. Only a look: the
    /// caller still calls `wait_for_batch`, whose acquire orders what it reads.
    pub(crate) fn is_available(&self, taken: usize) -> bool {
        let word = self.ready.word.load(Ordering::Acquire);
        word & FLAG != 0 || ahead(count(word), taken) > 0
    }

    /// Reads published batch `index` (the caller saw [`Available::Batch`]).
    ///
    /// # Safety
    ///
    /// The returned reader must be dropped before batch `index` is released and
    /// before this `Shared` is dropped.
    pub(crate) unsafe fn take(&self, index: usize) -> SlotReader {
        let descriptor = self.slots[index % self.slots()].get();
        // SAFETY: batch `index` is published (acquire in `wait_for_batch`), so the
        // producer's unique access to the slot ended before, and it starts no other
        // until this batch is released, after the reader is dropped.
        let token = unsafe { descriptor.deref() }.as_ref().map(|d| d.region.token);
        let token = token.expect("a published slot has a descriptor");
        // SAFETY: the token lives in the ring block of the batch, which the ring keeps
        // until the batch is released.
        let block = unsafe { token.as_ref() }.get();
        SlotReader { descriptor, _block: block }
    }

    /// Returns `n` more batches' slots to the producer.
    pub(crate) fn release(&self, n: usize) {
        self.room.advance(n);
    }

    /// Asks the producer to stop at its next check.
    pub(crate) fn request_stop(&self) {
        self.room.raise();
    }

    /// Takes the outcome of the epoch (the caller saw [`Available::Done`]).
    pub(crate) fn take_outcome(&self) -> Option<Error> {
        // SAFETY: DONE was seen (acquire), so the producer's write is complete and it
        // makes no other.
        self.outcome.with_mut(|cell| unsafe { (*cell).take() })
    }

    /// Starts a new epoch: counts and flags zero, no outcome. Only while no producer
    /// thread runs and no lease is alive.
    pub(crate) fn reset_epoch(&self) {
        self.ready.clear();
        self.room.clear();
        // SAFETY: no producer runs, so nobody else accesses the cell.
        let unreported = self.outcome.with_mut(|cell| unsafe { (*cell).take() });
        // An error nobody asked for may hold the source's error, whose destructor is
        // user code.
        drop_quietly(unreported);
    }
}

/// How the producer thread hands its state (the source and the ring) back when its
/// epoch ends: the one wait of the consumer with a time limit.
///
/// Joining the thread directly would wait as long as the source takes to return from a
/// call, which may be forever. Instead the thread puts its state here as its last act,
/// and the consumer waits for it at most the prefetcher's join timeout. If it gives up
/// for good (the prefetcher is dropped), it marks the exit [`Abandoned`](Returning::Abandoned),
/// and the thread, when the source finally returns, drops the state itself: whatever
/// memory it was writing lives exactly as long as it does.
pub(crate) struct Exit<T> {
    state: Mutex<Returning<T>>,
    cond: Condvar,
}

/// The states of an [`Exit`].
enum Returning<T> {
    /// The thread runs (or handed its state back and the consumer took it).
    Running,
    /// The thread handed its state back; the consumer has not taken it yet.
    Returned(T),
    /// The consumer is gone: the thread keeps its state and drops it.
    Abandoned,
}

impl<T> Exit<T> {
    pub(crate) fn new() -> Exit<T> {
        Exit { state: Mutex::new(Returning::Running), cond: Condvar::new() }
    }

    /// Producer thread: hands `value` back to the consumer, or, when the consumer
    /// abandoned it, returns it for the caller to drop.
    pub(crate) fn hand_back(&self, value: T) -> Option<T> {
        let mut state = lock(&self.state);
        if let Returning::Abandoned = *state {
            return Some(value);
        }
        *state = Returning::Returned(value);
        drop(state);
        self.cond.notify_all();
        None
    }

    /// Consumer: the value once handed back, waiting until `deadline`; `None` if it
    /// has not been by then.
    pub(crate) fn wait(&self, deadline: Deadline) -> Option<T> {
        let mut state = lock(&self.state);
        loop {
            if let Returning::Returned(_) = *state {
                let Returning::Returned(value) = mem::replace(&mut *state, Returning::Running) else {
                    unreachable!("matched above")
                };
                return Some(value);
            }
            state = wait_timeout(&self.cond, state, deadline.remaining()?);
        }
    }

    /// Consumer: gives up on the value for good. Returns it if it was handed back
    /// meanwhile; otherwise the thread drops it when it ends.
    pub(crate) fn abandon(&self) -> Option<T> {
        match mem::replace(&mut *lock(&self.state), Returning::Abandoned) {
            Returning::Returned(value) => Some(value),
            Returning::Running | Returning::Abandoned => None,
        }
    }
}

/// The producer's claim on one slot, from filling to publishing.
pub(crate) struct SlotWriter<'a> {
    shared: &'a Shared,
    cell: MutPtr<Option<Descriptor>>,
}

impl SlotWriter<'_> {
    /// Writes the slot's descriptor and publishes the batch to the consumer.
    pub(crate) fn publish(self, descriptor: Descriptor) {
        // SAFETY: the claim is the unique access to the slot (see `Shared::claim`).
        unsafe { *self.cell.deref() = Some(descriptor) };
        let SlotWriter { shared, cell } = self;
        drop(cell); // the claim ends before the batch is visible
        bump(&shared.counters.producer.produced);
        shared.ready.advance(1);
    }
}

/// The consumer's hold on one published batch, from [`Shared::take`].
///
/// Its contract (the caller's of `take`) keeps the batch published and unreleased
/// and the `Shared` alive for as long as the reader lives, which is what makes its
/// accessors safe.
pub(crate) struct SlotReader {
    descriptor: ConstPtr<Option<Descriptor>>,
    /// The shared access to the batch's block (tracked by loom; nothing with std).
    _block: ConstPtr<()>,
}

impl SlotReader {
    pub(crate) fn descriptor(&self) -> &Descriptor {
        // SAFETY: the slot is published and not yet released (the contract of
        // `Shared::take`); the producer does not touch it until the release.
        let descriptor = unsafe { self.descriptor.deref() };
        descriptor.as_ref().expect("a published slot has a descriptor")
    }

    pub(crate) fn batch(&self) -> BatchRef<'_> {
        let descriptor = self.descriptor();
        // SAFETY: the region holds the planned bytes of the layout, aligned, zeroed
        // and then filled by the producer before publishing, and the producer writes
        // it again only after the batch is released, which cannot happen while the
        // reader lives (the contract of `Shared::take`).
        unsafe { BatchRef::new(descriptor.region.base, &descriptor.layout, descriptor.index) }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn counts_compare_across_wrap_around() {
        assert_eq!(ahead(3, 1), 2);
        assert_eq!(ahead(1, COUNT_MASK), 2, "a count that wrapped is still ahead");
        assert_eq!(ahead(5, 5), 0);
    }

    #[test]
    fn a_parked_reader_wakes_on_the_count_and_on_the_flag() {
        let shared = std::sync::Arc::new(Shared::new(2));
        let waiter = {
            let shared = shared.clone();
            std::thread::spawn(move || matches!(shared.wait_for_batch(0), Available::Batch))
        };
        std::thread::sleep(std::time::Duration::from_millis(20)); // let it park
        shared.ready.advance(1);
        assert!(waiter.join().unwrap());
        let waiter = {
            let shared = shared.clone();
            std::thread::spawn(move || shared.wait_for_room(4))
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        shared.request_stop();
        assert_eq!(waiter.join().unwrap(), None, "STOP ends the producer's wait");
        assert!(shared.counters.producer.wait_ns.load(Ordering::Relaxed) > 0);
    }
}
