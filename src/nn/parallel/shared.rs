//! [`SharedBuf`]: the trainer's one copy of the parameters (and of the updater's
//! state), read by every worker during forward and backward and written, range by
//! range, by each worker during the update.

use std::cell::UnsafeCell;
use std::ops::Range;
use std::sync::atomic::Ordering;

// The barrier's primitives are loom's under `--cfg loom` (its model: `src/nn/loom.rs`).
use async_iter::sync::{self, AtomicU64, Condvar, Mutex};

/// A buffer of `f32` that several threads read at once, or write in disjoint ranges, in
/// phases that the trainer's barriers separate.
///
/// Access goes through two `unsafe fn`s whose contracts are the phases: [`read`]
/// while nothing writes, [`range_mut`] for a range nothing else touches.
///
/// [`read`]: SharedBuf::read
/// [`range_mut`]: SharedBuf::range_mut
pub(crate) struct SharedBuf(Box<[UnsafeCell<f32>]>);

// SAFETY: the cells are only reached through `read` and `range_mut`, whose callers
// promise that no element is written while another thread reads or writes it; `f32` is
// `Send`.
unsafe impl Sync for SharedBuf {}

impl SharedBuf {
    pub(crate) fn new(values: Vec<f32>) -> SharedBuf {
        SharedBuf(values.into_iter().map(UnsafeCell::new).collect())
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// The values.
    ///
    /// # Safety
    ///
    /// No element may be written (through [`SharedBuf::range_mut`]) while the slice
    /// lives.
    pub(crate) unsafe fn read(&self) -> &[f32] {
        // SAFETY: `UnsafeCell<f32>` has the layout of `f32`; no element is written while
        // the slice lives (the caller's promise).
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast::<f32>(), self.0.len()) }
    }

    /// The values of `range`, to write.
    ///
    /// # Safety
    ///
    /// No other slice of the buffer that overlaps `range` (from `read` or `range_mut`)
    /// may live while this one does.
    ///
    /// # Panics
    ///
    /// When `range` is not within the buffer.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn range_mut(&self, range: Range<usize>) -> &mut [f32] {
        let cells = &self.0[range];
        // SAFETY: the cells give mutable access to their values (`UnsafeCell::get`); the
        // layout is that of `f32`; nothing else reaches this range while the slice lives
        // (the caller's promise).
        unsafe { std::slice::from_raw_parts_mut(UnsafeCell::raw_get(cells.as_ptr()), cells.len()) }
    }

    /// The values, through exclusive access.
    pub(crate) fn get_mut(&mut self) -> &mut [f32] {
        let len = self.0.len();
        // SAFETY: `&mut self` excludes every other access; the layout is that of `f32`.
        unsafe { std::slice::from_raw_parts_mut(UnsafeCell::raw_get(self.0.as_ptr()), len) }
    }
}

/// A barrier of `n` threads that any of them can break: every wait, pending or later,
/// then returns `false` at once. The trainer's workers meet at gates, so that a worker
/// that cannot go on (a panic in the middle of a reduction, a trainer that stops) never
/// leaves the others waiting.
///
/// A waiter spins a little on the generation before it sleeps: the workers of a step
/// arrive within microseconds of each other, and a futex wake-up costs more.
pub(crate) struct Gate {
    n: usize,
    state: Mutex<GateState>,
    turned: Condvar,
    /// The state's generation and broken flag, to spin on: `generation << 1 | broken`.
    seen: AtomicU64,
}

struct GateState {
    waiting: usize,
    generation: u64,
    broken: bool,
}

/// Spins of a waiter before it sleeps (under loom, one: each spin is a load loom
/// explores, and the sleeping path is the one that can go wrong).
const SPINS: u32 = if cfg!(loom) { 1 } else { 4000 };

impl Gate {
    pub(crate) fn new(n: usize) -> Gate {
        Gate {
            n,
            state: Mutex::new(GateState { waiting: 0, generation: 0, broken: false }),
            turned: Condvar::new(),
            seen: AtomicU64::new(0),
        }
    }

    /// Waits until all `n` threads wait; `false` when the gate is (or gets) broken.
    pub(crate) fn wait(&self) -> bool {
        let mut state = sync::lock(&self.state);
        if state.broken {
            return false;
        }
        state.waiting += 1;
        if state.waiting == self.n {
            state.waiting = 0;
            state.generation += 1;
            self.seen.store(state.generation << 1, Ordering::Release);
            self.turned.notify_all();
            return true;
        }
        let generation = state.generation;
        drop(state);
        for _ in 0..SPINS {
            let seen = self.seen.load(Ordering::Acquire);
            // The generation first: a gate that turned and then broke did turn.
            if seen >> 1 != generation {
                return true;
            }
            if seen & 1 == 1 {
                return false;
            }
            sync::spin_loop();
        }
        let mut state = sync::lock(&self.state);
        while state.generation == generation && !state.broken {
            state = sync::wait(&self.turned, state);
        }
        state.generation != generation
    }

    /// Breaks the gate for good.
    pub(crate) fn break_all(&self) {
        let mut state = sync::lock(&self.state);
        state.broken = true;
        self.seen.store(state.generation << 1 | 1, Ordering::Release);
        drop(state);
        self.turned.notify_all();
    }
}

/// A panic's message, the payload disposed of without unwinding again (a payload whose
/// drop panics is leaked).
pub(crate) fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    let message = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with no message".to_string());
    if let Err(again) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(payload))) {
        std::mem::forget(again);
    }
    message
}
