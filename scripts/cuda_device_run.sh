#!/usr/bin/env bash
# Runs a bundle made by `scripts/check_gpu.py bundle` on a machine with an NVIDIA
# GPU and no Rust toolchain: the CUDA kernel tests and the real-model GPU test
# with TESSERA_REQUIRE_GPU=1 (so nothing passes by skipping), the kernel
# tests again under compute-sanitizer (memcheck) where it exists, a chat on
# the GPU that saves and reloads its session and its prefix cache on disk,
# and `tessera bench --device cuda` (each scenario beside its baseline in the
# same run). Everything it prints and measures goes to $OUT (default
# target/gpu-run): tests.log, gpu.jsonl (one bench object a line; with
# q8_0 and q4_0 caches, gpu-q8_0.jsonl and gpu-q4_0.jsonl) and
# meta.json (GPU, driver, date), which `scripts/readme_tables.py gpu` turns
# into the README's GPU table; with PROFILE=1, ncu's per-kernel times too;
# with OLD=<previous tessera>, the two alternating (ab.jsonl).
#
# Without MODEL_GGUF (a lent GPU that the model file cannot reach), only
# the kernel tests, their sanitizer run and the every-family model test on
# tiny generated files.
#
# QUICK=1 (a first look with little device time): no sanitizer runs, one
# round of the generated models' A/B. FORWARDS=cuda leaves the reference
# forward out of that A/B, FORWARDS=none the whole A/B (the models are
# still generated).
#
# VARIANTS="label:VAR=v,VAR=v;label2:..." (with SYNTH): kernel settings
# against each other in one run (BIN=name among them: that binary of the
# bundle instead of `tessera`, a previous build copied in, say);
# VARIANT_SCENARIOS: the bench scenarios each variant runs (default
# "decode decode-long decode-batch"; `prefill` is a 512-token prompt). Each variant's environment first runs the
# CUDA forward's format test (so a variant that is wrong fails here), then
# on the generated models decode, and on the first one decode after 2,048
# tokens and 8 sequences together too (with VARIANT_ALL=1 on every one),
# the variants alternating for ROUNDS rounds (default 2), into
# variants.jsonl (a {"model", "variant", "round"} line before each result).
#
# Usage: cuda_device_run.sh BUNDLE_DIR [MODEL_GGUF]
set -uo pipefail
B=$(cd "$1" && pwd)
# The bundle's binaries come xz-compressed (check_gpu.py bundle).
for f in "$B"/*.xz; do
    [ -e "$f" ] || continue
    [ -e "${f%.xz}" ] || { xz -d -k "$f" && chmod +x "${f%.xz}"; }
done
MODEL=$(realpath "${2:-}" 2>/dev/null || true)
[ -n "${2:-}" ] && [ -f "$MODEL" ] || MODEL=
OUT=${OUT:-target/gpu-run}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/tests.log
: >"$LOG"
fail=0

# The CUDA libraries the binaries link against (libcublas.so.13 and the rest),
# from wherever this machine has them (a CUDA install or pip's wheels).
for lib in libcudart.so.13 libcublas.so.13 libcurand.so.10 libnvrtc.so.13; do
    dir=$(ldconfig -p | awk -v l="$lib" '$1 == l {print $NF; exit}' | xargs -r dirname)
    [ -n "$dir" ] || dir=$(find / -xdev -name "$lib" -not -path '/proc/*' 2>/dev/null | head -1 | xargs -r dirname)
    [ -n "$dir" ] && export LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}"
done
export TESSERA_REQUIRE_GPU=1

step() {
    # A bundle without a test binary (one cut to what a lent machine takes
    # beside llama.cpp's) runs the rest.
    local a
    for a in "$@"; do
        case "$a" in
            "$B"/*) [ -x "$a" ] || { echo "=== $a not in the bundle: skipped" | tee -a "$LOG"; return; } ;;
        esac
    done
    echo "=== $*" | tee -a "$LOG"
    timeout 300 "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "=== rc $rc" | tee -a "$LOG"
    [ "$rc" = 0 ] || fail=1
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"
python3 - "$OUT/meta.json" "$(cat "$B/commit.txt")" <<'EOF'
import datetime, json, subprocess, sys
q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                    "--format=csv,noheader"], capture_output=True, text=True).stdout
name, driver, mem = [s.strip() for s in q.splitlines()[0].split(",")]
json.dump({"gpu": name, "driver": driver, "memory": mem, "date": str(datetime.date.today()),
           "commit": sys.argv[2]},
          open(sys.argv[1], "w"))
EOF

# Speed on generated models (SYNTH=<folder with gguf-py/ and tok.json.gz>):
# random quantized blocks of SmolLM2-135M's layout in Q4_1 and of a 1B Llama
# in Q4_0 and Q4_K_M, written here by synth_model.py --blocks (no model file
# needs to travel), then Tessera's CUDA forward and the reference forward
# (TESSERA_FORWARD=reference) of the same binary alternating, two rounds of
# decode, decode after 2,048 tokens and decode-batch, each result a line
# of synth.jsonl after a {"model", "forward", "round"} line; with
# LLAMA_BENCH=<llama-bench built for CUDA>, llama.cpp on the same files
# (flash attention, every layer on the GPU) into llama.jsonl.
synth_ab() {
    [ -n "${SYNTH:-}" ] || return 0
    local dir
    dir=$(mktemp -d)
    : >"$OUT/synth.jsonl"
    for spec in "135m Q4_1" "1b Q4_0" "1b Q4_K_M"; do
        set -- $spec
        echo "=== generating $1 $2" | tee -a "$LOG"
        python3 "$B/synth_model.py" "$1" --blocks "$2" --tokenizer-json "$SYNTH/tok.json.gz" \
            --gguf-py "$SYNTH/gguf-py" --out-dir "$dir" >>"$LOG" 2>&1 || { fail=1; continue; }
    done
    SYNTH_DIR=$dir
    local rounds="1 2"
    [ "${QUICK:-0}" = 1 ] && rounds=1
    for round in $rounds; do
        for m in "$dir"/*.gguf; do
            for fwd in ${FORWARDS:-cuda reference}; do
                [ "$fwd" = none ] && continue
                for sc in decode decode-long decode-batch; do
                    [ "$round" = 2 ] && [ "$sc" != decode ] && continue
                    echo "{\"model\": \"$(basename "$m")\", \"forward\": \"$fwd\", \"round\": $round}" >>"$OUT/synth.jsonl"
                    TESSERA_FORWARD=$fwd timeout 120 "$B/tessera" --device cuda bench --model "$m" --json \
                        --no-baseline --scenario "$sc" --runs 3 2>>"$LOG" >>"$OUT/synth.jsonl" || fail=1
                done
            done
        done
    done
    if [ -n "${LLAMA_BENCH:-}" ]; then
        : >"$OUT/llama.jsonl"
        for m in "$dir"/*.gguf; do
            timeout 120 "$LLAMA_BENCH" -m "$m" -ngl 99 -fa on -p 512 -n 128 -r 3 -o jsonl \
                >>"$OUT/llama.jsonl" 2>>"$LOG" || fail=1
            timeout 120 "$LLAMA_BENCH" -m "$m" -ngl 99 -fa on -p 0 -n 128 -d 2048 -r 3 -o jsonl \
                >>"$OUT/llama.jsonl" 2>>"$LOG" || fail=1
        done
    fi
}

# A variant's settings: VAR=v pairs for the environment, and BIN=name for
# a binary of the bundle other than `tessera` (a previous build, say).
bin_of() {
    local e
    for e in ${1//,/ }; do
        case $e in BIN=*) echo "$B/${e#BIN=}"; return ;; esac
    done
    echo "$B/tessera"
}
envs_of() {
    local e out=
    for e in ${1//,/ }; do
        case $e in BIN=*) ;; *) out="$out $e" ;; esac
    done
    echo $out
}

variants_ab() {
    [ -n "${VARIANTS:-}" ] && [ -n "${SYNTH_DIR:-}" ] || return 0
    local v label envs bin round m n sc
    IFS=';' read -ra vs <<<"$VARIANTS"
    for v in "${vs[@]}"; do
        label=${v%%:*}
        envs=${v#*:}
        echo "=== variant $label: $envs" | tee -a "$LOG"
        step env $(envs_of "$envs") "$B/model-tests" cuda_forward_follows_the_cpu_reference_in_every_format \
            --nocapture
    done
    : >"$OUT/variants.jsonl"
    for round in $(seq 1 "${ROUNDS:-2}"); do
        n=0
        for m in "$SYNTH_DIR"/*.gguf; do
            n=$((n + 1))
            for v in "${vs[@]}"; do
                label=${v%%:*}
                envs=${v#*:}
                bin=$(bin_of "$envs")
                for sc in ${VARIANT_SCENARIOS:-decode decode-long decode-batch}; do
                    [ "$sc" != decode ] && [ "$n" -gt 1 ] && [ "${VARIANT_ALL:-0}" != 1 ] && continue
                    echo "{\"model\": \"$(basename "$m")\", \"variant\": \"$label\", \"round\": $round}" >>"$OUT/variants.jsonl"
                    env $(envs_of "$envs") timeout 120 "$bin" --device cuda bench --model "$m" --json \
                        --no-baseline --scenario "$sc" --runs 3 2>>"$LOG" >>"$OUT/variants.jsonl" || fail=1
                done
            done
        done
    done
}

step "$B/kernel-tests" gpu:: --test-threads 1
if [ "${QUICK:-0}" != 1 ] && command -v compute-sanitizer >/dev/null; then
    step compute-sanitizer --tool memcheck --error-exitcode 1 "$B/kernel-tests" gpu:: --test-threads 1
fi
step "$B/model-tests" gpu_forward_follows_the_cpu_reference_on_every_family --nocapture
step "$B/model-tests" cuda_forward_ --nocapture --test-threads 1
if [ "${QUICK:-0}" != 1 ] && command -v compute-sanitizer >/dev/null; then
    step compute-sanitizer --tool memcheck --error-exitcode 1 "$B/model-tests" cuda_forward_ \
        --test-threads 1
fi
synth_ab
variants_ab
if [ -z "$MODEL" ]; then
    echo "=== no model file: the steps with the real model are skipped" | tee -a "$LOG"
    echo "=== done, fail=$fail" | tee -a "$LOG"
    exit $fail
fi
# The model test finds the model where it was compiled to look: the
# repository's models/ at the path the bundle was built in.
want=$(cat "$B/root.txt")/models
mkdir -p "$want"
[ -e "$want/SmolLM2-135M-Instruct.Q4_1.gguf" ] || ln -sf "$MODEL" "$want/SmolLM2-135M-Instruct.Q4_1.gguf"
step "$B/model-tests" gpu_forward_follows_the_cpu_reference_on_the_real_model --nocapture

T=$B/tessera
work=$(mktemp -d)
cat >"$work/chat.jsonl" <<'EOF'
{"user": "Name three rivers in Europe."}
{"cmd": "/save SESSION"}
{"user": "Which of them is the longest?"}
{"cmd": "/load SESSION"}
{"user": "Which of them is the longest?"}
{"cmd": "/stats"}
EOF
sed -i "s#SESSION#$work/session.bin#" "$work/chat.jsonl"
# Twice over one --cache-dir: the second process starts from the prefixes
# the first left on disk.
for i in 1 2; do
    step "$T" --device cuda chat --model "$MODEL" --temperature 0 --max-tokens 24 \
        --cache-dir "$work/cache" --script "$work/chat.jsonl" --json
done

J=$OUT/gpu.jsonl
: >"$J"
bench() {
    echo "=== bench $*" | tee -a "$LOG"
    timeout 150 "$T" --device cuda bench --model "$MODEL" --json "$@" 2>>"$LOG" | tee -a "$J"
    [ "${PIPESTATUS[0]}" = 0 ] || { echo "=== bench failed" | tee -a "$LOG"; fail=1; }
}
bench --scenario prefill --runs 5
bench --scenario decode --runs 5
bench --scenario chat
bench --scenario shared-prefix
bench --scenario decode-long --runs 3
bench --scenario decode-batch --runs 3
bench --scenario shift
# Quantized caches (q8_0, q4_0): decode deep in a context over the blocks
# read in place, and context shifts that rotate them; each type's lines in
# gpu-TYPE.jsonl (gpu.jsonl keeps the f16 cache's).
for kv in q8_0 q4_0; do
    J=$OUT/gpu-$kv.jsonl
    : >"$J"
    bench --scenario decode-long --runs 3 --cache-dtype $kv
    bench --scenario shift --cache-dtype $kv
done
J=$OUT/gpu.jsonl
# Defragmentation, sessions, pool resizes, context shifts and injected step
# faults on the GPU's K/V.
bench --scenario soak --requests 300
# Where the GPU time goes (PROFILE=1, where ncu exists): every kernel's time
# over one 512-token prefill, and over about two decode steps.
if [ "${PROFILE:-0}" = 1 ] && command -v ncu >/dev/null; then
    N="ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel"
    timeout 150 $N -c 1500 "$T" --device cuda bench --model "$MODEL" --scenario prefill --runs 1 \
        --no-baseline >"$OUT/ncu-prefill.txt" 2>&1 || fail=1
    timeout 150 $N --launch-skip 1500 -c 1000 "$T" --device cuda bench --model "$MODEL" \
        --scenario decode --runs 1 --no-baseline >"$OUT/ncu-decode.txt" 2>&1 || fail=1
fi
# A change against the binary before it (OLD=path to that `tessera`): both
# alternating, three rounds of decode, prefill and 8 sequences decoding
# together, into ab.jsonl (a {"bin": "old"|"new"} line before each result),
# which `scripts/readme_tables.py gpu-ab` reads.
if [ -n "${OLD:-}" ]; then
    : >"$OUT/ab.jsonl"
    for round in 1 2 3; do
        for side in old new; do
            bin=$T
            [ "$side" = old ] && bin=$OLD
            for sc in decode prefill decode-batch; do
                echo "{\"bin\": \"$side\", \"round\": $round}" >>"$OUT/ab.jsonl"
                timeout 60 "$bin" --device cuda bench --model "$MODEL" --json --scenario "$sc" \
                    --runs 3 --no-baseline 2>>"$LOG" >>"$OUT/ab.jsonl" || fail=1
            done
        done
    done
fi
echo "=== done, fail=$fail" | tee -a "$LOG"
exit $fail
