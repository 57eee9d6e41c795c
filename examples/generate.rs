//! Generates text from a character-level GPT, token by token, each stream's keys and
//! values in a cache sized before its first token (`Model::kv_cache_bytes`), every
//! step in the thread's planned serving arena.
//!
//! ```text
//! cargo run --release --example train_gpt -- --save gpt.safetensors
//! cargo run --release --example generate -- --model gpt.safetensors --prompt "ROMEO:" --tokens 300
//! ```
//!
//! Without `--model`, an untrained GPT of `train_gpt`'s shape (seeded by `--seed`, with
//! the characters of the shipped plays as its vocabulary) generates: noise, at the speed
//! of the real thing.
//!
//! | flag | default | what |
//! |---|---|---|
//! | `--model PATH` | none | a model saved by `train_gpt --save` (it keeps its characters) |
//! | `--prompt TEXT` | a newline | the text the stream starts from (its last `context` characters) |
//! | `--tokens N` | 300 | characters to generate (1 to 100000) |
//! | `--temperature T` | 1.0 | the logits divided by T (0: greedy) |
//! | `--top-k K` | 0 | draw among the K most probable (0: all) |
//! | `--seed S` | 0 | the draws (and the untrained model's weights) |
//! | `--streams N` | 1 | streams stepped together from the same prompt (1 to 256; stream `i` seeded `S + i`) |
//! | `--json` | off | one JSON object on stdout instead of the text |
//!
//! JSON keys: `text` (the first stream's characters), `prompt`, `tokens`, `streams`,
//! `tokens_per_sec` (every stream's tokens over the time of the token steps),
//! `token_us_p50`, `token_us_p99` (per step of all streams), `allocs_per_token` (heap
//! allocations per token after the first `context` steps), `kv_cache_bytes` (one
//! stream's), `arena_bytes` (the thread's serving arena after the run), `weight_bytes`,
//! `context`, `weights_read_us` (the least time, over 100 passes after the run, to read
//! every weight once: the floor of a one-stream step, which reads them all from wherever
//! they lie between steps).

#[path = "common/cli.rs"]
mod cli;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use carve::alloc_check::{thread_counts, CountingAllocator};
use carve::nn::serve::{Model, Sampling};
use carve::nn::{Network, NetworkConfig};
use clap::Parser;
use serde_json::json;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::system();

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Generates text from a character-level GPT.
#[derive(Parser, Debug)]
#[command(name = "generate", version, verbatim_doc_comment, next_line_help = true)]
struct Args {
    /// A model saved by `train_gpt --save` (without it: an untrained
    /// GPT of train_gpt's shape)
    #[arg(long, value_name = "PATH", verbatim_doc_comment)]
    model: Option<PathBuf>,
    /// The text to start from
    #[arg(long, value_name = "TEXT", default_value = "\n")]
    prompt: String,
    /// Characters to generate (1 to 100000)
    #[arg(long, value_name = "N", default_value_t = 300, value_parser = parse_tokens)]
    tokens: usize,
    /// The logits divided by T before drawing (0: greedy)
    #[arg(long, value_name = "T", default_value_t = 1.0, value_parser = parse_temperature, allow_negative_numbers = true)]
    temperature: f32,
    /// Draw among the K most probable characters (0: all)
    #[arg(long, value_name = "K", default_value_t = 0)]
    top_k: usize,
    /// Seed of the draws (and of the untrained model's weights)
    #[arg(long, value_name = "S", default_value_t = 0)]
    seed: u64,
    /// Streams stepped together from the prompt (1 to 256)
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = parse_streams)]
    streams: usize,
    /// Print one JSON object on stdout instead of the text
    #[arg(long)]
    json: bool,
}

fn parse_tokens(s: &str) -> Result<usize, String> {
    cli::bounded(s, 1, 100_000)
}

fn parse_streams(s: &str) -> Result<usize, String> {
    cli::bounded(s, 1, 256)
}

fn parse_temperature(s: &str) -> Result<f32, String> {
    let t: f32 = s.parse().map_err(|_| format!("'{s}' is not a number"))?;
    if !(t.is_finite() && t >= 0.0) {
        return Err(format!("{t} must be finite and at least 0"));
    }
    Ok(t)
}

/// The characters of the shipped plays, sorted: `train_gpt`'s vocabulary.
fn shipped_symbols() -> Res<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/data/shakespeare.txt.gz");
    let file = std::fs::File::open(&path).map_err(|e| format!("cannot open {} ({e})", path.display()))?;
    let mut text = String::new();
    flate2::read::GzDecoder::new(file).read_to_string(&mut text)?;
    Ok(text.chars().collect::<std::collections::BTreeSet<_>>().into_iter().collect())
}

/// An untrained GPT of `train_gpt`'s default shape over `symbols`.
fn untrained(symbols: &str, seed: u64) -> Res<Model> {
    let (vocab, d, heads, context) = (symbols.chars().count(), 128, 4, 64);
    let mut b = NetworkConfig::builder(vocab).embedding(d).position_embedding(context);
    for _ in 0..4 {
        b = b.residual(|b| b.layer_norm().attention(heads)).residual(|b| b.layer_norm().dense(4 * d).gelu().dense(d));
    }
    let net = Network::new(b.layer_norm().dense(vocab).seed(seed).build()?)?;
    Ok(net.freeze()?.with_symbols(symbols)?)
}

fn run(args: &Args) -> Res<()> {
    let model = match &args.model {
        Some(path) => {
            let model = Model::load(path)?;
            if model.symbols().is_none() {
                return Err(format!(
                    "{} has no characters (carve.symbols): save it with `train_gpt --save`, or give a model that \
                     has them",
                    path.display()
                )
                .into());
            }
            model
        }
        None => untrained(&shipped_symbols()?, args.seed)?,
    };
    let context = model.context()?;
    let prompt = model.encode(&args.prompt)?;
    if prompt.is_empty() {
        return Err("the prompt is empty: give at least one character".into());
    }
    let sampling: Vec<Sampling> = (0..args.streams as u64)
        .map(|i| Sampling::random(args.temperature, args.top_k, args.seed.wrapping_add(i)))
        .collect::<carve::Result<_>>()?;
    let prompts = vec![prompt.as_slice(); args.streams];
    let mut stream = model.streams(&prompts, &sampling)?;
    let mut out = vec![0u32; args.streams];
    let mut tokens: Vec<Vec<u32>> = vec![Vec::with_capacity(args.tokens); args.streams];
    let mut step_us = Vec::with_capacity(args.tokens);
    let mut allocs = 0u64;
    // The first `context + 1` steps plan every shape a step takes (one token, and the
    // first slide's half context); at least the last token is counted.
    let warm = (context + 1).min(args.tokens - 1);
    let started = Instant::now();
    for i in 0..args.tokens {
        let before = thread_counts().allocations;
        let t = Instant::now();
        stream.next_tokens(&mut out)?;
        step_us.push(t.elapsed().as_secs_f64() * 1e6);
        if i >= warm {
            allocs += thread_counts().allocations - before;
        }
        for (tokens, &t) in tokens.iter_mut().zip(&out) {
            tokens.push(t);
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let text = model.decode(&tokens[0])?;
    if !args.json {
        println!("{}{text}", args.prompt);
        return Ok(());
    }
    step_us.sort_by(f64::total_cmp);
    let at = |q: f64| step_us[((step_us.len() - 1) as f64 * q).round() as usize];
    let counted = (args.tokens - warm) * args.streams;
    let object = json!({
        "text": text,
        "prompt": args.prompt,
        "tokens": args.tokens,
        "streams": args.streams,
        "tokens_per_sec": (args.tokens * args.streams) as f64 / seconds,
        "token_us_p50": at(0.5),
        "token_us_p99": at(0.99),
        "allocs_per_token": allocs as f64 / counted.max(1) as f64,
        "kv_cache_bytes": stream.kv_cache_bytes(),
        "arena_bytes": Model::thread_workspace_bytes(),
        "weight_bytes": model.weight_bytes(),
        "context": context,
        "weights_read_us": weights_read_us(model.params()),
    });
    println!("{object}");
    Ok(())
}

/// The least time, over 100 passes, to read `weights` once, in µs: 32 independent sums,
/// which the compiler turns into vector adds, so that only the reads bound it.
fn weights_read_us(weights: &[f32]) -> f64 {
    let mut best = f64::INFINITY;
    let mut lanes = [0.0f32; 32];
    for _ in 0..100 {
        let t = Instant::now();
        let (chunks, _) = std::hint::black_box(weights).as_chunks::<32>();
        for chunk in chunks {
            for (sum, x) in lanes.iter_mut().zip(chunk) {
                *sum += x;
            }
        }
        best = best.min(t.elapsed().as_secs_f64() * 1e6);
        std::hint::black_box(&mut lanes);
    }
    best
}

fn main() -> ExitCode {
    let args: Args = cli::parse();
    cli::exit_status::<Args, _>(run(&args))
}
