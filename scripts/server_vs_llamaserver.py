#!/usr/bin/env python3
"""Tessera's server beside llama.cpp's `llama-server`, same workload, same run.

`just bench-server` builds both (llama-server from source with
scripts/build_llama_tools.sh, Tessera with the native CPU flags, as `just
bench-llamacpp` does), then runs this. The workload is `tessera bench
--scenario server`: USERS simulated users, each an 8-turn chat (a shared
~200-token system prompt, ~60-token turns, 32-token greedy replies), all
at once, streamed over HTTP on loopback. llama-server gets the same
threads, one slot per user (`--parallel`), 2,048 tokens of context per
slot and its prompt cache on (its default); Tessera gets its defaults
(256 MiB of f16 K/V). Runs alternate between the two; run r of both uses
the conversations of seed r. Writes target/bench/server.json and the
README's `bench-server` section.
"""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loopback import free_port, wait_ready  # noqa: E402
from readme_tables import BENCH, ROOT, splice  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TESSERA = ROOT / "target" / "native" / "release" / "tessera"
LLAMA_SERVER = ROOT / "target" / "llama-server" / "build" / "bin" / "llama-server"
RUNS = int(os.environ.get("SERVER_RUNS", "3"))
USERS = int(os.environ.get("SERVER_USERS", "8"))
TURNS = 8
THREADS = int(os.environ.get("TESSERA_BENCH_THREADS", os.cpu_count() or 1))


def bench(seed, url=None):
    cmd = [str(TESSERA), "bench", "--model", str(MODEL), "--scenario", "server",
           "--users", str(USERS), "--turns", str(TURNS), "--runs", "1", "--seed", str(seed),
           "--no-baseline", "--json"]
    if url:
        cmd += ["--url", url]
    env = dict(os.environ, RAYON_NUM_THREADS=str(THREADS))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    v = json.loads(out.strip().splitlines()[-1])
    return v["target" if url else "tessera"]["runs"][0]


def start_llama_server(port, log):
    proc = subprocess.Popen(
        [str(LLAMA_SERVER), "-m", str(MODEL), "--host", "127.0.0.1", "--port", str(port),
         "-t", str(THREADS), "-tb", str(THREADS), "--parallel", str(USERS),
         "-c", str(USERS * 2048)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    wait_ready(f"http://127.0.0.1:{port}/health", proc, "llama-server", timeout=300,
               hint=lambda: f": see {log.name}")
    return proc


def main():
    for p, how in ((TESSERA, "just bench-server"), (LLAMA_SERVER, "scripts/build_llama_tools.sh"),
                   (MODEL, "just model")):
        if not p.exists():
            sys.exit(f"{p} is missing: run `{how}`")
    BENCH.mkdir(parents=True, exist_ok=True)
    port = free_port()
    runs = {"tessera": [], "llama-server": []}
    with open(BENCH / "llama-server.log", "w") as log:
        server = start_llama_server(port, log)
        try:
            for r in range(RUNS):
                runs["llama-server"].append(bench(r, f"http://127.0.0.1:{port}"))
                runs["tessera"].append(bench(r))
                for name in runs:
                    x = runs[name][-1]
                    print(f"run {r + 1}/{RUNS} {name:>12}: TTFT p50 {x['ttft_p50_ms']:7.1f} ms, "
                          f"p99 {x['ttft_p99_ms']:7.1f} ms, {x['throughput_tok_s']:6.1f} tok/s, "
                          f"history cached {x['history_cached'] * 100:5.1f}%", flush=True)
        finally:
            server.terminate()
            server.wait(timeout=60)
    keys = ("ttft_p50_ms", "ttft_p99_ms", "throughput_tok_s", "history_cached", "hit_ratio")
    med = {n: {k: statistics.median(x[k] for x in v) for k in keys} for n, v in runs.items()}
    t, l = med["tessera"], med["llama-server"]
    result = {
        "users": USERS, "turns": TURNS, "threads": THREADS, "runs": RUNS,
        "median": med, "per_run": runs,
        "ttft_p50_ratio": t["ttft_p50_ms"] / l["ttft_p50_ms"],
        "ttft_p99_ratio": t["ttft_p99_ms"] / l["ttft_p99_ms"],
        "throughput_ratio": t["throughput_tok_s"] / l["throughput_tok_s"],
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, cwd=ROOT).stdout.strip(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "llama_server": "llama.cpp vendored by llama-cpp-python 0.3.36 (sdist), GGML_NATIVE",
    }
    (BENCH / "server.json").write_text(json.dumps(result, indent=1) + "\n")

    def spread(name, k, fmt):
        xs = [x[k] for x in runs[name]]
        return f"{fmt(statistics.median(xs))} ({fmt(min(xs))}–{fmt(max(xs))})"

    ms = lambda x: f"{x:,.0f} ms"  # noqa: E731
    tok = lambda x: f"{x:,.1f} tok/s"  # noqa: E731
    pct = lambda x: f"{x * 100:.1f}%"  # noqa: E731
    lines = [
        f"{USERS} users × {TURNS} turns at once over HTTP (streamed chat, 32-token greedy replies), "
        f"{THREADS} threads each, median of {RUNS} alternating runs (min–max), at `{result['commit']}` "
        f"on {result['date']}. `llama-server`: llama.cpp vendored by llama-cpp-python 0.3.36, "
        f"`--parallel {USERS}`, 2,048 tokens per slot, prompt cache on.",
        "",
        "| | Tessera | llama-server | Tessera / llama-server |",
        "|---|---:|---:|---:|",
        f"| TTFT p50 | {spread('tessera', 'ttft_p50_ms', ms)} | {spread('llama-server', 'ttft_p50_ms', ms)} "
        f"| {result['ttft_p50_ratio']:.2f}× (target ≤ 0.5×) |",
        f"| TTFT p99 | {spread('tessera', 'ttft_p99_ms', ms)} | {spread('llama-server', 'ttft_p99_ms', ms)} "
        f"| {result['ttft_p99_ratio']:.2f}× |",
        f"| throughput | {spread('tessera', 'throughput_tok_s', tok)} "
        f"| {spread('llama-server', 'throughput_tok_s', tok)} | {result['throughput_ratio']:.2f}× (target ≥ 1×) |",
        f"| history cached, turns 2–{TURNS} | {pct(t['history_cached'])} | {pct(l['history_cached'])} "
        f"| (target ≥ 90%) |",
        f"| prompt tokens cached, all turns | {pct(t['hit_ratio'])} | {pct(l['hit_ratio'])} | |",
    ]
    splice("server", "server_vs_llamaserver.py", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
