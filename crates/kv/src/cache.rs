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
    /// A second pool for sliding-window layers, if the model has them.
    pub sliding: Option<SlidingConfig>,
}

/// The pool of the layers that see only the last `window` positions (a
/// query at `q` reads keys `q - window + 1 ..= q`).
///
/// Its blocks are attached to the global blocks holding the same positions
/// ([`BlockPool::attach`]), so tables and tree nodes list global blocks
/// only, and a position's sliding K/V exists where its block has one:
///
/// - a running sequence keeps them for its window (and for the positions
///   it keeps in a context shift, [`KvCache::keep_front`]); those behind it
///   go as soon as no one else holds the block;
/// - cached blocks keep theirs until the sliding pool runs short, then
///   lose them least recently used first, except the tails: the `window - 1`
///   positions before a point requests resume from (the end of a prompt,
///   of a generation, a branch point) stay as long as their tree node, and
///   go only when running sequences need the room and evicting every
///   unlocked leaf did not give it;
/// - a match is the longest cached prefix at whose end the whole window
///   is there ([`KvCache::cached_prefix_len`]); what lies past it is
///   computed again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingConfig {
    pub window: usize,
    pub num_blocks: usize,
}

impl Default for KvConfig {
    fn default() -> Self {
        KvConfig {
            num_blocks: 1024,
            block_size: 16,
            sliding: None,
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
    /// Positions before this keep their sliding blocks (a context shift
    /// keeps them).
    keep_front: usize,
    /// Blocks before this index were already let go of in sliding layers.
    trimmed: usize,
    /// Positions whose sliding K/V is stale after a context shift though
    /// their block has a sliding block (kept or moved positions that were
    /// behind the window then): never read, never cached.
    gaps: Vec<(usize, usize)>,
}

impl Sequence {
    fn add_gap(&mut self, a: usize, b: usize) {
        if a < b {
            self.gaps.push((a, b));
        }
    }

    fn in_gap(&self, p: usize) -> bool {
        self.gaps.iter().any(|&(a, b)| (a..b).contains(&p))
    }
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
    /// Blocks of the sliding-window pool (0 without one).
    pub sliding_blocks: usize,
    pub free_sliding_blocks: usize,
    /// Sliding blocks taken from cached content under pressure.
    pub evicted_sliding_blocks: u64,
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
        let mut pool = BlockPool::new(config.num_blocks, config.block_size)?;
        if let Some(sl) = config.sliding {
            pool = pool.with_sliding(sl.window, sl.num_blocks)?;
        }
        Ok(KvCache {
            pool,
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

    /// Whether the prefix tree logs the full blocks its paths gain and
    /// lose ([`PrefixTree::set_log`]).
    pub fn set_log(&mut self, on: bool) {
        self.tree.set_log(on);
    }

    /// What the prefix tree logged since the last call: an evicted block's
    /// K/V stays valid until the next forward writes the pool, so a lower
    /// tier reads it before that.
    pub fn take_log(&mut self) -> Vec<crate::TreeEvent> {
        self.tree.take_log()
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

    /// The sliding window, if the pool has sliding-window layers.
    pub fn window(&self) -> Option<usize> {
        self.pool.window()
    }

    /// `seq`'s sliding-layer blocks: `None` where its position's sliding
    /// K/V is gone (always before its window).
    pub fn sliding_table(&self, seq: SeqId) -> Result<Vec<Option<BlockId>>, KvError> {
        let s = self.sequence(seq)?;
        Ok(s.table.iter().map(|&b| self.pool.sliding_of(b)).collect())
    }

    /// The sliding-layer slot of position `pos` of `seq`, if it has one.
    pub fn sliding_slot(&self, seq: SeqId, pos: usize) -> Result<Option<Slot>, KvError> {
        let slot = self.slot(seq, pos)?;
        let bs = self.block_size();
        let b = BlockId((slot.index() / bs) as u32);
        Ok(self.pool.sliding_of(b).map(|s| Slot::of(s, pos % bs, bs)))
    }

    /// Longest cached prefix of `tokens` (marks it recently used).
    pub fn match_prefix(&mut self, ns: Namespace, tokens: &[TokenId]) -> PrefixMatch {
        let n = self.cached_prefix_len(ns, tokens);
        self.tree.match_prefix(ns, &tokens[..n])
    }

    /// How many leading tokens of `tokens` a request can reuse: the longest
    /// cached prefix at whose end every layer has what the next query reads
    /// (without sliding-window layers, the longest cached prefix).
    pub fn cached_prefix_len(&self, ns: Namespace, tokens: &[TokenId]) -> usize {
        let m = self.tree.peek_prefix(ns, tokens);
        self.resumable(&m.blocks, m.len)
    }

    /// The longest `n <= len` such that the blocks of the window before
    /// position `n` all have their sliding blocks.
    fn resumable(&self, blocks: &[BlockId], len: usize) -> usize {
        if self.window().is_none() {
            return len;
        }
        let bs = self.block_size();
        let mut n = len;
        loop {
            if n == 0 {
                return 0;
            }
            // The window before `n`, and at least the block of `n - 1`: a
            // partly matched block is copied with its sliding block.
            let lo = self.window_start(n).unwrap_or(0).min(n - 1);
            match (lo / bs..=(n - 1) / bs).rev().find(|&j| {
                !self
                    .pool
                    .sliding_holds(blocks[j], lo.saturating_sub(j * bs))
            }) {
                None => return n,
                Some(k) => n = k * bs,
            }
        }
    }

    /// The first position a query at `pos` reads in the sliding-window
    /// layers, `None` without them.
    pub fn window_start(&self, pos: usize) -> Option<usize> {
        self.window().map(|w| (pos + 1).saturating_sub(w))
    }

    /// The first block index that a sequence with `computed` tokens still
    /// reads in its sliding-window layers (0 without them).
    fn window_first_block(&self, computed: usize) -> usize {
        self.window_start(computed).unwrap_or(0) / self.block_size()
    }

    /// Where the sliding-window K/V that a sequence of `len` computed tokens
    /// keeps begins: the first position of the block holding the oldest
    /// position its next query reads (0 without sliding layers). Sessions
    /// store the sliding layers from here.
    pub fn sliding_tail_start(&self, len: usize) -> usize {
        self.window_first_block(len) * self.block_size()
    }

    /// Keeps the sliding blocks of `seq`'s first `n` positions for as long
    /// as it runs, so that a context shift keeping them can read them.
    pub fn keep_front(&mut self, seq: SeqId, n: usize) -> Result<(), KvError> {
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or(KvError::UnknownSequence(seq))?;
        s.keep_front = n;
        Ok(())
    }

    /// Lets go of the sliding blocks behind `seq`'s window that nothing
    /// else holds (cached or shared ones stay, as evictable content).
    fn trim_window(&mut self, seq: SeqId) {
        if self.window().is_none() {
            return;
        }
        let Some(s) = self.seqs.get(&seq) else { return };
        let bs = self.block_size();
        let first = self.window_first_block(s.computed);
        let from = s.trimmed.max(s.keep_front.div_ceil(bs));
        for j in from..first.min(s.table.len()) {
            let b = s.table[j];
            if self.pool.ref_count(b) == 1 {
                self.pool.detach(b);
            }
        }
        let s = self.seqs.get_mut(&seq).expect("checked above");
        s.trimmed = s.trimmed.max(first);
    }

    /// Frees up to `n` sliding blocks that no one reads: first those of
    /// blocks only sequences hold behind their windows, then cached ones,
    /// least recently used first, never a tail (see [`SlidingConfig`]).
    fn evict_sliding(&mut self, n: usize, protect: &[BlockId], spare_tails: bool) -> usize {
        let Some(w) = self.window() else { return 0 };
        let bs = self.block_size();
        let mut keep = vec![false; self.pool.num_blocks()];
        for b in protect {
            keep[b.index()] = true;
        }
        let mut in_tree = vec![false; self.pool.num_blocks()];
        let mut behind = Vec::new();
        for s in self.seqs.values() {
            let first = self.window_first_block(s.computed);
            let front = s.keep_front.div_ceil(bs).min(first);
            for (j, &b) in s.table.iter().enumerate() {
                if j >= first || j < front {
                    keep[b.index()] = true;
                } else {
                    behind.push(b);
                }
            }
        }
        if spare_tails {
            self.tree.for_each_tail_block(w, |b| keep[b.index()] = true);
        }
        self.tree.for_each_block(|b| in_tree[b.index()] = true);
        let aged = self.tree.blocks_by_age();
        let behind = behind.into_iter().filter(|b| !in_tree[b.index()]);
        let mut freed = 0;
        // With the tree's log on, a cached full block that loses sliding
        // K/V it held whole is logged (a lower tier keeps it).
        let mut places = None;
        let mut lost = Vec::new();
        for b in behind.chain(aged) {
            if freed >= n {
                break;
            }
            if keep[b.index()] {
                continue;
            }
            let whole = self.pool.sliding_holds(b, 0);
            let Some(s) = self.pool.detach(b) else {
                continue;
            };
            freed += 1;
            if whole && in_tree[b.index()] && self.tree.logging() {
                let places = places.get_or_insert_with(|| self.tree.full_block_places());
                if let Some(&(node, j)) = places.get(&b) {
                    lost.push((node, j, b, s));
                }
            }
        }
        self.tree.log_sliding_removed(&lost);
        self.stats.evicted_sliding_blocks += freed as u64;
        freed
    }

    /// Starts a sequence that reuses the longest cached prefix of `reusable`
    /// (pass an empty slice to reuse nothing). Its blocks are shared, its
    /// tree path is locked until the sequence is freed, and its tokens are
    /// the matched ones, already computed. Returns the id and that length.
    ///
    /// Callers that need logits for the last prompt token leave it out of
    /// `reusable`, so at least one token is computed.
    pub fn add_sequence(&mut self, ns: Namespace, reusable: &[TokenId]) -> (SeqId, usize) {
        let n = self.cached_prefix_len(ns, reusable);
        let m = if n == 0 {
            PrefixMatch::default()
        } else {
            self.tree
                .match_prefix_for_lock(&mut self.pool, ns, &reusable[..n])
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
                keep_front: 0,
                trimmed: 0,
                gaps: Vec::new(),
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
        self.append_from(seq, tokens, 0)
    }

    /// [`append`](Self::append) for K/V that is written rather than
    /// computed (a restored session): sliding-window layers get blocks only
    /// from the block holding position `sliding_from` on, and the writer
    /// fills them from that block's first position (see
    /// [`KvCache::sliding_tail_start`]).
    pub fn append_from(
        &mut self,
        seq: SeqId,
        tokens: &[TokenId],
        sliding_from: usize,
    ) -> Result<Admission<AppendPlan>, KvError> {
        let bs = self.block_size();
        self.sequence(seq)?;
        if tokens.is_empty() {
            return Ok(Admission::Ok(AppendPlan::default()));
        }
        self.trim_window(seq);
        let s = self.sequence(seq)?;
        let len = s.tokens.len();
        let new_len = len + tokens.len();
        let need_total = new_len.div_ceil(bs);
        // Sliding blocks from the first one the new tokens read or write.
        let sliding = self.window_start(len).map(|lo| {
            let lo = lo.max(sliding_from.min(new_len)) / bs;
            lo..need_total
        });
        // The positions a shift keeps hold theirs too.
        let sliding_total = sliding
            .as_ref()
            .map_or(0, |r| r.len() + s.keep_front.div_ceil(bs).min(r.start));
        if need_total > self.pool.num_blocks() || sliding_total > self.pool.num_sliding_blocks() {
            let (needed, total) = if need_total > self.pool.num_blocks() {
                (need_total, self.pool.num_blocks())
            } else {
                (sliding_total, self.pool.num_sliding_blocks())
            };
            return Ok(Admission::Never { needed, total });
        }
        let grow = need_total - s.table.len();
        let tail = (len % bs != 0).then(|| s.table[len / bs]);
        let shared_tail = |pool: &BlockPool| tail.filter(|&b| pool.ref_count(b) > 1);
        let needed = grow + usize::from(shared_tail(&self.pool).is_some());
        // New blocks, a copied tail, and blocks in range without one.
        let needed_s = sliding.clone().map_or(0, |r| {
            r.filter(|&j| match s.table.get(j) {
                None => true,
                Some(&b) => Some(b) == shared_tail(&self.pool) || self.pool.sliding_of(b).is_none(),
            })
            .count()
        });
        if !self.make_room(needed, needed_s)? {
            return Ok(self.later(needed, needed_s));
        }
        // Eviction may have dropped the tail's other holders.
        let cow = shared_tail(&self.pool);
        let mut plan = AppendPlan {
            copies: Vec::new(),
            slots: Vec::with_capacity(tokens.len()),
            ..AppendPlan::default()
        };
        let pool = &mut self.pool;
        let s = self.seqs.get_mut(&seq).expect("checked above");
        if let Some(src) = cow {
            let dst = pool.allocate().expect("room was made");
            let src_sliding = pool.sliding_of(src);
            let from = pool.sliding_valid_from(src);
            pool.release(src)?;
            s.table[len / bs] = dst;
            plan.copies.push(CopyOp { src, dst });
            if let (Some(ss), true) = (
                src_sliding,
                sliding.as_ref().is_some_and(|r| r.contains(&(len / bs))),
            ) {
                let sd = pool.attach_from(dst, from).expect("room was made");
                plan.sliding_copies.push(CopyOp { src: ss, dst: sd });
            }
            self.stats.cow_copies += 1;
        }
        while s.table.len() < need_total {
            s.table.push(pool.allocate().expect("room was made"));
        }
        if let Some(range) = sliding {
            for j in range {
                if pool.sliding_of(s.table[j]).is_none() {
                    // A restored session's sliding K/V begins at
                    // `sliding_from`, maybe mid-block.
                    let from = if j == sliding_from / bs {
                        sliding_from % bs
                    } else {
                        0
                    };
                    pool.attach_from(s.table[j], from).expect("room was made");
                    // Positions already in the block have no sliding K/V
                    // there (they were behind every window): never read,
                    // never cached.
                    if j * bs < len {
                        s.add_gap(j * bs, len.min((j + 1) * bs));
                        s.cacheable = s.cacheable.min(j * bs);
                    }
                }
            }
            plan.sliding_slots.extend((len..new_len).map(
                |p| match pool.sliding_of(s.table[p / bs]) {
                    Some(b) if p >= sliding_from => Slot::of(b, p % bs, bs),
                    _ => Slot(u32::MAX),
                },
            ));
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

    /// Drops `seq`'s tokens from `new_len` on: the end of a speculative
    /// append whose tokens were not accepted. Blocks wholly past the new
    /// end go back to the pool (with their sliding blocks); the kept tail
    /// block's later slots are written again by the next append. No K/V
    /// moves. Only what the sequence appended itself may go: every block
    /// released must be the sequence's alone (not cached, not shared with
    /// a fork), else nothing changes and the error says so.
    pub fn truncate(&mut self, seq: SeqId, new_len: usize) -> Result<(), KvError> {
        let bs = self.block_size();
        let s = self.sequence(seq)?;
        let len = s.tokens.len();
        if new_len > len {
            return Err(KvError::Invariant(format!(
                "truncate {seq} to {new_len} tokens: it has {len}"
            )));
        }
        let keep = new_len.div_ceil(bs);
        if let Some(&b) = s.table[keep..]
            .iter()
            .find(|&&b| self.pool.ref_count(b) != 1)
        {
            return Err(KvError::Invariant(format!(
                "truncate {seq} to {new_len} tokens: block {b} past the end is shared"
            )));
        }
        let s = self.seqs.get_mut(&seq).expect("checked above");
        for b in s.table.drain(keep..) {
            self.pool.release(b)?;
        }
        s.tokens.truncate(new_len);
        s.computed = s.computed.min(new_len);
        s.trimmed = s.trimmed.min(keep);
        s.gaps.retain_mut(|g| {
            g.1 = g.1.min(new_len);
            g.0 < g.1
        });
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
    ///
    /// Its end is a point requests resume from: with sliding-window layers,
    /// the window before it keeps its sliding blocks while it is cached.
    pub fn insert_sequence(&mut self, seq: SeqId) -> Result<InsertReport, KvError> {
        self.insert_prefix(seq, usize::MAX, true)
    }

    /// [`insert_sequence`](Self::insert_sequence) of the whole blocks only:
    /// for a sequence that goes on writing its partly filled last block,
    /// which must not become shared (that would force a copy).
    pub fn insert_whole_blocks(&mut self, seq: SeqId) -> Result<InsertReport, KvError> {
        let bs = self.block_size();
        let len = self.sequence(seq)?.len();
        self.insert_prefix(seq, len / bs * bs, false)
    }

    /// [`insert_whole_blocks`](Self::insert_whole_blocks) at the end of a
    /// prompt: a point requests resume from, like
    /// [`insert_sequence`](Self::insert_sequence)'s end.
    pub fn insert_prompt(&mut self, seq: SeqId) -> Result<InsertReport, KvError> {
        let bs = self.block_size();
        let len = self.sequence(seq)?.len();
        self.insert_prefix(seq, len / bs * bs, true)
    }

    fn insert_prefix(
        &mut self,
        seq: SeqId,
        upto: usize,
        boundary: bool,
    ) -> Result<InsertReport, KvError> {
        let bs = self.block_size();
        let s = self.sequence(seq)?;
        Self::require_computed(seq, s, "insert")?;
        let n = s.tokens.len().min(s.cacheable).min(upto);
        if n == 0 {
            return Ok(InsertReport::default());
        }
        let ns = s.namespace;
        let boundary = boundary && self.pool.window().is_some();
        let cached = self.tree.peek_prefix(ns, &s.tokens[..n]);
        let window_from = self.window_first_block(s.computed);
        let s = self.seqs.get_mut(&seq).expect("checked above");
        let mut deduplicated_blocks = 0;
        for j in 0..cached.len / bs {
            let (tree_block, own) = (cached.blocks[j], s.table[j]);
            if own == tree_block {
                continue;
            }
            // The sliding K/V goes with the block that stays, when only
            // this sequence's copy has it.
            if self.pool.sliding_of(tree_block).is_none() && self.pool.sliding_of(own).is_some() {
                if self.pool.ref_count(own) == 1 {
                    self.pool.transfer_sliding(own, tree_block);
                } else if j >= window_from {
                    continue;
                }
            }
            self.pool.retain(tree_block)?;
            self.pool.release(own)?;
            s.table[j] = tree_block;
            deduplicated_blocks += 1;
        }
        let InsertOutcome {
            cached: already_cached,
            node,
        } = self.tree.insert(
            &mut self.pool,
            ns,
            &s.tokens[..n],
            &s.table[..n.div_ceil(bs)],
            boundary,
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
    /// blocks became free; returns them. (Sliding blocks go by themselves
    /// when an append needs them.)
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
            let (sliding_moves, sliding_live) = self.pool.compact_sliding();
            return DefragPlan {
                moves,
                live_blocks: live,
                sliding_moves,
                sliding_live,
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
        let (sliding_moves, sliding_live) = self.pool.compact_sliding();
        DefragPlan {
            moves,
            live_blocks: live,
            sliding_moves,
            sliding_live,
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
        // Sliding layers: the positions the next query reads.
        let window = self.window_start(new_len);
        if let Some(lo) = window.filter(|&lo| lo < n_keep) {
            let missing = (lo..n_keep)
                .find(|&p| !self.pool.sliding_holds(s.table[p / bs], p % bs) || s.in_gap(p));
            if let Some(position) = missing {
                return Err(KvError::ShiftLosesWindow {
                    seq,
                    n_keep,
                    position,
                });
            }
        }
        let shared = |cache: &KvCache, j: usize| cache.pool.ref_count(s.table[j]) > 1;
        let needed = written.clone().filter(|&j| shared(self, j)).count();
        // Whether block `j` holds a position the new window reads.
        let in_window = |j: usize| window.is_some_and(|lo| (j + 1) * bs > lo);
        let needed_s = window.map_or(0, |_| {
            written
                .clone()
                .filter(|&j| in_window(j))
                .filter(|&j| shared(self, j) || self.pool.sliding_of(s.table[j]).is_none())
                .count()
        });
        // What the new window reads keeps its sliding blocks meanwhile.
        let kept: Vec<BlockId> = window.map_or(Vec::new(), |lo| {
            s.table[(lo / bs).min(new_blocks)..new_blocks].to_vec()
        });
        if !self.make_room_keeping(needed, needed_s, &kept)? {
            return Ok(self.later(needed, needed_s));
        }
        let s = self.seqs.get_mut(&seq).expect("checked above");
        let old_table = s.table.clone();
        let old_sliding: Vec<Option<BlockId>> =
            old_table.iter().map(|&b| self.pool.sliding_of(b)).collect();
        let mut copies = Vec::new();
        let mut sliding_copies = Vec::new();
        let mut released = Vec::new();
        let partial_keep = j_keep_partial(n_keep, bs);
        // A kept block whose sliding K/V could not be carried over (its
        // kept positions were behind the window): it never enters the tree.
        let mut unwritten = None;
        for j in written.clone() {
            let old = old_table[j];
            if self.pool.ref_count(old) > 1 {
                let fresh = self.pool.allocate().expect("room was made");
                s.table[j] = fresh;
                released.push(old);
                if in_window(j) {
                    let sd = self.pool.attach(fresh).expect("room was made");
                    if partial_keep == Some(j) {
                        match old_sliding[j] {
                            Some(ss) => sliding_copies.push(CopyOp { src: ss, dst: sd }),
                            None => unwritten = Some(j * bs),
                        }
                    }
                }
                if partial_keep == Some(j) {
                    copies.push(CopyOp {
                        src: old,
                        dst: fresh,
                    });
                }
            } else if in_window(j) && self.pool.sliding_of(old).is_none() {
                self.pool.attach(old).expect("room was made");
                if partial_keep == Some(j) {
                    unwritten = Some(j * bs);
                }
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
        let sliding_moves = match window {
            None => Vec::new(),
            Some(lo) => (n_keep + n_discard..len)
                .filter(|&p| p - n_discard >= lo)
                .map(|p| {
                    let d = p - n_discard;
                    let src = old_sliding[p / bs].expect("the old window has its blocks");
                    let dst = self
                        .pool
                        .sliding_of(s.table[d / bs])
                        .expect("attached above");
                    SlotMove {
                        src: Slot::of(src, p % bs, bs),
                        dst: Slot::of(dst, d % bs, bs),
                    }
                })
                .collect(),
        };
        for b in released {
            self.pool.release(b)?;
        }
        s.tokens.drain(n_keep..n_keep + n_discard);
        s.computed = new_len;
        s.cacheable = s.cacheable.min(n_keep).min(unwritten.unwrap_or(usize::MAX));
        if let Some(lo) = window {
            // Stale from here on: the kept block's positions not carried
            // over, then the moved positions behind the window (they got no
            // sliding move). A gap of an earlier shift stays where kept.
            for g in &mut s.gaps {
                g.1 = g.1.min(n_keep);
            }
            s.gaps.retain(|&(a, b)| a < b);
            s.add_gap(unwritten.unwrap_or(n_keep), lo.max(n_keep));
        }
        s.trimmed = 0;
        self.stats.shifts += 1;
        Ok(Admission::Ok(ShiftPlan {
            copies,
            moves,
            position_delta: -(n_discard as i64),
            sliding_copies,
            sliding_moves,
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
            sliding_blocks: self.pool.num_sliding_blocks(),
            free_sliding_blocks: self.pool.num_free_sliding(),
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
            if let Some(lo) = self.window_start(s.computed) {
                if let Some(p) = (lo..s.computed).find(|&p| s.in_gap(p)) {
                    return bad(format!("{id:?} reads its stale position {p}"));
                }
                // Blocks the next queries read, and those of pending tokens.
                let reads = if lo < s.tokens.len() {
                    lo / bs..s.table.len()
                } else {
                    0..0
                };
                if let Some(j) = reads.clone().find(|&j| {
                    !self
                        .pool
                        .sliding_holds(s.table[j], lo.saturating_sub(j * bs))
                }) {
                    return bad(format!(
                        "{id:?} reads block {j} in its sliding window but it has no sliding block"
                    ));
                }
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

    /// Evicts cached content until `needed` blocks and `needed_s` sliding
    /// blocks are free; `false` if even that is not enough.
    fn make_room(&mut self, needed: usize, needed_s: usize) -> Result<bool, KvError> {
        self.make_room_keeping(needed, needed_s, &[])
    }

    /// [`make_room`](Self::make_room) that leaves the sliding blocks of
    /// `protect` alone.
    fn make_room_keeping(
        &mut self,
        needed: usize,
        needed_s: usize,
        protect: &[BlockId],
    ) -> Result<bool, KvError> {
        let free = self.pool.num_free();
        if free < needed {
            self.evict(needed - free)?;
        }
        // Sliding blocks of nothing read and no tail go first; what is left
        // is read by sequences or is a tail: only whole cached leaves can
        // give it back (a shorter leaf pins another tail).
        let spare_tails = true;
        self.evict_sliding_short(needed_s, protect, spare_tails);
        while self.pool.num_free_sliding() < needed_s {
            if self.evict(1)?.is_empty() && self.tree.num_evictable_leaves() == 0 {
                break;
            }
            self.evict_sliding_short(needed_s, protect, spare_tails);
        }
        // Locked paths' tails last: running sequences come first.
        self.evict_sliding_short(needed_s, protect, !spare_tails);
        Ok(self.pool.num_free() >= needed && self.pool.num_free_sliding() >= needed_s)
    }

    /// [`evict_sliding`](Self::evict_sliding) of what `needed_s` free
    /// sliding blocks still lack.
    fn evict_sliding_short(&mut self, needed_s: usize, protect: &[BlockId], spare_tails: bool) {
        let free_s = self.pool.num_free_sliding();
        if free_s < needed_s {
            self.evict_sliding(needed_s - free_s, protect, spare_tails);
        }
    }

    /// `Later` for an append or shift that needed `needed` blocks and
    /// `needed_s` sliding blocks after evicting: the numbers of the pool
    /// that was short.
    fn later<T>(&self, needed: usize, needed_s: usize) -> Admission<T> {
        if self.pool.num_free() < needed {
            Admission::Later {
                needed,
                free: self.pool.num_free(),
            }
        } else {
            Admission::Later {
                needed: needed_s,
                free: self.pool.num_free_sliding(),
            }
        }
    }
}

/// The block index holding both kept and moved tokens in a shift (the
/// block of `n_keep` when it does not start there).
fn j_keep_partial(n_keep: usize, bs: usize) -> Option<usize> {
    (!n_keep.is_multiple_of(bs)).then_some(n_keep / bs)
}
