//! The consumer's end of the hand-off, and the [`Lease`] it hands out for each batch.
//!
//! A lease borrows the prefetcher mutably, so at most one exists at a time and none
//! is alive when `next()` runs: the batch a lease shows cannot be overwritten while it
//! is visible, and holding it across the next `next()` does not compile. Dropping the
//! lease returns its slot to the producer at once; `detach()` copies the batch out
//! first.

use std::fmt;

use bytemuck::Pod;
use ndarray::{Array, ArrayView, Dimension};

use crate::detached::DetachedBatch;
use crate::error::Error;
use crate::handoff::{Available, Shared, SlotReader};
use crate::layout::BatchLayout;
use crate::role::Role;
use crate::stats::bump;
use crate::sync::Arc;
use crate::view::BatchRef;

/// What [`Consumer::poll`] found.
pub(crate) enum Polled {
    /// Batch `taken` is published: [`Consumer::lease`] hands it out.
    Batch,
    /// The producer finished: `Some` failure, or `None` at the end of data. Reported
    /// once; the epoch is over for the consumer.
    Done(Option<Error>),
    /// The epoch was already over.
    Ended,
}

/// The consumer's state for the current epoch.
pub(crate) struct Consumer {
    pub(crate) shared: Arc<Shared>,
    epoch: u64,
    /// Batches taken this epoch: the index of the next one.
    taken: usize,
    /// Batches whose slots were returned this epoch (`<= taken`).
    released: usize,
    /// The epoch is over for the consumer (its end was reported, or it was stopped).
    ended: bool,
}

impl Consumer {
    pub(crate) fn new(shared: Arc<Shared>) -> Consumer {
        Consumer { shared, epoch: 0, taken: 0, released: 0, ended: false }
    }

    pub(crate) fn ended(&self) -> bool {
        self.ended
    }

    /// Ends the epoch for the consumer (`stop()`).
    pub(crate) fn end(&mut self) {
        self.ended = true;
    }

    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Starts counting a new epoch; the caller has reset the shared state.
    pub(crate) fn start_epoch(&mut self, epoch: u64) {
        *self = Consumer { shared: self.shared.clone(), epoch, taken: 0, released: 0, ended: false };
    }

    /// Returns the slot of a leaked lease. A lease borrows the consumer, so none is
    /// alive when this runs; one that was leaked (`mem::forget`) never returned its
    /// slot, and does so here, before the producer needs it.
    pub(crate) fn settle(&mut self) {
        if self.released != self.taken {
            self.shared.release(self.taken - self.released);
            self.released = self.taken;
        }
    }

    /// Whether [`poll`](Self::poll) would return at once: the next batch or the end of
    /// the epoch is there.
    pub(crate) fn ready(&self) -> bool {
        self.ended || self.shared.is_available(self.taken)
    }

    /// Waits for the next batch or the end of the epoch; [`settle`](Self::settle)
    /// comes first.
    pub(crate) fn poll(&mut self) -> Polled {
        if self.ended {
            return Polled::Ended;
        }
        debug_assert_eq!(self.released, self.taken, "settled");
        match self.shared.wait_for_batch(self.taken) {
            Available::Batch => Polled::Batch,
            Available::Done => {
                self.ended = true;
                Polled::Done(self.shared.take_outcome())
            }
        }
    }

    /// Hands out batch `taken`, which [`poll`](Self::poll) found published.
    pub(crate) fn lease(&mut self) -> Lease<'_> {
        let index = self.taken;
        // SAFETY: the reader goes into a lease that borrows this consumer, which owns
        // an `Arc` of the `Shared`; the lease drops the reader before it releases the
        // batch, and a leaked lease's batch is released only by `settle`, which cannot
        // run while the lease's borrow lasts, and the leaked reader is never used again.
        let reader = unsafe { self.shared.take(index) };
        self.taken += 1;
        bump(&self.shared.counters.consumer.consumed);
        Lease { consumer: self, reader: Some(reader) }
    }

    /// Returns the slot of the one leased batch.
    fn release_one(&mut self) {
        debug_assert_eq!(self.released + 1, self.taken, "one lease at a time");
        self.released += 1;
        self.shared.release(1);
    }
}

/// One batch, lent to the consumer by [`Prefetcher::next`](crate::Prefetcher::next).
///
/// The lease reads the batch in place in the ring (no copy) through typed ndarray
/// views: [`features`](Self::features), [`labels`](Self::labels), the masks, or any
/// [`array`](Self::array) by role. It borrows the prefetcher, so the next batch can
/// only be asked for once this one is dropped — keeping a batch by mistake is a
/// compile error, not a silent overwrite:
///
/// ```compile_fail,E0499
/// # use async_iter::{BatchLayout, BatchMut, BatchSource, Prefetcher, SourceError};
/// # struct Two;
/// # impl BatchSource for Two {
/// #     fn next_layout(&mut self, i: usize) -> Result<Option<BatchLayout>, SourceError> {
/// #         Ok((i < 2).then(|| BatchLayout::new().features::<f32, _>(4)))
/// #     }
/// #     fn fill(&mut self, _: &mut BatchMut<'_>) -> Result<(), SourceError> { Ok(()) }
/// # }
/// let mut batches = Prefetcher::builder(Two).build()?;
/// let first = batches.next().unwrap()?;
/// let second = batches.next().unwrap()?; // error[E0499]: `batches` is still borrowed by `first`
/// println!("{:?}", first.features::<f32, ndarray::Ix1>()?);
/// # Ok::<(), async_iter::Error>(())
/// ```
///
/// To keep data, copy it out: [`detach`](Self::detach) gives a [`DetachedBatch`] that
/// owns all arrays, [`to_array`](Self::to_array) one owned `ndarray::Array`.
///
/// ```
/// # use async_iter::{BatchLayout, BatchMut, BatchSource, Prefetcher, SourceError};
/// # use ndarray::Ix1;
/// # struct Two;
/// # impl BatchSource for Two {
/// #     fn next_layout(&mut self, i: usize) -> Result<Option<BatchLayout>, SourceError> {
/// #         Ok((i < 2).then(|| BatchLayout::new().features::<f32, _>(4)))
/// #     }
/// #     fn fill(&mut self, b: &mut BatchMut<'_>) -> Result<(), SourceError> {
/// #         b.features::<f32, Ix1>()?.fill(b.index() as f32);
/// #         Ok(())
/// #     }
/// # }
/// let mut batches = Prefetcher::builder(Two).build()?;
/// let first = batches.next().unwrap()?.detach(); // the lease ends, the copy stays
/// let second = batches.next().unwrap()?;
/// assert_eq!(first.features::<f32, Ix1>()?.sum(), 0.0);
/// assert_eq!(second.features::<f32, Ix1>()?.sum(), 4.0);
/// # Ok::<(), async_iter::Error>(())
/// ```
pub struct Lease<'a> {
    consumer: &'a mut Consumer,
    /// `Some` until the lease is dropped; taken first in `drop` so the slot is let go
    /// before it is released.
    reader: Option<SlotReader>,
}

impl Lease<'_> {
    fn batch(&self) -> BatchRef<'_> {
        self.reader.as_ref().expect("a live lease has its reader").batch()
    }

    /// The batch's index in its epoch (0 for the first).
    pub fn index(&self) -> usize {
        self.batch().index()
    }

    /// The epoch the batch belongs to (0 for the first).
    pub fn epoch(&self) -> u64 {
        self.consumer.epoch
    }

    /// The batch's layout: shapes and element types of its arrays.
    pub fn layout(&self) -> &BatchLayout {
        self.batch().layout()
    }

    /// Bytes the batch takes in the ring.
    pub fn bytes(&self) -> usize {
        self.batch().bytes().len()
    }

    /// The batch's whole region in the ring: each array at its
    /// [`offset`](crate::ArraySpec::offset), zeros between them. For copying a batch
    /// elsewhere in one piece (to a device, say).
    pub fn as_bytes(&self) -> &[u8] {
        self.batch().bytes()
    }

    /// The features array.
    ///
    /// # Errors
    ///
    /// [`Error::WrongElementType`] or [`Error::WrongDimensionality`] when `T` or `Dim`
    /// do not match what the batch holds (`Dim = IxDyn` accepts any dimensionality).
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

    /// The features mask, if the batch has one.
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

    /// The array of `role`.
    ///
    /// # Errors
    ///
    /// As [`labels`](Self::labels).
    pub fn array<T: Pod, Dim: Dimension>(&self, role: Role) -> Result<ArrayView<'_, T, Dim>, Error> {
        self.batch().array(role)
    }

    /// Copies the array of `role` into an owned `ndarray::Array` (the lease goes on).
    ///
    /// # Errors
    ///
    /// As [`array`](Self::array).
    pub fn to_array<T: Pod, Dim: Dimension>(&self, role: Role) -> Result<Array<T, Dim>, Error> {
        Ok(self.array::<T, Dim>(role)?.to_owned())
    }

    /// The former name of [`to_array`](Self::to_array).
    ///
    /// # Errors
    ///
    /// As [`to_array`](Self::to_array).
    #[deprecated(note = "renamed `to_array`, as on `DetachedBatch` and `BatchArrays`")]
    #[doc(hidden)]
    pub fn detach_array<T: Pod, Dim: Dimension>(&self, role: Role) -> Result<Array<T, Dim>, Error> {
        self.to_array(role)
    }

    /// Copies the whole batch out and ends the lease: the [`DetachedBatch`] owns its
    /// arrays and outlives the prefetcher.
    pub fn detach(self) -> DetachedBatch {
        DetachedBatch::copy_of(self.batch(), self.epoch())
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        drop(self.reader.take());
        self.consumer.release_one();
    }
}

impl fmt::Debug for Lease<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("epoch", &self.epoch())
            .field("index", &self.index())
            .field("layout", self.layout())
            .finish()
    }
}
