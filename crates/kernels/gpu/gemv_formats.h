// The GGML block formats as the CUDA forward's products read them, and
// one lane's share of a product (ts_row_dots): gpu/forward.cu's, shared
// with the kernel-emu build (gpu/emu.cpp), whose tests expand every item
// of random blocks on the CPU and compare them with candle's
// dequantization bit for bit, and run every lane of every product shape
// the kernels are built in against the dot products in f64. Needs a
// prelude first (prelude_cuda.h or prelude_host.h): TS_INLINE, TS_STATIC,
// float4, the loads ts_load_u16/u32/u128 (at 2-, 4- and 16-byte aligned
// addresses) and ts_load_f4, ts_byte_perm, ts_bits_float, ts_f16_to_f32
// and TS_UNROLL.
#pragma once

TS_INLINE float ts_h2f(uint32_t bits) { return ts_f16_to_f32((uint16_t)bits); }

// Four bytes at an even address (every block field the items read is at
// one; blocks of 18, 34 or 210 bytes are not 4-aligned).
TS_INLINE uint32_t ts_ld4(const uint8_t* p) {
    return ts_load_u16(p) | (ts_load_u16(p + 2) << 16);
}


TS_INLINE uint32_t ts_byte(uint32_t q, int e) { return (q >> (8 * e)) & 0xffu; }

// Four bytes at a 4-aligned address (the fields of 20-, 144- and 176-byte
// blocks, whose rows are 4-aligned too).
TS_INLINE uint32_t ts_ld4a(const uint8_t* p) { return ts_load_u32(p); }

// Byte n (0..11) of the 12 scale bytes held as three words.
TS_INLINE uint32_t ts_scale_byte(const uint32_t* s, uint32_t n) {
    uint32_t word = n < 4 ? s[0] : (n < 8 ? s[1] : s[2]);
    return (word >> (8 * (n & 3))) & 0xffu;
}

// llama.cpp's get_scale_min_k4: sub-block j's 6-bit scale and min, from
// the 12 scale bytes as three words.
TS_INLINE void ts_scale_min_k4(uint32_t j, const uint32_t* q, float* sc, float* m) {
    if (j < 4) {
        *sc = (float)(ts_scale_byte(q, j) & 63);
        *m = (float)(ts_scale_byte(q, j + 4) & 63);
    } else {
        *sc = (float)((ts_scale_byte(q, j + 4) & 0xF) | ((ts_scale_byte(q, j - 4) >> 6) << 4));
        *m = (float)((ts_scale_byte(q, j + 4) >> 4) | ((ts_scale_byte(q, j) >> 6) << 4));
    }
}

// Q4_K's and Q5_K's scale and minimum for 64-value chunk c (sub-blocks 2c
// and 2c + 1) of a super-block, from its first word (d and dmin) and its
// 12 scale bytes as three words: d·sc and dmin·m of each.
TS_INLINE void ts_k_chunk(uint32_t dm, const uint32_t* scales, uint32_t c,
                                           float* d1, float* m1, float* d2, float* m2) {
    float d = ts_h2f(dm & 0xffffu);
    float dmin = ts_h2f(dm >> 16);
    float sc, m;
    ts_scale_min_k4(2 * c, scales, &sc, &m);
    *d1 = d * sc;
    *m1 = dmin * m;
    ts_scale_min_k4(2 * c + 1, scales, &sc, &m);
    *d2 = d * sc;
    *m2 = dmin * m;
}

// Byte e of q as an exact f32 less `bias`, without the integer-to-float
// conversion (an eighth of the FMA rate on sm_80/sm_90, and one per weight
// here): the byte in the low mantissa bits of 2^23, minus 2^23 + bias.
TS_INLINE float ts_bytef(uint32_t q, int e, float bias) {
    return ts_bits_float(ts_byte_perm(q, 0x4B000000u, 0x7650u + e)) - (8388608.0f + bias);
}

// The same for an integer v < 2^23.
TS_INLINE float ts_u2f(uint32_t v, float bias) {
    return ts_bits_float(0x4B000000u | v) - (8388608.0f + bias);
}


// Each format: row_bytes(k), items(k) per row, and for item i of a row:
// load(row, i, raw), the item's bytes as they are (a few registers, so
// that a lane has many items' loads in flight before it needs any);
// offsets(i, off), where its RUNS runs of 4 weights meet the inputs
// (off[r]..off[r]+4); expand(raw, i, w), the weights w[4r..4r+4) in f32.
// U1 and UM: the items a lane loads at once for one token (half as many
// of each of the gated activation's two rows), and for up to TS_FWD_MAXT
// (fewer for the formats whose items take more registers).
struct TsQ4_0 {
    static const int RUNS = 2, U1 = 8, UM = 2;
    struct Raw {
        uint32_t d, q;
    };
    TS_STATIC size_t row_bytes(uint32_t k) { return (size_t)(k / 32) * 18; }
    TS_STATIC uint32_t items(uint32_t k) { return k / 32 * 4; }
    TS_STATIC void load(const uint8_t* row, uint32_t i, Raw& r) {
        const uint8_t* blk = row + (size_t)(i >> 2) * 18;
        r.d = ts_load_u16(blk);
        r.q = ts_ld4(blk + 2 + (i & 3) * 4);
    }
    TS_STATIC void offsets(uint32_t i, uint32_t* off) {
        off[0] = (i >> 2) * 32 + (i & 3) * 4;
        off[1] = off[0] + 16;
    }
    TS_STATIC void expand(const Raw& r, uint32_t, float* w) {
        float d = ts_h2f(r.d);
        uint32_t lo = r.q & 0x0F0F0F0Fu, hi = (r.q >> 4) & 0x0F0F0F0Fu;
TS_UNROLL
        for (int e = 0; e < 4; e++) {
            w[e] = ts_bytef(lo, e, 8.0f) * d;
            w[4 + e] = ts_bytef(hi, e, 8.0f) * d;
        }
    }
};

struct TsQ4_1 {
    static const int RUNS = 2, U1 = 8, UM = 2;
    struct Raw {
        uint32_t dm, q;
    };
    TS_STATIC size_t row_bytes(uint32_t k) { return (size_t)(k / 32) * 20; }
    TS_STATIC uint32_t items(uint32_t k) { return k / 32 * 4; }
    TS_STATIC void load(const uint8_t* row, uint32_t i, Raw& r) {
        const uint8_t* blk = row + (size_t)(i >> 2) * 20;
        r.dm = ts_ld4a(blk);
        r.q = ts_ld4a(blk + 4 + (i & 3) * 4);
    }
    TS_STATIC void offsets(uint32_t i, uint32_t* off) {
        off[0] = (i >> 2) * 32 + (i & 3) * 4;
        off[1] = off[0] + 16;
    }
    TS_STATIC void expand(const Raw& r, uint32_t, float* w) {
        float d = ts_h2f(r.dm & 0xffffu), m = ts_h2f(r.dm >> 16);
        uint32_t lo = r.q & 0x0F0F0F0Fu, hi = (r.q >> 4) & 0x0F0F0F0Fu;
TS_UNROLL
        for (int e = 0; e < 4; e++) {
            w[e] = ts_bytef(lo, e, 0.0f) * d + m;
            w[4 + e] = ts_bytef(hi, e, 0.0f) * d + m;
        }
    }
};

struct TsQ8_0 {
    static const int RUNS = 2, U1 = 8, UM = 2;
    struct Raw {
        uint32_t d, q0, q1;
    };
    TS_STATIC size_t row_bytes(uint32_t k) { return (size_t)(k / 32) * 34; }
    TS_STATIC uint32_t items(uint32_t k) { return k / 32 * 4; }
    TS_STATIC void load(const uint8_t* row, uint32_t i, Raw& r) {
        const uint8_t* blk = row + (size_t)(i >> 2) * 34;
        uint32_t j = (i & 3) * 8;
        r.d = ts_load_u16(blk);
        r.q0 = ts_ld4(blk + 2 + j);
        r.q1 = ts_ld4(blk + 6 + j);
    }
    TS_STATIC void offsets(uint32_t i, uint32_t* off) {
        off[0] = (i >> 2) * 32 + (i & 3) * 8;
        off[1] = off[0] + 4;
    }
    TS_STATIC void expand(const Raw& r, uint32_t, float* w) {
        float d = ts_h2f(r.d);
        // Signed bytes as unsigned ones 128 higher.
        uint32_t a = r.q0 ^ 0x80808080u, b = r.q1 ^ 0x80808080u;
TS_UNROLL
        for (int e = 0; e < 4; e++) {
            w[e] = ts_bytef(a, e, 128.0f) * d;
            w[4 + e] = ts_bytef(b, e, 128.0f) * d;
        }
    }
};

struct TsQ4_K {
    static const int RUNS = 2, U1 = 4, UM = 2;
    struct Raw {
        uint32_t dm, s[3], q;
    };
    TS_STATIC size_t row_bytes(uint32_t k) { return (size_t)(k / 256) * 144; }
    TS_STATIC uint32_t items(uint32_t k) { return k / 256 * 32; }
    TS_STATIC void load(const uint8_t* row, uint32_t i, Raw& r) {
        uint32_t c = (i & 31) >> 3, l = (i & 7) * 4;
        const uint8_t* blk = row + (size_t)(i >> 5) * 144;
        r.dm = ts_ld4a(blk);
        r.s[0] = ts_ld4a(blk + 4);
        r.s[1] = ts_ld4a(blk + 8);
        r.s[2] = ts_ld4a(blk + 12);
        r.q = ts_ld4a(blk + 16 + c * 32 + l);
    }
    TS_STATIC void offsets(uint32_t i, uint32_t* off) {
        off[0] = (i >> 5) * 256 + ((i & 31) >> 3) * 64 + (i & 7) * 4;
        off[1] = off[0] + 32;
    }
    TS_STATIC void expand(const Raw& r, uint32_t i, float* w) {
        float d1, mm1, d2, mm2;
        ts_k_chunk(r.dm, r.s, (i & 31) >> 3, &d1, &mm1, &d2, &mm2);
        uint32_t lo = r.q & 0x0F0F0F0Fu, hi = (r.q >> 4) & 0x0F0F0F0Fu;
TS_UNROLL
        for (int e = 0; e < 4; e++) {
            w[e] = d1 * ts_bytef(lo, e, 0.0f) - mm1;
            w[4 + e] = d2 * ts_bytef(hi, e, 0.0f) - mm2;
        }
    }
};

struct TsQ5_K {
    static const int RUNS = 2, U1 = 4, UM = 2;
    struct Raw {
        uint32_t dm, s[3], h, q;
    };
    TS_STATIC size_t row_bytes(uint32_t k) { return (size_t)(k / 256) * 176; }
    TS_STATIC uint32_t items(uint32_t k) { return k / 256 * 32; }
    TS_STATIC void load(const uint8_t* row, uint32_t i, Raw& r) {
        uint32_t c = (i & 31) >> 3, l = (i & 7) * 4;
        const uint8_t* blk = row + (size_t)(i >> 5) * 176;
        r.dm = ts_ld4a(blk);
        r.s[0] = ts_ld4a(blk + 4);
        r.s[1] = ts_ld4a(blk + 8);
        r.s[2] = ts_ld4a(blk + 12);
        r.h = ts_ld4a(blk + 16 + l);
        r.q = ts_ld4a(blk + 48 + c * 32 + l);
    }
    TS_STATIC void offsets(uint32_t i, uint32_t* off) {
        off[0] = (i >> 5) * 256 + ((i & 31) >> 3) * 64 + (i & 7) * 4;
        off[1] = off[0] + 32;
    }
    TS_STATIC void expand(const Raw& r, uint32_t i, float* w) {
        uint32_t c = (i & 31) >> 3;
        float d1, mm1, d2, mm2;
        ts_k_chunk(r.dm, r.s, c, &d1, &mm1, &d2, &mm2);
        uint32_t u1 = 1u << (2 * c), u2 = 2u << (2 * c);
TS_UNROLL
        for (int e = 0; e < 4; e++) {
            uint32_t he = ts_byte(r.h, e), qe = ts_byte(r.q, e);
            w[e] = d1 * ts_u2f((qe & 15) | ((he & u1) ? 16u : 0u), 0.0f) - mm1;
            w[4 + e] = d2 * ts_u2f((qe >> 4) | ((he & u2) ? 16u : 0u), 0.0f) - mm2;
        }
    }
};

struct TsQ6_K {
    static const int RUNS = 4, U1 = 4, UM = 2;
    struct Raw {
        uint32_t d, sc0, sc1, ql0, ql1, qh;
    };
    TS_STATIC size_t row_bytes(uint32_t k) { return (size_t)(k / 256) * 210; }
    TS_STATIC uint32_t items(uint32_t k) { return k / 256 * 16; }
    TS_STATIC void load(const uint8_t* row, uint32_t i, Raw& r) {
        uint32_t n = (i & 15) >> 3, l = (i & 7) * 4;
        const uint8_t* blk = row + (size_t)(i >> 4) * 210;
        r.d = ts_load_u16(blk + 208);
        r.sc0 = ts_ld4(blk + 192 + n * 8);
        r.sc1 = ts_ld4(blk + 196 + n * 8);
        r.ql0 = ts_ld4(blk + n * 64 + l);
        r.ql1 = ts_ld4(blk + n * 64 + 32 + l);
        r.qh = ts_ld4(blk + 128 + n * 32 + l);
    }
    TS_STATIC void offsets(uint32_t i, uint32_t* off) {
        uint32_t base = (i >> 4) * 256 + ((i & 15) >> 3) * 128 + (i & 7) * 4;
        off[0] = base;
        off[1] = base + 32;
        off[2] = base + 64;
        off[3] = base + 96;
    }
    TS_STATIC void expand(const Raw& r, uint32_t i, float* w) {
        // The item's four scales: signed bytes is, is + 2 (first word) and
        // is, is + 2 of the second (bytes is + 4, is + 6 of the eight).
        int is = ((i & 7) * 4) / 16;
        float d = ts_h2f(r.d);
        uint32_t a0 = r.sc0 ^ 0x80808080u, a1 = r.sc1 ^ 0x80808080u;
        float s0 = d * ts_bytef(a0, is, 128.0f), s1 = d * ts_bytef(a0, is + 2, 128.0f),
              s2 = d * ts_bytef(a1, is, 128.0f), s3 = d * ts_bytef(a1, is + 2, 128.0f);
TS_UNROLL
        for (int e = 0; e < 4; e++) {
            uint32_t a = ts_byte(r.ql0, e), b = ts_byte(r.ql1, e), h = ts_byte(r.qh, e);
            w[e] = s0 * ts_u2f((a & 15) | ((h & 3) << 4), 32.0f);
            w[4 + e] = s1 * ts_u2f((b & 15) | (((h >> 2) & 3) << 4), 32.0f);
            w[8 + e] = s2 * ts_u2f((a >> 4) | (((h >> 4) & 3) << 4), 32.0f);
            w[12 + e] = s3 * ts_u2f((b >> 4) | (((h >> 6) & 3) << 4), 32.0f);
        }
    }
};

struct TsF32W {
    static const int RUNS = 2, U1 = 4, UM = 1;
    struct Raw {
        uint4 a, b;
    };
    TS_STATIC size_t row_bytes(uint32_t k) { return (size_t)k * 4; }
    TS_STATIC uint32_t items(uint32_t k) { return k / 8; }
    TS_STATIC void load(const uint8_t* row, uint32_t i, Raw& r) {
        r.a = ts_load_u128(row + (size_t)i * 32);
        r.b = ts_load_u128(row + (size_t)i * 32 + 16);
    }
    TS_STATIC void offsets(uint32_t i, uint32_t* off) {
        off[0] = i * 8;
        off[1] = i * 8 + 4;
    }
    TS_STATIC void expand(const Raw& r, uint32_t, float* w) {
        w[0] = ts_bits_float(r.a.x), w[1] = ts_bits_float(r.a.y);
        w[2] = ts_bits_float(r.a.z), w[3] = ts_bits_float(r.a.w);
        w[4] = ts_bits_float(r.b.x), w[5] = ts_bits_float(r.b.y);
        w[6] = ts_bits_float(r.b.z), w[7] = ts_bits_float(r.b.w);
    }
};

struct TsF16W {
    static const int RUNS = 2, U1 = 4, UM = 2;
    struct Raw {
        uint4 h;
    };
    TS_STATIC size_t row_bytes(uint32_t k) { return (size_t)k * 2; }
    TS_STATIC uint32_t items(uint32_t k) { return k / 8; }
    TS_STATIC void load(const uint8_t* row, uint32_t i, Raw& r) {
        r.h = ts_load_u128(row + (size_t)i * 16);
    }
    TS_STATIC void offsets(uint32_t i, uint32_t* off) {
        off[0] = i * 8;
        off[1] = i * 8 + 4;
    }
    TS_STATIC void expand(const Raw& r, uint32_t, float* w) {
        uint32_t v[4] = {r.h.x, r.h.y, r.h.z, r.h.w};
TS_UNROLL
        for (int e = 0; e < 4; e++) {
            w[2 * e] = ts_h2f(v[e] & 0xffffu);
            w[2 * e + 1] = ts_h2f(v[e] >> 16);
        }
    }
};

// The lane's share of sum_i row[i] x[t][i] for MT tokens and R rows
// (rows[r]), added into sum[r * MT + t], the rows' items shared by the WPR
// warps' 32 * WPR lanes (`lane` counts across them). x rows are
// `x_stride` floats apart (a multiple of 4, 16-byte aligned). Each pass
// loads U items of every row per lane before using any of them (decode is
// bound by the weight bytes in flight), as raw bytes, expanded to f32
// one at a time.
template <typename F, int MT, int U, int WPR, int R>
TS_INLINE void ts_row_dots(const uint8_t* const* rows, uint32_t k, const float* xs,
                           uint32_t x_stride, uint32_t nt, uint32_t lane, float* sum) {
    const uint32_t lanes = 32 * WPR;
    uint32_t items = F::items(k);
    for (uint32_t base = lane; base < items; base += lanes * U) {
        typename F::Raw raw[R][U];
TS_UNROLL
        for (int u = 0; u < U; u++) {
            if (base + lanes * u < items) {
TS_UNROLL
                for (int r = 0; r < R; r++) F::load(rows[r], base + lanes * u, raw[r][u]);
            }
        }
TS_UNROLL
        for (int u = 0; u < U; u++) {
            uint32_t i = base + lanes * u;
            if (i >= items) break;
            uint32_t off[F::RUNS];
            F::offsets(i, off);
            float wv[R][F::RUNS * 4];
TS_UNROLL
            for (int r = 0; r < R; r++) F::expand(raw[r][u], i, wv[r]);
TS_UNROLL
            for (int t = 0; t < MT; t++) {
                if ((uint32_t)t < nt) {
                    const float* xt = xs + (size_t)t * x_stride;
                    float4 v[F::RUNS];
TS_UNROLL
                    for (int q = 0; q < F::RUNS; q++) v[q] = ts_load_f4(xt + off[q]);
TS_UNROLL
                    for (int r = 0; r < R; r++) {
                        float s = 0.0f;
TS_UNROLL
                        for (int q = 0; q < F::RUNS; q++) {
                            s += wv[r][4 * q] * v[q].x + wv[r][4 * q + 1] * v[q].y +
                                 wv[r][4 * q + 2] * v[q].z + wv[r][4 * q + 3] * v[q].w;
                        }
                        sum[r * MT + t] += s;
                    }
                }
            }
        }
    }
}

// Item `idx` of a weight of rows of `k` values (items(k) a row, rows one
// after another), expanded to f32 into its row of `out` (row-major, `k`
// floats a row): what the CUDA forward's long batches multiply through
// cuBLAS.
template <typename F>
TS_INLINE void ts_dequant_item(const uint8_t* w, uint32_t k, ts_u64 idx, float* out) {
    uint32_t items = F::items(k);
    ts_u64 row = idx / items;
    uint32_t i = (uint32_t)(idx % items);
    typename F::Raw raw;
    F::load(w + row * F::row_bytes(k), i, raw);
    uint32_t off[F::RUNS];
    F::offsets(i, off);
    float v[F::RUNS * 4];
    F::expand(raw, i, v);
    float* o = out + row * k;
    TS_UNROLL
    for (int q = 0; q < F::RUNS; q++) {
        TS_UNROLL
        for (int e = 0; e < 4; e++) o[off[q] + e] = v[4 * q + e];
    }
}
