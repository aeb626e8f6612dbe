//! Linear layers as integer dot products: GGML weight blocks (Q4_0, Q4_1,
//! Q5_0, Q5_1, Q8_0, and the K-quants Q4_K, Q5_K, Q6_K: see [`kquant`])
//! repacked at load into tiles of 16 interleaved rows, against
//! activations quantized per 32-value block to **two int8 levels**
//! (`x ≈ d₁·q₁ + d₂·q₂`, the second level quantizing what the first left
//! over), or to one level as an explicit opt-in ([`Activations`]).
//!
//! Two levels keep the activations within `max|x| / (4·127²) ≈ 1.6·10⁻⁵`
//! of each block's largest value (a thirtieth of an f16 rounding step),
//! while the products run on the CPU's int8 dot instructions (AVX-512
//! VNNI, AVX-VNNI, AVX2's `maddubs`, NEON's `sdot`): one AVX-512
//! instruction multiplies 64 weight bytes by 64 activation bytes, where
//! the f32 path ([`crate::matvec`]) multiplies 16 pairs.
//!
//! **One arithmetic for every row, whatever the batch.** Per (row, input)
//! and block `b`, with `w` the block's integer weights (Q4_0: `n − 8`,
//! Q5_0: `n − 16`, Q4_1 and Q5_1: `n`, Q8_0: the signed bytes), `d`/`m`
//! its scale and minimum:
//!
//! ```text
//! a₁ = Σ w·q₁,  a₂ = Σ w·q₂                 (exact in i32)
//! s  = f32(a₁)·d₁;  s = fma(f32(a₂), d₂, s)  (second level only)
//! y  = fma(d, s, y);  y = fma(m, Σx, y)      (Q4_1, Q5_1; Σx of the f32 inputs)
//! ```
//!
//! Integer sums are exact, so each instruction set may form them its own
//! way (VNNI with unsigned weights and an offset, `maddubs` with a sign
//! trick); the float steps are the same on all, one lane per row. So
//! results are the same bits across instruction sets, thread counts,
//! row splits and batch compositions (tested against [`qmatvec_slow`],
//! which reads the original GGML blocks).
//!
//! Tile layout ([`Packed`]), per group of 16 rows and per block: the 16
//! f16 scales, the 16 f16 minimums (Q4_1, Q5_1), for Q5 the fifth bits as
//! eight 64-bit masks (mask `j`, bit `4r + e`: value `4j + e` of row `r`,
//! which becomes a byte mask in one instruction), then the values with
//! four consecutive values of a row in each 32-bit lane: chunk `c` holds,
//! at byte `4r + e`, the GGML byte `4c + e` of row `r` (for 4- and 5-bit
//! blocks that byte's low nibble is value `4c + e` and its high nibble
//! value `16 + 4c + e`; Q8_0 has eight chunks of one value each). The
//! same bytes as the GGML file, moved: [`Packed::unpack`] restores them
//! exactly.

// Lane loops index several arrays in step.
#![allow(clippy::needless_range_loop)]

use std::sync::OnceLock;

use candle_core::quantized::GgmlDType;

use crate::linear::matvec::{f16_to_f32, WeightFormat, Weights};
use crate::linear::Emit;
use crate::simd::capped;
use crate::tuning::IsaCap;

/// `$body` for `$i` = 0, 1, … below `$n` (at most [`MAX_NI`]), each a
/// constant: the loop written out. (Only the x86 tiles use it.)
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_macros))]
macro_rules! unrolled {
    ($n:expr, |$i:ident| $body:block) => {{
        unrolled!(@ $n, $i, $body, 0, 1, 2, 3, 4, 5, 6, 7)
    }};
    (@ $n:expr, $i:ident, $body:block, $($k:literal),*) => {{
        $(
            if $k < $n {
                let $i: usize = $k;
                $body
            }
        )*
    }};
}

/// Calls the tile kernel `$f::<K, TWO, NI>` for a weight's kind (from
/// `[Kind const, …]`), the level count and the input count (1, 4 or 8).
macro_rules! tile_match {
    ($f:ident, ($w:expr, $g:expr, $ins:expr, $out:expr), $two:expr, $ni:expr,
     [$($k:ident $n:literal),*], $what:literal) => {
        match ($w.kind, $two, $ni) {
            $(
                (Kind::$k, false, 1) => $f::<$n, false, 1>($w, $g, $ins, $out),
                (Kind::$k, false, 4) => $f::<$n, false, 4>($w, $g, $ins, $out),
                (Kind::$k, false, _) => $f::<$n, false, MAX_NI>($w, $g, $ins, $out),
                (Kind::$k, true, 1) => $f::<$n, true, 1>($w, $g, $ins, $out),
                (Kind::$k, true, 4) => $f::<$n, true, 4>($w, $g, $ins, $out),
                (Kind::$k, true, _) => $f::<$n, true, MAX_NI>($w, $g, $ins, $out),
            )*
            _ => unreachable!($what),
        }
    };
}

/// One tile on `isa`: the kernel family `[portable, avx512, avxvnni,
/// avx2, neon]` through [`tile_match`].
macro_rules! dispatch_tiles {
    ($isa:expr, $args:tt, $two:expr, $ni:expr, $kinds:tt, $what:literal,
     [$portable:ident, $avx512:ident, $avxvnni:ident, $avx2:ident, $neon:ident]) => {
        match $isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `QIsa` values above Portable come from CPU detection
            // (AMX's few-input tiles are AVX-512's).
            QIsa::Avx512Vnni | QIsa::Amx => unsafe {
                tile_match!($avx512, $args, $two, $ni, $kinds, $what)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            QIsa::AvxVnni => unsafe { tile_match!($avxvnni, $args, $two, $ni, $kinds, $what) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            QIsa::Avx2 => unsafe { tile_match!($avx2, $args, $two, $ni, $kinds, $what) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: `NeonDot` comes from CPU detection.
            QIsa::NeonDot => unsafe { tile_match!($neon, $args, $two, $ni, $kinds, $what) },
            _ => tile_match!($portable, $args, $two, $ni, $kinds, $what),
        }
    };
}

mod kquant;

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod panel;

/// Rows per tile.
pub const GROUP: usize = 16;

/// Most inputs one tile call takes: eight where the registers hold their
/// sums (AVX-512's 32), which spreads each block's weight unpacking over
/// twice as many inputs as four; elsewhere four.
const MAX_NI: usize = 8;

/// How the activations of a quantized linear layer are represented.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activations {
    /// f32, multiplied with the dequantized weights ([`crate::matvec`]).
    F32,
    /// Two int8 levels per 32-value block (the default).
    Int8x2,
    /// One int8 level per block, as llama.cpp does (opt-in: faster, less
    /// exact).
    Int8,
}

impl Activations {
    pub fn parse(s: &str) -> Option<Activations> {
        match s {
            "f32" => Some(Activations::F32),
            "int8x2" => Some(Activations::Int8x2),
            "int8" => Some(Activations::Int8),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Activations::F32 => "f32",
            Activations::Int8x2 => "int8x2",
            Activations::Int8 => "int8",
        }
    }

    /// Integer levels per block (0 for f32).
    pub fn levels(self) -> usize {
        match self {
            Activations::F32 => 0,
            Activations::Int8x2 => 2,
            Activations::Int8 => 1,
        }
    }

    /// The process's default ([`crate::tuning::Tuning::activations`]).
    pub fn tuned() -> Activations {
        crate::tuning::get().activations
    }
}

/// Instruction sets of the integer kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum QIsa {
    Portable,
    /// NEON with the dot-product extension (`sdot`, 4 rows per register).
    NeonDot,
    /// `maddubs` + `madd` (8 rows per register).
    Avx2,
    /// AVX-VNNI's 256-bit `dpbusd`.
    AvxVnni,
    /// AVX-512 VNNI (16 rows per register).
    Avx512Vnni,
    /// AVX-512 VNNI, and AMX-INT8 tiles (16 inputs × 16 rows an
    /// instruction) for products of 16 inputs or more.
    Amx,
}

impl QIsa {
    /// Whether its tiles take [`MAX_NI`] inputs at a time (else four).
    fn wide_tiles(self) -> bool {
        self >= QIsa::Avx512Vnni
    }

    /// The best this CPU runs, capped by the tuning's instruction set (on
    /// ARM only `portable` caps).
    pub fn detect() -> QIsa {
        static ISA: OnceLock<QIsa> = OnceLock::new();
        *ISA.get_or_init(|| {
            capped(QIsa::best(), |cap| match cap {
                IsaCap::Portable => QIsa::Portable,
                IsaCap::Avx2 => QIsa::Avx2,
                IsaCap::AvxVnni => QIsa::AvxVnni,
                IsaCap::Avx512 => QIsa::Avx512Vnni,
                IsaCap::Amx => QIsa::Amx,
            })
        })
    }

    /// Every integer kernel this CPU runs: those of the f32 kernels'
    /// instruction set ([`Isa`]) and its dot-product extensions.
    pub fn available() -> Vec<QIsa> {
        #[cfg_attr(
            not(any(target_arch = "x86_64", target_arch = "aarch64")),
            allow(unused_mut)
        )]
        let mut v = vec![QIsa::Portable];
        #[cfg(target_arch = "aarch64")]
        if std::arch::is_aarch64_feature_detected!("dotprod") {
            v.push(QIsa::NeonDot);
        }
        #[cfg(target_arch = "x86_64")]
        {
            use crate::linear::matvec::Isa;
            use std::arch::is_x86_feature_detected as has;
            let base = Isa::best();
            if base >= Isa::Avx2 {
                v.push(QIsa::Avx2);
                if has!("avxvnni") {
                    v.push(QIsa::AvxVnni);
                }
                if base == Isa::Avx512 && has!("avx512vnni") {
                    v.push(QIsa::Avx512Vnni);
                    if amx::usable() {
                        v.push(QIsa::Amx);
                    }
                }
            }
        }
        v
    }

    fn best() -> QIsa {
        *QIsa::available().last().expect("portable is always there")
    }
}

/// The weight formats with an integer path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

impl Kind {
    fn of(f: WeightFormat) -> Option<Kind> {
        match f {
            WeightFormat::Q4_0 => Some(Kind::Q4_0),
            WeightFormat::Q4_1 => Some(Kind::Q4_1),
            WeightFormat::Q5_0 => Some(Kind::Q5_0),
            WeightFormat::Q5_1 => Some(Kind::Q5_1),
            WeightFormat::Q8_0 => Some(Kind::Q8_0),
            WeightFormat::Ggml(GgmlDType::Q4K) => Some(Kind::Q4K),
            WeightFormat::Ggml(GgmlDType::Q5K) => Some(Kind::Q5K),
            WeightFormat::Ggml(GgmlDType::Q6K) => Some(Kind::Q6K),
            _ => None,
        }
    }

    /// f16 planes at the start of a block: the scale, and the minimum.
    fn planes(self) -> usize {
        match self {
            Kind::Q4_1 | Kind::Q5_1 => 2,
            _ => 1,
        }
    }

    /// A minimum term (`m·Σx`).
    fn has_min(self) -> bool {
        matches!(self, Kind::Q4_1 | Kind::Q5_1 | Kind::Q4K | Kind::Q5K)
    }

    /// A K-quant (super-blocks of 256 values, see [`kquant`]).
    fn super_block(self) -> bool {
        matches!(self, Kind::Q4K | Kind::Q5K | Kind::Q6K)
    }

    /// Values per tile record: a block, or a K-quant super-block.
    fn span(self) -> usize {
        if self.super_block() {
            kquant::QK
        } else {
            32
        }
    }

    /// Bytes of one GGML K-quant super-block.
    fn k_block(self) -> usize {
        match self {
            Kind::Q4K => 144,
            Kind::Q5K => 176,
            _ => 210,
        }
    }

    /// Bits of the unsigned integer weights the kernels multiply (8 for
    /// Q8_0's bytes). Only the x86 tiles group their products by it.
    #[cfg(target_arch = "x86_64")]
    fn bits(self) -> u32 {
        match self {
            Kind::Q4_0 | Kind::Q4_1 | Kind::Q4K => 4,
            Kind::Q5_0 | Kind::Q5_1 | Kind::Q5K => 5,
            Kind::Q6K => 6,
            Kind::Q8_0 => 8,
        }
    }

    /// A fifth bit per value (`qh`, 4 bytes after the f16s).
    fn high(self) -> bool {
        matches!(self, Kind::Q5_0 | Kind::Q5_1)
    }

    /// Bytes of values (`qs`) per block.
    fn qs(self) -> usize {
        if self == Kind::Q8_0 {
            32
        } else {
            16
        }
    }

    /// Bytes of one GGML block.
    fn block(self) -> usize {
        2 * self.planes() + 4 * usize::from(self.high()) + self.qs()
    }

    /// Offset of the high-bit masks in a tile block.
    fn masks_at(self) -> usize {
        GROUP * 2 * self.planes()
    }

    /// Offset of the values in a tile block.
    fn values_at(self) -> usize {
        self.masks_at() + 64 * usize::from(self.high())
    }

    /// Bytes of one tile record (16 GGML blocks' bytes for the 32-value
    /// formats).
    fn record(self) -> usize {
        if self.super_block() {
            self.k_record()
        } else {
            GROUP * self.block()
        }
    }

    /// What the integer weights the kernels multiply (`n`, unsigned)
    /// lack from the block's signed weights: `w = n + bias`.
    fn bias(self) -> i32 {
        match self {
            Kind::Q4_0 => -8,
            Kind::Q5_0 => -16,
            _ => 0,
        }
    }
}

/// Zeroed memory for tiles: one allocation, 2 MiB-aligned and advised for
/// transparent huge pages when it is large. Decode streams every weight
/// from DRAM once per step; huge pages spare it TLB misses and let the
/// hardware prefetchers run on past 4 KiB page boundaries.
struct Arena {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

// SAFETY: the arena is plain bytes, written only before it is shared.
unsafe impl Send for Arena {}
unsafe impl Sync for Arena {}

const HUGE: usize = 2 << 20;

impl Arena {
    fn new(len: usize) -> Arena {
        // Without huge pages tuned in, the pages are the system's default.
        let huge = len >= HUGE && crate::tuning::get().huge_pages;
        let (size, align) = if huge {
            (len.div_ceil(HUGE) * HUGE, HUGE)
        } else {
            (len.max(1), 64)
        };
        let layout = std::alloc::Layout::from_size_align(size, align).expect("tile arena layout");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc(layout) };
        let Some(ptr) = std::ptr::NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        #[cfg(target_os = "linux")]
        if huge {
            // A hint only: without transparent huge pages nothing changes.
            // Given before the first write, so that the first touch of
            // each 2 MiB maps a huge page.
            // SAFETY: the range is this allocation, 2 MiB-aligned.
            unsafe { libc::madvise(raw as *mut libc::c_void, size, libc::MADV_HUGEPAGE) };
        }
        // SAFETY: the allocation holds `size` bytes.
        unsafe { std::ptr::write_bytes(raw, 0, size) };
        Arena { ptr, layout }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the allocation holds `layout.size()` initialized bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// A weight repacked into tiles of [`GROUP`] rows (see the module docs).
#[derive(Clone)]
pub struct Packed {
    kind: Kind,
    n: usize,
    k: usize,
    nb: usize,
    arena: std::sync::Arc<Arena>,
    /// This weight's bytes in the arena.
    at: usize,
    len: usize,
}

impl std::fmt::Debug for Packed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Packed")
            .field("kind", &self.kind)
            .field("n", &self.n)
            .field("k", &self.k)
            .finish()
    }
}

impl Packed {
    /// The tiles of `w`, or `None` for a format without an integer path.
    pub fn pack(w: &Weights) -> Option<Packed> {
        Packed::pack_all(&[*w]).pop().flatten()
    }

    /// The tiles of every weight that has an integer path, in one arena
    /// (so that huge pages cover them all).
    pub fn pack_all(ws: &[Weights]) -> Vec<Option<Packed>> {
        let size = |w: &Weights| {
            Kind::of(w.format).map(|k| w.n.div_ceil(GROUP) * (w.k / k.span()) * k.record())
        };
        // Each weight starts on a cache line.
        let total: usize = ws
            .iter()
            .filter_map(size)
            .map(|s| s.div_ceil(64) * 64)
            .sum();
        let arena = Arena::new(total);
        let mut at = 0;
        let mut placed = Vec::with_capacity(ws.len());
        for w in ws {
            match (Kind::of(w.format), size(w)) {
                (Some(kind), Some(len)) => {
                    // SAFETY: the arena is not shared yet, and the weights'
                    // ranges do not overlap.
                    let dst =
                        unsafe { std::slice::from_raw_parts_mut(arena.ptr.as_ptr().add(at), len) };
                    if kind.super_block() {
                        kquant::pack_into(kind, w.data, w.n, w.k / kquant::QK, dst);
                    } else {
                        pack_into(kind, w, dst);
                    }
                    placed.push(Some((kind, at, len)));
                    at += len.div_ceil(64) * 64;
                }
                _ => placed.push(None),
            }
        }
        let arena = std::sync::Arc::new(arena);
        ws.iter()
            .zip(placed)
            .map(|(w, p)| {
                let (kind, at, len) = p?;
                Some(Packed {
                    kind,
                    n: w.n,
                    k: w.k,
                    nb: w.k / 32,
                    arena: arena.clone(),
                    at,
                    len,
                })
            })
            .collect()
    }

    fn data(&self) -> &[u8] {
        &self.arena.bytes()[self.at..self.at + self.len]
    }

    /// The GGML bytes the tiles were made from.
    pub fn unpack(&self) -> Vec<u8> {
        let kind = self.kind;
        if kind.super_block() {
            return kquant::unpack(kind, self.data(), self.n, self.k / kquant::QK);
        }
        let bb = kind.block();
        let rec = kind.record();
        let (h, planes) = (2 * kind.planes(), kind.planes());
        let qs_at = h + 4 * usize::from(kind.high());
        let mut out = vec![0u8; self.n * self.nb * bb];
        for row in 0..self.n {
            let (g, r) = (row / GROUP, row % GROUP);
            for b in 0..self.nb {
                let blk = &mut out[(row * self.nb + b) * bb..(row * self.nb + b + 1) * bb];
                let tile = &self.data()[(g * self.nb + b) * rec..(g * self.nb + b + 1) * rec];
                for j in 0..planes {
                    blk[2 * j..2 * j + 2]
                        .copy_from_slice(&tile[j * 2 * GROUP + 2 * r..j * 2 * GROUP + 2 * r + 2]);
                }
                if kind.high() {
                    let masks = &tile[kind.masks_at()..kind.values_at()];
                    let mut qh = 0u32;
                    for j in 0..8 {
                        for e in 0..4 {
                            let bit = 4 * r + e;
                            qh |= u32::from(masks[8 * j + bit / 8] >> (bit % 8) & 1) << (4 * j + e);
                        }
                    }
                    blk[h..h + 4].copy_from_slice(&qh.to_le_bytes());
                }
                let vals = &tile[kind.values_at()..];
                for c in 0..kind.qs() / 4 {
                    blk[qs_at + 4 * c..qs_at + 4 * c + 4]
                        .copy_from_slice(&vals[64 * c + 4 * r..64 * c + 4 * r + 4]);
                }
            }
        }
        out
    }

    /// The tile records of group `g`.
    fn tile(&self, g: usize) -> &[u8] {
        let len = self.k / self.kind.span() * self.kind.record();
        &self.data()[g * len..(g + 1) * len]
    }
}

/// Writes `w`'s tiles into `data` (zeroed, exactly their size).
fn pack_into(kind: Kind, w: &Weights, data: &mut [u8]) {
    let bb = kind.block();
    let nb = w.k / 32;
    let groups = w.n.div_ceil(GROUP);
    let rec = kind.record();
    assert_eq!(data.len(), groups * nb * rec);
    let rb = w.row_bytes();
    let (h, planes) = (2 * kind.planes(), kind.planes());
    let qs_at = h + 4 * usize::from(kind.high());
    for row in 0..w.n {
        let (g, r) = (row / GROUP, row % GROUP);
        for b in 0..nb {
            let blk = &w.data[row * rb + b * bb..row * rb + (b + 1) * bb];
            let out = &mut data[(g * nb + b) * rec..(g * nb + b + 1) * rec];
            for j in 0..planes {
                out[j * 2 * GROUP + 2 * r..j * 2 * GROUP + 2 * r + 2]
                    .copy_from_slice(&blk[2 * j..2 * j + 2]);
            }
            if kind.high() {
                let qh = u32::from_le_bytes([blk[h], blk[h + 1], blk[h + 2], blk[h + 3]]);
                let masks = &mut out[kind.masks_at()..kind.values_at()];
                for j in 0..8 {
                    for e in 0..4 {
                        if qh >> (4 * j + e) & 1 == 1 {
                            let bit = 4 * r + e;
                            masks[8 * j + bit / 8] |= 1 << (bit % 8);
                        }
                    }
                }
            }
            let vals = &mut out[kind.values_at()..];
            for c in 0..kind.qs() / 4 {
                vals[64 * c + 4 * r..64 * c + 4 * r + 4]
                    .copy_from_slice(&blk[qs_at + 4 * c..qs_at + 4 * c + 4]);
            }
        }
    }
}

/// One 32-value block of a quantized activation row.
#[derive(Debug, Clone, Copy, Default)]
#[repr(C, align(16))]
pub struct ActBlock {
    /// `q₁` then `q₂` (zero with one level).
    q: [[i8; 32]; 2],
    /// `d₁`, `d₂`.
    d: [f32; 2],
    /// `Σq₁`, `Σq₂`.
    s: [i32; 2],
    /// The same sums over the first 16 values (Q6_K scales halves).
    h: [i32; 2],
    /// `Σx` in f32, in order.
    xsum: f32,
}

impl ActBlock {
    /// `q₁` then `q₂`, 64 bytes.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(crate) fn levels(&self) -> [i8; 64] {
        // SAFETY: `[[i8; 32]; 2]` is 64 bytes, laid out as `[i8; 64]`.
        unsafe { std::mem::transmute(self.q) }
    }

    /// The values this block stands for: `d₁·q₁ + d₂·q₂`.
    pub fn values(&self) -> [f32; 32] {
        std::array::from_fn(|j| {
            self.d[0] * f32::from(self.q[0][j]) + self.d[1] * f32::from(self.q[1][j])
        })
    }
}

/// Round to nearest, ties to even, for `|v| < 2²²` (the same on every
/// target: plain IEEE additions).
#[inline(always)]
fn round(v: f32) -> f32 {
    (v + 12_582_912.0) - 12_582_912.0
}

/// One int8 level of `v`: the scale and the values. Written as lane
/// loops over 16 so that it vectorizes; every step is exact or one IEEE
/// operation per value, so every target gives the same bits.
#[inline(always)]
fn level(v: &[f32; 32]) -> (f32, [i8; 32]) {
    let mut m = [0f32; 16];
    let mut bad = 0u32;
    for j in 0..16 {
        m[j] = v[j].abs().max(v[j + 16].abs());
        bad |= u32::from(!v[j].is_finite()) | u32::from(!v[j + 16].is_finite());
    }
    if bad != 0 {
        // Non-finite inputs make non-finite outputs, as in f32.
        return (f32::NAN, [0; 32]);
    }
    let mut amax = 0f32;
    for &x in &m {
        amax = amax.max(x);
    }
    let id = 127.0 / amax;
    if id == f32::INFINITY {
        // All zero, or so small (below 127 / f32::MAX, 3.7e-37) that the
        // inverse scale overflows: the values are taken as 0.
        return (0.0, [0; 32]);
    }
    let mut q = [0i8; 32];
    for j in 0..32 {
        q[j] = round(v[j] * id).clamp(-127.0, 127.0) as i32 as i8;
    }
    (amax / 127.0, q)
}

/// One block of `x` (see [`quantize_row`]).
#[inline(always)]
fn quantize_block(xb: &[f32; 32], levels: usize) -> ActBlock {
    let (d1, q1) = level(xb);
    // Σx by a fixed tree: pairs 16 apart, then the kernels' tree.
    let pairs: [f32; 16] = std::array::from_fn(|j| xb[j] + xb[j + 16]);
    let xsum = crate::simd::lanes::reduce16(&pairs);
    let (d2, q2) = if levels == 2 && d1.is_finite() {
        let mut r = [0f32; 32];
        for j in 0..32 {
            r[j] = xb[j] - d1 * f32::from(q1[j]);
        }
        level(&r)
    } else {
        (0.0, [0; 32])
    };
    let sum = |q: &[i8]| q.iter().map(|&v| i32::from(v)).sum::<i32>();
    ActBlock {
        q: [q1, q2],
        d: [d1, d2],
        s: [sum(&q1), sum(&q2)],
        h: [sum(&q1[..16]), sum(&q2[..16])],
        xsum,
    }
}

#[inline(always)]
fn quantize_blocks(x: &[f32], levels: usize, out: &mut [ActBlock]) {
    for (xb, o) in x.chunks_exact(32).zip(out.iter_mut()) {
        *o = quantize_block(xb.try_into().expect("32 values"), levels);
    }
}

/// Quantizes one activation row (`x.len()` a multiple of 32) to `levels`
/// (1 or 2) int8 levels per block.
pub fn quantize_row(x: &[f32], levels: usize, out: &mut [ActBlock]) {
    quantize_row_on(QIsa::detect(), x, levels, out)
}

fn quantize_row_on(isa: QIsa, x: &[f32], levels: usize, out: &mut [ActBlock]) {
    assert!(x.len().is_multiple_of(32) && out.len() >= x.len() / 32 && (1..=2).contains(&levels));
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `QIsa` values above Portable come from CPU detection.
        QIsa::Avx512Vnni | QIsa::Amx => unsafe { quantize_avx512(x, levels, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        QIsa::Avx2 | QIsa::AvxVnni => unsafe { quantize_avx2(x, levels, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: every aarch64 CPU has NEON.
        QIsa::NeonDot => unsafe { quantize_neon(x, levels, out) },
        _ => quantize_blocks(x, levels, out),
    }
}

/// The signed integer weights of one GGML block, its scale and minimum
/// (reference decoding, straight from the GGML layout).
fn block_ints(kind: Kind, blk: &[u8]) -> (f32, f32, [i32; 32]) {
    let f16 = |at: usize| f16_to_f32(u16::from_le_bytes([blk[at], blk[at + 1]]));
    let d = f16(0);
    let m = if kind.has_min() { f16(2) } else { 0.0 };
    let mut w = [0i32; 32];
    let h = 2 * kind.planes();
    match kind {
        Kind::Q8_0 => {
            for j in 0..32 {
                w[j] = i32::from(blk[2 + j] as i8);
            }
        }
        _ => {
            let (qh, qs) = if kind.high() {
                let qh = u32::from_le_bytes([blk[h], blk[h + 1], blk[h + 2], blk[h + 3]]);
                (qh, h + 4)
            } else {
                (0, h)
            };
            for j in 0..16 {
                let hi = |v: usize| ((qh >> v & 1) << 4) as i32;
                w[j] = i32::from(blk[qs + j] & 0x0F) + hi(j) + kind.bias();
                w[j + 16] = i32::from(blk[qs + j] >> 4) + hi(j + 16) + kind.bias();
            }
        }
    }
    (d, m, w)
}

/// The float steps of one block (the module docs' formula).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn combine(min: bool, two: bool, a1: i32, a2: i32, a: &ActBlock, d: f32, m: f32, y: f32) -> f32 {
    let mut s = a1 as f32 * a.d[0];
    if two {
        s = (a2 as f32).mul_add(a.d[1], s);
    }
    let mut y = d.mul_add(s, y);
    if min {
        y = m.mul_add(a.xsum, y);
    }
    y
}

/// The reference: the original GGML rows of `w` against `t` quantized
/// inputs (`acts`: `t` rows of `k / 32` blocks), in plain scalar code.
/// `out[i * n + r]`.
pub fn qmatvec_slow(w: &Weights, acts: &[ActBlock], t: usize, levels: usize) -> Vec<f32> {
    let kind = Kind::of(w.format).expect("a format with an integer path");
    let bb = kind.block();
    let nb = w.k / 32;
    let rb = w.row_bytes();
    let mut out = vec![0f32; t * w.n];
    for r in 0..w.n {
        for i in 0..t {
            if kind.super_block() {
                let row = &w.data[r * rb..(r + 1) * rb];
                let a = &acts[i * nb..(i + 1) * nb];
                out[i * w.n + r] = kquant::row_slow(kind, row, a, levels == 2);
                continue;
            }
            let mut y = 0f32;
            for b in 0..nb {
                let (d, m, wi) = block_ints(kind, &w.data[r * rb + b * bb..r * rb + (b + 1) * bb]);
                let a = &acts[i * nb + b];
                let (mut a1, mut a2) = (0i32, 0i32);
                for j in 0..32 {
                    a1 += wi[j] * i32::from(a.q[0][j]);
                    a2 += wi[j] * i32::from(a.q[1][j]);
                }
                y = combine(kind.has_min(), levels == 2, a1, a2, a, d, m, y);
            }
            out[i * w.n + r] = y;
        }
    }
    out
}

/// Inputs per panel of a many-input product (kept in L2 across tiles).
const PANEL: usize = 64;

/// Rows `[r0, r1)` of `w` times each of the `t` quantized inputs in `acts`
/// (`t` rows of `k / 32` blocks, quantized with `levels` levels):
/// `emit(input, row, values)` with the values of rows `row..row +
/// values.len()` (up to one tile's sixteen), each pair once.
#[allow(clippy::too_many_arguments)]
pub fn qmatvec(
    isa: QIsa,
    w: &Packed,
    acts: &[ActBlock],
    t: usize,
    levels: usize,
    r0: usize,
    r1: usize,
    emit: &mut Emit,
) {
    qmatvec_keyed(isa, w, acts, None, t, levels, r0, r1, emit)
}

/// Names the contents of a batch of quantized inputs for the products
/// that share it ([`qmatvec_keyed`]): a fresh key each time the inputs are
/// written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActsKey(std::num::NonZeroU64);

impl ActsKey {
    /// A key no other call of this process has had.
    pub fn fresh() -> ActsKey {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        ActsKey(std::num::NonZeroU64::new(k).expect("fewer than 2^64 keys"))
    }
}

/// [`qmatvec`] for inputs named by `key`: what is done to the inputs
/// themselves (AMX's regrouping of a prompt chunk's inputs, the same work
/// for every row range) is done once per thread for all the calls with
/// the same key, such as a layer's row ranges taken head by head. Every
/// call with a key must pass the same inputs (values, `t`, width) as the
/// calls before it with that key on the same thread; the results are then
/// the same bits as without one.
#[allow(clippy::too_many_arguments)]
pub fn qmatvec_keyed(
    isa: QIsa,
    w: &Packed,
    acts: &[ActBlock],
    key: Option<ActsKey>,
    t: usize,
    levels: usize,
    r0: usize,
    r1: usize,
    emit: &mut Emit,
) {
    assert!(
        acts.len() >= t * w.nb && r0 <= r1 && r1 <= w.n && (1..=2).contains(&levels),
        "qmatvec: bad shapes"
    );
    // AVX2 or AVX-VNNI with a prompt chunk at two levels: weights
    // unpacked once per panel (see `panel`). One level keeps the tiles:
    // on the panels the `--activations int8` prefill of a 1B model (Zen 4
    // forced to AVX2) fell from 113–117 tok/s to 75–101 (Q4_0), the
    // unpacking and float steps not halving with the products.
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, QIsa::Avx2 | QIsa::AvxVnni)
        && levels == 2
        && t >= panel::MIN_INPUTS
        && w.kind != Kind::Q8_0
    {
        // SAFETY: `QIsa::Avx2` and `QIsa::AvxVnni` come from CPU detection
        // (AVX2, FMA, F16C; AVX-VNNI).
        unsafe {
            if isa == QIsa::AvxVnni {
                panel::products_avxvnni(w, acts, t, levels == 2, r0, r1, emit)
            } else {
                panel::products(w, acts, t, levels == 2, r0, r1, emit)
            }
        };
        return;
    }
    let nb = w.nb;
    let mut out = [[0f32; GROUP]; MAX_NI];
    let wide = if isa.wide_tiles() { MAX_NI } else { 4 };
    let tiles = |g: usize, i0: usize, ni: usize, out: &mut [[f32; GROUP]; MAX_NI]| {
        let ins: [&[ActBlock]; MAX_NI] = std::array::from_fn(|j| {
            &acts[(i0 + j.min(ni - 1)) * nb..(i0 + j.min(ni - 1) + 1) * nb]
        });
        run_tile(isa, w, g, &ins, ni, levels == 2, out);
    };
    let (g0, g1) = (r0 / GROUP, r1.div_ceil(GROUP));
    #[cfg(target_arch = "x86_64")]
    let amx = isa == QIsa::Amx && t >= amx::INPUTS;
    #[cfg(target_arch = "x86_64")]
    if amx {
        // SAFETY: `QIsa::Amx` comes from CPU detection.
        unsafe { amx::configure(w) };
    }
    // AMX: a keyed batch regrouped once, whole (`Some`), or panel by panel.
    #[cfg(target_arch = "x86_64")]
    let whole = if amx {
        amx::prepare(acts, t, nb, key)
    } else {
        None
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = key;
    #[cfg(target_arch = "x86_64")]
    let panel = if amx { amx::panel(nb) } else { PANEL };
    #[cfg(not(target_arch = "x86_64"))]
    let panel = PANEL;
    for p0 in (0..t).step_by(panel) {
        let p1 = (p0 + panel).min(t);
        // AMX's tiles take the panel's inputs 16 at a time, regrouped once
        // for all its row groups; the rest go to AVX-512's.
        #[cfg(target_arch = "x86_64")]
        let (amx_inputs, c0) = match whole {
            Some(full) => (full.min(p1).saturating_sub(p0), p0 / amx::INPUTS),
            None if amx => (amx::regroup(&acts[p0 * nb..p1 * nb], p1 - p0, nb), 0),
            None => (0, 0),
        };
        #[cfg(not(target_arch = "x86_64"))]
        let amx_inputs = 0;
        for g in g0..g1 {
            let mut i = p0 + amx_inputs;
            #[cfg(target_arch = "x86_64")]
            if amx_inputs > 0 {
                let base = g * GROUP;
                let (lo, hi) = (r0.max(base), r1.min(base + GROUP));
                // SAFETY: `QIsa::Amx` comes from CPU detection, and the
                // tiles are configured for `w`.
                unsafe {
                    let chunks = (c0, c0 + amx_inputs / amx::INPUTS);
                    amx::tiles(w, g, levels == 2, chunks, &mut |di, o| {
                        emit(p0 + di, lo, &o[lo - base..hi - base])
                    })
                };
            }
            while i < p1 {
                let ni = match p1 - i {
                    n if n >= wide => wide,
                    n if n >= 4 => 4,
                    _ => 1,
                };
                tiles(g, i, ni, &mut out);
                let base = g * GROUP;
                let (lo, hi) = (r0.max(base), r1.min(base + GROUP));
                for (di, o) in out[..ni].iter().enumerate() {
                    emit(i + di, lo, &o[lo - base..hi - base]);
                }
                i += ni;
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    if amx {
        // SAFETY: as above.
        unsafe { amx::release() };
    }
}

/// Whether this CPU runs the AVX-VNNI code in AVX-512 VNNI's encoding
/// (the features `panel::products_vnni_evex` and `x86::tile_vnni_evex`
/// enable).
#[cfg(target_arch = "x86_64")]
fn vnni_evex_runs() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512vnni")
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

/// The AVX-VNNI panels' code (the prompt chunks' products on an AVX-VNNI
/// CPU, `t ≥ 16` inputs and every kind but Q8_0) in AVX-512 VNNI's
/// encoding of the same 256-bit `vpdpbusd`, on a CPU with AVX-512 F, VL
/// and VNNI: for the every-path test and `examples/prefill_tiles` where
/// AVX-VNNI itself is missing (AMD Zen 4). `None` where it cannot run.
// Inline: compiled only where a test or an example calls it.
#[inline]
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub fn qmatvec_vnni_evex_panels(
    w: &Packed,
    acts: &[ActBlock],
    t: usize,
    levels: usize,
    r0: usize,
    r1: usize,
    emit: &mut Emit,
) -> Option<()> {
    if !vnni_evex_runs() || t < panel::MIN_INPUTS || w.kind == Kind::Q8_0 {
        return None;
    }
    assert!(
        acts.len() >= t * w.nb && r0 <= r1 && r1 <= w.n && (1..=2).contains(&levels),
        "qmatvec: bad shapes"
    );
    // SAFETY: the features were detected above.
    unsafe { panel::products_vnni_evex(w, acts, t, levels == 2, r0, r1, emit) };
    Some(())
}

/// The AVX-VNNI tiles of the 32-value block formats (but Q8_0) in AVX-512
/// VNNI's encoding, four inputs at a time, all rows: what
/// [`qmatvec_vnni_evex_panels`] is timed against in
/// `examples/prefill_tiles`. `None` where it cannot run.
// Inline: compiled only where a test or an example calls it.
#[inline]
#[cfg(target_arch = "x86_64")]
pub fn qmatvec_vnni_evex_tiles(
    w: &Packed,
    acts: &[ActBlock],
    t: usize,
    levels: usize,
    emit: &mut Emit,
) -> Option<()> {
    if !vnni_evex_runs() || w.kind.super_block() || w.kind == Kind::Q8_0 {
        return None;
    }
    assert!(
        acts.len() >= t * w.nb && (1..=2).contains(&levels),
        "qmatvec: bad shapes"
    );
    let nb = w.nb;
    let mut out = [[0f32; GROUP]; MAX_NI];
    for g in 0..w.n.div_ceil(GROUP) {
        let mut i = 0;
        while i < t {
            let ni = if t - i >= 4 { 4 } else { 1 };
            let ins: [&[ActBlock]; MAX_NI] = std::array::from_fn(|j| {
                let at = i + j.min(ni - 1);
                &acts[at * nb..(at + 1) * nb]
            });
            // SAFETY: the features were detected above.
            unsafe {
                tile_match!(
                    tile_vnni_evex,
                    (w, g, &ins, &mut out),
                    levels == 2,
                    ni,
                    [Q4_0 0, Q4_1 1, Q5_0 3, Q5_1 4],
                    "a 32-value block format"
                )
            };
            let (lo, hi) = (g * GROUP, ((g + 1) * GROUP).min(w.n));
            for (di, o) in out[..ni].iter().enumerate() {
                emit(i + di, lo, &o[..hi - lo]);
            }
            i += ni;
        }
    }
    Some(())
}

/// One tile (16 rows of group `g`) against `ni` (1, 4 or, on AVX-512, 8) inputs.
fn run_tile(
    isa: QIsa,
    w: &Packed,
    g: usize,
    ins: &[&[ActBlock]; MAX_NI],
    ni: usize,
    two: bool,
    out: &mut [[f32; GROUP]; MAX_NI],
) {
    if w.kind.super_block() {
        return kquant::run_ktile(isa, w, g, ins, ni, two, out);
    }
    dispatch_tiles!(
        isa,
        (w, g, ins, out),
        two,
        ni,
        [Q4_0 0, Q4_1 1, Q8_0 2, Q5_0 3, Q5_1 4],
        "a 32-value block format",
        [tile_portable, tile_avx512, tile_avxvnni, tile_avx2, tile_neon]
    )
}

const fn kind_of(k: u8) -> Kind {
    match k {
        0 => Kind::Q4_0,
        1 => Kind::Q4_1,
        2 => Kind::Q8_0,
        3 => Kind::Q5_0,
        4 => Kind::Q5_1,
        5 => Kind::Q4K,
        6 => Kind::Q5K,
        _ => Kind::Q6K,
    }
}

/// Scalar tiles: the same integer sums and float steps as the reference,
/// read from the tile layout.
fn tile_portable<const K: u8, const TWO: bool, const NI: usize>(
    w: &Packed,
    g: usize,
    ins: &[&[ActBlock]; MAX_NI],
    out: &mut [[f32; GROUP]; MAX_NI],
) {
    let kind = kind_of(K);
    let rec = kind.record();
    let tile = w.tile(g);
    let mut y = [[0f32; GROUP]; NI];
    for b in 0..w.nb {
        let t = &tile[b * rec..(b + 1) * rec];
        let masks = &t[kind.masks_at()..kind.values_at()];
        let vals = &t[kind.values_at()..];
        // The fifth bit of value `4j + e` of row `r` (0 without one).
        let hi = |r: usize, j: usize, e: usize| -> i32 {
            if kind.high() {
                let bit = 4 * r + e;
                i32::from(masks[8 * j + bit / 8] >> (bit % 8) & 1) << 4
            } else {
                0
            }
        };
        let mut wi = [[0i32; 32]; GROUP];
        let mut d = [0f32; GROUP];
        let mut m = [0f32; GROUP];
        for r in 0..GROUP {
            d[r] = f16_to_f32(u16::from_le_bytes([t[2 * r], t[2 * r + 1]]));
            if kind.has_min() {
                m[r] = f16_to_f32(u16::from_le_bytes([t[32 + 2 * r], t[33 + 2 * r]]));
            }
            for c in 0..kind.qs() / 4 {
                for e in 0..4 {
                    let byte = vals[64 * c + 4 * r + e];
                    match kind {
                        Kind::Q8_0 => wi[r][4 * c + e] = i32::from(byte as i8),
                        _ => {
                            let bias = kind.bias();
                            wi[r][4 * c + e] = i32::from(byte & 0x0F) + hi(r, c, e) + bias;
                            wi[r][16 + 4 * c + e] = i32::from(byte >> 4) + hi(r, c + 4, e) + bias;
                        }
                    }
                }
            }
        }
        for i in 0..NI {
            let a = &ins[i][b];
            for r in 0..GROUP {
                let (mut a1, mut a2) = (0i32, 0i32);
                for j in 0..32 {
                    a1 += wi[r][j] * i32::from(a.q[0][j]);
                }
                if TWO {
                    for j in 0..32 {
                        a2 += wi[r][j] * i32::from(a.q[1][j]);
                    }
                }
                y[i][r] = combine(kind.has_min(), TWO, a1, a2, a, d[r], m[r], y[i][r]);
            }
        }
    }
    out[..NI].copy_from_slice(&y);
}

#[cfg(target_arch = "x86_64")]
use x86::{quantize_avx2, quantize_avx512, tile_avx2, tile_avx512, tile_avxvnni, tile_vnni_evex};

#[cfg(target_arch = "aarch64")]
use arm::{quantize_neon, tile_neon};

#[cfg(target_arch = "aarch64")]
mod arm {
    use std::arch::aarch64::*;
    use std::arch::asm;

    use super::{kind_of, ActBlock, Kind, Packed, GROUP, MAX_NI};

    /// `acc` plus, per 32-bit lane, the dot product of four signed bytes
    /// of `w` and `q` (`sdot`; its intrinsic is not stable yet).
    #[inline(always)]
    pub(super) unsafe fn sdot(acc: int32x4_t, w: int8x16_t, q: int8x16_t) -> int32x4_t {
        let mut acc = acc;
        asm!(
            "sdot {0:v}.4s, {1:v}.16b, {2:v}.16b",
            inout(vreg) acc,
            in(vreg) w,
            in(vreg) q,
            options(pure, nomem, nostack, preserves_flags)
        );
        acc
    }

    /// Four f16 at `p` as f32 (`fcvtl`, exact).
    #[inline(always)]
    pub(super) unsafe fn f16x4(p: *const u8) -> float32x4_t {
        let h = vld1_u16(p as *const u16);
        let out: float32x4_t;
        asm!(
            "fcvtl {0:v}.4s, {1:v}.4h",
            out(vreg) out,
            in(vreg) h,
            options(pure, nomem, nostack, preserves_flags)
        );
        out
    }

    /// `q[4j..4j + 4]` in every lane.
    #[inline(always)]
    pub(super) unsafe fn quad(q: &[i8; 32], j: usize) -> int8x16_t {
        let v = (q.as_ptr() as *const i32).add(j).read_unaligned();
        vreinterpretq_s8_s32(vdupq_n_s32(v))
    }

    /// `0x10` in byte `i` where bit `i` of `k` is set.
    #[inline(always)]
    pub(super) unsafe fn fifth_bits(k: u16) -> int8x16_t {
        const SPREAD: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1];
        const BITS: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
        let v = vqtbl1q_u8(
            vreinterpretq_u8_u16(vdupq_n_u16(k)),
            vld1q_u8(SPREAD.as_ptr()),
        );
        let set = vtstq_u8(v, vld1q_u8(BITS.as_ptr()));
        vreinterpretq_s8_u8(vandq_u8(set, vdupq_n_u8(0x10)))
    }

    /// The low nibbles (values `4c + e`) and high nibbles (`16 + 4c + e`)
    /// of 16 bytes.
    #[inline(always)]
    pub(super) unsafe fn nibbles(p: *const u8) -> (int8x16_t, int8x16_t) {
        let raw = vld1q_u8(p);
        (
            vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(0x0F))),
            vreinterpretq_s8_u8(vshrq_n_u8::<4>(raw)),
        )
    }

    /// One level of 32 values in eight registers (the steps of
    /// `super::level`): the scale and the i32 values, or `None` when a
    /// value is not finite.
    #[inline(always)]
    unsafe fn level_neon(v: &[float32x4_t; 8]) -> Option<(f32, [int32x4_t; 8])> {
        let zero = vdupq_n_f32(0.0);
        let mut finite = vdupq_n_u32(u32::MAX);
        let mut m = zero;
        for r in v {
            // x − x is 0 exactly when x is finite.
            finite = vandq_u32(finite, vceqq_f32(vsubq_f32(*r, *r), zero));
            m = vmaxq_f32(m, vabsq_f32(*r));
        }
        if vminvq_u32(finite) == 0 {
            return None;
        }
        let amax = vmaxvq_f32(m);
        let id = 127.0 / amax;
        if id == f32::INFINITY {
            return Some((0.0, [vdupq_n_s32(0); 8]));
        }
        let magic = vdupq_n_f32(12_582_912.0);
        let (top, bottom) = (vdupq_n_s32(127), vdupq_n_s32(-127));
        let mut q = [vdupq_n_s32(0); 8];
        for k in 0..8 {
            // A product, then the rounding sum: no fused step, as in
            // `super::round`.
            let r = vsubq_f32(vaddq_f32(vmulq_n_f32(v[k], id), magic), magic);
            q[k] = vmaxq_s32(vminq_s32(vcvtq_s32_f32(r), top), bottom);
        }
        Some((amax / 127.0, q))
    }

    /// Stores one level's 32 integers as bytes into `q`: `(Σq, Σ of the
    /// first sixteen)`.
    #[inline(always)]
    unsafe fn store_neon(q: &mut [i8; 32], v: &[int32x4_t; 8]) -> (i32, i32) {
        for h in 0..2 {
            let w = |k: usize| vcombine_s16(vqmovn_s32(v[k]), vqmovn_s32(v[k + 1]));
            let b = vcombine_s8(vqmovn_s16(w(4 * h)), vqmovn_s16(w(4 * h + 2)));
            vst1q_s8(q.as_mut_ptr().add(16 * h), b);
        }
        let half = |h: usize| {
            vaddvq_s32(vaddq_s32(
                vaddq_s32(v[4 * h], v[4 * h + 1]),
                vaddq_s32(v[4 * h + 2], v[4 * h + 3]),
            ))
        };
        let first = half(0);
        (first + half(1), first)
    }

    /// `super::quantize_blocks` in NEON, a block at a time: the same
    /// operations, so the same bits.
    ///
    /// # Safety
    /// The CPU has NEON (every aarch64 CPU Rust targets).
    #[target_feature(enable = "neon")]
    pub(super) unsafe fn quantize_neon(x: &[f32], levels: usize, out: &mut [ActBlock]) {
        for (xb, o) in x.chunks_exact(32).zip(out.iter_mut()) {
            let p = xb.as_ptr();
            let mut v = [vdupq_n_f32(0.0); 8];
            for (k, r) in v.iter_mut().enumerate() {
                *r = vld1q_f32(p.add(4 * k));
            }
            // Σx by `quantize_block`'s tree: pairs 16 apart, then
            // `reduce16`'s halvings (8 apart, 4 apart, then lanes 0 + 2
            // and 1 + 3, and those two).
            let pairs = [
                vaddq_f32(v[0], v[4]),
                vaddq_f32(v[1], v[5]),
                vaddq_f32(v[2], v[6]),
                vaddq_f32(v[3], v[7]),
            ];
            let v4 = vaddq_f32(vaddq_f32(pairs[0], pairs[2]), vaddq_f32(pairs[1], pairs[3]));
            let v2 = vadd_f32(vget_low_f32(v4), vget_high_f32(v4));
            let xsum = vget_lane_f32::<0>(v2) + vget_lane_f32::<1>(v2);
            let mut blk = ActBlock {
                xsum,
                ..ActBlock::default()
            };
            let Some((d1, q1)) = level_neon(&v) else {
                blk.d = [f32::NAN, 0.0];
                *o = blk;
                continue;
            };
            blk.d[0] = d1;
            (blk.s[0], blk.h[0]) = store_neon(&mut blk.q[0], &q1);
            if levels == 2 {
                let mut r = v;
                for k in 0..8 {
                    r[k] = vsubq_f32(v[k], vmulq_n_f32(vcvtq_f32_s32(q1[k]), d1));
                }
                let (d2, q2) = level_neon(&r).expect("finite residuals of finite values");
                blk.d[1] = d2;
                (blk.s[1], blk.h[1]) = store_neon(&mut blk.q[1], &q2);
            }
            *o = blk;
        }
    }

    /// The float steps of one block for 4 rows.
    #[inline(always)]
    pub(super) unsafe fn steps<const TWO: bool>(
        a: &ActBlock,
        a1: int32x4_t,
        a2: int32x4_t,
        d: float32x4_t,
        m: Option<float32x4_t>,
        y: float32x4_t,
    ) -> float32x4_t {
        let mut s = vmulq_n_f32(vcvtq_f32_s32(a1), a.d[0]);
        if TWO {
            s = vfmaq_n_f32(s, vcvtq_f32_s32(a2), a.d[1]);
        }
        let mut y = vfmaq_f32(y, d, s);
        if let Some(m) = m {
            y = vfmaq_f32(y, m, vdupq_n_f32(a.xsum));
        }
        y
    }

    /// Four passes of 4 rows. The weights are signed bytes to `sdot`
    /// (4- and 5-bit values fit), so only Q4_0 and Q5_0 need an offset.
    ///
    /// # Safety
    /// The CPU has NEON and the dot-product extension.
    #[target_feature(enable = "neon,dotprod")]
    pub(super) unsafe fn tile_neon<const K: u8, const TWO: bool, const NI: usize>(
        w: &Packed,
        g: usize,
        ins: &[&[ActBlock]; MAX_NI],
        out: &mut [[f32; GROUP]; MAX_NI],
    ) {
        let kind = kind_of(K);
        let rec = kind.record();
        let p = w.tile(g).as_ptr();
        for quarter in 0..4 {
            let mut y = [vdupq_n_f32(0.0); NI];
            for b in 0..w.nb {
                let t = p.add(b * rec);
                let d = f16x4(t.add(8 * quarter));
                let m = kind.has_min().then(|| f16x4(t.add(32 + 8 * quarter)));
                let vals = t.add(kind.values_at() + 16 * quarter);
                let mut wv = [vdupq_n_s8(0); 8];
                if kind == Kind::Q8_0 {
                    for j in 0..8 {
                        wv[j] = vld1q_s8(vals.add(64 * j) as *const i8);
                    }
                } else {
                    for c in 0..4 {
                        (wv[c], wv[c + 4]) = nibbles(vals.add(64 * c));
                    }
                    if kind.high() {
                        let masks = t.add(kind.masks_at()) as *const u64;
                        for j in 0..8 {
                            let k = (masks.add(j).read_unaligned() >> (16 * quarter)) as u16;
                            wv[j] = vorrq_s8(wv[j], fifth_bits(k));
                        }
                    }
                }
                for i in 0..NI {
                    let a: &ActBlock = &ins[i][b];
                    let level = |l: usize| {
                        let mut acc = vdupq_n_s32(kind.bias() * a.s[l]);
                        for j in 0..8 {
                            acc = sdot(acc, wv[j], quad(&a.q[l], j));
                        }
                        acc
                    };
                    let a1 = level(0);
                    let a2 = if TWO { level(1) } else { a1 };
                    y[i] = steps::<TWO>(a, a1, a2, d, m, y[i]);
                }
            }
            for i in 0..NI {
                vst1q_f32(out[i].as_mut_ptr().add(4 * quarter), y[i]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{kind_of, ActBlock, Kind, Packed, GROUP, MAX_NI};
    use crate::simd::lanes::x86::{reduce8, Across16};

    /// One level of 32 values in two registers (the steps of
    /// `super::level`, vectorized): the scale and the i32 values, or
    /// `None` when a value is not finite.
    #[inline(always)]
    unsafe fn level512(lo: __m512, hi: __m512) -> Option<(f32, __m512i, __m512i)> {
        if finite(lo, hi) != 0xFFFF {
            return None;
        }
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        let id = 127.0 / amax;
        if id == f32::INFINITY {
            let z = _mm512_setzero_si512();
            return Some((0.0, z, z));
        }
        let id = _mm512_set1_ps(id);
        Some((amax / 127.0, round_ints(lo, id), round_ints(hi, id)))
    }

    /// The lanes of `lo` and `hi` (one bit each) whose values are finite.
    #[inline(always)]
    unsafe fn finite(lo: __m512, hi: __m512) -> u16 {
        let zero = _mm512_setzero_ps();
        // x − x is 0 exactly when x is finite.
        _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_sub_ps(lo, lo), zero)
            & _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_sub_ps(hi, hi), zero)
    }

    /// `super::quantize_blocks` in AVX-512: the same operations, so the
    /// same bits. Sixteen blocks at a time: their horizontal maxima and
    /// sums formed together, lane `b` for block `b` (one transposing tree
    /// instead of sixteen), and their scales in one division each; a group
    /// with a value that is not finite goes block by block.
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(super) unsafe fn quantize_avx512(x: &[f32], levels: usize, out: &mut [ActBlock]) {
        for (xg, og) in x.chunks(16 * 32).zip(out.chunks_mut(16)) {
            // A few blocks cost less one by one than one transposing tree.
            if xg.len() < FEW * 32 || !quantize16(xg, levels, og) {
                quantize_one_by_one(xg, levels, og);
            }
        }
    }

    /// Blocks from which [`quantize16`] takes a group.
    const FEW: usize = 4;

    /// Lane-wise i32 sum of two registers holding i32 lanes.
    #[inline(always)]
    unsafe fn add_i32(a: __m512, b: __m512) -> __m512 {
        _mm512_castsi512_ps(_mm512_add_epi32(
            _mm512_castps_si512(a),
            _mm512_castps_si512(b),
        ))
    }

    /// One level's integers of sixteen blocks as they come: stored, and
    /// their sums (the whole block's, the first half's) folded, lane `b`
    /// for block `b`.
    struct IntSums {
        tot: Across16,
        first: Across16,
        s: __m512,
        h: __m512,
    }

    impl IntSums {
        #[inline(always)]
        unsafe fn new() -> Self {
            let z = _mm512_setzero_ps();
            IntSums {
                tot: Across16::new(),
                first: Across16::new(),
                s: z,
                h: z,
            }
        }

        /// Block `b`'s integers (two registers of sixteen), stored into
        /// `q` when the block is one of the row's.
        #[inline(always)]
        unsafe fn take(
            &mut self,
            b: usize,
            (ql, qh): (__m512i, __m512i),
            q: Option<&mut [i8; 32]>,
        ) {
            if let Some(q) = q {
                let dst = q.as_mut_ptr() as *mut __m128i;
                _mm_storeu_si128(dst, _mm512_cvtepi32_epi8(ql));
                _mm_storeu_si128(dst.add(1), _mm512_cvtepi32_epi8(qh));
            }
            let l = _mm512_castsi512_ps(ql);
            let t = add_i32(l, _mm512_castsi512_ps(qh));
            if let Some(v) = self.tot.push(b, t, |a, b| add_i32(a, b)) {
                self.s = v;
            }
            if let Some(v) = self.first.push(b, l, |a, b| add_i32(a, b)) {
                self.h = v;
            }
        }

        /// Block `b`'s sums `(Σq, Σ of the first sixteen)`.
        #[inline(always)]
        unsafe fn sums(&self, b: usize) -> (i32, i32) {
            (
                lane(self.s, b).to_bits() as i32,
                lane(self.h, b).to_bits() as i32,
            )
        }
    }

    /// Lane `b` of `v` in every lane.
    #[inline(always)]
    unsafe fn splat_lane(v: __m512, b: usize) -> __m512 {
        _mm512_permutexvar_ps(_mm512_set1_epi32(b as i32), v)
    }

    /// Lane `b` of `v`.
    #[inline(always)]
    unsafe fn lane(v: __m512, b: usize) -> f32 {
        _mm512_cvtss_f32(splat_lane(v, b))
    }

    /// One level's scales of sixteen blocks from their largest magnitudes
    /// (lane `b` for block `b`): `(amax / 127, 127 / amax)`, both 0 for a
    /// block whose inverse overflows (all zero, or below 3.7e-37: its
    /// values all become 0, as `super::level` takes them).
    #[inline(always)]
    unsafe fn scales(amax: __m512) -> (__m512, __m512) {
        let (zero, c127) = (_mm512_setzero_ps(), _mm512_set1_ps(127.0));
        let inv = _mm512_div_ps(c127, amax);
        let zeros = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(inv, _mm512_set1_ps(f32::INFINITY));
        (
            _mm512_mask_blend_ps(zeros, _mm512_div_ps(amax, c127), zero),
            _mm512_mask_blend_ps(zeros, inv, zero),
        )
    }

    /// The integers of `v` at the inverse scale `id`: rounded to nearest
    /// (ties to even, by the magic constant), clamped to ±127.
    #[inline(always)]
    unsafe fn round_ints(v: __m512, id: __m512) -> __m512i {
        let magic = _mm512_set1_ps(12_582_912.0);
        let r = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v, id), magic), magic);
        let (top, bottom) = (_mm512_set1_epi32(127), _mm512_set1_epi32(-127));
        _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(r), top), bottom)
    }

    /// `v − d·q`, as `quantize_block` forms the residual.
    #[inline(always)]
    unsafe fn residual(v: __m512, d: __m512, q: __m512i) -> __m512 {
        _mm512_sub_ps(v, _mm512_mul_ps(d, _mm512_cvtepi32_ps(q)))
    }

    /// Up to sixteen blocks of `x` (`out.len()` of them) quantized as
    /// [`quantize_one_by_one`] does, or `false` (nothing written) when a
    /// value is not finite. Everything stays in registers: the second
    /// level's residuals are formed again from the inputs (the same
    /// operations, so the same values) rather than kept.
    #[inline(always)]
    unsafe fn quantize16(x: &[f32], levels: usize, out: &mut [ActBlock]) -> bool {
        let n = out.len().min(x.len() / 32);
        let out = &mut out[..n];
        let zero = _mm512_setzero_ps();
        let load = |b: usize| {
            if b < n {
                let p = x.as_ptr().add(32 * b);
                (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)))
            } else {
                (zero, zero)
            }
        };
        let absmax = |lo: __m512, hi: __m512| _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi));
        let (add, max) = (
            |a: __m512, b: __m512| _mm512_add_ps(a, b),
            |a: __m512, b: __m512| _mm512_max_ps(a, b),
        );
        let (mut sums, mut maxima) = (Across16::new(), Across16::new());
        let (mut xsum, mut amax) = (zero, zero);
        let mut all_finite = 0xFFFFu16;
        for b in 0..16 {
            let (lo, hi) = load(b);
            all_finite &= finite(lo, hi);
            if let Some(v) = sums.push(b, _mm512_add_ps(lo, hi), add) {
                xsum = v;
            }
            if let Some(v) = maxima.push(b, absmax(lo, hi), max) {
                amax = v;
            }
        }
        if all_finite != 0xFFFF {
            return false;
        }
        // Level 1 (and the residuals' maxima for level 2).
        let (d1, id1) = scales(amax);
        let (mut ints, mut rest) = (IntSums::new(), Across16::new());
        for b in 0..16 {
            let (lo, hi) = load(b);
            let id = splat_lane(id1, b);
            let (ql, qh) = (round_ints(lo, id), round_ints(hi, id));
            ints.take(b, (ql, qh), out.get_mut(b).map(|o| &mut o.q[0]));
            if levels == 2 {
                let d = splat_lane(d1, b);
                let (rl, rh) = (residual(lo, d, ql), residual(hi, d, qh));
                if let Some(v) = rest.push(b, absmax(rl, rh), max) {
                    amax = v;
                }
            }
        }
        for b in 0..n {
            let o = &mut out[b];
            o.xsum = lane(xsum, b);
            o.d[0] = lane(d1, b);
            (o.s[0], o.h[0]) = ints.sums(b);
            (o.q[1], o.d[1], o.s[1], o.h[1]) = ([0; 32], 0.0, 0, 0);
        }
        if levels < 2 {
            return true;
        }
        let (d2, id2) = scales(amax);
        let mut ints = IntSums::new();
        for b in 0..16 {
            let (lo, hi) = load(b);
            let (id, d) = (splat_lane(id1, b), splat_lane(d1, b));
            let (ql, qh) = (round_ints(lo, id), round_ints(hi, id));
            let (rl, rh) = (residual(lo, d, ql), residual(hi, d, qh));
            let id = splat_lane(id2, b);
            let (ql, qh) = (round_ints(rl, id), round_ints(rh, id));
            ints.take(b, (ql, qh), out.get_mut(b).map(|o| &mut o.q[1]));
        }
        for b in 0..n {
            let o = &mut out[b];
            o.d[1] = lane(d2, b);
            (o.s[1], o.h[1]) = ints.sums(b);
        }
        true
    }

    /// One level of 32 values in four 256-bit registers (the steps of
    /// `super::level`): the scale and the i32 values, or `None` when a
    /// value is not finite.
    #[inline(always)]
    unsafe fn level256(v: &[__m256; 4]) -> Option<(f32, [__m256i; 4])> {
        let zero = _mm256_setzero_ps();
        let mut finite = -1i32;
        for r in v {
            // x − x is 0 exactly when x is finite.
            finite &= _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_sub_ps(*r, *r), zero));
        }
        if finite & 0xFF != 0xFF {
            return None;
        }
        let sign = _mm256_set1_ps(-0.0);
        let m = _mm256_max_ps(
            _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
            _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])),
        );
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        let id = 127.0 / amax;
        if id == f32::INFINITY {
            return Some((0.0, [_mm256_setzero_si256(); 4]));
        }
        let id = _mm256_set1_ps(id);
        let magic = _mm256_set1_ps(12_582_912.0);
        let (top, bottom) = (_mm256_set1_epi32(127), _mm256_set1_epi32(-127));
        let mut q = [_mm256_setzero_si256(); 4];
        for k in 0..4 {
            let r = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v[k], id), magic), magic);
            q[k] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(r), top), bottom);
        }
        Some((amax / 127.0, q))
    }

    /// Stores one level's 32 integers as bytes into `q`: `(Σq, Σ of the
    /// first sixteen)`.
    #[inline(always)]
    unsafe fn store256(q: &mut [i8; 32], v: &[__m256i; 4]) -> (i32, i32) {
        // packs interleaves 128-bit lanes: [0 1 2 3] of 4-byte runs per
        // lane, put back in order.
        let w = _mm256_packs_epi16(
            _mm256_packs_epi32(v[0], v[1]),
            _mm256_packs_epi32(v[2], v[3]),
        );
        let w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, w);
        let first = hsum256(_mm256_add_epi32(v[0], v[1]));
        (first + hsum256(_mm256_add_epi32(v[2], v[3])), first)
    }

    /// The sum of the eight i32 lanes of `r`.
    #[inline(always)]
    unsafe fn hsum256(r: __m256i) -> i32 {
        let r = _mm_add_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256::<1>(r));
        let r = _mm_add_epi32(r, _mm_shuffle_epi32::<0b01_00_11_10>(r));
        _mm_cvtsi128_si32(_mm_add_epi32(r, _mm_shuffle_epi32::<0b00_00_00_01>(r)))
    }

    /// `super::quantize_blocks` in AVX2, a block at a time: the same
    /// operations, so the same bits.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_avx2(x: &[f32], levels: usize, out: &mut [ActBlock]) {
        for (xb, o) in x.chunks_exact(32).zip(out.iter_mut()) {
            let p = xb.as_ptr();
            let v = [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ];
            // Σx by `quantize_block`'s tree: pairs 16 apart, then
            // `reduce16`'s halvings (its first: pair `j` and `j + 8`).
            let pairs = (_mm256_add_ps(v[0], v[2]), _mm256_add_ps(v[1], v[3]));
            let xsum = reduce8(_mm256_add_ps(pairs.0, pairs.1));
            let mut blk = ActBlock {
                xsum,
                ..ActBlock::default()
            };
            let Some((d1, q1)) = level256(&v) else {
                blk.d = [f32::NAN, 0.0];
                *o = blk;
                continue;
            };
            blk.d[0] = d1;
            (blk.s[0], blk.h[0]) = store256(&mut blk.q[0], &q1);
            if levels == 2 {
                let d = _mm256_set1_ps(d1);
                let mut r = v;
                for k in 0..4 {
                    r[k] = _mm256_sub_ps(v[k], _mm256_mul_ps(d, _mm256_cvtepi32_ps(q1[k])));
                }
                let (d2, q2) = level256(&r).expect("finite residuals of finite values");
                blk.d[1] = d2;
                (blk.s[1], blk.h[1]) = store256(&mut blk.q[1], &q2);
            }
            *o = blk;
        }
    }

    /// [`quantize_avx512`] a block at a time.
    #[inline(always)]
    unsafe fn quantize_one_by_one(x: &[f32], levels: usize, out: &mut [ActBlock]) {
        for (xb, o) in x.chunks_exact(32).zip(out.iter_mut()) {
            let lo = _mm512_loadu_ps(xb.as_ptr());
            let hi = _mm512_loadu_ps(xb.as_ptr().add(16));
            let mut pairs = [0f32; 16];
            _mm512_storeu_ps(pairs.as_mut_ptr(), _mm512_add_ps(lo, hi));
            let xsum = crate::simd::lanes::reduce16(&pairs);
            let mut blk = ActBlock {
                xsum,
                ..ActBlock::default()
            };
            let Some((d1, q1l, q1h)) = level512(lo, hi) else {
                blk.d = [f32::NAN, 0.0];
                *o = blk;
                continue;
            };
            let store = |q: &mut [i8; 32], l: __m512i, h: __m512i| {
                _mm_storeu_si128(q.as_mut_ptr() as *mut __m128i, _mm512_cvtepi32_epi8(l));
                _mm_storeu_si128(
                    q.as_mut_ptr().add(16) as *mut __m128i,
                    _mm512_cvtepi32_epi8(h),
                );
                let first = _mm512_reduce_add_epi32(l);
                (first + _mm512_reduce_add_epi32(h), first)
            };
            blk.d[0] = d1;
            (blk.s[0], blk.h[0]) = store(&mut blk.q[0], q1l, q1h);
            if levels == 2 {
                let d = _mm512_set1_ps(d1);
                let (rl, rh) = (residual(lo, d, q1l), residual(hi, d, q1h));
                let (d2, q2l, q2h) = level512(rl, rh).expect("finite residuals of finite values");
                blk.d[1] = d2;
                (blk.s[1], blk.h[1]) = store(&mut blk.q[1], q2l, q2h);
            }
            *o = blk;
        }
    }

    /// Blocks of a tile's stream ahead of the one being read that
    /// [`Hints::record`] hints (about 18 KiB of Q4_1). Decoding one
    /// sequence waits on memory: four blocks ahead (2.3 KiB) gave 330
    /// tok/s on SmolLM2 Q4_1 (Xeon, 2 cores), sixteen 420, thirty-two
    /// 435, sixty-four 430.
    const AHEAD_BLOCKS: usize = 32;

    /// The lines of tile bytes to come that a block's products hint into
    /// L2, one line per product (`prefetcht1`), so that the hints are
    /// spread among the products rather than issued in a burst at the
    /// block's start: up to two runs of 64-byte lines, `na` from `a` and
    /// `nb` from `b`. Each hint is an `asm!` block, which the compiler
    /// keeps in its place among the loads around it (it gathers the
    /// `_mm_prefetch` intrinsics of a block into one burst).
    ///
    /// Why spread: with a block's lines hinted in a burst, a decode's
    /// tiles streamed 0.64–0.72 of the host's read rate on a 2-core Xeon
    /// (AVX-512 VNNI and AMX) while the same tiles ran 2× the read rate
    /// from L2; spread one a product, 0.80–0.88 (`tile_stream`, 2026-12-07,
    /// docs/performance-notes.md). A burst fills the core's miss buffers
    /// with lines that take a trip to memory, and the block's own loads,
    /// hits in L2 that need a buffer too, wait behind them.
    #[derive(Clone, Copy)]
    pub(super) struct Hints {
        a: *const u8,
        na: usize,
        b: *const u8,
        nb: usize,
    }

    impl Hints {
        /// No lines (the products of every input after the first).
        pub(super) const NONE: Hints = Hints {
            a: std::ptr::null(),
            na: 0,
            b: std::ptr::null(),
            nb: 0,
        };

        /// The `rec` bytes `AHEAD_BLOCKS` records past the record at `t`
        /// (tiles follow each other in memory, so it runs on into the
        /// next tiles).
        pub(super) fn record(t: *const u8, rec: usize) -> Hints {
            Hints::span(t.wrapping_add(AHEAD_BLOCKS * rec), rec)
        }

        /// The lines of the `bytes` bytes at `at`.
        pub(super) fn span(at: *const u8, bytes: usize) -> Hints {
            Hints {
                a: at,
                na: bytes.div_ceil(64),
                ..Hints::NONE
            }
        }

        /// These lines, then the one line at `at` (`Some`).
        pub(super) fn and_line(self, at: Option<*const u8>) -> Hints {
            match at {
                Some(b) => Hints { b, nb: 1, ..self },
                None => self,
            }
        }

        /// Hints line `j` (none past the last).
        #[inline(always)]
        #[allow(clippy::pointers_in_nomem_asm_block)]
        pub(super) unsafe fn line(&self, j: usize) {
            let at = if j < self.na {
                self.a.wrapping_add(64 * j)
            } else if j - self.na < self.nb {
                self.b.wrapping_add(64 * (j - self.na))
            } else {
                return;
            };
            // SAFETY: a prefetch never faults, whatever the address. It
            // reads nothing the program sees (`nomem`, so that the compiler
            // still moves loads around it freely; `readonly` streamed no
            // faster).
            std::arch::asm!(
                "prefetcht1 [{}]",
                in(reg) at,
                options(nostack, preserves_flags, nomem)
            );
        }

        /// Hints lines `from..` (those no product took).
        #[inline(always)]
        pub(super) unsafe fn rest(&self, from: usize) {
            for j in from..self.na + self.nb {
                self.line(j);
            }
        }
    }

    /// The i32 at `q[4j..4j + 4]` in every lane.
    #[inline(always)]
    pub(super) unsafe fn quad(q: &[i8; 32], j: usize) -> i32 {
        (q.as_ptr() as *const i32).add(j).read_unaligned()
    }

    /// Integer offset that turns the sum over unsigned weight bytes into
    /// the sum over the block's signed weights: `−off · Σq`.
    fn offset(kind: Kind) -> i32 {
        match kind {
            Kind::Q8_0 => -128,
            k => k.bias(),
        }
    }

    /// # Safety
    /// The CPU has AVX-512 F/BW/VL and VNNI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn tile_avx512<const K: u8, const TWO: bool, const NI: usize>(
        w: &Packed,
        g: usize,
        ins: &[&[ActBlock]; MAX_NI],
        out: &mut [[f32; GROUP]; MAX_NI],
    ) {
        let kind = kind_of(K);
        let rec = kind.record();
        let tile = w.tile(g);
        let p = tile.as_ptr();
        let flip = _mm512_set1_epi8(-128);
        let mut y = [_mm512_setzero_ps(); NI];
        for b in 0..w.nb {
            let t = p.add(b * rec);
            let hints = Hints::record(t, rec);
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(t as *const __m256i));
            let m = if kind.has_min() {
                _mm512_cvtph_ps(_mm256_loadu_si256(t.add(32) as *const __m256i))
            } else {
                _mm512_setzero_ps()
            };
            let mut wv = block_values512(kind, t);
            if kind == Kind::Q8_0 {
                for v in &mut wv {
                    *v = _mm512_xor_si512(*v, flip);
                }
            }
            // Written out input by input, so that every sum stays in a
            // register (a loop of eight keeps them on the stack). The
            // first input's products hint the lines to come, a line each
            // (`Hints`).
            unrolled!(NI, |i| {
                let a: &ActBlock = &ins[i][b];
                let h = if i == 0 { hints } else { Hints::NONE };
                let a1 = block_level512(kind, a, 0, &wv, &h);
                let mut s = _mm512_mul_ps(_mm512_cvtepi32_ps(a1), _mm512_set1_ps(a.d[0]));
                if TWO {
                    let a2 = block_level512(kind, a, 1, &wv, &h);
                    s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a2), _mm512_set1_ps(a.d[1]), s);
                }
                y[i] = _mm512_fmadd_ps(d, s, y[i]);
                if kind.has_min() {
                    y[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.xsum), y[i]);
                }
            });
            hints.rest(if TWO { 16 } else { 8 });
        }
        for i in 0..NI {
            _mm512_storeu_ps(out[i].as_mut_ptr(), y[i]);
        }
    }

    /// One level's integer sums for [`tile_avx512`]'s 16 rows, the
    /// products hinting lines `8l..8l + 8` of `hints`. (A closure in its
    /// place, once it hinted, was no longer inlined: a call a block, its
    /// weights through the stack.)
    #[inline(always)]
    unsafe fn block_level512(
        kind: Kind,
        a: &ActBlock,
        l: usize,
        wv: &[__m512i; 8],
        hints: &Hints,
    ) -> __m512i {
        let init = _mm512_set1_epi32(offset(kind) * a.s[l]);
        chains512(init, |j| {
            hints.line(8 * l + j);
            (wv[j], _mm512_set1_epi32(quad(&a.q[l], j)))
        })
    }

    /// The 32 values of each of the 16 rows of the tile block at `t`, as
    /// the kernels multiply them: register `j` holds values `4j..4j + 4`
    /// of row `r` at bytes `4r..4r + 4` (the unsigned `n` of the 4- and
    /// 5-bit formats, Q8_0's signed bytes as they are).
    #[inline(always)]
    pub(super) unsafe fn block_values512(kind: Kind, t: *const u8) -> [__m512i; 8] {
        let vals = t.add(kind.values_at());
        let mut wv = [_mm512_setzero_si512(); 8];
        if kind == Kind::Q8_0 {
            for j in 0..8 {
                wv[j] = _mm512_loadu_si512(vals.add(64 * j) as *const _);
            }
            return wv;
        }
        let nibble = _mm512_set1_epi8(0x0F);
        for c in 0..4 {
            let raw = _mm512_loadu_si512(vals.add(64 * c) as *const _);
            wv[c] = _mm512_and_si512(raw, nibble);
            wv[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        }
        if kind.high() {
            // One mask bit per byte of each register: its fifth bit.
            let fifth = _mm512_set1_epi8(0x10);
            let masks = t.add(kind.masks_at()) as *const u64;
            for j in 0..8 {
                let k: __mmask64 = masks.add(j).read_unaligned();
                wv[j] = _mm512_mask_add_epi8(wv[j], k, wv[j], fifth);
            }
        }
        wv
    }

    /// `init` plus the eight dot products `pair(j)` of a block's level
    /// (`vpdpbusd`: unsigned bytes times signed, four per lane), in two
    /// chains of four: the sums are exact integers, so the order can't
    /// change them, and two chains halve the latency of one.
    #[inline(always)]
    pub(super) unsafe fn chains512(
        init: __m512i,
        pair: impl Fn(usize) -> (__m512i, __m512i),
    ) -> __m512i {
        let mut acc = [init, _mm512_setzero_si512()];
        for j in 0..8 {
            let (w, q) = pair(j);
            acc[j % 2] = _mm512_dpbusd_epi32(acc[j % 2], w, q);
        }
        _mm512_add_epi32(acc[0], acc[1])
    }

    /// How an 8-row register of weight bytes meets four activation bytes.
    pub(super) trait Dot8 {
        /// Unsigned weight bytes (4-bit values, or Q8_0's flipped bytes)
        /// `w` times signed `q`, added to `acc` per 32-bit lane.
        unsafe fn dot(acc: __m256i, w: __m256i, q: __m256i) -> __m256i;
        /// [`chains512`] for 8 rows: `init` plus the 8 products
        /// `pair(0..8)` per 32-bit lane, for weights of at most `bits`
        /// bits as unsigned bytes (8: Q8_0's bytes, by either trick).
        #[inline(always)]
        unsafe fn chains(
            init: __m256i,
            _bits: u32,
            pair: impl Fn(usize) -> (__m256i, __m256i),
        ) -> __m256i {
            let mut acc = [init, _mm256_setzero_si256()];
            for j in 0..8 {
                let (w, q) = pair(j);
                acc[j % 2] = Self::dot(acc[j % 2], w, q);
            }
            _mm256_add_epi32(acc[0], acc[1])
        }
        /// `acc` plus two products, the weights of at most 6 bits.
        #[inline(always)]
        unsafe fn dot2(acc: __m256i, a: (__m256i, __m256i), b: (__m256i, __m256i)) -> __m256i {
            Self::dot(Self::dot(acc, a.0, a.1), b.0, b.1)
        }
        /// Whether Q8_0 runs on flipped (unsigned) bytes with an offset.
        const FLIP: bool;
        /// Whether a one-input tile of the plain 4-bit kinds takes
        /// [`one_input`]: with `vpdpbusd` (AVX-VNNI) it streamed 44–48
        /// GB/s from L2 on one Zen 5 core against 40–41; with `maddubs`
        /// (AVX2) 32–33 against 27–35, so AVX2 keeps the shared loop.
        const ONE_INPUT: bool;
        /// Whether its products come as i16 pairs to be widened (`maddubs`)
        /// rather than added into 32-bit lanes (`vpdpbusd`).
        const I16_SUMS: bool;
    }

    /// Products of `maddubs` that may be added in i16 before widening:
    /// each is a pair of `w·q` with `w < 2^bits` and `|q| ≤ 127` (the
    /// activation levels never take −128), at most `2·(2^bits − 1)·127`,
    /// so 4-bit weights allow eight (30,480 < 32,767), 5-bit four
    /// (31,496), 6-bit two (32,004), and Q8_0's `|w| ≤ 128` one.
    pub(super) const fn i16_group(bits: u32) -> usize {
        match bits {
            0..=4 => 8,
            5 => 4,
            6 => 2,
            _ => 1,
        }
    }

    pub(super) struct Maddubs;
    pub(super) struct Vnni256;
    /// [`Vnni256`]'s instruction in AVX-512 VNNI's encoding (for CPUs that
    /// have AVX-512 VNNI and VL but not AVX-VNNI): the panels' AVX-VNNI
    /// code run and timed there.
    pub(super) struct VnniEvex256;

    impl Dot8 for VnniEvex256 {
        #[inline(always)]
        unsafe fn dot(acc: __m256i, w: __m256i, q: __m256i) -> __m256i {
            _mm256_dpbusd_epi32(acc, w, q)
        }
        const FLIP: bool = true;
        const ONE_INPUT: bool = true;
        const I16_SUMS: bool = false;
    }

    impl Dot8 for Maddubs {
        #[inline(always)]
        unsafe fn dot(acc: __m256i, w: __m256i, q: __m256i) -> __m256i {
            // Pairs of products fit i16: 4-bit weights (≤ 15·127·2) and
            // Q8_0 through the sign trick (≤ 128·127·2).
            let pairs = _mm256_maddubs_epi16(w, q);
            _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
        }
        /// The `maddubs` products added in i16 in groups of
        /// [`i16_group`] before one `madd` widens each group: the widening
        /// `madd` takes the multiply ports as `maddubs` does, and for 4-bit
        /// weights one replaces eight. (Exact: no sum leaves i16.)
        #[inline(always)]
        unsafe fn chains(
            init: __m256i,
            bits: u32,
            pair: impl Fn(usize) -> (__m256i, __m256i),
        ) -> __m256i {
            let group = i16_group(bits);
            let ones = _mm256_set1_epi16(1);
            let mut acc = [init, _mm256_setzero_si256()];
            for g in 0..8 / group {
                let (w, q) = pair(g * group);
                let mut s = _mm256_maddubs_epi16(w, q);
                for k in 1..group {
                    let (w, q) = pair(g * group + k);
                    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w, q));
                }
                acc[g % 2] = _mm256_add_epi32(acc[g % 2], _mm256_madd_epi16(s, ones));
            }
            _mm256_add_epi32(acc[0], acc[1])
        }
        #[inline(always)]
        unsafe fn dot2(acc: __m256i, a: (__m256i, __m256i), b: (__m256i, __m256i)) -> __m256i {
            let s = _mm256_add_epi16(
                _mm256_maddubs_epi16(a.0, a.1),
                _mm256_maddubs_epi16(b.0, b.1),
            );
            _mm256_add_epi32(acc, _mm256_madd_epi16(s, _mm256_set1_epi16(1)))
        }
        const FLIP: bool = false;
        const ONE_INPUT: bool = false;
        const I16_SUMS: bool = true;
    }

    impl Dot8 for Vnni256 {
        #[inline(always)]
        unsafe fn dot(acc: __m256i, w: __m256i, q: __m256i) -> __m256i {
            _mm256_dpbusd_avx_epi32(acc, w, q)
        }
        const FLIP: bool = true;
        const ONE_INPUT: bool = true;
        const I16_SUMS: bool = false;
    }

    /// # Safety
    /// The CPU has AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile_avx2<const K: u8, const TWO: bool, const NI: usize>(
        w: &Packed,
        g: usize,
        ins: &[&[ActBlock]; MAX_NI],
        out: &mut [[f32; GROUP]; MAX_NI],
    ) {
        tile_256::<Maddubs, K, TWO, NI>(w, g, ins, out)
    }

    /// # Safety
    /// The CPU has AVX-VNNI, AVX2, FMA and F16C.
    #[target_feature(enable = "avxvnni,avx2,fma,f16c")]
    pub(super) unsafe fn tile_avxvnni<const K: u8, const TWO: bool, const NI: usize>(
        w: &Packed,
        g: usize,
        ins: &[&[ActBlock]; MAX_NI],
        out: &mut [[f32; GROUP]; MAX_NI],
    ) {
        tile_256::<Vnni256, K, TWO, NI>(w, g, ins, out)
    }

    /// [`tile_avxvnni`] in AVX-512 VNNI's encoding (the tiles the AVX-VNNI
    /// panels are timed against where AVX-VNNI is missing).
    ///
    /// # Safety
    /// The CPU has AVX-512 F, VL and VNNI, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn tile_vnni_evex<const K: u8, const TWO: bool, const NI: usize>(
        w: &Packed,
        g: usize,
        ins: &[&[ActBlock]; MAX_NI],
        out: &mut [[f32; GROUP]; MAX_NI],
    ) {
        tile_256::<VnniEvex256, K, TWO, NI>(w, g, ins, out)
    }

    /// One level's integer sums for 8 rows.
    #[inline(always)]
    unsafe fn level<D: Dot8>(
        a: &ActBlock,
        l: usize,
        off: i32,
        (signed, bits): (bool, u32),
        wv: &[__m256i; 8],
        abs: &[__m256i; 8],
        (hints, first): (&Hints, usize),
    ) -> __m256i {
        D::chains(_mm256_set1_epi32(off * a.s[l]), bits, |j| {
            hints.line(first + j);
            let q = _mm256_set1_epi32(quad(&a.q[l], j));
            if signed {
                (abs[j], _mm256_sign_epi8(q, wv[j]))
            } else {
                (wv[j], q)
            }
        })
    }

    /// The unsigned values of half `half` (8 rows) of a 4- or 5-bit
    /// block's tile record `t` (not Q8_0), as the 256-bit tiles hold them:
    /// register `j`, byte `4r + e`: value `4j + e` of row `r`.
    #[inline(always)]
    pub(super) unsafe fn block_values256(kind: Kind, t: *const u8, half: usize) -> [__m256i; 8] {
        let nibble = _mm256_set1_epi8(0x0F);
        let vals = t.add(kind.values_at() + 32 * half);
        let mut wv = [_mm256_setzero_si256(); 8];
        for c in 0..4 {
            let raw = _mm256_loadu_si256(vals.add(64 * c) as *const __m256i);
            wv[c] = _mm256_and_si256(raw, nibble);
            wv[c + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        }
        if kind.high() {
            let masks = t.add(kind.masks_at()) as *const u64;
            for j in 0..8 {
                let k = (masks.add(j).read_unaligned() >> (32 * half)) as u32;
                wv[j] = _mm256_or_si256(wv[j], fifth_bits_256(k));
            }
        }
        wv
    }

    /// `0x10` in byte `i` of the register where bit `i` of `k` is set.
    #[inline(always)]
    pub(super) unsafe fn fifth_bits_256(k: u32) -> __m256i {
        // Byte i takes mask bit i: byte i/8 of the mask's 32 bits, then
        // bit i%8.
        let spread = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        );
        let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let v = _mm256_shuffle_epi8(_mm256_set1_epi32(k as i32), spread);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(v, bits), bits);
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    }

    /// [`tile_256`] for one input (a decode) of the 4-bit kinds without
    /// fifth bits: each level's eight activation quads broadcast once for
    /// both halves, and the weights unpacked as each product takes them,
    /// so that the broadcasts stay in registers (16 of them) instead of
    /// going through the stack between the halves. The same integer sums
    /// and the same float steps in the same order: the same bits.
    #[inline(always)]
    unsafe fn one_input<D: Dot8, const K: u8, const TWO: bool, const NI: usize>(
        nb: usize,
        p: *const u8,
        a: &[ActBlock],
        y: &mut [[__m256; NI]; 2],
    ) {
        let kind = kind_of(K);
        let rec = kind.record();
        let nibble = _mm256_set1_epi8(0x0F);
        let off = offset(kind);
        let bits = kind.bits();
        for b in 0..nb {
            let t = p.add(b * rec);
            let hints = Hints::record(t, rec);
            let a = &a[b];
            let mut sums = [[_mm256_setzero_si256(); 2]; 2];
            for (l, sums) in sums.iter_mut().enumerate().take(if TWO { 2 } else { 1 }) {
                let q: [__m256i; 8] = std::array::from_fn(|j| _mm256_set1_epi32(quad(&a.q[l], j)));
                for (half, sum) in sums.iter_mut().enumerate() {
                    let vals = t.add(kind.values_at() + 32 * half);
                    *sum = D::chains(_mm256_set1_epi32(off * a.s[l]), bits, |j| {
                        // A line to come a product (`Hints`).
                        hints.line(16 * l + 8 * half + j);
                        let raw = _mm256_loadu_si256(vals.add(64 * (j % 4)) as *const __m256i);
                        let raw = if j < 4 {
                            raw
                        } else {
                            _mm256_srli_epi16(raw, 4)
                        };
                        (_mm256_and_si256(raw, nibble), q[j])
                    });
                }
            }
            for half in 0..2 {
                let d = _mm256_cvtph_ps(_mm_loadu_si128(t.add(16 * half) as *const __m128i));
                let mut s =
                    _mm256_mul_ps(_mm256_cvtepi32_ps(sums[0][half]), _mm256_set1_ps(a.d[0]));
                if TWO {
                    s = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(sums[1][half]),
                        _mm256_set1_ps(a.d[1]),
                        s,
                    );
                }
                y[half][0] = _mm256_fmadd_ps(d, s, y[half][0]);
                if kind.has_min() {
                    let m =
                        _mm256_cvtph_ps(_mm_loadu_si128(t.add(32 + 16 * half) as *const __m128i));
                    y[half][0] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.xsum), y[half][0]);
                }
            }
            hints.rest(if TWO { 32 } else { 16 });
        }
    }

    /// The 16 rows as two registers of 8, both halves of each block taken
    /// while its bytes are in L1 (as the K-quant tiles do).
    #[inline(always)]
    unsafe fn tile_256<D: Dot8, const K: u8, const TWO: bool, const NI: usize>(
        w: &Packed,
        g: usize,
        ins: &[&[ActBlock]; MAX_NI],
        out: &mut [[f32; GROUP]; MAX_NI],
    ) {
        let kind = kind_of(K);
        let rec = kind.record();
        let tile = w.tile(g);
        let p = tile.as_ptr();
        let flip = _mm256_set1_epi8(-128);
        let off = if kind == Kind::Q8_0 && !D::FLIP {
            0
        } else {
            offset(kind)
        };
        let mut y = [[_mm256_setzero_ps(); NI]; 2];
        if D::ONE_INPUT && NI == 1 && !kind.high() && kind != Kind::Q8_0 {
            one_input::<D, K, TWO, NI>(w.nb, p, ins[0], &mut y);
            for (half, y) in y.iter().enumerate() {
                _mm256_storeu_ps(out[0].as_mut_ptr().add(8 * half), y[0]);
            }
            return;
        }
        for b in 0..w.nb {
            let t = p.add(b * rec);
            // As in `tile_avx512`: the first input's first level hints
            // the lines to come, a line a product.
            let hints = Hints::record(t, rec);
            for half in 0..2 {
                let d = _mm256_cvtph_ps(_mm_loadu_si128(t.add(16 * half) as *const __m128i));
                let m = if kind.has_min() {
                    _mm256_cvtph_ps(_mm_loadu_si128(t.add(32 + 16 * half) as *const __m128i))
                } else {
                    _mm256_setzero_ps()
                };
                let vals = t.add(kind.values_at() + 32 * half);
                let mut wv = [_mm256_setzero_si256(); 8];
                if kind == Kind::Q8_0 {
                    for j in 0..8 {
                        let raw = _mm256_loadu_si256(vals.add(64 * j) as *const __m256i);
                        wv[j] = if D::FLIP {
                            _mm256_xor_si256(raw, flip)
                        } else {
                            raw
                        };
                    }
                } else {
                    wv = block_values256(kind, t, half);
                }
                // Q8_0 without VNNI: |w| unsigned, the sign moved to q.
                let signed = kind == Kind::Q8_0 && !D::FLIP;
                let mut abs = [_mm256_setzero_si256(); 8];
                if signed {
                    for j in 0..8 {
                        abs[j] = _mm256_abs_epi8(wv[j]);
                    }
                }
                let y = &mut y[half];
                // Written out, so that the sums stay in registers.
                unrolled!(NI, |i| {
                    let a: &ActBlock = &ins[i][b];
                    let h = if i == 0 {
                        (&hints, 8 * half)
                    } else {
                        (&Hints::NONE, 0)
                    };
                    let a1 = level::<D>(a, 0, off, (signed, kind.bits()), &wv, &abs, h);
                    let mut s = _mm256_mul_ps(_mm256_cvtepi32_ps(a1), _mm256_set1_ps(a.d[0]));
                    if TWO {
                        let a2 = level::<D>(
                            a,
                            1,
                            off,
                            (signed, kind.bits()),
                            &wv,
                            &abs,
                            (&Hints::NONE, 0),
                        );
                        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a2), _mm256_set1_ps(a.d[1]), s);
                    }
                    y[i] = _mm256_fmadd_ps(d, s, y[i]);
                    if kind.has_min() {
                        y[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.xsum), y[i]);
                    }
                });
            }
            hints.rest(16);
        }
        for half in 0..2 {
            for i in 0..NI {
                _mm256_storeu_ps(out[i].as_mut_ptr().add(8 * half), y[half][i]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::DType;

    use crate::testing::seeded;

    fn quantized(n: usize, k: usize, d: GgmlDType, seed: u64) -> Vec<u8> {
        let w = seeded(&[n, k], seed, DType::F32).unwrap();
        QTensor::quantize(&w, d)
            .unwrap()
            .data()
            .unwrap()
            .into_owned()
    }

    fn acts_of(x: &[f32], t: usize, k: usize, levels: usize) -> Vec<ActBlock> {
        let mut a = vec![ActBlock::default(); t * k / 32];
        for i in 0..t {
            quantize_row_on(
                QIsa::Portable,
                &x[i * k..(i + 1) * k],
                levels,
                &mut a[i * k / 32..(i + 1) * k / 32],
            );
        }
        a
    }

    /// Every format with an integer path, and a row length for it.
    const FORMATS: [(GgmlDType, usize); 8] = [
        (GgmlDType::Q4_0, 160),
        (GgmlDType::Q4_1, 160),
        (GgmlDType::Q5_0, 160),
        (GgmlDType::Q5_1, 160),
        (GgmlDType::Q8_0, 160),
        (GgmlDType::Q4K, 512),
        (GgmlDType::Q5K, 512),
        (GgmlDType::Q6K, 512),
    ];

    #[test]
    fn packing_is_lossless() {
        for (d, k) in FORMATS {
            for n in [1, 16, 21, 48] {
                let data = quantized(n, k, d, n as u64);
                let w = Weights::new(WeightFormat::from_ggml(d), &data, n, k).unwrap();
                let p = Packed::pack(&w).unwrap();
                assert_eq!(p.unpack(), data, "{d:?} n={n}");
            }
        }
        let f = vec![0u8; 4 * 32];
        let w = Weights::new(WeightFormat::F32, &f, 1, 32).unwrap();
        assert!(Packed::pack(&w).is_none());
    }

    /// Every format, level count, instruction set of this CPU, batch size
    /// and row split: the same bits as the scalar reference on the GGML
    /// blocks; and close to the f32 product.
    #[test]
    fn every_path_equals_the_reference_bit_for_bit() {
        let n = 37;
        for (d, k) in FORMATS {
            let data = quantized(n, k, d, 3);
            let w = Weights::new(WeightFormat::from_ggml(d), &data, n, k).unwrap();
            let p = Packed::pack(&w).unwrap();
            for t in [1, 3, 4, 9, 17, 70] {
                let x = seeded(&[t, k], 20 + t as u64, DType::F32).unwrap();
                let x = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let exact = crate::matvec_slow(&w, &x, t);
                for levels in [1, 2] {
                    let acts = acts_of(&x, t, k, levels);
                    let want = qmatvec_slow(&w, &acts, t, levels);
                    // Each instruction set, and (`None`) the AVX-VNNI panels'
                    // code in AVX-512 VNNI's encoding where that runs.
                    let paths = QIsa::available().into_iter().map(Some).chain([None]);
                    'paths: for isa in paths {
                        for splits in [&[][..], &[5][..], &[16, 17, 32][..]] {
                            let mut got = vec![f32::NAN; t * n];
                            let mut bounds = vec![0];
                            bounds.extend(splits);
                            bounds.push(n);
                            for pr in bounds.windows(2) {
                                let mut emit = |i: usize, r: usize, v: &[f32]| {
                                    got[i * n + r..][..v.len()].copy_from_slice(v)
                                };
                                match isa {
                                    Some(isa) => {
                                        qmatvec(isa, &p, &acts, t, levels, pr[0], pr[1], &mut emit)
                                    }
                                    #[cfg(target_arch = "x86_64")]
                                    None => {
                                        let ran = crate::testing::qmatvec_vnni_evex_panels(
                                            &p, &acts, t, levels, pr[0], pr[1], &mut emit,
                                        );
                                        if ran.is_none() {
                                            continue 'paths;
                                        }
                                    }
                                    #[cfg(not(target_arch = "x86_64"))]
                                    None => continue 'paths,
                                }
                            }
                            for (a, b) in got.iter().zip(&want) {
                                assert_eq!(
                                    a.to_bits(),
                                    b.to_bits(),
                                    "{d:?} t={t} levels={levels} {isa:?} {splits:?}"
                                );
                            }
                        }
                    }
                    // The sums here add 160 (512) terms of magnitude ~0.25
                    // (about 40 (80) in absolute value): two levels stay
                    // within 2e-3 of the f32 product (5e-5 of that), one
                    // level only 3e-1.
                    let tol = if levels == 2 { 2e-3 } else { 3e-1 } * (k as f32 / 160.0);
                    for (a, b) in want.iter().zip(&exact) {
                        assert!((a - b).abs() < tol, "{d:?} {levels}: {a} vs {b}");
                    }
                }
            }
        }
    }

    /// Keyed products (a layer's rows taken range by range, as the model
    /// takes q/k/v head by head): the same bits as the reference on every
    /// path, over more inputs than one panel holds, and a batch written
    /// anew under a fresh key in the same buffer gives its own results,
    /// not the regrouping of the one before.
    #[test]
    fn keyed_products_equal_the_reference_and_follow_new_inputs() {
        let n = 37;
        for (d, k) in [
            (GgmlDType::Q4_0, 160),
            (GgmlDType::Q4K, 256),
            (GgmlDType::Q6K, 256),
        ] {
            let data = quantized(n, k, d, 4);
            let w = Weights::new(WeightFormat::from_ggml(d), &data, n, k).unwrap();
            let p = Packed::pack(&w).unwrap();
            let t = 300;
            let mut acts = vec![ActBlock::default(); t * k / 32];
            for seed in [31u64, 32] {
                let x = seeded(&[t, k], seed, DType::F32).unwrap();
                let x = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                for i in 0..t {
                    quantize_row(
                        &x[i * k..(i + 1) * k],
                        2,
                        &mut acts[i * k / 32..(i + 1) * k / 32],
                    );
                }
                let want = qmatvec_slow(&w, &acts, t, 2);
                let key = ActsKey::fresh();
                for isa in QIsa::available() {
                    let mut got = vec![f32::NAN; t * n];
                    for r0 in (0..n).step_by(16) {
                        let r1 = (r0 + 16).min(n);
                        qmatvec_keyed(isa, &p, &acts, Some(key), t, 2, r0, r1, &mut |i, r, v| {
                            got[i * n + r..][..v.len()].copy_from_slice(v)
                        });
                    }
                    for (a, b) in got.iter().zip(&want) {
                        assert_eq!(a.to_bits(), b.to_bits(), "{d:?} seed {seed} {isa:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn two_levels_stand_for_the_activations_closely() {
        let x = seeded(&[1, 256], 9, DType::F32).unwrap();
        let mut x = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        x[5] = 40.0; // an outlier in the first block
        let a = acts_of(&x, 1, 256, 2);
        for (b, blk) in a.iter().enumerate() {
            let xb = &x[32 * b..32 * (b + 1)];
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (v, &want) in blk.values().iter().zip(xb) {
                assert!((v - want).abs() <= amax / (4.0 * 127.0 * 127.0) * 1.01);
            }
            let sum = |q: &[i8]| q.iter().map(|&q| i32::from(q)).sum::<i32>();
            assert_eq!(blk.s, [sum(&blk.q[0]), sum(&blk.q[1])]);
            assert_eq!(blk.h, [sum(&blk.q[0][..16]), sum(&blk.q[1][..16])]);
        }
        let mut with_inf = x.clone();
        with_inf[70] = f32::NEG_INFINITY;
        // Rows of several groups of sixteen blocks and a partial one (the
        // AVX-512 path's unit): an all-zero block, tiny and huge values,
        // a non-finite value in one group only.
        let long = seeded(&[1, 1184], 10, DType::F32).unwrap();
        let mut long = long.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        long[20 * 32..21 * 32].fill(0.0);
        long[3] = -0.0;
        long[40] = 1e-30;
        // A block whose largest value is so small its inverse scale
        // overflows (all taken as 0 on every path).
        long[5 * 32..6 * 32].fill(0.0);
        long[5 * 32 + 9] = -1e-38;
        long[5 * 32 + 30] = 2e-39;
        long[700] = 3e30;
        long[1100] = -1e-12;
        let mut long_nan = long.clone();
        long_nan[33 * 32 + 7] = f32::NAN;
        for (isa, x) in QIsa::available()
            .into_iter()
            .flat_map(|i| [(i, &x), (i, &with_inf), (i, &long), (i, &long_nan)])
        {
            for levels in [1, 2] {
                let mut got = vec![ActBlock::default(); x.len() / 32];
                quantize_row_on(isa, x, levels, &mut got);
                let want = acts_of(x, 1, x.len(), levels);
                for (g, w) in got.iter().zip(&want) {
                    assert_eq!((g.q, g.s, g.h), (w.q, w.s, w.h), "{isa:?}");
                    assert_eq!(g.d.map(f32::to_bits), w.d.map(f32::to_bits), "{isa:?}");
                    assert_eq!(g.xsum.to_bits(), w.xsum.to_bits(), "{isa:?}");
                }
            }
        }
        let z = acts_of(&[0.0; 32], 1, 32, 2);
        assert_eq!(z[0].values(), [0.0; 32]);
        let mut nan = [0.5f32; 32];
        nan[3] = f32::INFINITY;
        assert!(acts_of(&nan, 1, 32, 2)[0].d[0].is_nan());
    }
}
