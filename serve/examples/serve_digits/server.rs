//! The connections: accepted on tokio, each a task that hyper's HTTP/1.1 connection
//! serves with the axum router, then closed so that the client reads its last answer.
//!
//! Every limit on what a client controls, and where it is enforced:
//!
//! | limit | by | answer |
//! |---|---|---|
//! | a request head within `header_timeout` of the server waiting for it (idle keep-alive time included) | hyper, `header_read_timeout` | the connection closed |
//! | a head of at most `max_head` bytes | hyper, `max_buf_size` | bare 431 |
//! | at most `max_connections` open connections | a semaphore before `accept` | new ones wait in the listen queue |
//! | a connection open at most `connection_time` | this module | closed after its answer in flight |
//! | at most `in_flight` requests being answered | tower, `GlobalConcurrencyLimitLayer` | later ones wait (within `request_time`) |
//! | a body of at most `max_body` bytes | tower-http, `RequestBodyLimitLayer` | 413 |
//! | no silence longer than `body_idle` within a body | tower-http, `RequestBodyTimeoutLayer` | 408 |
//! | a whole body within `body_time` (however steadily it trickles) | `routes.rs`, `read_body` | 408 |
//! | an answer within `request_time` | tower-http, `TimeoutLayer`; the pool's `output_timeout` | 503 |
//!
//! A client that shuts down its side of the connection after its request (`nc -N`,
//! say) is taken for a client gone, as hyper's default (`half_close` off) takes it: its
//! request is cut short (a generation stops between two tokens) and it gets no answer.
//! That is what lets the server stop work for clients that went away; a client that
//! wants its answer keeps its side open until it has read it.
//!
//! (`routes.rs` applies the tower layers.) `axum::serve` does not let a caller set
//! hyper's header read timeout (axum 0.8.9 gives hyper no timer, so no deadline holds at
//! all), so the connections are driven here with hyper's HTTP/1.1 connection builder,
//! which is what `axum::serve` does inside.

use std::convert::Infallible;
use std::future::{poll_fn, Future};
use std::io::ErrorKind;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Request;
use axum::response::Response;
use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::AsyncWrite;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{sleep, timeout, timeout_at, Instant};
use tower::ServiceExt;

/// What a client may make the server hold, and for how long.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// How long a client may take to send a request head, from when the server starts
    /// waiting for it (after the previous answer, on a kept-alive connection).
    pub(crate) header_timeout: Duration,
    /// A request head (the request line and headers), in bytes.
    pub(crate) max_head: usize,
    /// How long a client may stay silent within a request body.
    pub(crate) body_idle: Duration,
    /// How long a whole request body may take to arrive.
    pub(crate) body_time: Duration,
    /// A request body, in bytes.
    pub(crate) max_body: usize,
    /// How long a request may take, from its head to its answer.
    pub(crate) request_time: Duration,
    /// Requests being answered at once; each may hold a blocking thread.
    pub(crate) in_flight: usize,
    /// Open connections.
    pub(crate) max_connections: usize,
    /// How long a connection may stay open (then it closes after the answer in
    /// flight, if any).
    pub(crate) connection_time: Duration,
    /// The most tokens one `POST /generate` may ask for.
    pub(crate) max_tokens: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            header_timeout: Duration::from_secs(5),
            max_head: 16 * 1024,
            body_idle: Duration::from_secs(5),
            body_time: Duration::from_secs(10),
            max_body: 1 << 20,
            request_time: Duration::from_secs(30),
            in_flight: 256,
            max_connections: 1024,
            connection_time: Duration::from_secs(60),
            max_tokens: 1000,
        }
    }
}

/// How long a closing connection reads (and drops) what the client still sends, so that
/// the client reads the answer rather than a reset ([`linger`]).
const LINGER_TIME: Duration = Duration::from_secs(1);
/// The most a closing connection reads meanwhile.
const LINGER_BYTES: usize = 16 << 20;

/// How long to wait before accepting again after `accept` failed (out of file
/// descriptors, say): the failure would repeat at once.
const ACCEPT_PAUSE: Duration = Duration::from_millis(50);

/// What hyper's service returns: boxed, so that it is `Unpin`, which
/// `poll_without_shutdown` needs to give the socket back for [`linger`].
type Answer = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

/// Accepts connections on `listener` and serves each on a task of its own, until the
/// process ends. A failed `accept` is retried: it says something of one connection, or
/// of the process's file descriptors, not of the listener.
pub(crate) async fn serve(listener: TcpListener, app: Router, limits: &Limits) -> Infallible {
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout).max_buf_size(limits.max_head);
    let open = Arc::new(Semaphore::new(limits.max_connections));
    loop {
        let permit = Arc::clone(&open).acquire_owned().await.expect("the semaphore is never closed");
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == ErrorKind::ConnectionAborted => continue,
            Err(_) => {
                sleep(ACCEPT_PAUSE).await;
                continue;
            }
        };
        // Answers are small and written whole: send them at once.
        let _ = stream.set_nodelay(true);
        tokio::spawn(connection(stream, http.clone(), app.clone(), *limits, permit));
    }
}

/// Serves one connection's requests until it ends (the client closes it, stays silent
/// past a deadline, sends something that is not HTTP, or the connection has been open
/// `connection_time`), then closes it gently.
async fn connection(stream: TcpStream, http: http1::Builder, app: Router, limits: Limits, open: OwnedSemaphorePermit) {
    let service = hyper::service::service_fn(move |request: Request<Incoming>| -> Answer {
        Box::pin(app.clone().oneshot(request))
    });
    let mut connection = http.serve_connection(TokioIo::new(stream), service);
    // An error (a head that is not HTTP, past its deadline, a client gone) has been
    // answered by hyper where HTTP has an answer for it; the connection ends either way.
    let ended = match timeout(limits.connection_time, poll_fn(|cx| connection.poll_without_shutdown(cx))).await {
        Ok(ended) => Some(ended),
        Err(_) => {
            Pin::new(&mut connection).graceful_shutdown();
            timeout(limits.request_time, poll_fn(|cx| connection.poll_without_shutdown(cx))).await.ok()
        }
    };
    // The connection is no longer served: another may be accepted while this one closes.
    drop(open);
    match ended {
        // Cut off within a head, past its deadline: there is no answer to read.
        Some(Err(e)) if e.is_timeout() => {}
        Some(_) => linger(connection.into_parts().io.into_inner()).await,
        // Still busy past its time and the grace after it: dropped.
        None => {}
    }
}

/// Closes `stream` for writing, then reads and drops what the client still sends, for
/// at most [`LINGER_TIME`] and [`LINGER_BYTES`]: the staged close of RFC 9112 §9.6.
/// Closing a socket with unread bytes (a body after its 413, the rest of a head over the
/// limit) resets the connection, and a client's system may then drop the answer that
/// the client has not read yet.
async fn linger(mut stream: TcpStream) {
    if poll_fn(|cx| Pin::new(&mut stream).poll_shutdown(cx)).await.is_err() {
        return;
    }
    let until = Instant::now() + LINGER_TIME;
    let mut chunk = vec![0u8; 16 * 1024];
    let mut read = 0;
    while read < LINGER_BYTES {
        if !matches!(timeout_at(until, stream.readable()).await, Ok(Ok(()))) {
            return;
        }
        match stream.try_read(&mut chunk) {
            Ok(0) => return,
            Ok(n) => read += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(_) => return,
        }
    }
}
