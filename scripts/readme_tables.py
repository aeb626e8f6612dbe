#!/usr/bin/env python3
"""The one generator of the generated sections of README.md and docs/*.md
(each between `bench-<name>` markers, in whichever page has them); nothing
in them is typed by hand. Each subcommand reads what its recipe wrote:

- model, engine: target/bench/model.jsonl (`just bench-model`) and
  engine.jsonl (`just bench-engine`), one `tessera bench --json` object a line;
- swa: target/bench/swa.jsonl (`just bench-swa`, Gemma 3's sliding pool);
- sessions: target/bench/sessions.jsonl (`just bench-sessions`);
- hangups: target/bench/hangups.json and, when present, hangups-before.json
  (`just bench-hangups`);
- soak: target/bench/soak.json (`just bench-soak`);
- criterion: target/criterion (`just bench`);
- llamacpp: target/bench/vs-llamacpp.json and vs-llamacpp-meta.json, the
  charts copied to docs/bench/ (`just bench-llamacpp`);
- cpu: target/bench/cpu.json (`just bench-cpu`); cpu-amx: cpu-amx.json
  (`just bench-cpu-amx`, on a CPU with AMX); cpu-avx2: cpu-avx2.json
  (`just bench-cpu` on a CPU with AVX2 alone); cpu-avx512: cpu-avx512.json
  (`just bench-cpu` on a CPU with AVX-512 VNNI and no AVX-VNNI); cpu-256:
  cpu-256.json (`just bench-cpu-256`: a wider CPU's 256-bit rows alone);
- gpu, gpu-ab, gpu-families, gpu-forward, gpu-variants, gpu-fusion: what
  `scripts/cuda_device_run.sh` brings back from a GPU machine, copied to
  target/bench/gpu/, gpu/ab/, gpu-families/, gpu-forward/, gpu-variants/<call>/
  and gpu-fusion/<call>/;
- summary: the README's results in brief, from cpu.json and gpu-forward/.

Other scripts (bench_cpu.py, families_vs_llamacpp.py, ...) write their own
sections through `splice` here.

Usage: readme_tables.py model|engine|sessions|hangups|swa|soak|criterion|llamacpp|cpu|cpu-amx|cpu-avx2|cpu-avx512|cpu-256|gpu|gpu-ab|gpu-families|gpu-forward|gpu-variants|gpu-fusion|summary
"""

import datetime
import json
import re
import statistics
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "target" / "bench"
# The instruction sets' names in the tables (TESSERA_ISA's values as keys).
ISA_NAMES = {"amx": "AMX-INT8", "avx512": "AVX-512 VNNI", "avxvnni": "AVX-VNNI", "avx2": "AVX2"}


def cpu():
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def commit(before=None):
    """HEAD, or the last commit made before the time `before` (seconds)."""
    args = ["git", "rev-list", "-1", "--abbrev-commit"]
    if before is not None:
        args.append(f"--before=@{int(before)}")
    out = subprocess.run(args + ["HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def measured(at=None, source=None):
    """When, where and at which commit (`at`, else HEAD): the start of every
    generated text. Given `source` (the results file), the date is the day
    it was written and the commit the last one made before that, so that
    regenerating a table does not restamp old results with today's."""
    day, when = datetime.date.today(), None
    if source is not None and Path(source).exists():
        when = Path(source).stat().st_mtime
        day = datetime.date.fromtimestamp(when)
    return f"measured {day} on {cpu()} ({os.cpu_count()} cores), commit `{at or commit(when)}`"


def header(source=None):
    return f"{measured(source=source)}, SmolLM2-135M-Instruct Q4_1, default (portable) release build"


def lines(name):
    path = BENCH / name
    if not path.exists():
        sys.exit(f"{path} is missing: run the recipe that writes it")
    return [json.loads(line) for line in path.read_text().splitlines()]


def rows(name):
    return {r["scenario"]: r for r in lines(name)}


def fidelity(name):
    """The `fidelity` rows (one per integer activation mode)."""
    f = [r for r in lines(name) if r["scenario"] == "fidelity"]
    if not f:
        return []
    out = [
        "",
        f"Agreement with f32 activations (`--scenario fidelity`): {f[0]['replies']} chat prompts, each "
        f"followed by the reply f32 activations give greedily ({f[0]['positions']} reply positions in all), "
        "read by each mode as prefills (f16 KV cache); KL(f32 ‖ mode) of the next-token distributions, and "
        "each mode's own greedy replies against f32's:",
        "",
        "| activations | top-1 agreement | KL mean | KL p99 | KL max | greedy replies identical | "
        "reply tokens before the first difference |",
        "|---|---|---|---|---|---|---|",
    ]
    names = {"int8x2": "two int8 levels per block (default)", "int8": "one int8 level (`--activations int8`)"}
    for r in f:
        out.append(
            f"| {names.get(r['activations'], r['activations'])} | {r['top1'] * 100:.2f}% | {r['kl_mean']:.1e} | "
            f"{r['kl_p99']:.1e} | {r['kl_max']:.1e} | {r['identical_replies']}/{r['replies']} | "
            f"{r['tokens_before_divergence']}/{r['reply_tokens']} |"
        )
    return out


def model():
    r = rows("model.jsonl")
    out = [
        f"`tessera bench --scenario prefill|decode`, {header(BENCH / 'model.jsonl')}, "
        f"{r['prefill']['threads']} threads, both engines alternating in the same run; "
        f"median of {r['prefill']['runs']} runs (prefill) and {r['decode']['runs']} (decode). "
        "candle's `quantized_llama` quantizes activations to 8 bits and has no SIMD "
        "path for Q4_1.",
        "",
        "| scenario | Tessera | candle 0.11 `quantized_llama` | ratio |",
        "|---|---|---|---|",
    ]
    for key, label in [
        ("prefill", "prefill, 512-token prompt"),
        ("decode", "decode, 128 tokens after a 16-token prompt"),
    ]:
        x = r[key]
        out.append(
            f"| {label} | {x['tessera']:.1f} tok/s | {x['candle']:.1f} tok/s | {x['ratio']:.1f}× |"
        )
    if "decode-long" in r and "decode-batch" in r:
        lg, bt = r["decode-long"], r["decode-batch"]

        def phases(x, att, fwd):
            """A decode forward's attention phases: 'a of f ms (s%)'."""
            a, f = x.get(att), x.get(fwd)
            if a is None or f is None or a != a or f != f:
                return "–"
            return f"{a:.2f} of {f:.2f} ms ({100 * a / f:.0f}%)"

        out += [
            "",
            f"Decode deep in a context and several sequences at once (`--scenario decode-long|decode-batch`, "
            f"median of {lg['runs']} runs), each beside one sequence decoding after a 16-token prompt in the "
            "same run. The last two columns time the attention phases of each decode forward (from the "
            "barrier after the fused QKV to the one after the merge, all layers; `tessera_model::phases`) "
            "against the whole forward:",
            "",
            "| scenario | Tessera | one sequence, short context | ratio | attention, Tessera | attention, one sequence |",
            "|---|---|---|---|---|---|",
            f"| decode-long: 128 tokens after {lg['context']:,} tokens of context | {lg['tessera']:.1f} tok/s | "
            f"{lg['short_tessera']:.1f} tok/s | {lg['ratio_to_short']:.2f}× | "
            f"{phases(lg, 'attention_ms', 'forward_ms')} | {phases(lg, 'short_attention_ms', 'short_forward_ms')} |",
            f"| decode-batch: 4 sequences decoding together, aggregate | {bt['batch4']:.1f} tok/s | "
            f"{bt['single']:.1f} tok/s | {bt['ratio4']:.2f}× | "
            f"{phases(bt, 'batch4_attention_ms', 'batch4_forward_ms')} | {phases(bt, 'single_attention_ms', 'single_forward_ms')} |",
            f"| decode-batch: 8 sequences decoding together, aggregate | {bt['batch8']:.1f} tok/s | "
            f"{bt['single']:.1f} tok/s | {bt['ratio8']:.2f}× | "
            f"{phases(bt, 'batch8_attention_ms', 'batch8_forward_ms')} | {phases(bt, 'single_attention_ms', 'single_forward_ms')} |",
        ]
    return out + fidelity("model.jsonl")


def engine():
    r = rows("engine.jsonl")
    c, s, i, sh = r["chat"], r["shared-prefix"], r["interleaved"], r["shift"]
    last = c["turns"][-1]
    second = c["turns"][1]
    new = [t["prompt_tokens"] - t["cached_tokens"] for t in c["turns"][1:]]
    return [
        f"`tessera bench --scenario chat|shared-prefix|interleaved|shift --json`, {header(BENCH / 'engine.jsonl')}. "
        "Each scenario runs beside the same engine without the cache's help, in the same run.",
        "",
        "| scenario | with the cache | without | |",
        "|---|---|---|---|",
        f"| chat: 12 turns (system ~150 tokens, user turns ~150, 32-token greedy replies), TTFT of turn 12, "
        f"median of {c['runs']} runs | {c['last_ttft_ms_reuse']:,.0f} ms ({last['cached_tokens']:,} of "
        f"{last['prompt_tokens']:,} prompt tokens cached) | {c['last_ttft_ms_no_reuse']:,.0f} ms (reuse off) | "
        f"**{c['last_ratio']:.1f}×**; sum over the 12 turns {c['sum_ttft_ms_reuse'] / 1e3:.1f} s vs "
        f"{c['sum_ttft_ms_no_reuse'] / 1e3:.1f} s; "
        f"{'identical' if c['same_replies'] else 'different'} greedy replies |",
        f"| shared prefix: 8 requests sharing a 1,000-token prefix, 50-token suffixes each, submitted "
        f"together: time until all 8 have their first token, median of {s['runs']} runs | "
        f"{s['total_ttft_ms']:,.0f} ms | {s['no_reuse_ms']:,.0f} ms (reuse off) | "
        f"{s['speedup_vs_no_reuse']:.1f}×; **{s['ratio_to_prefix_once']:.2f}×** the time of prefilling "
        f"the prefix once plus the 8 suffixes one by one ({s['prefix_once_plus_suffixes_ms']:,.0f} ms) |",
        f"| interleaved: 4 conversations (system ~400 tokens, user turns ~40, replies 32) taking turns, "
        f"6 rounds: prompt tokens served from cache from each one's second turn | "
        f"**{i['cached_share_from_turn_2'] * 100:.1f}%** (lowest turn {i['lowest_turn_share'] * 100:.1f}%; "
        f"{i['history_cached_share'] * 100:.0f}% of what earlier turns computed) | 0% | sum of TTFT "
        f"{i['sum_ttft_ms_reuse'] / 1e3:.1f} s vs {i['sum_ttft_ms_no_reuse'] / 1e3:.1f} s "
        f"({i['sum_ttft_ms_no_reuse'] / i['sum_ttft_ms_reuse']:.1f}×) |",
        "",
        f"TTFT with reuse grows from {second['ttft_ms_reuse'] / 1e3:.2f} s (turn 2) to "
        f"{last['ttft_ms_reuse'] / 1e3:.2f} s (turn 12) while the new tokens per turn stay at "
        f"{min(new) if min(new) == max(new) else f'{min(new)}–{max(new)}'}: what grows is attention "
        "over the longer history, not recomputation.",
        "",
        f"Context shift (`--scenario shift`): context {sh['context']}, keep {sh['keep']}; the "
        f"{sh['tokens_compared'] // sh['prompts']} greedy tokens after a shift against a fresh prefill "
        f"of the kept tokens, over {sh['prompts']} prompts: **{sh['agreement'] * 100:.1f}%** are the same "
        f"token at the same place, the first {sh['mean_identical_prefix']:.1f} on average are identical, "
        f"and all are in {sh['fully_identical']} of {sh['prompts']}. (Deeper layers' cached K/V still "
        "carry the dropped tokens' influence; only layer 0 is exact, which a test checks.)",
    ]


def isa():
    """The widest vector extensions of this host, as the kernels pick them."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if "amx_int8" in flags and "avx512_vnni" in flags:
        return "AVX-512 VNNI and AMX-INT8"
    if "avx512_vnni" in flags:
        return "AVX-512 VNNI"
    if "avx512f" in flags:
        return "AVX-512"
    if "avx_vnni" in flags:
        return "AVX2 with AVX-VNNI"
    if "avx2" in flags:
        return "AVX2"
    return "no AVX2"


def sessions():
    r = rows("sessions.jsonl")["session_save"]
    return [
        f"`tessera bench --scenario session-save --runs {r['runs']} --json`, {header(BENCH / 'sessions.jsonl')}, {isa()} host. "
        "A stream decodes 128 greedy tokens; once its fourth token is out, a "
        f"{r['session_tokens']:,}-token session nothing cached is saved (its K/V computed as a "
        "background request, written to a file). The stream's gaps between tokens from the fifth "
        "on, beside the same stream alone, the two alternating run by run (medians over the runs).",
        "",
        "| the stream's gap between tokens | alone | beside the save | ratio |",
        "|---|---|---|---|",
        f"| largest | {r['alone_max_gap_ms']:.2f} ms | {r['beside_save_max_gap_ms']:.2f} ms | "
        f"**{r['max_gap_ratio']:.2f}×** |",
        f"| median | {r['alone_median_gap_ms']:.2f} ms | {r['beside_save_median_gap_ms']:.2f} ms | "
        f"{r['median_gap_ratio']:.2f}× |",
        "",
        f"The save took {r['save_s_beside_stream']:.2f} s beside the stream and "
        f"{r['save_s_alone']:.2f} s on an idle engine. The largest gaps are single spikes of a few "
        "milliseconds (often followed by a gap near 0: two tokens delivered together), which the "
        "runs alone have too: on 2 cores the stream's reader, the saving thread and two compute "
        "workers share the machine; the median shows the steady cost of the save's share of each "
        "step (paced to keep such steps within about 1.5x a plain one). "
        "Before saves became background requests, "
        "the export computed the whole session inside one worker command, so every running stream "
        f"waited for all of it: a largest gap of at least the save's own time ({r['save_s_alone']:.2f} s "
        "here).",
    ]


def hangups():
    path = BENCH / "hangups.json"
    if not path.exists():
        sys.exit(f"{path} is missing: run just bench-hangups")
    r = json.loads(path.read_text())
    out = [
        f"`scripts/hangups.py`, {header(path)}, {isa()} host, `tessera serve` on loopback. "
        f"{r['clients']} clients each send a prompt of {r['prompt_tokens']:,} tokens (not "
        f"streamed) and close their socket after {r['hang_up_after_s']} s; right after them a short "
        "streamed request asks for 4 tokens. Its time to first token beside the same request on "
        f"the idle server just before (medians of {r['runs']} runs), how long until the server "
        "held no request, and the same request's TTFT then.",
        "",
        "| build | TTFT idle | TTFT right after the hang-ups | ratio | no request held after | TTFT then |",
        "|---|---|---|---|---|---|",
    ]
    rows_ = [("this build", r)]
    old = BENCH / "hangups-before.json"
    if old.exists():
        b = json.loads(old.read_text())
        rows_.insert(0, (f"before (`{b.get('commit', '?')}`: cancelled only when an event failed to reach the client)", b))
    for name, x in rows_:
        out.append(
            f"| {name} | {x['idle_ttft_s'] * 1e3:,.0f} ms | {x['after_hangups_ttft_s'] * 1e3:,.0f} ms | "
            f"**{x['ratio']:.2f}×** | {x['drained_s']:.2f} s | {x['settled_ttft_s'] * 1e3:,.0f} ms |"
        )
    out += [
        "",
        "Right after the hang-ups the short request waits for the one step in flight: a 512-token "
        "prefill chunk of an abandoned prompt, which no check between steps can cut short "
        f"({r['drained_s'] * 1e3:,.0f} ms here, about as long as the whole wait). The cancellation "
        "itself takes effect at the next step: from then on the server is as if idle.",
    ]
    return out


def swa():
    r = rows("swa.jsonl")["sliding-window"]
    mib = lambda b: b / (1 << 20)
    turns = r["chat_turns"]
    new = [t["prompt_tokens"] - t["cached_tokens"] for t in turns[1:]]
    return [
        f"`tessera bench --scenario sliding-window --json`, measured {datetime.date.today()} on {cpu()} "
        f"({os.cpu_count()} cores), commit `{commit()}`, Gemma 3 270M Q4_K_M (15 of 18 layers see "
        f"{r['window']} tokens), f16 cache, blocks of 16, default (portable) release build, median of "
        f"{r['runs']} runs.",
        "",
        "| | sliding layers on their own pool | full attention (`--swa-full`) | |",
        "|---|---|---|---|",
        f"| KV memory for an {r['prompt_tokens']:,}-token prompt + {r['new_tokens']} greedy tokens | "
        f"{mib(r['kv_bytes_sliding_pool']):.1f} MiB (peak held {mib(r['peak_held_sliding_pool']):.1f} MiB) | "
        f"{mib(r['kv_bytes_full_attention']):.1f} MiB (peak held {mib(r['peak_held_full_attention']):.1f} MiB) | "
        f"**{r['kv_ratio'] * 100:.1f}%**; {'the same' if r['same_tokens'] else 'different'} tokens |",
        f"| TTFT, decode | {r['ttft_ms'][0]:,.0f} ms, {r['decode_tok_s'][0]:.1f} tok/s | "
        f"{r['ttft_ms'][1]:,.0f} ms, {r['decode_tok_s'][1]:.1f} tok/s | |",
        "",
        f"On the same small pool, a 12-turn conversation (a 600-token start, ~150 new tokens a turn, "
        f"32-token greedy replies, up to {turns[-1]['prompt_tokens']:,} tokens) gets "
        f"**{r['chat_hit_ratio'] * 100:.1f}%** of its prompt tokens from the cache from turn 2 on "
        f"(new tokens per turn {min(new) if min(new) == max(new) else f'{min(new)}–{max(new)}'}; "
        f"{r['evicted_sliding_blocks']:,} sliding blocks "
        f"evicted meanwhile, the tails kept); TTFT of turn 12 "
        f"{turns[-1]['ttft_ms_reuse']:,.0f} ms with reuse, {turns[-1]['ttft_ms_no_reuse']:,.0f} ms without; "
        f"{'identical' if r['chat_same_replies'] else 'different'} greedy replies.",
    ]


def tiers():
    rs = [r for r in lines("tiers.jsonl") if r["scenario"] == "tiers"]
    r = rs[0]
    pct = lambda x: f"{x * 100:.1f}%"
    names = {
        "SmolLM2-135M-Instruct.Q4_1.gguf": "SmolLM2-135M-Instruct Q4_1",
        "gemma-3-270m-q4_k_m.gguf": "Gemma 3 270M Q4_K_M",
    }
    out = [
        f"`tessera bench --scenario tiers --json`, measured {datetime.date.today()} on {cpu()} "
        f"({os.cpu_count()} cores), commit `{commit()}`, f16 cache, default (portable) release "
        f"build, {isa()} host. {r['conversations']} conversations (a distinct ~600-token system "
        f"prompt each, ~40-token user turns, 32-token greedy replies) take {r['rounds']} turns each, "
        f"round-robin, on a pool whose global layers hold a third of their final working set, so "
        f"each history is evicted before its next turn (Gemma 3's sliding-window layers have a "
        f"pool of their own, sized for one request's window, prompt chunk and system prompt). The "
        f"pool alone beside the same pool with its disk tier (`--cache-dir`), turn by turn "
        f"alternating; history served from cache over rounds 2–{r['rounds']}.",
        "",
        "| model | pool (global layers) | final working set | history from cache: pool alone | "
        "pool + disk tier (share read from disk) | TTFT p50 | TTFT p99 | tier: blocks written / "
        "read, on disk | same greedy replies |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rs:
        name = names.get(r.get("model"), r.get("model") or "SmolLM2-135M-Instruct Q4_1")
        out.append(
            f"| {name} | {r['pool_tokens']:,} tokens | {r['working_set_tokens']:,} "
            f"({r['working_set_tokens'] / r['pool_tokens']:.1f}×) | {pct(r['history_cached_share_pool'])} | "
            f"**{pct(r['history_cached_share_tiered'])}** ({pct(r['disk_share_of_cached'])}) | "
            f"{r['ttft_p50_ms_pool']:,.0f} → {r['ttft_p50_ms_tiered']:,.0f} ms "
            f"(**{r['ttft_p50_ms_pool'] / r['ttft_p50_ms_tiered']:.2f}×**) | "
            f"{r['ttft_p99_ms_pool']:,.0f} → {r['ttft_p99_ms_tiered']:,.0f} ms "
            f"({r['ttft_p99_ms_pool'] / r['ttft_p99_ms_tiered']:.2f}×) | "
            f"{r['tier_blocks_written']:,} / {r['tier_blocks_read']:,}, "
            f"{r['tier_bytes'] / (1 << 20):.1f} MiB | {'yes' if r['same_replies'] else '**no**'} |"
        )
    return out


def device_tests(log):
    """What each test step of a `cuda_device_run.sh` log (tests.log) reported,
    found by the step's command line (`=== CMD`): the kernel tests, their
    sanitizer run (and its error summary), the every-family test (its
    per-family agreement lines) and the real-model test (its agreement)."""
    steps, cur = {}, None
    for line in log:
        if line.startswith("=== ") and not line.startswith("=== rc"):
            cmd = line[4:]
            if cmd.startswith("compute-sanitizer"):
                cur = "sanitizer"
            elif "kernel-tests" in cmd:
                cur = "kernels"
            elif "on_every_family" in cmd:
                cur = "families"
            elif "model-tests" in cmd:
                cur = "real"
            else:
                cur = None
            if cur:
                steps[cur] = []
            continue
        if cur:
            steps[cur].append(line)

    def result(name):
        for line in steps.get(name, []):
            if line.startswith("test result:"):
                return line.split(";")[0].removeprefix("test result: ").removeprefix("ok. ")
        return "not run"

    agree = lambda name: [l.split(": ", 1)[1] for l in steps.get(name, [])  # noqa: E731
                          if "greedy tokens before the first difference" in l]
    return {
        "kernels": result("kernels"),
        "sanitizer": result("sanitizer"),
        "sanitizer_summary": [l.removeprefix("========= ").lower() for l in steps.get("sanitizer", [])
                              if l.startswith("========= ERROR SUMMARY")],
        "families": result("families"),
        "families_agree": [(l.split(": ", 1)[0].split()[-1], l.split(": ", 1)[1])
                           for l in steps.get("families", []) if "greedy tokens before" in l],
        "real": result("real"),
        "real_agree": agree("real"),
    }


def gpu_families():
    """A CUDA run without the model file (`cuda_device_run.sh BUNDLE`, its
    tests.log and meta.json copied to target/bench/gpu-families/): the
    kernel tests, their sanitizer run and every family on the GPU."""
    d = BENCH / "gpu-families"
    meta = json.loads((d / "meta.json").read_text())
    t = device_tests((d / "tests.log").read_text().splitlines())
    fams = ", ".join(f"{name} {agree.split(' greedy')[0]}" for name, agree in t["families_agree"])
    return [
        f"Measured {meta['date']} on one {meta['gpu']} ({meta['memory']}, driver {meta['driver']}), "
        f"commit `{meta['commit']}`, `scripts/cuda_device_run.sh BUNDLE` (no model file: it could not "
        "be carried to that machine), `TESSERA_REQUIRE_GPU=1`:",
        "",
        f"- The CUDA kernel tests {t['kernels']}; under compute-sanitizer's memcheck {t['sanitizer']}, "
        f"{t['sanitizer_summary'][0] if t['sanitizer_summary'] else 'no summary'}.",
        f"- Every family's block on the GPU against the CPU reference forward (tiny generated Q8_0 files, "
        f"a 40-token prompt, then 16 greedy tokens over an f32 cache): {t['families']}; greedy tokens "
        f"before the first difference: {fams}.",
    ]


def gpu():
    """The CUDA run: tests, a chat with its session and cache on disk, and
    `tessera bench --device cuda`."""
    d = BENCH / "gpu"
    meta = json.loads((d / "meta.json").read_text())
    r = {x["scenario"]: x for x in lines("gpu/gpu.jsonl")}
    log = (d / "tests.log").read_text().splitlines()
    t = device_tests(log)
    passed = [t["kernels"], t["real"], t["sanitizer"]]
    agree = t["real_agree"]
    sanit = t["sanitizer_summary"]
    chats = [l for l in log if l.startswith("requests: ")]
    p, dcd, c, s = r["prefill"], r["decode"], r["chat"], r["shared-prefix"]
    lg, bt, sh = r["decode-long"], r["decode-batch"], r["shift"]
    out = [
        f"Measured {meta['date']} on one {meta['gpu']} ({meta['memory']}, driver {meta['driver']}), "
        f"commit `{meta['commit']}`, SmolLM2-135M-Instruct Q4_1, f16 cache, a release build with "
        "`--features cuda` (PTX for compute capability 8.0, compiled by the driver), "
        "`scripts/cuda_device_run.sh`.",
        "",
        f"- With `TESSERA_REQUIRE_GPU=1`: the CUDA kernel tests {passed[0]} (the four KV kernels "
        f"and paged attention against the CPU slow references, and the host-side checks); the real model on the "
        f"GPU against the CPU reference forward {passed[1]}, {agree[0] if agree else 'agreement not printed'}.",
        f"- The kernel tests under compute-sanitizer's memcheck: {passed[2] if len(passed) > 2 else 'not run'}, "
        f"{sanit[0] if sanit else 'no summary'}.",
        f"- A scripted chat on the GPU, twice over one `--cache-dir` (`/save`, a turn, `/load`, the same turn "
        f"again): first process `{chats[0] if chats else 'did not finish'}`; second `"
        f"{chats[1] if len(chats) > 1 else 'did not finish'}`.",
        "",
        "| scenario (`tessera bench --device cuda`) | Tessera on the GPU | baseline, same run | ratio |",
        "|---|---|---|---|",
        f"| prefill, 512-token prompt, median of {p['runs']} | {p['tessera']:,.0f} tok/s | "
        f"{p['candle']:,.0f} tok/s (candle `quantized_llama`, same GPU) | {p['ratio']:.2f}× |",
        f"| decode, 128 tokens after 16, median of {dcd['runs']} | {dcd['tessera']:,.1f} tok/s | "
        f"{dcd['candle']:,.1f} tok/s (candle `quantized_llama`, same GPU) | {dcd['ratio']:.2f}× |",
        f"| decode-long: 128 tokens after {lg['context']:,} | {lg['tessera']:,.1f} tok/s | "
        f"{lg['short_tessera']:,.1f} tok/s (short context) | {lg['ratio_to_short']:.2f}× |",
        f"| decode-batch: 8 sequences together, aggregate | {bt['batch8']:,.1f} tok/s | "
        f"{bt['single']:,.1f} tok/s (one sequence) | {bt['ratio8']:.2f}× |",
        f"| chat: TTFT of turn 12 | {c['last_ttft_ms_reuse']:,.0f} ms | {c['last_ttft_ms_no_reuse']:,.0f} ms "
        f"(reuse off) | {c['last_ratio']:.1f}×; {'identical' if c['same_replies'] else 'different'} greedy replies |",
        f"| shared prefix: 8 requests, 1,000-token prefix, all first tokens | {s['total_ttft_ms']:,.0f} ms | "
        f"{s['no_reuse_ms']:,.0f} ms (reuse off) | {s['speedup_vs_no_reuse']:.1f}× |",
        "",
        f"Context shift on the GPU (`--scenario shift`, the K-shift kernel): "
        f"{sh['agreement'] * 100:.1f}% of the greedy tokens after a shift equal a fresh prefill's "
        f"(the CPU's figure is in [KV-cache scenarios](#kv-cache-scenarios-just-bench-engine)).",
    ]
    # The same scenarios over quantized caches (their own files: the bench
    # objects do not name the cache type).
    kv = [(t, rows(f"gpu/gpu-{t}.jsonl")) for t in ("q8_0", "q4_0") if (d / f"gpu-{t}.jsonl").exists()]
    if kv:
        out += [
            "",
            "Quantized caches on the GPU (`--cache-dtype`, blocks read in place by attention):",
            "",
            "| cache | decode-long: 128 tokens after the context | short context | ratio | shift: greedy tokens "
            "equal to a fresh prefill's |",
            "|---|---|---|---|---|",
            f"| f16 | {lg['tessera']:,.1f} tok/s | {lg['short_tessera']:,.1f} tok/s | {lg['ratio_to_short']:.2f}× | "
            f"{sh['agreement'] * 100:.1f}% |",
        ]
        for t, q in kv:
            ql, qs = q.get("decode-long"), q.get("shift")
            long_cells = (f"{ql['tessera']:,.1f} tok/s | {ql['short_tessera']:,.1f} tok/s | "
                          f"{ql['ratio_to_short']:.2f}×" if ql else "did not finish | — | —")
            out.append(f"| {t} | {long_cells} | "
                       + (f"{qs['agreement'] * 100:.1f}% |" if qs else "did not finish |"))
    if "soak" in r:
        k = r["soak"]
        out += [
            "",
            f"Soak on the GPU (`--scenario soak --requests {k['requests']}`): {k['done']:,} requests done, "
            f"{k['failed']} failed by injected faults ({k['failed_steps']} failed steps), {k['shifted']} context "
            f"shifts, {k['sessions']} sessions saved and loaded, {k['defrags']} defragmentations, {k['resizes']} "
            f"pool resizes; {k['leaked_blocks']} blocks leaked.",
        ]
    llama = d / "llama.json"
    if llama.exists():
        out += ["", *vs_llamacpp(json.loads(llama.read_text()), r)]
    if (d / "ncu-prefill.txt").exists() and (d / "ncu-decode.txt").exists():
        out += ["", gpu_profile(d, dcd)]
    return out


def gpu_ab():
    """Changes to the GPU path, each against the binary before it,
    alternating in one call on the GPU (`OLD=... scripts/cuda_device_run.sh`
    writes ab.jsonl; kept as target/bench/gpu/ab/OLD-NEW.jsonl, described
    in changes.json there)."""
    d = BENCH / "gpu" / "ab"
    changes = json.loads((d / "changes.json").read_text())
    metric = {"prefill": "tessera", "decode": "tessera", "decode-batch": "batch8"}
    label = {"prefill": "prefill, 512 tokens", "decode": "decode",
             "decode-batch": "8 sequences decoding together"}
    out = [
        "Each change to the GPU path against the binary before it, the two alternating in one call on "
        "the GPU (medians over the rounds; tok/s):",
        "",
        "| change | scenario | before | after | after / before | rounds |",
        "|---|---|---|---|---|---|",
    ]
    for c in changes:
        side, got = None, {}
        for r in lines(f"gpu/ab/{c['old']}-{c['new']}.jsonl"):
            if "bin" in r:
                side = "old" if "old" in r["bin"] else "new"
            elif r["scenario"] in metric:
                got.setdefault((r["scenario"], side), []).append(r[metric[r["scenario"]]])
        what = f"{c['what']} ({c['old']} → {c['new']}{'' if c['kept'] else ', reverted'})"
        for sc in metric:
            if (sc, "old") in got and (sc, "new") in got:
                a, b = statistics.median(got[(sc, "old")]), statistics.median(got[(sc, "new")])
                out.append(f"| {what} | {label[sc]} | {a:,.1f} | {b:,.1f} | {b / a:.2f}× | "
                           f"{len(got[(sc, 'new')])} |")
    return out


def gpu_forward_runs():
    """The GPU-forward run's results (target/bench/gpu-forward/): Tessera's
    by (model file, forward, scenario), each a list of bench objects; and
    llama.cpp's tok/s by (model file, "pp" | "tg" | "tg_long"), the median of
    its repetitions as Tessera's figures are medians (empty without
    llama.jsonl)."""
    got, hdr = {}, None
    for r in lines("gpu-forward/synth.jsonl"):
        if "forward" in r:
            hdr = r
            continue
        got.setdefault((hdr["model"], hdr["forward"], r["scenario"]), []).append(r)
    return got, llama_bench_runs(BENCH / "gpu-forward" / "llama.jsonl")


def llama_bench_runs(path):
    """llama-bench's tok/s in a device run's llama.jsonl by (model file,
    "pp" | "tg" | "tg_long"), the median of its repetitions as Tessera's
    figures are medians (empty without the file)."""
    llama = {}
    if path.exists():
        for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip()):
            what = "pp" if r["n_prompt"] else ("tg_long" if r.get("n_depth") else "tg")
            ts = statistics.median(r["samples_ts"]) if r.get("samples_ts") else r["avg_ts"]
            llama[(Path(r["model_filename"]).name, what)] = ts
    return llama


def gpu_forward():
    """The CUDA forward on generated models (`SYNTH=... cuda_device_run.sh`:
    synth.jsonl, llama.jsonl, tests.log and meta.json copied to
    target/bench/gpu-forward/): Tessera's CUDA forward beside the reference
    forward of the same binary, alternating, and llama.cpp's CUDA build on
    the same files."""
    d = BENCH / "gpu-forward"
    meta = json.loads((d / "meta.json").read_text())
    log = (d / "tests.log").read_text().splitlines()
    # The default settings' steps (VARIANTS runs the format test again
    # under each variant's after them).
    log = log[:next((i for i, l in enumerate(log) if l.startswith("=== variant ")), len(log))]
    got, llama = gpu_forward_runs()
    agree = [l[l.index("CUDA forward "):].split(": ", 1) for l in log
             if "CUDA forward " in l and "greedy tokens before" in l]
    tests = [l for l in log if l.startswith("test result:")]
    # memcheck inside the run, or (memcheck-*.txt) beside it.
    sanit = [l.removeprefix("========= ").lower()
             for l in log + [x for f in sorted(d.glob("memcheck-*.txt")) for x in f.read_text().splitlines()]
             if l.startswith("========= ERROR SUMMARY")]
    rounds = max(h["round"] for h in lines("gpu-forward/synth.jsonl") if "round" in h)
    names = {"synth-135m-Q4_1-blocks.gguf": "135M (SmolLM2's layout) Q4_1",
             "synth-1b-Q4_0-blocks.gguf": "1B Llama Q4_0", "synth-1b-Q4_K_M-blocks.gguf": "1B Llama Q4_K_M"}
    med = lambda xs: statistics.median(xs)  # noqa: E731
    out = [
        f"Measured {meta['date']} on one {meta['gpu']} ({meta['memory']}, driver {meta['driver']}), "
        f"commit `{meta['commit']}`, `SYNTH=... scripts/cuda_device_run.sh BUNDLE`: models of random "
        "quantized blocks in the exact tensor layouts, generated on that machine "
        "(`synth_model.py --blocks`; speed does not depend on the values), f16 cache, 3 runs a "
        f"figure (medians{'; decode over both rounds' if rounds > 1 else ''}).",
        "",
        "- The CUDA forward against the CPU reference on tiny generated files (Llama, Qwen2, Gemma 3, "
        "Granite × Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), greedy tokens before the first difference: "
        + ", ".join(f"{a.removeprefix('CUDA forward ')} {b.split(' greedy')[0]}" for a, b in agree) + ".",
        f"- Test steps: {'; '.join(t.removeprefix('test result: ').split(';')[0] for t in tests)}; "
        f"compute-sanitizer memcheck: {', '.join(sanit) if sanit else 'not run'}.",
        "",
        "| model | scenario | CUDA forward | reference forward | ratio | llama.cpp CUDA | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, name in names.items():
        rows = [("decode", "decode, 128 tokens", lambda r: r["tessera"], "tg"),
                ("decode-long", "decode, 128 tokens after 2,048", lambda r: r["tessera"], "tg_long"),
                ("decode-batch", "8 sequences decoding together, aggregate", lambda r: r["batch8"], None)]
        for sc, label, f, lk in rows:
            a, b = got.get((m, "cuda", sc)), got.get((m, "reference", sc))
            if not a or not b:
                continue
            x, y = med([f(r) for r in a]), med([f(r) for r in b])
            ll = llama.get((m, lk)) if lk else None
            lc = f"{ll:,.0f} tok/s | {x / ll:.2f}×" if ll else "— | —"
            out.append(f"| {name} | {label} | {x:,.0f} tok/s | {y:,.0f} tok/s | {x / y:.2f}× | {lc} |")
    pp = [(names[m], v) for (m, w), v in llama.items() if w == "pp" and m in names]
    if pp:
        out += ["", "llama.cpp's prefill of 512 tokens on the same files, for scale (Tessera's prefill "
                "still runs the reference forward): " + ", ".join(f"{n} {v:,.0f} tok/s" for n, v in pp) + "."]
    # Where a decode step's time goes (later calls on the same kind of GPU):
    # the forward timed to its stream's end beside the whole step, and
    # ncu's time of each kernel inside the replayed graphs.
    if (d / "timing.jsonl").exists():
        t = [r for r in lines("gpu-forward/timing.jsonl")]
        parts = [f"{n} {1e3 / r['single']:.2f} ms a step, {r['single_forward_ms']:.2f} ms of it the forward "
                 f"to its stream's end" for n, r in zip(("135M", "1B Q4_0"), t)]
        out += ["", "Where a decode step goes (a later call, same GPU kind, `decode-batch` with the "
                "forward timed): " + "; ".join(parts) + ". The engine around the forward costs little; the "
                "forward is the GPU's time."]
    if (d / "ncu-nodes.txt").exists():
        k = ncu_kernels(d / "ncu-nodes.txt")
        each = {}
        for name, n, total in k:
            a, b = each.get(name, (0, 0.0))
            each[name] = (a + n, b + total)
        short = lambda n: n.removeprefix("tessera_fwd_").removeprefix("tessera_")  # noqa: E731
        out += ["", "ncu's time of each kernel inside the replayed decode graphs of the 135M model "
                "(mean µs per launch): " + ", ".join(f"{short(n)} {t / c:.1f}" for n, (c, t) in
                                                     sorted(each.items(), key=lambda x: -x[1][1] / x[1][0]))
                + ": each a few dependent memory round trips (its latency, not bandwidth), "
                + ("nine of them a layer (the merge: short contexts' attention in several partitions)."
                   if any("merge" in n for n in each) else "eight of them a layer.")]
    return out


def gpu_variants(folder="gpu-variants"):
    """Kernel settings against each other on the GPU (`VARIANTS=...
    scripts/cuda_device_run.sh`: variants.jsonl, llama.jsonl, tests.log and
    meta.json of each call copied to target/bench/<folder>/<call>/, with
    what scripts/cuda_lent_call.sh adds: memcheck-*.txt and
    ncu-decode-<size>-<format>.txt): a table per call, each variant's
    median tok/s per generated model and scenario, llama.cpp's CUDA build
    on the same files beside them, then memcheck's verdicts and ncu's time
    of each kernel of a decode step where the call has them."""
    names = {"synth-135m-Q4_1-blocks.gguf": "135M Q4_1", "synth-1b-Q4_0-blocks.gguf": "1B Q4_0",
             "synth-1b-Q4_K_M-blocks.gguf": "1B Q4_K_M"}
    label = {"prefill": "prefill, 512 tokens", "decode": "decode, 128 tokens",
             "decode-long": "decode after 2,048", "decode-batch": "8 sequences together, aggregate"}
    llama_key = {"prefill": "pp", "decode": "tg", "decode-long": "tg_long"}
    out = []
    for d in sorted((BENCH / folder).iterdir()):
        meta = json.loads((d / "meta.json").read_text())
        got, order, hdr, rounds = {}, [], None, 1
        for r in (json.loads(x) for x in (d / "variants.jsonl").read_text().splitlines() if x.strip()):
            if "variant" in r:
                hdr, rounds = r, max(rounds, r["round"])
                if r["variant"] not in order:
                    order.append(r["variant"])
                continue
            v = r["batch8"] if r["scenario"] == "decode-batch" else r["tessera"]
            got.setdefault((hdr["model"], r["scenario"], hdr["variant"]), []).append(v)
        llama = llama_bench_runs(d / "llama.jsonl") if (d / "llama.jsonl").exists() else {}
        log = (d / "tests.log").read_text()
        envs = dict(l.removeprefix("=== variant ").split(": ", 1) for l in log.splitlines()
                    if l.startswith("=== variant "))
        passed = log[log.find("=== variant "):].count(
            "test tests::cuda_forward_follows_the_cpu_reference_in_every_format ... ok")
        out += [f"{meta['date']}, one {meta['gpu']}, commit `{meta['commit']}`, {rounds} round"
                f"{'s' if rounds > 1 else ''} of 3 runs a figure (medians); variants: "
                + "; ".join(f"`{v}` = {envs.get(v) or 'the defaults'}" for v in order)
                + f". The format test passed under {passed} of {len(order)} variants.", "",
                "| model | scenario | " + " | ".join(f"`{v}`" for v in order) + " | llama.cpp CUDA |",
                "|---|---|" + "---|" * (len(order) + 1)]
        for m, name in names.items():
            for sc in label:
                cells = [got.get((m, sc, v)) for v in order]
                if not any(cells):
                    continue
                ll = llama.get((m, llama_key.get(sc)))
                out.append(f"| {name} | {label[sc]} | "
                           + " | ".join(f"{statistics.median(c):,.0f}" if c else "—" for c in cells)
                           + f" | {f'{ll:,.0f}' if ll else '—'} |")
        checks = sorted(d.glob("memcheck-*.txt"))
        if checks:
            verdicts = [next((l.strip("= ").strip() for l in c.read_text().splitlines()
                              if "ERROR SUMMARY" in l), "no summary") for c in checks]
            out += ["", "compute-sanitizer memcheck of the decode-batch test: "
                    + "; ".join(f"warps per row {c.stem.removeprefix('memcheck-w')}: {v}"
                                for c, v in zip(checks, verdicts)) + "."]
        for prof in sorted(d.glob("ncu-decode-*.txt")):
            k = sorted(ncu_kernels(prof), key=lambda x: -x[2])
            if not k:
                continue
            size, fmt = prof.stem.removeprefix("ncu-decode-").split("-", 1)
            what = f"{size.upper()} {fmt}"
            out += ["", f"ncu's time of each kernel of the {what} model's decode steps (variant "
                    f"`{order[-1] if order else ''}`'s settings: the defaults; mean µs per launch, "
                    "launches): " + ", ".join(f"{name} {t / n:.1f} ({n})" for name, n, t in k) + "."]
        out.append("")
    return out[:-1]


def ncu_kernels(path):
    """(name, launches, total µs) per kernel of an `ncu --print-summary
    per-kernel` report of gpu__time_duration.sum."""
    scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3}
    found = re.findall(
        r"\n  (\S+) \([^)]*\)x\([^)]*\).*?Invocations (\d+).*?gpu__time_duration\.sum\s+(\S+)\s+\S+\s+\S+\s+([\d.]+)",
        path.read_text(), re.S)
    return [(name, int(n), int(n) * float(avg) * scale[unit]) for name, n, unit, avg in found]


def gpu_profile(d, dcd):
    """Where the GPU time goes, from `PROFILE=1 scripts/cuda_device_run.sh`."""
    pre = ncu_kernels(d / "ncu-prefill.txt")
    total = sum(t for _, _, t in pre)
    group = lambda key: sum(t for name, _, t in pre if key in name)
    att = group("attention")
    gemm = group("gemm")
    deq = group("dequantize")
    dec = ncu_kernels(d / "ncu-decode.txt")
    # One lm_head product per decode step.
    steps = sum(n for name, n, _ in dec if "q8_0" in name) or 1
    per_step = sum(t for _, _, t in dec) / steps
    norm = sum(t for name, _, t in dec if name.startswith("rmsnorm")) / steps
    return (
        f"Where the GPU time goes (`PROFILE=1`: ncu's time of every kernel, same binary): a 512-token "
        f"prefill runs {total / 1e3:.1f} ms of kernels, of which cuBLAS's f32 products {gemm / 1e3:.1f} ms, "
        f"paged attention (the tiled kernel and the merge) {att / 1e3:.1f} ms ({att / total * 100:.0f}%) and "
        f"dequantizing the weights for the products {deq / 1e3:.1f} ms. A decode step "
        f"runs about {per_step / 1e3:.2f} ms of kernels against {1e3 / dcd['tessera']:.2f} ms per token measured "
        f"(the rest is launches and host work), {norm / 1e3:.2f} ms of it in candle's `rms_norm`, which "
        "gives a row one warp."
    )


def vs_llamacpp(runs, r):
    """llama.cpp's CUDA build (`llama-bench`, flash attention on, every
    layer on the GPU) beside `tessera bench --device cuda` in the same run."""
    def speed(n_prompt, n_gen, depth=0):
        # The median of llama-bench's repetitions, as Tessera's figures are
        # medians (its mean takes in a first, cold repetition).
        for x in runs:
            if (x["n_prompt"], x["n_gen"], x.get("n_depth", 0)) == (n_prompt, n_gen, depth):
                return statistics.median(x["samples_ts"]) if x.get("samples_ts") else x["avg_ts"]
        sys.exit(f"llama.json has no run with n_prompt={n_prompt} n_gen={n_gen} n_depth={depth}")
    b = runs[0]
    p, dcd, lg = r["prefill"], r["decode"], r["decode-long"]
    rows = [
        ("prefill, 512-token prompt", p["tessera"], speed(512, 0)),
        ("decode, 128 tokens (llama.cpp: from an empty context; Tessera: after 16)", dcd["tessera"],
         speed(0, 128)),
        (f"decode, 128 tokens after {lg['context']:,}", lg["tessera"], speed(0, 128, lg["context"])),
    ]
    return [
        f"Beside llama.cpp's CUDA build in the same run (`llama-bench` at build {b['build_commit']}, "
        f"built for sm_90 with `GGML_CUDA=ON`, every layer on the GPU, flash attention on, "
        f"{b['n_threads']} threads, median of {len(b.get('samples_ts', [])) or 'its'} repetitions; "
        "Tessera's figures from the table above):",
        "",
        "| scenario | Tessera | llama.cpp CUDA | ratio |",
        "|---|---|---|---|",
        *[f"| {label} | {t:,.0f} tok/s | {l:,.0f} tok/s | {t / l:.2f}× |" for label, t, l in rows],
        "",
        "llama.cpp runs its own fused CUDA kernels, with the activations of its quantized products "
        "rounded to 8 bits (Q8_1) and the decode graph replayed as a CUDA graph; Tessera's GPU path is "
        "candle's f32 operations launched one by one. Built by `scripts/build_llama_cuda.sh`.",
    ]


# Which recipe on which CPU writes each CPU table's file (cpu.json: `just bench-cpu`).
CPU_RECIPES = {
    "cpu-amx.json": "`just bench-cpu-amx`",
    "cpu-avx2.json": "`just bench-cpu` on a CPU with AVX2 alone",
    "cpu-avx512.json": "`just bench-cpu` on a CPU with AVX-512 VNNI and no AVX-VNNI",
    "cpu-256.json": "`just bench-cpu-256`",
}


def cpu_table(name="cpu.json"):
    """`just bench-cpu` (cpu.json; `just bench-cpu-amx`, cpu-amx.json):
    Tessera beside llama-bench at real sizes, per ISA."""
    path = BENCH / name
    if not path.exists():
        sys.exit(f"{path} is missing: run " + CPU_RECIPES.get(name, "`just bench-cpu`"))
    d = json.loads(path.read_text())
    row_isas = {r["isa"] for r in d["rows"]}
    builds = ("native for the AVX-512 rows, "
              if "amx" not in row_isas else
              "`GGML_NATIVE=OFF` with AVX-512, VNNI, VBMI, BF16 and AMX-INT8, compiled by clang, for the AMX "
              "rows (GCC 12 drops the stores that fill AMX's tile configuration, so its build dies of SIGILL "
              "at its first tile instruction; clang 14 needs `__AMX_INT8__` defined for ggml to compile its "
              "AMX kernels), the same without AMX, compiled by GCC, for the AVX-512 rows, ")
    # A CPU whose widest set is AVX2 (bench_cpu.py writes cpu-avx2.json only
    # there): its own rows, nothing forced down.
    avx2_only = name == "cpu-avx2.json"
    if avx2_only:
        llama_builds = ("`GGML_NATIVE=OFF` with AVX2 + FMA + F16C, this CPU's own instruction set, so the same "
                        "kernels as its native build), ")
    elif not row_isas & {"avxvnni", "avx2"}:
        # The AMX table's rows (`just bench-cpu-amx`): AMX and AVX-512 VNNI alone.
        llama_builds = builds.removesuffix(", ") + "), "
    elif not row_isas & {"avx512", "amx"}:
        # The 256-bit rows alone (`just bench-cpu-256`) of a wider CPU.
        llama_builds = ("`GGML_NATIVE=OFF` with AVX2 + FMA and no AVX-512, with `GGML_AVX_VNNI` for the AVX-VNNI "
                        "rows (256-bit `vpdpbusd`) and without it for the AVX2 rows), ")
    else:
        llama_builds = builds + "`GGML_NATIVE=OFF` with AVX2 + FMA and no AVX-512 for the " + (
            "others, with `GGML_AVX_VNNI` for the AVX-VNNI rows (256-bit `vpdpbusd`) and without it for the AVX2 "
            "rows), " if "avxvnni" in row_isas else "AVX2 rows; this CPU has no AVX-VNNI, so no such rows), ")
    runs = d.get("rooflines") or [{"models": [], "gb_s": d["roofline_gb_s"], "commit": d.get("commit")}]
    if len(runs) == 1:
        bw = f"{' and '.join(f'{g:.1f}' for g in runs[0]['gb_s'])} GB/s before and after"
    else:
        bw = "; ".join(
            f"{' and '.join(f'{g:.1f}' for g in r['gb_s'])} GB/s before and after the run of "
            f"{', '.join(r['models'])} (commit `{r.get('commit')}`)"
            for r in runs
        )
    out = [
        f"{measured(d.get('commit'))}, {isa()} host; `tessera bench` from the default (portable) build with `TESSERA_ISA` "
        + ("forced to each row's instruction set" if not avx2_only else "set to `avx2`, this CPU's widest set,")
        + " beside llama.cpp's own `llama-bench` (llama.cpp as vendored by "
        f"llama-cpp-python 0.3.36, built by `scripts/build_llama_tools.sh`: "
        + llama_builds
        + "best of flash attention "
        f"off and on, {d['threads']} threads each, the two alternating run by run, medians over {d['runs']} runs "
        "(min–max in brackets: this host's memory bandwidth is shared, and decode moves with it by ±15% from run "
        "to run). "
        "Prefill: a 512-token prompt; decode: 128 tokens (Tessera's after a 16-token prompt, llama-bench's from "
        "an empty context). `synth-*` models are generated by `just synth-model`: the Llama 3.2 1B and 3B tensor "
        "layouts (1B: hidden 2048, 16 layers, 32/8 heads, FFN 8192; 3B: hidden 3072, 28 layers, 24/8 heads, "
        "FFN 8192) with random weights and SmolLM2's 49,152-token vocabulary, quantized by llama.cpp's "
        "`llama-quantize`.",
        "",
        f"The roofline is this host's read bandwidth in the same run (`tessera bench --scenario roofline`: 1 GiB "
        f"read by {d['threads']} threads, best of 5; {bw}): a decode step reads every weight once, so tok/s × "
        "the weights' bytes ÷ the bandwidth is the share of it each engine reaches. "
        + ("Rows that read the bandwidth before each of their runs and after the last (the rows of "
           + ", ".join(sorted({f"{r['model']}" for r in d["rows"] if "read_gb_s" in r}))
           + ") take each run's decode against the mean of the two reads around it, and give the median of "
           "those shares; the others divide by the better of their run's two figures, a share too low where the "
           "bandwidth fell and above 100% where it rose."
           if any("read_gb_s" in r for r in d["rows"]) else "")
        + (" \"Forward, interleaved\" is closer still (`tessera bench --scenario roofline --model`, for Tessera "
           "only): 32 decode bursts of 8 steps, each between two read passes of 256 MiB a few milliseconds "
           "away, the forward's weight bytes a second over the mean of those two reads (the median over the "
           "bursts; the engine around the forward is left out), and in brackets the least of the step's parts "
           "(q/k/v, output, gate and up, down, head) on the same terms."
           if any("tessera_interleaved_share" in r for r in d["rows"]) else ""),
        "",
        "| model | ISA | scenario | Tessera (default, exact) | llama.cpp | ratio | Tessera `--activations int8` |"
        " Tessera, share of roofline | llama.cpp, share of roofline | Tessera's forward, interleaved |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    def close(r):
        if "tessera_interleaved_share" not in r:
            return "—"
        part, least = min(r["tessera_part_shares"].items(), key=lambda kv: kv[1])
        return f"{r['tessera_interleaved_share'] * 100:.0f}% ({part.replace('_', ' ')} {least * 100:.0f}%)"

    for r in d["rows"]:
        share = lambda k: f"{r[k] * 100:.0f}%" if k in r else "—"  # noqa: E731
        i8 = f"{r['tessera_int8']:.1f}" if "tessera_int8" in r else "—"
        span = lambda k: f" ({min(r[k]):.1f}–{max(r[k]):.1f})" if len(r.get(k, [])) > 1 else ""  # noqa: E731
        out.append(
            f"| {r['model']} | {ISA_NAMES.get(r['isa'], r['isa'])} | {r['scenario']} | {r['tessera']:.1f} tok/s"
            f"{span('tessera_runs')} | {r['llama']:.1f}{span('llama_runs')} | {r['ratio']:.2f}× | {i8} | "
            f"{share('tessera_roofline_share')} | "
            f"{share('llama_roofline_share')} | {close(r)} |"
        )
    if d.get("contention"):
        out += [
            "",
            "Decode with one busy process beside it (a shell loop spinning on one of the cores, as a browser "
            "or a build would), against the same decode idle, alternating, both engines at "
            f"{d['threads']} threads, {ISA_NAMES.get(d['contention'][0]['isa'], '')}"
            + (f", commit `{d['contention'][0]['commit']}`" if d["contention"][0].get("commit") else "")
            + ":",
            "",
            "| model | Tessera idle | Tessera busy | kept | Tessera, one thread idle | busy ÷ one thread "
            "| llama.cpp idle | llama.cpp busy | kept | llama.cpp, one thread idle | busy ÷ one thread |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in d["contention"]:
            one = lambda k, kept: (f"{r[k]:.1f} | {r[kept] * 100:.0f}%" if k in r else "— | —")  # noqa: E731
            out.append(
                f"| {r['model']} | {r['t_idle']:.1f} tok/s | {r['t_busy']:.1f} | {r['tessera_kept'] * 100:.0f}% | "
                f"{one('t_one', 'tessera_of_one')} | "
                f"{r['l_idle']:.1f} | {r['l_busy']:.1f} | {r['llama_kept'] * 100:.0f}% | "
                f"{one('l_one', 'llama_of_one')} |"
            )
        out += [
            "",
            "With one of the two cores taken, an engine has one core's worth of compute and of that "
            "core's memory bandwidth: \"one thread idle\" is that bound, measured in the same run.",
        ]
    return out


SUMMARY_HEADER = ["| model | where | prefill, 512 tokens | decode, 128 tokens |", "|---|---|---|---|"]


def kept_rows(before, where):
    """The summary's rows of `where` as last generated (`before`: its text)."""
    return [line for line in before.splitlines() if line.startswith("| ") and f"| {where}" in line]


# The sentences that open the summary's rows of one host's own table.
AMX_LEAD, AVX2_LEAD, AVX512_LEAD = "AMX rows:", "AVX2-only rows:", "AVX-512-without-AVX-VNNI rows:"
AVX256_LEAD = "An AMX CPU's 256-bit rows:"


def host_summary(before, table, where, lead, isas, says):
    """The summary's rows of one host's own table (`table`: cpu-amx or
    cpu-avx2, target/bench/TABLE.json), `where` naming them, with their
    sentence (`lead` and `says`); without that file, both as last generated
    (`before`: the summary's text)."""
    f = BENCH / f"{table}.json"
    if not f.exists():
        said = [line for line in before.splitlines() if line.startswith(lead)]
        return (said[0] if said else None), kept_rows(before, where)
    d = json.loads(f.read_text())
    ratio = {(r["model"], r["isa"], r["scenario"]): r["ratio"] for r in d["rows"]}
    page = marked_file(f"<!-- bench-{table}:start (generated by scripts/readme_tables.py) -->").read_text()
    when = re.search(rf"<!-- bench-{table}:start.*?measured (\d{{4}}-\d\d-\d\d) on ([^,]+)", page, re.S)
    host = f"{when.group(2)}, {when.group(1)}" if when else "see docs/benchmarks.md"
    models = [("SmolLM2-135M-Instruct.Q4_1", "SmolLM2-135M Q4_1"), ("synth-1b-Q4_0", "1B Llama Q4_0"),
              ("synth-1b-Q4_K_M", "1B Llama Q4_K_M"), ("synth-3b-Q4_K_M", "3B Llama Q4_K_M")]
    rows = []
    for key, name in models:
        if (key, isas[0][0], "prefill") not in ratio:
            continue
        cell = lambda sc: " / ".join(f"{ratio[(key, i, sc)]:.2f}×" if (key, i, sc) in ratio else "—"  # noqa: E731
                                     for i, _ in isas)
        rows.append(f"| {name} | {where}, {'/'.join(n for _, n in isas)} | {cell('prefill')} | "
                    f"{cell('decode')} |")
    return f"{lead} {host}, commit `{d.get('commit')}`, {says(d)}", rows


def amx_summary(before):
    """The summary's AMX rows from cpu-amx.json (`just bench-cpu-amx`)."""
    return host_summary(before, "cpu-amx", "CPU with AMX", AMX_LEAD,
                        [("amx", "AMX-INT8"), ("avx512", "AVX-512 VNNI")],
                        lambda d: f"both engines with AMX-INT8 and both without it, {d['threads']} threads each "
                                  "(`just bench-cpu-amx`).")


def avx2_summary(before):
    """The summary's rows of a CPU with AVX2 alone, from cpu-avx2.json
    (`just bench-cpu` there)."""
    return host_summary(before, "cpu-avx2", "CPU with AVX2 only", AVX2_LEAD, [("avx2", "AVX2")],
                        lambda d: f"the CPU's own instruction set, {d['threads']} threads each (`just bench-cpu` "
                                  "on it).")


def avx512_summary(before):
    """The summary's rows of a CPU with AVX-512 VNNI and no AVX-VNNI, from
    cpu-avx512.json (`just bench-cpu` there)."""
    return host_summary(before, "cpu-avx512", "CPU with AVX-512 but no AVX-VNNI", AVX512_LEAD,
                        [("avx512", "AVX-512 VNNI"), ("avx2", "AVX2")],
                        lambda d: f"both engines on AVX-512 VNNI and both forced to AVX2, {d['threads']} threads "
                                  "each (`just bench-cpu` on it).")


def avx256_summary(before):
    """The summary's rows of a wider CPU forced down to 256 bits, from
    cpu-256.json (`just bench-cpu-256`)."""
    return host_summary(before, "cpu-256", "AMX CPU forced to 256 bits", AVX256_LEAD,
                        [("avxvnni", "AVX-VNNI"), ("avx2", "AVX2")],
                        lambda d: f"both engines forced to AVX-VNNI and to AVX2, {d['threads']} threads each "
                                  "(`just bench-cpu-256`).")


def summary():
    """The README's results in brief: Tessera against llama.cpp at prefill
    and decode, from the CPU table (`just bench-cpu`), the AMX table (`just
    bench-cpu-amx`) and the CUDA forward's GPU table (docs/gpu.md); the
    pages hold the hosts, dates and runs. Rows whose run's files are not on
    this machine stay as last generated."""
    start = "<!-- bench-summary:start (generated by scripts/readme_tables.py) -->"
    before = marked_file(start).read_text().split(start)[1].split("<!-- bench-summary:end -->")[0]
    if (BENCH / "cpu.json").exists():
        out = cpu_summary()
    else:
        # The CPU table's run was on another host: its sentence and rows
        # stay as last generated.
        paragraph = [line for line in before.strip().splitlines()
                     if line.strip() and not line.startswith("|")
                     and not any(lead in line for lead in (AMX_LEAD, AVX2_LEAD, AVX512_LEAD, AVX256_LEAD))]
        out = paragraph[:1] + ["", *SUMMARY_HEADER] + kept_rows(before, "CPU, ")
    at = 1
    for part in (amx_summary, avx256_summary, avx2_summary, avx512_summary):
        sentence, rows = part(before)
        if sentence:
            out.insert(at, sentence)
            at += 1
        out += rows
    g = BENCH / "gpu-forward"
    gpu_run = (g / "synth.jsonl").exists() and (g / "llama.jsonl").exists()
    if not gpu_run:
        # The GPU run's files are not on this machine (a GPU is lent now and
        # then): its rows, each with its GPU and date, stay as last generated.
        out += kept_rows(before, "GPU, ")
    else:
        meta = json.loads((g / "meta.json").read_text())
        got, llama = gpu_forward_runs()
        for f, name in [("synth-135m-Q4_1-blocks.gguf", "135M (SmolLM2's layout) Q4_1"),
                        ("synth-1b-Q4_K_M-blocks.gguf", "1B Llama Q4_K_M")]:
            ours = [r["tessera"] for r in got.get((f, "cuda", "decode"), [])]
            if ours and (f, "tg") in llama:
                out.append(f"| {name} | GPU, one {meta['gpu']}, {meta['date']} | — (the reference forward) | "
                           f"{statistics.median(ours) / llama[(f, 'tg')]:.2f}× |")
    return out


def cpu_summary():
    """The summary's sentence, header and CPU rows from cpu.json."""
    d = json.loads((BENCH / "cpu.json").read_text())
    isas = [("avx512", "AVX-512 VNNI"), ("avxvnni", "AVX-VNNI"), ("avx2", "AVX2")]
    ratio = {(r["model"], r["isa"], r["scenario"]): r["ratio"] for r in d["rows"]}
    models = [("SmolLM2-135M-Instruct.Q4_1", "SmolLM2-135M Q4_1"), ("synth-1b-Q4_0", "1B Llama Q4_0"),
              ("synth-1b-Q4_K_M", "1B Llama Q4_K_M"), ("synth-3b-Q4_K_M", "3B Llama Q4_K_M"),
              ("synth-1b-Q6_K", "1B Llama Q6_K")]
    # When and where the CPU table was measured, as its own page says.
    page = marked_file("<!-- bench-cpu:start (generated by scripts/readme_tables.py) -->").read_text()
    when = re.search(r"<!-- bench-cpu:start.*?measured (\d{4}-\d\d-\d\d) on ([^,]+)", page, re.S)
    host = f"{when.group(2)}, {when.group(1)}" if when else "see docs/benchmarks.md"
    # Each run of the table with its commit (runs merged by --merge).
    names = dict(models)
    runs = d.get("rooflines") or [{"models": [k for k, _ in models], "commit": d.get("commit")}]
    shown = [r for r in runs if any(m in names for m in r["models"])]
    commits = "; ".join(
        f"commit `{r.get('commit')}`" + ("" if len(shown) == 1 else
                                         f" ({', '.join(names[m] for m in r['models'] if m in names)})")
        for r in shown)
    out = [
        f"Tessera's speed as a multiple of llama.cpp's on the same file, same machine, same run "
        f"(higher is better). CPU: {host}, {commits}, per instruction set "
        f"({'/'.join(n for _, n in isas)}, each engine forced to it), {d['threads']} threads each, Tessera "
        "with its exact activations. 1B and 3B are generated models of Llama 3.2's layouts.",
        "",
        *SUMMARY_HEADER,
    ]
    for key, name in models:
        if not any((key, i, "decode") in ratio for i, _ in isas):
            continue
        cell = lambda sc: " / ".join(f"{ratio[(key, i, sc)]:.2f}×" if (key, i, sc) in ratio else "—"  # noqa: E731
                                     for i, _ in isas)
        out.append(f"| {name} | CPU, {'/'.join(n for _, n in isas)} | {cell('prefill')} | {cell('decode')} |")
    return out


# The llama.cpp comparison (`just bench-llamacpp`).
LABELS = {
    ("prefill", "prefill_tok_s"): "prefill, 512-token prompt",
    ("decode", "decode_tok_s"): "decode, 128 tokens",
    ("decode-long", "decode_tok_s"): "decode-long: 128 tokens after 2,048 of context",
    ("decode-batch", "batch4_tok_s"): "decode-batch: 4 sequences together, aggregate",
    ("decode-batch", "batch8_tok_s"): "decode-batch: 8 sequences together, aggregate",
    ("chat-ttft", "ttft_sum_ms"): "chat, 12 turns: sum of TTFT",
    ("chat-ttft", "ttft_last_turn_ms"): "chat, 12 turns: TTFT of turn 12",
    ("shared-prefix", "total_ttft_ms"): "shared prefix: 8 requests, time to all first tokens",
    ("interleaved", "ttft_sum_ms"): "interleaved: 4 conversations × 6 turns, sum of TTFT",
}


def _fmt(x, unit):
    return f"{x:,.0f} {unit}" if unit == "ms" else f"{x:,.1f} {unit}"


def cell(side, unit):
    """Median, and the spread over the runs when there were several."""
    if side["runs"] < 2:
        return _fmt(side["median"], unit)
    digits = 0 if unit == "ms" else 1
    return f"{_fmt(side['median'], unit)} ({side['min']:,.{digits}f}–{side['max']:,.{digits}f})"


def llamacpp():
    """`just bench-llamacpp`: both engines in one process (vs-llamacpp.json and
    vs-llamacpp-meta.json), the charts copied to docs/bench/."""
    rows = json.loads((BENCH / "vs-llamacpp.json").read_text())
    meta = json.loads((BENCH / "vs-llamacpp-meta.json").read_text())
    main_rows = [r for r in rows if r["model"] == "Q4_1"]
    variants = [r for r in rows if r["model"] in ("Q4_0", "Q8_0")]
    gemma = [r for r in rows if r["model"] == "Gemma3"]
    scenarios = {r["scenario"] for r in main_rows}
    want = {"prefill", "decode", "decode-long", "decode-batch", "chat-ttft", "shared-prefix", "interleaved"}
    missing = want - scenarios
    if missing:
        sys.exit(f"vs-llamacpp.json lacks {sorted(missing)}: run `just bench-llamacpp`")
    docs = ROOT / "docs" / "bench"
    docs.mkdir(parents=True, exist_ok=True)
    for png in ("chat-ttft.png", "ratios.png"):
        shutil.copyfile(BENCH / png, docs / png)

    m = meta["machine"]
    out = [
        f"Measured {meta['date']} on {m['cpu']} ({m['cores']} cores), "
        f"{meta['threads']} threads for both engines, commit `{meta['commit']}`, "
        f"model `{Path(meta['model']).name}`; {meta['llama_cpp']}. "
        "Each cell: median over the runs (min–max in brackets). "
        "Ratio of medians > 1 means Tessera is better (throughput: Tessera / llama.cpp; "
        "time: llama.cpp / Tessera).",
        "",
        "| scenario | Tessera | llama.cpp | ratio | candle `quantized_llama` |",
        "|---|---|---|---|---|",
    ]
    for r in main_rows:
        label = LABELS.get((r["scenario"], r["metric"]), f"{r['scenario']} {r['metric']}")
        candle = cell(r["candle"], r["unit"]) if "candle" in r else ""
        out.append(
            f"| {label} | {cell(r['tessera'], r['unit'])} | {cell(r['llamacpp'], r['unit'])} "
            f"| **{r['ratio']:.2f}×** | {candle} |"
        )
    def table(title, rows, with_file):
        """A titled table of `rows`, with a file column when `with_file`."""
        if not rows:
            return []
        lines = ["", title, "",
                 "| file | scenario | Tessera | llama.cpp | ratio |" if with_file
                 else "| scenario | Tessera | llama.cpp | ratio |",
                 "|---|---|---|---|---|" if with_file else "|---|---|---|---|"]
        for r in rows:
            label = LABELS.get((r["scenario"], r["metric"]), f"{r['scenario']} {r['metric']}")
            first = f"| {r['model']} " if with_file else ""
            lines.append(
                f"{first}| {label} | {cell(r['tessera'], r['unit'])} "
                f"| {cell(r['llamacpp'], r['unit'])} | **{r['ratio']:.2f}×** |"
            )
        return lines

    out += table(
        f"The same model in the formats llama.cpp repacks for its fastest kernels ({meta['variants']}):",
        variants, True)
    out += table(
        "Gemma 3 270M Q4_K_M (`just model gemma3`: sliding-window layers, K-quants; Tessera's "
        "sliding layers on their own pool, a quarter of the blocks; llama.cpp's library default, "
        "`swa_full`):",
        gemma, False)
    out += ["", "Agreement of the two engines (greedy tokens of the timed runs; the completions "
            "diverge at near-ties, where llama.cpp's 8-bit activations tip the balance):", ""]
    for a in meta["agreement"]:
        where = "" if a["model"] == "Q4_1" else f"{a['model']}: "
        out.append(f"- {where}{a['what']}: {a['same']} of {a['of']}")
    out += [
        "",
        "![TTFT per chat turn](bench/chat-ttft.png)",
        "",
        "![Tessera / llama.cpp ratios](bench/ratios.png)",
    ]
    return out



def soak():
    """`just bench-soak`: target/bench/soak.json."""
    r = json.loads((ROOT / "target" / "bench" / "soak.json").read_text())
    mib = lambda b: f"{b / 2**20:,.1f} MiB"
    out = [
        f"Soak (`just bench-soak`), {measured(source=ROOT / 'target' / 'bench' / 'soak.json')}, SmolLM2-135M-Instruct Q4_1, "
        "24 MiB of KV pool (so requests preempt each other), context 256, requests spread over "
        "four cache partitions (two tenants, a salt, the default): "
        f"{r['requests']:,} requests, up to four at a time ({r['seconds']:,.0f} s of wall "
        "time: this scenario counts failures and leaks, it is no speed measure), "
        "with about one step in 150 failing with an error and one in 300 panicking"
        + (", KV events on (replayed into an index) and a disk tier under the pool" if "kv_event_batches" in r else "")
        + (", speculative decoding on and one request in five constrained (a JSON schema, a regex or "
           "a forced tool call)." if "constrained" in r else "."),
        "",
        "| what | count |",
        "|---|---|",
        f"| requests completed (all samples) | {r['done']:,} ({r['samples']:,} samples, {r['shifted']:,} past a context shift) |",
        f"| requests cancelled part way | {r['cancelled']:,} |",
        f"| requests failed by an injected fault | {r['failed']:,} (steps failed: {r['failed_steps']:,}) |",
        f"| sessions saved and loaded back / defragmentations / shrink-and-grow | {r['sessions']} / {r['defrags']} / {r['resizes']} |",
        f"| requests whose client hung up before any answer | {r['hung_up']:,} |",
        f"| sessions saved in a tenant's partition beside a stream, restored and used there | {r['background_saves']} |",
        f"| **prompts served across partitions** (of {r['probes']} probes over 4 partitions; sent again in their own, "
        f"{r['own_partition_hits']} came whole from the cache) | **{r['cross_partition_hits']}** |",
        *([f"| speculative decoding: draft tokens kept / proposed | {r['spec_accepted_tokens']:,} / {r['spec_draft_tokens']:,} |",
            f"| **constrained answers that ended with `stop` and do not match their constraint** (of {r['constrained']}) | **{r['unmatched']}** |"]
          if "constrained" in r else []),
        f"| **blocks leaked** (held once every request is over) | **{r['leaked_blocks']}** (sequences left: {r['sequences_left']}; KV invariants hold) |",
        *([f"| **KV events lost or out of order** (replayed into a router's index: {r['kv_event_batches']:,} batches, "
           f"{r['kv_events_stored']:,} blocks stored, {r['kv_events_removed']:,} removed; blocks left in it after a clear: "
           f"{r['kv_event_blocks_left']}) | **{r['kv_event_violations']}** |",
           f"| disk tier under the pool: blocks written / read back (prompt tokens from disk) | "
           f"{r['tier_blocks_written']:,} / {r['tier_blocks_read']:,} ({r['disk_cached_tokens']:,}) |"]
          if "kv_event_batches" in r else []),
        f"| resident memory after warm-up (10% of the requests) / peak / end | {mib(r['rss_warm_bytes'])} / {mib(r['rss_peak_bytes'])} / {mib(r['rss_end_bytes'])} |",
        f"| **RSS growth after warm-up** | **{r['rss_growth'] * 100:+.1f}%** |",
    ]
    return out



def _ns(ns: float) -> str:
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns:.3g} ns"


def defined():
    """The full ids of the benches `benches/kv.rs` defines now."""
    out = subprocess.run(["cargo", "bench", "-q", "--bench", "kv", "--", "--list"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return {line.rsplit(": ", 1)[0] for line in out.splitlines() if line.endswith(": benchmark")}


def criterion_rows():
    rows = []
    names = defined()
    for bench in sorted((ROOT / "target" / "criterion").glob("*/*/new/benchmark.json")):
        meta = json.loads(bench.read_text())
        if meta["full_id"] not in names:
            continue
        est = json.loads((bench.parent / "estimates.json").read_text())
        median = est["median"]["point_estimate"]
        per = ""
        thr = meta.get("throughput") or {}
        both = thr.get("ElementsAndBytes")
        elements = thr.get("Elements")
        name = meta["full_id"]
        if both:
            # Multiply-adds and bytes (the attention's decode benches).
            per = (f"{both['bytes'] / median:.1f} GB/s, "
                   f"{both['elements'] / median:.1f} GMAC/s")
        elif elements and name.startswith(("matvec", "roofline")):
            per = f"{elements / median:.1f} GMAC/s"
        elif elements:
            per = f"{_ns(median / elements)} per element"
        if thr.get("Bytes"):
            per = f"{thr['Bytes'] / median:.1f} GB/s"
        rows.append((meta["full_id"], _ns(median), per))
    if not rows:
        sys.exit("no criterion results in target/criterion: run `just bench`")
    out = ["| bench | median | |", "|---|---|---|"]
    out += [f"| `{name}` | {median} | {per} |" for name, median, per in rows]
    return out


def criterion():
    """`just bench`: the latest criterion results in target/criterion
    (median per iteration; per element, GB/s or GMAC/s where the bench sets
    a throughput), only the benches `cargo bench --bench kv -- --list` names
    (target/criterion keeps those of benches that no longer exist)."""
    return [f"Criterion medians, {measured()}, `cargo bench --bench kv`.", ""] + criterion_rows()


def marked_file(start):
    """The page (README.md or docs/*.md) holding a generated section's start
    marker."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if start in page.read_text():
            return page
    sys.exit(f"no page of README.md and docs/ has the marker {start}")


def splice(section, script, lines):
    """Replaces the text between the `bench-<section>` markers, in whichever
    page (README.md or docs/*.md) has them."""
    start = f"<!-- bench-{section}:start (generated by scripts/{script}) -->"
    end = f"<!-- bench-{section}:end -->"
    page = marked_file(start)
    text = page.read_text()
    if end not in text:
        sys.exit(f"{page.relative_to(ROOT)} has no {end} marker")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    page.write_text(head + "\n".join([start, "", *lines, "", end]) + tail)


def main():
    which = sys.argv[1] if len(sys.argv) > 1 else ""
    make = {
        "model": model,
        "engine": engine,
        "sessions": sessions,
        "hangups": hangups,
        "swa": swa,
        "tiers": tiers,
        "gpu": gpu,
        "gpu-ab": gpu_ab,
        "gpu-families": gpu_families,
        "gpu-forward": gpu_forward,
        "gpu-variants": gpu_variants,
        "gpu-fusion": lambda: gpu_variants("gpu-fusion"),
        "summary": summary,
        "llamacpp": llamacpp,
        "soak": soak,
        "criterion": criterion,
        "cpu": cpu_table,
        "cpu-amx": lambda: cpu_table("cpu-amx.json"),
        "cpu-avx2": lambda: cpu_table("cpu-avx2.json"),
        "cpu-avx512": lambda: cpu_table("cpu-avx512.json"),
        "cpu-256": lambda: cpu_table("cpu-256.json"),
    }.get(which)
    if make is None:
        sys.exit(__doc__)
    splice(which, "readme_tables.py", make())


if __name__ == "__main__":
    main()
