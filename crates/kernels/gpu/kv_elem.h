// The cache element types of every kernel, loaded and stored through f32
// (after a prelude: see kv_ops.h).

// A guard, not #pragma once: Metal sources inline this file's text.
#ifndef TS_KV_ELEM_H
#define TS_KV_ELEM_H
#define TS_NO_SLOT 0xffffffffu

// Every element type gives, besides its raw unit:
//   units(n)      the raw units that hold n values (n a multiple of 64 for
//                 the quantized types: whole rotated pairs of blocks)
//   at(row, i)    value i of a row, as f32 (a quantized row's value in its
//                 rotated basis: see below)
//   store_row(src, dst, n, tid, nthreads)
//                 n f32 values stored as a row, the calling threads
//                 striding over its values (a quantized row: over its
//                 groups of 64)

#define TS_FLOAT_ELEM                                                                        \
    TS_STATIC ts_u64 units(ts_u64 n) { return n; }                                           \
    TS_STATIC float at(TS_DEV const Raw* row, uint32_t i) { return load(row[i]); }          \
    TS_STATIC void store_row(TS_DEV const float* src, TS_DEV Raw* dst, uint32_t n,          \
                             uint32_t tid, uint32_t nthreads) {                              \
        for (uint32_t i = tid; i < n; i += nthreads) dst[i] = store(src[i]);                 \
    }

struct TsF32 {
    typedef float Raw;
    TS_STATIC float load(Raw x) { return x; }
    TS_STATIC Raw store(float x) { return x; }
    TS_FLOAT_ELEM
};
struct TsF16 {
    typedef uint16_t Raw;
    TS_STATIC float load(Raw x) { return ts_f16_to_f32(x); }
    TS_STATIC Raw store(float x) { return ts_f32_to_f16(x); }
    TS_FLOAT_ELEM
};
struct TsBf16 {
    typedef uint16_t Raw;
    TS_STATIC float load(Raw x) { return ts_bits_float(((uint32_t)x) << 16); }
    // Round to nearest even; a NaN stays a (quiet) NaN.
    TS_STATIC Raw store(float x) {
        uint32_t u = ts_float_bits(x);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (Raw)((u >> 16) | 0x40u);
        u += 0x7fffu + ((u >> 16) & 1u);
        return (Raw)(u >> 16);
    }
    TS_FLOAT_ELEM
};

// Quantized caches: GGML's q8_0 and q4_0 blocks (32 values and an f16
// scale, 34 and 18 bytes), each 64 values of a head row rotated by the
// orthonormal Walsh-Hadamard transform before they are quantized, as
// crates/kernels/src/kv/quant.rs lays them out and computes them (the same
// operations in the same order, so the same bits). `at` reads a value in
// the rotated basis: attention takes the queries rotated and rotates its
// output back (q.k = Hq.Hk, sum p v = H sum p Hv); every other reader
// rotates the row back first (ts_hadamard64).

// The transform of 64 values in place (Sylvester order, its own inverse):
// butterflies (a + b, a - b) over strides 1 to 32, then a scale of 1/8.
TS_INLINE void ts_hadamard64(TS_THREAD float* c) {
    TS_UNROLL
    for (uint32_t s = 0; s < 6; s++) {
        uint32_t h = 1u << s;
        TS_UNROLL
        for (uint32_t i = 0; i < 64; i += 2 * h) {
            TS_UNROLL
            for (uint32_t j = i; j < i + h; j++) {
                float a = c[j], b = c[j + h];
                c[j] = TS_ADD(a, b);
                c[j + h] = TS_SUB(a, b);
            }
        }
    }
    TS_UNROLL
    for (uint32_t i = 0; i < 64; i++) c[i] = TS_MUL(c[i], 0.125f);
}

// Rust's `x as i8` (toward zero, saturating, NaN to 0).
TS_INLINE int ts_sat_i8(float x) {
    if (!(x == x)) return 0;
    if (x >= 127.0f) return 127;
    if (x <= -128.0f) return -128;
    return (int)x;
}

TS_INLINE bool ts_all_finite32(TS_THREAD const float* x) {
    bool ok = true;
    for (uint32_t i = 0; i < 32; i++) ok = ok && (ts_float_bits(x[i]) & 0x7f800000u) != 0x7f800000u;
    return ok;
}

TS_INLINE float ts_q_scale(TS_DEV const uint8_t* b) {
    return ts_f16_to_f32((uint16_t)((uint32_t)b[0] | ((uint32_t)b[1] << 8)));
}

TS_INLINE void ts_q_put_scale(TS_DEV uint8_t* b, uint16_t d) {
    b[0] = (uint8_t)(d & 0xffu);
    b[1] = (uint8_t)(d >> 8);
}

// A row of quantized blocks, stored 64 values (two blocks) at a time.
#define TS_QUANT_ELEM                                                                        \
    typedef uint8_t Raw;                                                                     \
    TS_STATIC ts_u64 units(ts_u64 n) { return n / 32 * BYTES; }                              \
    TS_STATIC void store_row(TS_DEV const float* src, TS_DEV Raw* dst, uint32_t n,          \
                             uint32_t tid, uint32_t nthreads) {                              \
        for (uint32_t c = tid; c < n / 64; c += nthreads) {                                  \
            float t[64];                                                                     \
            TS_UNROLL                                                                        \
            for (uint32_t i = 0; i < 64; i++) t[i] = src[64 * c + i];                        \
            ts_hadamard64(t);                                                                \
            quantize(t, dst + 2 * c * BYTES);                                                \
            quantize(t + 32, dst + (2 * c + 1) * BYTES);                                     \
        }                                                                                    \
    }

struct TsKvQ8_0 {
    enum { BYTES = 34 };
    TS_QUANT_ELEM
    // d = max|x| / 127, q = round(x / d) (GGML's quantize_row_q8_0_ref).
    TS_STATIC void quantize(TS_THREAD const float* x, TS_DEV uint8_t* b) {
        float amax = 0.0f;
        for (uint32_t i = 0; i < 32; i++) amax = ts_fmax(amax, ts_fabs(x[i]));
        if (!ts_all_finite32(x)) {
            ts_q_put_scale(b, 0x7e00u);
            for (uint32_t i = 0; i < 32; i++) b[2 + i] = 0;
            return;
        }
        float d = TS_DIV(amax, 127.0f);
        float id = d != 0.0f ? TS_DIV(1.0f, d) : 0.0f;
        for (uint32_t i = 0; i < 32; i++)
            b[2 + i] = (uint8_t)(int8_t)ts_sat_i8(ts_round(TS_MUL(x[i], id)));
        ts_q_put_scale(b, ts_f32_to_f16(d));
    }
    TS_STATIC float at(TS_DEV const Raw* row, uint32_t i) {
        TS_DEV const uint8_t* b = row + (i / 32) * BYTES;
        return TS_MUL((float)(int8_t)b[2 + i % 32], ts_q_scale(b));
    }
};

struct TsKvQ4_0 {
    enum { BYTES = 18 };
    TS_QUANT_ELEM
    // m = the value of largest magnitude, d = m / -8, q = min(15, trunc(x /
    // d + 8.5)); byte j holds q_j (low nibble) and q_{j+16} (high).
    TS_STATIC void quantize(TS_THREAD const float* x, TS_DEV uint8_t* b) {
        float amax = 0.0f, mx = 0.0f;
        for (uint32_t i = 0; i < 32; i++) {
            if (amax < ts_fabs(x[i])) {
                amax = ts_fabs(x[i]);
                mx = x[i];
            }
        }
        if (!ts_all_finite32(x)) {
            ts_q_put_scale(b, 0x7e00u);
            for (uint32_t j = 0; j < 16; j++) b[2 + j] = 0x88u;
            return;
        }
        float d = TS_DIV(mx, -8.0f);
        float id = d != 0.0f ? TS_DIV(1.0f, d) : 0.0f;
        for (uint32_t j = 0; j < 16; j++) {
            int lo = ts_sat_i8(TS_ADD(TS_MUL(x[j], id), 8.5f));
            int hi = ts_sat_i8(TS_ADD(TS_MUL(x[j + 16], id), 8.5f));
            b[2 + j] = (uint8_t)((lo < 15 ? lo : 15) | ((hi < 15 ? hi : 15) << 4));
        }
        ts_q_put_scale(b, ts_f32_to_f16(d));
    }
    TS_STATIC float at(TS_DEV const Raw* row, uint32_t i) {
        TS_DEV const uint8_t* b = row + (i / 32) * BYTES;
        uint32_t j = i % 32;
        uint32_t q = j < 16 ? (b[2 + j] & 0xfu) : (b[2 + j - 16] >> 4);
        return TS_MUL((float)((int)q - 8), ts_q_scale(b));
    }
};

#endif // TS_KV_ELEM_H
