//! tessera-kv: the bookkeeping of a paged KV cache.
//!
//! **What this crate must not know:** tensors, candle, devices, threads,
//! wall-clock time, or the model. It deals in block ids, token ids, reference
//! counts and plans ([`CopyOp`], [`ShiftPlan`], [`DefragPlan`]) that the
//! engine carries out with kernels.
//!
//! - [`BlockPool`]: fixed-size blocks with reference counts, O(1) allocate
//!   and free.
//! - [`PrefixTree`]: a token-exact radix tree over cached prefixes, one root
//!   per [`Namespace`], LRU eviction of unlocked leaves by a logical clock.
//! - [`KvCache`]: sequences (token ids, computed count, block table) over
//!   the pool and the tree: reuse, append with copy-on-write, fork, insert,
//!   context shift and defragmentation plans, [`Admission`] decisions, and
//!   [`KvCache::check_invariants`].

mod cache;
mod error;
mod ids;
mod plan;
mod pool;
mod tree;

pub use cache::{InsertReport, KvCache, KvConfig, KvStats, Sequence, SlidingConfig};
pub use error::KvError;
pub use ids::{token_ids, BlockId, Namespace, NodeId, SeqId, Slot, TokenId};
pub use plan::{Admission, AppendPlan, CopyOp, DefragPlan, ShiftPlan, SlotMove};
pub use pool::BlockPool;
pub use tree::{CachedPath, Demoted, InsertOutcome, PrefixMatch, PrefixTree, TreeEvent};

#[cfg(test)]
mod tests;
