//! Where the model runs: `--device auto|cpu|cuda[:N]|metal`.
//!
//! The CPU runs the fast path (`tessera_kernels`' step pool and quantized
//! kernels). A GPU runs the candle reference forward, its K/V kept on the
//! device and moved by the GPU versions of the KV kernels; weights stay
//! there in their stored format (GGUF blocks, f16/bf16) and every product
//! is computed in f32 (`QLinear::forward`).

use std::fmt;
use std::str::FromStr;

use candle_core::Device;

use crate::{ModelError, Result};

/// A device as asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// CUDA device 0 if this build and machine have one, then Metal, then
    /// the CPU.
    #[default]
    Auto,
    Cpu,
    /// CUDA device `N` (`cuda` is `cuda:0`).
    Cuda(usize),
    Metal,
}

impl FromStr for DeviceSpec {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let bad = || format!("{s:?} is not a device (auto, cpu, cuda, cuda:N, metal)");
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(DeviceSpec::Auto),
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            "metal" => Ok(DeviceSpec::Metal),
            other => match other.strip_prefix("cuda:") {
                Some(n) => n.parse().map(DeviceSpec::Cuda).map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Auto => write!(f, "auto"),
            DeviceSpec::Cpu => write!(f, "cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
            DeviceSpec::Metal => write!(f, "metal"),
        }
    }
}

/// A device's name as `--device` spells it.
pub fn device_name(d: &Device) -> String {
    match d.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { .. } => "metal".into(),
    }
}

fn not_built(what: &str, feature: &str) -> ModelError {
    ModelError::Device(format!(
        "this build of Tessera has no {what} support; rebuild with `--features {feature}` \
         (cargo build --release -p tessera --features {feature})"
    ))
}

impl DeviceSpec {
    /// Opens the device. `Auto` never fails: it falls back to the CPU.
    /// An explicit GPU that this build lacks, or that the machine lacks, is
    /// one clear error naming what is missing.
    pub fn open(self) -> Result<Device> {
        match self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(n) => {
                if !candle_core::utils::cuda_is_available() {
                    return Err(not_built("CUDA", "cuda"));
                }
                Device::new_cuda(n).map_err(|e| {
                    ModelError::Device(format!(
                        "no usable CUDA device {n}: {}",
                        crate::without_backtrace(e)
                    ))
                })
            }
            DeviceSpec::Metal => {
                if !cfg!(target_vendor = "apple") {
                    return Err(ModelError::Device(
                        "this build of Tessera has no Metal support: Metal exists only on \
                         Apple machines (build there with `--features metal`)"
                            .into(),
                    ));
                }
                if !candle_core::utils::metal_is_available() {
                    return Err(not_built("Metal", "metal"));
                }
                Device::new_metal(0).map_err(|e| {
                    ModelError::Device(format!(
                        "no usable Metal device: {}",
                        crate::without_backtrace(e)
                    ))
                })
            }
            DeviceSpec::Auto => Ok(DeviceSpec::Cuda(0)
                .open()
                .or_else(|_| DeviceSpec::Metal.open())
                .unwrap_or(Device::Cpu)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_print() {
        for (s, d) in [
            ("auto", DeviceSpec::Auto),
            ("CPU", DeviceSpec::Cpu),
            ("cuda", DeviceSpec::Cuda(0)),
            ("cuda:3", DeviceSpec::Cuda(3)),
            ("metal", DeviceSpec::Metal),
        ] {
            assert_eq!(s.parse::<DeviceSpec>(), Ok(d));
            assert_eq!(d.to_string().parse::<DeviceSpec>(), Ok(d));
        }
        for bad in ["gpu", "cuda:", "cuda:x", ""] {
            let e = bad.parse::<DeviceSpec>().unwrap_err();
            assert!(e.contains("auto, cpu, cuda, cuda:N, metal"), "{e}");
        }
    }

    #[test]
    fn cpu_and_auto_open_and_a_missing_gpu_is_one_clear_error() -> Result<()> {
        assert!(DeviceSpec::Cpu.open()?.is_cpu());
        let auto = DeviceSpec::Auto.open()?;
        if !candle_core::utils::cuda_is_available() && !candle_core::utils::metal_is_available() {
            assert!(auto.is_cpu());
            let e = DeviceSpec::Cuda(0).open().unwrap_err().to_string();
            assert!(
                e.contains("no CUDA support") && e.contains("--features cuda"),
                "{e}"
            );
            let e = DeviceSpec::Metal.open().unwrap_err().to_string();
            assert!(
                e.contains("no Metal support") && e.contains("--features metal"),
                "{e}"
            );
            assert!(!e.contains('\n'));
        }
        assert_eq!(device_name(&Device::Cpu), "cpu");
        Ok(())
    }
}
