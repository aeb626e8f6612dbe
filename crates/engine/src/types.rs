//! Plain data of the engine's API: configuration, requests, completions,
//! statistics, and the fault hook tests use. No behaviour lives here.

use std::path::PathBuf;
use std::sync::Arc;

use tessera_kv::KvStats;
use tessera_model::{Activations, DeviceSpec, Message, Tuning};

use crate::sampler::{SamplingParams, TokenLogprob};
pub use crate::self_extend::SelfExtend;

/// Element type of the K/V cache: `f16` (the default), `bf16`, `f32`, or
/// GGML's block-quantized `q8_0` and `q4_0` (see `tessera_kernels::quant`).
pub use tessera_kernels::KvType as CacheDType;

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
    /// Where the prefix cache is written on shutdown and read at start,
    /// and the disk tier below the pool: full blocks of cached prefixes
    /// that eviction frees are written there as they go and read back
    /// when a prompt continues past what the pool holds.
    pub cache_dir: Option<PathBuf>,
    /// Where each step's KV events go (the prefix cache's full blocks
    /// stored and removed), when anyone listens.
    pub kv_events: Option<crate::KvEventSink>,
    /// The disk tier's size limit in bytes (its oldest blocks go first);
    /// 0 turns the tier off (the cache file is still written at shutdown).
    pub cache_dir_bytes: u64,
    /// Defragment automatically when idle and more than this share of the
    /// pool's span is holes.
    pub defrag_threshold: f64,
    /// Compute threads (default: all cores). The pool is process-wide: the
    /// first engine (or `RAYON_NUM_THREADS`) sets it.
    pub threads: Option<usize>,
    /// How quantized weights meet activations on the CPU: two int8
    /// levels per block (default), f32, or one int8 level (faster, less
    /// exact). `None`: the model's setting (the tuning's default).
    pub activations: Option<Activations>,
    /// The process's kernel settings (instruction-set cap, huge pages,
    /// fixed team, reference forward), fixed before the model loads. They
    /// hold for the whole process: once fixed (by an engine, or by the
    /// first kernel to run), a later engine asking for others is told so
    /// in a warning. `None`: as fixed already, else [`Tuning::from_env`]
    /// (the defaults with their documented environment overrides).
    pub tuning: Option<Tuning>,
    /// Faults injected into chosen steps (tests and the soak benchmark).
    pub faults: Option<FaultHook>,
    /// Models with sliding-window layers (Gemma 3): give those layers as
    /// many blocks as the others (llama.cpp's `--swa-full`), so no cached
    /// position ever loses them. Off, they get a quarter as many (at least
    /// one request's window and chunk): the same memory holds about three
    /// times the context, and cached content loses its sliding-window K/V
    /// first under pressure (see `tessera_kv::SlidingConfig`).
    pub swa_full: bool,
    /// Blocks of the sliding-window layers' pool, when set (at least one
    /// request's window and prompt chunk); the rest of `kv_memory` goes to
    /// the other layers. Overrides the quarter, not `swa_full`.
    pub swa_blocks: Option<usize>,
    /// SelfExtend for every request (llama.cpp's `--grp-attn-n`,
    /// `--grp-attn-w`): distant tokens' RoPE positions divided by the group
    /// size, so a model reads past its trained context. Such requests
    /// neither read nor fill the prefix cache.
    pub self_extend: Option<SelfExtend>,
    /// Prompt tokens a background prefill (a session save's K/V that the
    /// cache lacks) first computes in a step beside other requests' work;
    /// the engine then adapts the share so that such steps take at most
    /// about 1.5 times a step without them. Alone it takes whole chunks.
    pub background_chunk: usize,
    /// Where [`crate::Engine::load`] puts the model and its K/V (default
    /// `auto`: CUDA, then Metal, then the CPU, as this build and machine
    /// allow). [`crate::Engine::from_model`] keeps the model's own device.
    pub device: DeviceSpec,
    /// Draftless speculative decoding for every sample of a request with
    /// `n = 1` (not with SelfExtend): prompt-lookup drafts checked in the
    /// next step, the same output tokens as without (see
    /// [`crate::NgramSpec`]). `None`: off.
    pub speculative: Option<crate::NgramSpec>,
    /// Speculative decoding with a draft model (llama.cpp's
    /// `--model-draft`): a smaller model of the same tokenizer drafts
    /// instead of prompt lookup, on the model's device, with a K/V cache
    /// of its own cut from `kv_memory` (each pool holding as many tokens).
    /// Drafting is then on for every request with `n = 1` unless
    /// `speculative` or the request says otherwise; its `max_draft` is the
    /// most guesses a draft makes.
    pub draft: Option<DraftModelConfig>,
}

/// A draft model for speculative decoding ([`EngineConfig::draft`]).
#[derive(Debug, Clone)]
pub struct DraftModelConfig {
    pub source: crate::ModelSource,
    /// A draft stops before a guess the draft model gives less than this
    /// probability (llama.cpp's `--draft-p-min`).
    pub p_min: f32,
}

impl DraftModelConfig {
    /// The default `p_min`: 0, llama.cpp's default today (0.75 in its
    /// older trees); 0.5 and 0.75 were measured no faster where the draft
    /// model agrees and slower where it does not (docs/architecture.md).
    pub const P_MIN: f32 = 0.0;

    pub fn new(source: crate::ModelSource) -> DraftModelConfig {
        DraftModelConfig {
            source,
            p_min: Self::P_MIN,
        }
    }
}

/// The disk tier's default size limit: 4 GiB.
pub const DEFAULT_CACHE_DIR_BYTES: u64 = 4 << 30;

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
            cache_dir_bytes: DEFAULT_CACHE_DIR_BYTES,
            kv_events: None,
            defrag_threshold: 0.25,
            threads: None,
            activations: None,
            tuning: None,
            faults: None,
            swa_full: false,
            swa_blocks: None,
            self_extend: None,
            background_chunk: 1,
            device: DeviceSpec::Auto,
            speculative: None,
            draft: None,
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
    /// Messages and tool definitions (OpenAI's `tools` list), rendered
    /// with the model's chat template (see [`crate::ToolSyntax::prompt`]).
    ChatTools {
        messages: Vec<Message>,
        tools: serde_json::Value,
    },
}

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    pub sampling: SamplingParams,
    /// Most tokens to generate ([`GenerateRequest::UNLIMITED`]: no limit
    /// of its own).
    pub max_tokens: usize,
    /// Generation stops before any of these strings (at most
    /// [`crate::MAX_STOP_STRINGS`], each at most [`crate::MAX_STOP_BYTES`]
    /// bytes; empty ones are ignored).
    pub stop: Vec<String>,
    /// Keep generating through end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// What to do when the sequence reaches the context length.
    pub context_shift: ContextShift,
    /// Independent samples of the prompt; they share its prefill and its
    /// blocks (fork, copy-on-write). Sample `i` uses seed `seed + i`.
    pub n: usize,
    /// Report each generated token's log-probability and those of this
    /// many most likely tokens (`Some(0)`: the chosen token's only).
    pub logprobs: Option<usize>,
    /// Reuse cached K/V of the prompt (llama-server's `cache_prompt`). Off,
    /// the whole prompt is computed; the result is still cached.
    pub reuse_prefix: bool,
    /// The prefix-cache partition: the request reads and adds cached K/V
    /// of its own partition only.
    pub partition: Partition,
    /// SelfExtend for this request (instead of the engine's
    /// [`EngineConfig::self_extend`]).
    pub self_extend: Option<SelfExtend>,
    /// Structured output: every sample's text matches this (a sample ends
    /// when the constraint is complete and allows nothing more).
    pub constraint: Option<crate::Constraint>,
    /// Speculative decoding for this request: `None` follows the engine's
    /// [`EngineConfig::speculative`]; `Some` sets it (`max_draft: 0`
    /// turns it off).
    pub speculative: Option<crate::NgramSpec>,
}

/// A partition of the prefix cache: requests, sessions and the cache
/// directory's entries of one partition never see, time or change another's
/// K/V. A tenant (the server: a digest of the API key a request came with)
/// and vLLM's `cache_salt` together name one; the default (neither) is the
/// model's own. Each maps to its cache namespace through HMAC-SHA256 under
/// a secret the engine draws at start, so a client that picks its salt
/// cannot aim it at another partition's namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Partition {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub salt: Option<String>,
}

impl Partition {
    /// The partition of a `cache_salt` alone.
    pub fn salt(salt: impl Into<String>) -> Partition {
        Partition {
            tenant: None,
            salt: Some(salt.into()),
        }
    }

    pub fn is_default(&self) -> bool {
        self.tenant.is_none() && self.salt.is_none()
    }
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
    /// `max_tokens` for no limit of its own: the request generates until
    /// an end-of-generation token, a stop string, the context, or the KV
    /// pool's room for it alone (finish reason `length`). It is admitted
    /// on what its prompt needs and grows as it generates.
    pub const UNLIMITED: usize = usize::MAX;

    pub fn new(prompt: Prompt) -> Self {
        GenerateRequest {
            prompt,
            sampling: SamplingParams::default(),
            max_tokens: 256,
            stop: Vec::new(),
            ignore_eos: false,
            context_shift: ContextShift::Off,
            n: 1,
            logprobs: None,
            reuse_prefix: true,
            partition: Partition::default(),
            self_extend: None,
            constraint: None,
            speculative: None,
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
    /// When the request asked for log-probabilities.
    pub logprob: Option<&'a TokenLogprob>,
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
    /// Of those, the tokens read back from the disk tier below the pool
    /// (`EngineConfig::cache_dir`) rather than found in the pool.
    pub disk_cached_tokens: usize,
    pub completion_tokens: usize,
    /// Speculative decoding: draft tokens this sample computed, and those
    /// kept (each kept one is a completion token that cost no step).
    pub draft_tokens: usize,
    pub accepted_draft_tokens: usize,
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
    /// One per generated token, when the request asked for them.
    pub logprobs: Vec<TokenLogprob>,
    pub finish_reason: FinishReason,
    pub usage: Usage,
    pub timings: Timings,
}

/// Counters of the disk tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TierStats {
    /// Blocks held now, and their bytes on disk.
    pub blocks: usize,
    pub bytes: u64,
    /// Blocks written (demoted) and read back (promoted) since start.
    pub written: u64,
    pub read: u64,
    /// Blocks dropped for the size limit.
    pub dropped: u64,
    /// Records found bad at start (torn or corrupted), cut off.
    pub bad_at_start: u64,
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
    /// Forward steps that failed (an error or a panic) and were undone.
    pub failed_steps: u64,
    /// Requests that ended with an error.
    pub failed_requests: u64,
    /// Samples submitted and not yet finished (running or waiting).
    pub active_samples: usize,
    /// Sequences in the running batch.
    pub running: usize,
    /// Sequences waiting for admission (new, or preempted).
    pub waiting: usize,
    /// Samples paused because their reader is [`MAX_BACKLOG`] events
    /// behind (a slow client): they hold their blocks and compute nothing
    /// until it catches up.
    ///
    /// [`MAX_BACKLOG`]: crate::MAX_BACKLOG
    pub paused_samples: usize,
    /// Bytes of the K/V tensors (both pools).
    pub kv_bytes: usize,
    /// Bytes of the blocks with a holder (running sequences or the
    /// prefix cache), both pools.
    pub kv_bytes_held: usize,
    /// Speculative decoding: draft tokens proposed, and those kept.
    pub spec_draft_tokens: u64,
    pub spec_accepted_tokens: u64,
    /// With a draft model: its cache, and the time its drafts took (the
    /// steps wait for them).
    pub draft_kv: Option<KvStats>,
    pub spec_draft_ns: u64,
    /// What a checked guess costs, in millionths of a token of plain
    /// decoding at the last step's batch size (the draft model's time
    /// included): a sample drafts while the share of its recent guesses
    /// kept is above it. 0 until enough decoding steps have been timed.
    pub spec_guess_cost_ppm: u64,
    /// Structured output: next-token masks computed beside a forward, the
    /// time computing them took, and the part of it the step waited for
    /// after its forward (what masks cost a step).
    pub guide_masks: u64,
    pub guide_mask_ns: u64,
    pub guide_wait_ns: u64,
    /// Prompt tokens read back from the disk tier (counted in
    /// `cached_tokens` too), and the tier itself when it is on.
    pub disk_cached_tokens: u64,
    pub disk_tier: Option<TierStats>,
}

impl EngineStats {
    /// Share of prompt tokens served from the cache.
    pub fn hit_ratio(&self) -> f64 {
        self.cached_tokens as f64 / (self.prompt_tokens.max(1)) as f64
    }
}

/// What an injected fault does to the step it hits. The slots the step
/// would have written are first filled with NaN, so that a bug that let them
/// be read later would show in every output that read them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The step returns an error.
    Error,
    /// The step panics.
    Panic,
}

/// One item of a step, as a fault hook sees it.
#[derive(Debug, Clone, Copy)]
pub struct FaultSite<'a> {
    /// The prompt of the item's request.
    pub prompt: &'a [u32],
    /// Which sample of the request.
    pub sample: usize,
    /// Positions the item computes.
    pub start: usize,
    pub len: usize,
}

/// Decides, before each forward step, whether that step fails and how.
#[derive(Clone)]
#[allow(clippy::type_complexity)]
pub struct FaultHook(pub Arc<dyn Fn(&[FaultSite]) -> Option<Fault> + Send + Sync>);

impl FaultHook {
    pub fn new(f: impl Fn(&[FaultSite]) -> Option<Fault> + Send + Sync + 'static) -> FaultHook {
        FaultHook(Arc::new(f))
    }
}

impl std::fmt::Debug for FaultHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FaultHook")
    }
}
