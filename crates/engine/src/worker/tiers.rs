//! The worker's side of the prefix tree's log: KV events ([`crate::events`])
//! and the disk tier ([`crate::tier`]). Full blocks that eviction cuts are
//! read out of the pool before anything writes it again and appended to
//! the tier; before each schedule, the requests at the head of the queue
//! get the blocks of their prompt that the tier holds past what the pool
//! holds placed back into the prefix tree, so that their admission finds
//! them cached.

use std::collections::HashMap;

use tessera_kv::{Demoted, Namespace, TokenId, TreeEvent};
use tessera_sched::ReqId;
use tracing::warn;

use super::Worker;
use crate::events::{KvEvent, KvEventBatch};
use crate::runner::Rows;
use crate::snapshot::{Geometry, LayerBytes};
use crate::tier::{chain, tier_key, DiskTier, TierChange, TierKey, TIER_DIR};
use crate::Result;

pub(super) struct Tier {
    disk: DiskTier,
    /// Waiting requests already looked up (until they leave the queue):
    /// their tokens then, and the pool's match of them after the lookup.
    /// Looked up again when either changed (the pool may evict what was
    /// placed back while the request still waits).
    checked: HashMap<ReqId, (usize, usize)>,
    /// A write failed (a full disk): reported once.
    warned: bool,
}

impl Tier {
    /// Opens the tier of `cfg.cache_dir`, if it has one.
    pub(super) fn open(
        cfg: &crate::EngineConfig,
        geometry: &Geometry,
        row_bytes: usize,
    ) -> Result<Option<Tier>> {
        let Some(dir) = cfg.cache_dir.as_ref() else {
            return Ok(None);
        };
        if cfg.cache_dir_bytes == 0 || !cfg.prefix_cache {
            return Ok(None);
        }
        let mut disk = DiskTier::open(
            &dir.join(TIER_DIR),
            geometry,
            cfg.block_size,
            row_bytes,
            cfg.cache_dir_bytes,
        )?;
        disk.set_announce(cfg.kv_events.is_some());
        Ok(Some(Tier {
            disk,
            checked: HashMap::new(),
            warned: false,
        }))
    }

    pub(super) fn stats(&self) -> crate::types::TierStats {
        self.disk.stats()
    }
}

/// The medium of the disk tier's KV events (vLLM names the tier an event's
/// blocks live in, `"GPU"` or, offloaded, `"CPU"`).
const DISK_MEDIUM: &str = "DISK";

/// A tier change as a KV event.
fn tier_event(c: TierChange, block_size: usize) -> KvEvent {
    match c {
        TierChange::Stored {
            hash,
            parent,
            tokens,
        } => KvEvent::BlockStored {
            block_hashes: vec![hash],
            parent_block_hash: (parent != 0).then_some(parent),
            token_ids: tokens.into_vec(),
            block_size,
            medium: DISK_MEDIUM,
        },
        TierChange::Removed(hash) => KvEvent::BlockRemoved {
            block_hashes: vec![hash],
            medium: DISK_MEDIUM,
        },
    }
}

/// Every block the tier holds, as `BlockStored` events, parents first: for
/// consumers at start (the tier outlives the process) and after
/// `AllBlocksCleared` (the pool's bookkeeping started over, the tier's
/// did not).
pub(super) fn held_events(tier: &Tier, block_size: usize) -> Vec<KvEvent> {
    tier.disk
        .held()
        .into_iter()
        .map(|c| tier_event(c, block_size))
        .collect()
}

impl Worker {
    /// The block-name key of namespace `ns` (`None` for a namespace no
    /// partition of this engine maps to).
    fn block_key(&mut self, ns: Namespace) -> Option<TierKey> {
        if let Some(k) = self.block_keys.get(&ns) {
            return Some(*k);
        }
        let p = self.partition_of(ns)?;
        let key = tier_key(
            self.runner.model().fingerprint,
            self.cfg.cache_dtype.name(),
            p.tenant.as_deref(),
            p.salt.as_deref(),
        );
        self.block_keys.insert(ns, key);
        Some(key)
    }

    /// Whether the prefix tree's log has a reader: the disk tier or KV
    /// events.
    pub(super) fn logs_tree(&self) -> bool {
        self.tier.is_some() || self.cfg.kv_events.is_some()
    }

    /// Carries out what the prefix tree logged since the last call: KV
    /// events for the full blocks stored and removed, and the removed
    /// ones appended to the disk tier (unless `demote` is off: a cache
    /// cleared on request). Called after every pool operation that may
    /// evict and before the next write into the pool (the freed blocks
    /// still hold their K/V).
    pub(super) fn drain_tree_log(&mut self, demote: bool) {
        let log = self.sched.kv_mut().take_log();
        if log.is_empty() {
            return;
        }
        let bs = self.sched.kv().block_size();
        let medium = if self.runner.model().llama.device().is_cpu() {
            "CPU"
        } else {
            "GPU"
        };
        let events = self.cfg.kv_events.is_some();
        let demote = demote && self.tier.is_some();
        for e in log {
            let (ns, tokens, first) = match &e {
                // Only what a reader takes is named (hashed): stored blocks
                // by the events, removed ones by the events or the tier.
                TreeEvent::Stored { .. } if !events => continue,
                TreeEvent::Removed(_) if !events && !demote => continue,
                // The pool's own business, but for the tier.
                TreeEvent::SlidingRemoved(_) if !demote => continue,
                TreeEvent::Stored {
                    namespace,
                    tokens,
                    first,
                } => (*namespace, tokens, *first),
                TreeEvent::Removed(d) | TreeEvent::SlidingRemoved(d) => {
                    (d.namespace, &d.tokens, d.first)
                }
            };
            let Some(key) = self.block_key(ns) else {
                continue;
            };
            let raw: Vec<u32> = tokens.iter().map(|t| t.0).collect();
            let hashes = chain(&key, &raw, bs);
            match e {
                TreeEvent::Stored { .. } => self.kv_events.push(KvEvent::BlockStored {
                    block_hashes: hashes[first..].to_vec(),
                    parent_block_hash: first.checked_sub(1).map(|j| hashes[j]),
                    token_ids: raw[first * bs..].to_vec(),
                    block_size: bs,
                    medium,
                }),
                TreeEvent::Removed(d) => {
                    if events {
                        self.kv_events.push(KvEvent::BlockRemoved {
                            block_hashes: hashes[first..].to_vec(),
                            medium,
                        });
                    }
                    if demote {
                        self.demote(&d, &key, &raw, &hashes);
                    }
                }
                TreeEvent::SlidingRemoved(d) => self.demote(&d, &key, &raw, &hashes),
            }
            // What the tier took (and dropped for its limit), after the
            // pool's removal and before anything later evicted: a parent
            // is always known in one medium or the other.
            self.push_tier_events();
        }
    }

    /// The tier's changes since the last call, as KV events.
    fn push_tier_events(&mut self) {
        let Some(t) = self.tier.as_mut() else {
            return;
        };
        let bs = self.cfg.block_size;
        let changes = t.disk.take_changes();
        self.kv_events
            .extend(changes.into_iter().map(|c| tier_event(c, bs)));
    }

    /// Sends the events gathered since the last call as one batch.
    pub(super) fn flush_kv_events(&mut self) {
        // A bad record dropped when read back, since the last drain.
        self.push_tier_events();
        if self.kv_events.is_empty() {
            return;
        }
        let events = std::mem::take(&mut self.kv_events);
        if let Some(sink) = &self.cfg.kv_events {
            let ts = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            sink.send(KvEventBatch { ts, events });
        }
    }

    /// Appends the evicted blocks of `d` (path `raw`, named by `hashes`)
    /// that the disk tier lacks, or holds without the sliding-window
    /// layers' rows that come with them now. A block's sliding-window
    /// rows go with it when its sliding block held all of them.
    fn demote(&mut self, d: &Demoted, key: &TierKey, raw: &[u32], hashes: &[u64]) {
        let bs = self.sched.kv().block_size();
        let row = self.runner.row_bytes() * bs;
        let tier = self.tier.as_mut().expect("checked by the caller");
        // (path index, global block, sliding block)
        let want: Vec<(usize, u32, Option<u32>)> = d
            .blocks
            .iter()
            .zip(&d.sliding)
            .enumerate()
            .map(|(i, (b, s))| (d.first + i, b.0, s.map(|s| s.0)))
            .filter(|&(j, _, s)| {
                !tier.disk.contains(hashes[j]) || (s.is_some() && !tier.disk.whole(hashes[j]))
            })
            .collect();
        if want.is_empty() {
            return;
        }
        let rows = Rows {
            slots: want
                .iter()
                .flat_map(|&(_, b, _)| block_slots(b, bs))
                .collect(),
            sliding: want
                .iter()
                .filter_map(|&(_, _, s)| s)
                .flat_map(|s| block_slots(s, bs))
                .collect(),
        };
        let layers = match self.runner.read_rows(&rows) {
            Ok(l) => l,
            Err(e) => {
                warn!("reading evicted blocks for the disk tier: {e}");
                return;
            }
        };
        let tier = self.tier.as_mut().expect("checked by the caller");
        // The next block's place among those with sliding rows.
        let mut s_at = 0;
        for (i, &(j, _, s)) in want.iter().enumerate() {
            let block: Vec<LayerBytes> = layers
                .iter()
                .enumerate()
                .map(|(l, bytes)| {
                    let at = match (self.runner.in_sliding(l), s) {
                        (false, _) => i,
                        (true, Some(_)) => s_at,
                        (true, None) => return LayerBytes::default(),
                    };
                    LayerBytes {
                        k: bytes.k[at * row..(at + 1) * row].to_vec(),
                        v: bytes.v[at * row..(at + 1) * row].to_vec(),
                    }
                })
                .collect();
            s_at += usize::from(s.is_some());
            let parent = if j == 0 { 0 } else { hashes[j - 1] };
            let toks = &raw[j * bs..(j + 1) * bs];
            if let Err(e) = tier.disk.put(hashes[j], parent, key, toks, &block) {
                if !tier.warned {
                    warn!("writing to the disk tier failed: {e} (later failures are not reported)");
                    tier.warned = true;
                }
                break;
            }
        }
    }

    /// Places back into the prefix tree the blocks the disk tier holds of
    /// the prompts of the requests at the head of the queue (as many as
    /// may be admitted now), past what the pool holds of them. A request
    /// is looked up again when the pool had no room for its blocks, or
    /// its match in the pool changed; while there is no room the scheduler
    /// holds it (admitted beside the running requests, it would compute
    /// its prompt again and preempt them once the prompt outgrew the room).
    pub(super) fn promote(&mut self) {
        let Some(tier) = self.tier.as_mut() else {
            return;
        };
        let waiting = self.sched.waiting_ids();
        tier.checked.retain(|id, _| waiting.contains(id));
        let room = self
            .sched
            .config()
            .max_running
            .saturating_sub(self.sched.num_running())
            .max(1);
        let mut free = None;
        let mut held = Vec::new();
        for id in waiting.into_iter().take(room) {
            let tier = self.tier.as_mut().expect("checked above");
            let Some((ns, toks)) = self.sched.reusable(id) else {
                continue;
            };
            let pooled = self.sched.kv().cached_prefix_len(ns, toks);
            if tier.checked.get(&id) == Some(&(toks.len(), pooled)) {
                continue;
            }
            let (n, toks) = (toks.len(), toks.to_vec());
            // Blocks no sequence holds: free, or cached and evictable.
            // (Running sequences may take some of them in this step before
            // the request is admitted, evicting what was placed: it is
            // then looked up again. Keeping a block back for each running
            // sequence instead ran 5–8% slower on the bench-router's
            // one-replica tier workload.)
            let free = free.get_or_insert_with(|| {
                let k = self.sched.kv().stats();
                k.num_blocks - k.used_blocks
            });
            match self.promote_one(ns, &toks, pooled, free) {
                Ok(Promoted::NoRoom) => {
                    held.push(id);
                    continue;
                }
                Ok(Promoted::Nothing) => {}
                Ok(Promoted::Tokens(n)) => {
                    if let Some(a) = self.active.get_mut(&id) {
                        a.disk_cached = n;
                    }
                    self.totals.disk_cached_tokens += n as u64;
                }
                Err(e) => warn!("reading blocks back from the disk tier: {e}"),
            }
            let pooled = self.sched.kv().cached_prefix_len(ns, &toks);
            if let Some(t) = self.tier.as_mut() {
                t.checked.insert(id, (n, pooled));
            }
        }
        self.sched.hold_for_room(held);
    }

    /// Places the tier's blocks of `toks` past the pool's match (`cached`,
    /// as the caller has just read it), if the
    /// `free` blocks no sequence holds leave room for them and for the rest
    /// of the prompt (placing them must not starve the request itself, nor
    /// evict everything cached only to fail); takes what it used from
    /// `free`.
    ///
    /// With sliding-window layers the pool's match stops where a window is
    /// missing, while its global layers may hold the path further: the
    /// blocks are then taken from the pool's global layers as far as they
    /// hold them and from the tier after, and the point placed is the last
    /// whose window (the sliding layers' rows a request resuming there
    /// reads) the tier holds whole or the pool still has.
    fn promote_one(
        &mut self,
        ns: Namespace,
        toks: &[TokenId],
        cached: usize,
        free: &mut usize,
    ) -> Result<Promoted> {
        let kv = self.sched.kv();
        let bs = kv.block_size();
        let (j0, full) = (cached / bs, toks.len() / bs);
        if j0 >= full {
            return Ok(Promoted::Nothing);
        }
        let Some(key) = self.block_key(ns) else {
            return Ok(Promoted::Nothing);
        };
        let raw: Vec<u32> = toks[..full * bs].iter().map(|t| t.0).collect();
        let hashes = chain(&key, &raw, bs);
        let kv = self.sched.kv();
        // The pool's global layers: its blocks of the path, whole ones
        // `..g` (past `cached` only with sliding-window layers).
        let held = kv.tree().peek_prefix(ns, &toks[..full * bs]);
        let g = held.len / bs;
        let pool = kv.pool();
        let disk = &self.tier.as_ref().expect("a key means a tier").disk;
        let run = (j0..full)
            .take_while(|&j| j < g || disk.contains(hashes[j]))
            .count();
        // Block `j`'s sliding rows, whole, in the tier or the pool.
        let windowed =
            |j: usize| disk.whole(hashes[j]) || (j < g && pool.sliding_holds(held.blocks[j], 0));
        let run = match kv.window() {
            None => run,
            Some(_) => (1..=run)
                .rev()
                .find(|&k| {
                    let lo = kv.sliding_tail_start((j0 + k) * bs) / bs;
                    (lo.max(j0)..j0 + k).all(windowed)
                })
                .unwrap_or(0),
        };
        let end = (j0 + run) * bs;
        if end <= cached {
            return Ok(Promoted::Nothing);
        }
        let need = kv.blocks_for(toks.len() + 1) - j0;
        if need > *free {
            return Ok(Promoted::NoRoom);
        }
        // The sliding layers' rows from the window's first block on (0
        // without them), written from position `first`.
        let from = kv.sliding_tail_start(end);
        let first = cached.max(from);
        let jb = first / bs;
        let blocks = j0..j0 + run;
        // Where each block's rows come from, fixed before anything moves:
        // the tier's, else the pool's (read now: making room may evict
        // them).
        let in_tier: Vec<bool> = blocks.clone().map(|j| disk.contains(hashes[j])).collect();
        let whole_in_tier: Vec<bool> = blocks.clone().map(|j| disk.whole(hashes[j])).collect();
        let at = |j: usize| j - j0;
        let pool_global: Vec<usize> = blocks.clone().filter(|&j| !in_tier[at(j)]).collect();
        let pool_sliding: Vec<usize> = (jb..j0 + run).filter(|&j| !whole_in_tier[at(j)]).collect();
        let rows = Rows {
            slots: pool_global
                .iter()
                .flat_map(|&j| block_slots(held.blocks[j].0, bs))
                .collect(),
            sliding: pool_sliding
                .iter()
                .flat_map(|&j| {
                    let s = pool.sliding_of(held.blocks[j]).expect("checked");
                    block_slots(s.0, bs)
                })
                .collect(),
        };
        let from_pool = if rows.slots.is_empty() && rows.sliding.is_empty() {
            Vec::new()
        } else {
            self.runner.read_rows(&rows)?
        };
        // Room for them may evict others (demoted before anything is
        // written).
        let placed = self.sched.place_kv(ns, &toks[..end], from);
        self.drain_tree_log(true);
        let Ok(placed) = placed else {
            return Ok(Promoted::NoRoom);
        };
        *free -= need;
        let tier = self.tier.as_mut().expect("a key means a tier");
        let mut read = HashMap::new();
        for j in blocks.clone().filter(|&j| in_tier[at(j)]) {
            match tier.disk.get(hashes[j], &key, &raw[j * bs..(j + 1) * bs]) {
                Some(b) if !whole_in_tier[at(j)] || b.whole => {
                    read.insert(j, b);
                }
                _ => break,
            }
        }
        if placed.cached != cached || read.len() < in_tier.iter().filter(|&&t| t).count() {
            // A record went bad (or was dropped) since it was listed:
            // nothing is placed.
            self.sched
                .end_placement(placed, false)
                .map_err(super::sched_error)?;
            return Ok(Promoted::Nothing);
        }
        let row = self.runner.row_bytes() * bs;
        let n_layers = self.runner.model().config().n_layers;
        // Global layers' rows of blocks `j0..`, sliding layers' of `jb..`.
        let layers: Vec<LayerBytes> = (0..n_layers)
            .map(|l| {
                let sliding = self.runner.in_sliding(l);
                let (range, pooled) = if sliding {
                    (jb..j0 + run, &pool_sliding)
                } else {
                    (j0..j0 + run, &pool_global)
                };
                let mut out = LayerBytes::default();
                // The pool's rows come in `pooled`'s order, which is the
                // range's less the tier's blocks.
                let mut i = 0;
                for j in range {
                    let tiered = if sliding {
                        whole_in_tier[at(j)]
                    } else {
                        in_tier[at(j)]
                    };
                    let (k, v) = if tiered {
                        let b = &read[&j].layers[l];
                        (&b.k[..], &b.v[..])
                    } else {
                        debug_assert_eq!(pooled[i], j);
                        let (b, off) = (&from_pool[l], i * row);
                        i += 1;
                        (&b.k[off..off + row], &b.v[off..off + row])
                    };
                    out.k.extend_from_slice(k);
                    out.v.extend_from_slice(v);
                }
                out
            })
            .collect();
        let skip = cached - j0 * bs;
        let result = self.apply_append(&placed.plan).and_then(|()| {
            let rows = super::side::placement_rows(
                &placed.plan,
                cached,
                first,
                "a window read back from the disk tier",
            )?;
            self.runner
                .write_rows(&rows, &layers, skip, first - jb * bs)
        });
        let ok = result.is_ok();
        // Tokens read from disk: the tier's blocks, past `cached`.
        let gained = blocks
            .filter(|&j| in_tier[at(j)])
            .map(|j| (j + 1) * bs - cached.max(j * bs))
            .sum();
        self.sched
            .end_placement(placed, ok)
            .map_err(super::sched_error)?;
        result?;
        Ok(Promoted::Tokens(gained))
    }
}

/// What a promotion did.
enum Promoted {
    /// Tokens placed back into the prefix tree.
    Tokens(usize),
    /// The tier has nothing past the pool's match.
    Nothing,
    /// The pool has no room now: tried again at a later step.
    NoRoom,
}

/// The slots of block `b`'s positions (in its pool) for blocks of `bs`.
fn block_slots(b: u32, bs: usize) -> impl Iterator<Item = u32> {
    (0..bs as u32).map(move |o| b * bs as u32 + o)
}
