//! The probe on the machine the tests run on: never a panic, always a reason.

use std::process::Command;

use workspace_cuda::{probe, CudaDevice, Probe, DISABLE_ENV};

#[test]
fn the_probe_answers_without_panicking_and_says_why_there_is_no_device() {
    // SAFETY: only loads the driver library and resolves its symbols, as the probe does.
    let library = std::panic::catch_unwind(|| unsafe { workspace_cuda::cudarc::driver::sys::is_culib_present() });
    match probe() {
        Probe::Available { devices, .. } => {
            assert!(devices > 0 && matches!(library, Ok(true)));
            CudaDevice::new(0).expect("the probe found a device");
        }
        other => {
            let reason = other.reason().expect("a reason").to_string();
            if matches!(library, Ok(false)) && std::env::var_os(DISABLE_ENV).is_none() {
                assert!(matches!(other, Probe::NoDriver { .. }), "{other:?}");
                assert!(reason.contains("libcuda.so") && reason.contains("LD_LIBRARY_PATH"), "{reason}");
            }
            let err = CudaDevice::new(0).unwrap_err();
            assert_eq!(err.to_string(), format!("no CUDA device: {reason}"));
        }
    }
}

/// Run in a child process with the variable set (the probe is computed once per process).
#[test]
fn the_probe_can_be_disabled_by_the_environment() {
    if std::env::var_os(DISABLE_ENV).is_some() {
        match probe() {
            Probe::NoDevice { reason } => assert_eq!(reason, format!("disabled by {DISABLE_ENV}=yes")),
            other => panic!("expected NoDevice, got {other:?}"),
        }
        return;
    }
    let test = "probe::the_probe_can_be_disabled_by_the_environment";
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--test-threads=1"])
        .env(DISABLE_ENV, "yes")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&child.stdout);
    assert!(child.status.success(), "{stdout}{}", String::from_utf8_lossy(&child.stderr));
    assert!(stdout.contains("1 passed"), "{stdout}");
}
