//! The CUDA kernels against the CPU slow references (feature `cuda`; `just
//! test-cuda`). Without a CUDA device each test prints `skipped: no CUDA
//! device` and passes, unless `TESSERA_REQUIRE_GPU=1`, which makes it fail:
//! a GPU run cannot pass by skipping.

use candle_core::{DType, Device, Result};

use crate::testing::{max_abs_diff, seeded, seeded_cache};
use crate::{KvType, PagedMeta, RopeStyle, Rotation};

fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            if std::env::var("TESSERA_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("TESSERA_REQUIRE_GPU=1 but no CUDA device: {e}")
            }
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
    }
}

const FLOATS: [KvType; 3] = [KvType::F32, KvType::F16, KvType::Bf16];
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
fn write_kv_on_cuda_equals_the_reference() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for t in FLOATS {
        for (n, shape) in SHAPES.iter().enumerate() {
            let cache = seeded_cache(shape, n as u64, t)?;
            let slots: Vec<u32> = (0..5)
                .map(|i| ((i * 7 + 3) % (shape[0] * shape[1])) as u32)
                .collect();
            let new = seeded(&[5, shape[2], shape[3]], 40 + n as u64, DType::F32)?;
            let want = crate::write_kv_slow(&cache, &new, &slots)?;
            let on = cache.to_device(&dev)?;
            crate::write_kv(&on, &new.to_device(&dev)?, &slots)?;
            assert_eq!(
                max_abs_diff(&on.to_device(&Device::Cpu)?, &want)?,
                0.0,
                "{t} {shape:?}"
            );
        }
    }
    Ok(())
}

#[test]
fn copy_blocks_on_cuda_equals_the_reference() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for t in KvType::ALL {
        let cache = seeded_cache(&[8, 4, 2, 64], 9, t)?;
        let pairs = [(7, 0), (3, 1), (5, 6)];
        let want = crate::copy_blocks_slow(&cache, &pairs)?;
        let on = cache.to_device(&dev)?;
        crate::copy_blocks(&on, &pairs)?;
        assert_eq!(
            max_abs_diff(&on.to_device(&Device::Cpu)?, &want)?,
            0.0,
            "{t}"
        );
    }
    Ok(())
}

#[test]
fn shift_and_rotate_on_cuda_equal_the_reference() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for t in FLOATS {
        for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
            for shape in SHAPES {
                let n = shape[0] * shape[1];
                let (k, v) = (seeded_cache(&shape, 3, t)?, seeded_cache(&shape, 4, t)?);
                let moves: Vec<(u32, u32)> = (5..n as u32).map(|s| (s, s - 2)).collect();
                let r = rotation(style, shape[3], -2);
                let (wk, wv) = crate::shift_kv_slow(&k, &v, &moves, &r)?;
                let (gk, gv) = (k.to_device(&dev)?, v.to_device(&dev)?);
                crate::shift_kv(&gk, &gv, &moves, &r)?;
                assert_eq!(
                    max_abs_diff(&gk.to_device(&Device::Cpu)?, &wk)?,
                    0.0,
                    "{t} {style:?}"
                );
                assert_eq!(
                    max_abs_diff(&gv.to_device(&Device::Cpu)?, &wv)?,
                    0.0,
                    "{t} {style:?}"
                );
                let slots: Vec<u32> = (0..n as u32).step_by(3).collect();
                let deltas: Vec<i64> = (0..slots.len()).map(|i| (i % 5) as i64 * 3 - 6).collect();
                let want = crate::rotate_k_slow(&k, &slots, &deltas, &r)?;
                let gk = k.to_device(&dev)?;
                crate::rotate_k(&gk, &slots, &deltas, &r)?;
                assert_eq!(
                    max_abs_diff(&gk.to_device(&Device::Cpu)?, &want)?,
                    0.0,
                    "{t} {style:?}"
                );
            }
        }
    }
    // Rotating by a then by b is a rotation by a + b, up to rounding.
    let r = rotation(RopeStyle::Neox, 64, 0);
    let slots: Vec<u32> = (0..32).collect();
    let twice = seeded_cache(&[2, 16, 2, 64], 6, KvType::F32)?.to_device(&dev)?;
    let once = twice.copy()?;
    crate::rotate_k(&twice, &slots, &[7; 32], &r)?;
    crate::rotate_k(&twice, &slots, &[-100; 32], &r)?;
    crate::rotate_k(&once, &slots, &[-93; 32], &r)?;
    assert!(max_abs_diff(&twice, &once)? < 1e-5);
    Ok(())
}

#[test]
fn paged_attention_on_cuda_matches_the_reference() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    // (n_heads, n_kv_heads, head_dim, block_size, context, new tokens, window)
    let cases: [(usize, usize, usize, usize, usize, usize, usize); 5] = [
        (9, 3, 64, 16, 40, 1, 0),
        (8, 2, 128, 16, 1300, 1, 0), // three partitions
        (4, 4, 256, 8, 700, 1, 0),
        (6, 2, 64, 16, 600, 37, 0), // a prefill chunk across a partition boundary
        (4, 1, 64, 16, 900, 3, 256), // a sliding window
    ];
    for t in FLOATS {
        for (i, &(nh, kvh, hd, bs, ctx, new, window)) in cases.iter().enumerate() {
            let blocks = ctx.div_ceil(bs) + 2;
            let k = seeded_cache(&[blocks, bs, kvh, hd], 10 + i as u64, t)?;
            let v = seeded_cache(&[blocks, bs, kvh, hd], 20 + i as u64, t)?;
            // The sequence's blocks in reverse order, to exercise the table.
            let table: Vec<u32> = (0..blocks as u32).rev().collect();
            let token_pos: Vec<u32> = (ctx - new..ctx).map(|p| p as u32).collect();
            let meta = PagedMeta {
                block_size: bs,
                block_tables: &table,
                max_blocks: blocks,
                token_seq: &vec![0; new],
                token_pos: &token_pos,
                scale: 1.0 / (hd as f32).sqrt(),
                window,
            };
            let q = seeded(&[new, nh, hd], 30 + i as u64, DType::F32)?;
            let want = crate::paged_attention_slow(&q, &k, &v, &meta)?;
            let got = crate::paged_attention(
                &q.to_device(&dev)?,
                &k.to_device(&dev)?,
                &v.to_device(&dev)?,
                &meta,
            )?;
            let diff = max_abs_diff(&got.to_device(&Device::Cpu)?, &want)?;
            assert!(diff < 1e-4, "{t} case {i}: {diff}");
        }
    }
    Ok(())
}

#[test]
fn quantized_caches_are_refused_with_a_clear_error() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let q = seeded_cache(&[2, 4, 1, 64], 1, KvType::Q8_0)?.to_device(&dev)?;
    let new = seeded(&[1, 1, 64], 2, DType::F32)?.to_device(&dev)?;
    let err = crate::write_kv(&q, &new, &[0]).unwrap_err().to_string();
    assert!(err.contains("f32, f16 and bf16"), "{err}");
    Ok(())
}
