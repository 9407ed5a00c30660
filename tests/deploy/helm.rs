//! The Helm chart (deploy/helm/tollgate), rendered and linted by a real Helm (.tools/helm,
//! `make images`): linted; rendered with the defaults, each optional part and each store, every
//! rendering through the validators; its WasmPlugin's configuration run by the module; its default
//! rendering run by the real service, volumes projected as kubelet does; a random token when none
//! is given; the schema refusing exactly the tokens the service refuses.

use super::*;

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
