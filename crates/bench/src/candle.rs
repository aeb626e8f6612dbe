//! candle's own quantized models (`quantized_llama`, `quantized_gemma3`) as
//! a baseline, timed the way Tessera is (feature `candle-baseline`).

use std::time::Instant;

use anyhow::Result;
use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::{quantized_gemma3, quantized_llama};

/// candle's own model of the file's architecture (`quantized_llama`, or
/// `quantized_gemma3` for Gemma 3), timed the same way.
enum Weights {
    Llama(quantized_llama::ModelWeights),
    Gemma3(quantized_gemma3::ModelWeights),
}

/// While alive on a CUDA device: candle's default quantized kernels
/// (`set_force_dmmv(false)`); dropped, Tessera's exact ones again.
#[cfg(feature = "cuda")]
struct CandleKernels(bool);

#[cfg(feature = "cuda")]
impl CandleKernels {
    fn enter(device: &Device) -> CandleKernels {
        let cuda = device.is_cuda();
        if cuda {
            candle_core::quantized::cuda::set_force_dmmv(false);
        }
        CandleKernels(cuda)
    }
}

#[cfg(feature = "cuda")]
impl Drop for CandleKernels {
    fn drop(&mut self) {
        if self.0 {
            candle_core::quantized::cuda::set_force_dmmv(true);
        }
    }
}

/// candle's own quantized model on `device` (the device Tessera runs on,
/// so a GPU run compares GPU with GPU).
pub struct Candle {
    weights: Weights,
    device: Device,
}

impl Candle {
    pub fn load(path: &std::path::Path, device: &Device) -> Result<Candle> {
        let mut f = std::fs::File::open(path)?;
        let ct = gguf_file::Content::read(&mut f)?;
        let arch = ct
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        let weights = if arch == "gemma3" {
            Weights::Gemma3(quantized_gemma3::ModelWeights::from_gguf(
                ct, &mut f, device,
            )?)
        } else {
            Weights::Llama(quantized_llama::ModelWeights::from_gguf(
                ct, &mut f, device,
            )?)
        };
        Ok(Candle {
            weights,
            device: device.clone(),
        })
    }

    fn forward(&mut self, x: &Tensor, pos: usize) -> Result<Tensor> {
        // candle at its best on CUDA: its default kernels, which quantize
        // the activations to 8 bits (Q8_1). Tessera's loader switched them
        // off process-wide for its own exact products; back on after.
        #[cfg(feature = "cuda")]
        let _default = CandleKernels::enter(&self.device);
        Ok(match &mut self.weights {
            Weights::Llama(m) => m.forward(x, pos)?,
            Weights::Gemma3(m) => m.forward(x, pos)?,
        })
    }

    /// Seconds to run `ids` as one prompt from position 0.
    pub fn prefill(&mut self, ids: &[u32]) -> Result<f64> {
        let t = Instant::now();
        let x = Tensor::new(ids, &self.device)?.unsqueeze(0)?;
        self.forward(&x, 0)?.to_vec2::<f32>()?;
        Ok(t.elapsed().as_secs_f64())
    }

    /// Seconds for `n` greedy decode steps after the prompt `ids`, and the
    /// `n + 1` greedy tokens.
    pub fn decode(&mut self, ids: &[u32], n: usize) -> Result<(f64, Vec<u32>)> {
        let x = Tensor::new(ids, &self.device)?.unsqueeze(0)?;
        let mut logits = self.forward(&x, 0)?;
        let mut tokens = Vec::with_capacity(n + 1);
        let t = Instant::now();
        for i in 0..n {
            let next = logits.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?;
            tokens.push(next);
            let x = Tensor::new(&[next], &self.device)?.unsqueeze(0)?;
            logits = self.forward(&x, ids.len() + i)?;
        }
        let elapsed = t.elapsed().as_secs_f64();
        tokens.push(logits.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?);
        Ok((elapsed, tokens))
    }
}
