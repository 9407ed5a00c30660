//! Refunds: a caller gives back tokens it was granted and will not spend (a lease that ended with
//! tokens left), so the bucket can hand them to someone else. `POST /v1/refund` with the body of a
//! take (JSON only); each bucket's `cost` is the number of tokens given back.
//!
//! Why it cannot raise a limit: the store refills the bucket up to now before adding the tokens
//! back, and caps it at its capacity, so the bucket holds at most what it would hold had those
//! tokens never been charged. The caller must have removed them from its own pool first (the
//! filter does, with a CAS, before it sends the refund), so they are never spent as well.

use serde::Serialize;
use std::time::Instant;

use super::{Api, ApiError};
use crate::domain::{validate, Algorithm, InvalidArgument, RawTake};

/// The answer to a refund: how many buckets took tokens back (a bucket that has expired is full
/// already and takes none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Refunded {
    /// Buckets that took tokens back.
    pub refunded: u64,
}

impl Api {
    /// Validates and applies one refund: a take's fields and bounds, token buckets only, no lease.
    pub async fn refund(
        &self,
        raw: Result<RawTake, InvalidArgument>,
    ) -> Result<Refunded, ApiError> {
        let instance = raw.as_ref().ok().and_then(|r| r.instance.clone());
        let specs = match raw.and_then(validate).and_then(|specs| {
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
        }) {
            Ok(specs) => specs,
            Err(e) => {
                tracing::debug!(error = %e, "invalid refund");
                return Err(ApiError::Invalid(e));
            }
        };
        // `validate` checked the instance id: this proxy is live, whatever it is calling for.
        self.instances(instance.as_deref());
        let start = Instant::now();
        let result = self.store.refund(&specs).await;
        self.metrics.store_duration(start.elapsed().as_secs_f64());
        match result {
            Ok(refunded) => Ok(Refunded { refunded }),
            Err(e) => {
                self.metrics.store_error(e.kind());
                tracing::warn!(error = %e, store = self.store.kind(), "refund failed");
                Err(ApiError::Unavailable(e.public_message()))
            }
        }
    }
}
