//! What a callout sends, ready for the adapter: the core encodes, the adapter only dispatches.
//!
//! Every callout goes to the configured service cluster with its timeout and bearer token. A take
//! goes over the configured transport (JSON `POST <path>`, gRPC `tollgate.v1.RateLimiter/Take`, or
//! Envoy's `ShouldRateLimit` for transport `rls`); a batch of takes likewise (`<path>_batch` or
//! `TakeBatch`), or, with `service.stream`, as one message on the worker's `TakeStream`. The operations beside a take (acquire and release of concurrency slots, refunds,
//! settlements) are JSON over HTTP whatever the transport (the service answers JSON on its gRPC
//! port too), at `<base>/<op>` beside the take path.

use crate::core::base::ledger::CalloutId;
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

/// The W3C trace-context header a callout forwards (`service.trace`).
pub const TRACEPARENT: &str = "traceparent";

/// `v` if it is a version-00 `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`, ids not all zero)
/// whose flags say sampled; else `None` (an unsampled request's decision is not traced, so its
/// callout need not leave its batch).
pub fn sampled_traceparent(v: &[u8]) -> Option<String> {
    let hex = |b: &u8| b.is_ascii_digit() || (b'a'..=b'f').contains(b);
    let id = |from: usize, to: usize| {
        v.get(from..to)
            .is_some_and(|p| p.iter().all(hex) && p.iter().any(|&b| b != b'0'))
    };
    let ok = v.len() == 55
        && v.starts_with(b"00-")
        && v.get(35) == Some(&b'-')
        && v.get(52) == Some(&b'-')
        && id(3, 35)
        && id(36, 52)
        && v.get(53).is_some_and(hex)
        && matches!(
            v.get(54),
            Some(b'1' | b'3' | b'5' | b'7' | b'9' | b'b' | b'd' | b'f')
        );
    ok.then(|| String::from_utf8_lossy(v).into_owned())
}

const TOLLGATE: &str = "tollgate.v1.RateLimiter";
const RLS: &str = "envoy.service.ratelimit.v3.RateLimitService";

/// The callout that carries `plan`'s take (or, transport `rls`, its descriptors), with this
/// Envoy's `instance` id.
pub fn take(cfg: &Config, instance: Option<&str>, plan: &Plan) -> CalloutRequest {
    match (cfg.service.transport, &plan.rls) {
        (Transport::Http, _) => CalloutRequest::Http {
            path: cfg.service.path.clone(),
            body: wire::encode_json(&plan.request, instance),
        },
        (Transport::Grpc | Transport::Rls, Some(rls)) => CalloutRequest::Grpc {
            service: RLS,
            method: "ShouldRateLimit",
            message: wire::encode_rls(rls, &plan.request),
        },
        (Transport::Grpc | Transport::Rls, None) => CalloutRequest::Grpc {
            service: TOLLGATE,
            method: "Take",
            message: wire::encode_proto(&plan.request, instance),
        },
    }
}

/// The callout that carries every take of `takes` (group commit), with this Envoy's `instance` id.
pub fn batch(cfg: &Config, instance: Option<&str>, takes: &[&TakeRequest]) -> CalloutRequest {
    match cfg.service.transport {
        Transport::Grpc => CalloutRequest::Grpc {
            service: TOLLGATE,
            method: "TakeBatch",
            message: wire::encode_batch_proto(takes, instance),
        },
        Transport::Http | Transport::Rls => CalloutRequest::Http {
            path: format!("{}_batch", cfg.service.path),
            body: wire::encode_batch_json(takes, instance),
        },
    }
}

/// The service and method of a worker's stream of takes ([`crate::core::wire::stream`]).
pub const STREAM: (&str, &str) = (TOLLGATE, "TakeStream");

/// One message on the stream: the takes of `takes`, as a batch (`TakeBatchRequest`) with its id
/// `id` (its ledger id), answered by one `TakeBatchResponse` carrying the same id; with this
/// Envoy's `instance` id.
pub fn stream_message(instance: Option<&str>, takes: &[&TakeRequest], id: CalloutId) -> Vec<u8> {
    wire::encode_stream_message(takes, instance, id.0)
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

/// A refund: `request`'s costs go back to their buckets, with this Envoy's `instance` id.
pub fn refund(cfg: &Config, instance: Option<&str>, request: &TakeRequest) -> CalloutRequest {
    beside(cfg, "refund", wire::encode_json(request, instance))
}

/// `GrpcService { envoy_grpc: EnvoyGrpc { cluster_name } }`, serialised (both field 1, length
/// delimited): the target of a gRPC callout. Envoy tries to parse the name it is given as that
/// message first, and a cluster name whose bytes happen to parse (e.g. `abcdefghi`) makes it
/// abort the whole process; sent serialised, the cluster name is never read as protobuf.
pub fn grpc_service(cluster: &str) -> Vec<u8> {
    fn field1(out: &mut Vec<u8>, bytes: &[u8]) {
        out.push(0x0a);
        let mut n = bytes.len();
        loop {
            let b = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(b);
                break;
            }
            out.push(b | 0x80);
        }
        out.extend_from_slice(bytes);
    }
    let mut inner = Vec::with_capacity(cluster.len() + 4);
    field1(&mut inner, cluster.as_bytes());
    let mut out = Vec::with_capacity(inner.len() + 4);
    field1(&mut out, &inner);
    out
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
            matches!(batch(&c, None, &[]), CalloutRequest::Http { path, .. } if path == "/limits_batch")
        );
        let c = cfg("grpc", "/v1/take");
        assert!(matches!(
            batch(&c, None, &[]),
            CalloutRequest::Grpc {
                method: "TakeBatch",
                ..
            }
        ));
    }
}
