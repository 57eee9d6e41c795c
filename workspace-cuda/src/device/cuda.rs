//! The CUDA device, over cudarc's driver API.
//!
//! Two cudarc context objects share the device's primary context. The one users see
//! ([`CudaDevice::context`]) keeps cudarc's per-slice event tracking on, so cudarc
//! slices allocated by user code stay safe across streams. The other is private and has
//! tracking switched off: workspace memory is allocated stream-ordered on the
//! workspace's stream (`cuMemAllocAsync`) and wrapped as a `CudaSlice<u8>` of that
//! private context, so it carries no per-slice events — all views of a workspace
//! arena would otherwise share one slice's read and write events — and the workspaces
//! order it with events of their own.
//!
//! Copies from pageable host memory finish reading their source before returning (the
//! driver stages them); copies to pageable host memory are complete when they return.

use std::ffi::c_void;
use std::fmt;
use std::panic::catch_unwind;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaSlice, CudaStream, DriverError};

use super::{sealed, Device};
use crate::error::{DeviceError, Error};
use crate::probe::{describe, probe, Probe};

fn driver(call: &'static str, error: DriverError) -> DeviceError {
    let message = error.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    DeviceError::Driver { call, code: format!("{:?}", error.0), message }
}

fn alloc_error(call: &'static str, bytes: usize, what: &'static str, error: DriverError) -> DeviceError {
    if error.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
        DeviceError::OutOfMemory { bytes, what }
    } else {
        driver(call, error)
    }
}

/// A CUDA device; see the module docs. Cheap to clone: clones share the contexts.
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<Inner>,
}

struct Inner {
    /// The context users see; cudarc's event tracking on.
    context: Arc<CudaContext>,
    /// Private: event tracking off; only ever the parent of workspace memory slices.
    untracked: Arc<CudaContext>,
    /// `untracked`'s null stream: the stream workspace slices are freed on, after
    /// waiting for the stream they were used on.
    free_stream: Arc<CudaStream>,
    default: Arc<CudaStream>,
    ordinal: usize,
    name: String,
    memory_pools: bool,
    deferred: Mutex<Option<DeviceError>>,
    /// Events made by `record`, kept for reuse: one that only this list holds is
    /// recorded again instead of creating another (a steady loop of records creates
    /// none, and allocates nothing).
    events: Mutex<Vec<Arc<CudaEvent>>>,
}

/// The most events [`Inner::events`] keeps (more alive at once are made and dropped).
const POOLED_EVENTS: usize = 1024;

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaDevice({})", self.describe())
    }
}

impl CudaDevice {
    /// The device with this ordinal, after [`probe`] has found a driver and devices.
    ///
    /// ```
    /// match workspace_cuda::CudaDevice::new(0) {
    ///     Ok(gpu) => println!("using {}", gpu.name()),
    ///     Err(err) => println!("{err}"), // "no CUDA device: ..." on a machine without one
    /// }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::NoDevice`] with the reason when there is no driver, no such device, or the
    /// driver fails to create a context. Never panics.
    pub fn new(ordinal: usize) -> Result<CudaDevice, Error> {
        let no_device = |reason: String| Error::NoDevice { reason };
        let devices = match probe() {
            Probe::Available { devices, .. } => devices,
            other => return Err(no_device(other.to_string())),
        };
        if ordinal >= devices {
            return Err(no_device(format!("device {ordinal} was asked for, but the driver reports {devices}")));
        }
        let created = catch_unwind(|| -> Result<_, DriverError> {
            let context = CudaContext::new(ordinal)?;
            let untracked = CudaContext::new(ordinal)?;
            let name = context.name()?;
            let pools = context.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)?;
            Ok((context, untracked, name, pools > 0))
        });
        let (context, untracked, name, memory_pools) = match created {
            Ok(Ok(created)) => created,
            Ok(Err(error)) => return Err(no_device(format!("creating a context failed: {}", describe(error)))),
            Err(_) => return Err(no_device("the CUDA driver library failed while creating a context".into())),
        };
        // SAFETY: `untracked` is private to this device and never handed out; the only
        // slices ever created on it are workspace memory (`alloc`), whose every use is
        // ordered by the workspaces' own events, and which are freed only after the
        // stream they were used on (see `CudaMemory::drop`).
        unsafe { untracked.disable_event_tracking() };
        let default =
            context.new_stream().map_err(|e| no_device(format!("creating a stream failed: {}", describe(e))))?;
        let free_stream = untracked.default_stream();
        Ok(CudaDevice {
            inner: Arc::new(Inner {
                context,
                untracked,
                free_stream,
                default,
                ordinal,
                name,
                memory_pools,
                deferred: Mutex::new(None),
                events: Mutex::new(Vec::with_capacity(64)),
            }),
        })
    }

    /// The cudarc context (event tracking on), for loading modules and launching kernels
    /// on workspace memory (`DeviceView::device_ptr`) on a workspace's stream.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.context
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The device's name ("NVIDIA H200").
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Whether the device supports stream-ordered allocation (`cuMemAllocAsync`); when
    /// not, workspace memory comes from `cuMemAlloc`.
    pub fn supports_memory_pools(&self) -> bool {
        self.inner.memory_pools
    }

    fn bind(&self) -> Result<(), DeviceError> {
        self.inner.context.bind_to_thread().map_err(|e| driver("cuCtxSetCurrent", e))
    }
}

/// Whether the driver knows `ptr` as page-locked host memory (then copies from it are
/// asynchronous).
fn is_pinned(ptr: *const u8) -> bool {
    let mut memory_type = 0u32;
    // SAFETY: the driver writes one `CUmemorytype` (a u32) to `memory_type`; for memory it
    // does not know it returns an error and writes nothing.
    let known = unsafe {
        sys::cuPointerGetAttribute(
            (&mut memory_type as *mut u32).cast::<c_void>(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            ptr as sys::CUdeviceptr,
        )
    };
    known == sys::cudaError_enum::CUDA_SUCCESS && memory_type == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32
}

/// Workspace device memory: a `CudaSlice<u8>` of the private, untracked context.
pub struct CudaMemory {
    slice: CudaSlice<u8>,
    address: u64,
    /// The stream the memory was allocated (and is used) on.
    stream: Arc<CudaStream>,
}

impl fmt::Debug for CudaMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaMemory({:#x}, {} bytes)", self.address, self.slice.len())
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        // The slice frees itself on the private null stream; make that wait for the
        // stream the memory was used on, so the free is ordered after every use. (The
        // slice's own drop does not make its context current; this does, on any thread.)
        let context = self.slice.context().clone();
        context.record_err(context.bind_to_thread());
        match self.stream.record_event(None) {
            Ok(event) => context.record_err(self.slice.stream().wait(&event)),
            Err(error) => {
                context.record_err(Err::<(), _>(error));
                context.record_err(self.stream.synchronize());
            }
        }
    }
}

/// Page-locked host memory from `cuMemHostAlloc` (portable, not write-combined: the
/// host reads what it stages back).
pub struct CudaPinned {
    /// Invariant: `len` bytes from `cuMemHostAlloc`, owned here, freed in `drop`.
    ptr: NonNull<u8>,
    len: usize,
    context: Arc<CudaContext>,
}

// SAFETY: a `CudaPinned` exclusively owns its page-locked allocation; the pointer is only
// its address, and moving the handle moves that ownership. Freeing binds the context on
// whatever thread drops it (`CudaContext` is `Send + Sync`).
unsafe impl Send for CudaPinned {}

impl fmt::Debug for CudaPinned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaPinned({:p}, {} bytes)", self.ptr, self.len)
    }
}

impl Drop for CudaPinned {
    fn drop(&mut self) {
        self.context.record_err(self.context.bind_to_thread());
        // SAFETY: `ptr` came from `cuMemHostAlloc` and is freed once, here; the pinned
        // workspaces wait for every transfer that uses it before dropping it.
        self.context.record_err(unsafe { result::free_host(self.ptr.as_ptr().cast()) });
    }
}

impl sealed::Sealed for CudaDevice {}

impl Device for CudaDevice {
    type Stream = Arc<CudaStream>;
    type Event = Arc<CudaEvent>;
    type Memory = CudaMemory;
    type PinnedMemory = CudaPinned;

    const ARENA_KIND: &'static str = "device";
    const PINNED_KIND: &'static str = "pinned";

    fn describe(&self) -> String {
        format!("{} (CUDA device {})", self.inner.name, self.inner.ordinal)
    }

    fn same_device(&self, other: &Self) -> bool {
        self.inner.context.cu_device() == other.inner.context.cu_device()
    }

    fn default_stream(&self) -> Arc<CudaStream> {
        self.inner.default.clone()
    }

    fn new_stream(&self) -> Result<Arc<CudaStream>, DeviceError> {
        self.inner.context.new_stream().map_err(|e| driver("cuStreamCreate", e))
    }

    fn owns_stream(&self, stream: &Arc<CudaStream>) -> bool {
        stream.context().cu_ctx() == self.inner.context.cu_ctx()
    }

    fn alloc(&self, stream: &Arc<CudaStream>, bytes: usize) -> Result<CudaMemory, DeviceError> {
        self.bind()?;
        let address = if self.inner.memory_pools {
            // SAFETY: `stream` is a live stream of this context; the memory is only used
            // in its order or ordered with it by events (module docs).
            unsafe { result::malloc_async(stream.cu_stream(), bytes) }
                .map_err(|e| alloc_error("cuMemAllocAsync", bytes, "device", e))?
        } else {
            // SAFETY: a plain allocation; its contents are unspecified, as documented.
            unsafe { result::malloc_sync(bytes) }.map_err(|e| alloc_error("cuMemAlloc", bytes, "device", e))?
        };
        // SAFETY: `address` is a fresh allocation of `bytes` bytes of this device, owned by
        // the slice from now on. Event tracking is off on `untracked`, so this creates no
        // events (and cannot fail).
        let slice = unsafe { self.inner.free_stream.upgrade_device_ptr::<u8>(address, bytes) };
        Ok(CudaMemory { slice, address, stream: stream.clone() })
    }

    fn memory_address(memory: &CudaMemory) -> u64 {
        memory.address
    }

    fn alloc_pinned(&self, bytes: usize) -> Result<CudaPinned, DeviceError> {
        self.bind()?;
        // SAFETY: a plain page-locked allocation; its contents are unspecified.
        let ptr = unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| alloc_error("cuMemHostAlloc", bytes, "pinned host", e))?;
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(DeviceError::OutOfMemory { bytes, what: "pinned host" })?;
        Ok(CudaPinned { ptr, len: bytes, context: self.inner.context.clone() })
    }

    fn pinned_address(memory: &CudaPinned) -> NonNull<u8> {
        memory.ptr
    }

    fn record(&self, stream: &Arc<CudaStream>) -> Result<Arc<CudaEvent>, DeviceError> {
        let mut events = self.inner.events.lock().unwrap_or_else(PoisonError::into_inner);
        // An event only the list holds is observed by nobody: recording it again cannot
        // change what an earlier wait on it waits for (a wait takes the record that came
        // before it).
        let free = events.iter().find(|e| Arc::strong_count(e) == 1 && Arc::ptr_eq(e.context(), stream.context()));
        if let Some(event) = free {
            event.record(stream).map_err(|e| driver("cuEventRecord", e))?;
            return Ok(event.clone());
        }
        let event = Arc::new(stream.record_event(None).map_err(|e| driver("cuEventRecord", e))?);
        if events.len() < POOLED_EVENTS {
            events.push(event.clone());
        }
        Ok(event)
    }

    fn wait(&self, stream: &Arc<CudaStream>, event: &Arc<CudaEvent>) -> Result<(), DeviceError> {
        stream.wait(event).map_err(|e| driver("cuStreamWaitEvent", e))
    }

    fn event_synchronize(&self, event: &Arc<CudaEvent>) -> Result<(), DeviceError> {
        event.synchronize().map_err(|e| driver("cuEventSynchronize", e))
    }

    fn event_complete(&self, event: &Arc<CudaEvent>) -> bool {
        event.is_complete()
    }

    fn synchronize(&self, stream: &Arc<CudaStream>) -> Result<(), DeviceError> {
        stream.synchronize().map_err(|e| driver("cuStreamSynchronize", e))
    }

    unsafe fn memset_zero(&self, stream: &Arc<CudaStream>, dst: u64, bytes: usize) -> Result<(), DeviceError> {
        self.bind()?;
        // SAFETY: the caller guarantees `dst..dst+bytes` is live device memory ordered on
        // `stream`.
        unsafe { result::memset_d8_async(dst, 0, bytes, stream.cu_stream()) }.map_err(|e| driver("cuMemsetD8Async", e))
    }

    unsafe fn copy_htod(&self, stream: &Arc<CudaStream>, src: &[u8], dst: u64) -> Result<(), DeviceError> {
        self.bind()?;
        // SAFETY: `dst` as the caller guarantees; `src` is a live slice for this call.
        unsafe { result::memcpy_htod_async(dst, src, stream.cu_stream()) }
            .map_err(|e| driver("cuMemcpyHtoDAsync", e))?;
        // The driver reads pageable memory before returning; page-locked memory it reads
        // later, so wait for it while `src` is still borrowed.
        if is_pinned(src.as_ptr()) {
            self.synchronize(stream)?;
        }
        Ok(())
    }

    unsafe fn copy_htod_pinned(
        &self,
        stream: &Arc<CudaStream>,
        src: NonNull<u8>,
        dst: u64,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        self.bind()?;
        // SAFETY: the caller guarantees `src..src+bytes` is live pinned memory left alone
        // until the copy completes, and `dst` as in `memset_zero`.
        unsafe {
            let source = std::slice::from_raw_parts(src.as_ptr(), bytes);
            result::memcpy_htod_async(dst, source, stream.cu_stream())
        }
        .map_err(|e| driver("cuMemcpyHtoDAsync", e))
    }

    unsafe fn copy_dtoh(&self, stream: &Arc<CudaStream>, src: u64, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.bind()?;
        // SAFETY: `src` as the caller guarantees; `dst` is a live slice, and the stream is
        // synchronised before it is given back.
        unsafe { result::memcpy_dtoh_async(dst, src, stream.cu_stream()) }
            .map_err(|e| driver("cuMemcpyDtoHAsync", e))?;
        // Complete for pageable memory already; for page-locked memory this is the wait.
        self.synchronize(stream)
    }

    unsafe fn copy_dtoh_pinned(
        &self,
        stream: &Arc<CudaStream>,
        src: u64,
        dst: NonNull<u8>,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        self.bind()?;
        // SAFETY: the caller guarantees `dst..dst+bytes` is live pinned memory the host
        // leaves alone until the copy completes, and `src` as in `copy_dtoh`.
        unsafe {
            let target = std::slice::from_raw_parts_mut(dst.as_ptr(), bytes);
            result::memcpy_dtoh_async(target, src, stream.cu_stream())
        }
        .map_err(|e| driver("cuMemcpyDtoHAsync", e))
    }

    unsafe fn copy_dtod(&self, stream: &Arc<CudaStream>, src: u64, dst: u64, bytes: usize) -> Result<(), DeviceError> {
        self.bind()?;
        // SAFETY: the caller guarantees both ranges are live device memory ordered on
        // `stream`, not overlapping.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream()) }
            .map_err(|e| driver("cuMemcpyDtoDAsync", e))
    }

    fn defer_error(&self, error: DeviceError) {
        self.inner.deferred.lock().unwrap_or_else(PoisonError::into_inner).get_or_insert(error);
    }

    fn take_deferred_error(&self) -> Option<DeviceError> {
        if let Some(error) = self.inner.deferred.lock().unwrap_or_else(PoisonError::into_inner).take() {
            return Some(error);
        }
        let cudarc = self.inner.context.check_err().and_then(|()| self.inner.untracked.check_err());
        cudarc.err().map(|e| driver("an operation that could not report its error (a drop)", e))
    }
}

/// Raw allocation calls for benchmarks that compare workspace allocation with the
/// driver's allocators.
pub mod raw {
    use super::*;

    /// `cuMemAlloc` then `cuMemFree` of `bytes` bytes, `count` times.
    ///
    /// # Errors
    ///
    /// The first driver error.
    pub fn malloc_free(device: &CudaDevice, bytes: usize, count: usize) -> Result<(), DeviceError> {
        device.bind()?;
        for _ in 0..count {
            // SAFETY: a fresh allocation, freed right away and never used.
            unsafe {
                let ptr = result::malloc_sync(bytes).map_err(|e| alloc_error("cuMemAlloc", bytes, "device", e))?;
                result::free_sync(ptr).map_err(|e| driver("cuMemFree", e))?;
            }
        }
        Ok(())
    }

    /// `cuMemAllocAsync` then `cuMemFreeAsync` of `bytes` bytes on `stream`, `count`
    /// times (not synchronised: the caller synchronises once at the end).
    ///
    /// # Errors
    ///
    /// The first driver error (also when the device has no memory pools).
    pub fn malloc_free_async(
        device: &CudaDevice,
        stream: &Arc<CudaStream>,
        bytes: usize,
        count: usize,
    ) -> Result<(), DeviceError> {
        device.bind()?;
        for _ in 0..count {
            // SAFETY: a fresh stream-ordered allocation, freed in the same stream's order
            // and never used.
            unsafe {
                let ptr = result::malloc_async(stream.cu_stream(), bytes)
                    .map_err(|e| alloc_error("cuMemAllocAsync", bytes, "device", e))?;
                result::free_async(ptr, stream.cu_stream()).map_err(|e| driver("cuMemFreeAsync", e))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_new_is_an_error_with_the_probe_reason() {
        match probe() {
            Probe::Available { .. } => {
                let gpu = CudaDevice::new(0).expect("the probe found a device");
                assert!(gpu.describe().contains("CUDA device 0"));
                let err = CudaDevice::new(usize::MAX).unwrap_err();
                assert!(err.to_string().contains("was asked for"), "{err}");
            }
            other => {
                let err = CudaDevice::new(0).unwrap_err();
                assert!(matches!(err, Error::NoDevice { .. }));
                assert_eq!(err.to_string(), format!("no CUDA device: {other}"));
            }
        }
    }
}
