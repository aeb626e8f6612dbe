//! Tool calls: OpenAI's `tools` and `tool_choice` put into the prompt
//! through the model's own chat template, the model's tool-call syntax
//! parsed out of its answer, and `required` or a named function enforced
//! with a grammar, so that the answer is always a call that parses.
//!
//! Three syntaxes, chosen by what the chat template writes:
//! - **Hermes** (Qwen 2/2.5/3, Hermes, SmolLM3 and most tool-tuned models):
//!   `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, one block
//!   per call.
//! - **Llama 3** (`<|python_tag|>` or `ipython` in the template): one JSON
//!   object `{"name": …, "parameters": {…}}`.
//! - **Mistral** (`[TOOL_CALLS]` in the template): `[TOOL_CALLS]` then a
//!   JSON array of `{"name": …, "arguments": {…}}`.
//! - **Granite** (`available_tools` in the template): `<|tool_call|>` then
//!   the same JSON array.
//! - **Pythonic** (Gemma's templates, `<start_of_turn>`): Python calls in a
//!   `tool_code` block, as Google's function-calling guide for Gemma 3
//!   has them, `` ```tool_code\n[get_weather(city="Oslo")]\n``` ``, with
//!   results given back in a `tool_output` block; a bare `[f(a=1), …]`
//!   answer (Llama 3.2's and 4's pythonic style) parses too
//!   ([`crate::pythonic`]).
//!
//! A template that renders no tools (SmolLM2, Gemma 3, ChatML) gets its
//! syntax through a system message that describes the tools (Hermes, the
//! way llama.cpp's generic handling and Qwen's own template do it, or the
//! Python calls for Gemma); earlier calls and tool results are written
//! into the history in the same syntax.

use serde_json::{json, Value};
use tessera_model::{Message, Tokenizer};

use crate::grammar::{bound_json_whitespace, Constraint};
use crate::types::Prompt;

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: Option<String>,
    /// A JSON schema of the arguments (an object schema).
    pub parameters: Value,
}

impl ToolSpec {
    /// One entry of OpenAI's `tools`: `{"type": "function", "function":
    /// {"name", "description", "parameters"}}`.
    pub fn from_openai(v: &Value) -> Result<ToolSpec, String> {
        if v.get("type").and_then(Value::as_str) != Some("function") {
            return Err("every tool must have `type: function`".into());
        }
        let f = v
            .get("function")
            .and_then(Value::as_object)
            .ok_or("a tool needs a `function` object")?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty() && n.len() <= 64)
            .ok_or("a tool's function needs a `name` of 1 to 64 characters")?;
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p) if p.is_object() => p.clone(),
            Some(_) => {
                return Err(format!(
                    "the parameters of `{name}` must be a JSON schema object"
                ))
            }
        };
        Ok(ToolSpec {
            name: name.to_string(),
            description: f
                .get("description")
                .and_then(Value::as_str)
                .map(str::to_string),
            parameters,
        })
    }

    /// OpenAI's form, as templates and the tools system message show it.
    pub fn to_openai(&self) -> Value {
        let mut f = json!({"name": self.name, "parameters": self.parameters});
        if let Some(d) = &self.description {
            f["description"] = json!(d);
        }
        json!({"type": "function", "function": f})
    }
}

/// OpenAI's `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoice {
    /// The model decides (its answer is parsed for calls).
    #[default]
    Auto,
    /// No tool is called: the tools are not shown to the model.
    None,
    /// At least one call, enforced by a grammar.
    Required,
    /// A call of this function, enforced by a grammar.
    Named(String),
}

/// A call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments object.
    pub arguments: Value,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3,
    Mistral,
    Granite,
    Pythonic,
}

impl ToolFormat {
    /// The text a call starts with (Llama 3's is its JSON object's `{`).
    pub fn opener(self) -> &'static str {
        match self {
            ToolFormat::Hermes => HERMES_OPEN,
            ToolFormat::Mistral => MISTRAL_OPEN,
            ToolFormat::Granite => GRANITE_OPEN,
            ToolFormat::Pythonic => TOOL_CODE_OPEN,
            ToolFormat::Llama3 => "{",
        }
    }
}

/// How one model writes tool calls, and whether its template renders the
/// tools itself.
#[derive(Debug, Clone)]
pub struct ToolSyntax {
    pub format: ToolFormat,
    /// The template renders `tools` (else a system message describes them).
    pub native: bool,
    /// The opening marker's token, when the vocabulary has it as one
    /// control token (a grammar must then produce that token).
    opener_token: Option<u32>,
}

/// Most calls in one answer when a grammar forces calls (`required` with
/// `parallel_tool_calls`): a model that repeats itself would otherwise
/// write calls until its token limit, and the answer would not parse.
pub const MAX_PARALLEL_CALLS: usize = 4;

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_OPEN: &str = "[TOOL_CALLS]";
const GRANITE_OPEN: &str = "<|tool_call|>";
const PYTHON_TAG: &str = "<|python_tag|>";
const TOOL_CODE_OPEN: &str = "```tool_code";
const FENCE: &str = "```";

impl ToolSyntax {
    /// The syntax of a model, from its chat template and vocabulary.
    pub fn of(template: &tessera_model::ChatTemplate, tok: &Tokenizer) -> ToolSyntax {
        let (format, native) = ToolSyntax::detect(template);
        let controls = tok.control_texts();
        let opener = format.opener();
        let opener_token = (format != ToolFormat::Llama3 && controls.iter().any(|c| c == opener))
            .then(|| tok.token_to_id(opener))
            .flatten();
        ToolSyntax {
            format,
            native,
            opener_token,
        }
    }

    /// A template's call syntax, and whether it renders `tools` itself.
    pub fn detect(template: &tessera_model::ChatTemplate) -> (ToolFormat, bool) {
        let src = template.source();
        let native = template.renders_tools();
        let format = if src.contains(MISTRAL_OPEN) {
            ToolFormat::Mistral
        } else if native && (src.contains("available_tools") || src.contains(GRANITE_OPEN)) {
            ToolFormat::Granite
        } else if native
            && !src.contains(HERMES_OPEN)
            && (src.contains(PYTHON_TAG) || src.contains("ipython"))
        {
            ToolFormat::Llama3
        } else if !native && src.contains("<start_of_turn>") {
            ToolFormat::Pythonic
        } else {
            ToolFormat::Hermes
        };
        (format, native)
    }

    /// The text a call starts with (Llama 3's is its JSON object's `{`).
    pub fn opener(&self) -> &'static str {
        self.format.opener()
    }

    /// The prompt for `messages` with `tools` offered: OpenAI-shaped
    /// messages (assistant `tool_calls` with `arguments` as a JSON string
    /// or object, `tool` results) rendered by the template when it renders
    /// tools, else written in the Hermes syntax around a system message
    /// that describes the tools.
    pub fn prompt(&self, messages: Vec<Message>, tools: &[ToolSpec]) -> Prompt {
        let listed: Vec<Value> = tools.iter().map(ToolSpec::to_openai).collect();
        let mut messages: Vec<Message> = messages.into_iter().map(arguments_as_objects).collect();
        if self.native {
            return Prompt::ChatTools {
                messages,
                tools: Value::Array(listed),
            };
        }
        let mut out: Vec<Message> = Vec::with_capacity(messages.len() + 1);
        let pythonic = self.format == ToolFormat::Pythonic;
        let system = if pythonic {
            pythonic_system_text(&listed)
        } else {
            tools_system_text(&listed)
        };
        match messages.first_mut() {
            Some(m) if m.role == "system" => {
                m.content = format!("{}\n\n{system}", m.content);
            }
            _ => out.push(Message::new("system", system)),
        }
        for m in messages {
            let m = match m.role.as_str() {
                "assistant" if m.tool_calls.is_some() => {
                    let calls = m
                        .tool_calls
                        .iter()
                        .flat_map(|c| c.as_array().into_iter().flatten())
                        .map(|call| call.get("function").unwrap_or(call));
                    // Hermes: a block per call; Gemma: one block of calls.
                    let blocks: Vec<String> = if pythonic {
                        let python: Vec<String> = calls
                            .map(|f| {
                                let name =
                                    f.get("name").and_then(Value::as_str).unwrap_or_default();
                                let args = f.get("arguments").cloned().unwrap_or(json!({}));
                                crate::pythonic::call_text(name, &args)
                            })
                            .collect();
                        (!python.is_empty())
                            .then(|| format!("{TOOL_CODE_OPEN}\n[{}]\n{FENCE}", python.join(", ")))
                            .into_iter()
                            .collect()
                    } else {
                        calls
                            .map(|f| {
                                let body =
                                    json!({"name": f.get("name"), "arguments": f.get("arguments")});
                                format!("{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}")
                            })
                            .collect()
                    };
                    let mut text = m.content.clone();
                    for b in blocks {
                        if !text.is_empty() {
                            text.push('\n');
                        }
                        text.push_str(&b);
                    }
                    Message::new("assistant", text)
                }
                "tool" if pythonic => Message::new(
                    "user",
                    format!("{FENCE}tool_output\n{}\n{FENCE}", m.content),
                ),
                "tool" => Message::new(
                    "user",
                    format!("<tool_response>\n{}\n</tool_response>", m.content),
                ),
                _ => Message::new(m.role, m.content),
            };
            // Templates that insist on alternating roles get one turn.
            match out.last_mut() {
                Some(prev) if prev.role == m.role && m.role != "system" => {
                    prev.content.push('\n');
                    prev.content.push_str(&m.content);
                }
                _ => out.push(m),
            }
        }
        if pythonic && out.len() > 1 && out[0].role == "system" && out[1].role == "user" {
            // Gemma has no system turn (Gemma 2's template refuses one;
            // Gemma 3's puts it at the head of the first user turn).
            let system = out.remove(0);
            out[0].content = format!("{}\n\n{}", system.content, out[0].content);
        }
        Prompt::Chat(out)
    }

    /// The grammar that makes the answer one or more calls (`Required`) or
    /// a call of one function (`Named`), each call's arguments valid
    /// against that function's schema, and at most
    /// [`MAX_PARALLEL_CALLS`] calls. Objects in the schemas that do not
    /// say otherwise take no properties beyond their own (as OpenAI's
    /// `strict` mode): otherwise a model can add made-up properties until
    /// its token limit, and the call would not parse. For `Auto`, the same
    /// grammar over every tool once the answer opens a call
    /// ([`Constraint::After`] the opening marker: the answer is free until
    /// then; not for Llama 3's calls, which have no marker). `None` for
    /// `None`.
    pub fn constraint(
        &self,
        tools: &[ToolSpec],
        choice: &ToolChoice,
        parallel: bool,
    ) -> Result<Option<Constraint>, String> {
        let chosen: Vec<&ToolSpec> = match choice {
            ToolChoice::None => return Ok(None),
            // No marker opens Llama 3's calls: nothing to wait for.
            ToolChoice::Auto if self.format == ToolFormat::Llama3 || tools.is_empty() => {
                return Ok(None)
            }
            ToolChoice::Required | ToolChoice::Auto => tools.iter().collect(),
            ToolChoice::Named(n) => {
                let t = tools.iter().find(|t| &t.name == n).ok_or_else(|| {
                    format!("tool_choice names `{n}`, which is not among the tools")
                })?;
                vec![t]
            }
        };
        if chosen.is_empty() {
            return Err("tool_choice `required` needs at least one tool".into());
        }
        let many = parallel && matches!(choice, ToolChoice::Required | ToolChoice::Auto);
        // The JSON syntaxes' schema of one call.
        let one = || {
            let key = match self.format {
                ToolFormat::Llama3 => "parameters",
                _ => "arguments",
            };
            let mut calls: Vec<Value> = chosen
                .iter()
                .map(|t| {
                    let mut params = t.parameters.clone();
                    close_objects(&mut params);
                    json!({"type": "object",
                        "properties": {"name": {"const": t.name}, key: params},
                        "required": ["name", key], "additionalProperties": false})
                })
                .collect();
            if calls.len() == 1 {
                calls.remove(0)
            } else {
                json!({"anyOf": calls})
            }
        };
        let opener = match self.opener_token {
            Some(id) => format!("<[{id}]>"),
            None => serde_json::to_string(self.opener()).expect("a string"),
        };
        let lark = match self.format {
            ToolFormat::Hermes => {
                let mut schema = one();
                bound_json_whitespace(&mut schema);
                let repeat = if many {
                    format!(" (\"\\n\" call){{0,{}}}", MAX_PARALLEL_CALLS - 1)
                } else {
                    String::new()
                };
                format!(
                    "start: call{repeat}\ncall: {opener} \"\\n\" %json {schema} \"\\n{HERMES_CLOSE}\"\n"
                )
            }
            ToolFormat::Mistral | ToolFormat::Granite => {
                let most = if many { MAX_PARALLEL_CALLS } else { 1 };
                let mut schema =
                    json!({"type": "array", "items": one(), "minItems": 1, "maxItems": most});
                bound_json_whitespace(&mut schema);
                format!("start: {opener} %json {schema}\n")
            }
            ToolFormat::Llama3 => {
                let mut schema = one();
                bound_json_whitespace(&mut schema);
                format!("start: %json {schema}\n")
            }
            ToolFormat::Pythonic => pythonic_grammar(&chosen, many),
        };
        let calls = Constraint::Lark(lark);
        Ok(Some(match choice {
            // Free until the marker, then the calls.
            ToolChoice::Auto => Constraint::After {
                trigger: self.opener().to_string(),
                token: self.opener_token,
                then: Box::new(calls),
            },
            _ => calls,
        }))
    }

    /// Streaming: of `text` (the answer so far not yet sent), how much may
    /// be sent as content now, and whether a call starts right after it
    /// (the rest is then held to the end, and parsed). Text that could
    /// still become the opening marker is held back. `at_start`: nothing
    /// of the answer has been sent yet (Llama 3's calls are the whole
    /// answer).
    pub fn stream_split(&self, text: &str, at_start: bool) -> (usize, bool) {
        if self.format == ToolFormat::Llama3 {
            if !at_start {
                return (text.len(), false);
            }
            let t = text.trim_start();
            if t.starts_with('{') || t.starts_with(PYTHON_TAG) {
                return (0, true);
            }
            let undecided = t.is_empty() || PYTHON_TAG.starts_with(t);
            return (if undecided { 0 } else { text.len() }, false);
        }
        if self.format == ToolFormat::Pythonic && at_start {
            // A bare call list is the whole answer.
            let t = text.trim_start();
            if t.starts_with('[') {
                return (0, true);
            }
            if t.is_empty() {
                return (0, false);
            }
        }
        let open = self.opener();
        if let Some(at) = text.find(open) {
            return (at, true);
        }
        let hold = (1..open.len())
            .rev()
            .find(|&k| text.ends_with(&open[..k]))
            .unwrap_or(0);
        (text.len() - hold, false)
    }

    /// The calls in an answer, and the text before them; `None` when the
    /// answer holds no call, or one that does not parse (it is then plain
    /// content).
    pub fn parse(&self, text: &str) -> Option<(String, Vec<ToolCall>)> {
        match self.format {
            ToolFormat::Hermes => {
                let start = text.find(HERMES_OPEN)?;
                let mut calls = Vec::new();
                let mut rest = &text[start..];
                while let Some(body) = rest.strip_prefix(HERMES_OPEN) {
                    let (inner, after) = match body.find(HERMES_CLOSE) {
                        Some(end) => (&body[..end], &body[end + HERMES_CLOSE.len()..]),
                        // The answer ended before the closing tag.
                        None => (body, ""),
                    };
                    calls.push(call_of(
                        &serde_json::from_str(inner.trim()).ok()?,
                        "arguments",
                    )?);
                    rest = after.trim_start();
                }
                rest.is_empty()
                    .then(|| (text[..start].trim_end().to_string(), calls))
            }
            ToolFormat::Mistral | ToolFormat::Granite => {
                let open = self.opener();
                let start = text.find(open)?;
                let body: Value = serde_json::from_str(text[start + open.len()..].trim()).ok()?;
                let calls = body
                    .as_array()?
                    .iter()
                    .map(|c| call_of(c, "arguments"))
                    .collect::<Option<Vec<_>>>()?;
                Some((text[..start].trim_end().to_string(), calls))
            }
            ToolFormat::Pythonic => {
                let calls = |body: &str| -> Option<Vec<ToolCall>> {
                    let calls = crate::pythonic::parse_calls(body)?;
                    Some(
                        calls
                            .into_iter()
                            .map(|(name, arguments)| ToolCall { name, arguments })
                            .collect(),
                    )
                };
                let Some(start) = text.find(TOOL_CODE_OPEN) else {
                    let t = text.trim();
                    return t
                        .starts_with('[')
                        .then(|| calls(t))
                        .flatten()
                        .map(|c| (String::new(), c));
                };
                let body = &text[start + TOOL_CODE_OPEN.len()..];
                let body = match body.find(FENCE) {
                    Some(end) if body[end + FENCE.len()..].trim().is_empty() => &body[..end],
                    Some(_) => return None,
                    // The answer ended before the closing fence.
                    None => body,
                };
                Some((text[..start].trim_end().to_string(), calls(body)?))
            }
            ToolFormat::Llama3 => {
                let body = text.trim();
                let body = body.strip_prefix(PYTHON_TAG).unwrap_or(body).trim();
                if !body.starts_with('{') {
                    return None;
                }
                let mut calls = Vec::new();
                for part in body.split(';').map(str::trim).filter(|p| !p.is_empty()) {
                    let v: Value = serde_json::from_str(part).ok()?;
                    calls.push(call_of(&v, "parameters").or_else(|| call_of(&v, "arguments"))?);
                }
                Some((String::new(), calls))
            }
        }
    }
}

/// One streamed answer with tools offered: text that may open a call is
/// held back, and once a call opens, the rest is held to the end, where
/// it is parsed.
#[derive(Debug, Clone)]
pub struct ToolStream {
    syntax: ToolSyntax,
    held: String,
    in_call: bool,
    sent_any: bool,
}

impl ToolStream {
    pub fn new(syntax: ToolSyntax) -> ToolStream {
        ToolStream {
            syntax,
            held: String::new(),
            in_call: false,
            sent_any: false,
        }
    }

    /// Takes a token's text; returns the content that may be sent now.
    pub fn push(&mut self, text: &str) -> String {
        self.held.push_str(text);
        if self.in_call {
            return String::new();
        }
        let (safe, call) = self.syntax.stream_split(&self.held, !self.sent_any);
        self.in_call = call;
        let rest = self.held.split_off(safe);
        let out = std::mem::replace(&mut self.held, rest);
        self.sent_any |= !out.is_empty();
        out
    }

    /// At the end, given the whole answer: its calls, when a call opened
    /// and they parse; else the content still held.
    pub fn finish(&mut self, answer: &str) -> Result<Vec<ToolCall>, String> {
        match self.syntax.parse(answer) {
            Some((_, calls)) if self.in_call => Ok(calls),
            _ => Err(std::mem::take(&mut self.held)),
        }
    }
}

/// Gemma's forced calls: a `tool_code` block of one call of the chosen
/// functions (up to [`MAX_PARALLEL_CALLS`] with `many`), each one's
/// keyword arguments following its parameters' schema, closed as the JSON
/// syntaxes' are.
fn pythonic_grammar(chosen: &[&ToolSpec], many: bool) -> String {
    let mut rules = String::new();
    let mut names = Vec::new();
    for (i, t) in chosen.iter().enumerate() {
        let mut params = t.parameters.clone();
        close_objects(&mut params);
        rules.push_str(&crate::pythonic::call_rules(i, &t.name, &params));
        names.push(format!("call{i}"));
    }
    let repeat = if many {
        format!(" (\", \" call){{0,{}}}", MAX_PARALLEL_CALLS - 1)
    } else {
        String::new()
    };
    let open = Value::String(format!("{TOOL_CODE_OPEN}\n["));
    let close = Value::String(format!("]\n{FENCE}"));
    format!(
        "start: {open} call{repeat} {close}\ncall: {}\n{rules}",
        names.join(" | ")
    )
}

/// `additionalProperties: false` on every object schema in `v` that does
/// not set it, and bounds on every integer schema that has none.
fn close_objects(v: &mut Value) {
    match v {
        Value::Object(o) => {
            if o.get("type").and_then(Value::as_str) == Some("object")
                || o.contains_key("properties")
            {
                o.entry("additionalProperties")
                    .or_insert(Value::Bool(false));
            }
            // Integers within JSON's exact range (2^53 - 1) unless the
            // schema bounds them: a model may otherwise write digits
            // until its token limit.
            if o.get("type").and_then(Value::as_str) == Some("integer") {
                const SAFE: i64 = (1 << 53) - 1;
                if !o.contains_key("minimum") && !o.contains_key("exclusiveMinimum") {
                    o.insert("minimum".into(), (-SAFE).into());
                }
                if !o.contains_key("maximum") && !o.contains_key("exclusiveMaximum") {
                    o.insert("maximum".into(), SAFE.into());
                }
            }
            for (_, x) in o.iter_mut() {
                close_objects(x);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(close_objects),
        _ => {}
    }
}

/// `{"name": …, key: {…}}` as a call.
fn call_of(v: &Value, key: &str) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get(key)? {
        // Some models write the arguments as a JSON string.
        Value::String(s) => serde_json::from_str(s).ok()?,
        a @ Value::Object(_) => a.clone(),
        _ => return None,
    };
    Some(ToolCall { name, arguments })
}

/// An assistant message's tool calls with each `arguments` a JSON object
/// (OpenAI sends a string; templates read an object).
fn arguments_as_objects(mut m: Message) -> Message {
    if let Some(Value::Array(calls)) = m.tool_calls.as_mut() {
        for c in calls {
            if let Some(f) = c.get_mut("function") {
                if let Some(Value::String(s)) = f.get("arguments") {
                    if let Ok(v) = serde_json::from_str::<Value>(s) {
                        f["arguments"] = v;
                    }
                }
            }
        }
    }
    m
}

/// The system text that offers tools to a model whose template does not
/// (Qwen 2.5's own wording of the Hermes syntax).
fn tools_system_text(tools: &[Value]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&t.to_string());
    }
    s.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and \
         arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
         {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    s
}

/// The system text that offers tools to a Gemma model: Python calls in a
/// `tool_code` block (the wording of Google's function-calling guide for
/// Gemma 3).
fn pythonic_system_text(tools: &[Value]) -> String {
    let mut s = String::from(
        "You have access to functions. If you decide to invoke any of the function(s), \
         you MUST put it in the format of\n```tool_code\n[func_name1(params_name1=params_value1, \
         params_name2=params_value2...), func_name2(params)]\n```\n\
         You SHOULD NOT include any other text in the response if you call a function. \
         The results come back in a ```tool_output``` block.\n",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&t.to_string());
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn syntax(format: ToolFormat) -> ToolSyntax {
        ToolSyntax {
            format,
            native: true,
            opener_token: None,
        }
    }

    /// `auto`: the grammar of `required` over every tool, from the opening
    /// marker on (its control token where the vocabulary has one); none
    /// for Llama 3's calls (no marker) or without tools.
    #[test]
    fn auto_holds_a_call_to_the_required_grammar_once_opened() {
        let tools = vec![
            ToolSpec::from_openai(&json!({"type": "function", "function":
            {"name": "f", "parameters": {"type": "object", "properties": {}}}}))
            .unwrap(),
        ];
        for format in [
            ToolFormat::Hermes,
            ToolFormat::Mistral,
            ToolFormat::Granite,
            ToolFormat::Pythonic,
        ] {
            let mut s = syntax(format);
            s.opener_token = (format == ToolFormat::Mistral).then_some(5);
            let required = s
                .constraint(&tools, &ToolChoice::Required, true)
                .unwrap()
                .unwrap();
            let auto = s.constraint(&tools, &ToolChoice::Auto, true).unwrap();
            assert_eq!(
                auto,
                Some(Constraint::After {
                    trigger: format.opener().to_string(),
                    token: s.opener_token,
                    then: Box::new(required),
                }),
                "{format:?}"
            );
            assert_eq!(s.constraint(&[], &ToolChoice::Auto, true), Ok(None));
        }
        let llama = syntax(ToolFormat::Llama3);
        assert_eq!(llama.constraint(&tools, &ToolChoice::Auto, true), Ok(None));
    }

    #[test]
    fn each_syntax_parses_its_calls() {
        let h = syntax(ToolFormat::Hermes);
        let (content, calls) = h
            .parse("Let me look.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>{\"name\": \"time\", \"arguments\": \"{}\"}")
            .unwrap();
        assert_eq!(content, "Let me look.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].arguments, json!({"city": "Oslo"}));
        assert_eq!(calls[1].name, "time");
        assert!(h.parse("no calls here").is_none());
        assert!(h.parse("<tool_call>{broken</tool_call>").is_none());
        let l = syntax(ToolFormat::Llama3);
        let (_, calls) = l
            .parse("<|python_tag|>{\"name\": \"weather\", \"parameters\": {\"city\": \"Oslo\"}}")
            .unwrap();
        assert_eq!(calls[0].name, "weather");
        assert!(l.parse("Oslo is cold.").is_none());
        let m = syntax(ToolFormat::Mistral);
        let (_, calls) = m
            .parse("[TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {}}, {\"name\": \"b\", \"arguments\": {\"x\": 1}}]")
            .unwrap();
        assert_eq!(
            calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
    }

    /// The families of the template fixture (as their GGUF files carry
    /// their templates).
    #[test]
    fn each_template_family_gets_its_syntax() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/chat_templates.json");
        let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let found: Vec<(String, ToolFormat, bool)> = fixture
            .as_array()
            .unwrap()
            .iter()
            .map(|f| {
                let t = tessera_model::ChatTemplate::new(f["source"].as_str().unwrap(), "", "")
                    .unwrap();
                let (format, native) = ToolSyntax::detect(&t);
                (f["family"].as_str().unwrap().to_string(), format, native)
            })
            .collect();
        let want = [
            ("qwen3", ToolFormat::Hermes, true),
            // Its GGUF's template takes `xml_tools`, not `tools`.
            ("smollm3", ToolFormat::Hermes, false),
            ("granite", ToolFormat::Granite, true),
            ("phi3", ToolFormat::Hermes, false),
        ];
        assert_eq!(found, want.map(|(n, f, b)| (n.to_string(), f, b)));
        let chatml = tessera_model::ChatTemplate::new(tessera_model::CHATML, "", "").unwrap();
        assert_eq!(ToolSyntax::detect(&chatml), (ToolFormat::Hermes, false));
        let gemma = tessera_model::ChatTemplate::new(
            "{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(ToolSyntax::detect(&gemma), (ToolFormat::Pythonic, false));
    }

    #[test]
    fn streaming_holds_back_what_may_open_a_call() {
        let h = syntax(ToolFormat::Hermes);
        assert_eq!(h.stream_split("Hello", false), (5, false));
        assert_eq!(h.stream_split("Hello <tool", false), (6, false));
        assert_eq!(h.stream_split("Hello <tool_call>{", false), (6, true));
        let l = syntax(ToolFormat::Llama3);
        assert_eq!(l.stream_split("  {\"name\"", true), (0, true));
        assert_eq!(l.stream_split("<|python", true), (0, false));
        assert_eq!(l.stream_split("Sure", true), (4, false));
        assert_eq!(l.stream_split("{", false), (1, false));
    }

    /// A stream sends what cannot open a call, holds a call to the end,
    /// and gives back everything held when the call does not parse.
    #[test]
    fn a_stream_holds_calls_and_loses_no_text() {
        let answer = [
            "Sure. <tool",
            "_call>\n{\"name\": \"f\", ",
            "\"arguments\": {}}",
            "\n</tool_call>",
        ];
        let mut s = ToolStream::new(syntax(ToolFormat::Hermes));
        let sent: Vec<String> = answer.iter().map(|t| s.push(t)).collect();
        assert_eq!(sent, ["Sure. ", "", "", ""]);
        assert_eq!(s.finish(&answer.concat()).unwrap()[0].name, "f");
        let broken = ["Hi <tool_call>{\"na", "me\": oops", "} done"];
        let mut s = ToolStream::new(syntax(ToolFormat::Hermes));
        let sent: String = broken.iter().map(|t| s.push(t)).collect();
        assert_eq!(
            sent + &s.finish(&broken.concat()).unwrap_err(),
            broken.concat()
        );
        let mut s = ToolStream::new(syntax(ToolFormat::Hermes));
        assert_eq!(s.push("plain <to"), "plain ");
        assert_eq!(s.push("y>"), "<toy>");
        assert_eq!(s.finish("plain <toy>").unwrap_err(), "");
    }

    #[test]
    fn gemma_writes_python_calls() {
        let p = ToolSyntax {
            native: false,
            ..syntax(ToolFormat::Pythonic)
        };
        let (content, calls) = p
            .parse("Checking.\n```tool_code\n[get_weather(city=\"Oslo\", unit='celsius'), get_time(timezone=\"CET\")]\n```\n")
            .unwrap();
        assert_eq!(content, "Checking.");
        assert_eq!(
            calls[0].arguments,
            json!({"city": "Oslo", "unit": "celsius"})
        );
        assert_eq!(calls[1].name, "get_time");
        // Llama 3.2's bare list, and a block cut off before its fence.
        assert_eq!(p.parse("[f(a=1)]").unwrap().1[0].arguments, json!({"a": 1}));
        assert_eq!(p.parse("```tool_code\nf(a=1)").unwrap().1.len(), 1);
        assert!(p.parse("[a link](http://x)").is_none());
        assert!(p
            .parse("```tool_code\nf(a=1)\n```\nand then more")
            .is_none());
        assert_eq!(p.stream_split("[f(", true), (0, true));
        assert_eq!(p.stream_split("Sure ``", true), (5, false));
        assert_eq!(p.stream_split("Sure ```tool_code\n", false), (5, true));
        // The history: calls as a block, results as a tool_output block.
        let tools =
            [
                ToolSpec::from_openai(&json!({"type": "function", "function": {"name": "f"}}))
                    .unwrap(),
            ];
        let mut call = Message::new("assistant", "");
        call.tool_calls = Some(json!([{"id": "1", "type": "function",
            "function": {"name": "f", "arguments": "{\"a\": true}"}}]));
        let mut result = Message::new("tool", "42");
        result.tool_call_id = Some("1".into());
        let Prompt::Chat(m) = p.prompt(vec![Message::new("user", "hi"), call, result], &tools)
        else {
            panic!("not a chat");
        };
        // No system turn: the tools head the first user turn.
        assert_eq!(m[0].role, "user");
        assert!(m[0].content.contains("tool_code") && m[0].content.contains("\"name\":\"f\""));
        assert!(m[0].content.ends_with("\n\nhi"));
        assert_eq!(m[1].content, "```tool_code\n[f(a=True)]\n```");
        assert_eq!(m[2].content, "```tool_output\n42\n```");
        let forced = p.constraint(&tools, &ToolChoice::Required, true).unwrap();
        let Some(Constraint::Lark(lark)) = forced else {
            panic!("{forced:?}");
        };
        assert!(
            lark.starts_with("start: \"```tool_code\\n[\" call (\", \" call){0,3} \"]\\n```\""),
            "{lark}"
        );
        // Integers are bounded (else digits could run to the token limit),
        // nested objects closed, in every syntax.
        let counted = ToolSpec::from_openai(&json!({"type": "function", "function": {"name": "g",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"},
                "o": {"type": "object", "properties": {"k": {"type": "integer", "maximum": 9}}}}}}}))
        .unwrap();
        for syntax in [p.clone(), syntax(ToolFormat::Hermes)] {
            let Some(Constraint::Lark(lark)) = syntax
                .constraint(std::slice::from_ref(&counted), &ToolChoice::Required, false)
                .unwrap()
            else {
                panic!("no grammar");
            };
            assert!(lark.contains("\"maximum\":9007199254740991"), "{lark}");
            assert!(lark.contains("\"maximum\":9,"), "{lark}");
            assert_eq!(
                lark.matches("\"minimum\":-9007199254740991").count(),
                2,
                "{lark}"
            );
            assert!(lark.contains("\"additionalProperties\":false"), "{lark}");
        }
    }

    #[test]
    fn bad_tools_and_choices_are_refused() {
        assert!(ToolSpec::from_openai(&json!({"type": "function"})).is_err());
        assert!(
            ToolSpec::from_openai(&json!({"type": "retrieval", "function": {"name": "x"}}))
                .is_err()
        );
        let t =
            ToolSpec::from_openai(&json!({"type": "function", "function": {"name": "x"}})).unwrap();
        assert_eq!(t.parameters["type"], "object");
        let h = syntax(ToolFormat::Hermes);
        assert!(h
            .constraint(
                std::slice::from_ref(&t),
                &ToolChoice::Named("y".into()),
                true
            )
            .is_err());
        assert!(h.constraint(&[], &ToolChoice::Required, true).is_err());
        assert!(h
            .constraint(&[t], &ToolChoice::None, true)
            .unwrap()
            .is_none());
    }
}
