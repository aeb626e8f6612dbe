//! tessera-bench: the workloads every benchmark of Tessera runs, defined
//! once so that `tessera bench` and the llama.cpp comparison
//! (`just bench-llamacpp`) measure exactly the same thing, and candle's own
//! `quantized_llama` as the plain-Rust baseline.
//!
//! - `prefill`: a 512-token prompt; `decode`: 128 tokens after 16;
//! - `chat`: 12 turns, a ~150-token system prompt, ~150-token user turns,
//!   32-token greedy replies;
//! - `shared-prefix`: 8 requests sharing a 1,000-token prefix, each with its
//!   own 50-token suffix;
//! - `interleaved`: 4 conversations (a ~400-token system prompt each)
//!   taking turns for 6 rounds, ~40-token user turns, 32-token replies;
//! - `server` ([`serving`]): 8 users, each an 8-turn chat with an
//!   OpenAI-compatible server (a shared ~200-token system prompt, ~60-token
//!   turns, 32-token replies), all at once over HTTP.

pub mod serving;

use anyhow::{bail, Result};
use tessera_engine::{Engine, Event, GenerateRequest, Prompt, SamplingParams};
use tessera_model::{Model, Special};

#[cfg(feature = "candle-baseline")]
mod candle;
#[cfg(feature = "candle-baseline")]
pub use candle::Candle;

pub const PREFILL_TOKENS: usize = 512;
pub const DECODE_PROMPT: usize = 16;
pub const DECODE_TOKENS: usize = 128;
/// Greedy reply length of the chat workloads.
pub const REPLY_TOKENS: usize = 32;

const TEXT: &str = "The history of computing is a story of abstraction layered on abstraction. \
Early machines were programmed by rewiring panels; later, stored programs let the same hardware \
run many tasks. Compilers turned human-readable code into machine instructions, operating systems \
shared processors between programs, and networks joined machines across continents. Each layer \
hid the details of the one below, so that people could think about larger problems. ";

/// The prefill prompt: `PREFILL_TOKENS` tokens (BOS first).
pub fn prefill_prompt(model: &Model) -> Result<Vec<u32>> {
    let mut text = String::new();
    while text.len() < PREFILL_TOKENS * 8 {
        text.push_str(TEXT);
    }
    let mut ids = model.tokenizer.encode(&text, Special::AsText, true)?;
    if ids.len() < PREFILL_TOKENS {
        bail!("benchmark text gave only {} tokens", ids.len());
    }
    ids.truncate(PREFILL_TOKENS);
    Ok(ids)
}

/// The decode prompt: the first `DECODE_PROMPT` tokens of the prefill one.
pub fn decode_prompt(model: &Model) -> Result<Vec<u32>> {
    Ok(prefill_prompt(model)?[..DECODE_PROMPT].to_vec())
}

const WORDS: &[&str] = &[
    "river", "engine", "garden", "window", "theory", "market", "signal", "forest", "letter",
    "bridge", "planet", "memory", "harbor", "circuit", "painting", "kitchen", "voyage", "mountain",
    "library", "weather", "question", "machine", "island", "story", "winter", "language", "number",
    "friend", "music", "station", "orbit", "village", "teacher", "problem", "pattern", "journey",
];

/// Text of about `n` tokens, different for each seed: sentences built
/// from a small vocabulary, cut at a token boundary.
pub fn text(model: &Model, seed: u64, n: usize) -> Result<String> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut text = String::new();
    let mut sentence = 0;
    while text.len() < n * 8 {
        let mut words = Vec::new();
        for _ in 0..8 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            words.push(WORDS[(x % WORDS.len() as u64) as usize]);
        }
        sentence += 1;
        text.push_str(&format!(
            "Point {sentence}: the {} of the {} met a {} near the {}, and the {} spoke of {} {} and {}. ",
            words[0], words[1], words[2], words[3], words[4], words[5], words[6], words[7]
        ));
    }
    let ids = model.tokenizer.encode(&text, Special::AsText, false)?;
    Ok(model.tokenizer.decode(&ids[..n.min(ids.len())])?)
}

/// Context length of `decode-long`.
pub const LONG_CONTEXT: usize = 2048;

/// The `decode-long` prompt: `LONG_CONTEXT` tokens (BOS first).
pub fn long_prompt(model: &Model) -> Result<Vec<u32>> {
    let long_text = text(model, 77, LONG_CONTEXT + 52)?;
    let mut long = model.tokenizer.encode(&long_text, Special::AsText, true)?;
    long.truncate(LONG_CONTEXT);
    if long.len() < LONG_CONTEXT {
        bail!("the long prompt has only {} tokens", long.len());
    }
    Ok(long)
}

/// The `decode-batch` prompts: `n` different 16-token prompts.
pub fn batch_prompts(model: &Model, n: usize) -> Result<Vec<Vec<u32>>> {
    (0..n as u64)
        .map(|i| {
            let t = text(model, 500 + i, DECODE_PROMPT)?;
            let mut ids = model.tokenizer.encode(&t, Special::AsText, true)?;
            ids.truncate(DECODE_PROMPT);
            Ok(ids)
        })
        .collect()
}

/// One greedy decode of `steps` tokens after `prompt` (EOS ignored):
/// tok/s from the first token to the last.
pub fn decode_steps(engine: &Engine, prompt: &[u32], steps: usize) -> Result<f64> {
    let c = engine.complete(
        &GenerateRequest {
            max_tokens: steps + 1,
            sampling: SamplingParams::greedy(),
            ignore_eos: true,
            ..GenerateRequest::new(Prompt::Tokens(prompt.to_vec()))
        },
        &mut |_| {},
    )?;
    let secs = c.timings.total_s - c.timings.ttft_ms / 1e3;
    Ok(c.usage.completion_tokens.saturating_sub(1) as f64 / secs.max(1e-9))
}

/// Aggregate decode tok/s of `prompts` decoding together on `engine`
/// (`DECODE_TOKENS` each after the prompt, greedy): every generated token
/// after each one's first, over the time from the last first token to the
/// last finish (from the completions' timings, all measured from their
/// submission, which is the same moment).
pub fn decode_together(engine: &Engine, prompts: &[Vec<u32>]) -> Result<f64> {
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| {
            engine.generate(GenerateRequest {
                max_tokens: DECODE_TOKENS + 1,
                sampling: SamplingParams::greedy(),
                ignore_eos: true,
                ..GenerateRequest::new(Prompt::Tokens(p.clone()))
            })
        })
        .collect::<std::result::Result<_, _>>()?;
    let (mut tokens, mut last_first, mut last_end) = (0usize, 0f64, 0f64);
    for s in streams {
        for ev in s {
            match ev {
                Event::Token { .. } => {}
                Event::Done(c) => {
                    tokens += c.usage.completion_tokens.saturating_sub(1);
                    last_first = last_first.max(c.timings.ttft_ms / 1e3);
                    last_end = last_end.max(c.timings.total_s);
                }
                Event::Error(e) => return Err(e.into()),
            }
        }
    }
    Ok(tokens as f64 / (last_end - last_first).max(1e-9))
}

/// A conversation: its system prompt and user turns.
#[derive(Debug, Clone)]
pub struct Conversation {
    pub system: String,
    pub users: Vec<String>,
}

/// The chat benchmark: 12 turns, system ~150 tokens, user turns ~150.
pub fn chat(model: &Model) -> Result<Conversation> {
    Ok(Conversation {
        system: text(model, 1, 150)?,
        users: (0..12)
            .map(|i| text(model, 100 + i, 150))
            .collect::<Result<_>>()?,
    })
}

/// The shared-prefix benchmark: a 1,000-token prefix (BOS first) and 8
/// suffixes of 50 tokens.
pub fn shared_prefix(model: &Model) -> Result<(Vec<u32>, Vec<Vec<u32>>)> {
    let tok = &model.tokenizer;
    let mut prefix = tok.encode(&text(model, 7, 1000)?, Special::AsText, true)?;
    prefix.truncate(1000);
    let suffixes = (0..8)
        .map(|i| {
            let mut ids = tok.encode(&text(model, 50 + i, 50)?, Special::AsText, false)?;
            ids.truncate(50);
            Ok(ids)
        })
        .collect::<Result<_>>()?;
    Ok((prefix, suffixes))
}

/// The interleaved benchmark: 4 conversations, 6 rounds; conversation `c`
/// speaks `users[r]` in round `r`.
pub fn interleaved(model: &Model) -> Result<Vec<Conversation>> {
    (0..4u64)
        .map(|c| {
            Ok(Conversation {
                system: text(model, 200 + c, 400)?,
                users: (0..6u64)
                    .map(|r| text(model, 300 + r * 4 + c, 40))
                    .collect::<Result<_>>()?,
            })
        })
        .collect()
}

pub fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}
