//! The GPU kernel source run on the CPU (`kernel-emu` feature): `gpu/emu.cpp`
//! (the host prelude and the shared bodies) compiled by `build.rs`, each
//! entry point called once per thread of the grid the GPU launchers use.
//! The ops take CPU tensors and check their arguments as the CPU ops do.

use candle_core::{DType, Result, Tensor};

use super::{elem_suffix, moved_rows, Launch, RopeTables};
use crate::{cache_raw, CacheRaw, KvType, Rotation};

#[repr(C)]
#[derive(Clone, Copy)]
struct TsIdx {
    blk: u32,
    tid: u32,
    nthreads: u32,
}

extern "C" {
    fn tessera_write_kv_f32(
        ix: TsIdx,
        src: *const f32,
        cache: *mut f32,
        slots: *const u32,
        row: u32,
    );
    fn tessera_write_kv_f16(
        ix: TsIdx,
        src: *const f32,
        cache: *mut u16,
        slots: *const u32,
        row: u32,
    );
    fn tessera_write_kv_bf16(
        ix: TsIdx,
        src: *const f32,
        cache: *mut u16,
        slots: *const u32,
        row: u32,
    );
    fn tessera_copy_blocks(ix: TsIdx, cache: *mut u16, pairs: *const u32, units: u32);
    fn tessera_rope_gather_f32(
        ix: TsIdx,
        cache: *const f32,
        out: *mut f32,
        slots: *const u32,
        tables: *const u32,
        cos_t: *const f32,
        sin_t: *const f32,
        heads: u32,
        head_dim: u32,
        neox: u32,
    );
    fn tessera_rope_gather_f16(
        ix: TsIdx,
        cache: *const u16,
        out: *mut f32,
        slots: *const u32,
        tables: *const u32,
        cos_t: *const f32,
        sin_t: *const f32,
        heads: u32,
        head_dim: u32,
        neox: u32,
    );
    fn tessera_rope_gather_bf16(
        ix: TsIdx,
        cache: *const u16,
        out: *mut f32,
        slots: *const u32,
        tables: *const u32,
        cos_t: *const f32,
        sin_t: *const f32,
        heads: u32,
        head_dim: u32,
        neox: u32,
    );
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

/// The cache's float elements; quantized caches are refused as on the GPU.
fn float_cache(cache: &Tensor) -> Result<CacheRaw> {
    elem_suffix(KvType::of(cache)?)?;
    cache_raw(cache)
}

/// Stores f32 `rows` (`slots.len()` rows of `row` values) at `slots`.
fn scatter(raw: CacheRaw, rows: &[f32], slots: &[u32], row: usize) {
    let l = Launch::per_item(slots.len(), row);
    let (src, s, r) = (rows.as_ptr(), slots.as_ptr(), row as u32);
    // SAFETY: `rows` holds `slots.len() * row` values, every slot was checked
    // to lie inside the cache, and nothing else touches the cache meanwhile.
    run(l, |ix| unsafe {
        match raw {
            CacheRaw::F32(c, _) => tessera_write_kv_f32(ix, src, c, s, r),
            CacheRaw::F16(c, _) => tessera_write_kv_f16(ix, src, c, s, r),
            CacheRaw::Bf16(c, _) => tessera_write_kv_bf16(ix, src, c, s, r),
            CacheRaw::Q8_0(..) | CacheRaw::Q4_0(..) => unreachable!("refused by float_cache"),
        }
    });
}

/// The rows at `slots` as f32, rotated per `t`.
fn gather(
    raw: CacheRaw,
    slots: &[u32],
    t: &RopeTables,
    heads: usize,
    head_dim: usize,
    neox: bool,
) -> Vec<f32> {
    let row = heads * head_dim;
    let mut out = vec![0f32; slots.len() * row];
    let l = Launch::per_item(slots.len(), row / 2);
    let (o, s, tb, c, sn) = (
        out.as_mut_ptr(),
        slots.as_ptr(),
        t.tables.as_ptr(),
        t.cos.as_ptr(),
        t.sin.as_ptr(),
    );
    let (h, d, n) = (heads as u32, head_dim as u32, neox as u32);
    // SAFETY: `out` holds a row per slot, the slots were checked, and every
    // table index points at a whole table of `head_dim / 2` values.
    run(l, |ix| unsafe {
        match raw {
            CacheRaw::F32(c0, _) => tessera_rope_gather_f32(ix, c0, o, s, tb, c, sn, h, d, n),
            CacheRaw::F16(c0, _) => tessera_rope_gather_f16(ix, c0, o, s, tb, c, sn, h, d, n),
            CacheRaw::Bf16(c0, _) => tessera_rope_gather_bf16(ix, c0, o, s, tb, c, sn, h, d, n),
            CacheRaw::Q8_0(..) | CacheRaw::Q4_0(..) => unreachable!("refused by float_cache"),
        }
    });
    out
}

/// [`crate::write_kv`] through the GPU kernel source.
pub fn write_kv(cache: &Tensor, new: &Tensor, slots: &[u32]) -> Result<()> {
    crate::write::check(cache, new, slots)?;
    let raw = float_cache(cache)?;
    let rows = new.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    scatter(raw, &rows, slots, rows.len() / slots.len().max(1));
    Ok(())
}

/// [`crate::copy_blocks`] through the GPU kernel source (any cache type:
/// blocks move as 16-bit units).
pub fn copy_blocks(cache: &Tensor, pairs: &[(u32, u32)]) -> Result<()> {
    let values = crate::copy::check(cache, pairs)?;
    let units = (KvType::of(cache)?.bytes_for(values) / 2) as u32;
    let flat: Vec<u32> = pairs.iter().flat_map(|&(s, d)| [s, d]).collect();
    let base = match cache_raw(cache)? {
        CacheRaw::F32(p, _) => p as *mut u16,
        CacheRaw::F16(p, _) | CacheRaw::Bf16(p, _) => p,
        CacheRaw::Q8_0(p, _) => p as *mut u16,
        CacheRaw::Q4_0(p, _) => p as *mut u16,
    };
    // SAFETY: the pairs were checked to name blocks inside the cache.
    run(Launch::per_item(pairs.len(), units as usize), |ix| unsafe {
        tessera_copy_blocks(ix, base, flat.as_ptr(), units)
    });
    Ok(())
}

/// [`crate::shift_kv`] through the GPU kernel source: every source row
/// gathered (K rotated) before any is written.
pub fn shift_kv(
    k_cache: &Tensor,
    v_cache: &Tensor,
    moves: &[(u32, u32)],
    rotation: &Rotation,
) -> Result<()> {
    let (heads, head_dim) = crate::shift::check(k_cache, v_cache, moves, rotation)?;
    let (k, v) = (float_cache(k_cache)?, float_cache(v_cache)?);
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
    let moved = gather(v, &src, &RopeTables::none(src.len()), heads, head_dim, neox);
    scatter(v, &moved, &dst, row);
    Ok(())
}

/// [`crate::rotate_k`] through the GPU kernel source.
pub fn rotate_k(
    k_cache: &Tensor,
    slots: &[u32],
    deltas: &[i64],
    rotation: &Rotation,
) -> Result<()> {
    let (heads, head_dim) = crate::shift::check_rotate(k_cache, slots, deltas, rotation)?;
    let k = float_cache(k_cache)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{max_abs_diff, seeded, seeded_cache};
    use crate::RopeStyle;

    const FLOATS: [KvType; 3] = [KvType::F32, KvType::F16, KvType::Bf16];

    /// Geometries `[blocks, block_size, kv heads, head_dim]`: head dims 64,
    /// 128 and 256, rows shorter and longer than one block of threads.
    const SHAPES: [[usize; 4]; 4] = [
        [6, 4, 3, 64],
        [5, 16, 2, 128],
        [4, 8, 4, 256],
        [3, 32, 1, 64],
    ];

    fn rotation(style: RopeStyle, hd: usize, delta: i64) -> Rotation {
        Rotation {
            style,
            inv_freq: (0..hd / 2)
                .map(|i| 10000f32.powf(-2.0 * i as f32 / hd as f32))
                .collect(),
            delta,
        }
    }

    #[test]
    fn write_kv_equals_the_reference() -> Result<()> {
        for t in FLOATS {
            for (n, shape) in SHAPES.iter().enumerate() {
                let cache = seeded_cache(shape, n as u64, t)?;
                let slots: Vec<u32> = (0..5)
                    .map(|i| ((i * 7 + 3) % (shape[0] * shape[1])) as u32)
                    .collect();
                let new = seeded(&[5, shape[2], shape[3]], 40 + n as u64, DType::F32)?;
                let want = crate::write_kv_slow(&cache, &new, &slots)?;
                write_kv(&cache, &new, &slots)?;
                assert_eq!(max_abs_diff(&cache, &want)?, 0.0, "{t} {shape:?}");
            }
        }
        Ok(())
    }

    #[test]
    fn copy_blocks_equals_the_reference_for_every_cache_type() -> Result<()> {
        for t in KvType::ALL {
            let cache = seeded_cache(&[8, 4, 2, 64], 9, t)?;
            let pairs = [(7, 0), (3, 1), (5, 6)];
            let want = crate::copy_blocks_slow(&cache, &pairs)?;
            copy_blocks(&cache, &pairs)?;
            assert_eq!(max_abs_diff(&cache, &want)?, 0.0, "{t}");
        }
        Ok(())
    }

    #[test]
    fn shift_kv_equals_the_reference_with_overlapping_moves() -> Result<()> {
        for t in FLOATS {
            for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
                for shape in SHAPES {
                    let n = shape[0] * shape[1];
                    let k = seeded_cache(&shape, 3, t)?;
                    let v = seeded_cache(&shape, 4, t)?;
                    // Slide everything after slot 3 left by 2: sources and
                    // destinations overlap.
                    let moves: Vec<(u32, u32)> = (5..n as u32).map(|s| (s, s - 2)).collect();
                    let r = rotation(style, shape[3], -2);
                    let (wk, wv) = crate::shift_kv_slow(&k, &v, &moves, &r)?;
                    shift_kv(&k, &v, &moves, &r)?;
                    assert_eq!(max_abs_diff(&k, &wk)?, 0.0, "{t} {style:?} {shape:?}");
                    assert_eq!(max_abs_diff(&v, &wv)?, 0.0, "{t} {style:?} {shape:?}");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn rotate_k_equals_the_reference_and_composes() -> Result<()> {
        for t in FLOATS {
            for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
                let shape = [4, 16, 2, 128];
                let k = seeded_cache(&shape, 5, t)?;
                let slots: Vec<u32> = (0..40).collect();
                let deltas: Vec<i64> = (0..40).map(|i| (i % 5) as i64 * 3 - 6).collect();
                let r = rotation(style, shape[3], 0);
                let want = crate::rotate_k_slow(&k, &slots, &deltas, &r)?;
                rotate_k(&k, &slots, &deltas, &r)?;
                assert_eq!(max_abs_diff(&k, &want)?, 0.0, "{t} {style:?}");
            }
        }
        // Rotating by a then by b is a rotation by a + b, up to rounding.
        let shape = [2, 16, 2, 64];
        let r = rotation(RopeStyle::Neox, 64, 0);
        let slots: Vec<u32> = (0..32).collect();
        let twice = seeded_cache(&shape, 6, KvType::F32)?;
        let once = twice.copy()?;
        rotate_k(&twice, &slots, &[7; 32], &r)?;
        rotate_k(&twice, &slots, &[-100; 32], &r)?;
        rotate_k(&once, &slots, &[-93; 32], &r)?;
        assert!(max_abs_diff(&twice, &once)? < 1e-5);
        Ok(())
    }

    #[test]
    fn padded_slots_are_skipped_and_quantized_caches_refused() -> Result<()> {
        let cache = seeded_cache(&[2, 4, 1, 64], 1, KvType::F16)?;
        let before = cache.copy()?;
        let raw = float_cache(&cache)?;
        scatter(raw, &[1.0; 64], &[super::super::NO_TABLE], 64);
        assert_eq!(max_abs_diff(&cache, &before)?, 0.0);
        let q = seeded_cache(&[2, 4, 1, 64], 1, KvType::Q8_0)?;
        let err = write_kv(&q, &seeded(&[1, 1, 64], 2, DType::F32)?, &[0]).unwrap_err();
        assert!(err.to_string().contains("f32, f16 and bf16"), "{err}");
        Ok(())
    }
}
