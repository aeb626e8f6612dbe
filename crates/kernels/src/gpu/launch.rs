//! Kernel launches as data: which kernel, its grid and its arguments, the
//! same for the CUDA launchers (`cuda.rs`, which hand each [`Call`] to the
//! driver) and the kernel-emu build (`emu.rs`, which runs the same kernel
//! source on the CPU, a fiber per GPU thread). So the emulator checks the
//! launchers' shapes, argument order and kernel names along with the
//! kernels.

use candle_core::quantized::GgmlDType;
use candle_core::{bail, Result};

use super::{attention_split, attention_tiles, hadamard_launch, AttentionTiles, ATT_THREADS};
use crate::{KvType, PagedMeta};

/// One kernel argument: a device address, a u32 or an f32.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Arg {
    Ptr(u64),
    U32(u32),
    F32(f32),
}

/// The compiled source a kernel lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Module {
    /// `gpu/kv_ops.cu` (the shared `kv_ops.h`).
    KvOps,
    /// `gpu/paged_attention.cu`.
    Attention,
    /// `gpu/forward.cu`.
    Forward,
}

/// One kernel launch: a grid of `grid` blocks of `threads` threads (one
/// dimension), with `shared` bytes of dynamic shared memory.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Call {
    pub module: Module,
    pub name: String,
    pub grid: (u32, u32, u32),
    pub threads: u32,
    pub shared: u32,
    pub args: Vec<Arg>,
}

/// Device addresses of one paged attention launch: queries (f32,
/// `[tokens, n_heads, head_dim]`), the K and V caches (of the element type
/// `cache` names: "f32", "f16", "bf16", "q8_0" or "q4_0") and the output
/// (f32, as the queries). Over a quantized cache the launch rotates the
/// queries in place into the cache's basis (they are scratch to it) and
/// the output back.
pub(crate) struct AttnBuffers {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub out: u64,
    pub cache: &'static str,
}

/// One paged attention launch, every buffer on the device already: the
/// per-query kernel (or, with `tiles`, the tiled one over that many tiles)
/// writing `parts` partial states per (token, head) of `part_len`
/// positions each, then the merge into `bufs.out`. Allocates nothing and
/// copies nothing, so it can be captured into a CUDA graph.
pub(crate) struct AttnLaunch<'a> {
    pub bufs: &'a AttnBuffers,
    /// Block tables (`[sequences, max_blocks]`), sequence and position of
    /// each token.
    pub tables: u64,
    pub seqs: u64,
    pub pos: u64,
    /// The tiled kernel's tile table and tile count.
    pub tiles: Option<(u64, usize)>,
    /// Partial outputs, maxima and sums: room for `tokens · n_heads ·
    /// parts` states.
    pub partials: (u64, u64, u64),
    pub heads: (usize, usize, usize),
    pub tokens: usize,
    pub block_size: usize,
    pub max_blocks: usize,
    pub scale: f32,
    pub window: usize,
    pub parts: usize,
    pub part_len: usize,
    /// A u32 per (token, head), zero, that the per-query kernel counts its
    /// finished partitions in (and leaves zero): the last merges them in
    /// the same launch (`tessera_paged_attention_merged_*`). `None`: the
    /// merge is a launch of its own.
    pub counters: Option<u64>,
}

/// How a paged attention launch splits its work: the tiled kernel's plan
/// (prefill chunks) or the per-query kernel's partitions (`part_len`
/// positions, `parts` of them).
pub(crate) struct AttnPlan {
    pub tiles: Option<AttentionTiles>,
    pub part_len: usize,
    pub parts: usize,
}

impl AttnPlan {
    /// The plan for `meta`'s queries over `heads` (n_heads, n_kv_heads,
    /// head_dim).
    pub fn new(meta: &PagedMeta, heads: (usize, usize, usize)) -> Result<AttnPlan> {
        let (n_heads, n_kv_heads, head_dim) = heads;
        if head_dim > 256 {
            bail!("paged_attention on CUDA supports head_dim up to 256, not {head_dim}")
        }
        let tiles = attention_tiles(meta, n_heads, n_kv_heads, head_dim);
        let (part_len, parts) = match &tiles {
            Some(t) => (t.part_len, t.parts),
            None => attention_split(meta, n_heads),
        };
        Ok(AttnPlan {
            tiles,
            part_len,
            parts,
        })
    }

    /// Partial states the plan writes (each of `head_dim` outputs, a
    /// maximum and a sum).
    pub fn states(&self, tokens: usize, n_heads: usize) -> usize {
        tokens * n_heads * self.parts
    }
}

/// `values` f32 values at `x` (a multiple of 64) rotated in place, 64 at
/// a time (`tessera_hadamard_rows`; it is its own inverse).
pub(crate) fn hadamard_call(x: u64, values: usize) -> Call {
    let l = hadamard_launch(values);
    Call {
        module: Module::KvOps,
        name: "tessera_hadamard_rows".into(),
        grid: (l.blocks, 1, 1),
        threads: l.threads,
        shared: 0,
        args: vec![Arg::Ptr(x), Arg::U32((values / 64) as u32)],
    }
}

/// The launches of one paged attention, in order: over a quantized cache
/// the queries' rotation, then the attention kernel, then (unless it
/// normalised or merged its own output) the merge, then the output's
/// rotation back.
pub(crate) fn attention_calls(a: &AttnLaunch) -> Vec<Call> {
    let (n_heads, n_kv_heads, head_dim) = a.heads;
    let (kind, dims, grid) = match a.tiles {
        Some((_, n)) => ("tiled", format!("_{head_dim}"), (u(n), u(a.parts), 1)),
        None => (
            "paged",
            String::new(),
            (u(n_heads), u(a.tokens), u(a.parts)),
        ),
    };
    // One partition of the per-query kernel: it normalises its own sums
    // into the output, and there is nothing to merge; with counters, the
    // per-query kernel over several merges them itself.
    let direct = a.tiles.is_none() && a.parts == 1;
    let merged = match a.counters {
        Some(c) if a.tiles.is_none() && a.parts > 1 => Some(c),
        _ => None,
    };
    let quantized = KvType::parse(a.bufs.cache).is_some_and(|t| t.is_quantized());
    let values = a.tokens * n_heads * head_dim;
    let mut calls = Vec::new();
    if quantized {
        calls.push(hadamard_call(a.bufs.q, values));
    }
    let (mut po, pm, ps) = a.partials;
    if direct {
        po = a.bufs.out;
    }
    let mut args = vec![
        Arg::Ptr(a.bufs.q),
        Arg::Ptr(a.bufs.k),
        Arg::Ptr(a.bufs.v),
        Arg::Ptr(a.tables),
        Arg::Ptr(a.seqs),
        Arg::Ptr(a.pos),
    ];
    if let Some((t, _)) = a.tiles {
        args.push(Arg::Ptr(t));
    }
    args.extend([Arg::Ptr(po), Arg::Ptr(pm), Arg::Ptr(ps)]);
    args.extend([Arg::U32(u(n_heads)), Arg::U32(u(n_kv_heads))]);
    if a.tiles.is_none() {
        args.push(Arg::U32(u(head_dim)));
    }
    args.extend([
        Arg::U32(u(a.block_size)),
        Arg::U32(u(a.max_blocks)),
        Arg::F32(a.scale),
        Arg::U32(u(a.window)),
        Arg::U32(u(a.parts)),
        Arg::U32(u(a.part_len)),
    ]);
    if let Some(c) = merged {
        args.extend([Arg::Ptr(a.bufs.out), Arg::Ptr(c)]);
    }
    calls.push(Call {
        module: Module::Attention,
        name: format!(
            "tessera_{kind}_attention_{}{}{dims}",
            if merged.is_some() { "merged_" } else { "" },
            a.bufs.cache
        ),
        grid,
        threads: ATT_THREADS as u32,
        shared: 0,
        args,
    });
    if !direct && merged.is_none() {
        calls.push(Call {
            module: Module::Attention,
            name: "tessera_attention_merge".into(),
            grid: (u(n_heads), u(a.tokens), 1),
            threads: super::Launch::per_item(1, head_dim).threads,
            shared: 0,
            args: vec![
                Arg::Ptr(po),
                Arg::Ptr(pm),
                Arg::Ptr(ps),
                Arg::Ptr(a.bufs.out),
                Arg::U32(u(n_heads)),
                Arg::U32(u(head_dim)),
                Arg::U32(u(a.parts)),
            ],
        });
    }
    if quantized {
        calls.push(hadamard_call(a.bufs.out, values));
    }
    calls
}

// ---- the forward's kernels (`gpu/forward.cu`) -----------------------------

/// Inputs one GEMV block multiplies at once (`TS_FWD_MAXT`).
pub(crate) const MAXT: u32 = 8;
/// Warps per GEMV block (`TS_FWD_WARPS`), shared by its rows.
pub(crate) const BLOCK_WARPS: u32 = 4;
/// The warps per row the products are compiled for (`_w1`, `_w2`, `_w4`).
pub(crate) const ROW_WARPS: [u32; 3] = [1, 2, 4];
/// Threads of the row kernels (`TS_NORM_THREADS`).
pub(crate) const NORM_THREADS: u32 = 256;
/// The most shared memory a product that normalizes its input may stage
/// it in (the token's row, f32): under the 48 KiB a block gets without
/// opting in, with room for the kernels' own reduction arrays.
pub(crate) const NORM_STAGE_BYTES: usize = 46 * 1024;

/// A weight's storage as the GEMV kernels read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemvFormat {
    Q4_0,
    Q4_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
    F32,
    F16,
}

impl GemvFormat {
    pub(crate) const ALL: [GemvFormat; 8] = [
        GemvFormat::Q4_0,
        GemvFormat::Q4_1,
        GemvFormat::Q8_0,
        GemvFormat::Q4K,
        GemvFormat::Q5K,
        GemvFormat::Q6K,
        GemvFormat::F32,
        GemvFormat::F16,
    ];

    /// The format of a GGML tensor type; `None` for those without a kernel.
    pub fn from_ggml(t: GgmlDType) -> Option<GemvFormat> {
        Some(match t {
            GgmlDType::Q4_0 => GemvFormat::Q4_0,
            GgmlDType::Q4_1 => GemvFormat::Q4_1,
            GgmlDType::Q8_0 => GemvFormat::Q8_0,
            GgmlDType::Q4K => GemvFormat::Q4K,
            GgmlDType::Q5K => GemvFormat::Q5K,
            GgmlDType::Q6K => GemvFormat::Q6K,
            GgmlDType::F32 => GemvFormat::F32,
            GgmlDType::F16 => GemvFormat::F16,
            _ => return None,
        })
    }

    /// Values per block: a row's width must be a multiple.
    pub fn block_values(self) -> usize {
        match self {
            GemvFormat::Q4_0 | GemvFormat::Q4_1 | GemvFormat::Q8_0 => 32,
            GemvFormat::Q4K | GemvFormat::Q5K | GemvFormat::Q6K => 256,
            GemvFormat::F32 | GemvFormat::F16 => 8,
        }
    }

    /// What one lane takes at a time from a row of `k` values (`ITEMS` in
    /// the kernels): 8 weights, Q6_K's 16.
    pub(crate) fn items(self, k: usize) -> usize {
        match self {
            GemvFormat::Q6K => k / 16,
            _ => k / 8,
        }
    }

    /// Items a lane loads in one pass (the kernels' `U1` and `UM`): for
    /// one token, 8 of the formats whose items are two or three words,
    /// 4 of the others; for several, 2.
    pub fn per_pass(self, single: bool) -> usize {
        match (single, self) {
            (true, GemvFormat::Q4_0 | GemvFormat::Q4_1 | GemvFormat::Q8_0) => 8,
            (true, _) => 4,
            (false, _) => 2,
        }
    }

    /// Warps per output row: the fewest that take a row of `k` values in
    /// one pass of `per_pass` items a lane, at most four (a long row in
    /// one warp is passes of loads one after another, with few rows to
    /// hide them behind).
    pub fn row_warps(self, k: usize, per_pass: usize) -> u32 {
        ROW_WARPS
            .into_iter()
            .find(|&w| self.items(k) <= 32 * w as usize * per_pass)
            .unwrap_or(4)
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            GemvFormat::Q4_0 => "q4_0",
            GemvFormat::Q4_1 => "q4_1",
            GemvFormat::Q8_0 => "q8_0",
            GemvFormat::Q4K => "q4_k",
            GemvFormat::Q5K => "q5_k",
            GemvFormat::Q6K => "q6_k",
            GemvFormat::F32 => "f32",
            GemvFormat::F16 => "f16",
        }
    }
}

/// One weight for the products: its blocks' device address, format and
/// shape `[rows, k]`.
#[derive(Debug, Clone, Copy)]
pub struct DevWeight {
    pub ptr: u64,
    pub format: GemvFormat,
    pub rows: usize,
    pub k: usize,
}

/// Where a product reads and writes: `tokens` input rows `x_stride`
/// floats apart (a multiple of 4, the buffer 16-byte aligned), outputs
/// `y_stride` floats apart; `acc` adds to `y` instead of storing. With
/// `norm` (the norm's weights and epsilon), the product is of each input
/// row's RMSNorm, computed by the product's blocks (see
/// `Forward::fuses_norm`).
#[derive(Debug, Clone, Copy)]
pub struct GemvIo {
    pub x: u64,
    pub y: u64,
    pub tokens: usize,
    pub x_stride: usize,
    pub y_stride: usize,
    pub acc: bool,
    pub norm: Option<(u64, f32)>,
}

/// The q/k/v step of one layer (`Forward::qkv`): `qkv` holds each token's
/// q, k and v outputs side by side, `stride` floats apart; biases and
/// per-head norm weights are device addresses or 0 for none; `cos`/`sin`
/// hold `head_dim / 2` angles per token; K and V go to the layer's caches
/// at `slots` (device, one per token; `Forward::qkv` checks the host copy).
#[derive(Debug, Clone, Copy)]
pub struct QkvStep {
    pub qkv: u64,
    pub stride: usize,
    pub biases: [u64; 3],
    pub norms: [u64; 2],
    pub eps: f32,
    pub cos: u64,
    pub sin: u64,
    pub q_out: u64,
    pub slots: u64,
    pub tokens: usize,
    /// Query heads, K/V heads, head dimension.
    pub heads: (usize, usize, usize),
    pub neox: bool,
}

fn u(x: usize) -> u32 {
    x as u32
}

fn forward_call(name: String, grid: (u32, u32, u32), threads: u32, args: Vec<Arg>) -> Call {
    Call {
        module: Module::Forward,
        name,
        grid,
        threads,
        shared: 0,
        args,
    }
}

/// Every kernel name of `forward.cu` the launchers below use.
pub(crate) fn forward_kernels() -> Vec<String> {
    let mut names = Vec::new();
    for g in GemvFormat::ALL {
        let n = g.name();
        for w in ROW_WARPS {
            for kind in ["gemv", "gemv1", "glu", "glu1", "ngemv1", "nglu1"] {
                names.push(format!("tessera_fwd_{kind}_{n}_w{w}"));
            }
        }
        names.push(format!("tessera_fwd_dequant_{n}"));
    }
    for t in KvType::ALL {
        names.push(format!("tessera_fwd_qkv_{}", t.name()));
    }
    for n in ["rms_norm", "residual", "act_mul"] {
        names.push(format!("tessera_fwd_{n}"));
    }
    names
}

/// A product over `rows` output rows (`glu`: the gated activation of a
/// stacked gate|up weight, `rows` of its halves), `flag` its last integer
/// argument (GEMV: add into y; gated: the activation), `row_warps` the
/// warps per row (`None`: by the row's length; a count without a kernel
/// takes one). The caller checked the shapes, and that a normalized input
/// is one token.
pub(crate) fn product_call(
    w: &DevWeight,
    io: &GemvIo,
    rows: usize,
    glu: bool,
    flag: u32,
    row_warps: Option<u32>,
) -> Call {
    let single = io.tokens == 1;
    let warps = row_warps.unwrap_or_else(|| w.format.row_warps(w.k, w.format.per_pass(single)));
    let warps = ROW_WARPS[ROW_WARPS.iter().position(|&x| x == warps).unwrap_or(0)];
    let kind = match (single, io.norm.is_some(), glu) {
        (true, true, false) => "ngemv1",
        (true, true, true) => "nglu1",
        (true, false, false) => "gemv1",
        (true, false, true) => "glu1",
        (false, _, false) => "gemv",
        (false, _, true) => "glu",
    };
    let per_block = if single { 1 } else { MAXT };
    let (rows, k, tokens) = (u(rows), u(w.k), u(io.tokens));
    // The normalized inputs' rows in shared memory.
    let (nw, eps) = io.norm.unwrap_or((0, 0.0));
    let mut c = forward_call(
        format!("tessera_fwd_{kind}_{}_w{warps}", w.format.name()),
        (
            rows.div_ceil(BLOCK_WARPS / warps),
            tokens.div_ceil(per_block),
            1,
        ),
        BLOCK_WARPS * 32,
        vec![
            Arg::Ptr(w.ptr),
            Arg::Ptr(io.x),
            Arg::Ptr(io.y),
            Arg::U32(rows),
            Arg::U32(k),
            Arg::U32(tokens),
            Arg::U32(u(io.x_stride)),
            Arg::U32(u(io.y_stride)),
            Arg::U32(flag),
            Arg::Ptr(nw),
            Arg::F32(eps),
        ],
    );
    if io.norm.is_some() {
        c.shared = k * 4;
    }
    c
}

/// `w`'s rows expanded to f32 into `scratch` (a thread per item).
pub(crate) fn dequant_call(w: &DevWeight, scratch: u64) -> Call {
    let items = w.rows * w.format.items(w.k);
    forward_call(
        format!("tessera_fwd_dequant_{}", w.format.name()),
        (u(items.div_ceil(256)), 1, 1),
        256,
        vec![
            Arg::Ptr(w.ptr),
            Arg::Ptr(scratch),
            Arg::U32(u(w.rows)),
            Arg::U32(u(w.k)),
        ],
    )
}

/// A row kernel (`rms_norm`, `residual`): a block per row of `n_rows`
/// rows of `n` values, its arguments the addresses, `n`, then the floats.
pub(crate) fn per_row_call(
    kernel: &str,
    n_rows: usize,
    ptrs: &[u64],
    n: usize,
    floats: &[f32],
) -> Call {
    let mut args: Vec<Arg> = ptrs.iter().map(|&p| Arg::Ptr(p)).collect();
    args.push(Arg::U32(u(n)));
    args.extend(floats.iter().map(|&f| Arg::F32(f)));
    forward_call(
        format!("tessera_fwd_{kernel}"),
        (u(n_rows), 1, 1),
        NORM_THREADS,
        args,
    )
}

/// `out[t][j] = act(gu[t][j]) · gu[t][n + j]`.
pub(crate) fn act_mul_call(gu: u64, out: u64, (tokens, n): (usize, usize), act: u32) -> Call {
    forward_call(
        "tessera_fwd_act_mul".into(),
        (u((tokens * n).div_ceil(256)), 1, 1),
        256,
        vec![
            Arg::Ptr(gu),
            Arg::Ptr(out),
            Arg::U32(u(n)),
            Arg::U32(u(tokens)),
            Arg::U32(act),
        ],
    )
}

/// One layer's q/k/v step into caches at `kc` and `vc` of type `cache`
/// (checked by the caller).
pub(crate) fn qkv_call(s: &QkvStep, (kc, vc, cache): (u64, u64, &str)) -> Call {
    let (nh, kvh, hd) = s.heads;
    let mut args = vec![Arg::Ptr(s.qkv), Arg::U32(u(s.stride))];
    args.extend(s.biases.iter().chain(&s.norms).map(|&p| Arg::Ptr(p)));
    args.extend([
        Arg::F32(s.eps),
        Arg::Ptr(s.cos),
        Arg::Ptr(s.sin),
        Arg::Ptr(s.q_out),
        Arg::Ptr(kc),
        Arg::Ptr(vc),
        Arg::Ptr(s.slots),
        Arg::U32(u(nh)),
        Arg::U32(u(kvh)),
        Arg::U32(u(hd)),
        Arg::U32(s.neox as u32),
    ]);
    forward_call(
        format!("tessera_fwd_qkv_{cache}"),
        (u(s.tokens), u(nh + 2 * kvh), 1),
        32,
        args,
    )
}
