//! `GET /openapi.json`: the server's endpoints as an OpenAPI 3.1 document,
//! so clients and gateways can discover what it serves.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use crate::Server;

/// Every route the server answers, with its method: the document lists
/// exactly these (a test checks each against the running server).
pub const ROUTES: &[(&str, &str)] = &[
    ("post", "/v1/chat/completions"),
    ("post", "/v1/completions"),
    ("get", "/v1/models"),
    ("get", "/health"),
    ("get", "/metrics"),
    ("get", "/openapi.json"),
    ("post", "/tokenize"),
    ("post", "/detokenize"),
    ("post", "/v1/sessions/{name}/save"),
    ("post", "/v1/sessions/{name}/restore"),
];

fn summary(path: &str) -> (&'static str, Option<&'static str>) {
    match path {
        "/v1/chat/completions" => (
            "Chat completion, streamed (SSE) or not",
            Some("ChatRequest"),
        ),
        "/v1/completions" => (
            "Text completion of a prompt (text or token ids)",
            Some("CompletionRequest"),
        ),
        "/v1/models" => ("The model this server serves", None),
        "/health" => ("200 once the model has loaded, 503 before", None),
        "/metrics" => ("Prometheus metrics (vLLM's names)", None),
        "/openapi.json" => ("This document", None),
        "/tokenize" => ("Token ids of a text", Some("TokenizeRequest")),
        "/detokenize" => ("Text of token ids", Some("DetokenizeRequest")),
        "/v1/sessions/{name}/save" => (
            "Write a conversation's K/V to the session directory",
            Some("SessionSaveRequest"),
        ),
        "/v1/sessions/{name}/restore" => (
            "Load a saved session into the prefix cache, all or nothing",
            None,
        ),
        _ => ("", None),
    }
}

fn common() -> Value {
    json!({
        "model": {"type": "string"},
        "max_tokens": {"type": "integer", "minimum": 0},
        "max_completion_tokens": {"type": "integer", "minimum": 0},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "seed": {"type": "integer", "minimum": 0},
        "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "n": {"type": "integer", "minimum": 1},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "repeat_penalty": {"type": "number", "exclusiveMinimum": 0},
        "logit_bias": {"type": "object", "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        "cache_prompt": {"type": "boolean", "description": "false: compute the whole prompt (default true)"},
        "cache_salt": {"type": "string", "description": "only requests with the same salt share cached K/V"},
        "user": {"type": "string"},
        "n_keep": {"type": "integer", "minimum": 0, "description": "context shift at the limit, keeping this many first tokens"},
        "ignore_eos": {"type": "boolean"},
    })
}

fn with(mut base: Value, extra: Value) -> Value {
    if let (Some(b), Some(e)) = (base.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    base
}

pub(crate) async fn document(State(s): State<Arc<Server>>) -> Json<Value> {
    let mut paths = serde_json::Map::new();
    for &(method, path) in ROUTES {
        let (text, body) = summary(path);
        let mut op = json!({"summary": text, "responses": {"200": {"description": "OK"}}});
        if let Some(schema) = body {
            op["requestBody"] = json!({"required": true, "content": {"application/json": {
                "schema": {"$ref": format!("#/components/schemas/{schema}")}}}});
        }
        if path.contains("{name}") {
            op["parameters"] = json!([{"name": "name", "in": "path", "required": true,
                "schema": {"type": "string", "pattern": "^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$"}}]);
        }
        let entry = paths.entry(path.to_string()).or_insert_with(|| json!({}));
        entry[method] = op;
    }
    let message = json!({"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string"},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}}});
    Json(json!({
        "openapi": "3.1.0",
        "info": {"title": "Tessera", "version": env!("CARGO_PKG_VERSION"),
                 "description": format!("OpenAI-compatible server for `{}`", s.cfg.model_name)},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "ChatRequest": {"type": "object", "required": ["messages"], "properties": with(common(), json!({
                    "messages": {"type": "array", "items": message},
                    "logprobs": {"type": "boolean"},
                    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20}}))},
                "CompletionRequest": {"type": "object", "required": ["prompt"], "properties": with(common(), json!({
                    "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}},
                                         {"type": "array", "items": {"type": "string"}, "maxItems": 1}]},
                    "logprobs": {"type": "integer", "minimum": 0, "maximum": 20}}))},
                "TokenizeRequest": {"type": "object", "required": ["content"], "properties": {
                    "content": {"type": "string"}, "add_special": {"type": "boolean"},
                    "parse_special": {"type": "boolean"}}},
                "DetokenizeRequest": {"type": "object", "required": ["tokens"], "properties": {
                    "tokens": {"type": "array", "items": {"type": "integer"}}}},
                "SessionSaveRequest": {"type": "object", "properties": {
                    "messages": {"type": "array", "items": message},
                    "tokens": {"type": "array", "items": {"type": "integer"}}}},
            },
        },
        "security": if s.cfg.api_keys.is_empty() { json!([]) } else { json!([{"bearer": []}]) },
        "paths": paths,
    }))
}
