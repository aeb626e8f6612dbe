// The kernel-emu build: the shared kernel bodies compiled for the CPU.
#include "prelude_host.h"
#include "kv_elem.h"
#include "kv_ops.h"
#include "gemv_formats.h"

// Item i of a row of `k` values in format `fmt` (0 Q4_0, 1 Q4_1, 2 Q8_0,
// 3 Q4_K, 4 Q5_K, 5 Q6_K, 6 f32, 7 f16: GemvFormat's order) as the CUDA
// products expand it: its RUNS runs of 4 weights into w and where each run
// meets the inputs into off; returns RUNS (0: no such format).
template <typename F>
static int ts_emu_item(const uint8_t* row, uint32_t i, float* w, uint32_t* off) {
    typename F::Raw raw;
    F::load(row, i, raw);
    F::offsets(i, off);
    F::expand(raw, i, w);
    return F::RUNS;
}

extern "C" int tessera_emu_gemv_item(uint32_t fmt, const uint8_t* row, uint32_t i, float* w,
                                     uint32_t* off) {
    switch (fmt) {
    case 0: return ts_emu_item<TsQ4_0>(row, i, w, off);
    case 1: return ts_emu_item<TsQ4_1>(row, i, w, off);
    case 2: return ts_emu_item<TsQ8_0>(row, i, w, off);
    case 3: return ts_emu_item<TsQ4_K>(row, i, w, off);
    case 4: return ts_emu_item<TsQ5_K>(row, i, w, off);
    case 5: return ts_emu_item<TsQ6_K>(row, i, w, off);
    case 6: return ts_emu_item<TsF32W>(row, i, w, off);
    case 7: return ts_emu_item<TsF16W>(row, i, w, off);
    default: return 0;
    }
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

template <typename F>
static int ts_emu_lane_w(uint32_t kind, uint32_t wpr, const uint8_t* const* rows, uint32_t k,
                         const float* xs, uint32_t x_stride, uint32_t nt, uint32_t lane,
                         float* sum) {
    switch (wpr) {
    case 1: return ts_emu_lane<F, 1>(kind, rows, k, xs, x_stride, nt, lane, sum);
    case 2: return ts_emu_lane<F, 2>(kind, rows, k, xs, x_stride, nt, lane, sum);
    case 4: return ts_emu_lane<F, 4>(kind, rows, k, xs, x_stride, nt, lane, sum);
    default: return 0;
    }
}

extern "C" int tessera_emu_gemv_lane(uint32_t fmt, uint32_t kind, uint32_t wpr,
                                     const uint8_t* const* rows, uint32_t k, const float* xs,
                                     uint32_t x_stride, uint32_t nt, uint32_t lane, float* sum) {
    switch (fmt) {
    case 0: return ts_emu_lane_w<TsQ4_0>(kind, wpr, rows, k, xs, x_stride, nt, lane, sum);
    case 1: return ts_emu_lane_w<TsQ4_1>(kind, wpr, rows, k, xs, x_stride, nt, lane, sum);
    case 2: return ts_emu_lane_w<TsQ8_0>(kind, wpr, rows, k, xs, x_stride, nt, lane, sum);
    case 3: return ts_emu_lane_w<TsQ4_K>(kind, wpr, rows, k, xs, x_stride, nt, lane, sum);
    case 4: return ts_emu_lane_w<TsQ5_K>(kind, wpr, rows, k, xs, x_stride, nt, lane, sum);
    case 5: return ts_emu_lane_w<TsQ6_K>(kind, wpr, rows, k, xs, x_stride, nt, lane, sum);
    case 6: return ts_emu_lane_w<TsF32W>(kind, wpr, rows, k, xs, x_stride, nt, lane, sum);
    case 7: return ts_emu_lane_w<TsF16W>(kind, wpr, rows, k, xs, x_stride, nt, lane, sum);
    default: return 0;
    }
}

// A weight of `rows` rows of `k` values in format `fmt` expanded to f32
// into `out` by every item's thread of tessera_fwd_dequant_*, one after
// another; returns 0 for no such format.
template <typename F>
static int ts_emu_dequant(const uint8_t* w, uint32_t rows, uint32_t k, float* out) {
    for (ts_u64 idx = 0; idx < (ts_u64)rows * F::items(k); idx++) ts_dequant_item<F>(w, k, idx, out);
    return 1;
}

extern "C" int tessera_emu_dequant(uint32_t fmt, const uint8_t* w, uint32_t rows, uint32_t k,
                                   float* out) {
    switch (fmt) {
    case 0: return ts_emu_dequant<TsQ4_0>(w, rows, k, out);
    case 1: return ts_emu_dequant<TsQ4_1>(w, rows, k, out);
    case 2: return ts_emu_dequant<TsQ8_0>(w, rows, k, out);
    case 3: return ts_emu_dequant<TsQ4_K>(w, rows, k, out);
    case 4: return ts_emu_dequant<TsQ5_K>(w, rows, k, out);
    case 5: return ts_emu_dequant<TsQ6_K>(w, rows, k, out);
    case 6: return ts_emu_dequant<TsF32W>(w, rows, k, out);
    case 7: return ts_emu_dequant<TsF16W>(w, rows, k, out);
    default: return 0;
    }
}
