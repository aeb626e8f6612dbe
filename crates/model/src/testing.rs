//! Tiny Llama-family models written on the fly (safetensors, config.json,
//! tokenizer.json) with seeded random weights, so tests run in seconds
//! without downloads. Not for inference quality: for exercising code paths.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::{ModelError, Result};

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
        TinySpec { arch: "llama", seed: 1, hidden: 64, layers: 2, heads: 4, kv_heads: 2, context: 512 }
    }
}

/// GPT-2's byte-to-character map of byte-level BPE.
pub fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
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
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s"),
    ("r", "e"), ("a", "t"), ("e", "n"), ("Ġ", "w"), ("o", "r"), ("i", "s"), ("Ġ", "c"), ("l", "l"),
];

/// The tokenizer of tiny models: 256 byte tokens, a few merges, and the
/// ChatML control tokens. Returns it and its vocabulary size.
pub fn tiny_tokenizer() -> Result<(tokenizers::Tokenizer, usize)> {
    let mut tokens: Vec<String> = byte_chars().into_iter().map(String::from).collect();
    for (a, b) in MERGES {
        tokens.push(format!("{a}{b}"));
    }
    let vocab: tokenizers::models::bpe::Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let merges = MERGES.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
    let bpe = tokenizers::models::bpe::BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::byte_level::ByteLevel::new(false, false, true)));
    tok.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));
    let specials: Vec<_> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .map(|s| tokenizers::AddedToken::from(*s, true))
        .collect();
    tok.add_special_tokens(specials).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
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
    let io = |source| ModelError::Io { path: dir.to_path_buf(), source };
    std::fs::create_dir_all(dir).map_err(io)?;
    let (tok, vocab) = tiny_tokenizer()?;
    tok.save(dir.join("tokenizer.json"), false).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
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
    w.insert("model.embed_tokens.weight".into(), seeded(&[vocab, spec.hidden], s, 1.0)?);
    w.insert("model.norm.weight".into(), (seeded(&[spec.hidden], s, 0.1)? + 1.0)?);
    let kv = spec.kv_heads * head_dim;
    let proj_scale = 1.0 / (spec.hidden as f32).sqrt() * 1.7;
    for l in 0..spec.layers {
        let p = |n: &str| format!("model.layers.{l}.{n}");
        w.insert(p("input_layernorm.weight"), (seeded(&[spec.hidden], s, 0.1)? + 1.0)?);
        w.insert(p("post_attention_layernorm.weight"), (seeded(&[spec.hidden], s, 0.1)? + 1.0)?);
        w.insert(p("self_attn.q_proj.weight"), seeded(&[spec.hidden, spec.hidden], s, proj_scale * 2.0)?);
        w.insert(p("self_attn.k_proj.weight"), seeded(&[kv, spec.hidden], s, proj_scale * 2.0)?);
        w.insert(p("self_attn.v_proj.weight"), seeded(&[kv, spec.hidden], s, proj_scale)?);
        w.insert(p("self_attn.o_proj.weight"), seeded(&[spec.hidden, spec.hidden], s, proj_scale)?);
        w.insert(p("mlp.gate_proj.weight"), seeded(&[inter, spec.hidden], s, proj_scale)?);
        w.insert(p("mlp.up_proj.weight"), seeded(&[inter, spec.hidden], s, proj_scale)?);
        w.insert(p("mlp.down_proj.weight"), seeded(&[spec.hidden, inter], s, proj_scale)?);
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
