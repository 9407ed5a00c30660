//! `refund`: a caller gives back tokens it was granted and will not spend (a lease that ended with
//! tokens left), so the bucket can hand them to someone else. `POST /v1/refund` with the body of a
//! take (JSON only); each bucket's `cost` is the number of tokens given back.
//!
//! Why it cannot raise a limit: the store refills the bucket up to now before adding the tokens
//! back, and caps it at its capacity, so the bucket holds at most what it would hold had those
//! tokens never been charged. The caller must have removed them from its own pool first (the
//! filter does, with a CAS, before it sends the refund), so they are never spent as well.

use serde::Serialize;

use super::take::{self, RawTake};
use super::{invalid, Operation};
use crate::api::{Api, ApiError};
use crate::domain::{Algorithm, BucketSpec, InvalidArgument, MAX_TAKE_BYTES};

/// The answer to a refund: how many buckets took tokens back (a bucket that has expired is full
/// already and takes none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Refunded {
    /// Buckets that took tokens back.
    pub refunded: u64,
}

/// Validates a refund: a take's fields and bounds, token buckets only, no lease.
pub fn validate(raw: RawTake) -> Result<Vec<BucketSpec>, InvalidArgument> {
    let specs = take::validate(raw)?;
    for (i, b) in specs.iter().enumerate() {
        if b.algorithm != Algorithm::TokenBucket {
            return Err(InvalidArgument::new(
                format!("buckets[{i}].algorithm"),
                "refunds apply to token_bucket only (a fixed window's tokens end with their window)",
            ));
        }
        if b.lease != b.cost {
            return Err(InvalidArgument::new(
                format!("buckets[{i}].lease"),
                "not allowed in a refund",
            ));
        }
    }
    Ok(specs)
}

/// The refund operation.
pub struct Refund;

impl Operation for Refund {
    type Raw = RawTake;
    type Answer = Refunded;
    const BODY_BYTES: usize = MAX_TAKE_BYTES;

    /// Validates and applies one refund.
    async fn handle(
        api: &Api,
        raw: Result<RawTake, InvalidArgument>,
    ) -> Result<Refunded, ApiError> {
        let instance = raw.as_ref().ok().and_then(|r| r.instance.clone());
        let specs = raw.and_then(validate).map_err(|e| invalid("refund", e))?;
        // `validate` checked the instance id: this proxy is live, whatever it is calling for.
        api.instances(instance.as_deref());
        let refunded = api.store_call("refund", api.store.refund(&specs)).await?;
        Ok(Refunded { refunded })
    }
}
