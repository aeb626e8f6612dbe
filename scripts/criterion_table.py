#!/usr/bin/env python3
"""Print a Markdown table of the latest criterion results in target/criterion
(median per iteration, and per element where the bench sets a throughput)."""
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "target" / "criterion"


def fmt(ns: float) -> str:
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns:.3g} ns"


rows = []
for bench in sorted(ROOT.glob("*/*/new/benchmark.json")):
    meta = json.loads(bench.read_text())
    est = json.loads((bench.parent / "estimates.json").read_text())
    median = est["median"]["point_estimate"]
    per = ""
    elements = (meta.get("throughput") or {}).get("Elements")
    if elements:
        per = f"{fmt(median / elements)} per element"
    rows.append((meta["full_id"], fmt(median), per))

print("| bench | median | |")
print("|---|---|---|")
for name, median, per in rows:
    print(f"| `{name}` | {median} | {per} |")
