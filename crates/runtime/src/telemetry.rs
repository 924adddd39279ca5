//! Logs (`tracing`, filtered by `RUST_LOG`, JSON when `ARL_LOG_FORMAT=json`), traces
//! exported over OTLP/HTTP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, and the W3C trace
//! context carried on NATS headers so one trial is one trace across services.
//!
//! Spans always get OpenTelemetry trace ids — also without an exporter — so that a
//! `traceparent` travels through every hop whether or not this process exports.

use std::io::IsTerminal;

use async_nats::HeaderMap;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::headers::{HeaderExtractor, HeaderInjector, HttpExtractor, HttpInjector};

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("cannot build the OTLP exporter for {endpoint}: {reason}")]
    Exporter { endpoint: String, reason: String },
}

/// Owns trace export. Call [`TelemetryGuard::shutdown`] at the very end of `main`, after
/// every other task has finished, so the last spans are flushed.
#[derive(Debug)]
pub struct TelemetryGuard {
    provider: SdkTracerProvider,
}

impl TelemetryGuard {
    /// Exports every span still buffered.
    pub async fn flush(&self) {
        let provider = self.provider.clone();
        // The SDK blocks the calling thread while the export runs on the runtime; do that
        // on a blocking thread so a current-thread runtime keeps turning.
        let flushed = tokio::task::spawn_blocking(move || provider.force_flush()).await;
        if let Ok(Err(err)) = flushed {
            eprintln!("telemetry: flushing spans failed: {err}");
        }
    }

    /// Flushes and stops export.
    pub async fn shutdown(self) {
        self.flush().await;
        let provider = self.provider;
        let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
    }
}

/// The project traces are filed under in UIs that group by project (Phoenix):
/// `ARL_TRACE_PROJECT`, else `arl`.
pub fn trace_project() -> String {
    std::env::var("ARL_TRACE_PROJECT")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "arl".to_owned())
}

/// `OTEL_EXPORTER_OTLP_ENDPOINT`, the OTLP/HTTP base URL (e.g. `http://jaeger:4318`).
pub fn otlp_endpoint_from_env() -> Option<String> {
    std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
        .ok()
        .filter(|e| !e.is_empty())
}

/// Installs the global subscriber and propagator, exporting spans to `otlp_endpoint` (an
/// OTLP/HTTP base URL) when given. Must run inside a tokio runtime. A second call in one
/// process (tests) keeps the first subscriber.
pub fn init(
    service: &'static str,
    otlp_endpoint: Option<String>,
) -> Result<TelemetryGuard, TelemetryError> {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());

    // Phoenix files spans by this attribute; every ARL service lands in one project, so a
    // trial's spans from all of them form one trace there.
    let resource = Resource::builder()
        .with_service_name(service)
        .with_attribute(opentelemetry::KeyValue::new(
            "openinference.project.name",
            trace_project(),
        ))
        .build();
    let mut provider = SdkTracerProvider::builder().with_resource(resource);
    let endpoint = otlp_endpoint;
    if let Some(endpoint) = &endpoint {
        let traces_url = format!("{}/v1/traces", endpoint.trim_end_matches('/'));
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(traces_url)
            .build()
            .map_err(|err| TelemetryError::Exporter {
                endpoint: endpoint.clone(),
                reason: err.to_string(),
            })?;
        let processor =
            BatchSpanProcessor::builder(exporter, opentelemetry_sdk::runtime::Tokio).build();
        provider = provider
            .with_span_processor(ServiceOnSpans(service))
            .with_span_processor(processor);
    }
    let provider = provider.build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    let tracer = provider.tracer(service);

    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,async_nats=warn,opentelemetry=warn"));
    let json = std::env::var("ARL_LOG_FORMAT").is_ok_and(|f| f == "json");
    let fmt = if json {
        tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .boxed()
    } else {
        // Colours only for a person at a terminal: a log file (`arl up`'s logs, a script's
        // capture) gets plain lines that grep and other tools read as written.
        tracing_subscriber::fmt::layer()
            .with_target(false)
            .with_ansi(std::io::stderr().is_terminal())
            .with_writer(std::io::stderr)
            .boxed()
    };
    // `RUST_LOG` filters the log lines only: spans at info and above are always traced,
    // so a quiet service still carries every trial's trace on to the next hop.
    let otel = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(tracing_subscriber::filter::LevelFilter::INFO);
    let installed = tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(otel)
        .try_init();
    if installed.is_ok() {
        tracing::info!(
            service,
            otlp = endpoint.as_deref().unwrap_or("off"),
            "telemetry ready"
        );
    }
    Ok(TelemetryGuard { provider })
}

/// Names the service on every span as well as on the resource: trace UIs that keep only
/// span attributes (Phoenix) still show which service each span of a trial came from.
#[derive(Debug)]
struct ServiceOnSpans(&'static str);

impl opentelemetry_sdk::trace::SpanProcessor for ServiceOnSpans {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, _: &opentelemetry::Context) {
        use opentelemetry::trace::Span as _;
        span.set_attribute(opentelemetry::KeyValue::new("service.name", self.0));
    }

    fn on_end(&self, _: opentelemetry_sdk::trace::SpanData) {}

    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(
        &self,
        _: std::time::Duration,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        Ok(())
    }
}

/// Writes the current span's context into `traceparent` (and `tracestate`).
pub fn inject_context(headers: &mut HeaderMap) {
    let context = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.inject_context(&context, &mut HeaderInjector(headers));
    });
}

/// Makes `span` a child of the trace named in the message's `traceparent`.
pub fn set_parent_from_headers(span: &tracing::Span, headers: &HeaderMap) {
    let parent = opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.extract(&HeaderExtractor(headers))
    });
    if let Err(err) = span.set_parent(parent) {
        tracing::debug!(%err, "span already started; trace parent not set");
    }
}

/// Writes the current span's context into an HTTP request's `traceparent`: the hop from an
/// agent to the proxy, from the proxy to an engine, from a trial to its sandbox.
pub fn inject_http(headers: &mut axum::http::HeaderMap) {
    let context = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.inject_context(&context, &mut HttpInjector(headers));
    });
}

/// Makes `span` a child of the trace an HTTP request's `traceparent` names (none: `span`
/// stays where it is).
pub fn set_parent_from_http(span: &tracing::Span, headers: &axum::http::HeaderMap) {
    if !headers.contains_key("traceparent") {
        return;
    }
    let parent = opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.extract(&HttpExtractor(headers))
    });
    if let Err(err) = span.set_parent(parent) {
        tracing::debug!(%err, "span already started; trace parent not set");
    }
}

/// Links `span` — a new trace's root, made with `parent: None` — to the current span: a
/// trial's trace points back at the step that asked for it, instead of the step's trace
/// swallowing every trial.
pub fn link_to_current(span: &tracing::Span) {
    use opentelemetry::trace::TraceContextExt;
    let current = tracing::Span::current()
        .context()
        .span()
        .span_context()
        .clone();
    if current.is_valid() {
        span.add_link(current);
    }
}

/// A span's place in a trace, kept to parent later work on: the proxy keeps the one a
/// trial key was issued in, so the LLM calls of an agent that sends no `traceparent`
/// (mini-swe-agent) still join their trial's trace.
#[derive(Clone, Debug, Default)]
pub struct TraceContext(opentelemetry::Context);

impl TraceContext {
    /// The current span's.
    pub fn current() -> Self {
        Self(tracing::Span::current().context())
    }

    /// Makes `span` (not yet entered) a child of this context.
    pub fn adopt(&self, span: &tracing::Span) {
        if let Err(err) = span.set_parent(self.0.clone()) {
            tracing::debug!(%err, "span already started; trace parent not set");
        }
    }
}

/// The trace id of the current span, hex, if it has one. Handy in logs and tests.
pub fn current_trace_id() -> Option<String> {
    use opentelemetry::trace::TraceContextExt;
    let context = tracing::Span::current().context();
    let span_context = context.span().span_context().clone();
    span_context
        .is_valid()
        .then(|| span_context.trace_id().to_string())
}
