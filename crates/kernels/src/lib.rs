//! tessera-kernels: the operations that move KV bytes.
//!
//! **What this crate must not know:** block tables as types, the prefix tree,
//! scheduling policy. Block ids and slots reach it as plain integer lists;
//! kernels check shapes with `candle::bail!`, never decide.
//!
//! The KV cache of one layer is a pair of tensors (K and V) of shape
//! `[num_blocks, block_size, n_kv_heads, head_dim]`, dtype f32, f16 or bf16,
//! or block-quantized q8_0 / q4_0 ([`quant`]: each head row as GGML blocks
//! of 32 values).
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
//! The CPU forward pass (`tessera-model`'s fast path) also runs on this
//! crate: [`pool::StepPool`] (a persistent team of workers with barriers),
//! [`qmatvec`] (linear layers as integer dot products on repacked GGML
//! tiles, activations in two int8 levels per block), [`matvec`] (linear
//! layers on GGML blocks with f32 activations, one fixed order of fused
//! sums per row) and [`attend_item`]/[`merge`] (attention cut into
//! 128-position chunks merged by log-sum-exp). Each is compiled for
//! several instruction sets, chosen at run time ([`Isa`], [`QIsa`]), and
//! all give the same bits.
//!
//! With the `cuda` feature the KV ops also run on CUDA tensors ([`gpu`]:
//! one kernel source for CUDA, Metal and the host, `gpu/*.cu` for paged
//! attention). On Metal every op still returns an error that says so
//! (candle's default for custom ops).
//!
//! The source by concern: `kv/` (the movers: write, copy, shift, the RoPE
//! rotation they share with the forward, and the quantized cache types),
//! `attention/` (`paged`: the op over block tables and its reference;
//! `items`: the CPU forward's chunked attention), `linear/` (`matvec` and
//! `qdot`, the linear layers per instruction set), `norm.rs` (the
//! forward's per-row ops), `simd/` (the vector helpers the CPU kernels
//! share), `pool.rs` (the step pool), `gpu/`, and `tuning.rs`.

mod attention;
pub mod gpu;
mod kv;
mod linear;
mod mem;
mod norm;
pub mod pool;
mod simd;
pub mod tuning;

pub use kv::quant;
use simd::elem;

pub use attention::items::{
    attend_item, merge, AttnInput, AttnPlan, AttnScratch, AttnShape, KvRows, CHUNK,
};
pub use attention::paged::{paged_attention, paged_attention_slow, window_start, PagedMeta};
pub use kv::copy::{copy_blocks, copy_blocks_slow};
pub use kv::quant::{dequantize_cache, quantize_cache, KvType};
pub use kv::rope::{rotate_pairs, RopeStyle, Rotation};
pub use kv::shift::{rotate_k, rotate_k_slow, shift_kv, shift_kv_slow};
pub use kv::write::{write_kv, write_kv_raw, write_kv_slow};
pub use linear::matvec::{f16_to_f32, matvec, matvec_slow, Isa, WeightFormat, Weights};
pub use linear::qdot::{
    qmatvec, qmatvec_keyed, qmatvec_slow, quantize_row, ActBlock, Activations, ActsKey, Packed,
    QIsa, GROUP,
};
pub use linear::Emit;
pub use mem::{advise_huge_pages, read_buffer, timed_read, zeroed_huge};
pub use norm::{act_mul, act_mul_slow, rms_norm, rms_norm_in_place, rms_norm_slow, Activation};
pub use simd::exp_nonpositive;
pub use simd::portable_forced;
pub use tuning::{IsaCap, Tuning};

use candle_core::{bail, Result, Tensor};

/// `(num_blocks, block_size, n_kv_heads, head_dim)` of a cache tensor
/// `[num_blocks, block_size, n_kv_heads, head_dim]` (or, quantized,
/// `[.., n_kv_heads, head_dim / 32, block bytes]`: see [`quant`]).
pub fn cache_geometry(cache: &Tensor) -> Result<(usize, usize, usize, usize)> {
    let t = KvType::of(cache)?;
    if !cache.is_contiguous() {
        bail!("KV cache tensor must be contiguous")
    }
    let d = cache.dims();
    let hd = if t.is_quantized() {
        d[3] * quant::QK
    } else {
        d[3]
    };
    Ok((d[0], d[1], d[2], hd))
}

/// Deterministic tensors for tests and benches, and an allocation counter.
pub mod testing {
    #[cfg(target_arch = "x86_64")]
    pub use crate::linear::qdot::{qmatvec_vnni_evex_panels, qmatvec_vnni_evex_tiles};
    /// The largest single allocation made on the calling thread, for fuzz
    /// tests that check a loader allocates no more than its input justifies.
    /// Counted only in binaries that install [`CountingAlloc`].
    pub mod alloc_track {
        use std::alloc::{GlobalAlloc, Layout, System};
        use std::cell::Cell;

        thread_local! {
            static LARGEST: Cell<usize> = const { Cell::new(0) };
        }

        fn note(n: usize) {
            let _ = LARGEST.try_with(|c| {
                if n > c.get() {
                    c.set(n)
                }
            });
        }

        /// Resets the count and returns the previous largest allocation.
        pub fn take_largest() -> usize {
            LARGEST.with(|c| c.replace(0))
        }

        /// The system allocator, noting each request's size.
        pub struct CountingAlloc;

        // SAFETY: every call is passed to the system allocator unchanged; the
        // only addition is a thread-local counter that never allocates.
        unsafe impl GlobalAlloc for CountingAlloc {
            unsafe fn alloc(&self, l: Layout) -> *mut u8 {
                note(l.size());
                // SAFETY: forwarded with the caller's layout.
                unsafe { System.alloc(l) }
            }
            unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
                note(l.size());
                // SAFETY: forwarded with the caller's layout.
                unsafe { System.alloc_zeroed(l) }
            }
            unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
                note(n);
                // SAFETY: forwarded with the caller's pointer, layout and size.
                unsafe { System.realloc(p, l, n) }
            }
            unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
                // SAFETY: forwarded with the caller's pointer and layout.
                unsafe { System.dealloc(p, l) }
            }
        }
    }

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

    /// A seeded cache tensor `[nb, bs, kvh, hd]` of type `t` (quantized
    /// from the seeded f32 values).
    pub fn seeded_cache(shape: &[usize], seed: u64, t: crate::KvType) -> Result<Tensor> {
        crate::quantize_cache(&seeded(shape, seed, DType::F32)?, t)
    }

    pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        let a = a.to_dtype(DType::F32)?;
        let b = b.to_dtype(DType::F32)?;
        (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    }
}

/// A KV cache tensor's storage, for the fast forward pass to write and
/// read in place: `[num_slots · n_kv_heads · head_dim]` elements.
#[derive(Debug, Clone, Copy)]
pub enum CacheRaw {
    F32(*mut f32, usize),
    F16(*mut u16, usize),
    Bf16(*mut u16, usize),
    /// Blocks (not values) and their count.
    Q8_0(*mut quant::BlockQ8_0, usize),
    Q4_0(*mut quant::BlockQ4_0, usize),
}

// SAFETY: a plain address; whoever dereferences it upholds `cache_raw`'s
// contract.
unsafe impl Send for CacheRaw {}
unsafe impl Sync for CacheRaw {}

struct Capture(std::cell::Cell<Option<CacheRaw>>);

impl candle_core::InplaceOp1 for Capture {
    fn name(&self) -> &'static str {
        "cache_raw"
    }
    fn cpu_fwd(&self, s: &mut candle_core::CpuStorage, l: &candle_core::Layout) -> Result<()> {
        use candle_core::CpuStorage as S;
        let raw = match s {
            S::F32(v) => {
                let v = elem::contiguous_mut(v, l, "KV cache")?;
                CacheRaw::F32(v.as_mut_ptr(), v.len())
            }
            S::F16(v) => {
                let v = elem::contiguous_mut(v, l, "KV cache")?;
                CacheRaw::F16(v.as_mut_ptr() as *mut u16, v.len())
            }
            S::BF16(v) => {
                let v = elem::contiguous_mut(v, l, "KV cache")?;
                CacheRaw::Bf16(v.as_mut_ptr() as *mut u16, v.len())
            }
            S::U8(v) => {
                let t = KvType::of_dims(candle_core::DType::U8, l.dims())?;
                let v = elem::contiguous_mut(v, l, "KV cache")?;
                if t == KvType::Q8_0 {
                    let b = quant::blocks_mut::<quant::BlockQ8_0>(v);
                    CacheRaw::Q8_0(b.as_mut_ptr(), b.len())
                } else {
                    let b = quant::blocks_mut::<quant::BlockQ4_0>(v);
                    CacheRaw::Q4_0(b.as_mut_ptr(), b.len())
                }
            }
            other => bail!(
                "KV cache dtype {:?} is not supported (f32, f16, bf16, q8_0, q4_0)",
                candle_core::backend::BackendStorage::dtype(other)
            ),
        };
        self.0.set(Some(raw));
        Ok(())
    }
}

/// The address and length of a CPU cache tensor's elements.
///
/// The address stays valid while the tensor (and every clone sharing its
/// storage) lives; the caller must not let anything else read or write the
/// tensor while it uses the address.
pub fn cache_raw(cache: &Tensor) -> Result<CacheRaw> {
    cache_geometry(cache)?;
    let c = Capture(std::cell::Cell::new(None));
    cache.inplace_op1(&c)?;
    match c.0.get() {
        Some(r) => Ok(r),
        None => bail!("KV cache is not on the CPU"),
    }
}

impl CacheRaw {
    /// Stores one head row of K or V (`src`, f32) at value offset `at`,
    /// converted as [`write_kv`] converts (a quantized cache: rotated, then
    /// quantized, in whole blocks).
    ///
    /// # Safety
    /// The address is still valid ([`cache_raw`]'s contract), and no other
    /// thread reads or writes that row until this one is done with it.
    /// Panics when `at` and `src` fall outside the cache or, in a quantized
    /// cache, are not whole rotations of 64 values.
    pub unsafe fn store_row(self, at: usize, src: &[f32]) {
        use elem::KvElem;
        unsafe fn units<'a, T: KvElem>(p: *mut T, len: usize, at: usize, n: usize) -> &'a mut [T] {
            let per = T::PER;
            assert!(
                at.is_multiple_of(per) && n.is_multiple_of(per) && (at + n) / per <= len,
                "store_row: {n} values at {at} outside {len} units"
            );
            // Blocks hold rotated rows, rotated 64 values at a time.
            assert!(
                per == 1 || n.is_multiple_of(quant::ROT),
                "store_row: rows rotate 64 values at a time"
            );
            std::slice::from_raw_parts_mut(p.add(at / per), n / per)
        }
        match self {
            CacheRaw::F32(p, len) => f32::store(src, units(p, len, at, src.len())),
            CacheRaw::F16(p, len) => {
                half::f16::store(src, units(p as *mut half::f16, len, at, src.len()))
            }
            CacheRaw::Bf16(p, len) => {
                half::bf16::store(src, units(p as *mut half::bf16, len, at, src.len()))
            }
            CacheRaw::Q8_0(p, len) => quant::BlockQ8_0::store(src, units(p, len, at, src.len())),
            CacheRaw::Q4_0(p, len) => quant::BlockQ4_0::store(src, units(p, len, at, src.len())),
        }
    }

    /// The cache's rows, for attention to read.
    ///
    /// # Safety
    /// The address is still valid, and nothing writes the cache while the
    /// rows are read.
    pub unsafe fn rows(self) -> KvRows<'static> {
        match self {
            CacheRaw::F32(p, n) => KvRows::F32(std::slice::from_raw_parts(p, n)),
            CacheRaw::F16(p, n) => KvRows::F16(std::slice::from_raw_parts(p, n)),
            CacheRaw::Bf16(p, n) => KvRows::Bf16(std::slice::from_raw_parts(p, n)),
            CacheRaw::Q8_0(p, n) => KvRows::Q8_0(std::slice::from_raw_parts(p, n)),
            CacheRaw::Q4_0(p, n) => KvRows::Q4_0(std::slice::from_raw_parts(p, n)),
        }
    }
}
