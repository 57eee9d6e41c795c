//! Declared use of a workspace's memory on another stream.
//!
//! A device workspace belongs to one stream. To copy its memory on another stream (a
//! copy stream overlapping compute), or to hand it to a kernel there, open an
//! [`OnStream`] with [`DeviceScope::on_stream`](crate::DeviceScope::on_stream). Each
//! operation issued through it first makes the other stream wait for the workspace's
//! stream's work so far, and when the `OnStream` ends the workspace's stream waits for
//! the other one. The views it is given stay borrowed until then, so the workspace's
//! own stream cannot write memory that the other stream is still reading, and the cycle
//! cannot close under it.
//!
//! None of this rests on the `OnStream`'s destructor: every use is recorded by the
//! workspace when it is issued, so if the `OnStream` is leaked (`mem::forget`), the
//! first later work on the workspace's stream that conflicts with the use (a write of
//! memory the other stream reads, a read or write of memory it writes) waits for the
//! other stream first, and the cycle's reset, or dropping the workspace, waits for it
//! in any case. Leaking costs overlap, never correctness.
//!
//! ```
//! use workspace_cuda::device::sim::SimDevice;
//! use workspace_cuda::{Device, DeviceArray, DeviceWorkspace};
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
use ndarray::Dimension;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::Owner;
use crate::view::{DeviceView, DeviceViewMut};
use crate::workspace::DeviceWorkspace;

/// Work on another stream with a workspace's memory; see the module docs.
///
/// `'v` is how long the views it was given stay borrowed: until it ends. So the
/// workspace's stream cannot write a view that the other stream may still be reading:
///
/// ```compile_fail
/// use workspace_cuda::device::sim::SimDevice;
/// use workspace_cuda::{Device, DeviceArray, DeviceWorkspace};
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
    pub(crate) stream: D::Stream,
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
        ws.order().note_foreign(stream);
        Ok(OnStream { ws, stream: stream.clone(), joined: false, _views: PhantomData })
    }

    /// Orders an operation about to be issued on this stream that accesses each of
    /// `accesses` (owner, device address, bytes, whether it writes), after checking
    /// that each owner is ordered with this stream. For the workspace's memory: the
    /// workspace's stream first waits for any third stream whose unordered use
    /// conflicts, then this stream waits for the workspace's stream's work so far, and
    /// then, when `record`, the use is recorded with the workspace (module docs).
    pub(crate) fn prepare(
        &self,
        accesses: &[(Owner<'_, D>, u64, usize, bool)],
        record: bool,
        action: &'static str,
    ) -> Result<()> {
        for &(owner, ..) in accesses {
            self.check(owner, action)?;
        }
        let in_workspace = |owner: &Owner<'_, D>| matches!(owner, Owner::Workspace(_));
        if self.stream == *self.ws.stream() || !accesses.iter().any(|(owner, ..)| in_workspace(owner)) {
            return Ok(()); // the workspace's own stream, or memory of this stream only
        }
        for &(_, address, bytes, writes) in accesses.iter().filter(|(owner, ..)| in_workspace(owner)) {
            self.ws
                .order()
                .order_home_use(address, bytes, writes, Some(&self.stream))
                .map_err(|e| self.error(action, e))?;
        }
        self.ws.order().fork(&self.stream).map_err(|e| self.error(action, e))?;
        if record {
            self.record(accesses, action)?;
        }
        Ok(())
    }

    /// Records the accesses to the workspace's memory among `accesses` (see `prepare`).
    pub(crate) fn record(&self, accesses: &[(Owner<'_, D>, u64, usize, bool)], action: &'static str) -> Result<()> {
        for &(owner, address, bytes, writes) in accesses {
            if let Owner::Workspace(_) = owner {
                self.ws.order().note_use(&self.stream, address, bytes, writes).map_err(|e| self.error(action, e))?;
            }
        }
        Ok(())
    }

    /// The stream the work runs on.
    pub fn stream(&self) -> &D::Stream {
        &self.stream
    }

    pub(crate) fn device(&self) -> &'s D {
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

    pub(crate) fn error(&self, action: &'static str, source: crate::DeviceError) -> Error {
        self.ws.device_error(action, source)
    }

    /// The device address of `view`, for a kernel launched on this stream that reads it:
    /// this stream waits for the workspace stream's work issued so far, and the workspace's
    /// stream waits for this stream before it next writes the view's memory.
    ///
    /// # Errors
    ///
    /// [`Error::StreamMismatch`] for memory not ordered with this stream;
    /// [`Error::Device`] when the ordering cannot be issued.
    pub fn device_ptr<T: Pod, Dim: Dimension>(&self, view: &'v DeviceView<'_, D, T, Dim>) -> Result<u64> {
        let action = "handing memory to a kernel on another stream";
        self.prepare(&[(view.owner, view.address, view.byte_len(), false)], true, action)?;
        Ok(view.address)
    }

    /// The device address of `view`, for a kernel launched on this stream that writes it
    /// (ordered as [`OnStream::device_ptr`], for reads too).
    ///
    /// # Errors
    ///
    /// As [`OnStream::device_ptr`].
    pub fn device_ptr_mut<T: Pod, Dim: Dimension>(&self, view: &'v mut DeviceViewMut<'_, D, T, Dim>) -> Result<u64> {
        let action = "handing memory to a kernel on another stream";
        self.prepare(&[(view.owner, view.address, view.byte_len(), true)], true, action)?;
        Ok(view.address)
    }

    /// Ends the use: the workspace's stream waits for this stream's work so far.
    ///
    /// # Errors
    ///
    /// [`Error::Device`] when the join cannot be issued (the workspace still orders the
    /// stream before it next touches the memory this stream used, and at the reset).
    pub fn finish(mut self) -> Result<()> {
        self.joined = true;
        self.ws.order().join(&self.stream).map_err(|e| self.error("ordering the workspace's stream after another", e))
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
            if let Err(error) = self.ws.order().join(&self.stream) {
                // Reported by the next `enter`. The uses stay recorded, so the workspace
                // still orders the stream before it touches their memory again.
                self.ws.order().defer(error);
            }
        }
    }
}
