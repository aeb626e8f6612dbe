//! Attention of a forward pass's queries over the paged cache, split into
//! work items a team of workers takes in turn, on raw cache rows.
//!
//! The context of every query is cut into fixed chunks of [`CHUNK`]
//! positions. An item is (a run of ≤ 16 consecutive query tokens of one
//! sequence, one KV head, one chunk): it converts the chunk's K/V rows to
//! f32 once (f16 and bf16 inline) for all those tokens and all query heads
//! of the group, and leaves one partial softmax state per (token, head,
//! chunk): `(Σ p·v, max, Σ p)`. An item of a single token (a decoding
//! sequence) makes no copy of the chunk: it converts sixteen K rows at a
//! time into L1 (whole slots in address order where its KV heads fit) and
//! each V row in registers, once for all the query heads of the group,
//! hinting the rows it reads next a little at a time. Scores are formed
//! sixteen keys at a time and their sixteen-lane sums reduced together
//! (the same tree per key, by shuffles); values two query heads at a time
//! (eight chains of fused sums). [`merge`] combines a query's chunks in
//! chunk order by their log-sum-exp weights. A long context thus gives a
//! single decoding sequence many items (one per KV head and chunk), and
//! the arithmetic of a query depends only on its position and its keys:
//! not on the tile, the batch, the chunk boundaries of the prefill or the
//! worker, so results are bit-identical across all of them.
//!
//! ```text
//! chunk c of a query at position p: positions max(c·CHUNK, lo) .. min(p + 1, (c + 1)·CHUNK)
//!   lo = 0, or p + 1 − window on a sliding-window layer; chunks wholly
//!   before lo are skipped (a query has chunks lo/CHUNK ..= p/CHUNK)
//!   s_i = dot(q, k_i) · scale,  m = max s,  p_i = e^(s_i − m)
//!   state = (Σ p_i v_i (in order of i), m, Σ p_i)
//! merge: M = max m_c,  w_c = e^(m_c − M),  out = Σ w_c acc_c / Σ w_c l_c
//! ```

// Lane loops index several arrays in step.
#![allow(clippy::needless_range_loop)]

use crate::attention::paged::window_start;
use crate::linear::matvec::{f16_to_f32, Isa};
use crate::quant::{BlockQ4_0, BlockQ8_0, QBlock, QK};
use crate::simd::exp_nonpositive;
#[cfg(target_arch = "x86_64")]
use crate::simd::lanes::x86;
use crate::simd::lanes::{reduce16, Lanes, Portable};

/// Positions per chunk of context.
pub const CHUNK: usize = 128;
/// Rows a decoding item prefetches ahead of the row it reads: one row's
/// hints per row read (in shares, see [`heads_one`]), not sixteen rows'
/// in a burst, and the keys' pass runs on into the first value rows
/// (the best measured of 8, 16, 24 and 32).
const AHEAD: usize = 16;
/// Chunks of context from which a decoding item covers all KV heads.
const WIDE: usize = 4;
/// Decoding sequences in one batch from which each one's items cover all
/// KV heads, however short its context: the batch gives every worker items
/// anyway, and whole slots in address order stream where one head's rows,
/// a third of every slot's bytes, stall on each load (SmolLM2 Q4_1 on an
/// AMD EPYC, 8 sequences decoding together: attention 14% of the step's
/// samples with an item per head, 9% with an item per slot; alternating
/// runs, 4 together 695–720 → 780 tok/s, 8 together 800–834 → 831–890).
const WIDE_BATCH: usize = 4;
/// Most query tokens of one sequence in one item.
const TILE: usize = 16;

/// One layer's K or V cache, flat `[slots, n_kv_heads, head_dim]`.
#[derive(Debug, Clone, Copy)]
pub enum KvRows<'a> {
    F32(&'a [f32]),
    F16(&'a [u16]),
    Bf16(&'a [u16]),
    /// Quantized blocks of 32 values (offsets below are still in values).
    Q8_0(&'a [BlockQ8_0]),
    Q4_0(&'a [BlockQ4_0]),
}

impl KvRows<'_> {
    /// [`KvRows::load`], f16 sixteen values at a time by `L`'s conversion
    /// (exact: the same values).
    #[inline(always)]
    unsafe fn load_lanes<L: Lanes>(&self, at: usize, out: &mut [f32]) {
        match self {
            KvRows::F16(v) if out.len().is_multiple_of(16) => {
                let src = &v[at..at + out.len()];
                for (s, d) in src.chunks_exact(16).zip(out.chunks_exact_mut(16)) {
                    L::f16x16(s.try_into().expect("16"), d.try_into().expect("16"));
                }
            }
            KvRows::Q8_0(_) | KvRows::Q4_0(_) => {
                for (c, d) in out.chunks_exact_mut(16).enumerate() {
                    self.lanes::<L>(at, c).store(d.try_into().expect("16"));
                }
            }
            _ => self.load(at, out),
        }
    }

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
            KvRows::Q8_0(v) => {
                for (b, o) in v[at / QK..].iter().zip(out.chunks_exact_mut(QK)) {
                    b.dequantize(o)
                }
            }
            KvRows::Q4_0(v) => {
                for (b, o) in v[at / QK..].iter().zip(out.chunks_exact_mut(QK)) {
                    b.dequantize(o)
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
    /// Sliding window (a query at `p` sees keys at `j` with `p − j <
    /// window`); 0 for none.
    pub window: usize,
}

impl AttnShape {
    /// The usual geometry, with the softmax scale `1 / sqrt(head_dim)`.
    pub fn new(n_heads: usize, n_kv_heads: usize, head_dim: usize, block_size: usize) -> AttnShape {
        AttnShape {
            n_heads,
            n_kv_heads,
            head_dim,
            block_size,
            scale: 1.0 / (head_dim as f32).sqrt(),
            window: 0,
        }
    }

    /// The same geometry with a sliding window (0: none).
    pub fn with_window(self, window: usize) -> AttnShape {
        AttnShape { window, ..self }
    }

    /// The first position a query at `pos` sees.
    #[inline]
    pub fn first_key(&self, pos: usize) -> usize {
        window_start(pos, self.window)
    }

    /// The chunks of context of a query at `pos`: `(first, count)`; its
    /// partial states are the count's, in chunk order.
    #[inline]
    pub fn chunks(&self, pos: usize) -> (usize, usize) {
        let first = self.first_key(pos) / CHUNK;
        (first, pos / CHUNK + 1 - first)
    }

    /// Floats of one partial state: `head_dim` sums, the max, the total.
    pub fn record(&self) -> usize {
        self.head_dim + 2
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Item {
    pub t0: u32,
    pub nt: u32,
    /// The first KV head, and how many from it (more than one only for a
    /// single token: its item reads whole cache slots).
    pub g: u32,
    pub ng: u32,
    pub chunk: u32,
}

impl Item {
    /// `(t0, nt, g, chunk)`: its first token, its token count, its first KV
    /// head and its chunk.
    #[inline(always)]
    fn span(&self) -> (usize, usize, usize, usize) {
        let w = |x: u32| x as usize;
        (w(self.t0), w(self.nt), w(self.g), w(self.chunk))
    }
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
            states += shape.chunks(p as usize).1 * shape.n_heads;
        }
        self.states = states;
        // Runs of ≤ TILE consecutive tokens of one sequence.
        let run = |t: usize| {
            let mut n = 1;
            while t + n < token_seq.len() && n < TILE && token_seq[t + n] == token_seq[t] {
                n += 1;
            }
            n
        };
        let mut decoding = 0;
        let mut t = 0;
        while t < token_seq.len() {
            let n = run(t);
            decoding += usize::from(n == 1);
            t += n;
        }
        let mut t = 0;
        while t < token_seq.len() {
            let n = run(t);
            let last = positions[t..t + n].iter().max().copied().unwrap_or(0) as usize;
            let first = positions[t..t + n]
                .iter()
                .map(|&p| shape.chunks(p as usize).0)
                .min()
                .unwrap_or(0);
            // A decoding sequence deep in its context, or one of several
            // decoding together: one item per chunk for all KV heads,
            // reading whole slots in address order (a head's rows alone
            // are a third of the bytes, strided, and stream at a third of
            // the speed). A lone sequence's shallower context: one per
            // head, so that it still gives every worker work.
            let slots = n == 1 && (last / CHUNK + 1 - first >= WIDE || decoding >= WIDE_BATCH);
            let ng = if slots { shape.n_kv_heads } else { 1 };
            for c in first..=last / CHUNK {
                for g in (0..shape.n_kv_heads).step_by(ng) {
                    self.items.push(Item {
                        t0: t as u32,
                        nt: n as u32,
                        g: g as u32,
                        ng: ng as u32,
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
    /// A tile's keys transposed in blocks of sixteen (see [`tile_kt`]).
    kt: Vec<f32>,
    v: Vec<f32>,
    s: Vec<f32>,
    rec: Vec<f32>,
    /// A single query's K/V row offsets.
    rows: Vec<usize>,
    /// A single query's softmax states `(max, Σ)` per head.
    stats: Vec<(f32, f32)>,
    /// A single query's passes over its rows (see [`item_one`]).
    passes: Vec<(usize, (usize, usize, usize), usize)>,
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

/// Turns scores into softmax weights `e^(s − max)` in place: `(max, Σ)`.
/// Sixteen lanes at a time; a short tail is padded with the max, and
/// every lane's weight has the bits of [`exp_nonpositive`] on it.
#[inline(always)]
unsafe fn softmax<L: Lanes>(s: &mut [f32]) -> (f32, f32) {
    let n = s.len();
    let full = n - n % 16;
    let mut mv = L::splat(f32::NEG_INFINITY);
    for i in (0..full).step_by(16) {
        mv = L::max(mv, L::load(at16(s.as_ptr().add(i))));
    }
    let mx = s[full..].iter().fold(mv.reduce_max(), |m, &x| m.max(x));
    for i in (0..full).step_by(16) {
        let dst = &mut *(s.as_mut_ptr().add(i) as *mut [f32; 16]);
        L::exp_sub(L::load(dst), mx).store(dst);
    }
    if full < n {
        let mut t = [mx; 16];
        t[..n - full].copy_from_slice(&s[full..]);
        L::exp_sub(L::load(&t), mx).store(&mut t);
        s[full..].copy_from_slice(&t[..n - full]);
    }
    (mx, sum16(s))
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

/// The 16 values at `p`.
///
/// # Safety
/// `p..p + 16` is readable.
#[inline(always)]
unsafe fn at16<'a>(p: *const f32) -> &'a [f32; 16] {
    &*(p as *const [f32; 16])
}

/// `s[i] = dot16(q, k_i) · scale` for the keys in `k` (`hd` apart),
/// sixteen or four keys at a time.
#[inline(always)]
unsafe fn scores_lanes<L: Lanes>(q: &[f32], k: &[f32], hd: usize, scale: f32, s: &mut [f32]) {
    // The usual head sizes with their loops' lengths known.
    match hd {
        64 => scores_nc::<L, 4>(q, k, hd, scale, s),
        128 => scores_nc::<L, 8>(q, k, hd, scale, s),
        _ => scores_nc::<L, 0>(q, k, hd, scale, s),
    }
}

/// [`scores_lanes`] with `NC` chunks of 16 per head (0: `hd / 16`).
#[inline(always)]
unsafe fn scores_nc<L: Lanes, const NC: usize>(
    q: &[f32],
    k: &[f32],
    hd: usize,
    scale: f32,
    s: &mut [f32],
) {
    let nc = if NC == 0 { hd / 16 } else { NC };
    let n = s.len();
    assert!(q.len() >= nc * 16 && k.len() >= n * hd && nc <= 16);
    let (qp, kp) = (q.as_ptr(), k.as_ptr());
    let mut qv = [L::zero(); 16];
    for (c, v) in qv.iter_mut().enumerate().take(nc) {
        *v = L::load(at16(qp.add(c * 16)));
    }
    let mut i = 0;
    // Sixteen keys at a time, their sums reduced together.
    while i + 16 <= n {
        let mut acc = [L::zero(); 16];
        for c in 0..nc {
            for j in 0..16 {
                let kv = L::load(at16(kp.add((i + j) * hd + c * 16)));
                acc[j] = L::fma(qv[c], kv, acc[j]);
            }
        }
        let mut sums = [0f32; 16];
        L::reduce_rows(&acc, &mut sums);
        let dst: &mut [f32; 16] = (&mut s[i..i + 16]).try_into().expect("16");
        for j in 0..16 {
            dst[j] = sums[j] * scale;
        }
        i += 16;
    }
    while i + 4 <= n {
        let mut acc = [L::zero(); 4];
        for c in 0..nc {
            for j in 0..4 {
                let kv = L::load(at16(kp.add((i + j) * hd + c * 16)));
                acc[j] = L::fma(qv[c], kv, acc[j]);
            }
        }
        for j in 0..4 {
            s[i + j] = acc[j].reduce() * scale;
        }
        i += 4;
    }
    for (i, si) in s.iter_mut().enumerate().skip(i) {
        let mut acc = L::zero();
        for c in 0..nc {
            acc = L::fma(qv[c], L::load(at16(kp.add(i * hd + c * 16))), acc);
        }
        *si = acc.reduce() * scale;
    }
}

/// `acc[d] = Σ_i p_i · v_i[d]`, fused, in order of `i`; 64 dimensions per
/// pass over the values.
#[inline(always)]
unsafe fn values_lanes<L: Lanes>(p: &[f32], v: &[f32], hd: usize, acc: &mut [f32]) {
    let nc = hd / 16;
    assert!(v.len() >= p.len() * hd && acc.len() >= nc * 16);
    let vp = v.as_ptr();
    let mut g = 0;
    while g < nc {
        let m = (nc - g).min(4);
        let mut a = [L::zero(); 4];
        for (i, &pi) in p.iter().enumerate() {
            let pv = L::splat(pi);
            let row = vp.add(i * hd + g * 16);
            if m == 4 {
                a[0] = L::fma(pv, L::load(at16(row)), a[0]);
                a[1] = L::fma(pv, L::load(at16(row.add(16))), a[1]);
                a[2] = L::fma(pv, L::load(at16(row.add(32))), a[2]);
                a[3] = L::fma(pv, L::load(at16(row.add(48))), a[3]);
            } else {
                for c in 0..m {
                    a[c] = L::fma(pv, L::load(at16(row.add(16 * c))), a[c]);
                }
            }
        }
        for c in 0..m {
            let mut out = [0f32; 16];
            a[c].store(&mut out);
            acc[(g + c) * 16..(g + c + 1) * 16].copy_from_slice(&out);
        }
        g += m;
    }
}

/// One layer's K or V rows read sixteen values at a time. [`KvRows`]
/// chooses the cache type on every read; the typed views below let a
/// decoding item choose once.
trait Rows: Copy {
    /// Values `16c..16c + 16` of the row at `at` as lanes (exact).
    unsafe fn lanes<L: Lanes>(self, at: usize, c: usize) -> L;
    /// Hints the cache lines of `n` values at `at` (never faults).
    unsafe fn prefetch<L: Lanes>(self, at: usize, n: usize);
}

/// Hints the `bytes` bytes at `p`.
#[inline(always)]
unsafe fn prefetch_bytes<L: Lanes>(p: *const u8, bytes: usize) {
    for l in (0..bytes).step_by(64) {
        L::prefetch(p.wrapping_add(l));
    }
}

/// Hints `pf` values of each of `rows` (nothing when `pf` is 0).
#[inline(always)]
unsafe fn prefetch_rows<L: Lanes, R: Rows>(r: R, rows: &[usize], pf: usize) {
    if pf > 0 {
        for &at in rows {
            r.prefetch::<L>(at, pf);
        }
    }
}

#[derive(Clone, Copy)]
struct F16Rows<'a>(&'a [u16]);
#[derive(Clone, Copy)]
struct Q8Rows<'a>(&'a [BlockQ8_0]);
#[derive(Clone, Copy)]
struct Q4Rows<'a>(&'a [BlockQ4_0]);

impl Rows for F16Rows<'_> {
    #[inline(always)]
    unsafe fn lanes<L: Lanes>(self, at: usize, c: usize) -> L {
        L::load_f16(&*(self.0.as_ptr().add(at + 16 * c) as *const [u16; 16]))
    }
    #[inline(always)]
    unsafe fn prefetch<L: Lanes>(self, at: usize, n: usize) {
        prefetch_bytes::<L>(self.0.as_ptr().wrapping_add(at) as *const u8, 2 * n)
    }
}

impl Rows for Q8Rows<'_> {
    #[inline(always)]
    unsafe fn lanes<L: Lanes>(self, at: usize, c: usize) -> L {
        let p = at + 16 * c;
        let b = self.0.get_unchecked(p / QK);
        let q = &*(b.qs.as_ptr().add(p % QK) as *const [i8; 16]);
        L::load_q8(q, L::f16(u16::from_le_bytes(b.d)))
    }
    #[inline(always)]
    unsafe fn prefetch<L: Lanes>(self, at: usize, n: usize) {
        let p = self.0.as_ptr().wrapping_add(at / QK) as *const u8;
        prefetch_bytes::<L>(p, n / QK * BlockQ8_0::BYTES)
    }
}

impl Rows for Q4Rows<'_> {
    #[inline(always)]
    unsafe fn lanes<L: Lanes>(self, at: usize, c: usize) -> L {
        let p = at + 16 * c;
        let b = self.0.get_unchecked(p / QK);
        L::load_q4(
            &b.qs,
            !p.is_multiple_of(QK),
            L::f16(u16::from_le_bytes(b.d)),
        )
    }
    #[inline(always)]
    unsafe fn prefetch<L: Lanes>(self, at: usize, n: usize) {
        let p = self.0.as_ptr().wrapping_add(at / QK) as *const u8;
        prefetch_bytes::<L>(p, n / QK * BlockQ4_0::BYTES)
    }
}

impl Rows for KvRows<'_> {
    #[inline(always)]
    unsafe fn lanes<L: Lanes>(self, at: usize, c: usize) -> L {
        match self {
            KvRows::F32(v) => L::load(at16(v.as_ptr().add(at + 16 * c))),
            KvRows::F16(v) => F16Rows(v).lanes(at, c),
            KvRows::Bf16(_) => {
                let mut x = [0f32; 16];
                self.load(at + 16 * c, &mut x);
                L::load(&x)
            }
            KvRows::Q8_0(v) => Q8Rows(v).lanes(at, c),
            KvRows::Q4_0(v) => Q4Rows(v).lanes(at, c),
        }
    }
    #[inline(always)]
    unsafe fn prefetch<L: Lanes>(self, at: usize, n: usize) {
        match self {
            KvRows::F32(v) => prefetch_bytes::<L>(v.as_ptr().wrapping_add(at) as *const u8, 4 * n),
            KvRows::F16(v) | KvRows::Bf16(v) => F16Rows(v).prefetch::<L>(at, n),
            KvRows::Q8_0(v) => Q8Rows(v).prefetch::<L>(at, n),
            KvRows::Q4_0(v) => Q4Rows(v).prefetch::<L>(at, n),
        }
    }
}

/// Query heads of one token against one chunk of `n` rows (offsets
/// `rows`, plus `goff`): `ng` KV heads side by side from there, each with
/// `GH` query heads from `head0` (`group` apart), each K and V row
/// converted in registers once for all of them: the arithmetic of
/// [`scores_lanes`], the softmax and [`values_lanes`], in the same order,
/// so the same bits. Rows go by sixteen, all `ng` heads of them before
/// the next sixteen. The keys of sixteen rows are converted for up to
/// 16 KB of their heads at once, row after row: with every KV head of a
/// slot (SmolLM2's three of 64), whole slots in address order. The values
/// go head by head. `pf`: values of each row to prefetch (0: none), in
/// shares: each pass over a row hints its heads' share of the row
/// [`AHEAD`] rows on, and the last values' hints run on into `next`
/// (the next chunk's first rows, or none).
///
/// Hints in bursts stall: on an AMD EPYC, hinting whole rows on the
/// first head's pass only, and converting the keys head by head (each
/// pass striding over the slots), left the arithmetic and the stream
/// adding up: 3.0–3.1 ms for 30 layers' 2,048 rows (criterion's
/// `decode_1_at_2048_30_layers`, one thread, alternating runs) against
/// 2.6–2.75 ms this way, where the arithmetic alone (rows in L1) takes
/// about 1.9–2.0 ms and the same bytes read in the same order, with the
/// same hints and nothing else, 1.0 ms.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn heads_one<L: Lanes, R: Rows, const NC: usize, const GH: usize>(
    inp: &AttnInput,
    (kr, vr): (R, R),
    (goff, ng, pf): (usize, usize, usize),
    t: usize,
    head0: usize,
    chunk: usize,
    (rows, next): (&[usize], &[usize]),
    sc: &mut AttnScratch,
    write: &mut dyn FnMut(usize, usize, &[f32]),
) {
    let sh = inp.shape;
    let (nh, hd) = (sh.n_heads, sh.head_dim);
    let group = nh / sh.n_kv_heads;
    let n = rows.len();
    let heads = ng * GH;
    sc.s.resize(sc.s.len().max(heads * CHUNK), 0.0);
    // KV heads whose sixteen rows are converted together (at most 16 KB
    // of f32 in L1): SmolLM2's three heads of 64, whole slots.
    let js = (256 / hd).clamp(1, ng);
    sc.k.resize(sc.k.len().max(js * 16 * hd), 0.0);
    // Each head's record `(Σ p·v, max, Σ p)` in place, written whole;
    // records sixteen lanes apart, so each head's sums stay aligned.
    let rs = hd + 16;
    sc.v.resize(sc.v.len().max(heads * rs), 0.0);
    let (s, kf, vacc) = (
        &mut sc.s[..heads * CHUNK],
        &mut sc.k[..js * 16 * hd],
        &mut sc.v[..],
    );
    let head = |j: usize, h: usize| head0 + j * group + h;
    // Each KV head's share of a row's hints: each pass over a row hints
    // its heads' share of the row `AHEAD` on, so that the hints spread
    // over the whole group of rows.
    let pfj = pf / ng;
    prefetch_rows::<L, R>(kr, &rows[..n.min(AHEAD)], pf);
    // Sixteen keys at a time, converted once into `kf` (in L1) for the
    // query heads of their KV head.
    for i in (0..n).step_by(16) {
        let m = (n - i).min(16);
        for j0 in (0..ng).step_by(js) {
            let je = (j0 + js).min(ng);
            // The rows of heads j0..je in address order (whole slots
            // when they are all the item's heads).
            for r in 0..m {
                if pf > 0 {
                    let (a, pfs) = (i + r + AHEAD, (j0 * pfj, (je - j0) * pfj));
                    if a < n {
                        kr.prefetch::<L>(rows[a] + pfs.0, pfs.1);
                    } else if a - n < n {
                        vr.prefetch::<L>(rows[a - n] + pfs.0, pfs.1);
                    }
                }
                let at = rows[i + r] + goff;
                for j in j0..je {
                    for c in 0..NC {
                        let dst = (j - j0) * 16 + r;
                        let dst = &mut *(kf.as_mut_ptr().add(dst * hd + c * 16) as *mut [f32; 16]);
                        kr.lanes::<L>(at + j * hd, c).store(dst);
                    }
                }
            }
            for j in j0..je {
                let kf = &kf[(j - j0) * 16 * hd..][..16 * hd];
                for h in 0..GH {
                    let q = inp.q.as_ptr().add((t * nh + head(j, h)) * hd);
                    let s = &mut s[(j * GH + h) * CHUNK + i..][..m];
                    if m < 16 {
                        let q = std::slice::from_raw_parts(q, hd);
                        scores_lanes::<L>(q, kf, hd, sh.scale, s);
                        continue;
                    }
                    // As scores_lanes, with the query in registers across
                    // groups.
                    let mut qv = [L::zero(); NC];
                    for c in 0..NC {
                        qv[c] = L::load(at16(q.add(16 * c)));
                    }
                    let mut acc = [L::zero(); 16];
                    for r in 0..16 {
                        for c in 0..NC {
                            let k = L::load(at16(kf.as_ptr().add(r * hd + c * 16)));
                            acc[r] = L::fma(qv[c], k, acc[r]);
                        }
                    }
                    let mut sums = [0f32; 16];
                    L::reduce_rows(&acc, &mut sums);
                    let dst: &mut [f32; 16] = s.try_into().expect("16");
                    for r in 0..16 {
                        dst[r] = sums[r] * sh.scale;
                    }
                }
            }
        }
    }
    prefetch_rows::<L, R>(vr, &rows[..n.min(AHEAD.saturating_sub(n))], pf);
    let mut stats = std::mem::take(&mut sc.stats);
    stats.clear();
    for x in 0..heads {
        stats.push(softmax::<L>(&mut s[x * CHUNK..x * CHUNK + n]));
    }
    vacc[..heads * rs].fill(0.0);
    // Values sixteen rows at a time, each KV head's sums kept in
    // registers across its sixteen rows.
    for i in (0..n).step_by(16) {
        let m = (n - i).min(16);
        for j in 0..ng {
            let a = vacc.as_mut_ptr().add(j * GH * rs);
            let mut acc = [[L::zero(); NC]; GH];
            for h in 0..GH {
                for c in 0..NC {
                    acc[h][c] = L::load(at16(a.add(h * rs + 16 * c)));
                }
            }
            for r in i..i + m {
                if pf > 0 {
                    let a = r + AHEAD;
                    if a < n {
                        vr.prefetch::<L>(rows[a] + j * pfj, pfj);
                    } else if let Some(&at) = next.get(a - n) {
                        kr.prefetch::<L>(at + j * pfj, pfj);
                    }
                }
                let mut v = [L::zero(); NC];
                for c in 0..NC {
                    v[c] = vr.lanes::<L>(rows[r] + goff + j * hd, c);
                }
                for h in 0..GH {
                    let p = L::splat(s[(j * GH + h) * CHUNK + r]);
                    for c in 0..NC {
                        acc[h][c] = L::fma(p, v[c], acc[h][c]);
                    }
                }
            }
            for h in 0..GH {
                for c in 0..NC {
                    acc[h][c].store(&mut *(a.add(h * rs + 16 * c) as *mut [f32; 16]));
                }
            }
        }
    }
    for j in 0..ng {
        for h in 0..GH {
            let rec = &mut vacc[(j * GH + h) * rs..][..hd + 2];
            (rec[hd], rec[hd + 1]) = stats[j * GH + h];
            write(t, chunk * nh + head(j, h), rec);
        }
    }
    sc.stats = stats;
}

/// An item of one query token (a decoding sequence) with `NC · 16`
/// dimensions per head: no f32 copy of the chunk, each K/V row read once
/// for the query heads of its group (up to 64 lanes of queries at a time).
#[inline(always)]
unsafe fn item_one<L: Lanes, R: Rows, const NC: usize>(
    inp: &AttnInput,
    kv: (R, R),
    item: Item,
    sc: &mut AttnScratch,
    write: &mut dyn FnMut(usize, usize, &[f32]),
) {
    let sh = inp.shape;
    let (nh, kvh, hd, bs) = (sh.n_heads, sh.n_kv_heads, sh.head_dim, sh.block_size);
    let group = nh / kvh;
    let (t, g0, c) = (item.t0 as usize, item.g as usize, item.chunk as usize);
    let pos = inp.positions[t] as usize;
    let (c0, _) = sh.chunks(pos);
    if pos < c * CHUNK || c < c0 {
        return;
    }
    let start = (c * CHUNK).max(sh.first_key(pos));
    let seq = inp.token_seq[t] as usize;
    let table = &inp.block_tables[seq * inp.max_blocks..(seq + 1) * inp.max_blocks];
    let n = (pos + 1).min(c * CHUNK + CHUNK) - start;
    // Offsets of the item's first KV head's rows.
    let mut rows = std::mem::take(&mut sc.rows);
    rows.clear();
    let ng = item.ng as usize;
    // Then, for an item of whole slots, the first rows of the next chunk
    // (a worker's next item), which the last values' hints run on into.
    let upto = if ng == kvh {
        (pos + 1).min(start + n + AHEAD)
    } else {
        start + n
    };
    let mut p = start;
    while p < upto {
        let b = p / bs;
        let end = ((b + 1) * bs).min(upto);
        let slot = table[b] as usize * bs;
        for q in p..end {
            rows.push(((slot + q - b * bs) * kvh + g0) * hd);
        }
        p = end;
    }
    let (rows_n, next) = rows.split_at(n);
    let most = (16 / NC).clamp(1, 4);
    let rc = c - c0;
    // The passes over the rows: (query heads, (first KV head's offset,
    // KV heads, values to prefetch per row), first query head).
    let mut passes = std::mem::take(&mut sc.passes);
    passes.clear();
    if group <= most {
        // All the item's KV heads together, each with its whole group.
        passes.push((group, (0, ng, ng * hd), g0 * group));
    } else {
        // A group too large for the registers: `most` heads at a time,
        // one KV head at a time; the first pass prefetches all of them.
        let mut pf = ng * hd;
        for g in g0..g0 + ng {
            for h in (0..group).step_by(most) {
                passes.push(((group - h).min(most), ((g - g0) * hd, 1, pf), g * group + h));
                pf = 0;
            }
        }
    }
    for &(gh, at, head0) in &passes {
        // Only the query-head counts whose lanes fit in the registers.
        macro_rules! go {
            ($n:literal) => {
                heads_one::<L, R, NC, $n>(inp, kv, at, t, head0, rc, (rows_n, next), sc, write)
            };
        }
        match (NC, gh) {
            (_, 1) => go!(1),
            (4 | 8, 2) => go!(2),
            (4, 3) => go!(3),
            (4, _) => go!(4),
            (_, gh) => unreachable!("{gh} heads of {NC} lanes"),
        }
    }
    sc.passes = passes;
    sc.rows = rows;
}

/// [`item_one`] for the head size (64, 128 or 256).
#[inline(always)]
unsafe fn item_one_nc<L: Lanes, R: Rows>(
    inp: &AttnInput,
    kv: (R, R),
    item: Item,
    sc: &mut AttnScratch,
    write: &mut dyn FnMut(usize, usize, &[f32]),
) {
    match inp.shape.head_dim {
        64 => item_one::<L, R, 4>(inp, kv, item, sc, write),
        128 => item_one::<L, R, 8>(inp, kv, item, sc, write),
        _ => item_one::<L, R, 16>(inp, kv, item, sc, write),
    }
}

/// [`values_lanes`] for `Q` queries over the same values: `4·Q` chains of
/// fused sums, each query's in its own order as there (so the same bits).
#[inline(always)]
unsafe fn values_lanes_q<L: Lanes, const Q: usize>(
    p: [&[f32]; Q],
    v: &[f32],
    hd: usize,
    mut acc: [&mut [f32]; Q],
) {
    let nc = hd / 16;
    let n = p[0].len();
    assert!(v.len() >= n * hd);
    for q in 0..Q {
        assert!(p[q].len() == n && acc[q].len() >= hd);
    }
    let vp = v.as_ptr();
    let mut g = 0;
    while g < nc {
        let m = (nc - g).min(4);
        let mut a = [[L::zero(); 4]; Q];
        for i in 0..n {
            let mut pv = [L::zero(); Q];
            for q in 0..Q {
                pv[q] = L::splat(*p[q].get_unchecked(i));
            }
            let row = vp.add(i * hd + g * 16);
            for c in 0..m {
                let x = L::load(at16(row.add(16 * c)));
                for q in 0..Q {
                    a[q][c] = L::fma(pv[q], x, a[q][c]);
                }
            }
        }
        for (a, out) in a.iter().zip(acc.iter_mut()) {
            for c in 0..m {
                let dst: &mut [f32; 16] = (&mut out[(g + c) * 16..(g + c + 1) * 16])
                    .try_into()
                    .expect("16");
                a[c].store(dst);
            }
        }
        g += m;
    }
}

/// [`scores_kt`]'s `v4(l4) = (a(l4) + a(l4 + 8)) + (a(l4 + 4) + a(l4 +
/// 12))` for each query (no closures: a closure called through library
/// code loses the caller's target features).
#[inline(always)]
unsafe fn scores_kt_v4<L: Lanes, const Q: usize>(
    q: [*const f32; Q],
    kt: *const f32,
    nc: usize,
    l4: usize,
) -> [L; Q] {
    let mut a = [[L::zero(); Q]; 4];
    for c in 0..nc {
        for k in 0..4 {
            let d = 16 * c + l4 + 4 * k;
            let x = L::load(at16(kt.add(16 * d)));
            for j in 0..Q {
                a[k][j] = L::fma(L::splat(*q[j].add(d)), x, a[k][j]);
            }
        }
    }
    let mut v = [L::zero(); Q];
    for j in 0..Q {
        v[j] = L::add(L::add(a[0][j], a[2][j]), L::add(a[1][j], a[3][j]));
    }
    v
}

/// Scores of `Q` queries against sixteen keys held transposed (`kt[16·d +
/// r]`: dimension `d` of key `r`), lanes over keys: lane `r` of chain `l`
/// is the fused sum over `c` of `q[16c + l] · k_r[16c + l]` from zero,
/// which is lane `l` of [`scores_nc`]'s accumulator for key `r`; the
/// sixteen chains are then added by the same fixed tree as
/// [`Lanes::reduce`] (`v8(l) = a(l) + a(l+8)`, `v4(l) = v8(l) + v8(l+4)`,
/// `(v4(0) + v4(2)) + (v4(1) + v4(3))`) and scaled: the same bits as the
/// row-major path, with no shuffles and each key load shared by the
/// queries.
#[inline(always)]
unsafe fn scores_kt<L: Lanes, const Q: usize>(
    q: [*const f32; Q],
    kt: *const f32,
    nc: usize,
    scale: L,
    out: [*mut f32; Q],
) {
    let v0 = scores_kt_v4::<L, Q>(q, kt, nc, 0);
    let v2 = scores_kt_v4::<L, Q>(q, kt, nc, 2);
    let mut t02 = [L::zero(); Q];
    for j in 0..Q {
        t02[j] = L::add(v0[j], v2[j]);
    }
    let v1 = scores_kt_v4::<L, Q>(q, kt, nc, 1);
    let v3 = scores_kt_v4::<L, Q>(q, kt, nc, 3);
    for j in 0..Q {
        let s = L::add(t02[j], L::add(v1[j], v3[j]));
        L::mul(s, scale).store(&mut *(out[j] as *mut [f32; 16]));
    }
}

/// `Q` query heads (from `h0`) of token `t` over the chunk's transposed
/// keys `kt` and values `v` (rows from the copy's start): scores for the
/// blocks of sixteen keys that hold the token's rows `off..off + n`, then
/// softmax and values as [`item_head`]'s row-major path.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn heads_kt<L: Lanes, const Q: usize>(
    inp: &AttnInput,
    t: usize,
    h0: usize,
    (off, n): (usize, usize),
    (kt, v): (&[f32], &[f32]),
    (s, rec): (&mut [f32], &mut [f32]),
    mut write: impl FnMut(usize, &[f32]),
) {
    let sh = inp.shape;
    let (nh, hd) = (sh.n_heads, sh.head_dim);
    let nc = hd / 16;
    let (b0, b1) = (off / 16, (off + n).div_ceil(16));
    assert!(kt.len() >= b1 * 16 * hd && v.len() >= (off + n) * hd);
    assert!(s.len() >= Q * CHUNK && rec.len() >= Q * (hd + 2) && b1 * 16 <= CHUNK);
    assert!((t * nh + h0 + Q) * hd <= inp.q.len());
    let qp: [*const f32; Q] = std::array::from_fn(|j| inp.q.as_ptr().add((t * nh + h0 + j) * hd));
    let scale = L::splat(sh.scale);
    for b in b0..b1 {
        let out: [*mut f32; Q] = std::array::from_fn(|j| s.as_mut_ptr().add(j * CHUNK + 16 * b));
        scores_kt::<L, Q>(qp, kt.as_ptr().add(b * 16 * hd), nc, scale, out);
    }
    let mut ss = s.chunks_exact_mut(CHUNK);
    let ps: [&mut [f32]; Q] = std::array::from_fn(|_| &mut ss.next().expect("Q")[off..off + n]);
    let mut stats = [(0f32, 0f32); Q];
    for j in 0..Q {
        stats[j] = softmax::<L>(&mut *ps[j]);
    }
    {
        let p: [&[f32]; Q] = std::array::from_fn(|j| &*ps[j]);
        let mut rs = rec.chunks_exact_mut(hd + 2);
        let acc: [&mut [f32]; Q] = std::array::from_fn(|_| rs.next().expect("Q"));
        values_lanes_q::<L, Q>(p, &v[off * hd..], hd, acc);
    }
    for j in 0..Q {
        let r = &mut rec[j * (hd + 2)..(j + 1) * (hd + 2)];
        (r[hd], r[hd + 1]) = stats[j];
        write(h0 + j, r);
    }
}

/// One item with lanes `L`.
///
/// # Safety
/// The CPU has `L`'s instruction set.
#[inline(always)]
unsafe fn item_body<L: Lanes>(
    inp: &AttnInput,
    item: Item,
    sc: &mut AttnScratch,
    write: &mut dyn FnMut(usize, usize, &[f32]),
) {
    let sh = inp.shape;
    if item.nt == 1 && matches!(sh.head_dim, 64 | 128 | 256) {
        // f16, the default cache type, chosen once for the whole item
        // (each further type would be another copy of the item code).
        return match (inp.k, inp.v) {
            (KvRows::F16(k), KvRows::F16(v)) => {
                item_one_nc::<L, _>(inp, (F16Rows(k), F16Rows(v)), item, sc, write)
            }
            kv => item_one_nc::<L, _>(inp, kv, item, sc, write),
        };
    }
    // An item of whole slots here: its KV heads one after another.
    for g in item.g..item.g + item.ng {
        item_head::<L>(inp, Item { g, ng: 1, ..item }, sc, write);
    }
}

/// [`item_body`] for a tile of query tokens (or a head size without a
/// single-query path) and one KV head: the chunk's K/V rows converted to
/// f32 once for all the tokens and query heads.
///
/// # Safety
/// The CPU has `L`'s instruction set.
#[inline(always)]
unsafe fn item_head<L: Lanes>(
    inp: &AttnInput,
    item: Item,
    sc: &mut AttnScratch,
    write: &mut dyn FnMut(usize, usize, &[f32]),
) {
    let sh = inp.shape;
    let (nh, kvh, hd) = (sh.n_heads, sh.n_kv_heads, sh.head_dim);
    let group = nh / kvh;
    let (t0, nt, g, c) = item.span();
    let seq = inp.token_seq[t0] as usize;
    let table = &inp.block_tables[seq * inp.max_blocks..(seq + 1) * inp.max_blocks];
    let end = c * CHUNK + CHUNK;
    let last = inp.positions[t0..t0 + nt]
        .iter()
        .max()
        .copied()
        .unwrap_or(0) as usize;
    // Rows from the earliest key any token of the tile sees in this chunk.
    let start = inp.positions[t0..t0 + nt]
        .iter()
        .map(|&p| sh.first_key(p as usize))
        .min()
        .unwrap_or(0)
        .max(c * CHUNK);
    if start > last || start >= end {
        return;
    }
    let n_max = (last + 1).min(end) - start;
    if L::FAST_TRANSPOSE && hd.is_multiple_of(16) && hd <= 256 {
        return tile_kt::<L>(inp, item, table, (start, n_max), sc, write);
    }
    sc.k.resize(sc.k.len().max(CHUNK * hd), 0.0);
    sc.v.resize(sc.v.len().max(CHUNK * hd), 0.0);
    for i in 0..n_max {
        let (k, v) = (
            &mut sc.k[i * hd..(i + 1) * hd],
            &mut sc.v[i * hd..(i + 1) * hd],
        );
        kv_row::<L>(inp, table, g, (start, i, n_max), k, v);
    }
    sc.rec.resize(sc.rec.len().max(2 * (hd + 2)), 0.0);
    sc.s.resize(sc.s.len().max(2 * CHUNK), 0.0);
    let lanes = hd.is_multiple_of(16) && hd <= 256;
    for ti in 0..nt {
        let t = t0 + ti;
        let Some((off, n, rc)) = token_keys(&sh, inp.positions[t] as usize, c, start) else {
            continue;
        };
        let (kc, vc) = (&sc.k[off * hd..], &sc.v[off * hd..]);
        let mut h = 0;
        // Two heads at a time share the value rows.
        while lanes && h + 2 <= group {
            let (s0, s1) = sc.s.split_at_mut(CHUNK);
            let (s0, s1) = (&mut s0[..n], &mut s1[..n]);
            let (r0, r1) = sc.rec.split_at_mut(hd + 2);
            for (j, s) in [&mut *s0, &mut *s1].into_iter().enumerate() {
                let head = g * group + h + j;
                let q = &inp.q[(t * nh + head) * hd..(t * nh + head + 1) * hd];
                scores_lanes::<L>(q, kc, hd, sh.scale, s);
            }
            let stats = [softmax::<L>(s0), softmax::<L>(s1)];
            values_lanes_q::<L, 2>([s0, s1], vc, hd, [&mut r0[..hd], &mut r1[..hd]]);
            for (j, r) in [r0, r1].into_iter().enumerate() {
                (r[hd], r[hd + 1]) = stats[j];
                write(t, rc * nh + g * group + h + j, r);
            }
            h += 2;
        }
        let rec = &mut sc.rec[..hd + 2];
        for h in h..group {
            let head = g * group + h;
            let q = &inp.q[(t * nh + head) * hd..(t * nh + head + 1) * hd];
            let s = &mut sc.s[..n];
            if lanes {
                scores_lanes::<L>(q, kc, hd, sh.scale, s);
            } else {
                for (i, si) in s.iter_mut().enumerate() {
                    *si = dot16(q, &kc[i * hd..(i + 1) * hd]) * sh.scale;
                }
            }
            let (mx, l) = softmax::<L>(s);
            let acc = &mut rec[..hd];
            if lanes {
                values_lanes::<L>(s, vc, hd, acc);
            } else {
                acc.fill(0.0);
                for (i, &p) in s.iter().enumerate() {
                    let v = &vc[i * hd..(i + 1) * hd];
                    for (a, &vv) in acc.iter_mut().zip(v) {
                        *a = p.mul_add(vv, *a);
                    }
                }
            }
            rec[hd] = mx;
            rec[hd + 1] = l;
            write(t, rc * nh + head, rec);
        }
    }
}

/// Converts the K and V rows of position `start + i` (KV head `g`) to f32
/// into `k` and `v`, hinting the same rows a block further on (below
/// `start + n_max`): blocks lie anywhere in the pool, so the hardware
/// prefetchers lose the stream at each one.
///
/// # Safety
/// The CPU has `L`'s instruction set.
#[inline(always)]
unsafe fn kv_row<L: Lanes>(
    inp: &AttnInput,
    table: &[u32],
    g: usize,
    (start, i, n_max): (usize, usize, usize),
    k: &mut [f32],
    v: &mut [f32],
) {
    let sh = inp.shape;
    let (kvh, hd, bs) = (sh.n_kv_heads, sh.head_dim, sh.block_size);
    let p = start + i;
    let at = ((table[p / bs] as usize * bs + p % bs) * kvh + g) * hd;
    if i + bs < n_max {
        let q = p + bs;
        let ahead = ((table[q / bs] as usize * bs + q % bs) * kvh + g) * hd;
        inp.k.prefetch::<L>(ahead, hd);
        inp.v.prefetch::<L>(ahead, hd);
    }
    inp.k.load_lanes::<L>(at, k);
    inp.v.load_lanes::<L>(at, v);
}

/// The keys of a query at `pos` in chunk `c`, as rows of the chunk's copy
/// from position `start`: `(off, n, rc)`, rows `off..off + n`, and `rc`
/// the chunk's index among the query's (its partial state's); `None`
/// where the query has no keys in the chunk.
#[inline(always)]
fn token_keys(sh: &AttnShape, pos: usize, c: usize, start: usize) -> Option<(usize, usize, usize)> {
    let (c0, _) = sh.chunks(pos);
    if pos < c * CHUNK || c < c0 {
        return None;
    }
    let off = (c * CHUNK).max(sh.first_key(pos)) - start;
    let n = (pos + 1).min(c * CHUNK + CHUNK) - start - off;
    Some((off, n, c - c0))
}

/// [`item_head`] where `L` transposes cheaply: the chunk's K rows are
/// converted sixteen at a time into a small buffer and turned into
/// columns (zero keys past the last row), so that scores take sixteen
/// keys in the lanes for up to four query heads at once ([`heads_kt`]);
/// the same bits as the row-major path.
///
/// # Safety
/// The CPU has `L`'s instruction set.
#[inline(always)]
unsafe fn tile_kt<L: Lanes>(
    inp: &AttnInput,
    item: Item,
    table: &[u32],
    (start, n_max): (usize, usize),
    sc: &mut AttnScratch,
    write: &mut dyn FnMut(usize, usize, &[f32]),
) {
    let sh = inp.shape;
    let (nh, kvh, hd) = (sh.n_heads, sh.n_kv_heads, sh.head_dim);
    let group = nh / kvh;
    let (t0, nt, g, c) = item.span();
    let nb = n_max.div_ceil(16);
    sc.k.resize(sc.k.len().max(16 * hd), 0.0);
    sc.kt.resize(sc.kt.len().max(CHUNK * hd), 0.0);
    sc.v.resize(sc.v.len().max(CHUNK * hd), 0.0);
    for b in 0..nb {
        for r in 0..16 {
            let i = 16 * b + r;
            let dst = &mut sc.k[r * hd..(r + 1) * hd];
            if i >= n_max {
                dst.fill(0.0);
                continue;
            }
            kv_row::<L>(
                inp,
                table,
                g,
                (start, i, n_max),
                dst,
                &mut sc.v[i * hd..(i + 1) * hd],
            );
        }
        for d in (0..hd).step_by(16) {
            L::transpose16(
                sc.k.as_ptr().add(d),
                hd,
                sc.kt.as_mut_ptr().add((b * hd + d) * 16),
            );
        }
    }
    sc.rec.resize(sc.rec.len().max(4 * (hd + 2)), 0.0);
    sc.s.resize(sc.s.len().max(4 * CHUNK), 0.0);
    for ti in 0..nt {
        let t = t0 + ti;
        let Some((off, n, rc)) = token_keys(&sh, inp.positions[t] as usize, c, start) else {
            continue;
        };
        let bufs = (&sc.kt[..], &sc.v[..]);
        let mut w = |head: usize, r: &[f32]| write(t, rc * nh + head, r);
        let mut h = 0;
        while h < group {
            let q = (group - h).min(4);
            let at = g * group + h;
            let sr = (&mut sc.s[..], &mut sc.rec[..]);
            match q {
                4 => heads_kt::<L, 4>(inp, t, at, (off, n), bufs, sr, &mut w),
                3 => heads_kt::<L, 3>(inp, t, at, (off, n), bufs, sr, &mut w),
                2 => heads_kt::<L, 2>(inp, t, at, (off, n), bufs, sr, &mut w),
                _ => heads_kt::<L, 1>(inp, t, at, (off, n), bufs, sr, &mut w),
            }
            h += q;
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
    item_body::<x86::Avx512>(inp, item, sc, write)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn item_avx2(
    inp: &AttnInput,
    item: Item,
    sc: &mut AttnScratch,
    write: &mut dyn FnMut(usize, usize, &[f32]),
) {
    item_body::<x86::Avx2>(inp, item, sc, write)
}

/// Computes one item; `write(token, index, state)` receives each partial
/// state (`index = (chunk − the token's first chunk) · n_heads + head`,
/// the offset from the token's `base`).
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
        // SAFETY: the portable lanes need no particular CPU.
        _ => unsafe { item_body::<Portable>(inp, item, sc, write) },
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

#[cfg(test)]
mod tests {
    use candle_core::{DType, Tensor};

    use super::*;
    use crate::testing::{seeded, seeded_cache};
    use crate::KvType;
    use crate::{paged_attention_slow, PagedMeta};

    /// Runs a whole batch through plan, items and merge with `isa`.
    fn run(isa: Isa, inp: &AttnInput, plan: &AttnPlan) -> Vec<f32> {
        let sh = inp.shape;
        let rec = sh.record();
        let mut states = vec![f32::NAN; plan.states * rec];
        let mut sc = AttnScratch::default();
        for &item in &plan.items {
            attend_item(isa, inp, item, &mut sc, &mut |t, idx, r| {
                let at = (plan.base[t] + idx) * rec;
                states[at..at + rec].copy_from_slice(r);
            });
        }
        let t = inp.positions.len();
        let mut out = vec![0f32; t * sh.n_heads * sh.head_dim];
        for i in 0..t {
            let (_, chunks) = sh.chunks(inp.positions[i] as usize);
            for h in 0..sh.n_heads {
                let first = (plan.base[i] + h) * rec;
                let o = &mut out[(i * sh.n_heads + h) * sh.head_dim..][..sh.head_dim];
                merge(&states[first..], chunks, sh.n_heads * rec, sh.head_dim, o);
            }
        }
        out
    }

    /// Two sequences, one decoding deep in its context (several chunks)
    /// and one prefilling across a chunk boundary, over scattered blocks of
    /// an f16 cache: every instruction set gives the same bits, each query
    /// computed alone (a decoding sequence's item) gives the same bits as
    /// in the batch, and the result equals the slow reference within
    /// rounding; with sliding windows too (shorter than a chunk, cutting
    /// chunks, longer than the context), whose earlier blocks are ids
    /// outside the cache.
    #[test]
    fn items_match_the_reference_across_chunks_and_instruction_sets() {
        for case in [
            (64, 0),
            (24, 0),
            (128, 0),
            (256, 0),
            // Head sizes whose values take passes of three, two and one
            // sixteens (Phi-3's 96 among them).
            (48, 0),
            (96, 0),
            (80, 0),
            (64, 1),
            (64, 100),
            (256, 200),
            (24, 150),
            (128, 512),
        ]
        .into_iter()
        .flat_map(|c| [KvType::F16, KvType::Q8_0, KvType::Q4_0].map(|t| (c, t)))
        // Query heads per KV head 3, 4, 7 and 1 (the tile path's groups
        // of four, three, two and one heads), all with f16 rows.
        .flat_map(|(c, t)| {
            let heads: &[(usize, usize)] = match t {
                KvType::F16 => &[(6, 2), (8, 2), (7, 1), (2, 2)],
                _ => &[(6, 2)],
            };
            heads.iter().map(move |&h| (c, t, h))
        }) {
            let ((hd, window), kind, (nh, kvh)) = case;
            if kind.is_quantized() && hd % crate::quant::ROT != 0 {
                continue;
            }
            let (bs, nb) = (16, 96);
            let k = seeded_cache(&[nb, bs, kvh, hd], 1, kind).unwrap();
            let v = seeded_cache(&[nb, bs, kvh, hd], 2, kind).unwrap();
            let max_blocks = 40;
            let mut tables: Vec<u32> = (0..max_blocks as u32).rev().collect();
            tables.extend((max_blocks as u32..2 * max_blocks as u32).map(|b| b % nb as u32));
            // Blocks before every window of their sequence: never read.
            for (seq, first_query) in [(0, 600usize), (1, 120)] {
                let lo = window_start(first_query, window);
                for b in 0..lo / bs {
                    tables[seq * max_blocks + b] = u32::MAX;
                }
            }
            // Sequence 0: one query at position 600 (deep enough for items
            // of whole slots); sequence 1: 20 queries at 120..140 (crossing
            // the 128 boundary).
            let mut positions = vec![600u32];
            let mut seqs = vec![0u32];
            positions.extend(120..140);
            seqs.extend(std::iter::repeat_n(1, 20));
            let t = positions.len();
            let q = seeded(&[t, nh, hd], 3, DType::F32).unwrap();
            let mut qv = q.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            // A quantized cache holds rotated rows: the items take rotated
            // queries and give rotated outputs.
            if kind.is_quantized() {
                crate::quant::hadamard64(&mut qv);
            }
            let bits = |x: &Tensor| -> Vec<u16> {
                if kind.is_quantized() {
                    return Vec::new();
                }
                x.flatten_all()
                    .unwrap()
                    .to_vec1::<half::f16>()
                    .unwrap()
                    .iter()
                    .map(|h| h.to_bits())
                    .collect()
            };
            let bytes = |x: &Tensor| -> Vec<u8> {
                if !kind.is_quantized() {
                    return Vec::new();
                }
                x.flatten_all().unwrap().to_vec1::<u8>().unwrap()
            };
            let (kb, vb) = (bits(&k), bits(&v));
            let (kq, vq) = (bytes(&k), bytes(&v));
            fn pick<'a>(kind: KvType, h: &'a [u16], q: &'a [u8]) -> KvRows<'a> {
                match kind {
                    KvType::Q8_0 => KvRows::Q8_0(crate::quant::blocks(q)),
                    KvType::Q4_0 => KvRows::Q4_0(crate::quant::blocks(q)),
                    _ => KvRows::F16(h),
                }
            }
            let rows = |h, q| pick(kind, h, q);
            let shape = AttnShape::new(nh, kvh, hd, bs).with_window(window);
            let inp = AttnInput {
                shape,
                q: &qv,
                positions: &positions,
                token_seq: &seqs,
                block_tables: &tables,
                max_blocks,
                k: rows(&kb, &kq),
                v: rows(&vb, &vq),
            };
            let mut plan = AttnPlan::default();
            plan.build(&shape, &seqs, &positions);
            // The deep query reads whole slots (all KV heads in one item).
            if window == 0 || window > 512 {
                assert!(plan.items.iter().any(|i| i.ng as usize == kvh && i.nt == 1));
            }
            let want = run(Isa::Portable, &inp, &plan);
            for isa in Isa::available() {
                let got = run(isa, &inp, &plan);
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{isa:?} {kind} hd={hd} window={window} heads={nh}/{kvh}"
                );
                let row = nh * hd;
                for i in 0..t {
                    let one = AttnInput {
                        q: &qv[i * row..(i + 1) * row],
                        positions: &positions[i..i + 1],
                        token_seq: &seqs[i..i + 1],
                        ..inp
                    };
                    let mut alone = AttnPlan::default();
                    alone.build(&shape, one.token_seq, one.positions);
                    let got = run(isa, &one, &alone);
                    assert!(
                        got.iter()
                            .zip(&want[i * row..(i + 1) * row])
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{isa:?} hd={hd} query {i} alone"
                    );
                }
                // Many decoding sequences at once (every run a single
                // token, the deep query between each of the others): the
                // shallow ones read whole slots too, with the same bits.
                let order: Vec<usize> = (1..t).flat_map(|i| [0, i]).collect();
                let pick = |v: &[u32]| -> Vec<u32> { order.iter().map(|&i| v[i]).collect() };
                let (dpos, dseq) = (pick(&positions), pick(&seqs));
                let dq: Vec<f32> = order
                    .iter()
                    .flat_map(|&i| qv[i * row..(i + 1) * row].iter().copied())
                    .collect();
                let many = AttnInput {
                    q: &dq,
                    positions: &dpos,
                    token_seq: &dseq,
                    ..inp
                };
                let mut plan = AttnPlan::default();
                plan.build(&shape, &dseq, &dpos);
                assert!(plan.items.iter().all(|i| i.nt == 1 && i.ng as usize == kvh));
                let got = run(isa, &many, &plan);
                for (j, &i) in order.iter().enumerate() {
                    assert!(
                        got[j * row..(j + 1) * row]
                            .iter()
                            .zip(&want[i * row..(i + 1) * row])
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{isa:?} hd={hd} query {i} among decoding sequences"
                    );
                }
            }
            let meta = PagedMeta {
                block_size: bs,
                block_tables: &tables,
                max_blocks,
                token_seq: &seqs,
                token_pos: &positions,
                scale: shape.scale,
                window,
            };
            let slow = paged_attention_slow(&q, &k, &v, &meta).unwrap();
            let slow = slow.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let mut want = want;
            if kind.is_quantized() {
                crate::quant::hadamard64(&mut want);
            }
            // (A NaN anywhere fails: `f32::max` would pass over it.)
            let d = slow
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, |m, x| {
                    if m.is_nan() || x.is_nan() {
                        f32::NAN
                    } else {
                        m.max(x)
                    }
                });
            assert!(d < 1e-4, "{kind} hd={hd} window={window}: {d}");
        }
    }
}
