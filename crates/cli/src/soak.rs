//! `tessera bench --scenario soak`: the engine under a long random mix of
//! what users and operators do, with faults injected into its steps, to show
//! that nothing leaks and nothing wedges.
//!
//! Each round submits up to four requests together (random prompt lengths
//! over a few shared system prompts, 1 to 48 new tokens, `n` up to 3, some
//! cancelled part way, some long enough to shift the context), and between
//! rounds, now and then: a session saved and loaded back, a defragmentation,
//! the pool shrunk and grown back, a session saved in a tenant's partition
//! while a stream decodes (then restored and used there), a prompt sent in
//! one partition and then another (a cached token in the second is a
//! cross-partition hit, which fails the soak). Requests are spread over four
//! partitions (two tenants, a salt, the default), and one in ten is dropped
//! as soon as it is submitted (a client that hung up). Speculative decoding
//! is on, and one request in five is constrained (a JSON schema, a regex,
//! or a forced tool call): each such answer that ends with `stop` must
//! match its constraint. One step in about 150 fails with an error
//! and one in about 300 panics. At the end: requests done and failed, the
//! blocks still held (leaked) once every request is over, the KV invariants,
//! and the process's resident memory after warm-up, at its peak and at the
//! end.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{bail, Result};
use tessera_engine::{
    ContextShift, Engine, EngineConfig, EngineError, Event, Fault, FaultHook, GenerateRequest,
    Partition, Prompt, SamplingParams, SplitMix64, INJECTED_PANIC,
};
use tessera_model::Model;

use crate::bench::BenchArgs;

/// Resident and peak resident memory of this process, in bytes (Linux;
/// zero elsewhere).
fn rss() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

const CONTEXT: usize = 256;

/// Faults for about one step in `error_every` (errors) and one in
/// `panic_every` (panics), by a hash of the step's number.
fn fault_hook(error_every: u64, panic_every: u64) -> FaultHook {
    let step = AtomicU64::new(0);
    FaultHook::new(move |_| {
        let n = step.fetch_add(1, Ordering::Relaxed);
        let h = SplitMix64(n ^ 0x5eed).next_u64();
        if h.is_multiple_of(panic_every) {
            Some(Fault::Panic)
        } else if h % error_every == 1 {
            Some(Fault::Error)
        } else {
            None
        }
    })
}

/// The KV events as a router's index replays them: every stored block
/// new and after a parent it knows, every removed block known; what does
/// not hold is counted (a lost or reordered event shows here).
#[derive(Default)]
struct EventIndex {
    blocks: std::collections::HashSet<u64>,
    batches: u64,
    stored: u64,
    removed: u64,
    last_ts: f64,
    violations: u64,
    first: Option<String>,
}

impl EventIndex {
    fn apply(&mut self, b: tessera_engine::KvEventBatch) {
        use tessera_engine::KvEvent;
        fn bad(what: String, me: &mut EventIndex) {
            me.violations += 1;
            me.first.get_or_insert(what);
        }
        self.batches += 1;
        if b.ts < self.last_ts {
            bad(format!("batch {} goes back in time", self.batches), self);
        }
        self.last_ts = b.ts;
        for e in b.events {
            match e {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    ..
                } => {
                    if parent_block_hash.is_some_and(|p| !self.blocks.contains(&p)) {
                        bad(
                            format!("batch {}: a parent never stored", self.batches),
                            self,
                        );
                    }
                    for h in block_hashes {
                        self.stored += 1;
                        if !self.blocks.insert(h) {
                            bad(
                                format!("batch {}: a block stored twice", self.batches),
                                self,
                            );
                        }
                    }
                }
                KvEvent::BlockRemoved { block_hashes, .. } => {
                    for h in block_hashes {
                        self.removed += 1;
                        if !self.blocks.remove(&h) {
                            bad(
                                format!("batch {}: a block removed unstored", self.batches),
                                self,
                            );
                        }
                    }
                }
                KvEvent::AllBlocksCleared => self.blocks.clear(),
            }
        }
    }
}

#[derive(Default)]
struct Tally {
    done: usize,
    samples: usize,
    cancelled: usize,
    failed: usize,
    shifted: usize,
    sessions: usize,
    defrags: usize,
    resizes: usize,
    /// Requests whose stream was dropped before any event (a client gone).
    hung_up: usize,
    /// Session saves beside a running stream, in a tenant's partition.
    background_saves: usize,
    /// Prompts sent in one partition, then in another: any cached token
    /// in the second is a hit across partitions.
    probes: usize,
    cross_hits: usize,
    /// The same prompts sent again in their first partition, whole from
    /// the cache.
    own_hits: usize,
    /// Constrained answers that ended with `stop`, checked against their
    /// constraint, and those that did not match it.
    constrained: usize,
    unmatched: usize,
}

/// A soak request's constraint, and whether a finished answer matches it.
#[derive(Clone, Copy)]
enum Shape {
    Json,
    Regex,
    Tool,
}

fn shape_constraint(
    shape: Shape,
    tools: &[tessera_engine::ToolSpec],
    syntax: &tessera_engine::ToolSyntax,
) -> Result<tessera_engine::Constraint> {
    use tessera_engine::Constraint;
    Ok(match shape {
        Shape::Json => Constraint::JsonSchema(serde_json::json!({"type": "object",
            "properties": {"word": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
            "required": ["word", "n"], "additionalProperties": false})),
        Shape::Regex => Constraint::Regex("[a-z]{1,8}( [a-z]{1,8}){0,4}\\.".into()),
        Shape::Tool => syntax
            .constraint(tools, &tessera_engine::ToolChoice::Required, true)
            .map_err(anyhow::Error::msg)?
            .expect("required gives a grammar"),
    })
}

fn shape_matches(shape: Shape, text: &str, syntax: &tessera_engine::ToolSyntax) -> bool {
    match shape {
        Shape::Json => serde_json::from_str::<serde_json::Value>(text)
            .ok()
            // An integer as JSON Schema counts them (`-0` and `1.0` too).
            .and_then(|v| Some(v.get("word")?.is_string() && v.get("n")?.as_f64()?.fract() == 0.0))
            .unwrap_or(false),
        Shape::Regex => {
            text.ends_with('.')
                && text[..text.len() - 1].split(' ').all(|w| {
                    (1..=8).contains(&w.len()) && w.bytes().all(|b| b.is_ascii_lowercase())
                })
        }
        Shape::Tool => syntax
            .parse(text)
            .is_some_and(|(_, calls)| !calls.is_empty()),
    }
}

/// The partitions the soak's requests are spread over: the default one,
/// two tenants, and a salt within one of them.
fn partitions() -> Vec<Partition> {
    let tenant = |t: &str, salt: Option<&str>| Partition {
        tenant: Some(t.into()),
        salt: salt.map(str::to_string),
    };
    vec![
        Partition::default(),
        tenant("a", None),
        tenant("b", None),
        tenant("a", Some("s")),
    ]
}

pub fn soak(model: Model, args: &BenchArgs) -> Result<()> {
    let n_requests = args.requests.max(1);
    // The engine's worker catches the injected panics; keep their reports
    // out of the output (other panics are still reported).
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let injected = info.payload().downcast_ref::<&str>() == Some(&INJECTED_PANIC);
        if !injected {
            default_hook(info);
        }
    }));
    let systems: Vec<String> = (0..4)
        .map(|i| tessera_bench::text(&model, 900 + i, 60))
        .collect::<Result<_>>()?;
    let body = tessera_bench::text(&model, 999, 400)?;
    let tok = model.tokenizer.clone();
    let system_ids: Vec<Vec<u32>> = systems
        .iter()
        .map(|s| tok.encode(s, tessera_model::Special::AsText, true))
        .collect::<std::result::Result<_, _>>()?;
    let body_ids = tok.encode(&body, tessera_model::Special::AsText, false)?;
    // KV events replayed into an index, and a disk tier under the pool.
    let events: std::sync::Arc<std::sync::Mutex<EventIndex>> = Default::default();
    let sink = {
        let events = events.clone();
        tessera_engine::KvEventSink::new(move |b| events.lock().expect("not poisoned").apply(b))
    };
    let tier_dir = std::env::temp_dir().join(format!("tessera-soak-tier-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tier_dir);
    let cfg = EngineConfig {
        kv_events: Some(sink),
        cache_dir: Some(tier_dir.clone()),
        context_length: Some(CONTEXT),
        faults: Some(fault_hook(150, 300)),
        max_running: 8,
        prefill_chunk: 128,
        speculative: Some(tessera_engine::NgramSpec::default()),
        ..args.kv.config(true)
    };
    let engine = Engine::from_model(model, cfg)?;
    let syntax =
        tessera_engine::ToolSyntax::of(&engine.model().template, &engine.model().tokenizer);
    let tools =
        vec![
            tessera_engine::ToolSpec::from_openai(&serde_json::json!({"type": "function",
        "function": {"name": "lookup", "parameters": {"type": "object",
            "properties": {"q": {"type": "string", "maxLength": 16}}, "required": ["q"]}}}))
            .map_err(anyhow::Error::msg)?,
        ];
    let full_bytes = engine.stats().kv.num_blocks * engine.block_bytes();
    let session = std::env::temp_dir().join(format!("tessera-soak-{}.tkv", std::process::id()));
    let bg_session =
        std::env::temp_dir().join(format!("tessera-soak-bg-{}.tkv", std::process::id()));
    // Seeded: the same mix on every run.
    let mut rng = SplitMix64(42);
    let mut t = Tally::default();
    let warm_up = n_requests / 10;
    let mut rss_warm = 0;
    let started = Instant::now();
    let mut submitted = 0;
    let parts = partitions();
    while submitted < n_requests {
        let batch = (1 + rng.below(4)).min(n_requests - submitted);
        let mut streams = Vec::new();
        for _ in 0..batch {
            let sys = &system_ids[rng.below(system_ids.len())];
            let shift = rng.below(8) == 0;
            // A request that shifts starts near the context limit.
            let len = if shift { 150 } else { 1 + rng.below(150) };
            let from = rng.below(body_ids.len() - 200);
            let mut prompt = sys.clone();
            prompt.extend(&body_ids[from..from + len]);
            let n = if rng.below(6) == 0 {
                2 + rng.below(2)
            } else {
                1
            };
            let shape = (!shift && rng.below(5) == 0)
                .then(|| [Shape::Json, Shape::Regex, Shape::Tool][rng.below(3)]);
            let req = GenerateRequest {
                max_tokens: if shift {
                    CONTEXT + 16 - prompt.len().min(CONTEXT)
                } else if shape.is_some() {
                    // Room to finish most constrained answers.
                    40 + rng.below(40)
                } else {
                    1 + rng.below(32)
                },
                constraint: shape
                    .map(|s| shape_constraint(s, &tools, &syntax))
                    .transpose()?,
                sampling: SamplingParams {
                    seed: rng.next_u64(),
                    ..SamplingParams::default()
                },
                ignore_eos: shift,
                context_shift: if shift {
                    ContextShift::Keep(16)
                } else {
                    ContextShift::Off
                },
                n,
                partition: parts[rng.below(parts.len())].clone(),
                ..GenerateRequest::new(Prompt::Tokens(prompt))
            };
            let cancel_after = (rng.below(8) == 0).then(|| rng.below(12));
            let stream = engine.generate(req)?;
            submitted += 1;
            if rng.below(10) == 0 {
                // The client is gone before anything came back.
                drop(stream);
                t.hung_up += 1;
                continue;
            }
            streams.push((stream, cancel_after, n, shift, shape));
        }
        for (stream, cancel_after, n, shift, shape) in streams {
            let mut tokens = 0;
            let (mut done, mut failed) = (0, false);
            for ev in stream {
                match ev {
                    Event::Token { .. } => {
                        tokens += 1;
                        if cancel_after == Some(tokens) {
                            t.cancelled += 1;
                            break;
                        }
                    }
                    Event::Done(c) => {
                        done += 1;
                        if let Some(s) =
                            shape.filter(|_| c.finish_reason == tessera_engine::FinishReason::Stop)
                        {
                            t.constrained += 1;
                            if !shape_matches(s, &c.text, &syntax) {
                                t.unmatched += 1;
                                eprintln!(
                                    "soak: a constrained answer does not match: {:?}",
                                    c.text
                                );
                            }
                        }
                    }
                    Event::Error(_) => failed = true,
                }
            }
            t.samples += done;
            if failed {
                t.failed += 1;
            } else if done == n {
                t.done += 1;
                t.shifted += usize::from(shift);
            }
        }
        match rng.below(12) {
            0 => {
                let mut chat = engine.chat(Some(&systems[0]));
                let opts = tessera_engine::TurnOptions {
                    max_tokens: 8,
                    ..Default::default()
                };
                // A turn may hit an injected fault like any request.
                match chat.send("Say something short.", &opts, &mut |_| {}) {
                    Ok(_) => match chat.save(&session) {
                        Ok(()) => {
                            let back = engine.load_session(&session)?;
                            if back.token_ids() != chat.token_ids() {
                                bail!("a session came back with other tokens");
                            }
                            t.sessions += 1;
                        }
                        // The save computes in steps (a background
                        // request), which may fail like any request's.
                        Err(EngineError::Injected | EngineError::Step(_)) => t.failed += 1,
                        Err(e) => bail!("a chat session save failed: {e}"),
                    },
                    Err(_) => t.failed += 1,
                }
            }
            1 => {
                engine.defragment()?;
                t.defrags += 1;
            }
            2 => {
                // Shrink to half between rounds, then grow back.
                engine.resize_kv(full_bytes / 2)?;
                engine.resize_kv(full_bytes)?;
                t.resizes += 1;
            }
            3 => {
                // A prompt nobody sent, in one partition, then in another:
                // the second must compute all of it.
                let (x, y) = (rng.below(parts.len()), rng.below(parts.len()));
                if x != y {
                    // Random ids: nothing else in any partition starts
                    // like it (other prompts start with BOS and text).
                    let vocab = engine.model().config().vocab_size as u64;
                    let ids: Vec<u32> = (0..40)
                        .map(|_| (1000 + rng.next_u64() % (vocab - 1000)) as u32)
                        .collect();
                    let probe = |p: &Partition| {
                        let req = GenerateRequest {
                            max_tokens: 1,
                            partition: p.clone(),
                            ..GenerateRequest::new(Prompt::Tokens(ids.clone()))
                        };
                        engine.complete(&req, &mut |_| {})
                    };
                    // Either may hit an injected fault like any request.
                    if probe(&parts[x]).is_ok() {
                        if let Ok(done) = probe(&parts[y]) {
                            t.probes += 1;
                            t.cross_hits += usize::from(done.usage.cached_tokens > 0);
                            // The probe itself sees hits: its own partition's.
                            if let Ok(again) = probe(&parts[x]) {
                                let all = again.usage.cached_tokens == ids.len() - 1;
                                t.own_hits += usize::from(all);
                            }
                        }
                    }
                }
            }
            4 => {
                // A session saved in a tenant's partition beside a stream.
                let p = parts[1 + rng.below(parts.len() - 1)].clone();
                // Most of the context, in a partition of a tenant.
                let len = CONTEXT - 8 - system_ids[0].len().min(CONTEXT - 8);
                let from = rng.below(body_ids.len() - len);
                let ids: Vec<u32> = system_ids[0]
                    .iter()
                    .chain(&body_ids[from..from + len])
                    .copied()
                    .collect();
                let req = GenerateRequest {
                    max_tokens: 24,
                    ignore_eos: true,
                    ..GenerateRequest::new(Prompt::Tokens(system_ids[1].clone()))
                };
                let stream = engine.generate(req)?;
                let (e, path) = (engine.clone(), bg_session.clone());
                let (p2, ids2) = (p.clone(), ids.clone());
                let saver = std::thread::spawn(move || e.save_kv_session_in(&p2, &path, &ids2));
                for _ in stream {}
                let saved = saver
                    .join()
                    .map_err(|_| anyhow::anyhow!("a session save panicked"))?;
                // A save may meet an injected fault in a step it rides.
                let saved = match saved {
                    Ok(saved) => Some(saved),
                    Err(EngineError::Injected | EngineError::Step(_)) => {
                        t.failed += 1;
                        None
                    }
                    Err(e) => bail!("a session save beside a stream failed: {e}"),
                };
                if let Some(saved) = saved {
                    engine.clear_cache()?;
                    if engine.load_kv_session_in(&p, &bg_session)? != saved.tokens {
                        bail!("a session saved beside a stream came back with other tokens");
                    }
                    let req = GenerateRequest {
                        max_tokens: 1,
                        partition: p.clone(),
                        ..GenerateRequest::new(Prompt::Tokens(ids.clone()))
                    };
                    // Served from the restored session, in its partition only.
                    if let Ok(done) = engine.complete(&req, &mut |_| {}) {
                        if done.usage.cached_tokens != ids.len() - 1 {
                            bail!(
                                "a restored session served {} of {} tokens",
                                done.usage.cached_tokens,
                                ids.len()
                            );
                        }
                    }
                    t.background_saves += 1;
                }
            }
            _ => {}
        }
        if rss_warm == 0 && submitted >= warm_up {
            rss_warm = rss().0;
        }
    }
    let _ = std::fs::remove_file(&session);
    let _ = std::fs::remove_file(&bg_session);
    // Cancelled requests end at the engine's next step: wait for them.
    let idle_by = Instant::now() + std::time::Duration::from_secs(30);
    while engine.stats().active_samples > 0 && Instant::now() < idle_by {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let elapsed = started.elapsed().as_secs_f64();
    let stats = engine.stats();
    engine.check_kv()?;
    // Cleared, the cache holds nothing: the index, replayed from every
    // event, must be empty too (a command after the clear has passed the
    // worker's flush of its events).
    engine.clear_cache()?;
    engine.check_kv()?;
    let (ev_batches, ev_stored, ev_removed, ev_bad, ev_first, ev_left) = {
        let e = events.lock().expect("not poisoned");
        (
            e.batches,
            e.stored,
            e.removed,
            e.violations,
            e.first.clone(),
            e.blocks.len(),
        )
    };
    let tier = stats.disk_tier.unwrap_or_default();
    drop(engine);
    let _ = std::fs::remove_dir_all(&tier_dir);
    // With --model-draft, its cache's blocks and sequences count too.
    let draft = stats.draft_kv.unwrap_or_default();
    let leaked = stats.kv.used_blocks + draft.used_blocks;
    let sequences_left = stats.kv.sequences + draft.sequences;
    let (rss_end, rss_peak) = rss();
    let growth = rss_end as f64 / rss_warm.max(1) as f64 - 1.0;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let lines = vec![
        format!("soak: {n_requests} requests in {elapsed:.0} s (context {CONTEXT}, faults in about 1 step of 150 as errors and 1 of 300 as panics)"),
        format!("  done {} ({} samples, {} with a context shift) | cancelled {} | failed {} | steps failed {}", t.done, t.samples, t.shifted, t.cancelled, t.failed, stats.failed_steps),
        format!("  sessions saved and loaded {} | defragmentations {} | shrink and grow {}", t.sessions, t.defrags, t.resizes),
        format!("  partitions {} | hung up before an answer {} | sessions saved beside a stream {} | cross-partition probes {} with {} hits (again in their own partition: {} whole from the cache)", parts.len(), t.hung_up, t.background_saves, t.probes, t.cross_hits, t.own_hits),
        format!("  speculative decoding: {} of {} draft tokens kept | constrained answers finished {} ({} not matching)", stats.spec_accepted_tokens, stats.spec_draft_tokens, t.constrained, t.unmatched),
        format!("  blocks leaked {leaked} | sequences left {sequences_left} | KV invariants hold{}", if stats.draft_kv.is_some() { " (the draft model's cache included)" } else { "" }),
        format!("  KV events: {ev_batches} batches, {ev_stored} blocks stored, {ev_removed} removed, {ev_bad} out of order or lost{}, {ev_left} left after a clear | disk tier: {} blocks written, {} read back, {} prompt tokens from disk", ev_first.as_ref().map_or(String::new(), |f| format!(" (first: {f})")), tier.written, tier.read, stats.disk_cached_tokens),
        format!("  RSS after warm-up {:.1} MiB, peak {:.1} MiB, end {:.1} MiB: growth {:+.1}%", mib(rss_warm), mib(rss_peak), mib(rss_end), growth * 100.0),
    ];
    let v = serde_json::json!({
        "scenario": "soak",
        "requests": n_requests,
        "seconds": elapsed,
        "done": t.done,
        "samples": t.samples,
        "shifted": t.shifted,
        "cancelled": t.cancelled,
        "failed": t.failed,
        "failed_steps": stats.failed_steps,
        "sessions": t.sessions,
        "defrags": t.defrags,
        "resizes": t.resizes,
        "hung_up": t.hung_up,
        "background_saves": t.background_saves,
        "probes": t.probes,
        "cross_partition_hits": t.cross_hits,
        "own_partition_hits": t.own_hits,
        "spec_draft_tokens": stats.spec_draft_tokens,
        "spec_accepted_tokens": stats.spec_accepted_tokens,
        "constrained": t.constrained,
        "unmatched": t.unmatched,
        "leaked_blocks": leaked,
        "kv_event_batches": ev_batches,
        "kv_events_stored": ev_stored,
        "kv_events_removed": ev_removed,
        "kv_event_violations": ev_bad,
        "kv_event_blocks_left": ev_left,
        "tier_blocks_written": tier.written,
        "tier_blocks_read": tier.read,
        "disk_cached_tokens": stats.disk_cached_tokens,
        "sequences_left": sequences_left,
        "draft_model": stats.draft_kv.is_some(),
        "rss_warm_bytes": rss_warm,
        "rss_peak_bytes": rss_peak,
        "rss_end_bytes": rss_end,
        "rss_growth": growth,
    });
    crate::scenarios::emit(args, v, &lines);
    if t.unmatched != 0 {
        bail!(
            "{} constrained answers do not match their constraint",
            t.unmatched
        );
    }
    if t.cross_hits != 0 {
        bail!("{} prompts were served across partitions", t.cross_hits);
    }
    if ev_bad != 0 || ev_left != 0 {
        bail!("KV events: {ev_bad} out of order or lost, {ev_left} blocks left after a clear");
    }
    if leaked != 0 || sequences_left != 0 {
        bail!("{leaked} blocks and {sequences_left} sequences leaked");
    }
    Ok(())
}
