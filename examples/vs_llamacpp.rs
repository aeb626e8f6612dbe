//! Tessera against llama.cpp (through the `llama-cpp-2` crate) on the same
//! GGUF file, the same thread count, in the same process, both warmed up,
//! the two engines alternating run by run: prefill, decode, decode deep in
//! a context (128 tokens after 2,048) and in batches (4 and 8 sequences),
//! the 12-turn chat (TTFT per turn), 8 requests sharing a prefix, and 4
//! interleaved conversations; candle's `quantized_llama` for prefill and
//! decode as the plain-Rust baseline. In the chat scenarios each engine
//! carries its own replies, and llama.cpp gives each conversation its own
//! sequence (as a llama-server slot would). The default Q4_1 file is then
//! re-quantized by llama.cpp's own quantizer to Q4_0 and Q8_0 (the formats
//! it repacks for its fastest kernels) and prefill, decode, decode-long and
//! decode-batch run again on each. Workloads come from `tessera-bench`,
//! the same as `tessera bench`'s.
//!
//! Writes `target/bench/vs-llamacpp.json` (an array of `{model, scenario,
//! metric, unit, tessera, llamacpp, ratio}`, each side's median, min, max
//! and run count; ratio of medians > 1 when Tessera is better),
//! `target/bench/vs-llamacpp-meta.json` (date, machine, commit, threads,
//! agreement of the two engines, per-turn TTFT) and two charts,
//! `target/bench/chat-ttft.png` and `target/bench/ratios.png`.
//!
//! Run: `just bench-llamacpp` (builds llama.cpp with the native CPU flags;
//! `just bench-deps` installs cmake, clang and a font with apt).
//!
//! Settings, from the environment: `TESSERA_BENCH_THREADS` (default: every
//! core), `VS_ONLY` (comma-separated scenarios, e.g. `prefill,decode`),
//! `VS_VARIANTS=0` (no Q4_0/Q8_0 re-quantized files), `VS_GEMMA=0`,
//! `VS_CANDLE=0` (no candle baseline), `VS_CTX` (llama.cpp's context in
//! cells, default 8,192; the long and batched scenarios need it) and
//! `VS_OUT_DIR` (default `target/bench`).

use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;
use serde_json::json;
use tessera_bench::{median, Candle, DECODE_TOKENS, PREFILL_TOKENS, REPLY_TOKENS};
use tessera_engine::{
    Engine, EngineConfig, Event, GenerateRequest, Message, Model, Prompt, SamplingParams,
    TurnOptions,
};
use tessera_model::Special;

const PREFILL_RUNS: usize = 5;
const DECODE_RUNS: usize = 3;
const SHARED_RUNS: usize = 3;
const CHAT_RUNS: usize = 3;
/// The completion prompts whose greedy continuations the engines compare
/// (`COMPLETION_TOKENS` each, BOS as the model asks).
const COMPLETIONS: &[&str] = &[
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "The quick brown fox",
];
const COMPLETION_TOKENS: usize = 32;
const LONG_COMPLETION: usize = 1500;
/// Tokens per llama.cpp decode call (and its context's batch size).
const LLAMA_BATCH: usize = 512;

/// llama.cpp with one context and one sequence id per conversation (as a
/// llama-server with a slot per conversation), each keeping its own tokens.
struct Llama<'a> {
    model: &'a LlamaModel,
    ctx: LlamaContext<'a>,
    /// Tokens whose K/V each sequence holds, in order.
    cached: Vec<Vec<u32>>,
    /// The batch of one-sequence feeds, kept between calls.
    batch: LlamaBatch<'a>,
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Llama<'_> {
    fn clear(&mut self) {
        self.ctx.clear_kv_cache();
        self.cached.iter_mut().for_each(Vec::clear);
    }

    /// Decodes `tokens` into sequence `seq` from position `start`, in
    /// batches; returns the greedy token after the last one.
    fn feed(&mut self, seq: usize, start: usize, tokens: &[u32]) -> Result<u32> {
        let mut next = 0;
        for (c, chunk) in tokens.chunks(LLAMA_BATCH).enumerate() {
            self.batch.clear();
            let base = start + c * LLAMA_BATCH;
            for (i, &t) in chunk.iter().enumerate() {
                let last = c * LLAMA_BATCH + i == tokens.len() - 1;
                self.batch
                    .add(LlamaToken(t as i32), (base + i) as i32, &[seq as i32], last)?;
            }
            self.ctx.decode(&mut self.batch)?;
        }
        if let Some(last) = tokens.len().checked_sub(1) {
            next = argmax(self.ctx.get_logits_ith((last % LLAMA_BATCH) as i32));
        }
        Ok(next)
    }

    /// llama.cpp's best case for a new prompt on a kept sequence: keep the
    /// common token prefix, remove the rest (`llama_memory_seq_rm`), decode
    /// only the new tokens. Returns the first token and the seconds to it.
    fn prompt(&mut self, seq: usize, ids: &[u32]) -> Result<(u32, f64)> {
        let t = Instant::now();
        let common = self.cached[seq]
            .iter()
            .zip(ids)
            .take_while(|(a, b)| a == b)
            .count()
            .min(ids.len() - 1);
        self.ctx
            .kv_cache_seq_rm(seq as i32, Some(common as u32), None)?;
        self.cached[seq].truncate(common);
        let first = self.feed(seq, common, &ids[common..])?;
        self.cached[seq].extend_from_slice(&ids[common..]);
        Ok((first, t.elapsed().as_secs_f64()))
    }

    /// Greedy continuation of `seq` from `first` (included), `n` tokens at
    /// most, stopping at end of generation; the last token is not decoded
    /// (as in Tessera).
    fn reply(&mut self, seq: usize, first: u32, n: usize, stop_at_eog: bool) -> Result<Vec<u32>> {
        let eog = |t: u32| self.model.vocab().is_eog(LlamaToken(t as i32));
        let mut out = vec![first];
        while out.len() < n {
            let last = *out.last().expect("non-empty");
            if stop_at_eog && eog(last) {
                out.pop();
                return Ok(out);
            }
            let next = self.feed(seq, self.cached[seq].len(), &[last])?;
            self.cached[seq].push(last);
            out.push(next);
        }
        if stop_at_eog && eog(*out.last().expect("non-empty")) {
            out.pop();
        }
        Ok(out)
    }

    /// `prompt` into sequence 0 of the cleared context, then `n` greedy
    /// decode steps; the tokens (the first one included) and the steps'
    /// tok/s, the prompt not counted.
    fn timed_decode(&mut self, prompt: &[u32], n: usize) -> Result<(Vec<u32>, f64)> {
        self.clear();
        let (first, _) = self.prompt(0, prompt)?;
        let s = Instant::now();
        let toks = self.reply(0, first, n + 1, false)?;
        Ok((toks, n as f64 / s.elapsed().as_secs_f64()))
    }

    /// `prompts` prefilled into sequences `0..n`, then `steps` greedy
    /// decode steps of one token per sequence in one batch each (the batch
    /// reused); returns the aggregate decode tok/s.
    fn decode_together(&mut self, prompts: &[Vec<u32>], steps: usize) -> Result<f64> {
        self.clear();
        let mut next = Vec::new();
        for (s, p) in prompts.iter().enumerate() {
            next.push(self.feed(s, 0, p)?);
            self.cached[s] = p.clone();
        }
        let mut batch = LlamaBatch::new(prompts.len(), prompts.len() as i32);
        let start = Instant::now();
        for step in 0..steps {
            batch.clear();
            for (s, p) in prompts.iter().enumerate() {
                batch.add(
                    LlamaToken(next[s] as i32),
                    (p.len() + step) as i32,
                    &[s as i32],
                    true,
                )?;
            }
            self.ctx.decode(&mut batch)?;
            for (s, n) in next.iter_mut().enumerate() {
                *n = argmax(self.ctx.get_logits_ith(s as i32));
            }
        }
        let secs = start.elapsed().as_secs_f64();
        self.clear();
        Ok((steps * prompts.len()) as f64 / secs)
    }
}

/// One result row of the JSON: every run's value for each engine.
struct Row {
    model: String,
    scenario: &'static str,
    metric: &'static str,
    unit: &'static str,
    tessera: Vec<f64>,
    llamacpp: Vec<f64>,
    /// Lower is better (times): ratio = llamacpp / tessera.
    lower_better: bool,
    candle: Option<Vec<f64>>,
}

fn spread(v: &[f64]) -> (f64, f64, f64) {
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (median(v.to_vec()), min, max)
}

impl Row {
    fn ratio(&self) -> f64 {
        let (t, l) = (median(self.tessera.clone()), median(self.llamacpp.clone()));
        if self.lower_better {
            l / t
        } else {
            t / l
        }
    }

    fn json(&self) -> serde_json::Value {
        let side = |v: &[f64]| {
            let (m, lo, hi) = spread(v);
            json!({ "median": m, "min": lo, "max": hi, "runs": v.len() })
        };
        let mut v = json!({
            "model": self.model,
            "scenario": self.scenario,
            "metric": self.metric,
            "unit": self.unit,
            "tessera": side(&self.tessera),
            "llamacpp": side(&self.llamacpp),
            "ratio": self.ratio(),
            "higher_is_better": !self.lower_better,
        });
        if let Some(c) = &self.candle {
            v["candle"] = side(c);
        }
        v
    }
}

struct Agreement {
    checks: Vec<serde_json::Value>,
}

impl Agreement {
    fn add(&mut self, model: &str, what: &str, same: usize, of: usize) {
        println!("  agreement: {what}: {same} of {of}");
        self.checks
            .push(json!({ "model": model, "what": what, "same": same, "of": of }));
    }
}

fn tessera_engine(path: &Path, prefix_cache: bool) -> Result<Engine> {
    let model = Model::load(path, &mut |_, _| {})?;
    Ok(Engine::from_model(
        model,
        EngineConfig {
            prefix_cache,
            kv_memory: 512 << 20,
            ..EngineConfig::default()
        },
    )?)
}

fn greedy(max_tokens: usize, prompt: Vec<u32>) -> GenerateRequest {
    GenerateRequest {
        max_tokens,
        sampling: SamplingParams::greedy(),
        ..GenerateRequest::new(Prompt::Tokens(prompt))
    }
}

fn machine() -> serde_json::Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    json!({ "cpu": cpu, "cores": cores })
}

fn command_output(cmd: &str, args: &[&str]) -> String {
    std::process::Command::new(cmd)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// `src` re-quantized by llama.cpp's own quantizer to `ftype` (every
/// tensor, `pure`), written beside it once and reused.
fn variant(src: &Path, name: &str, ftype: llama_cpp_sys_2::llama_ftype) -> Result<PathBuf> {
    let out = src.with_file_name(
        src.file_name()
            .and_then(|f| f.to_str())
            .unwrap_or("model.gguf")
            .replace("Q4_1", name),
    );
    if out.exists() {
        return Ok(out);
    }
    let c = |p: &Path| std::ffi::CString::new(p.to_string_lossy().as_bytes()).expect("no NUL");
    let (inp, outp) = (c(src), c(&out));
    // SAFETY: plain C calls with valid NUL-terminated paths and a params
    // struct from llama.cpp's own defaults.
    let rc = unsafe {
        let mut params = llama_cpp_sys_2::llama_model_quantize_default_params();
        params.ftype = ftype;
        params.allow_requantize = true;
        params.pure_ = true;
        llama_cpp_sys_2::llama_model_quantize(inp.as_ptr(), outp.as_ptr(), &params)
    };
    if rc != 0 {
        let _ = std::fs::remove_file(&out);
        bail!("llama.cpp could not quantize {} to {name}", src.display());
    }
    Ok(out)
}

/// Everything one model file is measured on: prefill, decode, decode-long
/// and decode-batch always; the KV-cache scenarios when `full`.
#[allow(clippy::too_many_arguments)]
fn bench_model(
    backend: &LlamaBackend,
    model_path: &Path,
    label: &str,
    threads: usize,
    full: bool,
    agree: &mut Agreement,
    rows: &mut Vec<Row>,
    ttft: &mut [Vec<f64>; 3],
) -> Result<()> {
    println!("== {label}: {}", model_path.display());
    let reuse = tessera_engine(model_path, true)?;
    let plain = tessera_engine(model_path, false)?;
    let model = reuse.model();
    // candle's quantized_llama runs the Llama family only: the full runs
    // (VS_CANDLE=0 leaves it out).
    let mut candle = if full && std::env::var("VS_CANDLE").as_deref() != Ok("0") {
        Some(Candle::load(model_path, &candle_core::Device::Cpu)?)
    } else {
        None
    };
    let lmodel = LlamaModel::load_from_file(backend, model_path, &LlamaModelParams::default())
        .with_context(|| format!("llama.cpp loading {}", model_path.display()))?;
    // Flash attention at the library's default (`auto`: on for the CPU),
    // or off (`Some(false)`).
    let context = |flash: Option<bool>| -> Result<Llama> {
        let mut cparams = LlamaContextParams::default()
            .with_n_ctx(NonZeroU32::new(
                std::env::var("VS_CTX")
                    .ok()
                    .and_then(|c| c.parse().ok())
                    .unwrap_or(8192),
            ))
            .with_n_batch(LLAMA_BATCH as u32)
            .with_n_ubatch(LLAMA_BATCH as u32)
            .with_n_seq_max(8)
            .with_kv_unified(true)
            .with_n_threads(threads as i32)
            .with_n_threads_batch(threads as i32);
        if flash == Some(false) {
            cparams = cparams
                .with_flash_attention_policy(llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_DISABLED);
        }
        Ok(Llama {
            model: &lmodel,
            ctx: lmodel.new_context(backend, cparams)?,
            cached: vec![Vec::new(); 8],
            batch: LlamaBatch::new(LLAMA_BATCH, 1),
        })
    };
    // llama.cpp's best case in every scenario: each one is timed with
    // flash attention at the library's default (`auto`: on for the CPU)
    // and off, and the faster counts. (On an Intel Xeon with AMX,
    // 2026-12-08, on was 1.5× faster at prefill and off 2.4× faster
    // after 2,048 tokens.) Greedy tokens for the agreement counts come
    // from the default.
    let mut llama = context(None)?;
    let mut off = context(Some(false))?;
    let only = std::env::var("VS_ONLY").ok();
    let enabled = |name: &str| {
        only.as_ref()
            .is_none_or(|o| o.split(',').any(|x| x == name))
    };
    let opts = TurnOptions {
        sampling: SamplingParams::greedy(),
        max_tokens: REPLY_TOKENS,
        ..TurnOptions::default()
    };
    let row = |scenario, metric, unit, t: Vec<f64>, l: Vec<f64>, lower_better, candle| Row {
        model: label.to_string(),
        scenario,
        metric,
        unit,
        tessera: t,
        llamacpp: l,
        lower_better,
        candle,
    };

    // Warm-up, untimed: both engines load their pages and spin up threads.
    let short = tessera_bench::decode_prompt(model)?;
    plain.complete(&greedy(16, short.clone()), &mut |_| {})?;
    for ctx in [&mut llama, &mut off] {
        ctx.clear();
        let (first, _) = ctx.prompt(0, &short)?;
        ctx.reply(0, first, 16, false)?;
    }

    if enabled("prefill") {
        println!("prefill: {PREFILL_TOKENS}-token prompt, {PREFILL_RUNS} runs");
        let ids = tessera_bench::prefill_prompt(model)?;
        let (mut t, mut l, mut c) = (Vec::new(), Vec::new(), Vec::new());
        let (mut first_t, mut first_l) = (0, 0);
        for _ in 0..PREFILL_RUNS {
            let done = plain.complete(&greedy(1, ids.clone()), &mut |_| {})?;
            first_t = done.tokens.first().copied().unwrap_or(u32::MAX);
            t.push(PREFILL_TOKENS as f64 / (done.timings.ttft_ms / 1e3));
            let mut best = f64::MAX;
            for (k, ctx) in [&mut llama, &mut off].into_iter().enumerate() {
                ctx.clear();
                let (first, s) = ctx.prompt(0, &ids)?;
                if k == 0 {
                    first_l = first;
                }
                best = best.min(s);
            }
            l.push(PREFILL_TOKENS as f64 / best);
            if let Some(candle) = candle.as_mut() {
                c.push(PREFILL_TOKENS as f64 / candle.prefill(&ids)?);
            }
        }
        agree.add(
            label,
            "prefill: first greedy token",
            usize::from(first_t == first_l),
            1,
        );
        rows.push(row(
            "prefill",
            "prefill_tok_s",
            "tok/s",
            t,
            l,
            false,
            candle.is_some().then_some(c),
        ));
    }

    if enabled("decode") {
        println!("decode: {DECODE_TOKENS} tokens, {DECODE_RUNS} runs");
        let (mut t, mut l, mut c) = (Vec::new(), Vec::new(), Vec::new());
        let (mut toks_t, mut toks_l, mut toks_c) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..DECODE_RUNS {
            let req = GenerateRequest {
                ignore_eos: true,
                ..greedy(DECODE_TOKENS + 1, short.clone())
            };
            let done = plain.complete(&req, &mut |_| {})?;
            t.push(done.timings.decode_tok_s);
            toks_t = done.tokens;
            let mut best = 0f64;
            for (k, ctx) in [&mut llama, &mut off].into_iter().enumerate() {
                let (toks, tok_s) = ctx.timed_decode(&short, DECODE_TOKENS)?;
                best = best.max(tok_s);
                if k == 0 {
                    toks_l = toks;
                }
            }
            l.push(best);
            if let Some(candle) = candle.as_mut() {
                let (secs, toks) = candle.decode(&short, DECODE_TOKENS)?;
                toks_c = toks;
                c.push(DECODE_TOKENS as f64 / secs);
            }
        }
        let lead = |a: &[u32], b: &[u32]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
        agree.add(
            label,
            "decode: identical leading greedy tokens, Tessera and llama.cpp",
            lead(&toks_t, &toks_l),
            DECODE_TOKENS + 1,
        );
        if candle.is_some() {
            agree.add(
                label,
                "decode: identical leading greedy tokens, Tessera and candle",
                lead(&toks_t, &toks_c),
                DECODE_TOKENS + 1,
            );
        }
        rows.push(row(
            "decode",
            "decode_tok_s",
            "tok/s",
            t,
            l,
            false,
            candle.is_some().then_some(c),
        ));
    }

    if enabled("agreement") {
        println!(
            "agreement: greedy completions of {} prompts",
            COMPLETIONS.len()
        );
        let (mut same, mut of) = (0, 0);
        // And one prompt of LONG_COMPLETION tokens of the perplexity text,
        // past Gemma 3's 512-token window.
        let book = std::fs::read_to_string("data/pride-and-prejudice.txt")?;
        let cut = book
            .char_indices()
            .nth(LONG_COMPLETION * 8)
            .map_or(book.len(), |(i, _)| i);
        let mut long = model
            .tokenizer
            .encode(&book[..cut], Special::AsText, true)?;
        long.truncate(LONG_COMPLETION);
        let prompts = COMPLETIONS
            .iter()
            .map(|t| {
                Ok((
                    t.to_string(),
                    model.tokenizer.encode(t, Special::AsText, true)?,
                ))
            })
            .chain([Ok((
                format!("{LONG_COMPLETION} tokens of data/pride-and-prejudice.txt"),
                long,
            ))])
            .collect::<Result<Vec<(String, Vec<u32>)>>>()?;
        for (text, ids) in &prompts {
            let req = GenerateRequest {
                ignore_eos: true,
                ..greedy(COMPLETION_TOKENS, ids.clone())
            };
            let toks_t = plain.complete(&req, &mut |_| {})?.tokens;
            llama.clear();
            let (first, _) = llama.prompt(0, ids)?;
            let toks_l = llama.reply(0, first, COMPLETION_TOKENS, false)?;
            let lead = toks_t
                .iter()
                .zip(&toks_l)
                .take_while(|(x, y)| x == y)
                .count();
            println!(
                "  {text:?}: {lead} of {COMPLETION_TOKENS} leading tokens equal\n    Tessera:   {:?}\n    llama.cpp: {:?}",
                model.tokenizer.decode(&toks_t)?,
                model.tokenizer.decode(&toks_l)?
            );
            same += lead;
            of += COMPLETION_TOKENS;
        }
        agree.add(
            label,
            "completions: identical leading greedy tokens, summed over the prompts",
            same,
            of,
        );
    }

    if enabled("decode-long") {
        let long = tessera_bench::long_prompt(model)?;
        println!(
            "decode-long: {DECODE_TOKENS} tokens after {}, {DECODE_RUNS} runs",
            long.len()
        );
        let (mut t, mut l) = (Vec::new(), Vec::new());
        for _ in 0..DECODE_RUNS {
            t.push(tessera_bench::decode_together(
                &plain,
                std::slice::from_ref(&long),
            )?);
            let mut best = 0f64;
            for (fa, ctx) in [("auto", &mut llama), ("off", &mut off)] {
                let (_, tok_s) = ctx.timed_decode(&long, DECODE_TOKENS)?;
                println!("  llama.cpp, flash attention {fa}: {tok_s:.1} tok/s");
                best = best.max(tok_s);
            }
            l.push(best);
        }
        rows.push(row(
            "decode-long",
            "decode_tok_s",
            "tok/s",
            t,
            l,
            false,
            None,
        ));
    }

    if enabled("decode-batch") {
        for n in [4, 8] {
            println!("decode-batch: {n} sequences × {DECODE_TOKENS} tokens, {DECODE_RUNS} runs");
            let prompts = tessera_bench::batch_prompts(model, n)?;
            let (mut t, mut l) = (Vec::new(), Vec::new());
            for _ in 0..DECODE_RUNS {
                t.push(tessera_bench::decode_together(&plain, &prompts)?);
                let on = llama.decode_together(&prompts, DECODE_TOKENS)?;
                l.push(on.max(off.decode_together(&prompts, DECODE_TOKENS)?));
            }
            let metric = if n == 4 {
                "batch4_tok_s"
            } else {
                "batch8_tok_s"
            };
            rows.push(row("decode-batch", metric, "tok/s", t, l, false, None));
        }
    }

    if !full {
        return Ok(());
    }
    let chat = tessera_bench::chat(model)?;
    let convs = tessera_bench::interleaved(model)?;
    let mut texts: Vec<&str> = vec![chat.system.as_str()];
    texts.extend(chat.users.iter().map(String::as_str));
    for c in &convs {
        texts.push(&c.system);
        texts.extend(c.users.iter().map(String::as_str));
    }
    let same_ids = texts
        .iter()
        .filter(|t| {
            let ours = model.tokenizer.encode(t, Special::AsText, false).ok();
            let theirs: Vec<u32> = lmodel
                .vocab()
                .tokenize(t.as_bytes(), false, false)
                .iter()
                .map(|t| t.0 as u32)
                .collect();
            ours.as_deref() == Some(theirs.as_slice())
        })
        .count();
    agree.add(
        label,
        "token ids of the workload texts",
        same_ids,
        texts.len(),
    );

    // llama.cpp's turn: its own history (its replies as text, the whole
    // prompt re-tokenized as llama-server does), its own sequence.
    let llama_turn = |llama: &mut Llama,
                      seq: usize,
                      msgs: &mut Vec<Message>,
                      user: &str|
     -> Result<(u32, f64)> {
        msgs.push(Message::new("user", user));
        let ids = model.template.encode(&model.tokenizer, msgs, true)?;
        let (first, s) = llama.prompt(seq, &ids)?;
        let reply = llama.reply(seq, first, REPLY_TOKENS, true)?;
        msgs.push(Message::new("assistant", model.tokenizer.decode(&reply)?));
        Ok((first, s))
    };

    if enabled("chat-ttft") {
        println!("chat-ttft: 12 turns, {CHAT_RUNS} runs");
        let turns = chat.users.len();
        let mut per_turn = [
            vec![Vec::new(); turns],
            vec![Vec::new(); turns],
            vec![Vec::new(); turns],
        ];
        // llama.cpp's turns with flash attention off, kept apart: the
        // setting whose median sum is lower counts.
        let mut per_turn_off = vec![Vec::new(); turns];
        let (mut sums_t, mut sums_l, mut sums_off) = (Vec::new(), Vec::new(), Vec::new());
        let mut same_first = 0;
        for run in 0..CHAT_RUNS {
            reuse.clear_cache()?;
            llama.clear();
            off.clear();
            let mut a = reuse.chat(Some(&chat.system));
            let mut b = plain.chat(Some(&chat.system));
            let mut msgs = vec![Message::new("system", chat.system.as_str())];
            let mut msgs_off = msgs.clone();
            let (mut st, mut sl, mut so) = (0.0, 0.0, 0.0);
            for (i, u) in chat.users.iter().enumerate() {
                let x = a.send(u, &opts, &mut |_| {})?;
                let y = b.send(u, &opts, &mut |_| {})?;
                let (first, s) = llama_turn(&mut llama, 0, &mut msgs, u)?;
                let (_, s_off) = llama_turn(&mut off, 0, &mut msgs_off, u)?;
                if run == 0 {
                    same_first += usize::from(x.tokens.first() == Some(&first));
                }
                per_turn[0][i].push(x.timings.ttft_ms);
                per_turn[1][i].push(y.timings.ttft_ms);
                per_turn[2][i].push(s * 1e3);
                per_turn_off[i].push(s_off * 1e3);
                st += x.timings.ttft_ms;
                sl += s * 1e3;
                so += s_off * 1e3;
            }
            sums_t.push(st);
            sums_l.push(sl);
            sums_off.push(so);
        }
        let (on_ms, off_ms) = (median(sums_l.clone()), median(sums_off.clone()));
        println!(
            "  llama.cpp's sum of TTFT: {on_ms:.0} ms with flash attention auto, {off_ms:.0} off"
        );
        if off_ms < on_ms {
            sums_l = sums_off;
            per_turn[2] = per_turn_off;
        }
        for (out, turns) in ttft.iter_mut().zip(&per_turn) {
            *out = turns.iter().map(|v| median(v.clone())).collect();
        }
        agree.add(
            label,
            "chat: first greedy token of each turn (each engine with its own history)",
            same_first,
            turns,
        );
        let last = |i: usize| per_turn[i].last().cloned().unwrap_or_default();
        rows.push(row(
            "chat-ttft",
            "ttft_sum_ms",
            "ms",
            sums_t,
            sums_l,
            true,
            None,
        ));
        rows.push(row(
            "chat-ttft",
            "ttft_last_turn_ms",
            "ms",
            last(0),
            last(2),
            true,
            None,
        ));
    }

    if enabled("shared-prefix") {
        println!("shared-prefix: 8 requests, 1,000-token prefix, {SHARED_RUNS} runs");
        let (prefix_ids, suffixes) = tessera_bench::shared_prefix(model)?;
        let prompts: Vec<Vec<u32>> = suffixes
            .iter()
            .map(|s| [prefix_ids.as_slice(), s].concat())
            .collect();
        let (mut t, mut l) = (Vec::new(), Vec::new());
        let (mut firsts_t, mut firsts_l) = (Vec::new(), Vec::new());
        let total: usize = suffixes.iter().map(Vec::len).sum();
        let mut batch = LlamaBatch::new(total, 8);
        for _ in 0..SHARED_RUNS {
            reuse.clear_cache()?;
            let start = Instant::now();
            let streams: Vec<_> = prompts
                .iter()
                .map(|p| reuse.generate(greedy(1, p.clone())))
                .collect::<std::result::Result<_, _>>()?;
            firsts_t.clear();
            for s in streams {
                for ev in s {
                    match ev {
                        Event::Done(c) => firsts_t.push(c.tokens.first().copied()),
                        Event::Error(e) => return Err(e.into()),
                        Event::Token { .. } => {}
                    }
                }
            }
            t.push(start.elapsed().as_secs_f64() * 1e3);
            // llama.cpp: the prefix once in sequence 0, copied to 1..8
            // (`llama_memory_seq_cp`), then all 8 suffixes in one batch.
            let mut best = f64::MAX;
            for (k, llama) in [&mut llama, &mut off].into_iter().enumerate() {
                llama.clear();
                let start = Instant::now();
                llama.feed(0, 0, &prefix_ids)?;
                for seq in 1..8 {
                    llama.ctx.copy_kv_cache_seq(0, seq, None, None)?;
                }
                batch.clear();
                let mut last_index = Vec::new();
                for (seq, s) in suffixes.iter().enumerate() {
                    for (i, &tok) in s.iter().enumerate() {
                        let last = i == s.len() - 1;
                        if last {
                            last_index.push(batch.n_tokens());
                        }
                        batch.add(
                            LlamaToken(tok as i32),
                            (prefix_ids.len() + i) as i32,
                            &[seq as i32],
                            last,
                        )?;
                    }
                }
                llama.ctx.decode(&mut batch)?;
                best = best.min(start.elapsed().as_secs_f64() * 1e3);
                if k == 0 {
                    firsts_l = last_index
                        .iter()
                        .map(|&i| Some(argmax(llama.ctx.get_logits_ith(i))))
                        .collect();
                }
                llama.clear();
            }
            l.push(best);
        }
        let same = firsts_t
            .iter()
            .zip(&firsts_l)
            .filter(|(a, b)| a == b)
            .count();
        agree.add(
            label,
            "shared-prefix: first greedy token of each request",
            same,
            8,
        );
        rows.push(row(
            "shared-prefix",
            "total_ttft_ms",
            "ms",
            t,
            l,
            true,
            None,
        ));
    }

    if enabled("interleaved") {
        println!("interleaved: 4 conversations × 6 rounds, llama.cpp with a sequence each");
        reuse.clear_cache()?;
        llama.clear();
        off.clear();
        let mut sessions: Vec<_> = convs.iter().map(|c| reuse.chat(Some(&c.system))).collect();
        let mut histories: Vec<Vec<Message>> = convs
            .iter()
            .map(|c| vec![Message::new("system", c.system.as_str())])
            .collect();
        let mut histories_off = histories.clone();
        let (mut sum_t, mut sum_l, mut sum_off, mut same_first, mut turns) = (0.0, 0.0, 0.0, 0, 0);
        for round in 0..convs[0].users.len() {
            for (c, conv) in convs.iter().enumerate() {
                let x = sessions[c].send(&conv.users[round], &opts, &mut |_| {})?;
                let (first, s) = llama_turn(&mut llama, c, &mut histories[c], &conv.users[round])?;
                let (_, s_off) =
                    llama_turn(&mut off, c, &mut histories_off[c], &conv.users[round])?;
                sum_t += x.timings.ttft_ms;
                sum_l += s * 1e3;
                sum_off += s_off * 1e3;
                same_first += usize::from(x.tokens.first() == Some(&first));
                turns += 1;
            }
        }
        println!(
            "  llama.cpp's sum of TTFT: {sum_l:.0} ms with flash attention auto, {sum_off:.0} off"
        );
        let sum_l = sum_l.min(sum_off);
        agree.add(
            label,
            "interleaved: first greedy token of each turn (each engine with its own history)",
            same_first,
            turns,
        );
        rows.push(row(
            "interleaved",
            "ttft_sum_ms",
            "ms",
            vec![sum_t],
            vec![sum_l],
            true,
            None,
        ));
    }
    Ok(())
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let model_path = PathBuf::from(
        args.next()
            .unwrap_or_else(|| "models/SmolLM2-135M-Instruct.Q4_1.gguf".into()),
    );
    let threads = std::env::var("TESSERA_BENCH_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    // Tessera's pools (rayon, and the forward's step pool sized from it)
    // get the same thread count as llama.cpp.
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    // VS_OUT_DIR: where the results go (scripts/harness_check.py keeps its
    // runs apart from the README's).
    let out_dir =
        PathBuf::from(std::env::var("VS_OUT_DIR").unwrap_or_else(|_| "target/bench".into()));
    std::fs::create_dir_all(&out_dir)?;
    if !model_path.exists() {
        bail!("{} is missing: run `just model`", model_path.display());
    }
    println!("Tessera vs llama.cpp with {threads} threads");
    let mut backend = LlamaBackend::init()?;
    backend.void_logs();
    let mut agree = Agreement { checks: Vec::new() };
    let mut rows = Vec::new();
    let mut ttft = [Vec::new(), Vec::new(), Vec::new()];
    bench_model(
        &backend,
        &model_path,
        "Q4_1",
        threads,
        true,
        &mut agree,
        &mut rows,
        &mut ttft,
    )?;
    // The same model in the formats llama.cpp repacks for its fastest
    // kernels, made by llama.cpp's quantizer (VS_VARIANTS=0 skips them).
    if std::env::var("VS_VARIANTS").as_deref() != Ok("0") {
        for (name, ftype) in [
            ("Q4_0", llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q4_0),
            ("Q8_0", llama_cpp_sys_2::LLAMA_FTYPE_MOSTLY_Q8_0),
        ] {
            let path = variant(&model_path, name, ftype)?;
            bench_model(
                &backend, &path, name, threads, false, &mut agree, &mut rows, &mut ttft,
            )?;
        }
    }
    // Gemma 3 270M Q4_K_M, when fetched (`just model gemma3`): sliding
    // windows and K-quants (VS_GEMMA=0 skips it).
    let gemma = PathBuf::from("models/gemma-3-270m-q4_k_m.gguf");
    if std::env::var("VS_GEMMA").as_deref() != Ok("0") && gemma.exists() {
        bench_model(
            &backend, &gemma, "Gemma3", threads, false, &mut agree, &mut rows, &mut ttft,
        )?;
    }
    let [ttft_reuse, ttft_plain, ttft_llama] = ttft;

    // Report.
    println!();
    println!(
        "{:<6} {:<14} {:<20} {:>22} {:>22} {:>8}",
        "model", "scenario", "metric", "tessera (min-max)", "llama.cpp (min-max)", "ratio"
    );
    for r in &rows {
        let cell = |v: &[f64]| {
            let (m, lo, hi) = spread(v);
            format!("{m:.1} ({lo:.1}-{hi:.1})")
        };
        println!(
            "{:<6} {:<14} {:<20} {:>22} {:>22} {:>7.2}x",
            r.model,
            r.scenario,
            format!("{} ({})", r.metric, r.unit),
            cell(&r.tessera),
            cell(&r.llamacpp),
            r.ratio(),
        );
    }
    let json_rows: Vec<_> = rows.iter().map(Row::json).collect();
    std::fs::write(
        out_dir.join("vs-llamacpp.json"),
        serde_json::to_string_pretty(&json_rows)?,
    )?;
    let meta = json!({
        "date": command_output("date", &["-u", "+%Y-%m-%d"]),
        "machine": machine(),
        "commit": command_output("git", &["rev-parse", "--short", "HEAD"]),
        "threads": threads,
        "model": model_path.display().to_string(),
        "llama_cpp": "llama.cpp as shipped by the llama-cpp-sys-2 crate (version in Cargo.lock), built with GGML_NATIVE",
        "variants": "Q4_0 and Q8_0: the default file re-quantized by llama.cpp's llama_model_quantize (pure, allow_requantize)",
        "agreement": agree.checks,
        "chat_ttft_ms": {
            "tessera": ttft_reuse,
            "tessera_no_reuse": ttft_plain,
            "llamacpp": ttft_llama,
        },
    });
    std::fs::write(
        out_dir.join("vs-llamacpp-meta.json"),
        serde_json::to_string_pretty(&meta)?,
    )?;
    let main_rows: Vec<&Row> = rows.iter().filter(|r| r.model == "Q4_1").collect();
    if !ttft_reuse.is_empty() {
        charts::draw(&out_dir, &main_rows, &ttft_reuse, &ttft_plain, &ttft_llama)?;
    }
    println!(
        "\nwrote {0}/vs-llamacpp.json, {0}/vs-llamacpp-meta.json, {0}/chat-ttft.png, {0}/ratios.png",
        out_dir.display()
    );
    Ok(())
}

mod charts {
    use std::path::Path;

    use anyhow::{Context, Result};
    use plotters::prelude::*;
    use plotters::style::{register_font, FontStyle};

    use super::Row;

    fn short_name(r: &Row) -> &'static str {
        match (r.scenario, r.metric) {
            ("chat-ttft", "ttft_sum_ms") => "chat: TTFT sum",
            ("chat-ttft", _) => "chat: turn 12",
            ("shared-prefix", _) => "shared prefix",
            ("interleaved", _) => "interleaved",
            ("decode", _) => "decode",
            ("decode-long", _) => "decode @2k",
            ("decode-batch", "batch4_tok_s") => "batch 4",
            ("decode-batch", _) => "batch 8",
            _ => "prefill",
        }
    }

    const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

    fn font() -> Result<()> {
        let bytes = std::fs::read(FONT)
            .with_context(|| format!("reading {FONT} for the charts (run `just bench-deps`)"))?;
        register_font(
            "sans-serif",
            FontStyle::Normal,
            Box::leak(bytes.into_boxed_slice()),
        )
        .map_err(|_| anyhow::anyhow!("{FONT} is not a usable font"))
    }

    pub fn draw(
        dir: &Path,
        rows: &[&Row],
        reuse: &[f64],
        plain: &[f64],
        llama: &[f64],
    ) -> Result<()> {
        font()?;
        let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing a chart: {e}");

        let path = dir.join("chat-ttft.png");
        let root = BitMapBackend::new(&path, (900, 520)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let top = reuse
            .iter()
            .chain(plain)
            .chain(llama)
            .fold(0f64, |a, &b| a.max(b))
            * 1.1;
        let mut chart = ChartBuilder::on(&root)
            .caption("TTFT per chat turn (lower is better)", ("sans-serif", 24))
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(1f64..reuse.len() as f64, 0f64..top)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("turn")
            .y_desc("TTFT (ms)")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .label_style(("sans-serif", 14))
            .draw()
            .map_err(|e| err(&e))?;
        let series = [
            ("Tessera (prefix reuse)", reuse, RGBColor(200, 60, 20)),
            ("Tessera, reuse off", plain, RGBColor(120, 120, 120)),
            (
                "llama.cpp (common-prefix reuse)",
                llama,
                RGBColor(30, 90, 200),
            ),
        ];
        for (name, data, color) in series {
            chart
                .draw_series(LineSeries::new(
                    data.iter().enumerate().map(|(i, &y)| (i as f64 + 1.0, y)),
                    color.stroke_width(3),
                ))
                .map_err(|e| err(&e))?
                .label(name)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font(("sans-serif", 16))
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;

        let path = dir.join("ratios.png");
        let root = BitMapBackend::new(&path, (900, 520)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let names: Vec<&str> = rows.iter().map(|r| short_name(r)).collect();
        let top = rows.iter().map(|r| r.ratio()).fold(1f64, f64::max) * 1.15;
        let n = rows.len();
        let mut chart = ChartBuilder::on(&root)
            .caption(
                "Tessera / llama.cpp (above 1: Tessera better)",
                ("sans-serif", 24),
            )
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d((0..n.saturating_sub(1)).into_segmented(), 0f64..top)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n)
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => names.get(*i).map_or(String::new(), |s| s.to_string()),
                _ => String::new(),
            })
            .y_desc("ratio")
            .label_style(("sans-serif", 14))
            .draw()
            .map_err(|e| err(&e))?;
        chart
            .draw_series(rows.iter().enumerate().map(|(i, r)| {
                let color = if r.ratio() >= 1.0 {
                    RGBColor(200, 60, 20)
                } else {
                    RGBColor(30, 90, 200)
                };
                let mut bar = Rectangle::new(
                    [
                        (SegmentValue::Exact(i), 0.0),
                        (SegmentValue::Exact(i + 1), r.ratio()),
                    ],
                    color.filled(),
                );
                bar.set_margin(0, 0, 14, 14);
                bar
            }))
            .map_err(|e| err(&e))?;
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(SegmentValue::Exact(0), 1.0), (SegmentValue::Exact(n), 1.0)],
                BLACK.stroke_width(2),
            )))
            .map_err(|e| err(&e))?;
        chart
            .draw_series(rows.iter().enumerate().map(|(i, r)| {
                Text::new(
                    format!("{:.2}x", r.ratio()),
                    (SegmentValue::CenterOf(i), r.ratio() + top * 0.04),
                    ("sans-serif", 16).into_font().color(&BLACK),
                )
            }))
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
        Ok(())
    }
}
