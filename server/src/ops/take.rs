//! `take`: may this request pass? `POST /v1/take` (JSON) and `tollgate.v1.RateLimiter/Take`
//! (gRPC): 1..=16 buckets, all charged or none (contract/README.md). This module owns the take's
//! raw form, its one validation ([`validate`], which batches, refunds, settles and RLS reuse),
//! both decodings, both answer encodings and the handler.

use prost::Message;
use serde::de::MapAccess;
use serde::Serialize;
use serde_json::Value;

use contract::calendar::Unit;
use contract::fields;

use super::{invalid, GrpcOperation, Operation};
use crate::api::grpc::{
    algorithm_from_pb, malformed, non_empty_owned, pb, scan_field_one, DecodeStrict,
};
use crate::api::json::{self, Field, Object};
use crate::api::{Api, ApiError};
use crate::domain::{
    check_instance, Algorithm, BucketResult, BucketSpec, InvalidArgument, TakeResponse, MAX_AMOUNT,
    MAX_BUCKETS, MAX_DELAY_MS, MAX_KEY_BYTES, MAX_PERIOD_MS, MAX_RULE_BYTES, MAX_TAKE_BYTES,
};

/// A bucket as decoded from either wire form, before validation. `None` means "absent".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawBucket {
    /// `key`, absent when missing from JSON (protobuf cannot tell absent from empty).
    pub key: Option<String>,
    /// `capacity`.
    pub capacity: Option<u64>,
    /// `rate`; absent means equal to capacity.
    pub rate: Option<u64>,
    /// `period_ms`.
    pub period_ms: Option<u64>,
    /// `cost`; absent means 1.
    pub cost: Option<u64>,
    /// `algorithm`; absent means token bucket.
    pub algorithm: Option<Algorithm>,
    /// `lease`; absent means exactly `cost`.
    pub lease: Option<u64>,
    /// `rule`: the name of the rule the bucket belongs to, for metrics only; absent when not sent.
    pub rule: Option<String>,
    /// `max_delay_ms`: shaping (token buckets only); absent means 0, none.
    pub max_delay_ms: Option<u64>,
    /// `calendar`: a calendar window's unit, by name (required with, and only with, algorithm
    /// `calendar_window`).
    pub calendar: Option<String>,
    /// `time_zone`: a calendar window's zone; absent means UTC.
    pub time_zone: Option<String>,
}

/// A take as decoded from either wire form.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawTake {
    /// `buckets`, absent when missing from JSON.
    pub buckets: Option<Vec<RawBucket>>,
    /// `instance`: the calling proxy's id, counted among the live instances; absent when not sent.
    pub instance: Option<String>,
}

fn check_rule(field: impl FnOnce() -> String, rule: Option<&str>) -> Result<(), InvalidArgument> {
    let Some(r) = rule else { return Ok(()) };
    if r.is_empty() || r.len() > MAX_RULE_BYTES {
        return Err(InvalidArgument::new(
            field(),
            format!("must be 1..={MAX_RULE_BYTES} bytes, got {}", r.len()),
        ));
    }
    if r.chars().any(char::is_control) {
        return Err(InvalidArgument::new(
            field(),
            "must not hold control characters",
        ));
    }
    Ok(())
}

/// `field` names the value; it is only formatted when the value is rejected (a valid take
/// allocates no field names).
fn bounded(
    field: impl FnOnce() -> String,
    value: Option<u64>,
    max: u64,
) -> Result<u64, InvalidArgument> {
    match value {
        None => Err(InvalidArgument::new(field(), "is required")),
        Some(0) => Err(InvalidArgument::new(field(), "must be at least 1")),
        Some(v) if v > max => Err(InvalidArgument::new(
            field(),
            format!("must be at most {max}, got {v}"),
        )),
        Some(v) => Ok(v),
    }
}

/// A validated take: its buckets, and what its answer and metrics need of the rest.
#[derive(Debug)]
pub struct Validated {
    /// The buckets, defaults applied.
    pub specs: Vec<BucketSpec>,
    /// The caller's instance id, when sent.
    pub instance: Option<String>,
    /// Each bucket's rule name, when sent (for the `rule` label).
    pub rules: Vec<Option<String>>,
}

/// Checks a decoded take against the contract and applies its defaults.
///
/// The one validation function of the service: both transports call it, and stores only ever see
/// its output.
pub fn validate(raw: RawTake) -> Result<Vec<BucketSpec>, InvalidArgument> {
    validate_take(raw).map(|v| v.specs)
}

/// [`validate`], keeping the instance id and the rule names (moved, not copied).
pub fn validate_take(raw: RawTake) -> Result<Validated, InvalidArgument> {
    check_instance("instance", raw.instance.as_deref())?;
    let buckets = raw
        .buckets
        .ok_or_else(|| InvalidArgument::new("buckets", "is required"))?;
    if buckets.is_empty() {
        return Err(InvalidArgument::new(
            "buckets",
            "must hold at least 1 bucket",
        ));
    }
    if buckets.len() > MAX_BUCKETS {
        return Err(InvalidArgument::new(
            "buckets",
            format!(
                "must hold at most {MAX_BUCKETS} buckets, got {}",
                buckets.len()
            ),
        ));
    }
    let mut specs = Vec::with_capacity(buckets.len());
    let mut rules = Vec::with_capacity(buckets.len());
    for (i, b) in buckets.into_iter().enumerate() {
        let (spec, rule) = validate_bucket(i, b)?;
        specs.push(spec);
        rules.push(rule);
    }
    Ok(Validated {
        specs,
        instance: raw.instance,
        rules,
    })
}

/// Bucket `i` of a take, checked, with its defaults applied, and its rule name.
fn validate_bucket(
    i: usize,
    b: RawBucket,
) -> Result<(BucketSpec, Option<String>), InvalidArgument> {
    let f = |name: &str| format!("buckets[{i}].{name}");
    check_rule(|| f("rule"), b.rule.as_deref())?;
    let key = b
        .key
        .ok_or_else(|| InvalidArgument::new(f("key"), "is required"))?;
    if key.is_empty() {
        return Err(InvalidArgument::new(f("key"), "must not be empty"));
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(InvalidArgument::new(
            f("key"),
            format!("must be at most {MAX_KEY_BYTES} bytes, got {}", key.len()),
        ));
    }
    let capacity = bounded(|| f("capacity"), b.capacity, MAX_AMOUNT)?;
    let rate = bounded(|| f("rate"), Some(b.rate.unwrap_or(capacity)), MAX_AMOUNT)?;
    let period_ms = bounded(|| f("period_ms"), b.period_ms, MAX_PERIOD_MS)?;
    let cost = bounded(|| f("cost"), Some(b.cost.unwrap_or(1)), MAX_AMOUNT)?;
    let lease = bounded(|| f("lease"), Some(b.lease.unwrap_or(cost)), MAX_AMOUNT)?;
    if lease < cost {
        return Err(InvalidArgument::new(
            f("lease"),
            format!("must be at least cost ({cost}), got {lease}"),
        ));
    }
    let algorithm = b.algorithm.unwrap_or(Algorithm::TokenBucket);
    let max_delay_ms = b.max_delay_ms.unwrap_or(0);
    if max_delay_ms > MAX_DELAY_MS {
        return Err(InvalidArgument::new(
            f("max_delay_ms"),
            format!("must be at most {MAX_DELAY_MS}, got {max_delay_ms}"),
        ));
    }
    if max_delay_ms > 0 && algorithm != Algorithm::TokenBucket {
        return Err(InvalidArgument::new(
            f("max_delay_ms"),
            format!(
                "shaping is for token_bucket only, not {} (a window cannot grant tokens of a \
                 window to come): leave it out or 0",
                algorithm.name()
            ),
        ));
    }
    let mut spec = BucketSpec {
        key,
        capacity,
        rate,
        period_ms,
        cost,
        algorithm,
        lease,
        max_delay_ms,
    };
    calendar_span(&mut spec, b.calendar, b.time_zone, &f)?;
    Ok((spec, b.rule))
}

/// A calendar window's span (the service's clock now), carried in the spec's `rate` and
/// `period_ms` ([`contract::calendar::Span::pack`]): `calendar` is required with algorithm
/// `calendar_window` and refused with any other, as is `time_zone` (UTC when absent).
pub(super) fn calendar_span(
    spec: &mut BucketSpec,
    calendar: Option<String>,
    time_zone: Option<String>,
    f: &dyn Fn(&str) -> String,
) -> Result<(), InvalidArgument> {
    let window = spec.algorithm == Algorithm::CalendarWindow;
    let unit = match (window, calendar) {
        (false, None) if time_zone.is_none() => return Ok(()),
        (false, None) => {
            return Err(InvalidArgument::new(
                f(fields::TIME_ZONE),
                "only with a calendar (algorithm calendar_window)",
            ))
        }
        (false, Some(_)) => {
            return Err(InvalidArgument::new(
                f(fields::CALENDAR),
                format!(
                    "only with algorithm calendar_window, not {}",
                    spec.algorithm.name()
                ),
            ))
        }
        (true, None) => {
            return Err(InvalidArgument::new(
                f(fields::CALENDAR),
                "is required with algorithm calendar_window",
            ))
        }
        (true, Some(u)) => Unit::from_name(&u).ok_or_else(|| {
            InvalidArgument::new(
                f(fields::CALENDAR),
                format!("must be \"day\", \"week\", \"month\" or \"year\", got {u:?}"),
            )
        })?,
    };
    let zone = time_zone.unwrap_or_else(|| contract::calendar::UTC.to_string());
    let span = crate::calendar::span(unit, &zone, now_ms())
        .map_err(|why| InvalidArgument::new(f(fields::TIME_ZONE), why))?;
    (spec.rate, spec.period_ms) = span.pack();
    Ok(())
}

/// The service's clock, in ms since the epoch (a calendar span's; the store counts by its own).
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

// ---------------------------------------------------------------------------------------------
// JSON

impl Object for RawBucket {
    const FIELDS: &'static [&'static str] = &fields::TAKE_BUCKET;

    fn read<'de, A: MapAccess<'de>>(
        &mut self,
        name: &'static str,
        v: Field<'_, '_, A>,
    ) -> Result<(), A::Error> {
        match name {
            fields::KEY => self.key = v.string()?,
            fields::CAPACITY => self.capacity = v.uint()?,
            fields::RATE => self.rate = v.uint()?,
            fields::PERIOD_MS => self.period_ms = v.uint()?,
            fields::COST => self.cost = v.uint()?,
            fields::ALGORITHM => self.algorithm = v.algorithm()?,
            fields::LEASE => self.lease = v.uint()?,
            fields::RULE => self.rule = v.string()?,
            fields::MAX_DELAY_MS => self.max_delay_ms = v.uint()?,
            fields::CALENDAR => self.calendar = v.string()?,
            fields::TIME_ZONE => self.time_zone = v.string()?,
            // FIELDS holds no other name.
            _ => {}
        }
        Ok(())
    }
}

impl Object for RawTake {
    const FIELDS: &'static [&'static str] = &fields::TAKE;

    fn read<'de, A: MapAccess<'de>>(
        &mut self,
        name: &'static str,
        v: Field<'_, '_, A>,
    ) -> Result<(), A::Error> {
        match name {
            // A 17th bucket stops the decoding before it is read.
            fields::BUCKETS => self.buckets = v.objects(Some(MAX_BUCKETS))?,
            fields::INSTANCE => self.instance = v.string()?,
            _ => {}
        }
        Ok(())
    }
}

/// Decodes a `POST /v1/take` body (the strict reader, [`crate::api::json`]): in memory bounded by
/// the input, decoding stops at the 17th bucket.
pub fn decode_json(body: &[u8]) -> Result<RawTake, InvalidArgument> {
    json::decode(body)
}

/// A request bucket as JSON (absent fields omitted).
#[derive(Debug, Serialize)]
struct JsonBucket<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    key: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    capacity: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rate: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    period_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cost: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    algorithm: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lease: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rule: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_delay_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    calendar: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    time_zone: Option<&'a str>,
}

/// Encodes a request (used by tests and the load generator).
pub fn encode_json(raw: &RawTake) -> Value {
    let buckets: Vec<JsonBucket<'_>> = raw
        .buckets
        .iter()
        .flatten()
        .map(|b| JsonBucket {
            key: b.key.as_deref(),
            capacity: b.capacity,
            rate: b.rate,
            period_ms: b.period_ms,
            cost: b.cost,
            algorithm: b.algorithm.map(Algorithm::name),
            lease: b.lease,
            rule: b.rule.as_deref(),
            max_delay_ms: b.max_delay_ms,
            calendar: b.calendar.as_deref(),
            time_zone: b.time_zone.as_deref(),
        })
        .collect();
    let mut v = serde_json::json!({ "buckets": buckets });
    if let (Some(id), Some(o)) = (&raw.instance, v.as_object_mut()) {
        o.insert("instance".into(), Value::from(id.as_str()));
    }
    v
}

// ---------------------------------------------------------------------------------------------
// Protobuf

/// Checks a `TakeRequest`'s bucket count without building it: a 17th bucket stops the walk.
pub(super) fn scan_take(bytes: &[u8]) -> Result<(), InvalidArgument> {
    scan_field_one(
        bytes,
        MAX_BUCKETS,
        || {
            InvalidArgument::new(
                "buckets",
                format!("must hold at most {MAX_BUCKETS} buckets (decoding stopped at the 17th)"),
            )
        },
        |_, _| Ok(()),
    )
}

/// Decodes a `TakeRequest` message (protobuf bytes, without gRPC's 5-byte frame header): a pure
/// function over the bytes. The top-level fields are scanned first, in constant memory, and a
/// 17th bucket stops the decoding there; only then does prost build the message (at most 16
/// buckets, each no larger than the input).
pub fn decode_message(bytes: &[u8]) -> Result<pb::TakeRequest, InvalidArgument> {
    scan_take(bytes)?;
    pb::TakeRequest::decode(bytes).map_err(|e| malformed(&e))
}

/// Decodes a `TakeRequest` message into a [`RawTake`]: [`decode_message`], then [`raw_from_pb`].
pub fn decode_pb(bytes: &[u8]) -> Result<RawTake, InvalidArgument> {
    decode_message(bytes).and_then(raw_from_pb)
}

/// Converts a decoded protobuf request. Protobuf cannot tell an absent scalar from zero; zero
/// values are passed on and rejected by validation with the field's name.
pub fn raw_from_pb(req: pb::TakeRequest) -> Result<RawTake, InvalidArgument> {
    let mut buckets = Vec::with_capacity(req.buckets.len());
    for (i, b) in req.buckets.into_iter().enumerate() {
        let algorithm = algorithm_from_pb(i, b.algorithm)?;
        buckets.push(RawBucket {
            key: Some(b.key),
            capacity: Some(b.capacity),
            rate: b.rate,
            period_ms: Some(b.period_ms),
            cost: b.cost,
            algorithm: Some(algorithm),
            lease: b.lease,
            rule: non_empty_owned(b.rule),
            max_delay_ms: Some(b.max_delay_ms),
            calendar: calendar_from_pb(b.calendar),
            time_zone: non_empty_owned(b.time_zone),
        });
    }
    Ok(RawTake {
        buckets: Some(buckets),
        instance: non_empty_owned(req.instance),
    })
}

/// A `tollgate.v1.CalendarUnit` as its name (0: none; an unknown code by its number, which
/// validation refuses).
pub(super) fn calendar_from_pb(code: i32) -> Option<String> {
    match u64::try_from(code) {
        Ok(0) => None,
        Ok(c) => Some(Unit::from_code(c).map_or_else(|| c.to_string(), |u| u.name().to_string())),
        Err(_) => Some(code.to_string()),
    }
}

/// A calendar unit's name as its `tollgate.v1.CalendarUnit` (0: none or not a unit).
pub(super) fn calendar_to_pb(name: Option<&str>) -> i32 {
    name.and_then(Unit::from_name)
        .map_or(0, |u| i32::try_from(u.code()).unwrap_or(0))
}

/// Encodes a request as protobuf (tests and the load generator).
pub fn pb_from_raw(raw: &RawTake) -> pb::TakeRequest {
    pb::TakeRequest {
        buckets: raw
            .buckets
            .iter()
            .flatten()
            .map(|b| pb::Bucket {
                key: b.key.clone().unwrap_or_default(),
                capacity: b.capacity.unwrap_or(0),
                rate: b.rate,
                period_ms: b.period_ms.unwrap_or(0),
                cost: b.cost,
                algorithm: b.algorithm.unwrap_or_default().code(),
                lease: b.lease,
                rule: b.rule.clone().unwrap_or_default(),
                max_delay_ms: b.max_delay_ms.unwrap_or(0),
                calendar: calendar_to_pb(b.calendar.as_deref()),
                time_zone: b.time_zone.clone().unwrap_or_default(),
            })
            .collect(),
        instance: raw.instance.clone().unwrap_or_default(),
    }
}

/// Encodes a decision as protobuf.
pub fn pb_from_answer(d: &TakeResponse) -> pb::TakeResponse {
    pb::TakeResponse {
        allowed: d.allowed,
        buckets: d
            .buckets
            .iter()
            .map(|b| pb::BucketResult {
                allowed: b.allowed,
                limit: b.limit,
                remaining: b.remaining,
                reset_ms: b.reset_ms,
                retry_after_ms: b.retry_after_ms,
                granted: b.granted,
                delay_ms: b.delay_ms,
                window: b.window,
            })
            .collect(),
        instances: d.instances,
        delay_ms: d.delay_ms,
    }
}

/// Decodes a protobuf decision.
pub fn answer_from_pb(r: &pb::TakeResponse) -> TakeResponse {
    TakeResponse {
        allowed: r.allowed,
        buckets: r
            .buckets
            .iter()
            .map(|b| BucketResult {
                allowed: b.allowed,
                limit: b.limit,
                remaining: b.remaining,
                reset_ms: b.reset_ms,
                retry_after_ms: b.retry_after_ms,
                granted: b.granted,
                delay_ms: b.delay_ms,
                window: b.window,
            })
            .collect(),
        instances: r.instances,
        delay_ms: r.delay_ms,
    }
}

impl DecodeStrict for pb::TakeRequest {
    fn decode_strict(bytes: &[u8]) -> Result<Self, InvalidArgument> {
        decode_message(bytes)
    }
}

// ---------------------------------------------------------------------------------------------
// The handler

/// The take operation.
pub struct Take;

impl Operation for Take {
    type Raw = RawTake;
    type Answer = TakeResponse;
    const BODY_BYTES: usize = MAX_TAKE_BYTES;
    const SPAN: Option<&'static str> = Some("tollgate.take");

    /// Validates and decides one admitted take.
    async fn handle(
        api: &Api,
        raw: Result<RawTake, InvalidArgument>,
    ) -> Result<TakeResponse, ApiError> {
        let v = raw
            .and_then(validate_take)
            .map_err(|e| invalid("take", e))?;
        let mut d = take_specs(api, &v.specs).await?;
        api.metrics.decision(d.allowed, d.delay_ms);
        crate::trace::note(|| crate::trace::decision(d.allowed, &v.rules));
        count_rules(api, &d, &v.rules);
        d.instances = api.instances(v.instance.as_deref());
        Ok(d)
    }
}

impl GrpcOperation for Take {
    type Request = pb::TakeRequest;
    type Response = pb::TakeResponse;

    fn from_pb(req: pb::TakeRequest) -> Result<RawTake, InvalidArgument> {
        raw_from_pb(req)
    }

    fn to_pb(answer: &TakeResponse) -> pb::TakeResponse {
        pb_from_answer(answer)
    }
}

/// Decides validated buckets: one store call, timed, its failure counted (the caller counts
/// the decision). The RLS endpoint calls it (through [`super::Decide`]) with the buckets it built
/// itself, which may be more than a take on the wire holds.
pub async fn take_specs(api: &Api, specs: &[BucketSpec]) -> Result<TakeResponse, ApiError> {
    api.store_call("take", api.store.take(specs)).await
}

/// Counts a decision per rule named in its take.
pub(super) fn count_rules(api: &Api, d: &TakeResponse, rules: &[Option<String>]) {
    if rules.iter().all(Option::is_none) {
        return;
    }
    api.metrics.rule_decisions(
        d.allowed,
        rules
            .iter()
            .zip(&d.buckets)
            .map(|(r, b)| (r.as_deref(), b.allowed)),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::MAX_INSTANCE_BYTES;

    fn raw(key: &str) -> RawBucket {
        RawBucket {
            key: Some(key.to_string()),
            capacity: Some(10),
            rate: None,
            period_ms: Some(1000),
            cost: None,
            algorithm: None,
            lease: None,
            rule: None,
            max_delay_ms: None,
            calendar: None,
            time_zone: None,
        }
    }

    fn err(buckets: Vec<RawBucket>) -> InvalidArgument {
        match validate(RawTake {
            buckets: Some(buckets),
            instance: None,
        }) {
            Err(e) => e,
            Ok(v) => unreachable!("expected an error, got {v:?}"),
        }
    }

    #[test]
    fn defaults_apply() {
        let specs = validate(RawTake {
            buckets: Some(vec![raw("k")]),
            instance: None,
        })
        .unwrap_or_default();
        assert_eq!(
            specs,
            vec![BucketSpec {
                key: "k".into(),
                capacity: 10,
                rate: 10,
                period_ms: 1000,
                cost: 1,
                algorithm: Algorithm::TokenBucket,
                lease: 1,
                max_delay_ms: 0,
            }]
        );
    }

    #[test]
    fn names_the_field() {
        assert_eq!(err(vec![]).field, "buckets");
        assert_eq!(err(vec![raw("a"); 17]).field, "buckets");
        let mut b = raw("a");
        b.capacity = Some(0);
        assert_eq!(err(vec![raw("x"), b]).field, "buckets[1].capacity");
        let mut b = raw("a");
        b.rate = Some(MAX_AMOUNT + 1);
        assert_eq!(err(vec![b]).field, "buckets[0].rate");
        let mut b = raw("a");
        b.period_ms = None;
        assert_eq!(err(vec![b]).field, "buckets[0].period_ms");
        let mut b = raw("a");
        b.period_ms = Some(MAX_PERIOD_MS + 1);
        assert_eq!(err(vec![b]).field, "buckets[0].period_ms");
        let mut b = raw("a");
        b.cost = Some(0);
        assert_eq!(err(vec![b]).field, "buckets[0].cost");
        let mut b = raw("a");
        b.cost = Some(3);
        b.lease = Some(2);
        assert_eq!(err(vec![b]).field, "buckets[0].lease");
        let mut b = raw("a");
        b.lease = Some(MAX_AMOUNT + 1);
        assert_eq!(err(vec![b]).field, "buckets[0].lease");
        assert_eq!(err(vec![raw("")]).field, "buckets[0].key");
        assert_eq!(err(vec![raw(&"k".repeat(4097))]).field, "buckets[0].key");
        let mut b = raw("a");
        b.key = None;
        assert_eq!(err(vec![b]).field, "buckets[0].key");
        assert!(validate(RawTake::default()).is_err());
        let mut b = raw("a");
        b.rule = Some(String::new());
        assert_eq!(err(vec![b]).field, "buckets[0].rule");
        let mut b = raw("a");
        b.rule = Some("r".repeat(65));
        assert_eq!(err(vec![b]).field, "buckets[0].rule");
        let bad_instance = |id: &str| {
            validate(RawTake {
                buckets: Some(vec![raw("a")]),
                instance: Some(id.into()),
            })
            .err()
            .map(|e| e.field)
        };
        assert_eq!(bad_instance("a b"), Some("instance".into()));
        assert_eq!(bad_instance(""), Some("instance".into()));
        assert_eq!(bad_instance(&"i".repeat(65)), Some("instance".into()));
        assert_eq!(bad_instance("envoy-3:9f2c.a_b"), None);
    }

    #[test]
    fn accepts_the_bounds() {
        let b = RawBucket {
            key: Some("k".repeat(4096)),
            capacity: Some(MAX_AMOUNT),
            rate: Some(MAX_AMOUNT),
            period_ms: Some(MAX_PERIOD_MS),
            cost: Some(MAX_AMOUNT),
            algorithm: Some(Algorithm::FixedWindow),
            lease: Some(MAX_AMOUNT),
            rule: Some("r".repeat(MAX_RULE_BYTES)),
            max_delay_ms: None,
            calendar: None,
            time_zone: None,
        };
        assert!(validate(RawTake {
            buckets: Some(vec![b; 16]),
            instance: Some("i".repeat(MAX_INSTANCE_BYTES)),
        })
        .is_ok());
    }

    fn field_of(body: &str) -> String {
        match decode_json(body.as_bytes()).and_then(validate) {
            Err(e) => e.field,
            Ok(v) => unreachable!("accepted {body}: {v:?}"),
        }
    }

    #[test]
    fn reads_what_the_contract_allows() {
        let ok = |body: &str| match decode_json(body.as_bytes()) {
            Ok(raw) => raw,
            Err(e) => unreachable!("refused {body}: {e}"),
        };
        let raw = ok(
            r#"{"buckets":[{"key":"a\u00e9\"","capacity":10,"rate":5,"period_ms":1000,"cost":2,"algorithm":"fixed_window","lease":3,"rule":"api"}],"instance":"i-1"}"#,
        );
        assert_eq!(
            raw.buckets,
            Some(vec![RawBucket {
                key: Some("a\u{e9}\"".into()),
                capacity: Some(10),
                rate: Some(5),
                period_ms: Some(1000),
                cost: Some(2),
                algorithm: Some(Algorithm::FixedWindow),
                lease: Some(3),
                rule: Some("api".into()),
                max_delay_ms: None,
                calendar: None,
                time_zone: None,
            }])
        );
        assert_eq!(raw.instance.as_deref(), Some("i-1"));
        assert_eq!(ok(r#" {"buckets": null} "#).buckets, None);
        assert_eq!(ok("{}").buckets, None);
        assert_eq!(ok(r#"{"buckets":[]}"#).buckets, Some(vec![]));
        assert_eq!(
            ok(r#"{"buckets":[{"key":null,"capacity":null,"rate":null}]}"#).buckets,
            Some(vec![RawBucket::default()])
        );
        let last = ok(r#"{"buckets":[{"key":"a","capacity":1,"capacity":2,"period_ms":1}]}"#);
        assert_eq!(last.buckets.unwrap_or_default()[0].capacity, Some(2));
        let sixteen = format!(r#"{{"buckets":[{}]}}"#, vec!["{}"; 16].join(","));
        assert_eq!(ok(&sixteen).buckets.map(|b| b.len()), Some(16));
    }

    #[test]
    fn stops_at_the_seventeenth_bucket() {
        // The rest of the body is never read: even garbage after the 17th `{` is not reached.
        let body = format!(r#"{{"buckets":[{},{{"#, vec!["{}"; 16].join(","));
        let e = decode_json(body.as_bytes()).err();
        assert_eq!(
            e.as_ref().map(|e| e.field.as_str()),
            Some("buckets"),
            "{e:?}"
        );
        assert!(e.is_some_and(|e| e.message.contains("at most 16")));
    }

    #[test]
    fn errors_name_the_field() {
        assert_eq!(field_of("{"), "");
        assert_eq!(field_of("[]"), "");
        assert_eq!(field_of(r#"{"bucket": []}"#), "bucket");
        assert_eq!(field_of(r#"{"buckets": 1}"#), "buckets");
        assert_eq!(field_of(r#"{}"#), "buckets");
        assert_eq!(
            field_of(r#"{"buckets": [{"key":"a","capacity":1,"period_ms":1,"extra":1}]}"#),
            "buckets[0].extra"
        );
        assert_eq!(
            field_of(r#"{"buckets": [{"key":"a","capacity":-1,"period_ms":1}]}"#),
            "buckets[0].capacity"
        );
        assert_eq!(
            field_of(r#"{"buckets": [{"key":"a","capacity":1.5,"period_ms":1}]}"#),
            "buckets[0].capacity"
        );
        assert_eq!(
            field_of(r#"{"buckets": [{"key":"a","capacity":1,"period_ms":1,"algorithm":"gcra"}]}"#),
            "buckets[0].algorithm"
        );
        assert_eq!(
            field_of(r#"{"buckets": [{"key":5,"capacity":1,"period_ms":1}]}"#),
            "buckets[0].key"
        );
        assert_eq!(
            field_of(r#"{"buckets": [{"key":"a","capacity":1,"period_ms":1}, 3]}"#),
            "buckets[1]"
        );
        assert_eq!(field_of(r#"{"buckets":[["a",1,1]]}"#), "buckets[0]");
        assert_eq!(
            field_of(r#"{"buckets":[{"key":"a","capacity":"x","capacity":2,"period_ms":1}]}"#),
            "buckets[0].capacity"
        );
        assert_eq!(
            field_of(r#"{"buckets":[{"key":"a","capacity":1,"period_ms":1}]} x"#),
            ""
        );
        assert_eq!(field_of(r#"{"buckets":[{"key":"a\q"}]}"#), "");
    }

    #[test]
    fn decoding_stops_at_the_seventeenth_bucket() {
        // `0a 00`: field 1 (buckets), length 0: an empty bucket.
        let sixteen = [0x0a, 0x00].repeat(16);
        assert_eq!(
            decode_pb(&sixteen).map(|r| r.buckets.map(|b| b.len())),
            Ok(Some(16))
        );
        // Two million of them: refused at the 17th, whatever follows.
        let mut huge = [0x0a, 0x00].repeat(2_000_000);
        huge.extend_from_slice(&[0xff; 3]);
        let e = decode_pb(&huge).err();
        assert_eq!(
            e.as_ref().map(|e| e.field.as_str()),
            Some("buckets"),
            "{e:?}"
        );
        // Other fields do not count: unknown ones are skipped as prost would.
        let mut other = [0x18, 0x05].repeat(40);
        other.extend_from_slice(&[0x0a, 0x00]);
        assert_eq!(
            decode_pb(&other).map(|r| r.buckets.map(|b| b.len())),
            Ok(Some(1))
        );
    }

    #[test]
    fn malformed_bytes_are_invalid_arguments() {
        for bytes in [
            &[0x0a][..],               // a tag and no length
            &[0x0a, 0x05, 0x00],       // a length past the end
            &[0x0b, 0x0c],             // a group
            &[0xff; 11],               // a varint that never ends
            &[0x0a, 0x02, 0x08, 0xff], // a bucket whose field is cut
        ] {
            let e = decode_pb(bytes).err();
            assert!(
                e.as_ref()
                    .is_some_and(|e| e.message.starts_with("malformed protobuf")),
                "{bytes:02x?}: {e:?}"
            );
        }
    }
}
