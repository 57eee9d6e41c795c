//! Typed views of device memory, tied to the cycle (or to the owned array) they show.
//!
//! [`DeviceView`] and [`DeviceViewMut`] borrow their scope (or their
//! [`DeviceArray`](crate::DeviceArray)), so the compiler rejects any use after the reset,
//! as on the host:
//!
//! ```compile_fail
//! use workspace_cuda::device::sim::SimDevice;
//! use workspace_cuda::{Device, DeviceWorkspace};
//! let sim = SimDevice::new().unwrap();
//! let ws = DeviceWorkspace::new("W", Default::default(), &sim, &sim.default_stream()).unwrap();
//! let scope = ws.enter().unwrap();
//! let view = scope.zeros::<f32, _>(16).unwrap();
//! drop(scope); // the reset happens here...
//! view.to_host().unwrap(); // ...so this does not compile
//! ```
//!
//! Every operation of a view runs on its owner's stream, or is ordered with it by
//! events when it runs elsewhere (a copy into a workspace on another stream).

use std::marker::PhantomData;
use std::mem::size_of;
use std::ops::Deref;
use std::sync::Arc;

use bytemuck::Pod;
use ndarray::{Array, ArrayBase, ArrayViewMut, Data, DataMut, Dimension, Ix1};
use workspace_core::Scope;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::Owner;
use crate::pinned::PinnedArray;
use crate::workspace::DeviceWorkspace;

/// The elements of `src` in standard (row-major) order, as bytes.
pub(crate) fn with_host_bytes<T: Pod, S: Data<Elem = T>, Dim: Dimension, R>(
    src: &ArrayBase<S, Dim>,
    f: impl FnOnce(&[u8]) -> R,
) -> R {
    let standard = src.as_standard_layout();
    match standard.as_slice() {
        Some(elements) => f(bytemuck::cast_slice(elements)),
        None => f(bytemuck::cast_slice(&standard.iter().copied().collect::<Vec<T>>())),
    }
}

/// Runs `copy` into `dst`'s elements as bytes, staging through a vector when `dst` is not
/// in standard layout.
pub(crate) fn copy_to_host<T: Pod, S: DataMut<Elem = T>, Dim: Dimension>(
    dst: &mut ArrayBase<S, Dim>,
    copy: impl FnOnce(&mut [u8]) -> Result<()>,
) -> Result<()> {
    if let Some(elements) = dst.as_slice_mut() {
        return copy(bytemuck::cast_slice_mut(elements));
    }
    let mut staged = vec![T::zeroed(); dst.len()];
    copy(bytemuck::cast_slice_mut(&mut staged))?;
    // `staged` is in standard order, which is the order `iter_mut` visits.
    dst.iter_mut().zip(&staged).for_each(|(slot, value)| *slot = *value);
    Ok(())
}

/// A read-only view of device memory: of a workspace (for the cycle it was allocated in)
/// or of a [`DeviceArray`](crate::DeviceArray).
///
/// Its elements are `T` in standard (row-major) layout with shape `Dim`.
pub struct DeviceView<'a, D: Device, T, Dim: Dimension = Ix1> {
    pub(crate) owner: Owner<'a, D>,
    /// Invariant: `byte_len::<T>(dim)` initialised bytes of `owner`'s memory, valid for `'a`.
    pub(crate) address: u64,
    pub(crate) dim: Dim,
    _elements: PhantomData<&'a [T]>,
}

/// A mutable view of device memory; dereferences to [`DeviceView`] for reading.
pub struct DeviceViewMut<'a, D: Device, T, Dim: Dimension = Ix1> {
    pub(crate) view: DeviceView<'a, D, T, Dim>,
    _exclusive: PhantomData<&'a mut [T]>,
}

impl<'a, D: Device, T: Pod, Dim: Dimension> DeviceView<'a, D, T, Dim> {
    /// # Safety
    ///
    /// `address` must hold `dim.size()` initialised elements of `owner`'s memory that stay
    /// valid for `'a` (not reset, reused or freed): the device copies of every view
    /// method rely on it.
    pub(crate) unsafe fn new(owner: Owner<'a, D>, address: u64, dim: Dim) -> Self {
        DeviceView { owner, address, dim, _elements: PhantomData }
    }

    /// The device address of the first element, for kernels launched on
    /// [`DeviceView::stream`] that read it (using it elsewhere needs
    /// [`DeviceScope::on_stream`](crate::DeviceScope::on_stream)). Work on another stream
    /// that may still write this memory is ordered before the stream's later work first.
    pub fn device_ptr(&self) -> u64 {
        self.owner.order_home_use_or_defer(self.address, self.byte_len(), false);
        self.address
    }

    /// The stream this memory belongs to.
    pub fn stream(&self) -> &'a D::Stream {
        self.owner.stream()
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        self.dim.slice()
    }

    /// The shape as a dimension.
    pub fn raw_dim(&self) -> Dim {
        self.dim.clone()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.dim.size()
    }

    /// Whether there are no elements (never: empty allocations are refused).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len() * size_of::<T>()
    }

    /// The name of the workspace the memory belongs to (`owned device array` for arrays).
    pub fn workspace_name(&self) -> Arc<str> {
        self.owner.name()
    }

    /// Row `i` of a two-dimensional view, as a one-dimensional view of the same memory
    /// (`None` when there is no row `i`).
    pub fn row(&self, i: usize) -> Option<DeviceView<'_, D, T, Ix1>>
    where
        Dim: Dimension<Pattern = (usize, usize)>,
    {
        let (rows, cols) = self.dim.clone().into_pattern();
        if i >= rows {
            return None;
        }
        let offset = (i * cols * size_of::<T>()) as u64;
        // SAFETY: rows are `cols` elements each, in standard layout: row `i` is `cols`
        // initialised elements inside this view's memory, valid as long as this view.
        Some(unsafe { DeviceView::new(self.owner, self.address + offset, Ix1(cols)) })
    }

    /// A shorter-lived copy of this view.
    pub fn reborrow(&self) -> DeviceView<'_, D, T, Dim> {
        // SAFETY: the same memory, for a shorter lifetime than this view's.
        unsafe { DeviceView::new(self.owner, self.address, self.dim.clone()) }
    }

    /// The former name of [`to_host`](Self::to_host).
    ///
    /// # Errors
    ///
    /// As [`to_host`](Self::to_host).
    #[deprecated(note = "renamed `to_host`, as on `DeviceArray`")]
    #[doc(hidden)]
    pub fn detach_to_host(&self) -> Result<Array<T, Dim>> {
        self.to_host()
    }

    /// Copies into an owned host array.
    ///
    /// # Errors
    ///
    /// [`Error::Device`] when the device cannot copy.
    pub fn to_host(&self) -> Result<Array<T, Dim>> {
        let mut out = Array::from_elem(self.dim.clone(), T::zeroed());
        self.dtoh_into(&mut out)?;
        Ok(out)
    }

    /// Copies into a new array in the open host workspace scope `host`.
    ///
    /// # Errors
    ///
    /// `host`'s allocation errors, or [`Error::Device`].
    pub fn dtoh_in<'h>(&self, host: &'h Scope<'_>) -> Result<ArrayViewMut<'h, T, Dim>> {
        let mut out = host.zeros::<T, Dim>(self.dim.clone())?;
        self.dtoh_into(&mut out)?;
        Ok(out)
    }

    pub(crate) fn check_shape(&self, other: &[usize], action: &'static str) -> Result<()> {
        if other == self.shape() {
            Ok(())
        } else {
            Err(Error::ShapeMismatch {
                workspace: self.owner.name(),
                action,
                source_shape: self.shape().to_vec(),
                destination_shape: other.to_vec(),
            })
        }
    }
}

impl<'a, D: Device, T: Pod, Dim: Dimension> DeviceViewMut<'a, D, T, Dim> {
    /// # Safety
    ///
    /// As [`DeviceView::new`], and nothing else may refer to the memory for `'a`.
    pub(crate) unsafe fn new(owner: Owner<'a, D>, address: u64, dim: Dim) -> Self {
        // SAFETY: the caller's contract.
        DeviceViewMut { view: unsafe { DeviceView::new(owner, address, dim) }, _exclusive: PhantomData }
    }

    /// The device address of the first element, for kernels that write it on
    /// [`DeviceView::stream`]. Work on another stream that may still read or write this
    /// memory is ordered before the stream's later work first.
    pub fn device_ptr_mut(&mut self) -> u64 {
        self.view.owner.order_home_use_or_defer(self.view.address, self.view.byte_len(), true);
        self.view.address
    }

    /// A read-only view for the duration of the borrow.
    pub fn as_view(&self) -> DeviceView<'_, D, T, Dim> {
        self.view.reborrow()
    }

    /// Gives up mutability for the view's whole lifetime.
    pub fn freeze(self) -> DeviceView<'a, D, T, Dim> {
        self.view
    }
}

impl<D: Device, T, Dim: Dimension> std::fmt::Debug for DeviceView<'_, D, T, Dim> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceView")
            .field("workspace", &self.owner.name())
            .field("address", &format_args!("{:#x}", self.address))
            .field("shape", &self.dim.slice())
            .finish()
    }
}

impl<D: Device, T, Dim: Dimension> std::fmt::Debug for DeviceViewMut<'_, D, T, Dim> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("DeviceViewMut").field(&self.view).finish()
    }
}

impl<D: Device, T, Dim: Dimension> std::fmt::Debug for DeviceUninit<'_, D, T, Dim> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("DeviceUninit").field(&self.view.view).finish()
    }
}

impl<'a, D: Device, T, Dim: Dimension> Deref for DeviceViewMut<'a, D, T, Dim> {
    type Target = DeviceView<'a, D, T, Dim>;

    fn deref(&self) -> &DeviceView<'a, D, T, Dim> {
        &self.view
    }
}

/// Device memory that holds no data yet: it can be filled (from the host, a device view,
/// zeros, or a kernel) but not read.
pub struct DeviceUninit<'a, D: Device, T, Dim: Dimension = Ix1> {
    view: DeviceViewMut<'a, D, T, Dim>,
}

/// What hands out device memory that views may borrow: a scope's cycle, or a frame.
///
/// # Safety
///
/// `reserve` returns the address of memory for `dim.size()` elements of `T`, aligned for
/// `T`, in the memory of `workspace()`, that nothing else refers to and that stays
/// valid (not reset, reused or freed) while `self` is borrowed, with every earlier use
/// of it on another stream ordered before the workspace's stream.
#[allow(unsafe_code)]
pub(crate) unsafe trait Carve<D: Device> {
    /// The workspace the memory belongs to.
    fn workspace(&self) -> &DeviceWorkspace<D>;
    /// See the trait's contract.
    fn reserve<T, Dim: Dimension>(&self, dim: &Dim) -> Result<u64>;
}

impl<'a, D: Device, T: Pod, Dim: Dimension> DeviceUninit<'a, D, T, Dim> {
    /// Memory for `dim` elements of `T` reserved in `target` (a scope's cycle, or a
    /// frame of it).
    ///
    /// # Errors
    ///
    /// The target's allocation errors.
    pub(crate) fn allocate<C: Carve<D>>(target: &'a C, dim: Dim) -> Result<Self> {
        let address = target.reserve::<T, Dim>(&dim)?;
        // SAFETY: the range was just reserved by `target` for `dim.size()` elements:
        // nothing else refers to it while `target` is borrowed (the `Carve` contract),
        // and the view borrows it. (Its bytes are not initialised: `DeviceUninit` can
        // only be written.)
        Ok(DeviceUninit { view: unsafe { DeviceViewMut::new(Owner::Workspace(target.workspace()), address, dim) } })
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        self.view.shape()
    }

    /// The device address of the first element, for a kernel that writes every element
    /// on [`DeviceView::stream`] before [`DeviceUninit::assume_init`] (ordered as
    /// [`DeviceViewMut::device_ptr_mut`]).
    pub fn device_ptr_mut(&mut self) -> u64 {
        self.view.device_ptr_mut()
    }

    /// Fills with zeros.
    ///
    /// # Errors
    ///
    /// As [`DeviceViewMut::fill_zeros`].
    pub fn zeroed(mut self) -> Result<DeviceViewMut<'a, D, T, Dim>> {
        self.view.fill_zeros()?;
        Ok(self.view)
    }

    /// Fills from a host array of the same shape.
    ///
    /// # Errors
    ///
    /// As [`DeviceViewMut::htod_from`].
    pub fn htod_from<S: Data<Elem = T>>(mut self, src: &ArrayBase<S, Dim>) -> Result<DeviceViewMut<'a, D, T, Dim>> {
        self.view.htod_from(src)?;
        Ok(self.view)
    }

    /// Fills from a pinned staging array of the same shape (asynchronously).
    ///
    /// # Errors
    ///
    /// As [`DeviceViewMut::htod_pinned`].
    pub fn htod_pinned(mut self, src: &PinnedArray<'_, D, T, Dim>) -> Result<DeviceViewMut<'a, D, T, Dim>> {
        self.view.htod_pinned(src)?;
        Ok(self.view)
    }

    /// Fills from a device view of the same shape.
    ///
    /// # Errors
    ///
    /// As [`DeviceViewMut::copy_from`].
    pub fn copy_from(mut self, src: &DeviceView<'_, D, T, Dim>) -> Result<DeviceViewMut<'a, D, T, Dim>> {
        self.view.copy_from(src)?;
        Ok(self.view)
    }

    /// The view, for memory a kernel has filled.
    ///
    /// # Safety
    ///
    /// Every element must have been written by work issued to the view's stream (or
    /// ordered before it): otherwise reads see stale data of an earlier cycle.
    pub unsafe fn assume_init(self) -> DeviceViewMut<'a, D, T, Dim> {
        self.view
    }
}
