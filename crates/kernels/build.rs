//! GPU kernel builds, each behind its feature:
//! - `cuda`: `gpu/*.cu` compiled to PTX by nvcc (from `NVCC`, `CUDA_ROOT` /
//!   `CUDA_PATH`, `PATH`, or the CUDA 13.0 pip wheels) for compute
//!   capability `CUDA_COMPUTE_CAP` (default 80; the driver JIT-compiles the
//!   PTX for newer GPUs), embedded by `src/gpu/cuda.rs`.
//! - `kernel-emu`: the shared kernel source (`gpu/kv_ops.h` under the host
//!   prelude) compiled for the CPU, so its tests run the exact source the
//!   GPUs run; and the CUDA-only kernels (`gpu/paged_attention.cu`,
//!   `gpu/forward.cu`) compiled unchanged against a host stand-in for
//!   CUDA's header (`gpu/emu_cuda/`), run a fiber per GPU thread
//!   (`gpu/emu_cuda.cpp`); the Metal-only `gpu/paged_attention.metal` the
//!   same way against a stand-in for `<metal_stdlib>` (`gpu/emu_metal/`).

fn main() {
    println!("cargo:rerun-if-changed=gpu");
    #[cfg(feature = "cuda")]
    cuda::build();
    #[cfg(feature = "kernel-emu")]
    cc::Build::new()
        .cpp(true)
        .file("gpu/emu.cpp")
        .flag_if_supported("-std=c++14")
        .flag_if_supported("-ffp-contract=off")
        .warnings_into_errors(true)
        .compile("tessera_kernel_emu");
    // The CUDA-only kernel files, unchanged, against a host stand-in for
    // CUDA's header (gpu/emu_cuda/); optimised whatever the profile, as the
    // emulated grids are large.
    #[cfg(feature = "kernel-emu")]
    cc::Build::new()
        .cpp(true)
        .file("gpu/emu_cuda.cpp")
        .include("gpu/emu_cuda")
        .flag_if_supported("-std=c++17")
        .flag_if_supported("-ffp-contract=off")
        .flag_if_supported("-Wno-unknown-pragmas")
        .flag_if_supported("-Wno-sign-compare")
        .opt_level(2)
        .warnings_into_errors(true)
        .compile("tessera_kernel_emu_cuda");
    // The Metal-only kernel source, unchanged, against a host stand-in for
    // <metal_stdlib> (gpu/emu_metal/), run by the same fibers.
    #[cfg(feature = "kernel-emu")]
    cc::Build::new()
        .cpp(true)
        .file("gpu/emu_metal.cpp")
        .include("gpu/emu_metal")
        .flag_if_supported("-std=c++17")
        .flag_if_supported("-ffp-contract=off")
        .flag_if_supported("-Wno-unknown-pragmas")
        .flag_if_supported("-Wno-attributes")
        .flag_if_supported("-Wno-unknown-attributes")
        .flag_if_supported("-Wno-sign-compare")
        .opt_level(2)
        .warnings_into_errors(true)
        .compile("tessera_kernel_emu_metal");
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::path::PathBuf;
    use std::process::Command;

    fn nvcc() -> PathBuf {
        println!("cargo:rerun-if-env-changed=NVCC");
        println!("cargo:rerun-if-env-changed=CUDA_ROOT");
        println!("cargo:rerun-if-env-changed=CUDA_PATH");
        if let Some(p) = std::env::var_os("NVCC") {
            return p.into();
        }
        for root in ["CUDA_ROOT", "CUDA_PATH"] {
            if let Some(r) = std::env::var_os(root) {
                let p = PathBuf::from(r).join("bin").join("nvcc");
                if p.exists() {
                    return p;
                }
            }
        }
        if Command::new("nvcc").arg("--version").output().is_ok() {
            return "nvcc".into();
        }
        // The pip wheels: cuda-toolkit[nvcc,cccl]==13.0.*
        let wheel = Command::new("python3")
            .args([
                "-c",
                "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'bin', 'nvcc'))",
            ])
            .output();
        if let Ok(o) = wheel {
            let p = PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
            if o.status.success() && p.exists() {
                return p;
            }
        }
        panic!(
            "the `cuda` feature needs nvcc: set NVCC or CUDA_ROOT, or install it with \
             pip install \"cuda-toolkit[nvcc,cccl]==13.0.*\""
        )
    }

    pub fn build() {
        println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
        let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
        let cap = cap.trim().replace('.', "");
        let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
        let nvcc = nvcc();
        for stem in ["kv_ops", "paged_attention", "forward"] {
            let ptx = out.join(format!("{stem}.ptx"));
            let status = Command::new(&nvcc)
                .args(["-ptx", &format!("-arch=sm_{cap}"), "-O3", "-o"])
                .arg(&ptx)
                .arg(format!("gpu/{stem}.cu"))
                .status()
                .unwrap_or_else(|e| panic!("running {}: {e}", nvcc.display()));
            assert!(status.success(), "nvcc failed on gpu/{stem}.cu");
        }
    }
}
