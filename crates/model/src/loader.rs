//! Where weights come from: a GGUF file (weights stay quantized) or a
//! Hugging Face directory (`config.json` + one or many `*.safetensors`).
//! Both are read through [`Source`], so one `build_layers` serves both.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

use crate::config::{Arch, Block, HfConfig, ModelConfig, RopeScaling};
use crate::qlinear::QLinear;
use crate::{ModelError, Result};

/// A named weight of the Llama family.
#[derive(Debug, Clone, Copy)]
pub(crate) enum W {
    Embed,
    OutNorm,
    Output,
    AttnNorm(usize),
    Q(usize),
    K(usize),
    V(usize),
    QBias(usize),
    KBias(usize),
    VBias(usize),
    O(usize),
    FfnNorm(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
    /// Gemma 3: per-head RMSNorm weights of queries and keys.
    QNorm(usize),
    KNorm(usize),
    /// Gemma 3: RMSNorm of the attention and FFN outputs.
    PostAttnNorm(usize),
    PostFfnNorm(usize),
    /// Phi-3: q, k and v in one tensor (their rows one after another).
    Qkv(usize),
    /// Phi-3: gate and up in one tensor (GGUF: `ffn_up`, twice as tall).
    GateUp(usize),
}

impl W {
    fn gguf(self) -> String {
        match self {
            W::Embed => "token_embd.weight".into(),
            W::OutNorm => "output_norm.weight".into(),
            W::Output => "output.weight".into(),
            W::AttnNorm(l) => format!("blk.{l}.attn_norm.weight"),
            W::Q(l) => format!("blk.{l}.attn_q.weight"),
            W::K(l) => format!("blk.{l}.attn_k.weight"),
            W::V(l) => format!("blk.{l}.attn_v.weight"),
            W::QBias(l) => format!("blk.{l}.attn_q.bias"),
            W::KBias(l) => format!("blk.{l}.attn_k.bias"),
            W::VBias(l) => format!("blk.{l}.attn_v.bias"),
            W::O(l) => format!("blk.{l}.attn_output.weight"),
            W::FfnNorm(l) => format!("blk.{l}.ffn_norm.weight"),
            W::Gate(l) => format!("blk.{l}.ffn_gate.weight"),
            W::Up(l) => format!("blk.{l}.ffn_up.weight"),
            W::Down(l) => format!("blk.{l}.ffn_down.weight"),
            W::QNorm(l) => format!("blk.{l}.attn_q_norm.weight"),
            W::KNorm(l) => format!("blk.{l}.attn_k_norm.weight"),
            W::PostAttnNorm(l) => format!("blk.{l}.post_attention_norm.weight"),
            W::PostFfnNorm(l) => format!("blk.{l}.post_ffw_norm.weight"),
            W::Qkv(l) => format!("blk.{l}.attn_qkv.weight"),
            W::GateUp(l) => format!("blk.{l}.ffn_up.weight"),
        }
    }

    fn hf(self) -> String {
        let p = |l: usize, s: &str| format!("model.layers.{l}.{s}");
        match self {
            W::Embed => "model.embed_tokens.weight".into(),
            W::OutNorm => "model.norm.weight".into(),
            W::Output => "lm_head.weight".into(),
            W::AttnNorm(l) => p(l, "input_layernorm.weight"),
            W::Q(l) => p(l, "self_attn.q_proj.weight"),
            W::K(l) => p(l, "self_attn.k_proj.weight"),
            W::V(l) => p(l, "self_attn.v_proj.weight"),
            W::QBias(l) => p(l, "self_attn.q_proj.bias"),
            W::KBias(l) => p(l, "self_attn.k_proj.bias"),
            W::VBias(l) => p(l, "self_attn.v_proj.bias"),
            W::O(l) => p(l, "self_attn.o_proj.weight"),
            W::FfnNorm(l) => p(l, "post_attention_layernorm.weight"),
            W::Gate(l) => p(l, "mlp.gate_proj.weight"),
            W::Up(l) => p(l, "mlp.up_proj.weight"),
            W::Down(l) => p(l, "mlp.down_proj.weight"),
            W::QNorm(l) => p(l, "self_attn.q_norm.weight"),
            W::KNorm(l) => p(l, "self_attn.k_norm.weight"),
            W::PostAttnNorm(l) => p(l, "post_attention_layernorm.weight"),
            W::PostFfnNorm(l) => p(l, "post_feedforward_layernorm.weight"),
            W::Qkv(l) => p(l, "self_attn.qkv_proj.weight"),
            W::GateUp(l) => p(l, "mlp.gate_up_proj.weight"),
        }
    }
}

/// A tensor type of a file: its name, how many tensors use it, their bytes.
pub type TensorTypeUse = (String, usize, u64);

/// An opened GGUF file: its metadata and a reader for tensor data.
pub struct GgufFile {
    pub path: PathBuf,
    pub content: gguf_file::Content,
    reader: BufReader<File>,
}

impl GgufFile {
    /// Opens and validates a GGUF file: magic, header, metadata, and that
    /// every tensor's data lies inside the file.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let io = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        if !path.exists() {
            return Err(ModelError::NotFound(path.to_path_buf()));
        }
        let mut file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let mut magic = [0u8; 4];
        if len < 4 || file.read_exact(&mut magic).is_err() || &magic != b"GGUF" {
            return Err(ModelError::NotGguf {
                path: path.to_path_buf(),
                magic,
            });
        }
        file.rewind().map_err(io)?;
        let mut reader = BufReader::new(file);
        let corrupt = |reason: String| ModelError::CorruptGguf {
            path: path.to_path_buf(),
            reason,
        };
        let content = gguf_file::Content::read(&mut reader).map_err(|e| {
            let msg = crate::without_backtrace(e).to_string();
            if msg.contains("unknown dtype") {
                ModelError::UnsupportedQuantization {
                    tensor: "(header)".into(),
                    dtype: msg,
                }
            } else {
                corrupt(msg)
            }
        })?;
        // In name order, so that the same file always names the same tensor.
        let mut infos: Vec<_> = content.tensor_infos.iter().collect();
        infos.sort_unstable_by(|a, b| a.0.cmp(b.0));
        for (name, info) in infos {
            let dt = info.ggml_dtype;
            let dims = info.shape.dims();
            // Rows are whole quantization blocks, and nothing is empty (a
            // zero-sized tensor breaks candle's raw-data conversion).
            let row = dims.last().copied().unwrap_or(0);
            if dims.contains(&0) || !row.is_multiple_of(dt.block_size()) {
                return Err(corrupt(format!(
                    "tensor {name} has shape {dims:?}, which {dt:?} (blocks of {}) cannot hold",
                    dt.block_size()
                )));
            }
            let end = info
                .shape
                .dims()
                .iter()
                .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
                .map(|n| n / dt.block_size() as u64)
                .and_then(|blocks| blocks.checked_mul(dt.type_size() as u64))
                .and_then(|b| b.checked_add(info.offset))
                .and_then(|b| b.checked_add(content.tensor_data_offset))
                .unwrap_or(u64::MAX);
            if end > len {
                return Err(corrupt(format!(
                    "tensor {name} needs bytes up to {end} but the file has {len} (truncated?)"
                )));
            }
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            content,
            reader,
        })
    }

    /// A readable summary of the file, whatever its architecture: the
    /// metadata (long arrays shown by their length) in key order, and per
    /// tensor type the number of tensors and their bytes.
    pub fn describe(&self) -> (Vec<(String, String)>, Vec<TensorTypeUse>) {
        use gguf_file::Value as V;
        fn show(v: &V) -> String {
            match v {
                V::String(s) if s.len() > 120 => format!("<text, {} bytes>", s.len()),
                V::String(s) => format!("{s:?}"),
                V::Array(a) if a.len() > 8 => format!("<array of {}>", a.len()),
                V::Array(a) => format!("[{}]", a.iter().map(show).collect::<Vec<_>>().join(", ")),
                V::U8(x) => x.to_string(),
                V::I8(x) => x.to_string(),
                V::U16(x) => x.to_string(),
                V::I16(x) => x.to_string(),
                V::U32(x) => x.to_string(),
                V::I32(x) => x.to_string(),
                V::U64(x) => x.to_string(),
                V::I64(x) => x.to_string(),
                V::F32(x) => x.to_string(),
                V::F64(x) => x.to_string(),
                V::Bool(x) => x.to_string(),
            }
        }
        let mut meta: Vec<(String, String)> = self
            .content
            .metadata
            .iter()
            .map(|(k, v)| (k.clone(), show(v)))
            .collect();
        meta.sort();
        let mut types: std::collections::BTreeMap<String, (usize, u64)> = Default::default();
        for info in self.content.tensor_infos.values() {
            let dt = info.ggml_dtype;
            let n = info.shape.elem_count() as u64;
            let e = types.entry(format!("{dt:?}")).or_default();
            e.0 += 1;
            e.1 += n / dt.block_size() as u64 * dt.type_size() as u64;
        }
        let types = types.into_iter().map(|(k, (n, b))| (k, n, b)).collect();
        (meta, types)
    }

    pub fn meta(&self, key: &str) -> Option<&gguf_file::Value> {
        self.content.metadata.get(key)
    }

    pub fn meta_str(&self, key: &str) -> Result<&str> {
        self.meta(key)
            .and_then(|v| v.to_string().ok())
            .map(|s| s.as_str())
            .ok_or_else(|| ModelError::Missing(format!("GGUF metadata {key}")))
    }

    pub fn meta_u32(&self, key: &str) -> Result<u32> {
        let v = self
            .meta(key)
            .ok_or_else(|| ModelError::Missing(format!("GGUF metadata {key}")))?;
        v.to_u32()
            .or_else(|_| v.to_u64().map(|x| x as u32))
            .or_else(|_| v.to_i32().map(|x| x as u32))
            .map_err(|e| ModelError::Config(format!("{key}: {e}")))
    }

    pub fn meta_f32(&self, key: &str) -> Option<f32> {
        self.meta(key).and_then(|v| v.to_f32().ok())
    }

    /// A small tensor of the file as f32 values (RoPE factors).
    fn f32_vector(&mut self, name: &str) -> Result<Vec<f32>> {
        let t = self.qtensor(name, &Device::Cpu)?.dequantize(&Device::Cpu)?;
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
    }

    pub(crate) fn qtensor(&mut self, name: &str, device: &Device) -> Result<QTensor> {
        self.content
            .tensor(&mut self.reader, name, device)
            .map_err(|e| ModelError::CorruptGguf {
                path: self.path.clone(),
                reason: format!("tensor {name}: {}", crate::without_backtrace(e)),
            })
    }

    /// The model configuration from `{arch}.*` metadata.
    pub fn config(&mut self) -> Result<ModelConfig> {
        let arch_name = self.meta_str("general.architecture")?.to_string();
        let arch = Arch::parse(&arch_name)?;
        let k = |s: &str| format!("{arch_name}.{s}");
        let n_heads = self.meta_u32(&k("attention.head_count"))? as usize;
        let hidden = self.meta_u32(&k("embedding_length"))? as usize;
        let head_dim = self
            .meta_u32(&k("attention.key_length"))
            .map(|v| v as usize)
            .unwrap_or(hidden / n_heads.max(1));
        let vocab_size = match self.meta_u32(&k("vocab_size")) {
            Ok(v) => v as usize,
            Err(_) => self
                .meta("tokenizer.ggml.tokens")
                .and_then(|v| v.to_vec().ok())
                .map(|v| v.len())
                .unwrap_or(0),
        };
        let longrope = ["rope_factors_long.weight", "rope_factors_short.weight"]
            .map(|t| self.content.tensor_infos.contains_key(t));
        let context_length = self
            .meta_u32(&k("context_length"))
            .map(|v| v as usize)
            .unwrap_or(4096);
        let rope_scaling = if self.content.tensor_infos.contains_key("rope_freqs.weight") {
            RopeScaling::Factors(self.f32_vector("rope_freqs.weight")?)
        } else if longrope == [true, true] {
            // Phi-3's LongRoPE, as llama.cpp reads it: the context before
            // extension (default: the file's context) and the factor on
            // queries and keys (default 1).
            RopeScaling::LongRope {
                long: self.f32_vector("rope_factors_long.weight")?,
                short: self.f32_vector("rope_factors_short.weight")?,
                original_context: self
                    .meta_u32(&k("rope.scaling.original_context_length"))
                    .map(|v| v as usize)
                    .unwrap_or(context_length),
                attn_factor: self.meta_f32(&k("rope.scaling.attn_factor")).unwrap_or(1.0),
            }
        } else if longrope.contains(&true) {
            return Err(ModelError::Config(
                "this file has one of LongRoPE's two factor tensors (rope_factors_long, rope_factors_short) but not the other".into(),
            ));
        } else {
            match self
                .meta(&k("rope.scaling.type"))
                .and_then(|v| v.to_string().ok())
                .map(|s| s.as_str())
            {
                Some("linear") => RopeScaling::Linear {
                    factor: self.meta_f32(&k("rope.scaling.factor")).unwrap_or(1.0),
                },
                None | Some("none") => RopeScaling::None,
                Some(other) => {
                    return Err(ModelError::Config(format!(
                        "unsupported RoPE scaling {other:?}"
                    )))
                }
            }
        };
        let rope_dims = self
            .meta_u32(&k("rope.dimension_count"))
            .map(|d| d as usize)
            .unwrap_or(head_dim);
        let cfg = ModelConfig {
            arch,
            vocab_size,
            hidden_size: hidden,
            intermediate_size: self.meta_u32(&k("feed_forward_length"))? as usize,
            n_layers: self.meta_u32(&k("block_count"))? as usize,
            n_heads,
            n_kv_heads: self
                .meta_u32(&k("attention.head_count_kv"))
                .map(|v| v as usize)
                .unwrap_or(n_heads),
            head_dim,
            rms_eps: self
                .meta_f32(&k("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-5) as f64,
            rope_theta: self.meta_f32(&k("rope.freq_base")).unwrap_or(10_000.0),
            rope_scaling,
            rope_style: arch.gguf_rope_style(),
            rope_dims,
            context_length,
            tie_embeddings: !self.content.tensor_infos.contains_key("output.weight"),
            qkv_bias: self.content.tensor_infos.contains_key("blk.0.attn_q.bias"),
            block: match arch {
                // Gemma 3: embeddings scaled by sqrtf(n_embd), the file's
                // sliding window.
                Arch::Gemma3 => Block {
                    embed_scale: (hidden as f32).sqrt(),
                    sliding_window: self.meta_u32(&k("attention.sliding_window"))? as usize,
                    ..Block::of(arch)
                },
                // Granite: embeddings times `embedding_scale`, attention and
                // FFN outputs times `residual_scale` before their adds,
                // scores times `attention.scale`, logits times
                // 1/`logit_scale` (each optional but the last).
                Arch::Granite => Block {
                    embed_scale: self.meta_f32(&k("embedding_scale")).unwrap_or(1.0),
                    residual_scale: self.meta_f32(&k("residual_scale")).unwrap_or(1.0),
                    attention_scale: self.meta_f32(&k("attention.scale")).filter(|&s| s != 0.0),
                    logit_scale: self.meta_f32(&k("logit_scale")).ok_or_else(|| {
                        ModelError::Config(format!("{} is missing", k("logit_scale")))
                    })?,
                    ..Block::of(arch)
                },
                _ => Block::of(arch),
            },
        };
        if arch == Arch::Olmo2
            && self
                .meta_u32(&k("attention.sliding_window"))
                .is_ok_and(|w| w > 0)
        {
            return Err(ModelError::Config(
                "this OLMo file has sliding-window layers (OLMo 3), which Tessera does not run yet"
                    .into(),
            ));
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Weights of a Hugging Face checkpoint directory.
pub struct HfDir {
    pub dir: PathBuf,
    tensors: HashMap<String, Tensor>,
}

impl HfDir {
    /// The tensor `name` as stored.
    fn tensor(&self, name: &str) -> Result<&Tensor> {
        self.tensors
            .get(name)
            .ok_or_else(|| ModelError::Missing(format!("tensor {name}")))
    }

    /// Reads `config.json` and every `*.safetensors` in `dir`.
    pub fn open(dir: &Path) -> Result<(HfDir, ModelConfig)> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| ModelError::Io { path, source }
        };
        let cfg_path = dir.join("config.json");
        if !cfg_path.exists() {
            return Err(ModelError::NotFound(cfg_path));
        }
        let text = std::fs::read_to_string(&cfg_path).map_err(io(&cfg_path))?;
        let hf: HfConfig = serde_json::from_str(&text)
            .map_err(|e| ModelError::Config(format!("{}: {e}", cfg_path.display())))?;
        let cfg = hf.into_config()?;
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(io(dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(ModelError::Missing(format!(
                "*.safetensors files in {}",
                dir.display()
            )));
        }
        let mut tensors = HashMap::new();
        for f in &files {
            let loaded = candle_core::safetensors::load(f, &Device::Cpu)
                .map_err(|e| ModelError::Config(format!("{}: {e}", f.display())))?;
            tensors.extend(loaded);
        }
        Ok((
            HfDir {
                dir: dir.to_path_buf(),
                tensors,
            },
            cfg,
        ))
    }
}

/// A safetensors projection as [`Source::matmul`] keeps it: f32 on the
/// CPU, its f16/bf16 on a GPU (widened to f32 per product).
/// Whether a GGUF projection of `dtype` becomes a dense tensor on
/// `device`: float tensors on a GPU do (candle's GPU kernels take blocks);
/// everything else keeps its blocks, on CUDA with candle's exact kernels
/// switched on ([`exact_cuda_matmul`]).
fn gguf_dense(dtype: GgmlDType, device: &Device) -> bool {
    let float = matches!(dtype, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16);
    if float && !device.is_cpu() {
        return true;
    }
    if device.is_cuda() {
        exact_cuda_matmul();
    }
    false
}

fn dense_linear(t: &Tensor, device: &Device) -> Result<QLinear> {
    let half = matches!(t.dtype(), DType::F16 | DType::BF16);
    let t = if half {
        t.clone()
    } else {
        t.to_dtype(DType::F32)?
    };
    Ok(QLinear::Dense(t.to_device(device)?))
}

/// One of the two weight sources.
pub(crate) enum Source<'a> {
    Gguf(&'a mut GgufFile),
    Hf(&'a HfDir),
}

impl Source<'_> {
    pub fn has(&self, w: W) -> bool {
        match self {
            Source::Gguf(g) => g.content.tensor_infos.contains_key(&w.gguf()),
            Source::Hf(h) => h.tensors.contains_key(&w.hf()),
        }
    }

    fn name(&self, w: W) -> String {
        match self {
            Source::Gguf(_) => w.gguf(),
            Source::Hf(_) => w.hf(),
        }
    }

    /// A weight as f32 on `device`. GGUF weights are dequantized on the
    /// host (candle's exact `to_float`), so a GPU holds the CPU's values.
    pub(crate) fn dense(&mut self, w: W, device: &Device) -> Result<Tensor> {
        let name = self.name(w);
        match self {
            Source::Gguf(g) => Ok(g
                .qtensor(&name, &Device::Cpu)?
                .dequantize(&Device::Cpu)?
                .to_device(device)?),
            Source::Hf(h) => Ok(h.tensor(&name)?.to_dtype(DType::F32)?.to_device(device)?),
        }
    }

    /// A projection weight, kept in its stored format where the forward can
    /// compute it in f32 from there: GGUF blocks stay quantized (on the
    /// CPU, and on a GPU where candle has a kernel that dequantizes them in
    /// f32; float GGUF tensors become dense f32 on a GPU); safetensors
    /// weights are dense and keep their f16/bf16 (f32 otherwise), widened
    /// to f32 per product ([`QLinear::forward`]; on the CPU the fast path
    /// widens them in registers).
    pub fn matmul(&mut self, w: W, device: &Device) -> Result<QLinear> {
        if !self.has(w) {
            return Err(ModelError::Missing(format!("tensor {}", self.name(w))));
        }
        let name = self.name(w);
        match self {
            Source::Gguf(g) => {
                let dtype = g.content.tensor_infos.get(&name).map(|i| i.ggml_dtype);
                if dtype.is_some_and(|d| gguf_dense(d, device)) {
                    return Ok(QLinear::Dense(self.dense(w, device)?));
                }
                Ok(QLinear::Quantized(Arc::new(g.qtensor(&name, device)?)))
            }
            Source::Hf(h) => dense_linear(h.tensor(&name)?, device),
        }
    }

    /// A projection stored with others in one tensor (Phi-3's q/k/v and
    /// gate/up), split by rows into `rows.len()` projections of `rows[i]`
    /// rows each, every one as [`matmul`](Self::matmul) keeps it: a GGUF
    /// tensor's rows are whole blocks one after another, so each part is
    /// its bytes, unchanged.
    pub fn matmul_split(&mut self, w: W, rows: &[usize], device: &Device) -> Result<Vec<QLinear>> {
        self.matmul_parts(w, None, rows, device)
    }

    /// [`Source::matmul_split`] with the rows first put in `order` (row
    /// `i` of the result is the file's row `order[i]`; whole rows of
    /// blocks, so a quantized row keeps its bytes).
    pub fn matmul_parts(
        &mut self,
        w: W,
        order: Option<&[usize]>,
        rows: &[usize],
        device: &Device,
    ) -> Result<Vec<QLinear>> {
        if !self.has(w) {
            return Err(ModelError::Missing(format!("tensor {}", self.name(w))));
        }
        let name = self.name(w);
        let total: usize = rows.iter().sum();
        let bad = |dims: &[usize]| {
            ModelError::Config(format!(
                "tensor {name} has shape {dims:?}: expected {total} rows to split as {rows:?}"
            ))
        };
        match self {
            Source::Gguf(g) => {
                let q = g.qtensor(&name, &Device::Cpu)?;
                let dims = q.shape().dims().to_vec();
                let [n, k] = dims[..] else {
                    return Err(bad(&dims));
                };
                if n != total {
                    return Err(bad(&dims));
                }
                if order.is_some_and(|o| o.len() != n) {
                    return Err(bad(&dims));
                }
                let dtype = q.dtype();
                if gguf_dense(dtype, device) {
                    let t = reorder_rows(q.dequantize(&Device::Cpu)?, order)?;
                    let mut at = 0;
                    return rows
                        .iter()
                        .map(|&r| {
                            let part = t.narrow(0, at, r)?.to_device(device)?;
                            at += r;
                            Ok(QLinear::Dense(part))
                        })
                        .collect();
                }
                let row_bytes = k / dtype.block_size() * dtype.type_size();
                let data = q.data()?;
                let data: std::borrow::Cow<[u8]> = match order {
                    None => data,
                    Some(o) => o
                        .iter()
                        .flat_map(|&r| &data[r * row_bytes..(r + 1) * row_bytes])
                        .copied()
                        .collect::<Vec<u8>>()
                        .into(),
                };
                let mut at = 0;
                rows.iter()
                    .map(|&r| {
                        let bytes = &data[at * row_bytes..(at + r) * row_bytes];
                        at += r;
                        let part = candle_core::quantized::ggml_file::qtensor_from_ggml(
                            dtype,
                            bytes,
                            vec![r, k],
                            device,
                        )?;
                        Ok(QLinear::Quantized(Arc::new(part)))
                    })
                    .collect()
            }
            Source::Hf(h) => {
                let t = h.tensor(&name)?;
                let dims = t.dims().to_vec();
                if dims.len() != 2 || dims[0] != total || order.is_some_and(|o| o.len() != total) {
                    return Err(bad(&dims));
                }
                let t = reorder_rows(t.clone(), order)?;
                let mut at = 0;
                rows.iter()
                    .map(|&r| {
                        let part = t.narrow(0, at, r)?.contiguous()?;
                        at += r;
                        dense_linear(&part, device)
                    })
                    .collect()
            }
        }
    }

    /// A norm weight or bias, as f32.
    pub fn vector(&mut self, w: W, device: &Device) -> Result<Tensor> {
        if !self.has(w) {
            return Err(ModelError::Missing(format!("tensor {}", self.name(w))));
        }
        self.dense(w, device)
    }

    /// The embedding table (looked up a row at a time, never dequantized
    /// whole), which is also the output head when embeddings are tied.
    pub fn embedding(&mut self, device: &Device) -> Result<QLinear> {
        match self {
            Source::Gguf(g) => Ok(QLinear::Quantized(Arc::new(
                g.qtensor(&W::Embed.gguf(), device)?,
            ))),
            Source::Hf(_) => Ok(QLinear::Dense(self.vector(W::Embed, device)?)),
        }
    }
}

/// `t`'s rows (its first dimension) in `order` (`None`: as they are).
pub(crate) fn reorder_rows(t: Tensor, order: Option<&[usize]>) -> Result<Tensor> {
    let Some(order) = order else {
        return Ok(t);
    };
    let ids: Vec<u32> = order.iter().map(|&i| i as u32).collect();
    let ids = Tensor::new(ids, t.device())?;
    Ok(t.index_select(&ids, 0)?.contiguous()?)
}

/// Makes candle's CUDA quantized matrix-vector product dequantize the
/// weights in f32 against the f32 activations (its `dmmv` kernel) instead
/// of first quantizing the activations to 8 bits (Q8_1), which would lose
/// the precision the CPU path keeps. The switch is candle's, process-wide.
fn exact_cuda_matmul() {
    #[cfg(feature = "cuda")]
    candle_core::quantized::cuda::set_force_dmmv(true);
}
