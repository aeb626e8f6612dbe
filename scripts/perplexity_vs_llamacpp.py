#!/usr/bin/env python3
"""Perplexity of Tessera beside llama.cpp's own `llama-perplexity`, same text, same run.

`just bench-perplexity` builds llama-perplexity from source
(scripts/build_llama_tools.sh) and Tessera with the native CPU flags, then
runs this: both tools on data/pride-and-prejudice.txt with 512-token chunks
(each scored on its second half), the same threads, for each model that is
present (the default model; Gemma 3 270M after `just model gemma3`, also
with 2,048-token chunks, the first 16, where its 512-token sliding window
is in play). A model Tessera cannot run yet gets llama.cpp's numbers
alone, and says so.
Speed is tokens evaluated per second, model loading excluded. Writes
target/bench/perplexity.json and the README's `bench-perplexity` section.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_tables import BENCH, ROOT, splice  # noqa: E402

TEXT = ROOT / "data" / "pride-and-prejudice.txt"
TESSERA = ROOT / "target" / "native" / "release" / "tessera"
LLAMA = ROOT / "target" / "llama-server" / "build" / "bin" / "llama-perplexity"
SMOL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA = ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"
# (row name, model, chunk length, chunks: None for the whole text)
RUNS = [("SmolLM2-135M-Instruct Q4_1", SMOL, 512, None),
        ("Gemma 3 270M Q4_K_M", GEMMA, 512, None),
        ("Gemma 3 270M Q4_K_M", GEMMA, 2048, 16)]
THREADS = int(os.environ.get("TESSERA_BENCH_THREADS", os.cpu_count() or 1))


def stamp(log, message):
    """The time stamp of the log line `message` starts (llama.cpp's
    minutes.seconds.milliseconds.microseconds; a line may follow unfinished
    output on the same line, so the stamp is found just before the text)."""
    m = re.search(r"(\d+)\.(\d\d)\.(\d\d\d)\.(\d\d\d) I " + re.escape(message), log)
    if not m:
        sys.exit(f"no `{message}` in llama-perplexity's log:\n{log[-3000:]}")
    mi, s, ms, us = map(int, m.groups())
    return mi * 60 + s + ms / 1e3 + us / 1e6


def llama(model, ctx, chunks, extra=()):
    more = (["--chunks", str(chunks)] if chunks else []) + list(extra)
    out = subprocess.run([str(LLAMA), "-m", str(model), "-f", str(TEXT), "-c", str(ctx),
                          "-t", str(THREADS), "-tb", str(THREADS)] + more,
                         capture_output=True, text=True)
    log = out.stdout + out.stderr
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    if out.returncode != 0 or not final or not chunks:
        sys.exit(f"llama-perplexity failed on {model}:\n{log[-3000:]}")
    start = stamp(log, "perplexity: calculating perplexity over")
    end = stamp(log, "Final estimate")
    n = int(chunks.group(1))
    return {"ppl": float(final.group(1)), "ppl_err": float(final.group(2)), "chunks": n,
            "seconds": end - start, "tok_s": n * ctx / (end - start)}


def tessera(model, ctx, chunks, extra=()):
    env = dict(os.environ, RAYON_NUM_THREADS=str(THREADS))
    more = (["--chunks", str(chunks)] if chunks else []) + list(extra)
    out = subprocess.run([str(TESSERA), "perplexity", "--model", str(model), "--file", str(TEXT),
                          "--ctx", str(ctx), "--json"] + more,
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    for p, how in ((TESSERA, "just bench-perplexity"), (LLAMA, "scripts/build_llama_tools.sh")):
        if not p.exists():
            sys.exit(f"{p} is missing: run `{how}`")
    results = {}
    if "--readme" in sys.argv:
        # Only the README's table, from the last run's results.
        results = json.loads((BENCH / "perplexity.json").read_text())
    for name, path, ctx, chunks in RUNS if not results else []:
        if not path.exists():
            print(f"{name}: {path.name} is missing, skipped", flush=True)
            continue
        t = tessera(path, ctx, chunks)
        l = llama(path, ctx, chunks)
        results[f"{name} @{ctx}"] = {"model": name, "ctx": ctx, "tessera": t, "llamacpp": l}
        shown = f"{t['ppl']:.4f}, {t['tok_s']:.0f} tok/s" if "ppl" in t else t["error"]
        print(f"{name} @{ctx}: tessera {shown}; llama.cpp {l['ppl']:.4f}, {l['tok_s']:.0f} tok/s",
              flush=True)
    BENCH.mkdir(parents=True, exist_ok=True)
    commit = results.get("_commit") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    results["_commit"] = commit
    (BENCH / "perplexity.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [
        f"`{TEXT.relative_to(ROOT)}` (300 KB), chunks of `ctx` tokens scored on their second half "
        "(Gemma 3's sliding window is 512 tokens: at 2,048 its sliding layers see only part of "
        f"each chunk), {THREADS} threads, at `{commit}` on {time.strftime('%Y-%m-%d', time.gmtime())}. "
        "llama.cpp: `llama-perplexity` of the llama.cpp tree vendored by llama-cpp-python 0.3.36, "
        "GGML_NATIVE. Lower perplexity is better; ± is llama.cpp's standard-error estimate, "
        "computed the same way by both.",
        "",
        "| model | ctx | chunks | Tessera PPL | llama.cpp PPL | Tessera tok/s | llama.cpp tok/s | speed ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        if name.startswith("_"):
            continue
        t, l = r["tessera"], r["llamacpp"]
        name, ctx = r["model"], r["ctx"]
        if "ppl" in t:
            lines.append(f"| {name} | {ctx:,} | {t['chunks']} | {t['ppl']:.4f} ± {t['ppl_err']:.4f} | "
                         f"{l['ppl']:.4f} ± {l['ppl_err']:.4f} | {t['tok_s']:,.0f} | {l['tok_s']:,.0f} | "
                         f"{t['tok_s'] / l['tok_s']:.2f}× |")
        else:
            why = t["error"].split(": ", 2)[-1]
            lines.append(f"| {name} | {ctx:,} | {l['chunks']} | not yet: {why} | "
                         f"{l['ppl']:.4f} ± {l['ppl_err']:.4f} | — | {l['tok_s']:,.0f} | — |")
    splice("perplexity", "perplexity_vs_llamacpp.py", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
