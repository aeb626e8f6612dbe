#!/usr/bin/env python3
"""The default (portable) build beside a build for this CPU, in the same run.

`just bench-portable` builds `target/release/tessera` (the default build:
the kernels pick their instruction set at run time) and
`target/native/release/tessera` (`-C target-cpu=native`), then runs this:
prefill and decode of each binary, alternating, on each model and each
instruction set this host has (`TESSERA_ISA` forced to the same one in
both binaries, so the rows compare the dispatch, not the kernels; the
native binary's code around the kernels is still compiled for this CPU),
so that both see the same machine. Writes target/bench/portable.json and
the README's `bench-portable` section; on a CPU with AVX2 alone, where
`native` is an AVX2 build with 16 registers, portable-avx2-cpu.json and
its own section, so that a wider host's rows stay; on a CPU with AMX-INT8
(whose prompt chunks take AMX's tiles), portable-amx-cpu.json and its
own section likewise.

    python3 scripts/portable_vs_native.py [--models SmolLM2-135M-Instruct.Q4_1,synth-1b-Q4_K_M]
                                          [--isas avx512,avxvnni,avx2] [--runs 7]
                                          [--against native|x86-64-v3|x86-64-v3-vnni]

`--against x86-64-v3` compares with a build for the x86-64-v3 level
(`target/x86-64-v3`, AVX2 + FMA, 16 vector registers) instead, on the AVX2
rows: on an AVX-512 host `native` gives the 256-bit tiles 32 registers, so
only this build says what an AVX2 machine's own build would gain;
`--against x86-64-v3-vnni` (the same level with AVX-VNNI) says it for the
AVX-VNNI rows.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import avx2_only, host_isas, model_paths  # noqa: E402
from readme_tables import BENCH, ISA_NAMES, ROOT, measured, splice  # noqa: E402

# The builds the default one is compared with: this CPU's, or the x86-64-v3
# level (AVX2 + FMA, 16 vector registers), a faithful AVX2 build on a host
# whose `native` has AVX-512's 32 registers.
AGAINST = {
    "native": (ROOT / "target" / "native" / "release" / "tessera", "-C target-cpu=native"),
    "x86-64-v3": (ROOT / "target" / "x86-64-v3" / "release" / "tessera",
                  "-C target-cpu=x86-64-v3"),
    # The same level with AVX-VNNI (Intel since Alder Lake, AMD since Zen 5):
    # what an AVX-VNNI machine's own build would be, 16 registers.
    "x86-64-v3-vnni": (ROOT / "target" / "x86-64-v3-vnni" / "release" / "tessera",
                       "-C target-cpu=x86-64-v3 -C target-feature=+avxvnni"),
}
PORTABLE = ROOT / "target" / "release" / "tessera"
# One binary's runs spread by about ±10% on a shared host (AMD EPYC,
# 2026-11-25: prefill 885 to 1,062 tok/s over 5 runs), so the medians need
# several runs, alternating.
RUNS = 7


def host_section():
    """The section of this CPU's rows against its own build: the main one,
    or one of a CPU with AVX2 alone or with AMX-INT8, so that each kind of
    host keeps its own."""
    if avx2_only():
        return "portable-avx2-cpu"
    if "amx" in host_isas():
        return "portable-amx-cpu"
    return "portable"


def run(binary, model, scenario, isa):
    out = subprocess.run(
        [str(binary), "--threads", "2", "bench", "--model", str(model), "--scenario", scenario,
         "--runs", "1", "--no-baseline", "--json"],
        check=True, capture_output=True, text=True, env=dict(os.environ, TESSERA_ISA=isa),
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["tessera"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="SmolLM2-135M-Instruct.Q4_1,synth-1b-Q4_K_M")
    ap.add_argument("--isas", default=",".join(host_isas()))
    ap.add_argument("--runs", type=int, default=RUNS)
    ap.add_argument("--against", choices=sorted(AGAINST), default="native")
    args = ap.parse_args()
    other, flags = AGAINST[args.against]
    builds = {"portable": PORTABLE, "native": other}
    for name, path in builds.items():
        if not path.exists():
            sys.exit(f"{path} is missing: run `just bench-portable`")
    models = model_paths(args.models)
    isas = [i for i in args.isas.split(",") if i]
    rows = []
    for name, path in models:
        for isa in isas:
            got = {s: {b: [] for b in builds} for s in ("prefill", "decode")}
            for i in range(args.runs):
                for scenario, per in got.items():
                    for build, binary in builds.items():
                        per[build].append(run(binary, path, scenario, isa))
                print(f"{name} {isa} run {i + 1}/{args.runs}: "
                      + ", ".join(f"{s} {b} {v[b][-1]:.1f}" for s, v in got.items() for b in builds), flush=True)
            for s, per in got.items():
                rows.append({
                    "model": name, "isa": isa, "scenario": s,
                    **{b: statistics.median(v) for b, v in per.items()},
                    **{f"{b}_runs": v for b, v in per.items()},
                    "ratio": statistics.median(per["portable"]) / statistics.median(per["native"]),
                })
    BENCH.mkdir(parents=True, exist_ok=True)
    native = args.against == "native"
    section = host_section() if native else f"portable-{args.against}"
    out = BENCH / f"{section}.json"
    out.write_text(json.dumps({"runs": args.runs, "against": args.against, "rows": rows},
                              indent=1) + "\n")
    what = "one for this CPU" if native else f"one for the {args.against} level"
    lines = [
        f"The default build against {what} (`just bench-portable`), {measured()}: "
        "`target/release/tessera` (kernels chosen at run time) and the same code built with "
        f"`{flags}`, `TESSERA_ISA` forced to the row's instruction set in both, 2 threads, "
        f"alternating, {args.runs} runs each, median (min–max). Prefill: a 512-token prompt; decode: 128 "
        "tokens after a 16-token prompt.",
        "",
        f"| model | ISA | scenario | default build | `{flags.split()[-1]}` | default / other |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        span = lambda b: f"({min(r[b + '_runs']):.0f}–{max(r[b + '_runs']):.0f})"  # noqa: E731
        lines.append(
            f"| {r['model']} | {ISA_NAMES.get(r['isa'], r['isa'])} | {r['scenario']} | {r['portable']:.1f} tok/s "
            f"{span('portable')} | {r['native']:.1f} tok/s {span('native')} | {r['ratio']:.3f} |"
        )
    splice(section, "portable_vs_native.py", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
