//! `GET /openapi.json`: the server's endpoints as an OpenAPI 3.1 document,
//! so clients and gateways can discover what it serves. `utoipa` derives
//! it: each handler carries its `#[utoipa::path]` and each request type its
//! `ToSchema`, so the document follows the code (a test calls every route
//! it lists against the running server).

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::OpenApi as Document;
use utoipa::{Modify, OpenApi};

use crate::Server;

#[derive(OpenApi)]
#[openapi(
    info(title = "Tessera"),
    paths(
        crate::chat,
        crate::completions,
        crate::models,
        crate::health,
        crate::metrics_text,
        document,
        crate::tokenize,
        crate::detokenize,
        crate::sessions::save,
        crate::sessions::restore,
    ),
    modifiers(&Bearer),
)]
struct ApiDoc;

/// The API keys' scheme (required on every route when keys are set; see
/// [`document`]).
struct Bearer;

impl Modify for Bearer {
    fn modify(&self, doc: &mut Document) {
        let scheme = HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build();
        doc.components
            .get_or_insert_with(Default::default)
            .add_security_scheme("bearer", SecurityScheme::Http(scheme));
    }
}

/// The document, as this server is configured: its model's name, and the
/// bearer key required when it has keys.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "operations",
    summary = "This document",
    responses(
        (status = 200, description = "This document"),
    ),
)]
pub(crate) async fn document(State(s): State<Arc<Server>>) -> Json<Document> {
    let mut doc = ApiDoc::openapi();
    doc.info.description = Some(format!(
        "OpenAI-compatible server for `{}`",
        s.cfg.model_name
    ));
    doc.security = Some(if s.cfg.api_keys.is_empty() {
        Vec::new()
    } else {
        vec![SecurityRequirement::new("bearer", Vec::<String>::new())]
    });
    Json(doc)
}
