//! The serving workload: simulated users, each holding a multi-turn chat
//! with an OpenAI-compatible server, all arriving together. Each turn is a
//! streamed chat completion carrying the whole conversation so far; the
//! client measures time to the first generated text and reads the prompt,
//! cached and generated token counts the server reports (`usage`, or
//! llama-server's `timings`). Any server that speaks the protocol can be
//! measured the same way: Tessera's, llama.cpp's `llama-server`, vLLM.

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use tessera_model::Model;

use crate::{text, Conversation};

/// Users, turns and reply length of the default workload.
pub const USERS: usize = 8;
pub const TURNS: usize = 8;
pub const SERVE_REPLY_TOKENS: usize = 32;

/// One conversation per user: a system prompt of ~200 tokens that all
/// users share (the application's), and user turns of ~60 tokens; other
/// seeds give other texts.
pub fn serving(model: &Model, users: usize, turns: usize, seed: u64) -> Result<Vec<Conversation>> {
    let base = 10_000u64.wrapping_mul(seed + 1);
    let system = text(model, base, 200)?;
    (0..users as u64)
        .map(|u| {
            Ok(Conversation {
                system: system.clone(),
                users: (0..turns as u64)
                    .map(|t| text(model, base + 1 + u * 64 + t, 60))
                    .collect::<Result<_>>()?,
            })
        })
        .collect()
}

/// What one turn measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TurnStat {
    pub user: usize,
    pub turn: usize,
    /// Request sent to the first non-empty text.
    pub ttft_s: f64,
    /// Request sent to the end of the stream.
    pub total_s: f64,
    pub prompt_tokens: usize,
    /// Prompt tokens the server did not compute.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
}

/// The whole run.
#[derive(Debug, Clone)]
pub struct LoadReport {
    pub turns: Vec<TurnStat>,
    /// First request sent to last response ended.
    pub wall_s: f64,
}

/// The `p`-quantile (0 to 1) by nearest rank.
pub fn quantile(xs: &[f64], p: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = (p * v.len() as f64).ceil().max(1.0) as usize;
    v[rank.min(v.len()) - 1]
}

impl LoadReport {
    pub fn ttfts(&self) -> Vec<f64> {
        self.turns.iter().map(|t| t.ttft_s).collect()
    }

    /// Generated tokens per second over the whole run.
    pub fn throughput(&self) -> f64 {
        let n: usize = self.turns.iter().map(|t| t.completion_tokens).sum();
        n as f64 / self.wall_s.max(1e-9)
    }

    /// From the second turn on: the share of each prompt's history (the
    /// previous turn's prompt and reply) that came from the cache.
    pub fn history_cached(&self) -> f64 {
        let (mut cached, mut history) = (0usize, 0usize);
        for t in self.turns.iter().filter(|t| t.turn > 0) {
            let prev = self
                .turns
                .iter()
                .find(|p| p.user == t.user && p.turn == t.turn - 1);
            if let Some(p) = prev {
                history += p.prompt_tokens + p.completion_tokens;
                cached += t.cached_tokens;
            }
        }
        cached as f64 / history.max(1) as f64
    }

    /// Cached share of all prompt tokens.
    pub fn hit_ratio(&self) -> f64 {
        let p: usize = self.turns.iter().map(|t| t.prompt_tokens).sum();
        let c: usize = self.turns.iter().map(|t| t.cached_tokens).sum();
        c as f64 / p.max(1) as f64
    }

    pub fn json(&self) -> Value {
        let ttft = self.ttfts();
        json!({
            "ttft_p50_ms": quantile(&ttft, 0.5) * 1e3,
            "ttft_p99_ms": quantile(&ttft, 0.99) * 1e3,
            "throughput_tok_s": self.throughput(),
            "hit_ratio": self.hit_ratio(),
            "history_cached": self.history_cached(),
            "wall_s": self.wall_s,
            "requests": self.turns.len(),
        })
    }
}

/// Runs the workload against `base` (`http://host:port`): every user
/// starts at once and sends its next turn as soon as its previous reply
/// has ended. `extra` fields go into every request body (e.g.
/// `cache_prompt: false`). Greedy replies of exactly `reply_tokens`
/// (`ignore_eos`), so that every server generates the same amount.
pub fn run_load(
    base: &str,
    model_name: &str,
    convs: &[Conversation],
    reply_tokens: usize,
    extra: &Value,
) -> Result<LoadReport> {
    let start = Instant::now();
    let per_user: Vec<Result<Vec<TurnStat>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = convs
            .iter()
            .enumerate()
            .map(|(user, conv)| {
                scope.spawn(move || {
                    let mut messages = vec![json!({"role": "system", "content": conv.system})];
                    let mut stats = Vec::new();
                    for (turn, said) in conv.users.iter().enumerate() {
                        messages.push(json!({"role": "user", "content": said}));
                        let mut body = json!({
                            "model": model_name,
                            "messages": messages,
                            "max_tokens": reply_tokens,
                            "temperature": 0,
                            "ignore_eos": true,
                            "stream": true,
                            "stream_options": {"include_usage": true},
                        });
                        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
                            b.extend(e.clone());
                        }
                        let (reply, mut stat) = turn_once(base, &body)
                            .with_context(|| format!("user {user}, turn {}", turn + 1))?;
                        stat.user = user;
                        stat.turn = turn;
                        stats.push(stat);
                        messages.push(json!({"role": "assistant", "content": reply}));
                    }
                    Ok(stats)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow!("a user thread panicked")))
            })
            .collect()
    });
    let wall_s = start.elapsed().as_secs_f64();
    let mut turns = Vec::new();
    for r in per_user {
        turns.extend(r?);
    }
    Ok(LoadReport { turns, wall_s })
}

/// The first model `base` lists at `/v1/models` (`default` if it lists
/// none, as servers that ignore the field may).
pub fn served_model(base: &str) -> Result<String> {
    let r = ureq::get(&format!("{base}/v1/models"))
        .timeout(Duration::from_secs(30))
        .call()
        .map_err(|e| anyhow!("GET {base}/v1/models: {e}"))?;
    let v: Value = serde_json::from_str(&r.into_string()?)?;
    Ok(v["data"][0]["id"].as_str().unwrap_or("default").to_string())
}

/// One streamed chat completion: its text and what it measured.
fn turn_once(base: &str, body: &Value) -> Result<(String, TurnStat)> {
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(600))
        .build();
    let sent = Instant::now();
    let r = agent
        .post(&format!("{base}/v1/chat/completions"))
        .set("Content-Type", "application/json")
        .send_string(&body.to_string())
        .map_err(|e| match e {
            ureq::Error::Status(code, r) => {
                anyhow!("HTTP {code}: {}", r.into_string().unwrap_or_default())
            }
            other => anyhow!("{other}"),
        })?;
    let mut text = String::new();
    let mut first: Option<f64> = None;
    let (mut prompt, mut cached, mut completion) = (None, None, None);
    for line in BufReader::new(r.into_reader()).lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).with_context(|| format!("chunk {data}"))?;
        if v.get("error").is_some() {
            bail!("error in the stream: {data}");
        }
        if let Some(piece) = v["choices"][0]["delta"]["content"].as_str() {
            if !piece.is_empty() {
                first.get_or_insert_with(|| sent.elapsed().as_secs_f64());
                text.push_str(piece);
            }
        }
        let u = &v["usage"];
        if u.is_object() {
            prompt = u["prompt_tokens"].as_u64().or(prompt);
            completion = u["completion_tokens"].as_u64().or(completion);
            cached = u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .or(cached);
        }
        // llama-server's own counts (its usage may lack the cached ones).
        if let Some(n) = v["timings"]["cache_n"].as_u64() {
            cached = Some(n);
        }
    }
    let total_s = sent.elapsed().as_secs_f64();
    let prompt = prompt.ok_or_else(|| anyhow!("the stream had no usage"))? as usize;
    Ok((
        text,
        TurnStat {
            user: 0,
            turn: 0,
            ttft_s: first.unwrap_or(total_s),
            total_s,
            prompt_tokens: prompt,
            cached_tokens: cached.unwrap_or(0) as usize,
            completion_tokens: completion.unwrap_or(0) as usize,
        },
    ))
}
