//! The server on loopback, over a tiny model the tests generate, driven by
//! a real HTTP client (ureq): responses equal the engine's own greedy
//! output, streams carry the same text as non-streamed answers, cached
//! tokens are reported exactly, bad input gets its status code and the
//! server keeps serving, and a client that hangs up frees its request.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tessera_engine::{Engine, EngineConfig, GenerateRequest, Message, Prompt, SamplingParams};
use tessera_model::testing::{write_tiny_model, TinySpec};
use tessera_model::Model;
use tessera_server::{Server, ServerConfig};

struct Running {
    base: String,
    engine: Arc<Engine>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    dir: PathBuf,
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A server on an ephemeral port over a fresh tiny model.
fn start(name: &str, keys: &[&str]) -> Running {
    start_with(name, EngineConfig::default(), |c| {
        c.api_keys = keys.iter().map(|k| k.to_string()).collect()
    })
}

/// The same with this engine configuration, and the server's configured
/// by `set` (its `session_dir`, when set, is made relative to the test's
/// directory).
fn start_with(
    name: &str,
    engine_cfg: EngineConfig,
    set: impl FnOnce(&mut ServerConfig),
) -> Running {
    let dir = std::env::temp_dir().join(format!("tessera-server-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    write_tiny_model(&dir, TinySpec::default()).unwrap();
    let model = Model::load(&dir, &mut |_, _| {}).unwrap();
    let engine = Arc::new(Engine::from_model(model, engine_cfg).unwrap());
    let mut cfg = ServerConfig::new("tiny");
    set(&mut cfg);
    cfg.session_dir = cfg.session_dir.map(|d| dir.join(d));
    let server = Server::new(cfg);
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let app = server.router();
    server.set_engine(engine.clone());
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            addr_tx.send(listener.local_addr().unwrap()).unwrap();
            tessera_server::serve(listener, app, async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
        });
    });
    let addr = addr_rx.recv_timeout(Duration::from_secs(30)).unwrap();
    Running {
        base: format!("http://{addr}"),
        engine,
        stop: Some(stop),
        thread: Some(thread),
        dir,
    }
}

fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(120))
        .build()
}

/// GETs `path`, which must answer 200 with JSON.
fn get_json(s: &Running, path: &str) -> Value {
    agent()
        .get(&format!("{}{path}", s.base))
        .call()
        .unwrap()
        .into_json()
        .unwrap()
}

/// POSTs `body`; the status and the parsed JSON answer (errors included).
fn post(s: &Running, path: &str, body: &Value, key: Option<&str>) -> (u16, Value) {
    let mut req = agent().post(&format!("{}{path}", s.base));
    if let Some(k) = key {
        req = req.set("Authorization", &format!("Bearer {k}"));
    }
    match req.send_json(body.clone()) {
        Ok(r) => (r.status(), r.into_json().unwrap()),
        Err(ureq::Error::Status(code, r)) => (code, r.into_json().unwrap_or(Value::Null)),
        Err(e) => panic!("{path}: {e}"),
    }
}

/// The `data:` payloads of a streamed answer, up to and without `[DONE]`
/// (which must come last).
fn stream(s: &Running, path: &str, body: &Value) -> Vec<Value> {
    stream_keyed(s, path, body, None)
}

/// [`stream`] with an API key.
fn stream_keyed(s: &Running, path: &str, body: &Value, key: Option<&str>) -> Vec<Value> {
    let mut req = agent().post(&format!("{}{path}", s.base));
    if let Some(k) = key {
        req = req.set("Authorization", &format!("Bearer {k}"));
    }
    let r = req.send_json(body.clone()).unwrap();
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let mut out = Vec::new();
    let mut done = false;
    for line in BufReader::new(r.into_reader()).lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        assert!(!done, "nothing may follow [DONE]");
        if data == "[DONE]" {
            done = true;
            continue;
        }
        out.push(serde_json::from_str(data).unwrap());
    }
    assert!(done, "the stream ends with data: [DONE]");
    out
}

/// The entries of `choices[0].logprobs[field]` over a streamed answer.
fn streamed_logprobs(
    s: &Running,
    path: &str,
    body: &Value,
    key: Option<&str>,
    field: &str,
) -> Vec<Value> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    stream_keyed(s, path, &body, key)
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"][field].as_array())
        .flatten()
        .cloned()
        .collect()
}

fn greedy(engine: &Engine, prompt: Prompt, max_tokens: usize) -> String {
    let req = GenerateRequest {
        sampling: SamplingParams::greedy(),
        max_tokens,
        ..GenerateRequest::new(prompt)
    };
    engine.complete(&req, &mut |_| {}).unwrap().text
}

#[test]
fn chat_and_completions_match_the_engine_streamed_or_not() {
    let s = start("match", &[]);
    let health = agent().get(&format!("{}/health", s.base)).call().unwrap();
    assert_eq!(health.status(), 200);
    let models = get_json(&s, "/v1/models");
    assert_eq!(models["data"][0]["id"], "tiny");

    let msgs =
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the cat"}]);
    let want = greedy(
        &s.engine,
        Prompt::Chat(vec![
            Message::new("system", "Be brief."),
            Message::new("user", "the cat"),
        ]),
        24,
    );
    let body = json!({"model": "tiny", "messages": msgs, "max_tokens": 24, "temperature": 0});
    let (code, r) = post(&s, "/v1/chat/completions", &body, None);
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["object"], "chat.completion");
    assert_eq!(r["choices"][0]["message"]["role"], "assistant");
    assert_eq!(r["choices"][0]["message"]["content"], want.as_str());
    let u = &r["usage"];
    assert_eq!(
        u["total_tokens"].as_u64(),
        Some(u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap())
    );
    assert!(u["prompt_tokens_details"]["cached_tokens"].is_u64());
    assert!(r["timings"]["prompt_n"].is_u64());

    // Streamed: the role first, then the same text in deltas, the finish
    // reason, and the usage last when asked for.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let chunks = stream(&s, "/v1/chat/completions", &sbody);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, want);
    let reasons: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|r| !r.is_null())
        .collect();
    assert_eq!(reasons.len(), 1);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(
        last["usage"]["completion_tokens"],
        r["usage"]["completion_tokens"]
    );

    // Completions: text and token-id prompts.
    let want = greedy(&s.engine, Prompt::Text("the dog".into()), 16);
    let body = json!({"model": "tiny", "prompt": "the dog", "max_tokens": 16, "temperature": 0});
    let (code, r) = post(&s, "/v1/completions", &body, None);
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["choices"][0]["text"], want.as_str());
    let ids = s
        .engine
        .tokenize_prompt(&Prompt::Text("the dog".into()))
        .unwrap();
    let body = json!({"prompt": ids, "max_tokens": 16, "temperature": 0});
    let (_, r2) = post(&s, "/v1/completions", &body, None);
    assert_eq!(r2["choices"][0]["text"], want.as_str());
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let chunks = stream(&s, "/v1/completions", &sbody);
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, want);

    // Tokenize and detokenize round trip.
    let (_, t) = post(&s, "/tokenize", &json!({"content": "the dog"}), None);
    let (_, d) = post(&s, "/detokenize", &json!({"tokens": t["tokens"]}), None);
    assert_eq!(d["content"], "the dog");

    // Metrics: the engine's counters, and one latency observation per
    // request (five generations above), cumulative buckets.
    let m = metrics(&s);
    let st = s.engine.stats();
    assert_eq!(m["tessera:prompt_tokens_total"], st.prompt_tokens as f64);
    assert_eq!(
        m["tessera:generation_tokens_total"],
        st.completion_tokens as f64
    );
    assert_eq!(
        m["tessera:prefix_cache_hits_total"],
        st.cached_tokens as f64
    );
    assert_eq!(m["tessera:num_requests_running"], 0.0);
    assert_eq!(m["tessera:time_to_first_token_seconds_count"], 5.0);
    assert_eq!(m["tessera:e2e_request_latency_seconds_count"], 5.0);
    assert_eq!(
        m["tessera:time_to_first_token_seconds_bucket{le=\"+Inf\"}"],
        5.0
    );
    assert!(m["tessera:inter_token_latency_seconds_count"] > 0.0);
    let kv = s.engine.kv_stats();
    let info = format!(
        "tessera:cache_config_info{{block_size=\"{}\",num_blocks=\"{}\",sliding_blocks=\"0\"}}",
        kv.block_size, kv.num_blocks
    );
    assert_eq!(m[&info], 1.0);
    // The finished requests' tokens stay cached: their blocks are held.
    assert!(m["tessera:kv_cache_bytes_held"] > 0.0);
    assert_eq!(m["tessera:sliding_window_evictions_total"], 0.0);
}

/// `/metrics` as name (with labels) → value.
fn metrics(s: &Running) -> std::collections::HashMap<String, f64> {
    let text = agent()
        .get(&format!("{}/metrics", s.base))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    let mut out = std::collections::HashMap::new();
    let mut last_bucket = 0.0;
    // Families are separated by blank lines.
    for line in text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let (name, value) = line.rsplit_once(' ').unwrap();
        let v: f64 = value.parse().unwrap();
        if name.contains("_bucket{") {
            if name.contains("le=\"0.001\"") {
                last_bucket = 0.0;
            }
            assert!(v >= last_bucket, "buckets are cumulative: {line}");
            last_bucket = v;
        }
        out.insert(name.to_string(), v);
    }
    out
}

#[test]
fn a_second_turn_reports_its_cached_tokens_exactly() {
    let s = start("cached", &[]);
    let body = json!({"messages": [{"role": "user", "content": "one two three four five six seven"}], "max_tokens": 8, "temperature": 0});
    let (_, first) = post(&s, "/v1/chat/completions", &body, None);
    let reply = first["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let body2 = json!({"messages": [
        {"role": "user", "content": "one two three four five six seven"},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "eight nine"},
    ], "max_tokens": 8, "temperature": 0});
    let before = s.engine.stats();
    let (code, second) = post(&s, "/v1/chat/completions", &body2, None);
    assert_eq!(code, 200, "{second}");
    let after = s.engine.stats();
    let u = &second["usage"];
    let cached = u["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0, "the first turn's prompt is reused: {u}");
    // Exactly what the engine counted as not computed for this request.
    assert_eq!(cached, after.cached_tokens - before.cached_tokens);
    assert_eq!(second["timings"]["cache_n"].as_u64(), Some(cached));
    assert_eq!(
        second["timings"]["prompt_n"].as_u64(),
        Some(u["prompt_tokens"].as_u64().unwrap() - cached)
    );
}

#[test]
fn bad_requests_get_their_status_and_the_server_goes_on() {
    let s = start("bad", &["k1", "k2"]);
    let ok = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    assert_eq!(post(&s, "/v1/chat/completions", &ok, None).0, 401);
    assert_eq!(post(&s, "/v1/chat/completions", &ok, Some("nope")).0, 401);
    assert_eq!(post(&s, "/v1/chat/completions", &ok, Some("k2")).0, 200);
    // /health needs no key.
    assert_eq!(
        agent()
            .get(&format!("{}/health", s.base))
            .call()
            .unwrap()
            .status(),
        200
    );
    // Malformed JSON.
    let r = agent()
        .post(&format!("{}/v1/chat/completions", s.base))
        .set("Authorization", "Bearer k1")
        .set("Content-Type", "application/json")
        .send_string("{\"messages\": [");
    match r {
        Err(ureq::Error::Status(400, r)) => {
            let v: Value = r.into_json().unwrap();
            assert_eq!(v["error"]["type"], "invalid_request_error");
        }
        other => panic!("malformed JSON: {other:?}"),
    }
    let key = Some("k1");
    let (code, v) = post(
        &s,
        "/v1/chat/completions",
        &json!({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}),
        key,
    );
    assert_eq!(
        (code, v["error"]["code"].as_str()),
        (404, Some("model_not_found"))
    );
    let long = "word ".repeat(600);
    let (code, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": long, "max_tokens": 4}),
        key,
    );
    assert_eq!(
        (code, v["error"]["code"].as_str()),
        (400, Some("context_length_exceeded")),
        "{v}"
    );
    // Fields out of range name themselves.
    for (field, value, endpoint) in [
        ("top_logprobs", json!(50), "/v1/chat/completions"),
        ("logprobs", json!(3), "/v1/chat/completions"),
        ("logprobs", json!(21), "/v1/completions"),
        ("logit_bias", json!({"999999": 1}), "/v1/chat/completions"),
        ("logit_bias", json!({"5": 300}), "/v1/completions"),
        ("presence_penalty", json!(2.5), "/v1/chat/completions"),
        ("frequency_penalty", json!(-3), "/v1/completions"),
    ] {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "prompt": "hi"});
        body[field] = value;
        if field == "top_logprobs" {
            body["logprobs"] = json!(true);
        }
        let (code, v) = post(&s, endpoint, &body, key);
        assert_eq!(
            (code, v["error"]["param"].as_str()),
            (400, Some(field)),
            "{v}"
        );
    }
    let (code, _) = post(&s, "/v1/chat/completions", &json!({"messages": []}), key);
    assert_eq!(code, 400);
    let (code, _) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": [999_999], "max_tokens": 2}),
        key,
    );
    assert_eq!(code, 400);
    let (code, _) = post(
        &s,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "temperature": 7}),
        key,
    );
    assert_eq!(code, 400);
    // Still serving.
    assert_eq!(post(&s, "/v1/chat/completions", &ok, key).0, 200);
}

#[test]
fn a_client_hanging_up_mid_stream_frees_its_request() {
    let s = start("hangup", &[]);
    let body = json!({"prompt": "the", "max_tokens": 400, "stream": true, "ignore_eos": true});
    let r = agent()
        .post(&format!("{}/v1/completions", s.base))
        .send_json(body)
        .unwrap();
    let mut lines = BufReader::new(r.into_reader()).lines();
    // Read until a first token arrived, then hang up.
    let mut seen = 0;
    for line in lines.by_ref() {
        if line.unwrap().starts_with("data: ") {
            seen += 1;
            if seen == 2 {
                break;
            }
        }
    }
    drop(lines);
    let start = Instant::now();
    loop {
        let st = s.engine.stats();
        if st.active_samples == 0 {
            assert!(
                st.completion_tokens < 400,
                "the request was cancelled, not run out"
            );
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the request still runs"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let kv = s.engine.kv_stats();
    assert_eq!(kv.sequences, 0);
    assert_eq!(
        kv.used_blocks, 0,
        "its blocks went back to the pool (or the tree)"
    );
    let m = metrics(&s);
    assert_eq!(m["tessera:kv_cache_usage_perc"], 0.0);
    assert_eq!(
        m["tessera:num_requests_running"] + m["tessera:num_requests_waiting"],
        0.0
    );
}

/// Log-probabilities (chat and completions, streamed or not), logit bias,
/// `cache_prompt: false`, and the prefix-cache partitions of `cache_salt`
/// and of the API keys.
#[test]
fn logprobs_bias_cache_prompt_and_partitions() {
    let s = start("logprobs", &["k1", "k2"]);
    let key = Some("k1");
    let msgs = json!([{"role": "user", "content": "the cat sat on the mat"}]);
    let body = json!({"messages": msgs, "max_tokens": 12, "temperature": 0,
                      "logprobs": true, "top_logprobs": 3});
    let (code, r) = post(&s, "/v1/chat/completions", &body, key);
    assert_eq!(code, 200, "{r}");
    let text = r["choices"][0]["message"]["content"].as_str().unwrap();
    let content = r["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len() as u64,
        r["usage"]["completion_tokens"].as_u64().unwrap()
    );
    let mut bytes = Vec::new();
    for c in content {
        let top = c["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely.
        assert_eq!(top[0]["token"], c["token"]);
        assert_eq!(top[0]["logprob"], c["logprob"]);
        assert!(c["logprob"].as_f64().unwrap() <= 0.0);
        bytes.extend(
            c["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8),
        );
    }
    // (The tiny model's bytes need not be UTF-8: the text has U+FFFD.)
    assert_eq!(
        String::from_utf8_lossy(&bytes),
        text,
        "bytes rebuild the text"
    );

    // Streamed: the same entries, spread over the chunks.
    let streamed = streamed_logprobs(&s, "/v1/chat/completions", &body, key, "content");
    assert_eq!(&streamed, content);

    // Completions: parallel lists with offsets into the text.
    let body = json!({"prompt": "the cat", "max_tokens": 8, "temperature": 0, "logprobs": 2});
    let (code, r) = post(&s, "/v1/completions", &body, key);
    assert_eq!(code, 200, "{r}");
    let lp = &r["choices"][0]["logprobs"];
    let n = lp["tokens"].as_array().unwrap().len();
    assert_eq!(n as u64, r["usage"]["completion_tokens"].as_u64().unwrap());
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), n);
    assert_eq!(lp["text_offset"][0], 0);
    assert!(lp["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t.as_object().unwrap().len() <= 2));
    let offsets = streamed_logprobs(&s, "/v1/completions", &body, key, "text_offset");
    assert_eq!(&offsets, lp["text_offset"].as_array().unwrap());

    // A bias of -100 on the greedy first token changes it.
    let prompt = Prompt::Chat(vec![Message::new("user", "the cat sat on the mat")]);
    let req = GenerateRequest {
        sampling: SamplingParams::greedy(),
        max_tokens: 1,
        ..GenerateRequest::new(prompt)
    };
    let id = s.engine.complete(&req, &mut |_| {}).unwrap().tokens[0];
    let tok = &s.engine.model().tokenizer;
    assert_eq!(content[0]["bytes"], json!(tok.token_bytes(id)));
    let body = json!({"messages": msgs, "max_tokens": 1, "temperature": 0, "logprobs": true,
                      "logit_bias": {id.to_string(): -100}});
    let (code, r) = post(&s, "/v1/chat/completions", &body, key);
    assert_eq!(code, 200, "{r}");
    assert_ne!(
        r["choices"][0]["logprobs"]["content"][0]["bytes"],
        json!(tok.token_bytes(id))
    );

    // The conversation is cached for k1: k1 reuses it, k1 with
    // cache_prompt false does not, k2 (another tenant) does not, and a
    // salt is a partition of its own.
    let body = json!({"messages": msgs, "max_tokens": 2, "temperature": 0});
    let cached = |extra: Value, key: &str| {
        let mut b = body.clone();
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (code, r) = post(&s, "/v1/chat/completions", &b, Some(key));
        assert_eq!(code, 200, "{r}");
        r["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    assert!(cached(json!({}), "k1") > 0);
    assert_eq!(cached(json!({"cache_prompt": false}), "k1"), 0);
    assert_eq!(cached(json!({}), "k2"), 0);
    assert!(cached(json!({}), "k2") > 0, "k2's own partition");
    assert_eq!(cached(json!({"cache_salt": "s"}), "k1"), 0);
    assert!(cached(json!({"cache_salt": "s"}), "k1") > 0);
}

/// Sixty-four streams at once against a pool that holds a few of them:
/// every one completes, with the text it gets alone.
#[test]
fn sixty_four_concurrent_streams_on_a_small_pool_each_get_their_own_output() {
    let engine_cfg = EngineConfig {
        kv_memory: 96 << 10,
        block_size: 16,
        ..EngineConfig::default()
    };
    let s = start_with("many", engine_cfg, |_| {});
    let kv = s.engine.kv_stats();
    let prompts: Vec<String> = (0..64)
        .map(|i| {
            format!(
                "request {i}: the {} sat on {} mats",
                ["cat", "dog", "owl"][i % 3],
                i * 7
            )
        })
        .collect();
    let want: Vec<String> = prompts
        .iter()
        .map(|p| greedy(&s.engine, Prompt::Text(p.clone()), 24))
        .collect();
    s.engine.clear_cache().unwrap();
    // Each needs ~3 blocks of 16 for prompt and answer: 64 of them need
    // far more than the pool.
    assert!(
        kv.num_blocks < 64 * 3,
        "the pool is small: {} blocks",
        kv.num_blocks
    );
    let before = s.engine.stats();
    let got: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let body = json!({"prompt": p, "max_tokens": 24, "temperature": 0, "stream": true});
                let s = &s;
                scope.spawn(move || {
                    stream(s, "/v1/completions", &body)
                        .iter()
                        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
                        .collect::<String>()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, want);
    let after = s.engine.stats();
    assert_eq!(after.requests - before.requests, 64);
    assert_eq!(after.failed_requests, before.failed_requests);
    assert_eq!(s.engine.kv_stats().sequences, 0);
    s.engine.check_kv().unwrap();
}

/// With `max_queue` requests in the server, one more is answered 429 with
/// Retry-After; once they end, requests are served again.
#[test]
fn a_full_queue_answers_429_and_recovers() {
    let s = start_with("queue", EngineConfig::default(), |c| c.max_queue = 2);
    let long = json!({"prompt": "the", "max_tokens": 100000, "ignore_eos": true, "stream": true});
    let open: Vec<_> = (0..2)
        .map(|_| {
            let r = agent()
                .post(&format!("{}/v1/completions", s.base))
                .send_json(long.clone())
                .unwrap();
            let mut lines = BufReader::new(r.into_reader()).lines();
            // Its first chunk: the request is in the server.
            lines.find(|l| l.as_ref().unwrap().starts_with("data: "));
            lines
        })
        .collect();
    let small = json!({"prompt": "the", "max_tokens": 2});
    match agent()
        .post(&format!("{}/v1/completions", s.base))
        .send_json(small.clone())
    {
        Err(ureq::Error::Status(429, r)) => {
            assert_eq!(r.header("retry-after"), Some("1"));
            let v: Value = r.into_json().unwrap();
            assert_eq!(v["error"]["code"], "queue_full");
        }
        other => panic!("a third request: {other:?}"),
    }
    drop(open);
    let start = Instant::now();
    loop {
        let (code, v) = post(&s, "/v1/completions", &small, None);
        if code == 200 {
            break;
        }
        assert_eq!(code, 429, "{v}");
        assert!(start.elapsed() < Duration::from_secs(60), "never freed");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sessions over HTTP: saved, the cache cleared, restored whole, then the
/// conversation's next request reuses it; bad names, missing and corrupted
/// files are refused and change nothing.
#[test]
fn sessions_save_and_restore_over_http() {
    let s = start_with("sessions", EngineConfig::default(), |c| {
        c.session_dir = Some("sessions".into())
    });
    let msgs = json!([{"role": "system", "content": "You are terse."},
                      {"role": "user", "content": "one two three four five six seven eight"}]);
    let (code, v) = post(
        &s,
        "/v1/sessions/chat-1/save",
        &json!({"messages": msgs}),
        None,
    );
    assert_eq!(code, 200, "{v}");
    let saved = v["tokens"].as_u64().unwrap();
    assert!(saved > 10);
    s.engine.clear_cache().unwrap();
    let (code, v) = post(&s, "/v1/sessions/chat-1/restore", &json!({}), None);
    assert_eq!(
        (code, v["restored_tokens"].as_u64()),
        (200, Some(saved)),
        "{v}"
    );
    let body = json!({"messages": msgs, "max_tokens": 2, "temperature": 0});
    let (_, r) = post(&s, "/v1/chat/completions", &body, None);
    assert_eq!(
        r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(saved - 1),
        "all but the last prompt token come from the session"
    );
    // Token ids too.
    let (code, v) = post(
        &s,
        "/v1/sessions/ids/save",
        &json!({"tokens": [5, 6, 7, 8]}),
        None,
    );
    assert_eq!((code, v["tokens"].as_u64()), (200, Some(4)));
    for bad in [
        "..%2Fetc",
        "%2E%2Ehidden",
        ".hidden",
        "a%2Fb",
        "a%00b",
        &"x".repeat(129),
    ] {
        let (code, v) = post(
            &s,
            &format!("/v1/sessions/{bad}/save"),
            &json!({"tokens": [5]}),
            None,
        );
        assert_eq!(
            (code, v["error"]["param"].as_str()),
            (400, Some("name")),
            "{bad}: {v}"
        );
    }
    let (code, v) = post(&s, "/v1/sessions/nothing/restore", &json!({}), None);
    assert_eq!(
        (code, v["error"]["code"].as_str()),
        (404, Some("session_not_found"))
    );
    let (code, _) = post(&s, "/v1/sessions/x/save", &json!({}), None);
    assert_eq!(code, 400);
    // A corrupted file is refused and the cache stays as it was.
    let file = s.dir.join("sessions").join("chat-1.tkv");
    let mut data = std::fs::read(&file).unwrap();
    let mid = data.len() / 2;
    data[mid] ^= 0x40;
    std::fs::write(&file, &data).unwrap();
    s.engine.clear_cache().unwrap();
    let (code, v) = post(&s, "/v1/sessions/chat-1/restore", &json!({}), None);
    assert_eq!(
        (code, v["error"]["code"].as_str()),
        (400, Some("invalid_session")),
        "{v}"
    );
    assert_eq!(s.engine.kv_stats().cached_tokens, 0);
    // Without a session directory the endpoints are off.
    let off = start("nosessions", &[]);
    let (code, v) = post(&off, "/v1/sessions/a/save", &json!({"tokens": [5]}), None);
    assert_eq!(
        (code, v["error"]["code"].as_str()),
        (404, Some("sessions_disabled"))
    );
}

/// `/openapi.json` lists every route, and each answers its method.
#[test]
fn openapi_lists_the_routes_the_server_answers() {
    let s = start_with("openapi", EngineConfig::default(), |c| {
        c.session_dir = Some("sessions".into())
    });
    let doc = get_json(&s, "/openapi.json");
    assert_eq!(doc["openapi"], "3.1.0");
    let paths = doc["paths"].as_object().unwrap();
    // Every route the router has, and no other.
    let mut listed: Vec<&str> = paths.keys().map(String::as_str).collect();
    listed.sort_unstable();
    assert_eq!(
        listed,
        [
            "/detokenize",
            "/health",
            "/metrics",
            "/openapi.json",
            "/tokenize",
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/models",
            "/v1/sessions/{name}/restore",
            "/v1/sessions/{name}/save",
        ]
    );
    // The request schemas come from the request types, bounds included.
    let schemas = &doc["components"]["schemas"];
    let chat = &paths["/v1/chat/completions"]["post"];
    assert_eq!(
        chat["requestBody"]["content"]["application/json"]["schema"]["$ref"],
        "#/components/schemas/ChatRequest"
    );
    assert_eq!(
        schemas["Common"]["properties"]["temperature"]["maximum"],
        2.0
    );
    assert!(schemas["ChatRequest"].to_string().contains("\"messages\""));
    assert_eq!(
        chat["responses"]["400"]["content"]["application/json"]["schema"]["$ref"],
        "#/components/schemas/ErrorBody"
    );
    assert_eq!(doc["security"], json!([]), "no keys, no security");
    for (path, ops) in paths {
        let url = format!("{}{}", s.base, path.replace("{name}", "n"));
        for method in ops.as_object().unwrap().keys() {
            let r = match method.as_str() {
                "get" => agent().get(&url).call(),
                "post" => agent().post(&url).send_json(json!({})),
                m => panic!("{m}"),
            };
            let (code, body) = match r {
                Ok(r) => (r.status(), r.into_string().unwrap()),
                Err(ureq::Error::Status(c, r)) => (c, r.into_string().unwrap()),
                Err(e) => panic!("{url}: {e}"),
            };
            // A route that exists answers with its own status: never 405,
            // and a 404 only as a JSON error of its own.
            assert_ne!(code, 405, "{method} {path}");
            assert!(
                code != 404 || body.contains("\"error\""),
                "{method} {path}: {body}"
            );
        }
    }
}

/// At the context limit a request ends with `length`, unless it asks for
/// llama-server's context shift with `n_keep`.
#[test]
fn context_shift_only_when_the_request_asks() {
    let s = start("shift", &[]);
    let ctx = s.engine.context_length();
    let prompt: Vec<u32> = (0..ctx as u32 - 40).map(|i| 5 + i % 90).collect();
    let body = json!({"prompt": prompt, "max_tokens": 100, "temperature": 0, "ignore_eos": true});
    let (code, r) = post(&s, "/v1/completions", &body, None);
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    let n = r["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    // Up to the context, plus the last token, which needs no K/V room.
    assert_eq!(n, ctx - prompt.len() + 1, "stopped at the context");
    let mut shifted = body.clone();
    shifted["n_keep"] = json!(8);
    let (code, r) = post(&s, "/v1/completions", &shifted, None);
    assert_eq!(code, 200, "{r}");
    assert_eq!(
        r["usage"]["completion_tokens"], 100,
        "went on past the context"
    );
}

/// `post` with a raw body and content type, for bodies `serde_json` would
/// not build.
fn post_raw(s: &Running, path: &str, body: &[u8], key: Option<&str>) -> (u16, Value) {
    let mut req = agent()
        .post(&format!("{}{path}", s.base))
        .set("Content-Type", "application/json");
    if let Some(k) = key {
        req = req.set("Authorization", &format!("Bearer {k}"));
    }
    match req.send_bytes(body) {
        Ok(r) => (r.status(), r.into_json().unwrap_or(Value::Null)),
        Err(ureq::Error::Status(code, r)) => (code, r.into_json().unwrap_or(Value::Null)),
        // The server answered (413) and closed before the body was sent.
        Err(ureq::Error::Transport(t)) => (0, json!(t.to_string())),
    }
}

fn cached_of(r: &Value) -> u64 {
    r["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {r}"))
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Two API keys and salts: a tenant's sessions are its own (another
/// tenant can neither restore, overwrite nor time them), a restored
/// session serves its own tenant's (and salt's) next request from the
/// cache, and no other.
#[test]
fn tenants_keep_their_sessions_and_cached_tokens_apart() {
    let s = start_with("tenants", EngineConfig::default(), |c| {
        c.api_keys = vec!["k1".into(), "k2".into()];
        c.session_dir = Some("sessions".into());
    });
    // Each conversation opens with its own number: the words alone repeat
    // every 97 (conversation 101 was conversation 4, so k2's "fresh" save
    // of it had been cached by k2 itself).
    let conv = |i: usize| {
        let words: Vec<String> = (0..60)
            .map(|w| format!("w{}", (w * 7 + i * 13) % 97))
            .collect();
        json!([{"role": "user", "content": format!("c{i} {}", words.join(" "))}])
    };
    let notes = conv(0);
    let (code, v) = post(
        &s,
        "/v1/sessions/notes/save",
        &json!({"messages": notes}),
        Some("k1"),
    );
    assert_eq!(code, 200, "{v}");
    let n = v["tokens"].as_u64().unwrap();
    assert!(n > 50, "{v}");
    // k2 sees no session of that name, and its own save is its own.
    let (code, v) = post(&s, "/v1/sessions/notes/restore", &json!({}), Some("k2"));
    assert_eq!(
        (code, v["error"]["code"].as_str()),
        (404, Some("session_not_found")),
        "{v}"
    );
    let (code, v) = post(
        &s,
        "/v1/sessions/notes/save",
        &json!({"tokens": [5, 6, 7]}),
        Some("k2"),
    );
    assert_eq!((code, v["tokens"].as_u64()), (200, Some(3)), "{v}");
    let (code, v) = post(&s, "/v1/sessions/notes/restore", &json!({}), Some("k1"));
    assert_eq!((code, v["restored_tokens"].as_u64()), (200, Some(n)), "{v}");
    let (code, v) = post(&s, "/v1/sessions/notes/restore", &json!({}), Some("k2"));
    assert_eq!((code, v["restored_tokens"].as_u64()), (200, Some(3)), "{v}");
    // Saving k1's conversation tells k2 nothing: none of it comes from a
    // cache k2 can reach (k1's own save of it again reuses its cache).
    let (_, v) = post(
        &s,
        "/v1/sessions/guess/save",
        &json!({"messages": notes}),
        Some("k2"),
    );
    assert_eq!(v["cached_tokens"].as_u64(), Some(0), "{v}");
    let (_, v) = post(
        &s,
        "/v1/sessions/again/save",
        &json!({"messages": notes}),
        Some("k1"),
    );
    assert_eq!(v["cached_tokens"].as_u64(), Some(n - 1), "{v}");
    // Nor does the time it takes: guesses of conversations k1 holds cost
    // k2 what conversations nobody holds cost (medians, generous slack).
    let mut held = Vec::new();
    let mut fresh = Vec::new();
    for i in 1..=7 {
        let (code, _) = post(
            &s,
            &format!("/v1/sessions/h{i}/save"),
            &json!({"messages": conv(i)}),
            Some("k1"),
        );
        assert_eq!(code, 200);
    }
    for i in 1..=7 {
        for (conv_i, out) in [(i, &mut held), (i + 100, &mut fresh)] {
            let t = Instant::now();
            let (code, _) = post(
                &s,
                &format!("/v1/sessions/t{conv_i}/save"),
                &json!({"messages": conv(conv_i)}),
                Some("k2"),
            );
            assert_eq!(code, 200);
            out.push(t.elapsed().as_secs_f64());
        }
    }
    let (h, f) = (median(held), median(fresh));
    assert!(
        h > 0.5 * f,
        "k1's conversations save faster for k2: {h:.4} s against {f:.4} s"
    );

    // A restored session serves the next request of its own tenant only.
    s.engine.clear_cache().unwrap();
    let (code, _) = post(&s, "/v1/sessions/notes/restore", &json!({}), Some("k1"));
    assert_eq!(code, 200);
    let chat = json!({"messages": notes, "max_tokens": 2, "temperature": 0});
    let (_, r) = post(&s, "/v1/chat/completions", &chat, Some("k2"));
    assert_eq!(cached_of(&r), 0, "k2 reads nothing of k1's session");
    let (_, r) = post(&s, "/v1/chat/completions", &chat, Some("k1"));
    assert_eq!(
        cached_of(&r),
        n - 1,
        "k1's next request computes only its last token"
    );

    // With a salt: saved and restored in the salt's partition, used there.
    let salted = conv(50);
    let body = json!({"messages": salted, "cache_salt": "blue"});
    let (code, v) = post(&s, "/v1/sessions/salted/save", &body, Some("k1"));
    assert_eq!(code, 200, "{v}");
    let m = v["tokens"].as_u64().unwrap();
    s.engine.clear_cache().unwrap();
    let (code, _) = post(&s, "/v1/sessions/salted/restore", &json!({}), Some("k1"));
    assert_eq!(code, 404, "the session lives in the salt's partition");
    let (code, v) = post(
        &s,
        "/v1/sessions/salted/restore",
        &json!({"cache_salt": "blue"}),
        Some("k1"),
    );
    assert_eq!((code, v["restored_tokens"].as_u64()), (200, Some(m)), "{v}");
    let chat = json!({"messages": salted, "max_tokens": 2, "temperature": 0});
    let (_, r) = post(&s, "/v1/chat/completions", &chat, Some("k1"));
    assert_eq!(cached_of(&r), 0, "unsalted requests do not see it");
    let mut with_salt = chat.clone();
    with_salt["cache_salt"] = json!("blue");
    let (_, r) = post(&s, "/v1/chat/completions", &with_salt, Some("k1"));
    assert_eq!(cached_of(&r), m - 1);
    let (_, r) = post(&s, "/v1/chat/completions", &with_salt, Some("k2"));
    assert_eq!(
        cached_of(&r),
        0,
        "the same salt under another key is another partition"
    );
    // Neither keys nor salts appear in the session directory.
    let mut names = Vec::new();
    for e in std::fs::read_dir(s.dir.join("sessions")).unwrap().flatten() {
        names.push(e.file_name().to_string_lossy().into_owned());
    }
    assert!(
        names
            .iter()
            .all(|n| !n.contains("k1") && !n.contains("blue")),
        "{names:?}"
    );
}

/// Twelve saves of one name at once: each is answered 200 or 409 (one
/// writer at a time), never 500, and the file always restores to one of
/// the conversations saved whole; no temporary file is left behind.
#[test]
fn concurrent_saves_of_one_name_never_lose_the_session() {
    let s = start_with("concurrent", EngineConfig::default(), |c| {
        c.session_dir = Some("sessions".into())
    });
    let lens: Vec<usize> = (0..12).map(|i| 40 + 9 * i).collect();
    for round in 0..3 {
        let codes: Vec<u16> = std::thread::scope(|sc| {
            let handles: Vec<_> = lens
                .iter()
                .map(|&len| {
                    let s = &s;
                    sc.spawn(move || {
                        let ids: Vec<u32> =
                            (0..len as u32).map(|t| 3 + (t * 11 + round) % 90).collect();
                        post(s, "/v1/sessions/same/save", &json!({"tokens": ids}), None).0
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(codes.iter().all(|&c| c == 200 || c == 409), "{codes:?}");
        assert!(codes.contains(&200), "{codes:?}");
        s.engine.clear_cache().unwrap();
        let (code, v) = post(&s, "/v1/sessions/same/restore", &json!({}), None);
        assert_eq!(code, 200, "round {round}: {v}");
        let n = v["restored_tokens"].as_u64().unwrap() as usize;
        assert!(lens.contains(&n), "{n}");
        let left: Vec<String> = std::fs::read_dir(s.dir.join("sessions"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
}

/// What a client controls is bounded, each limit with the status and
/// message that name it: session size (413) and the directory's quota
/// (507), stop lists, bodies up to the documented 8 MiB; any accepted
/// temperature samples; an unset `max_tokens` works on a pool far smaller
/// than the context; `/metrics` and `/openapi.json` need a key unless
/// public.
#[test]
fn limits_and_small_defects() {
    let cfg = EngineConfig {
        kv_memory: 64 << 10,
        block_size: 16,
        ..EngineConfig::default()
    };
    let s = start_with("limits", cfg, |c| {
        c.session_dir = Some("sessions".into());
        c.max_session_tokens = Some(30);
        c.session_quota = Some(60 << 10);
        c.api_keys = vec!["k".into()];
    });
    let key = Some("k");
    let ids = |n: u32| json!({"tokens": (0..n).map(|t| 3 + t % 90).collect::<Vec<u32>>()});
    let (code, v) = post(&s, "/v1/sessions/big/save", &ids(31), key);
    assert_eq!(
        (code, v["error"]["code"].as_str()),
        (413, Some("session_too_large")),
        "{v}"
    );
    let mut saved = 0;
    let mut last = (0, Value::Null);
    for i in 0..40 {
        last = post(&s, &format!("/v1/sessions/q{i}/save"), &ids(30), key);
        if last.0 != 200 {
            break;
        }
        saved += 1;
    }
    assert_eq!(last.0, 507, "{:?}", last.1);
    assert_eq!(last.1["error"]["code"], "session_quota_exceeded");
    assert!(saved >= 1, "the quota holds some sessions");
    // Replacing a session within the quota is allowed.
    assert_eq!(post(&s, "/v1/sessions/q0/save", &ids(30), key).0, 200);

    // Stop lists.
    let many: Vec<String> = (0..17).map(|i| format!("s{i}")).collect();
    let body = json!({"prompt": "the", "max_tokens": 4, "stop": many});
    let (code, v) = post(&s, "/v1/completions", &body, key);
    assert_eq!(
        (code, v["error"]["param"].as_str()),
        (400, Some("stop")),
        "{v}"
    );
    let body = json!({"prompt": "the", "max_tokens": 4, "stop": ["x".repeat(257)]});
    assert_eq!(post(&s, "/v1/completions", &body, key).0, 400);
    let body = json!({"prompt": "the", "max_tokens": 4, "stop": ["", "zz"]});
    assert_eq!(post(&s, "/v1/completions", &body, key).0, 200);
    let body = json!({"prompt": "the", "max_tokens": 1, "cache_salt": "s".repeat(257)});
    let (code, v) = post(&s, "/v1/completions", &body, key);
    assert_eq!(
        (code, v["error"]["param"].as_str()),
        (400, Some("cache_salt")),
        "{v}"
    );

    // A 3 MB body is within the documented 8 MiB (axum's own JSON limit
    // was 2 MiB); 9 MB is not.
    let pad = "a ".repeat(1_500_000);
    let body = serde_json::to_vec(&json!({"content": pad})).unwrap();
    let (code, v) = post_raw(&s, "/tokenize", &body, key);
    assert_eq!(code, 200, "{v}");
    let body = serde_json::to_vec(&json!({"content": "a".repeat(9 << 20)})).unwrap();
    let (code, v) = post_raw(&s, "/tokenize", &body, key);
    assert!(code == 413 || code == 0, "{code}: {v}");

    // The smallest temperature samples the most likely token.
    let body =
        json!({"prompt": "the cat", "max_tokens": 6, "temperature": 1e-45, "ignore_eos": true});
    let (code, r) = post(&s, "/v1/completions", &body, key);
    assert_eq!(code, 200, "{r}");
    let greedy_text = greedy(&s.engine, Prompt::Text("the cat".into()), 6);
    assert_eq!(r["choices"][0]["text"].as_str(), Some(greedy_text.as_str()));
    assert_eq!(r["usage"]["completion_tokens"], 6);

    // No max_tokens: the pool (4 blocks of 16) holds far less than the
    // context (512); the request runs until the pool is full, `length`.
    let body = json!({"prompt": "the cat", "ignore_eos": true});
    let (code, r) = post(&s, "/v1/completions", &body, key);
    assert_eq!(code, 200, "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert!(r["usage"]["completion_tokens"].as_u64().unwrap() > 8, "{r}");

    // Metrics and the API document need the key.
    for path in ["/metrics", "/openapi.json"] {
        let r = agent().get(&format!("{}{path}", s.base)).call();
        assert!(matches!(r, Err(ureq::Error::Status(401, _))), "{path}");
        let r = agent()
            .get(&format!("{}{path}", s.base))
            .set("Authorization", "Bearer k")
            .call()
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let open = start_with("public", EngineConfig::default(), |c| {
        c.api_keys = vec!["k".into()];
        c.public_metrics = true;
    });
    assert_eq!(
        agent()
            .get(&format!("{}/metrics", open.base))
            .call()
            .unwrap()
            .status(),
        200
    );
    // With keys, the document says every route takes the bearer key.
    let doc = get_json(&open, "/openapi.json");
    assert_eq!(doc["security"], json!([{"bearer": []}]));
    assert_eq!(
        doc["components"]["securitySchemes"]["bearer"]["scheme"],
        "bearer"
    );
    let r = agent().get(&format!("{}/v1/models", open.base)).call();
    assert!(matches!(r, Err(ureq::Error::Status(401, _))));
}

/// Clients that send a long prompt and hang up before the answer (not
/// streaming, so nothing is ever written to them) are cancelled at once,
/// queued or running: their queue slots come back, the engine drops their
/// work, and a short request that follows is served as on an idle server.
#[test]
fn hung_up_clients_cost_nothing() {
    use std::io::Write;
    // Steps of 5 ms: the 24 prompts would take hundreds of them.
    let slow = tessera_engine::FaultHook::new(|_| {
        std::thread::sleep(Duration::from_millis(5));
        None
    });
    let cfg = EngineConfig {
        max_running: 4,
        prefill_chunk: 32,
        faults: Some(slow),
        ..EngineConfig::default()
    };
    let s = start_with("hangups", cfg, |c| c.max_queue = 30);
    let addr = s.base.trim_start_matches("http://").to_string();
    let long: Vec<u32> = (0..500).map(|t| 3 + (t * 7) % 90).collect();
    let ttft = |s: &Running| {
        let body = json!({"prompt": "the", "max_tokens": 1});
        let t = Instant::now();
        let (code, _) = post(s, "/v1/completions", &body, None);
        assert_eq!(code, 200);
        t.elapsed().as_secs_f64()
    };
    let idle = median((0..5).map(|_| ttft(&s)).collect());
    let before = s.engine.stats().prompt_tokens;
    let mut socks = Vec::new();
    for i in 0..24 {
        let ids: Vec<u32> = long.iter().map(|t| t + (i % 3)).collect();
        let body =
            serde_json::to_vec(&json!({"prompt": ids, "max_tokens": 200, "ignore_eos": true}))
                .unwrap();
        let mut sock = std::net::TcpStream::connect(&addr).unwrap();
        write!(
            sock,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .unwrap();
        sock.write_all(&body).unwrap();
        socks.push(sock);
    }
    // Every request is in the engine, then every client hangs up.
    let t = Instant::now();
    while s.engine.stats().running + s.engine.stats().waiting < 24 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "requests never arrived"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let steps = s.engine.stats().steps;
    drop(socks);
    let t = Instant::now();
    loop {
        let st = s.engine.stats();
        if st.active_samples == 0 {
            // Cancelled within a few steps of the hang-up (the server
            // notices the closed sockets while the engine steps on).
            assert!(
                st.steps - steps <= 20,
                "{} steps after the hang-up",
                st.steps - steps
            );
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "hung-up requests still held: {st:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let after = median((0..5).map(|_| ttft(&s)).collect());
    assert!(
        after < 2.0 * idle + 0.05,
        "TTFT {after:.4} s after the hang-ups, {idle:.4} s idle"
    );
    let st = s.engine.stats();
    assert!(
        st.completion_tokens < 24 * 200 / 4,
        "the hung-up requests were not run out: {st:?} ({before} prompt tokens before)"
    );
    let m = metrics(&s);
    assert_eq!(
        m["tessera:num_requests_running"] + m["tessera:num_requests_waiting"],
        0.0
    );
    // Their queue slots came back: a burst as large as the queue is served.
    let ok = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..30)
            .map(|_| {
                sc.spawn(|| {
                    post(
                        &s,
                        "/v1/completions",
                        &json!({"prompt": "the", "max_tokens": 1}),
                        None,
                    )
                    .0
                })
            })
            .collect();
        hs.into_iter()
            .filter(|_| true)
            .map(|h| h.join().unwrap())
            .filter(|&c| c == 200)
            .count()
    });
    assert_eq!(ok, 30);
}
