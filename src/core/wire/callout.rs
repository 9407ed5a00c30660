//! What a callout sends, ready for the adapter: the core encodes, the adapter only dispatches.
//!
//! Every callout goes to the configured service cluster with its timeout and bearer token. A take
//! goes over the configured transport (JSON `POST <path>`, gRPC `tollgate.v1.RateLimiter/Take`, or
//! Envoy's `ShouldRateLimit` for transport `rls`); a batch of takes likewise (`<path>_batch` or
//! `TakeBatch`). The operations beside a take (acquire and release of concurrency slots, refunds,
//! settlements) are JSON over HTTP whatever the transport (the service answers JSON on its gRPC
//! port too), at `<base>/<op>` beside the take path.

use crate::core::config::{Config, Transport};
use crate::core::wire::plan::Plan;
use crate::core::wire::{self, TakeRequest};

/// One callout, encoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CalloutRequest {
    /// `POST path` with a JSON body.
    Http {
        /// `:path`.
        path: String,
        /// The JSON body.
        body: Vec<u8>,
    },
    /// A unary gRPC call.
    Grpc {
        /// Fully qualified service name.
        service: &'static str,
        /// Method name.
        method: &'static str,
        /// The serialised request message.
        message: Vec<u8>,
    },
}

const TOLLGATE: &str = "tollgate.v1.RateLimiter";
const RLS: &str = "envoy.service.ratelimit.v3.RateLimitService";

/// The callout that carries `plan`'s take (or, transport `rls`, its descriptors).
pub fn take(cfg: &Config, plan: &Plan) -> CalloutRequest {
    match (cfg.service.transport, &plan.rls) {
        (Transport::Http, _) => CalloutRequest::Http {
            path: cfg.service.path.clone(),
            body: wire::encode_json(&plan.request, cfg.instance.as_deref()),
        },
        (Transport::Grpc | Transport::Rls, Some(rls)) => CalloutRequest::Grpc {
            service: RLS,
            method: "ShouldRateLimit",
            message: wire::encode_rls(rls, &plan.request),
        },
        (Transport::Grpc | Transport::Rls, None) => CalloutRequest::Grpc {
            service: TOLLGATE,
            method: "Take",
            message: wire::encode_proto(&plan.request, cfg.instance.as_deref()),
        },
    }
}

/// The callout that carries every take of `takes` (group commit).
pub fn batch(cfg: &Config, takes: &[&TakeRequest]) -> CalloutRequest {
    match cfg.service.transport {
        Transport::Grpc => CalloutRequest::Grpc {
            service: TOLLGATE,
            method: "TakeBatch",
            message: wire::encode_batch_proto(takes, cfg.instance.as_deref()),
        },
        Transport::Http | Transport::Rls => CalloutRequest::Http {
            path: format!("{}_batch", cfg.service.path),
            body: wire::encode_batch_json(takes, cfg.instance.as_deref()),
        },
    }
}

/// An operation beside the take (`acquire`, `release`, `refund`, `settle`): `POST <base>/<op>`
/// with the JSON `body`, where `<base>` is the take path without its `/take` (or, for a path that
/// does not end so, `<path>_<op>`).
pub fn beside(cfg: &Config, op: &str, body: Vec<u8>) -> CalloutRequest {
    let path = match cfg.service.path.strip_suffix("/take") {
        Some(base) => format!("{base}/{op}"),
        None => format!("{}_{op}", cfg.service.path),
    };
    CalloutRequest::Http { path, body }
}

/// A refund: `request`'s costs go back to their buckets.
pub fn refund(cfg: &Config, request: &TakeRequest) -> CalloutRequest {
    beside(
        cfg,
        "refund",
        wire::encode_json(request, cfg.instance.as_deref()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(transport: &str, path: &str) -> Config {
        let json = format!(
            r#"{{"service":{{"cluster":"c","transport":"{transport}","path":"{path}"}},
                "rules":[{{"name":"r","capacity":5,"period_ms":1000}}]}}"#
        );
        Config::parse(json.as_bytes()).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn operations_beside_a_take_go_next_to_its_path_as_json() {
        let c = cfg("grpc", "/v1/take");
        assert_eq!(
            beside(&c, "settle", b"{}".to_vec()),
            CalloutRequest::Http {
                path: "/v1/settle".into(),
                body: b"{}".to_vec()
            }
        );
        let c = cfg("http", "/limits");
        assert!(matches!(beside(&c, "acquire", Vec::new()),
            CalloutRequest::Http { path, .. } if path == "/limits_acquire"));
        assert!(
            matches!(batch(&c, &[]), CalloutRequest::Http { path, .. } if path == "/limits_batch")
        );
        let c = cfg("grpc", "/v1/take");
        assert!(matches!(
            batch(&c, &[]),
            CalloutRequest::Grpc {
                method: "TakeBatch",
                ..
            }
        ));
    }
}
