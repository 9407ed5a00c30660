//! End to end: Envoy refuses a bad plugin configuration, and its log names the offending field.

// A test reports a failure by panicking; the crate's no-panic lints are for the filter itself.
#![allow(
    clippy::panic,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

use crate::common;

use common::*;
use std::time::Duration;

/// Starts Envoy with `config` as the plugin configuration; it must exit with an error (or never
/// become ready) and its log must name `field`.
fn refused(label: &str, config: &str, field: &str) {
    let c = Components::get();
    let dir = TempDir::new(label);
    let spec = EnvoySpec::new(Some(config.to_string()), closed_port(), closed_port());
    match Envoy::try_start(&c, &dir, &spec, Duration::from_secs(15)) {
        Ok(mut envoy) => {
            let log = envoy.proc.log_text();
            envoy.proc.kill();
            panic!("Envoy accepted a bad configuration ({label}):\n{config}\n{log}");
        }
        Err(f) => {
            if let Some(st) = f.status {
                assert!(!st.success(), "Envoy exited with success: {st}");
            }
            // The filter's own error line, not just any mention in Envoy's log.
            let line = f
                .log
                .lines()
                .find(|l| l.contains("invalid configuration"))
                .unwrap_or_else(|| panic!("no configuration error logged ({label}):\n{}", f.log));
            eprintln!("{label}: {line}");
            assert!(
                line.contains(field),
                "the error names `{field}` ({label}): {line}"
            );
            // Envoy's own word that the filter refused it: the Wasm VM's, or the dynamic
            // module's (the native build).
            let refusal = if spec.native.is_some() {
                "Failed to initialize dynamic module"
            } else {
                "Unable to create Wasm"
            };
            assert!(
                f.log.contains(refusal),
                "Envoy refused the plugin ({label}):\n{}",
                f.log
            );
        }
    }
}

const GOOD_RULE: &str = r#"{"name": "r", "key": ["client_ip"], "capacity": 5, "period_ms": 1000}"#;

fn with(service: &str, rules: &str, rest: &str) -> String {
    format!(r#"{{"service": {service}, "rules": [{rules}]{rest}}}"#)
}

#[test]
fn a_good_configuration_is_accepted() {
    let c = Components::get();
    let dir = TempDir::new("good-config");
    let cfg = with(r#"{"cluster": "tollgate"}"#, GOOD_RULE, "");
    let spec = EnvoySpec::new(Some(cfg), closed_port(), closed_port());
    let envoy = Envoy::try_start(&c, &dir, &spec, Duration::from_secs(15));
    assert!(envoy.is_ok(), "{:?}", envoy.err().map(|f| f.log));
}

#[test]
fn zero_capacity() {
    let rule = r#"{"name": "r", "key": ["client_ip"], "capacity": 0, "period_ms": 1000}"#;
    refused(
        "capacity",
        &with(r#"{"cluster": "tollgate"}"#, rule, ""),
        "rules[0].capacity",
    );
}

#[test]
pub(crate) fn unknown_field() {
    let rule =
        r#"{"name": "r", "key": ["client_ip"], "capacity": 5, "period_ms": 1000, "burst": 3}"#;
    refused(
        "unknown-field",
        &with(r#"{"cluster": "tollgate"}"#, rule, ""),
        "burst",
    );
}

#[test]
fn bad_transport() {
    refused(
        "transport",
        &with(
            r#"{"cluster": "tollgate", "transport": "tcp"}"#,
            GOOD_RULE,
            "",
        ),
        "service.transport",
    );
}

#[test]
fn missing_cluster() {
    refused("cluster", &with("{}", GOOD_RULE, ""), "service.cluster");
}

#[test]
fn bad_failure_mode() {
    refused(
        "failure-mode",
        &with(
            r#"{"cluster": "tollgate"}"#,
            GOOD_RULE,
            r#", "failure_mode": "sometimes""#,
        ),
        "failure_mode",
    );
}

#[test]
fn bad_key_part() {
    let rule = r#"{"name": "r", "key": ["cookie:sid"], "capacity": 5, "period_ms": 1000}"#;
    refused(
        "key",
        &with(r#"{"cluster": "tollgate"}"#, rule, ""),
        "rules[0].key",
    );
}

#[test]
fn duplicate_rule_names() {
    let rules = format!("{GOOD_RULE}, {GOOD_RULE}");
    refused(
        "dup",
        &with(r#"{"cluster": "tollgate"}"#, &rules, ""),
        "rules[1].name",
    );
}

/// Shaping holds a request until the bucket's tokens are there: a window cannot lend its next
/// window's tokens, so a window rule with `shape` is refused.
#[test]
fn shape_on_a_window() {
    let rule = r#"{"name": "r", "key": ["client_ip"], "capacity": 5, "period_ms": 1000,
                   "algorithm": "fixed_window", "shape": {"max_delay_ms": 1000}}"#;
    refused(
        "shape",
        &with(r#"{"cluster": "tollgate"}"#, rule, ""),
        "rules[0].shape",
    );
}

#[test]
fn not_json() {
    refused("not-json", "service: tollgate", "not valid JSON");
}

/// The top-level envoy.yaml (what `make run` starts) passes Envoy's validation, which also loads the
/// module and configures it with the demo rule.
#[test]
fn the_demo_envoy_yaml_validates() {
    let c = Components::get();
    let root = workspace_root();
    let module = root.join("dist/tollgate.wasm");
    assert!(
        module.is_file(),
        "envoy.yaml loads {}; run `make build`",
        module.display()
    );
    let out = std::process::Command::new(&c.envoy)
        .current_dir(&root)
        .args([
            "--mode",
            "validate",
            "-c",
            "envoy.yaml",
            "--disable-hot-restart",
        ])
        .output()
        .expect("run envoy --mode validate");
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "envoy.yaml does not validate:\n{log}");
}
