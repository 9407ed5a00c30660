//! deploy/monitoring: the alert rules through `promtool check rules` and `promtool test rules`, and
//! the Grafana dashboard (its fields, every query valid PromQL, every metric one that exists).

use super::*;

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
