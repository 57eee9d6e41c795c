//! [`Mpi`]: the [`Reducer`] of one worker per MPI process (the cargo feature `mpi`).
//!
//! **Order.** A bucket of `L` values is cut into the same shares as the threads' (the
//! `r`-th of `P` ranges at multiples of 16 values). An all-to-all sends each rank its
//! share of every rank's bucket, read from the bucket where backward wrote it (nothing is
//! copied out first); rank `r` adds the `P` pieces of its share in rank order, `((b₀ +
//! b₁) + b₂) + …`, the threads' arithmetic; an all-gather gives every rank every sum. So
//! `P` processes give the bits of `P` threads, and the bits do not depend on the MPI
//! library's own reduction order (no `MPI_Allreduce` is used).
//!
//! **Bounded waits.** Every collective is nonblocking (`MPI_Ialltoallv`,
//! `MPI_Iallgatherv`), polled against a deadline ([`Mpi::timeout`], 60 s by default):
//! a peer that does not answer in time ends the job: the waiting rank says why on stderr
//! and calls `MPI_Abort` (MPI cannot cancel a collective call, and its buffers are the
//! worker's gradient buckets, so no error can be returned while it may still write them).
//! A peer that dies is usually noticed sooner by `mpirun`, which ends the whole job.

use std::ops::Range;
use std::time::{Duration, Instant};

use mpi::datatype::{Partition, PartitionMut};
use mpi::environment::Universe;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;
use mpi::Threading;

use crate::{Error, Result};

use super::reduce::{share, Reducer, Report};

/// The reducer of one worker per MPI process.
///
/// **Order.** A bucket is cut into the threads' shares (the `r`-th of `P` ranges at
/// multiples of 16 values); an all-to-all sends each rank its share of every rank's
/// bucket, read where backward wrote it; rank `r` adds the `P` pieces in rank order, an
/// all-gather gives every rank every sum. So `P` processes give the bits of `P` threads;
/// no `MPI_Allreduce` (whose order is the library's) is used.
///
/// **Bounded waits.** Every collective is nonblocking, polled against a deadline
/// ([`Mpi::timeout`]; `CARVE_MPI_TIMEOUT_MS`, 60 s by default): a peer that does not
/// answer ends the job, the waiting rank saying why on stderr (`MPI_Abort`: MPI cannot
/// cancel a collective whose buffers are the worker's buckets). A worker that abandons
/// a step makes the group unusable: its later calls fail with [`Error::Reduction`], and
/// dropping the reducer ends the job rather than wait in `MPI_Finalize`.
///
/// ```no_run
/// # use carve::nn::{parallel::DataParallel, parallel::Mpi, Network, NetworkConfig};
/// # fn main() -> carve::Result<()> {
/// // Run as `mpirun -np 2 <program>`: every process builds the same network and sees
/// // the same batches; each trains on its shard.
/// let mpi = Mpi::init()?;
/// let network = Network::new(NetworkConfig::builder(4).dense(8).relu().dense(3).build()?)?;
/// let mut trainer = DataParallel::with_reducer(network, Box::new(mpi), 4 << 20)?;
/// # Ok(())
/// # }
/// ```
pub struct Mpi {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    timeout: Duration,
    /// The pieces of this rank's share, by source rank.
    pieces: Vec<f32>,
    /// This rank's sums, sent to every rank.
    sums: Vec<f32>,
    /// Each rank's share of a bucket: the all-to-all's send partition and the
    /// all-gather's receive partition.
    counts: Vec<i32>,
    displs: Vec<i32>,
    /// The all-to-all's receive partition: this rank's share from each rank.
    piece_counts: Vec<i32>,
    piece_displs: Vec<i32>,
    /// This rank's report, and every rank's (loss bits, status), for the exchange.
    report: Box<[u64; 2]>,
    reports: Vec<u64>,
    /// Why the group is unusable, once it is.
    broken: Option<String>,
    /// MPI itself, finalized on drop (unless the group broke: then the job is aborted).
    universe: Option<Universe>,
    /// The thread that initialized MPI, the one that may finalize it.
    init_thread: std::thread::ThreadId,
}

impl std::fmt::Debug for Mpi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mpi").field("rank", &self.rank).field("size", &self.size).finish()
    }
}

// SAFETY: MPI is initialized with `Threading::Serialized` (checked in `Mpi::init`), so
// any thread may call it as long as no two do at once; the reducer makes its calls through
// `&mut self`, one thread at a time. Only the initializing thread finalizes MPI (`Drop`
// checks the thread).
unsafe impl Send for Mpi {}

impl Mpi {
    /// Initializes MPI (serialized threading) and gives the reducer of the world
    /// communicator: this process is worker `rank` of `size`. The environment variable
    /// `CARVE_MPI_TIMEOUT_MS` sets the timeout of each collective call (default 60,000;
    /// 1 to 86,400,000: a value that is not one is an error naming the variable).
    ///
    /// # Errors
    ///
    /// [`Error::Reduction`] when MPI was already initialized, or cannot serialize calls
    /// from several threads, or `CARVE_MPI_TIMEOUT_MS` is not a timeout it takes.
    pub fn init() -> Result<Mpi> {
        let timeout = super::mpi_timeout(std::env::var("CARVE_MPI_TIMEOUT_MS").ok().as_deref())?;
        let (universe, threading) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| Error::Reduction { message: "MPI is already initialized in this process".into() })?;
        if threading < Threading::Serialized {
            return Err(Error::Reduction {
                message: format!("the MPI library gives {threading:?} threading; carve needs Serialized"),
            });
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        Ok(Mpi {
            world,
            rank,
            size,
            timeout,
            pieces: Vec::new(),
            sums: Vec::new(),
            counts: vec![0; size],
            displs: vec![0; size],
            piece_counts: vec![0; size],
            piece_displs: vec![0; size],
            report: Box::new([0; 2]),
            reports: vec![0; 2 * size],
            broken: None,
            universe: Some(universe),
            init_thread: std::thread::current().id(),
        })
    }

    /// How long one collective call waits for the peers.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets how long one collective call waits for the peers.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Ends every process of the job (`MPI_Abort`) with `code`: what a process does after
    /// an error it cannot recover from, so that no peer waits for it.
    pub fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }

    fn check(&self) -> Result<()> {
        match &self.broken {
            None => Ok(()),
            Some(why) => Err(Error::Reduction { message: format!("the MPI group is unusable: {why}") }),
        }
    }

    /// Ends the job after a peer did not answer `what` in time: MPI cannot cancel a
    /// collective call, and its buffers are this worker's gradient buckets, so no error
    /// can be returned while the call may still write them.
    fn timed_out(&self, what: &str) -> ! {
        eprintln!(
            "carve: data-parallel reduction failed: rank {} waited {:?} for its peers in {what} (a peer died or \
             hangs); MPI cannot cancel the call, so the job ends (MPI_Abort)",
            self.rank, self.timeout
        );
        self.world.abort(1)
    }
}

/// Polls `request` until it completes or `deadline` passes; on time out the request is
/// given up, never completed (its buffers must then never be freed).
fn wait_until<'a, D: ?Sized, S: mpi::request::Scope<'a>>(
    mut request: mpi::request::Request<'a, D, S>,
    deadline: Option<Instant>,
) -> bool {
    let mut polls = 0u32;
    loop {
        match request.test() {
            Ok(_) => return true,
            Err(pending) => request = pending,
        }
        if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
            // SAFETY: unregistered from its scope so that the scope's end does not abort
            // the process before the caller says why; the caller's next and last MPI call
            // is `MPI_Abort`, and it returns to nothing that could free the buffers.
            let _ = unsafe { request.into_raw() };
            return false;
        }
        polls += 1;
        if polls < 1000 {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

fn count(n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| Error::Reduction { message: format!("a share of {n} values is too many for MPI") })
}

impl Reducer for Mpi {
    fn workers(&self) -> usize {
        self.size
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn name(&self) -> &'static str {
        "mpi"
    }

    fn reduce(&mut self, bucket: &mut [f32]) -> Result<Range<usize>> {
        self.check()?;
        let (p, len) = (self.size, bucket.len());
        let mine = share(len, p, self.rank);
        let n = mine.len();
        self.pieces.resize(n * p, 0.0);
        self.sums.resize(n, 0.0);
        // A timeout too long to represent never expires.
        let deadline = Instant::now().checked_add(self.timeout);
        // All-to-all: rank q gets its share of this bucket; this rank gets its share of
        // every bucket, by source rank.
        count(len)?;
        for q in 0..p {
            let s = share(len, p, q);
            (self.counts[q], self.displs[q]) = (s.len() as i32, s.start as i32);
            (self.piece_counts[q], self.piece_displs[q]) = (n as i32, count(q * n)?);
        }
        let done = {
            let send = Partition::new(&*bucket, &self.counts[..], &self.displs[..]);
            let mut recv = PartitionMut::new(&mut self.pieces[..], &self.piece_counts[..], &self.piece_displs[..]);
            let world = &self.world;
            mpi::request::scope(|scope| {
                wait_until(world.immediate_all_to_all_varcount_into(scope, &send, &mut recv), deadline)
            })
        };
        if !done {
            self.timed_out("the all-to-all of a gradient bucket");
        }
        for (j, sum) in self.sums.iter_mut().enumerate() {
            let mut s = self.pieces[j];
            for q in 1..p {
                s += self.pieces[q * n + j];
            }
            *sum = s;
        }
        let done = {
            let mut all = PartitionMut::new(&mut *bucket, &self.counts[..], &self.displs[..]);
            let (world, sums) = (&self.world, &self.sums[..]);
            mpi::request::scope(|scope| {
                wait_until(world.immediate_all_gather_varcount_into(scope, sums, &mut all), deadline)
            })
        };
        if !done {
            self.timed_out("the all-gather of a gradient bucket's sums");
        }
        Ok(0..len)
    }

    fn exchange(&mut self, mine: Report, all: &mut [Report]) -> Result<()> {
        self.check()?;
        self.report[..].copy_from_slice(&[mine.loss_sum.to_bits(), mine.status]);
        // A timeout too long to represent never expires.
        let deadline = Instant::now().checked_add(self.timeout);
        let (world, report, reports) = (&self.world, &self.report[..], &mut self.reports[..]);
        let done =
            mpi::request::scope(|scope| wait_until(world.immediate_all_gather_into(scope, report, reports), deadline));
        if !done {
            self.timed_out("the exchange of the workers' reports");
        }
        for (report, pair) in all.iter_mut().zip(self.reports.chunks_exact(2)) {
            *report = Report { loss_sum: f64::from_bits(pair[0]), status: pair[1] };
        }
        Ok(())
    }

    fn abandon(&mut self) {
        if self.broken.is_none() {
            self.broken = Some(format!("rank {} abandoned a step in the middle of its collective calls", self.rank));
        }
    }
}

impl Drop for Mpi {
    fn drop(&mut self) {
        if self.broken.is_some() {
            // The peers are in a step this rank abandoned: `MPI_Finalize` could wait for
            // ever.
            std::mem::forget(self.universe.take());
            self.world.abort(1);
        }
        if std::thread::current().id() != self.init_thread {
            // MPI is finalized by the thread that initialized it, or not at all.
            std::mem::forget(self.universe.take());
        }
    }
}
