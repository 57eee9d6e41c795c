//! A batch copied out of the ring: owned, `Send`, and free of any lifetime.

use std::fmt;

use bytemuck::Pod;
use ndarray::{Array, ArrayView, Dimension};

use crate::error::Error;
use crate::layout::{BatchLayout, Role, ARRAY_ALIGN};
use crate::view::{Align64, BatchRef};

/// A batch copied out of the ring by [`Lease::detach`](crate::Lease::detach).
///
/// It owns its arrays (one aligned copy of the batch's region), outlives the lease
/// and the prefetcher, and can be sent to other threads. Read it with the same typed
/// accessors as a lease, or take owned `ndarray::Array`s with
/// [`to_array`](Self::to_array).
///
/// ```
/// # use async_iter::{BatchLayout, BatchMut, BatchSource, Prefetcher, SourceError, Role};
/// # use ndarray::{Ix1, Ix2};
/// # struct One;
/// # impl BatchSource for One {
/// #     fn next_layout(&mut self, i: usize) -> Result<Option<BatchLayout>, SourceError> {
/// #         Ok((i < 1).then(|| BatchLayout::new().features::<f32, _>((2, 2)).labels::<u32, _>(2)))
/// #     }
/// #     fn fill(&mut self, b: &mut BatchMut<'_>) -> Result<(), SourceError> {
/// #         b.labels::<u32, Ix1>()?.fill(7);
/// #         Ok(())
/// #     }
/// # }
/// let kept = {
///     let mut batches = Prefetcher::builder(One).build()?;
///     let lease = batches.next().unwrap()?;
///     lease.detach()
/// }; // the prefetcher is gone; the copy is not
/// let labels: ndarray::Array1<u32> = kept.to_array(Role::Labels)?;
/// assert_eq!(labels.to_vec(), [7, 7]);
/// assert_eq!(kept.features::<f32, Ix2>()?.shape(), &[2, 2]);
/// # Ok::<(), async_iter::Error>(())
/// ```
#[derive(Clone)]
pub struct DetachedBatch {
    epoch: u64,
    index: usize,
    /// Planned: offsets are into `data`.
    layout: BatchLayout,
    data: Vec<Align64>,
}

impl DetachedBatch {
    pub(crate) fn copy_of(batch: BatchRef<'_>, epoch: u64) -> DetachedBatch {
        let bytes = batch.bytes();
        let mut data = vec![Align64([0; ARRAY_ALIGN]); bytes.len().div_ceil(ARRAY_ALIGN)];
        bytemuck::cast_slice_mut::<Align64, u8>(&mut data)[..bytes.len()].copy_from_slice(bytes);
        DetachedBatch { epoch, index: batch.index(), layout: *batch.layout(), data }
    }

    fn batch(&self) -> BatchRef<'_> {
        BatchRef::from_aligned(&self.data, &self.layout, self.index)
    }

    /// The batch's index in its epoch.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The epoch the batch came from.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The batch's layout.
    pub fn layout(&self) -> &BatchLayout {
        &self.layout
    }

    /// The features array.
    ///
    /// # Errors
    ///
    /// [`Error::WrongElementType`] or [`Error::WrongDimensionality`] when `T` or `D`
    /// do not match what the batch holds.
    pub fn features<T: Pod, D: Dimension>(&self) -> Result<ArrayView<'_, T, D>, Error> {
        self.array(Role::Features)
    }

    /// The labels array.
    ///
    /// # Errors
    ///
    /// As [`features`](Self::features), and [`Error::MissingArray`] when the batch has
    /// no labels.
    pub fn labels<T: Pod, D: Dimension>(&self) -> Result<ArrayView<'_, T, D>, Error> {
        self.array(Role::Labels)
    }

    /// The array of `role` (masks included).
    ///
    /// # Errors
    ///
    /// As [`labels`](Self::labels).
    pub fn array<T: Pod, D: Dimension>(&self, role: Role) -> Result<ArrayView<'_, T, D>, Error> {
        self.batch().array(role)
    }

    /// An owned copy of the array of `role`.
    ///
    /// # Errors
    ///
    /// As [`labels`](Self::labels).
    pub fn to_array<T: Pod, D: Dimension>(&self, role: Role) -> Result<Array<T, D>, Error> {
        Ok(self.array::<T, D>(role)?.to_owned())
    }
}

impl fmt::Debug for DetachedBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DetachedBatch")
            .field("epoch", &self.epoch)
            .field("index", &self.index)
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}
