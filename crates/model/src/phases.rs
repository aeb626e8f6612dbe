//! Where a decode step's time goes, when asked: the CPU fast path's
//! attention phase (from the barrier after the fused QKV to the barrier
//! after the merge: the items, the merge and the waits at those barriers,
//! timed on the first worker) and the whole forward, summed over the
//! forwards that decode (one token per sequence); on CUDA, the CUDA
//! forward's whole step, its stream synchronized before the clock is read
//! (no attention phase of its own). Only with the `phase-clock` feature
//! (the CLI's `bench` turns it on; a library build carries none of it),
//! and off unless [`start`]ed; then two clock reads per layer. `tessera bench` turns it on around its
//! decode runs (`decode-long`, `decode-batch`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

/// Totals since [`start`], over the decode steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodePhases {
    pub steps: u64,
    /// Mean forward time of a step, ms.
    pub forward_ms: f64,
    /// Mean time of a step's attention phases (all layers), ms.
    pub attention_ms: f64,
}

impl DecodePhases {
    /// The attention phases' share of the forward.
    pub fn attention_share(&self) -> f64 {
        self.attention_ms / self.forward_ms.max(1e-12)
    }
}

/// The switch and the totals.
pub(crate) struct Clock {
    on: AtomicBool,
    steps: AtomicU64,
    forward_ns: AtomicU64,
    attention_ns: AtomicU64,
}

/// The process's clock, which the fast path reports to.
pub(crate) static CLOCK: Clock = Clock::new();

impl Clock {
    const fn new() -> Clock {
        Clock {
            on: AtomicBool::new(false),
            steps: AtomicU64::new(0),
            forward_ns: AtomicU64::new(0),
            attention_ns: AtomicU64::new(0),
        }
    }

    fn start(&self) {
        for c in [&self.steps, &self.forward_ns, &self.attention_ns] {
            c.store(0, Relaxed);
        }
        self.on.store(true, Relaxed);
    }

    fn stop(&self) -> Option<DecodePhases> {
        self.on.store(false, Relaxed);
        let steps = self.steps.load(Relaxed);
        let ms = |c: &AtomicU64| c.load(Relaxed) as f64 / 1e6 / steps as f64;
        (steps > 0).then(|| DecodePhases {
            steps,
            forward_ms: ms(&self.forward_ns),
            attention_ms: ms(&self.attention_ns),
        })
    }

    /// Whether a forward over `token_seq` (each token's sequence, a
    /// sequence's tokens consecutive) is a decode step to time.
    pub(crate) fn timing(&self, token_seq: &[u32]) -> bool {
        cfg!(feature = "phase-clock")
            && self.on.load(Relaxed)
            && !token_seq.is_empty()
            && token_seq.windows(2).all(|w| w[0] != w[1])
    }

    pub(crate) fn add_attention(&self, ns: u64) {
        self.attention_ns.fetch_add(ns, Relaxed);
    }

    pub(crate) fn add_step(&self, ns: u64) {
        self.forward_ns.fetch_add(ns, Relaxed);
        self.steps.fetch_add(1, Relaxed);
    }
}

/// Clears the totals and starts timing.
pub fn start() {
    CLOCK.start()
}

/// Stops timing: the totals since [`start`] (`None` if no decode step ran
/// through the fast path).
pub fn stop() -> Option<DecodePhases> {
    CLOCK.stop()
}

#[cfg(all(test, feature = "phase-clock"))]
mod tests {
    use super::*;

    #[test]
    fn only_one_token_per_sequence_is_a_decode_step() {
        let c = Clock::new();
        assert!(!c.timing(&[0]), "off until started");
        c.start();
        assert!(c.timing(&[0]));
        assert!(c.timing(&[0, 1, 2]));
        assert!(!c.timing(&[0, 0, 1]));
        assert!(!c.timing(&[]));
        c.add_step(3_000_000);
        c.add_attention(1_000_000);
        c.add_step(1_000_000);
        let p = c.stop().expect("two steps");
        assert_eq!(p.steps, 2);
        assert!((p.forward_ms - 2.0).abs() < 1e-9 && (p.attention_ms - 0.5).abs() < 1e-9);
        assert!((p.attention_share() - 0.25).abs() < 1e-9);
        assert!(!c.timing(&[0]), "off after stop");
        c.start();
        assert_eq!(c.stop(), None, "no step since start");
    }
}
