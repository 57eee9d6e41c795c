//! Checks the MPI reducer under `mpirun` (the `mpi` feature): every process trains the
//! same MLP on the same batches through [`carve::nn::parallel::Mpi`], one shard each, and rank 0
//! trains a [`DataParallel`] of as many *threads* alongside: the losses must be the
//! same bits, step for step, and rank 0's copy of the trained weights must give the
//! threads' outputs, bit for bit.
//!
//! ```text
//! cargo build --release --features mpi --example mpi_check
//! mpirun -np 2 target/release/examples/mpi_check                   # bits: exit 0
//! mpirun -np 2 target/release/examples/mpi_check --fault stall-at 5 --timeout-ms 2000
//! mpirun -np 2 target/release/examples/mpi_check --fault die-at 5
//! ```
//!
//! `--fault nan-at N`: step N's batch holds a NaN in the last rank's shard: every
//! process's step fails naming that worker, as the threads' does, and training goes on
//! with the same bits (exit 0).
//! `--fault stall-at N`: the last rank sleeps 60 s before step N; the others wait
//! `--timeout-ms`, say why on stderr and end the job (`MPI_Abort`). `--fault die-at N`: the last rank exits before step N; `mpirun` ends
//! the job (or the others' timeout does). Either way nothing hangs: the exit status is
//! not 0 and the time is bounded by the timeout.

#[path = "common/cli.rs"]
mod cli;

use std::process::ExitCode;
use std::time::Duration;

use carve::ndarray::{Array1, Array2};
use carve::nn::{
    parallel::DataParallel, parallel::Mpi, parallel::ParallelConfig, parallel::Reducer, Network, NetworkConfig, Updater,
};
use clap::Parser;

/// Checks the MPI reducer against threads, or a peer's fault.
#[derive(Parser, Debug)]
#[command(name = "mpi_check", verbatim_doc_comment)]
struct Args {
    /// Steps to train
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// `none`, `nan-at`, `stall-at` or `die-at` (the last rank, at step --at)
    #[arg(long, default_value = "none")]
    fault: String,
    /// The step the fault comes before
    #[arg(long, default_value_t = 5)]
    at: usize,
    /// The reducer's timeout of one collective call, in ms
    #[arg(long, default_value_t = 60_000)]
    timeout_ms: u64,
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn network() -> carve::Result<Network> {
    let config =
        NetworkConfig::builder(20).dense(48).relu().dense(24).relu().dense(5).seed(9).updater(Updater::adam(0.01));
    Network::new(config.build()?)
}

fn batch(step: usize) -> (Array2<f32>, Array1<u32>) {
    let x = Array2::from_shape_fn((37, 20), |(r, c)| ((r * 13 + c * 7 + step * 5) % 29) as f32 / 29.0 - 0.5);
    let y = Array1::from_shape_fn(37, |r| ((r * 3 + step) % 5) as u32);
    (x, y)
}

fn run(args: &Args) -> Res<()> {
    let mut mpi = Mpi::init()?;
    mpi.set_timeout(Duration::from_millis(args.timeout_ms));
    let (rank, size) = (mpi.rank(), mpi.workers());
    let last = rank + 1 == size;
    let mut trainer = DataParallel::with_reducer(network()?, Box::new(mpi), 4 << 20)?;
    let mut threads = match rank {
        0 => Some(DataParallel::new(network()?, ParallelConfig::threads(size))?),
        _ => None,
    };
    for step in 0..args.steps {
        if last && step == args.at {
            match args.fault.as_str() {
                "stall-at" => std::thread::sleep(Duration::from_secs(60)),
                "die-at" => std::process::exit(3),
                _ => {}
            }
        }
        let (mut x, y) = batch(step);
        if args.fault == "nan-at" && step == args.at {
            // A row of the last shard (rows n·r/P .. n·(r+1)/P).
            let last_row = x.nrows() - 1;
            x[[last_row, 3]] = f32::NAN;
            let last_rank = size - 1;
            let named = |e: &carve::Error| matches!(e, carve::Error::Worker { worker, .. } if *worker == last_rank);
            let processes = trainer.fit_batch(x.view(), y.view());
            if !processes.as_ref().is_err_and(named) {
                return Err(
                    format!("rank {rank}: the NaN step gave {processes:?}, not worker {last_rank}'s error").into()
                );
            }
            if let Some(threads) = threads.as_mut() {
                let local = threads.fit_batch(x.view(), y.view());
                if !local.as_ref().is_err_and(named) {
                    return Err(format!("the threads' NaN step gave {local:?}").into());
                }
            }
            continue;
        }
        let loss = match trainer.fit_batch(x.view(), y.view()) {
            Ok(loss) => loss,
            Err(e) => {
                // Said before the trainer's drop ends the job.
                eprintln!("mpi_check: rank {rank}: step {step}: {e}");
                return Err(e.into());
            }
        };
        if let Some(threads) = threads.as_mut() {
            let expected = threads.fit_batch(x.view(), y.view())?;
            if loss.to_bits() != expected.to_bits() {
                return Err(
                    format!("step {step}: {size} processes' loss {loss:e}, {size} threads' {expected:e}").into()
                );
            }
        }
    }
    if let Some(threads) = threads {
        let (a, b) = (trainer.freeze()?, threads.freeze()?);
        let probe = batch(999).0;
        let (a, b) = (a.output(probe.view())?, b.output(probe.view())?);
        if a.iter().zip(b.iter()).any(|(p, q)| p.to_bits() != q.to_bits()) {
            return Err("the trained weights of the processes and of the threads differ".into());
        }
        println!(
            "mpi_check: {size} processes gave the bits of {size} threads over {} steps (losses and weights)",
            args.steps
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Args = cli::parse();
    cli::exit_status::<Args, _>(run(&args))
}
