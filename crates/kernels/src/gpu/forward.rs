//! The GPU executor's kernels on CUDA (`gpu/forward.cu`): quantized
//! matrix-vector products with f32 activations, RMSNorm, the q/k/v step
//! (biases, q/k norms, RoPE, K/V into the paged cache), the gated
//! activation and the residual add, launched from raw device addresses on
//! candle's stream (no tensors, no allocation per launch). tessera-model's
//! CUDA forward drives them, with [`Forward::attention`] (the paged
//! attention kernels of `paged_attention.cu`) in between.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::cublas::{self, CudaBlas};
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaStorageSlice as S, WrapErr};
use candle_core::{bail, CudaDevice, Result, Storage, Tensor};

use super::cuda::{addr, attention_into, launch_attention, launch_with, AttnBuffers, AttnLaunch};
use super::launch::{
    act_mul_call, dequant_call, forward_kernels, per_row_call, product_call, qkv_call, Call,
    NORM_STAGE_BYTES,
};
pub use super::launch::{DevWeight, GemvFormat, GemvIo, QkvStep};
use crate::PagedMeta;

const FORWARD_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/forward.ptx"));

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for u32 {}
    impl Sealed for i32 {}
}

/// Plain 4-byte values (f32, u32, i32) that the forward's f32 device
/// buffers carry as their bits: activations, and the batch's positions,
/// slots and block tables.
pub trait Bits32: Copy + sealed::Sealed {}
impl Bits32 for f32 {}
impl Bits32 for u32 {}
impl Bits32 for i32 {}

/// `src` copied into the start of `dst`, bit for bit.
pub fn upload_bits<T: Bits32>(
    stream: &Arc<CudaStream>,
    src: &[T],
    dst: &mut CudaSlice<f32>,
) -> Result<()> {
    if src.is_empty() {
        return Ok(());
    }
    // SAFETY: `T` is f32, u32 or i32 (the trait is sealed): four bytes,
    // four-byte aligned, and every bit pattern is some f32.
    let raw: &[f32] = unsafe { std::slice::from_raw_parts(src.as_ptr().cast(), src.len()) };
    stream.memcpy_htod(raw, &mut dst.slice_mut(..src.len())).w()
}

/// A captured CUDA graph that may be moved to another thread. cudarc's
/// graph is not `Send` (it holds raw driver handles); the driver lets any
/// thread launch a graph, and a graph here is only reached through its
/// owner's lock (tessera-model's CUDA forward), so never from two threads
/// at once: it is `Send`, and not `Sync`.
pub struct SendGraph(CudaGraph);

impl SendGraph {
    pub fn new(graph: CudaGraph) -> SendGraph {
        SendGraph(graph)
    }

    /// Launches the graph on the stream it was captured on.
    pub fn launch(&self) -> Result<()> {
        self.0.launch().w()
    }
}

// SAFETY: see `SendGraph`: moved between threads, never shared.
unsafe impl Send for SendGraph {}

/// The loaded kernels of `forward.cu` for one device.
pub struct Forward {
    dev: CudaDevice,
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    /// Every kernel the launchers use ([`forward_kernels`]), by name.
    funcs: HashMap<String, CudaFunction>,
    /// candle's cuBLAS handle (on the same stream).
    blas: Arc<CudaBlas>,
    /// Warps per row for every product (`None`: by the row's length).
    row_warps: Option<u32>,
    /// Products normalize their inputs themselves where they fit.
    fuse_norm: bool,
    /// Decode attention merges its partitions in its own launch.
    fuse_merge: bool,
}

impl Forward {
    pub fn new(dev: &CudaDevice) -> Result<Forward> {
        let stream = dev.cuda_stream();
        let module = stream
            .context()
            .load_module(Ptx::from_src(FORWARD_PTX))
            .w()?;
        let funcs = forward_kernels()
            .into_iter()
            .map(|name| {
                let f = module.load_function(&name).w()?;
                Ok((name, f))
            })
            .collect::<Result<HashMap<_, _>>>()?;
        Ok(Forward {
            dev: dev.clone(),
            funcs,
            blas: dev.cublas_handle(),
            row_warps: crate::tuning::get().gpu_row_warps,
            fuse_norm: crate::tuning::get().gpu_fuse_norm,
            fuse_merge: crate::tuning::get().gpu_fuse_merge,
            stream,
            _module: module,
        })
    }

    /// One [`Call`] of `forward.cu` on this forward's stream.
    ///
    /// # Safety
    /// The call's buffers hold what its kernel reads and writes.
    unsafe fn launch(&self, c: &Call) -> Result<()> {
        let Some(f) = self.funcs.get(&c.name) else {
            bail!("the CUDA forward has no kernel {}", c.name)
        };
        launch_with(self.stream.launch_builder(f), c)
    }

    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    /// Whether a product of `tokens` inputs of `k` values may take
    /// [`GemvIo::norm`] with weights at `w`: one token (on an H200 the
    /// products of several that normalized their own inputs made 8
    /// sequences decoding together 14% slower, 2026-11-28), whose
    /// normalized row fits a block's shared memory, and weights 16-byte
    /// aligned (the tuning can turn it off:
    /// [`crate::tuning::Tuning::gpu_fuse_norm`]).
    pub fn fuses_norm(&self, tokens: usize, k: usize, w: u64) -> bool {
        self.fuse_norm
            && tokens == 1
            && w != 0
            && w.is_multiple_of(16)
            && k.is_multiple_of(4)
            && k * 4 <= NORM_STAGE_BYTES
    }

    /// `y = W·x` (or `y += W·x`) for every input row.
    pub fn gemv(&self, w: &DevWeight, io: &GemvIo) -> Result<()> {
        self.product(w, io, w.rows, false, io.acc as u32)
    }

    /// The gated activation of a stacked gate|up weight (`2n` rows, gate
    /// first): `y[t][r] = act(gate_r·x[t]) · (up_r·x[t])` for `r < n` (act
    /// 0: SiLU, 1: GELU with tanh), in one pass without the two products
    /// in memory. `io.acc` must be false.
    pub fn glu(&self, w: &DevWeight, io: &GemvIo, act: u32) -> Result<()> {
        if !w.rows.is_multiple_of(2) || io.acc {
            bail!("glu: a stacked gate|up weight of {} rows, stored", w.rows)
        }
        self.product(w, io, w.rows / 2, true, act)
    }

    /// A product kernel (GEMV, or `glu`: the gated activation) over
    /// `rows` output rows, `flag` its last integer argument.
    fn product(&self, w: &DevWeight, io: &GemvIo, rows: usize, glu: bool, flag: u32) -> Result<()> {
        if !w.k.is_multiple_of(w.format.block_values()) || !io.x_stride.is_multiple_of(4) {
            bail!(
                "gemv: rows of {} values ({:?}) with inputs {} floats apart",
                w.k,
                w.format,
                io.x_stride
            )
        }
        if let Some((nw, _)) = io.norm {
            if !self.fuses_norm(io.tokens, w.k, nw) {
                bail!(
                    "gemv: {} inputs of {} values normalized by the product",
                    io.tokens,
                    w.k
                )
            }
        }
        if io.tokens == 0 || rows == 0 {
            return Ok(());
        }
        let c = product_call(w, io, rows, glu, flag, self.row_warps);
        // SAFETY: the caller's buffers hold `tokens` rows of x and y at
        // their strides, w its rows of `k` values in its format, and nw
        // (when normalizing) k floats.
        unsafe { self.launch(&c) }
    }

    /// `y = W·x` (or `y += W·x`) for every input row as one f32 GEMM
    /// (cuBLAS, f32 arithmetic throughout: no TF32, no 8-bit activations)
    /// on the weight expanded to f32 into `scratch` (room for `rows · k`
    /// floats): long batches, where the products' kernels would read the
    /// weight once per few tokens. `io.norm` must be `None`.
    pub fn gemm(&self, w: &DevWeight, io: &GemvIo, scratch: u64) -> Result<()> {
        if io.norm.is_some() || !io.x_stride.is_multiple_of(4) {
            bail!(
                "gemm: inputs normalized by the product, or {} floats apart",
                io.x_stride
            )
        }
        if io.tokens == 0 || w.rows == 0 {
            return Ok(());
        }
        // SAFETY: w holds `rows` rows of `k` values in its format and
        // scratch room for rows · k floats.
        unsafe { self.launch(&dequant_call(w, scratch))? };
        // Column-major: Y^T (rows × tokens, ld y_stride) = W'^T (W' is
        // k × rows, ld k) · X^T (k × tokens, ld x_stride).
        let (alpha, beta) = (1f32, if io.acc { 1f32 } else { 0f32 });
        let c = |x: usize| x as std::os::raw::c_int;
        // SAFETY: the caller's buffers hold `tokens` rows of x and y at
        // their strides; scratch holds the weight's rows · k floats; the
        // handle runs on this forward's stream.
        unsafe {
            cublas::result::sgemm(
                *self.blas.handle(),
                cublas::sys::cublasOperation_t::CUBLAS_OP_T,
                cublas::sys::cublasOperation_t::CUBLAS_OP_N,
                c(w.rows),
                c(io.tokens),
                c(w.k),
                &alpha,
                scratch as *const f32,
                c(w.k),
                io.x as *const f32,
                c(io.x_stride),
                &beta,
                io.y as *mut f32,
                c(io.y_stride),
            )
        }
        .map_err(|e| candle_core::Error::Msg(format!("cuBLAS sgemm: {e:?}")))?;
        Ok(())
    }

    /// `out[r] = rms_norm(x[rows[r]])` (`rows` 0: row r) for `n_rows` rows
    /// of `n` values.
    pub fn rms_norm(
        &self,
        (x, rows): (u64, u64),
        w: u64,
        out: u64,
        (n_rows, n): (usize, usize),
        eps: f32,
    ) -> Result<()> {
        // SAFETY (the launch): `n_rows` rows of `n` floats at out, and at x
        // the rows named.
        self.per_row("rms_norm", n_rows, &[x, rows, w, out], n, &[eps])
    }

    /// `x[r] += s * (w ? rms_norm(y[r], w) : y[r])` for `n_rows` rows of `n`.
    pub fn residual(
        &self,
        (x, y, w): (u64, u64, u64),
        (n_rows, n): (usize, usize),
        eps: f32,
        s: f32,
    ) -> Result<()> {
        // SAFETY (the launch): `n_rows` rows of `n` floats at x and y.
        self.per_row("residual", n_rows, &[x, y, w], n, &[eps, s])
    }

    /// A kernel of a block per row over `n_rows` rows of `n` values, its
    /// arguments the addresses, `n`, then the floats.
    fn per_row(
        &self,
        kernel: &str,
        n_rows: usize,
        ptrs: &[u64],
        n: usize,
        floats: &[f32],
    ) -> Result<()> {
        if n_rows == 0 {
            return Ok(());
        }
        // SAFETY: the callers' buffers hold the rows their kernels touch.
        unsafe { self.launch(&per_row_call(kernel, n_rows, ptrs, n, floats)) }
    }

    /// `out[t][j] = act(gu[t][j]) · gu[t][n + j]` (act 0: SiLU, 1: GELU
    /// with tanh).
    pub fn act_mul(&self, gu: u64, out: u64, (tokens, n): (usize, usize), act: u32) -> Result<()> {
        let total = tokens * n;
        if total == 0 {
            return Ok(());
        }
        // SAFETY: `tokens` rows of 2n floats at gu and of n at out.
        unsafe { self.launch(&act_mul_call(gu, out, (tokens, n), act)) }
    }

    /// One layer's q/k/v step (see [`QkvStep`]): K and V into the layer's
    /// caches at the slots, whose host copy `slots` is checked here.
    pub fn qkv(&self, s: &QkvStep, c: &CacheRef, slots: &[u32]) -> Result<()> {
        let (_, kvh, hd) = s.heads;
        if hd > 256 || !hd.is_multiple_of(2) {
            bail!("the CUDA forward supports even head dims up to 256, not {hd}")
        }
        let (nb, bs, ckvh, chd) = c.geometry;
        if (ckvh, chd) != (kvh, hd) || slots.len() != s.tokens {
            bail!(
                "the CUDA forward: {} tokens of {kvh} K/V heads of {hd} for caches of {ckvh} heads of {chd} with {} slots",
                s.tokens,
                slots.len()
            )
        }
        if let Some(&slot) = slots.iter().find(|&&x| x as usize >= nb * bs) {
            bail!(
                "write_kv: slot {slot} outside the cache of {} slots",
                nb * bs
            )
        }
        if s.tokens == 0 {
            return Ok(());
        }
        // SAFETY: the caller's buffers hold `tokens` rows at their strides;
        // the slots were checked against both caches above.
        unsafe { self.launch(&qkv_call(s, (c.k, c.v, c.cache))) }
    }

    /// Paged attention (`paged_attention.cu`) from device addresses: `q`
    /// and `out` `[tokens, n_heads, head_dim]` f32 (`heads`: n_heads,
    /// n_kv_heads, head_dim), over the caches; `meta`'s tables are host
    /// slices, checked here and uploaded once per forward (every layer
    /// reuses them).
    pub fn attention(
        &self,
        (q, out): (u64, u64),
        c: &CacheRef,
        meta: &PagedMeta,
        heads: (usize, usize, usize),
    ) -> Result<()> {
        let heads = crate::attention::paged::check_geometry(
            (meta.token_pos.len(), heads.0, heads.2),
            c.geometry,
            meta,
        )?;
        if meta.token_pos.is_empty() {
            return Ok(());
        }
        let b = AttnBuffers {
            q,
            k: c.k,
            v: c.v,
            out,
            cache: c.cache,
        };
        attention_into(&self.dev, &b, meta, heads)
    }
}

/// A layer's K and V caches as the kernels see them: device addresses,
/// element type and geometry `(blocks, block_size, kv_heads, head_dim)`.
/// Made once per step outside any graph capture (reading a candle
/// tensor's address records an event on the stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheRef {
    pub k: u64,
    pub v: u64,
    pub cache: &'static str,
    pub geometry: (usize, usize, usize, usize),
}

impl CacheRef {
    /// Contiguous caches of one type and shape on the GPU: f32, f16 or bf16
    /// `[blocks, block_size, kv_heads, head_dim]`, or quantized (q8_0,
    /// q4_0: [`crate::quant`]'s layout).
    pub fn new(k_cache: &Tensor, v_cache: &Tensor) -> Result<CacheRef> {
        if k_cache.shape() != v_cache.shape() {
            bail!(
                "the CUDA forward: K {:?} and V {:?} caches differ",
                k_cache.shape(),
                v_cache.shape()
            )
        }
        let geometry = crate::cache_geometry(k_cache)?;
        let (k, cache) = tensor_addr(k_cache)?;
        let (v, vcache) = tensor_addr(v_cache)?;
        if cache != vcache {
            bail!("the CUDA forward: K and V caches of different types")
        }
        Ok(CacheRef {
            k,
            v,
            cache,
            geometry,
        })
    }
}

/// A decode attention launch over tables the caller keeps on the device
/// ([`Forward::attention_on`]): nothing is allocated or copied, so the
/// launch can be captured into a CUDA graph and replayed with new table
/// contents.
#[derive(Debug, Clone, Copy)]
pub struct DeviceAttention {
    /// Queries and output, `[tokens, n_heads, head_dim]` f32.
    pub q: u64,
    pub out: u64,
    /// Block tables `[sequences, max_blocks]`, and each token's sequence
    /// and position (u32).
    pub tables: u64,
    pub seqs: u64,
    pub pos: u64,
    /// The device tables' row length (at least the host meta's).
    pub max_blocks: usize,
    /// Partial outputs, maxima and sums, with room for `tokens · n_heads ·
    /// parts` states.
    pub partials: (u64, u64, u64),
    pub parts: usize,
    pub part_len: usize,
    /// A zeroed u32 per (token, head), left zeroed, for the attention to
    /// merge its partitions in the same launch (0: a merge launch of its
    /// own; see [`Forward::fuses_merge`]).
    pub counters: u64,
}

impl Forward {
    /// Whether decode attention merges its partitions in its own launch
    /// (given [`DeviceAttention::counters`]), per the tuning
    /// ([`crate::tuning::Tuning::gpu_fuse_merge`]).
    pub fn fuses_merge(&self) -> bool {
        self.fuse_merge
    }

    /// Paged attention with the per-query kernel over device tables (see
    /// [`DeviceAttention`]); `meta` is their host copy (its block tables
    /// may have shorter rows), checked against the caches here, and gives
    /// the block size, scale and window. `parts · part_len` must cover the
    /// longest context.
    pub fn attention_on(
        &self,
        a: &DeviceAttention,
        c: &CacheRef,
        meta: &PagedMeta,
        heads: (usize, usize, usize),
    ) -> Result<()> {
        let heads = crate::attention::paged::check_geometry(
            (meta.token_pos.len(), heads.0, heads.2),
            c.geometry,
            meta,
        )?;
        let longest = meta
            .token_pos
            .iter()
            .map(|&p| p as usize + 1)
            .max()
            .unwrap_or(0);
        if a.max_blocks < meta.max_blocks || a.parts * a.part_len < longest {
            bail!(
                "attention_on: tables of {} blocks or {} partitions of {} for {} blocks and {longest} positions",
                a.max_blocks,
                a.parts,
                a.part_len,
                meta.max_blocks
            )
        }
        if meta.token_pos.is_empty() {
            return Ok(());
        }
        let bufs = AttnBuffers {
            q: a.q,
            k: c.k,
            v: c.v,
            out: a.out,
            cache: c.cache,
        };
        launch_attention(
            &self.dev,
            &AttnLaunch {
                bufs: &bufs,
                tables: a.tables,
                seqs: a.seqs,
                pos: a.pos,
                tiles: None,
                partials: a.partials,
                heads,
                tokens: meta.token_pos.len(),
                block_size: meta.block_size,
                max_blocks: a.max_blocks,
                scale: meta.scale,
                window: meta.window,
                parts: a.parts,
                part_len: a.part_len,
                counters: (a.counters != 0).then_some(a.counters),
            },
        )
    }
}

/// A contiguous f32, f16 or bf16 tensor's device address (at its layout's
/// start) and element type ("f32", "f16" or "bf16"): K/V caches (also
/// quantized ones, "q8_0" or "q4_0": bytes whose last dimension is the
/// block's size), and the model's norm and bias vectors.
pub fn tensor_addr(t: &Tensor) -> Result<(u64, &'static str)> {
    let (st, l) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*st else {
        bail!("the CUDA forward: a tensor that is not on the GPU")
    };
    if !l.is_contiguous() {
        bail!("the CUDA forward: tensors must be contiguous")
    }
    let dev = &cs.device;
    let at = |base: u64, size: usize| base + (l.start_offset() * size) as u64;
    Ok(match &cs.slice {
        S::F32(c) => (at(addr(dev, c), 4), "f32"),
        S::F16(c) => (at(addr(dev, c), 2), "f16"),
        S::BF16(c) => (at(addr(dev, c), 2), "bf16"),
        S::U8(c) => match crate::KvType::of_dims(t.dtype(), t.dims()) {
            Ok(k) => (at(addr(dev, c), 1), k.name()),
            Err(_) => bail!(
                "the CUDA forward takes no u8 tensor of shape {:?}",
                t.dims()
            ),
        },
        _ => bail!(
            "the CUDA forward supports f32, f16 and bf16 tensors, not {:?}",
            t.dtype()
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::GemvFormat;

    #[test]
    fn rows_take_the_fewest_warps_that_cover_them_in_one_pass() {
        let one = |f: GemvFormat, k| f.row_warps(k, f.per_pass(true));
        let many = |f: GemvFormat, k| f.row_warps(k, f.per_pass(false));
        // SmolLM2-135M's rows (576 and 1536 values), one token (8 items a
        // lane a pass in Q4_1) and several (2).
        assert_eq!(one(GemvFormat::Q4_1, 576), 1);
        assert_eq!(one(GemvFormat::Q4_1, 1536), 1);
        assert_eq!(many(GemvFormat::Q4_1, 576), 2);
        // A 1B model's (2048 and 8192): the long rows take four.
        assert_eq!(one(GemvFormat::Q4_0, 2048), 1);
        assert_eq!(one(GemvFormat::Q4_0, 8192), 4);
        assert_eq!(many(GemvFormat::Q4K, 8192), 4);
        // K-quants take 4 items a lane for one token; Q6_K's items are
        // twice as wide.
        assert_eq!(one(GemvFormat::Q4K, 2048), 2);
        assert_eq!(one(GemvFormat::Q4K, 8192), 4);
        assert_eq!(one(GemvFormat::Q6K, 2048), 1);
        assert_eq!(many(GemvFormat::Q6K, 2048), 2);
    }
}
