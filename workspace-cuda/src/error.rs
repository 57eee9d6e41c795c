//! The errors of workspace-cuda.
//!
//! [`DeviceError`] is what the device layer ([`Device`](crate::Device)) reports: a driver
//! call that failed, memory that ran out, a fault of the simulated device. [`Error`] is what
//! the workspaces report: it adds which workspace, what was being done, and what to do about
//! it, and carries the host engine's errors (learning, spilling, stale handles) unchanged.

use std::sync::Arc;

use workspace_core::BackendError;

/// A failure reported by a [`Device`](crate::Device).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// A CUDA driver call returned an error.
    #[error("{call} returned {code}: {message}")]
    Driver {
        /// The driver call (`cuMemAllocAsync`, `cuStreamWaitEvent`, ...).
        call: &'static str,
        /// The `CUresult` name (`CUDA_ERROR_ILLEGAL_ADDRESS`, ...).
        code: String,
        /// The driver's description of the error.
        message: String,
    },
    /// The device (or the page-locked host memory pool) has no room for the request.
    #[error("out of {what} memory: {bytes} bytes could not be allocated")]
    OutOfMemory {
        /// Bytes requested.
        bytes: usize,
        /// `"device"` or `"pinned host"`.
        what: &'static str,
    },
    /// The simulated device met an operation on memory it does not own (the
    /// simulator's `CUDA_ERROR_ILLEGAL_ADDRESS`): a use after free or out of bounds.
    #[error("simulated device fault in {op}: {detail}")]
    Fault {
        /// The operation that faulted (`memset`, `htod`, `dtoh`, `dtod`).
        op: &'static str,
        /// What was wrong with it.
        detail: String,
    },
}

impl DeviceError {
    /// The same error as a [`BackendError`] for the host engine.
    pub(crate) fn into_backend(self, align: usize) -> BackendError {
        match self {
            DeviceError::OutOfMemory { bytes, .. } => BackendError::OutOfMemory { bytes, align },
            other => BackendError::Other(other.to_string()),
        }
    }
}

/// Errors of device and pinned workspaces.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An error of the workspace engine: configuration, learning, spilling, budgets,
    /// stale handles, closed workspaces. The messages are those of host workspaces.
    #[error(transparent)]
    Workspace(#[from] workspace_core::Error),

    /// An error of the host prefetcher under a [`DevicePrefetcher`](crate::DevicePrefetcher):
    /// the batch source's errors and panics, layouts, the pinned ring, configuration, and
    /// reading an array with the wrong type. The messages are async-iter's.
    #[error(transparent)]
    Prefetch(#[from] async_iter::Error),

    /// No CUDA device can be used on this machine.
    #[error("no CUDA device: {reason}")]
    NoDevice {
        /// Why (no driver library, no device, a driver error), in words.
        reason: String,
    },

    /// The device failed an operation of a workspace.
    #[error(
        "workspace '{workspace}': {action} failed on the device: {source}. The workspace is still \
         consistent; if the driver reports a sticky error (illegal address, launch failure) the CUDA \
         context is lost and the process must create a new device"
    )]
    Device {
        /// The workspace (or `owned device array`).
        workspace: Arc<str>,
        /// What was being done.
        action: &'static str,
        /// What the device reported.
        #[source]
        source: DeviceError,
    },

    /// The shapes of a copy's source and destination differ.
    #[error(
        "workspace '{workspace}': {action} needs equal shapes, but the source has shape {source_shape:?} \
         and the destination {destination_shape:?}; allocate the destination with the source's shape"
    )]
    ShapeMismatch {
        /// The workspace of the destination.
        workspace: Arc<str>,
        /// What was being done.
        action: &'static str,
        /// The source's shape.
        source_shape: Vec<usize>,
        /// The destination's shape.
        destination_shape: Vec<usize>,
    },

    /// Memory of two different devices met in one operation.
    #[error(
        "workspace '{workspace}' lives on {device} but {action} involves memory of {other}; copy through \
         the host (`to_host`) to move data between devices"
    )]
    DeviceMismatch {
        /// The workspace asked.
        workspace: Arc<str>,
        /// What was being done.
        action: &'static str,
        /// The workspace's device.
        device: String,
        /// The other device.
        other: String,
    },

    /// Memory was used on a stream it is not ordered with.
    #[error(
        "workspace '{workspace}': {action}: {detail}. Use memory on another stream only through \
         `DeviceScope::on_stream`, which orders that stream with the workspace's stream"
    )]
    StreamMismatch {
        /// The workspace asked.
        workspace: Arc<str>,
        /// What was being done.
        action: &'static str,
        /// What does not match.
        detail: String,
    },
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The message, as for `Display`: what `main` prints for an error it returns.
impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_errors_become_backend_errors() {
        let oom = DeviceError::OutOfMemory { bytes: 1024, what: "device" };
        assert!(matches!(oom.into_backend(256), BackendError::OutOfMemory { bytes: 1024, align: 256 }));
        let fault = DeviceError::Fault { op: "dtod", detail: "no allocation at 0x10".into() };
        let backend = fault.into_backend(256);
        assert!(backend.to_string().contains("dtod") && backend.to_string().contains("0x10"), "{backend}");
    }

    #[test]
    fn messages_say_what_to_do() {
        let err = Error::Device {
            workspace: "ACT".into(),
            action: "zeroing an allocation",
            source: DeviceError::Driver {
                call: "cuMemsetD8Async",
                code: "CUDA_ERROR_ILLEGAL_ADDRESS".into(),
                message: "an illegal memory access was encountered".into(),
            },
        };
        let msg = err.to_string();
        for needle in ["'ACT'", "zeroing", "cuMemsetD8Async", "CUDA_ERROR_ILLEGAL_ADDRESS", "new device"] {
            assert!(msg.contains(needle), "message lacks {needle}: {msg}");
        }
        let err = Error::NoDevice { reason: "libcuda.so not found".into() };
        assert_eq!(err.to_string(), "no CUDA device: libcuda.so not found");
    }
}
