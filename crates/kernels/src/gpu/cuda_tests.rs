//! The CUDA kernels against the CPU slow references (feature `cuda`; `just
//! test-cuda`): the parity checks of [`super::parity`], and paged attention.
//! Without a CUDA device each test prints `skipped: no CUDA device` and
//! passes, unless `TESSERA_REQUIRE_GPU=1`, which makes it fail: a GPU run
//! cannot pass by skipping.

use candle_core::{DType, Device, Result, Tensor};

use super::parity::{self, Backend, FLOATS};
use crate::testing::{max_abs_diff, seeded, seeded_cache};
use crate::{PagedMeta, Rotation};

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

/// The crate's ops on copies of the inputs on the GPU.
struct Cuda(Device);

impl Cuda {
    fn up(&self, t: &Tensor) -> Result<Tensor> {
        t.to_device(&self.0)
    }
}

fn down(t: &Tensor) -> Result<Tensor> {
    t.to_device(&Device::Cpu)
}

impl Backend for Cuda {
    fn write_kv(&self, cache: &Tensor, new: &Tensor, slots: &[u32]) -> Result<Tensor> {
        let c = self.up(cache)?;
        crate::write_kv(&c, &self.up(new)?, slots)?;
        down(&c)
    }
    fn copy_blocks(&self, cache: &Tensor, pairs: &[(u32, u32)]) -> Result<Tensor> {
        let c = self.up(cache)?;
        crate::copy_blocks(&c, pairs)?;
        down(&c)
    }
    fn shift_kv(
        &self,
        k: &Tensor,
        v: &Tensor,
        moves: &[(u32, u32)],
        r: &Rotation,
    ) -> Result<(Tensor, Tensor)> {
        let (k, v) = (self.up(k)?, self.up(v)?);
        crate::shift_kv(&k, &v, moves, r)?;
        Ok((down(&k)?, down(&v)?))
    }
    fn rotate_k(&self, k: &Tensor, slots: &[u32], deltas: &[i64], r: &Rotation) -> Result<Tensor> {
        let k = self.up(k)?;
        crate::rotate_k(&k, slots, deltas, r)?;
        down(&k)
    }
}

#[test]
fn write_kv_on_cuda_equals_the_reference() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    parity::write_kv(&Cuda(dev))
}

#[test]
fn copy_blocks_on_cuda_equals_the_reference() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    parity::copy_blocks(&Cuda(dev))
}

#[test]
fn shift_and_rotate_on_cuda_equal_the_reference() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    parity::shift_and_rotate(&Cuda(dev))
}

#[test]
fn quantized_caches_are_refused_on_cuda() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    parity::quantized_caches_refused(&Cuda(dev))
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
