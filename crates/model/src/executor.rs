//! The seam between the model and the devices. A device with a forward of
//! its own implements [`Executor`]: it is built once per model (on the CPU
//! again when the worker count or the activations change), reads the
//! model's description (`Llama`'s layers and config), and runs the batches
//! it takes. What no executor takes (another device, a CUDA prefill, or
//! the tuning's `reference_forward`) runs through the candle reference
//! forward, which is also what the executors are tested against.
//!
//! Executors today: the CPU step-pool forward (`crate::fast`, every batch)
//! and the CUDA forward (`crate::gpu_forward`, batches of up to
//! [`GPU_FORWARD_TOKENS`] tokens, and longer ones with the tuning's
//! `gpu_prefill`).

use std::sync::MutexGuard;

use candle_core::{Device, Tensor};
use tessera_kernels::Activations;

use crate::fast::Fast;
use crate::llama::{Batch, LayerKv, Llama};
use crate::Result;

/// Batches of at most this many tokens take the CUDA forward's product
/// kernels; longer ones (prefill) the reference forward, whose products
/// are GEMMs, or with the tuning's `gpu_prefill` the CUDA forward with its
/// products as cuBLAS GEMMs.
#[cfg(feature = "cuda")]
pub(crate) const GPU_FORWARD_TOKENS: usize = 64;

/// What an executor was built for: when the model wants another, it is
/// built again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BuiltFor {
    /// Workers of the CPU step pool (0 elsewhere).
    pub threads: usize,
    /// How quantized layers meet their inputs.
    pub acts: Activations,
}

/// The GPU forwards' setting: no pool, f32 activations.
#[cfg(feature = "cuda")]
pub(crate) const ON_DEVICE: BuiltFor = BuiltFor {
    threads: 0,
    acts: Activations::F32,
};

/// One device's forward of the model.
pub(crate) trait Executor: Send {
    fn built_for(&self) -> BuiltFor;

    /// What runs, for users (`Llama::executor`).
    fn describe(&self) -> String;

    /// The logits of `batch` (writing its K/V), or `None` when this
    /// executor does not take such a batch.
    fn forward(&mut self, m: &Llama, batch: &Batch, cache: &[LayerKv]) -> Result<Option<Tensor>>;
}

impl Executor for Fast {
    fn built_for(&self) -> BuiltFor {
        BuiltFor {
            threads: self.threads(),
            acts: self.activations(),
        }
    }

    fn describe(&self) -> String {
        let n = self.threads();
        format!(
            "CPU forward ({n} worker{}, {} activations)",
            if n == 1 { "" } else { "s" },
            self.activations().name()
        )
    }

    fn forward(&mut self, m: &Llama, batch: &Batch, cache: &[LayerKv]) -> Result<Option<Tensor>> {
        m.forward_fast(self, batch, cache).map(Some)
    }
}

#[cfg(feature = "cuda")]
impl Executor for crate::gpu_forward::GpuForward {
    fn built_for(&self) -> BuiltFor {
        ON_DEVICE
    }

    fn describe(&self) -> String {
        if tessera_kernels::tuning::get().gpu_prefill {
            format!(
                "CUDA forward (batches over {GPU_FORWARD_TOKENS} tokens through cuBLAS f32 GEMMs)"
            )
        } else {
            format!("CUDA forward (batches of up to {GPU_FORWARD_TOKENS} tokens; longer ones the reference)")
        }
    }

    fn forward(&mut self, m: &Llama, batch: &Batch, cache: &[LayerKv]) -> Result<Option<Tensor>> {
        if batch.tokens.len() > GPU_FORWARD_TOKENS && !tessera_kernels::tuning::get().gpu_prefill {
            return Ok(None);
        }
        crate::gpu_forward::GpuForward::forward(self, m, batch, cache).map(Some)
    }
}

/// A model's executor: built, or why none runs it (the reference does).
pub(crate) type Slot = Option<std::result::Result<Box<dyn Executor>, String>>;

impl Llama {
    /// What this model's device wants of its executor.
    fn wanted(&self, threads: usize) -> BuiltFor {
        #[cfg(feature = "cuda")]
        if self.device.is_cuda() {
            return ON_DEVICE;
        }
        BuiltFor {
            threads: threads.max(1),
            acts: self.activations(),
        }
    }

    /// The executor for `threads` workers and the current activations,
    /// built when missing or built for others. Said once on stderr when a
    /// GPU has none that runs this model.
    pub(crate) fn executor_slot(&self, threads: usize) -> Result<MutexGuard<'_, Slot>> {
        let want = self.wanted(threads);
        let mut slot = self.exec.lock().unwrap_or_else(|e| e.into_inner());
        let stale = match slot.as_ref() {
            None => true,
            Some(Ok(e)) => e.built_for() != want,
            Some(Err(_)) => false,
        };
        if stale {
            *slot = None;
            let built = self.build_executor(want)?;
            if let (Err(why), false) = (&built, self.device.is_cpu()) {
                eprintln!("tessera: {why}; using the reference forward");
            }
            *slot = Some(built);
        }
        Ok(slot)
    }

    fn build_executor(
        &self,
        want: BuiltFor,
    ) -> Result<std::result::Result<Box<dyn Executor>, String>> {
        if tessera_kernels::tuning::get().reference_forward {
            return Ok(Err("the reference forward was asked for".into()));
        }
        match &self.device {
            Device::Cpu => Ok(Ok(Box::new(Fast::new(self, want.threads, want.acts)?))),
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) => Ok(crate::gpu_forward::GpuForward::new(self, dev)?
                .map(|g| Box::new(g) as Box<dyn Executor>)
                .map_err(|why| format!("the CUDA forward does not run {why}"))),
            #[allow(unreachable_patterns)]
            d => Ok(Err(format!(
                "{} has no forward of its own",
                crate::device_name(d)
            ))),
        }
    }

    /// What runs this model's forwards: its device's executor, or the
    /// reference forward and why (built by [`Llama::prepare`] or the first
    /// forward; `None` before).
    pub fn executor(&self) -> Option<String> {
        let slot = self.exec.lock().unwrap_or_else(|e| e.into_inner());
        slot.as_ref().map(|s| match s {
            Ok(e) => e.describe(),
            Err(why) => format!("reference forward ({why})"),
        })
    }
}
