//! Typed errors for misuse. Running out of blocks is not an error: it is an
//! [`Admission`](crate::Admission) value.

use crate::{BlockId, NodeId, SeqId};

/// What a caller did wrong. Every variant names the object and the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("unknown sequence {0}")]
    UnknownSequence(SeqId),
    #[error("unknown prefix-tree node {0}")]
    UnknownNode(NodeId),
    #[error("block {0} is outside the pool of {1} blocks")]
    UnknownBlock(BlockId, usize),
    #[error("block {0} released while its reference count is already 0 (double free)")]
    DoubleFree(BlockId),
    #[error("block {0} retained while free: only live blocks can gain holders")]
    RetainFree(BlockId),
    #[error("node {0} unlocked more often than it was locked")]
    NotLocked(NodeId),
    #[error("sequence {seq} has {pending} tokens whose KV is not computed yet; {op} needs them computed")]
    PendingTokens {
        seq: SeqId,
        pending: usize,
        op: &'static str,
    },
    #[error("sequence {seq} has {len} tokens; cannot mark {upto} as computed")]
    ComputedBeyondEnd { seq: SeqId, len: usize, upto: usize },
    #[error("insert of {tokens} tokens needs {expected} blocks, got {got}")]
    BlockCountMismatch {
        tokens: usize,
        expected: usize,
        got: usize,
    },
    #[error("invalid context shift on {seq}: keep {n_keep} + discard {n_discard} must be within {len} tokens and discard > 0")]
    InvalidShift {
        seq: SeqId,
        n_keep: usize,
        n_discard: usize,
        len: usize,
    },
    #[error("context shift of {seq} refused: it keeps {n_keep} tokens, and the sliding-window layers no longer hold position {position} of them (keep_front was not set)")]
    ShiftLosesWindow {
        seq: SeqId,
        n_keep: usize,
        position: usize,
    },
    #[error("cannot shrink the pool to {requested} blocks: block {highest_live} is live (defragment first)")]
    ShrinkBlocked {
        requested: usize,
        highest_live: BlockId,
    },
    #[error("invariant violated: {0}")]
    Invariant(String),
}
