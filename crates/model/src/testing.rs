//! Tiny Llama-family models written on the fly (safetensors, config.json,
//! tokenizer.json) with seeded random weights, so tests run in seconds
//! without downloads. Not for inference quality: for exercising code paths.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::{ModelError, Result};

pub use crate::eval::{paged_greedy, paged_greedy_with, prefill_logits};

/// The LongRoPE of tiny `"phi3+longrope"` files: factors shaped as
/// Phi-3.5's (short near 1, long growing toward the low frequencies).
pub struct TinyLongRope {
    /// The context before extension: tiny tests run on either side of it.
    pub original_context: usize,
    pub attn_factor: f32,
}

pub const TINY_LONGROPE: TinyLongRope = TinyLongRope {
    original_context: 16,
    attn_factor: 1.25,
};

impl TinyLongRope {
    /// The `(short, long)` divisors of `half` frequencies (all 1 when
    /// `neutral`).
    pub fn factors(&self, half: usize, neutral: bool) -> (Vec<f32>, Vec<f32>) {
        let x = |i: usize| i as f32 / half.max(1) as f32;
        if neutral {
            return (vec![1.0; half], vec![1.0; half]);
        }
        (
            (0..half).map(|i| 1.0 + 0.1 * x(i)).collect(),
            (0..half).map(|i| 1.0 + 30.0 * x(i) * x(i)).collect(),
        )
    }
}

/// What to generate.
#[derive(Debug, Clone, Copy)]
pub struct TinySpec {
    /// `"llama"` or `"qwen2"` (q/k/v biases).
    pub arch: &'static str,
    pub seed: u64,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub context: usize,
}

impl Default for TinySpec {
    fn default() -> Self {
        TinySpec {
            arch: "llama",
            seed: 1,
            hidden: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            context: 512,
        }
    }
}

/// GPT-2's byte-to-character map of byte-level BPE.
pub fn byte_chars() -> Vec<char> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).expect("latin-1")
            } else {
                extra += 1;
                char::from_u32(255 + extra).expect("valid")
            }
        })
        .collect()
}

const MERGES: &[(&str, &str)] = &[
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("Ġ", "a"),
    ("e", "r"),
    ("o", "n"),
    ("Ġ", "s"),
    ("r", "e"),
    ("a", "t"),
    ("e", "n"),
    ("Ġ", "w"),
    ("o", "r"),
    ("i", "s"),
    ("Ġ", "c"),
    ("l", "l"),
];

/// The tokenizer of tiny models: 256 byte tokens, a few merges, and the
/// ChatML control tokens. Returns it and its vocabulary size.
pub fn tiny_tokenizer() -> Result<(tokenizers::Tokenizer, usize)> {
    let mut tokens: Vec<String> = byte_chars().into_iter().map(String::from).collect();
    for (a, b) in MERGES {
        tokens.push(format!("{a}{b}"));
    }
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges = MERGES
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    let bpe = tokenizers::models::bpe::BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(
        tokenizers::pre_tokenizers::byte_level::ByteLevel::new(false, false, true),
    ));
    tok.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));
    let specials: Vec<_> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .map(|s| tokenizers::AddedToken::from(*s, true))
        .collect();
    tok.add_special_tokens(specials)
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let n = tok.get_vocab_size(true);
    Ok((tok, n))
}

fn seeded(shape: &[usize], seed: &mut u64, scale: f32) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            ((*seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

/// Writes `config.json`, `model.safetensors`, `tokenizer.json` and
/// `tokenizer_config.json` of a tiny model into `dir`.
pub fn write_tiny_model(dir: &Path, spec: TinySpec) -> Result<()> {
    let io = |source| ModelError::Io {
        path: dir.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    let (tok, vocab) = tiny_tokenizer()?;
    tok.save(dir.join("tokenizer.json"), false)
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let head_dim = spec.hidden / spec.heads;
    let inter = spec.hidden * 2;
    let config = serde_json::json!({
        "model_type": spec.arch,
        "vocab_size": vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": inter,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": spec.context,
        "tie_word_embeddings": true,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).map_err(io)?;
    let tok_cfg = serde_json::json!({ "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": false });
    std::fs::write(dir.join("tokenizer_config.json"), tok_cfg.to_string()).map_err(io)?;
    let mut seed = spec.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut w: HashMap<String, Tensor> = HashMap::new();
    let s = &mut seed;
    w.insert(
        "model.embed_tokens.weight".into(),
        seeded(&[vocab, spec.hidden], s, 1.0)?,
    );
    w.insert(
        "model.norm.weight".into(),
        (seeded(&[spec.hidden], s, 0.1)? + 1.0)?,
    );
    let kv = spec.kv_heads * head_dim;
    let proj_scale = 1.0 / (spec.hidden as f32).sqrt() * 1.7;
    for l in 0..spec.layers {
        let p = |n: &str| format!("model.layers.{l}.{n}");
        w.insert(
            p("input_layernorm.weight"),
            (seeded(&[spec.hidden], s, 0.1)? + 1.0)?,
        );
        w.insert(
            p("post_attention_layernorm.weight"),
            (seeded(&[spec.hidden], s, 0.1)? + 1.0)?,
        );
        w.insert(
            p("self_attn.q_proj.weight"),
            seeded(&[spec.hidden, spec.hidden], s, proj_scale * 2.0)?,
        );
        w.insert(
            p("self_attn.k_proj.weight"),
            seeded(&[kv, spec.hidden], s, proj_scale * 2.0)?,
        );
        w.insert(
            p("self_attn.v_proj.weight"),
            seeded(&[kv, spec.hidden], s, proj_scale)?,
        );
        w.insert(
            p("self_attn.o_proj.weight"),
            seeded(&[spec.hidden, spec.hidden], s, proj_scale)?,
        );
        w.insert(
            p("mlp.gate_proj.weight"),
            seeded(&[inter, spec.hidden], s, proj_scale)?,
        );
        w.insert(
            p("mlp.up_proj.weight"),
            seeded(&[inter, spec.hidden], s, proj_scale)?,
        );
        w.insert(
            p("mlp.down_proj.weight"),
            seeded(&[spec.hidden, inter], s, proj_scale)?,
        );
        if spec.arch == "qwen2" {
            w.insert(p("self_attn.q_proj.bias"), seeded(&[spec.hidden], s, 0.2)?);
            w.insert(p("self_attn.k_proj.bias"), seeded(&[kv], s, 0.2)?);
            w.insert(p("self_attn.v_proj.bias"), seeded(&[kv], s, 0.2)?);
        }
    }
    // Stored in bf16, as most Hugging Face checkpoints are.
    let w: HashMap<String, Tensor> = w
        .into_iter()
        .map(|(k, t)| Ok((k, t.to_dtype(DType::BF16)?)))
        .collect::<Result<_>>()?;
    candle_core::safetensors::save(&w, dir.join("model.safetensors"))?;
    Ok(())
}

/// The sliding window of the tiny Gemma 3 GGUF files (short, so that
/// tests of a few dozen tokens cross it).
pub const TINY_WINDOW: usize = 5;

/// Converts a tiny model written by [`write_tiny_model`] to a GGUF file the
/// way llama.cpp's converter does: Q and K rows permuted from Hugging Face's
/// half-split RoPE layout to adjacent pairs, weights stored as `dtype`, the
/// tokenizer as `tokenizer.ggml.*` metadata. `arch` is written as
/// `general.architecture` (tests use an unsupported one too). For the
/// families llama.cpp runs with NEOX RoPE (Qwen, Gemma) Q and K stay in the
/// half-split layout. `"gemma3"` files get Gemma's q/k norms and
/// post-norms (seeded weights near 1) and a sliding window of
/// [`TINY_WINDOW`]; `"qwen3"` files q/k norms; `"granite"` files its four
/// scales (none of them 1); `"phi3"` files fused `attn_qkv` and a
/// gate-and-up `ffn_up`; `"olmo2"` files no pre-norms, whole-row q/k norms
/// and post-norms; `"smollm3"` needs nothing more (its NoPE layers
/// come with the architecture). `"phi3+longrope"` is a Phi-3 file with
/// LongRoPE (see [`TINY_LONGROPE`]), `"phi3+longrope-neutral"` one whose
/// factors and attention factor are all 1; `+partial` rotates three
/// quarters of each head (Phi-4 mini's share).
pub fn write_tiny_gguf(
    hf_dir: &Path,
    out: &Path,
    dtype: candle_core::quantized::GgmlDType,
    arch: &str,
) -> Result<()> {
    use candle_core::quantized::gguf_file::Value;
    use candle_core::quantized::QTensor;

    let mut flags = arch.split('+');
    let arch = flags.next().unwrap_or(arch);
    let flags: Vec<&str> = flags.collect();
    let longrope = if flags.contains(&"longrope") {
        Some(false)
    } else if flags.contains(&"longrope-neutral") {
        Some(true)
    } else {
        None
    };
    let partial = flags.contains(&"partial");

    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(hf_dir.join("config.json")).map_err(|e| ModelError::Io {
            path: hf_dir.into(),
            source: e,
        })?,
    )
    .map_err(|e| ModelError::Config(e.to_string()))?;
    let get = |k: &str| cfg[k].as_u64().unwrap_or(0) as usize;
    let (hidden, layers, heads, kv_heads) = (
        get("hidden_size"),
        get("num_hidden_layers"),
        get("num_attention_heads"),
        get("num_key_value_heads"),
    );
    let head_dim = hidden / heads;
    // `+partial`: RoPE over three quarters of each head (Phi-4 mini's share).
    let rope_dims = if partial { head_dim * 3 / 4 } else { head_dim };
    let w = candle_core::safetensors::load(hf_dir.join("model.safetensors"), &Device::Cpu)?;
    let permute = |t: &Tensor, n: usize| -> Result<Tensor> {
        let (rows, cols) = t.dims2()?;
        Ok(t.reshape((n, 2, rows / n / 2, cols))?
            .transpose(1, 2)?
            .reshape((rows, cols))?)
    };
    let gemma = arch == "gemma3";
    let neox = crate::Arch::parse(arch)
        .is_ok_and(|a| a.gguf_rope_style() == tessera_kernels::RopeStyle::Neox);
    let permute = |t: &Tensor, n: usize| -> Result<Tensor> {
        if neox {
            Ok(t.clone())
        } else {
            permute(t, n)
        }
    };
    let mut seed = 0x5EED_u64;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut put = |name: String, t: Tensor, quantize: bool| -> Result<()> {
        let t = t.to_dtype(DType::F32)?;
        let q = if quantize {
            QTensor::quantize(&t, dtype)?
        } else {
            QTensor::quantize(&t, candle_core::quantized::GgmlDType::F32)?
        };
        tensors.push((name, q));
        Ok(())
    };
    let hf = |n: &str| {
        w.get(n)
            .cloned()
            .ok_or_else(|| ModelError::Missing(n.to_string()))
    };
    put(
        "token_embd.weight".into(),
        hf("model.embed_tokens.weight")?,
        true,
    )?;
    put("output_norm.weight".into(), hf("model.norm.weight")?, false)?;
    for l in 0..layers {
        let p = |n: &str| format!("model.layers.{l}.{n}");
        let g = |n: &str| format!("blk.{l}.{n}");
        // OLMo 2 has no pre-norms.
        if arch != "olmo2" {
            put(
                g("attn_norm.weight"),
                hf(&p("input_layernorm.weight"))?,
                false,
            )?;
            put(
                g("ffn_norm.weight"),
                hf(&p("post_attention_layernorm.weight"))?,
                false,
            )?;
        }
        let q = permute(&hf(&p("self_attn.q_proj.weight"))?, heads)?;
        let k = permute(&hf(&p("self_attn.k_proj.weight"))?, kv_heads)?;
        let v = hf(&p("self_attn.v_proj.weight"))?;
        let (gate, up) = (
            hf(&p("mlp.gate_proj.weight"))?,
            hf(&p("mlp.up_proj.weight"))?,
        );
        if arch == "phi3" {
            // Phi-3's converter: q/k/v rows in one tensor, gate then up
            // rows in `ffn_up`.
            put(g("attn_qkv.weight"), Tensor::cat(&[q, k, v], 0)?, true)?;
            put(g("ffn_up.weight"), Tensor::cat(&[gate, up], 0)?, true)?;
        } else {
            put(g("attn_q.weight"), q, true)?;
            put(g("attn_k.weight"), k, true)?;
            put(g("attn_v.weight"), v, true)?;
            put(g("ffn_gate.weight"), gate, true)?;
            put(g("ffn_up.weight"), up, true)?;
        }
        put(
            g("attn_output.weight"),
            hf(&p("self_attn.o_proj.weight"))?,
            true,
        )?;
        put(g("ffn_down.weight"), hf(&p("mlp.down_proj.weight"))?, true)?;
        // The families' other norms (seeded weights near 1): Gemma's and
        // Qwen3's per head, OLMo 2's over all heads; Gemma's and OLMo 2's
        // post-norms.
        let (q_norm, k_norm) = match arch {
            "olmo2" => (heads * head_dim, kv_heads * head_dim),
            _ => (head_dim, head_dim),
        };
        let qk = [
            ("attn_q_norm.weight", q_norm),
            ("attn_k_norm.weight", k_norm),
        ];
        let post = [
            ("post_attention_norm.weight", hidden),
            ("post_ffw_norm.weight", hidden),
        ];
        let norms: &[(&str, usize)] = match arch {
            "gemma3" | "olmo2" => &[qk[0], qk[1], post[0], post[1]],
            "qwen3" => &qk,
            _ => &[],
        };
        for &(name, n) in norms {
            put(g(name), (seeded(&[n], &mut seed, 0.3)? + 1.0)?, false)?;
        }
    }
    if let Some(neutral) = longrope {
        let half = rope_dims / 2;
        let (short, long) = TINY_LONGROPE.factors(half, neutral);
        put(
            "rope_factors_short.weight".into(),
            Tensor::new(short, &Device::Cpu)?,
            false,
        )?;
        put(
            "rope_factors_long.weight".into(),
            Tensor::new(long, &Device::Cpu)?,
            false,
        )?;
    }
    let (tok, vocab) = tiny_tokenizer()?;
    let tokens: Vec<Value> = (0..vocab as u32)
        .map(|i| Value::String(tok.id_to_token(i).unwrap_or_default()))
        .collect();
    let types: Vec<Value> = (0..vocab as u32)
        .map(|i| {
            let special = tok
                .get_added_tokens_decoder()
                .get(&i)
                .is_some_and(|t| t.special);
            Value::I32(if special { 3 } else { 1 })
        })
        .collect();
    let merges: Vec<Value> = MERGES
        .iter()
        .map(|(a, b)| Value::String(format!("{a} {b}")))
        .collect();
    let id = |s: &str| Value::U32(tok.token_to_id(s).unwrap_or(0));
    let a = |k: &str| format!("{arch}.{k}");
    let meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (a("block_count"), Value::U32(layers as u32)),
        (
            a("context_length"),
            Value::U32(get("max_position_embeddings") as u32),
        ),
        (a("embedding_length"), Value::U32(hidden as u32)),
        (
            a("feed_forward_length"),
            Value::U32(get("intermediate_size") as u32),
        ),
        (a("attention.head_count"), Value::U32(heads as u32)),
        (a("attention.head_count_kv"), Value::U32(kv_heads as u32)),
        (a("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
        // Gemma's global layers a base of their own (its sliding ones
        // keep 10,000), so that the two RoPE tables differ.
        (
            a("rope.freq_base"),
            Value::F32(if gemma { 1e6 } else { 10000.0 }),
        ),
        (a("rope.dimension_count"), Value::U32(rope_dims as u32)),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("default".into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.merges".into(), Value::Array(merges)),
        ("tokenizer.ggml.bos_token_id".into(), id("<|im_start|>")),
        ("tokenizer.ggml.eos_token_id".into(), id("<|im_end|>")),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
    ];
    let mut meta = meta;
    if arch == "granite" {
        // Granite 3's kind of scales (its 2B: 12, 0.22, 0.0078125, 8).
        for (k, v) in [
            ("embedding_scale", 3.0),
            ("residual_scale", 0.5),
            ("attention.scale", 0.3),
            ("logit_scale", 2.5),
        ] {
            meta.push((a(k), Value::F32(v)));
        }
    }
    if let Some(neutral) = longrope {
        meta.push((
            a("rope.scaling.original_context_length"),
            Value::U32(TINY_LONGROPE.original_context as u32),
        ));
        let f = if neutral {
            1.0
        } else {
            TINY_LONGROPE.attn_factor
        };
        meta.push((a("rope.scaling.attn_factor"), Value::F32(f)));
    }
    if gemma {
        meta.push((
            a("attention.sliding_window"),
            Value::U32(TINY_WINDOW as u32),
        ));
    }
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(out).map_err(|e| ModelError::Io {
        path: out.into(),
        source: e,
    })?;
    candle_core::quantized::gguf_file::write(&mut f, &meta_refs, &tensor_refs)?;
    Ok(())
}

/// One sequence's whole prompt as one batch over `num_blocks` blocks of
/// `block_size` laid out in reverse order (so that no block follows its
/// predecessor in the pool): the positions, slots and block table a
/// [`crate::Batch`] borrows.
pub struct ScatteredPrompt {
    pub num_blocks: usize,
    pub block_size: usize,
    pub table: Vec<u32>,
    pub positions: Vec<u32>,
    pub slots: Vec<u32>,
    pub seq: Vec<u32>,
}

impl ScatteredPrompt {
    pub fn new(tokens: usize, num_blocks: usize, block_size: usize) -> ScatteredPrompt {
        let table: Vec<u32> = (0..num_blocks as u32).rev().collect();
        let positions: Vec<u32> = (0..tokens as u32).collect();
        let bs = block_size as u32;
        let slots = positions
            .iter()
            .map(|&p| table[(p / bs) as usize] * bs + p % bs)
            .collect();
        ScatteredPrompt {
            num_blocks,
            block_size,
            table,
            positions,
            slots,
            seq: vec![0; tokens],
        }
    }

    /// The batch of `tokens` (as many as the prompt was made for), with
    /// the logits of positions `picks`.
    pub fn batch<'a>(&'a self, tokens: &'a [u32], picks: &'a [u32]) -> crate::Batch<'a> {
        crate::Batch {
            tokens,
            positions: &self.positions,
            rope_positions: None,
            slots: &self.slots,
            token_seq: &self.seq,
            block_tables: &self.table,
            max_blocks: self.num_blocks,
            block_size: self.block_size,
            logits_for: picks,
            sliding: None,
        }
    }
}

/// The same through the plain contiguous f32 cache ([`crate::DenseKv`]).
pub fn dense_greedy(
    model: &crate::Llama,
    prompt: &[u32],
    steps: usize,
) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
    let mut kv = crate::DenseKv::default();
    let mut logits = model.forward_dense(prompt, &mut kv)?;
    let (mut out, mut all) = (Vec::new(), Vec::new());
    for i in 0..steps {
        let t = crate::Llama::argmax(&logits)?;
        all.push(logits.to_vec1::<f32>()?);
        out.push(t);
        if i + 1 < steps {
            logits = model.forward_dense(&[t], &mut kv)?;
        }
    }
    Ok((out, all))
}

/// Largest absolute difference between two logit histories.
pub fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Deterministic mutation of valid inputs, for the fuzz tests that run in
/// `just test` (a few hundred cases per target) and `just fuzz` (set
/// `TESSERA_FUZZ_CASES` for long runs): bit flips, random bytes, huge
/// length and count fields, copied chunks, truncations and extensions.
pub struct Mutator {
    state: u64,
}

/// Values that break size arithmetic when a file stores them as a count.
const HUGE: [u64; 7] = [
    u64::MAX,
    u64::MAX / 2,
    u32::MAX as u64,
    i32::MAX as u64,
    1 << 31,
    1 << 40,
    0,
];

impl Mutator {
    pub fn new(seed: u64) -> Mutator {
        Mutator {
            state: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        // xorshift64*
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        self.state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// `data` with one to four mutations, most of them inside its first
    /// `focus` bytes (the header, where sizes live).
    pub fn mutate(&mut self, data: &[u8], focus: usize) -> Vec<u8> {
        let mut d = data.to_vec();
        for _ in 0..1 + self.below(4) {
            let span = focus.min(d.len()).max(1);
            let at = self.below(span);
            match self.below(7) {
                0 | 1 => {
                    if let Some(b) = d.get_mut(at) {
                        *b ^= 1 << self.below(8);
                    }
                }
                2 => {
                    if let Some(b) = d.get_mut(at) {
                        *b = self.next_u64() as u8;
                    }
                }
                3 => {
                    let v = HUGE[self.below(HUGE.len())].to_le_bytes();
                    let w = if self.below(2) == 0 { 4 } else { 8 };
                    let at = at / w * w;
                    for (i, b) in v[..w].iter().enumerate() {
                        if let Some(x) = d.get_mut(at + i) {
                            *x = *b;
                        }
                    }
                }
                4 => d.truncate(self.below(d.len() + 1)),
                5 => {
                    let n = 1 + self.below(64);
                    d.extend((0..n).map(|_| self.next_u64() as u8));
                }
                _ => {
                    let len = 1 + self.below(32);
                    let from = self.below(d.len().max(1));
                    let chunk: Vec<u8> = d.iter().skip(from).take(len).copied().collect();
                    for (i, b) in chunk.into_iter().enumerate() {
                        if let Some(x) = d.get_mut(at + i) {
                            *x = b;
                        }
                    }
                }
            }
        }
        d
    }
}

/// Cases per fuzz target: `TESSERA_FUZZ_CASES`, or `default`.
pub fn fuzz_cases(default: usize) -> usize {
    std::env::var("TESSERA_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

pub use tessera_kernels::testing::alloc_track;

/// Logits of one sequence at one position.
type LogitsAt = std::collections::BTreeMap<(usize, usize), Vec<f32>>;

/// One case of the batch-invariance property on `model`: a few random
/// sequences (some sharing prefixes) of `vocab`-bounded ids, each a prompt
/// and `decode` further tokens. Reference: every sequence alone, its prompt
/// in one forward, then one token per forward, with 1 worker. Then the same
/// tokens again in a random schedule: random chunk sizes, random sets of
/// sequences per forward, a random number of workers (1 or 2) per forward,
/// and, when `share` is set, each sequence reusing the full cache blocks
/// of an earlier sequence's equal prefix instead of computing them (as the
/// prefix cache does). Odd seeds decode in lockstep: four or five
/// sequences, and once every one has computed its prompt, all of them
/// decode one token per forward together (many single-token runs in one
/// batch, as a server decoding several requests has). Every logits row
/// wanted in both must be the same bits. Returns how many rows were
/// compared.
pub fn batch_invariance_case(
    model: &crate::Llama,
    seed: u64,
    vocab: u32,
    share: bool,
    cache_dtype: tessera_kernels::KvType,
) -> Result<usize> {
    let mut rng = Mutator::new(seed);
    let bs = 4usize;
    let decode = 2;
    // Prompts: random suffixes on prefixes of two random roots; in half
    // the cases the second root runs past the first 128-position attention
    // chunk, so that tokens of one chunk and of two meet in a batch.
    let roots: Vec<Vec<u32>> = (0..2)
        .map(|r| {
            let n = if r == 1 && seed % 4 >= 2 {
                120 + rng.below(40)
            } else {
                8 + rng.below(40)
            };
            (0..n).map(|_| rng.below(vocab as usize) as u32).collect()
        })
        .collect();
    let lockstep = seed % 2 == 1;
    let n_seqs = if lockstep {
        4 + rng.below(2)
    } else {
        2 + rng.below(4)
    };
    let mut prompts: Vec<Vec<u32>> = (0..n_seqs)
        .map(|_| {
            let root = &roots[rng.below(2)];
            let mut p = root[..1 + rng.below(root.len())].to_vec();
            p.extend((0..1 + rng.below(12)).map(|_| rng.below(vocab as usize) as u32));
            p
        })
        .collect();
    let max_len = prompts.iter().map(Vec::len).max().unwrap_or(0) + decode;
    let per_seq = max_len.div_ceil(bs) + 1;
    let num_blocks = per_seq * n_seqs;
    let max_blocks = per_seq;

    let run = |cache: &[crate::LayerKv],
               tables: &[Vec<u32>],
               parts: &[(usize, usize, usize)],
               toks: &[Vec<u32>],
               plens: &[usize],
               threads: usize,
               out: &mut LogitsAt|
     -> Result<()> {
        // parts: (sequence, start, end) of positions computed now.
        let (mut tokens, mut positions, mut slots, mut seq_ids, mut want, mut keys) =
            (vec![], vec![], vec![], vec![], vec![], vec![]);
        let mut flat = Vec::new();
        for (row, &(s, a, b)) in parts.iter().enumerate() {
            for p in a..b {
                if p + 1 >= plens[s] {
                    want.push(tokens.len() as u32);
                    keys.push((s, p));
                }
                tokens.push(toks[s][p]);
                positions.push(p as u32);
                slots.push(tables[s][p / bs] * bs as u32 + (p % bs) as u32);
                seq_ids.push(row as u32);
            }
            flat.extend(tables[s].iter().copied());
            flat.extend(std::iter::repeat_n(0, max_blocks - tables[s].len()));
        }
        let batch = crate::Batch {
            tokens: &tokens,
            positions: &positions,
            rope_positions: None,
            slots: &slots,
            token_seq: &seq_ids,
            block_tables: &flat,
            max_blocks,
            block_size: bs,
            logits_for: &want,
            sliding: None,
        };
        let logits = model
            .forward_threads(&batch, cache, threads)?
            .to_vec2::<f32>()?;
        for (k, l) in keys.into_iter().zip(logits) {
            out.insert(k, l);
        }
        Ok(())
    };

    // Reference: alone, whole prompt, then greedy decode.
    let cache = model.new_cache(num_blocks, bs, cache_dtype)?;
    let own: Vec<Vec<u32>> = (0..n_seqs)
        .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
        .collect();
    let plens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let mut want = LogitsAt::new();
    for s in 0..n_seqs {
        let mut done = 0;
        loop {
            let end = prompts[s].len();
            run(
                &cache,
                &own,
                &[(s, done, end)],
                &prompts,
                &plens,
                1,
                &mut want,
            )?;
            if end == plens[s] + decode {
                break;
            }
            let next = crate::Llama::argmax(&Tensor::new(&want[&(s, end - 1)][..], &Device::Cpu)?)?;
            prompts[s].push(next);
            done = end;
        }
    }

    // The random schedule.
    let cache = model.new_cache(num_blocks, bs, cache_dtype)?;
    let mut tables = own.clone();
    let mut start = vec![0usize; n_seqs];
    let mut after: Vec<Option<(usize, usize)>> = vec![None; n_seqs];
    if share {
        for j in 1..n_seqs {
            let i = rng.below(j);
            let common = prompts[i]
                .iter()
                .zip(&prompts[j])
                .take_while(|(a, b)| a == b)
                .count()
                .min(plens[i])
                .min(plens[j] - 1);
            let blocks = common / bs;
            if blocks > 0 {
                let shared: Vec<u32> = tables[i][..blocks].to_vec();
                tables[j][..blocks].copy_from_slice(&shared);
                let need = blocks * bs;
                // Wait for whoever computes those positions: blocks `i`
                // took from another sequence come from that one.
                let mut src = i;
                while let Some((k, _)) = after[src].filter(|_| need <= start[src]) {
                    src = k;
                }
                start[j] = need;
                after[j] = Some((src, need));
            }
        }
    }
    let mut got = LogitsAt::new();
    let mut done = start.clone();
    loop {
        let active: Vec<usize> = (0..n_seqs)
            .filter(|&s| done[s] < prompts[s].len())
            .filter(|&s| after[s].is_none_or(|(i, need)| done[i] >= need))
            .collect();
        if active.is_empty() {
            break;
        }
        // In lockstep, a sequence past its prompt waits for the others'.
        let prefilling = active.iter().any(|&s| done[s] < plens[s]);
        let mut parts = Vec::new();
        for &s in &active {
            let decoding = lockstep && done[s] >= plens[s];
            if decoding && prefilling {
                continue;
            }
            if !decoding && rng.below(3) == 0 && parts.len() + 1 < active.len() {
                continue;
            }
            // (In lockstep a prompt's chunks stop at its end.)
            let end = if lockstep && done[s] < plens[s] {
                plens[s]
            } else {
                prompts[s].len()
            };
            let left = end - done[s];
            let n = if decoding {
                1
            } else {
                1 + rng.below(left.min(9))
            };
            parts.push((s, done[s], done[s] + n));
        }
        if parts.is_empty() {
            let s = active
                .iter()
                .copied()
                .find(|&s| done[s] < plens[s])
                .unwrap_or(active[0]);
            parts.push((s, done[s], done[s] + 1));
        }
        run(
            &cache,
            &tables,
            &parts,
            &prompts,
            &plens,
            1 + rng.below(2),
            &mut got,
        )?;
        for &(s, _, e) in &parts {
            done[s] = e;
        }
    }
    let mut compared = 0;
    for (k, w) in &want {
        let g = got
            .get(k)
            .ok_or_else(|| ModelError::Config(format!("batch invariance: no logits for {k:?}")))?;
        let same = g.len() == w.len() && g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
        if !same {
            return Err(ModelError::Config(format!(
                "batch invariance (seed {seed}): logits of sequence {} at position {} differ by {}",
                k.0,
                k.1,
                max_diff(std::slice::from_ref(g), std::slice::from_ref(w))
            )));
        }
        compared += 1;
    }
    Ok(compared)
}
