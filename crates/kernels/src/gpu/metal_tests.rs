//! The Metal kernels against the CPU slow references (feature `metal`, on
//! a Mac: `just test-metal`): the parity checks of [`super::parity`], paged
//! attention included. Without a Metal device each test prints `skipped:
//! no Metal device` and passes, unless `TESSERA_REQUIRE_GPU=1`.

super::parity::device_tests!("Metal", Device::new_metal(0));
