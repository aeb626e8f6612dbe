//! The engine's KV events ([`tessera_engine::KvEvent`]) published over
//! ZeroMQ in vLLM's wire format, for the routers that place requests by
//! what each replica holds (NVIDIA Dynamo's KV router, llm-d's indexer,
//! vllm-router):
//!
//! ```text
//! PUB     [topic, seq (u64 big-endian), payload]       one message a step
//! payload msgpack [ts, [event, …], data_parallel_rank]
//! event   ["BlockStored", [hash, …], parent hash | nil, [token id, …],
//!          block size, lora id (nil), medium]
//!         ["BlockRemoved", [hash, …], medium]
//!         ["AllBlocksCleared"]
//! ROUTER  replay: a request [identity, "", start seq (u64 BE)] gets every
//!         kept batch from that sequence number on as
//!         [identity, "", seq, payload], then [identity, "", -1 (i64 BE), ""]
//! ```
//!
//! (vLLM's `KVEventBatch` with `msgspec`'s `array_like` and `tag`
//! encoding, as its `ZmqEventPublisher` sends it.) Block hashes are the
//! engine's chain hashes, 63 bits so that consumers reading signed 64-bit
//! integers read them too; the medium is `"CPU"` or `"GPU"`, where the pool
//! lives, or `"DISK"` for the disk tier's blocks (`--cache-dir`).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tessera_engine::{KvEvent, KvEventBatch, KvEventSink};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// Where the events go.
#[derive(Debug, Clone)]
pub struct KvEventsConfig {
    /// The PUB socket's endpoint, e.g. `tcp://*:5557` (bound; `*` is every
    /// interface).
    pub endpoint: String,
    /// The ROUTER socket answering replay requests, e.g. `tcp://*:5558`.
    pub replay_endpoint: Option<String>,
    pub topic: String,
    /// Batches kept for replay.
    pub buffer: usize,
}

/// `tcp://*:PORT` as the socket library binds it.
fn bindable(endpoint: &str) -> String {
    endpoint.replacen("://*:", "://0.0.0.0:", 1)
}

/// The msgpack payload of one batch (see the module docs).
pub fn encode(batch: &KvEventBatch, dp_rank: u32) -> Vec<u8> {
    use rmp::encode::*;
    let mut w = Vec::new();
    let hash = |w: &mut Vec<u8>, h: u64| {
        write_uint(w, h & i64::MAX as u64).expect("writes to a Vec");
    };
    let hashes = |w: &mut Vec<u8>, hs: &[u64]| {
        write_array_len(w, hs.len() as u32).expect("writes to a Vec");
        for &h in hs {
            hash(w, h);
        }
    };
    write_array_len(&mut w, 3).expect("writes to a Vec");
    write_f64(&mut w, batch.ts).expect("writes to a Vec");
    write_array_len(&mut w, batch.events.len() as u32).expect("writes to a Vec");
    for e in &batch.events {
        match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
            } => {
                write_array_len(&mut w, 7).expect("writes to a Vec");
                write_str(&mut w, "BlockStored").expect("writes to a Vec");
                hashes(&mut w, block_hashes);
                match parent_block_hash {
                    Some(p) => hash(&mut w, *p),
                    None => write_nil(&mut w).expect("writes to a Vec"),
                }
                write_array_len(&mut w, token_ids.len() as u32).expect("writes to a Vec");
                for &t in token_ids {
                    write_uint(&mut w, u64::from(t)).expect("writes to a Vec");
                }
                write_uint(&mut w, *block_size as u64).expect("writes to a Vec");
                write_nil(&mut w).expect("writes to a Vec");
                write_str(&mut w, medium).expect("writes to a Vec");
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } => {
                write_array_len(&mut w, 3).expect("writes to a Vec");
                write_str(&mut w, "BlockRemoved").expect("writes to a Vec");
                hashes(&mut w, block_hashes);
                write_str(&mut w, medium).expect("writes to a Vec");
            }
            KvEvent::AllBlocksCleared => {
                write_array_len(&mut w, 1).expect("writes to a Vec");
                write_str(&mut w, "AllBlocksCleared").expect("writes to a Vec");
            }
        }
    }
    write_uint(&mut w, u64::from(dp_rank)).expect("writes to a Vec");
    w
}

/// Runs `task`; a panic in it (the socket library's, on a peer it does
/// not expect) ends it with an error in the log instead of silently.
fn spawn_logged(what: &'static str, task: impl std::future::Future<Output = ()> + Send + 'static) {
    use futures_util::FutureExt;
    tokio::spawn(async move {
        if let Err(p) = std::panic::AssertUnwindSafe(task).catch_unwind().await {
            let why = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!("KV events {what} stopped: {why}");
        }
    });
}

/// Binds the sockets and starts publishing (on the current tokio
/// runtime); the sink goes into the engine's configuration. A socket that
/// cannot bind is an error now, not a silent loss later.
pub async fn start(cfg: KvEventsConfig) -> Result<KvEventSink, String> {
    let mut publisher = PubSocket::new();
    publisher
        .bind(&bindable(&cfg.endpoint))
        .await
        .map_err(|e| format!("KV events endpoint {}: {e}", cfg.endpoint))?;
    let kept: Arc<Mutex<VecDeque<(u64, Bytes)>>> = Default::default();
    if let Some(replay) = &cfg.replay_endpoint {
        let mut router = RouterSocket::new();
        router
            .bind(&bindable(replay))
            .await
            .map_err(|e| format!("KV events replay endpoint {replay}: {e}"))?;
        let kept = kept.clone();
        spawn_logged("replay", async move {
            while let Ok(req) = router.recv().await {
                let frames = req.into_vec();
                let [id, _, start] = frames.as_slice() else {
                    tracing::warn!("a KV events replay request of {} frames", frames.len());
                    continue;
                };
                let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else {
                    tracing::warn!("a KV events replay request without an 8-byte sequence number");
                    continue;
                };
                let batches: Vec<(u64, Bytes)> = kept
                    .lock()
                    .expect("not poisoned")
                    .iter()
                    .filter(|(s, _)| *s >= start)
                    .cloned()
                    .collect();
                let send = |seq: Bytes, payload: Bytes| {
                    ZmqMessage::try_from(vec![id.clone(), Bytes::new(), seq, payload])
                        .expect("four frames")
                };
                for (seq, payload) in batches {
                    let msg = send(Bytes::copy_from_slice(&seq.to_be_bytes()), payload);
                    if router.send(msg).await.is_err() {
                        break;
                    }
                }
                let end = send(Bytes::copy_from_slice(&(-1i64).to_be_bytes()), Bytes::new());
                let _ = router.send(end).await;
            }
        });
    }
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<KvEventBatch>();
    let topic = Bytes::from(cfg.topic.clone().into_bytes());
    let most = cfg.buffer.max(1);
    spawn_logged("publishing", async move {
        let mut seq = 0u64;
        while let Some(batch) = rx.recv().await {
            let payload = Bytes::from(encode(&batch, 0));
            let msg = ZmqMessage::try_from(vec![
                topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload.clone(),
            ])
            .expect("three frames");
            {
                let mut kept = kept.lock().expect("not poisoned");
                if kept.len() == most {
                    kept.pop_front();
                }
                kept.push_back((seq, payload));
            }
            // With no subscriber the batch is dropped (kept for replay),
            // as a PUB socket does.
            if let Err(e) = publisher.send(msg).await {
                tracing::warn!("publishing KV events: {e}");
            }
            seq += 1;
        }
    });
    Ok(KvEventSink::new(move |b| {
        let _ = tx.send(b);
    }))
}
