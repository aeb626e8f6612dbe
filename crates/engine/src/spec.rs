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
//!
//! Whether drafting pays at all is weighed against what a guess costs
//! ([`Cost`]): a sample drafts while the share of its recent guesses kept
//! is above a guess's cost in tokens of plain decoding. Below it, prompt
//! lookup goes on drafting in the shadow (its drafts are checked against
//! the tokens sampled, which costs nothing) and drafts again once its
//! shadow guesses would pay; a draft model's sample pauses and then tries
//! one draft, whose outcome decides again.

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
/// The longest pause of a draft model's sample whose probes keep showing
/// that its guesses cost more than they give (each such pause doubles,
/// from [`PAUSE`]): a probe after a pause costs the draft model the
/// tokens it missed besides the guesses.
pub const LONGEST_PAUSE: usize = 256;

/// How much the record of one earlier draft weighs against the next:
/// about the last ten drafts decide.
const DECAY: f64 = 0.9;
/// Guesses (decayed) a sample's record holds before it can stop drafts.
const EVIDENCE: f64 = 4.0;

/// Per sample: how long its next draft may be, its pause, and what its
/// guesses have been worth.
#[derive(Debug, Clone)]
pub(crate) struct Drafter {
    spec: NgramSpec,
    len: usize,
    misses: u32,
    pause: usize,
    /// Guesses proposed and kept, older drafts weighing less ([`DECAY`]).
    proposed: f64,
    kept: f64,
    /// Paused because guesses cost more than they gave: the draft after
    /// the pause is a probe; and the length of the next such pause.
    probing: bool,
    backoff: usize,
    /// While drafting does not pay, the draft prompt lookup would have
    /// proposed, and how many of its tokens were sampled since.
    shadow: Option<(Vec<u32>, usize)>,
}

impl Drafter {
    pub(crate) fn new(spec: NgramSpec) -> Drafter {
        Drafter {
            spec,
            len: spec.max_draft.clamp(1, 2),
            misses: 0,
            pause: 0,
            proposed: 0.0,
            kept: 0.0,
            probing: false,
            backoff: PAUSE,
            shadow: None,
        }
    }

    /// Whether this sample's guesses have lately been kept less often
    /// than a guess costs (`cost`, in tokens of plain decoding).
    fn losing(&self, cost: f64) -> bool {
        self.proposed >= EVIDENCE && self.kept < cost * self.proposed
    }

    /// The draft to follow `history` (whose last token is the one just
    /// sampled), at most `most` tokens, when a guess costs `cost` tokens
    /// of plain decoding; empty while paused, while drafts do not pay, or
    /// without a match.
    pub(crate) fn draft(&mut self, history: &[u32], most: usize, cost: f64) -> Vec<u32> {
        self.follow_shadow(history);
        if self.paused() {
            return Vec::new();
        }
        let most = self.cap(most);
        if most == 0 {
            return Vec::new();
        }
        if self.losing(cost) {
            if self.shadow.is_none() {
                let d = lookup(history, self.spec.min_ngram, self.spec.max_ngram, most);
                self.shadow = (!d.is_empty()).then_some((d, 0));
            }
            return Vec::new();
        }
        self.shadow = None;
        lookup(history, self.spec.min_ngram, self.spec.max_ngram, most)
    }

    /// Checks the shadow draft against the token just sampled (the last
    /// of `history`): a step would have kept its guesses up to the first
    /// one that differs, and sampled that token or, all kept, the next.
    fn follow_shadow(&mut self, history: &[u32]) {
        let Some((draft, matched)) = self.shadow.as_mut() else {
            return;
        };
        if *matched < draft.len() && history.last() == Some(&draft[*matched]) {
            *matched += 1;
            return;
        }
        let (proposed, kept) = (draft.len(), *matched);
        self.shadow = None;
        self.kept(proposed, kept);
    }

    /// How long the next draft may be, at most `most`, when a guess costs
    /// `cost` tokens of plain decoding (0 while paused; a draft model's
    /// drafts follow it as prompt lookup's do). While guesses do not pay,
    /// the sample pauses, and then tries one draft.
    pub(crate) fn allowance(&mut self, most: usize, cost: f64) -> usize {
        if self.paused() {
            return 0;
        }
        let losing = self.losing(cost);
        if losing && !self.probing {
            self.probing = true;
            self.pause = self.backoff - 1;
            self.backoff = (self.backoff * 2).min(LONGEST_PAUSE);
            return 0;
        }
        if !losing {
            self.backoff = PAUSE;
        }
        self.probing = false;
        self.cap(most)
    }

    /// Whether this token is one of a pause's (counting it off).
    fn paused(&mut self) -> bool {
        let paused = self.pause > 0;
        self.pause = self.pause.saturating_sub(1);
        paused
    }

    /// The next draft's length: at most `most`, the adapted length and
    /// the spec's longest.
    fn cap(&self, most: usize) -> usize {
        most.min(self.len).min(self.spec.max_draft)
    }

    /// What the step kept of a draft of `proposed` tokens.
    pub(crate) fn kept(&mut self, proposed: usize, kept: usize) {
        if proposed == 0 {
            return;
        }
        self.proposed = self.proposed * DECAY + proposed as f64;
        self.kept = self.kept * DECAY + kept as f64;
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

/// Older decoding steps' weight against the next in [`Cost`]'s line.
const STEP_DECAY: f64 = 0.98;

/// Plain steps after a step with guesses whose time beyond the line's is
/// still the guesses' ([`Cost`]). Measured on a 2-core Intel Xeon with
/// AVX-512 VNNI and AMX, SmolLM2-135M (2026-12-02): a one-token step
/// right after a checked draft took 1.2–1.3× a one-token step in a run of
/// them, every part of the forward alike, falling back over four to five
/// steps.
const WAKE: usize = 6;

/// What a guess costs the engine, in tokens of plain decoding: the time a
/// step's rows add beyond its samples' own, from a least-squares line
/// through recent decoding steps' times against their rows (older steps
/// weighing less), plus what the plain steps in the wake of a step with
/// guesses take beyond the line (a checked draft slows the steps after
/// it: on one host the next few plain steps ran 20–30% slower, every part
/// of the forward alike, for a cause not found), plus the draft model's time
/// per guess, against the time of a plain step per sample at the step's
/// batch size. The wake's steps stay out of the line, which would
/// otherwise take their slowness for a plain step's and make a row look
/// cheaper. Nothing is known (0) until decoding steps of different sizes
/// have been timed. On a busy batch a guess costs nearly a token, and
/// only drafts that are nearly always right go on.
#[derive(Debug, Clone)]
pub(crate) struct Cost {
    /// The line's decayed sums: weight, rows, seconds, rows², rows·seconds.
    sums: [f64; 5],
    /// Seconds of a step of no rows, and per row.
    line: Option<(f64, f64)>,
    /// Steps since the last with guesses (`usize::MAX` before any).
    since: usize,
    /// The wake's decayed seconds beyond the line, and the guesses
    /// behind them (both decayed at every step with guesses or in a wake).
    wake_secs: f64,
    wake_guesses: f64,
    /// The draft model's decayed seconds and guesses.
    draft_secs: f64,
    draft_guesses: f64,
}

impl Default for Cost {
    fn default() -> Cost {
        Cost {
            sums: [0.0; 5],
            line: None,
            since: usize::MAX,
            wake_secs: 0.0,
            wake_guesses: 0.0,
            draft_secs: 0.0,
            draft_guesses: 0.0,
        }
    }
}

impl Cost {
    /// A decoding step (every item one sampled token and its guesses, if
    /// any) of `rows` rows for `samples` samples took `secs` (the forward
    /// and the sampling).
    pub(crate) fn step(&mut self, rows: usize, samples: usize, secs: f64) {
        let guesses = rows.saturating_sub(samples);
        self.since = if guesses > 0 {
            0
        } else {
            self.since.saturating_add(1)
        };
        if guesses > 0 || self.since <= WAKE {
            let extra = match (guesses, self.line) {
                (0, Some((fixed, per_row))) => secs - fixed - per_row * rows as f64,
                _ => 0.0,
            };
            self.wake_secs = self.wake_secs * STEP_DECAY + extra;
            self.wake_guesses = self.wake_guesses * STEP_DECAY + guesses as f64;
            if guesses == 0 {
                return;
            }
        }
        let x = rows as f64;
        let [w, sx, sy, sxx, sxy] = &mut self.sums;
        for v in [&mut *w, &mut *sx, &mut *sy, &mut *sxx, &mut *sxy] {
            *v *= STEP_DECAY;
        }
        *w += 1.0;
        *sx += x;
        *sy += secs;
        *sxx += x * x;
        *sxy += x * secs;
        let (mx, my) = (*sx / *w, *sy / *w);
        let var = *sxx / *w - mx * mx;
        // Enough steps, of sizes different enough to draw a line through.
        if *w >= 8.0 && var >= 0.25 {
            let slope = ((*sxy / *w - mx * my) / var).max(0.0);
            self.line = Some(((my - slope * mx).max(0.0), slope));
        }
    }

    /// The draft model took `secs` to propose `guesses` guesses.
    pub(crate) fn drafted(&mut self, secs: f64, guesses: usize) {
        self.draft_secs = self.draft_secs * DECAY + secs;
        self.draft_guesses = self.draft_guesses * DECAY + guesses as f64;
    }

    /// A guess's cost in tokens of plain decoding, in a step of `samples`
    /// samples.
    pub(crate) fn per_guess(&self, samples: usize) -> f64 {
        let Some((fixed, per_row)) = self.line else {
            return 0.0;
        };
        let per = |secs: f64, guesses: f64| {
            if guesses >= 1.0 {
                (secs / guesses).max(0.0)
            } else {
                0.0
            }
        };
        let draft = per(self.draft_secs, self.draft_guesses);
        let wake = per(self.wake_secs, self.wake_guesses);
        let n = samples.max(1) as f64;
        let plain = fixed + per_row * n;
        if plain <= 0.0 {
            return 0.0;
        }
        (per_row + wake + draft) * n / plain
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
        assert_eq!(d.draft(&h, 100, 0.0).len(), 2);
        d.kept(2, 2);
        assert_eq!(d.draft(&h, 100, 0.0).len(), 4);
        d.kept(4, 4);
        assert_eq!(d.draft(&h, 100, 0.0).len(), 8);
        assert_eq!(
            d.draft(&h, 3, 0.0).len(),
            3,
            "capped by what the sample may still make"
        );
        d.kept(8, 1);
        assert_eq!(d.draft(&h, 100, 0.0).len(), 2);
        for _ in 0..MISSES {
            d.kept(2, 0);
        }
        for _ in 0..PAUSE {
            assert!(d.draft(&h, 100, 0.0).is_empty());
        }
        assert_eq!(d.draft(&h, 100, 0.0).len(), 1);
    }

    #[test]
    fn lookup_drafts_in_the_shadow_while_guesses_cost_more_than_they_give() {
        let spec = NgramSpec {
            max_draft: 4,
            max_ngram: 2,
            min_ngram: 2,
        };
        let mut d = Drafter::new(spec);
        // A record of one guess kept in four.
        for _ in 0..4 {
            d.kept(4, 1);
        }
        let h: Vec<u32> = (0..20).map(|i| i % 5).collect();
        // Kept a quarter of the time: worth it at a cost of 0.2, not 0.3.
        assert!(!d.draft(&h, 100, 0.2).is_empty());
        d.shadow = None;
        assert!(d.draft(&h, 100, 0.3).is_empty(), "losing: no draft");
        let (shadow, _) = d.shadow.clone().expect("a shadow draft");
        assert_eq!(shadow, [0, 1]);
        // The text goes on as the shadow said: its guesses count as kept,
        // without a draft made, until drafting pays again.
        let mut h = h;
        let mut drafted = false;
        for i in 0..40 {
            h.push(i % 5);
            if !d.draft(&h, 100, 0.3).is_empty() {
                drafted = true;
                break;
            }
        }
        assert!(drafted, "the shadow's kept guesses turn drafting back on");
        assert!(d.kept >= 0.3 * d.proposed);
    }

    #[test]
    fn a_shadow_draft_is_settled_as_a_step_would_settle_it() {
        let mut d = Drafter::new(NgramSpec::default());
        d.shadow = Some((vec![7, 8, 9], 0));
        // 7 and 8 sampled as guessed, then 5 where 9 was guessed.
        for t in [7, 8] {
            d.follow_shadow(&[1, t]);
            assert!(d.shadow.is_some());
        }
        d.follow_shadow(&[1, 5]);
        assert!(d.shadow.is_none());
        assert_eq!((d.proposed, d.kept), (3.0, 2.0));
        // All kept: settled by the token after them (the step's own).
        d.shadow = Some((vec![7], 0));
        d.follow_shadow(&[1, 7]);
        assert!(d.shadow.is_some());
        d.follow_shadow(&[1, 4]);
        assert_eq!((d.proposed, d.kept), (3.0 * DECAY + 1.0, 2.0 * DECAY + 1.0));
    }

    #[test]
    fn a_draft_model_sample_pauses_while_guesses_do_not_pay_then_probes() {
        let mut d = Drafter::new(NgramSpec::default());
        for _ in 0..3 {
            d.kept(2, 1);
            d.misses = 0;
        }
        // Half kept: pays at 0.4.
        assert!(d.allowance(8, 0.4) > 0);
        // Not at 0.6: a pause, then one probe.
        for _ in 0..PAUSE {
            assert_eq!(d.allowance(8, 0.6), 0);
        }
        assert!(d.allowance(8, 0.6) > 0, "the probe");
        d.kept(2, 0);
        // The probe missed: paused again, twice as long.
        for _ in 0..2 * PAUSE {
            assert_eq!(d.allowance(8, 0.6), 0);
        }
        assert!(d.allowance(8, 0.6) > 0, "the second probe");
        // Kept now: drafting goes on, and the next pause is short again.
        d.kept(2, 2);
        d.kept(2, 2);
        assert!(d.allowance(8, 0.6) > 0);
        assert_eq!(d.backoff, PAUSE);
    }

    #[test]
    fn the_cost_of_a_guess_is_read_from_the_steps_times() {
        let mut c = Cost::default();
        assert_eq!(c.per_guess(1), 0.0, "nothing known yet");
        // One sample; steps of 10 ms and 2 ms a row beyond, each step with
        // guesses followed by more plain ones than its wake.
        for i in 0..20 {
            let rows = 1 + i % 5;
            c.step(rows, 1, 0.010 + 0.002 * rows as f64);
            for _ in 0..=WAKE {
                c.step(1, 1, 0.012);
            }
        }
        // A plain step 12 ms, a guess 2 ms.
        assert!((c.per_guess(1) - 2.0 / 12.0).abs() < 1e-9);
        // Eight: a step 26 ms for 8 tokens, a guess 2 ms.
        assert!((c.per_guess(8) - 0.002 * 8.0 / 0.026).abs() < 1e-9);
        // A draft model at 3 ms a guess adds to it.
        c.drafted(0.006, 2);
        assert!((c.per_guess(1) - 5.0 / 12.0).abs() < 1e-9);
    }

    #[test]
    fn the_steps_in_a_drafts_wake_count_against_its_guesses() {
        let mut c = Cost::default();
        // Each step of guesses (2 ms a row) slows the next three plain
        // steps by 1.5, 1 and 0.5 ms: 3 ms a draft of 1 to 3 guesses.
        for i in 0..200 {
            let rows = 2 + i % 3;
            c.step(rows, 1, 0.010 + 0.002 * rows as f64);
            for slow in [0.0015, 0.001, 0.0005, 0.0, 0.0, 0.0, 0.0, 0.0] {
                c.step(1, 1, 0.012 + slow);
            }
        }
        let (fixed, per_row) = c.line.expect("a line");
        assert!(
            (fixed - 0.010).abs() < 1e-9 && (per_row - 0.002).abs() < 1e-9,
            "the wake stays out of the line: {fixed} {per_row}"
        );
        // 3 ms over 2 guesses a draft on average: a guess 2 + 1.5 ms (the
        // recent drafts weigh more, hence the tolerance).
        let got = c.per_guess(1);
        assert!((got - 3.5 / 12.0).abs() < 0.01, "{got}");
    }
}
