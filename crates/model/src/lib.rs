//! tessera-model: Llama-family architectures over the paged KV cache.
//!
//! **What this crate must not know:** the prefix tree, eviction, scheduling.
//! It runs a forward pass over a batch of sequences given their new tokens,
//! positions and block tables (plain integers) and returns logits.
//!
//! Status: not built yet. The model issue fills this crate; until then it
//! exports nothing.
