#!/usr/bin/env python3
"""The default (portable) build beside a build for this CPU, in the same run.

`just bench-portable` builds `target/release/tessera` (the default build:
the kernels pick their instruction set at run time) and
`target/native/release/tessera` (`-C target-cpu=native`), then runs this:
prefill and decode of each binary, alternating, `RUNS` times, so that both
see the same machine. Writes target/bench/portable.json and the README's
`bench-portable` section.
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_tables import BENCH, ROOT, measured, splice  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILDS = {
    "portable": ROOT / "target" / "release" / "tessera",
    "native": ROOT / "target" / "native" / "release" / "tessera",
}
# One binary's runs spread by about ±10% on a shared host (AMD EPYC,
# 2026-11-25: prefill 885 to 1,062 tok/s over 5 runs), so the medians need
# more runs than that.
RUNS = 15


def run(binary, scenario):
    out = subprocess.run(
        [str(binary), "bench", "--model", str(MODEL), "--scenario", scenario,
         "--runs", "1", "--no-baseline", "--json"],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["tessera"]


def main():
    for name, path in BUILDS.items():
        if not path.exists():
            sys.exit(f"{path} is missing: run `just bench-portable`")
    got = {s: {b: [] for b in BUILDS} for s in ("prefill", "decode")}
    for i in range(RUNS):
        for scenario, per in got.items():
            for build, path in BUILDS.items():
                per[build].append(run(path, scenario))
                print(f"run {i + 1}/{RUNS} {scenario} {build}: {per[build][-1]:.1f} tok/s", flush=True)
    result = {
        s: {
            **{b: statistics.median(v) for b, v in per.items()},
            **{f"{b}_min": min(v) for b, v in per.items()},
            **{f"{b}_max": max(v) for b, v in per.items()},
            "ratio": statistics.median(per["portable"]) / statistics.median(per["native"]),
        }
        for s, per in got.items()
    }
    result["runs"] = RUNS
    BENCH.mkdir(parents=True, exist_ok=True)
    (BENCH / "portable.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"The default build against one for this CPU (`just bench-portable`), {measured()}: "
        "`target/release/tessera` (kernels chosen at run time) and the same code built with "
        f"`-C target-cpu=native`, alternating, {RUNS} runs each, median (min–max):",
        "",
        "| scenario | default build | `target-cpu=native` | default / native |",
        "|---|---|---|---|",
    ]
    for key, label in [("prefill", "prefill, 512-token prompt"),
                       ("decode", "decode, 128 tokens after a 16-token prompt")]:
        r = result[key]
        lines.append(
            f"| {label} | {r['portable']:.1f} tok/s ({r['portable_min']:.0f}–{r['portable_max']:.0f}) | "
            f"{r['native']:.1f} tok/s ({r['native_min']:.0f}–{r['native_max']:.0f}) | {r['ratio']:.3f} |"
        )
    splice("portable", "portable_vs_native.py", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
