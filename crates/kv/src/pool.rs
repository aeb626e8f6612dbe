//! The block pool: reference counts and a free list, O(1) allocate and free.
//!
//! ```text
//! ids:     b0  b1  b2  b3  b4  b5
//! refs:     2   0   1   0   3   1
//! free:   [b3, b1]          (a stack; the top is taken first)
//! ```
//!
//! A block's count is the number of holders: one per block table that lists
//! it and one per prefix-tree node that lists it. A block whose only holders
//! are tree nodes is "cached": no sequence uses it, its content is matchable,
//! and it is reallocated (evicted from the tree, least recently used first)
//! only when no free block is left.

use crate::{BlockId, KvError};

/// Fixed number of fixed-size blocks with reference counts.
///
/// # Invariants
/// - every block with count 0 is in the free list exactly once, and no block
///   in the free list has a count above 0;
/// - `num_blocks * block_size` fits in a `u32` slot index.
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    refs: Vec<u32>,
    free: Vec<BlockId>,
    sliding: Option<Sliding>,
}

/// The blocks of the sliding-window layers (Gemma 3's local layers), a pool
/// of their own: a block here holds the same positions as the (global)
/// block it is attached to, for the layers that only look `window` tokens
/// back. It has no holders of its own: it lives while its global block
/// lives and someone wants its content (a sequence whose window covers it,
/// or the prefix tree as evictable cache), and goes with its global block.
///
/// ```text
/// global:  b0   b1   b2   b3   b4        every token, every global layer
/// sliding:  -    -   s1   s0   s2        only where someone reads them
/// ```
#[derive(Debug, Clone)]
struct Sliding {
    window: usize,
    /// Global block id -> its sliding block.
    attached: Vec<Option<BlockId>>,
    /// Sliding block id -> the global block it belongs to.
    owner: Vec<Option<BlockId>>,
    /// Sliding block id -> the first offset in it holding K/V (a restored
    /// session's sliding K/V begins mid-block; 0 otherwise).
    valid_from: Vec<u32>,
    free: Vec<BlockId>,
}

impl Sliding {
    fn rebuild_free_list(&mut self) {
        self.free.clear();
        self.free.extend(
            (0..self.owner.len())
                .rev()
                .filter(|&i| self.owner[i].is_none())
                .map(|i| BlockId(i as u32)),
        );
    }
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks of `block_size` slots each.
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self, KvError> {
        if block_size == 0 {
            return Err(KvError::Config("block_size must be at least 1".into()));
        }
        check_slot_range(num_blocks, block_size)?;
        let mut pool = BlockPool {
            block_size,
            refs: vec![0; num_blocks],
            free: Vec::with_capacity(num_blocks),
            sliding: None,
        };
        pool.rebuild_free_list();
        Ok(pool)
    }

    /// Gives the pool a second pool of `num_blocks` blocks for layers that
    /// see only the last `window` positions (see [`BlockPool::attach`]).
    pub fn with_sliding(mut self, window: usize, num_blocks: usize) -> Result<Self, KvError> {
        if window == 0 || num_blocks == 0 {
            return Err(KvError::Config(
                "a sliding window and its pool need at least one token and one block".into(),
            ));
        }
        check_slot_range(num_blocks, self.block_size)?;
        let mut sl = Sliding {
            window,
            attached: vec![None; self.refs.len()],
            owner: vec![None; num_blocks],
            valid_from: vec![0; num_blocks],
            free: Vec::with_capacity(num_blocks),
        };
        sl.rebuild_free_list();
        self.sliding = Some(sl);
        Ok(self)
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The sliding window of the second pool, if there is one.
    pub fn window(&self) -> Option<usize> {
        self.sliding.as_ref().map(|s| s.window)
    }

    /// Blocks of the sliding pool (0 without one).
    pub fn num_sliding_blocks(&self) -> usize {
        self.sliding.as_ref().map_or(0, |s| s.owner.len())
    }

    /// Free blocks of the sliding pool (0 without one).
    pub fn num_free_sliding(&self) -> usize {
        self.sliding.as_ref().map_or(0, |s| s.free.len())
    }

    /// The sliding block attached to global block `b`.
    #[inline]
    pub fn sliding_of(&self, b: BlockId) -> Option<BlockId> {
        self.sliding
            .as_ref()
            .and_then(|s| s.attached.get(b.index()).copied().flatten())
    }

    /// Attaches a free sliding block to the live global block `b` (which
    /// has none); `None` when the sliding pool is empty or absent.
    pub fn attach(&mut self, b: BlockId) -> Option<BlockId> {
        self.attach_from(b, 0)
    }

    /// [`attach`](Self::attach) of a block whose K/V will begin at offset
    /// `from` (the offsets before it are never written).
    pub fn attach_from(&mut self, b: BlockId, from: usize) -> Option<BlockId> {
        debug_assert!(self.ref_count(b) > 0, "attach to free block {b:?}");
        let sl = self.sliding.as_mut()?;
        debug_assert!(sl.attached[b.index()].is_none(), "{b:?} attached twice");
        let s = sl.free.pop()?;
        sl.owner[s.index()] = Some(b);
        sl.valid_from[s.index()] = from as u32;
        sl.attached[b.index()] = Some(s);
        Some(s)
    }

    /// Whether global block `b` has a sliding block holding K/V from
    /// offset `at` on.
    #[inline]
    pub fn sliding_holds(&self, b: BlockId, at: usize) -> bool {
        let Some(sl) = self.sliding.as_ref() else {
            return false;
        };
        match sl.attached.get(b.index()).copied().flatten() {
            Some(s) => sl.valid_from[s.index()] as usize <= at,
            None => false,
        }
    }

    /// The first offset of `b`'s sliding block that holds K/V (0 without
    /// one).
    pub fn sliding_valid_from(&self, b: BlockId) -> usize {
        self.sliding
            .as_ref()
            .and_then(|sl| {
                let s = sl.attached.get(b.index()).copied().flatten()?;
                Some(sl.valid_from[s.index()] as usize)
            })
            .unwrap_or(0)
    }

    /// Frees the sliding block of `b`, if it has one; returns it.
    pub fn detach(&mut self, b: BlockId) -> Option<BlockId> {
        let sl = self.sliding.as_mut()?;
        let s = sl.attached.get_mut(b.index())?.take()?;
        sl.owner[s.index()] = None;
        sl.free.push(s);
        Some(s)
    }

    /// Moves `from`'s sliding block to `to` when `to` has none (two global
    /// blocks holding the same content: one replaces the other).
    pub(crate) fn transfer_sliding(&mut self, from: BlockId, to: BlockId) {
        let Some(sl) = self.sliding.as_mut() else {
            return;
        };
        if sl.attached[to.index()].is_some() {
            return;
        }
        if let Some(s) = sl.attached[from.index()].take() {
            sl.attached[to.index()] = Some(s);
            sl.owner[s.index()] = Some(to);
        }
    }

    /// Compacts the attached sliding blocks to ids `0..live`; returns the
    /// copies that carry it out (no destination is another's source).
    pub(crate) fn compact_sliding(&mut self) -> (Vec<crate::CopyOp>, usize) {
        let Some(sl) = self.sliding.as_mut() else {
            return (Vec::new(), 0);
        };
        let n = sl.owner.len();
        let live = n - sl.free.len();
        let holes: Vec<usize> = (0..live).filter(|&i| sl.owner[i].is_none()).collect();
        let strays: Vec<usize> = (live..n).filter(|&i| sl.owner[i].is_some()).collect();
        let mut moves = Vec::new();
        for (src, dst) in strays.into_iter().zip(holes) {
            let g = sl.owner[src].take().expect("stray is attached");
            sl.owner[dst] = Some(g);
            sl.valid_from[dst] = sl.valid_from[src];
            sl.attached[g.index()] = Some(BlockId(dst as u32));
            moves.push(crate::CopyOp {
                src: BlockId(src as u32),
                dst: BlockId(dst as u32),
            });
        }
        sl.rebuild_free_list();
        (moves, live)
    }

    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Number of blocks with at least one holder.
    pub fn num_live(&self) -> usize {
        self.refs.len() - self.free.len()
    }

    /// Takes a free block and gives it a count of 1; `None` when none is free.
    #[inline]
    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = self.free.pop()?;
        debug_assert_eq!(self.refs[b.index()], 0);
        self.refs[b.index()] = 1;
        Some(b)
    }

    /// Adds a holder to a live block.
    #[inline]
    pub fn retain(&mut self, b: BlockId) -> Result<(), KvError> {
        let r = self.ref_slot(b)?;
        if *r == 0 {
            return Err(KvError::RetainFree(b));
        }
        *r += 1;
        Ok(())
    }

    /// Drops a holder; returns `true` when the block became free.
    #[inline]
    pub fn release(&mut self, b: BlockId) -> Result<bool, KvError> {
        let r = self.ref_slot(b)?;
        if *r == 0 {
            return Err(KvError::DoubleFree(b));
        }
        *r -= 1;
        if *r == 0 {
            self.free.push(b);
            self.detach(b);
            return Ok(true);
        }
        Ok(false)
    }

    /// The number of holders of `b` (0 for a free or unknown block).
    #[inline]
    pub fn ref_count(&self, b: BlockId) -> u32 {
        self.refs.get(b.index()).copied().unwrap_or(0)
    }

    /// The highest block id with a holder, if any.
    pub fn highest_live(&self) -> Option<BlockId> {
        self.refs
            .iter()
            .rposition(|&r| r > 0)
            .map(|i| BlockId(i as u32))
    }

    /// Drops the blocks `new_len..`; all of them must be free.
    pub fn shrink_to(&mut self, new_len: usize) -> Result<(), KvError> {
        if new_len >= self.refs.len() {
            return Ok(());
        }
        if let Some(h) = self.highest_live().filter(|h| h.index() >= new_len) {
            return Err(KvError::ShrinkBlocked {
                requested: new_len,
                highest_live: h,
            });
        }
        self.refs.truncate(new_len);
        if let Some(sl) = &mut self.sliding {
            sl.attached.truncate(new_len);
        }
        self.rebuild_free_list();
        Ok(())
    }

    /// Adds free blocks up to `new_len`.
    pub fn grow_to(&mut self, new_len: usize) -> Result<(), KvError> {
        if new_len <= self.refs.len() {
            return Ok(());
        }
        check_slot_range(new_len, self.block_size)?;
        self.refs.resize(new_len, 0);
        if let Some(sl) = &mut self.sliding {
            sl.attached.resize(new_len, None);
        }
        self.rebuild_free_list();
        Ok(())
    }

    /// Moves the holders of `src` to the free block `dst` (defragmentation).
    pub(crate) fn move_refs(&mut self, src: BlockId, dst: BlockId) {
        debug_assert_eq!(self.refs[dst.index()], 0);
        self.refs[dst.index()] = self.refs[src.index()];
        self.refs[src.index()] = 0;
        if let Some(sl) = &mut self.sliding {
            if let Some(s) = sl.attached[src.index()].take() {
                sl.attached[dst.index()] = Some(s);
                sl.owner[s.index()] = Some(dst);
            }
        }
    }

    /// Rebuilds the free stack so that the lowest ids are allocated first,
    /// which keeps a freshly compacted pool compact.
    pub(crate) fn rebuild_free_list(&mut self) {
        self.free.clear();
        self.free.extend(
            (0..self.refs.len())
                .rev()
                .filter(|&i| self.refs[i] == 0)
                .map(|i| BlockId(i as u32)),
        );
    }

    fn ref_slot(&mut self, b: BlockId) -> Result<&mut u32, KvError> {
        let n = self.refs.len();
        self.refs
            .get_mut(b.index())
            .ok_or(KvError::UnknownBlock(b, n))
    }

    /// Checks the free list against the counts; `expected` gives each block's
    /// number of holders as counted by the caller (tables + tree nodes).
    pub fn check_invariants(&self, expected: &[u32]) -> Result<(), KvError> {
        let bad = |m: String| Err(KvError::Invariant(m));
        if expected.len() != self.refs.len() {
            return bad(format!(
                "holder count table has {} entries, pool has {} blocks",
                expected.len(),
                self.refs.len()
            ));
        }
        for (i, (&have, &want)) in self.refs.iter().zip(expected).enumerate() {
            if have != want {
                return bad(format!(
                    "block b{i} has count {have} but {want} holders (tables + tree nodes)"
                ));
            }
        }
        let mut in_free = vec![false; self.refs.len()];
        for &b in &self.free {
            let Some(seen) = in_free.get_mut(b.index()) else {
                return bad(format!("free list holds {b:?} outside the pool"));
            };
            if *seen {
                return bad(format!("block {b:?} is in the free list twice"));
            }
            *seen = true;
            if self.refs[b.index()] != 0 {
                return bad(format!("block {b:?} is both free and held"));
            }
        }
        if let Some(i) = (0..self.refs.len()).find(|&i| self.refs[i] == 0 && !in_free[i]) {
            return bad(format!(
                "block b{i} has count 0 but is not in the free list (leaked)"
            ));
        }
        let Some(sl) = &self.sliding else {
            return Ok(());
        };
        if sl.attached.len() != self.refs.len() {
            return bad("sliding attachments do not cover the pool".into());
        }
        for (g, a) in sl.attached.iter().enumerate() {
            let Some(s) = *a else { continue };
            if self.refs[g] == 0 {
                return bad(format!("free block b{g} keeps sliding block {s:?}"));
            }
            if sl.owner.get(s.index()).copied().flatten() != Some(BlockId(g as u32)) {
                return bad(format!("sliding block {s:?} of b{g} names another owner"));
            }
        }
        let owned = sl.owner.iter().filter(|o| o.is_some()).count();
        let attached = sl.attached.iter().filter(|a| a.is_some()).count();
        if owned != attached || owned + sl.free.len() != sl.owner.len() {
            return bad(format!(
                "sliding pool: {owned} owned, {attached} attached, {} free of {}",
                sl.free.len(),
                sl.owner.len()
            ));
        }
        if let Some(s) = sl.free.iter().find(|s| sl.owner[s.index()].is_some()) {
            return bad(format!("sliding block {s:?} is both free and attached"));
        }
        Ok(())
    }
}

fn check_slot_range(num_blocks: usize, block_size: usize) -> Result<(), KvError> {
    if num_blocks
        .checked_mul(block_size)
        .is_none_or(|s| s > u32::MAX as usize)
    {
        return Err(KvError::Config(format!(
            "{num_blocks} blocks of {block_size} slots exceed the u32 slot range"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_lowest_ids_first_and_reuses_freed() {
        let mut p = BlockPool::new(3, 4).unwrap();
        assert_eq!(p.allocate(), Some(BlockId(0)));
        assert_eq!(p.allocate(), Some(BlockId(1)));
        assert_eq!(p.release(BlockId(0)), Ok(true));
        assert_eq!(p.allocate(), Some(BlockId(0)));
        assert_eq!(p.allocate(), Some(BlockId(2)));
        assert_eq!(p.allocate(), None);
        assert_eq!(p.num_free(), 0);
    }

    #[test]
    fn misuse_is_a_typed_error() {
        let mut p = BlockPool::new(2, 4).unwrap();
        let b = p.allocate().unwrap();
        assert_eq!(p.release(b), Ok(true));
        assert_eq!(p.release(b), Err(KvError::DoubleFree(b)));
        assert_eq!(p.retain(b), Err(KvError::RetainFree(b)));
        assert_eq!(
            p.retain(BlockId(9)),
            Err(KvError::UnknownBlock(BlockId(9), 2))
        );
        assert!(matches!(BlockPool::new(4, 0), Err(KvError::Config(_))));
        assert!(matches!(
            BlockPool::new(1 << 30, 16),
            Err(KvError::Config(_))
        ));
    }

    #[test]
    fn shrink_needs_free_tail() {
        let mut p = BlockPool::new(4, 2).unwrap();
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        assert_eq!(
            p.shrink_to(1),
            Err(KvError::ShrinkBlocked {
                requested: 1,
                highest_live: b
            })
        );
        p.shrink_to(2).unwrap();
        assert_eq!((p.num_blocks(), p.num_free()), (2, 0));
        p.release(a).unwrap();
        p.grow_to(3).unwrap();
        assert_eq!(p.allocate(), Some(BlockId(0)));
        assert_eq!(p.allocate(), Some(BlockId(2)));
    }
}
