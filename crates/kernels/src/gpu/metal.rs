//! Metal launchers (feature `metal`, Apple targets): each `.metal` source,
//! its headers inlined ([`super::metal_source`]), is compiled at run time
//! through candle's Metal device with fast math off, once per device;
//! pipelines are cached by device and entry point. They run on candle's
//! command encoder from the `metal_fwd` of the ops in `kv/write.rs`,
//! `kv/copy.rs`, `kv/shift.rs` and `attention/paged.rs`, with the launch shapes and
//! host tables of [`super`] (those the CUDA launchers and the `kernel-emu`
//! tests use).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::{bail, DType, Layout, MetalDevice, MetalStorage, Result, Shape};
use candle_metal_kernels::metal::{Buffer, ComputeCommandEncoder, ComputePipeline, Library};
use objc2_metal::{MTLCompileOptions, MTLMathFloatingPointFunctions, MTLMathMode, MTLSize};

use super::{metal_source, Launch, RopeTables};
use crate::{PagedMeta, RopeStyle};

const KV_OPS: &str = "kv_ops.metal";
const ATTENTION: &str = "paged_attention.metal";

fn wrap(e: candle_metal_kernels::MetalKernelError) -> candle_core::Error {
    candle_core::Error::Msg(format!("Tessera Metal kernels: {e}"))
}

/// Rounded per operation as on the CPU: no fast math, so no contraction of
/// a multiply and an add into an FMA and precise `exp`.
fn options() -> objc2::rc::Retained<MTLCompileOptions> {
    let o = MTLCompileOptions::new();
    if objc2::available!(macos = 15, ios = 18) {
        o.setMathMode(MTLMathMode::Safe);
        o.setMathFloatingPointFunctions(MTLMathFloatingPointFunctions::Precise);
    } else {
        #[allow(deprecated)]
        o.setFastMathEnabled(false);
    }
    o
}

/// The compiled libraries and pipelines of each device (by registry id).
#[derive(Default)]
struct Cache {
    libraries: HashMap<(u64, &'static str), Library>,
    pipelines: HashMap<(u64, String), ComputePipeline>,
}

fn cache() -> &'static Mutex<Cache> {
    static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// The pipeline of entry point `name` of source `file` on `dev`, compiled
/// on first use.
fn pipeline(dev: &MetalDevice, file: &'static str, name: &str) -> Result<ComputePipeline> {
    let md = dev.metal_device();
    let id = md.registry_id();
    let mut c = cache().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = c.pipelines.get(&(id, name.to_string())) {
        return Ok(p.clone());
    }
    let lib = match c.libraries.entry((id, file)) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => e.insert(
            md.new_library_with_source(&metal_source(file)?, Some(&options()))
                .map_err(wrap)?,
        ),
    };
    let f = lib.get_function(name, None).map_err(wrap)?;
    let p = md
        .new_compute_pipeline_state_with_function(&f)
        .map_err(wrap)?;
    c.pipelines.insert((id, name.to_string()), p.clone());
    Ok(p)
}

/// One kernel argument, at its index.
enum Arg<'a> {
    /// A buffer the kernel reads, from a byte offset.
    In(&'a Buffer, usize),
    /// A buffer the kernel writes (and may read).
    Out(&'a Buffer, usize),
    /// A `constant T&` scalar or struct.
    Bytes(&'a [u8]),
}

fn bytes<T: Copy>(x: &T) -> &[u8] {
    // SAFETY: `T` is a plain value (u32, f32 or a #[repr(C)] struct of
    // them) read as its bytes.
    unsafe { std::slice::from_raw_parts(x as *const T as *const u8, std::mem::size_of::<T>()) }
}

/// Dispatches `grid` threadgroups of `threads` threads of entry point
/// `name` with `args` bound at indices 0, 1, … on candle's encoder.
fn dispatch(
    dev: &MetalDevice,
    (file, name): (&'static str, &str),
    args: &[Arg],
    grid: (usize, usize, usize),
    threads: usize,
) -> Result<()> {
    let p = pipeline(dev, file, name)?;
    let guard = dev.command_encoder()?;
    let enc: &ComputeCommandEncoder = guard.as_ref();
    enc.set_compute_pipeline_state(&p);
    for (i, a) in args.iter().enumerate() {
        match *a {
            Arg::In(b, off) => enc.set_input_buffer(i, Some(b), off),
            Arg::Out(b, off) => enc.set_output_buffer(i, Some(b), off),
            Arg::Bytes(v) => enc.set_bytes_directly(i, v.len(), v.as_ptr().cast()),
        }
    }
    enc.dispatch_thread_groups(
        MTLSize {
            width: grid.0,
            height: grid.1,
            depth: grid.2,
        },
        MTLSize {
            width: threads,
            height: 1,
            depth: 1,
        },
    );
    Ok(())
}

/// The byte offset of a contiguous layout's first element.
fn offset(l: &Layout, dtype: DType, what: &str) -> Result<usize> {
    if !l.is_contiguous() {
        bail!("{what} must be contiguous")
    }
    Ok(l.start_offset() * dtype.size_in_bytes())
}

/// The kernel suffix of a float cache.
fn suffix(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        d => bail!("the Metal KV kernels support f32, f16 and bf16 caches, not {d:?}"),
    })
}

/// A host slice in a new device buffer (a one-value buffer for an empty
/// slice, so every binding has an address).
fn upload<T: Copy + Default>(dev: &MetalDevice, v: &[T]) -> Result<Arc<Buffer>> {
    let one = [T::default()];
    dev.new_buffer_with_data(if v.is_empty() { &one[..] } else { v })
}

/// Stores f32 rows (`slots.len()` rows of `row` values at byte `src_off`
/// of `src`) at `slots`.
fn scatter(
    s: &MetalStorage,
    l: &Layout,
    (src, src_off): (&Buffer, usize),
    slots: &[u32],
    row: usize,
) -> Result<()> {
    if slots.is_empty() {
        return Ok(());
    }
    let dev = s.device();
    let off = offset(l, s.dtype(), "KV cache")?;
    let slots_d = upload(dev, slots)?;
    let row_u = row as u32;
    let launch = Launch::per_item(slots.len(), row);
    dispatch(
        dev,
        (KV_OPS, &format!("tessera_write_kv_{}", suffix(s.dtype())?)),
        &[
            Arg::In(src, src_off),
            Arg::Out(s.buffer(), off),
            Arg::In(&slots_d, 0),
            Arg::Bytes(bytes(&row_u)),
        ],
        (launch.blocks as usize, 1, 1),
        launch.threads as usize,
    )
}

/// `write_kv`: `new` (f32, `[tokens, n_kv_heads, head_dim]`) into the cache.
pub(crate) fn write_kv(
    s: &mut MetalStorage,
    l: &Layout,
    new: &MetalStorage,
    ln: &Layout,
    slots: &[u32],
) -> Result<()> {
    if new.dtype() != DType::F32 {
        bail!("write_kv: new K/V must be f32 on the GPU")
    }
    let row = ln.shape().elem_count() / slots.len().max(1);
    let src_off = offset(ln, DType::F32, "new K/V")?;
    scatter(s, l, (new.buffer(), src_off), slots, row)
}

/// `copy_blocks`: whole blocks moved as 16-bit units (any cache type).
pub(crate) fn copy_blocks(
    s: &mut MetalStorage,
    l: &Layout,
    pairs: &[(u32, u32)],
    block_bytes: usize,
) -> Result<()> {
    if pairs.is_empty() {
        return Ok(());
    }
    let dev = s.device();
    let off = offset(l, s.dtype(), "KV cache")?;
    let flat: Vec<u32> = pairs.iter().flat_map(|&(a, b)| [a, b]).collect();
    let pairs_d = upload(dev, &flat)?;
    let units = (block_bytes / 2) as u32;
    let launch = Launch::per_item(pairs.len(), units as usize);
    dispatch(
        dev,
        (KV_OPS, "tessera_copy_blocks"),
        &[
            Arg::Out(s.buffer(), off),
            Arg::In(&pairs_d, 0),
            Arg::Bytes(bytes(&units)),
        ],
        (launch.blocks as usize, 1, 1),
        launch.threads as usize,
    )
}

/// The rows at `slots` gathered as f32 (rotated per `t`), then stored at
/// `dst`: every row is read before any is written, so moves may overlap
/// (the encoder orders the scatter after the gather, which wrote what it
/// reads).
pub(crate) fn move_rows(
    s: &mut MetalStorage,
    l: &Layout,
    slots: &[u32],
    dst: &[u32],
    t: &RopeTables,
    (heads, head_dim, style): (usize, usize, RopeStyle),
) -> Result<()> {
    if slots.is_empty() {
        return Ok(());
    }
    let dev = s.device().clone();
    let off = offset(l, s.dtype(), "KV cache")?;
    let row = heads * head_dim;
    let out = dev.new_buffer(slots.len() * row, DType::F32, "tessera_gather")?;
    let slots_d = upload(&dev, slots)?;
    let tables_d = upload(&dev, &t.tables)?;
    let cos_d = upload(&dev, &t.cos)?;
    let sin_d = upload(&dev, &t.sin)?;
    let (h, d, neox) = (
        heads as u32,
        head_dim as u32,
        (style == RopeStyle::Neox) as u32,
    );
    let launch = Launch::per_item(slots.len(), row / 2);
    dispatch(
        &dev,
        (
            KV_OPS,
            &format!("tessera_rope_gather_{}", suffix(s.dtype())?),
        ),
        &[
            Arg::In(s.buffer(), off),
            Arg::Out(&out, 0),
            Arg::In(&slots_d, 0),
            Arg::In(&tables_d, 0),
            Arg::In(&cos_d, 0),
            Arg::In(&sin_d, 0),
            Arg::Bytes(bytes(&h)),
            Arg::Bytes(bytes(&d)),
            Arg::Bytes(bytes(&neox)),
        ],
        (launch.blocks as usize, 1, 1),
        launch.threads as usize,
    )?;
    scatter(s, l, (&out, 0), dst, row)
}

/// `paged_attention` on Metal: partial softmax states per partition of
/// the context (as the CUDA per-query kernel splits it), merged by
/// log-sum-exp. Returns `[tokens, n_heads, head_dim]`.
pub(crate) fn paged_attention(
    q: (&MetalStorage, &Layout),
    k: (&MetalStorage, &Layout),
    v: (&MetalStorage, &Layout),
    meta: &PagedMeta,
    (n_heads, n_kv_heads, head_dim): (usize, usize, usize),
) -> Result<(MetalStorage, Shape)> {
    if head_dim > 256 {
        bail!("paged_attention on Metal supports head_dim up to 256, not {head_dim}")
    }
    if q.0.dtype() != DType::F32 {
        bail!("paged_attention: queries must be f32 on the GPU")
    }
    if k.0.dtype() != v.0.dtype() {
        bail!(
            "paged_attention on Metal: K/V caches must share a dtype, got {:?}/{:?}",
            k.0.dtype(),
            v.0.dtype()
        )
    }
    let dev = q.0.device().clone();
    let tokens = meta.token_pos.len();
    let plan = super::metal_plan::attention(meta, (n_heads, n_kv_heads, head_dim));
    let states = tokens * n_heads * plan.parts;
    let part_out = dev.new_buffer(states * head_dim, DType::F32, "tessera_part_out")?;
    let part_max = dev.new_buffer(states, DType::F32, "tessera_part_max")?;
    let part_sum = dev.new_buffer(states, DType::F32, "tessera_part_sum")?;
    let tables = upload(&dev, meta.block_tables)?;
    let seqs = upload(&dev, meta.token_seq)?;
    let pos = upload(&dev, meta.token_pos)?;
    let args = plan.args;
    let count = tokens * n_heads * head_dim;
    let out = dev.new_buffer(count, DType::F32, "tessera_attention")?;
    // One partition: the kernel normalises its sums into the output.
    let first = if plan.direct { &out } else { &part_out };
    dispatch(
        &dev,
        (
            ATTENTION,
            &format!("tessera_paged_attention_{}", suffix(k.0.dtype())?),
        ),
        &[
            Arg::In(q.0.buffer(), offset(q.1, DType::F32, "queries")?),
            Arg::In(k.0.buffer(), offset(k.1, k.0.dtype(), "K cache")?),
            Arg::In(v.0.buffer(), offset(v.1, v.0.dtype(), "V cache")?),
            Arg::In(&tables, 0),
            Arg::In(&seqs, 0),
            Arg::In(&pos, 0),
            Arg::Out(first, 0),
            Arg::Out(&part_max, 0),
            Arg::Out(&part_sum, 0),
            Arg::Bytes(bytes(&args)),
        ],
        plan.grid,
        plan.threads,
    )?;
    if !plan.direct {
        dispatch(
            &dev,
            (ATTENTION, "tessera_attention_merge"),
            &[
                Arg::In(&part_out, 0),
                Arg::In(&part_max, 0),
                Arg::In(&part_sum, 0),
                Arg::Out(&out, 0),
                Arg::Bytes(bytes(&args)),
            ],
            plan.merge_grid,
            plan.merge_threads,
        )?;
    }
    Ok((
        MetalStorage::new(out, dev, count, DType::F32),
        Shape::from((tokens, n_heads, head_dim)),
    ))
}
