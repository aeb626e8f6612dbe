//! Tool calls written as Python calls: Gemma 3's `tool_code` blocks and
//! the "pythonic" call lists of Llama 3.2 and 4,
//! `[get_weather(city="Oslo", days=3), get_time(timezone="CET")]`.
//! Reading the calls' literals back as JSON, writing JSON arguments as
//! literals, and the Lark rules that force a call of a function whose
//! arguments match its JSON schema.

use serde_json::{Map, Number, Value};

use crate::grammar::bound_json_whitespace;

/// The calls in `text`: `name(key=literal, …)` each, separated by commas
/// or line breaks, the whole optionally in `[…]`; `None` unless all of
/// `text` is calls. Literals are Python's (strings in either quote,
/// numbers, `True`/`False`/`None`, lists, tuples, dicts) or JSON's.
pub(crate) fn parse_calls(text: &str) -> Option<Vec<(String, Value)>> {
    let mut p = Reader { s: text, at: 0 };
    p.space();
    let bracket = p.eat('[');
    let mut calls = Vec::new();
    loop {
        p.space();
        if bracket && p.peek() == Some(']') {
            break;
        }
        calls.push(p.call()?);
        p.space();
        if !p.eat(',') && (p.peek().is_none() || p.peek() == Some(']')) {
            break;
        }
    }
    p.space();
    if bracket && !p.eat(']') {
        return None;
    }
    p.space();
    (p.at == text.len() && !calls.is_empty()).then_some(calls)
}

/// `arguments` (a JSON object) as a call of `name`.
pub(crate) fn call_text(name: &str, arguments: &Value) -> String {
    let args: Vec<String> = arguments
        .as_object()
        .map(|o| {
            o.iter()
                .map(|(k, v)| format!("{k}={}", literal(v)))
                .collect()
        })
        .unwrap_or_default();
    format!("{name}({})", args.join(", "))
}

/// A JSON value as a Python literal.
pub(crate) fn literal(v: &Value) -> String {
    match v {
        Value::Null => "None".into(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::Number(n) => n.to_string(),
        Value::String(_) => v.to_string(),
        Value::Array(a) => format!("[{}]", a.iter().map(literal).collect::<Vec<_>>().join(", ")),
        Value::Object(o) => format!(
            "{{{}}}",
            o.iter()
                .map(|(k, v)| format!("{}: {}", Value::String(k.clone()), literal(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Lark rules for one call of function `name` (rule `call{i}`), whose
/// keyword arguments are the properties of `params` (a JSON schema of an
/// object): the required ones, in their order, then any of the others in
/// theirs, each value a JSON value valid against its property's schema
/// (JSON literals are what [`parse_calls`] reads, and a model writes them
/// as readily). Property names are written as they are: one that is not a
/// Python name (letters, digits, `_`, and `.` or `-` inside) gives calls
/// that do not parse.
pub(crate) fn call_rules(i: usize, name: &str, params: &Value) -> String {
    let required: Vec<&str> = params
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let empty = Map::new();
    let props = params
        .get("properties")
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    let mut rules = String::new();
    let (mut req, mut opt) = (Vec::new(), Vec::new());
    for (j, (key, schema)) in props.iter().enumerate() {
        let rule = format!("arg{i}_{j}");
        let mut schema = schema.clone();
        bound_json_whitespace(&mut schema);
        let key_eq = Value::String(format!("{key}="));
        rules.push_str(&format!("{rule}: {key_eq} %json {schema}\n"));
        if required.contains(&key.as_str()) {
            req.push(rule);
        } else {
            opt.push(rule);
        }
    }
    let open = Value::String(format!("{name}("));
    let args = if !req.is_empty() {
        let mut s = req.join(" \", \" ");
        for o in &opt {
            s.push_str(&format!(" (\", \" {o})?"));
        }
        s
    } else if !opt.is_empty() {
        // Any of the optional ones in order, or none.
        let starts: Vec<String> = (0..opt.len())
            .map(|k| {
                let mut s = opt[k].clone();
                for o in &opt[k + 1..] {
                    s.push_str(&format!(" (\", \" {o})?"));
                }
                format!("({s})")
            })
            .collect();
        format!("({})?", starts.join(" | "))
    } else {
        String::new()
    };
    rules.push_str(&format!("call{i}: {open} {args} \")\"\n"));
    rules
}

struct Reader<'a> {
    s: &'a str,
    at: usize,
}

impl Reader<'_> {
    fn peek(&self) -> Option<char> {
        self.s[self.at..].chars().next()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.at += c.len_utf8();
        Some(c)
    }

    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(c) {
            self.at += c.len_utf8();
            true
        } else {
            false
        }
    }

    fn space(&mut self) {
        while self.peek().is_some_and(char::is_whitespace) {
            self.bump();
        }
    }

    /// A name: letters, digits, `_`, and `.` or `-` inside.
    fn name(&mut self) -> Option<&str> {
        let from = self.at;
        if !self.peek().is_some_and(|c| c.is_alphabetic() || c == '_') {
            return None;
        }
        while self
            .peek()
            .is_some_and(|c| c.is_alphanumeric() || matches!(c, '_' | '.' | '-'))
        {
            self.bump();
        }
        Some(&self.s[from..self.at])
    }

    fn call(&mut self) -> Option<(String, Value)> {
        let name = self.name()?.to_string();
        self.space();
        if !self.eat('(') {
            return None;
        }
        let mut args = Map::new();
        loop {
            self.space();
            if self.eat(')') {
                break;
            }
            let key = self.name()?.to_string();
            self.space();
            if !self.eat('=') {
                return None;
            }
            self.space();
            let v = self.value()?;
            args.insert(key, v);
            self.space();
            if !self.eat(',') {
                self.space();
                if !self.eat(')') {
                    return None;
                }
                break;
            }
        }
        Some((name, Value::Object(args)))
    }

    fn value(&mut self) -> Option<Value> {
        match self.peek()? {
            '"' | '\'' => self.string().map(Value::String),
            '[' => self.items(']').map(Value::Array),
            '(' => self.items(')').map(Value::Array),
            '{' => self.dict(),
            c if c == '-' || c == '+' || c.is_ascii_digit() => self.number(),
            _ => match self.name()? {
                "True" | "true" => Some(Value::Bool(true)),
                "False" | "false" => Some(Value::Bool(false)),
                "None" | "null" => Some(Value::Null),
                _ => None,
            },
        }
    }

    fn string(&mut self) -> Option<String> {
        let quote = self.bump()?;
        let mut out = String::new();
        loop {
            match self.bump()? {
                c if c == quote => return Some(out),
                '\\' => {
                    let e = self.bump()?;
                    match e {
                        'n' => out.push('\n'),
                        't' => out.push('\t'),
                        'r' => out.push('\r'),
                        '0' => out.push('\0'),
                        'b' => out.push('\u{8}'),
                        'f' => out.push('\u{c}'),
                        'u' | 'x' => {
                            let n = if e == 'u' { 4 } else { 2 };
                            let hex = self.s.get(self.at..self.at + n)?;
                            let code = u32::from_str_radix(hex, 16).ok()?;
                            self.at += n;
                            // A surrogate pair, as JSON writes characters
                            // past the basic plane.
                            if (0xD800..0xDC00).contains(&code)
                                && self.s[self.at..].starts_with("\\u")
                            {
                                let low =
                                    u32::from_str_radix(self.s.get(self.at + 2..self.at + 6)?, 16)
                                        .ok()?;
                                self.at += 6;
                                out.push(char::from_u32(
                                    0x10000
                                        + ((code - 0xD800) << 10)
                                        + (low.checked_sub(0xDC00)?),
                                )?);
                            } else {
                                out.push(char::from_u32(code)?);
                            }
                        }
                        other => out.push(other),
                    }
                }
                c => out.push(c),
            }
        }
    }

    fn number(&mut self) -> Option<Value> {
        let from = self.at;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_digit() || matches!(c, '-' | '+' | '.' | 'e' | 'E' | '_'))
        {
            self.bump();
        }
        let text: String = self.s[from..self.at]
            .chars()
            .filter(|&c| c != '_')
            .collect();
        let text = text.strip_prefix('+').unwrap_or(&text);
        if let Ok(i) = text.parse::<i64>() {
            return Some(Value::Number(i.into()));
        }
        if let Ok(u) = text.parse::<u64>() {
            return Some(Value::Number(u.into()));
        }
        Number::from_f64(text.parse::<f64>().ok()?).map(Value::Number)
    }

    fn items(&mut self, close: char) -> Option<Vec<Value>> {
        self.bump();
        let mut out = Vec::new();
        loop {
            self.space();
            if self.eat(close) {
                return Some(out);
            }
            out.push(self.value()?);
            self.space();
            if !self.eat(',') {
                self.space();
                return self.eat(close).then_some(out);
            }
        }
    }

    fn dict(&mut self) -> Option<Value> {
        self.bump();
        let mut out = Map::new();
        loop {
            self.space();
            if self.eat('}') {
                return Some(Value::Object(out));
            }
            let key = match self.value()? {
                Value::String(s) => s,
                other => other.to_string(),
            };
            self.space();
            if !self.eat(':') {
                return None;
            }
            self.space();
            out.insert(key, self.value()?);
            self.space();
            if !self.eat(',') {
                self.space();
                return self.eat('}').then_some(Value::Object(out));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn python_calls_read_as_json() {
        let calls = parse_calls(
            "[get_weather(city='Oslo', days=3, hourly=True), lookup(q=\"a \\\"b\\\"\\n\", \
             tags=['x', \"y\"], filters={'min': -1.5, \"max\": None}, at=(1, 2),)]",
        )
        .unwrap();
        assert_eq!(calls[0].0, "get_weather");
        assert_eq!(
            calls[0].1,
            json!({"city": "Oslo", "days": 3, "hourly": true})
        );
        assert_eq!(
            calls[1].1,
            json!({"q": "a \"b\"\n", "tags": ["x", "y"], "filters": {"min": -1.5, "max": null}, "at": [1, 2]})
        );
        // One per line, no brackets; JSON literals; no arguments.
        let calls = parse_calls("f(a=true, b=null)\ng()").unwrap();
        assert_eq!(calls[0].1, json!({"a": true, "b": null}));
        assert_eq!(calls[1], ("g".to_string(), json!({})));
        for bad in [
            "",
            "[]",
            "hello there",
            "f(a=)",
            "f(a=1",
            "[f(a=1)",
            "f(1)",
            "f(a=x)",
            "f(a=1) and more",
        ] {
            assert!(parse_calls(bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn json_arguments_written_as_literals_read_back() {
        let args = json!({"s": "it's \"quoted\"\n é 😀", "n": -3, "x": 2.5, "b": false, "z": null,
            "l": [1, "two"], "o": {"k": [true]}});
        let text = format!("[{}]", call_text("f", &args));
        assert!(
            text.contains("b=False") && text.contains("z=None"),
            "{text}"
        );
        assert_eq!(parse_calls(&text).unwrap(), vec![("f".to_string(), args)]);
    }

    #[test]
    fn call_rules_list_required_then_optional_arguments() {
        let params = json!({"type": "object", "properties": {"a": {"type": "integer"},
            "b": {"type": "string"}, "c": {"type": "boolean"}}, "required": ["b"]});
        let rules = call_rules(0, "f", &params);
        assert!(
            rules.contains("call0: \"f(\" arg0_1 (\", \" arg0_0)? (\", \" arg0_2)? \")\""),
            "{rules}"
        );
        let none = call_rules(1, "g", &json!({"type": "object", "properties": {}}));
        assert!(none.contains("call1: \"g(\"  \")\""), "{none}");
        let opt = call_rules(2, "h", &json!({"properties": {"a": {}, "b": {}}}));
        assert!(
            opt.contains("((arg2_0 (\", \" arg2_1)?) | (arg2_1))?"),
            "{opt}"
        );
    }
}
