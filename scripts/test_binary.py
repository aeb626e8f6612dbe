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


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    name = sys.argv[1].replace("-", "_")
    out = subprocess.run(["cargo", "test", "--workspace", "--no-run", "--message-format=json"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(out.stderr[-4000:])
    for line in out.stdout.splitlines():
        m = json.loads(line)
        if (m.get("reason") == "compiler-artifact" and m["target"]["name"] == name
                and "lib" in m["target"]["kind"] and m["profile"]["test"] and m.get("executable")):
            print(m["executable"])
            return
    sys.exit(f"no library test binary of {name} in the workspace's test build")


if __name__ == "__main__":
    main()
