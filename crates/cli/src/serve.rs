//! `tessera serve`: the OpenAI-compatible server (tessera-server) on a
//! socket. It listens at once, answers `/health` with 503 while the model
//! loads, then serves; SIGINT or SIGTERM stops it after the requests in
//! flight, or after `--shutdown-timeout` ends those still running with an
//! error event (and writes the prefix cache, every partition's, to
//! `--cache-dir` when given).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use tessera_engine::{Engine, EngineConfig};
use tessera_server::{Server, ServerConfig};

use crate::{load_model, parse_size, KvArgs, ModelArg};

#[derive(Args)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    model: ModelArg,
    #[command(flatten)]
    kv: KvArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 picks a free port (printed on stderr).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` (repeatable; every route but
    /// /health, and /metrics and /openapi.json with --public-metrics).
    /// With two or more keys each key is a tenant: its cached K/V and its
    /// sessions are its own.
    #[arg(long = "api-key")]
    api_keys: Vec<String>,
    /// Serve /metrics and /openapi.json without a key.
    #[arg(long)]
    public_metrics: bool,
    /// The model name clients send (default: the file's name without its
    /// extension).
    #[arg(long)]
    alias: Option<String>,
    /// Restore the prefix cache from this directory at start and write it
    /// back at shutdown; between, full blocks evicted from the pool are
    /// written to its disk tier (`blocks/`) as they go and read back when
    /// a prompt continues past what the pool holds.
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Publish KV events (the prefix cache's full blocks stored and
    /// removed) on this ZeroMQ PUB endpoint in vLLM's format, e.g.
    /// tcp://*:5557, for KV-aware routers (Dynamo, llm-d, vllm-router).
    #[arg(long)]
    kv_events_endpoint: Option<String>,
    /// A ZeroMQ ROUTER endpoint answering replay requests for missed
    /// batches (vLLM's), e.g. tcp://*:5558.
    #[arg(long, requires = "kv_events_endpoint")]
    kv_events_replay_endpoint: Option<String>,
    /// The topic frame of every KV events message.
    #[arg(long, default_value = "")]
    kv_events_topic: String,
    /// The disk tier's size limit (its oldest blocks go first), e.g. 4GiB;
    /// 0 keeps only the file written at shutdown.
    #[arg(long, default_value = "4GiB", value_parser = parse_size)]
    cache_dir_size: usize,
    /// Prefix of the /metrics names: `tessera`, or `vllm` for routers and
    /// dashboards that read vLLM's exact names.
    #[arg(long, default_value = "tessera", value_parser = parse_prefix)]
    metrics_prefix: String,
    /// Keep sessions (POST /v1/sessions/NAME/save and /restore) in this
    /// directory; without it those endpoints answer 404.
    #[arg(long)]
    session_dir: Option<PathBuf>,
    /// Most tokens one session may hold (default: the context length);
    /// larger saves are answered 413.
    #[arg(long)]
    max_session_tokens: Option<usize>,
    /// Most bytes all session files together may take (e.g. 2GiB); a save
    /// past it is answered 507. Default: no limit.
    #[arg(long, value_parser = parse_size)]
    session_quota: Option<usize>,
    /// Seconds to let requests in flight finish after SIGINT or SIGTERM;
    /// then those still running end with an error event.
    #[arg(long, default_value_t = 30.0)]
    shutdown_timeout: f64,
    /// Most generation requests held at once (running or queued); more
    /// are answered 429 with Retry-After.
    #[arg(long, default_value_t = 512)]
    max_queue: usize,
}

fn parse_prefix(s: &str) -> Result<String, String> {
    let ok = s
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if ok {
        Ok(s.to_string())
    } else {
        Err(format!(
            "`{s}` is not a metric name prefix (letters, digits, _)"
        ))
    }
}

pub(crate) fn serve(args: ServeArgs) -> Result<()> {
    let name = args.alias.clone().unwrap_or_else(|| {
        let spec = args.model.model.trim_end_matches('/');
        let file = spec.rsplit(['/', ':']).next().unwrap_or(spec);
        file.strip_suffix(".gguf").unwrap_or(file).to_string()
    });
    let server = Server::new(ServerConfig {
        api_keys: args.api_keys.clone(),
        metrics_prefix: args.metrics_prefix.clone(),
        session_dir: args.session_dir.clone(),
        max_session_tokens: args.max_session_tokens,
        session_quota: args.session_quota.map(|b| b as u64),
        public_metrics: args.public_metrics,
        max_queue: args.max_queue.max(1),
        ..ServerConfig::new(name.clone())
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("listening on {addr}"))?;
        let local = listener.local_addr()?;
        eprintln!("tessera serve: listening on http://{local} (model `{name}` loading)");
        let app = server.router();
        let (stopping, mut stop_seen) = tokio::sync::watch::channel(false);
        let serving = tokio::spawn(tessera_server::serve(listener, app, async move {
            shutdown().await;
            let _ = stopping.send(true);
        }));
        let spec = args.model.model.clone();
        let kv_events = match &args.kv_events_endpoint {
            Some(endpoint) => {
                let sink =
                    tessera_server::kv_events::start(tessera_server::kv_events::KvEventsConfig {
                        endpoint: endpoint.clone(),
                        replay_endpoint: args.kv_events_replay_endpoint.clone(),
                        topic: args.kv_events_topic.clone(),
                        buffer: 10_000,
                    })
                    .await
                    .map_err(anyhow::Error::msg)?;
                eprintln!("tessera serve: KV events on {endpoint}");
                Some(sink)
            }
            None => None,
        };
        let cfg = EngineConfig {
            cache_dir: args.cache_dir.clone(),
            cache_dir_bytes: args.cache_dir_size as u64,
            kv_events,
            ..args.kv.config(true)
        };
        let engine = tokio::task::spawn_blocking(move || -> Result<Arc<Engine>> {
            let dir = cfg.cache_dir.clone();
            let engine =
                Engine::from_model(load_model(&spec)?, cfg).with_context(|| match &dir {
                    Some(d) => format!(
                        "starting the engine (if {} is damaged, remove it)",
                        d.join(tessera_engine::CACHE_FILE).display()
                    ),
                    None => "starting the engine".into(),
                })?;
            if let Some(dir) = &dir {
                let s = engine.stats();
                eprintln!(
                    "tessera serve: {} cached tokens restored from {}{}",
                    s.kv.cached_tokens,
                    dir.display(),
                    s.disk_tier.map_or_else(String::new, |t| format!(
                        "; its disk tier holds {} blocks ({:.1} MiB)",
                        t.blocks,
                        t.bytes as f64 / (1 << 20) as f64
                    ))
                );
            }
            Ok(Arc::new(engine))
        })
        .await??;
        server.set_engine(engine.clone());
        eprintln!("tessera serve: ready");
        // The shutdown timeout: once it passes, the requests still running
        // end with an error event, so the graceful shutdown ends.
        let patience = Duration::from_secs_f64(args.shutdown_timeout.max(0.0));
        let e2 = engine.clone();
        tokio::spawn(async move {
            if stop_seen.wait_for(|&s| s).await.is_err() {
                return;
            }
            tokio::time::sleep(patience).await;
            eprintln!(
                "tessera serve: ending the requests still running after {:.0} s",
                patience.as_secs_f64()
            );
            let _ = tokio::task::spawn_blocking(move || {
                e2.fail_all("the shutdown timeout passed (--shutdown-timeout)")
            })
            .await;
        });
        serving.await??;
        if args.cache_dir.is_some() {
            let written = tokio::task::spawn_blocking(move || engine.persist_now())
                .await?
                .context("writing the prefix cache")?;
            if let Some(dir) = written {
                eprintln!("tessera serve: prefix cache written to {}", dir.display());
            }
        }
        Ok(())
    })
}

/// Resolves at SIGINT or SIGTERM.
async fn shutdown() {
    let int = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = int.await;
                    return;
                }
            };
        tokio::select! {
            _ = int => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = int.await;
    }
    eprintln!("tessera serve: shutting down after the requests in flight");
}
