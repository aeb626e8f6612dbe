//! The worker's work beside the requests' generations: session exports
//! (background requests, their K/V read between steps), scored texts
//! (private requests whose logits rows are gathered), and the byte copies
//! that sessions and the cache directory need (K/V read from cached paths,
//! written into free blocks).

use std::sync::mpsc;

use tessera_kv::{token_ids, AppendPlan, Namespace, SeqId};
use tessera_sched::{NewRequest, ReqId};
use tracing::warn;

use super::{sched_error, Worker};
use crate::runner::Rows;
use crate::self_extend::PositionMap;
use crate::snapshot::KvSnapshot;
use crate::types::Partition;
use crate::{EngineError, Result};

/// A session export in the scheduler: its tokens and who waits for them,
/// and once they are computed, its K/V as read so far.
pub(super) struct Export {
    pub(super) ids: Vec<u32>,
    pub(super) reply: mpsc::Sender<Result<(KvSnapshot, usize)>>,
    pub(super) read: Option<Reading>,
}

/// A text whose logits are wanted (`Engine::logits`, perplexity): a
/// private request (nothing cached read or added) computed in prefill
/// chunks beside the others, its rows gathered as the steps give them.
pub(super) struct Scoring {
    /// Tokens of the text.
    pub(super) n: usize,
    /// The first position whose logits are wanted.
    pub(super) first: usize,
    pub(super) rows: Vec<Vec<f32>>,
    pub(super) reply: mpsc::Sender<Result<Vec<Vec<f32>>>>,
}

impl Scoring {
    /// The wanted rows an item over `start..start + len` gives: the
    /// logits after each token of `lo..hi` (the text's last token predicts
    /// nothing). `None` when it gives none.
    pub(super) fn wanted(&self, start: usize, len: usize) -> Option<std::ops::Range<usize>> {
        let lo = self.first.max(start);
        let hi = (start + len).min(self.n - 1);
        (lo < hi).then_some(lo..hi)
    }
}

/// An export's K/V read a part at a time between steps (a 2,000-token
/// session of a 135M model is 46 MB: read at once, it would stall the
/// running requests for milliseconds).
pub(super) struct Reading {
    /// The export's sequence (its slots are looked up for each part: a
    /// defragmentation between two parts may move its blocks).
    pub(super) seq: SeqId,
    /// The first position the sliding-window layers hold.
    pub(super) from: usize,
    /// Positions read so far.
    pub(super) at: usize,
    pub(super) layers: Vec<crate::snapshot::LayerBytes>,
}

/// Positions of an export's K/V read between two steps while other
/// requests run (all at once when none does).
pub(super) const READ_PER_STEP: usize = 128;

impl Worker {
    /// Queues the text `ids` to be scored: its logits after each position
    /// from `first` on go to `reply` once its last chunk is computed.
    pub(super) fn start_scoring(
        &mut self,
        ids: Vec<u32>,
        first: usize,
        reply: mpsc::Sender<Result<Vec<Vec<f32>>>>,
    ) {
        let n = ids.len();
        if first + 1 >= n {
            let _ = reply.send(Ok(Vec::new()));
            return;
        }
        let added = self.sched.add(NewRequest {
            namespace: self.ns,
            prompt: token_ids(&ids),
            max_new_tokens: 0,
            shift_keep: None,
            reuse_prefix: false,
            private: true,
            background: false,
        });
        match added {
            Ok(id) => {
                if let Some(se) = self.cfg.self_extend {
                    self.maps.insert(id, PositionMap::new(se));
                }
                let rows = Vec::with_capacity(n - 1 - first);
                self.scores.insert(
                    id,
                    Scoring {
                        n,
                        first,
                        rows,
                        reply,
                    },
                );
            }
            Err(e) => {
                let _ = reply.send(Err(sched_error(e)));
            }
        }
    }

    /// Queues the export of `ids`' K/V in partition `p` as a background
    /// request; the answer goes to `reply` once its prompt is computed.
    pub(super) fn start_export(
        &mut self,
        p: &Partition,
        ids: Vec<u32>,
        reply: mpsc::Sender<Result<(KvSnapshot, usize)>>,
    ) {
        if ids.is_empty() {
            let empty = KvSnapshot {
                tokens: Vec::new(),
                layers: Vec::new(),
                sliding_from: 0,
            };
            let _ = reply.send(Ok((empty, 0)));
            return;
        }
        let namespace = self.namespace(p);
        if self.exports.is_empty() {
            // A first save starts small; the share grows as steps allow.
            self.sched.set_background_tokens(self.cfg.background_chunk);
        }
        let added = self.sched.add(NewRequest {
            namespace,
            prompt: token_ids(&ids),
            max_new_tokens: 0,
            shift_keep: None,
            reuse_prefix: true,
            private: false,
            background: true,
        });
        match added {
            Ok(id) => {
                self.exports.insert(
                    id,
                    Export {
                        ids,
                        reply,
                        read: None,
                    },
                );
            }
            Err(e) => {
                let _ = reply.send(Err(sched_error(e)));
            }
        }
    }

    /// An export's prompt is computed: its K/V is read from the next
    /// step on (its sequence stays held until then).
    pub(super) fn end_export(&mut self, id: ReqId, seq: SeqId) {
        let Some(n) = self.exports.get(&id).map(|x| x.ids.len()) else {
            return;
        };
        let from = self.sched.kv().window_start(n).unwrap_or(n);
        let x = self.exports.get_mut(&id).expect("just found");
        x.read = Some(Reading {
            seq,
            from,
            at: 0,
            layers: Vec::new(),
        });
    }

    /// Reads the next part of each computed export's K/V (all of it when
    /// no request runs beside); a whole one goes to its caller, and its
    /// sequence into the prefix tree.
    pub(super) fn read_exports(&mut self) {
        let busy = !self.active.is_empty();
        let ids: Vec<ReqId> = self
            .exports
            .iter()
            .filter(|(_, x)| x.read.is_some())
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            let x = self.exports.get(&id).expect("listed");
            let r = x.read.as_ref().expect("listed");
            let (n, at) = (x.ids.len(), r.at);
            let end = if busy { (at + READ_PER_STEP).min(n) } else { n };
            let read = self
                .slots_in(r.seq, at..end, r.from)
                .and_then(|rows| self.runner.read_rows(&rows));
            match read {
                Ok(part) => {
                    let x = self.exports.get_mut(&id).expect("listed");
                    let r = x.read.as_mut().expect("listed");
                    if r.layers.is_empty() {
                        r.layers = part;
                    } else {
                        for (all, p) in r.layers.iter_mut().zip(part) {
                            all.k.extend(p.k);
                            all.v.extend(p.v);
                        }
                    }
                    r.at = end;
                    if end == n {
                        self.send_export(id);
                    }
                }
                Err(e) => self.fail(id, &e),
            }
        }
    }

    /// Sends a whole export to its caller; its sequence enters the tree.
    pub(super) fn send_export(&mut self, id: ReqId) {
        let Some(x) = self.exports.remove(&id) else {
            return;
        };
        let cached = self.sched.cached_tokens(id).ok().flatten().unwrap_or(0);
        if let Err(e) = self.sched.finish(id) {
            warn!("finishing export {id}: {e}");
        }
        let r = x.read.expect("read whole");
        let snap = KvSnapshot {
            tokens: x.ids,
            layers: r.layers,
            sliding_from: r.from,
        };
        let _ = x.reply.send(Ok((snap, cached)));
    }

    /// A scored text's last chunk is computed: its rows go to the caller
    /// and its sequence is freed (nothing of it cached).
    pub(super) fn end_scoring(&mut self, id: ReqId) {
        let Some(s) = self.scores.remove(&id) else {
            return;
        };
        if let Err(e) = self.sched.finish(id) {
            warn!("finishing scored text {id}: {e}");
        }
        let _ = s.reply.send(Ok(s.rows));
    }

    /// Carries out an append plan's copies in both pools.
    pub(super) fn apply_append(&self, plan: &AppendPlan) -> Result<()> {
        self.runner.apply_copies(&plan.copies)?;
        self.runner.apply_sliding_copies(&plan.sliding_copies)
    }

    /// The K/V of `seq`'s positions `0..n`: every one's in global layers,
    /// and in sliding-window layers those a request resuming at `n` reads
    /// (from the returned position on).
    pub(super) fn read_kv(
        &self,
        seq: SeqId,
        n: usize,
    ) -> Result<(Vec<crate::snapshot::LayerBytes>, usize)> {
        let from = self.sched.kv().window_start(n).unwrap_or(n);
        let layers = self.runner.read_rows(&self.slots_in(seq, 0..n, from)?)?;
        Ok((layers, from))
    }

    /// The slots of `seq`'s positions in `range`: in the global layers all
    /// of them, in the sliding-window layers those from `from` on.
    pub(super) fn slots_in(
        &self,
        seq: SeqId,
        range: std::ops::Range<usize>,
        from: usize,
    ) -> Result<Rows> {
        let kv = self.sched.kv();
        let slots = range
            .clone()
            .map(|p| kv.slot(seq, p).map(|s| s.0))
            .collect::<std::result::Result<_, _>>()?;
        let mut sliding = Vec::new();
        if kv.window().is_some() {
            for p in range.start.max(from)..range.end {
                let slot = kv.sliding_slot(seq, p)?.ok_or_else(|| {
                    EngineError::Step(format!("position {p} lost its sliding-window K/V"))
                })?;
                sliding.push(slot.0);
            }
        }
        Ok(Rows { slots, sliding })
    }

    /// The K/V of a path the prefix tree of namespace `ns` holds whole
    /// (read, not computed: what is not cached is an error). The path is
    /// held while it is read, then released as it was.
    pub(super) fn export_now(&mut self, ns: Namespace, ids: &[u32]) -> Result<KvSnapshot> {
        let toks = token_ids(ids);
        let (seq, cached) = self.sched.kv_mut().add_sequence(ns, &toks);
        let read = if cached == ids.len() {
            self.read_kv(seq, ids.len())
        } else {
            Err(EngineError::Step(format!(
                "{} of {} tokens of a cached path are cached",
                cached,
                ids.len()
            )))
        };
        self.sched.kv_mut().free_sequence(seq)?;
        let (layers, sliding_from) = read?;
        Ok(KvSnapshot {
            tokens: ids.to_vec(),
            layers,
            sliding_from,
        })
    }

    pub(super) fn export_cache(&mut self) -> Result<Vec<(Partition, KvSnapshot)>> {
        let paths = self.sched.kv().tree().paths();
        let mut out = Vec::new();
        for p in paths {
            let Some(partition) = self.partition_of(p.namespace) else {
                continue;
            };
            // With sliding-window layers, up to the last point a request
            // can resume from (its window's K/V whole).
            let n = self.sched.kv().cached_prefix_len(p.namespace, &p.tokens);
            let ids: Vec<u32> = p.tokens[..n].iter().map(|t| t.0).collect();
            if ids.is_empty() {
                continue;
            }
            out.push((partition, self.export_now(p.namespace, &ids)?));
        }
        Ok(out)
    }

    /// Inserts snapshots into the prefix tree. Each is checked whole (token
    /// ids in the vocabulary, one K and one V row per token per layer)
    /// before any of its bytes is written; a bad one is refused and what
    /// came before it stays.
    pub(super) fn import(&mut self, snaps: &[(Partition, KvSnapshot)]) -> Result<usize> {
        if !self.cfg.prefix_cache {
            return Err(EngineError::Invalid(
                "loading saved K/V needs the prefix cache, which is off".into(),
            ));
        }
        let vocab = self.runner.model().config().vocab_size;
        let mut total = 0;
        for (partition, snap) in snaps.iter().filter(|s| !s.1.tokens.is_empty()) {
            let ns = self.namespace(partition);
            if let Some(&t) = snap.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(EngineError::Invalid(format!(
                    "saved token id {t} is outside the vocabulary of {vocab}"
                )));
            }
            // The byte counts, before the pool is touched.
            let n = snap.tokens.len();
            let from = snap.sliding_from.min(n);
            self.runner.check_rows(&snap.layers, n, n - from)?;
            let toks = token_ids(&snap.tokens);
            let placed = self.sched.place_kv(ns, &toks, from);
            // Room made for it: demoted before its rows are written.
            self.drain_tree_log(true);
            let placed = placed.map_err(sched_error)?;
            let cached = placed.cached;
            let plan = &placed.plan;
            let result = self.apply_append(plan).and_then(|()| {
                // Sliding rows of positions `first..` (the tail past what
                // the cache held).
                let first = cached.max(from);
                let rows = placement_rows(plan, cached, first, "a restored tail")?;
                self.runner
                    .write_rows(&rows, &snap.layers, cached, first - from)
            });
            total += self
                .sched
                .end_placement(placed, result.is_ok())
                .map_err(sched_error)?;
            result?;
        }
        Ok(total)
    }
}

/// The slots a placement of K/V that is written rather than computed
/// fills: every new position's in the global layers, and in the
/// sliding-window layers those from `first` on (the plan's positions
/// begin at `cached`). `what` names the K/V when a position from `first`
/// on has no sliding-window block.
pub(super) fn placement_rows(
    plan: &AppendPlan,
    cached: usize,
    first: usize,
    what: &str,
) -> Result<Rows> {
    let rows = Rows {
        slots: plan.slots.iter().map(|s| s.0).collect(),
        sliding: plan
            .sliding_slots
            .get(first - cached..)
            .unwrap_or_default()
            .iter()
            .map(|s| s.0)
            .collect(),
    };
    if rows.sliding.contains(&u32::MAX) {
        return Err(EngineError::Step(format!(
            "{what} has no sliding-window block"
        )));
    }
    Ok(rows)
}
