//! A small HTTP/1.1 server for the serving examples (included with `#[path]`): requests
//! parsed by `httparse`, bodies by `Content-Length`, keep-alive, and limits on
//! everything a client controls (the head's size, the body's size, idle time, the
//! connections waiting for a thread), so that no request can make it allocate without
//! bound, hang a thread, or stop it serving others.
//!
//! A fixed set of threads serves the connections an accepting thread hands them through
//! a bounded queue; when the queue is full, a new connection gets `503` at once. A
//! connection is closed after its answer once it has made `requests_per_connection`
//! requests, been open `connection_time`, or every thread is busy while another
//! connection waits; writing an
//! answer has a deadline too, so slow clients cannot keep the threads.

// Not every example needs every helper.
#![allow(dead_code)]

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A request: its method, path (without the query), body, and whether the client
/// asked to close the connection after it.
#[derive(Debug)]
pub(crate) struct Request {
    pub(crate) method: String,
    pub(crate) path: String,
    pub(crate) body: Vec<u8>,
}

/// A JSON response.
#[derive(Debug)]
pub(crate) struct Response {
    pub(crate) status: u16,
    pub(crate) body: String,
    /// The methods the path takes (`405` responses).
    pub(crate) allow: Option<&'static str>,
}

impl Response {
    /// `200` with `body` (JSON).
    pub(crate) fn ok(body: String) -> Response {
        Response { status: 200, body, allow: None }
    }

    /// `status` with `{"error": message}`.
    pub(crate) fn error(status: u16, message: &str) -> Response {
        Response { status, body: serde_json::json!({ "error": message }).to_string(), allow: None }
    }
}

/// What a client may send and how long it may take.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// The request line and headers.
    pub(crate) max_head: usize,
    /// A request body.
    pub(crate) max_body: usize,
    /// How long a connection may stay silent (between requests, or within one).
    pub(crate) idle: Duration,
    /// How long a request may take to arrive, from its first byte to its body's last.
    pub(crate) request_time: Duration,
    /// Connections accepted but not yet taken by a thread.
    pub(crate) queue: usize,
    /// Requests one connection may make before it is closed (so that a few clients
    /// cannot keep every thread for ever).
    pub(crate) requests_per_connection: usize,
    /// How long a connection may stay open.
    pub(crate) connection_time: Duration,
}

/// Serves `listener` on `threads` threads, answering each request with `handler`,
/// until the process ends.
pub(crate) fn serve<H>(listener: TcpListener, threads: usize, limits: Limits, handler: H) -> std::io::Result<()>
where
    H: Fn(&Request) -> Response + Sync,
{
    let (send, receive) = sync_channel::<TcpStream>(limits.queue);
    let receive = Arc::new(Mutex::new(receive));
    let load = Load { queued: AtomicUsize::new(0), serving: AtomicUsize::new(0), threads: threads.max(1) };
    std::thread::scope(|s| {
        for _ in 0..load.threads {
            let (receive, handler, load) = (Arc::clone(&receive), &handler, &load);
            s.spawn(move || worker(&receive, load, limits, handler));
        }
        for stream in listener.incoming() {
            let stream = match stream {
                Ok(stream) => stream,
                // A connection that failed while being accepted: the next one.
                Err(_) => continue,
            };
            load.queued.fetch_add(1, Ordering::Relaxed);
            match send.try_send(stream) {
                Ok(()) => {}
                Err(TrySendError::Full(mut stream)) => {
                    load.queued.fetch_sub(1, Ordering::Relaxed);
                    // Answered in passing (the accepting thread does not wait on a client).
                    let _ = stream.set_nonblocking(true);
                    let busy = Response::error(503, "the server is busy: every thread is serving; try again");
                    let _ = stream.write_all(&response_bytes(&busy, true, false));
                }
                Err(TrySendError::Disconnected(_)) => break,
            }
        }
        drop(send);
        Ok(())
    })
}

/// How busy the threads are.
struct Load {
    /// Connections accepted and not yet taken by a thread.
    queued: AtomicUsize,
    /// Threads serving a connection.
    serving: AtomicUsize,
    threads: usize,
}

impl Load {
    /// Every thread serves a connection and another waits for one.
    fn saturated(&self) -> bool {
        self.queued.load(Ordering::Relaxed) > 0 && self.serving.load(Ordering::Relaxed) >= self.threads
    }
}

fn worker<H>(receive: &Mutex<Receiver<TcpStream>>, load: &Load, limits: Limits, handler: &H)
where
    H: Fn(&Request) -> Response + Sync,
{
    loop {
        let stream = match receive.lock().map(|r| r.recv()) {
            Ok(Ok(stream)) => stream,
            _ => return,
        };
        load.serving.fetch_add(1, Ordering::Relaxed);
        load.queued.fetch_sub(1, Ordering::Relaxed);
        connection(stream, load, limits, handler);
        load.serving.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Serves one connection's requests until the client closes it, asks to, goes idle,
/// or sends something that ends it.
fn connection<H>(mut stream: TcpStream, load: &Load, limits: Limits, handler: &H)
where
    H: Fn(&Request) -> Response,
{
    let _ = stream.set_nodelay(true);
    let opened = Instant::now();
    let mut buffer = Vec::with_capacity(4096);
    for served in 1.. {
        let head = match read_head(&mut stream, &mut buffer, limits) {
            Ok(Some(head)) => head,
            Ok(None) => return,
            Err(response) => return refuse(stream, &response, limits),
        };
        let head_only = head.method == "HEAD";
        let (request, asked_to_close) = match read_body(&mut stream, &mut buffer, head, limits) {
            Ok(Some(done)) => done,
            Ok(None) => return,
            Err(response) => return refuse(stream, &response, limits),
        };
        // A handler that panics answers 500; the thread goes on serving.
        let response = catch_unwind(AssertUnwindSafe(|| handler(&request)))
            .unwrap_or_else(|_| Response::error(500, "the server failed on this request"));
        // Closed after its answer when the client asks, when the connection has served
        // its share, or when every thread is busy and another connection waits.
        let close = asked_to_close
            || served >= limits.requests_per_connection
            || opened.elapsed() >= limits.connection_time
            || load.saturated();
        let bytes = response_bytes(&response, close, head_only);
        if write_within(&mut stream, &bytes, Instant::now() + limits.idle).is_err() {
            return;
        }
        if close {
            return linger(stream, limits.max_body, Duration::from_millis(500));
        }
    }
}

/// A request's head, parsed.
struct Head {
    method: String,
    path: String,
    /// Bytes of the buffer the head took.
    len: usize,
    content_length: Option<usize>,
    chunked: bool,
    /// The client waits for `100 Continue` before it sends the body.
    continues: bool,
    close: bool,
    /// When its first byte came.
    begun: Instant,
}

/// Reads until the buffer holds a whole head. `Ok(None)`: the connection ended (or
/// went idle) between requests.
fn read_head(stream: &mut TcpStream, buffer: &mut Vec<u8>, limits: Limits) -> Result<Option<Head>, Response> {
    // A pipelined request already in the buffer has begun.
    let mut begun = Instant::now();
    loop {
        if !buffer.is_empty() {
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut request = httparse::Request::new(&mut headers);
            match request.parse(buffer) {
                Ok(httparse::Status::Complete(len)) => {
                    let header = |name: &str| {
                        request.headers.iter().find(|h| h.name.eq_ignore_ascii_case(name)).map(|h| h.value)
                    };
                    let text = |value: &[u8]| String::from_utf8_lossy(value).trim().to_ascii_lowercase();
                    let mut lengths = request.headers.iter().filter(|h| h.name.eq_ignore_ascii_case("content-length"));
                    let content_length = match lengths.next().map(|h| text(h.value)) {
                        None => None,
                        Some(value) => {
                            if lengths.any(|other| text(other.value) != value) {
                                return Err(Response::error(400, "two Content-Length headers that disagree"));
                            }
                            match value.parse::<usize>() {
                                Ok(length) => Some(length),
                                // Digits too many for a number: larger than any limit.
                                Err(_) if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) => {
                                    Some(usize::MAX)
                                }
                                Err(_) => {
                                    return Err(Response::error(
                                        400,
                                        "the Content-Length header is not a number of bytes",
                                    ))
                                }
                            }
                        }
                    };
                    let continues = header("expect").is_some_and(|v| text(v) == "100-continue");
                    let connection = header("connection").map(text).unwrap_or_default();
                    let close = connection == "close" || (request.version == Some(0) && connection != "keep-alive");
                    let path = request.path.unwrap_or("/");
                    return Ok(Some(Head {
                        method: request.method.unwrap_or("").to_string(),
                        path: path.split('?').next().unwrap_or(path).to_string(),
                        len,
                        content_length,
                        chunked: header("transfer-encoding").is_some(),
                        continues,
                        close,
                        begun,
                    }));
                }
                Ok(httparse::Status::Partial) => {}
                Err(httparse::Error::TooManyHeaders) => {
                    return Err(Response::error(431, "more than 32 headers"));
                }
                Err(e) => return Err(Response::error(400, &format!("not an HTTP request: {e}"))),
            }
        }
        if buffer.len() >= limits.max_head {
            return Err(Response::error(431, &format!("the request's head is over {} bytes", limits.max_head)));
        }
        let was_empty = buffer.is_empty();
        match fill(stream, buffer, limits.max_head - buffer.len(), limits, begun) {
            Ok(0) | Err(_) => return Ok(None),
            Ok(_) if was_empty => begun = Instant::now(),
            Ok(_) => {}
        }
    }
}

/// Reads the body `head` announces. `Ok(None)`: the client went away mid-body.
fn read_body(
    stream: &mut TcpStream,
    buffer: &mut Vec<u8>,
    head: Head,
    limits: Limits,
) -> Result<Option<(Request, bool)>, Response> {
    if head.chunked {
        return Err(Response::error(411, "chunked bodies are not taken: send the body with a Content-Length"));
    }
    let length = match (head.content_length, head.method.as_str()) {
        (Some(length), _) => length,
        (None, "POST" | "PUT" | "PATCH") => {
            return Err(Response::error(411, "a request with a body needs a Content-Length"));
        }
        (None, _) => 0,
    };
    if length > limits.max_body {
        return Err(Response::error(
            413,
            &format!("the body of {length} bytes is larger than the limit of {} bytes", limits.max_body),
        ));
    }
    let end = head.len + length;
    if head.continues && buffer.len() < end {
        let _ = write_within(stream, b"HTTP/1.1 100 Continue\r\n\r\n", Instant::now() + limits.idle);
    }
    while buffer.len() < end {
        match fill(stream, buffer, end - buffer.len(), limits, head.begun) {
            Ok(0) | Err(_) => return Ok(None),
            Ok(_) => {}
        }
    }
    let body = buffer[head.len..end].to_vec();
    // What follows (a pipelined request) stays for the next round.
    buffer.drain(..end);
    Ok(Some((Request { method: head.method, path: head.path, body }, head.close)))
}

/// Reads at most `most` more bytes into `buffer`, waiting at most `idle`, and not past
/// the request's deadline once it has begun (its first byte is in `buffer`).
fn fill(
    stream: &mut TcpStream,
    buffer: &mut Vec<u8>,
    most: usize,
    limits: Limits,
    begun: Instant,
) -> std::io::Result<usize> {
    let wait = match buffer.is_empty() {
        true => limits.idle,
        false => (begun + limits.request_time).saturating_duration_since(Instant::now()).min(limits.idle),
    };
    if wait.is_zero() {
        return Err(ErrorKind::TimedOut.into());
    }
    stream.set_read_timeout(Some(wait))?;
    let mut chunk = [0u8; 16 * 1024];
    let want = most.min(chunk.len());
    loop {
        match stream.read(&mut chunk[..want]) {
            Ok(n) => {
                buffer.extend_from_slice(&chunk[..n]);
                return Ok(n);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Answers a request that ends its connection, then closes it gently.
fn refuse(mut stream: TcpStream, response: &Response, limits: Limits) {
    if write_within(&mut stream, &response_bytes(response, true, false), Instant::now() + limits.idle).is_ok() {
        // Reads (and drops) what the client still sends, so that it sees the answer
        // rather than a reset: at most an oversized body's worth, for a second.
        linger(stream, limits.max_body.saturating_mul(64).max(1 << 20), Duration::from_secs(1));
    }
}

/// Closes the connection for writing, then reads and drops at most `most` bytes for at
/// most `time`, so that the client reads the answer before the connection closes.
fn linger(mut stream: TcpStream, most: usize, time: Duration) {
    let _ = stream.shutdown(Shutdown::Write);
    let until = Instant::now() + time;
    let mut chunk = [0u8; 16 * 1024];
    let mut read = 0;
    while read < most {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => read += n,
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        411 => "Length Required",
        413 => "Content Too Large",
        422 => "Unprocessable Content",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "",
    }
}

/// The bytes of `response` (without its body for a `HEAD` request).
fn response_bytes(response: &Response, close: bool, head_only: bool) -> Vec<u8> {
    let mut head = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: {}\r\n",
        response.status,
        reason(response.status),
        response.body.len(),
        if close { "close" } else { "keep-alive" },
    );
    if let Some(allow) = response.allow {
        head.push_str(&format!("Allow: {allow}\r\n"));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    if !head_only {
        bytes.extend_from_slice(response.body.as_bytes());
    }
    bytes
}

/// Writes `bytes` by `deadline`: a client that reads slowly cannot hold the thread
/// past it.
fn write_within(stream: &mut TcpStream, mut bytes: &[u8], deadline: Instant) -> std::io::Result<()> {
    while !bytes.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ErrorKind::TimedOut.into());
        }
        stream.set_write_timeout(Some(left))?;
        match stream.write(bytes) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    stream.flush()
}
