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
    #[error("unsupported architecture {0:?}{missing} (supported: {supported})", missing = crate::config::missing_parts(.0).map(|m| format!(": it needs {m}, which Tessera's forward does not have yet")).unwrap_or_default(), supported = crate::config::Arch::ALL.map(|a| a.name()).join(", "))]
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
    #[error("device: {0}")]
    Device(String),
    #[error(transparent)]
    Candle(candle_core::Error),
}

impl From<candle_core::Error> for ModelError {
    fn from(e: candle_core::Error) -> Self {
        ModelError::Candle(without_backtrace(e))
    }
}

/// `e` without the backtrace candle attaches when `RUST_BACKTRACE` is set:
/// errors are read by people, one line naming what is wrong. The backtrace
/// goes to the debug log (`TESSERA_LOG=debug`).
pub fn without_backtrace(e: candle_core::Error) -> candle_core::Error {
    use candle_core::Error as E;
    match e {
        E::WithBacktrace { inner, backtrace } => {
            tracing::debug!("candle error {inner}: backtrace\n{backtrace}");
            without_backtrace(*inner)
        }
        E::Context { inner, context } => E::Context {
            inner: Box::new(without_backtrace(*inner)),
            context,
        },
        E::WithPath { inner, path } => E::WithPath {
            inner: Box::new(without_backtrace(*inner)),
            path,
        },
        other => other,
    }
}

pub type Result<T> = std::result::Result<T, ModelError>;
