//! The prefix tree: a radix tree over token ids, one root per namespace.
//!
//! Each edge holds a run of tokens and the blocks that hold their K/V. Tokens
//! sit at absolute positions, so a node that starts or ends inside a block
//! shares that block with its neighbour:
//!
//! ```text
//! block_size 4, cached "abcdefg" then "abcdxyz" inserted:
//!
//!   root ── "abcd" [b0]  ── "efg" [b1]          positions 4..7 in b1
//!                        └─ "xyz" [b2]          positions 4..7 in b2
//!
//! cached "abcdef", then "abcxy" inserted (split inside block 0):
//!
//!   root ── "abc" [b0] ── "def" [b0 b1]         b0 is held by both nodes
//!                      └─ "xy"  [b5 b6]         b5 holds a copy of "abc"
//! ```
//!
//! A node's block at index `j` holds valid K/V for every position of block `j`
//! up to the node's end, along the node's root path (the tokens before the
//! node are its ancestors', and the sequence that wrote the block had the
//! same ones). A match therefore takes, for each block index, the block of the
//! deepest matched node that covers it, and may stop anywhere: matches are
//! token-exact, never rounded down to a block boundary.
//!
//! Every node holds one reference on each of its blocks. Eviction removes
//! least-recently-used unlocked leaves by a logical clock.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::{BlockId, BlockPool, KvError, Namespace, NodeId, TokenId};

/// The result of matching tokens against the tree.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PrefixMatch {
    /// Number of leading tokens whose K/V is cached (token-exact).
    pub len: usize,
    /// The blocks holding them: `ceil(len / block_size)` entries. The last one
    /// may be partly matched; whoever writes into it copies it first.
    pub blocks: Vec<BlockId>,
    /// The deepest node touched (to lock while the prefix is in use).
    pub node: Option<NodeId>,
}

/// The result of [`PrefixTree::insert`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InsertOutcome {
    /// How many leading tokens were already cached before the insert.
    pub cached: usize,
    /// The node that now ends at or contains the last inserted token.
    pub node: Option<NodeId>,
}

/// Full blocks of the cached paths that eviction cut, with the path they
/// held: what a lower tier keeps (see [`PrefixTree::set_log`]). Block
/// `first + i` of the path (positions `(first + i)·bs ..`) was `blocks[i]`; `tokens` runs from
/// the namespace's root to the end of the last of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Demoted {
    pub namespace: Namespace,
    pub tokens: Vec<TokenId>,
    pub first: usize,
    pub blocks: Vec<BlockId>,
    /// Per block, the sliding-window layers' block that held all of its
    /// positions when it was cut (`None` without one, or with one holding
    /// only its later positions). Freed with it, it keeps its K/V until
    /// the same next write.
    pub sliding: Vec<Option<BlockId>>,
}

/// What the cached paths gained or lost, in the order it happened (see
/// [`PrefixTree::set_log`]): what a router following the cache and a lower
/// tier keeping its evicted blocks need. Only full blocks count: block `j`
/// of a path holds its positions `j·bs .. (j + 1)·bs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TreeEvent {
    /// Full blocks `first ..` of a path entered the tree: `tokens` runs from
    /// the namespace's root to the end of the last of them.
    Stored {
        namespace: Namespace,
        tokens: Vec<TokenId>,
        first: usize,
    },
    /// Full blocks left it (eviction).
    Removed(Demoted),
    /// Full blocks the tree keeps lost their sliding-window layers' blocks
    /// (the sliding pool's eviction); `sliding` names the sliding blocks
    /// that held them whole, freed but holding their K/V until the same
    /// next write as a removed block's.
    SlidingRemoved(Demoted),
}

/// One root-to-leaf path, as [`PrefixTree::paths`] lists them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedPath {
    pub namespace: Namespace,
    pub tokens: Vec<TokenId>,
    pub blocks: Vec<BlockId>,
}

#[derive(Debug, Clone)]
struct Node {
    parent: Option<NodeId>,
    namespace: Namespace,
    /// Absolute position of `tokens[0]`.
    start: usize,
    tokens: Vec<TokenId>,
    /// Blocks for indices `start / bs ..= (start + len - 1) / bs`.
    blocks: Vec<BlockId>,
    children: BTreeMap<TokenId, NodeId>,
    last_access: u64,
    /// Locks on this node and all its descendants.
    lock_ref: u32,
    /// Locks taken on this node itself.
    own_locks: u32,
    /// Its end is a point requests resume from (the end of a prompt, of a
    /// generation, a branch point): the sliding-window blocks of the
    /// positions just before it are kept as long as the node is.
    tail: bool,
}

impl Node {
    fn end(&self) -> usize {
        self.start + self.tokens.len()
    }
}

/// Radix tree over token ids.
///
/// # Invariants
/// - a child's first token is its key in the parent and its `start` is the
///   parent's end; non-root nodes have at least one token; roots have none
///   and at least one child;
/// - a node holds exactly the blocks covering its token range, one pool
///   reference each;
/// - `lock_ref` is the node's own locks plus its children's `lock_ref`;
/// - the eviction set is exactly the unlocked non-root leaves, keyed by their
///   last access; a parent's last access is never older than a child's.
#[derive(Debug, Clone)]
pub struct PrefixTree {
    block_size: usize,
    nodes: Vec<Option<Node>>,
    free_ids: Vec<NodeId>,
    roots: BTreeMap<Namespace, NodeId>,
    evictable: BTreeSet<(u64, NodeId)>,
    clock: u64,
    cached_tokens: usize,
    /// Whether inserts and evictions are logged in `log`.
    logging: bool,
    log: Vec<TreeEvent>,
}

fn common_prefix(a: &[TokenId], b: &[TokenId]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PrefixTree {
    pub fn new(block_size: usize) -> Self {
        assert!(block_size > 0, "block_size must be at least 1");
        PrefixTree {
            block_size,
            nodes: Vec::new(),
            free_ids: Vec::new(),
            roots: BTreeMap::new(),
            evictable: BTreeSet::new(),
            clock: 0,
            cached_tokens: 0,
            logging: false,
            log: Vec::new(),
        }
    }

    /// Whether the tree logs the full blocks its paths gain (inserts) and
    /// lose (evictions), for [`take_log`](Self::take_log). An evicted
    /// block's K/V stays valid until the pool hands a freed block out again
    /// and something writes it (a block still shared is copied before any
    /// write), so a lower tier reads it before the next write.
    pub fn set_log(&mut self, on: bool) {
        self.logging = on;
        if !on {
            self.log.clear();
        }
    }

    /// What the tree logged since the last call (empty unless
    /// [`set_log`](Self::set_log) is on).
    pub fn take_log(&mut self) -> Vec<TreeEvent> {
        std::mem::take(&mut self.log)
    }

    /// The tokens from the root of `id`'s namespace to `id`'s end.
    fn path_of(&self, id: NodeId) -> Vec<TokenId> {
        let mut nodes = Vec::new();
        let mut cur = Some(id);
        while let Some(c) = cur {
            nodes.push(c);
            cur = self.n(c).parent;
        }
        nodes
            .iter()
            .rev()
            .flat_map(|&c| self.n(c).tokens.iter().copied())
            .collect()
    }

    /// Records the blocks of `node` (blocks `first_index..` of its path)
    /// that are full up to its end. A block another node or a sequence
    /// still holds counts too: it is not written while shared (a writer
    /// copies it first), so it still holds this path's K/V, which goes
    /// with the node.
    fn log_removed(
        &mut self,
        pool: &BlockPool,
        id: NodeId,
        first_index: usize,
        blocks: &[BlockId],
    ) {
        let bs = self.block_size;
        let end = self.n(id).end();
        let full: Vec<(usize, BlockId)> = blocks
            .iter()
            .enumerate()
            .filter(|&(i, _)| (first_index + i + 1) * bs <= end)
            .map(|(i, &b)| (first_index + i, b))
            .collect();
        if full.is_empty() {
            return;
        }
        // The full blocks are the first ones (only a node's last block
        // may end past it), so they form one run.
        let last = full.last().expect("not empty").0;
        let mut tokens = self.path_of(id);
        tokens.truncate((last + 1) * bs);
        self.log.push(TreeEvent::Removed(Demoted {
            namespace: self.n(id).namespace,
            tokens,
            first: full[0].0,
            sliding: full
                .iter()
                .map(|&(_, b)| pool.sliding_of(b).filter(|_| pool.sliding_holds(b, 0)))
                .collect(),
            blocks: full.into_iter().map(|(_, b)| b).collect(),
        }));
    }

    /// Whether [`set_log`](Self::set_log) is on.
    pub fn logging(&self) -> bool {
        self.logging
    }

    /// Where each block the tree holds full sits: its node and its index
    /// in the path (a block is full in at most one node's path).
    pub(crate) fn full_block_places(&self) -> HashMap<BlockId, (NodeId, usize)> {
        let bs = self.block_size;
        let mut out = HashMap::new();
        for (i, node) in self.nodes.iter().enumerate() {
            let Some(node) = node.as_ref().filter(|n| n.parent.is_some()) else {
                continue;
            };
            let first = node.start / bs;
            for (k, &b) in node.blocks.iter().enumerate() {
                if (first + k + 1) * bs <= node.end() {
                    out.insert(b, (NodeId(i as u32), first + k));
                }
            }
        }
        out
    }

    /// Logs that the full blocks `lost` lost the sliding blocks that held
    /// them whole: `(node, j, block, sliding)`, block `j` of `node`'s path.
    /// Consecutive blocks of one node make one event, whose path is hashed
    /// once.
    pub(crate) fn log_sliding_removed(&mut self, lost: &[(NodeId, usize, BlockId, BlockId)]) {
        let mut rest = lost;
        while let Some(&(node, first, _, _)) = rest.first() {
            let n = rest
                .iter()
                .enumerate()
                .take_while(|&(i, &(m, j, _, _))| m == node && j == first + i)
                .count();
            let (run, after) = rest.split_at(n);
            rest = after;
            let mut tokens = self.path_of(node);
            tokens.truncate((first + n) * self.block_size);
            self.log.push(TreeEvent::SlidingRemoved(Demoted {
                namespace: self.n(node).namespace,
                tokens,
                first,
                blocks: run.iter().map(|r| r.2).collect(),
                sliding: run.iter().map(|r| Some(r.3)).collect(),
            }));
        }
    }

    /// Total tokens held by all edges.
    pub fn cached_tokens(&self) -> usize {
        self.cached_tokens
    }

    pub fn num_nodes(&self) -> usize {
        self.nodes.len() - self.free_ids.len()
    }

    /// Number of leaves that [`evict`](Self::evict) could remove now.
    pub fn num_evictable_leaves(&self) -> usize {
        self.evictable.len()
    }

    /// Longest cached prefix of `tokens`, and marks the path as used now.
    pub fn match_prefix(&mut self, ns: Namespace, tokens: &[TokenId]) -> PrefixMatch {
        let mut path = Vec::new();
        let m = self.walk(ns, tokens, |id| path.push(id));
        if !path.is_empty() {
            let now = self.tick();
            for id in path {
                self.touch(id, now);
            }
        }
        m
    }

    /// [`match_prefix`](Self::match_prefix) for a sequence that will lock
    /// what it matched: `node` becomes the node ending exactly at the last
    /// whole block of the match (the edge is split there), or `None` when
    /// the match is shorter than a block. A partly matched last block is not
    /// locked: the sequence holds it by reference and copies it on its first
    /// write, so locking it would pin cached content the sequence no longer
    /// reads, and the rest of the edge stays evictable.
    pub fn match_prefix_for_lock(
        &mut self,
        pool: &mut BlockPool,
        ns: Namespace,
        tokens: &[TokenId],
    ) -> Result<PrefixMatch, KvError> {
        let mut m = self.match_prefix(ns, tokens);
        let aligned = m.len / self.block_size * self.block_size;
        let mut at = m.node;
        while let Some(id) = at {
            let node = self.n(id);
            if node.parent.is_none() || node.start < aligned {
                break;
            }
            at = node.parent;
        }
        m.node = match at {
            Some(id) if self.n(id).parent.is_some() => {
                let node = self.n(id);
                let inside = aligned - node.start;
                Some(if inside < node.tokens.len() {
                    self.split(pool, id, inside)?
                } else {
                    id
                })
            }
            _ => None,
        };
        Ok(m)
    }

    /// Like [`match_prefix`](Self::match_prefix) without touching the LRU
    /// clock: for inspection and tests.
    pub fn peek_prefix(&self, ns: Namespace, tokens: &[TokenId]) -> PrefixMatch {
        self.walk(ns, tokens, |_| {})
    }

    fn walk(
        &self,
        ns: Namespace,
        tokens: &[TokenId],
        mut visit: impl FnMut(NodeId),
    ) -> PrefixMatch {
        let mut m = PrefixMatch::default();
        let Some(&root) = self.roots.get(&ns) else {
            return m;
        };
        let bs = self.block_size;
        let mut cur = root;
        while m.len < tokens.len() {
            let Some(&c) = self.n(cur).children.get(&tokens[m.len]) else {
                break;
            };
            let node = self.n(c);
            let common = common_prefix(&node.tokens, &tokens[m.len..]);
            visit(c);
            let end = m.len + common;
            let first = node.start / bs;
            // The deepest node covering a block index supplies its block.
            for (k, &b) in node.blocks[..=(end - 1) / bs - first].iter().enumerate() {
                match m.blocks.get_mut(first + k) {
                    Some(slot) => *slot = b,
                    None => m.blocks.push(b),
                }
            }
            m.len = end;
            m.node = Some(c);
            if common < node.tokens.len() {
                break;
            }
            cur = c;
        }
        m
    }

    /// Records that `tokens` (of namespace `ns`) are computed in `blocks`
    /// (`ceil(len / block_size)` of them, all live). Splits the edge where the
    /// tokens leave the cached paths; the new leaf takes a reference on each
    /// of its blocks. Returns how much was cached already: the caller's blocks
    /// for that part are duplicates it may release.
    ///
    /// `boundary`: the tokens end where requests resume (the end of a
    /// prompt or a generation), so their last node keeps its tail (see
    /// [`PrefixTree::for_each_tail_block`]); a branch point always does.
    pub fn insert(
        &mut self,
        pool: &mut BlockPool,
        ns: Namespace,
        tokens: &[TokenId],
        blocks: &[BlockId],
        boundary: bool,
    ) -> Result<InsertOutcome, KvError> {
        let mut out = self.insert_tokens(pool, ns, tokens, blocks)?;
        if let (true, Some(id)) = (boundary, out.node) {
            let node = self.n(id);
            let inside = tokens.len() - node.start;
            let id = if inside < node.tokens.len() {
                self.split(pool, id, inside)?
            } else {
                id
            };
            self.nm(id).tail = true;
            out.node = Some(id);
        }
        Ok(out)
    }

    fn insert_tokens(
        &mut self,
        pool: &mut BlockPool,
        ns: Namespace,
        tokens: &[TokenId],
        blocks: &[BlockId],
    ) -> Result<InsertOutcome, KvError> {
        let bs = self.block_size;
        let expected = tokens.len().div_ceil(bs);
        if blocks.len() != expected {
            return Err(KvError::BlockCountMismatch {
                tokens: tokens.len(),
                expected,
                got: blocks.len(),
            });
        }
        for &b in blocks {
            if b.index() >= pool.num_blocks() {
                return Err(KvError::UnknownBlock(b, pool.num_blocks()));
            }
            if pool.ref_count(b) == 0 {
                return Err(KvError::RetainFree(b));
            }
        }
        if tokens.is_empty() {
            return Ok(InsertOutcome {
                cached: 0,
                node: None,
            });
        }
        let now = self.tick();
        let mut cur = self.root_or_create(ns);
        let mut pos = 0;
        while pos < tokens.len() {
            let Some(&c) = self.n(cur).children.get(&tokens[pos]) else {
                let leaf =
                    self.add_leaf(pool, cur, pos, &tokens[pos..], &blocks[pos / bs..], now)?;
                return Ok(InsertOutcome {
                    cached: pos,
                    node: Some(leaf),
                });
            };
            self.touch(c, now);
            let edge_len = self.n(c).tokens.len();
            let common = common_prefix(&self.n(c).tokens, &tokens[pos..]);
            if common == edge_len {
                pos += common;
                cur = c;
                continue;
            }
            if pos + common == tokens.len() {
                // The tokens end inside this edge: all of them are cached.
                return Ok(InsertOutcome {
                    cached: tokens.len(),
                    node: Some(c),
                });
            }
            let top = self.split(pool, c, common)?;
            // Requests branch here: later ones resume from this point.
            self.nm(top).tail = true;
            let at = pos + common;
            let leaf = self.add_leaf(pool, top, at, &tokens[at..], &blocks[at / bs..], now)?;
            return Ok(InsertOutcome {
                cached: at,
                node: Some(leaf),
            });
        }
        Ok(InsertOutcome {
            cached: pos,
            node: Some(cur),
        })
    }

    /// Protects `node` and its ancestors from eviction.
    pub fn lock(&mut self, node: NodeId) -> Result<(), KvError> {
        self.get(node)?;
        self.unlist(node);
        self.nm(node).own_locks += 1;
        let mut cur = Some(node);
        while let Some(id) = cur {
            let n = self.nm(id);
            n.lock_ref += 1;
            cur = n.parent;
        }
        self.relist(node);
        Ok(())
    }

    /// Undoes one [`lock`](Self::lock) of `node`.
    pub fn unlock(&mut self, node: NodeId) -> Result<(), KvError> {
        if self.get(node)?.own_locks == 0 {
            return Err(KvError::NotLocked(node));
        }
        self.unlist(node);
        self.nm(node).own_locks -= 1;
        let mut cur = Some(node);
        while let Some(id) = cur {
            let n = self.nm(id);
            n.lock_ref -= 1;
            cur = n.parent;
        }
        self.relist(node);
        Ok(())
    }

    /// Removes least-recently-used unlocked leaves until `n_blocks` blocks
    /// became free in the pool or nothing is left to evict. A leaf longer
    /// than what is still needed loses only its last blocks, so the front of
    /// a long cached conversation survives a small eviction. Returns the
    /// blocks that became free.
    pub fn evict(
        &mut self,
        pool: &mut BlockPool,
        n_blocks: usize,
    ) -> Result<Vec<BlockId>, KvError> {
        let mut freed = Vec::new();
        while freed.len() < n_blocks {
            let Some(&(_, id)) = self.evictable.first() else {
                break;
            };
            let want = n_blocks - freed.len();
            if self.n(id).blocks.len() > want {
                self.trim_leaf(pool, id, want, &mut freed)?;
            } else {
                self.remove_leaf(pool, id, &mut freed)?;
            }
        }
        Ok(freed)
    }

    /// Calls `f` for the blocks holding the `window - 1` positions before
    /// the end of every tail node (along its root path): what a request
    /// resuming there reads in its sliding-window layers. A block may come
    /// up more than once.
    pub fn for_each_tail_block(&self, window: usize, mut f: impl FnMut(BlockId)) {
        let bs = self.block_size;
        for (i, node) in self.nodes.iter().enumerate() {
            let Some(node) = node.as_ref().filter(|n| n.tail && n.parent.is_some()) else {
                continue;
            };
            let end = node.end();
            let lo = (end + 1).saturating_sub(window) / bs;
            let mut hi = (end - 1) / bs + 1;
            let mut cur = NodeId(i as u32);
            while hi > lo {
                let n = self.n(cur);
                if n.parent.is_none() {
                    break;
                }
                let first = n.start / bs;
                for j in first.max(lo)..hi {
                    f(n.blocks[j - first]);
                }
                hi = hi.min(first);
                cur = n.parent.expect("checked above");
            }
        }
    }

    /// Every block the tree holds, least recently used node first, each
    /// node's from its first position on.
    pub fn blocks_by_age(&self) -> Vec<BlockId> {
        let mut nodes: Vec<(u64, &Node)> = self
            .nodes
            .iter()
            .flatten()
            .filter(|n| n.parent.is_some())
            .map(|n| (n.last_access, n))
            .collect();
        nodes.sort_by_key(|&(t, _)| t);
        nodes
            .into_iter()
            .flat_map(|(_, n)| n.blocks.iter().copied())
            .collect()
    }

    /// Every root-to-leaf path with the blocks a match of it returns.
    pub fn paths(&self) -> Vec<CachedPath> {
        let mut out = Vec::new();
        for (&ns, &root) in &self.roots {
            let mut stack = vec![(root, Vec::new())];
            while let Some((id, mut prefix)) = stack.pop() {
                let node = self.n(id);
                prefix.extend_from_slice(&node.tokens);
                if node.children.is_empty() {
                    let m = self.peek_prefix(ns, &prefix);
                    out.push(CachedPath {
                        namespace: ns,
                        tokens: prefix,
                        blocks: m.blocks,
                    });
                } else {
                    for &c in node.children.values().rev() {
                        stack.push((c, prefix.clone()));
                    }
                }
            }
        }
        out
    }

    /// Calls `f` for every block reference the tree holds.
    pub fn for_each_block(&self, mut f: impl FnMut(BlockId)) {
        for node in self.nodes.iter().flatten() {
            node.blocks.iter().copied().for_each(&mut f);
        }
    }

    /// Number of locks taken on `node` itself.
    pub fn own_locks(&self, node: NodeId) -> Result<u32, KvError> {
        Ok(self.get(node)?.own_locks)
    }

    /// Ids of every live node (for invariant checks).
    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        (0..self.nodes.len())
            .filter(|&i| self.nodes[i].is_some())
            .map(|i| NodeId(i as u32))
    }

    /// Rewrites every block id through `map` (defragmentation).
    pub(crate) fn remap_blocks(&mut self, map: &[BlockId]) {
        for node in self.nodes.iter_mut().flatten() {
            for b in &mut node.blocks {
                *b = map[b.index()];
            }
        }
    }

    /// Checks the structure; `num_blocks` bounds the block ids.
    pub fn check_invariants(&self, num_blocks: usize) -> Result<(), KvError> {
        let bad = |m: String| Err(KvError::Invariant(m));
        let bs = self.block_size;
        let mut reachable = 0usize;
        let mut tokens = 0usize;
        let mut stack: Vec<NodeId> = Vec::new();
        for (&ns, &root) in &self.roots {
            let r = self.get(root)?;
            if r.parent.is_some()
                || r.namespace != ns
                || r.start != 0
                || !r.tokens.is_empty()
                || !r.blocks.is_empty()
            {
                return bad(format!("root {root:?} of {ns:?} is malformed"));
            }
            if r.children.is_empty() {
                return bad(format!(
                    "root {root:?} of {ns:?} has no children and was not removed"
                ));
            }
            stack.push(root);
        }
        let mut expected_evictable = BTreeSet::new();
        while let Some(id) = stack.pop() {
            reachable += 1;
            let node = self.n(id);
            tokens += node.tokens.len();
            let mut child_locks = 0u32;
            for (&key, &c) in &node.children {
                let child = self.get(c)?;
                if child.parent != Some(id) || child.tokens.first() != Some(&key) {
                    return bad(format!(
                        "child {c:?} of {id:?} does not point back or is keyed wrongly"
                    ));
                }
                if child.start != node.end() || child.namespace != node.namespace {
                    return bad(format!(
                        "child {c:?} starts at {} but {id:?} ends at {}",
                        child.start,
                        node.end()
                    ));
                }
                if node.parent.is_some() && child.last_access > node.last_access {
                    return bad(format!("child {c:?} was accessed after its parent {id:?}"));
                }
                child_locks += child.lock_ref;
                stack.push(c);
            }
            if node.lock_ref != node.own_locks + child_locks {
                return bad(format!(
                    "{id:?} has lock_ref {} but {} own + {} below",
                    node.lock_ref, node.own_locks, child_locks
                ));
            }
            if node.parent.is_none() {
                continue;
            }
            if node.tokens.is_empty() {
                return bad(format!("non-root {id:?} has no tokens"));
            }
            let want = (node.end() - 1) / bs - node.start / bs + 1;
            if node.blocks.len() != want {
                return bad(format!(
                    "{id:?} covers positions {}..{} with {} blocks, needs {want}",
                    node.start,
                    node.end(),
                    node.blocks.len()
                ));
            }
            if let Some(b) = node.blocks.iter().find(|b| b.index() >= num_blocks) {
                return bad(format!(
                    "{id:?} holds {b:?} outside the pool of {num_blocks}"
                ));
            }
            if node.children.is_empty() && node.lock_ref == 0 {
                expected_evictable.insert((node.last_access, id));
            }
        }
        if reachable != self.num_nodes() {
            return bad(format!(
                "{} nodes live but {reachable} reachable",
                self.num_nodes()
            ));
        }
        if tokens != self.cached_tokens {
            return bad(format!(
                "edges hold {tokens} tokens, counter says {}",
                self.cached_tokens
            ));
        }
        if expected_evictable != self.evictable {
            return bad("eviction set differs from the unlocked leaves".to_string());
        }
        Ok(())
    }

    // ---- internals -------------------------------------------------------

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn n(&self, id: NodeId) -> &Node {
        self.nodes[id.index()].as_ref().expect("node id is live")
    }

    fn nm(&mut self, id: NodeId) -> &mut Node {
        self.nodes[id.index()].as_mut().expect("node id is live")
    }

    fn get(&self, id: NodeId) -> Result<&Node, KvError> {
        self.nodes
            .get(id.index())
            .and_then(|n| n.as_ref())
            .ok_or(KvError::UnknownNode(id))
    }

    fn is_evictable(node: &Node) -> bool {
        node.parent.is_some() && node.children.is_empty() && node.lock_ref == 0
    }

    /// Takes `id` out of the eviction set before its key or status changes.
    fn unlist(&mut self, id: NodeId) {
        let key = (self.n(id).last_access, id);
        self.evictable.remove(&key);
    }

    /// Puts `id` back into the eviction set if it qualifies.
    fn relist(&mut self, id: NodeId) {
        let node = self.n(id);
        if Self::is_evictable(node) {
            let key = (node.last_access, id);
            self.evictable.insert(key);
        }
    }

    fn touch(&mut self, id: NodeId, now: u64) {
        self.unlist(id);
        self.nm(id).last_access = now;
        self.relist(id);
    }

    fn alloc_node(&mut self, node: Node) -> NodeId {
        match self.free_ids.pop() {
            Some(id) => {
                self.nodes[id.index()] = Some(node);
                id
            }
            None => {
                self.nodes.push(Some(node));
                NodeId((self.nodes.len() - 1) as u32)
            }
        }
    }

    fn root_or_create(&mut self, ns: Namespace) -> NodeId {
        if let Some(&r) = self.roots.get(&ns) {
            return r;
        }
        let id = self.alloc_node(Node {
            parent: None,
            namespace: ns,
            start: 0,
            tokens: Vec::new(),
            blocks: Vec::new(),
            children: BTreeMap::new(),
            last_access: 0,
            lock_ref: 0,
            own_locks: 0,
            tail: false,
        });
        self.roots.insert(ns, id);
        id
    }

    fn add_leaf(
        &mut self,
        pool: &mut BlockPool,
        parent: NodeId,
        start: usize,
        tokens: &[TokenId],
        blocks: &[BlockId],
        now: u64,
    ) -> Result<NodeId, KvError> {
        for &b in blocks {
            pool.retain(b)?;
        }
        let ns = self.n(parent).namespace;
        self.unlist(parent);
        let id = self.alloc_node(Node {
            parent: Some(parent),
            namespace: ns,
            start,
            tokens: tokens.to_vec(),
            blocks: blocks.to_vec(),
            children: BTreeMap::new(),
            last_access: now,
            lock_ref: 0,
            own_locks: 0,
            tail: false,
        });
        self.nm(parent).children.insert(tokens[0], id);
        self.cached_tokens += tokens.len();
        self.relist(id);
        let (bs, end) = (self.block_size, start + tokens.len());
        // Full blocks from the one holding `start` on: new along this path
        // (an equal path would have been walked, not added).
        if self.logging && end / bs > start / bs {
            let mut path = self.path_of(id);
            path.truncate(end / bs * bs);
            self.log.push(TreeEvent::Stored {
                namespace: ns,
                tokens: path,
                first: start / bs,
            });
        }
        Ok(id)
    }

    /// Splits `c` after `k` tokens (0 < k < len) into a new parent holding the
    /// first `k` and `c` keeping the rest (so locks held on `c` stay valid).
    fn split(&mut self, pool: &mut BlockPool, c: NodeId, k: usize) -> Result<NodeId, KvError> {
        let bs = self.block_size;
        let node = self.n(c);
        let (start, parent) = (node.start, node.parent.expect("non-root"));
        let split_at = start + k;
        let top_blocks = node.blocks[..=(split_at - 1) / bs - start / bs].to_vec();
        let drop_front = split_at / bs - start / bs;
        let top = Node {
            parent: Some(parent),
            namespace: node.namespace,
            start,
            tokens: node.tokens[..k].to_vec(),
            blocks: top_blocks,
            children: BTreeMap::from([(node.tokens[k], c)]),
            last_access: node.last_access,
            lock_ref: node.lock_ref,
            own_locks: 0,
            tail: false,
        };
        if !split_at.is_multiple_of(bs) {
            // The block holding the split point now has two holders.
            pool.retain(node.blocks[drop_front])?;
        }
        let first_token = node.tokens[0];
        let top_id = self.alloc_node(top);
        let bottom = self.nm(c);
        bottom.tokens.drain(..k);
        bottom.blocks.drain(..drop_front);
        bottom.start = split_at;
        bottom.parent = Some(top_id);
        self.nm(parent).children.insert(first_token, top_id);
        Ok(top_id)
    }

    /// Drops the last `k` blocks of a leaf (fewer than it has) and the
    /// tokens they hold; the leaf keeps its first block.
    fn trim_leaf(
        &mut self,
        pool: &mut BlockPool,
        id: NodeId,
        k: usize,
        freed: &mut Vec<BlockId>,
    ) -> Result<(), KvError> {
        let bs = self.block_size;
        let node = self.n(id);
        let keep = node.blocks.len() - k;
        let new_end = (node.start / bs + keep) * bs;
        let dropped_tokens = node.end() - new_end;
        let first = node.start / bs + keep;
        let dropped = node.blocks[keep..].to_vec();
        if self.logging {
            self.log_removed(pool, id, first, &dropped);
        }
        for &b in &dropped {
            if pool.release(b)? {
                freed.push(b);
            }
        }
        let node = self.nm(id);
        node.tokens.truncate(new_end - node.start);
        node.blocks.truncate(keep);
        self.cached_tokens -= dropped_tokens;
        Ok(())
    }

    fn remove_leaf(
        &mut self,
        pool: &mut BlockPool,
        id: NodeId,
        freed: &mut Vec<BlockId>,
    ) -> Result<(), KvError> {
        self.unlist(id);
        if self.logging {
            let node = self.n(id);
            let (first, blocks) = (node.start / self.block_size, node.blocks.clone());
            self.log_removed(pool, id, first, &blocks);
        }
        let node = self.nodes[id.index()].take().expect("leaf is live");
        self.free_ids.push(id);
        for &b in &node.blocks {
            if pool.release(b)? {
                freed.push(b);
            }
        }
        self.cached_tokens -= node.tokens.len();
        let parent = node.parent.expect("leaves are not roots");
        let p = self.nm(parent);
        p.children.remove(&node.tokens[0]);
        if p.parent.is_none() {
            if p.children.is_empty() {
                let ns = p.namespace;
                self.nodes[parent.index()] = None;
                self.free_ids.push(parent);
                self.roots.remove(&ns);
            }
        } else {
            self.relist(parent);
        }
        Ok(())
    }
}
