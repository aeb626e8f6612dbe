// The KV kernels whose logic is the same on every target: write_kv,
// copy_blocks and the gather-and-rotate half of shift_kv / rotate_k, for
// every cache type (the quantized ones' rows rotated and quantized as
// kv_elem.h says), and the 64-value rotation attention over a quantized
// cache applies to its queries and output.
// Written once over a small vocabulary that a prelude defines per target:
//
//   TS_KERNEL(name, params...)  an entry point
//   TS_BUF(T, name, index)      a buffer parameter (Metal: buffer(index))
//   TS_ARG(T, name, index)      a scalar parameter (Metal: buffer(index))
//   TS_DEV                      the address space of buffer pointers
//   TS_INLINE / TS_STATIC       a device function / a static member one
//   TS_IDX                      this thread's TsIdx {blk, tid, nthreads}
//   TS_MUL/TS_ADD/TS_SUB        f32 arithmetic rounded per operation
//   ts_f16_to_f32 / ts_f32_to_f16 / ts_float_bits / ts_bits_float
//
// A prelude, kv_elem.h and this file, in that order, are what nvcc
// compiles (kv_ops.cu), what Metal compiles at run time (kv_ops.metal), and
// what the `kernel-emu` feature compiles for the CPU (emu.cpp), whose tests
// check it against the CPU slow references. Neither header includes
// anything: Metal compiles one string.
//
// The cache is `[slots, n_kv_heads, head_dim]` elements; no kernel here
// synchronises threads, so each runs as a plain loop on the host.
//
// The Rust side binds the entry points by name and the buffers by index
// (crates/kernels/src/gpu/mod.rs, KERNELS); a test checks both against this file.

// One block per new token: its row of f32 values stored at its slot,
// converted to the cache type (a quantized row: rotated and quantized, a
// thread per 64 values). A slot of TS_NO_SLOT (padding) is skipped.
template <typename E>
TS_INLINE void ts_write_kv(TS_DEV const float* src, TS_DEV typename E::Raw* cache,
                           TS_DEV const uint32_t* slots, uint32_t row, TsIdx ix) {
    uint32_t slot = slots[ix.blk];
    if (slot == TS_NO_SLOT) return;
    E::store_row(src + (ts_u64)ix.blk * row, cache + E::units((ts_u64)slot * row), row, ix.tid,
                 ix.nthreads);
}

// One block per (source, destination) pair: `units` 16-bit units copied.
// Pairs are independent (no destination twice, none also a source).
TS_INLINE void ts_copy_blocks(TS_DEV uint16_t* cache, TS_DEV const uint32_t* pairs,
                              uint32_t units, TsIdx ix) {
    TS_DEV const uint16_t* from = cache + (ts_u64)pairs[2 * ix.blk] * units;
    TS_DEV uint16_t* to = cache + (ts_u64)pairs[2 * ix.blk + 1] * units;
    for (uint32_t i = ix.tid; i < units; i += ix.nthreads) to[i] = from[i];
}

// RoPE's rotation of one pair (x0, x1) by (c, s) into to[a], to[b], in
// the CPU's order of operations.
TS_INLINE void ts_rope_store(TS_DEV float* to, uint32_t a, uint32_t b, float x0, float x1, float c,
                             float s) {
    to[a] = TS_SUB(TS_MUL(x0, c), TS_MUL(x1, s));
    to[b] = TS_ADD(TS_MUL(x0, s), TS_MUL(x1, c));
}

// One block per row: the cache row at slots[block] read as f32 into
// out[block], each head rotated by the cos/sin table tables[block]
// (TS_NO_SLOT: copied unrotated). Tables are `head_dim / 2` values each,
// computed on the host. `neox` pairs (i, i + d/2), otherwise (2i, 2i + 1).
// Gathering every row before any is written back (ts_write_kv) lets moves
// overlap.
template <typename E>
TS_INLINE void ts_rope_gather(TS_DEV const typename E::Raw* cache, TS_DEV float* out,
                              TS_DEV const uint32_t* slots, TS_DEV const uint32_t* tables,
                              TS_DEV const float* cos_t, TS_DEV const float* sin_t,
                              uint32_t heads, uint32_t head_dim, uint32_t neox, TsIdx ix) {
    uint32_t row = heads * head_dim;
    uint32_t half_d = head_dim / 2;
    TS_DEV const typename E::Raw* from = cache + (ts_u64)slots[ix.blk] * row;
    TS_DEV float* to = out + (ts_u64)ix.blk * row;
    uint32_t table = tables[ix.blk];
    for (uint32_t p = ix.tid; p < heads * half_d; p += ix.nthreads) {
        uint32_t h = p / half_d;
        uint32_t i = p % half_d;
        uint32_t a = h * head_dim + (neox ? i : 2 * i);
        uint32_t b = neox ? a + half_d : a + 1;
        float x0 = E::load(from[a]);
        float x1 = E::load(from[b]);
        if (table == TS_NO_SLOT) {
            to[a] = x0;
            to[b] = x1;
        } else {
            ts_rope_store(to, a, b, x0, x1, cos_t[(ts_u64)table * half_d + i],
                          sin_t[(ts_u64)table * half_d + i]);
        }
    }
}

// One block per row of a quantized cache: the row at slots[block] read
// back as f32 into out[block] (each 64 values dequantized and rotated back
// by ts_hadamard64), each head then rotated by RoPE as ts_rope_gather
// rotates it; a thread per head.
template <typename E>
TS_INLINE void ts_rope_gather_q(TS_DEV const uint8_t* cache, TS_DEV float* out,
                                TS_DEV const uint32_t* slots, TS_DEV const uint32_t* tables,
                                TS_DEV const float* cos_t, TS_DEV const float* sin_t,
                                uint32_t heads, uint32_t head_dim, uint32_t neox, TsIdx ix) {
    uint32_t row = heads * head_dim;
    uint32_t half_d = head_dim / 2;
    TS_DEV const uint8_t* from = cache + E::units((ts_u64)slots[ix.blk] * row);
    uint32_t table = tables[ix.blk];
    for (uint32_t h = ix.tid; h < heads; h += ix.nthreads) {
        TS_DEV float* to = out + (ts_u64)ix.blk * row + h * head_dim;
        TS_DEV const uint8_t* head = from + E::units(h * head_dim);
        for (uint32_t c = 0; c < head_dim; c += 64) {
            float t[64];
            TS_UNROLL
            for (uint32_t i = 0; i < 64; i++) t[i] = E::at(head, c + i);
            ts_hadamard64(t);
            TS_UNROLL
            for (uint32_t i = 0; i < 64; i++) to[c + i] = t[i];
        }
        if (table == TS_NO_SLOT) continue;
        for (uint32_t i = 0; i < half_d; i++) {
            uint32_t a = neox ? i : 2 * i;
            uint32_t b = neox ? a + half_d : a + 1;
            ts_rope_store(to, a, b, to[a], to[b], cos_t[(ts_u64)table * half_d + i],
                          sin_t[(ts_u64)table * half_d + i]);
        }
    }
}

// Rows moved as they are (a quantized cache's V rows in a context shift):
// one block per row, `units` 16-bit units; gather: row idx[block] of src
// to row block of dst; scatter: row block of src to row idx[block] of dst.
TS_INLINE void ts_move_units(TS_DEV const uint16_t* src, TS_DEV uint16_t* dst,
                             ts_u64 from, ts_u64 to, uint32_t units, TsIdx ix) {
    for (uint32_t i = ix.tid; i < units; i += ix.nthreads)
        dst[to * units + i] = src[from * units + i];
}

// ts_hadamard64 over `chunks` runs of 64 values of x, a thread each
// (queries rotated into a quantized cache's basis, attention's output
// rotated back).
TS_INLINE void ts_hadamard_rows(TS_DEV float* x, uint32_t chunks, TsIdx ix) {
    uint32_t c = ix.blk * ix.nthreads + ix.tid;
    if (c >= chunks) return;
    float t[64];
    TS_UNROLL
    for (uint32_t i = 0; i < 64; i++) t[i] = x[(ts_u64)c * 64 + i];
    ts_hadamard64(t);
    TS_UNROLL
    for (uint32_t i = 0; i < 64; i++) x[(ts_u64)c * 64 + i] = t[i];
}

// The entry points, one per cache type.

TS_KERNEL(tessera_write_kv_f32, TS_BUF(const float, src, 0), TS_BUF(float, cache, 1),
          TS_BUF(const uint32_t, slots, 2), TS_ARG(uint32_t, row, 3)) {
    ts_write_kv<TsF32>(src, cache, slots, row, TS_IDX);
}
TS_KERNEL(tessera_write_kv_f16, TS_BUF(const float, src, 0), TS_BUF(uint16_t, cache, 1),
          TS_BUF(const uint32_t, slots, 2), TS_ARG(uint32_t, row, 3)) {
    ts_write_kv<TsF16>(src, cache, slots, row, TS_IDX);
}
TS_KERNEL(tessera_write_kv_bf16, TS_BUF(const float, src, 0), TS_BUF(uint16_t, cache, 1),
          TS_BUF(const uint32_t, slots, 2), TS_ARG(uint32_t, row, 3)) {
    ts_write_kv<TsBf16>(src, cache, slots, row, TS_IDX);
}

TS_KERNEL(tessera_write_kv_q8_0, TS_BUF(const float, src, 0), TS_BUF(uint8_t, cache, 1),
          TS_BUF(const uint32_t, slots, 2), TS_ARG(uint32_t, row, 3)) {
    ts_write_kv<TsKvQ8_0>(src, cache, slots, row, TS_IDX);
}
TS_KERNEL(tessera_write_kv_q4_0, TS_BUF(const float, src, 0), TS_BUF(uint8_t, cache, 1),
          TS_BUF(const uint32_t, slots, 2), TS_ARG(uint32_t, row, 3)) {
    ts_write_kv<TsKvQ4_0>(src, cache, slots, row, TS_IDX);
}

TS_KERNEL(tessera_copy_blocks, TS_BUF(uint16_t, cache, 0), TS_BUF(const uint32_t, pairs, 1),
          TS_ARG(uint32_t, units, 2)) {
    ts_copy_blocks(cache, pairs, units, TS_IDX);
}

TS_KERNEL(tessera_rope_gather_f32, TS_BUF(const float, cache, 0), TS_BUF(float, out, 1),
          TS_BUF(const uint32_t, slots, 2), TS_BUF(const uint32_t, tables, 3),
          TS_BUF(const float, cos_t, 4), TS_BUF(const float, sin_t, 5),
          TS_ARG(uint32_t, heads, 6), TS_ARG(uint32_t, head_dim, 7), TS_ARG(uint32_t, neox, 8)) {
    ts_rope_gather<TsF32>(cache, out, slots, tables, cos_t, sin_t, heads, head_dim, neox, TS_IDX);
}
TS_KERNEL(tessera_rope_gather_f16, TS_BUF(const uint16_t, cache, 0), TS_BUF(float, out, 1),
          TS_BUF(const uint32_t, slots, 2), TS_BUF(const uint32_t, tables, 3),
          TS_BUF(const float, cos_t, 4), TS_BUF(const float, sin_t, 5),
          TS_ARG(uint32_t, heads, 6), TS_ARG(uint32_t, head_dim, 7), TS_ARG(uint32_t, neox, 8)) {
    ts_rope_gather<TsF16>(cache, out, slots, tables, cos_t, sin_t, heads, head_dim, neox, TS_IDX);
}
TS_KERNEL(tessera_rope_gather_bf16, TS_BUF(const uint16_t, cache, 0), TS_BUF(float, out, 1),
          TS_BUF(const uint32_t, slots, 2), TS_BUF(const uint32_t, tables, 3),
          TS_BUF(const float, cos_t, 4), TS_BUF(const float, sin_t, 5),
          TS_ARG(uint32_t, heads, 6), TS_ARG(uint32_t, head_dim, 7), TS_ARG(uint32_t, neox, 8)) {
    ts_rope_gather<TsBf16>(cache, out, slots, tables, cos_t, sin_t, heads, head_dim, neox, TS_IDX);
}
TS_KERNEL(tessera_rope_gather_q8_0, TS_BUF(const uint8_t, cache, 0), TS_BUF(float, out, 1),
          TS_BUF(const uint32_t, slots, 2), TS_BUF(const uint32_t, tables, 3),
          TS_BUF(const float, cos_t, 4), TS_BUF(const float, sin_t, 5),
          TS_ARG(uint32_t, heads, 6), TS_ARG(uint32_t, head_dim, 7), TS_ARG(uint32_t, neox, 8)) {
    ts_rope_gather_q<TsKvQ8_0>(cache, out, slots, tables, cos_t, sin_t, heads, head_dim, neox,
                             TS_IDX);
}
TS_KERNEL(tessera_rope_gather_q4_0, TS_BUF(const uint8_t, cache, 0), TS_BUF(float, out, 1),
          TS_BUF(const uint32_t, slots, 2), TS_BUF(const uint32_t, tables, 3),
          TS_BUF(const float, cos_t, 4), TS_BUF(const float, sin_t, 5),
          TS_ARG(uint32_t, heads, 6), TS_ARG(uint32_t, head_dim, 7), TS_ARG(uint32_t, neox, 8)) {
    ts_rope_gather_q<TsKvQ4_0>(cache, out, slots, tables, cos_t, sin_t, heads, head_dim, neox,
                             TS_IDX);
}

TS_KERNEL(tessera_gather_rows, TS_BUF(const uint16_t, src, 0), TS_BUF(uint16_t, dst, 1),
          TS_BUF(const uint32_t, idx, 2), TS_ARG(uint32_t, units, 3)) {
    TsIdx ix = TS_IDX;
    ts_move_units(src, dst, idx[ix.blk], ix.blk, units, ix);
}
TS_KERNEL(tessera_scatter_rows, TS_BUF(const uint16_t, src, 0), TS_BUF(uint16_t, dst, 1),
          TS_BUF(const uint32_t, idx, 2), TS_ARG(uint32_t, units, 3)) {
    TsIdx ix = TS_IDX;
    ts_move_units(src, dst, ix.blk, idx[ix.blk], units, ix);
}

TS_KERNEL(tessera_hadamard_rows, TS_BUF(float, x, 0), TS_ARG(uint32_t, chunks, 1)) {
    ts_hadamard_rows(x, chunks, TS_IDX);
}
