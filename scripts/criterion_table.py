#!/usr/bin/env python3
"""The latest criterion results in target/criterion as a Markdown table
(median per iteration; per element, GB/s or GMAC/s where the bench sets a
throughput). With --readme, replaces the README text between the
bench-criterion markers instead of printing; nothing is typed by hand.
Only the benches `cargo bench --bench kv -- --list` names are shown:
target/criterion keeps the results of benches that no longer exist."""
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CRITERION = ROOT / "target" / "criterion"


def fmt(ns: float) -> str:
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns:.3g} ns"


def defined():
    """The full ids of the benches `benches/kv.rs` defines now."""
    out = subprocess.run(["cargo", "bench", "-q", "--bench", "kv", "--", "--list"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return {line.rsplit(": ", 1)[0] for line in out.splitlines() if line.endswith(": benchmark")}


def table():
    rows = []
    names = defined()
    for bench in sorted(CRITERION.glob("*/*/new/benchmark.json")):
        meta = json.loads(bench.read_text())
        if meta["full_id"] not in names:
            continue
        est = json.loads((bench.parent / "estimates.json").read_text())
        median = est["median"]["point_estimate"]
        per = ""
        thr = meta.get("throughput") or {}
        both = thr.get("ElementsAndBytes")
        elements = thr.get("Elements")
        name = meta["full_id"]
        if both:
            # Multiply-adds and bytes (the attention's decode benches).
            per = (f"{both['bytes'] / median:.1f} GB/s, "
                   f"{both['elements'] / median:.1f} GMAC/s")
        elif elements and name.startswith(("matvec", "roofline")):
            per = f"{elements / median:.1f} GMAC/s"
        elif elements:
            per = f"{fmt(median / elements)} per element"
        if thr.get("Bytes"):
            per = f"{thr['Bytes'] / median:.1f} GB/s"
        rows.append((meta["full_id"], fmt(median), per))
    if not rows:
        sys.exit("no criterion results in target/criterion: run `just bench`")
    out = ["| bench | median | |", "|---|---|---|"]
    out += [f"| `{name}` | {median} | {per} |" for name, median, per in rows]
    return out


def main():
    lines = table()
    if "--readme" not in sys.argv:
        print("\n".join(lines))
        return
    sys.path.insert(0, str(ROOT / "scripts"))
    from readme_tables import measured, splice

    head = [f"Criterion medians, {measured()}, `cargo bench --bench kv`.", ""]
    splice("criterion", "criterion_table.py", head + lines)
    print("README.md: criterion table regenerated from target/criterion")


if __name__ == "__main__":
    main()
