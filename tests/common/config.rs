//! Plugin configurations for the end-to-end tests: rules as JSON values, the whole built by
//! testkit's one builder ([`Plugin`], re-exported here).

use serde_json::{json, Value};
pub use tollgate_testkit::plugin::Plugin;

/// A refill so slow that it never matters within a test: one token per hour.
pub const SLOW_PERIOD_MS: u64 = 3_600_000;

/// A rule named `name` keyed by `key`, holding `capacity` tokens that refill one per hour.
pub fn rule(name: &str, key: &[&str], capacity: u64) -> Value {
    json!({"name": name, "key": key, "capacity": capacity, "rate": 1, "period_ms": SLOW_PERIOD_MS})
}

/// A full plugin configuration: `rules` over `transport` with a generous callout timeout (1 s),
/// then every field of `extra` set at top level (`service` fields are set one level down).
pub fn plugin(transport: Transport, rules: Vec<Value>, extra: Value) -> String {
    let p = transport.plugin(1000);
    with_fields(rules.iter().fold(p, Plugin::rule), extra).json()
}

/// `p` with every field of `extra` (an object) set at top level, `service`'s one level down.
pub fn with_fields(p: Plugin, extra: Value) -> Plugin {
    let Value::Object(extra) = extra else {
        return p;
    };
    extra.into_iter().fold(p, |p, (k, v)| match v {
        Value::Object(s) if k == "service" => {
            s.into_iter().fold(p, |p, (sk, sv)| p.service(&sk, sv))
        }
        v => p.field(&k, v),
    })
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
    /// gRPC, a call per take or batch (`"stream": false`; [`Transport::plugin`] sets it).
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

    /// A plugin configuration calling the service over this transport, a callout timing out after
    /// `timeout_ms` (`"stream": false` for [`Transport::GrpcUnary`]).
    pub fn plugin(self, timeout_ms: u64) -> Plugin {
        let p = Plugin::new(self.name(), timeout_ms);
        match self {
            Transport::GrpcUnary => p.stream(false),
            _ => p,
        }
    }
}
