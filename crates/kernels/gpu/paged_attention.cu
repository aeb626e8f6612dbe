// Paged attention on CUDA: the contract of crates/kernels/src/attention.rs.
// Over a quantized cache (q8_0, q4_0: kv_elem.h) the kernels read values in
// the cache's rotated basis; the launcher rotates the queries into it
// before and the output back after (tessera_hadamard_rows).
// Query token t of sequence s at position p attends to positions
// window_start(p)..=p of s, read through s's block table; query head h reads
// KV head h / (n_heads / n_kv_heads). f32 accumulation whatever the cache
// type.
//
// One thread block per (query head, token, partition of part_len positions,
// at most TS_ATT_PART; the launcher picks it, short where there are few
// queries): a long context is split across blocks, each leaving its running
// max, sum and unnormalised output; tessera_attention_merge then combines a
// token's partitions by log-sum-exp (or, in tessera_paged_attention_merged_*,
// the last of a query's blocks to finish does, in the same launch). Decode (one token per sequence) and
// prefill (a chunk of tokens) use the same kernels: the grid has a row per
// token. Within a block both passes over the positions go a warp per
// position, its lanes over the head dimension (rows read whole, several
// rows in flight).
//
// Unlike kv_ops.h this file is CUDA only (warp shuffles, shared memory,
// barriers); Metal has its own.
#include "prelude_cuda.h"
#include "kv_elem.h"

#define TS_ATT_THREADS 128
#define TS_ATT_WARPS (TS_ATT_THREADS / 32)
// The longest partition (one block's scores live in shared memory).
#define TS_ATT_PART 512
#define TS_ATT_MAX_HEAD_DIM 256
// Blocks per multiprocessor the register budget is set for (without it
// ptxas held the kernels to 32 registers and spilled the output sums).
#define TS_ATT_MIN_BLOCKS 8

__device__ __forceinline__ float ts_warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ float ts_warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// The first position a query at pos sees (window_start in attention.rs).
__device__ __forceinline__ uint32_t ts_window_start(uint32_t pos, uint32_t window) {
    return window == 0 ? 0 : (pos + 1 > window ? pos + 1 - window : 0);
}

// The whole block's max (op 0) or sum (op 1) of one value per thread.
__device__ __forceinline__ float ts_block_reduce(float x, float* red, int op) {
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    x = op ? ts_warp_sum(x) : ts_warp_max(x);
    __syncthreads();
    if (lane == 0) red[warp] = x;
    __syncthreads();
    float r = red[0];
    for (int w = 1; w < TS_ATT_WARPS; w++) r = op ? r + red[w] : fmaxf(r, red[w]);
    return r;
}

template <typename E>
__device__ void ts_paged_attention(
    const float* __restrict__ q, const typename E::Raw* __restrict__ k_cache,
    const typename E::Raw* __restrict__ v_cache, const uint32_t* __restrict__ block_tables,
    const uint32_t* __restrict__ token_seq, const uint32_t* __restrict__ token_pos,
    float* __restrict__ part_out, float* __restrict__ part_max, float* __restrict__ part_sum,
    uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim, uint32_t block_size,
    uint32_t max_blocks, float scale, uint32_t window, uint32_t parts, uint32_t part_len) {
    __shared__ float qs[TS_ATT_MAX_HEAD_DIM];
    __shared__ float scores[TS_ATT_PART];
    __shared__ float red[TS_ATT_WARPS];
    __shared__ float warp_out[TS_ATT_WARPS][TS_ATT_MAX_HEAD_DIM];
    uint32_t h = blockIdx.x, t = blockIdx.y, part = blockIdx.z;
    uint32_t g = h / (n_heads / n_kv_heads);
    uint32_t pos = token_pos[t];
    uint32_t lo = ts_window_start(pos, window);
    uint32_t from = lo + part * part_len;
    uint32_t to = min(pos + 1, from + part_len); // exclusive
    ts_u64 slot_out = ((ts_u64)t * n_heads + h) * parts + part;
    float* out = part_out + slot_out * head_dim;
    if (from >= pos + 1) {
        // An empty partition (its token has a shorter context than the
        // longest of the launch): nothing to merge.
        if (threadIdx.x == 0) {
            part_max[slot_out] = -INFINITY;
            part_sum[slot_out] = 0.0f;
        }
        for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) out[d] = 0.0f;
        return;
    }
    const float* qh = q + ((ts_u64)t * n_heads + h) * head_dim;
    for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = qh[d];
    __syncthreads();
    const uint32_t* table = block_tables + (ts_u64)token_seq[t] * max_blocks;
    uint32_t row = n_kv_heads * head_dim;
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    // Scores: a warp per position, its lanes over the head dimension.
    float best = -INFINITY;
#pragma unroll 4
    for (uint32_t j = from + warp; j < to; j += TS_ATT_WARPS) {
        ts_u64 slot = (ts_u64)table[j / block_size] * block_size + j % block_size;
        const typename E::Raw* kr = k_cache + E::units(slot * row + (ts_u64)g * head_dim);
        float s = 0.0f;
        for (uint32_t d = lane; d < head_dim; d += 32) s += qs[d] * E::at(kr, d);
        s = ts_warp_sum(s) * scale;
        if (lane == 0) scores[j - from] = s;
        best = fmaxf(best, s);
    }
    float mx = ts_block_reduce(best, red, 0);
    float l = 0.0f;
    for (uint32_t j = from + threadIdx.x; j < to; j += blockDim.x) {
        float p = expf(scores[j - from] - mx);
        scores[j - from] = p;
        l += p;
    }
    l = ts_block_reduce(l, red, 1);
    __syncthreads();
    // Output: a warp per position, as for the scores, each lane holding
    // its dimensions' sums over the warp's positions; then the warps' sums
    // added in warp order.
    float acc[TS_ATT_MAX_HEAD_DIM / 32];
#pragma unroll
    for (int i = 0; i < TS_ATT_MAX_HEAD_DIM / 32; i++) acc[i] = 0.0f;
#pragma unroll 2
    for (uint32_t j = from + warp; j < to; j += TS_ATT_WARPS) {
        ts_u64 slot = (ts_u64)table[j / block_size] * block_size + j % block_size;
        const typename E::Raw* vr = v_cache + E::units(slot * row + (ts_u64)g * head_dim);
        float p = scores[j - from];
#pragma unroll
        for (int i = 0; i < TS_ATT_MAX_HEAD_DIM / 32; i++) {
            uint32_t d = lane + 32 * i;
            if (d < head_dim) acc[i] += p * E::at(vr, d);
        }
    }
#pragma unroll
    for (int i = 0; i < TS_ATT_MAX_HEAD_DIM / 32; i++) {
        uint32_t d = lane + 32 * i;
        if (d < head_dim) warp_out[warp][d] = acc[i];
    }
    __syncthreads();
    // One partition: the launcher passes the output itself as part_out
    // and merges nothing, so the sums are normalised here (as the merge
    // would: exp(0) = 1).
    for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < TS_ATT_WARPS; w++) sum += warp_out[w][d];
        out[d] = parts == 1 ? sum / l : sum;
    }
    if (threadIdx.x == 0) {
        part_max[slot_out] = mx;
        part_sum[slot_out] = l;
    }
}

// The merge of one (token, head)'s partitions (`base`: token · n_heads +
// head) by log-sum-exp into out, the block's threads over the dimensions.
// Partial states are read through L2 (__ldcg): the merged kernel reads
// what other blocks of its launch wrote.
__device__ __forceinline__ void ts_merge_one(const float* __restrict__ part_out,
                                             const float* __restrict__ part_max,
                                             const float* __restrict__ part_sum,
                                             float* __restrict__ out, ts_u64 base,
                                             uint32_t head_dim, uint32_t parts) {
    float m = -INFINITY;
    for (uint32_t p = 0; p < parts; p++) m = fmaxf(m, __ldcg(part_max + base * parts + p));
    float l = 0.0f;
    for (uint32_t p = 0; p < parts; p++) {
        float w = __ldcg(part_sum + base * parts + p);
        if (w > 0.0f) l += expf(__ldcg(part_max + base * parts + p) - m) * w;
    }
    for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (uint32_t p = 0; p < parts; p++) {
            if (__ldcg(part_sum + base * parts + p) > 0.0f)
                acc += expf(__ldcg(part_max + base * parts + p) - m) *
                       __ldcg(part_out + (base * parts + p) * head_dim + d);
        }
        out[base * head_dim + d] = acc / l;
    }
}

// ts_paged_attention, then the merge by whichever of a (token, head)'s
// `parts` blocks finishes last: each block counts itself in counters[token
// · n_heads + head] (zero before the launch) after its partial state is
// out; the last resets the counter to zero (for the next launch) and
// merges all of them into out. Saves the merge's launch; the merge's
// arithmetic and order are tessera_attention_merge's, whichever block
// does it.
template <typename E>
__device__ void ts_paged_attention_merged(
    const float* __restrict__ q, const typename E::Raw* __restrict__ k_cache,
    const typename E::Raw* __restrict__ v_cache, const uint32_t* __restrict__ block_tables,
    const uint32_t* __restrict__ token_seq, const uint32_t* __restrict__ token_pos,
    float* __restrict__ part_out, float* __restrict__ part_max, float* __restrict__ part_sum,
    uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim, uint32_t block_size,
    uint32_t max_blocks, float scale, uint32_t window, uint32_t parts, uint32_t part_len,
    float* __restrict__ out, uint32_t* __restrict__ counters) {
    __shared__ uint32_t ticket;
    ts_paged_attention<E>(q, k_cache, v_cache, block_tables, token_seq, token_pos, part_out,
                          part_max, part_sum, n_heads, n_kv_heads, head_dim, block_size,
                          max_blocks, scale, window, parts, part_len);
    ts_u64 base = (ts_u64)blockIdx.y * n_heads + blockIdx.x;
    // This block's state is written (by all its threads) before it counts.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) ticket = atomicAdd(counters + base, 1u);
    __syncthreads();
    if (ticket != parts - 1) return;
    if (threadIdx.x == 0) counters[base] = 0;
    __threadfence();
    ts_merge_one(part_out, part_max, part_sum, out, base, head_dim, parts);
}

#define TS_ATTENTION(SUF, E)                                                                  \
    extern "C" __global__ void __launch_bounds__(TS_ATT_THREADS, TS_ATT_MIN_BLOCKS)          \
        tessera_paged_attention_##SUF(                                                        \
            const float* q, const E::Raw* k_cache, const E::Raw* v_cache,                     \
            const uint32_t* block_tables, const uint32_t* token_seq, const uint32_t* token_pos, \
            float* part_out, float* part_max, float* part_sum, uint32_t n_heads,              \
            uint32_t n_kv_heads, uint32_t head_dim, uint32_t block_size, uint32_t max_blocks, \
            float scale, uint32_t window, uint32_t parts, uint32_t part_len) {                \
        ts_paged_attention<E>(q, k_cache, v_cache, block_tables, token_seq, token_pos,       \
                              part_out, part_max, part_sum, n_heads, n_kv_heads, head_dim,    \
                              block_size, max_blocks, scale, window, parts, part_len);        \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(TS_ATT_THREADS, TS_ATT_MIN_BLOCKS)          \
        tessera_paged_attention_merged_##SUF(                                                 \
            const float* q, const E::Raw* k_cache, const E::Raw* v_cache,                     \
            const uint32_t* block_tables, const uint32_t* token_seq, const uint32_t* token_pos, \
            float* part_out, float* part_max, float* part_sum, uint32_t n_heads,              \
            uint32_t n_kv_heads, uint32_t head_dim, uint32_t block_size, uint32_t max_blocks, \
            float scale, uint32_t window, uint32_t parts, uint32_t part_len, float* out,      \
            uint32_t* counters) {                                                             \
        ts_paged_attention_merged<E>(q, k_cache, v_cache, block_tables, token_seq, token_pos, \
                                     part_out, part_max, part_sum, n_heads, n_kv_heads,       \
                                     head_dim, block_size, max_blocks, scale, window, parts,  \
                                     part_len, out, counters);                                \
    }

TS_ATTENTION(f32, TsF32)
TS_ATTENTION(f16, TsF16)
TS_ATTENTION(bf16, TsBf16)
TS_ATTENTION(q8_0, TsKvQ8_0)
TS_ATTENTION(q4_0, TsKvQ4_0)

// Tiled attention for prefill chunks (the launcher's attention_tiles plan,
// crates/kernels/src/gpu/mod.rs): one thread block per (tile, partition),
// a tile being up to ROWS (token, query head) rows that share one KV head:
// consecutive tokens of one sequence times the heads of a group. Each K/V
// row is read from the cache once per block, for all of its rows, instead
// of once per (token, head). The partition's positions go in chunks of 32:
// a chunk's K and V rows converted to f32 in shared memory, then each warp
// takes ROWS / 4 rows (a lane per position for the scores, then a lane per
// dimension for the output), with a running max and sum per row carried
// across chunks (online softmax). Each row masks positions outside its own
// window_start(pos)..=pos. It leaves the same partial states as
// ts_paged_attention, merged by tessera_attention_merge.
#define TS_TILE_KEYS 32
#define TS_TILE_ROWS_64 32
#define TS_TILE_ROWS_128 16

template <typename E, int DPL, int RPW>
__device__ void ts_tiled_attention(
    const float* __restrict__ q, const typename E::Raw* __restrict__ k_cache,
    const typename E::Raw* __restrict__ v_cache, const uint32_t* __restrict__ block_tables,
    const uint32_t* __restrict__ token_seq, const uint32_t* __restrict__ token_pos,
    const uint32_t* __restrict__ tiles, float* __restrict__ part_out,
    float* __restrict__ part_max, float* __restrict__ part_sum, uint32_t n_heads,
    uint32_t n_kv_heads, uint32_t block_size, uint32_t max_blocks, float scale,
    uint32_t window, uint32_t parts, uint32_t part_len) {
    constexpr int D = 32 * DPL;
    constexpr int ROWS = TS_ATT_WARPS * RPW;
    constexpr int TK = TS_TILE_KEYS;
    // Padded rows: a lane per position reads its K row as float4s without
    // bank conflicts.
    constexpr int KS = D + 4;
    __shared__ __align__(16) float qs[ROWS * KS];
    __shared__ __align__(16) float ks[TK * KS];
    __shared__ __align__(16) float vs[TK * D];
    __shared__ float ps[ROWS][TK + 1];
    __shared__ uint32_t row_lo[ROWS], row_hi[ROWS];
    __shared__ ts_u64 key_slot[TK];
    const uint32_t* tile = tiles + (ts_u64)blockIdx.x * 6;
    uint32_t t0 = tile[0], ntok = tile[1], h0 = tile[2], nh = tile[3];
    uint32_t part = blockIdx.y;
    uint32_t a = tile[4] + part * part_len;
    uint32_t b = min(tile[5], a + part_len);
    uint32_t rows = ntok * nh;
    uint32_t g = h0 / (n_heads / n_kv_heads);
    const uint32_t* table = block_tables + (ts_u64)token_seq[t0] * max_blocks;
    uint32_t row = n_kv_heads * D;
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (uint32_t i = threadIdx.x; i < ROWS * D; i += blockDim.x) {
        uint32_t r = i / D, d = i % D;
        float x = 0.0f;
        if (r < rows) x = q[((ts_u64)(t0 + r / nh) * n_heads + h0 + r % nh) * D + d];
        qs[r * KS + d] = x;
    }
    if (threadIdx.x < ROWS) {
        uint32_t r = threadIdx.x, lo = 1, hi = 0; // no positions
        if (r < rows) {
            uint32_t pos = token_pos[t0 + r / nh];
            lo = ts_window_start(pos, window);
            hi = pos + 1;
        }
        row_lo[r] = lo;
        row_hi[r] = hi;
    }
    float m[RPW], l[RPW], acc[RPW][DPL];
#pragma unroll
    for (int i = 0; i < RPW; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
#pragma unroll
        for (int e = 0; e < DPL; e++) acc[i][e] = 0.0f;
    }
    for (uint32_t c = a; c < b; c += TK) {
        __syncthreads(); // the previous chunk's rows are no longer read
        if (threadIdx.x < TK) {
            uint32_t j = c + threadIdx.x;
            key_slot[threadIdx.x] =
                j < b ? (ts_u64)table[j / block_size] * block_size + j % block_size : 0;
        }
        __syncthreads();
        for (uint32_t i = threadIdx.x; i < TK * D; i += blockDim.x) {
            uint32_t j = i / D, d = i % D;
            float kx = 0.0f, vx = 0.0f;
            if (c + j < b) {
                ts_u64 at = E::units(key_slot[j] * row + (ts_u64)g * D);
                kx = E::at(k_cache + at, d);
                vx = E::at(v_cache + at, d);
            }
            ks[j * KS + d] = kx;
            vs[j * D + d] = vx;
        }
        __syncthreads();
        // Scores: lane = position c + lane, rows warp * RPW + i.
        float s[RPW];
#pragma unroll
        for (int i = 0; i < RPW; i++) s[i] = 0.0f;
        const float4* kr = reinterpret_cast<const float4*>(ks + lane * KS);
#pragma unroll 4
        for (int d4 = 0; d4 < D / 4; d4++) {
            float4 kk = kr[d4];
#pragma unroll
            for (int i = 0; i < RPW; i++) {
                float4 qq = reinterpret_cast<const float4*>(qs + (warp * RPW + i) * KS)[d4];
                s[i] += qq.x * kk.x + qq.y * kk.y + qq.z * kk.z + qq.w * kk.w;
            }
        }
        uint32_t j = c + lane;
#pragma unroll
        for (int i = 0; i < RPW; i++) {
            int r = warp * RPW + i;
            bool valid = j < b && j >= row_lo[r] && j < row_hi[r];
            float x = valid ? s[i] * scale : -INFINITY;
            float mn = fmaxf(m[i], ts_warp_max(x));
            float p = valid ? expf(x - mn) : 0.0f;
            float alpha = m[i] == -INFINITY ? 0.0f : expf(m[i] - mn);
            l[i] = l[i] * alpha + ts_warp_sum(p);
            m[i] = mn;
            ps[r][lane] = p;
#pragma unroll
            for (int e = 0; e < DPL; e++) acc[i][e] *= alpha;
        }
        __syncwarp();
        // Output: lane = dimensions lane + 32 e.
#pragma unroll 4
        for (int jj = 0; jj < TK; jj++) {
            float v[DPL];
#pragma unroll
            for (int e = 0; e < DPL; e++) v[e] = vs[jj * D + lane + 32 * e];
#pragma unroll
            for (int i = 0; i < RPW; i++) {
                float p = ps[warp * RPW + i][jj];
#pragma unroll
                for (int e = 0; e < DPL; e++) acc[i][e] += p * v[e];
            }
        }
    }
#pragma unroll
    for (int i = 0; i < RPW; i++) {
        uint32_t r = warp * RPW + i;
        if (r >= rows) continue;
        ts_u64 slot_out = ((ts_u64)(t0 + r / nh) * n_heads + h0 + r % nh) * parts + part;
#pragma unroll
        for (int e = 0; e < DPL; e++) part_out[slot_out * D + lane + 32 * e] = acc[i][e];
        if (lane == 0) {
            part_max[slot_out] = m[i];
            part_sum[slot_out] = l[i];
        }
    }
}

#define TS_TILED(SUF, E, DIM)                                                                 \
    extern "C" __global__ void __launch_bounds__(TS_ATT_THREADS, 4)                           \
        tessera_tiled_attention_##SUF##_##DIM(                                                \
            const float* q, const E::Raw* k_cache, const E::Raw* v_cache,                     \
            const uint32_t* block_tables, const uint32_t* token_seq, const uint32_t* token_pos, \
            const uint32_t* tiles, float* part_out, float* part_max, float* part_sum,         \
            uint32_t n_heads, uint32_t n_kv_heads, uint32_t block_size, uint32_t max_blocks,  \
            float scale, uint32_t window, uint32_t parts, uint32_t part_len) {                \
        ts_tiled_attention<E, DIM / 32, TS_TILE_ROWS_##DIM / TS_ATT_WARPS>(                   \
            q, k_cache, v_cache, block_tables, token_seq, token_pos, tiles, part_out,         \
            part_max, part_sum, n_heads, n_kv_heads, block_size, max_blocks, scale, window,   \
            parts, part_len);                                                                 \
    }

TS_TILED(f32, TsF32, 64)
TS_TILED(f16, TsF16, 64)
TS_TILED(bf16, TsBf16, 64)
TS_TILED(f32, TsF32, 128)
TS_TILED(f16, TsF16, 128)
TS_TILED(bf16, TsBf16, 128)
TS_TILED(q8_0, TsKvQ8_0, 64)
TS_TILED(q4_0, TsKvQ4_0, 64)
TS_TILED(q8_0, TsKvQ8_0, 128)
TS_TILED(q4_0, TsKvQ4_0, 128)

// One thread block per (query head, token): its partitions merged by
// log-sum-exp into out [tokens, n_heads, head_dim].
extern "C" __global__ void tessera_attention_merge(const float* __restrict__ part_out,
                                                   const float* __restrict__ part_max,
                                                   const float* __restrict__ part_sum,
                                                   float* __restrict__ out, uint32_t n_heads,
                                                   uint32_t head_dim, uint32_t parts) {
    ts_merge_one(part_out, part_max, part_sum, out, (ts_u64)blockIdx.y * n_heads + blockIdx.x,
                 head_dim, parts);
}
