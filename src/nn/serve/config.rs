//! An [`InferencePool`](super::InferencePool)'s settings: how many arenas, direct or
//! batched, the batches' bounds, and whether requests run on their arena's own stack.

use std::time::Duration;

/// How an [`InferencePool`](super::InferencePool) runs requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolMode {
    /// Each request runs alone, on the caller's thread, in an arena leased for it
    /// (DL4J's `ParallelInference` `SEQUENTIAL`, without a copy of the weights per
    /// worker). Its layers run on the caller's stack, or on the arena's own with
    /// [`PoolConfig::arena_stacks`].
    Direct,
    /// Requests from many callers are coalesced, up to `max_batch` rows or `max_wait`
    /// after the oldest arrived, run as one inference by the pool's worker threads, and
    /// scattered back (DL4J's `BATCHED`). A request's result is the same, bit for bit,
    /// as alone. Flat rows only: a sequence model is served in direct mode.
    Batched,
}

/// An [`InferencePool`](super::InferencePool)'s settings.
///
/// ```
/// use std::time::Duration;
/// use carve::nn::{serve::PoolConfig, serve::PoolMode};
///
/// let config = PoolConfig::batched(4, 64, Duration::from_micros(200)).with_arena_stacks(true);
/// assert_eq!((config.workers, config.mode, config.arena_stacks), (4, PoolMode::Batched, true));
/// assert!(!PoolConfig::default().arena_stacks);
/// ```
#[derive(Clone, Debug)]
pub struct PoolConfig {
    /// Arenas (K): the requests that run at once. The machine's cores are a good
    /// choice; more callers than K wait their turn, and memory stays K × the plan.
    pub workers: usize,
    /// Direct or batched.
    pub mode: PoolMode,
    /// Batched: the most rows one inference runs. A request of more rows is split
    /// across batches (its rows in order), never refused for its size.
    pub max_batch: usize,
    /// Batched: how long the oldest waiting request may wait for others to join it.
    /// Zero (the default): a worker takes what is queued as soon as it is free, so
    /// batches form from the requests that arrived while the workers were busy (large
    /// under load, single requests when idle, never a wait for company); more trades
    /// latency at low load for larger batches.
    pub max_wait: Duration,
    /// Batched: the most rows waiting before `try_output` refuses
    /// ([`Error::PoolBusy`](crate::Error::PoolBusy)); waiting callers are never refused,
    /// nor a request that finds nothing waiting, whatever its rows. At least 1.
    pub max_queued_rows: usize,
    /// Whether a request's layers run on a call stack of its arena's own (a 2 MiB
    /// mapping with a guard page per arena, switched to with `psm::on_stack`) rather
    /// than on the stack of the thread that runs it. Off by default: a request runs on
    /// its caller's stack (direct) or its worker's (batched), as any function call does.
    /// On, the stack pages a direct request touches belong to one of the K arenas
    /// whatever the number of callers, so that the pages of a caller's thread are those
    /// of an idle thread; the price is a stack switch per request and a mapping per
    /// arena. A layer that needs more than 2 MiB of stack overflows an arena's stack
    /// (the guard page ends the process, as a thread's stack overflow does).
    pub arena_stacks: bool,
}

impl PoolConfig {
    /// Direct mode with `workers` arenas.
    pub fn direct(workers: usize) -> PoolConfig {
        PoolConfig { workers, mode: PoolMode::Direct, ..PoolConfig::default() }
    }

    /// Batched mode with `workers` arenas (and worker threads), batches of at most
    /// `max_batch` rows, and a request waiting at most `max_wait` for others.
    pub fn batched(workers: usize, max_batch: usize, max_wait: Duration) -> PoolConfig {
        PoolConfig { workers, mode: PoolMode::Batched, max_batch, max_wait, ..PoolConfig::default() }
    }

    /// These settings with [`PoolConfig::arena_stacks`] set to `on`.
    pub fn with_arena_stacks(self, on: bool) -> PoolConfig {
        PoolConfig { arena_stacks: on, ..self }
    }
}

impl Default for PoolConfig {
    /// Direct, one arena per core; batches of up to 32 rows, taken as soon as a worker
    /// is free; requests on their callers' stacks.
    fn default() -> PoolConfig {
        PoolConfig {
            workers: std::thread::available_parallelism().map_or(1, |n| n.get()),
            mode: PoolMode::Direct,
            max_batch: 32,
            max_wait: Duration::ZERO,
            max_queued_rows: 4096,
            arena_stacks: false,
        }
    }
}
