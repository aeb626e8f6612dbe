//! The KV-cache scenarios of `tessera bench`. Each one runs the engine as a
//! user would and compares it with the same engine without the cache's
//! help (prefix reuse off, or a fresh prefill), in the same run.

use std::time::Instant;

use anyhow::{bail, Result};
use tessera_engine::{
    ContextShift, Engine, EngineConfig, Event, GenerateRequest, Prompt, SamplingParams, TurnOptions,
};
use tessera_model::phases::{Part, PartTime, PARTS};
use tessera_model::{Model, Special};

use tessera_bench::{median, text, REPLY_TOKENS};

use crate::bench::BenchArgs;
use crate::load_model;

fn greedy_turn(max_tokens: usize) -> TurnOptions {
    TurnOptions {
        sampling: SamplingParams::greedy(),
        max_tokens,
        ..TurnOptions::default()
    }
}

/// The engine of the scenario, and the same model with reuse off.
fn two_engines(model: Model, args: &BenchArgs) -> Result<(Engine, Engine)> {
    let other = load_model(&model.path.display().to_string())?;
    let with = Engine::from_model(model, args.kv.config(true))?;
    let without = Engine::from_model(other, args.kv.config(false))?;
    Ok((with, without))
}

pub(crate) fn emit(args: &BenchArgs, v: serde_json::Value, lines: &[String]) {
    if args.json {
        println!("{v}");
    } else {
        for l in lines {
            println!("{l}");
        }
    }
}

/// 12 turns: a ~150-token system prompt, ~150-token user turns, 32-token
/// greedy replies. TTFT per turn with and without prefix reuse.
pub fn chat(model: Model, args: &BenchArgs) -> Result<()> {
    let conv = tessera_bench::chat(&model)?;
    const TURNS: usize = 12;
    let runs = args.runs.max(1);
    let (reuse, plain) = two_engines(model, args)?;
    let opts = greedy_turn(REPLY_TOKENS);
    // ttft[turn] over the runs, for each engine; each run is a new
    // conversation on an emptied cache.
    let (mut ta, mut tb) = (vec![Vec::new(); TURNS], vec![Vec::new(); TURNS]);
    let mut usage = Vec::new();
    let mut same = true;
    for _ in 0..runs {
        reuse.clear_cache()?;
        let mut a = reuse.chat(Some(&conv.system));
        let mut b = plain.chat(Some(&conv.system));
        usage.clear();
        for (i, u) in conv.users.iter().enumerate() {
            // Alternate the two engines turn by turn so drift hits both alike.
            let x = a.send(u, &opts, &mut |_| {})?;
            let y = b.send(u, &opts, &mut |_| {})?;
            same &= x.tokens == y.tokens;
            ta[i].push(x.timings.ttft_ms);
            tb[i].push(y.timings.ttft_ms);
            usage.push(x.usage);
        }
    }
    let mut rows = Vec::new();
    let mut lines = vec![format!(
        "chat: {TURNS} turns, system ~150 tokens, user turns ~150, replies ≤32 greedy; median of {runs} runs per turn"
    )];
    lines.push("turn  prompt  cached   TTFT reuse  TTFT no reuse   ratio".into());
    for i in 0..TURNS {
        let (x, y) = (median(ta[i].clone()), median(tb[i].clone()));
        lines.push(format!(
            "{:>4}  {:>6}  {:>6}  {:>8.1} ms  {:>10.1} ms  {:>6.1}x",
            i + 1,
            usage[i].prompt_tokens,
            usage[i].cached_tokens,
            x,
            y,
            y / x.max(1e-9)
        ));
        rows.push(serde_json::json!({
            "turn": i + 1,
            "prompt_tokens": usage[i].prompt_tokens,
            "cached_tokens": usage[i].cached_tokens,
            "ttft_ms_reuse": x,
            "ttft_ms_no_reuse": y,
        }));
    }
    let last = |k: &str| rows.last().map_or(0.0, |r| r[k].as_f64().unwrap_or(0.0));
    let sum = |k: &str| {
        rows.iter()
            .map(|r| r[k].as_f64().unwrap_or(0.0))
            .sum::<f64>()
    };
    let (lr, ln) = (last("ttft_ms_reuse"), last("ttft_ms_no_reuse"));
    lines.push(format!(
        "turn {TURNS}: {lr:.1} ms with reuse, {ln:.1} ms without: {:.1}x; sum over turns {:.0} vs {:.0} ms; same greedy replies: {same}",
        ln / lr.max(1e-9),
        sum("ttft_ms_reuse"),
        sum("ttft_ms_no_reuse"),
    ));
    let v = serde_json::json!({
        "scenario": "chat",
        "turns": rows,
        "last_ttft_ms_reuse": lr,
        "last_ttft_ms_no_reuse": ln,
        "last_ratio": ln / lr.max(1e-9),
        "sum_ttft_ms_reuse": sum("ttft_ms_reuse"),
        "sum_ttft_ms_no_reuse": sum("ttft_ms_no_reuse"),
        "same_replies": same,
        "runs": runs,
    });
    emit(args, v, &lines);
    Ok(())
}

/// Submits every prompt at once; seconds until all have their first token.
fn all_at_once(engine: &Engine, prompts: &[Vec<u32>]) -> Result<f64> {
    let t = Instant::now();
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| {
            engine.generate(GenerateRequest {
                max_tokens: 1,
                sampling: SamplingParams::greedy(),
                ..GenerateRequest::new(Prompt::Tokens(p.clone()))
            })
        })
        .collect::<std::result::Result<_, _>>()?;
    for s in streams {
        for ev in s {
            if let Event::Error(e) = ev {
                return Err(e.into());
            }
        }
    }
    Ok(t.elapsed().as_secs_f64())
}

fn one(engine: &Engine, prompt: &[u32]) -> Result<f64> {
    all_at_once(engine, &[prompt.to_vec()])
}

/// 8 requests sharing a 1,000-token prefix, each with its own 50-token
/// suffix, submitted together: time until all 8 have their first token,
/// against prefilling the prefix once plus the 8 suffixes one by one, and
/// against the same 8 requests with reuse off.
pub fn shared_prefix(model: Model, args: &BenchArgs) -> Result<()> {
    let (prefix, suffixes) = tessera_bench::shared_prefix(&model)?;
    let prompts: Vec<Vec<u32>> = suffixes
        .iter()
        .map(|s| [prefix.as_slice(), s].concat())
        .collect();
    let (reuse, plain) = two_engines(model, args)?;
    let (mut shared, mut reference, mut none) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.runs.max(1) {
        reuse.clear_cache()?;
        shared.push(all_at_once(&reuse, &prompts)?);
        reuse.clear_cache()?;
        let mut t = one(&reuse, &prefix)?;
        for p in &prompts {
            t += one(&reuse, p)?;
        }
        reference.push(t);
        none.push(all_at_once(&plain, &prompts)?);
    }
    let (s, r, n) = (median(shared), median(reference), median(none));
    let lines = vec![
        format!("shared-prefix: 8 requests, 1,000-token shared prefix, 50-token suffixes, {} runs (median)", args.runs),
        format!("  all 8 submitted together, reuse on     {:>8.1} ms", s * 1e3),
        format!("  prefix once + 8 suffixes one by one    {:>8.1} ms   (together / this: {:.2})", r * 1e3, s / r),
        format!("  all 8 together, reuse off              {:>8.1} ms   (speedup of reuse: {:.1}x)", n * 1e3, n / s),
    ];
    let v = serde_json::json!({
        "scenario": "shared-prefix",
        "total_ttft_ms": s * 1e3,
        "prefix_once_plus_suffixes_ms": r * 1e3,
        "ratio_to_prefix_once": s / r,
        "no_reuse_ms": n * 1e3,
        "speedup_vs_no_reuse": n / s,
        "runs": args.runs,
    });
    emit(args, v, &lines);
    Ok(())
}

/// 4 conversations taking turns on one engine, 6 rounds (a ~400-token
/// system prompt each, ~40-token user turns, 32-token replies): the share of
/// prompt tokens served from cache from each one's second turn on, the share
/// of the history (what an earlier turn computed) served from cache, and
/// the sum of TTFT with and without reuse.
pub fn interleaved(model: Model, args: &BenchArgs) -> Result<()> {
    let convs = tessera_bench::interleaved(&model)?;
    let (n, rounds) = (convs.len(), convs[0].users.len());
    let (reuse, plain) = two_engines(model, args)?;
    let mut a: Vec<_> = convs.iter().map(|c| reuse.chat(Some(&c.system))).collect();
    let mut b: Vec<_> = convs.iter().map(|c| plain.chat(Some(&c.system))).collect();
    let opts = greedy_turn(REPLY_TOKENS);
    let (mut prompt, mut cached, mut history) = (0usize, 0usize, 0usize);
    let mut worst: f64 = 1.0;
    let (mut ttft_a, mut ttft_b) = (0.0, 0.0);
    for round in 0..rounds {
        for c in 0..n {
            let u = &convs[c].users[round];
            let before = a[c].token_ids().len();
            let x = a[c].send(u, &opts, &mut |_| {})?;
            let y = b[c].send(u, &opts, &mut |_| {})?;
            ttft_a += x.timings.ttft_ms;
            ttft_b += y.timings.ttft_ms;
            if round > 0 {
                prompt += x.usage.prompt_tokens;
                cached += x.usage.cached_tokens;
                history += before;
                worst = worst.min(x.usage.cached_tokens as f64 / x.usage.prompt_tokens as f64);
            }
        }
    }
    let share = cached as f64 / prompt.max(1) as f64;
    let of_history = cached as f64 / history.max(1) as f64;
    let lines = vec![
        format!("interleaved: {n} conversations × {rounds} rounds, system ~400 tokens, user ~40, replies ≤{REPLY_TOKENS}"),
        format!("  prompt tokens served from cache from turn 2: {:.1}% (lowest turn {:.1}%)", share * 100.0, worst * 100.0),
        format!("  history (tokens earlier turns computed) served from cache: {:.1}%", of_history * 100.0),
        format!("  sum of TTFT: {ttft_a:.0} ms with reuse, {ttft_b:.0} ms without ({:.1}x)", ttft_b / ttft_a.max(1e-9)),
    ];
    let v = serde_json::json!({
        "scenario": "interleaved",
        "cached_share_from_turn_2": share,
        "lowest_turn_share": worst,
        "history_cached_share": of_history,
        "sum_ttft_ms_reuse": ttft_a,
        "sum_ttft_ms_no_reuse": ttft_b,
    });
    emit(args, v, &lines);
    Ok(())
}

/// Greedy generation through a context shift (context 256, keep 32): the 32
/// tokens after the shift against a fresh prefill of the kept tokens.
pub fn shift(model: Model, args: &BenchArgs) -> Result<()> {
    const CTX: usize = 256;
    const KEEP: usize = 32;
    const AFTER: usize = 32;
    const PROMPT: usize = 200;
    const PROMPTS: u64 = 8;
    let texts: Vec<String> = (0..PROMPTS)
        .map(|i| text(&model, 400 + i, PROMPT))
        .collect::<Result<_>>()?;
    let other = load_model(&model.path.display().to_string())?;
    let cfg = EngineConfig {
        context_length: Some(CTX),
        ..args.kv.config(false)
    };
    let shifted = Engine::from_model(model, cfg.clone())?;
    let fresh = Engine::from_model(other, cfg)?;
    let (mut matched, mut total, mut prefix_sum, mut whole) = (0, 0, 0, 0);
    for text in &texts {
        let mut ids = shifted
            .model()
            .tokenizer
            .encode(text, Special::AsText, true)?;
        ids.truncate(PROMPT);
        let need = CTX - ids.len() + 1 + AFTER;
        let req = GenerateRequest {
            max_tokens: need,
            sampling: SamplingParams::greedy(),
            ignore_eos: true,
            context_shift: ContextShift::Keep(KEEP),
            ..GenerateRequest::new(Prompt::Tokens(ids.clone()))
        };
        let done = shifted.complete(&req, &mut |_| {})?;
        if done.tokens.len() != need {
            bail!("the shifted run stopped after {} tokens", done.tokens.len());
        }
        let full: Vec<u32> = ids.iter().chain(&done.tokens).copied().collect();
        let discard = (CTX - KEEP) / 2;
        let kept: Vec<u32> = full[..KEEP]
            .iter()
            .chain(&full[KEEP + discard..=CTX])
            .copied()
            .collect();
        let after = &full[CTX + 1..];
        let again = fresh.complete(
            &GenerateRequest {
                max_tokens: AFTER,
                sampling: SamplingParams::greedy(),
                ignore_eos: true,
                ..GenerateRequest::new(Prompt::Tokens(kept))
            },
            &mut |_| {},
        )?;
        let same = after
            .iter()
            .zip(&again.tokens)
            .filter(|(a, b)| a == b)
            .count();
        let prefix = after
            .iter()
            .zip(&again.tokens)
            .take_while(|(a, b)| a == b)
            .count();
        matched += same;
        total += AFTER;
        prefix_sum += prefix;
        whole += usize::from(prefix == AFTER);
    }
    let rate = matched as f64 / total as f64;
    let lines = vec![
        format!("shift: context {CTX}, keep {KEEP}, {PROMPTS} prompts of {PROMPT} tokens; the {AFTER} greedy tokens after the shift against a fresh prefill of the kept tokens"),
        format!("  same token at the same place: {:.1}% | identical first {:.1} tokens on average | all {AFTER} identical in {whole} of {PROMPTS}", rate * 100.0, prefix_sum as f64 / PROMPTS as f64),
    ];
    let v = serde_json::json!({
        "scenario": "shift",
        "context": CTX,
        "keep": KEEP,
        "tokens_compared": total,
        "agreement": rate,
        "mean_identical_prefix": prefix_sum as f64 / PROMPTS as f64,
        "fully_identical": whole,
        "prompts": PROMPTS,
    });
    emit(args, v, &lines);
    Ok(())
}

/// A decode run's attention phases and whole forward, ms per step.
type Phases = (f64, f64);

/// A decode run's parts ([`tessera_model::phases::Part`]).
type Parts = [PartTime; PARTS];

/// Each run's tok/s, [`Phases`] and [`Parts`].
#[derive(Default)]
struct Runs(Vec<f64>, Vec<f64>, Vec<f64>, Vec<Parts>);

impl Runs {
    fn push(&mut self, (tps, (att, fwd), parts): (f64, Phases, Parts)) {
        self.0.push(tps);
        self.1.push(att);
        self.2.push(fwd);
        self.3.push(parts);
    }

    /// The medians of each (each part's time its own median).
    fn medians(self) -> (f64, Phases, Parts) {
        let parts = std::array::from_fn(|i| PartTime {
            ms: median(self.3.iter().map(|p| p[i].ms).collect()),
            bytes: self.3.first().map_or(0, |p| p[i].bytes),
        });
        (median(self.0), (median(self.1), median(self.2)), parts)
    }
}

/// A run's parts as JSON: each part's ms a step, and its weights' GB/s.
fn parts_json(parts: &Parts) -> serde_json::Value {
    Part::ALL
        .iter()
        .map(|&p| {
            let t = parts[p as usize];
            (
                p.name().to_string(),
                serde_json::json!({"ms": t.ms, "weight_bytes": t.bytes, "gb_s": t.gb_s()}),
            )
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// A run's parts on one line: ms a step, and GB/s where it reads weights.
fn parts_line(label: &str, parts: &Parts, forward_ms: f64) -> String {
    let each: Vec<String> = Part::ALL
        .iter()
        .map(|&p| {
            let t = parts[p as usize];
            if t.bytes > 0 {
                format!("{} {:.3} ms ({:.1} GB/s)", p.name(), t.ms, t.gb_s())
            } else {
                format!("{} {:.3} ms", p.name(), t.ms)
            }
        })
        .collect();
    let rest = forward_ms - parts.iter().map(|t| t.ms).sum::<f64>();
    format!(
        "  {label}: {}; outside the parts {rest:.3} ms",
        each.join(", ")
    )
}

/// `decode-long`: 128 tokens after 2,048 tokens of context; `decode-batch`:
/// 4 and 8 sequences decoding together. Each beside one sequence decoding
/// after a 16-token prompt, in the same run (medians over the runs), with
/// the share of a decode forward its attention phases take and the time
/// of each part of the step ([`tessera_model::phases`]).
pub fn decode_depth_and_width(model: Model, args: &BenchArgs) -> Result<()> {
    let short = tessera_bench::decode_prompt(&model)?;
    let long = tessera_bench::long_prompt(&model)?;
    let (four, eight) = (
        tessera_bench::batch_prompts(&model, 4)?,
        tessera_bench::batch_prompts(&model, 8)?,
    );
    let engine = Engine::from_model(model, args.kv.config(false))?;
    let long_scenario = args.scenario == crate::bench::Scenario::DecodeLong;
    // Each run's tok/s, its decode steps' attention and forward times, and
    // their parts.
    let run = |prompts: &[Vec<u32>]| -> Result<(f64, Phases, Parts)> {
        tessera_model::phases::start();
        let tps = tessera_bench::decode_together(&engine, prompts);
        let p = tessera_model::phases::stop();
        Ok((
            tps?,
            p.map_or((f64::NAN, f64::NAN), |p| (p.attention_ms, p.forward_ms)),
            p.map_or([PartTime::default(); PARTS], |p| p.parts),
        ))
    };
    let (mut base, mut a, mut b) = (Runs::default(), Runs::default(), Runs::default());
    for _ in 0..args.runs {
        base.push(run(std::slice::from_ref(&short))?);
        if long_scenario {
            a.push(run(std::slice::from_ref(&long))?);
        } else {
            a.push(run(&four)?);
            b.push(run(&eight)?);
        }
    }
    let (base, base_p, base_parts) = base.medians();
    // (Not timed off the CPU fast path: a GPU forward, or the reference.)
    let phases = |label: &str, (att, fwd): Phases| {
        if att.is_nan() || fwd.is_nan() {
            return format!("{label} not timed (not the CPU fast path)");
        }
        format!(
            "{label} {att:.3} of {fwd:.3} ms ({:.0}%)",
            100.0 * att / fwd
        )
    };
    let (v, lines) = if long_scenario {
        let (l, l_p, l_parts) = a.medians();
        (
            serde_json::json!({
                "scenario": "decode-long",
                "context": long.len(),
                "tessera": l,
                "short_tessera": base,
                "ratio_to_short": l / base,
                "attention_ms": l_p.0,
                "forward_ms": l_p.1,
                "short_attention_ms": base_p.0,
                "short_forward_ms": base_p.1,
                "parts": parts_json(&l_parts),
                "short_parts": parts_json(&base_parts),
                "runs": args.runs,
            }),
            vec![
                format!(
                    "decode-long: 128 tokens after {} tokens: {l:.1} tok/s; after 16 tokens: {base:.1} tok/s ({:.0}%)",
                    long.len(),
                    100.0 * l / base
                ),
                format!(
                    "  attention phases of a decode forward (medians): {}; {}",
                    phases(&format!("after {} tokens", long.len()), l_p),
                    phases("after 16", base_p)
                ),
                parts_line(&format!("parts after {} tokens", long.len()), &l_parts, l_p.1),
                parts_line("parts after 16", &base_parts, base_p.1),
            ],
        )
    } else {
        let ((x4, p4, parts4), (x8, p8, parts8)) = (a.medians(), b.medians());
        (
            serde_json::json!({
                "scenario": "decode-batch",
                "single": base,
                "batch4": x4,
                "batch8": x8,
                "ratio4": x4 / base,
                "ratio8": x8 / base,
                "single_attention_ms": base_p.0,
                "single_forward_ms": base_p.1,
                "batch4_attention_ms": p4.0,
                "batch4_forward_ms": p4.1,
                "batch8_attention_ms": p8.0,
                "batch8_forward_ms": p8.1,
                "single_parts": parts_json(&base_parts),
                "batch4_parts": parts_json(&parts4),
                "batch8_parts": parts_json(&parts8),
                "runs": args.runs,
            }),
            vec![
                format!(
                    "decode-batch: aggregate tok/s, 1 sequence {base:.1} | 4 together {x4:.1} ({:.2}×) | 8 together {x8:.1} ({:.2}×)",
                    x4 / base,
                    x8 / base
                ),
                format!(
                    "  attention phases of a decode forward (medians): {}; {}; {}",
                    phases("1 sequence", base_p),
                    phases("4", p4),
                    phases("8", p8)
                ),
                parts_line("parts of 1 sequence", &base_parts, base_p.1),
                parts_line("parts of 8", &parts8, p8.1),
            ],
        )
    };
    emit(args, v, &lines);
    Ok(())
}

/// Decode steps of each burst of `roofline --model`.
const SHARE_STEPS: usize = 8;

/// Bursts a run of `roofline --model`.
const SHARE_BURSTS: usize = 16;

/// Bytes of each read pass of `roofline --model` (a few ms: this host's
/// bandwidth was seen to move from 30 to 80 GB/s within a second, so the
/// reads are kept as close to each burst as they can be while still far
/// past the last-level cache).
const SHARE_READ: usize = 256 << 20;

/// `roofline --model`: decode bursts of [`SHARE_STEPS`] steps after the
/// 16-token prompt (cached after the first burst), alternating with read
/// passes of [`SHARE_READ`] bytes (each burst between two), `--runs` times
/// [`SHARE_BURSTS`] bursts. A burst's weight bytes a second (the phase
/// clock's parts: every matrix a decode step reads, over the forward's
/// time) over the mean of the reads either side is its share of the
/// roofline; each part's the same way; medians over the bursts. Also the
/// bursts' tok/s (the engine around the forward included).
pub fn roofline_share(model: Model, args: &BenchArgs) -> Result<()> {
    let prompt = tessera_bench::decode_prompt(&model)?;
    let engine = Engine::from_model(model, args.kv.config(false))?;
    let threads = candle_core::utils::get_num_threads();
    let data = tessera_kernels::read_buffer(SHARE_READ);
    let read = || SHARE_READ as f64 / tessera_kernels::timed_read(&data, threads) / 1e9;
    let burst = || -> Result<(f64, tessera_model::phases::DecodePhases)> {
        tessera_model::phases::start();
        let tps = tessera_bench::decode_steps(&engine, &prompt, SHARE_STEPS);
        let p = tessera_model::phases::stop();
        // A GPU forward times its steps but has no parts.
        let p = p
            .filter(|p| p.parts.iter().any(|x| x.bytes > 0))
            .ok_or_else(|| anyhow::anyhow!("the decode's parts were not timed: roofline --model measures the CPU fast path"))?;
        Ok((tps?, p))
    };
    burst()?;
    read();
    let (mut shares, mut tps, mut reads) = (Vec::new(), Vec::new(), Vec::new());
    let mut part_shares: Vec<Vec<f64>> = vec![Vec::new(); PARTS];
    let mut before = read();
    reads.push(before);
    let mut weight_bytes = 0;
    for _ in 0..args.runs * SHARE_BURSTS {
        let (t, p) = burst()?;
        let after = read();
        reads.push(after);
        let around = (before + after) / 2.0;
        weight_bytes = p.parts.iter().map(|x| x.bytes).sum::<u64>();
        shares.push(weight_bytes as f64 / p.forward_ms / 1e6 / around);
        for (s, x) in part_shares.iter_mut().zip(&p.parts) {
            if x.bytes > 0 {
                s.push(x.gb_s() / around);
            }
        }
        tps.push(t);
        before = after;
    }
    let bursts = shares.len();
    let (lo, hi) = reads
        .iter()
        .fold((f64::MAX, 0f64), |(l, h), &r| (l.min(r), h.max(r)));
    let share = median(shares.clone());
    let tok_s = median(tps);
    let read_mid = median(reads);
    let parts: serde_json::Map<_, _> = Part::ALL
        .iter()
        .filter(|p| !part_shares[**p as usize].is_empty())
        .map(|&p| {
            (
                p.name().to_string(),
                median(part_shares[p as usize].clone()).into(),
            )
        })
        .collect();
    let lines = vec![
        format!(
            "roofline: decode's weights {:.3} GB a step at {:.1}% of the read around each burst (median of {bursts} bursts of {SHARE_STEPS} steps; reads of {} MiB {lo:.1}–{hi:.1} GB/s, median {read_mid:.1}); {tok_s:.1} tok/s",
            weight_bytes as f64 / 1e9,
            100.0 * share,
            SHARE_READ >> 20
        ),
        format!(
            "  each part's share: {}",
            parts
                .iter()
                .map(|(k, v)| format!("{k} {:.1}%", 100.0 * v.as_f64().unwrap_or(0.0)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    ];
    let v = serde_json::json!({
        "scenario": "roofline",
        "metric": "decode_share_of_read",
        "tessera": share,
        "tok_s": tok_s,
        "weight_bytes": weight_bytes,
        "read_gb_s": read_mid,
        "read_gb_s_min": lo,
        "read_gb_s_max": hi,
        "part_shares": parts,
        "bursts": bursts,
        "steps": SHARE_STEPS,
        "threads": threads,
    });
    emit(args, v, &lines);
    Ok(())
}

/// Budget of the capacity part of `kv-types`.
const KV_TYPES_MIB: usize = 64;

/// `kv-types`: each KV cache type beside f16 in the same run. Capacity:
/// distinct 256-token prompts go through an engine with a 64 MiB pool until
/// it has had to evict (one and a half times what it can hold), then the
/// tokens its prefix tree still holds are counted. Speed: greedy decode
/// after 16 tokens and after 2,048 (`decode-long`), the types alternating
/// run by run (medians).
pub fn kv_types(model: Model, args: &BenchArgs) -> Result<()> {
    use tessera_engine::CacheDType;
    let path = model.path.display().to_string();
    let short = tessera_bench::decode_prompt(&model)?;
    let long = tessera_bench::long_prompt(&model)?;
    let head_dim = model.config().head_dim;
    let types: Vec<CacheDType> = [CacheDType::F16, CacheDType::Q8_0, CacheDType::Q4_0]
        .into_iter()
        .filter(|t| !t.is_quantized() || head_dim.is_multiple_of(64))
        .collect();
    let per_token: Vec<usize> = types
        .iter()
        .map(|&t| model.config().kv_bytes_per_token(t))
        .collect();
    drop(model);
    let mut rows = Vec::new();
    for &t in &types {
        let cfg = EngineConfig {
            kv_memory: KV_TYPES_MIB << 20,
            cache_dtype: t,
            ..args.kv.config(true)
        };
        let engine = Engine::from_model(load_model(&path)?, cfg)?;
        let s = engine.stats().kv;
        let capacity = s.num_blocks * s.block_size;
        let (mut fed, mut i) = (0, 0u64);
        while fed < capacity * 3 / 2 {
            let ids = engine.model().tokenizer.encode(
                &text(engine.model(), 9000 + i, 256)?,
                Special::AsText,
                true,
            )?;
            let req = GenerateRequest {
                max_tokens: 1,
                sampling: SamplingParams::greedy(),
                ..GenerateRequest::new(Prompt::Tokens(ids))
            };
            fed += engine.complete(&req, &mut |_| {})?.usage.prompt_tokens;
            i += 1;
        }
        let s = engine.stats().kv;
        rows.push((capacity, s.cached_tokens, s.evicted_blocks));
    }
    let engines = types
        .iter()
        .map(|&t| {
            let cfg = EngineConfig {
                cache_dtype: t,
                ..args.kv.config(false)
            };
            Ok(Engine::from_model(load_model(&path)?, cfg)?)
        })
        .collect::<Result<Vec<_>>>()?;
    let (mut dec, mut deep) = (vec![Vec::new(); types.len()], vec![Vec::new(); types.len()]);
    for _ in 0..args.runs {
        for (k, e) in engines.iter().enumerate() {
            dec[k].push(tessera_bench::decode_together(
                e,
                std::slice::from_ref(&short),
            )?);
            deep[k].push(tessera_bench::decode_together(
                e,
                std::slice::from_ref(&long),
            )?);
        }
    }
    let base_tpm = rows[0].1 as f64 / KV_TYPES_MIB as f64;
    let (base_dec, base_deep) = (median(dec[0].clone()), median(deep[0].clone()));
    let mut json = Vec::new();
    let mut lines = vec![format!(
        "kv-types: {KV_TYPES_MIB} MiB pool filled with distinct 256-token prompts; decode after {} and {} tokens",
        short.len(),
        long.len()
    )];
    for (k, &t) in types.iter().enumerate() {
        let (capacity, cached, evicted) = rows[k];
        let tpm = cached as f64 / KV_TYPES_MIB as f64;
        let (d, l) = (median(dec[k].clone()), median(deep[k].clone()));
        lines.push(format!(
            "{t:>5}: {} B/token | holds {cached} of {capacity} tokens ({tpm:.0}/MiB, {:.2}× f16) | decode {d:.1} tok/s ({:.2}× f16) | after {}: {l:.1} tok/s ({:.2}× f16, {:.0}% of its short decode)",
            per_token[k],
            tpm / base_tpm,
            d / base_dec,
            long.len(),
            l / base_deep,
            100.0 * l / d
        ));
        json.push(serde_json::json!({
            "type": t.name(),
            "bytes_per_token": per_token[k],
            "capacity_tokens": capacity,
            "cached_tokens": cached,
            "evicted_blocks": evicted,
            "tokens_per_mib": tpm,
            "tokens_per_mib_vs_f16": tpm / base_tpm,
            "decode": d,
            "decode_vs_f16": d / base_dec,
            "decode_long": l,
            "decode_long_vs_f16": l / base_deep,
            "decode_long_to_short": l / d,
        }));
    }
    let v = serde_json::json!({
        "scenario": "kv-types",
        "budget_mib": KV_TYPES_MIB,
        "context": long.len(),
        "runs": args.runs,
        "types": json,
    });
    emit(args, v, &lines);
    Ok(())
}

/// Tokens of the session that `session-save` saves.
const SESSION_TOKENS: usize = 2000;

/// `session-save`: a stream decodes 128 greedy tokens; beside it, once its
/// fourth token is out, a 2,000-token session that nothing cached is saved
/// (its K/V computed as a background request, written to a file). Its gaps
/// between tokens from the fifth on, largest and median, against the same
/// stream alone, the two alternating run by run (medians over the runs);
/// and the save's time, beside the stream and alone.
pub fn session_save(model: Model, args: &BenchArgs) -> Result<()> {
    let short = tessera_bench::decode_prompt(&model)?;
    let engine = Engine::from_model(model, args.kv.config(true))?;
    let dir = std::env::temp_dir().join(format!("tessera-bench-sessions-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let session = |run: u64| -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        let mut i = 0;
        while ids.len() < SESSION_TOKENS {
            ids.extend(engine.model().tokenizer.encode(
                &text(engine.model(), 7000 + run * 100 + i, 512)?,
                Special::AsText,
                ids.is_empty(),
            )?);
            i += 1;
        }
        ids.truncate(SESSION_TOKENS);
        Ok(ids)
    };
    // The stream's gaps (seconds) from its fifth token on, and the save's
    // seconds when one ran beside it.
    let run = |save: Option<Vec<u32>>| -> Result<(Vec<f64>, Option<f64>)> {
        engine.clear_cache()?;
        let req = GenerateRequest {
            sampling: SamplingParams::greedy(),
            max_tokens: 128,
            ignore_eos: true,
            ..GenerateRequest::new(Prompt::Tokens(short.clone()))
        };
        let stream = engine.generate(req)?;
        let (mut last, mut gaps, mut saver) = (None, Vec::new(), None);
        let mut tokens = 0;
        for ev in stream {
            match ev {
                Event::Token { .. } => {
                    tokens += 1;
                    let now = Instant::now();
                    if let Some(prev) = last.replace(now) {
                        if tokens > 5 {
                            gaps.push(now.duration_since(prev).as_secs_f64());
                        }
                    }
                    if tokens == 4 {
                        if let Some(ids) = save.clone() {
                            let (e, path) = (engine.clone(), dir.join("bench.tkv"));
                            saver = Some(std::thread::spawn(move || {
                                let t = Instant::now();
                                e.save_kv_session(&path, &ids)
                                    .map(|_| t.elapsed().as_secs_f64())
                            }));
                        }
                    }
                }
                Event::Error(e) => return Err(e.into()),
                Event::Done(_) => {}
            }
        }
        let took = match saver {
            Some(h) => Some(
                h.join()
                    .map_err(|_| anyhow::anyhow!("the save panicked"))??,
            ),
            None => None,
        };
        Ok((gaps, took))
    };
    let worst = |g: &[f64]| g.iter().copied().fold(0.0, f64::max);
    let (mut alone_max, mut alone_med, mut with_max, mut with_med, mut took) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for r in 0..args.runs.max(1) {
        let (g, _) = run(None)?;
        alone_max.push(worst(&g));
        alone_med.push(median(g.clone()));
        let (g, t) = run(Some(session(r as u64)?))?;
        with_max.push(worst(&g));
        with_med.push(median(g.clone()));
        took.extend(t);
    }
    // The save alone, on an idle engine.
    let mut alone_save = Vec::new();
    for r in 0..args.runs.max(1) {
        engine.clear_cache()?;
        let ids = session(r as u64)?;
        let t = Instant::now();
        engine.save_kv_session(&dir.join("bench.tkv"), &ids)?;
        alone_save.push(t.elapsed().as_secs_f64());
    }
    let _ = std::fs::remove_dir_all(&dir);
    let ms = |v: &[f64]| median(v.to_vec()) * 1e3;
    let (am, wm) = (ms(&alone_max), ms(&with_max));
    let (ad, wd) = (ms(&alone_med), ms(&with_med));
    let v = serde_json::json!({
        "scenario": "session_save",
        "session_tokens": SESSION_TOKENS,
        "alone_max_gap_ms": am,
        "beside_save_max_gap_ms": wm,
        "max_gap_ratio": wm / am,
        "alone_median_gap_ms": ad,
        "beside_save_median_gap_ms": wd,
        "median_gap_ratio": wd / ad,
        "save_s_beside_stream": median(took.clone()),
        "save_s_alone": median(alone_save.clone()),
        "runs": args.runs,
    });
    let lines = vec![
        format!(
            "session-save: a stream's largest gap {wm:.2} ms beside a {SESSION_TOKENS}-token save, {am:.2} ms alone ({:.2}x); median gap {wd:.2} against {ad:.2} ms ({:.2}x)",
            wm / am,
            wd / ad
        ),
        format!(
            "  the save took {:.2} s beside the stream, {:.2} s alone",
            median(took.clone()),
            median(alone_save.clone())
        ),
    ];
    emit(args, v, &lines);
    Ok(())
}

/// The scenario's prompts (`data/spec-prompts.json`, which
/// `scripts/spec_vs_llamacpp.py` sends to both servers): input-grounded
/// ones, whose answers repeat spans of the prompt (an edit of code, a
/// quote from a document, a list rewritten), and plain chat ones, with
/// little to look up.
#[derive(serde::Deserialize)]
struct SpecPrompts {
    grounded: Vec<String>,
    plain: Vec<String>,
}

/// Speculative decoding by prompt lookup (`--spec-ngram` settings, or the
/// defaults): decode speed of input-grounded prompts and of plain chat
/// prompts (greedy, 256 tokens at most), with and without it, alternating
/// run by run, each prompt alone; the outputs must be the same tokens.
pub fn spec(model: Model, args: &BenchArgs) -> Result<()> {
    let other = load_model(&model.path.display().to_string())?;
    let mut cfg = args.kv.config(false);
    let ngram = cfg.speculative.unwrap_or_default();
    cfg.speculative = Some(ngram);
    let with = Engine::from_model(model, cfg)?;
    let without = Engine::from_model(
        other,
        EngineConfig {
            speculative: None,
            draft: None,
            ..args.kv.config(false)
        },
    )?;
    // Prompt lookup's bounds are computed without a draft model only.
    let lookup = with.config().draft.is_none();
    let chat = |prompt: &str| Prompt::Chat(vec![tessera_engine::Message::new("user", prompt)]);
    let run = |engine: &Engine, prompt: &str| -> Result<(Vec<u32>, f64)> {
        let req = GenerateRequest {
            sampling: SamplingParams::greedy(),
            max_tokens: 256,
            ..GenerateRequest::new(chat(prompt))
        };
        let c = engine.complete(&req, &mut |_| {})?;
        let decode_s = (c.timings.total_s - c.timings.ttft_ms / 1e3).max(1e-9);
        Ok((c.tokens, decode_s))
    };
    let sets: SpecPrompts = serde_json::from_str(include_str!("../../../data/spec-prompts.json"))?;
    let mut rows = Vec::new();
    let mut same = true;
    for (kind, prompts) in [("grounded", &sets.grounded), ("plain", &sets.plain)] {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let (before, mut tokens) = (with.stats(), 0);
        // Steps of the answers with free checks (this drafter at full
        // length, and the best earlier occurrence of the last token).
        let mut bound = (0, 0, 0, 0);
        for run_no in 0..args.runs.max(1) {
            let (mut ta, mut tb, mut n) = (0.0, 0.0, 0);
            for p in prompts {
                let (x, sa) = run(&with, p)?;
                let (y, sb) = run(&without, p)?;
                (ta, tb, n) = (ta + sa, tb + sb, n + x.len().saturating_sub(1));
                same &= x == y;
                if run_no == 0 && lookup {
                    let ids = with.tokenize_prompt(&chat(p))?;
                    bound.0 += lookup_steps(&ids, &y, |h| ngram.lookup(h, ngram.max_draft));
                    let best = |most| {
                        lookup_steps(&ids, &y, |h| {
                            best_lookup(h, &y[h.len() - ids.len()..], most)
                        })
                    };
                    bound.1 += best(ngram.max_draft);
                    bound.2 += best(usize::MAX);
                    bound.3 += y.len().saturating_sub(1);
                }
            }
            tokens = n;
            a.push(n as f64 / ta);
            b.push(n as f64 / tb);
        }
        let after = with.stats();
        let drafted = after.spec_draft_tokens - before.spec_draft_tokens;
        let kept = after.spec_accepted_tokens - before.spec_accepted_tokens;
        let cost = after.spec_guess_cost_ppm as f64 / 1e6;
        rows.push((
            kind,
            prompts.len(),
            median(a),
            median(b),
            (drafted, kept, cost),
            tokens,
            bound,
        ));
    }
    if !same {
        bail!("speculative decoding changed a greedy output");
    }
    let how = match &with.config().draft {
        Some(d) => format!(
            "a draft model ({}, drafts of up to {} tokens, p_min {})",
            d.source, ngram.max_draft, d.p_min
        ),
        _ => format!(
            "prompt lookup (drafts of up to {} tokens, runs of {}..{})",
            ngram.max_draft, ngram.min_ngram, ngram.max_ngram
        ),
    };
    let mut lines = vec![format!(
        "spec: {how}, greedy, 256 tokens at most, {} runs (median); decode tok/s after the first token",
        args.runs
    )];
    let mut v = serde_json::json!({"scenario": "spec", "runs": args.runs, "same_tokens": same,
        "max_draft": ngram.max_draft, "min_ngram": ngram.min_ngram, "max_ngram": ngram.max_ngram,
        "draft_model": with.config().draft.as_ref().map(|d| d.source.to_string()),
        "draft_p_min": with.config().draft.as_ref().map(|d| d.p_min)});
    for (kind, count, a, b, (drafted, kept, cost), n, (steps, best, unlimited, decoded)) in rows {
        lines.push(format!(
            "  {kind:<9} {count} prompts, {n} tokens: {a:>7.1} tok/s with, {b:>7.1} without ({:.2}x); {kept} of {drafted} draft tokens kept; a checked guess costs {cost:.2} of a token",
            a / b
        ));
        v[kind] = serde_json::json!({"with": a, "without": b, "ratio": a / b,
            "draft_tokens": drafted, "accepted_tokens": kept, "tokens": n, "guess_cost": cost});
        if lookup {
            let per = |s: usize| decoded as f64 / s.max(1) as f64;
            lines.push(format!(
                "            with checks costing nothing: {:.2} tokens a step (these lookups at full length), {:.2} (the best earlier occurrence of the last token, {} at most), {:.2} (no limit)",
                per(steps), per(best), ngram.max_draft, per(unlimited)
            ));
            v[kind]["free_check_tokens_per_step"] = per(steps).into();
            v[kind]["best_lookup_tokens_per_step"] = per(best).into();
            v[kind]["best_unlimited_lookup_tokens_per_step"] = per(unlimited).into();
        }
    }
    lines.push("  the same greedy tokens with and without, every prompt and run".into());
    emit(args, v, &lines);
    Ok(())
}

/// Decode steps of `answer` (after its first token, which the prompt's
/// step gives) when every step checks the draft `draft(history)` and the
/// checks cost nothing: each step gives one token and the draft's tokens
/// that the answer continues with.
fn lookup_steps(prompt: &[u32], answer: &[u32], draft: impl Fn(&[u32]) -> Vec<u32>) -> usize {
    let mut history = prompt.to_vec();
    let (mut at, mut steps) = (0, 0);
    while at + 1 < answer.len() {
        history.extend_from_slice(&answer[history.len() - prompt.len()..=at]);
        let d = draft(&history);
        let kept = d
            .iter()
            .zip(&answer[at + 1..])
            .take_while(|(a, b)| a == b)
            .count();
        at += 1 + kept;
        steps += 1;
    }
    steps
}

/// The longest run of `future` (at most `most` tokens) that follows any
/// earlier occurrence of `history`'s last token: what the best lookup of
/// a tail of one token or more could draft.
fn best_lookup(history: &[u32], future: &[u32], most: usize) -> Vec<u32> {
    let Some(&last) = history.last() else {
        return Vec::new();
    };
    let mut best: &[u32] = &[];
    for s in 0..history.len() - 1 {
        if history[s] == last {
            let after = &history[s + 1..];
            let k = after
                .iter()
                .zip(future)
                .take(most)
                .take_while(|(a, b)| a == b)
                .count();
            if k > best.len() {
                best = &after[..k];
            }
        }
    }
    best.to_vec()
}

/// One entry of `data/structured-schemas.json` (which
/// `scripts/structured_client.py` sends through the server too).
#[derive(serde::Deserialize)]
struct SchemaPrompt {
    name: String,
    prompt: String,
    schema: serde_json::Value,
}

/// Structured output's cost: each schema's prompt answered greedily under
/// its JSON schema, then the same number of tokens unconstrained (a step
/// costs the same whatever its token), alternating, each prompt alone.
/// Reports decode tok/s both ways and what the masks took per token:
/// computing them, and the part of that on the step's path (all of it
/// where no core is free to compute them beside the forward).
pub fn structured(model: Model, args: &BenchArgs) -> Result<()> {
    let engine = Engine::from_model(model, args.kv.config(false))?;
    let sets: Vec<SchemaPrompt> =
        serde_json::from_str(include_str!("../../../data/structured-schemas.json"))?;
    let request = |p: &SchemaPrompt| GenerateRequest {
        sampling: SamplingParams::greedy(),
        max_tokens: 400,
        ..GenerateRequest::new(Prompt::Chat(vec![tessera_engine::Message::new(
            "user",
            format!("{} Answer in JSON.", p.prompt),
        )]))
    };
    let decode_s =
        |c: &tessera_engine::Completion| (c.timings.total_s - c.timings.ttft_ms / 1e3).max(1e-9);
    let (mut with, mut without) = (Vec::new(), Vec::new());
    let (mut masks, mut mask_ns, mut wait_ns, mut tokens, mut valid) = (0, 0, 0, 0, 0);
    for _ in 0..args.runs.max(1) {
        let (mut ta, mut tb, mut n) = (0.0, 0.0, 0);
        for p in &sets {
            let before = engine.stats();
            let c = engine.complete(
                &GenerateRequest {
                    constraint: Some(tessera_engine::Constraint::JsonSchema(p.schema.clone())),
                    ..request(p)
                },
                &mut |_| {},
            )?;
            let after = engine.stats();
            masks += after.guide_masks - before.guide_masks;
            mask_ns += after.guide_mask_ns - before.guide_mask_ns;
            wait_ns += after.guide_wait_ns - before.guide_wait_ns;
            if serde_json::from_str::<serde_json::Value>(&c.text).is_ok() {
                valid += 1;
            } else {
                bail!("schema {}: the answer is not JSON: {:?}", p.name, c.text);
            }
            let plain = engine.complete(
                &GenerateRequest {
                    max_tokens: c.tokens.len().max(1),
                    ignore_eos: true,
                    ..request(p)
                },
                &mut |_| {},
            )?;
            (ta, tb, n) = (
                ta + decode_s(&c),
                tb + decode_s(&plain),
                n + c.tokens.len().saturating_sub(1),
            );
        }
        tokens = n;
        with.push(n as f64 / ta);
        without.push(n as f64 / tb);
    }
    let (a, b) = (median(with), median(without));
    let per = |ns: u64| ns as f64 / 1e3 / masks.max(1) as f64;
    let step_us = 1e6 / b;
    let lines = vec![
        format!(
            "structured: {} JSON schemas, greedy, {} runs (median); decode tok/s after the first token, {tokens} tokens a run",
            sets.len(),
            args.runs
        ),
        format!(
            "  constrained {a:>7.1} tok/s, unconstrained {b:>7.1} ({:.3}x; {:+.1}% per token)",
            a / b,
            (b / a - 1.0) * 100.0
        ),
        format!(
            "  masks: {:.1} us each to compute, {:.1} us of it on the step's path ({:.1}% of a {step_us:.0} us step); {valid} answers, all JSON",
            per(mask_ns),
            per(wait_ns),
            per(wait_ns) / step_us * 100.0
        ),
    ];
    let v = serde_json::json!({"scenario": "structured", "runs": args.runs, "schemas": sets.len(),
        "tokens": tokens, "constrained_tok_s": a, "unconstrained_tok_s": b, "ratio": a / b,
        "mask_us": per(mask_ns), "mask_wait_us": per(wait_ns), "step_us": step_us, "valid": valid});
    emit(args, v, &lines);
    Ok(())
}

/// The disk tier: `CONVS` conversations (a distinct ~600-token system
/// prompt each, ~40-token user turns, replies ≤ 32 greedy) taking turns
/// round-robin, on a pool sized to a third of their final working set, so
/// every history is evicted before its next turn. The pool alone beside the
/// same pool with its disk tier (a fresh `--cache-dir`), turn by turn
/// alternating: the share of each history served from cache from round 2
/// on, TTFT p50/p99 of those turns, the same greedy replies.
pub fn tiers(model: Model, args: &BenchArgs) -> Result<()> {
    const CONVS: u64 = 8;
    const ROUNDS: u64 = 5;
    const SYSTEM: usize = 600;
    let convs: Vec<(String, Vec<String>)> = (0..CONVS)
        .map(|c| {
            let users = (0..ROUNDS)
                .map(|r| text(&model, 500 + 10 * c + r, 40))
                .collect::<Result<_>>()?;
            Ok((text(&model, 300 + c, SYSTEM)?, users))
        })
        .collect::<Result<_>>()?;
    // The working set: every conversation's last prompt and reply, about
    // the system prompt and each round's turn (user ~40 tokens, reply ≤ 32,
    // the template's few).
    let working = CONVS as usize * (SYSTEM + ROUNDS as usize * 80);
    // A third of it in the global layers' pool, sized as the engine sizes
    // its pools: with sliding-window layers (Gemma 3), those layers get a
    // pool of a quarter of the global one's blocks, or at least one
    // request's window and prompt chunk.
    let base = args.kv.config(true);
    let bs = base.block_size;
    let blocks = (working / 3).div_ceil(bs);
    let mc = model.config();
    let per_layer = bs * mc.kv_bytes_per_token(base.cache_dtype) / mc.n_layers.max(1);
    let n_sliding = mc.num_sliding_layers();
    // (A chat keeps its system prompt's sliding-window K/V for a context
    // shift: a request needs its window, a prompt chunk and those.)
    let sliding_blocks = match mc.sliding_window() {
        Some(w) if !base.swa_full => base
            .swa_blocks
            .unwrap_or(blocks / 4)
            .max((w + base.prefill_chunk.max(1) + SYSTEM + 64).div_ceil(bs) + 3),
        Some(_) => blocks,
        None => 0,
    };
    let kv_memory =
        blocks * per_layer * (mc.n_layers - n_sliding) + sliding_blocks * per_layer * n_sliding;
    let dir = std::env::temp_dir().join(format!("tessera-bench-tiers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = |tier: bool| EngineConfig {
        kv_memory,
        swa_blocks: (sliding_blocks > 0).then_some(sliding_blocks),
        cache_dir: tier.then(|| dir.clone()),
        ..base.clone()
    };
    let model_name = model
        .path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let other = load_model(&model.path.display().to_string())?;
    let pool = Engine::from_model(model, cfg(false))?;
    let tiered = Engine::from_model(other, cfg(true))?;
    let opts = greedy_turn(REPLY_TOKENS);
    let mut a: Vec<_> = convs.iter().map(|c| pool.chat(Some(&c.0))).collect();
    let mut b: Vec<_> = convs.iter().map(|c| tiered.chat(Some(&c.0))).collect();
    let (mut hist, mut cached_a, mut cached_b, mut disk_b) = (0usize, 0usize, 0usize, 0usize);
    let (mut ttft_a, mut ttft_b) = (Vec::new(), Vec::new());
    let mut same = true;
    let mut last_len = 0;
    for round in 0..ROUNDS as usize {
        for c in 0..CONVS as usize {
            let u = &convs[c].1[round];
            let before = b[c].token_ids().len();
            let (x, y) = if (round + c) % 2 == 0 {
                let x = a[c].send(u, &opts, &mut |_| {})?;
                (x, b[c].send(u, &opts, &mut |_| {})?)
            } else {
                let y = b[c].send(u, &opts, &mut |_| {})?;
                (a[c].send(u, &opts, &mut |_| {})?, y)
            };
            same &= x.tokens == y.tokens;
            if round > 0 {
                hist += before;
                cached_a += x.usage.cached_tokens.min(before);
                cached_b += y.usage.cached_tokens.min(before);
                disk_b += y.usage.disk_cached_tokens;
                ttft_a.push(x.timings.ttft_ms);
                ttft_b.push(y.timings.ttft_ms);
            }
            last_len += usize::from(round + 1 == ROUNDS as usize) * b[c].token_ids().len();
        }
    }
    let q = tessera_bench::serving::quantile;
    let (p50a, p50b) = (q(&ttft_a, 0.5), q(&ttft_b, 0.5));
    let (p99a, p99b) = (q(&ttft_a, 0.99), q(&ttft_b, 0.99));
    let (sa, sb) = (
        cached_a as f64 / hist.max(1) as f64,
        cached_b as f64 / hist.max(1) as f64,
    );
    let t = tiered.stats().disk_tier.unwrap_or_default();
    let pool_tokens = tiered.stats().kv.num_blocks * bs;
    let lines = vec![
        format!(
            "tiers: {CONVS} conversations × {ROUNDS} rounds (system ~{SYSTEM} tokens, user ~40, replies ≤{REPLY_TOKENS}) on a pool of {pool_tokens} tokens; final working set {last_len} tokens ({:.1}× the pool)",
            last_len as f64 / pool_tokens as f64
        ),
        format!(
            "  history served from cache from round 2: pool alone {:.1}%, pool + disk tier {:.1}% ({:.1}% of it from disk)",
            100.0 * sa,
            100.0 * sb,
            100.0 * disk_b as f64 / cached_b.max(1) as f64
        ),
        format!(
            "  TTFT p50: {p50a:.0} ms pool alone, {p50b:.0} ms with the disk tier ({:.2}×); p99: {p99a:.0} vs {p99b:.0} ms",
            p50a / p50b.max(1e-9)
        ),
        format!(
            "  disk tier: {} blocks written, {} read back, {:.1} MiB on disk; same greedy replies: {same}",
            t.written,
            t.read,
            t.bytes as f64 / (1 << 20) as f64
        ),
    ];
    let v = serde_json::json!({
        "scenario": "tiers",
        "model": model_name,
        "sliding_pool_tokens": sliding_blocks * bs,
        "conversations": CONVS,
        "rounds": ROUNDS,
        "pool_tokens": pool_tokens,
        "working_set_tokens": last_len,
        "history_cached_share_pool": sa,
        "history_cached_share_tiered": sb,
        "disk_share_of_cached": disk_b as f64 / cached_b.max(1) as f64,
        "ttft_p50_ms_pool": p50a,
        "ttft_p50_ms_tiered": p50b,
        "ttft_p99_ms_pool": p99a,
        "ttft_p99_ms_tiered": p99b,
        "tier_blocks_written": t.written,
        "tier_blocks_read": t.read,
        "tier_bytes": t.bytes,
        "same_replies": same,
    });
    drop((a, b, pool, tiered));
    let _ = std::fs::remove_dir_all(&dir);
    emit(args, v, &lines);
    Ok(())
}
