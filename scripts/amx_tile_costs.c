/* What AMX's tile instructions cost on this CPU, one thread: `tdpbssd`
 * at K = 16, 32 and 64 bytes (six independent chains), a product from
 * zero with its `tilestored`, stores alone, and two tile loads with a
 * product and its store: the floor under the prompt kernel's tiles
 * (crates/kernels/src/linear/qdot/amx.rs), beside which
 * `examples/prefill_tiles` shows what the kernel reaches
 * (docs/performance-notes.md, "AMX: what a tile instruction costs"); then
 * one two-level block's tile work in each of the two layouts the kernel
 * was tried in, inputs as A (kept) and weights as A (performance-notes.md,
 * "AMX with weights as the tile's rows").
 *
 *   clang -O2 -mamx-tile -mamx-int8 -o target/amx_tile_costs scripts/amx_tile_costs.c
 *   ./target/amx_tile_costs
 *
 * Linux only (the tiles' state is asked for with arch_prctl). */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
typedef struct { uint8_t palette, start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static int8_t A[16*64] __attribute__((aligned(64))), B[16*64] __attribute__((aligned(64)));
static int32_t C[8][16*16] __attribute__((aligned(64)));
/* 64 blocks of weights and of 16 inputs' two levels, for the layouts. */
static int8_t W[64][1024] __attribute__((aligned(64))), X[64][1024] __attribute__((aligned(64)));
/* tmm0, tmm1 of rows x colsb each, tmm2 8 x 64, tmm3-tmm7 16 x 64. */
static void layout(int r0, int c0, int r1, int c1){
  cfg_t c; memset(&c,0,sizeof c); c.palette=1;
  c.rows[0]=r0;c.colsb[0]=c0; c.rows[1]=r1;c.colsb[1]=c1; c.rows[2]=8;c.colsb[2]=64;
  for(int t=3;t<8;t++){c.rows[t]=16;c.colsb[t]=64;}
  _tile_loadconfig(&c);
}
int main(void){
  /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
  if(syscall(SYS_arch_prctl,0x1023,18)){puts("this CPU or kernel gives no AMX tiles");return 1;}
  for(int i=0;i<1024;i++){A[i]=i;B[i]=i*3;}
  int Ks[3]={16,32,64};
  for(int kk=0;kk<3;kk++){
    int K=Ks[kk];
    cfg_t c; memset(&c,0,sizeof c); c.palette=1;
    c.rows[0]=16;c.colsb[0]=K; c.rows[1]=K/4;c.colsb[1]=64;
    for(int t=2;t<8;t++){c.rows[t]=16;c.colsb[t]=64;}
    _tile_loadconfig(&c);
    _tile_loadd(0,A,64); _tile_loadd(1,B,64);
    long N=20000000; double t0=now();
    for(long n=0;n<N;n++){ _tile_dpbssd(2,0,1);_tile_dpbssd(3,0,1);_tile_dpbssd(4,0,1);_tile_dpbssd(5,0,1);_tile_dpbssd(6,0,1);_tile_dpbssd(7,0,1);}
    double dt=now()-t0; printf("K=%d tdpbssd indep: %.2f ns each, %.0f G MAC/s\n",K,dt/N/6*1e9, 16.0*16*K*N*6/dt/1e9);
    N=5000000; t0=now();
    for(long n=0;n<N;n++){ _tile_zero(2);_tile_dpbssd(2,0,1);_tile_stored(2,C[n&1],64);_tile_zero(3);_tile_dpbssd(3,0,1);_tile_stored(3,C[2+(n&1)],64);}
    dt=now()-t0; printf("K=%d zero+dp+store: %.2f ns each\n",K,dt/N/2*1e9);
    N=5000000; t0=now();
    for(long n=0;n<N;n++){ _tile_stored(2,C[n&3],64);_tile_stored(3,C[4+(n&3)],64);}
    dt=now()-t0; printf("store only: %.2f ns each\n",dt/N/2*1e9);
    N=5000000; t0=now();
    for(long n=0;n<N;n++){ _tile_loadd(0,A,64);_tile_loadd(1,B,64);_tile_zero(2);_tile_dpbssd(2,0,1);_tile_stored(2,C[n&1],64);}
    dt=now()-t0; printf("K=%d 2 loads+zero+dp+store: %.2f ns each\n",K,dt/N*1e9);
    _tile_release();
  }
  for(int j=0;j<64;j++)for(int i=0;i<1024;i++){W[j][i]=i+j;X[j][i]=i*3-j;}
  long N=4000000; double t0,dt;
  /* Inputs as A (16 x 32 bytes a level, rows 64 bytes apart: both levels
   * in the same 16 lines), the weights as B (8 x 64), shared. */
  layout(16,32,16,32); t0=now();
  for(long n=0;n<N;n++){ int b=n&63;
    _tile_loadd(2,W[b],64); _tile_loadd(0,X[b],64); _tile_loadd(1,X[b]+32,64);
    _tile_zero(3);_tile_dpbssd(3,0,2);_tile_stored(3,C[n&1],64);
    _tile_zero(4);_tile_dpbssd(4,1,2);_tile_stored(4,C[2+(n&1)],64);}
  dt=now()-t0; printf("block, inputs as A: %.2f ns\n",dt/N*1e9);
  _tile_release();
  /* The weights as A (16 x 32 bytes, rows 32 apart), shared; each level
   * as B (8 x 64, eight lines of its own). */
  layout(16,32,8,64); t0=now();
  for(long n=0;n<N;n++){ int b=n&63;
    _tile_loadd(0,W[b],32); _tile_loadd(1,X[b],64); _tile_loadd(2,X[b]+512,64);
    _tile_zero(3);_tile_dpbssd(3,0,1);_tile_stored(3,C[n&1],64);
    _tile_zero(4);_tile_dpbssd(4,0,2);_tile_stored(4,C[2+(n&1)],64);}
  dt=now()-t0; printf("block, weights as A: %.2f ns\n",dt/N*1e9);
  _tile_release();
  return 0;
}
