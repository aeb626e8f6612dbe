//! Tests of the bookkeeping: exact-state stories (`scenarios`) and a
//! model-based property test against a naive oracle (`model`). Both replay
//! every emitted plan on a shadow "KV" that records, per slot, the token and
//! position whose K/V it holds, so lost or mixed content is caught.

mod model;
mod scenarios;
mod sliding;

use crate::{Admission, AppendPlan, CopyOp, KvCache, Namespace, SeqId, ShiftPlan, Slot, TokenId};

/// What a slot holds: the token and the position its K/V was computed at.
pub(crate) type Cell = Option<(TokenId, usize)>;

/// A stand-in for the K/V tensors.
pub(crate) struct Shadow {
    pub cells: Vec<Cell>,
    /// The sliding-window layers' pool.
    pub sliding: Vec<Cell>,
    pub bs: usize,
}

fn copy_cells(cells: &mut [Cell], bs: usize, ops: &[CopyOp]) {
    for op in ops {
        for o in 0..bs {
            cells[op.dst.index() * bs + o] = cells[op.src.index() * bs + o];
        }
    }
}

fn move_cells(cells: &mut [Cell], moves: &[crate::SlotMove], delta: i64) {
    for m in moves {
        let (t, p) = cells[m.src.index()].expect("moved slot holds content");
        cells[m.dst.index()] = Some((t, (p as i64 + delta) as usize));
    }
}

impl Shadow {
    pub fn new(kv: &KvCache) -> Self {
        Shadow {
            cells: vec![None; kv.pool().num_blocks() * kv.block_size()],
            sliding: vec![None; kv.pool().num_sliding_blocks() * kv.block_size()],
            bs: kv.block_size(),
        }
    }

    /// Carries out an append plan's copies (both pools).
    pub fn copy_append(&mut self, plan: &AppendPlan) {
        copy_cells(&mut self.cells, self.bs, &plan.copies);
        copy_cells(&mut self.sliding, self.bs, &plan.sliding_copies);
    }

    /// Carries out a defragmentation plan (both pools).
    pub fn defrag(&mut self, plan: &crate::DefragPlan) {
        copy_cells(&mut self.cells, self.bs, &plan.moves);
        copy_cells(&mut self.sliding, self.bs, &plan.sliding_moves);
    }

    /// Carries out a shift plan: copies, then moves in order; a moved cell's
    /// position changes by the delta (the K rotation).
    pub fn shift(&mut self, plan: &ShiftPlan) {
        copy_cells(&mut self.cells, self.bs, &plan.copies);
        move_cells(&mut self.cells, &plan.moves, plan.position_delta);
        copy_cells(&mut self.sliding, self.bs, &plan.sliding_copies);
        move_cells(&mut self.sliding, &plan.sliding_moves, plan.position_delta);
    }

    /// Computes the pending tokens of `seq` into their slots.
    pub fn compute(&mut self, kv: &mut KvCache, seq: SeqId) {
        let s = kv.sequence(seq).unwrap();
        let (done, toks) = (s.num_computed(), s.tokens().to_vec());
        for (p, &t) in toks.iter().enumerate().skip(done) {
            let slot = kv.slot(seq, p).unwrap();
            self.cells[slot.index()] = Some((t, p));
            if let Some(s) = kv.sliding_slot(seq, p).unwrap() {
                self.sliding[s.index()] = Some((t, p));
            }
        }
        kv.mark_computed(seq, toks.len()).unwrap();
    }

    /// Every computed position of `seq` reads back its own token.
    pub fn check_seq(&self, kv: &KvCache, seq: SeqId) -> Result<(), String> {
        let s = kv.sequence(seq).unwrap();
        for p in 0..s.num_computed() {
            let slot = kv.slot(seq, p).unwrap();
            let want = Some((s.tokens()[p], p));
            if self.cells[slot.index()] != want {
                return Err(format!(
                    "{seq:?} position {p}: slot {slot:?} holds {:?}, want {want:?}",
                    self.cells[slot.index()]
                ));
            }
        }
        // The sliding layers: the window of the next query.
        let from = kv.window().map_or(s.num_computed(), |w| {
            (s.num_computed() + 1).saturating_sub(w)
        });
        for p in from..s.num_computed() {
            let want = Some((s.tokens()[p], p));
            let Some(slot) = kv.sliding_slot(seq, p).unwrap() else {
                return Err(format!(
                    "{seq:?} position {p}: no sliding block in its window"
                ));
            };
            if self.sliding[slot.index()] != want {
                return Err(format!(
                    "{seq:?} position {p}: sliding {slot:?} holds {:?}, want {want:?}",
                    self.sliding[slot.index()]
                ));
            }
        }
        Ok(())
    }

    /// Every cached path reads back its tokens through the blocks a match
    /// returns.
    pub fn check_tree(&self, kv: &KvCache) -> Result<(), String> {
        for path in kv.tree().paths() {
            for (p, &t) in path.tokens.iter().enumerate() {
                let b = path.blocks[p / self.bs];
                let cell = self.cells[Slot::of(b, p % self.bs, self.bs).index()];
                if cell != Some((t, p)) {
                    return Err(format!(
                        "cached path {:?}… position {p} in {b:?} holds {cell:?}, want {:?}",
                        &path.tokens[..path.tokens.len().min(8)],
                        (t, p)
                    ));
                }
                // A sliding block, where there is one, holds every position
                // from where its K/V begins.
                if let Some(sb) = kv
                    .pool()
                    .sliding_of(b)
                    .filter(|_| p % self.bs >= kv.pool().sliding_valid_from(b))
                {
                    let cell = self.sliding[Slot::of(sb, p % self.bs, self.bs).index()];
                    if cell != Some((t, p)) {
                        return Err(format!(
                            "cached path position {p}: sliding {sb:?} of {b:?} holds {cell:?}"
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

pub(crate) fn toks(raw: &[u32]) -> Vec<TokenId> {
    crate::token_ids(raw)
}

pub(crate) const NS: Namespace = Namespace(7);

/// Appends and computes, carrying out the plan on the shadow.
pub(crate) fn append_compute(
    kv: &mut KvCache,
    sh: &mut Shadow,
    seq: SeqId,
    raw: &[u32],
) -> AppendPlan {
    let plan = match kv.append(seq, &toks(raw)).unwrap() {
        Admission::Ok(p) => p,
        other => panic!("append of {} tokens not admitted: {other:?}", raw.len()),
    };
    sh.copy_append(&plan);
    sh.compute(kv, seq);
    plan
}
