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
    /// Generated tokens per request, and how many each may make.
    out: HashMap<ReqId, (Vec<u32>, usize)>,
    /// Samples draw from `hash(context) + salt` (forks use different salts).
    salt: HashMap<ReqId, u64>,
    done: Vec<(ReqId, Vec<u32>)>,
    log: Vec<StepPlan>,
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
        let kv = KvCache::new(KvConfig {
            num_blocks,
            block_size,
        })
        .unwrap();
        Sim {
            sched: Scheduler::new(kv, cfg),
            slots: HashMap::new(),
            out: HashMap::new(),
            salt: HashMap::new(),
            done: Vec::new(),
            log: Vec::new(),
        }
    }

    fn add(&mut self, prompt: &[u32], max_new: usize) -> ReqId {
        self.add_with(prompt, max_new, None)
    }

    fn add_with(&mut self, prompt: &[u32], max_new: usize, shift_keep: Option<usize>) -> ReqId {
        let id = self
            .sched
            .add(NewRequest {
                namespace: NS,
                prompt: token_ids(prompt),
                max_new_tokens: max_new,
                shift_keep,
            })
            .unwrap();
        self.out.insert(id, (Vec::new(), max_new));
        id
    }

    fn bs(&self) -> usize {
        self.sched.kv().block_size()
    }

    fn copy_block(&mut self, src: BlockId, dst: BlockId) {
        let bs = self.bs();
        for o in 0..bs {
            let from = Slot::of(src, o, bs).0;
            let to = Slot::of(dst, o, bs).0;
            match self.slots.get(&from).copied() {
                Some(v) => self.slots.insert(to, v),
                None => self.slots.remove(&to),
            };
        }
    }

    /// One step: plan, apply, check every sampled context, sample.
    fn step(&mut self) {
        let plan = self.sched.schedule().unwrap();
        let bs = self.bs();
        for op in &plan.ops {
            match op {
                KvOp::Copy(copies) => copies.iter().for_each(|c| self.copy_block(c.src, c.dst)),
                KvOp::Shift { plan: s, .. } => {
                    s.copies.iter().for_each(|c| self.copy_block(c.src, c.dst));
                    for m in &s.moves {
                        let (t, p) = self.slots[&m.src.0];
                        let p = (p as i64 + s.position_delta) as usize;
                        self.slots.insert(m.dst.0, (t, p));
                    }
                }
            }
        }
        for item in &plan.items {
            for (j, (t, s)) in item.tokens.iter().zip(&item.slots).enumerate() {
                self.slots.insert(s.0, (*t, item.start + j));
            }
        }
        self.sched.step_done(&plan).unwrap();
        for &(req, _) in &plan.ended {
            let toks = self.sched.finish(req).unwrap();
            let _ = toks;
            let (out, _) = self.out.remove(&req).unwrap();
            self.done.push((req, out));
        }
        for item in plan.items.iter().filter(|i| i.wants_logits) {
            let len = item.start + item.tokens.len();
            let ctx: Vec<TokenId> = (0..len)
                .map(|p| {
                    let slot = Slot::of(item.block_table[p / bs], p % bs, bs).0;
                    let (t, pos) = self.slots[&slot];
                    assert_eq!(pos, p, "{}: slot {slot} holds position {pos}", item.req);
                    t
                })
                .collect();
            assert_eq!(ctx, self.sched.tokens(item.req).unwrap(), "{}", item.req);
            let salt = self.salt.get(&item.req).copied().unwrap_or(0);
            let next = hash(&ctx, salt);
            let (out, max) = self.out.get_mut(&item.req).unwrap();
            out.push(next);
            if out.len() >= *max {
                let out = std::mem::take(out);
                self.out.remove(&item.req);
                self.sched.finish(item.req).unwrap();
                self.done.push((item.req, out));
            } else {
                self.sched.push_token(item.req, TokenId(next)).unwrap();
            }
        }
        self.sched.kv().check_invariants().unwrap();
        self.log.push(plan);
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
