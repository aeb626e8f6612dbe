//! The GPU kernel source run on the CPU (`kernel-emu` feature), compiled by
//! `build.rs`:
//! - `gpu/emu.cpp` (the host prelude and the shared bodies of `kv_ops.h`):
//!   each entry point called once per thread of the grid the GPU launchers
//!   use, one thread after another;
//! - `gpu/emu_cuda.cpp` and `gpu/emu_metal.cpp` (the CUDA-only and
//!   Metal-only kernel files, unchanged, against host stand-ins for CUDA's
//!   and Metal's headers): whole launches, a fiber per GPU thread, with
//!   CUDA's barriers and warp shuffles (Metal's threadgroup barriers and
//!   simdgroup reductions), from the launches the launchers build
//!   (`launch.rs`, `metal_plan`).
//!
//! The ops take CPU tensors and check their arguments as the CPU ops do.

use candle_core::{bail, DType, Result, Tensor};

use super::launch::{attention_calls, Arg, AttnBuffers, AttnLaunch, AttnPlan, Call, Module};
use super::{gather_launch, hadamard_launch, moved_rows, write_launch, Launch, RopeTables};
use crate::{cache_raw, CacheRaw, KvType, PagedMeta, Rotation};

#[repr(C)]
#[derive(Clone, Copy)]
struct TsIdx {
    blk: u32,
    tid: u32,
    nthreads: u32,
}

/// `write_kv`'s entry point: (thread, src, cache, slots, row).
type WriteFn = unsafe extern "C" fn(TsIdx, *const f32, *mut u8, *const u32, u32);
/// `rope_gather`'s: (thread, cache, out, slots, tables, cos, sin, heads,
/// head_dim, neox).
type GatherFn = unsafe extern "C" fn(
    TsIdx,
    *const u8,
    *mut f32,
    *const u32,
    *const u32,
    *const f32,
    *const f32,
    u32,
    u32,
    u32,
);

// The caches' element pointers are declared as bytes here: the C entry
// points take typed pointers of the same address (every cache buffer is
// aligned for its element type).
macro_rules! entry_points {
    (write: $($w:ident),*; gather: $($g:ident),*) => {
        extern "C" {
            $(fn $w(ix: TsIdx, src: *const f32, cache: *mut u8, slots: *const u32, row: u32);)*
            $(fn $g(
                ix: TsIdx,
                cache: *const u8,
                out: *mut f32,
                slots: *const u32,
                tables: *const u32,
                cos_t: *const f32,
                sin_t: *const f32,
                heads: u32,
                head_dim: u32,
                neox: u32,
            );)*
        }
    };
}

entry_points!(
    write: tessera_write_kv_f32, tessera_write_kv_f16, tessera_write_kv_bf16,
        tessera_write_kv_q8_0, tessera_write_kv_q4_0;
    gather: tessera_rope_gather_f32, tessera_rope_gather_f16, tessera_rope_gather_bf16,
        tessera_rope_gather_q8_0, tessera_rope_gather_q4_0
);

extern "C" {
    fn tessera_copy_blocks(ix: TsIdx, cache: *mut u16, pairs: *const u32, units: u32);
    fn tessera_gather_rows(ix: TsIdx, src: *const u16, dst: *mut u16, idx: *const u32, units: u32);
    fn tessera_scatter_rows(ix: TsIdx, src: *const u16, dst: *mut u16, idx: *const u32, units: u32);
    fn tessera_hadamard_rows(ix: TsIdx, x: *mut f32, chunks: u32);
}

/// Every thread of the grid, block after block.
fn run(l: Launch, mut thread: impl FnMut(TsIdx)) {
    for blk in 0..l.blocks {
        for tid in 0..l.threads {
            thread(TsIdx {
                blk,
                tid,
                nthreads: l.threads,
            })
        }
    }
}

/// A cache's type and the address of its storage.
#[derive(Clone, Copy)]
struct Cache {
    t: KvType,
    base: *mut u8,
}

fn cache_of(cache: &Tensor) -> Result<Cache> {
    let t = KvType::of(cache)?;
    let base = match cache_raw(cache)? {
        CacheRaw::F32(p, _) => p as *mut u8,
        CacheRaw::F16(p, _) | CacheRaw::Bf16(p, _) => p as *mut u8,
        CacheRaw::Q8_0(p, _) => p as *mut u8,
        CacheRaw::Q4_0(p, _) => p as *mut u8,
    };
    Ok(Cache { t, base })
}

fn write_fn(t: KvType) -> WriteFn {
    match t {
        KvType::F32 => tessera_write_kv_f32,
        KvType::F16 => tessera_write_kv_f16,
        KvType::Bf16 => tessera_write_kv_bf16,
        KvType::Q8_0 => tessera_write_kv_q8_0,
        KvType::Q4_0 => tessera_write_kv_q4_0,
    }
}

fn gather_fn(t: KvType) -> GatherFn {
    match t {
        KvType::F32 => tessera_rope_gather_f32,
        KvType::F16 => tessera_rope_gather_f16,
        KvType::Bf16 => tessera_rope_gather_bf16,
        KvType::Q8_0 => tessera_rope_gather_q8_0,
        KvType::Q4_0 => tessera_rope_gather_q4_0,
    }
}

/// Stores f32 `rows` (`slots.len()` rows of `row` values) at `slots`.
fn scatter(c: Cache, rows: &[f32], slots: &[u32], row: usize) {
    let f = write_fn(c.t);
    let (src, s, r) = (rows.as_ptr(), slots.as_ptr(), row as u32);
    // SAFETY: `rows` holds `slots.len() * row` values, every slot was checked
    // to lie inside the cache, and nothing else touches the cache meanwhile.
    run(write_launch(c.t, slots.len(), row), |ix| unsafe {
        f(ix, src, c.base, s, r)
    });
}

/// The rows at `slots` as f32, rotated per `t`.
fn gather(
    c: Cache,
    slots: &[u32],
    t: &RopeTables,
    heads: usize,
    head_dim: usize,
    neox: bool,
) -> Vec<f32> {
    let mut out = vec![0f32; slots.len() * heads * head_dim];
    let f = gather_fn(c.t);
    let (o, s, tb, cs, sn) = (
        out.as_mut_ptr(),
        slots.as_ptr(),
        t.tables.as_ptr(),
        t.cos.as_ptr(),
        t.sin.as_ptr(),
    );
    let (h, d, n) = (heads as u32, head_dim as u32, neox as u32);
    // SAFETY: `out` holds a row per slot, the slots were checked, and every
    // table index points at a whole table of `head_dim / 2` values.
    run(
        gather_launch(c.t, slots.len(), heads, head_dim),
        |ix| unsafe { f(ix, c.base, o, s, tb, cs, sn, h, d, n) },
    );
    out
}

/// Rows moved as they are (every row read before any is written), `units`
/// 16-bit units each: a quantized cache's V rows in a context shift.
fn move_raw(c: Cache, src: &[u32], dst: &[u32], units: usize) {
    let mut tmp = vec![0u16; src.len() * units];
    let l = Launch::per_item(src.len(), units);
    let (base, u) = (c.base as *mut u16, units as u32);
    // SAFETY: both index lists were checked against the cache, `tmp` holds
    // a row per index, and the rows are 16-bit aligned (even row bytes).
    run(l, |ix| unsafe {
        tessera_gather_rows(ix, base, tmp.as_mut_ptr(), src.as_ptr(), u)
    });
    // SAFETY: as above.
    run(l, |ix| unsafe {
        tessera_scatter_rows(ix, tmp.as_ptr(), base, dst.as_ptr(), u)
    });
}

/// [`crate::write_kv`] through the GPU kernel source.
pub fn write_kv(cache: &Tensor, new: &Tensor, slots: &[u32]) -> Result<()> {
    crate::kv::write::check(cache, new, slots)?;
    let c = cache_of(cache)?;
    let rows = new.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    scatter(c, &rows, slots, rows.len() / slots.len().max(1));
    Ok(())
}

/// [`crate::copy_blocks`] through the GPU kernel source (any cache type:
/// blocks move as 16-bit units).
pub fn copy_blocks(cache: &Tensor, pairs: &[(u32, u32)]) -> Result<()> {
    let values = crate::kv::copy::check(cache, pairs)?;
    let units = (KvType::of(cache)?.bytes_for(values) / 2) as u32;
    let flat: Vec<u32> = pairs.iter().flat_map(|&(s, d)| [s, d]).collect();
    let base = cache_of(cache)?.base as *mut u16;
    // SAFETY: the pairs were checked to name blocks inside the cache.
    run(Launch::per_item(pairs.len(), units as usize), |ix| unsafe {
        tessera_copy_blocks(ix, base, flat.as_ptr(), units)
    });
    Ok(())
}

/// [`crate::shift_kv`] through the GPU kernel source: every source row
/// gathered (K rotated) before any is written; a quantized cache's V rows
/// move as they are.
pub fn shift_kv(
    k_cache: &Tensor,
    v_cache: &Tensor,
    moves: &[(u32, u32)],
    rotation: &Rotation,
) -> Result<()> {
    let (heads, head_dim) = crate::kv::shift::check(k_cache, v_cache, moves, rotation)?;
    let (k, v) = (cache_of(k_cache)?, cache_of(v_cache)?);
    let (src, dst): (Vec<u32>, Vec<u32>) = moves.iter().copied().unzip();
    let neox = rotation.style == crate::RopeStyle::Neox;
    let row = heads * head_dim;
    let moved = gather(
        k,
        &src,
        &RopeTables::uniform(src.len(), rotation),
        heads,
        head_dim,
        neox,
    );
    scatter(k, &moved, &dst, row);
    if v.t.is_quantized() {
        move_raw(v, &src, &dst, v.t.bytes_for(row) / 2);
    } else {
        let moved = gather(v, &src, &RopeTables::none(src.len()), heads, head_dim, neox);
        scatter(v, &moved, &dst, row);
    }
    Ok(())
}

/// [`crate::rotate_k`] through the GPU kernel source.
pub fn rotate_k(
    k_cache: &Tensor,
    slots: &[u32],
    deltas: &[i64],
    rotation: &Rotation,
) -> Result<()> {
    let (heads, head_dim) = crate::kv::shift::check_rotate(k_cache, slots, deltas, rotation)?;
    let k = cache_of(k_cache)?;
    let (slots, deltas) = moved_rows(slots, deltas);
    let neox = rotation.style == crate::RopeStyle::Neox;
    let rows = gather(
        k,
        &slots,
        &RopeTables::per_delta(&deltas, rotation),
        heads,
        head_dim,
        neox,
    );
    scatter(k, &rows, &slots, heads * head_dim);
    Ok(())
}

/// `x` (a multiple of 64 values) rotated by `tessera_hadamard_rows`, as
/// attention rotates its queries and output over a quantized cache.
pub fn hadamard_rows(x: &mut [f32]) {
    let chunks = (x.len() / 64) as u32;
    let p = x.as_mut_ptr();
    // SAFETY: the kernel touches the first `chunks * 64` values of `x`.
    run(hadamard_launch(x.len()), |ix| unsafe {
        tessera_hadamard_rows(ix, p, chunks)
    });
}

/// The order in which an emulated CUDA launch runs each block's threads:
/// a result that depends on it reads what a missing barrier leaves racing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    Forward,
    Reverse,
}

/// One kernel argument as `gpu/emu_cuda.cpp` takes it.
#[repr(C)]
struct EmuArg {
    kind: u32,
    u32: u32,
    f32: f32,
    ptr: u64,
}

/// `tessera_emu_cuda_launch` and `tessera_emu_metal_launch`: (name, grid
/// x, y, z, threads, shared bytes, arguments, their count, order, error
/// text, its room) → 0 or an error.
type EmuLaunch = unsafe extern "C" fn(
    *const std::ffi::c_char,
    u32,
    u32,
    u32,
    u32,
    u32,
    *const EmuArg,
    u32,
    u32,
    *mut std::ffi::c_char,
    usize,
) -> i32;

extern "C" {
    fn tessera_emu_cuda_launch(
        name: *const std::ffi::c_char,
        gx: u32,
        gy: u32,
        gz: u32,
        threads: u32,
        shared: u32,
        args: *const EmuArg,
        nargs: u32,
        order: u32,
        err: *mut std::ffi::c_char,
        err_len: usize,
    ) -> i32;
    fn tessera_emu_metal_launch(
        name: *const std::ffi::c_char,
        gx: u32,
        gy: u32,
        gz: u32,
        threads: u32,
        shared: u32,
        args: *const EmuArg,
        nargs: u32,
        order: u32,
        err: *mut std::ffi::c_char,
        err_len: usize,
    ) -> i32;
}

/// Runs kernel `name` through one of the emulator's launchers.
///
/// # Safety
/// The arguments' addresses are live host memory of the sizes the kernel
/// touches.
unsafe fn emu_launch(
    f: EmuLaunch,
    name: &str,
    (grid, threads, shared): ((u32, u32, u32), u32, u32),
    args: &[EmuArg],
    order: Order,
) -> Result<()> {
    let c = std::ffi::CString::new(name).expect("kernel names have no NUL");
    let mut err = [0 as std::ffi::c_char; 512];
    let rc = f(
        c.as_ptr(),
        grid.0,
        grid.1,
        grid.2,
        threads,
        shared,
        args.as_ptr(),
        args.len() as u32,
        (order == Order::Reverse) as u32,
        err.as_mut_ptr(),
        err.len(),
    );
    if rc != 0 {
        let msg = std::ffi::CStr::from_ptr(err.as_ptr()).to_string_lossy();
        bail!("emu: {msg}")
    }
    Ok(())
}

/// Runs one launch of the CUDA launchers (`launch.rs`) on the CPU: a
/// `paged_attention.cu` or `forward.cu` kernel through the fiber
/// emulator, or a `kv_ops.h` one through the host prelude.
///
/// # Safety
/// The call's addresses are live host memory of the sizes its kernel
/// reads and writes.
unsafe fn launch(c: &Call, order: Order) -> Result<()> {
    if c.module == Module::KvOps {
        return match (c.name.as_str(), &c.args[..]) {
            ("tessera_hadamard_rows", &[Arg::Ptr(x), Arg::U32(chunks)]) => {
                let l = Launch {
                    blocks: c.grid.0,
                    threads: c.threads,
                };
                run(l, |ix| tessera_hadamard_rows(ix, x as *mut f32, chunks));
                Ok(())
            }
            _ => bail!("emu: no kv_ops launch {} with {:?}", c.name, c.args),
        };
    }
    let args: Vec<EmuArg> = c
        .args
        .iter()
        .map(|a| match *a {
            Arg::Ptr(p) => EmuArg {
                kind: 0,
                u32: 0,
                f32: 0.0,
                ptr: p,
            },
            Arg::U32(v) => EmuArg {
                kind: 1,
                u32: v,
                f32: 0.0,
                ptr: 0,
            },
            Arg::F32(v) => EmuArg {
                kind: 2,
                u32: 0,
                f32: v,
                ptr: 0,
            },
        })
        .collect();
    emu_launch(
        tessera_emu_cuda_launch,
        &c.name,
        (c.grid, c.threads, c.shared),
        &args,
        order,
    )
}

/// [`crate::paged_attention`] through the CUDA launchers and kernels
/// (`paged_attention.cu`), run on the CPU: the tiled kernel for prefill
/// chunks, the per-query one otherwise, its partitions merged by the merge
/// kernel or, with `merged`, by the last of a query's blocks (as the CUDA
/// forward's decode graphs launch it); over a quantized cache with the
/// queries and output rotated.
pub fn paged_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    meta: &PagedMeta,
    order: Order,
    merged: bool,
) -> Result<Tensor> {
    let (n_heads, n_kv_heads, head_dim) = crate::attention::paged::check(q, k, v, meta)?;
    let heads = (n_heads, n_kv_heads, head_dim);
    let tokens = meta.token_pos.len();
    let mut qs = q.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let mut out = vec![0f32; tokens * n_heads * head_dim];
    if tokens == 0 {
        return Tensor::from_vec(out, (0, n_heads, head_dim), &candle_core::Device::Cpu);
    }
    let (kc, vc) = (cache_of(k)?, cache_of(v)?);
    if kc.t != vc.t {
        bail!("emu paged_attention: K and V caches of different types")
    }
    let plan = AttnPlan::new(meta, heads)?;
    let states = plan.states(tokens, n_heads);
    // Poisoned, so that a state the kernels leave unwritten shows.
    let mut part_out = vec![f32::NAN; states * head_dim];
    let mut part_max = vec![f32::NAN; states];
    let mut part_sum = vec![f32::NAN; states];
    let mut counters = vec![0u32; tokens * n_heads];
    let tiles: Option<Vec<u32>> = plan.tiles.as_ref().map(|t| t.tiles.as_flattened().to_vec());
    let at = |p: *const f32| p as u64;
    let bufs = AttnBuffers {
        q: qs.as_mut_ptr() as u64,
        k: kc.base as u64,
        v: vc.base as u64,
        out: out.as_mut_ptr() as u64,
        cache: kc.t.name(),
    };
    let a = AttnLaunch {
        bufs: &bufs,
        tables: meta.block_tables.as_ptr() as u64,
        seqs: meta.token_seq.as_ptr() as u64,
        pos: meta.token_pos.as_ptr() as u64,
        tiles: tiles.as_ref().map(|t| (t.as_ptr() as u64, t.len() / 6)),
        partials: (
            at(part_out.as_mut_ptr()),
            at(part_max.as_mut_ptr()),
            at(part_sum.as_mut_ptr()),
        ),
        heads,
        tokens,
        block_size: meta.block_size,
        max_blocks: meta.max_blocks,
        scale: meta.scale,
        window: meta.window,
        parts: plan.parts,
        part_len: plan.part_len,
        counters: merged.then_some(counters.as_mut_ptr() as u64),
    };
    for c in attention_calls(&a) {
        // SAFETY: the buffers above are sized for the plan (queries and
        // output per token and head, `states` partial states, a counter per
        // token and head) and `check` held the tables and positions to the
        // caches.
        unsafe { launch(&c, order)? };
    }
    if counters.iter().any(|&c| c != 0) {
        bail!("emu paged_attention: the merged kernel left its counters nonzero")
    }
    Tensor::from_vec(out, (tokens, n_heads, head_dim), &candle_core::Device::Cpu)
}

/// A Metal binding as `gpu/emu_metal.cpp` takes it: a buffer's address,
/// or a `constant` value's bytes.
fn metal_buffer(p: u64) -> EmuArg {
    EmuArg {
        kind: 0,
        u32: 0,
        f32: 0.0,
        ptr: p,
    }
}

fn metal_bytes<T: Copy>(v: &T) -> EmuArg {
    EmuArg {
        kind: 3,
        u32: std::mem::size_of::<T>() as u32,
        f32: 0.0,
        ptr: v as *const T as u64,
    }
}

/// Dispatches a `paged_attention.metal` kernel on the CPU.
///
/// # Safety
/// The bindings are live host memory of the sizes the kernel touches.
unsafe fn metal_dispatch(
    name: &str,
    grid: (usize, usize, usize),
    threads: usize,
    args: &[EmuArg],
    order: Order,
) -> Result<()> {
    let u = |x: usize| x as u32;
    emu_launch(
        tessera_emu_metal_launch,
        name,
        ((u(grid.0), u(grid.1), u(grid.2)), u(threads), 0),
        args,
        order,
    )
}

/// [`crate::paged_attention`] through Metal's kernels
/// (`paged_attention.metal`) and launch plan (`metal_plan`, as `metal.rs`
/// dispatches it: partitions as CUDA's per-query kernel takes them, one
/// partition normalised by the kernel, several merged), run on the CPU:
/// float caches, as Metal takes.
pub fn metal_paged_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    meta: &PagedMeta,
    order: Order,
) -> Result<Tensor> {
    let (n_heads, n_kv_heads, head_dim) = crate::attention::paged::check(q, k, v, meta)?;
    let tokens = meta.token_pos.len();
    let qs = q.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let mut out = vec![f32::NAN; tokens * n_heads * head_dim];
    let (kc, vc) = (cache_of(k)?, cache_of(v)?);
    if kc.t != vc.t || kc.t.is_quantized() {
        bail!(
            "emu metal paged_attention: float K/V caches of one type, not {}/{}",
            kc.t,
            vc.t
        )
    }
    if tokens == 0 {
        return Tensor::from_vec(out, (0, n_heads, head_dim), &candle_core::Device::Cpu);
    }
    let plan = super::metal_plan::attention(meta, (n_heads, n_kv_heads, head_dim));
    let states = tokens * n_heads * plan.parts;
    let mut part_out = vec![f32::NAN; states * head_dim];
    let mut part_max = vec![f32::NAN; states];
    let mut part_sum = vec![f32::NAN; states];
    let p = |x: *const f32| metal_buffer(x as u64);
    let u = |x: *const u32| metal_buffer(x as u64);
    let attn = [
        p(qs.as_ptr()),
        metal_buffer(kc.base as u64),
        metal_buffer(vc.base as u64),
        u(meta.block_tables.as_ptr()),
        u(meta.token_seq.as_ptr()),
        u(meta.token_pos.as_ptr()),
        p(part_out.as_mut_ptr()),
        p(part_max.as_mut_ptr()),
        p(part_sum.as_mut_ptr()),
        metal_bytes(&plan.args),
    ];
    let merge = [
        p(part_out.as_ptr()),
        p(part_max.as_ptr()),
        p(part_sum.as_ptr()),
        p(out.as_mut_ptr()),
        metal_bytes(&plan.args),
    ];
    let mut attn = attn;
    if plan.direct {
        // One partition: the kernel normalises its sums into the output.
        attn[6] = p(out.as_mut_ptr());
    }
    // SAFETY: the buffers are sized for the plan's states, queries and
    // output; `check` held the tables and positions to the caches.
    unsafe {
        metal_dispatch(
            &format!("tessera_paged_attention_{}", kc.t.name()),
            plan.grid,
            plan.threads,
            &attn,
            order,
        )?;
        if !plan.direct {
            metal_dispatch(
                "tessera_attention_merge",
                plan.merge_grid,
                plan.merge_threads,
                &merge,
                order,
            )?;
        }
    }
    Tensor::from_vec(out, (tokens, n_heads, head_dim), &candle_core::Device::Cpu)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::parity::{self, Backend};
    use crate::testing::{max_abs_diff, seeded_cache};

    /// The emulated kernels on a copy of the inputs.
    struct Emu;

    impl Backend for Emu {
        fn write_kv(&self, cache: &Tensor, new: &Tensor, slots: &[u32]) -> Result<Tensor> {
            let c = cache.copy()?;
            write_kv(&c, new, slots)?;
            Ok(c)
        }
        fn copy_blocks(&self, cache: &Tensor, pairs: &[(u32, u32)]) -> Result<Tensor> {
            let c = cache.copy()?;
            copy_blocks(&c, pairs)?;
            Ok(c)
        }
        fn shift_kv(
            &self,
            k: &Tensor,
            v: &Tensor,
            moves: &[(u32, u32)],
            r: &Rotation,
        ) -> Result<(Tensor, Tensor)> {
            let (k, v) = (k.copy()?, v.copy()?);
            shift_kv(&k, &v, moves, r)?;
            Ok((k, v))
        }
        fn rotate_k(
            &self,
            k: &Tensor,
            slots: &[u32],
            deltas: &[i64],
            r: &Rotation,
        ) -> Result<Tensor> {
            let k = k.copy()?;
            rotate_k(&k, slots, deltas, r)?;
            Ok(k)
        }
    }

    /// Paged attention through the CUDA launchers and kernels on the CPU.
    struct EmuAttend {
        order: Order,
        merged: bool,
    }

    impl parity::Attend for EmuAttend {
        fn types(&self) -> &'static [KvType] {
            &KvType::ALL
        }
        fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, meta: &PagedMeta) -> Result<Tensor> {
            paged_attention(q, k, v, meta, self.order, self.merged)
        }
    }

    /// The CUDA attention kernels (`paged_attention.cu`: per-query, tiled
    /// and merge) and their launcher, every cache type, against the slow
    /// reference, each block's threads run first to last (the merge by the
    /// last block, last to first: the random launches below).
    #[test]
    fn cuda_paged_attention_matches_the_reference() -> Result<()> {
        parity::paged_attention(&EmuAttend {
            order: Order::Forward,
            merged: false,
        })
    }

    /// Paged attention through Metal's kernel source on the CPU.
    struct EmuMetalAttend(Order);

    impl parity::Attend for EmuMetalAttend {
        fn types(&self) -> &'static [KvType] {
            &[KvType::F32, KvType::F16, KvType::Bf16]
        }
        fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, meta: &PagedMeta) -> Result<Tensor> {
            metal_paged_attention(q, k, v, meta, self.0)
        }
    }

    /// Metal's attention kernels (`paged_attention.metal`: CUDA's
    /// partitions, simdgroup reductions, the merge) and launch plan,
    /// float caches, against the slow reference: the kernel Metal compiles
    /// on a Mac, run here, where no Mac is. Each threadgroup's threads run
    /// last to first (one order: both took 65 s), and the 512-token chunk
    /// is left out (4,608 threadgroups a partition: 42 s with it).
    #[test]
    fn metal_paged_attention_matches_the_reference() -> Result<()> {
        parity::paged_attention_upto(&EmuMetalAttend(Order::Reverse), 100)
    }

    /// Both emulated attentions on random launches (several sequences,
    /// decode beside chunks, head dims 64–128, odd block sizes, GQA,
    /// windows), CUDA's with the merged kernel on every cache type, Metal's
    /// on the float ones: 12 cases each here (17 s; 120 each passed once,
    /// 2 min).
    #[test]
    fn emulated_attention_matches_the_reference_on_random_launches() -> Result<()> {
        parity::paged_attention_random(
            &EmuAttend {
                order: Order::Reverse,
                merged: true,
            },
            12,
        )?;
        parity::paged_attention_random(&EmuMetalAttend(Order::Forward), 12)
    }

    fn test_call(name: &str, blocks: u32, threads: u32, args: Vec<Arg>) -> Call {
        Call {
            module: Module::Attention,
            name: name.into(),
            grid: (blocks, 1, 1),
            threads,
            shared: 0,
            args,
        }
    }

    /// The emulator itself: barriers order shared memory (a missing one
    /// shows in one of the two orders), shuffles exchange within a warp, a
    /// shuffle with a lane gone and barriers that cannot open fail the
    /// launch, and arguments must be the kernel's parameters.
    #[test]
    fn the_emulator_keeps_cudas_rules() -> Result<()> {
        let (blocks, threads) = (3u32, 96u32);
        let input: Vec<u32> = (0..blocks * threads).map(|i| i * 7 + 1).collect();
        let want: Vec<u32> = input
            .chunks(threads as usize)
            .map(|c| c.iter().sum())
            .collect();
        for (barrier, order, right) in [
            (1, Order::Forward, true),
            (1, Order::Reverse, true),
            (0, Order::Forward, false),
        ] {
            let mut out = vec![0u32; blocks as usize];
            let c = test_call(
                "tessera_emu_test_block_sum",
                blocks,
                threads,
                vec![
                    Arg::Ptr(input.as_ptr() as u64),
                    Arg::Ptr(out.as_mut_ptr() as u64),
                    Arg::U32(barrier),
                ],
            );
            // SAFETY: `input` and `out` are the sizes the kernel reads and writes.
            unsafe { launch(&c, order)? };
            assert_eq!(out == want, right, "barrier {barrier}, {order:?}: {out:?}");
        }
        let x: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let mut out = vec![0f32; 64];
        let warp_sum = |skip: u32, out: &mut Vec<f32>| {
            let c = test_call(
                "tessera_emu_test_warp_sum",
                1,
                64,
                vec![
                    Arg::Ptr(x.as_ptr() as u64),
                    Arg::Ptr(out.as_mut_ptr() as u64),
                    Arg::U32(skip),
                ],
            );
            // SAFETY: 64 values in and out.
            unsafe { launch(&c, Order::Forward) }
        };
        warp_sum(0, &mut out)?;
        let sums = [(0..32).sum::<i32>() as f32, (32..64).sum::<i32>() as f32];
        assert!(
            out.iter().enumerate().all(|(i, &v)| v == sums[i / 32]),
            "{out:?}"
        );
        let e = warp_sum(1, &mut out).unwrap_err().to_string();
        assert!(e.contains("did not take part"), "{e}");
        let mut flags = vec![0u32; 64];
        let stuck = test_call(
            "tessera_emu_test_stuck",
            1,
            64,
            vec![Arg::Ptr(flags.as_mut_ptr() as u64)],
        );
        // SAFETY: 64 flags.
        let e = unsafe { launch(&stuck, Order::Forward) }
            .unwrap_err()
            .to_string();
        assert!(e.contains("never reaches"), "{e}");
        let wrong = test_call("tessera_emu_test_stuck", 1, 64, vec![Arg::U32(0)]);
        // SAFETY: refused before it runs.
        let e = unsafe { launch(&wrong, Order::Forward) }
            .unwrap_err()
            .to_string();
        assert!(e.contains("not its parameters"), "{e}");
        Ok(())
    }

    /// The weight formats of the CUDA products, in `GemvFormat`'s order.
    const FORMATS: [candle_core::quantized::GgmlDType; 8] = {
        use candle_core::quantized::GgmlDType;
        [
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q8_0,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
            GgmlDType::F32,
            GgmlDType::F16,
        ]
    };

    /// f32 values in 16-byte aligned storage (the kernels load inputs as
    /// float4s).
    struct Floats(Vec<u128>, usize);

    impl Floats {
        fn new(v: &[f32]) -> Floats {
            let mut f = Floats(vec![0; v.len().div_ceil(4)], v.len());
            f.as_mut().copy_from_slice(v);
            f
        }
        fn as_mut(&mut self) -> &mut [f32] {
            // SAFETY: the u128s hold at least `len` f32s.
            unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast(), self.1) }
        }
        fn addr(&mut self) -> u64 {
            self.0.as_mut_ptr() as u64
        }
    }

    fn noise(i: usize, seed: u32) -> f32 {
        let h = (i as u32).wrapping_mul(2654435761) ^ seed.wrapping_mul(40503);
        ((h >> 7) % 2000) as f32 / 1000.0 - 1.0
    }

    fn act64(g: f64, act: u32) -> f64 {
        if act == 0 {
            g / (1.0 + (-g).exp())
        } else {
            let c = 0.7978845608028654;
            0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh())
        }
    }

    /// A dot product in f64 and the sum of its terms' sizes.
    fn dot64(w: &[f32], x: &[f64]) -> (f64, f64) {
        w.iter().zip(x).fold((0.0, 0.0), |(a, b), (&w, &x)| {
            let p = w as f64 * x;
            (a + p, b + p.abs())
        })
    }

    /// The CUDA forward's products (`forward.cu`: GEMV and the gated
    /// activation, for one token and for several, of normalized inputs,
    /// adding into y; 1, 2 and 4 warps a row) as the launcher builds them
    /// (`launch.rs`), run whole on the CPU a fiber per thread, against the
    /// dequantized weights in f64, in every format: rows in a partial last
    /// block, tokens past a block row, strided inputs and outputs.
    #[test]
    fn cuda_products_match_the_dequantized_weights() -> Result<()> {
        use super::super::launch::{product_call, DevWeight, GemvFormat, GemvIo};
        use candle_core::quantized::QTensor;
        use candle_core::Device;
        let formats = FORMATS;
        // Five outputs: a stacked gate|up weight of ten rows.
        let n = 5;
        for k in [256usize, 2304, 8192] {
            let src = Tensor::from_vec(
                (0..2 * n * k).map(|i| noise(i, 7)).collect::<Vec<f32>>(),
                (2 * n, k),
                &Device::Cpu,
            )?;
            let x_stride = k + 4;
            let xv: Vec<f32> = (0..9 * x_stride).map(|i| noise(i, 8) * 2.0).collect();
            let nwv: Vec<f32> = (0..k).map(|i| 1.0 + noise(i, 9) / 4.0).collect();
            let eps = 1e-5f32;
            for dtype in formats {
                let format = GemvFormat::from_ggml(dtype).expect("a kernel per format");
                let q = QTensor::quantize(&src, dtype)?;
                let deq = q.dequantize(&Device::Cpu)?.to_vec2::<f32>()?;
                let (mut wbuf, _) = aligned_blocks(&q)?;
                let y_stride = 2 * n + 3;
                // (tokens, gated, flag, normalized, warps)
                let mut cases = Vec::new();
                for warps in [None, Some(1), Some(2), Some(4)] {
                    for tokens in [1usize, 9] {
                        cases.push((tokens, false, 0u32, false, warps));
                        cases.push((tokens, true, 0, false, warps));
                    }
                    cases.push((1, false, 0, true, warps));
                    cases.push((1, true, 1, true, warps));
                }
                cases.push((3, false, 1, false, None)); // y += W·x
                cases.push((3, true, 1, false, None)); // GELU
                for (tokens, gated, flag, normalized, warps) in cases {
                    let mut x = Floats::new(&xv);
                    let mut nw = Floats::new(&nwv);
                    let y0: Vec<f32> = (0..tokens * y_stride).map(|i| noise(i, 10)).collect();
                    let mut y = Floats::new(&y0);
                    let w = DevWeight {
                        ptr: wbuf.as_mut_ptr() as u64,
                        format,
                        rows: 2 * n,
                        k,
                    };
                    let io = GemvIo {
                        x: x.addr(),
                        y: y.addr(),
                        tokens,
                        x_stride,
                        y_stride,
                        acc: !gated && flag == 1,
                        norm: normalized.then(|| (nw.addr(), eps)),
                    };
                    let rows = if gated { n } else { 2 * n };
                    let c = product_call(&w, &io, rows, gated, flag, warps);
                    // SAFETY: w holds 2n rows of k values in its format, x
                    // 9 rows at x_stride, y `tokens` rows at y_stride, nw k
                    // floats.
                    unsafe { launch(&c, Order::Forward)? };
                    let what = format!(
                        "{dtype:?} k {k} {} tokens {tokens} flag {flag} norm {normalized} warps {warps:?}",
                        c.name
                    );
                    let got = y.as_mut().to_vec();
                    for t in 0..tokens {
                        let xt = &xv[t * x_stride..t * x_stride + k];
                        let mut x64: Vec<f64> = xt.iter().map(|&v| v as f64).collect();
                        if normalized {
                            let ms = x64.iter().map(|v| v * v).sum::<f64>() / k as f64;
                            let scale = 1.0 / (ms + eps as f64).sqrt();
                            for (v, g) in x64.iter_mut().zip(&nwv) {
                                *v *= scale * *g as f64;
                            }
                        }
                        for r in 0..y_stride {
                            let g = got[t * y_stride + r] as f64;
                            let before = y0[t * y_stride + r] as f64;
                            if r >= rows {
                                assert_eq!(g, before, "{what}: y[{t}][{r}] past the rows written");
                                continue;
                            }
                            let (want, tol) = if gated {
                                let (a, sa) = dot64(&deq[r], &x64);
                                let (b, sb) = dot64(&deq[n + r], &x64);
                                (
                                    act64(a, flag) * b,
                                    2e-5 * (sa * b.abs() + sb * a.abs()) + 1e-6,
                                )
                            } else {
                                let (a, sa) = dot64(&deq[r], &x64);
                                let base = if io.acc { before } else { 0.0 };
                                (base + a, 2e-5 * sa + 1e-6)
                            };
                            assert!(
                                (g - want).abs() <= tol,
                                "{what}: y[{t}][{r}] = {g} against {want}"
                            );
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// `forward.cu`'s dequantizing kernel (long batches' products) as its
    /// launcher builds it gives candle's dequantization, bit for bit, in
    /// every format, over rows that end inside a block of threads.
    #[test]
    fn cuda_dequant_launch_equals_candles() -> Result<()> {
        use super::super::launch::{dequant_call, DevWeight, GemvFormat};
        use candle_core::quantized::QTensor;
        use candle_core::Device;
        let (rows, k) = (3usize, 768usize);
        let src = Tensor::from_vec(
            (0..rows * k)
                .map(|i| noise(i, 11) * 4.0)
                .collect::<Vec<f32>>(),
            (rows, k),
            &Device::Cpu,
        )?;
        for dtype in FORMATS {
            let q = QTensor::quantize(&src, dtype)?;
            let want = q
                .dequantize(&Device::Cpu)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let (mut buf, _) = aligned_blocks(&q)?;
            let mut out = Floats::new(&vec![f32::NAN; rows * k]);
            let w = DevWeight {
                ptr: buf.as_mut_ptr() as u64,
                format: GemvFormat::from_ggml(dtype).expect("a kernel per format"),
                rows,
                k,
            };
            // SAFETY: `rows` rows of k values in the format; out rows · k.
            unsafe { launch(&dequant_call(&w, out.addr()), Order::Forward)? };
            for (i, (g, w)) in out.as_mut().iter().zip(&want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "{dtype:?} value {i}: {g} against {w}"
                );
            }
        }
        Ok(())
    }

    /// `forward.cu`'s row kernels (RMSNorm of gathered rows, the residual
    /// add with and without a norm, the gated activation of stored
    /// products) as their launchers build them, against f64.
    #[test]
    fn cuda_row_kernels_match_the_reference() -> Result<()> {
        use super::super::launch::{act_mul_call, per_row_call};
        let (rows, n, eps) = (3usize, 576usize, 1e-6f32);
        let xv: Vec<f32> = (0..rows * n).map(|i| noise(i, 1) * 3.0).collect();
        let wv: Vec<f32> = (0..n).map(|i| 1.0 + noise(i, 2) / 2.0).collect();
        let norm64 = |row: &[f32], w: Option<&[f32]>| -> Vec<f64> {
            let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / n as f64;
            let scale = 1.0 / (ms + eps as f64).sqrt();
            row.iter()
                .enumerate()
                .map(|(i, &v)| v as f64 * w.map_or(1.0, |_| scale) * w.map_or(1.0, |w| w[i] as f64))
                .collect()
        };
        let close = |got: &[f32], want: &[f64], what: &str| {
            for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                assert!(
                    (g as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()),
                    "{what}: value {i}: {g} against {w}"
                );
            }
        };
        // RMSNorm of rows 2, 0 (gathered), and of the rows in order.
        for gather in [Some(vec![2u32, 0]), None] {
            let mut x = Floats::new(&xv);
            let mut w = Floats::new(&wv);
            let picked = gather.clone().unwrap_or_else(|| (0..rows as u32).collect());
            let mut out = Floats::new(&vec![f32::NAN; picked.len() * n]);
            let table = gather.as_ref().map_or(0, |g| g.as_ptr() as u64);
            let c = per_row_call(
                "rms_norm",
                picked.len(),
                &[x.addr(), table, w.addr(), out.addr()],
                n,
                &[eps],
            );
            // SAFETY: x holds `rows` rows, out one per row picked, w n.
            unsafe { launch(&c, Order::Forward)? };
            let want: Vec<f64> = picked
                .iter()
                .flat_map(|&r| norm64(&xv[r as usize * n..][..n], Some(&wv)))
                .collect();
            close(out.as_mut(), &want, &format!("rms_norm {gather:?}"));
        }
        // x += s · norm(y) and x += s · y.
        let yv: Vec<f32> = (0..rows * n).map(|i| noise(i, 3)).collect();
        for normed in [true, false] {
            let mut x = Floats::new(&xv);
            let mut y = Floats::new(&yv);
            let mut w = Floats::new(&wv);
            let wp = if normed { w.addr() } else { 0 };
            let c = per_row_call("residual", rows, &[x.addr(), y.addr(), wp], n, &[eps, 0.5]);
            // SAFETY: x and y hold `rows` rows of n, w n.
            unsafe { launch(&c, Order::Reverse)? };
            let want: Vec<f64> = (0..rows)
                .flat_map(|r| {
                    let yr = &yv[r * n..][..n];
                    let add = norm64(yr, normed.then_some(&wv[..]));
                    let xr = &xv[r * n..][..n];
                    xr.iter()
                        .zip(add)
                        .map(|(&x, a)| x as f64 + 0.5 * a)
                        .collect::<Vec<_>>()
                })
                .collect();
            close(x.as_mut(), &want, &format!("residual norm {normed}"));
        }
        // act(gate) · up over rows of 2n.
        for act in [0u32, 1] {
            let mut gu = Floats::new(&xv[..2 * n]);
            let mut out = Floats::new(&vec![f32::NAN; n]);
            let c = act_mul_call(gu.addr(), out.addr(), (1, n / 2), act);
            let half = n / 2;
            let mut out2 = Floats::new(&vec![f32::NAN; 2 * half]);
            let c2 = act_mul_call(gu.addr(), out2.addr(), (2, half / 2), act);
            // SAFETY: gu holds 2n floats: one row of 2·(n/2), or two of
            // 2·(n/4); out room for their outputs.
            unsafe {
                launch(&c, Order::Forward)?;
                launch(&c2, Order::Forward)?;
            }
            let row = |g: &[f32], m: usize, t: usize| -> Vec<f64> {
                (0..m)
                    .map(|j| act64(g[t * 2 * m + j] as f64, act) * g[t * 2 * m + m + j] as f64)
                    .collect()
            };
            let g = &xv[..2 * n];
            close(&out.as_mut()[..half], &row(g, half, 0), "act_mul");
            let mut want = row(g, half / 2, 0);
            want.extend(row(g, half / 2, 1));
            close(
                &out2.as_mut()[..2 * (half / 2)],
                &want,
                "act_mul, two tokens",
            );
        }
        Ok(())
    }

    /// `forward.cu`'s q/k/v step (biases, per-head q/k norms, RoPE in both
    /// pair layouts, q out, k and v into the paged cache at each token's
    /// slot, a padded slot skipped) against f64, every cache type (a
    /// quantized cache within its rounding step).
    #[test]
    fn cuda_qkv_step_matches_the_reference() -> Result<()> {
        use super::super::launch::{qkv_call, QkvStep};
        let (nh, kvh, hd, tokens) = (4usize, 2usize, 64usize, 3usize);
        let (blocks, bs) = (4usize, 4usize);
        let stride = (nh + 2 * kvh) * hd + 4;
        let eps = 1e-6f32;
        let qkvv: Vec<f32> = (0..tokens * stride).map(|i| noise(i, 4)).collect();
        let half = hd / 2;
        let angles: Vec<f64> = (0..tokens * half)
            .map(|i| (i / half + 5) as f64 * 10000f64.powf(-2.0 * (i % half) as f64 / hd as f64))
            .collect();
        let cosv: Vec<f32> = angles.iter().map(|a| a.cos() as f32).collect();
        let sinv: Vec<f32> = angles.iter().map(|a| a.sin() as f32).collect();
        let bias: Vec<Vec<f32>> = [nh, kvh, kvh]
            .iter()
            .enumerate()
            .map(|(p, &h)| (0..h * hd).map(|i| noise(i, 20 + p as u32) / 8.0).collect())
            .collect();
        let norms: Vec<Vec<f32>> = (0..2)
            .map(|p| (0..hd).map(|i| 1.0 + noise(i, 30 + p) / 4.0).collect())
            .collect();
        let slots = [5u32, u32::MAX, 14];
        for t in KvType::ALL {
            for (neox, extras) in [(false, true), (true, false), (true, true)] {
                let k = crate::testing::seeded_cache(&[blocks, bs, kvh, hd], 1, t)?;
                let v = crate::testing::seeded_cache(&[blocks, bs, kvh, hd], 2, t)?;
                let before_k = crate::dequantize_cache(&k)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                let before_v = crate::dequantize_cache(&v)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                let (kc, vc) = (cache_of(&k)?, cache_of(&v)?);
                let mut qkv = Floats::new(&qkvv);
                let mut q_out = Floats::new(&vec![f32::NAN; tokens * nh * hd]);
                let mut b: Vec<Floats> = bias.iter().map(|b| Floats::new(b)).collect();
                let mut nm: Vec<Floats> = norms.iter().map(|n| Floats::new(n)).collect();
                let (mut cs, mut sn) = (Floats::new(&cosv), Floats::new(&sinv));
                let pick = |f: &mut Floats| if extras { f.addr() } else { 0 };
                let step = QkvStep {
                    qkv: qkv.addr(),
                    stride,
                    biases: [pick(&mut b[0]), pick(&mut b[1]), pick(&mut b[2])],
                    norms: [pick(&mut nm[0]), pick(&mut nm[1])],
                    eps,
                    cos: cs.addr(),
                    sin: sn.addr(),
                    q_out: q_out.addr(),
                    slots: slots.as_ptr() as u64,
                    tokens,
                    heads: (nh, kvh, hd),
                    neox,
                };
                let c = qkv_call(&step, (kc.base as u64, vc.base as u64, t.name()));
                // SAFETY: the buffers hold `tokens` rows; the slots lie in
                // both caches (or are padding).
                unsafe { launch(&c, Order::Reverse)? };
                let after_k = crate::dequantize_cache(&k)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                let after_v = crate::dequantize_cache(&v)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                let what = format!("{t} neox {neox} extras {extras}");
                let mut want_k = before_k.clone();
                let mut want_v = before_v.clone();
                for tok in 0..tokens {
                    for head in 0..nh + 2 * kvh {
                        let (part, h) = match head {
                            x if x < nh => (0, x),
                            x if x < nh + kvh => (1, x - nh),
                            x => (2, x - nh - kvh),
                        };
                        let src = &qkvv[tok * stride + head * hd..][..hd];
                        let mut row: Vec<f64> = src
                            .iter()
                            .enumerate()
                            .map(|(d, &x)| {
                                x as f64
                                    + if extras {
                                        bias[part][h * hd + d] as f64
                                    } else {
                                        0.0
                                    }
                            })
                            .collect();
                        if extras && part < 2 {
                            let ms = row.iter().map(|x| x * x).sum::<f64>() / hd as f64;
                            let scale = 1.0 / (ms + eps as f64).sqrt();
                            for (x, g) in row.iter_mut().zip(&norms[part]) {
                                *x *= scale * *g as f64;
                            }
                        }
                        if part < 2 {
                            let mut r = row.clone();
                            for i in 0..half {
                                let (a, bb) = if neox {
                                    (i, i + half)
                                } else {
                                    (2 * i, 2 * i + 1)
                                };
                                let (c, s) =
                                    (cosv[tok * half + i] as f64, sinv[tok * half + i] as f64);
                                r[a] = row[a] * c - row[bb] * s;
                                r[bb] = row[a] * s + row[bb] * c;
                            }
                            row = r;
                        }
                        if part == 0 {
                            let got = &q_out.as_mut()[(tok * nh + h) * hd..][..hd];
                            for (d, (&g, &w)) in got.iter().zip(&row).enumerate() {
                                assert!(
                                    (g as f64 - w).abs() <= 1e-5,
                                    "{what}: q[{tok}][{h}][{d}] {g} against {w}"
                                );
                            }
                            continue;
                        }
                        if slots[tok] == u32::MAX {
                            continue;
                        }
                        let at = (slots[tok] as usize * kvh + h) * hd;
                        let dst = if part == 1 { &mut want_k } else { &mut want_v };
                        for (d, &w) in row.iter().enumerate() {
                            dst[at + d] = w as f32;
                        }
                    }
                }
                for (name, got, want) in [("k", &after_k, &want_k), ("v", &after_v, &want_v)] {
                    for (row, (g, w)) in got.chunks(hd).zip(want.chunks(hd)).enumerate() {
                        let l2 = |v: &mut dyn Iterator<Item = f32>| {
                            v.map(|x| x as f64 * x as f64).sum::<f64>().sqrt()
                        };
                        let size = w.iter().fold(0f32, |m, x| m.max(x.abs()));
                        if t.is_quantized() {
                            // Quantized in the Hadamard-turned basis: each
                            // turned value within half a step (q8_0: its
                            // block's largest / 127, q4_0: / 8, the largest
                            // at most the 64 values' norm), so the 64
                            // values' error norm within 8 half steps.
                            let err = l2(&mut g.iter().zip(w).map(|(a, b)| a - b));
                            let levels = if t == KvType::Q8_0 { 127.0 } else { 8.0 };
                            let bound = 8.0 * l2(&mut w.iter().copied()) / (2.0 * levels) * 1.01;
                            assert!(
                                err <= bound + 1e-6,
                                "{what}: {name} row {row}: error norm {err} over {bound}"
                            );
                            continue;
                        }
                        let tol = match t {
                            KvType::F16 => 1e-3 * size,
                            KvType::Bf16 => 8e-3 * size,
                            _ => 1e-5,
                        } + 1e-6;
                        for (d, (&g, &w)) in g.iter().zip(w).enumerate() {
                            assert!(
                                (g - w).abs() <= tol,
                                "{what}: {name} row {row} value {d}: {g} against {w}"
                            );
                        }
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    fn write_kv_equals_the_reference() -> Result<()> {
        parity::write_kv(&Emu)
    }

    #[test]
    fn copy_blocks_equals_the_reference_for_every_cache_type() -> Result<()> {
        parity::copy_blocks(&Emu)
    }

    #[test]
    fn shift_and_rotate_equal_the_reference_with_overlapping_moves() -> Result<()> {
        parity::shift_and_rotate(&Emu)
    }

    extern "C" {
        fn tessera_emu_gemv_lane(
            fmt: u32,
            kind: u32,
            wpr: u32,
            rows: *const *const u8,
            k: u32,
            xs: *const f32,
            x_stride: u32,
            nt: u32,
            lane: u32,
            sum: *mut f32,
        ) -> i32;
        fn tessera_emu_dequant(fmt: u32, w: *const u8, rows: u32, k: u32, out: *mut f32) -> i32;
        fn tessera_emu_gemv_item(
            fmt: u32,
            row: *const u8,
            i: u32,
            w: *mut f32,
            off: *mut u32,
        ) -> i32;
    }

    /// A quantized tensor's blocks at a 16-byte aligned address, as on the
    /// GPU, and their length in bytes.
    fn aligned_blocks(q: &candle_core::quantized::QTensor) -> Result<(Vec<u128>, usize)> {
        let bytes = q.data()?;
        let mut buf = vec![0u128; bytes.len().div_ceil(16)];
        // SAFETY: `buf` holds at least `bytes.len()` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                buf.as_mut_ptr().cast::<u8>(),
                bytes.len(),
            )
        };
        Ok((buf, bytes.len()))
    }

    /// The CUDA products' block formats (`gpu/gemv_formats.h`, which
    /// `gpu/forward.cu` includes) expand every item of a row to candle's
    /// dequantization of the row, bit for bit, and their items cover each
    /// value once: rows of several magnitudes and signs in each format;
    /// the dequantizing kernel's threads give the same row.
    #[test]
    fn gemv_items_expand_to_the_dequantized_weights_in_every_format() -> Result<()> {
        use candle_core::quantized::{GgmlDType, QTensor};
        use candle_core::Device;
        let k = 768;
        // GemvFormat's order; Q6_K's items are 16 values, the others' 8.
        let formats = [
            (0, GgmlDType::Q4_0, 8),
            (1, GgmlDType::Q4_1, 8),
            (2, GgmlDType::Q8_0, 8),
            (3, GgmlDType::Q4K, 8),
            (4, GgmlDType::Q5K, 8),
            (5, GgmlDType::Q6K, 16),
            (6, GgmlDType::F32, 8),
            (7, GgmlDType::F16, 8),
        ];
        for seed in 0..4u32 {
            let vals: Vec<f32> = (0..k as u32)
                .map(|i| {
                    let h = (i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)) % 1000;
                    let scale = [0.002, 0.05, 1.0, 30.0][((i / 64 + seed) % 4) as usize];
                    (h as f32 / 500.0 - 1.0) * scale
                })
                .collect();
            let src = Tensor::from_vec(vals, (1, k), &Device::Cpu)?;
            for (fmt, dtype, per_item) in formats {
                let q = QTensor::quantize(&src, dtype)?;
                let want = q
                    .dequantize(&Device::Cpu)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                let (buf, _) = aligned_blocks(&q)?;
                let mut got = vec![None; k];
                for i in 0..k / per_item {
                    let (mut w, mut off) = ([0f32; 16], [0u32; 4]);
                    // SAFETY: item i of a row of k values lies inside its
                    // blocks; w and off have room for four runs.
                    let runs = unsafe {
                        tessera_emu_gemv_item(
                            fmt,
                            buf.as_ptr().cast(),
                            i as u32,
                            w.as_mut_ptr(),
                            off.as_mut_ptr(),
                        )
                    } as usize;
                    assert_eq!(runs * 4, per_item, "{dtype:?}");
                    for r in 0..runs {
                        for e in 0..4 {
                            let at = off[r] as usize + e;
                            assert!(got[at].is_none(), "{dtype:?}: value {at} twice");
                            got[at] = Some(w[4 * r + e]);
                        }
                    }
                }
                for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                    let g = g.unwrap_or_else(|| panic!("{dtype:?}: value {j} in no item"));
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{dtype:?} value {j}: {g} against {w}"
                    );
                }
                // The same through tessera_fwd_dequant_*'s threads.
                let mut out = vec![f32::NAN; k];
                // SAFETY: one row of k values in the format; out holds k.
                let ok = unsafe {
                    tessera_emu_dequant(fmt, buf.as_ptr().cast(), 1, k as u32, out.as_mut_ptr())
                };
                assert_eq!(ok, 1);
                for (j, (g, w)) in out.iter().zip(&want).enumerate() {
                    assert_eq!(g.to_bits(), w.to_bits(), "dequant {dtype:?} value {j}");
                }
            }
        }
        Ok(())
    }

    /// Every lane of every product shape the CUDA kernels are built in
    /// (one token of one row, one token of gate and up together, up to 8
    /// tokens of one row; 1, 2 and 4 warps a row), run one after another
    /// through `ts_row_dots` (`gpu/gemv_formats.h`), adds up to the dot
    /// products of the dequantized rows with the inputs: every item is
    /// taken once, by some lane, against the right inputs of the right
    /// token, rows of one pass and of many, in every format.
    #[test]
    fn gemv_lanes_add_up_to_the_dot_products_in_every_shape() -> Result<()> {
        use candle_core::quantized::QTensor;
        use candle_core::Device;
        let formats = FORMATS;
        let noise = |i: u32, seed: u32| {
            let h = i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503);
            ((h >> 7) % 2000) as f32 / 1000.0 - 1.0
        };
        for k in [256usize, 2560] {
            // Two rows (gate and up), and 8 input rows 4 floats apart more
            // than their length.
            let w: Vec<f32> = (0..2 * k as u32).map(|i| noise(i, 1)).collect();
            let stride = k + 4;
            let x: Vec<f32> = (0..(8 * stride) as u32).map(|i| noise(i, 2)).collect();
            let src = Tensor::from_vec(w, (2, k), &Device::Cpu)?;
            for (fmt, dtype) in formats.into_iter().enumerate() {
                let q = QTensor::quantize(&src, dtype)?;
                let deq = q.dequantize(&Device::Cpu)?.to_vec2::<f32>()?;
                let (buf, len) = aligned_blocks(&q)?;
                let base = buf.as_ptr().cast::<u8>();
                // SAFETY: the second row starts one row's bytes in.
                let rows = [base, unsafe { base.add(len / 2) }];
                for (kind, mt, nr, tokens) in [
                    (0u32, 1usize, 1usize, &[1u32][..]),
                    (1, 1, 2, &[1]),
                    (2, 8, 1, &[1, 5, 8]),
                ] {
                    for wpr in [1u32, 2, 4] {
                        for &nt in tokens {
                            let mut total = vec![0f64; nr * mt];
                            for lane in 0..32 * wpr {
                                let mut sum = vec![0f32; nr * mt];
                                // SAFETY: the rows hold k values each in
                                // their format, x holds 8 rows at the
                                // stride, sum has room for nr · mt.
                                let got = unsafe {
                                    tessera_emu_gemv_lane(
                                        fmt as u32,
                                        kind,
                                        wpr,
                                        rows.as_ptr(),
                                        k as u32,
                                        x.as_ptr(),
                                        stride as u32,
                                        nt,
                                        lane,
                                        sum.as_mut_ptr(),
                                    )
                                };
                                assert_eq!(got as usize, mt, "{dtype:?} kind {kind}");
                                for (t, s) in total.iter_mut().zip(&sum) {
                                    *t += *s as f64;
                                }
                            }
                            for r in 0..nr {
                                for t in 0..mt {
                                    let got = total[r * mt + t];
                                    if t >= nt as usize {
                                        assert_eq!(got, 0.0, "{dtype:?}: token {t} of {nt}");
                                        continue;
                                    }
                                    let xt = &x[t * stride..t * stride + k];
                                    let (want, size) = deq[r].iter().zip(xt).fold(
                                        (0f64, 0f64),
                                        |(a, b), (w, x)| {
                                            let p = *w as f64 * *x as f64;
                                            (a + p, b + p.abs())
                                        },
                                    );
                                    assert!(
                                        (got - want).abs() <= 1e-5 * size,
                                        "{dtype:?} k {k} kind {kind} wpr {wpr} row {r} token {t} of {nt}: {got} against {want}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    fn padded_slots_are_skipped() -> Result<()> {
        for t in KvType::ALL {
            let cache = seeded_cache(&[2, 4, 1, 64], 1, t)?;
            let before = cache.copy()?;
            scatter(cache_of(&cache)?, &[1.0; 64], &[super::super::NO_TABLE], 64);
            assert_eq!(max_abs_diff(&cache, &before)?, 0.0, "{t}");
        }
        Ok(())
    }

    /// The rotation kernel is the CPU's, bit for bit, and its own inverse
    /// up to rounding.
    #[test]
    fn hadamard_rows_equal_the_cpu_transform() -> Result<()> {
        let x = crate::testing::seeded(&[5 * 64], 7, DType::F32)?.to_vec1::<f32>()?;
        let mut want = x.clone();
        crate::quant::hadamard64(&mut want);
        let mut got = x.clone();
        hadamard_rows(&mut got);
        assert_eq!(got, want);
        hadamard_rows(&mut got);
        let err = got
            .iter()
            .zip(&x)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err < 1e-6, "{err}");
        Ok(())
    }
}
