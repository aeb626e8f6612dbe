//! Criterion benches of the KV bookkeeping that runs on every forward step:
//! prefix matching and insertion on a tree of ~1,000,000 cached tokens in
//! 10,000 branches, the request life cycle at a full pool (eviction
//! included), allocate/free, decode-style appends, and `plan_defrag` on a
//! full pool of 65,536 blocks; and the paged-attention kernel on
//! SmolLM2-135M's geometry (one layer), for a prefill chunk and a decode
//! step over a 2,048-token context; the quantized linear layers (GB/s of
//! weights) beside the machine's rooflines (reads on one and on two
//! threads, f32 fused multiply-adds on one).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use tessera_kv::{BlockPool, KvCache, KvConfig, Namespace, SeqId, TokenId};

const NS: Namespace = Namespace(1);
const GROUPS: usize = 100;
const BRANCHES: usize = 10_000;
const SHARED: usize = 100;
const OWN: usize = 100;

/// Deterministic token stream (xorshift), vocabulary of SmolLM2's size.
struct Rng(u64);
impl Rng {
    fn token(&mut self) -> TokenId {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        TokenId((self.0 % 49_152) as u32)
    }
    fn tokens(&mut self, n: usize) -> Vec<TokenId> {
        (0..n).map(|_| self.token()).collect()
    }
}

/// Runs one request the way the engine does: reuse, append, compute,
/// insert, free.
fn serve(kv: &mut KvCache, tokens: &[TokenId]) {
    let (seq, cached) = kv.add_sequence(NS, &tokens[..tokens.len() - 1]);
    let plan = kv.append(seq, &tokens[cached..]).unwrap();
    assert!(plan.is_ok(), "pool sized for the benchmark");
    kv.mark_computed(seq, tokens.len()).unwrap();
    kv.insert_sequence(seq).unwrap();
    kv.free_sequence(seq).unwrap();
}

/// 100 groups of a 100-token shared prefix, 100 branches each with 100
/// tokens of their own: 1,010,000 distinct cached tokens.
fn big_tree(num_blocks: usize) -> (KvCache, Vec<Vec<TokenId>>, Vec<Vec<TokenId>>) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut kv = KvCache::new(KvConfig {
        num_blocks,
        block_size: 16,
        sliding: None,
    })
    .unwrap();
    let prefixes: Vec<_> = (0..GROUPS).map(|_| rng.tokens(SHARED)).collect();
    let mut requests = Vec::with_capacity(BRANCHES);
    for i in 0..BRANCHES {
        let mut t = prefixes[i % GROUPS].clone();
        t.extend(rng.tokens(OWN));
        serve(&mut kv, &t);
        requests.push(t);
    }
    (kv, prefixes, requests)
}

fn bench_tree(c: &mut Criterion) {
    let (mut kv, prefixes, requests) = big_tree(80_000);
    let mut rng = Rng(42);
    eprintln!(
        "tree: {} cached tokens, {} nodes, {} blocks live",
        kv.tree().cached_tokens(),
        kv.tree().num_nodes(),
        kv.pool().num_live()
    );
    let mut g = c.benchmark_group("prefix_tree_1M_tokens");
    let mut i = 0;
    g.bench_function("match_prefix_hit_200_tokens", |b| {
        b.iter(|| {
            i = (i + 7919) % BRANCHES;
            let m = kv.match_prefix(NS, black_box(&requests[i]));
            assert_eq!(m.len, SHARED + OWN);
        })
    });
    let miss = rng.tokens(200);
    g.bench_function("match_prefix_miss", |b| {
        b.iter(|| kv.match_prefix(NS, black_box(&miss)))
    });
    // A new request: a known 100-token prefix plus 150 new tokens.
    let fresh = |rng: &mut Rng, k: usize| {
        let mut t = prefixes[k % GROUPS].clone();
        t.extend(rng.tokens(150));
        t
    };
    let mut k = 0;
    g.bench_function("insert_250_token_request", |b| {
        // Only the insert is timed; admitting and freeing the request is not.
        b.iter_custom(|iters| {
            let mut spent = std::time::Duration::ZERO;
            for _ in 0..iters {
                k += 1;
                let t = fresh(&mut rng, k);
                let (seq, cached) = kv.add_sequence(NS, &t[..t.len() - 1]);
                assert!(kv.append(seq, &t[cached..]).unwrap().is_ok());
                kv.mark_computed(seq, t.len()).unwrap();
                let start = std::time::Instant::now();
                black_box(kv.insert_sequence(seq).unwrap());
                spent += start.elapsed();
                kv.free_sequence(seq).unwrap();
            }
            spent
        })
    });
    // Whole life cycle at a full pool: every request evicts LRU content.
    g.bench_function("request_lifecycle_full_pool", |b| {
        b.iter(|| {
            k += 1;
            let t = fresh(&mut rng, k);
            serve(&mut kv, black_box(&t));
        })
    });
    g.finish();
    eprintln!(
        "after: {} evicted blocks, {} cached tokens",
        kv.stats().evicted_blocks,
        kv.tree().cached_tokens()
    );
    kv.check_invariants().unwrap();
}

fn bench_pool(c: &mut Criterion) {
    let mut g = c.benchmark_group("pool");
    let mut pool = BlockPool::new(65_536, 16).unwrap();
    g.bench_function("allocate_release", |b| {
        b.iter(|| {
            let blk = pool.allocate().unwrap();
            pool.release(black_box(blk)).unwrap()
        })
    });
    let mut kv = KvCache::new(KvConfig {
        num_blocks: 65_536,
        block_size: 16,
        sliding: None,
    })
    .unwrap();
    let one = [TokenId(7)];
    g.throughput(Throughput::Elements(1024));
    g.bench_function("decode_append_1024_tokens", |b| {
        b.iter(|| {
            let (seq, _) = kv.add_sequence(NS, &[]);
            for p in 0..1024 {
                assert!(kv.append(seq, black_box(&one)).unwrap().is_ok());
                kv.mark_computed(seq, p + 1).unwrap();
            }
            kv.free_sequence(seq).unwrap();
        })
    });
    g.finish();
}

fn bench_defrag(c: &mut Criterion) {
    // A full pool of 65,536 blocks, then every other sequence freed: half the
    // live blocks sit above the compact range and must move.
    let mut kv = KvCache::new(KvConfig {
        num_blocks: 65_536,
        block_size: 16,
        sliding: None,
    })
    .unwrap();
    let mut rng = Rng(7);
    let seqs: Vec<SeqId> = (0..4096)
        .map(|_| {
            let (s, _) = kv.add_sequence(NS, &[]);
            assert!(kv.append(s, &rng.tokens(256)).unwrap().is_ok());
            kv.mark_computed(s, 256).unwrap();
            s
        })
        .collect();
    assert_eq!(kv.pool().num_free(), 0);
    for s in seqs.iter().step_by(2) {
        kv.free_sequence(*s).unwrap();
    }
    let mut g = c.benchmark_group("defrag");
    g.bench_function("plan_defrag_65536_blocks_half_live", |b| {
        b.iter_batched(
            || kv.clone(),
            |mut k| {
                let plan = k.plan_defrag();
                assert_eq!(plan.moves.len(), 16_384);
                plan
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

/// One layer of SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64,
/// f16 cache, blocks of 16) over a 2,048-token context.
fn bench_attention(c: &mut Criterion) {
    use candle_core::DType;
    use tessera_kernels::{paged_attention, PagedMeta};
    let (ctx, bs, nh, kvh, hd) = (2048usize, 16usize, 9usize, 3usize, 64usize);
    let blocks = ctx / bs;
    let seeded = |shape: &[usize], seed: u64, dtype: DType| {
        tessera_kernels::testing::seeded(shape, seed, dtype).unwrap()
    };
    let k = seeded(&[blocks, bs, kvh, hd], 1, DType::F16);
    let v = seeded(&[blocks, bs, kvh, hd], 2, DType::F16);
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let mut g = c.benchmark_group("paged_attention_smollm2_layer");
    for (name, new) in [("prefill_128_at_2048", 128usize), ("decode_1_at_2048", 1)] {
        let q = seeded(&[new, nh, hd], 3, DType::F32);
        let pos: Vec<u32> = (ctx - new..ctx).map(|p| p as u32).collect();
        let seq = vec![0u32; new];
        let meta = PagedMeta {
            block_size: bs,
            block_tables: &table,
            max_blocks: blocks,
            token_seq: &seq,
            token_pos: &pos,
            scale: 0.125,
            window: 0,
        };
        g.throughput(Throughput::Elements(new as u64));
        g.bench_function(name, |b| {
            b.iter(|| black_box(paged_attention(&q, &k, &v, &meta).unwrap()))
        });
    }
    g.finish();

    // The fast forward's attention (items over chunks, then the merge), one
    // thread, one decoding query: GB/s of the f16 K and V it reads.
    use tessera_kernels::{attend_item, merge, AttnInput, AttnPlan, AttnScratch, AttnShape, Isa};
    use tessera_kernels::{KvRows, CHUNK};
    let bits = |x: &candle_core::Tensor| -> Vec<u16> {
        let v = x.flatten_all().unwrap().to_vec1::<half::f16>().unwrap();
        v.iter().map(|h| h.to_bits()).collect()
    };
    let (kb, vb) = (bits(&k), bits(&v));
    // One decoding query over `layers` layers: its multiply-adds (q·k and
    // p·v for every query head and key) and the f16 K and V bytes it reads.
    let decode_work = |layers: usize| Throughput::ElementsAndBytes {
        elements: (layers * ctx * nh * hd * 2) as u64,
        bytes: (layers * ctx * kvh * hd * 2 * 2) as u64,
    };
    let mut g = c.benchmark_group("attend_smollm2_layer");
    // The same query over the first four blocks again and again (24 KB of
    // K and of V, read from L1 and L2): the arithmetic alone.
    let near: Vec<u32> = (0..blocks as u32).map(|b| b % 4).collect();
    // `(name, new tokens, the first one's position, block table)`; the
    // 512-token prompt from position 0 is `tessera bench`'s prefill.
    for (name, new, first, blocks_read) in [
        ("decode_1_at_2048", 1usize, ctx - 1, &table),
        ("decode_1_at_2048_rows_in_l2", 1, ctx - 1, &near),
        ("prefill_128_at_2048", 128, ctx - 128, &table),
        ("prefill_512_at_0", 512, 0, &table),
    ] {
        let q = seeded(&[new, nh, hd], 3, DType::F32)
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let pos: Vec<u32> = (first..first + new).map(|p| p as u32).collect();
        let seq = vec![0u32; new];
        let shape = AttnShape::new(nh, kvh, hd, bs);
        let inp = AttnInput {
            shape,
            q: &q,
            positions: &pos,
            token_seq: &seq,
            block_tables: blocks_read,
            max_blocks: blocks,
            k: KvRows::F16(&kb),
            v: KvRows::F16(&vb),
        };
        let mut plan = AttnPlan::default();
        plan.build(&shape, &seq, &pos);
        let rec = shape.record();
        let mut states = vec![0f32; plan.states * rec];
        let mut out = vec![0f32; new * nh * hd];
        let mut sc = AttnScratch::default();
        if new == 1 {
            g.throughput(decode_work(1));
        } else {
            g.throughput(Throughput::Elements(new as u64));
        }
        g.bench_function(name, |b| {
            b.iter(|| {
                for &item in &plan.items {
                    attend_item(Isa::detect(), &inp, item, &mut sc, &mut |t, idx, r| {
                        let at = (plan.base[t] + idx) * rec;
                        states[at..at + rec].copy_from_slice(r);
                    });
                }
                for t in 0..new {
                    let chunks = pos[t] as usize / CHUNK + 1;
                    for h in 0..nh {
                        let first = (plan.base[t] + h) * rec;
                        let o = &mut out[(t * nh + h) * hd..(t * nh + h + 1) * hd];
                        merge(&states[first..], chunks, nh * rec, hd, o);
                    }
                }
                black_box(&out);
            })
        });
    }

    // One decoding query through 30 layers' caches (SmolLM2's depth: 47 MB
    // of f16 K/V, past the last-level cache), as a decode step meets them:
    // each layer a pool of 8,192 tokens (allocated as the engine does)
    // whose first blocks hold the context, as a fresh pool hands them out.
    let layers = 30;
    let pool = |x: &[u16]| {
        let mut v = tessera_kernels::zeroed_huge::<u16>(4 * x.len());
        for c in v.chunks_exact_mut(x.len()) {
            c.copy_from_slice(x);
        }
        v
    };
    let (kl, vl): (Vec<Vec<u16>>, Vec<Vec<u16>>) =
        (0..layers).map(|_| (pool(&kb), pool(&vb))).unzip();
    let table: Vec<u32> = (256..256 + blocks as u32).collect();
    let q = seeded(&[1, nh, hd], 3, DType::F32)
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let (pos, seq) = (vec![ctx as u32 - 1], vec![0u32]);
    let shape = AttnShape::new(nh, kvh, hd, bs);
    let layer0 = AttnInput {
        shape,
        q: &q,
        positions: &pos,
        token_seq: &seq,
        block_tables: &table,
        max_blocks: blocks,
        k: KvRows::F16(&kl[0]),
        v: KvRows::F16(&vl[0]),
    };
    let mut plan = AttnPlan::default();
    plan.build(&shape, &seq, &pos);
    let rec = shape.record();
    let mut states = vec![0f32; plan.states * rec];
    let mut sc = AttnScratch::default();
    g.throughput(decode_work(layers));
    g.bench_function("decode_1_at_2048_30_layers", |b| {
        b.iter(|| {
            for (kb, vb) in kl.iter().zip(&vl) {
                let inp = AttnInput {
                    k: KvRows::F16(kb),
                    v: KvRows::F16(vb),
                    ..layer0
                };
                for &item in &plan.items {
                    attend_item(Isa::detect(), &inp, item, &mut sc, &mut |t, idx, r| {
                        let at = (plan.base[t] + idx) * rec;
                        states[at..at + rec].copy_from_slice(r);
                    });
                }
            }
            black_box(&states);
        })
    });
    g.finish();
}

/// The rooflines the kernels run against: reading 96 MiB (about
/// SmolLM2-135M's weights, far past the last-level cache) with 16-lane
/// loads, on one thread and on two (each half); and f32 fused
/// multiply-adds on one thread, independent chains in registers, with the
/// widest vectors the CPU has (x86-64).
fn bench_roofline(c: &mut Criterion) {
    let bytes = 96usize << 20;
    let data: Vec<f32> = (0..bytes / 4).map(|i| i as f32).collect();
    let sum = |d: &[f32]| {
        let mut acc = [0f32; 16];
        for ch in d.chunks_exact(16) {
            for j in 0..16 {
                acc[j] += ch[j];
            }
        }
        acc
    };
    let mut g = c.benchmark_group("roofline");
    g.throughput(Throughput::Bytes(bytes as u64));
    g.bench_function("read_96MiB_one_thread", |b| {
        b.iter(|| black_box(sum(&data)))
    });
    g.bench_function("read_96MiB_two_threads", |b| {
        b.iter(|| {
            let (lo, hi) = data.split_at(data.len() / 2);
            std::thread::scope(|s| {
                let other = s.spawn(|| black_box(sum(hi)));
                black_box(sum(lo));
                other.join().unwrap()
            })
        })
    });
    #[cfg(target_arch = "x86_64")]
    {
        const ROUNDS: usize = 1 << 20;
        let (run, lanes): (fn(usize) -> f32, usize) = if is_x86_feature_detected!("avx512f") {
            (|n| unsafe { fma::avx512(n) }, 16)
        } else if is_x86_feature_detected!("fma") {
            (|n| unsafe { fma::avx2(n) }, 8)
        } else {
            (fma::scalar, 1)
        };
        g.throughput(Throughput::Elements((ROUNDS * fma::CHAINS * lanes) as u64));
        g.bench_function("fma_one_thread", |b| {
            b.iter(|| black_box(run(black_box(ROUNDS))))
        });
        // The integer kernels' ceiling: `vpdpbusd` (64 byte products a
        // 512-bit instruction) alone, and beside one f32 multiply-add or
        // one `vpmulld` for every four, which show whether those take the
        // same ports (elements: `vpdpbusd` instructions).
        if is_x86_feature_detected!("avx512vnni") {
            g.throughput(Throughput::Elements(ROUNDS as u64 * 12));
            for (name, run) in [
                ("vpdpbusd_one_thread", ports::dpbusd as fn(usize)),
                ("vpdpbusd_with_fma_one_thread", ports::dpbusd_fma),
                ("vpdpbusd_with_vpmulld_one_thread", ports::dpbusd_mullo),
            ] {
                g.bench_function(name, |b| b.iter(|| run(black_box(ROUNDS))));
            }
        }
        // The 256-bit tiles' multiplies (elements: instructions, 32 byte
        // products each for `vpdpbusd` and `vpmaddubsw`, 16 i16 products
        // for `vpmaddwd`): the ceilings of the AVX-VNNI and AVX2 tiles.
        let mut ymm: Vec<PortBench> = Vec::new();
        if is_x86_feature_detected!("avxvnni") {
            ymm.push(("vpdpbusd_ymm_one_thread", ports::dpbusd_ymm));
        }
        if is_x86_feature_detected!("avx2") {
            ymm.push(("vpmaddubsw_ymm_one_thread", ports::maddubs_ymm));
            ymm.push(("vpmaddwd_ymm_one_thread", ports::madd_ymm));
        }
        g.throughput(Throughput::Elements(ROUNDS as u64 * 12));
        for (name, run) in ymm {
            g.bench_function(name, |b| b.iter(|| run(black_box(ROUNDS))));
        }
    }
    g.finish();
}

/// A port bench's name and its loop of rounds.
#[cfg(target_arch = "x86_64")]
type PortBench = (&'static str, fn(usize));

/// Twelve independent `vpdpbusd` a round, and three more instructions of
/// another kind on registers of their own (inline assembly, so that the
/// compiler neither folds nor reorders them).
#[cfg(target_arch = "x86_64")]
mod ports {
    use std::arch::asm;

    macro_rules! rounds {
        ($n:expr, $($extra:literal),*) => {
            // SAFETY: register-only AVX-512 instructions on clobbered
            // registers; the callers check for AVX-512 VNNI.
            unsafe {
                asm!(
                    "2:",
                    "vpdpbusd zmm0, zmm14, zmm15", "vpdpbusd zmm1, zmm14, zmm15",
                    "vpdpbusd zmm2, zmm14, zmm15", "vpdpbusd zmm3, zmm14, zmm15",
                    "vpdpbusd zmm4, zmm14, zmm15", "vpdpbusd zmm5, zmm14, zmm15",
                    "vpdpbusd zmm6, zmm14, zmm15", "vpdpbusd zmm7, zmm14, zmm15",
                    "vpdpbusd zmm8, zmm14, zmm15", "vpdpbusd zmm9, zmm14, zmm15",
                    "vpdpbusd zmm10, zmm14, zmm15", "vpdpbusd zmm11, zmm14, zmm15",
                    $($extra,)*
                    "dec {n}", "jnz 2b",
                    n = inout(reg) $n => _,
                    out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                    out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                    out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                    out("zmm16") _, out("zmm17") _, out("zmm18") _,
                    options(nostack),
                )
            }
        };
    }

    pub fn dpbusd(n: usize) {
        rounds!(n.max(1),)
    }

    pub fn dpbusd_fma(n: usize) {
        rounds!(
            n.max(1),
            "vfmadd231ps zmm16, zmm13, zmm12",
            "vfmadd231ps zmm17, zmm13, zmm12",
            "vfmadd231ps zmm18, zmm13, zmm12"
        )
    }

    /// Twelve independent 256-bit instructions `$op ymmN, ymm14, ymm15` a
    /// round.
    macro_rules! ymm_rounds {
        ($n:expr, $op:literal) => {
            // SAFETY: register-only AVX2 / AVX-VNNI instructions on
            // clobbered registers; the callers check for the feature.
            unsafe {
                asm!(
                    "2:",
                    concat!($op, " ymm0, ymm14, ymm15"), concat!($op, " ymm1, ymm14, ymm15"),
                    concat!($op, " ymm2, ymm14, ymm15"), concat!($op, " ymm3, ymm14, ymm15"),
                    concat!($op, " ymm4, ymm14, ymm15"), concat!($op, " ymm5, ymm14, ymm15"),
                    concat!($op, " ymm6, ymm14, ymm15"), concat!($op, " ymm7, ymm14, ymm15"),
                    concat!($op, " ymm8, ymm14, ymm15"), concat!($op, " ymm9, ymm14, ymm15"),
                    concat!($op, " ymm10, ymm14, ymm15"), concat!($op, " ymm11, ymm14, ymm15"),
                    "dec {n}", "jnz 2b",
                    n = inout(reg) $n => _,
                    out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                    out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
                    out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                    options(nostack),
                )
            }
        };
    }

    /// AVX-VNNI's `vpdpbusd` (the VEX form), each on its own accumulator.
    pub fn dpbusd_ymm(n: usize) {
        ymm_rounds!(n.max(1), "{{vex}} vpdpbusd")
    }

    pub fn maddubs_ymm(n: usize) {
        ymm_rounds!(n.max(1), "vpmaddubsw")
    }

    pub fn madd_ymm(n: usize) {
        ymm_rounds!(n.max(1), "vpmaddwd")
    }

    pub fn dpbusd_mullo(n: usize) {
        rounds!(
            n.max(1),
            "vpmulld zmm16, zmm13, zmm12",
            "vpmulld zmm17, zmm13, zmm12",
            "vpmulld zmm18, zmm13, zmm12"
        )
    }
}

/// The FMA roofline's loops: `CHAINS` independent accumulators, each
/// `x = x·a + b` per round, enough that no multiply-add waits for the
/// result of the one before it.
#[cfg(target_arch = "x86_64")]
mod fma {
    use std::arch::x86_64::*;
    use std::hint::black_box;
    pub const CHAINS: usize = 12;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn avx512(rounds: usize) -> f32 {
        let (a, b) = (_mm512_set1_ps(black_box(0.999)), _mm512_set1_ps(1e-3));
        let mut x = [_mm512_set1_ps(1.0); CHAINS];
        for _ in 0..rounds {
            for v in &mut x {
                *v = _mm512_fmadd_ps(*v, a, b);
            }
        }
        x.iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn avx2(rounds: usize) -> f32 {
        let (a, b) = (_mm256_set1_ps(black_box(0.999)), _mm256_set1_ps(1e-3));
        let mut x = [_mm256_set1_ps(1.0); CHAINS];
        for _ in 0..rounds {
            for v in &mut x {
                *v = _mm256_fmadd_ps(*v, a, b);
            }
        }
        let mut out = [0f32; 8];
        let s = x
            .iter()
            .fold(_mm256_setzero_ps(), |s, &v| _mm256_add_ps(s, v));
        _mm256_storeu_ps(out.as_mut_ptr(), s);
        out.iter().sum()
    }

    pub fn scalar(rounds: usize) -> f32 {
        let mut x = [1f32; CHAINS];
        for _ in 0..rounds {
            for v in &mut x {
                *v = v.mul_add(black_box(0.999), 1e-3);
            }
        }
        x.iter().sum()
    }
}

/// The decode-time linear layers on SmolLM2-135M's shapes, one thread,
/// one input row (GB/s of weights; the `_64` benches: 64 input rows, as in
/// prefill, where arithmetic rather than memory bounds them).
fn bench_matvec(c: &mut Criterion) {
    use candle_core::quantized::GgmlDType;
    use candle_core::DType;
    use tessera_kernels::{
        matvec, qmatvec, quantize_row, ActBlock, Activations, Isa, Packed, QIsa, WeightFormat,
        Weights,
    };
    let mut g = c.benchmark_group("matvec_smollm2");
    for (name, dtype, n, k, t) in [
        ("q4_1_ffn_1536x576", GgmlDType::Q4_1, 1536, 576, 1),
        ("q4_0_ffn_1536x576", GgmlDType::Q4_0, 1536, 576, 1),
        ("q8_0_ffn_1536x576", GgmlDType::Q8_0, 1536, 576, 1),
        ("q8_0_head_49152x576", GgmlDType::Q8_0, 49152, 576, 1),
        ("q4_1_ffn_1536x576_64", GgmlDType::Q4_1, 1536, 576, 64),
        ("q4_1_ffn_1536x576_8", GgmlDType::Q4_1, 1536, 576, 8),
        ("q8_0_head_49152x576_8", GgmlDType::Q8_0, 49152, 576, 8),
        // K-quants need rows of whole 256-value super-blocks: the down
        // projection's 1536 values.
        ("q4_k_down_576x1536", GgmlDType::Q4K, 576, 1536, 1),
        ("q5_k_down_576x1536", GgmlDType::Q5K, 576, 1536, 1),
        ("q6_k_down_576x1536", GgmlDType::Q6K, 576, 1536, 1),
        ("q4_k_down_576x1536_64", GgmlDType::Q4K, 576, 1536, 64),
        ("q5_k_down_576x1536_64", GgmlDType::Q5K, 576, 1536, 64),
        ("q6_k_down_576x1536_64", GgmlDType::Q6K, 576, 1536, 64),
    ] {
        let data = quantized(dtype, n, k);
        let weights = Weights::new(WeightFormat::from_ggml(dtype), &data, n, k).unwrap();
        let x = tessera_kernels::testing::seeded(&[t, k], 6, DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let mut out = vec![0f32; n * t];
        let mut scratch = Vec::new();
        if t == 1 {
            g.throughput(Throughput::Bytes(data.len() as u64));
        } else {
            g.throughput(Throughput::Elements((n * k * t) as u64));
        }
        g.bench_function(format!("{name}_f32"), |b| {
            b.iter(|| {
                matvec(
                    Isa::detect(),
                    &weights,
                    &x,
                    t,
                    0,
                    n,
                    &mut scratch,
                    &mut |i, r, v| out[i * n + r] = v,
                );
                black_box(&out);
            })
        });
        // The integer path: activations quantized per call, as the
        // forward does.
        let packed = Packed::pack(&weights).expect("a format with an integer path");
        let mut acts = vec![ActBlock::default(); t * k / 32];
        if t > 1 && dtype == GgmlDType::Q4K {
            // The quantization alone, for the shape's inputs.
            g.bench_function(format!("quantize_{t}x{k}_int8x2"), |b| {
                b.iter(|| {
                    for i in 0..t {
                        quantize_row(&x[i * k..(i + 1) * k], 2, &mut acts[i * k / 32..]);
                    }
                    black_box(&acts);
                })
            });
        }
        for act in [Activations::Int8x2, Activations::Int8] {
            let levels = act.levels();
            g.bench_function(format!("{name}_{}", act.name()), |b| {
                b.iter(|| {
                    for i in 0..t {
                        quantize_row(&x[i * k..(i + 1) * k], levels, &mut acts[i * k / 32..]);
                    }
                    qmatvec(
                        QIsa::detect(),
                        &packed,
                        &acts,
                        t,
                        levels,
                        0,
                        n,
                        &mut |i, r, v| out[i * n + r..][..v.len()].copy_from_slice(v),
                    );
                    black_box(&out);
                })
            });
        }
    }
    g.finish();
}

/// Seeded `n × k` weights in the GGML format `dtype`.
fn quantized(dtype: candle_core::quantized::GgmlDType, n: usize, k: usize) -> Vec<u8> {
    use candle_core::quantized::QTensor;
    let w = tessera_kernels::testing::seeded(&[n, k], 5, candle_core::DType::F32).unwrap();
    QTensor::quantize(&w, dtype)
        .unwrap()
        .data()
        .unwrap()
        .into_owned()
}

/// The quantized linear layers at a 1B-class model's FFN shape (8192 rows
/// of 2048), one thread, reading from DRAM as decode does: eight copies
/// of the weight (72 MiB of Q4_0, past the last-level cache) taken in
/// turn. The prefetch distance of the tiles shows here and not in the
/// L2-sized layers above.
fn bench_matvec_dram(c: &mut Criterion) {
    use candle_core::quantized::GgmlDType;
    use candle_core::DType;
    use tessera_kernels::{
        qmatvec, quantize_row, ActBlock, Activations, Packed, QIsa, WeightFormat, Weights,
    };
    const COPIES: usize = 8;
    let (n, k) = (8192, 2048);
    let mut g = c.benchmark_group("matvec_1b_dram");
    for (name, dtype) in [
        ("q4_0_up_8192x2048", GgmlDType::Q4_0),
        ("q4_k_up_8192x2048", GgmlDType::Q4K),
        ("q6_k_up_8192x2048", GgmlDType::Q6K),
    ] {
        let data = quantized(dtype, n, k);
        let weights = Weights::new(WeightFormat::from_ggml(dtype), &data, n, k).unwrap();
        let packed: Vec<Packed> = (0..COPIES)
            .map(|_| Packed::pack(&weights).expect("a format with an integer path"))
            .collect();
        let x = tessera_kernels::testing::seeded(&[1, k], 6, DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let mut out = vec![0f32; n];
        let mut acts = vec![ActBlock::default(); k / 32];
        g.throughput(Throughput::Bytes(data.len() as u64));
        for act in [Activations::Int8x2, Activations::Int8] {
            let levels = act.levels();
            let mut turn = 0;
            g.bench_function(format!("{name}_{}", act.name()), |b| {
                b.iter(|| {
                    quantize_row(&x, levels, &mut acts);
                    turn = (turn + 1) % COPIES;
                    qmatvec(
                        QIsa::detect(),
                        &packed[turn],
                        &acts,
                        1,
                        levels,
                        0,
                        n,
                        &mut |_, r, v| out[r..][..v.len()].copy_from_slice(v),
                    );
                    black_box(&out);
                })
            });
        }
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(3));
    targets = bench_tree, bench_pool, bench_defrag, bench_attention, bench_roofline, bench_matvec,
        bench_matvec_dram
}
criterion_main!(benches);
