//! The `tessera` command line.
//!
//! **What this crate must not know:** anything below the engine's public
//! API: no block ids, no tensors (the candle baseline of `bench` aside,
//! which runs candle's own model, not ours).

mod bench;
mod chat;
mod fidelity;
mod perplexity;
mod scenarios;
mod serve;
mod serving;
mod sliding;
mod soak;

use std::io::{IsTerminal, Read, Write};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use tessera_engine::{
    CacheDType, Completion, Engine, EngineConfig, GenerateRequest, Message, ModelSource, Prompt,
    SamplingParams,
};
use tessera_model::{device_name, Activations, DeviceSpec, IsaCap, Model, Special, Tuning};

#[derive(Parser)]
#[command(
    name = "tessera",
    version,
    about = "A KV-cache-centric transformer inference engine"
)]
struct Cli {
    /// Worker threads (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    /// Debug logs, and errors with their whole chain and backtrace
    /// (`TESSERA_LOG=debug` gives the logs alone).
    #[arg(long, global = true)]
    verbose: bool,
    /// Where the model runs: auto (CUDA, then Metal, then the CPU, as this
    /// build and machine allow), cpu, cuda, cuda:N or metal.
    #[arg(long, global = true, default_value = "auto")]
    device: DeviceSpec,
    /// A Jinja chat template to use instead of the model file's (as
    /// llama.cpp's --chat-template-file): for a file without one (a base
    /// model falls back to ChatML) or with a wrong one. Tool calls follow
    /// the syntax this template writes.
    #[arg(long, global = true, value_name = "FILE")]
    chat_template_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    tuning: TuningArgs,
    #[command(subcommand)]
    cmd: Cmd,
}

/// The kernels' process-wide settings. Each flag overrides its documented
/// environment variable (`TESSERA_ISA`, `TESSERA_FORWARD`,
/// `TESSERA_HUGE_PAGES=0`, `TESSERA_FIXED_TEAM=1`), which overrides the
/// default.
#[derive(Args)]
struct TuningArgs {
    /// The highest instruction set the CPU kernels use: portable, avx2,
    /// avxvnni, avx512 (AVX-512 without AMX) or amx (default: the best
    /// this CPU runs). For comparing with another engine on one ISA.
    #[arg(long, global = true, value_parser = parse_isa)]
    isa: Option<IsaCap>,
    /// Which forward runs the model: fast (default) or reference (the
    /// candle ops, for debugging).
    #[arg(long, global = true, value_parser = ["fast", "reference"])]
    forward: Option<String>,
    /// Leave repacked weights on the system's default pages instead of
    /// 2 MiB pages.
    #[arg(long, global = true)]
    no_huge_pages: bool,
    /// Keep every compute worker even while other processes take cores
    /// (default: the team shrinks while the machine is busy).
    #[arg(long, global = true)]
    fixed_team: bool,
    /// Warps per output row of the CUDA products (default: by the row's
    /// length), for comparing kernel shapes on a GPU.
    #[arg(long, global = true, value_parser = ["1", "2", "4"])]
    cuda_row_warps: Option<String>,
    /// The shortest partition of the CUDA paged attention, in positions
    /// (default 64).
    #[arg(long, global = true, value_parser = ["16", "32", "64"])]
    cuda_att_part: Option<String>,
    /// Run RMSNorm as a kernel of its own before each CUDA product instead
    /// of inside the product, for comparing.
    #[arg(long, global = true)]
    cuda_unfused_norm: bool,
    /// Merge the CUDA decode attention's partitions in a kernel of its own
    /// instead of in the attention's launch, for comparing.
    #[arg(long, global = true)]
    cuda_unfused_merge: bool,
    /// Run batches of more than 64 tokens (prefill) through the CUDA
    /// forward too, its products as cuBLAS f32 GEMMs (default: the
    /// reference forward runs them).
    #[arg(long, global = true)]
    cuda_prefill: bool,
}

impl TuningArgs {
    fn tuning(&self) -> Tuning {
        let mut t = Tuning::from_env();
        if let Some(isa) = self.isa {
            t.isa = Some(isa);
        }
        if let Some(f) = &self.forward {
            t.reference_forward = f == "reference";
        }
        if self.no_huge_pages {
            t.huge_pages = false;
        }
        if self.fixed_team {
            t.fixed_team = true;
        }
        if let Some(w) = &self.cuda_row_warps {
            t.gpu_row_warps = w.parse().ok();
        }
        if let Some(p) = &self.cuda_att_part {
            t.gpu_att_part = p.parse().ok();
        }
        if self.cuda_unfused_norm {
            t.gpu_fuse_norm = false;
        }
        if self.cuda_unfused_merge {
            t.gpu_fuse_merge = false;
        }
        if self.cuda_prefill {
            t.gpu_prefill = true;
        }
        t
    }
}

fn parse_isa(s: &str) -> Result<IsaCap, String> {
    IsaCap::parse(s)
        .ok_or_else(|| format!("`{s}`: expected portable, avx2, avxvnni, avx512 or amx"))
}

/// The `--device` of this invocation, for every model it loads.
static DEVICE: std::sync::OnceLock<DeviceSpec> = std::sync::OnceLock::new();

/// The `--chat-template-file` of this invocation (its text), for the
/// models it loads (a draft model's template is never read).
static TEMPLATE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Opens the `--device` device (once per process; later calls reuse it),
/// saying which one `auto` chose when this build had a choice to make.
fn device() -> Result<candle_core::Device> {
    static OPENED: std::sync::OnceLock<candle_core::Device> = std::sync::OnceLock::new();
    if let Some(d) = OPENED.get() {
        return Ok(d.clone());
    }
    let spec = DEVICE.get().copied().unwrap_or_default();
    let d = spec.open()?;
    let gpu_build =
        candle_core::utils::cuda_is_available() || candle_core::utils::metal_is_available();
    if spec == DeviceSpec::Auto && (gpu_build || !d.is_cpu()) {
        eprintln!("device: {} (chosen by --device auto)", device_name(&d));
    }
    Ok(OPENED.get_or_init(|| d).clone())
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text from a prompt.
    Run(RunArgs),
    /// A multi-turn conversation that keeps its KV cache between turns.
    Chat(chat::ChatArgs),
    /// An OpenAI-compatible HTTP server (/v1/chat/completions,
    /// /v1/completions, /v1/models, /health, /tokenize, /detokenize).
    Serve(serve::ServeArgs),
    /// Print the token ids of a text as a JSON array.
    Tokenize(TokenizeArgs),
    /// Read a JSON array of token ids from stdin and print their text.
    Detokenize(ModelArg),
    /// Print a model's architecture, sizes, quantization and KV cost.
    Inspect(ModelArg),
    /// Perplexity on a text, computed as llama.cpp's llama-perplexity does.
    Perplexity(perplexity::PerplexityArgs),
    /// Measure: prefill and decode beside candle's quantized_llama, decode
    /// deep in a context and in batches, the KV-cache scenarios (chat,
    /// shared-prefix, interleaved, shift), and the soak under faults.
    Bench(bench::BenchArgs),
}

#[derive(Args)]
pub(crate) struct ModelArg {
    /// A GGUF file, a safetensors directory, or hf:OWNER/REPO/FILE.
    #[arg(long)]
    pub(crate) model: String,
}

#[derive(Args, Clone)]
pub(crate) struct KvArgs {
    /// KV cache memory budget, e.g. 256MiB or 1GiB.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    kv_memory: usize,
    /// Context length (default: the model's).
    #[arg(long)]
    ctx: Option<usize>,
    /// KV cache element type: f16, bf16, f32, q8_0 or q4_0 (GGML blocks of 32 values per head row with an f16 scale: 53% and 28% of f16's bytes).
    #[arg(long, default_value = "f16", value_parser = parse_cache_dtype)]
    cache_dtype: CacheDType,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Activations of quantized layers: int8x2 (two int8 levels per block,
    /// the default), f32, or int8 (one level: faster, less exact).
    #[arg(long, value_parser = parse_activations)]
    activations: Option<Activations>,
    /// Models with sliding-window layers (Gemma 3): as many blocks for
    /// those layers as for the others, so cached content never loses them
    /// (llama.cpp's --swa-full). Off, they get a quarter as many and the
    /// same memory holds about three times the context.
    #[arg(long)]
    swa_full: bool,
    /// Blocks of the sliding-window layers' pool (at least one request's
    /// window and prompt chunk); the rest of --kv-memory goes to the other
    /// layers. Overrides the quarter, not --swa-full.
    #[arg(long)]
    swa_blocks: Option<usize>,
    /// Most tokens computed in one step: the running requests' decodes and
    /// prompt chunks together (llama.cpp's --ubatch-size).
    #[arg(long, default_value_t = EngineConfig::default().prefill_chunk,
          value_parser = parse_positive)]
    prefill_chunk: usize,
    /// Most requests decoding together (vLLM's --max-num-seqs).
    #[arg(long, default_value_t = EngineConfig::default().max_running,
          value_parser = parse_positive)]
    max_running: usize,
    /// Defragment when idle and holes pass this share of the pool's span,
    /// 0 to 1 (llama.cpp's --defrag-thold).
    #[arg(long, default_value_t = EngineConfig::default().defrag_threshold,
          value_parser = parse_share)]
    defrag_threshold: f64,
    /// Prompt tokens a background prefill (a session save's K/V) first
    /// computes in a step beside other requests' work; the engine adapts
    /// the share so that such steps take at most about 1.5 times a step
    /// without them.
    #[arg(long, default_value_t = EngineConfig::default().background_chunk,
          value_parser = parse_positive)]
    background_chunk: usize,
    #[command(flatten)]
    self_extend: SelfExtendArgs,
    #[command(flatten)]
    spec: SpecArgs,
}

/// Speculative decoding: draftless (prompt lookup), as llama.cpp's n-gram
/// drafts and vLLM's `ngram` method, or with a draft model (llama.cpp's
/// `--model-draft`).
#[derive(Args, Clone)]
pub(crate) struct SpecArgs {
    /// Speculative decoding by prompt lookup: after each token, the text so
    /// far is searched for its last few tokens and what followed them
    /// there is checked in the next step. The same output tokens as
    /// without; faster where the output repeats the prompt (editing,
    /// quoting, code).
    #[arg(long)]
    spec_ngram: bool,
    /// Most tokens a draft proposes (llama.cpp's --draft-max, vLLM's
    /// num_speculative_tokens).
    #[arg(long, default_value_t = tessera_engine::NgramSpec::default().max_draft,
          value_parser = parse_positive)]
    draft_max: usize,
    /// Longest and shortest runs of tokens looked up (vLLM's
    /// prompt_lookup_max and prompt_lookup_min).
    #[arg(long, default_value_t = tessera_engine::NgramSpec::default().max_ngram,
          value_parser = parse_positive)]
    ngram_max: usize,
    #[arg(long, default_value_t = tessera_engine::NgramSpec::default().min_ngram,
          value_parser = parse_positive)]
    ngram_min: usize,
    /// Speculative decoding with a draft model: a smaller model of the
    /// same tokenizer (a GGUF file, a model directory or hf:OWNER/REPO/FILE)
    /// drafts greedily on its own K/V cache, cut from --kv-memory; the
    /// model checks the drafts. The same output tokens as without; faster
    /// where the draft model often guesses the model's next tokens.
    #[arg(long = "model-draft", visible_alias = "md", value_name = "MODEL",
          value_parser = parse_source)]
    model_draft: Option<tessera_engine::ModelSource>,
    /// A draft stops before a guess the draft model gives less than this
    /// probability (llama.cpp's --draft-p-min).
    #[arg(long, default_value_t = tessera_engine::DraftModelConfig::P_MIN,
          value_parser = parse_share_f32)]
    draft_p_min: f32,
}

impl SpecArgs {
    /// Prompt lookup's settings: with --spec-ngram, or the draft model's
    /// (its most guesses) with --model-draft.
    pub(crate) fn get(&self) -> Option<tessera_engine::NgramSpec> {
        (self.spec_ngram || self.model_draft.is_some()).then_some(tessera_engine::NgramSpec {
            max_draft: self.draft_max,
            max_ngram: self.ngram_max.max(self.ngram_min),
            min_ngram: self.ngram_min,
        })
    }

    pub(crate) fn draft(&self) -> Option<tessera_engine::DraftModelConfig> {
        self.model_draft
            .clone()
            .map(|source| tessera_engine::DraftModelConfig {
                source,
                p_min: self.draft_p_min,
            })
    }
}

fn parse_source(s: &str) -> Result<tessera_engine::ModelSource, String> {
    tessera_engine::ModelSource::parse(s).map_err(|e| e.to_string())
}

fn parse_share_f32(s: &str) -> Result<f32, String> {
    parse_share(s).map(|v| v as f32)
}

fn parse_positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(v) if v >= 1 => Ok(v),
        _ => Err(format!("`{s}`: expected a whole number of at least 1")),
    }
}

fn parse_share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!("`{s}`: expected a number from 0 to 1")),
    }
}

/// SelfExtend, as llama.cpp's options of the same names.
#[derive(Args, Clone, Copy)]
pub(crate) struct SelfExtendArgs {
    /// SelfExtend group size: positions of tokens beyond the last
    /// --grp-attn-w are divided by it, so the model reads past its trained
    /// context (raise --ctx too). 1: off.
    #[arg(long, default_value_t = 1)]
    grp_attn_n: usize,
    /// SelfExtend window: the most recent tokens that keep exact positions
    /// (a multiple of --grp-attn-n).
    #[arg(long, default_value_t = 512)]
    grp_attn_w: usize,
}

impl SelfExtendArgs {
    /// The setting, or `None` when off (n = 1). Checked by the engine.
    pub(crate) fn get(self) -> Option<tessera_engine::SelfExtend> {
        (self.grp_attn_n != 1).then_some(tessera_engine::SelfExtend {
            n: self.grp_attn_n,
            w: self.grp_attn_w,
        })
    }
}

fn parse_activations(s: &str) -> Result<Activations, String> {
    Activations::parse(s).ok_or_else(|| format!("`{s}`: expected int8x2, f32 or int8"))
}

impl KvArgs {
    pub(crate) fn config(&self, prefix_cache: bool) -> EngineConfig {
        // (`chat --cache-dir` adds the cache directory.)
        EngineConfig {
            kv_memory: self.kv_memory,
            block_size: self.block_size,
            cache_dtype: self.cache_dtype,
            prefix_cache,
            context_length: self.ctx,
            activations: self.activations,
            swa_full: self.swa_full,
            swa_blocks: self.swa_blocks,
            prefill_chunk: self.prefill_chunk,
            max_running: self.max_running,
            defrag_threshold: self.defrag_threshold,
            background_chunk: self.background_chunk,
            self_extend: self.self_extend.get(),
            speculative: self.spec.get(),
            draft: self.spec.draft(),
            ..EngineConfig::default()
        }
    }
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    model: ModelArg,
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message (with --chat).
    #[arg(long)]
    system: Option<String>,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// 0 means greedy.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Stop before this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Print one JSON object (one line per sample) instead of streaming text.
    #[arg(long)]
    json: bool,
    /// Independent samples of the prompt; they share its prefill.
    #[arg(long, default_value_t = 1)]
    n: usize,
    #[command(flatten)]
    constraint: ConstraintArgs,
    #[command(flatten)]
    kv: KvArgs,
}

/// Structured output (llama.cpp's `--json-schema`, `--grammar`): at most
/// one of these.
#[derive(Args)]
struct ConstraintArgs {
    /// The output is JSON valid against this JSON schema (`{}`: any JSON
    /// object).
    #[arg(long, short = 'j', group = "constraint")]
    json_schema: Option<String>,
    /// The JSON schema from a file.
    #[arg(long, group = "constraint")]
    json_schema_file: Option<std::path::PathBuf>,
    /// The output matches this grammar: GBNF (llama.cpp's) or llguidance's
    /// Lark dialect.
    #[arg(long, group = "constraint")]
    grammar: Option<String>,
    /// The grammar from a file.
    #[arg(long, group = "constraint")]
    grammar_file: Option<std::path::PathBuf>,
    /// The whole output matches this regular expression.
    #[arg(long, group = "constraint")]
    regex: Option<String>,
}

impl ConstraintArgs {
    fn constraint(&self) -> Result<Option<tessera_engine::Constraint>> {
        use tessera_engine::Constraint;
        let read = |p: &std::path::PathBuf| {
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
        };
        let schema = match (&self.json_schema, &self.json_schema_file) {
            (Some(s), _) => Some(s.clone()),
            (_, Some(p)) => Some(read(p)?),
            _ => None,
        };
        if let Some(s) = schema {
            let v = serde_json::from_str(&s).context("the JSON schema is not JSON")?;
            return Ok(Some(Constraint::json_schema(v)));
        }
        let grammar = match (&self.grammar, &self.grammar_file) {
            (Some(g), _) => Some(g.clone()),
            (_, Some(p)) => Some(read(p)?),
            _ => None,
        };
        Ok(match (grammar, &self.regex) {
            (Some(g), _) => Some(Constraint::grammar_text(&g)),
            (_, Some(r)) => Some(Constraint::Regex(r.clone())),
            _ => None,
        })
    }
}

#[derive(Args)]
struct TokenizeArgs {
    #[command(flatten)]
    model: ModelArg,
    /// The text (default: read stdin).
    #[arg(long)]
    text: Option<String>,
    /// Parse control-token text such as <|im_start|> as control tokens.
    #[arg(long)]
    special: bool,
}

pub(crate) fn parse_size(s: &str) -> std::result::Result<usize, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size like 512MiB"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" | "kib" => 1024.0,
        "m" | "mb" | "mib" => 1024.0 * 1024.0,
        "g" | "gb" | "gib" => 1024.0 * 1024.0 * 1024.0,
        other => {
            return Err(format!(
                "unknown size unit {other:?} (use B, KiB, MiB or GiB)"
            ))
        }
    };
    Ok((n * mult) as usize)
}

fn parse_cache_dtype(s: &str) -> std::result::Result<CacheDType, String> {
    CacheDType::parse(s)
        .ok_or_else(|| format!("{s:?} is not a cache dtype (f16, bf16, f32, q8_0, q4_0)"))
}

/// Loads a model, with a progress bar when stderr is a terminal.
pub(crate) fn load_model(spec: &str) -> Result<Model> {
    let source = ModelSource::parse(spec)?;
    let path = source.resolve()?;
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = indicatif::ProgressBar::new(1);
        b.set_style(
            indicatif::ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len}")
                .expect("static template")
                .progress_chars("=> "),
        );
        b.set_message(path.display().to_string());
        b
    });
    let device = device()?;
    let model = Model::load_on(&path, &device, &mut |done, total| {
        if let Some(b) = &bar {
            b.set_length(total as u64);
            b.set_position(done as u64);
        }
    })
    .with_context(|| format!("loading {}", path.display()))?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let mut model = model;
    if let Some(src) = TEMPLATE.get() {
        model.template = model
            .template
            .with_source(src)
            .context("--chat-template-file")?;
    }
    Ok(model)
}

fn run(args: RunArgs) -> Result<()> {
    let model = load_model(&args.model.model)?;
    let engine = Engine::from_model(model, args.kv.config(true))?;
    let prompt = if args.chat {
        let mut msgs = Vec::new();
        if let Some(sys) = &args.system {
            msgs.push(Message::new("system", sys.clone()));
        }
        msgs.push(Message::new("user", args.prompt.clone()));
        Prompt::Chat(msgs)
    } else {
        if args.system.is_some() {
            bail!("--system needs --chat");
        }
        Prompt::Text(args.prompt.clone())
    };
    let req = GenerateRequest {
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            repetition_penalty: args.repeat_penalty,
            seed: args.seed,
            ..SamplingParams::default()
        },
        max_tokens: args.max_tokens,
        stop: args.stop.clone(),
        n: args.n,
        constraint: args.constraint.constraint()?,
        ..GenerateRequest::new(prompt)
    };
    if args.n == 0 {
        bail!("--n must be at least 1");
    }
    let mut stdout = std::io::stdout().lock();
    let stream = !args.json && args.n == 1;
    let samples = engine.complete_n(&req, &mut |ev| {
        if stream && !ev.text.is_empty() {
            let _ = stdout.write_all(ev.text.as_bytes());
            let _ = stdout.flush();
        }
    })?;
    drop(stdout);
    for done in &samples {
        if args.json {
            let mut v = completion_json(done);
            if args.n > 1 {
                v["index"] = done.index.into();
            }
            println!("{v}");
        } else if args.n > 1 {
            println!("--- sample {} ---\n{}", done.index + 1, done.text);
        } else {
            println!();
        }
    }
    if let Some(first) = samples.first() {
        print_stats(first);
    }
    Ok(())
}

pub(crate) fn completion_json(c: &Completion) -> serde_json::Value {
    serde_json::json!({
        "text": c.text,
        "tokens": c.tokens,
        "finish_reason": c.finish_reason.as_str(),
        "usage": {
            "prompt_tokens": c.usage.prompt_tokens,
            "cached_tokens": c.usage.cached_tokens,
            "completion_tokens": c.usage.completion_tokens,
        },
        "timings": {
            "ttft_ms": c.timings.ttft_ms,
            "prefill_tok_s": c.timings.prefill_tok_s,
            "decode_tok_s": c.timings.decode_tok_s,
        },
    })
}

pub(crate) fn print_stats(c: &Completion) {
    let u = c.usage;
    let t = c.timings;
    let disk = if u.disk_cached_tokens > 0 {
        format!(" ({} from disk)", u.disk_cached_tokens)
    } else {
        String::new()
    };
    eprintln!(
        "prompt: {} tokens | cached: {}{disk} | new: {} | {:.0} tok/s | TTFT: {:.0} ms",
        u.prompt_tokens,
        u.cached_tokens,
        u.prompt_tokens - u.cached_tokens,
        t.prefill_tok_s,
        t.ttft_ms
    );
    eprintln!(
        "output: {} tokens | {:.1} tok/s | total: {:.1} s",
        u.completion_tokens, t.decode_tok_s, t.total_s
    );
    if u.draft_tokens > 0 {
        eprintln!(
            "speculative: {} of {} draft tokens kept",
            u.accepted_draft_tokens, u.draft_tokens
        );
    }
}

fn tokenize(args: TokenizeArgs) -> Result<()> {
    let model = load_model(&args.model.model)?;
    let text = match args.text {
        Some(t) => t,
        None => {
            let mut buf = Vec::new();
            std::io::stdin().read_to_end(&mut buf)?;
            String::from_utf8(buf).context("stdin is not valid UTF-8")?
        }
    };
    let special = if args.special {
        Special::Parse
    } else {
        Special::AsText
    };
    let ids = model.tokenizer.encode(&text, special, false)?;
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}

fn detokenize(args: ModelArg) -> Result<()> {
    let model = load_model(&args.model)?;
    let mut buf = String::new();
    std::io::stdin()
        .read_to_string(&mut buf)
        .context("stdin is not valid UTF-8")?;
    let ids: Vec<u32> =
        serde_json::from_str(buf.trim()).context("stdin must be a JSON array of token ids")?;
    let vocab = model.config().vocab_size;
    if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
        bail!("token id {bad} is outside the vocabulary of {vocab}");
    }
    print!("{}", model.tokenizer.decode(&ids)?);
    Ok(())
}

fn inspect(args: ModelArg) -> Result<()> {
    let model = match load_model(&args.model) {
        Ok(m) => m,
        Err(e) => return inspect_gguf(&args.model, e),
    };
    let c = model.config();
    let storage: Vec<String> = model
        .storage
        .iter()
        .map(|(k, v)| format!("{k} ×{v}"))
        .collect();
    println!("model:          {}", model.path.display());
    println!(
        "format:         {:?}, {} bytes",
        model.format, model.file_bytes
    );
    println!(
        "architecture:   {} (RoPE {:?}, theta {}, scaling {})",
        c.arch.name(),
        c.rope_style,
        c.rope_theta,
        c.rope_scaling
    );
    if c.partial_rope() {
        println!(
            "partial RoPE:   {} of {} dimensions of each head",
            c.rope_dims, c.head_dim
        );
    }
    if let Some(long) = c.uses_long_factors() {
        println!(
            "LongRoPE:       {} factors at a context of {} (long ones above the original context; --ctx chooses)",
            if long { "long" } else { "short" },
            c.context_length
        );
    }
    println!("layers:         {}", c.n_layers);
    println!(
        "hidden:         {} (intermediate {})",
        c.hidden_size, c.intermediate_size
    );
    println!(
        "heads:          {} query, {} KV, head_dim {}",
        c.n_heads, c.n_kv_heads, c.head_dim
    );
    println!(
        "vocab:          {} (tokenizer: {} tokens, end-of-generation ids {:?})",
        c.vocab_size,
        model.tokenizer.vocab_size(),
        model.tokenizer.eog_ids()
    );
    println!("tied embedding: {}", c.tie_embeddings);
    let b = &c.block;
    if b.sliding_window > 0 {
        let sliding = (0..c.n_layers)
            .filter(|&l| c.layer_window(l).is_some())
            .count();
        println!(
            "sliding window: {} positions on {sliding} of {} layers (RoPE theta {} there)",
            b.sliding_window, c.n_layers, b.rope_theta_swa
        );
    }
    if *b != tessera_model::Block::llama() {
        println!(
            "block:          {:?} gate, q/k norms {}, post-norms {}, embeddings × {}",
            b.activation, b.qk_norm, b.post_norms, b.embed_scale
        );
        let mut extra = Vec::new();
        if b.no_rope_every > 0 {
            extra.push(format!(
                "no RoPE on every {}th layer ({} of {})",
                b.no_rope_every,
                (0..c.n_layers).filter(|&l| !c.layer_has_rope(l)).count(),
                c.n_layers
            ));
        }
        if b.residual_scale != 1.0 {
            extra.push(format!("block outputs × {}", b.residual_scale));
        }
        if let Some(s) = b.attention_scale {
            extra.push(format!("attention scores × {s}"));
        }
        if b.logit_scale != 1.0 {
            extra.push(format!("logits ÷ {}", b.logit_scale));
        }
        if !extra.is_empty() {
            println!("                {}", extra.join(", "));
        }
    }
    println!("context length: {}", c.context_length);
    println!("quantization:   {}", storage.join(", "));
    // Built now (on the CPU: the weights repacked for the kernels).
    model.llama.prepare()?;
    if let Some(exec) = model.llama.executor() {
        println!("forward:        {exec}");
    }
    for t in CacheDType::ALL {
        if t.is_quantized() && !c.head_dim.is_multiple_of(64) {
            continue;
        }
        println!(
            "KV bytes/token: {:>6} B with a {t} cache (2 · {} layers · {} kv_heads · {} B per head of {} values)",
            c.kv_bytes_per_token(t),
            c.n_layers,
            c.n_kv_heads,
            t.bytes_for(c.head_dim),
            c.head_dim
        );
    }
    Ok(())
}

/// What a GGUF file holds when Tessera cannot run it: its metadata and
/// tensor types, then why it cannot run.
fn inspect_gguf(spec: &str, why: anyhow::Error) -> Result<()> {
    let path = ModelSource::parse(spec).and_then(|s| s.resolve());
    let file = match path.map(|p| tessera_model::GgufFile::open(&p)) {
        Ok(Ok(f)) => f,
        _ => return Err(why),
    };
    let (meta, types) = file.describe();
    println!("model:          {}", file.path.display());
    println!("metadata:");
    for (k, v) in meta {
        println!("  {k} = {v}");
    }
    println!("tensors:");
    for (dtype, n, bytes) in types {
        println!("  {dtype:<6} {n:>4} tensors, {bytes} bytes");
    }
    println!("runs here:      no ({why:#})");
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Engine warnings (a cache directory that cannot be written, …) go to
    // stderr; TESSERA_LOG=debug (or --verbose) shows the step phases and the
    // backtraces of the errors candle reports.
    let filter = if cli.verbose {
        tracing_subscriber::EnvFilter::new("debug")
    } else {
        tracing_subscriber::EnvFilter::try_from_env("TESSERA_LOG")
            .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"))
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    if let Some(n) = cli.threads {
        // candle and the kernels both size their pools from this.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    // Before any kernel runs: they pick their paths once per process.
    let _ = tessera_model::tuning::set(cli.tuning.tuning());
    let verbose = cli.verbose;
    let _ = DEVICE.set(cli.device);
    let template = cli.chat_template_file.as_ref().map(|p| {
        std::fs::read_to_string(p)
            .with_context(|| format!("reading --chat-template-file {}", p.display()))
    });
    let result = match template {
        Some(Err(e)) => Err(e),
        t => {
            if let Some(Ok(src)) = t {
                let _ = TEMPLATE.set(src);
            }
            dispatch(cli.cmd)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if verbose => {
            eprintln!("error: {e:?}");
            ExitCode::FAILURE
        }
        Err(e) => {
            // One line for people: the whole chain, no backtrace.
            let line = format!("{e:#}");
            let line: Vec<&str> = line
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect();
            // The flag that helps, where there is one.
            let hint = match e.downcast_ref::<tessera_engine::EngineError>() {
                Some(
                    tessera_engine::EngineError::OutOfKvMemory { .. }
                    | tessera_engine::EngineError::KvBudgetTooSmall { .. },
                ) => " (raise --kv-memory)",
                _ => "",
            };
            eprintln!("error: {}{hint}", line.join(" "));
            ExitCode::FAILURE
        }
    }
}

fn dispatch(cmd: Cmd) -> Result<()> {
    match cmd {
        Cmd::Run(a) => run(a),
        Cmd::Chat(a) => chat::chat(a),
        Cmd::Serve(a) => serve::serve(a),
        Cmd::Tokenize(a) => tokenize(a),
        Cmd::Detokenize(a) => detokenize(a),
        Cmd::Inspect(a) => inspect(a),
        Cmd::Perplexity(a) => perplexity::perplexity(a),
        Cmd::Bench(a) => bench::bench(a),
    }
}
