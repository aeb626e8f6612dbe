//! Worker tests on a tiny generated model.
use super::*;
use crate::types::CacheDType;
use crate::SelfExtend;
use tessera_kv::{AppendPlan, SeqId};
use tessera_model::testing::{write_tiny_model, TinySpec};

fn tiny_worker(dtype: CacheDType) -> (Worker, std::path::PathBuf) {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::SeqCst);
    let dir = std::env::temp_dir().join(format!("tessera-worker-{}-{n}", std::process::id()));
    // Quantized caches need head_dim a multiple of 64.
    let hidden = if dtype.is_quantized() { 256 } else { 64 };
    write_tiny_model(
        &dir,
        TinySpec {
            hidden,
            ..TinySpec::default()
        },
    )
    .unwrap();
    let model = Arc::new(Model::load(&dir, &mut |_, _| {}).unwrap());
    let cfg = EngineConfig {
        kv_memory: 1 << 20,
        block_size: 4,
        cache_dtype: dtype,
        prefill_chunk: 7,
        ..EngineConfig::default()
    };
    let layout = KvLayout::new(model.config(), &cfg).unwrap();
    (Worker::new(model, &cfg, 512, &layout, None).unwrap(), dir)
}

fn computed(core: &mut Worker, ids: &[u32]) -> SeqId {
    let (seq, _) = core.sched.kv_mut().add_sequence(core.ns, &[]);
    compute_on(core, seq, &token_ids(ids)).unwrap();
    seq
}

/// `ids` computed on a sequence of their own and left in the prefix tree.
fn cached(core: &mut Worker, ids: &[u32]) {
    let seq = computed(core, ids);
    let kv = core.sched.kv_mut();
    kv.insert_sequence(seq).unwrap();
    kv.free_sequence(seq).unwrap();
}

/// Slots for `toks` on `seq`, outside the scheduler (no room: an error).
fn append_now(core: &mut Worker, seq: SeqId, toks: &[TokenId]) -> Result<AppendPlan> {
    match core.sched.kv_mut().append(seq, toks)? {
        tessera_kv::Admission::Ok(p) => Ok(p),
        _ => Err(EngineError::Step("the test's pool is full".into())),
    }
}

/// Appends and computes `toks` on `seq` in chunks, outside the scheduler:
/// the tests' way to fill a sequence.
fn compute_on(core: &mut Worker, seq: SeqId, toks: &[TokenId]) -> Result<()> {
    for chunk in toks.chunks(core.cfg.prefill_chunk.max(1)) {
        let plan = append_now(core, seq, chunk)?;
        core.apply_append(&plan)?;
        let kv = core.sched.kv();
        let s = kv.sequence(seq)?;
        let sliding = match kv.window() {
            Some(_) => Some(sliding_part(&plan.sliding_slots, &kv.sliding_table(seq)?)),
            None => None,
        };
        let part = Part {
            tokens: chunk,
            start: s.len() - chunk.len(),
            slots: &plan.slots,
            table: s.block_table(),
            logits_from: None,
            sliding,
            rope: Vec::new(),
        };
        let len = s.len();
        core.runner.forward(&[part])?;
        core.sched.kv_mut().mark_computed(seq, len)?;
    }
    Ok(())
}

fn max_abs(a: &[u8], b: &[u8]) -> f32 {
    let f = |x: &[u8]| -> Vec<f32> {
        x.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    f(a).iter()
        .zip(f(b))
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// After a context shift, layer-0 K (rotated by the position delta) and
/// V equal those computed fresh for the kept tokens at their new
/// positions: layer 0 sees only the token and its position.
#[test]
fn shifted_layer_zero_kv_equals_a_fresh_computation() {
    let (mut core, dir) = tiny_worker(CacheDType::F32);
    let ids: Vec<u32> = (0..23).map(|i| 5 + (i * 7) % 90).collect();
    let seq = computed(&mut core, &ids);
    let (keep, discard) = (5, 9);
    let plan = core
        .sched
        .kv_mut()
        .plan_shift(seq, keep, discard)
        .unwrap()
        .ok()
        .unwrap();
    core.runner.apply_shift(&plan).unwrap();
    let (shifted, _) = core.read_kv(seq, ids.len() - discard).unwrap();

    let kept: Vec<u32> = ids[..keep]
        .iter()
        .chain(&ids[keep + discard..])
        .copied()
        .collect();
    let fresh_seq = computed(&mut core, &kept);
    let (fresh, _) = core.read_kv(fresh_seq, kept.len()).unwrap();
    let dk = max_abs(&shifted[0].k, &fresh[0].k);
    let dv = max_abs(&shifted[0].v, &fresh[0].v);
    assert!(
        dk < 1e-4 && dv < 1e-4,
        "layer 0: K differs by {dk}, V by {dv}"
    );
    // Deeper layers saw the discarded tokens: they do differ.
    assert!(max_abs(&shifted[1].v, &fresh[1].v) > 1e-3);
    std::fs::remove_dir_all(dir).unwrap();
}

/// Exported K/V imported into another pool reads back byte for byte.
#[test]
fn snapshots_round_trip_between_pools() {
    for dtype in CacheDType::ALL {
        let (mut a, d1) = tiny_worker(dtype);
        let (mut b, d2) = tiny_worker(dtype);
        let ids: Vec<u32> = (0..19).map(|i| 3 + (i * 5) % 80).collect();
        let ns = a.ns;
        cached(&mut a, &ids);
        let snap = a.export_now(ns, &ids).unwrap();
        assert_eq!(snap.layers.len(), 2);
        let entry = [(Partition::default(), snap.clone())];
        assert_eq!(b.import(&entry).unwrap(), ids.len());
        let again = b.export_now(ns, &ids).unwrap();
        assert_eq!(again, snap);
        // The imported tokens are served from b's cache.
        let (seq, cached) = b.sched.kv_mut().add_sequence(b.ns, &token_ids(&ids));
        assert_eq!(cached, ids.len());
        b.sched.kv_mut().free_sequence(seq).unwrap();
        std::fs::remove_dir_all(d1).unwrap();
        std::fs::remove_dir_all(d2).unwrap();
    }
}

// ---- failure paths, through the engine handle ------------------------------

use crate::engine::Engine;
use crate::sampler::SamplingParams;
use crate::types::{FaultHook, GenerateRequest, Prompt};
use std::sync::atomic::AtomicUsize;

fn tiny_engine(cfg: EngineConfig) -> (Engine, std::path::PathBuf) {
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::SeqCst);
    let dir = std::env::temp_dir().join(format!("tessera-engine-{}-{n}", std::process::id()));
    write_tiny_model(&dir, TinySpec::default()).unwrap();
    let model = Model::load(&dir, &mut |_, _| {}).unwrap();
    (Engine::from_model(model, cfg).unwrap(), dir)
}

fn small_cfg() -> EngineConfig {
    EngineConfig {
        kv_memory: 1 << 20,
        block_size: 4,
        cache_dtype: CacheDType::F32,
        prefill_chunk: 16,
        ..EngineConfig::default()
    }
}

fn greedy(prompt: &[u32], max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        max_tokens,
        ignore_eos: true,
        ..GenerateRequest::new(Prompt::Tokens(prompt.to_vec()))
    }
}

fn prompts() -> Vec<Vec<u32>> {
    // A shared prefix, then a different tail each.
    (0..4u32)
        .map(|i| {
            (0..9u32)
                .map(|t| 3 + t * 5 % 60)
                .chain((0..14u32).map(|t| 7 + (t * 11 + i * 17) % 80))
                .collect()
        })
        .collect()
}

/// Runs the prompts concurrently; per prompt, its tokens or the error text.
fn run_all(engine: &Engine, prompts: &[Vec<u32>]) -> Vec<std::result::Result<Vec<u32>, String>> {
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| engine.generate(greedy(p, 12)).unwrap())
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

fn assert_no_leak(engine: &Engine) {
    let kv = engine.stats().kv;
    assert_eq!((kv.sequences, kv.used_blocks), (0, 0), "{kv:?}");
}

/// Errors and panics injected into chosen steps of concurrent requests: a
/// request whose every step fails ends with an error, one whose step fails
/// once is retried, and all others give exactly the tokens of a run without
/// faults. No block leaks, and the poisoned slots are never read again.
#[test]
fn injected_errors_and_panics_fail_only_the_request_at_fault() {
    let ps = prompts();
    let (clean, d1) = tiny_engine(small_cfg());
    let reference = run_all(&clean, &ps);
    assert!(reference.iter().all(|r| r.is_ok()));

    let (always, once) = (ps[1].clone(), ps[2].clone());
    let armed = Arc::new(AtomicBool::new(true));
    let panicked = Arc::new(AtomicBool::new(false));
    let (a, p) = (armed.clone(), panicked.clone());
    let hook = FaultHook::new(move |sites| {
        if !a.load(Ordering::SeqCst) {
            return None;
        }
        // Every step that computes past position 12 of `always` fails.
        if sites
            .iter()
            .any(|s| s.prompt == always && s.start + s.len > 12)
        {
            return Some(Fault::Error);
        }
        // The first step that decodes `once` beside other requests panics
        // (alone in a failing step, a request fails by design).
        if sites.len() > 1
            && sites
                .iter()
                .any(|s| s.prompt == once && s.start >= once.len())
            && !p.swap(true, Ordering::SeqCst)
        {
            return Some(Fault::Panic);
        }
        None
    });
    let (faulty, d2) = tiny_engine(EngineConfig {
        faults: Some(hook),
        ..small_cfg()
    });
    // Requests are submitted one by one while the worker steps, so on a
    // busy machine `once` may start after the others have ended and never
    // decode beside them: then nothing panics and the run is repeated.
    let mut runs = 0;
    let (got, before) = loop {
        let before = faulty.stats();
        let got = run_all(&faulty, &ps);
        if panicked.load(Ordering::SeqCst) {
            break (got, before);
        }
        runs += 1;
        assert!(runs < 10, "`once` never decoded beside another request");
    };
    assert!(
        got[1].as_ref().is_err_and(|e| e.contains("injected fault")),
        "{:?}",
        got[1]
    );
    for i in [0, 2, 3] {
        assert_eq!(got[i], reference[i], "prompt {i}");
    }
    let stats = faulty.stats();
    assert!(stats.failed_steps >= before.failed_steps + 2, "{stats:?}");
    assert_eq!(stats.failed_requests, before.failed_requests + 1);
    assert_no_leak(&faulty);

    // With the faults off, the failed prompt and the others run again from
    // what the cache holds, and give the reference tokens.
    armed.store(false, Ordering::SeqCst);
    assert_eq!(run_all(&faulty, &ps), reference);
    assert!(faulty.stats().cached_tokens > 0);
    assert_no_leak(&faulty);
    drop((clean, faulty));
    std::fs::remove_dir_all(d1).unwrap();
    std::fs::remove_dir_all(d2).unwrap();
}

/// Shrinking the pool below what a queued request needs is refused with the
/// numbers; the request then runs as usual.
#[test]
fn resize_keeps_room_for_the_requests_it_holds() {
    // Steps slowed down (never failed) so that the request is still
    // running when the resize arrives, however busy the machine.
    let slow = FaultHook::new(|_| {
        std::thread::sleep(std::time::Duration::from_millis(10));
        None
    });
    let (engine, dir) = tiny_engine(EngineConfig {
        max_running: 1,
        faults: Some(slow),
        ..small_cfg()
    });
    let per = engine.block_bytes();
    let long: Vec<u32> = (0..60).map(|i| 5 + i % 70).collect();
    let first = engine.generate(greedy(&long, 40)).unwrap();
    // 100 tokens of 4 per block: 25 blocks.
    let err = engine.resize_kv(20 * per).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::OutOfKvMemory {
                needed: 25,
                total: 20,
                ..
            }
        ),
        "{err}"
    );
    let done: Vec<_> = first.collect();
    assert!(matches!(done.last(), Some(Event::Done(_))));
    assert_eq!(engine.resize_kv(20 * per).unwrap(), 20);
    // Now a request that needs 25 blocks is refused up front.
    assert!(matches!(
        engine.generate(greedy(&long, 40)),
        Err(EngineError::OutOfKvMemory {
            needed: 25,
            total: 20,
            ..
        })
    ));
    drop(engine);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A quantized cache on a model whose heads are not whole blocks of 32 is
/// refused with a message, not a panic.
#[test]
fn a_quantized_cache_needs_whole_blocks_per_head() {
    let (engine, d) = tiny_engine(small_cfg());
    drop(engine);
    for t in [CacheDType::Q8_0, CacheDType::Q4_0] {
        let model = Model::load(&d, &mut |_, _| {}).unwrap();
        let cfg = EngineConfig {
            cache_dtype: t,
            ..small_cfg()
        };
        let err = Engine::from_model(model, cfg).err().unwrap().to_string();
        assert!(
            err.contains("head_dim is 16") && err.contains(t.name()),
            "{err}"
        );
    }
    std::fs::remove_dir_all(d).unwrap();
}

/// A cache directory the engine cannot read (saved with another cache
/// dtype) makes loading fail and is left exactly as it was.
#[test]
fn a_failed_restore_never_overwrites_the_cache_file() {
    let cache = std::env::temp_dir().join(format!("tessera-cachedir-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let with = |dtype| EngineConfig {
        cache_dir: Some(cache.clone()),
        cache_dtype: dtype,
        ..small_cfg()
    };
    let (engine, d1) = tiny_engine(with(CacheDType::F32));
    let p = &prompts()[0];
    engine.complete(&greedy(p, 4), &mut |_| {}).unwrap();
    drop(engine);
    let file = cache.join(crate::snapshot::CACHE_FILE);
    let before = std::fs::read(&file).unwrap();
    assert!(before.len() > 1000);

    let dir = std::env::temp_dir().join(format!("tessera-engine-f16-{}", std::process::id()));
    write_tiny_model(&dir, TinySpec::default()).unwrap();
    let model = Model::load(&dir, &mut |_, _| {}).unwrap();
    let err = Engine::from_model(model, with(CacheDType::F16))
        .err()
        .unwrap();
    assert!(err.to_string().contains("cache dtype f32"), "{err}");
    assert_eq!(
        std::fs::read(&file).unwrap(),
        before,
        "the file is untouched"
    );
    // No temporary files are left beside it (and the disk tier's folder).
    assert_eq!(std::fs::read_dir(&cache).unwrap().count(), 2);

    // The engine that wrote it still reads it back.
    let (engine, d3) = tiny_engine(with(CacheDType::F32));
    assert!(engine.stats().kv.cached_tokens >= p.len());
    drop(engine);
    for d in [d1, dir, d3, cache] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// Saved K/V whose bytes do not match the pool's geometry is refused before
/// anything is written, on the caller's thread, and the engine goes on.
#[test]
fn import_refuses_short_or_long_rows() {
    let (engine, dir) = tiny_engine(small_cfg());
    let p = &prompts()[0];
    let good = engine.export_kv(p).unwrap();
    let (fresh, d2) = tiny_engine(small_cfg());
    let mut short = good.clone();
    short.layers[1].v.truncate(good.layers[1].v.len() - 4);
    let mut missing = good.clone();
    missing.layers.pop();
    let mut long = good.clone();
    long.tokens.pop();
    for bad in [short, missing, long] {
        let err = fresh.import_kv(vec![bad]).unwrap_err();
        assert!(matches!(err, EngineError::Invalid(_)), "{err}");
    }
    assert_eq!(fresh.stats().kv.cached_tokens, 0);
    assert_no_leak(&fresh);
    assert_eq!(fresh.import_kv(vec![good]).unwrap(), p.len());
    drop((engine, fresh));
    std::fs::remove_dir_all(dir).unwrap();
    std::fs::remove_dir_all(d2).unwrap();
}

// ---- files on disk: damaged, killed mid-write, full disk --------------------

use crate::chat::TurnOptions;
use crate::snapshot::{read_file, write_file, Geometry};
use tessera_model::testing::{fuzz_cases, Mutator};

/// Damaged session and prefix-cache files are refused or read back exactly
/// as written, never panic; loading one never harms the engine.
#[test]
fn fuzz_session_and_cache_files_load_identically_or_are_refused() {
    let (engine, dir) = tiny_engine(small_cfg());
    let mut chat = engine.chat(Some("be brief"));
    let opts = TurnOptions {
        max_tokens: 6,
        ..TurnOptions::default()
    };
    chat.send("hello there", &opts, &mut |_| {}).unwrap();
    let session = dir.join("chat.tkv");
    chat.save(&session).unwrap();
    let cache_dir = dir.join("cache");
    engine.save_cache_dir(&cache_dir).unwrap();
    let geometry = engine.geometry();
    let case_path = dir.join("case.tkv");
    let mut m = Mutator::new(0x736e_6170);
    for (kind, file) in [
        ("chat session", session.clone()),
        ("prefix cache", cache_dir.join(crate::snapshot::CACHE_FILE)),
    ] {
        let bytes = std::fs::read(&file).unwrap();
        let good = read_file(&file, kind, &geometry).unwrap();
        let hlen = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
        for case in 0..fuzz_cases(200) {
            let focus = if case % 3 == 2 {
                bytes.len()
            } else {
                16 + hlen
            };
            let data = m.mutate(&bytes, focus);
            std::fs::write(&case_path, &data).unwrap();
            let got = std::panic::catch_unwind(|| read_file(&case_path, kind, &geometry))
                .unwrap_or_else(|_| panic!("{kind} case {case} panicked"));
            if let Ok(got) = got {
                assert_eq!(got.0, good.0, "{kind} case {case} read differently");
            }
            if kind == "chat session" && case % 10 == 0 {
                if let Ok(s) = engine.load_session(&case_path) {
                    assert_eq!(s.token_ids(), chat.token_ids());
                }
            }
        }
    }
    assert_no_leak(&engine);
    drop(engine);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A geometry and snapshots big enough that writing takes a while.
fn big_snapshot(version: u32) -> (Geometry, Vec<KvSnapshot>) {
    let g = Geometry {
        model: "test".into(),
        fingerprint: 7,
        arch: "llama".into(),
        cache_dtype: "f32".into(),
        n_layers: 4,
        n_kv_heads: 2,
        head_dim: 64,
        windows: Vec::new(),
    };
    let n = 4096;
    let row = 2 * 64 * 4;
    let layers = (0..4)
        .map(|l| crate::snapshot::LayerBytes {
            k: vec![(version + l) as u8; n * row],
            v: vec![(version * 3 + l) as u8; n * row],
        })
        .collect();
    (
        g,
        vec![KvSnapshot {
            tokens: vec![version; n],
            layers,
            sliding_from: n,
        }],
    )
}

const WRITER_ENV: &str = "TESSERA_TEST_WRITER";

/// In a child process (see below): overwrite the file forever, or, with
/// `full`, fail to write past a 64 KiB file-size limit.
fn writer_child(spec: &str) {
    let (mode, path) = spec.split_once(':').unwrap();
    let path = std::path::Path::new(path);
    if mode == "full" {
        // SAFETY: plain libc calls on this process's own limits and signal
        // disposition, before anything else runs in this child.
        unsafe {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let lim = libc::rlimit {
                rlim_cur: 64 << 10,
                rlim_max: 64 << 10,
            };
            assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &lim), 0);
        }
        let (g, snaps) = big_snapshot(2);
        let err =
            write_file(path, "chat session", &g, &snaps, serde_json::Value::Null).unwrap_err();
        println!("WRITE-FAILED: {err}");
        std::process::exit(0);
    }
    for version in 1.. {
        let (g, snaps) = big_snapshot(version % 5 + 1);
        write_file(path, "chat session", &g, &snaps, serde_json::Value::Null).unwrap();
    }
}

fn spawn_writer(spec: &str) -> std::process::Child {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "worker::tests::files_survive_a_killed_writer_and_a_full_disk",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(WRITER_ENV, spec)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

/// A process killed while it rewrites a session file leaves a whole file
/// (the old one or the new one), and a write that runs out of room fails
/// with an error and leaves the old file as it was.
#[test]
fn files_survive_a_killed_writer_and_a_full_disk() {
    if let Ok(spec) = std::env::var(WRITER_ENV) {
        return writer_child(&spec);
    }
    let dir = std::env::temp_dir().join(format!("tessera-writer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("session.tkv");
    let (g, first) = big_snapshot(0);
    write_file(&path, "chat session", &g, &first, serde_json::Value::Null).unwrap();
    for delay_ms in [30, 75, 160, 250] {
        let mut child = spawn_writer(&format!("loop:{}", path.display()));
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        child.kill().unwrap();
        child.wait().unwrap();
        let (snaps, _) = read_file(&path, "chat session", &g).expect("a whole file");
        let v = snaps[0].tokens[0];
        assert_eq!(snaps, big_snapshot(v).1, "after a kill at {delay_ms} ms");
    }
    let before = std::fs::read(&path).unwrap();
    let child = spawn_writer(&format!("full:{}", path.display()));
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("WRITE-FAILED") && text.contains("cannot write"),
        "{text}"
    );
    assert_eq!(
        std::fs::read(&path).unwrap(),
        before,
        "the old file is intact"
    );
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    // Killed writers leave their temporary files, the failed one removed
    // its own, and the next successful write removes the dead writers'.
    assert!(leftovers.len() <= 4, "{leftovers:?}");
    write_file(&path, "chat session", &g, &first, serde_json::Value::Null).unwrap();
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("session.tkv")]);
    std::fs::remove_dir_all(dir).unwrap();
}

/// `logprobs` reports the model's log-softmax at each generated token,
/// streamed with the token and in the completion; `cache_salt` partitions
/// the prefix cache; `reuse_prefix: false` computes the whole prompt and
/// gives the same tokens.
#[test]
fn logprobs_salts_and_prefix_reuse_off() {
    let (engine, dir) = tiny_engine(small_cfg());
    let prompt: Vec<u32> = (0..30).map(|i| 7 + (i * 11) % 90).collect();
    let mut req = greedy(&prompt, 6);
    req.logprobs = Some(3);
    let mut streamed = Vec::new();
    let done = engine
        .complete(&req, &mut |ev| streamed.extend(ev.logprob.cloned()))
        .unwrap();
    assert_eq!(done.logprobs.len(), done.tokens.len());
    assert_eq!(streamed, done.logprobs, "one per token event");
    for (lp, &t) in done.logprobs.iter().zip(&done.tokens) {
        assert_eq!(lp.id, t);
        assert_eq!(lp.top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(lp.top[0], (t, lp.logprob));
        assert!(lp.logprob <= 0.0 && lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
    }
    // The first token's log-probabilities equal the log-softmax of the
    // logits the prompt alone gives.
    let all = tessera_model::testing::prefill_logits(
        &engine.model().llama,
        &prompt,
        tessera_kernels::KvType::F32,
    )
    .unwrap();
    let logits = all.last().unwrap();
    let want = crate::sampler::TokenLogprob::of(logits, done.tokens[0], 3);
    for (a, b) in want.top.iter().zip(&done.logprobs[0].top) {
        assert_eq!(a.0, b.0);
        assert!((a.1 - b.1).abs() < 1e-4, "{a:?} vs {b:?}");
    }
    let cached = |r: &GenerateRequest| engine.complete(r, &mut |_| {}).unwrap().usage;
    // Cached under no salt: a salted request sees none of it, then its own.
    let mut salted = greedy(&prompt, 6);
    salted.partition = Partition::salt("tenant-a");
    assert_eq!(cached(&salted).cached_tokens, 0);
    assert_eq!(cached(&salted).cached_tokens, prompt.len() - 1);
    salted.partition = Partition::salt("tenant-b");
    assert_eq!(cached(&salted).cached_tokens, 0);
    assert_eq!(cached(&greedy(&prompt, 6)).cached_tokens, prompt.len() - 1);
    // Reuse off: nothing cached is used, the tokens are the same.
    let mut fresh = greedy(&prompt, 6);
    fresh.reuse_prefix = false;
    let again = engine.complete(&fresh, &mut |_| {}).unwrap();
    assert_eq!(again.usage.cached_tokens, 0);
    assert_eq!(again.tokens, done.tokens);
    assert_no_leak(&engine);
    drop(engine);
    std::fs::remove_dir_all(dir).unwrap();
}

/// `score` gives the log-softmax of the logits a single prefill gives, over
/// several prefill chunks, and leaves the cache as it was.
#[test]
fn scores_are_the_prefills_log_probabilities() {
    let (engine, dir) = tiny_engine(small_cfg());
    let ids: Vec<u32> = (0..45).map(|i| 3 + (i * 13) % 90).collect();
    let first = 20;
    let got = engine.score(&ids, first).unwrap();
    assert_eq!(got.len(), ids.len() - 1 - first);
    let all = tessera_model::testing::prefill_logits(
        &engine.model().llama,
        &ids,
        tessera_kernels::KvType::F32,
    )
    .unwrap();
    for (k, &(lp, top)) in got.iter().enumerate() {
        let j = first + k;
        let want = crate::sampler::TokenLogprob::of(&all[j], ids[j + 1], 1);
        assert!(
            (lp - want.logprob as f64).abs() < 1e-4,
            "{j}: {lp} vs {}",
            want.logprob
        );
        assert_eq!(top, want.top[0].0 == ids[j + 1], "{j}");
    }
    let kv = engine.kv_stats();
    assert_eq!((kv.sequences, kv.cached_tokens), (0, 0));
    assert!(engine.score(&[5, 999_999], 0).is_err());
    drop(engine);
    std::fs::remove_dir_all(dir).unwrap();
}

fn table_of(core: &Worker, seq: SeqId) -> Vec<u32> {
    let s = core.sched.kv().sequence(seq).unwrap();
    s.block_table().iter().map(|b| b.0).collect()
}

/// SelfExtend: a sequence computed in chunks, its cached keys rotated in
/// place each time the map moves, ends with the layer-0 K and V of a fresh
/// computation at the final positions (layer 0 sees only the token and its
/// position), and its positions did move.
#[test]
fn self_extend_rotations_equal_a_fresh_computation_at_the_final_positions() {
    let (mut core, dir) = tiny_worker(CacheDType::F32);
    let ids: Vec<u32> = (0..90).map(|i| 5 + (i * 11) % 90).collect();
    let toks = token_ids(&ids);
    let ga = SelfExtend::new(4, 16).unwrap().unwrap();
    let bs = core.sched.kv().block_size();
    let (seq, _) = core.sched.kv_mut().add_sequence(core.ns, &[]);
    let mut map = PositionMap::new(ga);
    let mut at = 0;
    for chunk in toks.chunks(7) {
        let plan = append_now(&mut core, seq, chunk).unwrap();
        core.apply_append(&plan).unwrap();
        let table = core.sched.kv().sequence(seq).unwrap().block_table();
        let rope = advance(&core.runner, &mut map, at, chunk.len(), table, bs).unwrap();
        let part = Part {
            tokens: chunk,
            start: at,
            slots: &plan.slots,
            table,
            logits_from: None,
            sliding: None,
            rope,
        };
        core.runner.forward(&[part]).unwrap();
        at += chunk.len();
        core.sched.kv_mut().mark_computed(seq, at).unwrap();
    }
    // The last chunk's tokens came after the final move: move once more so
    // that every key has been rotated to the final map.
    let moved = map.compress();
    let table = table_of(&core, seq);
    let slots: Vec<u32> = moved
        .iter()
        .map(|&(i, _)| table[i / bs] * bs as u32 + (i % bs) as u32)
        .collect();
    let deltas: Vec<i64> = moved.iter().map(|&(_, d)| d).collect();
    core.runner.rotate_keys(&slots, &deltas).unwrap();
    let finals: Vec<u32> = map.positions().iter().map(|&p| p as u32).collect();
    assert!(
        finals.iter().enumerate().any(|(i, &p)| p as usize != i),
        "positions moved"
    );
    let (extended, _) = core.read_kv(seq, ids.len()).unwrap();

    let (fresh, _) = core.sched.kv_mut().add_sequence(core.ns, &[]);
    let plan = append_now(&mut core, fresh, &toks).unwrap();
    core.apply_append(&plan).unwrap();
    let part = Part {
        tokens: &toks,
        start: 0,
        slots: &plan.slots,
        table: core.sched.kv().sequence(fresh).unwrap().block_table(),
        logits_from: None,
        sliding: None,
        rope: finals,
    };
    core.runner.forward(&[part]).unwrap();
    core.sched.kv_mut().mark_computed(fresh, ids.len()).unwrap();
    let (want, _) = core.read_kv(fresh, ids.len()).unwrap();
    let dk = max_abs(&extended[0].k, &want[0].k);
    let dv = max_abs(&extended[0].v, &want[0].v);
    assert!(
        dk < 1e-4 && dv < 1e-4,
        "layer 0: K differs by {dk}, V by {dv}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// A SelfExtend request neither reads the prefix cache nor adds to it; one
/// whose tokens stay within the window computes what a request without it
/// does; settings llama.cpp refuses, n > 1 and a context shift are refused
/// with a message.
#[test]
fn self_extend_requests_are_private_and_checked() {
    let (engine, dir) = tiny_engine(small_cfg());
    let p = prompts()[0].clone();
    let plain = engine.complete(&greedy(&p, 6), &mut |_| {}).unwrap();
    let cached_before = engine.stats().kv.cached_tokens;
    let mut req = greedy(&p, 6);
    req.self_extend = Some(SelfExtend { n: 2, w: 256 });
    let within = engine.complete(&req, &mut |_| {}).unwrap();
    assert_eq!(within.usage.cached_tokens, 0, "no reuse");
    assert_eq!(
        within.tokens, plain.tokens,
        "nothing moves inside the window"
    );
    assert_eq!(
        engine.stats().kv.cached_tokens,
        cached_before,
        "nothing cached"
    );
    req.self_extend = Some(SelfExtend { n: 2, w: 4 });
    let moved = engine.complete(&req, &mut |_| {}).unwrap();
    assert_eq!(moved.usage.cached_tokens, 0);
    assert_eq!(engine.stats().kv.cached_tokens, cached_before);
    for (ga, n, shift, want) in [
        (SelfExtend { n: 4, w: 10 }, 1, ContextShift::Off, "multiple"),
        (SelfExtend { n: 2, w: 8 }, 2, ContextShift::Off, "n > 1"),
        (
            SelfExtend { n: 2, w: 8 },
            1,
            ContextShift::Keep(4),
            "context shift",
        ),
    ] {
        let mut r = greedy(&p, 4);
        r.self_extend = Some(ga);
        r.n = n;
        r.context_shift = shift;
        let err = engine.complete_n(&r, &mut |_| {}).unwrap_err().to_string();
        assert!(err.contains(want), "{err}");
    }
    drop(engine);
    std::fs::remove_dir_all(dir).unwrap();
}

/// The cache directory keeps every partition's K/V, and a restarted engine
/// restores each into its own: a tenant's and a salt's requests are
/// served from the cache after the restart, and no other partition sees
/// them.
#[test]
fn the_cache_directory_restores_each_partition_into_its_own() {
    let store = std::env::temp_dir().join(format!("tessera-cachedir-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&store);
    let cfg = || EngineConfig {
        cache_dir: Some(store.clone()),
        ..small_cfg()
    };
    let prompt: Vec<u32> = (0..40).map(|i| 3 + (i * 7) % 80).collect();
    let parts = [
        Partition::default(),
        Partition::salt("blue"),
        Partition {
            tenant: Some("t1".into()),
            salt: None,
        },
        Partition {
            tenant: Some("t1".into()),
            salt: Some("blue".into()),
        },
    ];
    let in_part = |p: &Partition, prompt: &[u32]| GenerateRequest {
        partition: p.clone(),
        ..greedy(prompt, 2)
    };
    let (engine, d1) = tiny_engine(cfg());
    // Each partition caches a prompt of its own; the first also the shared one.
    for (i, p) in parts.iter().enumerate() {
        let own: Vec<u32> = prompt.iter().map(|t| t + i as u32).collect();
        engine.complete(&in_part(p, &own), &mut |_| {}).unwrap();
    }
    drop(engine);
    let (engine, d2) = tiny_engine(cfg());
    let cached = |p: &Partition, prompt: &[u32]| {
        engine
            .complete(&in_part(p, prompt), &mut |_| {})
            .unwrap()
            .usage
            .cached_tokens
    };
    for i in 0..parts.len() {
        for (j, q) in parts.iter().enumerate() {
            if i == j {
                continue;
            }
            let own: Vec<u32> = prompt.iter().map(|t| t + i as u32).collect();
            assert_eq!(cached(q, &own), 0, "partition {j} sees partition {i}'s K/V");
        }
    }
    for (i, p) in parts.iter().enumerate() {
        let own: Vec<u32> = prompt.iter().map(|t| t + i as u32).collect();
        assert_eq!(
            cached(p, &own),
            own.len() - 1,
            "partition {i} after the restart"
        );
    }
    assert_no_leak(&engine);
    drop(engine);
    for d in [d1, d2, store] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// A session save computes what the cache lacks as a background request:
/// a stream decoding beside a 2,000-token save goes on producing tokens
/// while the save runs (a save computed in one piece would hold the
/// stream for the whole save), and the saved K/V equals what a plain
/// computation of the same tokens caches. How much the save slows the
/// stream is measured by `tessera bench --scenario session-save`, not
/// asserted here (wall-clock limits fail on a busy machine).
#[test]
fn a_session_save_rides_along_a_running_stream() {
    let dir = std::env::temp_dir().join(format!("tessera-bgsave-{}", std::process::id()));
    let spec = TinySpec {
        hidden: 256,
        layers: 6,
        heads: 4,
        kv_heads: 2,
        context: 4096,
        ..TinySpec::default()
    };
    write_tiny_model(&dir, spec).unwrap();
    let model = Model::load(&dir, &mut |_, _| {}).unwrap();
    let engine = Engine::from_model(
        model,
        EngineConfig {
            kv_memory: 64 << 20,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let stream_prompt: Vec<u32> = (0..20).map(|i| 3 + (i * 3) % 80).collect();
    let ids: Vec<u32> = (0..2000).map(|i| 3 + (i * 11) % 85).collect();
    let mut req = greedy(&stream_prompt, 48);
    req.ignore_eos = true;
    let stream = engine.generate(req).unwrap();
    // The stream's tokens, each with whether the save had ended by then.
    let mut saver = None;
    let done = Arc::new(AtomicBool::new(false));
    let mut during = 0;
    let mut tokens = 0;
    let mut made = 0;
    for ev in stream {
        if let Event::Done(c) = &ev {
            made = c.tokens.len();
        }
        if let Event::Token { .. } = ev {
            tokens += 1;
            if saver.is_some() && !done.load(Ordering::SeqCst) {
                during += 1;
            }
            if tokens == 4 {
                let (e, ids, done) = (engine.clone(), ids.clone(), done.clone());
                saver = Some(std::thread::spawn(move || {
                    let s = e.export_kv(&ids).unwrap();
                    done.store(true, Ordering::SeqCst);
                    s
                }));
            }
        }
    }
    let snap = saver.expect("the save started").join().unwrap();
    assert_eq!(made, 48);
    assert!(
        during >= 2,
        "the stream made {during} tokens while the save ran"
    );
    // The background export's K/V is the cache's own: a plain export of
    // the same tokens (all cached now) reads the same bytes.
    assert_eq!(snap.tokens, ids);
    assert_eq!(engine.export_kv(&ids).unwrap(), snap);
    drop(engine);
    let _ = std::fs::remove_dir_all(dir);
}

/// A reader that falls behind pauses its request: past `MAX_BACKLOG`
/// unread token events the sample computes nothing (and holds its blocks)
/// until the reader catches up, then it goes on to the same tokens as a
/// request read at once.
#[test]
fn a_slow_reader_pauses_its_request_and_loses_nothing() {
    let (engine, dir) = tiny_engine(EngineConfig {
        kv_memory: 4 << 20,
        ..small_cfg()
    });
    let prompt: Vec<u32> = (0..8).map(|i| 3 + i * 5).collect();
    let req = GenerateRequest {
        ignore_eos: true,
        context_shift: ContextShift::Keep(4),
        ..greedy(&prompt, crate::MAX_BACKLOG * 2 + 100)
    };
    let want = engine.complete(&req, &mut |_| {}).unwrap().tokens;
    let stream = engine.generate(req).unwrap();
    // Nothing read: the request pauses once the backlog is full.
    let t = Instant::now();
    while engine.stats().paused_samples == 0 {
        assert!(
            t.elapsed().as_secs() < 60,
            "never paused: {:?}",
            engine.stats()
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let steps = engine.stats().steps;
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert_eq!(
        engine.stats().steps,
        steps,
        "a paused request computes nothing"
    );
    let mut got = Vec::new();
    for ev in stream {
        match ev {
            Event::Token { id, .. } => got.push(id),
            Event::Done(d) => assert_eq!(d.tokens, want),
            Event::Error(e) => panic!("{e}"),
        }
    }
    assert_eq!(got, want, "the same tokens, each sent once");
    assert_eq!(engine.stats().paused_samples, 0);
    assert_no_leak(&engine);
    drop(engine);
    std::fs::remove_dir_all(dir).unwrap();
}

/// An export read part by part beside a running request reads its own
/// rows even when a defragmentation moves its blocks between two parts:
/// the snapshot equals what the prefix tree then holds for its tokens.
#[test]
fn an_export_read_across_a_defragmentation_reads_its_own_rows() {
    let (mut w, dir) = tiny_worker(CacheDType::F32);
    // A cached path in the low blocks, dropped later to leave holes.
    let low: Vec<u32> = (0..60).map(|i| 7 + (i * 3) % 70).collect();
    let seq = computed(&mut w, &low);
    w.sched.kv_mut().insert_sequence(seq).unwrap();
    w.sched.kv_mut().free_sequence(seq).unwrap();
    // A request decoding beside the export keeps the reading to parts.
    let (events, _rx) = crate::stream::channel();
    let req = GenerateRequest {
        max_tokens: 400,
        ignore_eos: true,
        sampling: crate::sampler::SamplingParams::greedy(),
        ..GenerateRequest::new(crate::types::Prompt::Tokens(vec![3, 4, 5]))
    };
    let backlog = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    w.submit(
        vec![3, 4, 5],
        Box::new(req),
        None,
        events,
        Arc::new(AtomicBool::new(false)),
        backlog,
    )
    .unwrap();
    let ids: Vec<u32> = (0..300).map(|i| 5 + (i * 11) % 80).collect();
    let (tx, rx) = mpsc::channel();
    w.start_export(&Partition::default(), ids.clone(), tx);
    let mut moved = false;
    let snap = loop {
        w.step();
        if let Ok(got) = rx.try_recv() {
            break got.unwrap().0;
        }
        let reading = w
            .exports
            .values()
            .any(|x| x.read.as_ref().is_some_and(|r| r.at > 0));
        if reading && !moved {
            w.sched.kv_mut().clear_cache().unwrap();
            moved = w.defragment().unwrap() > 0;
            assert!(moved, "the defragmentation moved blocks");
        }
    };
    assert!(moved, "the export was read in parts");
    let ns = w.ns;
    assert_eq!(snap, w.export_now(ns, &ids).unwrap());
    std::fs::remove_dir_all(dir).unwrap();
}

/// Drives `fut` to its end on this thread, parking while it is pending:
/// the waker is the only thing that unparks it (with a 30 s bound, so a
/// missed wake fails the test instead of hanging it).
fn block_on<F: std::future::Future>(fut: F) -> F::Output {
    struct Unpark(std::thread::Thread, std::sync::atomic::AtomicUsize);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.1.fetch_add(1, Ordering::SeqCst);
            self.0.unpark();
        }
    }
    let unpark = Arc::new(Unpark(std::thread::current(), AtomicUsize::new(0)));
    let waker = std::task::Waker::from(unpark.clone());
    let mut cx = std::task::Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        if let std::task::Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        let seen = unpark.1.load(Ordering::SeqCst);
        let start = std::time::Instant::now();
        while unpark.1.load(Ordering::SeqCst) == seen {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(30),
                "the stream was never woken"
            );
            std::thread::park_timeout(std::time::Duration::from_millis(100));
        }
    }
}

/// The request stream read as a `futures::Stream` (polled, woken by the
/// worker) gives the events the blocking iterator gives, in order, and
/// ends after the last sample; dropped early, it cancels its request.
#[test]
fn the_async_stream_gives_the_iterators_events() {
    use futures_util::StreamExt;
    let (engine, dir) = tiny_engine(small_cfg());
    let mut req = greedy(&[5, 6, 7, 8], 12);
    req.n = 2;
    req.sampling = SamplingParams {
        temperature: 0.9,
        seed: 7,
        ..SamplingParams::greedy()
    };
    let summary = |events: Vec<Event>| -> Vec<(usize, Option<u32>)> {
        events
            .into_iter()
            .map(|ev| match ev {
                Event::Token { index, id, .. } => (index, Some(id)),
                Event::Done(c) => (c.index, None),
                Event::Error(e) => panic!("{e}"),
            })
            .collect()
    };
    let blocking: Vec<Event> = engine.generate(req.clone()).unwrap().collect();
    let polled: Vec<Event> = block_on(engine.generate(req.clone()).unwrap().into_async().collect());
    let (b, p) = (summary(blocking), summary(polled));
    assert_eq!(p.iter().filter(|(_, t)| t.is_none()).count(), 2, "{p:?}");
    let per_sample = |v: &[(usize, Option<u32>)], i| -> Vec<Option<u32>> {
        v.iter().filter(|(j, _)| *j == i).map(|(_, t)| *t).collect()
    };
    for i in 0..2 {
        assert_eq!(per_sample(&p, i), per_sample(&b, i), "sample {i}");
    }
    // A stream dropped after its first token cancels the request.
    let mut long = greedy(&[9, 10, 11], 400);
    long.ignore_eos = true;
    let mut s = engine.generate(long).unwrap().into_async();
    let first = block_on(s.next());
    assert!(matches!(first, Some(Event::Token { .. })), "{first:?}");
    drop(s);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while engine.stats().running + engine.stats().waiting > 0 {
        assert!(std::time::Instant::now() < deadline, "never cancelled");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // 24 tokens of the two requests above, and a few of this one, not 400.
    let done = engine.stats().completion_tokens;
    assert!(
        done < 300,
        "{done} tokens: the dropped stream's request ran on"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// A text scored while another request decodes is scheduled beside it
/// (prefill chunks in the same steps, not a stall of the worker): its
/// rows are the same bits as on an idle engine, the decoding request's
/// tokens are those it gives alone, and nothing of the text is cached.
#[test]
fn texts_are_scored_beside_running_requests() {
    let (engine, dir) = tiny_engine(small_cfg());
    let ids: Vec<u32> = (0..70).map(|i| 3 + (i * 17) % 90).collect();
    let idle = engine.logits(&ids, 5).unwrap();
    assert_eq!(idle.len(), ids.len() - 1 - 5);
    let req = greedy(&[9, 8, 7], 200);
    let tokens = |events: &mut dyn Iterator<Item = Event>| -> Vec<u32> {
        events
            .filter_map(|ev| match ev {
                Event::Token { id, .. } => Some(id),
                _ => None,
            })
            .collect()
    };
    let alone = tokens(&mut engine.generate(req.clone()).unwrap());
    engine.clear_cache().unwrap();
    let steps_before = engine.stats().steps;
    let mut stream = engine.generate(req).unwrap();
    // The request is running before the text arrives.
    let first = match stream.next() {
        Some(Event::Token { id, .. }) => id,
        other => panic!("{other:?}"),
    };
    let beside = engine.logits(&ids, 5).unwrap();
    let mut got = vec![first];
    got.extend(tokens(&mut stream));
    assert_eq!(got, alone);
    assert_eq!(beside, idle, "scored beside a decode: the same bits");
    // Its 70 tokens (chunks of 16) rode in the decoding steps: no step of
    // their own.
    assert!(engine.stats().steps - steps_before <= alone.len() as u64 + 1);
    assert_eq!(engine.kv_stats().sequences, 0);
    assert!(engine.logits(&ids[..1], 0).unwrap().is_empty());
    std::fs::remove_dir_all(dir).unwrap();
}

/// Speculative decoding by prompt lookup gives the tokens of plain decoding,
/// greedy and sampled, for requests running together (drafts checked in
/// batches beside other requests' decodes and prefills, settled, rolled
/// back), with stop limits inside drafts; drafts are made and kept.
#[test]
fn speculative_decoding_gives_the_tokens_of_plain_decoding() {
    // Prompts that repeat themselves, so lookups find drafts.
    let ps: Vec<Vec<u32>> = (0..4u32)
        .map(|i| (0..40u32).map(|t| 5 + (t % (5 + i)) * 7 % 60).collect())
        .collect();
    let run = |spec: Option<crate::NgramSpec>, temperature: f32| {
        let (engine, dir) = tiny_engine(EngineConfig {
            speculative: spec,
            ..small_cfg()
        });
        let outs = run_together(&engine, &ps, temperature);
        let stats = engine.stats();
        assert_no_leak(&engine);
        drop(engine);
        let _ = std::fs::remove_dir_all(dir);
        (outs, stats.spec_draft_tokens, stats.spec_accepted_tokens)
    };
    let spec = crate::NgramSpec {
        max_draft: 6,
        max_ngram: 3,
        min_ngram: 1,
    };
    for temperature in [0.0, 0.9] {
        let (plain, d0, _) = run(None, temperature);
        let (fast, drafted, kept) = run(Some(spec), temperature);
        assert_eq!(fast, plain, "temperature {temperature}");
        assert_eq!(d0, 0);
        assert!(drafted > 0 && kept > 0, "{drafted} drafted, {kept} kept");
        eprintln!("temperature {temperature}: {kept} of {drafted} draft tokens kept");
    }
}

/// A draft model (the model itself, and another of the same vocabulary)
/// gives the tokens of plain decoding, greedy and sampled, for requests
/// running together; its drafts are made and kept, and its cache holds
/// nothing once they end (what they computed stays in its prefix tree).
#[test]
fn a_draft_model_gives_the_tokens_of_plain_decoding() {
    let ps = prompts();
    let other = std::env::temp_dir().join(format!("tessera-draft-{}", std::process::id()));
    write_tiny_model(
        &other,
        TinySpec {
            seed: 7,
            layers: 1,
            ..TinySpec::default()
        },
    )
    .unwrap();
    let run = |draft: Option<&std::path::Path>, temperature: f32| {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("tessera-drafted-{}-{n}", std::process::id()));
        write_tiny_model(&dir, TinySpec::default()).unwrap();
        // The draft: the engine's own model when none is named.
        let draft = draft.map_or_else(|| dir.clone(), |d| d.to_path_buf());
        let model = Model::load(&dir, &mut |_, _| {}).unwrap();
        let engine = Engine::from_model(
            model,
            EngineConfig {
                draft: Some(crate::DraftModelConfig {
                    source: crate::ModelSource::Path(draft),
                    p_min: 0.0,
                }),
                ..small_cfg()
            },
        )
        .unwrap();
        let outs = run_together(&engine, &ps, temperature);
        engine.check_kv().unwrap();
        let stats = engine.stats();
        assert_no_leak(&engine);
        let d = stats.draft_kv.expect("a draft cache");
        assert_eq!(d.sequences, 0, "{d:?}");
        assert_eq!(d.used_blocks, 0, "{d:?}");
        assert!(
            d.cached_tokens > 0,
            "the draft's prefix tree keeps the texts"
        );
        drop(engine);
        let _ = std::fs::remove_dir_all(dir);
        (outs, stats.spec_draft_tokens, stats.spec_accepted_tokens)
    };
    let plain = |temperature: f32| {
        let (engine, dir) = tiny_engine(small_cfg());
        let outs = run_together(&engine, &ps, temperature);
        drop(engine);
        let _ = std::fs::remove_dir_all(dir);
        outs
    };
    for temperature in [0.0, 0.9] {
        let want = plain(temperature);
        for draft in [None, Some(other.as_path())] {
            let (got, drafted, kept) = run(draft, temperature);
            assert_eq!(got, want, "temperature {temperature}, draft {draft:?}");
            assert!(drafted > 0, "no drafts");
            if draft.is_none() && temperature == 0.0 {
                // The model drafting for itself greedily: every guess kept.
                assert_eq!(kept, drafted);
            }
            eprintln!("temperature {temperature}, draft {draft:?}: {kept} of {drafted} kept");
        }
    }
    let _ = std::fs::remove_dir_all(other);
}

/// Each prompt's tokens, run together.
fn run_together(engine: &Engine, ps: &[Vec<u32>], temperature: f32) -> Vec<Vec<u32>> {
    let streams: Vec<_> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut r = greedy(p, 20 + 7 * i);
            r.sampling.temperature = temperature;
            r.sampling.seed = 11 + i as u64;
            engine.generate(r).unwrap()
        })
        .collect();
    streams
        .into_iter()
        .map(|s| {
            s.filter_map(|ev| match ev {
                Event::Done(c) => Some(c.tokens),
                Event::Error(e) => panic!("{e}"),
                Event::Token { .. } => None,
            })
            .next()
            .expect("a completion")
        })
        .collect()
}

/// A disk tier's test setup: a fresh cache directory named for `name`,
/// the tiny model's bytes per block (from a probe engine, whose model
/// folder is returned to be removed) and three 40-token prompts that
/// share nothing.
fn tier_setup(name: &str) -> (std::path::PathBuf, std::path::PathBuf, usize, Vec<Vec<u32>>) {
    let cache = std::env::temp_dir().join(format!("tessera-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let (probe, dir) = tiny_engine(small_cfg());
    let s = probe.stats();
    let per_block = s.kv_bytes / s.kv.num_blocks;
    drop(probe);
    let texts = (0..3u32)
        .map(|i| (0..40u32).map(|t| 3 + (i * 17 + t * 7) % 60).collect())
        .collect();
    (cache, dir, per_block, texts)
}

/// With a cache directory, full blocks that eviction frees go to the disk
/// tier and come back for a prompt that continues past the pool's match:
/// the same tokens as an engine without the tier, counted as cached and
/// as read from disk, per partition, and still there after a restart
/// (the shutdown's cache file removed, so only the tier holds them).
#[test]
fn evicted_prefixes_come_back_from_the_disk_tier() {
    // A pool of 16 blocks of 4 tokens: one 40-token prompt and its answer.
    let (cache, d0, per_block, texts) = tier_setup("tier");
    let cfg = |dir: Option<&std::path::Path>| EngineConfig {
        kv_memory: 16 * per_block,
        cache_dir: dir.map(Into::into),
        ..small_cfg()
    };
    let order = [0, 1, 2, 0, 1];
    let run = |engine: &Engine, p: &[u32], tenant: Option<&str>| {
        let mut req = greedy(p, 6);
        req.partition.tenant = tenant.map(Into::into);
        let d = engine.complete(&req, &mut |_| {}).unwrap();
        (d.tokens, d.usage)
    };
    let (plain, d1) = tiny_engine(cfg(None));
    assert_eq!(plain.stats().kv.num_blocks, 16);
    let want: Vec<Vec<u32>> = order
        .iter()
        .map(|&i| run(&plain, &texts[i], None).0)
        .collect();
    assert!(plain.stats().disk_tier.is_none());

    let (tiered, d2) = tiny_engine(cfg(Some(&cache)));
    for (k, &i) in order.iter().enumerate() {
        let (toks, usage) = run(&tiered, &texts[i], None);
        assert_eq!(toks, want[k], "request {k}");
        if k >= 3 {
            // Evicted by the two between: back from disk, whole blocks of
            // the 39 tokens a match may cover.
            assert_eq!(usage.disk_cached_tokens, 36, "request {k}: {usage:?}");
            assert_eq!(usage.cached_tokens, 36, "request {k}: {usage:?}");
        } else {
            assert_eq!(usage.cached_tokens, 0);
        }
    }
    let st = tiered.stats();
    let t = st.disk_tier.unwrap();
    assert!(t.written >= 18 && t.read == 18, "{t:?}");
    assert_eq!(st.disk_cached_tokens, 72);
    // Another tenant never reads the default partition's blocks.
    let (toks, usage) = run(&tiered, &texts[2], Some("other"));
    assert_eq!((usage.cached_tokens, usage.disk_cached_tokens), (0, 0));
    assert_eq!(toks, want[2]);
    assert_no_leak(&tiered);
    tiered.check_kv().unwrap();
    drop(tiered);

    // Restarted on the tier alone.
    std::fs::remove_file(cache.join(crate::snapshot::CACHE_FILE)).unwrap();
    let (again, d3) = tiny_engine(cfg(Some(&cache)));
    assert_eq!(again.stats().kv.cached_tokens, 0);
    let (toks, usage) = run(&again, &texts[2], None);
    assert_eq!(toks, want[2]);
    assert_eq!(usage.disk_cached_tokens, 36, "{usage:?}");
    assert_no_leak(&again);
    drop(again);
    for d in [d0, d1, d2, d3, cache] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// A prompt that the disk tier holds, arriving while a running request
/// leaves the pool room for its first chunk but not for its blocks, waits
/// for that room and is read back from disk, rather than being admitted
/// to compute its prompt again beside the running one (and preempt it as
/// both grow).
#[test]
fn a_prompt_on_disk_waits_for_room_rather_than_computing_again() {
    let (cache, d0, per_block, texts) = tier_setup("tier-wait");
    let long: Vec<u32> = texts[2][..28].to_vec();
    // The long request's decoding steps take 10 ms each, so that the
    // other request, sent after its first token, arrives while it still
    // runs (27 steps to go) on any machine.
    let key = long.clone();
    let hook = FaultHook::new(move |sites| {
        if sites.iter().any(|s| s.prompt == key && s.start >= 28) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        None
    });
    // 16 blocks of 4 tokens; prompt chunks of 16 tokens (4 blocks).
    let cfg = |dir: Option<&std::path::Path>, hook: Option<FaultHook>| EngineConfig {
        kv_memory: 16 * per_block,
        cache_dir: dir.map(Into::into),
        faults: hook,
        ..small_cfg()
    };
    let tokens = |stream: crate::RequestStream| -> (Vec<u32>, crate::Usage) {
        stream
            .filter_map(|ev| match ev {
                Event::Done(c) => Some((c.tokens, c.usage)),
                Event::Error(e) => panic!("{e}"),
                Event::Token { .. } => None,
            })
            .next()
            .expect("a completion")
    };
    let (plain, d1) = tiny_engine(cfg(None, None));
    let want_long = tokens(plain.generate(greedy(&long, 28)).unwrap()).0;
    let want = tokens(plain.generate(greedy(&texts[0], 6)).unwrap()).0;
    drop(plain);

    let (engine, d2) = tiny_engine(cfg(Some(&cache), Some(hook)));
    for t in &texts {
        engine.complete(&greedy(t, 6), &mut |_| {}).unwrap();
    }
    // texts[0] is now on disk, but for at most its first block. The long
    // request runs: it holds 8 blocks after its first token and grows to
    // 14, so texts[0]'s 10 or 11 never fit beside it, though its first
    // chunk's 4 do.
    let mut running = engine.generate(greedy(&long, 28)).unwrap();
    assert!(matches!(running.next(), Some(Event::Token { .. })));
    let waiting = engine.generate(greedy(&texts[0], 6)).unwrap();
    let (got_long, _) = tokens(running);
    let (got, usage) = tokens(waiting);
    assert_eq!(got_long, want_long);
    assert_eq!(got, want);
    // Its whole match (36 of the 39 tokens a match may cover), all but
    // what the pool still held read back from disk.
    assert_eq!(usage.cached_tokens, 36, "{usage:?}");
    assert!(usage.disk_cached_tokens >= 32, "{usage:?}");
    assert_eq!(engine.stats().preemptions, 0);
    assert_no_leak(&engine);
    engine.check_kv().unwrap();
    drop(engine);
    for d in [d0, d1, d2, cache] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// With a disk tier, KV events name where blocks live: the pool's as
/// `"CPU"`, the tier's as `"DISK"` (as vLLM names its offloaded blocks'
/// medium). Replayed per medium, each parent known in one medium or the
/// other when its child comes, they end holding exactly the tier's blocks;
/// an engine started on the tier announces all of them first.
#[test]
fn the_disk_tiers_blocks_come_as_kv_events_of_their_own_medium() {
    use crate::{KvEvent, KvEventBatch, KvEventSink};
    use std::collections::{HashMap, HashSet};
    let (cache, d0, per_block, texts) = tier_setup("tier-ev");
    let sink = |got: Arc<std::sync::Mutex<Vec<KvEventBatch>>>| {
        KvEventSink::new(move |b| got.lock().unwrap().push(b))
    };
    let cfg = |sink: KvEventSink| EngineConfig {
        kv_memory: 16 * per_block,
        cache_dir: Some(cache.clone()),
        kv_events: Some(sink),
        ..small_cfg()
    };
    type Index = HashMap<&'static str, HashSet<u64>>;
    let replay = |batches: &std::sync::Mutex<Vec<KvEventBatch>>, index: &mut Index| {
        for b in batches.lock().unwrap().drain(..) {
            for e in b.events {
                match e {
                    KvEvent::BlockStored {
                        block_hashes,
                        parent_block_hash,
                        medium,
                        ..
                    } => {
                        assert!(["CPU", "DISK"].contains(&medium), "{medium}");
                        if let Some(p) = parent_block_hash {
                            assert!(
                                index.values().any(|m| m.contains(&p)),
                                "a parent known in some medium"
                            );
                        }
                        for h in block_hashes {
                            assert!(index.entry(medium).or_default().insert(h), "stored twice");
                        }
                    }
                    KvEvent::BlockRemoved {
                        block_hashes,
                        medium,
                    } => {
                        for h in block_hashes {
                            let m = index.entry(medium).or_default();
                            assert!(m.remove(&h), "removed unknown from {medium}");
                        }
                    }
                    KvEvent::AllBlocksCleared => index.clear(),
                }
            }
        }
    };
    let batches: Arc<std::sync::Mutex<Vec<KvEventBatch>>> = Default::default();
    let (engine, d1) = tiny_engine(cfg(sink(batches.clone())));
    let mut index = Index::new();
    for &i in &[0, 1, 2, 0, 1] {
        engine.complete(&greedy(&texts[i], 6), &mut |_| {}).unwrap();
    }
    engine.check_kv().unwrap();
    replay(&batches, &mut index);
    let on_disk = engine.stats().disk_tier.unwrap().blocks;
    assert!(on_disk >= 18, "{on_disk}");
    assert_eq!(index["DISK"].len(), on_disk);
    assert!(!index["CPU"].is_empty());
    drop(engine);
    // The tier on its own, read back: the same blocks.
    let (e, d) = tiny_engine(small_cfg());
    let geometry = crate::snapshot::Geometry::of(e.model(), CacheDType::F32);
    let c = e.model().config();
    let row_bytes = c.n_kv_heads * c.head_dim * 4;
    drop(e);
    std::fs::remove_dir_all(d).unwrap();
    let tier = crate::tier::DiskTier::open(
        &cache.join(crate::tier::TIER_DIR),
        &geometry,
        4,
        row_bytes,
        crate::DEFAULT_CACHE_DIR_BYTES,
    )
    .unwrap();
    let held: HashSet<u64> = tier
        .held()
        .into_iter()
        .map(|c| match c {
            crate::tier::TierChange::Stored { hash, .. } => hash,
            crate::tier::TierChange::Removed(_) => unreachable!(),
        })
        .collect();
    drop(tier);
    assert_eq!(index["DISK"], held);

    // Started again on the tier (the shutdown's pool file removed): the
    // first batch announces every block it holds, parents first.
    std::fs::remove_file(cache.join(crate::snapshot::CACHE_FILE)).unwrap();
    let again: Arc<std::sync::Mutex<Vec<KvEventBatch>>> = Default::default();
    let (engine, d2) = tiny_engine(cfg(sink(again.clone())));
    engine
        .complete(&greedy(&[9, 9, 9], 1), &mut |_| {})
        .unwrap();
    engine.check_kv().unwrap();
    let mut index = Index::new();
    replay(&again, &mut index);
    assert_eq!(index["DISK"], held);
    drop(engine);
    for d in [d0, d1, d2, cache] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// KV events follow the prefix cache exactly: replayed in order by a
/// router's index (stored blocks new and after their parent, removed
/// blocks known), they leave the full blocks of the cached paths, named by
/// the chain of their partition and tokens, with concurrent requests,
/// eviction, a tenant and a cleared cache.
#[test]
fn kv_events_replay_to_the_cached_full_blocks() {
    use crate::{KvEvent, KvEventBatch, KvEventSink};
    use std::collections::HashSet;
    let batches: Arc<std::sync::Mutex<Vec<KvEventBatch>>> = Default::default();
    let got = batches.clone();
    let (probe, d0) = tiny_engine(small_cfg());
    let s = probe.stats();
    let per_block = s.kv_bytes / s.kv.num_blocks;
    drop(probe);
    let (engine, dir) = tiny_engine(EngineConfig {
        kv_memory: 24 * per_block,
        kv_events: Some(KvEventSink::new(move |b| got.lock().unwrap().push(b))),
        ..small_cfg()
    });
    let mut index: HashSet<u64> = HashSet::new();
    let replay = |index: &mut HashSet<u64>| {
        for b in batches.lock().unwrap().drain(..) {
            assert!(b.ts > 1.7e9, "{}", b.ts);
            for e in b.events {
                match e {
                    KvEvent::BlockStored {
                        block_hashes,
                        parent_block_hash,
                        token_ids,
                        block_size,
                        medium,
                    } => {
                        assert_eq!((block_size, medium), (4, "CPU"));
                        assert_eq!(token_ids.len(), 4 * block_hashes.len());
                        if let Some(p) = parent_block_hash {
                            assert!(index.contains(&p), "a parent the index knows");
                        }
                        for h in block_hashes {
                            assert!(index.insert(h), "stored twice");
                        }
                    }
                    KvEvent::BlockRemoved { block_hashes, .. } => {
                        for h in block_hashes {
                            assert!(index.remove(&h), "removed unknown");
                        }
                    }
                    KvEvent::AllBlocksCleared => index.clear(),
                }
            }
        }
    };
    let texts = prompts();
    std::thread::scope(|s| {
        for p in &texts {
            let e = &engine;
            s.spawn(move || e.complete(&greedy(p, 8), &mut |_| {}).unwrap());
        }
    });
    for (i, p) in texts.iter().enumerate() {
        let mut req = greedy(&[p.as_slice(), p.as_slice()].concat(), 6);
        if i % 2 == 1 {
            req.partition.tenant = Some("t".into());
        }
        engine.complete(&req, &mut |_| {}).unwrap();
    }
    // A request's end reaches its caller within the step; the step's
    // events go out after it: a command after them has passed that.
    engine.check_kv().unwrap();
    replay(&mut index);
    assert!(engine.stats().kv.evicted_blocks > 0, "the pool evicted");
    // What the index holds: every full block of every cached path.
    let save = std::env::temp_dir().join(format!("tessera-events-{}", std::process::id()));
    engine.save_cache_dir(&save).unwrap();
    let geometry = crate::snapshot::Geometry::of(engine.model(), CacheDType::F32);
    let (snaps, meta) = crate::snapshot::read_file(
        &save.join(crate::snapshot::CACHE_FILE),
        "prefix cache",
        &geometry,
    )
    .unwrap();
    let parts: Vec<Partition> = serde_json::from_value(meta["partitions"].clone()).unwrap();
    let fp = engine.model().fingerprint;
    let want: HashSet<u64> = snaps
        .iter()
        .zip(&parts)
        .flat_map(|(s, p)| {
            let key = crate::tier::tier_key(fp, "f32", p.tenant.as_deref(), p.salt.as_deref());
            crate::tier::chain(&key, &s.tokens, 4)
        })
        .collect();
    assert!(want.len() > 10);
    assert_eq!(index, want);
    // A cleared cache removes what it held.
    engine.clear_cache().unwrap();
    engine
        .complete(&greedy(&[9, 9, 9], 1), &mut |_| {})
        .unwrap();
    engine.check_kv().unwrap();
    replay(&mut index);
    assert!(index.is_empty(), "{index:?}");
    drop(engine);
    for d in [d0, dir, save] {
        std::fs::remove_dir_all(d).unwrap();
    }
}
