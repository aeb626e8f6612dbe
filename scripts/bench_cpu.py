#!/usr/bin/env python3
"""Tessera beside llama.cpp's own `llama-bench` at real sizes, per ISA.

`just bench-cpu` builds llama.cpp's tools (scripts/build_llama_tools.sh:
native, and an AVX2-only `llama-bench`), the generated models
(scripts/synth_model.py) and Tessera's default (portable) build, then runs
this: for each model and each instruction set this host has among AVX-512
VNNI, AVX-VNNI and AVX2, prefill of 512 tokens and decode of 128, `llama-bench`
(standalone, best of flash attention off and on) and `tessera bench`
(`TESSERA_ISA` forced to the same instruction set) alternating run by run,
2 threads each; and the host's read bandwidth (`tessera bench --scenario
roofline`) before and after, so each decode figure is also a share of the
roofline (the weights' bytes a decode step reads × tok/s ÷ GB/s); and for
Tessera, `tessera bench --scenario roofline --model` (decode bursts of 8
steps between read passes of 256 MiB: each burst's forward against the
reads either side, and each part of the step's).

    python3 scripts/bench_cpu.py [--models synth-1b-Q4_0,...] [--isas avx512,avxvnni,avx2] [--runs 3] [--int8]
                                 [--contention SmolLM2-135M-Instruct.Q4_1,...]

With --contention, also decode on those models (best ISA) idle, with one
busy process beside it (a shell loop spinning on one core), and idle on one
thread (one core's speed: the most an engine can expect while another
process holds the other core), both engines, alternating: the share of its
idle speed each keeps, and of its one-core speed. `--models ""` with
`--merge` runs the contention rows alone.

On a CPU with AMX the rows are AMX-INT8 (Tessera's `TESSERA_ISA=amx`,
llama.cpp built with AMX by clang) and AVX-512 VNNI (Tessera's `avx512`,
llama.cpp without AMX) above the 256-bit ones.

On a CPU with AVX2 alone (no AVX-512, no VNNI: AMD before Zen 4, Intel from Haswell to
Comet Lake, many cloud VMs) the rows are that CPU's own, not a wider
CPU's forced down, and go to cpu-avx2.json and their own section, so that
the table of the wider host stays. Likewise a CPU with AVX-512 VNNI but
without AVX-VNNI or AMX (AMD's Zen 4, Intel's Cascade Lake to Rocket Lake):
its AVX-512 VNNI and AVX2 rows go to cpu-avx512.json and their own section.

Writes target/bench/cpu.json (or --out; cpu-avx2.json on an AVX2-only
CPU, cpu-avx512.json on one with AVX-512 VNNI and no AVX-VNNI), then its
section (`readme_tables.py cpu`, `cpu-amx` for cpu-amx.json, `cpu-avx2`
for cpu-avx2.json, `cpu-avx512` for cpu-avx512.json).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_tables import BENCH, ROOT  # noqa: E402

TESSERA = ROOT / "target/release/tessera"
LLAMA = ROOT / "target/llama-server"
LLAMA_BENCH = {"avx512": LLAMA / "build/bin/llama-bench", "avxvnni": LLAMA / "build-avxvnni/bin/llama-bench",
               "avx2": LLAMA / "build-avx2/bin/llama-bench", "amx": LLAMA / "build-amx/bin/llama-bench"}
GGUF_PY = LLAMA / "llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py"
DEFAULT_MODELS = ["SmolLM2-135M-Instruct.Q4_1", "synth-1b-Q4_0", "synth-1b-Q4_K_M", "synth-3b-Q4_0",
                  "synth-3b-Q4_K_M"]
THREADS = 2


def flags():
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def host_isas():
    f = flags()
    out = []
    if "avx512_vnni" in f and "amx_int8" in f:
        out.append("amx")
    if "avx512_vnni" in f:
        out.append("avx512")
    if "avx_vnni" in f:
        out.append("avxvnni")
    if "avx2" in f:
        out.append("avx2")
    return out


def avx2_only():
    """Whether AVX2 is this CPU's widest set (its rows go to their own table)."""
    return host_isas() == ["avx2"]


def default_out():
    """The results file of this CPU's rows: the main table (cpu.json) is a
    CPU that runs all three of AVX-512 VNNI, AVX-VNNI and AVX2; a CPU whose
    widest set is AVX2 has cpu-avx2.json, and one with AVX-512 VNNI but
    neither AVX-VNNI nor AMX (AMD's Zen 4, Intel's Cascade Lake to Rocket
    Lake) cpu-avx512.json, each with its own table, so that the others
    stay as they were."""
    if avx2_only():
        return "cpu-avx2.json"
    if host_isas() == ["avx512", "avx2"]:
        return "cpu-avx512.json"
    return "cpu.json"


def llama_binary(isa):
    """The `llama-bench` of an ISA's rows. On a CPU with AMX the native build
    has AMX (and GCC's dies of it, see build_llama_tools.sh), so the
    AVX-512 rows take a build without it."""
    if isa == "avx512" and "amx_int8" in flags():
        return LLAMA / "build-avx512/bin/llama-bench"
    return LLAMA_BENCH[isa]


def model_paths(names):
    """(name, path) of each comma-separated model name, from models/."""
    out = []
    for m in names.split(","):
        p = ROOT / "models" / f"{m}.gguf"
        if not p.exists():
            sys.exit(f"{p} is missing: run `just synth-model` (or `just model`)")
        out.append((m, p))
    return out


def decode_bytes(path):
    """Bytes of the weights one decode step reads: every tensor but the
    token embedding (one row of it), unless it is also the output."""
    sys.path.insert(0, str(GGUF_PY))
    import gguf

    r = gguf.GGUFReader(path)
    names = {t.name: int(t.n_bytes) for t in r.tensors}
    total = sum(names.values())
    if "output.weight" in names:
        total -= names.get("token_embd.weight", 0)
    return total


def tessera(model, scenario, isa, activations=None, threads=THREADS):
    env = dict(os.environ, TESSERA_ISA=isa)
    if activations:
        env["TESSERA_ACTIVATIONS"] = activations
    out = subprocess.run(
        [str(TESSERA), "--threads", str(threads), "bench", "--model", str(model), "--scenario", scenario,
         "--runs", "1", "--no-baseline", "--json"],
        check=True, capture_output=True, text=True, env=env,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["tessera"]


def llama_bench(binary, model, prompt=512, gen=128, threads=THREADS, fa="0,1"):
    """One `llama-bench` run of `binary` for each flash-attention setting in
    `fa`: {("prefill"|"decode", setting): tok/s}, the setting as llama-bench
    reports it (-1 auto, 0 off, 1 on); a prompt of `prompt` tokens, `gen`
    generated (0 skips one)."""
    out = subprocess.run(
        [str(binary), "-m", str(model), "-t", str(threads), "-p", str(prompt), "-n", str(gen),
         "-fa", fa, "-r", "1", "-o", "json"],
        check=True, capture_output=True, text=True,
    ).stdout
    return {("prefill" if row["n_prompt"] else "decode", int(row["flash_attn"])): row["avg_ts"]
            for row in json.loads(out)}


def llama(model, isa, prompt=512, gen=128, threads=THREADS):
    """`llama-bench` for `isa`, flash attention off and on, the better of
    the two per test: {"prefill": tok/s, "decode": tok/s} for the tests
    asked for."""
    best = {}
    for (key, _), ts in llama_bench(llama_binary(isa), model, prompt, gen, threads).items():
        best[key] = max(best.get(key, 0.0), ts)
    return best


def busy():
    """One process spinning on a core: a browser tab, a build."""
    return subprocess.Popen(["sh", "-c", "while :; do :; done"])


def contention(models, runs):
    isa = host_isas()[0]
    rows = []
    for name, path in models:
        got = {k: [] for k in ("t_idle", "t_busy", "t_one", "l_idle", "l_busy", "l_one")}
        for r in range(runs):
            for load in ("idle", "busy", "one"):
                # "one": one thread, idle: what one core decodes, the most
                # an engine can expect when another process holds the other.
                spinner = busy() if load == "busy" else None
                n = 1 if load == "one" else THREADS
                try:
                    got[f"l_{load}"].append(llama(path, isa, prompt=0, threads=n)["decode"])
                    got[f"t_{load}"].append(tessera(path, "decode", isa, threads=n))
                finally:
                    if spinner:
                        spinner.kill()
                        spinner.wait()
            print(f"{name} contention run {r + 1}/{runs}: "
                  + ", ".join(f"{k} {v[-1]:.1f}" for k, v in got.items()), flush=True)
        med = {k: statistics.median(v) for k, v in got.items()}
        rows.append({"model": name, "isa": isa, **{k: med[k] for k in med},
                     "tessera_kept": med["t_busy"] / med["t_idle"], "llama_kept": med["l_busy"] / med["l_idle"],
                     "tessera_of_one": med["t_busy"] / med["t_one"], "llama_of_one": med["l_busy"] / med["l_one"],
                     "runs": {k: v for k, v in got.items()}})
    return rows


def interleaved(model, isa):
    """`tessera bench --scenario roofline --model`: decode bursts between read
    passes, each burst's forward as a share of the reads either side."""
    out = subprocess.run(
        [str(TESSERA), "--threads", str(THREADS), "bench", "--model", str(model), "--scenario", "roofline",
         "--runs", "2", "--json"],
        check=True, capture_output=True, text=True, env=dict(os.environ, TESSERA_ISA=isa),
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def roofline():
    out = subprocess.run(
        [str(TESSERA), "--threads", str(THREADS), "bench", "--scenario", "roofline", "--runs", "5", "--json"],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["tessera"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--isas", default=",".join(host_isas()))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--int8", action="store_true", help="also Tessera with --activations int8")
    ap.add_argument("--contention", default="", help="models to decode beside a busy process")
    ap.add_argument("--out", default=default_out(),
                    help="results file in target/bench (cpu-amx.json: the AMX table, readme_tables.py cpu-amx; "
                         "cpu-avx2.json, the default on an AVX2-only CPU: readme_tables.py cpu-avx2; "
                         "cpu-avx512.json, the default on a CPU with AVX-512 VNNI and no AVX-VNNI: "
                         "readme_tables.py cpu-avx512; cpu-256.json, a wider CPU's 256-bit rows alone "
                         "(just bench-cpu-256): readme_tables.py cpu-256)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other models' rows (and their runs' rooflines) of target/bench/cpu.json")
    args = ap.parse_args()
    isas = [i for i in args.isas.split(",") if i]
    for i in isas:
        if i not in host_isas():
            sys.exit(f"this host does not run {i} (it runs {', '.join(host_isas())})")
        b = llama_binary(i)
        if not b.exists():
            flavour = "" if b.parent.parent.name == "build" else i
            sys.exit(f"{b} is missing: run scripts/build_llama_tools.sh {flavour}")
    if not TESSERA.exists():
        sys.exit(f"{TESSERA} is missing: cargo build --release -p tessera")
    models = model_paths(args.models) if args.models else []
    gb_s = [roofline()]
    print(f"roofline {gb_s[0]:.1f} GB/s", flush=True)
    rows = []
    for name, path in models:
        nbytes = decode_bytes(path)
        for isa in isas:
            got = {k: [] for k in ("t_prefill", "t_decode", "l_prefill", "l_decode", "i_prefill", "i_decode")}
            # The host's read bandwidth before each run and after the last:
            # each run's decode is a share of what was read around it.
            reads = [roofline()]
            for r in range(args.runs):
                ll = llama(path, isa)
                got["l_prefill"].append(ll["prefill"])
                got["l_decode"].append(ll["decode"])
                for s in ("prefill", "decode"):
                    got[f"t_{s}"].append(tessera(path, s, isa))
                    if args.int8:
                        got[f"i_{s}"].append(tessera(path, s, isa, "int8"))
                reads.append(roofline())
                print(f"{name} {isa} run {r + 1}/{args.runs}: "
                      + ", ".join(f"{k} {v[-1]:.1f}" for k, v in got.items() if v)
                      + f", read {reads[-2]:.1f}–{reads[-1]:.1f} GB/s", flush=True)
            close = interleaved(path, isa)
            print(f"{name} {isa} interleaved: forward at {close['tessera'] * 100:.1f}% of the read "
                  f"(reads {close['read_gb_s_min']:.1f}–{close['read_gb_s_max']:.1f} GB/s)", flush=True)
            for s in ("prefill", "decode"):
                t, ll = statistics.median(got[f"t_{s}"]), statistics.median(got[f"l_{s}"])
                row = {"model": name, "isa": isa, "scenario": s, "tessera": t, "llama": ll,
                       "ratio": t / ll, "tessera_runs": got[f"t_{s}"], "llama_runs": got[f"l_{s}"]}
                if got[f"i_{s}"]:
                    row["tessera_int8"] = statistics.median(got[f"i_{s}"])
                if s == "decode":
                    row["decode_bytes"] = nbytes
                    row["read_gb_s"] = reads
                    around = [(a + b) / 2 for a, b in zip(reads, reads[1:])]
                    for k, key in (("tessera", "t_decode"), ("llama", "l_decode"), ("tessera_int8", "i_decode")):
                        if got[key]:
                            row[f"{k}_roofline_share"] = statistics.median(
                                t * nbytes / 1e9 / g for t, g in zip(got[key], around))
                    row["tessera_interleaved_share"] = close["tessera"]
                    row["tessera_part_shares"] = close["part_shares"]
                    row["interleaved_read_gb_s"] = [close["read_gb_s_min"], close["read_gb_s_max"]]
                rows.append(row)
    busy_rows = []
    if args.contention:
        busy_rows = contention([(m, ROOT / "models" / f"{m}.gguf") for m in args.contention.split(",")], args.runs)
    gb_s.append(roofline())
    print(f"roofline {gb_s[1]:.1f} GB/s", flush=True)
    BENCH.mkdir(parents=True, exist_ok=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    names = [m for m, _ in models]
    run = [{"models": names, "gb_s": gb_s, "commit": head}] if names else []
    for row in rows + busy_rows:
        row["commit"] = head
    result = {"commit": head, "rooflines": run, "threads": THREADS, "runs": args.runs, "rows": rows,
              "contention": busy_rows}
    old = BENCH / args.out
    if args.merge and old.exists():
        prev = json.loads(old.read_text())
        kept = [r for r in prev["rows"] if r["model"] not in names]
        result["rows"] = kept + rows
        left = {r["model"] for r in kept}
        result["rooflines"] = [
            {**p, "models": [m for m in p["models"] if m in left]}
            for p in prev.get("rooflines", [{"models": sorted(left), "gb_s": prev.get("roofline_gb_s", []),
                                              "commit": prev.get("commit")}])
            if any(m in left for m in p["models"])
        ] + run
        result["contention"] = busy_rows or prev.get("contention", [])
        result["commit"] = prev.get("commit", head) if kept else head
    (BENCH / args.out).write_text(json.dumps(result, indent=1))
    for row in rows:
        extra = f", {row['tessera_roofline_share'] * 100:.0f}% of roofline" if "tessera_roofline_share" in row else ""
        print(f"{row['model']:<28} {row['isa']:<7} {row['scenario']:<8} tessera {row['tessera']:7.1f}  "
              f"llama.cpp {row['llama']:7.1f}  {row['ratio']:.2f}x{extra}")
    table = "cpu" if args.out == "cpu.json" else args.out.removesuffix(".json")
    subprocess.run([sys.executable, str(ROOT / "scripts/readme_tables.py"), table], check=True)
    # The README's summary takes its CPU rows from cpu.json and its AMX rows from cpu-amx.json.
    subprocess.run([sys.executable, str(ROOT / "scripts/readme_tables.py"), "summary"], check=True)


if __name__ == "__main__":
    main()
