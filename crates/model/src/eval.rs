//! One sequence through the model and a paged cache without the engine:
//! greedy generation and whole-prompt logits. The fidelity benchmark and
//! the tests measure the forward with these.

use crate::Result;

/// Greedy generation of `steps` tokens through the paged cache: one
/// sequence, block size 4, blocks deliberately scattered (reverse order),
/// the prompt prefilled in chunks of `chunk` tokens. Returns the tokens and
/// the logits each was picked from.
pub fn paged_greedy(
    model: &crate::Llama,
    prompt: &[u32],
    steps: usize,
    chunk: usize,
    cache_dtype: tessera_kernels::KvType,
) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
    paged_greedy_with(model, prompt, steps, chunk, cache_dtype, None, false)
}

/// [`paged_greedy`] with the sliding-window layers on a pool of their own
/// of `ring` blocks (when given), reused round robin: block `j` of the
/// sequence lives in sliding block `j % ring`, and every table entry
/// before the window of the step's first token is [`crate::NO_BLOCK`].
/// `reference`: the candle forward instead of [`crate::Llama::forward`].
pub fn paged_greedy_with(
    model: &crate::Llama,
    prompt: &[u32],
    steps: usize,
    chunk: usize,
    cache_dtype: tessera_kernels::KvType,
    ring: Option<usize>,
    reference: bool,
) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
    let bs = 4;
    let nb = (prompt.len() + steps).div_ceil(bs) + 1;
    let cache = model.new_split_cache(nb, ring, bs, cache_dtype)?;
    let table: Vec<u32> = (0..nb as u32).rev().collect();
    let window = model.windows().into_iter().max().unwrap_or(0);
    let mut toks = prompt.to_vec();
    let (mut out, mut all) = (Vec::new(), Vec::new());
    let mut done = 0;
    while out.len() < steps {
        let end = if done < prompt.len() {
            done.saturating_add(chunk.max(1)).min(prompt.len())
        } else {
            toks.len()
        };
        let positions: Vec<u32> = (done as u32..end as u32).collect();
        let slots: Vec<u32> = positions
            .iter()
            .map(|&p| table[p as usize / bs] * bs as u32 + p % bs as u32)
            .collect();
        let (sliding_slots, sliding_table) = match ring {
            Some(r) => {
                let first = tessera_kernels::window_start(done, window) / bs;
                let t: Vec<u32> = (0..nb)
                    .map(|j| {
                        if j < first {
                            crate::NO_BLOCK
                        } else {
                            (j % r) as u32
                        }
                    })
                    .collect();
                let s = positions
                    .iter()
                    .map(|&p| t[p as usize / bs] * bs as u32 + p % bs as u32)
                    .collect();
                (s, t)
            }
            None => (Vec::new(), Vec::new()),
        };
        let token_seq = vec![0; end - done];
        let last = [(end - done - 1) as u32];
        let batch = crate::Batch {
            tokens: &toks[done..end],
            positions: &positions,
            rope_positions: None,
            slots: &slots,
            token_seq: &token_seq,
            block_tables: &table,
            max_blocks: nb,
            block_size: bs,
            logits_for: &last,
            sliding: ring.map(|_| crate::SlidingBatch {
                slots: &sliding_slots,
                block_tables: &sliding_table,
            }),
        };
        let logits = if reference {
            model.forward_reference(&batch, &cache)?
        } else {
            model.forward(&batch, &cache)?
        }
        .squeeze(0)?;
        done = end;
        if done == toks.len() {
            let t = crate::Llama::argmax(&logits)?;
            all.push(logits.to_vec1::<f32>()?);
            out.push(t);
            toks.push(t);
        }
    }
    Ok((out, all))
}

/// The logits of every position of `tokens`, computed as one prefill on
/// a fresh paged cache of `cache_dtype` (`model.forward`).
pub fn prefill_logits(
    model: &crate::Llama,
    tokens: &[u32],
    cache_dtype: tessera_kernels::KvType,
) -> Result<Vec<Vec<f32>>> {
    let bs = 16;
    let nb = tokens.len().div_ceil(bs) + 1;
    let cache = model.new_cache(nb, bs, cache_dtype)?;
    let table: Vec<u32> = (0..nb as u32).collect();
    let positions: Vec<u32> = (0..tokens.len() as u32).collect();
    let seq = vec![0; tokens.len()];
    let batch = crate::Batch {
        tokens,
        positions: &positions,
        rope_positions: None,
        slots: &positions,
        token_seq: &seq,
        block_tables: &table,
        max_blocks: nb,
        block_size: bs,
        logits_for: &positions,
        sliding: None,
    };
    Ok(model.forward(&batch, &cache)?.to_vec2::<f32>()?)
}
