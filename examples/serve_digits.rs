//! Serves a saved model over HTTP from an inference pool: one model, its weights held
//! once, K planned arenas, any number of clients.
//!
//! ```text
//! cargo run --release --example train_digits -- --save digits.safetensors
//! cargo run --release --example serve_digits -- --model digits.safetensors --port 8080
//! curl -s localhost:8080/predict -d '{"inputs": [[0, 0, 5, 13, 9, 1, …64 values…]]}'
//! curl -s localhost:8080/stats
//! ```
//!
//! - `POST /predict` with `{"inputs": [[f32, …], …]}` (one row of the model's features
//!   per example) answers `{"classes": [u32, …], "probabilities": [[f32, …], …]}`.
//! - `GET /stats` answers the pool's statistics (`InferencePool::stats`) and the
//!   server's request counts.
//! - A bad request (malformed JSON, a wrong number of features, a value that is not a
//!   finite number, an empty batch, a body over `--max-body`) gets a 4xx answer with
//!   `{"error": "…"}`, and the server goes on serving.
//!
//! It listens on 127.0.0.1 only, and prints `listening on 127.0.0.1:PORT` on stdout once
//! ready (`--port 0` picks a free port).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use carve::nn::{InferencePool, Model, PoolConfig, PoolMode};
use carve::Error;
use clap::Parser;
use ndarray::Array2;
use serde_json::Value;

#[path = "common/cli.rs"]
mod cli;
#[path = "common/http.rs"]
mod http;

use http::{Limits, Request, Response};

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
    /// How long a connection may stay silent, in milliseconds
    /// (10 to 600000)
    #[arg(
        long,
        value_name = "MS",
        default_value_t = 5000,
        value_parser = clap::value_parser!(u64).range(10..=600_000),
        verbatim_doc_comment
    )]
    idle_timeout_ms: u64,
    /// Threads serving HTTP connections (1 to 1024)
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=1024))]
    http_threads: u16,
}

fn parse_mode(s: &str) -> Result<PoolMode, String> {
    match s {
        "direct" => Ok(PoolMode::Direct),
        "batched" => Ok(PoolMode::Batched),
        _ => Err(format!("'{s}' is not a mode: use `direct` or `batched`")),
    }
}

/// What the server counts, besides the pool.
#[derive(Default)]
struct Counts {
    requests: AtomicU64,
    predictions: AtomicU64,
    client_errors: AtomicU64,
    server_errors: AtomicU64,
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
    let pool = InferencePool::new(Arc::clone(&model), config)?;
    let listener = TcpListener::bind(("127.0.0.1", args.port))
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
    use std::io::Write;
    std::io::stdout().flush()?;

    let limits = Limits {
        max_head: 16 * 1024,
        max_body: args.max_body as usize,
        idle: Duration::from_millis(args.idle_timeout_ms),
        request_time: Duration::from_secs(30),
        queue: 256,
        requests_per_connection: 1000,
        connection_time: Duration::from_secs(60),
    };
    let counts = Counts::default();
    http::serve(listener, usize::from(args.http_threads), limits, |request| {
        counts.requests.fetch_add(1, Ordering::Relaxed);
        let response = route(request, &pool, &counts);
        let counter = match response.status {
            400..=499 => &counts.client_errors,
            500..=599 => &counts.server_errors,
            _ => &counts.predictions,
        };
        if response.status != 200 || request.path == "/predict" {
            counter.fetch_add(1, Ordering::Relaxed);
        }
        response
    })?;
    Ok(())
}

fn route(request: &Request, pool: &InferencePool, counts: &Counts) -> Response {
    match (request.method.as_str(), request.path.as_str()) {
        ("POST", "/predict") => predict(&request.body, pool),
        ("GET", "/stats") => {
            let mut stats: Value = serde_json::from_str(&pool.stats().to_json()).expect("the pool's JSON");
            stats["http"] = serde_json::json!({
                "requests": counts.requests.load(Ordering::Relaxed),
                "predictions": counts.predictions.load(Ordering::Relaxed),
                "client_errors": counts.client_errors.load(Ordering::Relaxed),
                "server_errors": counts.server_errors.load(Ordering::Relaxed),
            });
            Response::ok(stats.to_string())
        }
        (_, "/predict") => Response { allow: Some("POST"), ..Response::error(405, "use POST /predict") },
        (_, "/stats") => Response { allow: Some("GET"), ..Response::error(405, "use GET /stats") },
        (_, path) => Response::error(404, &format!("no such path '{path}': use POST /predict or GET /stats")),
    }
}

/// `POST /predict`: the body checked, the rows run through the pool.
fn predict(body: &[u8], pool: &InferencePool) -> Response {
    let x = match parse_inputs(body, pool.model().inputs()) {
        Ok(x) => x,
        Err(message) => return Response::error(400, &message),
    };
    let probabilities = match pool.output(x.view()) {
        Ok(p) => p,
        Err(e) => {
            let status = match e {
                Error::NonFinite { .. } | Error::ShapeMismatch { .. } | Error::InvalidInput { .. } => 400,
                Error::PoolBusy { .. } | Error::Timeout { .. } | Error::PoolClosed => 503,
                _ => 500,
            };
            return Response::error(status, &e.to_string());
        }
    };
    let classes: Vec<u32> = probabilities
        .rows()
        .into_iter()
        .map(|row| {
            // The first of equal maxima, as `Network::predict_into`.
            let mut best = 0;
            for (class, &p) in row.iter().enumerate() {
                if p > row[best] {
                    best = class;
                }
            }
            best as u32
        })
        .collect();
    let rows: Vec<Vec<f32>> = probabilities.rows().into_iter().map(|r| r.to_vec()).collect();
    // Serialized as f32 (the shortest text that reads back as the same f32), not widened
    // to f64 as a `serde_json::Value` would.
    let classes = serde_json::to_string(&classes).expect("numbers");
    let rows = serde_json::to_string(&rows).expect("finite numbers");
    Response::ok(format!("{{\"classes\":{classes},\"probabilities\":{rows}}}"))
}

/// `{"inputs": [[f32; features], …]}` as a matrix, or what is wrong with it.
fn parse_inputs(body: &[u8], features: usize) -> Result<Array2<f32>, String> {
    let json: Value = serde_json::from_slice(body).map_err(|e| {
        let text = String::from_utf8_lossy(body);
        if ["NaN", "Infinity"].iter().any(|word| text.contains(word)) {
            format!("malformed JSON ({e}): NaN and Infinity are not JSON numbers, and the model takes finite values")
        } else {
            format!("malformed JSON: {e}")
        }
    })?;
    let Some(rows) = json.get("inputs") else {
        return Err("the body needs \"inputs\": [[f32, ...], ...], one row of features per example".into());
    };
    let Value::Array(rows) = rows else {
        return Err("\"inputs\" must be a list of rows, each a list of numbers".into());
    };
    if rows.is_empty() {
        return Err("an empty batch: \"inputs\" holds no rows".into());
    }
    // Each value takes at least two bytes of the body ("0,"): no more room than that.
    let mut values = Vec::with_capacity(rows.len().saturating_mul(features).min(body.len() / 2 + 1));
    for (r, row) in rows.iter().enumerate() {
        let Value::Array(row) = row else {
            return Err(format!("row {r} of \"inputs\" is not a list of numbers"));
        };
        if row.len() != features {
            return Err(format!("row {r} has {} values; the model takes {features} features per row", row.len()));
        }
        for (c, value) in row.iter().enumerate() {
            let Some(number) = value.as_f64() else {
                return Err(format!("row {r}, column {c} is {value}, not a number"));
            };
            // A number beyond f32's range becomes infinite: the pool refuses it, naming it.
            values.push(number as f32);
        }
    }
    Ok(Array2::from_shape_vec((rows.len(), features), values).expect("rows × features values"))
}
