// The kernel vocabulary for CUDA (see kv_ops.h). nvcc compiles this
// prelude and the shared bodies to PTX; the Rust side launches them on
// candle's stream.
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

typedef unsigned long long ts_u64;

#define TS_KERNEL(name, ...) extern "C" __global__ void name(__VA_ARGS__)
#define TS_BUF(T, n, i) T* __restrict__ n
#define TS_ARG(T, n, i) T n
#define TS_DEV
#define TS_INLINE __device__ __forceinline__
#define TS_STATIC static __device__ __forceinline__

struct TsIdx {
    uint32_t blk, tid, nthreads;
};
#define TS_IDX (TsIdx{blockIdx.x, threadIdx.x, blockDim.x})

// Rounded one operation at a time, never contracted into an FMA, so the
// results equal the CPU's.
#define TS_MUL(a, b) __fmul_rn(a, b)
#define TS_ADD(a, b) __fadd_rn(a, b)
#define TS_SUB(a, b) __fsub_rn(a, b)
#define TS_DIV(a, b) __fdiv_rn(a, b)
#define TS_THREAD
#define TS_UNROLL _Pragma("unroll")
TS_INLINE float ts_fmax(float a, float b) { return fmaxf(a, b); }
TS_INLINE float ts_fabs(float x) { return fabsf(x); }
// Halfway cases away from zero (Rust's f32::round).
TS_INLINE float ts_round(float x) { return roundf(x); }

TS_INLINE uint32_t ts_float_bits(float f) { return __float_as_uint(f); }
TS_INLINE float ts_bits_float(uint32_t u) { return __uint_as_float(u); }
TS_INLINE float ts_f16_to_f32(uint16_t h) { return __half2float(__ushort_as_half(h)); }
TS_INLINE uint16_t ts_f32_to_f16(float f) { return __half_as_ushort(__float2half_rn(f)); }

// The block's dynamic shared memory (the launch sizes it) as an array of
// T named n. The kernel-emu build's stand-in for CUDA's header defines it
// its own way (gpu/emu_cuda/cuda_fp16.h).
#ifndef TS_DYN_SHARED
#define TS_DYN_SHARED(T, n) extern __shared__ T n[]
#endif

// Loads at 2-, 4- and 16-byte aligned addresses, the byte permutation
// (PRMT), and loops unrolled (gemv_formats.h).
TS_INLINE uint32_t ts_load_u16(const uint8_t* p) { return *(const uint16_t*)p; }
TS_INLINE uint32_t ts_load_u32(const uint8_t* p) { return *(const uint32_t*)p; }
TS_INLINE uint4 ts_load_u128(const uint8_t* p) { return *(const uint4*)p; }
TS_INLINE uint32_t ts_byte_perm(uint32_t x, uint32_t y, uint32_t s) { return __byte_perm(x, y, s); }
TS_INLINE float4 ts_load_f4(const float* p) { return *(const float4*)p; }
