//! Device scopes and frames: the open cycle, and release points inside it, that device
//! views borrow.
//!
//! A [`DeviceScope`] is the guard of one enter, nested enter or borrow of a
//! [`DeviceWorkspace`]. Allocation takes `&self` and returns views that borrow the
//! scope; the arena resets (ordered on the workspace's stream) when the last scope
//! closes. A [`DeviceFrame`] is a release point inside a scope, as the host's
//! [`Frame`](workspace_core::Frame): its views borrow it, and its bytes are handed out
//! again in the same cycle once it closes, after every other stream that used them is
//! ordered before the workspace's stream.
//!
//! [`DeviceWorkspace::enter`] and [`DeviceWorkspace::borrow_open`], which open a scope,
//! are here; the scope's handle constructors ([`DeviceScope::zeros_handle`] and the
//! like) are with [`DeviceHandle`](crate::DeviceHandle).

use bytemuck::Pod;
use ndarray::{ArrayBase, Data, Dimension, ShapeBuilder};
use workspace_core::backend::{Open, OpenFrame, Placement, ScopeKind};

use crate::backend::DeviceBackend;

use crate::device::Device;
use crate::error::Result;
use crate::memory::checked_bytes;
use crate::pinned::PinnedArray;
use crate::stream::OnStream;
use crate::view::{Carve, DeviceUninit, DeviceView, DeviceViewMut};
use crate::workspace::{DeviceWorkspace, StreamOrder};

/// The allocation methods of [`DeviceScope`] and [`DeviceFrame`], written once: each
/// type has a `reserve` of its own (the cycle's, or the frame's level).
macro_rules! allocation_methods {
    () => {
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
    };
}

/// Opening a scope.
impl<D: Device> DeviceWorkspace<D> {
    /// Opens a cycle (new generation) or, when already open, nests without resetting.
    ///
    /// # Errors
    ///
    /// When opening: an error recorded since the last cycle (a stream that could not be
    /// ordered, a device error from a `Drop`, a failed arena growth). The workspace
    /// stays closed and usable; entering again retries.
    #[inline]
    pub fn enter(&self) -> Result<DeviceScope<'_, D>> {
        Ok(DeviceScope::new(self, (**self).open()?))
    }

    /// Makes this already open workspace an allocation target for a while (as
    /// [`Workspace::borrow_open`](workspace_core::Workspace::borrow_open)).
    ///
    /// # Errors
    ///
    /// [`workspace_core::Error::NotOpen`] when the workspace is closed: leveraging into a
    /// closed workspace is an error, never a silent no-op.
    pub fn borrow_open(&self) -> Result<DeviceScope<'_, D>> {
        Ok(DeviceScope::new(self, (**self).open_borrowed()?))
    }
}

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

    allocation_methods!();
}

impl<'ws, D: Device> DeviceScope<'ws, D> {
    /// Opens a [`DeviceFrame`] in this scope: a release point for what it allocates.
    ///
    /// # Errors
    ///
    /// [`workspace_core::Error::InvalidInput`] when 65,535 frames of this workspace are
    /// open already.
    pub fn frame(&self) -> Result<DeviceFrame<'_, D>> {
        Ok(DeviceFrame { ws: self.ws, open: self.open.frame()? })
    }

    /// Reserves memory for `dim` elements of `T` in the open cycle: its device address.
    fn reserve_cycle<T, Dim: Dimension>(&self, dim: &Dim) -> Result<u64> {
        let bytes = checked_bytes::<T, Dim>(dim, || self.ws.name().clone())?;
        // The shell orders a reuse of a plan group's bytes (`StreamOrder::after_alloc`).
        let (base, offset) = self.open.alloc(bytes, std::mem::align_of::<T>())?;
        Ok(base + offset as u64)
    }
}

// SAFETY: the engine reserves the bytes in the open cycle, handed out again only when
// the cycle ends, which waits for this scope (its `Open` count) to close; the reset is
// ordered on the workspace's stream (module docs of `workspace`), and a reuse of a plan
// group's bytes is ordered by the shell's `after_alloc` hook before `alloc` returns.
#[allow(unsafe_code)]
unsafe impl<D: Device> Carve<D> for DeviceScope<'_, D> {
    fn workspace(&self) -> &DeviceWorkspace<D> {
        self.ws
    }

    #[inline]
    fn reserve<T, Dim: Dimension>(&self, dim: &Dim) -> Result<u64> {
        self.reserve_cycle::<T, Dim>(dim)
    }
}

/// A release point inside an open device scope: arrays allocated from the frame live
/// until the frame closes, and then the bytes they took are handed out again in the
/// same cycle (the host's [`Frame`](workspace_core::Frame), on the device). Opened with
/// [`DeviceScope::frame`] (or [`DeviceFrame::frame`], nested).
///
/// The views borrow the frame, so the compiler proves them dead when it closes:
///
/// ```compile_fail,E0505
/// use workspace_cuda::device::sim::SimDevice;
/// use workspace_cuda::{Device, DeviceWorkspace};
/// let sim = SimDevice::new().unwrap();
/// let ws = DeviceWorkspace::new("W", Default::default(), &sim, &sim.default_stream()).unwrap();
/// let scope = ws.enter().unwrap();
/// let frame = scope.frame().unwrap();
/// let tmp = frame.zeros::<f32, _>(16).unwrap();
/// drop(frame); // its bytes are handed out again here...
/// tmp.to_host().unwrap(); // ...so this does not compile
/// ```
///
/// Reuse is ordered on the stream: the bytes go to the next allocation of the same
/// cycle, whose work runs on the workspace's stream after everything issued there
/// before; and when the frame closes, every other stream with a use of the
/// workspace's memory not yet ordered (an [`OnStream`] still open, or leaked, or a copy
/// read there) is first made to finish before the workspace's stream. When that cannot be
/// issued, the frame's bytes are kept to the end of the cycle instead (as for a frame
/// never closed), and the error is reported by the next `enter`.
///
/// ```
/// use workspace_cuda::device::sim::SimDevice;
/// use workspace_cuda::{Device, DeviceWorkspace};
/// use workspace_core::{LearningPolicy, WorkspaceConfig};
///
/// let sim = SimDevice::new()?;
/// let config = WorkspaceConfig::builder().learning(LearningPolicy::None).initial_size(1 << 20).build()?;
/// let ws = DeviceWorkspace::new("UPDATER", config, &sim, &sim.default_stream())?;
/// let scope = ws.enter()?;
/// let mut total = scope.zeros::<f32, _>(1 << 16)?; // lives to the end of the scope
/// for step in 0..3 {
///     let frame = scope.frame()?;
///     let update = frame.htod(&ndarray::Array1::from_elem(1 << 16, step as f32))?; // 256 KiB
///     total.copy_from(&update)?; // a kernel would accumulate here
/// } // each frame's 256 KiB are handed out again to the next
/// drop(scope);
/// assert!(ws.stats().peak_bytes < 3 * 256 * 1024);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// A frame makes no handles (a handle outlives the views' borrow, and a frame's bytes
/// are reused before its cycle ends). In a device plan group
/// ([`DevicePlanGroup`](crate::DevicePlanGroup)) each frame is an owner of its own, so
/// the plan lets later arrays, of any member and on any stream, share its bytes.
///
/// `!Send` and `!Sync`, like its scope.
pub struct DeviceFrame<'f, D: Device> {
    ws: &'f DeviceWorkspace<D>,
    /// The engine's frame; dropping it closes the frame (after the workspace's hooks
    /// ordered the other streams).
    open: OpenFrame<'f, DeviceBackend<D>, StreamOrder<D>>,
}

impl<'f, D: Device> DeviceFrame<'f, D> {
    /// Opens a frame while this one is open, as the scope's `frame` does: its level is one
    /// more than the top frame's (the newest open one, which may be another).
    ///
    /// # Errors
    ///
    /// As [`DeviceScope::frame`].
    pub fn frame(&self) -> Result<DeviceFrame<'_, D>> {
        Ok(DeviceFrame { ws: self.ws, open: self.open.frame()? })
    }

    /// The frame's level in its cycle: 1 for a frame opened while no other frame of
    /// the workspace was open, one more for each frame open when it opened.
    pub fn level(&self) -> u32 {
        self.open.level()
    }

    /// The workspace this frame allocates in.
    pub fn workspace(&self) -> &'f DeviceWorkspace<D> {
        self.ws
    }

    /// Where `view`'s memory lies relative to this workspace's arena.
    pub fn placement<T, Dim: Dimension>(&self, view: &DeviceView<'_, D, T, Dim>) -> Placement {
        self.ws.placement(view.address)
    }

    /// Reserves memory for `dim` elements of `T` at the frame's level.
    fn reserve_frame<T, Dim: Dimension>(&self, dim: &Dim) -> Result<u64> {
        let bytes = checked_bytes::<T, Dim>(dim, || self.ws.name().clone())?;
        let (base, offset) = self.open.alloc(bytes, std::mem::align_of::<T>())?;
        Ok(base + offset as u64)
    }

    allocation_methods!();
}

// SAFETY: the engine reserves the bytes at the frame's level; they are handed out again
// only when the frame closes (or, if it never does, when the cycle ends), and the frame
// closes when this value drops, after the workspace's hooks ordered every other stream
// with a use of the memory before the workspace's stream (or keeps them to the end of
// the cycle when it cannot). The frame borrows its scope, so the cycle cannot end first.
#[allow(unsafe_code)]
unsafe impl<D: Device> Carve<D> for DeviceFrame<'_, D> {
    fn workspace(&self) -> &DeviceWorkspace<D> {
        self.ws
    }

    #[inline]
    fn reserve<T, Dim: Dimension>(&self, dim: &Dim) -> Result<u64> {
        self.reserve_frame::<T, Dim>(dim)
    }
}

impl<D: Device> std::fmt::Debug for DeviceFrame<'_, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceFrame")
            .field("workspace", self.ws.name())
            .field("level", &self.open.level())
            .finish_non_exhaustive()
    }
}
