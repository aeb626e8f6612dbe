//! `tessera bench`: prefill and decode speed on one model, beside candle's
//! own `quantized_llama` on the same GGUF file, measured in the same run,
//! alternating the two engines, and reported as medians with their ratio;
//! and the KV-cache scenarios (chat, shared-prefix, interleaved, shift),
//! each against the same engine with the cache's help taken away.

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
#[cfg(feature = "candle-baseline")]
use tessera_bench::Candle;
use tessera_bench::{decode_prompt, median, prefill_prompt, DECODE_TOKENS, PREFILL_TOKENS};
use tessera_engine::{Engine, GenerateRequest, Prompt, SamplingParams};
use tessera_model::ModelFormat;

use crate::{load_model, KvArgs};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Scenario {
    /// Prompt processing: tok/s on a 512-token prompt.
    Prefill,
    /// Generation: tok/s over 128 tokens after a 16-token prompt.
    Decode,
    /// A 12-turn chat: TTFT per turn with and without prefix reuse.
    Chat,
    /// 8 requests sharing a 1,000-token prefix, submitted together.
    SharedPrefix,
    /// 4 conversations taking turns on one engine.
    Interleaved,
    /// Greedy agreement after a context shift with a fresh prefill.
    Shift,
    /// Generation deep in a context: 128 tokens after 2,048, beside the
    /// short decode in the same run.
    DecodeLong,
    /// Several sequences decoding together (4 and 8): aggregate tok/s
    /// beside one sequence alone in the same run.
    DecodeBatch,
    /// Agreement of the integer activation modes with f32 activations:
    /// top-1 and KL over a fixed corpus, and greedy replies.
    Fidelity,
    /// Simulated users (--users), each an N-turn chat (--turns) with an
    /// OpenAI-compatible server over HTTP, all at once: TTFT p50/p99,
    /// throughput, cached share of the history. Tessera's own server
    /// beside itself with reuse off, or any server at --url.
    Server,
    /// Models with sliding-window layers (Gemma 3): an 8,192-token request
    /// on the smallest sliding pool beside full attention's memory (KV
    /// bytes, speed, same tokens), and a 12-turn conversation's share of
    /// prompt tokens served from the cache on that pool.
    SlidingWindow,
    /// Each KV cache type (f16, q8_0, q4_0) in the same run: cached tokens
    /// per MiB of KV memory, and decode tok/s after 16 and 2,048 tokens.
    KvTypes,
    /// A stream decoding while a 2,000-token session is saved (its K/V
    /// computed as a background request): the stream's largest and median
    /// gap between tokens beside the same stream alone, alternating runs,
    /// and how long the save took.
    SessionSave,
    /// A long random mix of requests (lengths, n > 1, cancellations,
    /// context shifts, sessions, defragment, shrink and grow, injected
    /// faults): errors, leaked blocks, RSS.
    Soak,
    /// Speculative decoding by prompt lookup: decode tok/s of
    /// input-grounded prompts (edit, quote, rewrite) and of plain chat
    /// prompts with and without it, alternating; the same greedy tokens.
    Spec,
    /// Structured output: decode tok/s of answers constrained by the JSON
    /// schemas of `data/structured-schemas.json` against the same number
    /// of tokens unconstrained, and the masks' own time per token.
    Structured,
    /// The disk tier below the KV pool: conversations taking turns on a
    /// pool a third of their working set, the pool alone beside the pool
    /// with its disk tier (`--cache-dir`): the history served from cache,
    /// TTFT p50/p99, the same greedy replies.
    Tiers,
    /// The host's memory read bandwidth: 1 GiB, far past the last-level
    /// cache, read by as many threads as the kernels use, the best of
    /// --runs passes. Decode at real sizes streams every weight once per
    /// token, so this is its roofline. With --model, the model's decode as
    /// a share of it: short decodes alternating with read passes, each
    /// decode's weight bytes a second (and each part's of the step) over
    /// the mean of the reads either side, so the host's drifting
    /// bandwidth falls on both alike.
    Roofline,
}

#[derive(Args)]
pub struct BenchArgs {
    /// The model (every scenario; roofline's is optional).
    #[arg(long)]
    model: Option<String>,
    #[arg(long, value_enum)]
    pub(crate) scenario: Scenario,
    /// Timed runs per engine (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub(crate) runs: usize,
    /// Skip the baseline: candle's quantized_llama, or for the server
    /// scenario Tessera with reuse off.
    #[arg(long)]
    pub(crate) no_baseline: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub(crate) json: bool,
    /// Requests of the soak scenario.
    #[arg(long, default_value_t = 2000)]
    pub(crate) requests: usize,
    /// Users of the server scenario.
    #[arg(long, default_value_t = tessera_bench::serving::USERS)]
    pub(crate) users: usize,
    /// Turns per user of the server scenario.
    #[arg(long, default_value_t = tessera_bench::serving::TURNS)]
    pub(crate) turns: usize,
    /// Seed of the server scenario's first run (run r uses seed + r).
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// The model name to send with --url (default: the first that the
    /// server's /v1/models lists).
    #[arg(long)]
    pub(crate) served_model: Option<String>,
    /// The server scenario against this server (http://HOST:PORT) instead
    /// of Tessera's own in this process.
    #[arg(long)]
    pub(crate) url: Option<String>,
    #[command(flatten)]
    pub(crate) kv: KvArgs,
}

pub fn bench(args: BenchArgs) -> Result<()> {
    if args.runs == 0 {
        bail!("--runs must be at least 1");
    }
    if args.scenario == Scenario::Roofline {
        return match args.model.as_deref() {
            Some(m) => crate::scenarios::roofline_share(load_model(m)?, &args),
            None => roofline(&args),
        };
    }
    let Some(model) = args.model.as_deref() else {
        let name = args
            .scenario
            .to_possible_value()
            .map(|v| v.get_name().to_owned());
        bail!(
            "--model is required for the {} scenario",
            name.unwrap_or_default()
        );
    };
    let model = load_model(model)?;
    let path = model.path.clone();
    let is_gguf = model.format == ModelFormat::Gguf;
    let ids = prefill_prompt(&model)?;
    let short = decode_prompt(&model)?;
    match args.scenario {
        Scenario::Prefill | Scenario::Decode => {}
        Scenario::Chat => return crate::scenarios::chat(model, &args),
        Scenario::SharedPrefix => return crate::scenarios::shared_prefix(model, &args),
        Scenario::Interleaved => return crate::scenarios::interleaved(model, &args),
        Scenario::Tiers => return crate::scenarios::tiers(model, &args),
        Scenario::Shift => return crate::scenarios::shift(model, &args),
        Scenario::Soak => return crate::soak::soak(model, &args),
        Scenario::KvTypes => return crate::scenarios::kv_types(model, &args),
        Scenario::SessionSave => return crate::scenarios::session_save(model, &args),
        Scenario::SlidingWindow => return crate::sliding::sliding_window(model, &args),
        Scenario::Server => return crate::serving::server(model, &args),
        Scenario::Fidelity => return crate::fidelity::fidelity(model, &args),
        Scenario::Spec => return crate::scenarios::spec(model, &args),
        Scenario::Structured => return crate::scenarios::structured(model, &args),
        Scenario::DecodeLong | Scenario::DecodeBatch => {
            return crate::scenarios::decode_depth_and_width(model, &args)
        }
        Scenario::Roofline => unreachable!("returned above"),
    }
    let engine = Engine::from_model(model, args.kv.config(false))?;
    let mut candle = if is_gguf && !args.no_baseline {
        baseline(&path)?
    } else {
        None
    };
    let threads = candle_core::utils::get_num_threads();
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    // Alternate the engines run by run so drift hits both alike.
    for _ in 0..args.runs {
        match args.scenario {
            Scenario::Prefill => {
                let req = GenerateRequest {
                    max_tokens: 1,
                    sampling: SamplingParams::greedy(),
                    ..GenerateRequest::new(Prompt::Tokens(ids.clone()))
                };
                let done = engine.complete(&req, &mut |_| {})?;
                ours.push(done.timings.prefill_tok_s);
                if let Some(c) = candle.as_mut() {
                    theirs.push(PREFILL_TOKENS as f64 / c.prefill(&ids)?);
                }
            }
            Scenario::Decode => {
                let prompt = short.clone();
                let req = GenerateRequest {
                    max_tokens: DECODE_TOKENS + 1,
                    sampling: SamplingParams::greedy(),
                    ignore_eos: true,
                    ..GenerateRequest::new(Prompt::Tokens(prompt.clone()))
                };
                let done = engine.complete(&req, &mut |_| {})?;
                ours.push(done.timings.decode_tok_s);
                if let Some(c) = candle.as_mut() {
                    theirs.push(DECODE_TOKENS as f64 / c.decode(&prompt, DECODE_TOKENS)?.0);
                }
            }
            _ => unreachable!("returned above"),
        }
    }
    let (metric, label) = match args.scenario {
        Scenario::Prefill => (
            "prefill_tok_s",
            format!("prefill, {PREFILL_TOKENS}-token prompt"),
        ),
        Scenario::Decode => ("decode_tok_s", format!("decode, {DECODE_TOKENS} tokens")),
        _ => unreachable!("returned above"),
    };
    let t = median(ours);
    let c = (!theirs.is_empty()).then(|| median(theirs));
    let ratio = c.map(|c| t / c);
    if args.json {
        let v = serde_json::json!({
            "scenario": format!("{:?}", args.scenario).to_lowercase(),
            "metric": metric,
            "unit": "tok/s",
            "tessera": t,
            "candle": c,
            "ratio": ratio,
            "runs": args.runs,
            "threads": threads,
        });
        println!("{v}");
    } else {
        println!(
            "{label}: {} runs each, {threads} threads, median tok/s",
            args.runs
        );
        println!("  tessera                   {t:>8.1}");
        match (c, ratio) {
            (Some(c), Some(r)) => {
                println!("  candle (quantized model) {c:>8.1}");
                println!("  ratio (tessera / candle)  {r:>8.2}x");
            }
            _ => println!("  candle (quantized model) (not run)"),
        }
    }
    Ok(())
}

/// Bytes each pass of the roofline reads.
const ROOFLINE_BYTES: usize = 1 << 30;

/// `tessera bench --scenario roofline`: GB/s reading [`ROOFLINE_BYTES`]
/// (on huge pages where the system has them, as the weights are) split
/// among the kernels' thread count, with AVX2 loads where present,
/// best of `--runs` passes (after one untimed pass).
fn roofline(args: &BenchArgs) -> Result<()> {
    let threads = candle_core::utils::get_num_threads();
    let data = tessera_kernels::read_buffer(ROOFLINE_BYTES);
    let pass = || tessera_kernels::timed_read(&data, threads);
    pass();
    let best = (0..args.runs).map(|_| pass()).fold(f64::MAX, f64::min);
    let gbs = ROOFLINE_BYTES as f64 / best / 1e9;
    if args.json {
        let v = serde_json::json!({
            "scenario": "roofline",
            "metric": "read_gb_s",
            "unit": "GB/s",
            "tessera": gbs,
            "bytes": ROOFLINE_BYTES,
            "runs": args.runs,
            "threads": threads,
        });
        println!("{v}");
    } else {
        println!(
            "memory read bandwidth: {gbs:.1} GB/s ({threads} threads, best of {} passes of 1 GiB)",
            args.runs
        );
    }
    Ok(())
}

/// candle's own quantized model of the file, the prefill and decode
/// baseline (feature `candle-baseline`).
#[cfg(feature = "candle-baseline")]
fn baseline(path: &std::path::Path) -> Result<Option<Candle>> {
    Ok(Some(Candle::load(path, &crate::device()?)?))
}

/// Without the `candle-baseline` feature there is no candle to time: the
/// figures come without a baseline, and stderr says how to get one.
#[cfg(not(feature = "candle-baseline"))]
fn baseline(_: &std::path::Path) -> Result<Option<Candle>> {
    eprintln!(
        "tessera bench: this build has no candle baseline (build with `--features candle-baseline`, \
         or pass --no-baseline)"
    );
    Ok(None)
}

/// No value: a build without `candle-baseline` never has a candle model.
#[cfg(not(feature = "candle-baseline"))]
enum Candle {}

#[cfg(not(feature = "candle-baseline"))]
impl Candle {
    fn prefill(&mut self, _: &[u32]) -> Result<f64> {
        match *self {}
    }

    fn decode(&mut self, _: &[u32], _: usize) -> Result<(f64, Vec<u32>)> {
        match *self {}
    }
}
