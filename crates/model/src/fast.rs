//! The CPU forward pass: one parallel region of a persistent [`StepPool`]
//! per batch, on buffers kept between steps, with the weights read in
//! their GGML formats by `tessera_kernels::matvec`.
//!
//! ```text
//! per layer (workers meet at 5 barriers, 6 when a token's context spans
//! more than one chunk):
//!   every worker: h = rmsnorm(x)                      (each its own copy)
//!   QKV: heads split among workers; epilogue: bias, RoPE, q → buffer,
//!        k and v → their cache slots                                  | barrier
//!   attention items (token run × KV head × 128-position chunk), each
//!        worker its own run of the plan in order, then the others'
//!        → partial softmax states, or straight to a for a
//!        token whose context is one chunk                              | barrier
//!   merge the other tokens' states per (token, head) → a               | barrier
//!   O: rows split; x += a·Woᵀ                                          | barrier
//!   every worker: h = rmsnorm(x)
//!   gate/up: rows split; m = act(h·Wgᵀ) · (h·Wuᵀ)                       | barrier
//!   down: rows split; x += m·Wdᵀ                                       | barrier
//! then the rows that want logits: norm, output head rows split.
//! ```
//!
//! "Split" is each worker's static share, taken in chunks of at least
//! 64 KB of weights while decoding (up to 8 inputs): a worker that
//! finishes its own run helps with the others' from their ends
//! (`for_units`), so the team no longer waits at each barrier for the
//! worker whose core streams slowest at that moment.
//!
//! Gemma 3 adds: embeddings scaled; q and k heads RMS-normed in the QKV
//! epilogue before RoPE (each layer with its own RoPE table); sliding-window
//! layers' attention planned with their window; O and down written to a
//! buffer, then normed and added to `x` by token share (one more barrier
//! each); GELU (tanh) as the gate's activation.
//!
//! Every value is computed by the same arithmetic whichever worker computes
//! it, however many workers there are, and whatever else is in the batch
//! (see `matvec` and `attend`), so a sequence's logits are the same bits
//! alone or batched, in one prefill or in chunks, with or without a cached
//! prefix. The candle forward (`Llama::forward_reference`) stays as the
//! reference this path is tested against.

// Lane loops index several arrays in step.
#![allow(clippy::needless_range_loop)]

use std::borrow::Cow;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use candle_core::Tensor;
use tessera_kernels::pool::{split as team_split, Shared, StepPool, Team};
use tessera_kernels::quant::hadamard64;
use tessera_kernels::{
    act_mul, attend_item, cache_geometry, cache_raw, matvec, merge, qmatvec_keyed, quantize_row,
    rms_norm, rms_norm_in_place, rotate_pairs, ActBlock, Activations, ActsKey, AttnInput, AttnPlan,
    AttnScratch, AttnShape, CacheRaw, Isa, Packed, QIsa, WeightFormat, Weights, GROUP,
};

use crate::llama::{rope_angles, Batch, LayerKv, Llama};
use crate::phases::Part;
use crate::qlinear::QLinear;
use crate::{ModelError, Result};

/// A counter on its own cache line (workers draw from each other's).
#[derive(Default)]
#[repr(align(64))]
struct Cursor(AtomicUsize);

/// Rows of gate/up computed per pass (their products wait in a buffer).
const FFN_ROWS: usize = 64;

/// A weight's bytes as the kernels read them.
enum Bytes {
    /// Borrowed from the model's `QTensor` at each step.
    Quantized(WeightFormat),
    /// Rows copied from a dense (safetensors) weight: f16 and bf16 as they
    /// are (widened in registers), anything else as f32.
    Owned(Vec<u8>, WeightFormat),
}

struct Lin {
    bytes: Bytes,
    n: usize,
    k: usize,
    /// Tiles for the integer path (quantized activations), when the format
    /// has one and the model runs with integer activations.
    packed: Option<Packed>,
}

impl Lin {
    /// The layer; its tiles come later ([`pack`]).
    fn new(q: &QLinear) -> Result<Lin> {
        Ok(match q {
            QLinear::Quantized(w) => {
                let (n, k) = w.shape().dims2()?;
                Lin {
                    bytes: Bytes::Quantized(WeightFormat::from_ggml(w.dtype())),
                    n,
                    k,
                    packed: None,
                }
            }
            QLinear::Dense(t) => {
                use candle_core::DType;
                let (n, k) = t.dims2()?;
                let flat = t.flatten_all()?;
                // Each value's little-endian bytes.
                fn le<T, const N: usize>(v: Vec<T>, f: fn(T) -> [u8; N]) -> Vec<u8> {
                    v.into_iter().flat_map(f).collect()
                }
                let bytes = match t.dtype() {
                    DType::F16 => Bytes::Owned(
                        le(flat.to_vec1::<half::f16>()?, half::f16::to_le_bytes),
                        WeightFormat::F16,
                    ),
                    DType::BF16 => Bytes::Owned(
                        le(flat.to_vec1::<half::bf16>()?, half::bf16::to_le_bytes),
                        WeightFormat::BF16,
                    ),
                    _ => Bytes::Owned(
                        le(
                            flat.to_dtype(DType::F32)?.to_vec1::<f32>()?,
                            f32::to_le_bytes,
                        ),
                        WeightFormat::F32,
                    ),
                };
                Lin {
                    bytes,
                    n,
                    k,
                    packed: None,
                }
            }
        })
    }

    fn data<'a>(&'a self, q: &'a QLinear) -> Result<Cow<'a, [u8]>> {
        match (&self.bytes, q) {
            (Bytes::Owned(v, _), _) => Ok(Cow::Borrowed(&v[..])),
            (Bytes::Quantized(_), QLinear::Quantized(w)) => Ok(w.data()?),
            _ => Err(ModelError::Config(
                "fast forward: weight kinds changed".into(),
            )),
        }
    }

    fn format(&self) -> WeightFormat {
        match self.bytes {
            Bytes::Quantized(f) => f,
            Bytes::Owned(_, f) => f,
        }
    }

    /// Rows `[r0, r1)` of this layer for the `t` inputs: on the tiles with
    /// the quantized inputs `q` when packed, else on `w` with the f32
    /// inputs `x`; into `out`.
    #[allow(clippy::too_many_arguments)]
    fn apply(
        &self,
        isa: (Isa, QIsa, usize),
        w: &Weights,
        x: &[f32],
        q: QIn,
        t: usize,
        (r0, r1): (usize, usize),
        deq: &mut Vec<f32>,
        out: &mut Out,
    ) {
        match &self.packed {
            Some(p) => qmatvec_keyed(isa.1, p, q.0, q.1, t, isa.2, r0, r1, &mut |i, r, v| {
                out.put(i, r, v)
            }),
            None => matvec(isa.0, w, x, t, r0, r1, deq, &mut |i, r, v| {
                out.put(i, r, std::slice::from_ref(&v))
            }),
        }
    }
}

/// Where [`Lin::apply`] puts a layer's results: input `i`'s value of row
/// `r` at `i * ld + r - off` of the buffer, stored, added times a scale,
/// or stored times a scale. One type for every call site, so that the f32
/// products (`matvec`, generic over what takes each value) are compiled
/// once here rather than once per call site's closure.
struct Out<'a> {
    dst: Dst<'a>,
    ld: usize,
    off: usize,
    how: How,
}

enum Dst<'a> {
    Own(&'a mut [f32]),
    /// A buffer the step's workers share; each puts only the rows of its
    /// own row range.
    Shared(&'a Shared<f32>),
}

#[derive(Clone, Copy)]
enum How {
    Store,
    Add(f32),
    Scaled(f32),
}

impl<'a> Out<'a> {
    fn own(buf: &'a mut [f32], ld: usize, off: usize) -> Out<'a> {
        Out {
            dst: Dst::Own(buf),
            ld,
            off,
            how: How::Store,
        }
    }

    fn shared(buf: &'a Shared<f32>, ld: usize, how: How) -> Out<'a> {
        Out {
            dst: Dst::Shared(buf),
            ld,
            off: 0,
            how,
        }
    }

    #[inline(always)]
    fn put(&mut self, i: usize, r: usize, v: &[f32]) {
        let at = i * self.ld + r - self.off;
        let dst = match &mut self.dst {
            Dst::Own(buf) => &mut buf[at..at + v.len()],
            // SAFETY: the callers' row ranges are disjoint between workers.
            Dst::Shared(buf) => unsafe { buf.part(at, at + v.len()) },
        };
        match self.how {
            How::Store => dst.copy_from_slice(v),
            How::Add(s) => add_scaled(dst, v, s),
            How::Scaled(s) => dst.iter_mut().zip(v).for_each(|(d, &v)| *d = v * s),
        }
    }
}

struct LayerConsts {
    /// The norms before attention and the FFN (none in OLMo 2).
    attn_norm: Option<Vec<f32>>,
    ffn_norm: Option<Vec<f32>>,
    /// q, k, v biases (Qwen2), concatenated.
    qkv_bias: Option<Vec<f32>>,
    /// Gemma 3, Qwen3: q and k head norms; OLMo 2: q and k norms over
    /// all heads. Gemma 3, OLMo 2: attention and FFN output norms.
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    post_attn: Option<Vec<f32>>,
    post_ffn: Option<Vec<f32>>,
    /// Index of the layer's RoPE table and of its window's plans.
    rope: usize,
    wset: usize,
    lins: [Lin; 7],
}

/// A worker's own buffers.
#[derive(Default)]
struct Local {
    h: Vec<f32>,
    /// Quantized inputs of a small batch (each worker quantizes them all).
    qown: Vec<ActBlock>,
    tmp: Vec<f32>,
    tmp2: Vec<f32>,
    deq: Vec<f32>,
    /// One normed row of an output (post-norms).
    row: Vec<f32>,
    attn: AttnScratch,
    /// Draws all workers have made from each cursor in the forward's
    /// earlier layers and groups (the same for every worker).
    drawn: Vec<usize>,
    /// The linear layers' phases so far in this forward (the same for
    /// every worker).
    phase: u16,
}

/// What the fast path keeps between steps.
pub(crate) struct Fast {
    pool: StepPool,
    isa: Isa,
    qisa: QIsa,
    acts: Activations,
    /// Quantized inputs of a large batch (workers quantize shares).
    qx: Vec<ActBlock>,
    layers: Vec<LayerConsts>,
    norm: Vec<f32>,
    head: Lin,
    locals: Vec<Mutex<Local>>,
    /// One per worker: the draws from its run of each layer's attention
    /// items (back to 0 before each forward).
    cursors: Vec<Cursor>,
    /// One per worker: its run of each linear layer's chunks.
    runs: Vec<Run>,
    x: Vec<f32>,
    q: Vec<f32>,
    a: Vec<f32>,
    m: Vec<f32>,
    /// O and down outputs waiting for their post-norm.
    o: Vec<f32>,
    /// Keys waiting for a norm over all heads (OLMo 2).
    kraw: Vec<f32>,
    /// RoPE tables, one per distinct frequency set.
    cos: Vec<Vec<f32>>,
    sin: Vec<Vec<f32>>,
    states: Vec<f32>,
    logits: Vec<f32>,
    /// The distinct sliding windows of the layers (0: global).
    windows: Vec<usize>,
    /// Per window, the attention plans of the batch's token groups:
    /// `(first, end, plan)`.
    plans: Vec<Vec<(usize, usize, AttnPlan)>>,
}

/// `x += s·y` (`x += y` for `s` = 1, the same bits without the product).
fn add_scaled(x: &mut [f32], y: &[f32], s: f32) {
    if s == 1.0 {
        x.iter_mut().zip(y).for_each(|(x, &y)| *x += y);
    } else {
        x.iter_mut().zip(y).for_each(|(x, &y)| *x += s * y);
    }
}

fn vec_of(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

impl Fast {
    pub(crate) fn new(m: &Llama, threads: usize, acts: Activations) -> Result<Fast> {
        let mut layers = Vec::with_capacity(m.layers.len());
        let mut windows: Vec<usize> = Vec::new();
        let opt = |t: &Option<Tensor>| t.as_ref().map(vec_of).transpose();
        for (i, l) in m.layers.iter().enumerate() {
            let window = m.cfg.layer_window(i).unwrap_or(0);
            let wset = match windows.iter().position(|&w| w == window) {
                Some(w) => w,
                None => {
                    windows.push(window);
                    windows.len() - 1
                }
            };
            let qkv_bias = match (&l.q_bias, &l.k_bias, &l.v_bias) {
                (Some(q), Some(k), Some(v)) => {
                    let mut b = vec_of(q)?;
                    b.extend(vec_of(k)?);
                    b.extend(vec_of(v)?);
                    Some(b)
                }
                _ => None,
            };
            let Some([q, k, v, o, gate, up, down]) = l.linears() else {
                return Err(bad(
                    "the CPU fast path needs the projections unstacked".into()
                ));
            };
            layers.push(LayerConsts {
                attn_norm: opt(&l.attn_norm)?,
                ffn_norm: opt(&l.ffn_norm)?,
                qkv_bias,
                q_norm: opt(&l.q_norm)?,
                k_norm: opt(&l.k_norm)?,
                post_attn: opt(&l.post_attn_norm)?,
                post_ffn: opt(&l.post_ffn_norm)?,
                rope: m.layer_rope[i],
                wset,
                lins: [
                    Lin::new(q)?,
                    Lin::new(k)?,
                    Lin::new(v)?,
                    Lin::new(o)?,
                    Lin::new(gate)?,
                    Lin::new(up)?,
                    Lin::new(down)?,
                ],
            });
        }
        let c = &m.cfg;
        let (nh, kvh, hd) = (c.n_heads, c.n_kv_heads, c.head_dim);
        let want = [
            (nh * hd, c.hidden_size),
            (kvh * hd, c.hidden_size),
            (kvh * hd, c.hidden_size),
            (c.hidden_size, nh * hd),
            (c.intermediate_size, c.hidden_size),
            (c.intermediate_size, c.hidden_size),
            (c.hidden_size, c.intermediate_size),
        ];
        for l in &layers {
            if l.lins
                .iter()
                .zip(&want)
                .any(|(w, &(n, k))| (w.n, w.k) != (n, k))
            {
                return Err(bad("weight shapes do not match the configuration".into()));
            }
        }
        let mut head = Lin::new(&m.lm_head)?;
        if (head.n, head.k) != (c.vocab_size, c.hidden_size) {
            return Err(bad(
                "output head shape does not match the configuration".into()
            ));
        }
        if acts != Activations::F32 {
            let mut lins: Vec<(&mut Lin, &QLinear)> = Vec::new();
            for (lc, l) in layers.iter_mut().zip(&m.layers) {
                let qs = l.linears().expect("checked above");
                lins.extend(lc.lins.iter_mut().zip(qs));
            }
            lins.push((&mut head, &m.lm_head));
            pack(&mut lins)?;
        }
        Ok(Fast {
            pool: StepPool::new(threads),
            isa: Isa::detect(),
            qisa: QIsa::detect(),
            acts,
            qx: Vec::new(),
            layers,
            norm: vec_of(&m.norm)?,
            head,
            locals: (0..threads).map(|_| Mutex::new(Local::default())).collect(),
            cursors: (0..threads).map(|_| Cursor::default()).collect(),
            runs: (0..threads).map(|_| Run::default()).collect(),
            x: Vec::new(),
            q: Vec::new(),
            a: Vec::new(),
            m: Vec::new(),
            o: Vec::new(),
            kraw: Vec::new(),
            cos: vec![Vec::new(); m.inv_freqs.len()],
            sin: vec![Vec::new(); m.inv_freqs.len()],
            states: Vec::new(),
            logits: Vec::new(),
            plans: (0..windows.len()).map(|_| Vec::new()).collect(),
            windows,
        })
    }

    pub(crate) fn threads(&self) -> usize {
        self.pool.threads()
    }

    pub(crate) fn activations(&self) -> Activations {
        self.acts
    }
}

/// The integer path's tiles of every layer whose format has one, in one
/// arena (`Packed::pack_all`).
fn pack(lins: &mut [(&mut Lin, &QLinear)]) -> Result<()> {
    let mut datas = Vec::with_capacity(lins.len());
    for (lin, q) in lins.iter() {
        datas.push(lin.data(q)?);
    }
    let mut ws = Vec::with_capacity(lins.len());
    for ((lin, _), d) in lins.iter().zip(&datas) {
        ws.push(Weights::new(lin.format(), d, lin.n, lin.k)?);
    }
    let packed = Packed::pack_all(&ws);
    for ((lin, _), p) in lins.iter_mut().zip(packed) {
        lin.packed = p;
    }
    Ok(())
}

/// Inputs of at most this many values are quantized by every worker for
/// itself; larger ones in shares, behind a barrier.
const QUANTIZE_ALONE: usize = 4096;

/// Whether [`quantize`] shares a `t`-row, `k`-wide input's rows out among
/// the workers (each its [`Team::share`], behind a barrier) rather than
/// have every worker quantize all of it for itself.
fn quantized_in_shares(t: usize, k: usize) -> bool {
    t * k > QUANTIZE_ALONE
}

/// A layer's quantized inputs, with the key that names them for the
/// products that share them (each worker's own: fresh at each
/// quantization).
#[derive(Clone, Copy)]
struct QIn<'a>(&'a [ActBlock], Option<ActsKey>);

/// The first `t` rows of `src` (each `k` wide) quantized for the integer
/// path, if `wanted`: a small batch into the worker's own buffer, a large
/// one in shares into `shared` (then a barrier). Every worker gets the
/// same values either way, each under a fresh key of its own.
#[allow(clippy::too_many_arguments)]
fn quantize<'a>(
    team: &Team,
    wanted: bool,
    levels: usize,
    src: &[f32],
    t: usize,
    k: usize,
    own: &'a mut Vec<ActBlock>,
    shared: &'a Shared<ActBlock>,
) -> QIn<'a> {
    let nb = k / 32;
    if !wanted {
        return QIn(&[], None);
    }
    if !quantized_in_shares(t, k) {
        grow(own, t * nb);
        for r in 0..t {
            quantize_row(
                &src[r * k..(r + 1) * k],
                levels,
                &mut own[r * nb..(r + 1) * nb],
            );
        }
        return QIn(&own[..t * nb], Some(ActsKey::fresh()));
    }
    let (i0, i1) = team.share(t);
    for r in i0..i1 {
        // SAFETY: each worker writes its own rows; read after the barrier.
        let dst = unsafe { shared.part(r * nb, (r + 1) * nb) };
        quantize_row(&src[r * k..(r + 1) * k], levels, dst);
    }
    team.barrier();
    // SAFETY: written before the barrier, not written again until the
    // next quantization, which every worker reaches after its last read
    // (each phase ends in a barrier).
    QIn(unsafe { &shared.all()[..t * nb] }, Some(ActsKey::fresh()))
}

/// The fewest weight bytes a worker takes at a time while decoding
/// (76 KB: four tiles of a Q4_K matrix 2,048 wide; a matrix 576 wide
/// takes twelve tiles): smaller chunks spend more of their time drawing
/// and starting cold.
const CHUNK_BYTES: usize = 64 << 10;

/// Inputs up to which the linear layers are taken in chunks (more
/// inputs: each worker's whole share at once, so that a prefill's panels
/// sweep one long run of tiles).
const CHUNKED_INPUTS: usize = 8;

/// Units a chunk of [`for_units`] takes for `t` inputs: while decoding
/// (up to [`CHUNKED_INPUTS`]), at least [`CHUNK_BYTES`] of weights
/// (`unit_bytes` a unit); else each worker's whole share. Rows come in
/// whole tiles (`align`, [`GROUP`]); heads one at a time (`align` 1).
/// A static share held the team at every barrier for the slowest worker:
/// the two cores of a shared host stream memory at different rates from
/// moment to moment (AMD EPYC, 1B-class Q4_K_M decode: the engine thread
/// waited at barriers for 18% of its samples). Which worker computes a
/// unit does not change its arithmetic, so results are the same bits.
fn chunk_units(team: &Team, n: usize, t: usize, unit_bytes: usize, align: usize) -> usize {
    if t <= CHUNKED_INPUTS {
        CHUNK_BYTES
            .div_ceil(unit_bytes.max(1))
            .next_multiple_of(align)
    } else {
        n.div_ceil(align).div_ceil(team.threads()) * align
    }
}

/// Rows `0..n` of a linear layer (`row_bytes` each, in all the matrices
/// a chunk's rows are taken from) for `t` inputs, through [`for_units`].
#[allow(clippy::too_many_arguments)]
fn for_rows(
    team: &Team,
    runs: &[Run],
    phase: &mut u16,
    n: usize,
    t: usize,
    row_bytes: usize,
    f: impl FnMut(usize, usize),
) {
    let chunk = chunk_units(team, n, t, row_bytes, GROUP);
    for_units(team, runs, phase, n, chunk, f)
}

/// One worker's run of a phase's chunks, on its own cache line: the
/// phase's number (16 bits), then the next chunk from the front and the
/// end (24 bits each).
#[derive(Default)]
#[repr(align(64))]
struct Run(AtomicU64);

const RUN_BITS: u32 = 24;

fn run_word(phase: u16, front: usize, back: usize) -> u64 {
    (u64::from(phase) << (2 * RUN_BITS)) | ((front as u64) << RUN_BITS) | back as u64
}

fn run_parts(w: u64) -> (u16, usize, usize) {
    let mask = (1u64 << RUN_BITS) - 1;
    (
        (w >> (2 * RUN_BITS)) as u16,
        ((w >> RUN_BITS) & mask) as usize,
        (w & mask) as usize,
    )
}

/// Units `0..n` in chunks of `chunk`, `f(start, end)` per chunk: each
/// worker takes the chunks of its own run (its static share) from the
/// front, in order (its tiles follow on in memory, so the kernels' hints
/// run ahead into its next chunk), then helps with the other runs from
/// their ends, where it does not break their owners' streams. Each phase
/// has its number (`phase`, counted alike by every worker); a run still
/// marked with an earlier phase is set up by whichever worker reaches it
/// first. Phases that use the runs must be separated by barriers.
fn for_units(
    team: &Team,
    runs: &[Run],
    phase: &mut u16,
    n: usize,
    chunk: usize,
    mut f: impl FnMut(usize, usize),
) {
    *phase = phase
        .checked_add(1)
        .expect("fewer than 65,536 phases a forward");
    let p = *phase;
    let nw = team.threads();
    let chunk = chunk.max(1);
    let chunks = n.div_ceil(chunk);
    assert!(chunks < 1 << RUN_BITS, "chunks of a phase fit a run word");
    let fresh = |u: usize| {
        let (c0, c1) = team_split(chunks, nw, u);
        run_word(p, c0, c1)
    };
    let take = |u: usize, from_back: bool| -> Option<usize> {
        let run = &runs[u].0;
        let mut cur = run.load(Ordering::Relaxed);
        loop {
            let (gen, front, back) = run_parts(cur);
            if gen != p {
                let new = fresh(u);
                cur = match run.compare_exchange(cur, new, Ordering::Relaxed, Ordering::Relaxed) {
                    Ok(_) => new,
                    Err(now) => now,
                };
                continue;
            }
            if front >= back {
                return None;
            }
            let (next, c) = if from_back {
                (run_word(p, front, back - 1), back - 1)
            } else {
                (run_word(p, front + 1, back), front)
            };
            match run.compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some(c),
                Err(now) => cur = now,
            }
        }
    };
    let me = team.id();
    for u in (0..nw).map(|k| (me + k) % nw) {
        while let Some(c) = take(u, u != me) {
            f(c * chunk, ((c + 1) * chunk).min(n));
        }
    }
}

fn bad(msg: String) -> ModelError {
    ModelError::Config(format!("forward: {msg}"))
}

/// Checks every index of the batch against the cache before any is used.
fn check_batch(b: &Batch, num_slots: usize, num_blocks: usize) -> Result<usize> {
    let t = b.tokens.len();
    if b.positions.len() != t
        || b.slots.len() != t
        || b.token_seq.len() != t
        || b.rope_positions.is_some_and(|r| r.len() != t)
    {
        return Err(bad(
            "tokens, positions, slots and sequences differ in length".into(),
        ));
    }
    if b.block_size == 0 || b.max_blocks == 0 && t > 0 {
        return Err(bad("empty block tables".into()));
    }
    let seqs = b.block_tables.len().checked_div(b.max_blocks).unwrap_or(0);
    if seqs * b.max_blocks != b.block_tables.len() {
        return Err(bad("block tables are not a whole number of rows".into()));
    }
    if let Some(&s) = b.slots.iter().find(|&&s| s as usize >= num_slots) {
        return Err(bad(format!(
            "slot {s} outside the cache of {num_slots} slots"
        )));
    }
    if let Some(&id) = b.block_tables.iter().find(|&&id| id as usize >= num_blocks) {
        return Err(bad(format!(
            "block {id} outside the cache of {num_blocks} blocks"
        )));
    }
    for i in 0..t {
        let s = b.token_seq[i] as usize;
        if s >= seqs {
            return Err(bad(format!("token {i} belongs to sequence {s} of {seqs}")));
        }
        if b.positions[i] as usize / b.block_size >= b.max_blocks {
            return Err(bad(format!(
                "position {} past the block table",
                b.positions[i]
            )));
        }
        if i > 0
            && b.token_seq[i] != b.token_seq[i - 1]
            && b.token_seq[..i].contains(&b.token_seq[i])
        {
            return Err(bad("tokens of a sequence must be consecutive".into()));
        }
    }
    if let Some(&p) = b.logits_for.iter().find(|&&p| p as usize >= t) {
        return Err(bad(format!("logits wanted for token {p} of {t}")));
    }
    Ok(seqs)
}

/// Checks the sliding-window layers' own slots and tables: every slot in
/// their pool of `num_blocks`, and every block a token's `window` reads
/// there (entries before it are never read).
fn check_sliding(b: &Batch, num_blocks: usize, window: usize) -> Result<()> {
    let Some(s) = b.sliding else { return Ok(()) };
    let t = b.tokens.len();
    if s.slots.len() != t || s.block_tables.len() != b.block_tables.len() {
        return Err(bad(
            "the sliding layers' slots or tables differ in size from the batch".into(),
        ));
    }
    let num_slots = num_blocks * b.block_size;
    if let Some(&x) = s.slots.iter().find(|&&x| x as usize >= num_slots) {
        return Err(bad(format!(
            "sliding slot {x} outside the sliding pool of {num_slots} slots"
        )));
    }
    for i in 0..t {
        let (seq, pos) = (b.token_seq[i] as usize, b.positions[i] as usize);
        let row = &s.block_tables[seq * b.max_blocks..(seq + 1) * b.max_blocks];
        let first = tessera_kernels::window_start(pos, window) / b.block_size;
        if let Some(j) = (first..=pos / b.block_size).find(|&j| row[j] as usize >= num_blocks) {
            return Err(bad(format!(
                "token {i} at position {pos} reads block {j} of its window, which the sliding pool does not hold"
            )));
        }
    }
    Ok(())
}

/// `h[j] = rms_norm(x[row_j])` for the rows `rows` of `x` (`hidden` wide).
fn norm_rows(
    isa: Isa,
    x: &[f32],
    rows: impl Iterator<Item = usize>,
    w: &[f32],
    eps: f32,
    h: &mut [f32],
) {
    let hidden = w.len();
    for (j, r) in rows.enumerate() {
        rms_norm(
            isa,
            &x[r * hidden..(r + 1) * hidden],
            w,
            eps,
            &mut h[j * hidden..(j + 1) * hidden],
        );
    }
}

/// `h = rmsnorm(x)`, or `h = x` in a block without pre-norms, for the
/// `rows` of `x` (`hidden` wide) into the same rows of `h`.
fn pre_norm(
    isa: Isa,
    x: &[f32],
    (hidden, rows): (usize, Range<usize>),
    w: &Option<Vec<f32>>,
    eps: f32,
    h: &mut [f32],
) {
    let (a, b) = (rows.start * hidden, rows.end * hidden);
    match w {
        Some(w) => norm_rows(isa, x, rows, w, eps, &mut h[a..b]),
        None => h[a..b].copy_from_slice(&x[a..b]),
    }
}

/// The rows of a layer's normed input (`t` rows, `k` wide) that a worker
/// reads in f32: only those it quantizes when every linear that takes the
/// input reads it quantized and [`quantize`] shares the rows out (the
/// products then read every row quantized), else all of them.
fn f32_rows(team: &Team, all_packed: bool, t: usize, k: usize) -> Range<usize> {
    if all_packed && quantized_in_shares(t, k) {
        let (i0, i1) = team.share(t);
        i0..i1
    } else {
        0..t
    }
}

fn grow<T: Clone + Default>(v: &mut Vec<T>, n: usize) {
    if v.len() < n {
        v.resize(n, T::default());
    }
}

impl Llama {
    /// The fast forward; `fast` is this model's state.
    pub(crate) fn forward_fast(
        &self,
        fast: &mut Fast,
        batch: &Batch,
        cache: &[LayerKv],
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (nh, kvh, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
        let (hidden, ffn, vocab) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let t = batch.tokens.len();
        let picks = batch.logits_for.len();
        if cache.len() != self.layers.len() {
            return Err(bad(format!(
                "{} cache layers for {} model layers",
                cache.len(),
                self.layers.len()
            )));
        }
        let mut raw = Vec::with_capacity(cache.len());
        for l in cache {
            raw.push((cache_raw(&l.k)?, cache_raw(&l.v)?));
        }
        let (_, bs, ckvh, chd) = cache
            .first()
            .map(|l| cache_geometry(&l.k))
            .transpose()?
            .unwrap_or((0, batch.block_size, kvh, hd));
        if (ckvh, chd) != (kvh, hd) || bs != batch.block_size {
            return Err(bad("cache geometry does not match the model".into()));
        }
        // Sliding-window layers may have a pool of their own.
        let mut pools = [usize::MAX; 2];
        for (lc, c) in fast.layers.iter().zip(cache) {
            let own = usize::from(fast.windows[lc.wset] > 0 && batch.sliding.is_some());
            pools[own] = pools[own].min(c.k.dim(0)?);
        }
        // (No layer of the global pool: its indices go unused.)
        let global = pools[0]
            .checked_mul(bs)
            .map_or((usize::MAX, usize::MAX), |s| (s, pools[0]));
        check_batch(batch, global.0, global.1)?;
        if pools[1] != usize::MAX {
            let widest = fast.windows.iter().copied().max().unwrap_or(0);
            check_sliding(batch, pools[1], widest)?;
        }
        if let Some(&tok) = batch.tokens.iter().find(|&&x| x as usize >= vocab) {
            return Err(bad(format!(
                "token id {tok} outside the vocabulary of {vocab}"
            )));
        }
        if t == 0 {
            return Ok(Tensor::zeros(
                (0, vocab),
                candle_core::DType::F32,
                &self.device,
            )?);
        }

        // Buffers of this step's size.
        let half = hd / 2;
        let post = cfg.block.post_norms;
        grow(&mut fast.x, t * hidden);
        grow(&mut fast.q, t * nh * hd);
        grow(&mut fast.a, t * nh * hd);
        grow(&mut fast.m, t * ffn);
        if post {
            grow(&mut fast.o, t * hidden);
        }
        let whole = cfg.block.qk_norm && cfg.block.qk_norm_whole;
        if whole {
            grow(&mut fast.kraw, t * kvh * hd);
        }
        let scale = self.cfg.rope_scale();
        for ((c, s), f) in fast.cos.iter_mut().zip(&mut fast.sin).zip(&self.inv_freqs) {
            grow(c, t * half);
            grow(s, t * half);
            rope_angles(
                f,
                scale,
                batch.rope(),
                &mut c[..t * half],
                &mut s[..t * half],
            );
        }
        grow(&mut fast.logits, picks * vocab);
        let levels = fast.acts.levels();
        if levels > 0 {
            let widest = hidden.max(ffn).max(nh * hd);
            grow(&mut fast.qx, t.max(picks) * widest / 32);
        }
        let shape = AttnShape {
            scale: cfg.attention_scale(),
            ..AttnShape::new(nh, kvh, hd, bs)
        };
        let shapes: Vec<AttnShape> = fast.windows.iter().map(|&w| shape.with_window(w)).collect();
        // Tokens in groups whose partial states fit the budget (a long
        // prefill deep in a context would otherwise hold one state per
        // token, head and 128 positions of context at once); the groups
        // change only how many states live together, not the arithmetic.
        let budget = self
            .attention_budget
            .load(std::sync::atomic::Ordering::Relaxed);
        // Global layers' states bound every layer's.
        let per_token = |p: u32| shape.chunks(p as usize).1 * nh * shape.record();
        let mut groups = Vec::new();
        let (mut a, mut used) = (0, 0);
        for (i, &p) in batch.positions.iter().enumerate() {
            if i > a && used + per_token(p) > budget {
                groups.push((a, i));
                (a, used) = (i, 0);
            }
            used += per_token(p);
        }
        groups.push((a, t));
        let mut most = 0;
        for (plans, sh) in fast.plans.iter_mut().zip(&shapes) {
            plans.resize_with(groups.len(), || (0, 0, AttnPlan::default()));
            for (slot, &(a, b)) in plans.iter_mut().zip(&groups) {
                slot.2
                    .build(sh, &batch.token_seq[a..b], &batch.positions[a..b]);
                (slot.0, slot.1) = (a, b);
                most = most.max(slot.2.states);
            }
        }
        grow(&mut fast.states, most * shape.record());
        self.embed_into(batch.tokens, &mut fast.x[..t * hidden])?;

        // Weight bytes for this step.
        let mut datas: Vec<[Cow<[u8]>; 7]> = Vec::with_capacity(self.layers.len());
        for (lc, l) in fast.layers.iter().zip(&self.layers) {
            let Some(qs) = l.linears() else {
                return Err(bad(
                    "the CPU fast path needs the projections unstacked".into()
                ));
            };
            datas.push([
                lc.lins[0].data(qs[0])?,
                lc.lins[1].data(qs[1])?,
                lc.lins[2].data(qs[2])?,
                lc.lins[3].data(qs[3])?,
                lc.lins[4].data(qs[4])?,
                lc.lins[5].data(qs[5])?,
                lc.lins[6].data(qs[6])?,
            ]);
        }
        let mut weights: Vec<[Weights; 7]> = Vec::with_capacity(datas.len());
        for (lc, d) in fast.layers.iter().zip(&datas) {
            let w = |i: usize| Weights::new(lc.lins[i].format(), &d[i], lc.lins[i].n, lc.lins[i].k);
            weights.push([w(0)?, w(1)?, w(2)?, w(3)?, w(4)?, w(5)?, w(6)?]);
        }
        let head_data = fast.head.data(&self.lm_head)?;
        let head = Weights::new(fast.head.format(), &head_data, fast.head.n, fast.head.k)?;
        let isa = (fast.isa, fast.qisa, levels);
        let eps = cfg.rms_eps as f32;
        let style = cfg.rope_style;
        let x = Shared::new(&mut fast.x[..t * hidden]);
        let q = Shared::new(&mut fast.q[..t * nh * hd]);
        let a = Shared::new(&mut fast.a[..t * nh * hd]);
        let m = Shared::new(&mut fast.m[..t * ffn]);
        let ob = Shared::new(&mut fast.o[..if post { t * hidden } else { 0 }]);
        let kraw = Shared::new(&mut fast.kraw[..if whole { t * kvh * hd } else { 0 }]);
        let act = cfg.block.activation;
        // Granite's residual scale, and the reciprocal its logits are
        // multiplied by (1 elsewhere: no product is taken then).
        let rs = cfg.block.residual_scale;
        let inv_logit = 1.0 / cfg.block.logit_scale;
        let states = Shared::new(&mut fast.states[..]);
        let logits = Shared::new(&mut fast.logits[..picks * vocab]);
        let qx = Shared::new(&mut fast.qx[..]);
        let packed = |l: &LayerConsts, i: &[usize]| i.iter().any(|&i| l.lins[i].packed.is_some());
        let all_packed =
            |l: &LayerConsts, i: &[usize]| i.iter().all(|&i| l.lins[i].packed.is_some());
        let (cos, sin) = (&fast.cos, &fast.sin);
        let plans = &fast.plans;
        let ngroups = groups.len();
        let layers = &fast.layers;
        let locals = &fast.locals;
        let norm = &fast.norm;
        let head_lin = &fast.head;
        let rec = shape.record();
        let cursors = &fast.cursors;
        for c in cursors {
            c.0.store(0, Ordering::Relaxed);
        }
        let runs = &fast.runs;
        for r in runs {
            r.0.store(0, Ordering::Relaxed);
        }
        let units = nh + 2 * kvh;

        let timing = crate::phases::CLOCK.timing(batch.token_seq);
        let body = |team: &Team| {
            let mut local = locals[team.id()].lock().unwrap_or_else(|e| e.into_inner());
            let Local {
                h,
                qown,
                tmp,
                tmp2,
                deq,
                row: nrow,
                attn,
                drawn,
                phase,
            } = &mut *local;
            grow(h, t * hidden);
            grow(tmp, t * hd.max(FFN_ROWS));
            grow(tmp2, t * FFN_ROWS);
            drawn.clear();
            drawn.resize(cursors.len(), 0);
            *phase = 0;
            let mut laps = crate::phases::Laps::new(timing && team.id() == 0);
            let bytes = |w: &[Weights]| w.iter().map(|w| w.data.len()).sum::<usize>();
            // x += y·Wᵀ (linear `which` of the layer, this worker's rows of
            // it) for the inputs `y` (f32, and quantized when packed); with
            // a post-norm, y·Wᵀ goes to `ob` first, and after a barrier
            // each worker adds the normed rows of its share of tokens.
            let residual = |lc: &LayerConsts,
                            w: &[Weights; 7],
                            which: usize,
                            (y, qy): (&[f32], QIn),
                            post: &Option<Vec<f32>>,
                            deq: &mut Vec<f32>,
                            row: &mut Vec<f32>,
                            phase: &mut u16| {
                let lin = &lc.lins[which];
                let to_ob = post.is_some();
                let rb = w[which].row_bytes();
                for_rows(team, runs, phase, hidden, t, rb, |r0, r1| {
                    let mut out = if to_ob {
                        Out::shared(&ob, hidden, How::Store)
                    } else {
                        Out::shared(&x, hidden, How::Add(rs))
                    };
                    lin.apply(isa, &w[which], y, qy, t, (r0, r1), deq, &mut out)
                });
                let Some(pn) = post else {
                    return;
                };
                team.barrier();
                let (i0, i1) = team.share(t);
                for i in i0..i1 {
                    // SAFETY: rows i0..i1 are this worker's alone here.
                    let o = unsafe { ob.part(i * hidden, (i + 1) * hidden) };
                    rms_norm_in_place(isa.0, o, pn, eps, row);
                    let xr = unsafe { x.part(i * hidden, (i + 1) * hidden) };
                    add_scaled(xr, o, rs);
                }
            };
            for (l, (lc, w)) in layers.iter().zip(&weights).enumerate() {
                let (ck, cv) = raw[l];
                let rotated = matches!(ck, CacheRaw::Q8_0(..) | CacheRaw::Q4_0(..));
                let (cos, sin) = (&cos[lc.rope][..t * half], &sin[lc.rope][..t * half]);
                let sh = shapes[lc.wset];
                let (slots, tables) = batch.pool_for(sh.window);
                // SAFETY (all `Shared` accesses below): each phase writes
                // disjoint ranges (split by worker or by item), and phases
                // that read what another wrote are separated by barriers.
                let span = (
                    hidden,
                    f32_rows(team, all_packed(lc, &[0, 1, 2]), t, hidden),
                );
                pre_norm(isa.0, unsafe { x.all() }, span, &lc.attn_norm, eps, h);
                let qh = quantize(
                    team,
                    packed(lc, &[0, 1, 2]),
                    levels,
                    h,
                    t,
                    hidden,
                    qown,
                    &qx,
                );
                // A q, k or v head row of token i, normed: RoPE, then to
                // the query buffer (rotated against a quantized cache's
                // keys; `in_q`: the row is already its place there) or the
                // cache slot.
                let finish = |which: usize, head: usize, i: usize, row: &mut [f32], in_q: bool| {
                    if which < 2 {
                        rotate_pairs(
                            style,
                            row,
                            &cos[i * half..(i + 1) * half],
                            &sin[i * half..(i + 1) * half],
                        );
                    }
                    let slot = slots[i] as usize;
                    match which {
                        0 => unsafe {
                            if rotated {
                                hadamard64(row);
                            }
                            if !in_q {
                                let at = (i * nh + head) * hd;
                                q.part(at, at + hd).copy_from_slice(row);
                            }
                        },
                        1 => unsafe { ck.store_row((slot * kvh + head) * hd, row) },
                        _ => unsafe { cv.store_row((slot * kvh + head) * hd, row) },
                    }
                };
                let chunk = chunk_units(team, units, t, hd * w[0].row_bytes(), 1);
                for_units(team, runs, phase, units, chunk, |u0, u1| {
                    for u in u0..u1 {
                        let (which, head) = if u < nh {
                            (0, u)
                        } else if u < nh + kvh {
                            (1, u - nh)
                        } else {
                            (2, u - nh - kvh)
                        };
                        let r0 = head * hd;
                        let lin = &lc.lins[which];
                        lin.apply(
                            isa,
                            &w[which],
                            h,
                            qh,
                            t,
                            (r0, r0 + hd),
                            deq,
                            &mut Out::own(&mut tmp[..], hd, r0),
                        );
                        let bias_at = [0, nh * hd, (nh + kvh) * hd][which] + r0;
                        for i in 0..t {
                            let row = &mut tmp[i * hd..(i + 1) * hd];
                            if let Some(b) = &lc.qkv_bias {
                                for (v, &bb) in row.iter_mut().zip(&b[bias_at..bias_at + hd]) {
                                    *v += bb;
                                }
                            }
                            if whole && which < 2 {
                                // Normed over all heads below, once every
                                // head of the token is here.
                                let (buf, n) = if which == 0 { (&q, nh) } else { (&kraw, kvh) };
                                unsafe { buf.part((i * n + head) * hd, (i * n + head + 1) * hd) }
                                    .copy_from_slice(row);
                                continue;
                            }
                            if !whole {
                                let head_norm = [&lc.q_norm, &lc.k_norm, &None][which];
                                if let Some(wn) = head_norm {
                                    rms_norm_in_place(isa.0, row, wn, eps, nrow);
                                }
                            }
                            finish(which, head, i, row, false);
                        }
                    }
                });
                if whole {
                    // OLMo 2: each token's q and k normed whole, then
                    // rotated and stored head by head.
                    team.barrier();
                    let (i0, i1) = team.share(t);
                    for i in i0..i1 {
                        for (which, buf, n) in [(0, &q, nh), (1, &kraw, kvh)] {
                            // SAFETY: token i's rows are this worker's alone.
                            let all = unsafe { buf.part(i * n * hd, (i + 1) * n * hd) };
                            if let Some(wn) = [&lc.q_norm, &lc.k_norm][which] {
                                rms_norm_in_place(isa.0, all, wn, eps, nrow);
                            }
                            for (head, row) in all.chunks_exact_mut(hd).enumerate() {
                                finish(which, head, i, row, which == 0);
                            }
                        }
                    }
                }
                team.barrier();
                laps.lap(Part::Qkv, bytes(&w[..3]));
                for (g0, g1, plan) in &plans[lc.wset][..ngroups] {
                    let (g0, g1) = (*g0, *g1);
                    let chunks = |i: usize| sh.chunks(batch.positions[g0 + i] as usize).1;
                    let input = AttnInput {
                        shape: sh,
                        q: unsafe { &q.all()[g0 * nh * hd..g1 * nh * hd] },
                        positions: &batch.positions[g0..g1],
                        token_seq: &batch.token_seq[g0..g1],
                        block_tables: tables,
                        max_blocks: batch.max_blocks,
                        k: unsafe { ck.rows() },
                        v: unsafe { cv.rows() },
                    };
                    // Each worker takes the items of its own run of the
                    // plan in order (consecutive chunks of a sequence,
                    // whose rows follow on in the cache, so an item's last
                    // hints serve the worker's next item), then helps with
                    // the others' runs. Items from one shared counter went
                    // to the workers in turn, and each item started cold
                    // (AMD EPYC, decode after 2,048 tokens: attention
                    // 1.75–2.01 → 1.61–1.78 ms a step). Cursors never go
                    // back: every worker draws from each run until one
                    // draw past its end, so each group moves run u's cursor
                    // on by `len_u + workers`.
                    let nw = team.threads();
                    let run = |u: usize| team_split(plan.items.len(), nw, u);
                    for u in (0..nw).map(|k| (team.id() + k) % nw) {
                        let (r0, r1) = run(u);
                        loop {
                            let i = r0 + cursors[u].0.fetch_add(1, Ordering::Relaxed) - drawn[u];
                            if i >= r1 {
                                break;
                            }
                            let item = plan.items[i];
                            attend_item(isa.0, &input, item, attn, &mut |tok, idx, r| {
                                if chunks(tok) > 1 {
                                    let at = (plan.base[tok] + idx) * rec;
                                    unsafe { states.part(at, at + rec).copy_from_slice(r) };
                                    return;
                                }
                                // A token's only state is its output (the
                                // merge of one state, computed here).
                                let at = ((g0 + tok) * nh + idx) * hd;
                                let out = unsafe { a.part(at, at + hd) };
                                merge(r, 1, rec, hd, out);
                                if rotated {
                                    hadamard64(out);
                                }
                            });
                        }
                    }
                    for (u, d) in drawn.iter_mut().enumerate() {
                        let (r0, r1) = run(u);
                        *d += r1 - r0 + nw;
                    }
                    team.barrier();
                    if (0..g1 - g0).all(|i| chunks(i) == 1) {
                        continue;
                    }
                    let (p0, p1) = team.share((g1 - g0) * nh);
                    for p in p0..p1 {
                        let (i, head) = (p / nh, p % nh);
                        if chunks(i) == 1 {
                            continue;
                        }
                        let st = unsafe { states.all() };
                        let first = (plan.base[i] + head) * rec;
                        let at = (g0 * nh + p) * hd;
                        let out = unsafe { a.part(at, at + hd) };
                        merge(&st[first..], chunks(i), nh * rec, hd, out);
                        if rotated {
                            hadamard64(out);
                        }
                    }
                    team.barrier();
                }
                laps.lap(Part::Attention, 0);
                let av = unsafe { a.all() };
                let qa = quantize(team, packed(lc, &[3]), levels, av, t, nh * hd, qown, &qx);
                residual(lc, w, 3, (av, qa), &lc.post_attn, deq, nrow, phase);
                team.barrier();
                laps.lap(Part::Output, bytes(&w[3..4]));
                let span = (hidden, f32_rows(team, all_packed(lc, &[4, 5]), t, hidden));
                pre_norm(isa.0, unsafe { x.all() }, span, &lc.ffn_norm, eps, h);
                let qh = quantize(team, packed(lc, &[4, 5]), levels, h, t, hidden, qown, &qx);
                for_rows(
                    team,
                    runs,
                    phase,
                    ffn,
                    t,
                    w[4].row_bytes() + w[5].row_bytes(),
                    |f0, f1| {
                        let mut r = f0;
                        while r < f1 {
                            let e = (r + FFN_ROWS).min(f1);
                            let n = e - r;
                            let mut out = Out::own(&mut tmp[..], n, r);
                            lc.lins[4].apply(isa, &w[4], h, qh, t, (r, e), deq, &mut out);
                            let mut out = Out::own(&mut tmp2[..], n, r);
                            lc.lins[5].apply(isa, &w[5], h, qh, t, (r, e), deq, &mut out);
                            for i in 0..t {
                                let out = unsafe { m.part(i * ffn + r, i * ffn + e) };
                                let row = i * n..(i + 1) * n;
                                act_mul(isa.0, act, &tmp[row.clone()], &tmp2[row], out);
                            }
                            r = e;
                        }
                    },
                );
                team.barrier();
                laps.lap(Part::GateUp, bytes(&w[4..6]));
                let mv = unsafe { m.all() };
                let qm = quantize(team, packed(lc, &[6]), levels, mv, t, ffn, qown, &qx);
                residual(lc, w, 6, (mv, qm), &lc.post_ffn, deq, nrow, phase);
                team.barrier();
                laps.lap(Part::Down, bytes(&w[6..7]));
            }
            if picks > 0 {
                let rows = batch.logits_for.iter().map(|&p| p as usize);
                norm_rows(isa.0, unsafe { x.all() }, rows, norm, eps, h);
                let wanted = head_lin.packed.is_some();
                let qh = quantize(team, wanted, levels, h, picks, hidden, qown, &qx);
                for_rows(
                    team,
                    runs,
                    phase,
                    vocab,
                    picks,
                    head.row_bytes(),
                    |r0, r1| {
                        let how = if inv_logit != 1.0 {
                            How::Scaled(inv_logit)
                        } else {
                            How::Store
                        };
                        let mut out = Out::shared(&logits, vocab, how);
                        head_lin.apply(isa, &head, h, qh, picks, (r0, r1), deq, &mut out)
                    },
                );
                laps.lap(Part::Head, head.data.len());
            }
        };
        let start = timing.then(std::time::Instant::now);
        fast.pool.run(&body);
        if let Some(at) = start {
            crate::phases::CLOCK.add_step(at.elapsed().as_nanos() as u64);
        }
        let out = fast.logits[..picks * vocab].to_vec();
        Ok(Tensor::from_vec(out, (picks, vocab), &self.device)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every unit of every phase runs exactly once, in chunks that start
    /// on a multiple of the chunk, whatever the team and however the
    /// workers race (more workers than cores: they are taken off the CPU
    /// mid-phase, and the others finish their runs).
    #[test]
    fn every_unit_of_every_phase_runs_once() {
        let cases = [
            (0, 1),
            (1, 1),
            (37, 4),
            (64, 64),
            (1000, 16),
            (5, 100),
            (4099, 3),
        ];
        for workers in 1..=5 {
            let pool = StepPool::with_policy(workers, true);
            let runs: Vec<Run> = (0..workers).map(|_| Run::default()).collect();
            let counts: Vec<Vec<AtomicUsize>> = cases
                .iter()
                .map(|&(n, _)| (0..n).map(|_| AtomicUsize::new(0)).collect())
                .collect();
            let rounds = 20;
            pool.run(&|team| {
                let mut phase = 0u16;
                for _ in 0..rounds {
                    for (case, &(n, chunk)) in cases.iter().enumerate() {
                        for_units(team, &runs, &mut phase, n, chunk, |a, b| {
                            assert!(a % chunk == 0 && a < b && b <= n, "{a}..{b} of {n}");
                            for u in a..b {
                                counts[case][u].fetch_add(1, Ordering::Relaxed);
                            }
                        });
                        team.barrier();
                    }
                }
            });
            for (case, c) in counts.iter().enumerate() {
                for (u, k) in c.iter().enumerate() {
                    let k = k.load(Ordering::Relaxed);
                    assert_eq!(k, rounds, "{workers} workers, case {case}, unit {u}");
                }
            }
        }
    }

    #[test]
    fn run_words_round_trip() {
        for (p, f, b) in [
            (1, 0, 0),
            (65_535, (1 << RUN_BITS) - 1, 7),
            (300, 12, (1 << RUN_BITS) - 1),
        ] {
            assert_eq!(run_parts(run_word(p, f, b)), (p, f, b));
        }
    }
}
