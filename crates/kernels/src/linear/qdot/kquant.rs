//! K-quant super-blocks (Q4_K, Q5_K, Q6_K) in tiles of 16 rows.
//!
//! A GGML super-block holds 256 values of a row: eight sub-blocks of 32
//! with 6-bit scales and minimums under an f16 scale and minimum (Q4_K,
//! Q5_K: `x = d·sc·n − dmin·m`), or sixteen groups of 16 with signed 8-bit
//! scales under an f16 scale (Q6_K: `x = d·sc·(n − 32)`). The activations
//! stay in blocks of 32 with their own scales, so each sub-block is one
//! term of the sum, with the same float steps as the 32-value formats:
//!
//! ```text
//! Q4_K, Q5_K:  D = f32(d)·sc,  M = −f32(dmin)·m         (exact in f32)
//!              a = Σ n·q;  s = f32(a₁)·d₁ (+ f32(a₂)·d₂);  y = fma(D, s, y);  y = fma(M, Σx, y)
//! Q6_K:        a = sc_lo·Σ_lo (n − 32)·q + sc_hi·Σ_hi (n − 32)·q    (exact in i32)
//!              s as above;  y = fma(f32(d), s, y)
//! ```
//!
//! Tile record per 16 rows and super-block: the 16 f16 scales; Q4_K and
//! Q5_K then the 16 f16 minimums, the scales `sc` as bytes (`16·j + r`
//! for sub-block `j`, row `r`) and the minimums `m` likewise; Q6_K then
//! its 16 signed scales (`16·h + r` for group `h`). Then each sub-block:
//! Q5_K's fifth bits as eight 64-bit masks (as Q5_0's), the low four bits
//! in the 32-value formats' layout, and Q6_K's top two bits in two
//! 64-byte registers (register `c / 2`, byte `4r + e`, bits
//! `4·(c % 2)..`: two bits for value `4c + e`, then two for `16 + 4c + e`).
//! Every field of the GGML block is kept, so [`super::Packed::unpack`]
//! restores its bytes exactly.

use super::{combine, ActBlock, Kind, Packed, QIsa, GROUP, MAX_NI};
use crate::linear::matvec::f16_to_f32;

/// Values per super-block.
pub(super) const QK: usize = 256;

/// One GGML super-block, its fields unpacked.
pub(super) struct Super {
    d: u16,
    dmin: u16,
    /// Q4_K, Q5_K: eight 6-bit scales; Q6_K: sixteen signed ones.
    sc: [i32; 16],
    m: [u8; 8],
    /// The unsigned values (Q4_K: 4 bits, Q5_K: 5, Q6_K: 6).
    n: [u8; QK],
}

impl Kind {
    /// Bytes before the first sub-block of a tile record.
    fn header(self) -> usize {
        if self == Kind::Q6K {
            32 + 16 * GROUP
        } else {
            64 + 16 * GROUP
        }
    }

    /// Bytes of one sub-block in a tile record.
    fn sub_bytes(self) -> usize {
        match self {
            Kind::Q4K => 256,
            Kind::Q5K => 320,
            _ => 384,
        }
    }

    pub(super) fn sub_at(self, j: usize) -> usize {
        self.header() + j * self.sub_bytes()
    }

    /// Bytes of one tile record (16 rows, one super-block).
    pub(super) fn k_record(self) -> usize {
        self.sub_at(8)
    }
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// The fields of the GGML super-block `blk`, as GGML's dequantization
/// reads them.
pub(super) fn decode(kind: Kind, blk: &[u8]) -> Super {
    let mut s = Super {
        d: 0,
        dmin: 0,
        sc: [0; 16],
        m: [0; 8],
        n: [0; QK],
    };
    if kind == Kind::Q6K {
        let (ql, qh) = (&blk[..128], &blk[128..192]);
        for h in 0..16 {
            s.sc[h] = i32::from(blk[192 + h] as i8);
        }
        s.d = le16(blk, 208);
        for half in 0..2 {
            let n = &mut s.n[128 * half..128 * (half + 1)];
            for l in 0..32 {
                let (a, b, q) = (ql[64 * half + l], ql[64 * half + l + 32], qh[32 * half + l]);
                n[l] = a & 0xF | (q & 3) << 4;
                n[l + 32] = b & 0xF | (q >> 2 & 3) << 4;
                n[l + 64] = a >> 4 | (q >> 4 & 3) << 4;
                n[l + 96] = b >> 4 | (q >> 6 & 3) << 4;
            }
        }
        return s;
    }
    s.d = le16(blk, 0);
    s.dmin = le16(blk, 2);
    let q = &blk[4..16];
    for j in 0..8 {
        let (sc, m) = if j < 4 {
            (q[j] & 63, q[j + 4] & 63)
        } else {
            (
                q[j + 4] & 0xF | (q[j - 4] >> 6) << 4,
                q[j + 4] >> 4 | (q[j] >> 6) << 4,
            )
        };
        s.sc[j] = i32::from(sc);
        s.m[j] = m;
    }
    let (qh, qs) = if kind == Kind::Q5K {
        (Some(&blk[16..48]), &blk[48..176])
    } else {
        (None, &blk[16..144])
    };
    for p in 0..4 {
        for l in 0..32 {
            let (mut lo, mut hi) = (qs[32 * p + l] & 0xF, qs[32 * p + l] >> 4);
            if let Some(qh) = qh {
                lo |= (qh[l] >> (2 * p) & 1) << 4;
                hi |= (qh[l] >> (2 * p + 1) & 1) << 4;
            }
            s.n[64 * p + l] = lo;
            s.n[64 * p + 32 + l] = hi;
        }
    }
    s
}

/// The GGML bytes of `s` (the inverse of [`decode`]).
fn encode(kind: Kind, s: &Super, blk: &mut [u8]) {
    blk.fill(0);
    if kind == Kind::Q6K {
        for half in 0..2 {
            let n = &s.n[128 * half..128 * (half + 1)];
            for l in 0..32 {
                blk[64 * half + l] = n[l] & 0xF | (n[l + 64] & 0xF) << 4;
                blk[64 * half + l + 32] = n[l + 32] & 0xF | (n[l + 96] & 0xF) << 4;
                blk[128 + 32 * half + l] = n[l] >> 4
                    | (n[l + 32] >> 4) << 2
                    | (n[l + 64] >> 4) << 4
                    | (n[l + 96] >> 4) << 6;
            }
        }
        for h in 0..16 {
            blk[192 + h] = s.sc[h] as i8 as u8;
        }
        blk[208..210].copy_from_slice(&s.d.to_le_bytes());
        return;
    }
    blk[0..2].copy_from_slice(&s.d.to_le_bytes());
    blk[2..4].copy_from_slice(&s.dmin.to_le_bytes());
    let sc = |j: usize| s.sc[j] as u8;
    for j in 0..4 {
        blk[4 + j] = sc(j) | (sc(j + 4) >> 4) << 6;
        blk[8 + j] = s.m[j] | (s.m[j + 4] >> 4) << 6;
        blk[12 + j] = sc(j + 4) & 0xF | (s.m[j + 4] & 0xF) << 4;
    }
    let qs_at = if kind == Kind::Q5K { 48 } else { 16 };
    for p in 0..4 {
        for l in 0..32 {
            let (lo, hi) = (s.n[64 * p + l], s.n[64 * p + 32 + l]);
            blk[qs_at + 32 * p + l] = lo & 0xF | (hi & 0xF) << 4;
            if kind == Kind::Q5K {
                blk[16 + l] |= (lo >> 4) << (2 * p) | (hi >> 4) << (2 * p + 1);
            }
        }
    }
}

/// Row `r`'s fields in the tile record `rec`.
fn read(kind: Kind, rec: &[u8], r: usize) -> Super {
    let mut s = Super {
        d: le16(rec, 2 * r),
        dmin: 0,
        sc: [0; 16],
        m: [0; 8],
        n: [0; QK],
    };
    if kind == Kind::Q6K {
        for h in 0..16 {
            s.sc[h] = i32::from(rec[32 + 16 * h + r] as i8);
        }
    } else {
        s.dmin = le16(rec, 32 + 2 * r);
        for j in 0..8 {
            s.sc[j] = i32::from(rec[64 + 16 * j + r]);
            s.m[j] = rec[64 + 16 * GROUP / 2 + 16 * j + r];
        }
    }
    for j in 0..8 {
        let sub = &rec[kind.sub_at(j)..kind.sub_at(j + 1)];
        let vals = if kind == Kind::Q5K { &sub[64..] } else { sub };
        let n = &mut s.n[32 * j..32 * (j + 1)];
        for c in 0..4 {
            for e in 0..4 {
                let bit = 4 * r + e;
                let byte = vals[64 * c + bit];
                let (mut lo, mut hi) = (byte & 0xF, byte >> 4);
                match kind {
                    Kind::Q5K => {
                        lo |= (sub[8 * c + bit / 8] >> (bit % 8) & 1) << 4;
                        hi |= (sub[8 * (c + 4) + bit / 8] >> (bit % 8) & 1) << 4;
                    }
                    Kind::Q6K => {
                        let two = sub[256 + 64 * (c / 2) + bit] >> (4 * (c % 2));
                        lo |= (two & 3) << 4;
                        hi |= (two >> 2 & 3) << 4;
                    }
                    _ => {}
                }
                n[4 * c + e] = lo;
                n[16 + 4 * c + e] = hi;
            }
        }
    }
    s
}

/// Writes row `r`'s fields into the (zeroed) tile record `rec`.
fn write(kind: Kind, s: &Super, rec: &mut [u8], r: usize) {
    rec[2 * r..2 * r + 2].copy_from_slice(&s.d.to_le_bytes());
    if kind == Kind::Q6K {
        for h in 0..16 {
            rec[32 + 16 * h + r] = s.sc[h] as i8 as u8;
        }
    } else {
        rec[32 + 2 * r..34 + 2 * r].copy_from_slice(&s.dmin.to_le_bytes());
        for j in 0..8 {
            rec[64 + 16 * j + r] = s.sc[j] as u8;
            rec[64 + 16 * GROUP / 2 + 16 * j + r] = s.m[j];
        }
    }
    for j in 0..8 {
        let (a, b) = (kind.sub_at(j), kind.sub_at(j + 1));
        let sub = &mut rec[a..b];
        let n = &s.n[32 * j..32 * (j + 1)];
        for c in 0..4 {
            for e in 0..4 {
                let bit = 4 * r + e;
                let (lo, hi) = (n[4 * c + e], n[16 + 4 * c + e]);
                let vals_at = if kind == Kind::Q5K { 64 } else { 0 };
                sub[vals_at + 64 * c + bit] = lo & 0xF | (hi & 0xF) << 4;
                match kind {
                    Kind::Q5K => {
                        sub[8 * c + bit / 8] |= (lo >> 4 & 1) << (bit % 8);
                        sub[8 * (c + 4) + bit / 8] |= (hi >> 4 & 1) << (bit % 8);
                    }
                    Kind::Q6K => {
                        let two = (lo >> 4) | (hi >> 4) << 2;
                        sub[256 + 64 * (c / 2) + bit] |= two << (4 * (c % 2));
                    }
                    _ => {}
                }
            }
        }
    }
}

/// Writes `w`'s tiles (GGML rows `data` of `nsb` super-blocks each) into
/// `out`.
pub(super) fn pack_into(kind: Kind, data: &[u8], n: usize, nsb: usize, out: &mut [u8]) {
    let (bb, rec) = (kind.k_block(), kind.k_record());
    for row in 0..n {
        let (g, r) = (row / GROUP, row % GROUP);
        for sb in 0..nsb {
            let blk = &data[(row * nsb + sb) * bb..(row * nsb + sb + 1) * bb];
            let at = (g * nsb + sb) * rec;
            write(kind, &decode(kind, blk), &mut out[at..at + rec], r);
        }
    }
}

/// The GGML bytes of the tiles `tiles` (`n` rows of `nsb` super-blocks).
pub(super) fn unpack(kind: Kind, tiles: &[u8], n: usize, nsb: usize) -> Vec<u8> {
    let (bb, rec) = (kind.k_block(), kind.k_record());
    let mut out = vec![0u8; n * nsb * bb];
    for row in 0..n {
        let (g, r) = (row / GROUP, row % GROUP);
        for sb in 0..nsb {
            let at = (g * nsb + sb) * rec;
            let blk = &mut out[(row * nsb + sb) * bb..(row * nsb + sb + 1) * bb];
            encode(kind, &read(kind, &tiles[at..at + rec], r), blk);
        }
    }
    out
}

/// One 32-value term of a super-block: its float scale and minimum, its
/// signed integer weights, and the integer scales of its two halves
/// (Q6_K; 1 and 1 otherwise).
struct Sub {
    d: f32,
    m: f32,
    w: [i32; 32],
    sc: [i32; 2],
}

fn subs(kind: Kind, s: &Super) -> [Sub; 8] {
    let d = f16_to_f32(s.d);
    let dmin = -f16_to_f32(s.dmin);
    std::array::from_fn(|j| {
        let n = &s.n[32 * j..32 * (j + 1)];
        if kind == Kind::Q6K {
            Sub {
                d,
                m: 0.0,
                w: std::array::from_fn(|v| i32::from(n[v]) - 32),
                sc: [s.sc[2 * j], s.sc[2 * j + 1]],
            }
        } else {
            Sub {
                d: d * s.sc[j] as f32,
                m: dmin * f32::from(s.m[j]),
                w: std::array::from_fn(|v| i32::from(n[v])),
                sc: [1, 1],
            }
        }
    })
}

/// `y` plus one sub-block against one activation block (the module docs'
/// steps, in scalar code).
fn sub_dot(kind: Kind, sub: &Sub, a: &ActBlock, two: bool, y: f32) -> f32 {
    let level = |l: usize| {
        let (mut lo, mut hi) = (0i32, 0i32);
        for v in 0..16 {
            lo += sub.w[v] * i32::from(a.q[l][v]);
            hi += sub.w[16 + v] * i32::from(a.q[l][16 + v]);
        }
        sub.sc[0] * lo + sub.sc[1] * hi
    };
    let a2 = if two { level(1) } else { 0 };
    combine(kind.has_min(), two, level(0), a2, a, sub.d, sub.m, y)
}

/// The reference for one row: GGML super-blocks `row` against one input's
/// activation blocks.
pub(super) fn row_slow(kind: Kind, row: &[u8], acts: &[ActBlock], two: bool) -> f32 {
    let mut y = 0f32;
    for (sb, blk) in row.chunks_exact(kind.k_block()).enumerate() {
        for (j, sub) in subs(kind, &decode(kind, blk)).iter().enumerate() {
            y = sub_dot(kind, sub, &acts[8 * sb + j], two, y);
        }
    }
    y
}

/// Scalar tiles: every row's fields read back from the tile, then the
/// reference's steps.
fn ktile_portable<const K: u8, const TWO: bool, const NI: usize>(
    w: &Packed,
    g: usize,
    ins: &[&[ActBlock]; MAX_NI],
    out: &mut [[f32; GROUP]; MAX_NI],
) {
    let kind = super::kind_of(K);
    let rec = kind.k_record();
    let tile = w.tile(g);
    let mut y = [[0f32; GROUP]; NI];
    for sb in 0..w.k / QK {
        let t = &tile[sb * rec..(sb + 1) * rec];
        for r in 0..GROUP {
            let subs = subs(kind, &read(kind, t, r));
            for (j, sub) in subs.iter().enumerate() {
                for i in 0..NI {
                    y[i][r] = sub_dot(kind, sub, &ins[i][8 * sb + j], TWO, y[i][r]);
                }
            }
        }
    }
    out[..NI].copy_from_slice(&y);
}

/// One tile of a K-quant weight (see `super::run_tile`).
pub(super) fn run_ktile(
    isa: QIsa,
    w: &Packed,
    g: usize,
    ins: &[&[ActBlock]; MAX_NI],
    ni: usize,
    two: bool,
    out: &mut [[f32; GROUP]; MAX_NI],
) {
    dispatch_tiles!(
        isa,
        (w, g, ins, out),
        two,
        ni,
        [Q4K 5, Q5K 6, Q6K 7],
        "a K-quant tile",
        [ktile_portable, ktile_avx512, ktile_avxvnni, ktile_avx2, ktile_neon]
    )
}

#[cfg(target_arch = "x86_64")]
use x86::{ktile_avx2, ktile_avx512, ktile_avxvnni};

#[cfg(target_arch = "aarch64")]
use arm::ktile_neon;

#[cfg(target_arch = "aarch64")]
mod arm {
    use std::arch::aarch64::*;

    use super::super::arm::{f16x4, fifth_bits, nibbles, quad, sdot, steps};
    use super::super::{kind_of, ActBlock, Kind, Packed, GROUP, MAX_NI};
    use super::QK;

    /// Four bytes at `p` as f32 (unsigned) or i32 (signed) lanes.
    #[inline(always)]
    unsafe fn four_u8(p: *const u8) -> float32x4_t {
        let b: [f32; 4] = std::array::from_fn(|i| f32::from(*p.add(i)));
        vld1q_f32(b.as_ptr())
    }

    #[inline(always)]
    unsafe fn four_i8(p: *const u8) -> int32x4_t {
        let b: [i32; 4] = std::array::from_fn(|i| i32::from(*p.add(i) as i8));
        vld1q_s32(b.as_ptr())
    }

    /// Four passes of 4 rows (see `super::super::arm::tile_neon`).
    ///
    /// # Safety
    /// The CPU has NEON and the dot-product extension.
    #[target_feature(enable = "neon,dotprod")]
    pub(super) unsafe fn ktile_neon<const K: u8, const TWO: bool, const NI: usize>(
        w: &Packed,
        g: usize,
        ins: &[&[ActBlock]; MAX_NI],
        out: &mut [[f32; GROUP]; MAX_NI],
    ) {
        let kind = kind_of(K);
        let q6 = kind == Kind::Q6K;
        let rec = kind.k_record();
        let p = w.tile(g).as_ptr();
        let three = vdupq_n_u8(3);
        for quarter in 0..4 {
            let rows = 4 * quarter;
            let mut y = [vdupq_n_f32(0.0); NI];
            for sb in 0..w.k / QK {
                let t = p.add(sb * rec);
                let d = f16x4(t.add(2 * rows));
                let dmin = vnegq_f32(f16x4(t.add(32 + 2 * rows)));
                for j in 0..8 {
                    let sub = t.add(kind.sub_at(j));
                    let vals = if kind == Kind::Q5K { sub.add(64) } else { sub };
                    let mut wv = [vdupq_n_s8(0); 8];
                    for c in 0..4 {
                        (wv[c], wv[c + 4]) = nibbles(vals.add(64 * c + 4 * rows));
                    }
                    if kind == Kind::Q5K {
                        let masks = sub as *const u64;
                        for v in 0..8 {
                            let k = (masks.add(v).read_unaligned() >> (4 * rows)) as u16;
                            wv[v] = vorrq_s8(wv[v], fifth_bits(k));
                        }
                    }
                    if q6 {
                        for c in 0..4 {
                            let mut h = vld1q_u8(sub.add(256 + 64 * (c / 2) + 4 * rows));
                            if c % 2 == 1 {
                                h = vshrq_n_u8::<4>(h);
                            }
                            let lo = vshlq_n_u8::<4>(vandq_u8(h, three));
                            let hi = vshlq_n_u8::<4>(vandq_u8(vshrq_n_u8::<2>(h), three));
                            wv[c] = vorrq_s8(wv[c], vreinterpretq_s8_u8(lo));
                            wv[c + 4] = vorrq_s8(wv[c + 4], vreinterpretq_s8_u8(hi));
                        }
                    }
                    let (scale, min) = if q6 {
                        (d, None)
                    } else {
                        (
                            vmulq_f32(d, four_u8(t.add(64 + 16 * j + rows))),
                            Some(vmulq_f32(
                                dmin,
                                four_u8(t.add(64 + 16 * GROUP / 2 + 16 * j + rows)),
                            )),
                        )
                    };
                    let sc = (
                        four_i8(t.add(32 + 16 * 2 * j + rows)),
                        four_i8(t.add(32 + 16 * (2 * j + 1) + rows)),
                    );
                    for i in 0..NI {
                        let a: &ActBlock = &ins[i][8 * sb + j];
                        let level = |l: usize| {
                            if !q6 {
                                let mut acc = vdupq_n_s32(0);
                                for v in 0..8 {
                                    acc = sdot(acc, wv[v], quad(&a.q[l], v));
                                }
                                return acc;
                            }
                            let mut lo = vdupq_n_s32(-32 * a.h[l]);
                            let mut hi = vdupq_n_s32(-32 * (a.s[l] - a.h[l]));
                            for v in 0..4 {
                                lo = sdot(lo, wv[v], quad(&a.q[l], v));
                                hi = sdot(hi, wv[v + 4], quad(&a.q[l], v + 4));
                            }
                            vmlaq_s32(vmulq_s32(lo, sc.0), hi, sc.1)
                        };
                        let a1 = level(0);
                        let a2 = if TWO { level(1) } else { a1 };
                        y[i] = steps::<TWO>(a, a1, a2, scale, min, y[i]);
                    }
                }
            }
            for i in 0..NI {
                vst1q_f32(out[i].as_mut_ptr().add(rows), y[i]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    use super::super::x86::{chains512, fifth_bits_256, quad, Dot8, Hints, Maddubs, Vnni256};
    use super::super::{kind_of, ActBlock, Kind, Packed, GROUP, MAX_NI};
    use super::QK;

    /// The unsigned values of half `half` (8 rows) of the K-quant
    /// sub-block at `sub` (Q4_K, Q5_K with its fifth bits, Q6_K with its
    /// two high bits), as the 256-bit tiles hold them: register `j`, byte
    /// `4r + e`: value `4j + e` of row `r`.
    #[inline(always)]
    pub(in super::super) unsafe fn sub_values256(
        kind: Kind,
        sub: *const u8,
        half: usize,
    ) -> [__m256i; 8] {
        let nibble = _mm256_set1_epi8(0x0F);
        let vals = if kind == Kind::Q5K { sub.add(64) } else { sub };
        let mut wv = [_mm256_setzero_si256(); 8];
        for c in 0..4 {
            let raw = _mm256_loadu_si256(vals.add(64 * c + 32 * half) as *const _);
            wv[c] = _mm256_and_si256(raw, nibble);
            wv[c + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        }
        if kind == Kind::Q5K {
            let masks = sub as *const u64;
            for v in 0..8 {
                let k = (masks.add(v).read_unaligned() >> (32 * half)) as u32;
                wv[v] = _mm256_or_si256(wv[v], fifth_bits_256(k));
            }
        }
        if kind == Kind::Q6K {
            let two_bits = _mm256_set1_epi8(3);
            for c in 0..4 {
                let at = 256 + 64 * (c / 2) + 32 * half;
                let mut h = _mm256_loadu_si256(sub.add(at) as *const _);
                if c % 2 == 1 {
                    h = _mm256_srli_epi16(h, 4);
                }
                let lo = _mm256_and_si256(h, two_bits);
                let hi = _mm256_and_si256(_mm256_srli_epi16(h, 2), two_bits);
                wv[c] = _mm256_or_si256(wv[c], _mm256_slli_epi16(lo, 4));
                wv[c + 4] = _mm256_or_si256(wv[c + 4], _mm256_slli_epi16(hi, 4));
            }
        }
        wv
    }

    /// How far ahead in a tile's stream the K-quant tiles hint records
    /// into L2: 6 KiB, in whole records (three of Q4_K's, two of Q6_K's).
    /// Measured with `examples/tile_stream.rs` against the read loop
    /// (AVX-512 VNNI, Zen 5, 2026-11-28): Q4_K on one thread streamed at
    /// 0.72–0.76 of it 16–64 KiB ahead, 0.88–0.93 at 4–6 KiB, 0.72–0.77 at
    /// 2 KiB; on two threads 0.97–0.98 at 6 KiB against 0.92–0.95 at 16
    /// (Q6_K 0.86–0.90 against 0.84–0.87). The 256-bit tiles, which the
    /// arithmetic holds below the read rate on one thread, do not mind.
    fn ahead(rec: usize) -> usize {
        (6usize << 10).div_ceil(rec) * rec
    }

    /// Flips the sign of every lane (exact, like the scalar negation).
    #[inline(always)]
    unsafe fn neg512(v: __m512) -> __m512 {
        _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(v),
            _mm512_set1_epi32(i32::MIN),
        ))
    }

    /// One level's sum for a sub-block, as f32: plain (Q4_K, Q5_K) or with
    /// Q6_K's half scales (`sc`, as f32) and offset. Q6_K's scaled sum is
    /// the integer `sc₀·lo + sc₁·hi` exactly: `|lo|, |hi| ≤ 16·32·127`
    /// and `|sc| ≤ 128`, so the product and the sum stay below 2²⁴. The
    /// float multiply and multiply-add take the place of two `vpmulld`,
    /// which are slower on the ports `vpdpbusd` needs.
    #[inline(always)]
    unsafe fn level512(
        q6: bool,
        a: &ActBlock,
        l: usize,
        wv: &[__m512i; 8],
        sc: (__m512, __m512),
        hints: &Hints,
    ) -> __m512 {
        if !q6 {
            let q = |j| _mm512_set1_epi32(quad(&a.q[l], j));
            return _mm512_cvtepi32_ps(chains512(_mm512_setzero_si512(), |j| {
                hints.line(j);
                (wv[j], q(j))
            }));
        }
        let mut lo = _mm512_set1_epi32(-32 * a.h[l]);
        let mut hi = _mm512_set1_epi32(-32 * (a.s[l] - a.h[l]));
        for j in 0..4 {
            hints.line(2 * j);
            lo = _mm512_dpbusd_epi32(lo, wv[j], _mm512_set1_epi32(quad(&a.q[l], j)));
            hints.line(2 * j + 1);
            hi = _mm512_dpbusd_epi32(hi, wv[j + 4], _mm512_set1_epi32(quad(&a.q[l], j + 4)));
        }
        let lo = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), sc.0);
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), sc.1, lo)
    }

    /// A tile record's f16 scales and negated minimums (Q4_K, Q5_K; the
    /// second is unused for Q6_K), one lane per row.
    #[inline(always)]
    pub(in super::super) unsafe fn super_scales512(t: *const u8) -> (__m512, __m512) {
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(t as *const __m256i));
        let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(t.add(32) as *const __m256i));
        (d, neg512(dmin))
    }

    /// Sub-block `j`'s scale and minimum per row (`D`, `M` of the module
    /// docs; Q6_K: `d` and no minimum) and Q6_K's half scales as f32,
    /// from the record at `t` and its [`super_scales512`].
    #[inline(always)]
    pub(in super::super) unsafe fn sub_scales512(
        kind: Kind,
        t: *const u8,
        j: usize,
        (d, dmin): (__m512, __m512),
    ) -> (__m512, __m512, (__m512, __m512)) {
        let bytes = |at: usize| _mm_loadu_si128(t.add(at) as *const __m128i);
        let z = _mm512_setzero_ps();
        if kind == Kind::Q6K {
            let f = |at: usize| _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes(at)));
            let sc = (f(32 + 16 * 2 * j), f(32 + 16 * (2 * j + 1)));
            (d, z, sc)
        } else {
            let f = |at: usize| _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes(at)));
            (
                _mm512_mul_ps(d, f(64 + 16 * j)),
                _mm512_mul_ps(dmin, f(64 + 16 * GROUP / 2 + 16 * j)),
                (z, z),
            )
        }
    }

    /// The unsigned values `n` of the sub-block at `sub` (4, 5 or 6 bits),
    /// in the 32-value formats' registers (`super::super::x86::block_values512`).
    #[inline(always)]
    pub(in super::super) unsafe fn sub_values512(kind: Kind, sub: *const u8) -> [__m512i; 8] {
        let nibble = _mm512_set1_epi8(0x0F);
        let vals = if kind == Kind::Q5K { sub.add(64) } else { sub };
        let mut wv = [_mm512_setzero_si512(); 8];
        for c in 0..4 {
            let raw = _mm512_loadu_si512(vals.add(64 * c) as *const _);
            wv[c] = _mm512_and_si512(raw, nibble);
            wv[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        }
        if kind == Kind::Q5K {
            let fifth = _mm512_set1_epi8(0x10);
            let masks = sub as *const u64;
            for v in 0..8 {
                let k: __mmask64 = masks.add(v).read_unaligned();
                wv[v] = _mm512_mask_add_epi8(wv[v], k, wv[v], fifth);
            }
        }
        if kind == Kind::Q6K {
            let two_bits = _mm512_set1_epi8(3);
            for c in 0..4 {
                let mut h = _mm512_loadu_si512(sub.add(256 + 64 * (c / 2)) as *const _);
                if c % 2 == 1 {
                    h = _mm512_srli_epi16(h, 4);
                }
                let lo = _mm512_and_si512(h, two_bits);
                let hi = _mm512_and_si512(_mm512_srli_epi16(h, 2), two_bits);
                wv[c] = _mm512_or_si512(wv[c], _mm512_slli_epi16(lo, 4));
                wv[c + 4] = _mm512_or_si512(wv[c + 4], _mm512_slli_epi16(hi, 4));
            }
        }
        wv
    }

    /// # Safety
    /// The CPU has AVX-512 F/BW/VL and VNNI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn ktile_avx512<const K: u8, const TWO: bool, const NI: usize>(
        w: &Packed,
        g: usize,
        ins: &[&[ActBlock]; MAX_NI],
        out: &mut [[f32; GROUP]; MAX_NI],
    ) {
        let kind = kind_of(K);
        let q6 = kind == Kind::Q6K;
        let rec = kind.k_record();
        let p = w.tile(g).as_ptr();
        let mut y = [_mm512_setzero_ps(); NI];
        for sb in 0..w.k / QK {
            let t = p.add(sb * rec);
            // Records `ahead` on (tiles follow each other in memory) into
            // L2, spread over the sub-blocks as the 256-bit
            // tiles do.
            let dist = ahead(rec);
            let (d, dmin) = super_scales512(t);
            for j in 0..8 {
                let sub = t.add(kind.sub_at(j));
                let hints = sub_hints(kind, t, j, dist);
                let wv = sub_values512(kind, sub);
                let (scale, min, sc) = sub_scales512(kind, t, j, (d, dmin));
                // Input by input, the sums in registers (as `tile_avx512`).
                unrolled!(NI, |i| {
                    let a: &ActBlock = &ins[i][8 * sb + j];
                    let h = if i == 0 { hints } else { Hints::NONE };
                    let a1 = level512(q6, a, 0, &wv, sc, &h);
                    let mut s = _mm512_mul_ps(a1, _mm512_set1_ps(a.d[0]));
                    if TWO {
                        let a2 = level512(q6, a, 1, &wv, sc, &Hints::NONE);
                        s = _mm512_fmadd_ps(a2, _mm512_set1_ps(a.d[1]), s);
                    }
                    y[i] = _mm512_fmadd_ps(scale, s, y[i]);
                    if !q6 {
                        y[i] = _mm512_fmadd_ps(min, _mm512_set1_ps(a.xsum), y[i]);
                    }
                });
                hints.rest(8);
            }
        }
        for i in 0..NI {
            _mm512_storeu_ps(out[i].as_mut_ptr(), y[i]);
        }
    }

    /// The lines `dist` bytes past sub-block `j` of the record at `t` and
    /// one line of that record's header (the header's lines go one a
    /// sub-block), for the first input's products to hint ([`Hints`]).
    #[inline(always)]
    fn sub_hints(kind: Kind, t: *const u8, j: usize, dist: usize) -> Hints {
        let ahead = t.wrapping_add(dist);
        Hints::span(ahead.wrapping_add(kind.sub_at(j)), kind.sub_bytes())
            .and_line((64 * j < kind.header()).then(|| ahead.wrapping_add(64 * j)))
    }

    /// # Safety
    /// The CPU has AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn ktile_avx2<const K: u8, const TWO: bool, const NI: usize>(
        w: &Packed,
        g: usize,
        ins: &[&[ActBlock]; MAX_NI],
        out: &mut [[f32; GROUP]; MAX_NI],
    ) {
        ktile_256::<Maddubs, K, TWO, NI>(w, g, ins, out)
    }

    /// # Safety
    /// The CPU has AVX-VNNI, AVX2, FMA and F16C.
    #[target_feature(enable = "avxvnni,avx2,fma,f16c")]
    pub(super) unsafe fn ktile_avxvnni<const K: u8, const TWO: bool, const NI: usize>(
        w: &Packed,
        g: usize,
        ins: &[&[ActBlock]; MAX_NI],
        out: &mut [[f32; GROUP]; MAX_NI],
    ) {
        ktile_256::<Vnni256, K, TWO, NI>(w, g, ins, out)
    }

    /// [`level512`] for 8 rows.
    #[inline(always)]
    unsafe fn level256<D: Dot8>(
        kind: Kind,
        a: &ActBlock,
        l: usize,
        wv: &[__m256i; 8],
        sc: (__m256, __m256),
        (hints, first): (&Hints, usize),
    ) -> __m256 {
        let q = |j| _mm256_set1_epi32(quad(&a.q[l], j));
        if kind != Kind::Q6K {
            let sum = D::chains(_mm256_setzero_si256(), kind.bits(), |j| {
                hints.line(first + j);
                (wv[j], q(j))
            });
            return _mm256_cvtepi32_ps(sum);
        }
        let mut lo = _mm256_set1_epi32(-32 * a.h[l]);
        let mut hi = _mm256_set1_epi32(-32 * (a.s[l] - a.h[l]));
        for j in [0, 2] {
            hints.line(first + j);
            lo = D::dot2(lo, (wv[j], q(j)), (wv[j + 1], q(j + 1)));
            hints.line(first + j + 1);
            hi = D::dot2(hi, (wv[j + 4], q(j + 4)), (wv[j + 5], q(j + 5)));
        }
        let lo = _mm256_mul_ps(_mm256_cvtepi32_ps(lo), sc.0);
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), sc.1, lo)
    }

    /// The 16 rows as two registers of 8, both halves of each sub-block
    /// taken while its bytes are in L1: each 64-byte line of the tile is
    /// read from memory once and used whole (two passes over the tile,
    /// one per half, left the second pass's work out of the memory
    /// stream's shadow).
    #[inline(always)]
    unsafe fn ktile_256<D: Dot8, const K: u8, const TWO: bool, const NI: usize>(
        w: &Packed,
        g: usize,
        ins: &[&[ActBlock]; MAX_NI],
        out: &mut [[f32; GROUP]; MAX_NI],
    ) {
        let kind = kind_of(K);
        let q6 = kind == Kind::Q6K;
        let rec = kind.k_record();
        let p = w.tile(g).as_ptr();
        let sign = _mm256_set1_epi32(i32::MIN);
        let mut y = [[_mm256_setzero_ps(); NI]; 2];
        for sb in 0..w.k / QK {
            let t = p.add(sb * rec);
            let dist = ahead(rec);
            // Each half's f16 scale and negated minimum, once per record.
            let f16s = |at: usize, half: usize| {
                _mm256_cvtph_ps(_mm_loadu_si128(t.add(at + 16 * half) as *const __m128i))
            };
            let d = [f16s(0, 0), f16s(0, 1)];
            let neg =
                |v: __m256| _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(v), sign));
            let dmin = [neg(f16s(32, 0)), neg(f16s(32, 1))];
            for j in 0..8 {
                let sub = t.add(kind.sub_at(j));
                // Spread over the sub-blocks (a burst of a whole record's
                // lines overflows the miss buffers) and over the first
                // input's products, a line each (`Hints`): Q6_K's 4 + 4
                // slots, the others' 8 + 8.
                let hints = sub_hints(kind, t, j, dist);
                let per_half = if q6 { 4 } else { 8 };
                for half in 0..2 {
                    let eight = |at: usize| _mm_loadl_epi64(t.add(at + 8 * half) as *const __m128i);
                    let wv = sub_values256(kind, sub, half);
                    let (scale, min, sc) = if q6 {
                        let f = |at: usize| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight(at)));
                        let sc = (f(32 + 16 * 2 * j), f(32 + 16 * (2 * j + 1)));
                        (d[half], _mm256_setzero_ps(), sc)
                    } else {
                        let f = |at: usize| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight(at)));
                        let z = _mm256_setzero_ps();
                        (
                            _mm256_mul_ps(d[half], f(64 + 16 * j)),
                            _mm256_mul_ps(dmin[half], f(64 + 16 * GROUP / 2 + 16 * j)),
                            (z, z),
                        )
                    };
                    let y = &mut y[half];
                    // Written out, so that the sums stay in registers.
                    unrolled!(NI, |i| {
                        let a: &ActBlock = &ins[i][8 * sb + j];
                        let h = if i == 0 {
                            (&hints, per_half * half)
                        } else {
                            (&Hints::NONE, 0)
                        };
                        let a1 = level256::<D>(kind, a, 0, &wv, sc, h);
                        let mut s = _mm256_mul_ps(a1, _mm256_set1_ps(a.d[0]));
                        if TWO {
                            let a2 = level256::<D>(kind, a, 1, &wv, sc, (&Hints::NONE, 0));
                            s = _mm256_fmadd_ps(a2, _mm256_set1_ps(a.d[1]), s);
                        }
                        y[i] = _mm256_fmadd_ps(scale, s, y[i]);
                        if !q6 {
                            y[i] = _mm256_fmadd_ps(min, _mm256_set1_ps(a.xsum), y[i]);
                        }
                    });
                }
                hints.rest(2 * per_half);
            }
        }
        for half in 0..2 {
            for i in 0..NI {
                _mm256_storeu_ps(out[i].as_mut_ptr().add(8 * half), y[half][i]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::matvec::{WeightFormat, Weights};
    use candle_core::quantized::{GgmlDType, QTensor};

    /// The fields [`decode`] reads are GGML's: they give back the values
    /// candle's dequantization computes from the same bytes.
    #[test]
    fn decoded_fields_give_ggml_values() {
        for (d, kind) in [
            (GgmlDType::Q4K, Kind::Q4K),
            (GgmlDType::Q5K, Kind::Q5K),
            (GgmlDType::Q6K, Kind::Q6K),
        ] {
            let (n, k) = (5, 768);
            let x = crate::testing::seeded(&[n, k], 11, candle_core::DType::F32).unwrap();
            let q = QTensor::quantize(&x, d).unwrap();
            let data = q.data().unwrap().into_owned();
            let w = Weights::new(WeightFormat::from_ggml(d), &data, n, k).unwrap();
            let mut want = vec![0f32; k];
            for r in 0..n {
                w.dequantize_row(r, &mut want);
                let row = &data[r * w.row_bytes()..(r + 1) * w.row_bytes()];
                for (sb, blk) in row.chunks_exact(kind.k_block()).enumerate() {
                    let mut again = vec![0u8; blk.len()];
                    let fields = decode(kind, blk);
                    encode(kind, &fields, &mut again);
                    assert_eq!(again, blk, "{d:?}");
                    for (j, sub) in subs(kind, &fields).iter().enumerate() {
                        for v in 0..32 {
                            let sc = f64::from(sub.sc[v / 16]);
                            let got =
                                f64::from(sub.d) * sc * f64::from(sub.w[v]) + f64::from(sub.m);
                            let want = f64::from(want[QK * sb + 32 * j + v]);
                            assert!((got - want).abs() <= 1e-6 * want.abs().max(1e-3), "{d:?}");
                        }
                    }
                }
            }
        }
    }
}
