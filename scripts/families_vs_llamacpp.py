#!/usr/bin/env python3
"""Each architecture's arithmetic against llama.cpp's, on the same files.

`just bench-families` generates GGUFs of each family's exact tensor layout
with random weights (scripts/synth_model.py: Qwen3 0.6B; Granite, SmolLM3,
Phi-3 and OLMo 2 at their widths; SmolLM2-135M's Llama layout as the control)
in F16, Q8_0 and Q4_K_M, then for each file and for the real models that
are present runs llama.cpp's own `llama-perplexity --kl-divergence-base`
(the scored distributions of 8 chunks of 256 tokens of
data/pride-and-prejudice.txt, whole vocabulary) and `tessera perplexity
--kl-divergence` on llama.cpp's file: the same tokens through both
forwards, KL(llama.cpp ‖ Tessera) per position and how often the two put
the same token first.

What sets the floor: llama.cpp rounds the activations of its quantized
products to 8 bits (Q8_0/Q8_K) and of its f16 products to f16; Tessera
keeps them exact (f32, or two int8 levels within 1e-5). The F16 rows
differ by llama.cpp's f16 rounding alone; the quantized rows by its 8-bit
activations, and the Llama control row shows how much that is for a
family both engines have long run.

Phi-3.5's LongRoPE is checked on a Phi-3 file with its factors, at a
context past its original one (the long factors) and at the original one
(the short factors): both engines choose by their context size.

    python3 scripts/families_vs_llamacpp.py [--only LABEL,...]

(`--only`: those rows again, the others kept from the last run, each row
marked with its own run's stamp.) Writes target/bench/families.json and the
README's `bench-families` section.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_tables import BENCH, ROOT, measured, splice  # noqa: E402

TEXT = ROOT / "data" / "pride-and-prejudice.txt"
TESSERA = ROOT / "target" / "release" / "tessera"
BIN = ROOT / "target" / "llama-server" / "build" / "bin"
CTX, CHUNKS = 256, 8
THREADS = int(os.environ.get("TESSERA_BENCH_THREADS", os.cpu_count() or 1))
# (row label, file stem, family, what the file is)
SYNTH = [
    ("Llama (control)", "synth-135m", "llama", "SmolLM2-135M's layout: 576 wide, 30 layers, 9/3 heads"),
    ("Qwen3", "synth-qwen3-0.6b", "qwen3", "Qwen3 0.6B's layout: 1,024 wide, 28 layers, 16/8 heads of 128, q/k norms"),
    ("Granite", "synth-granite-s", "granite",
     "Granite 3 2B's width (2,048, 32/8 heads, FFN 8,192) at 8 layers, its four scales"),
    ("SmolLM3", "synth-smollm3-s", "smollm3",
     "SmolLM3 3B's width (2,048, 16/4 heads of 128, FFN 11,008) at 8 layers, 2 of them NoPE"),
    ("Phi-3", "synth-phi3-s", "phi3",
     "Phi-3 mini's width (3,072, 32/32 heads of 96, FFN 8,192) at 8 layers, fused q/k/v and gate/up"),
    ("OLMo 2", "synth-olmo2-s", "olmo2",
     "OLMo 2 1B's width (2,048, 16/16 heads of 128, FFN 8,192) at 8 layers: post-norms only, whole q/k norms"),
]
FORMATS = ["F16", "Q8_0", "Q4_K_M"]
# Phi-3.5's LongRoPE on the Phi-3 layout (an original context of 256, a
# 128k one): both engines choose the short factors for a context of at most
# the original and the long ones past it (llama.cpp by its context per
# sequence, which it pads to a multiple of 256), so the same file is checked
# at the original context and at twice it: (label, ctx, chunks, what).
# Phi-4 mini's layout adds a rotation of 96 of each head's 128 dimensions
# (and a tied output) to the same LongRoPE.
def short_and_long(label, what):
    """The two checks of a LongRoPE file: at the original context (the
    short factors) and at twice it (the long ones)."""
    return [(f"{label}: short factors", CTX, CHUNKS, f"{what}: a context of {CTX}, the short factors"),
            (f"{label}: long factors", 2 * CTX, CHUNKS // 2,
             f"the same file at a context of {2 * CTX}, the long factors ({CHUNKS // 2} chunks of {2 * CTX})")]


LONGROPE = [
    ("synth-phi3-long", "phi3", ["F16", "Q8_0"], short_and_long(
        "Phi-3.5 LongRoPE",
        "Phi-3 mini's layout with Phi-3.5's LongRoPE (original context 256, attention factor 1.46)")),
    ("synth-phi3-4mini", "phi3", ["F16", "Q8_0"], short_and_long(
        "Phi-4 mini",
        "Phi-4 mini's width (3,072, 24/8 heads of 128, RoPE on 96 of them, FFN 8,192, tied output) at "
        "8 layers, LongRoPE as above")),
]
REAL = [
    ("SmolLM2-135M-Instruct (real)", "SmolLM2-135M-Instruct.Q4_1", "llama", "Q4_1"),
    ("Gemma 3 270M (real)", "gemma-3-270m-q4_k_m", "gemma3", "Q4_K_M"),
]


def run(model, ctx=CTX, chunks=CHUNKS):
    base = BENCH / "families" / f"{model.stem}.kld"
    base.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, LD_LIBRARY_PATH=str(BIN))
    r = subprocess.run([str(BIN / "llama-perplexity"), "-m", str(model), "-f", str(TEXT), "-c", str(ctx),
                        "--chunks", str(chunks), "-t", str(THREADS), "--kl-divergence-base", str(base)],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0 or not base.exists():
        sys.exit(f"llama-perplexity failed on {model}:\n{r.stderr[-2000:]}")
    r = subprocess.run([str(TESSERA), "perplexity", "--model", str(model), "--file", str(TEXT),
                        "--ctx", str(ctx), "--chunks", str(chunks), "--kl-divergence", str(base), "--json"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"tessera perplexity failed on {model}:\n{r.stderr[-2000:]}")
    out = json.loads(r.stdout)
    base.unlink()
    kl = out["kl_divergence"]
    return {"scored": out["tokens_scored"], "tokens_differing": kl["tokens_differing"],
            "kl_mean": kl["kl_mean"], "kl_max": kl["kl_max"], "same_top1": kl["same_top1"],
            "activations": out["activations"]}


def checks():
    """Every row to measure: (label, family, format, what the file is, its
    path, context, chunks, whether `just bench-families` generates it)."""
    models = ROOT / "models"
    for label, stem, arch, what in SYNTH:
        for fmt in FORMATS:
            yield label, arch, fmt, what, models / f"{stem}-{fmt}.gguf", CTX, CHUNKS, True
    for stem, arch, formats, file_checks in LONGROPE:
        for fmt in formats:
            for label, ctx, chunks, what in file_checks:
                yield label, arch, fmt, what, models / f"{stem}-{fmt}.gguf", ctx, chunks, True
    for label, stem, arch, fmt in REAL:
        yield label, arch, fmt, "", models / f"{stem}.gguf", CTX, CHUNKS, False


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "table":
        return table()
    for exe in (TESSERA, BIN / "llama-perplexity"):
        if not exe.exists():
            sys.exit(f"{exe} is missing: run `just bench-families`")
    # `--only LABEL,...`: those rows again, the others kept from the last run.
    only = sys.argv[2].split(",") if sys.argv[1:2] == ["--only"] else None
    wanted = lambda label: only is None or label in only  # noqa: E731
    rows = []
    for label, arch, fmt, what, model, ctx, chunks, generated in checks():
        if generated and not model.exists():
            sys.exit(f"{model} is missing: run `just bench-families` (it generates it)")
        if model.exists() and wanted(label):
            print(f"{label} {fmt}", flush=True)
            rows.append(dict(label=label, arch=arch, format=fmt, what=what, **run(model, ctx, chunks)))
    stamp = measured()
    if only is not None:
        # Each row in the place of the last run's row of its label and
        # format; the rows kept carry the last run's stamp.
        last = json.loads((BENCH / "families.json").read_text())
        for r in rows:
            r["measured"] = stamp
        new = {(r["label"], r["format"]): r for r in rows}
        kept = [new.pop((r["label"], r["format"]), {"measured": last["measured"], **r})
                for r in last["rows"]]
        rows = kept + list(new.values())
    (BENCH / "families.json").write_text(json.dumps({"measured": stamp, "rows": rows}, indent=1))
    table()


def table():
    data = json.loads((BENCH / "families.json").read_text())
    stamps = sorted({r["measured"] for r in data["rows"] if "measured" in r})
    out = [
        f"{'rows measured as marked below' if len(stamps) > 1 else data['measured']}; `llama-perplexity` of the llama.cpp tree vendored by llama-cpp-python 0.3.36 "
        f"(native CPU build) with `--kl-divergence-base`, then `tessera perplexity --kl-divergence` on its "
        f"file (default activations: two int8 levels for quantized weights, f32 for f16 ones), "
        f"{CHUNKS} chunks of {CTX} tokens of `data/pride-and-prejudice.txt`, the second half of each scored "
        f"({data['rows'][0]['scored']} positions per row). Generated files (`just synth-model`): random "
        f"weights of the family's tensor layout with SmolLM2's tokenizer.",
        "",
        "| family | file | weights | same top-1 | KL(llama.cpp ‖ Tessera), mean | max | tokenization |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        toks = "same tokens" if r["tokens_differing"] == 0 else f"{r['tokens_differing']} tokens differ"
        mark = "¹²³⁴⁵⁶⁷⁸⁹"[stamps.index(r["measured"])] if len(stamps) > 1 else ""
        out.append(f"| {r['label']} (`{r['arch']}`){mark} | {r['what'] or 'real weights'} | {r['format']} | "
                   f"{100 * r['same_top1']:.1f}% | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | {toks} |")
    if len(stamps) > 1:
        out.append("")
        out += [f"{'¹²³⁴⁵⁶⁷⁸⁹'[i]} {st}." for i, st in enumerate(stamps)]
    splice("families", "families_vs_llamacpp.py", out)


if __name__ == "__main__":
    main()
