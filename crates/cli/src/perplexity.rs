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
use tessera_engine::{argmax_and_norm, CacheDType, Engine, EngineConfig, TokenLogprob};
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
    /// KV cache element type: f16, bf16, f32, q8_0 or q4_0 (GGML blocks of 32 values per head row with an f16 scale: 53% and 28% of f16's bytes).
    #[arg(long, default_value = "f16", value_parser = parse_cache_dtype)]
    cache_dtype: CacheDType,
    /// Activations of quantized layers: int8x2 (default), f32 or int8.
    #[arg(long, value_parser = parse_activations)]
    activations: Option<Activations>,
    /// Save this run's distributions (per scored token: its log-probability
    /// and the 32 most likely tokens) for a later --kl-divergence.
    #[arg(long, value_name = "FILE")]
    save_logits: Option<PathBuf>,
    /// Compare with a run saved by --save-logits on the same text and
    /// chunks (another model file, activations or cache type), or with
    /// llama.cpp's own `llama-perplexity --kl-divergence-base FILE` of the
    /// same model (its tokens are scored then, so the two forwards see the
    /// same input; --ctx must be the file's): KL divergence from it and
    /// top-1 agreement.
    #[arg(long, value_name = "FILE")]
    kl_divergence: Option<PathBuf>,
    #[command(flatten)]
    self_extend: crate::SelfExtendArgs,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Tokens per position a --save-logits file keeps.
const KEEP: usize = 32;
const MAGIC: &[u8; 4] = b"TKLD";

/// The standard error of the mean of `n` values with sum `sum` and sum of
/// squares `sum2` (llama-perplexity's estimate).
fn std_err(sum: f64, sum2: f64, n: usize) -> f64 {
    let k = n as f64;
    let mean = sum / k;
    let var = sum2 / k - mean * mean;
    if var > 0.0 && n > 1 {
        (var / (k - 1.0)).sqrt()
    } else {
        0.0
    }
}

/// A --save-logits file: a header, then per scored position the target's
/// log-probability and `KEEP` (id, log-probability) pairs, best first.
struct Saved {
    ctx: usize,
    chunks: usize,
    fingerprint: u64,
    rows: Vec<(f32, Vec<(u32, f32)>)>,
}

fn fingerprint(tokens: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in tokens.iter().flat_map(|t| t.to_le_bytes()) {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

impl Saved {
    fn write(&self, path: &std::path::Path) -> Result<()> {
        let mut buf = Vec::with_capacity(24 + self.rows.len() * (4 + KEEP * 8));
        buf.extend_from_slice(MAGIC);
        for x in [1u32, self.ctx as u32, self.chunks as u32, KEEP as u32] {
            buf.extend_from_slice(&x.to_le_bytes());
        }
        buf.extend_from_slice(&self.fingerprint.to_le_bytes());
        for (lp, top) in &self.rows {
            buf.extend_from_slice(&lp.to_le_bytes());
            for &(t, l) in top {
                buf.extend_from_slice(&t.to_le_bytes());
                buf.extend_from_slice(&l.to_le_bytes());
            }
        }
        std::fs::write(path, buf).with_context(|| format!("writing {}", path.display()))
    }

    fn parse(path: &std::path::Path, data: &[u8]) -> Result<Saved> {
        let bad =
            |why: &str| anyhow::anyhow!("{} is not a --save-logits file: {why}", path.display());
        if data.len() < 28 || &data[..4] != MAGIC {
            return Err(bad("wrong header"));
        }
        let u32_at = |o: usize| u32::from_le_bytes(data[o..o + 4].try_into().expect("4 bytes"));
        if u32_at(4) != 1 || u32_at(16) as usize != KEEP {
            return Err(bad("another version"));
        }
        let per = 4 + KEEP * 8;
        if !(data.len() - 28).is_multiple_of(per) {
            return Err(bad("truncated"));
        }
        let rows = data[28..]
            .chunks_exact(per)
            .map(|r| {
                let f = |o: usize| f32::from_le_bytes(r[o..o + 4].try_into().expect("4 bytes"));
                let u = |o: usize| u32::from_le_bytes(r[o..o + 4].try_into().expect("4 bytes"));
                (
                    f(0),
                    (0..KEEP).map(|k| (u(4 + 8 * k), f(8 + 8 * k))).collect(),
                )
            })
            .collect();
        Ok(Saved {
            ctx: u32_at(8) as usize,
            chunks: u32_at(12) as usize,
            fingerprint: u64::from_le_bytes(data[20..28].try_into().expect("8 bytes")),
            rows,
        })
    }
}

/// A `llama-perplexity --kl-divergence-base` file: `_logits_`, then
/// `n_ctx`, `n_vocab`, `n_chunk` (i32), the tokens of the chunks (i32), then
/// per scored position (the last `n_ctx − 1 − n_ctx/2` of each chunk) a
/// row of `2·⌈n_vocab/2⌉ + 4` u16: two f32 (`scale`, `min_log_prob`), then
/// each token's log-probability as `min_log_prob + scale·v` (16 bits over
/// the 16 nats below the best token; 0 below them).
struct LlamaBase {
    ctx: usize,
    vocab: usize,
    chunks: usize,
    tokens: Vec<u32>,
    rows: Vec<u8>,
}

const LLAMA_MAGIC: &[u8; 8] = b"_logits_";

impl LlamaBase {
    fn read(path: &std::path::Path, data: Vec<u8>) -> Result<LlamaBase> {
        let bad = |why: String| {
            anyhow::anyhow!(
                "{} is not a llama-perplexity --kl-divergence-base file: {why}",
                path.display()
            )
        };
        let i32_at = |o: usize| -> Result<usize> {
            let b = data
                .get(o..o + 4)
                .ok_or_else(|| bad("truncated header".into()))?;
            let v = i32::from_le_bytes(b.try_into().expect("4 bytes"));
            usize::try_from(v).map_err(|_| bad(format!("negative size {v}")))
        };
        let (ctx, vocab, chunks) = (i32_at(8)?, i32_at(12)?, i32_at(16)?);
        if ctx < 4 || vocab == 0 || vocab > 1 << 24 || chunks == 0 || ctx > 1 << 24 {
            return Err(bad(format!(
                "n_ctx {ctx}, n_vocab {vocab}, n_chunk {chunks}"
            )));
        }
        let n_tokens = ctx
            .checked_mul(chunks)
            .ok_or_else(|| bad("too many tokens".into()))?;
        let rows_at = 20 + 4 * n_tokens;
        let per_row = 2 * (2 * vocab.div_ceil(2) + 4);
        let want = (ctx - 1 - ctx / 2)
            .checked_mul(chunks)
            .and_then(|r| r.checked_mul(per_row))
            .and_then(|b| b.checked_add(rows_at));
        if want != Some(data.len()) {
            return Err(bad(format!(
                "{} bytes where n_ctx {ctx}, n_vocab {vocab} and n_chunk {chunks} make {want:?}",
                data.len()
            )));
        }
        let tokens = data[20..rows_at]
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        let mut rows = data;
        rows.drain(..rows_at);
        Ok(LlamaBase {
            ctx,
            vocab,
            chunks,
            tokens,
            rows,
        })
    }

    /// The base's log-probabilities of scored position `n` (in order over
    /// the chunks), as llama.cpp reads them back.
    fn row(&self, n: usize, out: &mut Vec<f32>) {
        let per_row = 2 * (2 * self.vocab.div_ceil(2) + 4);
        let r = &self.rows[n * per_row..(n + 1) * per_row];
        let f = |o: usize| f32::from_le_bytes(r[o..o + 4].try_into().expect("4 bytes"));
        let (scale, min) = (f(0), f(4));
        out.clear();
        out.extend(
            r[8..8 + 2 * self.vocab]
                .chunks_exact(2)
                .map(|b| scale * u16::from_le_bytes([b[0], b[1]]) as f32 + min),
        );
    }
}

/// The run compared against: one of ours, or llama.cpp's.
enum Base {
    Saved(Saved),
    Llama(LlamaBase),
}

impl Base {
    fn read(path: &std::path::Path) -> Result<Base> {
        let data = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        if data.starts_with(LLAMA_MAGIC) {
            return Ok(Base::Llama(LlamaBase::read(path, data)?));
        }
        Ok(Base::Saved(Saved::parse(path, &data)?))
    }
}

/// KL divergence and top-1 agreement against a saved run.
#[derive(Default)]
struct Kl {
    n: usize,
    sum: f64,
    sum2: f64,
    max: f64,
    same_top: usize,
    base_nll: f64,
}

impl Kl {
    /// KL(base ‖ this) over the base's kept tokens plus the rest of the
    /// vocabulary as one outcome: the divergence of the distributions
    /// seen at that resolution, a lower bound of the full one.
    fn add(&mut self, base: &(f32, Vec<(u32, f32)>), row: &[f32], norm: f64, argmax: u32) {
        let (mut kl, mut p_kept, mut q_kept) = (0.0f64, 0.0f64, 0.0f64);
        for &(t, lp) in &base.1 {
            let (lp, lq) = (lp as f64, row[t as usize] as f64 - norm);
            let p = lp.exp();
            kl += p * (lp - lq);
            p_kept += p;
            q_kept += lq.exp();
        }
        let (pr, qr) = ((1.0 - p_kept).max(0.0), (1.0 - q_kept).max(1e-12));
        if pr > 0.0 {
            kl += pr * (pr / qr).ln();
        }
        self.record(kl.max(0.0), base.1[0].0 == argmax, base.0);
    }

    /// One position's divergence, whether the best tokens agree, and the
    /// base's log-probability of the target.
    fn record(&mut self, kl: f64, same_top: bool, base_lp: f32) {
        self.n += 1;
        self.sum += kl;
        self.sum2 += kl * kl;
        self.max = self.max.max(kl);
        self.same_top += same_top as usize;
        self.base_nll -= base_lp as f64;
    }

    /// KL(base ‖ this) over the whole vocabulary from llama.cpp's row of
    /// log-probabilities, as `llama-perplexity --kl-divergence` sums it
    /// (tokens more than 16 nats below the base's best left out), and
    /// top-1 agreement with its best token.
    fn add_full(&mut self, base: &[f32], row: &[f32], norm: f64, argmax: u32, target: u32) {
        let mut kl = 0.0f64;
        let mut best = 0;
        for (i, (&lp, &logit)) in base.iter().zip(row).enumerate() {
            if lp > base[best] {
                best = i;
            }
            if lp > -16.0 {
                kl += (lp as f64).exp() * (lp as f64 - (logit as f64 - norm));
            }
        }
        self.record(kl, best as u32 == argmax, base[target as usize]);
    }

    fn mean(&self) -> f64 {
        self.sum / self.n.max(1) as f64
    }

    fn err(&self) -> f64 {
        std_err(self.sum, self.sum2, self.n)
    }
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
        std_err(self.nll, self.nll2, self.count) * self.ppl()
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
    let mut tokens = tok.encode(&text, Special::AsText, add_bos)?;
    let base = args.kl_divergence.as_deref().map(Base::read).transpose()?;
    // Against llama.cpp: its tokens, and how many of ours differ.
    let mut differ = None;
    if let Some(Base::Llama(b)) = &base {
        if b.ctx != args.ctx {
            bail!(
                "{} was made with a context of {}: run with --ctx {}",
                args.kl_divergence.as_ref().expect("read").display(),
                b.ctx,
                b.ctx
            );
        }
        if b.vocab != model.config().vocab_size {
            bail!(
                "{} has a vocabulary of {} and the model {}: it is another model's",
                args.kl_divergence.as_ref().expect("read").display(),
                b.vocab,
                model.config().vocab_size
            );
        }
        let n = b.tokens.len();
        let same = tokens.iter().zip(&b.tokens).filter(|(a, b)| a == b).count();
        differ = Some((n - same.min(n), n));
        tokens = b.tokens.clone();
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= b.vocab) {
            bail!("token id {t} in the base is outside its vocabulary");
        }
    }
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
    if let Some(Base::Llama(b)) = &base {
        n_chunks = n_chunks.min(b.chunks);
    }
    let name = model.path.display().to_string();
    let per_token = model.config().kv_bytes_per_token(args.cache_dtype);
    // One chunk, and (a model with sliding layers) the least their own
    // pool holds: the window and a prompt chunk more.
    let span = ctx + 64 + model.config().sliding_window().map_or(0, |w| w + 512);
    let engine = Engine::from_model(
        model,
        EngineConfig {
            kv_memory: span * per_token.max(1) * 2,
            cache_dtype: args.cache_dtype,
            prefix_cache: false,
            context_length: Some(ctx),
            activations: args.activations,
            self_extend: args.self_extend.get(),
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
    let scored: Vec<u32> = (0..n_chunks)
        .flat_map(|i| tokens[i * ctx + first..(i + 1) * ctx].iter().copied())
        .collect();
    let fp = fingerprint(&scored);
    if let (Some(Base::Saved(b)), Some(path)) = (&base, &args.kl_divergence) {
        if (b.ctx, b.chunks, b.fingerprint) != (ctx, n_chunks, fp) {
            bail!(
                "{} was saved with --ctx {} over {} chunks of another text or tokenizer: run the same text with the same --ctx and --chunks",
                path.display(),
                b.ctx,
                b.chunks
            );
        }
    }
    let mut base_row = Vec::new();
    let detailed = base.is_some() || args.save_logits.is_some();
    let mut saved = Vec::new();
    let mut kl = Kl::default();
    let mut t = Totals::default();
    let mut line = String::new();
    let start = Instant::now();
    for i in 0..n_chunks {
        let mut chunk = tokens[i * ctx..(i + 1) * ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        let scores: Vec<(f64, bool)> = if detailed {
            let rows = engine.logits(&chunk, first)?;
            let mut out = Vec::with_capacity(rows.len());
            for (j, row) in (first..).zip(&rows) {
                let target = chunk[j + 1];
                let (argmax, norm) = argmax_and_norm(row);
                let lp = row[target as usize] as f64 - norm;
                match &base {
                    Some(Base::Saved(b)) => kl.add(&b.rows[kl.n], row, norm, argmax),
                    Some(Base::Llama(b)) => {
                        b.row(kl.n, &mut base_row);
                        kl.add_full(&base_row, row, norm, argmax, target);
                    }
                    None => {}
                }
                if args.save_logits.is_some() {
                    saved.push((lp as f32, TokenLogprob::of(row, target, KEEP).top));
                }
                out.push((lp, argmax == target));
            }
            out
        } else {
            engine.score(&chunk, first)?
        };
        for (lp, top) in scores {
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
    if let Some(path) = &args.save_logits {
        Saved {
            ctx,
            chunks: n_chunks,
            fingerprint: fp,
            rows: saved,
        }
        .write(path)?;
    }
    let kl_json = base.as_ref().map(|b| {
        json!({
            "base": match b { Base::Saved(_) => "tessera", Base::Llama(_) => "llama.cpp" },
            "tokens_differing": differ.map(|(d, _)| d),
            "kl_mean": kl.mean(),
            "kl_err": kl.err(),
            "kl_max": kl.max,
            "same_top1": kl.same_top as f64 / kl.n.max(1) as f64,
            "base_ppl": (kl.base_nll / kl.n.max(1) as f64).exp(),
        })
    });
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
                "cache_dtype": args.cache_dtype.name(),
                "self_extend": args.self_extend.get().map(|g| json!({"n": g.n, "w": g.w})),
                "kl_divergence": kl_json,
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
        if let Some((d, n)) = differ {
            println!("tokenization: {d} of llama.cpp's {n} tokens differ from Tessera's (llama.cpp's scored)");
        }
        let against = match &base {
            Some(Base::Llama(_)) => Some(("llama.cpp's run", "whole vocabulary".to_string())),
            Some(Base::Saved(_)) => Some((
                "the saved run",
                format!("over its top {KEEP} tokens and the rest"),
            )),
            None => None,
        };
        if let Some((what, over)) = against {
            println!(
                "KL divergence from {what}: {:.6} +/- {:.6} (max {:.4}; {over}), same top-1 {:.2}%, its PPL {:.4}",
                kl.mean(),
                kl.err(),
                kl.max,
                100.0 * kl.same_top as f64 / kl.n.max(1) as f64,
                (kl.base_nll / kl.n.max(1) as f64).exp()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `--kl-divergence-base` file as llama-perplexity writes it: its
    /// rows quantized by llama.cpp's own rule (16 bits over the 16 nats
    /// below the best token), read back, and KL against the same logits
    /// near 0 (the 16-bit rounding), against other logits not; a truncated
    /// file and a wrong header are errors, not panics.
    #[test]
    fn reads_llama_perplexity_base_files() {
        let (ctx, vocab, chunks) = (8usize, 5usize, 2usize);
        let rows = (ctx - 1 - ctx / 2) * chunks;
        let logits = |r: usize| -> Vec<f32> {
            (0..vocab)
                .map(|i| ((i * 7 + r * 3) % 11) as f32 * 0.9 - 3.0)
                .collect()
        };
        let mut data = b"_logits_".to_vec();
        for v in [ctx, vocab, chunks] {
            data.extend((v as i32).to_le_bytes());
        }
        for t in 0..ctx * chunks {
            data.extend((t as i32 % vocab as i32).to_le_bytes());
        }
        for r in 0..rows {
            // llama.cpp's log_softmax, as perplexity.cpp writes it.
            let l = logits(r);
            let max = l.iter().cloned().fold(f32::MIN, f32::max);
            let min = l.iter().cloned().fold(f32::MAX, f32::min).max(max - 16.0);
            let lse = (l.iter().map(|&x| ((x - max) as f64).exp()).sum::<f64>()).ln() as f32;
            let scale = (max - min) / 65535.0;
            data.extend(scale.to_le_bytes());
            data.extend((min - max - lse).to_le_bytes());
            for &x in &l {
                let q = if x > min {
                    ((x - min) / scale).round() as u16
                } else {
                    0
                };
                data.extend(q.to_le_bytes());
            }
            if vocab % 2 == 1 {
                data.extend(0u16.to_le_bytes());
            }
        }
        let path = std::path::Path::new("base.kld");
        let b = LlamaBase::read(path, data.clone()).unwrap();
        assert_eq!(
            (b.ctx, b.vocab, b.chunks, b.tokens.len()),
            (ctx, vocab, chunks, ctx * chunks)
        );
        let (mut same, mut other) = (Kl::default(), Kl::default());
        let mut row = Vec::new();
        for r in 0..rows {
            b.row(r, &mut row);
            let l = logits(r);
            let (argmax, norm) = argmax_and_norm(&l);
            same.add_full(&row, &l, norm, argmax, 1);
            let mut shifted = l.clone();
            shifted.rotate_left(1);
            let (argmax, norm) = argmax_and_norm(&shifted);
            other.add_full(&row, &shifted, norm, argmax, 1);
        }
        assert_eq!(same.n, rows);
        assert!(same.mean() < 1e-6, "KL against itself {}", same.mean());
        assert_eq!(same.same_top, rows);
        assert!(
            other.mean() > 0.1,
            "KL against other logits {}",
            other.mean()
        );
        for bad in [&data[..data.len() - 3], &data[..12]] {
            assert!(LlamaBase::read(path, bad.to_vec()).is_err());
        }
        let mut wrong = data.clone();
        wrong[8..12].copy_from_slice(&(-1i32).to_le_bytes());
        assert!(LlamaBase::read(path, wrong).is_err());
    }
}
