//! The parity checks every GPU backend passes, against the CPU slow
//! references: the kernel-emu build (`emu.rs`), CUDA (`cuda_tests.rs`) and
//! Metal (`metal_tests.rs`) run the same ones through a [`Backend`]; paged
//! attention runs through an [`Attend`] ([`paged_attention`]): on the two
//! devices ([`paged_attention_on`], through [`device_tests`]) and, in the
//! kernel-emu build, through CUDA's and Metal's kernel sources on the CPU.

#[cfg(any(feature = "cuda", all(feature = "metal", target_vendor = "apple")))]
use candle_core::Device;
use candle_core::{DType, Result, Tensor};

use crate::testing::{max_abs_diff, seeded, seeded_cache};
use crate::{KvType, PagedMeta, RopeStyle, Rotation};

/// A backend under test: each op applied to a copy of CPU inputs, the
/// result brought back to the CPU.
pub(crate) trait Backend {
    fn write_kv(&self, cache: &Tensor, new: &Tensor, slots: &[u32]) -> Result<Tensor>;
    fn copy_blocks(&self, cache: &Tensor, pairs: &[(u32, u32)]) -> Result<Tensor>;
    fn shift_kv(
        &self,
        k: &Tensor,
        v: &Tensor,
        moves: &[(u32, u32)],
        r: &Rotation,
    ) -> Result<(Tensor, Tensor)>;
    fn rotate_k(&self, k: &Tensor, slots: &[u32], deltas: &[i64], r: &Rotation) -> Result<Tensor>;
    /// The cache types its KV kernels take (the rest it refuses).
    fn types(&self) -> &'static [KvType] {
        &KvType::ALL
    }
}

#[cfg(any(feature = "cuda", all(feature = "metal", target_vendor = "apple")))]
pub(crate) const FLOATS: [KvType; 3] = [KvType::F32, KvType::F16, KvType::Bf16];

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

/// Every cache type the backend takes, bit for bit (a quantized row:
/// rotated and quantized as the CPU does).
pub(crate) fn write_kv(b: &dyn Backend) -> Result<()> {
    for &t in b.types() {
        for (n, shape) in SHAPES.iter().enumerate() {
            let cache = seeded_cache(shape, n as u64, t)?;
            let slots: Vec<u32> = (0..5)
                .map(|i| ((i * 7 + 3) % (shape[0] * shape[1])) as u32)
                .collect();
            let new = seeded(&[5, shape[2], shape[3]], 40 + n as u64, DType::F32)?;
            let want = crate::write_kv_slow(&cache, &new, &slots)?;
            let got = b.write_kv(&cache, &new, &slots)?;
            assert_eq!(max_abs_diff(&got, &want)?, 0.0, "{t} {shape:?}");
        }
    }
    Ok(())
}

pub(crate) fn copy_blocks(b: &dyn Backend) -> Result<()> {
    for t in KvType::ALL {
        let cache = seeded_cache(&[8, 4, 2, 64], 9, t)?;
        let pairs = [(7, 0), (3, 1), (5, 6)];
        let want = crate::copy_blocks_slow(&cache, &pairs)?;
        assert_eq!(
            max_abs_diff(&b.copy_blocks(&cache, &pairs)?, &want)?,
            0.0,
            "{t}"
        );
    }
    Ok(())
}

/// Overlapping moves (everything after slot 3 slides left by 2) and
/// per-slot rotations, both RoPE pair layouts; then composition.
pub(crate) fn shift_and_rotate(b: &dyn Backend) -> Result<()> {
    for &t in b.types() {
        for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
            for shape in SHAPES {
                let n = shape[0] * shape[1];
                let (k, v) = (seeded_cache(&shape, 3, t)?, seeded_cache(&shape, 4, t)?);
                let moves: Vec<(u32, u32)> = (5..n as u32).map(|s| (s, s - 2)).collect();
                let r = rotation(style, shape[3], -2);
                let (wk, wv) = crate::shift_kv_slow(&k, &v, &moves, &r)?;
                let (gk, gv) = b.shift_kv(&k, &v, &moves, &r)?;
                assert_eq!(max_abs_diff(&gk, &wk)?, 0.0, "{t} {style:?} {shape:?}");
                assert_eq!(max_abs_diff(&gv, &wv)?, 0.0, "{t} {style:?} {shape:?}");
                let slots: Vec<u32> = (0..n as u32).step_by(3).collect();
                let deltas: Vec<i64> = (0..slots.len()).map(|i| (i % 5) as i64 * 3 - 6).collect();
                let want = crate::rotate_k_slow(&k, &slots, &deltas, &r)?;
                let got = b.rotate_k(&k, &slots, &deltas, &r)?;
                assert_eq!(max_abs_diff(&got, &want)?, 0.0, "{t} {style:?} {shape:?}");
            }
        }
    }
    // Rotating by a then by b is a rotation by a + b, up to rounding.
    let r = rotation(RopeStyle::Neox, 64, 0);
    let slots: Vec<u32> = (0..32).collect();
    let k = seeded_cache(&[2, 16, 2, 64], 6, KvType::F32)?;
    let twice = b.rotate_k(
        &b.rotate_k(&k, &slots, &[7; 32], &r)?,
        &slots,
        &[-100; 32],
        &r,
    )?;
    let once = b.rotate_k(&k, &slots, &[-93; 32], &r)?;
    assert!(max_abs_diff(&twice, &once)? < 1e-5);
    Ok(())
}

/// Metal, which takes only float caches, refuses the quantized ones
/// (except in `copy_blocks`) with a message.
#[cfg(all(feature = "metal", target_vendor = "apple"))]
pub(crate) fn quantized_caches_refused(b: &dyn Backend) -> Result<()> {
    let q = seeded_cache(&[2, 4, 1, 64], 1, KvType::Q8_0)?;
    let new = seeded(&[1, 1, 64], 2, DType::F32)?;
    let err = b.write_kv(&q, &new, &[0]).unwrap_err().to_string();
    assert!(err.contains("f32, f16 and bf16"), "{err}");
    Ok(())
}

/// The crate's ops on copies of the inputs on a device (CUDA, Metal).
#[cfg(any(feature = "cuda", all(feature = "metal", target_vendor = "apple")))]
pub(crate) struct OnDevice(pub Device);

#[cfg(any(feature = "cuda", all(feature = "metal", target_vendor = "apple")))]
impl OnDevice {
    fn up(&self, t: &Tensor) -> Result<Tensor> {
        t.to_device(&self.0)
    }
}

#[cfg(any(feature = "cuda", all(feature = "metal", target_vendor = "apple")))]
fn down(t: &Tensor) -> Result<Tensor> {
    t.to_device(&Device::Cpu)
}

#[cfg(any(feature = "cuda", all(feature = "metal", target_vendor = "apple")))]
impl Backend for OnDevice {
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
    fn types(&self) -> &'static [KvType] {
        device_types(&self.0)
    }
}

/// The cache types a device's KV kernels and attention take: every one on
/// CUDA, the float ones on Metal.
#[cfg(any(feature = "cuda", all(feature = "metal", target_vendor = "apple")))]
fn device_types(dev: &Device) -> &'static [KvType] {
    if dev.is_cuda() {
        &KvType::ALL
    } else {
        &FLOATS
    }
}

/// Paged attention run somewhere other than by the CPU kernels: on a
/// device, or through the GPU kernel source on the CPU (kernel-emu).
pub(crate) trait Attend {
    /// The cache types it takes.
    fn types(&self) -> &'static [KvType];
    /// Attention over CPU inputs, the result on the CPU.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, meta: &PagedMeta) -> Result<Tensor>;
}

/// Paged attention on a device.
#[cfg(any(feature = "cuda", all(feature = "metal", target_vendor = "apple")))]
struct OnDeviceAttend<'a>(&'a Device);

#[cfg(any(feature = "cuda", all(feature = "metal", target_vendor = "apple")))]
impl Attend for OnDeviceAttend<'_> {
    fn types(&self) -> &'static [KvType] {
        device_types(self.0)
    }

    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, meta: &PagedMeta) -> Result<Tensor> {
        let dev = self.0;
        let got = crate::paged_attention(
            &q.to_device(dev)?,
            &k.to_device(dev)?,
            &v.to_device(dev)?,
            meta,
        )?;
        down(&got)
    }
}

/// Paged attention on `dev` against the slow reference ([`paged_attention`]).
#[cfg(any(feature = "cuda", all(feature = "metal", target_vendor = "apple")))]
pub(crate) fn paged_attention_on(dev: &Device) -> Result<()> {
    paged_attention(&OnDeviceAttend(dev))
}

/// `b`'s paged attention against the slow reference: decode and prefill
/// chunks, several partitions (on CUDA, of 64 and of 256 positions), GQA,
/// a sliding window, head dims 64–256, every cache type it takes.
pub(crate) fn paged_attention(b: &dyn Attend) -> Result<()> {
    paged_attention_upto(b, usize::MAX)
}

/// [`paged_attention`] without the cases of more than `most` queries (an
/// emulated per-query kernel takes most of a minute over the 512-token
/// chunk).
pub(crate) fn paged_attention_upto(b: &dyn Attend, most: usize) -> Result<()> {
    let diff = |q: &Tensor, k: &Tensor, v: &Tensor, meta: &PagedMeta| -> Result<f32> {
        let want = crate::paged_attention_slow(q, k, v, meta)?;
        max_abs_diff(&b.attend(q, k, v, meta)?, &want)
    };
    // (n_heads, n_kv_heads, head_dim, block_size, context, new tokens, window)
    // (CUDA: the chunks of 8 tokens or more go through the tiled kernel.)
    let cases: [(usize, usize, usize, usize, usize, usize, usize); 10] = [
        (9, 3, 64, 16, 40, 1, 0),
        (8, 2, 128, 16, 1300, 1, 0), // three partitions (CUDA: 21 of 64)
        (4, 4, 256, 8, 700, 1, 0),
        (6, 2, 64, 16, 600, 37, 0), // a prefill chunk across a partition boundary
        (4, 1, 64, 16, 900, 3, 256), // a sliding window
        (9, 3, 64, 16, 700, 512, 0), // a long chunk (CUDA: partitions of 64)
        (8, 2, 128, 16, 300, 64, 0), // head dim 128, GQA 4
        (4, 1, 64, 16, 900, 100, 256), // a chunk in a sliding window
        (40, 1, 64, 8, 60, 16, 0),  // a group wider than a tile
        (4, 4, 256, 8, 100, 20, 0), // a chunk with head dim 256 (per query)
    ];
    for &t in b.types() {
        for (i, &(nh, kvh, hd, bs, ctx, new, window)) in cases.iter().enumerate() {
            if new > most {
                continue;
            }
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
            let d = diff(&q, &k, &v, &meta)?;
            assert!(d < 1e-4, "{t} case {i}: {d}");
        }
        // Two sequences' chunks in one launch, each through its own table:
        // 20 tokens at 100.. of sequence 0, then 30 at 40.. of sequence 1.
        let (nh, kvh, hd, bs, blocks) = (6, 2, 64, 16, 16);
        let k = seeded_cache(&[blocks, bs, kvh, hd], 41, t)?;
        let v = seeded_cache(&[blocks, bs, kvh, hd], 42, t)?;
        let tables: Vec<u32> = (0..8).chain((8..16).rev()).collect();
        let token_seq: Vec<u32> = [0; 20].into_iter().chain([1; 30]).collect();
        let token_pos: Vec<u32> = (100..120).chain(40..70).collect();
        let meta = PagedMeta {
            block_size: bs,
            block_tables: &tables,
            max_blocks: 8,
            token_seq: &token_seq,
            token_pos: &token_pos,
            scale: 0.125,
            window: 0,
        };
        let q = seeded(&[50, nh, hd], 43, DType::F32)?;
        let d = diff(&q, &k, &v, &meta)?;
        assert!(d < 1e-4, "{t} two sequences: {d}");
    }
    Ok(())
}

/// `b`'s paged attention against the slow reference on `cases` random
/// launches (seeded): several sequences of their own lengths in one
/// launch, each through a shuffled block table, decode steps beside
/// prefill chunks, head dims with and without a tiled kernel (64, 80, 96,
/// 128), odd block sizes, GQA groups of 1 to 8, sliding windows. (Run
/// by the kernel-emu build, whose attention is fast enough for many.)
#[cfg(feature = "kernel-emu")]
pub(crate) fn paged_attention_random(b: &dyn Attend, cases: u64) -> Result<()> {
    let rng = |n: u64, state: &mut u64| -> usize {
        *state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*state >> 33) % n) as usize
    };
    for case in 0..cases {
        let mut st = 0x9e3779b97f4a7c15u64 ^ case;
        let hd: usize = [64, 80, 96, 128][rng(4, &mut st)];
        let kvh = 1 + rng(3, &mut st);
        let group = [1, 2, 3, 4, 8][rng(5, &mut st)];
        let nh = kvh * group;
        let bs = [1, 3, 8, 16][rng(4, &mut st)];
        let window = [0, 0, 17, 100][rng(4, &mut st)];
        let seqs = 1 + rng(3, &mut st);
        // Each sequence: a context length and how many of its last
        // positions are queries (1: a decode step).
        let mut spans = Vec::new();
        for _ in 0..seqs {
            let ctx = 1 + rng(300, &mut st);
            let new = if rng(2, &mut st) == 0 {
                1
            } else {
                1 + rng(ctx.min(40) as u64, &mut st)
            };
            spans.push((ctx, new));
        }
        let max_blocks = spans
            .iter()
            .map(|&(c, _)| c.div_ceil(bs))
            .max()
            .unwrap_or(1);
        let blocks = seqs * max_blocks + 1;
        let mut order: Vec<u32> = (0..blocks as u32).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng(i as u64 + 1, &mut st));
        }
        let tables: Vec<u32> = order[..seqs * max_blocks].to_vec();
        let (mut token_seq, mut token_pos) = (Vec::new(), Vec::new());
        for (s, &(ctx, new)) in spans.iter().enumerate() {
            for p in ctx - new..ctx {
                token_seq.push(s as u32);
                token_pos.push(p as u32);
            }
        }
        let meta = PagedMeta {
            block_size: bs,
            block_tables: &tables,
            max_blocks,
            token_seq: &token_seq,
            token_pos: &token_pos,
            scale: 1.0 / (hd as f32).sqrt(),
            window,
        };
        for &t in b.types() {
            if t.is_quantized() && !hd.is_multiple_of(64) {
                continue; // quantized rows are turned 64 values at a time
            }
            let k = seeded_cache(&[blocks, bs, kvh, hd], 100 + case, t)?;
            let v = seeded_cache(&[blocks, bs, kvh, hd], 200 + case, t)?;
            let q = seeded(&[token_pos.len(), nh, hd], 300 + case, DType::F32)?;
            let want = crate::paged_attention_slow(&q, &k, &v, &meta)?;
            let d = max_abs_diff(&b.attend(&q, &k, &v, &meta)?, &want)?;
            assert!(
                d < 1e-4,
                "{t} random case {case} (heads {nh}/{kvh} of {hd}, block {bs}, window {window}, spans {spans:?}): {d}"
            );
        }
    }
    Ok(())
}

/// The tests of a device backend: `$open` gives the device (`Err` when
/// there is none: the tests print `skipped: no $what device` and pass,
/// unless `TESSERA_REQUIRE_GPU=1`, which makes them fail, so a GPU run
/// cannot pass by skipping).
#[cfg(any(feature = "cuda", all(feature = "metal", target_vendor = "apple")))]
macro_rules! device_tests {
    ($what:literal, $open:expr) => {
        use candle_core::{Device, Result};

        use super::parity::{self, OnDevice};

        fn gpu() -> Option<Device> {
            match $open {
                Ok(d) => Some(d),
                Err(e) => {
                    if std::env::var("TESSERA_REQUIRE_GPU").as_deref() == Ok("1") {
                        panic!(
                            concat!("TESSERA_REQUIRE_GPU=1 but no ", $what, " device: {}"),
                            e
                        )
                    }
                    eprintln!(concat!("skipped: no ", $what, " device ({})"), e);
                    None
                }
            }
        }

        #[test]
        fn write_kv_equals_the_reference() -> Result<()> {
            let Some(dev) = gpu() else { return Ok(()) };
            parity::write_kv(&OnDevice(dev))
        }

        #[test]
        fn copy_blocks_equals_the_reference() -> Result<()> {
            let Some(dev) = gpu() else { return Ok(()) };
            parity::copy_blocks(&OnDevice(dev))
        }

        #[test]
        fn shift_and_rotate_equal_the_reference() -> Result<()> {
            let Some(dev) = gpu() else { return Ok(()) };
            parity::shift_and_rotate(&OnDevice(dev))
        }

        #[test]
        fn paged_attention_matches_the_reference() -> Result<()> {
            let Some(dev) = gpu() else { return Ok(()) };
            parity::paged_attention_on(&dev)
        }
    };
}
#[cfg(any(feature = "cuda", all(feature = "metal", target_vendor = "apple")))]
pub(crate) use device_tests;
