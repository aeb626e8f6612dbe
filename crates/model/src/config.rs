//! Model configuration, read from GGUF metadata or a Hugging Face
//! `config.json`, and the RoPE frequencies it implies.

use serde::Deserialize;
use tessera_kernels::RopeStyle;

use crate::{ModelError, Result};

/// The architectures that share one model file: the Llama family and
/// Gemma 3 (its block differs by the switches of [`Block`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Gemma3,
}

impl Arch {
    pub fn parse(name: &str) -> Result<Arch> {
        match name {
            "llama" => Ok(Arch::Llama),
            "mistral" => Ok(Arch::Mistral),
            "qwen2" => Ok(Arch::Qwen2),
            "gemma3" => Ok(Arch::Gemma3),
            other => Err(ModelError::UnsupportedArchitecture(other.to_string())),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Gemma3 => "gemma3",
        }
    }
}

/// The gate activation of the feed-forward block: `act(x·Wg) · (x·Wu)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU (the Llama family).
    Silu,
    /// GELU, tanh approximation (Gemma).
    GeluTanh,
}

/// What a transformer block does beyond the Llama family's: the switches
/// Gemma 3 turns on.
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    pub activation: Activation,
    /// RMSNorm of each query and key head (over `head_dim`) before RoPE.
    pub qk_norm: bool,
    /// RMSNorm of the attention and FFN outputs before the residual adds.
    pub post_norms: bool,
    /// Embeddings multiplied by this (Gemma: `√hidden`).
    pub embed_scale: f32,
    /// Sliding-window attention: a query at `p` sees keys at `j` with
    /// `p − j < sliding_window` on sliding layers; 0 for none.
    pub sliding_window: usize,
    /// Every `swa_pattern`-th layer (the last of each group) is global,
    /// the others slide (llama.cpp's `set_swa_pattern`): Gemma 3's 6.
    pub swa_pattern: usize,
    /// RoPE base of the sliding layers (Gemma 3: 10,000).
    pub rope_theta_swa: f32,
}

impl Block {
    /// The Llama family's block.
    pub fn llama() -> Block {
        Block {
            activation: Activation::Silu,
            qk_norm: false,
            post_norms: false,
            embed_scale: 1.0,
            sliding_window: 0,
            swa_pattern: 0,
            rope_theta_swa: 10_000.0,
        }
    }
}

/// How RoPE frequencies are scaled for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (all frequencies divided by it).
    Linear {
        factor: f32,
    },
    /// Llama 3.1: low frequencies divided by `factor`, high kept, smooth in
    /// between.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_context: usize,
    },
    /// Per-frequency divisors (GGUF `rope_freqs.weight`, written by llama.cpp's
    /// converter for Llama 3.1 and later).
    Factors(Vec<f32>),
}

/// Everything the forward pass needs to know about the shapes.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f64,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    /// Which dimension pairs RoPE rotates. GGUF Llama/Mistral: interleaved
    /// (llama.cpp permuted Q/K at conversion); Hugging Face checkpoints and
    /// GGUF Qwen2: neox. Wrong here means wrong attention at every position.
    pub rope_style: RopeStyle,
    pub context_length: usize,
    pub tie_embeddings: bool,
    /// Qwen2 has biases on the q, k and v projections.
    pub qkv_bias: bool,
    pub block: Block,
}

impl ModelConfig {
    /// The sliding window of layer `l` (`None`: a global layer).
    pub fn layer_window(&self, l: usize) -> Option<usize> {
        let b = &self.block;
        let sliding =
            b.sliding_window > 0 && (b.swa_pattern <= 1 || l % b.swa_pattern < b.swa_pattern - 1);
        sliding.then_some(b.sliding_window)
    }

    /// The widest sliding window of the layers (`None`: every layer is
    /// global).
    pub fn sliding_window(&self) -> Option<usize> {
        (0..self.n_layers)
            .filter_map(|l| self.layer_window(l))
            .max()
    }

    /// Whether some layer has a sliding window.
    pub fn has_sliding_layers(&self) -> bool {
        self.sliding_window().is_some()
    }

    /// Layers with a sliding window.
    pub fn num_sliding_layers(&self) -> usize {
        (0..self.n_layers)
            .filter(|&l| self.layer_window(l).is_some())
            .count()
    }

    /// The inverse frequencies of layer `l`: Gemma 3's sliding layers
    /// use their own base, unscaled (llama.cpp's `rope_freq_base_train_swa`
    /// and `rope_freq_scale_train_swa = 1`); every other layer the file's.
    pub fn layer_inv_freq(&self, l: usize) -> Vec<f32> {
        if self.arch == Arch::Gemma3 && self.layer_window(l).is_some() {
            return ModelConfig {
                rope_theta: self.block.rope_theta_swa,
                rope_scaling: RopeScaling::None,
                ..self.clone()
            }
            .inv_freq();
        }
        self.inv_freq()
    }

    /// Bytes of K and V per token in a cache of type `t`: 2 · layers ·
    /// kv_heads · (bytes of head_dim values: 2·head_dim for f16,
    /// 34·head_dim/32 for q8_0, 18·head_dim/32 for q4_0).
    pub fn kv_bytes_per_token(&self, t: tessera_kernels::KvType) -> usize {
        2 * self.n_layers * self.n_kv_heads * t.bytes_for(self.head_dim)
    }

    /// The `head_dim / 2` RoPE inverse frequencies, scaling applied.
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        let base: Vec<f64> = (0..d / 2)
            .map(|i| 1.0 / (self.rope_theta as f64).powf(2.0 * i as f64 / d as f64))
            .collect();
        let scaled = match &self.rope_scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / *factor as f64).collect(),
            RopeScaling::Factors(div) => base.iter().zip(div).map(|(f, d)| f / *d as f64).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_context,
            } => {
                let (factor, lo, hi) = (
                    *factor as f64,
                    *low_freq_factor as f64,
                    *high_freq_factor as f64,
                );
                let old = *original_context as f64;
                let (low_wavelen, high_wavelen) = (old / lo, old / hi);
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - lo) / (hi - lo);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        };
        scaled.into_iter().map(|f| f as f32).collect()
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(ModelError::Config(m));
        if self.n_layers == 0 || self.n_heads == 0 || self.n_kv_heads == 0 || self.head_dim == 0 {
            return bad(format!("empty geometry {self:?}"));
        }
        // Sizes come from files: bound them before anything is sized by
        // them (far above any real model, far below an allocation failure).
        for (what, v, most) in [
            ("layers", self.n_layers, 1 << 12),
            ("attention heads", self.n_heads, 1 << 12),
            ("KV heads", self.n_kv_heads, 1 << 12),
            ("head dim", self.head_dim, 1 << 12),
            ("hidden size", self.hidden_size, 1 << 18),
            ("FFN size", self.intermediate_size, 1 << 20),
            ("vocabulary", self.vocab_size, 1 << 24),
            ("context length", self.context_length, 1 << 26),
        ] {
            if v > most {
                return bad(format!(
                    "{v} {what} is more than this build supports ({most})"
                ));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "{} heads are not a multiple of {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim {} is odd; RoPE needs pairs",
                self.head_dim
            ));
        }
        if let RopeScaling::Factors(f) = &self.rope_scaling {
            if f.len() * 2 != self.head_dim {
                return bad(format!(
                    "{} RoPE frequency factors for head_dim {}",
                    f.len(),
                    self.head_dim
                ));
            }
        }
        let b = &self.block;
        if b.sliding_window > 1 << 26 || !(b.embed_scale.is_finite() && b.embed_scale > 0.0) {
            return bad(format!("bad block settings {b:?}"));
        }
        Ok(())
    }
}

/// The fields of a Hugging Face `config.json` that the Llama family uses.
#[derive(Debug, Deserialize)]
pub(crate) struct HfConfig {
    #[serde(default)]
    pub model_type: Option<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub rope_scaling: Option<HfRopeScaling>,
    #[serde(default = "default_ctx")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct HfRopeScaling {
    #[serde(alias = "type")]
    pub rope_type: String,
    #[serde(default)]
    pub factor: Option<f32>,
    #[serde(default)]
    pub low_freq_factor: Option<f32>,
    #[serde(default)]
    pub high_freq_factor: Option<f32>,
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f32 {
    10_000.0
}
fn default_ctx() -> usize {
    4096
}

impl HfConfig {
    pub fn into_config(self) -> Result<ModelConfig> {
        let arch = Arch::parse(self.model_type.as_deref().unwrap_or("llama"))?;
        let rope_scaling = match self.rope_scaling {
            None => RopeScaling::None,
            Some(s) => match (s.rope_type.as_str(), s.factor) {
                ("default", _) => RopeScaling::None,
                ("linear", Some(factor)) => RopeScaling::Linear { factor },
                ("llama3", Some(factor)) => RopeScaling::Llama3 {
                    factor,
                    low_freq_factor: s.low_freq_factor.unwrap_or(1.0),
                    high_freq_factor: s.high_freq_factor.unwrap_or(4.0),
                    original_context: s.original_max_position_embeddings.unwrap_or(8192),
                },
                (other, _) => {
                    return Err(ModelError::Config(format!(
                        "unsupported rope_scaling type {other:?}"
                    )))
                }
            },
        };
        let cfg = ModelConfig {
            arch,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            n_layers: self.num_hidden_layers,
            n_heads: self.num_attention_heads,
            n_kv_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim: self.head_dim.unwrap_or(
                self.hidden_size
                    .checked_div(self.num_attention_heads)
                    .unwrap_or(0),
            ),
            rms_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta,
            rope_scaling,
            rope_style: RopeStyle::Neox,
            context_length: self.max_position_embeddings,
            tie_embeddings: self.tie_word_embeddings,
            qkv_bias: self.attention_bias.unwrap_or(arch == Arch::Qwen2),
            block: Block::llama(),
        };
        if arch == Arch::Gemma3 {
            return Err(ModelError::Config(
                "Gemma 3 is supported from GGUF files only".into(),
            ));
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(scaling: RopeScaling) -> ModelConfig {
        ModelConfig {
            arch: Arch::Llama,
            vocab_size: 10,
            hidden_size: 8,
            intermediate_size: 16,
            n_layers: 1,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 4,
            rms_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: scaling,
            rope_style: RopeStyle::Neox,
            context_length: 128,
            tie_embeddings: true,
            qkv_bias: false,
            block: Block::llama(),
        }
    }

    #[test]
    fn rope_frequencies_follow_the_scaling() {
        assert_eq!(cfg(RopeScaling::None).inv_freq(), vec![1.0, 0.01]);
        assert_eq!(
            cfg(RopeScaling::Linear { factor: 2.0 }).inv_freq(),
            vec![0.5, 0.005]
        );
        assert_eq!(
            cfg(RopeScaling::Factors(vec![1.0, 4.0])).inv_freq(),
            vec![1.0, 0.0025]
        );
        // Llama 3: wavelength 2π < 8192/4 keeps f = 1; 2π/0.01 = 628 < 2048 keeps 0.01 too.
        let l3 = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_context: 8192,
        };
        assert_eq!(cfg(l3).inv_freq(), vec![1.0, 0.01]);
        let l3 = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_context: 64,
        };
        // 628 > 64: the low frequency is divided by the factor.
        assert_eq!(cfg(l3).inv_freq(), vec![1.0, 0.00125]);
        assert_eq!(
            cfg(RopeScaling::None).kv_bytes_per_token(tessera_kernels::KvType::F16),
            2 * 4 * 2
        );
    }
}
