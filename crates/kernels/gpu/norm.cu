// rms_norm for the GPU forward (crates/kernels/src/norm.rs): one thread
// block per row, y = x / sqrt(mean(x^2) + eps) * w, f32. The row's sum of
// squares: strided partial sums per thread, then warp shuffles, then the
// warps' sums in order.
#include "prelude_cuda.h"

#define TS_NORM_THREADS 256

extern "C" __global__ void __launch_bounds__(TS_NORM_THREADS)
    tessera_rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                     float* __restrict__ y, uint32_t cols, float eps) {
    __shared__ float warp_sums[TS_NORM_THREADS / 32];
    const float* xr = x + (ts_u64)blockIdx.x * cols;
    float* yr = y + (ts_u64)blockIdx.x * cols;
    float ss = 0.0f;
    for (uint32_t c = threadIdx.x; c < cols; c += blockDim.x) ss += xr[c] * xr[c];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = ss;
    __syncthreads();
    float total = 0.0f;
    for (uint32_t i = 0; i < blockDim.x / 32; i++) total += warp_sums[i];
    float scale = 1.0f / sqrtf(total / (float)cols + eps);
    for (uint32_t c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = xr[c] * scale * w[c];
}
