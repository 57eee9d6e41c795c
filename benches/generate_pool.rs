//! Generation benchmark: a GPT (`train_gpt`'s shape: 4 blocks, 4 heads, width 128,
//! context 64, 77 symbols; untrained, seed 7) serving 1 … 64 concurrent generation
//! streams from an [`InferencePool`] of K arenas (each stream leases an arena for its
//! life, so K streams run at once whatever the number of callers), against (with the
//! `candle` feature) candle running the same weights with its own key/value cache
//! (`candle_nn::kv_cache::KvCache`) on every caller thread, its products one thread each
//! (`RAYON_NUM_THREADS=1`), as carve's.
//!
//! Each run is a fresh child process: the model built, every arena warmed up (K streams
//! at once, each through a slide of its window), every caller thread started and warmed
//! up (one whole stream each), `VmHWM` reset, then the timed streams: each caller runs streams of `--tokens` tokens from an
//! 8-token prompt of its own until its share of the run's tokens is done, each token
//! timed alone. The figures per run: tokens per second, p50 and p99 per token, peak RSS,
//! heap allocations per token (token steps only: carve's counting allocator on each
//! caller's thread around each step) and per stream start.
//!
//! The memory target is net of the callers' own threads, as in `serve_pool`: the growth
//! of carve's peak RSS from the fewest callers to the most, less the growth of an
//! idle-thread baseline at the same counts; both figures are reported, with the arena
//! bytes (K × (plan + cache)) and one stream's `kv_cache_bytes`.
//!
//! With `--stream-batch S`, also a run of callers that join stream batches
//! (`InferencePool::stream_batch`: one per arena, of S slots each; caller `t` joins batch
//! `t mod K`; a step waits at most 1 ms for the streams that have not queued theirs),
//! whose steps are combined across callers (`carve_combined` in `runs`).
//!
//! Also measured in the same invocation: `batched_16_over_1` (one caller stepping 16
//! streams together, `Model::streams`, against one stream, tokens per second, each
//! through slides of its window every 28 tokens) and `batched_16_over_1_no_slides` (the
//! same, steps within the window only: each round's streams start from their prompts
//! and step 55 tokens).
//!
//! ```text
//! cargo run --release --example generate_pool -- --json
//! cargo run --release --example generate_pool -- --threads 1,2,4,8,16,32,64 --workers 2 --json
//! cargo run --release --example generate_pool --features candle -- --json    # with candle
//! ```

use std::process::Command;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use carve::alloc_check::{thread_counts, CountingAllocator};
use carve::nn::serve::{BatchedStream, InferencePool, Model, PoolConfig, Sampling, StreamBatch};
use carve::nn::{Network, NetworkConfig};
use clap::Parser;
use serde_json::{json, Value};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::system();

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const VOCAB: usize = 77;
const WIDTH: usize = 128;
const HEADS: usize = 4;
const LAYERS: usize = 4;
const CONTEXT: usize = 64;
/// Tokens of each stream's prompt.
const PROMPT: usize = 8;
/// How long a stream batch's step waits for the streams that have not queued theirs.
const MAX_WAIT: Duration = Duration::from_millis(1);

/// Generation benchmark: a GPT serving 1 … 64 concurrent streams from an
/// inference pool of K arenas, against (feature `candle`) candle with its
/// own KV cache; tokens per second, latency per token, peak RSS and heap
/// allocations per caller count. See benches/README.md.
#[derive(Parser, Debug, Clone)]
#[command(name = "generate_pool", verbatim_doc_comment, next_line_help = true)]
struct Args {
    /// Caller thread counts, comma-separated (each 1 to 256)
    #[arg(long, value_name = "N,N,...", value_delimiter = ',', default_value = "1,2,4,8,16,32,64",
          value_parser = clap::value_parser!(u16).range(1..=256))]
    threads: Vec<u16>,
    /// The pool's arenas (1 to 256)
    #[arg(long, value_name = "K", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=256))]
    workers: u16,
    /// Timed tokens per run, shared among its callers (at least
    /// 100)
    #[arg(long, value_name = "N", default_value_t = 6_000, value_parser = clap::value_parser!(u32).range(100..),
          verbatim_doc_comment)]
    total: u32,
    /// Tokens per stream (1 to 10000; past 56 a stream's window
    /// slides)
    #[arg(long, value_name = "N", default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=10_000),
          verbatim_doc_comment)]
    tokens: u32,
    /// Run the streams' steps on their arenas' own stacks
    /// (PoolConfig::with_arena_stacks)
    #[arg(long, verbatim_doc_comment)]
    arena_stacks: bool,
    /// Also run callers that join stream batches of S slots, one
    /// per arena, their steps combined (1 to 256)
    #[arg(long, value_name = "S", value_parser = clap::value_parser!(u16).range(1..=256), verbatim_doc_comment)]
    stream_batch: Option<u16>,
    /// Skip the baselines (carve's runs only)
    #[arg(long)]
    no_baselines: bool,
    /// Print one JSON object as the last line
    #[arg(long)]
    json: bool,
    /// Internal: one run in this fresh process (VARIANT THREADS
    /// WORKERS)
    #[arg(long, num_args = 3, value_names = ["VARIANT", "THREADS", "WORKERS"], hide = true)]
    child: Option<Vec<String>>,
}

fn main() {
    let args = Args::parse();
    let result = match &args.child {
        Some(child) => {
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
        eprintln!("generate_pool: error: {e}");
        std::process::exit(1);
    }
}

/// The benchmark's GPT (untrained: the speed is the same), frozen.
fn model() -> Res<Model> {
    let mut b = NetworkConfig::builder(VOCAB).embedding(WIDTH).position_embedding(CONTEXT);
    for _ in 0..LAYERS {
        b = b
            .residual(|b| b.layer_norm().attention(HEADS))
            .residual(|b| b.layer_norm().dense(4 * WIDTH).gelu().dense(WIDTH));
    }
    Ok(Network::new(b.layer_norm().dense(VOCAB).seed(7).build()?)?.freeze()?)
}

/// Caller `t`'s prompt.
fn prompt(t: usize) -> Vec<u32> {
    (0..PROMPT).map(|i| ((t * 31 + i * 7) % VOCAB) as u32).collect()
}

/// What a run measured.
struct Measured {
    tokens_per_sec: f64,
    p50_us: f64,
    p99_us: f64,
    peak_rss_bytes: Option<u64>,
    allocs_per_token: f64,
    allocs_per_stream: f64,
}

/// One caller's generator: streams of its own from `prompt`, a token at a time.
trait Generator {
    /// Starts a stream.
    fn start(&mut self, prompt: &[u32]);
    /// The stream's next token.
    fn next(&mut self) -> u32;
    /// Ends the stream.
    fn end(&mut self);
}

/// Runs `threads` callers, each with the generator `make(thread)` made in its thread:
/// a warm-up stream, a reset of the peak RSS, then its share of `args.total` tokens in
/// streams of `args.tokens`. The latencies are allocated before the threads start.
fn callers<G: Generator, M: Fn(usize) -> G + Sync>(args: &Args, threads: usize, make: M) -> Res<Measured> {
    let per_stream = args.tokens as usize;
    let per_thread = (args.total as usize).div_ceil(threads).div_ceil(per_stream) * per_stream;
    let mut latencies = vec![u32::MAX; per_thread * threads];
    let mut counts = vec![(0u64, 0u64); threads];
    let barrier = Barrier::new(threads + 1);
    let (mut wall, mut peak) = (Duration::ZERO, None);
    std::thread::scope(|s| -> Res<()> {
        let handles: Vec<_> = latencies
            .chunks_mut(per_thread)
            .zip(counts.iter_mut())
            .enumerate()
            .map(|(t, (times, count))| {
                let (barrier, make) = (&barrier, &make);
                let prompt = prompt(t);
                std::thread::Builder::new()
                    .stack_size(256 * 1024)
                    .spawn_scoped(s, move || {
                        let mut generator = make(t);
                        generator.start(&prompt);
                        for _ in 0..per_stream.max(CONTEXT + 1) {
                            std::hint::black_box(generator.next());
                        }
                        generator.end();
                        barrier.wait(); // warmed up
                        barrier.wait(); // measured from here
                        for stream in times.chunks_mut(per_stream) {
                            let before = thread_counts().allocations;
                            generator.start(&prompt);
                            count.1 += thread_counts().allocations - before;
                            for time in stream.iter_mut() {
                                let (before, begin) = (thread_counts().allocations, Instant::now());
                                std::hint::black_box(generator.next());
                                *time = begin.elapsed().as_nanos().min(u128::from(u32::MAX)) as u32;
                                count.0 += thread_counts().allocations - before;
                            }
                            generator.end();
                        }
                        barrier.wait(); // done
                    })
                    .expect("a caller thread")
            })
            .collect();
        barrier.wait();
        let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
        let start = Instant::now();
        barrier.wait();
        barrier.wait();
        wall = start.elapsed();
        peak = peak_rss_bytes().filter(|_| reset);
        for handle in handles {
            handle.join().map_err(|_| "a caller thread panicked")?;
        }
        Ok(())
    })?;
    latencies.sort_unstable();
    let quantile = |q: f64| f64::from(latencies[((latencies.len() - 1) as f64 * q).round() as usize]) / 1000.0;
    let tokens = latencies.len() as f64;
    let streams = tokens / per_stream as f64;
    Ok(Measured {
        tokens_per_sec: tokens / wall.as_secs_f64(),
        p50_us: quantile(0.5),
        p99_us: quantile(0.99),
        peak_rss_bytes: peak,
        allocs_per_token: counts.iter().map(|c| c.0).sum::<u64>() as f64 / tokens,
        allocs_per_stream: counts.iter().map(|c| c.1).sum::<u64>() as f64 / streams,
    })
}

/// A caller of the pool: a stream of its own per stream, in a leased arena.
struct PoolCaller<'p> {
    pool: &'p InferencePool,
    stream: Option<carve::nn::serve::TokenStream<'p>>,
}

impl Generator for PoolCaller<'_> {
    fn start(&mut self, prompt: &[u32]) {
        self.stream = Some(self.pool.stream(prompt, Sampling::greedy()).expect("a stream"));
    }
    fn next(&mut self) -> u32 {
        self.stream.as_mut().expect("started").next_token().expect("a token")
    }
    fn end(&mut self) {
        self.stream = None;
    }
}

/// A caller of a stream batch: a stream of its own per stream, in a slot of the batch,
/// its steps combined with the other callers'.
struct BatchCaller<'b, 'p> {
    batch: &'b StreamBatch<'p>,
    stream: Option<BatchedStream<'b, 'p>>,
}

impl Generator for BatchCaller<'_, '_> {
    fn start(&mut self, prompt: &[u32]) {
        self.stream = Some(self.batch.join(prompt, Sampling::greedy()).expect("a stream"));
    }
    fn next(&mut self) -> u32 {
        self.stream.as_mut().expect("started").next_token().expect("a token")
    }
    fn end(&mut self) {
        self.stream = None;
    }
}

/// The caller of the idle baseline: a token that costs nothing.
struct Idle;

impl Generator for Idle {
    fn start(&mut self, _: &[u32]) {}
    fn next(&mut self) -> u32 {
        0
    }
    fn end(&mut self) {}
}

/// Peak resident set size of the process (`VmHWM`), in bytes.
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.trim_start_matches("VmHWM:").trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}

/// One caller stepping 16 streams together against one stream, tokens per second:
/// `tokens` steps through the windows' slides, and (the second pair) rounds of steps
/// within the window only (each round's streams started afresh, untimed).
fn batched_over_one(model: &Model, tokens: usize) -> Res<((f64, f64), (f64, f64))> {
    let within = CONTEXT - PROMPT - 1;
    let rate = |streams: usize, slides: bool| -> Res<f64> {
        let prompts: Vec<Vec<u32>> = (0..streams).map(prompt).collect();
        let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
        let sampling = vec![Sampling::greedy(); streams];
        let mut batch = model.streams(&refs, &sampling)?;
        let mut out = vec![0u32; streams];
        for _ in 0..CONTEXT + 1 {
            batch.next_tokens(&mut out)?;
        }
        let mut timed = Duration::ZERO;
        let mut steps = 0;
        while steps < tokens {
            if !slides {
                batch = model.streams(&refs, &sampling)?;
            }
            let start = Instant::now();
            for _ in 0..if slides { tokens } else { within } {
                batch.next_tokens(&mut out)?;
                steps += 1;
            }
            timed += start.elapsed();
        }
        Ok((steps * streams) as f64 / timed.as_secs_f64())
    };
    Ok(((rate(1, true)?, rate(16, true)?), (rate(1, false)?, rate(16, false)?)))
}

fn child_run(args: &Args, child: &[String]) -> Res<()> {
    let [variant, threads, workers] = child else { return Err("--child takes 3 values".into()) };
    let threads: usize = threads.parse()?;
    let workers: usize = workers.parse()?;
    let model = Arc::new(model()?);
    let (measured, arena_bytes) = match variant.as_str() {
        "carve" => {
            let config = PoolConfig::direct(workers).with_arena_stacks(args.arena_stacks);
            let pool = InferencePool::new(Arc::clone(&model), config)?;
            // Every arena runs a whole stream first (K at once: each leases its own), so
            // that each holds its plans and buffers whatever the number of callers.
            {
                let mut warm: Vec<_> =
                    (0..workers).map(|t| pool.stream(&prompt(t), Sampling::greedy())).collect::<carve::Result<_>>()?;
                for _ in 0..CONTEXT + 1 {
                    for stream in &mut warm {
                        stream.next_token()?;
                    }
                }
            }
            let measured = callers(args, threads, |_| PoolCaller { pool: &pool, stream: None })?;
            (measured, pool.stats().arena_bytes)
        }
        "carve_combined" => {
            let slots = usize::from(args.stream_batch.ok_or("carve_combined needs --stream-batch")?);
            let pool = InferencePool::new(Arc::clone(&model), PoolConfig::direct(workers))?;
            let batches: Vec<StreamBatch<'_>> =
                (0..workers).map(|_| pool.stream_batch(slots, MAX_WAIT)).collect::<carve::Result<_>>()?;
            // Every batch runs a full set of streams first, stepped by as many callers,
            // so that it holds its plans for any number of streams in a step.
            std::thread::scope(|s| {
                for batch in &batches {
                    for t in 0..slots {
                        s.spawn(move || {
                            let mut caller = BatchCaller { batch, stream: None };
                            caller.start(&prompt(t));
                            for _ in 0..CONTEXT + 1 {
                                caller.next();
                            }
                        });
                    }
                }
            });
            let measured = callers(args, threads, |t| BatchCaller { batch: &batches[t % workers], stream: None })?;
            (measured, pool.stats().arena_bytes)
        }
        "idle_threads" => (callers(args, threads, |_| Idle)?, 0),
        #[cfg(feature = "candle")]
        "candle" => {
            let path = std::env::temp_dir().join(format!("generate-pool-{}.safetensors", std::process::id()));
            model.save(&path)?;
            let gpt = Arc::new(candle_gpt::Gpt::load(&path)?);
            let _ = std::fs::remove_file(&path);
            let gpt = &gpt;
            // The peer runs the same model: its greedy tokens are carve's (a check of the
            // comparison, not of either; the sums' orders differ, so a near tie could
            // part them).
            let mut peer = candle_gpt::Caller::new(gpt);
            peer.start(&prompt(0));
            let theirs: Vec<u32> = (0..CONTEXT + 8).map(|_| peer.next()).collect();
            let ours = model.generate(&prompt(0), CONTEXT + 8, Sampling::greedy())?;
            if theirs != ours {
                eprintln!("generate_pool: candle's greedy tokens differ from carve's: {theirs:?} vs {ours:?}");
            }
            (callers(args, threads, |_| candle_gpt::Caller::new(gpt))?, 0)
        }
        other => return Err(format!("unknown variant '{other}'").into()),
    };
    let m = measured;
    println!(
        "{}",
        json!({
            "threads": threads,
            "tokens_per_sec": m.tokens_per_sec,
            "p50_us": m.p50_us,
            "p99_us": m.p99_us,
            "peak_rss_bytes": m.peak_rss_bytes,
            "arena_bytes": arena_bytes,
            "allocs_per_token": m.allocs_per_token,
            "allocs_per_stream": m.allocs_per_stream,
        })
    );
    Ok(())
}

#[cfg(feature = "candle")]
mod candle_gpt {
    //! The same GPT in candle, from the weights carve saved (PyTorch's layouts and
    //! nanoGPT's structure; carve's names), generating with candle-nn's own key/value
    //! cache (`KvCache`, appended per token), greedy, the window sliding as carve's.
    use candle_core::{DType, Device, Module, Tensor, D};
    use candle_nn::kv_cache::KvCache;
    use candle_nn::{Embedding, LayerNorm, Linear};

    use super::{CONTEXT, HEADS, LAYERS, WIDTH};

    struct Block {
        ln_1: LayerNorm,
        qkv: Linear,
        proj: Linear,
        ln_2: LayerNorm,
        fc: Linear,
        fc_proj: Linear,
    }

    pub(crate) struct Gpt {
        wte: Embedding,
        wpe: Embedding,
        blocks: Vec<Block>,
        ln_f: LayerNorm,
        head: Linear,
    }

    impl Gpt {
        /// The GPT of a file carve saved (a GPT's tensors under nanoGPT's names).
        pub(crate) fn load(path: &std::path::Path) -> candle_core::Result<Gpt> {
            let t = candle_core::safetensors::load(path, &Device::Cpu)?;
            let get = |name: &str| -> candle_core::Result<Tensor> {
                t.get(name).cloned().ok_or_else(|| candle_core::Error::Msg(format!("no tensor {name}")))
            };
            let norm = |p: &str| -> candle_core::Result<LayerNorm> {
                Ok(LayerNorm::new(get(&format!("{p}.weight"))?, get(&format!("{p}.bias"))?, 1e-5))
            };
            let linear = |p: &str| -> candle_core::Result<Linear> {
                Ok(Linear::new(get(&format!("{p}.weight"))?, Some(get(&format!("{p}.bias"))?)))
            };
            let blocks = (0..LAYERS)
                .map(|i| {
                    let h = format!("transformer.h.{i}");
                    Ok(Block {
                        ln_1: norm(&format!("{h}.ln_1"))?,
                        qkv: linear(&format!("{h}.attn.c_attn"))?,
                        proj: linear(&format!("{h}.attn.c_proj"))?,
                        ln_2: norm(&format!("{h}.ln_2"))?,
                        fc: linear(&format!("{h}.mlp.c_fc"))?,
                        fc_proj: linear(&format!("{h}.mlp.c_proj"))?,
                    })
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            Ok(Gpt {
                wte: Embedding::new(get("transformer.wte.weight")?, WIDTH),
                wpe: Embedding::new(get("transformer.wpe.weight")?, WIDTH),
                blocks,
                ln_f: norm("transformer.ln_f")?,
                head: linear("lm_head")?,
            })
        }

        /// The logits of the last of `ids` (`[1, T]`) at positions `pos ..`, the keys and
        /// values appended to `caches`.
        fn step(&self, ids: &Tensor, pos: usize, caches: &mut [KvCache]) -> candle_core::Result<Tensor> {
            let (b, t) = ids.dims2()?;
            let hd = WIDTH / HEADS;
            let positions = Tensor::arange(pos as u32, (pos + t) as u32, &Device::Cpu)?;
            let mut x = self.wte.forward(ids)?.broadcast_add(&self.wpe.forward(&positions)?)?;
            for (blk, cache) in self.blocks.iter().zip(caches.iter_mut()) {
                let qkv = blk.qkv.forward(&blk.ln_1.forward(&x)?)?;
                let head = |i: usize| -> candle_core::Result<Tensor> {
                    qkv.narrow(2, i * WIDTH, WIDTH)?.reshape((b, t, HEADS, hd))?.transpose(1, 2)?.contiguous()
                };
                let (q, k, v) = (head(0)?, head(1)?, head(2)?);
                let (k, v) = cache.append(&k, &v)?;
                let end = pos + t;
                let mut scores = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?;
                if t > 1 {
                    let mask: Vec<f32> =
                        (0..t * end).map(|i| if i % end <= pos + i / end { 0.0 } else { f32::NEG_INFINITY }).collect();
                    scores = scores.broadcast_add(&Tensor::from_vec(mask, (t, end), &Device::Cpu)?)?;
                }
                let probs = candle_nn::ops::softmax_last_dim(&scores)?;
                let y = probs.matmul(&v.contiguous()?)?.transpose(1, 2)?.reshape((b, t, WIDTH))?;
                x = (x + blk.proj.forward(&y)?)?;
                let h = blk.fc.forward(&blk.ln_2.forward(&x)?)?.gelu()?;
                x = (x + blk.fc_proj.forward(&h)?)?;
            }
            let last = x.narrow(1, t - 1, 1)?;
            self.head.forward(&self.ln_f.forward(&last)?)?.flatten_all()
        }
    }

    /// A caller's stream: its caches, window and logits.
    pub(crate) struct Caller<'g> {
        gpt: &'g Gpt,
        caches: Vec<KvCache>,
        window: Vec<u32>,
        logits: Option<Tensor>,
    }

    impl<'g> Caller<'g> {
        pub(crate) fn new(gpt: &'g Gpt) -> Caller<'g> {
            Caller { gpt, caches: Vec::new(), window: Vec::new(), logits: None }
        }

        fn run(&mut self, from: usize) {
            let ids = Tensor::from_slice(&self.window[from..], (1, self.window.len() - from), &Device::Cpu)
                .and_then(|ids| self.gpt.step(&ids, from, &mut self.caches))
                .expect("a candle step");
            self.logits = Some(ids);
        }

        fn fresh_caches() -> Vec<KvCache> {
            (0..LAYERS).map(|_| KvCache::new(2, CONTEXT)).collect()
        }
    }

    impl super::Generator for Caller<'_> {
        fn start(&mut self, prompt: &[u32]) {
            self.caches = Self::fresh_caches();
            self.window = prompt.to_vec();
            self.run(0);
        }

        fn next(&mut self) -> u32 {
            let logits = self.logits.take().expect("started");
            let token =
                logits.argmax(D::Minus1).and_then(|t| t.to_dtype(DType::U32)?.to_scalar::<u32>()).expect("a token");
            self.window.push(token);
            if self.window.len() > CONTEXT {
                let keep = CONTEXT / 2;
                self.window.drain(..self.window.len() - keep);
                self.caches = Self::fresh_caches();
                self.run(0);
            } else {
                let from = self.window.len() - 1;
                self.run(from);
            }
            token
        }

        fn end(&mut self) {
            self.caches.clear();
            self.logits = None;
        }
    }
}

// ---------------------------------------------------------------------------------
// The parent: every run in a child, then the table and the JSON.

fn run_child(args: &Args, variant: &str, threads: usize, workers: usize) -> Res<Value> {
    let exe = std::env::current_exe()?;
    let output = Command::new(exe)
        // A stream is one thread's work in either framework: candle's products one
        // thread each, as carve's.
        .env("RAYON_NUM_THREADS", "1")
        .args(["--total", &args.total.to_string(), "--tokens", &args.tokens.to_string()])
        .args(args.arena_stacks.then_some("--arena-stacks"))
        .args(args.stream_batch.map(|s| format!("--stream-batch={s}")))
        .args(["--child", variant, &threads.to_string(), &workers.to_string()])
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

fn parent(args: &Args) -> Res<()> {
    let workers = usize::from(args.workers);
    let mut variants = vec!["carve"];
    if args.stream_batch.is_some() {
        variants.push("carve_combined");
    }
    if !args.no_baselines {
        variants.push("idle_threads");
        #[cfg(feature = "candle")]
        variants.push("candle");
    }
    let mut runs = serde_json::Map::new();
    for &variant in &variants {
        let mut rows = Vec::new();
        for &threads in &args.threads {
            let run = run_child(args, variant, usize::from(threads), workers)?;
            if !args.json {
                println!(
                    "{variant:>12} {threads:>3} callers: {:>9.0} tokens/s  p50 {:>7.1} µs  p99 {:>8.1} µs  peak RSS {:>6.1} MiB  \
                     {:.3} allocs/token",
                    number(&run, "tokens_per_sec"),
                    number(&run, "p50_us"),
                    number(&run, "p99_us"),
                    number(&run, "peak_rss_bytes") / f64::from(1 << 20),
                    number(&run, "allocs_per_token"),
                );
            }
            rows.push(run);
        }
        runs.insert(variant.to_string(), Value::Array(rows));
    }
    let growth = |variant: &str| -> Option<f64> {
        let rows = runs.get(variant)?.as_array()?;
        Some(number(rows.last()?, "peak_rss_bytes") - number(rows.first()?, "peak_rss_bytes"))
    };
    let carve_growth = growth("carve");
    let idle_growth = growth("idle_threads");
    let model = model()?;
    let ((one, sixteen), (one_within, sixteen_within)) = batched_over_one(&model, 256)?;
    let mut out = json!({
        "workers": workers,
        "tokens_per_stream": args.tokens,
        "kv_cache_bytes": model.kv_cache_bytes()?,
        "weight_bytes": model.weight_bytes(),
        "runs": runs,
        "rss_growth": {
            "carve_bytes": carve_growth,
            "idle_threads_bytes": idle_growth,
            "net_bytes": carve_growth.zip(idle_growth).map(|(c, i)| c - i),
        },
        "batched_16_over_1": sixteen / one,
        "one_stream_tokens_per_sec": one,
        "sixteen_streams_tokens_per_sec": sixteen,
        "batched_16_over_1_no_slides": sixteen_within / one_within,
        "one_stream_no_slides_tokens_per_sec": one_within,
        "sixteen_streams_no_slides_tokens_per_sec": sixteen_within,
    });
    if let Some(candle) = runs.get("candle").and_then(|r| r.as_array()) {
        let carve = runs["carve"].as_array().expect("carve's runs");
        let ratios: Vec<f64> =
            carve.iter().zip(candle).map(|(c, k)| number(c, "tokens_per_sec") / number(k, "tokens_per_sec")).collect();
        out["carve_over_candle"] = json!(ratios);
    }
    if !args.json {
        println!(
            "batched: 16 streams {sixteen:.0} tokens/s, one stream {one:.0} tokens/s ({:.2}x; {:.2}x within the \
             window); RSS growth net of threads: {:?} bytes",
            sixteen / one,
            sixteen_within / one_within,
            carve_growth.zip(idle_growth).map(|(c, i)| c - i),
        );
    }
    println!("{out}");
    Ok(())
}
