//! Draftless speculative decoding: prompt-lookup (n-gram) drafts.
//!
//! After each sampled token, the sample's text so far (prompt and
//! output) is searched for the most recent earlier occurrence of its last
//! `n` tokens (`n` from [`NgramSpec::max_ngram`] down to
//! [`NgramSpec::min_ngram`]); the tokens that followed it there are the
//! draft. The next step computes the sampled token and the draft together;
//! each draft token is kept while it equals what the sampler draws from the
//! logits before it (the same draws, in the same order, as decoding one
//! token a step), so the output is the same tokens with or without
//! speculation, greedy or sampled: for a draft that is one guess per
//! position, keeping a guess exactly when the sampler draws it is the
//! standard rejection rule. The rest are dropped from the sequence by the
//! scheduler ([`tessera_sched::Scheduler::settle_draft`]).
//!
//! How long a draft may be adapts per sample: it doubles (up to
//! [`NgramSpec::max_draft`]) while whole drafts are kept and falls to one
//! past what was kept otherwise; after [`MISSES`] drafts in a row with
//! nothing kept the sample stops drafting for [`PAUSE`] tokens, so text
//! that repeats nothing costs little.

/// Draftless speculative decoding by prompt lookup
/// ([`crate::EngineConfig::speculative`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramSpec {
    /// Most tokens a draft proposes.
    pub max_draft: usize,
    /// Longest tail searched for (tried first).
    pub max_ngram: usize,
    /// Shortest tail searched for.
    pub min_ngram: usize,
}

impl Default for NgramSpec {
    fn default() -> Self {
        NgramSpec {
            max_draft: 8,
            max_ngram: 4,
            min_ngram: 2,
        }
    }
}

impl NgramSpec {
    /// The draft prompt lookup proposes after `history` (whose last token
    /// is the one just sampled), at most `most` tokens.
    pub fn lookup(&self, history: &[u32], most: usize) -> Vec<u32> {
        lookup(history, self.min_ngram, self.max_ngram, most)
    }
}

/// Drafts in a row with nothing kept before a sample pauses drafting.
pub const MISSES: u32 = 3;
/// Tokens a sample decodes without drafts after [`MISSES`].
pub const PAUSE: usize = 16;

/// Per sample: how long its next draft may be, and its pause.
#[derive(Debug, Clone)]
pub(crate) struct Drafter {
    spec: NgramSpec,
    len: usize,
    misses: u32,
    pause: usize,
}

impl Drafter {
    pub(crate) fn new(spec: NgramSpec) -> Drafter {
        Drafter {
            spec,
            len: spec.max_draft.clamp(1, 2),
            misses: 0,
            pause: 0,
        }
    }

    /// The draft to follow `history` (whose last token is the one just
    /// sampled), at most `most` tokens; empty while paused or without a
    /// match.
    pub(crate) fn draft(&mut self, history: &[u32], most: usize) -> Vec<u32> {
        let most = self.allowance(most);
        if most == 0 {
            return Vec::new();
        }
        lookup(history, self.spec.min_ngram, self.spec.max_ngram, most)
    }

    /// How long the next draft may be, at most `most` (0 while paused; a
    /// draft model's drafts follow it as prompt lookup's do).
    pub(crate) fn allowance(&mut self, most: usize) -> usize {
        if self.pause > 0 {
            self.pause -= 1;
            return 0;
        }
        most.min(self.len).min(self.spec.max_draft)
    }

    /// What the step kept of a draft of `proposed` tokens.
    pub(crate) fn kept(&mut self, proposed: usize, kept: usize) {
        if proposed == 0 {
            return;
        }
        if kept == proposed {
            self.len = (self.len * 2).min(self.spec.max_draft).max(1);
        } else {
            self.len = (kept + 1).min(self.spec.max_draft).max(1);
        }
        if kept == 0 {
            self.misses += 1;
            if self.misses >= MISSES {
                self.misses = 0;
                self.pause = PAUSE;
            }
        } else {
            self.misses = 0;
        }
    }
}

/// The tokens after the most recent earlier occurrence of `history`'s
/// last `n` tokens, for the longest `n` from `max_n` down to `min_n` that
/// occurs, at most `most` of them.
pub(crate) fn lookup(history: &[u32], min_n: usize, max_n: usize, most: usize) -> Vec<u32> {
    let len = history.len();
    for n in (min_n.max(1)..=max_n).rev() {
        if len <= n {
            continue;
        }
        let tail = &history[len - n..];
        // Earlier occurrences only (ending before the tail starts), the
        // most recent first.
        for start in (0..len - n).rev() {
            if &history[start..start + n] == tail {
                let from = start + n;
                let to = (from + most).min(len);
                return history[from..to].to_vec();
            }
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_recent_match_gives_what_followed_it() {
        // "a b c d ... a b c" → "d ..."
        let h = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3];
        assert_eq!(lookup(&h, 2, 4, 3), [4, 5, 9]);
        // The most recent occurrence wins.
        let h = [1, 2, 7, 1, 2, 8, 1, 2];
        assert_eq!(lookup(&h, 2, 2, 4), [8, 1, 2]);
        // A draft runs up to the end of the history at most.
        let h = [5, 6, 5, 6];
        assert_eq!(lookup(&h, 2, 2, 8), [5, 6]);
        // No match of at least min_n tokens: no draft.
        assert!(lookup(&[1, 2, 3, 4], 2, 4, 4).is_empty());
        assert!(lookup(&[1], 1, 4, 4).is_empty());
    }

    #[test]
    fn drafts_grow_while_kept_and_pause_after_misses() {
        let spec = NgramSpec {
            max_draft: 8,
            max_ngram: 2,
            min_ngram: 1,
        };
        let mut d = Drafter::new(spec);
        let h: Vec<u32> = (0..40).map(|i| i % 10).collect();
        assert_eq!(d.draft(&h, 100).len(), 2);
        d.kept(2, 2);
        assert_eq!(d.draft(&h, 100).len(), 4);
        d.kept(4, 4);
        assert_eq!(d.draft(&h, 100).len(), 8);
        assert_eq!(
            d.draft(&h, 3).len(),
            3,
            "capped by what the sample may still make"
        );
        d.kept(8, 1);
        assert_eq!(d.draft(&h, 100).len(), 2);
        for _ in 0..MISSES {
            d.kept(2, 0);
        }
        for _ in 0..PAUSE {
            assert!(d.draft(&h, 100).is_empty());
        }
        assert_eq!(d.draft(&h, 100).len(), 1);
    }
}
