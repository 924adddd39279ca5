//! The proxy's metrics: every agent's LLM calls as the proxy saw them, whatever engine
//! served them (ARL's, vLLM, SGLang) — answered calls by status, recorded calls' latency
//! and tokens.

use arl_runtime::Metrics;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabel {
    /// The HTTP status the agent got.
    pub status: u16,
}

#[derive(Clone, Debug)]
pub struct ProxyMetrics {
    pub calls: Family<StatusLabel, Counter>,
    pub call_seconds: Histogram,
    pub time_to_first_token_seconds: Histogram,
    pub prompt_tokens: Counter,
    pub completion_tokens: Counter,
}

impl ProxyMetrics {
    pub fn register(metrics: &Metrics) -> Self {
        let m = Self {
            calls: Family::default(),
            call_seconds: Histogram::new(exponential_buckets(0.01, 2.0, 16)),
            time_to_first_token_seconds: Histogram::new(exponential_buckets(0.005, 2.0, 16)),
            prompt_tokens: Counter::default(),
            completion_tokens: Counter::default(),
        };
        metrics.register(
            "proxy_calls",
            "LLM calls answered, by HTTP status",
            m.calls.clone(),
        );
        metrics.register(
            "proxy_call_seconds",
            "Latency of recorded LLM calls, arrival to last token",
            m.call_seconds.clone(),
        );
        metrics.register(
            "proxy_time_to_first_token_seconds",
            "Time to the first token of recorded streamed calls",
            m.time_to_first_token_seconds.clone(),
        );
        metrics.register(
            "proxy_prompt_tokens",
            "Prompt tokens of recorded calls",
            m.prompt_tokens.clone(),
        );
        metrics.register(
            "proxy_completion_tokens",
            "Completion tokens of recorded calls",
            m.completion_tokens.clone(),
        );
        m
    }
}
