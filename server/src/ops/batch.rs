//! `take_batch`: many takes in one request, each decided exactly as a take alone (atomic within
//! itself, independent of the others). `POST /v1/take_batch` and `tollgate.v1.RateLimiter/
//! TakeBatch`: 1..=64 takes, admitted like one take (one permit) with the batch's body bound,
//! then one store call for all of them.

use prost::Message;
use serde::de::MapAccess;
use serde_json::Value;

use contract::fields;

use super::take::{self, count_rules, scan_take, RawTake};
use super::{invalid, GrpcOperation, Operation};
use crate::api::grpc::{malformed, non_empty_owned, pb, scan_field_one, DecodeStrict};
use crate::api::json::{self, Field, Object};
use crate::api::{Api, ApiError};
use crate::domain::{
    check_instance, BatchResponse, BucketSpec, InvalidArgument, TakeResponse, MAX_BATCH_BYTES,
    MAX_BATCH_TAKES,
};

/// A batch as decoded from either wire form: its takes, each as a single take decodes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawBatch {
    /// `takes`, absent when missing from JSON.
    pub takes: Option<Vec<RawTake>>,
    /// `instance`, as in a take.
    pub instance: Option<String>,
}

/// A validated batch: its takes' buckets, and what its answer and metrics need of the rest.
#[derive(Debug)]
pub struct ValidatedBatch {
    /// Each take's buckets, defaults applied.
    pub takes: Vec<Vec<BucketSpec>>,
    /// Each take's rule names ([`take::Validated::rules`]).
    pub rules: Vec<Vec<Option<String>>>,
    /// The caller's instance id, when sent.
    pub instance: Option<String>,
}

/// Checks a decoded batch: 1..=[`MAX_BATCH_TAKES`] takes, each checked by [`take::validate_take`]
/// exactly as a single take. The first invalid take rejects the whole batch, its field named from
/// the batch (`takes[3].buckets[0].capacity`). The instance id and the rule names are moved into
/// the result, not copied.
pub fn validate(raw: RawBatch) -> Result<ValidatedBatch, InvalidArgument> {
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
    let mut out = ValidatedBatch {
        takes: Vec::with_capacity(takes.len()),
        rules: Vec::with_capacity(takes.len()),
        instance: raw.instance,
    };
    for (i, t) in takes.into_iter().enumerate() {
        let v = take::validate_take(t).map_err(|e| e.within_take(i))?;
        out.takes.push(v.specs);
        out.rules.push(v.rules);
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// JSON

impl Object for RawBatch {
    const FIELDS: &'static [&'static str] = &fields::BATCH;

    fn read<'de, A: MapAccess<'de>>(
        &mut self,
        name: &'static str,
        v: Field<'_, '_, A>,
    ) -> Result<(), A::Error> {
        match name {
            // A 65th take stops the decoding before it is read.
            fields::TAKES => self.takes = v.objects(Some(MAX_BATCH_TAKES))?,
            fields::INSTANCE => self.instance = v.string()?,
            // FIELDS holds no other name.
            _ => {}
        }
        Ok(())
    }
}

/// Decodes a `POST /v1/take_batch` body, `{"takes": [<take>, ...]}`, each take as
/// [`take::decode_json`] decodes one; an error inside take `i` names its field from the batch
/// (`takes[3].buckets[0].key`). Decoding stops at the 65th take.
pub fn decode_json(body: &[u8]) -> Result<RawBatch, InvalidArgument> {
    json::decode(body)
}

/// Encodes a batch request (used by tests and the load generator).
pub fn encode_json(raw: &RawBatch) -> Value {
    let takes: Vec<Value> = raw.takes.iter().flatten().map(take::encode_json).collect();
    let mut v = serde_json::json!({ "takes": takes });
    if let (Some(id), Some(o)) = (&raw.instance, v.as_object_mut()) {
        o.insert("instance".into(), Value::from(id.as_str()));
    }
    v
}

// ---------------------------------------------------------------------------------------------
// Protobuf

/// Decodes a `TakeBatchRequest` message as [`take::decode_message`] decodes a take: the takes are
/// scanned first (a 65th take, or a 17th bucket in any take, stops the decoding there, the
/// latter named `takes[i].buckets`); only then does prost build the message.
pub fn decode_message(bytes: &[u8]) -> Result<pb::TakeBatchRequest, InvalidArgument> {
    scan_field_one(
        bytes,
        MAX_BATCH_TAKES,
        || {
            InvalidArgument::new(
                "takes",
                format!("must hold at most {MAX_BATCH_TAKES} takes (decoding stopped at the 65th)"),
            )
        },
        |i, take| scan_take(take).map_err(|e| e.within_take(i)),
    )?;
    pb::TakeBatchRequest::decode(bytes).map_err(|e| malformed(&e))
}

/// Decodes a `TakeBatchRequest` message into the domain's [`RawBatch`].
pub fn decode_pb(bytes: &[u8]) -> Result<RawBatch, InvalidArgument> {
    decode_message(bytes).and_then(raw_from_pb)
}

/// Converts a decoded protobuf batch: each take as [`take::raw_from_pb`] converts one, its errors named
/// from the batch.
pub fn raw_from_pb(req: pb::TakeBatchRequest) -> Result<RawBatch, InvalidArgument> {
    let takes = req
        .takes
        .into_iter()
        .enumerate()
        .map(|(i, t)| take::raw_from_pb(t).map_err(|e| e.within_take(i)))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(RawBatch {
        takes: Some(takes),
        instance: non_empty_owned(req.instance),
    })
}

/// Encodes a batch request as protobuf (tests and the load generator).
pub fn pb_from_raw(raw: &RawBatch) -> pb::TakeBatchRequest {
    pb::TakeBatchRequest {
        takes: raw.takes.iter().flatten().map(take::pb_from_raw).collect(),
        instance: raw.instance.clone().unwrap_or_default(),
        ..Default::default()
    }
}

/// Encodes a batch's decisions as protobuf.
pub fn pb_from_answer(ds: &[TakeResponse]) -> pb::TakeBatchResponse {
    pb::TakeBatchResponse {
        results: ds.iter().map(take::pb_from_answer).collect(),
        ..Default::default()
    }
}

/// Decodes a protobuf batch response.
pub fn answer_from_pb(r: &pb::TakeBatchResponse) -> Vec<TakeResponse> {
    r.results.iter().map(take::answer_from_pb).collect()
}

impl DecodeStrict for pb::TakeBatchRequest {
    fn decode_strict(bytes: &[u8]) -> Result<Self, InvalidArgument> {
        decode_message(bytes)
    }
}

// ---------------------------------------------------------------------------------------------
// The handler

/// The batch operation.
pub struct Batch;

impl Operation for Batch {
    type Raw = RawBatch;
    type Answer = BatchResponse;
    const BODY_BYTES: usize = MAX_BATCH_BYTES;
    const SPAN: Option<&'static str> = Some("tollgate.batch");

    /// Validates and decides one admitted batch: every take is validated first (one invalid
    /// take rejects the batch, nothing charged), then the store decides them all in one call.
    async fn handle(
        api: &Api,
        raw: Result<RawBatch, InvalidArgument>,
    ) -> Result<BatchResponse, ApiError> {
        let ValidatedBatch {
            takes,
            rules,
            instance,
        } = raw.and_then(validate).map_err(|e| invalid("batch", e))?;
        api.metrics.batch(takes.len());
        let mut results = api
            .store_call("batch", api.store.take_batch(&takes))
            .await?;
        let n = api.instances(instance.as_deref());
        crate::trace::note(|| {
            let allowed = results.iter().filter(|d| d.allowed).count();
            let mut names: Vec<&str> = rules
                .iter()
                .flatten()
                .flatten()
                .map(String::as_str)
                .collect();
            names.sort_unstable();
            names.dedup();
            vec![
                opentelemetry::KeyValue::new("tollgate.batch.takes", results.len() as i64),
                opentelemetry::KeyValue::new("tollgate.batch.allowed", allowed as i64),
                opentelemetry::KeyValue::new(
                    "tollgate.batch.limited",
                    (results.len() - allowed) as i64,
                ),
                opentelemetry::KeyValue::new("tollgate.rules", names.join(",")),
            ]
        });
        for (i, d) in results.iter_mut().enumerate() {
            api.metrics.decision(d.allowed, d.delay_ms);
            if let Some(r) = rules.get(i) {
                count_rules(api, d, r);
            }
            d.instances = n;
        }
        Ok(BatchResponse { results })
    }
}

impl GrpcOperation for Batch {
    type Request = pb::TakeBatchRequest;
    type Response = pb::TakeBatchResponse;

    fn from_pb(req: pb::TakeBatchRequest) -> Result<RawBatch, InvalidArgument> {
        raw_from_pb(req)
    }

    fn to_pb(answer: &BatchResponse) -> pb::TakeBatchResponse {
        pb_from_answer(&answer.results)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::take::RawBucket;

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

    #[test]
    fn batch_errors_name_the_take() {
        let take = |b: Vec<RawBucket>| RawTake {
            buckets: Some(b),
            instance: None,
        };
        let batch = |t: Vec<RawTake>| {
            validate(RawBatch {
                takes: Some(t),
                instance: None,
            })
        };
        assert_eq!(
            validate(RawBatch::default()).err().map(|e| e.field),
            Some("takes".into())
        );
        assert_eq!(batch(vec![]).err().map(|e| e.field), Some("takes".into()));
        let ok = take(vec![raw("a")]);
        assert_eq!(
            batch(vec![ok.clone(); 65]).err().map(|e| e.field),
            Some("takes".into())
        );
        assert_eq!(batch(vec![ok.clone(); 64]).map(|v| v.takes.len()), Ok(64));
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

    fn batch_field_of(body: &str) -> String {
        match decode_json(body.as_bytes()).and_then(validate) {
            Err(e) => e.field,
            Ok(v) => unreachable!("accepted {body}: {v:?}"),
        }
    }

    #[test]
    fn batches_read_each_take_as_a_take() {
        let take = r#"{"buckets":[{"key":"a","capacity":1,"period_ms":1}]}"#;
        let body = format!(r#"{{"takes":[{take},{take}]}}"#);
        let raw = decode_json(body.as_bytes()).unwrap_or_else(|e| unreachable!("{e}"));
        let one = take::decode_json(take.as_bytes()).unwrap_or_else(|e| unreachable!("{e}"));
        assert_eq!(raw.takes, Some(vec![one.clone(), one]));
        assert_eq!(
            Some(encode_json(&raw)),
            serde_json::from_str::<Value>(&body).ok()
        );
        assert_eq!(batch_field_of("{}"), "takes");
        assert_eq!(batch_field_of(r#"{"takes":[]}"#), "takes");
        assert_eq!(batch_field_of(r#"{"takes":3}"#), "takes");
        assert_eq!(batch_field_of(r#"{"buckets":[]}"#), "buckets");
        assert_eq!(
            batch_field_of(&format!(r#"{{"takes":[{take},7]}}"#)),
            "takes[1]"
        );
        assert_eq!(
            batch_field_of(&format!(r#"{{"takes":[{take},{{}}]}}"#)),
            "takes[1].buckets"
        );
        assert_eq!(
            batch_field_of(&format!(
                r#"{{"takes":[{take},{take},{take},{{"buckets":[{{"key":"a","capacity":0,"period_ms":1}}]}}]}}"#
            )),
            "takes[3].buckets[0].capacity"
        );
        assert_eq!(
            batch_field_of(
                r#"{"takes":[{"buckets":[{"key":"a","capacity":1,"period_ms":1,"x":1}]}]}"#
            ),
            "takes[0].buckets[0].x"
        );
        assert_eq!(batch_field_of(&format!(r#"{{"takes":[{take}] x"#)), "");
    }

    #[test]
    fn stops_at_the_sixty_fifth_take() {
        let take = r#"{"buckets":[{"key":"a","capacity":1,"period_ms":1}]}"#;
        let ok = format!(r#"{{"takes":[{}]}}"#, vec![take; 64].join(","));
        assert_eq!(
            decode_json(ok.as_bytes()).map(|b| b.takes.map(|t| t.len())),
            Ok(Some(64))
        );
        // Garbage after the 65th `{` is never reached.
        let body = format!(r#"{{"takes":[{},{{"#, vec![take; 64].join(","));
        let e = decode_json(body.as_bytes()).err();
        assert_eq!(e.as_ref().map(|e| e.field.as_str()), Some("takes"), "{e:?}");
        assert!(e.is_some_and(|e| e.message.contains("at most 64")));
    }

    #[test]
    fn batch_decoding_stops_at_the_sixty_fifth_take() {
        // `0a 02 0a 00`: field 1 (takes), length 2: a take of one empty bucket.
        let ok = [0x0a, 0x02, 0x0a, 0x00].repeat(64);
        assert_eq!(
            decode_pb(&ok).map(|r| r.takes.map(|t| t.len())),
            Ok(Some(64))
        );
        let mut huge = [0x0a, 0x02, 0x0a, 0x00].repeat(100_000);
        huge.extend_from_slice(&[0xff; 3]);
        let e = decode_pb(&huge).err();
        assert_eq!(e.as_ref().map(|e| e.field.as_str()), Some("takes"), "{e:?}");
        // A 17th bucket in take 2 is found before prost builds anything.
        let mut bad = [0x0a, 0x02, 0x0a, 0x00].repeat(2);
        bad.extend_from_slice(&[0x0a, 34]);
        bad.extend_from_slice(&[0x0a, 0x00].repeat(17));
        let e = decode_pb(&bad).err();
        assert_eq!(
            e.as_ref().map(|e| e.field.as_str()),
            Some("takes[2].buckets"),
            "{e:?}"
        );
        // A bad algorithm is named from the batch.
        let mut alg = [0x0a, 0x02, 0x0a, 0x00].to_vec();
        alg.extend_from_slice(&[0x0a, 0x04, 0x0a, 0x02, 0x30, 0x07]);
        let e = decode_pb(&alg).err();
        assert_eq!(
            e.as_ref().map(|e| e.field.as_str()),
            Some("takes[1].buckets[0].algorithm"),
            "{e:?}"
        );
    }
}
