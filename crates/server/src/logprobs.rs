//! Log-probabilities in OpenAI's two shapes: chat's `logprobs.content`
//! (token, logprob, bytes, top_logprobs) and completions' parallel lists
//! (tokens, token_logprobs, top_logprobs, text_offset).

use serde_json::{json, Map, Value};
use tessera_engine::TokenLogprob;
use tessera_model::Tokenizer;

/// The text of a token as it appears in a logprobs list (U+FFFD for a
/// token that ends inside a character: its `bytes` are exact).
fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id]).unwrap_or_default()
}

fn entry(tok: &Tokenizer, id: u32, logprob: f32) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("token".into(), json!(token_text(tok, id)));
    m.insert("logprob".into(), json!(finite(logprob)));
    m.insert("bytes".into(), json!(tok.token_bytes(id)));
    m
}

/// JSON has no -inf: a token the model gives no probability at all gets
/// OpenAI's floor of -9999.
fn finite(x: f32) -> f32 {
    if x.is_finite() {
        x
    } else {
        -9999.0
    }
}

/// Chat: `{"content": [...], "refusal": null}`.
pub fn chat(tok: &Tokenizer, lps: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = lps
        .iter()
        .map(|lp| {
            let mut e = entry(tok, lp.id, lp.logprob);
            let top: Vec<Value> = lp
                .top
                .iter()
                .map(|&(t, l)| Value::Object(entry(tok, t, l)))
                .collect();
            e.insert("top_logprobs".into(), Value::Array(top));
            Value::Object(e)
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// Completions: parallel lists; `offset` is where the first token's text
/// starts in the choice's text (for streamed chunks).
pub fn completion(tok: &Tokenizer, lps: &[TokenLogprob], offset: usize) -> Value {
    let mut at = offset;
    let (mut tokens, mut logprobs, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for lp in lps {
        let text = token_text(tok, lp.id);
        offsets.push(at);
        at += text.len();
        tokens.push(text);
        logprobs.push(finite(lp.logprob));
        let top: Map<String, Value> = lp
            .top
            .iter()
            .map(|&(t, l)| (token_text(tok, t), json!(finite(l))))
            .collect();
        tops.push(Value::Object(top));
    }
    json!({
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    })
}

/// Where text after these tokens starts, given where they started.
pub fn end_offset(tok: &Tokenizer, lps: &[TokenLogprob], offset: usize) -> usize {
    offset
        + lps
            .iter()
            .map(|l| token_text(tok, l.id).len())
            .sum::<usize>()
}
