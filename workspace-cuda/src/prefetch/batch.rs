//! What a [`DevicePrefetcher`](super::DevicePrefetcher) hands out: a [`DeviceLease`] on a
//! batch in the device ring, and the owned copies it can be detached into
//! ([`DeviceBatch`] on the device, [`DetachedBatch`] on the host).

use std::fmt;

use async_iter::{BatchArrays, BatchLayout, DetachedBatch, Role};
use bytemuck::Pod;
use ndarray::Dimension;

use super::ring::Place;
use super::Side;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::Owner;
use crate::view::DeviceView;

/// One batch in the device ring, lent to the consumer by
/// [`DevicePrefetcher::next`](super::DevicePrefetcher::next).
///
/// Its arrays are typed [`DeviceView`]s on the consumer's [`stream`](Self::stream):
/// launch kernels that read them there (or order another stream after it). The copy
/// that brought the batch is complete, as far as that stream is concerned, and the slot
/// is written again only after work issued to that stream before the lease ended.
///
/// The lease borrows the prefetcher, so the next batch can only be asked for once this
/// one is dropped; holding a batch across `next()` does not compile:
///
/// ```compile_fail,E0499
/// # use async_iter::{BatchLayout, BatchMut, BatchSource, SourceError};
/// # use workspace_cuda::device::sim::SimDevice;
/// # use workspace_cuda::DevicePrefetcher;
/// # struct Two;
/// # impl BatchSource for Two {
/// #     fn next_layout(&mut self, i: usize) -> Result<Option<BatchLayout>, SourceError> {
/// #         Ok((i < 2).then(|| BatchLayout::new().features::<f32, _>(4)))
/// #     }
/// #     fn fill(&mut self, _: &mut BatchMut<'_>) -> Result<(), SourceError> { Ok(()) }
/// # }
/// let sim = SimDevice::new()?;
/// let mut batches = DevicePrefetcher::builder(Two, &sim).build()?;
/// let first = batches.next().unwrap()?;
/// let second = batches.next().unwrap()?; // error[E0499]: `batches` is still borrowed by `first`
/// println!("{:?}", first.features::<f32, ndarray::Ix1>()?);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// To keep a batch, copy it out: [`detach`](Self::detach) to the device,
/// [`to_host`](Self::to_host) to the host. [`BatchArrays`] reads its arrays as it
/// reads a host batch's.
pub struct DeviceLease<'a, D: Device> {
    pub(super) side: &'a mut Side<D>,
    pub(super) batch: Leased,
}

/// The batch a lease shows, and where.
#[derive(Clone, Copy, Debug)]
pub(super) struct Leased {
    pub(super) info: BatchInfo,
    pub(super) place: Place,
}

impl<D: Device> DeviceLease<'_, D> {
    /// The batch's index in its epoch (0 for the first).
    pub fn index(&self) -> usize {
        self.batch.info.index
    }

    /// The epoch the batch belongs to (0 for the first).
    pub fn epoch(&self) -> u64 {
        self.batch.info.epoch
    }

    /// The batch's layout: shapes and element types of its arrays.
    pub fn layout(&self) -> &BatchLayout {
        &self.batch.info.layout
    }

    /// Bytes the batch takes (its arrays, each at a multiple of 64 bytes).
    pub fn bytes(&self) -> usize {
        self.batch.info.bytes
    }

    /// The consumer's stream, which every use of the batch is ordered on.
    pub fn stream(&self) -> &D::Stream {
        &self.side.ring.memory().consumer
    }

    /// The features array.
    ///
    /// # Errors
    ///
    /// [`Error::Prefetch`] with `WrongElementType` or `WrongDimensionality` when `T` or
    /// `Dim` do not match what the batch holds (`IxDyn` accepts any dimensionality).
    pub fn features<T: Pod, Dim: Dimension>(&self) -> Result<DeviceView<'_, D, T, Dim>> {
        self.array(Role::Features)
    }

    /// The labels array.
    ///
    /// # Errors
    ///
    /// As [`features`](Self::features), and `MissingArray` when the batch has no labels.
    pub fn labels<T: Pod, Dim: Dimension>(&self) -> Result<DeviceView<'_, D, T, Dim>> {
        self.array(Role::Labels)
    }

    /// The features mask, if the batch has one.
    ///
    /// # Errors
    ///
    /// As [`features`](Self::features).
    pub fn features_mask<T: Pod, Dim: Dimension>(&self) -> Result<Option<DeviceView<'_, D, T, Dim>>> {
        BatchArrays::features_mask(self)
    }

    /// The labels mask, if the batch has one.
    ///
    /// # Errors
    ///
    /// As [`features`](Self::features).
    pub fn labels_mask<T: Pod, Dim: Dimension>(&self) -> Result<Option<DeviceView<'_, D, T, Dim>>> {
        BatchArrays::labels_mask(self)
    }

    /// The array of `role`.
    ///
    /// # Errors
    ///
    /// As [`labels`](Self::labels).
    pub fn array<T: Pod, Dim: Dimension>(&self, role: Role) -> Result<DeviceView<'_, D, T, Dim>> {
        let (spec, dim) = self.batch.info.layout.typed::<T, Dim>(self.batch.info.index, role)?;
        let slots = self.side.ring.memory();
        let owner = Owner::Ring { device: &slots.device, stream: &slots.consumer };
        // SAFETY: the slot holds the batch (the consumer's stream waited for its copy) and
        // is not written again before work issued to that stream while the lease lives;
        // the array lies inside the batch (its spec comes from the batch's planned layout).
        Ok(unsafe { DeviceView::new(owner, self.batch.place.address + spec.offset() as u64, dim) })
    }

    /// Copies the batch into device memory of its own (one device-to-device copy on
    /// the consumer's stream) and ends the lease; the [`DeviceBatch`] outlives the
    /// prefetcher.
    ///
    /// # Errors
    ///
    /// [`Error::Device`] when the device cannot allocate or copy.
    pub fn detach(self) -> Result<DeviceBatch<D>> {
        let memory = self.whole().detach_memory("detaching a batch")?;
        let ring = &self.side.ring;
        Ok(DeviceBatch {
            memory,
            device: ring.memory().device.clone(),
            stream: ring.memory().consumer.clone(),
            info: self.batch.info,
        })
    }

    /// The whole batch, as bytes.
    fn whole(&self) -> DeviceView<'_, D, u8> {
        let owner = Owner::Ring { device: &self.side.ring.memory().device, stream: &self.side.ring.memory().consumer };
        // SAFETY: as in `array`: the slot holds the batch's bytes while the lease lives.
        unsafe { DeviceView::new(owner, self.batch.place.address, ndarray::Ix1(self.batch.info.bytes)) }
    }

    /// Copies the batch to the host (drop the lease to hand its slot back).
    ///
    /// # Errors
    ///
    /// [`Error::Device`] when the device cannot copy.
    pub fn to_host(&self) -> Result<DetachedBatch> {
        copy_to_host(&self.whole(), self.batch.info)
    }

    /// Copies the batch to the host and ends the lease: the former name of
    /// [`to_host`](Self::to_host).
    ///
    /// # Errors
    ///
    /// As [`to_host`](Self::to_host).
    #[deprecated(note = "renamed `to_host`, as on `DeviceBatch` and `DeviceArray`")]
    #[doc(hidden)]
    pub fn detach_to_host(self) -> Result<DetachedBatch> {
        self.to_host()
    }
}

impl<D: Device> BatchArrays for DeviceLease<'_, D> {
    type View<'b, T: Pod, Dim: Dimension>
        = DeviceView<'b, D, T, Dim>
    where
        Self: 'b;
    type Error = Error;

    fn index(&self) -> usize {
        DeviceLease::index(self)
    }

    fn epoch(&self) -> u64 {
        DeviceLease::epoch(self)
    }

    fn layout(&self) -> &BatchLayout {
        DeviceLease::layout(self)
    }

    fn array<T: Pod, Dim: Dimension>(&self, role: Role) -> Result<DeviceView<'_, D, T, Dim>> {
        DeviceLease::array(self, role)
    }

    /// A copy from the device, on the consumer's stream.
    fn to_array<T: Pod, Dim: Dimension>(&self, role: Role) -> Result<ndarray::Array<T, Dim>> {
        DeviceLease::array::<T, Dim>(self, role)?.to_host()
    }
}

impl<D: Device> BatchArrays for DeviceBatch<D> {
    type View<'b, T: Pod, Dim: Dimension>
        = DeviceView<'b, D, T, Dim>
    where
        Self: 'b;
    type Error = Error;

    fn index(&self) -> usize {
        DeviceBatch::index(self)
    }

    fn epoch(&self) -> u64 {
        DeviceBatch::epoch(self)
    }

    fn layout(&self) -> &BatchLayout {
        DeviceBatch::layout(self)
    }

    fn array<T: Pod, Dim: Dimension>(&self, role: Role) -> Result<DeviceView<'_, D, T, Dim>> {
        DeviceBatch::array(self, role)
    }

    /// A copy from the device, on the batch's stream.
    fn to_array<T: Pod, Dim: Dimension>(&self, role: Role) -> Result<ndarray::Array<T, Dim>> {
        DeviceBatch::array::<T, Dim>(self, role)?.to_host()
    }
}

impl<D: Device> Drop for DeviceLease<'_, D> {
    fn drop(&mut self) {
        self.side.end_lease();
    }
}

impl<D: Device> fmt::Debug for DeviceLease<'_, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceLease")
            .field("epoch", &self.epoch())
            .field("index", &self.index())
            .field("layout", self.layout())
            .field("address", &format_args!("{:#x}", self.batch.place.address))
            .finish()
    }
}

/// A batch copied out of the device ring by [`DeviceLease::detach`]: it owns its device
/// memory (freed in its stream's order when dropped) and outlives the prefetcher.
pub struct DeviceBatch<D: Device> {
    /// Invariant: holds the batch's `layout.bytes()` bytes (or they are being copied in,
    /// in `stream`'s order).
    memory: D::Memory,
    device: D,
    stream: D::Stream,
    info: BatchInfo,
}

impl<D: Device> DeviceBatch<D> {
    /// The batch's index in its epoch.
    pub fn index(&self) -> usize {
        self.info.index
    }

    /// The epoch the batch came from.
    pub fn epoch(&self) -> u64 {
        self.info.epoch
    }

    /// The batch's layout.
    pub fn layout(&self) -> &BatchLayout {
        &self.info.layout
    }

    /// The stream the batch belongs to (the prefetcher's consumer stream).
    pub fn stream(&self) -> &D::Stream {
        &self.stream
    }

    /// The features array.
    ///
    /// # Errors
    ///
    /// As [`DeviceLease::features`].
    pub fn features<T: Pod, Dim: Dimension>(&self) -> Result<DeviceView<'_, D, T, Dim>> {
        self.array(Role::Features)
    }

    /// The labels array.
    ///
    /// # Errors
    ///
    /// As [`DeviceLease::labels`].
    pub fn labels<T: Pod, Dim: Dimension>(&self) -> Result<DeviceView<'_, D, T, Dim>> {
        self.array(Role::Labels)
    }

    /// The features mask, if the batch has one.
    ///
    /// # Errors
    ///
    /// As [`DeviceLease::features`].
    pub fn features_mask<T: Pod, Dim: Dimension>(&self) -> Result<Option<DeviceView<'_, D, T, Dim>>> {
        BatchArrays::features_mask(self)
    }

    /// The labels mask, if the batch has one.
    ///
    /// # Errors
    ///
    /// As [`DeviceLease::features`].
    pub fn labels_mask<T: Pod, Dim: Dimension>(&self) -> Result<Option<DeviceView<'_, D, T, Dim>>> {
        BatchArrays::labels_mask(self)
    }

    /// The array of `role`.
    ///
    /// # Errors
    ///
    /// As [`DeviceLease::labels`].
    pub fn array<T: Pod, Dim: Dimension>(&self, role: Role) -> Result<DeviceView<'_, D, T, Dim>> {
        let (spec, dim) = self.info.layout.typed::<T, Dim>(self.info.index, role)?;
        let owner = Owner::Array { device: &self.device, stream: &self.stream };
        // SAFETY: the batch's own allocation holds its bytes for as long as `self` lives,
        // and the array lies inside it (its spec comes from the batch's planned layout).
        Ok(unsafe { DeviceView::new(owner, D::memory_address(&self.memory) + spec.offset() as u64, dim) })
    }

    /// Copies the batch to the host.
    ///
    /// # Errors
    ///
    /// [`Error::Device`] when the device cannot copy.
    pub fn to_host(&self) -> Result<DetachedBatch> {
        let owner = Owner::Array { device: &self.device, stream: &self.stream };
        // SAFETY: the allocation holds the batch's bytes for as long as `self` lives.
        let whole = unsafe { DeviceView::new(owner, D::memory_address(&self.memory), ndarray::Ix1(self.info.bytes)) };
        copy_to_host(&whole, self.info)
    }
}

impl<D: Device> fmt::Debug for DeviceBatch<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBatch")
            .field("epoch", &self.info.epoch)
            .field("index", &self.info.index)
            .field("layout", &self.info.layout)
            .field("memory", &self.memory)
            .finish()
    }
}

/// What a batch is, wherever it lives.
#[derive(Clone, Copy, Debug)]
pub(super) struct BatchInfo {
    /// Planned.
    pub(super) layout: BatchLayout,
    pub(super) index: usize,
    pub(super) epoch: u64,
    /// `layout`'s planned bytes.
    pub(super) bytes: usize,
}

/// Copies the batch in `bytes` (laid out as in the ring) to the host, on its stream.
fn copy_to_host<D: Device>(bytes: &DeviceView<'_, D, u8>, info: BatchInfo) -> Result<DetachedBatch> {
    DetachedBatch::read_from(info.layout, info.index, info.epoch, |target| {
        bytes.dtoh_into(&mut ndarray::ArrayViewMut1::from(target))
    })
}
