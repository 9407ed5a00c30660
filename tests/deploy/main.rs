//! The deployment files: every Kubernetes manifest under deploy/ against the published schemas, and
//! every Envoy configuration the project ships through `envoy --mode validate` with the real module
//! (validate mode loads the module and runs its `on_configure`, so a plugin configuration the module
//! would refuse fails here too).
//!
//! A test's name is its module and its function: `helm::helm_chart_lints` (nextest filters in
//! `.config/nextest.toml` match them by `binary(deploy)` and that prefix).
//!
//! Layout:
//! - this file: what the modules share. [`Validators`]: kubernetes-validate (Kubernetes' own
//!   OpenAPI schemas, strict: unknown fields are errors) and deploy/check/crds.mjs (Istio's and
//!   Envoy Gateway's CRD schemas, from the pinned @kubernetes-models packages), both installed
//!   into .tools/ by `make images`; [`manifests`], [`envoy_configs`]: what the project ships, found
//!   by walking the tree; [`plugin_configs_load_in_the_module`]: plugin configurations, found by
//!   `tollgate-server check` (the one reader of where they sit), run by the real module; [`service_takes_token`]: whether the real service starts with a token.
//! - [`common`]: the harness (`tests/common/`, shared with `tests/e2e/` and `tests/image.rs`).
//! - [`kubernetes`]: all manifests valid; a typo'd field fails each validator; the RLS ConfigMap's
//!   limits file loaded by the real service.
//! - [`envoy_validate`]: Envoy configs valid; the plugin configurations inside WasmPlugin /
//!   EnvoyExtensionPolicy accepted by the real module; Istio's ratelimit EnvoyFilter patches
//!   accepted by Envoy.
//! - [`tokens`]: no token under deploy/ that the real service would start with (markers only).
//! - [`monitoring`]: deploy/monitoring's alert rules through promtool, and the Grafana dashboard's
//!   queries and metrics.
//! - [`helm`]: the Helm chart (deploy/helm/tollgate), by a real Helm (.tools/helm, `make images`):
//!   linted; rendered with the defaults, each optional part and each store, every rendering through
//!   the validators; its WasmPlugin's configuration run by the module; its default rendering run by
//!   the real service, volumes projected as kubelet does (ready, token demanded, limits
//!   reloaded); a random token when none is given, the same in the Secret and the WasmPlugin; the
//!   schema refusing exactly the tokens the service refuses.
//!
//! A missing validator, Helm, Envoy or module fails the test (`make images`, `make build`).

// A test fails by panicking; the workspace lints deny that for the module, not here.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

#[path = "../common/mod.rs"]
mod common;
mod envoy_validate;
mod helm;
mod kubernetes;
mod monitoring;
mod tokens;

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
        let crds = self.crds(files);
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

    /// deploy/check/crds.mjs over `files`.
    fn crds(&self, files: &[PathBuf]) -> Output {
        let mut cmd = Command::new("node");
        cmd.arg(workspace_root().join("deploy/check/crds.mjs"))
            .arg(&self.crd_schemas);
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

const CHART: &str = "deploy/helm/tollgate";

/// Every plugin configuration in the WasmPlugins and EnvoyExtensionPolicies of `files` (and any
/// wasm filter's in them), found where `tollgate-server check` finds them (the one reader of those
/// places, server/src/check.rs) and accepted by it, each run by the real module in
/// `envoy --mode validate` (a refusal fails the test); the configurations, parsed.
fn plugin_configs_load_in_the_module(label: &str, files: &[PathBuf]) -> Vec<serde_json::Value> {
    let (envoy, wasm) = envoy_and_module();
    let server = required("TOLLGATE_SERVER_DYNAMIC", "target/debug/tollgate-server");
    let dir = TempDir::new(label);
    let out_dir = dir.path().join("configs");
    fs::create_dir_all(&out_dir).expect("mkdir");
    let mut cmd = Command::new(server);
    cmd.arg("check").arg("--write-configs").arg(&out_dir);
    for f in files {
        cmd.arg("--filter").arg(f);
    }
    let out = cmd.output().expect("run tollgate-server check");
    // A manifest without a plugin configuration is reported (exit status 2) and is no failure here,
    // nor is the summary line; a refused configuration is.
    let report = text(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        matches!(out.status.code(), Some(0 | 2))
            && stderr
                .lines()
                .all(|l| l.contains(": no filter configuration in it") || l.starts_with("check: ")),
        "tollgate-server check:\n{report}"
    );
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
