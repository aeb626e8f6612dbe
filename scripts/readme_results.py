#!/usr/bin/env python3
"""Regenerates the llama.cpp comparison (docs/benchmarks.md) from target/bench/.

Reads vs-llamacpp.json and vs-llamacpp-meta.json (written by
`just bench-llamacpp`), copies the charts to docs/bench/, and replaces the
text between the bench-llamacpp markers. Nothing is typed by hand.
"""

import json
import shutil
import sys
from pathlib import Path

from readme_tables import splice

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "target" / "bench"

LABELS = {
    ("prefill", "prefill_tok_s"): "prefill, 512-token prompt",
    ("decode", "decode_tok_s"): "decode, 128 tokens",
    ("decode-long", "decode_tok_s"): "decode-long: 128 tokens after 2,048 of context",
    ("decode-batch", "batch4_tok_s"): "decode-batch: 4 sequences together, aggregate",
    ("decode-batch", "batch8_tok_s"): "decode-batch: 8 sequences together, aggregate",
    ("chat-ttft", "ttft_sum_ms"): "chat, 12 turns: sum of TTFT",
    ("chat-ttft", "ttft_last_turn_ms"): "chat, 12 turns: TTFT of turn 12",
    ("shared-prefix", "total_ttft_ms"): "shared prefix: 8 requests, time to all first tokens",
    ("interleaved", "ttft_sum_ms"): "interleaved: 4 conversations × 6 turns, sum of TTFT",
}


def fmt(x, unit):
    return f"{x:,.0f} {unit}" if unit == "ms" else f"{x:,.1f} {unit}"


def cell(side, unit):
    """Median, and the spread over the runs when there were several."""
    if side["runs"] < 2:
        return fmt(side["median"], unit)
    digits = 0 if unit == "ms" else 1
    return f"{fmt(side['median'], unit)} ({side['min']:,.{digits}f}–{side['max']:,.{digits}f})"


def main():
    rows = json.loads((BENCH / "vs-llamacpp.json").read_text())
    meta = json.loads((BENCH / "vs-llamacpp-meta.json").read_text())
    main_rows = [r for r in rows if r["model"] == "Q4_1"]
    variants = [r for r in rows if r["model"] in ("Q4_0", "Q8_0")]
    gemma = [r for r in rows if r["model"] == "Gemma3"]
    scenarios = {r["scenario"] for r in main_rows}
    want = {"prefill", "decode", "decode-long", "decode-batch", "chat-ttft", "shared-prefix", "interleaved"}
    missing = want - scenarios
    if missing:
        sys.exit(f"vs-llamacpp.json lacks {sorted(missing)}: run `just bench-llamacpp`")
    docs = ROOT / "docs" / "bench"
    docs.mkdir(parents=True, exist_ok=True)
    for png in ("chat-ttft.png", "ratios.png"):
        shutil.copyfile(BENCH / png, docs / png)

    m = meta["machine"]
    out = [
        f"Measured {meta['date']} on {m['cpu']} ({m['cores']} cores), "
        f"{meta['threads']} threads for both engines, commit `{meta['commit']}`, "
        f"model `{Path(meta['model']).name}`; {meta['llama_cpp']}. "
        "Each cell: median over the runs (min–max in brackets). "
        "Ratio of medians > 1 means Tessera is better (throughput: Tessera / llama.cpp; "
        "time: llama.cpp / Tessera).",
        "",
        "| scenario | Tessera | llama.cpp | ratio | candle `quantized_llama` |",
        "|---|---|---|---|---|",
    ]
    for r in main_rows:
        label = LABELS.get((r["scenario"], r["metric"]), f"{r['scenario']} {r['metric']}")
        candle = cell(r["candle"], r["unit"]) if "candle" in r else ""
        out.append(
            f"| {label} | {cell(r['tessera'], r['unit'])} | {cell(r['llamacpp'], r['unit'])} "
            f"| **{r['ratio']:.2f}×** | {candle} |"
        )
    def table(title, rows, with_file):
        """A titled table of `rows`, with a file column when `with_file`."""
        if not rows:
            return []
        lines = ["", title, "",
                 "| file | scenario | Tessera | llama.cpp | ratio |" if with_file
                 else "| scenario | Tessera | llama.cpp | ratio |",
                 "|---|---|---|---|---|" if with_file else "|---|---|---|---|"]
        for r in rows:
            label = LABELS.get((r["scenario"], r["metric"]), f"{r['scenario']} {r['metric']}")
            first = f"| {r['model']} " if with_file else ""
            lines.append(
                f"{first}| {label} | {cell(r['tessera'], r['unit'])} "
                f"| {cell(r['llamacpp'], r['unit'])} | **{r['ratio']:.2f}×** |"
            )
        return lines

    out += table(
        f"The same model in the formats llama.cpp repacks for its fastest kernels ({meta['variants']}):",
        variants, True)
    out += table(
        "Gemma 3 270M Q4_K_M (`just model gemma3`: sliding-window layers, K-quants; Tessera's "
        "sliding layers on their own pool, a quarter of the blocks; llama.cpp's library default, "
        "`swa_full`):",
        gemma, False)
    out += ["", "Agreement of the two engines (greedy tokens of the timed runs; the completions "
            "diverge at near-ties, where llama.cpp's 8-bit activations tip the balance):", ""]
    for a in meta["agreement"]:
        where = "" if a["model"] == "Q4_1" else f"{a['model']}: "
        out.append(f"- {where}{a['what']}: {a['same']} of {a['of']}")
    out += [
        "",
        "![TTFT per chat turn](bench/chat-ttft.png)",
        "",
        "![Tessera / llama.cpp ratios](bench/ratios.png)",
    ]
    splice("llamacpp", "readme_results.py", out)
    print(f"docs/benchmarks.md: llama.cpp comparison regenerated from {BENCH / 'vs-llamacpp.json'}")


if __name__ == "__main__":
    main()
