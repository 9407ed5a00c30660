//! The API: one operation, take, in two wire forms on one port.
//!
//! | file | what |
//! |---|---|
//! | `json.rs` | JSON codec of the contract (strict: unknown fields rejected, the bad field named) |
//! | `grpc.rs` | protobuf types generated from `contract/tollgate.proto`, the tonic service, a codec that turns malformed protobuf into `INVALID_ARGUMENT` |
//! | `http.rs` | axum routes (`/v1/take`, `/healthz`, `/readyz`, `/metrics`), auth, and the content-type switch that sends gRPC to tonic |
//!
//! Both transports call [`Api::take`]: authenticate, validate (the one shared
//! [`crate::domain::validate`]), ask the store, count.

pub mod grpc;
pub mod http;
pub mod json;

use std::sync::Arc;
use std::time::Instant;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::domain::{validate, InvalidArgument, RawTake, TakeDecision};
use crate::metrics::Metrics;
use crate::store::Store;

/// Why a take was not answered. Each maps to one HTTP status and one gRPC code.
#[derive(Debug)]
pub enum ApiError {
    /// 400 / `INVALID_ARGUMENT`.
    Invalid(InvalidArgument),
    /// 401 / `UNAUTHENTICATED`.
    Unauthenticated,
    /// 503 / `UNAVAILABLE`: the store could not decide.
    Unavailable(String),
}

impl ApiError {
    /// The contract's error code, also the metrics label.
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::Invalid(_) => "invalid_argument",
            ApiError::Unauthenticated => "unauthenticated",
            ApiError::Unavailable(_) => "unavailable",
        }
    }

    /// The message both transports send with the error.
    pub fn message(&self) -> String {
        match self {
            ApiError::Invalid(inv) => inv.to_string(),
            ApiError::Unauthenticated => "missing or wrong bearer token".to_string(),
            ApiError::Unavailable(m) => m.clone(),
        }
    }
}

/// The bearer token check. Compares SHA-256 digests in constant time, so neither the content nor
/// the length of the expected token leaks through timing.
#[derive(Clone)]
pub struct Auth {
    expected: Option<[u8; 32]>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("token", &self.expected.map(|_| "***"))
            .finish()
    }
}

impl Auth {
    /// `None`: every call is accepted.
    pub fn new(token: Option<&str>) -> Self {
        Auth {
            expected: token.map(|t| Sha256::digest(format!("Bearer {t}").as_bytes()).into()),
        }
    }

    /// Checks an `authorization` header (HTTP) or metadata value (gRPC).
    pub fn check(&self, header: Option<&[u8]>) -> bool {
        let Some(expected) = &self.expected else {
            return true;
        };
        let header = header.unwrap_or_default();
        // The scheme is case-insensitive (RFC 9110); the token is compared exactly.
        let mut h = Sha256::new();
        match header.get(..7) {
            Some(scheme) if scheme.eq_ignore_ascii_case(b"bearer ") => {
                h.update(b"Bearer ");
                h.update(&header[7..]);
            }
            _ => h.update(header),
        }
        let got: [u8; 32] = h.finalize().into();
        bool::from(got.ct_eq(expected))
    }
}

/// What both transports share: the store, the metrics and the token.
pub struct Api {
    /// Where buckets live.
    pub store: Arc<dyn Store>,
    /// Counters and histograms.
    pub metrics: Metrics,
    /// Bearer token check.
    pub auth: Auth,
}

impl Api {
    /// Authenticates, validates and decides one take.
    pub async fn take(
        &self,
        authorization: Option<&[u8]>,
        raw: Result<RawTake, InvalidArgument>,
    ) -> Result<TakeDecision, ApiError> {
        if !self.auth.check(authorization) {
            return Err(ApiError::Unauthenticated);
        }
        let specs = match raw.and_then(validate) {
            Ok(specs) => specs,
            Err(e) => {
                tracing::debug!(error = %e, "invalid take");
                return Err(ApiError::Invalid(e));
            }
        };
        let start = Instant::now();
        let result = self.store.take(&specs).await;
        self.metrics.store_duration(start.elapsed().as_secs_f64());
        match result {
            Ok(d) => {
                self.metrics.decision(d.allowed);
                Ok(d)
            }
            Err(e) => {
                self.metrics.store_error(e.kind());
                tracing::warn!(error = %e, transient = e.is_transient(), store = self.store.kind(), "take failed");
                Err(ApiError::Unavailable(e.to_string()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auth() {
        let a = Auth::new(Some("s3cret"));
        assert!(a.check(Some(b"Bearer s3cret")));
        assert!(!a.check(Some(b"Bearer s3cre")));
        assert!(a.check(Some(b"bearer s3cret")));
        assert!(!a.check(Some(b"Bearer s3cret ")));
        assert!(!a.check(None));
        assert!(Auth::new(None).check(None));
        assert!(!format!("{a:?}").contains("s3cret"));
    }
}
