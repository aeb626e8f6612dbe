//! tessera-engine: the library API.
//!
//! **What this crate must not know:** command-line parsing and terminal I/O.
//! It owns the K/V tensors, applies the plans of tessera-kv through
//! tessera-kernels, runs tessera-model, samples, and reports usage and
//! timings.
//!
//! ```text
//! request → tokens → KvCache::add_sequence (reuse the cached prefix)
//!         → prefill chunks: append (slots, copy-on-write) → forward
//!         → decode: sample → append → forward … → stop
//!         → insert the sequence into the prefix tree → free
//! ```

mod chat;
mod engine;
mod error;
mod sampler;
mod source;

pub use chat::{ChatSession, TurnOptions};
pub use engine::{
    CacheDType, Completion, ContextShift, Engine, EngineConfig, EngineStats, FinishReason,
    GenerateRequest, Prompt, Timings, TokenEvent, Usage,
};
pub use error::{EngineError, Result};
pub use sampler::{Sampler, SamplingParams};
pub use source::ModelSource;
pub use tessera_model::{Message, Model};
