// The kernel-emu build of the Metal-only kernels: `paged_attention.metal`
// compiled unchanged for the CPU against `emu_metal/metal_stdlib`, run by
// the fibers of `emu_cuda.cpp` (a threadgroup a block, a simdgroup a warp).
// `tessera_emu_metal_launch` dispatches a kernel by name with its buffers
// and `constant` bytes in binding order, as gpu/metal.rs binds them.
#include <metal_stdlib>
#include <stdio.h>

namespace ts_metal_emu {
#include "paged_attention.metal"
} // namespace ts_metal_emu
using namespace ts_metal_emu;

extern "C" int ts_emu_run_c(const char* name, uint32_t gx, uint32_t gy, uint32_t gz,
                            uint32_t threads, uint32_t order, void (*body)(void*), void* ctx,
                            char* err, size_t err_len);

// A bound argument: a buffer's address (kind 0) or `len` bytes of a
// `constant` value at `ptr` (kind 3).
struct TsEmuArg {
    uint32_t kind;
    uint32_t len;
    float unused;
    uint64_t ptr;
};

namespace {

// A buffer address, converted to whatever pointer the parameter is.
struct AnyPtr {
    uint64_t p;
    template <typename T>
    operator T*() const {
        return (T*)(uintptr_t)p;
    }
};

struct Bound {
    const TsEmuArg* a;
    AnyPtr operator[](int i) const { return AnyPtr{a[i].ptr}; }
    const TsAttnArgs& args(int i) const { return *(const TsAttnArgs*)(uintptr_t)a[i].ptr; }
};

metal::uint3 group_pos() {
    uint32_t b[3];
    ts_emu_block_pos(b);
    return metal::uint3{b[0], b[1], b[2]};
}

template <int K>
void attention(void* ctx) {
    Bound b{(const TsEmuArg*)ctx};
    metal::uint tid = ts_emu_thread_pos();
#define TS_EMU_ARGS b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b.args(9), group_pos(), tid, tid % 32, tid / 32
    if (K == 0) tessera_paged_attention_f32(TS_EMU_ARGS);
    if (K == 1) tessera_paged_attention_f16(TS_EMU_ARGS);
    if (K == 2) tessera_paged_attention_bf16(TS_EMU_ARGS);
#undef TS_EMU_ARGS
}

struct Merge {
    const TsEmuArg* a;
    uint32_t threads;
};

void merge(void* ctx) {
    const Merge& m = *(const Merge*)ctx;
    Bound b{m.a};
    tessera_attention_merge(b[0], b[1], b[2], b[3], b.args(4), group_pos(), ts_emu_thread_pos(),
                            m.threads);
}

bool same(const char* a, const char* b) { return strcmp(a, b) == 0; }

} // namespace

// Dispatches `name` over (gx, gy, gz) threadgroups of `threads` threads
// (`shared` must be 0: the Metal kernels declare their threadgroup
// arrays); `order` 1 runs each threadgroup's threads last to first. 0,
// or nonzero with a message in err.
extern "C" int tessera_emu_metal_launch(const char* name, uint32_t gx, uint32_t gy, uint32_t gz,
                                        uint32_t threads, uint32_t shared, const TsEmuArg* args,
                                        uint32_t nargs, uint32_t order, char* err,
                                        size_t err_len) {
    // The bindings each kernel takes: buffers, then its TsAttnArgs.
    uint32_t buffers = same(name, "tessera_attention_merge") ? 4 : 9;
    bool ok = shared == 0 && nargs == buffers + 1 && args[buffers].kind == 3 &&
              args[buffers].len == sizeof(TsAttnArgs);
    for (uint32_t i = 0; ok && i < buffers; i++) ok = args[i].kind == 0;
    void (*body)(void*) = nullptr;
    if (same(name, "tessera_paged_attention_f32")) body = attention<0>;
    if (same(name, "tessera_paged_attention_f16")) body = attention<1>;
    if (same(name, "tessera_paged_attention_bf16")) body = attention<2>;
    Merge m{args, threads};
    void* ctx = (void*)args;
    if (same(name, "tessera_attention_merge")) {
        body = merge;
        ctx = &m;
    }
    if (!body || !ok) {
        snprintf(err, err_len, "%s: %s", name,
                 body ? "bindings that are not its parameters" : "no such kernel");
        return 1;
    }
    return ts_emu_run_c(name, gx, gy, gz, threads, order, body, ctx, err, err_len);
}
