//! Attention over the paged cache: [`paged`], the op over block tables
//! (CPU and GPU, with its slow reference in candle ops), and [`items`], the
//! CPU forward's attention cut into 128-position chunks that the step pool
//! runs and merges by log-sum-exp.

pub(crate) mod items;
pub(crate) mod paged;
