#!/bin/sh
# Builds llama.cpp's own tools, the baselines of every comparison:
# `llama-server` (`just bench-server`), `llama-perplexity`
# (`just bench-perplexity`), `llama-bench` and `llama-quantize`
# (`just synth-model`, `just bench-cpu`), into target/llama-server/build/bin,
# built native (GGML_NATIVE, the best this CPU runs).
#
# With `avx2` as its argument it builds `llama-bench` a second time into
# target/llama-server/build-avx2/bin with GGML_NATIVE off and AVX2 + FMA +
# F16C on and no AVX-512 or VNNI: the AVX2 row of `just bench-cpu` on a host
# that has more. With `avxvnni`, the same plus AVX-VNNI (256-bit `vpdpbusd`,
# Intel since Alder Lake, AMD since Zen 5) into build-avxvnni: the AVX-VNNI
# row.
#
# With `harness`, `llama-bench` on the llama-cpp-sys-2 crate's llama.cpp
# (the in-process harness's) into target/llama-server/build-harness-VERSION:
# `scripts/harness_check.py` sets the two side by side.
#
# The llama-cpp-sys-2 crate ships llama.cpp without its tools, so the
# source comes from the sdist of the llama-cpp-python package on PyPI (a
# package registry), which vendors the whole llama.cpp tree; pinned so
# that every run measures the same llama.cpp. Does nothing when built.
set -eu
VERSION=0.3.36
OUT=target/llama-server
BIN=$OUT/build/bin
FLAVOUR=${1:-native}
mkdir -p "$OUT"
SRC=$OUT/llama_cpp_python-$VERSION
if [ ! -d "$SRC" ]; then
    # The sdist of this package only: with `--no-binary :all:` pip would
    # also build its build backend's own dependencies (cmake among them)
    # from source just to read its metadata (on 2 cores, still compiling
    # cmake after a quarter of an hour).
    python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python --dest "$OUT" "llama-cpp-python==$VERSION"
    tar xzf "$OUT/llama_cpp_python-$VERSION.tar.gz" -C "$OUT"
fi
command -v cmake >/dev/null || python3 -m pip install --quiet cmake
COMMON="-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON"
if [ "$FLAVOUR" = harness ]; then
    # `llama-bench` on the llama.cpp library that `just bench-llamacpp`'s
    # in-process harness links: the tree the llama-cpp-sys-2 crate ships
    # (the version in Cargo.lock), with the tools' drivers (tools/, app/)
    # from the sdist above, since the crate leaves out their sources. Built
    # native, as the crate builds it under RUSTFLAGS=-C target-cpu=native.
    SYS=$(cargo metadata --format-version 1 --features llama-cpp | python3 -c '
import json, sys
d = json.load(sys.stdin)
p = next(p for p in d["packages"] if p["name"] == "llama-cpp-sys-2")
print(p["manifest_path"].rsplit("/", 1)[0], p["version"])')
    SYSDIR=${SYS% *}
    SYSVER=${SYS##* }
    TREE=$OUT/llama-cpp-sys-2-$SYSVER
    B=$OUT/build-harness-$SYSVER
    [ -x "$B/bin/llama-bench" ] && exit 0
    if [ ! -d "$TREE" ]; then
        rm -rf "$TREE.tmp"
        cp -r "$SYSDIR/llama.cpp" "$TREE.tmp"
        rm -rf "$TREE.tmp/tools" "$TREE.tmp/app"
        cp -r "$SRC/vendor/llama.cpp/tools" "$SRC/vendor/llama.cpp/app" "$TREE.tmp/"
        mv "$TREE.tmp" "$TREE"
    fi
    # shellcheck disable=SC2086
    cmake -S "$TREE" -B "$B" $COMMON -DLLAMA_BUILD_APP=OFF -DGGML_NATIVE=ON >/dev/null
    cmake --build "$B" --target llama-bench -j "$(nproc)"
    echo "built $B/bin/llama-bench (llama-cpp-sys-2 $SYSVER's llama.cpp)"
    exit 0
fi
if [ "$FLAVOUR" = avx2 ] || [ "$FLAVOUR" = avxvnni ]; then
    B=$OUT/build-$FLAVOUR
    [ -x "$B/bin/llama-bench" ] && exit 0
    VNNI=OFF
    [ "$FLAVOUR" = avxvnni ] && VNNI=ON
    # shellcheck disable=SC2086
    cmake -S "$SRC/vendor/llama.cpp" -B "$B" $COMMON -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
        -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF \
        -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=$VNNI >/dev/null
    cmake --build "$B" --target llama-bench -j "$(nproc)"
    echo "built $B/bin/llama-bench ($FLAVOUR, no AVX-512)"
    exit 0
fi
TOOLS="llama-server llama-perplexity llama-bench llama-quantize"
missing=
for t in $TOOLS; do [ -x "$BIN/$t" ] || missing=1; done
[ -z "$missing" ] && exit 0
# shellcheck disable=SC2086
cmake -S "$SRC/vendor/llama.cpp" -B "$OUT/build" $COMMON -DGGML_NATIVE=ON >/dev/null
# shellcheck disable=SC2086
cmake --build "$OUT/build" --target $TOOLS -j "$(nproc)"
echo "built $TOOLS into $BIN"
