//! Dot products of f32 activations with rows of GGML-quantized weights,
//! read in place: no dequantized copy of the row, the block scale applied to
//! a vector accumulator, one horizontal sum per row. The decode-time linear
//! layers are these loops: portable Rust, and AVX2 intrinsics chosen at run
//! time. Activations stay f32 (no 8-bit requantization, unlike llama.cpp's
//! and candle's quantized matmuls).
//!
//! ```text
//! Q4_1 block (20 bytes, 32 weights): d: f16, m: f16, qs: [u8; 16]
//!   w[j] = (qs[j] & 0xF)·d + m,  w[j + 16] = (qs[j] >> 4)·d + m
//!   Σ w·x = d·Σ q·x + m·Σ x       (Σ x per block computed once per input)
//! Q8_0 block (34 bytes, 32 weights): d: f16, qs: [i8; 32]   w[j] = qs[j]·d
//! ```

use candle_core::{bail, Result};
use half::f16;
use rayon::prelude::*;

use crate::simd::{self, madd};

/// Block formats with a fused dot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowFormat {
    Q4_1,
    Q8_0,
}

impl RowFormat {
    fn block_bytes(self) -> usize {
        match self {
            RowFormat::Q4_1 => 20,
            RowFormat::Q8_0 => 34,
        }
    }
}

const QK: usize = 32;

#[inline(always)]
fn scale(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

#[inline(always)]
fn row_dot<const FMA: bool>(format: RowFormat, row: &[u8], x: &[f32], xsum: &[f32]) -> f32 {
    let mut tot = [0f32; 16];
    let mut offset = 0f32;
    match format {
        RowFormat::Q4_1 => {
            for (b, blk) in row.chunks_exact(20).enumerate() {
                let (d, m) = (scale(blk, 0), scale(blk, 2));
                let qs = &blk[4..20];
                let xb = &x[b * QK..(b + 1) * QK];
                let mut p = [0f32; 16];
                for j in 0..16 {
                    p[j] = f32::from(qs[j] & 0xF) * xb[j];
                }
                for j in 0..16 {
                    p[j] = madd::<FMA>(p[j], f32::from(qs[j] >> 4), xb[j + 16]);
                }
                for j in 0..16 {
                    tot[j] = madd::<FMA>(tot[j], d, p[j]);
                }
                offset = madd::<FMA>(offset, m, xsum[b]);
            }
        }
        RowFormat::Q8_0 => {
            for (b, blk) in row.chunks_exact(34).enumerate() {
                let d = scale(blk, 0);
                let qs = &blk[2..34];
                let xb = &x[b * QK..(b + 1) * QK];
                let mut p = [0f32; 16];
                for j in 0..16 {
                    p[j] = f32::from(qs[j] as i8) * xb[j];
                }
                for j in 0..16 {
                    p[j] = madd::<FMA>(p[j], f32::from(qs[j + 16] as i8), xb[j + 16]);
                }
                for j in 0..16 {
                    tot[j] = madd::<FMA>(tot[j], d, p[j]);
                }
            }
        }
    }
    let mut s = [0f32; 8];
    for i in 0..8 {
        s[i] = tot[i] + tot[i + 8];
    }
    (s[0] + s[4]) + (s[1] + s[5]) + ((s[2] + s[6]) + (s[3] + s[7])) + offset
}

/// One weight row against every input row, with `dot(x_row, xsum_row)`.
#[inline(always)]
fn each_input(
    x: &[f32],
    xsums: &[f32],
    k: usize,
    out: &mut [f32],
    mut dot: impl FnMut(&[f32], &[f32]) -> f32,
) {
    let nb = k / QK;
    for (i, y) in out.iter_mut().enumerate() {
        *y = dot(&x[i * k..(i + 1) * k], &xsums[i * nb..(i + 1) * nb]);
    }
}

fn rows(format: RowFormat, row: &[u8], x: &[f32], xsums: &[f32], k: usize, out: &mut [f32]) {
    each_input(x, xsums, k, out, |x, s| row_dot::<false>(format, row, x, s));
}

/// The same loops in AVX2 intrinsics: each block's 32 weights become four
/// 8-lane f32 vectors, dotted with the input by FMA; the block scale
/// multiplies the block's partial sums into one accumulator.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{RowFormat, QK};

    #[inline(always)]
    unsafe fn scale(p: *const u8) -> f32 {
        let bits = u16::from_le_bytes([*p, *p.add(1)]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(bits as i16)))
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Four 8-lane products of the block's weights (as f32 vectors) with
    /// the 32 inputs at `xp`, summed.
    #[inline(always)]
    unsafe fn block(w: [__m256; 4], xp: *const f32) -> __m256 {
        let mut s = _mm256_mul_ps(w[0], _mm256_loadu_ps(xp));
        s = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xp.add(8)), s);
        s = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xp.add(16)), s);
        _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xp.add(24)), s)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn row_dot(format: RowFormat, row: &[u8], x: &[f32], xsum: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut offset = 0f32;
        match format {
            RowFormat::Q4_1 => {
                let mask = _mm_set1_epi8(0x0F);
                for (b, blk) in row.chunks_exact(20).enumerate() {
                    let p = blk.as_ptr();
                    let qs = _mm_loadu_si128(p.add(4) as *const __m128i);
                    let lo = _mm_and_si128(qs, mask);
                    let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
                    let f = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
                    let w = [
                        f(lo),
                        f(_mm_srli_si128(lo, 8)),
                        f(hi),
                        f(_mm_srli_si128(hi, 8)),
                    ];
                    let s = block(w, x.as_ptr().add(b * QK));
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(scale(p)), s, acc);
                    offset += scale(p.add(2)) * xsum[b];
                }
            }
            RowFormat::Q8_0 => {
                for (b, blk) in row.chunks_exact(34).enumerate() {
                    let p = blk.as_ptr();
                    let f = |o: usize| {
                        let v = _mm_loadl_epi64(p.add(2 + o) as *const __m128i);
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
                    };
                    let w = [f(0), f(8), f(16), f(24)];
                    let s = block(w, x.as_ptr().add(b * QK));
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(scale(p)), s, acc);
                }
            }
        }
        hsum(acc) + offset
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows(
        format: RowFormat,
        row: &[u8],
        x: &[f32],
        xsums: &[f32],
        k: usize,
        out: &mut [f32],
    ) {
        super::each_input(x, xsums, k, out, |x, s| row_dot(format, row, x, s));
    }
}

/// `[n, t]`: the dot of each of the `n` rows of a `[n, k]` weight stored as
/// `format` blocks in `data` with each of the `t` rows of `x` (`[t, k]`).
pub fn quantized_dots(
    format: RowFormat,
    data: &[u8],
    x: &[f32],
    t: usize,
    k: usize,
    n: usize,
) -> Result<Vec<f32>> {
    let row_bytes = k / QK * format.block_bytes();
    if !k.is_multiple_of(QK) || data.len() != n * row_bytes || x.len() != t * k {
        bail!(
            "quantized_dots: {} bytes of {format:?} and {} inputs do not make a {n}x{k} weight and {t} rows",
            data.len(),
            x.len()
        )
    }
    let xsums: Vec<f32> = x.chunks_exact(QK).map(|c| c.iter().sum()).collect();
    let avx2 = simd::has_avx2_fma() && simd::has_f16c();
    let mut out = vec![0f32; n * t];
    out.par_chunks_mut(t)
        .zip(data.par_chunks_exact(row_bytes))
        .with_min_len(16)
        .for_each(|(o, row)| {
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: the CPU supports AVX2, FMA and F16C (checked);
                // the row holds k / 32 whole blocks and x holds t·k values
                // (checked above), which is all the loads read.
                return unsafe { avx2::rows(format, row, x, &xsums, k, o) };
            }
            let _ = avx2;
            rows(format, row, x, &xsums, k, o)
        });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random blocks of either format, dotted by the portable loops, the
    /// dispatched path and a plain dequantize-then-multiply reference.
    #[test]
    fn fused_dots_equal_dequantized_products() {
        let mut s = 0x1234_5678_9abc_def1u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let (n, k, t) = (7, 96, 3);
        let x: Vec<f32> = (0..t * k)
            .map(|_| (next() % 2000) as f32 / 1000.0 - 1.0)
            .collect();
        for format in [RowFormat::Q4_1, RowFormat::Q8_0] {
            let bb = format.block_bytes();
            let mut data = vec![0u8; n * k / QK * bb];
            data.iter_mut().for_each(|b| *b = next() as u8);
            // Sane scales: f16 values in [0.01, 0.1].
            for blk in data.chunks_exact_mut(bb) {
                for at in [0, 2] {
                    let v = f16::from_f32(0.01 + (next() % 90) as f32 / 1000.0);
                    blk[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
                }
            }
            let weight = |r: usize, c: usize| {
                let blk = &data[(r * k / QK + c / QK) * bb..][..bb];
                let j = c % QK;
                match format {
                    RowFormat::Q4_1 => {
                        let q = if j < 16 {
                            blk[4 + j] & 15
                        } else {
                            blk[4 + j - 16] >> 4
                        };
                        f32::from(q) * scale(blk, 0) + scale(blk, 2)
                    }
                    RowFormat::Q8_0 => f32::from(blk[2 + j] as i8) * scale(blk, 0),
                }
            };
            let got = quantized_dots(format, &data, &x, t, k, n).unwrap();
            let xsums: Vec<f32> = x.chunks_exact(QK).map(|c| c.iter().sum()).collect();
            for r in 0..n {
                let row = &data[r * k / QK * bb..(r + 1) * k / QK * bb];
                let mut portable = vec![0f32; t];
                rows(format, row, &x, &xsums, k, &mut portable);
                for i in 0..t {
                    let want: f32 = (0..k).map(|c| weight(r, c) * x[i * k + c]).sum();
                    for (what, v) in [("dispatched", got[r * t + i]), ("portable", portable[i])] {
                        assert!(
                            (v - want).abs() < 1e-3 * (1.0 + want.abs()),
                            "{format:?} {what} row {r} input {i}: {v} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
