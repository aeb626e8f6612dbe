//! Exact-state stories: block ids, counts and eviction order are pinned.

use super::{append_compute, toks, Shadow, NS};
use crate::{
    Admission, BlockId, CopyOp, InsertReport, KvCache, KvConfig, KvError, Namespace, NodeId, SeqId,
    Slot, SlotMove,
};

fn cache(num_blocks: usize, block_size: usize) -> (KvCache, Shadow) {
    let kv = KvCache::new(KvConfig {
        num_blocks,
        block_size,
        sliding: None,
    })
    .unwrap();
    let sh = Shadow::new(&kv);
    (kv, sh)
}

fn b(ids: &[u32]) -> Vec<BlockId> {
    ids.iter().map(|&i| BlockId(i)).collect()
}

fn counts(kv: &KvCache, n: u32) -> Vec<u32> {
    (0..n).map(|i| kv.pool().ref_count(BlockId(i))).collect()
}

fn checked(kv: &KvCache, sh: &Shadow) {
    kv.check_invariants().unwrap();
    sh.check_tree(kv).unwrap();
    for s in kv.sequence_ids().collect::<Vec<_>>() {
        sh.check_seq(kv, s).unwrap();
    }
}

#[test]
fn multi_turn_chat_reuses_the_whole_previous_turn() {
    let (mut kv, mut sh) = cache(16, 4);
    // Turn 1: a 10-token prompt and a 3-token reply, generated one by one.
    let p1: Vec<u32> = (1..=10).collect();
    let (s0, cached) = kv.add_sequence(NS, &toks(&p1[..9]));
    assert_eq!(cached, 0);
    let plan = append_compute(&mut kv, &mut sh, s0, &p1);
    assert_eq!(plan.slots, (0..10).map(Slot).collect::<Vec<_>>());
    assert_eq!(kv.sequence(s0).unwrap().block_table(), b(&[0, 1, 2]));
    for (t, slot) in [(100, 10), (101, 11), (102, 12)] {
        let plan = append_compute(&mut kv, &mut sh, s0, &[t]);
        assert_eq!(
            (plan.copies.len(), plan.slots.as_slice()),
            (0, &[Slot(slot)][..])
        );
    }
    assert_eq!(
        kv.insert_sequence(s0).unwrap(),
        InsertReport {
            already_cached: 0,
            inserted: 13,
            deduplicated_blocks: 0
        }
    );
    kv.free_sequence(s0).unwrap();
    let st = kv.stats();
    assert_eq!(
        (
            st.cached_blocks,
            st.used_blocks,
            st.free_blocks,
            st.cached_tokens
        ),
        (4, 0, 12, 13)
    );
    checked(&kv, &sh);

    // Turn 2: history + reply + new user tokens. Everything of turn 1 hits,
    // token-exact (13 is not a multiple of the block size).
    let mut p2 = p1.clone();
    p2.extend([100, 101, 102, 200, 201, 202]);
    let (s1, cached) = kv.add_sequence(NS, &toks(&p2[..15]));
    assert_eq!(cached, 13);
    assert_eq!(kv.sequence(s1).unwrap().block_table(), b(&[0, 1, 2, 3]));
    assert_eq!(counts(&kv, 5), [2, 2, 2, 2, 0]);
    // The partly matched block b3 is shared: the first write copies it.
    let plan = append_compute(&mut kv, &mut sh, s1, &p2[13..]);
    assert_eq!(
        plan.copies,
        [CopyOp {
            src: BlockId(3),
            dst: BlockId(4)
        }]
    );
    assert_eq!(plan.slots, [Slot(17), Slot(18), Slot(19)]);
    assert_eq!(counts(&kv, 5), [2, 2, 2, 1, 1]);
    append_compute(&mut kv, &mut sh, s1, &[300]);
    assert_eq!(
        kv.insert_sequence(s1).unwrap(),
        InsertReport {
            already_cached: 13,
            inserted: 4,
            deduplicated_blocks: 0
        }
    );
    kv.free_sequence(s1).unwrap();
    checked(&kv, &sh);
    let mut p3 = p2.clone();
    p3.push(300);
    let m = kv.tree().peek_prefix(NS, &toks(&p3));
    assert_eq!((m.len, m.blocks), (17, b(&[0, 1, 2, 4, 5])));
    assert_eq!(kv.stats().cow_copies, 1);
}

#[test]
fn an_edit_in_the_middle_stops_the_match_at_the_edit() {
    let (mut kv, mut sh) = cache(16, 4);
    let (s, _) = kv.add_sequence(NS, &[]);
    append_compute(&mut kv, &mut sh, s, &(1..=13).collect::<Vec<_>>());
    kv.insert_sequence(s).unwrap();
    kv.free_sequence(s).unwrap();
    let edited = toks(&[1, 2, 3, 4, 5, 99, 7, 8, 9, 10]);
    let m = kv.tree().peek_prefix(NS, &edited);
    assert_eq!((m.len, m.blocks), (5, b(&[0, 1])));
    let (s, cached) = kv.add_sequence(NS, &edited);
    assert_eq!(cached, 5);
    let plan = append_compute(&mut kv, &mut sh, s, &[99, 7, 8, 9, 10]);
    assert_eq!(
        plan.copies,
        [CopyOp {
            src: BlockId(1),
            dst: BlockId(4)
        }]
    );
    checked(&kv, &sh);
    // Another namespace shares nothing.
    assert_eq!(kv.tree().peek_prefix(Namespace(8), &edited).len, 0);
}

#[test]
fn two_conversations_share_a_system_prompt() {
    let (mut kv, mut sh) = cache(16, 4);
    let a: Vec<u32> = (1..=8).chain([11, 12, 13]).collect();
    let bq: Vec<u32> = (1..=8).chain([21, 22, 23]).collect();
    let (sa, _) = kv.add_sequence(NS, &toks(&a[..10]));
    append_compute(&mut kv, &mut sh, sa, &a);
    kv.insert_sequence(sa).unwrap();
    let (sb, cached) = kv.add_sequence(NS, &toks(&bq[..10]));
    assert_eq!(cached, 8);
    append_compute(&mut kv, &mut sh, sb, &bq[8..]);
    assert_eq!(kv.sequence(sa).unwrap().block_table(), b(&[0, 1, 2]));
    assert_eq!(kv.sequence(sb).unwrap().block_table(), b(&[0, 1, 3]));
    // Tree + A + B on the shared blocks: 4 blocks live instead of 6.
    assert_eq!(counts(&kv, 4), [3, 3, 2, 1]);
    assert_eq!(kv.stats().used_blocks, 4);
    kv.insert_sequence(sb).unwrap();
    assert_eq!(counts(&kv, 4), [3, 3, 2, 2]);
    assert_eq!(kv.tree().num_nodes(), 4); // root, "1..8", "11 12 13", "21 22 23"
    checked(&kv, &sh);
}

#[test]
fn fork_then_diverge_copies_only_the_tail() {
    let (mut kv, mut sh) = cache(8, 4);
    let (p, _) = kv.add_sequence(NS, &[]);
    append_compute(&mut kv, &mut sh, p, &[1, 2, 3, 4, 5, 6]);
    let c = kv.fork(p).unwrap();
    assert_eq!(counts(&kv, 3), [2, 2, 0]);
    let plan = append_compute(&mut kv, &mut sh, p, &[7]);
    assert_eq!(
        plan.copies,
        [CopyOp {
            src: BlockId(1),
            dst: BlockId(2)
        }]
    );
    let plan = append_compute(&mut kv, &mut sh, c, &[8]);
    assert_eq!((plan.copies.len(), plan.slots), (0, vec![Slot(6)]));
    append_compute(&mut kv, &mut sh, c, &[9, 10]);
    assert_eq!(kv.sequence(p).unwrap().block_table(), b(&[0, 2]));
    assert_eq!(kv.sequence(c).unwrap().block_table(), b(&[0, 1, 3]));
    assert_eq!(
        kv.sequence(c).unwrap().tokens(),
        toks(&[1, 2, 3, 4, 5, 6, 8, 9, 10])
    );
    checked(&kv, &sh);
    kv.free_sequence(p).unwrap();
    assert_eq!(counts(&kv, 4), [1, 1, 0, 1]);
    checked(&kv, &sh);
}

#[test]
fn pool_exhaustion_evicts_lru_then_later_then_never() {
    let (mut kv, mut sh) = cache(4, 4);
    for raw in [(1..=8).collect::<Vec<u32>>(), vec![20, 21, 22, 23]] {
        let (s, _) = kv.add_sequence(NS, &toks(&raw));
        append_compute(&mut kv, &mut sh, s, &raw);
        kv.insert_sequence(s).unwrap();
        kv.free_sequence(s).unwrap();
    }
    assert_eq!((kv.stats().cached_blocks, kv.pool().num_free()), (3, 1));
    // 9 tokens need 3 blocks: the least recently used prefix (1..8) goes.
    let (c, _) = kv.add_sequence(NS, &[]);
    append_compute(&mut kv, &mut sh, c, &(30..=38).collect::<Vec<_>>());
    assert_eq!(kv.sequence(c).unwrap().block_table(), b(&[1, 0, 3]));
    assert_eq!(kv.stats().evicted_blocks, 2);
    assert_eq!(kv.tree().peek_prefix(NS, &toks(&[1, 2])).len, 0);
    assert_eq!(kv.tree().peek_prefix(NS, &toks(&[20, 21, 22, 23])).len, 4);
    checked(&kv, &sh);
    // 8 more tokens need 2 blocks: evicting the other prefix frees only 1.
    let (d, _) = kv.add_sequence(NS, &[]);
    let eight = toks(&(40..48).collect::<Vec<_>>());
    assert_eq!(
        kv.append(d, &eight).unwrap(),
        Admission::Later { needed: 2, free: 1 }
    );
    assert!(kv.sequence(d).unwrap().is_empty());
    assert_eq!(kv.tree().cached_tokens(), 0);
    // 17 tokens cannot fit even in an empty pool.
    let big = toks(&(0..17).collect::<Vec<_>>());
    assert_eq!(
        kv.append(d, &big).unwrap(),
        Admission::Never {
            needed: 5,
            total: 4
        }
    );
    kv.free_sequence(c).unwrap();
    assert!(kv.append(d, &eight).unwrap().is_ok());
    kv.check_invariants().unwrap();
}

#[test]
fn locked_prefixes_survive_eviction() {
    let (mut kv, mut sh) = cache(4, 4);
    let (s, _) = kv.add_sequence(NS, &[]);
    append_compute(&mut kv, &mut sh, s, &[1, 2, 3, 4, 5, 6, 7, 8]);
    kv.insert_sequence(s).unwrap();
    kv.free_sequence(s).unwrap();
    let m = kv.match_prefix(NS, &toks(&[1, 2, 3]));
    let node = m.node.unwrap();
    kv.lock(node).unwrap();
    assert_eq!(kv.evict(4).unwrap(), vec![]);
    assert_eq!(kv.tree().peek_prefix(NS, &toks(&[1, 2, 3, 4, 5])).len, 5);
    kv.unlock(node).unwrap();
    assert_eq!(kv.unlock(node), Err(KvError::NotLocked(node)));
    // A small eviction trims the leaf's tail and keeps its front cached.
    assert_eq!(kv.evict(1).unwrap(), b(&[1]));
    assert_eq!(kv.tree().peek_prefix(NS, &toks(&[1, 2, 3, 4, 5])).len, 4);
    kv.check_invariants().unwrap();
    assert_eq!(kv.evict(1).unwrap(), b(&[0]));
    assert_eq!(kv.tree().num_nodes(), 0);
    kv.check_invariants().unwrap();
}

#[test]
fn defrag_compacts_and_reads_back() {
    let (mut kv, mut sh) = cache(8, 2);
    let mut ids = Vec::new();
    for raw in [&[1u32, 2][..], &[3, 4, 5], &[6, 7, 8, 9]] {
        let (s, _) = kv.add_sequence(NS, &[]);
        append_compute(&mut kv, &mut sh, s, raw);
        ids.push(s);
    }
    kv.insert_sequence(ids[2]).unwrap();
    kv.free_sequence(ids[0]).unwrap();
    kv.free_sequence(ids[1]).unwrap();
    assert_eq!(kv.sequence(ids[2]).unwrap().block_table(), b(&[3, 4]));
    let plan = kv.plan_defrag();
    assert_eq!(plan.live_blocks, 2);
    assert_eq!(
        plan.moves,
        [
            CopyOp {
                src: BlockId(3),
                dst: BlockId(0)
            },
            CopyOp {
                src: BlockId(4),
                dst: BlockId(1)
            }
        ]
    );
    sh.defrag(&plan);
    assert_eq!(kv.sequence(ids[2]).unwrap().block_table(), b(&[0, 1]));
    checked(&kv, &sh);
    assert_eq!(kv.plan_defrag().moves, vec![]);
    assert_eq!(
        kv.shrink_to(1),
        Err(KvError::ShrinkBlocked {
            requested: 1,
            highest_live: BlockId(1)
        })
    );
    kv.shrink_to(2).unwrap();
    assert_eq!(kv.stats().free_blocks, 0);
    checked(&kv, &sh);
}

#[test]
fn shift_moves_the_tail_down_in_place_when_exclusive() {
    let (mut kv, mut sh) = cache(8, 4);
    let (s, _) = kv.add_sequence(NS, &[]);
    append_compute(&mut kv, &mut sh, s, &(1..=10).collect::<Vec<_>>());
    let plan = kv.plan_shift(s, 2, 4).unwrap().ok().unwrap();
    assert!(plan.copies.is_empty());
    let mv = |a, b| SlotMove {
        src: Slot(a),
        dst: Slot(b),
    };
    assert_eq!(plan.moves, [mv(6, 2), mv(7, 3), mv(8, 4), mv(9, 5)]);
    assert_eq!(plan.position_delta, -4);
    sh.shift(&plan);
    assert_eq!(kv.sequence(s).unwrap().tokens(), toks(&[1, 2, 7, 8, 9, 10]));
    assert_eq!(kv.sequence(s).unwrap().block_table(), b(&[0, 1]));
    checked(&kv, &sh);
    append_compute(&mut kv, &mut sh, s, &[11, 12, 13]);
    checked(&kv, &sh);
}

#[test]
fn shift_never_writes_shared_blocks() {
    let (mut kv, mut sh) = cache(16, 4);
    let (s, _) = kv.add_sequence(NS, &[]);
    append_compute(&mut kv, &mut sh, s, &(1..=10).collect::<Vec<_>>());
    kv.insert_sequence(s).unwrap();
    let plan = kv.plan_shift(s, 2, 4).unwrap().ok().unwrap();
    // b0 keeps tokens 1, 2 and is shared with the tree: copied to b3 first.
    assert_eq!(
        plan.copies,
        [CopyOp {
            src: BlockId(0),
            dst: BlockId(3)
        }]
    );
    let mv = |a, b| SlotMove {
        src: Slot(a),
        dst: Slot(b),
    };
    assert_eq!(plan.moves, [mv(6, 14), mv(7, 15), mv(8, 16), mv(9, 17)]);
    sh.shift(&plan);
    assert_eq!(kv.sequence(s).unwrap().block_table(), b(&[3, 4]));
    checked(&kv, &sh);
    // The tree still serves the unshifted tokens; the shifted tail never
    // enters it.
    assert_eq!(
        kv.tree()
            .peek_prefix(NS, &toks(&(1..=10).collect::<Vec<_>>()))
            .len,
        10
    );
    let rep = kv.insert_sequence(s).unwrap();
    assert_eq!((rep.already_cached, rep.inserted), (2, 0));
    assert_eq!(kv.tree().peek_prefix(NS, &toks(&[1, 2, 7])).len, 2);
    checked(&kv, &sh);
}

#[test]
fn misuse_returns_typed_errors() {
    let (mut kv, mut sh) = cache(8, 4);
    let ghost = SeqId(99);
    assert_eq!(
        kv.free_sequence(ghost),
        Err(KvError::UnknownSequence(ghost))
    );
    assert_eq!(kv.fork(ghost), Err(KvError::UnknownSequence(ghost)));
    assert!(matches!(
        kv.append(ghost, &toks(&[1])),
        Err(KvError::UnknownSequence(_))
    ));
    let (s, _) = kv.add_sequence(NS, &[]);
    append_compute(&mut kv, &mut sh, s, &[1, 2, 3]);
    assert!(kv.append(s, &toks(&[4])).unwrap().is_ok());
    assert_eq!(
        kv.fork(s),
        Err(KvError::PendingTokens {
            seq: s,
            pending: 1,
            op: "fork"
        })
    );
    assert!(matches!(
        kv.insert_sequence(s),
        Err(KvError::PendingTokens { .. })
    ));
    assert!(matches!(
        kv.mark_computed(s, 9),
        Err(KvError::ComputedBeyondEnd { .. })
    ));
    kv.mark_computed(s, 4).unwrap();
    assert!(matches!(
        kv.plan_shift(s, 2, 0),
        Err(KvError::InvalidShift { .. })
    ));
    assert!(matches!(
        kv.plan_shift(s, 2, 3),
        Err(KvError::InvalidShift { .. })
    ));
    assert_eq!(kv.unlock(NodeId(0)), Err(KvError::NotLocked(NodeId(0))));
    assert_eq!(kv.lock(NodeId(42)), Err(KvError::UnknownNode(NodeId(42))));
    kv.free_sequence(s).unwrap();
    assert_eq!(kv.free_sequence(s), Err(KvError::UnknownSequence(s)));
    let mut pool = crate::BlockPool::new(4, 4).unwrap();
    let mut tree = crate::PrefixTree::new(4);
    let blk = pool.allocate().unwrap();
    assert_eq!(
        tree.insert(&mut pool, NS, &toks(&[1, 2, 3, 4, 5]), &[blk], false),
        Err(KvError::BlockCountMismatch {
            tokens: 5,
            expected: 2,
            got: 1
        })
    );
    pool.release(blk).unwrap();
    assert_eq!(
        tree.insert(&mut pool, NS, &toks(&[1]), &[blk], false),
        Err(KvError::RetainFree(blk))
    );
    kv.check_invariants().unwrap();
}

#[test]
fn a_truncated_speculative_tail_frees_its_blocks_and_is_written_again() {
    // Blocks of 4: a prompt of 6 tokens, then a speculative append of 5
    // (positions 6..11, into block 1 and new blocks 2 and 3), of which
    // the first two are kept.
    let (mut kv, mut sh) = cache(8, 4);
    let (s, _) = kv.add_sequence(NS, &[]);
    append_compute(&mut kv, &mut sh, s, &[1, 2, 3, 4, 5, 6]);
    append_compute(&mut kv, &mut sh, s, &[7, 8, 9, 10, 11]);
    assert_eq!(kv.sequence(s).unwrap().block_table(), b(&[0, 1, 2]));
    kv.truncate(s, 8).unwrap();
    let seq = kv.sequence(s).unwrap();
    assert_eq!((seq.len(), seq.num_computed()), (8, 8));
    assert_eq!(seq.block_table(), b(&[0, 1]));
    assert_eq!(counts(&kv, 3), [1, 1, 0]);
    checked(&kv, &sh);
    // The next tokens take the freed positions: block 2 again, position 8.
    let plan = append_compute(&mut kv, &mut sh, s, &[20, 21]);
    assert_eq!(plan.slots, vec![Slot(8), Slot(9)]);
    checked(&kv, &sh);
    // Truncating to the middle of a block keeps the block.
    kv.truncate(s, 9).unwrap();
    assert_eq!(kv.sequence(s).unwrap().block_table(), b(&[0, 1, 2]));
    checked(&kv, &sh);
    // What the sequence finally holds enters the tree as usual.
    kv.insert_sequence(s).unwrap();
    checked(&kv, &sh);
}

#[test]
fn truncation_never_takes_a_shared_block() {
    let (mut kv, mut sh) = cache(8, 4);
    let (p, _) = kv.add_sequence(NS, &[]);
    append_compute(&mut kv, &mut sh, p, &[1, 2, 3, 4, 5, 6]);
    let c = kv.fork(p).unwrap();
    // Block 1 is shared with the fork: cutting into it would take the
    // fork's content.
    assert!(matches!(kv.truncate(p, 2), Err(KvError::Invariant(_))));
    assert_eq!(kv.sequence(p).unwrap().len(), 6);
    // After its own append copied the tail, the tail is the parent's to cut.
    append_compute(&mut kv, &mut sh, p, &[7, 8, 9]);
    assert_eq!(kv.sequence(p).unwrap().block_table(), b(&[0, 2, 3]));
    kv.truncate(p, 6).unwrap();
    assert_eq!(kv.sequence(p).unwrap().block_table(), b(&[0, 2]));
    assert_eq!(kv.sequence(c).unwrap().block_table(), b(&[0, 1]));
    assert!(kv.truncate(p, 7).is_err());
    checked(&kv, &sh);
}

#[test]
fn the_tree_logs_full_blocks_stored_and_removed_in_order() {
    use crate::TreeEvent;
    let (mut kv, mut sh) = cache(8, 4);
    kv.set_log(true);
    let removed = |log: Vec<TreeEvent>| -> Vec<crate::Demoted> {
        log.into_iter()
            .map(|e| match e {
                TreeEvent::Removed(d) => d,
                other => panic!("{other:?}"),
            })
            .collect()
    };
    // Two cached texts sharing their first 6 tokens: "a" of 14, "b" of 9.
    let a: Vec<u32> = (1..=14).collect();
    let mut bt: Vec<u32> = (1..=6).collect();
    bt.extend([50, 51, 52]);
    for text in [&a, &bt] {
        let (s, _) = kv.add_sequence(NS, &toks(text));
        let at = kv.sequence(s).unwrap().len();
        append_compute(&mut kv, &mut sh, s, &text[at..]);
        kv.insert_sequence(s).unwrap();
        kv.free_sequence(s).unwrap();
    }
    // "a" stores its three full blocks; "b" branches inside block 1 and
    // stores its own block 1 (positions 4..8 of its path), not its
    // partial block 2.
    let stored = |t: &[u32], first| TreeEvent::Stored {
        namespace: NS,
        tokens: toks(t),
        first,
    };
    assert_eq!(kv.take_log(), [stored(&a[..12], 0), stored(&bt[..8], 1)]);
    // "a" is the older leaf: its blocks past the shared split go first.
    // Its node holds positions 6..14 in blocks 1, 2, 3: the last two go,
    // and block 3 (positions 12..14) is not full.
    let freed = kv.evict(2).unwrap();
    assert_eq!(freed.len(), 2);
    let d = removed(kv.take_log());
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!(d[0].namespace, NS);
    assert_eq!(d[0].first, 2);
    assert_eq!(d[0].tokens, toks(&a[..12]));
    assert_eq!(d[0].blocks.len(), 1);
    assert!(freed.contains(&d[0].blocks[0]));
    checked(&kv, &sh);
    // The rest of "a" goes: block 1, full along its path (positions 4..8)
    // though "b"'s side of the split still holds it.
    let freed = kv.evict(1).unwrap();
    let d = removed(kv.take_log());
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!((d[0].first, d[0].tokens.clone()), (1, toks(&a[..8])));
    assert!(!freed.contains(&d[0].blocks[0]), "still the split's");
    // (What freed a block was "b"'s partial last block: not logged.)
    assert_eq!(freed.len(), 1);
    checked(&kv, &sh);
    // Off: nothing is logged.
    kv.set_log(false);
    kv.clear_cache().unwrap();
    assert!(kv.take_log().is_empty());
}
