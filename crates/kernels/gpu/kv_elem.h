// The cache element types of every kernel, loaded and stored through f32
// (after a prelude: see kv_ops.h).

#define TS_NO_SLOT 0xffffffffu

struct TsF32 {
    typedef float Raw;
    TS_STATIC float load(Raw x) { return x; }
    TS_STATIC Raw store(float x) { return x; }
};
struct TsF16 {
    typedef uint16_t Raw;
    TS_STATIC float load(Raw x) { return ts_f16_to_f32(x); }
    TS_STATIC Raw store(float x) { return ts_f32_to_f16(x); }
};
struct TsBf16 {
    typedef uint16_t Raw;
    TS_STATIC float load(Raw x) { return ts_bits_float(((uint32_t)x) << 16); }
    // Round to nearest even; a NaN stays a (quiet) NaN.
    TS_STATIC Raw store(float x) {
        uint32_t u = ts_float_bits(x);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (Raw)((u >> 16) | 0x40u);
        u += 0x7fffu + ((u >> 16) & 1u);
        return (Raw)(u >> 16);
    }
};

