//! `serve_digits` as a client meets it: started on a free port of 127.0.0.1, it answers
//! good requests with the model's own bits (in both pool modes, from many connections
//! at once), every bad request with a 4xx and a JSON error, and goes on serving after
//! each. The client is a plain `TcpStream` with timeouts, so nothing here can hang.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use carve::nn::{Model, Network, NetworkConfig, Rng};
use ndarray::Array2;
use serde_json::Value;

/// A running `serve_digits`, killed when dropped (also when a test fails).
struct Server {
    child: Child,
    port: u16,
}

impl Server {
    fn start(model: &Path, args: &[&str]) -> Server {
        let mut child = Command::new(crate::example_binary("serve_digits"))
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
        let stream = self.reader.get_mut();
        // A server may answer (413) before the whole body is sent, and close: a failed
        // write is not the test's failure, the answer is what counts.
        let _ = stream.write_all(bytes);
        self.response()
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
        let json = serde_json::from_slice(&body).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&body)));
        (status, json)
    }
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
            ("an oversized body", oversized.into_bytes(), 413, "larger than the limit"),
        ];
        for (what, body, want, needle) in &bad {
            let (status, json) = server.send("POST", "/predict", Some(body));
            assert_eq!(status, *want, "{mode}, {what}: {json}");
            let message = json["error"].as_str().unwrap_or_else(|| panic!("{mode}, {what}: no error message: {json}"));
            assert!(message.contains(needle), "{mode}, {what}: '{message}' should say '{needle}'");
        }
        // Requests the HTTP layer refuses: a lying length, no length, chunked, a wrong
        // method or path, not HTTP.
        let mut refusals = vec![
            (
                "a lying Content-Length",
                b"POST /predict HTTP/1.1\r\nContent-Length: 1000000000000000\r\n\r\n{".to_vec(),
                413,
            ),
            ("no Content-Length", b"POST /predict HTTP/1.1\r\n\r\n".to_vec(), 411),
            (
                "a chunked body",
                b"POST /predict HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n".to_vec(),
                411,
            ),
            ("a bad Content-Length", b"POST /predict HTTP/1.1\r\nContent-Length: many\r\n\r\n".to_vec(), 400),
            (
                "two Content-Lengths that disagree",
                b"POST /predict HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n".to_vec(),
                400,
            ),
            (
                "a Content-Length of 30 digits",
                b"POST /predict HTTP/1.1\r\nContent-Length: 999999999999999999999999999999\r\n\r\n".to_vec(),
                413,
            ),
            ("GET /predict", b"GET /predict HTTP/1.1\r\n\r\n".to_vec(), 405),
            ("an unknown path", b"GET /nothing HTTP/1.1\r\n\r\n".to_vec(), 404),
            ("not HTTP", b"\x00\x01\x02 hello\r\n\r\n".to_vec(), 400),
        ];
        let huge_head = format!("GET /stats HTTP/1.1\r\nX-Filler: {}\r\n\r\n", "a".repeat(40_000)).into_bytes();
        refusals.push(("a head over 16 KiB", huge_head, 431));
        for (what, bytes, want) in refusals {
            let (status, json) = server.connect().raw(&bytes);
            assert_eq!(status, want, "{mode}, {what}: {json}");
            assert!(json["error"].is_string(), "{mode}, {what}: {json}");
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
        // The handler's 4xx: the bad bodies but the oversized one, GET /predict, the
        // unknown path, and HEAD /stats.
        assert_eq!(stats["http"]["client_errors"].as_u64(), Some(bad.len() as u64 - 1 + 3), "{stats}");
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
        let output = Command::new(crate::example_binary("serve_digits"))
            .args(["--model", model.to_str().unwrap(), "--port", "0"])
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(1));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.starts_with("serve_digits: error: model file "), "{stderr}");
        assert!(output.stdout.is_empty(), "it never listened: {}", String::from_utf8_lossy(&output.stdout));
    }
}

#[test]
fn idle_keep_alive_clients_cannot_keep_every_thread_from_a_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = saved_model(dir.path());
    let server = Server::start(&path, &["--http-threads", "2", "--idle-timeout-ms", "300"]);
    // Two clients take both threads and keep their connections open.
    let mut a = server.connect();
    let mut b = server.connect();
    assert_eq!(a.request("GET", "/stats", None).0, 200);
    assert_eq!(b.request("GET", "/stats", None).0, 200);
    // A third is answered once an idle one times out (300 ms), not after them.
    let start = std::time::Instant::now();
    assert_eq!(server.send("GET", "/stats", None).0, 200);
    assert!(start.elapsed() < Duration::from_secs(10), "{:?}", start.elapsed());
    // Clients that keep asking (with a long idle timeout this time): each answer
    // closes their connection while another waits, so the waiting one is served at
    // once rather than when they fall idle.
    drop(server);
    let server = Server::start(&path, &["--http-threads", "2", "--idle-timeout-ms", "30000"]);
    let mut c = server.connect();
    let mut d = server.connect();
    assert_eq!(c.request("GET", "/stats", None).0, 200);
    assert_eq!(d.request("GET", "/stats", None).0, 200);
    let start = std::time::Instant::now();
    std::thread::scope(|s| {
        let waiting = s.spawn(|| server.send("GET", "/stats", None).0);
        std::thread::sleep(Duration::from_millis(100));
        // Their next answers say close: the connection ends after them.
        for connection in [&mut c, &mut d] {
            let (status, _) = connection.request("GET", "/stats", None);
            assert_eq!(status, 200);
            let mut line = String::new();
            let read = connection.reader.read_line(&mut line);
            assert!(matches!(read, Ok(0) | Err(_)), "the server closed the connection: {read:?} {line:?}");
        }
        assert_eq!(waiting.join().unwrap(), 200);
        // Closed after the answer, not after 30 s of idling.
        assert!(start.elapsed() < Duration::from_secs(15), "{:?}", start.elapsed());
    });
}
