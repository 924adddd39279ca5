//! The engine's metrics. Request latencies, token counts and live state keep vLLM's names
//! and labels (`vllm:time_to_first_token_seconds{model_name=…}`, …), so the dashboards and
//! alerts people already run against vLLM chart this engine unchanged; what only ARL has
//! (requests by endpoint and status, malformed tool calls) is `arl_inference_*`.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use arl_runtime::Metrics;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;

use crate::engine::{EngineHandle, FinishReason};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabel {
    pub endpoint: &'static str,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabel {
    pub model_name: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FinishLabel {
    pub model_name: String,
    /// `stop`, `length`, `abort` (vLLM's values).
    pub finished_reason: &'static str,
}

/// vLLM's latency buckets (seconds) for time to first token.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's buckets for the time per output token.
const TPOT_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's buckets for whole-request phases (e2e, queue, prefill, decode).
const REQUEST_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// The service's own metric families, with the served model's name as their label.
#[derive(Clone, Debug)]
pub struct InferenceMetrics {
    model: ModelLabel,
    pub requests: Family<RequestLabel, Counter>,
    pub tool_call_parse_failures: Counter,
    prompt_tokens: Family<ModelLabel, Counter>,
    generation_tokens: Family<ModelLabel, Counter>,
    prefix_cache_queries: Family<ModelLabel, Counter>,
    prefix_cache_hits: Family<ModelLabel, Counter>,
    request_success: Family<FinishLabel, Counter>,
    time_to_first_token: Family<ModelLabel, Histogram>,
    time_per_output_token: Family<ModelLabel, Histogram>,
    e2e_latency: Family<ModelLabel, Histogram>,
    queue_time: Family<ModelLabel, Histogram>,
    prefill_time: Family<ModelLabel, Histogram>,
    decode_time: Family<ModelLabel, Histogram>,
}

fn ttft_histogram() -> Histogram {
    Histogram::new(TTFT_BUCKETS.iter().copied())
}

fn tpot_histogram() -> Histogram {
    Histogram::new(TPOT_BUCKETS.iter().copied())
}

fn request_histogram() -> Histogram {
    Histogram::new(REQUEST_BUCKETS.iter().copied())
}

impl InferenceMetrics {
    /// Registers the families (and the live gauges read from `engine`) for a model served
    /// as `model_name`.
    pub fn register(metrics: &Metrics, model_name: &str, engine: &EngineHandle) -> Self {
        let m = Self {
            model: ModelLabel {
                model_name: model_name.to_owned(),
            },
            requests: Family::default(),
            tool_call_parse_failures: Counter::default(),
            prompt_tokens: Family::default(),
            generation_tokens: Family::default(),
            prefix_cache_queries: Family::default(),
            prefix_cache_hits: Family::default(),
            request_success: Family::default(),
            time_to_first_token: Family::new_with_constructor(ttft_histogram),
            time_per_output_token: Family::new_with_constructor(tpot_histogram),
            e2e_latency: Family::new_with_constructor(request_histogram),
            queue_time: Family::new_with_constructor(request_histogram),
            prefill_time: Family::new_with_constructor(request_histogram),
            decode_time: Family::new_with_constructor(request_histogram),
        };
        metrics.register(
            "inference_requests",
            "Requests by endpoint and status",
            m.requests.clone(),
        );
        metrics.register(
            "inference_tool_call_parse_failures",
            "Completions that opened a tool call that did not parse (returned as text)",
            m.tool_call_parse_failures.clone(),
        );
        let families = [
            (
                "vllm:time_to_first_token_seconds",
                "Time from arrival to the first generated token",
                &m.time_to_first_token,
            ),
            (
                "vllm:time_per_output_token_seconds",
                "Mean time between a request's output tokens",
                &m.time_per_output_token,
            ),
            (
                "vllm:e2e_request_latency_seconds",
                "Time from arrival to the last token",
                &m.e2e_latency,
            ),
            (
                "vllm:request_queue_time_seconds",
                "Time waiting for a batch slot",
                &m.queue_time,
            ),
            (
                "vllm:request_prefill_time_seconds",
                "Time from admission to the first token",
                &m.prefill_time,
            ),
            (
                "vllm:request_decode_time_seconds",
                "Time from the first token to the last",
                &m.decode_time,
            ),
        ];
        for (name, help, family) in families {
            metrics.register_foreign(name, help, family.clone());
        }
        let counters = [
            (
                "vllm:prompt_tokens",
                "Prefill tokens processed",
                &m.prompt_tokens,
            ),
            (
                "vllm:generation_tokens",
                "Generation tokens processed",
                &m.generation_tokens,
            ),
            (
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix and session caches",
                &m.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prompt tokens found in the prefix and session caches",
                &m.prefix_cache_hits,
            ),
        ];
        for (name, help, family) in counters {
            metrics.register_foreign(name, help, family.clone());
        }
        metrics.register_foreign(
            "vllm:request_success",
            "Finished requests, by finish reason",
            m.request_success.clone(),
        );
        metrics.register_foreign_collector(LiveState {
            model: m.model.clone(),
            engine: engine.clone(),
        });
        m
    }

    /// Counts a request's prompt as it is submitted, and the part of it found cached.
    pub fn prompt(&self, tokens: usize, cached: usize) {
        self.prompt_tokens
            .get_or_create(&self.model)
            .inc_by(tokens as u64);
        self.prefix_cache_queries
            .get_or_create(&self.model)
            .inc_by(tokens as u64);
        self.prefix_cache_hits
            .get_or_create(&self.model)
            .inc_by(cached as u64);
    }

    /// Records a finished request's phases and tokens; one success per choice, by its
    /// finish reason (`None`: aborted).
    pub fn finished(&self, timeline: &Timeline, tokens: usize, reasons: &[Option<FinishReason>]) {
        let Phases {
            queue,
            prefill,
            decode,
            e2e,
        } = timeline.phases();
        let model = &self.model;
        self.generation_tokens
            .get_or_create(model)
            .inc_by(tokens as u64);
        for reason in reasons {
            self.request_success
                .get_or_create(&FinishLabel {
                    model_name: model.model_name.clone(),
                    finished_reason: match reason {
                        Some(FinishReason::Stop) => "stop",
                        Some(FinishReason::Length) => "length",
                        None => "abort",
                    },
                })
                .inc();
        }
        self.e2e_latency
            .get_or_create(model)
            .observe(e2e.as_secs_f64());
        self.queue_time
            .get_or_create(model)
            .observe(queue.as_secs_f64());
        if let Some(first) = timeline.time_to_first_token() {
            self.time_to_first_token
                .get_or_create(model)
                .observe(first.as_secs_f64());
            self.prefill_time
                .get_or_create(model)
                .observe(prefill.as_secs_f64());
            self.decode_time
                .get_or_create(model)
                .observe(decode.as_secs_f64());
        }
        if let Some(per_token) = timeline.time_per_output_token() {
            self.time_per_output_token
                .get_or_create(model)
                .observe(per_token.as_secs_f64());
        }
    }
}

/// When a request arrived, was admitted, and produced its first and last tokens.
#[derive(Clone, Debug)]
pub struct Timeline {
    arrived: Instant,
    admitted: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// Tokens of the longest choice: the choices decode side by side, so the time per
    /// output token is the decode time over this count's gaps.
    longest: usize,
}

/// A finished request's phases, as vLLM splits them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Phases {
    pub queue: Duration,
    pub prefill: Duration,
    pub decode: Duration,
    pub e2e: Duration,
}

impl Timeline {
    pub fn new(arrived: Instant) -> Self {
        Self {
            arrived,
            admitted: None,
            first_token: None,
            last_token: None,
            longest: 0,
        }
    }

    pub fn admitted(&mut self, at: Instant) {
        self.admitted.get_or_insert(at);
    }

    /// A token of a choice that now holds `choice_tokens` tokens.
    pub fn token(&mut self, at: Instant, choice_tokens: usize) {
        self.first_token.get_or_insert(at);
        self.last_token = Some(at);
        self.longest = self.longest.max(choice_tokens);
    }

    pub fn time_to_first_token(&self) -> Option<Duration> {
        self.first_token.map(|t| t - self.arrived)
    }

    pub fn time_per_output_token(&self) -> Option<Duration> {
        let (first, last) = (self.first_token?, self.last_token?);
        let gaps = u32::try_from(self.longest.checked_sub(1)?).ok()?;
        (gaps > 0).then(|| (last - first) / gaps)
    }

    /// The phases up to now (a request that never started spent it all queued).
    pub fn phases(&self) -> Phases {
        let now = Instant::now();
        let admitted = self.admitted.unwrap_or(now);
        let first = self.first_token.unwrap_or(now);
        let last = self.last_token.unwrap_or(first);
        Phases {
            queue: admitted - self.arrived,
            prefill: first.saturating_duration_since(admitted),
            decode: last.saturating_duration_since(first),
            e2e: now.max(last) - self.arrived,
        }
    }
}

/// vLLM's gauges of live state, read from the engine at each scrape.
struct LiveState {
    model: ModelLabel,
    engine: EngineHandle,
}

impl std::fmt::Debug for LiveState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveState")
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

impl Collector for LiveState {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let stats = &self.engine.stats;
        let capacity = self.engine.kv_capacity_tokens().max(1);
        let gauges: [(&str, &str, f64); 3] = [
            (
                "vllm:num_requests_running",
                "Sequences in the running batch",
                stats.active.load(Ordering::SeqCst) as f64,
            ),
            (
                "vllm:num_requests_waiting",
                "Requests waiting for a batch slot",
                stats.waiting.load(Ordering::SeqCst) as f64,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage, 0 to 1: tokens cached by running sequences over the KV capacity (a GPU engine's block pool; on the CPU, max_batch × max_model_len)",
                stats.kv_tokens.load(Ordering::SeqCst) as f64 / capacity as f64,
            ),
        ];
        for (name, help, value) in gauges {
            let gauge = ConstGauge::new(value);
            let mut family = encoder.encode_descriptor(name, help, None, gauge.metric_type())?;
            gauge.encode(family.encode_family(&self.model)?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_timeline_splits_into_vllm_phases() {
        let arrived = Instant::now();
        let ms = Duration::from_millis;
        let mut timeline = Timeline::new(arrived);
        timeline.admitted(arrived + ms(10));
        timeline.admitted(arrived + ms(99)); // only the first admission counts
        // Two choices decoding side by side; the longer has 5 tokens.
        for (at, tokens) in [
            (40, 1),
            (41, 1),
            (50, 2),
            (51, 2),
            (60, 3),
            (70, 4),
            (80, 5),
        ] {
            timeline.token(arrived + ms(at), tokens);
        }
        assert_eq!(timeline.time_to_first_token(), Some(ms(40)));
        assert_eq!(timeline.time_per_output_token(), Some(ms(10)));
        let phases = timeline.phases();
        assert_eq!(phases.queue, ms(10));
        assert_eq!(phases.prefill, ms(30));
        assert_eq!(phases.decode, ms(40));
        assert!(phases.e2e >= ms(80));
    }

    #[test]
    fn a_request_that_never_started_was_all_queue() {
        let timeline = Timeline::new(Instant::now());
        assert_eq!(timeline.time_to_first_token(), None);
        assert_eq!(timeline.time_per_output_token(), None);
        let phases = timeline.phases();
        assert_eq!(phases.prefill, Duration::ZERO);
        assert_eq!(phases.decode, Duration::ZERO);
    }
}
