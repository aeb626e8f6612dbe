//! Token sampling: greedy, temperature, top-k, top-p, min-p and a
//! repetition penalty, with a seeded generator so that the same seed gives
//! the same tokens.

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

    /// Picks the next token from `logits`, given the tokens so far.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let p = &self.params;
        let mut logits = logits.to_vec();
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
        let mut cands: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / p.temperature))
            .collect();
        // Highest first; ties by id so the order is total and deterministic.
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
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

fn argmax(xs: &[f32]) -> u32 {
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
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0], &[]), 1);
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
            (0..200).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
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
        assert!((0..50).all(|_| s.sample(&logits, &[]) == top5[0]));
    }

    #[test]
    fn repetition_penalty_pushes_seen_tokens_down() {
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::greedy()
        });
        assert_eq!(s.sample(&[1.0, 1.5, 0.2], &[1]), 0);
    }
}
