//! The simulator's streams: one worker thread per stream running its queue in order,
//! events, holds, the device and pinned allocations (freed through the queue), and the
//! execution of each operation against the device memory.

use std::alloc::dealloc;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::Duration;

use super::kernel::QueuedKernel;
use super::memory::{pinned_layout, Memory};
use crate::device::PINNED_ALIGNMENT;
use crate::error::DeviceError;

static NEXT_STREAM: AtomicU64 = AtomicU64::new(1);

/// Operations a stream's queue holds before it grows.
const QUEUE_CAPACITY: usize = 1024;

/// Event flags a device starts with (more are made when more are alive at once).
pub(super) const EVENTS: usize = 64;

/// Locks `mutex`, ignoring poisoning: no simulator code panics while holding a lock,
/// and a user panic elsewhere must not turn every later call into a panic.
pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// State shared by the device handles, its streams and their workers.
pub(super) struct Shared {
    pub(super) id: u64,
    /// Stream queues and statuses, events, faults. Workers and host waits block on
    /// `changed`, which is notified whenever any of it changes.
    pub(super) sched: Mutex<Sched>,
    pub(super) changed: Condvar,
    /// The device memory and the registry of pinned host memory. Every simulated
    /// memory operation runs with this lock held.
    pub(super) memory: Mutex<Memory>,
    /// Testing knob: stream-to-stream waits are skipped.
    pub(super) ignore_waits: AtomicBool,
    /// Testing knob: this many coming `record` calls fail.
    pub(super) failing_records: AtomicUsize,
    /// Every event flag made so far; one that only this list holds is free and handed
    /// out again, so that a steady loop of records allocates nothing.
    pub(super) events: Mutex<Vec<Arc<AtomicBool>>>,
}

#[derive(Default)]
pub(super) struct Sched {
    pub(super) streams: HashMap<u64, StreamState>,
    /// Host threads blocked in `event_synchronize`.
    pub(super) blocked_hosts: usize,
    pub(super) faults: Vec<String>,
    pub(super) deferred: Option<DeviceError>,
}

#[derive(Default)]
pub(super) struct StreamState {
    queue: VecDeque<Op>,
    status: Status,
    /// Outstanding [`SimHold`]s; the worker starts no operation while any is held.
    pub(super) holds: usize,
    /// Every handle of the stream is gone: the worker drains the queue and exits.
    closed: bool,
    /// Sleep before each memory operation.
    pub(super) delay: Duration,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Status {
    /// Nothing queued.
    #[default]
    Idle,
    /// Executing an operation.
    Running,
    /// Held, or waiting for an event.
    Blocked,
}

impl StreamState {
    /// What the worker can do next.
    fn next(&self, ignore_waits: bool) -> Next {
        if self.holds > 0 {
            return Next::Blocked;
        }
        match self.queue.front() {
            None if self.closed => Next::Exit,
            None => Next::Idle,
            Some(Op::Wait(event)) if !ignore_waits && !event.is_done() => Next::Blocked,
            Some(_) => Next::Run,
        }
    }

    pub(super) fn busy(&self, ignore_waits: bool) -> bool {
        self.status == Status::Running || self.next(ignore_waits) == Next::Run
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Next {
    Run,
    Idle,
    Blocked,
    Exit,
}

/// One queued operation. Host addresses are kept as `usize` (the queue crosses threads);
/// see `Shared::execute` for why each access is sound.
// A kernel's arguments are inline (a launch allocates nothing): the largest variant.
#[allow(clippy::large_enum_variant)]
pub(super) enum Op {
    Memset {
        dst: u64,
        len: usize,
    },
    /// Host-to-device from bytes captured when the copy was issued.
    HtodCaptured {
        src: Vec<u8>,
        dst: u64,
    },
    /// Host-to-device from pinned memory, read when the copy runs.
    HtodPinned {
        src: usize,
        dst: u64,
        len: usize,
    },
    /// Device-to-host into pinned memory, written when the copy runs.
    DtohPinned {
        src: u64,
        dst: usize,
        len: usize,
    },
    Dtod {
        src: u64,
        dst: u64,
        len: usize,
    },
    /// A kernel, run on the memory under its lock.
    Kernel(QueuedKernel),
    Record(SimEvent),
    Wait(SimEvent),
    Free(u64),
}

impl Op {
    fn is_memory(&self) -> bool {
        !matches!(self, Op::Record(_) | Op::Wait(_) | Op::Free(_))
    }
}

/// A point in a simulated stream: set when the stream's worker reaches it.
#[derive(Clone, Debug, Default)]
pub struct SimEvent {
    pub(super) done: Arc<AtomicBool>,
}

impl SimEvent {
    pub(super) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }
}

/// A stream of a [`SimDevice`](super::SimDevice): a worker thread running its operations in order.
#[derive(Clone)]
pub struct SimStream {
    pub(super) id: u64,
    pub(super) device: u64,
    token: Arc<StreamToken>,
}

impl PartialEq for SimStream {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

impl fmt::Debug for SimStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SimStream({} of simulated device {})", self.id, self.device)
    }
}

/// Shared by the clones of one stream handle: the last one closes the stream.
struct StreamToken {
    id: u64,
    shared: Arc<Shared>,
}

impl Drop for StreamToken {
    fn drop(&mut self) {
        let mut sched = lock(&self.shared.sched);
        if let Some(state) = sched.streams.get_mut(&self.id) {
            state.closed = true;
        }
        self.shared.changed.notify_all();
    }
}

impl SimStream {
    pub(super) fn enqueue(&self, op: Op) {
        let shared = &self.token.shared;
        let mut sched = lock(&shared.sched);
        if let Some(state) = sched.streams.get_mut(&self.id) {
            state.queue.push_back(op);
        }
        shared.changed.notify_all();
    }
}

/// Keeps a stream from starting operations until dropped; see [`SimDevice::hold`](super::SimDevice::hold).
#[must_use = "the stream is released when the hold is dropped"]
pub struct SimHold {
    pub(super) id: u64,
    pub(super) shared: Arc<Shared>,
}

impl SimHold {
    /// Releases the stream (the same as dropping the hold).
    pub fn release(self) {}
}

impl Drop for SimHold {
    fn drop(&mut self) {
        let mut sched = lock(&self.shared.sched);
        if let Some(state) = sched.streams.get_mut(&self.id) {
            state.holds -= 1;
        }
        self.shared.changed.notify_all();
    }
}

/// A simulated device allocation; dropping it frees it in its stream's order.
pub struct SimMemory {
    pub(super) address: u64,
    pub(super) stream: SimStream,
}

impl fmt::Debug for SimMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SimMemory({:#x} on {:?})", self.address, self.stream)
    }
}

impl Drop for SimMemory {
    fn drop(&mut self) {
        self.stream.enqueue(Op::Free(self.address));
    }
}

/// Host memory that the simulated device treats as pinned; freed (and unregistered)
/// when dropped.
pub struct SimPinned {
    /// Invariant: `PINNED_ALIGNMENT` bytes past the start of an allocation made with
    /// `pinned_layout(len)`, owned here.
    pub(super) ptr: NonNull<u8>,
    pub(super) len: usize,
    pub(super) shared: Arc<Shared>,
}

// SAFETY: a `SimPinned` exclusively owns its allocation (nothing else frees it), and the
// pointer is only its address; moving it to another thread moves that ownership. Which
// thread accesses the bytes is governed by the workspaces' event protocol, not by this
// handle.
unsafe impl Send for SimPinned {}

impl fmt::Debug for SimPinned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SimPinned({:p}, {} bytes)", self.ptr, self.len)
    }
}

impl Drop for SimPinned {
    fn drop(&mut self) {
        {
            // Unregister first, under the memory lock: no simulated copy can reach the
            // bytes after this.
            let mut memory = lock(&self.shared.memory);
            memory.pinned.remove(&(self.ptr.as_ptr() as usize));
            memory.live_pinned -= self.len;
        }
        if let Some(layout) = pinned_layout(self.len) {
            // SAFETY: `ptr - PINNED_ALIGNMENT` is the start of an allocation made in
            // `alloc_pinned` with this very layout (`ptr` invariant), freed once, here.
            unsafe { dealloc(self.ptr.as_ptr().sub(PINNED_ALIGNMENT), layout) };
        }
    }
}

impl Shared {
    pub(super) fn spawn_stream(shared: &Arc<Shared>) -> Result<SimStream, DeviceError> {
        let id = NEXT_STREAM.fetch_add(1, Ordering::Relaxed);
        // Room for a step's operations from the start: a queue that grows while a loop
        // warms up would allocate at whatever step the worker falls furthest behind.
        let state = StreamState { queue: VecDeque::with_capacity(QUEUE_CAPACITY), ..StreamState::default() };
        lock(&shared.sched).streams.insert(id, state);
        let worker_shared = shared.clone();
        let spawned = thread::Builder::new()
            .name(format!("sim-stream-{id}"))
            .spawn(move || Shared::run_worker(&worker_shared, id));
        if let Err(error) = spawned {
            lock(&shared.sched).streams.remove(&id);
            return Err(DeviceError::Driver {
                call: "std::thread::Builder::spawn",
                code: "SIMULATOR_NO_THREAD".into(),
                message: format!("could not start a stream worker: {error}"),
            });
        }
        Ok(SimStream { id, device: shared.id, token: Arc::new(StreamToken { id, shared: shared.clone() }) })
    }

    /// The worker of stream `id`: runs its queue in order until the stream is closed
    /// and drained.
    fn run_worker(shared: &Shared, id: u64) {
        let mut sched = lock(&shared.sched);
        loop {
            let ignore = shared.ignore_waits.load(Ordering::Acquire);
            let Some(state) = sched.streams.get_mut(&id) else { return };
            match state.next(ignore) {
                Next::Exit => {
                    sched.streams.remove(&id);
                    shared.changed.notify_all();
                    return;
                }
                Next::Run => {
                    let Some(op) = state.queue.pop_front() else { continue };
                    state.status = Status::Running;
                    let delay = if op.is_memory() { state.delay } else { Duration::ZERO };
                    drop(sched);
                    if !delay.is_zero() {
                        thread::sleep(delay);
                    }
                    shared.execute(op);
                    sched = lock(&shared.sched);
                }
                idle_or_blocked => {
                    let status = if idle_or_blocked == Next::Idle { Status::Idle } else { Status::Blocked };
                    // Notify only on a change: workers waking each other for nothing
                    // would never rest.
                    if state.status != status {
                        state.status = status;
                        shared.changed.notify_all();
                    }
                    sched = shared.changed.wait(sched).unwrap_or_else(PoisonError::into_inner);
                }
            }
        }
    }

    /// Runs one operation on the calling worker thread.
    fn execute(&self, op: Op) {
        let result = match op {
            Op::Record(event) => {
                let _sched = lock(&self.sched);
                event.done.store(true, Ordering::Release);
                self.changed.notify_all();
                Ok(())
            }
            Op::Wait(_) => Ok(()),
            Op::Free(address) => {
                let mut memory = lock(&self.memory);
                match memory.regions.remove(&address) {
                    Some(data) => {
                        memory.live_bytes -= data.len();
                        Ok(())
                    }
                    None => Err(("free", format!("double free of {address:#x}"))),
                }
            }
            Op::Memset { dst, len } => {
                lock(&self.memory).bytes_mut(dst, len).map(|bytes| bytes.fill(0)).map_err(|e| ("memset", e))
            }
            Op::HtodCaptured { src, dst } => lock(&self.memory)
                .bytes_mut(dst, src.len())
                .map(|bytes| bytes.copy_from_slice(&src))
                .map_err(|e| ("htod", e)),
            Op::HtodPinned { src, dst, len } => {
                let mut memory = lock(&self.memory);
                memory
                    .check_pinned(src, len)
                    .and_then(|()| memory.bytes_mut(dst, len))
                    .map(|bytes| {
                        // SAFETY: `src..src+len` is registered pinned memory (checked just above,
                        // under the memory lock that `SimPinned::drop` takes before freeing it),
                        // and `copy_htod_pinned`'s contract keeps the host from writing it
                        // until this copy has completed.
                        let source = unsafe { std::slice::from_raw_parts(src as *const u8, len) };
                        bytes.copy_from_slice(source);
                    })
                    .map_err(|e| ("htod", e))
            }
            Op::DtohPinned { src, dst, len } => {
                let memory = lock(&self.memory);
                memory
                    .check_pinned(dst, len)
                    .and_then(|()| memory.bytes(src, len))
                    .map(|bytes| {
                        // SAFETY: `dst..dst+len` is registered pinned memory (checked under the
                        // lock, as above), and `copy_dtoh_pinned`'s contract keeps the host
                        // from touching it until this copy has completed.
                        let target = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len) };
                        target.copy_from_slice(bytes);
                    })
                    .map_err(|e| ("dtoh", e))
            }
            Op::Kernel(kernel) => kernel.run(&mut lock(&self.memory)).map_err(|e| (kernel.name, e)),
            Op::Dtod { src, dst, len } => {
                let mut memory = lock(&self.memory);
                memory
                    .bytes(src, len)
                    .map(<[u8]>::to_vec)
                    .and_then(|data| memory.bytes_mut(dst, len).map(|bytes| bytes.copy_from_slice(&data)))
                    .map_err(|e| ("dtod", e))
            }
        };
        if let Err((op, detail)) = result {
            let mut sched = lock(&self.sched);
            sched.faults.push(format!("{op}: {detail}"));
            sched.deferred.get_or_insert(DeviceError::Fault { op, detail });
        }
    }
}
