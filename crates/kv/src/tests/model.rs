//! Model-based property test: random operation sequences against a naive
//! oracle (plain token lists per sequence, a plain list of cached strings),
//! with `check_invariants()` and a shadow read-back after every operation.

use proptest::prelude::*;

use super::{toks, Shadow};
use crate::{Admission, KvCache, KvConfig, KvError, Namespace, NodeId, SeqId, TokenId};

#[derive(Debug, Clone)]
pub(super) enum Op {
    /// Start a sequence: (a prefix of an existing sequence's tokens) + extra.
    Add {
        ns: u8,
        from: Option<usize>,
        cut: usize,
        extra: Vec<u32>,
        reuse: bool,
    },
    /// Reserve slots; with `compute`, also write them right away.
    Append {
        seq: usize,
        tokens: Vec<u32>,
        compute: bool,
    },
    Compute {
        seq: usize,
    },
    Fork {
        seq: usize,
    },
    Free {
        seq: usize,
    },
    Insert {
        seq: usize,
    },
    Match {
        ns: u8,
        from: Option<usize>,
        cut: usize,
        extra: Vec<u32>,
        touch: bool,
    },
    Lock {
        ns: u8,
        from: Option<usize>,
        cut: usize,
    },
    Unlock {
        which: usize,
    },
    Evict {
        n: usize,
    },
    Defrag,
    Shift {
        seq: usize,
        keep: usize,
        discard: usize,
    },
    ClearCache,
}

fn tokens(max: usize) -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(0u32..3, 0..max)
}

pub(super) fn op() -> impl Strategy<Value = Op> {
    let from = prop::option::weighted(0.7, 0usize..8);
    prop_oneof![
        4 => (0u8..2, from.clone(), 0usize..64, tokens(20), prop::bool::weighted(0.9))
            .prop_map(|(ns, from, cut, extra, reuse)| Op::Add { ns, from, cut, extra, reuse }),
        8 => (0usize..8, tokens(12), prop::bool::weighted(0.75))
            .prop_map(|(seq, tokens, compute)| Op::Append { seq, tokens, compute }),
        3 => (0usize..8).prop_map(|seq| Op::Compute { seq }),
        2 => (0usize..8).prop_map(|seq| Op::Fork { seq }),
        2 => (0usize..8).prop_map(|seq| Op::Free { seq }),
        5 => (0usize..8).prop_map(|seq| Op::Insert { seq }),
        3 => (0u8..2, from.clone(), 0usize..64, tokens(6), any::<bool>())
            .prop_map(|(ns, from, cut, extra, touch)| Op::Match { ns, from, cut, extra, touch }),
        1 => (0u8..2, from, 0usize..64).prop_map(|(ns, from, cut)| Op::Lock { ns, from, cut }),
        1 => (0usize..4).prop_map(|which| Op::Unlock { which }),
        2 => (0usize..6).prop_map(|n| Op::Evict { n }),
        2 => Just(Op::Defrag),
        2 => (0usize..8, 0usize..64, 1usize..64)
            .prop_map(|(seq, keep, discard)| Op::Shift { seq, keep, discard }),
        1 => Just(Op::ClearCache),
    ]
}

#[derive(Debug, Clone)]
struct OSeq {
    id: SeqId,
    ns: Namespace,
    tokens: Vec<TokenId>,
    computed: usize,
    cacheable: usize,
}

struct World {
    kv: KvCache,
    sh: Shadow,
    seqs: Vec<OSeq>,
    /// Oracle of the tree: every string inserted and not evicted.
    cached: Vec<(Namespace, Vec<TokenId>)>,
    /// External locks: node and the prefix it protects.
    locks: Vec<(NodeId, Namespace, Vec<TokenId>)>,
}

fn lcp(a: &[TokenId], b: &[TokenId]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl World {
    fn oracle_match(&self, ns: Namespace, q: &[TokenId]) -> usize {
        self.cached
            .iter()
            .filter(|(n, _)| *n == ns)
            .map(|(_, s)| lcp(s, q))
            .max()
            .unwrap_or(0)
    }

    fn query(&self, from: Option<usize>, cut: usize, extra: &[u32]) -> Vec<TokenId> {
        let mut q = match from {
            Some(i) if !self.seqs.is_empty() => {
                let s = &self.seqs[i % self.seqs.len()].tokens;
                s[..cut % (s.len() + 1)].to_vec()
            }
            _ => Vec::new(),
        };
        q.extend(toks(extra));
        q
    }

    fn pick(&self, i: usize) -> Option<usize> {
        (!self.seqs.is_empty()).then(|| i % self.seqs.len())
    }

    /// After an eviction: what is left is a prefix of what was cached, locked
    /// prefixes are intact, and the oracle takes the tree's new content.
    fn resync_after_evict(&mut self) -> Result<(), TestCaseError> {
        let now: Vec<_> = self
            .kv
            .tree()
            .paths()
            .into_iter()
            .map(|p| (p.namespace, p.tokens))
            .collect();
        for (ns, path) in &now {
            prop_assert!(
                self.cached
                    .iter()
                    .any(|(n, s)| n == ns && s.starts_with(path)),
                "eviction invented cached content {path:?}"
            );
        }
        for (_, ns, prefix) in &self.locks {
            prop_assert_eq!(
                self.kv.tree().peek_prefix(*ns, prefix).len,
                prefix.len(),
                "locked prefix evicted"
            );
        }
        self.cached = now;
        Ok(())
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let bs = self.kv.block_size();
        match op {
            Op::Add {
                ns,
                from,
                cut,
                extra,
                reuse,
            } => {
                let ns = Namespace(*ns as u64);
                let q = self.query(*from, *cut, extra);
                let reusable = if *reuse { &q[..] } else { &[][..] };
                let want = if *reuse { self.oracle_match(ns, &q) } else { 0 };
                let (id, got) = self.kv.add_sequence(ns, reusable);
                prop_assert_eq!(got, want, "match length of {:?}", q);
                self.seqs.push(OSeq {
                    id,
                    ns,
                    tokens: q[..got].to_vec(),
                    computed: got,
                    cacheable: usize::MAX,
                });
            }
            Op::Append {
                seq,
                tokens,
                compute,
            } => {
                let Some(i) = self.pick(*seq) else {
                    return Ok(());
                };
                let s = &self.seqs[i];
                let new = toks(tokens);
                match self.kv.append(s.id, &new).unwrap() {
                    Admission::Ok(plan) => {
                        self.sh.copy_append(&plan);
                        prop_assert_eq!(plan.slots.len(), new.len());
                        for (k, slot) in plan.slots.iter().enumerate() {
                            prop_assert_eq!(*slot, self.kv.slot(s.id, s.tokens.len() + k).unwrap());
                        }
                        self.seqs[i].tokens.extend(new);
                        if *compute {
                            self.sh.compute(&mut self.kv, self.seqs[i].id);
                            self.seqs[i].computed = self.seqs[i].tokens.len();
                        }
                        // Making room may have evicted cached content.
                        self.resync_after_evict()?;
                    }
                    Admission::Later { needed, free } => {
                        prop_assert!(free < needed);
                        prop_assert_eq!(self.kv.pool().num_free(), free);
                        prop_assert_eq!(
                            self.kv.tree().num_evictable_leaves(),
                            0,
                            "Later with evictable leaves"
                        );
                        self.resync_after_evict()?;
                    }
                    Admission::Never { needed, total } => {
                        prop_assert_eq!(needed, (s.tokens.len() + new.len()).div_ceil(bs));
                        prop_assert!(needed > total);
                    }
                }
            }
            Op::Compute { seq } => {
                let Some(i) = self.pick(*seq) else {
                    return Ok(());
                };
                self.sh.compute(&mut self.kv, self.seqs[i].id);
                self.seqs[i].computed = self.seqs[i].tokens.len();
            }
            Op::Fork { seq } => {
                let Some(i) = self.pick(*seq) else {
                    return Ok(());
                };
                let s = self.seqs[i].clone();
                match self.kv.fork(s.id) {
                    Ok(id) => {
                        prop_assert_eq!(s.computed, s.tokens.len());
                        self.seqs.push(OSeq { id, ..s });
                    }
                    Err(KvError::PendingTokens { .. }) => prop_assert!(s.computed < s.tokens.len()),
                    Err(e) => return Err(TestCaseError::fail(e.to_string())),
                }
            }
            Op::Free { seq } => {
                let Some(i) = self.pick(*seq) else {
                    return Ok(());
                };
                let s = self.seqs.swap_remove(i);
                self.kv.free_sequence(s.id).unwrap();
                prop_assert_eq!(
                    self.kv.free_sequence(s.id),
                    Err(KvError::UnknownSequence(s.id))
                );
            }
            Op::Insert { seq } => {
                let Some(i) = self.pick(*seq) else {
                    return Ok(());
                };
                let s = self.seqs[i].clone();
                match self.kv.insert_sequence(s.id) {
                    Ok(rep) => {
                        let n = s.tokens.len().min(s.cacheable);
                        prop_assert_eq!(rep.already_cached + rep.inserted, n);
                        if n > 0 {
                            prop_assert_eq!(
                                rep.already_cached,
                                self.oracle_match(s.ns, &s.tokens[..n]).min(n)
                            );
                            self.cached.push((s.ns, s.tokens[..n].to_vec()));
                        }
                    }
                    Err(KvError::PendingTokens { .. }) => prop_assert!(s.computed < s.tokens.len()),
                    Err(e) => return Err(TestCaseError::fail(e.to_string())),
                }
            }
            Op::Match {
                ns,
                from,
                cut,
                extra,
                touch,
            } => {
                let ns = Namespace(*ns as u64);
                let q = self.query(*from, *cut, extra);
                let want = self.oracle_match(ns, &q);
                let m = if *touch {
                    self.kv.match_prefix(ns, &q)
                } else {
                    self.kv.tree().peek_prefix(ns, &q)
                };
                prop_assert_eq!(m.len, want, "match of {:?}", q);
                prop_assert_eq!(m.blocks.len(), want.div_ceil(bs));
            }
            Op::Lock { ns, from, cut } => {
                let ns = Namespace(*ns as u64);
                let q = self.query(*from, *cut, &[]);
                let m = self.kv.match_prefix(ns, &q);
                if let Some(node) = m.node {
                    self.kv.lock(node).unwrap();
                    self.locks.push((node, ns, q[..m.len].to_vec()));
                }
            }
            Op::Unlock { which } => {
                if !self.locks.is_empty() {
                    let (node, _, _) = self.locks.swap_remove(which % self.locks.len());
                    self.kv.unlock(node).unwrap();
                }
            }
            Op::Evict { n } => {
                let freed = self.kv.evict(*n).unwrap();
                prop_assert!(freed.len() >= *n || self.kv.tree().num_evictable_leaves() == 0);
                for b in &freed {
                    prop_assert_eq!(self.kv.pool().ref_count(*b), 0);
                }
                self.resync_after_evict()?;
            }
            Op::Defrag => {
                let plan = self.kv.plan_defrag();
                self.sh.defrag(&plan);
                prop_assert_eq!(plan.live_blocks, self.kv.pool().num_live());
                if let Some(h) = self.kv.pool().highest_live() {
                    prop_assert!(h.index() < plan.live_blocks, "defrag left a hole");
                }
            }
            Op::Shift { seq, keep, discard } => {
                let Some(i) = self.pick(*seq) else {
                    return Ok(());
                };
                let s = self.seqs[i].clone();
                let len = s.tokens.len();
                let n_keep = keep % (len + 1);
                let room = len - n_keep;
                if room == 0 {
                    return Ok(());
                }
                let n_discard = 1 + discard % room;
                match self.kv.plan_shift(s.id, n_keep, n_discard) {
                    Ok(Admission::Ok(plan)) => {
                        prop_assert_eq!(s.computed, len);
                        self.sh.shift(&plan);
                        let o = &mut self.seqs[i];
                        o.tokens.drain(n_keep..n_keep + n_discard);
                        o.computed = o.tokens.len();
                        o.cacheable = o.cacheable.min(n_keep);
                        self.resync_after_evict()?;
                    }
                    Ok(Admission::Later { needed, free }) => {
                        prop_assert!(free < needed);
                        self.resync_after_evict()?;
                    }
                    Ok(Admission::Never { .. }) => {
                        prop_assert!(false, "a shift never needs more than the pool")
                    }
                    Err(KvError::PendingTokens { .. }) => prop_assert!(s.computed < len),
                    Err(e) => return Err(TestCaseError::fail(e.to_string())),
                }
            }
            Op::ClearCache => {
                self.kv.clear_cache().unwrap();
                prop_assert_eq!(self.kv.tree().num_evictable_leaves(), 0);
                self.resync_after_evict()?;
            }
        }
        Ok(())
    }

    fn check(&self) -> Result<(), TestCaseError> {
        self.kv
            .check_invariants()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        for o in &self.seqs {
            let s = self.kv.sequence(o.id).unwrap();
            prop_assert_eq!(s.tokens(), &o.tokens[..]);
            prop_assert_eq!(s.num_computed(), o.computed);
            self.sh
                .check_seq(&self.kv, o.id)
                .map_err(TestCaseError::fail)?;
        }
        self.sh.check_tree(&self.kv).map_err(TestCaseError::fail)?;
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    #[test]
    fn bookkeeping_matches_the_oracle(
        block_size in prop::sample::select(vec![1usize, 2, 3, 4, 16]),
        num_blocks in 1usize..48,
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let kv = KvCache::new(KvConfig { num_blocks, block_size, sliding: None }).unwrap();
        let sh = Shadow::new(&kv);
        let mut w = World { kv, sh, seqs: Vec::new(), cached: Vec::new(), locks: Vec::new() };
        for op in &ops {
            w.apply(op)?;
            w.check()?;
        }
        // Tearing everything down returns every block.
        for o in std::mem::take(&mut w.seqs) {
            w.kv.free_sequence(o.id).unwrap();
        }
        for (node, _, _) in std::mem::take(&mut w.locks) {
            w.kv.unlock(node).unwrap();
        }
        w.kv.clear_cache().unwrap();
        w.kv.check_invariants().map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(w.kv.pool().num_free(), num_blocks);
        prop_assert_eq!(w.kv.tree().num_nodes(), 0);
    }
}
