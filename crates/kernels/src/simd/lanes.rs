//! Sixteen f32 lanes for the kernels: an array in portable code, one
//! AVX-512 register, or two AVX2 registers, with only lane-wise fused
//! multiply-adds and one fixed reduction tree, so that every
//! implementation gives the same bits.

// Lane loops index several arrays in step.
#![allow(clippy::needless_range_loop)]

use crate::linear::matvec::f16_to_f32;

/// The fixed tree over 16 values (see [`Lanes::reduce`]).
#[inline(always)]
pub(crate) fn reduce16(v: &[f32; 16]) -> f32 {
    let mut v8 = [0f32; 8];
    for j in 0..8 {
        v8[j] = v[j] + v[j + 8];
    }
    let mut v4 = [0f32; 4];
    for j in 0..4 {
        v4[j] = v8[j] + v8[j + 4];
    }
    (v4[0] + v4[2]) + (v4[1] + v4[3])
}

/// Sixteen f32 lanes: an array in portable code, one AVX-512 register,
/// or two AVX2 registers. Only lane-wise fused multiply-adds, so every
/// implementation gives the same bits.
pub(crate) trait Lanes: Copy {
    /// # Safety
    /// The CPU has the instruction set of the implementation.
    unsafe fn zero() -> Self;
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn load(p: &[f32; 16]) -> Self;
    /// `a · b + c`, rounded once.
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn store(self, out: &mut [f32; 16]);
    /// A hint to load the cache line at `p` into L2 (never faults). Not
    /// L1: a stream of L1 prefetches fills the core's few miss buffers and
    /// then each one waits, stalling the arithmetic it should overlap
    /// (measured: one thread's attention over 47 MB of K/V took 7.8 ms
    /// with L1 hints, the same as with none, and 5.2 ms with L2 hints).
    /// # Safety
    /// As [`Lanes::zero`].
    #[inline(always)]
    unsafe fn prefetch(_p: *const u8) {}
    /// `x` in every lane.
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn splat(x: f32) -> Self;
    /// `a + b` lane by lane, rounded once.
    /// # Safety
    /// As [`Lanes::zero`].
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        let (mut x, mut y) = ([0f32; 16], [0f32; 16]);
        a.store(&mut x);
        b.store(&mut y);
        for j in 0..16 {
            x[j] += y[j];
        }
        Self::load(&x)
    }
    /// `a · b` lane by lane, rounded once.
    /// # Safety
    /// As [`Lanes::zero`].
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        let (mut x, mut y) = ([0f32; 16], [0f32; 16]);
        a.store(&mut x);
        b.store(&mut y);
        for j in 0..16 {
            x[j] *= y[j];
        }
        Self::load(&x)
    }
    /// Whether [`Lanes::transpose16`] is a few shuffles (else a scalar
    /// loop, and callers keep a layout that needs none).
    const FAST_TRANSPOSE: bool = false;
    /// `dst[16·j + r] = src[r·stride + j]` for `r, j < 16`: sixteen rows of
    /// sixteen values turned into sixteen columns (moves only, no
    /// arithmetic).
    /// # Safety
    /// As [`Lanes::zero`]; `src` holds 15 · `stride` + 16 values and `dst`
    /// 256.
    #[inline(always)]
    unsafe fn transpose16(src: *const f32, stride: usize, dst: *mut f32) {
        for r in 0..16 {
            for j in 0..16 {
                *dst.add(16 * j + r) = *src.add(r * stride + j);
            }
        }
    }
    /// The fixed reduction tree of [`crate::matvec`]: `v8[j] = v[j] +
    /// v[j+8]`, `v4[j] = v8[j] + v8[j+4]`, `(v4[0] + v4[2]) + (v4[1] +
    /// v4[3])`.
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn reduce(self) -> f32;
    /// An f16 scale, exactly (hardware conversion where there is one).
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn f16(bits: u16) -> f32;
    /// Sixteen f16 values to f32, exactly.
    /// # Safety
    /// As [`Lanes::zero`].
    #[inline(always)]
    unsafe fn f16x16(src: &[u16; 16], dst: &mut [f32; 16]) {
        for j in 0..16 {
            dst[j] = f16_to_f32(src[j]);
        }
    }
    /// `out[r] = rows[r].reduce()`, each by the same tree (so the same
    /// bits), for sixteen rows at once where the instruction set can.
    /// # Safety
    /// As [`Lanes::zero`].
    #[inline(always)]
    unsafe fn reduce_rows(rows: &[Self; 16], out: &mut [f32; 16]) {
        for r in 0..16 {
            out[r] = rows[r].reduce();
        }
    }
    /// Sixteen f16 values as lanes, exactly.
    /// # Safety
    /// As [`Lanes::zero`].
    #[inline(always)]
    unsafe fn load_f16(src: &[u16; 16]) -> Self {
        let mut v = [0f32; 16];
        Self::f16x16(src, &mut v);
        Self::load(&v)
    }
    /// The lane-wise maximum (as `f32::max` on numbers).
    /// # Safety
    /// As [`Lanes::zero`].
    #[inline(always)]
    unsafe fn max(a: Self, b: Self) -> Self {
        let (mut x, mut y) = ([0f32; 16], [0f32; 16]);
        a.store(&mut x);
        b.store(&mut y);
        for j in 0..16 {
            x[j] = x[j].max(y[j]);
        }
        Self::load(&x)
    }
    /// The largest lane.
    /// # Safety
    /// As [`Lanes::zero`].
    #[inline(always)]
    unsafe fn reduce_max(self) -> f32 {
        let mut x = [0f32; 16];
        self.store(&mut x);
        x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v))
    }
    /// `exp_nonpositive(x − m)` in every lane: the same operations in the
    /// same order as [`crate::simd::exp_nonpositive`], so the same bits.
    /// # Safety
    /// As [`Lanes::zero`].
    #[inline(always)]
    unsafe fn exp_sub(x: Self, m: f32) -> Self {
        let mut v = [0f32; 16];
        x.store(&mut v);
        for e in v.iter_mut() {
            *e = crate::simd::exp_nonpositive(*e - m);
        }
        Self::load(&v)
    }
    /// Sixteen q8_0 values `q · d` (exact products, rounded once).
    /// # Safety
    /// As [`Lanes::zero`].
    #[inline(always)]
    unsafe fn load_q8(q: &[i8; 16], d: f32) -> Self {
        let mut v = [0f32; 16];
        for j in 0..16 {
            v[j] = f32::from(q[j]) * d;
        }
        Self::load(&v)
    }
    /// Sixteen q4_0 values `(nibble − 8) · d`: the low nibbles of `q`, or
    /// the high ones.
    /// # Safety
    /// As [`Lanes::zero`].
    #[inline(always)]
    unsafe fn load_q4(q: &[u8; 16], high: bool, d: f32) -> Self {
        let mut v = [0f32; 16];
        let sh = if high { 4 } else { 0 };
        for j in 0..16 {
            v[j] = f32::from(((q[j] >> sh) & 0xF) as i8 - 8) * d;
        }
        Self::load(&v)
    }
}

#[derive(Clone, Copy)]
pub(crate) struct Portable([f32; 16]);

impl Lanes for Portable {
    #[inline(always)]
    unsafe fn zero() -> Self {
        Portable([0.0; 16])
    }
    #[inline(always)]
    unsafe fn load(p: &[f32; 16]) -> Self {
        Portable(*p)
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        let mut o = [0f32; 16];
        for j in 0..16 {
            o[j] = a.0[j].mul_add(b.0[j], c.0[j]);
        }
        Portable(o)
    }
    #[inline(always)]
    unsafe fn store(self, out: &mut [f32; 16]) {
        *out = self.0;
    }
    #[inline(always)]
    unsafe fn f16(bits: u16) -> f32 {
        f16_to_f32(bits)
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Portable([x; 16])
    }
    #[inline(always)]
    unsafe fn reduce(self) -> f32 {
        reduce16(&self.0)
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    use super::Lanes;

    /// [`crate::simd::exp_nonpositive`] of the vector `$x` with
    /// vector operations (no fused ones: the scalar code rounds each
    /// product and sum), wrapped by `$wrap`.
    macro_rules! exp_ops {
        ($x:expr, $set:ident, $add:ident, $sub:ident, $mul:ident, $max:ident, $pow2:ident) => {{
            let x = $max($x, $set(-87.0));
            let magic = $set(12_582_912.0);
            let n = $sub($add($mul(x, $set(std::f32::consts::LOG2_E)), magic), magic);
            let r = $sub(
                $sub(x, $mul(n, $set(0.693_145_75))),
                $mul(n, $set(1.428_606_8e-6)),
            );
            let mut p = $mul(r, $set(0.001_388_889));
            for c in [0.008_333_334, 0.041_666_668, 0.166_666_67, 0.5, 1.0] {
                p = $mul(r, $add($set(c), p));
            }
            let p = $add($set(1.0), p);
            $mul(p, $pow2(n))
        }};
    }

    /// The low (or high) nibbles of sixteen q4_0 bytes, less 8, as signed
    /// bytes.
    #[inline(always)]
    unsafe fn nibbles(q: &[u8; 16], high: bool) -> __m128i {
        let mut b = _mm_loadu_si128(q.as_ptr() as *const __m128i);
        if high {
            b = _mm_srli_epi16(b, 4);
        }
        _mm_sub_epi8(_mm_and_si128(b, _mm_set1_epi8(0xF)), _mm_set1_epi8(8))
    }

    /// `2^n` for integral `n` in −126..=127.
    #[inline(always)]
    unsafe fn pow2_512(n: __m512) -> __m512 {
        let e = _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127));
        _mm512_castsi512_ps(_mm512_slli_epi32::<23>(e))
    }

    /// `2^n` for integral `n` in −126..=127.
    #[inline(always)]
    unsafe fn pow2_256(n: __m256) -> __m256 {
        let e = _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127));
        _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e))
    }

    /// [`Lanes::exp_sub`] on eight lanes.
    #[inline(always)]
    unsafe fn exp8(x: __m256, m: f32) -> __m256 {
        exp_ops!(
            _mm256_sub_ps(x, _mm256_set1_ps(m)),
            _mm256_set1_ps,
            _mm256_add_ps,
            _mm256_sub_ps,
            _mm256_mul_ps,
            _mm256_max_ps,
            pow2_256
        )
    }

    #[derive(Clone, Copy)]
    pub(crate) struct Avx512(__m512);

    impl Lanes for Avx512 {
        #[inline(always)]
        unsafe fn zero() -> Self {
            Avx512(_mm512_setzero_ps())
        }
        #[inline(always)]
        unsafe fn load(p: &[f32; 16]) -> Self {
            Avx512(_mm512_loadu_ps(p.as_ptr()))
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            Avx512(_mm512_fmadd_ps(a.0, b.0, c.0))
        }
        #[inline(always)]
        unsafe fn store(self, out: &mut [f32; 16]) {
            _mm512_storeu_ps(out.as_mut_ptr(), self.0)
        }
        #[inline(always)]
        unsafe fn f16(bits: u16) -> f32 {
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
        }
        #[inline(always)]
        unsafe fn f16x16(src: &[u16; 16], dst: &mut [f32; 16]) {
            let h = _mm256_loadu_si256(src.as_ptr() as *const __m256i);
            _mm512_storeu_ps(dst.as_mut_ptr(), _mm512_cvtph_ps(h))
        }
        #[inline(always)]
        unsafe fn load_f16(src: &[u16; 16]) -> Self {
            Avx512(_mm512_cvtph_ps(_mm256_loadu_si256(
                src.as_ptr() as *const __m256i
            )))
        }
        #[inline(always)]
        unsafe fn load_q8(q: &[i8; 16], d: f32) -> Self {
            let i = _mm512_cvtepi8_epi32(_mm_loadu_si128(q.as_ptr() as *const __m128i));
            Avx512(_mm512_mul_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(d)))
        }
        #[inline(always)]
        unsafe fn load_q4(q: &[u8; 16], high: bool, d: f32) -> Self {
            let i = _mm512_cvtepi8_epi32(nibbles(q, high));
            Avx512(_mm512_mul_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(d)))
        }
        #[inline(always)]
        unsafe fn prefetch(p: *const u8) {
            _mm_prefetch(p as *const i8, _MM_HINT_T1)
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Avx512(_mm512_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            Avx512(_mm512_add_ps(a.0, b.0))
        }
        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            Avx512(_mm512_mul_ps(a.0, b.0))
        }
        const FAST_TRANSPOSE: bool = true;
        /// Pairs of 32-bit values, then of 64-bit ones, then 128-bit
        /// quarters twice: 64 shuffles for 256 values.
        #[inline(always)]
        unsafe fn transpose16(src: *const f32, stride: usize, dst: *mut f32) {
            let mut r = [_mm512_setzero_ps(); 16];
            for (i, r) in r.iter_mut().enumerate() {
                *r = _mm512_loadu_ps(src.add(i * stride));
            }
            // t[2i] / t[2i + 1]: rows 2i and 2i + 1 interleaved by 32 bits.
            let mut t = [_mm512_setzero_ps(); 16];
            for i in 0..8 {
                t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
                t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
            }
            // u: each 128-bit lane now holds one column of four rows.
            let mut u = [_mm512_setzero_ps(); 16];
            for q in 0..4 {
                let (a, b) = (_mm512_castps_pd(t[4 * q]), _mm512_castps_pd(t[4 * q + 2]));
                let (c, d) = (
                    _mm512_castps_pd(t[4 * q + 1]),
                    _mm512_castps_pd(t[4 * q + 3]),
                );
                u[4 * q] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
                u[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
                u[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
                u[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
            }
            // u[4q + c], 128-bit lane l: column 4l + c of rows 4q..4q + 4.
            let mut v = [_mm512_setzero_ps(); 16];
            for c in 0..4 {
                v[c] = _mm512_shuffle_f32x4::<0x88>(u[c], u[4 + c]);
                v[4 + c] = _mm512_shuffle_f32x4::<0xdd>(u[c], u[4 + c]);
                v[8 + c] = _mm512_shuffle_f32x4::<0x88>(u[8 + c], u[12 + c]);
                v[12 + c] = _mm512_shuffle_f32x4::<0xdd>(u[8 + c], u[12 + c]);
            }
            for c in 0..4 {
                for h in 0..2 {
                    let (a, b) = (v[4 * h + c], v[8 + 4 * h + c]);
                    // Columns c + 4h (their lanes 0 and 2) and c + 4h + 8.
                    _mm512_storeu_ps(
                        dst.add(16 * (c + 4 * h)),
                        _mm512_shuffle_f32x4::<0x88>(a, b),
                    );
                    _mm512_storeu_ps(
                        dst.add(16 * (c + 4 * h + 8)),
                        _mm512_shuffle_f32x4::<0xdd>(a, b),
                    );
                }
            }
        }
        #[inline(always)]
        unsafe fn max(a: Self, b: Self) -> Self {
            Avx512(_mm512_max_ps(a.0, b.0))
        }
        #[inline(always)]
        unsafe fn reduce_max(self) -> f32 {
            _mm512_reduce_max_ps(self.0)
        }
        #[inline(always)]
        unsafe fn exp_sub(x: Self, m: f32) -> Self {
            Avx512(exp_ops!(
                _mm512_sub_ps(x.0, _mm512_set1_ps(m)),
                _mm512_set1_ps,
                _mm512_add_ps,
                _mm512_sub_ps,
                _mm512_mul_ps,
                _mm512_max_ps,
                pow2_512
            ))
        }
        #[inline(always)]
        unsafe fn reduce(self) -> f32 {
            let v8 = _mm256_add_ps(
                _mm512_castps512_ps256(self.0),
                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(self.0), 1)),
            );
            reduce8(v8)
        }
        /// The tree's three levels on sixteen rows at once ([`Across16`]):
        /// the same additions of the same values as [`Lanes::reduce`].
        #[inline(always)]
        unsafe fn reduce_rows(rows: &[Self; 16], out: &mut [f32; 16]) {
            let mut tree = Across16::new();
            // Written out row by row: each push's branches fold away.
            macro_rules! push {
                ($($r:literal)*) => {$(
                    if let Some(sums) = tree.push($r, rows[$r].0, |a, b| _mm512_add_ps(a, b)) {
                        _mm512_storeu_ps(out.as_mut_ptr(), sums);
                    }
                )*};
            }
            push!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
        }
    }

    /// `op` over the sixteen lanes of each of sixteen registers pushed in
    /// turn, into lane `b` for the `b`-th, by the tree of
    /// [`super::reduce16`] (lanes `j` and `j + 8`, then `j` and `j + 4`,
    /// then `(0 + 2) + (1 + 3)`), rows moved between lanes by shuffles,
    /// folded as the registers come: [`Avx512::reduce_rows`] with `+`,
    /// and the activations' quantization with `+` and `max`, whose
    /// sixteen registers never sit in memory (it runs between tiles that
    /// have pushed its stack lines out of every cache).
    #[derive(Clone, Copy)]
    pub(crate) struct Across16 {
        /// The even register of the pair being pushed.
        pair: __m512,
        /// The first of two pairs, reduced to eight lanes each.
        v8: __m512,
        /// The first of two quads, reduced to four lanes each.
        v4: __m512,
        /// The first eight registers, reduced to two lanes each.
        r01: __m512,
    }

    impl Across16 {
        #[inline(always)]
        pub(crate) unsafe fn new() -> Self {
            let z = _mm512_setzero_ps();
            Across16 {
                pair: z,
                v8: z,
                v4: z,
                r01: z,
            }
        }

        /// Takes the `b`-th register (`b` = 0, 1, … in turn); after the
        /// sixteenth, returns the result.
        #[inline(always)]
        pub(crate) unsafe fn push(
            &mut self,
            b: usize,
            v: __m512,
            op: impl Fn(__m512, __m512) -> __m512,
        ) -> Option<__m512> {
            if b.is_multiple_of(2) {
                self.pair = v;
                return None;
            }
            let a = self.pair;
            let v8 = op(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(a, v),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(a, v),
            );
            if (b / 2).is_multiple_of(2) {
                self.v8 = v8;
                return None;
            }
            let s = self.v8;
            let v4 = op(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(s, v8),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(s, v8),
            );
            if (b / 4).is_multiple_of(2) {
                self.v4 = v4;
                return None;
            }
            let (x, y) = (_mm512_castps_pd(self.v4), _mm512_castps_pd(v4));
            let r = op(
                _mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)),
            );
            if b < 8 {
                self.r01 = r;
                return None;
            }
            let sum = op(
                _mm512_shuffle_ps::<0b10_00_10_00>(self.r01, r),
                _mm512_shuffle_ps::<0b11_01_11_01>(self.r01, r),
            );
            let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
            Some(_mm512_permutexvar_ps(order, sum))
        }
    }

    /// `v4[j] = v8[j] + v8[j+4]`, then `(v4[0] + v4[2]) + (v4[1] + v4[3])`.
    #[inline(always)]
    pub(crate) unsafe fn reduce8(v8: __m256) -> f32 {
        let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
        let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
        _mm_cvtss_f32(_mm_add_ss(v2, _mm_movehdup_ps(v2)))
    }

    #[derive(Clone, Copy)]
    pub(crate) struct Avx2(__m256, __m256);

    impl Avx2 {
        /// Sixteen signed bytes times `d`.
        #[inline(always)]
        unsafe fn bytes(b: __m128i, d: f32) -> Avx2 {
            let d = _mm256_set1_ps(d);
            let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
            let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
            Avx2(_mm256_mul_ps(lo, d), _mm256_mul_ps(hi, d))
        }
    }

    impl Lanes for Avx2 {
        #[inline(always)]
        unsafe fn zero() -> Self {
            Avx2(_mm256_setzero_ps(), _mm256_setzero_ps())
        }
        #[inline(always)]
        unsafe fn load(p: &[f32; 16]) -> Self {
            Avx2(
                _mm256_loadu_ps(p.as_ptr()),
                _mm256_loadu_ps(p.as_ptr().add(8)),
            )
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            Avx2(
                _mm256_fmadd_ps(a.0, b.0, c.0),
                _mm256_fmadd_ps(a.1, b.1, c.1),
            )
        }
        #[inline(always)]
        unsafe fn store(self, out: &mut [f32; 16]) {
            _mm256_storeu_ps(out.as_mut_ptr(), self.0);
            _mm256_storeu_ps(out.as_mut_ptr().add(8), self.1);
        }
        #[inline(always)]
        unsafe fn f16(bits: u16) -> f32 {
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
        }
        #[inline(always)]
        unsafe fn f16x16(src: &[u16; 16], dst: &mut [f32; 16]) {
            let lo = _mm_loadu_si128(src.as_ptr() as *const __m128i);
            let hi = _mm_loadu_si128(src.as_ptr().add(8) as *const __m128i);
            _mm256_storeu_ps(dst.as_mut_ptr(), _mm256_cvtph_ps(lo));
            _mm256_storeu_ps(dst.as_mut_ptr().add(8), _mm256_cvtph_ps(hi));
        }
        #[inline(always)]
        unsafe fn load_f16(src: &[u16; 16]) -> Self {
            let lo = _mm_loadu_si128(src.as_ptr() as *const __m128i);
            let hi = _mm_loadu_si128(src.as_ptr().add(8) as *const __m128i);
            Avx2(_mm256_cvtph_ps(lo), _mm256_cvtph_ps(hi))
        }
        #[inline(always)]
        unsafe fn load_q8(q: &[i8; 16], d: f32) -> Self {
            let b = _mm_loadu_si128(q.as_ptr() as *const __m128i);
            Avx2::bytes(b, d)
        }
        #[inline(always)]
        unsafe fn load_q4(q: &[u8; 16], high: bool, d: f32) -> Self {
            Avx2::bytes(nibbles(q, high), d)
        }
        #[inline(always)]
        unsafe fn prefetch(p: *const u8) {
            _mm_prefetch(p as *const i8, _MM_HINT_T1)
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Avx2(_mm256_set1_ps(x), _mm256_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn max(a: Self, b: Self) -> Self {
            Avx2(_mm256_max_ps(a.0, b.0), _mm256_max_ps(a.1, b.1))
        }
        #[inline(always)]
        unsafe fn exp_sub(x: Self, m: f32) -> Self {
            Avx2(exp8(x.0, m), exp8(x.1, m))
        }
        #[inline(always)]
        unsafe fn reduce(self) -> f32 {
            reduce8(_mm256_add_ps(self.0, self.1))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::exp_nonpositive;

    /// Scores and maxima over the softmax's whole range, and beyond it.
    fn inputs() -> Vec<(f32, f32)> {
        let mut v = Vec::new();
        for i in 0..40_000 {
            let x = -(i as f32) * 100.0 / 40_000.0;
            v.push((x, 0.0));
            v.push((x * 0.37 + 3.0, 3.0));
            v.push((f32::from_bits(x.to_bits() ^ 1), -0.0));
        }
        v.push((f32::NEG_INFINITY, 0.0));
        v
    }

    /// `exp_sub` of lanes `L` against the scalar function, bit for bit.
    unsafe fn check<L: Lanes>(name: &str) {
        for chunk in inputs().chunks_exact(16) {
            for &(_, m) in chunk.iter().take(1) {
                let mut x = [0f32; 16];
                for (j, &(v, _)) in chunk.iter().enumerate() {
                    x[j] = v + m;
                }
                let mut got = [0f32; 16];
                L::exp_sub(L::load(&x), m).store(&mut got);
                for j in 0..16 {
                    let want = exp_nonpositive(x[j] - m);
                    assert_eq!(
                        got[j].to_bits(),
                        want.to_bits(),
                        "{name}: e^({} - {m})",
                        x[j]
                    );
                }
                let mut y = x;
                y.reverse();
                let mut mx = [0f32; 16];
                L::max(L::load(&x), L::load(&y)).store(&mut mx);
                for j in 0..16 {
                    assert_eq!(mx[j], x[j].max(y[j]), "{name}: max");
                }
                let top = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                assert_eq!(L::load(&x).reduce_max(), top, "{name}: reduce_max");
                let (mut sum, mut prod) = ([0f32; 16], [0f32; 16]);
                L::add(L::load(&x), L::load(&y)).store(&mut sum);
                L::mul(L::load(&x), L::load(&y)).store(&mut prod);
                for j in 0..16 {
                    assert_eq!(sum[j].to_bits(), (x[j] + y[j]).to_bits(), "{name}: add");
                    assert_eq!(prod[j].to_bits(), (x[j] * y[j]).to_bits(), "{name}: mul");
                }
            }
        }
        // Sixteen rows 19 apart (a stride that is no row length) turned
        // into columns.
        let src: Vec<f32> = (0..16 * 19).map(|i| i as f32).collect();
        let mut dst = [0f32; 256];
        L::transpose16(src.as_ptr(), 19, dst.as_mut_ptr());
        for r in 0..16 {
            for j in 0..16 {
                assert_eq!(
                    dst[16 * j + r],
                    src[19 * r + j],
                    "{name}: transpose16 ({r}, {j})"
                );
            }
        }
    }

    #[test]
    fn vector_exp_max_add_mul_and_transpose_equal_the_scalar_ones() {
        unsafe { check::<Portable>("portable") };
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn avx2() {
                check::<x86::Avx2>("avx2")
            }
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
            unsafe fn avx512() {
                check::<x86::Avx512>("avx512")
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                unsafe { avx2() };
            }
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
                unsafe { avx512() };
            }
        }
    }
}
