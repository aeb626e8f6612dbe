//! The f32 kernels' vectors: [`lanes::Lanes`], sixteen f32 lanes (an
//! array in portable code, one AVX-512 register, two AVX2 registers) with
//! one fixed reduction tree, which the attention and the f32-activation
//! products are written in; the kernels' exponential; and how every kernel
//! family picks its instruction set ([`capped`]). Element-wise loops (the
//! norms and activations) are plain code compiled again under each
//! instruction set's `#[target_feature]`, the same operations in every
//! build. [`elem`] converts cache elements (f16, bf16) to and from f32.

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

/// `e^x` for `x <= 0` (softmax weights, sigmoids), within 2 ulp of `f32::exp`, in
/// straight-line arithmetic the compiler vectorizes: `x = n·ln2 + r` with
/// `|r| <= ln2/2`, a degree-6 polynomial for `e^r`, and `2^n` put into the
/// exponent bits. Below -87 the result is 0.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = x.max(-87.0);
    // Round to nearest, ties to even, by the 1.5·2^23 trick (exact for
    // |x·log2 e| < 2^22, here at most 126): no library call anywhere.
    const MAGIC: f32 = 12_582_912.0;
    let t = x * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (0.166_666_67
                    + r * (0.041_666_668 + r * (0.008_333_334 + r * 0.001_388_889)))));
    // `2^n` from the bits of `t` = 1.5·2^23 + n (spacing 1 there, so its
    // low bits hold n exactly): integer steps that vectorize, where `n as
    // i32` (a saturating conversion) is done one lane at a time.
    let scale = f32::from_bits(t.to_bits().wrapping_sub(MAGIC.to_bits() - 127) << 23);
    p * scale
}

#[cfg(test)]
#[test]
fn fast_exp_matches_std_exp() {
    let mut worst = 0f32;
    for i in 0..=200_000 {
        let x = -(i as f32) * 87.0 / 200_000.0;
        let (a, b) = (exp_nonpositive(x), x.exp());
        worst = worst.max((a - b).abs() / b.max(f32::MIN_POSITIVE));
    }
    assert!(worst < 3e-7, "relative error {worst}");
    // The exponent taken from the rounding sum's bits is `n as i32`: every
    // integer n the clamp allows, and the halfway points between them.
    for i in 0..=2 * 126 {
        let x = (-(i as f32) / 2.0 / std::f32::consts::LOG2_E).max(-87.0);
        let t = x * std::f32::consts::LOG2_E + 12_582_912.0;
        let n = (t - 12_582_912.0) as i32;
        assert_eq!(t.to_bits().wrapping_sub(0x4B40_0000) as i32, n, "at {x}");
        assert!((-126..=0).contains(&n), "{n} at {x}");
    }
    assert_eq!(exp_nonpositive(0.0), 1.0);
    assert_eq!(exp_nonpositive(-1000.0), exp_nonpositive(-87.0));
}
