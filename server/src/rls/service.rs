//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` over the service's store.
//!
//! A request's descriptors are resolved against the limits file (or the `limit` Envoy sent with a
//! descriptor), then every limit that is enforced is charged in **one** take: all or nothing, in
//! one atomic script. envoyproxy/ratelimit increments each descriptor's counter on its own, so a
//! request denied by one descriptor still spends the others; here a denied request spends nothing.
//! Shadow-mode limits are charged in a second take and always answer `OK`.

use std::fmt::Write;
use std::sync::Arc;

use prost_types::Duration as PbDuration;
use sha2::{Digest, Sha256};
use tonic::{Request, Response, Status};

use super::config::{Limit, Limits, Unit};
use super::pb::envoy::config::core::v3::HeaderValue;
use super::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use super::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use super::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use super::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use super::reload::LimitsFile;
use crate::api::grpc::status_of;
use crate::api::Api;
use crate::domain::{BucketDecision, RawBucket, RawTake, MAX_AMOUNT, MAX_BUCKETS, MAX_KEY_BYTES};

/// The RLS v3 service.
pub struct RlsService {
    api: Arc<Api>,
    limits: Arc<LimitsFile>,
}

impl RlsService {
    /// Serves `limits` over `api`'s store and metrics.
    pub fn new(api: Arc<Api>, limits: Arc<LimitsFile>) -> Self {
        RlsService { api, limits }
    }
}

/// One descriptor of a request, resolved.
#[derive(Debug, Clone)]
enum Plan {
    /// No limit applies (no match, unlimited, replaced, or nothing to charge): `OK`.
    Free {
        /// `unlimited: true`: `limit_remaining` is `u32::MAX`, as envoyproxy/ratelimit says.
        unlimited: bool,
    },
    /// Charged `cost` to the bucket `key` under `limit`.
    Charge {
        limit: Arc<Limit>,
        key: String,
        cost: u64,
    },
}

/// The Tollgate bucket key of a descriptor: the domain and every entry, escaped so that no two
/// descriptors share one; the limit itself is part of the store's key. Nothing else goes in, so
/// a reload that leaves a limit alone leaves its count alone.
pub fn bucket_key(domain: &str, entries: &[(String, String)]) -> String {
    let mut key = String::from("rls|");
    push_escaped(&mut key, domain);
    for (k, v) in entries {
        key.push('|');
        push_escaped(&mut key, k);
        key.push('=');
        push_escaped(&mut key, v);
    }
    if key.len() > MAX_KEY_BYTES {
        let mut hashed = String::from("rls#");
        for b in Sha256::digest(key.as_bytes()) {
            let _ = write!(hashed, "{b:02x}");
        }
        return hashed;
    }
    key
}

fn push_escaped(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '%' => out.push_str("%25"),
            '|' => out.push_str("%7C"),
            '=' => out.push_str("%3D"),
            c => out.push(c),
        }
    }
}

/// A limit found for a descriptor, and the `(key, value)` entries its bucket is keyed on.
type Hit = (Arc<Limit>, Vec<(String, String)>);

/// Resolves every descriptor: the limit that applies, `replaces` applied, and the cost.
fn plan(limits: &Limits, req: &RateLimitRequest) -> Result<Vec<Plan>, Status> {
    let mut found: Vec<Option<Hit>> = Vec::with_capacity(req.descriptors.len());
    for (i, d) in req.descriptors.iter().enumerate() {
        let entries = d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str()));
        let hit = match &d.limit {
            Some(o) => {
                let unit = Unit::from_proto(o.unit).ok_or_else(|| {
                    Status::invalid_argument(format!(
                        "descriptors[{i}].limit.unit: unknown unit {}",
                        o.unit
                    ))
                })?;
                let rpu = u64::from(o.requests_per_unit).min(MAX_AMOUNT);
                let limit = Limit {
                    requests_per_unit: rpu,
                    unit,
                    unlimited: false,
                    shadow_mode: false,
                    name: String::new(),
                    replaces: Vec::new(),
                    algorithm: crate::domain::Algorithm::TokenBucket,
                    capacity: rpu,
                    path: format!("{}.<override>", req.domain),
                };
                let entries = entries.map(|(k, v)| (k.to_string(), v.to_string()));
                Some((Arc::new(limit), entries.collect()))
            }
            None => limits
                .lookup(&req.domain, entries)
                .map(|f| (f.limit, f.entries)),
        };
        found.push(hit);
    }
    let replaced: Vec<String> = found
        .iter()
        .flatten()
        .flat_map(|(l, _)| l.replaces.iter().cloned())
        .collect();
    Ok(found
        .into_iter()
        .zip(&req.descriptors)
        .map(|(hit, d)| match hit {
            None => Plan::Free { unlimited: false },
            Some((l, _)) if l.unlimited => Plan::Free { unlimited: true },
            Some((l, _)) if !l.name.is_empty() && replaced.contains(&l.name) => {
                Plan::Free { unlimited: false }
            }
            Some((limit, entries)) => match cost(req, d) {
                0 => Plan::Free { unlimited: false },
                cost => Plan::Charge {
                    key: bucket_key(&req.domain, &entries),
                    limit,
                    cost,
                },
            },
        })
        .collect())
}

/// Hits to charge: the descriptor's `hits_addend` when set, else the request's (0 there means 1).
/// A descriptor asking to give hits back (`is_negative_hits`) or to charge 0 is not charged.
fn cost(req: &RateLimitRequest, d: &RateLimitDescriptor) -> u64 {
    if d.is_negative_hits {
        return 0;
    }
    match d.hits_addend {
        Some(h) => h,
        None => u64::from(req.hits_addend.max(1)),
    }
}

fn raw_bucket(limit: &Limit, key: &str, cost: u64) -> RawBucket {
    RawBucket {
        key: Some(key.to_string()),
        capacity: Some(limit.capacity),
        rate: Some(limit.requests_per_unit),
        period_ms: Some(limit.period_ms()),
        // Above the contract's bound a cost could never be paid anyway: deny, not refuse.
        cost: Some(cost.min(MAX_AMOUNT)),
        algorithm: Some(limit.algorithm),
        lease: None,
        rule: None,
    }
}

fn pb_limit(l: &Limit) -> RateLimit {
    RateLimit {
        name: l.name.clone(),
        requests_per_unit: u32::try_from(l.requests_per_unit).unwrap_or(u32::MAX),
        unit: l.unit.to_proto(),
    }
}

fn pb_duration(ms: u64) -> PbDuration {
    PbDuration {
        seconds: i64::try_from(ms / 1000).unwrap_or(i64::MAX),
        nanos: i32::try_from((ms % 1000) * 1_000_000).unwrap_or(0),
    }
}

fn status(code: Code, limit: &Limit, d: Option<&BucketDecision>) -> DescriptorStatus {
    // For a denial, the time until the request could pass; otherwise until the bucket is full
    // again (token bucket) or the window ends (fixed window).
    let until = d.map(|d| {
        if d.allowed {
            d.reset_ms
        } else {
            d.retry_after_ms
        }
    });
    DescriptorStatus {
        code: code as i32,
        current_limit: Some(pb_limit(limit)),
        limit_remaining: d
            .map(|d| u32::try_from(d.remaining).unwrap_or(u32::MAX))
            .unwrap_or(0),
        duration_until_reset: until.map(pb_duration),
    }
}

/// `RateLimit-Policy` / `RateLimit` (IETF draft, as the filter writes them) and `x-ratelimit-*`
/// for the descriptor that decided: the denying one with the longest wait, else the one with the
/// least left.
fn headers(statuses: &[DescriptorStatus], limits: &[Option<&Limit>]) -> Vec<HeaderValue> {
    let over = Code::OverLimit as i32;
    let secs = |s: &DescriptorStatus| {
        s.duration_until_reset
            .as_ref()
            .map(|d| d.seconds.max(0) as u64 + u64::from(d.nanos > 0))
            .unwrap_or(0)
    };
    let chosen = statuses
        .iter()
        .zip(limits)
        .filter_map(|(s, l)| l.map(|l| (s, l)))
        .filter(|(s, _)| s.current_limit.is_some())
        .min_by_key(|(s, _)| {
            if s.code == over {
                (0, u64::MAX - secs(s))
            } else {
                (1, u64::from(s.limit_remaining))
            }
        });
    let Some((s, l)) = chosen else {
        return Vec::new();
    };
    let name: String = if l.name.is_empty() { &l.path } else { &l.name }
        .chars()
        .filter(|c| *c != '"' && *c != '\\' && !c.is_control())
        .collect();
    let window = l.unit.seconds();
    let reset = secs(s);
    let h = |k: &str, v: String| HeaderValue {
        key: k.to_string(),
        value: v,
    };
    let mut out = vec![
        h(
            "ratelimit-policy",
            format!("\"{name}\";q={};w={window}", l.requests_per_unit),
        ),
        h(
            "ratelimit",
            format!("\"{name}\";r={};t={reset}", s.limit_remaining),
        ),
        h("x-ratelimit-limit", l.requests_per_unit.to_string()),
        h("x-ratelimit-remaining", s.limit_remaining.to_string()),
        h("x-ratelimit-reset", reset.to_string()),
    ];
    if s.code == over {
        out.push(h("retry-after", reset.max(1).to_string()));
    }
    out
}

impl RlsService {
    async fn decide(&self, req: &RateLimitRequest) -> Result<RateLimitResponse, Status> {
        if req.domain.is_empty() {
            return Err(Status::invalid_argument("domain: must not be empty"));
        }
        if req.descriptors.is_empty() {
            return Err(Status::invalid_argument("descriptors: must not be empty"));
        }
        let limits = self.limits.current();
        let plans = plan(&limits, req)?;
        let charged = |shadow: bool| {
            plans
                .iter()
                .enumerate()
                .filter_map(move |(i, p)| match p {
                    Plan::Charge { limit, key, cost } if limit.shadow_mode == shadow => {
                        Some((i, limit.clone(), key.clone(), *cost))
                    }
                    _ => None,
                })
                .collect::<Vec<_>>()
        };
        let (enforced, shadow) = (charged(false), charged(true));
        if enforced.len() > MAX_BUCKETS || shadow.len() > MAX_BUCKETS {
            return Err(Status::invalid_argument(format!(
                "descriptors: at most {MAX_BUCKETS} of them may match a limit"
            )));
        }
        let mut statuses: Vec<DescriptorStatus> = plans
            .iter()
            .map(|p| DescriptorStatus {
                code: Code::Ok as i32,
                limit_remaining: match p {
                    Plan::Free { unlimited: true } => u32::MAX,
                    _ => 0,
                },
                ..DescriptorStatus::default()
            })
            .collect();
        let mut overall = Code::Ok;
        // `requests_per_unit: 0` (a ban) denies without asking the store; nothing is charged.
        let banned = enforced.iter().any(|(_, l, _, _)| l.requests_per_unit == 0);
        if banned {
            overall = Code::OverLimit;
            for (i, l, _, _) in &enforced {
                let code = if l.requests_per_unit == 0 {
                    Code::OverLimit
                } else {
                    Code::Ok
                };
                if let Some(s) = statuses.get_mut(*i) {
                    *s = status(code, l, None);
                }
            }
        } else if !enforced.is_empty() {
            let d = self.take(&enforced).await?;
            if !d.allowed {
                overall = Code::OverLimit;
            }
            for ((i, l, _, _), b) in enforced.iter().zip(&d.buckets) {
                let code = if b.allowed { Code::Ok } else { Code::OverLimit };
                if let Some(s) = statuses.get_mut(*i) {
                    *s = status(code, l, Some(b));
                }
            }
        }
        let shadow: Vec<_> = shadow
            .into_iter()
            .filter(|(_, l, _, _)| l.requests_per_unit > 0)
            .collect();
        if !shadow.is_empty() {
            // A shadow limit never changes the answer, nor does its store failing.
            match self.take(&shadow).await {
                Ok(d) => {
                    for ((i, l, _, _), b) in shadow.iter().zip(&d.buckets) {
                        if !b.allowed {
                            tracing::debug!(limit = %l.path, "shadow limit over");
                        }
                        if let Some(s) = statuses.get_mut(*i) {
                            *s = status(Code::Ok, l, Some(b));
                        }
                    }
                }
                Err(e) => tracing::debug!(error = %e, "shadow take failed"),
            }
        }
        let applied: Vec<Option<&Limit>> = plans
            .iter()
            .map(|p| match p {
                Plan::Charge { limit, .. } if !limit.shadow_mode => Some(limit.as_ref()),
                _ => None,
            })
            .collect();
        let response_headers_to_add = headers(&statuses, &applied);
        Ok(RateLimitResponse {
            overall_code: overall as i32,
            statuses,
            response_headers_to_add,
        })
    }

    async fn take(
        &self,
        buckets: &[(usize, Arc<Limit>, String, u64)],
    ) -> Result<crate::domain::TakeDecision, Status> {
        let raw = RawTake {
            buckets: Some(
                buckets
                    .iter()
                    .map(|(_, l, k, c)| raw_bucket(l, k, *c))
                    .collect(),
            ),
            instance: None,
        };
        self.api.take(Ok(raw)).await.map_err(|e| status_of(&e))
    }
}

/// Reached only through [`crate::api::http::router`], after [`Api::admit`] (token, bounded body,
/// permit).
#[tonic::async_trait]
impl RateLimitService for RlsService {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        match self.decide(request.get_ref()).await {
            Ok(r) => {
                self.api.metrics.request("rls", "ok");
                Ok(Response::new(r))
            }
            Err(s) => {
                self.api.metrics.request("rls", code_label(&s));
                Err(s)
            }
        }
    }
}

fn code_label(s: &Status) -> &'static str {
    match s.code() {
        tonic::Code::InvalidArgument => "invalid_argument",
        tonic::Code::Unavailable => "unavailable",
        tonic::Code::DeadlineExceeded => "deadline_exceeded",
        tonic::Code::ResourceExhausted => "resource_exhausted",
        tonic::Code::Unauthenticated => "unauthenticated",
        _ => "internal",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rls::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
        Entry, RateLimitOverride,
    };
    use crate::store::memory::MemoryStore;

    const LIMITS: &str = "
domain: d
descriptors:
  - key: k
    value: a
    rate_limit: {unit: hour, requests_per_unit: 3}
  - key: k
    value: b
    rate_limit: {unit: hour, requests_per_unit: 10, name: b}
  - key: k
    value: free
    rate_limit: {unlimited: true}
  - key: k
    value: shadow
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: k
    value: boss
    rate_limit: {unit: hour, requests_per_unit: 100, replaces: [{name: b}]}
";

    fn service() -> RlsService {
        let api = Arc::new(Api::new(
            Arc::new(MemoryStore::new()),
            None,
            16,
            std::time::Duration::from_millis(500),
        ));
        let limits = Limits::parse(LIMITS).unwrap_or_default();
        RlsService::new(api, Arc::new(LimitsFile::fixed(limits)))
    }

    fn desc(value: &str) -> RateLimitDescriptor {
        RateLimitDescriptor {
            entries: vec![Entry {
                key: "k".into(),
                value: value.into(),
            }],
            ..RateLimitDescriptor::default()
        }
    }

    fn req(descriptors: Vec<RateLimitDescriptor>, hits: u32) -> RateLimitRequest {
        RateLimitRequest {
            domain: "d".into(),
            descriptors,
            hits_addend: hits,
        }
    }

    async fn codes(s: &RlsService, r: &RateLimitRequest) -> (i32, Vec<i32>, Vec<u32>) {
        match s.decide(r).await {
            Ok(resp) => (
                resp.overall_code,
                resp.statuses.iter().map(|x| x.code).collect(),
                resp.statuses.iter().map(|x| x.limit_remaining).collect(),
            ),
            Err(e) => (-1, vec![], vec![e.code() as u32]),
        }
    }

    const OK: i32 = Code::Ok as i32;
    const OVER: i32 = Code::OverLimit as i32;

    #[tokio::test]
    async fn hits_addend_and_all_or_nothing() {
        let s = service();
        // hits_addend 2 of 3, then 2 more is over; the other descriptor is not charged.
        assert_eq!(
            codes(&s, &req(vec![desc("a")], 2)).await,
            (OK, vec![OK], vec![1])
        );
        assert_eq!(
            codes(&s, &req(vec![desc("b"), desc("a")], 2)).await,
            (OVER, vec![OK, OVER], vec![8, 1])
        );
        assert_eq!(
            codes(&s, &req(vec![desc("b")], 0)).await,
            (OK, vec![OK], vec![9])
        );
        // A descriptor's own hits_addend wins over the request's.
        let mut d = desc("b");
        d.hits_addend = Some(4);
        assert_eq!(codes(&s, &req(vec![d], 1)).await, (OK, vec![OK], vec![5]));
    }

    #[tokio::test]
    async fn unlimited_shadow_replaces_and_overrides() {
        let s = service();
        assert_eq!(
            codes(&s, &req(vec![desc("free")], 1)).await,
            (OK, vec![OK], vec![u32::MAX])
        );
        for _ in 0..3 {
            assert_eq!(codes(&s, &req(vec![desc("shadow")], 1)).await.0, OK);
        }
        // `boss` replaces the limit named b: b's bucket is not charged.
        for _ in 0..12 {
            assert_eq!(
                codes(&s, &req(vec![desc("boss"), desc("b")], 1)).await.1,
                vec![OK, OK]
            );
        }
        assert_eq!(codes(&s, &req(vec![desc("b")], 1)).await.2, vec![9]);
        // Envoy's per-descriptor limit: 2 per minute for a descriptor the file does not know.
        let mut d = desc("unknown");
        d.limit = Some(RateLimitOverride {
            requests_per_unit: 2,
            unit: Unit::Minute.to_proto(),
        });
        let r = req(vec![d], 1);
        assert_eq!(codes(&s, &r).await.0, OK);
        assert_eq!(codes(&s, &r).await.0, OK);
        assert_eq!(codes(&s, &r).await.0, OVER);
        // No match: OK, no limit.
        assert_eq!(
            codes(&s, &req(vec![desc("none")], 1)).await,
            (OK, vec![OK], vec![0])
        );
        // Empty domain or no descriptor: INVALID_ARGUMENT.
        let mut bad = req(vec![desc("a")], 1);
        bad.domain.clear();
        assert_eq!(codes(&s, &bad).await.0, -1);
        assert_eq!(codes(&s, &req(vec![], 1)).await.0, -1);
    }

    #[tokio::test]
    async fn headers_name_the_deciding_limit() {
        let s = service();
        let r = req(vec![desc("b"), desc("a")], 3);
        let resp = s.decide(&r).await.unwrap_or_default();
        let h: Vec<(String, String)> = resp
            .response_headers_to_add
            .iter()
            .map(|h| (h.key.clone(), h.value.clone()))
            .collect();
        let get = |k: &str| h.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("x-ratelimit-limit"), Some("3"));
        assert_eq!(get("x-ratelimit-remaining"), Some("0"));
        assert_eq!(get("ratelimit-policy"), Some("\"d.k_a\";q=3;w=3600"));
        assert_eq!(get("retry-after"), None);
        let resp = s.decide(&r).await.unwrap_or_default();
        assert_eq!(resp.overall_code, OVER);
        let over = resp
            .response_headers_to_add
            .iter()
            .any(|h| h.key == "retry-after" && h.value.parse::<u64>().is_ok_and(|v| v >= 1));
        assert!(over, "{:?}", resp.response_headers_to_add);
    }

    #[test]
    fn keys_are_injective_and_stable() {
        let e = |v: &[(&str, &str)]| {
            v.iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect::<Vec<_>>()
        };
        let a = bucket_key("d", &e(&[("k", "a|b=c")]));
        let b = bucket_key("d", &e(&[("k", "a"), ("b", "c")]));
        assert_ne!(a, b);
        assert_eq!(bucket_key("d", &e(&[("k", "v")])), "rls|d|k=v");
        let long = "x".repeat(5000);
        let h = bucket_key("d", &e(&[("k", &long)]));
        assert!(h.starts_with("rls#") && h.len() == 68, "{h}");
    }
}
