//! Structured output: a request's constraint (any JSON object, a JSON
//! schema, a Lark grammar, a regular expression) compiled by llguidance over
//! the model's own vocabulary into a matcher that allows, at each step, only
//! the tokens that keep the output inside the constraint. A bad constraint
//! is refused when the request is made, never run unconstrained.

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use tessera_model::{Model, Special, Tokenizer};
use toktrie::{SimpleVob, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::error::{EngineError, Result};

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// Any JSON object (OpenAI's `response_format: json_object`).
    JsonObject,
    /// JSON valid against this schema (`json_schema`), as llguidance
    /// supports JSON Schema (its documentation lists the keywords).
    JsonSchema(Value),
    /// A grammar in llguidance's Lark dialect (GBNF is converted first, see
    /// [`gbnf_to_lark`]).
    Lark(String),
    /// A regular expression the whole output matches (Rust `regex` syntax).
    Regex(String),
    /// Free output until `trigger` appears in it (its text, or the control
    /// token `token` sampled), then `then` from the trigger on: `then`
    /// begins with the trigger (llama.cpp's lazy grammars). Tool calls
    /// under `tool_choice: auto`: the answer is free until it opens a
    /// call, and the call then parses. Where what follows the trigger in
    /// the same token does not fit `then`, the output stays free.
    After {
        trigger: String,
        token: Option<u32>,
        then: Box<Constraint>,
    },
}

/// Whitespace allowed between two JSON tokens: pretty-printing fits, and
/// a model cannot loop on it forever (llguidance's default allows any
/// run: a base model answered `{` and 400 newlines). A schema's own
/// `x-guidance` options replace this.
const JSON_WHITESPACE: &str = r"[\x20\x0A\x0D\x09]{1,24}";

/// `schema` with [`JSON_WHITESPACE`] between its tokens, unless it sets its
/// own `x-guidance` options (also for JSON inside grammars: `%json`).
pub(crate) fn bound_json_whitespace(schema: &mut Value) {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_pattern": JSON_WHITESPACE}));
    }
}

fn json_grammar(schema: &Value) -> TopLevelGrammar {
    let mut schema = schema.clone();
    bound_json_whitespace(&mut schema);
    TopLevelGrammar::from_json_schema(schema)
}

impl Constraint {
    /// A JSON schema's constraint (`{}`: any JSON object, as llama.cpp's
    /// `--json-schema '{}'`).
    pub fn json_schema(schema: Value) -> Constraint {
        if schema.as_object().is_some_and(|o| o.is_empty()) {
            Constraint::JsonObject
        } else {
            Constraint::JsonSchema(schema)
        }
    }

    /// A grammar's constraint: GBNF (converted) or llguidance's Lark.
    pub fn grammar_text(grammar: &str) -> Constraint {
        Constraint::Lark(gbnf_to_lark(grammar))
    }

    fn grammar(&self) -> TopLevelGrammar {
        match self {
            Constraint::JsonObject => json_grammar(&serde_json::json!({"type": "object"})),
            Constraint::JsonSchema(s) => json_grammar(s),
            Constraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
            Constraint::Regex(r) => TopLevelGrammar::from_regex(r),
            Constraint::After { then, .. } => then.grammar(),
        }
    }
}

/// The model's vocabulary as llguidance reads it: every token's bytes (a
/// control token's text behind llguidance's 0xFF marker, so no grammar
/// produces one by spelling it), and the ids that end generation.
struct TokEnv {
    trie: TokTrie,
    model: Arc<Model>,
}

impl TokenizerEnv for TokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.tokenize(s, Special::AsText)
    }

    fn tokenize_bytes_special(&self, s: &[u8]) -> Vec<TokenId> {
        self.tokenize(s, Special::Parse)
    }
}

impl TokEnv {
    fn tokenize(&self, s: &[u8], special: Special) -> Vec<TokenId> {
        let tok = &self.model.tokenizer;
        self.trie
            .tokenize_with_greedy_fallback(s, |s| tok.encode(s, special, false).unwrap_or_default())
    }
}

/// Compiles constraints for one model; the vocabulary's trie is built the
/// first time a request asks for one (tens of milliseconds on a large
/// vocabulary) and shared by every later one. Nothing is built or copied
/// for an engine that never sees a constraint.
#[derive(Default)]
pub(crate) struct Grammars {
    factory: OnceLock<std::result::Result<Arc<ParserFactory>, String>>,
}

impl Grammars {
    fn factory(&self, model: &Arc<Model>) -> Result<&Arc<ParserFactory>> {
        self.factory
            .get_or_init(|| guarded(|| build_factory(model)))
            .as_ref()
            .map_err(|e| EngineError::Invalid(format!("structured output: {e}")))
    }

    /// A fresh matcher for `c` over `model`'s vocabulary (always the same
    /// model: the engine's), or why `c` cannot be used.
    pub(crate) fn compile(&self, model: &Arc<Model>, c: &Constraint) -> Result<Matcher> {
        let factory = self.factory(model)?;
        let parser = guarded(|| factory.create_parser(c.grammar()))
            .map_err(|e| EngineError::Invalid(format!("bad constraint: {e}")))?;
        let m = Matcher::new(Ok(parser));
        match m.get_error() {
            Some(e) => Err(EngineError::Invalid(format!("bad constraint: {e}"))),
            None => Ok(m),
        }
    }
}

fn build_factory(model: &Arc<Model>) -> std::result::Result<Arc<ParserFactory>, String> {
    let tok: &Tokenizer = &model.tokenizer;
    // Logit rows cover this many ids (at least the tokenizer's).
    let vocab = model.config().vocab_size;
    let eog = tok.eog_ids().to_vec();
    let Some(&eos) = eog.first() else {
        return Err("the model has no end-of-generation token".into());
    };
    let control: std::collections::HashSet<String> = tok.control_texts().into_iter().collect();
    let n = vocab.max(tok.vocab_size());
    let words: Vec<Vec<u8>> = (0..n as u32)
        .map(|id| {
            if id as usize >= tok.vocab_size() {
                return Vec::new();
            }
            match tok.id_to_token(id) {
                Some(text) if control.contains(&text) || eog.contains(&id) => {
                    let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    b.extend_from_slice(text.as_bytes());
                    b
                }
                _ => tok.token_bytes(id),
            }
        })
        .collect();
    let info = TokRxInfo::new(n as u32, eos);
    let trie = TokTrie::from(&info, &words).with_eos_tokens(&eog);
    let env = TokEnv {
        trie,
        model: model.clone(),
    };
    let mut factory = ParserFactory::new_simple(&(Arc::new(env) as toktrie::TokEnv))
        .map_err(|e| e.to_string())?;
    factory.quiet();
    Ok(Arc::new(factory))
}

/// One sample's constraint: its matcher and the mask for its next token
/// (computed beside the forward that makes that token's logits).
pub(crate) struct Guide {
    /// Boxed: a matcher is over a kilobyte, and guides move with requests.
    matcher: Box<Matcher>,
    /// The next token's mask, or why it could not be computed.
    mask: Option<std::result::Result<SimpleVob, String>>,
    /// A lazy constraint's trigger ([`Constraint::After`]) while it has not
    /// appeared: the output is free until then.
    waiting: Option<(String, Option<u32>)>,
}

/// Runs a matcher call, a panic in it becoming an error (the sample then
/// fails; it never goes on unconstrained).
fn guarded<T, E: std::fmt::Display>(
    f: impl FnOnce() -> std::result::Result<T, E>,
) -> std::result::Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err("the grammar engine failed".into()),
    }
}

impl Guide {
    /// The guide of `c`, compiled into `matcher` (a lazy constraint's
    /// waits for its trigger).
    pub(crate) fn new(matcher: Matcher, c: &Constraint) -> Guide {
        Guide {
            matcher: Box::new(matcher),
            mask: None,
            waiting: match c {
                Constraint::After { trigger, token, .. } => Some((trigger.clone(), *token)),
                _ => None,
            },
        }
    }

    /// A copy for another sample of the same request, at the same point.
    pub(crate) fn fork(&self) -> Guide {
        Guide {
            matcher: Box::new(self.matcher.deep_clone()),
            mask: self.mask.clone(),
            waiting: self.waiting.clone(),
        }
    }

    /// Whether it constrains the next token (a lazy one only once its
    /// trigger has appeared).
    pub(crate) fn active(&self) -> bool {
        self.waiting.is_none()
    }

    /// A waiting guide after token `t` made `text` (the sample's output
    /// text; its first `before` bytes were there before `t`): where the
    /// trigger begins when `t` completed it (its control token, or its
    /// text ending in `t`'s piece), else `None`.
    pub(crate) fn triggered(&self, t: u32, text: &str, before: usize) -> Option<Trigger> {
        let (trigger, token) = self.waiting.as_ref()?;
        if *token == Some(t) {
            return Some(Trigger::Token(t));
        }
        // The trigger must end inside the new piece.
        let mut from = before.saturating_sub(trigger.len().saturating_sub(1));
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        text[from..]
            .find(trigger.as_str())
            .map(|at| Trigger::Text(from + at))
    }

    /// Starts constraining from a trigger: the matcher takes `tokens` (the
    /// trigger's control token, or the text from the trigger to the end of
    /// the output, tokenized); `false`, the guide unchanged, when they do
    /// not fit the constraint (the output then stays free).
    pub(crate) fn wake(&mut self, tokens: &[u32]) -> bool {
        let mut m = self.matcher.deep_clone();
        let fits = guarded(|| m.consume_tokens(tokens)).is_ok() && m.get_error().is_none();
        if fits {
            *self.matcher = m;
            self.waiting = None;
            self.mask = None;
        }
        fits
    }

    /// Whether the constraint is complete and allows nothing more.
    pub(crate) fn done(&self) -> bool {
        self.active() && self.matcher.is_stopped()
    }

    /// Computes the next token's mask now, unless it is ready (nothing
    /// while a lazy guide waits).
    pub(crate) fn prepare(&mut self) {
        if self.active() && self.mask.is_none() && !self.matcher.is_stopped() {
            let m = &mut self.matcher;
            self.mask = Some(guarded(|| m.compute_mask()));
        }
    }

    /// `logits` with every token the constraint forbids at this point set
    /// to −∞.
    pub(crate) fn masked(&mut self, logits: &[f32]) -> Result<Vec<f32>> {
        let m = &mut self.matcher;
        let mask = match self.mask.take() {
            Some(r) => r,
            None => guarded(|| m.compute_mask()),
        }
        .map_err(|e| guide_err(&e))?;
        if mask.is_zero() {
            return Err(EngineError::Invalid(
                "structured output: no token can continue the constrained output".into(),
            ));
        }
        // Word by word: most words of a mask are all set or all clear.
        let mut out = vec![f32::NEG_INFINITY; logits.len()];
        for (w, &bits) in mask.as_slice().iter().enumerate() {
            let at = w * 32;
            if bits == 0 || at >= out.len() {
                continue;
            }
            let end = (at + 32).min(out.len());
            if bits == u32::MAX {
                out[at..end].copy_from_slice(&logits[at..end]);
            } else {
                for i in at..end {
                    if bits >> (i - at) & 1 != 0 {
                        out[i] = logits[i];
                    }
                }
            }
        }
        Ok(out)
    }

    /// Takes the sampled token; `true` when the constraint is complete
    /// and allows nothing more (the sample ends there).
    pub(crate) fn commit(&mut self, t: u32) -> Result<bool> {
        self.mask = None;
        let m = &mut self.matcher;
        guarded(|| m.consume_token(t)).map_err(|e| guide_err(&e))?;
        Ok(self.matcher.is_stopped())
    }
}

/// Where a lazy constraint's trigger appeared ([`Guide::triggered`]).
pub(crate) enum Trigger {
    /// Its control token was sampled.
    Token(u32),
    /// Its text begins at this byte of the output.
    Text(usize),
}

fn guide_err(e: &impl std::fmt::Display) -> EngineError {
    EngineError::Invalid(format!("structured output: {e}"))
}

/// Converts a GBNF grammar (llama.cpp's grammar format) to llguidance's
/// Lark dialect, which shares most of its expressions: rules `name ::= …`
/// become `name: …`, `root` becomes `start`, `-` in rule names becomes `_`,
/// character classes `[…]` and `.` become regexes, and `#` comments go.
/// Text that is already Lark is returned unchanged.
pub fn gbnf_to_lark(gbnf: &str) -> String {
    if !gbnf.contains("::=") {
        return gbnf.to_string();
    }
    let mut out = String::with_capacity(gbnf.len() + 16);
    for line in gbnf.lines() {
        let mut rest = line;
        let mut code = String::new();
        // Copy the line, leaving strings and classes untouched, renaming
        // identifiers and dropping a comment.
        while let Some(c) = rest.chars().next() {
            match c {
                '"' | '[' => {
                    let close = if c == '"' { '"' } else { ']' };
                    let mut end = c.len_utf8();
                    let mut escaped = false;
                    for (i, ch) in rest[end..].char_indices() {
                        if escaped {
                            escaped = false;
                        } else if ch == '\\' {
                            escaped = true;
                        } else if ch == close {
                            end += i + ch.len_utf8();
                            break;
                        }
                    }
                    if end == c.len_utf8() {
                        end = rest.len();
                    }
                    if c == '[' {
                        // A character class is a regex in Lark (`[x]`
                        // there means an optional `x`).
                        code.push('/');
                        code.push_str(&rest[..end].replace('/', "\\/"));
                        code.push('/');
                    } else {
                        code.push_str(&rest[..end]);
                    }
                    rest = &rest[end..];
                }
                // Any character.
                '.' => {
                    code.push_str("/(?s:.)/");
                    rest = &rest[1..];
                }
                '#' => break,
                c if c.is_ascii_alphabetic() || c == '_' => {
                    let end = rest
                        .find(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_' || ch == '-'))
                        .unwrap_or(rest.len());
                    let name = rest[..end].replace('-', "_");
                    code.push_str(if name == "root" { "start" } else { &name });
                    rest = &rest[end..];
                }
                _ => {
                    code.push(c);
                    rest = &rest[c.len_utf8()..];
                }
            }
        }
        out.push_str(&code.replace("::=", ":"));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::gbnf_to_lark;

    #[test]
    fn gbnf_rules_become_lark_rules() {
        let g = "root ::= answer # the answer\nanswer ::= \"yes\" | \"no-way # not a comment\" | my-digits\nmy-digits ::= [0-9#/]+ .\n";
        assert_eq!(
            gbnf_to_lark(g),
            "start : answer \nanswer : \"yes\" | \"no-way # not a comment\" | my_digits\nmy_digits : /[0-9#\\/]/+ /(?s:.)/\n"
        );
        // Lark passes through.
        assert_eq!(gbnf_to_lark("start: \"a\"+"), "start: \"a\"+");
    }
}
