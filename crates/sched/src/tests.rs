//! The scheduler driven by a simulated executor: a shadow KV pool of
//! `(token, position)` per slot, and a "model" whose next token is a hash of
//! the whole context it reads back through the block table. A wrong slot, a
//! missed copy, a bad shift or a stale table changes the context it reads,
//! which the executor checks against the request's tokens at every sample.

use std::collections::HashMap;

use proptest::prelude::*;
use tessera_kv::{token_ids, KvCache, KvConfig, Namespace, Slot, TokenId};

use super::*;

const NS: Namespace = Namespace(7);

struct Sim {
    sched: Scheduler,
    slots: HashMap<u32, (TokenId, usize)>,
    /// The sliding-window layers' pool, when there is one.
    sliding: HashMap<u32, (TokenId, usize)>,
    /// Generated tokens per request, and how many each may make.
    out: HashMap<ReqId, (Vec<u32>, usize)>,
    /// Samples draw from `hash(context) + salt` (forks use different salts).
    salt: HashMap<ReqId, u64>,
    done: Vec<(ReqId, Vec<u32>)>,
    log: Vec<StepPlan>,
    /// Speculative decoding: after each sample, a draft of up to this many
    /// tokens, some right and some wrong (see [`Sim::guess`]).
    spec: usize,
}

/// A draft of up to `most` tokens after `ctx`: the model's own tokens,
/// except that (by the context) it is sometimes shorter and sometimes
/// wrong from some token on, as a real drafter is.
fn guess(ctx: &[TokenId], salt: u64, most: usize) -> Vec<TokenId> {
    let h = hash(ctx, salt ^ 0x5eed) as usize;
    let (n, wrong_from) = (h % (most + 1), (h / 7) % (most + 2));
    let mut ctx = ctx.to_vec();
    let mut out = Vec::new();
    for i in 0..n {
        let t = hash(&ctx, salt);
        let t = if i >= wrong_from { (t + 1) % 1000 } else { t };
        out.push(TokenId(t));
        ctx.push(TokenId(t));
    }
    out
}

fn hash(ctx: &[TokenId], salt: u64) -> u32 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ salt;
    for t in ctx {
        h = (h ^ t.0 as u64).wrapping_mul(0x100_0000_01b3);
    }
    (h % 1000) as u32
}

impl Sim {
    fn new(num_blocks: usize, block_size: usize, cfg: SchedConfig) -> Sim {
        Sim::with_pool(
            KvConfig {
                num_blocks,
                block_size,
                sliding: None,
            },
            cfg,
        )
    }

    fn with_pool(pool: KvConfig, cfg: SchedConfig) -> Sim {
        let kv = KvCache::new(pool).unwrap();
        Sim {
            sched: Scheduler::new(kv, cfg),
            slots: HashMap::new(),
            sliding: HashMap::new(),
            out: HashMap::new(),
            salt: HashMap::new(),
            done: Vec::new(),
            log: Vec::new(),
            spec: 0,
        }
    }

    fn add(&mut self, prompt: &[u32], max_new: usize) -> ReqId {
        self.add_with(prompt, max_new, None)
    }

    fn add_with(&mut self, prompt: &[u32], max_new: usize, shift_keep: Option<usize>) -> ReqId {
        self.add_req(NewRequest {
            namespace: NS,
            prompt: token_ids(prompt),
            max_new_tokens: max_new,
            shift_keep,
            reuse_prefix: true,
            private: false,
            background: false,
        })
    }

    fn add_req(&mut self, r: NewRequest) -> ReqId {
        let max_new = r.max_new_tokens;
        let id = self.sched.add(r).unwrap();
        self.out.insert(id, (Vec::new(), max_new));
        id
    }

    fn bs(&self) -> usize {
        self.sched.kv().block_size()
    }

    fn copy_block(&mut self, src: BlockId, dst: BlockId) {
        let bs = self.bs();
        copy_in(&mut self.slots, bs, src, dst);
    }

    /// One step: plan, apply, check every sampled context, sample.
    fn step(&mut self) {
        let plan = self.sched.schedule().unwrap();
        for op in &plan.ops {
            match op {
                KvOp::Copy(copies) => copies.iter().for_each(|c| self.copy_block(c.src, c.dst)),
                KvOp::CopySliding(copies) => {
                    let bs = self.bs();
                    copies
                        .iter()
                        .for_each(|c| copy_in(&mut self.sliding, bs, c.src, c.dst));
                }
                KvOp::Shift { plan: s, .. } => {
                    s.copies.iter().for_each(|c| self.copy_block(c.src, c.dst));
                    move_in(&mut self.slots, &s.moves, s.position_delta);
                    let bs = self.bs();
                    s.sliding_copies
                        .iter()
                        .for_each(|c| copy_in(&mut self.sliding, bs, c.src, c.dst));
                    move_in(&mut self.sliding, &s.sliding_moves, s.position_delta);
                }
            }
        }
        write_items(self, &plan);
        self.sched.step_done(&plan).unwrap();
        for &(req, _) in &plan.ended {
            let toks = self.sched.finish(req).unwrap();
            let _ = toks;
            let (out, _) = self.out.remove(&req).unwrap();
            self.done.push((req, out));
        }
        self.sample(&plan);
        self.sched.kv().check_invariants().unwrap();
        self.log.push(plan);
    }

    /// Checks the context each item that wants logits reads, and samples.
    fn sample(&mut self, plan: &StepPlan) {
        let bs = self.bs();
        for item in plan.items.iter().filter(|i| i.wants_logits) {
            let len = item.start + item.tokens.len();
            let most = self.sched.config().context_length;
            assert!(
                len <= most,
                "{}: {len} tokens in a context of {most}",
                item.req
            );
            let ctx: Vec<TokenId> = (0..len)
                .map(|p| {
                    let slot = Slot::of(item.block_table[p / bs], p % bs, bs).0;
                    let (t, pos) = self.slots[&slot];
                    assert_eq!(pos, p, "{}: slot {slot} holds position {pos}", item.req);
                    t
                })
                .collect();
            assert_eq!(ctx, self.sched.tokens(item.req).unwrap(), "{}", item.req);
            // The sliding-window layers read the window through their table.
            if let Some(w) = self.sched.kv().window() {
                for (p, &t) in ctx.iter().enumerate().skip(len.saturating_sub(w)) {
                    let b = item.sliding_table[p / bs]
                        .unwrap_or_else(|| panic!("{}: no sliding block at {p}", item.req));
                    let slot = Slot::of(b, p % bs, bs).0;
                    assert_eq!(
                        self.sliding.get(&slot),
                        Some(&(t, p)),
                        "{}: sliding slot {slot} at {p}",
                        item.req
                    );
                }
            }
            let salt = self.salt.get(&item.req).copied().unwrap_or(0);
            // The draft's tokens are accepted while each equals what the
            // model gives at the position before it; the model's token
            // after the last accepted one is sampled as usual.
            let known = len - item.draft;
            let mut accepted = 0;
            while accepted < item.draft
                && hash(&ctx[..known + accepted], salt) == ctx[known + accepted].0
            {
                accepted += 1;
            }
            let (out, max) = self.out.get_mut(&item.req).unwrap();
            let mut end = false;
            for i in 0..=accepted {
                out.push(hash(&ctx[..known + i], salt));
                if out.len() >= *max {
                    end = true;
                    break;
                }
            }
            if end {
                let out = std::mem::take(out);
                self.out.remove(&item.req);
                self.sched.finish(item.req).unwrap();
                self.done.push((item.req, out));
                continue;
            }
            let left = *max - out.len();
            let next = *out.last().unwrap();
            if item.draft > 0 {
                self.sched.settle_draft(item.req, accepted).unwrap();
            }
            assert_eq!(
                self.sched.kv().sequence(item.seq).map(|s| s.len()).ok(),
                Some(known + accepted),
                "{}: settled",
                item.req
            );
            if self.spec > 0 && left > 1 {
                let mut ctx = ctx[..known + accepted].to_vec();
                ctx.push(TokenId(next));
                let draft = guess(&ctx, salt, self.spec.min(left - 1));
                self.sched
                    .push_draft(item.req, TokenId(next), &draft)
                    .unwrap();
            } else {
                self.sched.push_token(item.req, TokenId(next)).unwrap();
            }
        }
    }

    fn run_until(&mut self, done: impl Fn(&Sim) -> bool) {
        let mut steps = 0;
        while !done(self) {
            self.step();
            steps += 1;
            assert!(steps < 100_000, "no progress");
        }
    }

    fn run(&mut self) {
        let mut steps = 0;
        while self.sched.has_work() {
            self.step();
            steps += 1;
            assert!(steps < 100_000, "no progress");
        }
    }

    fn outputs(&self) -> HashMap<ReqId, Vec<u32>> {
        self.done.iter().cloned().collect()
    }
}

fn cfg(max_batch_tokens: usize, max_running: usize) -> SchedConfig {
    SchedConfig {
        max_batch_tokens,
        max_running,
        max_wait_steps: 64,
        prefix_cache: true,
        context_length: 4096,
        background_tokens: 16,
    }
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 1000 + seed * 7919 + i).collect()
}

#[test]
fn prefill_is_chunked_inside_the_budget_and_decodes_go_first() {
    let mut sim = Sim::new(64, 4, cfg(16, 8));
    let a = sim.add(&prompt(1, 10), 5);
    sim.step();
    assert_eq!(sim.log[0].items.len(), 1);
    assert!(sim.log[0].items[0].wants_logits);
    let b = sim.add(&prompt(2, 40), 3);
    sim.step();
    // a decodes (1 token), b gets the other 15 of the budget.
    let plan = &sim.log[1];
    assert_eq!(plan.items[0].req, a);
    assert_eq!(plan.items[0].tokens.len(), 1);
    assert_eq!((plan.items[1].req, plan.items[1].tokens.len()), (b, 15));
    assert!(!plan.items[1].wants_logits);
    sim.run();
    assert!(sim.log.iter().all(|p| p.num_tokens() <= 16));
    assert_eq!(sim.outputs()[&b].len(), 3);
}

#[test]
fn longest_cached_prefix_is_admitted_first() {
    let mut sim = Sim::new(256, 4, cfg(512, 1));
    let base = prompt(1, 40);
    sim.add(&base, 2);
    sim.run();
    let cold = sim.add(&prompt(2, 40), 2);
    let mut longer = base.clone();
    longer.extend([5, 6, 7]);
    let warm = sim.add(&longer, 2);
    sim.step();
    let first = &sim.log.last().unwrap().items[0];
    assert_eq!(first.req, warm);
    // The first request cached its prompt and the token it generated.
    assert_eq!(first.start, 40, "the cached prompt tokens are skipped");
    sim.run();
    assert_eq!(sim.sched.cached_tokens(cold).ok(), None, "finished");
    assert_eq!(sim.outputs().len(), 3);
}

#[test]
fn a_request_without_prefix_reuse_computes_everything_and_the_cache_keeps_one_copy() {
    let mut sim = Sim::new(256, 4, cfg(512, 4));
    let base = prompt(1, 40);
    let first = sim.add(&base, 2);
    sim.run();
    let live = sim.sched.kv().pool().num_live();
    let again = sim.add_req(NewRequest {
        namespace: NS,
        prompt: token_ids(&base),
        max_new_tokens: 2,
        shift_keep: None,
        reuse_prefix: false,
        private: false,
        background: false,
    });
    sim.step();
    let item = &sim.log.last().unwrap().items[0];
    assert_eq!((item.req, item.start, item.tokens.len()), (again, 0, 40));
    assert_eq!(sim.sched.cached_tokens(again).unwrap(), Some(0));
    sim.run();
    let out = sim.outputs();
    assert_eq!(out[&first], out[&again], "same context, same tokens");
    assert_eq!(sim.sched.kv().pool().num_live(), live, "one copy cached");
    // Its blocks deduplicated into the tree: a third request reuses the
    // prompt, and the pool holds the path once.
    let warm = sim.add(&base, 1);
    sim.step();
    assert_eq!(sim.log.last().unwrap().items[0].start, 39);
    sim.run();
    assert_eq!(sim.outputs()[&warm].len(), 1);
    assert_no_leak(&sim);
}

#[test]
fn a_request_passed_over_too_long_goes_first() {
    let mut c = cfg(512, 1);
    c.max_wait_steps = 3;
    let mut sim = Sim::new(256, 4, c);
    let base = prompt(1, 40);
    sim.add(&base, 1);
    sim.run();
    let cold = sim.add(&prompt(2, 20), 1);
    // Keep a warm request waiting at every step: without the bound the cold
    // one would never run.
    let mut admitted = Vec::new();
    for i in 0..8 {
        let mut p = base.clone();
        p.push(i);
        sim.add(&p, 1);
        sim.step();
        admitted.extend(sim.log.last().unwrap().items.iter().map(|i| i.req));
    }
    let at = admitted.iter().position(|&r| r == cold).expect("cold ran");
    assert!((3..=5).contains(&at), "admitted at step {at}: {admitted:?}");
}

/// The requests of the last step's items, in order.
fn last_step_reqs(sim: &Sim) -> Vec<ReqId> {
    let plan = sim.log.last().expect("a step ran");
    plan.items.iter().map(|i| i.req).collect()
}

#[test]
fn a_request_held_for_room_waits_while_others_run_and_only_then() {
    let mut sim = Sim::new(64, 4, cfg(16, 4));
    let a = sim.add(&prompt(1, 8), 6);
    sim.step();
    let held = sim.add(&prompt(2, 8), 2);
    let behind = sim.add(&prompt(3, 8), 2);
    // Held while `a` runs: neither it nor the request behind it is
    // admitted, though both fit.
    for _ in 0..3 {
        sim.sched.hold_for_room([held]);
        sim.step();
        assert_eq!(last_step_reqs(&sim), [a]);
    }
    // One step's hold only: the next step admits both.
    sim.step();
    assert_eq!(last_step_reqs(&sim), [a, held, behind]);
    sim.run();
    // With nothing running a hold would wait for nothing: ignored.
    let alone = sim.add(&prompt(4, 8), 1);
    sim.sched.hold_for_room([alone]);
    sim.step();
    assert_eq!(sim.log.last().unwrap().items[0].req, alone);
    sim.run();
    assert_eq!(sim.outputs().len(), 4);
    assert_no_leak(&sim);
}

#[test]
fn out_of_blocks_preempts_the_newest_and_it_resumes_from_cache() {
    // 10 blocks of 4: two requests of 8 prompt + 24 new tokens (8 blocks
    // each at the end) cannot both finish.
    let mut sim = Sim::new(10, 4, cfg(64, 8));
    let a = sim.add(&prompt(1, 8), 24);
    let b = sim.add(&prompt(2, 8), 24);
    sim.run();
    let preempted: Vec<ReqId> = sim.log.iter().flat_map(|p| p.preempted.clone()).collect();
    assert!(!preempted.is_empty());
    assert!(preempted.iter().all(|&r| r == b), "{preempted:?}");
    // Re-admitted b starts past its cached prefix, not at 0.
    let first_preempt = sim
        .log
        .iter()
        .position(|p| !p.preempted.is_empty())
        .unwrap();
    let readmit = sim.log[first_preempt + 1..]
        .iter()
        .flat_map(|p| &p.items)
        .find(|i| i.req == b)
        .unwrap();
    assert!(readmit.start > 0, "recompute reused the cache");
    assert!(sim.sched.stats().preemptions >= 1);

    let mut big = Sim::new(64, 4, cfg(64, 8));
    big.add(&prompt(1, 8), 24);
    big.add(&prompt(2, 8), 24);
    big.run();
    assert_eq!(sim.outputs()[&a], big.outputs()[&a]);
    assert_eq!(sim.outputs()[&b], big.outputs()[&b]);
}

#[test]
fn requests_that_cannot_fit_alone_are_rejected_with_numbers() {
    let mut sim = Sim::new(8, 4, cfg(64, 8));
    let err = sim
        .sched
        .add(NewRequest {
            namespace: NS,
            prompt: token_ids(&prompt(1, 20)),
            max_new_tokens: 20,
            shift_keep: None,
            reuse_prefix: true,
            private: false,
            background: false,
        })
        .unwrap_err();
    assert_eq!(
        err,
        SchedError::TooLarge {
            needed: 10,
            total: 8,
            block_size: 4
        }
    );
    assert!(err.to_string().contains("10 blocks"));
    let mut c = cfg(64, 8);
    c.context_length = 16;
    let mut sim = Sim::new(8, 4, c);
    let err = sim
        .sched
        .add(NewRequest {
            namespace: NS,
            prompt: token_ids(&prompt(1, 20)),
            max_new_tokens: 1,
            shift_keep: None,
            reuse_prefix: true,
            private: false,
            background: false,
        })
        .unwrap_err();
    assert_eq!(
        err,
        SchedError::PromptTooLong {
            tokens: 20,
            context: 16
        }
    );
}

#[test]
fn context_shift_goes_on_past_four_contexts_and_off_ends_the_request() {
    let mut c = cfg(64, 8);
    c.context_length = 32;
    let mut sim = Sim::new(32, 4, c.clone());
    let a = sim.add_with(&prompt(1, 10), 150, Some(6));
    sim.run();
    assert_eq!(sim.outputs()[&a].len(), 150);
    assert!(sim.sched.stats().shifts >= 4);
    assert!(sim
        .log
        .iter()
        .all(|p| p.items.iter().all(|i| i.start + i.tokens.len() <= 32)));

    let mut sim = Sim::new(32, 4, c);
    let b = sim.add_with(&prompt(1, 10), 150, None);
    sim.run();
    assert_eq!(sim.outputs()[&b].len(), 32 - 10 + 1);
    assert!(sim
        .log
        .iter()
        .any(|p| p.ended == vec![(b, EndReason::ContextFull)]));
}

#[test]
fn forks_continue_independently_on_shared_blocks() {
    let mut sim = Sim::new(64, 4, cfg(64, 8));
    let a = sim.add(&prompt(1, 10), 1);
    // Run the prefill only, then fork before sampling.
    let plan = sim.sched.schedule().unwrap();
    for item in &plan.items {
        for (j, (t, s)) in item.tokens.iter().zip(&item.slots).enumerate() {
            sim.slots.insert(s.0, (*t, item.start + j));
        }
    }
    sim.sched.step_done(&plan).unwrap();
    let kids: Vec<ReqId> = (1..3).map(|_| sim.sched.fork(a).unwrap()).collect();
    sim.out.insert(a, (Vec::new(), 12));
    for (i, &k) in kids.iter().enumerate() {
        sim.out.insert(k, (Vec::new(), 12));
        sim.salt.insert(k, i as u64 + 1);
    }
    for (i, id) in std::iter::once(a).chain(kids.clone()).enumerate() {
        sim.sched.push_token(id, TokenId(i as u32)).unwrap();
    }
    let used_after_fork = sim.sched.kv().stats().used_blocks;
    assert_eq!(used_after_fork, 3, "three sequences share 3 prompt blocks");
    sim.run();
    let outs = sim.outputs();
    assert_eq!(outs.len(), 3);
    assert_ne!(outs[&a], outs[&kids[0]]);
    assert_ne!(outs[&kids[0]], outs[&kids[1]]);
}

#[test]
fn requests_arriving_together_compute_a_shared_prefix_once() {
    let mut sim = Sim::new(512, 4, cfg(64, 16));
    let shared = prompt(0, 100);
    let ids: Vec<ReqId> = (0..8)
        .map(|i| {
            let mut p = shared.clone();
            p.extend(prompt(i + 1, 10));
            sim.add(&p, 2)
        })
        .collect();
    sim.run();
    let computed: usize = sim.log.iter().map(|p| p.num_tokens()).sum();
    // The prefix once, 8 suffixes of 10, and one decode step each.
    assert_eq!(computed, 100 + 8 * 10 + 8);
    assert_eq!(sim.outputs().len(), ids.len());
}

#[test]
fn finishing_a_waiting_request_cancels_it() {
    let mut sim = Sim::new(64, 4, cfg(8, 1));
    let a = sim.add(&prompt(1, 20), 4);
    let b = sim.add(&prompt(2, 20), 4);
    sim.step();
    sim.sched.finish(b).unwrap();
    sim.out.remove(&b);
    sim.run();
    assert_eq!(sim.outputs().keys().copied().collect::<Vec<_>>(), vec![a]);
    assert_eq!(sim.sched.kv().stats().used_blocks, 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    /// Any pool that fits each request alone gives every request the output
    /// of a pool that fits them all, whatever the budget and arrival order.
    #[test]
    fn small_pools_give_the_outputs_of_large_ones(
        reqs in prop::collection::vec((0u32..4, 1usize..30, 1usize..20), 1..8),
        budget in 1usize..48,
        running in 1usize..6,
        shared in 0usize..20,
    ) {
        let bs = 4;
        let need = reqs.iter().map(|&(_, p, n)| (shared + p + n).div_ceil(bs)).max().unwrap();
        let run = |blocks: usize| {
            let mut sim = Sim::new(blocks, bs, cfg(budget, running));
            let ids: Vec<ReqId> = reqs
                .iter()
                .map(|&(seed, len, max_new)| {
                    let mut p = prompt(0, shared);
                    p.extend(prompt(seed + 1, len));
                    sim.add(&p, max_new)
                })
                .collect();
            sim.run();
            let outs = sim.outputs();
            (ids.iter().map(|i| outs[i].clone()).collect::<Vec<_>>(), sim.sched.stats())
        };
        let (small, _) = run(need);
        let (large, _) = run(need * reqs.len() + 8);
        prop_assert_eq!(small, large);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// With sliding-window layers, a sliding pool just big enough for one
    /// request's window and chunk gives every request the output of a pool
    /// with no sliding layers (the sampler checks each window's content).
    /// With context shifts (whose arithmetic a preemption at the limit
    /// changes) every request still finishes reading whole windows.
    #[test]
    fn sliding_pools_of_any_size_give_the_outputs_of_full_attention(
        reqs in prop::collection::vec((0u32..4, 1usize..30, 1usize..20, any::<bool>()), 1..8),
        budget in 1usize..24,
        running in 1usize..6,
        shared in 0usize..20,
        window in prop::sample::select(vec![2usize, 3, 5, 9]),
        extra in 0usize..12,
    ) {
        let bs = 4;
        let mut c = cfg(budget, running);
        c.context_length = 40;
        let need = reqs.iter().map(|&(_, p, n, _)| (shared + p + n).min(40).div_ceil(bs)).max().unwrap();
        // A window, a chunk, and the block of the 3 tokens a shift keeps.
        let least = (window + budget).div_ceil(bs) + 2;
        let run = |sliding: Option<usize>, shifts: bool| {
            let pool = KvConfig {
                num_blocks: 2 * need + 4,
                block_size: bs,
                sliding: sliding.map(|num_blocks| tessera_kv::SlidingConfig { window, num_blocks }),
            };
            let mut sim = Sim::with_pool(pool, c.clone());
            let ids: Vec<ReqId> = reqs
                .iter()
                .map(|&(seed, len, max_new, shift)| {
                    let mut p = prompt(0, shared);
                    p.extend(prompt(seed + 1, len));
                    p.truncate(40);
                    sim.add_with(&p, max_new, (shift && shifts).then_some(3))
                })
                .collect();
            sim.run();
            assert_no_leak(&sim);
            let outs = sim.outputs();
            ids.iter().map(|i| outs[i].clone()).collect::<Vec<_>>()
        };
        prop_assert_eq!(run(Some(least + extra), false), run(None, false));
        run(Some(least + extra), true);
    }
}

/// Writes the plan's tokens into the shadow pool as a forward pass would,
/// without marking anything computed.
fn write_items(sim: &mut Sim, plan: &StepPlan) {
    for item in &plan.items {
        for (j, (t, s)) in item.tokens.iter().zip(&item.slots).enumerate() {
            sim.slots.insert(s.0, (*t, item.start + j));
        }
        for (j, (t, s)) in item.tokens.iter().zip(&item.sliding_slots).enumerate() {
            if s.0 != u32::MAX {
                sim.sliding.insert(s.0, (*t, item.start + j));
            }
        }
    }
}

fn copy_in(cells: &mut HashMap<u32, (TokenId, usize)>, bs: usize, src: BlockId, dst: BlockId) {
    for o in 0..bs {
        let from = Slot::of(src, o, bs).0;
        let to = Slot::of(dst, o, bs).0;
        match cells.get(&from).copied() {
            Some(v) => cells.insert(to, v),
            None => cells.remove(&to),
        };
    }
}

fn move_in(cells: &mut HashMap<u32, (TokenId, usize)>, moves: &[tessera_kv::SlotMove], delta: i64) {
    for m in moves {
        let (t, p) = cells[&m.src.0];
        cells.insert(m.dst.0, (t, (p as i64 + delta) as usize));
    }
}

/// With every request done, no block is held but by the prefix tree.
fn assert_no_leak(sim: &Sim) {
    let kv = sim.sched.kv();
    kv.check_invariants().unwrap();
    let stats = kv.stats();
    assert_eq!((stats.sequences, stats.used_blocks), (0, 0), "{stats:?}");
}

/// Every token the prefix tree would serve is one the shadow pool holds at
/// its position: nothing unwritten is matchable.
fn assert_tree_written(sim: &Sim) {
    let bs = sim.bs();
    for path in sim.sched.kv().tree().paths() {
        let m = sim
            .sched
            .kv()
            .tree()
            .peek_prefix(path.namespace, &path.tokens);
        for (p, t) in path.tokens.iter().enumerate().take(m.len) {
            let slot = Slot::of(m.blocks[p / bs], p % bs, bs).0;
            assert_eq!(sim.slots.get(&slot), Some(&(*t, p)), "cached position {p}");
        }
    }
}

#[test]
fn an_aborted_step_of_several_requests_retries_them_alone_with_the_same_outputs() {
    let reference = {
        let mut sim = Sim::new(64, 4, cfg(16, 8));
        for i in 0..3 {
            sim.add(&prompt(i, 11), 6);
        }
        sim.run();
        sim.outputs()
    };
    let mut sim = Sim::new(64, 4, cfg(16, 8));
    let ids: Vec<ReqId> = (0..3).map(|i| sim.add(&prompt(i, 11), 6)).collect();
    sim.step();
    sim.step();
    // The third step fails after writing garbage into every slot it had.
    let plan = sim.sched.schedule().unwrap();
    assert!(plan.items.len() > 1);
    for s in plan.items.iter().flat_map(|i| &i.slots) {
        sim.slots.insert(s.0, (TokenId(u32::MAX), usize::MAX));
    }
    let aborted = sim.sched.abort_step(&plan).unwrap();
    assert!(aborted.failed.is_empty());
    assert_eq!(aborted.retried.len(), plan.items.len());
    sim.sched.kv().check_invariants().unwrap();
    assert_tree_written(&sim);
    // Each retried request runs alone until it is past the failed step.
    let log_from = sim.log.len();
    sim.run();
    for p in &sim.log[log_from..log_from + aborted.retried.len()] {
        assert_eq!(p.items.len(), 1, "{p:?}");
    }
    assert_eq!(sim.outputs(), reference);
    assert_no_leak(&sim);
    assert!(ids.iter().all(|i| sim.outputs().contains_key(i)));
    assert_tree_written(&sim);
}

#[test]
fn an_aborted_step_of_one_request_fails_it_and_frees_everything_unwritten() {
    let mut sim = Sim::new(64, 4, cfg(8, 8));
    let a = sim.add(&prompt(1, 30), 4);
    sim.step();
    let plan = sim.sched.schedule().unwrap();
    assert_eq!(plan.items.len(), 1);
    let aborted = sim.sched.abort_step(&plan).unwrap();
    assert_eq!(aborted.failed, vec![a]);
    sim.sched.finish(a).unwrap();
    sim.out.remove(&a);
    sim.sched.kv().check_invariants().unwrap();
    assert!(!sim.sched.has_work());
    // Only the first chunk (8 tokens, 2 whole blocks) was computed.
    assert_eq!(sim.sched.kv().tree().cached_tokens(), 8);
    assert_tree_written(&sim);
    // A later request with the same prompt reuses just that and finishes.
    let b = sim.add(&prompt(1, 30), 4);
    sim.run();
    assert_no_leak(&sim);
    assert_eq!(sim.outputs()[&b].len(), 4);
}

#[test]
fn a_request_that_no_longer_fits_the_pool_ends_instead_of_waiting_forever() {
    let mut sim = Sim::new(16, 4, cfg(64, 1));
    let a = sim.add(&prompt(1, 20), 4);
    let b = sim.add(&prompt(2, 40), 8);
    assert_eq!(sim.sched.min_blocks(), 12);
    sim.run_until(|s| s.done.iter().any(|(r, _)| *r == a));
    // The pool shrinks below what b needs while it waits.
    sim.sched.kv_mut().clear_cache().unwrap();
    sim.sched.kv_mut().shrink_to(8).unwrap();
    let mut ended = Vec::new();
    for _ in 0..4 {
        if !sim.sched.has_work() {
            break;
        }
        sim.step();
        ended.extend(sim.log.last().unwrap().ended.clone());
    }
    assert_eq!(
        ended,
        vec![(
            b,
            EndReason::OutOfKvMemory {
                needed: 10,
                total: 8
            }
        )]
    );
    assert!(!sim.sched.has_work());
    assert_eq!(sim.sched.min_blocks(), 0);
}

#[test]
fn a_request_pinned_by_its_own_match_evicts_only_what_it_needs() {
    let mut sim = Sim::new(12, 4, cfg(64, 4));
    // Three cached conversations of 3 blocks each (8 prompt + 1 generated,
    // then the request ends).
    for i in 0..3 {
        sim.add(&prompt(i, 8), 1);
        sim.run();
    }
    let before = sim.sched.kv().tree().cached_tokens();
    assert_eq!(before, 24);
    // A long continuation of the newest one needs 10 blocks.
    let mut long = prompt(2, 8);
    long.extend(prompt(9, 29));
    let q = sim.add(&long, 2);
    sim.run();
    assert_eq!(sim.outputs()[&q].len(), 2);
    assert_eq!(sim.sched.cached_tokens(q).ok(), None);
    let evicted = sim.sched.kv().stats().evicted_blocks;
    assert!(
        evicted <= 8,
        "evicted {evicted} blocks for a request of 10 in a pool of 12"
    );
    // Its 38 tokens, and one of the other conversations.
    assert!(sim.sched.kv().tree().cached_tokens() >= 38 + 8);
}

type RandomReq = (u32, usize, usize, bool);

/// Runs `reqs` (seed, prompt length, new tokens, shift) with the steps
/// marked in `faults` failing after writing garbage, `cancel_at`
/// (request, step) cancellations, and a fork of the first request to sample;
/// returns the outputs and the failed or cancelled requests.
fn faulty_run(
    reqs: &[RandomReq],
    faults: &[bool],
    cancel_at: &[(usize, usize)],
    fork_first: bool,
    blocks: usize,
) -> (HashMap<ReqId, Vec<u32>>, Vec<ReqId>) {
    let bs = 4;
    let mut c = cfg(12, 4);
    c.context_length = 36;
    let mut sim = Sim::new(blocks, bs, c);
    let mut ids = Vec::new();
    for &(seed, len, max_new, shift) in reqs {
        let most = (len + max_new).min(36).div_ceil(bs);
        if most > blocks {
            continue;
        }
        ids.push(sim.add_with(&prompt(seed, len), max_new, shift.then_some(4)));
    }
    if fork_first && !ids.is_empty() {
        // The first request to finish its prompt is forked before it
        // samples; both then sample as usual.
        let mut plan = sim.sched.schedule().unwrap();
        write_items(&mut sim, &plan);
        sim.sched.step_done(&plan).unwrap();
        if let Some(first) = plan.items.iter().find(|i| i.wants_logits).cloned() {
            let child = sim.sched.fork(first.req).unwrap();
            let max = sim.out[&first.req].1;
            sim.out.insert(child, (Vec::new(), max));
            sim.salt.insert(child, 99);
            plan.items.push(StepItem {
                req: child,
                ..first
            });
        }
        sim.sample(&plan);
    }
    let mut failed = Vec::new();
    let mut steps = 0;
    while sim.sched.has_work() {
        for &(which, at) in cancel_at {
            if at == steps {
                if let Some(&id) = ids.get(which) {
                    if sim.out.remove(&id).is_some() {
                        sim.sched.finish(id).unwrap();
                        failed.push(id);
                    }
                }
            }
        }
        if faults.get(steps).copied().unwrap_or(false) {
            let plan = sim.sched.schedule().unwrap();
            for s in plan.items.iter().flat_map(|i| &i.slots) {
                sim.slots.insert(s.0, (TokenId(u32::MAX), usize::MAX));
            }
            let aborted = sim.sched.abort_step(&plan).unwrap();
            for &(req, _) in &plan.ended {
                sim.sched.finish(req).unwrap();
                let (out, _) = sim.out.remove(&req).unwrap();
                sim.done.push((req, out));
            }
            for id in aborted.failed {
                sim.sched.finish(id).unwrap();
                sim.out.remove(&id);
                failed.push(id);
            }
            sim.sched.kv().check_invariants().unwrap();
            assert_tree_written(&sim);
        } else if sim.sched.has_work() {
            sim.step();
            assert_tree_written(&sim);
        }
        steps += 1;
        assert!(steps < 5_000, "no progress");
    }
    assert_no_leak(&sim);
    assert_eq!(sim.done.len() + failed.len(), sim.salt.len() + ids.len());
    (sim.outputs(), failed)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Steps that fail at random (several requests, forks, context shifts,
    /// cancellations) never leak a block or make an unwritten slot
    /// matchable, and every request that is not failed gives the output it
    /// gives without faults.
    #[test]
    fn random_failures_cancels_forks_and_shifts_keep_the_cache_sound(
        reqs in prop::collection::vec((0u32..4, 1usize..24, 1usize..16, any::<bool>()), 1..6),
        faults in prop::collection::vec(any::<bool>(), 0..40),
        cancel_at in prop::collection::vec((0usize..6, 0usize..30), 0..3),
        fork_first in any::<bool>(),
        blocks in 10usize..40,
    ) {
        let (outs, failed) = faulty_run(&reqs, &faults, &cancel_at, fork_first, blocks);
        let (clean, none) = faulty_run(&reqs, &[], &[], fork_first, blocks);
        prop_assert!(none.is_empty());
        for (id, out) in &outs {
            prop_assert!(!failed.contains(id));
            prop_assert_eq!(Some(out), clean.get(id), "{}", id);
        }
    }
}

/// The bookkeeping crates stay free of tensors: neither tessera-kv nor
/// tessera-sched depends, even indirectly, on candle or the crates that use
/// it.
#[test]
fn kv_and_sched_depend_on_no_tensor_crate() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args([
            "tree",
            "-p",
            "tessera-sched",
            "-e",
            "normal",
            "--prefix",
            "none",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(tree.contains("tessera-kv"), "{tree}");
    for line in tree.lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        assert!(
            !name.starts_with("candle")
                && ![
                    "tessera-kernels",
                    "tessera-model",
                    "tessera-engine",
                    "half",
                    "gemm"
                ]
                .contains(&name),
            "tessera-sched pulls in {name}:\n{tree}"
        );
    }
}

/// Finishing requests whose planned step never ran (the engine failing
/// everything after an error) frees them without caching what was not
/// computed, and leaves nothing running.
#[test]
fn finishing_requests_with_unwritten_tokens_frees_them_uncached() {
    let mut sim = Sim::new(64, 4, cfg(8, 8));
    let a = sim.add(&prompt(1, 30), 4);
    let b = sim.add(&prompt(2, 6), 4);
    sim.step();
    // Planned, never carried out.
    let plan = sim.sched.schedule().unwrap();
    assert!(!plan.items.is_empty());
    for id in [a, b] {
        sim.sched.finish(id).unwrap();
        sim.out.remove(&id);
    }
    assert!(!sim.sched.has_work());
    assert_no_leak(&sim);
    assert_tree_written(&sim);
    assert!(matches!(
        sim.sched.finish(a),
        Err(SchedError::UnknownRequest(r)) if r == a
    ));
}

/// A private request (SelfExtend's rotated keys) computes its whole prompt
/// though the tree holds it, and leaves nothing in the tree; the same
/// outputs as a shared one.
#[test]
fn private_requests_neither_read_nor_fill_the_prefix_tree() {
    let mut sim = Sim::new(64, 4, cfg(64, 8));
    let shared = sim.add(&prompt(1, 12), 4);
    sim.run();
    let held = sim.sched.kv().stats().cached_tokens;
    assert!(held >= 12);
    let private = sim.add_req(NewRequest {
        namespace: NS,
        prompt: token_ids(&prompt(1, 12)),
        max_new_tokens: 4,
        shift_keep: None,
        reuse_prefix: true,
        private: true,
        background: false,
    });
    sim.run();
    let computed: usize = sim
        .log
        .iter()
        .flat_map(|p| &p.items)
        .filter(|i| i.req == private)
        .map(|i| i.tokens.len())
        .sum();
    assert_eq!(computed, 12 + 3, "every prompt token computed");
    assert_eq!(sim.sched.kv().stats().cached_tokens, held, "nothing added");
    assert_eq!(sim.outputs()[&private], sim.outputs()[&shared]);
}

/// A background request (a session save's prefill) rides along other
/// requests' steps a few tokens at a time, is admitted after the
/// foreground requests waiting beside it, and takes whole chunks once it
/// is alone; what it computes is the same K/V.
#[test]
fn a_background_request_takes_a_small_share_beside_others_and_all_alone() {
    let mut sim = Sim::new(512, 4, cfg(64, 8));
    let fg = sim.add(&prompt(1, 8), 30);
    sim.step();
    let bg = sim.add_req(NewRequest {
        namespace: NS,
        prompt: token_ids(&prompt(2, 600)),
        max_new_tokens: 1,
        shift_keep: None,
        reuse_prefix: true,
        private: false,
        background: true,
    });
    let late = sim.add(&prompt(3, 40), 4);
    sim.step();
    let items = &sim.log.last().unwrap().items;
    let share = |items: &[StepItem], r: ReqId| {
        items
            .iter()
            .find(|i| i.req == r)
            .map_or(0, |i| i.tokens.len())
    };
    assert_eq!(share(items, late), 40, "the foreground request first");
    assert!(share(items, bg) <= 16, "{}", share(items, bg));
    let mut alone = false;
    while sim.sched.has_work() {
        sim.step();
        let items = &sim.log.last().unwrap().items;
        let others = items.iter().any(|i| i.req != bg);
        let n = share(items, bg);
        if others {
            assert!(n <= 16, "beside others: {n} tokens");
        } else if n > 16 {
            alone = true;
        }
    }
    assert!(alone, "alone it took more than the background share");
    let out = sim.outputs();
    assert_eq!(out[&fg].len(), 30);
    assert_eq!(out[&bg].len(), 1);
}

/// K/V placed from outside between steps: written, it enters the tree (a
/// second placement finds it all cached and needs no slot); not written,
/// nothing is cached; no room is an error with the numbers, and leaves no
/// block held.
#[test]
fn placed_kv_enters_the_tree_only_when_written() {
    let mut sim = Sim::new(8, 4, cfg(64, 8));
    let toks = token_ids(&prompt(3, 10));
    let p = sim.sched.place_kv(NS, &toks, 0).unwrap();
    assert_eq!((p.cached, p.plan.slots.len()), (0, 10));
    assert_eq!(sim.sched.end_placement(p, true).unwrap(), 10);
    let again = sim.sched.place_kv(NS, &toks, 0).unwrap();
    assert_eq!((again.cached, again.plan.slots.len()), (10, 0));
    assert_eq!(sim.sched.end_placement(again, true).unwrap(), 0);

    let other = token_ids(&prompt(4, 6));
    let p = sim.sched.place_kv(NS, &other, 0).unwrap();
    assert_eq!(sim.sched.end_placement(p, false).unwrap(), 0);
    let p = sim.sched.place_kv(NS, &other, 0).unwrap();
    assert_eq!(p.cached, 0, "an unwritten placement left nothing cached");
    sim.sched.end_placement(p, false).unwrap();

    let huge = token_ids(&prompt(5, 40));
    let err = sim.sched.place_kv(NS, &huge, 0).unwrap_err();
    assert!(
        matches!(err, SchedError::TooLarge { total: 8, .. }),
        "{err}"
    );
    let kv = sim.sched.kv();
    assert_eq!(kv.stats().sequences, 0);
    kv.check_invariants().unwrap();
}

/// A request started over (here: its step failed) after its context filled
/// shifts before it computes again, as it would have running: it never
/// computes past the context, and its tokens are those of a run without
/// the failure (a case proptest found).
#[test]
fn a_request_started_over_past_a_full_context_shifts_first() {
    let reqs = [
        (0, 15, 3, false),
        (1, 1, 2, false),
        (0, 1, 2, false),
        (0, 23, 15, true),
    ];
    let faults = [false, true, false, false, false, false];
    let (outs, failed) = faulty_run(&reqs, &faults, &[], true, 13);
    let (clean, _) = faulty_run(&reqs, &[], &[], true, 13);
    assert!(failed.is_empty());
    assert_eq!(outs, clean);
}

#[test]
fn a_draft_is_computed_in_one_step_and_what_is_rejected_rolls_back() {
    let mut sim = Sim::new(64, 4, cfg(64, 4));
    let a = sim.add(&prompt(1, 9), 40);
    sim.spec = 5;
    sim.run();
    // Drafts ran: items of a sampled token and guesses, in one step each.
    let drafted: Vec<&StepItem> = sim
        .log
        .iter()
        .flat_map(|p| &p.items)
        .filter(|i| i.draft > 0)
        .collect();
    assert!(!drafted.is_empty());
    assert!(drafted
        .iter()
        .all(|i| i.wants_logits && i.tokens.len() == i.draft + 1));
    // The same output as one token a step, in fewer steps.
    let spec = sim.outputs()[&a].clone();
    let steps = sim.log.len();
    let mut plain = Sim::new(64, 4, cfg(64, 4));
    let b = plain.add(&prompt(1, 9), 40);
    plain.run();
    assert_eq!(spec, plain.outputs()[&b]);
    assert!(
        steps < plain.log.len(),
        "{steps} steps against {}",
        plain.log.len()
    );
    assert_no_leak(&sim);
}

#[test]
fn a_draft_is_cut_to_the_budget_and_dropped_by_preemption() {
    // A budget of 3: drafts of at most 2; two requests in a pool that
    // fits one at a time, so the second preempts the first's drafts away.
    let mut sim = Sim::new(12, 4, cfg(3, 2));
    sim.spec = 6;
    let a = sim.add(&prompt(1, 10), 30);
    let b = sim.add(&prompt(2, 10), 30);
    sim.run();
    assert!(sim.log.iter().all(|p| p.num_tokens() <= 3));
    assert!(sim.log.iter().flat_map(|p| &p.items).all(|i| i.draft <= 2));
    let mut plain = Sim::new(64, 4, cfg(16, 2));
    let (pa, pb) = (plain.add(&prompt(1, 10), 30), plain.add(&prompt(2, 10), 30));
    plain.run();
    assert_eq!(sim.outputs()[&a], plain.outputs()[&pa]);
    assert_eq!(sim.outputs()[&b], plain.outputs()[&pb]);
    assert_no_leak(&sim);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Speculative decoding (drafts partly right, partly wrong, cut by the
    /// budget, the context and preemption) gives every request the output
    /// of one token a step: in any pool that fits each request alone, and
    /// with context shifts in a large one (a shift in a pool that fits
    /// only the request may end it for want of room for the shift's
    /// copies, with or without drafts, depending on what else ran).
    #[test]
    fn drafts_give_the_outputs_of_plain_decoding(
        reqs in prop::collection::vec((0u32..4, 1usize..30, 1usize..20, any::<bool>()), 1..6),
        budget in 1usize..24,
        running in 1usize..5,
        spec in 1usize..6,
    ) {
        let bs = 4;
        let mut c = cfg(budget, running);
        c.context_length = 36;
        let need = reqs.iter().map(|&(_, p, n, _)| (p + n).min(36).div_ceil(bs)).max().unwrap();
        let run = |blocks: usize, spec: usize, shifts: bool| {
            let mut sim = Sim::new(blocks, bs, c.clone());
            sim.spec = spec;
            let ids: Vec<ReqId> = reqs
                .iter()
                .map(|&(seed, len, max_new, shift)| {
                    sim.add_with(&prompt(seed + 1, len), max_new, (shift && shifts).then_some(3))
                })
                .collect();
            sim.run();
            assert_no_leak(&sim);
            let outs = sim.outputs();
            ids.iter().map(|i| outs[i].clone()).collect::<Vec<_>>()
        };
        let large = need * reqs.len() + 8;
        prop_assert_eq!(run(need, spec, false), run(large, 0, false));
        prop_assert_eq!(run(large, spec, true), run(large, 0, true));
    }
}
