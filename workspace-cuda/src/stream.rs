//! Declared use of a workspace's memory on another stream.
//!
//! A device workspace belongs to one stream. To copy its memory on another stream (a
//! copy stream overlapping compute), or to hand it to a kernel there, open an
//! [`OnStream`] with [`DeviceScope::on_stream`](crate::DeviceScope::on_stream): it
//! makes the other stream wait for the workspace's stream, issues work there, and when
//! it ends makes the workspace's stream wait for the other one. The views it is given
//! stay borrowed until then, so the workspace's own stream cannot write memory that
//! the other stream is still reading, and the cycle cannot close under it; the cycle's
//! reset waits for the other stream in any case (even if the `OnStream` is leaked).
//!
//! ```
//! use workspace_cuda::{Device, DeviceArray, DeviceWorkspace, SimDevice};
//! use workspace_core::WorkspaceConfig;
//!
//! let sim = SimDevice::new()?;
//! let copy_stream = sim.new_stream()?;
//! let ws = DeviceWorkspace::new("ACT", WorkspaceConfig::default(), &sim, &sim.default_stream())?;
//! let mut kept = DeviceArray::<_, f32>::zeros(&sim, &copy_stream, 4)?;
//! {
//!     let mut kept_view = kept.view_mut(); // borrowed until the use ends
//!     let scope = ws.enter()?;
//!     let x = scope.htod(&ndarray::arr1(&[1.0f32, 2.0, 3.0, 4.0]))?;
//!     let on_copy = scope.on_stream(&copy_stream)?;
//!     on_copy.dtod(&x, &mut kept_view)?; // runs on the copy stream
//!     on_copy.finish()?;
//! } // the reset is ordered after the copy stream's work
//! assert_eq!(kept.to_host()?.sum(), 10.0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::marker::PhantomData;

use bytemuck::Pod;
use ndarray::{ArrayBase, Data, DataMut, Dimension};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::pinned::PinnedArray;
use crate::view::{copy_to_host, with_host_bytes, DeviceView, DeviceViewMut, Owner};
use crate::workspace::DeviceWorkspace;

/// Work on another stream with a workspace's memory; see the module docs.
///
/// `'v` is how long the views it was given stay borrowed: until it ends. So the
/// workspace's stream cannot write a view that the other stream may still be reading:
///
/// ```compile_fail
/// use workspace_cuda::{Device, DeviceArray, DeviceWorkspace, SimDevice};
/// let sim = SimDevice::new().unwrap();
/// let copy_stream = sim.new_stream().unwrap();
/// let ws = DeviceWorkspace::new("W", Default::default(), &sim, &sim.default_stream()).unwrap();
/// let mut out = DeviceArray::<_, f32>::zeros(&sim, &copy_stream, 4).unwrap();
/// let mut out_view = out.view_mut();
/// let scope = ws.enter().unwrap();
/// let mut x = scope.zeros::<f32, _>(4).unwrap();
/// let on_copy = scope.on_stream(&copy_stream).unwrap();
/// on_copy.dtod(&x, &mut out_view).unwrap();
/// x.fill_zeros().unwrap(); // the copy stream may still read `x`: does not compile
/// on_copy.finish().unwrap();
/// ```
pub struct OnStream<'s, 'v, D: Device> {
    ws: &'s DeviceWorkspace<D>,
    stream: D::Stream,
    joined: bool,
    /// Invariant in `'v`: a covariant `'v` could be shortened at each call, which would end
    /// the views' borrows before the use does.
    _views: PhantomData<fn(&'v ()) -> &'v ()>,
}

impl<'s, 'v, D: Device> OnStream<'s, 'v, D> {
    pub(crate) fn new(ws: &'s DeviceWorkspace<D>, stream: &D::Stream) -> Result<OnStream<'s, 'v, D>> {
        if !ws.device().owns_stream(stream) {
            return Err(Error::StreamMismatch {
                workspace: ws.name().clone(),
                action: "declaring use on another stream",
                detail: format!("{stream:?} belongs to another device than {}", ws.device().describe()),
            });
        }
        // Noted first: even if the fork fails half-way, the reset orders this stream.
        ws.note_foreign(stream);
        ws.fork(stream).map_err(|e| ws.device_error("ordering another stream after the workspace's", e))?;
        Ok(OnStream { ws, stream: stream.clone(), joined: false, _views: PhantomData })
    }

    /// The stream the work runs on.
    pub fn stream(&self) -> &D::Stream {
        &self.stream
    }

    fn device(&self) -> &'s D {
        self.ws.device()
    }

    /// Checks that `owner`'s memory is ordered with this stream: this workspace's
    /// memory, or an owned array that belongs to this stream.
    fn check(&self, owner: Owner<'_, D>, action: &'static str) -> Result<()> {
        let ordered = match owner {
            Owner::Workspace(ws) => std::ptr::eq(ws, self.ws),
            Owner::Array { stream, .. } | Owner::Ring { stream, .. } => *stream == self.stream,
        };
        if ordered {
            Ok(())
        } else {
            Err(Error::StreamMismatch {
                workspace: self.ws.name().clone(),
                action,
                detail: format!(
                    "memory of '{}' is not ordered with {:?}: only this workspace's memory, and owned arrays of \
                     that stream, can be used here",
                    owner.name(),
                    self.stream
                ),
            })
        }
    }

    fn error(&self, action: &'static str, source: crate::DeviceError) -> Error {
        self.ws.device_error(action, source)
    }

    /// Copies `src` into `dst` (same shape) on this stream.
    ///
    /// # Errors
    ///
    /// [`Error::StreamMismatch`] for memory not ordered with this stream,
    /// [`Error::ShapeMismatch`], or [`Error::Device`].
    pub fn dtod<T: Pod, Dim: Dimension>(
        &self,
        src: &'v DeviceView<'_, D, T, Dim>,
        dst: &'v mut DeviceViewMut<'_, D, T, Dim>,
    ) -> Result<()> {
        let action = "copying between device views on another stream";
        self.check(src.owner, action)?;
        self.check(dst.owner, action)?;
        src.check_shape(dst.shape(), action)?;
        let (from, to, bytes) = (src.address, dst.device_ptr_mut(), src.byte_len());
        // SAFETY: both ranges are live while borrowed for `'v`, i.e. until this stream is
        // joined back; both are ordered with this stream (checked above: the workspace's
        // stream was forked into it, or the array belongs to it). Distinct allocations do
        // not overlap.
        unsafe { self.device().copy_dtod(&self.stream, from, to, bytes) }.map_err(|e| self.error(action, e))
    }

    /// Copies `src` into the host array `dst` (same shape) on this stream; complete when
    /// this returns.
    ///
    /// # Errors
    ///
    /// As [`OnStream::dtod`].
    pub fn dtoh<T: Pod, S: DataMut<Elem = T>, Dim: Dimension>(
        &self,
        src: &DeviceView<'_, D, T, Dim>,
        dst: &mut ArrayBase<S, Dim>,
    ) -> Result<()> {
        let action = "copying device data to the host on another stream";
        self.check(src.owner, action)?;
        src.check_shape(dst.shape(), action)?;
        let from = src.address;
        copy_to_host(dst, |bytes| {
            // SAFETY: `src` is live while borrowed (beyond this call) and ordered with this
            // stream (as in `dtod`); the copy is complete when this returns.
            unsafe { self.device().copy_dtoh(&self.stream, from, bytes) }.map_err(|e| self.error(action, e))
        })
    }

    /// Copies `src` into the pinned array `dst` asynchronously on this stream.
    ///
    /// # Errors
    ///
    /// As [`OnStream::dtod`], and [`Error::DeviceMismatch`].
    pub fn dtoh_pinned<T: Pod, Dim: Dimension>(
        &self,
        src: &'v DeviceView<'_, D, T, Dim>,
        dst: &mut PinnedArray<'_, D, T, Dim>,
    ) -> Result<()> {
        let action = "copying device data to pinned memory on another stream";
        self.check(src.owner, action)?;
        src.check_shape(dst.shape(), action)?;
        src.owner.check_device(dst.device(), action)?;
        let (from, host, bytes) = (src.address, dst.host_ptr(), src.byte_len());
        dst.transfer(&self.stream, |on| {
            // SAFETY: `src` is live and ordered with this stream (as in `dtod`); `host`
            // holds `bytes` bytes of pinned memory that `transfer` keeps from the host and
            // from reuse until the copy's event completes.
            unsafe { self.device().copy_dtoh_pinned(on, from, host, bytes) }
        })
        .map_err(|e| self.error(action, e))
    }

    /// Copies the host array `src` into `dst` (same shape) on this stream; `src` is read
    /// before this returns.
    ///
    /// # Errors
    ///
    /// As [`OnStream::dtod`].
    pub fn htod<T: Pod, S: Data<Elem = T>, Dim: Dimension>(
        &self,
        src: &ArrayBase<S, Dim>,
        dst: &'v mut DeviceViewMut<'_, D, T, Dim>,
    ) -> Result<()> {
        let action = "copying host data to the device on another stream";
        self.check(dst.owner, action)?;
        dst.check_shape(src.shape(), action)?;
        let to = dst.device_ptr_mut();
        with_host_bytes(src, |bytes| {
            // SAFETY: `dst` is live while borrowed for `'v` and ordered with this stream.
            unsafe { self.device().copy_htod(&self.stream, bytes, to) }
        })
        .map_err(|e| self.error(action, e))
    }

    /// Copies the pinned array `src` into `dst` asynchronously on this stream.
    ///
    /// # Errors
    ///
    /// As [`OnStream::dtoh_pinned`].
    pub fn htod_pinned<T: Pod, Dim: Dimension>(
        &self,
        src: &PinnedArray<'_, D, T, Dim>,
        dst: &'v mut DeviceViewMut<'_, D, T, Dim>,
    ) -> Result<()> {
        let action = "copying pinned memory to the device on another stream";
        self.check(dst.owner, action)?;
        dst.check_shape(src.shape(), action)?;
        dst.owner.check_device(src.device(), action)?;
        let (to, host, bytes) = (dst.device_ptr_mut(), src.host_ptr(), dst.byte_len());
        src.transfer(&self.stream, |on| {
            // SAFETY: `dst` is live while borrowed for `'v` and ordered with this stream;
            // `host` is pinned memory kept from host writes and reuse until the copy's
            // event completes.
            unsafe { self.device().copy_htod_pinned(on, host, to, bytes) }
        })
        .map_err(|e| self.error(action, e))
    }

    /// The device address of `view`, for a kernel launched on this stream that reads it.
    ///
    /// # Errors
    ///
    /// [`Error::StreamMismatch`] for memory not ordered with this stream.
    pub fn device_ptr<T, Dim: Dimension>(&self, view: &'v DeviceView<'_, D, T, Dim>) -> Result<u64> {
        self.check(view.owner, "handing memory to a kernel on another stream")?;
        Ok(view.address)
    }

    /// The device address of `view`, for a kernel launched on this stream that writes it.
    ///
    /// # Errors
    ///
    /// As [`OnStream::device_ptr`].
    pub fn device_ptr_mut<T, Dim: Dimension>(&self, view: &'v mut DeviceViewMut<'_, D, T, Dim>) -> Result<u64> {
        self.check(view.owner, "handing memory to a kernel on another stream")?;
        Ok(view.address)
    }

    /// Ends the use: the workspace's stream waits for this stream's work so far.
    ///
    /// # Errors
    ///
    /// [`Error::Device`] when the join cannot be issued (the cycle's reset still orders
    /// the stream).
    pub fn finish(mut self) -> Result<()> {
        self.joined = true;
        self.ws.join(&self.stream).map_err(|e| self.error("ordering the workspace's stream after another", e))
    }
}

impl<D: Device> std::fmt::Debug for OnStream<'_, '_, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnStream").field("workspace", self.ws.name()).field("stream", &self.stream).finish()
    }
}

impl<D: Device> Drop for OnStream<'_, '_, D> {
    fn drop(&mut self) {
        if !self.joined {
            if let Err(error) = self.ws.join(&self.stream) {
                // Reported by the next `enter`; the reset still orders the stream.
                self.ws.defer(error);
            }
        }
    }
}
