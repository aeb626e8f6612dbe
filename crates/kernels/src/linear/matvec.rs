//! Linear layers on weights kept in their GGML block formats, with f32
//! activations: `y[i][r] = Σ_c w[r][c] · x[i][c]` where `w` is exactly the
//! dequantized weight (the same values as candle's `to_float`) and nothing
//! rounds the activations.
//!
//! **One arithmetic for every row, whatever the batch.** Each (row, input)
//! pair is computed in the same order of operations whether it is computed
//! alone, beside other rows, in a decode step or in a 512-token prefill,
//! and on whichever worker: 32 weights at a time (one GGML block), weights
//! `0..16` of the block fused-multiply-added into one 16-lane accumulator
//! and `16..32` into another, then one fixed reduction tree:
//!
//! ```text
//! lo[j] = fma(w[32b + j], x[32b + j], lo[j])            j < 16, every block b
//! hi[j] = fma(w[32b + 16 + j], x[32b + 16 + j], hi[j])
//! v = lo + hi;  v8[j] = v[j] + v[j+8];  v4[j] = v8[j] + v8[j+4];
//! v2[j] = v4[j] + v4[j+2];  y = (v2[0] + v2[1]) + tail
//! ```
//!
//! So results are bit-identical across batch compositions, thread counts
//! and instruction sets: the same source is compiled for AVX-512, for
//! AVX2 + FMA and for the baseline target and chosen at run time
//! ([`Isa`]); all use fused multiply-adds and no reassociation, so they
//! give the same bits (tested). Tiles of several rows and several inputs
//! share weight decoding and keep enough independent accumulator chains
//! in flight; their sizes change speed, never results.
//!
//! Decoded in registers: F32, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0. Every other
//! GGML type (the K-quants, F16, BF16, …) is dequantized a few rows at a
//! time into a per-worker buffer with candle's `to_float` and then takes
//! the F32 path.

// Lane loops index several arrays in step.
#![allow(clippy::needless_range_loop)]

use std::sync::OnceLock;

use candle_core::quantized::k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, BlockQ8_1, GgmlType,
};
use candle_core::quantized::GgmlDType;
use candle_core::{bail, Result};

use crate::simd::capped;
#[cfg(target_arch = "x86_64")]
use crate::simd::lanes::x86;
use crate::simd::lanes::{reduce16, Lanes, Portable};
use crate::tuning::IsaCap;

/// Instruction sets the kernels are compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Portable,
    Avx2,
    Avx512,
}

impl Isa {
    /// The best this CPU runs, capped by the tuning's instruction set
    /// (AVX-VNNI's cap is AVX2 here: it has no 512-bit registers).
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            capped(Isa::best(), |cap| match cap {
                IsaCap::Portable => Isa::Portable,
                IsaCap::Avx2 | IsaCap::AvxVnni => Isa::Avx2,
                IsaCap::Avx512 | IsaCap::Amx => Isa::Avx512,
            })
        })
    }

    /// Every instruction set this CPU runs.
    pub fn available() -> Vec<Isa> {
        let best = Isa::best();
        [Isa::Portable, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|&i| i <= best)
            .collect()
    }

    /// The best this CPU runs, whatever `TESSERA_ISA` says.
    pub(crate) fn best() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma") && has!("f16c");
            if avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vl") {
                return Isa::Avx512;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }
}

/// How a weight's rows are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// Little-endian f32 values.
    F32,
    /// Little-endian f16 values (GGUF's F16 tensors), widened exactly to
    /// f32 in registers.
    F16,
    /// Little-endian bf16 values (GGUF's BF16 tensors, safetensors' bf16),
    /// widened exactly to f32 in registers.
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    /// Any other GGML type, dequantized row by row.
    Ggml(GgmlDType),
}

impl WeightFormat {
    pub fn from_ggml(d: GgmlDType) -> WeightFormat {
        match d {
            GgmlDType::F32 => WeightFormat::F32,
            GgmlDType::F16 => WeightFormat::F16,
            GgmlDType::BF16 => WeightFormat::BF16,
            GgmlDType::Q4_0 => WeightFormat::Q4_0,
            GgmlDType::Q4_1 => WeightFormat::Q4_1,
            GgmlDType::Q5_0 => WeightFormat::Q5_0,
            GgmlDType::Q5_1 => WeightFormat::Q5_1,
            GgmlDType::Q8_0 => WeightFormat::Q8_0,
            other => WeightFormat::Ggml(other),
        }
    }

    /// `(values, bytes)` of one block.
    fn block(self) -> (usize, usize) {
        match self {
            WeightFormat::F32 => (1, 4),
            WeightFormat::F16 | WeightFormat::BF16 => (1, 2),
            WeightFormat::Q4_0 => (32, 18),
            WeightFormat::Q4_1 => (32, 20),
            WeightFormat::Q5_0 => (32, 22),
            WeightFormat::Q5_1 => (32, 24),
            WeightFormat::Q8_0 => (32, 34),
            WeightFormat::Ggml(d) => (d.block_size(), d.type_size()),
        }
    }
}

/// A `[n, k]` weight: `n` rows of `k` values in `format`.
#[derive(Debug, Clone, Copy)]
pub struct Weights<'a> {
    pub format: WeightFormat,
    pub data: &'a [u8],
    pub n: usize,
    pub k: usize,
}

impl<'a> Weights<'a> {
    /// Checks that `data` holds exactly `n` rows of `k` values.
    pub fn new(format: WeightFormat, data: &'a [u8], n: usize, k: usize) -> Result<Weights<'a>> {
        let (vals, bytes) = format.block();
        let row = (k / vals).checked_mul(bytes);
        if !k.is_multiple_of(vals) || row.and_then(|r| r.checked_mul(n)) != Some(data.len()) {
            bail!(
                "weights: {} bytes of {format:?} do not make {n} rows of {k} values",
                data.len()
            )
        }
        if let WeightFormat::Ggml(d) = format {
            if ggml_to_float(d).is_none() {
                bail!("weights: no dequantization for {d:?}")
            }
        }
        Ok(Weights { format, data, n, k })
    }

    pub fn row_bytes(&self) -> usize {
        let (vals, bytes) = self.format.block();
        self.k / vals * bytes
    }

    fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Row `r` dequantized into `out` (`k` values): the values every path
    /// multiplies with.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let row = self.row(r);
        let out = &mut out[..self.k];
        match self.format {
            WeightFormat::F32 => {
                for (o, c) in out.iter_mut().zip(row.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            WeightFormat::F16 => {
                for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                    *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
                }
            }
            WeightFormat::BF16 => {
                for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                    *o = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
                }
            }
            WeightFormat::Q4_0 => decode_row::<Q40>(row, out),
            WeightFormat::Q4_1 => decode_row::<Q41>(row, out),
            WeightFormat::Q5_0 => decode_row::<Q50>(row, out),
            WeightFormat::Q5_1 => decode_row::<Q51>(row, out),
            WeightFormat::Q8_0 => decode_row::<Q80>(row, out),
            WeightFormat::Ggml(d) => ggml_to_float(d).expect("checked in new")(row, out),
        }
    }
}

fn decode_row<D: Decode>(row: &[u8], out: &mut [f32]) {
    for (blk, o) in row.chunks_exact(D::BYTES).zip(out.chunks_exact_mut(32)) {
        // SAFETY: the portable lanes need no particular CPU.
        let (lo, hi) = unsafe { D::dec::<Portable>(blk) };
        o[..16].copy_from_slice(&lo);
        o[16..].copy_from_slice(&hi);
    }
}

type ToFloat = fn(&[u8], &mut [f32]);

fn to_float<B: GgmlType>(row: &[u8], out: &mut [f32]) {
    let n = row.len() / std::mem::size_of::<B>();
    let mut blocks = Vec::<B>::with_capacity(n);
    // SAFETY: `B` is a `#[repr(C)]` block of plain bytes and f16s, valid
    // for any bit pattern; the copy fills exactly `n` blocks, and goes
    // through an aligned buffer because `row` may not be aligned for `B`.
    unsafe {
        std::ptr::copy_nonoverlapping(row.as_ptr(), blocks.as_mut_ptr() as *mut u8, row.len());
        blocks.set_len(n);
    }
    B::to_float(&blocks, out);
}

fn ggml_to_float(d: GgmlDType) -> Option<ToFloat> {
    Some(match d {
        GgmlDType::F16 => to_float::<half::f16>,
        GgmlDType::BF16 => to_float::<half::bf16>,
        GgmlDType::Q8_1 => to_float::<BlockQ8_1>,
        GgmlDType::Q2K => to_float::<BlockQ2K>,
        GgmlDType::Q3K => to_float::<BlockQ3K>,
        GgmlDType::Q4K => to_float::<BlockQ4K>,
        GgmlDType::Q5K => to_float::<BlockQ5K>,
        GgmlDType::Q6K => to_float::<BlockQ6K>,
        GgmlDType::Q8K => to_float::<BlockQ8K>,
        _ => return None,
    })
}

/// f16 bits to f32, exactly, in arithmetic that vectorizes: the exponent
/// and mantissa moved into f32 position and rescaled by 2^112 (which also
/// normalizes subnormals), infinities and NaNs kept.
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let em = u32::from(h & 0x7fff);
    let v = if em >= 0x7c00 {
        f32::from_bits((em << 13) | 0x7f80_0000)
    } else {
        f32::from_bits(em << 13) * f32::from_bits(0x7780_0000) // 2^112
    };
    f32::from_bits(v.to_bits() | sign)
}

/// One block of 32 weights decoded into two halves of 16.
trait Decode {
    const BYTES: usize;
    /// # Safety
    /// The CPU has `L`'s instruction set.
    unsafe fn dec<L: Lanes>(b: &[u8]) -> ([f32; 16], [f32; 16]);
}

struct F32Rows;
struct F16Rows;
struct Bf16Rows;
struct Q40;
struct Q41;
struct Q50;
struct Q51;
struct Q80;

impl Decode for F32Rows {
    const BYTES: usize = 128;
    #[inline(always)]
    unsafe fn dec<L: Lanes>(b: &[u8]) -> ([f32; 16], [f32; 16]) {
        let b: &[u8; 128] = b.try_into().expect("128 bytes");
        let mut lo = [0f32; 16];
        let mut hi = [0f32; 16];
        for j in 0..16 {
            lo[j] = f32::from_le_bytes([b[4 * j], b[4 * j + 1], b[4 * j + 2], b[4 * j + 3]]);
            let o = 64 + 4 * j;
            hi[j] = f32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        }
        (lo, hi)
    }
}

impl Decode for Q40 {
    const BYTES: usize = 18;
    #[inline(always)]
    unsafe fn dec<L: Lanes>(b: &[u8]) -> ([f32; 16], [f32; 16]) {
        let b: &[u8; 18] = b.try_into().expect("18 bytes");
        let d = L::f16(u16::from_le_bytes([b[0], b[1]]));
        let mut lo = [0f32; 16];
        let mut hi = [0f32; 16];
        for j in 0..16 {
            let q = b[2 + j];
            lo[j] = f32::from(i16::from(q & 0x0F) - 8) * d;
            hi[j] = f32::from(i16::from(q >> 4) - 8) * d;
        }
        (lo, hi)
    }
}

impl Decode for Q41 {
    const BYTES: usize = 20;
    #[inline(always)]
    unsafe fn dec<L: Lanes>(b: &[u8]) -> ([f32; 16], [f32; 16]) {
        let b: &[u8; 20] = b.try_into().expect("20 bytes");
        let (d, m) = (
            L::f16(u16::from_le_bytes([b[0], b[1]])),
            L::f16(u16::from_le_bytes([b[2], b[3]])),
        );
        let mut lo = [0f32; 16];
        let mut hi = [0f32; 16];
        for j in 0..16 {
            let q = b[4 + j];
            // q·d is exact in f32 (4 × 11 bits), so the fused form equals
            // candle's `q * d + m`.
            lo[j] = f32::from(q & 0x0F).mul_add(d, m);
            hi[j] = f32::from(q >> 4).mul_add(d, m);
        }
        (lo, hi)
    }
}

impl Decode for Q50 {
    const BYTES: usize = 22;
    #[inline(always)]
    unsafe fn dec<L: Lanes>(b: &[u8]) -> ([f32; 16], [f32; 16]) {
        let b: &[u8; 22] = b.try_into().expect("22 bytes");
        let d = L::f16(u16::from_le_bytes([b[0], b[1]]));
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let mut lo = [0f32; 16];
        let mut hi = [0f32; 16];
        for j in 0..16 {
            let q = b[6 + j];
            let h0 = (((qh >> j) << 4) & 0x10) as u8;
            let h1 = ((qh >> (j + 12)) & 0x10) as u8;
            lo[j] = (i32::from((q & 0x0F) | h0) - 16) as f32 * d;
            hi[j] = (i32::from((q >> 4) | h1) - 16) as f32 * d;
        }
        (lo, hi)
    }
}

impl Decode for Q51 {
    const BYTES: usize = 24;
    #[inline(always)]
    unsafe fn dec<L: Lanes>(b: &[u8]) -> ([f32; 16], [f32; 16]) {
        let b: &[u8; 24] = b.try_into().expect("24 bytes");
        let (d, m) = (
            L::f16(u16::from_le_bytes([b[0], b[1]])),
            L::f16(u16::from_le_bytes([b[2], b[3]])),
        );
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let mut lo = [0f32; 16];
        let mut hi = [0f32; 16];
        for j in 0..16 {
            let q = b[8 + j];
            let h0 = (((qh >> j) << 4) & 0x10) as u8;
            let h1 = ((qh >> (j + 12)) & 0x10) as u8;
            // Exact products (5 × 11 bits): fused equals `q * d + m`.
            lo[j] = f32::from((q & 0x0F) | h0).mul_add(d, m);
            hi[j] = f32::from((q >> 4) | h1).mul_add(d, m);
        }
        (lo, hi)
    }
}

/// Two runs of sixteen little-endian 16-bit values, at bytes 0 and 32.
#[inline(always)]
fn halves(b: &[u8; 64]) -> ([u16; 16], [u16; 16]) {
    let run = |at: usize| -> [u16; 16] {
        // SAFETY: 32 bytes at `at` (0 or 32) of the 64; any bits are a
        // u16, and the read is unaligned.
        let v = unsafe { std::ptr::read_unaligned(b.as_ptr().add(at) as *const [u16; 16]) };
        v.map(u16::from_le)
    };
    (run(0), run(32))
}

impl Decode for F16Rows {
    const BYTES: usize = 64;
    #[inline(always)]
    unsafe fn dec<L: Lanes>(b: &[u8]) -> ([f32; 16], [f32; 16]) {
        let (a, c) = halves(b.try_into().expect("64 bytes"));
        let mut lo = [0f32; 16];
        let mut hi = [0f32; 16];
        L::f16x16(&a, &mut lo);
        L::f16x16(&c, &mut hi);
        (lo, hi)
    }
}

impl Decode for Bf16Rows {
    const BYTES: usize = 64;
    #[inline(always)]
    unsafe fn dec<L: Lanes>(b: &[u8]) -> ([f32; 16], [f32; 16]) {
        let (a, c) = halves(b.try_into().expect("64 bytes"));
        (a.map(bf16_to_f32), c.map(bf16_to_f32))
    }
}

/// A bf16 value widened to f32 (exact: its bits are an f32's top half).
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

impl Decode for Q80 {
    const BYTES: usize = 34;
    #[inline(always)]
    unsafe fn dec<L: Lanes>(b: &[u8]) -> ([f32; 16], [f32; 16]) {
        let b: &[u8; 34] = b.try_into().expect("34 bytes");
        let d = L::f16(u16::from_le_bytes([b[0], b[1]]));
        let mut lo = [0f32; 16];
        let mut hi = [0f32; 16];
        for j in 0..16 {
            lo[j] = f32::from(b[2 + j] as i8) * d;
            hi[j] = f32::from(b[18 + j] as i8) * d;
        }
        (lo, hi)
    }
}

/// The fixed reduction tree of the two 16-lane accumulators.
#[inline(always)]
pub(crate) fn reduce(lo: &[f32; 16], hi: &[f32; 16]) -> f32 {
    let mut v = [0f32; 16];
    for j in 0..16 {
        v[j] = lo[j] + hi[j];
    }
    reduce16(&v)
}

/// `NR` rows against `NI` inputs over `nb` blocks; `out[r][i]`.
#[inline(always)]
fn tile<L: Lanes, D: Decode, const NR: usize, const NI: usize>(
    rows: [&[u8]; NR],
    xs: [&[f32]; NI],
    nb: usize,
) -> [[f32; NI]; NR] {
    for r in &rows {
        assert!(r.len() >= nb * D::BYTES);
    }
    for x in &xs {
        assert!(x.len() >= nb * 32);
    }
    // SAFETY: `L` is only instantiated inside functions compiled for its
    // instruction set, which `Isa::detect` found on this CPU.
    unsafe {
        let mut lo = [[L::zero(); NI]; NR];
        let mut hi = [[L::zero(); NI]; NR];
        for b in 0..nb {
            let mut w = [(L::zero(), L::zero()); NR];
            for (r, w) in w.iter_mut().enumerate() {
                // The same block of the row four tiles further on: rows
                // are stored one after another, so this runs a few KiB
                // ahead of the loads (decode streams weights from DRAM).
                let ahead = 4 * NR * rows[r].len() + b * D::BYTES;
                L::prefetch(rows[r].as_ptr().wrapping_add(ahead));
                let (wl, wh) = D::dec::<L>(&rows[r][b * D::BYTES..(b + 1) * D::BYTES]);
                *w = (L::load(&wl), L::load(&wh));
            }
            for i in 0..NI {
                let xb = &xs[i][b * 32..(b + 1) * 32];
                let xl = L::load(xb[..16].try_into().expect("16"));
                let xh = L::load(xb[16..].try_into().expect("16"));
                for r in 0..NR {
                    lo[r][i] = L::fma(w[r].0, xl, lo[r][i]);
                    hi[r][i] = L::fma(w[r].1, xh, hi[r][i]);
                }
            }
        }
        let mut out = [[0f32; NI]; NR];
        let (mut a, mut c) = ([0f32; 16], [0f32; 16]);
        for r in 0..NR {
            for i in 0..NI {
                lo[r][i].store(&mut a);
                hi[r][i].store(&mut c);
                out[r][i] = reduce(&a, &c);
            }
        }
        out
    }
}

/// Inputs per panel of a many-input product (kept in L2 across row tiles).
const PANEL: usize = 64;

/// Rows `[r0, r1)` of `w` (row-major bytes, `rb` per row, `nb` 32-value
/// blocks each) against the `t` inputs `x` (`[t, k]`), each result passed
/// to `emit(input, row, value)`; `tail(row, input)` adds the dot of the
/// values past the last whole block (F32 rows only).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn drive<'w, L: Lanes, D: Decode, R, T, E>(
    row: &R,
    nb: usize,
    x: &[f32],
    t: usize,
    k: usize,
    r0: usize,
    r1: usize,
    tail: &T,
    emit: &mut E,
) where
    R: Fn(usize) -> &'w [u8],
    T: Fn(usize, usize) -> f32,
    E: FnMut(usize, usize, f32),
{
    let xi = |i: usize| &x[i * k..(i + 1) * k];
    if t == 1 {
        let mut r = r0;
        while r + 4 <= r1 {
            let o = tile::<L, D, 4, 1>([row(r), row(r + 1), row(r + 2), row(r + 3)], [xi(0)], nb);
            for (dr, v) in o.iter().enumerate() {
                emit(0, r + dr, v[0] + tail(r + dr, 0));
            }
            r += 4;
        }
        for r in r..r1 {
            let o = tile::<L, D, 1, 1>([row(r)], [xi(0)], nb);
            emit(0, r, o[0][0] + tail(r, 0));
        }
        return;
    }
    for p0 in (0..t).step_by(PANEL) {
        let p1 = (p0 + PANEL).min(t);
        let mut r = r0;
        while r < r1 {
            let two = r + 2 <= r1;
            let mut i = p0;
            while i + 4 <= p1 {
                let xs = [xi(i), xi(i + 1), xi(i + 2), xi(i + 3)];
                if two {
                    let o = tile::<L, D, 2, 4>([row(r), row(r + 1)], xs, nb);
                    for (dr, v) in o.iter().enumerate() {
                        for (di, &y) in v.iter().enumerate() {
                            emit(i + di, r + dr, y + tail(r + dr, i + di));
                        }
                    }
                } else {
                    let o = tile::<L, D, 1, 4>([row(r)], xs, nb);
                    for (di, &y) in o[0].iter().enumerate() {
                        emit(i + di, r, y + tail(r, i + di));
                    }
                }
                i += 4;
            }
            for i in i..p1 {
                if two {
                    let o = tile::<L, D, 2, 1>([row(r), row(r + 1)], [xi(i)], nb);
                    emit(i, r, o[0][0] + tail(r, i));
                    emit(i, r + 1, o[1][0] + tail(r + 1, i));
                } else {
                    let o = tile::<L, D, 1, 1>([row(r)], [xi(i)], nb);
                    emit(i, r, o[0][0] + tail(r, i));
                }
            }
            r += if two { 2 } else { 1 };
        }
    }
}

/// Rows of the dequantized-row path per refill of the worker's buffer.
const DEQ_ROWS: usize = 16;

#[inline(always)]
fn product<L: Lanes, E: FnMut(usize, usize, f32)>(
    w: &Weights,
    x: &[f32],
    t: usize,
    r0: usize,
    r1: usize,
    scratch: &mut Vec<f32>,
    emit: &mut E,
) {
    let k = w.k;
    let rb = w.row_bytes();
    let data = w.data;
    let row = move |r: usize| -> &[u8] { &data[r * rb..(r + 1) * rb] };
    let no_tail = |_: usize, _: usize| 0f32;
    match w.format {
        WeightFormat::Q4_0 => {
            drive::<L, Q40, _, _, _>(&row, k / 32, x, t, k, r0, r1, &no_tail, emit)
        }
        WeightFormat::Q4_1 => {
            drive::<L, Q41, _, _, _>(&row, k / 32, x, t, k, r0, r1, &no_tail, emit)
        }
        WeightFormat::Q5_0 => {
            drive::<L, Q50, _, _, _>(&row, k / 32, x, t, k, r0, r1, &no_tail, emit)
        }
        WeightFormat::Q5_1 => {
            drive::<L, Q51, _, _, _>(&row, k / 32, x, t, k, r0, r1, &no_tail, emit)
        }
        WeightFormat::Q8_0 => {
            drive::<L, Q80, _, _, _>(&row, k / 32, x, t, k, r0, r1, &no_tail, emit)
        }
        WeightFormat::F32 => float_rows::<L, F32Rows, _, _>(&row, x, t, k, r0, r1, F32_LE, emit),
        WeightFormat::F16 => float_rows::<L, F16Rows, _, _>(&row, x, t, k, r0, r1, F16_LE, emit),
        WeightFormat::BF16 => float_rows::<L, Bf16Rows, _, _>(&row, x, t, k, r0, r1, BF16_LE, emit),
        WeightFormat::Ggml(_) => {
            let mut a = r0;
            while a < r1 {
                let b = (a + DEQ_ROWS).min(r1);
                scratch.resize((b - a) * k, 0.0);
                for r in a..b {
                    w.dequantize_row(r, &mut scratch[(r - a) * k..(r - a + 1) * k]);
                }
                // SAFETY: viewing initialized f32s as bytes.
                let buf: &[u8] = unsafe {
                    std::slice::from_raw_parts(scratch.as_ptr() as *const u8, scratch.len() * 4)
                };
                let local = move |r: usize| -> &[u8] { &buf[(r - a) * k * 4..(r - a + 1) * k * 4] };
                float_rows::<L, F32Rows, _, _>(&local, x, t, k, a, b, F32_LE, emit);
                a = b;
            }
        }
    }
}

/// Float rows (`D`: f32, f16 or bf16, `width` bytes a value, `widen`
/// reading one): whole 32-value blocks through [`drive`], each widened to
/// f32 in registers where it is used (for f16 and bf16 the values the rows
/// dequantized to f32 would hold, so the same bits; widening each row once
/// into a buffer for a prefill's many inputs measured no faster), the rest
/// (`k % 32` values) as a sequential fused sum added last.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn float_rows<'w, L: Lanes, D: Decode, R: Fn(usize) -> &'w [u8], E: FnMut(usize, usize, f32)>(
    row: &R,
    x: &[f32],
    t: usize,
    k: usize,
    r0: usize,
    r1: usize,
    (width, widen): (usize, fn(&[u8]) -> f32),
    emit: &mut E,
) {
    let nb = k / 32;
    let tail = |r: usize, i: usize| {
        let w = &row(r)[nb * 32 * width..];
        let x = &x[i * k + nb * 32..(i + 1) * k];
        let mut s = 0f32;
        for (c, &xv) in w.chunks_exact(width).zip(x) {
            s = widen(c).mul_add(xv, s);
        }
        s
    };
    drive::<L, D, _, _, _>(row, nb, x, t, k, r0, r1, &tail, emit)
}

/// One little-endian value of each float format.
const F32_LE: (usize, fn(&[u8]) -> f32) = (4, |c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
const F16_LE: (usize, fn(&[u8]) -> f32) = (2, |c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])));
const BF16_LE: (usize, fn(&[u8]) -> f32) = (2, |c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])));

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn product_avx512<E: FnMut(usize, usize, f32)>(
    w: &Weights,
    x: &[f32],
    t: usize,
    r0: usize,
    r1: usize,
    scratch: &mut Vec<f32>,
    emit: &mut E,
) {
    product::<x86::Avx512, E>(w, x, t, r0, r1, scratch, emit)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn product_avx2<E: FnMut(usize, usize, f32)>(
    w: &Weights,
    x: &[f32],
    t: usize,
    r0: usize,
    r1: usize,
    scratch: &mut Vec<f32>,
    emit: &mut E,
) {
    product::<x86::Avx2, E>(w, x, t, r0, r1, scratch, emit)
}

/// Rows `[r0, r1)` of `w` times each of the `t` inputs in `x` (`[t, k]`):
/// `emit(input, row, value)` once per pair. `scratch` is the caller's
/// reusable buffer (dequantized rows of the formats decoded row by row).
#[allow(clippy::too_many_arguments)]
pub fn matvec<E: FnMut(usize, usize, f32)>(
    isa: Isa,
    w: &Weights,
    x: &[f32],
    t: usize,
    r0: usize,
    r1: usize,
    scratch: &mut Vec<f32>,
    emit: &mut E,
) {
    assert!(
        x.len() >= t * w.k && r0 <= r1 && r1 <= w.n,
        "matvec: bad shapes"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa` values above Portable come from CPU detection.
        Isa::Avx512 => unsafe { product_avx512(w, x, t, r0, r1, scratch, emit) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { product_avx2(w, x, t, r0, r1, scratch, emit) },
        _ => product::<Portable, E>(w, x, t, r0, r1, scratch, emit),
    }
}

/// The reference: each row dequantized, then the same fused sums one
/// value at a time in the documented order, in plain scalar code.
pub fn matvec_slow(w: &Weights, x: &[f32], t: usize) -> Vec<f32> {
    let k = w.k;
    let nb = k / 32;
    let mut row = vec![0f32; k];
    let mut out = vec![0f32; t * w.n];
    for r in 0..w.n {
        w.dequantize_row(r, &mut row);
        for i in 0..t {
            let x = &x[i * k..(i + 1) * k];
            let mut lo = [0f32; 16];
            let mut hi = [0f32; 16];
            for b in 0..nb {
                for j in 0..16 {
                    lo[j] = row[32 * b + j].mul_add(x[32 * b + j], lo[j]);
                    hi[j] = row[32 * b + 16 + j].mul_add(x[32 * b + 16 + j], hi[j]);
                }
            }
            let mut tail = 0f32;
            for c in nb * 32..k {
                tail = row[c].mul_add(x[c], tail);
            }
            out[i * w.n + r] = reduce(&lo, &hi) + tail;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QTensor;
    use candle_core::{DType, Device};

    use crate::testing::seeded;

    fn quantized(n: usize, k: usize, d: GgmlDType, seed: u64) -> Vec<u8> {
        let w = seeded(&[n, k], seed, DType::F32).unwrap();
        QTensor::quantize(&w, d)
            .unwrap()
            .data()
            .unwrap()
            .into_owned()
    }

    fn run_all(isa: Isa, w: &Weights, x: &[f32], t: usize, splits: &[usize]) -> Vec<f32> {
        let mut out = vec![f32::NAN; t * w.n];
        let mut scratch = Vec::new();
        let mut bounds = vec![0];
        bounds.extend(splits.iter().copied().filter(|&s| s < w.n));
        bounds.push(w.n);
        for pair in bounds.windows(2) {
            matvec(
                isa,
                w,
                x,
                t,
                pair[0],
                pair[1],
                &mut scratch,
                &mut |i, r, v| out[i * w.n + r] = v,
            );
        }
        out
    }

    /// Every format, every instruction set of this CPU, several batch
    /// sizes and row splits: bit-identical to the scalar reference, and
    /// within rounding of candle's dequantize-then-matmul.
    #[test]
    fn every_path_equals_the_reference_bit_for_bit() {
        let cases = [
            (GgmlDType::F32, 64),
            (GgmlDType::Q4_0, 96),
            (GgmlDType::Q4_1, 96),
            (GgmlDType::Q5_0, 96),
            (GgmlDType::Q5_1, 96),
            (GgmlDType::Q8_0, 96),
            (GgmlDType::Q4K, 256),
            (GgmlDType::Q6K, 256),
            (GgmlDType::F16, 40),
            (GgmlDType::F16, 96),
            (GgmlDType::BF16, 40),
            (GgmlDType::BF16, 96),
        ];
        let n = 13;
        for (d, k) in cases {
            let data = quantized(n, k, d, 7);
            let w = Weights::new(WeightFormat::from_ggml(d), &data, n, k).unwrap();
            let q = QTensor::quantize(&seeded(&[n, k], 7, DType::F32).unwrap(), d).unwrap();
            let dense = q.dequantize(&Device::Cpu).unwrap();
            for t in [1, 2, 5, 9, 70] {
                let xt = seeded(&[t, k], 11 + t as u64, DType::F32).unwrap();
                let x = xt.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let want = matvec_slow(&w, &x, t);
                for isa in Isa::available() {
                    for splits in [&[][..], &[5][..], &[1, 2, 7][..]] {
                        let got = run_all(isa, &w, &x, t, splits);
                        for (a, b) in got.iter().zip(&want) {
                            assert_eq!(a.to_bits(), b.to_bits(), "{d:?} t={t} {isa:?} {splits:?}");
                        }
                    }
                }
                let candle = xt.matmul(&dense.t().unwrap()).unwrap();
                let candle = candle.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                for (a, b) in want.iter().zip(&candle) {
                    assert!((a - b).abs() < 1e-4 * (1.0 + b.abs()), "{d:?}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn a_row_does_not_depend_on_its_batch() {
        let (n, k) = (9, 128);
        let data = quantized(n, k, GgmlDType::Q4_1, 3);
        let w = Weights::new(WeightFormat::Q4_1, &data, n, k).unwrap();
        let x = seeded(&[37, k], 5, DType::F32).unwrap();
        let x = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let all = run_all(Isa::detect(), &w, &x, 37, &[]);
        for i in 0..37 {
            let one = run_all(Isa::detect(), &w, &x[i * k..(i + 1) * k], 1, &[]);
            assert_eq!(&one[..], &all[i * n..(i + 1) * n]);
        }
    }

    #[test]
    fn f16_conversion_is_exact_for_every_value() {
        for bits in 0..=u16::MAX {
            let want = half::f16::from_bits(bits).to_f32();
            let got = f16_to_f32(bits);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{bits:#x}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn rejects_storage_of_the_wrong_size() {
        assert!(Weights::new(WeightFormat::Q4_1, &[0u8; 40], 1, 96).is_err());
        assert!(Weights::new(WeightFormat::Q4_1, &[0u8; 60], 1, 96).is_ok());
        assert!(Weights::new(WeightFormat::Q8_0, &[0u8; 34], 1, 40).is_err());
    }
}
