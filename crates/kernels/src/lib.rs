//! tessera-kernels: the operations that move KV bytes.
//!
//! **What this crate must not know:** block tables as types, the prefix tree,
//! scheduling policy. Block ids and slots reach it as plain integer lists;
//! kernels check shapes with `candle::bail!`, never decide.
//!
//! The KV cache of one layer is a pair of tensors (K and V) of shape
//! `[num_blocks, block_size, n_kv_heads, head_dim]`, dtype f32, f16 or bf16.
//! A slot is `block * block_size + offset`, so viewed flat the cache is
//! `[num_slots, n_kv_heads, head_dim]`:
//!
//! ```text
//! slot s:  cache[s / block_size, s % block_size, :, :]   (n_kv_heads * head_dim values)
//! ```
//!
//! Ops, each with a slow reference in plain candle ops and a seeded parity
//! test beside it:
//! - [`write_kv`]: scatter new K or V rows into their slots;
//! - [`paged_attention`]: attention of new queries over cached K/V read
//!   through block tables (GQA, online softmax, f32 accumulation);
//! - [`copy_blocks`]: whole-block copies (copy-on-write, defragmentation);
//! - [`shift_kv`]: move slots and rotate K by a RoPE position delta
//!   (context shift).
//!
//! Only the CPU backend exists so far; on another device every op returns an
//! error that says so (candle's default for custom ops).

mod attention;
mod copy;
mod elem;
mod quant;
mod rope;
mod shift;
mod simd;
mod write;

pub use attention::{dot, paged_attention, paged_attention_slow, PagedMeta};
pub use copy::{copy_blocks, copy_blocks_slow};
pub use quant::{quantized_dots, RowFormat};
pub use rope::{RopeStyle, Rotation};
pub use shift::{shift_kv, shift_kv_slow};
pub use simd::portable_forced;
pub use write::{write_kv, write_kv_slow};

use candle_core::{bail, Result, Tensor};

/// `(num_slots, n_kv_heads, head_dim)` of a cache tensor
/// `[num_blocks, block_size, n_kv_heads, head_dim]`.
pub fn cache_geometry(cache: &Tensor) -> Result<(usize, usize, usize, usize)> {
    let (nb, bs, kvh, hd) = cache.dims4()?;
    if !cache.is_contiguous() {
        bail!("KV cache tensor must be contiguous")
    }
    Ok((nb, bs, kvh, hd))
}

/// Deterministic tensors for tests and benches.
pub mod testing {
    use candle_core::{DType, Device, Result, Tensor};

    /// Seeded pseudo-random tensor (xorshift), values in [-1, 1).
    pub fn seeded(shape: &[usize], seed: u64, dtype: DType) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dtype)
    }

    pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        let a = a.to_dtype(DType::F32)?;
        let b = b.to_dtype(DType::F32)?;
        (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    }
}
