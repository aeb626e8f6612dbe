//! Model configuration, read from GGUF metadata or a Hugging Face
//! `config.json`, and the RoPE frequencies it implies.

use serde::Deserialize;
use tessera_kernels::RopeStyle;

use crate::{ModelError, Result};

/// The architectures that share one model file: the Llama family, and
/// the families whose block differs from it only by the switches of
/// [`Block`] (Gemma 3, Qwen3, Granite, SmolLM3, OLMo 2) or by how its
/// weights are stored (Phi-3's fused projections).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Gemma3,
    Qwen3,
    Granite,
    SmolLM3,
    Phi3,
    Olmo2,
}

impl Arch {
    /// Every architecture, in the order error messages list them.
    pub const ALL: [Arch; 9] = [
        Arch::Llama,
        Arch::Mistral,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Gemma3,
        Arch::Granite,
        Arch::SmolLM3,
        Arch::Phi3,
        Arch::Olmo2,
    ];

    /// The architecture of a GGUF `general.architecture` or a Hugging Face
    /// `model_type`.
    pub fn parse(name: &str) -> Result<Arch> {
        Arch::ALL
            .into_iter()
            .find(|a| a.name() == name)
            .ok_or_else(|| ModelError::UnsupportedArchitecture(name.to_string()))
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Gemma3 => "gemma3",
            Arch::Qwen3 => "qwen3",
            Arch::Granite => "granite",
            Arch::SmolLM3 => "smollm3",
            Arch::Phi3 => "phi3",
            Arch::Olmo2 => "olmo2",
        }
    }

    /// Which dimension pairs RoPE rotates in this family's GGUF files
    /// (llama.cpp's `llama_model_rope_type`): adjacent pairs where the
    /// converter permuted Q and K (the Llama lineage: Llama, Mistral,
    /// Granite, SmolLM3), half-split (NEOX) elsewhere.
    pub fn gguf_rope_style(self) -> RopeStyle {
        match self {
            Arch::Llama | Arch::Mistral | Arch::Granite | Arch::SmolLM3 => RopeStyle::Interleaved,
            Arch::Qwen2 | Arch::Qwen3 | Arch::Gemma3 | Arch::Phi3 | Arch::Olmo2 => RopeStyle::Neox,
        }
    }
}

/// What an architecture that llama.cpp runs and Tessera does not would
/// need, for the families people ask about (`None`: not known here).
pub(crate) fn missing_parts(arch: &str) -> Option<&'static str> {
    Some(match arch {
        "gemma2" => "Gemma 2's attention and final logit soft-capping",
        "phi2" => "LayerNorm with biases, a parallel attention/MLP block and partial RoPE",
        "qwen2moe" | "qwen3moe" | "olmoe" | "granitemoe" => {
            "mixture-of-experts feed-forward layers"
        }
        "granitehybrid" | "mamba" | "mamba2" | "jamba" | "falcon-h1" => {
            "state-space (Mamba) layers"
        }
        _ => return None,
    })
}

/// The gate activation of the feed-forward block (computed by the
/// kernels crate's `act_mul`).
pub use tessera_kernels::Activation;

/// What a transformer block does beyond the Llama family's: the switches
/// Gemma 3, Qwen3, Granite, SmolLM3 and OLMo 2 turn on.
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    pub activation: Activation,
    /// RMSNorm of each query and key head (over `head_dim`) before RoPE.
    pub qk_norm: bool,
    /// With `qk_norm`: the norm is over each token's whole query and key
    /// projections (`heads · head_dim` values, OLMo 2) instead of each
    /// head.
    pub qk_norm_whole: bool,
    /// RMSNorm of the residual stream before attention and before the FFN
    /// (every family but OLMo 2, which norms only the outputs).
    pub pre_norms: bool,
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
    /// Every `no_rope_every`-th layer (the last of each group) has no
    /// positional encoding (SmolLM3's NoPE layers: 4); 0 for none.
    pub no_rope_every: usize,
    /// The attention and FFN outputs multiplied by this before their
    /// residual adds (Granite's `residual_scale`).
    pub residual_scale: f32,
    /// The softmax scale of attention scores, where not `1/√head_dim`
    /// (Granite's `attention.scale`).
    pub attention_scale: Option<f32>,
    /// The logits divided by this (Granite's `logit_scale`; applied as a
    /// product with its reciprocal, as llama.cpp does).
    pub logit_scale: f32,
}

impl Block {
    /// The Llama family's block.
    pub fn llama() -> Block {
        Block {
            activation: Activation::Silu,
            qk_norm: false,
            qk_norm_whole: false,
            pre_norms: true,
            post_norms: false,
            embed_scale: 1.0,
            sliding_window: 0,
            swa_pattern: 0,
            rope_theta_swa: 10_000.0,
            no_rope_every: 0,
            residual_scale: 1.0,
            attention_scale: None,
            logit_scale: 1.0,
        }
    }

    /// The switches `arch`'s block has whatever its file says, as
    /// llama.cpp's graph for it computes: what the scales and the sliding
    /// window are comes from the file (GGUF metadata or `config.json`), on
    /// top of this.
    ///
    /// - Gemma 3: a GELU (tanh) gate, q/k head norms, post-norms, five
    ///   sliding layers of every six with base 10,000.
    /// - Qwen3: Qwen2's block without biases, each q and k head RMS-normed
    ///   before RoPE.
    /// - SmolLM3: every fourth layer without RoPE (llama.cpp's
    ///   `n_no_rope_layer_step = 4`).
    /// - OLMo 2: no norm before attention or the FFN; q and k each normed
    ///   whole (every head at once) before RoPE; the attention and FFN
    ///   outputs normed before their residual adds.
    /// - Llama, Mistral, Qwen2, Granite (its scales are the file's) and
    ///   Phi-3 (fused projections, split at load; llama.cpp leaves its
    ///   sliding window off, "Phi SWA is currently disabled", and so does
    ///   Tessera, to compute what it computes): the Llama block.
    pub fn of(arch: Arch) -> Block {
        match arch {
            Arch::Gemma3 => Block {
                activation: Activation::GeluTanh,
                qk_norm: true,
                post_norms: true,
                swa_pattern: 6,
                ..Block::llama()
            },
            Arch::Qwen3 => Block {
                qk_norm: true,
                ..Block::llama()
            },
            Arch::SmolLM3 => Block {
                no_rope_every: 4,
                ..Block::llama()
            },
            Arch::Olmo2 => Block {
                qk_norm: true,
                qk_norm_whole: true,
                pre_norms: false,
                post_norms: true,
                ..Block::llama()
            },
            Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Granite | Arch::Phi3 => {
                Block::llama()
            }
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
    /// Phi-3's LongRoPE (Phi-3 mini 128k, Phi-3.5 mini): per-frequency
    /// divisors, `long` when the context a sequence may reach
    /// ([`ModelConfig::context_length`], which the engine sets) is longer
    /// than `original_context` and `short` otherwise, as llama.cpp chooses
    /// by its context size; and the rotated pairs of queries and keys both
    /// scaled by `attn_factor` (cos and sin times it, as in llama.cpp and
    /// Hugging Face: [`ModelConfig::rope_scale`]).
    LongRope {
        short: Vec<f32>,
        long: Vec<f32>,
        original_context: usize,
        attn_factor: f32,
    },
}

impl std::fmt::Display for RopeScaling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RopeScaling::None => write!(f, "none"),
            RopeScaling::Linear { factor } => write!(f, "linear ×{factor}"),
            RopeScaling::Llama3 {
                factor,
                original_context,
                ..
            } => write!(f, "Llama 3 ×{factor} (original context {original_context})"),
            RopeScaling::Factors(d) => write!(f, "{} per-frequency factors", d.len()),
            RopeScaling::LongRope {
                original_context,
                attn_factor,
                ..
            } => write!(
                f,
                "LongRoPE (original context {original_context}, attention factor {attn_factor})"
            ),
        }
    }
}

impl RopeScaling {
    /// LongRoPE's attention factor when a file does not give it: Hugging
    /// Face's and llama.cpp's converter's `sqrt(1 + ln(s) / ln(original))`
    /// with `s = context / original` (1 when the context is not longer).
    pub fn longrope_attn_factor(context: usize, original_context: usize) -> f32 {
        let s = context as f64 / original_context.max(1) as f64;
        if s <= 1.0 || original_context <= 1 {
            return 1.0;
        }
        (1.0 + s.ln() / (original_context as f64).ln()).sqrt() as f32
    }
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
    /// Dimensions of each head that RoPE rotates (llama.cpp's `n_rot`):
    /// `head_dim`, or fewer (Phi-4 mini: 96 of 128), the rest left as they
    /// are. See [`ModelConfig::head_order`].
    pub rope_dims: usize,
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

    /// Whether layer `l` encodes positions (every layer but SmolLM3's
    /// NoPE layers).
    pub fn layer_has_rope(&self, l: usize) -> bool {
        let n = self.block.no_rope_every;
        n == 0 || !(l + 1).is_multiple_of(n)
    }

    /// The softmax scale of attention scores.
    pub fn attention_scale(&self) -> f32 {
        self.block
            .attention_scale
            .unwrap_or(1.0 / (self.head_dim as f32).sqrt())
    }

    /// What the forward's RoPE multiplies the cos and sin of its rotated
    /// pairs by: LongRoPE's attention factor, else 1. (A pair left alone by
    /// a partial rotation is not scaled, so this is not a scale of the
    /// scores.) A context shift rotates by plain cos and sin: a key keeps
    /// its one factor.
    pub fn rope_scale(&self) -> f32 {
        match &self.rope_scaling {
            RopeScaling::LongRope { attn_factor, .. } => *attn_factor,
            _ => 1.0,
        }
    }

    /// LongRoPE: whether the long factors apply, at this context length.
    pub fn uses_long_factors(&self) -> Option<bool> {
        match &self.rope_scaling {
            RopeScaling::LongRope {
                original_context, ..
            } => Some(self.context_length > *original_context),
            _ => None,
        }
    }

    /// Whether RoPE rotates only part of each head.
    pub fn partial_rope(&self) -> bool {
        self.rope_dims < self.head_dim
    }

    /// The order the forward keeps a head's q and k dimensions in (new
    /// index → the file's), when RoPE rotates only `r = rope_dims` of its
    /// `d = head_dim` dimensions in half-split pairs `(i, i + r/2)`: the
    /// rotated pairs first and the others after, in each half, so that
    /// every pair is `(j, j + d/2)` as in a whole rotation and the pairs
    /// left alone take frequency 0 (cos 1, sin 0: exactly unchanged).
    /// Queries and keys are reordered alike (the q/k rows at load), which
    /// leaves every score `q·k` as it was; values are not. With adjacent
    /// pairs the order is the file's: the rotated pairs already come first.
    pub fn head_order(&self) -> Option<Vec<usize>> {
        if !self.partial_rope() || self.rope_style != RopeStyle::Neox {
            return None;
        }
        let (d, r) = (self.head_dim, self.rope_dims);
        let (hr, hu) = (r / 2, (d - r) / 2);
        let half = |first: usize| (0..hr).map(move |i| first + i);
        let rest = |first: usize| (0..hu).map(move |i| first + i);
        Some(
            half(0)
                .chain(rest(r))
                .chain(half(hr))
                .chain(rest(r + hu))
                .collect(),
        )
    }

    /// The inverse frequencies of layer `l`: Gemma 3's sliding layers
    /// use their own base, unscaled (llama.cpp's `rope_freq_base_train_swa`
    /// and `rope_freq_scale_train_swa = 1`); a layer without positional
    /// encoding all zeros (every angle 0: cos 1 and sin 0 leave each pair
    /// exactly as it is, in the forward and in a K-shift alike); every
    /// other layer the file's.
    pub fn layer_inv_freq(&self, l: usize) -> Vec<f32> {
        if !self.layer_has_rope(l) {
            return vec![0.0; self.head_dim / 2];
        }
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

    /// The `head_dim / 2` RoPE inverse frequencies, scaling applied: the
    /// first `rope_dims / 2` from the base over `rope_dims` (as llama.cpp
    /// computes a partial rotation's), the rest 0 (pairs left as they are).
    pub fn inv_freq(&self) -> Vec<f32> {
        let mut f = self.rotated_inv_freq();
        f.resize(self.head_dim / 2, 0.0);
        f
    }

    /// The inverse frequencies of the `rope_dims / 2` rotated pairs.
    fn rotated_inv_freq(&self) -> Vec<f32> {
        let d = self.rope_dims;
        let base: Vec<f64> = (0..d / 2)
            .map(|i| 1.0 / (self.rope_theta as f64).powf(2.0 * i as f64 / d as f64))
            .collect();
        fn divided(base: &[f64], div: &[f32]) -> Vec<f64> {
            base.iter().zip(div).map(|(f, d)| f / *d as f64).collect()
        }
        let scaled = match &self.rope_scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / *factor as f64).collect(),
            RopeScaling::Factors(div) => divided(&base, div),
            RopeScaling::LongRope { short, long, .. } => {
                let long_ones = self.uses_long_factors() == Some(true);
                divided(&base, if long_ones { long } else { short })
            }
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
        let factors: Vec<&Vec<f32>> = match &self.rope_scaling {
            RopeScaling::Factors(f) => vec![f],
            RopeScaling::LongRope {
                short,
                long,
                attn_factor,
                ..
            } => {
                if !(attn_factor.is_finite() && *attn_factor > 0.0) {
                    return bad(format!("LongRoPE attention factor {attn_factor}"));
                }
                vec![short, long]
            }
            _ => Vec::new(),
        };
        if self.rope_dims == 0
            || self.rope_dims > self.head_dim
            || !self.rope_dims.is_multiple_of(2)
        {
            return bad(format!(
                "RoPE over {} of {} dimensions (an even number, at most head_dim)",
                self.rope_dims, self.head_dim
            ));
        }
        for f in factors {
            if f.len() * 2 != self.rope_dims {
                return bad(format!(
                    "{} RoPE frequency factors for {} rotated dimensions",
                    f.len(),
                    self.rope_dims
                ));
            }
            if let Some(x) = f.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
                return bad(format!("RoPE frequency factor {x} (each must be positive)"));
            }
        }
        let b = &self.block;
        let positive = |x: f32| x.is_finite() && x > 0.0;
        if b.sliding_window > 1 << 26
            || !positive(b.embed_scale)
            || !positive(b.residual_scale)
            || !positive(b.logit_scale)
            || !b.attention_scale.is_none_or(positive)
        {
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
    /// Phi-3's LongRoPE: the context it was trained at before extension.
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
    /// The share of each head that RoPE rotates (Phi-4 mini: 0.75).
    #[serde(default)]
    pub partial_rotary_factor: Option<f32>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: Option<bool>,
    /// Granite's scales.
    #[serde(default)]
    pub embedding_multiplier: Option<f32>,
    #[serde(default)]
    pub residual_multiplier: Option<f32>,
    #[serde(default)]
    pub attention_multiplier: Option<f32>,
    #[serde(default)]
    pub logits_scaling: Option<f32>,
    /// SmolLM3: per layer, 1 where it uses RoPE and 0 where it does not.
    #[serde(default)]
    pub no_rope_layers: Option<Vec<u8>>,
    #[serde(default)]
    pub no_rope_layer_interval: Option<usize>,
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
    /// LongRoPE's divisors and attention factor.
    #[serde(default)]
    pub long_factor: Option<Vec<f32>>,
    #[serde(default)]
    pub short_factor: Option<Vec<f32>>,
    #[serde(default)]
    pub attention_factor: Option<f32>,
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
                ("longrope" | "su", _) => {
                    let original = s
                        .original_max_position_embeddings
                        .or(self.original_max_position_embeddings)
                        .ok_or_else(|| {
                            ModelError::Config(
                                "LongRoPE without original_max_position_embeddings".into(),
                            )
                        })?;
                    let (Some(short), Some(long)) = (s.short_factor, s.long_factor) else {
                        return Err(ModelError::Config(
                            "LongRoPE without short_factor and long_factor".into(),
                        ));
                    };
                    RopeScaling::LongRope {
                        short,
                        long,
                        original_context: original,
                        attn_factor: s.attention_factor.unwrap_or_else(|| {
                            RopeScaling::longrope_attn_factor(
                                self.max_position_embeddings,
                                original,
                            )
                        }),
                    }
                }
                (other, _) => {
                    return Err(ModelError::Config(format!(
                        "unsupported rope_scaling type {other:?}"
                    )))
                }
            },
        };
        let head_dim = self.head_dim.unwrap_or(
            self.hidden_size
                .checked_div(self.num_attention_heads)
                .unwrap_or(0),
        );
        let cfg = ModelConfig {
            arch,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            n_layers: self.num_hidden_layers,
            n_heads: self.num_attention_heads,
            n_kv_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim,
            rms_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta,
            rope_scaling,
            rope_style: RopeStyle::Neox,
            // Phi-4 mini's `partial_rotary_factor` (0.75).
            rope_dims: match self.partial_rotary_factor {
                Some(f) if f > 0.0 && f < 1.0 => (head_dim as f64 * f as f64) as usize,
                _ => head_dim,
            },
            context_length: self.max_position_embeddings,
            tie_embeddings: self.tie_word_embeddings,
            qkv_bias: self.attention_bias.unwrap_or(arch == Arch::Qwen2),
            block: Block {
                embed_scale: self.embedding_multiplier.unwrap_or(1.0),
                residual_scale: self.residual_multiplier.unwrap_or(1.0),
                attention_scale: self.attention_multiplier,
                logit_scale: self.logits_scaling.unwrap_or(1.0),
                no_rope_every: no_rope_every(
                    arch,
                    self.no_rope_layers.as_deref(),
                    self.no_rope_layer_interval,
                    self.num_hidden_layers,
                )?,
                ..Block::of(arch)
            },
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

/// SmolLM3's NoPE layers as a period: `layers` (1 = RoPE, 0 = none) must
/// be the pattern of every `interval`-th layer without RoPE, the only one
/// the forward knows. Without `layers`, a SmolLM3 config has transformers'
/// default, every `interval`-th layer (4 unless given); other families
/// have none.
fn no_rope_every(
    arch: Arch,
    layers: Option<&[u8]>,
    interval: Option<usize>,
    n: usize,
) -> Result<usize> {
    let Some(layers) = layers else {
        return Ok(if arch == Arch::SmolLM3 {
            interval.unwrap_or(4)
        } else {
            0
        });
    };
    if layers.iter().all(|&r| r != 0) {
        return Ok(0);
    }
    let every = interval.unwrap_or(4);
    let regular = layers.len() == n
        && every > 0
        && layers
            .iter()
            .enumerate()
            .all(|(l, &r)| (r == 0) == (l + 1).is_multiple_of(every));
    if !regular {
        return Err(ModelError::Config(format!(
            "no_rope_layers {layers:?} is not every {every}th layer without RoPE, the only NoPE pattern supported"
        )));
    }
    Ok(every)
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
            rope_dims: 4,
            context_length: 128,
            tie_embeddings: true,
            qkv_bias: false,
            block: Block::llama(),
        }
    }

    /// `config.json` switches of the new families: Granite's four
    /// multipliers, SmolLM3's NoPE layers (only the every-n-th pattern),
    /// Qwen3's q/k norms; an architecture Tessera lacks names what it
    /// needs.
    #[test]
    fn hugging_face_configs_set_the_family_switches() {
        let parse = |extra: &str| -> Result<ModelConfig> {
            let json = format!(
                r#"{{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                    "num_hidden_layers": 8, "num_attention_heads": 2{extra}}}"#
            );
            serde_json::from_str::<HfConfig>(&json)
                .map_err(|e| ModelError::Config(e.to_string()))?
                .into_config()
        };
        let g = parse(
            r#", "model_type": "granite", "embedding_multiplier": 12.0,
               "residual_multiplier": 0.22, "attention_multiplier": 0.015625, "logits_scaling": 8.0"#,
        )
        .unwrap();
        assert_eq!(g.arch, Arch::Granite);
        let b = &g.block;
        assert_eq!(
            (
                b.embed_scale,
                b.residual_scale,
                b.attention_scale,
                b.logit_scale
            ),
            (12.0, 0.22, Some(0.015625), 8.0)
        );
        assert_eq!(g.attention_scale(), 0.015625);
        assert_eq!(parse("").unwrap().attention_scale(), 0.5);
        let s = parse(
            r#", "model_type": "smollm3", "no_rope_layer_interval": 4,
               "no_rope_layers": [1, 1, 1, 0, 1, 1, 1, 0]"#,
        )
        .unwrap();
        assert_eq!(s.block.no_rope_every, 4);
        let rope: Vec<bool> = (0..8).map(|l| s.layer_has_rope(l)).collect();
        assert_eq!(rope, [true, true, true, false, true, true, true, false]);
        assert!(s.layer_inv_freq(3).iter().all(|&f| f == 0.0));
        assert_eq!(s.layer_inv_freq(2), s.inv_freq());
        // Without the list, transformers' default: every interval-th layer
        // (4 unless the config gives another).
        let plain = parse(r#", "model_type": "smollm3""#).unwrap();
        assert_eq!(plain.block.no_rope_every, 4);
        assert!(!plain.layer_has_rope(3) && plain.layer_has_rope(4));
        let five = parse(r#", "model_type": "smollm3", "no_rope_layer_interval": 5"#).unwrap();
        assert_eq!(five.block.no_rope_every, 5);
        assert_eq!(
            parse(r#", "model_type": "llama""#)
                .unwrap()
                .block
                .no_rope_every,
            0
        );
        let odd = parse(r#", "model_type": "smollm3", "no_rope_layers": [1, 0, 1, 1, 1, 1, 1, 1]"#);
        assert!(matches!(odd, Err(ModelError::Config(m)) if m.contains("NoPE")));
        let q = parse(r#", "model_type": "qwen3""#).unwrap();
        assert!(q.block.qk_norm && !q.qkv_bias);
        let olmo = parse(r#", "model_type": "olmo2""#).unwrap();
        let b = &olmo.block;
        assert!(b.qk_norm && b.qk_norm_whole && b.post_norms && !b.pre_norms);
        let moe = parse(r#", "model_type": "olmoe""#).unwrap_err().to_string();
        assert!(moe.contains("mixture-of-experts"), "{moe}");
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
