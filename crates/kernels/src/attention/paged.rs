//! `paged_attention`: attention of new query tokens over the K/V cache,
//! reading each sequence's earlier tokens through its block table.
//!
//! ```text
//! token t of sequence s at position p attends to positions lo..=p of s:
//!   lo = 0, or p + 1 - window for a sliding-window layer (p - j < window)
//!   position j -> block table[s][j / bs], offset j % bs -> slot
//! ```
//!
//! The K/V of the new tokens are written to the cache first (`write_kv`), so
//! causality inside a prefill chunk falls out of the position bound. Grouped
//! query attention: query head `h` reads KV head `h / (n_heads / n_kv_heads)`.
//! On the CPU this is the forward's own attention ([`crate::attention::items`]:
//! chunks of context per item, partial softmax states merged), so the
//! reference forward and the fast one share one attention, and
//! [`paged_attention_slow`] (plain candle ops) is its reference; CUDA and
//! Metal have their kernels.

use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::attention::items::{
    attend_item, merge, AttnInput, AttnPlan, AttnScratch, AttnShape, KvRows,
};
use crate::linear::matvec::Isa;
use crate::quant::hadamard64;
use crate::simd::elem::{contiguous, f32_data};
use half::slice::HalfFloatSliceExt;

/// Where each query token's context lives. All ids are plain integers.
#[derive(Debug, Clone, Copy)]
pub struct PagedMeta<'a> {
    pub block_size: usize,
    /// Row-major `[num_seqs, max_blocks]` block ids (unused entries: any value).
    pub block_tables: &'a [u32],
    pub max_blocks: usize,
    /// Sequence index of each query token.
    pub token_seq: &'a [u32],
    /// Position of each query token: it attends to positions `0..=pos`.
    pub token_pos: &'a [u32],
    /// Softmax scale, usually `1 / sqrt(head_dim)`.
    pub scale: f32,
    /// Sliding window: a query at `p` sees keys at `j` with `p - j <
    /// window`; 0 for none (every earlier position).
    pub window: usize,
}

/// The first position a query at `pos` sees with `window` (0: none).
#[inline]
pub fn window_start(pos: usize, window: usize) -> usize {
    if window == 0 {
        0
    } else {
        (pos + 1).saturating_sub(window)
    }
}

struct PagedAttention<'a> {
    meta: PagedMeta<'a>,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

impl PagedAttention<'_> {
    /// The CPU's one attention ([`crate::attention::items`]) over the whole
    /// batch: its plan, its items on rayon's workers (each with its own
    /// scratch), then each query head's chunks merged. A quantized cache
    /// holds Hadamard-rotated rows ([`crate::quant`]): the queries are
    /// rotated as the keys were, and the outputs (sums of rotated values)
    /// rotated back (the transform is its own inverse).
    fn run(&self, q: &[f32], k: KvRows, v: KvRows) -> Vec<f32> {
        let rotated = matches!(k, KvRows::Q8_0(_) | KvRows::Q4_0(_));
        let mut q_rot = Vec::new();
        let q = if rotated {
            q_rot.extend_from_slice(q);
            q_rot.chunks_exact_mut(self.head_dim).for_each(hadamard64);
            &q_rot[..]
        } else {
            q
        };
        let m = &self.meta;
        let shape = AttnShape {
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            block_size: m.block_size,
            scale: m.scale,
            window: m.window,
        };
        let mut plan = AttnPlan::default();
        plan.build(&shape, m.token_seq, m.token_pos);
        let input = AttnInput {
            shape,
            q,
            positions: m.token_pos,
            token_seq: m.token_seq,
            block_tables: m.block_tables,
            max_blocks: m.max_blocks,
            k,
            v,
        };
        let (rec, isa) = (shape.record(), Isa::detect());
        // Each item's partial states: where each goes, and the states.
        let parts: Vec<(Vec<usize>, Vec<f32>)> = plan
            .items
            .par_iter()
            .map_init(AttnScratch::default, |scratch, &item| {
                let (mut at, mut states) = (Vec::new(), Vec::new());
                attend_item(isa, &input, item, scratch, &mut |t, idx, r| {
                    at.push(plan.base[t] + idx);
                    states.extend_from_slice(r);
                });
                (at, states)
            })
            .collect();
        let mut states = vec![0f32; plan.states * rec];
        for (at, part) in &parts {
            for (&i, r) in at.iter().zip(part.chunks_exact(rec)) {
                states[i * rec..(i + 1) * rec].copy_from_slice(r);
            }
        }
        let (nh, hd) = (self.n_heads, self.head_dim);
        let mut out = vec![0f32; q.len()];
        out.par_chunks_mut(hd).enumerate().for_each(|(p, o)| {
            let (t, head) = (p / nh, p % nh);
            let chunks = shape.chunks(m.token_pos[t] as usize).1;
            merge(
                &states[(plan.base[t] + head) * rec..],
                chunks,
                nh * rec,
                hd,
                o,
            );
            if rotated {
                hadamard64(o);
            }
        });
        out
    }
}

impl CustomOp3 for PagedAttention<'_> {
    fn name(&self) -> &'static str {
        "paged_attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let q = f32_data(s1, l1, "queries")?;
        let out = match (s2, s3) {
            (CpuStorage::F32(k), CpuStorage::F32(v)) => self.run(
                q,
                KvRows::F32(contiguous(k, l2, "K cache")?),
                KvRows::F32(contiguous(v, l3, "V cache")?),
            ),
            (CpuStorage::F16(k), CpuStorage::F16(v)) => self.run(
                q,
                KvRows::F16(contiguous(k, l2, "K cache")?.reinterpret_cast()),
                KvRows::F16(contiguous(v, l3, "V cache")?.reinterpret_cast()),
            ),
            (CpuStorage::BF16(k), CpuStorage::BF16(v)) => self.run(
                q,
                KvRows::Bf16(contiguous(k, l2, "K cache")?.reinterpret_cast()),
                KvRows::Bf16(contiguous(v, l3, "V cache")?.reinterpret_cast()),
            ),
            (CpuStorage::U8(k), CpuStorage::U8(v)) => {
                use crate::quant::blocks;
                let (k, v) = (contiguous(k, l2, "K cache")?, contiguous(v, l3, "V cache")?);
                match crate::KvType::of_dims(DType::U8, l2.dims())? {
                    crate::KvType::Q8_0 => {
                        self.run(q, KvRows::Q8_0(blocks(k)), KvRows::Q8_0(blocks(v)))
                    }
                    _ => self.run(q, KvRows::Q4_0(blocks(k)), KvRows::Q4_0(blocks(v))),
                }
            }
            (k, v) => bail!(
                "paged_attention: K/V caches must share an f32/f16/bf16/q8_0/q4_0 dtype, got {:?}/{:?}",
                candle_core::backend::BackendStorage::dtype(k),
                candle_core::backend::BackendStorage::dtype(v)
            ),
        };
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let geometry = (self.n_heads, self.n_kv_heads, self.head_dim);
        crate::gpu::cuda::paged_attention((s1, l1), (s2, l2), (s3, l3), &self.meta, geometry)
    }

    #[cfg(all(feature = "metal", target_vendor = "apple"))]
    fn metal_fwd(
        &self,
        s1: &candle_core::MetalStorage,
        l1: &Layout,
        s2: &candle_core::MetalStorage,
        l2: &Layout,
        s3: &candle_core::MetalStorage,
        l3: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        let geometry = (self.n_heads, self.n_kv_heads, self.head_dim);
        crate::gpu::metal::paged_attention((s1, l1), (s2, l2), (s3, l3), &self.meta, geometry)
    }
}

pub(crate) fn check(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    meta: &PagedMeta,
) -> Result<(usize, usize, usize)> {
    check_dims(q.dims3()?, k_cache, v_cache, meta)
}

/// [`paged_attention`]'s checks for queries of shape `(t, nh, hd)`: the
/// caches agree with each other and the queries, and every block a token
/// reads is inside them. Returns `(nh, kvh, hd)`.
pub(crate) fn check_dims(
    q: (usize, usize, usize),
    k_cache: &Tensor,
    v_cache: &Tensor,
    meta: &PagedMeta,
) -> Result<(usize, usize, usize)> {
    if k_cache.shape() != v_cache.shape() || !v_cache.is_contiguous() {
        bail!(
            "paged_attention: K {:?} and V {:?} caches differ",
            k_cache.shape(),
            v_cache.shape()
        )
    }
    check_geometry(q, crate::cache_geometry(k_cache)?, meta)
}

/// [`check_dims`] for caches of geometry `(blocks, block_size, kv_heads,
/// head_dim)` (K and V alike).
pub(crate) fn check_geometry(
    (t, nh, hd): (usize, usize, usize),
    (nb, bs, kvh, khd): (usize, usize, usize, usize),
    meta: &PagedMeta,
) -> Result<(usize, usize, usize)> {
    if khd != hd || kvh == 0 || nh % kvh != 0 {
        bail!(
            "paged_attention: queries of {nh} heads of {hd} do not fit a cache of {kvh} heads of {khd}"
        )
    }
    if bs != meta.block_size || meta.token_seq.len() != t || meta.token_pos.len() != t {
        bail!(
            "paged_attention: meta for {} tokens, block size {}, but {t} queries and block size {bs}",
            meta.token_seq.len(),
            meta.block_size
        )
    }
    if meta.max_blocks == 0 || !meta.block_tables.len().is_multiple_of(meta.max_blocks) {
        bail!(
            "paged_attention: block tables are not [num_seqs, {}]",
            meta.max_blocks
        )
    }
    let num_seqs = meta.block_tables.len() / meta.max_blocks;
    for (&s, &p) in meta.token_seq.iter().zip(meta.token_pos) {
        let (s, p) = (s as usize, p as usize);
        if s >= num_seqs || p / bs >= meta.max_blocks {
            bail!("paged_attention: token of sequence {s} at position {p} is outside the block tables")
        }
        let lo = window_start(p, meta.window);
        let row = &meta.block_tables[s * meta.max_blocks..][lo / bs..p / bs + 1];
        if let Some(&b) = row.iter().find(|&&b| b as usize >= nb) {
            bail!("paged_attention: block {b} outside the cache of {nb} blocks")
        }
    }
    Ok((nh, kvh, hd))
}

/// Attention output `[tokens, n_heads, head_dim]` (f32) for queries `q`
/// (`[tokens, n_heads, head_dim]`, f32, RoPE applied) over the caches.
pub fn paged_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    meta: &PagedMeta,
) -> Result<Tensor> {
    let (n_heads, n_kv_heads, head_dim) = check(q, k_cache, v_cache, meta)?;
    let q = q.to_dtype(DType::F32)?.contiguous()?;
    let op = PagedAttention {
        meta: *meta,
        n_heads,
        n_kv_heads,
        head_dim,
    };
    q.apply_op3_no_bwd(k_cache, v_cache, &op)
}

/// Reference for [`paged_attention`] in plain candle ops, one token at a
/// time: gather the context rows, repeat KV heads, softmax(q·Kᵀ·scale)·V.
pub fn paged_attention_slow(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    meta: &PagedMeta,
) -> Result<Tensor> {
    let (nh, kvh, hd) = check(q, k_cache, v_cache, meta)?;
    let (nb, bs, _, _) = crate::cache_geometry(k_cache)?;
    let kf = crate::dequantize_cache(k_cache)?.reshape((nb * bs, kvh, hd))?;
    let vf = crate::dequantize_cache(v_cache)?.reshape((nb * bs, kvh, hd))?;
    let head_map = Tensor::new(
        (0..nh as u32)
            .map(|h| h / (nh / kvh) as u32)
            .collect::<Vec<_>>(),
        q.device(),
    )?;
    let mut outs = Vec::new();
    for (t, (&s, &p)) in meta.token_seq.iter().zip(meta.token_pos).enumerate() {
        let table = &meta.block_tables[s as usize * meta.max_blocks..];
        let slots: Vec<u32> = (window_start(p as usize, meta.window)..=p as usize)
            .map(|j| table[j / bs] * bs as u32 + (j % bs) as u32)
            .collect();
        let slots = Tensor::new(slots, q.device())?;
        // [L, kvh, hd] -> [L, nh, hd] -> [nh, L, hd]
        let k = kf
            .index_select(&slots, 0)?
            .index_select(&head_map, 1)?
            .transpose(0, 1)?
            .contiguous()?;
        let v = vf
            .index_select(&slots, 0)?
            .index_select(&head_map, 1)?
            .transpose(0, 1)?
            .contiguous()?;
        let qt = q.get(t)?.to_dtype(DType::F32)?.unsqueeze(1)?; // [nh, 1, hd]
        let scores = (qt.matmul(&k.t()?)? * meta.scale as f64)?; // [nh, 1, L]
        let max = scores.max_keepdim(2)?;
        let e = scores.broadcast_sub(&max)?.exp()?;
        let probs = e.broadcast_div(&e.sum_keepdim(2)?)?;
        outs.push(probs.matmul(&v)?.squeeze(1)?); // [nh, hd]
    }
    Tensor::stack(&outs, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{max_abs_diff, seeded};

    /// Two sequences with scattered blocks: a 3-token prefill chunk of one
    /// (positions 9..=11) and a decode token of the other (position 20).
    #[test]
    fn matches_reference_with_gqa_and_scattered_blocks() -> Result<()> {
        let (nb, bs, kvh, nh, hd) = (12, 4, 2, 6, 16);
        let tables = [7u32, 2, 9, 0, 0, 0, 1, 11, 3, 5, 8, 4];
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let k = seeded(&[nb, bs, kvh, hd], 3, dtype)?;
            let v = seeded(&[nb, bs, kvh, hd], 4, dtype)?;
            let q = seeded(&[4, nh, hd], 5, DType::F32)?;
            let meta = PagedMeta {
                block_size: bs,
                block_tables: &tables,
                max_blocks: 6,
                token_seq: &[0, 0, 0, 1],
                token_pos: &[9, 10, 11, 20],
                scale: 1.0 / (hd as f32).sqrt(),
                window: 0,
            };
            let fast = paged_attention(&q, &k, &v, &meta)?;
            let slow = paged_attention_slow(&q, &k, &v, &meta)?;
            // Both accumulate in f32 over the same f32-converted inputs; they
            // differ only in summation order (1e-5 is ~100 ulps at these
            // magnitudes).
            let d = max_abs_diff(&fast, &slow)?;
            assert!(d < 1e-5, "{dtype:?}: max diff {d}");
        }
        Ok(())
    }

    /// The register-blocked path (blocks of 16, heads of 64): a prefill
    /// chunk crossing block boundaries, a tile longer than 16 tokens, and a
    /// decode token of a second sequence.
    #[test]
    fn fixed_geometry_path_matches_reference() -> Result<()> {
        let (nb, bs, kvh, nh, hd) = (10, 16, 3, 9, 64);
        let tables: Vec<u32> = vec![4, 1, 7, 2, 9, 3, 0, 5, 8, 6];
        let mut seqs = vec![0u32; 21];
        seqs.push(1);
        let mut pos: Vec<u32> = (30..51).collect();
        pos.push(70);
        for dtype in crate::KvType::ALL {
            let k = crate::testing::seeded_cache(&[nb, bs, kvh, hd], 13, dtype)?;
            let v = crate::testing::seeded_cache(&[nb, bs, kvh, hd], 14, dtype)?;
            let q = seeded(&[seqs.len(), nh, hd], 15, DType::F32)?;
            let meta = PagedMeta {
                block_size: bs,
                block_tables: &tables,
                max_blocks: 5,
                token_seq: &seqs,
                token_pos: &pos,
                scale: 1.0 / (hd as f32).sqrt(),
                window: 0,
            };
            let fast = paged_attention(&q, &k, &v, &meta)?;
            let slow = paged_attention_slow(&q, &k, &v, &meta)?;
            let d = max_abs_diff(&fast, &slow)?;
            assert!(d < 1e-5, "{dtype:?}: max diff {d}");
        }
        Ok(())
    }

    /// Sliding windows shorter than, equal to and longer than a block,
    /// cutting blocks in the middle, on both paths (any geometry and the
    /// register-blocked one), against the reference, which gathers only
    /// the window's positions. The blocks before every window are ids
    /// outside the cache: nothing may read them.
    #[test]
    fn sliding_windows_match_reference() -> Result<()> {
        for (bs, hd) in [(4, 16), (16, 64)] {
            let (nb, kvh, nh) = (12, 2, 4);
            let k = seeded(&[nb, bs, kvh, hd], 23, DType::F16)?;
            let v = seeded(&[nb, bs, kvh, hd], 24, DType::F16)?;
            // Sequence 0: a prefill chunk deep in the context; sequence 1:
            // one decode token.
            let pos0: Vec<u32> = (5 * bs as u32 - 3..5 * bs as u32 + bs.min(14) as u32).collect();
            let mut seqs = vec![0u32; pos0.len()];
            seqs.push(1);
            let mut pos = pos0.clone();
            pos.push(6 * bs as u32 + 1);
            let q = seeded(&[pos.len(), nh, hd], 25, DType::F32)?;
            for window in [1, 3, bs, bs + 5, 3 * bs] {
                let mut tables = vec![0u32; 14];
                for (i, b) in [7u32, 2, 9, 0, 1, 11, 3].iter().enumerate() {
                    tables[i] = *b;
                    tables[7 + i] = (*b + 4) % nb as u32;
                }
                // Blocks wholly before the earliest window: invalid ids.
                let first = (5 * bs - 3 + 1).saturating_sub(window) / bs;
                tables[..first].fill(999);
                let first1 = (6 * bs + 2).saturating_sub(window) / bs;
                tables[7..7 + first1].fill(999);
                let meta = PagedMeta {
                    block_size: bs,
                    block_tables: &tables,
                    max_blocks: 7,
                    token_seq: &seqs,
                    token_pos: &pos,
                    scale: 1.0 / (hd as f32).sqrt(),
                    window,
                };
                let fast = paged_attention(&q, &k, &v, &meta)?;
                let slow = paged_attention_slow(&q, &k, &v, &meta)?;
                let d = max_abs_diff(&fast, &slow)?;
                assert!(d < 1e-5, "bs={bs} window={window}: max diff {d}");
            }
            // A window of one is the token's own value.
            let meta = PagedMeta {
                block_size: bs,
                block_tables: &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 0],
                max_blocks: 7,
                token_seq: &seqs,
                token_pos: &pos,
                scale: 1.0,
                window: 1,
            };
            let out = paged_attention(&q, &k, &v, &meta)?;
            let p = pos[0] as usize;
            let want = v
                .reshape((nb * bs, kvh, hd))?
                .get(p)?
                .get(0)?
                .to_dtype(DType::F32)?;
            let d = max_abs_diff(&out.get(0)?.get(0)?, &want)?;
            assert!(d < 1e-6, "window of one: {d}");
        }
        Ok(())
    }

    #[test]
    fn rejects_inconsistent_meta() -> Result<()> {
        let k = seeded(&[4, 4, 1, 8], 3, DType::F32)?;
        let q = seeded(&[1, 2, 8], 5, DType::F32)?;
        let meta = |pos: &'static [u32], tables: &'static [u32]| PagedMeta {
            block_size: 4,
            block_tables: tables,
            max_blocks: 2,
            token_seq: &[0],
            token_pos: pos,
            scale: 1.0,
            window: 0,
        };
        assert!(paged_attention(&q, &k, &k, &meta(&[3], &[0, 1])).is_ok());
        assert!(paged_attention(&q, &k, &k, &meta(&[8], &[0, 1])).is_err());
        assert!(paged_attention(&q, &k, &k, &meta(&[5], &[0, 9])).is_err());
        Ok(())
    }
}
