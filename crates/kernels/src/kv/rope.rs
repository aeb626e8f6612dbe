//! RoPE rotations by a position delta, for the context shift.
//!
//! RoPE rotates each pair of a head's dimensions by `position * inv_freq[i]`.
//! Rotations compose, `R(p - d) = R(-d) · R(p)`, so a K cached at position `p`
//! becomes the K of position `p - d` by one more rotation of `-d` — no need
//! to recompute it from the hidden state.

/// Which dimensions form a rotated pair. Set per architecture the way
/// llama.cpp maps it; getting it wrong rotates the wrong pairs and the model
/// produces garbage after a shift (and at every position for the forward).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs `(2i, 2i + 1)`: llama.cpp's "norm" type (GGUF Llama, Mistral,
    /// whose Q/K weights were permuted at conversion).
    Interleaved,
    /// Pairs `(i, i + d/2)`: "neox" type (Hugging Face checkpoints, Qwen2).
    Neox,
}

/// A rotation of cached K by `delta` positions.
#[derive(Debug, Clone, PartialEq)]
pub struct Rotation {
    pub style: RopeStyle,
    /// `head_dim / 2` inverse frequencies, scaling already applied.
    pub inv_freq: Vec<f32>,
    pub delta: i64,
}

impl Rotation {
    /// `(cos, sin)` of `delta * inv_freq[i]`, computed in f64 for accuracy.
    pub(crate) fn cos_sin(&self) -> (Vec<f32>, Vec<f32>) {
        self.inv_freq
            .iter()
            .map(|&f| {
                let a = self.delta as f64 * f as f64;
                (a.cos() as f32, a.sin() as f32)
            })
            .unzip()
    }

    /// Rotates one head vector in place.
    pub(crate) fn apply(&self, x: &mut [f32], cos: &[f32], sin: &[f32]) {
        rotate_pairs(self.style, x, cos, sin)
    }
}

/// Rotates one head vector `x` in place, pair `i` by the angle whose
/// cosine and sine are `cos[i]` and `sin[i]` (candle's `rope_i` / `rope`
/// arithmetic): RoPE in the forward (angles of a position) and in a
/// context shift (angles of a delta) alike.
#[inline]
pub fn rotate_pairs(style: RopeStyle, x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    assert!(
        cos.len() >= half && sin.len() >= half,
        "rotate_pairs: {half} angles needed"
    );
    match style {
        RopeStyle::Interleaved => {
            for i in 0..half {
                let (a, b) = (x[2 * i], x[2 * i + 1]);
                x[2 * i] = a * cos[i] - b * sin[i];
                x[2 * i + 1] = a * sin[i] + b * cos[i];
            }
        }
        RopeStyle::Neox => {
            for i in 0..half {
                let (a, b) = (x[i], x[i + half]);
                x[i] = a * cos[i] - b * sin[i];
                x[i + half] = a * sin[i] + b * cos[i];
            }
        }
    }
}
