//! Device memory as views and arrays see it: whose it is ([`Owner`], which says which
//! stream orders it and names it in errors), and how many bytes a shape of it takes
//! ([`checked_bytes`]).

use std::sync::Arc;

use ndarray::Dimension;

use crate::device::{ordered_with, Device};
use crate::error::{DeviceError, Error, Result};
use crate::workspace::DeviceWorkspace;

/// Whose memory a view shows, and so which stream orders it.
pub(crate) enum Owner<'a, D: Device> {
    /// A workspace's arena or spill blocks, valid for the open cycle.
    Workspace(&'a DeviceWorkspace<D>),
    /// A [`DeviceArray`](crate::DeviceArray), valid while it lives.
    Array {
        /// The array's device.
        device: &'a D,
        /// The stream the array belongs to.
        stream: &'a D::Stream,
    },
    /// A batch in a device prefetch ring, valid while its lease lives.
    Ring {
        /// The ring's device.
        device: &'a D,
        /// The consumer's stream, which orders every use of the batch.
        stream: &'a D::Stream,
    },
}

impl<D: Device> Clone for Owner<'_, D> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<D: Device> Copy for Owner<'_, D> {}

/// Name used in errors about owned device arrays.
pub(crate) const OWNED: &str = "owned device array";

/// Name used in errors about batches of a device prefetch ring.
pub(crate) const RING: &str = "device prefetch ring";

impl<'a, D: Device> Owner<'a, D> {
    pub(crate) fn device(&self) -> &'a D {
        match self {
            Owner::Workspace(ws) => ws.device(),
            Owner::Array { device, .. } | Owner::Ring { device, .. } => device,
        }
    }

    pub(crate) fn stream(&self) -> &'a D::Stream {
        match self {
            Owner::Workspace(ws) => ws.stream(),
            Owner::Array { stream, .. } | Owner::Ring { stream, .. } => stream,
        }
    }

    pub(crate) fn name(&self) -> Arc<str> {
        match self {
            Owner::Workspace(ws) => ws.name().clone(),
            Owner::Array { .. } => Arc::from(OWNED),
            Owner::Ring { .. } => Arc::from(RING),
        }
    }

    pub(crate) fn error(&self, action: &'static str, source: DeviceError) -> Error {
        Error::Device { workspace: self.name(), action, source }
    }

    /// Runs `op` on `stream` with this owner's memory, ordered with the owner's stream.
    pub(crate) fn run_on(
        &self,
        stream: &D::Stream,
        action: &'static str,
        op: impl FnOnce(&D::Stream) -> Result<(), DeviceError>,
    ) -> Result<()> {
        match self {
            Owner::Workspace(ws) => ws.run_on(stream, action, op),
            Owner::Array { device, stream: home } | Owner::Ring { device, stream: home } => {
                ordered_with(*device, stream, home, op).map_err(|e| self.error(action, e))
            }
        }
    }

    /// Before work on the owner's own stream reads (or, with `writes`, writes) `bytes`
    /// bytes at `address`: for a workspace, orders first every other stream whose use of
    /// that memory, recorded by an [`OnStream`](crate::OnStream), conflicts (see
    /// [`DeviceWorkspace`]'s module docs). Nothing to do for arrays and rings, which only
    /// their own stream uses.
    pub(crate) fn order_home_use(&self, address: u64, bytes: usize, writes: bool, action: &'static str) -> Result<()> {
        match self {
            Owner::Workspace(ws) => {
                ws.order().order_home_use(address, bytes, writes, None).map_err(|e| self.error(action, e))
            }
            Owner::Array { .. } | Owner::Ring { .. } => Ok(()),
        }
    }

    /// As [`Owner::order_home_use`], for a raw address handed to a kernel (no error to
    /// return: one is kept for the workspace's next `enter`).
    pub(crate) fn order_home_use_or_defer(&self, address: u64, bytes: usize, writes: bool) {
        if let Owner::Workspace(ws) = self {
            ws.order().order_home_use_or_defer(address, bytes, writes);
        }
    }

    /// An error unless `other` lives on the same device.
    pub(crate) fn check_device(&self, other: &D, action: &'static str) -> Result<()> {
        if self.device().same_device(other) {
            Ok(())
        } else {
            Err(Error::DeviceMismatch {
                workspace: self.name(),
                action,
                device: self.device().describe(),
                other: other.describe(),
            })
        }
    }
}

/// Byte size of `dim` elements of `T` in device or pinned memory: the engine's one
/// shape-to-bytes computation ([`workspace_core::backend::checked_bytes`]), and zero-sized
/// element types refused.
///
/// # Errors
///
/// In this order: [`ShapeOverflow`](workspace_core::Error::ShapeOverflow) when the
/// element count overflows or exceeds `isize::MAX` (for every element type, zero-sized
/// ones included), [`ZeroLength`](workspace_core::Error::ZeroLength) for no elements,
/// [`InvalidInput`](workspace_core::Error::InvalidInput) for a zero-sized element type,
/// and `ShapeOverflow` again when the byte size exceeds `isize::MAX`. `workspace` names
/// the workspace in the error.
#[inline(always)]
pub(crate) fn checked_bytes<T, Dim: Dimension>(
    dim: &Dim,
    workspace: impl Fn() -> Arc<str>,
) -> Result<usize, workspace_core::Error> {
    match workspace_core::backend::checked_bytes::<T, Dim>(dim, &workspace)? {
        0 => Err(zero_sized::<T>(dim.slice(), workspace())),
        bytes => Ok(bytes),
    }
}

#[cold]
#[inline(never)]
fn zero_sized<T>(shape: &[usize], workspace: Arc<str>) -> workspace_core::Error {
    workspace_core::Error::InvalidInput(format!(
        "workspace '{workspace}': elements of type `{}` are zero-sized, and device and pinned arrays hold \
         elements of non-zero size (shape {shape:?}); an array of zero-sized elements needs no memory, so \
         create it on the host with `ndarray::Array`",
        std::any::type_name::<T>()
    ))
}
