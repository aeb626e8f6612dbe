#!/usr/bin/env python3
"""Speculative decoding beside llama.cpp's: the prompts of `tessera bench
--scenario spec` (data/spec-prompts.json) sent to `tessera serve` with and
without `--spec-ngram` and to llama.cpp's `llama-server` without and with
each of its n-gram draft types (`--spec-type ngram-*`, each with its own
defaults; Tessera's drafts of up to --draft-max tokens), one server at a time, each prompt alone, greedy, 256
tokens at most. Decode tok/s from each response's own timings
(`predicted_n / predicted_ms`, which both servers report), summed over a
set's prompts, median over --runs; and whether each engine gives the same
tokens with speculation as without (its own greedy text).

    python3 scripts/spec_vs_llamacpp.py [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--runs 3]

Writes target/bench/spec-vs-llamacpp.json and prints a Markdown table.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "target/llama-server/build/bin"
TESSERA = ROOT / "target/release/tessera"
PORT = 8093
NGRAM_TYPES = ["ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache"]


def post(path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def wait_up(proc):
    for _ in range(600):
        if proc.poll() is not None:
            sys.exit(f"server exited: {proc.args}")
        try:
            # llama-server answers 503 here until its model is loaded.
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError:
            time.sleep(0.2)
        except Exception:
            time.sleep(0.2)
    sys.exit("server did not come up")


def serve(cmd, env=None):
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wait_up(proc)
    return proc


def measure(prompts, runs):
    """Per run, the set's decode tok/s; and each prompt's text (first run)."""
    speeds, texts = [], []
    for r in range(runs):
        n, ms = 0, 0.0
        for p in prompts:
            out = post("/v1/chat/completions", {
                "messages": [{"role": "user", "content": p}], "temperature": 0, "max_tokens": 256,
                "seed": 0})
            t = out["timings"]
            n, ms = n + t["predicted_n"], ms + t["predicted_ms"]
            if r == 0:
                texts.append(out["choices"][0]["message"]["content"])
        speeds.append(n / (ms / 1e3))
    return speeds, texts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--draft-max", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sets = json.loads((ROOT / "data/spec-prompts.json").read_text())
    env = dict(os.environ, LD_LIBRARY_PATH=str(LLAMA))
    configs = [("tessera", "off", [str(TESSERA), "serve", "--model", args.model, "--port", str(PORT),
                                   "--threads", str(args.threads)]),
               ("tessera", "--spec-ngram", [str(TESSERA), "serve", "--model", args.model, "--port", str(PORT),
                                            "--threads", str(args.threads), "--spec-ngram",
                                            "--draft-max", str(args.draft_max)])]
    base = [str(LLAMA / "llama-server"), "-m", args.model, "--port", str(PORT), "-t", str(args.threads),
            "-c", "4096", "-np", "1"]
    configs.append(("llama.cpp", "off", base))
    # Each n-gram type with its own defaults (this tree has no one draft
    # length for all of them: --draft-max was removed).
    for t in NGRAM_TYPES:
        configs.append(("llama.cpp", f"--spec-type {t}", base + ["--spec-type", t]))
    results = []
    for engine, setting, cmd in configs:
        proc = serve(cmd, env)
        try:
            row = {"engine": engine, "setting": setting}
            for kind, prompts in sets.items():
                speeds, texts = measure(prompts, args.runs)
                row[kind] = {"tok_s": statistics.median(speeds), "runs": speeds, "texts": texts}
            results.append(row)
            print(engine, setting, {k: round(row[k]["tok_s"], 1) for k in sets}, file=sys.stderr)
        finally:
            proc.terminate()
            proc.wait()
    out = ROOT / "target/bench/spec-vs-llamacpp.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": Path(args.model).name, "runs": args.runs, "threads": args.threads,
                               "draft_max": args.draft_max, "date": time.strftime("%Y-%m-%d"),
                               "results": results}, indent=1))
    off = {r["engine"]: r for r in results if r["setting"] == "off"}
    print("| engine | setting | grounded tok/s | vs its own off | plain tok/s | vs its own off | same text as off |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        o = off[r["engine"]]
        same = all(r[k]["texts"] == o[k]["texts"] for k in sets)
        print(f"| {r['engine']} | `{r['setting']}` | {r['grounded']['tok_s']:.0f} | "
              f"{r['grounded']['tok_s'] / o['grounded']['tok_s']:.2f}× | {r['plain']['tok_s']:.0f} | "
              f"{r['plain']['tok_s'] / o['plain']['tok_s']:.2f}× | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
