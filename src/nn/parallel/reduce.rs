//! The [`Reducer`] seam: how the workers' gradient buckets become one sum, and how the
//! workers agree on each step's outcome.

use std::ops::Range;
use std::sync::atomic::Ordering;

// The reduction's primitives are loom's under `--cfg loom` (its model: `src/nn/loom.rs`).
use async_iter::sync::{self, Arc, AtomicPtr, AtomicUsize, Mutex};

use super::super::sync::Gate;

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
/// it with contiguous `&mut [f32]` buckets of each worker's gradients (ranges of its
/// plan, where backward wrote them), in the same order in every worker.
///
/// Every implementation sums element by element **in rank order**, `((b₀ + b₁) + b₂) +
/// …`, so that every reducer (and the trainer's single-thread shard mode) gives the same
/// bits. [`Reducer::reduce`] returns the range of the bucket that holds the sum, and the
/// trainer updates the parameters of that range: the whole bucket when each worker holds
/// its own parameters (a process, with MPI); the workers of one process that share their
/// parameters (threads) each return their share, `r`-th of `workers` ranges cut at
/// multiples of 16 values, which the trainer checks.
///
/// Calls are collective: every worker makes the same calls in the same order, and a
/// worker that fails still takes part (it reports its failure through
/// [`Reducer::exchange`]), so that no call waits for ever. A worker that cannot finish a
/// step's calls (a panic in the middle of them) calls [`Reducer::abandon`]. Implementations
/// that talk to other processes bound each wait and return [`Error::Reduction`] when a
/// peer does not answer.
pub trait Reducer: Send {
    /// The number of workers (ranks `0..workers`).
    fn workers(&self) -> usize;

    /// This worker's rank.
    fn rank(&self) -> usize;

    /// A short name for reports ("threads", "mpi").
    fn name(&self) -> &'static str {
        "custom"
    }

    /// Sums `bucket` over the workers, in rank order; returns the range of `bucket` that
    /// holds the sum on return.
    ///
    /// # Errors
    ///
    /// [`Error::Reduction`]: a peer that does not answer in time, a bucket of another
    /// length than the others', a group abandoned by a worker.
    fn reduce(&mut self, bucket: &mut [f32]) -> Result<Range<usize>>;

    /// Exchanges the workers' reports: `all[r]` is rank `r`'s on return.
    ///
    /// # Errors
    ///
    /// As [`Reducer::reduce`].
    fn exchange(&mut self, mine: Report, all: &mut [Report]) -> Result<()>;

    /// Gives up this step's remaining calls: every other worker's pending and later calls
    /// fail (or time out) instead of waiting for this one. The group is not used again.
    fn abandon(&mut self) {}

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
    gate: Gate,
    /// Workers that may be reading other workers' buckets: counted in before the gate of
    /// a reduction, out after its reads (or when the gate fails). A worker that abandons
    /// waits for none before its buckets may go.
    reading: AtomicUsize,
    /// Each worker's current bucket, double-buffered by the parity of the call (a worker
    /// publishes call `k + 2` only after every worker has passed call `k + 1`'s gate, so
    /// after every worker has finished reading call `k`'s pointers).
    buckets: [Box<[AtomicPtr<f32>]>; 2],
    lengths: [Box<[AtomicUsize]>; 2],
    reports: [Mutex<Box<[Report]>>; 2],
}

/// A worker counted among the readers of the others' buckets until this drops (at the
/// end of its reads, or on an early return).
struct Reading<'g>(&'g AtomicUsize);

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The buckets of the other workers, read during one call.
struct Peers(Vec<*const f32>);

// SAFETY: the pointers are only dereferenced inside `Threads::reduce`, under the
// contract written there; between calls they are stale values that nothing reads.
unsafe impl Send for Peers {}

/// Threads of one process: a reduce-scatter through shared memory. Worker `r` sums its
/// share (the `r`-th of `workers` ranges, cut at multiples of 16 elements) of every
/// worker's bucket, in rank order, into its own bucket, reading the others' buckets
/// where their backward passes wrote them: nothing is copied.
pub(crate) struct Threads {
    group: Arc<Group>,
    rank: usize,
    calls: usize,
    exchanges: usize,
    peers: Peers,
}

impl Threads {
    /// The reducers of `workers` threads, rank 0 first.
    pub(crate) fn group(workers: usize) -> Vec<Threads> {
        let slots = || (0..workers).map(|_| AtomicPtr::new(std::ptr::null_mut())).collect::<Box<[_]>>();
        let lengths = || (0..workers).map(|_| AtomicUsize::new(0)).collect::<Box<[_]>>();
        let group = Arc::new(Group {
            gate: Gate::new(workers),
            reading: AtomicUsize::new(0),
            buckets: [slots(), slots()],
            lengths: [lengths(), lengths()],
            reports: [(); 2].map(|_| Mutex::new(vec![Report::default(); workers].into_boxed_slice())),
        });
        (0..workers)
            .map(|rank| Threads {
                group: Arc::clone(&group),
                rank,
                calls: 0,
                exchanges: 0,
                peers: Peers(vec![std::ptr::null(); workers]),
            })
            .collect()
    }

    fn meet(&self) -> Result<()> {
        match self.group.gate.wait() {
            true => Ok(()),
            false => Err(Error::Reduction {
                message: "a worker abandoned the reduction in the middle of a step (it panicked outside its layers); \
                          this trainer cannot train on, into_network() gives back the weights of its last whole step"
                    .into(),
            }),
        }
    }
}

/// The `rank`-th of `workers` shares of `len` elements, cut at multiples of 16.
pub(crate) fn share(len: usize, workers: usize, rank: usize) -> Range<usize> {
    let blocks = len.div_ceil(16);
    let cut = |r: usize| (blocks * r / workers * 16).min(len);
    cut(rank)..cut(rank + 1)
}

/// Values summed at a time: one block of partial sums stays in registers or L1.
const CHUNK: usize = 256;

impl Reducer for Threads {
    fn workers(&self) -> usize {
        self.group.buckets[0].len()
    }

    fn name(&self) -> &'static str {
        "threads"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn reduce(&mut self, bucket: &mut [f32]) -> Result<Range<usize>> {
        let parity = self.calls % 2;
        self.calls += 1;
        let workers = self.workers();
        let (slots, lengths) = (&self.group.buckets[parity], &self.group.lengths[parity]);
        let own = bucket.as_mut_ptr();
        slots[self.rank].store(own, Ordering::Release);
        lengths[self.rank].store(bucket.len(), Ordering::Release);
        self.group.reading.fetch_add(1, Ordering::AcqRel);
        let reading = Reading(&self.group.reading);
        self.meet()?;
        if let Some(other) = (0..workers).find(|&w| lengths[w].load(Ordering::Acquire) != bucket.len()) {
            return Err(Error::Reduction {
                message: format!(
                    "worker {other}'s bucket holds {} values and worker {}'s {}; every worker must reduce the same \
                     buckets",
                    lengths[other].load(Ordering::Acquire),
                    self.rank,
                    bucket.len()
                ),
            });
        }
        for (peer, slot) in self.peers.0.iter_mut().zip(slots.iter()) {
            *peer = slot.load(Ordering::Acquire).cast_const();
        }
        let mine = share(bucket.len(), workers, self.rank);
        let mut sums = [0.0f32; CHUNK];
        let mut at = mine.start;
        while at < mine.end {
            let n = CHUNK.min(mine.end - at);
            let sums = &mut sums[..n];
            // Rank order, ((b₀ + b₁) + b₂) + …, a block at a time: this worker's own values
            // are read in their turn before the block's sums are written over them.
            // SAFETY: every worker published a bucket of `bucket.len()` values (checked
            // above) before the gate and keeps it alive, unwritten but for its own share,
            // until the trainer's next collective call, which no worker makes before
            // finishing this one; `at..at + n` is within this worker's share `mine`, which
            // only this worker reads or writes while the others read theirs.
            unsafe {
                sums.copy_from_slice(std::slice::from_raw_parts(self.peers.0[0].add(at), n));
                for &peer in &self.peers.0[1..workers] {
                    for (sum, &value) in sums.iter_mut().zip(std::slice::from_raw_parts(peer.add(at), n)) {
                        *sum += value;
                    }
                }
                std::ptr::copy_nonoverlapping(sums.as_ptr(), own.add(at), n);
            }
            at += n;
        }
        drop(reading);
        Ok(mine)
    }

    fn exchange(&mut self, mine: Report, all: &mut [Report]) -> Result<()> {
        // Double-buffered by the exchange's parity: a worker writes exchange k + 2's
        // reports only after passing exchange k + 1's gate, so after every worker has
        // read exchange k's.
        let parity = self.exchanges % 2;
        self.exchanges += 1;
        sync::lock(&self.group.reports[parity])[self.rank] = mine;
        self.meet()?;
        all.copy_from_slice(&sync::lock(&self.group.reports[parity]));
        Ok(())
    }

    fn abandon(&mut self) {
        self.group.gate.break_all();
        // This worker's buckets may go once nobody reads them: the others' reads end
        // within their current call (the gate is broken: no new one starts).
        while self.group.reading.load(Ordering::Acquire) != 0 {
            sync::yield_now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_sum_in_rank_order_and_return_their_share() {
        let mut group = Threads::group(3);
        let results = std::thread::scope(|s| {
            let handles: Vec<_> = group
                .iter_mut()
                .enumerate()
                .map(|(rank, reducer)| {
                    s.spawn(move || {
                        let mut bucket: Vec<f32> = (0..100).map(|i| (i * (rank + 1)) as f32 + 0.25).collect();
                        let range = reducer.reduce(&mut bucket).unwrap();
                        let sums = bucket[range.clone()].to_vec();
                        // The others read this bucket until the next collective call.
                        let mut all = [Report::default(); 3];
                        reducer.exchange(Report::default(), &mut all).unwrap();
                        drop(bucket);
                        (range, sums)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
        });
        let mut covered = 0;
        for (rank, (range, values)) in results.iter().enumerate() {
            assert_eq!(*range, share(100, 3, rank));
            for (i, v) in range.clone().zip(values) {
                let expected = ((i as f32 + 0.25) + (2 * i) as f32 + 0.25) + ((3 * i) as f32 + 0.25);
                assert_eq!(v.to_bits(), expected.to_bits(), "value {i}");
            }
            covered += range.len();
        }
        assert_eq!(covered, 100);
    }

    #[test]
    fn a_worker_that_abandons_frees_the_others_at_once() {
        let mut group = Threads::group(3);
        let mut quitter = group.pop().unwrap();
        std::thread::scope(|s| {
            let waiting: Vec<_> = group
                .iter_mut()
                .map(|reducer| {
                    s.spawn(move || {
                        let mut bucket = vec![1.0f32; 64];
                        let reduced = reducer.reduce(&mut bucket).map(|_| ());
                        let mut all = [Report::default(); 3];
                        let exchanged = reducer.exchange(Report::default(), &mut all);
                        (reduced, exchanged)
                    })
                })
                .collect();
            quitter.abandon();
            for handle in waiting {
                let (reduced, exchanged) = handle.join().unwrap();
                assert!(matches!(reduced, Err(Error::Reduction { .. })), "{reduced:?}");
                assert!(matches!(exchanged, Err(Error::Reduction { .. })), "{exchanged:?}");
            }
        });
    }

    #[test]
    fn buckets_of_different_lengths_are_an_error_on_every_worker() {
        let mut group = Threads::group(2);
        let results = std::thread::scope(|s| {
            let handles: Vec<_> = group
                .iter_mut()
                .enumerate()
                .map(|(rank, reducer)| {
                    s.spawn(move || {
                        let mut bucket = vec![1.0f32; 32 + rank];
                        let result = reducer.reduce(&mut bucket).map(|_| ());
                        let mut all = [Report::default(); 2];
                        reducer.exchange(Report::default(), &mut all).unwrap();
                        result
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
        });
        for result in results {
            let err = result.unwrap_err();
            assert!(err.to_string().contains("every worker must reduce the same buckets"), "{err}");
        }
    }
}
