//! The [`Reducer`] seam: how the workers' gradient buckets become one sum, and how the
//! workers agree on each step's outcome.

use std::ops::Range;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex, PoisonError};

use crate::{Error, Result};

/// What a worker tells the others at the end of its forward and backward pass, and after
/// checking its share of the update: what its shard's loss adds up to, and whether it
/// failed.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C)]
pub struct Report {
    /// The sum of the cross-entropies of the shard's counted rows (`f64`, in row order).
    pub loss_sum: f64,
    /// 0 when the worker succeeded; otherwise 1 + the index of the layer it failed in
    /// (the number of layers + 1 for a failure outside any layer: the input, the loss,
    /// the update).
    pub status: u64,
}

/// How the workers of a data-parallel trainer reduce their gradients: the trainer calls
/// it with contiguous `&mut [f32]` buckets of each worker's gradients, in the same order
/// in every worker.
///
/// Every implementation sums element by element **in rank order**, `((b₀ + b₁) + b₂) +
/// …`, so that every reducer (and the trainer's single-thread shard mode) gives the same
/// bits. An implementation may leave the sum in part of the bucket only (its rank's
/// share, for a reduce-scatter): the trainer updates the parameters of the range
/// [`Reducer::reduce`] returns, and every range is returned by exactly one worker when
/// the workers share their parameters ([`Reducer::shares_parameters`]), or by every
/// worker (the whole bucket) when each holds its own copy.
///
/// Calls are collective: every worker makes the same calls in the same order, and a
/// worker that fails still takes part (it reports its failure through
/// [`Reducer::exchange`]), so that no call waits for ever. Implementations that talk to
/// other processes bound each wait and return an error when a peer does not answer.
pub trait Reducer: Send {
    /// The number of workers (ranks `0..workers`).
    fn workers(&self) -> usize;

    /// This worker's rank.
    fn rank(&self) -> usize;

    /// Whether the workers share one copy of the parameters (threads of a process), so
    /// that each updates only the ranges it reduced; otherwise each worker holds a copy
    /// and updates all of it (processes).
    fn shares_parameters(&self) -> bool;

    /// Sums `bucket` over the workers, in rank order; returns the range of `bucket` that
    /// holds the sum on return.
    ///
    /// # Errors
    ///
    /// A peer that does not answer in time; a bucket of another length than the others'.
    fn reduce(&mut self, bucket: &mut [f32]) -> Result<Range<usize>>;

    /// Exchanges the workers' reports: `all[r]` is rank `r`'s on return.
    ///
    /// # Errors
    ///
    /// As [`Reducer::reduce`].
    fn exchange(&mut self, mine: Report, all: &mut [Report]) -> Result<()>;

    /// Bytes this reducer copied out of the gradient buckets before reducing them (into
    /// staging buffers), over its life: 0 for the reducers of this crate, which read the
    /// buckets where backward wrote them.
    fn bytes_copied(&self) -> u64 {
        0
    }
}

/// The reducer of a single worker: the sum over one worker is its bucket.
#[derive(Debug, Default)]
pub(crate) struct Alone;

impl Reducer for Alone {
    fn workers(&self) -> usize {
        1
    }

    fn rank(&self) -> usize {
        0
    }

    fn shares_parameters(&self) -> bool {
        true
    }

    fn reduce(&mut self, bucket: &mut [f32]) -> Result<Range<usize>> {
        Ok(0..bucket.len())
    }

    fn exchange(&mut self, mine: Report, all: &mut [Report]) -> Result<()> {
        all[0] = mine;
        Ok(())
    }
}

/// What the threads of one process share to reduce.
struct Group {
    barrier: Barrier,
    /// Each worker's current bucket, double-buffered by the parity of the call (a worker
    /// publishes call `k + 2` only after every worker has passed call `k + 1`'s barrier,
    /// so after every worker has finished reading call `k`'s pointers).
    buckets: [Box<[AtomicPtr<f32>]>; 2],
    lengths: [Box<[AtomicUsize]>; 2],
    reports: Mutex<Box<[Report]>>,
}

/// Threads of one process: a reduce-scatter through shared memory. Worker `r` sums its
/// share (the `r`-th of `workers` ranges, cut at multiples of 16 elements) of every
/// worker's bucket, in rank order, into its own bucket, reading the others' buckets
/// where their backward passes wrote them: nothing is copied.
pub(crate) struct Threads {
    group: Arc<Group>,
    rank: usize,
    calls: usize,
}

impl Threads {
    /// The reducers of `workers` threads, rank 0 first.
    pub(crate) fn group(workers: usize) -> Vec<Threads> {
        let slots = || (0..workers).map(|_| AtomicPtr::new(std::ptr::null_mut())).collect::<Box<[_]>>();
        let lengths = || (0..workers).map(|_| AtomicUsize::new(0)).collect::<Box<[_]>>();
        let group = Arc::new(Group {
            barrier: Barrier::new(workers),
            buckets: [slots(), slots()],
            lengths: [lengths(), lengths()],
            reports: Mutex::new(vec![Report::default(); workers].into_boxed_slice()),
        });
        (0..workers).map(|rank| Threads { group: Arc::clone(&group), rank, calls: 0 }).collect()
    }
}

/// The `rank`-th of `workers` shares of `len` elements, cut at multiples of 16.
pub(crate) fn share(len: usize, workers: usize, rank: usize) -> Range<usize> {
    let blocks = len.div_ceil(16);
    let cut = |r: usize| (blocks * r / workers * 16).min(len);
    cut(rank)..cut(rank + 1)
}

impl Reducer for Threads {
    fn workers(&self) -> usize {
        self.group.buckets[0].len()
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn shares_parameters(&self) -> bool {
        true
    }

    #[allow(unsafe_code)]
    fn reduce(&mut self, bucket: &mut [f32]) -> Result<Range<usize>> {
        let parity = self.calls % 2;
        self.calls += 1;
        let workers = self.workers();
        let (slots, lengths) = (&self.group.buckets[parity], &self.group.lengths[parity]);
        slots[self.rank].store(bucket.as_mut_ptr(), Ordering::Release);
        lengths[self.rank].store(bucket.len(), Ordering::Release);
        self.group.barrier.wait();
        if let Some(other) = (0..workers).find(|&w| lengths[w].load(Ordering::Acquire) != bucket.len()) {
            return Err(Error::InvalidInput(format!(
                "data-parallel reduction: worker {other}'s bucket holds {} values and worker {}'s {}; every worker \
                 must reduce the same buckets",
                lengths[other].load(Ordering::Acquire),
                self.rank,
                bucket.len()
            )));
        }
        let mine = share(bucket.len(), workers, self.rank);
        let own = bucket.as_mut_ptr();
        for i in mine.clone() {
            // Rank order, ((b₀ + b₁) + b₂) + …, in a register: this worker's own values
            // are read in their turn before the sum is written over them.
            // SAFETY: every worker published a bucket of `bucket.len()` values (checked
            // above) before the barrier and keeps it alive, unwritten but for its own
            // share, until the trainer's next collective call, which no worker makes
            // before finishing this one; this worker writes only its own share `mine` of
            // its own bucket, which no other worker reads or writes.
            unsafe {
                let mut sum = *slots[0].load(Ordering::Acquire).add(i);
                for slot in &slots[1..workers] {
                    sum += *slot.load(Ordering::Acquire).add(i);
                }
                *own.add(i) = sum;
            }
        }
        Ok(mine)
    }

    fn exchange(&mut self, mine: Report, all: &mut [Report]) -> Result<()> {
        self.group.reports.lock().unwrap_or_else(PoisonError::into_inner)[self.rank] = mine;
        self.group.barrier.wait();
        all.copy_from_slice(&self.group.reports.lock().unwrap_or_else(PoisonError::into_inner));
        // Nobody writes the next reports before everyone has read these.
        self.group.barrier.wait();
        Ok(())
    }
}
