//! Speculative decoding with a draft model (llama.cpp's `--model-draft`):
//! a smaller model of the same vocabulary proposes the tokens that follow
//! each sampled one, greedily, from a paged K/V cache of its own; the next
//! step of the model checks them exactly as it checks prompt-lookup drafts
//! ([`crate::spec`]), so the output is the same tokens with or without it,
//! greedy or sampled (a greedy draft is one guess per position, kept when
//! the sampler draws it).
//!
//! Each sample has a sequence in the draft's cache holding the K/V of its
//! text so far and of the guesses it fed. At its next draft the sequence
//! is cut back to what it has in common with the text (the guesses that
//! were wrong leave through [`KvCache::truncate`], no copy), the text it
//! lacks is computed (the prompt, the first time, in chunks; afterwards
//! the token just sampled and any guesses it did not feed), and then the
//! guesses one at a time, every sample drafting in the same forward. A
//! draft stops early where the draft model's probability of its next
//! guess is under `p_min` (llama.cpp's `--draft-p-min`) or at an
//! end-of-generation token. What a finished sample computed enters the
//! draft's own prefix tree, in its partition's namespace, so a chat's next
//! turn drafts without computing its history again.
//!
//! A draft that fails (an error or a panic in the draft model) is no
//! draft: the draft's cache starts over and the samples decode one token
//! a step until the next.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use tessera_kv::{token_ids, Admission, KvCache, KvConfig, Namespace, SeqId, Slot, TokenId};
use tessera_model::Model;
use tessera_sched::ReqId;
use tracing::warn;

use crate::error::panic_text;
use crate::runner::{sliding_part, Part, Runner};
use crate::sampler::argmax_and_norm;
use crate::{CacheDType, EngineError, Result};

/// How the draft model's cache is laid out and how it drafts.
pub(crate) struct DraftSetup {
    pub model: Arc<Model>,
    /// Its pools.
    pub kv: KvConfig,
    pub dtype: CacheDType,
    /// Longest text (with its draft) the draft model reads.
    pub ctx: usize,
    /// Most tokens of one forward that computes prompts.
    pub chunk: usize,
    pub p_min: f32,
    pub prefix_cache: bool,
}

/// A sample that wants a draft.
pub(crate) struct Want<'a> {
    pub req: ReqId,
    /// The sample's partition's namespace.
    pub ns: Namespace,
    /// Its text so far; the last token is the one just sampled.
    pub history: &'a [u32],
    /// Most guesses.
    pub most: usize,
    /// May read and fill the draft's prefix tree.
    pub reuse: bool,
}

/// A sample drafting in this call: its sequence, the tokens appended to it
/// and not yet computed, their slots, and its logits row once computed.
struct Live {
    at: usize,
    seq: SeqId,
    start: usize,
    pending: Vec<TokenId>,
    slots: Vec<Slot>,
    sliding: Vec<Slot>,
    done: usize,
    row: Option<Vec<f32>>,
    going: bool,
}

pub(crate) struct Drafts {
    runner: Runner,
    kv: KvCache,
    setup: DraftSetup,
    seqs: HashMap<ReqId, SeqId>,
}

impl Drafts {
    pub(crate) fn new(setup: DraftSetup) -> Result<Drafts> {
        let runner = Runner::new(
            setup.model.clone(),
            setup.kv.num_blocks,
            setup.kv.sliding.map(|s| s.num_blocks),
            setup.kv.block_size,
            setup.dtype,
        )?;
        Ok(Drafts {
            runner,
            kv: KvCache::new(setup.kv)?,
            setup,
            seqs: HashMap::new(),
        })
    }

    /// The draft model's cache.
    pub(crate) fn kv(&self) -> &KvCache {
        &self.kv
    }

    /// Each sample's draft (empty where there is none), in order.
    pub(crate) fn draft(&mut self, wants: &[Want]) -> Vec<Vec<u32>> {
        let ran = catch_unwind(AssertUnwindSafe(|| self.try_draft(wants)));
        let why = match ran {
            Ok(Ok(d)) => return d,
            Ok(Err(e)) => e.to_string(),
            Err(p) => panic_text(&*p),
        };
        warn!("the draft model failed ({why}); its cache starts over");
        self.clear();
        vec![Vec::new(); wants.len()]
    }

    /// Drops `req`'s sequence; with its final text, what the sequence
    /// holds of that text first enters the prefix tree.
    pub(crate) fn release(&mut self, req: ReqId, text: Option<&[u32]>) {
        let Some(seq) = self.seqs.remove(&req) else {
            return;
        };
        if let (Some(text), true) = (text, self.setup.prefix_cache) {
            let common = self.common(seq, text);
            if self.kv.truncate(seq, common).is_ok() {
                if let Err(e) = self.kv.insert_sequence(seq) {
                    warn!("draft cache: caching {req}: {e}");
                }
            }
        }
        if let Err(e) = self.kv.free_sequence(seq) {
            warn!("draft cache: freeing {req}: {e}");
            self.clear();
        }
    }

    /// An empty cache (its tensors' contents no longer matter): after a
    /// failed draft, or when the engine's own bookkeeping starts over.
    pub(crate) fn clear(&mut self) {
        self.seqs.clear();
        match KvCache::new(self.setup.kv) {
            Ok(kv) => self.kv = kv,
            Err(e) => warn!("draft cache: starting over: {e}"),
        }
    }

    /// Tokens `seq` holds in common with `text`.
    fn common(&self, seq: SeqId, text: &[u32]) -> usize {
        self.kv.sequence(seq).map_or(0, |s| {
            s.tokens()
                .iter()
                .zip(text)
                .take_while(|(a, b)| a.0 == **b)
                .count()
        })
    }

    /// `want`'s sequence, cut back to what it has in common with the text
    /// (at most all but its last token, whose logits the draft starts
    /// from), and that length.
    fn place(&mut self, want: &Want) -> (SeqId, usize) {
        let keep = want.history.len() - 1;
        if let Some(&seq) = self.seqs.get(&want.req) {
            let common = self.common(seq, want.history).min(keep);
            if self.kv.truncate(seq, common).is_ok() {
                return (seq, common);
            }
            self.release(want.req, None);
        }
        let reusable = if want.reuse && self.setup.prefix_cache {
            token_ids(&want.history[..keep])
        } else {
            Vec::new()
        };
        let (seq, reused) = self.kv.add_sequence(want.ns, &reusable);
        self.seqs.insert(want.req, seq);
        (seq, reused)
    }

    /// Reserves slots for `tokens` after `seq`'s, carrying out the copies
    /// of shared tail blocks; `None` when the draft's pool has no room.
    fn append(&mut self, seq: SeqId, tokens: &[TokenId]) -> Result<Option<(Vec<Slot>, Vec<Slot>)>> {
        match self.kv.append(seq, tokens)? {
            Admission::Ok(plan) => {
                self.runner.apply_copies(&plan.copies)?;
                self.runner.apply_sliding_copies(&plan.sliding_copies)?;
                Ok(Some((plan.slots, plan.sliding_slots)))
            }
            Admission::Later { .. } | Admission::Never { .. } => Ok(None),
        }
    }

    fn try_draft(&mut self, wants: &[Want]) -> Result<Vec<Vec<u32>>> {
        let mut out = vec![Vec::new(); wants.len()];
        let mut live = Vec::new();
        for (at, w) in wants.iter().enumerate() {
            let len = w.history.len();
            if w.most == 0 || len == 0 || len + w.most > self.setup.ctx {
                self.release(w.req, None);
                continue;
            }
            let (seq, start) = self.place(w);
            let pending = token_ids(&w.history[start..]);
            let Some((slots, sliding)) = self.append(seq, &pending)? else {
                // No room in the draft's pool: no draft this time.
                self.release(w.req, None);
                continue;
            };
            live.push(Live {
                at,
                seq,
                start,
                pending,
                slots,
                sliding,
                done: 0,
                row: None,
                going: true,
            });
        }
        // The text each sequence lacks, at most `chunk` tokens a forward.
        while live.iter().any(|l| l.done < l.pending.len()) {
            let mut budget = self.setup.chunk.max(1);
            let mut batch = Vec::new();
            for (j, l) in live.iter().enumerate() {
                let n = (l.pending.len() - l.done).min(budget);
                if n > 0 {
                    batch.push((j, l.done..l.done + n));
                    budget -= n;
                }
            }
            self.forward(&mut live, &batch)?;
        }
        // Then the guesses, one per sample and forward.
        loop {
            let mut batch = Vec::new();
            for (j, l) in live.iter_mut().enumerate() {
                if !l.going {
                    continue;
                }
                let w = &wants[l.at];
                let row = l.row.take().unwrap_or_default();
                let (t, norm) = argmax_and_norm(&row);
                let p = row
                    .get(t as usize)
                    .map_or(0.0, |&x| (x as f64 - norm).exp());
                if row.is_empty() || p < self.setup.p_min as f64 {
                    l.going = false;
                    continue;
                }
                out[l.at].push(t);
                if out[l.at].len() >= w.most || self.setup.model.tokenizer.is_eog(t) {
                    l.going = false;
                    continue;
                }
                l.pending.push(TokenId(t));
                batch.push(j);
            }
            let mut fed = Vec::new();
            for j in batch {
                let l = &mut live[j];
                let t = *l.pending.last().expect("pushed above");
                match self.append(l.seq, &[t])? {
                    Some((s, sl)) => {
                        l.slots.extend(s);
                        l.sliding.extend(sl);
                        fed.push((j, l.done..l.done + 1));
                    }
                    None => l.going = false,
                }
            }
            if fed.is_empty() {
                break;
            }
            self.forward(&mut live, &fed)?;
        }
        Ok(out)
    }

    /// Computes the given token ranges of the samples' pending tokens in
    /// one forward; a sample whose pending tokens end there gets the
    /// logits row of its last.
    fn forward(
        &mut self,
        live: &mut [Live],
        batch: &[(usize, std::ops::Range<usize>)],
    ) -> Result<()> {
        let split = self.kv.window().is_some();
        let mut tables = Vec::with_capacity(batch.len());
        for (j, _) in batch {
            let seq = live[*j].seq;
            let sliding = if split {
                Some(self.kv.sliding_table(seq)?)
            } else {
                None
            };
            tables.push((self.kv.sequence(seq)?.block_table().to_vec(), sliding));
        }
        let parts: Vec<Part> = batch
            .iter()
            .zip(&tables)
            .map(|((j, r), (table, sliding))| {
                let l = &live[*j];
                let last = r.end == l.pending.len();
                Part {
                    tokens: &l.pending[r.clone()],
                    start: l.start + r.start,
                    slots: &l.slots[r.clone()],
                    table,
                    logits_from: last.then_some(r.len() - 1),
                    sliding: sliding
                        .as_ref()
                        .map(|t| sliding_part(&l.sliding[r.clone()], t)),
                    rope: Vec::new(),
                }
            })
            .collect();
        let logits = self.runner.forward(&parts)?;
        drop(parts);
        let wanting: Vec<usize> = batch
            .iter()
            .filter(|(j, r)| r.end == live[*j].pending.len())
            .map(|(j, _)| *j)
            .collect();
        let mut at = 0;
        logits.each_row(|row| {
            if let Some(&j) = wanting.get(at) {
                live[j].row = Some(row.to_vec());
            }
            at += 1;
        })?;
        for (j, r) in batch {
            let l = &mut live[*j];
            l.done = r.end;
            self.kv.mark_computed(l.seq, l.start + l.done)?;
        }
        if at != wanting.len() {
            return Err(EngineError::Step(format!(
                "the draft model returned {at} logits rows for {}",
                wanting.len()
            )));
        }
        Ok(())
    }
}

/// Refuses a draft model whose vocabulary is not the model's, token for
/// token (its guesses would be other tokens' ids).
pub(crate) fn check_vocab(model: &Model, draft: &Model) -> Result<()> {
    let (a, b) = (&model.tokenizer, &draft.tokenizer);
    let (na, nb) = (model.config().vocab_size, draft.config().vocab_size);
    if na != nb || a.vocab_size() != b.vocab_size() {
        return Err(EngineError::Invalid(format!(
            "the draft model's vocabulary has {} tokens ({} logits), the model's {} ({}): a draft model must share the model's tokenizer",
            b.vocab_size(),
            nb,
            a.vocab_size(),
            na
        )));
    }
    for id in 0..a.vocab_size() as u32 {
        let (x, y) = (a.id_to_token(id), b.id_to_token(id));
        if x != y {
            return Err(EngineError::Invalid(format!(
                "the draft model's token {id} is {y:?}, the model's {x:?}: a draft model must share the model's tokenizer"
            )));
        }
    }
    if a.eog_ids() != b.eog_ids() || a.bos_id() != b.bos_id() {
        return Err(EngineError::Invalid(
            "the draft model's special tokens (BOS, end of generation) differ from the model's"
                .into(),
        ));
    }
    Ok(())
}
