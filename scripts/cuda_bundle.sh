#!/usr/bin/env bash
# Builds, on a machine without a GPU, what `scripts/cuda_device_run.sh` runs
# on one that has a GPU but no Rust toolchain: the `cuda` feature's kernel
# tests, the model crate's tests and the `tessera` binary (release profile,
# target/cuda, CUDA_COMPUTE_CAP=80 unless set: PTX that the driver compiles
# for newer GPUs), stripped, in BUNDLE_DIR (default target/cuda-bundle).
#
# candle's `cuda` feature links against libcuda, which only a GPU driver
# installs: here the link uses a stub with the driver API's names (from
# cudarc's bindings), and the real library is found at run time. The other
# CUDA libraries come from the pinned pip wheels (installed when missing).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUNDLE=${1:-$ROOT/target/cuda-bundle}
python3 -m pip install --quiet "cuda-toolkit[nvcc,cccl,cublas,curand,cudart]==13.0.*"
NV=$(python3 -c 'import nvidia, os; print([p for p in nvidia.__path__ if os.path.isdir(p + "/cu13")][0] + "/cu13")')
LIB=$ROOT/target/gpu/lib
mkdir -p "$LIB"
for f in "$NV"/lib/lib*.so.*; do
    n=$(basename "$f")
    n=${n%%.so*}.so
    [ -e "$LIB/$n" ] || ln -s "$f" "$LIB/$n"
done
if [ ! -e "$LIB/libcuda.so" ]; then
    bindings=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-"$(
        awk '/^name = "cudarc"/ {getline; gsub(/"/, "", $3); print $3}' "$ROOT/Cargo.lock")"/src/driver/sys/mod.rs | head -1)
    grep -oE '^pub unsafe fn cu[A-Za-z0-9_]+' "$bindings" | awk '{print "int " $4 "(void) { return 999; }"}' |
        sort -u >"$LIB/cuda_stub.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$LIB/libcuda.so" "$LIB/cuda_stub.c"
fi
export PATH=$NV/bin:$PATH CUDA_ROOT=$NV CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-80}
export CARGO_TARGET_DIR=$ROOT/target/cuda LIBRARY_PATH=$LIB:$NV/lib
cd "$ROOT"
features=tessera-kernels/cuda,tessera-model/cuda
cargo test --release -p tessera-kernels -p tessera-model --features $features --no-run
exes=$(cargo test --release -p tessera-kernels -p tessera-model --features $features --no-run \
    --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["lib"]:
        print(m["target"]["name"], m["executable"])')
cargo build --release -p tessera --features cuda
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE"
while read -r name exe; do
    case $name in
    tessera_kernels) cp "$exe" "$BUNDLE/kernel-tests" ;;
    tessera_model) cp "$exe" "$BUNDLE/model-tests" ;;
    esac
done <<<"$exes"
cp "$CARGO_TARGET_DIR/release/tessera" "$BUNDLE/tessera"
strip "$BUNDLE"/*
echo "$ROOT" >"$BUNDLE/root.txt"
# The commit the binaries were built from (-dirty: with uncommitted changes).
git -C "$ROOT" describe --always --dirty --abbrev=7 >"$BUNDLE/commit.txt"
cp "$ROOT/scripts/cuda_device_run.sh" "$BUNDLE/"
ls -la "$BUNDLE"
