#!/usr/bin/env python3
"""The KV cache types beside f16, same run: memory, speed and perplexity.

`just bench-kv-types` runs `tessera bench --scenario kv-types --json`
(cached tokens per MiB of a 64 MiB pool, decode after 16 and 2,048 tokens,
for f16, q8_0 and q4_0), then the perplexity of the default model with each
cache type at 2,048-token chunks (the first 16 of data/pride-and-prejudice.txt),
Tessera's `tessera perplexity --cache-dtype T` beside llama.cpp's
`llama-perplexity -ctk T -ctv T -fa on` (a quantized V cache needs flash
attention in llama.cpp). Writes target/bench/kv-types.json and the README's
`bench-kv-types` section.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from perplexity_vs_llamacpp import LLAMA, SMOL, TESSERA, TEXT, THREADS, llama, tessera  # noqa: E402
from readme_tables import BENCH, ROOT, commit, cpu, splice  # noqa: E402

CTX, CHUNKS = 2048, 16
TYPES = ["f16", "q8_0", "q4_0"]


def main():
    for p, how in ((TESSERA, "just bench-kv-types"), (LLAMA, "scripts/build_llama_tools.sh")):
        if not p.exists():
            sys.exit(f"{p} is missing: run `{how}`")
    out = BENCH / "kv-types.json"
    if "--readme" in sys.argv:
        r = json.loads(out.read_text())
    else:
        bench = subprocess.run([str(TESSERA), "bench", "--model", str(SMOL), "--scenario", "kv-types",
                                "--runs", "3", "--json"], capture_output=True, text=True, check=True)
        r = {"bench": json.loads(bench.stdout.strip().splitlines()[-1]), "ppl": {},
             "_commit": commit(), "_date": time.strftime("%Y-%m-%d", time.gmtime()), "_cpu": cpu()}
        for t in TYPES:
            a = tessera(SMOL, CTX, CHUNKS, ["--cache-dtype", t])
            b = llama(SMOL, CTX, CHUNKS, ["-ctk", t, "-ctv", t, "-fa", "on"])
            r["ppl"][t] = {"tessera": a, "llamacpp": b}
            print(f"{t}: tessera {a.get('ppl', a.get('error'))}; llama.cpp {b['ppl']}", flush=True)
        BENCH.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(r, indent=1) + "\n")
    b = r["bench"]
    lines = [
        f"Measured {r['_date']} on {r['_cpu']}, {THREADS} threads, commit `{r['_commit']}`, "
        f"SmolLM2-135M-Instruct Q4_1, native release build. Capacity: distinct 256-token prompts "
        f"fed to a {b['budget_mib']} MiB pool until it had evicted, then the tokens its prefix tree "
        f"held; decode: greedy tok/s after 16 and after {b['context']:,} tokens, the types "
        f"alternating run by run, median of {b['runs']}.",
        "",
        "| cache | bytes/token | tokens held in 64 MiB | tokens per MiB | vs f16 | decode | vs f16 | "
        f"decode after {b['context']:,} | vs f16 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in b["types"]:
        lines.append(
            f"| {t['type']} | {t['bytes_per_token']:,} | {t['cached_tokens']:,} | "
            f"{t['tokens_per_mib']:.0f} | **{t['tokens_per_mib_vs_f16']:.2f}×** | "
            f"{t['decode']:.1f} tok/s | {t['decode_vs_f16']:.2f}× | {t['decode_long']:.1f} tok/s | "
            f"{t['decode_long_vs_f16']:.2f}× |")
    ppl = r["ppl"]
    f16 = ppl["f16"]
    lines += [
        "",
        f"Perplexity with each cache type, `{TEXT.relative_to(ROOT)}`, {CTX:,}-token chunks (the first "
        f"{CHUNKS}) scored on their second half; llama.cpp's `llama-perplexity` with the same cache "
        "type for K and V (`-ctk T -ctv T -fa on`), same run:",
        "",
        "| cache | Tessera PPL | vs f16 | llama.cpp PPL | vs its f16 |",
        "|---|---:|---:|---:|---:|",
    ]
    for t in TYPES:
        a, l = ppl[t]["tessera"], ppl[t]["llamacpp"]
        if "ppl" not in a:
            lines.append(f"| {t} | failed: {a['error']} | | {l['ppl']:.4f} ± {l['ppl_err']:.4f} | |")
            continue
        lines.append(
            f"| {t} | {a['ppl']:.4f} ± {a['ppl_err']:.4f} | "
            f"{100 * (a['ppl'] / f16['tessera']['ppl'] - 1):+.2f}% | "
            f"{l['ppl']:.4f} ± {l['ppl_err']:.4f} | {100 * (l['ppl'] / f16['llamacpp']['ppl'] - 1):+.2f}% |")
    splice("kv-types", "kv_types.py", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
