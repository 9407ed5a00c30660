//! `tollgate-server check` says what Envoy and the service say: every filter configuration the
//! project ships or fuzzes from (the fuzz seeds, the docs' `json filter` blocks, the WasmPlugins
//! the EnvoyExtensionPolicy and the Helm chart in deploy/, envoy.yaml and deploy/envoy/envoy.yaml) and copies made
//! wrong are run through the checker binary, through the module's parser natively, and through a
//! real Envoy loading the real module (`envoy --mode validate` runs its `on_configure`); every
//! limits file shipped (deploy/'s ConfigMap and Helm chart, the docs' `yaml limits` blocks) and copies made wrong
//! through the checker and the real service started on it. The verdicts must agree, and a refusal
//! must carry the very errors Envoy's log or the service's shows, every one of them.
//!
//! Envoy, the module or the CRD schemas (for what Istio hands the module) missing fails the test
//! (`make build`, `make images`).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use tollgate::core::config::Config;
use tollgate_testkit::docs::{self, Kind};
use tollgate_testkit::envoy::{self, EnvoySpec};
use tollgate_testkit::process::{closed_port, required_component, workspace_root, Proc, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_tollgate-server");

/// `tollgate-server check ARGS`: (exit status, stdout, stderr).
fn check(args: &[&str]) -> (i32, String, String) {
    let out: Output = Command::new(BIN)
        .arg("check")
        .args(args)
        .env_clear()
        .output()
        .expect("run tollgate-server check");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// What one reader said: `None` accepted, `Some(errors)` refused, every error it reported.
type Verdict = Option<Vec<String>>;

/// The checker's verdict on a file holding one configuration, from its lines (one when accepted,
/// one per refusal when refused), its summary and its exit status.
fn checker(flag: &str, file: &Path) -> Verdict {
    let (code, out, err) = check(&[flag, file.to_str().expect("UTF-8 path")]);
    let lines: Vec<&str> = out.lines().collect();
    assert!(!lines.is_empty(), "{}:\n{out}{err}", file.display());
    match code {
        0 => {
            assert_eq!(
                lines.len(),
                1,
                "one configuration in {}:\n{out}",
                file.display()
            );
            assert!(
                lines[0].ends_with(": ok") || lines[0].contains(": ok ("),
                "{out}"
            );
            assert_eq!(err, "check: 1 configuration, none refused\n");
            None
        }
        1 => {
            let why: Vec<String> = lines
                .iter()
                .map(|l| {
                    let (_, why) = l
                        .split_once(": refused: ")
                        .unwrap_or_else(|| panic!("a refusal line: {out}"));
                    why.to_string()
                })
                .collect();
            let refusals = match why.len() {
                1 => "1 refusal".to_string(),
                n => format!("{n} refusals"),
            };
            assert_eq!(
                err,
                format!("check: 1 configuration, 1 refused ({refusals})\n")
            );
            Some(why)
        }
        _ => panic!("check {}: exit {code}:\n{out}{err}", file.display()),
    }
}

/// The module's parser, natively, as `on_configure` calls it (an empty configuration never
/// reaches it: the adapter refuses it first).
fn native(json: &[u8]) -> Verdict {
    if json.is_empty() {
        return Some(vec!["config: missing".into()]);
    }
    Config::parse_all(json)
        .err()
        .map(|all| all.iter().map(ToString::to_string).collect())
}

/// Envoy's verdict on a bootstrap: validate mode loads the module and configures it; a refusal is
/// the module's `invalid configuration: ...` lines, one per error.
fn envoy_verdict(envoy_bin: &Path, bootstrap: &Path) -> Verdict {
    match envoy::validate(envoy_bin, bootstrap) {
        Ok(()) => None,
        Err(log) => {
            let lines: Vec<String> = log
                .lines()
                .filter_map(|l| l.split_once("invalid configuration: ").map(|(_, e)| e))
                .map(|e| e.trim_end().to_string())
                .collect();
            assert!(
                !lines.is_empty(),
                "Envoy refused {} without the module's error:\n{log}",
                bootstrap.display()
            );
            Some(lines)
        }
    }
}

/// One filter configuration: the file the checker reads and the Envoy bootstrap that loads the
/// same configuration (and, for a plugin configuration, its JSON and the Envoy it runs in).
struct FilterCase {
    label: String,
    file: PathBuf,
    bootstrap: PathBuf,
    json: Option<Vec<u8>>,
    spec: Option<EnvoySpec>,
    /// Whether the checker can give Envoy's very text (not for protobuf bytes it never sees).
    same_text: bool,
}

/// A case for a plugin configuration as JSON: the checker reads `checked` (the JSON itself, or
/// the YAML it came from); Envoy runs it in a generated bootstrap.
fn plugin_case(
    dir: &Path,
    wasm: &Path,
    label: &str,
    checked: Option<&Path>,
    json: &[u8],
) -> FilterCase {
    let n = fs::read_dir(dir).map(|d| d.count()).unwrap_or(0);
    let text = std::str::from_utf8(json).expect("a UTF-8 plugin configuration");
    let spec = EnvoySpec::new(Some(text.to_string()), closed_port(), closed_port());
    let bootstrap = dir.join(format!("envoy-{n}.yaml"));
    fs::write(&bootstrap, spec.yaml(wasm, closed_port(), closed_port())).expect("write");
    let file = match checked {
        Some(f) => f.to_path_buf(),
        None => {
            let f = dir.join(format!("plugin-{n}.json"));
            fs::write(&f, json).expect("write");
            f
        }
    };
    FilterCase {
        label: label.to_string(),
        file,
        bootstrap,
        json: Some(json.to_vec()),
        spec: Some(spec),
        same_text: true,
    }
}

/// A case for a whole Envoy bootstrap: the checker reads it; Envoy validates it with every
/// `*.wasm` being the module under test.
fn bootstrap_case(dir: &Path, wasm: &Path, label: &str, yaml: &str) -> FilterCase {
    let n = fs::read_dir(dir).map(|d| d.count()).unwrap_or(0);
    let file = dir.join(format!("bootstrap-{n}.yaml"));
    fs::write(&file, yaml).expect("write");
    let bootstrap = dir.join(format!("bootstrap-{n}-module.yaml"));
    fs::write(&bootstrap, envoy::with_module(yaml, wasm)).expect("write");
    FilterCase {
        label: label.to_string(),
        file,
        bootstrap,
        json: None,
        spec: None,
        same_text: true,
    }
}

/// The free-form plugin configurations of `manifest` as Istio and Envoy Gateway hand them over,
/// read by deploy/check/crds.mjs (their published CRD schemas, node's YAML reader): the checker's
/// own reading of the YAML is not its oracle.
fn handed_over(manifest: &Path, out: &Path) -> Vec<Vec<u8>> {
    let schemas = workspace_root().join(".tools/crd-schemas");
    assert!(
        schemas
            .join("node_modules/@kubernetes-models/istio")
            .is_dir(),
        "{} is missing: run `make images`. The check does not skip.",
        schemas.display()
    );
    let _ = fs::remove_dir_all(out);
    fs::create_dir_all(out).expect("mkdir");
    let run = Command::new("node")
        .arg(workspace_root().join("deploy/check/crds.mjs"))
        .arg(&schemas)
        .arg("--plugin-configs")
        .arg(out)
        .arg(manifest)
        .output()
        .expect("node is required to run deploy/check/crds.mjs");
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stdout)
    );
    let mut files: Vec<PathBuf> = fs::read_dir(out)
        .expect("configs")
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    files.iter().map(|f| fs::read(f).expect("read")).collect()
}

/// The Helm chart (deploy/helm/tollgate) as `helm template` renders it with `sets`, written to
/// `dir/<name>.yaml`.
fn chart(dir: &Path, name: &str, sets: &[&str]) -> PathBuf {
    let helm = required_component("TOLLGATE_HELM", ".tools/helm", ": run `make images`.");
    let mut cmd = Command::new(helm);
    cmd.args([
        "template",
        "tollgate",
        "deploy/helm/tollgate",
        "--namespace",
        "tollgate-system",
    ])
    .current_dir(workspace_root());
    for set in sets {
        cmd.args(["--set", set]);
    }
    let out = cmd.output().expect("run helm");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = dir.join(format!("{name}.yaml"));
    fs::write(&path, &out.stdout).expect("write");
    path
}

/// Every filter configuration: the checker, the module's parser and Envoy agree, and a refusal is
/// reported with Envoy's own text.
#[test]
fn the_checker_accepts_what_envoy_accepts_and_refuses_what_it_refuses() {
    let envoy_bin = required_component("TOLLGATE_ENVOY", ".tools/envoy", ": run `make tools`.");
    let wasm = required_component("TOLLGATE_WASM", "dist/tollgate.wasm", ": run `make build`.");
    let root = workspace_root();
    let tmp = TempDir::new("check-filter");
    let dir = tmp.path().join("cases");
    fs::create_dir_all(&dir).expect("mkdir");
    let mut cases = Vec::new();

    // The fuzz seeds, good and bad (fuzz/src/lib.rs's CONFIGS are among them).
    let mut seeds: Vec<PathBuf> = fs::read_dir(root.join("fuzz/seeds/filter_config"))
        .expect("fuzz/seeds/filter_config")
        .map(|e| e.expect("entry").path())
        .collect();
    seeds.sort();
    assert!(seeds.len() >= 10, "fuzz seeds: {seeds:?}");
    for s in &seeds {
        let label = format!("fuzz seed {}", s.display());
        cases.push(plugin_case(
            &dir,
            &wasm,
            &label,
            Some(s),
            &fs::read(s).expect("read"),
        ));
    }

    // The docs' plugin configurations.
    let blocks = docs::blocks_of(Kind::Filter);
    assert!(!blocks.is_empty(), "no `json filter` block in the docs");
    for b in &blocks {
        cases.push(plugin_case(
            &dir,
            &wasm,
            &b.place(),
            None,
            b.text.as_bytes(),
        ));
    }

    // deploy/'s WasmPlugins, EnvoyExtensionPolicy and Helm chart, and copies with a capacity of 0 and 100.0.
    let manifests = [
        "deploy/istio/wasmplugin.yaml",
        "deploy/istio/wasmplugin-grpc.yaml",
        "deploy/istio/wasmplugin-llm-tokens.yaml",
        "deploy/envoy-gateway/envoyextensionpolicy.yaml",
    ];
    let mut manifest_files: Vec<(String, PathBuf)> = manifests
        .iter()
        .map(|m| (m.to_string(), root.join(m)))
        .collect();
    manifest_files.push((
        "deploy/helm/tollgate with wasmPlugin.enabled".into(),
        chart(&dir, "chart", &["wasmPlugin.enabled=true"]),
    ));
    let plugin = fs::read_to_string(root.join(manifests[0])).expect("read");
    assert!(plugin.contains("capacity: 100\n"), "{plugin}");
    // A capacity of 0: refused. A float that is an integer reaches the module as an integer
    // (Istio's Struct, Kubernetes' YAML to JSON): accepted.
    for (n, capacity) in ["0", "100.0"].iter().enumerate() {
        let copy = dir.join(format!("wasmplugin-{n}.yaml"));
        let text = plugin.replacen("capacity: 100\n", &format!("capacity: {capacity}\n"), 1);
        fs::write(&copy, text).expect("write");
        manifest_files.push((format!("{} with capacity {capacity}", manifests[0]), copy));
    }
    for (label, file) in &manifest_files {
        let configs = handed_over(file, &tmp.path().join("handed-over"));
        assert_eq!(configs.len(), 1, "{label}: one plugin configuration");
        cases.push(plugin_case(&dir, &wasm, label, Some(file), &configs[0]));
    }

    // The bootstraps, and envoy.yaml with a field misspelt inside its plugin configuration.
    for f in ["envoy.yaml", "deploy/envoy/envoy.yaml"] {
        let yaml = fs::read_to_string(root.join(f)).expect("read");
        cases.push(bootstrap_case(&dir, &wasm, f, &yaml));
    }
    let demo = fs::read_to_string(root.join("envoy.yaml")).expect("read");
    assert!(
        demo.contains("\"period_ms\""),
        "envoy.yaml's rule has a period_ms"
    );
    let typo = demo.replacen("\"period_ms\"", "\"period\"", 1);
    cases.push(bootstrap_case(
        &dir,
        &wasm,
        "envoy.yaml with `period`",
        &typo,
    ));
    // A Struct instead of a StringValue: Envoy hands the module protobuf bytes, which it refuses.
    let string_value =
        "\"@type\": type.googleapis.com/google.protobuf.StringValue\n                  value: |";
    assert!(
        demo.contains(string_value),
        "envoy.yaml's configuration is a StringValue"
    );
    let structured = demo.replacen(
        string_value,
        "\"@type\": type.googleapis.com/google.protobuf.Struct\n                  value:",
        1,
    );
    let mut c = bootstrap_case(&dir, &wasm, "envoy.yaml with a Struct", &structured);
    c.same_text = false;
    cases.push(c);

    // Envoy takes about half a second of CPU a run, most of it compiling the module. The plugin
    // configurations the checker accepts go through one Envoy together, each on a listener of its
    // own (one VM, a root context per configuration, each `on_configure` run): if Envoy accepts
    // that, it accepts each of them. Every other case, and all of them if Envoy refuses the lot,
    // gets a run of its own, two at a time.
    let started = Instant::now();
    let by_checker: Vec<Verdict> = cases.iter().map(|c| checker("--filter", &c.file)).collect();
    let together: Vec<usize> = (0..cases.len())
        .filter(|&i| by_checker[i].is_none() && cases[i].spec.is_some())
        .collect();
    let accepted_together = match together.split_first() {
        Some((&first, rest)) if !rest.is_empty() => {
            let mut spec = cases[first].spec.clone().expect("a plugin case");
            spec.listener_name = "case-0".to_string();
            for (n, &i) in rest.iter().enumerate() {
                let mut other = cases[i].spec.clone().expect("a plugin case");
                other.listener_name = format!("case-{}", n + 1);
                spec.extra_listeners
                    .push(other.listener(&wasm, closed_port()));
            }
            let bootstrap = dir.join("together.yaml");
            fs::write(&bootstrap, spec.yaml(&wasm, closed_port(), closed_port())).expect("write");
            envoy_verdict(&envoy_bin, &bootstrap).is_none()
        }
        _ => false,
    };
    let alone: Vec<usize> = (0..cases.len())
        .filter(|i| !(accepted_together && together.contains(i)))
        .collect();
    let run = |part: &[usize]| -> Vec<(usize, Verdict)> {
        part.iter()
            .map(|&i| (i, envoy_verdict(&envoy_bin, &cases[i].bootstrap)))
            .collect()
    };
    let (a, b) = alone.split_at(alone.len() / 2);
    let mut envoy_verdicts: Vec<Verdict> = vec![None; cases.len()];
    std::thread::scope(|s| {
        let ha = s.spawn(|| run(a));
        let hb = s.spawn(|| run(b));
        for (i, v) in ha
            .join()
            .expect("envoy thread")
            .into_iter()
            .chain(hb.join().expect("envoy thread"))
        {
            envoy_verdicts[i] = v;
        }
    });
    eprintln!(
        "{} configurations through {} Envoy runs in {:?} ({} accepted in one run: {accepted_together})",
        cases.len(),
        alone.len() + usize::from(together.len() > 1),
        started.elapsed(),
        together.len(),
    );
    let mut refused = 0;
    for ((c, by_envoy), by_checker) in cases.iter().zip(envoy_verdicts).zip(by_checker) {
        eprintln!("{}: checker {by_checker:?}, Envoy {by_envoy:?}", c.label);
        if c.same_text {
            assert_eq!(
                by_checker, by_envoy,
                "{}: the checker and Envoy disagree",
                c.label
            );
        } else {
            let config = |v: &Verdict| {
                v.as_deref()
                    .is_some_and(|e| e.len() == 1 && e[0].starts_with("config: "))
            };
            assert!(
                config(&by_checker) && config(&by_envoy),
                "{}: both refuse the configuration as a whole",
                c.label
            );
        }
        if let Some(json) = &c.json {
            let by_module = native(json);
            assert_eq!(
                by_checker.is_some(),
                by_module.is_some(),
                "{}: the checker and the module's parser disagree: {by_module:?}",
                c.label
            );
            if let (Some(a), Some(b)) = (&by_checker, &by_module) {
                assert_eq!(a.len(), b.len(), "{}: {a:?} / {b:?}", c.label);
                for (a, b) in a.iter().zip(b) {
                    assert!(a.starts_with(b.as_str()), "{}: {a} / {b}", c.label);
                }
            }
        }
        refused += usize::from(by_checker.is_some());
    }
    // Both verdicts are exercised: the bad seeds and the copies made wrong are refused.
    assert!(refused >= 5, "{refused} refused");
    assert!(refused < cases.len(), "all refused");
}

/// The service's verdict on a limits file: it starts on it (`listening`, `None`), or exits with
/// the reader's error in its log (`Some(log)`).
fn service_verdict(dir: &Path, file: &Path) -> Option<String> {
    let mut cmd = Command::new(BIN);
    cmd.env_clear()
        .args(["--listen", "127.0.0.1:0", "--rls-config"])
        .arg(file);
    let log = dir.join(format!(
        "{}.log",
        file.file_name().and_then(|n| n.to_str()).unwrap_or("s")
    ));
    let mut proc = Proc::spawn("tollgate-server", cmd, log);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if proc.log_text().contains("listening") {
            proc.kill();
            return None;
        }
        if let Some(st) = proc.exited() {
            assert!(!st.success(), "{}", proc.log_text());
            return Some(proc.log_text());
        }
        assert!(
            Instant::now() < deadline,
            "the service neither started nor exited"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every limits file: the checker and the real service agree, and a refusal carries the service's
/// own error.
#[test]
fn the_checker_accepts_what_the_service_accepts_and_refuses_what_it_refuses() {
    let tmp = TempDir::new("check-limits");
    let root = workspace_root();
    // (label, the file the checker reads, the limits file the service loads)
    let mut cases: Vec<(String, PathBuf, PathBuf)> = Vec::new();
    let file = |name: String, text: &str| {
        let p = tmp.path().join(name);
        fs::write(&p, text).expect("write");
        p
    };

    let cm_path = root.join("deploy/kubernetes/rls-limits.yaml");
    let cm: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&fs::read_to_string(&cm_path).expect("read")).expect("YAML");
    let limits = cm["data"]["limits.yaml"]
        .as_str()
        .expect("data.limits.yaml")
        .to_string();
    let bad = limits.replacen("requests_per_unit", "request_per_unit", 1);
    cases.push((
        "deploy/kubernetes/rls-limits.yaml".into(),
        cm_path.clone(),
        file("cm-limits.yaml".into(), &limits),
    ));
    let bad_cm = fs::read_to_string(&cm_path).expect("read").replacen(
        "requests_per_unit",
        "request_per_unit",
        1,
    );
    cases.push((
        "rls-limits.yaml with `request_per_unit`".into(),
        file("bad-cm.yaml".into(), &bad_cm),
        file("bad-cm-limits.yaml".into(), &bad),
    ));
    // The chart's ConfigMap, beside the dashboard's (JSON, not a limits file).
    let rendered = chart(tmp.path(), "chart", &["metrics.dashboard.enabled=true"]);
    let text = fs::read_to_string(&rendered).expect("read");
    let chart_limits = serde_yaml_ng::Deserializer::from_str(&text)
        .filter_map(|d| serde::Deserialize::deserialize(d).ok())
        .find_map(|d: serde_yaml_ng::Value| d["data"]["limits.yaml"].as_str().map(String::from))
        .expect("the chart's limits file");
    assert!(
        text.contains("grafana-dashboard.json"),
        "the dashboard is rendered"
    );
    cases.push((
        "deploy/helm/tollgate".into(),
        rendered,
        file("chart-limits.yaml".into(), &chart_limits),
    ));

    let blocks = docs::blocks_of(Kind::Limits);
    assert!(!blocks.is_empty(), "no `yaml limits` block in the docs");
    for (i, b) in blocks.iter().enumerate() {
        let f = file(format!("docs-{i}.yaml"), &b.text);
        cases.push((b.place(), f.clone(), f));
    }
    let broken = blocks[0].text.replacen("domain:", "domains:", 1);
    let f = file("docs-broken.yaml".into(), &broken);
    cases.push((
        format!("{} with `domains`", blocks[0].place()),
        f.clone(),
        f,
    ));

    let mut refused = 0;
    for (label, checked, loaded) in &cases {
        let by_checker = checker("--limits", checked);
        let by_service = service_verdict(tmp.path(), loaded);
        eprintln!("{label}: checker {by_checker:?}");
        match (&by_checker, &by_service) {
            (None, None) => {}
            (Some(why), Some(log)) => {
                for why in why {
                    assert!(
                        log.contains(why.as_str()),
                        "{label}: the service's log lacks {why:?}:\n{log}"
                    );
                }
                refused += 1;
            }
            _ => panic!("{label}: checker {by_checker:?}, service {by_service:?}"),
        }
    }
    assert_eq!(refused, 2, "the two copies made wrong are refused");
}

/// Exit statuses a pipeline can act on, and every configuration reported, not just the first
/// refused one.
#[test]
fn exit_status_fits_ci() {
    let tmp = TempDir::new("check-exit");
    let good = tmp.path().join("good.json");
    let bad = tmp.path().join("bad.json");
    fs::write(
        &good,
        r#"{"service": {"cluster": "c"}, "rules": [{"name": "r", "key": ["client_ip"], "capacity": 5, "period_ms": 1000}]}"#,
    )
    .unwrap();
    fs::write(&bad, r#"{"service": {"cluster": "c"}, "rules": []}"#).unwrap();
    let limits = tmp.path().join("limits.yaml");
    fs::write(
        &limits,
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 5, burstt: 1}\n",
    )
    .unwrap();
    let (g, b, l) = (
        good.to_str().unwrap(),
        bad.to_str().unwrap(),
        limits.to_str().unwrap(),
    );

    let (code, out, err) = check(&["--filter", g]);
    assert_eq!((code, out), (0, format!("{g}: ok\n")));
    assert_eq!(err, "check: 1 configuration, none refused\n");

    let (code, out, err) = check(&["--filter", b, "--filter", g, "--limits", l]);
    assert_eq!(code, 1, "{out}");
    assert_eq!(err, "check: 3 configurations, 2 refused (2 refusals)\n");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert_eq!(
        lines[0],
        format!("{b}: refused: rules: must hold between 1 and 16 rules")
    );
    assert_eq!(lines[1], format!("{g}: ok"));
    assert!(lines[2].starts_with(&format!("{l}: refused: ")), "{out}");
    assert!(lines[2].contains("burstt"), "{out}");

    let (code, _, err) = check(&["--filter", "/nonexistent/plugin.json", "--filter", g]);
    assert_eq!(code, 2);
    assert!(
        err.contains("/nonexistent/plugin.json: cannot read"),
        "{err}"
    );
    assert!(
        err.ends_with("check: 1 configuration, none refused; 1 file not checked\n"),
        "{err}"
    );
    let (code, _, err) = check(&[]);
    assert_eq!(code, 2, "{err}");
    let limits_as_filter = check(&["--filter", l]);
    assert_eq!(limits_as_filter.0, 2, "{limits_as_filter:?}");
}

/// Every refusal of every configuration is reported, a line each in document order, not only each
/// configuration's first; the summary counts them.
#[test]
fn every_refusal_of_every_configuration_is_reported() {
    let tmp = TempDir::new("check-every");
    // Three mistakes: no `service`, a field no rule has, a shaping rule held up to 0 ms.
    let plugin = tmp.path().join("plugin.json");
    fs::write(
        &plugin,
        r#"{"rules": [
            {"name": "a", "key": ["client_ip"], "capacity": 5, "period_ms": 1000},
            {"name": "b", "capacity": 5, "period_ms": 1000, "colour": "red"},
            {"name": "c", "capacity": 5, "period_ms": 1000, "shape": {"max_delay_ms": 0}}]}"#,
    )
    .unwrap();
    // An EnvoyExtensionPolicy with two wasm extensions: the first's two mistakes, and the second's
    // one, each reported under its own configuration.
    let policy = tmp.path().join("policy.yaml");
    fs::write(
        &policy,
        "kind: EnvoyExtensionPolicy\nmetadata: {name: t, namespace: ns}\nspec:\n  wasm:\n\
         \x20 - config:\n      service: {cluster: c, timeout_ms: 0}\n      rules:\n\
         \x20     - {name: r, capacity: 0, period_ms: 1000}\n\
         \x20 - config:\n      service: {cluster: c}\n      rules:\n\
         \x20     - {name: r, capacity: 1, period_ms: 1000, match: /api}\n",
    )
    .unwrap();
    // A limits file with two mistakes, each in its descriptor.
    let limits = tmp.path().join("limits.yaml");
    fs::write(
        &limits,
        "domain: d\ndescriptors:\n\
         \x20 - key: a\n    rate_limit: {unit: minutes, requests_per_unit: 1}\n\
         \x20 - key: b\n    rate_limit: {unit: second, requests_per_unit: 1, algorithm: leaky}\n",
    )
    .unwrap();
    let (p, y, l) = (
        plugin.to_str().unwrap(),
        policy.to_str().unwrap(),
        limits.to_str().unwrap(),
    );
    let (code, out, err) = check(&["--filter", p, "--filter", y, "--limits", l]);
    assert_eq!(code, 1, "{out}{err}");
    let lines: Vec<&str> = out.lines().collect();
    let expected = [
        format!("{p}: refused: service: missing (required)"),
        format!("{p}: refused: rules[1].colour: unknown field (expected one of: "),
        format!("{p}: refused: rules[2].shape.max_delay_ms: must be between 1 and "),
        format!("{y}: EnvoyExtensionPolicy ns/t: spec.wasm[0].config: refused: service.timeout_ms: must be between 1 and 60000"),
        format!("{y}: EnvoyExtensionPolicy ns/t: spec.wasm[0].config: refused: rules[0].capacity: must be between 1 and 1000000000"),
        format!("{y}: EnvoyExtensionPolicy ns/t: spec.wasm[1].config: refused: rules[0].match: must be an object"),
        format!("{l}: refused: domain \"d\": descriptor d.a (descriptors[0]): rate_limit.unit: \"minutes\""),
        format!("{l}: refused: domain \"d\": descriptor d.b (descriptors[1]): rate_limit.algorithm: \"leaky\""),
    ];
    assert_eq!(lines.len(), expected.len(), "{out}");
    for (line, start) in lines.iter().zip(&expected) {
        assert!(
            line.starts_with(start.as_str()),
            "{line}\nexpected {start}...\n{out}"
        );
    }
    assert_eq!(err, "check: 4 configurations, 4 refused (8 refusals)\n");
    // The filter's reader agrees: its first refusal is the first reported.
    let first = Config::parse(&fs::read(&plugin).unwrap()).unwrap_err();
    assert_eq!(first.to_string(), "service: missing (required)");
}

#[test]
fn a_calendar_in_a_zone_the_database_lacks_is_refused() {
    let tmp = TempDir::new("check-zone");
    let plugin = tmp.path().join("plugin.json");
    fs::write(
        &plugin,
        r#"{"service": {"cluster": "c"}, "rules": [
            {"name": "a", "capacity": 5, "algorithm": "calendar_window", "calendar": "month", "time_zone": "Europe/Berlin"},
            {"name": "b", "capacity": 5, "algorithm": "calendar_window", "calendar": "day", "time_zone": "Mars/Olympus"}]}"#,
    )
    .unwrap();
    let limits = tmp.path().join("limits.yaml");
    fs::write(
        &limits,
        "domain: d\ndescriptors:\n\
         \x20 - key: a\n    rate_limit: {unit: month, requests_per_unit: 9, algorithm: calendar_window, time_zone: Asia/Kolkata}\n\
         \x20 - key: b\n    rate_limit: {unit: week, requests_per_unit: 9, algorithm: calendar_window, time_zone: Moon/Tycho}\n",
    )
    .unwrap();
    let (p, l) = (plugin.to_str().unwrap(), limits.to_str().unwrap());
    let (code, out, err) = check(&["--filter", p, "--limits", l]);
    assert_eq!(code, 1, "{out}{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(
        lines[0].starts_with(&format!(
            "{p}: refused: rules[1].time_zone: \"Mars/Olympus\" is not a time zone of the IANA database"
        )),
        "{out}"
    );
    assert!(
        lines[1].starts_with(&format!(
            "{l}: refused: domain \"d\": descriptor d.b (descriptors[1]): rate_limit.time_zone: \"Moon/Tycho\""
        )),
        "{out}"
    );
    // The module itself reads the name and leaves the database to the service.
    assert!(Config::parse(&fs::read(&plugin).unwrap()).is_ok());
}
