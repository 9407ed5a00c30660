//! The proxy-wasm adapter: the only module that talks to the host. It reads what the core needs,
//! performs what the core decided, and keeps the per-request state machine:
//!
//! `Idle → (no rule) Done`, `Idle → (dispatched) Calling{token} → Done`, `Idle → (reply) Done`.
//!
//! The stream is paused only after a dispatch succeeded, and resumed only from `Calling`; every
//! other path answers synchronously. Calls go through `proxy_wasm::hostcalls` (which return
//! `Result`), never through the SDK's trait helpers that unwrap.

mod raw;

use crate::core::breaker::{self, Admission, Event};
use crate::core::config::{Config, Transport};
use crate::core::decide::{
    self, Action as Act, CalloutResult, Cause, Decision, Outcome, Plan, Step,
};
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

/// Proxy-wasm shared data: process-wide, shared by every worker's VM.
struct SharedData;

impl CasStore for SharedData {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(v), cas)) => Some((v, cas.unwrap_or(0))),
            _ => None,
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
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
        Ok(Metrics {
            decisions,
            failures,
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
        self.config = Some(Arc::new(config));
        self.metrics = Some(Rc::new(metrics));
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Never `None`: the SDK would panic. Without a configuration (which Envoy does not allow
        // to happen) the filter passes everything through.
        Some(Box::new(Filter {
            config: self.config.clone(),
            metrics: self.metrics.clone(),
            phase: Phase::Idle,
            response_headers: Vec::new(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Where a request is in its life.
enum Phase {
    /// Headers not seen yet.
    Idle,
    /// Paused, waiting for callout `token`.
    Calling { token: u32, plan: Plan, probe: bool },
    /// Decided (and resumed, if it was paused).
    Done,
}

struct Filter {
    config: Option<Arc<Config>>,
    metrics: Option<Rc<Metrics>>,
    phase: Phase,
    /// Rate limit headers for the upstream's response (`response.on_allowed`).
    response_headers: Vec<(String, String)>,
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

    fn dispatch(cfg: &Config, plan: &Plan) -> Result<u32, Status> {
        let svc = &cfg.service;
        let timeout = Duration::from_millis(svc.timeout_ms);
        let bearer = svc.token.as_ref().map(|t| format!("Bearer {t}"));
        match svc.transport {
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
        }
    }

    /// A callout is needed: ask the breaker, dispatch, pause only if the dispatch succeeded.
    fn start(&mut self, cfg: &Config, metrics: &Metrics, plan: Plan) -> Action {
        let admission = breaker::admit_shared(&SharedData, &cfg.breaker, now_ms());
        if admission == Admission::Reject {
            return self.conclude(cfg, metrics, &plan, &Outcome::Failed(Cause::Breaker), false);
        }
        let probe = admission == Admission::Probe;
        match Self::dispatch(cfg, &plan) {
            Ok(token) => {
                self.phase = Phase::Calling { token, plan, probe };
                Action::Pause
            }
            Err(status) => {
                warn!(
                    "callout to cluster {:?} failed to dispatch: {status:?}",
                    cfg.service.cluster
                );
                self.after_callout(
                    cfg,
                    metrics,
                    &plan,
                    probe,
                    Outcome::Failed(Cause::Dispatch),
                    false,
                )
            }
        }
    }

    /// A callout ended (or failed to start): count, update the breaker, conclude.
    fn after_callout(
        &mut self,
        cfg: &Config,
        metrics: &Metrics,
        plan: &Plan,
        probe: bool,
        outcome: Outcome,
        paused: bool,
    ) -> Action {
        let success = !matches!(outcome, Outcome::Failed(_));
        if let Outcome::Failed(cause) = outcome {
            metrics.failure(cause);
        }
        let event = breaker::record_shared(&SharedData, &cfg.breaker, now_ms(), success, probe);
        metrics.breaker(event);
        self.conclude(cfg, metrics, plan, &outcome, paused)
    }

    /// Applies the verdict: let through (resuming if paused) or answer locally.
    fn conclude(
        &mut self,
        cfg: &Config,
        metrics: &Metrics,
        plan: &Plan,
        outcome: &Outcome,
        paused: bool,
    ) -> Action {
        let verdict = decide::resolve(cfg, plan, outcome, &SharedData, now_ms());
        metrics.decision(verdict.decision);
        if let Outcome::Failed(cause) = outcome {
            debug!(
                "no answer from the service ({}): {}",
                cause.name(),
                verdict.decision.metric()
            );
        }
        if !verdict.denied_by.is_empty() && log::log_enabled!(log::Level::Debug) {
            for i in &verdict.denied_by {
                let rule = plan
                    .rules
                    .get(*i)
                    .and_then(|r| cfg.rules.get(*r))
                    .map_or("?", |r| r.name.as_str());
                let key = plan.request.buckets.get(*i).map_or("?", |b| b.key.as_str());
                debug!("{} rule={rule} key={key}", verdict.decision.metric());
            }
        }
        self.phase = Phase::Done;
        match verdict.action {
            Act::Allow(headers) => {
                self.response_headers = headers;
                if paused {
                    if let Err(e) = hostcalls::resume_http_request() {
                        warn!("could not resume the request: {e:?}");
                    }
                }
                Action::Continue
            }
            Act::Deny(reply) => {
                let headers: Vec<(&str, &str)> = reply
                    .headers
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect();
                if let Err(e) = hostcalls::send_http_response(
                    reply.status,
                    headers,
                    Some(reply.body.as_bytes()),
                ) {
                    warn!("could not send the denial: {e:?}");
                }
                Action::Pause
            }
        }
    }

    /// The plan and probe flag of the callout `token`, if it is ours and pending.
    fn take_pending(&mut self, token: u32) -> Option<(Plan, bool)> {
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Calling {
                token: t,
                plan,
                probe,
            } if t == token => Some((plan, probe)),
            other => {
                self.phase = other;
                None
            }
        }
    }

    fn finish(&mut self, token: u32, result: impl FnOnce() -> CalloutResult) {
        let (Some(cfg), Some(metrics)) = (self.config.clone(), self.metrics.clone()) else {
            return;
        };
        let Some((plan, probe)) = self.take_pending(token) else {
            return;
        };
        let outcome = decide::interpret(&plan, result());
        self.after_callout(&cfg, &metrics, &plan, probe, outcome, true);
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
        if !matches!(self.phase, Phase::Idle) {
            return Action::Continue;
        }
        let (Some(cfg), Some(metrics)) = (self.config.clone(), self.metrics.clone()) else {
            self.phase = Phase::Done;
            return Action::Continue;
        };
        let req = Self::read_request(&cfg);
        match decide::decide(&cfg, &req) {
            Step::Continue => {
                self.phase = Phase::Done;
                Action::Continue
            }
            Step::Callout(plan) => self.start(&cfg, &metrics, plan),
        }
    }

    // While the callout is in flight, body and trailers must wait too: returning Continue here
    // would let Envoy forward the request before the decision.
    fn on_http_request_body(&mut self, _body_size: usize, _end_of_stream: bool) -> Action {
        if matches!(self.phase, Phase::Calling { .. }) {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if matches!(self.phase, Phase::Calling { .. }) {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        for (k, v) in std::mem::take(&mut self.response_headers) {
            let _ = hostcalls::add_map_value(MapType::HttpResponseHeaders, &k, &v);
        }
        Action::Continue
    }
}
