// The kernel-emu build of the CUDA-only kernel files: `paged_attention.cu`
// and `forward.cu` compiled unchanged for the CPU against
// `emu_cuda/cuda_fp16.h` (in a namespace of their own, so that the shared
// headers' types do not meet the host prelude's build of them in
// `emu.cpp`), and run a thread block at a time, each GPU thread a fiber
// (see that header).
// `tessera_emu_cuda_launch` launches a kernel by name with its arguments
// as the Rust launchers pass them to CUDA (crates/kernels/src/gpu/emu.rs).
// macOS keeps its ucontext routines behind _XOPEN_SOURCE.
#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 700
#endif
#include <cuda_fp16.h>

#include <functional>
#include <memory>
#include <stdio.h>
#include <stdlib.h>
#include <utility>
#include <vector>

namespace ts_cuda_emu {
#include "paged_attention.cu"
#include "forward.cu"
} // namespace ts_cuda_emu
using namespace ts_cuda_emu;

// ---- fibers ---------------------------------------------------------------

#if defined(__x86_64__) && defined(__linux__) && !defined(TS_EMU_UCONTEXT)
// Saves the callee-saved registers on this stack and its pointer in *from,
// then resumes the stack at `to` (one saved by this function, or a new one
// laid out by fiber_stack).
extern "C" void ts_emu_switch(void** from, void* to);
asm(R"(
    .text
    .p2align 4
ts_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
)");
#define TS_EMU_ASM 1 // (-DTS_EMU_UCONTEXT forces the ucontext fibers)
#else
#include <ucontext.h>
#define TS_EMU_ASM 0
#endif

namespace {

const size_t STACK = 128 << 10;

enum State { RUNNABLE, WAITING, DONE };

struct Fiber {
    void* sp = nullptr;
#if !TS_EMU_ASM
    ucontext_t ctx;
#endif
    State state = RUNNABLE;
};

// A barrier: threads waiting, threads not returned that belong to it.
struct Barrier {
    std::vector<uint32_t> waiting;
    uint32_t live = 0;
    uint32_t round = 0;
};

struct Launch {
    uint3 grid, block, blk;
    uint32_t threads = 0, cur = 0;
    bool reverse = false;
    std::vector<Fiber> fibers;
    std::unique_ptr<char[]> stacks;
    void* sched_sp = nullptr;
#if !TS_EMU_ASM
    ucontext_t sched;
#endif
    Barrier block_bar;
    std::vector<Barrier> warps;
    // Shuffle slots: a value and the warp round it was posted in.
    std::vector<uint32_t> slot, slot_round;
    std::vector<uint32_t> queue;
    size_t head = 0;
    const std::function<void()>* body = nullptr;
    // Dynamic shared memory, 16-byte aligned.
    std::unique_ptr<float4[]> dyn;
    char error[256] = {0};
};

thread_local Launch* cur_launch = nullptr;

void fail(Launch& l, const char* msg) {
    if (!l.error[0]) snprintf(l.error, sizeof l.error, "%s", msg);
}

void to_scheduler(Launch& l) {
    Fiber& f = l.fibers[l.cur];
#if TS_EMU_ASM
    ts_emu_switch(&f.sp, l.sched_sp);
#else
    swapcontext(&f.ctx, &l.sched);
#endif
}

void fiber_main() {
    Launch& l = *cur_launch;
    (*l.body)();
    l.fibers[l.cur].state = DONE;
    to_scheduler(l);
    abort(); // a finished fiber is never resumed
}

#if TS_EMU_ASM
extern "C" void ts_emu_entry() { fiber_main(); }

// A new fiber's stack: six zeroed registers under ts_emu_entry's address,
// which ts_emu_switch's `ret` jumps to with the stack as after a call.
void* fiber_stack(char* lo, size_t size) {
    uintptr_t top = ((uintptr_t)(lo + size)) & ~(uintptr_t)15;
    uint64_t* sp = (uint64_t*)(top - 16);
    sp[1] = 0;                         // the entry's own return address
    sp[0] = (uint64_t)(uintptr_t)&ts_emu_entry;
    sp -= 6;
    for (int i = 0; i < 6; i++) sp[i] = 0;
    return sp;
}
#else
void ucontext_entry() { fiber_main(); }
#endif

void release(Launch& l, Barrier& b) {
    b.round++;
    if (l.reverse)
        for (size_t i = b.waiting.size(); i-- > 0;) l.queue.push_back(b.waiting[i]);
    else
        for (uint32_t t : b.waiting) l.queue.push_back(t);
    for (uint32_t t : b.waiting) l.fibers[t].state = RUNNABLE;
    b.waiting.clear();
}

void maybe_release(Launch& l, Barrier& b) {
    if (!b.waiting.empty() && b.waiting.size() == b.live) release(l, b);
}

// Runs block l.blk: every thread to its end.
void run_block(Launch& l) {
    uint32_t n = l.threads;
    uint32_t nwarps = (n + 31) / 32;
    l.block_bar = Barrier();
    l.block_bar.live = n;
    l.warps.assign(nwarps, Barrier());
    for (uint32_t w = 0; w < nwarps; w++) l.warps[w].live = (w + 1) * 32 <= n ? 32 : n - w * 32;
    l.slot.assign(n, 0);
    l.slot_round.assign(n, ~0u);
    l.queue.clear();
    l.head = 0;
    for (uint32_t i = 0; i < n; i++) {
        Fiber& f = l.fibers[i];
        f.state = RUNNABLE;
        char* lo = l.stacks.get() + (size_t)i * STACK;
#if TS_EMU_ASM
        f.sp = fiber_stack(lo, STACK);
#else
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = lo;
        f.ctx.uc_stack.ss_size = STACK;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, ucontext_entry, 0);
#endif
        l.queue.push_back(l.reverse ? n - 1 - i : i);
    }
    uint32_t done = 0;
    while (l.head < l.queue.size()) {
        l.cur = l.queue[l.head++];
#if TS_EMU_ASM
        ts_emu_switch(&l.sched_sp, l.fibers[l.cur].sp);
#else
        swapcontext(&l.sched, &l.fibers[l.cur].ctx);
#endif
        Fiber& f = l.fibers[l.cur];
        Barrier& warp = l.warps[l.cur / 32];
        if (f.state == DONE) {
            done++;
            l.block_bar.live--;
            warp.live--;
            maybe_release(l, l.block_bar);
            maybe_release(l, warp);
        }
        // A waiting fiber put itself on its barrier's list (ts_emu_barrier),
        // which opened it if it was the last.
        if (l.head > 4096 && l.head * 2 > l.queue.size()) {
            l.queue.erase(l.queue.begin(), l.queue.begin() + l.head);
            l.head = 0;
        }
    }
    if (done != n) fail(l, "threads wait at a barrier the rest of the block never reaches");
}

} // namespace

uint3 ts_emu_thread_idx() { return uint3{cur_launch->cur, 0, 0}; }
uint3 ts_emu_block_idx() { return cur_launch->blk; }
uint3 ts_emu_block_dim() { return cur_launch->block; }
uint3 ts_emu_grid_dim() { return cur_launch->grid; }

void ts_emu_barrier(int warp) {
    Launch& l = *cur_launch;
    Barrier& b = warp < 0 ? l.block_bar : l.warps[warp];
    l.fibers[l.cur].state = WAITING;
    b.waiting.push_back(l.cur);
    maybe_release(l, b);
    to_scheduler(l);
}

void* ts_emu_dyn_shared() { return cur_launch->dyn.get(); }

// Posts this thread's value in its warp's slots and waits for the warp:
// the round the values were posted in.
static uint32_t post(Launch& l, uint32_t mine) {
    uint32_t me = l.cur, w = me / 32;
    uint32_t round = l.warps[w].round;
    l.slot[me] = mine;
    l.slot_round[me] = round;
    ts_emu_barrier((int)w);
    return round;
}

// What lane `lane` of this thread's warp posted in `round` (0, and the
// launch failed with `what`, where it posted nothing).
static uint32_t posted(Launch& l, uint32_t lane, uint32_t round, const char* what) {
    uint32_t src = l.cur / 32 * 32 + lane;
    if (src >= l.threads || l.slot_round[src] != round) {
        fail(l, what);
        return 0;
    }
    return l.slot[src];
}

uint32_t ts_emu_exchange(uint32_t mine, uint32_t from) {
    Launch& l = *cur_launch;
    uint32_t got = posted(l, from, post(l, mine),
                          "a warp shuffle reads a lane that did not take part in it");
    ts_emu_barrier((int)(l.cur / 32));
    return got;
}

// The hooks the Metal sources' stand-in calls (gpu/emu_metal/metal_stdlib),
// with C linkage so that the other translation unit needs none of this
// one's types.
extern "C" void ts_emu_block_pos(uint32_t* xyz) {
    xyz[0] = cur_launch->blk.x;
    xyz[1] = cur_launch->blk.y;
    xyz[2] = cur_launch->blk.z;
}
extern "C" uint32_t ts_emu_thread_pos() { return cur_launch->cur; }
extern "C" void ts_emu_sync(int warp) { ts_emu_barrier(warp); }
// Every lane of this thread's warp posts a value; each gets all 32 (a
// simdgroup reduction's operands, in lane order).
extern "C" void ts_emu_gather(uint32_t mine, uint32_t* lanes) {
    Launch& l = *cur_launch;
    uint32_t round = post(l, mine);
    for (uint32_t i = 0; i < 32; i++)
        lanes[i] = posted(l, i, round,
                          "a simdgroup reduction reads a lane that did not take part in it");
    ts_emu_barrier((int)(l.cur / 32));
}

// ---- the emulator's own tests (src/gpu/emu.rs) -------------------------------

// out[block] = the sum of in[block * n + t] over the block's n threads,
// through shared memory: with `barrier` 0 thread 0 may read the others'
// slots before they write them.
extern "C" __global__ void tessera_emu_test_block_sum(const uint32_t* in, uint32_t* out,
                                                      uint32_t barrier) {
    __shared__ uint32_t s[1024];
    s[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
    if (barrier) __syncthreads();
    if (threadIdx.x == 0) {
        uint32_t sum = 0;
        for (uint32_t t = 0; t < blockDim.x; t++) sum += s[t];
        out[blockIdx.x] = sum;
    }
}

// out[thread] = the sum of in over the thread's warp, by shuffles; with
// `skip` 1 lane 0 returns first, and the others read it.
extern "C" __global__ void tessera_emu_test_warp_sum(const float* in, float* out, uint32_t skip) {
    if (skip && threadIdx.x % 32 == 0) return;
    float x = in[threadIdx.x];
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    out[threadIdx.x] = x;
}

// Thread 0 waits at its warp's barrier, the rest at the block's: neither
// opens.
extern "C" __global__ void tessera_emu_test_stuck(uint32_t* out) {
    if (threadIdx.x == 0)
        __syncwarp();
    else
        __syncthreads();
    out[threadIdx.x] = 1;
}

// ---- launches by name -------------------------------------------------------

// One kernel argument as the launchers pass it: a device address, a u32
// or an f32 (src/gpu/emu.rs's Arg).
struct TsEmuArg {
    uint32_t kind; // 0 address, 1 u32, 2 f32
    uint32_t u32;
    float f32;
    uint64_t ptr;
};

template <typename T>
struct ArgOf;
template <typename T>
struct ArgOf<T*> {
    static bool fits(const TsEmuArg& a) { return a.kind == 0; }
    static T* get(const TsEmuArg& a) { return (T*)(uintptr_t)a.ptr; }
};
template <>
struct ArgOf<uint32_t> {
    static bool fits(const TsEmuArg& a) { return a.kind == 1; }
    static uint32_t get(const TsEmuArg& a) { return a.u32; }
};
template <>
struct ArgOf<float> {
    static bool fits(const TsEmuArg& a) { return a.kind == 2; }
    static float get(const TsEmuArg& a) { return a.f32; }
};

template <typename... P, size_t... I>
static void call_with(void (*f)(P...), const TsEmuArg* a, std::index_sequence<I...>) {
    f(ArgOf<P>::get(a[I])...);
}

// The kernel's call with `a`, if the arguments' count and kinds are its
// parameters'.
template <typename... P>
static bool ts_emu_bind(void (*f)(P...), const TsEmuArg* a, uint32_t n, std::function<void()>* body) {
    if (n != sizeof...(P)) return false;
    uint32_t i = 0;
    bool ok = true;
    using expand = int[];
    (void)expand{0, (ok = ok && ArgOf<P>::fits(a[i++]), 0)...};
    if (!ok) return false;
    *body = [f, a]() { call_with(f, a, std::index_sequence_for<P...>{}); };
    return true;
}

typedef bool (*Binder)(const TsEmuArg*, uint32_t, std::function<void()>*);

struct Entry {
    const char* name;
    Binder bind;
};

#define TS_EMU_K(k) {#k, [](const TsEmuArg* a, uint32_t n, std::function<void()>* b) { return ts_emu_bind(&k, a, n, b); }}
#define TS_EMU_ATT(s) TS_EMU_K(tessera_paged_attention_##s), TS_EMU_K(tessera_paged_attention_merged_##s)
#define TS_EMU_TILED(s) TS_EMU_K(tessera_tiled_attention_##s##_64), TS_EMU_K(tessera_tiled_attention_##s##_128)
#define TS_EMU_GEMV_W(f, w)                                                                    \
    TS_EMU_K(tessera_fwd_gemv_##f##_w##w), TS_EMU_K(tessera_fwd_gemv1_##f##_w##w),             \
        TS_EMU_K(tessera_fwd_glu_##f##_w##w), TS_EMU_K(tessera_fwd_glu1_##f##_w##w),           \
        TS_EMU_K(tessera_fwd_ngemv1_##f##_w##w), TS_EMU_K(tessera_fwd_nglu1_##f##_w##w)
#define TS_EMU_GEMV(f)                                                                         \
    TS_EMU_GEMV_W(f, 1), TS_EMU_GEMV_W(f, 2), TS_EMU_GEMV_W(f, 4),                             \
        TS_EMU_K(tessera_fwd_dequant_##f)

static const Entry ENTRIES[] = {
    TS_EMU_ATT(f32), TS_EMU_ATT(f16), TS_EMU_ATT(bf16), TS_EMU_ATT(q8_0), TS_EMU_ATT(q4_0),
    TS_EMU_TILED(f32), TS_EMU_TILED(f16), TS_EMU_TILED(bf16), TS_EMU_TILED(q8_0),
    TS_EMU_TILED(q4_0), TS_EMU_K(tessera_attention_merge),
    TS_EMU_GEMV(q4_0), TS_EMU_GEMV(q4_1), TS_EMU_GEMV(q8_0), TS_EMU_GEMV(q4_k),
    TS_EMU_GEMV(q5_k), TS_EMU_GEMV(q6_k), TS_EMU_GEMV(f32), TS_EMU_GEMV(f16),
    TS_EMU_K(tessera_fwd_qkv_f32), TS_EMU_K(tessera_fwd_qkv_f16), TS_EMU_K(tessera_fwd_qkv_bf16),
    TS_EMU_K(tessera_fwd_qkv_q8_0), TS_EMU_K(tessera_fwd_qkv_q4_0),
    TS_EMU_K(tessera_fwd_rms_norm), TS_EMU_K(tessera_fwd_residual), TS_EMU_K(tessera_fwd_act_mul),
    TS_EMU_K(tessera_emu_test_block_sum), TS_EMU_K(tessera_emu_test_warp_sum),
    TS_EMU_K(tessera_emu_test_stuck),
};

// Runs `body` as every thread of a grid of (gx, gy, gz) blocks of
// `threads` threads with `shared` bytes of dynamic shared memory; `order`
// 1 runs each block's threads last to first. 0, or nonzero with a message
// in err.
static int ts_emu_run(const char* name, uint32_t gx, uint32_t gy, uint32_t gz, uint32_t threads,
                      uint32_t shared, uint32_t order, const std::function<void()>& body,
                      char* err, size_t err_len) {
    if (threads == 0 || threads > 1024 || gx == 0 || gy == 0 || gz == 0) {
        snprintf(err, err_len, "%s: a launch of %u threads a block over (%u, %u, %u)", name,
                 threads, gx, gy, gz);
        return 1;
    }
    Launch l;
    l.grid = uint3{gx, gy, gz};
    l.block = uint3{threads, 1, 1};
    l.threads = threads;
    l.reverse = order == 1;
    l.fibers.resize(threads);
    l.stacks.reset(new char[(size_t)threads * STACK]);
    l.body = &body;
    // Poisoned, as the GPU's is never cleared: a read before a write shows.
    l.dyn.reset(new float4[(shared + 15) / 16 + 1]);
    memset((void*)l.dyn.get(), 0xff, ((shared + 15) / 16 + 1) * sizeof(float4));
    Launch* outer = cur_launch;
    cur_launch = &l;
    for (uint32_t z = 0; z < gz && !l.error[0]; z++)
        for (uint32_t y = 0; y < gy && !l.error[0]; y++)
            for (uint32_t x = 0; x < gx && !l.error[0]; x++) {
                l.blk = uint3{x, y, z};
                run_block(l);
            }
    cur_launch = outer;
    if (l.error[0]) {
        snprintf(err, err_len, "%s, block (%u, %u, %u): %s", name, l.blk.x, l.blk.y, l.blk.z,
                 l.error);
        return 1;
    }
    return 0;
}

// The same for a body that C code gives: `body(ctx)` per thread.
extern "C" int ts_emu_run_c(const char* name, uint32_t gx, uint32_t gy, uint32_t gz,
                            uint32_t threads, uint32_t order, void (*body)(void*), void* ctx,
                            char* err, size_t err_len) {
    std::function<void()> f = [body, ctx]() { body(ctx); };
    return ts_emu_run(name, gx, gy, gz, threads, 0, order, f, err, err_len);
}

// Runs kernel `name` over a grid of (gx, gy, gz) blocks of `threads`
// threads and `shared` bytes of dynamic shared memory with `nargs`
// arguments; `order` 1 runs each block's threads
// last to first. 0, or nonzero with a message in err.
extern "C" int tessera_emu_cuda_launch(const char* name, uint32_t gx, uint32_t gy, uint32_t gz,
                                       uint32_t threads, uint32_t shared, const TsEmuArg* args,
                                       uint32_t nargs, uint32_t order, char* err,
                                       size_t err_len) {
    const Entry* e = nullptr;
    for (const Entry& x : ENTRIES)
        if (strcmp(x.name, name) == 0) e = &x;
    if (!e) {
        snprintf(err, err_len, "no kernel named %s in the emu build", name);
        return 1;
    }
    std::function<void()> body;
    if (!e->bind(args, nargs, &body)) {
        snprintf(err, err_len, "%s: arguments that are not its parameters (%u given)", name,
                 nargs);
        return 1;
    }
    return ts_emu_run(name, gx, gy, gz, threads, shared, order, body, err, err_len);
}
