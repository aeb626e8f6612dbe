//! `tessera bench --scenario server`: simulated users chatting with an
//! OpenAI-compatible server over HTTP (the workload of
//! [`tessera_bench::serving`]). Without `--url`, Tessera's own server runs
//! in this process and is measured beside itself with prefix reuse off
//! (`cache_prompt: false`), alternating run by run; with `--url`, any
//! server (llama.cpp's `llama-server`, say) is measured the same way.
//! Run `r` uses conversations of seed `--seed + r` (system prompt
//! included), so that no run finds an earlier run's conversations in a
//! cache.

use std::sync::Arc;

use anyhow::{Context, Result};
use serde_json::{json, Value};
use tessera_bench::median;
use tessera_bench::serving::{
    quantile, run_load, served_model, serving, LoadReport, SERVE_REPLY_TOKENS,
};
use tessera_engine::Engine;
use tessera_model::Model;
use tessera_server::{Server, ServerConfig};

use crate::bench::BenchArgs;
use crate::scenarios::emit;

/// Medians over runs of each run's numbers.
fn summary(runs: &[LoadReport]) -> Value {
    let pick = |f: &dyn Fn(&LoadReport) -> f64| median(runs.iter().map(f).collect());
    json!({
        "ttft_p50_ms": pick(&|r| quantile(&r.ttfts(), 0.5) * 1e3),
        "ttft_p99_ms": pick(&|r| quantile(&r.ttfts(), 0.99) * 1e3),
        "throughput_tok_s": pick(&|r| r.throughput()),
        "hit_ratio": pick(&|r| r.hit_ratio()),
        "history_cached": pick(&|r| r.history_cached()),
        "runs": runs.iter().map(LoadReport::json).collect::<Vec<_>>(),
    })
}

fn line(name: &str, s: &Value) -> String {
    format!(
        "{name:<22} TTFT p50 {:>8.1} ms  p99 {:>8.1} ms  {:>7.1} tok/s  history cached {:>5.1}%  hit ratio {:>5.1}%",
        s["ttft_p50_ms"].as_f64().unwrap_or(f64::NAN),
        s["ttft_p99_ms"].as_f64().unwrap_or(f64::NAN),
        s["throughput_tok_s"].as_f64().unwrap_or(f64::NAN),
        s["history_cached"].as_f64().unwrap_or(f64::NAN) * 100.0,
        s["hit_ratio"].as_f64().unwrap_or(f64::NAN) * 100.0,
    )
}

/// Tessera's server on a loopback port of its own, in this process.
fn start(model: Model, args: &BenchArgs) -> Result<(String, Arc<Engine>)> {
    let engine = Arc::new(Engine::from_model(model, args.kv.config(true))?);
    let server = Server::new(ServerConfig::new("tessera"));
    server.set_engine(engine.clone());
    let app = server.router();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = match tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => return drop(tx.send(Err(anyhow::Error::from(e)))),
        };
        rt.block_on(async move {
            match tokio::net::TcpListener::bind("127.0.0.1:0").await {
                Ok(l) => {
                    let _ = tx.send(l.local_addr().map_err(Into::into));
                    let _ = tessera_server::serve(l, app, std::future::pending()).await;
                }
                Err(e) => drop(tx.send(Err(e.into()))),
            }
        });
    });
    let addr = rx.recv().context("the server thread ended")??;
    Ok((format!("http://{addr}"), engine))
}

pub fn server(model: Model, args: &BenchArgs) -> Result<()> {
    let (users, turns, runs) = (args.users, args.turns, args.runs.max(1));
    let workloads = (0..runs as u64)
        .map(|r| serving(&model, users, turns, args.seed + r))
        .collect::<Result<Vec<_>>>()?;
    // A warm-up conversation of a seed no run uses.
    let warm = serving(&model, 1, 1, 1_000_000)?;
    let head = json!({
        "scenario": "server",
        "users": users,
        "turns": turns,
        "reply_tokens": SERVE_REPLY_TOKENS,
        "runs": runs,
    });
    if let Some(url) = &args.url {
        let url = url.trim_end_matches('/');
        let name = match &args.served_model {
            Some(n) => n.clone(),
            None => served_model(url)?,
        };
        run_load(url, &name, &warm, SERVE_REPLY_TOKENS, &json!({}))
            .with_context(|| format!("warming up {url}"))?;
        let reports = workloads
            .iter()
            .map(|w| run_load(url, &name, w, SERVE_REPLY_TOKENS, &json!({})))
            .collect::<Result<Vec<_>>>()?;
        let s = summary(&reports);
        let mut v = head;
        v["url"] = json!(url);
        v["target"] = s.clone();
        emit(args, v, &[line(url, &s)]);
        return Ok(());
    }
    let (base, engine) = start(model, args)?;
    run_load(&base, "tessera", &warm, SERVE_REPLY_TOKENS, &json!({}))?;
    let off = json!({"cache_prompt": false});
    let (mut reuse, mut plain) = (Vec::new(), Vec::new());
    for w in &workloads {
        reuse.push(run_load(
            &base,
            "tessera",
            w,
            SERVE_REPLY_TOKENS,
            &json!({}),
        )?);
        if !args.no_baseline {
            plain.push(run_load(&base, "tessera", w, SERVE_REPLY_TOKENS, &off)?);
        }
    }
    let a = summary(&reuse);
    if plain.is_empty() {
        let mut v = head;
        v["tessera"] = a.clone();
        emit(args, v, &[line("tessera", &a)]);
        return Ok(());
    }
    let b = summary(&plain);
    let ratio = |k: &str| b[k].as_f64().unwrap_or(0.0) / a[k].as_f64().unwrap_or(1.0).max(1e-9);
    let mut v = head;
    v["tessera"] = a.clone();
    v["no_reuse"] = b.clone();
    v["ttft_p50_speedup"] = json!(ratio("ttft_p50_ms"));
    v["ttft_p99_speedup"] = json!(ratio("ttft_p99_ms"));
    v["preemptions"] = json!(engine.stats().preemptions);
    emit(
        args,
        v,
        &[
            line("tessera", &a),
            line("tessera, reuse off", &b),
            format!(
                "TTFT p50 {:.2}x, p99 {:.2}x faster with prefix reuse",
                ratio("ttft_p50_ms"),
                ratio("ttft_p99_ms")
            ),
        ],
    );
    Ok(())
}
