//! Which stream last used which bytes of a device plan group's arena, and the events
//! that order a reuse after that use.
//!
//! A plan lets the allocations of different members share bytes of the group's one
//! arena once the earlier ones are dead. On the host, dead means the cycle or frame
//! that made them closed. On the device, work issued on them may still be queued: on
//! the member's stream, which orders it before that member's later work for free, and
//! on any other stream. So each *release* (a member's cycle or frame closes, after the
//! member has ordered every other stream that used its memory before its own) records
//! an event on the member's stream and notes, for every other stream of the group, the
//! bytes that stream has not yet been ordered after. A *reservation* of arena bytes on
//! a stream waits, before its address is handed out, for the latest release event of
//! every other stream whose noted bytes overlap it. Freeing the arena (a larger plan, a
//! trim, the group dropped) waits for every stream the same way, on the stream the
//! arena was allocated on, and a new arena is released by that stream in turn, so its
//! first use elsewhere waits for the allocation.
//!
//! The noted bytes of a stream are one range (the union of what it released since the
//! other stream last waited for it): a wait for the latest event of a stream covers
//! all of its earlier releases, and a range too wide costs a wait, never a race. With
//! one stream in the group nothing is recorded: stream order is enough (until a stream
//! could not be ordered, see below).
//!
//! What could be ordered neither by an event nor by waiting on the host is kept in
//! `unordered`: every later reservation in the arena, and the arena's free, waits for
//! those streams on the host first, and fails (or leaks the arena) while it cannot.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::device::Device;
use crate::error::DeviceError;

/// Bytes `[start, end)`; empty when `start >= end`.
type Range = (u64, u64);

const EMPTY: Range = (u64::MAX, 0);

fn union(a: Range, b: Range) -> Range {
    (a.0.min(b.0), a.1.max(b.1))
}

fn overlaps(a: Range, b: Range) -> bool {
    a.0 < b.1 && b.0 < a.1
}

/// See the module docs.
pub(crate) struct Ledger<D: Device> {
    device: D,
    /// The arena's first byte and its end (both 0 without an arena).
    arena_start: AtomicU64,
    arena_end: AtomicU64,
    /// Whether anything needs ordering: more than one stream touches the arena, or a
    /// stream could not be ordered (`unordered`). Until then stream order is enough.
    multi: AtomicBool,
    lanes: Mutex<Lanes<D>>,
}

/// The streams of a group: lane 0 is the stream its arena is allocated on.
struct Lanes<D: Device> {
    streams: Vec<D::Stream>,
    /// The latest release event of each lane.
    latest: Vec<Option<D::Event>>,
    /// `pending[from][to]`: bytes lane `from` released that lane `to` has not waited for.
    pending: Vec<Vec<Range>>,
    /// Streams that could not be ordered (see the module docs).
    unordered: Vec<D::Stream>,
    /// Waits issued for reuse across streams.
    waits: u64,
}

impl<D: Device> Ledger<D> {
    /// The ledger of a group whose arena is allocated on `home`.
    pub(crate) fn new(device: D, home: D::Stream) -> Ledger<D> {
        Ledger {
            device,
            arena_start: AtomicU64::new(0),
            arena_end: AtomicU64::new(0),
            multi: AtomicBool::new(false),
            lanes: Mutex::new(Lanes {
                streams: vec![home],
                latest: vec![None],
                pending: vec![vec![EMPTY]],
                unordered: Vec::new(),
                waits: 0,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Lanes<D>> {
        self.lanes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The lane of `stream`, added when it is new. A new stream is ordered after all
    /// the work of the others so far (what they did before it joined was not noted).
    ///
    /// # Errors
    ///
    /// When an event can be neither recorded nor waited for on the host.
    pub(crate) fn lane(&self, stream: &D::Stream) -> Result<usize, DeviceError> {
        let mut lanes = self.lock();
        if let Some(lane) = lanes.streams.iter().position(|s| s == stream) {
            return Ok(lane);
        }
        for other in 0..lanes.streams.len() {
            let event = self.device.record(&lanes.streams[other]);
            match event.and_then(|event| self.device.wait(stream, &event)) {
                Ok(()) => {}
                Err(_) => self.device.synchronize(&lanes.streams[other])?,
            }
        }
        let lane = lanes.streams.len();
        lanes.streams.push(stream.clone());
        lanes.latest.push(None);
        for row in &mut lanes.pending {
            row.push(EMPTY);
        }
        lanes.pending.push(vec![EMPTY; lane + 1]);
        self.multi.store(true, Ordering::Release);
        Ok(lane)
    }

    /// Whether `address` lies in the group's arena.
    #[inline]
    pub(crate) fn in_arena(&self, address: u64) -> bool {
        let start = self.arena_start.load(Ordering::Relaxed);
        address >= start && address < self.arena_end.load(Ordering::Relaxed)
    }

    /// Before `bytes` at `address` (in the arena) are handed out on lane `lane`: its
    /// stream waits for every other stream that released overlapping bytes it has not
    /// waited for yet.
    ///
    /// # Errors
    ///
    /// When a stream can be ordered neither by an event nor on the host: the bytes must
    /// not be used then.
    pub(crate) fn order_use(&self, lane: usize, address: u64, bytes: usize) -> Result<(), DeviceError> {
        if !self.multi.load(Ordering::Acquire) {
            return Ok(());
        }
        self.order_lane(lane, (address, address.saturating_add(bytes as u64)))
    }

    /// Makes lane `lane`'s stream wait for every other stream that released bytes of
    /// `range` it has not waited for yet, and for the streams that could not be ordered
    /// (on the host): the one ordering step of a reservation and of a free.
    fn order_lane(&self, lane: usize, range: Range) -> Result<(), DeviceError> {
        let mut lanes = self.lock();
        let lanes = &mut *lanes;
        self.settle_unordered(lanes)?;
        let stream = lanes.streams[lane].clone();
        for from in 0..lanes.streams.len() {
            if from == lane || !overlaps(lanes.pending[from][lane], range) {
                continue;
            }
            let ordered = match &lanes.latest[from] {
                Some(event) => self.device.wait(&stream, event),
                None => Ok(()),
            };
            if ordered.is_err() {
                self.device.synchronize(&lanes.streams[from])?;
            }
            lanes.pending[from][lane] = EMPTY;
            lanes.waits += 1;
        }
        Ok(())
    }

    /// Lane `lane` released `range` of the arena: what it issued on those bytes so far
    /// is recorded, for the other streams to wait for before they reuse them. When no
    /// event can be recorded the stream is waited for on the host; when that fails too,
    /// it is kept in `unordered`.
    pub(crate) fn release(&self, lane: usize, range: Range) {
        if !self.multi.load(Ordering::Acquire) || range.0 >= range.1 {
            return;
        }
        let mut lanes = self.lock();
        let lanes = &mut *lanes;
        if let Err(error) = self.publish(lanes, lane, range) {
            if self.device.synchronize(&lanes.streams[lane]).is_err() {
                self.device.defer_error(error);
                let stream = lanes.streams[lane].clone();
                lanes.unordered.push(stream);
            }
        }
    }

    /// Records an event on lane `lane` and notes `range` for every other lane to wait
    /// for: the one recording step of a release and of a new arena.
    fn publish(&self, lanes: &mut Lanes<D>, lane: usize, range: Range) -> Result<(), DeviceError> {
        let event = self.device.record(&lanes.streams[lane])?;
        lanes.latest[lane] = Some(event);
        for (to, pending) in lanes.pending[lane].iter_mut().enumerate() {
            if to != lane {
                *pending = union(*pending, range);
            }
        }
        Ok(())
    }

    /// Keeps `stream` (which used arena bytes and could not be ordered) to be waited
    /// for on the host before anything reuses the arena.
    pub(crate) fn unordered(&self, stream: &D::Stream) {
        let mut lanes = self.lock();
        if !lanes.unordered.contains(stream) {
            lanes.unordered.push(stream.clone());
        }
        // Even with one stream in the group: its reuse must wait for this one now.
        self.multi.store(true, Ordering::Release);
    }

    /// Waits on the host for the streams that could not be ordered.
    fn settle_unordered(&self, lanes: &mut Lanes<D>) -> Result<(), DeviceError> {
        while let Some(stream) = lanes.unordered.last() {
            self.device.synchronize(stream)?;
            lanes.unordered.pop();
        }
        Ok(())
    }

    /// A new arena `[start, end)` was allocated on lane 0: its first use on any other
    /// stream waits for the allocation.
    ///
    /// # Errors
    ///
    /// When the allocation can be ordered neither by an event nor on the host.
    pub(crate) fn arena_allocated(&self, start: u64, end: u64) -> Result<(), DeviceError> {
        if self.multi.load(Ordering::Acquire) {
            let mut lanes = self.lock();
            let lanes = &mut *lanes;
            if self.publish(lanes, 0, (start, end)).is_err() {
                self.device.synchronize(&lanes.streams[0])?;
            }
        }
        self.arena_start.store(start, Ordering::Relaxed);
        self.arena_end.store(end, Ordering::Relaxed);
        Ok(())
    }

    /// Before the arena `[start, end)` is freed on lane 0: lane 0 waits for every other
    /// stream that used it. Returns whether it may be freed (`false`: a stream could not
    /// be ordered, and the arena must be leaked).
    pub(crate) fn before_free(&self, start: u64, end: u64) -> bool {
        if self.arena_start.load(Ordering::Relaxed) == start {
            self.arena_start.store(0, Ordering::Relaxed);
            self.arena_end.store(0, Ordering::Relaxed);
        }
        if !self.multi.load(Ordering::Acquire) {
            return true;
        }
        match self.order_lane(0, (start, end)) {
            Ok(()) => true,
            Err(error) => {
                self.device.defer_error(error);
                false
            }
        }
    }

    /// Waits issued so far to order a reuse of arena bytes after another stream.
    pub(crate) fn waits(&self) -> u64 {
        self.lock().waits
    }

    /// Streams of the group (lane 0 first).
    pub(crate) fn streams(&self) -> usize {
        self.lock().streams.len()
    }
}

impl<D: Device> std::fmt::Debug for Ledger<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger").field("streams", &self.streams()).finish_non_exhaustive()
    }
}
