//! `write_kv`: scatter the K (or V) rows of new tokens into their slots.

use candle_core::{bail, CpuStorage, DType, InplaceOp1, InplaceOp2, Layout, Result, Tensor};

use crate::simd::elem::{f32_data, with_cache_mut, KvElem};

struct WriteKv<'a> {
    slots: &'a [u32],
}

fn write_rows<T: KvElem>(cache: &mut [T], new: &[f32], slots: &[u32], row: usize) {
    let units = row / T::PER;
    for (i, &s) in slots.iter().enumerate() {
        let dst = &mut cache[s as usize * units..(s as usize + 1) * units];
        T::store(&new[i * row..(i + 1) * row], dst);
    }
}

impl InplaceOp2 for WriteKv<'_> {
    fn name(&self) -> &'static str {
        "write_kv"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let new = f32_data(s2, l2, "new K/V")?;
        let row = new.len() / self.slots.len().max(1);
        with_cache_mut!(s1, l1, |cache| write_rows(cache, new, self.slots, row));
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        crate::gpu::cuda::write_kv(s1, l1, s2, l2, self.slots)
    }

    #[cfg(all(feature = "metal", target_vendor = "apple"))]
    fn metal_fwd(
        &self,
        s1: &mut candle_core::MetalStorage,
        l1: &Layout,
        s2: &candle_core::MetalStorage,
        l2: &Layout,
    ) -> Result<()> {
        crate::gpu::metal::write_kv(s1, l1, s2, l2, self.slots)
    }
}

pub(crate) fn check(cache: &Tensor, new: &Tensor, slots: &[u32]) -> Result<()> {
    let (nb, bs, kvh, hd) = crate::cache_geometry(cache)?;
    let (t, nkvh, nhd) = new.dims3()?;
    if (nkvh, nhd) != (kvh, hd) || t != slots.len() {
        bail!(
            "write_kv: new K/V {:?} does not fit cache {:?} with {} slots",
            new.shape(),
            cache.shape(),
            slots.len()
        )
    }
    if let Some(&s) = slots.iter().find(|&&s| s as usize >= nb * bs) {
        bail!("write_kv: slot {s} outside the cache of {} slots", nb * bs)
    }
    Ok(())
}

/// Writes `new` (`[tokens, n_kv_heads, head_dim]`, any float dtype) into
/// `cache` at `slots` (one per token), converting to the cache dtype.
pub fn write_kv(cache: &Tensor, new: &Tensor, slots: &[u32]) -> Result<()> {
    check(cache, new, slots)?;
    if slots.is_empty() {
        return Ok(());
    }
    let new = new.to_dtype(DType::F32)?.contiguous()?;
    cache.inplace_op2(&new, &WriteKv { slots })
}

/// `cache` with rows `rows` (`[slots.len(), row]` of its storage dtype) at
/// `slots`, as a new tensor.
fn splice_rows(cache: &Tensor, rows: &Tensor, slots: &[u32]) -> Result<Tensor> {
    let n = cache.dim(0)? * cache.dim(1)?;
    let mut pick: Vec<u32> = (0..n as u32).collect();
    for (i, &s) in slots.iter().enumerate() {
        pick[s as usize] = (n + i) as u32;
    }
    let pick = Tensor::new(pick, cache.device())?;
    Tensor::cat(&[&cache.reshape((n, ()))?, rows], 0)?
        .index_select(&pick, 0)?
        .reshape(cache.shape())
}

/// Stores raw rows (`rows`: `slots.len()` rows of the cache's own bytes,
/// as [`crate::quant`] lays them out) at `slots`: a saved quantized row
/// goes back byte for byte.
pub fn write_kv_raw(cache: &Tensor, rows: &[u8], slots: &[u32]) -> Result<()> {
    let (nb, bs, kvh, hd) = crate::cache_geometry(cache)?;
    let t = crate::KvType::of(cache)?;
    let row = t.bytes_for(kvh * hd);
    if !t.is_quantized() || rows.len() != row * slots.len() {
        bail!(
            "write_kv_raw: {} bytes for {} rows of a {t} cache ({row} bytes each)",
            rows.len(),
            slots.len()
        )
    }
    if let Some(&s) = slots.iter().find(|&&s| s as usize >= nb * bs) {
        bail!(
            "write_kv_raw: slot {s} outside the cache of {} slots",
            nb * bs
        )
    }
    struct Raw<'a>(&'a [u8], &'a [u32], usize);
    impl InplaceOp1 for Raw<'_> {
        fn name(&self) -> &'static str {
            "write_kv_raw"
        }
        fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
            let CpuStorage::U8(d) = s else {
                bail!("write_kv_raw: not a quantized cache")
            };
            let d = crate::simd::elem::contiguous_mut(d, l, "KV cache")?;
            let row = self.2;
            for (i, &s) in self.1.iter().enumerate() {
                d[s as usize * row..(s as usize + 1) * row]
                    .copy_from_slice(&self.0[i * row..(i + 1) * row]);
            }
            Ok(())
        }
        #[cfg(feature = "cuda")]
        fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &Layout) -> Result<()> {
            crate::gpu::cuda::write_raw(s, l, self.0, self.1, self.2)
        }
    }
    cache.inplace_op1(&Raw(rows, slots, row))
}

/// Reference for [`write_kv`] in plain candle ops: the cache with the rows
/// replaced, as a new tensor.
pub fn write_kv_slow(cache: &Tensor, new: &Tensor, slots: &[u32]) -> Result<Tensor> {
    check(cache, new, slots)?;
    let t = crate::KvType::of(cache)?;
    if t.is_quantized() {
        // The new rows quantized, spliced into the cache's bytes.
        let (_, _, kvh, hd) = crate::cache_geometry(cache)?;
        let rows = crate::quantize_cache(&new.reshape((slots.len(), 1, kvh, hd))?, t)?;
        return splice_rows(cache, &rows.reshape((slots.len(), ()))?, slots);
    }
    let (nb, bs, kvh, hd) = cache.dims4()?;
    let n = nb * bs;
    let flat = cache.reshape((n, kvh * hd))?;
    let rows = new
        .to_dtype(cache.dtype())?
        .reshape((slots.len(), kvh * hd))?;
    let mut pick: Vec<u32> = (0..n as u32).collect();
    for (i, &s) in slots.iter().enumerate() {
        pick[s as usize] = (n + i) as u32;
    }
    let pick = Tensor::new(pick, cache.device())?;
    Tensor::cat(&[&flat, &rows], 0)?
        .index_select(&pick, 0)?
        .reshape(cache.shape())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{max_abs_diff, seeded};

    #[test]
    fn matches_reference_for_every_cache_dtype() -> Result<()> {
        for dtype in crate::KvType::ALL {
            let cache = crate::testing::seeded_cache(&[6, 4, 3, 64], 1, dtype)?;
            let new = seeded(&[5, 3, 64], 2, DType::F32)?;
            let slots = [0, 7, 9, 23, 12];
            let want = write_kv_slow(&cache, &new, &slots)?;
            write_kv(&cache, &new, &slots)?;
            assert_eq!(max_abs_diff(&cache, &want)?, 0.0, "{dtype:?}");
        }
        Ok(())
    }

    #[test]
    fn rejects_bad_shapes_and_slots() -> Result<()> {
        let cache = seeded(&[2, 4, 3, 8], 1, DType::F32)?;
        let new = seeded(&[2, 3, 8], 2, DType::F32)?;
        assert!(write_kv(&cache, &new, &[0]).is_err());
        assert!(write_kv(&cache, &new, &[0, 8]).is_err());
        let wrong = seeded(&[2, 2, 8], 2, DType::F32)?;
        assert!(write_kv(&cache, &wrong, &[0, 1]).is_err());
        Ok(())
    }
}
