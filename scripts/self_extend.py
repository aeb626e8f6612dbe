#!/usr/bin/env python3
"""SelfExtend past the trained context, beside the model without it, same run.

`just bench-self-extend` runs `tessera perplexity` on the default model
(trained context 8,192) over the first 16,384 tokens of
data/pride-and-prejudice.txt as one chunk (its second half scored: the
positions past 8,192), without SelfExtend and with it (`--grp-attn-n N
--grp-attn-w W` for each setting below), the model at its own 8,192-token
context on the same text for reference, and llama.cpp's `llama-perplexity`
at 16,384 (llama-perplexity has no SelfExtend: the model without it).
Writes target/bench/self-extend.json and the README's `bench-self-extend`
section.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from perplexity_vs_llamacpp import LLAMA, SMOL, TESSERA, TEXT, THREADS, llama, tessera  # noqa: E402
from readme_tables import BENCH, ROOT, commit, cpu, splice  # noqa: E402

LONG = 16384
SETTINGS = [(4, 2048), (8, 1024)]


def main():
    for p, how in ((TESSERA, "just bench-self-extend"), (LLAMA, "scripts/build_llama_tools.sh")):
        if not p.exists():
            sys.exit(f"{p} is missing: run `{how}`")
    out = BENCH / "self-extend.json"
    if "--readme" in sys.argv:
        r = json.loads(out.read_text())
    else:
        r = {"_commit": commit(), "_date": time.strftime("%Y-%m-%d", time.gmtime()), "_cpu": cpu(),
             "runs": []}

        def run(name, ctx, chunks, extra, who="tessera"):
            if who == "tessera":
                x = tessera(SMOL, ctx, chunks, extra)
            else:
                x = llama(SMOL, ctx, chunks, extra)
            r["runs"].append({"name": name, "ctx": ctx, "chunks": chunks, "engine": who, **x})
            print(f"{name} ({who}, ctx {ctx}): {x.get('ppl', x.get('error'))}", flush=True)

        run("trained context", 8192, 2, [])
        run("no SelfExtend", LONG, 1, [])
        for n, w in SETTINGS:
            run(f"SelfExtend n={n} w={w}", LONG, 1, ["--grp-attn-n", str(n), "--grp-attn-w", str(w)])
        run("no SelfExtend", LONG, 1, [], "llamacpp")
        BENCH.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(r, indent=1) + "\n")
    base = next(x for x in r["runs"] if x["name"] == "no SelfExtend" and x["engine"] == "tessera")
    lines = [
        f"Measured {r['_date']} on {r['_cpu']}, {THREADS} threads, commit `{r['_commit']}`, "
        f"SmolLM2-135M-Instruct Q4_1 (trained context 8,192), `{TEXT.relative_to(ROOT)}`: "
        f"the first {LONG:,} tokens as one chunk, its second half scored (every scored token is "
        "past position 8,192); the trained-context row scores the same text as two 8,192-token "
        "chunks. llama.cpp's `llama-perplexity` has no SelfExtend; its row is the model without it.",
        "",
        "| run | context | Tessera PPL | vs no SelfExtend | llama.cpp PPL |",
        "|---|---:|---:|---:|---:|",
    ]
    lc = next((x for x in r["runs"] if x["engine"] == "llamacpp"), None)
    for x in r["runs"]:
        if x["engine"] != "tessera":
            continue
        ppl = f"{x['ppl']:,.4f} ± {x['ppl_err']:,.4f}" if "ppl" in x else f"failed: {x['error']}"
        rel = f"{x['ppl'] / base['ppl']:.3f}×" if "ppl" in x and x["ctx"] == LONG else ""
        other = ""
        if lc and x is base and "ppl" in lc:
            other = f"{lc['ppl']:,.4f} ± {lc['ppl_err']:,.4f}"
        name = f"**{x['name']}**" if x["name"].startswith("SelfExtend") else x["name"]
        lines.append(f"| {name} | {x['ctx']:,} | {ppl} | {rel} | {other} |")
    splice("self-extend", "self_extend.py", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
