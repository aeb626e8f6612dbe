//! The integer tiles of a prompt chunk (many inputs) on each instruction
//! set this CPU runs, alternating round by round on one thread: a 1B-class
//! shape's weight (`--n` rows of `--k`) in one format against `--t`
//! inputs quantized to `--levels`, in multiply-adds a second. What a
//! prefill's linear layers can reach on one core, without the rest of the
//! forward.
//!
//! `cargo run --release --example prefill_tiles -- [q4_0|q4_1|q8_0|q4_k|q6_k]
//! [--n 2048] [--k 2048] [--t 128] [--levels 2] [--rounds 5] [--isas amx,avx512vnni]`
//! (`--isas`: only these, by their names below, lower case; on a CPU
//! with AVX-512 VNNI, `avxvnni-evex` adds the AVX-VNNI panels' code in
//! AVX-512 VNNI's encoding, for CPUs without AVX-VNNI, and for the
//! 32-value block formats the AVX-VNNI tiles' code in that encoding)

use std::time::Instant;

#[path = "common/args.rs"]
mod args;
use args::Args;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::DType;
use tessera_kernels::{qmatvec, quantize_row, ActBlock, Packed, QIsa, WeightFormat, Weights};

fn main() -> anyhow::Result<()> {
    let args = Args::new();
    let (n, k, t) = (
        args.value("--n", 2048)?,
        args.value("--k", 2048)?,
        args.value("--t", 128)?,
    );
    let levels = args.levels()?;
    let rounds = args.value("--rounds", 5)?.max(1);
    let (format, dtype) = args.format(&[
        ("q4_0", GgmlDType::Q4_0),
        ("q4_1", GgmlDType::Q4_1),
        ("q8_0", GgmlDType::Q8_0),
        ("q4_k", GgmlDType::Q4K),
        ("q6_k", GgmlDType::Q6K),
    ])?;
    let w = tessera_kernels::testing::seeded(&[n, k], 5, DType::F32)?;
    let data = QTensor::quantize(&w, dtype)?.data()?.into_owned();
    let weights = Weights::new(WeightFormat::from_ggml(dtype), &data, n, k)?;
    let packed =
        Packed::pack(&weights).ok_or_else(|| anyhow::anyhow!("{format} has no integer path"))?;
    let x = tessera_kernels::testing::seeded(&[t, k], 6, DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let mut acts = vec![ActBlock::default(); t * k / 32];
    for i in 0..t {
        quantize_row(&x[i * k..(i + 1) * k], levels, &mut acts[i * k / 32..]);
    }
    let mut out = vec![0f32; t * n];
    let only = args.words("--isas")?;
    let isas: Vec<QIsa> = QIsa::available()
        .into_iter()
        .filter(|i| *i != QIsa::Portable)
        .filter(|i| {
            only.as_ref()
                .is_none_or(|o| o.contains(&format!("{i:?}").to_lowercase()))
        })
        .collect();
    let mut names: Vec<String> = isas.iter().map(|i| format!("{i:?}")).collect();
    #[cfg(target_arch = "x86_64")]
    let evex = only
        .as_ref()
        .is_some_and(|o| o.iter().any(|w| w == "avxvnni-evex"));
    #[cfg(not(target_arch = "x86_64"))]
    let evex = false;
    if evex {
        names.push("AvxVnni-evex panels".into());
        if !matches!(dtype, GgmlDType::Q4K | GgmlDType::Q6K | GgmlDType::Q8_0) {
            names.push("AvxVnni-evex tiles".into());
        }
    }
    anyhow::ensure!(!names.is_empty(), "no instruction set of --isas runs here");
    let mut best = vec![0f64; names.len()];
    let macs = (n * k * t) as f64;
    for _ in 0..rounds {
        for (j, best) in best.iter_mut().enumerate() {
            let start = Instant::now();
            let mut runs = 0;
            while runs < 3 || start.elapsed().as_secs_f64() < 0.5 {
                let mut emit =
                    |i: usize, r: usize, v: &[f32]| out[i * n + r..][..v.len()].copy_from_slice(v);
                match isas.get(j) {
                    Some(&isa) => qmatvec(isa, &packed, &acts, t, levels, 0, n, &mut emit),
                    #[cfg(target_arch = "x86_64")]
                    None if j > isas.len() => tessera_kernels::testing::qmatvec_vnni_evex_tiles(
                        &packed, &acts, t, levels, &mut emit,
                    )
                    .ok_or_else(|| anyhow::anyhow!("the evex tiles did not run"))?,
                    #[cfg(target_arch = "x86_64")]
                    None => tessera_kernels::testing::qmatvec_vnni_evex_panels(
                        &packed, &acts, t, levels, 0, n, &mut emit,
                    )
                    .ok_or_else(|| {
                        anyhow::anyhow!("avxvnni-evex needs AVX-512 VNNI, 16 inputs and no Q8_0")
                    })?,
                    #[cfg(not(target_arch = "x86_64"))]
                    None => unreachable!(),
                }
                runs += 1;
            }
            let rate = macs * runs as f64 / start.elapsed().as_secs_f64() / 1e9;
            *best = best.max(rate);
        }
    }
    println!(
        "{format} {n}x{k}, {t} inputs, {levels} level(s), one thread, best of {rounds} rounds:"
    );
    for (name, rate) in names.iter().zip(&best) {
        println!("  {name:<12} {rate:7.1} G multiply-adds/s");
    }
    Ok(())
}
