//! [`Engine`]: a cheap, cloneable, thread-safe handle to one model, its
//! paged KV pool and prefix cache, served by a worker thread that runs the
//! continuous-batching loop (see `worker.rs`). Every method of the handle
//! lives in this file: requests, chat turns, sessions and the cache
//! directory, pool management.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use tessera_kv::KvStats;
use tessera_model::{Model, Special};
use tracing::warn;

use crate::sampler::argmax_and_norm;
use crate::snapshot::{read_file, write_file, Geometry, KvSnapshot, CACHE_FILE};
use crate::stream::{Event, RequestStream};
use crate::types::{
    Completion, EngineConfig, EngineStats, GenerateRequest, Partition, Prompt, TokenEvent,
};
use crate::worker::{Command, KvLayout, Worker};
use crate::{EngineError, ModelSource, Result};

/// A model with its paged K/V pool and prefix cache, served by one worker
/// thread. Cloning is cheap; clones share everything and may be used from
/// any thread. Requests run concurrently, batched together step by step.
/// The worker stops (writing the cache to `cache_dir`, if set) when the last
/// clone is dropped.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

struct Inner {
    model: Arc<Model>,
    cfg: EngineConfig,
    ctx: usize,
    per_block: usize,
    tx: mpsc::Sender<Command>,
    worker: Option<JoinHandle<()>>,
    /// Where the prefix cache is written when the engine stops: set only
    /// once restoring from there succeeded (or found nothing), so that a
    /// file this engine could not read is never overwritten.
    persist: Mutex<Option<PathBuf>>,
    /// Compiles requests' structured-output constraints.
    grammars: crate::grammar::Grammars,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let dir = self.persist.lock().ok().and_then(|mut d| d.take());
        if let Some(dir) = dir {
            // Requests still in flight end first, so their work is saved.
            let (tx, rx) = mpsc::channel();
            if self.tx.send(Command::CancelAll(tx)).is_ok() {
                let _ = rx.recv();
            }
            let (tx, rx) = mpsc::channel();
            let snaps = self
                .tx
                .send(Command::ExportCache(tx))
                .ok()
                .and_then(|()| rx.recv().ok());
            let geometry = Geometry::of(&self.model, self.cfg.cache_dtype);
            let written = match snaps {
                Some(Ok(snaps)) => write_cache_dir(&dir, &geometry, snaps),
                Some(Err(e)) => Err(e),
                None => Err(EngineError::Stopped),
            };
            if let Err(e) = written {
                warn!("writing the prefix cache to {}: {e}", dir.display());
            }
        }
        let _ = self.tx.send(Command::Shutdown);
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

impl Engine {
    /// Loads the model (downloading a hub source) and sizes the pool.
    pub fn load(
        source: &ModelSource,
        cfg: EngineConfig,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Engine> {
        let path = source.resolve()?;
        // Before the weights are packed for the kernels that it picks.
        apply_tuning(&cfg);
        let device = cfg.device.open()?;
        let model = Model::load_on(&path, &device, progress)?;
        Engine::from_model(model, cfg)
    }

    /// Sizes the pool from `cfg.kv_memory`, starts the worker, and restores
    /// the prefix cache from `cfg.cache_dir` when it holds one.
    pub fn from_model(mut model: Model, cfg: EngineConfig) -> Result<Engine> {
        apply_tuning(&cfg);
        if let Some(n) = cfg.threads {
            // Fails only when the pool already exists: the first one stays.
            let _ = rayon::ThreadPoolBuilder::new()
                .num_threads(n.max(1))
                .build_global();
        }
        if let Some(a) = cfg.activations {
            model.llama.set_activations(a);
        }
        let device = model.llama.device();
        if device.is_metal() && cfg.cache_dtype.is_quantized() {
            return Err(EngineError::Invalid(format!(
                "cache dtype {} runs on the CPU and CUDA only; on {} use f16, bf16 or f32",
                cfg.cache_dtype,
                tessera_model::device_name(device)
            )));
        }
        if let Some(ctx) = cfg.context_length {
            // What LongRoPE chooses its factors by (before any forward).
            model.llama.set_context_length(ctx)?;
        }
        model.llama.prepare()?;
        let draft = match &cfg.draft {
            Some(d) => Some((load_draft(d, &model, &cfg)?, d.p_min)),
            None => None,
        };
        let mc = model.config();
        // With a draft model, each pool holds as many tokens.
        let share = draft.as_ref().map_or(cfg.kv_memory, |(d, _)| {
            let (a, b) = (
                mc.kv_bytes_per_token(cfg.cache_dtype) as u128,
                d.config().kv_bytes_per_token(cfg.cache_dtype) as u128,
            );
            (cfg.kv_memory as u128 * a / (a + b).max(1)) as usize
        });
        let layout = KvLayout::new(
            mc,
            &EngineConfig {
                kv_memory: share,
                ..cfg.clone()
            },
        )?;
        let per_block = layout.block_bytes;
        let ctx = cfg.context_length.unwrap_or(mc.context_length);
        let drafts = match draft {
            Some((d, p_min)) => {
                let dcfg = EngineConfig {
                    kv_memory: cfg.kv_memory - share,
                    self_extend: None,
                    swa_blocks: None,
                    ..cfg.clone()
                };
                let layout = KvLayout::new(d.config(), &dcfg)?;
                Some(crate::draft::Drafts::new(crate::draft::DraftSetup {
                    ctx: ctx.min(d.config().context_length),
                    model: Arc::new(d),
                    kv: layout.kv_config(cfg.block_size),
                    dtype: cfg.cache_dtype,
                    chunk: cfg.prefill_chunk.max(1),
                    p_min,
                    prefix_cache: cfg.prefix_cache,
                })?)
            }
            None => None,
        };
        let model = Arc::new(model);
        let core = Worker::new(model.clone(), &cfg, ctx, &layout, drafts)?;
        let (tx, rx) = mpsc::channel();
        let worker = std::thread::Builder::new()
            .name("tessera-engine".into())
            .spawn(move || core.run(rx))
            .map_err(|e| EngineError::Invalid(format!("cannot start the engine thread: {e}")))?;
        let engine = Engine {
            inner: Arc::new(Inner {
                model,
                cfg,
                ctx,
                per_block,
                tx,
                worker: Some(worker),
                persist: Mutex::new(None),
                grammars: Default::default(),
            }),
        };
        if let Some(dir) = &engine.inner.cfg.cache_dir {
            engine.restore_cache_dir(dir)?;
            *engine.inner.persist.lock().expect("not poisoned") = Some(dir.clone());
        }
        Ok(engine)
    }

    pub fn model(&self) -> &Model {
        &self.inner.model
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.cfg
    }

    pub fn context_length(&self) -> usize {
        self.inner.ctx
    }

    /// Bytes of one KV block (all layers, K and V; with sliding-window
    /// layers on a pool of their own, the other layers').
    pub fn block_bytes(&self) -> usize {
        self.inner.per_block
    }

    /// Sends a command to the worker and waits for its answer.
    pub(crate) fn call<T: Send + 'static>(
        &self,
        make: impl FnOnce(mpsc::Sender<T>) -> Command,
    ) -> Result<T> {
        let (tx, rx) = mpsc::channel();
        self.inner
            .tx
            .send(make(tx))
            .map_err(|_| EngineError::Stopped)?;
        rx.recv().map_err(|_| EngineError::Stopped)
    }

    pub fn kv_stats(&self) -> KvStats {
        self.stats().kv
    }

    /// Cache occupancy, hit and scheduling counters.
    pub fn stats(&self) -> EngineStats {
        self.call(Command::Stats).unwrap_or_default()
    }

    /// Ends every request in flight with [`EngineError::ShuttingDown`]
    /// (`why` says what stops it); what they computed stays cached.
    pub fn fail_all(&self, why: &str) -> Result<()> {
        let e = EngineError::ShuttingDown(why.to_string());
        self.call(|tx| Command::FailAll(e, tx))
    }

    /// Drops every cached prefix no request uses; returns the blocks freed.
    pub fn clear_cache(&self) -> Result<usize> {
        self.call(Command::ClearCache)?
    }

    /// Verifies the KV bookkeeping: every block's reference count equals
    /// its holders, no free block is held, every lock is accounted for.
    pub fn check_kv(&self) -> Result<()> {
        self.call(Command::Check)?
    }

    /// Scores a text: for each `j` from `first` to the next-to-last token,
    /// the log-probability the model gives `tokens[j + 1]` after
    /// `tokens[..=j]` and whether it was the most likely token (perplexity,
    /// as `tessera perplexity` and llama.cpp's `llama-perplexity` measure
    /// it). The tokens are computed as a fresh sequence between steps:
    /// nothing cached is used and nothing enters the cache.
    pub fn score(&self, tokens: &[u32], first: usize) -> Result<Vec<(f64, bool)>> {
        use rayon::prelude::*;
        let rows = self.logits(tokens, first)?;
        // Each row's normalizer is a pass over the vocabulary: rows in
        // parallel (the results do not depend on how).
        Ok(rows
            .par_iter()
            .enumerate()
            .map(|(i, row)| {
                let (t, (best, norm)) = (tokens[first + i + 1], argmax_and_norm(row));
                (row[t as usize] as f64 - norm, best == t)
            })
            .collect())
    }

    /// The logits behind [`score`](Self::score): one row per `j` from
    /// `first` to the next-to-last token, after `tokens[..=j]`.
    pub fn logits(&self, tokens: &[u32], first: usize) -> Result<Vec<Vec<f32>>> {
        self.check_tokens(tokens)?;
        if tokens.len() > self.context_length() {
            return Err(EngineError::PromptTooLong {
                tokens: tokens.len(),
                context: self.context_length(),
            });
        }
        self.call(|tx| Command::Logits(tokens.to_vec(), first, tx))?
    }

    /// Refuses token ids outside the vocabulary.
    fn check_tokens(&self, ids: &[u32]) -> Result<()> {
        let vocab = self.inner.model.config().vocab_size;
        match ids.iter().find(|&&t| t as usize >= vocab) {
            Some(&bad) => Err(EngineError::Invalid(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            ))),
            None => Ok(()),
        }
    }

    /// Compacts live blocks to the low end of the pool; returns the blocks
    /// moved.
    pub fn defragment(&self) -> Result<usize> {
        self.call(Command::Defragment)?
    }

    /// Resizes the pool to `bytes` (whole blocks). Shrinking evicts cached
    /// blocks as needed, defragments, and gives the memory back; it fails,
    /// changing nothing, when running requests hold more than fits. With
    /// sliding-window layers on a pool of their own, `bytes` is the other
    /// layers' pool ([`block_bytes`](Self::block_bytes) a block); the
    /// sliding pool keeps its size.
    pub fn resize_kv(&self, bytes: usize) -> Result<usize> {
        self.call(|tx| Command::Resize(bytes / self.inner.per_block, tx))?
    }

    /// [`resize_kv`](Self::resize_kv) to a smaller size.
    pub fn shrink_to(&self, bytes: usize) -> Result<usize> {
        self.resize_kv(bytes)
    }

    /// The token ids a prompt becomes.
    pub fn tokenize_prompt(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        let model = &self.inner.model;
        let tok = &model.tokenizer;
        Ok(match prompt {
            Prompt::Text(t) => tok.encode(t, Special::Parse, true)?,
            Prompt::Tokens(ids) => ids.clone(),
            Prompt::Chat(msgs) => model.template.encode(tok, msgs, true)?,
            Prompt::ChatTools { messages, tools } => {
                model
                    .template
                    .encode_tools(tok, messages, Some(tools), true)?
            }
        })
    }

    /// Starts a request; its tokens and its end arrive on the stream.
    /// Dropping the stream (or [`RequestStream::cancel`]) cancels it. Errors
    /// that the request can never run (too long, larger than the pool) come
    /// back here, before anything is queued.
    pub fn generate(&self, req: GenerateRequest) -> Result<RequestStream> {
        let ids = self.tokenize_prompt(&req.prompt)?;
        self.check_tokens(&ids)?;
        if req.n == 0 {
            return Err(EngineError::Invalid("n must be at least 1".into()));
        }
        check_stops(&req.stop)?;
        check_partition(&req.partition)?;
        let guide = match &req.constraint {
            Some(c) => Some(crate::grammar::Guide::new(
                self.inner.grammars.compile(&self.inner.model, c)?,
                c,
            )),
            None => None,
        };
        let (events, rx) = crate::stream::channel();
        let cancel = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let backlog = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        self.call(|reply| Command::Submit {
            ids,
            req: Box::new(req.clone()),
            guide,
            events,
            cancel: cancel.clone(),
            backlog: backlog.clone(),
            reply,
        })??;
        Ok(RequestStream::new(rx, cancel, backlog, req.n))
    }

    /// Runs a request to the end, calling `on_token` for every token of
    /// every sample; returns the completion of each sample, in order.
    pub fn complete_n(
        &self,
        req: &GenerateRequest,
        on_token: &mut dyn FnMut(TokenEvent),
    ) -> Result<Vec<Completion>> {
        let mut stream = self.generate(req.clone())?;
        let mut done: Vec<Option<Completion>> = vec![None; req.n];
        for ev in stream.by_ref() {
            match ev {
                Event::Token {
                    index,
                    id,
                    text,
                    logprob,
                } => on_token(TokenEvent {
                    index,
                    id,
                    text: &text,
                    logprob: logprob.as_deref(),
                }),
                Event::Done(c) => {
                    let i = c.index;
                    done[i] = Some(*c);
                }
                Event::Error(e) => return Err(e),
            }
        }
        done.into_iter()
            .map(|c| c.ok_or(EngineError::Stopped))
            .collect()
    }

    /// [`complete_n`](Self::complete_n) for one sample.
    pub fn complete(
        &self,
        req: &GenerateRequest,
        on_token: &mut dyn FnMut(TokenEvent),
    ) -> Result<Completion> {
        let req = GenerateRequest {
            n: 1,
            ..req.clone()
        };
        Ok(self.complete_n(&req, on_token)?.remove(0))
    }
}

// ---- K/V snapshots, sessions on disk, the cache directory -----------------

impl Engine {
    pub(crate) fn geometry(&self) -> Geometry {
        Geometry::of(self.model(), self.config().cache_dtype)
    }

    /// The K/V of `tokens` (computed now for any part not cached).
    pub fn export_kv(&self, tokens: &[u32]) -> Result<KvSnapshot> {
        Ok(self.export_kv_in(&Partition::default(), tokens)?.0)
    }

    /// The K/V of `tokens` in partition `p`, and how many of them came
    /// from the cache. What the cache lacks is computed as a background
    /// request: a few tokens a step beside other requests' work (whole
    /// chunks when there is none), so a long export never stalls them.
    pub fn export_kv_in(&self, p: &Partition, tokens: &[u32]) -> Result<(KvSnapshot, usize)> {
        self.check_tokens(tokens)?;
        check_partition(p)?;
        self.call(|tx| Command::Export(p.clone(), tokens.to_vec(), tx))?
    }

    /// Inserts saved K/V into the prefix cache; returns the tokens added.
    pub fn import_kv(&self, snaps: Vec<KvSnapshot>) -> Result<usize> {
        self.import_kv_in(&Partition::default(), snaps)
    }

    /// [`import_kv`](Self::import_kv) into partition `p`: only its
    /// requests see the K/V.
    pub fn import_kv_in(&self, p: &Partition, snaps: Vec<KvSnapshot>) -> Result<usize> {
        self.import_each(snaps.into_iter().map(|s| (p.clone(), s)).collect())
    }

    /// Inserts snapshots, each into its partition.
    fn import_each(&self, snaps: Vec<(Partition, KvSnapshot)>) -> Result<usize> {
        let vocab = self.model().config().vocab_size;
        for (_, s) in &snaps {
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(EngineError::Invalid(format!(
                    "saved token id {t} is outside the vocabulary of {vocab}"
                )));
            }
        }
        self.call(|tx| Command::Import(snaps, tx))?
    }

    /// Writes the K/V of `tokens` (computed now for any part not cached)
    /// to `path` as a session file (replaced whole or not at all); returns
    /// the tokens written.
    pub fn save_kv_session(&self, path: &Path, tokens: &[u32]) -> Result<usize> {
        Ok(self
            .save_kv_session_in(&Partition::default(), path, tokens)?
            .tokens)
    }

    /// [`save_kv_session`](Self::save_kv_session) from partition `p`'s
    /// cache: its K/V is computed (in the background, see
    /// [`export_kv_in`](Self::export_kv_in)) and cached in `p` only.
    pub fn save_kv_session_in(
        &self,
        p: &Partition,
        path: &Path,
        tokens: &[u32],
    ) -> Result<SessionSaved> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let (snap, cached) = self.export_kv_in(p, tokens)?;
        write_file(
            path,
            KV_SESSION,
            &self.geometry(),
            &[snap],
            serde_json::Value::Null,
        )?;
        Ok(SessionSaved {
            tokens: tokens.len(),
            cached,
        })
    }

    /// Bytes a session file of `tokens` tokens takes (within a few hundred
    /// bytes of header), for quotas checked before the K/V is computed.
    pub fn session_bytes(&self, tokens: usize) -> usize {
        let mc = self.model().config();
        let per_token = mc.kv_bytes_per_token(self.config().cache_dtype);
        tokens
            .saturating_mul(per_token.saturating_add(4))
            .saturating_add(1024)
    }

    /// Loads a file written by [`save_kv_session`](Self::save_kv_session)
    /// into the prefix cache, all or nothing; a file that is truncated,
    /// corrupted, of another kind or of another model is refused with the
    /// reason and the cache is left as it was. Returns the tokens it holds.
    pub fn load_kv_session(&self, path: &Path) -> Result<usize> {
        self.load_kv_session_in(&Partition::default(), path)
    }

    /// [`load_kv_session`](Self::load_kv_session) into partition `p`.
    pub fn load_kv_session_in(&self, p: &Partition, path: &Path) -> Result<usize> {
        let (snaps, _) = read_file(path, KV_SESSION, &self.geometry())?;
        let n = snaps.iter().map(|s| s.tokens.len()).sum();
        self.import_kv_in(p, snaps)?;
        Ok(n)
    }

    /// Writes the whole prefix cache, every partition's, to `dir` now (the
    /// engine also does it when it stops, if `cache_dir` is set).
    pub fn save_cache_dir(&self, dir: &Path) -> Result<()> {
        let snaps = self.call(Command::ExportCache)??;
        write_cache_dir(dir, &self.geometry(), snaps)
    }

    /// Writes the prefix cache to the configured `cache_dir` now, in place
    /// of the write when the engine stops (a server's shutdown, which
    /// decides when that is); returns where it went, `None` without a
    /// cache directory (or when an earlier call already wrote it).
    pub fn persist_now(&self) -> Result<Option<PathBuf>> {
        let dir = self.inner.persist.lock().ok().and_then(|mut d| d.take());
        let Some(dir) = dir else {
            return Ok(None);
        };
        self.save_cache_dir(&dir)?;
        Ok(Some(dir))
    }

    /// Fills the prefix cache from `dir`, if it holds a cache file, each
    /// entry into the partition it was saved from; returns the tokens
    /// restored.
    pub fn restore_cache_dir(&self, dir: &Path) -> Result<usize> {
        // What a write killed mid-way left (a whole file or none is there).
        crate::snapshot::clean_temporaries(dir);
        let path: PathBuf = dir.join(CACHE_FILE);
        if !path.exists() {
            return Ok(0);
        }
        let (snaps, meta) = read_file(&path, "prefix cache", &self.geometry())?;
        let bad = |why: String| EngineError::Snapshot {
            path: path.clone(),
            reason: format!("corrupted partitions: {why}"),
        };
        // Files of before partitions were saved hold the default one's.
        let parts: Vec<Partition> = match meta.get("partitions") {
            None => vec![Partition::default(); snaps.len()],
            Some(v) => serde_json::from_value(v.clone()).map_err(|e| bad(e.to_string()))?,
        };
        if parts.len() != snaps.len() {
            return Err(bad(format!(
                "{} partitions for {} entries",
                parts.len(),
                snaps.len()
            )));
        }
        self.import_each(parts.into_iter().zip(snaps).collect())
    }
}

/// What [`Engine::save_kv_session_in`] wrote: the tokens, and how many of
/// them came from the partition's cache (the rest were computed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionSaved {
    pub tokens: usize,
    pub cached: usize,
}

/// The longest tenant or salt of a [`Partition`]: the engine keeps each
/// partition's name while it has cached K/V (for the cache directory).
const MAX_PARTITION_BYTES: usize = 4096;

fn check_partition(p: &Partition) -> Result<()> {
    for part in [&p.tenant, &p.salt].into_iter().flatten() {
        if part.len() > MAX_PARTITION_BYTES {
            return Err(EngineError::Invalid(format!(
                "a partition's tenant or salt of {} bytes; at most {MAX_PARTITION_BYTES} are allowed",
                part.len()
            )));
        }
    }
    Ok(())
}

/// Refuses stop lists past the limits (every generated token is checked
/// against each stop string).
pub fn check_stops(stops: &[String]) -> Result<()> {
    use crate::request::{MAX_STOP_BYTES, MAX_STOP_STRINGS};
    if stops.len() > MAX_STOP_STRINGS {
        return Err(EngineError::Invalid(format!(
            "{} stop strings; at most {MAX_STOP_STRINGS} are allowed",
            stops.len()
        )));
    }
    if let Some(long) = stops.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(EngineError::Invalid(format!(
            "a stop string of {} bytes; at most {MAX_STOP_BYTES} are allowed",
            long.len()
        )));
    }
    Ok(())
}

/// The kind of the files of [`Engine::save_kv_session`].
const KV_SESSION: &str = "kv session";

/// Writes the prefix cache file into `dir` (created if missing): the
/// entries, and in the metadata the partition of each.
fn write_cache_dir(
    dir: &Path,
    geometry: &Geometry,
    entries: Vec<(Partition, KvSnapshot)>,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| EngineError::Snapshot {
        path: dir.to_path_buf(),
        reason: format!("cannot create: {e}"),
    })?;
    let (parts, snaps): (Vec<Partition>, Vec<KvSnapshot>) = entries.into_iter().unzip();
    write_file(
        &dir.join(CACHE_FILE),
        "prefix cache",
        geometry,
        &snaps,
        serde_json::json!({ "partitions": parts }),
    )
}

/// Fixes the process's kernel tuning to `cfg`'s, or warns that another is
/// already in force (the kernels pick their paths once per process).
fn apply_tuning(cfg: &EngineConfig) {
    let Some(want) = cfg.tuning else { return };
    if let Err(now) = tessera_model::tuning::set(want) {
        tracing::warn!(
            "kernel tuning {want:?} not applied: this process already runs with {now:?}"
        );
    }
}

/// Loads the draft model of `cfg` onto `model`'s device, with the
/// engine's activation mode, after checking that it shares the model's
/// tokenizer.
fn load_draft(d: &crate::DraftModelConfig, model: &Model, cfg: &EngineConfig) -> Result<Model> {
    if !(0.0..=1.0).contains(&d.p_min) {
        return Err(EngineError::Invalid(format!(
            "draft p_min {} is not a probability (0 to 1)",
            d.p_min
        )));
    }
    let path = d.source.resolve()?;
    let draft = Model::load_on(&path, model.llama.device(), &mut |_, _| {})?;
    crate::draft::check_vocab(model, &draft)?;
    if let Some(a) = cfg.activations {
        draft.llama.set_activations(a);
    }
    draft.llama.prepare()?;
    Ok(draft)
}
