//! How close a decode's linear layers come to the host's read bandwidth:
//! the integer tiles of one weight format at a 1B-class FFN shape (8,192
//! rows of 2,048), as many copies as make `--mib` of weights, streamed by
//! one vector of activations on `--threads` threads (each its own half of
//! the copies, as a layer's rows are shared out), against the plain read
//! loop of `tessera bench --scenario roofline` over as many bytes.
//! Passes alternate read, tiles, read, tiles, … so that this host's
//! drifting bandwidth falls on both alike; each round's ratio is the tile
//! pass against the mean of the read passes either side. The same tiles
//! over one copy that fits in L2, as many times, give the rate the
//! arithmetic alone allows.
//!
//! `cargo run --release --example tile_stream -- [q4_0|q4_k|q6_k|q8_0]
//! [--threads 2] [--levels 2] [--mib 512] [--rounds 15]`

use std::time::Instant;

#[path = "common/args.rs"]
mod args;
use args::Args;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::DType;
use tessera_kernels::{
    qmatvec, quantize_row, timed_read, ActBlock, Packed, QIsa, WeightFormat, Weights,
};

fn main() -> anyhow::Result<()> {
    let args = Args::new();
    let threads = args.value("--threads", 2)?.max(1);
    let levels = args.levels()?;
    let mib = args.value("--mib", 512)?;
    let rounds = args.value("--rounds", 15)?.max(1);
    let (format, dtype) = args.format(&[
        ("q4_0", GgmlDType::Q4_0),
        ("q4_k", GgmlDType::Q4K),
        ("q6_k", GgmlDType::Q6K),
        ("q8_0", GgmlDType::Q8_0),
    ])?;
    let (n, k) = (8192, 2048);
    let w = tessera_kernels::testing::seeded(&[n, k], 5, DType::F32)?;
    let data = QTensor::quantize(&w, dtype)?.data()?.into_owned();
    let weights = Weights::new(WeightFormat::from_ggml(dtype), &data, n, k)?;
    let copies = ((mib << 20) / data.len()).max(threads);
    let packed: Vec<Packed> = Packed::pack_all(&vec![weights; copies])
        .into_iter()
        .map(|p| p.ok_or_else(|| anyhow::anyhow!("{format} has no integer path")))
        .collect::<anyhow::Result<_>>()?;
    let bytes = copies * data.len();
    let flat = tessera_kernels::read_buffer(bytes);
    let x = tessera_kernels::testing::seeded(&[1, k], 6, DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let mut acts = vec![ActBlock::default(); k / 32];
    quantize_row(&x, levels, &mut acts);
    let isa = QIsa::detect();

    // Each thread's share: whole copies, or (for the L2 pass) `repeat`
    // times the rows of `rows` of the first copy.
    let tiles = |share: &[Packed], rows: usize, repeat: usize| {
        let mut out = vec![0f32; n];
        for _ in 0..repeat {
            for p in share {
                qmatvec(isa, p, &acts, 1, levels, 0, rows, &mut |_, r, v| {
                    out[r..][..v.len()].copy_from_slice(v)
                });
            }
        }
        std::hint::black_box(&out);
    };
    let timed = |f: &(dyn Fn(usize) + Sync)| {
        let t = Instant::now();
        std::thread::scope(|s| {
            for i in 0..threads {
                s.spawn(move || f(i));
            }
        });
        t.elapsed().as_secs_f64()
    };
    let part = copies.div_ceil(threads);
    let stream = |i: usize| tiles(packed.chunks(part).nth(i).unwrap_or(&[]), n, 1);
    let read = || timed_read(&flat, threads);
    // The L2 pass: 256 rows of one copy (about 288 KiB of Q4_0), over and
    // over, as many bytes in all as the streams.
    let small = 256;
    let repeat = (bytes / threads) / (data.len() * small / n);
    let cached = |_: usize| tiles(&packed[..1], small, repeat);

    read();
    timed(&stream);
    let mut reads = vec![read()];
    let (mut tile_gbs, mut ratios) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t = timed(&stream);
        reads.push(read());
        let around = (reads[reads.len() - 2] + reads[reads.len() - 1]) / 2.0;
        tile_gbs.push(bytes as f64 / t / 1e9);
        ratios.push(around / t);
    }
    let l2 = bytes as f64 / timed(&cached) / 1e9;
    let read_gbs: Vec<f64> = reads.iter().map(|t| bytes as f64 / t / 1e9).collect();
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let json = serde_json::json!({
        "format": format,
        "isa": format!("{isa:?}"),
        "threads": threads,
        "levels": levels,
        "bytes": bytes,
        "rounds": rounds,
        "read_gb_s": median(&read_gbs),
        "tiles_gb_s": median(&tile_gbs),
        "tiles_share_of_read": median(&ratios),
        "tiles_share_min": ratios.iter().copied().fold(f64::MAX, f64::min),
        "tiles_share_max": ratios.iter().copied().fold(0.0, f64::max),
        "tiles_in_l2_gb_s": l2,
    });
    println!("{json}");
    Ok(())
}
