//! Sessions over HTTP, llama-server's slot save/restore made safe: a
//! session is the K/V of one conversation in a file under `--session-dir`,
//! named by the client (checked: no path can leave the directory).
//! Restoring puts it into the prefix tree, all or nothing, so the
//! conversation's next request computes only its new tokens, whichever
//! request sends it.
//!
//! Sessions live inside the caller's partition (API key and `cache_salt`):
//! each partition has a directory of its own, the save computes and caches
//! K/V in that partition only, and the restore puts it back there. One
//! tenant can neither read, overwrite nor time another's sessions. One
//! writer per file at a time (a second save of the same name is answered
//! 409), every write through a temporary file of its own, flushed and
//! renamed; sizes are bounded by `max_session_tokens` (413) and the
//! directory by `session_quota` (507).

use std::collections::HashSet;
use std::path::{Path as FsPath, PathBuf};
use std::sync::{Arc, Mutex};

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use serde_json::{json, Value};
use tessera_engine::{EngineError, Message, Partition, Prompt};

use crate::api::{ApiError, ErrorBody, SessionRestoreRequest, SessionSaveRequest};
use crate::{blocking, message_text, partition, rejected, Server, Tenant};

/// The saves in flight: the files being written, and the bytes they have
/// reserved against the quota.
#[derive(Default)]
pub(crate) struct Writers {
    state: Mutex<(HashSet<PathBuf>, u64)>,
}

/// One save's claim on its file and its quota reservation, given back when
/// dropped.
struct Claim<'a> {
    writers: &'a Writers,
    path: PathBuf,
    reserved: u64,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        let mut st = self.writers.state.lock().expect("not poisoned");
        st.0.remove(&self.path);
        st.1 -= self.reserved;
    }
}

/// Removes the temporary files that writers killed mid-write left in the
/// session directory and its partitions' directories; returns how many.
pub(crate) fn clean(dir: &FsPath) -> usize {
    let mut n = tessera_engine::clean_temporaries(dir);
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                n += tessera_engine::clean_temporaries(&e.path());
            }
        }
    }
    n
}

/// Bytes of the session files under `dir` (its partitions' directories
/// included).
fn used_bytes(dir: &FsPath) -> u64 {
    let mut total = 0;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    for e in entries.flatten() {
        let Ok(meta) = e.metadata() else { continue };
        if meta.is_dir() {
            total += used_bytes(&e.path());
        } else {
            total += meta.len();
        }
    }
    total
}

/// The directory of a partition's sessions: the session directory itself
/// for the default partition, else a subdirectory named by a digest of
/// the partition (so neither a key nor a salt appears on disk).
fn partition_dir(root: &FsPath, p: &Partition) -> PathBuf {
    use sha2::Digest;
    if p.is_default() {
        return root.to_path_buf();
    }
    let id = serde_json::to_vec(p).expect("a partition serializes");
    let d = sha2::Sha256::digest(&id);
    let hex: String = d[..16].iter().map(|b| format!("{b:02x}")).collect();
    root.join(format!("p-{hex}"))
}

/// The file of session `name` in partition `p`: letters, digits, `-`, `_`
/// and `.`, at most 128 bytes, not starting with a dot.
fn session_path(s: &Server, p: &Partition, name: &str) -> Result<PathBuf, ApiError> {
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
    Ok(partition_dir(dir, p).join(format!("{name}.tkv")))
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
/// endpoint renders them) or `tokens`, and optionally `cache_salt`: their
/// K/V (computed now, in the background beside other requests, for what
/// the partition's cache lacks) is written to the session's file.
#[utoipa::path(
    post,
    path = "/v1/sessions/{name}/save",
    tag = "sessions",
    summary = "Write a conversation's K/V to the session directory",
    params(("name" = String, Path, description = "1 to 128 letters, digits, '-', '_' or '.', not starting with '.'", pattern = "^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")),
    request_body = SessionSaveRequest,
    responses(
        (status = 200, description = "The conversation's K/V is written to the session directory"),
        (status = 400, description = "The request is invalid", body = ErrorBody),
        (status = 404, description = "Sessions are off", body = ErrorBody),
    ),
)]
pub(crate) async fn save(
    State(s): State<Arc<Server>>,
    Extension(tenant): Extension<Tenant>,
    Path(name): Path<String>,
    body: Result<Json<SessionSaveRequest>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let Json(req) = body.map_err(rejected)?;
    let part = partition(&s, &tenant, req.cache_salt.as_deref())?;
    let path = session_path(&s, &part, &name)?;
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
    let server = s.clone();
    let n2 = name.clone();
    let (n, cached) = blocking("session", move || {
        let ids = engine.tokenize_prompt(&prompt)?;
        let most = server
            .cfg
            .max_session_tokens
            .unwrap_or(usize::MAX)
            .min(engine.context_length());
        if ids.len() > most {
            return Err(ApiError {
                status: StatusCode::PAYLOAD_TOO_LARGE,
                code: Some("session_too_large"),
                ..ApiError::bad(format!(
                    "the session has {} tokens; this server keeps sessions of at most {most} (--max-session-tokens, the context length)",
                    ids.len()
                ))
            });
        }
        let _claim = claim(&server, &path, &n2, engine.session_bytes(ids.len()) as u64)?;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| {
                ApiError::server(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("cannot create the session directory: {e}"),
                )
            })?;
        }
        // Token ids outside the vocabulary are refused by the engine.
        let saved = engine
            .save_kv_session_in(&part, &path, &ids)
            .map_err(|e| match e {
                EngineError::Invalid(why) => ApiError::param("tokens", why),
                other => other.into(),
            })?;
        Ok((saved.tokens, saved.cached))
    })
    .await?;
    Ok(Json(
        json!({"name": name, "tokens": n, "cached_tokens": cached}),
    ))
}

/// Claims `path` for one save of `bytes`: 409 while another save writes
/// it, 507 when the files already there (less the one replaced) and the
/// saves in flight leave less than `bytes` of the quota.
fn claim<'a>(s: &'a Server, path: &FsPath, name: &str, bytes: u64) -> Result<Claim<'a>, ApiError> {
    let writers = &s.sessions;
    let mut st = writers.state.lock().expect("not poisoned");
    if st.0.contains(path) {
        return Err(ApiError {
            status: StatusCode::CONFLICT,
            code: Some("session_busy"),
            ..ApiError::bad(format!(
                "session `{name}` is being saved by another request: retry when it is done"
            ))
        });
    }
    if let (Some(quota), Some(root)) = (s.cfg.session_quota, &s.cfg.session_dir) {
        let replaced = std::fs::metadata(path).map_or(0, |m| m.len());
        let used = used_bytes(root).saturating_sub(replaced) + st.1;
        if used.saturating_add(bytes) > quota {
            return Err(ApiError {
                status: StatusCode::INSUFFICIENT_STORAGE,
                code: Some("session_quota_exceeded"),
                ..ApiError::server(
                    StatusCode::INSUFFICIENT_STORAGE,
                    format!(
                        "saving `{name}` needs about {bytes} bytes; sessions use {used} of the {quota} this server allows (--session-quota)"
                    ),
                )
            });
        }
    }
    st.0.insert(path.to_path_buf());
    st.1 += bytes;
    Ok(Claim {
        writers,
        path: path.to_path_buf(),
        reserved: bytes,
    })
}

/// `POST /v1/sessions/{name}/restore`, optionally with `cache_salt`: the
/// session's K/V goes into the partition's prefix cache, validated first,
/// all or nothing.
#[utoipa::path(
    post,
    path = "/v1/sessions/{name}/restore",
    tag = "sessions",
    summary = "Load a saved session into the prefix cache, all or nothing",
    params(("name" = String, Path, description = "1 to 128 letters, digits, '-', '_' or '.', not starting with '.'", pattern = "^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")),
    request_body(content = SessionRestoreRequest, description = "Optional"),
    responses(
        (status = 200, description = "The session is in the prefix cache, all of it"),
        (status = 400, description = "The request or the file is invalid", body = ErrorBody),
        (status = 404, description = "No such session, or sessions are off", body = ErrorBody),
    ),
)]
pub(crate) async fn restore(
    State(s): State<Arc<Server>>,
    Extension(tenant): Extension<Tenant>,
    Path(name): Path<String>,
    body: axum::body::Bytes,
) -> Result<Json<Value>, ApiError> {
    let req: SessionRestoreRequest = if body.iter().all(u8::is_ascii_whitespace) {
        SessionRestoreRequest::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::bad(format!("malformed request body: {e}")))?
    };
    let part = partition(&s, &tenant, req.cache_salt.as_deref())?;
    let path = session_path(&s, &part, &name)?;
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
            .load_kv_session_in(&part, &path)
            .map_err(|e| session_error(&n2, e))
    })
    .await?;
    Ok(Json(json!({"name": name, "restored_tokens": n})))
}
