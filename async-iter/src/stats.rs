//! Statistics of a prefetcher: the ring's size and growth, batches on each side, and
//! how long each side waited for the other.
//!
//! The counters are relaxed std atomics, written by the side that owns each figure
//! and read by [`Prefetcher::stats`](crate::Prefetcher::stats) at any time; they are
//! not part of the hand-off protocol and need no ordering.

use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use crossbeam::utils::CachePadded;
use serde::Serialize;

use crate::error::SourceCall;

/// The live counters, one cache line per writer so that neither side's counting
/// disturbs the other's cache.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) producer: CachePadded<ProducerCounters>,
    pub(crate) consumer: CachePadded<ConsumerCounters>,
}

/// Written by the producer (and its ring).
#[derive(Debug, Default)]
pub(crate) struct ProducerCounters {
    pub(crate) ring_bytes: AtomicUsize,
    pub(crate) slot_bytes: AtomicUsize,
    pub(crate) first_batch_bytes: AtomicUsize,
    pub(crate) ring_growths: AtomicU64,
    pub(crate) produced: AtomicU64,
    pub(crate) wait_ns: AtomicU64,
    /// Where the producer is, for the message of a producer that does not stop: the
    /// batch index shifted left by 2, or'ed with the call into the source in progress
    /// (0 for none, see [`Position`]).
    pub(crate) position: AtomicU64,
}

/// The call of the source the producer is in, and at which batch; written by the
/// producer around every call, read only to explain a producer that did not stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Position {
    pub(crate) call: Option<SourceCall>,
    pub(crate) batch: usize,
}

impl Position {
    fn encode(self) -> u64 {
        let call = match self.call {
            None => 0,
            Some(SourceCall::NextLayout) => 1,
            Some(SourceCall::Fill) => 2,
            Some(_) => 3,
        };
        (self.batch as u64) << 2 | call
    }

    fn decode(word: u64) -> Position {
        let call = match word & 3 {
            0 => None,
            1 => Some(SourceCall::NextLayout),
            2 => Some(SourceCall::Fill),
            _ => Some(SourceCall::Reset),
        };
        Position { call, batch: usize::try_from(word >> 2).unwrap_or(usize::MAX) }
    }
}

impl ProducerCounters {
    /// Notes where the producer is (a relaxed store: diagnostics, not protocol).
    #[inline]
    pub(crate) fn set_position(&self, position: Position) {
        self.position.store(position.encode(), Ordering::Relaxed);
    }

    pub(crate) fn position(&self) -> Position {
        Position::decode(self.position.load(Ordering::Relaxed))
    }
}

/// Written by the consumer.
#[derive(Debug, Default)]
pub(crate) struct ConsumerCounters {
    pub(crate) consumed: AtomicU64,
    pub(crate) wait_ns: AtomicU64,
}

/// Adds one to a counter that only the calling side writes: a plain load and store,
/// as no other writer can interleave, instead of a locked read-modify-write per batch.
pub(crate) fn bump(counter: &AtomicU64) {
    counter.store(counter.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
}

/// Adds `waited` to a nanosecond counter.
pub(crate) fn add_wait(counter: &AtomicU64, waited: Duration) {
    counter.fetch_add(u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
}

/// A snapshot of a prefetcher's statistics; printable as a table and serialisable.
///
/// ```
/// # use async_iter::{BatchLayout, BatchMut, BatchSource, Prefetcher, SourceError};
/// # struct Three;
/// # impl BatchSource for Three {
/// #     fn next_layout(&mut self, i: usize) -> Result<Option<BatchLayout>, SourceError> {
/// #         Ok((i < 3).then(|| BatchLayout::new().features::<f32, _>(100)))
/// #     }
/// #     fn fill(&mut self, _: &mut BatchMut<'_>) -> Result<(), SourceError> { Ok(()) }
/// # }
/// let mut batches = Prefetcher::builder(Three).depth(2).build()?;
/// while let Some(batch) = batches.next() {
///     batch?;
/// }
/// let stats = batches.stats();
/// assert_eq!((stats.batches_produced, stats.batches_consumed), (3, 3));
/// assert_eq!(stats.first_batch_bytes, 448);     // 400 bytes, rounded up to 64
/// assert_eq!(stats.ring_bytes, 3 * 448);        // depth + 1 slots
/// assert_eq!(stats.ring_growths, 0);
/// println!("{stats}");
/// # Ok::<(), async_iter::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize)]
#[non_exhaustive]
pub struct PrefetchStats {
    /// `"background"` or `"shield"`.
    pub threading: &'static str,
    /// `"enabled"` (batches in the ring) or `"none"` (a heap allocation per batch).
    pub workspace_mode: &'static str,
    /// Batches the producer may have ready or in progress ahead of the one the consumer holds.
    pub depth: usize,
    /// Slots of the ring: `depth + 1` (the consumer holds one).
    pub slots: usize,
    /// Bytes of the ring now (0 before the first batch, and with `WorkspaceMode::None`).
    pub ring_bytes: usize,
    /// Bytes of one slot now.
    pub slot_bytes: usize,
    /// Bytes of the first batch, which sized the ring.
    pub first_batch_bytes: usize,
    /// Times a batch larger than a slot grew the ring (the first sizing is not counted).
    pub ring_growths: u64,
    /// The current epoch (0 for the first; `reset()` counts up).
    pub epoch: u64,
    /// Batches filled and published by the producer, over all epochs.
    pub batches_produced: u64,
    /// Batches handed to the consumer, over all epochs.
    pub batches_consumed: u64,
    /// Time the consumer waited in `next()` for a batch, in nanoseconds. Each wait is
    /// timed from the end of its first spins, so waits under about a microsecond are
    /// not counted.
    pub consumer_wait_ns: u64,
    /// Time the producer waited for a free slot, in nanoseconds (timed the same way).
    pub producer_wait_ns: u64,
}

impl PrefetchStats {
    pub(crate) fn snapshot(
        counters: &Counters,
        threading: &'static str,
        workspace_mode: &'static str,
        depth: usize,
        epoch: u64,
    ) -> PrefetchStats {
        let load64 = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let load = |c: &AtomicUsize| c.load(Ordering::Relaxed);
        let (producer, consumer) = (&counters.producer, &counters.consumer);
        PrefetchStats {
            threading,
            workspace_mode,
            depth,
            slots: depth + 1,
            ring_bytes: load(&producer.ring_bytes),
            slot_bytes: load(&producer.slot_bytes),
            first_batch_bytes: load(&producer.first_batch_bytes),
            ring_growths: load64(&producer.ring_growths),
            epoch,
            batches_produced: load64(&producer.produced),
            batches_consumed: load64(&consumer.consumed),
            consumer_wait_ns: load64(&consumer.wait_ns),
            producer_wait_ns: load64(&producer.wait_ns),
        }
    }

    /// [`consumer_wait_ns`](Self::consumer_wait_ns) as a `Duration`.
    pub fn consumer_wait(&self) -> Duration {
        Duration::from_nanos(self.consumer_wait_ns)
    }

    /// [`producer_wait_ns`](Self::producer_wait_ns) as a `Duration`.
    pub fn producer_wait(&self) -> Duration {
        Duration::from_nanos(self.producer_wait_ns)
    }
}

impl fmt::Display for PrefetchStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |ns: u64| ns as f64 / 1e6;
        writeln!(f, "| prefetcher | value |")?;
        writeln!(f, "|---|---:|")?;
        writeln!(f, "| threading / workspaces | {} / {} |", self.threading, self.workspace_mode)?;
        writeln!(f, "| depth (slots) | {} ({}) |", self.depth, self.slots)?;
        writeln!(f, "| ring bytes (per slot) | {} ({}) |", self.ring_bytes, self.slot_bytes)?;
        writeln!(f, "| first batch bytes | {} |", self.first_batch_bytes)?;
        writeln!(f, "| ring growths | {} |", self.ring_growths)?;
        writeln!(f, "| epoch | {} |", self.epoch)?;
        writeln!(f, "| batches produced / consumed | {} / {} |", self.batches_produced, self.batches_consumed)?;
        writeln!(f, "| consumer waited | {:.3} ms |", ms(self.consumer_wait_ns))?;
        write!(f, "| producer waited | {:.3} ms |", ms(self.producer_wait_ns))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_read_the_counters_and_print() {
        let counters = Counters::default();
        counters.producer.ring_bytes.store(3 * 128, Ordering::Relaxed);
        counters.producer.produced.store(5, Ordering::Relaxed);
        add_wait(&counters.consumer.wait_ns, Duration::from_micros(1500));
        let stats = PrefetchStats::snapshot(&counters, "background", "enabled", 2, 1);
        assert_eq!((stats.slots, stats.ring_bytes, stats.batches_produced), (3, 384, 5));
        assert_eq!(stats.consumer_wait(), Duration::from_micros(1500));
        let table = stats.to_string();
        assert!(table.contains("| ring bytes (per slot) | 384 (0) |"), "{table}");
        assert!(table.contains("| consumer waited | 1.500 ms |"), "{table}");
        let json = serde_json::to_value(&stats).unwrap();
        assert_eq!(json["ring_bytes"], 384);
        assert_eq!(json["threading"], "background");
    }

    #[test]
    fn positions_round_trip() {
        let counters = ProducerCounters::default();
        assert_eq!(counters.position(), Position { call: None, batch: 0 });
        for call in [None, Some(SourceCall::NextLayout), Some(SourceCall::Fill), Some(SourceCall::Reset)] {
            let position = Position { call, batch: 12345 };
            counters.set_position(position);
            assert_eq!(counters.position(), position);
        }
    }
}
