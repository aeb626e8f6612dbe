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
