#!/usr/bin/env python3
"""Clients that hang up, measured over HTTP on the real model.

Starts `tessera serve` on loopback, then, for each run: the time to the
first token of a short streamed request on the idle server; 24 clients
that each send a ~2,000-token prompt (not streamed) and close their socket
after 0.3 s; and right after them the same short request again. A server
that kept computing the abandoned prompts makes the short request wait for
them; one that cancels them serves it once the step in flight ends. Then
the same request once the server holds no request. Writes
target/bench/hangups.json (medians over the runs).

Usage: hangups.py BINARY MODEL [RUNS]
"""

import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = 24
PROMPT_WORDS = 520
HANG_UP_AFTER = 0.3


def start(binary, model):
    p = subprocess.Popen(
        [binary, "serve", "--model", model, "--port", "0", "--max-queue", "64"],
        stderr=subprocess.PIPE,
        text=True,
    )
    addr = None
    for line in p.stderr:
        if "http://" in line:
            addr = line.split("http://", 1)[1].split()[0]
        if "ready" in line:
            break
    return p, addr


def first_token(addr):
    """Seconds to the first streamed token of a short request."""
    body = json.dumps(
        {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "stream": True}
    ).encode()
    req = urllib.request.Request(
        f"http://{addr}/v1/completions", body, {"Content-Type": "application/json"}
    )
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: ") and b'"text":"' in line and b'"text":""' not in line:
                return time.perf_counter() - t
    return time.perf_counter() - t


def held(addr):
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=60).read().decode()
    n = 0.0
    for line in text.splitlines():
        if line.startswith(("tessera:num_requests_running", "tessera:num_requests_waiting")):
            n += float(line.rsplit(" ", 1)[1])
    return n


def prompt(i, run):
    return " ".join(f"w{(j * 7 + i * 13 + run) % 997}" for j in range(PROMPT_WORDS))


def tokens(addr, text):
    body = json.dumps({"content": text}).encode()
    req = urllib.request.Request(
        f"http://{addr}/tokenize", body, {"Content-Type": "application/json"}
    )
    return len(json.load(urllib.request.urlopen(req, timeout=60))["tokens"])


def hang_up(addr, run):
    socks = []
    for i in range(CLIENTS):
        words = prompt(i, run)
        body = json.dumps({"prompt": words, "max_tokens": 64}).encode()
        host, port = addr.rsplit(":", 1)
        s = socket.create_connection((host, int(port)))
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        socks.append(s)
    time.sleep(HANG_UP_AFTER)
    for s in socks:
        s.close()


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    binary, model = sys.argv[1], sys.argv[2]
    runs = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    p, addr = start(binary, model)
    try:
        n_tokens = tokens(addr, prompt(0, 0))
        idle, after, drained, settled = [], [], [], []
        for run in range(runs):
            idle.append(first_token(addr))
            hang_up(addr, run)
            t = time.perf_counter()
            after.append(first_token(addr))
            while held(addr) > 0 and time.perf_counter() - t < 600:
                time.sleep(0.01)
            drained.append(time.perf_counter() - t)
            # Once nothing is held: the server is as if idle again.
            settled.append(first_token(addr))
            time.sleep(0.5)
    finally:
        p.terminate()
        p.wait(timeout=120)
    out = {
        "clients": CLIENTS,
        "prompt_tokens": n_tokens,
        "hang_up_after_s": HANG_UP_AFTER,
        "runs": runs,
        "idle_ttft_s": statistics.median(idle),
        "after_hangups_ttft_s": statistics.median(after),
        "ratio": statistics.median(after) / statistics.median(idle),
        "drained_s": statistics.median(drained),
        "settled_ttft_s": statistics.median(settled),
    }
    (ROOT / "target" / "bench").mkdir(parents=True, exist_ok=True)
    (ROOT / "target" / "bench" / "hangups.json").write_text(json.dumps(out) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
