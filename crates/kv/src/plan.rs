//! Plain-data results that the engine carries out with kernels: block copies,
//! slot moves with a RoPE position delta, and admission decisions.

use crate::{BlockId, Slot};

/// Copy every slot of block `src` into block `dst` (copy-on-write, defrag).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOp {
    pub src: BlockId,
    pub dst: BlockId,
}

/// Move the K/V of one slot to another. For a context shift the moved K is
/// also rotated by [`ShiftPlan::position_delta`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotMove {
    pub src: Slot,
    pub dst: Slot,
}

/// Whether something fits in the pool. Out of memory is a value, not a panic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission<T> {
    /// It fits; here is what the caller must carry out.
    Ok(T),
    /// Not now: `needed` more blocks were required and only `free` were free
    /// after evicting every unlocked cached block. It fits once running
    /// sequences are preempted or finish. Nothing was changed except the
    /// eviction of cached-only content.
    Later { needed: usize, free: usize },
    /// Never: the sequence would need `needed` blocks and the whole pool has
    /// only `total`.
    Never { needed: usize, total: usize },
}

impl<T> Admission<T> {
    pub fn is_ok(&self) -> bool {
        matches!(self, Admission::Ok(_))
    }

    /// The plan, if admitted.
    pub fn ok(self) -> Option<T> {
        match self {
            Admission::Ok(t) => Some(t),
            _ => None,
        }
    }

    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Admission<U> {
        match self {
            Admission::Ok(t) => Admission::Ok(f(t)),
            Admission::Later { needed, free } => Admission::Later { needed, free },
            Admission::Never { needed, total } => Admission::Never { needed, total },
        }
    }
}

/// What [`KvCache::append`](crate::KvCache::append) asks of the engine.
///
/// Carry out `copies` first (copy-on-write of a shared tail block), then write
/// the new tokens' K/V into `slots`, in order. The slots stay valid until the
/// next call that moves blocks (`plan_defrag`, `plan_shift`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AppendPlan {
    pub copies: Vec<CopyOp>,
    pub slots: Vec<Slot>,
    /// The same for the sliding-window layers' pool (empty without one): a
    /// slot per new token, `Slot(u32::MAX)` where that layer keeps nothing
    /// ([`KvCache::append_from`](crate::KvCache::append_from)).
    pub sliding_copies: Vec<CopyOp>,
    pub sliding_slots: Vec<Slot>,
}

/// A context shift of one sequence.
///
/// Carry out `copies` first (whole blocks), then `moves` **in order**: a move
/// may write a slot that a later move of the same plan has already read, never
/// one it has yet to read. Every moved K is rotated by `position_delta`
/// (negative: positions move down); V is moved unchanged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShiftPlan {
    pub copies: Vec<CopyOp>,
    pub moves: Vec<SlotMove>,
    pub position_delta: i64,
    /// The same for the sliding-window layers' pool: only the positions
    /// their next query reads.
    pub sliding_copies: Vec<CopyOp>,
    pub sliding_moves: Vec<SlotMove>,
}

/// Compaction of live blocks to the lowest ids. The bookkeeping is already
/// remapped when the plan is returned; the engine copies every `moves` entry
/// (no destination is the source of another move, so any order works) before
/// the next forward step.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DefragPlan {
    pub moves: Vec<CopyOp>,
    /// Number of live blocks; after the plan they are exactly `0..live_blocks`.
    pub live_blocks: usize,
    /// The same for the sliding-window layers' pool.
    pub sliding_moves: Vec<CopyOp>,
    pub sliding_live: usize,
}
