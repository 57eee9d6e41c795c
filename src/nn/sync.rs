//! What the threads of `carve::nn` meet at: [`Gate`], a barrier any of them can break
//! (the trainer's workers and the matrix multiply's threads), [`Latch`], which a
//! thread that starts others waits on until they run (the inference pool's batch
//! workers), and [`panic_message`], the one way a caught panic becomes an error's
//! message.

use std::sync::atomic::Ordering;

// The barrier's primitives are loom's under `--cfg loom` (its model: `src/nn/loom.rs`).
use async_iter::sync::{self, AtomicU64, Condvar, Mutex};

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

/// A count of threads that have arrived, and a wait until `n` have: the thread that
/// starts `n` workers waits until each of them runs (a thread's start-up is then not
/// the first request's work). Arriving never blocks; a worker arrives once, first thing.
pub(crate) struct Latch {
    arrived: Mutex<usize>,
    changed: Condvar,
}

impl Latch {
    pub(crate) fn new() -> Latch {
        Latch { arrived: Mutex::new(0), changed: Condvar::new() }
    }

    /// One more thread has arrived.
    pub(crate) fn arrive(&self) {
        *sync::lock(&self.arrived) += 1;
        self.changed.notify_all();
    }

    /// Waits until `n` threads have arrived.
    pub(crate) fn wait_for(&self, n: usize) {
        let mut arrived = sync::lock(&self.arrived);
        while *arrived < n {
            arrived = sync::wait(&self.changed, arrived);
        }
    }
}

/// A panic's message, the payload disposed of without unwinding again (a payload whose
/// drop panics is dropped quietly: see [`async_iter::panics::drop_quietly`]).
pub(crate) fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    let message = async_iter::panics::panic_message(&*payload);
    async_iter::panics::drop_quietly(payload);
    message
}
