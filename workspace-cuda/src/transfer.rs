//! Every copy and fill a device workspace issues: the one module that calls the
//! [`Device`]'s unsafe copies, each behind a safe method of a view or of an
//! [`OnStream`].
//!
//! Each method's safety rests on two things it checks or establishes itself before the
//! unsafe call: the memory is live for the call (it is reached through a view, which
//! borrows its scope, array or lease, or through a fresh allocation), and the operation
//! is ordered with every other stream that uses the memory (`order_home_use` on the
//! owner's stream; `OnStream::prepare` on another stream). The ordering model is in the
//! [`workspace`](crate::workspace) module docs.

use bytemuck::Pod;
use ndarray::{ArrayBase, Data, DataMut, Dimension};

use crate::array::DeviceArray;
use crate::device::Device;
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::pinned::PinnedArray;
use crate::scope::DeviceScope;
use crate::stream::OnStream;
use crate::view::{copy_to_host, with_host_bytes, DeviceView, DeviceViewMut};

/// Copies out of a view, on its owner's stream.
impl<'a, D: Device, T: Pod, Dim: Dimension> DeviceView<'a, D, T, Dim> {
    /// Copies into an owned device array (device to device, on this view's stream) that
    /// outlives every reset.
    ///
    /// # Errors
    ///
    /// [`Error::Device`] when the device cannot allocate or copy.
    pub fn detach(&self) -> Result<DeviceArray<D, T, Dim>> {
        let memory = self.detach_memory("detaching a view")?;
        Ok(DeviceArray::from_parts(memory, self.owner.device().clone(), self.owner.stream().clone(), self.dim.clone()))
    }

    /// Copies the view's bytes into a new allocation of its device (device to device, on
    /// the owner's stream).
    /// Copies into `target` (another open device workspace, typically an outer one),
    /// returning a view there. When `target` is on another stream, that stream waits for
    /// this view's stream before the copy, and this view's stream waits for the copy.
    ///
    /// # Errors
    ///
    /// `target`'s allocation errors, [`Error::DeviceMismatch`], or [`Error::Device`].
    pub fn leverage_to<'t>(&self, target: &'t DeviceScope<'_, D>) -> Result<DeviceViewMut<'t, D, T, Dim>> {
        target.copy_of(self)
    }

    pub(crate) fn detach_memory(&self, action: &'static str) -> Result<D::Memory> {
        let device = self.owner.device();
        let stream = self.owner.stream();
        self.owner.order_home_use(self.address, self.byte_len(), false, action)?;
        let memory = device.alloc(stream, self.byte_len()).map_err(|e| self.owner.error(action, e))?;
        let target = D::memory_address(&memory);
        // SAFETY: both ranges hold `byte_len` bytes: the view's (valid for `'a`, so until
        // after this copy, which is issued now on the owner's stream, after every other
        // stream that wrote the range: `order_home_use`) and a fresh allocation on the same
        // stream, so the copy is ordered with both.
        unsafe { device.copy_dtod(stream, self.address, target, self.byte_len()) }
            .map_err(|e| self.owner.error(action, e))?;
        Ok(memory)
    }

    /// Copies into an existing host array of the same shape (of any layout: a view of a
    /// host workspace, for instance).
    ///
    /// # Errors
    ///
    /// [`Error::ShapeMismatch`], or [`Error::Device`] when the device cannot copy.
    pub fn dtoh_into<S: DataMut<Elem = T>>(&self, dst: &mut ArrayBase<S, Dim>) -> Result<()> {
        let action = "copying device data to the host";
        self.check_shape(dst.shape(), action)?;
        let (owner, address) = (self.owner, self.address);
        owner.order_home_use(address, self.byte_len(), false, action)?;
        copy_to_host(dst, |bytes| {
            // SAFETY: the view's `bytes.len()` bytes are valid for `'a`, beyond this call,
            // and the copy runs on the owner's stream; it is complete when this returns.
            unsafe { owner.device().copy_dtoh(owner.stream(), address, bytes) }.map_err(|e| owner.error(action, e))
        })
    }

    /// Copies into the pinned staging array `dst`, asynchronously on this view's stream;
    /// reading `dst` on the host waits for the copy.
    ///
    /// # Errors
    ///
    /// [`Error::ShapeMismatch`], [`Error::DeviceMismatch`], or [`Error::Device`].
    pub fn dtoh_pinned(&self, dst: &mut PinnedArray<'_, D, T, Dim>) -> Result<()> {
        let action = "copying device data to pinned memory";
        self.check_shape(dst.shape(), action)?;
        self.owner.check_device(dst.device(), action)?;
        let stream = self.owner.stream();
        let bytes = self.byte_len();
        let (address, host) = (self.address, dst.host_ptr());
        self.owner.order_home_use(address, bytes, false, action)?;
        dst.transfer(stream, |on| {
            // SAFETY: the view's range is valid for `'a` and the copy runs on its owner's
            // stream; `host` holds `bytes` bytes of pinned memory that `transfer` keeps
            // from the host (and from reuse) until the copy's event completes.
            unsafe { self.owner.device().copy_dtoh_pinned(on, address, host, bytes) }
        })
        .map_err(|e| self.owner.error(action, e))
    }
}

/// Writes into a view, on its owner's stream.
impl<'a, D: Device, T: Pod, Dim: Dimension> DeviceViewMut<'a, D, T, Dim> {
    /// Sets every element to zero (on the view's stream).
    ///
    /// # Errors
    ///
    /// [`Error::Device`].
    pub fn fill_zeros(&mut self) -> Result<()> {
        let action = "zeroing a view";
        let (owner, address, bytes) = (self.view.owner, self.view.address, self.view.byte_len());
        owner.order_home_use(address, bytes, true, action)?;
        // SAFETY: the view's range is valid for `'a` and exclusively ours; the memset is
        // issued to the owner's stream, after every other stream that used the range
        // (`order_home_use`).
        unsafe { owner.device().memset_zero(owner.stream(), address, bytes) }.map_err(|e| owner.error(action, e))
    }

    /// Copies a host array of the same shape into this view (on the view's stream; the
    /// source is read before this returns).
    ///
    /// # Errors
    ///
    /// [`Error::ShapeMismatch`], or [`Error::Device`].
    pub fn htod_from<S: Data<Elem = T>>(&mut self, src: &ArrayBase<S, Dim>) -> Result<()> {
        let action = "copying host data to the device";
        self.view.check_shape(src.shape(), action)?;
        let (owner, address) = (self.view.owner, self.view.address);
        owner.order_home_use(address, self.view.byte_len(), true, action)?;
        with_host_bytes(src, |bytes| {
            // SAFETY: the view's range (`bytes.len()` bytes) is valid for `'a` and
            // exclusively ours; the copy is issued to the owner's stream, after every
            // other stream that used the range (`order_home_use`).
            unsafe { owner.device().copy_htod(owner.stream(), bytes, address) }
        })
        .map_err(|e| owner.error(action, e))
    }

    /// Copies the pinned staging array `src` into this view, asynchronously on the
    /// view's stream; writing `src` on the host waits for the copy.
    ///
    /// # Errors
    ///
    /// [`Error::ShapeMismatch`], [`Error::DeviceMismatch`], or [`Error::Device`].
    pub fn htod_pinned(&mut self, src: &PinnedArray<'_, D, T, Dim>) -> Result<()> {
        let action = "copying pinned memory to the device";
        self.view.check_shape(src.shape(), action)?;
        self.view.owner.check_device(src.device(), action)?;
        let (owner, address, bytes) = (self.view.owner, self.view.address, self.view.byte_len());
        let host = src.host_ptr();
        owner.order_home_use(address, bytes, true, action)?;
        src.transfer(owner.stream(), |on| {
            // SAFETY: the view's range is valid for `'a` and exclusively ours, the copy is
            // issued to its owner's stream, after every other stream that used the range
            // (`order_home_use`); `host` holds `bytes` bytes of pinned memory that
            // `transfer` keeps from host writes and reuse until the copy completes.
            unsafe { owner.device().copy_htod_pinned(on, host, address, bytes) }
        })
        .map_err(|e| owner.error(action, e))
    }

    /// Copies another device view of the same shape into this one. The copy runs on this
    /// view's stream, ordered with the source's stream when they differ.
    ///
    /// # Errors
    ///
    /// [`Error::ShapeMismatch`], [`Error::DeviceMismatch`], or [`Error::Device`].
    pub fn copy_from(&mut self, src: &DeviceView<'_, D, T, Dim>) -> Result<()> {
        let action = "copying between device views";
        src.check_shape(self.shape(), action)?;
        let target = self.view.owner;
        src.owner.check_device(target.device(), action)?;
        let (from, to, bytes) = (src.address, self.view.address, self.view.byte_len());
        src.owner.order_home_use(from, bytes, false, action)?;
        target.order_home_use(to, bytes, true, action)?;
        src.owner.run_on(target.stream(), action, |on| {
            // SAFETY: both ranges are valid while the views are borrowed, which outlasts
            // issuing the copy; the copy runs on the destination's stream, after every
            // other stream that used the destination range (`order_home_use`), and
            // `run_on` orders it with the source's stream (which waited for every other
            // stream that wrote the source range, and which waits for the copy in turn).
            // Distinct allocations never overlap.
            unsafe { target.device().copy_dtod(on, from, to, bytes) }
        })
    }
}

/// Copies on another stream.
impl<'s, 'v, D: Device> OnStream<'s, 'v, D> {
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
        src.check_shape(dst.shape(), action)?;
        let (from, to, bytes) = (src.address, dst.address, src.byte_len());
        self.prepare(&[(src.owner, from, bytes, false), (dst.owner, to, bytes, true)], true, action)?;
        // SAFETY: both ranges are live while borrowed for `'v`; both are ordered with this
        // stream (`prepare`: this stream waits for the workspace's stream, and the use is
        // recorded, so the workspace's stream waits for this one before it next touches
        // the ranges or resets, even if `self` is leaked; or the array belongs to this
        // stream). Distinct allocations do not overlap.
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
        src.check_shape(dst.shape(), action)?;
        let access = [(src.owner, src.address, src.byte_len(), false)];
        // Not recorded: the copy is complete when it returns (recorded if it fails).
        self.prepare(&access, false, action)?;
        let from = src.address;
        copy_to_host(dst, |bytes| {
            // SAFETY: `src` is live while borrowed (beyond this call) and ordered with this
            // stream (as in `dtod`); the copy is complete when this returns.
            unsafe { self.device().copy_dtoh(&self.stream, from, bytes) }.map_err(|e| self.error(action, e))
        })
        .inspect_err(|_| {
            // Whether the copy still runs is unknown: treat it as a use.
            let _ = self.record(&access, action);
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
        src.check_shape(dst.shape(), action)?;
        src.owner.check_device(dst.device(), action)?;
        let (from, host, bytes) = (src.address, dst.host_ptr(), src.byte_len());
        self.prepare(&[(src.owner, from, bytes, false)], true, action)?;
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
        dst.check_shape(src.shape(), action)?;
        let to = dst.address;
        self.prepare(&[(dst.owner, to, dst.byte_len(), true)], true, action)?;
        with_host_bytes(src, |bytes| {
            // SAFETY: `dst` is live while borrowed for `'v` and ordered with this stream
            // (`prepare`, as in `dtod`).
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
        dst.check_shape(src.shape(), action)?;
        dst.owner.check_device(src.device(), action)?;
        let (to, host, bytes) = (dst.address, src.host_ptr(), dst.byte_len());
        self.prepare(&[(dst.owner, to, bytes, true)], true, action)?;
        src.transfer(&self.stream, |on| {
            // SAFETY: `dst` is live while borrowed for `'v` and ordered with this stream
            // (`prepare`, as in `dtod`); `host` is pinned memory kept from host writes and
            // reuse until the copy's event completes.
            unsafe { self.device().copy_htod_pinned(on, host, to, bytes) }
        })
        .map_err(|e| self.error(action, e))
    }
}
