// The kernel vocabulary for Metal (see kv_ops.h). The Rust side compiles
// this prelude followed by the shared bodies at run time, with fast math
// off, so no multiply and add are contracted into an FMA.
#include <metal_stdlib>
using namespace metal;

typedef unsigned char uint8_t;
typedef signed char int8_t;
typedef ushort uint16_t;
typedef uint uint32_t;
typedef ulong ts_u64;

#define TS_KERNEL(name, ...)                                                   \
    kernel void name(__VA_ARGS__,                                              \
                     uint3 ts_b [[threadgroup_position_in_grid]],              \
                     uint3 ts_t [[thread_position_in_threadgroup]],            \
                     uint3 ts_n [[threads_per_threadgroup]])
#define TS_BUF(T, n, i) device T* n [[buffer(i)]]
#define TS_ARG(T, n, i) constant T& n [[buffer(i)]]
#define TS_DEV device
// A threadgroup array declared in a kernel (the kernel-emu build's
// stand-in for <metal_stdlib> defines it its own way).
#ifndef TS_GROUP_ARRAY
#define TS_GROUP_ARRAY(T, n, size) threadgroup T n[size]
#endif
#define TS_INLINE static inline
#define TS_STATIC static inline

struct TsIdx {
    uint32_t blk, tid, nthreads;
};
#define TS_IDX (TsIdx{ts_b.x, ts_t.x, ts_n.x})

#define TS_MUL(a, b) ((a) * (b))
#define TS_ADD(a, b) ((a) + (b))
#define TS_SUB(a, b) ((a) - (b))
#define TS_DIV(a, b) ((a) / (b))
#define TS_THREAD thread
#define TS_UNROLL
TS_INLINE float ts_fmax(float a, float b) { return fmax(a, b); }
TS_INLINE float ts_fabs(float x) { return fabs(x); }
// Halfway cases away from zero (Rust's f32::round).
TS_INLINE float ts_round(float x) { return round(x); }

TS_INLINE uint32_t ts_float_bits(float f) { return as_type<uint32_t>(f); }
TS_INLINE float ts_bits_float(uint32_t u) { return as_type<float>(u); }
TS_INLINE float ts_f16_to_f32(uint16_t h) { return float(as_type<half>(h)); }
TS_INLINE uint16_t ts_f32_to_f16(float f) { return as_type<uint16_t>(half(f)); }
