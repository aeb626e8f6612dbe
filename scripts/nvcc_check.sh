#!/bin/sh
# nvcc for a type-check alone (`cargo check` with the `cuda` features, in
# scripts/check_gpu.py's check_launchers): asked to compile or archive
# (`-c`, `-ptx`/`--ptx`, `--lib`), it writes empty outputs where the real
# nvcc would write objects, PTX or a library, and exits; anything else
# (`--version`, `--list-gpu-code`) goes to the real nvcc, TESSERA_REAL_NVCC.
#
# A type-check reads no kernel: build scripts embed their PTX as strings
# and nothing is linked. candle-kernels' build script compiles some sixty
# CUDA files for it all the same, most of a cold check's time on two cores.
# Tessera's own kernels are compiled and put through ptxas by the real nvcc
# in check_gpu.py's check_cuda, and the `bundle` and `test-cuda` builds use
# the real nvcc throughout.
set -eu
real=${TESSERA_REAL_NVCC:?set TESSERA_REAL_NVCC to the real nvcc}
mode=""
out=""
dir=""
prev=""
last=""
for a in "$@"; do
    case "$prev" in
        -o | --output-file) out=$a ;;
        -odir | --output-directory) dir=$a ;;
    esac
    case "$a" in
        -c | --compile) mode=obj ;;
        -ptx | --ptx) mode=ptx ;;
        -lib | --lib) mode=lib ;;
    esac
    prev=$a
    last=$a
done
if [ -z "$mode" ]; then
    exec "$real" "$@"
fi
if [ -z "$out" ]; then
    # One source and an output directory (cudaforge's PTX builds): the
    # output is named after the source.
    stem=$(basename "$last")
    stem=${stem%.*}
    case "$mode" in
        ptx) out=${dir:-.}/$stem.ptx ;;
        obj) out=${dir:-.}/$stem.o ;;
        lib) out=${dir:-.}/$stem.a ;;
    esac
fi
mkdir -p "$(dirname "$out")"
: >"$out"
