//! Sliding-window layers on the paged cache: random operation sequences
//! over a pool with a sliding pool, checked after every operation with
//! `check_invariants()` and a shadow read-back of both pools (every
//! running sequence's window, every cached block's sliding content), and
//! stories for the rules (window let go of, reuse at any point without
//! pressure, tails kept under pressure, shifts).

use proptest::prelude::*;

use super::{append_compute, toks, Shadow, NS};
use crate::{Admission, KvCache, KvConfig, KvError, SeqId, SlidingConfig, TokenId};

fn cache(num_blocks: usize, block_size: usize, window: usize, sliding: usize) -> KvCache {
    KvCache::new(KvConfig {
        num_blocks,
        block_size,
        sliding: Some(SlidingConfig {
            window,
            num_blocks: sliding,
        }),
    })
    .unwrap()
}

fn checked(kv: &KvCache, sh: &Shadow) {
    kv.check_invariants().unwrap();
    sh.check_tree(kv).unwrap();
    for s in kv.sequence_ids().collect::<Vec<_>>() {
        sh.check_seq(kv, s).unwrap();
    }
}

/// Runs `prompt` as a request would: reuse what the cache allows, compute
/// the rest, insert at the end; returns (sequence, tokens reused).
fn request(kv: &mut KvCache, sh: &mut Shadow, prompt: &[u32]) -> (SeqId, usize) {
    let t = toks(prompt);
    let (seq, got) = kv.add_sequence(NS, &t[..t.len() - 1]);
    let raw: Vec<u32> = prompt[got..].to_vec();
    append_compute(kv, sh, seq, &raw);
    kv.insert_sequence(seq).unwrap();
    checked(kv, sh);
    (seq, got)
}

fn run(from: u32, n: usize) -> Vec<u32> {
    (from..from + n as u32).collect()
}

#[test]
fn a_running_sequence_lets_go_of_blocks_behind_its_window() {
    // Window 8, blocks of 4: a query at p reads p-7..=p, so a sequence of
    // 40 computed tokens keeps blocks 8 and 9 (positions 32..40) and block
    // 8's predecessor only while position 32 is read (33 - 8 = 25 -> 6).
    let mut kv = cache(32, 4, 8, 32);
    let mut sh = Shadow::new(&kv);
    let (seq, _) = kv.add_sequence(NS, &[]);
    append_compute(&mut kv, &mut sh, seq, &run(1, 40));
    // The next append lets go of what no query reads any more.
    append_compute(&mut kv, &mut sh, seq, &[99]);
    let table = kv.sliding_table(seq).unwrap();
    let held: Vec<usize> = (0..table.len()).filter(|&j| table[j].is_some()).collect();
    // 41 tokens, next query at 41 reads 34..41: blocks 8..=10.
    assert_eq!(held, vec![8, 9, 10]);
    assert_eq!(kv.pool().num_free_sliding(), 32 - 3);
    checked(&kv, &sh);
}

#[test]
fn without_pressure_any_cached_point_is_reused() {
    // A prompt computed in chunks enters the tree chunk by chunk; with room
    // in the sliding pool every block keeps its sliding K/V, so a request
    // branching anywhere reuses everything before the branch.
    let mut kv = cache(64, 4, 8, 64);
    let mut sh = Shadow::new(&kv);
    let (seq, _) = kv.add_sequence(NS, &[]);
    let prompt = run(1, 60);
    for chunk in prompt.chunks(16) {
        append_compute(&mut kv, &mut sh, seq, chunk);
        kv.insert_whole_blocks(seq).unwrap();
    }
    kv.insert_sequence(seq).unwrap();
    kv.free_sequence(seq).unwrap();
    checked(&kv, &sh);
    for cut in [13, 22, 37, 50] {
        let mut p = prompt[..cut].to_vec();
        p.extend([500 + cut as u32, 7]);
        let (s, got) = request(&mut kv, &mut sh, &p);
        assert_eq!(got, cut, "branch at {cut}");
        kv.free_sequence(s).unwrap();
    }
    checked(&kv, &sh);
}

#[test]
fn under_pressure_the_tails_stay_and_the_rest_is_recomputed() {
    // 40-token prompt, window 8, blocks of 4; a sliding pool of 12 blocks
    // cannot keep the sliding K/V of both prompts.
    let mut kv = cache(64, 4, 8, 12);
    let mut sh = Shadow::new(&kv);
    let prompt = run(1, 40);
    let (a, _) = request(&mut kv, &mut sh, &prompt);
    kv.free_sequence(a).unwrap();
    // Another long request takes the sliding pool over.
    let (b, _) = request(&mut kv, &mut sh, &run(1000, 30));
    kv.free_sequence(b).unwrap();
    // The prompt's end is a tail: the same prompt plus more reuses all of
    // it (the tail was kept under pressure).
    let mut longer = prompt.clone();
    longer.extend([77, 78]);
    let (c, got) = request(&mut kv, &mut sh, &longer);
    assert_eq!(got, 40);
    kv.free_sequence(c).unwrap();
    // A branch in the middle whose window lost its sliding blocks falls
    // back to the last point whose window is whole (here: none).
    let mut branch = prompt[..20].to_vec();
    branch.extend([55, 56]);
    let global = kv.tree().peek_prefix(NS, &toks(&branch)).len;
    assert_eq!(global, 20, "the global layers still have the branch point");
    let resumable = kv.cached_prefix_len(NS, &toks(&branch));
    assert!(resumable < 20, "window of position 20 was evicted");
    let (d, got) = request(&mut kv, &mut sh, &branch);
    assert_eq!(got, resumable);
    kv.free_sequence(d).unwrap();
    checked(&kv, &sh);
    assert!(kv.stats().evicted_sliding_blocks > 0);
}

#[test]
fn a_shift_keeps_the_window_and_the_kept_prefix() {
    let mut kv = cache(64, 4, 8, 64);
    let mut sh = Shadow::new(&kv);
    let (seq, _) = kv.add_sequence(NS, &[]);
    kv.keep_front(seq, 10).unwrap();
    append_compute(&mut kv, &mut sh, seq, &run(1, 30));
    append_compute(&mut kv, &mut sh, seq, &[31]);
    // Keep 10, drop 16: 15 tokens left, the next query reads 8..=15, kept
    // positions 8 and 9 among them.
    let plan = kv.plan_shift(seq, 10, 16).unwrap().ok().unwrap();
    sh.shift(&plan);
    checked(&kv, &sh);
    // Without keep_front the kept positions' sliding K/V is gone: refused.
    let (s2, _) = kv.add_sequence(NS, &[]);
    append_compute(&mut kv, &mut sh, s2, &run(200, 30));
    append_compute(&mut kv, &mut sh, s2, &[9]);
    assert!(matches!(
        kv.plan_shift(s2, 10, 16),
        Err(KvError::ShiftLosesWindow { .. })
    ));
    checked(&kv, &sh);
}

/// The operations of the model-based test, and those only sliding pools
/// have.
#[derive(Debug, Clone)]
enum Op {
    Base(super::model::Op),
    Keep { seq: usize, n: usize },
    InsertPrompt { seq: usize },
    InsertWhole { seq: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        16 => super::model::op().prop_map(Op::Base),
        1 => (0usize..8, 0usize..10).prop_map(|(seq, n)| Op::Keep { seq, n }),
        1 => (0usize..8).prop_map(|seq| Op::InsertPrompt { seq }),
        1 => (0usize..8).prop_map(|seq| Op::InsertWhole { seq }),
    ]
}

struct World {
    kv: KvCache,
    sh: Shadow,
    /// Each sequence with every token it ever had (queries draw on them).
    seqs: Vec<(SeqId, Vec<TokenId>)>,
}

impl World {
    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        use super::model::Op as B;
        let kv = &mut self.kv;
        let n = self.seqs.len();
        let pick = |i: usize| (n > 0).then(|| i % n);
        let insert = |kv: &mut KvCache, id: SeqId, how: u8| -> Result<(), TestCaseError> {
            let r = match how {
                0 => kv.insert_sequence(id),
                1 => kv.insert_prompt(id),
                _ => kv.insert_whole_blocks(id),
            };
            match r {
                Ok(_) | Err(KvError::PendingTokens { .. }) => Ok(()),
                Err(e) => Err(TestCaseError::fail(e.to_string())),
            }
        };
        let op = match op {
            Op::Base(op) => op,
            Op::Keep { seq, n } => {
                if let Some(i) = pick(*seq) {
                    kv.keep_front(self.seqs[i].0, *n).unwrap();
                }
                return Ok(());
            }
            Op::InsertPrompt { seq } | Op::InsertWhole { seq } => {
                let how = if matches!(op, Op::InsertPrompt { .. }) {
                    1
                } else {
                    2
                };
                return match pick(*seq) {
                    Some(i) => insert(kv, self.seqs[i].0, how),
                    None => Ok(()),
                };
            }
        };
        // A query: a prefix of a sequence's tokens (or none) and more.
        let query = |from: &Option<usize>, cut: usize, extra: &[u32]| -> Vec<TokenId> {
            let mut q: Vec<TokenId> = match from.and_then(pick) {
                Some(i) => {
                    let t = &self.seqs[i].1;
                    t[..cut.min(t.len())].to_vec()
                }
                None => Vec::new(),
            };
            q.extend(toks(extra));
            q
        };
        match op {
            B::Add {
                ns,
                from,
                cut,
                extra,
                reuse,
            } => {
                let ns = crate::Namespace(*ns as u64);
                let q = query(from, *cut, extra);
                let reusable = if *reuse { &q[..] } else { &[][..] };
                let want = kv.cached_prefix_len(ns, reusable);
                let global = kv.tree().peek_prefix(ns, reusable).len;
                let (id, got) = kv.add_sequence(ns, reusable);
                prop_assert_eq!(got, want);
                prop_assert!(got <= global);
                self.seqs.push((id, q[..got].to_vec()));
            }
            B::Match {
                ns,
                from,
                cut,
                extra,
                touch,
            } => {
                let ns = crate::Namespace(*ns as u64);
                let q = query(from, *cut, extra);
                let want = kv.cached_prefix_len(ns, &q);
                prop_assert!(want <= kv.tree().peek_prefix(ns, &q).len);
                if *touch {
                    prop_assert_eq!(kv.match_prefix(ns, &q).len, want);
                }
            }
            B::Append {
                seq,
                tokens,
                compute,
            } => {
                let Some(i) = pick(*seq) else {
                    return Ok(());
                };
                let id = self.seqs[i].0;
                match kv.append(id, &toks(tokens)).unwrap() {
                    Admission::Ok(plan) => {
                        self.sh.copy_append(&plan);
                        prop_assert_eq!(plan.sliding_slots.len(), tokens.len());
                        self.seqs[i].1 = kv.sequence(id).unwrap().tokens().to_vec();
                        if *compute {
                            self.sh.compute(kv, id);
                        }
                    }
                    Admission::Later { needed, free } => prop_assert!(free < needed),
                    Admission::Never { needed, total } => prop_assert!(needed > total),
                }
            }
            B::Compute { seq } => {
                if let Some(i) = pick(*seq) {
                    self.sh.compute(kv, self.seqs[i].0);
                }
            }
            B::Fork { seq } => {
                if let Some(i) = pick(*seq) {
                    if let Ok(id) = kv.fork(self.seqs[i].0) {
                        let t = self.seqs[i].1.clone();
                        self.seqs.push((id, t));
                    }
                }
            }
            B::Free { seq } => {
                if let Some(i) = pick(*seq) {
                    kv.free_sequence(self.seqs.swap_remove(i).0).unwrap();
                }
            }
            B::Insert { seq } => {
                if let Some(i) = pick(*seq) {
                    insert(kv, self.seqs[i].0, 0)?;
                }
            }
            // External locks are the model-based test's; here they add
            // nothing the sequences' own locks do not.
            B::Lock { .. } | B::Unlock { .. } => {}
            B::Evict { n } => {
                kv.evict(*n).unwrap();
            }
            B::Defrag => {
                let plan = kv.plan_defrag();
                self.sh.defrag(&plan);
                prop_assert_eq!(
                    plan.sliding_live,
                    kv.pool().num_sliding_blocks() - kv.pool().num_free_sliding()
                );
            }
            B::Shift { seq, keep, discard } => {
                let Some(i) = pick(*seq) else {
                    return Ok(());
                };
                let id = self.seqs[i].0;
                let len = kv.sequence(id).unwrap().len();
                let n_keep = keep % (len + 1);
                if len == n_keep {
                    return Ok(());
                }
                let n_discard = 1 + discard % (len - n_keep);
                match kv.plan_shift(id, n_keep, n_discard) {
                    Ok(Admission::Ok(plan)) => {
                        self.sh.shift(&plan);
                        self.seqs[i].1 = kv.sequence(id).unwrap().tokens().to_vec();
                    }
                    Ok(_)
                    | Err(KvError::PendingTokens { .. })
                    | Err(KvError::ShiftLosesWindow { .. }) => {}
                    Err(e) => return Err(TestCaseError::fail(e.to_string())),
                }
            }
            B::ClearCache => {
                kv.clear_cache().unwrap();
            }
        }
        Ok(())
    }

    fn check(&self) -> Result<(), TestCaseError> {
        let fail = |e: String| TestCaseError::fail(e);
        self.kv
            .check_invariants()
            .map_err(|e| fail(e.to_string()))?;
        for (id, _) in &self.seqs {
            self.sh.check_seq(&self.kv, *id).map_err(fail)?;
        }
        self.sh.check_tree(&self.kv).map_err(fail)
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    #[test]
    fn both_pools_hold_what_every_reader_reads(
        block_size in prop::sample::select(vec![1usize, 2, 3, 4, 16]),
        window in prop::sample::select(vec![1usize, 2, 5, 8, 17]),
        num_blocks in 1usize..48,
        sliding in 1usize..48,
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let kv = cache(num_blocks, block_size, window, sliding);
        let sh = Shadow::new(&kv);
        let mut w = World { kv, sh, seqs: Vec::new() };
        for op in &ops {
            w.apply(op)?;
            w.check()?;
        }
        for (id, _) in std::mem::take(&mut w.seqs) {
            w.kv.free_sequence(id).unwrap();
        }
        w.kv.clear_cache().unwrap();
        w.kv.check_invariants().map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(w.kv.pool().num_free(), num_blocks);
        prop_assert_eq!(w.kv.pool().num_free_sliding(), sliding);
    }
}

#[test]
fn a_restored_session_keeps_the_sliding_tail_only_and_resumes_at_its_end() {
    // Window 8, blocks of 4: 30 saved tokens bring sliding K/V for their
    // last 7 positions (23..30), from mid-block 5 on.
    let mut kv = cache(32, 4, 8, 16);
    let mut sh = Shadow::new(&kv);
    let saved = run(1, 30);
    let (seq, _) = kv.add_sequence(NS, &[]);
    let plan = kv
        .append_from(seq, &toks(&saved), 23)
        .unwrap()
        .ok()
        .unwrap();
    for (p, (&t, (g, s))) in saved
        .iter()
        .zip(plan.slots.iter().zip(&plan.sliding_slots))
        .enumerate()
    {
        sh.cells[g.index()] = Some((crate::TokenId(t), p));
        if p >= 23 {
            sh.sliding[s.index()] = Some((crate::TokenId(t), p));
        } else {
            assert_eq!(s.0, u32::MAX, "no sliding slot before the tail");
        }
    }
    kv.mark_computed(seq, 30).unwrap();
    assert_eq!(kv.pool().num_free_sliding(), 16 - 3, "blocks 5, 6, 7 only");
    kv.insert_sequence(seq).unwrap();
    kv.free_sequence(seq).unwrap();
    checked(&kv, &sh);
    let mut more = saved.clone();
    more.extend([91, 92]);
    let (s, got) = request(&mut kv, &mut sh, &more);
    assert_eq!(got, 30, "resumes at the saved end");
    kv.free_sequence(s).unwrap();
    // Inside the saved part, before the tail: nothing to resume from.
    let mut branch = saved[..20].to_vec();
    branch.push(93);
    assert_eq!(kv.cached_prefix_len(NS, &toks(&branch)), 0);
    checked(&kv, &sh);
}

#[test]
fn a_truncated_tail_gives_back_its_sliding_blocks() {
    let mut kv = cache(16, 4, 8, 16);
    let mut sh = Shadow::new(&kv);
    let (seq, _) = kv.add_sequence(NS, &[]);
    append_compute(&mut kv, &mut sh, seq, &run(1, 10));
    let free = kv.pool().num_free_sliding();
    append_compute(&mut kv, &mut sh, seq, &run(50, 7));
    assert!(kv.pool().num_free_sliding() < free);
    kv.truncate(seq, 11).unwrap();
    checked(&kv, &sh);
    // Blocks 0..3 are the sequence's again; the append after the cut
    // writes the window from position 11 on.
    append_compute(&mut kv, &mut sh, seq, &run(80, 9));
    checked(&kv, &sh);
    kv.insert_sequence(seq).unwrap();
    checked(&kv, &sh);
}

/// What [`logged_then_pressed`] leaves.
struct Pressed {
    kv: KvCache,
    sh: Shadow,
    prompt: Vec<u32>,
    blocks: Vec<crate::BlockId>,
    before: Vec<Option<crate::BlockId>>,
}

/// Window 8, blocks of 4, a sliding pool of 12 blocks and `global` global
/// ones, the tree's log on: a 40-token prompt is cached, then a 30-token
/// request presses on the pools. Returns the cache (its log holds what the
/// second request did), the prompt, its blocks and, per block, the sliding
/// block that held it whole before the second request.
fn logged_then_pressed(global: usize) -> Pressed {
    let mut kv = cache(global, 4, 8, 12);
    let mut sh = Shadow::new(&kv);
    kv.set_log(true);
    let prompt = run(1, 40);
    let (a, _) = request(&mut kv, &mut sh, &prompt);
    kv.free_sequence(a).unwrap();
    let blocks = kv.tree().peek_prefix(NS, &toks(&prompt)).blocks;
    let pool = kv.pool();
    let before = blocks
        .iter()
        .map(|&b| pool.sliding_of(b).filter(|_| pool.sliding_holds(b, 0)))
        .collect();
    kv.take_log();
    let (b, _) = request(&mut kv, &mut sh, &run(1000, 30));
    kv.free_sequence(b).unwrap();
    Pressed {
        kv,
        sh,
        prompt,
        blocks,
        before,
    }
}

#[test]
fn an_evicted_block_names_the_sliding_block_that_held_it_whole() {
    // Window 8, blocks of 4, 12 global blocks: a second long request
    // evicts the first one's blocks, tail included.
    let Pressed {
        mut kv,
        sh,
        blocks,
        before,
        ..
    } = logged_then_pressed(12);
    // The tail (the window before position 40: blocks 8 and 9) had them.
    assert!(before[8].is_some() && before[9].is_some(), "{before:?}");
    let mut seen = 0;
    for e in kv.take_log() {
        let crate::TreeEvent::Removed(d) = e else {
            continue;
        };
        assert_eq!(d.sliding.len(), d.blocks.len());
        for (i, (&g, &s)) in d.blocks.iter().zip(&d.sliding).enumerate() {
            let j = d.first + i;
            assert_eq!(g, blocks[j], "block {j}");
            // What held the block whole before, or nothing: never another
            // block's sliding K/V.
            assert!(s.is_none() || s == before[j], "block {j}: {s:?}");
            if j >= 8 {
                assert_eq!(s, before[j], "the tail's block {j}");
                seen += 1;
            }
        }
    }
    assert_eq!(seen, 2, "the tail's two blocks were evicted");
    checked(&kv, &sh);
}

#[test]
fn a_cached_block_losing_its_sliding_block_is_logged() {
    // 64 global blocks, 12 sliding: a second request takes the sliding
    // blocks of the first one's cached blocks behind its tail.
    let Pressed {
        mut kv,
        sh,
        prompt,
        blocks,
        before,
    } = logged_then_pressed(64);
    let lost: Vec<crate::Demoted> = kv
        .take_log()
        .into_iter()
        .filter_map(|e| match e {
            crate::TreeEvent::SlidingRemoved(d) => Some(d),
            _ => None,
        })
        .collect();
    assert!(!lost.is_empty());
    let mut seen = 0;
    for d in &lost {
        let end = d.first + d.blocks.len();
        // Consecutive blocks of the path in one event.
        assert_eq!(d.blocks, blocks[d.first..end]);
        assert_eq!(d.sliding, before[d.first..end]);
        assert_eq!(d.tokens, toks(&prompt[..end * 4]));
        for (j, &b) in (d.first..end).zip(&d.blocks) {
            assert!(j < 8, "the tail's blocks keep theirs: {j}");
            // The global block is still cached; the sliding one is not.
            assert_eq!(kv.pool().sliding_of(b), None);
            seen += 1;
        }
    }
    // The 30-token request's 8 sliding blocks, of which 2 were free.
    assert_eq!(seen, 6, "{lost:?}");
    checked(&kv, &sh);
}
