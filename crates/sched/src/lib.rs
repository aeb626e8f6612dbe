//! tessera-sched: the continuous-batching scheduler.
//!
//! **What this crate must not know:** tensors, candle, devices, the model.
//! It turns waiting and running requests plus the state of a
//! [`tessera_kv::KvCache`] into a step plan (which sequences run, how many
//! tokens each, which blocks to allocate, evict, copy or shift), and is
//! tested through a simulated executor.
//!
//! Status: not built yet. The engine issue fills this crate; until then it
//! exports nothing.
