//! Cache element types and their conversion to and from f32 in bulk (half's
//! slice conversions use SIMD where the CPU has it).

use candle_core::{bail, CpuStorage, Layout, Result};
use half::{bf16, f16, slice::HalfFloatSliceExt};

use crate::quant::{decode_row, encode_row, QBlock, QK};

/// A cache storage unit: one value, or one quantized block of
/// [`KvElem::PER`] values. Slices of units map to `PER` times as many f32s;
/// value offsets into a cache are multiples of a head row, so of `PER`.
pub(crate) trait KvElem: Copy + Send + Sync + 'static {
    /// Values per unit.
    const PER: usize = 1;
    fn load(src: &[Self], dst: &mut [f32]);
    fn store(src: &[f32], dst: &mut [Self]);
}

/// Whole head rows of blocks, stored rotated (see [`crate::quant`]).
impl<B: QBlock> KvElem for B {
    const PER: usize = QK;
    fn load(src: &[Self], dst: &mut [f32]) {
        decode_row(src, dst)
    }
    fn store(src: &[f32], dst: &mut [Self]) {
        encode_row(src, dst)
    }
}

impl KvElem for f32 {
    fn load(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
    fn store(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src)
    }
}

impl KvElem for f16 {
    fn load(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }
    fn store(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src)
    }
}

impl KvElem for bf16 {
    fn load(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }
    fn store(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src)
    }
}

/// The contiguous part of `data` that `layout` describes.
pub(crate) fn contiguous<'a, T>(data: &'a [T], layout: &Layout, what: &str) -> Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => bail!("{what} must be contiguous"),
    }
}

pub(crate) fn contiguous_mut<'a, T>(
    data: &'a mut [T],
    layout: &Layout,
    what: &str,
) -> Result<&'a mut [T]> {
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&mut data[a..b]),
        None => bail!("{what} must be contiguous"),
    }
}

/// The f32 data of a storage, or an error naming the tensor.
pub(crate) fn f32_data<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    match s {
        CpuStorage::F32(v) => contiguous(v, l, what),
        other => bail!(
            "{what} must be f32, got {:?}",
            candle_core::backend::BackendStorage::dtype(other)
        ),
    }
}

/// Runs `$body` with `$v` bound to the typed mutable cache data.
macro_rules! with_cache_mut {
    ($storage:expr, $layout:expr, |$v:ident| $body:expr) => {
        match $storage {
            candle_core::CpuStorage::F32(d) => {
                let $v = $crate::simd::elem::contiguous_mut(d, $layout, "KV cache")?;
                $body
            }
            candle_core::CpuStorage::F16(d) => {
                let $v = $crate::simd::elem::contiguous_mut(d, $layout, "KV cache")?;
                $body
            }
            candle_core::CpuStorage::BF16(d) => {
                let $v = $crate::simd::elem::contiguous_mut(d, $layout, "KV cache")?;
                $body
            }
            candle_core::CpuStorage::U8(d) => {
                let t = $crate::KvType::of_dims(candle_core::DType::U8, $layout.dims())?;
                let bytes = $crate::simd::elem::contiguous_mut(d, $layout, "KV cache")?;
                if t == $crate::KvType::Q8_0 {
                    let $v = $crate::quant::blocks_mut::<$crate::quant::BlockQ8_0>(bytes);
                    $body
                } else {
                    let $v = $crate::quant::blocks_mut::<$crate::quant::BlockQ4_0>(bytes);
                    $body
                }
            }
            other => candle_core::bail!(
                "KV cache dtype {:?} is not supported (f32, f16, bf16, q8_0, q4_0)",
                candle_core::backend::BackendStorage::dtype(other)
            ),
        }
    };
}
pub(crate) use with_cache_mut;
