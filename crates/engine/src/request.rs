//! Request handling: what happens to one sample's tokens once the model has
//! given logits: sampling, stream decoding into valid UTF-8, stop strings
//! (held back until they can no longer start one), events to the stream,
//! usage and timings. Nothing here knows blocks or tensors.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tessera_model::{Special, StreamDecoder, Tokenizer};

use crate::grammar::{Guide, Trigger};
use crate::sampler::{Sampler, TokenLogprob};
use crate::stream::Event;
use crate::types::{Completion, FinishReason, GenerateRequest, Timings, Usage};
use crate::Result;

/// One request as submitted (shared by its samples).
pub(crate) struct Group {
    pub req: Box<GenerateRequest>,
    pub prompt: Vec<u32>,
    /// The constraint's matcher before any token: each sample starts from
    /// a copy.
    pub guide: Option<std::sync::Mutex<Guide>>,
    pub events: crate::stream::EventSender,
    pub cancel: Arc<AtomicBool>,
    /// Token events sent and not yet read (see [`crate::MAX_BACKLOG`]).
    pub backlog: Arc<AtomicUsize>,
    pub submitted: Instant,
}

impl Group {
    /// The reader is [`crate::MAX_BACKLOG`] token events behind.
    pub fn behind(&self) -> bool {
        self.backlog.load(Ordering::Relaxed) >= crate::MAX_BACKLOG
    }

    /// The reader has caught up by half.
    pub fn caught_up(&self) -> bool {
        self.backlog.load(Ordering::Relaxed) <= crate::MAX_BACKLOG / 2
    }
}

/// One sample being generated.
pub(crate) struct Active {
    pub group: Arc<Group>,
    pub index: usize,
    /// The samples of `n > 1` are forked at the first logits.
    pub fork_pending: bool,
    sampler: Sampler,
    decoder: StreamDecoder,
    history: Vec<u32>,
    out: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    text: String,
    emitted: usize,
    pub started: Option<Instant>,
    first_token: Option<Instant>,
    /// Prompt tokens served from the cache.
    pub cached: Option<usize>,
    /// Of those, the tokens read back from the disk tier for it.
    pub disk_cached: usize,
    /// A sampled token not yet given to the scheduler: the reader is too
    /// far behind (see [`Group::behind`]).
    pub held: Option<u32>,
    /// Speculative decoding's drafts for this sample, when on.
    pub drafter: Option<crate::spec::Drafter>,
    /// The request's constraint, at this sample's point (structured
    /// output); taken out while its next mask is computed beside a step.
    pub guide: Option<Guide>,
    /// Draft tokens computed for this sample, and those kept.
    pub drafted: usize,
    pub accepted: usize,
}

/// What a sampled token means for its sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Compute this token and go on.
    Continue(u32),
    Finish(FinishReason),
}

impl Active {
    pub(crate) fn new(group: Arc<Group>, index: usize) -> Active {
        let mut sampling = group.req.sampling.clone();
        sampling.seed = sampling.seed.wrapping_add(index as u64);
        Active {
            fork_pending: index == 0 && group.req.n > 1,
            sampler: Sampler::new(sampling),
            decoder: StreamDecoder::default(),
            history: group.prompt.clone(),
            out: Vec::new(),
            logprobs: Vec::new(),
            text: String::new(),
            emitted: 0,
            started: None,
            first_token: None,
            cached: None,
            disk_cached: 0,
            held: None,
            drafter: None,
            drafted: 0,
            accepted: 0,
            guide: group
                .guide
                .as_ref()
                .map(|g| g.lock().expect("not poisoned").fork()),
            index,
            group,
        }
    }

    /// The draft to follow the token just sampled (the last of the
    /// history), at most what the sample may still generate after it;
    /// empty without speculative decoding or a match.
    /// The text so far: the prompt and the tokens sampled.
    pub(crate) fn history(&self) -> &[u32] {
        &self.history
    }

    /// How many guesses may follow the token just sampled (a draft
    /// model's): what the drafter allows now and the sample may still
    /// generate after it; 0 without speculative decoding.
    pub(crate) fn draft_room(&mut self, cost: f64) -> usize {
        let most = self.room();
        self.drafter.as_mut().map_or(0, |d| d.allowance(most, cost))
    }

    /// Tokens the sample may still generate after the one just sampled.
    fn room(&self) -> usize {
        self.group
            .req
            .max_tokens
            .saturating_sub(self.out.len())
            .saturating_sub(1)
    }

    pub(crate) fn next_draft(&mut self, cost: f64) -> Vec<u32> {
        let most = self.room();
        match &mut self.drafter {
            Some(d) => d.draft(&self.history, most, cost),
            None => Vec::new(),
        }
    }

    /// Sends the text token `id` completes; its log-probability goes with
    /// the token's own event (`new`), not with text flushed at the end.
    fn send_text(&self, id: u32, text: &str, new: bool) {
        let logprob = self
            .logprobs
            .last()
            .filter(|_| new)
            .map(|l| Box::new(l.clone()));
        self.group.backlog.fetch_add(1, Ordering::Relaxed);
        let _ = self.group.events.send(Event::Token {
            index: self.index,
            id,
            text: text.to_string(),
            logprob,
        });
    }

    /// Samples one token from `logits`, streams its text, and says whether
    /// the sample goes on.
    pub(crate) fn advance(&mut self, logits: &[f32], tok: &Tokenizer) -> Result<Next> {
        let group = self.group.clone();
        let req = &group.req;
        if self.out.len() >= req.max_tokens {
            return Ok(Next::Finish(FinishReason::Length));
        }
        // (A lazy constraint constrains nothing until its trigger.)
        let constrained = self.guide.as_ref().is_some_and(Guide::active);
        let t = match self.guide.as_mut().filter(|g| g.active()) {
            Some(g) => {
                let allowed = g.masked(logits)?;
                self.sampler.sample(&allowed, &self.history, &self.out)
            }
            None => self.sampler.sample(logits, &self.history, &self.out),
        };
        self.first_token.get_or_insert_with(Instant::now);
        // A constrained sample's end-of-generation token is the
        // constraint's end: it ends the sample even with `ignore_eos`.
        if tok.is_eog(t) && (!req.ignore_eos || constrained) {
            return Ok(Next::Finish(FinishReason::Stop));
        }
        // The constraint complete, nothing more may follow.
        let complete = match self.guide.as_mut().filter(|g| g.active()) {
            Some(g) => g.commit(t)?,
            None => false,
        };
        if let Some(top) = req.logprobs {
            self.logprobs.push(TokenLogprob::of(logits, t, top));
        }
        self.out.push(t);
        self.history.push(t);
        let before = self.text.len();
        if let Some(piece) = self.decoder.push(tok, t)? {
            self.text.push_str(&piece);
        }
        // A lazy constraint's trigger completed by this token: constrained
        // from the next one (complete already, when the text after the
        // trigger finished it).
        let complete = complete || self.wake_guide(t, before, tok);
        if let Some(at) = find_stop(&self.text, before, &req.stop) {
            self.text.truncate(at);
            self.send_text(t, &self.text[self.emitted.min(at)..], true);
            self.emitted = self.text.len();
            return Ok(Next::Finish(FinishReason::StopString));
        }
        let safe = self.text.len() - held_back(&self.text, &req.stop);
        if safe > self.emitted || self.text.is_empty() {
            self.send_text(t, &self.text[self.emitted..safe], true);
        } else {
            self.send_text(t, "", true);
        }
        self.emitted = safe.max(self.emitted);
        if complete {
            return Ok(Next::Finish(FinishReason::Stop));
        }
        if self.out.len() >= req.max_tokens {
            return Ok(Next::Finish(FinishReason::Length));
        }
        Ok(Next::Continue(t))
    }

    /// Wakes a waiting lazy guide whose trigger token `t` completed (the
    /// output's text was `before` bytes long without it): its matcher takes
    /// the trigger and the text after it. Whether the constraint is then
    /// complete. Where they do not fit it, the guide waits on.
    fn wake_guide(&mut self, t: u32, before: usize, tok: &Tokenizer) -> bool {
        let Some(g) = self.guide.as_mut().filter(|g| !g.active()) else {
            return false;
        };
        let tokens = match g.triggered(t, &self.text, before) {
            None => return false,
            Some(Trigger::Token(t)) => vec![t],
            Some(Trigger::Text(from)) => tok
                .encode(&self.text[from..], Special::AsText, false)
                .unwrap_or_default(),
        };
        g.wake(&tokens) && g.done()
    }

    /// Flushes held-back text and builds the sample's completion.
    pub(crate) fn complete(mut self, reason: FinishReason, tok: &Tokenizer) -> Completion {
        if reason != FinishReason::StopString {
            if let Ok(Some(rest)) = self.decoder.finish(tok) {
                self.text.push_str(&rest);
            }
            if self.emitted < self.text.len() {
                if let Some(&last) = self.out.last() {
                    self.send_text(last, &self.text[self.emitted..], false);
                }
            }
        }
        let now = Instant::now();
        let g = &self.group;
        let first = self.first_token.unwrap_or(now);
        let started = self.started.unwrap_or(g.submitted);
        let cached = self.cached.unwrap_or(0);
        let new_prompt = g.prompt.len().saturating_sub(cached);
        let decode_s = now.duration_since(first).as_secs_f64();
        let prefill_s = first.duration_since(started).as_secs_f64();
        Completion {
            index: self.index,
            usage: Usage {
                prompt_tokens: g.prompt.len(),
                cached_tokens: cached,
                disk_cached_tokens: self.disk_cached.min(cached),
                completion_tokens: self.out.len(),
                draft_tokens: self.drafted,
                accepted_draft_tokens: self.accepted,
            },
            timings: Timings {
                ttft_ms: first.duration_since(g.submitted).as_secs_f64() * 1e3,
                prefill_tok_s: new_prompt as f64 / prefill_s.max(1e-9),
                decode_tok_s: if self.out.len() > 1 {
                    (self.out.len() - 1) as f64 / decode_s.max(1e-9)
                } else {
                    0.0
                },
                total_s: now.duration_since(g.submitted).as_secs_f64(),
            },
            text: self.text,
            tokens: self.out,
            logprobs: self.logprobs,
            prompt_tokens: g.prompt.clone(),
            finish_reason: reason,
        }
    }
}

/// Most stop strings a request may give, and the longest one in bytes:
/// each generated token is checked against every one of them.
pub const MAX_STOP_STRINGS: usize = 16;
pub const MAX_STOP_BYTES: usize = 256;

/// Where the first stop string in `text` starts, of those that end past
/// `before` (the text's length before the last token: an earlier match
/// would have stopped already). Only the last `before`'s tail that a stop
/// string could reach back into is searched, so a token costs the same
/// however long the text is.
pub(crate) fn find_stop(text: &str, before: usize, stops: &[String]) -> Option<usize> {
    let reach = stops.iter().map(String::len).max()?.saturating_sub(1);
    let mut from = before.saturating_sub(reach);
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text[from..].find(s.as_str()).map(|at| from + at))
        .min()
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
    use super::{find_stop, held_back};

    /// The incremental search finds what a search of the whole text finds,
    /// for stops that end in the last token's text.
    #[test]
    fn finds_stops_in_the_new_tail_only() {
        let stops = vec!["</end>".to_string(), "é!".to_string(), String::new()];
        assert_eq!(find_stop("abc </en", 5, &stops), None);
        assert_eq!(find_stop("abc </end>", 8, &stops), Some(4));
        assert_eq!(find_stop("xxé!", 3, &stops), Some(2));
        assert_eq!(find_stop("ééé!", 6, &stops), Some(4));
        // The empty string never stops a sample.
        assert_eq!(find_stop("abc", 2, &[String::new()]), None);
        assert_eq!(find_stop("abc", 2, &[]), None);
    }

    #[test]
    fn holds_back_possible_stop_prefixes() {
        let stops = vec!["</end>".to_string(), "STOP".to_string()];
        assert_eq!(held_back("hello </e", &stops), 3);
        assert_eq!(held_back("hello S", &stops), 1);
        assert_eq!(held_back("hello", &stops), 0);
    }
}
