//! The OpenAI wire format: requests as clients send them, responses and
//! stream chunks as clients parse them, and OpenAI-style errors.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use utoipa::{IntoResponses, ToSchema};

/// `"text"` or `["a", "b"]`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// A message's content: a string, or parts of which only text is read.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant turn's calls: `[{"id", "type": "function",
    /// "function": {"name", "arguments"}}]`.
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` turn: the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The fields both endpoints share (sampling, stopping, streaming).
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct Common {
    #[serde(default)]
    pub model: Option<String>,
    /// Most tokens to generate (default: up to the context).
    pub max_tokens: Option<usize>,
    /// The same as `max_tokens` (OpenAI's newer name).
    pub max_completion_tokens: Option<usize>,
    #[schema(minimum = 0, maximum = 2)]
    pub temperature: Option<f32>,
    #[schema(exclusive_minimum = 0, maximum = 1)]
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    #[schema(minimum = 0, maximum = 1)]
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<OneOrMany>,
    /// Samples of the prompt, sharing its K/V.
    #[schema(minimum = 1)]
    pub n: Option<usize>,
    #[schema(exclusive_minimum = 0)]
    pub repeat_penalty: Option<f32>,
    #[schema(minimum = -2, maximum = 2)]
    pub presence_penalty: Option<f32>,
    #[schema(minimum = -2, maximum = 2)]
    pub frequency_penalty: Option<f32>,
    /// Token id → bias added to its logit (−100 to 100).
    #[schema(value_type = Option<std::collections::HashMap<String, f64>>)]
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// Chat: `true` for the chosen tokens' log-probabilities (with
    /// `top_logprobs` alternatives); completions: how many alternatives
    /// (0–20).
    pub logprobs: Option<Value>,
    #[schema(maximum = 20)]
    pub top_logprobs: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// `false`: compute the whole prompt (default `true`).
    pub cache_prompt: Option<bool>,
    /// Partitions the prefix cache (vLLM's `cache_salt`): only requests
    /// with the same salt share cached K/V.
    pub cache_salt: Option<String>,
    /// llama-server's context shift: at the context limit keep the first
    /// `n_keep` tokens, drop half of the rest and go on (default: the
    /// request ends with `finish_reason: length`).
    pub n_keep: Option<usize>,
    /// The end user, for the client's own tracking (logged, not used).
    pub user: Option<String>,
    /// llama-server's: generate through end-of-generation tokens.
    #[serde(default)]
    pub ignore_eos: bool,
    /// llama-server's: most draft tokens per step for this request
    /// (speculative decoding by prompt lookup, or by the server's
    /// `--model-draft`; 0 turns it off; unset: the server's setting).
    #[serde(rename = "speculative.n_max")]
    pub speculative_n_max: Option<usize>,
    /// Structured output: `{"type": "json_object"}`, or `{"type":
    /// "json_schema", "json_schema": {"name": …, "schema": {…}}}` (the
    /// schema is always enforced), or `{"type": "text"}`.
    pub response_format: Option<ResponseFormat>,
    /// llama-server's: the output is JSON valid against this schema.
    #[schema(value_type = Option<Object>)]
    pub json_schema: Option<Value>,
    /// The output matches this grammar: GBNF (llama-server's) or
    /// llguidance's Lark dialect.
    pub grammar: Option<String>,
    /// The whole output matches this regular expression (SGLang's).
    pub regex: Option<String>,
}

/// OpenAI's `response_format`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ResponseFormat {
    /// `text`, `json_object` or `json_schema`.
    #[serde(rename = "type")]
    pub kind: String,
    pub json_schema: Option<JsonSchemaFormat>,
}

/// `name`, `description` and `strict` are part of the OpenAPI document
/// and otherwise unused: the schema is enforced either way.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[allow(dead_code)]
pub struct JsonSchemaFormat {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub description: Option<String>,
    #[schema(value_type = Option<Object>)]
    pub schema: Option<Value>,
    #[serde(default)]
    pub strict: Option<bool>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    /// Functions the model may call: `[{"type": "function", "function":
    /// {"name", "description", "parameters"}}]`.
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<Value>>,
    /// `"auto"` (default with tools), `"none"`, `"required"`, or
    /// `{"type": "function", "function": {"name"}}`.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// With `required`: several calls in one answer (default true).
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    pub common: Common,
}

/// A completion prompt: text, or token ids.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CompletionRequest {
    pub prompt: PromptField,
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct TokenizeRequest {
    #[serde(default)]
    pub content: String,
    /// Instead of `content`: chat messages, tokenized exactly as
    /// `/v1/chat/completions` tokenizes its prompt (the model's chat
    /// template, then its tokens): what a router computes block hashes of.
    #[serde(default)]
    pub messages: Option<Vec<ChatMessage>>,
    /// Add the model's BOS token (as llama-server's `add_special`).
    #[serde(default)]
    pub add_special: bool,
    /// Control-token text becomes control tokens (llama-server's default).
    #[serde(default = "yes")]
    pub parse_special: bool,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct DetokenizeRequest {
    pub tokens: Vec<u32>,
}

/// The conversation a session holds: chat messages (rendered with the
/// model's template) or token ids.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct SessionSaveRequest {
    #[serde(default)]
    pub messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    pub tokens: Option<Vec<u32>>,
    /// The partition the session lives in (with the API key's), as the
    /// requests that continue it send it.
    #[serde(default)]
    pub cache_salt: Option<String>,
}

/// A restore's optional body.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct SessionRestoreRequest {
    #[serde(default)]
    pub cache_salt: Option<String>,
}

/// `usage` of a response: `cached_tokens` are the prompt tokens whose K/V
/// came from the prefix cache (not computed by this request).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct UsageOut {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: CachedOut,
    /// With speculative decoding: draft tokens kept and rejected (OpenAI's
    /// names for predicted outputs, which work the same way).
    pub completion_tokens_details: PredictionOut,
}

#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct CachedOut {
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PredictionOut {
    pub accepted_prediction_tokens: usize,
    pub rejected_prediction_tokens: usize,
}

/// llama-server's `timings`, for users coming from it.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct TimingsOut {
    pub cache_n: usize,
    /// Of `cache_n`, the tokens read back from the disk tier below the
    /// pool (`--cache-dir`).
    pub cache_disk_n: usize,
    pub prompt_n: usize,
    pub prompt_ms: f64,
    pub predicted_n: usize,
    pub predicted_ms: f64,
    /// Speculative decoding's draft tokens and those kept.
    pub draft_n: usize,
    pub draft_n_accepted: usize,
}

/// The body of every error response.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    pub message: String,
    /// `invalid_request_error` (the request's fault) or `server_error`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The request field at fault, when one is.
    pub param: Option<&'static str>,
    /// A machine-readable reason, e.g. `context_length_exceeded`.
    pub code: Option<&'static str>,
}

/// The error answers every generating route may give, for the OpenAPI
/// document.
#[allow(dead_code)] // Only its derived responses are used.
#[derive(IntoResponses)]
pub enum RequestErrors {
    #[response(status = 400, description = "The request is invalid")]
    Invalid(ErrorBody),
    #[response(
        status = 401,
        description = "A key is required and was missing or wrong"
    )]
    Unauthorized(ErrorBody),
    #[response(
        status = 429,
        description = "The queue is full: retry after `Retry-After`"
    )]
    Busy(ErrorBody),
    #[response(status = 503, description = "Loading or shutting down")]
    Unavailable(ErrorBody),
}

/// An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}`
/// with its HTTP status.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: Option<&'static str>,
    pub param: Option<&'static str>,
    pub message: String,
}

impl ApiError {
    pub fn bad(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code: None,
            param: None,
            message: message.into(),
        }
    }

    /// A failure of the server, not of the request (`server_error`).
    pub fn server(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            kind: "server_error",
            code: None,
            param: None,
            message: message.into(),
        }
    }

    /// A request field out of range, naming the field.
    pub fn param(param: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param),
            ..ApiError::bad(message)
        }
    }

    pub fn unsupported(param: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            code: Some("unsupported_parameter"),
            param: Some(param),
            ..ApiError::bad(message)
        }
    }

    pub fn body(&self) -> Value {
        let body = ErrorBody {
            error: ErrorDetail {
                message: self.message.clone(),
                kind: self.kind,
                param: self.param,
                code: self.code,
            },
        };
        serde_json::to_value(body).unwrap_or_else(|_| json!({"error": {"message": self.message}}))
    }
}

impl IntoResponse for ApiError {
    /// A 429 or 503 also says when to retry (`Retry-After: 1`).
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if matches!(
            self.status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        ) {
            r.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        r
    }
}

impl From<tessera_engine::EngineError> for ApiError {
    fn from(e: tessera_engine::EngineError) -> ApiError {
        use tessera_engine::EngineError as E;
        let message = e.to_string();
        match e {
            E::PromptTooLong { .. } => ApiError {
                code: Some("context_length_exceeded"),
                param: Some("messages"),
                ..ApiError::bad(message)
            },
            E::OutOfKvMemory { .. } => ApiError {
                code: Some("kv_memory_exceeded"),
                ..ApiError::bad(message)
            },
            E::EmptyPrompt | E::Invalid(_) => ApiError::bad(message),
            E::Model(
                tessera_model::ModelError::Tokenizer(_) | tessera_model::ModelError::Template(_),
            ) => ApiError::bad(message),
            E::Stopped | E::ShuttingDown(_) => {
                ApiError::server(StatusCode::SERVICE_UNAVAILABLE, message)
            }
            _ => ApiError::server(StatusCode::INTERNAL_SERVER_ERROR, message),
        }
    }
}
