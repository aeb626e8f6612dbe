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
        };
        pool.rebuild_free_list();
        Ok(pool)
    }

    pub fn block_size(&self) -> usize {
        self.block_size
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
        self.rebuild_free_list();
        Ok(())
    }

    /// Moves the holders of `src` to the free block `dst` (defragmentation).
    pub(crate) fn move_refs(&mut self, src: BlockId, dst: BlockId) {
        debug_assert_eq!(self.refs[dst.index()], 0);
        self.refs[dst.index()] = self.refs[src.index()];
        self.refs[src.index()] = 0;
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
