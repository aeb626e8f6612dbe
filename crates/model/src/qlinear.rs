//! Linear layers whose weights stay quantized in memory and are computed in
//! f32: a weight row is dequantized (candle's `GgmlType::to_float`, exact for
//! every block type) and dotted with f32 activations.
//!
//! candle's own quantized matmul first quantizes the activations to 8 bits
//! (Q8_1 for Q4_1 weights); on SmolLM2-135M Q4_1 that loses enough precision
//! to change greedy answers. Here the only rounding is the weights' own.
//!
//! - few rows of input (decode): one pass over the weights; Q4_1 and Q8_0
//!   rows are dotted in place (`tessera_kernels::quantized_dots`), other
//!   formats dequantized row by row into a small buffer;
//! - many rows (prefill): the weight is dequantized once into a dense f32
//!   matrix and multiplied with candle's GEMM.

use std::sync::Arc;

use candle_core::quantized::k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K,
    BlockQ8_1, GgmlType,
};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{bail, DType, Tensor};
use rayon::prelude::*;
use tessera_kernels::{dot, quantized_dots, RowFormat};

use crate::Result;

/// From this many input rows on, dequantize the whole weight and use GEMM.
const GEMM_ROWS: usize = 4;

/// `y = x · Wᵀ` with `W` of shape `[out, in]`.
pub enum QLinear {
    Quantized(Arc<QTensor>),
    Dense(Tensor),
}

impl QLinear {
    pub fn out_features(&self) -> usize {
        match self {
            QLinear::Quantized(w) => w.shape().dims()[0],
            QLinear::Dense(w) => w.dims()[0],
        }
    }

    /// `x`: `[T, in]` f32 → `[T, out]` f32.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            QLinear::Dense(w) => Ok(x.matmul(&w.t()?)?),
            QLinear::Quantized(w) if x.dim(0)? >= GEMM_ROWS => {
                let dense = w.dequantize(x.device())?;
                Ok(x.matmul(&dense.t()?)?)
            }
            QLinear::Quantized(w) => row_dots(w, x),
        }
    }
}

fn row_dots(w: &QTensor, x: &Tensor) -> Result<Tensor> {
    let (n, k) = w.shape().dims2()?;
    let (t, xk) = x.dims2()?;
    if xk != k {
        return Err(candle_core::Error::Msg(format!(
            "linear: input of width {xk} for a weight {n}x{k}"
        ))
        .into());
    }
    let x = x.to_dtype(DType::F32)?.contiguous()?;
    let xs = x.flatten_all()?.to_vec1::<f32>()?;
    let data = w.data()?;
    let out_t = match w.dtype() {
        GgmlDType::Q4_1 => Ok(quantized_dots(RowFormat::Q4_1, &data, &xs, t, k, n)?),
        GgmlDType::Q8_0 => Ok(quantized_dots(RowFormat::Q8_0, &data, &xs, t, k, n)?),
        GgmlDType::F32 => dots::<f32>(&data, &xs, t, k, n),
        GgmlDType::F16 => dots::<half::f16>(&data, &xs, t, k, n),
        GgmlDType::BF16 => dots::<half::bf16>(&data, &xs, t, k, n),
        GgmlDType::Q4_0 => dots::<BlockQ4_0>(&data, &xs, t, k, n),
        GgmlDType::Q5_0 => dots::<BlockQ5_0>(&data, &xs, t, k, n),
        GgmlDType::Q5_1 => dots::<BlockQ5_1>(&data, &xs, t, k, n),
        GgmlDType::Q8_1 => dots::<BlockQ8_1>(&data, &xs, t, k, n),
        GgmlDType::Q2K => dots::<BlockQ2K>(&data, &xs, t, k, n),
        GgmlDType::Q3K => dots::<BlockQ3K>(&data, &xs, t, k, n),
        GgmlDType::Q4K => dots::<BlockQ4K>(&data, &xs, t, k, n),
        GgmlDType::Q5K => dots::<BlockQ5K>(&data, &xs, t, k, n),
        GgmlDType::Q6K => dots::<BlockQ6K>(&data, &xs, t, k, n),
        GgmlDType::Q8K => dots::<BlockQ8K>(&data, &xs, t, k, n),
    }?;
    // Computed as [out, T]; T is small here.
    let y = Tensor::from_vec(out_t, (n, t), x.device())?;
    Ok(y.t()?.contiguous()?)
}

/// `[n, t]` dot products of every weight row with every input row.
fn dots<B: GgmlType>(
    data: &[u8],
    x: &[f32],
    t: usize,
    k: usize,
    n: usize,
) -> candle_core::Result<Vec<f32>> {
    let per_row = k / B::BLCK_SIZE;
    let size = std::mem::size_of::<B>();
    if !k.is_multiple_of(B::BLCK_SIZE) || data.len() != n * per_row * size {
        bail!(
            "linear: weight storage of {} bytes does not hold {n}x{k} {:?}",
            data.len(),
            B::DTYPE
        )
    }
    if !(data.as_ptr() as usize).is_multiple_of(std::mem::align_of::<B>()) {
        bail!("linear: weight storage is not aligned for {:?}", B::DTYPE)
    }
    // SAFETY: the length and alignment were checked above, `B` is a
    // `#[repr(C)]` plain-data block type that candle itself stores in this
    // buffer, and the slice borrows `data` for no longer than `data` lives.
    let blocks: &[B] =
        unsafe { std::slice::from_raw_parts(data.as_ptr() as *const B, n * per_row) };
    let mut out = vec![0f32; n * t];
    out.par_chunks_mut(t).enumerate().for_each_init(
        || vec![0f32; k],
        |row, (j, o)| {
            B::to_float(&blocks[j * per_row..(j + 1) * per_row], row);
            for (i, y) in o.iter_mut().enumerate() {
                *y = dot(row, &x[i * k..(i + 1) * k]);
            }
        },
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use tessera_kernels::testing::seeded;

    /// Both paths equal the dense product with the dequantized weight.
    #[test]
    fn quantized_paths_match_dense_dequantized() -> Result<()> {
        let dev = Device::Cpu;
        let w = seeded(&[48, 64], 1, DType::F32)?;
        for dtype in [
            GgmlDType::Q4_1,
            GgmlDType::Q8_0,
            GgmlDType::Q4K,
            GgmlDType::F16,
        ] {
            let k = if dtype == GgmlDType::Q4K { 256 } else { 64 };
            let w = if k == 64 {
                w.clone()
            } else {
                seeded(&[48, 256], 2, DType::F32)?
            };
            let q = Arc::new(QTensor::quantize(&w, dtype)?);
            let dense = q.dequantize(&dev)?;
            for t in [1, 3, 9] {
                let x = seeded(&[t, k], 3 + t as u64, DType::F32)?;
                let want = x.matmul(&dense.t()?)?;
                let got = QLinear::Quantized(q.clone()).forward(&x)?;
                let d = (want - got)?
                    .abs()?
                    .flatten_all()?
                    .max(0)?
                    .to_scalar::<f32>()?;
                assert!(d < 1e-3, "{dtype:?} t={t}: {d}");
            }
        }
        Ok(())
    }
}
