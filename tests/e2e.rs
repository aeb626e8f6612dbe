//! End-to-end tests on the real default model (SmolLM2-135M-Instruct Q4_1,
//! fetched by `just model`, which `just test` runs first).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tessera_engine::{Engine, EngineConfig, GenerateRequest, Message, Prompt, SamplingParams};
use tessera_kernels::Activations;
use tessera_model::testing::{dense_greedy, max_diff, paged_greedy, ScatteredPrompt};
use tessera_model::{Model, Special};

#[path = "e2e/cache.rs"]
mod cache;
#[path = "e2e/draft.rs"]
mod draft;
#[path = "e2e/extend.rs"]
mod extend;
#[path = "e2e/gemma.rs"]
mod gemma;
#[path = "e2e/structured.rs"]
mod structured;

/// `models/FILE`, which `just model ARGS` fetches (as `just test` does).
pub(crate) fn models_file(file: &str, fetch: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(file);
    assert!(
        p.exists(),
        "{} is missing: run `just model{fetch}` (or `just test`, which fetches it)",
        p.display()
    );
    p
}

pub(crate) fn model_path() -> PathBuf {
    models_file("SmolLM2-135M-Instruct.Q4_1.gguf", "")
}

fn model() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| Model::load(&model_path(), &mut |_, _| {}).expect("default model loads"))
}

/// The real model with f32 activations (a second instance, so that tests
/// running beside each other never see the mode change): the arithmetic
/// of the candle reference, for the tests that compare against it.
fn model_f32() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| {
        let m = Model::load(&model_path(), &mut |_, _| {}).expect("default model loads");
        m.llama.set_activations(Activations::F32);
        m
    })
}

pub(crate) fn engine(cfg: EngineConfig) -> Engine {
    Engine::from_model(Model::load(&model_path(), &mut |_, _| {}).unwrap(), cfg).unwrap()
}

const PROMPTS: &[&str] = &[
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash map is in one paragraph.",
    "List three colors of the rainbow.",
    "def fibonacci(n):",
];

#[test]
fn paged_cache_matches_a_dense_f32_cache() {
    let m = model_f32();
    for (i, p) in PROMPTS.iter().enumerate() {
        let ids = if i < 4 {
            m.template
                .encode(&m.tokenizer, &[Message::new("user", *p)], true)
                .unwrap()
        } else {
            m.tokenizer.encode(p, Special::AsText, true).unwrap()
        };
        let (dense, dl) = dense_greedy(&m.llama, &ids, 64).unwrap();
        let (paged, pl) =
            paged_greedy(&m.llama, &ids, 64, usize::MAX, tessera_kernels::KvType::F32).unwrap();
        assert_eq!(paged, dense, "prompt {p:?}");
        // Same weights, same f32 arithmetic; only the attention's summation
        // order differs (blockwise online softmax versus one softmax), which
        // moves logits (magnitude ~10-30) by ~1e-4. 1e-2 leaves a margin
        // while catching any real mix-up, which moves them by whole units.
        let d = max_diff(&pl, &dl);
        assert!(d < 1e-2, "prompt {p:?}: logits differ by {d}");
    }
}

/// The fast CPU forward against the candle reference on the real model
/// (f32 cache, so that no f16 rounding of K/V amplifies the differences):
/// the same greedy tokens, logits within rounding (different summation
/// orders and SiLU's exponential) with f32 activations, and within the
/// two-level quantization's error with the default activations.
#[test]
fn fast_forward_matches_the_candle_reference_on_the_real_model() {
    let m = model_f32();
    let ids = m
        .template
        .encode(&m.tokenizer, &[Message::new("user", PROMPTS[1])], true)
        .unwrap();
    let n = ids.len();
    let bs = 16;
    let nb = n.div_ceil(bs) + 1;
    let layout = ScatteredPrompt::new(n, nb, bs);
    let picks: Vec<u32> = (0..n as u32).collect();
    let batch = layout.batch(&ids, &picks);
    let cache = m
        .llama
        .new_cache(nb, bs, tessera_kernels::KvType::F32)
        .unwrap();
    let reference = m.llama.forward_reference(&batch, &cache).unwrap();
    let r = reference.to_vec2::<f32>().unwrap();
    let argmax = |v: &[f32]| (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap();
    // Logits here are of magnitude 10-30: f32 activations differ from the
    // reference by ~1e-3, two int8 levels by ~2e-2.
    for (m, tol) in [(m, 1e-2), (model(), 6e-2)] {
        let fast = m.llama.forward_threads(&batch, &cache, 2).unwrap();
        let f = fast.to_vec2::<f32>().unwrap();
        let acts = m.llama.activations();
        let d = max_diff(&f, &r);
        assert!(d < tol, "{acts:?}: logits differ by {d}");
        let same = f
            .iter()
            .zip(&r)
            .filter(|(a, b)| argmax(a) == argmax(b))
            .count();
        assert!(
            same + 1 >= n,
            "{acts:?}: top-1 agrees at {same} of {n} positions"
        );
    }
}

/// Random prompts sharing prefixes, random chunk sizes, batch
/// compositions and worker counts, with and without reusing cached prefix
/// blocks: every logits row is the same bits as the sequence computed
/// alone.
#[test]
fn real_model_logits_are_the_same_bits_in_any_batch() {
    let m = model();
    for seed in 0..4 {
        for share in [false, true] {
            let n = tessera_model::testing::batch_invariance_case(
                &m.llama,
                100 + seed,
                m.tokenizer.vocab_size() as u32,
                share,
                tessera_kernels::KvType::F16,
            )
            .unwrap();
            assert!(n > 0);
        }
    }
}

#[test]
fn chunked_and_token_by_token_prefill_continue_identically() {
    let m = model();
    let ids = m
        .template
        .encode(&m.tokenizer, &[Message::new("user", PROMPTS[2])], true)
        .unwrap();
    let (whole, _) =
        paged_greedy(&m.llama, &ids, 32, usize::MAX, tessera_kernels::KvType::F16).unwrap();
    let (sevens, _) = paged_greedy(&m.llama, &ids, 32, 7, tessera_kernels::KvType::F16).unwrap();
    let (ones, _) = paged_greedy(&m.llama, &ids, 32, 1, tessera_kernels::KvType::F16).unwrap();
    assert_eq!(sevens, whole);
    assert_eq!(ones, whole);
    // And through the engine with its own chunking.
    let req = GenerateRequest {
        max_tokens: 32,
        sampling: SamplingParams::greedy(),
        ignore_eos: true,
        ..GenerateRequest::new(Prompt::Tokens(ids.clone()))
    };
    let out: Vec<Vec<u32>> = [usize::MAX, 7, 1]
        .iter()
        .map(|&c| {
            let e = engine(EngineConfig {
                prefill_chunk: c,
                prefix_cache: false,
                ..EngineConfig::default()
            });
            e.complete(&req, &mut |_| {}).unwrap().tokens
        })
        .collect();
    assert_eq!(out[0], whole);
    assert_eq!(out[1], whole);
    assert_eq!(out[2], whole);
}

#[test]
fn the_capital_of_france_is_paris() {
    let e = engine(EngineConfig::default());
    let req = GenerateRequest {
        max_tokens: 32,
        sampling: SamplingParams::greedy(),
        ..GenerateRequest::new(Prompt::Chat(vec![Message::new(
            "user",
            "What is the capital of France?",
        )]))
    };
    let mut streamed = String::new();
    let done = e
        .complete(&req, &mut |ev| streamed.push_str(ev.text))
        .unwrap();
    assert!(done.text.contains("Paris"), "{:?}", done.text);
    assert_eq!(streamed, done.text);
    assert_eq!(done.finish_reason.as_str(), "stop");
    // The same request again hits the prefix cache for all but one token.
    let again = e.complete(&req, &mut |_| {}).unwrap();
    assert_eq!(again.usage.cached_tokens, again.usage.prompt_tokens - 1);
    assert_eq!(again.text, done.text);
}

fn corpus() -> Vec<String> {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer_corpus.json"),
    )
    .unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn tokenizer_round_trips_a_varied_corpus() {
    let tok = &model().tokenizer;
    for text in corpus() {
        let ids = tok.encode(&text, Special::AsText, false).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), text);
        // Streaming gives the same text, in valid pieces.
        let mut s = tok.stream();
        let mut out = String::new();
        for &id in &ids {
            out.extend(s.push(tok, id).unwrap());
        }
        out.extend(s.finish(tok).unwrap());
        assert_eq!(out, text);
    }
}

/// llama.cpp's ids for the corpus, from a fixture of
/// `just tokenizer-fixture`: (text, ids).
fn llamacpp_ids(fixture: &str) -> Vec<(String, Vec<u32>)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(fixture);
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert_eq!(
        cases.len(),
        corpus().len(),
        "fixture is stale: run `just tokenizer-fixture`"
    );
    cases
        .iter()
        .map(|c| {
            let text = c["text"].as_str().unwrap().to_string();
            (text, serde_json::from_value(c["ids"].clone()).unwrap())
        })
        .collect()
}

#[test]
fn tokenizer_ids_equal_llama_cpp() {
    let tok = &model().tokenizer;
    for (text, want) in llamacpp_ids("llamacpp_tokens.json") {
        let text = text.as_str();
        assert_eq!(
            tok.encode(text, Special::AsText, false).unwrap(),
            want,
            "{text:?}"
        );
    }
}

/// Gemma 3's tokenizer (SentencePiece-style, 262,144 tokens, read from
/// its GGUF) gives llama.cpp's ids.
#[test]
fn gemma3_tokenizer_ids_equal_llama_cpp() {
    let gguf = gemma::gemma_path();
    let tok = tessera_model::Tokenizer::from_gguf(&tessera_model::GgufFile::open(&gguf).unwrap())
        .unwrap();
    assert_eq!(tok.vocab_size(), 262_144);
    let cases = llamacpp_ids("llamacpp_tokens_gemma3.json");
    let mut wrong = Vec::new();
    for (text, want) in &cases {
        let got = tok.encode(text, Special::AsText, false).unwrap();
        if &got != want {
            wrong.push(format!("{text:?}: {got:?} vs llama.cpp {want:?}"));
        }
        assert_eq!(&tok.decode(&got).unwrap(), text, "round trip");
    }
    assert!(
        wrong.is_empty(),
        "{} of {} differ:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n")
    );
}

#[test]
fn generation_stops_before_a_stop_string_and_at_max_tokens() {
    let e = engine(EngineConfig {
        prefix_cache: false,
        ..EngineConfig::default()
    });
    let prompt = Prompt::Chat(vec![Message::new(
        "user",
        "Write a short story about a robot.",
    )]);
    let base = GenerateRequest {
        max_tokens: 40,
        sampling: SamplingParams::greedy(),
        ..GenerateRequest::new(prompt)
    };
    let full = e.complete(&base, &mut |_| {}).unwrap();
    assert_eq!(full.usage.completion_tokens, 40);
    assert_eq!(full.finish_reason.as_str(), "length");
    // Stop at a word from the middle of the greedy text.
    let words: Vec<&str> = full.text.split_whitespace().collect();
    let stop = words[words.len() / 2].to_string();
    let at = full.text.find(&stop).unwrap();
    let mut streamed = String::new();
    let req = GenerateRequest {
        stop: vec![stop.clone()],
        ..base
    };
    let cut = e
        .complete(&req, &mut |ev| streamed.push_str(ev.text))
        .unwrap();
    assert_eq!(cut.text, full.text[..at], "stop {stop:?}");
    assert_eq!(streamed, cut.text, "the stop string is never streamed");
    assert_eq!(cut.finish_reason.as_str(), "stop");
}
