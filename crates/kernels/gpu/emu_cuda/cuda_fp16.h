// CUDA on the CPU (the `kernel-emu` feature): what `prelude_cuda.h` and
// the CUDA-only kernel files take from CUDA's headers, for the host
// compiler. `gpu/emu_cuda.cpp` compiles those files unchanged with this
// directory first on the include path, so `#include <cuda_fp16.h>` lands
// here.
//
// Each thread block runs as cooperative fibers on one OS thread, a fiber
// per GPU thread: a thread runs until it reaches a barrier
// (`__syncthreads`, `__syncwarp`, or one of the two a warp shuffle takes)
// and the block's (or warp's) next thread runs; a barrier opens once
// every thread of its block (warp) that has not returned is waiting at
// it, and a launch whose threads all wait at barriers that cannot open
// fails with a message (a barrier some threads never reach). Blocks run
// one after another. `__shared__` variables are thread-local statics,
// shared by the fibers of the block that runs and not by launches on other
// OS threads. Threads of a block can be run in either order
// (`TsEmuOrder`), so a read that a missing barrier leaves racing sees a
// different value in one of them.
#pragma once
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "../host_f16.h"

struct uint3 {
    uint32_t x, y, z;
};
struct uint4 {
    uint32_t x, y, z, w;
};
struct float4 {
    float x, y, z, w;
};

// The launch running on this OS thread (gpu/emu_cuda.cpp).
uint3 ts_emu_thread_idx();
uint3 ts_emu_block_idx();
uint3 ts_emu_block_dim();
uint3 ts_emu_grid_dim();
// Waits at the block's barrier (warp < 0) or warp `warp`'s.
void ts_emu_barrier(int warp);
// A warp shuffle's exchange: this thread's 4 bytes out, lane `from`'s in.
uint32_t ts_emu_exchange(uint32_t mine, uint32_t from);
// The launch's dynamic shared memory (16-byte aligned).
void* ts_emu_dyn_shared();

#define threadIdx (ts_emu_thread_idx())
#define blockIdx (ts_emu_block_idx())
#define blockDim (ts_emu_block_dim())
#define gridDim (ts_emu_grid_dim())

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static thread_local
#define TS_DYN_SHARED(T, n) T* n = (T*)ts_emu_dyn_shared()

inline void __syncthreads() { ts_emu_barrier(-1); }
inline void __syncwarp(uint32_t mask = 0xffffffffu) {
    (void)mask;
    ts_emu_barrier((int)(threadIdx.x / 32));
}
// Blocks run one after another and share one memory: every write is seen.
inline void __threadfence() {}

template <typename T>
inline T __shfl_xor_sync(uint32_t mask, T v, int lane_mask) {
    static_assert(sizeof(T) == 4, "4-byte shuffles only");
    (void)mask;
    uint32_t mine, got;
    memcpy(&mine, &v, 4);
    got = ts_emu_exchange(mine, (threadIdx.x % 32) ^ (uint32_t)lane_mask);
    T r;
    memcpy(&r, &got, 4);
    return r;
}

inline uint32_t atomicAdd(uint32_t* p, uint32_t v) {
    uint32_t old = *p;
    *p = old + v;
    return old;
}
inline float atomicAdd(float* p, float v) {
    float old = *p;
    *p = old + v;
    return old;
}
template <typename T>
inline T __ldcg(const T* p) {
    return *p;
}

template <typename T>
inline T min(T a, T b) {
    return b < a ? b : a;
}
template <typename T>
inline T max(T a, T b) {
    return a < b ? b : a;
}

// Rounded as written: the emu build compiles with -ffp-contract=off.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline uint32_t __float_as_uint(float f) { return ts_host_float_bits(f); }
inline float __uint_as_float(uint32_t u) { return ts_host_bits_float(u); }
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
    uint64_t v = ((uint64_t)y << 32) | x;
    uint32_t r = 0;
    for (int i = 0; i < 4; i++)
        r |= (uint32_t)((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
    return r;
}

inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

// binary16, converted as the GPU converts (round to nearest even).
struct __half {
    uint16_t bits;
};
typedef __half half;
inline __half __ushort_as_half(uint16_t b) { return __half{b}; }
inline uint16_t __half_as_ushort(__half h) { return h.bits; }
inline float __half2float(__half h) { return ts_host_f16_to_f32(h.bits); }
inline __half __float2half_rn(float f) { return __half{ts_host_f32_to_f16(f)}; }
