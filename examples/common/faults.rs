//! Minor page faults of the calling thread, for the training examples' measurements.

/// Minor page faults of this thread so far (of the process where the OS cannot count
/// per thread).
pub(crate) fn minor_faults() -> u64 {
    // SAFETY: `getrusage` only writes into the struct it is given, for which all-zero
    // bytes are a valid value.
    unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        #[cfg(target_os = "linux")]
        let who = libc::RUSAGE_THREAD;
        #[cfg(not(target_os = "linux"))]
        let who = libc::RUSAGE_SELF;
        if libc::getrusage(who, &mut usage) != 0 {
            return 0;
        }
        usage.ru_minflt as u64
    }
}
