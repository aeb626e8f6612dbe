//! The forward on CUDA: the model's layers run as a short sequence of
//! Tessera's own kernels (`tessera_kernels::gpu::forward`) over buffers
//! allocated once and grown as batches need, instead of the candle
//! reference forward's one operation (and allocation) per step.
//!
//! Per layer: the q/k/v products (one launch where the weights are
//! stacked) of the RMSNorm that their blocks compute; biases, q/k norms,
//! RoPE and the K/V store in one kernel; paged attention; the output
//! product added into the residual stream by its own epilogue; gate and
//! up with the gated activation, of the next RMSNorm; the down product
//! added into the residual. (Several tokens, or a row too long for a
//! block's shared memory, take a norm kernel before the products.)
//! Post-norms and residual scales (Gemma 3, Granite) take one more kernel
//! each. The quantized products read the GGML blocks where the loader put
//! them and multiply them in f32 with f32 activations, as the reference
//! does (no 8-bit activations).
//!
//! What it does not run (weights in other formats or dense safetensors
//! tensors, OLMo 2's whole-row q/k norm, head dims over 256) is reported
//! by [`GpuForward::new`], and the model keeps the reference forward.

use candle_core::cuda_backend::cudarc::driver::sys::{
    CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, Storage, Tensor, TensorId};
use std::collections::HashMap;
use std::sync::Arc;
use tessera_kernels::gpu::forward::{
    tensor_addr, upload_bits, Bits32, CacheRef, DevWeight, DeviceAttention, Forward, GemvFormat,
    GemvIo, QkvStep, SendGraph,
};
use tessera_kernels::{PagedMeta, RopeStyle};

use crate::config::Activation;
use crate::llama::{rope_angles, Batch, LayerKv, Llama};
use crate::qlinear::{Proj, QLinear};
use crate::{ModelError, Result};

/// One layer's device addresses (0: absent).
struct GpuLayer {
    attn_norm: u64,
    /// Each projection and the column of the q|k|v row it writes.
    qkv: Vec<(DevWeight, usize)>,
    biases: [u64; 3],
    qk_norms: [u64; 2],
    o: DevWeight,
    ffn_norm: u64,
    /// Gate, then up, at columns 0 and `ffn` of the gate|up row.
    gate_up: Vec<(DevWeight, usize)>,
    down: DevWeight,
    post_attn_norm: u64,
    post_ffn_norm: u64,
}

/// A grow-only f32 device buffer.
#[derive(Default)]
struct Buf {
    slice: Option<CudaSlice<f32>>,
    ptr: u64,
    len: usize,
    /// Times (re)allocated.
    grown: usize,
}

impl Buf {
    /// The address of at least `n` floats (contents undefined).
    fn at_least(&mut self, stream: &Arc<CudaStream>, n: usize) -> Result<u64> {
        if self.len < n.max(1) {
            let len = n.max(1).next_power_of_two();
            let s = stream.alloc_zeros::<f32>(len).map_err(cuda_err)?;
            self.ptr = {
                let (p, _sync) = s.device_ptr(stream);
                p
            };
            self.slice = Some(s);
            self.len = len;
            self.grown += 1;
        }
        Ok(self.ptr)
    }

    /// `data` copied in (the buffer grown to hold it); its address.
    fn upload<T: Bits32>(&mut self, stream: &Arc<CudaStream>, data: &[T]) -> Result<u64> {
        let ptr = self.at_least(stream, data.len())?;
        let s = self.slice.as_mut().expect("allocated above");
        upload_bits(stream, data, s)?;
        Ok(ptr)
    }
}

fn cuda_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Config(format!("CUDA: {e}"))
}

/// The per-batch buffers.
#[derive(Default)]
struct Bufs {
    x: Buf,
    h: Buf,
    qkv: Buf,
    q: Buf,
    att: Buf,
    gu: Buf,
    act: Buf,
    tmp: Buf,
    /// A weight expanded to f32 for a long batch's GEMM.
    deq: Buf,
    slots: Buf,
    sliding_slots: Buf,
    picks: Buf,
    last: Buf,
    logits: Buf,
    /// Decode batches' attention tables and partial states.
    tables: Buf,
    sliding_tables: Buf,
    seqs: Buf,
    pos: Buf,
    part_out: Buf,
    part_max: Buf,
    part_sum: Buf,
    /// The attention's per-(token, head) counters of finished partitions
    /// (u32, zero between launches).
    counters: Buf,
    /// cos and sin per RoPE frequency set.
    rope: Vec<(Buf, Buf)>,
}

impl Bufs {
    /// Allocations made so far: a graph captured before one is stale.
    fn generation(&self) -> usize {
        let all = [
            &self.x,
            &self.h,
            &self.qkv,
            &self.q,
            &self.att,
            &self.gu,
            &self.act,
            &self.tmp,
            &self.deq,
            &self.slots,
            &self.sliding_slots,
            &self.picks,
            &self.last,
            &self.logits,
            &self.tables,
            &self.sliding_tables,
            &self.seqs,
            &self.pos,
            &self.part_out,
            &self.part_max,
            &self.part_sum,
            &self.counters,
        ];
        all.iter().map(|b| b.grown).sum::<usize>()
            + self
                .rope
                .iter()
                .map(|(c, s)| c.grown + s.grown)
                .sum::<usize>()
    }
}

pub(crate) struct GpuForward {
    k: Forward,
    stream: Arc<CudaStream>,
    layers: Vec<GpuLayer>,
    norm: u64,
    head: DevWeight,
    bufs: Bufs,
    /// Captured decode steps by shape.
    graphs: HashMap<GraphKey, SendGraph>,
    /// Off once a capture has failed.
    graphs_on: bool,
    /// Cache tensors' addresses by the tensors' ids.
    cache_refs: HashMap<(TensorId, TensorId), CacheRef>,
    /// The decode shape of the step before, when it was launched directly.
    last_shape: Option<GraphKey>,
    /// Values of the largest layer weight: what a long batch's GEMMs
    /// expand to f32 at once.
    largest: usize,
}

fn weight(w: &QLinear) -> std::result::Result<DevWeight, String> {
    match w {
        QLinear::Quantized(q) => {
            let format = GemvFormat::from_ggml(q.dtype())
                .ok_or_else(|| format!("weights in {:?}", q.dtype()))?;
            let (rows, k) = q.shape().dims2().map_err(|e| e.to_string())?;
            if !k.is_multiple_of(format.block_values()) || !k.is_multiple_of(4) {
                return Err(format!("rows of {k} values in {format:?}"));
            }
            let ptr = q.device_ptr().map_err(|e| e.to_string())? as u64;
            Ok(DevWeight {
                ptr,
                format,
                rows,
                k,
            })
        }
        QLinear::Dense(_) => Err("dense (safetensors) weights".into()),
    }
}

fn proj<const N: usize>(p: &Proj<N>) -> std::result::Result<Vec<(DevWeight, usize)>, String> {
    match p {
        Proj::Stacked(w, _) => Ok(vec![(weight(w)?, 0)]),
        Proj::Split(parts) => {
            let mut at = 0;
            parts
                .iter()
                .map(|w| {
                    let d = weight(w)?;
                    let col = at;
                    at += d.rows;
                    Ok((d, col))
                })
                .collect()
        }
    }
}

/// A contiguous f32 vector's device address; 0 for none.
fn vector(t: Option<&Tensor>) -> std::result::Result<u64, String> {
    let Some(t) = t else { return Ok(0) };
    match tensor_addr(t) {
        Ok((p, "f32")) => Ok(p),
        Ok(_) => Err(format!("a {:?} norm or bias vector", t.dtype())),
        Err(e) => Err(e.to_string()),
    }
}

impl GpuForward {
    /// The executor for `m`'s weights on `dev`, or why it cannot run them.
    pub(crate) fn new(
        m: &Llama,
        dev: &CudaDevice,
    ) -> Result<std::result::Result<GpuForward, String>> {
        let cfg = &m.cfg;
        if cfg.block.qk_norm_whole {
            return Ok(Err("q/k norms over whole rows (OLMo 2)".into()));
        }
        if cfg.head_dim > 256 || !cfg.head_dim.is_multiple_of(2) {
            return Ok(Err(format!("head dim {}", cfg.head_dim)));
        }
        if !cfg.hidden_size.is_multiple_of(4) {
            return Ok(Err(format!("hidden size {}", cfg.hidden_size)));
        }
        let build = || -> std::result::Result<(Vec<GpuLayer>, u64, DevWeight), String> {
            let mut layers = Vec::with_capacity(m.layers.len());
            for l in &m.layers {
                layers.push(GpuLayer {
                    attn_norm: vector(l.attn_norm.as_ref())?,
                    qkv: proj(&l.qkv)?,
                    biases: [
                        vector(l.q_bias.as_ref())?,
                        vector(l.k_bias.as_ref())?,
                        vector(l.v_bias.as_ref())?,
                    ],
                    qk_norms: [vector(l.q_norm.as_ref())?, vector(l.k_norm.as_ref())?],
                    o: weight(&l.o)?,
                    ffn_norm: vector(l.ffn_norm.as_ref())?,
                    gate_up: proj(&l.gate_up)?,
                    down: weight(&l.down)?,
                    post_attn_norm: vector(l.post_attn_norm.as_ref())?,
                    post_ffn_norm: vector(l.post_ffn_norm.as_ref())?,
                });
            }
            Ok((layers, vector(Some(&m.norm))?, weight(&m.lm_head)?))
        };
        let (layers, norm, head) = match build() {
            Ok(b) => b,
            Err(why) => return Ok(Err(why)),
        };
        let k = Forward::new(dev)?;
        let mut bufs = Bufs::default();
        bufs.rope.resize_with(m.inv_freqs.len(), Default::default);
        let largest = layers
            .iter()
            .flat_map(|l| {
                l.qkv
                    .iter()
                    .chain(&l.gate_up)
                    .map(|(w, _)| w)
                    .chain([&l.o, &l.down])
            })
            .map(|w| w.rows * w.k)
            .max()
            .unwrap_or(0);
        Ok(Ok(GpuForward {
            k,
            stream: dev.cuda_stream(),
            largest,
            layers,
            norm,
            head,
            bufs,
            graphs: HashMap::new(),
            graphs_on: true,
            cache_refs: HashMap::new(),
            last_shape: None,
        }))
    }

    /// Logits `[logits_for.len(), vocab]` (f32, on the GPU) for `batch`,
    /// its K/V written into `cache`: [`Llama::forward`] on CUDA.
    ///
    /// A decode batch (one token per sequence) runs as a CUDA graph: the
    /// step's kernels captured once per shape (tokens, logits, the
    /// attention's partitions, the tables' row length, the caches), when
    /// that shape repeats the step before, and replayed with the batch's
    /// embeddings, angles, slots and tables copied into the same buffers
    /// first. Other batches launch the kernels one by one.
    pub(crate) fn forward(
        &mut self,
        m: &Llama,
        batch: &Batch,
        cache: &[LayerKv],
    ) -> Result<Tensor> {
        let cfg = &m.cfg;
        let t = batch.tokens.len();
        let (nh, kvh, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
        let (hidden, ffn) = (cfg.hidden_size, cfg.intermediate_size);
        if cache.len() != self.layers.len() {
            return Err(ModelError::Config(format!(
                "a cache of {} layers for a model of {}",
                cache.len(),
                self.layers.len()
            )));
        }
        let picks = batch.logits_for;
        if let Some(&p) = picks.iter().find(|&&p| p as usize >= t) {
            return Err(ModelError::Config(format!(
                "logits wanted for token {p} of a batch of {t}"
            )));
        }
        // Timed (`phases`, a decode step while `tessera bench` asks): the
        // whole step to its logits, the stream synchronized at the end.
        let timed = crate::phases::CLOCK.timing(batch.token_seq);
        let at = std::time::Instant::now();
        let s = self.stream.clone();
        let vocab = self.head.rows;
        let before = self.bufs.generation();
        {
            let b = &mut self.bufs;
            // The embeddings (looked up on the host) and the batch's tables.
            let mut x_host = vec![0f32; t * hidden];
            m.embed_into(batch.tokens, &mut x_host)?;
            b.x.upload(&s, &x_host)?;
            let half = hd / 2;
            for (f, (cb, sb)) in m.inv_freqs.iter().zip(b.rope.iter_mut()) {
                let mut cos = vec![0f32; t * half];
                let mut sin = vec![0f32; t * half];
                rope_angles(f, m.cfg.rope_scale(), batch.rope(), &mut cos, &mut sin);
                cb.upload(&s, &cos)?;
                sb.upload(&s, &sin)?;
            }
            b.slots.upload(&s, batch.slots)?;
            if let Some(sl) = batch.sliding {
                b.sliding_slots.upload(&s, sl.slots)?;
            }
            b.picks.upload(&s, picks)?;
            b.h.at_least(&s, t * hidden)?;
            b.qkv.at_least(&s, t * (nh + 2 * kvh) * hd)?;
            b.q.at_least(&s, t * nh * hd)?;
            b.att.at_least(&s, t * nh * hd)?;
            b.gu.at_least(&s, t * 2 * ffn)?;
            b.act.at_least(&s, t * ffn)?;
            b.tmp.at_least(&s, t * hidden)?;
            b.last.at_least(&s, picks.len() * hidden)?;
            b.logits.at_least(&s, picks.len() * vocab)?;
            if t > GEMV_TOKENS {
                b.deq.at_least(&s, self.largest)?;
            }
        }
        // The caches' addresses, read once per pair of tensors (reading
        // one records an event on the stream).
        let caches = cache
            .iter()
            .map(|kv| {
                let id = (kv.k.id(), kv.v.id());
                match self.cache_refs.get(&id) {
                    Some(c) => Ok(*c),
                    None => {
                        let c = CacheRef::new(&kv.k, &kv.v)?;
                        self.cache_refs.insert(id, c);
                        Ok(c)
                    }
                }
            })
            .collect::<Result<Vec<_>>>()?;
        if self.cache_refs.len() > 4 * cache.len() {
            self.cache_refs.clear();
        }
        let plan = decode_plan(batch, nh);
        let mut key = None;
        if let Some(p) = &plan {
            let b = &mut self.bufs;
            let padded = |tables: &[u32]| -> Vec<u32> {
                let mut out = vec![0u32; tables.len() / batch.max_blocks.max(1) * p.max_blocks];
                for (row, src) in out
                    .chunks_exact_mut(p.max_blocks)
                    .zip(tables.chunks_exact(batch.max_blocks.max(1)))
                {
                    row[..src.len()].copy_from_slice(src);
                }
                out
            };
            b.tables.upload(&s, &padded(batch.block_tables))?;
            if let Some(sl) = batch.sliding {
                b.sliding_tables.upload(&s, &padded(sl.block_tables))?;
            }
            b.seqs.upload(&s, batch.token_seq)?;
            b.pos.upload(&s, batch.positions)?;
            let states = t * nh * p.parts;
            b.part_out.at_least(&s, states * hd)?;
            b.part_max.at_least(&s, states)?;
            b.part_sum.at_least(&s, states)?;
            // Zeroed when allocated; each attention launch leaves them so.
            b.counters.at_least(&s, t * nh)?;
            key = Some(GraphKey {
                tokens: t,
                picks: picks.len(),
                sliding: batch.sliding.is_some(),
                plan: *p,
                caches: caches.clone(),
            });
        }
        // A buffer that moved leaves every captured graph pointing at the
        // old one.
        if self.bufs.generation() != before {
            self.graphs.clear();
        }
        match key {
            // A shape is captured when it repeats the step before (steady
            // decode); shapes that change from step to step (a server's
            // batches coming and going) launch directly instead of paying
            // a capture each.
            Some(key)
                if self.graphs_on
                    && (self.graphs.contains_key(&key)
                        || self.last_shape.as_ref() == Some(&key)) =>
            {
                if !self.graphs.contains_key(&key) {
                    if self.graphs.len() >= MAX_GRAPHS {
                        self.graphs.clear();
                    }
                    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                        .map_err(cuda_err)?;
                    let launched = self.launch(m, batch, &caches, plan.as_ref());
                    let graph = s.end_capture(CUgraphInstantiate_flags(0));
                    match (launched, graph) {
                        (Ok(()), Ok(Some(g))) => {
                            self.graphs.insert(key.clone(), SendGraph::new(g));
                        }
                        (Err(e), _) => return Err(e),
                        (Ok(()), other) => {
                            // Capture is not to be had here: launch directly
                            // from now on.
                            eprintln!(
                                "tessera: CUDA graph capture failed ({:?}); the CUDA forward launches its kernels one by one",
                                other.err()
                            );
                            self.graphs_on = false;
                            self.launch(m, batch, &caches, plan.as_ref())?;
                        }
                    }
                }
                if let Some(g) = self.graphs.get(&key) {
                    g.launch()?;
                }
            }
            other => {
                self.last_shape = other;
                self.launch(m, batch, &caches, plan.as_ref())?
            }
        }
        let dev = self.k.device().clone();
        let n = picks.len() * vocab;
        // SAFETY: the copy below writes all n values read (none when n is 0).
        let mut logits = unsafe { s.alloc::<f32>(n.max(1)) }.map_err(cuda_err)?;
        if n > 0 {
            let src = self.bufs.logits.slice.as_ref().expect("sized above");
            s.memcpy_dtod(&src.slice(..n), &mut logits.slice_mut(..n))
                .map_err(cuda_err)?;
        }
        if timed {
            s.synchronize().map_err(cuda_err)?;
            crate::phases::CLOCK.add_step(at.elapsed().as_nanos() as u64);
        }
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(logits, dev));
        let logits = Tensor::from_storage(storage, n.max(1), BackpropOp::none(), false)
            .narrow(0, 0, n)?
            .reshape((picks.len(), vocab))?;
        Ok(match cfg.block.logit_scale {
            1.0 => logits,
            sc => (logits * (1.0 / sc) as f64)?,
        })
    }

    /// The step's kernels, in order, on the buffers [`GpuForward::forward`]
    /// filled: nothing here allocates or copies (with a decode `plan`), so
    /// the sequence can be captured.
    fn launch(
        &self,
        m: &Llama,
        batch: &Batch,
        cache: &[CacheRef],
        plan: Option<&DecodePlan>,
    ) -> Result<()> {
        let cfg = &m.cfg;
        let t = batch.tokens.len();
        let (nh, kvh, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
        let (hidden, ffn) = (cfg.hidden_size, cfg.intermediate_size);
        let eps = cfg.rms_eps as f32;
        let rs = cfg.block.residual_scale;
        let b = &self.bufs;
        let (x, h, qkv, q, att, gu, act, tmp) = (
            b.x.ptr, b.h.ptr, b.qkv.ptr, b.q.ptr, b.att.ptr, b.gu.ptr, b.act.ptr, b.tmp.ptr,
        );
        let qkv_w = (nh + 2 * kvh) * hd;
        let windows = m.windows();
        let act_kind = match cfg.block.activation {
            Activation::Silu => 0,
            Activation::GeluTanh => 1,
        };
        // A long batch's products: f32 GEMMs on the weights expanded to
        // f32, each read once, instead of kernels that read them once per
        // few tokens.
        let gemm = t > GEMV_TOKENS;
        let product = |w: &DevWeight, io: &GemvIo| {
            if gemm {
                self.k.gemm(w, io, b.deq.ptr)
            } else {
                self.k.gemv(w, io)
            }
        };
        // A block's output into the residual stream: by the product's own
        // epilogue, or (post-norm, residual scale) through `tmp`.
        let into = |post: u64| {
            if post == 0 && rs == 1.0 {
                (x, true)
            } else {
                (tmp, false)
            }
        };
        for (l, (layer, kv)) in self.layers.iter().zip(cache).enumerate() {
            let window = windows[l];
            let sliding = window > 0 && batch.sliding.is_some();
            let (cos, sin) = &b.rope[m.layer_rope[l]];
            let (input, norm) = self.normed(x, h, layer.attn_norm, (t, hidden), eps)?;
            for (w, col) in &layer.qkv {
                product(
                    w,
                    &GemvIo {
                        x: input,
                        y: qkv + (*col * 4) as u64,
                        tokens: t,
                        x_stride: hidden,
                        y_stride: qkv_w,
                        acc: false,
                        norm,
                    },
                )?;
            }
            let (slots_host, tables) = batch.pool_for(window);
            let step = QkvStep {
                qkv,
                stride: qkv_w,
                biases: layer.biases,
                norms: layer.qk_norms,
                eps,
                cos: cos.ptr,
                sin: sin.ptr,
                q_out: q,
                slots: if sliding {
                    b.sliding_slots.ptr
                } else {
                    b.slots.ptr
                },
                tokens: t,
                heads: (nh, kvh, hd),
                neox: cfg.rope_style == RopeStyle::Neox,
            };
            self.k.qkv(&step, kv, slots_host)?;
            let meta = PagedMeta {
                block_size: batch.block_size,
                block_tables: tables,
                max_blocks: batch.max_blocks,
                token_seq: batch.token_seq,
                token_pos: batch.positions,
                scale: cfg.attention_scale(),
                window,
            };
            match plan {
                Some(p) => {
                    let a = DeviceAttention {
                        q,
                        out: att,
                        tables: if sliding {
                            b.sliding_tables.ptr
                        } else {
                            b.tables.ptr
                        },
                        seqs: b.seqs.ptr,
                        pos: b.pos.ptr,
                        max_blocks: p.max_blocks,
                        partials: (b.part_out.ptr, b.part_max.ptr, b.part_sum.ptr),
                        parts: p.parts,
                        part_len: p.part_len,
                        counters: if self.k.fuses_merge() {
                            b.counters.ptr
                        } else {
                            0
                        },
                    };
                    self.k.attention_on(&a, kv, &meta, (nh, kvh, hd))?;
                }
                None => self.k.attention((q, att), kv, &meta, (nh, kvh, hd))?,
            }
            let (y, acc) = into(layer.post_attn_norm);
            product(
                &layer.o,
                &GemvIo {
                    x: att,
                    y,
                    tokens: t,
                    x_stride: nh * hd,
                    y_stride: hidden,
                    acc,
                    norm: None,
                },
            )?;
            if !acc {
                self.k
                    .residual((x, tmp, layer.post_attn_norm), (t, hidden), eps, rs)?;
            }
            let (input, norm) = self.normed(x, h, layer.ffn_norm, (t, hidden), eps)?;
            match &layer.gate_up[..] {
                // Stacked: the activation in the product's own pass.
                [(w, 0)] if !gemm => self.k.glu(
                    w,
                    &GemvIo {
                        x: input,
                        y: act,
                        tokens: t,
                        x_stride: hidden,
                        y_stride: ffn,
                        acc: false,
                        norm,
                    },
                    act_kind,
                )?,
                parts => {
                    for (w, col) in parts {
                        product(
                            w,
                            &GemvIo {
                                x: input,
                                y: gu + (*col * 4) as u64,
                                tokens: t,
                                x_stride: hidden,
                                y_stride: 2 * ffn,
                                acc: false,
                                norm,
                            },
                        )?;
                    }
                    self.k.act_mul(gu, act, (t, ffn), act_kind)?;
                }
            }
            let (y, acc) = into(layer.post_ffn_norm);
            product(
                &layer.down,
                &GemvIo {
                    x: act,
                    y,
                    tokens: t,
                    x_stride: ffn,
                    y_stride: hidden,
                    acc,
                    norm: None,
                },
            )?;
            if !acc {
                self.k
                    .residual((x, tmp, layer.post_ffn_norm), (t, hidden), eps, rs)?;
            }
        }
        let picks = batch.logits_for.len();
        if picks > 0 {
            self.k.rms_norm(
                (x, b.picks.ptr),
                self.norm,
                b.last.ptr,
                (picks, hidden),
                eps,
            )?;
            self.k.gemv(
                &self.head,
                &GemvIo {
                    x: b.last.ptr,
                    y: b.logits.ptr,
                    tokens: picks,
                    x_stride: hidden,
                    y_stride: self.head.rows,
                    acc: false,
                    norm: None,
                },
            )?;
        }
        Ok(())
    }
}

impl GpuForward {
    /// The input of the products after a pre-norm of weights `w` (0: none)
    /// over `rows` rows of `n` in `x`: `x` itself and the norm for the
    /// products to apply (where they can: [`Forward::fuses_norm`]), or the
    /// norm written to `h` by a kernel of its own.
    fn normed(
        &self,
        x: u64,
        h: u64,
        w: u64,
        (rows, n): (usize, usize),
        eps: f32,
    ) -> Result<(u64, Option<(u64, f32)>)> {
        if w == 0 {
            Ok((x, None))
        } else if self.k.fuses_norm(rows, n, w) {
            Ok((x, Some((w, eps))))
        } else {
            self.k.rms_norm((x, 0), w, h, (rows, n), eps)?;
            Ok((h, None))
        }
    }
}

/// Batches of more tokens than this run their products as GEMMs
/// ([`Forward::gemm`]; only with the tuning's `gpu_prefill`: the executor
/// gives longer batches to the reference forward otherwise).
const GEMV_TOKENS: usize = crate::executor::GPU_FORWARD_TOKENS;

/// Graphs kept at once (a new shape past this many starts over).
const MAX_GRAPHS: usize = 32;

/// How a decode batch's attention is launched: partitions of `part_len`
/// positions, `parts` of them (a power of two: contexts that grow keep the
/// graph until they pass it), over device tables with rows of `max_blocks`
/// (a power of two).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct DecodePlan {
    part_len: usize,
    parts: usize,
    max_blocks: usize,
}

/// A decode batch's plan: `None` unless every token is its own sequence's
/// only one.
fn decode_plan(batch: &Batch, n_heads: usize) -> Option<DecodePlan> {
    let seqs = batch.token_seq;
    let mut seen = std::collections::HashSet::with_capacity(seqs.len());
    if seqs.is_empty() || !seqs.iter().all(|s| seen.insert(*s)) {
        return None;
    }
    let meta = PagedMeta {
        block_size: batch.block_size,
        block_tables: batch.block_tables,
        max_blocks: batch.max_blocks,
        token_seq: batch.token_seq,
        token_pos: batch.positions,
        scale: 1.0,
        window: 0,
    };
    let (part_len, parts) = tessera_kernels::gpu::attention_split(&meta, n_heads);
    Some(DecodePlan {
        part_len,
        parts: parts.next_power_of_two(),
        max_blocks: batch.max_blocks.max(1).next_power_of_two(),
    })
}

/// What a captured step depends on beyond its buffers' contents.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct GraphKey {
    tokens: usize,
    picks: usize,
    sliding: bool,
    plan: DecodePlan,
    /// Each layer's caches.
    caches: Vec<CacheRef>,
}
