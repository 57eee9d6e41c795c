//! The routes (`POST /predict`, `POST /generate`, `GET /stats`), the tower layers that bound every
//! request, and the JSON of every answer: `{"error": "…"}` for each 4xx and 5xx, the
//! layers' own included.

use std::error::Error as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{to_bytes, Body};
use axum::extract::{Extension, Request, State};
use axum::http::header::{ALLOW, CONTENT_LENGTH, CONTENT_TYPE, TRANSFER_ENCODING};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use carve::nn::serve::{InferencePool, Sampling};
use carve::Error;
use ndarray::Array2;
use serde_json::Value;
use tower::limit::GlobalConcurrencyLimitLayer;
use tower::ServiceBuilder;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::{RequestBodyTimeoutLayer, TimeoutLayer};

use crate::generation::{Batcher, Job, NotQueued, Outcome};
use crate::inputs::parse_inputs;
use crate::server::Limits;

/// What the handlers share.
struct App {
    pool: Arc<InferencePool>,
    /// `POST /generate`'s stream batch, when there is one (`--stream-batch`).
    batcher: Option<Batcher>,
    counts: Counts,
    limits: Limits,
}

/// What the server counts, besides the pool.
#[derive(Default)]
struct Counts {
    requests: AtomicU64,
    predictions: AtomicU64,
    client_errors: AtomicU64,
    server_errors: AtomicU64,
}

impl Counts {
    /// Counts an answer: every request, each 4xx and 5xx, and each prediction.
    fn record(&self, predict: bool, status: StatusCode) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let counter = if status.is_client_error() {
            &self.client_errors
        } else if status.is_server_error() {
            &self.server_errors
        } else if predict {
            &self.predictions
        } else {
            return;
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// The routes, inside the layers that bound each request (outermost first): the JSON
/// of errors and the counts; the time to answer; the requests in flight; the body's
/// size; the body's silences.
pub(crate) fn router(pool: Arc<InferencePool>, batcher: Option<Batcher>, limits: &Limits) -> Router {
    let app = Arc::new(App { pool, batcher, counts: Counts::default(), limits: *limits });
    let wrong_method = |allow: &'static str, message: &'static str| {
        move || async move { ApiError { allow: Some(allow), ..ApiError::new(StatusCode::METHOD_NOT_ALLOWED, message) } }
    };
    let layers = ServiceBuilder::new()
        .layer(middleware::from_fn_with_state(Arc::clone(&app), observe))
        .layer(TimeoutLayer::with_status_code(StatusCode::SERVICE_UNAVAILABLE, limits.request_time))
        .layer(GlobalConcurrencyLimitLayer::new(limits.in_flight))
        .layer(RequestBodyLimitLayer::new(limits.max_body))
        .layer(RequestBodyTimeoutLayer::new(limits.body_idle));
    Router::new()
        .route("/predict", post(predict).fallback(wrong_method("POST", "use POST /predict")))
        .route("/generate", post(generate).fallback(wrong_method("POST", "use POST /generate")))
        // axum answers HEAD with the GET route's head; this server takes GET only.
        .route(
            "/stats",
            get(stats).head(wrong_method("GET", "use GET /stats")).fallback(wrong_method("GET", "use GET /stats")),
        )
        .fallback(|request: Request| async move {
            let path = request.uri().path();
            ApiError::new(
                StatusCode::NOT_FOUND,
                format!("no such path '{path}': use POST /predict, POST /generate or GET /stats"),
            )
        })
        .layer(layers)
        .with_state(app)
}

/// When a request arrived (before any wait for an in-flight slot).
#[derive(Clone, Copy)]
struct Arrived(Instant);

/// Counts each answer, and gives the layers' errors (413, 503; plain text or empty) a
/// JSON body as the handlers' own.
async fn observe(State(app): State<Arc<App>>, mut request: Request, next: Next) -> Response {
    let predict = request.uri().path() == "/predict";
    // The request's time runs from here, as the timeout layer's does: a handler that
    // starts after a wait for an in-flight slot has only what is left.
    request.extensions_mut().insert(Arrived(Instant::now()));
    let mut response = next.run(request).await;
    let status = response.status();
    let json = response.headers().get(CONTENT_TYPE).is_some_and(|t| t == "application/json");
    if (status.is_client_error() || status.is_server_error()) && !json {
        let message = match status {
            StatusCode::PAYLOAD_TOO_LARGE => {
                format!("the body is larger than the limit of {} bytes", app.limits.max_body)
            }
            StatusCode::SERVICE_UNAVAILABLE => {
                format!("no answer within {} ms: the server is busy; try again", app.limits.request_time.as_millis())
            }
            _ => status.canonical_reason().unwrap_or("refused").to_string(),
        };
        response = ApiError::new(status, message).into_response();
    }
    app.counts.record(predict, status);
    response
}

/// `GET /stats`: the pool's statistics and the server's counts.
async fn stats(State(app): State<Arc<App>>) -> Response {
    let mut stats: Value = serde_json::from_str(&app.pool.stats().to_json()).expect("the pool's JSON");
    let counts = &app.counts;
    stats["http"] = serde_json::json!({
        "requests": counts.requests.load(Ordering::Relaxed),
        "predictions": counts.predictions.load(Ordering::Relaxed),
        "client_errors": counts.client_errors.load(Ordering::Relaxed),
        "server_errors": counts.server_errors.load(Ordering::Relaxed),
    });
    // POST /generate's stream slots per arena and arenas, and the statistics of the
    // pool that holds those arenas, beside the server's (null: each stream alone in an
    // arena of the server's pool).
    stats["stream_batch"] = serde_json::json!(app.batcher.as_ref().map(|b| {
        let pool: Value = serde_json::from_str(&b.pool().stats().to_json()).expect("the pool's JSON");
        serde_json::json!({"slots": b.slots(), "arenas": b.arenas(), "pool": pool})
    }));
    json(StatusCode::OK, stats.to_string())
}

/// The body of a request, read whole: one with a Content-Length, within the limits.
async fn read_body(app: &App, headers: &HeaderMap, body: Body) -> Result<axum::body::Bytes, ApiError> {
    if headers.contains_key(TRANSFER_ENCODING) {
        return Err(ApiError::new(
            StatusCode::LENGTH_REQUIRED,
            "chunked bodies are not taken: send the body with a Content-Length",
        ));
    }
    if !headers.contains_key(CONTENT_LENGTH) {
        return Err(ApiError::new(StatusCode::LENGTH_REQUIRED, "a request with a body needs a Content-Length"));
    }
    // The whole body within `body_time`: a client that sends a byte now and then
    // (within `body_idle`) does not hold a request in flight for long.
    match tokio::time::timeout(app.limits.body_time, to_bytes(body, app.limits.max_body)).await {
        Ok(read) => read.map_err(|e| body_error(&e, &app.limits)),
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            format!("the body took longer than {} ms to arrive", app.limits.body_time.as_millis()),
        )),
    }
}

/// The status of a pool's error: the client's fault, the server's load, or the
/// server's fault.
fn status_of(e: &Error) -> StatusCode {
    match e {
        Error::NonFinite { .. } | Error::ShapeMismatch { .. } | Error::InvalidInput { .. } => StatusCode::BAD_REQUEST,
        Error::PoolBusy { .. } | Error::Timeout { .. } | Error::PoolClosed | Error::BatchFull { .. } => {
            StatusCode::SERVICE_UNAVAILABLE
        }
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// Set when the request that started a generation is gone (its client disconnected,
/// or its time ran out): the stream stops at its next token.
struct Cancel(Arc<AtomicBool>);

impl Drop for Cancel {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// `POST /generate`: `{"prompt": "…", "tokens": N}` (and optionally `temperature`,
/// `top_k`, `seed`) → `{"text": "…", "tokens": N}`, a stream of the pool's model run
/// on a blocking thread in an arena leased for it, or beside the other requests' in
/// a generation thread's stream slots (`--stream-batch`).
async fn generate(
    State(app): State<Arc<App>>,
    Extension(Arrived(arrived)): Extension<Arrived>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let deadline = arrived + app.limits.request_time;
    let body = read_body(&app, &headers, body).await?;
    let bad = |m: String| ApiError::new(StatusCode::BAD_REQUEST, m);
    // The body parsed and its prompt read on a blocking thread: a body of the largest
    // size takes milliseconds, which no runtime thread (serving every connection)
    // spends, nor a generation thread, whose streams would wait.
    let (model, max_tokens) = (Arc::clone(app.pool.model()), app.limits.max_tokens);
    let read = tokio::task::spawn_blocking(move || {
        let request = parse_generate(&body, max_tokens).map_err(bad)?;
        drop(body);
        if let Err(e) = model.context() {
            let message = format!("this model does not generate text: {e}");
            return Err(ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, message));
        }
        if model.symbols().is_none() {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "this model does not generate text: it was saved without its characters (save it with train_gpt \
                 --save)",
            ));
        }
        let sampling =
            Sampling::random(request.temperature, request.top_k, request.seed).map_err(|e| bad(e.to_string()))?;
        let prompt = model.encode(&request.prompt).map_err(|e| bad(format!("the prompt: {e}")))?;
        Ok::<_, ApiError>((prompt, request.tokens, sampling))
    });
    let (mut prompt, tokens, sampling) = match read.await {
        Ok(read) => read?,
        Err(_) => return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the server failed on this request")),
    };
    let pool = Arc::clone(&app.pool);
    let cancelled = Arc::new(AtomicBool::new(false));
    let _cancel = Cancel(Arc::clone(&cancelled));
    let app_time = app.limits.request_time;
    let gone = move || {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the generation took longer than {} ms, or its client went away", app_time.as_millis()),
        )
    };
    // Once the prompt is read (every character one of the model's), what the model
    // refuses or fails on is the server's fault (logits that are not finite, tokens it
    // cannot write back), but for the limits of a busy server (503).
    let model_failed = |e: Error| match status_of(&e) {
        StatusCode::BAD_REQUEST => {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("the model failed on this prompt: {e}"))
        }
        status => ApiError::new(status, e.to_string()),
    };
    let failed = || ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the server failed on this request");
    if let Some(batcher) = &app.batcher {
        // Its last `context` tokens kept (a stream keeps no more).
        let context = pool.model().context().map_err(model_failed)?;
        prompt.drain(..prompt.len().saturating_sub(context));
        let (reply, answer) = tokio::sync::oneshot::channel();
        let job = Job { prompt, tokens, sampling, deadline, cancelled, reply };
        match batcher.submit(job) {
            Ok(()) => {}
            Err(NotQueued::Full) => {
                return Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!(
                        "the {} generation arenas' {} slots each and their queue are full: try again later",
                        batcher.arenas(),
                        batcher.slots()
                    ),
                ))
            }
            Err(NotQueued::Gone) => return Err(failed()),
        }
        let out = match answer.await {
            Ok(Outcome::Tokens(out)) => out,
            Ok(Outcome::Refused(e)) => return Err(model_failed(e)),
            Ok(Outcome::Failed(why)) => {
                return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("the generation failed: {why}")))
            }
            Ok(Outcome::Gone) => return Err(gone()),
            Err(_) => return Err(failed()),
        };
        let text = pool.model().decode(&out).map_err(model_failed)?;
        return Ok(json(StatusCode::OK, serde_json::json!({ "text": text, "tokens": tokens }).to_string()));
    }
    let generation = tokio::task::spawn_blocking(move || {
        if cancelled.load(Ordering::Relaxed) {
            return Err(gone());
        }
        let wait = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let mut stream = pool.stream_timeout(&prompt, sampling, wait).map_err(model_failed)?;
        let mut out = Vec::with_capacity(tokens);
        for _ in 0..tokens {
            if cancelled.load(Ordering::Relaxed) || Instant::now() >= deadline {
                // No one reads the answer: the stream ends, its arena goes back.
                return Err(gone());
            }
            out.push(stream.next_token().map_err(model_failed)?);
        }
        drop(stream);
        pool.model().decode(&out).map_err(model_failed)
    });
    let text = match generation.await {
        Ok(result) => result?,
        Err(_) => return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the server failed on this request")),
    };
    Ok(json(StatusCode::OK, serde_json::json!({ "text": text, "tokens": tokens }).to_string()))
}

/// A `POST /generate` body.
struct GenerateRequest {
    prompt: String,
    tokens: usize,
    temperature: f32,
    top_k: usize,
    seed: u64,
}

/// `{"prompt": "…", "tokens": N, …}`, or what is wrong with it.
fn parse_generate(body: &[u8], max_tokens: usize) -> Result<GenerateRequest, String> {
    let mut json: Value = serde_json::from_slice(body).map_err(|e| format!("malformed JSON: {e}"))?;
    let usage = "the body needs {\"prompt\": \"text\", \"tokens\": N}";
    only_keys(&json, &["prompt", "tokens", "temperature", "top_k", "seed"], usage)?;
    let Some(prompt) = json.get("prompt") else {
        return Err(usage.into());
    };
    let Some(prompt) = prompt.as_str() else {
        return Err(format!("\"prompt\" must be a string of text, not {prompt}"));
    };
    if prompt.is_empty() {
        return Err("the prompt is empty: a stream starts from at least one character".into());
    }
    let Some(tokens) = json.get("tokens") else {
        return Err(usage.into());
    };
    let tokens = match tokens.as_u64() {
        Some(n) if n >= 1 && n <= max_tokens as u64 => n as usize,
        _ => return Err(format!("\"tokens\" must be a whole number from 1 to {max_tokens}, not {tokens}")),
    };
    let temperature = match json.get("temperature") {
        None => 1.0,
        Some(t) => match t.as_f64() {
            // Checked as the f32 it becomes: serde_json's reading of a number's text may
            // be one step of f64 off (f32::MAX's own text, read a step above it, still
            // rounds to f32::MAX).
            Some(t) if t >= 0.0 && (t as f32).is_finite() => t as f32,
            _ => return Err(format!("\"temperature\" must be a finite number of at least 0, not {t}")),
        },
    };
    let whole = |key: &str| match json.get(key) {
        None => Ok(0),
        Some(v) => v.as_u64().ok_or_else(|| format!("\"{key}\" must be a whole number of at least 0, not {v}")),
    };
    let (top_k, seed) = (usize::try_from(whole("top_k")?).unwrap_or(usize::MAX), whole("seed")?);
    // Moved out of the body's tree, not copied (it may be as long as the body).
    let Some(Value::String(prompt)) = json.get_mut("prompt").map(Value::take) else {
        unreachable!("checked above: a string")
    };
    Ok(GenerateRequest { prompt, tokens, temperature, top_k, seed })
}

/// `POST /predict`: the body read, then parsed, checked and run through the pool on a
/// blocking thread.
async fn predict(
    State(app): State<Arc<App>>,
    Extension(Arrived(arrived)): Extension<Arrived>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let deadline = arrived + app.limits.request_time;
    let body = read_body(&app, &headers, body).await?;
    // The body parsed, run and answered on a blocking thread: a body of the largest size
    // takes milliseconds to parse, which no runtime thread (serving every connection)
    // spends.
    let pool = Arc::clone(&app.pool);
    // Set when this handler is dropped (its client went away): the blocking thread then
    // runs nothing more for it.
    let cancelled = Arc::new(AtomicBool::new(false));
    let _cancel = Cancel(Arc::clone(&cancelled));
    let answered = tokio::task::spawn_blocking(move || answer_predict(&pool, &body, deadline, &cancelled));
    match answered.await {
        Ok(Ok(answer)) => Ok(json(StatusCode::OK, answer)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the server failed on this request")),
    }
}

/// `POST /predict`'s answer to `body`, computed by `pool` before `deadline` unless its
/// client went away first (`cancelled`): its JSON, or the error to answer with.
fn answer_predict(
    pool: &InferencePool,
    body: &[u8],
    deadline: Instant,
    cancelled: &AtomicBool,
) -> Result<String, ApiError> {
    let x = parse_inputs(body, pool.model().inputs()).map_err(|m| ApiError::new(StatusCode::BAD_REQUEST, m))?;
    if cancelled.load(Ordering::Relaxed) {
        // No one reads the answer: the pool's arenas go to the requests of live clients.
        return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the client went away"));
    }
    // Never longer than the request may take: past it, no one reads the answer.
    let wait = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let mut probabilities = Array2::zeros((x.nrows(), pool.model().classes()));
    pool.output_timeout(x.view(), probabilities.view_mut(), wait)
        .map_err(|e| ApiError::new(status_of(&e), e.to_string()))?;
    // Finite inputs the model carries past f32 (it overflows): its failure, not the
    // client's, and never probabilities of `null`.
    if let Some((at, p)) = probabilities.indexed_iter().find(|(_, p)| !p.is_finite()) {
        return Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the model failed on these inputs: the probability of class {} of row {} is {p}", at.1, at.0),
        ));
    }
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
    Ok(format!("{{\"classes\":{classes},\"probabilities\":{rows}}}"))
}

/// The answer to a body that could not be read: too large (the client sent more than
/// its Content-Length said it would not), silent too long, or cut short.
fn body_error(e: &axum::Error, limits: &Limits) -> ApiError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = e.source();
    while let Some(error) = source {
        if error.is::<http_body_util::LengthLimitError>() {
            return ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body is larger than the limit of {} bytes", limits.max_body),
            );
        }
        if error.is::<tower_http::timeout::TimeoutError>() {
            return ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                format!("the body stopped for {} ms", limits.body_idle.as_millis()),
            );
        }
        source = error.source();
    }
    ApiError::new(StatusCode::BAD_REQUEST, format!("the body could not be read: {e}"))
}

/// That `json` is an object of no keys but `known`: a misspelt option (`"temprature"`)
/// is an error naming it, not a request served with the option's default.
fn only_keys(json: &Value, known: &[&str], usage: &str) -> Result<(), String> {
    let Value::Object(fields) = json else {
        return Err(format!("the body is not a JSON object: {usage}"));
    };
    match fields.keys().find(|key| !known.contains(&key.as_str())) {
        Some(key) => {
            let known = known.iter().map(|k| format!("\"{k}\"")).collect::<Vec<_>>().join(", ");
            Err(format!("unknown field {}: the body's fields are {known}", Value::String(key.clone())))
        }
        None => Ok(()),
    }
}

/// A JSON answer.
fn json(status: StatusCode, body: String) -> Response {
    (status, [(CONTENT_TYPE, HeaderValue::from_static("application/json"))], body).into_response()
}

/// A refused request: its status and `{"error": message}`.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
    /// The methods the path takes (`405` answers).
    allow: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), allow: None }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = json(self.status, serde_json::json!({ "error": self.message }).to_string());
        if let Some(allow) = self.allow {
            response.headers_mut().insert(ALLOW, HeaderValue::from_static(allow));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::parse_generate;

    fn temperature(text: &str) -> Result<f32, String> {
        let body = format!(r#"{{"prompt": "a", "tokens": 1, "temperature": {text}}}"#);
        parse_generate(body.as_bytes(), 10).map(|request| request.temperature)
    }

    #[test]
    fn a_temperature_is_any_finite_f32_of_at_least_0_however_its_text_reads() {
        // f32::MAX as its shortest text, and as the f64 that serde_json writes for it
        // (which its reader takes one step of f64 above f32::MAX).
        assert_eq!(temperature("3.4028235e38"), Ok(f32::MAX));
        assert_eq!(temperature("3.4028234663852886e38"), Ok(f32::MAX));
        assert_eq!(temperature(&serde_json::json!(f32::MAX).to_string()), Ok(f32::MAX));
        assert_eq!(temperature("0"), Ok(0.0));
        assert_eq!(temperature("-0.0"), Ok(0.0));
        assert_eq!(temperature("1e-45"), Ok(1e-45));
        assert_eq!(temperature("0.8"), Ok(0.8));
        for refused in ["3.5e38", "1e39", "-1e-30", "-1", "\"1\"", "null"] {
            let error = temperature(refused).expect_err(refused);
            assert!(error.contains("\"temperature\" must be a finite number of at least 0"), "{refused}: {error}");
        }
        // Beyond f64's range is not JSON serde_json reads: malformed.
        assert!(temperature("1e400").is_err());
    }
}
