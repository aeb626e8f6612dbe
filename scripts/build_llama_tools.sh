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
# With `amx`, `llama-bench` with AVX-512 VNNI and AMX-INT8, compiled by
# clang, into build-amx (the AMX row on a CPU with AMX; see below why not
# the native GCC build); with `avx512`, the same without AMX (GCC) into
# build-avx512 (the AVX-512 row on such a CPU).
#
# With `harness`, `llama-bench` on the llama-cpp-sys-2 crate's llama.cpp
# (the in-process harness's) into target/llama-server/build-harness-VERSION:
# `scripts/harness_check.py` sets the two side by side.
#
# On a CPU with AMX the default native build is compiled by clang with
# AMX-INT8 named, since GCC 12's dies of SIGILL there (see the `amx`
# flavour), and the `harness` one by GCC without dead-store elimination
# (see harness_kept below).
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
# Whether this CPU has AMX-INT8.
amx_cpu() { grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; }
# Configures a native build of the tree $1 into $2 (more cmake arguments
# after them). On a CPU with AMX clang compiles it, with AMX-INT8 named as
# the amx flavour names it, since GCC 12's native builds die of SIGILL
# there (see the amx flavour); a GCC build left in $2 from before is
# configured again from scratch.
native_cmake() {
    src=$1
    build=$2
    shift 2
    native_kept "$build" || rm -rf "$build"
    if amx_cpu; then
        F="-mamx-tile -mamx-int8 -D__AMX_TILE__=1 -D__AMX_INT8__=1"
        set -- "$@" -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
            "-DCMAKE_C_FLAGS=$F" "-DCMAKE_CXX_FLAGS=$F"
    fi
    # shellcheck disable=SC2086
    cmake -S "$src" -B "$build" $COMMON -DGGML_NATIVE=ON "$@" >/dev/null
}
# Whether the native build in $1 is one to keep: on a CPU with AMX, clang's.
native_kept() { ! amx_cpu || grep -q "CMAKE_CXX_COMPILER:.*clang" "$1/CMakeCache.txt" 2>/dev/null; }
# The harness flavour's build instead stays with GCC, as the crate builds
# the harness's library (a like-for-like check), with dead-store
# elimination off on a CPU with AMX: the stores GCC 12 drops are those of
# the tile configuration before `ldtilecfg` (measured 2026-12-02: the
# shared-library build kept only the palette byte and died at its first
# `tileloadd`; with -fno-dse -fno-tree-dse it runs; the crate's static
# build happens to keep them).
NO_DSE="-fno-dse -fno-tree-dse"
harness_kept() { ! amx_cpu || grep -q "CMAKE_CXX_FLAGS:.*-fno-dse" "$1/CMakeCache.txt" 2>/dev/null; }
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
    harness_kept "$B" || rm -rf "$B"
    [ -x "$B/bin/llama-bench" ] && exit 0
    if [ ! -d "$TREE" ]; then
        rm -rf "$TREE.tmp"
        cp -r "$SYSDIR/llama.cpp" "$TREE.tmp"
        rm -rf "$TREE.tmp/tools" "$TREE.tmp/app"
        cp -r "$SRC/vendor/llama.cpp/tools" "$SRC/vendor/llama.cpp/app" "$TREE.tmp/"
        mv "$TREE.tmp" "$TREE"
    fi
    set --
    amx_cpu && set -- "-DCMAKE_C_FLAGS=$NO_DSE" "-DCMAKE_CXX_FLAGS=$NO_DSE"
    # shellcheck disable=SC2086
    cmake -S "$TREE" -B "$B" $COMMON -DLLAMA_BUILD_APP=OFF -DGGML_NATIVE=ON "$@" >/dev/null
    cmake --build "$B" --target llama-bench -j "$(nproc)"
    echo "built $B/bin/llama-bench (llama-cpp-sys-2 $SYSVER's llama.cpp)"
    exit 0
fi
if [ "$FLAVOUR" = amx ] || [ "$FLAVOUR" = avx512 ]; then
    # AVX-512 with VNNI, VBMI and BF16, into build-avx512 without AMX (the
    # AVX-512 VNNI row on a CPU that has AMX), into build-amx with AMX-INT8
    # and compiled by clang (the AMX row). The native GCC build is neither:
    # on such a CPU -march=native turns AMX on, and GCC 12 (Debian 12's)
    # drops the stores that fill the tile configuration on the stack (only
    # the palette byte is written before `ldtilecfg`), so it dies of SIGILL
    # at its first tile instruction; clang 14's -march=native does not turn
    # AMX on for this CPU, hence the features named here, and it names the
    # macro `__AMXINT8__` where ggml tests `__AMX_INT8__` (GCC's name), hence
    # the definitions.
    B=$OUT/build-$FLAVOUR
    [ -x "$B/bin/llama-bench" ] && exit 0
    AMX=OFF
    CC_ARGS=
    if [ "$FLAVOUR" = amx ]; then
        AMX=ON
        CC_ARGS="-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++"
        CC_ARGS="$CC_ARGS -DCMAKE_C_FLAGS=-D__AMX_INT8__=1 -DCMAKE_CXX_FLAGS=-D__AMX_INT8__=1"
    fi
    # shellcheck disable=SC2086
    cmake -S "$SRC/vendor/llama.cpp" -B "$B" $COMMON $CC_ARGS -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
        -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
        -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=$AMX \
        -DGGML_AMX_INT8=$AMX -DGGML_AMX_BF16=OFF >/dev/null
    cmake --build "$B" --target llama-bench -j "$(nproc)"
    echo "built $B/bin/llama-bench ($FLAVOUR)"
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
native_kept "$OUT/build" || missing=1
for t in $TOOLS; do [ -x "$BIN/$t" ] || missing=1; done
[ -z "$missing" ] && exit 0
native_cmake "$SRC/vendor/llama.cpp" "$OUT/build"
# shellcheck disable=SC2086
cmake --build "$OUT/build" --target $TOOLS -j "$(nproc)"
echo "built $TOOLS into $BIN"
