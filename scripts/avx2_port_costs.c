/* What the 256-bit integer products and their sums cost on this CPU, one
 * thread: twelve independent chains each of `vpmaddubsw`, `vpmaddwd`,
 * `vpaddw`, `vfmadd231ps` and `vpdpbusd` (AVX-VNNI, when the CPU has it),
 * and `vpmaddubsw` mixed one for one with `vpaddw`: which ports the two
 * levels' AVX2 products (crates/kernels/src/linear/qdot/panel.rs) share,
 * against the single-level kernels of llama.cpp's AVX2 build
 * (docs/performance-notes.md, "AVX2 on an Intel core: the two levels'
 * ceiling"). Instructions a second, in G; FMA's rate gives the clock (two
 * a cycle on every x86 core with two FMA units).
 *
 *   cc -O2 -o target/avx2_port_costs scripts/avx2_port_costs.c
 *   ./target/avx2_port_costs
 */
#include <stdio.h>
#include <time.h>
static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
#define N 100000000L
#define X12(op)                                                               \
  op " %%ymm15,%%ymm14,%%ymm0\n" op " %%ymm15,%%ymm14,%%ymm1\n" op            \
     " %%ymm15,%%ymm14,%%ymm2\n" op " %%ymm15,%%ymm14,%%ymm3\n" op            \
     " %%ymm15,%%ymm14,%%ymm4\n" op " %%ymm15,%%ymm14,%%ymm5\n" op            \
     " %%ymm15,%%ymm14,%%ymm6\n" op " %%ymm15,%%ymm14,%%ymm7\n" op            \
     " %%ymm15,%%ymm14,%%ymm8\n" op " %%ymm15,%%ymm14,%%ymm9\n" op            \
     " %%ymm15,%%ymm14,%%ymm10\n" op " %%ymm15,%%ymm14,%%ymm11\n"
#define CLOBBER                                                               \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",     \
      "xmm9", "xmm10", "xmm11"
#define TIME(name, body)                                                      \
  do {                                                                        \
    double t0 = now();                                                        \
    for (long n = 0; n < N; n++) __asm__ volatile(body ::: CLOBBER);          \
    printf("%-28s %5.2f G/s\n", name, 12.0 * N / (now() - t0) / 1e9);         \
  } while (0)
int main(void) {
  TIME("vpmaddubsw", X12("vpmaddubsw"));
  TIME("vpmaddwd", X12("vpmaddwd"));
  TIME("vpaddw", X12("vpaddw"));
  TIME("vpmaddubsw + vpaddw, 1:1",
       "vpmaddubsw %%ymm15,%%ymm14,%%ymm0\n vpaddw %%ymm15,%%ymm14,%%ymm1\n"
       "vpmaddubsw %%ymm15,%%ymm14,%%ymm2\n vpaddw %%ymm15,%%ymm14,%%ymm3\n"
       "vpmaddubsw %%ymm15,%%ymm14,%%ymm4\n vpaddw %%ymm15,%%ymm14,%%ymm5\n"
       "vpmaddubsw %%ymm15,%%ymm14,%%ymm6\n vpaddw %%ymm15,%%ymm14,%%ymm7\n"
       "vpmaddubsw %%ymm15,%%ymm14,%%ymm8\n vpaddw %%ymm15,%%ymm14,%%ymm9\n"
       "vpmaddubsw %%ymm15,%%ymm14,%%ymm10\n vpaddw %%ymm15,%%ymm14,%%ymm11\n");
  TIME("vfmadd231ps", X12("vfmadd231ps"));
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avxvnni"))
    TIME("vpdpbusd (AVX-VNNI)", X12("%{vex%} vpdpbusd"));
  return 0;
}
