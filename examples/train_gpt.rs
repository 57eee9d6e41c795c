//! Trains a character-level GPT on the plays of Shakespeare (`examples/data/shakespeare.txt.gz`,
//! 4,789,735 characters, 77 distinct): nanoGPT's CPU "baby" shape by default — 4 pre-LN
//! blocks of 4 heads, width 128, 64 steps of context, batches of 12 random windows, no
//! dropout, an untied output head, AdamW (lr 1e-3, betas 0.9/0.99, weight decay 0.1 on
//! the matrices): 821,325 parameters.
//!
//! ```text
//! cargo run --release --example train_gpt
//! cargo run --release --example train_gpt -- --iters 200 --compare --json
//! ```
//!
//! Characters are tokens (the sorted distinct characters; a token's id is its index); the
//! first 90% of the text trains, the rest validates. Training batches are random windows
//! of the training split, their targets the same windows one character later, drawn from
//! the seed by `async_iter::TokenWindows` through the prefetch ring; the validation loss
//! is the mean over 20 fixed windows batches of the validation split.
//!
//! | flag | default | what |
//! |---|---|---|
//! | `--iters N` | 2000 | training steps (at most 10,000,000) |
//! | `--eval-every N` | 250 | validation loss every N steps (and after the last; 0: after the last only) |
//! | `--workspace-mode MODE` | `enabled` | `enabled`, `planned` or `none` (ignored with `--compare`) |
//! | `--device host\|sim\|cuda[:N]` | `host` | where each step runs: the CPU, the simulated device (the host's arithmetic in simulated device memory: the same losses) or a GPU (an error naming why where there is none); not with `--workers`, `--breakdown` or `--timeline` |
//! | `--compare` | off | train the three modes (same seed) and check that their loss traces are bit-identical |
//! | `--attention keep\|recompute` | `recompute` | keep the attention probabilities for backward, or only their softmax statistics (the scores rebuilt in backward; the same bits) |
//! | `--threads N` | 1 | threads of each step (`Network::set_threads`, the same bits); not with `--workers` |
//! | `--workers N` | none | train data-parallel with N workers (1 to 256), a one-worker trainer alongside for `speedup_vs_one_worker` |
//! | `--reducer threads\|sequential\|mpi` | `threads` | how the workers reduce (`sequential`: one thread running the N shards in turn, the same bits) |
//! | `--breakdown` | off | where a steady step's time goes (JSON: `breakdown_us`), and the step's products against carve's multiply alone on the same shapes (`step_gflops`, `products_gflops`, `gemm_gflops_same_shapes`, `step_over_gemm`, `products_over_gemm`) |
//! | `--timeline FILE` | none | record the run's workspace memory as a Chrome trace (one mode: not with `--compare`; a path other than `--save`'s) |
//! | `--save PATH` | none | save the trained model (safetensors) |
//! | `--seed S` | 0 | weights, batches and the sample |
//! | `--sample N` | 300 | characters sampled at the end (seeded), from a newline |
//! | `--layers`, `--heads`, `--width`, `--context`, `--batch-size`, `--lr` | 4, 4, 128, 64, 12, 1e-3 | the shape |
//! | `--json` | off | one JSON object on stdout (the rest goes to stderr) |
//!
//! JSON keys (per mode under its name with `--compare`, the first mode's at the top
//! level too): `train_loss` (the mean of the last eval interval's steps), `val_loss`,
//! `val_losses` (each evaluation: `[step, loss]`), `step_us_median`,
//! `steady_state_allocs_max` (heap allocations of the busiest step after the first 10),
//! `workspace_bytes`, `plan_bytes` and `lower_bound_bytes` (one arena planned from a
//! recorded step, and the peak of its live bytes), `predicted_bytes` (the dry run's
//! `workspace_bytes` before the first step; `null` on a device, whose steps hold device
//! memory of their own), `peak_rss_bytes`,
//! `training_rss_growth_bytes` (RSS after 10 steps, or the last of fewer, minus RSS before the first),
//! `params`, `loss_trace_sha256`, `attention`, `attention_kept_bytes` (what a step
//! keeps for backward in its attention layers besides their outputs, in each form),
//! `kept_bytes_per_layer_kind` (each kind's outputs and what it keeps besides), `sample`.

#[path = "common/breakdown.rs"]
mod breakdown;
#[path = "common/cli.rs"]
mod cli;
#[path = "common/parallel.rs"]
mod parallel;
#[path = "common/timeline.rs"]
#[allow(dead_code)]
mod timeline;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::str::FromStr;
use std::time::Instant;

use carve::alloc_check::{reset_thread_peak, thread_counts, CountingAllocator};
use carve::async_iter::{Prefetcher, TokenWindows};
use carve::nn::{
    dry::BatchShape, dry::DryPass, Attention, Device, Input, Labels, Network, NetworkConfig, NetworkConfigBuilder,
    Updater,
};
use carve::workspace_core::timeline::Timeline;
use carve::WorkspaceMode;
use carve_rng::Rng;
use clap::Parser;
use ndarray::{Array2, Ix2};
use serde_json::{json, Value};

use parallel::{parse_reducer, parse_workers, ReducerArg, Setup};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::system();

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Validation batches, fixed for the run.
const VAL_BATCHES: usize = 20;
/// Steps before the steady state (allocation counts and step times start after them).
const WARM_UP: usize = 10;

/// Trains a character-level GPT on the plays of Shakespeare.
#[derive(Parser, Debug)]
#[command(name = "train_gpt", version, verbatim_doc_comment, next_line_help = true)]
struct Args {
    /// Training steps (1 to 10,000,000)
    #[arg(long, value_name = "N", default_value_t = 2000, value_parser = parse_count)]
    iters: usize,
    /// The validation loss every N steps and after the last (0:
    /// after the last only)
    #[arg(long, value_name = "N", default_value_t = 250, verbatim_doc_comment)]
    eval_every: usize,
    /// Workspaces: `enabled`, `planned` or `none` (ignored with
    /// --compare)
    #[arg(long, value_name = "MODE", default_value = "enabled", value_parser = parse_mode, verbatim_doc_comment)]
    workspace_mode: WorkspaceMode,
    /// Train the three modes (same seed) and check that their loss
    /// traces are bit-identical
    #[arg(long, verbatim_doc_comment)]
    compare: bool,
    /// Where each step runs: `host`, `sim` (the simulated device:
    /// the host's arithmetic in simulated device memory), `cuda` or
    /// `cuda:N`; not with --workers, --breakdown or
    /// --timeline
    #[arg(long, value_name = "DEVICE", default_value = "host", value_parser = Device::from_str, verbatim_doc_comment)]
    device: Device,
    /// Attention: `keep` the probabilities for backward, or
    /// `recompute` them from kept softmax statistics
    #[arg(long, value_name = "FORM", default_value = "recompute", value_parser = parse_attention, verbatim_doc_comment)]
    attention: Form,
    /// Threads of each step (1 to 64); not with --workers
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = parse_threads)]
    threads: usize,
    /// Train data-parallel with N workers (1 to 256)
    #[arg(long, value_name = "N", value_parser = parse_workers)]
    workers: Option<usize>,
    /// How the workers reduce: `threads`, `sequential` or `mpi`
    #[arg(long, value_name = "KIND", value_parser = parse_reducer)]
    reducer: Option<ReducerArg>,
    /// Measure where a steady step's time goes
    #[arg(long)]
    breakdown: bool,
    /// Record a timeline of the run's workspace memory to FILE
    /// (a Chrome trace)
    #[arg(long, value_name = "FILE", verbatim_doc_comment)]
    timeline: Option<PathBuf>,
    /// Save the trained model to PATH (safetensors)
    #[arg(long, value_name = "PATH")]
    save: Option<PathBuf>,
    /// Seed of the weights, the batches and the sample
    #[arg(long, value_name = "S", default_value_t = 0)]
    seed: u64,
    /// Characters to sample at the end (0 to 100000)
    #[arg(long, value_name = "N", default_value_t = 300, value_parser = parse_sample)]
    sample: usize,
    /// Transformer blocks (1 to 64)
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = parse_small)]
    layers: usize,
    /// Attention heads (1 to 64; they must divide the width)
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = parse_small)]
    heads: usize,
    /// Features per step (1 to 4096)
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = parse_width)]
    width: usize,
    /// Steps of context (1 to 4096)
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = parse_width)]
    context: usize,
    /// Windows per batch (1 to 4096)
    #[arg(long, value_name = "N", default_value_t = 12, value_parser = parse_width)]
    batch_size: usize,
    /// AdamW learning rate (finite, above 0)
    #[arg(long, value_name = "X", default_value_t = 1e-3, value_parser = parse_lr, allow_negative_numbers = true)]
    lr: f32,
    /// Print one JSON object on stdout (the rest goes to stderr)
    #[arg(long)]
    json: bool,
}

/// The most training steps: a run keeps a loss, a time and an allocation count per
/// step, and plans its passes before the first.
const MAX_ITERS: usize = 10_000_000;

fn parse_count(s: &str) -> Result<usize, String> {
    cli::bounded(s, 1, MAX_ITERS)
}

fn parse_small(s: &str) -> Result<usize, String> {
    cli::bounded(s, 1, 64)
}

fn parse_threads(s: &str) -> Result<usize, String> {
    cli::bounded(s, 1, 64)
}

fn parse_width(s: &str) -> Result<usize, String> {
    cli::bounded(s, 1, 4096)
}

fn parse_sample(s: &str) -> Result<usize, String> {
    cli::bounded(s, 0, 100_000)
}

fn parse_lr(s: &str) -> Result<f32, String> {
    let lr: f32 = s.parse().map_err(|_| format!("'{s}' is not a number"))?;
    if !(lr.is_finite() && lr > 0.0) {
        return Err(format!("{lr} must be finite and above 0"));
    }
    Ok(lr)
}

fn parse_mode(s: &str) -> Result<WorkspaceMode, String> {
    s.parse::<WorkspaceMode>().map_err(|e| e.to_string())
}

/// Where the attention probabilities live between forward and backward.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Form {
    /// Kept.
    Keep,
    /// Rebuilt in backward from kept softmax statistics.
    Recompute,
}

fn parse_attention(s: &str) -> Result<Form, String> {
    match s {
        "keep" => Ok(Form::Keep),
        "recompute" => Ok(Form::Recompute),
        other => Err(format!("'{other}' is not an attention form: keep or recompute")),
    }
}

fn mode_name(mode: WorkspaceMode) -> &'static str {
    match mode {
        WorkspaceMode::Enabled => "enabled",
        WorkspaceMode::Planned => "planned",
        WorkspaceMode::None => "none",
    }
}

/// The corpus as tokens: the sorted distinct characters, each character's index.
struct Corpus {
    chars: Vec<char>,
    train: Vec<u32>,
    val: Vec<u32>,
}

impl Corpus {
    fn load() -> Res<Corpus> {
        let path = std::env::var_os("TRAIN_GPT_DATA")
            .map(PathBuf::from)
            .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/data/shakespeare.txt.gz"));
        let file = std::fs::File::open(&path)
            .map_err(|e| format!("cannot open {} ({e}); TRAIN_GPT_DATA overrides the path", path.display()))?;
        let mut text = String::new();
        flate2::read::GzDecoder::new(file)
            .read_to_string(&mut text)
            .map_err(|e| format!("{} is not gzip-compressed UTF-8 text: {e}", path.display()))?;
        let mut chars: Vec<char> = text.chars().collect::<std::collections::BTreeSet<_>>().into_iter().collect();
        chars.sort_unstable();
        let ids: Vec<u32> = text
            .chars()
            .map(|c| chars.binary_search(&c).expect("every character is in the vocabulary") as u32)
            .collect();
        let split = ids.len() * 9 / 10;
        if split < 2 || ids.len() - split < 2 {
            return Err(format!("{} holds {} characters: too few to split", path.display(), ids.len()).into());
        }
        Ok(Corpus { chars, val: ids[split..].to_vec(), train: ids[..split].to_vec() })
    }
}

/// The GPT of the command line.
fn gpt(args: &Args, vocab: usize, mode: WorkspaceMode) -> carve::Result<NetworkConfig> {
    let (d, heads) = (args.width, args.heads);
    let mut b: NetworkConfigBuilder = NetworkConfig::builder(vocab).embedding(d).position_embedding(args.context);
    for _ in 0..args.layers {
        b = b.residual(|b| match args.attention {
            Form::Recompute => b.layer_norm().attention_recompute(heads),
            Form::Keep => b.layer_norm().attention(heads),
        });
        b = b.residual(|b| b.layer_norm().dense(4 * d).gelu().dense(d));
    }
    b.layer_norm()
        .dense(vocab)
        .updater(Updater::AdamW { learning_rate: args.lr, beta1: 0.9, beta2: 0.99, epsilon: 1e-8, weight_decay: 0.1 })
        .seed(args.seed)
        .device(args.device)
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode)
        .build()
}

/// One matrix product of a training step: `m × k` by `k × n`, either operand read
/// transposed as the step reads it.
#[derive(Clone, Copy)]
struct Product {
    m: usize,
    n: usize,
    k: usize,
    a_t: bool,
    b_t: bool,
}

impl Product {
    fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
}

/// Every matrix product of one training step of the command line's GPT, as its layers
/// issue them: per dense map `in → out` over the batch's rows, `x·W`, `xᵀ·dy` and
/// `dy·Wᵀ`; per head of each sequence, the scores `q·kᵀ` and `p·v` forward and, backward,
/// the scores again (recompute form), `dO·vᵀ`, `pᵀ·dO`, `dS·k` and `dSᵀ·q`.
fn step_products(args: &Args, vocab: usize) -> Vec<Product> {
    let (d, t, rows) = (args.width, args.context, args.batch_size * args.context);
    let hd = d / args.heads;
    let dense = |inputs: usize, outputs: usize| {
        [
            Product { m: rows, n: outputs, k: inputs, a_t: false, b_t: false },
            Product { m: inputs, n: outputs, k: rows, a_t: true, b_t: false },
            Product { m: rows, n: inputs, k: outputs, a_t: false, b_t: true },
        ]
    };
    let mut head = vec![
        Product { m: t, n: t, k: hd, a_t: false, b_t: true },
        Product { m: t, n: hd, k: t, a_t: false, b_t: false },
        Product { m: t, n: t, k: hd, a_t: false, b_t: true },
        Product { m: t, n: hd, k: t, a_t: true, b_t: false },
        Product { m: t, n: hd, k: t, a_t: false, b_t: false },
        Product { m: t, n: hd, k: t, a_t: true, b_t: false },
    ];
    if args.attention == Form::Recompute {
        head.push(Product { m: t, n: t, k: hd, a_t: false, b_t: true });
    }
    let mut all = Vec::new();
    for _ in 0..args.layers {
        all.extend(dense(d, 3 * d));
        all.extend(dense(d, d));
        for _ in 0..args.batch_size * args.heads {
            all.extend(head.iter().copied());
        }
        all.extend(dense(d, 4 * d));
        all.extend(dense(4 * d, d));
    }
    all.extend(dense(d, vocab));
    all
}

/// GFLOP/s of carve's matrix multiply alone (one thread) on `products`, the median of
/// `rounds` rounds of the whole set after three untimed ones.
fn gemm_alone_gflops(products: &[Product], rounds: usize) -> Res<f64> {
    use carve::nn::gemm::{scratch_len, sgemm};
    use std::mem::MaybeUninit;
    let fill =
        |r: usize, c: usize| Array2::from_shape_fn((r, c), |(i, j)| (((i * 31 + j * 17) % 97) as f32 / 97.0) - 0.5);
    let operands: Vec<_> = products
        .iter()
        .map(|p| {
            let a = if p.a_t { fill(p.k, p.m) } else { fill(p.m, p.k) };
            let b = if p.b_t { fill(p.n, p.k) } else { fill(p.k, p.n) };
            (a, b, Array2::<f32>::zeros((p.m, p.n)))
        })
        .collect();
    let need = products.iter().map(|p| scratch_len(p.m, p.n, p.k)).max().unwrap_or(0);
    let mut scratch = vec![MaybeUninit::<f32>::uninit(); need];
    let flops: f64 = products.iter().map(Product::flops).sum();
    let mut operands = operands;
    let mut times = Vec::with_capacity(rounds);
    for round in 0..rounds + 3 {
        let t0 = Instant::now();
        for (p, (a, b, c)) in products.iter().zip(operands.iter_mut()) {
            let a = if p.a_t { a.t() } else { a.view() };
            let b = if p.b_t { b.t() } else { b.view() };
            sgemm(1.0, a, b, 0.0, c.view_mut(), &mut scratch)?;
        }
        if round >= 3 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(flops / times[times.len() / 2] / 1e9)
}

/// Resident set size now, and its peak (`VmRSS`, `VmHWM` in /proc/self/status), in bytes.
fn rss() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l[name.len()..].trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// What one mode's run measured.
struct Run {
    losses: Vec<f32>,
    step_ns: Vec<u64>,
    allocs: Vec<u64>,
    val: Vec<(usize, f64)>,
    json: Value,
}

/// The fixed validation batches: the same windows of the validation split every time,
/// whichever way the run trains.
fn validation_batches(args: &Args, corpus: &Corpus) -> Res<Prefetcher<TokenWindows>> {
    let windows = TokenWindows::new(corpus.val.clone(), args.context, args.batch_size, VAL_BATCHES)?;
    Ok(Prefetcher::builder(windows.seeded(args.seed ^ 0x76616c).fixed()).build()?)
}

/// The mean loss over the fixed validation batches.
fn validate(net: &mut Network, val: &mut Prefetcher<TokenWindows>) -> Res<f64> {
    let mut sum = 0.0f64;
    let mut n = 0;
    while let Some(lease) = val.next() {
        let lease = lease?;
        let (x, y) = (lease.features::<u32, Ix2>()?, lease.labels::<u32, Ix2>()?);
        // The mean cross-entropy of the batch's next characters.
        let probs = net.output(Input::tokens(x))?;
        let batch: f64 =
            probs.rows().into_iter().zip(y.iter()).map(|(p, &next)| -f64::from(p[next as usize].max(1e-12)).ln()).sum();
        sum += batch / y.len() as f64;
        n += 1;
    }
    val.reset()?;
    Ok(sum / n.max(1) as f64)
}

/// `n` characters sampled from the network, one at a time from a newline, each from the
/// distribution at the last step of the context so far.
fn sample(net: &mut Network, corpus: &Corpus, n: usize, context: usize, seed: u64) -> Res<String> {
    let mut rng = Rng::new(seed ^ 0x005a_4d50_4c45);
    let newline = corpus.chars.binary_search(&'\n').unwrap_or(0) as u32;
    let mut tokens = vec![newline];
    let mut out = String::with_capacity(n);
    for _ in 0..n {
        let start = tokens.len().saturating_sub(context);
        let window = Array2::from_shape_vec((1, tokens.len() - start), tokens[start..].to_vec())?;
        let probs = net.output(Input::tokens(window.view()))?;
        let last = probs.row(probs.nrows() - 1);
        let mut u = rng.next_f32();
        let mut next = last.len() - 1;
        for (i, &p) in last.iter().enumerate() {
            if u < p {
                next = i;
                break;
            }
            u -= p;
        }
        tokens.push(next as u32);
        out.push(corpus.chars[next]);
    }
    Ok(out)
}

/// Saves the trained model with its characters (the vocabulary `examples/generate.rs`
/// reads text by).
fn save(net: &Network, corpus: &Corpus, path: &Path) -> Res<()> {
    let symbols: String = corpus.chars.iter().collect();
    let model = net.freeze()?.with_symbols(&symbols)?;
    model.save(path).map_err(|e| format!("saving the model: {e}").into())
}

/// One mode's training run.
fn train(args: &Args, corpus: &Corpus, mode: WorkspaceMode, say: &dyn Fn(String)) -> Res<Run> {
    let vocab = corpus.chars.len();
    let config = gpt(args, vocab, mode)?;
    let mut net = Network::new(config)?;
    net.set_threads(args.threads)?;
    let params = net.params().len();
    // What the run will take, before its first step.
    // The run's passes: its steps, and the validation batches' inferences at each
    // evaluation.
    let shape = BatchShape::tokens(args.batch_size, args.context);
    let evaluations = args.iters.checked_div(args.eval_every).map_or(1, |n| n + 1);
    let mut passes = Vec::with_capacity(args.iters + VAL_BATCHES * evaluations);
    for step in 1..=args.iters {
        passes.push(DryPass::Train(shape));
        if (args.eval_every > 0 && step % args.eval_every == 0) || step == args.iters {
            passes.extend([DryPass::Infer(shape); VAL_BATCHES]);
        }
    }
    // On a device the steps hold device memory of their own: the host's workspaces
    // predict nothing of them.
    let predicted = match args.device {
        Device::Host => Some(net.dry_run(&passes)?.workspace_bytes),
        _ => None,
    };
    let train_source =
        TokenWindows::new(corpus.train.clone(), args.context, args.batch_size, args.iters)?.seeded(args.seed);
    let mut batches = Prefetcher::builder(train_source).build()?;
    let mut val = validation_batches(args, corpus)?;
    let mut timeline = match &args.timeline {
        Some(_) => {
            let t = Timeline::start()?;
            net.attach_timeline(&t)?;
            Some(t)
        }
        None => None,
    };
    let bar = (!args.json).then(|| {
        let bar = indicatif::ProgressBar::new(args.iters as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{prefix:>8} [{bar:30}] {pos}/{len} {msg}")
                .expect("a valid template")
                .progress_chars("=> "),
        );
        bar.set_prefix(mode_name(mode));
        bar
    });
    let mut run = Run {
        losses: Vec::with_capacity(args.iters),
        step_ns: Vec::with_capacity(args.iters),
        allocs: Vec::with_capacity(args.iters),
        val: Vec::new(),
        json: Value::Null,
    };
    let (rss_before, _) = rss();
    let mut rss_after_warm_up = rss_before;
    let mut step = 0;
    while let Some(lease) = batches.next() {
        let lease = lease?;
        let (x, y) = (lease.features::<u32, Ix2>()?, lease.labels::<u32, Ix2>()?);
        if step == 1 {
            // One arena planned from a recorded step: the plan's bytes and its bound.
            net.record_next_iteration();
        }
        if args.breakdown && step == WARM_UP {
            net.set_breakdown(true);
        }
        let before = reset_thread_peak();
        let t0 = Instant::now();
        let loss = net.fit_batch(Input::tokens(x), Labels::from(y))?;
        run.step_ns.push(t0.elapsed().as_nanos() as u64);
        run.allocs.push(thread_counts().allocations - before.allocations);
        run.losses.push(loss);
        drop(lease);
        step += 1;
        // After 10 steps, or after the last of a shorter run.
        if step == WARM_UP.min(args.iters) {
            rss_after_warm_up = rss().0;
        }
        if let Some(bar) = &bar {
            bar.inc(1);
            bar.set_message(format!("loss {loss:.4}"));
        }
        if (args.eval_every > 0 && step % args.eval_every == 0) || step == args.iters {
            let v = validate(&mut net, &mut val)?;
            run.val.push((step, v));
            let line =
                format!("{:>8} step {step:>5}/{}: train loss {loss:.4}, val loss {v:.4}", mode_name(mode), args.iters);
            match &bar {
                Some(bar) => bar.println(line),
                None => say(line),
            }
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let (_, peak_rss) = rss();
    let workspace_bytes = net.workspace_capacity();
    let text = sample(&mut net, corpus, args.sample, args.context, args.seed)?;
    let plan = net.memory_plan();
    let interval = if args.eval_every > 0 { args.eval_every } else { args.iters };
    let tail = &run.losses[run.losses.len().saturating_sub(interval)..];
    let train_loss = tail.iter().map(|&l| f64::from(l)).sum::<f64>() / tail.len().max(1) as f64;
    let mut steady: Vec<u64> = run.step_ns.iter().skip(WARM_UP).copied().collect();
    if steady.is_empty() {
        steady = run.step_ns.clone();
    }
    steady.sort_unstable();
    let step_us_median = steady[steady.len() / 2] as f64 / 1e3;
    // What a step keeps for backward, per layer kind: each layer's output (kept until
    // the backward pass, unless the step computes it again there), and what attention
    // keeps besides.
    let mut kept_by_kind = serde_json::Map::new();
    let rows = args.batch_size * args.context;
    for (i, layer) in net.layers().iter().enumerate() {
        let kind = layer.name().trim_end_matches(|c: char| c.is_ascii_digit()).trim_end_matches('_').to_string();
        let any: &dyn std::any::Any = layer.as_ref();
        let width = layer.output_size(net.layer_inputs(i))?;
        let extra =
            any.downcast_ref::<Attention>().and_then(|a| a.kept_values(args.batch_size, args.context)).unwrap_or(0);
        let output = if net.output_rebuilt(i) { 0 } else { rows * width };
        let bytes = 4 * (output + extra);
        let entry = kept_by_kind.entry(kind).or_insert(json!(0));
        *entry = json!(entry.as_u64().unwrap_or(0) + bytes as u64);
    }
    let kept = |recompute: bool| -> Option<usize> {
        let a = Attention::named("a", args.width, args.heads).ok()?;
        let a = if recompute { a.recomputing() } else { a };
        a.kept_values(args.batch_size, args.context).map(|v| v * 4 * args.layers)
    };
    let mut object = json!({
        "train_loss": train_loss,
        "val_loss": run.val.last().map(|v| v.1),
        "val_losses": run.val.iter().map(|&(s, l)| json!([s, l])).collect::<Vec<_>>(),
        "step_us_median": step_us_median,
        "steady_state_allocs_max": run.allocs.iter().skip(WARM_UP).max().copied().unwrap_or(0),
        "workspace_bytes": workspace_bytes,
        "plan_bytes": plan.as_ref().map(|p| p.arena_bytes),
        "lower_bound_bytes": plan.as_ref().map(|p| p.arena_lower_bound_bytes),
        "predicted_bytes": predicted,
        "peak_rss_bytes": peak_rss,
        "training_rss_growth_bytes": rss_after_warm_up.saturating_sub(rss_before),
        "params": params,
        "loss_trace_sha256": parallel::sha256_of_losses(&run.losses),
        "attention": if args.attention == Form::Recompute { "recompute" } else { "keep" },
        "attention_kept_bytes": {"keep": kept(false), "recompute": kept(true)},
        "kept_bytes_per_layer_kind": kept_by_kind,
        "sample": text,
    });
    if let Some(b) = net.breakdown() {
        say(breakdown::breakdown_lines(mode_name(mode), &b));
        object["breakdown_us"] = breakdown::breakdown_json(&b);
        // The step's products against carve's matrix multiply alone on the same shapes.
        let products = step_products(args, vocab);
        let flops: f64 = products.iter().map(Product::flops).sum();
        let gemm = gemm_alone_gflops(&products, 20)?;
        let matmul_us = b.per_step_us().iter().find(|(part, _)| *part == "matmul").map_or(0.0, |p| p.1);
        let step_gflops = flops / (step_us_median * 1e3);
        let products_gflops = if matmul_us > 0.0 { flops / (matmul_us * 1e3) } else { 0.0 };
        say(format!(
            "{}: the step's products, {:.2} GFLOP: {products_gflops:.1} GFLOP/s in the step's matrix multiplies \
             ({:.0} % of carve's multiply alone on the same shapes, {gemm:.1} GFLOP/s on one thread)",
            mode_name(mode),
            flops / 1e9,
            100.0 * products_gflops / gemm
        ));
        object["step_gflops"] = step_gflops.into();
        object["products_gflops"] = products_gflops.into();
        object["gemm_gflops_same_shapes"] = gemm.into();
        object["step_over_gemm"] = (step_gflops / gemm).into();
        object["products_over_gemm"] = (products_gflops / gemm).into();
    }
    if let (Some(t), Some(path)) = (timeline.take(), &args.timeline) {
        let figures = timeline::export(&t, path, None)?;
        say(figures.line(path));
    }
    if let Some(path) = &args.save {
        save(&net, corpus, path)?;
        say(format!("model saved to {}", path.display()));
    }
    say(format!(
        "{}: {params} parameters; val loss {:.4}; step {step_us_median:.0} µs (median); workspaces {} bytes \
         (predicted {}); plan {} bytes, bound {}; RSS growth over {WARM_UP} steps {} bytes",
        mode_name(mode),
        run.val.last().map_or(f64::NAN, |v| v.1),
        workspace_bytes,
        predicted.map_or_else(|| "on the device: none".to_string(), |b| b.to_string()),
        plan.as_ref().map_or(0, |p| p.arena_bytes),
        plan.as_ref().map_or(0, |p| p.arena_lower_bound_bytes),
        rss_after_warm_up.saturating_sub(rss_before),
    ));
    if let Some(stats) = net.device_stats() {
        object["device_name"] = stats.device.into();
        object["device_bytes"] = stats.bytes.into();
        object["device_allocations"] = stats.allocations.into();
        object["device_plan_bytes"] = stats.plan_bytes.into();
        object["device_lower_bound_bytes"] = stats.lower_bound_bytes.into();
    }
    run.json = object;
    Ok(run)
}

fn run(args: &Args) -> Res<()> {
    if args.workers.is_some() || args.reducer.is_some() {
        return data_parallel(args);
    }
    let json = args.json;
    let say = move |text: String| match json {
        true => eprintln!("{text}"),
        false => println!("{text}"),
    };
    let corpus = Corpus::load()?;
    say(format!(
        "train_gpt: {} characters ({} train, {} validation), {} tokens; {} blocks of {} heads, width {}, context {}, \
         batch {}, seed {}",
        corpus.train.len() + corpus.val.len(),
        corpus.train.len(),
        corpus.val.len(),
        corpus.chars.len(),
        args.layers,
        args.heads,
        args.width,
        args.context,
        args.batch_size,
        args.seed
    ));
    let modes = match args.compare {
        true => vec![WorkspaceMode::Enabled, WorkspaceMode::Planned, WorkspaceMode::None],
        false => vec![args.workspace_mode],
    };
    let mut runs = Vec::new();
    for &mode in &modes {
        runs.push((mode, train(args, &corpus, mode, &say)?));
    }
    if let Some((_, first)) = runs.first() {
        if !json {
            println!("sample ({} characters):\n{}", args.sample, first.json["sample"].as_str().unwrap_or(""));
        }
    }
    let equal = runs
        .windows(2)
        .all(|w| w[0].1.losses.iter().map(|l| l.to_bits()).eq(w[1].1.losses.iter().map(|l| l.to_bits())));
    if args.compare {
        say(format!("loss traces of the three modes bit-identical: {equal}"));
    }
    if json {
        let mut object = runs[0].1.json.clone();
        object["mode"] = mode_name(runs[0].0).into();
        object["iters"] = args.iters.into();
        object["threads"] = args.threads.into();
        object["device"] = args.device.to_string().into();
        object["seed"] = args.seed.into();
        if args.compare {
            object["loss_traces_equal"] = equal.into();
            for (mode, run) in &runs {
                object[mode_name(*mode)] = run.json.clone();
            }
        }
        println!("{}", serde_json::to_string(&object)?);
    }
    if args.compare && !equal {
        return Err("the three modes' loss traces differ".into());
    }
    Ok(())
}

/// `--workers N`: the GPT trained data-parallel, one worker alongside.
fn data_parallel(args: &Args) -> Res<()> {
    if args.compare || args.threads > 1 || args.timeline.is_some() {
        return Err("--workers trains one mode, one thread per worker, without a timeline: leave out --compare, \
                    --threads and --timeline"
            .into());
    }
    let mut setup = Setup::new(args.workers, args.reducer)?;
    let root = setup.is_root();
    let say = |text: String| match (root, args.json) {
        (false, _) => {}
        (true, true) => eprintln!("{text}"),
        (true, false) => println!("{text}"),
    };
    let corpus = Corpus::load()?;
    let vocab = corpus.chars.len();
    let mut trainers = setup.trainers(|| Network::new(gpt(args, vocab, args.workspace_mode)?))?;
    trainers.reserve(args.iters);
    if args.breakdown {
        trainers.main.set_breakdown(true);
    }
    let source = || -> Res<Prefetcher<TokenWindows>> {
        let windows = TokenWindows::new(corpus.train.clone(), args.context, args.batch_size, args.iters)?;
        Ok(Prefetcher::builder(windows.seeded(args.seed)).build()?)
    };
    let mut batches = source()?;
    while let Some(lease) = batches.next() {
        let lease = lease?;
        let (x, y) = (lease.features::<u32, Ix2>()?, lease.labels::<u32, Ix2>()?);
        trainers.fit(Input::tokens(x), Labels::from(y))?;
    }
    if trainers.has_baseline() {
        let mut baseline = source()?;
        while let Some(lease) = baseline.next() {
            let lease = lease?;
            let (x, y) = (lease.features::<u32, Ix2>()?, lease.labels::<u32, Ix2>()?);
            trainers.fit_one(Input::tokens(x), Labels::from(y))?;
        }
    }
    let summary = trainers.summary(&setup, WARM_UP.min(args.iters.saturating_sub(1)));
    let mut fields = trainers.json(&setup, WARM_UP.min(args.iters.saturating_sub(1)));
    if let Some(b) = trainers.main.breakdown() {
        say(breakdown::breakdown_lines(&format!("{} workers", setup.workers), &b));
        fields["breakdown_us"] = breakdown::breakdown_json(&b);
    }
    let losses = trainers.loss.clone();
    let mut network = trainers.main.into_network()?;
    let mut val = validation_batches(args, &corpus)?;
    let val_loss = validate(&mut network, &mut val)?;
    say(summary);
    say(format!("val loss {val_loss:.4}; loss trace sha256 {}", parallel::sha256_of_losses(&losses)));
    if let (Some(path), true) = (&args.save, root) {
        save(&network, &corpus, path)?;
    }
    if args.json && root {
        fields["val_loss"] = val_loss.into();
        fields["train_loss"] = losses.last().map(|&l| f64::from(l)).into();
        fields["params"] = network.params().len().into();
        let object = json!({"iters": args.iters, "seed": args.seed, "batch_size": args.batch_size});
        parallel::print_json(object, fields, mode_name(args.workspace_mode))?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Args = cli::parse();
    if args.threads > 1 && (args.workers.is_some() || args.reducer.is_some()) {
        cli::usage_error::<Args>("--threads is for one network: leave it out with --workers");
    }
    let on_device = args.device != Device::Host;
    if on_device && (args.workers.is_some() || args.reducer.is_some() || args.breakdown || args.timeline.is_some()) {
        cli::usage_error::<Args>(
            "--device trains on a device: --workers, --reducer, --breakdown and --timeline measure host steps; leave \
             them out, or train on the host",
        );
    }
    if let Some(path) = &args.timeline {
        if let Err(e) = cli::check_writable(path, "--timeline", "the timeline") {
            cli::usage_error::<Args>(&e);
        }
        if args.compare {
            cli::usage_error::<Args>(
                "--timeline records one mode's run, --compare trains three: leave out --compare (and choose the mode \
                 with --workspace-mode)",
            );
        }
        if args.save.as_ref() == Some(path) {
            cli::usage_error::<Args>("--timeline writes a file of its own: give it a path other than --save's");
        }
    }
    if let Some(path) = &args.save {
        if let Err(e) = cli::check_writable(path, "--save", "the model") {
            cli::usage_error::<Args>(&e);
        }
    }
    cli::exit_status::<Args, _>(run(&args))
}
