#!/usr/bin/env python3
"""Speculative decoding beside llama.cpp's: the prompts of `tessera bench
--scenario spec` (data/spec-prompts.json) sent to `tessera serve` with and
without `--spec-ngram` and to llama.cpp's `llama-server` without and with
each of its n-gram draft types (`--spec-type ngram-*`, each with its own
defaults; Tessera's drafts of up to --draft-max tokens): every server up at
once on its own port, the prompts sent to one after another (so a slow
moment of this shared host hits every setting alike), each prompt alone,
greedy, 256 tokens at most. Decode tok/s from each response's own timings
(`predicted_n / predicted_ms`, which both servers report), summed over a
set's prompts, median over --runs; and whether each engine gives the same
tokens with speculation as without (its own greedy text).

    python3 scripts/spec_vs_llamacpp.py [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--runs 3]

With `--model-draft DRAFT`, the settings compared are a draft model's
instead: `tessera serve --model-draft DRAFT` (its defaults) against
`llama-server -md DRAFT --spec-type draft-simple`, with llama.cpp's own
defaults and with Tessera's draft length and p_min.

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


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def wait_up(proc, port):
    for _ in range(600):
        if proc.poll() is not None:
            sys.exit(f"server exited: {proc.args}")
        try:
            # llama-server answers 503 here until its model is loaded.
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError:
            time.sleep(0.2)
        except Exception:
            time.sleep(0.2)
    sys.exit("server did not come up")


def serve(cmd, port, env=None):
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wait_up(proc, port)
    return proc


def ask(port, prompt):
    """(generated tokens, decode ms, text) of one greedy chat request."""
    out = post(port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 256, "seed": 0})
    t = out["timings"]
    return t["predicted_n"], t["predicted_ms"], out["choices"][0]["message"]["content"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--draft-max", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model-draft", help="compare draft-model speculation instead of n-gram")
    ap.add_argument("--draft-p-min", type=float, default=0.0, help="with --model-draft: Tessera's default")
    args = ap.parse_args()
    sets = json.loads((ROOT / "data/spec-prompts.json").read_text())
    env = dict(os.environ, LD_LIBRARY_PATH=str(LLAMA))
    tessera = [str(TESSERA), "serve", "--model", args.model, "--threads", str(args.threads)]
    base = [str(LLAMA / "llama-server"), "-m", args.model, "-t", str(args.threads), "-c", "4096", "-np", "1"]
    if args.model_draft:
        d = args.model_draft
        md = ["-md", d, "--spec-type", "draft-simple"]
        configs = [("tessera", "off", tessera),
                   ("tessera", "--model-draft", tessera + ["--model-draft", d, "--draft-max", str(args.draft_max),
                                                           "--draft-p-min", str(args.draft_p_min)]),
                   ("llama.cpp", "off", base),
                   ("llama.cpp", "-md (its defaults)", base + md),
                   ("llama.cpp", f"-md, n-max {args.draft_max}, p-min {args.draft_p_min}",
                    base + md + ["--spec-draft-n-max", str(args.draft_max), "--draft-p-min", str(args.draft_p_min)])]
    else:
        configs = [("tessera", "off", tessera),
                   ("tessera", "--spec-ngram", tessera + ["--spec-ngram", "--draft-max", str(args.draft_max)])]
        configs.append(("llama.cpp", "off", base))
        # Each n-gram type with its own defaults (this tree has no one draft
        # length for all of them: --draft-max was removed).
        for t in NGRAM_TYPES:
            configs.append(("llama.cpp", f"--spec-type {t}", base + ["--spec-type", t]))
    procs = []
    try:
        for i, (_, _, cmd) in enumerate(configs):
            procs.append(serve(cmd + ["--port", str(PORT + i)], PORT + i, env))
        # per config and set: tokens and ms per run, texts of the first run
        got = {(i, k): ([], []) for i in range(len(configs)) for k in sets}
        for r in range(args.runs):
            for k, prompts in sets.items():
                tot = {i: [0, 0.0] for i in range(len(configs))}
                for p in prompts:
                    for i in range(len(configs)):
                        n, ms, text = ask(PORT + i, p)
                        tot[i][0] += n
                        tot[i][1] += ms
                        if r == 0:
                            got[(i, k)][1].append(text)
                for i in range(len(configs)):
                    got[(i, k)][0].append(tot[i][0] / (tot[i][1] / 1e3))
    finally:
        for p in procs:
            p.terminate()
            p.wait()
    results = []
    for i, (engine, setting, _) in enumerate(configs):
        row = {"engine": engine, "setting": setting}
        for k in sets:
            speeds, texts = got[(i, k)]
            row[k] = {"tok_s": statistics.median(speeds), "runs": speeds, "texts": texts}
        results.append(row)
    out = ROOT / ("target/bench/spec-draft-vs-llamacpp.json" if args.model_draft
                  else "target/bench/spec-vs-llamacpp.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": Path(args.model).name, "runs": args.runs,
                               "model_draft": args.model_draft and Path(args.model_draft).name, "threads": args.threads,
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
