#!/bin/sh
# Builds the in-process harness (examples/vs_llamacpp) natively into
# target/native, with its llama.cpp compiled as `llama-bench` is:
#
# - `LLAMA_LIB_PROFILE=Release`: the llama-cpp-sys-2 crate builds llama.cpp
#   as CMake's RelWithDebInfo (-O2) whenever the Rust profile has debug
#   info, and this workspace's release profile keeps line tables. At -O2
#   the harness's llama.cpp decoded the 135M model at 0.52–0.64× of
#   `llama-bench` (-O3) on the same library (2026-12-02); at -O3 within the
#   host's noise of it (2026-12-08).
# - On a CPU with AMX, GCC's dead-store elimination off, as
#   `scripts/build_llama_tools.sh harness` builds that tool: at -O3 GCC 12
#   drops the stores of the AMX tile configuration and the harness dies of
#   a general-protection fault in ggml's AMX kernel.
#
# cmake-rs configures a build directory only once, so a llama.cpp built
# with other settings is cleaned first.
set -eu
NO_DSE=""
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
    NO_DSE="-fno-dse -fno-tree-dse"
fi
for cache in target/native/release/build/llama-cpp-sys-2-*/out/build/CMakeCache.txt; do
    [ -f "$cache" ] || continue
    if ! grep -q '^CMAKE_BUILD_TYPE:STRING=Release$' "$cache" \
        || { [ -n "$NO_DSE" ] && ! grep -q '^CMAKE_CXX_FLAGS:.*-fno-dse -fno-tree-dse' "$cache"; }; then
        echo "llama.cpp in target/native was built with other settings: rebuilding it"
        CARGO_TARGET_DIR=target/native cargo clean --release -p llama-cpp-sys-2
        break
    fi
done
CARGO_TARGET_DIR=target/native RUSTFLAGS="-C target-cpu=native" LLAMA_LIB_PROFILE=Release \
    CFLAGS="$NO_DSE" CXXFLAGS="$NO_DSE" \
    cargo build --release --features llama-cpp --example vs_llamacpp
