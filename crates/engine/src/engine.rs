//! [`Engine`]: a cheap, cloneable, thread-safe handle to one model, its
//! paged KV pool and prefix cache, served by a worker thread that runs the
//! continuous-batching loop (see `core.rs`).

use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use candle_core::DType;
use tessera_kv::KvStats;
use tessera_model::{Message, Model, Special};

use crate::core::{Command, Core};
use crate::sampler::SamplingParams;
use crate::stream::{Event, RequestStream};
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
    /// Most tokens computed in one forward call (decodes and prompt
    /// chunks of all running requests together).
    pub prefill_chunk: usize,
    /// Most requests decoding together.
    pub max_running: usize,
    /// Where the prefix cache is written on shutdown and read at start.
    pub cache_dir: Option<PathBuf>,
    /// Defragment automatically when idle and more than this share of the
    /// pool's span is holes.
    pub defrag_threshold: f64,
    /// Compute threads (default: all cores). The pool is process-wide: the
    /// first engine (or `RAYON_NUM_THREADS`) sets it.
    pub threads: Option<usize>,
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
            max_running: 16,
            cache_dir: None,
            defrag_threshold: 0.25,
            threads: None,
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
    /// Independent samples of the prompt; they share its prefill and its
    /// blocks (fork, copy-on-write). Sample `i` uses seed `seed + i`.
    pub n: usize,
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
            n: 1,
        }
    }
}

/// One generated token and the text it completes (possibly empty while a
/// multi-byte character or a possible stop string is held back).
#[derive(Debug, Clone, Copy)]
pub struct TokenEvent<'a> {
    /// Which sample (0 unless `n > 1`).
    pub index: usize,
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
    /// The caller cancelled (or dropped the stream).
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop | FinishReason::StopString => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
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
    /// Which sample (0 unless `n > 1`).
    pub index: usize,
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
    pub completion_tokens: u64,
    /// Running requests sent back to the queue for lack of blocks.
    pub preemptions: u64,
    /// Forward steps run.
    pub steps: u64,
    /// Defragmentations run (by call or when idle).
    pub defrags: u64,
}

impl EngineStats {
    /// Share of prompt tokens served from the cache.
    pub fn hit_ratio(&self) -> f64 {
        self.cached_tokens as f64 / (self.prompt_tokens.max(1)) as f64
    }
}

/// A model with its paged K/V pool and prefix cache, served by one worker
/// thread. Cloning is cheap; clones share everything and may be used from
/// any thread. Requests run concurrently, batched together step by step.
/// The worker stops (writing the cache to `cache_dir`, if set) when the last
/// clone is dropped.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

struct Inner {
    model: Arc<Model>,
    cfg: EngineConfig,
    ctx: usize,
    per_block: usize,
    tx: mpsc::Sender<Command>,
    worker: Option<JoinHandle<()>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.tx.send(Command::Shutdown);
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
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

    /// Sizes the pool from `cfg.kv_memory`, starts the worker, and restores
    /// the prefix cache from `cfg.cache_dir` when it holds one.
    pub fn from_model(model: Model, cfg: EngineConfig) -> Result<Engine> {
        if let Some(n) = cfg.threads {
            // Fails only when the pool already exists: the first one stays.
            let _ = rayon::ThreadPoolBuilder::new()
                .num_threads(n.max(1))
                .build_global();
        }
        let mc = model.config();
        let per_block = cfg.block_size * mc.kv_bytes_per_token(cfg.cache_dtype.bytes());
        let ctx = cfg.context_length.unwrap_or(mc.context_length);
        let model = Arc::new(model);
        let core = Core::new(model.clone(), &cfg, ctx, per_block)?;
        let (tx, rx) = mpsc::channel();
        let worker = std::thread::Builder::new()
            .name("tessera-engine".into())
            .spawn(move || core.run(rx))
            .map_err(|e| EngineError::Invalid(format!("cannot start the engine thread: {e}")))?;
        let engine = Engine {
            inner: Arc::new(Inner {
                model,
                cfg,
                ctx,
                per_block,
                tx,
                worker: Some(worker),
            }),
        };
        if let Some(dir) = &engine.inner.cfg.cache_dir {
            engine.restore_cache_dir(dir)?;
        }
        Ok(engine)
    }

    pub fn model(&self) -> &Model {
        &self.inner.model
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.cfg
    }

    pub fn context_length(&self) -> usize {
        self.inner.ctx
    }

    /// Bytes of one KV block (all layers, K and V).
    pub fn block_bytes(&self) -> usize {
        self.inner.per_block
    }

    /// Sends a command to the worker and waits for its answer.
    pub(crate) fn call<T: Send + 'static>(
        &self,
        make: impl FnOnce(mpsc::Sender<T>) -> Command,
    ) -> Result<T> {
        let (tx, rx) = mpsc::channel();
        self.inner
            .tx
            .send(make(tx))
            .map_err(|_| EngineError::Stopped)?;
        rx.recv().map_err(|_| EngineError::Stopped)
    }

    pub fn kv_stats(&self) -> KvStats {
        self.stats().kv
    }

    /// Cache occupancy, hit and scheduling counters.
    pub fn stats(&self) -> EngineStats {
        self.call(Command::Stats).unwrap_or_default()
    }

    /// Drops every cached prefix no request uses; returns the blocks freed.
    pub fn clear_cache(&self) -> Result<usize> {
        self.call(Command::ClearCache)?
    }

    /// Compacts live blocks to the low end of the pool; returns the blocks
    /// moved.
    pub fn defragment(&self) -> Result<usize> {
        self.call(Command::Defragment)?
    }

    /// Resizes the pool to `bytes` (whole blocks). Shrinking evicts cached
    /// blocks as needed, defragments, and gives the memory back; it fails,
    /// changing nothing, when running requests hold more than fits.
    pub fn resize_kv(&self, bytes: usize) -> Result<usize> {
        self.call(|tx| Command::Resize(bytes / self.inner.per_block, tx))?
    }

    /// [`resize_kv`](Self::resize_kv) to a smaller size.
    pub fn shrink_to(&self, bytes: usize) -> Result<usize> {
        self.resize_kv(bytes)
    }

    /// The token ids a prompt becomes.
    pub fn tokenize_prompt(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        let model = &self.inner.model;
        let tok = &model.tokenizer;
        Ok(match prompt {
            Prompt::Text(t) => tok.encode(t, Special::Parse, true)?,
            Prompt::Tokens(ids) => ids.clone(),
            Prompt::Chat(msgs) => model.template.encode(tok, msgs, true)?,
        })
    }

    /// Starts a request; its tokens and its end arrive on the stream.
    /// Dropping the stream (or [`RequestStream::cancel`]) cancels it. Errors
    /// that the request can never run (too long, larger than the pool) come
    /// back here, before anything is queued.
    pub fn generate(&self, req: GenerateRequest) -> Result<RequestStream> {
        let ids = self.tokenize_prompt(&req.prompt)?;
        let vocab = self.inner.model.config().vocab_size;
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::Invalid(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        if req.n == 0 {
            return Err(EngineError::Invalid("n must be at least 1".into()));
        }
        let (events, rx) = mpsc::channel();
        let cancel = Arc::new(std::sync::atomic::AtomicBool::new(false));
        self.call(|reply| Command::Submit {
            ids,
            req: Box::new(req.clone()),
            events,
            cancel: cancel.clone(),
            reply,
        })??;
        Ok(RequestStream::new(rx, cancel, req.n))
    }

    /// Runs a request to the end, calling `on_token` for every token of
    /// every sample; returns the completion of each sample, in order.
    pub fn complete_n(
        &self,
        req: &GenerateRequest,
        on_token: &mut dyn FnMut(TokenEvent),
    ) -> Result<Vec<Completion>> {
        let mut stream = self.generate(req.clone())?;
        let mut done: Vec<Option<Completion>> = vec![None; req.n];
        for ev in stream.by_ref() {
            match ev {
                Event::Token { index, id, text } => on_token(TokenEvent {
                    index,
                    id,
                    text: &text,
                }),
                Event::Done(c) => {
                    let i = c.index;
                    done[i] = Some(*c);
                }
                Event::Error(e) => return Err(e),
            }
        }
        done.into_iter()
            .map(|c| c.ok_or(EngineError::Stopped))
            .collect()
    }

    /// [`complete_n`](Self::complete_n) for one sample.
    pub fn complete(
        &self,
        req: &GenerateRequest,
        on_token: &mut dyn FnMut(TokenEvent),
    ) -> Result<Completion> {
        let req = GenerateRequest {
            n: 1,
            ..req.clone()
        };
        Ok(self.complete_n(&req, on_token)?.remove(0))
    }
}

/// Length of the longest suffix of `text` that begins some stop string.
pub(crate) fn held_back(text: &str, stops: &[String]) -> usize {
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
