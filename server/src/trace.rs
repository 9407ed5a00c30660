//! OpenTelemetry traces: a span per decision, exported over OTLP/gRPC (`--otlp-endpoint`; off by
//! default, and then nothing here runs on the take path).
//!
//! **Spans.** `tollgate.take` for a take, `tollgate.batch` for a batch call or a batch message on
//! a stream (its takes are decided in one store call, so one span), `tollgate.should_rate_limit`
//! for an RLS call. Attributes: `tollgate.rules` (the rule names the buckets were sent with, never
//! a key), `tollgate.buckets`,
//! `tollgate.outcome` (`allowed`, `limited`, or the error's code), `tollgate.store_ms` (the store
//! call, on its clock), and for a batch `tollgate.batch.takes`, `tollgate.batch.allowed`,
//! `tollgate.batch.limited`; for RLS `tollgate.rls.domain`.
//!
//! **Joined to the request's trace.** The parent is the W3C `traceparent` (and `tracestate`) of
//! the call: an HTTP header, or gRPC metadata (a message on a `TakeStream` stream has none of its
//! own: its span is a root, `ops/stream.rs`). The filter forwards the request's own on its
//! callout when `service.trace` is on (a sampled request then calls on its own, outside any batch,
//! so its decision has its one parent); Envoy's native rate limit filter sends Envoy's when Envoy
//! traces. A call without a parent starts a trace of its own, sampled at `--otlp-sample-ratio`;
//! one with a parent follows the parent's sampling decision (OpenTelemetry's `parentbased`).
//!
//! **Bounded.** Spans leave through the SDK's batch processor (a queue of 2,048, exported every
//! 500 ms): when the collector is slow or gone, spans are dropped, decisions never wait.

use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{FutureExt, Status, TraceContextExt, Tracer};
use opentelemetry::{global, Context, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider,
};
use opentelemetry_sdk::Resource;

/// An error a traced call can end with: its code names the outcome (`tollgate.outcome`) and the
/// span's error status. The API's error implements it; this module imports nothing above it.
pub trait Coded {
    /// The error's code (`invalid_argument`, `unavailable`, ...).
    fn code(&self) -> &'static str;
}

/// Whether spans are made at all: set once, by [`init`].
static ON: OnceLock<()> = OnceLock::new();

/// The W3C trace-context headers (and gRPC metadata keys).
pub const TRACEPARENT: &str = "traceparent";
/// See [`TRACEPARENT`].
pub const TRACESTATE: &str = "tracestate";

/// Whether traces are exported.
pub fn enabled() -> bool {
    ON.get().is_some()
}

/// Starts the OTLP/gRPC exporter towards `endpoint` (e.g. `http://otel-collector:4317`) and makes
/// spans from now on; calls without a parent are sampled at `ratio` (0..=1). Must run inside the
/// Tokio runtime (the exporter's gRPC channel lives there). The provider must be
/// [shut down](SdkTracerProvider::shutdown) at exit so the last spans leave.
pub fn init(endpoint: &str, ratio: f64) -> Result<SdkTracerProvider, String> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .with_timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| format!("--otlp-endpoint {endpoint}: {e}"))?;
    let batch = BatchSpanProcessor::builder(exporter)
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_scheduled_delay(Duration::from_millis(500))
                .build(),
        )
        .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(batch)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            ratio.clamp(0.0, 1.0),
        ))))
        .with_resource(
            Resource::builder()
                .with_service_name("tollgate-server")
                .build(),
        )
        .build();
    global::set_tracer_provider(provider.clone());
    let _ = ON.set(());
    Ok(provider)
}

/// A call's trace context, as read from its headers or metadata.
#[derive(Debug, Clone, Copy, Default)]
pub struct Parent<'a> {
    /// `traceparent`, if the call had one.
    pub traceparent: Option<&'a str>,
    /// `tracestate`, if the call had one.
    pub tracestate: Option<&'a str>,
}

impl<'a> Parent<'a> {
    /// From HTTP headers.
    pub fn of_headers(h: &'a axum::http::HeaderMap) -> Self {
        Parent {
            traceparent: h.get(TRACEPARENT).and_then(|v| v.to_str().ok()),
            tracestate: h.get(TRACESTATE).and_then(|v| v.to_str().ok()),
        }
    }

    /// From gRPC metadata.
    pub fn of_metadata(m: &'a tonic::metadata::MetadataMap) -> Self {
        Parent {
            traceparent: m.get(TRACEPARENT).and_then(|v| v.to_str().ok()),
            tracestate: m.get(TRACESTATE).and_then(|v| v.to_str().ok()),
        }
    }
}

impl Extractor for Parent<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            TRACEPARENT => self.traceparent,
            TRACESTATE => self.tracestate,
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT, TRACESTATE]
    }
}

/// Runs `call` in a span `name` whose parent is `parent` (when traces are on; else just runs it),
/// and ends the span with the call's outcome: an error sets the span's status and
/// `tollgate.outcome` to its code; a success leaves the outcome to the call ([`note`]).
pub async fn traced<T, E: Coded>(
    name: &'static str,
    parent: Parent<'_>,
    call: impl Future<Output = Result<T, E>>,
) -> Result<T, E> {
    if !enabled() {
        return call.await;
    }
    let parent_cx = TraceContextPropagator::new().extract(&parent);
    let span = global::tracer("tollgate-server").start_with_context(name, &parent_cx);
    let cx = parent_cx.with_span(span);
    let result = call.with_context(cx.clone()).await;
    let span = cx.span();
    if let Err(e) = &result {
        span.set_attribute(KeyValue::new("tollgate.outcome", e.code()));
        span.set_status(Status::error(e.code()));
    }
    span.end();
    result
}

/// Adds attributes to the current span, if there is one (a no-op with traces off).
pub fn note(attributes: impl FnOnce() -> Vec<KeyValue>) {
    if !enabled() {
        return;
    }
    let cx = Context::current();
    let span = cx.span();
    if span.span_context().is_sampled() {
        span.set_attributes(attributes());
    }
}

/// The attributes of one decision: its outcome, its buckets and the rule names they were sent with.
pub fn decision(allowed: bool, rules: &[Option<String>]) -> Vec<KeyValue> {
    let names: Vec<&str> = rules.iter().flatten().map(String::as_str).collect();
    vec![
        KeyValue::new(
            "tollgate.outcome",
            if allowed { "allowed" } else { "limited" },
        ),
        KeyValue::new("tollgate.buckets", rules.len() as i64),
        KeyValue::new("tollgate.rules", names.join(",")),
    ]
}
