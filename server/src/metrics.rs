//! Prometheus metrics (`GET /metrics`, text format via `prometheus-client`).
//!
//! | metric | labels | what |
//! |---|---|---|
//! | `tollgate_decisions_total` | `outcome` = allowed, limited | takes answered |
//! | `tollgate_rule_decisions_total` | `rule` = a rule name the filter sent (at most [`MAX_RULE_LABELS`] distinct, the rest `other`); `outcome` = allowed, limited | per rule named in a take (each rule once per take): `allowed` when the take was, `limited` when that rule's own bucket denied it |
//! | `tollgate_shaped_total` | | takes granted with a delay (shaping: `delay_ms` > 0), counted in `tollgate_decisions_total{outcome="allowed"}` too |
//! | `tollgate_shaped_delay_seconds` | | the delay of each shaped grant: how long its caller holds the request (histogram) |
//! | `tollgate_slots_total` | `outcome` = acquired, limited, released, already_free | concurrency slots (`ops/acquire.rs`, `ops/release.rs`): acquires that took their slots or were denied, releases that found their slot or found it gone (expired at its deadline, or released before) |
//! | `tollgate_settlements_total` | `outcome` = applied, duplicate | settles (`/v1/settle`, `Settle`): applied, or found already applied (a resent id) |
//! | `tollgate_live_instances` | | proxy instances of the deployment heard from within the instance TTL (`--instance-ttl-ms`, 90 s by default), as last counted (gauge) |
//! | `tollgate_store_duration_seconds` | | time of one store call: a take, or a whole batch (histogram) |
//! | `tollgate_batch_takes` | | takes per batch (`/v1/take_batch`, `TakeBatch`; histogram: its count is the number of batches) |
//! | `tollgate_store_errors_total` | `kind` = timeout, connection, server, protocol | failed takes |
//! | `tollgate_requests_total` | `transport` = http, grpc; `code` = ok, invalid_argument, unauthenticated, resource_exhausted, deadline_exceeded, unavailable | API calls |
//! | `tollgate_shed_total` | | takes answered 503 / `UNAVAILABLE` at once because `--max-in-flight` takes were being decided |
//! | `tollgate_connections_open` | | connections being served (gauge) |
//! | `tollgate_streams_open` | | `TakeStream` streams open (gauge; each of their messages is counted as a `TakeBatch` call in the metrics above) |
//! | `tollgate_stream_buffered_bytes` | | bytes the `TakeStream` streams hold of messages not yet whole, against `--stream-buffer-bytes` (gauge) |
//! | `tollgate_stream_refusals_total` | `reason` = in_flight, buffer, deadline | `TakeStream` refusals at a stream's bounds (`ops/stream.rs`; each also counted as the `TakeBatch` call it stands for): `in_flight`, a message answered `UNAVAILABLE` because `--stream-max-in-flight` messages of its stream were being decided; `buffer`, a stream ended `UNAVAILABLE` because the message it was sending would have taken the bytes the streams hold past `--stream-buffer-bytes`; `deadline`, a stream ended `DEADLINE_EXCEEDED` because a message was not whole within `--body-timeout-ms` of its first byte |
//! | `tollgate_connections_refused_total` | | connections closed on accept because `--max-connections` were open |
//! | `tollgate_rls_config_reloads_total` | `outcome` = ok, refused | changes of the `--rls-config` limits file, loaded or refused |
//! | `tollgate_rls_config_ok` | | 1 while the limits file on disk is the one in force, 0 after it was refused (gauge) |
//! | `tollgate_rls_hits_total` | `domain`; `key` = the limit's place in the limits file (`key_value.key`; the request's values with `detailed_metric`, and at the `value_to_metric` levels, as envoyproxy/ratelimit's stat names: `rls::config::Found::stat`; at most [`MAX_RLS_STAT_KEYS`] distinct, the rest `other`); `stat` = total_hits, within_limit, near_limit, over_limit, shadow_mode | hits (the descriptor's cost) of RLS descriptors that matched a limit, as envoyproxy/ratelimit's per-descriptor statistics: `near_limit` when at least 80 % of the limit is used after them, `shadow_mode` for shadow-mode limits over their limit (counted in `over_limit` too) |
//! | `tollgate_rls_stat_keys_overflow_total` | | RLS descriptors counted under `key="other"` because [`MAX_RLS_STAT_KEYS`] keys were in use |

use std::sync::OnceLock;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Outcome {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RuleOutcome {
    rule: String,
    outcome: &'static str,
}

/// Most distinct `rule` label values; the rules seen after them count as `other`. Rule names come
/// from the filter's configuration, never from request keys, so a fleet rarely has this many.
pub const MAX_RULE_LABELS: usize = 64;

/// The `rule` label's value for decisions of rules beyond [`MAX_RULE_LABELS`].
pub const OTHER_RULE: &str = "other";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RlsStat {
    domain: String,
    key: String,
    stat: &'static str,
}

/// Most distinct `(domain, key)` pairs of `tollgate_rls_hits_total`; the descriptors seen after
/// them count under `key="other"`. Keys come from the limits file unless a limit asks for its
/// request values (`detailed_metric`, `value_to_metric`), which clients choose.
pub const MAX_RLS_STAT_KEYS: usize = 1000;

/// What an RLS descriptor's hits count as (`stat` of `tollgate_rls_hits_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RlsHits {
    /// The descriptor's cost.
    pub hits: u64,
    /// It was over its limit.
    pub over: bool,
    /// At least 80 % of the limit is used after it.
    pub near: bool,
    /// Its limit is in shadow mode.
    pub shadow: bool,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Kind {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Call {
    transport: &'static str,
    code: &'static str,
}

/// The service's metrics and their registry.
///
/// The label sets every successful take counts (`allowed`, `limited`, `http`/`grpc` + `ok`) are
/// resolved once, on first use, and kept: `Family::get_or_create` hashes the labels and takes the
/// family's lock on every call. A series still appears in the exposition only once counted.
pub struct Metrics {
    registry: Registry,
    decisions: Family<Outcome, Counter>,
    shaped: Counter,
    shaped_delay: Histogram,
    store_duration: Histogram,
    batch_takes: Histogram,
    store_errors: Family<Kind, Counter>,
    requests: Family<Call, Counter>,
    shed: Counter,
    connections_open: Gauge,
    streams_open: Gauge,
    stream_refusals: Family<Reason, Counter>,
    stream_buffered: Gauge,
    connections_refused: Counter,
    rls_reloads: Family<Outcome, Counter>,
    rls_config_ok: Gauge,
    rule_decisions: Family<RuleOutcome, Counter>,
    /// The (allowed, limited) counters of every rule label in use, so a take looks its rules up
    /// in one map instead of hashing label sets in the family.
    rule_counters: std::sync::Mutex<std::collections::HashMap<String, [Counter; 2]>>,
    live_instances: Gauge,
    slots: Family<Outcome, Counter>,
    settlements: Family<Outcome, Counter>,
    rls_hits: Family<RlsStat, Counter>,
    /// The five counters (total_hits, within_limit, near_limit, over_limit, shadow_mode) of every
    /// `(domain, key)` in use, so a descriptor is counted with one map lookup.
    rls_stat_keys: std::sync::Mutex<std::collections::HashMap<(String, String), [Counter; 5]>>,
    rls_stat_overflow: Counter,
    allowed: OnceLock<Counter>,
    limited: OnceLock<Counter>,
    http_ok: OnceLock<Counter>,
    grpc_ok: OnceLock<Counter>,
}

/// The counter of `labels` in `family`, looked up the first time only.
fn cached<'a, L>(cell: &'a OnceLock<Counter>, family: &Family<L, Counter>, labels: L) -> &'a Counter
where
    L: Clone + std::hash::Hash + Eq,
{
    cell.get_or_init(|| family.get_or_create_owned(&labels))
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
        let shaped = Counter::default();
        registry.register(
            "shaped",
            "Takes granted with a delay (shaping)",
            shaped.clone(),
        );
        // 1 ms .. 60 s: contract::bounds::MAX_DELAY_MS is one minute.
        let shaped_delay = Histogram::new([
            0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        ]);
        registry.register(
            "shaped_delay_seconds",
            "Delay of each shaped grant: how long its caller holds the request",
            shaped_delay.clone(),
        );
        // 50 µs .. ~100 ms: a store round trip on a LAN is well under a millisecond.
        let store_duration = Histogram::new([
            0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
        ]);
        registry.register(
            "store_duration_seconds",
            "Duration of one store take",
            store_duration.clone(),
        );
        let batch_takes = Histogram::new([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]);
        registry.register(
            "batch_takes",
            "Takes per batch (the count is the number of batches)",
            batch_takes.clone(),
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
        let shed = Counter::default();
        registry.register(
            "shed",
            "Takes answered UNAVAILABLE at once because the take limit was reached",
            shed.clone(),
        );
        let connections_open = Gauge::default();
        registry.register(
            "connections_open",
            "Connections being served",
            connections_open.clone(),
        );
        let streams_open = Gauge::default();
        registry.register(
            "streams_open",
            "TakeStream streams open",
            streams_open.clone(),
        );
        let stream_refusals = Family::<Reason, Counter>::default();
        registry.register(
            "stream_refusals",
            "TakeStream refusals at a stream's bounds: messages in flight, bytes held, a message's deadline",
            stream_refusals.clone(),
        );
        let stream_buffered = Gauge::default();
        registry.register(
            "stream_buffered_bytes",
            "Bytes the TakeStream streams hold of messages not yet whole",
            stream_buffered.clone(),
        );
        let connections_refused = Counter::default();
        registry.register(
            "connections_refused",
            "Connections closed on accept because the connection limit was reached",
            connections_refused.clone(),
        );
        let rls_reloads = Family::<Outcome, Counter>::default();
        registry.register(
            "rls_config_reloads",
            "Changes of the RLS limits file, loaded (ok) or refused",
            rls_reloads.clone(),
        );
        let rls_config_ok = Gauge::default();
        rls_config_ok.set(1);
        registry.register(
            "rls_config_ok",
            "1 while the RLS limits file on disk is the one in force, 0 after it was refused",
            rls_config_ok.clone(),
        );
        let rule_decisions = Family::<RuleOutcome, Counter>::default();
        registry.register(
            "rule_decisions",
            "Takes answered per rule named in them (allowed, or limited by that rule's bucket)",
            rule_decisions.clone(),
        );
        let live_instances = Gauge::default();
        registry.register(
            "live_instances",
            "Proxy instances of the deployment heard from lately, as last counted",
            live_instances.clone(),
        );
        let slots = Family::<Outcome, Counter>::default();
        registry.register(
            "slots",
            "Concurrency slots: acquires taken or denied, releases that found their slot or not",
            slots.clone(),
        );
        let settlements = Family::<Outcome, Counter>::default();
        registry.register(
            "settlements",
            "Settles of reserved tokens: applied, or already applied before (a resent id)",
            settlements.clone(),
        );
        let rls_hits = Family::<RlsStat, Counter>::default();
        registry.register(
            "rls_hits",
            "Hits of RLS descriptors that matched a limit, per domain, descriptor key and stat",
            rls_hits.clone(),
        );
        let rls_stat_overflow = Counter::default();
        registry.register(
            "rls_stat_keys_overflow",
            "RLS descriptors counted under key=\"other\": the distinct keys were at their bound",
            rls_stat_overflow.clone(),
        );
        Metrics {
            registry,
            slots,
            settlements,
            rls_hits,
            rls_stat_keys: std::sync::Mutex::new(std::collections::HashMap::new()),
            rls_stat_overflow,
            rule_decisions,
            rule_counters: std::sync::Mutex::new(std::collections::HashMap::new()),
            live_instances,
            decisions,
            shaped,
            shaped_delay,
            store_duration,
            batch_takes,
            store_errors,
            requests,
            shed,
            connections_open,
            streams_open,
            stream_refusals,
            stream_buffered,
            connections_refused,
            rls_reloads,
            rls_config_ok,
            allowed: OnceLock::new(),
            limited: OnceLock::new(),
            http_ok: OnceLock::new(),
            grpc_ok: OnceLock::new(),
        }
    }

    /// Counts a decision; a grant with a delay (shaping) also counts as shaped, its delay observed.
    pub fn decision(&self, allowed: bool, delay_ms: u64) {
        let (cell, outcome) = if allowed {
            (&self.allowed, "allowed")
        } else {
            (&self.limited, "limited")
        };
        cached(cell, &self.decisions, Outcome { outcome }).inc();
        if allowed && delay_ms > 0 {
            self.shaped.inc();
            self.shaped_delay.observe(delay_ms as f64 / 1000.0);
        }
    }

    /// Counts a take once per distinct rule among `rules` (each bucket's rule name and whether
    /// that bucket alone could pay): `allowed` when the take was allowed, `limited` for the rules
    /// whose own bucket denied it. Unnamed buckets are not counted here.
    pub fn rule_decisions<'a>(
        &self,
        take_allowed: bool,
        rules: impl Iterator<Item = (Option<&'a str>, bool)>,
    ) {
        // The rules counted so far: the first without an allocation (a take usually names one).
        let (mut first, mut more): (Option<&str>, Vec<&str>) = (None, Vec::new());
        let mut map = match self.rule_counters.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        for (rule, bucket_allowed) in rules {
            let Some(rule) = rule else { continue };
            if (!take_allowed && bucket_allowed) || first == Some(rule) || more.contains(&rule) {
                continue;
            }
            if first.is_none() {
                first = Some(rule);
            } else {
                more.push(rule);
            }
            let counters = match map.get(rule) {
                Some(c) => c,
                None => {
                    let label = if map.len() < MAX_RULE_LABELS {
                        rule
                    } else {
                        OTHER_RULE
                    };
                    let c = |outcome| {
                        self.rule_decisions.get_or_create_owned(&RuleOutcome {
                            rule: label.to_string(),
                            outcome,
                        })
                    };
                    map.entry(label.to_string())
                        .or_insert_with(|| [c("allowed"), c("limited")])
                }
            };
            let [a, l] = counters;
            if take_allowed { a } else { l }.inc();
        }
    }

    /// Sets the live-instance count last learned.
    pub fn live_instances(&self, n: u64) {
        self.live_instances
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Records the duration of one store take.
    pub fn store_duration(&self, seconds: f64) {
        self.store_duration.observe(seconds);
    }

    /// Counts a batch of `takes` takes (valid, about to be decided).
    pub fn batch(&self, takes: usize) {
        self.batch_takes.observe(takes as f64);
    }

    /// Counts a store failure.
    pub fn store_error(&self, kind: &'static str) {
        self.store_errors.get_or_create(&Kind { kind }).inc();
    }

    /// Counts an API call.
    pub fn request(&self, transport: &'static str, code: &'static str) {
        let cell = match (transport, code) {
            ("http", "ok") => &self.http_ok,
            ("grpc", "ok") => &self.grpc_ok,
            _ => {
                self.requests.get_or_create(&Call { transport, code }).inc();
                return;
            }
        };
        cached(cell, &self.requests, Call { transport, code }).inc();
    }

    /// Counts a take shed at the take limit.
    pub fn shed(&self) {
        self.shed.inc();
    }

    /// A connection was accepted (`true`) or has ended (`false`).
    pub fn connection(&self, opened: bool) {
        if opened {
            self.connections_open.inc();
        } else {
            self.connections_open.dec();
        }
    }

    /// A `TakeStream` stream was opened (`true`) or has ended (`false`).
    pub fn stream(&self, opened: bool) {
        if opened {
            self.streams_open.inc();
        } else {
            self.streams_open.dec();
        }
    }

    /// Counts a refusal at a stream's bounds: `in_flight`, `buffer` or `deadline`.
    pub fn stream_refused(&self, reason: &'static str) {
        self.stream_refusals.get_or_create(&Reason { reason }).inc();
    }

    /// The bytes the streams hold of messages not yet whole grew (or, negative, shrank) by `n`.
    pub fn stream_buffered(&self, n: i64) {
        self.stream_buffered.inc_by(n);
    }

    /// Counts a connection refused at the connection limit.
    pub fn connection_refused(&self) {
        self.connections_refused.inc();
    }

    /// Counts `n` concurrency-slot events of `outcome` (`acquired`, `limited`, `released`,
    /// `already_free`).
    pub fn slots(&self, outcome: &'static str, n: u64) {
        self.slots.get_or_create(&Outcome { outcome }).inc_by(n);
    }

    /// Counts a settle: `applied`, or `duplicate` (its id was applied before).
    pub fn settlements(&self, outcome: &'static str) {
        self.settlements.get_or_create(&Outcome { outcome }).inc();
    }

    /// Counts a change of the RLS limits file: loaded, or refused (the old limits stay).
    pub fn rls_reload(&self, loaded: bool) {
        let outcome = if loaded { "ok" } else { "refused" };
        self.rls_reloads.get_or_create(&Outcome { outcome }).inc();
        self.rls_config_ok.set(i64::from(loaded));
    }

    /// Counts one RLS descriptor that matched a limit under `(domain, key)` (at most
    /// [`MAX_RLS_STAT_KEYS`] pairs; later ones under `key="other"`, counted in the overflow).
    pub fn rls_hits(&self, domain: &str, key: &str, h: RlsHits) {
        const STATS: [&str; 5] = [
            "total_hits",
            "within_limit",
            "near_limit",
            "over_limit",
            "shadow_mode",
        ];
        let mut keys = match self.rls_stat_keys.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let mut pair = (domain.to_string(), key.to_string());
        if !keys.contains_key(&pair) && keys.len() >= MAX_RLS_STAT_KEYS {
            self.rls_stat_overflow.inc();
            pair.1 = "other".to_string();
        }
        let counters = keys.entry(pair).or_insert_with_key(|(domain, key)| {
            STATS.map(|stat| {
                self.rls_hits.get_or_create_owned(&RlsStat {
                    domain: domain.clone(),
                    key: key.clone(),
                    stat,
                })
            })
        });
        let [total, within, near, over, shadow] = counters;
        total.inc_by(h.hits);
        if h.over {
            over.inc_by(h.hits);
            if h.shadow {
                shadow.inc_by(h.hits);
            }
        } else {
            within.inc_by(h.hits);
            if h.near {
                near.inc_by(h.hits);
            }
        }
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
