//! `copy_blocks`: whole-block copies inside one cache tensor, for
//! copy-on-write and defragmentation.

use candle_core::{bail, CpuStorage, InplaceOp1, Layout, Result, Tensor};

use crate::simd::elem::{with_cache_mut, KvElem};

struct CopyBlocks<'a> {
    pairs: &'a [(u32, u32)],
    block_len: usize,
}

fn copy<T: KvElem>(cache: &mut [T], pairs: &[(u32, u32)], values: usize) {
    let n = values / T::PER;
    for &(src, dst) in pairs {
        cache.copy_within(src as usize * n..(src as usize + 1) * n, dst as usize * n);
    }
}

impl InplaceOp1 for CopyBlocks<'_> {
    fn name(&self) -> &'static str {
        "copy_blocks"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        with_cache_mut!(s, l, |cache| copy(cache, self.pairs, self.block_len));
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &Layout) -> Result<()> {
        let t = crate::KvType::of_dims(candle_core::backend::BackendStorage::dtype(s), l.dims())?;
        crate::gpu::cuda::copy_blocks(s, l, self.pairs, t.bytes_for(self.block_len))
    }

    #[cfg(all(feature = "metal", target_vendor = "apple"))]
    fn metal_fwd(&self, s: &mut candle_core::MetalStorage, l: &Layout) -> Result<()> {
        let t = crate::KvType::of_dims(candle_core::backend::BackendStorage::dtype(s), l.dims())?;
        crate::gpu::metal::copy_blocks(s, l, self.pairs, t.bytes_for(self.block_len))
    }
}

pub(crate) fn check(cache: &Tensor, pairs: &[(u32, u32)]) -> Result<usize> {
    let (nb, bs, kvh, hd) = crate::cache_geometry(cache)?;
    for &(s, d) in pairs {
        if s as usize >= nb || d as usize >= nb {
            bail!("copy_blocks: pair ({s}, {d}) outside the cache of {nb} blocks")
        }
    }
    let mut dsts: Vec<u32> = pairs.iter().map(|p| p.1).collect();
    dsts.sort_unstable();
    if dsts.windows(2).any(|w| w[0] == w[1])
        || pairs.iter().any(|p| dsts.binary_search(&p.0).is_ok())
    {
        bail!("copy_blocks: a destination repeats or is also a source; pairs must be independent")
    }
    Ok(bs * kvh * hd)
}

/// Copies block `src` to block `dst` for every pair, in place. Pairs must be
/// independent (no destination twice, no destination that is a source), as
/// copy-on-write and defragmentation plans are.
pub fn copy_blocks(cache: &Tensor, pairs: &[(u32, u32)]) -> Result<()> {
    let block_len = check(cache, pairs)?;
    if pairs.is_empty() {
        return Ok(());
    }
    cache.inplace_op1(&CopyBlocks { pairs, block_len })
}

/// Reference for [`copy_blocks`] in plain candle ops, as a new tensor.
pub fn copy_blocks_slow(cache: &Tensor, pairs: &[(u32, u32)]) -> Result<Tensor> {
    check(cache, pairs)?;
    let nb = cache.dim(0)?;
    // Any type: whole blocks of the pool are moved as they are.
    let mut pick: Vec<u32> = (0..nb as u32).collect();
    for &(s, d) in pairs {
        pick[d as usize] = s;
    }
    cache.index_select(&Tensor::new(pick, cache.device())?, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{max_abs_diff, seeded};
    use candle_core::DType;

    #[test]
    fn matches_reference() -> Result<()> {
        for dtype in crate::KvType::ALL {
            let cache = crate::testing::seeded_cache(&[8, 4, 2, 64], 9, dtype)?;
            let pairs = [(7, 0), (3, 1), (5, 6)];
            let want = copy_blocks_slow(&cache, &pairs)?;
            copy_blocks(&cache, &pairs)?;
            assert_eq!(max_abs_diff(&cache, &want)?, 0.0);
        }
        let cache = seeded(&[4, 4, 2, 8], 9, DType::F32)?;
        assert!(copy_blocks(&cache, &[(0, 1), (1, 2)]).is_err());
        assert!(copy_blocks(&cache, &[(0, 4)]).is_err());
        Ok(())
    }
}
