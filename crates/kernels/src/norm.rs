//! `rms_norm` for the GPU forward: `y = x / sqrt(mean(x²) + eps) · w` per
//! row, f32. On CUDA one thread block per row (`gpu/norm.cu`), where
//! candle's own kernel gives a row one warp; on the CPU a plain loop (the
//! CPU forward has its own fused norms; this is the reference the CUDA
//! kernel is tested against).

use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

struct RmsNorm {
    eps: f32,
}

/// The rows and width of `x` (`[.., cols]`) and `w` (`[cols]`), both f32 and
/// contiguous.
fn geometry(lx: &Layout, lw: &Layout) -> Result<(usize, usize)> {
    let cols = *lx.dims().last().unwrap_or(&0);
    if lw.dims() != [cols] {
        bail!(
            "rms_norm: weight of shape {:?} for rows of {cols}",
            lw.dims()
        )
    }
    if lx.contiguous_offsets().is_none() || lw.contiguous_offsets().is_none() {
        bail!("rms_norm: inputs must be contiguous")
    }
    Ok((lx.shape().elem_count() / cols.max(1), cols))
}

/// One row: the sum of squares in f32, in order.
pub fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let scale = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms_norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, cols) = geometry(l1, l2)?;
        let (CpuStorage::F32(x), CpuStorage::F32(w)) = (s1, s2) else {
            bail!("rms_norm: f32 only")
        };
        let (a, b) = l1.contiguous_offsets().expect("checked");
        let (wa, wb) = l2.contiguous_offsets().expect("checked");
        let (x, w) = (&x[a..b], &w[wa..wb]);
        let mut out = vec![0f32; rows * cols];
        for (o, xr) in out.chunks_exact_mut(cols).zip(x.chunks_exact(cols)) {
            rms_norm_row(xr, w, self.eps, o);
        }
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, cols) = geometry(l1, l2)?;
        crate::gpu::cuda::rms_norm((s1, l1), (s2, l2), rows, cols, self.eps)
    }
}

/// `x / sqrt(mean(x²) + eps) · w` over the last dimension of `x` (f32,
/// contiguous), on the CPU or CUDA.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    x.apply_op2_no_bwd(w, &RmsNorm { eps })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::seeded;
    use candle_core::{DType, D};

    /// The op's rows are the plain formula's.
    #[test]
    fn rms_norm_matches_the_formula() -> Result<()> {
        let x = seeded(&[5, 96], 1, DType::F32)?;
        let w = seeded(&[96], 2, DType::F32)?;
        let got = rms_norm(&x, &w, 1e-5)?;
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
        let want = x.broadcast_div(&(ms + 1e-5)?.sqrt()?)?.broadcast_mul(&w)?;
        let d = (got - want)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        assert!(d < 1e-5, "{d}");
        assert!(rms_norm(&x, &seeded(&[95], 2, DType::F32)?, 1e-5).is_err());
        Ok(())
    }
}
