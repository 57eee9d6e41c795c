//! A call stack of an arena's own: a direct request runs its layers on the stack of the
//! arena it leased, not on its caller's, so that the memory a request touches is the
//! arena's (K of them) whatever the number of callers; a caller's thread only waits
//! and returns, as an idle thread does.
//!
//! The stack is an anonymous mapping with a guard page below it (stacks grow down on
//! the targets carve builds for), reserved once per arena; only the pages a request
//! reaches are resident. The switch is `psm::on_stack`, the primitive `stacker` (and so
//! rustc) uses; a panic is caught on the arena's stack and resumed on the caller's.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use crate::{Error, Result};

/// Bytes of an arena's stack (virtual; a request touches a few pages of it): Rust's
/// default for a spawned thread, so that layers deep enough for a thread of their own
/// are deep enough here.
const STACK: usize = 2 << 20;

/// An arena's call stack.
#[derive(Debug)]
pub(crate) struct ArenaStack {
    /// The mapping: the guard page, then the stack.
    mapping: *mut libc::c_void,
    length: usize,
    /// The page size (the guard's length).
    page: usize,
}

// SAFETY: the mapping is owned (made in `new`, unmapped in `drop`) and used only
// through `&mut self` (`run`), so moving it between threads moves its only user.
unsafe impl Send for ArenaStack {}

impl ArenaStack {
    /// A stack of [`STACK`] bytes and a guard page below it.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when the mapping cannot be made.
    pub(crate) fn new() -> Result<ArenaStack> {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(4096);
        let length = STACK + page;
        // SAFETY: a fresh anonymous private mapping; nothing else refers to it.
        let mapping = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                length,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if mapping == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(Error::InvalidConfig { reason: format!("cannot map an inference arena's stack: {e}") });
        }
        let stack = ArenaStack { mapping, length, page };
        // The lowest page is the guard: a request that overflows the stack faults there
        // instead of writing below it.
        // SAFETY: the first page of the mapping made above.
        if unsafe { libc::mprotect(mapping, page, libc::PROT_NONE) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err(Error::InvalidConfig { reason: format!("cannot guard an inference arena's stack: {e}") });
        }
        Ok(stack)
    }

    /// Runs `f` on this stack (on the calling thread): its value, or its panic resumed
    /// here.
    pub(crate) fn run<R>(&mut self, f: impl FnOnce() -> R) -> R {
        let mut outcome = None;
        let base = self.mapping.cast::<u8>().wrapping_add(self.page);
        let body = || outcome = Some(catch_unwind(AssertUnwindSafe(f)));
        // SAFETY: `base .. base + STACK` is this stack's writable part, page-aligned
        // (so aligned for any target), with the guard page below it (the direction
        // stacks grow on the targets carve builds for); `&mut self` makes this call its
        // only user until it returns. No panic unwinds out of `body` (it is caught
        // inside), and `body` returns normally, so `on_stack` restores the caller's
        // stack before this returns.
        unsafe { psm::on_stack(base, STACK, body) };
        match outcome.expect("the body ran") {
            Ok(value) => value,
            Err(payload) => resume_unwind(payload),
        }
    }
}

impl Drop for ArenaStack {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, no longer in use (`run` borrows `self`).
        unsafe { libc::munmap(self.mapping, self.length) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closure_runs_on_the_arenas_stack_and_its_panic_comes_back() {
        let mut stack = ArenaStack::new().unwrap();
        let here = 0u8;
        let (low, high) = (stack.mapping as usize, stack.mapping as usize + stack.length);
        let there = stack.run(|| {
            let local = 0u8;
            std::ptr::addr_of!(local) as usize
        });
        assert!((low..high).contains(&there), "ran at {there:#x}, not in {low:#x}..{high:#x}");
        assert!(!(low..high).contains(&(std::ptr::addr_of!(here) as usize)));
        // Deep enough for real work: a recursion of some hundred kilobytes.
        fn depth(n: usize) -> usize {
            let pad = std::hint::black_box([n as u8; 512]);
            if n == 0 {
                pad[0] as usize
            } else {
                depth(n - 1) + pad[1] as usize
            }
        }
        assert_eq!(stack.run(|| depth(500)), (1..=500).map(|n| n as u8 as usize).sum::<usize>());
        let caught = catch_unwind(AssertUnwindSafe(|| stack.run(|| panic!("from the arena's stack"))));
        let payload = caught.expect_err("the panic comes back");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"from the arena's stack"));
        // Still usable afterwards.
        assert_eq!(stack.run(|| 41 + 1), 42);
    }
}
