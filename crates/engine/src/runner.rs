//! The runner: the per-layer K/V tensors and the model that reads and
//! writes them. It carries out what the bookkeeping decided (block copies,
//! context shifts, forward passes over given slots, row reads and writes,
//! resizes) and knows nothing of requests, sampling or files.
//!
//! ```text
//! layer l:  k[l], v[l]  [num_blocks, block_size, kv_heads, head_dim]
//! slot s  = block · block_size + offset    (a row of kv_heads · head_dim)
//! ```
//!
//! With sliding-window layers (Gemma 3's local layers) on a pool of their
//! own, those layers' tensors have that pool's blocks, and every operation
//! takes their slots, tables, copies and moves apart from the others'.

use std::sync::Arc;

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};
use tessera_kernels::{copy_blocks, rotate_k, shift_kv, write_kv, write_kv_raw, KvType, Rotation};
use tessera_kv::{BlockId, CopyOp, ShiftPlan, Slot, TokenId};
use tessera_model::{Batch, LayerKv, Model, SlidingBatch, NO_BLOCK};

use crate::snapshot::LayerBytes;
use crate::{EngineError, Result};

/// The logits a forward pass returned, `[tokens, vocab]`: read in place,
/// a row at a time, where they are f32 in host memory (eight decoding
/// sequences' rows are 1.5 MiB of SmolLM2's vocabulary per step, which a
/// copy into one vector per row would move again).
pub(crate) struct Logits(Option<Tensor>);

impl Logits {
    /// Calls `f` with each row, in order.
    pub(crate) fn each_row(&self, mut f: impl FnMut(&[f32])) -> Result<()> {
        let Some(t) = &self.0 else {
            return Ok(());
        };
        let (_, vocab) = t.dims2()?;
        let in_place = |t: &Tensor, f: &mut dyn FnMut(&[f32])| {
            let (st, layout) = t.storage_and_layout();
            match (&*st, layout.contiguous_offsets()) {
                (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => {
                    v[a..b].chunks_exact(vocab).for_each(f);
                    true
                }
                _ => false,
            }
        };
        if in_place(t, &mut f) {
            return Ok(());
        }
        // A GPU's logits: one copy to the host, then read there in place
        // (not copied again into a vector per row).
        let host = t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
        if !in_place(&host, &mut f) {
            for row in host.to_vec2::<f32>()? {
                f(&row);
            }
        }
        Ok(())
    }
}

/// One sequence's part of a forward pass.
pub(crate) struct Part<'a> {
    pub tokens: &'a [TokenId],
    /// Position of `tokens[0]`.
    pub start: usize,
    /// Where each token's K/V goes (the scheduler's, borrowed).
    pub slots: &'a [Slot],
    /// The sequence's block table (the scheduler's, borrowed).
    pub table: &'a [BlockId],
    /// Return the logits of the tokens from this index on (`Some(len - 1)`:
    /// the last token's).
    pub logits_from: Option<usize>,
    /// The sliding-window layers' slots and block table (entries before
    /// the window: [`NO_BLOCK`]), when they have a pool of their own.
    pub sliding: Option<(Vec<u32>, Vec<u32>)>,
    /// RoPE positions of the tokens when they are not their positions
    /// (SelfExtend); empty otherwise.
    pub rope: Vec<u32>,
}

/// Slots of both pools: every layer's rows of some positions.
#[derive(Debug, Clone, Default)]
pub(crate) struct Rows {
    pub slots: Vec<u32>,
    /// The sliding-window layers' slots (their own pool), or empty.
    pub sliding: Vec<u32>,
}

impl Rows {
    /// The slots of the layers of one pool.
    fn of(&self, sliding: bool) -> &[u32] {
        if sliding {
            &self.sliding
        } else {
            &self.slots
        }
    }
}

pub(crate) struct Runner {
    model: Arc<Model>,
    cache: Vec<LayerKv>,
    /// Per layer: its tensors are the sliding pool's.
    in_sliding: Vec<bool>,
    block_size: usize,
}

impl Runner {
    /// `sliding_blocks`: a pool of their own for the sliding-window layers.
    pub(crate) fn new(
        model: Arc<Model>,
        num_blocks: usize,
        sliding_blocks: Option<usize>,
        block_size: usize,
        dtype: KvType,
    ) -> Result<Runner> {
        let cache = model
            .llama
            .new_split_cache(num_blocks, sliding_blocks, block_size, dtype)?;
        let in_sliding = (0..cache.len())
            .map(|l| sliding_blocks.is_some() && model.config().layer_window(l).is_some())
            .collect();
        Ok(Runner {
            model,
            cache,
            in_sliding,
            block_size,
        })
    }

    /// Whether layer `l` is a sliding-window layer with a pool of its own.
    pub(crate) fn in_sliding(&self, l: usize) -> bool {
        self.in_sliding.get(l).copied().unwrap_or(false)
    }

    /// Whether the sliding-window layers have a pool of their own.
    fn split(&self) -> bool {
        self.in_sliding.iter().any(|&s| s)
    }

    /// The layers of one pool, with their indices.
    fn layers(&self, sliding: bool) -> impl Iterator<Item = (usize, &LayerKv)> {
        self.cache
            .iter()
            .enumerate()
            .filter(move |(l, _)| self.in_sliding[*l] == sliding)
    }

    pub(crate) fn model(&self) -> &Model {
        &self.model
    }

    fn dtype(&self) -> KvType {
        self.cache
            .first()
            .and_then(|l| KvType::of(&l.k).ok())
            .unwrap_or(KvType::F32)
    }

    /// Bytes of one token's K (or V) in one layer.
    pub(crate) fn row_bytes(&self) -> usize {
        let c = self.model.config();
        c.n_kv_heads * self.dtype().bytes_for(c.head_dim)
    }

    /// Block copies in the global pool (every layer without a pool of its
    /// own).
    pub(crate) fn apply_copies(&self, copies: &[CopyOp]) -> Result<()> {
        self.copy_in(false, copies)
    }

    /// Block copies in the sliding-window layers' pool.
    pub(crate) fn apply_sliding_copies(&self, copies: &[CopyOp]) -> Result<()> {
        self.copy_in(true, copies)
    }

    fn copy_in(&self, sliding: bool, copies: &[CopyOp]) -> Result<()> {
        if copies.is_empty() {
            return Ok(());
        }
        let pairs: Vec<(u32, u32)> = copies.iter().map(|c| (c.src.0, c.dst.0)).collect();
        for (_, layer) in self.layers(sliding) {
            copy_blocks(&layer.k, &pairs)?;
            copy_blocks(&layer.v, &pairs)?;
        }
        Ok(())
    }

    /// Rotates the cached keys of `slots` (global pool) in place, each by
    /// its delta: a SelfExtend position map that moved. Each layer by its
    /// own RoPE frequencies.
    pub(crate) fn rotate_keys(&self, slots: &[u32], deltas: &[i64]) -> Result<()> {
        if slots.is_empty() {
            return Ok(());
        }
        for (l, layer) in self.cache.iter().enumerate() {
            if self.in_sliding[l] {
                return Err(EngineError::Invalid(
                    "SelfExtend on a sliding-window layer's pool".into(),
                ));
            }
            let rotation = Rotation {
                style: self.model.config().rope_style,
                inv_freq: self.model.llama.inv_freq(l).to_vec(),
                delta: 0,
            };
            rotate_k(&layer.k, slots, deltas, &rotation)?;
        }
        Ok(())
    }

    /// A context shift: its copies, then the moves with K rotated by the
    /// position delta, in each pool.
    pub(crate) fn apply_shift(&self, plan: &ShiftPlan) -> Result<()> {
        self.apply_copies(&plan.copies)?;
        self.apply_sliding_copies(&plan.sliding_copies)?;
        let pairs = |moves: &[tessera_kv::SlotMove]| -> Vec<(u32, u32)> {
            moves.iter().map(|m| (m.src.0, m.dst.0)).collect()
        };
        let (global, sliding) = (pairs(&plan.moves), pairs(&plan.sliding_moves));
        // Each layer by its own RoPE frequencies (Gemma 3's sliding layers
        // have their own base).
        for (l, layer) in self.cache.iter().enumerate() {
            let moves = if self.in_sliding[l] {
                &sliding
            } else {
                &global
            };
            if moves.is_empty() {
                continue;
            }
            let rotation = Rotation {
                style: self.model.config().rope_style,
                inv_freq: self.model.llama.inv_freq(l).to_vec(),
                delta: plan.position_delta,
            };
            shift_kv(&layer.k, &layer.v, moves, &rotation)?;
        }
        Ok(())
    }

    /// Runs `parts` through the model in one batch (writing their K/V into
    /// their slots); returns the logits the parts want, one row per token,
    /// in order.
    pub(crate) fn forward(&self, parts: &[Part]) -> Result<Logits> {
        if parts.is_empty() {
            return Ok(Logits(None));
        }
        let max_blocks = parts.iter().map(|p| p.table.len()).max().unwrap_or(0);
        let (mut tokens, mut positions, mut slots, mut token_seq) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mapped = parts.iter().any(|p| !p.rope.is_empty());
        let mut rope = Vec::new();
        let mut tables = Vec::with_capacity(parts.len() * max_blocks);
        let (mut sliding_slots, mut sliding_tables) = (Vec::new(), Vec::new());
        let mut logits_for = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            tokens.extend(p.tokens.iter().map(|t| t.0));
            positions.extend((p.start..p.start + p.tokens.len()).map(|x| x as u32));
            if mapped {
                if p.rope.is_empty() {
                    rope.extend((p.start..p.start + p.tokens.len()).map(|x| x as u32));
                } else {
                    rope.extend_from_slice(&p.rope);
                }
            }
            slots.extend(p.slots.iter().map(|s| s.0));
            token_seq.extend(std::iter::repeat_n(i as u32, p.tokens.len()));
            tables.extend(p.table.iter().map(|b| b.0));
            tables.extend(std::iter::repeat_n(0, max_blocks - p.table.len()));
            if self.split() {
                let Some((s, t)) = &p.sliding else {
                    return Err(EngineError::Step(
                        "a part without the sliding layers' slots".into(),
                    ));
                };
                sliding_slots.extend_from_slice(s);
                sliding_tables.extend_from_slice(t);
                sliding_tables.extend(std::iter::repeat_n(NO_BLOCK, max_blocks - t.len()));
            }
            if let Some(from) = p.logits_from {
                let end = tokens.len() as u32;
                logits_for.extend(end - (p.tokens.len() - from) as u32..end);
            }
        }
        let batch = Batch {
            tokens: &tokens,
            positions: &positions,
            rope_positions: (!rope.is_empty()).then_some(&rope[..]),
            slots: &slots,
            token_seq: &token_seq,
            block_tables: &tables,
            max_blocks,
            block_size: self.block_size,
            logits_for: &logits_for,
            sliding: self.split().then_some(SlidingBatch {
                slots: &sliding_slots,
                block_tables: &sliding_tables,
            }),
        };
        let logits = self.model.llama.forward(&batch, &self.cache)?;
        Ok(Logits((!logits_for.is_empty()).then_some(logits)))
    }

    /// The K/V rows of `rows`, per layer (the sliding-window layers' from
    /// their own slots when they have a pool).
    pub(crate) fn read_rows(&self, rows: &Rows) -> Result<Vec<LayerBytes>> {
        let dev = self.model.llama.device();
        let idx = [
            Tensor::new(rows.of(false), dev)?,
            Tensor::new(rows.of(true), dev)?,
        ];
        let read = |t: &Tensor, idx: &Tensor| -> Result<Vec<u8>> {
            let slots = t.dim(0)? * t.dim(1)?;
            let picked = t
                .reshape((slots, t.elem_count() / slots.max(1)))?
                .index_select(idx, 0)?;
            tensor_bytes(&picked)
        };
        self.cache
            .iter()
            .enumerate()
            .map(|(l, layer)| {
                let idx = &idx[usize::from(self.in_sliding[l])];
                Ok(LayerBytes {
                    k: read(&layer.k, idx)?,
                    v: read(&layer.v, idx)?,
                })
            })
            .collect()
    }

    /// Checks that every layer holds exactly `tokens` K and V rows of this
    /// pool's dtype and geometry (`sliding_tokens` in sliding-window layers
    /// with a pool of their own).
    pub(crate) fn check_rows(
        &self,
        layers: &[LayerBytes],
        tokens: usize,
        sliding_tokens: usize,
    ) -> Result<()> {
        if layers.len() != self.cache.len() {
            return Err(EngineError::Invalid(format!(
                "K/V for {} layers; the model has {}",
                layers.len(),
                self.cache.len()
            )));
        }
        for (i, l) in layers.iter().enumerate() {
            let n = if self.in_sliding[i] {
                sliding_tokens
            } else {
                tokens
            };
            let want = n
                .checked_mul(self.row_bytes())
                .ok_or_else(|| EngineError::Invalid("K/V size overflows".into()))?;
            if l.k.len() != want || l.v.len() != want {
                return Err(EngineError::Invalid(format!(
                    "layer {i} holds {} K and {} V bytes; {n} tokens need {want} each",
                    l.k.len(),
                    l.v.len(),
                )));
            }
        }
        Ok(())
    }

    /// Writes rows `skip..` of `layers` into `rows.slots` (and rows
    /// `sliding_skip..` of the sliding-window layers into `rows.sliding`),
    /// after [`check_rows`](Self::check_rows): nothing is written unless
    /// every layer has its rows.
    pub(crate) fn write_rows(
        &self,
        rows: &Rows,
        layers: &[LayerBytes],
        skip: usize,
        sliding_skip: usize,
    ) -> Result<()> {
        let row = self.row_bytes();
        self.check_rows(
            layers,
            skip + rows.slots.len(),
            sliding_skip + rows.sliding.len(),
        )?;
        let dev = self.model.llama.device();
        let c = self.model.config();
        for (l, (layer, bytes)) in self.cache.iter().zip(layers).enumerate() {
            let slots = rows.of(self.in_sliding[l]);
            let skip = if self.in_sliding[l] {
                sliding_skip
            } else {
                skip
            };
            if slots.is_empty() {
                continue;
            }
            let shape = [slots.len(), c.n_kv_heads, c.head_dim];
            let t = self.dtype();
            if t.is_quantized() {
                // Quantized rows go back byte for byte.
                let n = slots.len() * row;
                write_kv_raw(&layer.k, &bytes.k[skip * row..][..n], slots)?;
                write_kv_raw(&layer.v, &bytes.v[skip * row..][..n], slots)?;
                continue;
            }
            let from = |b: &[u8]| {
                Tensor::from_raw_buffer(&b[skip * row..], t.storage_dtype(), &shape, dev)
            };
            write_kv(&layer.k, &from(&bytes.k)?, slots)?;
            write_kv(&layer.v, &from(&bytes.v)?, slots)?;
        }
        Ok(())
    }

    /// Fills `rows` with NaN in every layer (injected faults).
    pub(crate) fn poison(&self, rows: &Rows) -> Result<()> {
        let c = self.model.config();
        for (l, layer) in self.cache.iter().enumerate() {
            let slots = rows.of(self.in_sliding[l]);
            if slots.is_empty() {
                continue;
            }
            let nan = Tensor::full(
                f32::NAN,
                (slots.len(), c.n_kv_heads, c.head_dim),
                self.model.llama.device(),
            )?;
            write_kv(&layer.k, &nan, slots)?;
            write_kv(&layer.v, &nan, slots)?;
        }
        Ok(())
    }

    /// Gives the global pool `blocks` blocks: the first ones are kept (the
    /// caller compacted live blocks below `blocks` first), new ones are
    /// zero. (A sliding-window layers' pool keeps its size.)
    pub(crate) fn resize(&mut self, blocks: usize) -> Result<()> {
        for (l, layer) in self.cache.iter_mut().enumerate() {
            if self.in_sliding[l] {
                continue;
            }
            let now = layer.k.dim(0)?;
            if blocks < now {
                layer.k = layer.k.narrow(0, 0, blocks)?.copy()?;
                layer.v = layer.v.narrow(0, 0, blocks)?.copy()?;
            } else if blocks > now {
                let mut dims = layer.k.dims().to_vec();
                dims[0] = blocks - now;
                let extra = Tensor::zeros(dims, layer.k.dtype(), layer.k.device())?;
                layer.k = Tensor::cat(&[&layer.k, &extra], 0)?;
                layer.v = Tensor::cat(&[&layer.v, &extra], 0)?;
            }
        }
        Ok(())
    }
}

/// The raw little-endian bytes of a tensor.
fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let flat = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => flat
            .to_vec1::<f32>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::F16 => flat
            .to_vec1::<half::f16>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::BF16 => flat
            .to_vec1::<half::bf16>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::U8 => flat.to_vec1::<u8>()?,
        other => {
            return Err(EngineError::Invalid(format!(
                "K/V of dtype {other:?} cannot be saved"
            )))
        }
    })
}

/// A sequence's slots and table in the sliding-window layers' pool, as
/// the runner takes them (entries before the window: no block).
pub(crate) fn sliding_part(
    slots: &[tessera_kv::Slot],
    table: &[Option<tessera_kv::BlockId>],
) -> (Vec<u32>, Vec<u32>) {
    (
        slots.iter().map(|s| s.0).collect(),
        table
            .iter()
            .map(|b| b.map_or(tessera_model::NO_BLOCK, |b| b.0))
            .collect(),
    )
}
