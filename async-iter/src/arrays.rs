//! One way to read a batch's arrays, wherever the batch lives: [`BatchArrays`].

use bytemuck::Pod;
use ndarray::{Array, ArrayView, Dimension};

use crate::detached::DetachedBatch;
use crate::error::Error;
use crate::layout::BatchLayout;
use crate::lease::Lease;
use crate::role::Role;

/// A batch's arrays, read the same way whether the batch is leased from a ring
/// ([`Lease`]), owned on the host ([`DetachedBatch`]), or on a device
/// (`workspace_cuda`'s `DeviceLease` and `DeviceBatch`): code written against this
/// trait takes any of them.
///
/// The types keep these methods as inherent methods too (a device batch's
/// `to_array` aside, where `to_host` copies the whole batch), so that a caller who
/// knows the type needs no import.
///
/// ```
/// use async_iter::{BatchArrays, BatchLayout, BatchMut, BatchSource, Prefetcher, Role, SourceError};
/// use ndarray::Ix1;
///
/// /// The first label of any batch, as a host value.
/// fn first_label<B: BatchArrays>(batch: &B) -> Result<u32, B::Error> {
///     Ok(batch.to_array::<u32, Ix1>(Role::Labels)?[0])
/// }
///
/// struct Two;
/// impl BatchSource for Two {
///     fn next_layout(&mut self, i: usize) -> Result<Option<BatchLayout>, SourceError> {
///         Ok((i < 2).then(|| BatchLayout::new().features::<f32, _>(4).labels::<u32, _>(4)))
///     }
///     fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
///         batch.labels::<u32, Ix1>()?.fill(7 + batch.index() as u32);
///         Ok(())
///     }
/// }
///
/// let mut batches = Prefetcher::builder(Two).build()?;
/// let lease = batches.next().unwrap()?;
/// assert_eq!(first_label(&lease)?, 7);
/// assert!(lease.features_mask::<f32, Ix1>()?.is_none());
/// let owned = lease.detach();
/// assert_eq!(first_label(&owned)?, 7);
/// # Ok::<(), async_iter::Error>(())
/// ```
pub trait BatchArrays {
    /// A view of one of the batch's arrays: an `ndarray::ArrayView` for a batch on the
    /// host, a device view for one on a device.
    type View<'b, T: Pod, Dim: Dimension>
    where
        Self: 'b;
    /// What a failed access returns.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The batch's index in its epoch (0 for the first).
    fn index(&self) -> usize;

    /// The epoch the batch came from.
    fn epoch(&self) -> u64;

    /// The batch's layout: which arrays it holds, their element types and shapes.
    fn layout(&self) -> &BatchLayout;

    /// The array of `role` (masks included).
    ///
    /// # Errors
    ///
    /// Wrong element type or dimensionality for what the batch holds (`IxDyn` accepts
    /// any dimensionality); a missing array.
    fn array<T: Pod, Dim: Dimension>(&self, role: Role) -> Result<Self::View<'_, T, Dim>, Self::Error>;

    /// An owned host copy of the array of `role` (a copy from the device for a batch
    /// that lives there).
    ///
    /// # Errors
    ///
    /// As [`array`](Self::array), and a failed copy from a device.
    fn to_array<T: Pod, Dim: Dimension>(&self, role: Role) -> Result<Array<T, Dim>, Self::Error>;

    /// The features array.
    ///
    /// # Errors
    ///
    /// As [`array`](Self::array).
    fn features<T: Pod, Dim: Dimension>(&self) -> Result<Self::View<'_, T, Dim>, Self::Error> {
        self.array(Role::Features)
    }

    /// The labels array.
    ///
    /// # Errors
    ///
    /// As [`array`](Self::array): missing when the batch has no labels.
    fn labels<T: Pod, Dim: Dimension>(&self) -> Result<Self::View<'_, T, Dim>, Self::Error> {
        self.array(Role::Labels)
    }

    /// The features mask, if the batch has one.
    ///
    /// # Errors
    ///
    /// As [`array`](Self::array).
    fn features_mask<T: Pod, Dim: Dimension>(&self) -> Result<Option<Self::View<'_, T, Dim>>, Self::Error> {
        optional(self, Role::FeaturesMask)
    }

    /// The labels mask, if the batch has one.
    ///
    /// # Errors
    ///
    /// As [`array`](Self::array).
    fn labels_mask<T: Pod, Dim: Dimension>(&self) -> Result<Option<Self::View<'_, T, Dim>>, Self::Error> {
        optional(self, Role::LabelsMask)
    }
}

/// The array of `role` when the batch holds one.
fn optional<B: BatchArrays + ?Sized, T: Pod, Dim: Dimension>(
    batch: &B,
    role: Role,
) -> Result<Option<B::View<'_, T, Dim>>, B::Error> {
    if batch.layout().has(role) {
        batch.array(role).map(Some)
    } else {
        Ok(None)
    }
}

impl BatchArrays for Lease<'_> {
    type View<'b, T: Pod, Dim: Dimension>
        = ArrayView<'b, T, Dim>
    where
        Self: 'b;
    type Error = Error;

    fn index(&self) -> usize {
        Lease::index(self)
    }

    fn epoch(&self) -> u64 {
        Lease::epoch(self)
    }

    fn layout(&self) -> &BatchLayout {
        Lease::layout(self)
    }

    fn array<T: Pod, Dim: Dimension>(&self, role: Role) -> Result<ArrayView<'_, T, Dim>, Error> {
        Lease::array(self, role)
    }

    fn to_array<T: Pod, Dim: Dimension>(&self, role: Role) -> Result<Array<T, Dim>, Error> {
        Lease::to_array(self, role)
    }
}

impl BatchArrays for DetachedBatch {
    type View<'b, T: Pod, Dim: Dimension> = ArrayView<'b, T, Dim>;
    type Error = Error;

    fn index(&self) -> usize {
        DetachedBatch::index(self)
    }

    fn epoch(&self) -> u64 {
        DetachedBatch::epoch(self)
    }

    fn layout(&self) -> &BatchLayout {
        DetachedBatch::layout(self)
    }

    fn array<T: Pod, Dim: Dimension>(&self, role: Role) -> Result<ArrayView<'_, T, Dim>, Error> {
        DetachedBatch::array(self, role)
    }

    fn to_array<T: Pod, Dim: Dimension>(&self, role: Role) -> Result<Array<T, Dim>, Error> {
        DetachedBatch::to_array(self, role)
    }
}
