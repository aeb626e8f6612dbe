//! Engine errors: each names what was wrong and the numbers involved.

use tessera_kv::KvError;
use tessera_model::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("KV cache bookkeeping: {0}")]
    Kv(#[from] KvError),
    #[error(transparent)]
    Candle(candle_core::Error),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {tokens} tokens but the context holds {context}")]
    PromptTooLong { tokens: usize, context: usize },
    #[error("out of KV memory: the request needs {needed} blocks of {block_size} tokens and the pool has {total}")]
    OutOfKvMemory {
        needed: usize,
        total: usize,
        block_size: usize,
    },
    #[error("the KV memory budget of {bytes} bytes holds less than one block of {block_size} tokens ({per_block} bytes)")]
    KvBudgetTooSmall {
        bytes: usize,
        block_size: usize,
        per_block: usize,
    },
    #[error("model download: {0}")]
    Hub(String),
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("{}: {reason}", path.display())]
    Snapshot {
        path: std::path::PathBuf,
        reason: String,
    },
    #[error("the step running this request failed: {0}")]
    Step(String),
    /// A fault the configuration's fault hook asked for.
    #[error("injected fault")]
    Injected,
    #[error("the engine has stopped")]
    Stopped,
    /// The server stopped waiting for this request (its shutdown timeout).
    #[error("the server is shutting down: {0}")]
    ShuttingDown(String),
}

impl EngineError {
    /// The same error again, for one more listener (errors hold no
    /// resources; the ones a request can end with keep their kind).
    pub fn again(&self) -> EngineError {
        match self {
            EngineError::OutOfKvMemory {
                needed,
                total,
                block_size,
            } => EngineError::OutOfKvMemory {
                needed: *needed,
                total: *total,
                block_size: *block_size,
            },
            EngineError::Injected => EngineError::Injected,
            EngineError::Stopped => EngineError::Stopped,
            EngineError::ShuttingDown(why) => EngineError::ShuttingDown(why.clone()),
            EngineError::Step(why) => EngineError::Step(why.clone()),
            EngineError::Invalid(why) => EngineError::Invalid(why.clone()),
            other => EngineError::Step(other.to_string()),
        }
    }
}

pub type Result<T> = std::result::Result<T, EngineError>;

impl From<candle_core::Error> for EngineError {
    fn from(e: candle_core::Error) -> Self {
        EngineError::Candle(tessera_model::without_backtrace(e))
    }
}

/// The text of a caught panic.
pub(crate) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}
