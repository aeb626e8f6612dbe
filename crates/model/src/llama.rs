//! The Llama family (Llama 2/3.x, SmolLM2, Mistral, Qwen2/2.5) and Gemma 3
//! in one model file: RMSNorm, GQA attention with RoPE, gated MLP,
//! optional q/k/v biases (Qwen2), tied or separate output head; Gemma 3
//! adds (`config::Block`) scaled embeddings, q/k norms, post-norms, a GELU
//! gate, and sliding-window layers with their own RoPE base.
//!
//! Attention goes through an [`Attention`] backend: [`PagedAttention`]
//! writes each layer's new K/V into the paged cache and reads context
//! through block tables; [`DenseKv`] keeps a plain contiguous f32 cache and
//! exists as the reference the paged path is tested against.

use std::sync::atomic::AtomicUsize;
use std::sync::Mutex;

use candle_core::{DType, Device, Tensor, D};
use tessera_kernels::{paged_attention, write_kv, Activations, KvType, PagedMeta, RopeStyle};

use crate::config::{Activation, ModelConfig};
use crate::loader::{Source, W};
use crate::qlinear::{Proj, QLinear};
use crate::Result;

pub(crate) struct Layer {
    /// The norms before attention and the FFN (none in OLMo 2).
    pub(crate) attn_norm: Option<Tensor>,
    /// q, k and v (stacked into one weight on a GPU).
    pub(crate) qkv: Proj<3>,
    pub(crate) q_bias: Option<Tensor>,
    pub(crate) k_bias: Option<Tensor>,
    pub(crate) v_bias: Option<Tensor>,
    pub(crate) o: QLinear,
    pub(crate) ffn_norm: Option<Tensor>,
    /// The gate and up projections (stacked on a GPU).
    pub(crate) gate_up: Proj<2>,
    pub(crate) down: QLinear,
    /// Gemma 3's, Qwen3's and OLMo 2's norms (`Block::qk_norm`,
    /// `Block::post_norms`): per head, or (OLMo 2) over all heads.
    pub(crate) q_norm: Option<Tensor>,
    pub(crate) k_norm: Option<Tensor>,
    pub(crate) post_attn_norm: Option<Tensor>,
    pub(crate) post_ffn_norm: Option<Tensor>,
}

impl Layer {
    /// q, k, v, o, gate, up and down, each on its own: what the CPU fast
    /// path reads (there the projections are never stacked).
    pub(crate) fn linears(&self) -> Option<[&QLinear; 7]> {
        let ([q, k, v], [gate, up]) = (self.qkv.split()?, self.gate_up.split()?);
        Some([q, k, v, &self.o, gate, up, &self.down])
    }
}

/// The weights of a loaded model.
pub struct Llama {
    pub(crate) cfg: ModelConfig,
    /// The embedding table, read a row at a time.
    pub(crate) embed: QLinear,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: Tensor,
    pub(crate) lm_head: QLinear,
    /// The distinct RoPE frequency sets and each layer's.
    pub(crate) inv_freqs: Vec<Vec<f32>>,
    pub(crate) layer_rope: Vec<usize>,
    pub(crate) device: Device,
    /// The device's forward ([`crate::executor`]; built by `prepare` or
    /// on first use), or why none runs this model.
    pub(crate) exec: Mutex<crate::executor::Slot>,
    /// Floats of partial attention states one forward keeps at once.
    pub(crate) attention_budget: AtomicUsize,
    activations: Mutex<Activations>,
}

/// Default of [`Llama::set_attention_budget`]: 32 MiB of states.
const ATTENTION_BUDGET: usize = 8 << 20;

fn bad_split(what: &str) -> crate::ModelError {
    crate::ModelError::Config(format!(
        "the fused {what} tensor did not split in its parts"
    ))
}

/// The q or k rows of `heads` heads in the forward's head order (each
/// head's rows reordered by [`ModelConfig::head_order`]), or `None` when
/// that order is the file's.
fn head_rows(cfg: &ModelConfig, heads: usize) -> Option<Vec<usize>> {
    let order = cfg.head_order()?;
    let d = cfg.head_dim;
    Some(
        (0..heads)
            .flat_map(|h| order.iter().map(move |&j| h * d + j))
            .collect(),
    )
}

/// The distinct RoPE frequency sets of `cfg`'s layers, and each layer's.
fn frequencies(cfg: &ModelConfig) -> (Vec<Vec<f32>>, Vec<usize>) {
    let (mut inv_freqs, mut layer_rope) = (Vec::<Vec<f32>>::new(), Vec::new());
    for l in 0..cfg.n_layers {
        let f = cfg.layer_inv_freq(l);
        let i = match inv_freqs.iter().position(|g| *g == f) {
            Some(i) => i,
            None => {
                inv_freqs.push(f);
                inv_freqs.len() - 1
            }
        };
        layer_rope.push(i);
    }
    if inv_freqs.is_empty() {
        inv_freqs.push(cfg.inv_freq());
    }
    (inv_freqs, layer_rope)
}

/// `cos`/`sin` of each position's RoPE angles, `[positions, inv_freq]`,
/// each times `scale` where the frequency is not 0 (LongRoPE's attention
/// factor, on the rotated pairs only, as llama.cpp and Hugging Face scale
/// cos and sin; a pair of frequency 0 stays exactly as it is).
pub(crate) fn rope_angles(
    inv_freq: &[f32],
    scale: f32,
    positions: &[u32],
    cos: &mut [f32],
    sin: &mut [f32],
) {
    let half = inv_freq.len();
    for (i, &p) in positions.iter().enumerate() {
        for (j, &f) in inv_freq.iter().enumerate() {
            let a = p as f32 * f;
            let m = if f == 0.0 { 1.0 } else { scale };
            cos[i * half + j] = a.cos() * m;
            sin[i * half + j] = a.sin() * m;
        }
    }
}

/// The paged K and V cache tensors of one layer:
/// `[num_blocks, block_size, n_kv_heads, head_dim]` each.
#[derive(Debug, Clone)]
pub struct LayerKv {
    pub k: Tensor,
    pub v: Tensor,
}

/// One forward step over several sequences. Ids are plain integers.
#[derive(Debug, Clone, Copy)]
pub struct Batch<'a> {
    /// New tokens of all sequences, concatenated.
    pub tokens: &'a [u32],
    /// Position of each new token in its sequence (its row in the block
    /// table; attention is causal by it).
    pub positions: &'a [u32],
    /// The RoPE position of each new token where it is not `positions`
    /// (SelfExtend's position map); `None`: `positions`.
    pub rope_positions: Option<&'a [u32]>,
    /// Cache slot receiving each new token's K/V.
    pub slots: &'a [u32],
    /// Sequence index of each new token (row of `block_tables`).
    pub token_seq: &'a [u32],
    /// Row-major `[num_seqs, max_blocks]` block tables.
    pub block_tables: &'a [u32],
    pub max_blocks: usize,
    pub block_size: usize,
    /// Indices into `tokens` whose logits are wanted.
    pub logits_for: &'a [u32],
    /// Slots and tables of the sliding-window layers' own pool (Gemma 3's
    /// local layers); `None`: they use `slots` and `block_tables` too.
    pub sliding: Option<SlidingBatch<'a>>,
}

/// A batch's place in the sliding-window layers' pool: one slot per token,
/// and `[num_seqs, max_blocks]` tables whose entries before a token's
/// window may be [`NO_BLOCK`] (never read).
#[derive(Debug, Clone, Copy)]
pub struct SlidingBatch<'a> {
    pub slots: &'a [u32],
    pub block_tables: &'a [u32],
}

/// A block-table entry that holds nothing (sliding layers, before the
/// window).
pub const NO_BLOCK: u32 = u32::MAX;

impl<'a> Batch<'a> {
    /// The positions RoPE rotates each new token's Q and K by.
    pub fn rope(&self) -> &'a [u32] {
        self.rope_positions.unwrap_or(self.positions)
    }

    /// The slots and block tables that layers with `window` read and write.
    pub fn pool_for(&self, window: usize) -> (&'a [u32], &'a [u32]) {
        match (window, self.sliding) {
            (w, Some(s)) if w > 0 => (s.slots, s.block_tables),
            _ => (self.slots, self.block_tables),
        }
    }
}

/// Stores one layer's new K/V and returns the attention output.
pub trait Attention {
    /// `q`: `[T, n_heads, head_dim]`, `k`, `v`: `[T, n_kv_heads, head_dim]`,
    /// RoPE applied; returns `[T, n_heads, head_dim]`.
    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor>;
}

/// Attention over the paged cache.
pub struct PagedAttention<'a> {
    pub cache: &'a [LayerKv],
    pub batch: &'a Batch<'a>,
    pub scale: f32,
    /// Each layer's sliding window (0: none).
    pub windows: &'a [usize],
}

impl Attention for PagedAttention<'_> {
    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let c = &self.cache[layer];
        let window = self.windows.get(layer).copied().unwrap_or(0);
        let (slots, block_tables) = self.batch.pool_for(window);
        write_kv(&c.k, k, slots)?;
        write_kv(&c.v, v, slots)?;
        let meta = PagedMeta {
            block_size: self.batch.block_size,
            block_tables,
            max_blocks: self.batch.max_blocks,
            token_seq: self.batch.token_seq,
            token_pos: self.batch.positions,
            scale: self.scale,
            window,
        };
        Ok(paged_attention(q, &c.k, &c.v, &meta)?)
    }
}

/// A plain contiguous f32 cache for one sequence: the reference path.
#[derive(Debug, Default, Clone)]
pub struct DenseKv {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
}

impl DenseKv {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

struct DenseAttention<'a> {
    kv: &'a mut DenseKv,
    start: usize,
    n_rep: usize,
    scale: f64,
    windows: &'a [usize],
}

impl Attention for DenseAttention<'_> {
    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        if self.kv.layers.len() <= layer {
            self.kv.layers.resize(layer + 1, None);
        }
        let (k, v) = match self.kv.layers[layer].take() {
            None => (k.clone(), v.clone()),
            Some((pk, pv)) => (Tensor::cat(&[&pk, k], 0)?, Tensor::cat(&[&pv, v], 0)?),
        };
        self.kv.layers[layer] = Some((k.clone(), v.clone()));
        let t = q.dim(0)?;
        let total = k.dim(0)?;
        // [heads, T, hd] x [heads, hd, total]
        let q = q.transpose(0, 1)?.contiguous()?;
        let repeat = |x: &Tensor| -> Result<Tensor> {
            let (n, kvh, hd) = x.dims3()?;
            Ok(x.unsqueeze(2)?
                .expand((n, kvh, self.n_rep, hd))?
                .reshape((n, kvh * self.n_rep, hd))?
                .transpose(0, 1)?
                .contiguous()?)
        };
        let (k, v) = (repeat(&k)?, repeat(&v)?);
        let scores = (q.matmul(&k.t()?)? * self.scale)?;
        let start = self.start;
        let window = self.windows.get(layer).copied().unwrap_or(0);
        let mask: Vec<f32> = (0..t)
            .flat_map(|i| {
                (0..total).map(move |j| {
                    if j > start + i || j < tessera_kernels::window_start(start + i, window) {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, total), q.device())?;
        let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
        Ok(probs.matmul(&v)?.transpose(0, 1)?.contiguous()?)
    }
}

fn add_bias(y: Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    Ok(match bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    })
}

impl Llama {
    /// Loads every weight from `src`. The one place that knows the layer
    /// structure, for GGUF and safetensors alike.
    pub(crate) fn build(
        src: &mut Source,
        cfg: ModelConfig,
        device: &Device,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Llama> {
        let total = cfg.n_layers + 2;
        // Embedding rows are looked up on the host whatever the device.
        let embed = src.embedding(&Device::Cpu)?;
        progress(1, total);
        let mut layers = Vec::with_capacity(cfg.n_layers);
        let (q_rows, kv_rows) = (cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim);
        // A partial rotation: q and k rows (and their biases and norms) in
        // the forward's head order (`ModelConfig::head_order`), the same
        // for every layer; Phi-3's fused q|k|v rows so too, v's as they are.
        let head_order = cfg.head_order();
        let q_order = head_rows(&cfg, cfg.n_heads);
        let k_order = head_rows(&cfg, cfg.n_kv_heads);
        let qkv_order = q_order.as_ref().zip(k_order.as_ref()).map(|(q, k)| {
            let v = q_rows + kv_rows..q_rows + 2 * kv_rows;
            let k = k.iter().map(|&i| q_rows + i);
            q.iter().copied().chain(k).chain(v).collect::<Vec<_>>()
        });
        for l in 0..cfg.n_layers {
            let maybe = |src: &mut Source, on: bool, w: W| -> Result<Option<Tensor>> {
                Ok(if on {
                    Some(src.vector(w, device)?)
                } else {
                    None
                })
            };
            let bias = |src: &mut Source, w: W| maybe(src, cfg.qkv_bias, w);
            let (qk, post, pre) = (cfg.block.qk_norm, cfg.block.post_norms, cfg.block.pre_norms);
            // Phi-3 stores q/k/v, and gate/up, as one tensor each: split
            // by rows here, so the forward sees the same projections.
            let [q, k, v] = if src.has(W::Qkv(l)) {
                let parts = src.matmul_parts(
                    W::Qkv(l),
                    qkv_order.as_deref(),
                    &[q_rows, kv_rows, kv_rows],
                    device,
                )?;
                <[QLinear; 3]>::try_from(parts).map_err(|_| bad_split("attn_qkv"))?
            } else {
                let mut one = |w: W, order: &Option<Vec<usize>>, rows: usize| -> Result<QLinear> {
                    match order {
                        None => src.matmul(w, device),
                        Some(o) => Ok(src.matmul_parts(w, Some(o), &[rows], device)?.remove(0)),
                    }
                };
                [
                    one(W::Q(l), &q_order, q_rows)?,
                    one(W::K(l), &k_order, kv_rows)?,
                    src.matmul(W::V(l), device)?,
                ]
            };
            // Biases and norms of q or k in the same order: a per-head
            // norm has one head's weights, the rest cover every head.
            let along = |t: Option<Tensor>, order: &Option<Vec<usize>>| -> Result<Option<Tensor>> {
                Ok(match (t, order) {
                    (Some(t), Some(o)) => {
                        let o = if t.elem_count() == cfg.head_dim {
                            head_order.as_deref()
                        } else {
                            Some(&o[..])
                        };
                        Some(crate::loader::reorder_rows(t, o)?)
                    }
                    (t, _) => t,
                })
            };
            let ffn = cfg.intermediate_size;
            let [gate, up] = if !src.has(W::Gate(l)) && src.has(W::GateUp(l)) {
                let parts = src.matmul_split(W::GateUp(l), &[ffn, ffn], device)?;
                <[QLinear; 2]>::try_from(parts).map_err(|_| bad_split("gate/up"))?
            } else {
                [
                    src.matmul(W::Gate(l), device)?,
                    src.matmul(W::Up(l), device)?,
                ]
            };
            layers.push(Layer {
                attn_norm: maybe(src, pre, W::AttnNorm(l))?,
                qkv: Proj::new([q, k, v])?,
                q_bias: along(bias(src, W::QBias(l))?, &q_order)?,
                k_bias: along(bias(src, W::KBias(l))?, &k_order)?,
                v_bias: bias(src, W::VBias(l))?,
                o: src.matmul(W::O(l), device)?,
                ffn_norm: maybe(src, pre, W::FfnNorm(l))?,
                gate_up: Proj::new([gate, up])?,
                down: src.matmul(W::Down(l), device)?,
                q_norm: along(maybe(src, qk, W::QNorm(l))?, &q_order)?,
                k_norm: along(maybe(src, qk, W::KNorm(l))?, &k_order)?,
                post_attn_norm: maybe(src, post, W::PostAttnNorm(l))?,
                post_ffn_norm: maybe(src, post, W::PostFfnNorm(l))?,
            });
            progress(l + 2, total);
        }
        let norm = src.vector(W::OutNorm, device)?;
        let lm_head = if src.has(W::Output) {
            src.matmul(W::Output, device)?
        } else if device.is_cpu() {
            embed.clone()
        } else {
            // Tied: the embedding table again, on the device.
            src.matmul(W::Embed, device)?
        };
        progress(total, total);
        let (inv_freqs, layer_rope) = frequencies(&cfg);
        Ok(Llama {
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            inv_freqs,
            layer_rope,
            device: device.clone(),
            exec: Mutex::new(None),
            attention_budget: AtomicUsize::new(ATTENTION_BUDGET),
            activations: Mutex::new(Activations::tuned()),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The longest context a sequence will reach (the engine's context
    /// length): what Phi-3's LongRoPE chooses its factors by, as llama.cpp
    /// does by its context size. Rebuilds the frequencies and the device's
    /// forward; call it before the first forward and with an empty cache
    /// (keys cached under the other factors would be rotated differently).
    pub fn set_context_length(&mut self, ctx: usize) -> Result<()> {
        if ctx == self.cfg.context_length {
            return Ok(());
        }
        let cfg = ModelConfig {
            context_length: ctx,
            ..self.cfg.clone()
        };
        cfg.validate()?;
        (self.inv_freqs, self.layer_rope) = frequencies(&cfg);
        self.cfg = cfg;
        *self.exec.get_mut().unwrap_or_else(|e| e.into_inner()) = None;
        Ok(())
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Layer `l`'s RoPE inverse frequencies (scaling applied), for K-shift
    /// rotations.
    pub fn inv_freq(&self, l: usize) -> &[f32] {
        &self.inv_freqs[self.layer_rope.get(l).copied().unwrap_or(0)]
    }

    /// Each layer's sliding window (0: a global layer).
    pub fn windows(&self) -> Vec<usize> {
        (0..self.cfg.n_layers)
            .map(|l| self.cfg.layer_window(l).unwrap_or(0))
            .collect()
    }

    /// Embeddings of `tokens` (scaled as the architecture asks):
    /// `tokens.len() · hidden` values into `out`.
    pub(crate) fn embed_into(&self, tokens: &[u32], out: &mut [f32]) -> Result<()> {
        self.embed.rows(tokens, out)?;
        let s = self.cfg.block.embed_scale;
        if s != 1.0 {
            out[..tokens.len() * self.cfg.hidden_size]
                .iter_mut()
                .for_each(|x| *x *= s);
        }
        Ok(())
    }

    /// Allocates a zeroed paged cache of `num_blocks` blocks per layer.
    pub fn new_cache(
        &self,
        num_blocks: usize,
        block_size: usize,
        dtype: KvType,
    ) -> Result<Vec<LayerKv>> {
        self.new_split_cache(num_blocks, None, block_size, dtype)
    }

    /// [`new_cache`](Self::new_cache) with `sliding_blocks` blocks (when
    /// given) for the sliding-window layers, which then read and write
    /// [`Batch::sliding`].
    pub fn new_split_cache(
        &self,
        num_blocks: usize,
        sliding_blocks: Option<usize>,
        block_size: usize,
        dtype: KvType,
    ) -> Result<Vec<LayerKv>> {
        let t = dtype;
        (0..self.cfg.n_layers)
            .map(|l| {
                let blocks = match (self.cfg.layer_window(l), sliding_blocks) {
                    (Some(_), Some(n)) => n,
                    _ => num_blocks,
                };
                let (kvh, hd) = (self.cfg.n_kv_heads, self.cfg.head_dim);
                Ok(LayerKv {
                    k: t.zeros(blocks, block_size, kvh, hd, &self.device)?,
                    v: t.zeros(blocks, block_size, kvh, hd, &self.device)?,
                })
            })
            .collect()
    }

    fn scale(&self) -> f32 {
        self.cfg.attention_scale()
    }

    /// Logits `[logits_for.len(), vocab]` (f32) for a batch over the paged
    /// cache; writes the batch's K/V into its slots. The device's executor
    /// runs it where it takes it ([`crate::executor`]: on the CPU with as
    /// many workers as rayon has threads, every batch); otherwise the
    /// candle reference.
    pub fn forward(&self, batch: &Batch, cache: &[LayerKv]) -> Result<Tensor> {
        self.forward_threads(batch, cache, rayon::current_num_threads())
    }

    /// [`Llama::forward`] with `threads` workers on the CPU (the results
    /// are the same bits for any number).
    pub fn forward_threads(
        &self,
        batch: &Batch,
        cache: &[LayerKv],
        threads: usize,
    ) -> Result<Tensor> {
        let mut slot = self.executor_slot(threads)?;
        if let Some(Ok(exec)) = slot.as_mut() {
            if let Some(logits) = exec.forward(self, batch, cache)? {
                return Ok(logits);
            }
        }
        drop(slot);
        self.forward_reference(batch, cache)
    }

    /// Whether the CUDA forward runs this model (`Err`: why not); `None`
    /// before it was built.
    #[cfg(feature = "cuda")]
    pub fn cuda_forward_status(&self) -> Option<std::result::Result<(), String>> {
        if !self.device.is_cuda() {
            return None;
        }
        let slot = self.exec.lock().unwrap_or_else(|e| e.into_inner());
        slot.as_ref()
            .map(|g| g.as_ref().map(|_| ()).map_err(|e| e.clone()))
    }

    /// Builds the device's executor before the first call (on the CPU: the
    /// step pool, and the weights repacked for the integer path; on CUDA
    /// its weights and buffers), so that the first request does not wait
    /// for it.
    pub fn prepare(&self) -> Result<()> {
        drop(self.executor_slot(rayon::current_num_threads())?);
        Ok(())
    }

    /// How the fast path's quantized linear layers meet their inputs:
    /// two int8 levels per block (the default, or `TESSERA_ACTIVATIONS`),
    /// f32, or one int8 level (see `tessera_kernels::Activations`).
    pub fn set_activations(&self, acts: Activations) {
        *self.activations.lock().unwrap_or_else(|e| e.into_inner()) = acts;
    }

    pub fn activations(&self) -> Activations {
        *self.activations.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many floats of partial attention states the fast path keeps at
    /// once (default 32 MiB): a batch whose queries need more runs its
    /// attention in groups of tokens, with the same results.
    pub fn set_attention_budget(&self, floats: usize) {
        self.attention_budget
            .store(floats.max(1), std::sync::atomic::Ordering::Relaxed);
    }

    /// The reference forward in candle ops (any device): what the fast
    /// path is tested against.
    pub fn forward_reference(&self, batch: &Batch, cache: &[LayerKv]) -> Result<Tensor> {
        let windows = self.windows();
        let mut attn = PagedAttention {
            cache,
            batch,
            scale: self.scale(),
            windows: &windows,
        };
        let picks = Tensor::new(batch.logits_for, &self.device)?;
        self.run(batch.tokens, batch.rope(), &mut attn, &picks)
    }

    /// Reference forward of one sequence over a dense f32 cache: logits of
    /// the last new token.
    pub fn forward_dense(&self, tokens: &[u32], kv: &mut DenseKv) -> Result<Tensor> {
        let start = kv.len;
        let positions: Vec<u32> = (start..start + tokens.len()).map(|p| p as u32).collect();
        let n_rep = self.cfg.n_heads / self.cfg.n_kv_heads;
        let windows = self.windows();
        let mut attn = DenseAttention {
            kv,
            start,
            n_rep,
            scale: self.scale() as f64,
            windows: &windows,
        };
        let picks = Tensor::new(&[tokens.len() as u32 - 1], &self.device)?;
        let out = self.run(tokens, &positions, &mut attn, &picks)?;
        attn.kv.len += tokens.len();
        Ok(out.squeeze(0)?)
    }

    /// `cos`/`sin` of each token's angles: `[T, 1, head_dim / 2]`.
    fn rope_tables(&self, inv_freq: &[f32], positions: &[u32]) -> Result<(Tensor, Tensor)> {
        let half = inv_freq.len();
        let mut cos = vec![0f32; positions.len() * half];
        let mut sin = vec![0f32; positions.len() * half];
        rope_angles(
            inv_freq,
            self.cfg.rope_scale(),
            positions,
            &mut cos,
            &mut sin,
        );
        let shape = (positions.len(), 1, half);
        Ok((
            Tensor::from_vec(cos, shape, &self.device)?,
            Tensor::from_vec(sin, shape, &self.device)?,
        ))
    }

    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        // [T, H, hd] viewed as [T, H, 1, hd]: every token is its own "batch"
        // with its own cos/sin row, so positions may be arbitrary.
        let (t, h, d) = x.dims3()?;
        let x = x.reshape((t, h, 1, d))?;
        let y = match self.cfg.rope_style {
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&x, cos, sin)?,
            RopeStyle::Neox => candle_nn::rotary_emb::rope(&x, cos, sin)?,
        };
        Ok(y.reshape((t, h, d))?)
    }

    fn run(
        &self,
        tokens: &[u32],
        positions: &[u32],
        attn: &mut dyn Attention,
        picks: &Tensor,
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let t = tokens.len();
        let (nh, kvh, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
        let mut x = vec![0f32; t * cfg.hidden_size];
        self.embed_into(tokens, &mut x)?;
        let mut x = Tensor::from_vec(x, (t, cfg.hidden_size), &self.device)?;
        let tables = self
            .inv_freqs
            .iter()
            .map(|f| self.rope_tables(f, positions))
            .collect::<Result<Vec<_>>>()?;
        let eps = cfg.rms_eps as f32;
        let norm = |x: &Tensor, w: &Option<Tensor>| -> Result<Tensor> {
            Ok(match w {
                Some(w) => candle_nn::ops::rms_norm(&x.contiguous()?, w, eps)?,
                None => x.clone(),
            })
        };
        // A block's output as its residual add takes it: normed where the
        // block has a post-norm, scaled where it has a residual scale.
        let rs = cfg.block.residual_scale;
        let out = |y: &Tensor, w: &Option<Tensor>| -> Result<Tensor> {
            let y = norm(y, w)?;
            Ok(if rs == 1.0 { y } else { (y * rs as f64)? })
        };
        for (l, layer) in self.layers.iter().enumerate() {
            let (cos, sin) = &tables[self.layer_rope[l]];
            let h = norm(&x, &layer.attn_norm)?;
            let [q, k, v] = layer.qkv.forward(&h)?;
            // Biased, then as heads, normed per head or (OLMo 2) over the
            // whole row first, then rotated.
            let heads = |y: Tensor, b: &Option<Tensor>, n: usize, w: &Option<Tensor>| {
                let y = add_bias(y, b.as_ref())?;
                let y = if cfg.block.qk_norm_whole {
                    norm(&y, w)?.reshape((t, n, hd))?
                } else {
                    norm(&y.reshape((t, n, hd))?, w)?
                };
                self.rope(&y, cos, sin)
            };
            let q = heads(q, &layer.q_bias, nh, &layer.q_norm)?;
            let k = heads(k, &layer.k_bias, kvh, &layer.k_norm)?;
            let v = add_bias(v, layer.v_bias.as_ref())?.reshape((t, kvh, hd))?;
            let a = attn.attend(l, &q, &k, &v.contiguous()?)?;
            let o = layer.o.forward(&a.reshape((t, nh * hd))?)?;
            x = (x + out(&o, &layer.post_attn_norm)?)?;
            let h = norm(&x, &layer.ffn_norm)?;
            let [g, u] = layer.gate_up.forward(&h)?;
            let g = match cfg.block.activation {
                Activation::Silu => g.silu()?,
                Activation::GeluTanh => g.gelu()?,
            };
            let d = layer.down.forward(&(g * u)?)?;
            x = (x + out(&d, &layer.post_ffn_norm)?)?;
        }
        if picks.dim(0)? == 0 {
            return Ok(Tensor::zeros(
                (0, cfg.vocab_size),
                DType::F32,
                &self.device,
            )?);
        }
        let x = x.index_select(picks, 0)?;
        let x = candle_nn::ops::rms_norm(&x, &self.norm, eps)?;
        let logits = self.lm_head.forward(&x)?.to_dtype(DType::F32)?;
        Ok(match cfg.block.logit_scale {
            1.0 => logits,
            s => (logits * (1.0 / s) as f64)?,
        })
    }

    /// Argmax of a logits row.
    pub fn argmax(logits: &Tensor) -> Result<u32> {
        Ok(logits.argmax(D::Minus1)?.to_scalar::<u32>()?)
    }
}
