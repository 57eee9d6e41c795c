//! The synchronisation primitives of the hand-off, from std or, under `cfg(loom)`,
//! from loom.
//!
//! Everything the protocol in [`handoff`](crate::handoff) and the ring in
//! [`ring`](crate::ring) use to coordinate the two threads comes from here: atomics,
//! the lock and condition variable a waiting side parks on, the cells that hold slot
//! descriptors, thread spawning, and the deadline of the one timed wait (for the
//! producer thread to hand its state back). Under `--cfg loom` each of them is loom's, so
//! the model checker sees every atomic operation, lock, wait and cell access of the
//! very code that ships (the pattern of crossbeam's `primitive` and tokio's `loom`
//! modules).
//!
//! Two shapes differ from std and are given here on both sides:
//!
//! - [`UnsafeCell`] hands out *tracked* pointers ([`ConstPtr`], [`MutPtr`]): loom
//!   considers the cell accessed for as long as such a pointer lives, so a lease that
//!   holds a `ConstPtr` to its slot turns "the producer writes a slot the consumer
//!   still holds" into a model failure. With std they are plain raw pointers.
//! - [`Backoff`] is crossbeam's spin-then-yield backoff with std. Under loom it
//!   reports completion at once, so a waiting side goes straight to the lock and
//!   condition variable, which loom explores; spinning would only multiply the
//!   interleavings of the same loads.
//!
//! Statistics counters are not part of the protocol and use std atomics directly.

#[cfg(not(loom))]
mod imp {
    pub(crate) use crossbeam::utils::Backoff;
    pub(crate) use std::sync::atomic::AtomicUsize;
    pub(crate) use std::sync::{Arc, Condvar, Mutex, MutexGuard};
    pub(crate) use std::thread::JoinHandle;

    /// Spawns the producer thread.
    pub(crate) fn spawn<F, T>(f: F) -> std::io::Result<JoinHandle<T>>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        std::thread::Builder::new().name("carve-prefetch".into()).spawn(f)
    }

    /// A cell whose accesses loom can track; with std, a plain `UnsafeCell`.
    #[derive(Debug, Default)]
    pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

    impl<T> UnsafeCell<T> {
        pub(crate) fn new(value: T) -> UnsafeCell<T> {
            UnsafeCell(std::cell::UnsafeCell::new(value))
        }

        /// A shared access that lasts as long as the returned pointer.
        #[inline(always)]
        pub(crate) fn get(&self) -> ConstPtr<T> {
            ConstPtr(self.0.get())
        }

        /// A unique access that lasts as long as the returned pointer.
        #[inline(always)]
        pub(crate) fn get_mut(&self) -> MutPtr<T> {
            MutPtr(self.0.get())
        }

        /// A unique access for the duration of `f`.
        #[inline(always)]
        pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
            f(self.0.get())
        }
    }

    /// A shared access to an [`UnsafeCell`], until dropped.
    #[derive(Debug)]
    pub(crate) struct ConstPtr<T>(*const T);

    /// Dropping ends the access, as with loom's pointer (nothing to do with std).
    impl<T> Drop for ConstPtr<T> {
        fn drop(&mut self) {}
    }

    impl<T> ConstPtr<T> {
        /// # Safety
        ///
        /// No unique access to the cell may overlap the returned reference.
        #[inline(always)]
        pub(crate) unsafe fn deref(&self) -> &T {
            // SAFETY: the pointer comes from a live cell; the caller rules out a
            // concurrent unique access.
            unsafe { &*self.0 }
        }
    }

    /// A unique access to an [`UnsafeCell`], until dropped.
    #[derive(Debug)]
    pub(crate) struct MutPtr<T>(*mut T);

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
        pub(crate) unsafe fn deref(&self) -> &mut T {
            // SAFETY: the pointer comes from a live cell; the caller rules out any
            // overlapping access.
            unsafe { &mut *self.0 }
        }
    }
}

#[cfg(loom)]
mod imp {
    pub(crate) use loom::cell::{ConstPtr, MutPtr, UnsafeCell};
    pub(crate) use loom::sync::atomic::AtomicUsize;
    pub(crate) use loom::sync::{Arc, Condvar, Mutex, MutexGuard};
    pub(crate) use loom::thread::JoinHandle;

    /// Spawns the producer thread as a loom thread.
    pub(crate) fn spawn<F, T>(f: F) -> std::io::Result<JoinHandle<T>>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        loom::thread::Builder::new().name("carve-prefetch".into()).spawn(f)
    }

    /// A backoff that is complete at once: waiting goes straight to the lock and
    /// condition variable, which loom explores (see the module docs).
    #[derive(Debug, Default)]
    pub(crate) struct Backoff;

    impl Backoff {
        pub(crate) fn new() -> Backoff {
            Backoff
        }
        pub(crate) fn snooze(&self) {
            loom::thread::yield_now();
        }
        pub(crate) fn is_completed(&self) -> bool {
            true
        }
    }
}

pub(crate) use imp::*;

use std::sync::PoisonError;
use std::time::Duration;

/// Locks `mutex`, ignoring poisoning: no user code runs while one of the protocol's
/// locks is held (they guard `()` or a state that is only moved in and out), so a
/// poisoned lock protects nothing broken.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Waits on `cond` for at most `timeout` (ignoring poisoning, as [`lock`] does). With
/// loom the wait is not timed: it ends on a notification, which loom explores.
pub(crate) fn wait_timeout<'a, T>(cond: &Condvar, guard: MutexGuard<'a, T>, timeout: Duration) -> MutexGuard<'a, T> {
    cond.wait_timeout(guard, timeout).unwrap_or_else(PoisonError::into_inner).0
}

/// The end of a timed wait.
///
/// With loom no time passes, so that every run of a model takes the same path: a zero
/// timeout has expired at once, and any other never expires.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Deadline {
    #[cfg(not(loom))]
    at: Option<std::time::Instant>,
    #[cfg(loom)]
    zero: bool,
}

impl Deadline {
    /// `timeout` from now.
    pub(crate) fn after(timeout: Duration) -> Deadline {
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
    pub(crate) fn remaining(&self) -> Option<Duration> {
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
