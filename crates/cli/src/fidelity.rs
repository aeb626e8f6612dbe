//! `tessera bench --scenario fidelity`: how closely the integer activation
//! modes follow f32 activations on the same weights.
//!
//! The corpus is fixed: eight chat prompts, each followed by the reply the
//! model gives greedily with f32 activations (up to 128 tokens, cut at the
//! end-of-generation token). Every mode then reads the whole corpus as
//! prefills, and its next-token distribution at each reply position is
//! compared with f32's: top-1 agreement and KL(f32 ‖ mode). Each mode also
//! writes its own greedy replies, compared with f32's token by token.

use anyhow::Result;
use tessera_model::eval::{paged_greedy, prefill_logits};
use tessera_model::{Activations, Message, Model};

use crate::bench::BenchArgs;
use crate::scenarios::emit;

const PROMPTS: &[&str] = &[
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash map is in one paragraph.",
    "Give me three tips for a job interview.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Write a Python function that reverses a string.",
    "What are the health benefits of drinking water?",
];

const REPLY: usize = 128;

/// `(top-1 agrees, KL(p ‖ q))` of two logit rows, in f64.
fn compare(p: &[f32], q: &[f32]) -> (bool, f64) {
    let log_softmax = |v: &[f32]| {
        let m = v.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let z = v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
        v.iter().map(|&x| x as f64 - z).collect::<Vec<f64>>()
    };
    let argmax = |v: &[f32]| {
        (0..v.len())
            .max_by(|&a, &b| v[a].total_cmp(&v[b]))
            .unwrap_or(0)
    };
    let (lp, lq) = (log_softmax(p), log_softmax(q));
    let kl = lp
        .iter()
        .zip(&lq)
        .map(|(&a, &b)| a.exp() * (a - b))
        .sum::<f64>();
    (argmax(p) == argmax(q), kl.max(0.0))
}

pub fn fidelity(model: Model, args: &BenchArgs) -> Result<()> {
    let llama = &model.llama;
    let cut = |mut reply: Vec<u32>| {
        if let Some(e) = reply.iter().position(|&t| model.tokenizer.is_eog(t)) {
            reply.truncate(e + 1);
        }
        reply
    };
    let mut prompts = Vec::new();
    for p in PROMPTS {
        prompts.push(
            model
                .template
                .encode(&model.tokenizer, &[Message::new("user", *p)], true)?,
        );
    }
    let greedy = |acts: Activations| -> Result<Vec<Vec<u32>>> {
        llama.set_activations(acts);
        prompts
            .iter()
            .map(|ids| {
                Ok(cut(paged_greedy(
                    llama,
                    ids,
                    REPLY,
                    usize::MAX,
                    tessera_engine::CacheDType::F16,
                )?
                .0))
            })
            .collect()
    };
    // Logits at the positions that predict reply tokens.
    let logits = |acts: Activations, corpus: &[(Vec<u32>, Vec<u32>)]| -> Result<Vec<Vec<f32>>> {
        llama.set_activations(acts);
        let mut out = Vec::new();
        for (ids, reply) in corpus {
            let all: Vec<u32> = ids.iter().chain(reply).copied().collect();
            let rows = prefill_logits(llama, &all, tessera_engine::CacheDType::F16)?;
            out.extend(rows.into_iter().skip(ids.len() - 1).take(reply.len()));
        }
        Ok(out)
    };
    let reference = greedy(Activations::F32)?;
    let corpus: Vec<(Vec<u32>, Vec<u32>)> =
        prompts.iter().cloned().zip(reference.clone()).collect();
    let base = logits(Activations::F32, &corpus)?;
    for acts in [Activations::Int8x2, Activations::Int8] {
        let rows = logits(acts, &corpus)?;
        let (mut agree, mut kls) = (0usize, Vec::with_capacity(rows.len()));
        for (p, q) in base.iter().zip(&rows) {
            let (same, kl) = compare(p, q);
            agree += usize::from(same);
            kls.push(kl);
        }
        let replies = greedy(acts)?;
        let identical = replies
            .iter()
            .zip(&reference)
            .filter(|(a, b)| a == b)
            .count();
        let same_tokens: usize = replies
            .iter()
            .zip(&reference)
            .map(|(a, b)| a.iter().zip(b).take_while(|(x, y)| x == y).count())
            .sum();
        let ref_tokens: usize = reference.iter().map(Vec::len).sum();
        let n = kls.len();
        let mean = kls.iter().sum::<f64>() / n as f64;
        kls.sort_by(f64::total_cmp);
        let p99 = kls[(n * 99 / 100).min(n - 1)];
        let max = kls[n - 1];
        let top1 = agree as f64 / n as f64;
        let v = serde_json::json!({
            "scenario": "fidelity",
            "activations": acts.name(),
            "baseline": "f32",
            "positions": n,
            "top1": top1,
            "kl_mean": mean,
            "kl_p99": p99,
            "kl_max": max,
            "replies": reference.len(),
            "identical_replies": identical,
            "reply_tokens": ref_tokens,
            "tokens_before_divergence": same_tokens,
        });
        emit(
            args,
            v,
            &[format!(
                "{} vs f32 over {n} reply positions: top-1 {:.2}%, KL mean {mean:.2e}, p99 {p99:.2e}, \
                 max {max:.2e}; greedy replies identical {identical}/{}, {same_tokens}/{ref_tokens} \
                 tokens before the first difference",
                acts.name(),
                top1 * 100.0,
                reference.len()
            )],
        );
    }
    llama.set_activations(Activations::tuned());
    Ok(())
}
