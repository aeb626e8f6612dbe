//! Linear layers of the candle reference forward: weights stay quantized in
//! memory and are computed in f32 (the values of candle's exact
//! `GgmlType::to_float`) with f32 activations.
//!
//! candle's own quantized matmul first quantizes the activations to 8 bits
//! (Q8_1 for Q4_1 weights); on SmolLM2-135M Q4_1 that loses enough precision
//! to change greedy answers. Here the only rounding is the weights' own.
//!
//! - few rows of input (decode): one pass over the weights with
//!   `tessera_kernels::matvec` (the fast path's kernel), rows split among
//!   rayon tasks;
//! - many rows (prefill): the weight is dequantized once into a dense f32
//!   matrix and multiplied with candle's GEMM;
//! - on a GPU the blocks stay there, quantized: one row goes through
//!   candle's matrix-vector kernel, which dequantizes them in f32 against
//!   the f32 activations (on CUDA its 8-bit-activation kernels are switched
//!   off at load); more rows dequantize the weight there for the GEMM.

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{CpuStorage, DType, Storage, Tensor};
use rayon::prelude::*;
use tessera_kernels::{matvec, Isa, WeightFormat, Weights};

use crate::Result;

/// From this many input rows on, dequantize the whole weight and use GEMM.
const GEMM_ROWS: usize = 4;

/// `y = x · Wᵀ` with `W` of shape `[out, in]`.
#[derive(Clone)]
pub enum QLinear {
    Quantized(Arc<QTensor>),
    Dense(Tensor),
}

impl QLinear {
    fn is_cpu(&self) -> bool {
        match self {
            QLinear::Quantized(w) => w.device().is_cpu(),
            QLinear::Dense(w) => w.device().is_cpu(),
        }
    }

    pub fn out_features(&self) -> usize {
        match self {
            QLinear::Quantized(w) => w.shape().dims()[0],
            QLinear::Dense(w) => w.dims()[0],
        }
    }

    /// Rows `ids` of the weight as f32, one after another into `out`
    /// (`ids.len() · in` values): an embedding lookup that dequantizes
    /// only the rows it reads. Ids are checked.
    pub fn rows(&self, ids: &[u32], out: &mut [f32]) -> Result<()> {
        let (n, k) = match self {
            QLinear::Quantized(w) => w.shape().dims2()?,
            QLinear::Dense(w) => w.dims2()?,
        };
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= n) {
            return Err(crate::ModelError::Config(format!(
                "token id {id} outside the vocabulary of {n}"
            )));
        }
        let out = &mut out[..ids.len() * k];
        match self {
            QLinear::Quantized(w) => {
                let data = w.data()?;
                let weights = Weights::new(WeightFormat::from_ggml(w.dtype()), &data, n, k)?;
                for (&id, o) in ids.iter().zip(out.chunks_exact_mut(k)) {
                    weights.dequantize_row(id as usize, o);
                }
            }
            QLinear::Dense(w) => {
                let (st, layout) = w.storage_and_layout();
                let table = match (&*st, layout.contiguous_offsets()) {
                    (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => &v[a..b],
                    _ => {
                        drop(st);
                        let ids = Tensor::new(ids, w.device())?;
                        let rows = w.index_select(&ids, 0)?.to_dtype(DType::F32)?;
                        out.copy_from_slice(&rows.flatten_all()?.to_vec1::<f32>()?);
                        return Ok(());
                    }
                };
                for (&id, o) in ids.iter().zip(out.chunks_exact_mut(k)) {
                    let r = id as usize;
                    o.copy_from_slice(&table[r * k..(r + 1) * k]);
                }
            }
        }
        Ok(())
    }

    /// `x`: `[T, in]` f32 → `[T, out]` f32.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            // f16/bf16 weights (safetensors on a GPU) widened exactly to
            // the activations' f32 for the product.
            QLinear::Dense(w) if w.dtype() != x.dtype() => {
                Ok(x.matmul(&w.to_dtype(x.dtype())?.t()?)?)
            }
            QLinear::Dense(w) => Ok(x.matmul(&w.t()?)?),
            QLinear::Quantized(w) => {
                let gpu = !w.device().is_cpu();
                if gpu && !x.device().same_device(&w.device()) {
                    return Err(candle_core::Error::Msg(
                        "linear: input and weight on different devices".into(),
                    )
                    .into());
                }
                let x = if gpu {
                    x.to_dtype(DType::F32)?.contiguous()?
                } else {
                    x.clone()
                };
                // A GPU dequantizes for the GEMM from two rows on.
                if x.dim(0)? >= if gpu { 2 } else { GEMM_ROWS } {
                    let dense = w.dequantize(x.device())?;
                    Ok(x.matmul(&dense.t()?)?)
                } else if gpu {
                    // One row on a GPU: candle's matrix-vector kernel,
                    // which dequantizes in f32 against f32 activations (on
                    // CUDA once told at load: `loader::exact_cuda_matmul`).
                    Ok(x.apply_op1_no_bwd(w.as_ref())?)
                } else {
                    row_dots(w, &x)
                }
            }
        }
    }
}

/// Projections of one input (a layer's q, k and v, or gate and up): `N`
/// weights of their own, or on a GPU stacked into one (their rows one
/// after another), so that one product, one kernel launch, gives all `N`
/// outputs side by side.
#[derive(Clone)]
pub enum Proj<const N: usize> {
    Split([QLinear; N]),
    /// The stacked weight and each part's output width.
    Stacked(QLinear, [usize; N]),
}

impl<const N: usize> Proj<N> {
    /// `parts` stacked where that is possible and worth it (on a GPU, all
    /// quantized in one format, or all dense in one dtype, with one input
    /// width); split otherwise. Each output row is the same dot product
    /// either way.
    pub fn new(parts: [QLinear; N]) -> Result<Proj<N>> {
        if parts.iter().any(|p| p.is_cpu()) {
            return Ok(Proj::Split(parts));
        }
        Proj::stacked(parts)
    }

    /// `parts` stacked wherever they are, where they share a format and an
    /// input width (split otherwise).
    pub(crate) fn stacked(parts: [QLinear; N]) -> Result<Proj<N>> {
        match stack(&parts)? {
            Some(w) => Ok(Proj::Stacked(w, parts.map(|p| p.out_features()))),
            None => Ok(Proj::Split(parts)),
        }
    }

    /// The separate weights (the CPU fast path reads them); `None` once
    /// stacked.
    pub fn split(&self) -> Option<&[QLinear; N]> {
        match self {
            Proj::Split(p) => Some(p),
            Proj::Stacked(..) => None,
        }
    }

    /// `x`: `[T, in]` → the `N` outputs `[T, out_i]`.
    pub fn forward(&self, x: &Tensor) -> Result<[Tensor; N]> {
        let ys = match self {
            Proj::Split(p) => p.iter().map(|w| w.forward(x)).collect::<Result<Vec<_>>>()?,
            Proj::Stacked(w, widths) => {
                let y = w.forward(x)?;
                let mut at = 0;
                widths
                    .iter()
                    .map(|&n| {
                        let part = y.narrow(1, at, n);
                        at += n;
                        part
                    })
                    .collect::<candle_core::Result<Vec<_>>>()?
            }
        };
        Ok(ys.try_into().unwrap_or_else(|_| unreachable!("N outputs")))
    }
}

/// One weight holding the rows of `parts` in order, where they share a
/// format and an input width; `None` otherwise.
fn stack(parts: &[QLinear]) -> Result<Option<QLinear>> {
    use candle_core::quantized::QStorage;
    let Some(first) = parts.first() else {
        return Ok(None);
    };
    match first {
        QLinear::Quantized(w0) => {
            let dev = w0.device();
            let (_, k) = w0.shape().dims2()?;
            let mut ws = Vec::with_capacity(parts.len());
            for p in parts {
                match p {
                    QLinear::Quantized(w)
                        if w.dtype() == w0.dtype() && w.shape().dims2()?.1 == k =>
                    {
                        ws.push(w)
                    }
                    _ => return Ok(None),
                }
            }
            // A row is whole blocks, so the stacked blocks are the parts'
            // bytes one after another.
            let mut bytes = Vec::new();
            let mut n = 0;
            for w in ws {
                bytes.extend_from_slice(&w.data()?);
                n += w.shape().dims2()?.0;
            }
            let storage = QStorage::from_data(std::borrow::Cow::Owned(bytes), &dev, w0.dtype())?;
            Ok(Some(QLinear::Quantized(Arc::new(QTensor::new(
                storage,
                (n, k),
            )?))))
        }
        QLinear::Dense(w0) => {
            let mut ws = Vec::with_capacity(parts.len());
            for p in parts {
                match p {
                    QLinear::Dense(w) if w.dtype() == w0.dtype() && w.dim(1)? == w0.dim(1)? => {
                        ws.push(w)
                    }
                    _ => return Ok(None),
                }
            }
            Ok(Some(QLinear::Dense(Tensor::cat(&ws, 0)?)))
        }
    }
}

/// Weight rows per task of the row path.
const ROWS_PER_TASK: usize = 64;

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
    let weights = Weights::new(WeightFormat::from_ggml(w.dtype()), &data, n, k)?;
    let isa = Isa::detect();
    // Computed as [out, T]; T is small here.
    let mut out = vec![0f32; n * t];
    out.par_chunks_mut(ROWS_PER_TASK * t)
        .enumerate()
        .for_each_init(Vec::new, |scratch, (c, o)| {
            let r0 = c * ROWS_PER_TASK;
            let r1 = (r0 + ROWS_PER_TASK).min(n);
            matvec(isa, &weights, &xs, t, r0, r1, scratch, &mut |i, r, v| {
                o[(r - r0) * t + i] = v
            });
        });
    let y = Tensor::from_vec(out, (n, t), x.device())?;
    Ok(y.t()?.contiguous()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;
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
            // Row lookups give the dequantized rows exactly.
            let ids = [5u32, 0, 47, 5];
            let mut got = vec![0f32; ids.len() * k];
            QLinear::Quantized(q.clone()).rows(&ids, &mut got)?;
            let want = dense.index_select(&Tensor::new(&ids[..], &dev)?, 0)?;
            assert_eq!(got, want.flatten_all()?.to_vec1::<f32>()?, "{dtype:?}");
            let mut dense_got = vec![0f32; ids.len() * k];
            QLinear::Dense(dense.clone()).rows(&ids, &mut dense_got)?;
            assert_eq!(got, dense_got);
            assert!(QLinear::Dense(dense.clone()).rows(&[48], &mut got).is_err());
        }
        Ok(())
    }

    /// Stacked projections give each part's product (the same dot
    /// products, one launch); mixed formats stay split.
    #[test]
    fn stacked_projections_give_each_parts_product() -> Result<()> {
        let parts = |dtypes: [GgmlDType; 3]| -> Result<[QLinear; 3]> {
            let mut out = Vec::new();
            for (i, (dt, n)) in dtypes.iter().zip([64, 32, 32]).enumerate() {
                let w = seeded(&[n, 64], 10 + i as u64, DType::F32)?;
                out.push(QLinear::Quantized(Arc::new(QTensor::quantize(&w, *dt)?)));
            }
            Ok(out.try_into().unwrap_or_else(|_| unreachable!()))
        };
        let x = seeded(&[3, 64], 20, DType::F32)?;
        let same = parts([GgmlDType::Q4_1; 3])?;
        // On the CPU the fast path reads the parts: never stacked there.
        assert!(Proj::new(same.clone())?.split().is_some());
        let stacked = Proj::stacked(same.clone())?;
        assert!(stacked.split().is_none());
        let got = stacked.forward(&x)?;
        for (p, g) in same.iter().zip(&got) {
            let want = p.forward(&x)?;
            assert_eq!(g.dims(), want.dims());
            assert_eq!(
                g.contiguous()?.flatten_all()?.to_vec1::<f32>()?,
                want.flatten_all()?.to_vec1::<f32>()?
            );
        }
        let mixed = parts([GgmlDType::Q4_1, GgmlDType::Q4_1, GgmlDType::Q8_0])?;
        assert!(Proj::stacked(mixed)?.split().is_some());
        let dense: [QLinear; 2] = [
            QLinear::Dense(seeded(&[16, 64], 30, DType::F32)?),
            QLinear::Dense(seeded(&[8, 64], 31, DType::F32)?),
        ];
        let [a, b] = Proj::stacked(dense.clone())?.forward(&x)?;
        for (p, g) in dense.iter().zip([a, b]) {
            let want = p.forward(&x)?.flatten_all()?.to_vec1::<f32>()?;
            assert_eq!(g.contiguous()?.flatten_all()?.to_vec1::<f32>()?, want);
        }
        Ok(())
    }

    /// f16/bf16 weights (safetensors on a GPU) multiply f32 inputs as their
    /// exact f32 widening does, and give f32.
    #[test]
    fn half_weights_widen_exactly() -> Result<()> {
        let x = seeded(&[3, 64], 4, DType::F32)?;
        for dtype in [DType::F16, DType::BF16] {
            let w = seeded(&[48, 64], 1, DType::F32)?.to_dtype(dtype)?;
            let got = QLinear::Dense(w.clone()).forward(&x)?;
            assert_eq!(got.dtype(), DType::F32);
            let want = x.matmul(&w.to_dtype(DType::F32)?.t()?)?;
            assert_eq!(
                got.flatten_all()?.to_vec1::<f32>()?,
                want.flatten_all()?.to_vec1::<f32>()?,
                "{dtype:?}"
            );
        }
        Ok(())
    }
}
