//! The Metal kernels against the CPU slow references (feature `metal`, on
//! a Mac: `just test-metal`): the parity checks of [`super::parity`], paged
//! attention included, and the refusal of quantized caches (which CUDA
//! takes). Without a Metal device each test prints `skipped: no Metal
//! device` and passes, unless `TESSERA_REQUIRE_GPU=1`.

super::parity::device_tests!("Metal", Device::new_metal(0));

#[test]
fn quantized_caches_are_refused() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    parity::quantized_caches_refused(&OnDevice(dev))
}
