#!/usr/bin/env python3
"""The in-process harness's llama.cpp against the same llama.cpp's own
`llama-bench`.

`just bench-llamacpp` measures llama.cpp inside Tessera's process through
the `llama-cpp-2` crate (examples/vs_llamacpp.rs). That number is only a
fair baseline if it is what llama.cpp's own tool reports for the same
library, file, threads and host. This runs the two alternately on the same
llama.cpp library (the llama-cpp-sys-2 crate's tree; `llama-bench` built
from it by `scripts/build_llama_tools.sh harness`): prefill of 512 tokens
and decode of 128, the in-process side as the harness runs them (`VS_ONLY=
prefill,decode`, its own medians of 5 and 3 runs, the context's flash
attention left at the library's `auto`), `llama-bench` with flash attention
`auto` (the same setting), off and on, and writes the in-process /
standalone ratios per scenario to target/bench/harness-check.json and the
`harness-check` section of docs/benchmarks.md. The `llama-bench` of the
tree the other baselines use (llama-cpp-python's, `just bench-cpu`'s)
runs beside them, flash attention `auto`, so that the two trees' speeds
are compared in the same run too.

    python3 scripts/harness_check.py [--runs 2] [MODEL ...]

Default models: the default model and, when generated, synth-1b-Q4_0.
"""

import argparse
import json
import os
import subprocess
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bench_cpu import llama_bench  # noqa: E402
from readme_tables import BENCH, cpu, isa, splice  # noqa: E402

HARNESS = ROOT / "target/native/release/examples/vs_llamacpp"
THREADS = int(os.environ.get("TESSERA_BENCH_THREADS", "2"))


def llama_bench_binary():
    """`llama-bench` on the llama-cpp-sys-2 version in Cargo.lock."""
    lock = (ROOT / "Cargo.lock").read_text()
    version = lock.split('name = "llama-cpp-sys-2"\nversion = "', 1)[1].split('"', 1)[0]
    binary = ROOT / f"target/llama-server/build-harness-{version}/bin/llama-bench"
    if not binary.exists():
        sys.exit(f"{binary} missing: run scripts/build_llama_tools.sh harness")
    return binary


OTHER = ROOT / "target/llama-server/build/bin/llama-bench"


def harness_library():
    """How the harness's llama.cpp was built (CMake's build type), or exit
    where it is not the -O3 `Release` that `llama-bench` gets."""
    caches = sorted((ROOT / "target/native/release/build").glob("llama-cpp-sys-2-*/out/build/CMakeCache.txt"))
    if not caches:
        sys.exit("the harness's llama.cpp is not built: run `sh scripts/build_harness.sh`")
    kind = next((line.split("=", 1)[1] for line in caches[-1].read_text().splitlines()
                 if line.startswith("CMAKE_BUILD_TYPE:")), "")
    if kind != "Release":
        sys.exit(f"the harness's llama.cpp was built as {kind or 'an unknown type'}, not Release: "
                 "run `sh scripts/build_harness.sh`")
    return kind


def in_process(model):
    """The harness's llama.cpp side: {"prefill": tok/s, "decode": tok/s}."""
    out = ROOT / "target/bench/harness-check"
    env = dict(os.environ, VS_ONLY="prefill,decode", VS_VARIANTS="0", VS_GEMMA="0", VS_CANDLE="0",
               VS_OUT_DIR=str(out), TESSERA_BENCH_THREADS=str(THREADS))
    subprocess.run([str(HARNESS), str(model)], check=True, env=env, capture_output=True, text=True)
    rows = json.loads((out / "vs-llamacpp.json").read_text())
    return {r["scenario"]: r["llamacpp"]["median"] for r in rows}


def standalone(binary, model, fa="auto,0,1"):
    """llama-bench, flash attention auto, off and on: {("prefill"|"decode", fa): tok/s},
    fa -1 (auto), 0 or 1 as llama-bench reports it."""
    return llama_bench(binary, model, threads=THREADS, fa=fa)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("models", nargs="*")
    args = ap.parse_args()
    models = [Path(m) for m in args.models] or [
        p for p in (ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf", ROOT / "models/synth-1b-Q4_0.gguf")
        if p.exists()]
    if not HARNESS.exists():
        sys.exit(f"{HARNESS} missing: run `just bench-llamacpp` (or build the example natively)")
    harness_library()
    binary = llama_bench_binary()
    tree = binary.parent.parent.name.removeprefix("build-harness-")
    results = []
    for model in models:
        ins = {"prefill": [], "decode": []}
        alone = {}
        for r in range(args.runs):
            for k, v in in_process(model).items():
                ins[k].append(v)
            for k, v in standalone(binary, model).items():
                alone.setdefault(k, []).append(v)
            if OTHER.exists():
                for (k, _), v in standalone(OTHER, model, "auto").items():
                    alone.setdefault((k, "other"), []).append(v)
            print(f"{model.name} run {r + 1}: in-process {ins}, llama-bench {alone}", flush=True)
        for scenario in ("prefill", "decode"):
            a = statistics.median(ins[scenario])
            auto, off, on = (statistics.median(alone[(scenario, fa)]) for fa in (-1, 0, 1))
            results.append({"model": model.stem, "scenario": scenario, "in_process": a,
                            "in_process_runs": ins[scenario], "fa_auto": auto, "fa_off": off,
                            "fa_on": on, "ratio_same": a / auto, "ratio_best": a / max(auto, off, on),
                            "other_tree_auto": statistics.median(alone[(scenario, "other")])
                            if (scenario, "other") in alone else None})
    BENCH.mkdir(parents=True, exist_ok=True)
    (BENCH / "harness-check.json").write_text(json.dumps(results, indent=1) + "\n")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    # On a CPU with AMX build_llama_tools.sh builds this llama-bench with
    # GCC's dead-store elimination off and the other tree's with clang
    # (GCC 12's native builds die of SIGILL there otherwise).
    amx = "amx_int8" in Path("/proc/cpuinfo").read_text().split()
    how = ("native, by GCC with `-fno-dse -fno-tree-dse` as on every CPU with AMX, where GCC 12 "
           "otherwise drops the tile configuration's stores" if amx else "native")
    lines = [
        f"`python3 scripts/harness_check.py` at `{commit}` on {time.strftime('%Y-%m-%d', time.gmtime())}, "
        f"{cpu()} ({isa()} host), {THREADS} threads: llama.cpp inside the harness (examples/vs_llamacpp.rs through `llama-cpp-2`, "
        f"its own medians of 5 prefill and 3 decode runs; its llama.cpp built as CMake's Release, -O3, by "
        f"`scripts/build_harness.sh`) and `llama-bench` built from the same library "
        f"(llama-cpp-sys-2 {tree}'s llama.cpp, {how}), alternating, medians of {args.runs} rounds. "
        "Prefill: 512 tokens; decode: 128 (the harness's after a 16-token prompt, llama-bench's "
        "from an empty context). The last column: `llama-bench` of the tree the other baselines use "
        f"(llama-cpp-python 0.3.36's, `scripts/build_llama_tools.sh`, {'native, clang' if amx else 'native'}), "
        "in the same rounds.",
        "",
        "| model | scenario | in process (tok/s) | llama-bench, flash attention auto | off | on "
        "| in process ÷ llama-bench, same setting | ÷ llama-bench's best "
        "| llama-bench of llama-cpp-python's tree, auto |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r['model']} | {r['scenario']} | {r['in_process']:.1f} | {r['fa_auto']:.1f} | "
                     f"{r['fa_off']:.1f} | {r['fa_on']:.1f} | {r['ratio_same']:.3f} | {r['ratio_best']:.3f} | "
                     + (f"{r['other_tree_auto']:.1f} |" if r["other_tree_auto"] else "— |"))
    splice("harness-check", "harness_check.py", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
