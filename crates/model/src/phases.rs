//! Where a decode step's time goes, when asked: the CPU fast path's
//! attention phase (from the barrier after the fused QKV to the barrier
//! after the merge: the items, the merge and the waits at those barriers,
//! timed on the first worker) and the whole forward, summed over the
//! forwards that decode (one token per sequence); on CUDA, the CUDA
//! forward's whole step, its stream synchronized before the clock is read
//! (no attention phase of its own). Only with the `phase-clock` feature
//! (the CLI's `bench` turns it on; a library build carries none of it),
//! and off unless [`start`]ed; then a clock read at the end of each
//! [`Part`] (five a layer, one for the head). `tessera bench` turns it on
//! around its decode runs (`decode-long`, `decode-batch`, `roofline
//! --model`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

/// The parts of a CPU decode step, each from the barrier that ends the
/// part before it to the barrier that ends it (summed over the layers),
/// timed on the first worker, so that they add up to the step less the
/// team's wake-up and the last part's wait for the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The attention norm, the input's quantization, the q, k and v
    /// projections, their norms, RoPE and the stores to the cache.
    Qkv,
    /// The attention items and the merges of their states.
    Attention,
    /// The attention output's quantization and projection, added to the
    /// residual.
    Output,
    /// The FFN norm, the input's quantization, gate and up with the
    /// activation.
    GateUp,
    /// The FFN product's quantization and the down projection.
    Down,
    /// The final norm and the output head (no barrier at its end).
    Head,
}

impl Part {
    pub const ALL: [Part; PARTS] = [
        Part::Qkv,
        Part::Attention,
        Part::Output,
        Part::GateUp,
        Part::Down,
        Part::Head,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Part::Qkv => "qkv",
            Part::Attention => "attention",
            Part::Output => "output",
            Part::GateUp => "gate_up",
            Part::Down => "down",
            Part::Head => "head",
        }
    }
}

pub const PARTS: usize = 6;

/// One part's mean time and the weight bytes it reads, a step.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PartTime {
    pub ms: f64,
    /// Weight bytes the part's matrices hold (0 for attention, whose
    /// reads are the K/V cache's).
    pub bytes: u64,
}

impl PartTime {
    /// The part's weights over its time, GB/s (0 without weights).
    pub fn gb_s(&self) -> f64 {
        if self.ms > 0.0 {
            self.bytes as f64 / self.ms / 1e6
        } else {
            0.0
        }
    }
}

/// Totals since [`start`], over the decode steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodePhases {
    pub steps: u64,
    /// Mean forward time of a step, ms.
    pub forward_ms: f64,
    /// Mean time of a step's attention phases (all layers), ms: the
    /// [`Part::Attention`] part's.
    pub attention_ms: f64,
    /// The step's parts, in [`Part::ALL`]'s order.
    pub parts: [PartTime; PARTS],
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
    part_ns: [AtomicU64; PARTS],
    part_bytes: [AtomicU64; PARTS],
}

/// The process's clock, which the fast path reports to.
pub(crate) static CLOCK: Clock = Clock::new();

impl Clock {
    const fn new() -> Clock {
        Clock {
            on: AtomicBool::new(false),
            steps: AtomicU64::new(0),
            forward_ns: AtomicU64::new(0),
            part_ns: [const { AtomicU64::new(0) }; PARTS],
            part_bytes: [const { AtomicU64::new(0) }; PARTS],
        }
    }

    fn start(&self) {
        let parts = self.part_ns.iter().chain(&self.part_bytes);
        for c in [&self.steps, &self.forward_ns].into_iter().chain(parts) {
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
            attention_ms: ms(&self.part_ns[Part::Attention as usize]),
            parts: std::array::from_fn(|i| PartTime {
                ms: ms(&self.part_ns[i]),
                bytes: self.part_bytes[i].load(Relaxed) / steps,
            }),
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

    /// A part's time in one layer (or the head) of a step, and the weight
    /// bytes it read.
    pub(crate) fn add_part(&self, part: Part, ns: u64, bytes: u64) {
        self.part_ns[part as usize].fetch_add(ns, Relaxed);
        self.part_bytes[part as usize].fetch_add(bytes, Relaxed);
    }

    pub(crate) fn add_step(&self, ns: u64) {
        self.forward_ns.fetch_add(ns, Relaxed);
        self.steps.fetch_add(1, Relaxed);
    }
}

/// The first worker's clock over a step's parts: each [`Laps::lap`] adds
/// the time since the one before (or since the step began) to a part.
pub(crate) struct Laps(Option<std::time::Instant>);

impl Laps {
    /// Laps that time (`on`), or do nothing.
    pub(crate) fn new(on: bool) -> Laps {
        Laps(on.then(std::time::Instant::now))
    }

    pub(crate) fn lap(&mut self, part: Part, bytes: usize) {
        if let Some(last) = &mut self.0 {
            let now = std::time::Instant::now();
            CLOCK.add_part(part, (now - *last).as_nanos() as u64, bytes as u64);
            *last = now;
        }
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
        c.add_part(Part::Attention, 1_000_000, 0);
        c.add_step(1_000_000);
        c.add_part(Part::Down, 500_000, 1_000_000);
        c.add_part(Part::Down, 1_500_000, 3_000_000);
        let p = c.stop().expect("two steps");
        let down = p.parts[Part::Down as usize];
        assert!((down.ms - 1.0).abs() < 1e-9 && down.bytes == 2_000_000);
        assert!((down.gb_s() - 2.0).abs() < 1e-9, "2 MB a step in 1 ms");
        assert_eq!(p.parts[Part::Qkv as usize], PartTime::default());
        assert_eq!(p.steps, 2);
        assert!((p.forward_ms - 2.0).abs() < 1e-9 && (p.attention_ms - 0.5).abs() < 1e-9);
        assert!((p.attention_share() - 0.25).abs() < 1e-9);
        assert!(!c.timing(&[0]), "off after stop");
        c.start();
        assert_eq!(c.stop(), None, "no step since start");
    }
}
