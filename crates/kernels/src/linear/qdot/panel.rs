//! AVX2 and AVX-VNNI products of many inputs (a prompt chunk) with
//! weights unpacked once per panel.
//!
//! The tiles ([`super::x86`]'s `tile_256`) hold a weight register in each
//! product and broadcast the activations, four bytes at a time: `maddubs`
//! takes its unsigned operand from a register and its signed one from a
//! register or memory, so the unsigned 4-bit weights unpacked per block
//! meet activation broadcasts that AVX2 cannot fold into the product
//! (AVX-512 can), and the tile re-broadcasts them for each half of its 16
//! rows. On a Zen 4 core those broadcasts, the sums kept live across both
//! halves and the unpacking held the tile at 40–42 G multiply-adds a
//! second, under half the ports' ceiling.
//!
//! Here the roles swap. A chunk of eight blocks (a K-quant super-block)
//! of 32 rows is unpacked once into signed bytes in L1 (`w − c`, with
//! `c = 2^(bits−1)`: Q4 `[−8, 7]`, Q5 `[−16, 15]`, Q6_K `[−32, 31]`),
//! and every input of the panel runs over it with its activations flipped
//! to unsigned bytes (`q + 128`, from `[1, 255]`), broadcast once per block
//! and level for all 32 rows, and the weights read by the products straight
//! from memory. The integer sums are the same integers:
//!
//! ```text
//! Σ w·q = Σ (q + 128)·(w − c) − 128·Σ (w − c) + c·Σq
//! ```
//!
//! with `−128·Σ(w − c)` a weight constant of the row and block, unpacked
//! with it, and `Σq` the activation block's own sum (so the kinds whose
//! integers carry an offset, Q4_0 and Q5_0, add `(c + bias)·Σq = 0`).
//! Pairs of products stay within `2·255·2^(bits−1)`, so the `maddubs`
//! groups added in i16 are those of the tiles (8, 4 and 2 for 4, 5 and 6
//! bits: 32,640 at most). The float steps are the tiles' in the same
//! order, so the results are the same bits (tested with every other path
//! against [`super::qmatvec_slow`]). Q8_0 (signed bytes that do not fit
//! the trick's pairs) keeps the tiles.
//!
//! AVX-VNNI's `vpdpbusd` takes the same operands (unsigned from a
//! register, signed from memory) and adds each lane's four products
//! straight into i32, so the same panels run on it without the i16 sums
//! and their widening `madd` (one instruction in 16 for 4-bit weights, and
//! the i16 adds: 14 of them). On one Zen 4 core, where the instruction runs
//! in AVX-512 VNNI's encoding ([`products_vnni_evex`]), the panels ran
//! 1.2–1.4× their `maddubs` form at the 1B model's shapes.

use std::arch::x86_64::*;

use super::kquant::x86::sub_values256;
use super::x86::{block_values256, i16_group, Dot8, Maddubs, Vnni256, VnniEvex256};
use super::{kind_of, ActBlock, Emit, Kind, Packed, GROUP};

/// Blocks of 32 values per chunk: one K-quant super-block.
const CH: usize = 8;
/// 8-row registers per panel of rows: two tiles.
const RR: usize = 4;
/// Inputs whose sums are kept while a panel of rows runs (in L1/L2).
const INPUTS: usize = 64;
/// The fewest inputs that take the panels (below, the unpacking of each
/// chunk is not shared enough to pay for itself).
pub(super) const MIN_INPUTS: usize = 16;

/// One block (or K-quant sub-block) of 8 rows, unpacked.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct Unit {
    /// The signed values `w − c`, as the tiles' registers hold them (byte
    /// `4r + e` of register `j`: value `4j + e` of row `r`).
    w: [[i8; 32]; 8],
    /// `−128·Σ(w − c)` per row; Q6_K: over its first 16 values.
    c0: [i32; 8],
    /// Q6_K: `−128·Σ(w − c)` over its last 16 values.
    c1: [i32; 8],
    /// The scale per row (K-quants Q4_K, Q5_K: `d·sc`).
    d: [f32; 8],
    /// The minimum's factor (Q4_1, Q5_1, Q4_K, Q5_K), or Q6_K's scale of
    /// its first 16 values.
    m: [f32; 8],
    /// Q6_K's scale of its last 16 values.
    sc1: [f32; 8],
}

const ZERO: Unit = Unit {
    w: [[0; 32]; 8],
    c0: [0; 8],
    c1: [0; 8],
    d: [0.0; 8],
    m: [0.0; 8],
    sc1: [0.0; 8],
};

/// `2^(bits−1)`, the centre the values are moved to.
const fn centre(kind: Kind) -> i32 {
    match kind {
        Kind::Q4_0 | Kind::Q4_1 | Kind::Q4K => 8,
        Kind::Q5_0 | Kind::Q5_1 | Kind::Q5K => 16,
        _ => 32,
    }
}

/// Rows `[r0, r1)` of `w` times `t ≥ MIN_INPUTS` inputs, as
/// [`super::qmatvec_keyed`] (which calls it, or [`products_avxvnni`], for
/// AVX2 or AVX-VNNI, two levels and every kind but Q8_0).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn products(
    w: &Packed,
    acts: &[ActBlock],
    t: usize,
    two: bool,
    r0: usize,
    r1: usize,
    emit: &mut Emit,
) {
    by_kind::<Maddubs>(w, acts, t, two, r0, r1, emit)
}

/// [`products`] with AVX-VNNI's `vpdpbusd`, which takes the flipped
/// activations as its unsigned operand and the signed weights from memory
/// as `maddubs` does, and adds its four products a lane straight into
/// i32: no i16 sums to widen.
///
/// # Safety
/// The CPU has AVX-VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avxvnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn products_avxvnni(
    w: &Packed,
    acts: &[ActBlock],
    t: usize,
    two: bool,
    r0: usize,
    r1: usize,
    emit: &mut Emit,
) {
    by_kind::<Vnni256>(w, acts, t, two, r0, r1, emit)
}

/// [`products_avxvnni`] in AVX-512 VNNI's encoding of the same 256-bit
/// instruction, for CPUs with AVX-512 VNNI and without AVX-VNNI (AMD Zen
/// 4): the every-path test runs the AVX-VNNI panels' code there, and
/// `examples/prefill_tiles --isas avxvnni-evex` times it.
///
/// # Safety
/// The CPU has AVX-512 F, VL and VNNI, AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn products_vnni_evex(
    w: &Packed,
    acts: &[ActBlock],
    t: usize,
    two: bool,
    r0: usize,
    r1: usize,
    emit: &mut Emit,
) {
    by_kind::<VnniEvex256>(w, acts, t, two, r0, r1, emit)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn by_kind<D: Dot8>(
    w: &Packed,
    acts: &[ActBlock],
    t: usize,
    two: bool,
    r0: usize,
    r1: usize,
    emit: &mut Emit,
) {
    macro_rules! kinds {
        ($($k:ident $n:literal),*) => {
            match (w.kind, two) {
                $((Kind::$k, false) => panels::<D, $n, false>(w, acts, t, r0, r1, emit),
                  (Kind::$k, true) => panels::<D, $n, true>(w, acts, t, r0, r1, emit),)*
                (Kind::Q8_0, _) => unreachable!("Q8_0 keeps the tiles"),
            }
        };
    }
    kinds!(Q4_0 0, Q4_1 1, Q5_0 3, Q5_1 4, Q4K 5, Q5K 6, Q6K 7)
}

#[inline(always)]
unsafe fn panels<D: Dot8, const K: u8, const TWO: bool>(
    w: &Packed,
    acts: &[ActBlock],
    t: usize,
    r0: usize,
    r1: usize,
    emit: &mut Emit,
) {
    let nb = w.nb;
    let (g0, g1) = (r0 / GROUP, r1.div_ceil(GROUP));
    let mut units = [[ZERO; RR]; CH];
    let mut sums = vec![[[0f32; 8]; RR]; INPUTS.min(t)];
    let mut flipped = vec![[[0u8; 32]; 2]; INPUTS.min(t) * nb];
    let flip = _mm256_set1_epi8(-128);
    for p0 in (0..t).step_by(INPUTS) {
        let p1 = (p0 + INPUTS).min(t);
        let sums = &mut sums[..p1 - p0];
        // The panel's activation bytes as unsigned `q + 128`, once for all
        // its rows (so that each broadcast is a plain load).
        let levels = if TWO { 2 } else { 1 };
        for (f, a) in flipped.iter_mut().zip(&acts[p0 * nb..p1 * nb]) {
            for l in 0..levels {
                let q = _mm256_loadu_si256(a.q[l].as_ptr() as *const __m256i);
                _mm256_storeu_si256(f[l].as_mut_ptr() as *mut __m256i, _mm256_xor_si256(q, flip));
            }
        }
        for gp in (g0..g1).step_by(RR / 2) {
            let tiles = (RR / 2).min(g1 - gp);
            for s in sums.iter_mut() {
                *s = [[0.0; 8]; RR];
            }
            for b0 in (0..nb).step_by(CH) {
                let len = CH.min(nb - b0);
                unpack::<K>(w, gp, tiles, b0, len, &mut units);
                let mut i = 0;
                let n = sums.len();
                // Two inputs at a time (but Q6_K, whose halves' sums would
                // not stay in registers: tried, two inputs against half the
                // rows ran at 31–36 G a second against this one-input loop's
                // 37–41 on a Zen 4 core): each weight register loaded once
                // for both.
                while i + 2 <= n && kind_of(K) != Kind::Q6K {
                    let a = |i: usize| &acts[(p0 + i) * nb + b0..][..len];
                    let f = |i: usize| &flipped[i * nb + b0..][..len];
                    let s = sums[i..i + 2].as_mut_ptr();
                    let s = [&mut *s, &mut *s.add(1)];
                    if tiles == 2 {
                        run2::<D, K, TWO, RR>(&units, [a(i), a(i + 1)], [f(i), f(i + 1)], s);
                    } else {
                        run2::<D, K, TWO, 2>(&units, [a(i), a(i + 1)], [f(i), f(i + 1)], s);
                    }
                    i += 2;
                }
                for (i, s) in sums.iter_mut().enumerate().skip(i) {
                    let a = &acts[(p0 + i) * nb + b0..][..len];
                    let f = &flipped[i * nb + b0..][..len];
                    if tiles == 2 {
                        run::<D, K, TWO, RR>(&units, a, f, s);
                    } else {
                        run::<D, K, TWO, 2>(&units, a, f, s);
                    }
                }
            }
            for (i, s) in sums.iter().enumerate() {
                for tile in 0..tiles {
                    let base = (gp + tile) * GROUP;
                    let (lo, hi) = (r0.max(base), r1.min(base + GROUP));
                    // The tile's two registers, 16 rows in order.
                    let rows: &[f32; GROUP] = &*(s[2 * tile..].as_ptr() as *const [f32; GROUP]);
                    emit(p0 + i, lo, &rows[lo - base..hi - base]);
                }
            }
        }
    }
}

#[inline(always)]
unsafe fn ld(v: &[i32; 8]) -> __m256i {
    _mm256_load_si256(v.as_ptr() as *const __m256i)
}

#[inline(always)]
unsafe fn ldf(v: &[f32; 8]) -> __m256 {
    _mm256_load_ps(v.as_ptr())
}

/// `−128·Σ` of the signed bytes of registers `js`, per 32-bit lane.
#[inline(always)]
unsafe fn correction(w: &[__m256i; 8], js: std::ops::Range<usize>) -> __m256i {
    let ones = _mm256_set1_epi8(1);
    let mut s = _mm256_setzero_si256();
    for j in js {
        // |pair| ≤ 2·32, eight of them: far inside i16.
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(ones, w[j]));
    }
    let s = _mm256_madd_epi16(s, _mm256_set1_epi16(1));
    _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(s, 7))
}

/// Blocks `[b0, b0 + len)` of tiles `gp..gp + tiles`, unpacked into
/// `units[block][2·tile + half]`.
#[inline(always)]
unsafe fn unpack<const K: u8>(
    w: &Packed,
    gp: usize,
    tiles: usize,
    b0: usize,
    len: usize,
    units: &mut [[Unit; RR]; CH],
) {
    let kind = kind_of(K);
    let c = _mm256_set1_epi8(centre(kind) as i8);
    for tile in 0..tiles {
        let p = w.tile(gp + tile).as_ptr();
        for blk in 0..len {
            for half in 0..2 {
                let u = &mut units[blk][2 * tile + half];
                let mut wv;
                let f16s = |at: *const u8| _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i));
                if kind.super_block() {
                    // Super-block `b0 / 8`, sub-block `blk` (b0 is a
                    // multiple of 8 and len is 8: k is a multiple of 256).
                    let t = p.add(b0 / CH * kind.k_record());
                    let sub = t.add(kind.sub_at(blk));
                    wv = sub_values256(kind, sub, half);
                    let eight = |at: usize| _mm_loadl_epi64(t.add(at + 8 * half) as *const __m128i);
                    let d = f16s(t.add(16 * half));
                    if kind == Kind::Q6K {
                        let f = |at: usize| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight(at)));
                        _mm256_store_ps(u.d.as_mut_ptr(), d);
                        _mm256_store_ps(u.m.as_mut_ptr(), f(32 + 16 * 2 * blk));
                        _mm256_store_ps(u.sc1.as_mut_ptr(), f(32 + 16 * (2 * blk + 1)));
                    } else {
                        let f = |at: usize| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight(at)));
                        // −dmin, exactly (the sign bit flipped).
                        let dmin = _mm256_castsi256_ps(_mm256_xor_si256(
                            _mm256_castps_si256(f16s(t.add(32 + 16 * half))),
                            _mm256_set1_epi32(i32::MIN),
                        ));
                        let scale = _mm256_mul_ps(d, f(64 + 16 * blk));
                        let min = _mm256_mul_ps(dmin, f(64 + 16 * GROUP / 2 + 16 * blk));
                        _mm256_store_ps(u.d.as_mut_ptr(), scale);
                        _mm256_store_ps(u.m.as_mut_ptr(), min);
                    }
                } else {
                    let t = p.add((b0 + blk) * kind.record());
                    wv = block_values256(kind, t, half);
                    _mm256_store_ps(u.d.as_mut_ptr(), f16s(t.add(16 * half)));
                    if kind.has_min() {
                        _mm256_store_ps(u.m.as_mut_ptr(), f16s(t.add(32 + 16 * half)));
                    }
                }
                for j in 0..8 {
                    wv[j] = _mm256_sub_epi8(wv[j], c);
                    _mm256_store_si256(u.w[j].as_mut_ptr() as *mut __m256i, wv[j]);
                }
                if kind == Kind::Q6K {
                    _mm256_store_si256(u.c0.as_mut_ptr() as *mut __m256i, correction(&wv, 0..4));
                    _mm256_store_si256(u.c1.as_mut_ptr() as *mut __m256i, correction(&wv, 4..8));
                } else {
                    _mm256_store_si256(u.c0.as_mut_ptr() as *mut __m256i, correction(&wv, 0..8));
                }
            }
        }
    }
}

/// One input's blocks `a` (a chunk) against its unpacked units, added to
/// its sums `s` for the first `R` registers of rows.
#[inline(always)]
unsafe fn run<D: Dot8, const K: u8, const TWO: bool, const R: usize>(
    units: &[[Unit; RR]; CH],
    a: &[ActBlock],
    flipped: &[[[u8; 32]; 2]],
    s: &mut [[f32; 8]; RR],
) {
    let kind = kind_of(K);
    let q6 = kind == Kind::Q6K;
    let bits = kind.bits();
    // The activation sums' factor: c + the kind's offset (0 for Q4_0,
    // Q5_0 and Q6_K, whose values already carry theirs).
    let cs = if q6 { 0 } else { centre(kind) + kind.bias() };
    let mut y: [__m256; R] = std::array::from_fn(|r| _mm256_loadu_ps(s[r].as_ptr()));
    for blk in 0..std::hint::black_box(a.len()) {
        let a = &a[blk];
        let u = &units[blk];
        let mut f = [_mm256_setzero_ps(); R];
        for l in 0..if TWO { 2 } else { 1 } {
            let fq = flipped[blk][l].as_ptr() as *const i32;
            let q: [__m256i; 8] =
                std::array::from_fn(|j| _mm256_set1_epi32(fq.add(j).read_unaligned()));
            // Read for each product (a volatile read, so that the compiler
            // neither keeps the 32 weight registers of both levels nor
            // copies them to the stack, but takes them as the products'
            // memory operands).
            let wj = |r: usize, j: usize| (u[r].w[j].as_ptr() as *const __m256i).read_volatile();
            let e = _mm256_set1_epi32(cs * a.s[l]);
            let dl = _mm256_set1_ps(a.d[l]);
            for r in 0..R {
                let v = if q6 {
                    let mut lo = ld(&u[r].c0);
                    let mut hi = ld(&u[r].c1);
                    for j in [0, 2] {
                        lo = D::dot2(lo, (q[j], wj(r, j)), (q[j + 1], wj(r, j + 1)));
                        hi = D::dot2(hi, (q[j + 4], wj(r, j + 4)), (q[j + 5], wj(r, j + 5)));
                    }
                    let lo = _mm256_mul_ps(_mm256_cvtepi32_ps(lo), ldf(&u[r].m));
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), ldf(&u[r].sc1), lo)
                } else {
                    let init = _mm256_add_epi32(ld(&u[r].c0), e);
                    _mm256_cvtepi32_ps(D::chains(init, bits, |j| (q[j], wj(r, j))))
                };
                f[r] = if l == 0 {
                    _mm256_mul_ps(v, dl)
                } else {
                    _mm256_fmadd_ps(v, dl, f[r])
                };
            }
        }
        for r in 0..R {
            y[r] = _mm256_fmadd_ps(ldf(&u[r].d), f[r], y[r]);
            if kind.has_min() {
                y[r] = _mm256_fmadd_ps(ldf(&u[r].m), _mm256_set1_ps(a.xsum), y[r]);
            }
        }
    }
    for r in 0..R {
        _mm256_storeu_ps(s[r].as_mut_ptr(), y[r]);
    }
}

/// [`run`] for two inputs at once and the kinds other than Q6_K: per
/// 32-bit quad of values, the `R` weight registers loaded once and each
/// met by both inputs' broadcasts, the `2·R` sums added in i16 in the
/// tiles' groups (`maddubs`) or in i32 (`vpdpbusd`). (One load for every 1.3 products instead of one for
/// each: the loads into the vector unit, two a cycle, bound [`run`].)
#[inline(always)]
unsafe fn run2<D: Dot8, const K: u8, const TWO: bool, const R: usize>(
    units: &[[Unit; RR]; CH],
    a: [&[ActBlock]; 2],
    flipped: [&[[[u8; 32]; 2]]; 2],
    s: [&mut [[f32; 8]; RR]; 2],
) {
    let kind = kind_of(K);
    let bits = kind.bits();
    let group = if D::I16_SUMS { i16_group(bits) } else { 8 };
    let cs = centre(kind) + kind.bias();
    let ones = _mm256_set1_epi16(1);
    let mut y: [[__m256; 2]; R] =
        std::array::from_fn(|r| std::array::from_fn(|i| _mm256_loadu_ps(s[i][r].as_ptr())));
    for blk in 0..std::hint::black_box(a[0].len()) {
        let u = &units[blk];
        let ab = [&a[0][blk], &a[1][blk]];
        let mut f = [[_mm256_setzero_ps(); 2]; R];
        for l in 0..if TWO { 2 } else { 1 } {
            let fq = [
                flipped[0][blk][l].as_ptr() as *const i32,
                flipped[1][blk][l].as_ptr() as *const i32,
            ];
            // The integer sums: with `maddubs` the products of a group added
            // in i16 and widened by `madd`; with `vpdpbusd` one group of all
            // eight, added into i32 as they come. Then the corrections.
            let mut sum = [[_mm256_setzero_si256(); 2]; R];
            for g in 0..8 / group {
                let mut acc = [[_mm256_setzero_si256(); 2]; R];
                for jj in 0..group {
                    let j = g * group + jj;
                    let q = [
                        _mm256_set1_epi32(fq[0].add(j).read_unaligned()),
                        _mm256_set1_epi32(fq[1].add(j).read_unaligned()),
                    ];
                    for r in 0..R {
                        // Volatile: loaded again for the second level, not
                        // kept (or copied to the stack) from the first.
                        let w = (u[r].w[j].as_ptr() as *const __m256i).read_volatile();
                        for i in 0..2 {
                            acc[r][i] = if !D::I16_SUMS {
                                D::dot(acc[r][i], q[i], w)
                            } else if jj == 0 {
                                _mm256_maddubs_epi16(q[i], w)
                            } else {
                                _mm256_add_epi16(acc[r][i], _mm256_maddubs_epi16(q[i], w))
                            };
                        }
                    }
                }
                for r in 0..R {
                    for i in 0..2 {
                        let w = if D::I16_SUMS {
                            _mm256_madd_epi16(acc[r][i], ones)
                        } else {
                            acc[r][i]
                        };
                        sum[r][i] = if g == 0 {
                            w
                        } else {
                            _mm256_add_epi32(sum[r][i], w)
                        };
                    }
                }
            }
            // The corrections after the products (started from them, the
            // `vpdpbusd` chains ran Q4_0 at 50 G a second on Zen 4 against
            // 66–71 this way, the cause not found).
            for r in 0..R {
                let c = ld(&u[r].c0);
                for i in 0..2 {
                    let e = _mm256_set1_epi32(cs * ab[i].s[l]);
                    sum[r][i] = _mm256_add_epi32(sum[r][i], _mm256_add_epi32(c, e));
                }
            }
            for r in 0..R {
                for i in 0..2 {
                    let v = _mm256_cvtepi32_ps(sum[r][i]);
                    let dl = _mm256_set1_ps(ab[i].d[l]);
                    f[r][i] = if l == 0 {
                        _mm256_mul_ps(v, dl)
                    } else {
                        _mm256_fmadd_ps(v, dl, f[r][i])
                    };
                }
            }
        }
        for r in 0..R {
            for i in 0..2 {
                y[r][i] = _mm256_fmadd_ps(ldf(&u[r].d), f[r][i], y[r][i]);
                if kind.has_min() {
                    y[r][i] = _mm256_fmadd_ps(ldf(&u[r].m), _mm256_set1_ps(ab[i].xsum), y[r][i]);
                }
            }
        }
    }
    for r in 0..R {
        for i in 0..2 {
            _mm256_storeu_ps(s[i][r].as_mut_ptr(), y[r][i]);
        }
    }
}
