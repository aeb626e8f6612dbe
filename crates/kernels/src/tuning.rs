//! The process-wide knobs that pick kernel paths, and the one place the
//! library reads its environment.
//!
//! A program sets them once with [`set`] before the first kernel runs (the
//! engine does, from `EngineConfig`; the CLI has a flag for each); the
//! first kernel that asks fixes them ([`get`]). Unset, they are the
//! defaults with these documented environment overrides:
//!
//! | variable | values | knob |
//! |---|---|---|
//! | `TESSERA_ISA` | `portable`, `avx2`, `avxvnni`, `avx512`, `amx` | [`Tuning::isa`] |
//! | `TESSERA_ACTIVATIONS` | `int8x2`, `f32`, `int8` | [`Tuning::activations`] |
//! | `TESSERA_HUGE_PAGES` | `0` | [`Tuning::huge_pages`] off |
//! | `TESSERA_FIXED_TEAM` | `1` | [`Tuning::fixed_team`] on |
//! | `TESSERA_FORWARD` | `reference` | [`Tuning::reference_forward`] on |
//! | `TESSERA_CUDA_ROW_WARPS` | `1`, `2`, `4` | [`Tuning::gpu_row_warps`] |
//! | `TESSERA_CUDA_ATT_PART` | `16`, `32`, `64` | [`Tuning::gpu_att_part`] |
//! | `TESSERA_CUDA_FUSE_NORM` | `0` | [`Tuning::gpu_fuse_norm`] off |
//! | `TESSERA_CUDA_FUSE_MERGE` | `0` | [`Tuning::gpu_fuse_merge`] off |
//! | `TESSERA_CUDA_PREFILL` | `1` | [`Tuning::gpu_prefill`] on |

use std::fmt;
use std::sync::OnceLock;

use crate::Activations;

/// The highest instruction set the CPU kernels may use (each family takes
/// the best it has at or below it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum IsaCap {
    /// Plain Rust, whatever the CPU has (tests check these paths with it).
    Portable,
    Avx2,
    AvxVnni,
    /// AVX-512 (F, BW, VL; VNNI for the integer products), without AMX.
    Avx512,
    /// AVX-512 and AMX-INT8's tiles for many-input integer products.
    Amx,
}

impl IsaCap {
    pub const ALL: [IsaCap; 5] = [
        IsaCap::Portable,
        IsaCap::Avx2,
        IsaCap::AvxVnni,
        IsaCap::Avx512,
        IsaCap::Amx,
    ];

    pub fn name(self) -> &'static str {
        match self {
            IsaCap::Portable => "portable",
            IsaCap::Avx2 => "avx2",
            IsaCap::AvxVnni => "avxvnni",
            IsaCap::Avx512 => "avx512",
            IsaCap::Amx => "amx",
        }
    }

    pub fn parse(s: &str) -> Option<IsaCap> {
        IsaCap::ALL.into_iter().find(|i| i.name() == s)
    }
}

impl fmt::Display for IsaCap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The process's kernel settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    /// The highest instruction set the kernels use (`None`: the best this
    /// CPU runs). For comparing paths and engines on one ISA.
    pub isa: Option<IsaCap>,
    /// How quantized weights meet activations in models loaded from now on
    /// (an engine's `activations` overrides it per model).
    pub activations: Activations,
    /// Large buffers (repacked weights) on 2 MiB pages where the system
    /// allows.
    pub huge_pages: bool,
    /// The step pool keeps every worker even when a core is taken
    /// (default: the team shrinks while the machine is busy).
    pub fixed_team: bool,
    /// Every forward through the candle reference, for debugging.
    pub reference_forward: bool,
    /// Warps per output row of the CUDA products (`None`: by the row's
    /// length), for comparing the kernels' shapes on a GPU.
    pub gpu_row_warps: Option<u32>,
    /// The shortest partition of the CUDA paged attention, in positions
    /// (`None`: 64; the launch takes the shortest its state budget allows).
    pub gpu_att_part: Option<usize>,
    /// The CUDA products normalize their inputs themselves (RMSNorm in
    /// the product's blocks) where they fit, instead of a norm kernel
    /// before each.
    pub gpu_fuse_norm: bool,
    /// The CUDA decode attention merges a query's partitions in its own
    /// launch (the last block of the query to finish), instead of a merge
    /// kernel after it.
    pub gpu_fuse_merge: bool,
    /// The CUDA forward runs batches of more than 64 tokens too (prefill),
    /// its products as cuBLAS f32 GEMMs on weights expanded to f32
    /// (default: those batches run the reference forward). Off until
    /// measured on a GPU.
    pub gpu_prefill: bool,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            isa: None,
            activations: Activations::Int8x2,
            huge_pages: true,
            fixed_team: false,
            reference_forward: false,
            gpu_row_warps: None,
            gpu_att_part: None,
            gpu_fuse_norm: true,
            gpu_fuse_merge: true,
            gpu_prefill: false,
        }
    }
}

impl Tuning {
    /// The defaults with the environment's overrides (the table above); a
    /// value the table does not name leaves its default.
    pub fn from_env() -> Tuning {
        let var = |name: &str| std::env::var(name).ok();
        let d = Tuning::default();
        Tuning {
            isa: var("TESSERA_ISA").and_then(|v| IsaCap::parse(&v)),
            activations: var("TESSERA_ACTIVATIONS")
                .and_then(|v| Activations::parse(&v))
                .unwrap_or(d.activations),
            huge_pages: var("TESSERA_HUGE_PAGES").as_deref() != Some("0"),
            fixed_team: var("TESSERA_FIXED_TEAM").as_deref() == Some("1"),
            reference_forward: var("TESSERA_FORWARD").as_deref() == Some("reference"),
            gpu_row_warps: var("TESSERA_CUDA_ROW_WARPS")
                .and_then(|v| v.parse().ok())
                .filter(|w| [1, 2, 4].contains(w)),
            gpu_att_part: var("TESSERA_CUDA_ATT_PART")
                .and_then(|v| v.parse().ok())
                .filter(|p: &usize| [16, 32, 64].contains(p)),
            gpu_fuse_norm: var("TESSERA_CUDA_FUSE_NORM").as_deref() != Some("0"),
            gpu_fuse_merge: var("TESSERA_CUDA_FUSE_MERGE").as_deref() != Some("0"),
            gpu_prefill: var("TESSERA_CUDA_PREFILL").as_deref() == Some("1"),
        }
    }
}

static TUNING: OnceLock<Tuning> = OnceLock::new();

/// Fixes the process's tuning. `Err` with the tuning in force when it was
/// fixed already (by an earlier `set`, or by a kernel that asked first)
/// and differs.
pub fn set(t: Tuning) -> Result<(), Tuning> {
    let now = *TUNING.get_or_init(|| t);
    if now == t {
        Ok(())
    } else {
        Err(now)
    }
}

/// The process's tuning: what [`set`] fixed, else [`Tuning::from_env`].
pub fn get() -> &'static Tuning {
    TUNING.get_or_init(Tuning::from_env)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_order_by_width() {
        for i in IsaCap::ALL {
            assert_eq!(IsaCap::parse(i.name()), Some(i));
        }
        assert_eq!(IsaCap::parse("sse"), None);
        assert!(IsaCap::Portable < IsaCap::Avx2 && IsaCap::AvxVnni < IsaCap::Avx512);
        assert!(IsaCap::Avx512 < IsaCap::Amx);
    }

    #[test]
    fn a_second_set_reports_the_tuning_in_force() {
        let now = *get();
        assert_eq!(set(now), Ok(()));
        let other = Tuning {
            fixed_team: !now.fixed_team,
            ..now
        };
        assert_eq!(set(other), Err(now));
        assert_eq!(*get(), now);
    }
}
