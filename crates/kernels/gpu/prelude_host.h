// The kernel vocabulary for the host (the `kernel-emu` feature): the same
// kernel source compiled as C++ for the CPU. Each entry point takes the
// position of one GPU thread first; the Rust side calls it for every
// thread of the grid it would launch, one after another. Compiled with
// -ffp-contract=off so no multiply and add fuse.
#pragma once
#include <stdint.h>
#include <math.h>
#include <string.h>

#include "host_f16.h"

typedef uint64_t ts_u64;

struct TsIdx {
    uint32_t blk, tid, nthreads;
};

#define TS_KERNEL(name, ...) extern "C" void name(TsIdx ts_idx, __VA_ARGS__)
#define TS_BUF(T, n, i) T* n
#define TS_ARG(T, n, i) T n
#define TS_DEV
#define TS_INLINE static inline
#define TS_STATIC static inline
#define TS_IDX ts_idx

#define TS_MUL(a, b) ((a) * (b))
#define TS_ADD(a, b) ((a) + (b))
#define TS_SUB(a, b) ((a) - (b))
#define TS_DIV(a, b) ((a) / (b))
#define TS_THREAD
#define TS_UNROLL
TS_INLINE float ts_fmax(float a, float b) { return fmaxf(a, b); }
TS_INLINE float ts_fabs(float x) { return fabsf(x); }
// Halfway cases away from zero (Rust's f32::round).
TS_INLINE float ts_round(float x) { return roundf(x); }

TS_INLINE uint32_t ts_float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
TS_INLINE float ts_bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// IEEE binary16 <-> binary32, round to nearest even (host_f16.h, which
// the emulator's stand-ins for CUDA and Metal share).
TS_INLINE float ts_f16_to_f32(uint16_t h) { return ts_host_f16_to_f32(h); }
TS_INLINE uint16_t ts_f32_to_f16(float f) { return ts_host_f32_to_f16(f); }

// CUDA's vector of four words, the loads at 2-, 4- and 16-byte aligned
// addresses, and the byte permutation of __byte_perm (PRMT): byte i of the
// result is byte s[4i..4i+3] of the eight of (y:x) (gemv_formats.h).
struct uint4 {
    uint32_t x, y, z, w;
};
TS_INLINE uint32_t ts_load_u16(const uint8_t* p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}
TS_INLINE uint32_t ts_load_u32(const uint8_t* p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
TS_INLINE uint4 ts_load_u128(const uint8_t* p) {
    uint4 v;
    memcpy(&v, p, 16);
    return v;
}
TS_INLINE uint32_t ts_byte_perm(uint32_t x, uint32_t y, uint32_t s) {
    uint64_t v = ((uint64_t)y << 32) | x;
    uint32_t r = 0;
    for (int i = 0; i < 4; i++) r |= (uint32_t)((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
    return r;
}
struct float4 {
    float x, y, z, w;
};
TS_INLINE float4 ts_load_f4(const float* p) {
    float4 v;
    memcpy(&v, p, 16);
    return v;
}
