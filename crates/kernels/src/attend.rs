//! Attention of a forward pass's queries over the paged cache, split into
//! work items a team of workers takes from a counter, on raw cache rows.
//!
//! The context of every query is cut into fixed chunks of [`CHUNK`]
//! positions. An item is (a run of ≤ 16 consecutive query tokens of one
//! sequence, one KV head, one chunk): it converts the chunk's K/V rows to
//! f32 once (f16 and bf16 inline) for all those tokens and all query heads
//! of the group, and leaves one partial softmax state per (token, head,
//! chunk): `(Σ p·v, max, Σ p)`. [`merge`] combines a query's chunks in
//! chunk order by their log-sum-exp weights. A long context thus gives a
//! single decoding sequence many items (one per KV head and chunk), and
//! the arithmetic of a query depends only on its position and its keys:
//! not on the tile, the batch, the chunk boundaries of the prefill or the
//! worker, so results are bit-identical across all of them.
//!
//! ```text
//! chunk c of a query at position p: positions c·CHUNK .. min(p + 1, (c + 1)·CHUNK)
//!   s_i = dot(q, k_i) · scale,  m = max s,  p_i = e^(s_i − m)
//!   state = (Σ p_i v_i (in order of i), m, Σ p_i)
//! merge: M = max m_c,  w_c = e^(m_c − M),  out = Σ w_c acc_c / Σ w_c l_c
//! ```

// Lane loops index several arrays in step.
#![allow(clippy::needless_range_loop)]

use crate::attention::exp_nonpositive;
use crate::matvec::{f16_to_f32, Isa};

/// Positions per chunk of context.
pub const CHUNK: usize = 128;
/// Most query tokens of one sequence in one item.
const TILE: usize = 16;

/// One layer's K or V cache, flat `[slots, n_kv_heads, head_dim]`.
#[derive(Debug, Clone, Copy)]
pub enum KvRows<'a> {
    F32(&'a [f32]),
    F16(&'a [u16]),
    Bf16(&'a [u16]),
}

impl KvRows<'_> {
    #[inline(always)]
    fn load(&self, at: usize, out: &mut [f32]) {
        match self {
            KvRows::F32(v) => out.copy_from_slice(&v[at..at + out.len()]),
            KvRows::F16(v) => {
                let n = out.len();
                for (o, &h) in out.iter_mut().zip(&v[at..at + n]) {
                    *o = f16_to_f32(h);
                }
            }
            KvRows::Bf16(v) => {
                let n = out.len();
                for (o, &h) in out.iter_mut().zip(&v[at..at + n]) {
                    *o = f32::from_bits(u32::from(h) << 16);
                }
            }
        }
    }
}

/// Geometry of the attention.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub scale: f32,
}

impl AttnShape {
    /// Floats of one partial state: `head_dim` sums, the max, the total.
    pub fn record(&self) -> usize {
        self.head_dim + 2
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Item {
    pub t0: u32,
    pub nt: u32,
    pub g: u32,
    pub chunk: u32,
}

/// The items of a batch and where each token's partial states go.
#[derive(Debug, Default)]
pub struct AttnPlan {
    pub items: Vec<Item>,
    /// Per token: index of its first partial state (then `chunk · n_heads
    /// + head`).
    pub base: Vec<usize>,
    /// Partial states in all.
    pub states: usize,
}

impl AttnPlan {
    /// Plans `token_seq`/`positions` (one entry per query token; tokens of
    /// a sequence consecutive). Reuses its vectors.
    pub fn build(&mut self, shape: &AttnShape, token_seq: &[u32], positions: &[u32]) {
        self.items.clear();
        self.base.clear();
        let mut states = 0;
        for &p in positions {
            self.base.push(states);
            states += (p as usize / CHUNK + 1) * shape.n_heads;
        }
        self.states = states;
        let mut t = 0;
        while t < token_seq.len() {
            let mut n = 1;
            while t + n < token_seq.len() && n < TILE && token_seq[t + n] == token_seq[t] {
                n += 1;
            }
            let last = positions[t..t + n].iter().max().copied().unwrap_or(0) as usize;
            for c in 0..=last / CHUNK {
                for g in 0..shape.n_kv_heads {
                    self.items.push(Item {
                        t0: t as u32,
                        nt: n as u32,
                        g: g as u32,
                        chunk: c as u32,
                    });
                }
            }
            t += n;
        }
    }
}

/// A worker's buffers for [`attend_item`].
#[derive(Debug, Default)]
pub struct AttnScratch {
    k: Vec<f32>,
    v: Vec<f32>,
    s: Vec<f32>,
    rec: Vec<f32>,
}

/// Everything an item reads.
#[derive(Clone, Copy)]
pub struct AttnInput<'a> {
    pub shape: AttnShape,
    /// `[T, n_heads, head_dim]`, RoPE applied.
    pub q: &'a [f32],
    pub positions: &'a [u32],
    pub token_seq: &'a [u32],
    /// Row-major `[num_seqs, max_blocks]`.
    pub block_tables: &'a [u32],
    pub max_blocks: usize,
    pub k: KvRows<'a>,
    pub v: KvRows<'a>,
}

/// The fixed 16-lane tree of [`crate::matvec`]'s reduction.
#[inline(always)]
fn reduce16(v: &[f32; 16]) -> f32 {
    let mut v8 = [0f32; 8];
    for j in 0..8 {
        v8[j] = v[j] + v[j + 8];
    }
    let mut v4 = [0f32; 4];
    for j in 0..4 {
        v4[j] = v8[j] + v8[j + 4];
    }
    (v4[0] + v4[2]) + (v4[1] + v4[3])
}

/// `Σ a·b`: 16 lanes of fused sums, the fixed tree, then the rest in order.
#[inline(always)]
fn dot16(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..16 {
            acc[j] = x[j].mul_add(y[j], acc[j]);
        }
    }
    let mut tail = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail = x.mul_add(*y, tail);
    }
    reduce16(&acc) + tail
}

#[inline(always)]
fn sum16(a: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let c = a.chunks_exact(16);
    let rest: f32 = c.remainder().iter().fold(0.0, |s, &x| s + x);
    for x in c {
        for j in 0..16 {
            acc[j] += x[j];
        }
    }
    reduce16(&acc) + rest
}

#[inline(always)]
fn item_body(
    inp: &AttnInput,
    item: Item,
    sc: &mut AttnScratch,
    write: &mut dyn FnMut(usize, usize, &[f32]),
) {
    let sh = inp.shape;
    let (nh, kvh, hd, bs) = (sh.n_heads, sh.n_kv_heads, sh.head_dim, sh.block_size);
    let group = nh / kvh;
    let (t0, nt, g, c) = (
        item.t0 as usize,
        item.nt as usize,
        item.g as usize,
        item.chunk as usize,
    );
    let seq = inp.token_seq[t0] as usize;
    let table = &inp.block_tables[seq * inp.max_blocks..(seq + 1) * inp.max_blocks];
    let start = c * CHUNK;
    let last = inp.positions[t0..t0 + nt]
        .iter()
        .max()
        .copied()
        .unwrap_or(0) as usize;
    let n_max = (last + 1).min(start + CHUNK) - start;
    sc.k.resize(CHUNK * hd, 0.0);
    sc.v.resize(CHUNK * hd, 0.0);
    sc.s.resize(CHUNK, 0.0);
    for i in 0..n_max {
        let p = start + i;
        let slot = table[p / bs] as usize * bs + p % bs;
        let at = (slot * kvh + g) * hd;
        inp.k.load(at, &mut sc.k[i * hd..(i + 1) * hd]);
        inp.v.load(at, &mut sc.v[i * hd..(i + 1) * hd]);
    }
    sc.rec.resize(hd + 2, 0.0);
    let rec = &mut sc.rec;
    for ti in 0..nt {
        let t = t0 + ti;
        let pos = inp.positions[t] as usize;
        if pos < start {
            continue;
        }
        let n = (pos + 1).min(start + CHUNK) - start;
        for h in 0..group {
            let head = g * group + h;
            let q = &inp.q[(t * nh + head) * hd..(t * nh + head + 1) * hd];
            let s = &mut sc.s[..n];
            let mut mx = f32::NEG_INFINITY;
            for (i, si) in s.iter_mut().enumerate() {
                *si = dot16(q, &sc.k[i * hd..(i + 1) * hd]) * sh.scale;
                mx = mx.max(*si);
            }
            for si in s.iter_mut() {
                *si = exp_nonpositive(*si - mx);
            }
            let l = sum16(s);
            let acc = &mut rec[..hd];
            acc.fill(0.0);
            for (i, &p) in s.iter().enumerate() {
                let v = &sc.v[i * hd..(i + 1) * hd];
                for (a, &vv) in acc.iter_mut().zip(v) {
                    *a = p.mul_add(vv, *a);
                }
            }
            rec[hd] = mx;
            rec[hd + 1] = l;
            write(t, c * nh + head, rec);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn item_avx512(
    inp: &AttnInput,
    item: Item,
    sc: &mut AttnScratch,
    write: &mut dyn FnMut(usize, usize, &[f32]),
) {
    item_body(inp, item, sc, write)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn item_avx2(
    inp: &AttnInput,
    item: Item,
    sc: &mut AttnScratch,
    write: &mut dyn FnMut(usize, usize, &[f32]),
) {
    item_body(inp, item, sc, write)
}

/// Computes one item; `write(token, index, state)` receives each partial
/// state (`index = chunk · n_heads + head`, the offset from the token's
/// `base`).
pub fn attend_item(
    isa: Isa,
    inp: &AttnInput,
    item: Item,
    sc: &mut AttnScratch,
    write: &mut dyn FnMut(usize, usize, &[f32]),
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa` values above Portable come from CPU detection.
        Isa::Avx512 => unsafe { item_avx512(inp, item, sc, write) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { item_avx2(inp, item, sc, write) },
        _ => item_body(inp, item, sc, write),
    }
}

/// Combines the `chunks` partial states of one query head (each
/// `head_dim + 2` floats, `stride` apart) into `out`.
pub fn merge(states: &[f32], chunks: usize, stride: usize, hd: usize, out: &mut [f32]) {
    let rec = |c: usize| &states[c * stride..c * stride + hd + 2];
    let mut m = f32::NEG_INFINITY;
    for c in 0..chunks {
        m = m.max(rec(c)[hd]);
    }
    let mut l = 0f32;
    out[..hd].fill(0.0);
    for c in 0..chunks {
        let r = rec(c);
        let w = exp_nonpositive(r[hd] - m);
        l += w * r[hd + 1];
        for (o, &a) in out[..hd].iter_mut().zip(&r[..hd]) {
            *o += w * a;
        }
    }
    let inv = 1.0 / l;
    out[..hd].iter_mut().for_each(|o| *o *= inv);
}
