//! The worker: owns the scheduler, the runner and the state of every
//! request, and runs the continuous-batching loop on its own thread.
//!
//! ```text
//! loop:
//!   commands (submit, stats, defragment, sessions, …) between steps
//!   plan  = Scheduler::schedule()       decodes + prefill chunks, in budget
//!   run   = runner: plan.ops, forward   copy_blocks, shift_kv, write_kv + attention
//!     failed or panicked → Scheduler::abort_step: nothing of it is cached;
//!     a request alone in it fails, the others are retried one at a time
//!   step_done, sample each item         stop rules, events to its stream
//!   push_token / finish                 finished sequences enter the tree
//! idle: defragment past the threshold, wait for a command
//! ```
//!
//! A panic anywhere in the loop is caught: the requests it touched fail,
//! the KV bookkeeping is checked, and the worker goes on serving the others.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use tessera_kv::{token_ids, BlockId, KvCache, KvConfig, Namespace, SlidingConfig, TokenId};
use tessera_model::Model;
use tessera_sched::{
    EndReason, KvOp, NewRequest, ReqId, SchedConfig, SchedError, Scheduler, StepPlan,
};
use tracing::{debug, debug_span, error, warn};

use crate::error::panic_text;
use crate::request::{Active, Group, Next};
use crate::runner::{sliding_part, Logits, Part, Rows, Runner};
use crate::self_extend::PositionMap;
use crate::snapshot::KvSnapshot;
use crate::stream::Event;
use crate::types::{
    ContextShift, EngineConfig, EngineStats, Fault, FaultSite, FinishReason, GenerateRequest,
    Partition,
};
use crate::{EngineError, Result};

mod side;
mod tiers;
use side::{Export, Scoring};

/// What the handles ask of the worker.
pub(crate) enum Command {
    Submit {
        ids: Vec<u32>,
        req: Box<GenerateRequest>,
        guide: Option<crate::grammar::Guide>,
        events: crate::stream::EventSender,
        cancel: Arc<AtomicBool>,
        backlog: Arc<std::sync::atomic::AtomicUsize>,
        reply: mpsc::Sender<Result<()>>,
    },
    Stats(mpsc::Sender<EngineStats>),
    ClearCache(mpsc::Sender<Result<usize>>),
    Defragment(mpsc::Sender<Result<usize>>),
    /// New number of blocks.
    Resize(usize, mpsc::Sender<Result<usize>>),
    /// The K/V of these tokens in this partition, and how many of them
    /// were cached: what the cache lacks is computed as a background
    /// request, between and beside the other requests' steps.
    Export(
        Partition,
        Vec<u32>,
        mpsc::Sender<Result<(KvSnapshot, usize)>>,
    ),
    /// Every cached path of the prefix tree, with its partition (paths of
    /// namespaces no partition of this engine maps to are left out).
    ExportCache(mpsc::Sender<Result<Vec<(Partition, KvSnapshot)>>>),
    /// Into the prefix tree, each into its partition; answers the tokens
    /// inserted.
    Import(Vec<(Partition, KvSnapshot)>, mpsc::Sender<Result<usize>>),
    /// Ends every request in flight with this error (the server's shutdown
    /// timeout); what they computed stays cached.
    FailAll(EngineError, mpsc::Sender<()>),
    /// Verify the KV bookkeeping.
    Check(mpsc::Sender<Result<()>>),
    /// The logits after each token of a text from a position on.
    Logits(Vec<u32>, usize, mpsc::Sender<Result<Vec<Vec<f32>>>>),
    /// End every request in flight (cancelled; what they computed stays
    /// cached), before the cache is saved at shutdown.
    CancelAll(mpsc::Sender<()>),
    Shutdown,
}

pub(crate) struct Worker {
    runner: Runner,
    sched: Scheduler,
    ns: Namespace,
    cfg: EngineConfig,
    layout: KvLayout,
    active: HashMap<ReqId, Active>,
    totals: EngineStats,
    /// SelfExtend requests: each one's RoPE position map.
    maps: HashMap<ReqId, PositionMap>,
    /// Drawn at start: the key of the partitions' namespaces.
    secret: [u8; 32],
    /// The partition of each namespace this engine has served (the
    /// default one's is `ns`), for the cache directory.
    partitions: HashMap<Namespace, Partition>,
    /// Session exports computing as background requests.
    exports: HashMap<ReqId, Export>,
    /// Texts scored as requests beside the others ([`Scoring`]).
    scores: HashMap<ReqId, Scoring>,
    /// Seconds of a recent step without background tokens (a moving
    /// average), against which steps with them are held.
    plain_step: Option<f64>,
    pace: Pace,
    /// Structured output's masks are computed on a thread of their own
    /// beside the forward when a core is free for it (a GPU forward, or
    /// fewer compute threads than cores); otherwise before the forward on
    /// this thread, since a thread taking a core from the step pool's
    /// team stalls every worker at the next barrier (measured: 10% of a
    /// decode step on two cores, against 5% for the masks in line).
    masks_beside: bool,
    /// The draft model, when speculative decoding has one.
    drafts: Option<crate::draft::Drafts>,
    /// Samples whose next token waits for its draft (computed for all of
    /// them together at the end of the step): the token, and the most
    /// guesses.
    to_draft: Vec<(ReqId, u32, usize)>,
    /// What a guess costs, measured ([`crate::spec::Cost`]), and that cost
    /// in tokens of plain decoding at the last step's batch size.
    cost: crate::spec::Cost,
    guess_cost: f64,
    /// The disk tier below the pool (`cache_dir`), when it is on.
    tier: Option<tiers::Tier>,
    /// Each namespace's block-name key (the tier's and the KV events').
    block_keys: HashMap<Namespace, crate::tier::TierKey>,
    /// KV events not yet sent (`cfg.kv_events`).
    kv_events: Vec<crate::KvEvent>,
}

/// The background share's memory: the largest share not found too slow,
/// and the fast steps seen at it.
#[derive(Debug, Clone, Copy)]
struct Pace {
    ceiling: usize,
    good: usize,
}

/// The logits rows a step item asks for: the last `given` rows of its
/// part, of which the first `kept` are wanted (a scored text's last token
/// predicts nothing); `scored`: a text's rows, else a sample's one row.
#[derive(Debug, Clone, Copy)]
struct ItemRows {
    given: usize,
    kept: usize,
    scored: bool,
}

/// Partitions beyond which the idle worker forgets those with nothing
/// cached and nothing running.
const PARTITIONS_KEPT: usize = 4096;

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

/// Moves `map` to a forward of `k` tokens from `start`: llama.cpp's
/// SelfExtend loop, the cached keys whose positions moved rotated in place
/// (slots from `table`); returns the new tokens' RoPE positions. A map
/// longer than `start` (a step undone) keeps its first `start` tokens; a
/// sequence restarted from 0 starts a fresh map.
fn advance(
    runner: &Runner,
    map: &mut PositionMap,
    start: usize,
    k: usize,
    table: &[BlockId],
    bs: usize,
) -> Result<Vec<u32>> {
    if start == 0 {
        *map = PositionMap::new(map.settings());
    } else if map.len() > start {
        map.truncate(start);
    } else if map.len() < start {
        return Err(EngineError::Step(format!(
            "SelfExtend map of {} tokens for a sequence of {start}",
            map.len()
        )));
    }
    let moved = map.compress();
    if !moved.is_empty() {
        let slots: Vec<u32> = moved
            .iter()
            .map(|&(i, _)| table[i / bs].0 * bs as u32 + (i % bs) as u32)
            .collect();
        let deltas: Vec<i64> = moved.iter().map(|&(_, d)| d).collect();
        runner.rotate_keys(&slots, &deltas)?;
    }
    Ok(map.append(k))
}

/// The namespace of a partition: the model's own (`ns`) for the default
/// one, else the first 8 bytes of HMAC-SHA256 under `secret` of the
/// model's namespace and the partition's parts, each length-prefixed (so
/// no choice of salt reads as another tenant and salt). Without the secret
/// a client cannot compute a namespace at all, let alone aim at one.
fn partition_namespace(secret: &[u8; 32], ns: Namespace, p: &Partition) -> Namespace {
    use hmac::{Hmac, Mac};
    if p.is_default() {
        return ns;
    }
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(secret).expect("any key length");
    mac.update(b"tessera partition v1");
    mac.update(&ns.0.to_le_bytes());
    for part in [&p.tenant, &p.salt] {
        match part {
            None => mac.update(&[0]),
            Some(s) => {
                mac.update(&[1]);
                mac.update(&(s.len() as u64).to_le_bytes());
                mac.update(s.as_bytes());
            }
        }
    }
    let out = mac.finalize().into_bytes();
    let h = u64::from_le_bytes(out[..8].try_into().expect("8 bytes"));
    // The default partition's namespace is the model's alone.
    Namespace(if h == ns.0 { h ^ 1 } else { h })
}

/// What an injected [`Fault::Panic`] panics with.
pub const INJECTED_PANIC: &str = "injected panic";

/// How the KV memory budget is split: the pool of every layer, or, for a
/// model with sliding-window layers, the global layers' pool and a smaller
/// one for the sliding layers (see [`EngineConfig::swa_full`]).
#[derive(Debug, Clone)]
pub(crate) struct KvLayout {
    pub num_blocks: usize,
    pub sliding: Option<SlidingConfig>,
    /// Bytes of one block of the first pool (its layers, K and V).
    pub block_bytes: usize,
    /// Bytes of one block of the sliding layers' pool.
    pub sliding_block_bytes: usize,
}

impl KvLayout {
    pub(crate) fn new(mc: &tessera_model::ModelConfig, cfg: &EngineConfig) -> Result<KvLayout> {
        let bs = cfg.block_size.max(1);
        if let Some(ga) = cfg.self_extend {
            ga.check(mc.sliding_window().is_some())
                .map_err(EngineError::Invalid)?;
        }
        if cfg.cache_dtype.is_quantized() && !mc.head_dim.is_multiple_of(64) {
            return Err(EngineError::Invalid(format!(
                "a {} KV cache rotates and quantizes each head's row 64 values at a time; this model's head_dim is {} (use --cache-dtype f16, bf16 or f32)",
                cfg.cache_dtype, mc.head_dim
            )));
        }
        let per_layer = bs * mc.kv_bytes_per_token(cfg.cache_dtype) / mc.n_layers.max(1);
        let budget = cfg.kv_memory;
        let too_small = |per_block: usize| EngineError::KvBudgetTooSmall {
            bytes: budget,
            block_size: cfg.block_size,
            per_block,
        };
        let Some(window) = mc.sliding_window() else {
            let g = per_layer * mc.n_layers;
            let num_blocks = budget / g.max(1);
            if num_blocks == 0 {
                return Err(too_small(g));
            }
            return Ok(KvLayout {
                num_blocks,
                sliding: None,
                block_bytes: g,
                sliding_block_bytes: 0,
            });
        };
        let n_sliding = mc.num_sliding_layers();
        let (g, sl) = (per_layer * (mc.n_layers - n_sliding), per_layer * n_sliding);
        // One request: its window, a prompt chunk, a copied tail block and
        // the block of the tokens a context shift keeps.
        let least = (window + cfg.prefill_chunk.max(1)).div_ceil(bs) + 3;
        let share = if cfg.swa_full { 1 } else { 4 };
        let n = budget / (g + sl / share).max(1);
        let m = match cfg.swa_blocks {
            Some(k) if !cfg.swa_full => k,
            _ => n / share,
        }
        .max(least);
        let rest = budget
            .checked_sub(m * sl)
            .ok_or_else(|| too_small(g + least * sl))?;
        let n = rest.checked_div(g).unwrap_or(n.max(m));
        if n == 0 {
            return Err(too_small(g + least * sl));
        }
        Ok(KvLayout {
            num_blocks: n,
            sliding: Some(SlidingConfig {
                window,
                num_blocks: m.min(n.max(least)),
            }),
            block_bytes: g,
            sliding_block_bytes: sl,
        })
    }

    pub(crate) fn kv_config(&self, block_size: usize) -> KvConfig {
        KvConfig {
            num_blocks: self.num_blocks,
            block_size,
            sliding: self.sliding,
        }
    }
}

impl Worker {
    pub(crate) fn new(
        model: Arc<Model>,
        cfg: &EngineConfig,
        ctx: usize,
        layout: &KvLayout,
        drafts: Option<crate::draft::Drafts>,
    ) -> Result<Worker> {
        let mut kv = KvCache::new(layout.kv_config(cfg.block_size))?;
        let runner = Runner::new(
            model.clone(),
            layout.num_blocks,
            layout.sliding.map(|s| s.num_blocks),
            cfg.block_size,
            cfg.cache_dtype,
        )?;
        let geometry = crate::snapshot::Geometry::of(&model, cfg.cache_dtype);
        let tier = tiers::Tier::open(cfg, &geometry, runner.row_bytes())?;
        kv.set_log(tier.is_some() || cfg.kv_events.is_some());
        let sched = Scheduler::new(
            kv,
            SchedConfig {
                max_batch_tokens: cfg.prefill_chunk.max(1),
                max_running: cfg.max_running.max(1),
                max_wait_steps: 64,
                prefix_cache: cfg.prefix_cache,
                context_length: ctx,
                background_tokens: cfg.background_chunk.max(1),
            },
        );
        let mut secret = [0u8; 32];
        getrandom::getrandom(&mut secret).map_err(|e| {
            EngineError::Invalid(format!("cannot draw the partitions' secret: {e}"))
        })?;
        Ok(Worker {
            ns: Namespace(model.fingerprint),
            runner,
            sched,
            cfg: cfg.clone(),
            layout: layout.clone(),
            active: HashMap::new(),
            maps: HashMap::new(),
            totals: EngineStats::default(),
            secret,
            partitions: HashMap::new(),
            exports: HashMap::new(),
            scores: HashMap::new(),
            plain_step: None,
            masks_beside: !model.llama.device().is_cpu()
                || std::thread::available_parallelism().map_or(1, |c| c.get())
                    > rayon::current_num_threads(),
            pace: Pace {
                ceiling: cfg.prefill_chunk.max(1),
                good: 0,
            },
            drafts,
            to_draft: Vec::new(),
            cost: crate::spec::Cost::default(),
            guess_cost: 0.0,
            kv_events: tier
                .as_ref()
                .filter(|_| cfg.kv_events.is_some())
                .map_or_else(Vec::new, |t| tiers::held_events(t, cfg.block_size)),
            tier,
            block_keys: HashMap::new(),
        })
    }

    /// The namespace of partition `p`, remembered for the cache directory.
    fn namespace(&mut self, p: &Partition) -> Namespace {
        let ns = partition_namespace(&self.secret, self.ns, p);
        if !p.is_default() {
            self.partitions.entry(ns).or_insert_with(|| p.clone());
        }
        ns
    }

    /// The partition of namespace `ns`, when this engine knows it.
    fn partition_of(&self, ns: Namespace) -> Option<Partition> {
        if ns == self.ns {
            return Some(Partition::default());
        }
        self.partitions.get(&ns).cloned()
    }

    /// The worker thread's loop.
    pub(crate) fn run(mut self, rx: mpsc::Receiver<Command>) {
        loop {
            // Commands first, between steps; block only when idle.
            let cmd = if self.sched.has_work() && self.all_paused() {
                // Every request waits for its reader: nothing to compute,
                // so wait for a command a little instead of spinning.
                match rx.recv_timeout(std::time::Duration::from_millis(2)) {
                    Ok(c) => Some(c),
                    Err(mpsc::RecvTimeoutError::Timeout) => None,
                    Err(mpsc::RecvTimeoutError::Disconnected) => Some(Command::Shutdown),
                }
            } else if self.sched.has_work() {
                match rx.try_recv() {
                    Ok(c) => Some(c),
                    Err(mpsc::TryRecvError::Empty) => None,
                    Err(mpsc::TryRecvError::Disconnected) => Some(Command::Shutdown),
                }
            } else {
                self.guarded(|w| w.idle());
                Some(rx.recv().unwrap_or(Command::Shutdown))
            };
            match cmd {
                Some(Command::Shutdown) => return self.shutdown(),
                Some(c) => self.guarded(|w| w.handle(c)),
                None => self.guarded(|w| w.step()),
            }
            // What the step or command added to the prefix tree (and any
            // eviction not yet carried out), sent as one batch.
            self.guarded(|w| {
                w.drain_tree_log(true);
                w.flush_kv_events();
            });
        }
    }

    /// Runs `f`, and if it panics, fails every request (the state it left
    /// them in is unknown) and checks the bookkeeping.
    fn guarded(&mut self, f: impl FnOnce(&mut Self)) {
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(self))) {
            let e = EngineError::Step(format!("the engine hit a bug: {}", panic_text(&*p)));
            error!("{e}");
            self.fail_all(&e);
            self.check_or_reset();
        }
    }

    /// Checks the KV invariants; if they broke, starts the bookkeeping over
    /// on an empty pool (requests are already failed).
    fn check_or_reset(&mut self) {
        if let Err(e) = self.sched.kv().check_invariants() {
            error!("KV bookkeeping broken ({e}): the prefix cache starts over");
            // The layout's pools, the global one at its current size.
            let mut kv = KvCache::new(KvConfig {
                num_blocks: self.sched.kv().pool().num_blocks(),
                ..self.layout.kv_config(self.cfg.block_size)
            })
            .expect("the same configuration was valid");
            kv.set_log(self.logs_tree());
            // What the old bookkeeping held is gone for the routers too.
            self.kv_events.clear();
            if self.cfg.kv_events.is_some() {
                self.kv_events.push(crate::KvEvent::AllBlocksCleared);
                // The disk tier keeps its blocks: told again.
                if let Some(t) = &self.tier {
                    let held = tiers::held_events(t, self.cfg.block_size);
                    self.kv_events.extend(held);
                }
            }
            self.sched = Scheduler::new(kv, self.sched.config().clone());
            // The draft model's sequences were the cleared samples'.
            if let Some(d) = self.drafts.as_mut() {
                d.clear();
            }
            self.active.clear();
            self.exports.clear();
            self.scores.clear();
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit {
                ids,
                req,
                guide,
                events,
                cancel,
                backlog,
                reply,
            } => {
                let _ = reply.send(self.submit(ids, req, guide, events, cancel, backlog));
            }
            Command::Stats(reply) => {
                let _ = reply.send(self.stats());
            }
            Command::ClearCache(reply) => {
                let cleared = self.sched.kv_mut().clear_cache();
                // Cleared, not demoted: the tier keeps what it had.
                self.drain_tree_log(false);
                let _ = reply.send(cleared.map_err(Into::into));
            }
            Command::Defragment(reply) => {
                let _ = reply.send(self.defragment());
            }
            Command::Resize(blocks, reply) => {
                let _ = reply.send(self.resize(blocks));
            }
            Command::Export(partition, ids, reply) => self.start_export(&partition, ids, reply),
            Command::ExportCache(reply) => {
                let _ = reply.send(self.export_cache());
            }
            Command::Import(snaps, reply) => {
                let _ = reply.send(self.import(&snaps));
            }
            Command::FailAll(e, reply) => {
                self.fail_all(&e);
                let _ = reply.send(());
            }
            Command::CancelAll(reply) => {
                self.cancel_all();
                let _ = reply.send(());
            }
            Command::Check(reply) => {
                let draft = self.drafts.as_ref().map(|d| d.kv().check_invariants());
                let checked = self
                    .sched
                    .kv()
                    .check_invariants()
                    .and(draft.unwrap_or(Ok(())));
                let _ = reply.send(checked.map_err(Into::into));
            }
            Command::Logits(ids, first, reply) => self.start_scoring(ids, first, reply),
            Command::Shutdown => unreachable!("handled by run"),
        }
    }

    fn stats(&self) -> EngineStats {
        let s = self.sched.stats();
        let kv = self.sched.kv().stats();
        let (g, sl) = (self.layout.block_bytes, self.layout.sliding_block_bytes);
        EngineStats {
            kv,
            kv_bytes: kv.num_blocks * g + kv.sliding_blocks * sl,
            kv_bytes_held: (kv.num_blocks - kv.free_blocks) * g
                + (kv.sliding_blocks - kv.free_sliding_blocks) * sl,
            preemptions: s.preemptions,
            active_samples: self.active.len(),
            running: self.sched.num_running(),
            waiting: self.sched.num_waiting(),
            paused_samples: self.active.values().filter(|a| a.held.is_some()).count(),
            draft_kv: self.drafts.as_ref().map(|d| d.kv().stats()),
            disk_tier: self.tier.as_ref().map(|t| t.stats()),
            spec_guess_cost_ppm: (self.guess_cost * 1e6).round() as u64,
            ..self.totals
        }
    }

    fn submit(
        &mut self,
        ids: Vec<u32>,
        req: Box<GenerateRequest>,
        guide: Option<crate::grammar::Guide>,
        events: crate::stream::EventSender,
        cancel: Arc<AtomicBool>,
        backlog: Arc<std::sync::atomic::AtomicUsize>,
    ) -> Result<()> {
        let shift_keep = match req.context_shift {
            ContextShift::Off => None,
            ContextShift::Keep(n) => Some(n),
        };
        let self_extend = req.self_extend.or(self.cfg.self_extend);
        if let Some(ga) = self_extend {
            ga.check(self.sched.kv().window().is_some())
                .map_err(EngineError::Invalid)?;
            let why = if req.n > 1 {
                Some("n > 1 (its samples would share keys that each one rotates)")
            } else if shift_keep.is_some() {
                Some("a context shift (use one or the other)")
            } else {
                None
            };
            if let Some(why) = why {
                return Err(EngineError::Invalid(ga.refusal(why)));
            }
        }
        let namespace = self.namespace(&req.partition);
        let id = self
            .sched
            .add(NewRequest {
                namespace,
                prompt: token_ids(&ids),
                // Unlimited: what it needs now; it grows as it generates.
                max_new_tokens: if req.max_tokens == GenerateRequest::UNLIMITED {
                    1
                } else {
                    req.max_tokens
                },
                shift_keep,
                reuse_prefix: req.reuse_prefix,
                private: self_extend.is_some(),
                background: false,
            })
            .map_err(sched_error)?;
        if let Some(ga) = self_extend {
            self.maps.insert(id, PositionMap::new(ga));
        }
        let group = Arc::new(Group {
            req,
            prompt: ids,
            guide: guide.map(std::sync::Mutex::new),
            events,
            cancel,
            backlog,
            submitted: Instant::now(),
        });
        let mut a = Active::new(group, 0);
        let spec = a
            .group
            .req
            .speculative
            .or(self.cfg.speculative)
            .or(self.drafts.is_some().then(crate::NgramSpec::default));
        if a.group.req.n == 1 && self_extend.is_none() {
            a.drafter = spec
                .filter(|s| s.max_draft > 0)
                .map(crate::spec::Drafter::new);
        }
        self.active.insert(id, a);
        Ok(())
    }

    /// Gives the scheduler a sampled token to compute: with speculative
    /// decoding on and a draft found, the token and its draft.
    fn push_next(&mut self, id: ReqId, t: u32) -> Result<()> {
        if self.drafts.is_some() {
            // The draft model's drafts are computed together after the step.
            let cost = self.guess_cost;
            let most = self.active.get_mut(&id).map_or(0, |a| a.draft_room(cost));
            if most > 0 {
                self.to_draft.push((id, t, most));
                return Ok(());
            }
            return self.sched.push_token(id, TokenId(t)).map_err(sched_error);
        }
        let cost = self.guess_cost;
        let draft = self
            .active
            .get_mut(&id)
            .map(|a| a.next_draft(cost))
            .unwrap_or_default();
        if !draft.is_empty() {
            let draft: Vec<TokenId> = draft.into_iter().map(TokenId).collect();
            match self.sched.push_draft(id, TokenId(t), &draft) {
                Ok(()) => return Ok(()),
                // Not in a state to draft (it cannot happen after a
                // sampled step; plain decoding is always right).
                Err(SchedError::BadState(..)) => {}
                Err(e) => return Err(sched_error(e)),
            }
        }
        self.sched.push_token(id, TokenId(t)).map_err(sched_error)
    }

    /// One row of a step item that computed `draft` after its sampled
    /// token: row `k` is sampled as any would be; while its token equals
    /// `draft[k]` the guess is kept and the next row is read (`true`).
    /// Otherwise the step settles: the guesses kept stay, the rest leave
    /// the sequence, and the token sampled here is the next to compute.
    fn on_spec_row(&mut self, req: ReqId, logits: &[f32], draft: &[u32], k: usize) -> Result<bool> {
        let Some(a) = self.active.get_mut(&req) else {
            return Ok(false);
        };
        let next = a.advance(logits, &self.runner.model().tokenizer)?;
        let behind = a.group.behind();
        if let Next::Continue(t) = next {
            if k < draft.len() && t == draft[k] && !behind {
                return Ok(true);
            }
        }
        if let Some(d) = a.drafter.as_mut() {
            d.kept(draft.len(), k);
        }
        a.drafted += draft.len();
        a.accepted += k;
        self.totals.spec_draft_tokens += draft.len() as u64;
        self.totals.spec_accepted_tokens += k as u64;
        self.sched.settle_draft(req, k).map_err(sched_error)?;
        match next {
            Next::Continue(t) if behind => {
                if let Some(a) = self.active.get_mut(&req) {
                    a.held = Some(t);
                }
            }
            Next::Continue(t) => self.push_next(req, t)?,
            Next::Finish(reason) => self.finish(req, reason),
        }
        Ok(false)
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
        self.resume_caught_up();
        self.read_exports();
        if !self.sched.has_work() {
            return;
        }
        self.promote();
        let scheduled = debug_span!("schedule").in_scope(|| self.sched.schedule());
        // What admission evicted, before the step writes the pool.
        self.drain_tree_log(true);
        let plan = match scheduled {
            Ok(p) => p,
            Err(e) => {
                let e = sched_error(e);
                self.fail_all(&e);
                return self.check_or_reset();
            }
        };
        if plan.items.is_empty() && plan.ops.is_empty() && plan.ended.is_empty() {
            // Every running request waits for its reader.
            return;
        }
        self.totals.steps += 1;
        let now = Instant::now();
        let background: usize = plan
            .items
            .iter()
            .filter(|i| self.exports.contains_key(&i.req))
            .map(|i| i.tokens.len())
            .sum();
        // The others' items all decoding (one token each): the steps the
        // background share is paced against.
        let decoding = plan
            .items
            .iter()
            .filter(|i| !self.exports.contains_key(&i.req))
            .all(|i| i.tokens.len() == 1);
        let others = plan
            .items
            .iter()
            .any(|i| !self.exports.contains_key(&i.req));
        let beside = decoding && others && background > 0;
        let plain = decoding && others && background == 0;
        for item in &plan.items {
            if let Some(a) = self.active.get_mut(&item.req) {
                a.started.get_or_insert(now);
            }
        }
        // Where each item's logits rows go, fixed before the forward asks
        // for them (ending requests below must not move them).
        let rows: Vec<Option<ItemRows>> = plan.items.iter().map(|i| self.item_rows(i)).collect();
        // Constrained samples' next masks, computed while the forward
        // computes the logits they mask where a core is free for them.
        let mut guides: Vec<(ReqId, crate::grammar::Guide)> = plan
            .items
            .iter()
            .zip(&rows)
            .filter(|(_, r)| r.is_some_and(|r| !r.scored))
            .filter_map(|(i, _)| {
                let a = self.active.get_mut(&i.req)?;
                // (A lazy guide still waiting has no mask to compute.)
                let g = a.guide.take_if(|g| g.active())?;
                Some((i.req, g))
            })
            .collect();
        let prepare = |guides: &mut Vec<(ReqId, crate::grammar::Guide)>| {
            let t = Instant::now();
            for (_, g) in guides.iter_mut() {
                g.prepare();
            }
            t.elapsed()
        };
        let (overlap, any) = (self.masks_beside, !guides.is_empty());
        let (ran, masked) = std::thread::scope(|s| {
            let inline = (any && !overlap).then(|| prepare(&mut guides));
            let beside = (any && overlap).then(|| s.spawn(|| prepare(&mut guides)));
            let ran = catch_unwind(AssertUnwindSafe(|| self.execute(&plan, &rows)));
            // (Time, time on the step's path.) A mask computation never
            // panics (`Guide::prepare` turns panics into errors).
            let waited = Instant::now();
            let masked = match (inline, beside) {
                (Some(t), _) => Some((t, t)),
                (_, Some(h)) => h.join().ok().map(|t| (t, waited.elapsed())),
                _ => None,
            };
            (ran, masked)
        });
        if let Some((took, waited)) = masked {
            self.totals.guide_masks += guides.len() as u64;
            self.totals.guide_mask_ns += took.as_nanos() as u64;
            self.totals.guide_wait_ns += waited.as_nanos() as u64;
        }
        let ran = ran.unwrap_or_else(|p| {
            let text = panic_text(&*p);
            Err(if text == INJECTED_PANIC {
                EngineError::Injected
            } else {
                EngineError::Step(text)
            })
        });
        for (id, g) in guides {
            if let Some(a) = self.active.get_mut(&id) {
                a.guide = Some(g);
            }
        }
        let logits =
            match ran.and_then(|l| self.sched.step_done(&plan).map(|()| l).map_err(sched_error)) {
                Ok(l) => l,
                Err(e) => return self.abort(&plan, &e),
            };
        self.end_scheduled(&plan);
        self.guess_cost = self.cost.per_guess(plan.items.len());
        // The items that asked for rows, in the forward's order.
        let wanting: Vec<(ReqId, ItemRows, Vec<u32>)> = plan
            .items
            .iter()
            .zip(&rows)
            .filter_map(|(i, r)| {
                let draft = i.tokens[i.tokens.len() - i.draft..].iter().map(|t| t.0);
                Some((i.req, (*r)?, draft.collect()))
            })
            .collect();
        // Per item with a draft: its rows are read until one settles it.
        let mut settled = vec![false; wanting.len()];
        for item in &plan.items {
            let done = self
                .exports
                .get(&item.req)
                .is_some_and(|x| item.start + item.tokens.len() == x.ids.len());
            if done {
                self.end_export(item.req, item.seq);
            }
        }
        let _span = debug_span!("sample").entered();
        let (mut at, mut k) = (0, 0);
        let read = logits.each_row(|row| {
            while wanting.get(at).is_some_and(|w| k == w.1.given) {
                (at, k) = (at + 1, 0);
            }
            let Some((req, r, draft)) = wanting.get(at) else {
                return;
            };
            let (req, r) = (*req, *r);
            if r.scored {
                if let Some(s) = self.scores.get_mut(&req).filter(|_| k < r.kept) {
                    s.rows.push(row.to_vec());
                }
            } else if draft.is_empty() {
                if let Err(e) = self.on_logits(req, row) {
                    self.fail(req, &e);
                }
            } else if !settled[at] {
                match self.on_spec_row(req, row, draft, k) {
                    Ok(true) => {}
                    Ok(false) => settled[at] = true,
                    Err(e) => {
                        settled[at] = true;
                        self.fail(req, &e);
                    }
                }
            }
            k += 1;
        });
        if let Err(e) = read {
            // Reading fails before the first row, if at all.
            for (req, ..) in &wanting {
                self.fail(*req, &e);
            }
        }
        for item in &plan.items {
            if self
                .scores
                .get(&item.req)
                .is_some_and(|s| item.start + item.tokens.len() == s.n)
            {
                self.end_scoring(item.req);
            }
        }
        // A decoding step (each item a sampled token and its guesses) times
        // the rows a guess adds.
        let decoding_only = plan.ops.is_empty()
            && plan
                .items
                .iter()
                .all(|i| i.tokens.len() == 1 + i.draft && !self.exports.contains_key(&i.req));
        if decoding_only && !plan.items.is_empty() {
            let rows = plan.items.iter().map(|i| i.tokens.len()).sum();
            self.cost
                .step(rows, plan.items.len(), now.elapsed().as_secs_f64());
        }
        self.draft_model_drafts();
        self.pace_background(now.elapsed().as_secs_f64(), plain, background, beside);
    }

    /// The draft model's drafts for the samples that sampled a token in
    /// this step, in one batch; each token goes to the scheduler with its
    /// draft (or alone, without one).
    fn draft_model_drafts(&mut self) {
        let waiting = std::mem::take(&mut self.to_draft);
        let Some(drafts) = self.drafts.as_mut() else {
            return;
        };
        if waiting.is_empty() {
            return;
        }
        let active = &self.active;
        let _span = debug_span!("draft", samples = waiting.len()).entered();
        let began = Instant::now();
        let wants: Vec<crate::draft::Want> = waiting
            .iter()
            .filter_map(|&(req, _, most)| {
                let a = active.get(&req)?;
                Some(crate::draft::Want {
                    req,
                    ns: partition_namespace(&self.secret, self.ns, &a.group.req.partition),
                    history: a.history(),
                    most,
                    reuse: a.group.req.reuse_prefix,
                })
            })
            .collect();
        let mut made: HashMap<ReqId, Vec<u32>> = wants
            .iter()
            .map(|w| w.req)
            .zip(drafts.draft(&wants))
            .collect();
        let took = began.elapsed();
        self.totals.spec_draft_ns += took.as_nanos() as u64;
        let guesses = made.values().map(Vec::len).sum();
        self.cost.drafted(took.as_secs_f64(), guesses);
        for (id, t, _) in waiting {
            if !self.active.contains_key(&id) {
                continue;
            }
            let draft: Vec<TokenId> = made
                .remove(&id)
                .unwrap_or_default()
                .into_iter()
                .map(TokenId)
                .collect();
            let pushed = if draft.is_empty() {
                self.sched.push_token(id, TokenId(t))
            } else {
                match self.sched.push_draft(id, TokenId(t), &draft) {
                    Err(SchedError::BadState(..)) => self.sched.push_token(id, TokenId(t)),
                    r => r,
                }
            };
            if let Err(e) = pushed {
                self.fail(id, &sched_error(e));
            }
        }
    }

    /// Adapts the background share of a step (additive increase,
    /// multiplicative decrease) so that decoding steps computing background
    /// tokens take at most about 1.5 times a decoding step without them
    /// (a moving average of those): a stream decoding beside a session save
    /// keeps its pace on any model and machine, and the save goes as fast
    /// as that allows. Steps with other prompts' chunks count as neither.
    fn pace_background(&mut self, secs: f64, plain: bool, background: usize, beside: bool) {
        if plain {
            let avg = self.plain_step.map_or(secs, |a| 0.8 * a + 0.2 * secs);
            self.plain_step = Some(avg);
            return;
        }
        let (Some(plain), true) = (self.plain_step, beside) else {
            return;
        };
        let share = self.sched.config().background_tokens;
        let most = self.cfg.prefill_chunk.max(1);
        let next = if secs > 1.6 * plain {
            // Too slow: in proportion to the excess, one step back to the
            // aim; and no share this large again for a while (a kernel's
            // cost can jump at a number of rows, which growing back to it
            // would hit again and again).
            self.pace.ceiling = background.saturating_sub(1).max(1);
            self.pace.good = 0;
            (share as f64 * 1.5 * plain / secs) as usize
        } else if secs < 1.3 * plain && background >= share {
            // Fast enough: grow up to the ceiling, which itself rises one
            // token after 32 such steps at it.
            if share >= self.pace.ceiling {
                self.pace.good += 1;
                if self.pace.good >= 32 {
                    self.pace.ceiling += 1;
                    self.pace.good = 0;
                }
            }
            (share + share.div_ceil(4)).min(self.pace.ceiling).min(most)
        } else {
            share
        };
        self.sched.set_background_tokens(next.max(1));
    }

    /// Gives the scheduler the held tokens of samples whose reader has
    /// caught up.
    fn resume_caught_up(&mut self) {
        let ready: Vec<(ReqId, u32)> = self
            .active
            .iter()
            .filter_map(|(&id, a)| Some((id, a.held?)).filter(|_| a.group.caught_up()))
            .collect();
        for (id, t) in ready {
            if let Some(a) = self.active.get_mut(&id) {
                a.held = None;
            }
            if let Err(e) = self.sched.push_token(id, TokenId(t)) {
                self.fail(id, &sched_error(e));
            }
        }
    }

    /// Whether every running request is paused for its reader: a step
    /// would compute nothing.
    fn all_paused(&self) -> bool {
        self.sched.num_waiting() == 0
            && self.exports.is_empty()
            && self.scores.is_empty()
            && self.active.values().all(|a| a.held.is_some())
    }

    /// Whether a step item's last row is sampled (an export's or a
    /// scored text's is not).
    fn samples(&self, item: &tessera_sched::StepItem) -> bool {
        item.wants_logits
            && !self.exports.contains_key(&item.req)
            && !self.scores.contains_key(&item.req)
    }

    /// The logits rows a step item asks the forward for, if any: a
    /// sample's last row, or a scored text's rows in this part.
    fn item_rows(&self, item: &tessera_sched::StepItem) -> Option<ItemRows> {
        let end = item.start + item.tokens.len();
        match self.scores.get(&item.req) {
            Some(s) => s.wanted(item.start, item.tokens.len()).map(|r| ItemRows {
                given: end - r.start,
                kept: r.len(),
                scored: true,
            }),
            // A draft's rows too: each is checked against the guess after it.
            None => self.samples(item).then_some(ItemRows {
                given: item.draft + 1,
                kept: item.draft + 1,
                scored: false,
            }),
        }
    }

    /// Finishes the requests the scheduler ended.
    fn end_scheduled(&mut self, plan: &StepPlan) {
        for &(req, reason) in &plan.ended {
            let unlimited = self
                .active
                .get(&req)
                .is_some_and(|a| a.group.req.max_tokens == GenerateRequest::UNLIMITED);
            match reason {
                EndReason::ContextFull => self.finish(req, FinishReason::Length),
                // No limit asked for: the pool's room for it alone is one.
                EndReason::OutOfKvMemory { .. } if unlimited => {
                    self.finish(req, FinishReason::Length)
                }
                EndReason::OutOfKvMemory { needed, total } => {
                    let e = EngineError::OutOfKvMemory {
                        needed,
                        total,
                        block_size: self.sched.kv().block_size(),
                    };
                    self.fail(req, &e);
                }
            }
        }
    }

    /// A step failed: nothing of it enters the cache; the requests alone in
    /// it fail, the others are retried.
    fn abort(&mut self, plan: &StepPlan, e: &EngineError) {
        if matches!(e, EngineError::Injected) {
            debug!("step failed: {e}");
        } else {
            warn!("step failed: {e}");
        }
        self.totals.failed_steps += 1;
        match self.sched.abort_step(plan) {
            Ok(aborted) => {
                self.end_scheduled(plan);
                for id in aborted.failed {
                    self.fail(id, e);
                }
            }
            Err(bug) => {
                self.fail_all(&EngineError::Step(format!("{e}; undoing it: {bug}")));
            }
        }
        self.check_or_reset();
    }

    /// Applies the plan's KV operations and runs the forward pass; returns
    /// the logits of the items that want them, in order.
    fn execute(&mut self, plan: &StepPlan, rows: &[Option<ItemRows>]) -> Result<Logits> {
        let _span = debug_span!("execute", tokens = plan.num_tokens()).entered();
        for op in &plan.ops {
            match op {
                KvOp::Copy(copies) => self.runner.apply_copies(copies)?,
                KvOp::CopySliding(copies) => self.runner.apply_sliding_copies(copies)?,
                KvOp::Shift { plan, .. } => self.runner.apply_shift(plan)?,
            }
        }
        let split = self.sched.kv().window().is_some();
        let mut parts: Vec<Part> = plan
            .items
            .iter()
            .zip(rows)
            .map(|(i, r)| Part {
                tokens: &i.tokens,
                start: i.start,
                slots: &i.slots,
                table: &i.block_table,
                logits_from: r.map(|r| i.tokens.len() - r.given),
                sliding: split.then(|| sliding_part(&i.sliding_slots, &i.sliding_table)),
                rope: Vec::new(),
            })
            .collect();
        self.maps
            .retain(|id, _| self.active.contains_key(id) || self.scores.contains_key(id));
        let bs = self.sched.kv().block_size();
        for (i, part) in plan.items.iter().zip(&mut parts) {
            if let Some(map) = self.maps.get_mut(&i.req) {
                part.rope = advance(
                    &self.runner,
                    map,
                    part.start,
                    part.tokens.len(),
                    part.table,
                    bs,
                )?;
            }
        }
        self.inject_fault(plan, &parts)?;
        self.runner.forward(&parts)
    }

    /// Asks the fault hook about this step; a chosen fault poisons the
    /// step's slots and then errors or panics.
    fn inject_fault(&self, plan: &StepPlan, parts: &[Part]) -> Result<()> {
        let Some(hook) = &self.cfg.faults else {
            return Ok(());
        };
        let sites: Vec<FaultSite> = plan
            .items
            .iter()
            .filter_map(|i| {
                let a = self.active.get(&i.req)?;
                Some(FaultSite {
                    prompt: &a.group.prompt,
                    sample: a.index,
                    start: i.start,
                    len: i.tokens.len(),
                })
            })
            .collect();
        let Some(fault) = (hook.0)(&sites) else {
            return Ok(());
        };
        let rows = Rows {
            slots: parts
                .iter()
                .flat_map(|p| p.slots.iter().map(|s| s.0))
                .collect(),
            sliding: parts
                .iter()
                .filter_map(|p| p.sliding.as_ref())
                .flat_map(|(s, _)| s.iter().copied())
                .collect(),
        };
        self.runner.poison(&rows)?;
        match fault {
            Fault::Error => Err(EngineError::Injected),
            Fault::Panic => std::panic::panic_any(INJECTED_PANIC),
        }
    }

    /// Samples the next token of `req` (and of its forks, the first time).
    fn on_logits(&mut self, req: ReqId, logits: &[f32]) -> Result<()> {
        let cached = self.sched.cached_tokens(req).ok().flatten();
        let Some(a) = self.active.get_mut(&req) else {
            return Ok(());
        };
        a.cached = a.cached.or(cached);
        let mut ids = vec![req];
        if std::mem::take(&mut a.fork_pending) {
            let (group, started) = (a.group.clone(), a.started);
            for index in 1..group.req.n {
                let child = self.sched.fork(req).map_err(sched_error)?;
                let mut c = Active::new(group.clone(), index);
                c.started = started;
                c.cached = cached;
                self.active.insert(child, c);
                ids.push(child);
            }
        }
        for id in ids {
            let a = self.active.get_mut(&id).expect("active");
            match a.advance(logits, &self.runner.model().tokenizer)? {
                // Its reader is far behind: it waits, computing nothing.
                Next::Continue(t) if a.group.behind() => a.held = Some(t),
                Next::Continue(t) => self.push_next(id, t)?,
                Next::Finish(reason) => self.finish(id, reason),
            }
        }
        Ok(())
    }

    /// Ends a sample: its sequence enters the prefix tree (when caching),
    /// its blocks are freed, and its completion goes to the stream.
    fn finish(&mut self, id: ReqId, reason: FinishReason) {
        let cached = self.sched.cached_tokens(id).ok().flatten();
        let Some(mut a) = self.active.remove(&id) else {
            return;
        };
        if let Some(d) = self.drafts.as_mut() {
            d.release(id, Some(a.history()));
        }
        a.cached = a.cached.or(cached);
        if let Err(e) = self.sched.finish(id) {
            warn!("finishing {id}: {e}");
        }
        let events = a.group.events.clone();
        let done = a.complete(reason, &self.runner.model().tokenizer);
        if done.index == 0 {
            self.totals.requests += 1;
            self.totals.prompt_tokens += done.usage.prompt_tokens as u64;
            self.totals.cached_tokens += done.usage.cached_tokens as u64;
        }
        self.totals.completion_tokens += done.usage.completion_tokens as u64;
        let _ = events.send(Event::Done(Box::new(done)));
    }

    /// Ends a sample (or an export) with an error; what it computed stays
    /// cached.
    fn fail(&mut self, id: ReqId, e: &EngineError) {
        if let Some(d) = self.drafts.as_mut() {
            d.release(id, None);
        }
        if let Some(a) = self.active.remove(&id) {
            self.totals.failed_requests += 1;
            let _ = a.group.events.send(Event::Error(e.again()));
        }
        if let Some(x) = self.exports.remove(&id) {
            let _ = x.reply.send(Err(e.again()));
        }
        if let Some(x) = self.scores.remove(&id) {
            let _ = x.reply.send(Err(e.again()));
        }
        if let Err(e) = self.sched.finish(id) {
            warn!("dropping failed {id}: {e}");
        }
    }

    fn fail_all(&mut self, e: &EngineError) {
        let ids: Vec<ReqId> = self
            .active
            .keys()
            .chain(self.exports.keys())
            .chain(self.scores.keys())
            .copied()
            .collect();
        for id in ids {
            self.fail(id, e);
        }
    }

    /// Between requests: defragment when holes pass the threshold, and
    /// forget partitions with nothing cached once there are many.
    fn idle(&mut self) {
        if self.partitions.len() > PARTITIONS_KEPT {
            let live: std::collections::HashSet<Namespace> = self
                .sched
                .kv()
                .tree()
                .paths()
                .into_iter()
                .map(|p| p.namespace)
                .collect();
            self.partitions.retain(|ns, _| live.contains(ns));
        }
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
        self.runner.apply_copies(&plan.moves)?;
        self.runner.apply_sliding_copies(&plan.sliding_moves)?;
        if !plan.moves.is_empty() || !plan.sliding_moves.is_empty() {
            self.totals.defrags += 1;
        }
        Ok(plan.moves.len() + plan.sliding_moves.len())
    }

    /// Resizes the pool to `blocks`; returns the new number of blocks. A
    /// pool too small for a request it holds (waiting or running), or for
    /// the blocks running requests hold now, is refused, changing nothing.
    fn resize(&mut self, blocks: usize) -> Result<usize> {
        let bs = self.sched.kv().block_size();
        let now = self.sched.kv().pool().num_blocks();
        let oom = |needed| EngineError::OutOfKvMemory {
            needed,
            total: blocks,
            block_size: bs,
        };
        if blocks == 0 {
            return Err(EngineError::Invalid(
                "the KV pool needs at least one block".into(),
            ));
        }
        let needed = self.sched.min_blocks();
        if blocks < needed {
            return Err(oom(needed));
        }
        if blocks < now {
            let kv = self.sched.kv_mut();
            let live = kv.pool().num_live();
            if live > blocks {
                kv.evict(live - blocks)?;
            }
            self.drain_tree_log(true);
            let kv = self.sched.kv_mut();
            let live = kv.pool().num_live();
            if live > blocks {
                return Err(oom(live));
            }
            self.defragment()?;
            self.sched.kv_mut().shrink_to(blocks)?;
            self.runner.resize(blocks)?;
        } else if blocks > now {
            self.runner.resize(blocks)?;
            self.sched.kv_mut().grow_to(blocks)?;
        }
        Ok(blocks)
    }

    fn cancel_all(&mut self) {
        for id in self.active.keys().copied().collect::<Vec<_>>() {
            self.finish(id, FinishReason::Cancelled);
        }
        let side: Vec<ReqId> = self
            .exports
            .keys()
            .chain(self.scores.keys())
            .copied()
            .collect();
        for id in side {
            self.fail(id, &EngineError::Stopped);
        }
    }

    fn shutdown(mut self) {
        self.cancel_all();
    }
}

#[cfg(test)]
mod tests;
