//! A batch copied out of the ring: owned, `Send`, and free of any lifetime.

use std::fmt;

use bytemuck::Pod;
use ndarray::{Array, ArrayView, Dimension};

use crate::error::Error;
use crate::layout::{BatchLayout, ARRAY_ALIGN};
use crate::role::Role;
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
        // A copy of a batch the ring holds: as much memory again, or the usual
        // out-of-memory handling of the global allocator.
        let blocks = vec![Align64([0; ARRAY_ALIGN]); batch.layout().planned_bytes().div_ceil(ARRAY_ALIGN)];
        let mut kept = DetachedBatch { epoch, index: batch.index(), layout: *batch.layout(), data: blocks };
        kept.region_mut().copy_from_slice(batch.bytes());
        kept
    }

    /// A batch of `layout` whose bytes `read` writes: a copy of a batch that lived
    /// elsewhere (device memory, say), laid out as in the ring. The layout is planned
    /// here, so `read` gets exactly the batch's region, each array at its
    /// [`offset`](crate::ArraySpec::offset), and the arrays are read back with the usual
    /// typed accessors.
    ///
    /// ```
    /// use async_iter::{BatchLayout, DetachedBatch, Role};
    /// use ndarray::Ix1;
    ///
    /// let layout = BatchLayout::new().features::<u8, _>(3).labels::<u8, _>(2);
    /// let batch = DetachedBatch::read_from(layout, 0, 0, |region| {
    ///     region.fill(9); // a copy from elsewhere would go here
    ///     Ok::<_, async_iter::Error>(())
    /// })?;
    /// assert_eq!(batch.labels::<u8, Ix1>()?.to_vec(), [9, 9]);
    /// assert_eq!(batch.layout().spec(Role::Labels).unwrap().offset(), 64);
    /// # Ok::<(), async_iter::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidLayout`] when the layout cannot be laid out; [`Error::Backend`]
    /// when the machine cannot hold the batch; the error of `read`.
    pub fn read_from<E: From<Error>>(
        mut layout: BatchLayout,
        index: usize,
        epoch: u64,
        read: impl FnOnce(&mut [u8]) -> Result<(), E>,
    ) -> Result<DetachedBatch, E> {
        layout.plan().map_err(|reason| Error::InvalidLayout { epoch, batch: index, reason })?;
        let mut batch = DetachedBatch::zeroed(layout, index, epoch)?;
        read(batch.region_mut())?;
        Ok(batch)
    }

    /// A zeroed batch of the planned `layout`.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] when the machine cannot hold it.
    fn zeroed(layout: BatchLayout, index: usize, epoch: u64) -> Result<DetachedBatch, Error> {
        let bytes = layout.planned_bytes();
        let mut data = Vec::new();
        if data.try_reserve_exact(bytes.div_ceil(ARRAY_ALIGN)).is_err() {
            let source = workspace_core::BackendError::OutOfMemory { bytes, align: ARRAY_ALIGN };
            return Err(Error::Backend { epoch, batch: index, source });
        }
        data.resize(bytes.div_ceil(ARRAY_ALIGN), Align64([0; ARRAY_ALIGN]));
        Ok(DetachedBatch { epoch, index, layout, data })
    }

    /// The batch's region: its arrays and the padding between them.
    fn region_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut::<Align64, u8>(&mut self.data)[..self.layout.planned_bytes()]
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
    /// [`Error::WrongElementType`] or [`Error::WrongDimensionality`] when `T` or `Dim`
    /// do not match what the batch holds.
    pub fn features<T: Pod, Dim: Dimension>(&self) -> Result<ArrayView<'_, T, Dim>, Error> {
        self.array(Role::Features)
    }

    /// The labels array.
    ///
    /// # Errors
    ///
    /// As [`features`](Self::features), and [`Error::MissingArray`] when the batch has
    /// no labels.
    pub fn labels<T: Pod, Dim: Dimension>(&self) -> Result<ArrayView<'_, T, Dim>, Error> {
        self.array(Role::Labels)
    }

    /// The features mask (`[batch, time]` for sequences: 1 where a step holds data, 0
    /// where it is padding), if the batch has one.
    ///
    /// # Errors
    ///
    /// As [`features`](Self::features).
    pub fn features_mask<T: Pod, Dim: Dimension>(&self) -> Result<Option<ArrayView<'_, T, Dim>>, Error> {
        self.batch().optional(Role::FeaturesMask)
    }

    /// The labels mask, if the batch has one.
    ///
    /// # Errors
    ///
    /// As [`features`](Self::features).
    pub fn labels_mask<T: Pod, Dim: Dimension>(&self) -> Result<Option<ArrayView<'_, T, Dim>>, Error> {
        self.batch().optional(Role::LabelsMask)
    }

    /// The array of `role` (masks included).
    ///
    /// # Errors
    ///
    /// As [`labels`](Self::labels).
    pub fn array<T: Pod, Dim: Dimension>(&self, role: Role) -> Result<ArrayView<'_, T, Dim>, Error> {
        self.batch().array(role)
    }

    /// An owned copy of the array of `role`.
    ///
    /// # Errors
    ///
    /// As [`labels`](Self::labels).
    pub fn to_array<T: Pod, Dim: Dimension>(&self, role: Role) -> Result<Array<T, Dim>, Error> {
        Ok(self.array::<T, Dim>(role)?.to_owned())
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
