//! [`ChatSession`]: a conversation whose token ids are kept as the model saw
//! and produced them. Each turn's prompt is the previous ids plus the
//! template text of the new turn; generated tokens are spliced back as ids,
//! never re-tokenized from text, so the next prompt shares the exact token
//! prefix with what the cache holds.

use std::path::Path;

use serde::{Deserialize, Serialize};
use tessera_model::{Message, Special};

use crate::engine::Engine;
use crate::sampler::SamplingParams;
use crate::snapshot::write_file;
use crate::types::{Completion, TokenEvent};
use crate::{EngineError, Result};

/// Per-turn generation settings.
#[derive(Debug, Clone)]
pub struct TurnOptions {
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// Shift the context (keeping the system prompt) instead of stopping at
    /// the context limit.
    pub context_shift: bool,
}

impl Default for TurnOptions {
    fn default() -> Self {
        TurnOptions {
            sampling: SamplingParams::default(),
            max_tokens: 256,
            stop: Vec::new(),
            context_shift: true,
        }
    }
}

/// A conversation on an engine: its messages and the exact token ids of
/// its history.
#[derive(Clone)]
pub struct ChatSession {
    pub(crate) engine: Engine,
    pub(crate) messages: Vec<Message>,
    /// Prompt and generated ids of every turn so far, in order.
    pub(crate) ids: Vec<u32>,
    /// The text `ids` stand for (the rendered history up to the last token);
    /// `None` when they no longer agree and the next turn must re-encode.
    pub(crate) covered: Option<String>,
    /// Tokens of the system part, kept by a context shift.
    pub(crate) n_keep: usize,
}

/// What a session file holds besides the K/V.
#[derive(Serialize, Deserialize)]
pub(crate) struct SessionMeta {
    pub messages: Vec<(String, String)>,
    pub covered: Option<String>,
    pub n_keep: usize,
}

impl ChatSession {
    pub fn new(engine: &Engine, system: Option<&str>) -> ChatSession {
        let messages = system
            .map(|s| vec![Message::new("system", s)])
            .unwrap_or_default();
        ChatSession {
            engine: engine.clone(),
            messages,
            ids: Vec::new(),
            covered: None,
            n_keep: 0,
        }
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// The token ids of the history.
    pub fn token_ids(&self) -> &[u32] {
        &self.ids
    }

    pub fn system(&self) -> Option<&str> {
        self.messages
            .first()
            .filter(|m| m.role == "system")
            .map(|m| m.content.as_str())
    }

    /// Forgets the conversation, keeping the system prompt.
    pub fn clear(&mut self) {
        let system = self.system().map(str::to_string);
        *self = ChatSession::new(&self.engine, system.as_deref());
    }

    /// Starts over with a new system prompt.
    pub fn set_system(&mut self, system: &str) {
        *self = ChatSession::new(&self.engine, Some(system));
    }

    /// Writes the conversation and the K/V of its history to `path`, so
    /// that [`Engine::load_session`] resumes it without recomputing, in
    /// this process or another.
    pub fn save(&self, path: &Path) -> Result<()> {
        let snap = self.engine.export_kv(&self.ids)?;
        let meta = SessionMeta {
            messages: self
                .messages
                .iter()
                .map(|m| (m.role.clone(), m.content.clone()))
                .collect(),
            covered: self.covered.clone(),
            n_keep: self.n_keep,
        };
        let meta = serde_json::to_value(meta).map_err(|e| EngineError::Invalid(e.to_string()))?;
        write_file(path, "chat session", &self.engine.geometry(), &[snap], meta)
    }

    /// Runs one turn: `user` speaks, the assistant answers.
    pub fn send(
        &mut self,
        user: &str,
        opts: &TurnOptions,
        on_token: &mut dyn FnMut(TokenEvent),
    ) -> Result<Completion> {
        let engine = self.engine.clone();
        engine.chat_turn(self, user, opts, on_token)
    }
}

/// Tokens of the new text of a turn: template text with control tokens
/// parsed, the user's content as plain text. `None` when the content does
/// not appear in the text as typed (the template changed it): the caller
/// then encodes the whole conversation, which keeps control tokens to the
/// template's own text whatever it does to messages.
pub(crate) fn encode_turn_suffix(
    tok: &tessera_model::Tokenizer,
    suffix: &str,
    user: &str,
) -> Result<Option<Vec<u32>>> {
    if user.is_empty() {
        return Ok(Some(tok.encode(suffix, Special::Parse, false)?));
    }
    let Some(at) = suffix.rfind(user) else {
        return Ok(None);
    };
    let mut ids = tok.encode(&suffix[..at], Special::Parse, false)?;
    ids.extend(tok.encode(user, Special::AsText, false)?);
    ids.extend(tok.encode(&suffix[at + user.len()..], Special::Parse, false)?);
    Ok(Some(ids))
}
