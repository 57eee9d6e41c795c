//! Serves a saved model over HTTP from an inference pool: one model, its weights held
//! once, K planned arenas, any number of clients.
//!
//! ```text
//! cargo run --release --example train_digits -- --save digits.safetensors
//! cargo run --release --example serve_digits -- --model digits.safetensors --port 8080
//! curl -s localhost:8080/predict -d '{"inputs": [[0, 0, 0.3125, 0.8125, 0.5625, 0.0625, …64 values…]]}'
//! curl -s localhost:8080/stats
//! ```
//!
//! - `POST /predict` with `{"inputs": [[f32, …], …]}` (one row of the model's features
//!   per example, as the model was trained on them: `train_digits`' pixels divided by
//!   16, so 0 to 1) answers `{"classes": [u32, …], "probabilities": [[f32, …], …]}`.
//! - `POST /generate` with `{"prompt": "…", "tokens": N}` (and optionally
//!   `"temperature"`, default 1, 0 for greedy; `"top_k"`, default 0: all; `"seed"`,
//!   default 0) answers `{"text": "…", "tokens": N}`: the model's continuation of the
//!   prompt, a stream of a language model saved with its characters (`train_gpt
//!   --save`), its steps in an arena leased for the stream's life. At most
//!   `--max-tokens` tokens; a client that goes away mid-stream ends its stream at the
//!   next token, and its arena goes back to the pool. With `--stream-batch S`, the
//!   streams of the requests in flight are stepped together instead (continuous
//!   batching), S per arena in `--workers` arenas of their own, a thread each
//!   (`StreamSlots`: see `generation.rs`), each request's text still the model's own for
//!   its prompt.
//! - `GET /stats` answers the pool's statistics (`InferencePool::stats`) and the
//!   server's request counts; with `--stream-batch`, `stream_batch` holds the slots, the
//!   arenas and the statistics of the pool those arenas are leased from (`pool`: its
//!   `arena_bytes` and `stream_bytes` are memory beside the server's pool's).
//! - A bad request (malformed JSON, a wrong number of features, a value that is not a
//!   finite number, an empty batch, a body over `--max-body`, a wrong method or path)
//!   gets a 4xx answer with `{"error": "…"}`, and the server goes on serving. A request
//!   whose head is not HTTP/1.1 gets hyper's own bare 400 (or 431 for a head over
//!   16 KiB) before it reaches the routes.
//!
//! It listens on 127.0.0.1 only, and prints `listening on 127.0.0.1:PORT` on stdout once
//! ready (`--port 0` picks a free port).
//!
//! # Why axum, hyper and tokio
//!
//! A server with a thread per connection is held by its slowest clients: two clients
//! that send a request head one byte every 300 ms keep two threads from everyone else.
//! Here the connections are tasks on tokio's runtime, so a client that waits costs a
//! task and a socket, not a thread; hyper speaks HTTP/1.1 (parsing, keep-alive, `Expect:
//! 100-continue`, `HEAD`) and cuts off a client that has not sent a whole request head
//! within `--header-timeout-ms` (`http1::Builder::header_read_timeout`), counted from
//! when the server starts waiting for it, which also ends idle keep-alive connections;
//! axum routes the requests; tower and tower-http bound the rest (`server.rs` lists
//! every limit). These are what Rust HTTP servers are built on, so the example shows
//! carve's pool inside the stack a deployment would use.
//!
//! The pool's calls block (a caller waits for an arena, or for its batch), so they run on
//! tokio's blocking threads (`spawn_blocking`) with `InferencePool::output_timeout`: the
//! runtime's threads never wait on the pool, and a blocking thread waits no longer than
//! the request may take. The server is a package of its own (`carve-serve`) so that the
//! library's other examples, the demo first, never compile tokio.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use carve::nn::{serve::InferencePool, serve::Model, serve::PoolConfig, serve::PoolMode};
use clap::Parser;

#[path = "../../../examples/common/cli.rs"]
mod cli;
mod generation;
mod inputs;
mod routes;
mod server;

use server::Limits;

/// Serves a model saved by `train_digits --save` over HTTP on
/// 127.0.0.1: POST /predict {"inputs": [[...], ...]} answers
/// {"classes": [...], "probabilities": [[...], ...]}; GET /stats
/// answers the inference pool's statistics.
#[derive(Parser, Debug)]
#[command(name = "serve_digits", verbatim_doc_comment, next_line_help = true)]
struct Args {
    /// The model: a safetensors file saved by `train_digits --save`
    /// (or `Network::save`)
    #[arg(long, value_name = "PATH", verbatim_doc_comment)]
    model: PathBuf,
    /// The port on 127.0.0.1 (0: a free one, printed once
    /// ready)
    #[arg(long, value_name = "N", default_value_t = 8080, verbatim_doc_comment)]
    port: u16,
    /// Inference arenas, each serving one request (or batch) at a
    /// time (1 to 1024; default: the machine's cores)
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u16).range(1..=1024), verbatim_doc_comment)]
    workers: Option<u16>,
    /// `direct` (each request alone in an arena) or `batched`
    /// (requests coalesced up to --max-batch rows or
    /// --max-wait-us)
    #[arg(long, value_name = "MODE", default_value = "direct", value_parser = parse_mode, verbatim_doc_comment)]
    mode: PoolMode,
    /// Batched mode: the most rows in one inference (1 to
    /// 65536)
    #[arg(
        long,
        value_name = "N",
        default_value_t = 32,
        value_parser = clap::value_parser!(u32).range(1..=65536),
        verbatim_doc_comment
    )]
    max_batch: u32,
    /// Batched mode: how long a request may wait for others, in
    /// microseconds (0 to 1000000; 0: a batch is what queued while
    /// the workers were busy)
    #[arg(
        long,
        value_name = "US",
        default_value_t = 0,
        value_parser = clap::value_parser!(u64).range(0..=1_000_000),
        verbatim_doc_comment
    )]
    max_wait_us: u64,
    /// The largest request body in bytes (1024 to
    /// 1073741824)
    #[arg(
        long,
        value_name = "BYTES",
        default_value_t = 1 << 20,
        value_parser = clap::value_parser!(u64).range(1024..=1 << 30),
        verbatim_doc_comment
    )]
    max_body: u64,
    /// How long a client may take to send a request's head, in
    /// milliseconds, counted from when the server waits for it
    /// (so it also ends an idle keep-alive connection; 10 to
    /// 600000)
    #[arg(
        long,
        value_name = "MS",
        default_value_t = 5000,
        value_parser = clap::value_parser!(u64).range(10..=600_000),
        verbatim_doc_comment
    )]
    header_timeout_ms: u64,
    /// How long a client may stay silent within a request's
    /// body, in milliseconds (10 to 600000)
    #[arg(
        long,
        value_name = "MS",
        default_value_t = 5000,
        value_parser = clap::value_parser!(u64).range(10..=600_000),
        verbatim_doc_comment
    )]
    idle_timeout_ms: u64,
    /// How long a whole request body may take to arrive, in
    /// milliseconds (10 to 600000)
    #[arg(
        long,
        value_name = "MS",
        default_value_t = 10_000,
        value_parser = clap::value_parser!(u64).range(10..=600_000),
        verbatim_doc_comment
    )]
    body_timeout_ms: u64,
    /// Open connections at most; more wait to be accepted (1 to
    /// 65536)
    #[arg(
        long,
        value_name = "N",
        default_value_t = 1024,
        value_parser = clap::value_parser!(u32).range(1..=65536),
        verbatim_doc_comment
    )]
    max_connections: u32,
    /// The most tokens one POST /generate may ask for (1 to
    /// 100000)
    #[arg(
        long,
        value_name = "N",
        default_value_t = 1000,
        value_parser = clap::value_parser!(u32).range(1..=100_000),
        verbatim_doc_comment
    )]
    max_tokens: u32,
    /// POST /generate: the streams of the requests in flight
    /// stepped together, up to S in each of --workers arenas of
    /// their own, a thread each (1 to 256; without it: each
    /// stream alone in one of the pool's arenas)
    #[arg(long, value_name = "S", value_parser = clap::value_parser!(u16).range(1..=256), verbatim_doc_comment)]
    stream_batch: Option<u16>,
    /// The runtime's threads, serving every connection (1 to
    /// 1024; default: the machine's cores)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1024), verbatim_doc_comment)]
    http_threads: Option<u16>,
}

fn parse_mode(s: &str) -> Result<PoolMode, String> {
    match s {
        "direct" => Ok(PoolMode::Direct),
        "batched" => Ok(PoolMode::Batched),
        _ => Err(format!("'{s}' is not a mode: use `direct` or `batched`")),
    }
}

fn main() -> ExitCode {
    let args: Args = cli::parse();
    cli::exit_status::<Args, _>(run(&args))
}

fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let model = Arc::new(Model::load(&args.model)?);
    let defaults = PoolConfig::default();
    let config = PoolConfig {
        workers: args.workers.map_or(defaults.workers, usize::from),
        mode: args.mode,
        max_batch: args.max_batch as usize,
        max_wait: Duration::from_micros(args.max_wait_us),
        ..defaults
    };
    let pool = Arc::new(InferencePool::new(Arc::clone(&model), config)?);
    let limits = Limits {
        header_timeout: Duration::from_millis(args.header_timeout_ms),
        body_idle: Duration::from_millis(args.idle_timeout_ms),
        body_time: Duration::from_millis(args.body_timeout_ms),
        max_body: usize::try_from(args.max_body)?,
        max_connections: args.max_connections as usize,
        max_tokens: args.max_tokens as usize,
        ..Limits::default()
    };

    // A stream batch for POST /generate, when asked for and the model generates text
    // (without one the route answers 422, as it does without the flag).
    let batcher = match args.stream_batch {
        Some(slots) if model.context().is_ok() && model.symbols().is_some() => {
            let arenas = pool.config().workers;
            Some(generation::Batcher::start(Arc::clone(&model), arenas, usize::from(slots), limits.in_flight)?)
        }
        _ => None,
    };

    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = args.http_threads {
        runtime.worker_threads(usize::from(threads));
    }
    // Every blocking thread serves one request in flight: no more are ever needed.
    let runtime = runtime.max_blocking_threads(limits.in_flight).enable_io().enable_time().build()?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", args.port))
            .await
            .map_err(|e| format!("cannot listen on 127.0.0.1:{}: {e}", args.port))?;
        let port = listener.local_addr()?.port();
        eprintln!(
            "serve_digits: {} ({} features, {} classes, {} weight bytes), {} {} arenas",
            args.model.display(),
            model.inputs(),
            model.classes(),
            model.weight_bytes(),
            pool.config().workers,
            pool.stats().mode,
        );
        println!("listening on 127.0.0.1:{port}");
        std::io::stdout().flush()?;
        match server::serve(listener, routes::router(pool, batcher, &limits), &limits).await {}
    })
}
