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
//! Scores use an online softmax per block with f32 accumulation, whatever the
//! cache dtype.

use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::simd;
use crate::simd::elem::{contiguous, f32_data, KvElem};

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

/// Most query tokens of one sequence that share one pass over its cache.
const QUERY_TILE: usize = 16;

impl PagedAttention<'_> {
    /// Runs of consecutive tokens of the same sequence, at most
    /// [`QUERY_TILE`] long: `(first token, count)`.
    fn tiles(&self) -> Vec<(usize, usize)> {
        let seqs = self.meta.token_seq;
        let mut tiles = Vec::new();
        let mut t = 0;
        while t < seqs.len() {
            let mut n = 1;
            while t + n < seqs.len() && n < QUERY_TILE && seqs[t + n] == seqs[t] {
                n += 1;
            }
            tiles.push((t, n));
            t += n;
        }
        tiles
    }

    fn run<T: KvElem>(&self, q: &[f32], k: &[T], v: &[T]) -> Vec<f32> {
        let (nh, kvh, hd) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let group = nh / kvh;
        let bs = self.meta.block_size;
        let m = &self.meta;
        let tiles = self.tiles();
        // One task per (tile of query tokens, KV head): each cached row is
        // converted to f32 once for every query token of the tile and every
        // query head sharing the KV head.
        let results: Vec<Vec<f32>> = (0..tiles.len() * kvh)
            .into_par_iter()
            .map_init(
                || (vec![0f32; bs * hd], vec![0f32; bs * hd], vec![0f32; bs]),
                |(kbuf, vbuf, scores), task| {
                    let job = Tile {
                        tile: tiles[task / kvh],
                        g: task % kvh,
                        group,
                        nh,
                        kvh,
                        hd,
                    };
                    // Transposing a block's keys pays off over several
                    // query tokens, not for one decode token.
                    let fixed = bs == FIXED_BS && hd == FIXED_HD && job.tile.1 > 1;
                    #[cfg(target_arch = "x86_64")]
                    if simd::has_avx2_fma() {
                        // SAFETY: the CPU supports AVX2 and FMA (checked).
                        return unsafe {
                            if fixed {
                                attend_fixed_avx2(m, &job, q, k, v, kbuf, vbuf)
                            } else {
                                attend_tile_avx2(m, &job, q, k, v, kbuf, vbuf, scores)
                            }
                        };
                    }
                    if fixed {
                        attend_fixed::<T, false>(m, &job, q, k, v, kbuf, vbuf)
                    } else {
                        attend_tile::<T, false>(m, &job, q, k, v, kbuf, vbuf, scores)
                    }
                },
            )
            .collect();
        let mut out = vec![0f32; q.len()];
        for (task, acc) in results.iter().enumerate() {
            let ((t0, nt), g) = (tiles[task / kvh], task % kvh);
            for ti in 0..nt {
                let dst = ((t0 + ti) * nh + g * group) * hd;
                out[dst..dst + group * hd]
                    .copy_from_slice(&acc[ti * group * hd..(ti + 1) * group * hd]);
            }
        }
        out
    }
}

/// One task: a tile of query tokens of one sequence and one KV head.
struct Tile {
    /// First token and number of tokens.
    tile: (usize, usize),
    g: usize,
    group: usize,
    nh: usize,
    kvh: usize,
    hd: usize,
}

/// How one path of the attention treats a loaded block: what it prepares
/// from the block's keys, and how one query row attends to the block's
/// positions `from..n` (updating the row's output, running max and sum).
trait BlockKernel {
    fn prepare(&mut self, loaded: usize, kbuf: &[f32]);
    #[allow(clippy::too_many_arguments)]
    fn row(
        &mut self,
        qh: &[f32],
        span: (usize, usize),
        kbuf: &[f32],
        vbuf: &[f32],
        acc: &mut [f32],
        mx: &mut f32,
        l: &mut f32,
    );
}

/// Online-softmax attention of a tile's queries over their context, block
/// by block; each cached row is converted to f32 once for the whole tile,
/// and `kernel` does the per-block arithmetic.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn walk_tile<T: KvElem, K: BlockKernel>(
    m: &PagedMeta,
    job: &Tile,
    q: &[f32],
    k: &[T],
    v: &[T],
    kbuf: &mut [f32],
    vbuf: &mut [f32],
    kernel: &mut K,
) -> Vec<f32> {
    let Tile {
        tile: (t0, nt),
        g,
        group,
        nh,
        kvh,
        hd,
    } = *job;
    let bs = m.block_size;
    let seq = m.token_seq[t0] as usize;
    let table = &m.block_tables[seq * m.max_blocks..(seq + 1) * m.max_blocks];
    let rows = nt * group;
    let mut acc = vec![0f32; rows * hd];
    let mut mx = vec![f32::NEG_INFINITY; rows];
    let mut l = vec![0f32; rows];
    let last = (t0..t0 + nt)
        .map(|t| m.token_pos[t] as usize)
        .max()
        .unwrap_or(0);
    let first = (t0..t0 + nt)
        .map(|t| window_start(m.token_pos[t] as usize, m.window))
        .min()
        .unwrap_or(0);
    for (j, &b) in table
        .iter()
        .enumerate()
        .take(last / bs + 1)
        .skip(first / bs)
    {
        let loaded = bs.min(last + 1 - j * bs);
        for o in 0..loaded {
            let row = ((b as usize * bs + o) * kvh + g) * hd;
            let (a, b) = (row / T::PER, (row + hd) / T::PER);
            T::load(&k[a..b], &mut kbuf[o * hd..(o + 1) * hd]);
            T::load(&v[a..b], &mut vbuf[o * hd..(o + 1) * hd]);
        }
        kernel.prepare(loaded, kbuf);
        for ti in 0..nt {
            let t = t0 + ti;
            let pos = m.token_pos[t] as usize;
            let lo = window_start(pos, m.window);
            if pos < j * bs || lo >= (j + 1) * bs {
                continue;
            }
            let n = bs.min(pos + 1 - j * bs);
            let from = lo.saturating_sub(j * bs);
            for h in 0..group {
                let r = ti * group + h;
                let qh = &q[(t * nh + g * group + h) * hd..][..hd];
                let out = &mut acc[r * hd..(r + 1) * hd];
                kernel.row(qh, (from, n), kbuf, vbuf, out, &mut mx[r], &mut l[r]);
            }
        }
    }
    for (r, a) in acc.chunks_mut(hd).enumerate() {
        let inv = 1.0 / l[r];
        a.iter_mut().for_each(|x| *x *= inv);
    }
    acc
}

/// Any block size and head dimension: one dot per key, one axpy per value.
struct AnyGeometry<'a, const FMA: bool> {
    scores: &'a mut [f32],
    scale: f32,
}

impl<const FMA: bool> BlockKernel for AnyGeometry<'_, FMA> {
    #[inline(always)]
    fn prepare(&mut self, _loaded: usize, _kbuf: &[f32]) {}

    #[inline(always)]
    fn row(
        &mut self,
        qh: &[f32],
        (from, n): (usize, usize),
        kbuf: &[f32],
        vbuf: &[f32],
        acc: &mut [f32],
        mx: &mut f32,
        l: &mut f32,
    ) {
        let hd = qh.len();
        let (kbuf, vbuf) = (&kbuf[from * hd..], &vbuf[from * hd..]);
        let scores = &mut self.scores[..n - from];
        let mut best = f32::NEG_INFINITY;
        for (i, s) in scores.iter_mut().enumerate() {
            *s = simd::dot::<FMA>(qh, &kbuf[i * hd..(i + 1) * hd]) * self.scale;
            best = best.max(*s);
        }
        let new_max = mx.max(best);
        let correction = (*mx - new_max).exp();
        if correction != 1.0 {
            acc.iter_mut().for_each(|a| *a *= correction);
        }
        *l *= correction;
        for s in scores.iter_mut() {
            *s = exp_nonpositive(*s - new_max);
        }
        *l += scores.iter().sum::<f32>();
        for (i, &p) in scores.iter().enumerate() {
            simd::axpy::<FMA>(p, &vbuf[i * hd..(i + 1) * hd], acc);
        }
        *mx = new_max;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_tile_avx2<T: KvElem>(
    m: &PagedMeta,
    job: &Tile,
    q: &[f32],
    k: &[T],
    v: &[T],
    kbuf: &mut [f32],
    vbuf: &mut [f32],
    scores: &mut [f32],
) -> Vec<f32> {
    attend_tile::<T, true>(m, job, q, k, v, kbuf, vbuf, scores)
}

/// [`walk_tile`] with [`AnyGeometry`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_tile<T: KvElem, const FMA: bool>(
    m: &PagedMeta,
    job: &Tile,
    q: &[f32],
    k: &[T],
    v: &[T],
    kbuf: &mut [f32],
    vbuf: &mut [f32],
    scores: &mut [f32],
) -> Vec<f32> {
    let mut kernel = AnyGeometry::<FMA> {
        scores,
        scale: m.scale,
    };
    walk_tile(m, job, q, k, v, kbuf, vbuf, &mut kernel)
}

/// Block size and head dimension of the register-blocked path (the
/// defaults: 16-token blocks, 64-dim heads as in SmolLM2 and Llama 3.2 1B).
const FIXED_BS: usize = 16;
const FIXED_HD: usize = 64;

/// 16-token blocks and 64-dim heads, in fixed-size arrays the compiler
/// keeps in vector registers: the block's keys are transposed once per tile
/// so that one query's 16 scores accumulate together over the head
/// dimension (no horizontal sums), and a row's output accumulates over the
/// block's 16 values before it is stored.
struct Fixed<const FMA: bool> {
    /// Transposed keys of the block: `kt[d][i]`.
    kt: [[f32; FIXED_BS]; FIXED_HD],
    scale: f32,
}

impl<const FMA: bool> BlockKernel for Fixed<FMA> {
    #[inline(always)]
    fn prepare(&mut self, loaded: usize, kbuf: &[f32]) {
        for (d, col) in self.kt.iter_mut().enumerate() {
            for (i, c) in col.iter_mut().enumerate() {
                *c = if i < loaded {
                    kbuf[i * FIXED_HD + d]
                } else {
                    0.0
                };
            }
        }
    }

    #[inline(always)]
    fn row(
        &mut self,
        qh: &[f32],
        (from, n): (usize, usize),
        _kbuf: &[f32],
        vbuf: &[f32],
        acc: &mut [f32],
        mx: &mut f32,
        l: &mut f32,
    ) {
        const BS: usize = FIXED_BS;
        const HD: usize = FIXED_HD;
        let qh: &[f32; HD] = qh.try_into().expect("HD values");
        let mut sc = [0f32; BS];
        for (d, col) in self.kt.iter().enumerate() {
            let qd = qh[d];
            for i in 0..BS {
                sc[i] = simd::madd::<FMA>(sc[i], qd, col[i]);
            }
        }
        let mut best = f32::NEG_INFINITY;
        for (i, x) in sc.iter_mut().enumerate() {
            *x = if (from..n).contains(&i) {
                *x * self.scale
            } else {
                f32::NEG_INFINITY
            };
            best = best.max(*x);
        }
        let new_max = mx.max(best);
        let correction = (*mx - new_max).exp();
        for x in sc.iter_mut() {
            *x = exp_nonpositive(*x - new_max);
        }
        // Positions before the window weigh nothing.
        sc[..from].fill(0.0);
        *l = *l * correction + sc.iter().sum::<f32>();
        let out: &mut [f32; HD] = acc.try_into().expect("HD values");
        let mut o = [0f32; HD];
        for d in 0..HD {
            o[d] = out[d] * correction;
        }
        for (i, &p) in sc.iter().enumerate().take(n).skip(from) {
            let vi: &[f32; HD] = vbuf[i * HD..(i + 1) * HD].try_into().expect("HD values");
            for d in 0..HD {
                o[d] = simd::madd::<FMA>(o[d], p, vi[d]);
            }
        }
        *out = o;
        *mx = new_max;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_fixed_avx2<T: KvElem>(
    m: &PagedMeta,
    job: &Tile,
    q: &[f32],
    k: &[T],
    v: &[T],
    kbuf: &mut [f32],
    vbuf: &mut [f32],
) -> Vec<f32> {
    attend_fixed::<T, true>(m, job, q, k, v, kbuf, vbuf)
}

/// [`walk_tile`] with [`Fixed`].
#[inline(always)]
fn attend_fixed<T: KvElem, const FMA: bool>(
    m: &PagedMeta,
    job: &Tile,
    q: &[f32],
    k: &[T],
    v: &[T],
    kbuf: &mut [f32],
    vbuf: &mut [f32],
) -> Vec<f32> {
    let mut kernel = Fixed::<FMA> {
        kt: [[0f32; FIXED_BS]; FIXED_HD],
        scale: m.scale,
    };
    walk_tile(m, job, q, k, v, kbuf, vbuf, &mut kernel)
}

/// `e^x` for `x <= 0` (softmax weights, sigmoids), within 2 ulp of `f32::exp`, in
/// straight-line arithmetic the compiler vectorizes: `x = n·ln2 + r` with
/// `|r| <= ln2/2`, a degree-6 polynomial for `e^r`, and `2^n` put into the
/// exponent bits. Below -87 the result is 0.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = x.max(-87.0);
    // Round to nearest, ties to even, by the 1.5·2^23 trick (exact for
    // |x·log2 e| < 2^22, here at most 126): no library call anywhere.
    const MAGIC: f32 = 12_582_912.0;
    let t = x * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (0.166_666_67
                    + r * (0.041_666_668 + r * (0.008_333_334 + r * 0.001_388_889)))));
    // `2^n` from the bits of `t` = 1.5·2^23 + n (spacing 1 there, so its
    // low bits hold n exactly): integer steps that vectorize, where `n as
    // i32` (a saturating conversion) is done one lane at a time.
    let scale = f32::from_bits(t.to_bits().wrapping_sub(MAGIC.to_bits() - 127) << 23);
    p * scale
}

#[cfg(test)]
#[test]
fn fast_exp_matches_std_exp() {
    let mut worst = 0f32;
    for i in 0..=200_000 {
        let x = -(i as f32) * 87.0 / 200_000.0;
        let (a, b) = (exp_nonpositive(x), x.exp());
        worst = worst.max((a - b).abs() / b.max(f32::MIN_POSITIVE));
    }
    assert!(worst < 3e-7, "relative error {worst}");
    // The exponent taken from the rounding sum's bits is `n as i32`: every
    // integer n the clamp allows, and the halfway points between them.
    for i in 0..=2 * 126 {
        let x = (-(i as f32) / 2.0 / std::f32::consts::LOG2_E).max(-87.0);
        let t = x * std::f32::consts::LOG2_E + 12_582_912.0;
        let n = (t - 12_582_912.0) as i32;
        assert_eq!(t.to_bits().wrapping_sub(0x4B40_0000) as i32, n, "at {x}");
        assert!((-126..=0).contains(&n), "{n} at {x}");
    }
    assert_eq!(exp_nonpositive(0.0), 1.0);
    assert_eq!(exp_nonpositive(-1000.0), exp_nonpositive(-87.0));
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
                contiguous(k, l2, "K cache")?,
                contiguous(v, l3, "V cache")?,
            ),
            (CpuStorage::F16(k), CpuStorage::F16(v)) => self.run(
                q,
                contiguous(k, l2, "K cache")?,
                contiguous(v, l3, "V cache")?,
            ),
            (CpuStorage::BF16(k), CpuStorage::BF16(v)) => self.run(
                q,
                contiguous(k, l2, "K cache")?,
                contiguous(v, l3, "V cache")?,
            ),
            (CpuStorage::U8(k), CpuStorage::U8(v)) => {
                let (k, v) = (contiguous(k, l2, "K cache")?, contiguous(v, l3, "V cache")?);
                match crate::KvType::of_dims(DType::U8, l2.dims())? {
                    crate::KvType::Q8_0 => {
                        use crate::quant::{blocks, BlockQ8_0};
                        self.run(q, blocks::<BlockQ8_0>(k), blocks::<BlockQ8_0>(v))
                    }
                    _ => {
                        use crate::quant::{blocks, BlockQ4_0};
                        self.run(q, blocks::<BlockQ4_0>(k), blocks::<BlockQ4_0>(v))
                    }
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

fn check(
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
