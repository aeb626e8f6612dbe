//! [`ChatSession`]: a conversation whose token ids are kept as the model saw
//! and produced them. Each turn's prompt is the previous ids plus the
//! template text of the new turn; generated tokens are spliced back as ids,
//! never re-tokenized from text, so the next prompt shares the exact token
//! prefix with what the cache holds.

use tessera_model::{Message, Special};

use crate::engine::{
    Completion, ContextShift, Engine, FinishReason, GenerateRequest, Prompt, TokenEvent,
};
use crate::sampler::SamplingParams;
use crate::Result;

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

/// A conversation: its messages and the exact token ids of its history.
#[derive(Debug, Clone, Default)]
pub struct ChatSession {
    messages: Vec<Message>,
    /// Prompt and generated ids of every turn so far, in order.
    ids: Vec<u32>,
    /// The text `ids` stand for (the rendered history up to the last token);
    /// `None` when they no longer agree and the next turn must re-encode.
    covered: Option<String>,
    /// Tokens of the system part, kept by a context shift.
    n_keep: usize,
}

impl ChatSession {
    pub fn new(system: Option<&str>) -> ChatSession {
        let messages = system
            .map(|s| vec![Message::new("system", s)])
            .unwrap_or_default();
        ChatSession {
            messages,
            ..ChatSession::default()
        }
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
        *self = ChatSession::new(system.as_deref());
    }

    /// Starts over with a new system prompt.
    pub fn set_system(&mut self, system: &str) {
        *self = ChatSession::new(Some(system));
    }
}

impl Engine {
    /// A new conversation.
    pub fn chat(&self, system: Option<&str>) -> ChatSession {
        ChatSession::new(system)
    }

    /// Runs one turn: `user` speaks, the assistant answers.
    pub fn chat_turn(
        &mut self,
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
        let prompt = match covered.and_then(|c| full.strip_prefix(c)) {
            // Append-only template and an unbroken history: splice.
            Some(suffix) => {
                let mut ids = session.ids.clone();
                ids.extend(encode_turn_suffix(tok, suffix, user)?);
                ids
            }
            _ => template.encode(tok, &msgs, true)?,
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
        let done = self.generate(&req, on_token)?;
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

/// Tokens of the new text of a turn: template text with control tokens
/// parsed, the user's content as plain text.
fn encode_turn_suffix(
    tok: &tessera_model::Tokenizer,
    suffix: &str,
    user: &str,
) -> Result<Vec<u32>> {
    let Some(at) = (!user.is_empty()).then(|| suffix.rfind(user)).flatten() else {
        return Ok(tok.encode(suffix, Special::Parse, false)?);
    };
    let mut ids = tok.encode(&suffix[..at], Special::Parse, false)?;
    ids.extend(tok.encode(user, Special::AsText, false)?);
    ids.extend(tok.encode(&suffix[at + user.len()..], Special::Parse, false)?);
    Ok(ids)
}
