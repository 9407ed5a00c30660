//! Prometheus metrics (`GET /metrics`, text format via `prometheus-client`).
//!
//! | metric | labels | what |
//! |---|---|---|
//! | `tollgate_decisions_total` | `outcome` = allowed, limited | takes answered |
//! | `tollgate_store_duration_seconds` | | time of one store take (histogram) |
//! | `tollgate_store_errors_total` | `kind` = timeout, connection, server, protocol | failed takes |
//! | `tollgate_requests_total` | `transport` = http, grpc; `code` = ok, invalid_argument, unauthenticated, unavailable | API calls |

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Outcome {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Kind {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Call {
    transport: &'static str,
    code: &'static str,
}

/// The service's metrics and their registry.
pub struct Metrics {
    registry: Registry,
    decisions: Family<Outcome, Counter>,
    store_duration: Histogram,
    store_errors: Family<Kind, Counter>,
    requests: Family<Call, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("tollgate");
        let decisions = Family::<Outcome, Counter>::default();
        registry.register("decisions", "Takes answered, by outcome", decisions.clone());
        // 50 µs .. ~100 ms: a store round trip on a LAN is well under a millisecond.
        let store_duration = Histogram::new([
            0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
        ]);
        registry.register(
            "store_duration_seconds",
            "Duration of one store take",
            store_duration.clone(),
        );
        let store_errors = Family::<Kind, Counter>::default();
        registry.register(
            "store_errors",
            "Failed store takes, by kind",
            store_errors.clone(),
        );
        let requests = Family::<Call, Counter>::default();
        registry.register(
            "requests",
            "API calls, by transport and result code",
            requests.clone(),
        );
        Metrics {
            registry,
            decisions,
            store_duration,
            store_errors,
            requests,
        }
    }

    /// Counts a decision.
    pub fn decision(&self, allowed: bool) {
        let outcome = if allowed { "allowed" } else { "limited" };
        self.decisions.get_or_create(&Outcome { outcome }).inc();
    }

    /// Records the duration of one store take.
    pub fn store_duration(&self, seconds: f64) {
        self.store_duration.observe(seconds);
    }

    /// Counts a store failure.
    pub fn store_error(&self, kind: &'static str) {
        self.store_errors.get_or_create(&Kind { kind }).inc();
    }

    /// Counts an API call.
    pub fn request(&self, transport: &'static str, code: &'static str) {
        self.requests.get_or_create(&Call { transport, code }).inc();
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}
