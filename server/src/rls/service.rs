//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` over the service's store.
//!
//! A request's descriptors are resolved against the limits file (or the `limit` Envoy sent with a
//! descriptor), then every limit that is enforced is charged in **one** take: all or nothing, in
//! one atomic script. envoyproxy/ratelimit increments each descriptor's counter on its own, so a
//! request denied by one descriptor still spends the others; here a denied request spends nothing.
//! A descriptor with `hits_addend: 0` is a check, decided by a take that cannot pass (nothing is
//! written); a limit with `charge: response` is charged in full through the settle path, into
//! debt. Shadow-mode limits are decided last and always answer `OK`. docs/rls.md describes every
//! answer.

use std::fmt::Write;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use contract::headers;
use prost_types::Duration as PbDuration;
use sha2::{Digest, Sha256};
use tonic::{Request, Response, Status};

use super::config::{stat_step, Found, Limit, Limits, Unit};
use super::pb::envoy::config::core::v3::HeaderValue;
use super::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use super::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use super::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use super::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use super::reload::LimitsFile;
use crate::api::grpc::status_of;
use crate::domain::{
    BucketResult, BucketSpec, TakeResponse, MAX_AMOUNT, MAX_BUCKETS, MAX_KEY_BYTES,
};
use crate::metrics::RlsHits;
use crate::ops::settle::{RawSettle, RawSettleBucket};
use crate::ops::take::{validate, RawBucket, RawTake};
use crate::ops::Decide;

/// The RLS v3 service.
pub struct RlsService<D> {
    /// What it may ask of the service: takes, settlements, metrics.
    api: Arc<D>,
    limits: Arc<LimitsFile>,
    /// Random per process, and a sequence: the ids of the settlements that charge
    /// `charge: response` limits, each applied once (the store remembers an id).
    nonce: u64,
    settlements: AtomicU64,
}

impl<D: Decide> RlsService<D> {
    /// Serves `limits` over `api`'s takes, settlements and metrics.
    pub fn new(api: Arc<D>, limits: Arc<LimitsFile>) -> Self {
        let nonce =
            std::collections::hash_map::RandomState::new().hash_one(std::time::SystemTime::now());
        RlsService {
            api,
            limits,
            nonce,
            settlements: AtomicU64::new(0),
        }
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
    /// Charged `cost` (at least 1) to the bucket `key` under `limit`; counted under `stat`
    /// ([`Found::stat`]).
    Charge {
        limit: Arc<Limit>,
        key: String,
        cost: u64,
        stat: String,
    },
    /// `hits_addend: 0` on the descriptor: `OVER_LIMIT` when the bucket cannot cover one more
    /// unit (or owes), nothing charged.
    Check {
        limit: Arc<Limit>,
        key: String,
        stat: String,
    },
}

/// A descriptor that asks the store: its index in the request, its limit, bucket and cost (1
/// for a check).
type Ask = (usize, Arc<Limit>, String, u64);
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
/// Resolves every descriptor: the limit that applies, `replaces` applied, and the cost. A
/// descriptor's own `limit` (sent by Envoy) applies only in a domain the file knows, as in
/// envoyproxy/ratelimit.
fn plan(limits: &Limits, req: &RateLimitRequest) -> Result<Vec<Plan>, Status> {
    let mut found: Vec<Option<Found>> = Vec::with_capacity(req.descriptors.len());
    for (i, d) in req.descriptors.iter().enumerate() {
        let entries = d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str()));
        let hit = match &d.limit {
            Some(_) if !limits.has_domain(&req.domain) => None,
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
                    unit_multiplier: 1,
                    unlimited: false,
                    shadow_mode: false,
                    name: String::new(),
                    replaces: Vec::new(),
                    algorithm: crate::domain::Algorithm::TokenBucket,
                    capacity: rpu,
                    path: format!("{}.<override>", req.domain),
                    detailed_metric: true,
                    charge_response: false,
                    calendar: None,
                };
                let entries: Vec<(String, String)> = entries
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect();
                let steps: Vec<String> = entries.iter().map(|(k, v)| stat_step(k, v)).collect();
                Some(Found {
                    limit: Arc::new(limit),
                    entries,
                    stat: steps.join("."),
                })
            }
            None => limits.lookup(&req.domain, entries),
        };
        found.push(hit);
    }
    let replaced: Vec<String> = found
        .iter()
        .flatten()
        .flat_map(|f| f.limit.replaces.iter().cloned())
        .collect();
    Ok(found
        .into_iter()
        .zip(&req.descriptors)
        .map(|(hit, d)| match hit {
            None => Plan::Free { unlimited: false },
            Some(f) if f.limit.unlimited => Plan::Free { unlimited: true },
            Some(f) if !f.limit.name.is_empty() && replaced.contains(&f.limit.name) => {
                Plan::Free { unlimited: false }
            }
            Some(Found {
                limit,
                entries,
                stat,
            }) => {
                let key = bucket_key(&req.domain, &entries);
                match cost(req, d) {
                    None => Plan::Free { unlimited: false },
                    Some(0) => Plan::Check { limit, key, stat },
                    Some(cost) => Plan::Charge {
                        limit,
                        key,
                        cost,
                        stat,
                    },
                }
            }
        })
        .collect())
}

/// Hits to charge: the descriptor's `hits_addend` when set (0: a check), else the request's (0
/// there means 1, as Envoy documents). `None`: a descriptor giving hits back
/// (`is_negative_hits`), which is not charged.
fn cost(req: &RateLimitRequest, d: &RateLimitDescriptor) -> Option<u64> {
    if d.is_negative_hits {
        return None;
    }
    Some(match d.hits_addend {
        Some(h) => h,
        None => u64::from(req.hits_addend.max(1)),
    })
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
        max_delay_ms: None,
        calendar: limit.calendar.as_ref().map(|c| c.unit.name().to_string()),
        time_zone: limit.calendar.as_ref().map(|c| c.zone.clone()),
    }
}

/// The buckets of `asks` (`probe`: each followed by its own key again at its capacity, see
/// [`RlsService::probe`]), validated as any take's, [`MAX_BUCKETS`] at a time: a request may
/// match more descriptors than a take on the wire holds, and all of them are decided in one
/// store call.
fn specs(asks: &[Ask], probe: bool) -> Result<Vec<BucketSpec>, Status> {
    let mut raw = Vec::with_capacity(asks.len() * 2);
    for (_, l, k, c) in asks {
        raw.push(raw_bucket(l, k, *c));
        if probe {
            raw.push(raw_bucket(l, k, l.capacity));
        }
    }
    let mut out = Vec::with_capacity(raw.len());
    for chunk in raw.chunks(MAX_BUCKETS) {
        let take = RawTake {
            buckets: Some(chunk.to_vec()),
            instance: None,
        };
        out.extend(validate(take).map_err(|e| Status::internal(e.to_string()))?);
    }
    Ok(out)
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

/// A descriptor's status from its bucket's decision; `charged`: the store charged `cost`.
///
/// - Denied: `limit_remaining` 0 and `duration_until_reset` the time until this cost could
///   pass, as envoyproxy/ratelimit's window end is for a fixed window; none for a cost above
///   the limit, which never passes.
/// - Allowed: the tokens left (as the bucket stands when it was not charged: a check, or a
///   request another descriptor denied) and the time until the bucket is full again (token
///   bucket) or the window ends: when `limit_remaining` is back at the limit, which is what
///   envoyproxy/ratelimit's reset means.
fn decided(limit: &Limit, d: &BucketResult, cost: u64, charged: bool) -> DescriptorStatus {
    let (code, remaining, until) = if !d.allowed {
        let never = cost > limit.capacity;
        (Code::OverLimit, 0, (!never).then_some(d.retry_after_ms))
    } else if charged {
        (Code::Ok, d.remaining, Some(d.reset_ms))
    } else {
        let left = d.remaining.saturating_add(cost).min(limit.capacity);
        (Code::Ok, left, Some(d.reset_ms))
    };
    DescriptorStatus {
        code: code as i32,
        current_limit: Some(pb_limit(limit)),
        limit_remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
        duration_until_reset: until.map(pb_duration),
    }
}

fn set(statuses: &mut [DescriptorStatus], i: usize, s: DescriptorStatus) {
    if let Some(slot) = statuses.get_mut(i) {
        *slot = s;
    }
}

/// `requests_per_unit: 0` (a ban): denied, and no duration: nothing ever passes.
fn banned(limit: &Limit) -> DescriptorStatus {
    DescriptorStatus {
        code: Code::OverLimit as i32,
        current_limit: Some(pb_limit(limit)),
        limit_remaining: 0,
        duration_until_reset: None,
    }
}

/// `RateLimit-Policy` / `RateLimit` (IETF draft, as the filter writes them) and `x-ratelimit-*`
/// for the descriptor that decided: the denying one with the longest wait, else the one with the
/// least left. The reset is the status's `duration_until_reset` (what Envoy's own headers say);
/// a denial that never passes has none, and no `retry-after`.
fn headers(statuses: &[DescriptorStatus], limits: &[Option<&Limit>]) -> Vec<HeaderValue> {
    let over = Code::OverLimit as i32;
    let secs = |s: &DescriptorStatus| {
        s.duration_until_reset
            .as_ref()
            .map(|d| d.seconds.max(0) as u64 + u64::from(d.nanos > 0))
    };
    let chosen = statuses
        .iter()
        .zip(limits)
        .filter_map(|(s, l)| l.map(|l| (s, l)))
        .filter(|(s, _)| s.current_limit.is_some())
        .min_by_key(|(s, _)| {
            if s.code == over {
                (0, u64::MAX - secs(s).unwrap_or(u64::MAX))
            } else {
                (1, u64::from(s.limit_remaining))
            }
        });
    let Some((s, l)) = chosen else {
        return Vec::new();
    };
    let name = if l.name.is_empty() { &l.path } else { &l.name };
    let h = |k: &str, v: String| HeaderValue {
        key: k.to_string(),
        value: v,
    };
    let reset = secs(s);
    let (mut policy, mut state) = (String::new(), String::new());
    headers::push_policy(&mut policy, name, l.requests_per_unit, l.window_seconds());
    headers::push_state(&mut state, name, u64::from(s.limit_remaining), reset);
    let mut out = vec![
        h("ratelimit-policy", policy),
        h("ratelimit", state),
        h("x-ratelimit-limit", l.requests_per_unit.to_string()),
        h("x-ratelimit-remaining", s.limit_remaining.to_string()),
    ];
    if let Some(r) = reset {
        out.push(h("x-ratelimit-reset", r.to_string()));
        if s.code == over {
            out.push(h("retry-after", r.max(1).to_string()));
        }
    }
    out
}

impl<D: Decide> RlsService<D> {
    /// Decides a request:
    ///
    /// 1. A ban (`requests_per_unit: 0`) among the enforced limits denies without a charge.
    /// 2. Checks (`hits_addend: 0`) are decided by a probe that charges nothing, together with
    ///    the charges (so a denied request reports every descriptor's true remaining).
    /// 3. The charges, all or nothing, in one take.
    /// 4. `charge: response` limits are charged what Envoy sent, into debt if need be.
    /// 5. Shadow-mode limits last; they never change the answer.
    async fn decide(&self, req: &RateLimitRequest) -> Result<RateLimitResponse, Status> {
        if req.domain.is_empty() {
            return Err(Status::invalid_argument("domain: must not be empty"));
        }
        if req.descriptors.is_empty() {
            return Err(Status::invalid_argument("descriptors: must not be empty"));
        }
        let limits = self.limits.current();
        let plans = plan(&limits, req)?;
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
        // (checks, all-or-nothing charges, charges into debt), each of enforced or shadow limits.
        let (mut checks, mut charges, mut debts) = (Vec::new(), Vec::new(), Vec::new());
        let (mut shadow_checks, mut shadow_charges) = (Vec::new(), Vec::new());
        let mut ban = false;
        for (i, p) in plans.iter().enumerate() {
            let (limit, key, cost) = match p {
                Plan::Free { .. } => continue,
                Plan::Check { limit, key, .. } => (limit, key, 0),
                Plan::Charge {
                    limit, key, cost, ..
                } => (limit, key, *cost),
            };
            if limit.requests_per_unit == 0 {
                if !limit.shadow_mode {
                    ban = true;
                    set(&mut statuses, i, banned(limit));
                }
                continue;
            }
            let ask = (i, limit.clone(), key.clone(), cost.max(1));
            match (limit.shadow_mode, cost, limit.charge_response) {
                (false, 0, _) => checks.push(ask),
                (false, _, true) => debts.push(ask),
                (false, _, false) => charges.push(ask),
                (true, 0, _) => shadow_checks.push(ask),
                (true, _, _) => shadow_charges.push(ask),
            }
        }
        let mut over = ban;
        let asks: Vec<Ask> = checks.iter().chain(&charges).cloned().collect();
        if (ban || !checks.is_empty()) && !asks.is_empty() {
            let decisions = self.probe(&asks).await?;
            for ((i, l, _, c), d) in asks.iter().zip(&decisions) {
                over |= !d.allowed;
                set(&mut statuses, *i, decided(l, d, *c, false));
            }
        }
        if !over && !charges.is_empty() {
            let d = self.take(&charges).await?;
            over = !d.allowed;
            for ((i, l, _, c), b) in charges.iter().zip(&d.buckets) {
                set(&mut statuses, *i, decided(l, b, *c, d.allowed));
            }
        }
        for (i, status) in self.charge_into_debt(&debts).await? {
            over |= status.code == Code::OverLimit as i32;
            set(&mut statuses, i, status);
        }
        let shadow_over = self
            .shadow(&shadow_checks, &shadow_charges, &mut statuses)
            .await;
        let response_headers_to_add = if self.limits.headers() {
            let applied: Vec<Option<&Limit>> = plans
                .iter()
                .map(|p| match p {
                    Plan::Charge { limit, .. } | Plan::Check { limit, .. }
                        if !limit.shadow_mode =>
                    {
                        Some(limit.as_ref())
                    }
                    _ => None,
                })
                .collect();
            headers(&statuses, &applied)
        } else {
            Vec::new()
        };
        self.count(req, &plans, &statuses, &shadow_over);
        let overall = if over { Code::OverLimit } else { Code::Ok };
        Ok(RateLimitResponse {
            overall_code: overall as i32,
            statuses,
            response_headers_to_add,
        })
    }

    /// Counts every descriptor that matched a limit in `/metrics` (`tollgate_rls_hits_total`),
    /// keyed as envoyproxy/ratelimit keys its statistics ([`Found::stat`]).
    fn count(
        &self,
        req: &RateLimitRequest,
        plans: &[Plan],
        statuses: &[DescriptorStatus],
        shadow_over: &[usize],
    ) {
        for (i, (p, s)) in plans.iter().zip(statuses).enumerate() {
            let (limit, hits, key) = match p {
                Plan::Free { .. } => continue,
                Plan::Check { limit, stat, .. } => (limit, 0, stat),
                Plan::Charge {
                    limit, cost, stat, ..
                } => (limit, *cost, stat),
            };
            // Within 20 % of the limit after this descriptor (an allowed status's remaining).
            let near = u64::from(s.limit_remaining).saturating_mul(5) <= limit.capacity;
            let over = s.code == Code::OverLimit as i32 || shadow_over.contains(&i);
            self.api.metrics().rls_hits(
                &req.domain,
                key,
                RlsHits {
                    hits,
                    over,
                    near,
                    shadow: limit.shadow_mode,
                },
            );
        }
    }

    /// Charges `asks` in one take, all or nothing (counted in `tollgate_decisions_total`).
    async fn take(&self, asks: &[Ask]) -> Result<TakeResponse, Status> {
        let specs = specs(asks, false)?;
        let d = self
            .api
            .take_specs(&specs)
            .await
            .map_err(|e| status_of(&e))?;
        // Never shaped: an RLS bucket has no max_delay_ms (config.rs refuses one).
        self.api.metrics().decision(d.allowed, 0);
        Ok(d)
    }

    /// Decides `asks` without charging anything: one take in which each bucket is followed by
    /// its own key again at its whole capacity, which no bucket can pay after the first charge,
    /// so the take is denied and nothing is written (a denied take writes nothing, in every
    /// store and in every Redis Cluster slot), while each first entry says whether it could
    /// have paid, what would be left and when. One decision per ask.
    async fn probe(&self, asks: &[Ask]) -> Result<Vec<BucketResult>, Status> {
        let specs = specs(asks, true)?;
        let d = self
            .api
            .take_specs(&specs)
            .await
            .map_err(|e| status_of(&e))?;
        let decided: Vec<BucketResult> = d.buckets.into_iter().step_by(2).collect();
        // Counted as what it decided, not as the denied take it is.
        self.api
            .metrics()
            .decision(decided.iter().all(|b| b.allowed), 0);
        Ok(decided)
    }

    /// Charges `asks` (limits with `charge: response`) in full through a settlement with no
    /// estimate: the store's settle path, which lets a bucket owe (contract/README.md,
    /// "Settle"). Each call is its own settlement, with an id of its own.
    async fn charge_into_debt(
        &self,
        asks: &[Ask],
    ) -> Result<Vec<(usize, DescriptorStatus)>, Status> {
        let mut out = Vec::with_capacity(asks.len());
        for chunk in asks.chunks(MAX_BUCKETS) {
            let id = format!(
                "rls-{:016x}-{}",
                self.nonce,
                self.settlements.fetch_add(1, Ordering::Relaxed)
            );
            let raw = RawSettle {
                id: Some(id),
                instance: None,
                buckets: Some(
                    chunk
                        .iter()
                        .map(|(_, l, k, c)| RawSettleBucket {
                            bucket: RawBucket {
                                cost: None,
                                ..raw_bucket(l, k, 1)
                            },
                            estimate: Some(0),
                            used: Some((*c).min(MAX_AMOUNT)),
                            window: None,
                        })
                        .collect(),
                ),
            };
            let d = self.api.settle(raw).await.map_err(|e| status_of(&e))?;
            for ((i, l, _, _), b) in chunk.iter().zip(&d.buckets) {
                let code = if b.debt > 0 {
                    Code::OverLimit
                } else {
                    Code::Ok
                };
                out.push((
                    *i,
                    DescriptorStatus {
                        code: code as i32,
                        current_limit: Some(pb_limit(l)),
                        limit_remaining: u32::try_from(b.remaining).unwrap_or(u32::MAX),
                        duration_until_reset: None,
                    },
                ));
            }
        }
        Ok(out)
    }

    /// Shadow-mode limits: checks probed, charges taken, each reported `OK` whatever its
    /// bucket said; a store failure changes nothing either. Returns the descriptors that were
    /// over their limit.
    async fn shadow(
        &self,
        checks: &[Ask],
        charges: &[Ask],
        statuses: &mut [DescriptorStatus],
    ) -> Vec<usize> {
        let mut decided_all = Vec::new();
        if !checks.is_empty() {
            match self.probe(checks).await {
                Ok(d) => decided_all.extend(checks.iter().zip(d).map(|(a, d)| (a, d, false))),
                Err(e) => tracing::debug!(error = %e, "shadow check failed"),
            }
        }
        if !charges.is_empty() {
            match self.take(charges).await {
                Ok(d) => {
                    let allowed = d.allowed;
                    decided_all.extend(charges.iter().zip(d.buckets).map(|(a, d)| (a, d, allowed)));
                }
                Err(e) => tracing::debug!(error = %e, "shadow take failed"),
            }
        }
        let mut over = Vec::new();
        for ((i, l, _, c), d, charged) in decided_all {
            if !d.allowed {
                tracing::debug!(limit = %l.path, "shadow limit over");
                over.push(*i);
            }
            let mut s = decided(l, &d, *c, charged);
            s.code = Code::Ok as i32;
            set(statuses, *i, s);
        }
        over
    }
}

/// Reached only through [`crate::router::router`], after [`crate::api::Api::admit`] (token, bounded body,
/// permit).
#[tonic::async_trait]
impl<D: Decide> RateLimitService for RlsService<D> {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        match self.decide(request.get_ref()).await {
            Ok(r) => {
                self.api.metrics().request("rls", "ok");
                Ok(Response::new(r))
            }
            Err(s) => {
                self.api.metrics().request("rls", code_label(&s));
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
    use crate::api::Api;
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
  - key: k
    value: resp
    rate_limit: {unit: hour, requests_per_unit: 2, charge: response}
  - key: k
    value: ban
    rate_limit: {unit: minute, requests_per_unit: 0}
  - key: many
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: user
    detailed_metric: true
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: k
    value: five
    rate_limit: {unit: minute, unit_multiplier: 5, requests_per_unit: 10, name: five}
  - key: k
    value: week
    rate_limit: {unit: week, requests_per_unit: 7}
  - key: k
    value: month
    rate_limit: {unit: month, requests_per_unit: 30}
  - key: k
    value: year
    rate_limit: {unit: year, requests_per_unit: 365, algorithm: fixed_window}
";

    fn service() -> RlsService<Api> {
        service_with(false)
    }

    fn service_with(headers: bool) -> RlsService<Api> {
        service_of(LIMITS, headers)
    }

    fn service_of(text: &str, headers: bool) -> RlsService<Api> {
        let api = Arc::new(Api::new(
            Arc::new(MemoryStore::new()),
            None,
            16,
            std::time::Duration::from_millis(500),
        ));
        let limits = Limits::parse(text).unwrap_or_default();
        RlsService::new(
            api,
            Arc::new(LimitsFile::fixed(limits).with_headers(headers)),
        )
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

    async fn codes(s: &RlsService<Api>, r: &RateLimitRequest) -> (i32, Vec<i32>, Vec<u32>) {
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
        // hits_addend 2 of 3, then 2 more is over; the other descriptor is not charged. The
        // denying one reports 0 left, the other what it really has (10, not 8 as if charged).
        assert_eq!(
            codes(&s, &req(vec![desc("a")], 2)).await,
            (OK, vec![OK], vec![1])
        );
        assert_eq!(
            codes(&s, &req(vec![desc("b"), desc("a")], 2)).await,
            (OVER, vec![OK, OVER], vec![10, 0])
        );
        // The request's hits_addend 0 is 1 (Envoy sends 0 when it has none).
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
        // The same descriptor limit in a domain the file does not know: ignored, as upstream.
        let mut d = desc("unknown");
        d.limit = Some(RateLimitOverride {
            requests_per_unit: 1,
            unit: Unit::Minute.to_proto(),
        });
        let mut r = req(vec![d], 1);
        r.domain = "elsewhere".into();
        for _ in 0..3 {
            assert_eq!(codes(&s, &r).await, (OK, vec![OK], vec![0]));
        }
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
        let s = service_with(true);
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

    fn header(resp: &RateLimitResponse, k: &str) -> Option<String> {
        resp.response_headers_to_add
            .iter()
            .find(|h| h.key == k)
            .map(|h| h.value.clone())
    }

    fn until_ms(s: &DescriptorStatus) -> Option<u64> {
        s.duration_until_reset
            .as_ref()
            .map(|d| d.seconds as u64 * 1000 + d.nanos as u64 / 1_000_000)
    }

    #[tokio::test]
    async fn headers_only_when_asked() {
        let r = req(vec![desc("a")], 1);
        let plain = service().decide(&r).await.unwrap_or_default();
        assert!(plain.response_headers_to_add.is_empty(), "{plain:?}");
        let with = service_with(true).decide(&r).await.unwrap_or_default();
        assert_eq!(header(&with, "x-ratelimit-remaining").as_deref(), Some("2"));
    }

    #[tokio::test]
    async fn a_zero_cost_check_charges_nothing_and_denies_an_empty_bucket() {
        let s = service_with(true);
        let mut check = desc("a");
        check.hits_addend = Some(0);
        let c = req(vec![check], 1);
        for _ in 0..3 {
            assert_eq!(codes(&s, &c).await, (OK, vec![OK], vec![3]));
        }
        assert_eq!(codes(&s, &req(vec![desc("a")], 3)).await.0, OK);
        let resp = s.decide(&c).await.unwrap_or_default();
        assert_eq!(resp.overall_code, OVER);
        let st = &resp.statuses[0];
        assert_eq!((st.code, st.limit_remaining), (OVER, 0));
        assert_eq!(
            st.current_limit.as_ref().map(|l| l.requests_per_unit),
            Some(3)
        );
        // 3 per hour: one unit is back in 1,200 s.
        let wait = until_ms(st).unwrap_or(0);
        assert!((1_199_000..=1_200_000).contains(&wait), "{wait}");
        assert_eq!(header(&resp, "retry-after").as_deref(), Some("1200"));
        // Each check counts as what it decided (the probe's take is always denied).
        let m = s.api.metrics.encode();
        assert!(
            m.contains("tollgate_decisions_total{outcome=\"allowed\"} 4"),
            "{m}"
        );
        assert!(
            m.contains("tollgate_decisions_total{outcome=\"limited\"} 1"),
            "{m}"
        );
    }

    #[tokio::test]
    async fn a_response_charge_goes_into_debt_and_the_checks_wait_for_it() {
        let s = service();
        let mut check = desc("resp");
        check.hits_addend = Some(0);
        let c = req(vec![check], 1);
        let mut charge = desc("resp");
        charge.hits_addend = Some(3);
        let charge = req(vec![charge], 1);
        assert_eq!(codes(&s, &c).await, (OK, vec![OK], vec![2]));
        // 3 charged to a bucket of 2: applied in full, 1 owed.
        assert_eq!(codes(&s, &charge).await, (OVER, vec![OVER], vec![0]));
        let resp = s.decide(&c).await.unwrap_or_default();
        assert_eq!(resp.overall_code, OVER);
        // 2 per hour: the debt of 1 and one unit take 2 x 1,800 s.
        let wait = until_ms(&resp.statuses[0]).unwrap_or(0);
        assert!((3_599_000..=3_600_000).contains(&wait), "{wait}");
    }

    #[tokio::test]
    async fn more_descriptors_than_a_take_holds_are_decided_all_or_nothing() {
        let s = service();
        let many = |n: usize| {
            (0..n)
                .map(|i| RateLimitDescriptor {
                    entries: vec![Entry {
                        key: "many".into(),
                        value: format!("v{i}"),
                    }],
                    ..RateLimitDescriptor::default()
                })
                .collect::<Vec<_>>()
        };
        // v0 is spent first; then 40 descriptors: denied by v0 alone, nothing charged.
        assert_eq!(codes(&s, &req(many(1), 1)).await.0, OK);
        let (code, each, left) = codes(&s, &req(many(40), 1)).await;
        assert_eq!(code, OVER);
        assert_eq!(each.iter().filter(|c| **c == OVER).count(), 1);
        assert_eq!(left.iter().sum::<u32>(), 39);
        // v1..v40: all 40 pass, once.
        let r = req(many(41).split_off(1), 1);
        assert_eq!(codes(&s, &r).await, (OK, vec![OK; 40], vec![0; 40]));
        assert_eq!(codes(&s, &r).await.1, vec![OVER; 40]);
    }

    #[tokio::test]
    async fn what_never_passes_says_so() {
        let s = service_with(true);
        // A ban: denied with no time to wait and no retry-after.
        let resp = s
            .decide(&req(vec![desc("ban")], 1))
            .await
            .unwrap_or_default();
        assert_eq!(resp.overall_code, OVER);
        assert_eq!(until_ms(&resp.statuses[0]), None);
        assert_eq!(header(&resp, "retry-after"), None);
        assert_eq!(header(&resp, "x-ratelimit-limit").as_deref(), Some("0"));
        // A cost above the limit: likewise.
        let resp = s.decide(&req(vec![desc("a")], 4)).await.unwrap_or_default();
        assert_eq!(resp.overall_code, OVER);
        assert_eq!(until_ms(&resp.statuses[0]), None);
        assert_eq!(header(&resp, "retry-after"), None);
        // Neither charged anything.
        assert_eq!(codes(&s, &req(vec![desc("a")], 1)).await.2, vec![2]);
    }

    #[tokio::test]
    async fn windows_of_a_unit_multiplier_and_the_long_units() {
        let s = service_with(true);
        // 10 per 5 minutes: spent, one is back in 30 s; the policy's window is 300 s.
        assert_eq!(codes(&s, &req(vec![desc("five")], 10)).await.0, OK);
        let resp = s
            .decide(&req(vec![desc("five")], 1))
            .await
            .unwrap_or_default();
        assert_eq!(resp.overall_code, OVER);
        let wait = until_ms(&resp.statuses[0]).unwrap_or(0);
        assert!((29_000..=30_000).contains(&wait), "{wait}");
        assert_eq!(
            header(&resp, "ratelimit-policy").as_deref(),
            Some("\"five\";q=10;w=300")
        );
        // A week of 7, a month of 30: one a day. A fixed window of a year: until its end.
        for (v, n, wait_ms) in [("week", 7, 86_400_000), ("month", 30, 86_400_000)] {
            assert_eq!(codes(&s, &req(vec![desc(v)], n)).await.0, OK, "{v}");
            let resp = s.decide(&req(vec![desc(v)], 1)).await.unwrap_or_default();
            let wait = until_ms(&resp.statuses[0]).unwrap_or(0);
            assert!((wait_ms - 1000..=wait_ms).contains(&wait), "{v}: {wait}");
            let unit = resp.statuses[0].current_limit.as_ref().map(|l| l.unit);
            let want = if v == "week" { Unit::Week } else { Unit::Month };
            assert_eq!(unit, Some(want.to_proto()));
        }
        assert_eq!(codes(&s, &req(vec![desc("year")], 365)).await.0, OK);
        let resp = s
            .decide(&req(vec![desc("year")], 1))
            .await
            .unwrap_or_default();
        assert_eq!(resp.overall_code, OVER);
        let wait = until_ms(&resp.statuses[0]).unwrap_or(0);
        assert!(wait > 0 && wait <= 365 * 86_400_000, "{wait}");
    }

    #[tokio::test]
    async fn statistics_per_domain_and_descriptor_key_bounded() {
        let s = service();
        for _ in 0..4 {
            let _ = s.decide(&req(vec![desc("a")], 1)).await;
        }
        for _ in 0..2 {
            let _ = s.decide(&req(vec![desc("shadow")], 1)).await;
        }
        let user = |u: &str| RateLimitDescriptor {
            entries: vec![Entry {
                key: "user".into(),
                value: u.into(),
            }],
            ..RateLimitDescriptor::default()
        };
        let _ = s.decide(&req(vec![user("alice")], 2)).await;
        let m = s.api.metrics.encode();
        let line = |key: &str, stat: &str| stat_of(&m, "d", key, stat);
        // 3 of 3 within (the third leaves none: near), the fourth over.
        assert_eq!(line("k_a", "total_hits"), Some(4), "{m}");
        assert_eq!(line("k_a", "within_limit"), Some(3));
        assert_eq!(line("k_a", "near_limit"), Some(1));
        assert_eq!(line("k_a", "over_limit"), Some(1));
        // Shadow mode: answered OK, counted over and shadow_mode.
        assert_eq!(line("k_shadow", "shadow_mode"), Some(1));
        assert_eq!(line("k_shadow", "over_limit"), Some(1));
        // detailed_metric: the request's value, hits as charged.
        assert_eq!(line("user_alice", "total_hits"), Some(2));
        // The keys a client chooses are bounded; the rest count as "other".
        for i in 0..crate::metrics::MAX_RLS_STAT_KEYS {
            let _ = s.decide(&req(vec![user(&format!("u{i}"))], 1)).await;
        }
        let m = s.api.metrics.encode();
        let keys: std::collections::HashSet<&str> = m
            .lines()
            .filter(|l| l.starts_with("tollgate_rls_hits_total{"))
            .filter_map(|l| l.split("key=\"").nth(1)?.split('"').next())
            .collect();
        assert_eq!(
            keys.len(),
            crate::metrics::MAX_RLS_STAT_KEYS + 1,
            "the bound and other"
        );
        assert!(keys.contains("other"));
        assert!(m.contains("tollgate_rls_stat_keys_overflow_total 3"), "{m}");
    }

    /// `tollgate_rls_hits_total{domain, key, stat}` in `m`, if there.
    fn stat_of(m: &str, domain: &str, key: &str, stat: &str) -> Option<u64> {
        let want = format!(
            "tollgate_rls_hits_total{{domain=\"{domain}\",key=\"{key}\",stat=\"{stat}\"}} "
        );
        m.lines()
            .find_map(|l| l.strip_prefix(want.as_str()))
            .and_then(|v| v.parse::<u64>().ok())
    }

    #[tokio::test]
    async fn value_to_metric_names_only_its_own_descriptors_value() {
        // As envoyproxy/ratelimit: the flag puts the request's value in the statistics key at
        // its own level only (matched by the key alone or by a wildcard), never at the levels
        // below or above it; share_threshold keeps the wildcard; detailed_metric names all.
        let s = service_of(
            r#"
domain: v
descriptors:
  - key: route
    value_to_metric: true
    descriptors:
      - key: user
        rate_limit: {unit: hour, requests_per_unit: 5}
  - key: team
    descriptors:
      - key: user
        value_to_metric: true
        rate_limit: {unit: hour, requests_per_unit: 5}
  - key: path
    value: "/api/*"
    value_to_metric: true
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: path
    value: "/static/*"
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: path
    value: "/shared/*"
    share_threshold: true
    value_to_metric: true
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: client
    value: known
    value_to_metric: true
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: plan
    value_to_metric: true
    descriptors:
      - key: user
        detailed_metric: true
        rate_limit: {unit: hour, requests_per_unit: 5}
"#,
            false,
        );
        let d = |entries: &[(&str, &str)]| RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(k, v)| Entry {
                    key: (*k).into(),
                    value: (*v).into(),
                })
                .collect(),
            ..RateLimitDescriptor::default()
        };
        let asks = [
            vec![("route", "r1"), ("user", "alice")],
            vec![("team", "t1"), ("user", "bob")],
            vec![("path", "/api/x")],
            vec![("path", "/static/a.css")],
            vec![("path", "/shared/y")],
            vec![("client", "known")],
            vec![("plan", "pro"), ("user", "carol")],
        ];
        for a in &asks {
            let mut r = req(vec![d(a)], 1);
            r.domain = "v".into();
            assert_eq!(codes(&s, &r).await.0, OK, "{a:?}");
        }
        let m = s.api.metrics.encode();
        for key in [
            "route_r1.user",
            "team.user_bob",
            "path_/api/x",
            "path_/static/*",
            "path_/shared/*",
            "client_known",
            "plan_pro.user_carol",
        ] {
            assert_eq!(stat_of(&m, "v", key, "total_hits"), Some(1), "{key}: {m}");
        }
        let keys = m.matches("tollgate_rls_hits_total{domain=\"v\"").count();
        assert_eq!(
            keys,
            asks.len() * 5,
            "one key per descriptor, five stats each: {m}"
        );
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
