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
    let dir = std::env::temp_dir().join(format!("tessera-server-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    write_tiny_model(&dir, TinySpec::default()).unwrap();
    let model = Model::load(&dir, &mut |_, _| {}).unwrap();
    let engine = Arc::new(Engine::from_model(model, EngineConfig::default()).unwrap());
    let server = Server::new(ServerConfig {
        api_keys: keys.iter().map(|k| k.to_string()).collect(),
        ..ServerConfig::new("tiny")
    });
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
    let r = agent()
        .post(&format!("{}{path}", s.base))
        .send_json(body.clone())
        .unwrap();
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
    let models: Value = agent()
        .get(&format!("{}/v1/models", s.base))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
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
        "tessera:cache_config_info{{block_size=\"{}\",num_blocks=\"{}\"}}",
        kv.block_size, kv.num_blocks
    );
    assert_eq!(m[&info], 1.0);
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
    for line in text.lines().filter(|l| !l.starts_with('#')) {
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
    let (code, v) = post(
        &s,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "logprobs": true}),
        key,
    );
    assert_eq!(
        (code, v["error"]["param"].as_str()),
        (400, Some("logprobs"))
    );
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
