//! The GPU kernel source run on the CPU (`kernel-emu` feature): `gpu/emu.cpp`
//! (the host prelude and the shared bodies) compiled by `build.rs`, each
//! entry point called once per thread of the grid the GPU launchers use.
//! The ops take CPU tensors and check their arguments as the CPU ops do.

use candle_core::{DType, Result, Tensor};

use super::{gather_launch, hadamard_launch, moved_rows, write_launch, Launch, RopeTables};
use crate::{cache_raw, CacheRaw, KvType, Rotation};

#[repr(C)]
#[derive(Clone, Copy)]
struct TsIdx {
    blk: u32,
    tid: u32,
    nthreads: u32,
}

/// `write_kv`'s entry point: (thread, src, cache, slots, row).
type WriteFn = unsafe extern "C" fn(TsIdx, *const f32, *mut u8, *const u32, u32);
/// `rope_gather`'s: (thread, cache, out, slots, tables, cos, sin, heads,
/// head_dim, neox).
type GatherFn = unsafe extern "C" fn(
    TsIdx,
    *const u8,
    *mut f32,
    *const u32,
    *const u32,
    *const f32,
    *const f32,
    u32,
    u32,
    u32,
);

// The caches' element pointers are declared as bytes here: the C entry
// points take typed pointers of the same address (every cache buffer is
// aligned for its element type).
macro_rules! entry_points {
    (write: $($w:ident),*; gather: $($g:ident),*) => {
        extern "C" {
            $(fn $w(ix: TsIdx, src: *const f32, cache: *mut u8, slots: *const u32, row: u32);)*
            $(fn $g(
                ix: TsIdx,
                cache: *const u8,
                out: *mut f32,
                slots: *const u32,
                tables: *const u32,
                cos_t: *const f32,
                sin_t: *const f32,
                heads: u32,
                head_dim: u32,
                neox: u32,
            );)*
        }
    };
}

entry_points!(
    write: tessera_write_kv_f32, tessera_write_kv_f16, tessera_write_kv_bf16,
        tessera_write_kv_q8_0, tessera_write_kv_q4_0;
    gather: tessera_rope_gather_f32, tessera_rope_gather_f16, tessera_rope_gather_bf16,
        tessera_rope_gather_q8_0, tessera_rope_gather_q4_0
);

extern "C" {
    fn tessera_copy_blocks(ix: TsIdx, cache: *mut u16, pairs: *const u32, units: u32);
    fn tessera_gather_rows(ix: TsIdx, src: *const u16, dst: *mut u16, idx: *const u32, units: u32);
    fn tessera_scatter_rows(ix: TsIdx, src: *const u16, dst: *mut u16, idx: *const u32, units: u32);
    fn tessera_hadamard_rows(ix: TsIdx, x: *mut f32, chunks: u32);
}

/// Every thread of the grid, block after block.
fn run(l: Launch, mut thread: impl FnMut(TsIdx)) {
    for blk in 0..l.blocks {
        for tid in 0..l.threads {
            thread(TsIdx {
                blk,
                tid,
                nthreads: l.threads,
            })
        }
    }
}

/// A cache's type and the address of its storage.
#[derive(Clone, Copy)]
struct Cache {
    t: KvType,
    base: *mut u8,
}

fn cache_of(cache: &Tensor) -> Result<Cache> {
    let t = KvType::of(cache)?;
    let base = match cache_raw(cache)? {
        CacheRaw::F32(p, _) => p as *mut u8,
        CacheRaw::F16(p, _) | CacheRaw::Bf16(p, _) => p as *mut u8,
        CacheRaw::Q8_0(p, _) => p as *mut u8,
        CacheRaw::Q4_0(p, _) => p as *mut u8,
    };
    Ok(Cache { t, base })
}

fn write_fn(t: KvType) -> WriteFn {
    match t {
        KvType::F32 => tessera_write_kv_f32,
        KvType::F16 => tessera_write_kv_f16,
        KvType::Bf16 => tessera_write_kv_bf16,
        KvType::Q8_0 => tessera_write_kv_q8_0,
        KvType::Q4_0 => tessera_write_kv_q4_0,
    }
}

fn gather_fn(t: KvType) -> GatherFn {
    match t {
        KvType::F32 => tessera_rope_gather_f32,
        KvType::F16 => tessera_rope_gather_f16,
        KvType::Bf16 => tessera_rope_gather_bf16,
        KvType::Q8_0 => tessera_rope_gather_q8_0,
        KvType::Q4_0 => tessera_rope_gather_q4_0,
    }
}

/// Stores f32 `rows` (`slots.len()` rows of `row` values) at `slots`.
fn scatter(c: Cache, rows: &[f32], slots: &[u32], row: usize) {
    let f = write_fn(c.t);
    let (src, s, r) = (rows.as_ptr(), slots.as_ptr(), row as u32);
    // SAFETY: `rows` holds `slots.len() * row` values, every slot was checked
    // to lie inside the cache, and nothing else touches the cache meanwhile.
    run(write_launch(c.t, slots.len(), row), |ix| unsafe {
        f(ix, src, c.base, s, r)
    });
}

/// The rows at `slots` as f32, rotated per `t`.
fn gather(
    c: Cache,
    slots: &[u32],
    t: &RopeTables,
    heads: usize,
    head_dim: usize,
    neox: bool,
) -> Vec<f32> {
    let mut out = vec![0f32; slots.len() * heads * head_dim];
    let f = gather_fn(c.t);
    let (o, s, tb, cs, sn) = (
        out.as_mut_ptr(),
        slots.as_ptr(),
        t.tables.as_ptr(),
        t.cos.as_ptr(),
        t.sin.as_ptr(),
    );
    let (h, d, n) = (heads as u32, head_dim as u32, neox as u32);
    // SAFETY: `out` holds a row per slot, the slots were checked, and every
    // table index points at a whole table of `head_dim / 2` values.
    run(
        gather_launch(c.t, slots.len(), heads, head_dim),
        |ix| unsafe { f(ix, c.base, o, s, tb, cs, sn, h, d, n) },
    );
    out
}

/// Rows moved as they are (every row read before any is written), `units`
/// 16-bit units each: a quantized cache's V rows in a context shift.
fn move_raw(c: Cache, src: &[u32], dst: &[u32], units: usize) {
    let mut tmp = vec![0u16; src.len() * units];
    let l = Launch::per_item(src.len(), units);
    let (base, u) = (c.base as *mut u16, units as u32);
    // SAFETY: both index lists were checked against the cache, `tmp` holds
    // a row per index, and the rows are 16-bit aligned (even row bytes).
    run(l, |ix| unsafe {
        tessera_gather_rows(ix, base, tmp.as_mut_ptr(), src.as_ptr(), u)
    });
    // SAFETY: as above.
    run(l, |ix| unsafe {
        tessera_scatter_rows(ix, tmp.as_ptr(), base, dst.as_ptr(), u)
    });
}

/// [`crate::write_kv`] through the GPU kernel source.
pub fn write_kv(cache: &Tensor, new: &Tensor, slots: &[u32]) -> Result<()> {
    crate::kv::write::check(cache, new, slots)?;
    let c = cache_of(cache)?;
    let rows = new.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    scatter(c, &rows, slots, rows.len() / slots.len().max(1));
    Ok(())
}

/// [`crate::copy_blocks`] through the GPU kernel source (any cache type:
/// blocks move as 16-bit units).
pub fn copy_blocks(cache: &Tensor, pairs: &[(u32, u32)]) -> Result<()> {
    let values = crate::kv::copy::check(cache, pairs)?;
    let units = (KvType::of(cache)?.bytes_for(values) / 2) as u32;
    let flat: Vec<u32> = pairs.iter().flat_map(|&(s, d)| [s, d]).collect();
    let base = cache_of(cache)?.base as *mut u16;
    // SAFETY: the pairs were checked to name blocks inside the cache.
    run(Launch::per_item(pairs.len(), units as usize), |ix| unsafe {
        tessera_copy_blocks(ix, base, flat.as_ptr(), units)
    });
    Ok(())
}

/// [`crate::shift_kv`] through the GPU kernel source: every source row
/// gathered (K rotated) before any is written; a quantized cache's V rows
/// move as they are.
pub fn shift_kv(
    k_cache: &Tensor,
    v_cache: &Tensor,
    moves: &[(u32, u32)],
    rotation: &Rotation,
) -> Result<()> {
    let (heads, head_dim) = crate::kv::shift::check(k_cache, v_cache, moves, rotation)?;
    let (k, v) = (cache_of(k_cache)?, cache_of(v_cache)?);
    let (src, dst): (Vec<u32>, Vec<u32>) = moves.iter().copied().unzip();
    let neox = rotation.style == crate::RopeStyle::Neox;
    let row = heads * head_dim;
    let moved = gather(
        k,
        &src,
        &RopeTables::uniform(src.len(), rotation),
        heads,
        head_dim,
        neox,
    );
    scatter(k, &moved, &dst, row);
    if v.t.is_quantized() {
        move_raw(v, &src, &dst, v.t.bytes_for(row) / 2);
    } else {
        let moved = gather(v, &src, &RopeTables::none(src.len()), heads, head_dim, neox);
        scatter(v, &moved, &dst, row);
    }
    Ok(())
}

/// [`crate::rotate_k`] through the GPU kernel source.
pub fn rotate_k(
    k_cache: &Tensor,
    slots: &[u32],
    deltas: &[i64],
    rotation: &Rotation,
) -> Result<()> {
    let (heads, head_dim) = crate::kv::shift::check_rotate(k_cache, slots, deltas, rotation)?;
    let k = cache_of(k_cache)?;
    let (slots, deltas) = moved_rows(slots, deltas);
    let neox = rotation.style == crate::RopeStyle::Neox;
    let rows = gather(
        k,
        &slots,
        &RopeTables::per_delta(&deltas, rotation),
        heads,
        head_dim,
        neox,
    );
    scatter(k, &rows, &slots, heads * head_dim);
    Ok(())
}

/// `x` (a multiple of 64 values) rotated by `tessera_hadamard_rows`, as
/// attention rotates its queries and output over a quantized cache.
pub fn hadamard_rows(x: &mut [f32]) {
    let chunks = (x.len() / 64) as u32;
    let p = x.as_mut_ptr();
    // SAFETY: the kernel touches the first `chunks * 64` values of `x`.
    run(hadamard_launch(x.len()), |ix| unsafe {
        tessera_hadamard_rows(ix, p, chunks)
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::parity::{self, Backend};
    use crate::testing::{max_abs_diff, seeded_cache};

    /// The emulated kernels on a copy of the inputs.
    struct Emu;

    impl Backend for Emu {
        fn write_kv(&self, cache: &Tensor, new: &Tensor, slots: &[u32]) -> Result<Tensor> {
            let c = cache.copy()?;
            write_kv(&c, new, slots)?;
            Ok(c)
        }
        fn copy_blocks(&self, cache: &Tensor, pairs: &[(u32, u32)]) -> Result<Tensor> {
            let c = cache.copy()?;
            copy_blocks(&c, pairs)?;
            Ok(c)
        }
        fn shift_kv(
            &self,
            k: &Tensor,
            v: &Tensor,
            moves: &[(u32, u32)],
            r: &Rotation,
        ) -> Result<(Tensor, Tensor)> {
            let (k, v) = (k.copy()?, v.copy()?);
            shift_kv(&k, &v, moves, r)?;
            Ok((k, v))
        }
        fn rotate_k(
            &self,
            k: &Tensor,
            slots: &[u32],
            deltas: &[i64],
            r: &Rotation,
        ) -> Result<Tensor> {
            let k = k.copy()?;
            rotate_k(&k, slots, deltas, r)?;
            Ok(k)
        }
    }

    #[test]
    fn write_kv_equals_the_reference() -> Result<()> {
        parity::write_kv(&Emu)
    }

    #[test]
    fn copy_blocks_equals_the_reference_for_every_cache_type() -> Result<()> {
        parity::copy_blocks(&Emu)
    }

    #[test]
    fn shift_and_rotate_equal_the_reference_with_overlapping_moves() -> Result<()> {
        parity::shift_and_rotate(&Emu)
    }

    extern "C" {
        fn tessera_emu_gemv_lane(
            fmt: u32,
            kind: u32,
            wpr: u32,
            rows: *const *const u8,
            k: u32,
            xs: *const f32,
            x_stride: u32,
            nt: u32,
            lane: u32,
            sum: *mut f32,
        ) -> i32;
        fn tessera_emu_dequant(fmt: u32, w: *const u8, rows: u32, k: u32, out: *mut f32) -> i32;
        fn tessera_emu_gemv_item(
            fmt: u32,
            row: *const u8,
            i: u32,
            w: *mut f32,
            off: *mut u32,
        ) -> i32;
    }

    /// A quantized tensor's blocks at a 16-byte aligned address, as on the
    /// GPU, and their length in bytes.
    fn aligned_blocks(q: &candle_core::quantized::QTensor) -> Result<(Vec<u128>, usize)> {
        let bytes = q.data()?;
        let mut buf = vec![0u128; bytes.len().div_ceil(16)];
        // SAFETY: `buf` holds at least `bytes.len()` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                buf.as_mut_ptr().cast::<u8>(),
                bytes.len(),
            )
        };
        Ok((buf, bytes.len()))
    }

    /// The CUDA products' block formats (`gpu/gemv_formats.h`, which
    /// `gpu/forward.cu` includes) expand every item of a row to candle's
    /// dequantization of the row, bit for bit, and their items cover each
    /// value once: rows of several magnitudes and signs in each format;
    /// the dequantizing kernel's threads give the same row.
    #[test]
    fn gemv_items_expand_to_the_dequantized_weights_in_every_format() -> Result<()> {
        use candle_core::quantized::{GgmlDType, QTensor};
        use candle_core::Device;
        let k = 768;
        // GemvFormat's order; Q6_K's items are 16 values, the others' 8.
        let formats = [
            (0, GgmlDType::Q4_0, 8),
            (1, GgmlDType::Q4_1, 8),
            (2, GgmlDType::Q8_0, 8),
            (3, GgmlDType::Q4K, 8),
            (4, GgmlDType::Q5K, 8),
            (5, GgmlDType::Q6K, 16),
            (6, GgmlDType::F32, 8),
            (7, GgmlDType::F16, 8),
        ];
        for seed in 0..4u32 {
            let vals: Vec<f32> = (0..k as u32)
                .map(|i| {
                    let h = (i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)) % 1000;
                    let scale = [0.002, 0.05, 1.0, 30.0][((i / 64 + seed) % 4) as usize];
                    (h as f32 / 500.0 - 1.0) * scale
                })
                .collect();
            let src = Tensor::from_vec(vals, (1, k), &Device::Cpu)?;
            for (fmt, dtype, per_item) in formats {
                let q = QTensor::quantize(&src, dtype)?;
                let want = q
                    .dequantize(&Device::Cpu)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                let (buf, _) = aligned_blocks(&q)?;
                let mut got = vec![None; k];
                for i in 0..k / per_item {
                    let (mut w, mut off) = ([0f32; 16], [0u32; 4]);
                    // SAFETY: item i of a row of k values lies inside its
                    // blocks; w and off have room for four runs.
                    let runs = unsafe {
                        tessera_emu_gemv_item(
                            fmt,
                            buf.as_ptr().cast(),
                            i as u32,
                            w.as_mut_ptr(),
                            off.as_mut_ptr(),
                        )
                    } as usize;
                    assert_eq!(runs * 4, per_item, "{dtype:?}");
                    for r in 0..runs {
                        for e in 0..4 {
                            let at = off[r] as usize + e;
                            assert!(got[at].is_none(), "{dtype:?}: value {at} twice");
                            got[at] = Some(w[4 * r + e]);
                        }
                    }
                }
                for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                    let g = g.unwrap_or_else(|| panic!("{dtype:?}: value {j} in no item"));
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{dtype:?} value {j}: {g} against {w}"
                    );
                }
                // The same through tessera_fwd_dequant_*'s threads.
                let mut out = vec![f32::NAN; k];
                // SAFETY: one row of k values in the format; out holds k.
                let ok = unsafe {
                    tessera_emu_dequant(fmt, buf.as_ptr().cast(), 1, k as u32, out.as_mut_ptr())
                };
                assert_eq!(ok, 1);
                for (j, (g, w)) in out.iter().zip(&want).enumerate() {
                    assert_eq!(g.to_bits(), w.to_bits(), "dequant {dtype:?} value {j}");
                }
            }
        }
        Ok(())
    }

    /// Every lane of every product shape the CUDA kernels are built in
    /// (one token of one row, one token of gate and up together, up to 8
    /// tokens of one row; 1, 2 and 4 warps a row), run one after another
    /// through `ts_row_dots` (`gpu/gemv_formats.h`), adds up to the dot
    /// products of the dequantized rows with the inputs: every item is
    /// taken once, by some lane, against the right inputs of the right
    /// token, rows of one pass and of many, in every format.
    #[test]
    fn gemv_lanes_add_up_to_the_dot_products_in_every_shape() -> Result<()> {
        use candle_core::quantized::{GgmlDType, QTensor};
        use candle_core::Device;
        let formats = [
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q8_0,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
            GgmlDType::F32,
            GgmlDType::F16,
        ];
        let noise = |i: u32, seed: u32| {
            let h = i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503);
            ((h >> 7) % 2000) as f32 / 1000.0 - 1.0
        };
        for k in [256usize, 2560] {
            // Two rows (gate and up), and 8 input rows 4 floats apart more
            // than their length.
            let w: Vec<f32> = (0..2 * k as u32).map(|i| noise(i, 1)).collect();
            let stride = k + 4;
            let x: Vec<f32> = (0..(8 * stride) as u32).map(|i| noise(i, 2)).collect();
            let src = Tensor::from_vec(w, (2, k), &Device::Cpu)?;
            for (fmt, dtype) in formats.into_iter().enumerate() {
                let q = QTensor::quantize(&src, dtype)?;
                let deq = q.dequantize(&Device::Cpu)?.to_vec2::<f32>()?;
                let (buf, len) = aligned_blocks(&q)?;
                let base = buf.as_ptr().cast::<u8>();
                // SAFETY: the second row starts one row's bytes in.
                let rows = [base, unsafe { base.add(len / 2) }];
                for (kind, mt, nr, tokens) in [
                    (0u32, 1usize, 1usize, &[1u32][..]),
                    (1, 1, 2, &[1]),
                    (2, 8, 1, &[1, 5, 8]),
                ] {
                    for wpr in [1u32, 2, 4] {
                        for &nt in tokens {
                            let mut total = vec![0f64; nr * mt];
                            for lane in 0..32 * wpr {
                                let mut sum = vec![0f32; nr * mt];
                                // SAFETY: the rows hold k values each in
                                // their format, x holds 8 rows at the
                                // stride, sum has room for nr · mt.
                                let got = unsafe {
                                    tessera_emu_gemv_lane(
                                        fmt as u32,
                                        kind,
                                        wpr,
                                        rows.as_ptr(),
                                        k as u32,
                                        x.as_ptr(),
                                        stride as u32,
                                        nt,
                                        lane,
                                        sum.as_mut_ptr(),
                                    )
                                };
                                assert_eq!(got as usize, mt, "{dtype:?} kind {kind}");
                                for (t, s) in total.iter_mut().zip(&sum) {
                                    *t += *s as f64;
                                }
                            }
                            for r in 0..nr {
                                for t in 0..mt {
                                    let got = total[r * mt + t];
                                    if t >= nt as usize {
                                        assert_eq!(got, 0.0, "{dtype:?}: token {t} of {nt}");
                                        continue;
                                    }
                                    let xt = &x[t * stride..t * stride + k];
                                    let (want, size) = deq[r].iter().zip(xt).fold(
                                        (0f64, 0f64),
                                        |(a, b), (w, x)| {
                                            let p = *w as f64 * *x as f64;
                                            (a + p, b + p.abs())
                                        },
                                    );
                                    assert!(
                                        (got - want).abs() <= 1e-5 * size,
                                        "{dtype:?} k {k} kind {kind} wpr {wpr} row {r} token {t} of {nt}: {got} against {want}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    fn padded_slots_are_skipped() -> Result<()> {
        for t in KvType::ALL {
            let cache = seeded_cache(&[2, 4, 1, 64], 1, t)?;
            let before = cache.copy()?;
            scatter(cache_of(&cache)?, &[1.0; 64], &[super::super::NO_TABLE], 64);
            assert_eq!(max_abs_diff(&cache, &before)?, 0.0, "{t}");
        }
        Ok(())
    }

    /// The rotation kernel is the CPU's, bit for bit, and its own inverse
    /// up to rounding.
    #[test]
    fn hadamard_rows_equal_the_cpu_transform() -> Result<()> {
        let x = crate::testing::seeded(&[5 * 64], 7, DType::F32)?.to_vec1::<f32>()?;
        let mut want = x.clone();
        crate::quant::hadamard64(&mut want);
        let mut got = x.clone();
        hadamard_rows(&mut got);
        assert_eq!(got, want);
        hadamard_rows(&mut got);
        let err = got
            .iter()
            .zip(&x)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err < 1e-6, "{err}");
        Ok(())
    }
}
