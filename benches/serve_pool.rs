//! Serving benchmark: one model served to 1 … 64 caller threads from an
//! [`InferencePool`] of K planned arenas, against the ways a user would serve it without
//! one: a `Network` per caller thread (the weights, gradients and updater state copied
//! per thread, as DL4J's `ParallelInference` copies the model per worker), one `Network`
//! behind a mutex, and (with the `candle` feature) candle running the same MLP, the same
//! weights (read from the safetensors file carve saves), from an `Arc` on every thread.
//!
//! Each run is a fresh child process, so that its peak RSS is its own: the model built,
//! every caller thread started and warmed up (every shape planned), `VmHWM` reset
//! (`/proc/self/clear_refs`), then the timed requests, each timed alone. The figures per
//! run: requests per second, p50 and p99 latency, peak RSS, arena bytes and heap
//! allocations per request (carve's counting allocator, every thread).
//!
//! The memory target is measured net of the callers' own threads: the growth of carve's
//! peak RSS from the fewest callers to the most, less the growth of an idle-thread
//! baseline (the same caller threads, each request doing nothing) at the same counts in
//! the same invocation; both figures are reported. `--arena-stacks` runs the pool's
//! requests on its arenas' own stacks (`PoolConfig::with_arena_stacks`), off by default
//! as in the pool.
//!
//! Also measured in the same invocation: `speedup_k2_over_k1` (direct mode at the most
//! callers, K = 2 over K = 1, the median of three alternating pairs),
//! `batched_over_direct` (requests per second at the most callers), `lease_ns` (an
//! uncontended lease and its release), and `plan_bytes` (one arena's plan for the
//! request shape, so that `arena_bytes` can be checked against K × plan).
//!
//! ```text
//! cargo run --release --example serve_pool -- --json
//! cargo run --release --example serve_pool -- --threads 1,2,4,8,16,32,64 --workers 2 --mode batched --json
//! cargo run --release --example serve_pool -- --arena-stacks --json        # requests on the arenas' stacks
//! cargo run --release --example serve_pool --features candle -- --json    # with candle
//! ```

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use carve::alloc_check::{process_counts, CountingAllocator, Threads};
use carve::nn::{serve::InferencePool, serve::PoolConfig, serve::PoolMode, Network, NetworkConfig};
use carve_rng::Rng;
use clap::Parser;
use ndarray::{Array2, ArrayView2, ArrayViewMut2};
use serde_json::{json, Value};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::system();

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Serving benchmark: an inference pool of K arenas serving one model to
/// 1 … 64 caller threads, against a network per thread, a network
/// behind a mutex and (feature `candle`) candle; peak RSS, requests per
/// second, latency and heap allocations per caller count. See
/// benches/README.md.
#[derive(Parser, Debug, Clone)]
#[command(name = "serve_pool", verbatim_doc_comment, next_line_help = true)]
struct Args {
    /// Caller thread counts, comma-separated (each 1 to 1024)
    #[arg(long, value_name = "N,N,...", value_delimiter = ',', default_value = "1,2,4,8,16,32,64",
          value_parser = clap::value_parser!(u16).range(1..=1024))]
    threads: Vec<u16>,
    /// The pool's arenas (1 to 256)
    #[arg(long, value_name = "K", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=256))]
    workers: u16,
    /// `direct` or `batched`
    #[arg(long, value_name = "MODE", default_value = "direct", value_parser = parse_mode)]
    mode: PoolMode,
    /// Timed requests per run, shared among its callers (at
    /// least 100)
    #[arg(long, value_name = "N", default_value_t = 20_000, value_parser = clap::value_parser!(u32).range(100..),
          verbatim_doc_comment)]
    requests: u32,
    /// Rows per request (1 to 1024)
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1024))]
    rows: u16,
    /// The MLP's inputs, hidden widths and classes (each 1 to
    /// 8192; a ReLU after each hidden layer)
    #[arg(long, value_name = "W,W,...", value_delimiter = ',', default_value = "64,256,256,10",
          value_parser = clap::value_parser!(u16).range(1..=8192), verbatim_doc_comment)]
    shape: Vec<u16>,
    /// Batched mode: the most rows in one inference (1 to 4096)
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..=4096))]
    max_batch: u16,
    /// Batched mode: how long a request may wait for others, in
    /// microseconds (0: a batch is what queued while the workers
    /// were busy)
    #[arg(long, value_name = "US", default_value_t = 0, verbatim_doc_comment)]
    max_wait_us: u64,
    /// Run the pool's requests on its arenas' own stacks
    /// (PoolConfig::with_arena_stacks)
    #[arg(long, verbatim_doc_comment)]
    arena_stacks: bool,
    /// Skip the baselines (carve's runs, the idle threads and the
    /// ratios only)
    #[arg(long, verbatim_doc_comment)]
    no_baselines: bool,
    /// Print one JSON object as the last line
    #[arg(long)]
    json: bool,
    /// Internal: one run in this fresh process (VARIANT THREADS
    /// WORKERS MODE)
    #[arg(long, num_args = 4, value_names = ["VARIANT", "THREADS", "WORKERS", "MODE"], hide = true)]
    child: Option<Vec<String>>,
}

fn parse_mode(s: &str) -> Result<PoolMode, String> {
    match s {
        "direct" => Ok(PoolMode::Direct),
        "batched" => Ok(PoolMode::Batched),
        _ => Err(format!("'{s}' is not a mode: use `direct` or `batched`")),
    }
}

fn mode_name(mode: PoolMode) -> &'static str {
    match mode {
        PoolMode::Direct => "direct",
        PoolMode::Batched => "batched",
    }
}

fn main() {
    let args = Args::parse();
    if args.shape.len() < 2 || args.shape.last().is_some_and(|&c| c < 2) {
        eprintln!("serve_pool: error: --shape needs the inputs and at least 2 classes; see 'serve_pool --help'");
        std::process::exit(2);
    }
    let result = match &args.child {
        Some(child) => {
            // A panic in any thread ends the child at once (the parent reports its
            // stderr), rather than leaving the others waiting at a barrier.
            let report = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                report(info);
                std::process::exit(101);
            }));
            child_run(&args, child)
        }
        None => parent(&args),
    };
    if let Err(e) = result {
        eprintln!("serve_pool: error: {e}");
        std::process::exit(1);
    }
}

// ---------------------------------------------------------------------------------
// The model.

/// The benchmark's network: the MLP of `--shape`, seed 7, inference in planned mode.
fn network(args: &Args) -> Res<Network> {
    let mut builder = NetworkConfig::builder(usize::from(args.shape[0]));
    let widths = &args.shape[1..];
    for (i, &width) in widths.iter().enumerate() {
        builder = builder.dense(usize::from(width));
        if i + 1 < widths.len() {
            builder = builder.relu();
        }
    }
    let config = builder.seed(7).inference_workspace_mode(carve::WorkspaceMode::Enabled).build()?;
    Ok(Network::new(config)?)
}

fn requests_for(args: &Args, threads: usize) -> Vec<Array2<f32>> {
    (0..threads)
        .map(|t| {
            let mut rng = Rng::new(1000 + t as u64);
            Array2::from_shape_fn((usize::from(args.rows), usize::from(args.shape[0])), |_| rng.uniform(0.0, 1.0))
        })
        .collect()
}

// ---------------------------------------------------------------------------------
// One run, in a child process.

/// What a run measured.
struct Measured {
    requests_per_sec: f64,
    p50_us: f64,
    p99_us: f64,
    peak_rss_bytes: Option<u64>,
    heap_allocs_per_request: f64,
}

/// One caller thread's way of serving a request.
trait Caller {
    /// Serves `x`, its probabilities (or classes) written where the caller keeps them.
    fn serve(&mut self, x: ArrayView2<'_, f32>, out: ArrayViewMut2<'_, f32>);
    /// Workspace bytes this caller holds of its own.
    fn own_bytes(&self) -> usize {
        0
    }
}

impl<F: FnMut(ArrayView2<'_, f32>, ArrayViewMut2<'_, f32>)> Caller for F {
    fn serve(&mut self, x: ArrayView2<'_, f32>, out: ArrayViewMut2<'_, f32>) {
        self(x, out)
    }
}

/// Runs `threads` callers, each made in its own thread by `make(thread)`: warm-up, a
/// reset of the peak RSS, then `requests` timed requests among them. Returns what was
/// measured and the callers' own workspace bytes, summed. What the harness itself needs
/// per thread (the request, the output, the latencies) is allocated before the threads
/// start, so that the peak RSS shows the callers' own memory.
fn callers<C: Caller, M>(args: &Args, threads: usize, make: M) -> Res<(Measured, usize)>
where
    M: Fn(usize) -> C + Sync,
{
    let xs = requests_for(args, threads);
    let classes = usize::from(*args.shape.last().expect("classes"));
    let per_thread = (args.requests as usize).div_ceil(threads);
    // Written once here, so that their pages are resident before the peak is reset.
    let mut outs: Vec<Array2<f32>> =
        (0..threads).map(|_| Array2::from_elem((usize::from(args.rows), classes), 1.0)).collect();
    let mut latencies = vec![u32::MAX; per_thread * threads];
    let barrier = Barrier::new(threads + 1);
    let mut own_bytes = 0;
    let (mut allocs, mut wall) = (0u64, Duration::ZERO);
    let mut peak = None;
    let mut reset = false;
    std::thread::scope(|s| -> Res<()> {
        let handles: Vec<_> = latencies
            .chunks_mut(per_thread)
            .zip(&mut outs)
            .enumerate()
            .map(|(t, (times, out))| {
                let (x, barrier, make) = (&xs[t], &barrier, &make);
                std::thread::Builder::new()
                    .stack_size(256 * 1024)
                    .spawn_scoped(s, move || {
                        let mut caller = make(t);
                        for _ in 0..20 {
                            caller.serve(x.view(), out.view_mut());
                        }
                        barrier.wait(); // warmed up
                        barrier.wait(); // measured from here
                        for time in times.iter_mut() {
                            let begin = Instant::now();
                            caller.serve(x.view(), out.view_mut());
                            *time = begin.elapsed().as_nanos().min(u128::from(u32::MAX)) as u32;
                        }
                        barrier.wait(); // done
                        caller.own_bytes()
                    })
                    .expect("a caller thread")
            })
            .collect();
        barrier.wait();
        reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
        allocs = process_counts(Threads::All).allocations;
        let start = Instant::now();
        barrier.wait();
        barrier.wait();
        wall = start.elapsed();
        allocs = process_counts(Threads::All).allocations - allocs;
        // Without a reset the peak would include the warm-up's: not reported.
        peak = peak_rss_bytes().filter(|_| reset);
        for handle in handles {
            own_bytes += handle.join().map_err(|_| "a caller thread panicked")?;
        }
        Ok(())
    })?;
    std::hint::black_box(&outs);
    latencies.sort_unstable();
    let quantile = |q: f64| latencies[((latencies.len() - 1) as f64 * q).round() as usize] as f64 / 1000.0;
    let requests = latencies.len() as f64;
    let measured = Measured {
        requests_per_sec: requests / wall.as_secs_f64(),
        p50_us: quantile(0.5),
        p99_us: quantile(0.99),
        peak_rss_bytes: peak,
        heap_allocs_per_request: allocs as f64 / requests,
    };
    Ok((measured, own_bytes))
}

/// A caller with a `Network` of its own (built in its thread: a network is not `Send`),
/// inferring with `predict_into`, which allocates nothing per request.
struct OwnNetwork(Network);

impl Caller for OwnNetwork {
    fn serve(&mut self, x: ArrayView2<'_, f32>, _: ArrayViewMut2<'_, f32>) {
        let mut classes = [0u32; 1024];
        self.0.predict_into(x, &mut classes[..x.nrows()]).expect("a request");
        std::hint::black_box(&classes);
    }
    fn own_bytes(&self) -> usize {
        self.0.workspace_capacity()
    }
}

/// Peak resident set size of the process (`VmHWM`), in bytes.
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.trim_start_matches("VmHWM:").trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}

fn child_run(args: &Args, child: &[String]) -> Res<()> {
    let [variant, threads, workers, mode] = child else { return Err("--child takes 4 values".into()) };
    let threads: usize = threads.parse()?;
    let workers: usize = workers.parse()?;
    let mode = parse_mode(mode)?;
    let (measured, arena_bytes) = match variant.as_str() {
        "carve" => {
            let config = PoolConfig {
                workers,
                mode,
                max_batch: usize::from(args.max_batch),
                max_wait: Duration::from_micros(args.max_wait_us),
                ..PoolConfig::default()
            }
            .with_arena_stacks(args.arena_stacks);
            let pool = InferencePool::new(Arc::new(network(args)?.freeze()?), config)?;
            // Every arena planned for the request shape before the callers start.
            pool.warm_up(requests_for(args, 1)[0].view())?;
            let pool = &pool;
            let (measured, _) = callers(args, threads, |_| {
                |x: ArrayView2<'_, f32>, out: ArrayViewMut2<'_, f32>| pool.output_into(x, out).expect("a request")
            })?;
            (measured, pool.stats().arena_bytes)
        }
        "idle_threads" => {
            // The callers' threads alone (a request that does nothing): what any server
            // with this many threads pays in stacks, whatever serves the requests.
            callers(args, threads, |_| |_: ArrayView2<'_, f32>, _: ArrayViewMut2<'_, f32>| {})?
        }
        "network_per_thread" => callers(args, threads, |_| OwnNetwork(network(args).expect("a network")))?,
        "mutex_network" => {
            // A `Network` is not `Send`: one thread owns it and serves the callers in
            // turn, each waiting for its answer (what a mutex around it would do).
            let (requests, inbox) = sync_channel::<(usize, &SyncSender<()>)>(threads);
            let (senders, receivers): (Vec<_>, Vec<_>) = (0..threads).map(|_| sync_channel::<()>(1)).unzip();
            let receivers: Vec<Mutex<Receiver<()>>> = receivers.into_iter().map(Mutex::new).collect();
            let xs = requests_for(args, threads);
            std::thread::scope(|s| -> Res<(Measured, usize)> {
                let xs = &xs;
                let owner = s.spawn(move || {
                    let mut net = OwnNetwork(network(args).expect("a network"));
                    let mut out = Array2::<f32>::zeros((0, 0));
                    while let Ok((t, reply)) = inbox.recv() {
                        net.serve(xs[t].view(), out.view_mut());
                        let _ = reply.send(());
                    }
                    net.own_bytes()
                });
                let measured = {
                    let (requests, senders, receivers) = (&requests, &senders, &receivers);
                    callers(args, threads, move |t| {
                        move |_: ArrayView2<'_, f32>, _: ArrayViewMut2<'_, f32>| {
                            requests.send((t, &senders[t])).expect("the owner serves");
                            receivers[t].lock().expect("one caller each").recv().expect("an answer");
                        }
                    })
                };
                // The owner stops once the callers are done.
                drop(requests);
                let bytes = owner.join().map_err(|_| "the owner panicked")?;
                Ok((measured?.0, bytes))
            })?
        }
        #[cfg(feature = "candle")]
        "candle" => {
            let dir = std::env::temp_dir().join(format!("serve-pool-{}.safetensors", std::process::id()));
            network(args)?.save(&dir)?;
            let mlp = Arc::new(candle_mlp::Mlp::load(&dir, args.shape.len() - 1)?);
            let _ = std::fs::remove_file(&dir);
            let mlp = &mlp;
            let (measured, _) = callers(args, threads, |_| {
                move |x: ArrayView2<'_, f32>, out: ArrayViewMut2<'_, f32>| mlp.output_into(x, out).expect("a request")
            })?;
            (measured, 0)
        }
        other => return Err(format!("unknown variant '{other}'").into()),
    };
    let m = measured;
    println!(
        "{}",
        json!({
            "threads": threads,
            "requests_per_sec": m.requests_per_sec,
            "p50_us": m.p50_us,
            "p99_us": m.p99_us,
            "peak_rss_bytes": m.peak_rss_bytes,
            "arena_bytes": arena_bytes,
            "heap_allocs_per_request": m.heap_allocs_per_request,
        })
    );
    Ok(())
}

#[cfg(feature = "candle")]
mod candle_mlp {
    //! The same MLP in candle: `candle_nn::Linear` layers of the weights carve saved
    //! (PyTorch's `[out, in]` layout, which is candle's), ReLU between them, softmax.
    use candle_core::{Device, Module, Tensor};
    use ndarray::{ArrayView2, ArrayViewMut2};

    pub(crate) struct Mlp {
        layers: Vec<candle_nn::Linear>,
    }

    impl Mlp {
        pub(crate) fn load(path: &std::path::Path, dense: usize) -> candle_core::Result<Mlp> {
            let tensors = candle_core::safetensors::load(path, &Device::Cpu)?;
            let layers = (0..dense)
                .map(|i| {
                    // The builder names them dense_0, dense_2, … (a ReLU between).
                    let name = format!("dense_{}", 2 * i);
                    let weight = tensors[&format!("{name}.weight")].clone();
                    let bias = tensors[&format!("{name}.bias")].clone();
                    candle_nn::Linear::new(weight, Some(bias))
                })
                .collect();
            Ok(Mlp { layers })
        }

        pub(crate) fn output_into(
            &self,
            x: ArrayView2<'_, f32>,
            mut out: ArrayViewMut2<'_, f32>,
        ) -> candle_core::Result<()> {
            let mut h = Tensor::from_slice(x.as_slice().expect("standard layout"), x.dim(), &Device::Cpu)?;
            for (i, layer) in self.layers.iter().enumerate() {
                h = layer.forward(&h)?;
                if i + 1 < self.layers.len() {
                    h = h.relu()?;
                }
            }
            let probs = candle_nn::ops::softmax_last_dim(&h)?.flatten_all()?.to_vec1::<f32>()?;
            out.as_slice_mut().expect("standard layout").copy_from_slice(&probs);
            Ok(())
        }
    }
}

// ---------------------------------------------------------------------------------
// The parent: every run in a child, then the table and the JSON.

fn run_child(args: &Args, variant: &str, threads: usize, workers: usize, mode: PoolMode) -> Res<Value> {
    let exe = std::env::current_exe()?;
    let shape: Vec<String> = args.shape.iter().map(u16::to_string).collect();
    let output = Command::new(exe)
        .args(["--requests", &args.requests.to_string(), "--rows", &args.rows.to_string()])
        .args(["--max-batch", &args.max_batch.to_string(), "--max-wait-us", &args.max_wait_us.to_string(), "--shape"])
        .arg(shape.join(","))
        .args(args.arena_stacks.then_some("--arena-stacks"))
        .args(["--child", variant, &threads.to_string(), &workers.to_string(), mode_name(mode)])
        .output()?;
    if !output.status.success() {
        return Err(format!(
            "the {variant} run with {threads} callers failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        )
        .into());
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    Ok(serde_json::from_str(stdout.lines().last().ok_or("no output")?)?)
}

fn number(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or(f64::NAN)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// An uncontended lease and its release, in nanoseconds (the median of 7 rounds).
fn lease_ns(pool: &InferencePool) -> Res<f64> {
    let rounds = (0..7)
        .map(|_| {
            let n = 200_000;
            let start = Instant::now();
            for _ in 0..n {
                std::hint::black_box(pool.lease().expect("a lease"));
            }
            start.elapsed().as_nanos() as f64 / n as f64
        })
        .collect();
    Ok(median(rounds))
}

fn parent(args: &Args) -> Res<()> {
    let say = |text: String| if args.json { eprintln!("{text}") } else { println!("{text}") };
    let workers = usize::from(args.workers);
    // Ascending, without repeats: growth is from the fewest callers to the most.
    let mut threads: Vec<usize> = args.threads.iter().map(|&t| usize::from(t)).collect();
    threads.sort_unstable();
    threads.dedup();
    let most = *threads.iter().max().expect("at least one caller count");
    let shape: Vec<String> = args.shape.iter().map(u16::to_string).collect();
    let net = network(args)?;
    let model = Arc::new(net.freeze()?);
    let weight_bytes = model.weight_bytes();
    // One arena's plan for the largest shape served (batched: a full batch), and the
    // uncontended lease.
    let single = InferencePool::new(Arc::clone(&model), PoolConfig::direct(1))?;
    let largest = match args.mode {
        PoolMode::Direct => usize::from(args.rows),
        PoolMode::Batched => usize::from(args.max_batch.max(args.rows)),
    };
    single.warm_up(Array2::<f32>::zeros((largest, model.inputs())).view())?;
    let plan_bytes = single.stats().arena_bytes;
    let lease = lease_ns(&single)?;
    drop(single);
    say(format!(
        "serve_pool: MLP {} ({} weight bytes), {} row(s) per request, {} requests per run, K = {workers}, {} mode, \
         requests on {}",
        shape.join("-"),
        weight_bytes,
        args.rows,
        args.requests,
        mode_name(args.mode),
        if args.arena_stacks { "the arenas' stacks" } else { "the callers' stacks" }
    ));

    // The idle threads always run: the memory target is carve's growth net of theirs.
    let mut variants: Vec<(&str, usize, PoolMode)> =
        vec![("carve", workers, args.mode), ("idle_threads", 0, args.mode)];
    if !args.no_baselines {
        variants.push(("network_per_thread", 0, PoolMode::Direct));
        variants.push(("mutex_network", 0, PoolMode::Direct));
        #[cfg(feature = "candle")]
        variants.push(("candle", 0, PoolMode::Direct));
    }
    let mut results: BTreeMap<&str, Vec<Value>> = BTreeMap::new();
    say(format!(
        "{:<20} {:>7} {:>12} {:>9} {:>9} {:>12} {:>12} {:>11}",
        "variant", "callers", "requests/s", "p50 µs", "p99 µs", "peak RSS", "arena bytes", "allocs/req"
    ));
    for &t in &threads {
        for &(variant, k, mode) in &variants {
            let run = run_child(args, variant, t, k, mode)?;
            say(format!(
                "{:<20} {:>7} {:>12.0} {:>9.1} {:>9.1} {:>12} {:>12} {:>11.2}",
                variant,
                t,
                number(&run, "requests_per_sec"),
                number(&run, "p50_us"),
                number(&run, "p99_us"),
                run["peak_rss_bytes"].as_u64().map_or("n/a".into(), |b| b.to_string()),
                run["arena_bytes"],
                number(&run, "heap_allocs_per_request"),
            ));
            results.entry(variant).or_default().push(run);
        }
    }
    let runs = results.remove("carve").unwrap_or_default();
    let rss = |run: Option<&Value>| run.and_then(|r| r["peak_rss_bytes"].as_f64());
    let (first, last) = (rss(runs.first()), rss(runs.last()));
    let rss_growth = first.zip(last).map(|(a, b)| b / a);
    let rss_growth_bytes = first.zip(last).map(|(a, b)| b - a);
    let idle = results.get("idle_threads");
    let idle_growth_bytes = rss(idle.and_then(|r| r.last())).zip(rss(idle.and_then(|r| r.first()))).map(|(b, a)| b - a);
    // The target, net of the callers' own threads: at most 1% of the fewest callers' peak
    // plus 1 MiB.
    let net_growth_bytes = rss_growth_bytes.zip(idle_growth_bytes).map(|(carve, idle)| carve - idle);
    let allowed_bytes = first.map(|a| a * 0.01 + f64::from(1u32 << 20));

    // K = 2 over K = 1 in direct mode at the most callers: three alternating pairs.
    let mut ratios = Vec::new();
    for _ in 0..3 {
        let one = run_child(args, "carve", most, 1, PoolMode::Direct)?;
        let two = run_child(args, "carve", most, 2, PoolMode::Direct)?;
        ratios.push(number(&two, "requests_per_sec") / number(&one, "requests_per_sec"));
    }
    let speedup = median(ratios.clone());
    // Batched against direct at the most callers, K as given.
    let direct = run_child(args, "carve", most, workers, PoolMode::Direct)?;
    let batched = run_child(args, "carve", most, workers, PoolMode::Batched)?;
    let batched_over_direct = number(&batched, "requests_per_sec") / number(&direct, "requests_per_sec");
    let arena = runs.last().and_then(|r| r["arena_bytes"].as_f64()).unwrap_or(f64::NAN);
    let arena_over_plans = arena / (workers as f64 * plan_bytes as f64);

    say(String::new());
    say(format!(
        "peak RSS at {most} callers over {}: {:.4}× ({:+.0} bytes), of which the caller threads' own (idle threads, \
         same counts): {:+.0} bytes",
        threads[0],
        rss_growth.unwrap_or(f64::NAN),
        rss_growth_bytes.unwrap_or(f64::NAN),
        idle_growth_bytes.unwrap_or(f64::NAN)
    ));
    say(format!(
        "  net of the caller threads: {:+.0} bytes (goal: at most 1% + 1 MiB = {:.0} bytes)",
        net_growth_bytes.unwrap_or(f64::NAN),
        allowed_bytes.unwrap_or(f64::NAN)
    ));
    say(format!(
        "arena bytes over K × plan ({plan_bytes} bytes): {arena_over_plans:.3} (goal: 1); weights {weight_bytes} bytes, \
         held once"
    ));
    say(format!("uncontended lease: {lease:.1} ns (goal: at most 100)"));
    say(format!(
        "direct, {most} callers: K = 2 over K = 1: {speedup:.2}× (pairs {:?}; goal: at least 1.6)",
        ratios.iter().map(|r| (r * 100.0).round() / 100.0).collect::<Vec<_>>()
    ));
    say(format!(
        "{most} callers, K = {workers}: batched over direct {batched_over_direct:.2}× ({:.0} against {:.0} requests/s; \
         goal: at least 1)",
        number(&batched, "requests_per_sec"),
        number(&direct, "requests_per_sec")
    ));
    if args.json {
        let object = json!({
            "shape": args.shape,
            "rows_per_request": args.rows,
            "max_batch": args.max_batch,
            "max_wait_us": args.max_wait_us,
            "requests_per_run": args.requests,
            "workers": workers,
            "mode": mode_name(args.mode),
            "weight_bytes": weight_bytes,
            "plan_bytes": plan_bytes,
            "arena_over_k_plans": arena_over_plans,
            "runs": runs,
            "rss_growth": rss_growth,
            "rss_growth_bytes": rss_growth_bytes,
            "idle_threads_rss_growth_bytes": idle_growth_bytes,
            "rss_growth_net_bytes": net_growth_bytes,
            "rss_growth_net_allowed_bytes": allowed_bytes,
            "arena_stacks": args.arena_stacks,
            "speedup_k2_over_k1": speedup,
            "speedup_k2_over_k1_pairs": ratios,
            "batched_over_direct": batched_over_direct,
            "batched_over_direct_threads": most,
            "lease_ns": lease,
            "baselines": results,
        });
        println!("{object}");
    }
    Ok(())
}
