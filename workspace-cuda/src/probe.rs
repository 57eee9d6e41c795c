//! Finding out whether a CUDA device can be used, without ever panicking.
//!
//! cudarc loads `libcuda` on first use and panics when it is missing (dynamic loading),
//! so [`probe`] asks [`is_culib_present`](cudarc::driver::sys::is_culib_present) first,
//! then initialises the driver and counts the devices. "No driver" and "no device" are
//! ordinary values with a readable reason; nothing else in this crate calls cudarc
//! before the probe has said yes.

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use cudarc::driver::{result, sys};

/// A driver error in words: its name and the driver's description.
pub(crate) fn describe(error: result::DriverError) -> String {
    let message = error.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    format!("{:?} ({message})", error.0)
}

/// Environment variable that makes [`probe`] report no device when set to anything but
/// `0` or the empty string: for running the no-GPU paths on a machine with a GPU.
pub const DISABLE_ENV: &str = "CARVE_CUDA_DISABLE";

/// What [`probe`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Probe {
    /// The driver is loaded and has devices.
    Available {
        /// Number of CUDA devices.
        devices: usize,
        /// The driver's CUDA version as `major * 1000 + minor * 10` (12080 for 12.8).
        driver_version: i32,
    },
    /// The driver library cannot be loaded or used.
    NoDriver {
        /// Why, in words.
        reason: String,
    },
    /// The driver is there but offers no device (or was disabled by [`DISABLE_ENV`]).
    NoDevice {
        /// Why, in words.
        reason: String,
    },
}

impl Probe {
    /// Whether a device can be used.
    pub fn is_available(&self) -> bool {
        matches!(self, Probe::Available { .. })
    }

    /// Why no device can be used (`None` when one can).
    pub fn reason(&self) -> Option<&str> {
        match self {
            Probe::Available { .. } => None,
            Probe::NoDriver { reason } | Probe::NoDevice { reason } => Some(reason),
        }
    }
}

impl fmt::Display for Probe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Probe::Available { devices, driver_version } => write!(
                f,
                "{devices} CUDA device(s), driver API {}.{}",
                driver_version / 1000,
                driver_version % 1000 / 10
            ),
            Probe::NoDriver { reason } | Probe::NoDevice { reason } => f.write_str(reason),
        }
    }
}

/// Probes for the CUDA driver and its devices; never panics. The result is computed once
/// per process.
///
/// ```
/// match workspace_cuda::probe() {
///     workspace_cuda::Probe::Available { devices, .. } => println!("{devices} device(s)"),
///     other => println!("no CUDA device: {other}"),
/// }
/// ```
pub fn probe() -> Probe {
    static PROBE: OnceLock<Probe> = OnceLock::new();
    PROBE.get_or_init(probe_now).clone()
}

fn probe_now() -> Probe {
    if let Some(value) = std::env::var_os(DISABLE_ENV) {
        if !value.is_empty() && value != "0" {
            return Probe::NoDevice { reason: format!("disabled by {DISABLE_ENV}={}", value.to_string_lossy()) };
        }
    }
    // cudarc's loader panics when the library lacks a symbol of the bindings' API
    // version (an old driver); that must come back as a reason, not as a panic.
    // SAFETY: `is_culib_present` only tries to load the driver library and resolve its
    // symbols; it calls none of them.
    match catch_unwind(|| unsafe { sys::is_culib_present() }) {
        Ok(true) => {}
        Ok(false) => {
            return Probe::NoDriver {
                reason: "the CUDA driver library (libcuda.so) was not found; install the NVIDIA driver, or add \
                         the directory holding libcuda.so to LD_LIBRARY_PATH"
                    .into(),
            }
        }
        Err(_) => {
            return Probe::NoDriver {
                reason: "the CUDA driver library was found but lacks functions of the CUDA 13.0 driver API \
                         that carve is built against; update the NVIDIA driver"
                    .into(),
            }
        }
    }
    let counted = catch_unwind(AssertUnwindSafe(|| -> Result<(i32, i32), result::DriverError> {
        result::init()?;
        let mut version = 0;
        // SAFETY: `version` is a valid place for the driver to write an int.
        unsafe { sys::cuDriverGetVersion(&mut version) }.result()?;
        Ok((result::device::get_count()?, version))
    }));
    match counted {
        Ok(Ok((0, _))) => Probe::NoDevice { reason: "the CUDA driver reports no device".into() },
        Ok(Ok((count, driver_version))) => {
            Probe::Available { devices: usize::try_from(count).unwrap_or(0), driver_version }
        }
        Ok(Err(error)) => {
            Probe::NoDevice { reason: format!("initialising the CUDA driver failed: {}", describe(error)) }
        }
        Err(_) => Probe::NoDriver { reason: "the CUDA driver library failed while initialising".into() },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_never_panics_and_explains_itself() {
        let found = probe();
        assert_eq!(found, probe(), "computed once");
        match &found {
            Probe::Available { devices, driver_version } => {
                assert!(*devices > 0 && *driver_version > 0);
                assert!(found.reason().is_none());
            }
            other => {
                let reason = other.reason().expect("a reason");
                assert!(reason.len() > 20, "a readable reason: {reason}");
                assert_eq!(other.to_string(), reason);
                assert!(!other.is_available());
            }
        }
    }

    #[test]
    fn display_of_an_available_device_names_the_driver_version() {
        let probe = Probe::Available { devices: 2, driver_version: 12080 };
        assert_eq!(probe.to_string(), "2 CUDA device(s), driver API 12.8");
    }
}
