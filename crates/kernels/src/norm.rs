//! The per-row operations of a transformer layer around its products:
//! RMSNorm and the gated activations of the feed-forward block, each
//! vectorized for the CPU with the same operations on every instruction
//! set (so the same bits), and a slow f64 reference each.

use crate::simd::exp_nonpositive;
use crate::Isa;

/// The gate activation of a feed-forward block: `act(x·Wg) · (x·Wu)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU (the Llama family).
    Silu,
    /// GELU, tanh approximation (Gemma).
    GeluTanh,
}

/// `out = x / sqrt(mean(x²) + eps) · w`: the sum of squares in 16 lanes
/// and a fixed tree, so the same bits on every instruction set (16-lane
/// divisions where the portable build has 4).
pub fn rms_norm(isa: Isa, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    assert!(
        w.len() == x.len() && out.len() == x.len(),
        "rms_norm: lengths differ"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa` values above Portable come from CPU detection.
        Isa::Avx512 => unsafe { rms_norm_avx512(x, w, eps, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { rms_norm_avx2(x, w, eps, out) },
        _ => rms_norm_lanes(x, w, eps, out),
    }
}

/// [`rms_norm`] of `x` in place (`row`: scratch, grown as needed).
pub fn rms_norm_in_place(isa: Isa, x: &mut [f32], w: &[f32], eps: f32, row: &mut Vec<f32>) {
    if row.len() < x.len() {
        row.resize(x.len(), 0.0);
    }
    let row = &mut row[..x.len()];
    rms_norm(isa, x, w, eps, row);
    x.copy_from_slice(row);
}

/// Reference for [`rms_norm`]: the mean of squares in f64.
pub fn rms_norm_slow(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len() as f64;
    let m = (ms + eps as f64).sqrt();
    x.iter()
        .zip(w)
        .map(|(&v, &a)| (v as f64 / m * a as f64) as f32)
        .collect()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn rms_norm_avx512(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    rms_norm_lanes(x, w, eps, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rms_norm_avx2(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    rms_norm_lanes(x, w, eps, out)
}

#[inline(always)]
fn rms_norm_lanes(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let mut acc = [0f32; 16];
    let c = x.chunks_exact(16);
    let mut tail = 0f32;
    for &v in c.remainder() {
        tail += v * v;
    }
    for ch in c {
        for j in 0..16 {
            acc[j] += ch[j] * ch[j];
        }
    }
    let mut v8 = [0f32; 8];
    for j in 0..8 {
        v8[j] = acc[j] + acc[j + 8];
    }
    let sum = (v8[0] + v8[4]) + (v8[1] + v8[5]) + ((v8[2] + v8[6]) + (v8[3] + v8[7])) + tail;
    let m = (sum / x.len() as f32 + eps).sqrt();
    for ((o, &v), &a) in out.iter_mut().zip(x).zip(w) {
        *o = v / m * a;
    }
}

/// `v · sigmoid(v)` with `e^(−|v|)` from the kernels' exponential
/// (branch-free, so that it vectorizes).
#[inline(always)]
fn silu(v: f32) -> f32 {
    let e = exp_nonpositive(-v.abs());
    let num = if v >= 0.0 { 1.0 } else { e };
    v * (num / (1.0 + e))
}

/// GELU, tanh approximation (candle's `gelu`): `v/2 · (1 + tanh(√(2/π) ·
/// (v + 0.044715 v³)))`, with `tanh(y) = sign(y) · (1 − e^(−2|y|)) / (1 +
/// e^(−2|y|))` from the kernels' exponential (branch-free, so that it
/// vectorizes).
#[inline(always)]
fn gelu_tanh(v: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let y = SQRT_2_OVER_PI * v * (1.0 + 0.044_715 * v * v);
    let e = exp_nonpositive(-2.0 * y.abs());
    let t = ((1.0 - e) / (1.0 + e)).copysign(y);
    0.5 * v * (1.0 + t)
}

#[inline(always)]
fn act_mul_lanes(act: Activation, g: &[f32], u: &[f32], out: &mut [f32]) {
    match act {
        Activation::Silu => {
            for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
                *o = silu(g) * u;
            }
        }
        Activation::GeluTanh => {
            for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
                *o = gelu_tanh(g) * u;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn act_mul_avx512(act: Activation, g: &[f32], u: &[f32], out: &mut [f32]) {
    act_mul_lanes(act, g, u, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn act_mul_avx2(act: Activation, g: &[f32], u: &[f32], out: &mut [f32]) {
    act_mul_lanes(act, g, u, out)
}

/// `out[j] = act(g[j]) · u[j]`, vectorized for the CPU (the same
/// operations on every instruction set, so the same bits).
pub fn act_mul(isa: Isa, act: Activation, g: &[f32], u: &[f32], out: &mut [f32]) {
    assert!(
        g.len() == out.len() && u.len() == out.len(),
        "act_mul: lengths differ"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa` values above Portable come from CPU detection.
        Isa::Avx512 => unsafe { act_mul_avx512(act, g, u, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { act_mul_avx2(act, g, u, out) },
        _ => act_mul_lanes(act, g, u, out),
    }
}

/// Reference for [`act_mul`] in f64 with the library's `exp` and `tanh`.
pub fn act_mul_slow(act: Activation, g: &[f32], u: &[f32]) -> Vec<f32> {
    g.iter()
        .zip(u)
        .map(|(&g, &u)| {
            let (g, u) = (g as f64, u as f64);
            let a = match act {
                Activation::Silu => g / (1.0 + (-g).exp()),
                Activation::GeluTanh => {
                    let y = (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g);
                    0.5 * g * (1.0 + y.tanh())
                }
            };
            (a * u) as f32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32, scale: f32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| {
                let h = (i.wrapping_mul(2_654_435_761) ^ seed).wrapping_mul(40_503);
                ((h >> 8) as f32 / (1 << 24) as f32 - 0.5) * scale
            })
            .collect()
    }

    /// Every instruction set gives the same bits, within 1e-6 (relative)
    /// of the f64 reference, for rows that are and are not whole lanes.
    #[test]
    fn rms_norm_matches_its_reference_on_every_isa() {
        for n in [1, 15, 16, 64, 100, 576, 2048] {
            let (x, w) = (values(n, 1, 8.0), values(n, 2, 3.0));
            let slow = rms_norm_slow(&x, &w, 1e-5);
            let mut first: Option<Vec<f32>> = None;
            for isa in Isa::available() {
                let mut out = vec![0f32; n];
                rms_norm(isa, &x, &w, 1e-5, &mut out);
                for (a, b) in out.iter().zip(&slow) {
                    assert!(
                        (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                        "{isa:?} n={n}: {a} vs {b}"
                    );
                }
                match &first {
                    None => first = Some(out),
                    Some(f) => assert_eq!(f, &out, "{isa:?} n={n}: other bits"),
                }
            }
            let mut inplace = x.clone();
            rms_norm_in_place(Isa::detect(), &mut inplace, &w, 1e-5, &mut Vec::new());
            assert_eq!(Some(inplace), first);
        }
    }

    #[test]
    fn act_mul_matches_its_reference_on_every_isa() {
        for act in [Activation::Silu, Activation::GeluTanh] {
            for n in [1, 7, 16, 333] {
                let (g, u) = (values(n, 3, 24.0), values(n, 4, 2.0));
                let slow = act_mul_slow(act, &g, &u);
                let mut first: Option<Vec<f32>> = None;
                for isa in Isa::available() {
                    let mut out = vec![0f32; n];
                    act_mul(isa, act, &g, &u, &mut out);
                    // Relative, with a floor of a tenth of |u|: GELU's
                    // `1 + tanh` cancels where the gate is far below 0.
                    for ((a, b), u) in out.iter().zip(&slow).zip(&u) {
                        let tol = 1e-5 * (b.abs() + 0.1 * u.abs());
                        assert!((a - b).abs() <= tol, "{act:?} {isa:?}: {a} vs {b}");
                    }
                    match &first {
                        None => first = Some(out),
                        Some(f) => assert_eq!(f, &out, "{act:?} {isa:?}: other bits"),
                    }
                }
            }
        }
    }
}
