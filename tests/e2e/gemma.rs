//! Gemma 3 270M Q4_K_M (`just model gemma3`, fetched by `just test`): its
//! block, sliding windows and K-quants on the real file.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tessera_kernels::Activations;
use tessera_model::testing::{dense_greedy, max_diff, paged_greedy, ScatteredPrompt};
use tessera_model::{Model, Special};

pub(crate) fn gemma_path() -> PathBuf {
    crate::models_file("gemma-3-270m-q4_k_m.gguf", " gemma3")
}

/// The model with f32 activations: the reference's arithmetic.
fn gemma_f32() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| {
        let m = Model::load(&gemma_path(), &mut |_, _| {}).expect("Gemma 3 loads");
        m.llama.set_activations(Activations::F32);
        m
    })
}

/// The opening of the perplexity text, `n` tokens with BOS.
fn text_tokens(m: &Model, n: usize) -> Vec<u32> {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("data/pride-and-prejudice.txt"),
    )
    .unwrap();
    let ids = m
        .tokenizer
        .encode(&text[..12_000], Special::AsText, true)
        .unwrap();
    assert!(ids.len() >= n);
    ids[..n].to_vec()
}

/// The fast forward against the candle reference over 600 tokens (past
/// the 512-token window, so that sliding layers drop the oldest keys): the
/// same top tokens, logits within rounding.
#[test]
fn gemma3_fast_forward_matches_the_reference_past_the_window() {
    let m = gemma_f32();
    let ids = text_tokens(m, 600);
    let n = ids.len();
    let bs = 16;
    let nb = n.div_ceil(bs) + 1;
    let layout = ScatteredPrompt::new(n, nb, bs);
    let picks: Vec<u32> = vec![0, 100, 511, 512, 513, 560, 599];
    let batch = layout.batch(&ids, &picks);
    let cache = m
        .llama
        .new_cache(nb, bs, tessera_kernels::KvType::F32)
        .unwrap();
    let r = m
        .llama
        .forward_reference(&batch, &cache)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let f = m
        .llama
        .forward_threads(&batch, &cache, 2)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let argmax = |v: &[f32]| (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap();
    let big = r.iter().flatten().fold(1f32, |m, v| m.max(v.abs()));
    let d = max_diff(&f, &r);
    assert!(d < 2e-3 * big, "logits differ by {d} (largest {big})");
    for (i, (a, b)) in f.iter().zip(&r).enumerate() {
        assert_eq!(argmax(a), argmax(b), "top token at position {}", picks[i]);
    }
}

/// Paged (in any prefill chunking) against the dense f32 reference, on a
/// prompt longer than the window: the same greedy tokens.
#[test]
fn gemma3_paged_cache_matches_a_dense_cache_past_the_window() {
    let m = gemma_f32();
    let ids = text_tokens(m, 530);
    let (dense, dl) = dense_greedy(&m.llama, &ids, 12).unwrap();
    for chunk in [usize::MAX, 100] {
        let (paged, pl) =
            paged_greedy(&m.llama, &ids, 12, chunk, tessera_kernels::KvType::F32).unwrap();
        assert_eq!(paged, dense, "chunk {chunk}");
        let big = dl.iter().flatten().fold(1f32, |m, v| m.max(v.abs()));
        let d = max_diff(&pl, &dl);
        assert!(d < 2e-3 * big, "chunk {chunk}: logits differ by {d}");
    }
}

fn gemma_engine(cfg: tessera_engine::EngineConfig) -> tessera_engine::Engine {
    let m = Model::load(&gemma_path(), &mut |_, _| {}).expect("Gemma 3 loads");
    tessera_engine::Engine::from_model(m, cfg).unwrap()
}

/// Greedy completion of `ids`: the tokens and the prompt tokens served
/// from the cache.
fn complete(e: &tessera_engine::Engine, ids: &[u32], n: usize) -> (Vec<u32>, usize) {
    use tessera_engine::{GenerateRequest, Prompt, SamplingParams};
    let c = e
        .complete(
            &GenerateRequest {
                max_tokens: n,
                sampling: SamplingParams::greedy(),
                ignore_eos: true,
                ..GenerateRequest::new(Prompt::Tokens(ids.to_vec()))
            },
            &mut |_| {},
        )
        .unwrap();
    (c.tokens, c.usage.cached_tokens)
}

/// A pool whose sliding-window layers have room for little more than one
/// request's window and chunk: cached content loses its sliding blocks
/// under pressure, tails excepted.
fn tight() -> tessera_engine::EngineConfig {
    tessera_engine::EngineConfig {
        kv_memory: 64 << 20,
        prefill_chunk: 256,
        ..tessera_engine::EngineConfig::default()
    }
}

/// A second request sharing a prefix of more than two windows computes
/// only its own tokens and gives the tokens of a run without reuse;
/// after other long requests have taken the sliding pool over, the
/// branch point (a tail) still serves it whole, while a branch inside the
/// prefix falls back to the last point whose window is whole.
#[test]
fn gemma3_a_long_shared_prefix_is_reused_exactly_before_and_after_eviction() {
    let m = gemma_f32();
    let text = text_tokens(m, 1500);
    let prefix = &text[..1200];
    let with_suffix = |s: &[u32]| -> Vec<u32> { prefix.iter().chain(s).copied().collect() };
    let (a, b, c) = (
        with_suffix(&[651, 3303, 576]),
        with_suffix(&[818, 1979]),
        with_suffix(&[1018, 506, 2270, 8974]),
    );
    let cold = gemma_engine(tessera_engine::EngineConfig {
        prefix_cache: false,
        ..tight()
    });
    let warm = gemma_engine(tight());
    let stats = warm.stats();
    assert!(
        stats.kv.sliding_blocks * 4 < stats.kv.num_blocks,
        "the sliding pool is the small one: {} of {} blocks",
        stats.kv.sliding_blocks,
        stats.kv.num_blocks
    );
    let n = 12;
    assert_eq!(complete(&warm, &a, n).0, complete(&cold, &a, n).0);
    let (got, cached) = complete(&warm, &b, n);
    assert_eq!(got, complete(&cold, &b, n).0);
    assert_eq!(cached, prefix.len(), "the second request reuses the prefix");
    // Other long requests: the sliding pool evicts cached content.
    let before = warm.stats().kv.evicted_sliding_blocks;
    for k in 0..2 {
        let other: Vec<u32> = text[..1100 + 150 * k].iter().rev().copied().collect();
        complete(&warm, &other[..1100], 4);
    }
    assert!(warm.stats().kv.evicted_sliding_blocks > before);
    let (got, cached) = complete(&warm, &c, n);
    assert_eq!(got, complete(&cold, &c, n).0);
    assert_eq!(cached, prefix.len(), "the branch point's tail survived");
    // A branch in the middle of the prefix: its window was evicted.
    let mid: Vec<u32> = text[..700].iter().chain(&[9, 10, 11]).copied().collect();
    let (got, cached) = complete(&warm, &mid, n);
    assert_eq!(got, complete(&cold, &mid, n).0);
    assert!(cached < 700, "{cached} of the 700 shared tokens served");
    warm.check_kv().unwrap();
}

/// A Gemma 3 chat session saved to disk keeps every token's K/V in the
/// global layers and only the last window's in the sliding ones, and
/// resumes in a new engine from the cache with the same tokens.
#[test]
fn gemma3_a_saved_session_resumes_from_its_sliding_tail() {
    let m = gemma_f32();
    let text = text_tokens(m, 800);
    let e = gemma_engine(tessera_engine::EngineConfig::default());
    let snap = e.export_kv(&text).unwrap();
    let row = 256 * 2;
    assert_eq!(snap.sliding_from, 800 + 1 - 512);
    for (l, layer) in snap.layers.iter().enumerate() {
        let rows = if l % 6 == 5 {
            800
        } else {
            800 - snap.sliding_from
        };
        assert_eq!(layer.k.len(), rows * row, "layer {l}");
    }
    let dir = std::env::temp_dir().join(format!("tessera-gemma-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    e.save_cache_dir(&dir).unwrap();
    let more: Vec<u32> = text.iter().chain(&[1018, 506]).copied().collect();
    let (want, _) = complete(&e, &more, 10);
    drop(e);
    let second = gemma_engine(tessera_engine::EngineConfig {
        cache_dir: Some(dir.clone()),
        ..tessera_engine::EngineConfig::default()
    });
    let (got, cached) = complete(&second, &more, 10);
    assert_eq!(got, want);
    assert_eq!(cached, 800, "resumed from the saved tail");
    second.check_kv().unwrap();
    drop(second);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// With a cache directory, a conversation whose history was evicted by
/// others on a small pool comes back for its next turn: its blocks from
/// the disk tier (written as the pool evicted them, or as their sliding
/// layers' rows were evicted), or from the pool's global layers where
/// they still are, with the window before the resume point whole. The
/// tokens are those of a run without reuse.
#[test]
fn gemma3_an_evicted_history_comes_back_from_the_disk_tier() {
    use tessera_engine::{GenerateRequest, Prompt, SamplingParams};
    let m = gemma_f32();
    let ids = text_tokens(m, 2100);
    let texts: Vec<Vec<u32>> = (0..3)
        .map(|k| ids[k * 700..(k + 1) * 700].to_vec())
        .collect();
    let dir = std::env::temp_dir().join(format!("tessera-gemma-tier-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // About 1,400 tokens of global blocks: two of the three histories.
    let cfg = |cache_dir: Option<PathBuf>| tessera_engine::EngineConfig {
        kv_memory: 16 << 20,
        prefill_chunk: 256,
        cache_dir,
        ..tessera_engine::EngineConfig::default()
    };
    let cold = gemma_engine(tessera_engine::EngineConfig {
        prefix_cache: false,
        ..cfg(None)
    });
    let warm = gemma_engine(cfg(Some(dir.clone())));
    assert!(
        warm.stats().kv.num_blocks * 16 < 1500,
        "{:?}",
        warm.stats().kv
    );
    let turn = |history: &[u32], more: &[u32]| {
        let prompt: Vec<u32> = history.iter().chain(more).copied().collect();
        let c = warm
            .complete(
                &GenerateRequest {
                    max_tokens: 12,
                    sampling: SamplingParams::greedy(),
                    ignore_eos: true,
                    ..GenerateRequest::new(Prompt::Tokens(prompt.clone()))
                },
                &mut |_| {},
            )
            .unwrap();
        assert_eq!(
            c.tokens,
            complete(&cold, &prompt, 12).0,
            "{} tokens",
            prompt.len()
        );
        let history: Vec<u32> = prompt.iter().chain(&c.tokens).copied().collect();
        (history, c.usage)
    };
    let (a, _) = turn(&texts[0], &[]);
    turn(&texts[1], &[]);
    // The second conversation took the pool's end of the first: its last
    // blocks come from disk, the rest from the pool's global layers. The
    // whole blocks of its 712 tokens are served (the last one, which the
    // answer did not fill, is computed).
    let (a, usage) = turn(&a, &[1018, 506, 2270]);
    assert_eq!(usage.cached_tokens, 704, "{usage:?}");
    assert!(
        usage.disk_cached_tokens > 0 && usage.disk_cached_tokens < 704,
        "{usage:?}"
    );
    // Two more take all of it: every block from disk.
    turn(&texts[2], &[]);
    turn(&texts[1][..400], &[9, 10]);
    let (_, usage) = turn(&a, &[818, 1979]);
    assert_eq!(usage.cached_tokens, 720, "{usage:?}");
    assert!(usage.disk_cached_tokens > 0, "{usage:?}");
    let tier = warm.stats().disk_tier.unwrap();
    assert!(tier.read > 0 && tier.written > 0, "{tier:?}");
    warm.check_kv().unwrap();
    // The prefix cache written at shutdown: every path up to the point a
    // request resumes from (those whose windows were evicted, shorter).
    warm.save_cache_dir(&dir).unwrap();
    drop(warm);
    std::fs::remove_dir_all(&dir).unwrap();
}
