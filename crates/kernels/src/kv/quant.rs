//! Block-quantized KV cache rows (GGML's `q8_0` and `q4_0`): 32 values per
//! block with an f16 scale, quantized per head row (a head's `head_dim`
//! values are `head_dim / 32` whole blocks, so no block spans two heads).
//!
//! The arithmetic is GGML's reference (`quantize_row_q8_0_ref`,
//! `quantize_row_q4_0_ref`), so a row written here reads back as llama.cpp
//! would read it:
//!
//! ```text
//! q8_0: d = max|x| / 127, q_i = round(x_i / d)             x_i ≈ d·q_i,      q_i ∈ [-127, 127]
//! q4_0: m = the x of largest |x|, d = m / -8,
//!       q_i = min(15, trunc(x_i / d + 8.5))                 x_i ≈ d·(q_i − 8), q_i ∈ [0, 15]
//!       byte j of the block holds q_j (low nibble) and q_{j+16} (high)
//! ```
//!
//! Quantizing a dequantized block gives the same block back (the largest
//! value maps to ±127, or to −8, exactly).
//!
//! **Rows are stored rotated**, as llama.cpp stores a quantized cache: each
//! 64 values of a head row go through the orthonormal Walsh–Hadamard
//! transform `H` (entries ±1/8, `H = Hᵀ = H⁻¹`) before they are quantized.
//! It spreads a row's outliers over its blocks, so fewer values are lost to
//! a block's one scale. `q·k = (Hq)·(Hk)` and `Σ p·v = H(Σ p·Hv)`, so the
//! fast attention reads the blocks as they are, with `Hq` for queries and
//! `H` applied to its output; every other reader (the reference attention,
//! a context shift, sessions) un-rotates a row as it dequantizes it
//! ([`decode_row`]), and RoPE always acts on un-rotated keys. Hence a
//! quantized cache needs `head_dim` divisible by 64.
//!
//! A quantized cache tensor is `u8` of shape `[num_blocks, block_size,
//! n_kv_heads, head_dim / 32, block bytes]`: its last dimension (34 or 18)
//! names the type.

use candle_core::{bail, DType, Device, Result, Shape, Tensor};
use half::f16;

/// Values per quantized block.
pub const QK: usize = 32;
/// Values per Walsh–Hadamard rotation (two blocks).
pub const ROT: usize = 64;

/// The orthonormal Walsh–Hadamard transform of every 64 values of `x`
/// (Sylvester order; its own inverse): butterflies `(a + b, a − b)` over
/// strides 1 to 32, then a scale of 1/8 (exact).
pub fn hadamard64(x: &mut [f32]) {
    assert!(x.len().is_multiple_of(ROT), "rows of 64 values");
    for c in x.chunks_exact_mut(ROT) {
        let mut h = 1;
        while h < ROT {
            for i in (0..ROT).step_by(2 * h) {
                for j in i..i + h {
                    let (a, b) = (c[j], c[j + h]);
                    c[j] = a + b;
                    c[j + h] = a - b;
                }
            }
            h *= 2;
        }
        for v in c.iter_mut() {
            *v *= 0.125;
        }
    }
}

/// Quantizes whole head rows (`x.len()` a multiple of 64): rotated, then
/// one block per 32 values.
pub fn encode_row<B: QBlock>(x: &[f32], out: &mut [B]) {
    let mut t = [0f32; ROT];
    for (c, o) in x.chunks_exact(ROT).zip(out.chunks_exact_mut(2)) {
        t.copy_from_slice(c);
        hadamard64(&mut t);
        o[0] = B::quantize(&t[..QK]);
        o[1] = B::quantize(&t[QK..]);
    }
}

/// The values of whole head rows of blocks (an even number), un-rotated.
pub fn decode_row<B: QBlock>(blocks: &[B], out: &mut [f32]) {
    for (b, o) in blocks.chunks_exact(2).zip(out.chunks_exact_mut(ROT)) {
        b[0].dequantize(&mut o[..QK]);
        b[1].dequantize(&mut o[QK..]);
        hadamard64(o);
    }
}

/// 32 values as signed bytes times an f16 scale (34 bytes, no padding).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockQ8_0 {
    pub d: [u8; 2],
    pub qs: [i8; QK],
}

/// 32 values as nibbles (offset 8) times an f16 scale (18 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockQ4_0 {
    pub d: [u8; 2],
    pub qs: [u8; QK / 2],
}

impl BlockQ8_0 {
    #[inline]
    pub fn scale(&self) -> f32 {
        f16::from_le_bytes(self.d).to_f32()
    }
}

impl BlockQ4_0 {
    #[inline]
    pub fn scale(&self) -> f32 {
        f16::from_le_bytes(self.d).to_f32()
    }
}

/// A block with a NaN or an infinity quantizes to a NaN scale, so that it
/// reads back as NaN (as an f16 cache would keep it) instead of as zeros.
#[inline]
fn finite(x: &[f32; QK]) -> bool {
    x.iter().all(|v| v.is_finite())
}

/// Reinterprets bytes as blocks (both block types are byte arrays: align 1).
pub(crate) fn blocks<B: QBlock>(bytes: &[u8]) -> &[B] {
    assert!(bytes.len().is_multiple_of(B::BYTES));
    // SAFETY: `B` is `repr(C)` of byte arrays (size B::BYTES, align 1, every
    // bit pattern valid).
    unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const B, bytes.len() / B::BYTES) }
}

pub(crate) fn blocks_mut<B: QBlock>(bytes: &mut [u8]) -> &mut [B] {
    assert!(bytes.len().is_multiple_of(B::BYTES));
    // SAFETY: as `blocks`.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr() as *mut B, bytes.len() / B::BYTES) }
}

/// A quantized block type.
pub trait QBlock: Copy + Send + Sync + 'static {
    const BYTES: usize;
    /// GGML's rounding of 32 values.
    fn quantize(x: &[f32]) -> Self;
    /// The 32 values, `out[..32]`.
    fn dequantize(&self, out: &mut [f32]);
}

impl QBlock for BlockQ8_0 {
    const BYTES: usize = 34;

    fn quantize(x: &[f32]) -> BlockQ8_0 {
        let x: &[f32; QK] = x.try_into().expect("32 values");
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        if !finite(x) {
            return BlockQ8_0 {
                d: f16::NAN.to_le_bytes(),
                qs: [0; QK],
            };
        }
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0i8; QK];
        for (q, &v) in qs.iter_mut().zip(x) {
            *q = (v * id).round() as i8;
        }
        BlockQ8_0 {
            d: f16::from_f32(d).to_le_bytes(),
            qs,
        }
    }

    #[inline]
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.scale();
        for (o, &q) in out[..QK].iter_mut().zip(&self.qs) {
            *o = f32::from(q) * d;
        }
    }
}

impl QBlock for BlockQ4_0 {
    const BYTES: usize = 18;

    fn quantize(x: &[f32]) -> BlockQ4_0 {
        let x: &[f32; QK] = x.try_into().expect("32 values");
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        if !finite(x) {
            return BlockQ4_0 {
                d: f16::NAN.to_le_bytes(),
                qs: [0x88; QK / 2],
            };
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0u8; QK / 2];
        let q = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
        for (j, b) in qs.iter_mut().enumerate() {
            *b = q(x[j]) | (q(x[j + QK / 2]) << 4);
        }
        BlockQ4_0 {
            d: f16::from_f32(d).to_le_bytes(),
            qs,
        }
    }

    #[inline]
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.scale();
        for (j, &b) in self.qs.iter().enumerate() {
            out[j] = f32::from((b & 0xF) as i8 - 8) * d;
            out[j + QK / 2] = f32::from((b >> 4) as i8 - 8) * d;
        }
    }
}

const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);

/// The element type of a KV cache tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvType {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
}

impl KvType {
    pub const ALL: [KvType; 5] = [
        KvType::F32,
        KvType::F16,
        KvType::Bf16,
        KvType::Q8_0,
        KvType::Q4_0,
    ];

    /// The name used on the command line, in session headers and by
    /// llama.cpp's `--cache-type-k`.
    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Bf16 => "bf16",
            KvType::Q8_0 => "q8_0",
            KvType::Q4_0 => "q4_0",
        }
    }

    pub fn parse(s: &str) -> Option<KvType> {
        KvType::ALL.into_iter().find(|t| t.name() == s)
    }

    pub fn is_quantized(self) -> bool {
        matches!(self, KvType::Q8_0 | KvType::Q4_0)
    }

    /// Bytes of one quantized block (0 for the float types).
    fn block_bytes(self) -> usize {
        match self {
            KvType::Q8_0 => BlockQ8_0::BYTES,
            KvType::Q4_0 => BlockQ4_0::BYTES,
            _ => 0,
        }
    }

    /// The candle dtype of the tensor that stores it.
    pub fn storage_dtype(self) -> DType {
        match self {
            KvType::F32 => DType::F32,
            KvType::F16 => DType::F16,
            KvType::Bf16 => DType::BF16,
            KvType::Q8_0 | KvType::Q4_0 => DType::U8,
        }
    }

    /// The float type, if it is one.
    pub fn from_dtype(dtype: DType) -> Option<KvType> {
        match dtype {
            DType::F32 => Some(KvType::F32),
            DType::F16 => Some(KvType::F16),
            DType::BF16 => Some(KvType::Bf16),
            _ => None,
        }
    }

    /// Bytes that hold `values` values (a multiple of 32 for the
    /// quantized types).
    pub fn bytes_for(self, values: usize) -> usize {
        match self {
            KvType::Q8_0 | KvType::Q4_0 => values / QK * self.block_bytes(),
            _ => values * self.storage_dtype().size_in_bytes(),
        }
    }

    /// The tensor shape of a cache of this type.
    pub fn shape(
        self,
        num_blocks: usize,
        block_size: usize,
        kvh: usize,
        hd: usize,
    ) -> Result<Shape> {
        if self.is_quantized() {
            if !hd.is_multiple_of(ROT) {
                bail!(
                    "a {} KV cache needs head_dim divisible by {ROT}, the model has {hd}",
                    self.name()
                )
            }
            Ok(Shape::from((
                num_blocks,
                block_size,
                kvh,
                hd / QK,
                self.block_bytes(),
            )))
        } else {
            Ok(Shape::from((num_blocks, block_size, kvh, hd)))
        }
    }

    /// A zeroed cache tensor of this type (zero bytes are zeros in every
    /// type). On the CPU its memory is advised onto huge pages before the
    /// first touch (see [`crate::zeroed_huge`]).
    pub fn zeros(
        self,
        num_blocks: usize,
        block_size: usize,
        kvh: usize,
        hd: usize,
        device: &Device,
    ) -> Result<Tensor> {
        use crate::mem::zeroed_huge;
        let shape = self.shape(num_blocks, block_size, kvh, hd)?;
        if !device.is_cpu() {
            return Tensor::zeros(shape, self.storage_dtype(), device);
        }
        let n = shape.elem_count();
        match self {
            KvType::F32 => Tensor::from_vec(zeroed_huge::<f32>(n), shape, device),
            KvType::F16 => Tensor::from_vec(zeroed_huge::<f16>(n), shape, device),
            KvType::Bf16 => Tensor::from_vec(zeroed_huge::<half::bf16>(n), shape, device),
            KvType::Q8_0 | KvType::Q4_0 => Tensor::from_vec(zeroed_huge::<u8>(n), shape, device),
        }
    }

    /// The type of a cache tensor, from its dtype and shape.
    pub fn of(cache: &Tensor) -> Result<KvType> {
        KvType::of_dims(cache.dtype(), cache.dims())
    }

    pub(crate) fn of_dims(dtype: DType, dims: &[usize]) -> Result<KvType> {
        match (dtype, dims) {
            (DType::U8, [_, _, _, _, 34]) => Ok(KvType::Q8_0),
            (DType::U8, [_, _, _, _, 18]) => Ok(KvType::Q4_0),
            (d, [_, _, _, _]) if KvType::from_dtype(d).is_some() => {
                Ok(KvType::from_dtype(d).expect("float"))
            }
            (d, s) => bail!(
                "not a KV cache tensor: {d:?} {s:?} (f32/f16/bf16 [blocks, block_size, heads, head_dim], or u8 [.., head_dim/32, 34|18] for q8_0/q4_0)"
            ),
        }
    }
}

impl std::fmt::Display for KvType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// An f32 copy `[num_blocks, block_size, n_kv_heads, head_dim]` of a cache
/// tensor of any type (for references and tests).
pub fn dequantize_cache(cache: &Tensor) -> Result<Tensor> {
    let t = KvType::of(cache)?;
    if !t.is_quantized() {
        return cache.to_dtype(DType::F32);
    }
    let (nb, bs, kvh, hd) = crate::cache_geometry(cache)?;
    let bytes = cache.flatten_all()?.to_vec1::<u8>()?;
    let mut out = vec![0f32; nb * bs * kvh * hd];
    match t {
        KvType::Q8_0 => decode_all::<BlockQ8_0>(&bytes, &mut out),
        _ => decode_all::<BlockQ4_0>(&bytes, &mut out),
    }
    Tensor::from_vec(out, (nb, bs, kvh, hd), cache.device())
}

fn decode_all<B: QBlock>(bytes: &[u8], out: &mut [f32]) {
    decode_row(blocks::<B>(bytes), out)
}

/// A cache tensor of type `to` holding `values` (`[num_blocks, block_size,
/// n_kv_heads, head_dim]`, any float dtype), quantized as `write_kv` does.
pub fn quantize_cache(values: &Tensor, to: KvType) -> Result<Tensor> {
    let (nb, bs, kvh, hd) = values.dims4()?;
    if !to.is_quantized() {
        return values.to_dtype(to.storage_dtype());
    }
    let x = values
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let shape = to.shape(nb, bs, kvh, hd)?;
    let mut bytes = vec![0u8; shape.elem_count()];
    match to {
        KvType::Q8_0 => encode_all::<BlockQ8_0>(&x, &mut bytes),
        _ => encode_all::<BlockQ4_0>(&x, &mut bytes),
    }
    Tensor::from_vec(bytes, shape, values.device())
}

fn encode_all<B: QBlock>(x: &[f32], bytes: &mut [u8]) {
    encode_row(x, blocks_mut::<B>(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::seeded;

    /// GGML's reference arithmetic, written out as in ggml-quants.c.
    fn ggml_q8_0(x: &[f32]) -> (f32, Vec<i8>) {
        let amax = x.iter().map(|v| v.abs()).fold(0f32, f32::max);
        let d = amax / ((1 << 7) - 1) as f32;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        (d, x.iter().map(|v| (v * id).round() as i8).collect())
    }

    #[test]
    fn blocks_match_ggml_and_requantize_to_themselves() {
        for seed in 0..50u64 {
            let t = seeded(&[QK], seed, DType::F32).unwrap();
            let mut x: Vec<f32> = t.to_vec1().unwrap();
            if seed % 7 == 0 {
                x.iter_mut().for_each(|v| *v *= 1e-3);
            }
            if seed == 0 {
                x.iter_mut().for_each(|v| *v = 0.0);
            }
            let b8 = BlockQ8_0::quantize(&x);
            let (d, q) = ggml_q8_0(&x);
            assert_eq!(b8.d, f16::from_f32(d).to_le_bytes());
            assert_eq!(b8.qs.to_vec(), q);
            let b4 = BlockQ4_0::quantize(&x);
            let mut y = [0f32; QK];
            b8.dequantize(&mut y);
            let err8 = x
                .iter()
                .zip(&y)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            // Half a step, plus the f16 rounding of the scale over 127 steps.
            let bound = 0.5 * b8.scale() + 127.0 * (d - b8.scale()).abs() + 1e-7;
            assert!(err8 <= bound, "q8_0 error {err8} > {bound}");
            assert_eq!(BlockQ8_0::quantize(&y), b8, "q8_0 is idempotent");
            b4.dequantize(&mut y);
            let err4 = x
                .iter()
                .zip(&y)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            // A whole step where +8 clamps to +7.
            let d4 = x.iter().fold(0f32, |m, v| m.max(v.abs())) / 8.0;
            let bound = b4.scale().abs() + 8.0 * (d4 - b4.scale().abs()).abs() + 1e-7;
            assert!(err4 <= bound, "q4_0 error {err4} > {bound}");
            assert_eq!(BlockQ4_0::quantize(&y), b4, "q4_0 is idempotent");
        }
    }

    #[test]
    fn cache_round_trip_and_types() -> Result<()> {
        let x = seeded(&[3, 4, 2, 64], 5, DType::F32)?;
        for t in [KvType::Q8_0, KvType::Q4_0] {
            let q = quantize_cache(&x, t)?;
            assert_eq!(KvType::of(&q)?, t);
            assert_eq!(q.elem_count(), t.bytes_for(3 * 4 * 2 * 64));
            let back = dequantize_cache(&q)?;
            // Root-mean-square error (the rotation is orthonormal: it keeps
            // the rounding's energy, spread over the row).
            let tol = if t == KvType::Q8_0 { 0.005 } else { 0.08 };
            let rms = (&x - &back)?
                .sqr()?
                .mean_all()?
                .sqrt()?
                .to_scalar::<f32>()?;
            assert!(rms < tol, "{t}: rms error {rms}");
            // Rotated and back: the same bytes but where a value sits on a
            // rounding boundary.
            let again = quantize_cache(&back, t)?.to_vec1_flat()?;
            let q = q.to_vec1_flat()?;
            let same = again.iter().zip(&q).filter(|(a, b)| a == b).count();
            assert!(same * 100 >= again.len() * 99, "{same} of {}", again.len());
        }
        assert!(KvType::Q8_0.shape(1, 1, 1, 96).is_err());
        for t in KvType::ALL {
            assert_eq!(KvType::parse(t.name()), Some(t));
            assert_eq!(KvType::of(&t.zeros(2, 4, 1, 64, &Device::Cpu)?)?, t);
        }
        Ok(())
    }

    #[test]
    fn hadamard_is_orthonormal_and_its_own_inverse() {
        let x: Vec<f32> = (0..128)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let mut y = x.clone();
        hadamard64(&mut y);
        for (a, b) in [(&x[..64], &y[..64]), (&x[64..], &y[64..])] {
            let na: f32 = a.iter().map(|v| v * v).sum();
            let nb: f32 = b.iter().map(|v| v * v).sum();
            assert!((na - nb).abs() < 1e-3 * na);
        }
        // Row 1 of Sylvester's matrix: +, −, +, −, …
        let mut e = vec![0f32; 64];
        e[1] = 1.0;
        hadamard64(&mut e);
        let want = |i: usize| if i.is_multiple_of(2) { 0.125 } else { -0.125 };
        assert!(e.iter().enumerate().all(|(i, v)| *v == want(i)));
        hadamard64(&mut y);
        assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() < 1e-5));
        // An outlier spreads over the row: q4_0 keeps the row far better.
        let mut row: Vec<f32> = (0..64)
            .map(|i| ((i * 13 % 17) as f32 - 8.0) / 80.0)
            .collect();
        row[5] = 4.0;
        let plain = [
            BlockQ4_0::quantize(&row[..32]),
            BlockQ4_0::quantize(&row[32..]),
        ];
        let mut rotated = plain;
        encode_row(&row, &mut rotated);
        let mut a = vec![0f32; 64];
        plain[0].dequantize(&mut a[..32]);
        plain[1].dequantize(&mut a[32..]);
        let mut b = vec![0f32; 64];
        decode_row(&rotated, &mut b);
        let err = |v: &[f32]| -> f32 { v.iter().zip(&row).map(|(p, q)| (p - q) * (p - q)).sum() };
        assert!(
            err(&b) < err(&a),
            "rotated {} vs plain {}",
            err(&b),
            err(&a)
        );
    }

    trait Flat {
        fn to_vec1_flat(&self) -> Result<Vec<u8>>;
    }
    impl Flat for Tensor {
        fn to_vec1_flat(&self) -> Result<Vec<u8>> {
            self.flatten_all()?.to_vec1()
        }
    }
}
