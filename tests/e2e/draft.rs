//! Speculative decoding with a draft model on the real models: the output
//! is the tokens of plain decoding (greedy and sampled, requests running
//! together, constrained or not, sliding-window layers included); drafts
//! are made and kept; a draft model of another tokenizer is refused.

use std::path::Path;

use tessera_engine::{
    Completion, Constraint, DraftModelConfig, Engine, EngineConfig, EngineError, Event,
    GenerateRequest, Message, ModelSource, NgramSpec, Prompt, SamplingParams,
};
use tessera_model::Model;

use super::gemma::gemma_path;
use super::model_path;

fn with_draft(model: &Path, draft: &Path) -> Engine {
    Engine::from_model(
        Model::load(model, &mut |_, _| {}).unwrap(),
        EngineConfig {
            draft: Some(DraftModelConfig::new(ModelSource::Path(
                draft.to_path_buf(),
            ))),
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

fn plain(model: &Path) -> Engine {
    Engine::from_model(
        Model::load(model, &mut |_, _| {}).unwrap(),
        EngineConfig::default(),
    )
    .unwrap()
}

fn requests(prompts: &[&str], chat: bool) -> Vec<GenerateRequest> {
    let mut out = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let prompt = if chat {
            Prompt::Chat(vec![Message::new("user", *p)])
        } else {
            Prompt::Text(p.to_string())
        };
        for sampling in [
            SamplingParams::greedy(),
            SamplingParams {
                temperature: 0.8,
                seed: 5 + i as u64,
                ..SamplingParams::default()
            },
        ] {
            out.push(GenerateRequest {
                sampling,
                max_tokens: 64,
                ..GenerateRequest::new(prompt.clone())
            });
        }
    }
    out
}

/// Every request at once; their completions in order.
fn together(e: &Engine, reqs: &[GenerateRequest]) -> Vec<Completion> {
    let streams: Vec<_> = reqs
        .iter()
        .map(|r| e.generate(r.clone()).unwrap())
        .collect();
    streams
        .into_iter()
        .map(|s| {
            s.filter_map(|ev| match ev {
                Event::Done(c) => Some(*c),
                Event::Error(e) => panic!("{e}"),
                _ => None,
            })
            .next()
            .expect("a completion")
        })
        .collect()
}

const PROMPTS: &[&str] = &[
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.",
    "Write a haiku about the sea.",
    "List the days of the week.",
];

#[test]
fn a_draft_model_gives_the_tokens_of_plain_decoding() {
    let m = model_path();
    let reqs = requests(PROMPTS, true);
    let want = together(&plain(&m), &reqs);
    // The model as its own draft: the same file, loaded a second time.
    let e = with_draft(&m, &m);
    let got = together(&e, &reqs);
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.tokens, w.tokens, "{:?} / {:?}", g.text, w.text);
    }
    let s = e.stats();
    assert!(
        s.spec_draft_tokens > 0 && s.spec_accepted_tokens > 0,
        "{s:?}"
    );
    let per_request: usize = got.iter().map(|c| c.usage.draft_tokens).sum();
    assert_eq!(per_request as u64, s.spec_draft_tokens);
    // The cost of a guess was measured (the steps' line, and a draft model
    // as large as the model itself: most of a token a guess).
    assert!(s.spec_guess_cost_ppm > 100_000, "{s:?}");
    // Greedy guesses of the model itself are kept, nearly all (the same
    // weights; a batch of one against a batch of several differs only in
    // where a tie might fall).
    let greedy: (usize, usize) = got
        .iter()
        .step_by(2)
        .map(|c| (c.usage.draft_tokens, c.usage.accepted_draft_tokens))
        .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    assert!(greedy.1 * 10 >= greedy.0 * 9, "{greedy:?}");
    e.check_kv().unwrap();
    let d = s.draft_kv.expect("a draft cache");
    assert_eq!(d.sequences, 0);
    assert!(d.cached_tokens > 0, "{d:?}");

    // A chat's next turn: its history comes from the draft's prefix cache.
    let turn = GenerateRequest {
        max_tokens: 6,
        ..reqs[0].clone()
    };
    let before = e.stats().draft_kv.unwrap();
    let again = together(&e, std::slice::from_ref(&turn));
    assert_eq!(again[0].tokens[..], want[0].tokens[..6]);
    let after = e.stats().draft_kv.unwrap();
    assert_eq!(
        after.cow_copies,
        before.cow_copies + 1,
        "the prompt's tail block was reused"
    );

    // Off for one request: no drafts.
    let off = GenerateRequest {
        speculative: Some(NgramSpec {
            max_draft: 0,
            ..NgramSpec::default()
        }),
        ..reqs[1].clone()
    };
    let c = together(&e, &[off]).remove(0);
    assert_eq!((c.usage.draft_tokens, &c.tokens), (0, &want[1].tokens));

    // Constrained: drafts are checked under the mask.
    let json = GenerateRequest {
        constraint: Some(Constraint::JsonObject),
        max_tokens: 96,
        ..GenerateRequest::new(Prompt::Chat(vec![Message::new(
            "user",
            "Give me a JSON object describing a cat.",
        )]))
    };
    let a = together(&e, std::slice::from_ref(&json)).remove(0);
    let b = together(&plain(&m), &[json]).remove(0);
    assert_eq!(a.tokens, b.tokens);
}

/// Gemma 3's sliding-window layers in the draft's own cache: the model as
/// its own draft gives plain decoding's tokens.
#[test]
fn a_draft_model_with_sliding_window_layers() {
    let g = gemma_path();
    let reqs = requests(
        &[
            "The capital of France is",
            "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        ],
        false,
    );
    let want = together(&plain(&g), &reqs);
    let e = with_draft(&g, &g);
    let got = together(&e, &reqs);
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.tokens, w.tokens, "{:?} / {:?}", g.text, w.text);
    }
    assert!(e.stats().spec_accepted_tokens > 0);
    e.check_kv().unwrap();
}

#[test]
fn a_draft_model_of_another_tokenizer_is_refused() {
    let e = Engine::from_model(
        Model::load(&model_path(), &mut |_, _| {}).unwrap(),
        EngineConfig {
            draft: Some(DraftModelConfig::new(ModelSource::Path(gemma_path()))),
            ..EngineConfig::default()
        },
    );
    match e {
        Err(EngineError::Invalid(why)) => assert!(why.contains("tokenizer"), "{why}"),
        Err(other) => panic!("{other}"),
        Ok(_) => panic!("a draft of another vocabulary was taken"),
    }
}
