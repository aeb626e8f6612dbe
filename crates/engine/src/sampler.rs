//! Token sampling: logit bias, presence/frequency and repetition
//! penalties, then greedy or temperature with top-k, top-p and min-p, with a
//! seeded generator so that the same seed gives the same tokens; and the
//! log-probabilities of the model's own distribution.

/// Sampling parameters. `temperature <= 0` means greedy (argmax).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `top_p` (1: all).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely (0: none).
    pub min_p: f32,
    /// Divide positive logits (multiply negative ones) of tokens seen in the
    /// last `repeat_last_n` tokens by this (1: off).
    pub repetition_penalty: f32,
    pub repeat_last_n: usize,
    /// Subtracted from the logit of every token already generated (OpenAI's
    /// `presence_penalty`; 0: off).
    pub presence_penalty: f32,
    /// Subtracted once per earlier occurrence in the generated tokens
    /// (OpenAI's `frequency_penalty`; 0: off).
    pub frequency_penalty: f32,
    /// Added to these tokens' logits before anything else (OpenAI's
    /// `logit_bias`; -100 or less bans a token, +100 or more forces it).
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: u64,
}

impl Default for SamplingParams {
    /// llama.cpp's defaults, with a fixed seed.
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repetition_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: 42,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        }
    }
}

/// SplitMix64: small, fast, and stable across platforms and versions (the
/// samplers' random state; also the seeded mixes of the benchmarks).
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`, from the top 24 bits.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}

/// A sampler with its own random state.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        let rng = SplitMix64(params.seed);
        Sampler { params, rng }
    }

    /// Picks the next token from `logits`, given the tokens so far
    /// (`history`, prompt included) and the ones this sample generated.
    pub fn sample(&mut self, logits: &[f32], history: &[u32], generated: &[u32]) -> u32 {
        let p = &self.params;
        let plain = p.logit_bias.is_empty()
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0
            && p.repetition_penalty == 1.0;
        if plain && p.temperature <= 0.0 {
            // Nothing to adjust: no copy of the vocabulary's logits.
            return argmax(logits);
        }
        let mut logits = logits.to_vec();
        for &(t, b) in &p.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            let mut seen = generated.to_vec();
            seen.sort_unstable();
            for run in seen.chunk_by(|a, b| a == b) {
                if let Some(l) = logits.get_mut(run[0] as usize) {
                    *l -= p.presence_penalty + p.frequency_penalty * run.len() as f32;
                }
            }
        }
        if p.repetition_penalty != 1.0 {
            let start = history.len().saturating_sub(p.repeat_last_n);
            let mut seen: Vec<u32> = history[start..].to_vec();
            seen.sort_unstable();
            seen.dedup();
            for t in seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
        if p.temperature <= 0.0 {
            return argmax(&logits);
        }
        // The largest logit is subtracted before dividing, so that any
        // temperature above 0, however small, gives finite values (the
        // most likely token 0, the others at most 0, down to -inf).
        let top = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut cands: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, scaled(l, top, p.temperature)))
            .collect();
        if p.top_k > 0 && p.top_k < cands.len() {
            cands.select_nth_unstable_by(p.top_k - 1, by_logit);
            cands.truncate(p.top_k);
        }
        cands.sort_by(by_logit);
        let max = cands[0].1;
        let mut probs: Vec<f32> = cands.iter().map(|c| (c.1 - max).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= sum);
        let mut keep = probs.len();
        if p.min_p > 0.0 {
            keep = keep.min(
                probs
                    .iter()
                    .take_while(|&&x| x >= p.min_p * probs[0])
                    .count()
                    .max(1),
            );
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let n = probs.iter().take_while(|&&x| {
                let before = acc;
                acc += x;
                before < p.top_p
            });
            keep = keep.min(n.count().max(1));
        }
        let total: f32 = probs[..keep].iter().sum();
        let mut r = self.rng.next_f32() * total;
        for (i, &x) in probs[..keep].iter().enumerate() {
            if r < x {
                return cands[i].0;
            }
            r -= x;
        }
        cands[keep - 1].0
    }
}

/// `(l - top) / t`: 0 for the largest logit, never NaN (a logit of
/// -inf, or a difference that overflows, is -inf).
fn scaled(l: f32, top: f32, t: f32) -> f32 {
    let d = l - top;
    if d == 0.0 {
        0.0
    } else {
        let v = d / t;
        if v.is_nan() {
            f32::NEG_INFINITY
        } else {
            v
        }
    }
}

/// Highest first; ties by id so the order is total and deterministic.
fn by_logit(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// The log-probability of a chosen token and of the most likely ones.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    /// The `top` most likely tokens, most likely first.
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprob {
    /// Log-probabilities of the model's own distribution (the log-softmax
    /// of the raw logits: before bias, penalties and temperature, as vLLM
    /// reports them), for the chosen token `id` and the `top` best.
    pub fn of(logits: &[f32], id: u32, top: usize) -> TokenLogprob {
        let norm = argmax_and_norm(logits).1 as f32;
        let lp = |t: u32| {
            logits
                .get(t as usize)
                .map_or(f32::NEG_INFINITY, |&l| l - norm)
        };
        let mut best: Vec<(u32, f32)> = Vec::new();
        if top > 0 {
            let mut all: Vec<(u32, f32)> = logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as u32, l))
                .collect();
            let k = top.min(all.len());
            if k < all.len() {
                all.select_nth_unstable_by(k - 1, by_logit);
                all.truncate(k);
            }
            all.sort_by(by_logit);
            best = all.into_iter().map(|(t, l)| (t, l - norm)).collect();
        }
        TokenLogprob {
            id,
            logprob: lp(id),
            top: best,
        }
    }
}

/// The first maximum of `logits` and their log-sum-exp, so that the
/// log-softmax at `t` is `logits[t] - norm` (f32 exponentials, each within
/// an ulp, summed in f64 in chunks of 64).
pub fn argmax_and_norm(logits: &[f32]) -> (u32, f64) {
    let best = argmax(logits);
    let max = logits
        .get(best as usize)
        .copied()
        .unwrap_or(f32::NEG_INFINITY);
    let sum: f64 = logits
        .chunks(64)
        .map(|c| c.iter().map(|&l| (l - max).exp()).sum::<f32>() as f64)
        .sum();
    (best, max as f64 + sum.ln())
}

/// The first index of the largest value: what a scan keeping the first
/// strictly larger value finds (a NaN is never taken, unless it comes
/// first, and then nothing is larger). The largest value is found sixteen
/// lanes at a time, then its first place: a greedy step over a 49,152-token
/// vocabulary no longer waits on one compare per token.
fn argmax(xs: &[f32]) -> u32 {
    let Some(&first) = xs.first() else {
        return 0;
    };
    if first.is_nan() {
        return 0;
    }
    let larger = |m: f32, x: f32| if x > m { x } else { m };
    let chunks = xs.chunks_exact(16);
    let mut m = chunks.remainder().iter().fold(first, |m, &x| larger(m, x));
    let mut acc = [first; 16];
    for c in chunks {
        for j in 0..16 {
            acc[j] = larger(acc[j], c[j]);
        }
    }
    m = acc.iter().fold(m, |m, &x| larger(m, x));
    xs.chunks(16)
        .enumerate()
        .find_map(|(i, c)| c.iter().position(|&x| x == m).map(|p| i * 16 + p))
        .unwrap_or(0) as u32
}

/// [`argmax`] as one scan (the tests' reference).
#[cfg(test)]
fn argmax_scan(xs: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0], &[], &[]), 1);
    }

    #[test]
    fn argmax_is_the_first_of_the_largest_as_a_scan_finds_it() {
        let mut rng = SplitMix64(7);
        let special = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY, 0.0, -0.0];
        for case in 0..3000 {
            let n = (rng.next_u64() % 80) as usize + usize::from(case % 2 == 0) * 49_000;
            // Few distinct values, so that ties are common.
            let mut xs: Vec<f32> = (0..n).map(|_| (rng.next_u64() % 7) as f32 - 3.0).collect();
            for _ in 0..rng.next_u64() % 4 {
                if n > 0 {
                    let at = (rng.next_u64() % n as u64) as usize;
                    xs[at] = special[(rng.next_u64() % special.len() as u64) as usize];
                }
            }
            assert_eq!(argmax(&xs), argmax_scan(&xs), "{:?}", &xs[..n.min(80)]);
        }
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[f32::NAN, 1.0, 2.0]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 20]), 0);
        assert_eq!(argmax(&[-0.0, 0.0, -1.0]), 0);
    }

    /// Any temperature above 0 samples: the smallest positive floats
    /// (where `logit / t` overflowed to inf and every probability became
    /// NaN) pick the most likely token, and -inf logits stay out.
    #[test]
    fn tiny_temperatures_pick_the_most_likely_token() {
        let mut logits: Vec<f32> = (0..64).map(|i| (i as f32 * 0.61).cos() * 5.0).collect();
        logits[3] = f32::NEG_INFINITY;
        let best = argmax(&logits);
        for t in [1e-45_f32, f32::MIN_POSITIVE, 1e-30, 1e-6] {
            for seed in 0..20 {
                let mut s = Sampler::new(SamplingParams {
                    temperature: t,
                    seed,
                    ..Default::default()
                });
                assert_eq!(s.sample(&logits, &[], &[]), best, "temperature {t}");
            }
        }
    }

    #[test]
    fn same_seed_same_tokens_and_filters_apply() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 5,
            top_p: 1.0,
            min_p: 0.0,
            ..Default::default()
        };
        let run = |seed| {
            let mut s = Sampler::new(SamplingParams {
                seed,
                ..params.clone()
            });
            (0..200)
                .map(|_| s.sample(&logits, &[], &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        let mut top5: Vec<u32> = (0..50u32).collect();
        top5.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        top5.truncate(5);
        assert!(run(7).iter().all(|t| top5.contains(t)), "top-k leaked");
        let distinct: std::collections::BTreeSet<_> = run(7).into_iter().collect();
        assert!(
            distinct.len() > 2,
            "temperature 1 should spread: {distinct:?}"
        );
        // min_p close to 1 keeps only the best.
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.999,
            ..Default::default()
        });
        assert!((0..50).all(|_| s.sample(&logits, &[], &[]) == top5[0]));
    }

    #[test]
    fn repetition_penalty_pushes_seen_tokens_down() {
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::greedy()
        });
        assert_eq!(s.sample(&[1.0, 1.5, 0.2], &[1], &[]), 0);
    }

    #[test]
    fn bias_and_openai_penalties() {
        let logits = [1.0, 1.5, 0.2, 1.4];
        // A bias of -100 bans the best token; +100 forces the worst.
        let mut s = Sampler::new(SamplingParams {
            logit_bias: vec![(1, -100.0)],
            ..SamplingParams::greedy()
        });
        assert_eq!(s.sample(&logits, &[], &[]), 3);
        let mut s = Sampler::new(SamplingParams {
            logit_bias: vec![(2, 100.0), (99, 5.0)],
            ..SamplingParams::greedy()
        });
        assert_eq!(s.sample(&logits, &[], &[]), 2);
        // Presence: once generated, 1 falls below 3 (1.5 - 0.2 < 1.4), and
        // only generated tokens count, not the prompt.
        let mut s = Sampler::new(SamplingParams {
            presence_penalty: 0.2,
            ..SamplingParams::greedy()
        });
        assert_eq!(s.sample(&logits, &[1, 1], &[]), 1);
        assert_eq!(s.sample(&logits, &[1], &[1]), 3);
        // Frequency: per occurrence. One 1 costs 0.3 (1.2 < 1.4); two of
        // each leave 0.9 and 0.8 below token 0's 1.0.
        let mut s = Sampler::new(SamplingParams {
            frequency_penalty: 0.3,
            ..SamplingParams::greedy()
        });
        assert_eq!(s.sample(&logits, &[], &[1]), 3);
        assert_eq!(s.sample(&logits, &[], &[1, 3, 1, 3]), 0);
    }

    #[test]
    fn logprobs_are_the_models_log_softmax() {
        let logits = [2.0f32, 0.5, -1.0, 2.0];
        let lp = TokenLogprob::of(&logits, 1, 3);
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let want = |t: usize| (logits[t] as f64 - z.ln()) as f32;
        assert!((lp.logprob - want(1)).abs() < 1e-6);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [0, 3, 1]);
        for &(t, l) in &lp.top {
            assert!((l - want(t as usize)).abs() < 1e-6);
        }
        let total: f64 = (0..4).map(|t| (want(t) as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!(TokenLogprob::of(&logits, 0, 0).top.is_empty());
    }
}
