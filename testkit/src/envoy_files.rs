//! The checked-in Envoy configurations, as the generator ([`crate::envoy`]) writes them: `envoy.yaml`
//! (what `make run` starts) and `deploy/envoy/envoy.yaml` (plain Envoy in front of an application).
//! They are edited here and written with `make configs`; `cargo test -p tollgate-testkit` fails
//! when a checked-in file differs from what this module generates. Envoy loads both in the tests
//! (`cargo test --test deploy --test e2e config::`, and `--test e2e tokens::` starts `envoy.yaml`).

use std::path::Path;

use crate::envoy::{EnvoySpec, Note, Route};
use crate::plugin::Plugin;

/// Every checked-in configuration: its path from the repository root and its text.
pub fn checked_in() -> Vec<(&'static str, String)> {
    vec![("envoy.yaml", demo()), ("deploy/envoy/envoy.yaml", plain())]
}

/// `envoy.yaml`: the edge listener with Tollgate, a demo upstream (with a stand-in LLM API) on a
/// second listener, the service on 127.0.0.1:8081.
pub fn demo() -> String {
    let mut upstream = EnvoySpec::empty();
    upstream.listener_name = "demo_upstream".to_string();
    let mut llm = Route::direct("/v1/chat/completions", LLM_ANSWER);
    llm.note =
        Some("A stand-in for an LLM API: every completion reports 42 tokens used.".to_string());
    llm.response_headers = vec![("content-type".to_string(), "application/json".to_string())];
    upstream.routes = vec![llm, Route::direct("/", "hello from the upstream\n")];

    let mut edge = EnvoySpec::empty();
    edge.plugin_config = Some(demo_plugin());
    edge.failure_policy = Some("FAIL_RELOAD".to_string());
    edge.use_remote_address = true;
    edge.service_ports = vec![8081];
    edge.upstream_ports = vec![10001];
    edge.extra_listeners = vec![upstream.listener(Path::new(""), 10001)];
    edge.notes = vec![
        (Note::File, format!("{DEMO_HEADER}\n\n{GENERATED}")),
        (
            Note::RemoteAddress,
            "An edge proxy: the downstream address (what `client_ip` reads with trusted_hops 0) is\n\
             the real peer. With the default (false) Envoy takes it from x-forwarded-for, which a\n\
             client can forge."
                .to_string(),
        ),
        (
            Note::ModuleFailure,
            "A module that fails (a panic) is reloaded rather than leaving a worker answering 503."
                .to_string(),
        ),
        (
            Note::Configuration,
            "The plugin configuration is JSON in a StringValue (a Struct would arrive as protobuf)."
                .to_string(),
        ),
        (
            Note::ServiceCluster,
            "The decision service. HTTP/2 for both transports: the gRPC transport requires it, and\n\
             for the JSON transport one multiplexed connection per worker beats a pool of HTTP/1.1\n\
             connections."
                .to_string(),
        ),
    ];
    edge.yaml(Path::new("dist/tollgate.wasm"), 10000, 9901)
}

/// `deploy/envoy/envoy.yaml`: plain Envoy (no mesh, no gateway controller) in front of `app:8080`,
/// the service at `tollgate:8081`, behind one load balancer.
pub fn plain() -> String {
    let mut spec = EnvoySpec::empty();
    spec.listener_name = "ingress".to_string();
    spec.listen_address = "0.0.0.0".to_string();
    spec.plugin_config = Some(plain_plugin());
    spec.fail_open = true;
    spec.use_remote_address = true;
    spec.xff_num_trusted_hops = 1;
    spec.virtual_host_name = "app".to_string();
    spec.routes = vec![Route::upstream("/", Some(15))];
    spec.service_host = Some("tollgate".to_string());
    spec.service_ports = vec![8081];
    spec.service_health_check = Some("/readyz".to_string());
    spec.upstream_cluster = "app".to_string();
    spec.upstream_host = Some("app".to_string());
    spec.upstream_ports = vec![8080];
    spec.upstream_connect_timeout_ms = Some(1000);
    spec.notes = vec![
        (Note::File, format!("{PLAIN_HEADER}\n\n{GENERATED}")),
        (
            Note::RemoteAddress,
            "Topology: clients -> one load balancer that appends the client's address to\n\
             X-Forwarded-For -> this Envoy. use_remote_address: true makes Envoy resolve the client\n\
             itself, trusting exactly that one hop (xff_num_trusted_hops: 1): the downstream address\n\
             is the entry the load balancer appended, whatever the client wrote further left, and the\n\
             filter keys on it with trusted_hops 0 below. (With use_remote_address: false Envoy would\n\
             take the 2nd entry from the right, which the client writes.) No load balancer in front:\n\
             leave out xff_num_trusted_hops."
                .to_string(),
        ),
        (
            Note::ModuleFailure,
            "A module that cannot load is skipped (limits off) rather than failing every request."
                .to_string(),
        ),
        (
            Note::Configuration,
            "JSON in a StringValue (a Struct would reach the module as binary protobuf).".to_string(),
        ),
        (
            Note::ServiceCluster,
            "The decision service over HTTP/2 cleartext (prior knowledge): about twice the callout\n\
             throughput of HTTP/1.1, and required for the \"grpc\" transport."
                .to_string(),
        ),
        (
            Note::HealthChecks,
            "Only ready instances (GET /readyz is 200 while Redis answers) take callouts.".to_string(),
        ),
    ];
    spec.yaml(Path::new("/etc/tollgate/plugin.wasm"), 10000, 9901)
}

const GENERATED: &str =
    "Generated by `make configs` from testkit/src/envoy_files.rs: edit it there.";

const DEMO_HEADER: &str = r#"Envoy with Tollgate, as `make run` starts it (from the repository root, so the module path is
relative).

  127.0.0.1:10000  the edge listener: Tollgate, then the router to the `upstream` cluster
  127.0.0.1:10001  a demo upstream (direct_response), so the stack needs nothing else
  127.0.0.1:9901   admin: /stats?filter=tollgate shows the filter's counters (wasmcustom.tollgate.*)
  127.0.0.1:8081   tollgate-server (cluster `tollgate`), spoken to over HTTP/2 cleartext

The demo rules: 5 requests of burst per client IP, refilling one token per second. Repeat
`curl -i localhost:10000/` quickly to see five 200s, then 429 with Retry-After and the RateLimit
headers. And under /v1/, 10,000 tokens a minute per `x-api-key`, priced by what the (stand-in) LLM
API's response reports using: 4,000 are reserved, the reported usage is settled afterwards.
Under /v1/shaped, 5 a second per client IP, shaped: a request beyond the burst is held until its
token is there (up to 3 s, `x-ratelimit-delay-ms` says how long), not refused; 15 curls at once all
get 200, spread over about 2 s.
Validate with: .tools/envoy --mode validate -c envoy.yaml"#;

const PLAIN_HEADER: &str = r#"Plain Envoy (no mesh, no gateway controller) in front of an application, with Tollgate: for VMs,
Docker Compose and the like. Paths and host names are the deployment's:
  /etc/tollgate/plugin.wasm  the module (dist/tollgate.wasm, or plugin.wasm from the compat image)
  tollgate:8081              the decision service (several instances: list them, or use DNS)
  app:8080                   the application
Run several of these Envoys behind one load balancer: they share every limit through the service.
Check it with: envoy --mode validate -c deploy/envoy/envoy.yaml (the module must be at the path)."#;

/// The demo's rules: 5 requests of burst per client IP, priced LLM tokens under /v1/, and a
/// shaped limit under /v1/shaped (held, not refused, up to 3 s).
fn demo_plugin() -> String {
    Plugin::new("grpc", 50)
        .field("trusted_hops", 0)
        .rule(
            r#"{"name": "per-ip", "match": {"not": {"path_prefix": "/v1/"}},
 "key": ["client_ip"], "capacity": 5, "rate": 1, "period_ms": 1000}"#,
        )
        .rule(
            r#"{"name": "llm-tokens", "match": {"path_prefix": "/v1/", "not": {"path_prefix": "/v1/shaped"}},
 "key": ["header:x-api-key"],
 "capacity": 10000, "period_ms": 60000,
 "cost": {"reserve": "max", "max": 4000},
 "charge": "response"}"#,
        )
        .rule(
            r#"{"name": "shaped", "match": {"path_prefix": "/v1/shaped"}, "key": ["client_ip"],
 "capacity": 5, "rate": 5, "period_ms": 1000, "shape": {"max_delay_ms": 3000}}"#,
        )
        .failure_mode("fallback")
        .fallback(1, 10000)
        .breaker(5, 250, 5000)
        .response(r#"{"status": 429, "headers": ["draft", "x-ratelimit"], "on_allowed": true}"#)
        .json()
}

/// Plain Envoy's: 100 requests a minute per client IP.
fn plain_plugin() -> String {
    Plugin::new("grpc", 20)
        .field("trusted_hops", 0)
        .rule(r#"{"name": "per-ip", "key": ["client_ip"], "capacity": 100, "rate": 100, "period_ms": 60000}"#)
        .failure_mode("fallback")
        .fallback(2, 10000)
        .response(r#"{"status": 429, "headers": ["draft"]}"#)
        .json()
}

const LLM_ANSWER: &str = "{\"object\":\"chat.completion\",\"choices\":[{\"index\":0,\"message\":\
{\"role\":\"assistant\",\"content\":\"hi\"}}],\"usage\":{\"prompt_tokens\":12,\
\"completion_tokens\":30,\"total_tokens\":42}}\n";

#[cfg(test)]
mod tests {
    use super::*;

    /// The checked-in files are what the generator writes: regenerate them with `make configs`.
    #[test]
    fn the_checked_in_files_are_the_generators_output() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        for (path, text) in checked_in() {
            let file = std::fs::read_to_string(root.join(path)).expect(path);
            assert!(
                file == text,
                "{path} differs from what testkit/src/envoy_files.rs generates: edit it there and \
                 run `make configs`"
            );
        }
    }

    #[test]
    fn each_file_says_where_it_comes_from() {
        for (path, text) in checked_in() {
            assert!(text.contains(GENERATED), "{path}");
        }
    }
}
