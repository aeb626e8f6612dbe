//! Chat templates: the model's Jinja template (GGUF
//! `tokenizer.chat_template` or `tokenizer_config.json`) rendered with
//! minijinja the way Hugging Face renders it (`messages`,
//! `add_generation_prompt`, `bos_token`, `eos_token`), ChatML when a model
//! has none.
//!
//! [`ChatTemplate::encode`] parses control tokens only in the template's own
//! text: message contents are tokenized as plain text, so a user who types
//! `<|im_start|>` cannot forge a turn.

use minijinja::{context, Environment, Error, ErrorKind};
use serde::Serialize;

use crate::tokenizer::{Special, Tokenizer};
use crate::{ModelError, Result};

/// ChatML, for models without a template of their own.
pub const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
    source: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .finish()
    }
}

/// Marks message `i` in a probe rendering; private-use characters that no
/// template touches.
fn sentinel(i: usize) -> String {
    format!("\u{F8FF}{i}\u{F8FE}")
}

impl ChatTemplate {
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| ModelError::Template(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            bos: bos.into(),
            eos: eos.into(),
            source: source.into(),
        })
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// The prompt text for `messages`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| ModelError::Template(e.to_string()))?;
        t.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos,
            eos_token => self.eos,
        })
        .map_err(|e| ModelError::Template(e.to_string()))
    }

    /// Token ids of the rendered prompt, control tokens parsed only in the
    /// template's own text.
    pub fn encode(
        &self,
        tok: &Tokenizer,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let real = self.render(messages, add_generation_prompt)?;
        let marked: Vec<Message> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| Message::new(m.role.clone(), sentinel(i)))
            .collect();
        let probe = self.render(&marked, add_generation_prompt)?;
        // Split the probe into template text and message slots.
        let mut parts: Vec<(bool, &str)> = Vec::new();
        let mut rest = probe.as_str();
        while let Some(start) = rest.find('\u{F8FF}') {
            let Some(len) = rest[start..].find('\u{F8FE}') else {
                break;
            };
            let idx: Option<usize> = rest[start + '\u{F8FF}'.len_utf8()..start + len]
                .parse()
                .ok();
            let Some(m) = idx.and_then(|i| messages.get(i)) else {
                break;
            };
            parts.push((true, &rest[..start]));
            parts.push((false, m.content.as_str()));
            rest = &rest[start + len + '\u{F8FE}'.len_utf8()..];
        }
        parts.push((true, rest));
        let joined: String = parts.iter().map(|(_, s)| *s).collect();
        if joined != real {
            // The template transformed the contents (trim, escape…): fall
            // back to parsing the whole text.
            return tok.encode(&real, Special::Parse, false);
        }
        let mut ids = Vec::new();
        for (is_template, text) in parts {
            if text.is_empty() {
                continue;
            }
            let special = if is_template {
                Special::Parse
            } else {
                Special::AsText
            };
            ids.extend(tok.encode(text, special, false)?);
        }
        Ok(ids)
    }
}
