//! The engine's KV-cache behaviour on the real model: reuse across turns
//! and sessions, forks, a pool too small for the load, sessions on disk,
//! the cache directory, context shift, defragmentation, cancellation and
//! concurrent callers.

use std::path::PathBuf;

use tessera_engine::{
    ContextShift, Engine, EngineConfig, EngineError, Event, Fault, FaultHook, FinishReason,
    GenerateRequest, Message, Prompt, SamplingParams, TurnOptions,
};

use super::engine;

const SYSTEM: &str = "You are Tessa, the assistant of a small public library in a mountain \
town. You help visitors find books, explain how to borrow and return them, and answer general \
questions about the town and the world. The library opens at nine in the morning and closes at \
six in the evening from Monday to Saturday; it is closed on Sundays and public holidays. Members \
may borrow up to eight books at a time for three weeks, and may renew a loan twice unless another \
member has reserved the book. Late returns cost ten cents a day per book. Children under twelve \
borrow for free and need a parent to sign their card. The reading room on the first floor is \
quiet; the café on the ground floor serves tea, coffee and cake. There is free wireless internet \
everywhere in the building, and four computers may be booked for one hour at a time at the front \
desk. You answer every question briefly and politely, in plain English, in one or two sentences, \
and you never use lists.";

const USERS: [&str; 10] = [
    "Hello! Who are you?",
    "What is the capital of France?",
    "Name a famous river in Europe.",
    "How many legs does a spider have?",
    "What colour is the sky on a clear day?",
    "Give me a word that rhymes with cat.",
    "What is two plus three?",
    "Which planet is closest to the sun?",
    "What do bees make?",
    "Say goodbye in French.",
];

fn greedy(max_tokens: usize) -> TurnOptions {
    TurnOptions {
        sampling: SamplingParams::greedy(),
        max_tokens,
        ..TurnOptions::default()
    }
}

fn no_reuse() -> EngineConfig {
    EngineConfig {
        prefix_cache: false,
        ..EngineConfig::default()
    }
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tessera-e2e-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn a_ten_turn_chat_with_reuse_equals_one_without_and_is_served_from_cache() {
    let with = engine(EngineConfig::default());
    let without = engine(no_reuse());
    let mut a = with.chat(Some(SYSTEM));
    let mut b = without.chat(Some(SYSTEM));
    for (i, u) in USERS.iter().enumerate() {
        let x = a.send(u, &greedy(24), &mut |_| {}).unwrap();
        let y = b.send(u, &greedy(24), &mut |_| {}).unwrap();
        assert_eq!(x.text, y.text, "turn {}", i + 1);
        assert_eq!(x.usage.prompt_tokens, y.usage.prompt_tokens);
        assert_eq!(y.usage.cached_tokens, 0);
        if i > 0 {
            let u = x.usage;
            assert!(
                u.cached_tokens * 10 >= u.prompt_tokens * 9,
                "turn {}: {} of {} cached",
                i + 1,
                u.cached_tokens,
                u.prompt_tokens
            );
        }
    }
    assert!(with.stats().hit_ratio() > 0.8);
}

fn live_blocks(e: &Engine) -> usize {
    let k = e.kv_stats();
    k.num_blocks - k.free_blocks
}

#[test]
fn two_sessions_sharing_a_system_prompt_use_fewer_blocks_than_apart() {
    let system = SYSTEM.repeat(6);
    let together = engine(EngineConfig::default());
    let mut s1 = together.chat(Some(&system));
    let mut s2 = together.chat(Some(&system));
    s1.send(USERS[0], &greedy(8), &mut |_| {}).unwrap();
    let second = s2.send(USERS[1], &greedy(8), &mut |_| {}).unwrap();
    let system_tokens = together
        .model()
        .template
        .encode(
            &together.model().tokenizer,
            &[Message::new("system", system.clone())],
            false,
        )
        .unwrap()
        .len();
    assert!(second.usage.cached_tokens >= system_tokens);
    let shared = live_blocks(&together);

    let (e1, e2) = (
        engine(EngineConfig::default()),
        engine(EngineConfig::default()),
    );
    e1.chat(Some(&system))
        .send(USERS[0], &greedy(8), &mut |_| {})
        .unwrap();
    e2.chat(Some(&system))
        .send(USERS[1], &greedy(8), &mut |_| {})
        .unwrap();
    let apart = live_blocks(&e1) + live_blocks(&e2);
    assert!(
        shared + system_tokens / 16 <= apart,
        "{shared} blocks together, {apart} apart"
    );
}

#[test]
fn forked_samples_equal_single_runs_and_release_every_block() {
    let e = engine(EngineConfig::default());
    let sampling = SamplingParams {
        temperature: 1.0,
        seed: 11,
        ..SamplingParams::default()
    };
    let req = GenerateRequest {
        n: 3,
        max_tokens: 24,
        sampling: sampling.clone(),
        ..GenerateRequest::new(Prompt::Chat(vec![Message::new(
            "user",
            "Tell me a very short story about a fox.",
        )]))
    };
    let mut streamed = vec![String::new(); 3];
    let samples = e
        .complete_n(&req, &mut |ev| streamed[ev.index].push_str(ev.text))
        .unwrap();
    assert_eq!(samples.len(), 3);
    for (i, s) in samples.iter().enumerate() {
        assert_eq!(s.index, i);
        assert_eq!(streamed[i], s.text);
    }
    assert!(
        samples[0].text != samples[1].text || samples[1].text != samples[2].text,
        "samples should differ: {samples:?}"
    );
    assert_eq!(e.kv_stats().used_blocks, 0, "every sequence was freed");
    // Each fork continues exactly as a lone request with its seed would.
    let alone = engine(no_reuse());
    for (i, s) in samples.iter().enumerate() {
        let single = GenerateRequest {
            n: 1,
            sampling: SamplingParams {
                seed: sampling.seed + i as u64,
                ..sampling.clone()
            },
            ..req.clone()
        };
        let one = alone.complete(&single, &mut |_| {}).unwrap();
        assert_eq!(one.tokens, s.tokens, "sample {i}");
    }
}

/// Six requests run at once through the scheduler.
fn run_all(e: &Engine, prompts: &[String]) -> Vec<Vec<u32>> {
    run_all_results(e, prompts)
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
        .collect()
}

/// Runs the prompts concurrently; the tokens of each, or its error.
fn run_all_results(e: &Engine, prompts: &[String]) -> Vec<Result<Vec<u32>, String>> {
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| {
            e.generate(GenerateRequest {
                max_tokens: 40,
                sampling: SamplingParams::greedy(),
                ignore_eos: true,
                ..GenerateRequest::new(Prompt::Chat(vec![Message::new("user", p.clone())]))
            })
            .unwrap()
        })
        .collect();
    streams
        .into_iter()
        .map(|s| {
            let mut out = Err("no end".to_string());
            for ev in s {
                match ev {
                    Event::Done(c) => out = Ok(c.tokens),
                    Event::Error(e) => out = Err(e.to_string()),
                    Event::Token { .. } => {}
                }
            }
            out
        })
        .collect()
}

/// Faults injected into the steps of concurrent chats on the real model:
/// the request whose every step past its prompt fails gets an error, the
/// one whose decode panics once beside others is retried, and every other request
/// gives exactly the tokens of a run without faults; nothing leaks, and
/// afterwards the failed prompt runs normally from what the cache holds.
#[test]
fn injected_faults_fail_only_the_request_at_fault_on_the_real_model() {
    let prompts: Vec<String> = USERS[..4].iter().map(|u| u.to_string()).collect();
    let clean = engine(EngineConfig::default());
    let want = run_all(&clean, &prompts);
    let ids = |u: &str| {
        clean
            .tokenize_prompt(&Prompt::Chat(vec![Message::new("user", u)]))
            .unwrap()
    };
    let (always, once) = (ids(USERS[1]), ids(USERS[2]));
    let armed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let fired = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (a, f) = (armed.clone(), fired.clone());
    use std::sync::atomic::Ordering::SeqCst;
    let hook = FaultHook::new(move |sites| {
        if !a.load(SeqCst) {
            return None;
        }
        if sites
            .iter()
            .any(|s| s.prompt == always && s.start >= always.len())
        {
            return Some(Fault::Error);
        }
        // Once, in a step shared with other requests (alone in a failing
        // step, a request fails by design).
        if sites.len() > 1
            && sites
                .iter()
                .any(|s| s.prompt == once && s.start > once.len())
            && !f.swap(true, SeqCst)
        {
            return Some(Fault::Panic);
        }
        None
    });
    let faulty = engine(EngineConfig {
        faults: Some(hook),
        ..EngineConfig::default()
    });
    let got = run_all_results(&faulty, &prompts);
    assert!(fired.load(SeqCst));
    assert_eq!(got[1], Err("injected fault".to_string()));
    for i in [0, 2, 3] {
        assert_eq!(got[i].as_ref(), Ok(&want[i]), "prompt {i}");
    }
    let stats = faulty.stats();
    assert!(
        stats.failed_steps >= 2 && stats.failed_requests == 1,
        "{stats:?}"
    );
    assert_eq!((stats.kv.used_blocks, stats.kv.sequences), (0, 0));
    faulty.check_kv().unwrap();
    armed.store(false, SeqCst);
    let again = run_all(&faulty, &prompts);
    assert_eq!(again, want);
    assert!(faulty.stats().cached_tokens > 0);
}

#[test]
fn a_pool_too_small_for_all_requests_completes_each_with_the_large_pool_output() {
    let prompts: Vec<String> = USERS[..6].iter().map(|u| u.to_string()).collect();
    let large = engine(EngineConfig::default());
    let want = run_all(&large, &prompts);
    // Room for about two of the six at their full length.
    let small = engine(EngineConfig {
        kv_memory: 16 * 23_040 * 14,
        ..EngineConfig::default()
    });
    let got = run_all(&small, &prompts);
    assert_eq!(got, want);
    let stats = small.stats();
    assert!(stats.preemptions > 0, "{stats:?}");
    assert_eq!(stats.kv.used_blocks, 0);
    // A request that cannot fit even alone is refused with the numbers.
    let err = small
        .generate(GenerateRequest {
            max_tokens: 1000,
            ..GenerateRequest::new(Prompt::Text("Hello".into()))
        })
        .err()
        .unwrap();
    assert!(
        matches!(err, EngineError::OutOfKvMemory { total: 14, .. }),
        "{err}"
    );
}

#[test]
fn a_saved_session_resumes_in_a_new_engine_from_cache() {
    let dir = temp_dir("session");
    let path = dir.join("chat.tkv");
    let first = engine(EngineConfig::default());
    let mut s = first.chat(Some(SYSTEM));
    for u in &USERS[..3] {
        s.send(u, &greedy(20), &mut |_| {}).unwrap();
    }
    s.save(&path).unwrap();
    let history = s.token_ids().len();
    let cont = s.send(USERS[3], &greedy(20), &mut |_| {}).unwrap();
    drop(s);
    drop(first);

    let second = engine(EngineConfig::default());
    let mut r = second.load_session(&path).unwrap();
    assert_eq!(r.messages().len(), 7);
    let resumed = r.send(USERS[3], &greedy(20), &mut |_| {}).unwrap();
    assert_eq!(resumed.text, cont.text);
    assert_eq!(resumed.usage.prompt_tokens, cont.usage.prompt_tokens);
    assert!(
        resumed.usage.cached_tokens >= history - 1,
        "{} of {history} history tokens cached",
        resumed.usage.cached_tokens
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn damaged_session_files_are_refused_with_the_reason_and_harm_nothing() {
    let dir = temp_dir("damaged");
    let good = dir.join("good.tkv");
    let e = engine(EngineConfig::default());
    let mut s = e.chat(Some(SYSTEM));
    s.send(USERS[0], &greedy(8), &mut |_| {}).unwrap();
    s.save(&good).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let check = |name: &str, data: &[u8], want: &str| {
        let p = dir.join(name);
        std::fs::write(&p, data).unwrap();
        let err = e.load_session(&p).err().expect(name).to_string();
        assert!(err.contains(want), "{name}: {err}");
        assert!(
            err.contains(name),
            "{name}: the error names the file: {err}"
        );
    };
    check("truncated.tkv", &bytes[..bytes.len() / 2], "truncated");
    let mut flipped = bytes.clone();
    let at = bytes.len() - 100;
    flipped[at] ^= 0x40;
    check("flipped.tkv", &flipped, "checksum");
    let mut version = bytes.clone();
    version[8] = 99;
    check("version.tkv", &version, "format version 99");
    check("other.tkv", b"GGUF not a session at all", "magic");
    // Another model: a different cache dtype gives a different geometry.
    let f32_engine = engine(EngineConfig {
        cache_dtype: tessera_engine::CacheDType::F32,
        ..EngineConfig::default()
    });
    let err = f32_engine.load_session(&good).err().unwrap().to_string();
    assert!(err.contains("cache dtype f16"), "{err}");
    // The engine still works and the good file still loads.
    let mut r = e.load_session(&good).unwrap();
    r.send(USERS[1], &greedy(8), &mut |_| {}).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_cache_dir_keeps_the_cache_warm_across_restarts() {
    let dir = temp_dir("cache-dir");
    let cfg = EngineConfig {
        cache_dir: Some(dir.clone()),
        ..EngineConfig::default()
    };
    let req = GenerateRequest {
        max_tokens: 16,
        sampling: SamplingParams::greedy(),
        ..GenerateRequest::new(Prompt::Chat(vec![
            Message::new("system", SYSTEM),
            Message::new("user", USERS[1]),
        ]))
    };
    let cold = {
        let e = engine(cfg.clone());
        e.complete(&req, &mut |_| {}).unwrap()
        // Dropping the engine writes the cache.
    };
    assert_eq!(cold.usage.cached_tokens, 0);
    assert!(dir.join(tessera_engine::CACHE_FILE).exists());
    let e = engine(cfg);
    let warm = e.complete(&req, &mut |_| {}).unwrap();
    assert_eq!(warm.usage.cached_tokens, warm.usage.prompt_tokens - 1);
    assert_eq!(warm.text, cold.text);
    drop(e);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn generation_goes_on_past_four_contexts_with_context_shift() {
    let e = engine(EngineConfig {
        context_length: Some(64),
        ..EngineConfig::default()
    });
    let prompt = Prompt::Chat(vec![Message::new("user", "Count from one to a thousand.")]);
    let req = GenerateRequest {
        max_tokens: 300,
        sampling: SamplingParams::greedy(),
        ignore_eos: true,
        context_shift: ContextShift::Keep(8),
        ..GenerateRequest::new(prompt.clone())
    };
    let done = e.complete(&req, &mut |_| {}).unwrap();
    assert_eq!(done.usage.completion_tokens, 300);
    assert!(e.kv_stats().shifts >= 4, "{:?}", e.kv_stats());
    // With shifting off, the context ends the request.
    let off = e
        .complete(
            &GenerateRequest {
                context_shift: ContextShift::Off,
                ..req
            },
            &mut |_| {},
        )
        .unwrap();
    assert_eq!(off.finish_reason, FinishReason::Length);
    assert!(off.usage.prompt_tokens + off.usage.completion_tokens <= 65);
}

#[test]
fn defragmenting_and_shrinking_change_no_output() {
    // No automatic defragmentation: the test decides when to compact.
    let e = engine(EngineConfig {
        defrag_threshold: 1.0,
        ..EngineConfig::default()
    });
    let req = |u: &str| GenerateRequest {
        max_tokens: 40,
        sampling: SamplingParams::greedy(),
        ignore_eos: true,
        ..GenerateRequest::new(Prompt::Chat(vec![Message::new("user", u)]))
    };
    let first: Vec<Vec<u32>> = USERS[..3]
        .iter()
        .map(|u| e.complete(&req(u), &mut |_| {}).unwrap().tokens)
        .collect();
    // Shrinking below what is live evicts the least recently used blocks
    // (the first conversation's tail, low in the pool), compacts the rest
    // into the holes, and gives the top of the pool back.
    let live = live_blocks(&e);
    e.shrink_to(e.block_bytes() * (live - 2)).unwrap();
    let k = e.kv_stats();
    assert_eq!(k.num_blocks, live - 2);
    assert!(k.defrag_moves > 0, "{k:?}");
    assert_eq!(e.defragment().unwrap(), 0, "already compact");
    for (i, u) in USERS[..3].iter().enumerate().rev() {
        let again = e.complete(&req(u), &mut |_| {}).unwrap();
        assert_eq!(again.tokens, first[i], "request {i}");
        if i > 0 {
            assert_eq!(again.usage.cached_tokens, again.usage.prompt_tokens - 1);
        }
    }
    // And the pool grows back.
    e.resize_kv(e.block_bytes() * 64).unwrap();
    assert_eq!(e.kv_stats().num_blocks, 64);
}

#[test]
fn dropping_a_stream_cancels_and_cancel_reports_it() {
    let e = engine(EngineConfig::default());
    let req = GenerateRequest {
        max_tokens: 500,
        ignore_eos: true,
        sampling: SamplingParams::greedy(),
        ..GenerateRequest::new(Prompt::Text("Once upon a time".into()))
    };
    let mut s = e.generate(req.clone()).unwrap();
    let mut tokens = 0;
    for ev in s.by_ref() {
        if let Event::Token { .. } = ev {
            tokens += 1;
            if tokens == 3 {
                break;
            }
        }
    }
    s.cancel();
    let done = s
        .find_map(|ev| match ev {
            Event::Done(c) => Some(c),
            _ => None,
        })
        .unwrap();
    assert_eq!(done.finish_reason, FinishReason::Cancelled);
    assert!(done.usage.completion_tokens < 500);
    // A dropped stream frees its sequence too.
    drop(e.generate(req).unwrap());
    let after = e
        .complete(
            &GenerateRequest {
                max_tokens: 4,
                ..GenerateRequest::new(Prompt::Text("Hello".into()))
            },
            &mut |_| {},
        )
        .unwrap();
    assert_eq!(after.usage.completion_tokens, 4);
    assert_eq!(e.kv_stats().used_blocks, 0);
}

#[test]
fn callers_on_many_threads_get_what_they_would_alone() {
    let e = engine(EngineConfig::default());
    let req = |u: &str| GenerateRequest {
        max_tokens: 16,
        sampling: SamplingParams::greedy(),
        ..GenerateRequest::new(Prompt::Chat(vec![Message::new("user", u)]))
    };
    let alone = engine(no_reuse());
    let want: Vec<String> = USERS[..3]
        .iter()
        .map(|u| alone.complete(&req(u), &mut |_| {}).unwrap().text)
        .collect();
    let got: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = USERS[..3]
            .iter()
            .map(|u| {
                let e = e.clone();
                s.spawn(move || e.complete(&req(u), &mut |_| {}).unwrap().text)
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, want);
    assert!(e.stats().steps > 0);
}
