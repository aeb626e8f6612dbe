//! [`Engine`]: one model, its paged KV pool and prefix cache, and
//! request-by-request generation.

use std::time::Instant;

use candle_core::DType;
use tessera_kernels::{copy_blocks, shift_kv, Rotation};
use tessera_kv::{
    Admission, CopyOp, KvCache, KvConfig, KvStats, Namespace, SeqId, ShiftPlan, TokenId,
};
use tessera_model::{Batch, LayerKv, Message, Model, Special};

use crate::sampler::{Sampler, SamplingParams};
use crate::{EngineError, ModelSource, Result};

/// Element type of the K/V cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheDType {
    F32,
    F16,
    BF16,
}

impl CacheDType {
    pub fn dtype(self) -> DType {
        match self {
            CacheDType::F32 => DType::F32,
            CacheDType::F16 => DType::F16,
            CacheDType::BF16 => DType::BF16,
        }
    }

    pub fn bytes(self) -> usize {
        self.dtype().size_in_bytes()
    }

    pub fn parse(s: &str) -> Option<CacheDType> {
        match s {
            "f32" => Some(CacheDType::F32),
            "f16" => Some(CacheDType::F16),
            "bf16" => Some(CacheDType::BF16),
            _ => None,
        }
    }
}

/// How the engine is set up.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Bytes for the K/V pool; the number of blocks follows from it.
    pub kv_memory: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    pub cache_dtype: CacheDType,
    /// Reuse cached prefixes across requests.
    pub prefix_cache: bool,
    /// Context length; `None`: the model's.
    pub context_length: Option<usize>,
    /// Most prompt tokens computed in one forward call.
    pub prefill_chunk: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            kv_memory: 256 << 20,
            block_size: 16,
            cache_dtype: CacheDType::F16,
            prefix_cache: true,
            context_length: None,
            prefill_chunk: 512,
        }
    }
}

/// What to generate from.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Raw text; control-token text in it is parsed (the caller owns it all).
    Text(String),
    Tokens(Vec<u32>),
    /// Messages rendered with the model's chat template.
    Chat(Vec<Message>),
}

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    /// Generation stops before any of these strings.
    pub stop: Vec<String>,
    /// Keep generating through end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// What to do when the sequence reaches the context length.
    pub context_shift: ContextShift,
}

/// Context-shift policy at the context limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ContextShift {
    /// Finish with reason `length`.
    #[default]
    Off,
    /// Keep the first `n_keep` tokens, drop half of the rest, move the tail
    /// down (rotating cached K by the position delta) and go on.
    Keep(usize),
}

impl GenerateRequest {
    pub fn new(prompt: Prompt) -> Self {
        GenerateRequest {
            prompt,
            sampling: SamplingParams::default(),
            max_tokens: 256,
            stop: Vec::new(),
            ignore_eos: false,
            context_shift: ContextShift::Off,
        }
    }
}

/// One generated token and the text it completes (possibly empty while a
/// multi-byte character or a possible stop string is held back).
#[derive(Debug, Clone, Copy)]
pub struct TokenEvent<'a> {
    pub id: u32,
    pub text: &'a str,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token.
    Stop,
    /// `max_tokens` or the context length.
    Length,
    /// A stop string.
    StopString,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop | FinishReason::StopString => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Prompt tokens whose K/V came from the prefix cache.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Timings {
    /// Request start to the first sampled token.
    pub ttft_ms: f64,
    /// Newly computed prompt tokens per second of prefill.
    pub prefill_tok_s: f64,
    /// Tokens per second after the first.
    pub decode_tok_s: f64,
    pub total_s: f64,
}

#[derive(Debug, Clone)]
pub struct Completion {
    pub text: String,
    /// Generated ids (end-of-generation token excluded).
    pub tokens: Vec<u32>,
    pub prompt_tokens: Vec<u32>,
    pub finish_reason: FinishReason,
    pub usage: Usage,
    pub timings: Timings,
}

/// Engine-wide counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineStats {
    pub kv: KvStats,
    pub requests: u64,
    pub prompt_tokens: u64,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u64,
}

impl EngineStats {
    /// Share of prompt tokens served from the cache.
    pub fn hit_ratio(&self) -> f64 {
        self.cached_tokens as f64 / (self.prompt_tokens.max(1)) as f64
    }
}

/// A model with its paged K/V pool and prefix cache.
pub struct Engine {
    model: Model,
    kv: KvCache,
    cache: Vec<LayerKv>,
    cfg: EngineConfig,
    ctx: usize,
    ns: Namespace,
    totals: EngineStats,
}

/// Length of the longest suffix of `text` that begins some stop string.
fn held_back(text: &str, stops: &[String]) -> usize {
    let mut hold = 0;
    for s in stops {
        for (k, _) in s.char_indices().skip(1) {
            if k > hold && text.ends_with(&s[..k]) {
                hold = k;
            }
        }
    }
    hold
}

impl Engine {
    /// Loads the model (downloading a hub source) and sizes the pool.
    pub fn load(
        source: &ModelSource,
        cfg: EngineConfig,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Engine> {
        let path = source.resolve()?;
        let model = Model::load(&path, progress)?;
        Engine::from_model(model, cfg)
    }

    pub fn from_model(model: Model, cfg: EngineConfig) -> Result<Engine> {
        let mc = model.config();
        let per_block = cfg.block_size * mc.kv_bytes_per_token(cfg.cache_dtype.bytes());
        let num_blocks = cfg.kv_memory / per_block.max(1);
        if num_blocks == 0 {
            return Err(EngineError::KvBudgetTooSmall {
                bytes: cfg.kv_memory,
                block_size: cfg.block_size,
                per_block,
            });
        }
        let kv = KvCache::new(KvConfig {
            num_blocks,
            block_size: cfg.block_size,
        })?;
        let cache = model
            .llama
            .new_cache(num_blocks, cfg.block_size, cfg.cache_dtype.dtype())?;
        let ctx = cfg.context_length.unwrap_or(mc.context_length);
        let ns = Namespace(model.fingerprint);
        Ok(Engine {
            model,
            kv,
            cache,
            cfg,
            ctx,
            ns,
            totals: EngineStats::default(),
        })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub fn context_length(&self) -> usize {
        self.ctx
    }

    pub fn kv_stats(&self) -> KvStats {
        self.kv.stats()
    }

    /// Cache occupancy and hit counters.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            kv: self.kv.stats(),
            ..self.totals
        }
    }

    /// Drops every cached prefix no request uses.
    pub fn clear_cache(&mut self) -> Result<usize> {
        Ok(self.kv.clear_cache()?)
    }

    /// The token ids a prompt becomes.
    pub fn tokenize_prompt(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        let tok = &self.model.tokenizer;
        Ok(match prompt {
            Prompt::Text(t) => tok.encode(t, Special::Parse, true)?,
            Prompt::Tokens(ids) => ids.clone(),
            Prompt::Chat(msgs) => self.model.template.encode(tok, msgs, true)?,
        })
    }

    /// Generates a completion, calling `on_token` for every token.
    pub fn generate(
        &mut self,
        req: &GenerateRequest,
        on_token: &mut dyn FnMut(TokenEvent),
    ) -> Result<Completion> {
        let start = Instant::now();
        let ids = self.tokenize_prompt(&req.prompt)?;
        if ids.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if ids.len() > self.ctx {
            return Err(EngineError::PromptTooLong {
                tokens: ids.len(),
                context: self.ctx,
            });
        }
        let vocab = self.model.config().vocab_size;
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::Invalid(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        let toks: Vec<TokenId> = ids.iter().copied().map(TokenId).collect();
        let reusable = if self.cfg.prefix_cache {
            &toks[..toks.len() - 1]
        } else {
            &[][..]
        };
        let (seq, cached) = self.kv.add_sequence(self.ns, reusable);
        let result = self.run(seq, ids, cached, req, start, on_token);
        // Whatever happened, the sequence's blocks go back; what was computed
        // stays cached for the next request.
        if result.is_ok() && self.cfg.prefix_cache {
            self.kv.insert_sequence(seq)?;
        }
        self.kv.free_sequence(seq)?;
        if let Ok(done) = &result {
            self.totals.requests += 1;
            self.totals.prompt_tokens += done.usage.prompt_tokens as u64;
            self.totals.cached_tokens += done.usage.cached_tokens as u64;
        }
        result
    }

    fn run(
        &mut self,
        seq: SeqId,
        ids: Vec<u32>,
        cached: usize,
        req: &GenerateRequest,
        start: Instant,
        on_token: &mut dyn FnMut(TokenEvent),
    ) -> Result<Completion> {
        let mut logits = Vec::new();
        let mut pos = cached;
        while pos < ids.len() {
            let end = (pos + self.cfg.prefill_chunk.max(1)).min(ids.len());
            logits = self
                .step(seq, &ids[pos..end], end == ids.len())?
                .unwrap_or_default();
            pos = end;
        }
        let prefill_s = start.elapsed().as_secs_f64();
        let mut sampler = Sampler::new(req.sampling.clone());
        let mut history = ids.clone();
        let mut out = Vec::new();
        let mut text = String::new();
        let mut emitted = 0;
        let mut ttft = None;
        let mut decode_start = Instant::now();
        let tokenizer = self.model.tokenizer.clone();
        let mut stream = tokenizer.stream();
        let finish = loop {
            if out.len() >= req.max_tokens {
                break FinishReason::Length;
            }
            let tok = sampler.sample(&logits, &history);
            if ttft.is_none() {
                ttft = Some(start.elapsed().as_secs_f64() * 1e3);
                decode_start = Instant::now();
            }
            if tokenizer.is_eog(tok) && !req.ignore_eos {
                break FinishReason::Stop;
            }
            out.push(tok);
            history.push(tok);
            if let Some(piece) = stream.push(tok)? {
                text.push_str(&piece);
            }
            if let Some(at) = req.stop.iter().filter_map(|s| text.find(s.as_str())).min() {
                text.truncate(at);
                on_token(TokenEvent {
                    id: tok,
                    text: &text[emitted.min(at)..],
                });
                emitted = text.len();
                break FinishReason::StopString;
            }
            let safe = text.len() - held_back(&text, &req.stop);
            on_token(TokenEvent {
                id: tok,
                text: &text[emitted..safe],
            });
            emitted = safe;
            if out.len() >= req.max_tokens {
                break FinishReason::Length;
            }
            let len = self.kv.sequence(seq)?.len();
            if len >= self.ctx {
                match req.context_shift {
                    ContextShift::Off => break FinishReason::Length,
                    ContextShift::Keep(n_keep) => {
                        // Keep n_keep (at most half the context), drop half of the rest.
                        let n_keep = n_keep.min(self.ctx / 2);
                        let n_discard = ((len - n_keep) / 2).max(1);
                        self.shift(seq, n_keep, n_discard)?;
                    }
                }
            }
            logits = self.step(seq, &[tok], true)?.unwrap_or_default();
        };
        if finish != FinishReason::StopString {
            if let Some(rest) = stream.finish()? {
                text.push_str(&rest);
            }
            if emitted < text.len() {
                if let Some(&last) = out.last() {
                    on_token(TokenEvent {
                        id: last,
                        text: &text[emitted..],
                    });
                }
            }
        }
        let decode_s = decode_start.elapsed().as_secs_f64();
        let new_prompt = ids.len() - cached;
        Ok(Completion {
            usage: Usage {
                prompt_tokens: ids.len(),
                cached_tokens: cached,
                completion_tokens: out.len(),
            },
            timings: Timings {
                ttft_ms: ttft.unwrap_or(prefill_s * 1e3),
                prefill_tok_s: new_prompt as f64 / prefill_s.max(1e-9),
                decode_tok_s: if out.len() > 1 {
                    (out.len() - 1) as f64 / decode_s.max(1e-9)
                } else {
                    0.0
                },
                total_s: start.elapsed().as_secs_f64(),
            },
            text,
            tokens: out,
            prompt_tokens: ids,
            finish_reason: finish,
        })
    }

    /// Reserves slots for `tokens`, runs the forward pass, and returns the
    /// logits of the last token when asked.
    fn step(&mut self, seq: SeqId, tokens: &[u32], want_logits: bool) -> Result<Option<Vec<f32>>> {
        let toks: Vec<TokenId> = tokens.iter().copied().map(TokenId).collect();
        let plan = match self.kv.append(seq, &toks)? {
            Admission::Ok(plan) => plan,
            Admission::Later { .. } | Admission::Never { .. } => {
                let len = self.kv.sequence(seq)?.len() + tokens.len();
                return Err(EngineError::OutOfKvMemory {
                    needed: self.kv.blocks_for(len),
                    total: self.kv.pool().num_blocks(),
                    block_size: self.kv.block_size(),
                });
            }
        };
        self.apply_copies(&plan.copies)?;
        let s = self.kv.sequence(seq)?;
        let first = s.len() - tokens.len();
        let positions: Vec<u32> = (first..s.len()).map(|p| p as u32).collect();
        let slots: Vec<u32> = plan.slots.iter().map(|s| s.0).collect();
        let table: Vec<u32> = s.block_table().iter().map(|b| b.0).collect();
        let token_seq = vec![0u32; tokens.len()];
        let last = [tokens.len() as u32 - 1];
        let batch = Batch {
            tokens,
            positions: &positions,
            slots: &slots,
            token_seq: &token_seq,
            block_tables: &table,
            max_blocks: table.len(),
            block_size: self.kv.block_size(),
            logits_for: if want_logits { &last } else { &[] },
        };
        let logits = self.model.llama.forward(&batch, &self.cache)?;
        self.kv.mark_computed(seq, s.len())?;
        if !want_logits {
            return Ok(None);
        }
        Ok(Some(logits.squeeze(0)?.to_vec1::<f32>()?))
    }

    /// Context shift of `seq`: the bookkeeping plan, then the K/V moves with
    /// the RoPE rotation of every cached K.
    fn shift(&mut self, seq: SeqId, n_keep: usize, n_discard: usize) -> Result<()> {
        let plan = match self.kv.plan_shift(seq, n_keep, n_discard)? {
            Admission::Ok(plan) => plan,
            Admission::Later { needed, .. } | Admission::Never { needed, .. } => {
                return Err(EngineError::OutOfKvMemory {
                    needed,
                    total: self.kv.pool().num_blocks(),
                    block_size: self.kv.block_size(),
                })
            }
        };
        self.apply_shift(&plan)
    }

    fn apply_shift(&self, plan: &ShiftPlan) -> Result<()> {
        self.apply_copies(&plan.copies)?;
        let moves: Vec<(u32, u32)> = plan.moves.iter().map(|m| (m.src.0, m.dst.0)).collect();
        let rotation = Rotation {
            style: self.model.config().rope_style,
            inv_freq: self.model.llama.inv_freq().to_vec(),
            delta: plan.position_delta,
        };
        for layer in &self.cache {
            shift_kv(&layer.k, &layer.v, &moves, &rotation)?;
        }
        Ok(())
    }

    fn apply_copies(&self, copies: &[CopyOp]) -> Result<()> {
        if copies.is_empty() {
            return Ok(());
        }
        let pairs: Vec<(u32, u32)> = copies.iter().map(|c| (c.src.0, c.dst.0)).collect();
        for layer in &self.cache {
            copy_blocks(&layer.k, &pairs)?;
            copy_blocks(&layer.v, &pairs)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::held_back;

    #[test]
    fn holds_back_possible_stop_prefixes() {
        let stops = vec!["</end>".to_string(), "STOP".to_string()];
        assert_eq!(held_back("hello </e", &stops), 3);
        assert_eq!(held_back("hello S", &stops), 1);
        assert_eq!(held_back("hello", &stops), 0);
    }
}
