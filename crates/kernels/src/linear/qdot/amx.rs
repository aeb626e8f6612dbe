//! AMX tiles for products with many inputs (prompt chunks): Intel's
//! Advanced Matrix Extensions (Xeon since Sapphire Rapids) multiply a
//! 16 × K tile of signed bytes by a K × 16 one into a 16 × 16 tile of
//! exact i32 sums in one instruction (`tdpbssd`), where AVX-512 VNNI
//! forms sixteen such sums per instruction.
//!
//! **The same bits as every other path.** Per 32-value block (or K-quant
//! sub-block) the tile forms `a₁ = Σ w·q₁` and `a₂ = Σ w·q₂` for 16 inputs
//! × 16 rows at once, with the block's signed weights `w` (the GGML
//! integers: Q4_0's `n − 8`, Q6_K's `n − 32`, …) against the activations'
//! levels. Integer sums are exact, so they equal those the other tiles form
//! their own way; the sums go through memory into AVX-512 registers, one
//! lane per row as in `tile_avx512`, and take the same float steps in the
//! same order (the module docs of `super`). Q6_K's two halves of a
//! sub-block have scales of their own: each half is a tile product of its
//! own (`K` = 16), scaled as `ktile_avx512` scales them.
//!
//! A group's 16 rows are unpacked once into signed bytes in the tiles'
//! layout ([`Unit`]: the packed chunks are already `tdpbssd`'s second
//! operand, four values of a row in each 32-bit lane), then streamed
//! against each 16 inputs of a panel. Fewer than 16 inputs left take the
//! AVX-512 tiles.
//!
//! ```text
//!   A (tmm0): 16 inputs × 32 bytes (one level of one block)
//!   B (tmm2): 8 rows × 64 bytes: row j = values 4j..4j+4 of each of 16 weight rows
//!   C (tmm3): 16 inputs × 16 weight rows of i32     C[i][r] = Σₖ A[i][k]·B[k/4][4r + k%4]
//! ```

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::OnceLock;

use super::kquant::x86::{sub_scales512, sub_values512, super_scales512};
use super::kquant::QK;
use super::x86::block_values512;
use super::{ActBlock, ActsKey, Kind, Packed, GROUP};

/// Inputs one tile takes.
pub(super) const INPUTS: usize = 16;

/// Inputs per panel for a weight of `nb` blocks a row: as many as keep
/// the regrouped panel within about 1.25 MiB of the 2 MiB L2 of every CPU
/// with AMX so far, from 64 to 256 (a row group's unpacking is shared by
/// more inputs the larger the panel). Measured with `prefill_tiles`, Q4_0
/// against 512 inputs: 2048 wide, 256 inputs 1.08× 64; 8192 wide, 64
/// inputs 1.2× 128 or 256.
pub(super) fn panel(nb: usize) -> usize {
    const BUDGET: usize = 1280 << 10;
    (BUDGET / input_bytes(nb).max(1) / INPUTS * INPUTS).clamp(64, 256)
}

/// Bytes one input of `nb` blocks takes regrouped.
fn input_bytes(nb: usize) -> usize {
    nb * std::mem::size_of::<Inputs>() / INPUTS
}

/// Whether this CPU has AMX-INT8 and the OS lets this process use the
/// tiles' state (on Linux it must be asked for, once per process).
pub(super) fn usable() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        // CPUID.(EAX=7, ECX=0):EDX bit 24 AMX-TILE, bit 25 AMX-INT8.
        #[allow(unused_unsafe)]
        // SAFETY: CPUID leaf 7 exists on every x86-64 CPU with AVX-512.
        let leaf = unsafe { __cpuid_count(7, 0) };
        if leaf.edx >> 24 & 3 != 3 {
            return false;
        }
        request_tiles()
    })
}

#[cfg(target_os = "linux")]
fn request_tiles() -> bool {
    // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): the kernel
    // then saves the tiles' 8 KiB with each thread of the process.
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain system call with integer arguments.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn request_tiles() -> bool {
    false
}

/// One block (or sub-block) of a group's 16 rows, unpacked for the tiles.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Unit {
    /// `tdpbssd`'s second operand: 8 rows of 64 bytes, row `j` holding the
    /// signed values `4j..4j + 4` of weight row `r` at bytes `4r..4r + 4`
    /// (Q6_K: rows 0–3 the first half, 4–7 the second).
    w: [i8; 512],
    /// Each row's scale (`d`, or a K-quant's `D`).
    d: [f32; GROUP],
    /// Each row's minimum (`m`, `M`), or Q6_K's first half scale.
    m: [f32; GROUP],
    /// Q6_K's second half scale.
    sc1: [f32; GROUP],
}

const EMPTY: Unit = Unit {
    w: [0; 512],
    d: [0.0; GROUP],
    m: [0.0; GROUP],
    sc1: [0.0; GROUP],
};

thread_local! {
    /// The unpacked group this thread streams inputs against.
    static UNITS: RefCell<Vec<Unit>> = const { RefCell::new(Vec::new()) };
}

/// The 64-byte operand of `ldtilecfg` (palette 1).
#[repr(C, align(64))]
struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
    tail: [u8; 16],
}

impl Config {
    /// Blocks: tmm0, tmm1 the two levels' A (16 × 32 bytes), tmm2 B (8 ×
    /// 64), tmm3, tmm4 their sums. Halves (Q6_K): tmm0, tmm1 a level's two
    /// halves (16 × 16), tmm2, tmm3 B's halves (4 × 64), tmm4–tmm7 the sums
    /// (level 1 low, high; level 2 low, high).
    fn new(halves: bool) -> Config {
        let mut c = Config {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
            tail: [0; 16],
        };
        let mut set = |t: usize, rows: u8, colsb: u16| {
            c.rows[t] = rows;
            c.colsb[t] = colsb;
        };
        if halves {
            set(0, 16, 16);
            set(1, 16, 16);
            set(2, 4, 64);
            set(3, 4, 64);
            for t in 4..8 {
                set(t, 16, 64);
            }
        } else {
            set(0, 16, 32);
            set(1, 16, 32);
            set(2, 8, 64);
            set(3, 16, 64);
            set(4, 16, 64);
        }
        c
    }
}

/// One tile's sums, one 64-byte row per input.
#[repr(C, align(64))]
struct Sums([[i32; GROUP]; INPUTS]);

/// One block of 16 inputs, regrouped for the tiles: the inputs' levels as
/// rows of 64 bytes (`q₁` then `q₂`, `tdpbssd`'s first operand 64 bytes a
/// row apart, where the blocks of a row of inputs lie `nb` blocks apart),
/// and their scales and sums side by side for the float steps.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Inputs {
    q: [[i8; 64]; INPUTS],
    d1: [f32; INPUTS],
    d2: [f32; INPUTS],
    xsum: [f32; INPUTS],
}

/// The inputs regrouped on this thread, 16 at a time, block by block.
struct Regrouped {
    records: Vec<Inputs>,
    /// Blocks an input.
    nb: usize,
    /// Whole 16-input chunks held.
    chunks: usize,
    /// The key of the batch held whole, or `None` (a panel, or no key).
    key: Option<ActsKey>,
}

thread_local! {
    static REGROUPED: RefCell<Regrouped> = const {
        RefCell::new(Regrouped { records: Vec::new(), nb: 0, chunks: 0, key: None })
    };
}

/// The most a thread keeps of a keyed batch regrouped whole (beyond it,
/// panel by panel): 8 MiB holds 512 inputs 4,096 wide.
const KEEP_BYTES: usize = 8 << 20;

/// Regroups the inputs' first `16·⌊t/16⌋` for [`tiles`] on this thread,
/// all of them if `key` names them and they fit [`KEEP_BYTES`] (then
/// later calls with the same key find them done: `Some(count)`), else
/// none (`None`: [`regroup`] a panel at a time).
pub(super) fn prepare(
    acts: &[ActBlock],
    t: usize,
    nb: usize,
    key: Option<ActsKey>,
) -> Option<usize> {
    let full = t / INPUTS * INPUTS;
    let key = key?;
    if full * input_bytes(nb) > KEEP_BYTES {
        return None;
    }
    REGROUPED.with(|r| {
        let r = &mut *r.borrow_mut();
        if r.key != Some(key) || r.nb != nb || r.chunks != full / INPUTS {
            // SAFETY: only with AMX, so AVX-512 F/BW.
            unsafe { fill(r, &acts[..full * nb], full, nb) };
            r.key = Some(key);
        }
    });
    Some(full)
}

/// Regroups the first `16·⌊t/16⌋` of the `t` inputs in `acts` (`t` rows
/// of `nb` blocks) for [`tiles`], on this thread; returns how many.
pub(super) fn regroup(acts: &[ActBlock], t: usize, nb: usize) -> usize {
    let full = t / INPUTS * INPUTS;
    REGROUPED.with(|r| {
        let r = &mut *r.borrow_mut();
        // SAFETY: only with AMX, so AVX-512 F/BW.
        unsafe { fill(r, acts, full, nb) };
        r.key = None;
    });
    full
}

/// The first `full` inputs of `acts` into `r`, whose every field of every
/// record is written.
///
/// # Safety
/// The CPU has AVX-512 F and BW (for the 64-byte copies).
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn fill(r: &mut Regrouped, acts: &[ActBlock], full: usize, nb: usize) {
    let n = full / INPUTS * nb;
    r.records.resize(n, EMPTY_INPUTS);
    (r.nb, r.chunks) = (nb, full / INPUTS);
    for (c, chunk) in r.records.chunks_exact_mut(nb).enumerate() {
        let rows = &acts[c * INPUTS * nb..(c + 1) * INPUTS * nb];
        for (b, rec) in chunk.iter_mut().enumerate() {
            for i in 0..INPUTS {
                let a = &rows[i * nb + b];
                rec.q[i] = a.levels();
                (rec.d1[i], rec.d2[i], rec.xsum[i]) = (a.d[0], a.d[1], a.xsum);
            }
        }
    }
}

const EMPTY_INPUTS: Inputs = Inputs {
    q: [[0; 64]; INPUTS],
    d1: [0.0; INPUTS],
    d2: [0.0; INPUTS],
    xsum: [0.0; INPUTS],
};

/// Group `g` of `w` against the regrouped chunks `c0..c1` on this thread
/// ([`prepare`], [`regroup`]): `emit(input, values)` for each of their
/// inputs (counted from chunk `c0`'s first), the 16 rows' values.
///
/// # Safety
/// [`usable`], the CPU has AVX-512 F/BW/VL and F16C, and [`configure`]
/// was called for `w` on this thread.
pub(super) unsafe fn tiles(
    w: &Packed,
    g: usize,
    two: bool,
    (c0, c1): (usize, usize),
    emit: &mut impl FnMut(usize, &[f32; GROUP]),
) {
    let halves = w.kind == Kind::Q6K;
    let min = w.kind.has_min();
    REGROUPED.with(|r| {
        let r = &*r.borrow();
        assert!(
            r.nb == w.nb && c0 <= c1 && c1 <= r.chunks,
            "amx::tiles: inputs regrouped for another width or count"
        );
        if c0 == c1 {
            return;
        }
        let panel = &r.records[c0 * r.nb..c1 * r.nb];
        UNITS.with(|units| {
            let mut units = units.borrow_mut();
            stage(w, g, &mut units);
            let mut out = [[0f32; GROUP]; INPUTS];
            let mut sums = Sums2::new();
            for (j, ins) in panel.chunks_exact(w.nb).enumerate() {
                match (halves, min, two) {
                    (true, _, true) => run::<true, false, true>(&units, ins, &mut sums, &mut out),
                    (true, _, false) => run::<true, false, false>(&units, ins, &mut sums, &mut out),
                    (false, true, true) => {
                        run::<false, true, true>(&units, ins, &mut sums, &mut out)
                    }
                    (false, true, false) => {
                        run::<false, true, false>(&units, ins, &mut sums, &mut out)
                    }
                    (false, false, true) => {
                        run::<false, false, true>(&units, ins, &mut sums, &mut out)
                    }
                    (false, false, false) => {
                        run::<false, false, false>(&units, ins, &mut sums, &mut out)
                    }
                }
                for (i, o) in out.iter().enumerate() {
                    emit(j * INPUTS + i, o);
                }
            }
        })
    })
}

/// Loads the tile configuration for `w`'s format on this thread, for the
/// [`tiles`] calls up to [`release`].
///
/// # Safety
/// [`usable`].
pub(super) unsafe fn configure(w: &Packed) {
    let cfg = Config::new(w.kind == Kind::Q6K);
    // SAFETY: AMX is usable (the caller's contract); the config is valid
    // for palette 1.
    asm!("ldtilecfg [{}]", in(reg) &cfg, options(nostack, readonly, preserves_flags));
}

/// Gives the tiles back (their state no longer saved with the thread).
///
/// # Safety
/// [`usable`].
pub(super) unsafe fn release() {
    asm!("tilerelease", options(nostack, nomem, preserves_flags));
}

/// Unpacks group `g`'s tile records into `units`, one a 32-value block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn stage(w: &Packed, g: usize, units: &mut Vec<Unit>) {
    let kind = w.kind;
    // Every field the float steps read for this kind is written below, so
    // a group staged after another of the same width keeps the vector as
    // it is (filling it first doubled the stores a unit takes).
    if units.len() != w.nb {
        units.clear();
        units.resize(w.nb, EMPTY);
    }
    let p = w.tile(g).as_ptr();
    let put = |u: &mut Unit, wv: [__m512i; 8], bias: i8| {
        let b = _mm512_set1_epi8(bias);
        for (j, v) in wv.into_iter().enumerate() {
            _mm512_store_si512(
                u.w.as_mut_ptr().add(64 * j) as *mut _,
                _mm512_add_epi8(v, b),
            );
        }
    };
    if kind.super_block() {
        let rec = kind.k_record();
        for sb in 0..w.k / QK {
            let t = p.add(sb * rec);
            let scales = super_scales512(t);
            for j in 0..8 {
                let u = &mut units[8 * sb + j];
                let (d, m, sc) = sub_scales512(kind, t, j, scales);
                let q6 = kind == Kind::Q6K;
                put(
                    u,
                    sub_values512(kind, t.add(kind.sub_at(j))),
                    if q6 { -32 } else { 0 },
                );
                _mm512_store_ps(u.d.as_mut_ptr(), d);
                _mm512_store_ps(u.m.as_mut_ptr(), if q6 { sc.0 } else { m });
                _mm512_store_ps(u.sc1.as_mut_ptr(), sc.1);
            }
        }
        return;
    }
    let rec = kind.record();
    for (b, u) in units.iter_mut().enumerate() {
        let t = p.add(b * rec);
        put(u, block_values512(kind, t), kind.bias() as i8);
        _mm512_store_ps(
            u.d.as_mut_ptr(),
            _mm512_cvtph_ps(_mm256_loadu_si256(t as *const __m256i)),
        );
        if kind.has_min() {
            let m = _mm512_cvtph_ps(_mm256_loadu_si256(t.add(32) as *const __m256i));
            _mm512_store_ps(u.m.as_mut_ptr(), m);
        }
    }
}

/// `$body` for each of the 16 inputs, written out (as `unrolled!`).
macro_rules! each_input {
    (|$i:ident| $body:block) => {{
        unrolled!(8, |h| {
            let $i = h;
            $body
        });
        unrolled!(8, |h| {
            let $i = h + 8;
            $body
        });
    }};
}

/// `tileloadd tmm$t` from rows `stride` bytes apart at `p`.
macro_rules! load {
    ($t:literal, $p:expr, $stride:expr) => {
        asm!(
            concat!("tileloadd tmm", $t, ", [{p} + {s}*1]"),
            p = in(reg) $p,
            s = in(reg) $stride,
            options(nostack, readonly, preserves_flags)
        )
    };
}

/// `tmm$c = tmm$a · tmm$b` (from zero).
macro_rules! product {
    ($c:literal, $a:literal, $b:literal) => {
        asm!(
            concat!("tilezero tmm", $c),
            concat!("tdpbssd tmm", $c, ", tmm", $a, ", tmm", $b),
            options(nostack, nomem, preserves_flags)
        )
    };
}

/// `tilestored` of `tmm$t` into `sums`.
macro_rules! store {
    ($t:literal, $sums:expr) => {
        asm!(
            concat!("tilestored [{p} + {s}*1], tmm", $t),
            p = in(reg) ($sums).0.as_mut_ptr(),
            s = in(reg) 64usize,
            options(nostack, preserves_flags)
        )
    };
}

/// Two units' tile sums (the one the float steps read, the one the tiles
/// write), one 64-byte row per input: a unit's are its levels' (blocks),
/// or each level's halves (Q6_K: level 1 low, high, level 2 low, high).
/// The second unit's start 2 KiB past a multiple of 4 KiB from the
/// first's, so that loads of the one are not taken for loads of what is
/// being stored into the other (addresses equal in their low 12 bits).
#[repr(C, align(64))]
struct Sums2([Sums; 10]);

impl Sums2 {
    fn new() -> Sums2 {
        Sums2(std::array::from_fn(|_| Sums([[0; GROUP]; INPUTS])))
    }

    /// Unit `u`'s sums (`u` 0 or 1), and the other's. Inlined: a call in
    /// `run`'s loop would spill its accumulators around it (it did: the
    /// tiles ran 1.3–1.9× faster once it was inlined).
    #[inline(always)]
    fn split(&mut self, halves: bool, u: usize) -> (&[Sums], &mut [Sums]) {
        let (parts, second) = if halves { (4, 6) } else { (2, 2) };
        let (a, b) = self.0.split_at_mut(second);
        let (a, b) = (&mut a[..parts], &mut b[..parts]);
        if u == 0 {
            (a, b)
        } else {
            (b, a)
        }
    }
}

/// Part `p`'s sums for input `i`, as f32.
#[inline(always)]
unsafe fn get(sums: &[Sums], p: usize, i: usize) -> __m512 {
    _mm512_cvtepi32_ps(_mm512_load_si512(sums[p].0[i].as_ptr() as *const _))
}

/// Unit `u`'s products for the 16 inputs whose blocks open at `q`
/// (`stride` bytes apart), into `sums`.
#[inline(always)]
unsafe fn products<const HALVES: bool, const TWO: bool>(
    u: &Unit,
    q: *const u8,
    stride: usize,
    sums: &mut [Sums],
) {
    if HALVES {
        let [s0, s1, s2, s3] = sums else {
            unreachable!("four parts")
        };
        load!("2", u.w.as_ptr(), 64usize);
        load!("3", u.w.as_ptr().add(256), 64usize);
        load!("0", q, stride);
        load!("1", q.add(16), stride);
        product!("4", "0", "2");
        product!("5", "1", "3");
        store!("4", s0);
        store!("5", s1);
        if TWO {
            load!("0", q.add(32), stride);
            load!("1", q.add(48), stride);
            product!("6", "0", "2");
            product!("7", "1", "3");
            store!("6", s2);
            store!("7", s3);
        }
    } else {
        let [s0, s1] = sums else {
            unreachable!("two parts")
        };
        load!("2", u.w.as_ptr(), 64usize);
        load!("0", q, stride);
        product!("3", "0", "2");
        store!("3", s0);
        if TWO {
            load!("1", q.add(32), stride);
            product!("4", "1", "2");
            store!("4", s1);
        }
    }
}

/// Sixteen inputs (`ins`: regrouped, a unit each) against the staged
/// units, with the float steps of `tile_avx512` (Q6_K's: `ktile_avx512`'s).
/// The tiles run a unit ahead of the float steps, into the other of two
/// buffers, so that the two overlap.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn run<const HALVES: bool, const MIN: bool, const TWO: bool>(
    units: &[Unit],
    ins: &[Inputs],
    sums: &mut Sums2,
    out: &mut [[f32; GROUP]; INPUTS],
) {
    let stride = 64;
    let q = |b: usize| ins[b].q.as_ptr() as *const u8;
    let mut y = [_mm512_setzero_ps(); INPUTS];
    products::<HALVES, TWO>(&units[0], q(0), stride, sums.split(HALVES, 1).1);
    for (b, u) in units.iter().enumerate() {
        let (now, next) = sums.split(HALVES, b % 2);
        if b + 1 < units.len() {
            products::<HALVES, TWO>(&units[b + 1], q(b + 1), stride, next);
        }
        let d = _mm512_load_ps(u.d.as_ptr());
        let m = _mm512_load_ps(u.m.as_ptr());
        let sc1 = _mm512_load_ps(u.sc1.as_ptr());
        // Q6_K's level: its halves' sums times their scales (`m` holds the
        // first's).
        let level = |l: usize, i: usize| {
            if HALVES {
                _mm512_fmadd_ps(
                    get(now, 2 * l + 1, i),
                    sc1,
                    _mm512_mul_ps(get(now, 2 * l, i), m),
                )
            } else {
                get(now, l, i)
            }
        };
        // The inputs' scales as vectors, each broadcast in registers: 32
        // to 48 broadcasts from memory a block cost 1.24–1.63× (Q4_0).
        let a = &ins[b];
        let d1 = _mm512_load_ps(a.d1.as_ptr());
        let d2 = _mm512_load_ps(a.d2.as_ptr());
        let xs = _mm512_load_ps(a.xsum.as_ptr());
        let lane = |v: __m512, i: usize| _mm512_permutexvar_ps(_mm512_set1_epi32(i as i32), v);
        each_input!(|i| {
            let mut s = _mm512_mul_ps(level(0, i), lane(d1, i));
            if TWO {
                s = _mm512_fmadd_ps(level(1, i), lane(d2, i), s);
            }
            y[i] = _mm512_fmadd_ps(d, s, y[i]);
            if MIN {
                y[i] = _mm512_fmadd_ps(m, lane(xs, i), y[i]);
            }
        });
    }
    for i in 0..INPUTS {
        _mm512_storeu_ps(out[i].as_mut_ptr(), y[i]);
    }
}
