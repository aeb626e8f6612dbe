#!/usr/bin/env python3
"""The path of a crate's library test binary as `cargo test --workspace`
builds it (built first if it is not), so that a test run with other
environment variables (TESSERA_ISA=portable) takes the same build instead
of compiling the crate again: `cargo test -p CRATE` resolves features over
CRATE alone and rebuilds it and its dependents.

    test_binary.py CRATE   e.g. tessera_kernels
"""

import json
import subprocess
import sys


def lib_test_binaries(cargo_test_args, **kw):
    """The library test binaries `cargo test ARGS --no-run` builds, by crate
    name (`kw` goes to subprocess.run: cwd, env)."""
    out = subprocess.run(["cargo", "test", *cargo_test_args, "--no-run",
                          "--message-format=json"], capture_output=True, text=True, **kw)
    if out.returncode != 0:
        sys.exit(out.stderr[-4000:])
    exes = {}
    for line in out.stdout.splitlines():
        m = json.loads(line)
        if (m.get("reason") == "compiler-artifact" and m.get("executable")
                and m["target"]["kind"] == ["lib"]):
            exes[m["target"]["name"]] = m["executable"]
    return exes


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    name = sys.argv[1].replace("-", "_")
    exe = lib_test_binaries(["--workspace"]).get(name)
    if exe is None:
        sys.exit(f"no library test binary of {name} in the workspace's test build")
    print(exe)


if __name__ == "__main__":
    main()
