//! Pinned (page-locked) host workspaces for staging transfers: ND4J's "mirroring".
//!
//! Copies from and to page-locked memory are asynchronous: the host returns at once and
//! the device reads or writes the memory later, in its stream's order. So a
//! [`PinnedArray`] remembers the event recorded after its last transfer, and host access
//! ([`PinnedArray::view`], [`PinnedArray::view_mut`]) waits for it first; the workspace
//! remembers every such event of the cycle, and opening the next cycle (which hands the
//! memory out again) waits for all of them. Blocks given back meanwhile (spills freed at
//! the reset) are kept until then.
//!
//! A pinned workspace is bounded: page-locked memory is taken from the operating system
//! and cannot be paged out, so it is sized to what the transfers need
//! ([`PinnedWorkspace::for_transfers`]) or given a `max_size`, never grown without limit.

use std::cell::RefCell;
use std::mem::align_of;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use bytemuck::Pod;
use ndarray::{ArrayBase, ArrayView, ArrayViewMut, Data, Dimension, ShapeBuilder};
use workspace_core::backend::{CycleHooks, Open, Placement, ScopeKind, Shell};
use workspace_core::{AllocationPolicy, LearningPolicy, Location, SpillPolicy, WorkspaceConfig, WorkspaceStats};

use crate::backend::{lock_in_flight, InFlight, PinnedBackend};
use crate::device::Device;
use crate::error::{DeviceError, Error, Result};
use crate::memory::checked_bytes;
use crate::workspace::check_alignment;

/// Events kept per pinned workspace before completed ones are dropped from the list.
const PRUNE_AT: usize = 64;

/// A workspace of page-locked host memory for staging transfers; see the module docs.
///
/// ```
/// use workspace_cuda::device::sim::SimDevice;
/// use workspace_cuda::{Device, DeviceWorkspace, PinnedWorkspace};
/// use workspace_core::WorkspaceConfig;
///
/// let sim = SimDevice::new()?;
/// let staging = PinnedWorkspace::for_transfers("STAGE", &sim, 4096)?;
/// let device = DeviceWorkspace::new("BATCH", WorkspaceConfig::default(), &sim, &sim.default_stream())?;
/// for batch in 0..3 {
///     let stage = staging.enter()?; // waits for the last cycle's transfers first
///     let mut x = stage.zeros::<f32, _>(256)?;
///     x.view_mut()?.fill(batch as f32); // fill on the host
///     let scope = device.enter()?;
///     let on_device = scope.htod_pinned(&x)?; // asynchronous copy
///     assert_eq!(on_device.to_host()?.sum(), 256.0 * batch as f32);
/// }
/// assert_eq!(staging.stats().pinned_allocations, 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// Its memory is handed out again only after its transfers are waited for: no safe
/// path opens a cycle without that wait. The engine is not exposed (its `enter` would
/// open one), and the hooks that wait run only inside the shell:
///
/// ```compile_fail,E0599
/// use workspace_cuda::device::sim::SimDevice;
/// use workspace_cuda::PinnedWorkspace;
/// let sim = SimDevice::new().unwrap();
/// let staging = PinnedWorkspace::for_transfers("STAGE", &sim, 4096).unwrap();
/// staging.engine().enter().unwrap(); // no `engine()` on a shell with hooks
/// ```
///
/// ```compile_fail,E0133
/// use workspace_core::backend::CycleHooks;
/// use workspace_cuda::device::sim::SimDevice;
/// use workspace_cuda::PinnedWorkspace;
/// let sim = SimDevice::new().unwrap();
/// let staging = PinnedWorkspace::for_transfers("STAGE", &sim, 4096).unwrap();
/// staging.hooks().before_reset(); // unsafe to call: only the shell runs its hooks
/// ```
pub struct PinnedWorkspace<D: Device> {
    shell: Shell<PinnedBackend<D>, PendingTransfers<D>>,
}

/// The accessors every kind of workspace shares (name, generation, capacity,
/// statistics, `trim`, ...) are the [`Shell`]'s.
impl<D: Device> std::ops::Deref for PinnedWorkspace<D> {
    type Target = Shell<PinnedBackend<D>, PendingTransfers<D>>;

    #[inline(always)]
    fn deref(&self) -> &Self::Target {
        &self.shell
    }
}

/// What a pinned workspace does around the engine's cycles (its [`CycleHooks`]): before
/// its memory is handed out again, or freed, it waits for every transfer that may still
/// use it (module docs).
pub struct PendingTransfers<D: Device> {
    device: D,
    shared: Arc<Mutex<InFlight<D>>>,
    /// A transfer whose end could be neither recorded nor waited for: its memory may be
    /// in use indefinitely, so the workspace never opens again.
    broken: RefCell<Option<DeviceError>>,
}

impl<D: Device> PinnedWorkspace<D> {
    /// Creates a pinned workspace with `config`, which must be bounded (`max_size` set).
    ///
    /// # Errors
    ///
    /// [`workspace_core::Error::InvalidConfig`] for an unbounded configuration, a file
    /// location or an alignment beyond [`MAX_DEVICE_ALIGNMENT`](crate::MAX_DEVICE_ALIGNMENT);
    /// a backend error when the initial arena cannot be pinned.
    pub fn new(name: &str, config: WorkspaceConfig, device: &D) -> Result<PinnedWorkspace<D>> {
        if config.max_size() == usize::MAX {
            return Err(invalid(format!(
                "pinned workspace '{name}' has no max_size: page-locked memory is taken from the operating \
                 system and cannot be paged out, so a pinned workspace must be bounded; set max_size, or use \
                 PinnedWorkspace::for_transfers to size it for the transfers of one cycle"
            )));
        }
        if !matches!(config.location(), Location::Ram) {
            return Err(invalid(format!(
                "pinned workspace '{name}' cannot live in a file or mapping ({:?}); use Location::Ram",
                config.location()
            )));
        }
        check_alignment(name, &config, "pinned")?;
        let shared = Arc::new(Mutex::new(InFlight::new()));
        let backend = PinnedBackend::new(device.clone(), shared.clone());
        let transfers = PendingTransfers { device: device.clone(), shared, broken: RefCell::new(None) };
        Ok(PinnedWorkspace { shell: Shell::new(name, config, backend, transfers)? })
    }

    /// A pinned workspace of exactly `bytes` bytes, reserved now, that never grows and
    /// never spills: sized to the transfers of one cycle. Each allocation occupies a
    /// multiple of 64 bytes.
    ///
    /// # Errors
    ///
    /// As [`PinnedWorkspace::new`]; `bytes` must be > 0.
    pub fn for_transfers(name: &str, device: &D, bytes: usize) -> Result<PinnedWorkspace<D>> {
        let config = WorkspaceConfig::builder()
            .allocation(AllocationPolicy::Strict)
            .learning(LearningPolicy::None)
            .spill(SpillPolicy::Fail)
            .initial_size(bytes)
            .max_size(bytes)
            .build()?;
        PinnedWorkspace::new(name, config, device)
    }

    /// Opens a cycle, after waiting for every transfer of the previous cycles, or nests in
    /// the open one.
    ///
    /// # Errors
    ///
    /// A device error while waiting (the workspace stays closed; entering again
    /// retries), or an engine error as for host workspaces.
    pub fn enter(&self) -> Result<PinnedScope<'_, D>> {
        Ok(PinnedScope { ws: self, open: self.shell.open()? })
    }

    /// The device whose transfers this memory stages.
    pub fn device(&self) -> &D {
        &self.hooks().device
    }

    fn device_error(&self, action: &'static str, source: DeviceError) -> Error {
        device_error(self.name(), action, source)
    }
}

fn device_error(workspace: &Arc<str>, action: &'static str, source: DeviceError) -> Error {
    Error::Device { workspace: workspace.clone(), action, source }
}

impl<D: Device> PendingTransfers<D> {
    fn note_transfer(&self, event: D::Event) {
        let mut shared = lock_in_flight(&self.shared);
        if shared.events.len() >= PRUNE_AT {
            shared.events.retain(|e| !self.device.event_complete(e));
        }
        shared.events.push(event);
    }
}

impl<D: Device> CycleHooks for PendingTransfers<D> {
    type Error = Error;

    /// Waits for every transfer that may still use the memory, then frees the blocks
    /// given back meanwhile.
    #[cold]
    unsafe fn before_open(&self, name: &Arc<str>) -> Result<()> {
        if let Some(error) = self.broken.borrow().clone() {
            return Err(device_error(name, "waiting for a transfer whose end could not be recorded", error));
        }
        let mut shared = lock_in_flight(&self.shared);
        while let Some(event) = shared.events.last() {
            self.device
                .event_synchronize(event)
                .map_err(|e| device_error(name, "waiting for the last cycle's transfers", e))?;
            shared.events.pop();
        }
        shared.graveyard.clear();
        Ok(())
    }

    /// Nothing: memory that transfers may still use is not handed out again before the
    /// next open waits for them, and blocks freed at the reset go to the graveyard.
    unsafe fn before_reset(&self) {}

    /// A frame of a pinned workspace keeps its bytes to the end of the cycle: transfers
    /// issued on them may still run, and only opening the next cycle waits for them.
    unsafe fn before_frame_close(&self, _level: u32) -> bool {
        false
    }

    /// Waits for every transfer; leaks the memory when one cannot be waited for.
    unsafe fn before_drop(&mut self) -> bool {
        let mut shared = lock_in_flight(&self.shared);
        let mut waited = self.broken.get_mut().is_none();
        for event in shared.events.drain(..) {
            if let Err(error) = self.device.event_synchronize(&event) {
                self.device.defer_error(error);
                waited = false;
            }
        }
        if waited {
            shared.graveyard.clear();
        } else {
            // A transfer may still use this memory: leak it rather than free it under it.
            std::mem::forget(std::mem::take(&mut shared.graveyard));
        }
        waited
    }

    /// `pinned_allocations`: the page-locked allocations made so far.
    fn amend_stats(&self, stats: &mut WorkspaceStats) {
        stats.pinned_allocations = lock_in_flight(&self.shared).allocations;
    }
}

fn invalid(reason: String) -> Error {
    workspace_core::Error::InvalidConfig { reason }.into()
}

impl<D: Device> std::fmt::Debug for PinnedWorkspace<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedWorkspace").field("shell", &self.shell).finish_non_exhaustive()
    }
}

/// An open scope of a pinned workspace. `!Send` and `!Sync`.
#[derive(Debug)]
pub struct PinnedScope<'ws, D: Device> {
    ws: &'ws PinnedWorkspace<D>,
    /// The scope's count of the cycle; dropping it closes the scope. Memory that
    /// transfers may still use is not handed out again before the next `enter` waits for
    /// them, and blocks freed at the reset go to the graveyard.
    open: Open<'ws, PinnedBackend<D>, PendingTransfers<D>>,
}

impl<'ws, D: Device> PinnedScope<'ws, D> {
    /// How this scope came to be.
    pub fn kind(&self) -> ScopeKind {
        self.open.kind()
    }

    /// Where `array`'s memory lies relative to this workspace's arena (does not wait for
    /// transfers: it looks at the address only).
    pub fn placement<T, Dim: Dimension>(&self, array: &PinnedArray<'_, D, T, Dim>) -> Placement {
        self.ws.placement(array.ptr.cast::<u8>())
    }

    /// A zero-filled pinned array.
    ///
    /// # Errors
    ///
    /// [`workspace_core::Error::ZeroLength`], [`workspace_core::Error::ShapeOverflow`],
    /// [`workspace_core::Error::InvalidInput`] for a zero-sized element type (as for
    /// [`DeviceScope::zeros`](crate::DeviceScope::zeros)), or the workspace's allocation errors (with [`PinnedWorkspace::for_transfers`]:
    /// [`workspace_core::Error::Exhausted`] past its size).
    pub fn zeros<T: Pod, Sh: ShapeBuilder>(&self, shape: Sh) -> Result<PinnedArray<'_, D, T, Sh::Dim>> {
        let dim = shape.into_shape_with_order().raw_dim().clone();
        let bytes = checked_bytes::<T, Sh::Dim>(&dim, || self.ws.name().clone())?;
        let (base, offset) = self.open.alloc(bytes, align_of::<T>())?;
        // SAFETY: the engine reserved `offset..offset + bytes` inside the block at `base`
        // for this cycle, so the pointer stays inside one live allocation, aligned for
        // `T`; the memory is not in any transfer (the cycle opened after waiting for
        // them), and it is zeroed before anything reads it.
        let ptr = unsafe {
            let ptr = base.add(offset);
            ptr.as_ptr().write_bytes(0, bytes);
            ptr.cast::<T>()
        };
        Ok(PinnedArray { ptr, dim, ws: self.ws, pending: RefCell::new(None) })
    }

    /// A pinned array filled with `value`.
    ///
    /// # Errors
    ///
    /// As [`PinnedScope::zeros`].
    pub fn filled<T: Pod, Sh: ShapeBuilder>(&self, shape: Sh, value: T) -> Result<PinnedArray<'_, D, T, Sh::Dim>> {
        let mut array = self.zeros::<T, Sh>(shape)?;
        array.view_mut()?.fill(value);
        Ok(array)
    }

    /// A pinned copy of the host array `src`, in standard layout.
    ///
    /// # Errors
    ///
    /// As [`PinnedScope::zeros`].
    pub fn copy_of<T: Pod, S: Data<Elem = T>, Dim: Dimension>(
        &self,
        src: &ArrayBase<S, Dim>,
    ) -> Result<PinnedArray<'_, D, T, Dim>> {
        let mut array = self.zeros::<T, Dim>(src.raw_dim())?;
        array.view_mut()?.assign(src);
        Ok(array)
    }
}

/// An array in pinned host memory; see the module docs. Host access waits for the
/// array's last transfer. It borrows its scope, so it cannot outlive the cycle:
///
/// ```compile_fail
/// use workspace_cuda::device::sim::SimDevice;
/// use workspace_cuda::PinnedWorkspace;
/// let sim = SimDevice::new().unwrap();
/// let staging = PinnedWorkspace::for_transfers("STAGE", &sim, 4096).unwrap();
/// let kept = {
///     let stage = staging.enter().unwrap();
///     stage.zeros::<f32, _>(16).unwrap()
/// }; // the pinned memory is handed out again after this
/// kept.view().unwrap();
/// ```
pub struct PinnedArray<'s, D: Device, T, Dim: Dimension> {
    /// Invariant: `dim.size()` initialised elements in the workspace's memory, valid for
    /// `'s` and reached by nothing else but transfers this array recorded.
    ptr: NonNull<T>,
    dim: Dim,
    ws: &'s PinnedWorkspace<D>,
    /// The event after the last transfer from or to this array.
    pending: RefCell<Option<D::Event>>,
}

impl<'s, D: Device, T: Pod, Dim: Dimension> PinnedArray<'s, D, T, Dim> {
    /// Waits for the array's last transfer.
    ///
    /// # Errors
    ///
    /// A device error.
    pub fn wait(&self) -> Result<()> {
        let pending = self.pending.borrow().clone();
        if let Some(event) = pending {
            self.ws
                .device()
                .event_synchronize(&event)
                .map_err(|e| self.ws.device_error("waiting for a transfer", e))?;
            self.pending.replace(None);
        }
        Ok(())
    }

    /// The elements, for reading on the host, once the last transfer is complete.
    ///
    /// # Errors
    ///
    /// A device error while waiting.
    pub fn view(&self) -> Result<ArrayView<'_, T, Dim>> {
        self.wait()?;
        // SAFETY: `ptr` holds `dim.size()` initialised, aligned elements valid for `'s`
        // (invariant); no transfer writes them (the last one is complete, and starting a
        // transfer that writes needs `&mut self`); the view borrows `self`.
        Ok(unsafe { ArrayView::from_shape_ptr(self.dim.clone(), self.ptr.as_ptr()) })
    }

    /// The elements, for writing on the host, once the last transfer is complete.
    ///
    /// # Errors
    ///
    /// A device error while waiting.
    pub fn view_mut(&mut self) -> Result<ArrayViewMut<'_, T, Dim>> {
        self.wait()?;
        // SAFETY: as in `view`; no transfer reads them either, and `&mut self` makes this
        // the only view.
        Ok(unsafe { ArrayViewMut::from_shape_ptr(self.dim.clone(), self.ptr.as_ptr()) })
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        self.dim.slice()
    }

    /// The shape as a dimension.
    pub fn raw_dim(&self) -> Dim {
        self.dim.clone()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.dim.size()
    }

    /// Whether there are no elements (never: empty allocations are refused).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn device(&self) -> &D {
        self.ws.device()
    }

    pub(crate) fn host_ptr(&self) -> NonNull<u8> {
        self.ptr.cast()
    }

    /// Issues a transfer from or to this array on `stream`: ordered after the array's
    /// last transfer, and recorded so that host access and reuse wait for it.
    pub(crate) fn transfer(
        &self,
        stream: &D::Stream,
        op: impl FnOnce(&D::Stream) -> Result<(), DeviceError>,
    ) -> Result<(), DeviceError> {
        let device = self.ws.device();
        if let Some(previous) = self.pending.borrow().as_ref() {
            device.wait(stream, previous)?;
        }
        op(stream)?;
        match device.record(stream) {
            Ok(event) => {
                self.ws.hooks().note_transfer(event.clone());
                self.pending.replace(Some(event));
                Ok(())
            }
            Err(error) => {
                // Without an event nobody could tell when the copy is over: wait now.
                if let Err(lost) = device.synchronize(stream) {
                    self.ws.hooks().broken.borrow_mut().get_or_insert(lost);
                }
                Err(error)
            }
        }
    }
}

impl<D: Device, T, Dim: Dimension> std::fmt::Debug for PinnedArray<'_, D, T, Dim> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedArray").field("ptr", &self.ptr).field("shape", &self.dim.slice()).finish()
    }
}
