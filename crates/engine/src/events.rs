//! KV events: the full blocks the prefix cache gains and loses, in order,
//! for routers that place requests by what each replica holds (vLLM's
//! `BlockStored`, `BlockRemoved` and `AllBlocksCleared`, which NVIDIA
//! Dynamo's KV router, llm-d's indexer and vllm-router read). A block is
//! named by the chain hash of its partition and every token up to its end
//! (`crate::tier`'s, the disk tier's names), so a block stored in one event
//! is removed under the same name, and a child names its parent.
//!
//! The disk tier's blocks come as events of their own medium (`"DISK"`),
//! as vLLM's offloading connector announces its CPU blocks: written as
//! the pool evicts them, dropped by the tier's size limit, and all of them
//! at start (the tier outlives the process) and after `AllBlocksCleared`.
//!
//! The engine hands each step's events, as one batch, to the
//! [`KvEventSink`] of [`crate::EngineConfig::kv_events`]; the server
//! publishes them over ZeroMQ in vLLM's wire format.

use std::sync::Arc;

/// One change of the prefix cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Full blocks entered the cache: `block_hashes[i]` names the block
    /// holding `token_ids[i·block_size ..][.. block_size]`, and the first
    /// one follows `parent_block_hash` (`None`: it starts the text).
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: usize,
        /// Where the blocks live: `"GPU"` or `"CPU"`, the pool's device,
        /// or `"DISK"`, the disk tier (`--cache-dir`) below it. A block
        /// evicted from the pool to the tier is removed from the first
        /// and stored in the second; a consumer counts a block held while
        /// some medium holds it.
        medium: &'static str,
    },
    /// Full blocks left the cache (evicted, or cleared).
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: &'static str,
    },
    /// Every block left the cache (its bookkeeping started over).
    AllBlocksCleared,
}

/// The events of one step, in order, and when it ended (seconds since the
/// Unix epoch).
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
}

/// Where the engine sends its event batches (called on the engine's
/// thread: it must not block).
#[derive(Clone)]
pub struct KvEventSink(Arc<dyn Fn(KvEventBatch) + Send + Sync>);

impl KvEventSink {
    pub fn new(f: impl Fn(KvEventBatch) + Send + Sync + 'static) -> KvEventSink {
        KvEventSink(Arc::new(f))
    }

    pub(crate) fn send(&self, batch: KvEventBatch) {
        (self.0)(batch)
    }
}

impl std::fmt::Debug for KvEventSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KvEventSink")
    }
}
