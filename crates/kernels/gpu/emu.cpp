// The kernel-emu build: the shared kernel bodies compiled for the CPU.
#include "prelude_host.h"
#include "kv_elem.h"
#include "kv_ops.h"
#include "gemv_formats.h"

// f called with a value of format `fmt`'s type (0 Q4_0, 1 Q4_1, 2 Q8_0,
// 3 Q4_K, 4 Q5_K, 5 Q6_K, 6 f32, 7 f16: GemvFormat's order); 0 for no such
// format.
template <typename Fn>
static int ts_emu_format(uint32_t fmt, Fn f) {
    switch (fmt) {
    case 0: return f(TsQ4_0());
    case 1: return f(TsQ4_1());
    case 2: return f(TsQ8_0());
    case 3: return f(TsQ4_K());
    case 4: return f(TsQ5_K());
    case 5: return f(TsQ6_K());
    case 6: return f(TsF32W());
    case 7: return f(TsF16W());
    default: return 0;
    }
}

// Item i of a row of `k` values in format `fmt` as the CUDA products
// expand it: its RUNS runs of 4 weights into w and where each run meets
// the inputs into off; returns RUNS.
extern "C" int tessera_emu_gemv_item(uint32_t fmt, const uint8_t* row, uint32_t i, float* w,
                                     uint32_t* off) {
    return ts_emu_format(fmt, [&](auto f) {
        typedef decltype(f) F;
        typename F::Raw raw;
        F::load(row, i, raw);
        F::offsets(i, off);
        F::expand(raw, i, w);
        return F::RUNS;
    });
}

// Lane `lane`'s share (ts_row_dots) of a product in the shapes the CUDA
// kernels are built in: kind 0 one token of one row (gemv1, U1 items a
// pass), 1 one token of two rows (glu1's gate and up, U1 / 2), 2 up to
// TS_EMU_MAXT tokens of one row (gemv and glu, UM); `wpr` warps per row
// (1, 2 or 4). Adds into sum[r * MT + t]; returns MT (0: no such shape).
#define TS_EMU_MAXT 8
template <typename F, int WPR>
static int ts_emu_lane(uint32_t kind, const uint8_t* const* rows, uint32_t k, const float* xs,
                       uint32_t x_stride, uint32_t nt, uint32_t lane, float* sum) {
    switch (kind) {
    case 0: ts_row_dots<F, 1, F::U1, WPR, 1>(rows, k, xs, x_stride, nt, lane, sum); return 1;
    case 1: ts_row_dots<F, 1, F::U1 / 2, WPR, 2>(rows, k, xs, x_stride, nt, lane, sum); return 1;
    case 2:
        ts_row_dots<F, TS_EMU_MAXT, F::UM, WPR, 1>(rows, k, xs, x_stride, nt, lane, sum);
        return TS_EMU_MAXT;
    default: return 0;
    }
}

extern "C" int tessera_emu_gemv_lane(uint32_t fmt, uint32_t kind, uint32_t wpr,
                                     const uint8_t* const* rows, uint32_t k, const float* xs,
                                     uint32_t x_stride, uint32_t nt, uint32_t lane, float* sum) {
    return ts_emu_format(fmt, [&](auto f) {
        typedef decltype(f) F;
        switch (wpr) {
        case 1: return ts_emu_lane<F, 1>(kind, rows, k, xs, x_stride, nt, lane, sum);
        case 2: return ts_emu_lane<F, 2>(kind, rows, k, xs, x_stride, nt, lane, sum);
        case 4: return ts_emu_lane<F, 4>(kind, rows, k, xs, x_stride, nt, lane, sum);
        default: return 0;
        }
    });
}

// A weight of `rows` rows of `k` values in format `fmt` expanded to f32
// into `out` by every item's thread of tessera_fwd_dequant_*, one after
// another; returns 1.
extern "C" int tessera_emu_dequant(uint32_t fmt, const uint8_t* w, uint32_t rows, uint32_t k,
                                   float* out) {
    return ts_emu_format(fmt, [&](auto f) {
        typedef decltype(f) F;
        for (ts_u64 idx = 0; idx < (ts_u64)rows * F::items(k); idx++)
            ts_dequant_item<F>(w, k, idx, out);
        return 1;
    });
}
