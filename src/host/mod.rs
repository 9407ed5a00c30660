//! The proxy-wasm adapter: the only module that talks to the host. It reads what the core needs
//! (headers, peer address, callout replies), and implements the core's [`Host`] port (callouts,
//! resume, local replies, metrics, shared data). The per-request state machine itself is
//! [`crate::core::flow`]. Calls go through `proxy_wasm::hostcalls` (which return `Result`), never
//! through the SDK's trait helpers that unwrap.
//!
//! - `mod.rs`: root context (configuration, metrics), HTTP context, the [`Host`] implementation.
//! - `raw.rs`: host calls done by hand where the SDK would panic (header maps, gRPC status
//!   message, local replies, adding response headers).

mod raw;

use crate::core::breaker::Event;
use crate::core::config::{Config, Transport};
use crate::core::decide::{CalloutResult, Cause, Decision, LocalReply, Plan};
use crate::core::flow::{Flow, Host, Next, Phase};
use crate::core::lease;
use crate::core::rules::Request;
use crate::core::store::{CasStore, SetError};
use crate::core::wire;
use log::{debug, error, info, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType, Status};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

/// Largest callout response body read (a valid answer for 16 buckets is well under 2 KiB).
const MAX_RESPONSE_BYTES: usize = 64 * 1024;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    // Replaces the SDK's hook, which unwraps its own log call.
    std::panic::set_hook(Box::new(|info| {
        let _ = hostcalls::log(LogLevel::Critical, &format!("panic: {info}"));
    }));
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// Follows Envoy's level for the `wasm` logger, so disabled levels are not even formatted.
fn sync_log_level() {
    if let Ok(level) = hostcalls::get_log_level() {
        proxy_wasm::set_log_level(level);
    }
}

fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Proxy-wasm shared data: process-wide, shared by every worker's VM of the same `vm_id`.
/// Keys are prefixed with a digest of the plugin configuration, so two plugins with different
/// configurations in one VM never share a breaker or fallback buckets (and a new configuration
/// starts from a clean state).
struct SharedData {
    prefix: String,
}

impl SharedData {
    fn key(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }
}

impl CasStore for SharedData {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        match hostcalls::get_shared_data(&self.key(key)) {
            Ok((Some(v), cas)) => Some((v, cas.unwrap_or(0))),
            _ => None,
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        match hostcalls::set_shared_data(&self.key(key), Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(SetError::CasMismatch),
            Err(_) => Err(SetError::Other),
        }
    }
}

/// Metric ids, defined once per configuration.
struct Metrics {
    decisions: Vec<u32>,
    failures: Vec<u32>,
    breaker_opened: u32,
    breaker_open: u32,
    leases: Vec<u32>,
}

impl Metrics {
    fn define() -> Result<Metrics, Status> {
        let mut decisions = Vec::with_capacity(Decision::ALL.len());
        for d in Decision::ALL {
            decisions.push(hostcalls::define_metric(MetricType::Counter, d.metric())?);
        }
        let mut failures = Vec::with_capacity(Cause::CALLOUT.len());
        for c in Cause::CALLOUT {
            let name = format!("tollgate.callout_failure.{}", c.name());
            failures.push(hostcalls::define_metric(MetricType::Counter, &name)?);
        }
        let mut leases = Vec::with_capacity(lease::Count::ALL.len());
        for c in lease::Count::ALL {
            leases.push(hostcalls::define_metric(MetricType::Counter, c.metric())?);
        }
        Ok(Metrics {
            decisions,
            failures,
            leases,
            breaker_opened: hostcalls::define_metric(
                MetricType::Counter,
                "tollgate.breaker.opened",
            )?,
            breaker_open: hostcalls::define_metric(MetricType::Gauge, "tollgate.breaker.open")?,
        })
    }

    fn decision(&self, d: Decision) {
        let idx = Decision::ALL.iter().position(|x| *x == d);
        if let Some(&id) = idx.and_then(|i| self.decisions.get(i)) {
            let _ = hostcalls::increment_metric(id, 1);
        }
    }

    fn failure(&self, c: Cause) {
        let idx = Cause::CALLOUT.iter().position(|x| *x == c);
        if let Some(&id) = idx.and_then(|i| self.failures.get(i)) {
            let _ = hostcalls::increment_metric(id, 1);
        }
    }

    fn lease(&self, c: lease::Count, n: u64) {
        let idx = lease::Count::ALL.iter().position(|x| *x == c);
        if let Some(&id) = idx.and_then(|i| self.leases.get(i)) {
            let _ = hostcalls::increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    fn breaker(&self, e: Event) {
        match e {
            Event::Opened => {
                let _ = hostcalls::increment_metric(self.breaker_opened, 1);
                let _ = hostcalls::record_metric(self.breaker_open, 1);
                warn!("circuit breaker opened: the decision service is failing, using the failure mode");
            }
            Event::Reopened => debug!("breaker probe failed, staying open"),
            Event::Closed => {
                let _ = hostcalls::record_metric(self.breaker_open, 0);
                info!("circuit breaker closed: the decision service answers again");
            }
            Event::None => {}
        }
    }
}

#[derive(Default)]
struct Root {
    config: Option<Arc<Config>>,
    metrics: Option<Rc<Metrics>>,
    shared: Option<Rc<SharedData>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_vm_start(&mut self, _vm_configuration_size: usize) -> bool {
        sync_log_level();
        info!(
            "tollgate {} (git {}) starting",
            env!("CARGO_PKG_VERSION"),
            env!("TOLLGATE_GIT_HASH")
        );
        true
    }

    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        sync_log_level();
        let bytes = match hostcalls::get_buffer(
            BufferType::PluginConfiguration,
            0,
            plugin_configuration_size,
        ) {
            Ok(Some(b)) if !b.is_empty() => b,
            _ => {
                error!("invalid configuration: config: missing (put the JSON in a google.protobuf.StringValue)");
                return false;
            }
        };
        let config = match Config::parse(&bytes) {
            Ok(c) => c,
            Err(e) => {
                error!("invalid configuration: {e}");
                return false;
            }
        };
        let metrics = match Metrics::define() {
            Ok(m) => m,
            Err(e) => {
                error!("could not define metrics: {e:?}");
                return false;
            }
        };
        if config.failure_mode == crate::core::config::FailureMode::Fallback {
            for r in &config.rules {
                if r.capacity < config.fallback.instances {
                    warn!(
                        "rule {}: capacity {} < fallback.instances {}: its fallback bucket admits nothing",
                        r.name, r.capacity, config.fallback.instances
                    );
                }
            }
        }
        info!(
            "configured {} rule(s), service cluster {:?} over {}, failure_mode {:?}{}",
            config.rules.len(),
            config.service.cluster,
            match config.service.transport {
                Transport::Http => "http",
                Transport::Grpc => "grpc",
            },
            config.failure_mode,
            if config.shadow { ", shadow mode" } else { "" }
        );
        let digest = crate::core::hash::sha256_hex(&bytes);
        self.shared = Some(Rc::new(SharedData {
            prefix: format!("{}/", digest.get(..12).unwrap_or(&digest)),
        }));
        self.config = Some(Arc::new(config));
        self.metrics = Some(Rc::new(metrics));
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Never `None`: the SDK would panic. Without a configuration (which Envoy does not allow
        // to happen) the filter passes everything through.
        Some(Box::new(Filter {
            state: match (&self.config, &self.metrics, &self.shared) {
                (Some(c), Some(m), Some(s)) => Some((c.clone(), m.clone(), s.clone())),
                _ => None,
            },
            flow: Flow::default(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// The proxy side of [`Host`]: metrics, shared data, callouts, replies.
struct Proxy<'a> {
    metrics: &'a Metrics,
    shared: &'a SharedData,
}

impl Host for Proxy<'_> {
    type Store = SharedData;

    fn store(&self) -> &SharedData {
        self.shared
    }

    fn now_ms(&self) -> u64 {
        now_ms()
    }

    fn dispatch(&mut self, cfg: &Config, plan: &Plan) -> Result<u32, String> {
        let svc = &cfg.service;
        let timeout = Duration::from_millis(svc.timeout_ms);
        let bearer = svc.token.as_ref().map(|t| format!("Bearer {t}"));
        let sent = match svc.transport {
            Transport::Http => {
                let body = wire::encode_json(&plan.request);
                let mut headers = vec![
                    (":method", "POST"),
                    (":path", svc.path.as_str()),
                    (":authority", svc.authority.as_str()),
                    ("content-type", "application/json"),
                ];
                if let Some(b) = &bearer {
                    headers.push(("authorization", b.as_str()));
                }
                hostcalls::dispatch_http_call(&svc.cluster, headers, Some(&body), vec![], timeout)
            }
            Transport::Grpc => {
                let body = wire::encode_proto(&plan.request);
                let mut metadata: Vec<(&str, &[u8])> = Vec::new();
                if let Some(b) = &bearer {
                    metadata.push(("authorization", b.as_bytes()));
                }
                hostcalls::dispatch_grpc_call(
                    &svc.cluster,
                    "tollgate.v1.RateLimiter",
                    "Take",
                    metadata,
                    Some(&body),
                    timeout,
                )
            }
        };
        sent.map_err(|status| {
            warn!(
                "callout to cluster {:?} failed to dispatch: {status:?}",
                svc.cluster
            );
            format!("{status:?}")
        })
    }

    fn resume(&mut self) {
        if let Err(e) = hostcalls::resume_http_request() {
            warn!("could not resume the request: {e:?}");
        }
    }

    fn reply(&mut self, reply: &LocalReply) {
        if let Err(status) =
            raw::send_local_response(reply.status, &reply.headers, reply.body.as_bytes())
        {
            warn!("could not send the denial: host status {status}");
        }
    }

    fn count(&mut self, decision: Decision) {
        self.metrics.decision(decision);
    }

    fn count_failure(&mut self, cause: Cause) {
        self.metrics.failure(cause);
    }

    fn breaker_event(&mut self, event: Event) {
        self.metrics.breaker(event);
    }

    fn count_lease(&mut self, count: lease::Count, n: u64) {
        self.metrics.lease(count, n);
    }
}

/// One request: the core's [`Flow`] plus what it needs.
struct Filter {
    /// Configuration, metrics and shared store; `None` only if the root was never configured.
    state: Option<(Arc<Config>, Rc<Metrics>, Rc<SharedData>)>,
    flow: Flow,
}

impl Filter {
    fn read_request(cfg: &Config) -> Request {
        let headers = raw::get_map(raw::REQUEST_HEADERS).unwrap_or_default();
        let peer = if cfg.needs_peer_address {
            match hostcalls::get_property(vec!["source", "address"]) {
                Ok(Some(b)) => String::from_utf8(b).ok(),
                _ => None,
            }
        } else {
            None
        };
        Request { headers, peer }
    }

    /// Hands a callout result to the flow, if this request waits for `token`. `read` runs only
    /// then, so a stray callback costs no host calls.
    fn finish(&mut self, token: u32, read: impl FnOnce() -> CalloutResult) {
        if !self.flow.waits_for(token) {
            return;
        }
        let Some((cfg, metrics, shared)) = self.state.clone() else {
            return;
        };
        let result = read();
        let mut proxy = Proxy {
            metrics: &metrics,
            shared: &shared,
        };
        self.flow.on_callout_result(&cfg, token, result, &mut proxy);
    }
}

fn action(next: Next) -> Action {
    match next {
        Next::Continue => Action::Continue,
        Next::Pause => Action::Pause,
    }
}

impl Context for Filter {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        self.finish(token_id, || {
            if num_headers == 0 {
                // Envoy reports a reset (and some other failures) as a response without headers.
                return CalloutResult::Http {
                    status: None,
                    body: Vec::new(),
                };
            }
            let status =
                hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status")
                    .ok()
                    .flatten()
                    .and_then(|s| {
                        std::str::from_utf8(&s)
                            .ok()
                            .and_then(|s| s.parse::<u32>().ok())
                    });
            let body = if body_size > MAX_RESPONSE_BYTES {
                b"(response too large)".to_vec()
            } else {
                hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
                    .ok()
                    .flatten()
                    .unwrap_or_default()
            };
            CalloutResult::Http { status, body }
        });
    }

    fn on_grpc_call_response(&mut self, token_id: u32, status_code: u32, response_size: usize) {
        self.finish(token_id, || {
            if status_code != 0 {
                return CalloutResult::Grpc {
                    status: status_code,
                    message: raw::grpc_status_message(),
                    body: Vec::new(),
                };
            }
            let body = if response_size > MAX_RESPONSE_BYTES {
                // Not a valid message (a truncated varint): decoded as a failure.
                vec![0xff]
            } else {
                hostcalls::get_buffer(BufferType::GrpcReceiveBuffer, 0, response_size)
                    .ok()
                    .flatten()
                    .unwrap_or_default()
            };
            CalloutResult::Grpc {
                status: 0,
                message: None,
                body,
            }
        });
    }
}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some((cfg, metrics, shared)) = self.state.clone() else {
            return Action::Continue;
        };
        if self.flow.phase != Phase::Idle {
            return Action::Continue;
        }
        let req = Self::read_request(&cfg);
        let mut proxy = Proxy {
            metrics: &metrics,
            shared: &shared,
        };
        action(self.flow.on_request_headers(&cfg, &req, &mut proxy))
    }

    fn on_http_request_body(&mut self, _body_size: usize, _end_of_stream: bool) -> Action {
        action(self.flow.on_request_data())
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        action(self.flow.on_request_data())
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        for (k, v) in std::mem::take(&mut self.flow.response_headers) {
            if let Err(status) = raw::add_header(raw::RESPONSE_HEADERS, &k, &v) {
                debug!("could not add {k} to the response: host status {status}");
            }
        }
        Action::Continue
    }
}
