//! Produces `tests/fixtures/llamacpp_tokens.json`: llama.cpp's token ids for
//! every text of `tests/fixtures/tokenizer_corpus.json`, tokenized with the
//! default model's GGUF (no BOS, control-token text not parsed — the same
//! settings as `Tokenizer::encode(text, Special::AsText, false)`); with
//! arguments `MODEL OUT`, another model's ids into another file (Gemma 3's
//! into `tests/fixtures/llamacpp_tokens_gemma3.json`).
//!
//! Run: `just tokenizer-fixture` (needs cmake and clang; builds llama.cpp).

use anyhow::{Context, Result};
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;

fn main() -> Result<()> {
    let model_path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "models/SmolLM2-135M-Instruct.Q4_1.gguf".into());
    let out_path = std::env::args()
        .nth(2)
        .unwrap_or_else(|| "tests/fixtures/llamacpp_tokens.json".into());
    let corpus: Vec<String> = serde_json::from_str(&std::fs::read_to_string(
        "tests/fixtures/tokenizer_corpus.json",
    )?)?;
    let backend = LlamaBackend::init()?;
    let model = LlamaModel::load_from_file(&backend, &model_path, &LlamaModelParams::default())
        .with_context(|| format!("loading {model_path}"))?;
    let mut cases = Vec::new();
    for text in &corpus {
        let ids: Vec<i32> = model
            .vocab()
            .tokenize(text.as_bytes(), false, false)
            .iter()
            .map(|t| t.0)
            .collect();
        cases.push(serde_json::json!({ "text": text, "ids": ids }));
    }
    let out = serde_json::json!({
        "produced_by": "examples/llamacpp_tokenize.rs (`just tokenizer-fixture`): llama.cpp as shipped by the llama-cpp-2 crate (version in Cargo.lock), llama_tokenize(add_special = false, parse_special = false)",
        "model": model_path,
    });
    // One case per line keeps the fixture readable and its diffs small.
    let lines: Vec<String> = cases
        .iter()
        .map(serde_json::to_string)
        .collect::<Result<_, _>>()?;
    let text = format!(
        "{{\n\"produced_by\": {},\n\"model\": {},\n\"cases\": [\n{}\n]\n}}\n",
        serde_json::to_string(&out["produced_by"])?,
        serde_json::to_string(&out["model"])?,
        lines.join(",\n")
    );
    std::fs::write(&out_path, text)?;
    println!("wrote {out_path} ({} cases)", corpus.len());
    Ok(())
}
