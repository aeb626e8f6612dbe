//! The GPU side of the KV kernels: what every backend shares.
//!
//! `write_kv`, `copy_blocks` and the gather-and-rotate half of `shift_kv` /
//! `rotate_k` are written once, in `gpu/kv_ops.h`, over a small macro
//! vocabulary that a prelude defines per target (CUDA, Metal, host C++).
//! This module holds what the launchers of every target share: the entry
//! points and their parameters in binding order ([`KERNELS`], checked
//! against the source by a test), the launch shape of each op
//! ([`Launch`]), and the host-side tables (cos/sin per position delta).
//!
//! With the `kernel-emu` feature, [`emu`] runs the very same kernel source,
//! compiled for the CPU, thread by thread over the grid a GPU launch would
//! use, on CPU tensors: its tests hold it to the slow references of
//! [`crate::write_kv_slow`], [`crate::copy_blocks_slow`],
//! [`crate::shift_kv_slow`] and [`crate::rotate_k_slow`] on every machine.

use candle_core::{bail, Result};

use crate::{KvType, Rotation};

/// The shared kernel source (without a prelude).
pub const KV_OPS_SOURCE: &str = include_str!("../../gpu/kv_ops.h");

/// The headers Metal sources include, by name (Metal compiles a source
/// string at run time, with no file system to include from).
const METAL_HEADERS: &[(&str, &str)] = &[
    ("prelude_metal.h", include_str!("../../gpu/prelude_metal.h")),
    ("kv_elem.h", include_str!("../../gpu/kv_elem.h")),
    ("kv_ops.h", KV_OPS_SOURCE),
];

/// The Metal sources: one library each.
pub const METAL_SOURCES: &[(&str, &str)] = &[
    ("kv_ops.metal", include_str!("../../gpu/kv_ops.metal")),
    (
        "paged_attention.metal",
        include_str!("../../gpu/paged_attention.metal"),
    ),
];

/// Metal source `file` as Metal compiles it: each `#include "…"` line
/// replaced by that header (as `clang++ -fsyntax-only` of `just check-gpu`
/// resolves it).
pub fn metal_source(file: &str) -> Result<String> {
    let Some((_, text)) = METAL_SOURCES.iter().find(|(n, _)| *n == file) else {
        bail!("no Metal source {file}")
    };
    let mut out = String::new();
    for line in text.lines() {
        match line.trim_start().strip_prefix("#include \"") {
            Some(rest) => {
                let name = rest.trim_end().trim_end_matches('"');
                let Some((_, h)) = METAL_HEADERS.iter().find(|(n, _)| *n == name) else {
                    bail!("{file} includes {name}, which is not embedded")
                };
                out.push_str(h);
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    Ok(out)
}

/// An entry point of the kernel source: its name and its parameters in
/// binding order (the CUDA argument order; Metal's `buffer(i)` index).
#[derive(Debug, Clone, Copy)]
pub struct KernelSig {
    pub name: &'static str,
    pub params: &'static [&'static str],
}

const WRITE: &[&str] = &["src", "cache", "slots", "row"];
const GATHER: &[&str] = &[
    "cache", "out", "slots", "tables", "cos_t", "sin_t", "heads", "head_dim", "neox",
];
const MOVE: &[&str] = &["src", "dst", "idx", "units"];

macro_rules! sigs {
    ($($name:literal: $params:expr),* $(,)?) => {
        &[$(KernelSig { name: $name, params: $params }),*]
    };
}

/// Every entry point the launchers bind.
pub const KERNELS: &[KernelSig] = sigs![
    "tessera_write_kv_f32": WRITE,
    "tessera_write_kv_f16": WRITE,
    "tessera_write_kv_bf16": WRITE,
    "tessera_write_kv_q8_0": WRITE,
    "tessera_write_kv_q4_0": WRITE,
    "tessera_copy_blocks": &["cache", "pairs", "units"],
    "tessera_rope_gather_f32": GATHER,
    "tessera_rope_gather_f16": GATHER,
    "tessera_rope_gather_bf16": GATHER,
    "tessera_rope_gather_q8_0": GATHER,
    "tessera_rope_gather_q4_0": GATHER,
    "tessera_gather_rows": MOVE,
    "tessera_scatter_rows": MOVE,
    "tessera_hadamard_rows": &["x", "chunks"],
];

/// The launch that stores `rows` rows of `row` values into a cache of
/// type `t`: a block per row, its threads over the row's values (a
/// quantized row's groups of 64).
pub fn write_launch(t: KvType, rows: usize, row: usize) -> Launch {
    Launch::per_item(rows, if t.is_quantized() { row / 64 } else { row })
}

/// The launch that gathers `rows` rows of `heads` heads of `head_dim`
/// from a cache of type `t` (a thread per RoPE pair, or, quantized, per
/// head).
pub fn gather_launch(t: KvType, rows: usize, heads: usize, head_dim: usize) -> Launch {
    Launch::per_item(
        rows,
        if t.is_quantized() {
            heads
        } else {
            heads * head_dim / 2
        },
    )
}

/// Threads per block of [`hadamard_launch`].
const HADAMARD_THREADS: usize = 64;

/// The launch of `tessera_hadamard_rows` over `values` values (a multiple
/// of 64): a thread per 64.
pub fn hadamard_launch(values: usize) -> Launch {
    let chunks = values / 64;
    Launch {
        blocks: chunks.div_ceil(HADAMARD_THREADS).max(1) as u32,
        threads: HADAMARD_THREADS as u32,
    }
}

/// A one-dimensional launch: one block per item (token, pair or row), its
/// threads striding over the item's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub blocks: u32,
    pub threads: u32,
}

impl Launch {
    /// Threads per block at most.
    pub const MAX_THREADS: usize = 256;

    /// `items` blocks, each with enough whole warps for `work` values (at
    /// most [`Launch::MAX_THREADS`]).
    pub fn per_item(items: usize, work: usize) -> Launch {
        let threads = work.div_ceil(32).max(1) * 32;
        Launch {
            blocks: items as u32,
            threads: threads.min(Self::MAX_THREADS) as u32,
        }
    }
}

/// The host side of a rotation on the GPU: which row reads which cos/sin
/// table, and the tables (`head_dim / 2` values each), computed exactly as
/// the CPU kernels compute them.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeTables {
    /// One table index per gathered row; [`NO_TABLE`] for none.
    pub tables: Vec<u32>,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

/// The table index of a row gathered without rotation (and the slot of a
/// padded token in `write_kv`).
pub const NO_TABLE: u32 = u32::MAX;

impl RopeTables {
    /// `rows` rows, all rotated by `rotation` (a context shift's K).
    pub fn uniform(rows: usize, rotation: &Rotation) -> RopeTables {
        let (cos, sin) = rotation.cos_sin();
        RopeTables {
            tables: vec![0; rows],
            cos,
            sin,
        }
    }

    /// `rows` rows gathered unrotated (V).
    pub fn none(rows: usize) -> RopeTables {
        RopeTables {
            tables: vec![NO_TABLE; rows],
            cos: Vec::new(),
            sin: Vec::new(),
        }
    }

    /// One table per distinct delta, row `i` by `deltas[i]` (rotate_k).
    pub fn per_delta(deltas: &[i64], rotation: &Rotation) -> RopeTables {
        let mut seen: Vec<i64> = Vec::new();
        let mut t = RopeTables::none(0);
        for &d in deltas {
            let i = match seen.iter().position(|&x| x == d) {
                Some(i) => i,
                None => {
                    let (c, s) = Rotation {
                        delta: d,
                        ..rotation.clone()
                    }
                    .cos_sin();
                    t.cos.extend(c);
                    t.sin.extend(s);
                    seen.push(d);
                    seen.len() - 1
                }
            };
            t.tables.push(i as u32);
        }
        t
    }
}

/// Positions per partition and threads per block of both paged attention
/// kernels (`TS_ATT_PART`, `TS_ATT_THREADS` in their sources).
pub const ATT_PART: usize = 512;
pub const ATT_THREADS: usize = 128;

/// Metal's paged attention launches (`gpu/paged_attention.metal`), shared by
/// its launcher (`metal.rs`) and the kernel-emu build, which runs the same
/// source on the CPU.
#[cfg(any(
    feature = "kernel-emu",
    all(feature = "metal", target_vendor = "apple")
))]
pub(crate) mod metal_plan {
    use super::{attention_split, Launch, ATT_THREADS};
    use crate::PagedMeta;

    /// `TsAttnArgs` of `gpu/paged_attention.metal`.
    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct AttnArgs {
        pub n_heads: u32,
        pub n_kv_heads: u32,
        pub head_dim: u32,
        pub block_size: u32,
        pub max_blocks: u32,
        pub scale: f32,
        pub window: u32,
        pub parts: u32,
        pub part_len: u32,
    }

    /// One paged attention on Metal: `parts` partitions of `part_len`
    /// positions per (token, head), as the CUDA per-query kernel splits
    /// them ([`attention_split`]), a threadgroup of `threads` each over
    /// `grid`; then, with more than one partition, the merge, a
    /// threadgroup of `merge_threads` per (head, token). One partition
    /// (`direct`) normalises its own output into the output buffer.
    pub(crate) struct Plan {
        pub args: AttnArgs,
        pub parts: usize,
        pub grid: (usize, usize, usize),
        pub threads: usize,
        pub direct: bool,
        pub merge_grid: (usize, usize, usize),
        pub merge_threads: usize,
    }

    pub(crate) fn attention(
        meta: &PagedMeta,
        (n_heads, n_kv_heads, head_dim): (usize, usize, usize),
    ) -> Plan {
        let tokens = meta.token_pos.len();
        let (part_len, parts) = attention_split(meta, n_heads);
        let u = |x: usize| x as u32;
        Plan {
            args: AttnArgs {
                n_heads: u(n_heads),
                n_kv_heads: u(n_kv_heads),
                head_dim: u(head_dim),
                block_size: u(meta.block_size),
                max_blocks: u(meta.max_blocks),
                scale: meta.scale,
                window: u(meta.window),
                parts: u(parts),
                part_len: u(part_len),
            },
            parts,
            grid: (n_heads, tokens, parts),
            threads: ATT_THREADS,
            direct: parts == 1,
            merge_grid: (n_heads, tokens, 1),
            merge_threads: Launch::per_item(1, head_dim).threads as usize,
        }
    }
}

/// The longest context one query of a paged attention launch sees.
fn longest_context(meta: &crate::PagedMeta) -> usize {
    meta.token_pos
        .iter()
        .map(|&p| p as usize + 1 - crate::window_start(p as usize, meta.window))
        .max()
        .unwrap_or(1)
}

/// Partitions of a paged attention launch (Metal: [`ATT_PART`] positions
/// each): enough for the longest context one of its queries sees.
pub fn attention_parts(meta: &crate::PagedMeta) -> usize {
    longest_context(meta).div_ceil(ATT_PART).max(1)
}

/// Thread blocks of partial states the CUDA attention aims to stay within.
pub const ATT_STATES: usize = 1 << 14;

/// Partitions a short partition may make: 16 or 32 positions serve short
/// contexts (each warp of a block takes a few positions, one after
/// another), not long ones (the merge of many partials costs more).
const SHORT_PARTS: usize = 16;

/// Positions per partition and partitions of a CUDA paged attention launch
/// over `n_heads` query heads. A block's positions are read one after
/// another, so few long partitions leave the GPU idle where there are few
/// queries (decode: one block per head and all its positions); the
/// partition is the shortest of 16 and 32 positions (while that makes at
/// most [`SHORT_PARTS`] partitions), 64, 128, 256 and [`ATT_PART`] that
/// keeps the launch within [`ATT_STATES`] partial states (tokens × heads ×
/// partitions), or [`ATT_PART`]. On an H200, 16 positions rather than 64
/// took a 135M model's decode (contexts under 150) from 618 to 767 tok/s;
/// at 2,048 positions 64 stays (16 gave 384 tok/s against 500).
/// [`crate::tuning::Tuning::gpu_att_part`] puts its length first instead.
pub fn attention_split(meta: &crate::PagedMeta, n_heads: usize) -> (usize, usize) {
    let longest = longest_context(meta);
    let queries = meta.token_pos.len().max(1) * n_heads;
    let fits = |p: usize| queries * longest.div_ceil(p) <= ATT_STATES;
    let part = match crate::tuning::get().gpu_att_part {
        Some(first) => [first, 64, 128, 256].into_iter().find(|&p| fits(p)),
        None => [16, 32]
            .into_iter()
            .find(|&p| longest.div_ceil(p) <= SHORT_PARTS && fits(p))
            .or_else(|| [64, 128, 256].into_iter().find(|&p| fits(p))),
    }
    .unwrap_or(ATT_PART);
    (part, longest.div_ceil(part).max(1))
}

/// Query rows (token × query head pairs) one block of the CUDA tiled
/// attention holds for each head dimension it has a kernel for
/// (`TS_TILE_ROWS_*` in its source); other head dimensions take the
/// per-query kernel.
pub const TILE_ROWS: [(usize, usize); 2] = [(64, 32), (128, 16)];

/// Partial states the tiled attention aims to stay within.
pub const TILE_STATES: usize = 1 << 16;

/// A launch of the CUDA tiled attention: each tile is a run of consecutive
/// tokens of one sequence and a range of query heads of one KV head group,
/// at most `rows` (token, head) rows; a block per (tile, partition of
/// `part_len` positions) loads each K/V row once for all of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionTiles {
    /// Per tile: first token, tokens, first query head, query heads, and
    /// the positions its tokens see, `from..to`.
    pub tiles: Vec<[u32; 6]>,
    pub part_len: usize,
    pub parts: usize,
    /// Rows per block, as the kernel for this head dimension has them.
    pub rows: usize,
}

/// The tiled plan of a paged attention launch over `n_heads` query heads
/// (`n_kv_heads` K/V heads of `head_dim`), or `None` where the per-query
/// kernel serves better or alone can: a head dimension without a tiled
/// kernel, or mostly one token per sequence (decode), where sharing K/V
/// rows between tokens saves nothing and long contexts want the per-query
/// kernel's short partitions.
pub fn attention_tiles(
    meta: &crate::PagedMeta,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
) -> Option<AttentionTiles> {
    let &(_, rows) = TILE_ROWS.iter().find(|(d, _)| *d == head_dim)?;
    let tokens = meta.token_pos.len();
    // Runs of consecutive tokens of one sequence.
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for t in 0..tokens {
        match runs.last_mut() {
            Some((s, n)) if meta.token_seq[*s] == meta.token_seq[t] => *n += 1,
            _ => runs.push((t, 1)),
        }
    }
    if n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) || tokens < 8 * runs.len() {
        return None;
    }
    let group = n_heads / n_kv_heads;
    let (tile_tokens, tile_heads) = if group <= rows {
        (rows / group, group)
    } else {
        (1, rows)
    };
    let mut tiles = Vec::new();
    let mut longest = 1;
    for &(first, n) in &runs {
        for t0 in (first..first + n).step_by(tile_tokens) {
            let nt = tile_tokens.min(first + n - t0);
            let pos = &meta.token_pos[t0..t0 + nt];
            let from = pos
                .iter()
                .map(|&p| crate::window_start(p as usize, meta.window))
                .min()
                .unwrap_or(0);
            let to = pos.iter().map(|&p| p as usize + 1).max().unwrap_or(1);
            longest = longest.max(to - from);
            for g in 0..n_kv_heads {
                for h0 in (g * group..(g + 1) * group).step_by(tile_heads) {
                    let nh = tile_heads.min((g + 1) * group - h0);
                    tiles.push([t0, nt, h0, nh, from, to].map(|x| x as u32));
                }
            }
        }
    }
    let queries = tokens * n_heads;
    let part_len = (6..)
        .map(|s| 1usize << s)
        .find(|&p| p >= longest || queries * longest.div_ceil(p) <= TILE_STATES)
        .expect("some power of two covers the context");
    Some(AttentionTiles {
        tiles,
        part_len,
        parts: longest.div_ceil(part_len),
        rows,
    })
}

/// The rows `rotate_k` actually moves: those with a nonzero delta.
pub fn moved_rows(slots: &[u32], deltas: &[i64]) -> (Vec<u32>, Vec<i64>) {
    slots
        .iter()
        .zip(deltas)
        .filter(|(_, &d)| d != 0)
        .map(|(&s, &d)| (s, d))
        .unzip()
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(all(test, feature = "cuda"))]
mod cuda_tests;
#[cfg(feature = "kernel-emu")]
pub mod emu;
#[cfg(feature = "cuda")]
pub mod forward;
// Without `cuda`, the forward's launchers serve the kernel-emu tests alone.
#[cfg(any(feature = "cuda", feature = "kernel-emu"))]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod launch;
#[cfg(all(feature = "metal", target_vendor = "apple"))]
pub(crate) mod metal;
#[cfg(all(test, feature = "metal", target_vendor = "apple"))]
mod metal_tests;
#[cfg(all(
    test,
    any(
        feature = "cuda",
        feature = "kernel-emu",
        all(feature = "metal", target_vendor = "apple")
    )
))]
mod parity;

#[cfg(test)]
mod tests {
    use super::*;

    /// `(name, [(param, index)])` of every `TS_KERNEL` in the source.
    fn entry_points(src: &str) -> Vec<(String, Vec<(String, usize)>)> {
        let mut out = Vec::new();
        for part in src.split("TS_KERNEL(").skip(1) {
            let Some(end) = part.find(')').and_then(|_| part.find('{')) else {
                continue;
            };
            let head = &part[..end];
            let name = head.split(',').next().unwrap_or("").trim().to_string();
            if name == "name" {
                continue; // the vocabulary's own description
            }
            let mut params = Vec::new();
            for p in head.split("TS_").skip(1) {
                let Some(args) = p.strip_prefix("BUF(").or_else(|| p.strip_prefix("ARG(")) else {
                    continue;
                };
                let args: Vec<&str> = args.split(')').next().unwrap_or("").split(',').collect();
                if let [_, n, i] = args[..] {
                    params.push((n.trim().to_string(), i.trim().parse().unwrap_or(usize::MAX)));
                }
            }
            out.push((name, params));
        }
        out
    }

    #[test]
    fn every_bound_kernel_and_buffer_index_exists_in_the_source() {
        let found = entry_points(KV_OPS_SOURCE);
        assert_eq!(found.len(), KERNELS.len(), "{found:?}");
        for k in KERNELS {
            let (_, params) = found
                .iter()
                .find(|(n, _)| n == k.name)
                .unwrap_or_else(|| panic!("{} is not in gpu/kv_ops.h", k.name));
            let want: Vec<(String, usize)> = k
                .params
                .iter()
                .enumerate()
                .map(|(i, p)| (p.to_string(), i))
                .collect();
            assert_eq!(params, &want, "{}", k.name);
        }
    }

    /// What Metal compiles holds every entry point the launchers bind,
    /// with no include left unresolved.
    #[test]
    fn metal_sources_expand_to_every_entry_point() {
        let kv = metal_source("kv_ops.metal").unwrap();
        let att = metal_source("paged_attention.metal").unwrap();
        for src in [&kv, &att] {
            assert!(!src.contains("#include \""));
            assert!(src.contains("#define TS_KERNEL"), "the Metal prelude");
        }
        for k in KERNELS {
            assert!(kv.contains(&format!("TS_KERNEL({},", k.name)), "{}", k.name);
        }
        for suffix in ["f32", "f16", "bf16"] {
            assert!(att.contains(&format!("TS_ATTENTION({suffix},")), "{suffix}");
        }
        assert!(att.contains("kernel void tessera_attention_merge("));
        // The launchers' partition size and block size are the sources'.
        let cuda = include_str!("../../gpu/paged_attention.cu");
        for src in [cuda, att.as_str()] {
            assert!(src.contains(&format!("#define TS_ATT_PART {ATT_PART}\n")));
            assert!(src.contains(&format!("#define TS_ATT_THREADS {ATT_THREADS}\n")));
        }
        // The tiled kernels' rows per block and names are the plan's.
        for (dim, rows) in TILE_ROWS {
            assert!(cuda.contains(&format!("#define TS_TILE_ROWS_{dim} {rows}\n")));
            for suffix in ["f32", "f16", "bf16"] {
                assert!(cuda.contains(&format!("TS_TILED({suffix}, ")), "{suffix}");
                assert!(cuda.contains(&format!(", {dim})\n")), "{dim}");
            }
        }
        assert!(metal_source("nope.metal").is_err());
    }

    #[test]
    fn attention_splits_cover_every_context_within_the_state_budget() {
        let split = |positions: &[u32], window: usize, heads: usize| {
            let meta = crate::PagedMeta {
                block_size: 16,
                block_tables: &[],
                max_blocks: 0,
                token_seq: &[],
                token_pos: positions,
                scale: 1.0,
                window,
            };
            attention_split(&meta, heads)
        };
        // Decode deep in a context: short partitions, many blocks.
        assert_eq!(split(&[2047], 0, 9), (64, 32));
        // A 512-token prefill chunk: longer ones, within the budget.
        let chunk: Vec<u32> = (0..512).collect();
        assert_eq!(split(&chunk, 0, 9), (256, 2));
        // Too many queries for any budget: the kernel's own partition.
        let wide: Vec<u32> = (0..4096).collect();
        assert_eq!(split(&wide, 0, 32), (ATT_PART, 8));
        // A sliding window bounds the context; one position is one partition.
        assert_eq!(split(&[9000], 1024, 8), (64, 16));
        assert_eq!(split(&[0], 0, 9), (16, 1));
        // Short contexts: 16 or 32 positions, at most 16 partitions.
        assert_eq!(split(&[143], 0, 9), (16, 9));
        assert_eq!(split(&[400], 0, 9), (32, 13));
        assert_eq!(split(&[600], 0, 9), (64, 10));
        for (pos, heads) in [(100u32, 4usize), (1299, 8), (40, 9), (70_000, 32)] {
            let (part, parts) = split(&[pos], 0, heads);
            assert!(
                part <= ATT_PART
                    && parts * part > pos as usize
                    && (parts - 1) * part <= pos as usize
            );
        }
    }

    /// Every (token, query head) pair of a tiled launch is in exactly one
    /// tile, with its sequence, its KV head group and the positions it
    /// sees; decode launches and other head dimensions take the per-query
    /// kernel.
    #[test]
    fn attention_tiles_cover_every_query_once() {
        let meta = |seqs: &'static [u32], pos: &'static [u32], window| crate::PagedMeta {
            block_size: 16,
            block_tables: &[],
            max_blocks: 0,
            token_seq: seqs,
            token_pos: pos,
            scale: 1.0,
            window,
        };
        let check = |m: &crate::PagedMeta, nh: usize, kvh: usize, hd: usize| {
            let plan = attention_tiles(m, nh, kvh, hd).expect("a tiled launch");
            let mut seen = vec![0; m.token_pos.len() * nh];
            for &[t0, nt, h0, nhd, from, to] in &plan.tiles {
                let (t0, nt, h0, nhd) = (t0 as usize, nt as usize, h0 as usize, nhd as usize);
                assert!(nt * nhd <= plan.rows && nt > 0 && nhd > 0);
                let g = h0 / (nh / kvh);
                assert_eq!((h0 + nhd - 1) / (nh / kvh), g, "one KV head per tile");
                for t in t0..t0 + nt {
                    assert_eq!(m.token_seq[t], m.token_seq[t0], "one sequence per tile");
                    let p = m.token_pos[t] as usize;
                    assert!(from as usize <= crate::window_start(p, m.window) && p < to as usize);
                    for h in h0..h0 + nhd {
                        seen[t * nh + h] += 1;
                    }
                }
                assert!(plan.parts * plan.part_len >= (to - from) as usize);
            }
            assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
            plan
        };
        static CHUNK: [u32; 512] = {
            let mut p = [0u32; 512];
            let mut i = 0;
            while i < 512 {
                p[i] = i as u32;
                i += 1;
            }
            p
        };
        static ZEROS: [u32; 512] = [0; 512];
        // A 512-token prefill, GQA 3: ten tokens of three heads a tile.
        let plan = check(&meta(&ZEROS, &CHUNK, 0), 9, 3, 64);
        assert_eq!(plan.tiles.len(), 52 * 3);
        assert_eq!((plan.part_len, plan.parts), (64, 8));
        // Head dim 128, GQA 4; a sliding window.
        check(&meta(&ZEROS[..40], &CHUNK[100..140], 0), 8, 2, 128);
        check(&meta(&ZEROS[..100], &CHUNK[300..400], 64), 4, 1, 64);
        // Groups wider than a tile: a token a tile, heads split.
        let wide = check(&meta(&ZEROS[..16], &CHUNK[..16], 0), 40, 1, 64);
        assert_eq!(wide.tiles.len(), 16 * 2);
        // Two sequences' chunks in one launch.
        static SEQS: [u32; 30] = {
            let mut s = [0u32; 30];
            let mut i = 12;
            while i < 30 {
                s[i] = 1;
                i += 1;
            }
            s
        };
        check(&meta(&SEQS, &CHUNK[200..230], 0), 6, 2, 64);
        // Decode (a token per sequence) and head dims without a kernel.
        static DECODE: [u32; 4] = [0, 1, 2, 3];
        assert_eq!(
            attention_tiles(&meta(&DECODE, &CHUNK[..4], 0), 9, 3, 64),
            None
        );
        assert_eq!(attention_tiles(&meta(&ZEROS, &CHUNK, 0), 4, 4, 256), None);
    }

    #[test]
    fn launches_cover_the_work_in_whole_warps() {
        assert_eq!(
            Launch::per_item(5, 192),
            Launch {
                blocks: 5,
                threads: 192
            }
        );
        assert_eq!(
            Launch::per_item(1, 1000),
            Launch {
                blocks: 1,
                threads: 256
            }
        );
        assert_eq!(
            Launch::per_item(3, 1),
            Launch {
                blocks: 3,
                threads: 32
            }
        );
    }

    #[test]
    fn per_delta_tables_are_shared_by_equal_deltas() {
        let r = Rotation {
            style: crate::RopeStyle::Neox,
            inv_freq: vec![1.0, 0.5],
            delta: 0,
        };
        let t = RopeTables::per_delta(&[3, -2, 3], &r);
        assert_eq!(t.tables, [0, 1, 0]);
        assert_eq!(t.cos.len(), 4);
        let three = Rotation {
            delta: 3,
            ..r.clone()
        }
        .cos_sin();
        assert_eq!(&t.cos[..2], &three.0[..]);
        assert_eq!(&t.sin[..2], &three.1[..]);
    }
}
