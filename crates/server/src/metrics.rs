//! `/metrics` in Prometheus' text format, with vLLM's metric names (prefix
//! `tessera:`, or `vllm:` with `--metrics-prefix vllm`) so that existing
//! dashboards and routers read them. Gauges and token counters come from
//! the engine's stats; the latency histograms are observed by the server.

use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

use tessera_engine::EngineStats;

/// Bucket bounds in seconds (vLLM's for TTFT and end-to-end latency).
const LATENCY: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0,
];
/// Bucket bounds in seconds between two tokens of a request.
const GAPS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.4, 0.5, 0.75, 1.0, 2.5,
];

#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    /// Observations at or below each bound (not cumulative), then above.
    counts: Vec<u64>,
    sum: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
        }
    }

    fn observe(&mut self, v: f64) {
        let i = self.bounds.partition_point(|&b| b < v);
        self.counts[i] += 1;
        self.sum += v;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut total = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            total += c;
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {total}");
        }
        total += self.counts[self.bounds.len()];
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {total}");
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {total}", self.sum);
    }
}

/// The server's own observations.
#[derive(Debug)]
pub struct Metrics {
    prefix: String,
    hist: Mutex<[Histogram; 3]>,
}

const TTFT: usize = 0;
const GAP: usize = 1;
const E2E: usize = 2;

impl Metrics {
    pub fn new(prefix: &str) -> Metrics {
        Metrics {
            prefix: prefix.to_string(),
            hist: Mutex::new([
                Histogram::new(LATENCY),
                Histogram::new(GAPS),
                Histogram::new(LATENCY),
            ]),
        }
    }

    fn observe(&self, which: usize, v: f64) {
        let mut h = self.hist.lock().unwrap_or_else(|e| e.into_inner());
        h[which].observe(v);
    }

    /// A request's first token came this long after it started.
    pub fn ttft(&self, d: f64) {
        self.observe(TTFT, d);
    }

    /// Two consecutive tokens of a sample came this far apart.
    pub fn gap(&self, d: Duration) {
        self.observe(GAP, d.as_secs_f64());
    }

    /// A request finished this long after it started.
    pub fn e2e(&self, d: f64) {
        self.observe(E2E, d);
    }

    /// The text of `/metrics`.
    pub fn render(&self, s: &EngineStats) -> String {
        let p = &self.prefix;
        let mut out = String::new();
        let kv = &s.kv;
        let usage = kv.used_blocks as f64 / kv.num_blocks.max(1) as f64;
        let (gauge, counter) = ("gauge", "counter");
        let lines: [(&str, &str, &str, String); 10] = [
            (
                "num_requests_running",
                gauge,
                "Sequences in the running batch.",
                s.running.to_string(),
            ),
            (
                "num_requests_waiting",
                gauge,
                "Sequences waiting for admission.",
                s.waiting.to_string(),
            ),
            (
                "kv_cache_usage_perc",
                gauge,
                "Share of KV blocks held by sequences (1 = all).",
                usage.to_string(),
            ),
            (
                "prefix_cache_queries_total",
                counter,
                "Prompt tokens looked up in the prefix cache.",
                s.prompt_tokens.to_string(),
            ),
            (
                "prefix_cache_hits_total",
                counter,
                "Prompt tokens served from the prefix cache.",
                s.cached_tokens.to_string(),
            ),
            (
                "num_preemptions_total",
                counter,
                "Running sequences sent back to the queue for lack of blocks.",
                s.preemptions.to_string(),
            ),
            (
                "prompt_tokens_total",
                counter,
                "Prompt tokens of all requests.",
                s.prompt_tokens.to_string(),
            ),
            (
                "generation_tokens_total",
                counter,
                "Generated tokens of all requests.",
                s.completion_tokens.to_string(),
            ),
            (
                "kv_cache_bytes_held",
                gauge,
                "Bytes of KV blocks held by sequences or the prefix cache (both pools).",
                s.kv_bytes_held.to_string(),
            ),
            (
                "sliding_window_evictions_total",
                counter,
                "Sliding-window blocks taken from cached content under pressure.",
                kv.evicted_sliding_blocks.to_string(),
            ),
        ];
        for (name, kind, help, v) in lines {
            let _ = writeln!(
                out,
                "# HELP {p}:{name} {help}\n# TYPE {p}:{name} {kind}\n{p}:{name} {v}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP {p}:cache_config_info The KV cache's geometry.\n# TYPE {p}:cache_config_info gauge\n\
             {p}:cache_config_info{{block_size=\"{}\",num_blocks=\"{}\",sliding_blocks=\"{}\"}} 1",
            kv.block_size, kv.num_blocks, kv.sliding_blocks
        );
        let h = self.hist.lock().unwrap_or_else(|e| e.into_inner());
        h[TTFT].write(
            &mut out,
            &format!("{p}:time_to_first_token_seconds"),
            "Request start to its first token.",
        );
        h[GAP].write(
            &mut out,
            &format!("{p}:inter_token_latency_seconds"),
            "Time between two tokens of a sample.",
        );
        h[E2E].write(
            &mut out,
            &format!("{p}:e2e_request_latency_seconds"),
            "Request start to its end.",
        );
        out
    }
}
