//! The runner: the per-layer K/V tensors and the model that reads and
//! writes them. It carries out what the bookkeeping decided (block copies,
//! context shifts, forward passes over given slots, row reads and writes,
//! resizes) and knows nothing of requests, sampling or files.
//!
//! ```text
//! layer l:  k[l], v[l]  [num_blocks, block_size, kv_heads, head_dim]
//! slot s  = block · block_size + offset    (a row of kv_heads · head_dim)
//! ```

use std::sync::Arc;

use candle_core::{DType, Tensor};
use tessera_kernels::{copy_blocks, shift_kv, write_kv, Rotation};
use tessera_kv::{CopyOp, ShiftPlan, TokenId};
use tessera_model::{Batch, LayerKv, Model};

use crate::snapshot::LayerBytes;
use crate::{EngineError, Result};

/// One sequence's part of a forward pass.
pub(crate) struct Part<'a> {
    pub tokens: &'a [TokenId],
    /// Position of `tokens[0]`.
    pub start: usize,
    /// Where each token's K/V goes.
    pub slots: Vec<u32>,
    /// The sequence's block table.
    pub table: Vec<u32>,
    /// Return the logits of the tokens from this index on (`Some(len - 1)`:
    /// the last token's).
    pub logits_from: Option<usize>,
}

pub(crate) struct Runner {
    model: Arc<Model>,
    cache: Vec<LayerKv>,
    block_size: usize,
}

impl Runner {
    pub(crate) fn new(
        model: Arc<Model>,
        num_blocks: usize,
        block_size: usize,
        dtype: DType,
    ) -> Result<Runner> {
        let cache = model.llama.new_cache(num_blocks, block_size, dtype)?;
        Ok(Runner {
            model,
            cache,
            block_size,
        })
    }

    pub(crate) fn model(&self) -> &Model {
        &self.model
    }

    fn dtype(&self) -> DType {
        self.cache.first().map_or(DType::F32, |l| l.k.dtype())
    }

    /// Bytes of one token's K (or V) in one layer.
    pub(crate) fn row_bytes(&self) -> usize {
        let c = self.model.config();
        c.n_kv_heads * c.head_dim * self.dtype().size_in_bytes()
    }

    pub(crate) fn apply_copies(&self, copies: &[CopyOp]) -> Result<()> {
        if copies.is_empty() {
            return Ok(());
        }
        let pairs: Vec<(u32, u32)> = copies.iter().map(|c| (c.src.0, c.dst.0)).collect();
        for layer in &self.cache {
            copy_blocks(&layer.k, &pairs)?;
            copy_blocks(&layer.v, &pairs)?;
        }
        Ok(())
    }

    /// A context shift: its copies, then the moves with K rotated by the
    /// position delta.
    pub(crate) fn apply_shift(&self, plan: &ShiftPlan) -> Result<()> {
        self.apply_copies(&plan.copies)?;
        let moves: Vec<(u32, u32)> = plan.moves.iter().map(|m| (m.src.0, m.dst.0)).collect();
        // Each layer by its own RoPE frequencies (Gemma 3's sliding layers
        // have their own base).
        for (l, layer) in self.cache.iter().enumerate() {
            let rotation = Rotation {
                style: self.model.config().rope_style,
                inv_freq: self.model.llama.inv_freq(l).to_vec(),
                delta: plan.position_delta,
            };
            shift_kv(&layer.k, &layer.v, &moves, &rotation)?;
        }
        Ok(())
    }

    /// Runs `parts` through the model in one batch (writing their K/V into
    /// their slots); returns the logits the parts want, one row per token,
    /// in order.
    pub(crate) fn forward(&self, parts: &[Part]) -> Result<Vec<Vec<f32>>> {
        if parts.is_empty() {
            return Ok(Vec::new());
        }
        let max_blocks = parts.iter().map(|p| p.table.len()).max().unwrap_or(0);
        let (mut tokens, mut positions, mut slots, mut token_seq) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut tables = Vec::with_capacity(parts.len() * max_blocks);
        let mut logits_for = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            tokens.extend(p.tokens.iter().map(|t| t.0));
            positions.extend((p.start..p.start + p.tokens.len()).map(|x| x as u32));
            slots.extend_from_slice(&p.slots);
            token_seq.extend(std::iter::repeat_n(i as u32, p.tokens.len()));
            tables.extend_from_slice(&p.table);
            tables.extend(std::iter::repeat_n(0, max_blocks - p.table.len()));
            if let Some(from) = p.logits_from {
                let end = tokens.len() as u32;
                logits_for.extend(end - (p.tokens.len() - from) as u32..end);
            }
        }
        let batch = Batch {
            tokens: &tokens,
            positions: &positions,
            slots: &slots,
            token_seq: &token_seq,
            block_tables: &tables,
            max_blocks,
            block_size: self.block_size,
            logits_for: &logits_for,
        };
        let logits = self.model.llama.forward(&batch, &self.cache)?;
        if logits_for.is_empty() {
            return Ok(Vec::new());
        }
        Ok(logits.to_vec2::<f32>()?)
    }

    /// The K/V rows of `slots`, per layer.
    pub(crate) fn read_rows(&self, slots: &[u32]) -> Result<Vec<LayerBytes>> {
        let idx = Tensor::new(slots, self.model.llama.device())?;
        let rows = |t: &Tensor| -> Result<Vec<u8>> {
            let (nb, bs, h, d) = t.dims4()?;
            let picked = t.reshape((nb * bs, h, d))?.index_select(&idx, 0)?;
            tensor_bytes(&picked)
        };
        self.cache
            .iter()
            .map(|l| {
                Ok(LayerBytes {
                    k: rows(&l.k)?,
                    v: rows(&l.v)?,
                })
            })
            .collect()
    }

    /// Checks that every layer holds exactly `tokens` K and V rows of this
    /// pool's dtype and geometry.
    pub(crate) fn check_rows(&self, layers: &[LayerBytes], tokens: usize) -> Result<()> {
        if layers.len() != self.cache.len() {
            return Err(EngineError::Invalid(format!(
                "K/V for {} layers; the model has {}",
                layers.len(),
                self.cache.len()
            )));
        }
        let want = tokens
            .checked_mul(self.row_bytes())
            .ok_or_else(|| EngineError::Invalid("K/V size overflows".into()))?;
        if let Some((i, l)) = layers
            .iter()
            .enumerate()
            .find(|(_, l)| l.k.len() != want || l.v.len() != want)
        {
            return Err(EngineError::Invalid(format!(
                "layer {i} holds {} K and {} V bytes; {tokens} tokens need {want} each",
                l.k.len(),
                l.v.len(),
            )));
        }
        Ok(())
    }

    /// Writes rows `skip..skip + slots.len()` of `layers` into `slots`,
    /// after [`check_rows`](Self::check_rows) for `skip + slots.len()`
    /// tokens: nothing is written unless every layer has its rows.
    pub(crate) fn write_rows(
        &self,
        slots: &[u32],
        layers: &[LayerBytes],
        skip: usize,
    ) -> Result<()> {
        let row = self.row_bytes();
        let n = slots.len();
        self.check_rows(layers, skip + n)?;
        if n == 0 {
            return Ok(());
        }
        let dev = self.model.llama.device();
        let c = self.model.config();
        let shape = [n, c.n_kv_heads, c.head_dim];
        for (layer, bytes) in self.cache.iter().zip(layers) {
            let from =
                |b: &[u8]| Tensor::from_raw_buffer(&b[skip * row..], self.dtype(), &shape, dev);
            write_kv(&layer.k, &from(&bytes.k)?, slots)?;
            write_kv(&layer.v, &from(&bytes.v)?, slots)?;
        }
        Ok(())
    }

    /// Fills `slots` with NaN in every layer (injected faults).
    pub(crate) fn poison(&self, slots: &[u32]) -> Result<()> {
        if slots.is_empty() {
            return Ok(());
        }
        let c = self.model.config();
        let nan = Tensor::full(
            f32::NAN,
            (slots.len(), c.n_kv_heads, c.head_dim),
            self.model.llama.device(),
        )?
        .to_dtype(self.dtype())?;
        for layer in &self.cache {
            write_kv(&layer.k, &nan, slots)?;
            write_kv(&layer.v, &nan, slots)?;
        }
        Ok(())
    }

    /// Gives the pool `blocks` blocks: the first ones are kept (the caller
    /// compacted live blocks below `blocks` first), new ones are zero.
    pub(crate) fn resize(&mut self, blocks: usize) -> Result<()> {
        for layer in &mut self.cache {
            let (now, bs, h, d) = layer.k.dims4()?;
            if blocks < now {
                layer.k = layer.k.narrow(0, 0, blocks)?.copy()?;
                layer.v = layer.v.narrow(0, 0, blocks)?.copy()?;
            } else if blocks > now {
                let extra =
                    Tensor::zeros((blocks - now, bs, h, d), layer.k.dtype(), layer.k.device())?;
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
        other => {
            return Err(EngineError::Invalid(format!(
                "K/V of dtype {other:?} cannot be saved"
            )))
        }
    })
}
