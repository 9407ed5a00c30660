//! Plugin configurations for the end-to-end tests, built as JSON values.

use serde_json::{json, Value};

/// A refill so slow that it never matters within a test: one token per hour.
pub const SLOW_PERIOD_MS: u64 = 3_600_000;

/// A rule named `name` keyed by `key`, holding `capacity` tokens that refill one per hour.
pub fn rule(name: &str, key: &[&str], capacity: u64) -> Value {
    json!({"name": name, "key": key, "capacity": capacity, "rate": 1, "period_ms": SLOW_PERIOD_MS})
}

/// A full plugin configuration: `rules` over `transport` with a generous callout timeout (1 s),
/// then every field of `extra` merged in at top level (`service` fields are merged one level down).
pub fn plugin(transport: Transport, rules: Vec<Value>, extra: Value) -> String {
    let mut cfg = json!({
        "service": {"cluster": "tollgate", "transport": transport.name(), "timeout_ms": 1000},
        "rules": rules,
    });
    if transport == Transport::GrpcUnary {
        cfg["service"]["stream"] = json!(false);
    }
    if let (Some(obj), Value::Object(extra)) = (cfg.as_object_mut(), extra) {
        for (k, v) in extra {
            match (k.as_str(), v) {
                ("service", Value::Object(s)) => {
                    if let Some(Value::Object(svc)) = obj.get_mut("service") {
                        for (sk, sv) in s {
                            svc.insert(sk, sv);
                        }
                    }
                }
                (_, v) => {
                    obj.insert(k, v);
                }
            }
        }
    }
    serde_json::to_string_pretty(&cfg).unwrap_or_default()
}

/// Expands `$name(Transport)`, for each `$name`, into a module `$name` with one test per
/// `test => Variant` pair (the two macros below name the sets).
#[macro_export]
macro_rules! over_transports {
    (@one [$($test:ident => $t:ident),*] $name:ident) => {
        mod $name {
            $(
                #[test]
                fn $test() {
                    super::$name($crate::common::Transport::$t)
                }
            )*
        }
    };
    ($tests:tt $($name:ident),* $(,)?) => {
        $($crate::over_transports!(@one $tests $name);)*
    };
}

/// Expands `$name(Transport)` into a module `$name` with tests `http` and `grpc`.
#[macro_export]
macro_rules! both_transports {
    ($($name:ident),* $(,)?) => {
        $crate::over_transports!([http => Http, grpc => Grpc] $($name),*);
    };
}

/// Expands `$name(Transport)` into a module `$name` with tests `http`, `grpc` (a stream per
/// worker, the default) and `grpc_unary` (a call per batch, `"stream": false`).
#[macro_export]
macro_rules! every_transport {
    ($($name:ident),* $(,)?) => {
        $crate::over_transports!([http => Http, grpc => Grpc, grpc_unary => GrpcUnary] $($name),*);
    };
}

/// The transports every behaviour is checked over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Http,
    /// gRPC, takes as messages on a stream per worker (`service.stream`, the default).
    Grpc,
    /// gRPC, a call per take or batch (`"stream": false`; [`plugin`] sets it).
    GrpcUnary,
}

impl Transport {
    /// The `service.transport` value.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Http => "http",
            Transport::Grpc | Transport::GrpcUnary => "grpc",
        }
    }
}
