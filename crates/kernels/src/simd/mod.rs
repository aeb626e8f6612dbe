//! f32 vector loops, written so the compiler vectorizes them, in two
//! builds: the baseline target, and AVX2 + FMA chosen at run time (the
//! kernels' hot functions are compiled again under `#[target_feature]` and
//! inline these).

use crate::tuning::IsaCap;

pub(crate) mod elem;
pub(crate) mod lanes;

/// Whether every kernel takes its portable path, whatever the CPU has
/// ([`crate::tuning::Tuning::isa`] `portable`): tests use it to check
/// those paths on machines where the SIMD ones would run.
pub fn portable_forced() -> bool {
    crate::tuning::get().isa == Some(IsaCap::Portable)
}

/// `best`, capped by the instruction set the tuning names, which `level`
/// maps to the family's own: how every kernel family picks its path.
pub(crate) fn capped<T: Ord + Copy>(best: T, level: impl Fn(IsaCap) -> T) -> T {
    match crate::tuning::get().isa {
        Some(cap) => best.min(level(cap)),
        None => best,
    }
}

/// Whether this CPU has AVX2 and FMA (checked once; x86-64 only, its
/// one caller's AVX2 attention paths are).
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn has_avx2_fma() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        !portable_forced()
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
    })
}

#[inline(always)]
pub(crate) fn madd<const FMA: bool>(acc: f32, x: f32, y: f32) -> f32 {
    if FMA {
        x.mul_add(y, acc)
    } else {
        acc + x * y
    }
}

/// Dot product with sixteen independent accumulators.
#[inline(always)]
pub(crate) fn dot<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] = madd::<FMA>(acc[i], x[i], y[i]);
        }
    }
    let mut s = [0f32; 8];
    for i in 0..8 {
        s[i] = acc[i] + acc[i + 8];
    }
    (s[0] + s[4]) + (s[1] + s[5]) + ((s[2] + s[6]) + (s[3] + s[7])) + tail
}

/// `y += a · x`.
#[inline(always)]
pub(crate) fn axpy<const FMA: bool>(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = madd::<FMA>(*y, a, x);
    }
}
