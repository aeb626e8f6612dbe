//! `tessera perplexity`: the perplexity of a model on a text, computed as
//! llama.cpp's `llama-perplexity` computes it, so that the two can be put
//! side by side. The text is tokenized whole (BOS first when the model
//! adds one) and cut into chunks of `--ctx` tokens; each chunk is a fresh
//! sequence whose first token is replaced by BOS (when the model adds
//! one), and the tokens of its second half are scored: the log-probability
//! of token `j + 1` after tokens `0..=j`, for `j` from `ctx / 2` to
//! `ctx - 2`. The perplexity is `exp` of their mean negative
//! log-probability, with llama.cpp's error estimate.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use tessera_engine::{CacheDType, Engine, EngineConfig};
use tessera_model::{Activations, Special};

use crate::{load_model, parse_activations, parse_cache_dtype, ModelArg};

#[derive(Args)]
pub(crate) struct PerplexityArgs {
    #[command(flatten)]
    model: ModelArg,
    /// The text to score (UTF-8).
    #[arg(long)]
    file: PathBuf,
    /// Tokens per chunk; each chunk's second half is scored.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Score only the first N chunks (default: all of the text).
    #[arg(long)]
    chunks: Option<usize>,
    /// KV cache element type: f16, bf16 or f32.
    #[arg(long, default_value = "f16", value_parser = parse_cache_dtype)]
    cache_dtype: CacheDType,
    /// Activations of quantized layers: int8x2 (default), f32 or int8.
    #[arg(long, value_parser = parse_activations)]
    activations: Option<Activations>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Running totals, as llama-perplexity keeps them.
#[derive(Default)]
struct Totals {
    count: usize,
    nll: f64,
    nll2: f64,
    top1: usize,
}

impl Totals {
    fn ppl(&self) -> f64 {
        (self.nll / self.count.max(1) as f64).exp()
    }

    /// llama.cpp's estimate of the perplexity's standard error.
    fn err(&self) -> f64 {
        let n = self.count as f64;
        let mean = self.nll / n;
        let var = self.nll2 / n - mean * mean;
        if var > 0.0 && self.count > 1 {
            (var / (n - 1.0)).sqrt() * self.ppl()
        } else {
            0.0
        }
    }
}

pub(crate) fn perplexity(args: PerplexityArgs) -> Result<()> {
    if args.ctx < 4 {
        bail!("--ctx must be at least 4");
    }
    let bytes =
        std::fs::read(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let text = String::from_utf8(bytes)
        .map_err(|e| anyhow::anyhow!("{} is not UTF-8 text: {e}", args.file.display()))?;
    let model = load_model(&args.model.model)?;
    let tok = &model.tokenizer;
    let add_bos = tok.add_bos();
    let bos = tok.bos_id().filter(|_| add_bos);
    let tokens = tok.encode(&text, Special::AsText, add_bos)?;
    let ctx = args.ctx;
    if tokens.len() < 2 * ctx {
        bail!(
            "{} has {} tokens: perplexity with --ctx {ctx} needs at least {}",
            args.file.display(),
            tokens.len(),
            2 * ctx
        );
    }
    let mut n_chunks = tokens.len() / ctx;
    if let Some(n) = args.chunks {
        n_chunks = n_chunks.min(n.max(1));
    }
    let name = model.path.display().to_string();
    let per_token = model.config().kv_bytes_per_token(args.cache_dtype.bytes());
    let engine = Engine::from_model(
        model,
        EngineConfig {
            kv_memory: (ctx + 64) * per_token.max(1) * 2,
            cache_dtype: args.cache_dtype,
            prefix_cache: false,
            context_length: Some(ctx),
            activations: args.activations,
            ..EngineConfig::default()
        },
    )?;
    let bar = (!args.json && std::io::stderr().is_terminal()).then(|| {
        let b = indicatif::ProgressBar::new(n_chunks as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template("chunk {pos}/{len} [{bar:30}] {msg}")
                .expect("static template")
                .progress_chars("=> "),
        );
        b
    });
    let first = ctx / 2;
    let mut t = Totals::default();
    let mut line = String::new();
    let start = Instant::now();
    for i in 0..n_chunks {
        let mut chunk = tokens[i * ctx..(i + 1) * ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        for (lp, top) in engine.score(&chunk, first)? {
            t.count += 1;
            t.nll -= lp;
            t.nll2 += lp * lp;
            t.top1 += top as usize;
        }
        line.push_str(&format!("[{}]{:.4},", i + 1, t.ppl()));
        match &bar {
            Some(b) => {
                b.set_message(format!("PPL {:.4}", t.ppl()));
                b.inc(1);
            }
            None if !args.json => eprint!("[{}]{:.4},", i + 1, t.ppl()),
            None => {}
        }
    }
    let secs = start.elapsed().as_secs_f64();
    if let Some(b) = bar {
        b.finish_and_clear();
        eprintln!("{line}");
    } else if !args.json {
        eprintln!();
    }
    let tok_s = (n_chunks * ctx) as f64 / secs.max(1e-9);
    if args.json {
        println!(
            "{}",
            json!({
                "model": name,
                "file": args.file.display().to_string(),
                "ctx": ctx,
                "chunks": n_chunks,
                "tokens_scored": t.count,
                "ppl": t.ppl(),
                "ppl_err": t.err(),
                "top1": t.top1 as f64 / t.count.max(1) as f64,
                "seconds": secs,
                "tok_s": tok_s,
                "activations": engine.model().llama.activations().name(),
                "cache_dtype": format!("{:?}", args.cache_dtype).to_lowercase(),
            })
        );
    } else {
        println!(
            "Final estimate: PPL = {:.4} +/- {:.5} ({} chunks of {ctx}, {} tokens scored, top-1 {:.2}%, {:.1} s, {:.0} tok/s)",
            t.ppl(),
            t.err(),
            n_chunks,
            t.count,
            100.0 * t.top1 as f64 / t.count.max(1) as f64,
            secs,
            tok_s
        );
    }
    Ok(())
}
