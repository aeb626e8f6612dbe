#!/usr/bin/env python3
"""Two `tessera serve` replicas behind the SGLang model gateway on loopback.

The gateway (`pip install sglang-router`, a Rust router for
OpenAI-compatible workers) keeps an approximate prefix tree of the text it
routed to each worker; its `cache_aware` policy sends a request to the
worker whose tree matches most of it, so a conversation's next turn lands
where its history is cached.

  router.py test  TESSERA_BINARY MODEL   3 users × 3 turns, in turn,
      through a cache_aware gateway: every request answers, and every turn
      after the first finds its history cached on the replica it reaches
      (with round_robin, an odd number of users sends every other turn to
      the replica without it). `just test` runs this.
  router.py bench TESSERA_BINARY MODEL   `tessera bench --scenario server`
      (8 users × 8 turns) against one replica alone, then against two
      replicas behind the gateway with `cache_aware` and with
      `round_robin`: the cached share of each turn's history, TTFT and
      throughput; target/bench/router.json and the README's
      `bench-router` section. Then the same with pools a third of the
      working set (eviction): one replica with and without its disk tier,
      and two replicas behind `cache_aware`, `round_robin` and the
      KV-event gateway (scripts/kv_router.py), and with a disk tier each
      behind `cache_aware` and the KV-event gateway (which reads the tiers'
      blocks from their events, medium "DISK"); and two replicas whose pools
      differ (a third of the working set and all of it) behind
      `cache_aware` and the KV-event gateway. A fifth argument keeps only
      the setups whose names contain one of its `;`-separated parts
      (`"small pools, kv_events;small pools, cache_aware"`);
      ROUTER_RUNS runs of the workload per setup (default 1).

Each replica gets half the cores (RAYON_NUM_THREADS), one replica alone
all of them. Clients name the model (`smollm2`, the replicas' alias): the
gateway's own /v1/models lists it as `unknown`, since it learns model
names from SGLang-specific endpoints. Installs sglang-router with pip when it is missing.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from loopback import free_port, wait_ready  # noqa: E402
# cache_aware sends a request where most of its prefix went until the
# workers' loads differ by more than 64 requests (its default): with a
# system prompt that every user shares, all of a small workload would go
# to one replica. A difference of 2 rebalances new conversations early.
ROUTER_ARGS = {"cache_aware": ["--balance-abs-threshold", "2"]}
# Runs of the workload per setup (ROUTER_RUNS), the median reported.
RUNS = os.environ.get("ROUTER_RUNS", "1")


class Cluster:
    """`replicas` tessera servers, and a gateway in front when `policy`
    (`kv_events`: scripts/kv_router.py on the replicas' KV events, else an
    sglang-router policy); `extra`: more `tessera serve` arguments, where
    `{port}` becomes the replica's port; a list of them gives each replica
    its own."""

    def __init__(self, binary, model, replicas, policy, threads, extra=()):
        self.procs = []
        self.logs = []
        ports = [free_port() for _ in range(replicas)]
        env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
        events = {}
        per = extra if extra and isinstance(extra[0], list) else [extra] * replicas
        for p, ex in zip(ports, per):
            log = open(ROOT / "target" / f"replica-{p}.log", "w")
            self.logs.append(log)
            args = [a.replace("{port}", str(p)) for a in ex]
            if policy == "kv_events":
                events[p] = (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
                args += ["--kv-events-endpoint", events[p][0],
                         "--kv-events-replay-endpoint", events[p][1]]
            proc = subprocess.Popen([binary, "serve", "--model", model, "--port", str(p),
                                     "--alias", "smollm2", *args], stdout=log, stderr=log, env=env)
            self.procs.append(proc)
            wait_ready(f"http://127.0.0.1:{p}/health", proc, f"replica on {p}")
        self.replica_urls = [f"http://127.0.0.1:{p}" for p in ports]
        self.url = self.replica_urls[0]
        if policy == "kv_events":
            port = free_port()
            log = open(ROOT / "target" / "router-kv_events.log", "w")
            self.logs.append(log)
            proc = subprocess.Popen(
                [sys.executable, str(ROOT / "scripts" / "kv_router.py"), str(port),
                 *[f"http://127.0.0.1:{p}={events[p][0]}={events[p][1]}" for p in ports]],
                stdout=log, stderr=log)
            self.procs.append(proc)
            self.url = f"http://127.0.0.1:{port}"
            wait_ready(f"{self.url}/v1/models", proc, "the KV-event gateway")
        elif policy:
            port = free_port()
            log = open(ROOT / "target" / f"router-{policy}.log", "w")
            self.logs.append(log)
            proc = subprocess.Popen(
                [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                 "--port", str(port), "--policy", policy, *ROUTER_ARGS.get(policy, []),
                 "--worker-urls", *[f"http://127.0.0.1:{p}" for p in ports]],
                stdout=log, stderr=log)
            self.procs.append(proc)
            self.url = f"http://127.0.0.1:{port}"
            wait_ready(f"{self.url}/v1/models", proc, "the gateway")

    def shares(self):
        """Each replica's requests, prompt tokens, share of them found cached,
        and preemptions, from its /metrics."""
        out = []
        for u in self.replica_urls:
            with urllib.request.urlopen(f"{u}/metrics", timeout=30) as r:
                text = r.read().decode()
            m = {k: float(v) for k, v in re.findall(r"^tessera:(\w+) ([0-9.e+-]+)$", text, re.M)}
            out.append({"requests": int(m.get("e2e_request_latency_seconds_count", 0)),
                        "prompt_tokens": int(m.get("prompt_tokens_total", 0)),
                        "cached": m.get("prefix_cache_hits_total", 0)
                        / max(1.0, m.get("prefix_cache_queries_total", 0)),
                        "preemptions": int(m.get("num_preemptions_total", 0))})
        return out

    def close(self):
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in self.logs:
            log.close()


def chat(url, messages, max_tokens=8):
    body = json.dumps({"model": "smollm2", "messages": messages, "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def test(binary, model):
    threads = max(1, (os.cpu_count() or 2) // 2)
    c = Cluster(binary, model, 2, "cache_aware", threads)
    try:
        users = [f"User {u} asks about topic {u * 37}: tell me something about the number {u * 37}."
                 for u in range(3)]
        convs = [[{"role": "user", "content": q}] for q in users]
        for turn in range(3):
            for u, conv in enumerate(convs):
                r = chat(c.url, conv)
                text = r["choices"][0]["message"]["content"]
                cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
                prompt = r["usage"]["prompt_tokens"]
                if turn > 0 and cached < prompt // 2:
                    sys.exit(f"user {u} turn {turn + 1}: only {cached} of {prompt} prompt tokens "
                             "cached: the gateway sent it away from its history")
                conv += [{"role": "assistant", "content": text},
                         {"role": "user", "content": f"And then? ({turn})"}]
        print("router: 2 replicas behind sglang-router (cache_aware): 9 requests answered, "
              "every follow-up turn found its history cached")
    finally:
        c.close()


def bench(binary, model):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from readme_tables import BENCH, splice  # noqa: E402

    cores = os.cpu_count() or 2
    half = max(1, cores // 2)
    # With eviction: each replica's pool about a third of the workload's
    # working set (8 conversations of up to ~1,000 tokens sharing a
    # 200-token system prompt: ~6,700 tokens; this model's f16 K/V is
    # 22.5 KiB a token, so 48 MiB holds ~2,180).
    small = ["--kv-memory", "48MiB"]
    tier = small + ["--cache-dir", str(ROOT / "target" / "router-tier-{port}")]
    # One replica's pool a third of the working set and the other's the
    # whole of it (a replica with less memory, or one shared with other
    # work): what the small one evicts, a text-based router keeps sending
    # back to it.
    unequal = [small, ["--kv-memory", "144MiB"]]
    setups = [("one replica", 1, None, cores, ()),
              ("2 replicas, cache_aware", 2, "cache_aware", half, ()),
              ("2 replicas, round_robin", 2, "round_robin", half, ()),
              ("2 replicas, kv_events", 2, "kv_events", half, ()),
              ("one replica, small pool", 1, None, cores, small),
              ("one replica, small pool + disk tier", 1, None, cores, tier),
              ("2 replicas, small pools, cache_aware", 2, "cache_aware", half, small),
              ("2 replicas, small pools, round_robin", 2, "round_robin", half, small),
              ("2 replicas, small pools, kv_events", 2, "kv_events", half, small),
              ("2 replicas, small pools + disk tiers, cache_aware", 2, "cache_aware", half, tier),
              ("2 replicas, small pools + disk tiers, kv_events", 2, "kv_events", half, tier),
              ("2 replicas, unequal pools, cache_aware", 2, "cache_aware", half, unequal),
              ("2 replicas, unequal pools, kv_events", 2, "kv_events", half, unequal)]
    if len(sys.argv) > 4:
        setups = [s for s in setups if any(k.strip() in s[0] for k in sys.argv[4].split(";"))]
    results = {}
    for name, n, policy, threads, extra in setups:
        for d in (ROOT / "target").glob("router-tier-*"):
            shutil.rmtree(d)
        c = Cluster(binary, model, n, policy, threads, extra)
        try:
            out = subprocess.run(
                [binary, "bench", "--model", model, "--scenario", "server", "--runs", RUNS,
                 "--url", c.url, "--served-model", "smollm2", "--json"],
                capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f"{name}: {out.stderr[-2000:]}")
            out = out.stdout
            results[name] = json.loads(out.strip().splitlines()[-1])["target"]
            r = results[name]
            r["replicas"] = c.shares()
            print(f"{name:>24}: history cached {r['history_cached'] * 100:5.1f}%, TTFT p50 "
                  f"{r['ttft_p50_ms']:7.1f} ms, {r['throughput_tok_s']:6.1f} tok/s; per replica "
                  + ", ".join(f"{x['requests']} requests {x['cached'] * 100:.0f}% cached "
                              f"{x['preemptions']} preempted" for x in r["replicas"]), flush=True)
        finally:
            c.close()
    BENCH.mkdir(parents=True, exist_ok=True)
    (BENCH / "router.json").write_text(json.dumps(results, indent=1) + "\n")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    lines = [
        f"8 users × 8 turns at once over HTTP (`tessera bench --scenario server --url`), at "
        f"`{commit}` on {time.strftime('%Y-%m-%d', time.gmtime())}, sglang-router "
        f"{sglang_version()}; each of two replicas has half of the {cores} cores. "
        "`kv_events`: scripts/kv_router.py routing on the replicas' KV events. "
        "Small pools: `--kv-memory 48MiB`, about a third of the workload's working set "
        "(~6,700 tokens), so histories are evicted; the disk tier is `--cache-dir`. Unequal "
        "pools: one replica's 48 MiB, the other's 144 MiB. "
        f"Medians of {RUNS} runs of the workload per setup (each run its own texts); "
        "requests per replica count every run's, and the replicas' own preemptions.",
        "",
        "| setup | history cached, turns 2–8 | prompt tokens cached | TTFT p50 | TTFT p99 | throughput | requests per replica (preempted) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        split = " / ".join(f"{x['requests']} ({x['preemptions']})" for x in r["replicas"])
        lines.append(f"| {name} | {r['history_cached'] * 100:.1f}% | {r['hit_ratio'] * 100:.1f}% | "
                     f"{r['ttft_p50_ms']:,.0f} ms | {r['ttft_p99_ms']:,.0f} ms | "
                     f"{r['throughput_tok_s']:,.1f} tok/s | {split} |")
    splice("router", "router.py", lines)
    print("\n".join(lines))


def sglang_version():
    try:
        from importlib.metadata import version
        return version("sglang-router")
    except Exception:
        return "?"


def main():
    if len(sys.argv) not in (4, 5) or sys.argv[1] not in ("test", "bench"):
        sys.exit(__doc__)
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "sglang-router"],
                       check=True)
    (ROOT / "target").mkdir(exist_ok=True)
    {"test": test, "bench": bench}[sys.argv[1]](sys.argv[2], sys.argv[3])


if __name__ == "__main__":
    main()
