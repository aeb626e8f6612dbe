#!/usr/bin/env bash
# One call on a lent GPU, prepared here: kernel settings against each other
# on generated models beside llama.cpp's CUDA llama-bench, the CUDA
# forward's tests under each, memcheck of the split-row products, and ncu's
# time of each kernel of a 135M decode step. Everything it writes comes
# back as ONE file, $OUT/run.tgz (a call brings back at most eight files).
#
# Prepare the folder (an ignored path, carried whole: 64 MiB a call) with
#   python3 scripts/check_gpu.py lent [DIR]     # default target/lent
# (the bundle, llama.cpp's gguf-py and a tokenizer for the generated
# models, llama.cpp's CUDA llama-bench, this script; it says the size), then
# run(command="cd DIR && VARIANTS='a:VAR=1;b:' bash cuda_lent_call.sh", carry=[DIR])
# and unpack run.tgz into target/bench/gpu-variants/<call>/ for
# `readme_tables.py gpu-variants` (gpu-fusion/ for `gpu-fusion`, gpu-forward/
# for `gpu-forward`).
set -u
D=$(cd "$(dirname "$0")" && pwd)
R=$OUT/run
mkdir -p "$R"
start=$(date +%s)
for lib in libcudart.so.13 libcublas.so.13 libcurand.so.10 libnvrtc.so.13; do
    dir=$(ldconfig -p | awk -v l="$lib" '$1 == l {print $NF; exit}' | xargs -r dirname)
    [ -n "$dir" ] || dir=$(find / -xdev -name "$lib" -not -path '/proc/*' 2>/dev/null | head -1 | xargs -r dirname)
    [ -n "$dir" ] && export LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}"
done
# Without llama-bench.xz in the folder, no llama.cpp runs.
[ -x "$D/llama-bench" ] || [ ! -e "$D/llama-bench.xz" ] ||
    { xz -d -k "$D/llama-bench.xz" && chmod +x "$D/llama-bench"; }
LB=
[ -x "$D/llama-bench" ] && LB=$D/llama-bench
# RUN_S: the most seconds the tests and benches may take (default 420),
# so that what they wrote still comes back within the call's limit.
OUT=$R SYNTH=$D/synth LLAMA_BENCH=$LB QUICK=1 FORWARDS="${FORWARDS:-cuda reference}" \
    ROUNDS=${ROUNDS:-1} VARIANT_ALL=${VARIANT_ALL:-1} VARIANTS="${VARIANTS:-}" \
    timeout "${RUN_S:-420}" bash "$D/bundle/cuda_device_run.sh" "$D/bundle"
echo "script rc $? after $(( $(date +%s) - start )) s" | tee -a "$R/tests.log"
# MEMCHECK: the warps-per-row settings to run memcheck under ("auto": the
# launcher's choice), default all three.
if command -v compute-sanitizer >/dev/null; then
    for w in ${MEMCHECK:-1 2 4}; do
        [ "$w" = auto ] && warps= || warps=$w
        TESSERA_REQUIRE_GPU=1 TESSERA_CUDA_ROW_WARPS=$warps timeout 90 compute-sanitizer --tool memcheck \
            --error-exitcode 1 "$D/bundle/model-tests" cuda_forward_decodes_sequences_together_as_alone \
            2>&1 | tail -8 >"$R/memcheck-w$w.txt"
    done
fi
if command -v ncu >/dev/null && [ $(( $(date +%s) - start )) -lt "${NCU_BEFORE_S:-420}" ]; then
    mkdir -p "$D/m"
    # NCU_MODEL: the generated model whose decode step ncu times (size and
    # format), default SmolLM2-135M's layout in Q4_1.
    set -- ${NCU_MODEL:-135m Q4_1}
    python3 "$D/bundle/synth_model.py" "$1" --blocks "$2" --tokenizer-json "$D/synth/tok.json.gz" \
        --gguf-py "$D/synth/gguf-py" --out-dir "$D/m" >/dev/null 2>&1
    m=$(ls "$D"/m/*.gguf | head -1)
    TESSERA_REQUIRE_GPU=1 timeout 90 ncu --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum --print-summary per-kernel --launch-skip 3000 -c 900 \
        "$D/bundle/tessera" --device cuda bench --model "$m" --scenario decode --runs 1 --no-baseline \
        >"$R/ncu-decode-$1-$2.txt" 2>&1
fi
tar czf "$OUT/run.tgz" -C "$OUT" run && rm -rf "$R"
echo "all done after $(( $(date +%s) - start )) s"
