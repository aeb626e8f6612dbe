#!/bin/sh
# Builds llama.cpp's own `llama-server` and `llama-perplexity` into
# target/llama-server/build/bin (the baselines of `just bench-server` and
# `just bench-perplexity`).
#
# The llama-cpp-sys-2 crate ships llama.cpp without tools/server, so the
# source comes from the sdist of the llama-cpp-python package on PyPI (a
# package registry), which vendors the whole llama.cpp tree; pinned so
# that every run measures the same llama.cpp. Built with GGML_NATIVE, as
# the library for `just bench-llamacpp` is. Does nothing when built.
set -eu
VERSION=0.3.36
OUT=target/llama-server
BIN=$OUT/build/bin
[ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-perplexity" ] && exit 0
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
cmake -S "$SRC/vendor/llama.cpp" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
cmake --build "$OUT/build" --target llama-server llama-perplexity -j "$(nproc)"
echo "built $BIN/llama-server and $BIN/llama-perplexity"
