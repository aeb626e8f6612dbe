//! CUDA launchers (feature `cuda`): `build.rs` compiles `gpu/kv_ops.cu` and
//! `gpu/paged_attention.cu` to PTX (for `CUDA_COMPUTE_CAP`, default 80),
//! embedded here, loaded through candle's device
//! (`get_or_load_custom_func`) and launched on its stream from the
//! `cuda_fwd` of the ops in `kv/write.rs`, `kv/copy.rs`, `kv/shift.rs` and
//! `attention/paged.rs`. The launch shapes and host tables are those of
//! [`super`], and the attention's launches are built by `launch.rs`, which
//! the `kernel-emu` tests run on the CPU.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, DevicePtrMut, DeviceRepr, LaunchArgs, LaunchConfig,
    PushKernelArg,
};
use candle_core::cuda_backend::{CudaStorageSlice as S, DeviceId, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, Layout, Result, Shape};

use super::launch::{attention_calls, Arg, AttnPlan, Call, Module};
pub(crate) use super::launch::{AttnBuffers, AttnLaunch};
use super::{gather_launch, write_launch, Launch, RopeTables};
use crate::{KvType, PagedMeta, RopeStyle};

const KV_OPS_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kv_ops.ptx"));
const ATTENTION_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/paged_attention.ptx"));

fn config(l: Launch) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (l.blocks, 1, 1),
        block_dim: (l.threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn range(l: &Layout, what: &str) -> Result<std::ops::Range<usize>> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(a..b),
        None => bail!("{what} must be contiguous"),
    }
}

/// `host` on the device. A forward hands every layer the same slots, block
/// tables and positions, so the last few uploads are kept (per thread, keyed
/// by device and contents; never written after the upload) and a table
/// already there is reused: one upload per forward instead of one per kernel
/// launch. Freed in stream order when pushed out.
fn upload(dev: &CudaDevice, host: &[u32]) -> Result<Rc<CudaSlice<u32>>> {
    type Kept = VecDeque<(DeviceId, Vec<u32>, Rc<CudaSlice<u32>>)>;
    const KEEP: usize = 8;
    thread_local! {
        static KEPT: RefCell<Kept> = const { RefCell::new(VecDeque::new()) };
    }
    KEPT.with(|kept| {
        let mut kept = kept.borrow_mut();
        let id = dev.id();
        if let Some(i) = kept
            .iter()
            .position(|(d, h, _)| *d == id && h[..] == host[..])
        {
            let hit = kept.remove(i).expect("the position was just found");
            let d = hit.2.clone();
            kept.push_front(hit);
            return Ok(d);
        }
        let d = Rc::new(dev.clone_htod(host)?);
        kept.push_front((id, host.to_vec(), d.clone()));
        kept.truncate(KEEP);
        Ok(d)
    })
}

/// A cache's device slice (its layout's range), type and kernel suffix.
macro_rules! with_cache {
    ($s:expr, $l:expr, |$c:ident, $t:ident, $suffix:ident| $body:expr) => {{
        let r = range($l, "KV cache")?;
        let $t = KvType::of_dims($s.dtype(), $l.dims())?;
        let $suffix = $t.name();
        match &mut $s.slice {
            S::F32(c) => {
                let mut $c = c.slice_mut(r);
                $body
            }
            S::F16(c) => {
                let mut $c = c.slice_mut(r);
                $body
            }
            S::BF16(c) => {
                let mut $c = c.slice_mut(r);
                $body
            }
            S::U8(c) => {
                let mut $c = c.slice_mut(r);
                $body
            }
            _ => bail!("the CUDA KV kernels take no {:?} cache", $s.dtype()),
        }
    }};
}

/// Stores f32 rows (`slots.len()` rows of `row` values) at `slots`
/// (quantized: rotated and quantized).
fn scatter(
    s: &mut CudaStorage,
    l: &Layout,
    rows: &CudaView<'_, f32>,
    slots: &[u32],
    row: usize,
) -> Result<()> {
    let dev = s.device.clone();
    let slots_d = upload(&dev, slots)?;
    let n = slots.len();
    let row = row as u32;
    with_cache!(s, l, |cache, t, suffix| {
        let f = dev.get_or_load_custom_func(
            &format!("tessera_write_kv_{suffix}"),
            "tessera_kv_ops",
            KV_OPS_PTX,
        )?;
        let mut b = f.builder();
        b.arg(rows);
        b.arg(&mut cache);
        b.arg(&*slots_d);
        b.arg(&row);
        // SAFETY: the op checked the slots against the cache, and `rows`
        // holds a row per slot.
        unsafe { b.launch(config(write_launch(t, n, row as usize))) }.w()?;
    });
    Ok(())
}

/// `write_kv`: `new` (f32, `[tokens, n_kv_heads, head_dim]`) into the cache.
pub(crate) fn write_kv(
    s: &mut CudaStorage,
    l: &Layout,
    new: &CudaStorage,
    ln: &Layout,
    slots: &[u32],
) -> Result<()> {
    let S::F32(src) = &new.slice else {
        bail!("write_kv: new K/V must be f32 on the GPU")
    };
    let r = range(ln, "new K/V")?;
    let row = r.len() / slots.len().max(1);
    scatter(s, l, &src.slice(r), slots, row)
}

/// `copy_blocks`: whole blocks moved as 16-bit units (any cache type).
pub(crate) fn copy_blocks(
    s: &mut CudaStorage,
    l: &Layout,
    pairs: &[(u32, u32)],
    block_bytes: usize,
) -> Result<()> {
    fn go<T: DeviceRepr>(
        dev: &CudaDevice,
        c: &mut CudaSlice<T>,
        r: std::ops::Range<usize>,
        pairs: &CudaSlice<u32>,
        n: usize,
        units: u32,
    ) -> Result<()> {
        let f = dev.get_or_load_custom_func("tessera_copy_blocks", "tessera_kv_ops", KV_OPS_PTX)?;
        let mut c = c.slice_mut(r);
        let mut b = f.builder();
        b.arg(&mut c);
        b.arg(pairs);
        b.arg(&units);
        // SAFETY: the op checked every pair against the cache.
        unsafe { b.launch(config(Launch::per_item(n, units as usize))) }.w()?;
        Ok(())
    }
    let dev = s.device.clone();
    let flat: Vec<u32> = pairs.iter().flat_map(|&(a, b)| [a, b]).collect();
    let pairs_d = dev.clone_htod(&flat)?;
    let units = (block_bytes / 2) as u32;
    let r = range(l, "KV cache")?;
    let n = pairs.len();
    let dtype = s.dtype();
    match &mut s.slice {
        S::F32(c) => go(&dev, c, r, &pairs_d, n, units),
        S::F16(c) => go(&dev, c, r, &pairs_d, n, units),
        S::BF16(c) => go(&dev, c, r, &pairs_d, n, units),
        S::U8(c) => go(&dev, c, r, &pairs_d, n, units),
        _ => bail!("copy_blocks: unsupported cache dtype {dtype:?}"),
    }
}

/// The rows at `slots` gathered as f32 (rotated per `t`), then stored at
/// `dst`: every row is read before any is written, so moves may overlap.
pub(crate) fn move_rows(
    s: &mut CudaStorage,
    l: &Layout,
    slots: &[u32],
    dst: &[u32],
    t: &RopeTables,
    (heads, head_dim, style): (usize, usize, RopeStyle),
) -> Result<()> {
    if slots.is_empty() {
        return Ok(());
    }
    let dev = s.device.clone();
    let row = heads * head_dim;
    let t_cache = KvType::of_dims(s.dtype(), l.dims())?;
    if t_cache.is_quantized() && t.tables.iter().all(|&x| x == super::NO_TABLE) {
        // Quantized rows that turn by nothing move as they are (a context
        // shift's V): dequantized and quantized again they could differ.
        return move_raw(s, l, slots, dst, t_cache.bytes_for(row) / 2);
    }
    let out = dev.alloc_zeros::<f32>(slots.len() * row)?;
    let slots_d = dev.clone_htod(slots)?;
    let tables_d = dev.clone_htod(&t.tables)?;
    // Empty tables (no rotation) still need a valid address.
    let cos_d = dev.clone_htod(if t.cos.is_empty() {
        &[0f32][..]
    } else {
        &t.cos
    })?;
    let sin_d = dev.clone_htod(if t.sin.is_empty() {
        &[0f32][..]
    } else {
        &t.sin
    })?;
    let (h, d, neox) = (
        heads as u32,
        head_dim as u32,
        (style == RopeStyle::Neox) as u32,
    );
    let launch = gather_launch(t_cache, slots.len(), heads, head_dim);
    let mut out = out;
    with_cache!(s, l, |cache, _t, suffix| {
        let f = dev.get_or_load_custom_func(
            &format!("tessera_rope_gather_{suffix}"),
            "tessera_kv_ops",
            KV_OPS_PTX,
        )?;
        let mut b = f.builder();
        b.arg(&mut cache); // read only
        b.arg(&mut out);
        b.arg(&slots_d);
        b.arg(&tables_d);
        b.arg(&cos_d);
        b.arg(&sin_d);
        b.arg(&h);
        b.arg(&d);
        b.arg(&neox);
        // SAFETY: the op checked the slots; every table index points at a
        // whole table.
        unsafe { b.launch(config(launch)) }.w()?;
    });
    scatter(s, l, &out.slice(..), dst, row)
}

/// `f` with the device and the address of a quantized cache's bytes (its
/// layout's start), the cache held for the kernels `f` launches.
fn with_quantized<R>(
    s: &mut CudaStorage,
    l: &Layout,
    what: &str,
    f: impl FnOnce(&CudaDevice, u64) -> Result<R>,
) -> Result<R> {
    let dev = s.device.clone();
    let r = range(l, "KV cache")?;
    let S::U8(c) = &mut s.slice else {
        bail!("{what}: not a quantized cache")
    };
    let mut cache = c.slice_mut(r);
    let stream = dev.cuda_stream();
    let (base, _b) = cache.device_ptr_mut(&stream);
    f(&dev, base)
}

/// `tessera_gather_rows` (row `idx[i]` of `from` to row `i` of `to`) or
/// `tessera_scatter_rows` (row `i` of `from` to row `idx[i]` of `to`) over
/// rows of `units` 16-bit units.
fn move_units(
    dev: &CudaDevice,
    name: &str,
    (from, to): (u64, u64),
    idx: &CudaSlice<u32>,
    rows: usize,
    units: usize,
) -> Result<()> {
    let f = dev.get_or_load_custom_func(name, "tessera_kv_ops", KV_OPS_PTX)?;
    let u = units as u32;
    let mut b = f.builder();
    b.arg(&from);
    b.arg(&to);
    b.arg(idx);
    b.arg(&u);
    // SAFETY: the callers' ops checked every index against the cache, and
    // the other side holds a row per index; rows are whole 16-bit units.
    unsafe { b.launch(config(Launch::per_item(rows, units))) }.w()?;
    Ok(())
}

/// `write_kv_raw`: rows of a quantized cache's own bytes (`row` bytes each,
/// an even number) stored at `slots` as they are.
pub(crate) fn write_raw(
    s: &mut CudaStorage,
    l: &Layout,
    rows: &[u8],
    slots: &[u32],
    row: usize,
) -> Result<()> {
    if slots.is_empty() {
        return Ok(());
    }
    with_quantized(s, l, "write_kv_raw", |dev, base| {
        let units: Vec<u16> = rows
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        let src = dev.clone_htod(&units)?;
        let idx = dev.clone_htod(slots)?;
        let from = addr(dev, &src);
        move_units(
            dev,
            "tessera_scatter_rows",
            (from, base),
            &idx,
            slots.len(),
            row / 2,
        )
    })
}

/// Rows of `units` 16-bit units moved from `slots` to `dst` as they are:
/// all gathered into a scratch buffer before any is written.
fn move_raw(
    s: &mut CudaStorage,
    l: &Layout,
    slots: &[u32],
    dst: &[u32],
    units: usize,
) -> Result<()> {
    with_quantized(s, l, "move_raw", |dev, base| {
        let tmp = dev.alloc_zeros::<u16>(slots.len() * units)?;
        let tmp_p = addr(dev, &tmp);
        let (src_d, dst_d) = (dev.clone_htod(slots)?, dev.clone_htod(dst)?);
        let n = slots.len();
        move_units(dev, "tessera_gather_rows", (base, tmp_p), &src_d, n, units)?;
        move_units(dev, "tessera_scatter_rows", (tmp_p, base), &dst_d, n, units)
    })
}

/// A device slice's address, for kernels that take raw pointers (the
/// slice outlives the launch; everything runs on the device's one stream).
pub(crate) fn addr<T>(dev: &CudaDevice, s: &CudaSlice<T>) -> u64 {
    let stream = dev.cuda_stream();
    let (p, _sync) = s.device_ptr(&stream);
    p
}

/// `paged_attention` on CUDA: partial softmax states per partition of the
/// context, merged by log-sum-exp. Prefill chunks go through the tiled
/// kernel ([`super::attention_tiles`]: each K/V row loaded once for a tile
/// of tokens and heads), decode through the per-query kernel
/// ([`super::attention_split`]). Returns `[tokens, n_heads, head_dim]`.
pub(crate) fn paged_attention(
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    meta: &PagedMeta,
    (n_heads, n_kv_heads, head_dim): (usize, usize, usize),
) -> Result<(CudaStorage, Shape)> {
    let dev = q.0.device.clone();
    let S::F32(qs) = &q.0.slice else {
        bail!("paged_attention: queries must be f32 on the GPU")
    };
    let qs = qs.slice(range(q.1, "queries")?);
    let tokens = meta.token_pos.len();
    // SAFETY: the merge writes every output value before anything reads it.
    let out = unsafe { dev.alloc::<f32>(tokens * n_heads * head_dim)? };
    let stream = dev.cuda_stream();
    let kt = KvType::of_dims(k.0.dtype(), k.1.dims())?;
    if kt != KvType::of_dims(v.0.dtype(), v.1.dims())? {
        bail!(
            "paged_attention on CUDA: K and V caches of different types ({:?}, {:?})",
            k.1.dims(),
            v.1.dims()
        )
    }
    // Over a quantized cache the launch rotates the queries in place: a
    // copy of them.
    let rotated = if kt.is_quantized() {
        // SAFETY: filled from the queries just below, before any read.
        let mut c = unsafe { dev.alloc::<f32>(qs.len())? };
        stream.memcpy_dtod(&qs, &mut c).w()?;
        Some(c)
    } else {
        None
    };
    let (qp, _q) = match &rotated {
        Some(c) => c.device_ptr(&stream),
        None => qs.device_ptr(&stream),
    };
    macro_rules! go {
        ($suffix:expr, $k:expr, $v:expr) => {{
            let kc = $k.slice(range(k.1, "K cache")?);
            let vc = $v.slice(range(v.1, "V cache")?);
            let (kp, _k) = kc.device_ptr(&stream);
            let (vp, _v) = vc.device_ptr(&stream);
            let bufs = AttnBuffers {
                q: qp,
                k: kp,
                v: vp,
                out: addr(&dev, &out),
                cache: $suffix,
            };
            attention_into(&dev, &bufs, meta, (n_heads, n_kv_heads, head_dim))?
        }};
    }
    match (&k.0.slice, &v.0.slice) {
        (S::F32(kc), S::F32(vc)) => go!("f32", kc, vc),
        (S::F16(kc), S::F16(vc)) => go!("f16", kc, vc),
        (S::BF16(kc), S::BF16(vc)) => go!("bf16", kc, vc),
        (S::U8(kc), S::U8(vc)) => go!(kt.name(), kc, vc),
        _ => bail!(
            "paged_attention on CUDA: K/V caches must share a dtype, got {:?}/{:?}",
            k.0.dtype(),
            v.0.dtype()
        ),
    }
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from((tokens, n_heads, head_dim)),
    ))
}

/// Paged attention from raw device addresses (see [`paged_attention`]):
/// the partial states allocated here, the tables uploaded (kept for the
/// next layers), the merge writing `b.out`.
pub(crate) fn attention_into(
    dev: &CudaDevice,
    b: &AttnBuffers,
    meta: &PagedMeta,
    heads: (usize, usize, usize),
) -> Result<()> {
    let plan = AttnPlan::new(meta, heads)?;
    let tokens = meta.token_pos.len();
    let states = plan.states(tokens, heads.0);
    // SAFETY (the three allocations): the attention kernels write every
    // partial state, an empty partition's too, before the merge reads them.
    let part_out = unsafe { dev.alloc::<f32>(states * heads.2)? };
    let part_max = unsafe { dev.alloc::<f32>(states)? };
    let part_sum = unsafe { dev.alloc::<f32>(states)? };
    let tables = upload(dev, meta.block_tables)?;
    let seqs = upload(dev, meta.token_seq)?;
    let pos = upload(dev, meta.token_pos)?;
    let tile_table = match &plan.tiles {
        Some(t) => Some((upload(dev, t.tiles.as_flattened())?, t.tiles.len())),
        None => None,
    };
    let launch = AttnLaunch {
        bufs: b,
        tables: addr(dev, &*tables),
        seqs: addr(dev, &*seqs),
        pos: addr(dev, &*pos),
        tiles: tile_table.as_ref().map(|(t, n)| (addr(dev, &**t), *n)),
        partials: (
            addr(dev, &part_out),
            addr(dev, &part_max),
            addr(dev, &part_sum),
        ),
        heads,
        tokens,
        block_size: meta.block_size,
        max_blocks: meta.max_blocks,
        scale: meta.scale,
        window: meta.window,
        parts: plan.parts,
        part_len: plan.part_len,
        counters: None,
    };
    launch_attention(dev, &launch)
}

/// Runs [`attention_calls`]' launches on the device's stream.
pub(crate) fn launch_attention(dev: &CudaDevice, a: &AttnLaunch) -> Result<()> {
    for c in attention_calls(a) {
        launch(dev, &c)?;
    }
    Ok(())
}

/// One [`Call`] on the device's stream.
fn launch(dev: &CudaDevice, c: &Call) -> Result<()> {
    let (module, ptx) = match c.module {
        Module::KvOps => ("tessera_kv_ops", KV_OPS_PTX),
        Module::Attention => ("tessera_paged_attention", ATTENTION_PTX),
        Module::Forward => bail!(
            "{}: forward.cu's kernels launch through gpu::forward",
            c.name
        ),
    };
    let f = dev.get_or_load_custom_func(&c.name, module, ptx)?;
    // SAFETY: the calls come from the launchers in `launch.rs`, whose
    // callers checked shapes, block tables and positions against the
    // buffers; each argument list is its kernel's parameters (the
    // kernel-emu build checks them against the source's signatures).
    unsafe { launch_with(f.builder(), c) }
}

/// Pushes `c`'s arguments onto `b` (a kernel's launch builder) and launches
/// its grid.
///
/// # Safety
/// The call's buffers hold what its kernel reads and writes, and `b` is
/// the builder of the kernel `c` names.
pub(crate) unsafe fn launch_with<'a>(mut b: LaunchArgs<'a>, c: &'a Call) -> Result<()> {
    for a in &c.args {
        match a {
            Arg::Ptr(p) => b.arg(p),
            Arg::U32(v) => b.arg(v),
            Arg::F32(v) => b.arg(v),
        };
    }
    let cfg = LaunchConfig {
        grid_dim: c.grid,
        block_dim: (c.threads, 1, 1),
        shared_mem_bytes: c.shared,
    };
    b.launch(cfg).w()?;
    Ok(())
}
