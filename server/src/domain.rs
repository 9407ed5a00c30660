//! The domain: what a take asks for, what it answers, and the one validation both transports share.
//!
//! Both wire forms (JSON in `api::http`, protobuf in `api::grpc`) decode into a [`RawTake`] and go
//! through [`validate`]; only a validated [`BucketSpec`] list ever reaches a store, so a bad request
//! can never write anything.

use std::fmt;

/// The contract's bounds and algorithms (contract/README.md), from the contract crate.
pub use contract::bounds::{
    BUCKET_OVERHEAD_BYTES, MAX_AMOUNT, MAX_BATCH_BYTES, MAX_BATCH_TAKES, MAX_BUCKETS,
    MAX_INSTANCE_BYTES, MAX_KEY_BYTES, MAX_PERIOD_MS, MAX_RULE_BYTES, MAX_SETTLE_ID_BYTES,
    MAX_TAKE_BYTES, SETTLE_ID_TTL_MS,
};
pub use contract::Algorithm;

/// One validated bucket of a take: every field is within the contract's bounds.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BucketSpec {
    /// Bucket identity, 1..=4096 bytes.
    pub key: String,
    /// Burst size, 1..=1e9.
    pub capacity: u64,
    /// Tokens added per period, 1..=1e9 (equal to capacity when the caller left it out).
    pub rate: u64,
    /// Period length in milliseconds, 1..=one year.
    pub period_ms: u64,
    /// Tokens this request takes, 1..=1e9. Above capacity it is denied, never an error.
    pub cost: u64,
    /// Counting scheme.
    pub algorithm: Algorithm,
    /// Lease mode: take up to this many tokens (cost..=1e9) when the request is allowed, as many as
    /// the bucket holds but never fewer than `cost`. Equal to `cost` when the caller left it out.
    pub lease: u64,
}

/// The answer for one bucket, for a take, and for a batch: the contract's messages, whose serde
/// forms are the JSON bodies (the protobuf ones are mapped in `api::grpc`).
pub use contract::take::{BatchResponse, BucketResult, TakeResponse};

/// The contract's slot bounds: longest deadline (one day), longest slot id, and what a denial
/// suggests waiting at most.
pub use contract::bounds::{MAX_SLOT_BYTES, MAX_SLOT_TTL_MS, SLOT_DENIED_RETRY_MS};

/// The answers to an acquire (per key, and in all) and to a release: the contract's, whose serde
/// forms are the JSON response bodies of `POST /v1/acquire` and `POST /v1/release`.
pub use contract::slots::{AcquireResponse, ReleaseResponse, SlotResult};

/// One validated key of an acquire (concurrency slots, contract/README.md "Acquire and release").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotSpec {
    /// The key, 1..=4096 bytes; distinct from the other keys of the acquire.
    pub key: String,
    /// Most slots held at once for this key, 1..=1e9.
    pub limit: u64,
    /// The slot's deadline from now, 1..=[`MAX_SLOT_TTL_MS`] ms.
    pub ttl_ms: u64,
}

/// The delay a denied slot key suggests: [`SLOT_DENIED_RETRY_MS`], or sooner when the oldest
/// slot's deadline (`earliest_left_ms` from now) is sooner.
pub fn slot_retry_after(earliest_left_ms: Option<u64>) -> u64 {
    earliest_left_ms.map_or(SLOT_DENIED_RETRY_MS, |ms| ms.clamp(1, SLOT_DENIED_RETRY_MS))
}

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
}

/// A take as decoded from either wire form.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawTake {
    /// `buckets`, absent when missing from JSON.
    pub buckets: Option<Vec<RawBucket>>,
    /// `instance`: the calling proxy's id, counted among the live instances; absent when not sent.
    pub instance: Option<String>,
}

/// A batch as decoded from either wire form: its takes, each as a single take decodes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawBatch {
    /// `takes`, absent when missing from JSON.
    pub takes: Option<Vec<RawTake>>,
    /// `instance`, as in a take.
    pub instance: Option<String>,
}

/// Checks an instance id: 1..=[`MAX_INSTANCE_BYTES`] bytes of `A-Z a-z 0-9 . _ : -`.
pub fn check_instance(field: &str, id: Option<&str>) -> Result<(), InvalidArgument> {
    let Some(id) = id else { return Ok(()) };
    if id.is_empty() || id.len() > MAX_INSTANCE_BYTES {
        return Err(InvalidArgument::new(
            field,
            format!("must be 1..={MAX_INSTANCE_BYTES} bytes, got {}", id.len()),
        ));
    }
    if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b".-_:".contains(&b))
    {
        return Err(InvalidArgument::new(
            field,
            "may hold only letters, digits, '.', '_', ':' and '-'",
        ));
    }
    Ok(())
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

/// A rejected request: which field, and why. Becomes 400 / `INVALID_ARGUMENT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidArgument {
    /// The offending field, e.g. `buckets[0].capacity` (empty when the body as a whole is bad).
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

impl InvalidArgument {
    /// A new error about `field`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        InvalidArgument {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for InvalidArgument {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.field, self.message)
        }
    }
}

impl std::error::Error for InvalidArgument {}

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

/// Checks a decoded take against the contract and applies its defaults.
///
/// The one validation function of the service: both transports call it, and stores only ever see
/// its output.
pub fn validate(raw: RawTake) -> Result<Vec<BucketSpec>, InvalidArgument> {
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
    buckets
        .into_iter()
        .enumerate()
        .map(|(i, b)| {
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
            Ok(BucketSpec {
                key,
                capacity,
                rate,
                period_ms,
                cost,
                algorithm: b.algorithm.unwrap_or(Algorithm::TokenBucket),
                lease,
            })
        })
        .collect()
}

/// Checks a decoded batch: 1..=[`MAX_BATCH_TAKES`] takes, each checked by [`validate`] exactly as
/// a single take. The first invalid take rejects the whole batch, its field named from the batch
/// (`takes[3].buckets[0].capacity`).
pub fn validate_batch(raw: RawBatch) -> Result<Vec<Vec<BucketSpec>>, InvalidArgument> {
    check_instance("instance", raw.instance.as_deref())?;
    let takes = raw
        .takes
        .ok_or_else(|| InvalidArgument::new("takes", "is required"))?;
    if takes.is_empty() {
        return Err(InvalidArgument::new("takes", "must hold at least 1 take"));
    }
    if takes.len() > MAX_BATCH_TAKES {
        return Err(InvalidArgument::new(
            "takes",
            format!(
                "must hold at most {MAX_BATCH_TAKES} takes, got {}",
                takes.len()
            ),
        ));
    }
    takes
        .into_iter()
        .enumerate()
        .map(|(i, t)| validate(t).map_err(|e| e.within_take(i)))
        .collect()
}

impl InvalidArgument {
    /// The same error about take `i` of a batch: `buckets[0].key` becomes
    /// `takes[i].buckets[0].key`, and an error about the take as a whole, `takes[i]`.
    pub fn within_take(self, i: usize) -> Self {
        let field = if self.field.is_empty() {
            format!("takes[{i}]")
        } else {
            format!("takes[{i}].{}", self.field)
        };
        InvalidArgument { field, ..self }
    }
}

/// A settle (`POST /v1/settle`, `Settle`) as decoded from either wire form.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawSettle {
    /// `id`: the settlement's id, applied at most once.
    pub id: Option<String>,
    /// `instance`, as in a take.
    pub instance: Option<String>,
    /// `buckets`, absent when missing from JSON.
    pub buckets: Option<Vec<RawSettleBucket>>,
}

/// One bucket of a settle as decoded: the bucket as a take names it, and the amounts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawSettleBucket {
    /// The bucket's fields as in a take (`cost` and `lease` are never set: a settle has none).
    pub bucket: RawBucket,
    /// `estimate`: the tokens the take charged at the request.
    pub estimate: Option<u64>,
    /// `used`: the tokens the response actually used.
    pub used: Option<u64>,
    /// `window`: the fixed window index the take charged, when the caller knows it.
    pub window: Option<u64>,
}

/// One validated bucket of a settle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettleSpec {
    /// The bucket, validated as a take's (`cost` and `lease` are 1 and mean nothing here).
    pub bucket: BucketSpec,
    /// Tokens charged at the request, 0..=1e9.
    pub estimate: u64,
    /// Tokens actually used, 0..=1e9.
    pub used: u64,
    /// Fixed windows only: the window the estimate was charged in, if known.
    pub window: Option<u64>,
}

/// A validated settle: its id and buckets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settlement {
    /// 1..=[`MAX_SETTLE_ID_BYTES`] printable ASCII characters (no space).
    pub id: String,
    /// 1..=[`MAX_BUCKETS`] buckets, settled in order.
    pub buckets: Vec<SettleSpec>,
}

/// The answers to a settle: the contract's.
pub use contract::settle::{SettleResponse, SettleResult};

/// Checks a decoded settle: the id, then every bucket as a take's (same fields, same bounds and
/// the same error names; a settle has no `cost` nor `lease`), then its amounts.
pub fn validate_settle(raw: RawSettle) -> Result<Settlement, InvalidArgument> {
    let id = raw
        .id
        .ok_or_else(|| InvalidArgument::new("id", "is required"))?;
    if id.is_empty() || id.len() > MAX_SETTLE_ID_BYTES {
        return Err(InvalidArgument::new(
            "id",
            format!("must be 1..={MAX_SETTLE_ID_BYTES} bytes, got {}", id.len()),
        ));
    }
    if !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(InvalidArgument::new(
            "id",
            "may hold only printable ASCII characters, no space",
        ));
    }
    let raws = raw
        .buckets
        .ok_or_else(|| InvalidArgument::new("buckets", "is required"))?;
    let mut amounts = Vec::with_capacity(raws.len());
    let mut takes = Vec::with_capacity(raws.len());
    for b in raws {
        amounts.push((b.estimate, b.used, b.window));
        takes.push(RawBucket {
            cost: None,
            lease: None,
            ..b.bucket
        });
    }
    let specs = validate(RawTake {
        buckets: Some(takes),
        instance: None,
    })?;
    let buckets = specs
        .into_iter()
        .zip(amounts)
        .enumerate()
        .map(|(i, (bucket, (estimate, used, window)))| {
            let f = |name: &str| format!("buckets[{i}].{name}");
            let amount = |name: &str, v: Option<u64>| match v {
                None => Err(InvalidArgument::new(f(name), "is required")),
                Some(v) if v > MAX_AMOUNT => Err(InvalidArgument::new(
                    f(name),
                    format!("must be at most {MAX_AMOUNT}, got {v}"),
                )),
                Some(v) => Ok(v),
            };
            let estimate = amount("estimate", estimate)?;
            let used = amount("used", used)?;
            if window.is_some() && bucket.algorithm == Algorithm::TokenBucket {
                return Err(InvalidArgument::new(
                    f("window"),
                    "applies to fixed_window and sliding_window only",
                ));
            }
            Ok(SettleSpec {
                bucket,
                estimate,
                used,
                window,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Settlement { id, buckets })
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn batch_errors_name_the_take() {
        let take = |b: Vec<RawBucket>| RawTake {
            buckets: Some(b),
            instance: None,
        };
        let batch = |t: Vec<RawTake>| {
            validate_batch(RawBatch {
                takes: Some(t),
                instance: None,
            })
        };
        assert_eq!(
            validate_batch(RawBatch::default()).err().map(|e| e.field),
            Some("takes".into())
        );
        assert_eq!(batch(vec![]).err().map(|e| e.field), Some("takes".into()));
        let ok = take(vec![raw("a")]);
        assert_eq!(
            batch(vec![ok.clone(); 65]).err().map(|e| e.field),
            Some("takes".into())
        );
        assert_eq!(batch(vec![ok.clone(); 64]).map(|v| v.len()), Ok(64));
        let mut bad = raw("a");
        bad.capacity = Some(0);
        let e = batch(vec![ok.clone(), ok.clone(), ok.clone(), take(vec![bad])]).err();
        assert_eq!(
            e.map(|e| e.field),
            Some("takes[3].buckets[0].capacity".into())
        );
        let e = batch(vec![ok, RawTake::default()]).err();
        assert_eq!(e.map(|e| e.field), Some("takes[1].buckets".into()));
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
        };
        assert!(validate(RawTake {
            buckets: Some(vec![b; 16]),
            instance: Some("i".repeat(MAX_INSTANCE_BYTES)),
        })
        .is_ok());
    }
}
