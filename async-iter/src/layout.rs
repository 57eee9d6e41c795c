//! What a batch holds: the shapes and element types of its arrays, and where each one
//! sits in the batch's region of the ring.
//!
//! A [`BatchLayout`] is plain data (`Copy`, no heap): it travels with every batch
//! through the hand-off without allocating. Arrays are laid out in role order, each at
//! an offset aligned to [`ARRAY_ALIGN`] bytes, so any `Pod` element type up to that
//! alignment can be viewed in place.

use std::any::TypeId;
use std::fmt;

use bytemuck::Pod;
use ndarray::{Dimension, IntoDimension};

use crate::error::{Error, LayoutError};
use crate::role::Role;

/// Most dimensions an array of a batch can have (ndarray's largest fixed dimension).
pub const MAX_DIMS: usize = 6;

/// Alignment of every array in a batch, and of every batch in the ring (a cache line).
pub const ARRAY_ALIGN: usize = 64;

/// The element type of an array: any `bytemuck::Pod` type, identified by its `TypeId`.
#[derive(Clone, Copy)]
pub struct ElementType {
    id: TypeId,
    name: &'static str,
    size: usize,
    align: usize,
}

impl ElementType {
    /// The element type `T`.
    ///
    /// ```
    /// let t = async_iter::ElementType::of::<f32>();
    /// assert_eq!((t.name(), t.size()), ("f32", 4));
    /// ```
    pub fn of<T: Pod>() -> ElementType {
        ElementType {
            id: TypeId::of::<T>(),
            name: std::any::type_name::<T>(),
            size: size_of::<T>(),
            align: align_of::<T>(),
        }
    }

    /// The type's name, as `std::any::type_name` gives it.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Bytes per element.
    pub fn size(&self) -> usize {
        self.size
    }

    pub(crate) fn is<T: Pod>(&self) -> bool {
        self.id == TypeId::of::<T>()
    }
}

impl PartialEq for ElementType {
    fn eq(&self, other: &ElementType) -> bool {
        self.id == other.id
    }
}

impl Eq for ElementType {}

impl fmt::Debug for ElementType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

/// One array of a batch: element type, shape, and (once planned) its place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArraySpec {
    element: ElementType,
    ndim: usize,
    /// The shape; entries past `ndim` are 0.
    dims: [usize; MAX_DIMS],
    /// Byte offset in the batch's region; set by [`BatchLayout::plan`].
    offset: usize,
}

impl ArraySpec {
    /// The element type.
    pub fn element(&self) -> ElementType {
        self.element
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.dims[..self.ndim]
    }

    /// The array's byte offset in the batch's region (a multiple of [`ARRAY_ALIGN`];
    /// set once the layout is planned, as every layout a lease shows is).
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The array's shape as `Dim`, if `T` and `Dim` match what it holds.
    pub(crate) fn dim<T: Pod, Dim: Dimension>(&self, batch: usize, role: Role) -> Result<Dim, Error> {
        if !self.element.is::<T>() {
            let (stored, requested) = (self.element.name, std::any::type_name::<T>());
            return Err(Error::WrongElementType { batch, role, stored, requested });
        }
        if Dim::NDIM.is_some_and(|n| n != self.ndim) {
            let (stored, requested) = (self.ndim, Dim::NDIM.unwrap_or(0));
            return Err(Error::WrongDimensionality { batch, role, stored, requested, shape: self.shape().to_vec() });
        }
        let mut dim = Dim::zeros(self.ndim);
        dim.slice_mut().copy_from_slice(self.shape());
        Ok(dim)
    }
}

/// The arrays of one batch: a features array, and optionally labels and masks, each of
/// any `Pod` element type and shape.
///
/// A [`BatchSource`](crate::BatchSource) describes each batch with one before
/// filling it; the last batch of an epoch may be smaller than the others. Problems
/// (a shape with no elements, one whose size overflows, more than [`MAX_DIMS`]
/// dimensions) are reported by the prefetcher as [`Error::InvalidLayout`] at that
/// batch.
///
/// ```
/// use async_iter::{BatchLayout, Role};
///
/// let layout = BatchLayout::new().features::<f32, _>((32, 784)).labels::<u32, _>(32);
/// assert_eq!(layout.spec(Role::Features).unwrap().shape(), &[32, 784]);
/// assert!(!layout.has(Role::LabelsMask));
/// assert_eq!(layout.bytes(), Ok(32 * 784 * 4 + 128)); // labels start on a 64-byte boundary
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchLayout {
    arrays: [Option<ArraySpec>; 4],
    /// Bytes of the batch once [`BatchLayout::plan`] succeeded (0 before).
    planned: usize,
    /// The first problem found while describing (reported when the batch is planned).
    problem: Option<Problem>,
}

/// A problem found while describing a layout, kept `Copy` so the layout stays plain data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Problem {
    TooManyDimensions { role: Role, ndim: usize },
    OverAligned { role: Role, element: ElementType },
}

impl BatchLayout {
    /// An empty layout; add the arrays with [`features`](Self::features) and friends.
    pub fn new() -> BatchLayout {
        BatchLayout::default()
    }

    /// Describes the features array (required): element type `T`, `shape` as ndarray
    /// takes it (`n`, `(n, m)`, `[n, m, k]`, `&[..][..]`).
    pub fn features<T: Pod, Sh: IntoDimension>(self, shape: Sh) -> BatchLayout {
        self.array::<T, Sh>(Role::Features, shape)
    }

    /// Describes the labels array.
    pub fn labels<T: Pod, Sh: IntoDimension>(self, shape: Sh) -> BatchLayout {
        self.array::<T, Sh>(Role::Labels, shape)
    }

    /// Describes the features mask.
    pub fn features_mask<T: Pod, Sh: IntoDimension>(self, shape: Sh) -> BatchLayout {
        self.array::<T, Sh>(Role::FeaturesMask, shape)
    }

    /// Describes the labels mask.
    pub fn labels_mask<T: Pod, Sh: IntoDimension>(self, shape: Sh) -> BatchLayout {
        self.array::<T, Sh>(Role::LabelsMask, shape)
    }

    /// Describes the array of `role` (replacing an earlier description of it).
    pub fn array<T: Pod, Sh: IntoDimension>(mut self, role: Role, shape: Sh) -> BatchLayout {
        let shape = shape.into_dimension();
        let shape = shape.slice();
        let element = ElementType::of::<T>();
        if shape.len() > MAX_DIMS {
            self.problem.get_or_insert(Problem::TooManyDimensions { role, ndim: shape.len() });
            return self;
        }
        if element.align > ARRAY_ALIGN {
            self.problem.get_or_insert(Problem::OverAligned { role, element });
            return self;
        }
        let mut dims = [0; MAX_DIMS];
        dims[..shape.len()].copy_from_slice(shape);
        self.arrays[role.index()] = Some(ArraySpec { element, ndim: shape.len(), dims, offset: 0 });
        self
    }

    /// Whether the layout has an array of `role`.
    pub fn has(&self, role: Role) -> bool {
        self.arrays[role.index()].is_some()
    }

    /// The array of `role`, if any.
    pub fn spec(&self, role: Role) -> Option<&ArraySpec> {
        self.arrays[role.index()].as_ref()
    }

    /// The spec of the array of `role` and its shape as `Dim`, when the layout has it and
    /// `T` and `Dim` match what it holds (`batch` names the batch in the errors). With a
    /// planned layout (a lease's) the spec's [`offset`](ArraySpec::offset) says where
    /// the array lies in the batch's region.
    ///
    /// # Errors
    ///
    /// [`Error::MissingArray`], [`Error::WrongElementType`],
    /// [`Error::WrongDimensionality`].
    pub fn typed<T: Pod, Dim: Dimension>(&self, batch: usize, role: Role) -> Result<(&ArraySpec, Dim), Error> {
        let spec = self.spec(role).ok_or(Error::MissingArray { batch, role })?;
        let dim = spec.dim::<T, Dim>(batch, role)?;
        Ok((spec, dim))
    }

    /// Bytes the batch takes in the ring: its arrays, each starting at a multiple of
    /// [`ARRAY_ALIGN`], the total rounded up to it as well.
    ///
    /// # Errors
    ///
    /// The problem with the layout, if it has one (see [`LayoutError`]).
    pub fn bytes(&self) -> Result<usize, LayoutError> {
        let mut copy = *self;
        copy.plan()
    }

    /// Checks the layout, gives every array its offset, and returns the batch's bytes.
    pub(crate) fn plan(&mut self) -> Result<usize, LayoutError> {
        match self.problem {
            Some(Problem::TooManyDimensions { role, ndim }) => {
                return Err(LayoutError::TooManyDimensions { role, ndim, max: MAX_DIMS })
            }
            Some(Problem::OverAligned { role, element }) => {
                let (element, align) = (element.name, element.align);
                return Err(LayoutError::OverAligned { role, element, align, max: ARRAY_ALIGN });
            }
            None => {}
        }
        if !self.has(Role::Features) {
            return Err(LayoutError::NoFeatures);
        }
        let mut end = 0_usize;
        for (role, spec) in Role::ALL.into_iter().zip(&mut self.arrays) {
            let Some(spec) = spec else { continue };
            let overflow = |spec: &ArraySpec| LayoutError::Overflow {
                role,
                shape: spec.shape().to_vec(),
                element_size: spec.element.size,
            };
            let elements = spec.shape().iter().try_fold(1_usize, |n, &d| n.checked_mul(d));
            let elements = elements.ok_or_else(|| overflow(spec))?;
            if elements == 0 {
                return Err(LayoutError::Empty { role, shape: spec.shape().to_vec() });
            }
            let bytes = elements.checked_mul(spec.element.size).ok_or_else(|| overflow(spec))?;
            if bytes == 0 {
                // Elements of no bytes (`[f32; 0]`): an array that holds nothing.
                return Err(LayoutError::Empty { role, shape: spec.shape().to_vec() });
            }
            spec.offset = end;
            // No allocation may pass `isize::MAX` bytes.
            end = end
                .checked_add(bytes)
                .and_then(|e| align_up(e, ARRAY_ALIGN))
                .filter(|&e| e <= isize::MAX as usize)
                .ok_or_else(|| overflow(spec))?;
        }
        self.planned = end;
        Ok(end)
    }

    /// Bytes of the batch as planned (0 when [`plan`](Self::plan) has not succeeded).
    pub(crate) fn planned_bytes(&self) -> usize {
        self.planned
    }
}

/// Rounds `value` up to `align` (a power of two); `None` on overflow.
pub(crate) fn align_up(value: usize, align: usize) -> Option<usize> {
    debug_assert!(align.is_power_of_two());
    Some(value.checked_add(align - 1)? & !(align - 1))
}

#[cfg(test)]
mod tests {
    use ndarray::{Ix1, Ix2, IxDyn};

    use super::*;

    #[test]
    fn arrays_are_placed_in_role_order_on_aligned_offsets() {
        let mut layout = BatchLayout::new()
            .labels_mask::<u8, _>(3)
            .features::<f64, _>((2, 5))
            .labels::<u16, _>([3])
            .features_mask::<u8, _>(&[1, 1, 1][..]);
        assert_eq!(layout.plan(), Ok(320));
        let offsets: Vec<_> = Role::ALL.iter().map(|&r| layout.spec(r).unwrap().offset()).collect();
        assert_eq!(offsets, [0, 128, 192, 256]);
    }

    #[test]
    fn bad_layouts_are_typed_errors() {
        assert_eq!(BatchLayout::new().labels::<f32, _>(4).bytes(), Err(LayoutError::NoFeatures));
        assert_eq!(
            BatchLayout::new().features::<f32, _>((4, 0)).bytes(),
            Err(LayoutError::Empty { role: Role::Features, shape: vec![4, 0] })
        );
        let huge = BatchLayout::new().features::<f32, _>((usize::MAX / 2, 2)).bytes();
        assert!(matches!(huge, Err(LayoutError::Overflow { role: Role::Features, element_size: 4, .. })), "{huge:?}");
        let bytes_overflow = BatchLayout::new().features::<u64, _>(usize::MAX / 4).bytes();
        assert!(matches!(bytes_overflow, Err(LayoutError::Overflow { .. })), "{bytes_overflow:?}");
        let seven = BatchLayout::new().features::<u8, _>(&[1, 1, 1, 1, 1, 1, 1][..]).bytes();
        assert_eq!(seven, Err(LayoutError::TooManyDimensions { role: Role::Features, ndim: 7, max: MAX_DIMS }));

        #[derive(Clone, Copy, bytemuck::Zeroable, bytemuck::Pod)]
        #[repr(C, align(128))]
        struct Wide([u8; 128]);
        let wide = BatchLayout::new().features::<Wide, _>(1).bytes();
        assert!(matches!(wide, Err(LayoutError::OverAligned { align: 128, .. })), "{wide:?}");
    }

    #[test]
    fn typed_shapes_check_element_type_and_dimensionality() {
        let mut layout = BatchLayout::new().features::<f32, _>((2, 3));
        layout.plan().unwrap();
        let spec = layout.spec(Role::Features).unwrap();
        assert_eq!(spec.dim::<f32, Ix2>(0, Role::Features).unwrap().into_pattern(), (2, 3));
        assert_eq!(spec.dim::<f32, IxDyn>(0, Role::Features).unwrap().slice(), &[2, 3]);
        let wrong_type = spec.dim::<u32, Ix2>(5, Role::Features).unwrap_err();
        assert!(matches!(wrong_type, Error::WrongElementType { batch: 5, stored: "f32", requested: "u32", .. }));
        let wrong_ndim = spec.dim::<f32, Ix1>(5, Role::Features).unwrap_err();
        assert!(matches!(wrong_ndim, Error::WrongDimensionality { stored: 2, requested: 1, .. }), "{wrong_ndim}");
    }
}
