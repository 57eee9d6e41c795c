//! Device scopes: the open cycle that device views borrow.
//!
//! A [`DeviceScope`] is the guard of one enter, nested enter or borrow of a
//! [`DeviceWorkspace`]. Allocation takes `&self` and returns views that borrow the
//! scope; the arena resets (ordered on the workspace's stream) when the last scope
//! closes.

use bytemuck::Pod;
use ndarray::{ArrayBase, Data, Dimension, ShapeBuilder};
use workspace_core::backend::{Open, Placement, ScopeKind};

use crate::backend::DeviceBackend;

use crate::device::Device;
use crate::error::Result;
use crate::handle::DeviceHandle;
use crate::pinned::PinnedArray;
use crate::stream::OnStream;
use crate::view::{checked_bytes, DeviceUninit, DeviceView, DeviceViewMut};
use crate::workspace::{DeviceWorkspace, StreamOrder};

/// An open scope of a device workspace; see the module docs.
///
/// `!Send` and `!Sync`: it closes on the thread that opened it.
#[derive(Debug)]
pub struct DeviceScope<'ws, D: Device> {
    ws: &'ws DeviceWorkspace<D>,
    /// The scope's count of the cycle; dropping it closes the scope, and the last one
    /// orders every other stream that used the memory before the workspace's stream,
    /// which the reset (and all reuse) is ordered on.
    open: Open<'ws, DeviceBackend<D>, StreamOrder<D>>,
}

impl<'ws, D: Device> DeviceScope<'ws, D> {
    pub(crate) fn new(ws: &'ws DeviceWorkspace<D>, open: Open<'ws, DeviceBackend<D>, StreamOrder<D>>) -> Self {
        DeviceScope { ws, open }
    }

    /// The workspace this scope allocates in.
    pub fn workspace(&self) -> &'ws DeviceWorkspace<D> {
        self.ws
    }

    /// How this scope came to be.
    pub fn kind(&self) -> ScopeKind {
        self.open.kind()
    }

    /// The generation this scope allocates in.
    pub fn generation(&self) -> u64 {
        self.ws.generation()
    }

    /// Where `view`'s memory lies relative to this workspace's arena.
    pub fn placement<T, Dim: Dimension>(&self, view: &DeviceView<'_, D, T, Dim>) -> Placement {
        self.ws.placement(view.address)
    }

    /// Reserves memory for `dim` elements of `T` in the open cycle: its device address.
    pub(crate) fn reserve<T, Dim: Dimension>(&self, dim: &Dim) -> Result<u64> {
        let bytes = checked_bytes::<T, Dim>(dim, || self.ws.name().clone())?;
        let (base, offset) = self.open.alloc(bytes, std::mem::align_of::<T>())?;
        Ok(base + offset as u64)
    }

    /// A zero-filled array (zeroed on the workspace's stream).
    ///
    /// # Errors
    ///
    /// [`workspace_core::Error::ZeroLength`] for an empty shape,
    /// [`workspace_core::Error::ShapeOverflow`] when the element count or the byte size
    /// exceeds `isize::MAX`, [`workspace_core::Error::InvalidInput`] for a zero-sized
    /// element type, the workspace's allocation errors (exhausted, over budget, out of
    /// device memory), or a device error.
    pub fn zeros<T: Pod, Sh: ShapeBuilder>(&self, shape: Sh) -> Result<DeviceViewMut<'_, D, T, Sh::Dim>> {
        self.uninit::<T, Sh>(shape)?.zeroed()
    }

    /// An array whose memory holds no data yet; fill it before reading.
    ///
    /// # Errors
    ///
    /// As [`DeviceScope::zeros`], without the device error.
    pub fn uninit<T: Pod, Sh: ShapeBuilder>(&self, shape: Sh) -> Result<DeviceUninit<'_, D, T, Sh::Dim>> {
        DeviceUninit::allocate(self, shape.into_shape_with_order().raw_dim().clone())
    }

    /// A copy of the host array `src` (any layout; copied in standard order on the
    /// workspace's stream, `src` read before this returns).
    ///
    /// # Errors
    ///
    /// As [`DeviceScope::zeros`].
    pub fn htod<T: Pod, S: Data<Elem = T>, Dim: Dimension>(
        &self,
        src: &ArrayBase<S, Dim>,
    ) -> Result<DeviceViewMut<'_, D, T, Dim>> {
        self.uninit::<T, Dim>(src.raw_dim())?.htod_from(src)
    }

    /// A copy of the pinned staging array `src`, copied asynchronously on the
    /// workspace's stream.
    ///
    /// # Errors
    ///
    /// As [`DeviceScope::zeros`], and [`Error::DeviceMismatch`](crate::Error::DeviceMismatch).
    pub fn htod_pinned<T: Pod, Dim: Dimension>(
        &self,
        src: &PinnedArray<'_, D, T, Dim>,
    ) -> Result<DeviceViewMut<'_, D, T, Dim>> {
        self.uninit::<T, Dim>(src.raw_dim())?.htod_pinned(src)
    }

    /// A copy of the device view `src` (from another workspace, an owned array, or this
    /// workspace): the leverage target. The copy runs on this workspace's stream,
    /// ordered with the source's stream.
    ///
    /// # Errors
    ///
    /// As [`DeviceScope::zeros`], and [`Error::DeviceMismatch`](crate::Error::DeviceMismatch).
    pub fn copy_of<T: Pod, Dim: Dimension>(
        &self,
        src: &DeviceView<'_, D, T, Dim>,
    ) -> Result<DeviceViewMut<'_, D, T, Dim>> {
        self.uninit::<T, Dim>(src.raw_dim())?.copy_from(src)
    }

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

    /// Declares that work on `stream` will use this workspace's memory, and returns the
    /// handle to issue it through. Each operation issued through it first makes `stream`
    /// wait for the workspace stream's work so far; when the handle is dropped (or
    /// [`OnStream::finish`]ed) the workspace's stream waits for `stream`. Neither rests on
    /// the handle being dropped: the workspace records every use when it is issued, and
    /// waits for `stream` before its own stream next touches that memory, at the reset,
    /// and when it is dropped (see [`OnStream`]).
    ///
    /// # Errors
    ///
    /// [`Error::StreamMismatch`](crate::Error::StreamMismatch) for a stream of another
    /// device.
    pub fn on_stream<'v>(&self, stream: &D::Stream) -> Result<OnStream<'_, 'v, D>> {
        OnStream::new(self.ws, stream)
    }
}
