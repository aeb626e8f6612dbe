//! Linear layers on GGML blocks: [`matvec`] with f32 activations (one
//! fixed order of fused sums per row), [`qdot`] with activations as int8
//! levels against repacked tiles, each compiled per instruction set.

pub(crate) mod matvec;
pub(crate) mod qdot;

/// Where the quantized products' results go (`qmatvec`): `emit(input,
/// row, values)` with one input's values of rows `row..row +
/// values.len()` (up to a tile's sixteen), each pair once. A trait object,
/// so that the products are compiled once, here, instead of once for each
/// caller's closure in each crate that calls them: in the model crate five
/// closures had made them 30% of its code and a third of its build. It
/// is called once per sixteen rows of a whole dot product. `matvec` (f32
/// activations) still takes a closure per value: its results gathered into
/// runs for a trait object ran 10–18% slower (docs/performance-notes.md).
pub type Emit<'a> = dyn FnMut(usize, usize, &[f32]) + 'a;
