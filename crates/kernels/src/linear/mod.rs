//! Linear layers on GGML blocks: [`matvec`] with f32 activations (one
//! fixed order of fused sums per row), [`qdot`] with activations as int8
//! levels against repacked tiles, each compiled per instruction set.

pub(crate) mod matvec;
pub(crate) mod qdot;
