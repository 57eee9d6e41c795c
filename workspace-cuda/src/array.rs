//! Owned device arrays: what `detach()` gives, outliving every reset.

use std::fmt;
use std::marker::PhantomData;

use bytemuck::Pod;
use ndarray::{Array, ArrayBase, Data, Dimension, Ix1, ShapeBuilder};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::{checked_bytes, Owner, OWNED};
use crate::view::{DeviceView, DeviceViewMut};

/// A device array that owns its memory (one device allocation), bound to one stream:
/// every operation on it runs on that stream, and dropping it frees the memory in that
/// stream's order.
///
/// ```
/// use workspace_cuda::device::sim::SimDevice;
/// use workspace_cuda::{Device, DeviceArray};
///
/// let sim = SimDevice::new()?;
/// let host = ndarray::Array2::from_shape_fn((2, 3), |(i, j)| (i * 3 + j) as f32);
/// let on_device = DeviceArray::htod(&sim, &sim.default_stream(), &host)?;
/// assert_eq!(on_device.shape(), &[2, 3]);
/// assert_eq!(on_device.to_host()?, host);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DeviceArray<D: Device, T, Dim: Dimension = Ix1> {
    /// Invariant: holds `byte_len::<T>(dim)` initialised bytes.
    memory: D::Memory,
    device: D,
    stream: D::Stream,
    dim: Dim,
    _elements: PhantomData<T>,
}

impl<D: Device, T: Pod, Dim: Dimension> DeviceArray<D, T, Dim> {
    /// `memory` must hold `dim.size()` elements, written (or being written in `stream`'s
    /// order) by the caller.
    pub(crate) fn from_parts(memory: D::Memory, device: D, stream: D::Stream, dim: Dim) -> Self {
        DeviceArray { memory, device, stream, dim, _elements: PhantomData }
    }

    fn allocate(device: &D, stream: &D::Stream, dim: &Dim, action: &'static str) -> Result<D::Memory> {
        let bytes = checked_bytes::<T, Dim>(dim, || OWNED.into())?;
        if !device.owns_stream(stream) {
            return Err(Error::StreamMismatch {
                workspace: OWNED.into(),
                action,
                detail: format!("{stream:?} does not belong to {}", device.describe()),
            });
        }
        device.alloc(stream, bytes).map_err(|source| Error::Device { workspace: OWNED.into(), action, source })
    }

    /// A zero-filled array on `stream`.
    ///
    /// # Errors
    ///
    /// An empty or overflowing shape or a zero-sized element type (as for
    /// [`DeviceScope::zeros`](crate::DeviceScope::zeros)), a stream of another device, or a
    /// device error.
    pub fn zeros<Sh: ShapeBuilder<Dim = Dim>>(device: &D, stream: &D::Stream, shape: Sh) -> Result<Self> {
        let dim = shape.into_shape_with_order().raw_dim().clone();
        let memory = Self::allocate(device, stream, &dim, "allocating an owned array")?;
        let mut array = DeviceArray::from_parts(memory, device.clone(), stream.clone(), dim);
        array.view_mut().fill_zeros()?;
        Ok(array)
    }

    /// A copy of the host array `src` on `stream`.
    ///
    /// # Errors
    ///
    /// As [`DeviceArray::zeros`].
    pub fn htod<S: Data<Elem = T>>(device: &D, stream: &D::Stream, src: &ArrayBase<S, Dim>) -> Result<Self> {
        let dim = src.raw_dim();
        let memory = Self::allocate(device, stream, &dim, "copying host data to the device")?;
        let mut array = DeviceArray::from_parts(memory, device.clone(), stream.clone(), dim);
        array.view_mut().htod_from(src)?;
        Ok(array)
    }

    /// A read-only view.
    #[allow(unsafe_code)]
    pub fn view(&self) -> DeviceView<'_, D, T, Dim> {
        // SAFETY: the array owns `dim.size()` initialised elements at its address, freed
        // only when it is dropped, which the borrow of `self` prevents.
        unsafe { DeviceView::new(self.owner(), self.device_ptr(), self.raw_dim()) }
    }

    /// A mutable view.
    #[allow(unsafe_code)]
    pub fn view_mut(&mut self) -> DeviceViewMut<'_, D, T, Dim> {
        // SAFETY: as in `view`; the borrow is exclusive.
        unsafe { DeviceViewMut::new(self.owner(), self.device_ptr(), self.raw_dim()) }
    }

    pub(crate) fn raw_dim(&self) -> Dim {
        self.dim.clone()
    }

    pub(crate) fn owner(&self) -> Owner<'_, D> {
        Owner::Array { device: &self.device, stream: &self.stream }
    }

    /// Copies into an owned host array.
    ///
    /// # Errors
    ///
    /// [`Error::Device`].
    pub fn to_host(&self) -> Result<Array<T, Dim>> {
        self.view().to_host()
    }

    /// The device address of the first element, for kernels on [`DeviceArray::stream`].
    pub fn device_ptr(&self) -> u64 {
        D::memory_address(&self.memory)
    }

    /// The stream the array belongs to.
    pub fn stream(&self) -> &D::Stream {
        &self.stream
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        self.dim.slice()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.dim.size()
    }

    /// Whether there are no elements (never: empty arrays are refused).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<D: Device, T, Dim: Dimension> fmt::Debug for DeviceArray<D, T, Dim> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceArray")
            .field("memory", &self.memory)
            .field("shape", &self.dim.slice())
            .field("stream", &self.stream)
            .finish()
    }
}
