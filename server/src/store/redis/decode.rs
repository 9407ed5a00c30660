//! Script replies into decisions: pure functions over the integers a script answers, each
//! checking the reply's shape (see each script's header) before trusting it.

use super::scripts::PER_BUCKET;
use crate::domain::{
    BucketResult, BucketSpec, BucketState, SettleResult, SlotsState, TakeResponse, MAX_LISTED_SLOTS,
};
use crate::store::StoreError;

/// What one `take.lua` call answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupReply {
    /// Every bucket of the call could pay, and they were charged.
    pub charged: bool,
    /// Per bucket: the decision (with the tokens charged if the call charged) and the fixed window
    /// index charged (0 for token buckets).
    pub buckets: Vec<(BucketResult, u64)>,
}

/// Turns a `take.lua` reply (see its header) into decisions for `specs` (the call's buckets).
/// `granted` is kept as the script charged it (a refund needs it); [`TakeResponse::from_buckets`]
/// reports 0 for a denied request.
pub fn decode_take(reply: &[i64], specs: &[&BucketSpec]) -> Result<GroupReply, StoreError> {
    if reply.len() != 1 + PER_BUCKET * specs.len() {
        return Err(StoreError::Protocol(format!(
            "take reply has {} integers, expected {}",
            reply.len(),
            1 + PER_BUCKET * specs.len()
        )));
    }
    let num = |v: i64, what: &str| {
        u64::try_from(v).map_err(|_| StoreError::Protocol(format!("negative {what}: {v}")))
    };
    let flag = |v: i64| match v {
        0 => Ok(false),
        1 => Ok(true),
        v => Err(StoreError::Protocol(format!(
            "flag is {v}, expected 0 or 1"
        ))),
    };
    let charged = flag(reply[0])?;
    let mut buckets = Vec::with_capacity(specs.len());
    for (i, spec) in specs.iter().enumerate() {
        let r = &reply[1 + PER_BUCKET * i..1 + PER_BUCKET * (i + 1)];
        let d = BucketResult {
            allowed: flag(r[0])?,
            limit: spec.capacity,
            remaining: num(r[1], "remaining")?,
            reset_ms: num(r[2], "reset_ms")?,
            retry_after_ms: num(r[3], "retry_after_ms")?,
            granted: num(r[4], "granted")?,
            delay_ms: num(r[5], "delay_ms")?,
            window: 0,
        };
        if d.allowed && !(spec.cost..=spec.lease).contains(&d.granted) {
            return Err(StoreError::Protocol(format!(
                "granted {} outside {}..={}",
                d.granted, spec.cost, spec.lease
            )));
        }
        if d.delay_ms > spec.max_delay_ms || (d.delay_ms > 0 && !d.allowed) {
            return Err(StoreError::Protocol(format!(
                "delay_ms {} of a bucket {} with max_delay_ms {}",
                d.delay_ms,
                if d.allowed { "allowed" } else { "denied" },
                spec.max_delay_ms
            )));
        }
        let mark = num(r[6], "mark")?;
        // A window's mark is the window charged: the take's answer names it for a settle.
        let mut d = d;
        if d.allowed && spec.algorithm != crate::domain::Algorithm::TokenBucket {
            d.window = mark;
        }
        buckets.push((d, mark));
    }
    if charged != buckets.iter().all(|(d, _)| d.allowed) {
        return Err(StoreError::Protocol(
            "take reply's overall flag disagrees with its buckets".into(),
        ));
    }
    Ok(GroupReply { charged, buckets })
}

/// Splits a `take_batch.lua` reply into one [`take.lua`-shaped](decode_take) reply per take and
/// decodes each.
pub fn decode_batch(
    reply: &[i64],
    takes: &[&[BucketSpec]],
) -> Result<Vec<TakeResponse>, StoreError> {
    let expected: usize = takes.iter().map(|t| 1 + PER_BUCKET * t.len()).sum();
    if reply.len() != expected {
        return Err(StoreError::Protocol(format!(
            "batch reply has {} integers, expected {expected}",
            reply.len()
        )));
    }
    let mut at = 0;
    let mut out = Vec::with_capacity(takes.len());
    for specs in takes {
        let len = 1 + PER_BUCKET * specs.len();
        let these: Vec<&BucketSpec> = specs.iter().collect();
        let g = decode_take(&reply[at..at + len], &these)?;
        at += len;
        out.push(TakeResponse::from_buckets(
            g.buckets.into_iter().map(|(d, _)| d).collect(),
        ));
    }
    Ok(out)
}

/// Turns a `settle.lua` reply (see its header) into whether the id was known and `n` results.
pub fn decode_settle(reply: &[i64], n: usize) -> Result<(bool, Vec<SettleResult>), StoreError> {
    if reply.len() != 1 + 2 * n {
        return Err(StoreError::Protocol(format!(
            "settle reply has {} integers, expected {}",
            reply.len(),
            1 + 2 * n
        )));
    }
    let uint = |v: i64| {
        u64::try_from(v)
            .map_err(|_| StoreError::Protocol(format!("negative value {v} in settle reply")))
    };
    let results = reply[1..]
        .chunks_exact(2)
        .map(|p| {
            Ok(SettleResult {
                remaining: uint(p[0])?,
                debt: uint(p[1])?,
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    Ok((reply[0] == 1, results))
}

/// Turns an `inspect.lua` reply for a bucket of `capacity` (see its header) into its state.
pub fn decode_inspect(reply: &[i64], capacity: u64) -> Result<BucketState, StoreError> {
    let uint = |v: i64| {
        u64::try_from(v)
            .map_err(|_| StoreError::Protocol(format!("negative value {v} in inspect reply")))
    };
    match reply {
        [exists @ (0 | 1), remaining, debt, reset_ms] => Ok(BucketState::new(
            *exists == 1,
            capacity,
            SettleResult {
                remaining: uint(*remaining)?,
                debt: uint(*debt)?,
            },
            uint(*reset_ms)?,
        )),
        r => Err(StoreError::Protocol(format!(
            "inspect reply has {} integers, expected 4",
            r.len()
        ))),
    }
}

/// Turns an `inspect.lua` reply for a slot set into its live slots.
pub fn decode_slots(reply: &[i64]) -> Result<SlotsState, StoreError> {
    let uint = |v: &i64| {
        u64::try_from(*v)
            .map_err(|_| StoreError::Protocol(format!("negative value {v} in inspect reply")))
    };
    let Some((n, deadlines)) = reply.split_first() else {
        return Err(StoreError::Protocol("empty inspect reply".into()));
    };
    let in_flight = uint(n)?;
    if deadlines.len() > MAX_LISTED_SLOTS || deadlines.len() as u64 > in_flight {
        return Err(StoreError::Protocol(format!(
            "inspect reply lists {} deadlines of {in_flight} slots",
            deadlines.len()
        )));
    }
    Ok(SlotsState {
        in_flight,
        deadlines_ms: deadlines.iter().map(uint).collect::<Result<_, _>>()?,
    })
}

/// Turns an `instances.lua` reply (one integer) into the deployment's count of live instances.
pub(super) fn decode_instances(reply: &[i64]) -> Result<Option<u64>, StoreError> {
    match reply {
        [n] => u64::try_from(*n)
            .map(Some)
            .map_err(|_| StoreError::Protocol(format!("negative instance count {n}"))),
        r => Err(StoreError::Protocol(format!(
            "instances reply has {} integers, expected 1",
            r.len()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Algorithm;

    fn spec(cap: u64) -> BucketSpec {
        BucketSpec {
            key: "k".into(),
            capacity: cap,
            rate: cap,
            period_ms: 1000,
            cost: 1,
            algorithm: Algorithm::TokenBucket,
            lease: 1,
            max_delay_ms: 0,
        }
    }

    #[test]
    fn decodes_a_reply() {
        let (a, b) = (spec(10), spec(3));
        let g = decode_take(&[0, 1, 9, 100, 0, 1, 0, 0, 0, 2, 5, 7, 0, 0, 42], &[&a, &b])
            .unwrap_or_else(|e| {
                unreachable!("{e}");
            });
        assert!(!g.charged);
        assert_eq!(
            g.buckets,
            vec![
                (
                    BucketResult {
                        allowed: true,
                        limit: 10,
                        remaining: 9,
                        reset_ms: 100,
                        retry_after_ms: 0,
                        granted: 1,
                        delay_ms: 0,
                        window: 0,
                    },
                    0
                ),
                (
                    BucketResult {
                        allowed: false,
                        limit: 3,
                        remaining: 2,
                        reset_ms: 5,
                        retry_after_ms: 7,
                        granted: 0,
                        delay_ms: 0,
                        window: 0,
                    },
                    42
                )
            ]
        );
    }

    #[test]
    fn rejects_bad_replies() {
        let a = spec(10);
        assert!(decode_take(&[1, 1, 9, 100, 0, 1, 0], &[&a]).is_err());
        assert!(decode_take(&[1, 1, -9, 100, 0, 1, 0, 0], &[&a]).is_err());
        assert!(decode_take(&[1, 2, 9, 100, 0, 1, 0, 0], &[&a]).is_err());
        assert!(decode_take(&[1, 0, 9, 100, 0, 0, 0, 0], &[&a]).is_err());
        assert!(decode_take(&[0, 1, 9, 100, 0, 1, 0, 0], &[&a]).is_err());
        assert!(
            decode_take(&[1, 1, 9, 100, 0, 2, 0, 0], &[&a]).is_err(),
            "granted above lease"
        );
        assert!(
            decode_take(&[1, 1, 0, 100, 0, 1, 50, 0], &[&a]).is_err(),
            "a delay beyond max_delay_ms"
        );
        let shaped = BucketSpec {
            max_delay_ms: 50,
            ..spec(10)
        };
        assert!(decode_take(&[1, 1, 0, 100, 0, 1, 50, 0], &[&shaped]).is_ok());
        assert!(
            decode_take(&[0, 0, 0, 100, 0, 0, 50, 0], &[&shaped]).is_err(),
            "a delay on a denial"
        );
        assert!(decode_take(&[1, 1, 9, 100, 0, 1, 0, 0], &[&a]).is_ok());
    }
}
