//! tessera-model: Llama-family architectures over the paged KV cache.
//!
//! **What this crate must not know:** the prefix tree, eviction, scheduling.
//! It runs a forward pass over a batch of sequences given their new tokens,
//! positions, slots and block tables (plain integers) and returns logits;
//! it loads weights (GGUF quantized, or safetensors), tokenizers and chat
//! templates.

mod config;
mod device;
mod error;
pub mod eval;
mod executor;
mod fast;
#[cfg(feature = "cuda")]
mod gpu_forward;
mod llama;
mod loader;
mod model;
pub mod phases;
mod qlinear;
mod template;
/// Tiny models written on the fly, a fuzz mutator, an allocation counter
/// and the batch-invariance property: for tests and benches (the
/// `testing` feature), not the product.
#[cfg(any(test, feature = "testing"))]
pub mod testing;
#[cfg(test)]
mod tests;
mod tokenizer;

pub use config::{Activation, Arch, Block, ModelConfig, RopeScaling};
pub use device::{device_name, DeviceSpec};
pub use error::{without_backtrace, ModelError, Result};
pub use llama::{
    Attention, Batch, DenseKv, LayerKv, Llama, PagedAttention, SlidingBatch, NO_BLOCK,
};
pub use loader::{GgufFile, HfDir};
pub use model::{Model, ModelFormat};
pub use qlinear::{Proj, QLinear};
pub use template::{ChatTemplate, Message, CHATML};
pub use tessera_kernels::{tuning, Activations, IsaCap, Tuning};
pub use tokenizer::{Special, StreamDecoder, Tokenizer};
