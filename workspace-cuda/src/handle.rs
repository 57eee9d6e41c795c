//! Storable device handles: device arrays that may outlive a borrow, checked on every
//! access, as [`Handle`](workspace_core::Handle) is on the host.
//!
//! A [`DeviceHandle`] remembers its workspace and that workspace's generation. Reaching
//! its memory needs a [`DeviceScope`] of the same workspace and generation, and the view
//! it gives borrows that scope, so it cannot outlive the cycle either.

use std::marker::PhantomData;
use std::sync::Arc;

use bytemuck::Pod;
use ndarray::{Array, ArrayBase, Data, Dimension, ShapeBuilder};

use crate::array::DeviceArray;
use crate::device::Device;
use crate::error::Result;
use crate::memory::Owner;
use crate::scope::DeviceScope;
use crate::view::{DeviceView, DeviceViewMut};
use crate::workspace::DeviceWorkspace;

/// An array in device workspace memory that can be stored across borrows; see the module
/// docs.
///
/// ```
/// use workspace_cuda::device::sim::SimDevice;
/// use workspace_cuda::{Device, DeviceWorkspace};
/// use workspace_core::{Error as CoreError, WorkspaceConfig};
///
/// let sim = SimDevice::new()?;
/// let ws = DeviceWorkspace::new("CACHE", WorkspaceConfig::default(), &sim, &sim.default_stream())?;
/// let cached = {
///     let scope = ws.enter()?;
///     let h = scope.htod_handle(&ndarray::arr1(&[1.0f32, 2.0, 3.0]))?;
///     assert_eq!(h.to_host(&scope)?.sum(), 6.0);
///     h
/// }; // the cycle ends: the handle's memory is reset
/// let scope = ws.enter()?;
/// match cached.view(&scope) {
///     Err(workspace_cuda::Error::Workspace(CoreError::StaleHandle { array_generation: 1, .. })) => {}
///     other => panic!("expected a stale handle, got {:?}", other.map(|v| v.shape().to_vec())),
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct DeviceHandle<T, Dim> {
    /// Invariant: `dim.size()` initialised elements of the owner's memory, valid while
    /// the owner is at `generation`.
    address: u64,
    dim: Dim,
    owner: u64,
    generation: u64,
    workspace: Arc<str>,
    _elements: PhantomData<T>,
}

impl<T: Pod, Dim: Dimension> DeviceHandle<T, Dim> {
    /// A handle to `view`'s memory, which `scope`'s cycle holds (the handle records the
    /// workspace and generation the view belongs to).
    fn of_view<D: Device>(view: &DeviceView<'_, D, T, Dim>, scope: &DeviceScope<'_, D>) -> Self {
        let ws = scope.workspace();
        DeviceHandle {
            address: view.address,
            dim: view.raw_dim(),
            owner: ws.id(),
            generation: ws.generation(),
            workspace: ws.name().clone(),
            _elements: PhantomData,
        }
    }

    pub(crate) fn raw_dim(&self) -> Dim {
        self.dim.clone()
    }

    /// Checks that `scope` belongs to this handle's workspace, at its generation.
    ///
    /// # Errors
    ///
    /// [`workspace_core::Error::WrongWorkspace`] or [`workspace_core::Error::StaleHandle`]
    /// (inside [`Error::Workspace`](crate::Error::Workspace)), naming the workspace, both
    /// generations and the fix.
    pub fn check<D: Device>(&self, scope: &DeviceScope<'_, D>) -> Result<()> {
        Ok(scope.workspace().check_handle(self.owner, self.generation, &self.workspace)?)
    }

    /// A read-only view, borrowed from `scope`.
    ///
    /// # Errors
    ///
    /// As [`DeviceHandle::check`].
    #[allow(unsafe_code)]
    pub fn view<'a, D: Device>(&'a self, scope: &'a DeviceScope<'_, D>) -> Result<DeviceView<'a, D, T, Dim>> {
        self.check(scope)?;
        // SAFETY: a handle is made from a view of its workspace's memory at a generation
        // (`DeviceHandle::of_view`), and the check proves the workspace is still at that
        // generation, so the memory holds the elements; the view borrows `scope` (the
        // cycle cannot end) and the handle.
        Ok(unsafe { DeviceView::new(Owner::Workspace(scope.workspace()), self.address, self.raw_dim()) })
    }

    /// A mutable view, borrowed from `scope`.
    ///
    /// # Errors
    ///
    /// As [`DeviceHandle::check`].
    #[allow(unsafe_code)]
    pub fn view_mut<'a, D: Device>(
        &'a mut self,
        scope: &'a DeviceScope<'_, D>,
    ) -> Result<DeviceViewMut<'a, D, T, Dim>> {
        self.check(scope)?;
        // SAFETY: as in `view`; `&mut` on the handle keeps every other view of it away
        // for `'a`.
        Ok(unsafe { DeviceViewMut::new(Owner::Workspace(scope.workspace()), self.address, self.raw_dim()) })
    }

    /// Copies into an owned device array.
    ///
    /// # Errors
    ///
    /// As [`DeviceHandle::check`], and [`DeviceView::detach`]'s errors.
    pub fn detach<D: Device>(&self, scope: &DeviceScope<'_, D>) -> Result<DeviceArray<D, T, Dim>> {
        self.view(scope)?.detach()
    }

    /// Copies into an owned host array.
    ///
    /// # Errors
    ///
    /// As [`DeviceHandle::check`], and [`DeviceView::to_host`]'s errors.
    pub fn to_host<D: Device>(&self, scope: &DeviceScope<'_, D>) -> Result<Array<T, Dim>> {
        self.view(scope)?.to_host()
    }

    /// The former name of [`to_host`](Self::to_host).
    ///
    /// # Errors
    ///
    /// As [`to_host`](Self::to_host).
    #[deprecated(note = "renamed `to_host`, as on `DeviceView` and `DeviceArray`")]
    #[doc(hidden)]
    pub fn detach_to_host<D: Device>(&self, scope: &DeviceScope<'_, D>) -> Result<Array<T, Dim>> {
        self.to_host(scope)
    }

    /// Copies into the open scope `target` of another device workspace, returning a
    /// handle there.
    ///
    /// # Errors
    ///
    /// As [`DeviceHandle::check`] for `scope`, and [`DeviceScope::copy_of`]'s errors.
    pub fn leverage_to<D: Device>(
        &self,
        scope: &DeviceScope<'_, D>,
        target: &DeviceScope<'_, D>,
    ) -> Result<DeviceHandle<T, Dim>> {
        target.copy_handle(&self.view(scope)?)
    }

    /// Copies into the workspace `target`, which must be open (it is borrowed for the
    /// copy, as with [`DeviceWorkspace::borrow_open`]).
    ///
    /// # Errors
    ///
    /// [`workspace_core::Error::NotOpen`] when `target` is closed (never a silent no-op),
    /// and as [`DeviceHandle::leverage_to`].
    pub fn leverage_to_workspace<D: Device>(
        &self,
        scope: &DeviceScope<'_, D>,
        target: &DeviceWorkspace<D>,
    ) -> Result<DeviceHandle<T, Dim>> {
        let view = self.view(scope)?;
        let borrowed = target.borrow_open()?;
        borrowed.copy_handle(&view)
    }

    /// The generation the handle was allocated in.
    pub fn generation(&self) -> u64 {
        self.generation
    }
    /// The name of the workspace it lives in.
    pub fn workspace_name(&self) -> &Arc<str> {
        &self.workspace
    }
    /// The shape.
    pub fn shape(&self) -> &[usize] {
        self.dim.slice()
    }
}

/// The scope's handle constructors: each allocates a view and makes a handle of it.
impl<D: Device> DeviceScope<'_, D> {
    /// A zero-filled array behind a [`DeviceHandle`] that can be stored and is checked
    /// against this workspace's generation on every access.
    ///
    /// # Errors
    ///
    /// As [`DeviceScope::zeros`].
    pub fn zeros_handle<T: Pod, Sh: ShapeBuilder>(&self, shape: Sh) -> Result<DeviceHandle<T, Sh::Dim>> {
        let view = self.zeros::<T, Sh>(shape)?;
        Ok(DeviceHandle::of_view(&view, self))
    }

    /// A copy of the host array `src` behind a [`DeviceHandle`].
    ///
    /// # Errors
    ///
    /// As [`DeviceScope::zeros`].
    pub fn htod_handle<T: Pod, S: Data<Elem = T>, Dim: Dimension>(
        &self,
        src: &ArrayBase<S, Dim>,
    ) -> Result<DeviceHandle<T, Dim>> {
        let view = self.htod(src)?;
        Ok(DeviceHandle::of_view(&view, self))
    }

    /// A copy of the device view `src` behind a [`DeviceHandle`].
    ///
    /// # Errors
    ///
    /// As [`DeviceScope::copy_of`].
    pub fn copy_handle<T: Pod, Dim: Dimension>(&self, src: &DeviceView<'_, D, T, Dim>) -> Result<DeviceHandle<T, Dim>> {
        let view = self.copy_of(src)?;
        Ok(DeviceHandle::of_view(&view, self))
    }
}
