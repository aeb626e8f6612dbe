#!/usr/bin/env python3
"""A change's CPU speed against the build before it, in one run.

    python3 scripts/ab_cpu.py OLD_TESSERA NEW_TESSERA [--rounds 3] [--label NAME]

Runs `tessera bench --no-baseline` of both binaries alternating, round by
round (old, new, new, old, ...: neither always goes first), for prefill,
decode, decode-long and decode-batch on the default model, decode on
Gemma 3 270M and prefill and decode on the generated 1B-class Q4_K_M
when they are present, and keeps the median of each side's
rounds. Writes target/bench/ab-cpu.json and the README's `bench-ab-cpu`
section. Both binaries should come from the same build profile and flags.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_tables import BENCH, ROOT, isa, measured, splice  # noqa: E402

SMOL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA = ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"
# The 1B-class Llama layout with random weights (`just synth-model`).
SYNTH_1B = ROOT / "models" / "synth-1b-Q4_K_M.gguf"
# (row, model, scenario, runs per round, the JSON field that holds tok/s)
CASES = [
    ("prefill, 512-token prompt", SMOL, "prefill", 3, "tessera"),
    ("decode, 128 tokens", SMOL, "decode", 3, "tessera"),
    ("decode-long: 128 tokens after 2,048", SMOL, "decode-long", 2, "tessera"),
    ("decode-batch: 8 sequences, aggregate", SMOL, "decode-batch", 2, "batch8"),
    ("Gemma 3 270M decode, 128 tokens", GEMMA, "decode", 3, "tessera"),
    ("1B-class Q4_K_M (generated) prefill, 512-token prompt", SYNTH_1B, "prefill", 2, "tessera"),
    ("1B-class Q4_K_M (generated) decode, 128 tokens", SYNTH_1B, "decode", 2, "tessera"),
]


def bench(exe, model, scenario, runs, field):
    r = subprocess.run([exe, "bench", "--model", str(model), "--scenario", scenario, "--runs", str(runs),
                        "--no-baseline", "--json"], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{exe} bench --scenario {scenario} failed:\n{r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out[field], "tok/s"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--label", default="this change")
    args = ap.parse_args()
    cases = [c for c in CASES if c[1].exists()]
    results = {c[0]: {"old": [], "new": [], "unit": ""} for c in cases}
    for rnd in range(args.rounds):
        order = ["old", "new"] if rnd % 2 == 0 else ["new", "old"]
        for name, model, scenario, runs, field in cases:
            for side in order:
                v, unit = bench(getattr(args, side), model, scenario, runs, field)
                results[name][side].append(v)
                results[name]["unit"] = unit
                print(f"round {rnd + 1} {side} {name}: {v:.1f} {unit}", flush=True)
    rows = [{"case": n, "unit": r["unit"], "old": statistics.median(r["old"]),
             "new": statistics.median(r["new"]), "old_runs": r["old"], "new_runs": r["new"]}
            for n, r in results.items()]
    BENCH.mkdir(parents=True, exist_ok=True)
    data = {"measured": f"{measured()}, {isa()} host", "label": args.label, "rounds": args.rounds,
            "threads": os.cpu_count(), "rows": rows}
    (BENCH / "ab-cpu.json").write_text(json.dumps(data, indent=1))
    table(data)


def table(data):
    out = [
        f"{data['measured']}: {data['label']}, `tessera bench --no-baseline` of the build before "
        f"it and of this one alternating, {data['rounds']} rounds, medians (each cell the median of "
        "its rounds; min–max in brackets), default (portable) release builds, 2 threads.",
        "",
        "| scenario | before | after | after / before |",
        "|---|---|---|---|",
    ]
    for r in data["rows"]:
        rng = lambda v: f"{min(v):,.1f}–{max(v):,.1f}"  # noqa: E731
        out.append(f"| {r['case']} | {r['old']:,.1f} {r['unit']} [{rng(r['old_runs'])}] | "
                   f"{r['new']:,.1f} {r['unit']} [{rng(r['new_runs'])}] | {r['new'] / r['old']:.3f}× |")
    splice("ab-cpu", "ab_cpu.py", out)


if __name__ == "__main__":
    main()
