//! The deployment files: every Kubernetes manifest under deploy/ against the published schemas, and
//! every Envoy configuration the project ships through `envoy --mode validate` with the real module
//! (validate mode loads the module and runs its `on_configure`, so a plugin configuration the module
//! would refuse fails here too).
//!
//! Layout:
//! - [`Validators`]: kubernetes-validate (Kubernetes' own OpenAPI schemas, strict: unknown fields are
//!   errors) and deploy/check/crds.mjs (Istio's and Envoy Gateway's CRD schemas, from the pinned
//!   @kubernetes-models packages), both installed into .tools/ by `make images`
//! - [`manifests`], [`envoy_configs`]: what the project ships, found by walking the tree
//! - tests: all manifests valid; a typo'd field fails each validator; Envoy configs valid; the plugin
//!   configurations inside WasmPlugin / EnvoyExtensionPolicy accepted by the real module; no token
//!   under deploy/ that the real service would start with (markers only).
//! - the Helm chart (deploy/helm/tollgate), by a real Helm (.tools/helm, `make images`): linted;
//!   rendered with the defaults, each optional part and each store, every rendering through the
//!   validators; its WasmPlugin's configuration run by the module; its default rendering run by the
//!   real service, volumes projected as kubelet does (ready, token demanded, limits reloaded); a
//!   random token when none is given, the same in the Secret and the WasmPlugin; the schema refusing
//!   exactly the tokens the service refuses.
//!
//! A missing validator, Helm, Envoy or module fails the test (`make images`, `make build`).

// A test fails by panicking; the workspace lints deny that for the module, not here.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::*;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

// ---------------------------------------------------------------------------------------------
// Validators

struct Validators {
    /// .tools/kubernetes-validate (a pip --target directory).
    kubernetes_validate: PathBuf,
    /// .tools/crd-schemas (an npm prefix holding the @kubernetes-models packages).
    crd_schemas: PathBuf,
}

impl Validators {
    fn get() -> Validators {
        let tools = workspace_root().join(".tools");
        let v = Validators {
            kubernetes_validate: tools.join("kubernetes-validate"),
            crd_schemas: tools.join("crd-schemas"),
        };
        assert!(
            v.kubernetes_validate.join("kubernetes_validate").is_dir(),
            "{} is missing: run `make images`. Validation does not skip.",
            v.kubernetes_validate.display()
        );
        assert!(
            v.crd_schemas
                .join("node_modules/@kubernetes-models/istio")
                .is_dir()
                && v.crd_schemas
                    .join("node_modules/@kubernetes-models/envoy-gateway")
                    .is_dir(),
            "{} is missing: run `make images`. Validation does not skip.",
            v.crd_schemas.display()
        );
        v
    }

    /// kubernetes-validate --strict over `files`.
    fn core(&self, files: &[PathBuf]) -> Output {
        Command::new("python3")
            .args(["-m", "kubernetes_validate", "--strict"])
            .args(files)
            .env("PYTHONPATH", &self.kubernetes_validate)
            .output()
            .expect("python3 is required to run kubernetes-validate")
    }

    /// Both validators over `files`, every document checked by one of them: the custom resources
    /// by crds.mjs, every other by kubernetes-validate. Their reports (CRDs, core).
    fn all_valid(&self, files: &[PathBuf]) -> (String, String) {
        let crds = self.crds(files, None);
        let crd_text = text(&crds);
        assert!(crds.status.success(), "CRD validation failed:\n{crd_text}");
        let checked = crd_text.lines().filter(|l| l.starts_with("ok ")).count();
        let core = crd_text.lines().filter(|l| l.starts_with("core ")).count();
        let k8s = self.core(files);
        let k8s_text = text(&k8s);
        assert!(
            k8s.status.success(),
            "kubernetes-validate failed:\n{k8s_text}"
        );
        let passed = k8s_text
            .lines()
            .filter(|l| l.contains(" passed for resource "))
            .count();
        assert_eq!(
            passed, core,
            "every core document validated by kubernetes-validate:\n{k8s_text}\n{crd_text}"
        );
        eprintln!(
            "{checked} custom resources and {core} core resources valid in {} files",
            files.len()
        );
        (crd_text, k8s_text)
    }

    /// deploy/check/crds.mjs over `files` (optionally writing the plugin configurations).
    fn crds(&self, files: &[PathBuf], plugin_configs: Option<&Path>) -> Output {
        let mut cmd = Command::new("node");
        cmd.arg(workspace_root().join("deploy/check/crds.mjs"))
            .arg(&self.crd_schemas);
        if let Some(dir) = plugin_configs {
            cmd.arg("--plugin-configs").arg(dir);
        }
        cmd.args(files)
            .output()
            .expect("node is required to run deploy/check/crds.mjs")
    }
}

/// A real component (env var, else the workspace default); missing = test failure.
fn required(var: &str, default_rel: &str) -> PathBuf {
    required_component(
        var,
        default_rel,
        ": run `make build`. Validation needs the real component and does not skip.",
    )
}

/// (Envoy, the module).
fn envoy_and_module() -> (PathBuf, PathBuf) {
    (
        required("TOLLGATE_ENVOY", ".tools/envoy"),
        required("TOLLGATE_WASM", "dist/tollgate.wasm"),
    )
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

// ---------------------------------------------------------------------------------------------
// What the project ships

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries {
        let p = e.expect("dir entry").path();
        if p.is_dir() {
            yaml_files(&p, out);
        } else if matches!(p.extension().and_then(|x| x.to_str()), Some("yaml" | "yml")) {
            out.push(p);
        }
    }
}

fn is_envoy_config(path: &Path) -> bool {
    fs::read_to_string(path)
        .map(|t| t.lines().any(|l| l.starts_with("static_resources:")))
        .unwrap_or(false)
}

/// Every Kubernetes manifest under deploy/ (YAML that is not an Envoy configuration), but the Helm
/// chart's sources: templates are checked as Helm renders them ([`Chart`]).
fn manifests() -> Vec<PathBuf> {
    let mut files = Vec::new();
    yaml_files(&workspace_root().join("deploy"), &mut files);
    let chart = workspace_root().join(CHART);
    files.retain(|f| !is_envoy_config(f) && !f.starts_with(&chart));
    files.sort();
    assert!(files.len() >= 5, "manifests under deploy/: {files:?}");
    files
}

/// Every Envoy configuration shipped: envoy.yaml at the top, and any under deploy/ or tests/fixtures/.
fn envoy_configs() -> Vec<PathBuf> {
    let root = workspace_root();
    let mut files = Vec::new();
    for f in ["envoy.yaml", "envoy.yml"] {
        if root.join(f).is_file() {
            files.push(root.join(f));
        }
    }
    yaml_files(&root.join("deploy"), &mut files);
    yaml_files(&root.join("tests/fixtures"), &mut files);
    files.retain(|f| is_envoy_config(f));
    files.sort();
    files.dedup();
    files
}

// ---------------------------------------------------------------------------------------------
// Tests

/// Every manifest is valid: custom resources against Istio's / Envoy Gateway's / Gateway API's CRD
/// schemas with no unknown field, every other document against Kubernetes' schemas (strict), and no
/// document left unchecked.
#[test]
fn manifests_match_published_schemas() {
    let v = Validators::get();
    let files = manifests();
    let (crd_text, k8s_text) = v.all_valid(&files);
    for kind in [
        "WasmPlugin/",
        "EnvoyExtensionPolicy/",
        "HTTPRoute/",
        "EnvoyFilter/",
    ] {
        assert!(
            crd_text
                .lines()
                .any(|l| l.starts_with("ok ") && l.contains(kind)),
            "no {kind} checked:\n{crd_text}"
        );
    }
    for kind in [
        "deployment/",
        "service/",
        "poddisruptionbudget/",
        "secret/",
        "namespace/",
        "configmap/",
    ] {
        assert!(
            k8s_text.contains(kind),
            "no {kind} in the manifests:\n{k8s_text}"
        );
    }
}

/// The validators are not rubber stamps: one typo'd field in a copy of each kind of manifest fails,
/// and the failure names the field.
#[test]
fn a_typo_fails_validation() {
    let v = Validators::get();
    let dir = TempDir::new("deploy-typo");
    let root = workspace_root();
    let cases = [
        (
            "deploy/istio/wasmplugin.yaml",
            "  failStrategy:",
            "  failStrategie:",
            "failStrategie",
            true,
        ),
        (
            "deploy/envoy-gateway/envoyextensionpolicy.yaml",
            "    failOpen:",
            "    failopen:",
            "failopen",
            true,
        ),
        (
            "deploy/envoy-gateway/tollgate-route.yaml",
            "    backendRefs:",
            "    backendRef:",
            "backendRef",
            true,
        ),
        (
            "deploy/istio/envoyfilter-ratelimit.yaml",
            "      operation: INSERT_BEFORE",
            "      operatio: INSERT_BEFORE",
            "operatio",
            true,
        ),
        (
            "deploy/kubernetes/tollgate.yaml",
            "        readinessProbe:",
            "        readinesProbe:",
            "readinesProbe",
            false,
        ),
    ];
    for (file, from, to, field, crd) in cases {
        let original = fs::read_to_string(root.join(file)).expect("read manifest");
        assert!(original.contains(from), "{file} has {from:?}");
        let bad = dir.path().join(Path::new(file).file_name().expect("name"));
        fs::write(&bad, original.replacen(from, to, 1)).expect("write");
        let out = if crd {
            v.crds(std::slice::from_ref(&bad), None)
        } else {
            v.core(std::slice::from_ref(&bad))
        };
        let t = text(&out);
        assert!(!out.status.success(), "{file} with {to:?} passed:\n{t}");
        assert!(t.contains(field), "{file}: the failure names {field}:\n{t}");
    }
}

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

/// Every plugin configuration in the WasmPlugins and EnvoyExtensionPolicies of `files`, each run by
/// the real module in `envoy --mode validate` (a refusal fails the test); the configurations, parsed.
fn plugin_configs_load_in_the_module(label: &str, files: &[PathBuf]) -> Vec<serde_json::Value> {
    let (envoy, wasm) = envoy_and_module();
    let v = Validators::get();
    let dir = TempDir::new(label);
    let out_dir = dir.path().join("configs");
    fs::create_dir_all(&out_dir).expect("mkdir");
    let out = v.crds(files, Some(&out_dir));
    assert!(out.status.success(), "{}", text(&out));
    let mut configs: Vec<PathBuf> = fs::read_dir(&out_dir)
        .expect("configs")
        .map(|e| e.expect("entry").path())
        .collect();
    configs.sort();
    let mut parsed_all = Vec::new();
    for cfg in &configs {
        let json = fs::read_to_string(cfg).expect("read");
        let parsed: serde_json::Value = serde_json::from_str(&json).expect("JSON");
        let cluster = parsed["service"]["cluster"]
            .as_str()
            .expect("service.cluster");
        let yaml = module_config(&wasm, &json, cluster);
        let path = dir.path().join("envoy.yaml");
        fs::write(&path, yaml).expect("write");
        if let Err(out) = envoy::validate(&envoy, &path) {
            panic!("the module refuses {}:\n{json}\n{out}", cfg.display());
        }
        eprintln!("{}: accepted by the module", cfg.display());
        parsed_all.push(parsed);
    }
    parsed_all
}

/// A minimal Envoy configuration running the module with `plugin_json`, calling a cluster of the
/// name the deployment generates (Istio's `outbound|...`, Envoy Gateway's `httproute/...`).
fn module_config(wasm: &Path, plugin_json: &str, cluster: &str) -> String {
    let mut spec = EnvoySpec::new(Some(plugin_json.to_string()), closed_port(), closed_port());
    spec.service_cluster = cluster.to_string();
    spec.answer_directly("direct\n");
    spec.yaml(wasm, closed_port(), closed_port())
}

/// The limits file shipped in the RLS ConfigMap (`data."limits.yaml"`), as the block's text.
fn rls_limits_of(configmap: &str) -> String {
    let mut lines = configmap
        .lines()
        .skip_while(|l| l.trim() != "limits.yaml: |");
    lines
        .next()
        .expect("a `limits.yaml: |` block in the ConfigMap");
    lines
        .take_while(|l| l.is_empty() || l.starts_with("    "))
        .map(|l| format!("{}\n", l.get(4..).unwrap_or("")))
        .collect()
}

/// The limits file of deploy/kubernetes/rls-limits.yaml is accepted by the real service (which
/// refuses to start on a limits file it cannot load), and a typo in it is refused with the field
/// named.
#[test]
fn rls_limits_configmap_loads_in_the_service() {
    let c = Components::get();
    let dir = TempDir::new("deploy-rls-limits");
    let cm = fs::read_to_string(workspace_root().join("deploy/kubernetes/rls-limits.yaml"))
        .expect("read the ConfigMap");
    let limits = rls_limits_of(&cm);
    assert!(limits.contains("domain: edge"), "{limits}");
    let path = dir.path().join("limits.yaml");
    fs::write(&path, &limits).expect("write");
    let arg = path.to_str().expect("UTF-8 path");
    let service = Service::start_with(&c, &dir, None, &["--rls-config", arg]);
    assert!(
        service.proc.log_text().contains("listening"),
        "{}",
        service.proc.log_text()
    );
    drop(service);
    let bad = dir.path().join("bad.yaml");
    fs::write(
        &bad,
        limits.replacen("requests_per_unit", "request_per_unit", 1),
    )
    .expect("write");
    let out = Command::new(&c.server)
        .args(["--listen", "127.0.0.1:0", "--rls-config"])
        .arg(&bad)
        .output()
        .expect("run tollgate-server");
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(t.contains("request_per_unit"), "{t}");
}

// ---------------------------------------------------------------------------------------------
// Tokens

/// Whether the real service starts with `token` as its takes' token (TOLLGATE_TOKEN), in memory
/// on a port the system picks: Ok once it listens (then it is stopped), else what it said as it
/// exited. `label` names its log in `dir`.
fn service_takes_token(
    server: &Path,
    dir: &TempDir,
    label: &str,
    token: &str,
) -> Result<(), String> {
    let mut cmd = Command::new(server);
    cmd.env_clear()
        .env("TOLLGATE_TOKEN", token)
        .args(["--listen", "127.0.0.1:0"]);
    let mut proc = Proc::spawn(
        "tollgate-server",
        cmd,
        dir.log_file(&format!("token-{label}")),
    );
    let limit = std::time::Duration::from_secs(20);
    let deadline = std::time::Instant::now() + limit;
    loop {
        if proc.exited().is_some() {
            return Err(proc.log_text());
        }
        if proc.log_text().contains("listening") {
            return Ok(());
        }
        assert!(
            std::time::Instant::now() < deadline,
            "tollgate-server neither listening nor exited after {limit:?}:\n{}",
            proc.log_text()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Every bearer token written in `text`: the value of a `token:` key (YAML, or JSON's
/// `"token":`) and the word after `Bearer `. Comment lines, empty values and what stands for a
/// token elsewhere (`{{ ... }}`, `$VAR`, `<token>`) are left out.
fn tokens_in(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
        let keys = ["token:", "\"token\":"].into_iter().flat_map(|key| {
            line.match_indices(key)
                .filter(|(at, _)| {
                    line[..*at]
                        .chars()
                        .next_back()
                        .is_none_or(|c| !(c.is_alphanumeric() || "_-.".contains(c)))
                })
                .map(move |(at, _)| &line[at + key.len()..])
        });
        let bearers = line
            .match_indices("Bearer ")
            .map(|(at, _)| &line[at + "Bearer ".len()..]);
        for rest in keys.chain(bearers) {
            let word = rest
                .trim_start()
                .split([' ', ',', '}'])
                .next()
                .unwrap_or("")
                .trim_matches(['"', '\'', '\\']);
            if !word.is_empty() && !word.starts_with(['$', '{', '<']) {
                found.push(word.to_string());
            }
        }
    }
    found
}

/// No file under deploy/ carries a token the service would start with: each manifest's Secret,
/// WasmPlugin, EnvoyExtensionPolicy and EnvoyFilter holds a marker that the real service refuses
/// (a cluster applied as shipped has no token anyone could know). The check itself finds tokens
/// in every form they take there and tells a real token from a marker.
#[test]
fn no_manifest_carries_a_token_the_service_accepts() {
    let c = Components::get();
    let dir = TempDir::new("deploy-tokens");
    // The check can fail: it finds each form, and the service starts with a real token.
    let sample = "  token: tok-a\n    {\"token\": \"tok-b\", \"x\": 1}\n  value: Bearer tok-c\n\
                  # token: not-one\n  automountServiceAccountToken: false\n  token: \"{{ x }}\"\n\
                  fail \"service.token: with ...\"\n";
    assert_eq!(tokens_in(sample), ["tok-a", "tok-b", "tok-c"]);
    let real = "Zx8Qm2LrT5vN0kWc7HdJ4pYs1FgB9aEu6tRoXi3MqVnKbLhC";
    assert_eq!(service_takes_token(&c.server, &dir, "real", real), Ok(()));

    let mut files = Vec::new();
    all_files(&workspace_root().join("deploy"), &mut files);
    let mut places = Vec::new();
    for f in &files {
        let Ok(text) = fs::read_to_string(f) else {
            continue;
        };
        for token in tokens_in(&text) {
            places.push((
                f.strip_prefix(workspace_root()).unwrap_or(f).to_path_buf(),
                token,
            ));
        }
    }
    for shipped in [
        "deploy/kubernetes/tollgate.yaml",
        "deploy/istio/wasmplugin.yaml",
        "deploy/istio/wasmplugin-grpc.yaml",
        "deploy/istio/envoyfilter-ratelimit.yaml",
        "deploy/envoy-gateway/envoyextensionpolicy.yaml",
    ] {
        assert!(
            places.iter().any(|(f, _)| f == Path::new(shipped)),
            "no token found in {shipped}: {places:?}"
        );
    }
    let mut tokens: Vec<&String> = places.iter().map(|(_, t)| t).collect();
    tokens.sort();
    tokens.dedup();
    for (i, token) in tokens.into_iter().enumerate() {
        let at: Vec<_> = places
            .iter()
            .filter(|(_, t)| t == token)
            .map(|(f, _)| f)
            .collect();
        let said = service_takes_token(&c.server, &dir, &format!("shipped-{i}"), token)
            .err()
            .unwrap_or_else(|| panic!("the service starts with {token:?}, shipped in {at:?}"));
        assert!(
            said.contains("the bearer token (--token, TOLLGATE_TOKEN or --token-file)"),
            "{token:?} ({at:?}) refused for another reason:\n{said}"
        );
        eprintln!("{token:?}, in {at:?}: refused by the service");
    }
}

/// Every file under `dir`, recursively.
fn all_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries {
        let p = e.expect("dir entry").path();
        if p.is_dir() {
            all_files(&p, out);
        } else {
            out.push(p);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Alerts and dashboard (deploy/monitoring)

/// promtool, from Debian's prometheus package (`make images`); missing = test failure.
fn promtool() -> PathBuf {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|d| d.join("promtool"))
        .find(|p| p.is_file());
    found.expect("promtool is missing: run `make images` (Debian package prometheus). Validation does not skip.")
}

/// The rule groups of the PrometheusRule: its `spec`, as a Prometheus rules file.
fn rules_file_of(manifest: &str) -> String {
    let mut lines = manifest.lines().skip_while(|l| *l != "spec:");
    lines.next().expect("spec: in the PrometheusRule");
    lines
        .map(|l| format!("{}\n", l.get(2..).unwrap_or("")))
        .collect()
}

fn promtool_run(args: &[&str], dir: &Path) -> Output {
    Command::new(promtool())
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run promtool")
}

/// The alert rules pass `promtool check rules`, and `promtool test rules` shows each alert firing on
/// the series it is about and staying quiet on healthy ones.
#[test]
fn alert_rules_pass_promtool() {
    let dir = TempDir::new("deploy-alerts");
    let manifest =
        fs::read_to_string(workspace_root().join("deploy/monitoring/prometheusrule.yaml"))
            .expect("read the PrometheusRule");
    fs::write(dir.path().join("rules.yaml"), rules_file_of(&manifest)).expect("write");
    let out = promtool_run(&["check", "rules", "rules.yaml"], dir.path());
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("SUCCESS: 7 rules found"),
        "{}",
        text(&out)
    );
    // 1 fallback decision/s, 10% of calls UNAVAILABLE, 2 Redis timeouts/s; the breaker closed.
    let tests = r#"rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
- interval: 1m
  input_series:
  - {series: 'tollgate_fallback_allowed{pod="a"}', values: '0+60x30'}
  - {series: 'tollgate_fallback_limited{pod="a"}', values: '0x30'}
  - {series: 'tollgate_breaker_open{pod="a"}', values: '0x30'}
  - {series: 'tollgate_requests_total{transport="grpc",code="ok"}', values: '0+5400x30'}
  - {series: 'tollgate_requests_total{transport="grpc",code="unavailable"}', values: '0+600x30'}
  - {series: 'tollgate_store_errors_total{kind="timeout"}', values: '0+120x30'}
  - {series: 'tollgate_store_duration_seconds_bucket{le="0.005"}', values: '0+100x30'}
  - {series: 'tollgate_store_duration_seconds_bucket{le="+Inf"}', values: '0+100x30'}
  - {series: 'tollgate_rls_config_ok{pod="a"}', values: '1x10 0x20'}
  - {series: 'tollgate_rls_config_ok{pod="b"}', values: '1x30'}
  - {series: 'tollgate_rls_stat_keys_overflow_total{pod="a"}', values: '0x5 0+60x25'}
  alert_rule_test:
  - eval_time: 5m
    alertname: TollgateRlsStatKeysOverflow
    exp_alerts: []
  - eval_time: 20m
    alertname: TollgateRlsStatKeysOverflow
    exp_alerts:
    - exp_labels: {severity: info}
      exp_annotations:
        summary: tollgate-server's RLS statistics are at their key bound
        description: "1 descriptors/s counted under key=\"other\"; drop detailed_metric or value_to_metric where values are unbounded."
  - eval_time: 1m
    alertname: TollgateFallbackInUse
    exp_alerts: []
  - eval_time: 20m
    alertname: TollgateFallbackInUse
    exp_alerts:
    - exp_labels: {severity: warning}
      exp_annotations:
        summary: Envoys are rate limiting on their local fallback
        description: "1 requests/s decided without tollgate-server for 2 minutes: the service or Redis is unreachable or slow."
  - eval_time: 20m
    alertname: TollgateBreakerOpen
    exp_alerts: []
  - eval_time: 20m
    alertname: TollgateStoreSlow
    exp_alerts: []
  - eval_time: 10m
    alertname: TollgateRlsLimitsRefused
    exp_alerts: []
  - eval_time: 20m
    alertname: TollgateRlsLimitsRefused
    exp_alerts:
    - exp_labels: {severity: warning}
      exp_annotations:
        summary: tollgate-server refused its RLS limits file
        description: The limits file changed and does not load; the previous limits stay in force. The service's log names the error.
  - eval_time: 20m
    alertname: TollgateServiceUnavailable
    exp_alerts:
    - exp_labels: {severity: critical}
      exp_annotations:
        summary: tollgate-server answers more than 1% of calls with 503 / UNAVAILABLE
        description: "10% of calls failed for 5 minutes; the filters are on their failure mode."
  - eval_time: 20m
    alertname: TollgateRedisErrors
    exp_alerts:
    - exp_labels: {severity: warning, kind: timeout}
      exp_annotations:
        summary: "tollgate-server gets Redis errors (timeout)"
        description: "2 store errors/s of kind timeout for 2 minutes."
"#;
    fs::write(dir.path().join("tests.yaml"), tests).expect("write");
    let out = promtool_run(&["test", "rules", "tests.yaml"], dir.path());
    assert!(out.status.success(), "{}", text(&out));
}

/// The Grafana dashboard: JSON with the fields Grafana needs, every query valid PromQL (promtool
/// checks each as a recording rule), and every metric it reads one that exists: the service's as a
/// real tollgate-server exposes them, the filter's as docs/filter-config.md lists them.
#[test]
fn grafana_dashboard_queries_are_valid() {
    let c = Components::get();
    let dir = TempDir::new("deploy-dashboard");
    let text_of = |p: &str| fs::read_to_string(workspace_root().join(p)).expect("read");
    let d: serde_json::Value =
        serde_json::from_str(&text_of("deploy/monitoring/grafana-dashboard.json"))
            .expect("the dashboard is JSON");
    assert!(d["title"].is_string() && d["uid"].is_string(), "{d}");
    assert!(d["schemaVersion"].as_u64().is_some_and(|v| v >= 36), "{d}");
    let panels = d["panels"].as_array().expect("panels");
    let mut exprs = Vec::new();
    for p in panels {
        assert!(p["title"].is_string() && p["type"].is_string() && p["gridPos"].is_object());
        for t in p["targets"].as_array().expect("targets") {
            exprs.push(t["expr"].as_str().expect("expr").to_string());
        }
    }
    assert!(exprs.len() >= 8, "{exprs:?}");
    // The operator's next step from a limited client: the admin endpoints' URL forms.
    let inspect = panels
        .iter()
        .find(|p| p["title"] == "Inspect a bucket")
        .and_then(|p| p["options"]["content"].as_str())
        .expect("the \"Inspect a bucket\" text panel");
    for form in [
        "/v1/buckets?key=",
        "/v1/buckets?kind=concurrency",
        "/v1/buckets/reset",
    ] {
        assert!(inspect.contains(form), "{form} in {inspect}");
    }
    // Grafana's $__rate_interval is not PromQL: promtool sees 5m.
    let mut rules = String::from("groups:\n- name: dashboard\n  rules:\n");
    for (i, e) in exprs.iter().enumerate() {
        let e = e.replace("$__rate_interval", "5m");
        rules.push_str(&format!("  - record: dashboard:q{i}\n    expr: {e:?}\n"));
    }
    fs::write(dir.path().join("q.yaml"), rules).expect("write");
    let out = promtool_run(&["check", "rules", "q.yaml"], dir.path());
    assert!(out.status.success(), "{}", text(&out));
    // Which metrics exist: the live service's names, the filter's documented ones.
    // Labelled families show once they have a sample: one take allowed, one refused by a full
    // memory store (a store error),
    // and one change of an RLS limits file.
    let limits = dir.path().join("limits.yaml");
    let one = |n: u32| {
        format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{unit: second, requests_per_unit: {n}}}\n")
    };
    fs::write(&limits, one(1)).expect("write");
    let service = Service::start_with(
        &c,
        &dir,
        None,
        &[
            "--memory-max-buckets",
            "1",
            "--rls-config",
            limits.to_str().expect("UTF-8"),
            "--rls-config-poll-ms",
            "20",
        ],
    );
    fs::write(dir.path().join("next.yaml"), one(2)).expect("write");
    fs::rename(dir.path().join("next.yaml"), &limits).expect("rename");
    assert!(eventually(std::time::Duration::from_secs(5), || service
        .metrics()
        .contains("# TYPE tollgate_rls_config_reloads ")));
    let take = |key: &str| {
        let body = format!(r#"{{"buckets":[{{"key":"{key}","capacity":1,"period_ms":1000}}]}}"#);
        Client::new()
            .post(
                &format!("http://127.0.0.1:{}/v1/take", service.port),
                &[("content-type", "application/json")],
                body.as_bytes(),
            )
            .status
    };
    assert_eq!((take("a"), take("b")), (200, 503));
    // One RLS call (ShouldRateLimit, domain d, descriptor k=v with hits_addend 0, a check that
    // needs no room in the full store; gRPC framing over HTTP/1.1, which the service decides all
    // the same), so the per-descriptor statistics have a sample.
    let msg: &[u8] = &[
        0x0a, 1, b'd', 0x12, 10, 0x0a, 6, 0x0a, 1, b'k', 0x12, 1, b'v', 0x1a, 0,
    ];
    let mut frame = vec![0, 0, 0, 0, msg.len() as u8];
    frame.extend_from_slice(msg);
    let _ = Client::new().post(
        &format!(
            "http://127.0.0.1:{}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
            service.port
        ),
        &[("content-type", "application/grpc"), ("te", "trailers")],
        &frame,
    );
    assert!(eventually(std::time::Duration::from_secs(5), || service
        .metrics()
        .contains("tollgate_rls_hits_total{")));
    let exposed = service.metrics();
    let documented = text_of("docs/filter-config.md").replace('.', "_");
    let mut names: Vec<String> = exprs
        .iter()
        .flat_map(|e| {
            e.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("tollgate_"))
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    names.sort();
    names.dedup();
    for n in &names {
        // A family shows as `# TYPE <name without _total/_bucket> <type>` before its first sample.
        let family = ["_total", "_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| n.strip_suffix(s))
            .unwrap_or(n);
        let known = exposed.contains(&format!("# TYPE {family} "))
            || documented.contains(&format!("`{n}`"));
        assert!(known, "the dashboard reads {n}, which nothing exposes");
    }
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

// ---------------------------------------------------------------------------------------------
// The Helm chart (deploy/helm/tollgate), rendered and linted by a real Helm

const CHART: &str = "deploy/helm/tollgate";
const NAMESPACE: &str = "tollgate-system";

/// Each optional part: its value, and the objects it adds.
const PARTS: &[(&str, &[&str])] = &[
    (
        "metrics.serviceMonitor.enabled=true",
        &["ServiceMonitor/tollgate"],
    ),
    (
        "metrics.prometheusRule.enabled=true",
        &["PrometheusRule/tollgate"],
    ),
    (
        "metrics.dashboard.enabled=true",
        &["ConfigMap/tollgate-dashboard"],
    ),
    ("wasmPlugin.enabled=true", &["WasmPlugin/tollgate"]),
    (
        "bundledRedis.enabled=true",
        &["Service/tollgate-redis", "StatefulSet/tollgate-redis"],
    ),
];

/// `--set`s that turn every optional part on.
fn all_on() -> Vec<&'static str> {
    PARTS.iter().flat_map(|(set, _)| ["--set", *set]).collect()
}

/// Helm, pinned, from .tools/ (`make images`; TOLLGATE_HELM overrides); missing = test failure.
fn helm() -> PathBuf {
    required_component(
        "TOLLGATE_HELM",
        ".tools/helm",
        ": run `make images`. The chart is checked by a real Helm and does not skip.",
    )
}

/// `helm <args>` in the workspace root.
fn helm_run(args: &[&str]) -> Output {
    Command::new(helm())
        .args(args)
        .current_dir(workspace_root())
        .output()
        .expect("run helm")
}

/// The chart as `helm template` renders it for release "tollgate" in tollgate-system with `args`
/// (`--set`s, `--set-file`s), written to `dir/<name>.yaml`; the file and its documents.
fn render(dir: &TempDir, name: &str, args: &[&str]) -> (PathBuf, Vec<serde_json::Value>) {
    let mut all = vec!["template", "tollgate", CHART, "--namespace", NAMESPACE];
    all.extend_from_slice(args);
    let out = helm_run(&all);
    assert!(
        out.status.success(),
        "helm template {args:?}:\n{}",
        text(&out)
    );
    let path = dir.path().join(format!("{name}.yaml"));
    fs::write(&path, &out.stdout).expect("write");
    let docs = yaml_docs(&path);
    (path, docs)
}

/// The YAML documents of `file` as JSON, read by the validators' own PyYAML.
fn yaml_docs(file: &Path) -> Vec<serde_json::Value> {
    let v = Validators::get();
    let out = Command::new("python3")
        .args([
            "-c",
            "import json, sys, yaml\n\
             docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d is not None]\n\
             print(json.dumps(docs))",
        ])
        .arg(file)
        .env("PYTHONPATH", &v.kubernetes_validate)
        .output()
        .expect("python3 is required to read YAML");
    assert!(out.status.success(), "{}", text(&out));
    serde_json::from_slice(&out.stdout).expect("JSON from PyYAML")
}

/// "Kind/name" of every document.
fn kinds(docs: &[serde_json::Value]) -> Vec<String> {
    let mut k: Vec<String> = docs
        .iter()
        .map(|d| {
            format!(
                "{}/{}",
                d["kind"].as_str().unwrap_or("?"),
                d["metadata"]["name"].as_str().unwrap_or("?")
            )
        })
        .collect();
    k.sort();
    k
}

/// The one document of `kind` (and `name`, if given).
fn doc<'a>(docs: &'a [serde_json::Value], kind: &str, name: Option<&str>) -> &'a serde_json::Value {
    let found: Vec<_> = docs
        .iter()
        .filter(|d| d["kind"] == kind && name.is_none_or(|n| d["metadata"]["name"] == n))
        .collect();
    assert_eq!(found.len(), 1, "one {kind} {name:?} in {:?}", kinds(docs));
    found[0]
}

/// `helm lint --strict` passes with the default values and with every optional part on, and fails,
/// naming the value, on a store mode that does not exist and on a misspelt key (values.schema.json).
#[test]
fn helm_chart_lints() {
    for extra in [vec![], all_on()] {
        let mut args = vec!["lint", "--strict", CHART];
        args.extend_from_slice(&extra);
        let out = helm_run(&args);
        assert!(out.status.success(), "helm lint {extra:?}:\n{}", text(&out));
        assert!(text(&out).contains("0 chart(s) failed"), "{}", text(&out));
    }
    for (set, named) in [
        ("redis.mode=bogus", "/redis/mode"),
        ("replicaCont=3", "replicaCont"),
    ] {
        let out = helm_run(&["lint", CHART, "--set", set]);
        assert!(!out.status.success(), "{set}: {}", text(&out));
        assert!(text(&out).contains(named), "{set}: {}", text(&out));
    }
}

/// Every rendering of the chart is valid against the published schemas, as deploy/ is: the
/// defaults, each optional part on its own and all of them, and each store. The defaults render
/// what deploy/kubernetes/tollgate.yaml and rls-limits.yaml are (no CRD needed, no Sentinel); each
/// optional part adds its object; the alert rules and the dashboard are deploy/monitoring's.
#[test]
fn helm_chart_renders_valid_manifests() {
    let dir = TempDir::new("helm-render");
    let v = Validators::get();
    let base = [
        "ConfigMap/tollgate-rls-limits",
        "Deployment/tollgate",
        "PodDisruptionBudget/tollgate",
        "Secret/tollgate-token",
        "Service/tollgate",
        "ServiceAccount/tollgate",
    ];
    let mut files = Vec::new();
    let (default_file, defaults) = render(&dir, "default", &[]);
    assert_eq!(kinds(&defaults), base, "the default render");
    let default_text = fs::read_to_string(&default_file).expect("read");
    assert!(!default_text.contains("SENTINEL"), "{default_text}");
    files.push(default_file);

    for (i, (set, added)) in PARTS.iter().enumerate() {
        let (file, docs) = render(&dir, &format!("part-{i}"), &["--set", set]);
        let mut expected: Vec<String> = base
            .iter()
            .chain(added.iter())
            .map(|s| s.to_string())
            .collect();
        expected.sort();
        assert_eq!(kinds(&docs), expected, "{set}");
        files.push(file);
    }
    let (file, all) = render(&dir, "all-on", &all_on());
    let added: usize = PARTS.iter().map(|(_, a)| a.len()).sum();
    assert_eq!(kinds(&all).len(), base.len() + added, "{:?}", kinds(&all));
    files.push(file);

    // The monitoring parts are the shipped files, not copies that drift.
    let shipped = yaml_docs(&workspace_root().join("deploy/monitoring/prometheusrule.yaml"));
    assert_eq!(
        doc(&all, "PrometheusRule", None)["spec"],
        shipped[0]["spec"]
    );
    let dashboard: serde_json::Value = serde_json::from_str(
        doc(&all, "ConfigMap", Some("tollgate-dashboard"))["data"]["tollgate.json"]
            .as_str()
            .expect("the dashboard's JSON"),
    )
    .expect("JSON");
    let shipped_dashboard: serde_json::Value = serde_json::from_str(
        &fs::read_to_string(workspace_root().join("deploy/monitoring/grafana-dashboard.json"))
            .expect("read"),
    )
    .expect("JSON");
    assert_eq!(dashboard, shipped_dashboard);

    // Each store, and the Secrets and ConfigMap a cluster already has.
    let stores: [(&str, &[&str], &str); 6] = [
        (
            "cluster",
            &["--set", "redis.mode=cluster", "--set", "redis.cluster.nodes={redis://redis-cluster-0.redis-cluster:6379,redis://redis-cluster-1.redis-cluster:6379}"],
            "TOLLGATE_REDIS_CLUSTER",
        ),
        (
            "sentinel",
            &["--set", "redis.mode=sentinel", "--set", "redis.sentinel.addresses={redis://redis-sentinel:26379}"],
            "TOLLGATE_REDIS_SENTINEL_MASTER",
        ),
        ("memory", &["--set", "redis.mode=memory", "--set", "replicaCount=1"], "TOLLGATE_LISTEN"),
        (
            "tls",
            &[
                "--set", "redis.url=rediss://redis:6379",
                "--set", "redis.tls.enabled=true",
                "--set", "redis.tls.secretName=tollgate-redis-client-tls",
                "--set", "redis.tls.clientCertificate=true",
            ],
            "TOLLGATE_REDIS_TLS_KEY",
        ),
        (
            "url-secret",
            &["--set", "redis.urlSecret.name=redis-auth", "--set", "token.existingSecret=my-token"],
            "secretKeyRef",
        ),
        (
            "existing-limits",
            &["--set", "rls.existingConfigMap=my-limits", "--set", "podDisruptionBudget.minAvailable=null", "--set", "podDisruptionBudget.maxUnavailable=1"],
            "my-limits",
        ),
    ];
    for (name, args, shows) in stores {
        let (file, _) = render(&dir, name, args);
        let t = fs::read_to_string(&file).expect("read");
        assert!(t.contains(shows), "{name}: {shows} in\n{t}");
        files.push(file);
    }
    // The values docs/deploy.md shows.
    let guide = tollgate_testkit::docs::read("docs/deploy.md");
    let shown = tollgate_testkit::docs::blocks("docs/deploy.md", &guide)
        .into_iter()
        .find(|b| b.info == "yaml partial" && b.text.starts_with("replicaCount:"))
        .expect("docs/deploy.md shows chart values");
    let values = dir.path().join("docs-values.yaml");
    fs::write(&values, &shown.text).expect("write");
    let (file, docs) = render(&dir, "docs", &["-f", values.to_str().expect("UTF-8")]);
    assert!(kinds(&docs).contains(&"ServiceMonitor/tollgate".to_string()));
    files.push(file);

    // Refused at render time, naming the value.
    for (args, names) in [
        (&["--set", "redis.mode=memory"][..], "replicaCount"),
        (&["--set", "redis.mode=cluster"][..], "redis.cluster.nodes"),
        (
            &["--set", "redis.tls.enabled=true"][..],
            "redis.tls.secretName",
        ),
        (
            &[
                "--set",
                "bundledRedis.enabled=true",
                "--set",
                "redis.mode=sentinel",
            ][..],
            "bundledRedis",
        ),
    ] {
        let mut all = vec!["template", "tollgate", CHART];
        all.extend_from_slice(args);
        let out = helm_run(&all);
        assert!(!out.status.success(), "{args:?} rendered");
        assert!(text(&out).contains(names), "{args:?}: {}", text(&out));
    }
    let (crd_text, _) = v.all_valid(&files);
    for kind in ["ServiceMonitor/", "PrometheusRule/", "WasmPlugin/"] {
        assert!(
            crd_text
                .lines()
                .any(|l| l.starts_with("ok ") && l.contains(kind)),
            "no {kind} checked:\n{crd_text}"
        );
    }
}

/// The chart's defaults are the flat manifests, parameterised: the same pod (security, probes,
/// resources, ports), every environment variable deploy/kubernetes/tollgate.yaml sets with the same
/// value, the same rollout, Service ports and disruption budget, and rls-limits.yaml's limits file.
#[test]
fn helm_defaults_are_the_shipped_manifests() {
    let dir = TempDir::new("helm-defaults");
    let (_, chart) = render(&dir, "default", &[]);
    let flat = yaml_docs(&workspace_root().join("deploy/kubernetes/tollgate.yaml"));
    let limits = yaml_docs(&workspace_root().join("deploy/kubernetes/rls-limits.yaml"));
    let pod = |docs: &[serde_json::Value]| {
        doc(docs, "Deployment", None)["spec"]["template"]["spec"].clone()
    };
    let (ours, theirs) = (pod(&chart), pod(&flat));
    assert_eq!(ours["securityContext"], theirs["securityContext"]);
    assert_eq!(
        ours["terminationGracePeriodSeconds"],
        theirs["terminationGracePeriodSeconds"]
    );
    // The chart's spread selector also names the release.
    let spread = |p: &serde_json::Value| p["topologySpreadConstraints"][0]["topologyKey"].clone();
    assert_eq!(spread(&ours), spread(&theirs));
    let (c, f) = (&ours["containers"][0], &theirs["containers"][0]);
    for field in [
        "image",
        "imagePullPolicy",
        "ports",
        "readinessProbe",
        "livenessProbe",
        "resources",
        "securityContext",
    ] {
        assert_eq!(c[field], f[field], "container {field}");
    }
    let env = |c: &serde_json::Value| -> Vec<(String, String)> {
        c["env"]
            .as_array()
            .expect("env")
            .iter()
            .map(|e| {
                let value = e["value"].as_str().expect("a literal value");
                (
                    e["name"].as_str().expect("name").to_string(),
                    value.to_string(),
                )
            })
            .collect()
    };
    let ours_env = env(c);
    for var in env(f) {
        assert!(
            ours_env.contains(&var),
            "{var:?} not in the chart's {ours_env:?}"
        );
    }
    // The chart's addition to the pod: the limits file, mounted where TOLLGATE_RLS_CONFIG points.
    let rls = (
        "TOLLGATE_RLS_CONFIG".to_string(),
        "/etc/tollgate/rls/limits.yaml".to_string(),
    );
    assert!(ours_env.contains(&rls), "{ours_env:?}");
    for kind in ["Deployment", "PodDisruptionBudget"] {
        let spec = |docs: &[serde_json::Value]| {
            let mut s = doc(docs, kind, None)["spec"].clone();
            let s_map = s.as_object_mut().expect("spec");
            s_map.remove("selector");
            s_map.remove("template");
            s
        };
        assert_eq!(spec(&chart), spec(&flat), "{kind}");
    }
    assert_eq!(
        doc(&chart, "Service", None)["spec"]["ports"],
        doc(&flat, "Service", None)["spec"]["ports"]
    );
    assert_eq!(doc(&chart, "ConfigMap", None)["data"], limits[0]["data"]);
}

/// The bundled Redis is deploy/kubernetes/redis.yaml's (pod, ports, Service), the service points
/// at it, and a real redis-server runs with its rendered arguments (no persistence, volatile-ttl
/// eviction under the memory bound).
#[test]
fn helm_bundled_redis_is_the_shipped_one() {
    let c = Components::get();
    let dir = TempDir::new("helm-redis");
    let (_, chart) = render(&dir, "bundled", &["--set", "bundledRedis.enabled=true"]);
    let flat = yaml_docs(&workspace_root().join("deploy/kubernetes/redis.yaml"));
    let pod = |docs: &[serde_json::Value]| {
        doc(docs, "StatefulSet", None)["spec"]["template"]["spec"].clone()
    };
    let (ours, theirs) = (pod(&chart), pod(&flat));
    for field in ["securityContext", "volumes", "automountServiceAccountToken"] {
        assert_eq!(ours[field], theirs[field], "{field}");
    }
    assert_eq!(ours["containers"][0], theirs["containers"][0]);
    let ports = |docs: &[serde_json::Value], name: &str| {
        doc(docs, "Service", Some(name))["spec"]["ports"].clone()
    };
    assert_eq!(ports(&chart, "tollgate-redis"), ports(&flat, "redis"));
    let deployment = doc(&chart, "Deployment", None);
    let env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .expect("env");
    assert!(env.iter().any(|e| e["name"] == "TOLLGATE_REDIS_URL"
        && e["value"] == "redis://tollgate-redis.tollgate-system.svc.cluster.local:6379"));

    let args: Vec<&str> = ours["containers"][0]["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("an argument"))
        .collect();
    let port = free_port();
    let mut redis = tollgate_testkit::redis::spawn(
        &c.redis_server,
        port,
        dir.path(),
        &args,
        dir.log_file("redis"),
    );
    wait_until("redis-server", &mut redis, || redis_ping(port)).expect("redis-server started");
    let config = |key: &str| {
        tollgate_testkit::redis::cli(port, &[], &["CONFIG", "GET", key]).unwrap_or_default()
    };
    assert_eq!(config("maxmemory-policy"), "maxmemory-policy\nvolatile-ttl");
    assert_eq!(
        config("maxmemory"),
        format!("maxmemory\n{}", 192 * 1024 * 1024)
    );
    assert_eq!(config("appendonly"), "appendonly\nno");
}

/// The chart's WasmPlugin, for either transport, carries a configuration the real module accepts,
/// calling the cluster Istio generates for the chart's Service (the shipped WasmPlugin's, for the
/// default release) with the chart's token.
#[test]
fn helm_wasmplugin_config_loads_in_the_module() {
    let dir = TempDir::new("helm-wasmplugin");
    let (http, http_docs) = render(&dir, "http", &["--set", "wasmPlugin.enabled=true"]);
    let (grpc, _) = render(
        &dir,
        "grpc",
        &[
            "--set",
            "wasmPlugin.enabled=true",
            "--set",
            "wasmPlugin.pluginConfig.service.transport=grpc",
            "--set",
            "token.value=another-token-0123456789abcdef01234",
        ],
    );
    let http_cfg = plugin_configs_load_in_the_module("helm-wasmplugin-http", &[http]);
    let grpc_cfg = plugin_configs_load_in_the_module("helm-wasmplugin-grpc", &[grpc]);
    assert_eq!(http_cfg.len(), 1);
    assert_eq!(grpc_cfg.len(), 1);
    let shipped = yaml_docs(&workspace_root().join("deploy/istio/wasmplugin.yaml"));
    assert_eq!(
        http_cfg[0]["service"]["cluster"],
        shipped[0]["spec"]["pluginConfig"]["service"]["cluster"]
    );
    let shipped_grpc = yaml_docs(&workspace_root().join("deploy/istio/wasmplugin-grpc.yaml"));
    assert_eq!(
        grpc_cfg[0]["service"]["cluster"],
        shipped_grpc[0]["spec"]["pluginConfig"]["service"]["cluster"]
    );
    assert_eq!(
        http_cfg[0]["service"]["token"],
        doc(&http_docs, "Secret", None)["stringData"]["token"]
    );
    assert_eq!(
        grpc_cfg[0]["service"]["token"],
        "another-token-0123456789abcdef01234"
    );
}

/// The takes' token of `rendered`: the Secret's, and the WasmPlugin's.
fn rendered_tokens(rendered: &[serde_json::Value]) -> (String, String) {
    let text = |v: &serde_json::Value, what: &str| {
        v.as_str()
            .unwrap_or_else(|| panic!("{what}: {v}"))
            .to_string()
    };
    (
        text(
            &doc(rendered, "Secret", None)["stringData"]["token"],
            "the Secret's token",
        ),
        text(
            &doc(rendered, "WasmPlugin", None)["spec"]["pluginConfig"]["service"]["token"],
            "the WasmPlugin's token",
        ),
    )
}

/// With no token given, the chart makes one (_helpers.tpl, `tollgate.token`): 48 letters and
/// digits in the Secret and the same in the WasmPlugin (one named template for both, so they never
/// differ), another on every render (random: on a cluster the chart reads its Secret back and keeps
/// the token across upgrades, which `helm template` cannot show), and one the service starts with.
/// A token given is the one both carry.
#[test]
fn helm_makes_a_random_token_when_none_is_given() {
    let c = Components::get();
    let dir = TempDir::new("helm-token");
    let tokens = |name: &str, args: &[&str]| {
        let mut all = vec!["--set", "wasmPlugin.enabled=true"];
        all.extend_from_slice(args);
        rendered_tokens(&render(&dir, name, &all).1)
    };
    let (first, in_plugin) = tokens("first", &[]);
    assert_eq!(first.len(), 48, "{first}");
    assert!(first.bytes().all(|b| b.is_ascii_alphanumeric()), "{first}");
    assert_eq!(in_plugin, first, "the WasmPlugin's token is the Secret's");
    let (second, in_plugin) = tokens("second", &[]);
    assert_eq!(in_plugin, second, "the WasmPlugin's token is the Secret's");
    assert_ne!(first, second, "two renders made the same token");
    assert_eq!(service_takes_token(&c.server, &dir, "made", &first), Ok(()));

    let given = "given-token-0123456789abcdef0123456789";
    assert_eq!(
        tokens("given", &["--set", &format!("token.value={given}")]),
        (given.to_string(), given.to_string())
    );
}

/// values.schema.json refuses a token.value the service would refuse, and only those: each value
/// below is rendered by Helm exactly when the real service starts with it. The refusals name
/// `/token/value` (the placeholder earlier charts shipped and deploy/'s marker, in any case; fewer
/// than 32 bytes).
#[test]
fn helm_refuses_the_tokens_the_service_refuses() {
    let c = Components::get();
    let dir = TempDir::new("helm-token-schema");
    let cases = [
        ("replace-with-a-long-random-token", false),
        ("REPLACE-WITH-openssl-rand-hex-32", false),
        ("0123456789abcdef0123456789abcdef-Replace-With", false),
        ("0123456789abcdef0123456789abcde", false),
        ("s3cret", false),
        ("0123456789abcdef0123456789abcdef", true),
        ("Zx8Qm2LrT5vN0kWc7HdJ4pYs1FgB9aEu6tRoXi3MqVnKbLhC", true),
    ];
    for (i, (value, good)) in cases.into_iter().enumerate() {
        let set = format!("token.value={value}");
        let out = helm_run(&["template", "tollgate", CHART, "--set-string", &set]);
        let t = text(&out);
        assert_eq!(out.status.success(), good, "helm, {value}:\n{t}");
        if !good {
            assert!(t.contains("/token/value"), "{value}: {t}");
        }
        let service = service_takes_token(&c.server, &dir, &format!("schema-{i}"), value);
        assert_eq!(service.is_ok(), good, "the service, {value}: {service:?}");
    }
}

/// What kubelet makes of a rendered volume: its Secret's or ConfigMap's keys as files under
/// `root` + `mount_path`, in kubelet's layout (`..data` a symlink to the directory of this
/// `generation`, each key a symlink through it), so that an update swaps one symlink, as kubelet's
/// does.
fn project_volume(root: &Path, mount_path: &str, files: &serde_json::Value, generation: u32) {
    use std::os::unix::fs::symlink;
    let dir = root.join(mount_path.trim_start_matches('/'));
    let gen = format!("..{generation}");
    fs::create_dir_all(dir.join(&gen)).expect("mkdir");
    let files = files.as_object().expect("the volume's keys");
    for (key, value) in files {
        fs::write(dir.join(&gen).join(key), value.as_str().expect("text")).expect("write");
    }
    let tmp = dir.join("..data_tmp");
    symlink(&gen, &tmp).expect("symlink");
    fs::rename(&tmp, dir.join("..data")).expect("swap ..data");
    for key in files.keys() {
        if fs::symlink_metadata(dir.join(key)).is_err() {
            symlink(format!("..data/{key}"), dir.join(key)).expect("symlink");
        }
    }
}

/// The files of a pod volume, from the rendered Secret or ConfigMap it names.
fn volume_files(docs: &[serde_json::Value], volume: &serde_json::Value) -> serde_json::Value {
    if let Some(name) = volume["secret"]["secretName"].as_str() {
        doc(docs, "Secret", Some(name))["stringData"].clone()
    } else if let Some(name) = volume["configMap"]["name"].as_str() {
        doc(docs, "ConfigMap", Some(name))["data"].clone()
    } else {
        panic!("a volume of another kind: {volume}")
    }
}

/// The chart's default values run in the real service: the rendered container's environment as
/// it is (only the listen address and Redis's address swapped for this machine's), its volumes
/// projected from the rendered Secret and ConfigMap as kubelet does. The service gets ready on the
/// readiness probe's path, demands the Secret's token, serves the ConfigMap's limits, and reloads
/// them when the ConfigMap changes (a new render with another limits file).
#[test]
fn helm_default_values_run_in_the_service() {
    let c = Components::get();
    let dir = TempDir::new("helm-service");
    let (_, docs) = render(&dir, "default", &[]);
    let pod = &doc(&docs, "Deployment", None)["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let root = dir.path().join("pod");
    let mounts: Vec<(String, serde_json::Value)> = container["volumeMounts"]
        .as_array()
        .expect("volumeMounts")
        .iter()
        .map(|m| {
            let volume = pod["volumes"]
                .as_array()
                .expect("volumes")
                .iter()
                .find(|v| v["name"] == m["name"])
                .expect("the mount's volume")
                .clone();
            // kubelet never updates a subPath mount: the limits file would never reload.
            assert!(m["subPath"].is_null(), "a subPath mount: {m}");
            (
                m["mountPath"].as_str().expect("mountPath").to_string(),
                volume,
            )
        })
        .collect();
    for (path, volume) in &mounts {
        project_volume(&root, path, &volume_files(&docs, volume), 1);
    }

    let redis = Redis::start(&c, &dir);
    let port = free_port();
    let mut cmd = Command::new(&c.server);
    cmd.env_clear();
    for e in container["env"].as_array().expect("env") {
        let name = e["name"].as_str().expect("name");
        let rendered = e["value"].as_str().expect("a literal value").to_string();
        let value = match name {
            "TOLLGATE_LISTEN" => {
                assert_eq!(rendered, "0.0.0.0:8081");
                format!("127.0.0.1:{port}")
            }
            "TOLLGATE_REDIS_URL" => {
                assert_eq!(
                    rendered,
                    "redis://redis.tollgate-system.svc.cluster.local:6379"
                );
                redis.url()
            }
            _ if mounts.iter().any(|(m, _)| rendered.starts_with(m.as_str())) => root
                .join(rendered.trim_start_matches('/'))
                .to_str()
                .expect("UTF-8")
                .to_string(),
            _ => rendered,
        };
        cmd.env(name, value);
    }
    let mut proc = Proc::spawn("tollgate-server", cmd, dir.log_file("service"));
    let probe = |p: &serde_json::Value| {
        assert_eq!(p["httpGet"]["port"], "api");
        p["httpGet"]["path"].as_str().expect("path").to_string()
    };
    let (ready, live) = (
        probe(&container["readinessProbe"]),
        probe(&container["livenessProbe"]),
    );
    wait_until("tollgate-server", &mut proc, || {
        http_get_status(port, &ready) == Some(200)
    })
    .expect("the service started");
    assert_eq!(http_get_status(port, &live), Some(200));

    // The token of the rendered Secret, demanded.
    let token = doc(&docs, "Secret", None)["stringData"]["token"]
        .as_str()
        .expect("token")
        .to_string();
    let take = |auth: Option<&str>| {
        let body = r#"{"buckets":[{"key":"k","capacity":1,"period_ms":1000}]}"#;
        let bearer = auth.map(|t| format!("Bearer {t}"));
        let mut headers = vec![("content-type", "application/json")];
        if let Some(b) = &bearer {
            headers.push(("authorization", b));
        }
        Client::new()
            .post(
                &format!("http://127.0.0.1:{port}/v1/take"),
                &headers,
                body.as_bytes(),
            )
            .status
    };
    assert_eq!((take(None), take(Some(&token))), (401, 200));

    // The limits file in force, and reloaded from a changed ConfigMap.
    let metrics = || {
        http_get(port, "/metrics")
            .map(|r| r.body)
            .unwrap_or_default()
    };
    assert!(
        metrics().contains("tollgate_rls_config_ok 1"),
        "{}",
        metrics()
    );
    let limits = dir.path().join("limits.yaml");
    fs::write(
        &limits,
        "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: minute, requests_per_unit: 50}\n",
    )
    .expect("write");
    let set_file = format!("rls.limits={}", limits.display());
    let (_, next) = render(&dir, "next", &["--set-file", &set_file]);
    let (path, volume) = mounts
        .iter()
        .find(|(_, v)| v["configMap"].is_object())
        .expect("the limits volume");
    project_volume(&root, path, &volume_files(&next, volume), 2);
    assert!(
        eventually(std::time::Duration::from_secs(10), || metrics()
            .contains(r#"tollgate_rls_config_reloads_total{outcome="ok"} 1"#)),
        "{}\n{}",
        metrics(),
        proc.log_text()
    );
    assert!(metrics().contains("tollgate_rls_config_ok 1"));
}

/// The admin token (`GET /v1/buckets`, `POST /v1/buckets/reset`) is off by default; given a
/// Secret, the service reads it from that Secret's file, mounted apart from the takes' token.
#[test]
fn helm_admin_token_is_mounted_from_its_secret() {
    let dir = TempDir::new("helm-admin");
    let container = |docs: &[serde_json::Value]| {
        doc(docs, "Deployment", None)["spec"]["template"]["spec"]["containers"][0].clone()
    };
    let env = |c: &serde_json::Value, name: &str| {
        c["env"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|e| e["name"] == name)
            .map(|e| e["value"].clone())
    };
    let (_, docs) = render(&dir, "admin-off", &[]);
    assert_eq!(env(&container(&docs), "TOLLGATE_ADMIN_TOKEN_FILE"), None);
    let (_, docs) = render(
        &dir,
        "admin-on",
        &["--set", "adminToken.existingSecret=tollgate-admin"],
    );
    let c = container(&docs);
    assert_eq!(
        env(&c, "TOLLGATE_ADMIN_TOKEN_FILE"),
        Some(serde_json::json!("/etc/tollgate/admin-token/token"))
    );
    let mounts = c["volumeMounts"].as_array().expect("mounts");
    assert!(
        mounts
            .iter()
            .any(|m| m["name"] == "admin-token" && m["mountPath"] == "/etc/tollgate/admin-token"),
        "{mounts:?}"
    );
    let volumes = doc(&docs, "Deployment", None)["spec"]["template"]["spec"]["volumes"].clone();
    assert!(
        volumes
            .as_array()
            .expect("volumes")
            .iter()
            .any(|v| v["name"] == "admin-token" && v["secret"]["secretName"] == "tollgate-admin"),
        "{volumes}"
    );
}
