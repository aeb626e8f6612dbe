//! `tessera bench --scenario sliding-window`: what the sliding-window pool
//! (Gemma 3's local layers) saves and keeps, on a model that has such
//! layers, in one run:
//!
//! - **Memory.** An 8,192-token prompt and 32 greedy tokens on the smallest
//!   pool that holds them (every token in the global layers, one request's
//!   window and chunk in the sliding ones), beside an engine whose sliding
//!   layers keep every token (`--swa-full`, full attention's memory): the
//!   pools' bytes, the peak bytes held, the speed, and whether the tokens
//!   are the same.
//! - **Reuse.** A 12-turn conversation without a chat template (each turn
//!   the whole history plus ~150 new tokens, 32-token greedy replies) on
//!   that small pool, beside the same engine with reuse off: the share of
//!   prompt tokens served from the cache, TTFT, and the replies.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::{bail, Result};
use tessera_engine::{Completion, Engine, EngineConfig, GenerateRequest, Prompt, SamplingParams};
use tessera_model::{Model, Special};

use tessera_bench::{median, text};

use crate::bench::BenchArgs;
use crate::load_model;
use crate::scenarios::emit;

const PROMPT: usize = 8192;
const NEW: usize = 32;
const TURNS: usize = 12;
const FIRST: usize = 600;
const USER: usize = 150;

fn greedy(ids: &[u32], n: usize) -> GenerateRequest {
    GenerateRequest {
        max_tokens: n,
        sampling: SamplingParams::greedy(),
        ignore_eos: true,
        ..GenerateRequest::new(Prompt::Tokens(ids.to_vec()))
    }
}

/// Runs `req`, sampling the bytes of held KV blocks every 10 ms (often
/// enough for a pool that changes a block per 16 tokens, rarely enough not
/// to slow the steps); the completion and the most bytes seen held.
fn run_watched(engine: &Engine, req: &GenerateRequest) -> Result<(Completion, usize)> {
    let peak = Arc::new(AtomicUsize::new(engine.stats().kv_bytes_held));
    let done = Arc::new(AtomicBool::new(false));
    let out = std::thread::scope(|s| {
        let (peak2, done2) = (peak.clone(), done.clone());
        s.spawn(move || {
            while !done2.load(Ordering::Relaxed) {
                peak2.fetch_max(engine.stats().kv_bytes_held, Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        });
        let out = engine.complete(req, &mut |_| {});
        done.store(true, Ordering::Relaxed);
        out
    })?;
    Ok((out, peak.load(Ordering::Relaxed)))
}

fn tokens(model: &Model, seed: u64, n: usize) -> Result<Vec<u32>> {
    let t = text(model, seed, n + 16)?;
    let mut ids = model.tokenizer.encode(&t, Special::AsText, seed == 0)?;
    ids.truncate(n);
    if ids.len() < n {
        bail!("the text has only {} tokens", ids.len());
    }
    Ok(ids)
}

pub fn sliding_window(model: Model, args: &BenchArgs) -> Result<()> {
    let mc = model.config().clone();
    let Some(window) = mc.sliding_window() else {
        bail!(
            "{} has no sliding-window layers (this scenario is for models like Gemma 3)",
            model.path.display()
        );
    };
    let runs = args.runs.max(1);
    let prompt = tokens(&model, 0, PROMPT)?;
    let bs = args.kv.config(true).block_size;
    let row = mc.kv_bytes_per_token(args.kv.config(true).cache_dtype) / mc.n_layers;
    let n_sliding = mc.num_sliding_layers();
    let blocks = (PROMPT + NEW).div_ceil(bs) + 1;
    let chunk = EngineConfig::default().prefill_chunk;
    let least = (window + chunk).div_ceil(bs) + 3;
    // The smallest pool for the request: every token in the global
    // layers, one request's window and chunk in the sliding ones.
    let small_bytes = blocks * bs * row * (mc.n_layers - n_sliding) + least * bs * row * n_sliding;
    // Full attention: every token in every layer.
    let full_bytes = blocks * bs * row * mc.n_layers;
    let other = load_model(&model.path.display().to_string())?;
    let third = load_model(&model.path.display().to_string())?;
    let small_cfg = EngineConfig {
        kv_memory: small_bytes,
        swa_blocks: Some(least),
        context_length: Some(PROMPT + NEW + 64),
        ..args.kv.config(true)
    };
    let small = Engine::from_model(model, small_cfg.clone())?;
    let full = Engine::from_model(
        other,
        EngineConfig {
            kv_memory: full_bytes,
            swa_full: true,
            swa_blocks: None,
            ..small_cfg.clone()
        },
    )?;
    let plain = Engine::from_model(
        third,
        EngineConfig {
            prefix_cache: false,
            ..small_cfg
        },
    )?;
    let (ss, fs) = (small.stats(), full.stats());

    // Memory: the 8k request on both pools.
    let req = greedy(&prompt, NEW);
    let (mut ttft, mut dec) = ((Vec::new(), Vec::new()), (Vec::new(), Vec::new()));
    let (mut peak_small, mut peak_full, mut same) = (0, 0, true);
    for _ in 0..runs {
        small.clear_cache()?;
        full.clear_cache()?;
        let (a, pa) = run_watched(&small, &req)?;
        let (b, pb) = run_watched(&full, &req)?;
        same &= a.tokens == b.tokens;
        peak_small = peak_small.max(pa);
        peak_full = peak_full.max(pb);
        ttft.0.push(a.timings.ttft_ms);
        ttft.1.push(b.timings.ttft_ms);
        dec.0.push(a.timings.decode_tok_s);
        dec.1.push(b.timings.decode_tok_s);
    }
    let (t0, t1) = (median(ttft.0), median(ttft.1));
    let (d0, d1) = (median(dec.0), median(dec.1));
    let ratio = ss.kv_bytes as f64 / fs.kv_bytes as f64;
    let mib = |b: usize| b as f64 / (1u64 << 20) as f64;

    // Reuse: a conversation without a template on the small pool.
    let mut history = tokens(small.model(), 1, FIRST)?;
    let (mut prompt_sum, mut cached_sum, mut replies_same) = (0, 0, true);
    let (mut tr, mut tp) = (Vec::new(), Vec::new());
    let mut turns = Vec::new();
    small.clear_cache()?;
    for turn in 0..TURNS {
        if turn > 0 {
            history.extend(tokens(small.model(), 100 + turn as u64, USER)?);
        }
        let x = small.complete(&greedy(&history, NEW), &mut |_| {})?;
        let y = plain.complete(&greedy(&history, NEW), &mut |_| {})?;
        replies_same &= x.tokens == y.tokens;
        if turn > 0 {
            prompt_sum += x.usage.prompt_tokens;
            cached_sum += x.usage.cached_tokens;
        }
        tr.push(x.timings.ttft_ms);
        tp.push(y.timings.ttft_ms);
        turns.push(serde_json::json!({
            "turn": turn + 1,
            "prompt_tokens": x.usage.prompt_tokens,
            "cached_tokens": x.usage.cached_tokens,
            "ttft_ms_reuse": x.timings.ttft_ms,
            "ttft_ms_no_reuse": y.timings.ttft_ms,
        }));
        history.extend(&x.tokens);
    }
    let hit = cached_sum as f64 / prompt_sum.max(1) as f64;
    let evicted = small.stats().kv.evicted_sliding_blocks;
    let lines = vec![
        format!(
            "sliding-window: {} ({n_sliding} of {} layers see {window} tokens), f16 cache, blocks of {bs}",
            small.model().path.file_name().unwrap_or_default().to_string_lossy(),
            mc.n_layers
        ),
        format!(
            "  {PROMPT}-token prompt + {NEW} greedy tokens, median of {runs} runs:"
        ),
        format!(
            "    sliding pool   {:>7.1} MiB KV ({} + {} blocks), peak held {:>6.1} MiB, TTFT {:>7.0} ms, decode {:>5.1} tok/s",
            mib(ss.kv_bytes), ss.kv.num_blocks, ss.kv.sliding_blocks, mib(peak_small), t0, d0
        ),
        format!(
            "    full attention {:>7.1} MiB KV ({} + {} blocks), peak held {:>6.1} MiB, TTFT {:>7.0} ms, decode {:>5.1} tok/s",
            mib(fs.kv_bytes), fs.kv.num_blocks, fs.kv.sliding_blocks, mib(peak_full), t1, d1
        ),
        format!(
            "    KV memory {:.1}% of full attention's; same tokens: {same}",
            ratio * 100.0
        ),
        format!(
            "  {TURNS}-turn conversation on the sliding pool ({FIRST}-token start, +{USER} per turn, {NEW}-token replies), up to {} tokens:",
            history.len()
        ),
        format!(
            "    prompt tokens from the cache (turns 2-{TURNS}) {:.1}%; last turn TTFT {:.0} ms with reuse, {:.0} ms without; sliding blocks evicted {evicted}; same replies: {replies_same}",
            hit * 100.0,
            tr.last().copied().unwrap_or(0.0),
            tp.last().copied().unwrap_or(0.0)
        ),
    ];
    let v = serde_json::json!({
        "scenario": "sliding-window",
        "window": window,
        "prompt_tokens": PROMPT,
        "new_tokens": NEW,
        "kv_bytes_sliding_pool": ss.kv_bytes,
        "kv_bytes_full_attention": fs.kv_bytes,
        "kv_ratio": ratio,
        "peak_held_sliding_pool": peak_small,
        "peak_held_full_attention": peak_full,
        "ttft_ms": [t0, t1],
        "decode_tok_s": [d0, d1],
        "same_tokens": same,
        "chat_hit_ratio": hit,
        "chat_turns": turns,
        "chat_same_replies": replies_same,
        "evicted_sliding_blocks": evicted,
        "runs": runs,
    });
    emit(args, v, &lines);
    Ok(())
}
