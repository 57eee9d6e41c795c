//! Data-parallel training in the demos (included with `#[path]`): the `--workers N
//! --reducer threads|sequential|mpi` flags, the trainers, what they measure and the JSON
//! keys they add.
//!
//! With more than one worker, a trainer of one worker trains alongside on the same
//! batches (from a second prefetcher of the same seed), epoch by epoch in turn, so that
//! `speedup_vs_one_worker` (samples per second of the N workers over those of one, after
//! the first epoch) is measured in the same run, on the same machine state. Under `mpirun` every process does so (each its own one-worker
//! trainer, at the same time), and rank 0 reports.

// Not every demo needs every helper.
#![allow(dead_code)]

use std::time::Instant;

use carve::alloc_check::{reset_thread_peak, thread_counts};
use carve::nn::{parallel::DataParallel, parallel::ParallelConfig, parallel::ParallelStats, Input, Labels, Network};

/// How the workers reduce (`--reducer`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReducerArg {
    /// One thread per worker.
    Threads,
    /// One thread running the workers' shards in turn (the same bits as the threads).
    Sequential,
    /// One worker per MPI process (`mpirun -np N`; the `mpi` feature).
    Mpi,
}

impl ReducerArg {
    pub(crate) fn name(self) -> &'static str {
        match self {
            ReducerArg::Threads => "threads",
            ReducerArg::Sequential => "sequential",
            ReducerArg::Mpi => "mpi",
        }
    }
}

/// The most workers `--workers` takes.
pub(crate) const MAX_WORKERS: usize = 256;

pub(crate) fn parse_reducer(s: &str) -> Result<ReducerArg, String> {
    match s {
        "threads" => Ok(ReducerArg::Threads),
        "sequential" => Ok(ReducerArg::Sequential),
        "mpi" => Ok(ReducerArg::Mpi),
        _ => Err(format!("'{s}' is not a reducer: use `threads`, `sequential` or `mpi`")),
    }
}

pub(crate) fn parse_workers(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_WORKERS).contains(&n) => Ok(n),
        _ => Err(format!("'{s}' is not a number of workers from 1 to {MAX_WORKERS}")),
    }
}

/// Where this process stands: its workers and reducer, its rank (0 but under MPI).
pub(crate) struct Setup {
    pub(crate) workers: usize,
    pub(crate) reducer: ReducerArg,
    pub(crate) rank: usize,
    #[cfg(feature = "mpi")]
    mpi: Option<carve::nn::parallel::Mpi>,
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

impl Setup {
    /// The setup of `--workers` (default: 2 threads, or the MPI world's size) and
    /// `--reducer` (default: threads).
    pub(crate) fn new(workers: Option<usize>, reducer: Option<ReducerArg>) -> Res<Setup> {
        let reducer = reducer.unwrap_or(ReducerArg::Threads);
        if reducer != ReducerArg::Mpi {
            return Ok(Setup {
                workers: workers.unwrap_or(2),
                reducer,
                rank: 0,
                #[cfg(feature = "mpi")]
                mpi: None,
            });
        }
        #[cfg(feature = "mpi")]
        {
            use carve::nn::parallel::Reducer;
            let mpi = carve::nn::parallel::Mpi::init()?;
            let (rank, size) = (mpi.rank(), mpi.workers());
            if let Some(n) = workers.filter(|&n| n != size) {
                return Err(format!("--workers {n} under mpirun of {size} processes: one worker per process").into());
            }
            Ok(Setup { workers: size, reducer, rank, mpi: Some(mpi) })
        }
        #[cfg(not(feature = "mpi"))]
        {
            let _ = workers;
            Err("--reducer mpi needs the `mpi` feature: cargo build --release --features mpi --example <demo>, \
                 then mpirun -np N target/release/examples/<demo> --reducer mpi"
                .into())
        }
    }

    /// Whether this process reports (rank 0).
    pub(crate) fn is_root(&self) -> bool {
        self.rank == 0
    }

    /// The trainers of `network()`'s networks: the N workers' and, with more than one
    /// worker, one worker's alongside.
    pub(crate) fn trainers(&mut self, network: impl Fn() -> carve::Result<Network>) -> Res<Trainers> {
        let main = match self.reducer {
            ReducerArg::Threads => DataParallel::new(network()?, ParallelConfig::threads(self.workers))?,
            ReducerArg::Sequential => DataParallel::new(network()?, ParallelConfig::sequential(self.workers))?,
            #[cfg(feature = "mpi")]
            ReducerArg::Mpi => {
                let mpi = self.mpi.take().ok_or("the MPI reducer is taken")?;
                DataParallel::with_reducer(network()?, Box::new(mpi), ParallelConfig::threads(1).bucket_bytes)?
            }
            #[cfg(not(feature = "mpi"))]
            ReducerArg::Mpi => return Err("built without the `mpi` feature".into()),
        };
        let one = match self.workers {
            1 => None,
            _ => Some(DataParallel::new(network()?, ParallelConfig::threads(1))?),
        };
        Ok(Trainers {
            main,
            one,
            mpi_rank: (self.reducer == ReducerArg::Mpi).then_some(self.rank),
            loss: Vec::new(),
            main_ns: Vec::new(),
            one_ns: Vec::new(),
            rows: Vec::new(),
            allocs: Vec::new(),
        })
    }
}

/// The N workers' trainer, one worker's alongside, and what they measured.
pub(crate) struct Trainers {
    pub(crate) main: DataParallel,
    one: Option<DataParallel>,
    /// This process's rank under MPI.
    mpi_rank: Option<usize>,
    pub(crate) loss: Vec<f32>,
    main_ns: Vec<u64>,
    one_ns: Vec<u64>,
    rows: Vec<usize>,
    /// Heap allocations of this thread in each step of the N workers.
    pub(crate) allocs: Vec<u64>,
}

impl Trainers {
    /// Room for `iterations` steps, so that recording allocates nothing.
    pub(crate) fn reserve(&mut self, iterations: usize) {
        self.loss.reserve_exact(iterations);
        self.main_ns.reserve_exact(iterations);
        self.one_ns.reserve_exact(iterations);
        self.rows.reserve_exact(iterations);
        self.allocs.reserve_exact(iterations);
    }

    /// One step of each trainer on the batch; returns the N workers' loss.
    pub(crate) fn fit(&mut self, x: Input<'_>, y: Labels<'_>) -> carve::Result<f32> {
        let rows = x.rows();
        let before = reset_thread_peak();
        let t0 = Instant::now();
        let loss = self.main.fit_batch(x, y).inspect_err(|e| {
            if let Some(rank) = self.mpi_rank {
                // Said now: a failed MPI group ends the job when the trainer drops.
                eprintln!("rank {rank}: {e}");
            }
        })?;
        let elapsed = t0.elapsed();
        self.allocs.push(thread_counts().allocations - before.allocations);
        self.main_ns.push(elapsed.as_nanos() as u64);
        self.loss.push(loss);
        self.rows.push(rows);
        Ok(loss)
    }

    /// Whether a one-worker trainer trains alongside (more than one worker).
    pub(crate) fn has_baseline(&self) -> bool {
        self.one.is_some()
    }

    /// One step of the one-worker trainer (the same batches, in an epoch of its own
    /// after the N workers' epoch, so that neither's threads wait on the other's steps).
    pub(crate) fn fit_one(&mut self, x: Input<'_>, y: Labels<'_>) -> carve::Result<()> {
        if let Some(one) = &mut self.one {
            let t0 = Instant::now();
            one.fit_batch(x, y)?;
            self.one_ns.push(t0.elapsed().as_nanos() as u64);
        }
        Ok(())
    }

    /// Samples per second of the N workers and of one, over the steps from `steady`
    /// (all of them when there are no more).
    pub(crate) fn samples_per_second(&self, steady: usize) -> (f64, Option<f64>) {
        let from = if steady < self.rows.len() { steady } else { 0 };
        let rows: usize = self.rows[from..].iter().sum();
        let rate = |ns: &[u64]| rows as f64 / (ns.iter().sum::<u64>() as f64 / 1e9);
        let one = (!self.one_ns.is_empty()).then(|| rate(&self.one_ns[from..]));
        (rate(&self.main_ns[from..]), one)
    }

    /// The keys the issue names (and the memory beside them), for the steps from `steady`.
    pub(crate) fn json(&self, setup: &Setup, steady: usize) -> serde_json::Value {
        let stats: ParallelStats = self.main.stats();
        let (rate, one) = self.samples_per_second(steady);
        let speedup = match one {
            Some(one) => rate / one,
            None => 1.0,
        };
        let steady_allocs = self.allocs.get(steady..).and_then(|a| a.iter().copied().max());
        serde_json::json!({
            "workers": setup.workers,
            "reducer": setup.reducer.name(),
            "bytes_copied_for_reduction": stats.bytes_copied_for_reduction,
            "gradient_bucket_bytes": stats.gradient_bucket_bytes,
            "speedup_vs_one_worker": speedup,
            "samples_per_second": rate,
            "samples_per_second_one_worker": one.unwrap_or(rate),
            "loss_trace_sha256": sha256_of_losses(&self.loss),
            "gradient_buckets": stats.buckets,
            "weight_bytes": stats.weight_bytes,
            "updater_state_bytes": stats.updater_state_bytes,
            "worker_plan_bytes": stats.worker_plan_bytes,
            "worker_arena_bytes": stats.worker_arena_bytes,
            "memory_bytes": stats.total_bytes(),
            "dl4j_design_bytes": stats.replicated_bytes(),
            "steady_state_allocs_max": steady_allocs,
        })
    }

    /// A line or two for people.
    pub(crate) fn summary(&self, setup: &Setup, steady: usize) -> String {
        let stats = self.main.stats();
        let (rate, one) = self.samples_per_second(steady);
        let speedup = one.map_or("(one worker: no baseline)".to_string(), |one| {
            format!("{:.2}x one worker's {:.0} samples/s", rate / one, one)
        });
        format!(
            "{} workers ({}): {rate:.0} samples/s, {speedup}; bytes copied for the reduction {}; memory {} bytes \
             (weights {} + updater state {} once, worker arenas {:?}); a copy of the model per worker (DL4J's \
             ParallelWrapper) would hold {} bytes",
            setup.workers,
            setup.reducer.name(),
            stats.bytes_copied_for_reduction,
            stats.total_bytes(),
            stats.weight_bytes,
            stats.updater_state_bytes,
            stats.worker_arena_bytes,
            stats.replicated_bytes(),
        )
    }
}

/// `object` (a demo's run description) with the data-parallel `fields` added at its
/// top level and under `mode`'s key, printed as the last line of stdout.
pub(crate) fn print_json(mut object: serde_json::Value, fields: serde_json::Value, mode: &str) -> Res<()> {
    if let (Some(object), Some(keys)) = (object.as_object_mut(), fields.as_object()) {
        for (k, v) in keys {
            object.insert(k.clone(), v.clone());
        }
    }
    object[mode] = fields;
    println!("{}", serde_json::to_string(&object)?);
    Ok(())
}

/// SHA-256 of the losses as little-endian `f32` bits, in order (the demos'
/// `loss_trace_sha256`).
pub(crate) fn sha256_of_losses(losses: &[f32]) -> String {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    for loss in losses {
        hasher.update(loss.to_bits().to_le_bytes());
    }
    hasher.finalize().iter().map(|b| format!("{b:02x}")).collect()
}
