//! What Envoy runs, through `envoy --mode validate` with the real module in place: every Envoy
//! configuration shipped, the plugin configurations inside the WasmPlugins and the
//! EnvoyExtensionPolicy, and what deploy/istio/envoyfilter-ratelimit.yaml patches in.

use super::*;

/// Every Envoy configuration shipped passes `envoy --mode validate` with the real module in place.
#[test]
fn envoy_configs_validate() {
    let (envoy, wasm) = envoy_and_module();
    let dir = TempDir::new("deploy-envoy");
    let configs = envoy_configs();
    assert!(
        configs
            .iter()
            .any(|p| p.starts_with(workspace_root().join("deploy"))),
        "an Envoy configuration under deploy/: {configs:?}"
    );
    for (i, cfg) in configs.iter().enumerate() {
        let yaml = fs::read_to_string(cfg).expect("read config");
        let path = dir.path().join(format!("envoy-{i}.yaml"));
        fs::write(&path, envoy::with_module(&yaml, &wasm)).expect("write");
        if let Err(out) = envoy::validate(&envoy, &path) {
            panic!("{} does not validate:\n{out}", cfg.display());
        }
        eprintln!("{}: OK", cfg.display());
    }
}

/// The plugin configurations inside the WasmPlugins and the EnvoyExtensionPolicy are accepted by the
/// real module (its `on_configure`, run by Envoy's validate mode, refuses a bad one).
#[test]
fn shipped_plugin_configs_load_in_the_module() {
    let configs = plugin_configs_load_in_the_module("deploy-plugin-configs", &manifests());
    assert!(
        configs.len() >= 3,
        "plugin configurations found: {configs:?}"
    );
}

/// The `value` blocks of an EnvoyFilter's patches, in order, without their 8-space indentation.
fn patch_values(envoyfilter: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut lines = envoyfilter.lines().peekable();
    while let Some(l) = lines.next() {
        if l != "      value:" {
            continue;
        }
        let mut block = Vec::new();
        while let Some(next) = lines.peek() {
            if !next.starts_with("        ") && !next.trim().is_empty() {
                break;
            }
            block.push(next.get(8..).unwrap_or("").to_string());
            lines.next();
        }
        out.push(block);
    }
    out
}

/// Envoy accepts what deploy/istio/envoyfilter-ratelimit.yaml patches in (CRD schemas leave patch
/// values free-form): its ratelimit filter and route actions, placed where Istio puts them, pass
/// `envoy --mode validate`.
#[test]
fn istio_ratelimit_envoyfilter_validates_in_envoy() {
    let (envoy, wasm) = envoy_and_module();
    let dir = TempDir::new("deploy-envoyfilter");
    let ef = fs::read_to_string(workspace_root().join("deploy/istio/envoyfilter-ratelimit.yaml"))
        .expect("read the EnvoyFilter");
    let values = patch_values(&ef);
    assert_eq!(values.len(), 2, "{values:?}");
    let block = |lines: &[String]| -> String { lines.iter().map(|l| format!("{l}\n")).collect() };
    // The gateway: the patches placed where Istio puts them (the filter before the router, the
    // descriptors on the virtual host), the service under the cluster name Istio generates.
    let mut spec = EnvoySpec::new(None, closed_port(), closed_port());
    spec.answer_directly("direct\n");
    spec.service_cluster = "outbound|9081||tollgate.tollgate-system.svc.cluster.local".to_string();
    spec.extra_http_filters.push(block(&values[0]));
    spec.virtual_host_extra = Some(block(&values[1]));
    let yaml = spec.yaml(&wasm, closed_port(), closed_port());
    assert!(yaml.contains("envoy.filters.http.ratelimit") && yaml.contains("rate_limits:"));
    let path = dir.path().join("gateway.yaml");
    fs::write(&path, &yaml).expect("write");
    if let Err(out) = envoy::validate(&envoy, &path) {
        panic!("the EnvoyFilter's patches do not validate:\n{yaml}\n{out}");
    }
    // Not a rubber stamp: a misspelt field of the filter fails.
    let bad = yaml.replacen("failure_mode_deny", "failure_mode_denied", 1);
    fs::write(&path, &bad).expect("write");
    let err = envoy::validate(&envoy, &path).expect_err("a misspelt field passed");
    assert!(err.contains("failure_mode_denied"), "{err}");
}
