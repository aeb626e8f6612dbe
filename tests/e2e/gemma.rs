//! Gemma 3 270M Q4_K_M (`just model gemma3`, fetched by `just test`): its
//! block, sliding windows and K-quants on the real file.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use candle_core::DType;
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
    let cache = m.llama.new_cache(nb, bs, DType::F32).unwrap();
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
        let (paged, pl) = paged_greedy(&m.llama, &ids, 12, chunk, DType::F32).unwrap();
        assert_eq!(paged, dense, "chunk {chunk}");
        let big = dl.iter().flatten().fold(1f32, |m, v| m.max(v.abs()));
        let d = max_diff(&pl, &dl);
        assert!(d < 2e-3 * big, "chunk {chunk}: logits differ by {d}");
    }
}
