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
use crate::snapshot::{read_file, write_file};
use crate::types::{Completion, ContextShift, FinishReason, GenerateRequest, Prompt, TokenEvent};
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

// ---- the engine's chat calls ----------------------------------------------

impl Engine {
    /// A new conversation.
    pub fn chat(&self, system: Option<&str>) -> ChatSession {
        ChatSession::new(self, system)
    }

    /// Resumes a conversation saved by [`ChatSession::save`]: its K/V goes
    /// into the prefix cache, so the next turn computes only its new
    /// tokens. A file that is truncated, corrupted, of another format
    /// version or of another model is refused with the reason, and the
    /// engine is left as it was.
    pub fn load_session(&self, path: &Path) -> Result<ChatSession> {
        let (snaps, meta) = read_file(path, "chat session", &self.geometry())?;
        let meta: SessionMeta =
            serde_json::from_value(meta).map_err(|e| EngineError::Snapshot {
                path: path.to_path_buf(),
                reason: format!("corrupted session metadata: {e}"),
            })?;
        let ids = snaps.first().map(|s| s.tokens.clone()).unwrap_or_default();
        self.import_kv(snaps)?;
        Ok(ChatSession {
            engine: self.clone(),
            messages: meta
                .messages
                .into_iter()
                .map(|(role, content)| Message::new(&role, content))
                .collect(),
            ids,
            covered: meta.covered,
            n_keep: meta.n_keep,
        })
    }

    /// Runs one turn of `session`: `user` speaks, the assistant answers.
    pub fn chat_turn(
        &self,
        session: &mut ChatSession,
        user: &str,
        opts: &TurnOptions,
        on_token: &mut dyn FnMut(TokenEvent),
    ) -> Result<Completion> {
        let model = self.model();
        let (tok, template) = (&model.tokenizer, &model.template);
        let mut msgs = session.messages.clone();
        msgs.push(Message::new("user", user));
        let full = template.render(&msgs, true)?;
        let covered = session
            .covered
            .as_deref()
            .filter(|_| !session.ids.is_empty());
        let spliced = match covered.and_then(|c| full.strip_prefix(c)) {
            // Append-only template and an unbroken history: splice.
            Some(suffix) => encode_turn_suffix(tok, suffix, user)?.map(|new| {
                let mut ids = session.ids.clone();
                ids.extend(new);
                ids
            }),
            None => None,
        };
        let prompt = match spliced {
            Some(ids) => ids,
            None => template.encode(tok, &msgs, true)?,
        };
        if session.ids.is_empty() && session.system().is_some() {
            session.n_keep = template.encode(tok, &msgs[..1], false)?.len();
        }
        let whole = prompt.len();
        let prompt = self.fit_context(prompt, session.n_keep);
        let cut = prompt.len() != whole;
        let req = GenerateRequest {
            sampling: opts.sampling.clone(),
            max_tokens: opts.max_tokens,
            stop: opts.stop.clone(),
            context_shift: if opts.context_shift {
                ContextShift::Keep(session.n_keep)
            } else {
                ContextShift::Off
            },
            ..GenerateRequest::new(Prompt::Tokens(prompt))
        };
        let done = self.complete(&req, on_token)?;
        let tok = &self.model().tokenizer;
        session.messages.push(Message::new("user", user));
        session
            .messages
            .push(Message::new("assistant", done.text.clone()));
        session.ids = done
            .prompt_tokens
            .iter()
            .chain(&done.tokens)
            .copied()
            .collect();
        // A prompt cut to fit the context, or a reply cut at a stop string
        // (the message holds the text before it, the ids the stop string
        // too), leaves ids and text disagreeing: the next turn re-encodes.
        session.covered = if cut || done.finish_reason == FinishReason::StopString {
            None
        } else {
            Some(full + &tok.decode(&done.tokens)?)
        };
        Ok(done)
    }

    /// Drops history after the first `n_keep` tokens until the prompt fits
    /// in the context with room to answer (a quarter of the context).
    fn fit_context(&self, mut ids: Vec<u32>, n_keep: usize) -> Vec<u32> {
        let ctx = self.context_length();
        let budget = ctx - ctx / 4;
        if ids.len() > budget && n_keep < budget {
            let drop = ids.len() - budget;
            ids.drain(n_keep..n_keep + drop);
        }
        ids
    }
}
