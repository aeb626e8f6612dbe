//! tessera-server: an OpenAI-compatible HTTP server over one [`Engine`].
//!
//! **What this crate must not know:** scheduling, the KV cache, the model.
//! Every HTTP request becomes one engine request; the engine's worker
//! batches all running requests into each step and serves every prompt
//! from its one prefix tree, so `usage.prompt_tokens_details.cached_tokens`
//! is exactly what a request did not compute.
//!
//! ```text
//! axum handler ── spawn_blocking: Engine::generate ──▶ EventStream (async)
//!      ▲                                   │ forwarder task: events → channel
//!      └── JSON, or SSE chunks ◀── converter task ◀──┘
//! client gone → the handler (or the SSE body) is dropped → its cancel
//!             guard cancels the request, queued or running, at the
//!             engine's next step; its queue slot is freed when it ends
//! ```
//!
//! Tenants: with several API keys each key is a tenant, and a request's
//! prefix-cache partition is its tenant and its `cache_salt`
//! ([`tessera_engine::Partition`]). Sessions live inside the partition too
//! (a directory of their own), so one tenant never reads, overwrites or
//! times another's cached K/V or sessions.

mod api;
pub mod kv_events;
mod logprobs;
mod metrics;
mod openapi;
mod sessions;

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::rejection::JsonRejection;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use futures_util::StreamExt;
use serde_json::{json, Value};
use tessera_engine::{
    Canceller, Completion, Constraint, ContextShift, Engine, EngineError, Event, FinishReason,
    GenerateRequest, Message, Partition, Prompt, SamplingParams, TokenLogprob, ToolCall,
    ToolChoice, ToolSpec, ToolStream, ToolSyntax,
};
use tokio::sync::mpsc;

pub use api::ApiError;
use api::{
    CachedOut, ChatRequest, Common, CompletionRequest, Content, DetokenizeRequest, PredictionOut,
    PromptField, RequestErrors, TimingsOut, TokenizeRequest, UsageOut,
};

/// How the server is set up.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The name `/v1/models` lists and requests must name (or leave out).
    pub model_name: String,
    /// Accepted `Authorization: Bearer` keys; empty: no key needed.
    pub api_keys: Vec<String>,
    /// Largest request body, in bytes.
    pub body_limit: usize,
    /// Longest wait for a response to start (a stream may then run on).
    pub request_timeout: Duration,
    /// Most samples (`n`) per request.
    pub max_n: usize,
    /// Prefix of the `/metrics` names (`tessera`, or `vllm` for routers
    /// that read vLLM's exact names).
    pub metrics_prefix: String,
    /// Most generation requests in the server at once (running or queued
    /// in the engine); more are answered 429 with `Retry-After`.
    pub max_queue: usize,
    /// Where `/v1/sessions/{name}/save` and `/restore` keep sessions;
    /// `None`: those endpoints answer 404.
    pub session_dir: Option<std::path::PathBuf>,
    /// Most tokens one session may hold (`None`: the context length);
    /// larger saves are answered 413.
    pub max_session_tokens: Option<usize>,
    /// Most bytes all session files together may take; a save past it is
    /// answered 507 (`None`: no limit).
    pub session_quota: Option<u64>,
    /// `/metrics` and `/openapi.json` without a key, when keys are set.
    pub public_metrics: bool,
}

impl ServerConfig {
    pub fn new(model_name: impl Into<String>) -> ServerConfig {
        ServerConfig {
            model_name: model_name.into(),
            api_keys: Vec::new(),
            body_limit: 8 << 20,
            request_timeout: Duration::from_secs(600),
            max_n: 16,
            metrics_prefix: "tessera".into(),
            max_queue: 512,
            session_dir: None,
            max_session_tokens: None,
            session_quota: None,
            public_metrics: false,
        }
    }
}

/// The server's shared state: its configuration and the engine, once the
/// model has loaded (`/health` answers 503 until then).
pub struct Server {
    cfg: ServerConfig,
    /// SHA-256 of each API key, compared in constant time.
    key_digests: Vec<[u8; 32]>,
    /// Session files being written now (one writer per file), and bytes
    /// reserved against the quota by saves in flight.
    sessions: sessions::Writers,
    engine: OnceLock<Arc<Engine>>,
    next_id: AtomicU64,
    metrics: metrics::Metrics,
    /// Generation requests in the server now.
    in_flight: Arc<AtomicUsize>,
}

/// One generation request counted against `max_queue` while it lives.
struct QueueSlot(Arc<AtomicUsize>);

impl Drop for QueueSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Server {
    pub fn new(cfg: ServerConfig) -> Arc<Server> {
        if let Some(dir) = &cfg.session_dir {
            let n = sessions::clean(dir);
            if n > 0 {
                tracing::info!(
                    "removed {n} unfinished session writes from {}",
                    dir.display()
                );
            }
        }
        Arc::new(Server {
            key_digests: cfg.api_keys.iter().map(|k| digest(k)).collect(),
            sessions: sessions::Writers::default(),
            metrics: metrics::Metrics::new(&cfg.metrics_prefix),
            cfg,
            engine: OnceLock::new(),
            next_id: AtomicU64::new(1),
            in_flight: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// A place for one more generation request, or 429 when the server
    /// already holds `max_queue` of them.
    fn admit(&self) -> Result<QueueSlot, ApiError> {
        let before = self.in_flight.fetch_add(1, Ordering::SeqCst);
        let slot = QueueSlot(self.in_flight.clone());
        if before >= self.cfg.max_queue {
            return Err(ApiError {
                code: Some("queue_full"),
                ..ApiError::server(
                    StatusCode::TOO_MANY_REQUESTS,
                    format!(
                        "the server holds {} requests, its limit: retry shortly",
                        self.cfg.max_queue
                    ),
                )
            });
        }
        Ok(slot)
    }

    /// The model has loaded: requests are served from now on.
    pub fn set_engine(&self, engine: Arc<Engine>) {
        let _ = self.engine.set(engine);
    }

    fn engine(&self) -> Result<Arc<Engine>, ApiError> {
        self.engine.get().cloned().ok_or_else(|| ApiError {
            code: Some("loading"),
            ..ApiError::server(
                StatusCode::SERVICE_UNAVAILABLE,
                "the model is still loading",
            )
        })
    }

    fn id(&self, prefix: &str) -> String {
        format!("{prefix}-{}", self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// The routes, with the API key check (every route but `/health`, and
    /// with `public_metrics` `/metrics` and `/openapi.json`), the body
    /// limit (of every body, JSON included) and the response timeout.
    pub fn router(self: &Arc<Self>) -> Router {
        let mut open = Router::new().route("/health", get(health));
        let mut keyed = Router::new();
        let docs = Router::new()
            .route("/metrics", get(metrics_text))
            .route("/openapi.json", get(openapi::document));
        if self.cfg.public_metrics {
            open = open.merge(docs);
        } else {
            keyed = keyed.merge(docs);
        }
        let keyed = keyed
            .route("/v1/models", get(models))
            .route("/v1/chat/completions", post(chat))
            .route("/v1/completions", post(completions))
            .route("/tokenize", post(tokenize))
            .route("/detokenize", post(detokenize))
            .route("/v1/sessions/{name}/save", post(sessions::save))
            .route("/v1/sessions/{name}/restore", post(sessions::restore))
            .route_layer(middleware::from_fn_with_state(self.clone(), auth));
        open.merge(keyed)
            .layer(axum::extract::DefaultBodyLimit::max(self.cfg.body_limit))
            .layer(tower_http::limit::RequestBodyLimitLayer::new(
                self.cfg.body_limit,
            ))
            .layer(tower_http::timeout::TimeoutLayer::with_status_code(
                StatusCode::REQUEST_TIMEOUT,
                self.cfg.request_timeout,
            ))
            .with_state(self.clone())
    }
}

/// Serves `router` on `listener` until `shutdown` resolves, then lets the
/// requests in flight finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}

/// Which configured API key a request came with (its index; `None` when
/// no key is needed), for the per-key prefix-cache partitions.
#[derive(Debug, Clone, Copy, Default)]
struct Tenant(Option<usize>);

fn digest(key: &str) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(key.as_bytes()).into()
}

/// The configured key `given` is, if any: its digest is compared with
/// every key's in constant time (no early exit, no length leak), so the
/// time taken says nothing of how close a guess was.
fn key_index(digests: &[[u8; 32]], given: &str) -> Option<usize> {
    use subtle::{ConditionallySelectable, ConstantTimeEq};
    let d = digest(given);
    let (mut found, mut any) = (0u64, subtle::Choice::from(0));
    for (i, k) in digests.iter().enumerate() {
        let hit = k.ct_eq(&d);
        found.conditional_assign(&(i as u64), hit);
        any |= hit;
    }
    bool::from(any).then_some(found as usize)
}

async fn auth(State(s): State<Arc<Server>>, mut req: Request, next: Next) -> Response {
    if s.cfg.api_keys.is_empty() {
        req.extensions_mut().insert(Tenant(None));
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if let Some(i) = given.and_then(|k| key_index(&s.key_digests, k)) {
        req.extensions_mut().insert(Tenant(Some(i)));
        return next.run(req).await;
    }
    ApiError {
        status: StatusCode::UNAUTHORIZED,
        kind: "authentication_error",
        code: Some("invalid_api_key"),
        param: None,
        message: "a valid API key is required (Authorization: Bearer KEY)".into(),
    }
    .into_response()
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[utoipa::path(
    get,
    path = "/health",
    tag = "operations",
    summary = "200 once the model has loaded, 503 before",
    responses(
        (status = 200, description = "The model has loaded"),
        (status = 503, description = "The model is loading"),
    ),
)]
async fn health(State(s): State<Arc<Server>>) -> Response {
    match s.engine.get() {
        Some(_) => (StatusCode::OK, Json(json!({"status": "ok"}))).into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "loading"})),
        )
            .into_response(),
    }
}

#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    summary = "Prometheus metrics (vLLM's names)",
    responses(
        (status = 200, description = "Prometheus metrics (vLLM's names)", content_type = "text/plain"),
    ),
)]
async fn metrics_text(State(s): State<Arc<Server>>) -> Result<Response, ApiError> {
    let engine = s.engine()?;
    let stats = blocking("stats", move || Ok(engine.stats())).await?;
    Ok((
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(&stats),
    )
        .into_response())
}

#[utoipa::path(
    get,
    path = "/v1/models",
    tag = "OpenAI",
    summary = "The model this server serves",
    responses(
        (status = 200, description = "The model this server serves"),
    ),
)]
async fn models(State(s): State<Arc<Server>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": s.cfg.model_name,
            "object": "model",
            "created": now(),
            "owned_by": "tessera",
        }],
    }))
}

/// Runs blocking engine work off the async threads; a task that dies is a
/// 500 naming `what`.
async fn blocking<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| {
        ApiError::server(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("{what} task failed: {e}"),
        )
    })?
}

/// A malformed body as an OpenAI-style 400.
fn rejected(r: JsonRejection) -> ApiError {
    let mut e = ApiError::bad(format!("malformed request body: {}", r.body_text()));
    e.status = if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
        StatusCode::PAYLOAD_TOO_LARGE
    } else {
        StatusCode::BAD_REQUEST
    };
    e
}

#[utoipa::path(
    post,
    path = "/tokenize",
    tag = "llama-server",
    summary = "Token ids of a text",
    request_body = TokenizeRequest,
    responses(
        (status = 200, description = "Token ids of the text"),
        RequestErrors,
    ),
)]
async fn tokenize(
    State(s): State<Arc<Server>>,
    body: Result<Json<TokenizeRequest>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let Json(req) = body.map_err(rejected)?;
    let engine = s.engine()?;
    if let Some(messages) = req.messages {
        let mut msgs = Vec::with_capacity(messages.len());
        for m in messages {
            let mut msg = Message::new(m.role, message_text(m.content)?);
            msg.tool_calls = m.tool_calls.map(Value::Array);
            msg.tool_call_id = m.tool_call_id;
            msg.name = m.name;
            msgs.push(msg);
        }
        let ids: Vec<u32> = blocking("tokenize", move || {
            Ok(engine.tokenize_prompt(&Prompt::Chat(msgs))?)
        })
        .await?;
        return Ok(Json(json!({"tokens": ids})));
    }
    let special = if req.parse_special {
        tessera_model::Special::Parse
    } else {
        tessera_model::Special::AsText
    };
    // Megabytes of text take a while: off the async threads.
    let ids = blocking("tokenize", move || {
        Ok(engine
            .model()
            .tokenizer
            .encode(&req.content, special, req.add_special)
            .map_err(EngineError::from)?)
    })
    .await?;
    Ok(Json(json!({"tokens": ids})))
}

#[utoipa::path(
    post,
    path = "/detokenize",
    tag = "llama-server",
    summary = "Text of token ids",
    request_body = DetokenizeRequest,
    responses(
        (status = 200, description = "Text of the token ids"),
        RequestErrors,
    ),
)]
async fn detokenize(
    State(s): State<Arc<Server>>,
    body: Result<Json<DetokenizeRequest>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let Json(req) = body.map_err(rejected)?;
    let engine = s.engine()?;
    let vocab = engine.model().config().vocab_size;
    if let Some(bad) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad(format!(
            "token id {bad} is outside the vocabulary of {vocab}"
        )));
    }
    let text = blocking("detokenize", move || {
        Ok(engine
            .model()
            .tokenizer
            .decode(&req.tokens)
            .map_err(EngineError::from)?)
    })
    .await?;
    Ok(Json(json!({"content": text})))
}

/// Which endpoint a generation answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completions,
}

#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    tag = "OpenAI",
    summary = "Chat completion, streamed (SSE) or not",
    request_body = ChatRequest,
    responses(
        (status = 200, description = "A chat completion; with `stream`, its chunks as server-sent events"),
        RequestErrors,
    ),
)]
async fn chat(
    State(s): State<Arc<Server>>,
    Extension(tenant): Extension<Tenant>,
    body: Result<Json<ChatRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body.map_err(rejected)?;
    if req.messages.is_empty() {
        return Err(ApiError::bad("`messages` is empty"));
    }
    let mut msgs = Vec::with_capacity(req.messages.len());
    for m in req.messages {
        let mut msg = Message::new(m.role, message_text(m.content)?);
        msg.tool_calls = m.tool_calls.map(Value::Array);
        msg.tool_call_id = m.tool_call_id;
        msg.name = m.name;
        msgs.push(msg);
    }
    let specs = req
        .tools
        .iter()
        .flatten()
        .map(ToolSpec::from_openai)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ApiError::param("tools", e))?;
    let choice = tool_choice(req.tool_choice.as_ref(), !specs.is_empty())?;
    if specs.is_empty() || choice == ToolChoice::None {
        return generate(
            s,
            Prompt::Chat(msgs),
            req.common,
            Endpoint::Chat,
            tenant,
            None,
        )
        .await;
    }
    let engine = s.engine()?;
    let model = engine.model();
    let syntax = ToolSyntax::of(&model.template, &model.tokenizer);
    let forced = syntax
        .constraint(&specs, &choice, req.parallel_tool_calls.unwrap_or(true))
        .map_err(|e| ApiError::param("tool_choice", e))?;
    let prompt = syntax.prompt(msgs, &specs);
    let tools = Tools { syntax, forced };
    generate(s, prompt, req.common, Endpoint::Chat, tenant, Some(tools)).await
}

/// A chat request's tools: how the model writes calls, and the grammar
/// that forces one (`tool_choice` `required` or a named function) or,
/// under `auto`, holds a call to its syntax once it opens.
struct Tools {
    syntax: ToolSyntax,
    forced: Option<Constraint>,
}

/// OpenAI's `tool_choice` (default `auto` with tools, `none` without).
fn tool_choice(v: Option<&Value>, any: bool) -> Result<ToolChoice, ApiError> {
    let bad = || {
        ApiError::param(
            "tool_choice",
            "tool_choice must be `none`, `auto`, `required` or {\"type\": \"function\", \"function\": {\"name\": …}}",
        )
    };
    let choice = match v {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            _ => return Err(bad()),
        },
        Some(o) => o
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .map(|n| ToolChoice::Named(n.to_string()))
            .ok_or_else(bad)?,
    };
    if !any && matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) {
        return Err(ApiError::param(
            "tool_choice",
            "tool_choice asks for a call, and no `tools` were given",
        ));
    }
    Ok(choice)
}

/// A message's text: its string, or its text parts joined (other parts
/// are refused).
fn message_text(content: Option<Content>) -> Result<String, ApiError> {
    Ok(match content {
        None => String::new(),
        Some(Content::Text(t)) => t,
        Some(Content::Parts(parts)) => {
            let mut t = String::new();
            for p in parts {
                if p.kind != "text" {
                    return Err(ApiError::unsupported(
                        "messages",
                        format!("message parts of type `{}` are not supported", p.kind),
                    ));
                }
                t.push_str(p.text.as_deref().unwrap_or(""));
            }
            t
        }
    })
}

#[utoipa::path(
    post,
    path = "/v1/completions",
    tag = "OpenAI",
    summary = "Text completion of a prompt (text or token ids)",
    request_body = CompletionRequest,
    responses(
        (status = 200, description = "A completion of the prompt (text or token ids); with `stream`, its chunks as server-sent events"),
        RequestErrors,
    ),
)]
async fn completions(
    State(s): State<Arc<Server>>,
    Extension(tenant): Extension<Tenant>,
    body: Result<Json<CompletionRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body.map_err(rejected)?;
    let prompt = match req.prompt {
        PromptField::Text(t) => Prompt::Text(t),
        PromptField::Tokens(ids) => Prompt::Tokens(ids),
        PromptField::Texts(mut v) if v.len() == 1 => Prompt::Text(v.remove(0)),
        PromptField::Texts(_) => {
            return Err(ApiError::unsupported(
                "prompt",
                "a list of several prompts is not supported: send one request per prompt",
            ))
        }
    };
    generate(s, prompt, req.common, Endpoint::Completions, tenant, None).await
}

/// The engine request a body asks for, or why it cannot be served.
fn request(
    s: &Server,
    engine: &Engine,
    prompt: Prompt,
    c: &Common,
    endpoint: Endpoint,
    tenant: &Tenant,
    forced: Option<Constraint>,
) -> Result<GenerateRequest, ApiError> {
    if let Some(m) = c.model.as_deref() {
        if !m.is_empty() && m != s.cfg.model_name {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                kind: "invalid_request_error",
                code: Some("model_not_found"),
                param: Some("model"),
                message: format!(
                    "the model `{m}` does not exist: this server serves `{}`",
                    s.cfg.model_name
                ),
            });
        }
    }
    let logprobs = logprobs_wanted(c, endpoint)?;
    let vocab = engine.model().config().vocab_size;
    let mut logit_bias = Vec::new();
    for (k, v) in c.logit_bias.iter().flatten() {
        let id = k
            .parse::<u32>()
            .ok()
            .filter(|&t| (t as usize) < vocab)
            .ok_or_else(|| {
                ApiError::param(
                    "logit_bias",
                    format!("logit_bias key `{k}` is not a token id below {vocab}"),
                )
            })?;
        let b = v
            .as_f64()
            .filter(|b| (-100.0..=100.0).contains(b))
            .ok_or_else(|| {
                ApiError::param(
                    "logit_bias",
                    format!("logit_bias of token {id} must be a number from -100 to 100"),
                )
            })?;
        logit_bias.push((id, b as f32));
    }
    for (name, v) in [
        ("presence_penalty", c.presence_penalty),
        ("frequency_penalty", c.frequency_penalty),
    ] {
        if v.is_some_and(|v| !(-2.0..=2.0).contains(&v)) {
            return Err(ApiError::param(
                name,
                format!("{name} must be between -2 and 2"),
            ));
        }
    }
    if let Some(user) = &c.user {
        tracing::debug!(user, "request");
    }
    let n = c.n.unwrap_or(1);
    if n == 0 || n > s.cfg.max_n {
        return Err(ApiError::bad(format!(
            "n must be between 1 and {}",
            s.cfg.max_n
        )));
    }
    let mut sampling = SamplingParams {
        presence_penalty: c.presence_penalty.unwrap_or(0.0),
        frequency_penalty: c.frequency_penalty.unwrap_or(0.0),
        logit_bias,
        ..SamplingParams::default()
    };
    if let Some(t) = c.temperature {
        if !(0.0..=2.0).contains(&t) {
            return Err(ApiError::bad("temperature must be between 0 and 2"));
        }
        sampling.temperature = t;
    }
    if let Some(p) = c.top_p {
        if !(0.0..=1.0).contains(&p) || p == 0.0 {
            return Err(ApiError::bad("top_p must be in (0, 1]"));
        }
        sampling.top_p = p;
    }
    if let Some(k) = c.top_k {
        sampling.top_k = k;
    }
    if let Some(m) = c.min_p {
        if !(0.0..=1.0).contains(&m) {
            return Err(ApiError::bad("min_p must be between 0 and 1"));
        }
        sampling.min_p = m;
    }
    if let Some(r) = c.repeat_penalty {
        if r <= 0.0 {
            return Err(ApiError::bad("repeat_penalty must be positive"));
        }
        sampling.repetition_penalty = r;
    }
    if let Some(seed) = c.seed {
        sampling.seed = seed;
    }
    // Unset: until the end of generation, the context or the pool (the
    // request is admitted on what its prompt needs and grows).
    let max_tokens = c
        .max_completion_tokens
        .or(c.max_tokens)
        .unwrap_or(GenerateRequest::UNLIMITED);
    let stop = c.stop.clone().map(|s| s.into_vec()).unwrap_or_default();
    tessera_engine::check_stops(&stop).map_err(|e| ApiError::param("stop", e.to_string()))?;
    Ok(GenerateRequest {
        sampling,
        max_tokens,
        stop,
        ignore_eos: c.ignore_eos,
        n,
        logprobs,
        context_shift: c.n_keep.map_or(ContextShift::Off, ContextShift::Keep),
        reuse_prefix: c.cache_prompt.unwrap_or(true),
        partition: partition(s, tenant, c.cache_salt.as_deref())?,
        constraint: match (constraint(c)?, forced) {
            // `tool_choice: auto`'s calls, constrained once opened, give
            // way to a constraint on the whole answer.
            (Some(a), Some(Constraint::After { .. })) => Some(a),
            (Some(_), Some(_)) => {
                return Err(ApiError::param(
                    "tool_choice",
                    "a tool_choice that forces a call cannot be combined with response_format, json_schema, grammar or regex",
                ))
            }
            (a, b) => a.or(b),
        },
        speculative: c.speculative_n_max.map(|n| tessera_engine::NgramSpec {
            max_draft: n,
            ..engine.config().speculative.unwrap_or_default()
        }),
        ..GenerateRequest::new(prompt)
    })
}

/// The structured-output constraint a body asks for (at most one of
/// `response_format`, `json_schema`, `grammar` and `regex`).
fn constraint(c: &Common) -> Result<Option<Constraint>, ApiError> {
    let mut found: Vec<(&'static str, Constraint)> = Vec::new();
    if let Some(f) = &c.response_format {
        match f.kind.as_str() {
            "text" => {}
            "json_object" => found.push(("response_format", Constraint::JsonObject)),
            "json_schema" => {
                let schema = f
                    .json_schema
                    .as_ref()
                    .and_then(|j| j.schema.clone())
                    .ok_or_else(|| {
                        ApiError::param(
                            "response_format",
                            "response_format of type json_schema needs json_schema.schema",
                        )
                    })?;
                found.push(("response_format", Constraint::JsonSchema(schema)));
            }
            other => {
                return Err(ApiError::param(
                    "response_format",
                    format!(
                    "response_format type `{other}` is not one of text, json_object, json_schema"
                ),
                ))
            }
        }
    }
    if let Some(s) = &c.json_schema {
        found.push(("json_schema", Constraint::json_schema(s.clone())));
    }
    if let Some(g) = &c.grammar {
        found.push(("grammar", Constraint::grammar_text(g)));
    }
    if let Some(r) = &c.regex {
        found.push(("regex", Constraint::Regex(r.clone())));
    }
    if found.len() > 1 {
        return Err(ApiError::param(
            found[1].0,
            format!(
                "give one constraint: {} and {} were both given",
                found[0].0, found[1].0
            ),
        ));
    }
    Ok(found.pop().map(|(_, c)| c))
}

/// How many top log-probabilities a request wants per token, if any:
/// chat's `logprobs: true` with `top_logprobs: N`, completions'
/// `logprobs: N` (0 to 20 either way).
fn logprobs_wanted(c: &Common, endpoint: Endpoint) -> Result<Option<usize>, ApiError> {
    const MOST: u64 = 20;
    let range = |name| ApiError::param(name, format!("{name} must be from 0 to {MOST}"));
    match endpoint {
        Endpoint::Chat => {
            let on = match &c.logprobs {
                None | Some(Value::Null) | Some(Value::Bool(false)) => false,
                Some(Value::Bool(true)) => true,
                Some(_) => {
                    return Err(ApiError::param(
                        "logprobs",
                        "logprobs must be true or false (top_logprobs says how many)",
                    ))
                }
            };
            match c.top_logprobs {
                Some(n) if n as u64 > MOST => Err(range("top_logprobs")),
                Some(n) if n > 0 && !on => Err(ApiError::param(
                    "top_logprobs",
                    "top_logprobs needs logprobs: true",
                )),
                n => Ok(on.then_some(n.unwrap_or(0) as usize)),
            }
        }
        Endpoint::Completions => match &c.logprobs {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n <= MOST => Ok(Some(n as usize)),
                _ => Err(range("logprobs")),
            },
        },
    }
}

/// The prefix-cache partition of a request: its `cache_salt`, and with
/// several API keys configured, the key it came with (one partition per
/// key, so one tenant cannot see or time another's prompts). The tenant
/// is named by a digest of its key, never the key, and stays the same
/// across restarts (the cache directory restores each partition's K/V
/// into its own).
fn partition(s: &Server, tenant: &Tenant, cache_salt: Option<&str>) -> Result<Partition, ApiError> {
    if cache_salt.is_some_and(|salt| salt.len() > MAX_SALT_BYTES) {
        return Err(ApiError::param(
            "cache_salt",
            format!("cache_salt takes at most {MAX_SALT_BYTES} bytes"),
        ));
    }
    let key = tenant.0.filter(|_| s.cfg.api_keys.len() > 1);
    Ok(Partition {
        tenant: key.map(|k| {
            s.key_digests[k][..16]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect()
        }),
        salt: cache_salt.map(str::to_string),
    })
}

/// The longest `cache_salt` (the engine keeps each partition's name while
/// it has cached K/V, for the cache directory).
const MAX_SALT_BYTES: usize = 256;

/// Cancels its request when dropped.
struct CancelOnDrop(Canceller);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

fn finish(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

/// A chat choice's message and finish reason: with tools offered, the
/// calls the model made, if its answer holds any that parse (then
/// `finish_reason: tool_calls`, and `content` is the text before them or
/// null).
fn chat_message(c: &Completion, syntax: Option<&ToolSyntax>, id: &str) -> (Value, &'static str) {
    match syntax.and_then(|t| t.parse(&c.text)) {
        Some((content, calls)) => {
            let calls = tool_calls(&calls, id, c.index);
            let content = (!content.is_empty()).then_some(content);
            (
                json!({"role": "assistant", "content": content, "tool_calls": calls}),
                "tool_calls",
            )
        }
        None => (
            json!({"role": "assistant", "content": c.text}),
            finish(c.finish_reason),
        ),
    }
}

/// OpenAI's `tool_calls` entries, `arguments` as a JSON string (stream
/// deltas add each one's `index`).
fn tool_calls(calls: &[ToolCall], id: &str, choice: usize) -> Vec<Value> {
    calls
        .iter()
        .enumerate()
        .map(|(i, call)| {
            json!({
                "id": format!("call_{}_{choice}_{i}", id.replace('-', "_")),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments.to_string()},
            })
        })
        .collect()
}

fn usage(done: &[Completion]) -> (UsageOut, TimingsOut) {
    let Some(first) = done.first() else {
        return Default::default();
    };
    let completion: usize = done.iter().map(|c| c.usage.completion_tokens).sum();
    let drafted: usize = done.iter().map(|c| c.usage.draft_tokens).sum();
    let accepted: usize = done.iter().map(|c| c.usage.accepted_draft_tokens).sum();
    let u = first.usage;
    let usage = UsageOut {
        prompt_tokens: u.prompt_tokens,
        completion_tokens: completion,
        total_tokens: u.prompt_tokens + completion,
        prompt_tokens_details: CachedOut {
            cached_tokens: u.cached_tokens,
        },
        completion_tokens_details: PredictionOut {
            accepted_prediction_tokens: accepted,
            rejected_prediction_tokens: drafted - accepted,
        },
    };
    let t = first.timings;
    let timings = TimingsOut {
        cache_n: u.cached_tokens,
        cache_disk_n: u.disk_cached_tokens,
        prompt_n: u.prompt_tokens - u.cached_tokens,
        prompt_ms: t.ttft_ms,
        predicted_n: completion,
        predicted_ms: (t.total_s * 1e3 - t.ttft_ms).max(0.0),
        draft_n: drafted,
        draft_n_accepted: accepted,
    };
    (usage, timings)
}

async fn generate(
    s: Arc<Server>,
    prompt: Prompt,
    c: Common,
    endpoint: Endpoint,
    tenant: Tenant,
    tools: Option<Tools>,
) -> Result<Response, ApiError> {
    let engine = s.engine()?;
    let (syntax, forced) = match tools {
        Some(t) => (Some(t.syntax), t.forced),
        None => (None, None),
    };
    let req = request(&s, &engine, prompt, &c, endpoint, &tenant, forced)?;
    let slot = s.admit()?;
    let n = req.n;
    let want_logprobs = req.logprobs.is_some();
    // Errors that the request can never run come back before anything is
    // sent, as a status code.
    let e2 = engine.clone();
    let stream = blocking("request", move || Ok(e2.generate(req)?)).await?;
    // Dropped when the client is gone (this handler's future, or the SSE
    // body's task, dropped): the request is cancelled at once, queued or
    // running, rather than when an event next fails to reach the client.
    let mut stream = stream.into_async();
    let guard = CancelOnDrop(stream.canceller());
    let (tx, mut rx) = mpsc::channel::<Event>(256);
    // A task forwards the engine's events (woken by the engine's worker),
    // and stops (so dropping the stream cancels the request) when the
    // receiver is gone. It also times the tokens for /metrics.
    let watcher = s.clone();
    tokio::spawn(async move {
        // Counts against the queue limit until the request has ended.
        let _slot = slot;
        let mut last: Vec<Option<std::time::Instant>> = vec![None; n];
        while let Some(ev) = stream.next().await {
            match &ev {
                Event::Token { index, .. } => {
                    let now = std::time::Instant::now();
                    if let Some(prev) = last[*index].replace(now) {
                        watcher.metrics.gap(now - prev);
                    }
                }
                Event::Done(c) if c.index == 0 => {
                    watcher.metrics.ttft(c.timings.ttft_ms / 1e3);
                    watcher.metrics.e2e(c.timings.total_s);
                }
                _ => {}
            }
            if tx.send(ev).await.is_err() {
                break;
            }
        }
    });
    let id = s.id(if endpoint == Endpoint::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    });
    let created = now();
    let model = s.cfg.model_name.clone();
    if !c.stream {
        let _guard = guard;
        let mut done: Vec<Option<Completion>> = vec![None; n];
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Token { .. } => {}
                Event::Done(comp) => {
                    let i = comp.index;
                    done[i] = Some(*comp);
                }
                Event::Error(e) => return Err(e.into()),
            }
        }
        let done: Vec<Completion> = done.into_iter().flatten().collect();
        if done.len() != n {
            return Err(EngineError::Stopped.into());
        }
        let (usage, timings) = usage(&done);
        let tok = &engine.model().tokenizer;
        let choices: Vec<Value> = done
            .iter()
            .map(|c| match endpoint {
                Endpoint::Chat => {
                    let (message, reason) = chat_message(c, syntax.as_ref(), &id);
                    json!({
                        "index": c.index,
                        "message": message,
                        "finish_reason": reason,
                        "logprobs": want_logprobs.then(|| logprobs::chat(tok, &c.logprobs)),
                    })
                }
                Endpoint::Completions => json!({
                    "index": c.index,
                    "text": c.text,
                    "finish_reason": finish(c.finish_reason),
                    "logprobs": want_logprobs.then(|| logprobs::completion(tok, &c.logprobs, 0)),
                }),
            })
            .collect();
        let object = match endpoint {
            Endpoint::Chat => "chat.completion",
            Endpoint::Completions => "text_completion",
        };
        return Ok(Json(json!({
            "id": id,
            "object": object,
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage,
            "timings": timings,
        }))
        .into_response());
    }
    let include_usage = c.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let object = match endpoint {
        Endpoint::Chat => "chat.completion.chunk",
        Endpoint::Completions => "text_completion",
    };
    let call_id = id.clone();
    // One chunk; the last, with `stream_options.include_usage`, has no
    // choices and the usage.
    let chunk = move |choices: Value, usage: Option<(UsageOut, TimingsOut)>| {
        let mut v = json!({
            "id": id,
            "object": object,
            "created": created,
            "model": model,
            "choices": choices,
        });
        if let Some((u, t)) = usage {
            v["usage"] = json!(u);
            v["timings"] = json!(t);
        }
        SseEvent::default().data(v.to_string())
    };
    let (out, out_rx) = mpsc::channel::<SseEvent>(256);
    // Engine events become SSE chunks; when the client is gone, `out`
    // fails and this task ends, closing `rx` in turn.
    tokio::spawn(async move {
        let _guard = guard;
        let tok = &engine.model().tokenizer;
        // Log-probabilities of tokens not yet sent (their text may be held
        // back), and where each choice's next text starts (completions).
        let mut pending: Vec<Vec<TokenLogprob>> = vec![Vec::new(); n];
        let mut offsets = vec![0usize; n];
        // With tools: each choice's text that may open a call, or is one.
        let mut holds: Vec<ToolStream> = match &syntax {
            Some(t) => vec![ToolStream::new(t.clone()); n],
            None => Vec::new(),
        };
        let mut choice = |index: usize,
                          text: Option<&str>,
                          reason: Option<&str>,
                          lps: Vec<TokenLogprob>| {
            let logprobs = match endpoint {
                _ if !want_logprobs => Value::Null,
                Endpoint::Chat => logprobs::chat(tok, &lps),
                Endpoint::Completions => {
                    let v = logprobs::completion(tok, &lps, offsets[index]);
                    offsets[index] = logprobs::end_offset(tok, &lps, offsets[index]);
                    v
                }
            };
            match endpoint {
                Endpoint::Chat => {
                    let delta = match text {
                        Some(t) => json!({"content": t}),
                        None => json!({}),
                    };
                    json!([{"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}])
                }
                Endpoint::Completions => json!([{
                    "index": index,
                    "text": text.unwrap_or(""),
                    "finish_reason": reason,
                    "logprobs": logprobs,
                }]),
            }
        };
        if endpoint == Endpoint::Chat {
            for i in 0..n {
                let first = json!([{
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "finish_reason": null,
                    "logprobs": null,
                }]);
                if out.send(chunk(first, None)).await.is_err() {
                    return;
                }
            }
        }
        let mut done = Vec::with_capacity(n);
        loop {
            // A client gone while nothing is sent (its request queued, or
            // a long prefill) ends the task too, and so the request.
            let ev = tokio::select! {
                ev = rx.recv() => ev,
                () = out.closed() => return,
            };
            let Some(ev) = ev else { break };
            let sent = match ev {
                Event::Token {
                    index,
                    text,
                    logprob,
                    ..
                } => {
                    pending[index].extend(logprob.map(|l| *l));
                    let text = match holds.get_mut(index) {
                        Some(h) => h.push(&text),
                        None => text,
                    };
                    if text.is_empty() {
                        Ok(())
                    } else {
                        let lps = std::mem::take(&mut pending[index]);
                        out.send(chunk(choice(index, Some(&text), None, lps), None))
                            .await
                    }
                }
                Event::Done(c) => {
                    let lps = std::mem::take(&mut pending[c.index]);
                    let i = c.index;
                    let mut r = Ok(());
                    let end = holds.get_mut(i).map(|h| h.finish(&c.text));
                    let reason = match end {
                        Some(Ok(calls)) => {
                            let mut calls = tool_calls(&calls, &call_id, i);
                            for (k, c) in calls.iter_mut().enumerate() {
                                c["index"] = json!(k);
                            }
                            let delta = json!([{"index": i, "delta": {"tool_calls": calls},
                                "finish_reason": null, "logprobs": null}]);
                            r = out.send(chunk(delta, None)).await;
                            "tool_calls"
                        }
                        rest => {
                            let rest = rest.and_then(Result::err).unwrap_or_default();
                            if !rest.is_empty() {
                                r = out
                                    .send(chunk(choice(i, Some(&rest), None, Vec::new()), None))
                                    .await;
                            }
                            finish(c.finish_reason)
                        }
                    };
                    if r.is_ok() {
                        r = out
                            .send(chunk(choice(i, None, Some(reason), lps), None))
                            .await;
                    }
                    done.push(*c);
                    r
                }
                Event::Error(e) => {
                    let body = ApiError::from(e).body();
                    let _ = out.send(SseEvent::default().data(body.to_string())).await;
                    return;
                }
            };
            if sent.is_err() {
                return;
            }
        }
        let last = (done.len() == n && include_usage).then(|| chunk(json!([]), Some(usage(&done))));
        if let Some(last) = last {
            if out.send(last).await.is_err() {
                return;
            }
        }
        let _ = out.send(SseEvent::default().data("[DONE]")).await;
    });
    let events = futures_util::stream::unfold(out_rx, |mut rx| async move {
        rx.recv().await.map(|e| (Ok::<_, Infallible>(e), rx))
    });
    Ok(Sse::new(events)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(10)))
        .into_response())
}
