//! tessera-engine: the library API.
//!
//! **What this crate must not know:** command-line parsing and terminal I/O.
//! It owns the K/V tensors, applies the plans of tessera-kv and
//! tessera-sched through tessera-kernels, runs tessera-model, samples, and
//! keeps sessions, metrics, context shift and save/load.
//!
//! Status: not built yet. The engine issue fills this crate; until then it
//! exports nothing.
