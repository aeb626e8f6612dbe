# Tessera task runner. Each recipe is one obvious command.

default:
    @just --list

# Fetch the default model (SmolLM2-135M-Instruct Q4_1) into models/ if missing.
model name="":
    python3 scripts/fetch_model.py {{name}}

# Fetch the model, build, and run a scripted 10-turn chat printing per-turn cache statistics.
demo: model
    cargo build --release -p tessera
    ./target/release/tessera chat --model models/SmolLM2-135M-Instruct.Q4_1.gguf --script demo/chat.jsonl --temperature 0 --max-tokens 48

# Run every test of the workspace (fetches the default model and Gemma 3 first), then `tessera serve`
# driven by the official `openai` Python package (200 structured outputs checked with `jsonschema`
# among its checks), a KV events subscriber decoding vLLM's event types (`pyzmq`, `msgspec`), and two replicas behind the SGLang model
# gateway (`openai` and `sglang-router` installed with pip when missing).
test: model
    python3 scripts/fetch_model.py gemma3
    cargo test --workspace
    python3 -c "import openai" 2>/dev/null || python3 -m pip install --quiet openai
    python3 scripts/openai_client.py target/debug/tessera models/SmolLM2-135M-Instruct.Q4_1.gguf
    python3 -c "import jsonschema" 2>/dev/null || python3 -m pip install --quiet jsonschema
    python3 scripts/structured_client.py target/debug/tessera models/SmolLM2-135M-Instruct.Q4_1.gguf 200
    python3 -c "import zmq, msgspec" 2>/dev/null || python3 -m pip install --quiet pyzmq msgspec
    python3 scripts/kv_events_client.py target/debug/tessera models/SmolLM2-135M-Instruct.Q4_1.gguf
    python3 scripts/router.py test target/debug/tessera models/SmolLM2-135M-Instruct.Q4_1.gguf

# Long fuzzing runs of the loaders and parsers (GGUF, sessions, cache files, tokenizer, templates).
fuzz cases="20000":
    TESSERA_FUZZ_CASES={{cases}} cargo test -p tessera-model -p tessera-engine -- fuzz

# Other targets and the portable kernel paths: aarch64 builds (cargo check; installs the
# cross C compiler, qemu's user-mode emulator and the Rust target if missing), the kernel
# tests on aarch64 under qemu (a CPU with NEON's dot product: the ARM kernels against the
# scalar references), and the kernel tests with SIMD off (the workspace's test build of them,
# run with TESSERA_ISA=portable: `cargo test -p tessera-kernels` would compile them again).
check-portable:
    command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null || ($(command -v sudo || true) apt-get update && $(command -v sudo || true) apt-get install -y gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)
    rustup target list --installed | grep -q aarch64-unknown-linux-gnu || rustup target add aarch64-unknown-linux-gnu
    cargo check --workspace --target aarch64-unknown-linux-gnu
    CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu -cpu max" cargo test -p tessera-kernels --target aarch64-unknown-linux-gnu
    TESSERA_ISA=portable "$(python3 scripts/test_binary.py tessera_kernels)"

# What a machine without a GPU can check of the GPU kernels: every .cu through nvcc and ptxas for
# sm_80 and sm_90 (installs the pinned CUDA 13.0 nvcc wheels when missing), every .metal through
# clang -fsyntax-only against our metal_stdlib shim, and the kernel-emu tests (the shared kernel
# source, and the CUDA-only and Metal-only kernels under a fiber emulator, compiled for the CPU
# against the slow references), then the CUDA launchers type-checked
# (target/cuda-check, with scripts/nvcc_check.sh standing in for nvcc: nothing there runs a kernel) and
# the Metal ones through clippy for aarch64-apple-darwin (target/metal).
check-gpu:
    command -v clang++ >/dev/null || ($(command -v sudo || true) apt-get update && $(command -v sudo || true) apt-get install -y clang)
    python3 scripts/check_gpu.py

# On a machine with an NVIDIA GPU: the CUDA kernels against the CPU slow references, then the real
# model on the GPU against the CPU reference forward (installs the pinned CUDA 13.0 wheels when
# missing). TESSERA_REQUIRE_GPU=1: no test passes by skipping.
test-cuda:
    python3 scripts/check_gpu.py test-cuda

# On a Mac: the Metal kernels against the CPU slow references, then the real model on the GPU
# against the CPU reference forward, with TESSERA_REQUIRE_GPU=1.
test-metal:
    python3 scripts/check_gpu.py test-metal

# Criterion benches of the KV bookkeeping, the attention kernel and the quantized linear layers (beside the read and FMA rooflines); writes its table in docs/benchmarks.md.
bench:
    cargo bench --bench kv
    python3 scripts/readme_tables.py criterion

# Prefill and decode speed of Tessera beside candle's quantized_llama (same run), decode deep in a
# context and with 4 and 8 sequences beside one (same run), the integer activation modes' agreement
# with f32 activations, then the tables in docs/.
bench-model: model
    cargo build --release -p tessera --features candle-baseline
    mkdir -p target/bench
    ./target/release/tessera bench --model models/SmolLM2-135M-Instruct.Q4_1.gguf --scenario prefill --runs 5 --json | tee target/bench/model.jsonl
    ./target/release/tessera bench --model models/SmolLM2-135M-Instruct.Q4_1.gguf --scenario decode --runs 3 --json | tee -a target/bench/model.jsonl
    ./target/release/tessera bench --model models/SmolLM2-135M-Instruct.Q4_1.gguf --scenario decode-long --runs 9 --json | tee -a target/bench/model.jsonl
    ./target/release/tessera bench --model models/SmolLM2-135M-Instruct.Q4_1.gguf --scenario decode-batch --runs 9 --json | tee -a target/bench/model.jsonl
    ./target/release/tessera bench --model models/SmolLM2-135M-Instruct.Q4_1.gguf --scenario fidelity --json | tee -a target/bench/model.jsonl
    python3 scripts/readme_tables.py model

# The default build (instruction sets chosen at run time) beside one built for this CPU
# (`-C target-cpu=native`, in target/native), prefill and decode alternating on the default model and
# a generated 1B-class one, each instruction set this host has forced in both; then its table in docs/.
bench-portable: model (synth-model "1b" "Q4_K_M")
    cargo build --release -p tessera
    CARGO_TARGET_DIR=target/native RUSTFLAGS="-C target-cpu=native" cargo build --release -p tessera
    python3 scripts/portable_vs_native.py
    CARGO_TARGET_DIR=target/x86-64-v3 RUSTFLAGS="-C target-cpu=x86-64-v3" cargo build --release -p tessera
    python3 scripts/portable_vs_native.py --against x86-64-v3 --isas avx2
    CARGO_TARGET_DIR=target/x86-64-v3-vnni RUSTFLAGS="-C target-cpu=x86-64-v3 -C target-feature=+avxvnni" cargo build --release -p tessera
    python3 scripts/portable_vs_native.py --against x86-64-v3-vnni --isas avxvnni

# The KV-cache scenarios: chat TTFT with and without reuse, shared prefix, interleaved conversations, context shift; then the tables in docs/.
bench-engine: model
    cargo build --release -p tessera
    mkdir -p target/bench
    rm -f target/bench/engine.jsonl
    for s in chat shared-prefix interleaved shift; do ./target/release/tessera bench --model models/SmolLM2-135M-Instruct.Q4_1.gguf --scenario $s --runs 3 --json | tee -a target/bench/engine.jsonl; done
    python3 scripts/readme_tables.py engine

# The disk tier below the pool: 8 conversations taking turns on a pool a third of their working set,
# the pool alone beside the pool with its disk tier (target/bench/tiers.jsonl, then its table in docs/).
bench-tiers: model
    cargo build --release -p tessera
    mkdir -p target/bench
    python3 scripts/fetch_model.py gemma3
    ./target/release/tessera bench --model models/SmolLM2-135M-Instruct.Q4_1.gguf --scenario tiers --json | tee target/bench/tiers.jsonl
    ./target/release/tessera bench --model models/gemma-3-270m-q4_k_m.gguf --scenario tiers --json | tee -a target/bench/tiers.jsonl
    python3 scripts/readme_tables.py tiers

# Gemma 3's sliding-window layers on their own pool: an 8,192-token request on the smallest pool beside
# full attention's memory, and a 12-turn conversation's cache hits (target/bench/swa.json, then its table in docs/).
bench-swa: (model "gemma3")
    cargo build --release -p tessera
    mkdir -p target/bench
    ./target/release/tessera bench --model models/gemma-3-270m-q4_k_m.gguf --scenario sliding-window --runs 3 --json | tee target/bench/swa.jsonl
    python3 scripts/readme_tables.py swa

# The KV cache types (f16, q8_0, q4_0) in the same run: tokens per MiB, decode speed, and perplexity
# beside llama.cpp's llama-perplexity with the same cache type; then its table in docs/.
bench-kv-types: model bench-deps
    sh scripts/build_llama_tools.sh
    CARGO_TARGET_DIR=target/native RUSTFLAGS="-C target-cpu=native" cargo build --release -p tessera
    python3 scripts/kv_types.py

# SelfExtend past the default model's trained context: perplexity at 16,384 tokens with and without
# it, beside llama.cpp's llama-perplexity (which has none); then its table in docs/.
bench-self-extend: model bench-deps
    sh scripts/build_llama_tools.sh
    CARGO_TARGET_DIR=target/native RUSTFLAGS="-C target-cpu=native" cargo build --release -p tessera
    python3 scripts/self_extend.py

# A stream decoding beside a 2,000-token session save (computed as a background request) and
# alone, alternating: its largest and median gaps between tokens; then its table in docs/.
bench-sessions: model
    cargo build --release -p tessera
    mkdir -p target/bench
    ./target/release/tessera bench --model models/SmolLM2-135M-Instruct.Q4_1.gguf --scenario session-save --runs 7 --json | tee target/bench/sessions.jsonl
    python3 scripts/readme_tables.py sessions

# 24 clients that send ~2,000-token prompts and hang up after 0.3 s, then a short request: its TTFT
# beside the idle server's (scripts/hangups.py over HTTP), then its table in docs/.
bench-hangups: model
    cargo build --release -p tessera
    python3 scripts/hangups.py target/release/tessera models/SmolLM2-135M-Instruct.Q4_1.gguf 3
    python3 scripts/readme_tables.py hangups

# 2,000 random requests with injected faults: leaks, errors, RSS (target/bench/soak.json, then the soak table in docs/architecture.md).
bench-soak requests="2000": model
    cargo build --release -p tessera
    mkdir -p target/bench
    ./target/release/tessera bench --model models/SmolLM2-135M-Instruct.Q4_1.gguf --scenario soak --requests {{requests}} --kv-memory 24MiB --json | tee target/bench/soak.json
    python3 scripts/readme_tables.py soak

# Generated GGUFs of a family's tensor layout (random weights, SmolLM2's tokenizer), quantized by
# llama.cpp's llama-quantize: models/synth-<model>-<FORMAT>.gguf. A model is ARCH-SIZE (qwen3-0.6b,
# granite-s, smollm3-s, phi3-s, olmo2-s, llama-135m) or a Llama size alone (1b, 3b: Llama 3.2's layouts, for speed).
synth-model models="1b" formats="Q4_0,Q4_K_M,Q5_K_M,Q6_K,Q8_0": model bench-deps
    sh scripts/build_llama_tools.sh
    python3 -c "import numpy" 2>/dev/null || python3 -m pip install --quiet numpy
    python3 scripts/synth_model.py {{models}} --formats {{formats}}

# Speculative decoding with a draft model, where no real pair of one tokenizer is reachable: SmolLM2-135M
# drafting for a 240-layer model grown from it (scripts/grow_model.py: its 30 layers, each followed by 7
# generated ones whose output projections have std STD; the larger STD, the less the two agree), with and
# without (`tessera bench --scenario spec`), then beside llama-server -md on the same pair.
bench-spec-draft std="0.006" runs="3": model bench-deps
    sh scripts/build_llama_tools.sh
    python3 -c "import gguf" 2>/dev/null || python3 -m pip install --quiet gguf numpy
    test -f models/grown-smollm2-x8-std{{std}}.Q4_1.gguf || python3 scripts/grow_model.py models/SmolLM2-135M-Instruct.Q4_1.gguf models/grown-smollm2-x8-std{{std}}.Q4_1.gguf --extra 7 --std {{std}}
    cargo build --release -p tessera
    mkdir -p target/bench
    ./target/release/tessera bench --model models/grown-smollm2-x8-std{{std}}.Q4_1.gguf --model-draft models/SmolLM2-135M-Instruct.Q4_1.gguf --scenario spec --runs {{runs}} --json | tee target/bench/spec-draft-std{{std}}.json
    python3 scripts/spec_vs_llamacpp.py --model models/grown-smollm2-x8-std{{std}}.Q4_1.gguf --model-draft models/SmolLM2-135M-Instruct.Q4_1.gguf --runs {{runs}}

# Tessera beside llama.cpp's own llama-bench (standalone; native, and built for AVX2 and AVX-VNNI alone) at real
# sizes on each instruction set this host has, TESSERA_ISA forced to match, alternating, with the
# host's read bandwidth in the same run; then the table in docs/benchmarks.md (target/bench/cpu.json; on a CPU
# with AVX2 alone, its own rows in target/bench/cpu-avx2.json and their own table; on one with AVX-512 VNNI
# but no AVX-VNNI, such as Zen 4, in target/bench/cpu-avx512.json and theirs).
bench-cpu models="SmolLM2-135M-Instruct.Q4_1,synth-1b-Q4_0,synth-1b-Q4_K_M,synth-3b-Q4_0,synth-3b-Q4_K_M" runs="3": (synth-model "1b 3b" "Q4_0,Q4_K_M")
    sh scripts/build_llama_tools.sh avx2
    if grep -q avx_vnni /proc/cpuinfo; then sh scripts/build_llama_tools.sh avxvnni; fi
    if grep -q amx_int8 /proc/cpuinfo; then sh scripts/build_llama_tools.sh amx && sh scripts/build_llama_tools.sh avx512; fi
    cargo build --release -p tessera
    python3 scripts/bench_cpu.py --models {{models}} --runs {{runs}} --int8 --contention SmolLM2-135M-Instruct.Q4_1,synth-1b-Q4_0

# On a CPU with AMX-INT8 (Xeon since Sapphire Rapids): the AMX and AVX-512 VNNI rows alone, Tessera's
# AMX tiles beside llama.cpp's (built with AMX by clang) and both engines without AMX, into target/bench/cpu-amx.json
# and its table in docs/benchmarks.md.
bench-cpu-amx models="SmolLM2-135M-Instruct.Q4_1,synth-1b-Q4_0,synth-1b-Q4_K_M" runs="3": bench-deps (synth-model "1b" "Q4_0,Q4_K_M")
    grep -q amx_int8 /proc/cpuinfo || (echo "this CPU has no AMX-INT8" && exit 1)
    sh scripts/build_llama_tools.sh amx
    sh scripts/build_llama_tools.sh avx512
    cargo build --release -p tessera
    python3 scripts/bench_cpu.py --models {{models}} --isas amx,avx512 --runs {{runs}} --int8 --out cpu-amx.json

# The 256-bit rows alone (AVX-VNNI where this CPU has it, and AVX2), both engines forced down to them, into
# target/bench/cpu-256.json and their own table in docs/benchmarks.md: on a wider CPU (AVX-512, AMX) whose
# main table (`bench-cpu`) is another host's, the rows a laptop's instruction sets get.
bench-cpu-256 models="SmolLM2-135M-Instruct.Q4_1,synth-1b-Q4_0,synth-1b-Q4_K_M" runs="3": bench-deps (synth-model "1b" "Q4_0,Q4_K_M")
    sh scripts/build_llama_tools.sh avx2
    if grep -q avx_vnni /proc/cpuinfo; then sh scripts/build_llama_tools.sh avxvnni; fi
    cargo build --release -p tessera
    python3 scripts/bench_cpu.py --models {{models}} --isas $(grep -q avx_vnni /proc/cpuinfo && echo avxvnni,avx2 || echo avx2) --runs {{runs}} --int8 --out cpu-256.json

# More formats of the generated 1B-class model beside llama-bench (as `bench-cpu`, each run's own
# roofline), merged into target/bench/cpu.json and the table in docs/benchmarks.md.
bench-cpu-formats formats="Q5_K_M,Q6_K,Q8_0" runs="3": (synth-model "1b" formats)
    sh scripts/build_llama_tools.sh avx2
    if grep -q avx_vnni /proc/cpuinfo; then sh scripts/build_llama_tools.sh avxvnni; fi
    cargo build --release -p tessera
    python3 scripts/bench_cpu.py --models $(echo {{formats}} | sed 's/\([^,]*\)/synth-1b-\1/g') --runs {{runs}} --int8 --merge

# Tessera beside llama.cpp and candle on the default model (same file, same threads, same run):
# a table, target/bench/vs-llamacpp.json, two charts, then the results section of docs/benchmarks.md;
# then the harness's llama.cpp beside `llama-bench` built from the same library (harness_check.py);
# then the server beside llama-server (`bench-server`), the router (`bench-router`) and
# perplexity (`bench-perplexity`).
# llama.cpp and Tessera are built with the native CPU flags, in target/native, llama.cpp at -O3 as
# llama-bench is (scripts/build_harness.sh says why).
bench-llamacpp: model bench-deps
    sh scripts/build_harness.sh
    target/native/release/examples/vs_llamacpp
    python3 scripts/readme_tables.py llamacpp
    sh scripts/build_llama_tools.sh harness
    python3 scripts/harness_check.py --runs 4
    just bench-server
    just bench-router
    just bench-perplexity

# Tessera's server beside llama.cpp's own llama-server (built from source once, in
# target/llama-server): 8 users × 8-turn chats at once over HTTP, alternating runs; then the
# table in docs/benchmarks.md (target/bench/server.json).
bench-server: model bench-deps
    sh scripts/build_llama_tools.sh
    CARGO_TARGET_DIR=target/native RUSTFLAGS="-C target-cpu=native" cargo build --release -p tessera
    python3 scripts/server_vs_llamaserver.py

# Scale-out: the server scenario against one replica, and against two behind the SGLang model
# gateway (cache_aware, round_robin) and the KV-event gateway, with room, with pools a third of
# the working set, and with unequal pools; 3 runs per setup; then its table in docs/.
bench-router: model
    cargo build --release -p tessera
    python3 -c "import zmq, msgspec" 2>/dev/null || python3 -m pip install --quiet pyzmq msgspec
    ROUTER_RUNS=3 python3 scripts/router.py bench target/release/tessera models/SmolLM2-135M-Instruct.Q4_1.gguf

# Perplexity of Tessera beside llama.cpp's llama-perplexity (built from source once) on the
# shipped text, for the default model and Gemma 3 when fetched; then its table in docs/.
bench-perplexity: model bench-deps
    sh scripts/build_llama_tools.sh
    CARGO_TARGET_DIR=target/native RUSTFLAGS="-C target-cpu=native" cargo build --release -p tessera
    python3 scripts/perplexity_vs_llamacpp.py

# Each family's arithmetic against llama.cpp's on the same generated files (Llama control, Qwen3,
# Granite, SmolLM3, Phi-3, OLMo 2; F16, Q8_0, Q4_K_M; Phi-3.5's LongRoPE and Phi-4 mini's partial RoPE at a context past the original and at it) and the real models: KL divergence and top-1 agreement of
# tessera perplexity against llama-perplexity's --kl-divergence-base; then its table in docs/.
bench-families: (synth-model "llama-135m qwen3-0.6b granite-s smollm3-s phi3-s olmo2-s" "F16,Q8_0,Q4_K_M") (synth-model "phi3-long phi3-4mini" "F16,Q8_0")
    cargo build --release -p tessera
    python3 scripts/families_vs_llamacpp.py

# Packages the llama.cpp comparison needs (cmake, clang to build llama.cpp, with OpenMP for its AMX build; a font for the charts), with apt if missing.
bench-deps:
    command -v cmake >/dev/null && command -v clang >/dev/null && test -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf && (! grep -q amx_int8 /proc/cpuinfo || ls /usr/lib/llvm-*/lib/libomp.so >/dev/null 2>&1) || ($(command -v sudo || true) apt-get update && $(command -v sudo || true) apt-get install -y cmake clang libclang-dev libomp-dev fonts-dejavu-core)

# Regenerate tests/fixtures/llamacpp_tokens.json (and _gemma3.json) with llama.cpp's tokenizer.
tokenizer-fixture: model bench-deps
    python3 scripts/fetch_model.py gemma3
    cargo run --release --features llama-cpp --example llamacpp_tokenize
    cargo run --release --features llama-cpp --example llamacpp_tokenize models/gemma-3-270m-q4_k_m.gguf tests/fixtures/llamacpp_tokens_gemma3.json

# Lints as CI would want them.
lint:
    cargo fmt --all -- --check
    cargo clippy --workspace --all-targets -- -D warnings
