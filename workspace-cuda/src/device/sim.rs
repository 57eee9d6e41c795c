//! A simulated device in host memory, with CUDA's stream and event ordering.
//!
//! Each stream is a worker thread that runs its operations in issue order; an event is
//! a flag set when the worker reaches it; a wait holds the worker until the flag is set.
//! Device memory is a registry of byte vectors at made-up addresses that are never
//! reused, and every operation checks its range against the registry under one lock,
//! so a use after free or out of bounds is recorded as a fault (the simulator's
//! `CUDA_ERROR_ILLEGAL_ADDRESS`, see [`SimDevice::faults`]) instead of touching memory
//! that is gone. Fresh allocations are filled with [`POISON`].
//!
//! Allocations are aligned to exactly what [`Device`] promises and no more: a device
//! address is an odd multiple of [`DEVICE_ALIGNMENT`], a pinned one an odd multiple of
//! [`PINNED_ALIGNMENT`]. Code that counts on more alignment than it asked for fails on
//! the simulator every time, not by the luck of where an allocation landed.
//!
//! Knobs make ordering mistakes observable in tests without timing: [`SimDevice::hold`]
//! stops a stream until released, [`SimDevice::quiesce`] waits until every stream has run
//! all it can, [`SimDevice::set_delay`] slows a stream's memory operations, and
//! [`SimDevice::ignore_stream_waits`] drops every stream-to-stream wait, which is what a
//! missing wait would do.
//!
//! ```
//! use workspace_cuda::device::sim::SimDevice;
//! use workspace_cuda::Device;
//!
//! let sim = SimDevice::new()?;
//! let (home, copy) = (sim.default_stream(), sim.new_stream()?);
//! let memory = sim.alloc(&home, 256)?;
//! let address = SimDevice::memory_address(&memory);
//! // SAFETY: the allocation outlives both operations, which are ordered by the event.
//! unsafe { sim.copy_htod(&home, &[7; 256], address)? };
//! let written = sim.record(&home)?;
//! sim.wait(&copy, &written)?;
//! let mut out = [0u8; 256];
//! // SAFETY: as above.
//! unsafe { sim.copy_dtoh(&copy, address, &mut out)? };
//! assert_eq!(out, [7; 256]);
//! assert!(sim.faults().is_empty());
//! # Ok::<(), workspace_cuda::DeviceError>(())
//! ```

mod kernel;
mod memory;
mod queue;

use std::alloc::alloc;
use std::collections::BTreeMap;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use kernel::QueuedKernel;
pub use kernel::{Bytes, SimAccess, SimKernel, MAX_KERNEL_BYTES};
use memory::Memory;
use queue::{lock, Op, Sched, Shared};
pub use queue::{SimEvent, SimHold, SimMemory, SimPinned, SimStream};

use super::{sealed, Device, DEVICE_ALIGNMENT, PINNED_ALIGNMENT};
use crate::error::DeviceError;

/// Byte value of fresh simulated device memory: data nobody wrote reads as `0xA5`.
pub const POISON: u8 = 0xA5;

/// Simulated device addresses start here: an odd multiple of [`DEVICE_ALIGNMENT`]. They
/// are never dereferenced on the host.
const ADDRESS_BASE: u64 = 0x7e00_0000_0000 + DEVICE_ALIGNMENT as u64;
/// Unused addresses between simulated allocations, so an overrun lands in no allocation.
/// Allocations start [`ADDRESS_STRIDE`]-aligned plus [`DEVICE_ALIGNMENT`], so every
/// address is an odd multiple of the device alignment.
const GUARD: u64 = 1 << 20;
/// Allocations take multiples of this much address space (guard included).
const ADDRESS_STRIDE: u64 = 1 << 21;

static NEXT_DEVICE: AtomicU64 = AtomicU64::new(1);

/// A device in host memory that keeps CUDA's ordering rules; see the module docs.
///
/// Cheap to clone: clones are handles to the same device.
#[derive(Clone)]
pub struct SimDevice {
    shared: Arc<Shared>,
    default: SimStream,
}

impl fmt::Debug for SimDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SimDevice({})", self.shared.id)
    }
}

impl SimDevice {
    /// A simulated device with unlimited memory and one stream (its default stream).
    ///
    /// # Errors
    ///
    /// When the stream's worker thread cannot be started.
    pub fn new() -> Result<SimDevice, DeviceError> {
        SimDevice::with_memory_limit(usize::MAX)
    }

    /// A simulated device whose allocations fail with [`DeviceError::OutOfMemory`] past
    /// `bytes` bytes of live device memory.
    ///
    /// # Errors
    ///
    /// When the default stream's worker thread cannot be started.
    pub fn with_memory_limit(bytes: usize) -> Result<SimDevice, DeviceError> {
        let shared = Arc::new(Shared {
            id: NEXT_DEVICE.fetch_add(1, Ordering::Relaxed),
            sched: Mutex::new(Sched::default()),
            changed: Condvar::new(),
            memory: Mutex::new(Memory {
                regions: BTreeMap::new(),
                next: ADDRESS_BASE,
                live_bytes: 0,
                limit: bytes,
                pinned: BTreeMap::new(),
                live_pinned: 0,
            }),
            ignore_waits: AtomicBool::new(false),
            failing_records: AtomicUsize::new(0),
            events: Mutex::new((0..queue::EVENTS).map(|_| Arc::new(AtomicBool::new(false))).collect()),
        });
        let default = Shared::spawn_stream(&shared)?;
        Ok(SimDevice { shared, default })
    }

    /// An event not yet reached: a flag no other event or queued record holds (one the
    /// list alone holds is free: nothing can observe it any more), or a new one.
    fn fresh_event(&self) -> SimEvent {
        let mut events = lock(&self.shared.events);
        let done = match events.iter().find(|flag| Arc::strong_count(flag) == 1) {
            Some(free) => {
                free.store(false, Ordering::Release);
                free.clone()
            }
            None => {
                let flag = Arc::new(AtomicBool::new(false));
                // Bounded: more flags alive at once than this are made and dropped.
                if events.len() < 1024 {
                    events.push(flag.clone());
                }
                flag
            }
        };
        SimEvent { done }
    }

    /// Runs `kernel` on `stream`, in its order, on the simulated memory (see
    /// [`SimKernel`]). Safe where a CUDA launch is not: every range the kernel touches is
    /// checked when it runs, and a bad one is a fault ([`SimDevice::faults`]), as a
    /// kernel that panics is.
    ///
    /// # Errors
    ///
    /// When `stream` belongs to another device.
    pub fn launch<K: SimKernel>(&self, stream: &SimStream, kernel: K) -> Result<(), DeviceError> {
        self.check_stream(stream, "launch")?;
        stream.enqueue(Op::Kernel(QueuedKernel::new(kernel)));
        Ok(())
    }

    /// Makes `stream` sleep for `delay` before each memory operation (memset, copies);
    /// `Duration::ZERO` turns it off.
    pub fn set_delay(&self, stream: &SimStream, delay: Duration) {
        if let Some(state) = lock(&self.shared.sched).streams.get_mut(&stream.id) {
            state.delay = delay;
        }
    }

    /// Stops `stream` from starting operations until the returned hold is dropped; work
    /// already running finishes. The deterministic form of an unbounded delay.
    pub fn hold(&self, stream: &SimStream) -> SimHold {
        if let Some(state) = lock(&self.shared.sched).streams.get_mut(&stream.id) {
            state.holds += 1;
        }
        SimHold { id: stream.id, shared: self.shared.clone() }
    }

    /// Blocks until every stream of this device is idle or blocked (held, or waiting for
    /// an event that is not complete): everything that can run has run.
    pub fn quiesce(&self) {
        let mut sched = lock(&self.shared.sched);
        loop {
            let ignore = self.shared.ignore_waits.load(Ordering::Acquire);
            if !sched.streams.values().any(|state| state.busy(ignore)) {
                return;
            }
            sched = self.shared.changed.wait(sched).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Testing knob: with `true`, every stream-to-stream wait is skipped, as if the code
    /// under test had forgotten it. Tests use it to show that the hazard a wait prevents
    /// is observable. Host waits (`synchronize`, `event_synchronize`) still wait.
    pub fn ignore_stream_waits(&self, ignore: bool) {
        self.shared.ignore_waits.store(ignore, Ordering::Release);
        let _sched = lock(&self.shared.sched);
        self.shared.changed.notify_all();
    }

    /// Testing knob: the next `count` calls of [`Device::record`] fail (as a driver error
    /// would), so that tests reach the paths that cope with a failed ordering.
    pub fn fail_next_records(&self, count: usize) {
        self.shared.failing_records.store(count, Ordering::Release);
    }

    /// Every fault so far (operations on memory that is not allocated), oldest first.
    pub fn faults(&self) -> Vec<String> {
        lock(&self.shared.sched).faults.clone()
    }

    /// Bytes of device memory allocated and not yet freed in stream order.
    pub fn live_device_bytes(&self) -> usize {
        lock(&self.shared.memory).live_bytes
    }

    /// Bytes of pinned host memory allocated and not yet freed.
    pub fn live_pinned_bytes(&self) -> usize {
        lock(&self.shared.memory).live_pinned
    }

    /// Host threads blocked waiting for an event of this device now.
    pub fn blocked_host_threads(&self) -> usize {
        lock(&self.shared.sched).blocked_hosts
    }

    /// Reads `len` bytes of device memory at `address` now, outside any stream order
    /// (for tests that inspect what a stream left behind); `None` when the range is not
    /// allocated.
    pub fn read_now(&self, address: u64, len: usize) -> Option<Vec<u8>> {
        lock(&self.shared.memory).bytes(address, len).ok().map(<[u8]>::to_vec)
    }

    fn check_stream(&self, stream: &SimStream, op: &'static str) -> Result<(), DeviceError> {
        if stream.device == self.shared.id {
            Ok(())
        } else {
            Err(DeviceError::Fault { op, detail: format!("{stream:?} belongs to another simulated device") })
        }
    }
}

impl sealed::Sealed for SimDevice {}

impl Device for SimDevice {
    type Stream = SimStream;
    type Event = SimEvent;
    type Memory = SimMemory;
    type PinnedMemory = SimPinned;

    const ARENA_KIND: &'static str = "sim-device";
    const PINNED_KIND: &'static str = "sim-pinned";

    fn describe(&self) -> String {
        format!("simulated device {}", self.shared.id)
    }

    fn same_device(&self, other: &Self) -> bool {
        self.shared.id == other.shared.id
    }

    fn default_stream(&self) -> SimStream {
        self.default.clone()
    }

    fn new_stream(&self) -> Result<SimStream, DeviceError> {
        Shared::spawn_stream(&self.shared)
    }

    fn owns_stream(&self, stream: &SimStream) -> bool {
        stream.device == self.shared.id
    }

    fn alloc(&self, stream: &SimStream, bytes: usize) -> Result<SimMemory, DeviceError> {
        self.check_stream(stream, "alloc")?;
        let oom = DeviceError::OutOfMemory { bytes, what: "device" };
        let mut memory = lock(&self.shared.memory);
        if memory.live_bytes.checked_add(bytes).is_none_or(|total| total > memory.limit) {
            return Err(oom);
        }
        let next = u64::try_from(bytes)
            .ok()
            .and_then(|bytes| bytes.checked_add(GUARD))
            .and_then(|span| span.checked_next_multiple_of(ADDRESS_STRIDE))
            .and_then(|span| memory.next.checked_add(span))
            .ok_or_else(|| oom.clone())?;
        let mut data = Vec::new();
        data.try_reserve_exact(bytes).map_err(|_| oom)?;
        data.resize(bytes, POISON);
        let address = memory.next;
        memory.next = next;
        memory.live_bytes += bytes;
        memory.regions.insert(address, data);
        Ok(SimMemory { address, stream: stream.clone() })
    }

    fn memory_address(memory: &SimMemory) -> u64 {
        memory.address
    }

    fn alloc_pinned(&self, bytes: usize) -> Result<SimPinned, DeviceError> {
        let oom = DeviceError::OutOfMemory { bytes, what: "pinned host" };
        if bytes == 0 {
            return Err(oom);
        }
        let layout = memory::pinned_layout(bytes).ok_or_else(|| oom.clone())?;
        // SAFETY: `layout` has a non-zero size.
        let start = NonNull::new(unsafe { alloc(layout) }).ok_or(oom)?;
        // SAFETY: the allocation has `PINNED_ALIGNMENT + bytes` bytes, so the offset stays
        // inside it; `start` is aligned to twice `PINNED_ALIGNMENT`, so `ptr` is an odd
        // multiple of it.
        let ptr = unsafe { start.add(PINNED_ALIGNMENT) };
        let mut memory = lock(&self.shared.memory);
        memory.pinned.insert(ptr.as_ptr() as usize, bytes);
        memory.live_pinned += bytes;
        Ok(SimPinned { ptr, len: bytes, shared: self.shared.clone() })
    }

    fn pinned_address(memory: &SimPinned) -> NonNull<u8> {
        memory.ptr
    }

    fn record(&self, stream: &SimStream) -> Result<SimEvent, DeviceError> {
        self.check_stream(stream, "record")?;
        let failing = &self.shared.failing_records;
        if failing.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1)).is_ok() {
            return Err(DeviceError::Driver {
                call: "record",
                code: "SIMULATED_FAILURE".into(),
                message: "failure injected by SimDevice::fail_next_records".into(),
            });
        }
        let event = self.fresh_event();
        stream.enqueue(Op::Record(event.clone()));
        Ok(event)
    }

    fn wait(&self, stream: &SimStream, event: &SimEvent) -> Result<(), DeviceError> {
        self.check_stream(stream, "wait")?;
        stream.enqueue(Op::Wait(event.clone()));
        Ok(())
    }

    fn event_synchronize(&self, event: &SimEvent) -> Result<(), DeviceError> {
        let mut sched = lock(&self.shared.sched);
        sched.blocked_hosts += 1;
        self.shared.changed.notify_all();
        while !event.is_done() {
            sched = self.shared.changed.wait(sched).unwrap_or_else(PoisonError::into_inner);
        }
        sched.blocked_hosts -= 1;
        self.shared.changed.notify_all();
        Ok(())
    }

    fn event_complete(&self, event: &SimEvent) -> bool {
        event.is_done()
    }

    fn synchronize(&self, stream: &SimStream) -> Result<(), DeviceError> {
        let event = self.record(stream)?;
        self.event_synchronize(&event)
    }

    unsafe fn memset_zero(&self, stream: &SimStream, dst: u64, bytes: usize) -> Result<(), DeviceError> {
        self.check_stream(stream, "memset")?;
        stream.enqueue(Op::Memset { dst, len: bytes });
        Ok(())
    }

    unsafe fn copy_htod(&self, stream: &SimStream, src: &[u8], dst: u64) -> Result<(), DeviceError> {
        self.check_stream(stream, "htod")?;
        stream.enqueue(Op::HtodCaptured { src: src.to_vec(), dst });
        Ok(())
    }

    unsafe fn copy_htod_pinned(
        &self,
        stream: &SimStream,
        src: NonNull<u8>,
        dst: u64,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        self.check_stream(stream, "htod")?;
        stream.enqueue(Op::HtodPinned { src: src.as_ptr() as usize, dst, len: bytes });
        Ok(())
    }

    unsafe fn copy_dtoh(&self, stream: &SimStream, src: u64, dst: &mut [u8]) -> Result<(), DeviceError> {
        // Everything issued to the stream before this copy completes first; the copy
        // itself then runs on the calling thread, so a fault is reported right here.
        self.synchronize(stream)?;
        let memory = lock(&self.shared.memory);
        let bytes = memory.bytes(src, dst.len()).map_err(|detail| DeviceError::Fault { op: "dtoh", detail })?;
        dst.copy_from_slice(bytes);
        Ok(())
    }

    unsafe fn copy_dtoh_pinned(
        &self,
        stream: &SimStream,
        src: u64,
        dst: NonNull<u8>,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        self.check_stream(stream, "dtoh")?;
        stream.enqueue(Op::DtohPinned { src, dst: dst.as_ptr() as usize, len: bytes });
        Ok(())
    }

    unsafe fn copy_dtod(&self, stream: &SimStream, src: u64, dst: u64, bytes: usize) -> Result<(), DeviceError> {
        self.check_stream(stream, "dtod")?;
        stream.enqueue(Op::Dtod { src, dst, len: bytes });
        Ok(())
    }

    fn defer_error(&self, error: DeviceError) {
        lock(&self.shared.sched).deferred.get_or_insert(error);
    }

    fn take_deferred_error(&self) -> Option<DeviceError> {
        lock(&self.shared.sched).deferred.take()
    }
}

#[cfg(test)]
mod tests {
    use std::thread;

    use super::*;

    fn filled(sim: &SimDevice, stream: &SimStream, byte: u8, len: usize) -> SimMemory {
        let memory = sim.alloc(stream, len).unwrap();
        // SAFETY: the allocation outlives the copy (it is freed in the same stream's order).
        unsafe { sim.copy_htod(stream, &vec![byte; len], SimDevice::memory_address(&memory)).unwrap() };
        memory
    }

    #[test]
    fn fresh_memory_is_poisoned_and_addresses_are_aligned_and_never_reused() {
        let sim = SimDevice::new().unwrap();
        let stream = sim.default_stream();
        let a = sim.alloc(&stream, 100).unwrap();
        let address = SimDevice::memory_address(&a);
        assert_eq!(address % DEVICE_ALIGNMENT as u64, 0);
        assert_ne!(address % (2 * DEVICE_ALIGNMENT) as u64, 0, "no more alignment than promised");
        assert_eq!(sim.read_now(address, 100), Some(vec![POISON; 100]));
        drop(a);
        let b = sim.alloc(&stream, 100).unwrap();
        assert_ne!(SimDevice::memory_address(&b), address);
        sim.synchronize(&stream).unwrap();
        assert_eq!(sim.read_now(address, 1), None, "freed in stream order");
        assert_eq!(sim.live_device_bytes(), 100);
    }

    #[test]
    fn one_stream_runs_in_issue_order() {
        let sim = SimDevice::new().unwrap();
        let stream = sim.default_stream();
        sim.set_delay(&stream, Duration::from_millis(2));
        let a = filled(&sim, &stream, 1, 64);
        let address = SimDevice::memory_address(&a);
        // SAFETY: `a` outlives the operations, all on its stream.
        unsafe {
            sim.memset_zero(&stream, address, 32).unwrap();
            sim.copy_htod(&stream, &[9; 8], address + 8).unwrap();
        }
        let mut out = [0u8; 64];
        // SAFETY: as above.
        unsafe { sim.copy_dtoh(&stream, address, &mut out).unwrap() };
        let mut expected = [1u8; 64];
        expected[..32].fill(0);
        expected[8..16].fill(9);
        assert_eq!(out, expected);
    }

    #[test]
    fn a_wait_orders_two_streams_and_ignoring_it_shows_the_race() {
        for ignore in [false, true] {
            let sim = SimDevice::new().unwrap();
            let (first, second) = (sim.default_stream(), sim.new_stream().unwrap());
            let src = filled(&sim, &first, 1, 256);
            let dst = sim.alloc(&second, 256).unwrap();
            sim.synchronize(&first).unwrap();
            sim.ignore_stream_waits(ignore);
            let hold = sim.hold(&first);
            // SAFETY: both allocations outlive the copies.
            unsafe { sim.copy_htod(&first, &[2; 256], SimDevice::memory_address(&src)).unwrap() };
            let written = sim.record(&first).unwrap();
            sim.wait(&second, &written).unwrap();
            // SAFETY: as above.
            unsafe {
                sim.copy_dtod(&second, SimDevice::memory_address(&src), SimDevice::memory_address(&dst), 256).unwrap()
            };
            sim.quiesce();
            hold.release();
            sim.synchronize(&second).unwrap();
            sim.synchronize(&first).unwrap();
            let seen = sim.read_now(SimDevice::memory_address(&dst), 1).unwrap()[0];
            assert_eq!(seen, if ignore { 1 } else { 2 }, "ignore_stream_waits = {ignore}");
        }
    }

    #[test]
    fn use_after_free_is_a_fault_not_a_crash() {
        let sim = SimDevice::new().unwrap();
        let stream = sim.default_stream();
        let a = filled(&sim, &stream, 3, 64);
        let address = SimDevice::memory_address(&a);
        drop(a);
        // SAFETY: deliberately wrong (the memory is freed); the simulator checks every
        // range, so this is recorded as a fault and touches nothing.
        unsafe { sim.memset_zero(&stream, address, 64).unwrap() };
        sim.synchronize(&stream).unwrap();
        assert_eq!(sim.faults().len(), 1, "{:?}", sim.faults());
        assert!(sim.faults()[0].contains("memset"), "{:?}", sim.faults());
        assert!(matches!(sim.take_deferred_error(), Some(DeviceError::Fault { op: "memset", .. })));
        assert!(sim.take_deferred_error().is_none(), "reported once");
        let mut out = [0u8; 4];
        // SAFETY: as above: checked, reported as an error.
        let err = unsafe { sim.copy_dtoh(&stream, address, &mut out) }.unwrap_err();
        assert!(err.to_string().contains("no allocation") || err.to_string().contains("use after free"), "{err}");
    }

    /// `out[i] = a[i] + b[i]` over `n` f32s, or a deliberate panic.
    #[derive(Clone, Copy)]
    struct Add {
        a: u64,
        b: u64,
        out: u64,
        n: usize,
        panic: bool,
    }

    impl SimKernel for Add {
        fn name(&self) -> &'static str {
            "add"
        }

        fn run(&self, memory: &mut SimAccess<'_>) -> Result<(), String> {
            assert!(!self.panic, "asked to panic");
            let bytes = |at| Bytes::of::<f32>(at, self.n).ok_or("overflow");
            let ([a, b], [out]) = memory.io([bytes(self.a)?, bytes(self.b)?], [bytes(self.out)?])?;
            let cast = |e: bytemuck::PodCastError| e.to_string();
            let (a, b) = (
                bytemuck::try_cast_slice::<u8, f32>(a).map_err(cast)?,
                bytemuck::try_cast_slice::<u8, f32>(b).map_err(cast)?,
            );
            let out = bytemuck::try_cast_slice_mut::<u8, f32>(out).map_err(cast)?;
            for ((o, a), b) in out.iter_mut().zip(a).zip(b) {
                *o = a + b;
            }
            Ok(())
        }
    }

    #[test]
    fn kernels_run_in_stream_order_and_bad_ranges_are_faults() {
        let sim = SimDevice::new().unwrap();
        let stream = sim.default_stream();
        let memory = sim.alloc(&stream, 3 * 64 * 4).unwrap();
        let base = SimDevice::memory_address(&memory);
        let values: Vec<u8> = (0..128).flat_map(|i| (i as f32).to_ne_bytes()).collect();
        let (a, b, out) = (base, base + 256, base + 512);
        // SAFETY: the allocation outlives every operation, all on one stream.
        unsafe { sim.copy_htod(&stream, &values, a).unwrap() };
        let add = Add { a, b, out, n: 64, panic: false };
        sim.launch(&stream, add).unwrap();
        let mut bytes = vec![0u8; 256];
        // SAFETY: as above.
        unsafe { sim.copy_dtoh(&stream, out, &mut bytes).unwrap() };
        let sums: Vec<f32> = bytes.chunks(4).map(|c| f32::from_ne_bytes(c.try_into().unwrap())).collect();
        assert_eq!(
            sums,
            (0..64).map(|i| (2 * i + 64) as f32).collect::<Vec<_>>(),
            "ran after the copy, before the read"
        );
        assert!(sim.faults().is_empty(), "{:?}", sim.faults());

        // Past the allocation, written over its own input, and a panic: three faults,
        // and the stream runs on.
        sim.launch(&stream, Add { out: base + 3 * 256 - 4, ..add }).unwrap();
        sim.launch(&stream, Add { out: a + 4, ..add }).unwrap();
        sim.launch(&stream, Add { panic: true, ..add }).unwrap();
        sim.synchronize(&stream).unwrap();
        let faults = sim.faults();
        assert_eq!(faults.len(), 3, "{faults:?}");
        assert!(faults[0].starts_with("add:") && faults[0].contains("not inside one allocation"), "{faults:?}");
        assert!(faults[1].contains("overlap"), "{faults:?}");
        assert!(faults[2].contains("panicked"), "{faults:?}");
        assert!(matches!(sim.take_deferred_error(), Some(DeviceError::Fault { op: "add", .. })));
        // Freed memory is a fault, not a read of memory that is gone.
        drop(memory);
        sim.launch(&stream, add).unwrap();
        sim.synchronize(&stream).unwrap();
        assert!(sim.faults()[3].contains("use after free"), "{:?}", sim.faults());
    }

    #[test]
    fn memory_limit_and_pinned_registry() {
        let sim = SimDevice::with_memory_limit(1000).unwrap();
        let stream = sim.default_stream();
        let a = sim.alloc(&stream, 600).unwrap();
        assert!(matches!(sim.alloc(&stream, 600), Err(DeviceError::OutOfMemory { bytes: 600, .. })));
        drop(a);
        sim.synchronize(&stream).unwrap();
        let b = sim.alloc(&stream, 600).unwrap();
        let pinned = sim.alloc_pinned(300).unwrap();
        let host = SimDevice::pinned_address(&pinned);
        assert_eq!(host.as_ptr() as usize % PINNED_ALIGNMENT, 0);
        assert_ne!(host.as_ptr() as usize % (2 * PINNED_ALIGNMENT), 0, "no more alignment than promised");
        assert_eq!(sim.live_pinned_bytes(), 300);
        // SAFETY: `pinned` is live and the host does not touch it until the stream is
        // synchronised; `b` outlives the copies.
        unsafe {
            sim.copy_dtoh_pinned(&stream, SimDevice::memory_address(&b), host, 300).unwrap();
            sim.copy_htod_pinned(&stream, host, SimDevice::memory_address(&b) + 300, 300).unwrap();
        }
        sim.synchronize(&stream).unwrap();
        assert!(sim.faults().is_empty(), "{:?}", sim.faults());
        assert_eq!(sim.read_now(SimDevice::memory_address(&b) + 300, 300), Some(vec![POISON; 300]));
        drop(pinned);
        assert_eq!(sim.live_pinned_bytes(), 0);
        assert!(matches!(sim.alloc_pinned(0), Err(DeviceError::OutOfMemory { .. })));
    }

    #[test]
    fn streams_of_another_device_are_refused() {
        let (a, b) = (SimDevice::new().unwrap(), SimDevice::new().unwrap());
        assert!(!a.owns_stream(&b.default_stream()));
        assert!(!a.same_device(&b) && a.same_device(&a.clone()));
        let err = a.alloc(&b.default_stream(), 16).unwrap_err();
        assert!(err.to_string().contains("another simulated device"), "{err}");
    }

    #[test]
    fn quiesce_returns_when_streams_are_blocked_and_host_waiters_are_counted() {
        let sim = SimDevice::new().unwrap();
        let (first, second) = (sim.default_stream(), sim.new_stream().unwrap());
        let hold = sim.hold(&first);
        let never_yet = sim.record(&first).unwrap();
        sim.wait(&second, &never_yet).unwrap();
        sim.quiesce();
        assert!(!sim.event_complete(&never_yet));
        let waiter = {
            let sim = sim.clone();
            let event = never_yet.clone();
            thread::spawn(move || sim.event_synchronize(&event))
        };
        while sim.blocked_host_threads() == 0 {
            thread::yield_now();
        }
        drop(hold);
        waiter.join().unwrap().unwrap();
        sim.synchronize(&second).unwrap();
        assert!(sim.event_complete(&never_yet));
    }
}
