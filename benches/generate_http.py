"""POST /generate under concurrent clients (benches/README.md, "Generation").

Starts `serve_digits` on a GPT saved by `train_gpt --save`, once per server
configuration given, and runs C clients at once, each sending requests of T tokens
(greedy, its own prompt) one after another on a keep-alive connection for D seconds:
generated tokens per second over all clients, and each request's latency (p50, p99).
Prints one JSON object.

    cargo run --release --example train_gpt -- --iters 1 --save /tmp/gpt.safetensors
    cargo build --release -p carve-serve --example serve_digits
    python3 benches/generate_http.py --model /tmp/gpt.safetensors --clients 16 \\
        --config "--workers 2" --config "--workers 1 --stream-batch 8"

Standard library only; the server listens on 127.0.0.1 (a free port) and is killed at
the end of its run.
"""
import argparse
import http.client
import json
import os
import select
import shlex
import subprocess
import threading
import time

PROMPTS = ["ROMEO:", "JULIET:", "To be, or not", "HAMLET:", "First Citizen:", "O", "KING:", "Now is the"]


def serve(binary, model, extra):
    args = [binary, "--model", model, "--port", "0", "--max-tokens", "100000"] + shlex.split(extra)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    # At most a minute for the server to say where it listens.
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else ""
    prefix = "listening on 127.0.0.1:"
    if not line.startswith(prefix):
        proc.kill()
        raise SystemExit(f"serve_digits {extra!r} did not start: {line!r}")
    return proc, int(line[len(prefix):])


def client(port, prompt, tokens, until, latencies, counts, index, errors):
    try:
        requests(port, prompt, tokens, until, latencies, counts, index)
    except BaseException as e:  # a thread's exception is not the run's: kept for it
        errors.append(f"client {index}: {e!r}")


def requests(port, prompt, tokens, until, latencies, counts, index):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps({"prompt": prompt, "tokens": tokens, "temperature": 0})
    done = 0
    # `until` None: one request (a warm-up).
    while until is None or time.monotonic() < until:
        start = time.monotonic()
        conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        answer = json.loads(response.read())
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {answer}")
        latencies.append(time.monotonic() - start)
        done += answer["tokens"]
        if until is None:
            break
    counts[index] = done
    conn.close()


def run(binary, model, extra, clients, tokens, seconds):
    proc, port = serve(binary, model, extra)
    try:
        # Every client's first request (the arenas' and plans' first use) before the clock.
        warm, errors = [], []
        threads = [threading.Thread(target=client, args=(port, PROMPTS[i % len(PROMPTS)], tokens, None, warm, [0] * clients, i, errors))
                   for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        latencies, counts = [], [0] * clients
        start = time.monotonic()
        until = start + seconds
        threads = [threading.Thread(target=client, args=(port, PROMPTS[i % len(PROMPTS)], tokens, until, latencies, counts, i, errors))
                   for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - start
    finally:
        proc.kill()
        proc.wait()
    if errors or len(latencies) < clients:
        raise SystemExit(f"serve_digits {extra!r}: {len(latencies)} requests answered; {errors[:3]}")
    latencies.sort()
    at = lambda q: latencies[min(len(latencies) - 1, round((len(latencies) - 1) * q))] * 1e3
    return {"server_args": extra, "clients": clients, "tokens_per_request": tokens, "requests": len(latencies),
            "tokens_per_sec": sum(counts) / elapsed, "request_ms_p50": at(0.5), "request_ms_p99": at(0.99)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--binary", default=os.path.join("target", "release", "examples", "serve_digits"))
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--config", action="append", required=True, help="serve_digits flags of one run")
    a = p.parse_args()
    runs = [run(a.binary, a.model, extra, a.clients, a.tokens, a.seconds) for extra in a.config]
    print(json.dumps({"runs": runs}))


if __name__ == "__main__":
    main()
