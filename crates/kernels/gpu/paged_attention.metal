// Paged attention on Metal: the contract of paged_attention.cu's per-query
// kernel and the same work split (read that file's header): one
// threadgroup per (query head, token, partition of `part_len` positions,
// at most TS_ATT_PART; the launcher picks it as the CUDA launcher does,
// short where there are few queries), both passes over the positions a
// simdgroup per position with its lanes over the head dimension, the
// simdgroups' output sums added in simdgroup order; one partition
// normalises its own output (the launcher passes the output as part_out
// and merges nothing), several are merged by tessera_attention_merge.
// Simdgroup reductions in place of warp shuffles. The Rust side compiles
// prelude_metal.h, kv_elem.h and this file as one source
// (gpu::metal_source inlines them).
#include "prelude_metal.h"
#include "kv_elem.h"

#define TS_ATT_THREADS 128
#define TS_ATT_SIMDS (TS_ATT_THREADS / 32)
#define TS_ATT_PART 512
#define TS_ATT_MAX_HEAD_DIM 256

// The whole threadgroup's max (op 0) or sum (op 1) of one value per thread.
static inline float ts_group_reduce(float x, threadgroup float* red, uint lane, uint simd, int op) {
    x = op ? simd_sum(x) : simd_max(x);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (lane == 0) red[simd] = x;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float r = red[0];
    for (uint w = 1; w < TS_ATT_SIMDS; w++) r = op ? r + red[w] : fmax(r, red[w]);
    return r;
}

struct TsAttnArgs {
    uint32_t n_heads, n_kv_heads, head_dim, block_size, max_blocks;
    float scale;
    uint32_t window, parts, part_len;
};

template <typename E>
static inline void ts_paged_attention(
    device const float* q, device const typename E::Raw* k_cache,
    device const typename E::Raw* v_cache, device const uint32_t* block_tables,
    device const uint32_t* token_seq, device const uint32_t* token_pos, device float* part_out,
    device float* part_max, device float* part_sum, constant TsAttnArgs& a, uint3 group,
    uint tid, uint lane, uint simd, threadgroup float* qs, threadgroup float* scores,
    threadgroup float* red, threadgroup float* simd_out) {
    uint32_t h = group.x, t = group.y, part = group.z;
    uint32_t g = h / (a.n_heads / a.n_kv_heads);
    uint32_t pos = token_pos[t];
    uint32_t lo = a.window == 0 ? 0 : (pos + 1 > a.window ? pos + 1 - a.window : 0);
    uint32_t from = lo + part * a.part_len;
    uint32_t to = min(pos + 1, from + a.part_len);
    ts_u64 slot_out = ((ts_u64)t * a.n_heads + h) * a.parts + part;
    device float* out = part_out + slot_out * a.head_dim;
    if (from >= pos + 1) {
        // An empty partition (its token has a shorter context than the
        // longest of the launch): nothing to merge.
        if (tid == 0) {
            part_max[slot_out] = -INFINITY;
            part_sum[slot_out] = 0.0f;
        }
        for (uint32_t d = tid; d < a.head_dim; d += TS_ATT_THREADS) out[d] = 0.0f;
        return;
    }
    device const float* qh = q + ((ts_u64)t * a.n_heads + h) * a.head_dim;
    for (uint32_t d = tid; d < a.head_dim; d += TS_ATT_THREADS) qs[d] = qh[d];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    device const uint32_t* table = block_tables + (ts_u64)token_seq[t] * a.max_blocks;
    uint32_t row = a.n_kv_heads * a.head_dim;
    // Scores: a simdgroup per position, its lanes over the head dimension.
    float best = -INFINITY;
    for (uint32_t j = from + simd; j < to; j += TS_ATT_SIMDS) {
        ts_u64 slot = (ts_u64)table[j / a.block_size] * a.block_size + j % a.block_size;
        device const typename E::Raw* kr = k_cache + E::units(slot * row + (ts_u64)g * a.head_dim);
        float s = 0.0f;
        for (uint32_t d = lane; d < a.head_dim; d += 32) s += qs[d] * E::at(kr, d);
        s = simd_sum(s) * a.scale;
        if (lane == 0) scores[j - from] = s;
        best = fmax(best, s);
    }
    float mx = ts_group_reduce(best, red, lane, simd, 0);
    float l = 0.0f;
    for (uint32_t j = from + tid; j < to; j += TS_ATT_THREADS) {
        float p = exp(scores[j - from] - mx);
        scores[j - from] = p;
        l += p;
    }
    l = ts_group_reduce(l, red, lane, simd, 1);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Output: a simdgroup per position, as for the scores, each lane
    // holding its dimensions' sums over the simdgroup's positions; then
    // the simdgroups' sums added in simdgroup order.
    float acc[TS_ATT_MAX_HEAD_DIM / 32];
    for (int i = 0; i < TS_ATT_MAX_HEAD_DIM / 32; i++) acc[i] = 0.0f;
    for (uint32_t j = from + simd; j < to; j += TS_ATT_SIMDS) {
        ts_u64 slot = (ts_u64)table[j / a.block_size] * a.block_size + j % a.block_size;
        device const typename E::Raw* vr = v_cache + E::units(slot * row + (ts_u64)g * a.head_dim);
        float p = scores[j - from];
        for (int i = 0; i < TS_ATT_MAX_HEAD_DIM / 32; i++) {
            uint32_t d = lane + 32 * i;
            if (d < a.head_dim) acc[i] += p * E::at(vr, d);
        }
    }
    for (int i = 0; i < TS_ATT_MAX_HEAD_DIM / 32; i++) {
        uint32_t d = lane + 32 * i;
        if (d < a.head_dim) simd_out[simd * TS_ATT_MAX_HEAD_DIM + d] = acc[i];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint32_t d = tid; d < a.head_dim; d += TS_ATT_THREADS) {
        float sum = 0.0f;
        for (uint w = 0; w < TS_ATT_SIMDS; w++) sum += simd_out[w * TS_ATT_MAX_HEAD_DIM + d];
        out[d] = a.parts == 1 ? sum / l : sum;
    }
    if (tid == 0) {
        part_max[slot_out] = mx;
        part_sum[slot_out] = l;
    }
}

#define TS_ATTENTION(SUF, E)                                                                   \
    kernel void tessera_paged_attention_##SUF(                                                 \
        device const float* q [[buffer(0)]], device const E::Raw* k_cache [[buffer(1)]],       \
        device const E::Raw* v_cache [[buffer(2)]],                                            \
        device const uint32_t* block_tables [[buffer(3)]],                                     \
        device const uint32_t* token_seq [[buffer(4)]],                                        \
        device const uint32_t* token_pos [[buffer(5)]], device float* part_out [[buffer(6)]], \
        device float* part_max [[buffer(7)]], device float* part_sum [[buffer(8)]],            \
        constant TsAttnArgs& a [[buffer(9)]], uint3 group [[threadgroup_position_in_grid]],     \
        uint tid [[thread_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],     \
        uint simd [[simdgroup_index_in_threadgroup]]) {                                        \
        TS_GROUP_ARRAY(float, qs, TS_ATT_MAX_HEAD_DIM);                                        \
        TS_GROUP_ARRAY(float, scores, TS_ATT_PART);                                            \
        TS_GROUP_ARRAY(float, red, TS_ATT_SIMDS);                                              \
        TS_GROUP_ARRAY(float, simd_out, TS_ATT_SIMDS * TS_ATT_MAX_HEAD_DIM);                   \
        ts_paged_attention<E>(q, k_cache, v_cache, block_tables, token_seq, token_pos,         \
                              part_out, part_max, part_sum, a, group, tid, lane, simd, qs,     \
                              scores, red, simd_out);                                          \
    }

TS_ATTENTION(f32, TsF32)
TS_ATTENTION(f16, TsF16)
TS_ATTENTION(bf16, TsBf16)

// One threadgroup per (query head, token): its partitions merged by
// log-sum-exp into out [tokens, n_heads, head_dim].
kernel void tessera_attention_merge(device const float* part_out [[buffer(0)]],
                                    device const float* part_max [[buffer(1)]],
                                    device const float* part_sum [[buffer(2)]],
                                    device float* out [[buffer(3)]],
                                    constant TsAttnArgs& a [[buffer(4)]],
                                    uint3 group [[threadgroup_position_in_grid]],
                                    uint tid [[thread_index_in_threadgroup]],
                                    uint threads [[threads_per_threadgroup]]) {
    ts_u64 base = (ts_u64)group.y * a.n_heads + group.x;
    float m = -INFINITY;
    for (uint32_t p = 0; p < a.parts; p++) m = fmax(m, part_max[base * a.parts + p]);
    float l = 0.0f;
    for (uint32_t p = 0; p < a.parts; p++) {
        float w = part_sum[base * a.parts + p];
        if (w > 0.0f) l += exp(part_max[base * a.parts + p] - m) * w;
    }
    for (uint32_t d = tid; d < a.head_dim; d += threads) {
        float acc = 0.0f;
        for (uint32_t p = 0; p < a.parts; p++) {
            if (part_sum[base * a.parts + p] > 0.0f)
                acc += exp(part_max[base * a.parts + p] - m) *
                       part_out[(base * a.parts + p) * a.head_dim + d];
        }
        out[base * a.head_dim + d] = acc / l;
    }
}
