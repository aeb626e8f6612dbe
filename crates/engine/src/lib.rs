//! tessera-engine: the library API.
//!
//! **What this crate must not know:** command-line parsing and terminal I/O.
//! It owns the K/V tensors, applies the plans of tessera-kv through
//! tessera-kernels, runs tessera-model, samples, and reports usage and
//! timings.
//!
//! ```text
//! Engine (handle, any thread) ──commands──▶ worker thread (core.rs)
//!   generate(req) → RequestStream           Scheduler::schedule (tessera-sched)
//!   ◀── Token … Done events ──────────────  ops: copy_blocks / shift_kv
//!                                           forward over every running sequence
//!                                           sample, stop rules, finish → prefix tree
//! ```

mod chat;
mod core;
mod engine;
mod error;
mod sampler;
mod snapshot;
mod source;
mod stream;

pub use chat::{ChatSession, TurnOptions};
pub use engine::{
    CacheDType, Completion, ContextShift, Engine, EngineConfig, EngineStats, FinishReason,
    GenerateRequest, Prompt, Timings, TokenEvent, Usage,
};
pub use error::{EngineError, Result};
pub use sampler::{Sampler, SamplingParams};
pub use snapshot::{Geometry, KvSnapshot, LayerBytes, CACHE_FILE, FORMAT_VERSION};
pub use source::ModelSource;
pub use stream::{Event, RequestStream};
pub use tessera_model::{Message, Model};
