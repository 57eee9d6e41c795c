//! The device layer: what workspaces need from a GPU, and its two implementations.
//!
//! [`Device`] is a thin, fallible interface in the style of cudarc's `result` layer:
//! stream-ordered allocation, streams, events, memset and copies on raw device
//! addresses. [`CudaDevice`](cuda::CudaDevice) implements it over cudarc;
//! [`SimDevice`](sim::SimDevice) implements it in host memory with one worker thread
//! per stream, so that every ordering rule of the workspaces is exercised without a GPU.
//!
//! # The ordering model (CUDA's, which the simulator reproduces)
//!
//! - Operations on one stream run in the order they were issued.
//! - Operations on different streams run in any order, unless ordered by an event: work
//!   issued to a stream after [`Device::wait`] runs only once the work captured by
//!   [`Device::record`] on the other stream is complete.
//! - Freeing memory (dropping a [`Device::Memory`]) is an operation on the stream it was
//!   allocated on: the memory stays valid for every operation issued to that stream
//!   before the drop, and for nothing else.

pub mod cuda;
pub mod sim;

use std::fmt;
use std::ptr::NonNull;

use crate::error::DeviceError;

/// Alignment of every device allocation and of every offset in a device workspace
/// (cudaMalloc's guarantee, and what coalesced loads want).
pub const DEVICE_ALIGNMENT: usize = 256;

/// Alignment of pinned host blocks (a page).
pub const PINNED_ALIGNMENT: usize = 4096;

/// The largest alignment a device or pinned workspace can be configured with (2 MiB, a
/// large page of GPU and host memory). The driver aligns allocations to
/// [`DEVICE_ALIGNMENT`] (device) or [`PINNED_ALIGNMENT`] (pinned), so a larger
/// alignment is met by padding every arena and spill block, by up to the alignment: a
/// configuration beyond this limit would pad each block by more than most of them hold,
/// and is refused when the workspace is created.
pub const MAX_DEVICE_ALIGNMENT: usize = 2 << 20;

pub(crate) mod sealed {
    /// Only this crate implements [`Device`](super::Device): workspaces rely on every
    /// implementation keeping the ordering model of the module docs.
    pub trait Sealed {}
}

/// A device that workspaces can carve memory from; see the module docs for the ordering
/// model every implementation keeps.
///
/// Implemented by [`CudaDevice`](cuda::CudaDevice) and [`SimDevice`](sim::SimDevice) only
/// (the trait is sealed). Code generic over `D: Device` runs on both: that is how one
/// test suite checks the simulator on CI and a real GPU where there is one.
///
/// The workspaces' unsafe code relies on more than the `unsafe fn`s' contracts: that
/// [`Device::alloc`] and [`Device::alloc_pinned`] return at least the bytes asked for,
/// aligned as documented, that [`Device::memory_address`] and [`Device::pinned_address`]
/// name them, that the ordering model holds, and that two streams compare equal only
/// when they are the same stream (equal streams are not ordered with events). That is
/// why the trait is sealed rather than implementable by anyone:
///
/// ```compile_fail
/// #[derive(Clone, Debug)]
/// struct MyGpu;
/// impl workspace_cuda::device::sealed::Sealed for MyGpu {} // error: module `sealed` is private
/// ```
pub trait Device: sealed::Sealed + Clone + Send + Sync + fmt::Debug + 'static {
    /// A queue of device work. Clones name the same stream.
    type Stream: Clone + PartialEq + Send + Sync + fmt::Debug;
    /// A point in a stream's work, recorded by [`Device::record`].
    type Event: Clone + Send + Sync + fmt::Debug;
    /// An owned device allocation; dropping it frees it, ordered on the stream it was
    /// allocated on.
    type Memory: Send + fmt::Debug;
    /// An owned allocation of page-locked host memory; dropping it frees it at once, so
    /// no transfer may still use it then.
    type PinnedMemory: Send + fmt::Debug;

    /// Backend name of device arenas in statistics tables.
    const ARENA_KIND: &'static str;
    /// Backend name of pinned arenas in statistics tables.
    const PINNED_KIND: &'static str;

    /// The device in words ("NVIDIA H200 (ordinal 0)", "simulated device 3").
    fn describe(&self) -> String;
    /// Whether `other` is the same device (memory of one is usable by the other).
    fn same_device(&self, other: &Self) -> bool;
    /// The stream this device handle was created with.
    fn default_stream(&self) -> Self::Stream;
    /// A new stream, unordered with every other stream.
    ///
    /// # Errors
    ///
    /// When the driver cannot create one.
    fn new_stream(&self) -> Result<Self::Stream, DeviceError>;
    /// Whether `stream` belongs to this device.
    fn owns_stream(&self, stream: &Self::Stream) -> bool;

    /// Allocates `bytes` (> 0) bytes of device memory, aligned to [`DEVICE_ALIGNMENT`],
    /// ordered on `stream`. The contents are unspecified.
    ///
    /// # Errors
    ///
    /// [`DeviceError::OutOfMemory`] when the device is full, or a driver error.
    fn alloc(&self, stream: &Self::Stream, bytes: usize) -> Result<Self::Memory, DeviceError>;
    /// The device address of an allocation.
    fn memory_address(memory: &Self::Memory) -> u64;

    /// Allocates `bytes` (> 0) bytes of page-locked host memory, aligned to
    /// [`PINNED_ALIGNMENT`]. The contents are unspecified.
    ///
    /// # Errors
    ///
    /// [`DeviceError::OutOfMemory`] when the pinned pool is exhausted, or a driver error.
    fn alloc_pinned(&self, bytes: usize) -> Result<Self::PinnedMemory, DeviceError>;
    /// The host address of a pinned allocation.
    fn pinned_address(memory: &Self::PinnedMemory) -> NonNull<u8>;

    /// Records the work issued to `stream` so far.
    ///
    /// # Errors
    ///
    /// A driver error.
    fn record(&self, stream: &Self::Stream) -> Result<Self::Event, DeviceError>;
    /// Makes work issued to `stream` from now on wait for `event`.
    ///
    /// # Errors
    ///
    /// A driver error.
    fn wait(&self, stream: &Self::Stream, event: &Self::Event) -> Result<(), DeviceError>;
    /// Blocks the calling thread until `event` is complete.
    ///
    /// # Errors
    ///
    /// A driver error (including errors of the work the event waits for).
    fn event_synchronize(&self, event: &Self::Event) -> Result<(), DeviceError>;
    /// Whether the work captured by `event` is complete (never blocks).
    fn event_complete(&self, event: &Self::Event) -> bool;
    /// Blocks the calling thread until all work issued to `stream` is complete.
    ///
    /// # Errors
    ///
    /// A driver error (including errors of the work on the stream).
    fn synchronize(&self, stream: &Self::Stream) -> Result<(), DeviceError>;

    /// Sets `bytes` bytes at `dst` to zero, ordered on `stream`.
    ///
    /// # Errors
    ///
    /// A driver error.
    ///
    /// # Safety
    ///
    /// `dst..dst + bytes` must lie in one allocation of this device that stays
    /// allocated, and is written by no other stream, until the operation completes in
    /// `stream`'s order.
    unsafe fn memset_zero(&self, stream: &Self::Stream, dst: u64, bytes: usize) -> Result<(), DeviceError>;

    /// Copies `src` (host memory) to `dst`, ordered on `stream`. `src` is read before
    /// this returns, so the caller may reuse it at once.
    ///
    /// # Errors
    ///
    /// A driver error.
    ///
    /// # Safety
    ///
    /// As [`Device::memset_zero`] for `dst..dst + src.len()`.
    unsafe fn copy_htod(&self, stream: &Self::Stream, src: &[u8], dst: u64) -> Result<(), DeviceError>;

    /// Copies `bytes` bytes of pinned host memory at `src` to `dst`, asynchronously:
    /// `src` is read when the copy runs in `stream`'s order.
    ///
    /// # Errors
    ///
    /// A driver error.
    ///
    /// # Safety
    ///
    /// `src..src + bytes` must lie in a live [`Device::PinnedMemory`] of this device
    /// that is neither freed nor written until the copy completes; `dst` as in
    /// [`Device::memset_zero`].
    unsafe fn copy_htod_pinned(
        &self,
        stream: &Self::Stream,
        src: NonNull<u8>,
        dst: u64,
        bytes: usize,
    ) -> Result<(), DeviceError>;

    /// Copies `dst.len()` bytes from `src` into host memory, ordered on `stream`; the
    /// copy is complete when this returns.
    ///
    /// # Errors
    ///
    /// A driver error.
    ///
    /// # Safety
    ///
    /// `src..src + dst.len()` must lie in one allocation of this device that stays
    /// allocated, and is written by no other stream, until the copy completes.
    unsafe fn copy_dtoh(&self, stream: &Self::Stream, src: u64, dst: &mut [u8]) -> Result<(), DeviceError>;

    /// Copies `bytes` bytes from `src` into pinned host memory at `dst`,
    /// asynchronously: `dst` is written when the copy runs in `stream`'s order.
    ///
    /// # Errors
    ///
    /// A driver error.
    ///
    /// # Safety
    ///
    /// `dst..dst + bytes` must lie in a live [`Device::PinnedMemory`] of this device
    /// that is neither freed, read nor written by the host until the copy completes;
    /// `src` as in [`Device::copy_dtoh`].
    unsafe fn copy_dtoh_pinned(
        &self,
        stream: &Self::Stream,
        src: u64,
        dst: NonNull<u8>,
        bytes: usize,
    ) -> Result<(), DeviceError>;

    /// Copies `bytes` bytes from `src` to `dst` (device to device), ordered on `stream`.
    ///
    /// # Errors
    ///
    /// A driver error.
    ///
    /// # Safety
    ///
    /// Both ranges as in [`Device::memset_zero`] (`src` may be read by other streams);
    /// they must not overlap.
    unsafe fn copy_dtod(&self, stream: &Self::Stream, src: u64, dst: u64, bytes: usize) -> Result<(), DeviceError>;

    /// Keeps an error from a place that cannot return one (a `Drop`), for
    /// [`Device::take_deferred_error`].
    fn defer_error(&self, error: DeviceError);
    /// The first error kept by [`Device::defer_error`] (or by the driver) since the last
    /// call, if any.
    fn take_deferred_error(&self) -> Option<DeviceError>;
}

/// Runs `op` on stream `on` with memory that stream `other` also uses: `on` first waits
/// for `other`'s work so far, and `other`'s later work waits for `op`. With one stream
/// for both, `op` simply runs on it.
pub(crate) fn ordered_with<D: Device>(
    device: &D,
    on: &D::Stream,
    other: &D::Stream,
    op: impl FnOnce(&D::Stream) -> Result<(), DeviceError>,
) -> Result<(), DeviceError> {
    if on == other {
        return op(on);
    }
    let before = device.record(other)?;
    device.wait(on, &before)?;
    op(on)?;
    let after = device.record(on)?;
    device.wait(other, &after)
}
