//! Typed ndarray views of a batch's region: read-only for the consumer
//! ([`BatchRef`], behind [`Lease`](crate::Lease) and
//! [`DetachedBatch`](crate::DetachedBatch)) and writable for the source
//! ([`BatchMut`]).
//!
//! This module turns a base pointer plus a planned [`BatchLayout`] into slices; the
//! callers (the hand-off for leases, the producer for filling) state why the memory
//! is theirs for the view's lifetime.

use std::cell::Cell;
use std::marker::PhantomData;
use std::ptr::NonNull;

use bytemuck::{Pod, Zeroable};
use ndarray::{ArrayView, ArrayViewMut, Dimension};

use crate::error::Error;
use crate::layout::{BatchLayout, ARRAY_ALIGN};
use crate::role::Role;

/// One cache line of bytes, aligned to [`ARRAY_ALIGN`]: the storage unit of detached
/// batches, so their arrays can be viewed in place like the ring's.
#[derive(Clone, Copy, Zeroable, Pod)]
#[repr(C, align(64))]
pub(crate) struct Align64(pub(crate) [u8; ARRAY_ALIGN]);

/// Read access to a planned batch.
#[derive(Clone, Copy)]
pub(crate) struct BatchRef<'a> {
    /// Invariant: aligned to [`ARRAY_ALIGN`]; `layout.planned_bytes()` initialised bytes
    /// from here are not written while `'a` lasts.
    base: NonNull<u8>,
    layout: &'a BatchLayout,
    index: usize,
    _memory: PhantomData<&'a [u8]>,
}

impl<'a> BatchRef<'a> {
    /// # Safety
    ///
    /// `base` is aligned to [`ARRAY_ALIGN`], `layout` is planned, and the
    /// `layout.planned_bytes()` bytes from `base` are initialised and not written by
    /// anyone while `'a` lasts.
    pub(crate) unsafe fn new(base: NonNull<u8>, layout: &'a BatchLayout, index: usize) -> BatchRef<'a> {
        debug_assert_eq!(base.as_ptr() as usize % ARRAY_ALIGN, 0);
        debug_assert!(layout.planned_bytes() > 0, "the layout is planned");
        BatchRef { base, layout, index, _memory: PhantomData }
    }

    /// Views a detached copy; `data` holds at least the planned bytes of `layout`.
    pub(crate) fn from_aligned(data: &'a [Align64], layout: &'a BatchLayout, index: usize) -> BatchRef<'a> {
        assert!(size_of_val(data) >= layout.planned_bytes(), "a detached batch holds its whole region");
        let base = NonNull::from(data).cast::<u8>();
        // SAFETY: `data` is aligned to ARRAY_ALIGN (its element type is), holds the
        // planned bytes (checked above), is initialised (`Align64` is plain bytes) and
        // is borrowed shared for `'a`, so nobody writes it meanwhile.
        unsafe { BatchRef::new(base, layout, index) }
    }

    pub(crate) fn layout(&self) -> &'a BatchLayout {
        self.layout
    }

    pub(crate) fn index(&self) -> usize {
        self.index
    }

    /// The whole region of the batch: its arrays and the padding between them.
    pub(crate) fn bytes(&self) -> &'a [u8] {
        // SAFETY: the type's invariant: `planned_bytes` initialised bytes from `base`,
        // not written during `'a`.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr(), self.layout.planned_bytes()) }
    }

    /// The array of `role`, or `None` when the batch has none (masks are optional).
    pub(crate) fn optional<T: Pod, Dim: Dimension>(&self, role: Role) -> Result<Option<ArrayView<'a, T, Dim>>, Error> {
        match self.array(role) {
            Ok(view) => Ok(Some(view)),
            Err(Error::MissingArray { .. }) => Ok(None),
            Err(err) => Err(err),
        }
    }

    pub(crate) fn array<T: Pod, Dim: Dimension>(&self, role: Role) -> Result<ArrayView<'a, T, Dim>, Error> {
        let (spec, dim) = self.layout.typed::<T, Dim>(self.index, role)?;
        // SAFETY: `spec` is planned, so `offset + bytes <= planned_bytes` and the offset
        // is a multiple of ARRAY_ALIGN; with the aligned base and `align_of::<T>() <=
        // ARRAY_ALIGN` (checked when the layout was described) the pointer is aligned for
        // `T`. The `bytes / size_of::<T>()` elements are the shape's element count,
        // initialised (any bits are a valid `Pod`) and not written during `'a` (the
        // type's invariant).
        unsafe {
            let ptr = self.base.as_ptr().add(spec.offset()).cast::<T>();
            Ok(ArrayView::from_shape_ptr(dim, ptr))
        }
    }
}

/// The batch a [`BatchSource`](crate::BatchSource) fills: writable ndarray views of
/// its arrays, in the ring's memory.
///
/// Every array starts zeroed. Each array can be borrowed once per batch; views of
/// different arrays live side by side, so features and labels can be filled in one
/// loop. The element type and dimensionality must match the layout the source gave
/// for this batch ([`Error::WrongElementType`], [`Error::WrongDimensionality`]).
///
/// ```
/// use async_iter::{BatchLayout, BatchMut, BatchSource, SourceError};
/// use ndarray::{Ix1, Ix2};
///
/// struct Ramp;
///
/// impl BatchSource for Ramp {
///     fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
///         Ok((index < 3).then(|| BatchLayout::new().features::<f32, _>((4, 2)).labels::<u8, _>(4)))
///     }
///     fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
///         let mut x = batch.features::<f32, Ix2>()?;
///         let mut y = batch.labels::<u8, Ix1>()?; // both views at once
///         for (row, (mut features, label)) in x.rows_mut().into_iter().zip(y.iter_mut()).enumerate() {
///             features.fill(row as f32);
///             *label = (row % 2) as u8;
///         }
///         Ok(())
///     }
/// }
/// # let mut batches = async_iter::Prefetcher::builder(Ramp).build()?;
/// # let lease = batches.next().unwrap()?;
/// # assert_eq!(lease.features::<f32, Ix2>()?[[3, 1]], 3.0);
/// # Ok::<(), async_iter::Error>(())
/// ```
pub struct BatchMut<'a> {
    /// Invariant: aligned to [`ARRAY_ALIGN`]; `layout.planned_bytes()` initialised
    /// bytes from here belong to this batch alone while `'a` lasts.
    base: NonNull<u8>,
    layout: &'a BatchLayout,
    index: usize,
    /// Bit `role.index()` is set once that array's view was handed out.
    lent: Cell<u8>,
    _memory: PhantomData<&'a mut [u8]>,
}

impl<'a> BatchMut<'a> {
    /// # Safety
    ///
    /// `base` is aligned to [`ARRAY_ALIGN`], `layout` is planned, and the
    /// `layout.planned_bytes()` bytes from `base` are initialised and accessed by
    /// nobody else while `'a` lasts.
    pub(crate) unsafe fn new(base: NonNull<u8>, layout: &'a BatchLayout, index: usize) -> BatchMut<'a> {
        debug_assert_eq!(base.as_ptr() as usize % ARRAY_ALIGN, 0);
        BatchMut { base, layout, index, lent: Cell::new(0), _memory: PhantomData }
    }

    /// The batch's index in its epoch (0 for the first).
    pub fn index(&self) -> usize {
        self.index
    }

    /// The layout the source described for this batch.
    pub fn layout(&self) -> &BatchLayout {
        self.layout
    }

    /// The features array, to fill.
    ///
    /// # Errors
    ///
    /// [`Error::WrongElementType`] or [`Error::WrongDimensionality`] when `T` or `Dim`
    /// differ from the layout; [`Error::AlreadyBorrowed`] on a second call.
    pub fn features<T: Pod, Dim: Dimension>(&self) -> Result<ArrayViewMut<'_, T, Dim>, Error> {
        self.array(Role::Features)
    }

    /// The labels array, to fill.
    ///
    /// # Errors
    ///
    /// As [`features`](Self::features), and [`Error::MissingArray`] when the layout
    /// has no labels.
    pub fn labels<T: Pod, Dim: Dimension>(&self) -> Result<ArrayViewMut<'_, T, Dim>, Error> {
        self.array(Role::Labels)
    }

    /// The features mask, to fill.
    ///
    /// # Errors
    ///
    /// As [`labels`](Self::labels).
    pub fn features_mask<T: Pod, Dim: Dimension>(&self) -> Result<ArrayViewMut<'_, T, Dim>, Error> {
        self.array(Role::FeaturesMask)
    }

    /// The labels mask, to fill.
    ///
    /// # Errors
    ///
    /// As [`labels`](Self::labels).
    pub fn labels_mask<T: Pod, Dim: Dimension>(&self) -> Result<ArrayViewMut<'_, T, Dim>, Error> {
        self.array(Role::LabelsMask)
    }

    /// The array of `role`, to fill.
    ///
    /// # Errors
    ///
    /// As [`labels`](Self::labels).
    pub fn array<T: Pod, Dim: Dimension>(&self, role: Role) -> Result<ArrayViewMut<'_, T, Dim>, Error> {
        let (spec, dim) = self.layout.typed::<T, Dim>(self.index, role)?;
        let bit = 1_u8 << role.index();
        if self.lent.get() & bit != 0 {
            return Err(Error::AlreadyBorrowed { batch: self.index, role });
        }
        self.lent.set(self.lent.get() | bit);
        // SAFETY: as in `BatchRef::array` for bounds, alignment and initialisation.
        // The bytes are this batch's alone during `'a` (the type's invariant), and the
        // `lent` bit makes this the only view of this array; arrays of different roles
        // do not overlap (planned offsets), so the views are disjoint.
        unsafe {
            let ptr = self.base.as_ptr().add(spec.offset()).cast::<T>();
            Ok(ArrayViewMut::from_shape_ptr(dim, ptr))
        }
    }
}

#[cfg(test)]
mod tests {
    use ndarray::{Ix1, Ix2};

    use super::*;

    fn planned() -> BatchLayout {
        let mut layout = BatchLayout::new().features::<f32, _>((2, 3)).labels::<u16, _>(2);
        layout.plan().unwrap();
        layout
    }

    #[test]
    fn writes_land_where_reads_find_them() {
        let layout = planned();
        let mut data = vec![Align64([0; ARRAY_ALIGN]); 3];
        let base = NonNull::from(&mut data[..]).cast::<u8>();
        {
            // SAFETY: `data` is aligned, large enough, zeroed and borrowed by nobody else here.
            let batch = unsafe { BatchMut::new(base, &layout, 4) };
            let mut x = batch.features::<f32, Ix2>().unwrap();
            let mut y = batch.labels::<u16, Ix1>().unwrap();
            x[[1, 2]] = 5.5;
            y[1] = 9;
            assert!(matches!(batch.features::<f32, Ix2>(), Err(Error::AlreadyBorrowed { batch: 4, .. })));
            assert!(matches!(batch.features_mask::<u8, Ix1>(), Err(Error::MissingArray { .. })));
        }
        let view = BatchRef::from_aligned(&data, &layout, 4);
        assert_eq!(view.array::<f32, Ix2>(Role::Features).unwrap()[[1, 2]], 5.5);
        assert_eq!(view.array::<u16, Ix1>(Role::Labels).unwrap().to_vec(), [0, 9]);
        assert_eq!(view.bytes().len(), 128);
        assert_eq!(&view.bytes()[64..68], &[0, 0, 9, 0]);
    }
}
