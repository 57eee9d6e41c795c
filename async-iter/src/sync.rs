//! The synchronisation primitives of carve's concurrent protocols, from std or, under
//! `cfg(loom)`, from loom.
//!
//! Everything the prefetcher's protocol in `handoff` and its ring use to coordinate the
//! two threads comes from here: atomics, the lock and condition variable a waiting side
//! parks on, the cells that hold slot descriptors, thread spawning, and the deadline of
//! the one timed wait (for the producer thread to hand its state back). carve's serving
//! and data-parallel protocols (`carve::nn`: the batcher's tickets, the inference
//! arenas' turns, the workers' barrier and reducer) take theirs from here too, so that
//! their loom models check the code that ships. Under `--cfg loom` each of them is
//! loom's, so the model checker sees every atomic operation, lock, wait, park and cell
//! access (the pattern of crossbeam's `primitive` and tokio's `loom` modules).
//!
//! This module is public for carve's own crates; it is not a stable API.
//!
//! Some shapes differ from std and are given here on both sides:
//!
//! - [`UnsafeCell`] hands out *tracked* pointers ([`ConstPtr`], [`MutPtr`]): loom
//!   considers the cell accessed for as long as such a pointer lives, so a lease that
//!   holds a `ConstPtr` to its slot turns "the producer writes a slot the consumer
//!   still holds" into a model failure. With std they are plain raw pointers.
//! - [`Backoff`] is crossbeam's spin-then-yield backoff with std, and [`spin_loop`] the
//!   processor's spin hint. Under loom the backoff reports completion at once and the
//!   spin yields, so a waiting side goes straight to what loom explores; spinning would
//!   only multiply the interleavings of the same loads.
//! - Time ([`Deadline`], [`Stopwatch`], [`park_timeout`]): with loom no time passes, so
//!   that every run of a model takes the same path: a zero timeout has expired at once,
//!   any other never expires, and a timed park or wait ends only when woken.
//!
//! Statistics counters are not part of any protocol and use std atomics directly.

#[cfg(not(loom))]
mod imp {
    pub use crossbeam::utils::Backoff;
    pub use std::hint::spin_loop;
    pub use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize};
    pub use std::sync::{Arc, Condvar, Mutex, MutexGuard};
    pub use std::thread::{current, park, park_timeout, yield_now, JoinHandle, Thread, ThreadId};

    /// Spawns a thread named `name`.
    ///
    /// # Errors
    ///
    /// When the thread cannot be started.
    pub fn spawn<F, T>(name: &str, f: F) -> std::io::Result<JoinHandle<T>>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        std::thread::Builder::new().name(name.into()).spawn(f)
    }

    /// A cell whose accesses loom can track; with std, a plain `UnsafeCell`.
    #[derive(Debug, Default)]
    pub struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

    impl<T> UnsafeCell<T> {
        /// A cell holding `value`.
        pub fn new(value: T) -> UnsafeCell<T> {
            UnsafeCell(std::cell::UnsafeCell::new(value))
        }

        /// A shared access that lasts as long as the returned pointer.
        #[inline(always)]
        pub fn get(&self) -> ConstPtr<T> {
            ConstPtr(self.0.get())
        }

        /// A unique access that lasts as long as the returned pointer.
        #[inline(always)]
        pub fn get_mut(&self) -> MutPtr<T> {
            MutPtr(self.0.get())
        }

        /// A unique access for the duration of `f`.
        #[inline(always)]
        pub fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
            f(self.0.get())
        }
    }

    /// A shared access to an [`UnsafeCell`], until dropped.
    #[derive(Debug)]
    pub struct ConstPtr<T>(*const T);

    /// Dropping ends the access, as with loom's pointer (nothing to do with std).
    impl<T> Drop for ConstPtr<T> {
        fn drop(&mut self) {}
    }

    impl<T> ConstPtr<T> {
        /// # Safety
        ///
        /// No unique access to the cell may overlap the returned reference.
        #[inline(always)]
        pub unsafe fn deref(&self) -> &T {
            // SAFETY: the pointer comes from a live cell; the caller rules out a
            // concurrent unique access.
            unsafe { &*self.0 }
        }
    }

    /// A unique access to an [`UnsafeCell`], until dropped.
    #[derive(Debug)]
    pub struct MutPtr<T>(*mut T);

    /// Dropping ends the access, as with loom's pointer (nothing to do with std).
    impl<T> Drop for MutPtr<T> {
        fn drop(&mut self) {}
    }

    impl<T> MutPtr<T> {
        /// # Safety
        ///
        /// No other access to the cell may overlap the returned reference.
        #[inline(always)]
        #[allow(clippy::mut_from_ref)] // the reference is derived from the cell, not from `self`
        pub unsafe fn deref(&self) -> &mut T {
            // SAFETY: the pointer comes from a live cell; the caller rules out any
            // overlapping access.
            unsafe { &mut *self.0 }
        }
    }
}

#[cfg(loom)]
mod imp {
    pub use loom::cell::{ConstPtr, MutPtr, UnsafeCell};
    pub use loom::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize};
    pub use loom::sync::{Arc, Condvar, Mutex, MutexGuard};
    pub use loom::thread::{current, park, yield_now, JoinHandle, Thread, ThreadId};

    /// Spawns a loom thread named `name`.
    ///
    /// # Errors
    ///
    /// Never (the signature is std's).
    pub fn spawn<F, T>(name: &str, f: F) -> std::io::Result<JoinHandle<T>>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        loom::thread::Builder::new().name(name.into()).spawn(f)
    }

    /// A park that ends only when the thread is unparked (no time passes under loom).
    pub fn park_timeout(_timeout: std::time::Duration) {
        loom::thread::park();
    }

    /// A spin that lets loom schedule another thread.
    pub fn spin_loop() {
        loom::thread::yield_now();
    }

    /// A backoff that is complete at once: waiting goes straight to the lock and
    /// condition variable, which loom explores (see the module docs).
    #[derive(Debug, Default)]
    pub struct Backoff;

    impl Backoff {
        /// A new backoff.
        pub fn new() -> Backoff {
            Backoff
        }
        /// Lets another thread run.
        pub fn snooze(&self) {
            loom::thread::yield_now();
        }
        /// Always complete.
        pub fn is_completed(&self) -> bool {
            true
        }
    }
}

pub use imp::*;

use std::sync::PoisonError;
use std::time::Duration;

/// Locks `mutex`, ignoring poisoning: no user code runs while one of the protocol's
/// locks is held (they guard `()` or a state that is only moved in and out), so a
/// poisoned lock protects nothing broken.
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Waits on `cond` for at most `timeout` (ignoring poisoning, as [`lock`] does). With
/// loom the wait is not timed: it ends on a notification, which loom explores.
pub fn wait_timeout<'a, T>(cond: &Condvar, guard: MutexGuard<'a, T>, timeout: Duration) -> MutexGuard<'a, T> {
    cond.wait_timeout(guard, timeout).unwrap_or_else(PoisonError::into_inner).0
}

/// The end of a timed wait.
///
/// With loom no time passes, so that every run of a model takes the same path: a zero
/// timeout has expired at once, and any other never expires.
#[derive(Clone, Copy, Debug)]
pub struct Deadline {
    #[cfg(not(loom))]
    at: Option<std::time::Instant>,
    #[cfg(loom)]
    zero: bool,
}

impl Deadline {
    /// `timeout` from now.
    pub fn after(timeout: Duration) -> Deadline {
        #[cfg(not(loom))]
        {
            // A timeout too long to represent never expires.
            Deadline { at: std::time::Instant::now().checked_add(timeout) }
        }
        #[cfg(loom)]
        {
            Deadline { zero: timeout.is_zero() }
        }
    }

    /// The time left, or `None` once the deadline has passed.
    pub fn remaining(&self) -> Option<Duration> {
        #[cfg(not(loom))]
        {
            match self.at {
                Some(at) => Some(at.saturating_duration_since(std::time::Instant::now())).filter(|d| !d.is_zero()),
                None => Some(Duration::MAX),
            }
        }
        #[cfg(loom)]
        {
            (!self.zero).then_some(Duration::MAX)
        }
    }
}

/// Waits on `cond` until notified (ignoring poisoning, as [`lock`] does).
pub fn wait<'a, T>(cond: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cond.wait(guard).unwrap_or_else(PoisonError::into_inner)
}

/// The time since a start, for what a protocol reports (how long a request waited).
/// With loom no time passes: it is always zero.
#[derive(Clone, Copy, Debug)]
pub struct Stopwatch {
    #[cfg(not(loom))]
    start: std::time::Instant,
}

impl Stopwatch {
    /// Started now.
    pub fn start() -> Stopwatch {
        Stopwatch {
            #[cfg(not(loom))]
            start: std::time::Instant::now(),
        }
    }

    /// The time since the start.
    pub fn elapsed(&self) -> Duration {
        #[cfg(not(loom))]
        {
            self.start.elapsed()
        }
        #[cfg(loom)]
        {
            Duration::ZERO
        }
    }
}
