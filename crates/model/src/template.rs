//! Chat templates: the model's Jinja template (GGUF
//! `tokenizer.chat_template` or `tokenizer_config.json`) rendered with
//! minijinja the way Hugging Face renders it (`messages`,
//! `add_generation_prompt`, `bos_token`, `eos_token`), ChatML when a model
//! has none.
//!
//! [`ChatTemplate::encode`] parses control tokens only in the template's own
//! text: message contents (and roles) are tokenized as plain text, so a user
//! who types `<|im_start|>` cannot forge a turn, whatever the template does
//! to the messages (trim, replace, escape).
//!
//! Templates come from model files, so rendering is bounded: fuel (about
//! one unit per instruction), a recursion limit, and a cap on the output.

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
    /// An assistant turn's tool calls, as templates read them: OpenAI's
    /// `[{"id", "type": "function", "function": {"name", "arguments"}}]`
    /// with `arguments` an object.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A `tool` turn's answer to this call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A `tool` turn's function name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }

    /// This message with `content` and `role` replaced.
    fn with(&self, role: String, content: String) -> Message {
        Message {
            role,
            content,
            ..self.clone()
        }
    }
}

/// Every string in `v` neutralized (see [`neutralize`]).
fn neutralize_value(
    v: &serde_json::Value,
    controls: &[String],
    literals: &mut Vec<String>,
) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::String(s) => Value::String(neutralize(s, controls, literals)),
        Value::Array(a) => Value::Array(
            a.iter()
                .map(|x| neutralize_value(x, controls, literals))
                .collect(),
        ),
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, x)| {
                    (
                        neutralize(k, controls, literals),
                        neutralize_value(x, controls, literals),
                    )
                })
                .collect(),
        ),
        other => other.clone(),
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

/// Stands for literal `k` (control-token text typed by a user) in a
/// rendering.
const LIT_OPEN: char = '\u{F8FD}';
const LIT_CLOSE: char = '\u{F8FC}';

/// Instructions a rendering may run (a real chat template of a long
/// conversation uses well under a million).
pub const TEMPLATE_FUEL: u64 = 20_000_000;
/// Nesting depth of includes, macros and blocks.
pub const TEMPLATE_RECURSION: usize = 64;
/// Bytes a rendering may produce.
pub const TEMPLATE_MAX_OUTPUT: usize = 64 << 20;

/// `text` with every occurrence of a control-token text replaced by a
/// private-use marker; the replaced texts are pushed to `literals`.
fn neutralize(text: &str, controls: &[String], literals: &mut Vec<String>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    'outer: while !rest.is_empty() {
        for c in controls {
            if rest.starts_with(c.as_str()) {
                out.push(LIT_OPEN);
                out.push_str(&literals.len().to_string());
                out.push(LIT_CLOSE);
                literals.push(c.clone());
                rest = &rest[c.len()..];
                continue 'outer;
            }
        }
        let ch = rest.chars().next().expect("not empty");
        out.push(ch);
        rest = &rest[ch.len_utf8()..];
    }
    out
}

/// Tokens of template text that may hold literal markers: control tokens
/// parsed in the text between markers, each marker's literal as plain text.
fn encode_with_literals(tok: &Tokenizer, text: &str, literals: &[String]) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(LIT_OPEN) {
        let after = &rest[start + LIT_OPEN.len_utf8()..];
        let lit = after.find(LIT_CLOSE).and_then(|end| {
            let k: usize = after[..end].parse().ok()?;
            Some((literals.get(k)?, end))
        });
        let Some((lit, end)) = lit else {
            // Not a marker of ours: the rest is plain template text.
            break;
        };
        if start > 0 {
            ids.extend(tok.encode(&rest[..start], Special::Parse, false)?);
        }
        ids.extend(tok.encode(lit, Special::AsText, false)?);
        rest = &after[end + LIT_CLOSE.len_utf8()..];
    }
    if !rest.is_empty() {
        ids.extend(tok.encode(rest, Special::Parse, false)?);
    }
    Ok(ids)
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)` as
/// Hugging Face's `tojson` filter calls it: keys in their order, `", "`
/// and `": "` between items (`","` before a newline when indented), no
/// HTML escaping. `sort_keys`, `separators` and `ensure_ascii` are
/// accepted and only their defaults are supported.
fn tojson(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<minijinja::Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    for k in ["sort_keys", "separators", "ensure_ascii"] {
        let _: Option<minijinja::Value> = kwargs.get(k)?;
    }
    kwargs.assert_all_used()?;
    let v = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    python_json(&v, indent, 0, &mut out);
    Ok(minijinja::Value::from_safe_string(out))
}

fn python_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value;
    let (open, close, items): (char, char, Vec<(Option<&String>, &Value)>) = match v {
        Value::Array(a) => ('[', ']', a.iter().map(|x| (None, x)).collect()),
        Value::Object(o) => ('{', '}', o.iter().map(|(k, x)| (Some(k), x)).collect()),
        other => {
            out.push_str(&other.to_string());
            return;
        }
    };
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return;
    }
    for (i, (k, x)) in items.iter().enumerate() {
        match indent {
            Some(n) => {
                out.push_str(if i > 0 { ",\n" } else { "\n" });
                out.push_str(&" ".repeat(n * (depth + 1)));
            }
            None if i > 0 => out.push_str(", "),
            None => {}
        }
        if let Some(k) = k {
            out.push_str(&serde_json::to_string(k).expect("a string serializes"));
            out.push_str(": ");
        }
        python_json(x, indent, depth + 1, out);
    }
    if let Some(n) = indent {
        out.push('\n');
        out.push_str(&" ".repeat(n * depth));
    }
    out.push(close);
}

/// Today's date (UTC) in the C `strftime` codes templates use: `%Y %y %m
/// %d %e %B %b %A %a %H %M %S %j %%` (others are kept as written).
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    strftime(fmt, secs)
}

/// [`strftime_now`] at `secs` since the Unix epoch.
fn strftime(fmt: &str, secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let before = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][(m - 1) as usize];
    let yday = before + d + i64::from(leap && m > 2);
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out += &y.to_string(),
            Some('y') => out += &format!("{:02}", y.rem_euclid(100)),
            Some('m') => out += &format!("{m:02}"),
            Some('d') => out += &format!("{d:02}"),
            Some('e') => out += &format!("{d:2}"),
            Some('B') => out += month,
            Some('b') => out += &month[..3],
            Some('A') => out += weekday,
            Some('a') => out += &weekday[..3],
            Some('H') => out += &format!("{:02}", tod / 3600),
            Some('M') => out += &format!("{:02}", tod / 60 % 60),
            Some('S') => out += &format!("{:02}", tod % 60),
            Some('j') => out += &format!("{yday:03}"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

impl ChatTemplate {
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_recursion_limit(TEMPLATE_RECURSION);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        // Hugging Face renders templates with trim_blocks and
        // lstrip_blocks on (so does llama.cpp's own engine); templates
        // written for it leave newlines to them.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // Granite's and Llama 3's templates put today's date in their
        // default system message.
        env.add_function("strftime_now", |fmt: String| strftime_now(&fmt));
        // Hugging Face's `tojson` (Python's `json.dumps`), not minijinja's
        // HTML-safe one: tool definitions reach the model as they do
        // under transformers.
        env.add_filter("tojson", tojson);
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

    /// Another template for the same model (its BOS and EOS texts): what
    /// llama.cpp's `--chat-template-file` gives a model whose file has no
    /// template, or a wrong one.
    pub fn with_source(&self, source: &str) -> Result<ChatTemplate> {
        ChatTemplate::new(source, &self.bos, &self.eos)
    }

    /// Whether the template renders a `tools` list of its own.
    pub fn renders_tools(&self) -> bool {
        self.source.contains("tools")
    }

    /// The prompt text for `messages`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_tools(messages, None, add_generation_prompt)
    }

    /// The prompt text for `messages` with the `tools` (OpenAI's list of
    /// function definitions) that the template renders.
    pub fn render_tools(
        &self,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| ModelError::Template(e.to_string()))?;
        let out = t
            .render(context! {
                messages => messages,
                tools => tools,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos,
                eos_token => self.eos,
            })
            .map_err(|e| ModelError::Template(e.to_string()))?;
        if out.len() > TEMPLATE_MAX_OUTPUT {
            return Err(ModelError::Template(format!(
                "the rendered prompt has {} bytes, more than the limit of {TEMPLATE_MAX_OUTPUT}",
                out.len()
            )));
        }
        Ok(out)
    }

    /// Token ids of the rendered prompt, control tokens parsed only in the
    /// template's own text.
    pub fn encode(
        &self,
        tok: &Tokenizer,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        self.encode_tools(tok, messages, None, add_generation_prompt)
    }

    /// [`ChatTemplate::encode`] with the `tools` the template renders.
    /// Like roles, tool definitions and a message's tool calls, call id
    /// and name are the caller's text: control-token text in them is
    /// encoded as plain text.
    pub fn encode_tools(
        &self,
        tok: &Tokenizer,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        // Roles are the caller's text too: control-token text in them is
        // marked, and encoded as plain text wherever the template puts it.
        let controls = tok.control_texts();
        let mut literals = Vec::new();
        let tools = tools.map(|t| neutralize_value(t, &controls, &mut literals));
        let tools = tools.as_ref();
        let with_roles: Vec<Message> = messages
            .iter()
            .map(|m| {
                let mut n = m.with(
                    neutralize(&m.role, &controls, &mut literals),
                    m.content.clone(),
                );
                n.tool_calls = m
                    .tool_calls
                    .as_ref()
                    .map(|v| neutralize_value(v, &controls, &mut literals));
                n.tool_call_id = m
                    .tool_call_id
                    .as_ref()
                    .map(|s| neutralize(s, &controls, &mut literals));
                n.name = m
                    .name
                    .as_ref()
                    .map(|s| neutralize(s, &controls, &mut literals));
                n
            })
            .collect();
        let real = self.render_tools(&with_roles, tools, add_generation_prompt)?;
        let marked: Vec<Message> = with_roles
            .iter()
            .enumerate()
            .map(|(i, m)| m.with(m.role.clone(), sentinel(i)))
            .collect();
        let probe = self.render_tools(&marked, tools, add_generation_prompt)?;
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
            // The template transformed the contents (trim, escape…), so
            // they cannot be told apart from its text. Render them with
            // their control-token texts marked instead: every control token
            // left in that rendering is the template's own.
            let neutral: Vec<Message> = with_roles
                .iter()
                .map(|m| {
                    m.with(
                        m.role.clone(),
                        neutralize(&m.content, &controls, &mut literals),
                    )
                })
                .collect();
            let text = self.render_tools(&neutral, tools, add_generation_prompt)?;
            return encode_with_literals(tok, &text, &literals);
        }
        let mut ids = Vec::new();
        for (is_template, text) in parts {
            if text.is_empty() {
                continue;
            }
            if is_template {
                ids.extend(encode_with_literals(tok, text, &literals)?);
            } else {
                ids.extend(tok.encode(text, Special::AsText, false)?);
            }
        }
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::strftime;

    #[test]
    fn strftime_formats_dates_as_c_does() {
        // 2026-11-27 01:51:37 UTC, a Friday, day 331 of the year.
        let t = 1_795_744_297;
        assert_eq!(strftime("%B %d, %Y", t), "November 27, 2026");
        assert_eq!(
            strftime("%d %b %Y %a %H:%M:%S %j %y %m %e%%", t),
            "27 Nov 2026 Fri 01:51:37 331 26 11 27%"
        );
        assert_eq!(strftime("%Y-%m-%d %A", 0), "1970-01-01 Thursday");
        // A leap day, and the day after it.
        assert_eq!(strftime("%Y-%m-%d %j", 1_709_164_800), "2024-02-29 060");
        assert_eq!(
            strftime("%Y-%m-%d %j %q", 1_709_251_200),
            "2024-03-01 061 %q"
        );
    }
}
