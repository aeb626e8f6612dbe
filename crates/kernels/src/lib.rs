//! tessera-kernels: the operations that move KV bytes.
//!
//! **What this crate must not know:** block tables as types, the prefix tree,
//! scheduling policy. Block ids and slots reach it as plain integer lists;
//! kernels check shapes, never decide.
//!
//! Planned ops, each with a slow reference in plain candle ops and a seeded
//! parity test: `write_kv`, `paged_attention`, `copy_blocks`, `shift_kv`
//! (move slots and rotate K by a RoPE position delta).
//!
//! Status: not built yet. The model issue fills this crate; until then it
//! exports nothing.
