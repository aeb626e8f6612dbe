//! The worker: owns the scheduler, the K/V tensors and the state of every
//! request, and runs the continuous-batching loop on its own thread.
//!
//! ```text
//! loop:
//!   commands (submit, stats, defragment, sessions, …) between steps
//!   plan  = Scheduler::schedule()       decodes + prefill chunks, in budget
//!   apply plan.ops                      copy_blocks, shift_kv (RoPE K-shift)
//!   logits = forward(all items at once) write_kv + paged_attention
//!   sample each item that wants logits  stop rules, events to its stream
//!   push_token / finish                 finished sequences enter the tree
//! idle: defragment past the threshold, wait for a command
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Tensor};
use tessera_kernels::{copy_blocks, shift_kv, write_kv, Rotation};
use tessera_kv::{
    token_ids, Admission, AppendPlan, CopyOp, KvCache, KvConfig, Namespace, SeqId, ShiftPlan,
    TokenId,
};
use tessera_model::{Batch, LayerKv, Model, StreamDecoder};
use tessera_sched::{
    EndReason, KvOp, NewRequest, ReqId, SchedConfig, SchedError, Scheduler, StepPlan,
};
use tracing::{debug_span, warn};

use crate::engine::{
    held_back, Completion, ContextShift, EngineConfig, EngineStats, FinishReason, GenerateRequest,
    Timings, Usage,
};
use crate::sampler::Sampler;
use crate::snapshot::{KvSnapshot, LayerBytes};
use crate::stream::Event;
use crate::{EngineError, Result};

/// What the handles ask of the worker.
pub(crate) enum Command {
    Submit {
        ids: Vec<u32>,
        req: Box<GenerateRequest>,
        events: mpsc::Sender<Event>,
        cancel: Arc<AtomicBool>,
        reply: mpsc::Sender<Result<()>>,
    },
    Stats(mpsc::Sender<EngineStats>),
    ClearCache(mpsc::Sender<Result<usize>>),
    Defragment(mpsc::Sender<Result<usize>>),
    /// New number of blocks.
    Resize(usize, mpsc::Sender<Result<usize>>),
    /// The K/V of these tokens (computed if not cached).
    Export(Vec<u32>, mpsc::Sender<Result<KvSnapshot>>),
    /// Every cached path of the prefix tree.
    ExportCache(mpsc::Sender<Result<Vec<KvSnapshot>>>),
    /// Into the prefix tree; answers the tokens inserted.
    Import(Vec<KvSnapshot>, mpsc::Sender<Result<usize>>),
    Shutdown,
}

/// One request as submitted (shared by its samples).
struct Group {
    req: Box<GenerateRequest>,
    prompt: Vec<u32>,
    events: mpsc::Sender<Event>,
    cancel: Arc<AtomicBool>,
    submitted: Instant,
}

/// One sample being generated.
struct Active {
    group: Arc<Group>,
    index: usize,
    /// The samples of `n > 1` are forked at the first logits.
    fork_pending: bool,
    sampler: Sampler,
    decoder: StreamDecoder,
    history: Vec<u32>,
    out: Vec<u32>,
    text: String,
    emitted: usize,
    started: Option<Instant>,
    first_token: Option<Instant>,
    cached: usize,
}

impl Active {
    fn new(group: Arc<Group>, index: usize) -> Active {
        let mut sampling = group.req.sampling.clone();
        sampling.seed = sampling.seed.wrapping_add(index as u64);
        Active {
            fork_pending: index == 0 && group.req.n > 1,
            sampler: Sampler::new(sampling),
            decoder: StreamDecoder::default(),
            history: group.prompt.clone(),
            out: Vec::new(),
            text: String::new(),
            emitted: 0,
            started: None,
            first_token: None,
            cached: 0,
            index,
            group,
        }
    }

    fn send_text(&self, id: u32, text: &str) {
        let _ = self.group.events.send(Event::Token {
            index: self.index,
            id,
            text: text.to_string(),
        });
    }
}

/// One sequence's part of a forward pass.
struct Part<'a> {
    tokens: &'a [TokenId],
    start: usize,
    slots: Vec<u32>,
    table: Vec<u32>,
    logits: bool,
}

pub(crate) struct Core {
    model: Arc<Model>,
    sched: Scheduler,
    cache: Vec<LayerKv>,
    ns: Namespace,
    cfg: EngineConfig,
    active: HashMap<ReqId, Active>,
    totals: EngineStats,
}

fn sched_error(e: SchedError) -> EngineError {
    match e {
        SchedError::EmptyPrompt => EngineError::EmptyPrompt,
        SchedError::PromptTooLong { tokens, context } => {
            EngineError::PromptTooLong { tokens, context }
        }
        SchedError::TooLarge {
            needed,
            total,
            block_size,
        } => EngineError::OutOfKvMemory {
            needed,
            total,
            block_size,
        },
        SchedError::Kv(e) => EngineError::Kv(e),
        other => EngineError::Invalid(other.to_string()),
    }
}

impl Core {
    pub(crate) fn new(
        model: Arc<Model>,
        cfg: &EngineConfig,
        ctx: usize,
        per_block: usize,
    ) -> Result<Core> {
        let num_blocks = cfg.kv_memory / per_block.max(1);
        if num_blocks == 0 {
            return Err(EngineError::KvBudgetTooSmall {
                bytes: cfg.kv_memory,
                block_size: cfg.block_size,
                per_block,
            });
        }
        let kv = KvCache::new(KvConfig {
            num_blocks,
            block_size: cfg.block_size,
        })?;
        let cache = model
            .llama
            .new_cache(num_blocks, cfg.block_size, cfg.cache_dtype.dtype())?;
        let sched = Scheduler::new(
            kv,
            SchedConfig {
                max_batch_tokens: cfg.prefill_chunk.max(1),
                max_running: cfg.max_running.max(1),
                max_wait_steps: 64,
                prefix_cache: cfg.prefix_cache,
                context_length: ctx,
            },
        );
        Ok(Core {
            ns: Namespace(model.fingerprint),
            model,
            sched,
            cache,
            cfg: cfg.clone(),
            active: HashMap::new(),
            totals: EngineStats::default(),
        })
    }

    /// The worker thread's loop.
    pub(crate) fn run(mut self, rx: mpsc::Receiver<Command>) {
        loop {
            // Commands first, between steps; block only when idle.
            let cmd = if self.sched.has_work() {
                match rx.try_recv() {
                    Ok(c) => Some(c),
                    Err(mpsc::TryRecvError::Empty) => None,
                    Err(mpsc::TryRecvError::Disconnected) => Some(Command::Shutdown),
                }
            } else {
                self.idle();
                Some(rx.recv().unwrap_or(Command::Shutdown))
            };
            match cmd {
                Some(Command::Shutdown) => return self.shutdown(),
                Some(c) => self.handle(c),
                None => self.step(),
            }
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit {
                ids,
                req,
                events,
                cancel,
                reply,
            } => {
                let _ = reply.send(self.submit(ids, req, events, cancel));
            }
            Command::Stats(reply) => {
                let _ = reply.send(self.stats());
            }
            Command::ClearCache(reply) => {
                let _ = reply.send(self.sched.kv_mut().clear_cache().map_err(Into::into));
            }
            Command::Defragment(reply) => {
                let _ = reply.send(self.defragment());
            }
            Command::Resize(blocks, reply) => {
                let _ = reply.send(self.resize(blocks));
            }
            Command::Export(ids, reply) => {
                let _ = reply.send(self.export(&ids));
            }
            Command::ExportCache(reply) => {
                let _ = reply.send(self.export_cache());
            }
            Command::Import(snaps, reply) => {
                let _ = reply.send(self.import(&snaps));
            }
            Command::Shutdown => unreachable!("handled by run"),
        }
    }

    fn stats(&self) -> EngineStats {
        let s = self.sched.stats();
        EngineStats {
            kv: self.sched.kv().stats(),
            preemptions: s.preemptions,
            ..self.totals
        }
    }

    fn submit(
        &mut self,
        ids: Vec<u32>,
        req: Box<GenerateRequest>,
        events: mpsc::Sender<Event>,
        cancel: Arc<AtomicBool>,
    ) -> Result<()> {
        let shift_keep = match req.context_shift {
            ContextShift::Off => None,
            ContextShift::Keep(n) => Some(n),
        };
        let id = self
            .sched
            .add(NewRequest {
                namespace: self.ns,
                prompt: token_ids(&ids),
                max_new_tokens: req.max_tokens,
                shift_keep,
            })
            .map_err(sched_error)?;
        let group = Arc::new(Group {
            req,
            prompt: ids,
            events,
            cancel,
            submitted: Instant::now(),
        });
        self.active.insert(id, Active::new(group, 0));
        Ok(())
    }

    /// One step of the batch.
    fn step(&mut self) {
        let cancelled: Vec<ReqId> = self
            .active
            .iter()
            .filter(|(_, a)| a.group.cancel.load(Ordering::Relaxed))
            .map(|(&id, _)| id)
            .collect();
        for id in cancelled {
            self.finish(id, FinishReason::Cancelled);
        }
        if !self.sched.has_work() {
            return;
        }
        let plan = match debug_span!("schedule").in_scope(|| self.sched.schedule()) {
            Ok(p) => p,
            Err(e) => return self.fail_all(&sched_error(e)),
        };
        self.totals.steps += 1;
        let now = Instant::now();
        for item in &plan.items {
            if let Some(a) = self.active.get_mut(&item.req) {
                a.started.get_or_insert(now);
            }
        }
        let logits = match self.execute(&plan) {
            Ok(l) => l,
            Err(e) => return self.fail_all(&e),
        };
        if let Err(e) = self.sched.step_done(&plan) {
            return self.fail_all(&sched_error(e));
        }
        for &(req, EndReason::ContextFull) in &plan.ended {
            self.finish(req, FinishReason::Length);
        }
        let _span = debug_span!("sample").entered();
        let wanting = plan.items.iter().filter(|i| i.wants_logits);
        for (item, row) in wanting.zip(logits) {
            if let Err(e) = self.on_logits(item.req, &row) {
                self.fail(item.req, &e);
            }
        }
    }

    /// Applies the plan's KV operations and runs the forward pass; returns
    /// the logits of the items that want them, in order.
    fn execute(&self, plan: &StepPlan) -> Result<Vec<Vec<f32>>> {
        let _span = debug_span!("execute", tokens = plan.num_tokens()).entered();
        for op in &plan.ops {
            match op {
                KvOp::Copy(copies) => self.apply_copies(copies)?,
                KvOp::Shift { plan, .. } => self.apply_shift(plan)?,
            }
        }
        let parts: Vec<Part> = plan
            .items
            .iter()
            .map(|i| Part {
                tokens: &i.tokens,
                start: i.start,
                slots: i.slots.iter().map(|s| s.0).collect(),
                table: i.block_table.iter().map(|b| b.0).collect(),
                logits: i.wants_logits,
            })
            .collect();
        self.forward(&parts)
    }

    fn forward(&self, parts: &[Part]) -> Result<Vec<Vec<f32>>> {
        if parts.is_empty() {
            return Ok(Vec::new());
        }
        let max_blocks = parts.iter().map(|p| p.table.len()).max().unwrap_or(0);
        let (mut tokens, mut positions, mut slots, mut token_seq) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut tables = Vec::with_capacity(parts.len() * max_blocks);
        let mut logits_for = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            tokens.extend(p.tokens.iter().map(|t| t.0));
            positions.extend((p.start..p.start + p.tokens.len()).map(|x| x as u32));
            slots.extend_from_slice(&p.slots);
            token_seq.extend(std::iter::repeat_n(i as u32, p.tokens.len()));
            tables.extend_from_slice(&p.table);
            tables.extend(std::iter::repeat_n(0, max_blocks - p.table.len()));
            if p.logits {
                logits_for.push(tokens.len() as u32 - 1);
            }
        }
        let batch = Batch {
            tokens: &tokens,
            positions: &positions,
            slots: &slots,
            token_seq: &token_seq,
            block_tables: &tables,
            max_blocks,
            block_size: self.sched.kv().block_size(),
            logits_for: &logits_for,
        };
        let logits = self.model.llama.forward(&batch, &self.cache)?;
        if logits_for.is_empty() {
            return Ok(Vec::new());
        }
        Ok(logits.to_vec2::<f32>()?)
    }

    fn apply_shift(&self, plan: &ShiftPlan) -> Result<()> {
        self.apply_copies(&plan.copies)?;
        let moves: Vec<(u32, u32)> = plan.moves.iter().map(|m| (m.src.0, m.dst.0)).collect();
        let rotation = Rotation {
            style: self.model.config().rope_style,
            inv_freq: self.model.llama.inv_freq().to_vec(),
            delta: plan.position_delta,
        };
        for layer in &self.cache {
            shift_kv(&layer.k, &layer.v, &moves, &rotation)?;
        }
        Ok(())
    }

    fn apply_copies(&self, copies: &[CopyOp]) -> Result<()> {
        if copies.is_empty() {
            return Ok(());
        }
        let pairs: Vec<(u32, u32)> = copies.iter().map(|c| (c.src.0, c.dst.0)).collect();
        for layer in &self.cache {
            copy_blocks(&layer.k, &pairs)?;
            copy_blocks(&layer.v, &pairs)?;
        }
        Ok(())
    }

    /// Samples the next token of `req` (and of its forks, the first time).
    fn on_logits(&mut self, req: ReqId, logits: &[f32]) -> Result<()> {
        let Some(a) = self.active.get_mut(&req) else {
            return Ok(());
        };
        let mut ids = vec![req];
        if std::mem::take(&mut a.fork_pending) {
            a.cached = self.sched.cached_tokens(req).ok().flatten().unwrap_or(0);
            let group = a.group.clone();
            for index in 1..group.req.n {
                let child = self.sched.fork(req).map_err(sched_error)?;
                let mut c = Active::new(group.clone(), index);
                c.started = self.active[&req].started;
                self.active.insert(child, c);
                ids.push(child);
            }
        }
        for id in ids {
            self.advance(id, logits)?;
        }
        Ok(())
    }

    /// Samples one token for `id`, streams its text, and either queues it
    /// for the next step or finishes the sample.
    fn advance(&mut self, id: ReqId, logits: &[f32]) -> Result<()> {
        let model = self.model.clone();
        let tok = &model.tokenizer;
        let a = self.active.get_mut(&id).expect("active");
        // The request is shared with the other samples: no per-token copy.
        let group = a.group.clone();
        let req = &group.req;
        if a.out.len() >= req.max_tokens {
            self.finish(id, FinishReason::Length);
            return Ok(());
        }
        let t = a.sampler.sample(logits, &a.history);
        if a.first_token.is_none() {
            a.first_token = Some(Instant::now());
            a.cached = self.sched.cached_tokens(id).ok().flatten().unwrap_or(0);
        }
        if tok.is_eog(t) && !req.ignore_eos {
            self.finish(id, FinishReason::Stop);
            return Ok(());
        }
        a.out.push(t);
        a.history.push(t);
        if let Some(piece) = a.decoder.push(tok, t)? {
            a.text.push_str(&piece);
        }
        if let Some(at) = req
            .stop
            .iter()
            .filter_map(|s| a.text.find(s.as_str()))
            .min()
        {
            a.text.truncate(at);
            a.send_text(t, &a.text[a.emitted.min(at)..]);
            a.emitted = a.text.len();
            self.finish(id, FinishReason::StopString);
            return Ok(());
        }
        let safe = a.text.len() - held_back(&a.text, &req.stop);
        if safe > a.emitted || a.text.is_empty() {
            a.send_text(t, &a.text[a.emitted..safe]);
        } else {
            a.send_text(t, "");
        }
        a.emitted = safe.max(a.emitted);
        if a.out.len() >= req.max_tokens {
            self.finish(id, FinishReason::Length);
            return Ok(());
        }
        self.sched.push_token(id, TokenId(t)).map_err(sched_error)?;
        Ok(())
    }

    /// Ends a sample: its sequence enters the prefix tree (when caching),
    /// its blocks are freed, and its completion goes to the stream.
    fn finish(&mut self, id: ReqId, reason: FinishReason) {
        let Some(mut a) = self.active.remove(&id) else {
            return;
        };
        if a.first_token.is_none() {
            a.cached = self.sched.cached_tokens(id).ok().flatten().unwrap_or(0);
        }
        if let Err(e) = self.sched.finish(id) {
            warn!("finishing {id}: {e}");
        }
        let tok = &self.model.tokenizer;
        if reason != FinishReason::StopString {
            if let Ok(Some(rest)) = a.decoder.finish(tok) {
                a.text.push_str(&rest);
            }
            if a.emitted < a.text.len() {
                if let Some(&last) = a.out.last() {
                    a.send_text(last, &a.text[a.emitted..]);
                }
            }
        }
        let now = Instant::now();
        let g = &a.group;
        let first = a.first_token.unwrap_or(now);
        let started = a.started.unwrap_or(g.submitted);
        let new_prompt = g.prompt.len().saturating_sub(a.cached);
        let decode_s = now.duration_since(first).as_secs_f64();
        let prefill_s = first.duration_since(started).as_secs_f64();
        let done = Completion {
            index: a.index,
            usage: Usage {
                prompt_tokens: g.prompt.len(),
                cached_tokens: a.cached,
                completion_tokens: a.out.len(),
            },
            timings: Timings {
                ttft_ms: first.duration_since(g.submitted).as_secs_f64() * 1e3,
                prefill_tok_s: new_prompt as f64 / prefill_s.max(1e-9),
                decode_tok_s: if a.out.len() > 1 {
                    (a.out.len() - 1) as f64 / decode_s.max(1e-9)
                } else {
                    0.0
                },
                total_s: now.duration_since(g.submitted).as_secs_f64(),
            },
            text: std::mem::take(&mut a.text),
            tokens: std::mem::take(&mut a.out),
            prompt_tokens: g.prompt.clone(),
            finish_reason: reason,
        };
        if a.index == 0 {
            self.totals.requests += 1;
            self.totals.prompt_tokens += done.usage.prompt_tokens as u64;
            self.totals.cached_tokens += done.usage.cached_tokens as u64;
        }
        self.totals.completion_tokens += done.usage.completion_tokens as u64;
        let _ = g.events.send(Event::Done(Box::new(done)));
    }

    fn fail(&mut self, id: ReqId, e: &EngineError) {
        if let Some(a) = self.active.remove(&id) {
            let _ = a
                .group
                .events
                .send(Event::Error(EngineError::Step(e.to_string())));
        }
        if let Err(e) = self.sched.finish(id) {
            warn!("dropping failed {id}: {e}");
        }
    }

    fn fail_all(&mut self, e: &EngineError) {
        warn!("step failed: {e}");
        let ids: Vec<ReqId> = self.active.keys().copied().collect();
        for id in ids {
            self.fail(id, e);
        }
    }

    /// Between requests: defragment when holes pass the threshold.
    fn idle(&mut self) {
        let pool = self.sched.kv().pool();
        let live = pool.num_live();
        let span = pool.highest_live().map_or(0, |b| b.index() + 1);
        if span > 0 && (span - live) as f64 > self.cfg.defrag_threshold * span as f64 {
            if let Err(e) = self.defragment() {
                warn!("idle defragmentation: {e}");
            }
        }
    }

    fn defragment(&mut self) -> Result<usize> {
        let plan = self.sched.kv_mut().plan_defrag();
        self.apply_copies(&plan.moves)?;
        if !plan.moves.is_empty() {
            self.totals.defrags += 1;
        }
        Ok(plan.moves.len())
    }

    /// Resizes the pool to `blocks`; returns the new number of blocks.
    fn resize(&mut self, blocks: usize) -> Result<usize> {
        let kv = self.sched.kv_mut();
        let now = kv.pool().num_blocks();
        let bs = kv.block_size();
        if blocks == 0 {
            return Err(EngineError::Invalid(
                "the KV pool needs at least one block".into(),
            ));
        }
        if blocks < now {
            let live = kv.pool().num_live();
            if live > blocks {
                kv.evict(live - blocks)?;
            }
            let live = kv.pool().num_live();
            if live > blocks {
                return Err(EngineError::OutOfKvMemory {
                    needed: live,
                    total: blocks,
                    block_size: bs,
                });
            }
            self.defragment()?;
            self.sched.kv_mut().shrink_to(blocks)?;
            for layer in &mut self.cache {
                layer.k = layer.k.narrow(0, 0, blocks)?.copy()?;
                layer.v = layer.v.narrow(0, 0, blocks)?.copy()?;
            }
        } else if blocks > now {
            self.sched.kv_mut().grow_to(blocks)?;
            for layer in &mut self.cache {
                let (_, bs, h, d) = layer.k.dims4()?;
                let extra =
                    Tensor::zeros((blocks - now, bs, h, d), layer.k.dtype(), layer.k.device())?;
                layer.k = Tensor::cat(&[&layer.k, &extra], 0)?;
                layer.v = Tensor::cat(&[&layer.v, &extra], 0)?;
            }
        }
        Ok(blocks)
    }

    /// Runs `tokens` through the model on a private sequence (reusing what
    /// is cached), then hands the sequence to `f` and releases it; the
    /// computed tokens stay cached when caching is on.
    fn with_computed<T>(
        &mut self,
        tokens: &[u32],
        f: impl FnOnce(&Self, SeqId) -> Result<T>,
    ) -> Result<T> {
        let toks = token_ids(tokens);
        let (seq, cached) = self.sched.kv_mut().add_sequence(self.ns, &toks);
        let result = self
            .compute_on(seq, &toks[cached..])
            .and_then(|()| f(self, seq));
        let kv = self.sched.kv_mut();
        if result.is_ok() && self.cfg.prefix_cache {
            kv.insert_sequence(seq)?;
        }
        kv.free_sequence(seq)?;
        result
    }

    /// Reserves slots for `toks` on `seq` outside the scheduler (sessions,
    /// exports): out of blocks is an error, not a wait.
    fn append_now(&mut self, seq: SeqId, toks: &[TokenId]) -> Result<AppendPlan> {
        let kv = self.sched.kv_mut();
        match kv.append(seq, toks)? {
            Admission::Ok(p) => Ok(p),
            Admission::Later { needed, .. } | Admission::Never { needed, .. } => {
                Err(EngineError::OutOfKvMemory {
                    needed,
                    total: kv.pool().num_blocks(),
                    block_size: kv.block_size(),
                })
            }
        }
    }

    /// Appends and computes `toks` on `seq`, in chunks.
    fn compute_on(&mut self, seq: SeqId, toks: &[TokenId]) -> Result<()> {
        for chunk in toks.chunks(self.cfg.prefill_chunk.max(1)) {
            let plan = self.append_now(seq, chunk)?;
            self.apply_copies(&plan.copies)?;
            let s = self.sched.kv().sequence(seq)?;
            let part = Part {
                tokens: chunk,
                start: s.len() - chunk.len(),
                slots: plan.slots.iter().map(|s| s.0).collect(),
                table: s.block_table().iter().map(|b| b.0).collect(),
                logits: false,
            };
            let len = s.len();
            self.forward(&[part])?;
            self.sched.kv_mut().mark_computed(seq, len)?;
        }
        Ok(())
    }

    /// The K/V of `seq`'s positions `0..n`.
    fn read_kv(&self, seq: SeqId, n: usize) -> Result<Vec<LayerBytes>> {
        let kv = self.sched.kv();
        let slots: Vec<u32> = (0..n)
            .map(|p| kv.slot(seq, p).map(|s| s.0))
            .collect::<std::result::Result<_, _>>()?;
        let dev = self.model.llama.device();
        let idx = Tensor::new(slots.as_slice(), dev)?;
        let rows = |t: &Tensor| -> Result<Vec<u8>> {
            let (nb, bs, h, d) = t.dims4()?;
            let picked = t.reshape((nb * bs, h, d))?.index_select(&idx, 0)?;
            tensor_bytes(&picked)
        };
        self.cache
            .iter()
            .map(|l| {
                Ok(LayerBytes {
                    k: rows(&l.k)?,
                    v: rows(&l.v)?,
                })
            })
            .collect()
    }

    fn export(&mut self, ids: &[u32]) -> Result<KvSnapshot> {
        if ids.is_empty() {
            return Ok(KvSnapshot {
                tokens: Vec::new(),
                layers: Vec::new(),
            });
        }
        self.with_computed(ids, |core, seq| {
            Ok(KvSnapshot {
                tokens: ids.to_vec(),
                layers: core.read_kv(seq, ids.len())?,
            })
        })
    }

    fn export_cache(&mut self) -> Result<Vec<KvSnapshot>> {
        let paths = self.sched.kv().tree().paths();
        let mut out = Vec::new();
        let ns = self.ns;
        for p in paths.into_iter().filter(|p| p.namespace == ns) {
            let ids: Vec<u32> = p.tokens.iter().map(|t| t.0).collect();
            out.push(self.export(&ids)?);
        }
        Ok(out)
    }

    fn import(&mut self, snaps: &[KvSnapshot]) -> Result<usize> {
        if !self.cfg.prefix_cache {
            return Err(EngineError::Invalid(
                "loading saved K/V needs the prefix cache, which is off".into(),
            ));
        }
        let dtype = self.cfg.cache_dtype.dtype();
        let mut total = 0;
        for snap in snaps.iter().filter(|s| !s.tokens.is_empty()) {
            let toks = token_ids(&snap.tokens);
            let (seq, cached) = self.sched.kv_mut().add_sequence(self.ns, &toks);
            let result = self.write_snapshot(seq, cached, snap, dtype);
            let kv = self.sched.kv_mut();
            if result.is_ok() {
                kv.mark_computed(seq, toks.len())?;
                let r = kv.insert_sequence(seq)?;
                total += r.inserted;
            }
            kv.free_sequence(seq)?;
            result?;
        }
        Ok(total)
    }

    /// Appends `snap`'s tokens past `cached` to `seq` and writes their K/V.
    fn write_snapshot(
        &mut self,
        seq: SeqId,
        cached: usize,
        snap: &KvSnapshot,
        dtype: DType,
    ) -> Result<()> {
        let toks = token_ids(&snap.tokens[cached..]);
        let plan = self.append_now(seq, &toks)?;
        self.apply_copies(&plan.copies)?;
        let slots: Vec<u32> = plan.slots.iter().map(|s| s.0).collect();
        let dev = self.model.llama.device();
        for (layer, bytes) in self.cache.iter().zip(&snap.layers) {
            let (_, _, h, d) = layer.k.dims4()?;
            let row = h * d * dtype.size_in_bytes();
            let from = |b: &[u8]| {
                Tensor::from_raw_buffer(&b[cached * row..], dtype, &[toks.len(), h, d], dev)
            };
            write_kv(&layer.k, &from(&bytes.k)?, &slots)?;
            write_kv(&layer.v, &from(&bytes.v)?, &slots)?;
        }
        Ok(())
    }

    fn shutdown(mut self) {
        for id in self.active.keys().copied().collect::<Vec<_>>() {
            self.finish(id, FinishReason::Cancelled);
        }
        if let Some(dir) = self.cfg.cache_dir.clone() {
            let geometry = crate::snapshot::Geometry::of(&self.model, self.cfg.cache_dtype);
            let written = self
                .export_cache()
                .and_then(|snaps| crate::snapshot::write_cache_dir(&dir, &geometry, &snaps));
            if let Err(e) = written {
                warn!("writing the prefix cache to {}: {e}", dir.display());
            }
        }
    }
}

/// The raw little-endian bytes of a tensor.
fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let flat = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => flat
            .to_vec1::<f32>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::F16 => flat
            .to_vec1::<half::f16>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::BF16 => flat
            .to_vec1::<half::bf16>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        other => {
            return Err(EngineError::Invalid(format!(
                "K/V of dtype {other:?} cannot be saved"
            )))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::CacheDType;
    use tessera_model::testing::{write_tiny_model, TinySpec};

    fn tiny_core(dtype: CacheDType) -> (Core, std::path::PathBuf) {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("tessera-core-{}-{n}", std::process::id()));
        write_tiny_model(&dir, TinySpec::default()).unwrap();
        let model = Arc::new(Model::load(&dir, &mut |_, _| {}).unwrap());
        let cfg = EngineConfig {
            kv_memory: 1 << 20,
            block_size: 4,
            cache_dtype: dtype,
            prefill_chunk: 7,
            ..EngineConfig::default()
        };
        let per = cfg.block_size * model.config().kv_bytes_per_token(dtype.bytes());
        (Core::new(model, &cfg, 512, per).unwrap(), dir)
    }

    fn computed(core: &mut Core, ids: &[u32]) -> SeqId {
        let (seq, _) = core.sched.kv_mut().add_sequence(core.ns, &[]);
        core.compute_on(seq, &token_ids(ids)).unwrap();
        seq
    }

    fn max_abs(a: &[u8], b: &[u8]) -> f32 {
        let f = |x: &[u8]| -> Vec<f32> {
            x.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        f(a).iter()
            .zip(f(b))
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// After a context shift, layer-0 K (rotated by the position delta) and
    /// V equal those computed fresh for the kept tokens at their new
    /// positions: layer 0 sees only the token and its position.
    #[test]
    fn shifted_layer_zero_kv_equals_a_fresh_computation() {
        let (mut core, dir) = tiny_core(CacheDType::F32);
        let ids: Vec<u32> = (0..23).map(|i| 5 + (i * 7) % 90).collect();
        let seq = computed(&mut core, &ids);
        let (keep, discard) = (5, 9);
        let plan = core
            .sched
            .kv_mut()
            .plan_shift(seq, keep, discard)
            .unwrap()
            .ok()
            .unwrap();
        core.apply_shift(&plan).unwrap();
        let shifted = core.read_kv(seq, ids.len() - discard).unwrap();

        let kept: Vec<u32> = ids[..keep]
            .iter()
            .chain(&ids[keep + discard..])
            .copied()
            .collect();
        let fresh_seq = computed(&mut core, &kept);
        let fresh = core.read_kv(fresh_seq, kept.len()).unwrap();
        let dk = max_abs(&shifted[0].k, &fresh[0].k);
        let dv = max_abs(&shifted[0].v, &fresh[0].v);
        assert!(
            dk < 1e-4 && dv < 1e-4,
            "layer 0: K differs by {dk}, V by {dv}"
        );
        // Deeper layers saw the discarded tokens: they do differ.
        assert!(max_abs(&shifted[1].v, &fresh[1].v) > 1e-3);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Exported K/V imported into another pool reads back byte for byte.
    #[test]
    fn snapshots_round_trip_between_pools() {
        for dtype in [CacheDType::F16, CacheDType::F32] {
            let (mut a, d1) = tiny_core(dtype);
            let (mut b, d2) = tiny_core(dtype);
            let ids: Vec<u32> = (0..19).map(|i| 3 + (i * 5) % 80).collect();
            let snap = a.export(&ids).unwrap();
            assert_eq!(snap.layers.len(), 2);
            assert_eq!(b.import(std::slice::from_ref(&snap)).unwrap(), ids.len());
            let again = b.export(&ids).unwrap();
            assert_eq!(again, snap);
            // The imported tokens are served from b's cache.
            let (seq, cached) = b.sched.kv_mut().add_sequence(b.ns, &token_ids(&ids));
            assert_eq!(cached, ids.len());
            b.sched.kv_mut().free_sequence(seq).unwrap();
            std::fs::remove_dir_all(d1).unwrap();
            std::fs::remove_dir_all(d2).unwrap();
        }
    }
}
