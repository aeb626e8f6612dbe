//! Tessera against llama.cpp (through the `llama-cpp-2` crate) on the same
//! GGUF file, the same thread count, in the same process, the two engines
//! alternating run by run: prefill, decode, the 12-turn chat (TTFT per
//! turn), 8 requests sharing a prefix, and 4 interleaved conversations; and
//! candle's `quantized_llama` for prefill and decode as the plain-Rust
//! baseline. Workloads come from `tessera-bench`, the same as `tessera
//! bench`'s.
//!
//! Writes `target/bench/vs-llamacpp.json` (an array of `{scenario, metric,
//! unit, tessera, llamacpp, ratio}`, ratio > 1 when Tessera is better),
//! `target/bench/vs-llamacpp-meta.json` (date, machine, commit, threads,
//! agreement of the two engines, per-turn TTFT) and two charts,
//! `target/bench/chat-ttft.png` and `target/bench/ratios.png`.
//!
//! Run: `just bench-llamacpp` (builds llama.cpp with the native CPU flags;
//! `just bench-deps` installs cmake, clang and a font with apt).

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
    Engine, EngineConfig, Event, GenerateRequest, Model, Prompt, SamplingParams, TurnOptions,
};
use tessera_model::Special;

const PREFILL_RUNS: usize = 5;
const DECODE_RUNS: usize = 3;
const SHARED_RUNS: usize = 3;
const CHAT_RUNS: usize = 3;
/// Tokens per llama.cpp decode call (and its context's batch size).
const LLAMA_BATCH: usize = 512;

/// llama.cpp with one context: sequence 0 is the "slot" whose KV is reused.
struct Llama<'a> {
    model: &'a LlamaModel,
    ctx: LlamaContext<'a>,
    /// Tokens whose K/V sequence 0 holds, in order.
    cached: Vec<u32>,
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
        self.cached.clear();
    }

    /// Decodes `tokens` into sequence `seq` from position `start`, in
    /// batches; returns the greedy token after the last one.
    fn feed(&mut self, seq: i32, start: usize, tokens: &[u32]) -> Result<u32> {
        let mut batch = LlamaBatch::new(LLAMA_BATCH, 1);
        let mut next = 0;
        for (c, chunk) in tokens.chunks(LLAMA_BATCH).enumerate() {
            batch.clear();
            let base = start + c * LLAMA_BATCH;
            for (i, &t) in chunk.iter().enumerate() {
                let last = c * LLAMA_BATCH + i == tokens.len() - 1;
                batch.add(LlamaToken(t as i32), (base + i) as i32, &[seq], last)?;
            }
            self.ctx.decode(&mut batch)?;
        }
        if let Some(last) = tokens.len().checked_sub(1) {
            next = argmax(self.ctx.get_logits_ith((last % LLAMA_BATCH) as i32));
        }
        Ok(next)
    }

    /// llama.cpp's best case for a new prompt on a kept KV: keep the common
    /// token prefix, remove the rest (`llama_memory_seq_rm`), decode only
    /// the new tokens. Returns the first token and the seconds to it.
    fn prompt(&mut self, ids: &[u32]) -> Result<(u32, f64)> {
        let t = Instant::now();
        let common = self
            .cached
            .iter()
            .zip(ids)
            .take_while(|(a, b)| a == b)
            .count()
            .min(ids.len() - 1);
        self.ctx.kv_cache_seq_rm(0, Some(common as u32), None)?;
        self.cached.truncate(common);
        let first = self.feed(0, common, &ids[common..])?;
        self.cached.extend_from_slice(&ids[common..]);
        Ok((first, t.elapsed().as_secs_f64()))
    }

    /// Greedy continuation of sequence 0 from `first` (included), `n`
    /// tokens at most, stopping at end of generation; the last token is not
    /// decoded (as in Tessera).
    fn reply(&mut self, first: u32, n: usize, stop_at_eog: bool) -> Result<Vec<u32>> {
        let mut out = vec![first];
        while out.len() < n {
            let last = *out.last().expect("non-empty");
            if stop_at_eog && self.model.vocab().is_eog(LlamaToken(last as i32)) {
                out.pop();
                return Ok(out);
            }
            let next = self.feed(0, self.cached.len(), &[last])?;
            self.cached.push(last);
            out.push(next);
        }
        if stop_at_eog
            && self
                .model
                .vocab()
                .is_eog(LlamaToken(*out.last().expect("non-empty") as i32))
        {
            out.pop();
        }
        Ok(out)
    }
}

/// One result row of the JSON.
struct Row {
    scenario: &'static str,
    metric: &'static str,
    unit: &'static str,
    tessera: f64,
    llamacpp: f64,
    /// Lower is better (times): ratio = llamacpp / tessera.
    lower_better: bool,
    candle: Option<f64>,
}

impl Row {
    fn ratio(&self) -> f64 {
        if self.lower_better {
            self.llamacpp / self.tessera
        } else {
            self.tessera / self.llamacpp
        }
    }

    fn json(&self) -> serde_json::Value {
        let mut v = json!({
            "scenario": self.scenario,
            "metric": self.metric,
            "unit": self.unit,
            "tessera": self.tessera,
            "llamacpp": self.llamacpp,
            "ratio": self.ratio(),
        });
        if let Some(c) = self.candle {
            v["candle"] = json!(c);
        }
        v
    }
}

struct Agreement {
    checks: Vec<serde_json::Value>,
}

impl Agreement {
    fn add(&mut self, what: &str, same: usize, of: usize) {
        println!("  agreement: {what}: {same} of {of}");
        self.checks
            .push(json!({ "what": what, "same": same, "of": of }));
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
    // Tessera's pools (rayon, used by candle and the kernels) get the same
    // thread count as llama.cpp.
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    let out_dir = PathBuf::from("target/bench");
    std::fs::create_dir_all(&out_dir)?;
    if !model_path.exists() {
        bail!("{} is missing: run `just model`", model_path.display());
    }

    println!(
        "Tessera vs llama.cpp on {} with {threads} threads",
        model_path.display()
    );
    let reuse = tessera_engine(&model_path, true)?;
    let plain = tessera_engine(&model_path, false)?;
    let model = reuse.model();
    let mut candle = Candle::load(&model_path)?;

    let mut backend = LlamaBackend::init()?;
    backend.void_logs();
    let lmodel = LlamaModel::load_from_file(&backend, &model_path, &LlamaModelParams::default())
        .with_context(|| format!("llama.cpp loading {}", model_path.display()))?;
    let cparams = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(8192))
        .with_n_batch(LLAMA_BATCH as u32)
        .with_n_ubatch(LLAMA_BATCH as u32)
        .with_n_seq_max(8)
        .with_kv_unified(true)
        .with_n_threads(threads as i32)
        .with_n_threads_batch(threads as i32);
    let ctx = lmodel.new_context(&backend, cparams)?;
    let mut llama = Llama {
        model: &lmodel,
        ctx,
        cached: Vec::new(),
    };
    let mut agree = Agreement { checks: Vec::new() };
    let mut rows = Vec::new();
    // VS_ONLY=decode,chat-ttft runs some scenarios only (development).
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
    let (mut ttft_reuse, mut ttft_plain, mut ttft_llama) = (Vec::new(), Vec::new(), Vec::new());

    // Token ids: both tokenizers on every text of the workloads.
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
    agree.add("token ids of the workload texts", same_ids, texts.len());

    if enabled("prefill") {
        println!("prefill: {PREFILL_TOKENS}-token prompt, median of {PREFILL_RUNS}");
        let ids = tessera_bench::prefill_prompt(model)?;
        let (mut t, mut l, mut c) = (Vec::new(), Vec::new(), Vec::new());
        let (mut first_t, mut first_l) = (0, 0);
        for _ in 0..PREFILL_RUNS {
            let done = plain.complete(&greedy(1, ids.clone()), &mut |_| {})?;
            first_t = done.tokens.first().copied().unwrap_or(u32::MAX);
            t.push(PREFILL_TOKENS as f64 / (done.timings.ttft_ms / 1e3));
            llama.clear();
            let (first, s) = llama.prompt(&ids)?;
            first_l = first;
            l.push(PREFILL_TOKENS as f64 / s);
            c.push(PREFILL_TOKENS as f64 / candle.prefill(&ids)?);
        }
        agree.add(
            "prefill: first greedy token",
            usize::from(first_t == first_l),
            1,
        );
        rows.push(Row {
            scenario: "prefill",
            metric: "prefill_tok_s",
            unit: "tok/s",
            tessera: median(t),
            llamacpp: median(l),
            lower_better: false,
            candle: Some(median(c)),
        });
    }

    if enabled("decode") {
        println!("decode: {DECODE_TOKENS} tokens, median of {DECODE_RUNS}");
        let short = tessera_bench::decode_prompt(model)?;
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
            llama.clear();
            let (first, _) = llama.prompt(&short)?;
            let s = Instant::now();
            toks_l = llama.reply(first, DECODE_TOKENS + 1, false)?;
            l.push(DECODE_TOKENS as f64 / s.elapsed().as_secs_f64());
            let (secs, toks) = candle.decode(&short, DECODE_TOKENS)?;
            toks_c = toks;
            c.push(DECODE_TOKENS as f64 / secs);
        }
        let prefix = toks_t
            .iter()
            .zip(&toks_l)
            .take_while(|(a, b)| a == b)
            .count();
        agree.add(
            "decode: identical leading greedy tokens, Tessera and llama.cpp",
            prefix,
            DECODE_TOKENS + 1,
        );
        let with_candle = toks_t
            .iter()
            .zip(&toks_c)
            .take_while(|(a, b)| a == b)
            .count();
        agree.add(
            "decode: identical leading greedy tokens, Tessera and candle",
            with_candle,
            DECODE_TOKENS + 1,
        );
        rows.push(Row {
            scenario: "decode",
            metric: "decode_tok_s",
            unit: "tok/s",
            tessera: median(t),
            llamacpp: median(l),
            lower_better: false,
            candle: Some(median(c)),
        });
    }

    if enabled("chat-ttft") {
        println!("chat-ttft: 12 turns, median of {CHAT_RUNS} runs per turn");
        let turns = chat.users.len();
        let (mut tr, mut tp, mut tl) = (
            vec![Vec::new(); turns],
            vec![Vec::new(); turns],
            vec![Vec::new(); turns],
        );
        let mut same_first = 0;
        for run in 0..CHAT_RUNS {
            reuse.clear_cache()?;
            llama.clear();
            let mut a = reuse.chat(Some(&chat.system));
            let mut b = plain.chat(Some(&chat.system));
            for (i, u) in chat.users.iter().enumerate() {
                let x = a.send(u, &opts, &mut |_| {})?;
                let y = b.send(u, &opts, &mut |_| {})?;
                let (first, s) = llama.prompt(&x.prompt_tokens)?;
                llama.reply(first, REPLY_TOKENS, true)?;
                if run == 0 {
                    same_first += usize::from(x.tokens.first() == Some(&first));
                }
                tr[i].push(x.timings.ttft_ms);
                tp[i].push(y.timings.ttft_ms);
                tl[i].push(s * 1e3);
            }
        }
        ttft_reuse = tr.into_iter().map(median).collect();
        ttft_plain = tp.into_iter().map(median).collect();
        ttft_llama = tl.into_iter().map(median).collect();
        agree.add(
            "chat: first greedy token of each turn",
            same_first,
            chat.users.len(),
        );
        let sum = |v: &[f64]| v.iter().sum::<f64>();
        rows.push(Row {
            scenario: "chat-ttft",
            metric: "ttft_sum_ms",
            unit: "ms",
            tessera: sum(&ttft_reuse),
            llamacpp: sum(&ttft_llama),
            lower_better: true,
            candle: None,
        });
        rows.push(Row {
            scenario: "chat-ttft",
            metric: "ttft_last_turn_ms",
            unit: "ms",
            tessera: *ttft_reuse.last().expect("12 turns"),
            llamacpp: *ttft_llama.last().expect("12 turns"),
            lower_better: true,
            candle: None,
        });
    }

    if enabled("shared-prefix") {
        println!("shared-prefix: 8 requests, 1,000-token prefix, median of {SHARED_RUNS}");
        let (prefix_ids, suffixes) = tessera_bench::shared_prefix(model)?;
        let prompts: Vec<Vec<u32>> = suffixes
            .iter()
            .map(|s| [prefix_ids.as_slice(), s].concat())
            .collect();
        let (mut t, mut l) = (Vec::new(), Vec::new());
        let (mut firsts_t, mut firsts_l) = (Vec::new(), Vec::new());
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
            llama.clear();
            let start = Instant::now();
            llama.feed(0, 0, &prefix_ids)?;
            for seq in 1..8 {
                llama.ctx.copy_kv_cache_seq(0, seq, None, None)?;
            }
            let total: usize = suffixes.iter().map(Vec::len).sum();
            let mut batch = LlamaBatch::new(total, 1);
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
            firsts_l = last_index
                .iter()
                .map(|&i| Some(argmax(llama.ctx.get_logits_ith(i))))
                .collect();
            l.push(start.elapsed().as_secs_f64() * 1e3);
            llama.clear();
        }
        let same = firsts_t
            .iter()
            .zip(&firsts_l)
            .filter(|(a, b)| a == b)
            .count();
        agree.add("shared-prefix: first greedy token of each request", same, 8);
        rows.push(Row {
            scenario: "shared-prefix",
            metric: "total_ttft_ms",
            unit: "ms",
            tessera: median(t),
            llamacpp: median(l),
            lower_better: true,
            candle: None,
        });
    }

    if enabled("interleaved") {
        println!("interleaved: 4 conversations × 6 rounds");
        reuse.clear_cache()?;
        llama.clear();
        let mut sessions: Vec<_> = convs.iter().map(|c| reuse.chat(Some(&c.system))).collect();
        let (mut sum_t, mut sum_l, mut same_first, mut turns) = (0.0, 0.0, 0, 0);
        for round in 0..convs[0].users.len() {
            for (c, conv) in convs.iter().enumerate() {
                let x = sessions[c].send(&conv.users[round], &opts, &mut |_| {})?;
                // One llama.cpp slot: prefix reuse only against what it holds.
                let (first, s) = llama.prompt(&x.prompt_tokens)?;
                llama.reply(first, REPLY_TOKENS, true)?;
                sum_t += x.timings.ttft_ms;
                sum_l += s * 1e3;
                same_first += usize::from(x.tokens.first() == Some(&first));
                turns += 1;
            }
        }
        agree.add(
            "interleaved: first greedy token of each turn",
            same_first,
            turns,
        );
        rows.push(Row {
            scenario: "interleaved",
            metric: "ttft_sum_ms",
            unit: "ms",
            tessera: sum_t,
            llamacpp: sum_l,
            lower_better: true,
            candle: None,
        });
    }

    // Report.
    println!();
    println!(
        "{:<14} {:<18} {:>12} {:>12} {:>8} {:>12}",
        "scenario", "metric", "tessera", "llama.cpp", "ratio", "candle"
    );
    for r in &rows {
        println!(
            "{:<14} {:<18} {:>12.1} {:>12.1} {:>7.2}x {:>12}",
            r.scenario,
            format!("{} ({})", r.metric, r.unit),
            r.tessera,
            r.llamacpp,
            r.ratio(),
            r.candle.map_or(String::new(), |c| format!("{c:.1}"))
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
        "llama_cpp": "llama.cpp as shipped by the llama-cpp-2 crate (version in Cargo.lock), built with GGML_NATIVE",
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
    if !ttft_reuse.is_empty() {
        charts::draw(&out_dir, &rows, &ttft_reuse, &ttft_plain, &ttft_llama)?;
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
            ("chat-ttft", _) => "chat: TTFT turn 12",
            ("shared-prefix", _) => "shared prefix",
            ("interleaved", _) => "interleaved",
            ("decode", _) => "decode",
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
        rows: &[Row],
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
        let names: Vec<&str> = rows.iter().map(short_name).collect();
        let top = rows.iter().map(Row::ratio).fold(1f64, f64::max) * 1.15;
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
