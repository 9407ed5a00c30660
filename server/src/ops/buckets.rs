//! `buckets`: an operator looks at one client's bucket and resets it, without `redis-cli` or the
//! key layout. `GET /v1/buckets?<the bucket's fields>` reads it on the store's clock and changes
//! nothing; `POST /v1/buckets/reset` with the same fields as a JSON body deletes it (every key
//! of it), so the next take finds a full bucket.
//!
//! A bucket is named as a take names it (contract/README.md): `key` as the filter sends it (the
//! rule's key parts joined by its key builder, `src/core/rules/keys.rs`), `algorithm` (default
//! `token_bucket`); inspecting also needs its limits (`capacity`, `rate`, `period_ms`, as the
//! rule says), under which it is read, as a take would read it. `kind=concurrency` names a
//! concurrency rule's key instead: its live slots and their deadlines (no limits needed).
//!
//! gRPC: `tollgate.admin.v1.Admin` (`server/proto/tollgate/admin.proto`), `InspectBucket` and
//! `ResetBucket`, with the same fields.
//!
//! Guarded by a token of their own (`--admin-token`, `TOLLGATE_ADMIN_TOKEN` or
//! `--admin-token-file`), never the takes' token: without one set, both answer 404 (the
//! endpoints do not exist); with one, any other bearer (the takes' token included) is 401.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;
use serde::de::MapAccess;
use serde::Serialize;
use serde_json::{Map, Value};

use super::invalid;
use super::take::{self, RawBucket, RawTake};
use crate::api::grpc::{admin_pb, non_empty, status_of};
use crate::api::http::answer;
use crate::api::json::{self, Field, Object};
use crate::api::{Api, ApiError};
use crate::domain::{
    Algorithm, BucketSpec, BucketState, InvalidArgument, Period, ResetTarget, SlotsState,
    MAX_KEY_BYTES,
};
use contract::fields;

/// The field naming what a key is: `rate` (the default) or `concurrency` (a rule's `kind`).
pub const KIND: &str = "kind";
/// Every field of an inspection or a reset.
pub const FIELDS: [&str; 8] = [
    KIND,
    fields::KEY,
    fields::ALGORITHM,
    fields::CAPACITY,
    fields::RATE,
    fields::PERIOD_MS,
    fields::CALENDAR,
    fields::TIME_ZONE,
];
/// The largest reset body: a key of [`MAX_KEY_BYTES`] (escaped) and the other fields.
pub const BODY_BYTES: usize = 6 * MAX_KEY_BYTES + 512;

/// An inspection or a reset as decoded, before validation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawBucketRef {
    /// `kind`: `rate` or `concurrency`; absent means `rate`.
    pub kind: Option<String>,
    /// The bucket's fields, as a take's.
    pub bucket: RawBucket,
}

impl Object for RawBucketRef {
    const FIELDS: &'static [&'static str] = &FIELDS;

    fn read<'de, A: MapAccess<'de>>(
        &mut self,
        name: &'static str,
        v: Field<'_, '_, A>,
    ) -> Result<(), A::Error> {
        match name {
            KIND => self.kind = v.string()?,
            // The bucket's own fields, read as a take's bucket reads them (FIELDS holds no `cost`,
            // `lease` or `rule`, so those never reach it).
            _ => self.bucket.read(name, v)?,
        }
        Ok(())
    }
}

/// A validated inspection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inspect {
    /// A rate bucket under these limits (cost unused), with a calendar window's zone.
    Bucket(BucketSpec, Option<String>),
    /// A concurrency key's slots.
    Slots(String),
}

/// What an inspection answers: the bucket's state, or the key's slots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Inspected {
    /// A rate bucket.
    Bucket(BucketState),
    /// A concurrency key.
    Slots(SlotsState),
}

/// The answer to a reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Reset {
    /// Whether anything was stored (false: the bucket was full or unknown already).
    pub reset: bool,
}

/// Whether `raw` names a concurrency key (else a rate bucket); an unknown kind is refused.
fn is_concurrency(raw: &RawBucketRef) -> Result<bool, InvalidArgument> {
    match raw.kind.as_deref() {
        None | Some("rate") => Ok(false),
        Some("concurrency") => Ok(true),
        Some(k) => Err(InvalidArgument::new(
            KIND,
            format!("must be \"rate\" or \"concurrency\", got {k:?}"),
        )),
    }
}

/// A concurrency key: the key alone (a take's key bounds), no bucket field.
fn slots_key(raw: RawBucketRef) -> Result<String, InvalidArgument> {
    let b = raw.bucket;
    for (name, given) in [
        (fields::ALGORITHM, b.algorithm.is_some()),
        (fields::CAPACITY, b.capacity.is_some()),
        (fields::RATE, b.rate.is_some()),
        (fields::PERIOD_MS, b.period_ms.is_some()),
    ] {
        if given {
            return Err(InvalidArgument::new(
                name,
                "not allowed with kind \"concurrency\"",
            ));
        }
    }
    let key = b
        .key
        .ok_or_else(|| InvalidArgument::new(fields::KEY, "is required"))?;
    if key.is_empty() || key.len() > MAX_KEY_BYTES {
        return Err(InvalidArgument::new(
            fields::KEY,
            format!("must be 1..={MAX_KEY_BYTES} bytes, got {}", key.len()),
        ));
    }
    Ok(key)
}

/// A rate bucket, validated as a take's only bucket (its errors name the field alone).
fn bucket(b: RawBucket) -> Result<BucketSpec, InvalidArgument> {
    let mut specs = take::validate(RawTake {
        buckets: Some(vec![b]),
        instance: None,
    })
    .map_err(|mut e| {
        if let Some(f) = e.field.strip_prefix("buckets[0].") {
            e.field = f.to_string();
        }
        e
    })?;
    specs
        .pop()
        .ok_or_else(|| InvalidArgument::new(fields::KEY, "is required"))
}

/// Validates an inspection: a concurrency key, or a rate bucket with its limits.
pub fn validate_inspect(raw: RawBucketRef) -> Result<Inspect, InvalidArgument> {
    if is_concurrency(&raw)? {
        return slots_key(raw).map(Inspect::Slots);
    }
    let zone = raw.bucket.calendar.is_some().then(|| {
        raw.bucket
            .time_zone
            .clone()
            .unwrap_or_else(|| contract::calendar::UTC.to_string())
    });
    bucket(raw.bucket).map(|b| Inspect::Bucket(b, zone))
}

/// Validates a reset: a concurrency key, or a rate bucket's algorithm and key (its limits,
/// when given, are checked and not needed: a bucket is its algorithm and key).
pub fn validate_reset(raw: RawBucketRef) -> Result<ResetTarget, InvalidArgument> {
    if is_concurrency(&raw)? {
        return slots_key(raw).map(ResetTarget::Slots);
    }
    let mut b = raw.bucket;
    b.capacity = b.capacity.or(Some(1));
    b.period_ms = b.period_ms.or(Some(1));
    bucket(b).map(|s| ResetTarget::Bucket(s.algorithm, s.key))
}

/// The query string as the JSON object a reset's body would be: numbers where the field is a
/// number and the value one, text otherwise (the strict reader then names a bad field); a field
/// given twice is refused.
pub fn query_object(query: &str) -> Result<Vec<u8>, InvalidArgument> {
    let mut obj = Map::new();
    for (k, v) in url::form_urlencoded::parse(query.as_bytes()) {
        let numeric = [fields::CAPACITY, fields::RATE, fields::PERIOD_MS].contains(&k.as_ref());
        let value = match v.parse::<u64>() {
            Ok(n) if numeric => Value::from(n),
            _ => Value::from(v.as_ref()),
        };
        if obj.insert(k.to_string(), value).is_some() {
            return Err(InvalidArgument::new(k.as_ref(), "given more than once"));
        }
    }
    serde_json::to_vec(&Value::Object(obj))
        .map_err(|e| InvalidArgument::new("", format!("query: {e}")))
}

/// Decides a validated inspection.
pub async fn inspect(api: &Api, what: &Inspect) -> Result<Inspected, ApiError> {
    match what {
        Inspect::Bucket(b, zone) => {
            let mut state = api.store_call("inspect", api.store.inspect(b)).await?;
            if let Some(zone) = zone {
                state.period = period(b, zone);
            }
            Ok(Inspected::Bucket(state))
        }
        Inspect::Slots(k) => api
            .store_call("inspect", api.store.inspect_slots(k))
            .await
            .map(Inspected::Slots),
    }
}

/// A calendar bucket's period now (its span, computed when it was validated, picks it on the
/// service's clock).
fn period(b: &BucketSpec, zone: &str) -> Option<Period> {
    let span = contract::calendar::Span::unpack(b.rate, b.period_ms);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_millis();
    let (start_ms, end_ms) = span.window(u64::try_from(now).ok()?);
    Some(Period {
        start_ms,
        end_ms,
        start: crate::calendar::format(start_ms, zone).ok()?,
        end: crate::calendar::format(end_ms, zone).ok()?,
    })
}

/// Applies a validated reset, logged (who reset what is an operator's question later).
pub async fn reset(api: &Api, target: &ResetTarget) -> Result<Reset, ApiError> {
    let reset = api.store_call("reset", api.store.reset(target)).await?;
    tracing::info!(?target, reset, "bucket reset");
    Ok(Reset { reset })
}

/// `GET /v1/buckets?...`: admitted as an admin call (no body), decoded from the query, read.
pub async fn http_inspect(State(api): State<Arc<Api>>, req: Request) -> Response {
    let (parts, _) = req.into_parts();
    let result = match api.admit_admin(&parts.headers, Body::empty(), 0, 0).await {
        Ok((_, _permit)) => {
            let raw = query_object(parts.uri.query().unwrap_or_default())
                .and_then(|body| json::decode::<RawBucketRef>(&body))
                .and_then(validate_inspect)
                .map_err(|e| invalid("inspect", e));
            match raw {
                Ok(what) => inspect(&api, &what).await,
                Err(e) => Err(e),
            }
        }
        Err(e) => Err(e),
    };
    answer(&api, result)
}

/// `POST /v1/buckets/reset`: admitted as an admin call, its JSON body decoded, applied.
pub async fn http_reset(State(api): State<Arc<Api>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let result = match api.admit_admin(&parts.headers, body, BODY_BYTES, 0).await {
        Ok((bytes, _permit)) => {
            match json::decode::<RawBucketRef>(&bytes)
                .and_then(validate_reset)
                .map_err(|e| invalid("reset", e))
            {
                Ok(target) => reset(&api, &target).await,
                Err(e) => Err(e),
            }
        }
        Err(e) => Err(e),
    };
    answer(&api, result)
}

// ---------------------------------------------------------------------------------------------
// gRPC: `tollgate.admin.v1.Admin` (server/proto/tollgate/admin.proto)

/// A `BucketRef` as a [`RawBucketRef`] (zero values are "not sent", then refused by validation
/// with the field's name, as the query's absent fields are).
pub fn raw_from_pb(r: &admin_pb::BucketRef) -> Result<RawBucketRef, InvalidArgument> {
    let algorithm = match r.algorithm {
        0 => None,
        code => Some(Algorithm::from_code(code).ok_or_else(|| {
            InvalidArgument::new(fields::ALGORITHM, format!("unknown algorithm {code}"))
        })?),
    };
    let nonzero = |v: u64| (v != 0).then_some(v);
    Ok(RawBucketRef {
        kind: non_empty(&r.kind),
        bucket: RawBucket {
            key: Some(r.key.clone()),
            algorithm,
            capacity: nonzero(r.capacity),
            rate: nonzero(r.rate),
            period_ms: nonzero(r.period_ms),
            calendar: take::calendar_from_pb(r.calendar),
            time_zone: non_empty(&r.time_zone),
            ..RawBucket::default()
        },
    })
}

/// An inspection's answer in protobuf.
pub fn inspected_to_pb(i: &Inspected) -> admin_pb::InspectBucketResponse {
    match i {
        Inspected::Bucket(b) => {
            let p = b.period.clone();
            admin_pb::InspectBucketResponse {
                exists: b.exists,
                remaining: b.remaining,
                debt: b.debt,
                used: b.used,
                reset_ms: b.reset_ms,
                period_start_ms: p.as_ref().map_or(0, |p| p.start_ms),
                period_end_ms: p.as_ref().map_or(0, |p| p.end_ms),
                period_start: p.as_ref().map(|p| p.start.clone()).unwrap_or_default(),
                period_end: p.map(|p| p.end).unwrap_or_default(),
                ..Default::default()
            }
        }
        Inspected::Slots(s) => admin_pb::InspectBucketResponse {
            in_flight: s.in_flight,
            deadlines_ms: s.deadlines_ms.clone(),
            ..Default::default()
        },
    }
}

/// The tonic service of `tollgate.admin.v1.Admin`: reached only through
/// [`crate::router::router`], after [`Api::admit_admin`] (the admin token, bounded body, permit).
pub struct AdminService {
    api: Arc<Api>,
}

impl AdminService {
    /// Wraps the shared API.
    pub fn new(api: Arc<Api>) -> Self {
        AdminService { api }
    }

    /// One call's answer, counted under the `grpc` transport.
    fn counted<T>(&self, r: Result<T, ApiError>) -> Result<tonic::Response<T>, tonic::Status> {
        match r {
            Ok(a) => {
                self.api.metrics.request("grpc", "ok");
                Ok(tonic::Response::new(a))
            }
            Err(e) => {
                self.api.metrics.request("grpc", e.code());
                Err(status_of(&e))
            }
        }
    }
}

#[tonic::async_trait]
impl admin_pb::admin_server::Admin for AdminService {
    async fn inspect_bucket(
        &self,
        request: tonic::Request<admin_pb::BucketRef>,
    ) -> Result<tonic::Response<admin_pb::InspectBucketResponse>, tonic::Status> {
        let what = raw_from_pb(request.get_ref())
            .and_then(validate_inspect)
            .map_err(|e| invalid("inspect", e));
        let r = match what {
            Ok(w) => inspect(&self.api, &w).await.map(|i| inspected_to_pb(&i)),
            Err(e) => Err(e),
        };
        self.counted(r)
    }

    async fn reset_bucket(
        &self,
        request: tonic::Request<admin_pb::BucketRef>,
    ) -> Result<tonic::Response<admin_pb::ResetBucketResponse>, tonic::Status> {
        let target = raw_from_pb(request.get_ref())
            .and_then(validate_reset)
            .map_err(|e| invalid("reset", e));
        let r = match target {
            Ok(t) => reset(&self.api, &t)
                .await
                .map(|r| admin_pb::ResetBucketResponse { reset: r.reset }),
            Err(e) => Err(e),
        };
        self.counted(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(query: &str) -> Result<RawBucketRef, InvalidArgument> {
        query_object(query).and_then(|b| json::decode(&b))
    }

    #[test]
    fn a_query_names_the_bad_field() {
        let field = |q: &str| {
            raw(q)
                .and_then(validate_inspect)
                .err()
                .map(|e| e.field)
                .unwrap_or_default()
        };
        assert_eq!(field("key=a&capacity=x&period_ms=1"), "capacity");
        assert_eq!(field("key=a&period_ms=1"), "capacity");
        assert_eq!(field("capacity=1&period_ms=1"), "key");
        assert_eq!(field("key=a&capacity=1&period_ms=1&cost=2"), "cost");
        assert_eq!(field("key=a&key=b&capacity=1&period_ms=1"), "key");
        assert_eq!(field("key=a&kind=lease"), "kind");
        assert_eq!(field("key=a&kind=concurrency&capacity=1"), "capacity");
        assert_eq!(
            field("key=a&capacity=1&period_ms=1&algorithm=leaky"),
            "algorithm"
        );
    }

    #[test]
    fn a_query_reads_as_a_take_would() {
        let ok = raw("key=tenant%3Aa+b&capacity=5&period_ms=1000&algorithm=fixed_window")
            .and_then(validate_inspect);
        let Ok(Inspect::Bucket(b, _)) = ok else {
            unreachable!("{ok:?}")
        };
        assert_eq!(
            (b.key.as_str(), b.capacity, b.rate, b.period_ms),
            ("tenant:a b", 5, 5, 1000)
        );
        assert_eq!(
            raw("kind=concurrency&key=k").and_then(validate_inspect),
            Ok(Inspect::Slots("k".into()))
        );
    }

    #[test]
    fn a_reset_needs_no_limits() {
        let r = json::decode::<RawBucketRef>(br#"{"key":"k","algorithm":"sliding_window"}"#)
            .and_then(validate_reset);
        assert_eq!(
            r,
            Ok(ResetTarget::Bucket(
                crate::domain::Algorithm::SlidingWindow,
                "k".into()
            ))
        );
    }
}
