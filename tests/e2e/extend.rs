//! Longer contexts in less memory on the real model: the quantized KV cache
//! types and SelfExtend.

use tessera_engine::{
    CacheDType, EngineConfig, GenerateRequest, Prompt, SamplingParams, SelfExtend, TurnOptions,
};

use super::{engine, PROMPTS};

fn greedy_req(prompt: Prompt, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        sampling: SamplingParams::greedy(),
        max_tokens,
        ignore_eos: true,
        ..GenerateRequest::new(prompt)
    }
}

fn with(t: CacheDType) -> EngineConfig {
    EngineConfig {
        cache_dtype: t,
        ..EngineConfig::default()
    }
}

/// q8_0 and q4_0 caches run every prompt; q8_0 picks the f16 cache's first
/// greedy token on each, and a session saved with q8_0 resumes from its
/// cache in a new engine with the same reply.
#[test]
fn quantized_caches_generate_and_resume_sessions() {
    let f16 = engine(with(CacheDType::F16));
    let q8 = engine(with(CacheDType::Q8_0));
    let q4 = engine(with(CacheDType::Q4_0));
    for p in PROMPTS {
        let req = greedy_req(Prompt::Text(p.to_string()), 12);
        let a = f16.complete(&req, &mut |_| {}).unwrap();
        let b = q8.complete(&req, &mut |_| {}).unwrap();
        let c = q4.complete(&req, &mut |_| {}).unwrap();
        assert_eq!(a.tokens[0], b.tokens[0], "{p}: first token with q8_0");
        assert_eq!(c.tokens.len(), 12, "{p}: q4_0 runs");
    }
    let dir = std::env::temp_dir().join(format!("tessera-e2e-{}-q8", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("q8.tkv");
    let turn = TurnOptions {
        sampling: SamplingParams::greedy(),
        max_tokens: 16,
        ..TurnOptions::default()
    };
    let mut s = q8.chat(Some("You are a helpful assistant."));
    s.send(PROMPTS[0], &turn, &mut |_| {}).unwrap();
    s.save(&path).unwrap();
    let cont = s.send(PROMPTS[2], &turn, &mut |_| {}).unwrap();
    let other = engine(with(CacheDType::Q8_0));
    let mut r = other.load_session(&path).unwrap();
    let resumed = r.send(PROMPTS[2], &turn, &mut |_| {}).unwrap();
    assert_eq!(resumed.tokens, cont.tokens);
    assert!(resumed.usage.cached_tokens > 20);
    // The f16 engine refuses the q8_0 file, saying why.
    let err = f16.load_session(&path).err().unwrap().to_string();
    assert!(err.contains("q8_0"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// SelfExtend on the real model: with a window wider than the request it
/// computes what the engine computes without it; with a small window the
/// positions are compressed as the request runs, it completes, and nothing
/// of it is read from or left in the prefix cache.
#[test]
fn self_extend_runs_and_keeps_its_keys_to_itself() {
    let e = engine(EngineConfig::default());
    let text = PROMPTS.join(" ").repeat(12);
    let prompt = Prompt::Text(text);
    let plain = e
        .complete(&greedy_req(prompt.clone(), 16), &mut |_| {})
        .unwrap();
    assert!(plain.usage.prompt_tokens > 300);
    let held = e.stats().kv.cached_tokens;
    let mut req = greedy_req(prompt, 16);
    req.self_extend = Some(SelfExtend { n: 4, w: 1024 });
    let wide = e.complete(&req, &mut |_| {}).unwrap();
    assert_eq!(wide.tokens, plain.tokens);
    assert_eq!(wide.usage.cached_tokens, 0);
    req.self_extend = Some(SelfExtend { n: 4, w: 64 });
    let narrow = e.complete(&req, &mut |_| {}).unwrap();
    assert_eq!(narrow.tokens.len(), 16);
    assert_eq!(narrow.usage.cached_tokens, 0);
    assert_eq!(e.stats().kv.cached_tokens, held);
}
