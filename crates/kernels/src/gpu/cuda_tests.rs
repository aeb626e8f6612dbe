//! The CUDA kernels against the CPU slow references (feature `cuda`; `just
//! test-cuda`): the parity checks of [`super::parity`], paged attention
//! included. Without a CUDA device each test prints `skipped: no CUDA
//! device` and passes, unless `TESSERA_REQUIRE_GPU=1`.

super::parity::device_tests!("CUDA", Device::new_cuda(0));
