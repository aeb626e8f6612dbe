//! tessera-sched: the continuous-batching scheduler.
//!
//! **What this crate must not know:** tensors, candle, devices, the model.
//! It turns waiting and running requests plus the state of a
//! [`tessera_kv::KvCache`] into a [`StepPlan`] (which sequences run, how many
//! tokens each, which blocks to copy or shift), and is tested through a
//! simulated executor.
//!
//! One step, as the engine drives it:
//!
//! ```text
//! plan = sched.schedule()          // decodes first, then prefill chunks,
//!                                  // then new requests, inside the budget
//! apply plan.ops in order          // copy-on-write copies, context shifts
//! forward(plan.items)              // write K/V into the slots, attend
//! sched.step_done(&plan)           // the items' K/V is now computed
//! for items with logits:
//!     sched.settle_draft(req, n)   // an item with a draft: keep n guesses
//!     sched.push_token(req, tok)   // or push_draft(req, tok, guesses),
//!                                  // finish(req) / fork(req)
//! ```
//!
//! Policies:
//! - **Budget.** A step computes at most `max_batch_tokens` tokens over at
//!   most `max_running` sequences. Running sequences go first, oldest first
//!   (one token each when decoding, a chunk when prefilling); what is left
//!   admits waiting requests, prefilled in chunks. A background request
//!   (a prompt computed for its K/V alone: a session save) is admitted
//!   last and, while others have work, computes at most
//!   `background_tokens` a step, so it rides along their steps.
//! - **Cache-aware order.** Waiting requests with the longest cached prefix
//!   are admitted first; one that has waited `max_wait_steps` steps goes
//!   before all others (first come, first served among those), so no
//!   request waits forever. Prompt chunks enter the prefix tree as soon as
//!   they are computed, and a request whose prompt shares more with a prompt
//!   being prefilled than with the cache waits for that prefill instead of
//!   computing the same tokens twice.
//! - **Out of blocks.** [`KvCache::append`] evicts cached-only blocks (LRU)
//!   by itself. When that is not enough, the most recently admitted running
//!   request is preempted by recompute: its computed tokens go into the
//!   prefix tree (so they usually stay cached), its blocks are freed, and it
//!   waits at the front of the queue with every token it has so far. A
//!   request that cannot fit even alone is rejected when it is added.
//! - **Context limit.** A request that would pass the context length is
//!   shifted (keep `n_keep` tokens, drop half the rest, [`KvOp::Shift`]) or
//!   ended with [`EndReason::ContextFull`].
//! - **Never fits.** A request that no longer fits the pool even alone (the
//!   pool was shrunk under it) is ended with [`EndReason::OutOfKvMemory`],
//!   never left waiting. A request that fits alone but not beside the cache
//!   evicts just the cached blocks it needs, least recently used first.
//! - **Held for room.** The engine may hold waiting requests for a step
//!   ([`Scheduler::hold_for_room`]: a lower cache tier has blocks of their
//!   prompts that the pool has no room to take back yet). While anything
//!   runs, admission stops at a held request as it does at one whose first
//!   chunk does not fit, so its prompt is copied back once running requests
//!   free the room rather than computed again beside them.
//! - **Drafts** (speculative decoding). A request may follow its sampled
//!   token with guessed ones ([`Scheduler::push_draft`]). The sampled
//!   token is scheduled as any decode; the guesses are appended in a
//!   second pass, from what is left of the budget, within the context and
//!   the request's own blocks, and only where the pool has room (a guess
//!   never preempts anyone; a step that preempted drops its drafts). After
//!   the step the engine keeps the guesses that match what it sampled
//!   ([`Scheduler::settle_draft`]); the rest leave the sequence through
//!   [`KvCache::truncate`], no K/V copied. Preemption, a failed step and
//!   finishing drop a pending draft; drafts never enter the prefix tree
//!   before they are settled.
//! - **Failed steps.** [`Scheduler::abort_step`] undoes a step whose forward
//!   pass failed: the sequences of its items are freed without entering the
//!   prefix tree (their new slots were never written), and their requests
//!   either fail (alone in the step: the fault was theirs) or are retried
//!   one per step from what the cache holds, so that a request that breaks
//!   every step it is in fails alone and the others go on.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;

use tessera_kv::{
    Admission, AppendPlan, BlockId, CopyOp, KvCache, KvError, Namespace, SeqId, ShiftPlan, Slot,
    TokenId,
};

/// A request handle, assigned by [`Scheduler::add`] and [`Scheduler::fork`].
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct ReqId(pub u64);

impl fmt::Display for ReqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "r{}", self.0)
    }
}

#[derive(Debug, Clone)]
pub struct SchedConfig {
    /// Most tokens computed in one step (decodes and prefill chunks).
    pub max_batch_tokens: usize,
    /// Most sequences in one step.
    pub max_running: usize,
    /// Steps a waiting request may be passed over by better-cached ones.
    pub max_wait_steps: u64,
    /// Reuse cached prefixes and insert finished sequences.
    pub prefix_cache: bool,
    /// Positions a sequence may hold.
    pub context_length: usize,
    /// Most tokens a background request computes in a step that has other
    /// requests' work (alone it takes the whole budget).
    pub background_tokens: usize,
}

impl Default for SchedConfig {
    fn default() -> Self {
        SchedConfig {
            max_batch_tokens: 512,
            max_running: 64,
            max_wait_steps: 64,
            prefix_cache: true,
            context_length: 2048,
            background_tokens: 16,
        }
    }
}

/// What a request asks for.
#[derive(Debug, Clone)]
pub struct NewRequest {
    pub namespace: Namespace,
    pub prompt: Vec<TokenId>,
    /// Most tokens it will generate (for the fits-alone check).
    pub max_new_tokens: usize,
    /// At the context limit: `Some(n_keep)` shifts, `None` ends the request.
    pub shift_keep: Option<usize>,
    /// Start from the longest cached prefix (when the prefix cache is on).
    /// Off, every token is computed; what it computed is still cached.
    pub reuse_prefix: bool,
    /// Its K/V is its own (keys rotated for its own position map:
    /// SelfExtend): it neither reads the prefix tree nor adds to it.
    pub private: bool,
    /// Low priority (a prompt computed for its K/V alone, as a session
    /// save's): admitted after every other waiting request, and while
    /// other requests have work it computes at most
    /// [`SchedConfig::background_tokens`] a step.
    pub background: bool,
}

/// Why a request was refused at [`Scheduler::add`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {tokens} tokens but the context holds {context}")]
    PromptTooLong { tokens: usize, context: usize },
    #[error(
        "the request needs {needed} blocks of {block_size} tokens and the whole pool has {total}"
    )]
    TooLarge {
        needed: usize,
        total: usize,
        block_size: usize,
    },
    #[error("unknown request {0}")]
    UnknownRequest(ReqId),
    #[error("request {0} cannot do that now: {1}")]
    BadState(ReqId, &'static str),
    #[error(transparent)]
    Kv(#[from] KvError),
}

/// A KV operation the engine carries out, in order, before the forward pass.
#[derive(Debug, Clone, PartialEq)]
pub enum KvOp {
    /// Copy whole blocks (copy-on-write).
    Copy(Vec<CopyOp>),
    /// The same in the sliding-window layers' pool.
    CopySliding(Vec<CopyOp>),
    /// A context shift of `req`: its copies, then the moves with K rotated.
    Shift { req: ReqId, plan: ShiftPlan },
}

/// One sequence's part of a step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepItem {
    pub req: ReqId,
    pub seq: SeqId,
    pub tokens: Vec<TokenId>,
    /// Position of `tokens[0]`.
    pub start: usize,
    pub slots: Vec<Slot>,
    /// The sequence's block table after this step's appends.
    pub block_table: Vec<BlockId>,
    /// With sliding-window layers: their slots for the tokens, and their
    /// blocks (`None` before the window); empty otherwise.
    pub sliding_slots: Vec<Slot>,
    pub sliding_table: Vec<Option<BlockId>>,
    /// The last token ends what is known: the engine samples from it.
    pub wants_logits: bool,
    /// The item's last `draft` tokens are speculative
    /// ([`Scheduler::push_draft`]): the engine reads the logits of its last
    /// `draft + 1` positions, then settles ([`Scheduler::settle_draft`]).
    pub draft: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndReason {
    /// The sequence holds the whole context and shifting is off.
    ContextFull,
    /// The request needs more blocks than the whole pool has (it was shrunk
    /// after the request was added).
    OutOfKvMemory { needed: usize, total: usize },
}

/// What [`Scheduler::abort_step`] did with the requests of a failed step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Aborted {
    /// Alone in the failed step: the engine fails them (and then calls
    /// [`Scheduler::finish`]).
    pub failed: Vec<ReqId>,
    /// Sent back to the front of the queue, to run alone until they have
    /// computed what the failed step held.
    pub retried: Vec<ReqId>,
}

/// What one step runs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    pub ops: Vec<KvOp>,
    pub items: Vec<StepItem>,
    /// Running requests sent back to the queue (they come back by themselves).
    pub preempted: Vec<ReqId>,
    /// Requests ended by the scheduler; the engine finishes them.
    pub ended: Vec<(ReqId, EndReason)>,
}

impl StepPlan {
    pub fn num_tokens(&self) -> usize {
        self.items.iter().map(|i| i.tokens.len()).sum()
    }
}

/// Engine-wide scheduling counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedStats {
    pub steps: u64,
    pub preemptions: u64,
    pub shifts: u64,
    pub admitted: u64,
}

#[derive(Debug)]
struct Request {
    ns: Namespace,
    /// Every token known: prompt, then generated ones.
    tokens: Vec<TokenId>,
    shift_keep: Option<usize>,
    /// Matches the prefix tree at admission.
    reuse: bool,
    /// Never reads or adds to the prefix tree.
    private: bool,
    /// Low priority: see [`NewRequest::background`].
    background: bool,
    /// Prompt tokens served from the cache at first admission.
    cached: Option<usize>,
    /// Blocks it holds at most (prompt and new tokens, within the context).
    most_blocks: usize,
    /// After a failed step shared with others: it runs alone until its
    /// sequence holds this many computed tokens.
    solo_until: Option<usize>,
    /// Ran out of blocks while running alone: its own cached path pinned
    /// what it needed. The second time, it starts over on an empty cache.
    starved: bool,
    /// Speculative tokens at the end of `tokens` (see
    /// [`Scheduler::push_draft`]).
    draft: usize,
    state: State,
}

#[derive(Debug, Clone, Copy)]
enum State {
    Waiting { since: u64 },
    Running { seq: SeqId, admitted: u64 },
}

/// What a prefix match of `r` may cover: all its tokens but the last (the
/// one whose logits are wanted), when it reads the prefix cache.
fn reusable_of<'a>(cfg: &SchedConfig, r: &'a Request) -> Option<&'a [TokenId]> {
    (cfg.prefix_cache && r.reuse).then(|| &r.tokens[..r.tokens.len() - 1])
}

/// The continuous-batching scheduler over a [`KvCache`].
pub struct Scheduler {
    kv: KvCache,
    cfg: SchedConfig,
    reqs: HashMap<ReqId, Request>,
    /// Front: preempted requests; back: new arrivals.
    waiting: VecDeque<ReqId>,
    /// Admission order.
    running: Vec<ReqId>,
    next_req: u64,
    step: u64,
    admissions: u64,
    stats: SchedStats,
    /// Held for room this step ([`Scheduler::hold_for_room`]).
    held: HashSet<ReqId>,
}

impl Scheduler {
    pub fn new(kv: KvCache, cfg: SchedConfig) -> Scheduler {
        Scheduler {
            kv,
            cfg,
            reqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_req: 0,
            step: 0,
            admissions: 0,
            stats: SchedStats::default(),
            held: HashSet::new(),
        }
    }

    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    /// The cache, for work between steps (defragmentation, sessions).
    pub fn kv_mut(&mut self) -> &mut KvCache {
        &mut self.kv
    }

    pub fn config(&self) -> &SchedConfig {
        &self.cfg
    }

    /// Changes [`SchedConfig::background_tokens`] (the engine adapts it to
    /// what background tokens cost beside the others' work).
    pub fn set_background_tokens(&mut self, n: usize) {
        self.cfg.background_tokens = n.max(1);
    }

    pub fn stats(&self) -> SchedStats {
        self.stats
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// The waiting requests, in queue order.
    pub fn waiting_ids(&self) -> Vec<ReqId> {
        self.waiting.iter().copied().collect()
    }

    /// What a prefix match of `req` may cover at its admission: its
    /// namespace and all its tokens but the last (`None` for a request that
    /// does not read the prefix cache).
    pub fn reusable(&self, req: ReqId) -> Option<(Namespace, &[TokenId])> {
        let r = self.reqs.get(&req)?;
        Some((r.ns, reusable_of(&self.cfg, r)?))
    }

    /// Holds waiting requests `ids` for the next [`Scheduler::schedule`]:
    /// while any request runs, admission stops at one of them (as at a
    /// request whose first chunk does not fit). For requests whose prompts
    /// a lower cache tier holds past the pool's match, with no room in the
    /// pool to take those blocks back yet: admitted now, they would compute
    /// the prompt again and take the room that running requests need. With
    /// nothing running the hold is ignored (no room would come).
    pub fn hold_for_room(&mut self, ids: impl IntoIterator<Item = ReqId>) {
        self.held = ids.into_iter().collect();
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Every token the request has so far.
    pub fn tokens(&self, req: ReqId) -> Result<&[TokenId], SchedError> {
        Ok(&self.get(req)?.tokens)
    }

    /// Prompt tokens served from the cache when the request was first
    /// admitted (`None` before).
    pub fn cached_tokens(&self, req: ReqId) -> Result<Option<usize>, SchedError> {
        Ok(self.get(req)?.cached)
    }

    fn get(&self, req: ReqId) -> Result<&Request, SchedError> {
        self.reqs.get(&req).ok_or(SchedError::UnknownRequest(req))
    }

    /// Queues a request, or refuses one that can never run.
    pub fn add(&mut self, r: NewRequest) -> Result<ReqId, SchedError> {
        let ctx = self.cfg.context_length;
        if r.prompt.is_empty() {
            return Err(SchedError::EmptyPrompt);
        }
        if r.prompt.len() > ctx {
            return Err(SchedError::PromptTooLong {
                tokens: r.prompt.len(),
                context: ctx,
            });
        }
        let most = r.prompt.len().saturating_add(r.max_new_tokens).min(ctx);
        let needed = self.kv.blocks_for(most);
        let total = self.kv.pool().num_blocks();
        if needed > total {
            return Err(SchedError::TooLarge {
                needed,
                total,
                block_size: self.kv.block_size(),
            });
        }
        let id = self.new_id();
        self.reqs.insert(
            id,
            Request {
                ns: r.namespace,
                tokens: r.prompt,
                shift_keep: r.shift_keep,
                reuse: r.reuse_prefix && !r.private,
                private: r.private,
                background: r.background,
                cached: None,
                most_blocks: needed,
                solo_until: None,
                starved: false,
                draft: 0,
                state: State::Waiting { since: self.step },
            },
        );
        self.waiting.push_back(id);
        Ok(id)
    }

    fn new_id(&mut self) -> ReqId {
        let id = ReqId(self.next_req);
        self.next_req += 1;
        id
    }

    /// Plans the next step.
    pub fn schedule(&mut self) -> Result<StepPlan, SchedError> {
        self.step += 1;
        self.stats.steps += 1;
        let mut plan = StepPlan::default();
        let mut budget = self.cfg.max_batch_tokens.max(1);
        if let Some(id) = self.solo_candidate() {
            self.held.clear();
            self.schedule_solo(id, &mut budget, &mut plan)?;
            self.place_drafts(&mut budget, &mut plan)?;
            return Ok(plan);
        }
        let mut i = 0;
        while i < self.running.len() && budget > 0 && plan.items.len() < self.cfg.max_running {
            let id = self.running[i];
            let mut part = self.share(id, budget);
            let before = part;
            let placed = self.schedule_running(id, &mut part, &mut plan)?;
            budget -= before - part;
            match placed {
                Placed::Yes | Placed::Ended => i += 1,
                // The victim was the newest: either this one (now gone) or
                // one behind it; this one is retried.
                Placed::Preempted(victim) => {
                    plan.preempted.push(victim);
                    if victim == id {
                        break;
                    }
                }
            }
        }
        for (id, _) in &plan.ended {
            self.running.retain(|r| r != id);
        }
        if plan.preempted.is_empty() {
            let order = self.admission_order();
            self.admit(order, &mut budget, &mut plan)?;
        }
        self.held.clear();
        self.place_drafts(&mut budget, &mut plan)?;
        Ok(plan)
    }

    /// The second pass of a step: each placed item that ends with a
    /// sampled token followed by a draft ([`Scheduler::push_draft`]) gets
    /// the draft's tokens appended, as far as what is left of the budget,
    /// the context and the request's own blocks allows, and only where the
    /// pool has room: a guess never costs another request its place. A
    /// step that preempted drops every draft in it. What does not fit is
    /// dropped (the request's sampled token still runs).
    fn place_drafts(&mut self, budget: &mut usize, plan: &mut StepPlan) -> Result<(), SchedError> {
        let bs = self.kv.block_size();
        for i in 0..plan.items.len() {
            let (id, seq) = (plan.items[i].req, plan.items[i].seq);
            let Some(r) = self.reqs.get(&id) else {
                continue;
            };
            let len = plan.items[i].start + plan.items[i].tokens.len();
            if r.draft == 0 || !plan.items[i].wants_logits || len + r.draft != r.tokens.len() {
                continue;
            }
            let room = if plan.preempted.is_empty() {
                (*budget)
                    .min(self.cfg.context_length.saturating_sub(len))
                    .min((r.most_blocks * bs).saturating_sub(len))
                    .min(r.draft)
            } else {
                0
            };
            // The draft cut to `room` (still a draft).
            self.drop_draft(id, room)?;
            if room == 0 {
                continue;
            }
            self.reqs.get_mut(&id).expect("known").draft = room;
            let draft = self.reqs[&id].tokens[len..].to_vec();
            let Admission::Ok(a) = self.kv.append(seq, &draft)? else {
                self.drop_draft(id, 0)?;
                continue;
            };
            *budget -= room;
            let sliding_table = self.copies_and_window(plan, seq, a.copies, a.sliding_copies)?;
            let item = &mut plan.items[i];
            item.tokens.extend_from_slice(&draft);
            item.slots.extend(a.slots);
            item.sliding_slots.extend(a.sliding_slots);
            item.block_table = self.kv.sequence(seq)?.block_table().to_vec();
            item.sliding_table = sliding_table;
            item.draft = room;
        }
        Ok(())
    }

    /// The part of `budget` request `id` may take this step: all of it,
    /// or for a background request beside other requests' work, at most
    /// `background_tokens`.
    fn share(&self, id: ReqId, budget: usize) -> usize {
        let others = |r: &ReqId| *r != id && !self.reqs[r].background;
        if self.reqs[&id].background
            && (self.running.iter().any(others) || self.waiting.iter().any(others))
        {
            budget.min(self.cfg.background_tokens.max(1))
        } else {
            budget
        }
    }

    /// A request that must run alone: a running one first, else the first
    /// waiting one.
    fn solo_candidate(&self) -> Option<ReqId> {
        let solo = |r: &&ReqId| self.reqs[*r].solo_until.is_some();
        self.running
            .iter()
            .find(solo)
            .or_else(|| self.waiting.iter().find(solo))
            .copied()
    }

    /// A step of `id` alone. Running requests that hold the blocks it needs
    /// are preempted, newest first.
    fn schedule_solo(
        &mut self,
        id: ReqId,
        budget: &mut usize,
        plan: &mut StepPlan,
    ) -> Result<(), SchedError> {
        if self.running.contains(&id) {
            if let Placed::Preempted(victim) = self.schedule_running(id, budget, plan)? {
                plan.preempted.push(victim);
            }
            for (ended, _) in &plan.ended {
                self.running.retain(|r| r != ended);
            }
            return Ok(());
        }
        loop {
            self.admit(vec![id], budget, plan)?;
            let placed = !plan.items.is_empty() || !plan.ended.is_empty();
            if placed || self.running.is_empty() {
                return Ok(());
            }
            let victim = self.preempt_newest()?;
            plan.preempted.push(victim);
        }
    }

    /// A context shift of a sequence of `len` computed tokens in a context
    /// of `context`: the tokens it keeps at the front (`keep`, at most half
    /// the context) and how many after them it drops (half the rest, at
    /// least one). Running and started over alike.
    fn shift_sizes(context: usize, keep: usize, len: usize) -> (usize, usize) {
        let n_keep = keep.min(context / 2);
        (n_keep, ((len - n_keep) / 2).max(1))
    }

    /// Schedules one running request's next tokens.
    fn schedule_running(
        &mut self,
        id: ReqId,
        budget: &mut usize,
        plan: &mut StepPlan,
    ) -> Result<Placed, SchedError> {
        let State::Running { seq, .. } = self.reqs[&id].state else {
            unreachable!("running list holds running requests")
        };
        let mut len = self.kv.sequence(seq)?.len();
        let known = self.reqs[&id].tokens.len();
        if len == known {
            // Nothing to compute until the engine pushes a token.
            return Ok(Placed::Yes);
        }
        if len >= self.cfg.context_length {
            let Some(keep) = self.reqs[&id].shift_keep else {
                plan.ended.push((id, EndReason::ContextFull));
                return Ok(Placed::Ended);
            };
            let (n_keep, n_discard) = Self::shift_sizes(self.cfg.context_length, keep, len);
            let shift = match self.kv.plan_shift(seq, n_keep, n_discard) {
                // The sliding-window layers no longer hold what it keeps
                // (it was matched from the cache with those positions
                // evicted): it ends as if shifting were off.
                Err(KvError::ShiftLosesWindow { .. }) => {
                    plan.ended.push((id, EndReason::ContextFull));
                    return Ok(Placed::Ended);
                }
                other => other?,
            };
            match shift {
                Admission::Ok(shift) => {
                    self.reqs
                        .get_mut(&id)
                        .expect("known")
                        .tokens
                        .drain(n_keep..n_keep + n_discard);
                    self.stats.shifts += 1;
                    plan.ops.push(KvOp::Shift {
                        req: id,
                        plan: shift,
                    });
                    len -= n_discard;
                }
                Admission::Never { needed, total } => {
                    plan.ended
                        .push((id, EndReason::OutOfKvMemory { needed, total }));
                    return Ok(Placed::Ended);
                }
                Admission::Later { needed, .. }
                    if self.running.len() == 1 && self.reqs[&id].starved =>
                {
                    // Alone, started over once on an empty cache, and the
                    // shift's copies still do not fit: it would start over
                    // forever.
                    let total = self.kv.pool().num_blocks();
                    plan.ended
                        .push((id, EndReason::OutOfKvMemory { needed, total }));
                    return Ok(Placed::Ended);
                }
                Admission::Later { .. } => {
                    return self.preempt_newest().map(Placed::Preempted);
                }
            }
        }
        // A draft waits for the second pass (see `place_drafts`): here the
        // sampled token before it goes as any decode.
        let req = &self.reqs[&id];
        let known = req.tokens.len() - req.draft;
        let end = known.min(len.saturating_add(*budget));
        let chunk = req.tokens[len..end].to_vec();
        match self.kv.append(seq, &chunk)? {
            Admission::Ok(a) => {
                *budget -= chunk.len();
                self.place(plan, id, seq, len, chunk, a, end == known)?;
                Ok(Placed::Yes)
            }
            Admission::Never { needed, total } => {
                plan.ended
                    .push((id, EndReason::OutOfKvMemory { needed, total }));
                Ok(Placed::Ended)
            }
            Admission::Later { .. } => self.preempt_newest().map(Placed::Preempted),
        }
    }

    /// An append's copies into the plan; the sequence's sliding-window
    /// table after it (empty without sliding layers).
    fn copies_and_window(
        &self,
        plan: &mut StepPlan,
        seq: SeqId,
        copies: Vec<tessera_kv::CopyOp>,
        sliding_copies: Vec<tessera_kv::CopyOp>,
    ) -> Result<Vec<Option<BlockId>>, SchedError> {
        if !copies.is_empty() {
            plan.ops.push(KvOp::Copy(copies));
        }
        if !sliding_copies.is_empty() {
            plan.ops.push(KvOp::CopySliding(sliding_copies));
        }
        Ok(if self.kv.window().is_some() {
            self.kv.sliding_table(seq)?
        } else {
            Vec::new()
        })
    }

    /// Adds an admitted chunk to the plan: its copies, then its item.
    #[allow(clippy::too_many_arguments)]
    fn place(
        &self,
        plan: &mut StepPlan,
        req: ReqId,
        seq: SeqId,
        start: usize,
        tokens: Vec<TokenId>,
        admitted: AppendPlan,
        wants_logits: bool,
    ) -> Result<(), SchedError> {
        let sliding_table =
            self.copies_and_window(plan, seq, admitted.copies, admitted.sliding_copies)?;
        plan.items.push(StepItem {
            req,
            seq,
            start,
            slots: admitted.slots,
            block_table: self.kv.sequence(seq)?.block_table().to_vec(),
            sliding_slots: admitted.sliding_slots,
            sliding_table,
            wants_logits,
            tokens,
            draft: 0,
        });
        Ok(())
    }

    /// Sends the most recently admitted running request back to the queue.
    fn preempt_newest(&mut self) -> Result<ReqId, SchedError> {
        let victim = *self
            .running
            .iter()
            .max_by_key(|r| match self.reqs[r].state {
                State::Running { admitted, .. } => admitted,
                State::Waiting { .. } => 0,
            })
            .expect("a running request asked for room");
        self.running.retain(|&r| r != victim);
        self.drop_draft(victim, 0)?;
        let alone = self.running.is_empty();
        if alone && self.reqs[&victim].starved {
            // Alone and out of room again: what pins the missing blocks is
            // cached content on its own path (partial blocks of shared
            // ancestors, which its cached tokens keep alive). Start it over
            // on an empty cache, where it fits.
            if let State::Running { seq, .. } = self.reqs[&victim].state {
                self.kv.free_sequence(seq)?;
            }
            self.kv.clear_cache()?;
        } else {
            // Its work stays cached; readmission evicts what it needs, least
            // recently used first.
            self.release(victim)?;
        }
        let r = self.reqs.get_mut(&victim).expect("known");
        r.starved |= alone;
        r.state = State::Waiting { since: self.step };
        self.waiting.push_front(victim);
        self.stats.preemptions += 1;
        Ok(victim)
    }

    /// Caches what `req` computed (when caching) and frees its sequence. A
    /// sequence holding tokens whose K/V was never written (a step planned
    /// and not carried out) is freed without entering the tree.
    fn release(&mut self, req: ReqId) -> Result<(), SchedError> {
        if let State::Running { seq, .. } = self.get(req)?.state {
            let s = self.kv.sequence(seq)?;
            let computed = s.num_computed() == s.len();
            let cached = if self.cfg.prefix_cache && computed && !self.get(req)?.private {
                self.kv.insert_sequence(seq).map(drop)
            } else {
                Ok(())
            };
            // Freed whatever the insert said: a request never keeps blocks
            // after it is released.
            self.kv.free_sequence(seq)?;
            cached?;
        }
        Ok(())
    }

    /// Admits waiting requests in cache-aware order while budget and blocks
    /// allow.
    fn admit(
        &mut self,
        order: Vec<ReqId>,
        budget: &mut usize,
        plan: &mut StepPlan,
    ) -> Result<(), SchedError> {
        for id in order {
            let solo = self.reqs[&id].solo_until.is_some();
            if *budget == 0 || (self.running.len() >= self.cfg.max_running && !solo) {
                break;
            }
            if !solo && !self.running.is_empty() && self.held.contains(&id) {
                // Waits for room, as `Admission::Later` below.
                break;
            }
            let ctx = self.cfg.context_length;
            let r = self.reqs.get_mut(&id).expect("known");
            if r.tokens.len() > ctx {
                // Preempted with a sampled token past a full context: it
                // ends, or shifts, as it would have had it kept running
                // (the shift made on its tokens: its K/V is computed again).
                let Some(keep) = r.shift_keep else {
                    self.waiting.retain(|&w| w != id);
                    plan.ended.push((id, EndReason::ContextFull));
                    continue;
                };
                while r.tokens.len() > ctx {
                    let (n_keep, n_discard) = Self::shift_sizes(ctx, keep, r.tokens.len() - 1);
                    r.tokens.drain(n_keep..n_keep + n_discard);
                    self.stats.shifts += 1;
                }
            }
            let r = &self.reqs[&id];
            let reusable = reusable_of(&self.cfg, r).unwrap_or_default();
            // A running request is computing more of this prompt than the
            // cache holds: wait for it rather than compute it twice.
            if self.cfg.prefix_cache
                && r.reuse
                && !solo
                && self.in_flight(reusable) > self.kv.cached_prefix_len(r.ns, reusable)
            {
                continue;
            }
            let (seq, cached) = self.kv.add_sequence(r.ns, reusable);
            if let Some(keep) = r.shift_keep {
                // A context shift keeps these: their sliding-window K/V stays.
                self.kv
                    .keep_front(seq, keep.min(self.cfg.context_length / 2))?;
            }
            let end = r
                .tokens
                .len()
                .min(cached.saturating_add(self.share(id, *budget)));
            let chunk = r.tokens[cached..end].to_vec();
            match self.kv.append(seq, &chunk)? {
                Admission::Ok(a) => {
                    *budget -= chunk.len();
                    self.waiting.retain(|&w| w != id);
                    self.running.push(id);
                    self.admissions += 1;
                    self.stats.admitted += 1;
                    let r = self.reqs.get_mut(&id).expect("known");
                    r.state = State::Running {
                        seq,
                        admitted: self.admissions,
                    };
                    r.cached.get_or_insert(cached);
                    let last = end == r.tokens.len();
                    self.place(plan, id, seq, cached, chunk, a, last)?;
                }
                Admission::Never { needed, total } => {
                    self.kv.free_sequence(seq)?;
                    self.waiting.retain(|&w| w != id);
                    plan.ended
                        .push((id, EndReason::OutOfKvMemory { needed, total }));
                }
                Admission::Later { needed, free } => {
                    // Not now: it waits for running requests to finish. With
                    // none running, cached blocks (its own match pins some)
                    // hold the room it needs: unpinned, the least recently
                    // used of them go, just enough for the next step.
                    self.kv.free_sequence(seq)?;
                    if self.running.is_empty() {
                        if self.reqs[&id].starved {
                            self.kv.clear_cache()?;
                        } else {
                            self.kv.evict(needed.saturating_sub(free).max(1))?;
                        }
                    }
                    break;
                }
            }
        }
        Ok(())
    }

    /// Background requests after all others; then overdue requests first
    /// (in queue order), then the longest cached prefix, then queue order.
    fn admission_order(&self) -> Vec<ReqId> {
        let mut keyed: Vec<(bool, bool, usize, usize, ReqId)> = self
            .waiting
            .iter()
            .enumerate()
            .map(|(qpos, &id)| {
                let r = &self.reqs[&id];
                let State::Waiting { since } = r.state else {
                    unreachable!("waiting list holds waiting requests")
                };
                let overdue = self.step.saturating_sub(since) > self.cfg.max_wait_steps;
                let hit = reusable_of(&self.cfg, r)
                    .filter(|_| !overdue)
                    .map_or(0, |t| self.kv.cached_prefix_len(r.ns, t));
                (r.background, overdue, hit, qpos, id)
            })
            .collect();
        keyed.sort_by(|a, b| {
            a.0.cmp(&b.0)
                .then(b.1.cmp(&a.1))
                .then(if a.1 { a.3.cmp(&b.3) } else { b.2.cmp(&a.2) })
                .then(a.3.cmp(&b.3))
        });
        keyed.into_iter().map(|k| k.4).collect()
    }

    /// Records that the plan's K/V is written. Prompt chunks that do not
    /// end their prompt enter the prefix tree now, so that requests sharing
    /// the prompt can use them before this one finishes.
    pub fn step_done(&mut self, plan: &StepPlan) -> Result<(), SchedError> {
        for item in &plan.items {
            let computed = item.start + item.tokens.len();
            self.kv.mark_computed(item.seq, computed)?;
            // A draft's tokens are not a prompt's: they never enter the tree
            // here (what is accepted does when the request ends).
            let prefill = item.tokens.len() - item.draft > 1 || !item.wants_logits;
            let private = self.reqs.get(&item.req).is_some_and(|r| r.private);
            if self.cfg.prefix_cache && prefill && !private {
                // The end of a prompt is a point requests resume from.
                if item.wants_logits {
                    self.kv.insert_prompt(item.seq)?;
                } else {
                    self.kv.insert_whole_blocks(item.seq)?;
                }
            }
            if let Some(r) = self.reqs.get_mut(&item.req) {
                if r.solo_until.is_some_and(|until| computed >= until) {
                    r.solo_until = None;
                }
            }
        }
        Ok(())
    }

    /// Undoes a step whose K/V was not (or not wholly) written: nothing of
    /// it is marked computed, and the sequences of its items are freed
    /// without entering the prefix tree, so no block the step may have left
    /// half written can ever be matched. What those sequences computed in
    /// earlier steps stays cached. Requests the scheduler ended in the plan
    /// are left for the engine to finish, as after a good step.
    pub fn abort_step(&mut self, plan: &StepPlan) -> Result<Aborted, SchedError> {
        let alone = plan.items.len() == 1;
        let mut out = Aborted::default();
        for item in &plan.items {
            self.drop_draft(item.req, 0)?;
            let r = self
                .reqs
                .get_mut(&item.req)
                .ok_or(SchedError::UnknownRequest(item.req))?;
            if let State::Running { seq, .. } = r.state {
                self.kv.free_sequence(seq)?;
            }
            r.state = State::Waiting { since: self.step };
            self.running.retain(|&x| x != item.req);
            self.waiting.retain(|&x| x != item.req);
            if alone {
                out.failed.push(item.req);
            } else {
                r.solo_until = Some(item.start + item.tokens.len());
                out.retried.push(item.req);
            }
        }
        // The retried go first, in the order they ran.
        for &id in out.retried.iter().rev() {
            self.waiting.push_front(id);
        }
        Ok(out)
    }

    /// Blocks the pool must keep for the requests it has (the largest any
    /// one of them may hold): a smaller pool would leave one that can never
    /// run.
    pub fn min_blocks(&self) -> usize {
        self.reqs.values().map(|r| r.most_blocks).max().unwrap_or(0)
    }

    /// The longest prefix `tokens` shares with a running request that has
    /// not yet computed it (a prompt being prefilled).
    fn in_flight(&self, tokens: &[TokenId]) -> usize {
        self.running
            .iter()
            .filter_map(|r| {
                let req = &self.reqs[r];
                let State::Running { seq, .. } = req.state else {
                    return None;
                };
                let done = self.kv.sequence(seq).map_or(0, |s| s.num_computed());
                let common = req
                    .tokens
                    .iter()
                    .zip(tokens)
                    .take_while(|(a, b)| a == b)
                    .count();
                (common > done).then_some(common)
            })
            .max()
            .unwrap_or(0)
    }

    /// Appends a sampled token; the next step computes it.
    pub fn push_token(&mut self, req: ReqId, token: TokenId) -> Result<(), SchedError> {
        let r = self
            .reqs
            .get_mut(&req)
            .ok_or(SchedError::UnknownRequest(req))?;
        r.tokens.push(token);
        Ok(())
    }

    /// Appends a sampled token and after it `draft`, tokens guessed to
    /// follow (speculative decoding): the next step computes them all
    /// (the draft shortened to what the step's budget and the context
    /// leave), its item's [`StepItem::draft`] says how many are guesses,
    /// and [`Scheduler::settle_draft`] then keeps what the engine
    /// accepted. Only for a running request whose tokens are all computed.
    pub fn push_draft(
        &mut self,
        req: ReqId,
        token: TokenId,
        draft: &[TokenId],
    ) -> Result<(), SchedError> {
        let r = self.get(req)?;
        let State::Running { seq, .. } = r.state else {
            return Err(SchedError::BadState(req, "only a running request drafts"));
        };
        if r.draft > 0 || self.kv.sequence(seq)?.num_computed() != r.tokens.len() {
            return Err(SchedError::BadState(req, "a draft follows computed tokens"));
        }
        let r = self.reqs.get_mut(&req).expect("known");
        r.tokens.push(token);
        r.tokens.extend_from_slice(draft);
        r.draft = draft.len();
        Ok(())
    }

    /// After the step that computed a draft: keeps its first `accepted`
    /// tokens and drops the rest, from the request and from its sequence
    /// (the blocks past the new end go back to the pool; nothing is
    /// copied). The engine then pushes the token it sampled after them.
    pub fn settle_draft(&mut self, req: ReqId, accepted: usize) -> Result<(), SchedError> {
        self.drop_draft(req, accepted)
    }

    /// Drops a request's draft past its first `keep` tokens (from the
    /// request's tokens and from its sequence, where the draft was
    /// appended).
    fn drop_draft(&mut self, req: ReqId, keep: usize) -> Result<(), SchedError> {
        let r = self
            .reqs
            .get_mut(&req)
            .ok_or(SchedError::UnknownRequest(req))?;
        if r.draft == 0 {
            return Ok(());
        }
        let n = r.tokens.len() - r.draft + keep.min(r.draft);
        r.tokens.truncate(n);
        r.draft = 0;
        if let State::Running { seq, .. } = r.state {
            if self.kv.sequence(seq)?.len() > n {
                self.kv.truncate(seq, n)?;
            }
        }
        Ok(())
    }

    /// A new request continuing `req` from the same state (parallel
    /// samples): it shares every block; the next append copies the shared
    /// tail. Only between steps, with `req` running and fully computed.
    pub fn fork(&mut self, req: ReqId) -> Result<ReqId, SchedError> {
        let r = self.get(req)?;
        let State::Running { seq, .. } = r.state else {
            return Err(SchedError::BadState(req, "only a running request forks"));
        };
        if self.kv.sequence(seq)?.len() != r.tokens.len() {
            return Err(SchedError::BadState(req, "fork before pushing a token"));
        }
        let (ns, tokens, shift_keep, cached) = (r.ns, r.tokens.clone(), r.shift_keep, r.cached);
        let (most_blocks, solo_until, reuse) = (r.most_blocks, r.solo_until, r.reuse);
        let (private, background) = (r.private, r.background);
        let child_seq = self.kv.fork(seq)?;
        let child = Request {
            ns,
            tokens,
            shift_keep,
            reuse,
            private,
            background,
            cached,
            most_blocks,
            solo_until,
            starved: false,
            draft: 0,
            state: State::Running {
                seq: child_seq,
                admitted: self.admissions + 1,
            },
        };
        self.admissions += 1;
        let id = self.new_id();
        self.reqs.insert(id, child);
        self.running.push(id);
        Ok(id)
    }

    /// Ends a request: what it computed goes into the prefix tree (when
    /// caching), its blocks are freed. Also cancels a waiting request.
    pub fn finish(&mut self, req: ReqId) -> Result<Vec<TokenId>, SchedError> {
        self.drop_draft(req, 0)?;
        let released = self.release(req);
        self.running.retain(|&r| r != req);
        self.waiting.retain(|&r| r != req);
        let r = self
            .reqs
            .remove(&req)
            .ok_or(SchedError::UnknownRequest(req))?;
        released?;
        Ok(r.tokens)
    }

    /// Between steps, slots for K/V that arrives whole from outside (a
    /// session file): a sequence of `namespace` holding `tokens`, its
    /// cached prefix reused and the rest given slots, evicting cached
    /// blocks if need be (no room is an error, not a wait: nothing else is
    /// held back for it). The sliding-window layers get slots for positions
    /// from `sliding_from` on. The caller applies the plan's copies, writes
    /// the rows, then calls [`Scheduler::end_placement`].
    pub fn place_kv(
        &mut self,
        namespace: Namespace,
        tokens: &[TokenId],
        sliding_from: usize,
    ) -> Result<Placement, SchedError> {
        let (seq, cached) = self.kv.add_sequence(namespace, tokens);
        let plan = match self.kv.append_from(seq, &tokens[cached..], sliding_from) {
            Ok(Admission::Ok(plan)) => plan,
            other => {
                self.kv.free_sequence(seq)?;
                return Err(match other {
                    Err(e) => e.into(),
                    Ok(Admission::Later { needed, .. } | Admission::Never { needed, .. }) => {
                        SchedError::TooLarge {
                            needed,
                            total: self.kv.pool().num_blocks(),
                            block_size: self.kv.block_size(),
                        }
                    }
                    Ok(Admission::Ok(_)) => unreachable!("matched above"),
                });
            }
        };
        Ok(Placement { seq, cached, plan })
    }

    /// Ends a [`Scheduler::place_kv`]: when `written`, its tokens count as
    /// computed and enter the prefix tree (the number of tokens new to the
    /// tree is returned); either way its sequence is freed.
    pub fn end_placement(&mut self, p: Placement, written: bool) -> Result<usize, SchedError> {
        let mut inserted = 0;
        if written {
            let n = self.kv.sequence(p.seq)?.len();
            self.kv.mark_computed(p.seq, n)?;
            inserted = self.kv.insert_sequence(p.seq)?.inserted;
        }
        self.kv.free_sequence(p.seq)?;
        Ok(inserted)
    }
}

/// Slots given by [`Scheduler::place_kv`] to K/V that arrives whole.
#[derive(Debug)]
pub struct Placement {
    pub seq: SeqId,
    /// Leading tokens the prefix tree already held (their rows are not
    /// written again).
    pub cached: usize,
    /// Copies to apply first, and the slots of the tokens after `cached`.
    pub plan: AppendPlan,
}

enum Placed {
    Yes,
    Ended,
    Preempted(ReqId),
}

#[cfg(test)]
mod tests;
