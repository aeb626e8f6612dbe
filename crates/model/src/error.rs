//! Typed errors of model loading and running. Each says what is wrong with
//! which input, so the CLI can print it as is.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model file {0} does not exist")]
    NotFound(PathBuf),
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a GGUF file (magic bytes {magic:?}; expected \"GGUF\")")]
    NotGguf { path: PathBuf, magic: [u8; 4] },
    #[error("{path} is a damaged or truncated GGUF file: {reason}")]
    CorruptGguf { path: PathBuf, reason: String },
    #[error("unsupported architecture {0:?} (supported: llama, mistral, qwen2)")]
    UnsupportedArchitecture(String),
    #[error("unsupported quantization {dtype} of tensor {tensor}")]
    UnsupportedQuantization { tensor: String, dtype: String },
    #[error("the model is missing {0}")]
    Missing(String),
    #[error("invalid model configuration: {0}")]
    Config(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, ModelError>;
