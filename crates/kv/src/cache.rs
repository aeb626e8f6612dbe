//! [`KvCache`]: sequences with block tables over one pool, shared through the
//! prefix tree and through forks, with copy-on-write, eviction, context-shift
//! plans and defragmentation plans.
//!
//! A sequence's position `p` lives in block `table[p / bs]` at offset
//! `p % bs`:
//!
//! ```text
//! block_size 4, 10 tokens:   positions  0 1 2 3 | 4 5 6 7 | 8 9 . .
//!                            table      [  b7   ,   b2    ,   b9   ]
//! position 9 -> table[2] = b9, offset 1 -> slot 9*4+1 = 37
//! ```

use std::collections::BTreeMap;

use crate::{
    Admission, AppendPlan, BlockId, BlockPool, CopyOp, DefragPlan, InsertOutcome, KvError,
    Namespace, NodeId, PrefixMatch, PrefixTree, SeqId, ShiftPlan, Slot, SlotMove, TokenId,
};

/// Pool geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvConfig {
    pub num_blocks: usize,
    /// Tokens per block (default 16).
    pub block_size: usize,
}

impl Default for KvConfig {
    fn default() -> Self {
        KvConfig {
            num_blocks: 1024,
            block_size: 16,
        }
    }
}

/// One sequence's state.
///
/// # Invariants
/// - `table.len() == ceil(tokens.len() / block_size)`, no block twice;
/// - `computed <= tokens.len()`: tokens past `computed` have slots reserved
///   but no K/V yet;
/// - only `tokens[..cacheable]` may enter the prefix tree: after a context
///   shift the rest no longer equals a fresh prefill.
#[derive(Debug, Clone)]
pub struct Sequence {
    namespace: Namespace,
    tokens: Vec<TokenId>,
    computed: usize,
    table: Vec<BlockId>,
    lock: Option<NodeId>,
    cacheable: usize,
}

impl Sequence {
    pub fn namespace(&self) -> Namespace {
        self.namespace
    }
    pub fn tokens(&self) -> &[TokenId] {
        &self.tokens
    }
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
    /// Number of leading tokens whose K/V is written.
    pub fn num_computed(&self) -> usize {
        self.computed
    }
    pub fn block_table(&self) -> &[BlockId] {
        &self.table
    }
    /// The tree node this sequence keeps locked, if any.
    pub fn locked_node(&self) -> Option<NodeId> {
        self.lock
    }
}

/// What [`KvCache::insert_sequence`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct InsertReport {
    /// Tokens that were in the tree already.
    pub already_cached: usize,
    /// Tokens newly added to the tree.
    pub inserted: usize,
    /// Blocks of the sequence that duplicated cached ones and were swapped
    /// for them (and released).
    pub deduplicated_blocks: usize,
}

/// Counters and occupancy, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvStats {
    pub num_blocks: usize,
    pub block_size: usize,
    pub free_blocks: usize,
    /// Blocks held by at least one sequence.
    pub used_blocks: usize,
    /// Blocks held only by the prefix tree: reusable, evictable.
    pub cached_blocks: usize,
    pub cached_tokens: usize,
    pub sequences: usize,
    pub evicted_blocks: u64,
    pub cow_copies: u64,
    pub shifts: u64,
    pub defrag_moves: u64,
}

/// The KV-cache bookkeeping of one model: pool, sequences and prefix tree.
///
/// Every block's count equals the number of block tables and tree nodes
/// holding it ([`check_invariants`](Self::check_invariants)). Methods that
/// return plans have already updated the bookkeeping; the engine must carry
/// the plan out on the K/V tensors before the next forward step.
#[derive(Debug, Clone)]
pub struct KvCache {
    pool: BlockPool,
    tree: PrefixTree,
    seqs: BTreeMap<SeqId, Sequence>,
    /// Locks taken through [`KvCache::lock`] rather than by sequences.
    external_locks: BTreeMap<NodeId, u32>,
    next_seq: u64,
    stats: KvStats,
}

impl KvCache {
    pub fn new(config: KvConfig) -> Result<Self, KvError> {
        Ok(KvCache {
            pool: BlockPool::new(config.num_blocks, config.block_size)?,
            tree: PrefixTree::new(config.block_size),
            seqs: BTreeMap::new(),
            external_locks: BTreeMap::new(),
            next_seq: 0,
            stats: KvStats::default(),
        })
    }

    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn tree(&self) -> &PrefixTree {
        &self.tree
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size())
    }

    pub fn sequence(&self, seq: SeqId) -> Result<&Sequence, KvError> {
        self.seqs.get(&seq).ok_or(KvError::UnknownSequence(seq))
    }

    pub fn sequence_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    /// The slot of position `pos` of `seq`.
    pub fn slot(&self, seq: SeqId, pos: usize) -> Result<Slot, KvError> {
        let s = self.sequence(seq)?;
        let bs = self.block_size();
        match s.table.get(pos / bs) {
            Some(&b) if pos < s.tokens.len() => Ok(Slot::of(b, pos % bs, bs)),
            _ => Err(KvError::ComputedBeyondEnd {
                seq,
                len: s.tokens.len(),
                upto: pos,
            }),
        }
    }

    /// Longest cached prefix of `tokens` (marks it recently used).
    pub fn match_prefix(&mut self, ns: Namespace, tokens: &[TokenId]) -> PrefixMatch {
        self.tree.match_prefix(ns, tokens)
    }

    /// Starts a sequence that reuses the longest cached prefix of `reusable`
    /// (pass an empty slice to reuse nothing). Its blocks are shared, its
    /// tree path is locked until the sequence is freed, and its tokens are
    /// the matched ones, already computed. Returns the id and that length.
    ///
    /// Callers that need logits for the last prompt token leave it out of
    /// `reusable`, so at least one token is computed.
    pub fn add_sequence(&mut self, ns: Namespace, reusable: &[TokenId]) -> (SeqId, usize) {
        let m = if reusable.is_empty() {
            PrefixMatch::default()
        } else {
            self.tree
                .match_prefix_for_lock(&mut self.pool, ns, reusable)
                .expect("matched blocks are live")
        };
        for &b in &m.blocks {
            self.pool
                .retain(b)
                .expect("blocks held by the tree are live");
        }
        if let Some(node) = m.node {
            self.tree.lock(node).expect("matched node is live");
        }
        let id = SeqId(self.next_seq);
        self.next_seq += 1;
        self.seqs.insert(
            id,
            Sequence {
                namespace: ns,
                tokens: reusable[..m.len].to_vec(),
                computed: m.len,
                table: m.blocks,
                lock: m.node,
                cacheable: usize::MAX,
            },
        );
        (id, m.len)
    }

    /// Reserves slots for `tokens` at the end of `seq`, allocating blocks
    /// (evicting cached ones if needed) and copying a shared tail block
    /// first. On `Later`/`Never` the sequence is unchanged.
    pub fn append(
        &mut self,
        seq: SeqId,
        tokens: &[TokenId],
    ) -> Result<Admission<AppendPlan>, KvError> {
        let bs = self.block_size();
        let s = self.sequence(seq)?;
        if tokens.is_empty() {
            return Ok(Admission::Ok(AppendPlan::default()));
        }
        let len = s.tokens.len();
        let new_len = len + tokens.len();
        let need_total = new_len.div_ceil(bs);
        if need_total > self.pool.num_blocks() {
            return Ok(Admission::Never {
                needed: need_total,
                total: self.pool.num_blocks(),
            });
        }
        let grow = need_total - s.table.len();
        let tail = (len % bs != 0).then(|| s.table[len / bs]);
        let shared_tail = |pool: &BlockPool| tail.filter(|&b| pool.ref_count(b) > 1);
        let needed = grow + usize::from(shared_tail(&self.pool).is_some());
        if !self.make_room(needed)? {
            return Ok(Admission::Later {
                needed,
                free: self.pool.num_free(),
            });
        }
        // Eviction may have dropped the tail's other holders.
        let cow = shared_tail(&self.pool);
        let mut plan = AppendPlan {
            copies: Vec::new(),
            slots: Vec::with_capacity(tokens.len()),
        };
        let pool = &mut self.pool;
        let s = self.seqs.get_mut(&seq).expect("checked above");
        if let Some(src) = cow {
            let dst = pool.allocate().expect("room was made");
            pool.release(src)?;
            s.table[len / bs] = dst;
            plan.copies.push(CopyOp { src, dst });
            self.stats.cow_copies += 1;
        }
        while s.table.len() < need_total {
            s.table.push(pool.allocate().expect("room was made"));
        }
        plan.slots
            .extend((len..new_len).map(|p| Slot::of(s.table[p / bs], p % bs, bs)));
        s.tokens.extend_from_slice(tokens);
        Ok(Admission::Ok(plan))
    }

    /// Records that the K/V of `seq`'s first `upto` tokens is written.
    pub fn mark_computed(&mut self, seq: SeqId, upto: usize) -> Result<(), KvError> {
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or(KvError::UnknownSequence(seq))?;
        if upto < s.computed || upto > s.tokens.len() {
            return Err(KvError::ComputedBeyondEnd {
                seq,
                len: s.tokens.len(),
                upto,
            });
        }
        s.computed = upto;
        Ok(())
    }

    /// A new sequence sharing every block of `seq` (parallel samples, beam
    /// search, a branch of a chat). The shared tail block is copied lazily by
    /// whichever of the two appends first.
    pub fn fork(&mut self, seq: SeqId) -> Result<SeqId, KvError> {
        let s = self.sequence(seq)?;
        Self::require_computed(seq, s, "fork")?;
        let child = s.clone();
        for &b in &child.table {
            self.pool.retain(b)?;
        }
        if let Some(node) = child.lock {
            self.tree.lock(node)?;
        }
        let id = SeqId(self.next_seq);
        self.next_seq += 1;
        self.seqs.insert(id, child);
        Ok(id)
    }

    /// Drops `seq` and its holds on blocks and on the tree.
    pub fn free_sequence(&mut self, seq: SeqId) -> Result<(), KvError> {
        let s = self
            .seqs
            .remove(&seq)
            .ok_or(KvError::UnknownSequence(seq))?;
        for &b in &s.table {
            self.pool.release(b)?;
        }
        if let Some(node) = s.lock {
            self.tree.unlock(node)?;
        }
        Ok(())
    }

    /// Offers `seq`'s computed (and still cacheable) tokens to the prefix
    /// tree. Blocks of the sequence that duplicate fully cached blocks are
    /// swapped for the cached ones, and the sequence's lock moves to its new
    /// deepest node so that what it holds is not evicted under it.
    pub fn insert_sequence(&mut self, seq: SeqId) -> Result<InsertReport, KvError> {
        self.insert_prefix(seq, usize::MAX)
    }

    /// [`insert_sequence`](Self::insert_sequence) of the whole blocks only:
    /// for a sequence that goes on writing its partly filled last block,
    /// which must not become shared (that would force a copy).
    pub fn insert_whole_blocks(&mut self, seq: SeqId) -> Result<InsertReport, KvError> {
        let bs = self.block_size();
        let len = self.sequence(seq)?.len();
        self.insert_prefix(seq, len / bs * bs)
    }

    fn insert_prefix(&mut self, seq: SeqId, upto: usize) -> Result<InsertReport, KvError> {
        let bs = self.block_size();
        let s = self.sequence(seq)?;
        Self::require_computed(seq, s, "insert")?;
        let n = s.tokens.len().min(s.cacheable).min(upto);
        if n == 0 {
            return Ok(InsertReport::default());
        }
        let ns = s.namespace;
        let cached = self.tree.peek_prefix(ns, &s.tokens[..n]);
        let s = self.seqs.get_mut(&seq).expect("checked above");
        let mut deduplicated_blocks = 0;
        for j in 0..cached.len / bs {
            let tree_block = cached.blocks[j];
            if s.table[j] != tree_block {
                self.pool.retain(tree_block)?;
                self.pool.release(s.table[j])?;
                s.table[j] = tree_block;
                deduplicated_blocks += 1;
            }
        }
        let InsertOutcome {
            cached: already_cached,
            node,
        } = self.tree.insert(
            &mut self.pool,
            ns,
            &s.tokens[..n],
            &s.table[..n.div_ceil(bs)],
        )?;
        if let Some(node) = node {
            self.tree.lock(node)?;
            if let Some(old) = s.lock.replace(node) {
                self.tree.unlock(old)?;
            }
        }
        Ok(InsertReport {
            already_cached,
            inserted: n - already_cached,
            deduplicated_blocks,
        })
    }

    /// Locks a tree node found by [`match_prefix`](Self::match_prefix) so it
    /// survives eviction while the caller uses it.
    pub fn lock(&mut self, node: NodeId) -> Result<(), KvError> {
        self.tree.lock(node)?;
        *self.external_locks.entry(node).or_default() += 1;
        Ok(())
    }

    /// Undoes one [`lock`](Self::lock).
    pub fn unlock(&mut self, node: NodeId) -> Result<(), KvError> {
        let held = self
            .external_locks
            .get_mut(&node)
            .ok_or(KvError::NotLocked(node))?;
        self.tree.unlock(node)?;
        *held -= 1;
        if *held == 0 {
            self.external_locks.remove(&node);
        }
        Ok(())
    }

    /// Evicts least-recently-used unlocked cached content until `n_blocks`
    /// blocks became free; returns them.
    pub fn evict(&mut self, n_blocks: usize) -> Result<Vec<BlockId>, KvError> {
        let freed = self.tree.evict(&mut self.pool, n_blocks)?;
        self.stats.evicted_blocks += freed.len() as u64;
        Ok(freed)
    }

    /// Drops every cached block that no sequence uses and no lock protects.
    pub fn clear_cache(&mut self) -> Result<usize, KvError> {
        Ok(self.evict(usize::MAX)?.len())
    }

    /// Compacts live blocks to ids `0..live`, remapping every table and tree
    /// node now. The engine copies `moves` before the next forward step.
    pub fn plan_defrag(&mut self) -> DefragPlan {
        let live = self.pool.num_live();
        let n = self.pool.num_blocks();
        let holes = (0..live).filter(|&i| self.pool.ref_count(BlockId(i as u32)) == 0);
        let strays = (live..n).filter(|&i| self.pool.ref_count(BlockId(i as u32)) > 0);
        let moves: Vec<CopyOp> = strays
            .zip(holes)
            .map(|(src, dst)| CopyOp {
                src: BlockId(src as u32),
                dst: BlockId(dst as u32),
            })
            .collect();
        if moves.is_empty() {
            return DefragPlan {
                moves,
                live_blocks: live,
            };
        }
        let mut map: Vec<BlockId> = (0..n as u32).map(BlockId).collect();
        for m in &moves {
            map[m.src.index()] = m.dst;
            self.pool.move_refs(m.src, m.dst);
        }
        self.pool.rebuild_free_list();
        for s in self.seqs.values_mut() {
            for b in &mut s.table {
                *b = map[b.index()];
            }
        }
        self.tree.remap_blocks(&map);
        self.stats.defrag_moves += moves.len() as u64;
        DefragPlan {
            moves,
            live_blocks: live,
        }
    }

    /// Gives back the blocks `num_blocks..` (all must be free: defragment
    /// first). The engine shrinks its tensors to match.
    pub fn shrink_to(&mut self, num_blocks: usize) -> Result<(), KvError> {
        self.pool.shrink_to(num_blocks)
    }

    /// Adds free blocks up to `num_blocks`.
    pub fn grow_to(&mut self, num_blocks: usize) -> Result<(), KvError> {
        self.pool.grow_to(num_blocks)
    }

    /// Plans a context shift of `seq`: keep `n_keep` tokens, discard the next
    /// `n_discard`, move the rest down by `n_discard` positions.
    ///
    /// ```text
    /// before: [ keep | discard |  tail  ]      positions 0..len
    /// after:  [ keep |  tail'  ]               tail' = tail moved down,
    ///                                          K rotated by -n_discard
    /// ```
    ///
    /// Blocks from the one holding position `n_keep` on are written; any of
    /// them that another holder shares is replaced by a fresh block (copied
    /// first if it keeps tokens of the kept part), so shared content is never
    /// changed in place. Nothing past `n_keep` of this sequence will enter the
    /// prefix tree afterwards.
    pub fn plan_shift(
        &mut self,
        seq: SeqId,
        n_keep: usize,
        n_discard: usize,
    ) -> Result<Admission<ShiftPlan>, KvError> {
        let bs = self.block_size();
        let s = self.sequence(seq)?;
        Self::require_computed(seq, s, "shift")?;
        let len = s.tokens.len();
        if n_discard == 0 || n_keep + n_discard > len {
            return Err(KvError::InvalidShift {
                seq,
                n_keep,
                n_discard,
                len,
            });
        }
        let new_len = len - n_discard;
        let new_blocks = new_len.div_ceil(bs);
        // Block indices that receive moved tokens.
        let written = if new_len > n_keep {
            n_keep / bs..new_blocks
        } else {
            0..0
        };
        let count_shared = |cache: &KvCache, table: &[BlockId]| {
            written
                .clone()
                .filter(|&j| cache.pool.ref_count(table[j]) > 1)
                .count()
        };
        let needed = count_shared(self, &s.table);
        if !self.make_room(needed)? {
            return Ok(Admission::Later {
                needed,
                free: self.pool.num_free(),
            });
        }
        let s = self.seqs.get_mut(&seq).expect("checked above");
        let old_table = s.table.clone();
        let mut copies = Vec::new();
        let mut released = Vec::new();
        for j in written.clone() {
            let old = old_table[j];
            if self.pool.ref_count(old) > 1 {
                let fresh = self.pool.allocate().expect("room was made");
                if j == n_keep / bs && !n_keep.is_multiple_of(bs) {
                    copies.push(CopyOp {
                        src: old,
                        dst: fresh,
                    });
                }
                s.table[j] = fresh;
                released.push(old);
            }
        }
        released.extend_from_slice(&old_table[new_blocks..]);
        s.table.truncate(new_blocks);
        let moves = (n_keep + n_discard..len)
            .map(|p| SlotMove {
                src: Slot::of(old_table[p / bs], p % bs, bs),
                dst: Slot::of(s.table[(p - n_discard) / bs], (p - n_discard) % bs, bs),
            })
            .collect();
        for b in released {
            self.pool.release(b)?;
        }
        s.tokens.drain(n_keep..n_keep + n_discard);
        s.computed = new_len;
        s.cacheable = s.cacheable.min(n_keep);
        self.stats.shifts += 1;
        Ok(Admission::Ok(ShiftPlan {
            copies,
            moves,
            position_delta: -(n_discard as i64),
        }))
    }

    /// Occupancy and counters.
    pub fn stats(&self) -> KvStats {
        let mut in_table = vec![false; self.pool.num_blocks()];
        for s in self.seqs.values() {
            for &b in &s.table {
                in_table[b.index()] = true;
            }
        }
        let used_blocks = in_table.iter().filter(|&&u| u).count();
        KvStats {
            num_blocks: self.pool.num_blocks(),
            block_size: self.block_size(),
            free_blocks: self.pool.num_free(),
            used_blocks,
            cached_blocks: self.pool.num_live() - used_blocks,
            cached_tokens: self.tree.cached_tokens(),
            sequences: self.seqs.len(),
            ..self.stats
        }
    }

    /// Verifies every invariant of the pool, the tree and the tables:
    /// each block's count equals the tables and nodes holding it, no block is
    /// both free and held, every node's tokens match its blocks, every table
    /// covers its tokens, and every lock is accounted for.
    pub fn check_invariants(&self) -> Result<(), KvError> {
        let bad = |m: String| Err(KvError::Invariant(m));
        let bs = self.block_size();
        let n = self.pool.num_blocks();
        let mut holders = vec![0u32; n];
        let mut locks: BTreeMap<NodeId, u32> = self.external_locks.clone();
        for (&id, s) in &self.seqs {
            if s.table.len() != s.tokens.len().div_ceil(bs) {
                return bad(format!(
                    "{id:?} has {} tokens but {} blocks",
                    s.tokens.len(),
                    s.table.len()
                ));
            }
            if s.computed > s.tokens.len() {
                return bad(format!(
                    "{id:?} computed {} of {} tokens",
                    s.computed,
                    s.tokens.len()
                ));
            }
            let mut seen = std::collections::BTreeSet::new();
            for &b in &s.table {
                if b.index() >= n {
                    return bad(format!("{id:?} holds {b:?} outside the pool"));
                }
                if !seen.insert(b) {
                    return bad(format!("{id:?} lists {b:?} twice"));
                }
                holders[b.index()] += 1;
            }
            if let Some(node) = s.lock {
                *locks.entry(node).or_default() += 1;
            }
        }
        self.tree.check_invariants(n)?;
        self.tree.for_each_block(|b| holders[b.index()] += 1);
        self.pool.check_invariants(&holders)?;
        for node in self.tree.node_ids() {
            let want = locks.remove(&node).unwrap_or(0);
            let have = self.tree.own_locks(node)?;
            if have != want {
                return bad(format!(
                    "{node:?} has {have} locks but {want} holders of locks"
                ));
            }
        }
        if let Some((node, _)) = locks.first_key_value() {
            return bad(format!(
                "a lock is held on {node:?}, which is not in the tree"
            ));
        }
        Ok(())
    }

    // ---- internals -------------------------------------------------------

    fn require_computed(seq: SeqId, s: &Sequence, op: &'static str) -> Result<(), KvError> {
        match s.tokens.len() - s.computed {
            0 => Ok(()),
            pending => Err(KvError::PendingTokens { seq, pending, op }),
        }
    }

    /// Evicts cached content until `needed` blocks are free; `false` if even
    /// that is not enough.
    fn make_room(&mut self, needed: usize) -> Result<bool, KvError> {
        let free = self.pool.num_free();
        if free < needed {
            self.evict(needed - free)?;
        }
        Ok(self.pool.num_free() >= needed)
    }
}
