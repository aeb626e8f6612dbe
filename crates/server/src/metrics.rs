//! `/metrics` in Prometheus' text format, with vLLM's metric names (prefix
//! `tessera:`, or `vllm:` with `--metrics-prefix vllm`) so that existing
//! dashboards and routers read them. Recorded with the `metrics` crate and
//! rendered by `metrics-exporter-prometheus`, one recorder per server (not
//! the process-global one, so that two servers in one process keep apart).
//! Gauges and token counters are the engine's stats, set when the page is
//! rendered; the latency histograms are observed by the server.

use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Key, Label, Level, Metadata, Recorder};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};
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

/// What a value of the engine's stats is exported as.
enum Kind {
    Gauge,
    Counter,
}

/// The engine's stats on the page: name, kind, help, and the value.
type StatLine = (&'static str, Kind, &'static str, StatOf);
/// Reads one value from the engine's stats.
type StatOf = fn(&EngineStats) -> f64;

const STATS: &[StatLine] = &[
    (
        "num_requests_running",
        Kind::Gauge,
        "Sequences in the running batch.",
        |s| s.running as f64,
    ),
    (
        "num_requests_waiting",
        Kind::Gauge,
        "Sequences waiting for admission.",
        |s| s.waiting as f64,
    ),
    (
        "kv_cache_usage_perc",
        Kind::Gauge,
        "Share of KV blocks held by sequences (1 = all).",
        |s| s.kv.used_blocks as f64 / s.kv.num_blocks.max(1) as f64,
    ),
    (
        "prefix_cache_queries_total",
        Kind::Counter,
        "Prompt tokens looked up in the prefix cache.",
        |s| s.prompt_tokens as f64,
    ),
    (
        "prefix_cache_hits_total",
        Kind::Counter,
        "Prompt tokens served from the prefix cache.",
        |s| s.cached_tokens as f64,
    ),
    (
        "prefix_cache_disk_hits_total",
        Kind::Counter,
        "Prompt tokens served from the disk tier below the pool (--cache-dir), counted in prefix_cache_hits_total too.",
        |s| s.disk_cached_tokens as f64,
    ),
    (
        "disk_tier_blocks",
        Kind::Gauge,
        "KV blocks the disk tier holds.",
        |s| s.disk_tier.map_or(0.0, |t| t.blocks as f64),
    ),
    (
        "disk_tier_bytes",
        Kind::Gauge,
        "Bytes of the disk tier's files.",
        |s| s.disk_tier.map_or(0.0, |t| t.bytes as f64),
    ),
    (
        "disk_tier_blocks_written_total",
        Kind::Counter,
        "KV blocks written to the disk tier as eviction freed them.",
        |s| s.disk_tier.map_or(0.0, |t| t.written as f64),
    ),
    (
        "disk_tier_blocks_read_total",
        Kind::Counter,
        "KV blocks read back from the disk tier instead of computed.",
        |s| s.disk_tier.map_or(0.0, |t| t.read as f64),
    ),
    (
        "num_preemptions_total",
        Kind::Counter,
        "Running sequences sent back to the queue for lack of blocks.",
        |s| s.preemptions as f64,
    ),
    (
        "spec_decode_num_draft_tokens_total",
        Kind::Counter,
        "Draft tokens computed by speculative decoding (--spec-ngram, --model-draft).",
        |s| s.spec_draft_tokens as f64,
    ),
    (
        "spec_decode_num_accepted_tokens_total",
        Kind::Counter,
        "Draft tokens kept: the sampler drew them.",
        |s| s.spec_accepted_tokens as f64,
    ),
    (
        "spec_decode_draft_model_seconds_total",
        // A gauge: the recorder's counters are whole numbers.
        Kind::Gauge,
        "Time the draft model took to draft (--model-draft); the steps wait for it.",
        |s| s.spec_draft_ns as f64 / 1e9,
    ),
    (
        "spec_decode_guess_cost",
        Kind::Gauge,
        "What a checked draft token costs, in tokens of plain decoding at the last step's batch size (the draft model's time included); a sample drafts while the share of its recent draft tokens kept is above it. 0 until measured.",
        |s| s.spec_guess_cost_ppm as f64 / 1e6,
    ),
    (
        "structured_output_masks_total",
        Kind::Counter,
        "Next-token masks computed for constrained samples (structured output, forced tool calls).",
        |s| s.guide_masks as f64,
    ),
    (
        "structured_output_mask_seconds_total",
        // A gauge: the recorder's counters are whole numbers.
        Kind::Gauge,
        "Time computing those masks.",
        |s| s.guide_mask_ns as f64 / 1e9,
    ),
    (
        "structured_output_mask_wait_seconds_total",
        // A gauge: the recorder's counters are whole numbers.
        Kind::Gauge,
        "The part of that time on the steps' path (all of it where no core is free beside the forward).",
        |s| s.guide_wait_ns as f64 / 1e9,
    ),
    (
        "prompt_tokens_total",
        Kind::Counter,
        "Prompt tokens of all requests.",
        |s| s.prompt_tokens as f64,
    ),
    (
        "generation_tokens_total",
        Kind::Counter,
        "Generated tokens of all requests.",
        |s| s.completion_tokens as f64,
    ),
    (
        "kv_cache_bytes_held",
        Kind::Gauge,
        "Bytes of KV blocks held by sequences or the prefix cache (both pools).",
        |s| s.kv_bytes_held as f64,
    ),
    (
        "sliding_window_evictions_total",
        Kind::Counter,
        "Sliding-window blocks taken from cached content under pressure.",
        |s| s.kv.evicted_sliding_blocks as f64,
    ),
];

/// A handle on one of [`STATS`].
enum Stat {
    Gauge(Gauge),
    Counter(Counter),
}

/// The server's metrics: its recorder and the handles it records through.
pub struct Metrics {
    prefix: String,
    recorder: PrometheusRecorder,
    stats: Vec<(Stat, StatOf)>,
    ttft: Histogram,
    gap: Histogram,
    e2e: Histogram,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

static META: Metadata<'static> = Metadata::new(module_path!(), Level::INFO, None);

impl Metrics {
    pub fn new(prefix: &str) -> Metrics {
        let name = |n: &str| format!("{prefix}:{n}");
        let histograms = [
            (
                "time_to_first_token_seconds",
                LATENCY,
                "Request start to its first token.",
            ),
            (
                "inter_token_latency_seconds",
                GAPS,
                "Time between two tokens of a sample.",
            ),
            (
                "e2e_request_latency_seconds",
                LATENCY,
                "Request start to its end.",
            ),
        ];
        let mut builder = PrometheusBuilder::new();
        for (n, bounds, _) in histograms {
            builder = builder
                .set_buckets_for_metric(Matcher::Full(name(n)), bounds)
                .expect("bucket bounds are not empty");
        }
        let recorder = builder.build_recorder();
        let stats = STATS
            .iter()
            .map(|(n, kind, help, value)| {
                let key = Key::from_name(name(n));
                let stat = match kind {
                    Kind::Gauge => {
                        recorder.describe_gauge(name(n).into(), None, (*help).into());
                        Stat::Gauge(recorder.register_gauge(&key, &META))
                    }
                    Kind::Counter => {
                        recorder.describe_counter(name(n).into(), None, (*help).into());
                        Stat::Counter(recorder.register_counter(&key, &META))
                    }
                };
                (stat, *value)
            })
            .collect();
        recorder.describe_gauge(
            name("cache_config_info").into(),
            None,
            "The KV cache's geometry.".into(),
        );
        let [ttft, gap, e2e] = histograms.map(|(n, _, help)| {
            recorder.describe_histogram(name(n).into(), None, help.into());
            recorder.register_histogram(&Key::from_name(name(n)), &META)
        });
        Metrics {
            prefix: prefix.to_string(),
            recorder,
            stats,
            ttft,
            gap,
            e2e,
        }
    }

    /// A request's first token came this long after it started.
    pub fn ttft(&self, d: f64) {
        self.ttft.record(d);
    }

    /// Two consecutive tokens of a sample came this far apart.
    pub fn gap(&self, d: Duration) {
        self.gap.record(d.as_secs_f64());
    }

    /// A request finished this long after it started.
    pub fn e2e(&self, d: f64) {
        self.e2e.record(d);
    }

    /// The text of `/metrics`: the engine's stats as they are now, and the
    /// histograms observed so far.
    pub fn render(&self, s: &EngineStats) -> String {
        for (stat, value) in &self.stats {
            let v = value(s);
            match stat {
                Stat::Gauge(g) => g.set(v),
                Stat::Counter(c) => c.absolute(v as u64),
            }
        }
        let kv = &s.kv;
        let info = Key::from_parts(
            format!("{}:cache_config_info", self.prefix),
            vec![
                Label::new("block_size", kv.block_size.to_string()),
                Label::new("num_blocks", kv.num_blocks.to_string()),
                Label::new("sliding_blocks", kv.sliding_blocks.to_string()),
            ],
        );
        self.recorder.register_gauge(&info, &META).set(1.0);
        self.recorder.handle().render()
    }
}
