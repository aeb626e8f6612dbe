//! Sessions over HTTP, llama-server's slot save/restore made safe: a
//! session is the K/V of one conversation in a file under `--session-dir`,
//! named by the client (checked: no path can leave the directory).
//! Restoring puts it into the shared prefix tree, all or nothing, so the
//! conversation's next request computes only its new tokens, whichever
//! request sends it.

use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};
use tessera_engine::{EngineError, Message, Prompt};

use crate::api::{ApiError, SessionSaveRequest};
use crate::{blocking, message_text, rejected, Server};

/// The file of session `name`: letters, digits, `-`, `_` and `.`, at most
/// 128 bytes, not starting with a dot.
fn session_path(s: &Server, name: &str) -> Result<PathBuf, ApiError> {
    let dir = s.cfg.session_dir.as_ref().ok_or_else(|| ApiError {
        status: StatusCode::NOT_FOUND,
        code: Some("sessions_disabled"),
        ..ApiError::bad("sessions are off: start the server with --session-dir DIR")
    })?;
    let ok = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if !ok {
        return Err(ApiError::param(
            "name",
            format!(
                "invalid session name `{name}`: use 1 to 128 letters, digits, '-', '_' or '.', not starting with '.'"
            ),
        ));
    }
    Ok(dir.join(format!("{name}.tkv")))
}

/// A session file the engine refused, as the client's error.
fn session_error(name: &str, e: EngineError) -> ApiError {
    match e {
        EngineError::Snapshot { reason, .. } => ApiError {
            code: Some("invalid_session"),
            ..ApiError::bad(format!("session `{name}` cannot be used: {reason}"))
        },
        other => other.into(),
    }
}

/// `POST /v1/sessions/{name}/save` with `messages` (rendered as the chat
/// endpoint renders them) or `tokens`: their K/V (computed now for what
/// the cache lacks) is written to the session's file.
pub(crate) async fn save(
    State(s): State<Arc<Server>>,
    Path(name): Path<String>,
    body: Result<Json<SessionSaveRequest>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let path = session_path(&s, &name)?;
    let Json(req) = body.map_err(rejected)?;
    let prompt = match (req.messages, req.tokens) {
        (Some(msgs), None) if !msgs.is_empty() => {
            let mut out = Vec::with_capacity(msgs.len());
            for m in msgs {
                out.push(Message::new(m.role, message_text(m.content)?));
            }
            Prompt::Chat(out)
        }
        (None, Some(ids)) if !ids.is_empty() => Prompt::Tokens(ids),
        _ => {
            return Err(ApiError::bad(
                "send either `messages` or `tokens` (one of them, not empty)",
            ))
        }
    };
    let engine = s.engine()?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| {
            ApiError::server(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("cannot create the session directory: {e}"),
            )
        })?;
    }
    let n = blocking("session", move || {
        let ids = engine.tokenize_prompt(&prompt)?;
        if ids.len() > engine.context_length() {
            return Err(EngineError::PromptTooLong {
                tokens: ids.len(),
                context: engine.context_length(),
            }
            .into());
        }
        // Token ids outside the vocabulary are refused by the engine.
        engine.save_kv_session(&path, &ids).map_err(|e| match e {
            EngineError::Invalid(why) => ApiError::param("tokens", why),
            other => other.into(),
        })
    })
    .await?;
    Ok(Json(json!({"name": name, "tokens": n})))
}

/// `POST /v1/sessions/{name}/restore`: the session's K/V goes into the
/// prefix cache, validated first, all or nothing.
pub(crate) async fn restore(
    State(s): State<Arc<Server>>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let path = session_path(&s, &name)?;
    if !path.is_file() {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            code: Some("session_not_found"),
            ..ApiError::bad(format!("no session named `{name}`"))
        });
    }
    let engine = s.engine()?;
    let n2 = name.clone();
    let n = blocking("session", move || {
        engine
            .load_kv_session(&path)
            .map_err(|e| session_error(&n2, e))
    })
    .await?;
    Ok(Json(json!({"name": name, "restored_tokens": n})))
}
