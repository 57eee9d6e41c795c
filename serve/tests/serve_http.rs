//! `serve_digits` as a client meets it: started on a free port of 127.0.0.1, it answers
//! good requests with the model's own bits (in both pool modes, from many connections
//! at once), every bad request with a 4xx (a JSON error from the routes, hyper's bare
//! status for a head that is not HTTP), and goes on serving after each; clients that
//! dribble their heads, or fall silent, hold nothing from the others and are cut off at
//! their deadlines. The client is a plain `TcpStream` with timeouts, and every loop is
//! bounded in count and time, so nothing here can hang.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{mpsc, OnceLock};
use std::time::{Duration, Instant};

use carve::nn::{serve::Model, Network, NetworkConfig};
use carve_rng::Rng;
use ndarray::Array2;
use serde_json::Value;

/// The path of the `serve_digits` example, built once per test process with the
/// profile of this test: a nested `cargo build`, so that the binary run is the current
/// source (`cargo test --test serve_http` alone does not build the package's examples).
fn serve_digits() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        // This test runs from target/<profile>/deps; examples go to
        // target/<profile>/examples.
        let exe = std::env::current_exe().expect("the test's own path");
        let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>");
        let target_dir = profile_dir.parent().expect("target/<profile>");
        let mut cargo = Command::new(env!("CARGO"));
        cargo.args(["build", "--quiet", "-p", env!("CARGO_PKG_NAME"), "--example", "serve_digits"]);
        cargo.arg("--target-dir").arg(target_dir);
        if profile_dir.file_name().is_some_and(|name| name == "release") {
            cargo.arg("--release");
        }
        let status = cargo.current_dir(env!("CARGO_MANIFEST_DIR")).status().expect("cargo runs");
        assert!(status.success(), "building serve_digits failed: {status}");
        profile_dir.join("examples").join(format!("serve_digits{}", std::env::consts::EXE_SUFFIX))
    })
}

/// A running `serve_digits`, killed when dropped (also when a test fails).
struct Server {
    child: Child,
    port: u16,
}

impl Server {
    fn start(model: &Path, args: &[&str]) -> Server {
        let mut child = Command::new(serve_digits())
            .args(["--model", model.to_str().unwrap(), "--port", "0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("serve_digits starts");
        let stdout = child.stdout.take().unwrap();
        let (send, receive) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = send.send(line);
        });
        let line = receive.recv_timeout(Duration::from_secs(60)).unwrap_or_default();
        let mut server = Server { child, port: 0 };
        let Some(port) = line.trim().strip_prefix("listening on 127.0.0.1:") else {
            let _ = server.child.kill();
            let mut stderr = String::new();
            let _ = server.child.stderr.take().unwrap().read_to_string(&mut stderr);
            panic!("serve_digits did not say where it listens: {line:?}; stderr: {stderr}");
        };
        server.port = port.parse().expect("a port number");
        server
    }

    fn connect(&self) -> Connection {
        let stream = TcpStream::connect(("127.0.0.1", self.port)).expect("the server accepts");
        stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        stream.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
        Connection { reader: BufReader::new(stream) }
    }

    /// One request on a connection of its own.
    fn send(&self, method: &str, path: &str, body: Option<&[u8]>) -> (u16, Value) {
        self.connect().request(method, path, body)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A keep-alive connection.
struct Connection {
    reader: BufReader<TcpStream>,
}

impl Connection {
    fn raw(&mut self, bytes: &[u8]) -> (u16, Value) {
        self.send_raw(bytes);
        self.response()
    }

    /// Sends `bytes`. A server may answer (413) before the whole body is sent, and
    /// close: a failed write is not the test's failure, the answer is what counts.
    fn send_raw(&mut self, bytes: &[u8]) {
        let _ = self.reader.get_mut().write_all(bytes);
    }

    fn request(&mut self, method: &str, path: &str, body: Option<&[u8]>) -> (u16, Value) {
        let mut bytes = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n").into_bytes();
        if let Some(body) = body {
            bytes.extend_from_slice(
                format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len()).as_bytes(),
            );
        }
        bytes.extend_from_slice(b"\r\n");
        bytes.extend_from_slice(body.unwrap_or_default());
        self.raw(&bytes)
    }

    /// The status and the JSON body of the next response.
    fn response(&mut self) -> (u16, Value) {
        let (status, body) = self.answer();
        let json = serde_json::from_slice(&body).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&body)));
        (status, json)
    }

    /// The status and the body of the next response (a body is JSON when it says so).
    fn answer(&mut self) -> (u16, Vec<u8>) {
        let mut status_line = String::new();
        self.reader.read_line(&mut status_line).expect("a status line");
        let status: u16 = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("not an HTTP status line: {status_line:?}"));
        let mut length = None;
        loop {
            let mut line = String::new();
            self.reader.read_line(&mut line).expect("a header line");
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            let (name, value) = line.split_once(':').expect("a header");
            if name.eq_ignore_ascii_case("content-type") {
                assert_eq!(value.trim(), "application/json");
            }
            if name.eq_ignore_ascii_case("content-length") {
                length = Some(value.trim().parse::<usize>().unwrap());
            }
        }
        let mut body = vec![0; length.expect("a Content-Length")];
        self.reader.read_exact(&mut body).expect("the body");
        (status, body)
    }

    /// Whether the server has closed the connection: the next read ends (EOF, or a
    /// reset) rather than timing out.
    fn closed_within(&mut self, time: Duration) -> bool {
        self.reader.get_mut().set_read_timeout(Some(time)).unwrap();
        let mut line = String::new();
        let read = self.reader.read_line(&mut line);
        self.reader.get_mut().set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        match read {
            Ok(0) => true,
            Ok(_) => panic!("an answer where the connection should close: {line:?}"),
            Err(e) => !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
        }
    }
}

/// How a refusal is answered: a JSON error from the routes, or hyper's bare status.
enum Answer {
    Json,
    Bare,
}

fn rows_json(x: &Array2<f32>) -> Vec<u8> {
    let rows: Vec<Vec<f32>> = x.rows().into_iter().map(|r| r.to_vec()).collect();
    format!("{{\"inputs\": {}}}", serde_json::to_string(&rows).unwrap()).into_bytes()
}

/// The probabilities and classes of a 200 answer, checked against the model's own.
fn assert_answer(json: &Value, expected: &Array2<f32>) {
    let probabilities = json["probabilities"].as_array().unwrap_or_else(|| panic!("{json}"));
    let classes = json["classes"].as_array().unwrap_or_else(|| panic!("{json}"));
    assert_eq!((probabilities.len(), classes.len()), (expected.nrows(), expected.nrows()), "{json}");
    for ((row, class), want) in probabilities.iter().zip(classes).zip(expected.rows()) {
        let got: Vec<f32> = row.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        assert_eq!(got, want.to_vec(), "the model's bits, through JSON");
        let argmax = (0..want.len()).fold(0, |best, c| if want[c] > want[best] { c } else { best });
        assert_eq!(class.as_u64(), Some(argmax as u64), "{json}");
    }
}

fn saved_model(dir: &Path) -> (std::path::PathBuf, Model) {
    let config = NetworkConfig::builder(64).dense(32).relu().dense(10).seed(17).build().unwrap();
    let net = Network::new(config).unwrap();
    let path = dir.join("digits.safetensors");
    net.save(&path).unwrap();
    let model = Model::load(&path).unwrap();
    (path, model)
}

#[test]
fn inputs_the_model_carries_past_f32_are_a_500_never_null_probabilities() {
    // Finite inputs (the client's are checked) that the model overflows: every weight
    // 1, so that 64 inputs of 1e38 sum past f32 and the softmax has nothing finite.
    let dir = tempfile::tempdir().unwrap();
    let config = || NetworkConfig::builder(64).dense(32).relu().dense(10).build().unwrap();
    let params = vec![1.0; Network::new(config()).unwrap().params().len()];
    let path = dir.path().join("overflowing.safetensors");
    Model::from_config(&config(), params).unwrap().save(&path).unwrap();
    let server = Server::start(&path, &[]);
    let (status, json) = server.send("POST", "/predict", Some(&rows_json(&Array2::from_elem((2, 64), 1e38))));
    assert_eq!(status, 500, "{json}");
    assert!(json["error"].as_str().unwrap().contains("the model failed on these inputs"), "{json}");
    let (status, json) = server.send("POST", "/predict", Some(&rows_json(&Array2::zeros((1, 64)))));
    assert_eq!(status, 200, "{json}");
}

#[test]
fn a_body_that_trickles_in_is_cut_off_at_its_whole_deadline() {
    // A byte every 100 ms never falls silent for the 5 s `body_idle`; the whole body
    // has 1 s: a 408 then, not a request held for the 30 s of `request_time`.
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = saved_model(dir.path());
    let server = Server::start(&path, &["--body-timeout-ms", "1000"]);
    let mut slow = server.connect();
    slow.send_raw(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n");
    let mut writer = slow.reader.get_ref().try_clone().unwrap();
    let sent = Instant::now();
    let trickle = std::thread::spawn(move || {
        // Bounded: 60 bytes (6 s) at most, and it stops once the server closes.
        for _ in 0..60 {
            if writer.write_all(b" ").is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let (status, json) = slow.response();
    let waited = sent.elapsed();
    assert_eq!(status, 408, "{json}");
    assert!(json["error"].as_str().is_some_and(|e| e.contains("longer than 1000 ms")), "{json}");
    assert!(waited >= Duration::from_millis(900) && waited < Duration::from_secs(4), "{waited:?}");
    drop(slow);
    trickle.join().unwrap();
    assert_eq!(server.send("GET", "/stats", None).0, 200);
}

#[test]
fn serve_digits_answers_good_requests_with_the_models_bits_and_bad_ones_with_4xx_and_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let (path, model) = saved_model(dir.path());
    let mut rng = Rng::new(3);
    let x = Array2::from_shape_fn((4, 64), |_| rng.uniform(0.0, 16.0));
    let expected = model.output(x.view()).unwrap();
    let row = |n: usize| vec!["0.5"; n].join(",");
    for mode in ["direct", "batched"] {
        let server = Server::start(&path, &["--workers", "2", "--mode", mode]);
        let (status, json) = server.send("POST", "/predict", Some(&rows_json(&x)));
        assert_eq!(status, 200, "{mode}: {json}");
        assert_answer(&json, &expected);

        let oversized = format!("{{\"inputs\": [{}]}}", vec![format!("[{}]", row(64)); 6000].join(","));
        assert!(oversized.len() > 1 << 20);
        let bad: Vec<(&str, Vec<u8>, u16, &str)> = vec![
            ("malformed JSON", b"{\"inputs\": [[1, 2,".to_vec(), 400, "malformed JSON"),
            ("not JSON at all", b"inputs=1,2,3".to_vec(), 400, "malformed JSON"),
            ("wrong feature count", format!("{{\"inputs\": [[{}]]}}", row(63)).into_bytes(), 400, "64 features"),
            (
                "a ragged batch",
                format!("{{\"inputs\": [[{}], [{}]]}}", row(64), row(65)).into_bytes(),
                400,
                "row 1 has 65",
            ),
            ("NaN", format!("{{\"inputs\": [[NaN, {}]]}}", row(63)).into_bytes(), 400, "NaN"),
            ("a value beyond f32", format!("{{\"inputs\": [[1e39, {}]]}}", row(63)).into_bytes(), 400, "non-finite"),
            ("a string value", format!("{{\"inputs\": [[\"7\", {}]]}}", row(63)).into_bytes(), 400, "not a number"),
            ("an empty batch", b"{\"inputs\": []}".to_vec(), 400, "empty batch"),
            ("no inputs", b"{\"rows\": [[1]]}".to_vec(), 400, "\"inputs\""),
            ("inputs not a list", b"{\"inputs\": 3}".to_vec(), 400, "list of rows"),
            (
                "an unknown field",
                format!("{{\"inputs\": [[{}]], \"normalise\": true}}", row(64)).into_bytes(),
                400,
                "unknown field \"normalise\"",
            ),
            ("not an object", format!("[[{}]]", row(64)).into_bytes(), 400, "not a JSON object"),
            ("an oversized body", oversized.into_bytes(), 413, "larger than the limit"),
        ];
        for (what, body, want, needle) in &bad {
            let (status, json) = server.send("POST", "/predict", Some(body));
            assert_eq!(status, *want, "{mode}, {what}: {json}");
            let message = json["error"].as_str().unwrap_or_else(|| panic!("{mode}, {what}: no error message: {json}"));
            assert!(message.contains(needle), "{mode}, {what}: '{message}' should say '{needle}'");
        }
        // Requests the routes refuse before they read a body (a lying length, no length,
        // chunked, a wrong method or path): a JSON error; and heads that hyper refuses
        // as HTTP/1.1 (a bad or overflowing Content-Length, two that disagree, not HTTP,
        // a head over 16 KiB): its bare status, no body, before any route.
        let mut refusals = vec![
            (
                "a lying Content-Length",
                b"POST /predict HTTP/1.1\r\nContent-Length: 1000000000000000\r\n\r\n{".to_vec(),
                413,
                Answer::Json,
            ),
            ("no Content-Length", b"POST /predict HTTP/1.1\r\n\r\n".to_vec(), 411, Answer::Json),
            (
                "a chunked body",
                b"POST /predict HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n".to_vec(),
                411,
                Answer::Json,
            ),
            ("GET /predict", b"GET /predict HTTP/1.1\r\n\r\n".to_vec(), 405, Answer::Json),
            ("an unknown path", b"GET /nothing HTTP/1.1\r\n\r\n".to_vec(), 404, Answer::Json),
            (
                "a bad Content-Length",
                b"POST /predict HTTP/1.1\r\nContent-Length: many\r\n\r\n".to_vec(),
                400,
                Answer::Bare,
            ),
            (
                "two Content-Lengths that disagree",
                b"POST /predict HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n".to_vec(),
                400,
                Answer::Bare,
            ),
            (
                "a Content-Length of 30 digits",
                b"POST /predict HTTP/1.1\r\nContent-Length: 999999999999999999999999999999\r\n\r\n".to_vec(),
                400,
                Answer::Bare,
            ),
            ("not HTTP", b"\x00\x01\x02 hello\r\n\r\n".to_vec(), 400, Answer::Bare),
        ];
        let huge_head = format!("GET /stats HTTP/1.1\r\nX-Filler: {}\r\n\r\n", "a".repeat(40_000)).into_bytes();
        refusals.push(("a head over 16 KiB", huge_head, 431, Answer::Bare));
        for (what, bytes, want, answer) in &refusals {
            let mut connection = server.connect();
            connection.send_raw(bytes);
            let (status, body) = connection.answer();
            assert_eq!(status, *want, "{mode}, {what}: {}", String::from_utf8_lossy(&body));
            match answer {
                Answer::Json => {
                    let json: Value = serde_json::from_slice(&body).unwrap();
                    assert!(json["error"].is_string(), "{mode}, {what}: {json}");
                }
                Answer::Bare => assert!(body.is_empty(), "{mode}, {what}: {}", String::from_utf8_lossy(&body)),
            }
        }

        // HEAD gets its head only (the next answer on the connection is read whole).
        let mut connection = server.connect();
        connection.reader.get_mut().write_all(b"HEAD /stats HTTP/1.1\r\n\r\n").unwrap();
        let mut head = String::new();
        while !head.ends_with("\r\n\r\n") {
            let mut line = String::new();
            assert!(connection.reader.read_line(&mut line).unwrap() > 0, "{head}");
            head.push_str(&line);
        }
        assert!(head.starts_with("HTTP/1.1 405"), "{head}");
        assert_eq!(connection.request("GET", "/stats", None).0, 200);
        // A client that waits for `100 Continue` before its body gets it.
        let body = rows_json(&x);
        let expect =
            format!("POST /predict HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n", body.len());
        connection.reader.get_mut().write_all(expect.as_bytes()).unwrap();
        let mut line = String::new();
        connection.reader.read_line(&mut line).unwrap();
        assert_eq!(line, "HTTP/1.1 100 Continue\r\n");
        line.clear();
        connection.reader.read_line(&mut line).unwrap();
        assert_eq!(line, "\r\n");
        let (status, json) = connection.raw(&body);
        assert_eq!(status, 200, "{json}");
        assert_answer(&json, &expected);

        // Still serving, with the same bits, on a keep-alive connection.
        let mut connection = server.connect();
        for _ in 0..3 {
            let (status, json) = connection.request("POST", "/predict", Some(&rows_json(&x)));
            assert_eq!(status, 200, "{mode}: {json}");
            assert_answer(&json, &expected);
        }
        let (status, stats) = connection.request("GET", "/stats", None);
        assert_eq!(status, 200);
        assert_eq!(stats["workers"].as_u64(), Some(2), "{stats}");
        assert_eq!(stats["mode"].as_str(), Some(mode), "{stats}");
        assert!(stats["leases"].as_u64().is_some_and(|n| n >= 4), "{stats}");
        assert_eq!(stats["panics"].as_u64(), Some(0), "{stats}");
        assert_eq!(stats["weight_bytes"].as_u64(), Some(model.weight_bytes() as u64), "{stats}");
        assert!(stats["arena_bytes"].as_u64().is_some_and(|n| n > 0), "{stats}");
        // Every 4xx the routes and their layers answered: the bad bodies, the refusals
        // in JSON, and HEAD /stats (hyper's bare ones never reach them).
        let routed = refusals.iter().filter(|r| matches!(r.3, Answer::Json)).count();
        assert_eq!(stats["http"]["client_errors"].as_u64(), Some((bad.len() + routed + 1) as u64), "{stats}");
        assert_eq!(stats["http"]["server_errors"].as_u64(), Some(0), "{stats}");
        if mode == "batched" {
            assert!(stats["batches"].as_u64().is_some_and(|n| n > 0), "{stats}");
        }
    }
}

#[test]
fn serve_digits_serves_many_connections_at_once_with_each_requests_own_bits() {
    let dir = tempfile::tempdir().unwrap();
    let (path, model) = saved_model(dir.path());
    for mode in ["direct", "batched"] {
        let server = Server::start(&path, &["--workers", "2", "--mode", mode, "--max-batch", "8"]);
        std::thread::scope(|s| {
            for t in 0..6u64 {
                let (server, model) = (&server, &model);
                s.spawn(move || {
                    let mut rng = Rng::new(100 + t);
                    let mut connection = server.connect();
                    for _ in 0..12 {
                        let rows = 1 + rng.below(10);
                        let x = Array2::from_shape_fn((rows, 64), |_| rng.uniform(0.0, 16.0));
                        let (status, json) = connection.request("POST", "/predict", Some(&rows_json(&x)));
                        assert_eq!(status, 200, "{mode}: {json}");
                        assert_answer(&json, &model.output(x.view()).unwrap());
                    }
                });
            }
        });
        let (_, stats) = server.send("GET", "/stats", None);
        assert_eq!(stats["http"]["predictions"].as_u64(), Some(72), "{stats}");
    }
}

#[test]
fn serve_digits_refuses_a_missing_or_broken_model_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let broken = dir.path().join("broken.safetensors");
    std::fs::write(&broken, b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}").unwrap();
    for model in [dir.path().join("missing.safetensors"), broken] {
        let output = run(&["--model", model.to_str().unwrap(), "--port", "0"]);
        assert_eq!(output.status.code(), Some(1));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.starts_with("serve_digits: error: model file "), "{stderr}");
        assert!(output.stdout.is_empty(), "it never listened: {}", String::from_utf8_lossy(&output.stdout));
    }
}

#[test]
fn idle_and_silent_clients_hold_nothing_and_are_closed_at_their_deadlines() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = saved_model(dir.path());
    // One runtime thread: connections are tasks, not threads.
    let args = ["--http-threads", "1", "--header-timeout-ms", "1000", "--idle-timeout-ms", "300"];
    let server = Server::start(&path, &args);
    // Two keep-alive clients fall silent after an answer.
    let mut a = server.connect();
    let mut b = server.connect();
    assert_eq!(a.request("GET", "/stats", None).0, 200);
    assert_eq!(b.request("GET", "/stats", None).0, 200);
    let idle_since = Instant::now();
    // A third is answered at once, not after they time out.
    assert_eq!(server.send("GET", "/stats", None).0, 200);
    assert!(idle_since.elapsed() < Duration::from_millis(800), "{:?}", idle_since.elapsed());
    // The idle ones are closed once their next head is 1 s late.
    for connection in [&mut a, &mut b] {
        assert!(connection.closed_within(Duration::from_secs(5)), "an idle connection stayed open");
    }
    let closed = idle_since.elapsed();
    assert!(closed >= Duration::from_millis(900) && closed < Duration::from_secs(4), "{closed:?}");

    // A client that falls silent within its body: 408 once it has said nothing for
    // 300 ms, and the connection ends.
    let mut c = server.connect();
    let sent = Instant::now();
    c.send_raw(b"POST /predict HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"inputs\": [[1, ");
    let (status, json) = c.response();
    let waited = sent.elapsed();
    assert_eq!(status, 408, "{json}");
    assert!(json["error"].as_str().is_some_and(|e| e.contains("stopped for 300 ms")), "{json}");
    assert!(waited >= Duration::from_millis(250) && waited < Duration::from_secs(3), "{waited:?}");
    assert!(c.closed_within(Duration::from_secs(5)));
    drop(server);

    // --max-connections 1: a second connection is accepted only once the first closes
    // (here at its header deadline).
    let server = Server::start(&path, &["--max-connections", "1", "--header-timeout-ms", "500"]);
    let mut first = server.connect();
    assert_eq!(first.request("GET", "/stats", None).0, 200);
    let start = Instant::now();
    assert_eq!(server.send("GET", "/stats", None).0, 200);
    let waited = start.elapsed();
    assert!(waited >= Duration::from_millis(400) && waited < Duration::from_secs(3), "{waited:?}");
    assert!(first.closed_within(Duration::from_secs(1)));
}

/// How a slow client's connection ended.
#[derive(Debug)]
struct Cut {
    /// When, and how long after the client connected.
    at: Instant,
    after: Duration,
    /// Bytes of its head it had sent.
    sent: usize,
    how: String,
}

/// A slow-loris client: sends `head` one byte every `every`, until the server closes
/// the connection (or answers), or for at most `most`.
fn dribble(port: u16, head: &[u8], every: Duration, most: Duration) -> Cut {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("the server accepts");
    let start = Instant::now();
    stream.set_read_timeout(Some(every)).unwrap();
    stream.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    let cut = |sent: usize, how: String| Cut { at: Instant::now(), after: start.elapsed(), sent, how };
    for (sent, byte) in head.iter().enumerate() {
        if start.elapsed() > most {
            return cut(sent, "never cut off".into());
        }
        if let Err(e) = stream.write_all(std::slice::from_ref(byte)) {
            return cut(sent, format!("write failed: {e}"));
        }
        // The pause between bytes is a read, which ends as soon as the server closes.
        let mut answer = [0u8; 256];
        match stream.read(&mut answer) {
            Ok(0) => return cut(sent + 1, "closed".into()),
            Ok(n) => return cut(sent + 1, format!("answered {:?}", String::from_utf8_lossy(&answer[..n]))),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => return cut(sent + 1, format!("read failed: {e}")),
        }
    }
    cut(head.len(), "sent its whole head".into())
}

#[test]
fn good_requests_are_answered_within_a_second_while_8_slow_loris_clients_dribble_until_their_header_deadline() {
    const SLOW_CLIENTS: usize = 8;
    const HEADER_TIMEOUT: Duration = Duration::from_millis(4000);
    const EVERY: Duration = Duration::from_millis(300);
    let dir = tempfile::tempdir().unwrap();
    let (path, model) = saved_model(dir.path());
    let header_ms = HEADER_TIMEOUT.as_millis().to_string();
    let server = Server::start(&path, &["--http-threads", "2", "--workers", "2", "--header-timeout-ms", &header_ms]);
    let mut rng = Rng::new(5);
    let x = Array2::from_shape_fn((1, 64), |_| rng.uniform(0.0, 16.0));
    let (body, expected) = (rows_json(&x), model.output(x.view()).unwrap());
    let (status, json) = server.send("POST", "/predict", Some(&body));
    assert_eq!(status, 200, "{json}");
    // A whole head takes 30 s at this pace: only the deadline can end it sooner.
    let head = format!(
        "POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    assert!(EVERY * head.len() as u32 > HEADER_TIMEOUT * 5);

    let (latencies, last_answer, cuts) = std::thread::scope(|s| {
        let slow: Vec<_> = (0..SLOW_CLIENTS)
            .map(|_| s.spawn(|| dribble(server.port, head.as_bytes(), EVERY, HEADER_TIMEOUT * 3)))
            .collect();
        // Every slow client has connected and sent a byte or two.
        std::thread::sleep(EVERY * 2);
        let dribbling_since = Instant::now();
        let mut latencies = Vec::new();
        // Good requests, each on a new connection, until 1 s before the slow clients'
        // deadline (at most 100).
        while dribbling_since.elapsed() + EVERY * 2 + Duration::from_secs(1) < HEADER_TIMEOUT && latencies.len() < 100 {
            let start = Instant::now();
            let (status, json) = server.send("POST", "/predict", Some(&body));
            latencies.push(start.elapsed());
            assert_eq!(status, 200, "{json}");
            assert_answer(&json, &expected);
            std::thread::sleep(Duration::from_millis(50));
        }
        let last_answer = Instant::now();
        let cuts: Vec<Cut> = slow.into_iter().map(|t| t.join().unwrap()).collect();
        (latencies, last_answer, cuts)
    });

    let mut sorted = latencies.clone();
    sorted.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let (median, max) = (ms(sorted[sorted.len() / 2]), ms(sorted[sorted.len() - 1]));
    let cut_after: Vec<u128> = cuts.iter().map(|c| c.after.as_millis()).collect();
    println!(
        "slow loris: {SLOW_CLIENTS} clients sending a head byte every {} ms; {} good requests: median {median:.2} ms, \
         max {max:.2} ms; the slow clients cut off after {cut_after:?} ms (header timeout {header_ms} ms)",
        EVERY.as_millis(),
        latencies.len(),
    );
    assert!(latencies.len() >= 10, "{} good requests", latencies.len());
    assert!(sorted[sorted.len() - 1] < Duration::from_secs(1), "a good request waited {max:.0} ms: {latencies:?}");
    for cut in &cuts {
        // Cut off by the server at its header deadline, which runs from when the server
        // took the connection, just after the client's connect returned (50 ms of slack
        // for a client thread descheduled in between); and after the last good answer.
        assert!(cut.how == "closed" || cut.how.contains("failed"), "{cut:?}");
        assert!(cut.after >= HEADER_TIMEOUT - Duration::from_millis(50), "{cut:?}");
        assert!(cut.after < HEADER_TIMEOUT + Duration::from_millis(1500), "{cut:?}");
        assert!(cut.at > last_answer, "{cut:?}");
        assert!(cut.sent > 2 && cut.sent < head.len(), "{cut:?}");
    }
    // The server goes on serving.
    assert_eq!(server.send("POST", "/predict", Some(&body)).0, 200);
}

fn run(args: &[&str]) -> Output {
    Command::new(serve_digits()).args(args).output().expect("serve_digits runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn help_prints_usage_within_80_columns_and_runs_nothing() {
    let output = run(&["--help"]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    assert!(stdout.contains("Usage: serve_digits"), "{stdout}");
    assert!(stdout.contains("-h, --help"), "{stdout}");
    let wide: Vec<&str> = stdout.lines().filter(|l| l.chars().count() > 80).collect();
    assert!(wide.is_empty(), "help wider than 80 columns: {wide:#?}");
    assert!(!stdout.contains("listening on"), "{stdout}");
    assert!(output.stderr.is_empty(), "{}", text(&output.stderr));
    for flag in [
        "--model",
        "--port",
        "--workers",
        "--mode",
        "--max-batch",
        "--max-wait-us",
        "--max-body",
        "--header-timeout-ms",
        "--idle-timeout-ms",
        "--max-connections",
        "--http-threads",
    ] {
        assert!(stdout.contains(flag), "{flag}: {stdout}");
    }
}

#[test]
fn unknown_flags_and_bad_values_are_one_line_usage_errors_naming_the_flag_and_the_valid_range() {
    for (args, flag, range) in [
        (&["--model", "m", "--no-such-flag"][..], "'--no-such-flag'", ""),
        (&["--model", "m", "--mode", "fast"], "'--mode <MODE>'", "direct"),
        (&["--model", "m", "--workers", "0"], "'--workers <K>'", "1..=1024"),
        (&["--model", "m", "--port", "70000"], "'--port <N>'", "65535"),
        (&["--model", "m", "--max-body", "10"], "'--max-body <BYTES>'", "1024.."),
        (&["--model", "m", "--header-timeout-ms", "5"], "'--header-timeout-ms <MS>'", "10..=600000"),
        (&["--model", "m", "--idle-timeout-ms", "0"], "'--idle-timeout-ms <MS>'", "10..=600000"),
        (&["--model", "m", "--body-timeout-ms", "5"], "'--body-timeout-ms <MS>'", "10..=600000"),
        (&["--model", "m", "--max-connections", "0"], "'--max-connections <N>'", "1..=65536"),
        (&["--model", "m", "--http-threads", "0"], "'--http-threads <N>'", "1..=1024"),
        (&["--model", "m", "--stream-batch", "0"], "'--stream-batch <S>'", "1..=256"),
        (&["--model", "m", "--stream-batch", "257"], "'--stream-batch <S>'", "1..=256"),
        (&["--port", "0"], "--model <PATH>", "required"),
    ] {
        let output = run(args);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: a usage error, got {:?}: {stderr}", output.status);
        assert!(output.stdout.is_empty(), "{args:?}: nothing may run: {}", text(&output.stdout));
        assert_eq!(stderr.lines().count(), 1, "{args:?}: one line: {stderr}");
        assert!(stderr.starts_with("serve_digits: error: "), "{args:?}: {stderr}");
        assert!(stderr.contains(flag) && stderr.contains(range), "{args:?}: '{flag}', '{range}' in {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

/// A small character-level GPT saved with its characters, and the model itself.
fn saved_gpt(dir: &Path) -> (PathBuf, Model) {
    let symbols = "\n !',.:;?abcdefghijklmnopqrstuvwxyzAEHIMNORST";
    let vocab = symbols.chars().count();
    let mut b = NetworkConfig::builder(vocab).embedding(16).position_embedding(16);
    b = b.residual(|b| b.layer_norm().attention(2)).residual(|b| b.layer_norm().dense(32).gelu().dense(16));
    let net = Network::new(b.layer_norm().dense(vocab).seed(9).build().unwrap()).unwrap();
    let model = net.freeze().unwrap().with_symbols(symbols).unwrap();
    let path = dir.join("gpt.safetensors");
    model.save(&path).unwrap();
    let loaded = Model::load(&path).unwrap();
    (path, loaded)
}

#[test]
fn generate_answers_the_models_own_text_and_bad_requests_with_4xx_and_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let (path, model) = saved_gpt(dir.path());
    assert!(model.symbols().is_some(), "the file keeps the characters");
    let server = Server::start(&path, &["--workers", "1", "--max-tokens", "50"]);
    let body = br#"{"prompt": "ROMEO:", "tokens": 40, "temperature": 0.8, "top_k": 5, "seed": 3}"#;
    let (status, json) = server.send("POST", "/generate", Some(body));
    assert_eq!(status, 200, "{json}");
    let prompt = model.encode("ROMEO:").unwrap();
    let sampling = carve::nn::serve::Sampling::random(0.8, 5, 3).unwrap();
    let expected = model.decode(&model.generate(&prompt, 40, sampling).unwrap()).unwrap();
    assert_eq!(json["text"], expected.as_str(), "the model's own continuation");
    assert_eq!(json["tokens"], 40);
    // Greedy by temperature 0, and the same answer twice.
    let greedy = br#"{"prompt": "a", "tokens": 30, "temperature": 0}"#;
    let first = server.send("POST", "/generate", Some(greedy));
    assert_eq!(first, server.send("POST", "/generate", Some(greedy)));
    let bad: [(&[u8], u16, &str); 13] = [
        (br#"{"prompt": "", "tokens": 5}"#, 400, "empty"),
        // A misspelt option is named, not served with the option's default.
        (br#"{"prompt": "a", "tokens": 5, "temprature": 0}"#, 400, "unknown field \"temprature\""),
        (br#"{"prompt": "a", "tokens": 5, "top-k": 3}"#, 400, "unknown field \"top-k\""),
        (br#"["a", 5]"#, 400, "not a JSON object"),
        (br#""a""#, 400, "not a JSON object"),
        (br#"{"prompt": "ROMEO\u20ac", "tokens": 5}"#, 400, "'\u{20ac}'"),
        (br#"{"prompt": "a", "tokens": 0}"#, 400, "from 1 to 50"),
        (br#"{"prompt": "a", "tokens": 51}"#, 400, "from 1 to 50"),
        (br#"{"prompt": "a", "tokens": -3}"#, 400, "from 1 to 50"),
        (br#"{"tokens": 5}"#, 400, "\"prompt\""),
        (br#"{"prompt": 7, "tokens": 5}"#, 400, "must be a string"),
        (br#"{"prompt": "a", "tokens": 5, "temperature": -1}"#, 400, "temperature"),
        (br#"{"prompt": "a""#, 400, "malformed JSON"),
    ];
    for (body, want, says) in bad {
        let (status, json) = server.send("POST", "/generate", Some(body));
        let message = json["error"].as_str().unwrap_or_default();
        assert_eq!(status, want, "{}: {json}", String::from_utf8_lossy(body));
        assert!(message.contains(says), "{}: {message}", String::from_utf8_lossy(body));
    }
    let (status, json) = server.send("GET", "/generate", None);
    assert_eq!(status, 405, "{json}");
    // Served after clients that went away before their answers.
    for _ in 0..3 {
        let mut gone = server.connect();
        let body = br#"{"prompt": "a", "tokens": 50}"#;
        let head = format!("POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n", body.len());
        gone.send_raw(head.as_bytes());
        gone.send_raw(body);
        drop(gone);
    }
    let (status, json) = server.send("POST", "/generate", Some(greedy));
    assert_eq!((status, &json), (200, &first.1), "served after clients left");
    let (_, stats) = server.send("GET", "/stats", None);
    assert_eq!(stats["workers"], 1, "{stats}");
    assert!(stats["http"]["client_errors"].as_u64().unwrap() >= 10, "{stats}");
}

/// A GPT whose logits overflow (are infinite) at position 5 and are finite before:
/// every weight finite, as a file must hold them.
fn saved_gpt_overflowing_at_position_5(dir: &Path) -> PathBuf {
    let symbols = "abcdefgh";
    let config = || NetworkConfig::builder(8).embedding(8).position_embedding(8).dense(8).seed(4).build().unwrap();
    let mut params = Network::new(config()).unwrap().params().to_vec();
    let region = |params: &[f32], layer: usize| {
        let values = Model::from_config(&config(), params.to_vec()).unwrap().layer_params(layer).to_vec();
        let at = params.windows(values.len()).position(|w| w == values.as_slice()).unwrap();
        at..at + values.len()
    };
    // Large output weights, and a position 5 whose features they carry past f32.
    let (table, dense) = (region(&params, 1), region(&params, 2));
    params[dense].iter_mut().for_each(|w| *w = 1e30);
    params[table.start + 5 * 8..table.start + 6 * 8].fill(1e10);
    let model = Model::from_config(&config(), params).unwrap().with_symbols(symbols).unwrap();
    let path = dir.join("overflowing.safetensors");
    model.save(&path).unwrap();
    path
}

#[test]
fn logits_that_are_not_finite_are_the_servers_failure_and_it_goes_on() {
    // The prompt is the client's; what the model makes of it is not: a stream whose
    // logits are not finite is a 500 naming them, with a stream per arena and through
    // the stream batch, and the next request is served.
    let dir = tempfile::tempdir().unwrap();
    let path = saved_gpt_overflowing_at_position_5(dir.path());
    for args in [&["--workers", "1"][..], &["--workers", "1", "--stream-batch", "2"]] {
        let server = Server::start(&path, args);
        // Position 5 reached by the prompt, and by the third token of a shorter one.
        for body in [&br#"{"prompt": "abcdef", "tokens": 2}"#[..], br#"{"prompt": "abc", "tokens": 5}"#] {
            let (status, json) = server.send("POST", "/generate", Some(body));
            assert_eq!(status, 500, "{args:?} {}: {json}", String::from_utf8_lossy(body));
            assert!(json["error"].as_str().unwrap().contains("logits hold inf"), "{args:?}: {json}");
        }
        let (status, json) = server.send("POST", "/generate", Some(br#"{"prompt": "ab", "tokens": 3}"#));
        assert_eq!(status, 200, "{args:?}: {json}");
        assert_eq!(json["text"].as_str().unwrap().chars().count(), 3, "{json}");
    }
}

#[test]
fn generate_on_a_model_that_reads_no_text_is_a_422() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = saved_model(dir.path());
    let server = Server::start(&path, &[]);
    let (status, json) = server.send("POST", "/generate", Some(br#"{"prompt": "a", "tokens": 5}"#));
    assert_eq!(status, 422, "{json}");
    assert!(json["error"].as_str().unwrap().contains("does not generate text"), "{json}");
    // A body that is wrong is the client's error first, whatever the model.
    let (status, json) = server.send("POST", "/generate", Some(br#"{"prompt": "a", "tokens": 0}"#));
    assert_eq!(status, 400, "{json}");
    // And the model's own route still answers.
    let (status, _) = server.send("POST", "/predict", Some(&rows_json(&Array2::zeros((1, 64)))));
    assert_eq!(status, 200);
}

/// A client that goes away mid-stream on a server of `args` (one arena, or one slot):
/// its stream ends at the next token, and the next request is served at once.
fn a_client_that_goes_away_frees_what_its_stream_held(args: &[&str], held: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = saved_gpt(dir.path());
    // A generation that alone would hold it for many seconds (over 20).
    let server = Server::start(&path, &[args, &["--max-tokens", "100000"]].concat());
    let mut gone = server.connect();
    let body = br#"{"prompt": "a", "tokens": 100000}"#;
    let head = format!("POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n", body.len());
    gone.send_raw(head.as_bytes());
    gone.send_raw(body);
    // Its stream has started before the client goes.
    std::thread::sleep(Duration::from_millis(300));
    drop(gone);
    let start = Instant::now();
    let (status, json) = server.send("POST", "/generate", Some(br#"{"prompt": "a", "tokens": 5}"#));
    assert_eq!(status, 200, "{json}");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "the next stream waited {:?} for the {held} of a client that had gone",
        start.elapsed()
    );
}

#[test]
fn a_client_that_goes_away_mid_stream_ends_its_stream_and_frees_the_arena() {
    a_client_that_goes_away_frees_what_its_stream_held(&["--workers", "1"], "arena");
}

#[test]
fn a_stream_batch_steps_concurrent_generations_together_each_with_the_models_own_text() {
    let dir = tempfile::tempdir().unwrap();
    let (path, model) = saved_gpt(dir.path());
    let server = Server::start(&path, &["--workers", "1", "--stream-batch", "4", "--max-tokens", "60"]);
    // Six clients at once for four slots (two wait for a slot, and start beside the
    // streams under way when slots come free), greedy and sampled,
    // prompts of several lengths (one past the context of 16), and slides.
    let requests: [(&str, usize, f32, usize, u64); 6] = [
        ("ROMEO:", 40, 0.0, 0, 0),
        ("a", 60, 0.8, 5, 3),
        ("to be, or not to be", 25, 0.0, 0, 0),
        ("HERMIONE: ", 50, 1.0, 0, 11),
        ("o", 7, 0.5, 3, 2),
        ("ROSE, I am here", 33, 0.0, 0, 0),
    ];
    let answers: Vec<(u16, Value)> = std::thread::scope(|scope| {
        let clients: Vec<_> = requests
            .iter()
            .map(|&(prompt, tokens, temperature, top_k, seed)| {
                let server = &server;
                scope.spawn(move || {
                    let body = serde_json::json!({
                        "prompt": prompt, "tokens": tokens, "temperature": temperature, "top_k": top_k, "seed": seed
                    });
                    server.send("POST", "/generate", Some(body.to_string().as_bytes()))
                })
            })
            .collect();
        clients.into_iter().map(|c| c.join().unwrap()).collect()
    });
    for ((prompt, tokens, temperature, top_k, seed), (status, json)) in requests.iter().zip(&answers) {
        assert_eq!(*status, 200, "{prompt:?}: {json}");
        let sampling = carve::nn::serve::Sampling::random(*temperature, *top_k, *seed).unwrap();
        let alone = model.generate(&model.encode(prompt).unwrap(), *tokens, sampling).unwrap();
        assert_eq!(json["text"], model.decode(&alone).unwrap().as_str(), "{prompt:?}: its own text alone");
    }
    // A prompt the model cannot read is the client's error, through the batch too.
    let (status, json) =
        server.send("POST", "/generate", Some("{\"prompt\": \"x\u{20ac}\", \"tokens\": 5}".as_bytes()));
    assert_eq!(status, 400, "{json}");
    assert!(json["error"].as_str().unwrap().contains('\u{20ac}'), "{json}");
    let (_, stats) = server.send("GET", "/stats", None);
    let batch = &stats["stream_batch"];
    assert_eq!(
        (&batch["slots"], &batch["arenas"], &batch["pool"]["workers"]),
        (&4.into(), &1.into(), &1.into()),
        "{stats}"
    );
    // The slots' caches are counted where they lie: in the stream batch's pool.
    let cache = model.kv_cache_bytes().unwrap() as u64;
    assert!(batch["pool"]["stream_bytes"].as_u64().unwrap() >= 4 * cache, "{stats}");
    assert!(batch["pool"]["arena_bytes"].as_u64().unwrap() > 0, "{stats}");
}

#[test]
fn a_client_that_goes_away_frees_its_slot_of_the_stream_batch() {
    a_client_that_goes_away_frees_what_its_stream_held(&["--workers", "1", "--stream-batch", "1"], "slot");
}
