// The model's own kernels on CUDA: what the GPU executor
// (crates/kernels/src/gpu/forward.rs, driven by tessera-model's CUDA
// forward) launches around the paged attention kernels, in place of one
// candle operation per step.
//
// - tessera_fwd_gemv_<format>: y = W·x for up to TS_FWD_MAXT inputs per
//   block row, W in its GGML blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, or
//   f16/f32 rows), dequantized in registers to f32 and multiplied with the
//   f32 activations (no 8-bit rounding of the activations: the precision of
//   the CPU reference; the quantized values become f32 exactly, by way of
//   the mantissa of 2^23 rather than the slow conversion unit). One, two
//   or four warps per output row (the launcher picks by the row's length:
//   few passes each); each lane takes items of 8 (Q6_K: 16) weights, as
//   runs of 4 consecutive inputs, loading several items' raw bytes before
//   expanding any; a warp's sums are reduced by shuffles, a row's warps'
//   through shared memory in warp order. `acc` adds the result to y (the
//   residual add) instead of storing it.
// - tessera_fwd_ngemv1_* / tessera_fwd_nglu1_*: the one-token products of
//   the RMSNorm of x (weights nw): each block normalizes the row into
//   shared memory first (x · scale · w, as tessera_fwd_rms_norm writes
//   it), in place of a norm kernel and its round trip through memory.
// - tessera_fwd_rms_norm: one block per row, rows optionally gathered.
// - tessera_fwd_qkv_<cache>: per token and head, the q/k/v biases, the
//   per-head q/k norms, RoPE (both pair layouts), q into its buffer and k/v
//   into the paged cache at the token's slot (a quantized cache's rows
//   rotated and quantized, kv_elem.h).
// - tessera_fwd_act_mul: act(gate) * up.
// - tessera_fwd_residual: x += s * norm(y) (post-norms, residual scales).
//
// CUDA only (warp shuffles); the arithmetic each kernel does is the CPU
// reference forward's, up to the order of f32 additions.
#include "prelude_cuda.h"
#include "kv_elem.h"
#include "gemv_formats.h"

#define TS_FWD_WARPS 4
#define TS_FWD_THREADS (TS_FWD_WARPS * 32)
// Inputs (tokens) one GEMV block multiplies at once; more take more block
// rows (gridDim.y).
#define TS_FWD_MAXT 8
// Blocks per multiprocessor the products' register budget is set for:
// 8 (64 registers) for one token, whose loads want many warps in flight,
// 4 for several (without it ptxas held the split-row products to 64
// registers and spilled).
#define TS_FWD_MIN_BLOCKS 4

__device__ __forceinline__ float ts_fwd_warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// The row's total of each token's partial sums over its WPR warps, in
// warp order (the same bits however the blocks are scheduled): valid in
// lane 0 of the row's first warp. Every thread of the block calls it (a
// barrier when WPR > 1).
template <int MT, int WPR>
__device__ __forceinline__ void ts_row_total(float* sum) {
#pragma unroll
    for (int t = 0; t < MT; t++) sum[t] = ts_fwd_warp_sum(sum[t]);
    if (WPR == 1) return;
    __shared__ float red[TS_FWD_WARPS][MT];
    uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
#pragma unroll
        for (int t = 0; t < MT; t++) red[warp][t] = sum[t];
    }
    __syncthreads();
    if (warp % WPR == 0 && lane == 0) {
#pragma unroll
        for (int t = 0; t < MT; t++) {
            float v = red[warp][t];
            for (int w = 1; w < WPR; w++) v += red[warp + w][t];
            sum[t] = v;
        }
    }
}

// The RMSNorm (weights nw) of a token's row of x (k values, 16-byte
// aligned), written to the block's dynamic shared memory (the launcher
// sizes it k floats): x · scale · nw, the products of tessera_fwd_rms_norm
// in its order. Every thread of the block calls it (two barriers).
__device__ __forceinline__ const float* ts_stage_norm(const float* __restrict__ x, uint32_t k,
                                                      const float* __restrict__ nw, float eps) {
    TS_DYN_SHARED(float4, ts_xn4);
    __shared__ float red[TS_FWD_WARPS];
    uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, k4 = k / 4;
    const float4* x4 = (const float4*)x;
    float ss = 0.0f;
    for (uint32_t i = threadIdx.x; i < k4; i += TS_FWD_THREADS) {
        float4 v = x4[i];
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    ss = ts_fwd_warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    float tot = 0.0f;
    for (int w = 0; w < TS_FWD_WARPS; w++) tot += red[w];
    float scale = rsqrtf(tot / (float)k + eps);
    const float4* w4 = (const float4*)nw;
    for (uint32_t i = threadIdx.x; i < k4; i += TS_FWD_THREADS) {
        float4 v = x4[i], g = w4[i];
        ts_xn4[i] = make_float4(v.x * scale * g.x, v.y * scale * g.y, v.z * scale * g.z,
                                v.w * scale * g.w);
    }
    __syncthreads();
    return (const float*)ts_xn4;
}

// y[t][r] (= or +=) sum_i W[r][i] x[t][i] for the block's rows (WPR warps
// each: one for short rows, more where a warp alone would take several
// passes) and up to MT of its tokens; y rows are `y_stride` floats apart.
template <typename F, int MT, int U, int WPR, bool NORM>
__device__ void ts_gemv(const uint8_t* __restrict__ w, const float* __restrict__ x,
                        float* __restrict__ y, uint32_t rows, uint32_t k, uint32_t tokens,
                        uint32_t x_stride, uint32_t y_stride, uint32_t acc,
                        const float* __restrict__ nw, float eps) {
    uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    uint32_t r = blockIdx.x * (TS_FWD_WARPS / WPR) + warp / WPR;
    // A row past the end computes the last row's sums (so every warp
    // meets the barrier) and stores nothing.
    bool live = r < rows;
    if (!live) r = rows - 1;
    uint32_t t0 = blockIdx.y * MT;
    uint32_t nt = tokens - t0 < (uint32_t)MT ? tokens - t0 : (uint32_t)MT;
    const float* xs = x + (size_t)t0 * x_stride;
    static_assert(!NORM || MT == 1, "normalized inputs: one token");
    if (NORM) xs = ts_stage_norm(xs, k, nw, eps);
    float sum[MT];
#pragma unroll
    for (int t = 0; t < MT; t++) sum[t] = 0.0f;
    const uint8_t* row[1] = {w + (size_t)r * F::row_bytes(k)};
    ts_row_dots<F, MT, U, WPR, 1>(row, k, xs, x_stride, nt, (warp % WPR) * 32 + lane, sum);
    ts_row_total<MT, WPR>(sum);
    if (!live || warp % WPR != 0 || lane != 0) return;
#pragma unroll
    for (int t = 0; t < MT; t++) {
        if (t < nt) {
            float* o = y + (size_t)(t0 + t) * y_stride + r;
            *o = acc ? *o + sum[t] : sum[t];
        }
    }
}

__device__ __forceinline__ float ts_act(float g, uint32_t act) {
    if (act == 0) return g / (1.0f + expf(-g));
    const float c = 0.7978845608028654f;  // sqrt(2/pi)
    return 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g)));
}

// The gated activation of a stacked gate|up weight (2n rows: gate, then
// up): y[t][r] = act(gate_r · x[t]) * (up_r · x[t]) for r < n, WPR warps
// per r (act 0: SiLU, 1: GELU with tanh).
template <typename F, int MT, int U, int WPR, bool NORM>
__device__ void ts_glu(const uint8_t* __restrict__ w, const float* __restrict__ x,
                       float* __restrict__ y, uint32_t n, uint32_t k, uint32_t tokens,
                       uint32_t x_stride, uint32_t y_stride, uint32_t act,
                       const float* __restrict__ nw, float eps) {
    uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    uint32_t r = blockIdx.x * (TS_FWD_WARPS / WPR) + warp / WPR;
    bool live = r < n;
    if (!live) r = n - 1;
    uint32_t t0 = blockIdx.y * MT;
    uint32_t nt = tokens - t0 < (uint32_t)MT ? tokens - t0 : (uint32_t)MT;
    const float* xs = x + (size_t)t0 * x_stride;
    static_assert(!NORM || MT == 1, "normalized inputs: one token");
    if (NORM) xs = ts_stage_norm(xs, k, nw, eps);
    // The gate's sums, then the up's (for one token, both rows' loads in
    // flight together): one total over both.
    float gu[2 * MT];
#pragma unroll
    for (int t = 0; t < 2 * MT; t++) gu[t] = 0.0f;
    uint32_t sub = (warp % WPR) * 32 + lane;
    const uint8_t* rows[2] = {w + (size_t)r * F::row_bytes(k), w + (size_t)(n + r) * F::row_bytes(k)};
    if (MT == 1) {
        ts_row_dots<F, MT, U, WPR, 2>(rows, k, xs, x_stride, nt, sub, gu);
    } else {
        // Several tokens: one row after the other (both at once take more
        // registers than the blocks per multiprocessor allow).
        ts_row_dots<F, MT, U, WPR, 1>(rows, k, xs, x_stride, nt, sub, gu);
        ts_row_dots<F, MT, U, WPR, 1>(rows + 1, k, xs, x_stride, nt, sub, gu + MT);
    }
    ts_row_total<2 * MT, WPR>(gu);
    if (!live || warp % WPR != 0 || lane != 0) return;
#pragma unroll
    for (int t = 0; t < MT; t++) {
        if (t < nt) y[(size_t)(t0 + t) * y_stride + r] = ts_act(gu[t], act) * gu[MT + t];
    }
}

// Per format and warps per row (_w1, _w2, _w4): tessera_fwd_gemv_* and
// tessera_fwd_glu_* for up to TS_FWD_MAXT tokens per block row,
// tessera_fwd_gemv1_* and tessera_fwd_glu1_* for one (decode of one
// sequence: one accumulator, so more items in flight); those two also as
// tessera_fwd_n*, the product of x's RMSNorm (nw, eps: unused by the
// others, which take them so that every product has one signature).
#define TS_GEMV_KERNEL(kname, body, F, MT, U, WPR, NORM)                                      \
    extern "C" __global__ void __launch_bounds__(TS_FWD_THREADS, TS_FWD_MIN_BLOCKS / MT + 4)  \
        kname(const uint8_t* __restrict__ w, const float* __restrict__ x,                     \
              float* __restrict__ y, uint32_t rows, uint32_t k, uint32_t tokens,              \
              uint32_t x_stride, uint32_t y_stride, uint32_t flag,                            \
              const float* __restrict__ nw, float eps) {                                      \
        body<F, MT, U, WPR, NORM>(w, x, y, rows, k, tokens, x_stride, y_stride, flag, nw,     \
                                  eps);                                                       \
    }
#define TS_GEMV_W(name, F, WPR)                                                               \
    TS_GEMV_KERNEL(tessera_fwd_gemv_##name##_w##WPR, ts_gemv, F, TS_FWD_MAXT, F::UM, WPR,     \
                   false)                                                                     \
    TS_GEMV_KERNEL(tessera_fwd_gemv1_##name##_w##WPR, ts_gemv, F, 1, F::U1, WPR, false)       \
    TS_GEMV_KERNEL(tessera_fwd_glu_##name##_w##WPR, ts_glu, F, TS_FWD_MAXT, F::UM, WPR, false) \
    TS_GEMV_KERNEL(tessera_fwd_glu1_##name##_w##WPR, ts_glu, F, 1, F::U1 / 2, WPR, false)     \
    TS_GEMV_KERNEL(tessera_fwd_ngemv1_##name##_w##WPR, ts_gemv, F, 1, F::U1, WPR, true)       \
    TS_GEMV_KERNEL(tessera_fwd_nglu1_##name##_w##WPR, ts_glu, F, 1, F::U1 / 2, WPR, true)
#define TS_GEMV(name, F) TS_GEMV_W(name, F, 1) TS_GEMV_W(name, F, 2) TS_GEMV_W(name, F, 4)

TS_GEMV(q4_0, TsQ4_0)
TS_GEMV(q4_1, TsQ4_1)
TS_GEMV(q8_0, TsQ8_0)
TS_GEMV(q4_k, TsQ4_K)
TS_GEMV(q5_k, TsQ5_K)
TS_GEMV(q6_k, TsQ6_K)
TS_GEMV(f32, TsF32W)
TS_GEMV(f16, TsF16W)

// tessera_fwd_dequant_<format>: a weight's rows expanded to f32 (a thread
// per item), for the products of long batches (cuBLAS's f32 GEMM).
#define TS_DEQUANT(name, F)                                                                   \
    extern "C" __global__ void tessera_fwd_dequant_##name(                                    \
        const uint8_t* __restrict__ w, float* __restrict__ out, uint32_t rows, uint32_t k) {  \
        ts_u64 idx = (ts_u64)blockIdx.x * blockDim.x + threadIdx.x;                           \
        if (idx >= (ts_u64)rows * F::items(k)) return;                                        \
        ts_dequant_item<F>(w, k, idx, out);                                                   \
    }

TS_DEQUANT(q4_0, TsQ4_0)
TS_DEQUANT(q4_1, TsQ4_1)
TS_DEQUANT(q8_0, TsQ8_0)
TS_DEQUANT(q4_k, TsQ4_K)
TS_DEQUANT(q5_k, TsQ5_K)
TS_DEQUANT(q6_k, TsQ6_K)
TS_DEQUANT(f32, TsF32W)
TS_DEQUANT(f16, TsF16W)

#define TS_NORM_THREADS 256

// The sum over the block of one value per thread (every thread gets it).
__device__ __forceinline__ float ts_fwd_block_sum(float v, float* red) {
    uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = ts_fwd_warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.0f;
    for (uint32_t i = 0; i < warps; i++) s += red[i];
    return s;
}

// out[r] = x[rows ? rows[r] : r] / sqrt(mean(x²) + eps) * w, a block per
// row of n values.
extern "C" __global__ void __launch_bounds__(TS_NORM_THREADS)
    tessera_fwd_rms_norm(const float* __restrict__ x, const uint32_t* __restrict__ rows,
                         const float* __restrict__ w, float* __restrict__ out, uint32_t n,
                         float eps) {
    __shared__ float red[TS_NORM_THREADS / 32];
    uint32_t r = blockIdx.x;
    const float* xr = x + (size_t)(rows ? rows[r] : r) * n;
    float ss = 0.0f;
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    float scale = rsqrtf(ts_fwd_block_sum(ss, red) / (float)n + eps);
    float* o = out + (size_t)r * n;
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) o[i] = xr[i] * scale * w[i];
}

// x[r] += s * (w ? rms_norm(y[r], w) : y[r]), a block per row.
extern "C" __global__ void __launch_bounds__(TS_NORM_THREADS)
    tessera_fwd_residual(float* __restrict__ x, const float* __restrict__ y,
                         const float* __restrict__ w, uint32_t n, float eps, float s) {
    __shared__ float red[TS_NORM_THREADS / 32];
    const float* yr = y + (size_t)blockIdx.x * n;
    float* xr = x + (size_t)blockIdx.x * n;
    float scale = 1.0f;
    if (w) {
        float ss = 0.0f;
        for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) ss += yr[i] * yr[i];
        scale = rsqrtf(ts_fwd_block_sum(ss, red) / (float)n + eps);
    }
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
        float v = w ? yr[i] * scale * w[i] : yr[i];
        xr[i] += s * v;
    }
}

// out[t][j] = act(gu[t][j]) * gu[t][n + j] for rows of 2n (gate, then up);
// act 0: SiLU, 1: GELU (tanh).
extern "C" __global__ void tessera_fwd_act_mul(const float* __restrict__ gu,
                                               float* __restrict__ out, uint32_t n,
                                               uint32_t tokens, uint32_t act) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * tokens) return;
    size_t t = i / n, j = i % n;
    float g = gu[t * 2 * n + j], u = gu[t * 2 * n + n + j];
    float a = ts_act(g, act);
    out[i] = a * u;
}

#define TS_QKV_MAX_HEAD_DIM 256

// One warp per (token, head of q, k or v). qkv rows hold the token's q, k
// and v outputs side by side (`stride` floats apart). q and k heads: bias,
// per-head norm (weights qn/kn, or none), RoPE with the token's cos/sin row
// (`half` = head_dim / 2 angles; neox: pairs (i, i + half), else (2i,
// 2i + 1)); q to q_out [token][head][dim], k and v to the cache at the
// token's slot (none: TS_NO_SLOT).
template <typename E>
__device__ void ts_qkv(const float* __restrict__ qkv, uint32_t stride,
                       const float* __restrict__ bq, const float* __restrict__ bk,
                       const float* __restrict__ bv, const float* __restrict__ qn,
                       const float* __restrict__ kn, float eps, const float* __restrict__ cos,
                       const float* __restrict__ sin, float* __restrict__ q_out,
                       typename E::Raw* __restrict__ kc, typename E::Raw* __restrict__ vc,
                       const uint32_t* __restrict__ slots, uint32_t nh, uint32_t kvh,
                       uint32_t hd, uint32_t neox) {
    __shared__ float v[TS_QKV_MAX_HEAD_DIM];
    uint32_t t = blockIdx.x, head = blockIdx.y, lane = threadIdx.x;
    // Which part and head, and where its bias and norm are.
    uint32_t part = head < nh ? 0 : (head < nh + kvh ? 1 : 2);
    uint32_t h = part == 0 ? head : (part == 1 ? head - nh : head - nh - kvh);
    const float* bias = part == 0 ? bq : (part == 1 ? bk : bv);
    const float* norm = part == 0 ? qn : (part == 1 ? kn : 0);
    const float* src = qkv + (size_t)t * stride + (size_t)head * hd;
    float ss = 0.0f;
    for (uint32_t d = lane; d < hd; d += 32) {
        float x = src[d];
        if (bias) x += bias[h * hd + d];
        v[d] = x;
        ss += x * x;
    }
    if (norm) {
        float scale = rsqrtf(ts_fwd_warp_sum(ss) / (float)hd + eps);
        for (uint32_t d = lane; d < hd; d += 32) v[d] = v[d] * scale * norm[d];
    }
    __syncwarp();
    if (part == 2) {
        uint32_t slot = slots[t];
        if (slot == TS_NO_SLOT) return;
        E::store_row(v, vc + E::units(((ts_u64)slot * kvh + h) * hd), hd, lane, 32);
        return;
    }
    uint32_t half = hd / 2;
    const float* c = cos + (size_t)t * half;
    const float* s = sin + (size_t)t * half;
    float out[TS_QKV_MAX_HEAD_DIM / 32];
    uint32_t n = 0;
    for (uint32_t d = lane; d < hd; d += 32, n++) {
        uint32_t i, a, b;
        if (neox) {
            i = d < half ? d : d - half;
            a = i;
            b = i + half;
        } else {
            i = d / 2;
            a = 2 * i;
            b = 2 * i + 1;
        }
        bool first = neox ? d < half : (d % 2 == 0);
        out[n] = first ? v[a] * c[i] - v[b] * s[i] : v[a] * s[i] + v[b] * c[i];
    }
    n = 0;
    if (part == 0) {
        float* o = q_out + ((size_t)t * nh + h) * hd;
        for (uint32_t d = lane; d < hd; d += 32, n++) o[d] = out[n];
    } else {
        uint32_t slot = slots[t];
        if (slot == TS_NO_SLOT) return;
        // The rotated row back into shared memory, then stored (a
        // quantized row: a lane per 64 values).
        __syncwarp();
        for (uint32_t d = lane; d < hd; d += 32, n++) v[d] = out[n];
        __syncwarp();
        E::store_row(v, kc + E::units(((ts_u64)slot * kvh + h) * hd), hd, lane, 32);
    }
}

#define TS_QKV(suffix, E)                                                                     \
    extern "C" __global__ void __launch_bounds__(32) tessera_fwd_qkv_##suffix(               \
        const float* __restrict__ qkv, uint32_t stride, const float* __restrict__ bq,         \
        const float* __restrict__ bk, const float* __restrict__ bv,                           \
        const float* __restrict__ qn, const float* __restrict__ kn, float eps,                \
        const float* __restrict__ cos, const float* __restrict__ sin,                         \
        float* __restrict__ q_out, E::Raw* __restrict__ kc, E::Raw* __restrict__ vc,          \
        const uint32_t* __restrict__ slots, uint32_t nh, uint32_t kvh, uint32_t hd,           \
        uint32_t neox) {                                                                      \
        ts_qkv<E>(qkv, stride, bq, bk, bv, qn, kn, eps, cos, sin, q_out, kc, vc, slots, nh,   \
                  kvh, hd, neox);                                                             \
    }

TS_QKV(f32, TsF32)
TS_QKV(f16, TsF16)
TS_QKV(bf16, TsBf16)
TS_QKV(q8_0, TsKvQ8_0)
TS_QKV(q4_0, TsKvQ4_0)
