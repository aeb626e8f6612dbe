#!/usr/bin/env bash
# Builds llama.cpp's `llama-bench` with its CUDA backend (GGML_CUDA=ON, for
# sm_90 unless CUDA_ARCH says otherwise) into target/llama-cuda/build/bin, on
# a machine with or without a GPU: the baseline of the README's CUDA table,
# run by hand beside `scripts/cuda_device_run.sh` on the GPU machine. One
# static binary; it links against the CUDA 13.0 pip wheels' libraries and,
# on a machine without a driver, the stub libcuda of scripts/check_gpu.py
# (the GPU machine's own libcuda is used at run time). Source: the same
# pinned llama-cpp-python sdist as scripts/build_llama_tools.sh. About 45
# minutes on 2 cores.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VERSION=0.3.36
OUT=$ROOT/target/llama-cuda
ARCH=${CUDA_ARCH:-90}
[ -x "$OUT/build/bin/llama-bench" ] && exit 0
mkdir -p "$OUT"
python3 -m pip install --quiet cmake ninja
# nvcc and the CUDA libraries from the pinned wheels, their unversioned names
# and libcuda (the driver's, or a stub) in target/gpu/lib: check_gpu.py's.
NVCC=$(python3 -c "import sys; sys.path.insert(0, '$ROOT/scripts'); import check_gpu
check_gpu.runtime_env(); print(check_gpu.ensure_nvcc())" | tail -1)
NV=$(dirname "$(dirname "$NVCC")")
# nvcc's own profile looks for its libraries under lib64.
[ -e "$NV/lib64" ] || ln -s lib "$NV/lib64"
LIB=$ROOT/target/gpu/lib
SRC=$OUT/llama_cpp_python-$VERSION
if [ ! -d "$SRC" ]; then
    # The sdist itself (pip download would build its build dependencies).
    url=$(curl -s -H 'Accept: application/vnd.pypi.simple.v1+json' https://pypi.org/simple/llama-cpp-python/ |
        python3 -c "import json, sys; print([f['url'] for f in json.load(sys.stdin)['files'] if f['filename'] == 'llama_cpp_python-$VERSION.tar.gz'][0])")
    curl -sL -o "$OUT/src.tar.gz" "${url%%#*}"
    tar xzf "$OUT/src.tar.gz" -C "$OUT"
fi
export PATH=$NV/bin:$PATH LIBRARY_PATH=$LIB
cmake -S "$SRC/vendor/llama.cpp" -B "$OUT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DCMAKE_CUDA_COMPILER="$NV/bin/nvcc" \
    -DCUDAToolkit_ROOT="$NV" -DCUDA_cuda_driver_LIBRARY="$LIB/libcuda.so" \
    -DCUDA_CUDART="$LIB/libcudart.so" -DCUDA_cudart_LIBRARY="$LIB/libcudart.so" \
    -DCUDA_cublas_LIBRARY="$LIB/libcublas.so" -DCUDA_cublasLt_LIBRARY="$LIB/libcublasLt.so" \
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON >/dev/null
cmake --build "$OUT/build" --target llama-bench -j "$(nproc)"
echo "built $OUT/build/bin/llama-bench"
