// IEEE binary16 <-> binary32 on the host, round to nearest even (what the
// GPUs' conversion instructions do): the host prelude's conversions
// (prelude_host.h) and the kernel-emu stand-ins for CUDA's and Metal's
// headers (emu_cuda/, emu_metal/).
#ifndef TS_HOST_F16_H
#define TS_HOST_F16_H
#include <stdint.h>
#include <string.h>

static inline uint32_t ts_host_float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float ts_host_bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float ts_host_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1fu) return ts_host_bits_float(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0) return ts_host_bits_float(sign);
        // Subnormal: man * 2^-24.
        float v = (float)man * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    return ts_host_bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}
static inline uint16_t ts_host_f32_to_f16(float f) {
    uint32_t u = ts_host_float_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); // rounds to infinity
    if (a < 0x38800000u) {
        // Result subnormal or zero: round a / 2^-24 to an integer, ties to even.
        if (a < 0x33000000u) return sign; // below half the smallest subnormal
        uint32_t e = a >> 23;
        uint32_t m = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e; // value = m * 2^(e-150) = (m >> (126 - e)) * 2^-24
        uint32_t q = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t halfway = 1u << (shift - 1u);
        if (rem > halfway || (rem == halfway && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    // Normal: drop 13 mantissa bits, ties to even (a carry into the
    // exponent is the right answer).
    uint32_t r = a - 0x38000000u; // rebias 127 -> 15
    r += 0xfffu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
}

#endif // TS_HOST_F16_H
