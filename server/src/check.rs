//! `tollgate-server check`: filter configurations and RLS limits files checked before they ship
//! (a CI step), by the readers that will load them: the filter's own configuration reader, built
//! natively (`tollgate::core::config::Config::parse`, the function the module's `on_configure`
//! calls), and the service's limits-file reader ([`crate::rls::config::Limits::parse`], the one
//! `--rls-config` loads and reloads with). What they accept the module and the service accept;
//! what they refuse is reported with the very text Envoy's log (`invalid configuration: ...`) or
//! the service's (`--rls-config ...`) would show, the field named.
//!
//! A subcommand of the service rather than a binary of its own: the service's image already ships
//! to where a pipeline runs, the limits reader is the service's, and the check then always has the
//! version of the readers that is deployed.
//!
//! Both readers report every refusal ([`Config::parse_all`], [`Limits::parse_all`]), as the
//! module logs them (a line each) and the service (one line); but a limits file's document that
//! does not fit the schema (serde's derive, which stops there) is refused by that first error
//! alone. Every configuration in every file given is checked, each refusal reported on a line of
//! its own, and a summary, on stderr, counts the configurations, those refused and their
//! refusals. Exit status: 0 every
//! configuration is accepted, 1 one is refused, 2 a file cannot be read or holds nothing to check
//! (and clap's usage errors).
//!
//! Where the filter's configuration is found (`--filter FILE`):
//!
//! | file | the configuration checked |
//! |---|---|
//! | `*.json` | the whole file: the bytes the module is handed |
//! | YAML `kind: WasmPlugin` (Istio) | `spec.pluginConfig`, as JSON (Istio hands it over so) |
//! | YAML `kind: EnvoyExtensionPolicy` (Envoy Gateway) | each `spec.wasm[i].config`, as JSON |
//! | any other YAML (an `EnvoyFilter`, an Envoy bootstrap) | the `configuration` of every `envoy.extensions.filters.http.wasm.v3.Wasm` typed config: a `google.protobuf.StringValue`'s `value` |
//!
//! A YAML file may hold several documents (`---`). Numbers in `pluginConfig` and `config` are
//! read as Istio's protobuf Struct and Kubernetes' YAML-to-JSON conversion write them: `5.0` is
//! `5`. A wasm `configuration` of another type (a Struct) reaches the module as protobuf bytes,
//! which it refuses.
//!
//! The places are one table, [`PLACES`]; `--write-configs DIR` writes each configuration found
//! there, so that tests (tests/deploy) run the very bytes through the real module.
//!
//! A limits file (`--limits FILE`) is the file `--rls-config` names, or YAML holding Kubernetes
//! ConfigMaps (`kind: ConfigMap`, e.g. a chart's rendered manifests) whose every `data` entry
//! named `*.yaml` or `*.yml` is one.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde_json::Value as Json;
use serde_yaml_ng::Value as Yaml;

use tollgate::core::config::Config;

use crate::rls::config::Limits;

/// The `type_url` of Envoy's wasm HTTP filter configuration.
const WASM_FILTER: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
/// The `type_url` the module reads its configuration from.
const STRING_VALUE: &str = "type.googleapis.com/google.protobuf.StringValue";
/// What the module logs for an empty configuration, before reading it (src/host/dispatch.rs).
const MISSING: &str = "config: missing (put the JSON in a google.protobuf.StringValue)";

/// The subcommand's arguments.
#[derive(clap::Args, Debug, Clone)]
#[command(group(clap::ArgGroup::new("input").required(true).multiple(true).args(["filters", "limits"])))]
pub struct CheckArgs {
    /// A filter configuration: the plugin configuration itself (`*.json`), or YAML holding it (an
    /// Istio WasmPlugin, an Envoy Gateway EnvoyExtensionPolicy, an EnvoyFilter, an Envoy
    /// bootstrap). Repeatable.
    #[arg(long = "filter", value_name = "FILE")]
    pub filters: Vec<PathBuf>,

    /// An RLS limits file (what --rls-config loads), or a ConfigMap holding limits files.
    /// Repeatable.
    #[arg(long = "limits", value_name = "FILE")]
    pub limits: Vec<PathBuf>,

    /// Also write each plugin configuration found in the --filter files, as the bytes the module
    /// is handed, to DIR/000.json, DIR/001.json, ... in the order reported.
    #[arg(long = "write-configs", value_name = "DIR")]
    pub write_configs: Option<PathBuf>,
}

/// Where a Kubernetes resource holds the plugin configuration, by its `kind`: a path of fields
/// (`*`: every item of a list), whose value is the configuration as YAML, handed to the module as
/// JSON. Any other YAML is searched for Envoy's wasm filter configurations ([`WASM_FILTER`]).
pub const PLACES: [(&str, &str); 2] = [
    // Istio hands `pluginConfig` over as JSON.
    ("WasmPlugin", "spec.pluginConfig"),
    // Envoy Gateway: each of the policy's wasm extensions.
    ("EnvoyExtensionPolicy", "spec.wasm.*.config"),
];

/// What a reader says of one configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Accepted; what it holds, for the report (may be empty).
    Accepted(String),
    /// Refused: the reader's every refusal (one at least), field first (`rules[0].capacity:
    /// must be ...`).
    Refused(Vec<String>),
}

/// One configuration found in a file, and its verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// Where it is in the file (`WasmPlugin istio-system/tollgate: spec.pluginConfig`); empty
    /// when it is the whole file.
    pub at: String,
    /// The verdict.
    pub verdict: Verdict,
}

/// A plugin configuration found in a file: where, and the bytes the module is handed (`Err`: it
/// is handed something it refuses before reading JSON; why).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginConfig {
    /// Where it is in the file.
    pub at: String,
    /// The configuration's bytes.
    pub bytes: Result<Vec<u8>, String>,
}

/// The module's verdict on a plugin configuration (the bytes of `proxy_on_configure`).
pub fn check_plugin(bytes: &[u8]) -> Verdict {
    if bytes.is_empty() {
        return Verdict::Refused(vec![MISSING.into()]);
    }
    match Config::parse_all(bytes) {
        Ok(cfg) => {
            // The module reads a zone's name, not whether the database has it: the service does.
            let unknown: Vec<String> = cfg
                .rules
                .iter()
                .enumerate()
                .filter_map(|(i, r)| {
                    let c = r.rate_limit()?.calendar.as_ref()?;
                    let why = crate::calendar::check_zone(&c.zone).err()?;
                    Some(format!(
                        "rules[{i}].time_zone: {why} (the service refuses its takes)"
                    ))
                })
                .collect();
            if unknown.is_empty() {
                Verdict::Accepted(String::new())
            } else {
                Verdict::Refused(unknown)
            }
        }
        Err(all) => Verdict::Refused(all.iter().map(ToString::to_string).collect()),
    }
}

/// The service's verdict on a limits file's text.
pub fn check_limits(text: &str) -> Verdict {
    match Limits::parse_all(text) {
        Ok(l) => {
            let mut domains = l.domains();
            domains.sort_unstable();
            Verdict::Accepted(format!("domains: {}", domains.join(", ")))
        }
        Err(all) => Verdict::Refused(all),
    }
}

/// Every plugin configuration in a `--filter` file (see the module doc); `json`: the file is the
/// configuration itself. `Err`: YAML that does not parse.
pub fn plugin_configs(text: &[u8], json: bool) -> Result<Vec<PluginConfig>, String> {
    if json {
        return Ok(vec![PluginConfig {
            at: String::new(),
            bytes: Ok(text.to_vec()),
        }]);
    }
    let mut found = Vec::new();
    for (i, doc) in documents(text)?.iter().enumerate() {
        let name = document_name(doc, i);
        let kind = doc.get("kind").and_then(Yaml::as_str);
        match PLACES.iter().find(|(k, _)| Some(*k) == kind) {
            Some((_, place)) => {
                let fields: Vec<&str> = place.split('.').collect();
                at_place(Some(doc), &fields, &mut String::new(), &name, &mut found);
            }
            None => wasm_filters(doc, &mut String::new(), &name, &mut found),
        }
    }
    Ok(found)
}

/// Every limits file in a `--limits` file: the file itself, or each `*.yaml` / `*.yml` `data`
/// entry of its ConfigMaps (`(where, text)`).
pub fn limits_files(text: &str) -> Vec<(String, String)> {
    let docs = documents(text.as_bytes()).unwrap_or_default();
    let configmaps: Vec<(usize, &Yaml)> = docs
        .iter()
        .enumerate()
        .filter(|(_, d)| d.get("kind").and_then(Yaml::as_str) == Some("ConfigMap"))
        .collect();
    // Not a ConfigMap (or YAML that does not parse): the file is the limits file, and the
    // service's reader says what is wrong with it.
    if configmaps.is_empty() {
        return vec![(String::new(), text.to_string())];
    }
    let mut files = Vec::new();
    for (i, cm) in configmaps {
        let name = document_name(cm, i);
        let data = cm.get("data").and_then(Yaml::as_mapping);
        for (k, v) in data.into_iter().flatten() {
            let key = k.as_str().unwrap_or_default();
            // A limits file is YAML; other entries (a dashboard in JSON) are not for the service.
            if !(key.ends_with(".yaml") || key.ends_with(".yml")) {
                continue;
            }
            files.push((
                format!("{name}: data.{key}"),
                v.as_str().unwrap_or_default().to_string(),
            ));
        }
    }
    files
}

/// The YAML documents of `text`.
fn documents(text: &[u8]) -> Result<Vec<Yaml>, String> {
    use serde::Deserialize;
    let text = std::str::from_utf8(text).map_err(|e| format!("not UTF-8: {e}"))?;
    serde_yaml_ng::Deserializer::from_str(text)
        .enumerate()
        .map(|(i, d)| Yaml::deserialize(d).map_err(|e| format!("document {}: {e}", i + 1)))
        .collect()
}

/// `Kind namespace/name` of a Kubernetes object, else `document N`.
fn document_name(doc: &Yaml, i: usize) -> String {
    let kind = doc.get("kind").and_then(Yaml::as_str);
    let meta = doc.get("metadata");
    let field = |f: &str| meta.and_then(|m| m.get(f)).and_then(Yaml::as_str);
    match (kind, field("name")) {
        (Some(kind), Some(name)) => match field("namespace") {
            Some(ns) => format!("{kind} {ns}/{name}"),
            None => format!("{kind} {name}"),
        },
        _ => format!("document {}", i + 1),
    }
}

/// The configurations at `fields` of `v` (at `path`; `None`: absent): `*` enters every item of a
/// list (none when it is absent or not a list), and an absent configuration is an empty one
/// (which the module refuses).
fn at_place(
    v: Option<&Yaml>,
    fields: &[&str],
    path: &mut String,
    name: &str,
    found: &mut Vec<PluginConfig>,
) {
    let Some((first, rest)) = fields.split_first() else {
        found.push(PluginConfig {
            at: format!("{name}: {path}"),
            bytes: v.map_or(Ok(Vec::new()), json_bytes),
        });
        return;
    };
    let len = path.len();
    if *first == "*" {
        let items = v.and_then(Yaml::as_sequence).into_iter().flatten();
        for (i, item) in items.enumerate() {
            path.push_str(&format!("[{i}]"));
            at_place(Some(item), rest, path, name, found);
            path.truncate(len);
        }
        return;
    }
    if !path.is_empty() {
        path.push('.');
    }
    path.push_str(first);
    at_place(v.and_then(|v| v.get(first)), rest, path, name, found);
    path.truncate(len);
}

/// Walks `v` (at `path`) for wasm filter typed configs and takes their `configuration`.
fn wasm_filters(v: &Yaml, path: &mut String, name: &str, found: &mut Vec<PluginConfig>) {
    let len = path.len();
    match v {
        Yaml::Mapping(m) => {
            if v.get("@type").and_then(Yaml::as_str) == Some(WASM_FILTER) {
                let configuration = v.get("config").and_then(|c| c.get("configuration"));
                found.push(PluginConfig {
                    at: format!("{name}: {path}.config.configuration"),
                    bytes: configuration.map_or(Ok(Vec::new()), wasm_configuration),
                });
                return;
            }
            for (k, child) in m {
                let key = k.as_str().unwrap_or("?");
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(key);
                wasm_filters(child, path, name, found);
                path.truncate(len);
            }
        }
        Yaml::Sequence(items) => {
            for (i, child) in items.iter().enumerate() {
                path.push_str(&format!("[{i}]"));
                wasm_filters(child, path, name, found);
                path.truncate(len);
            }
        }
        _ => {}
    }
}

/// What the module is handed for a wasm filter's `configuration` (a `google.protobuf.Any`).
fn wasm_configuration(any: &Yaml) -> Result<Vec<u8>, String> {
    match any.get("@type").and_then(Yaml::as_str) {
        Some(STRING_VALUE) => Ok(any
            .get("value")
            .map(|v| match v {
                Yaml::String(s) => s.clone(),
                other => scalar(other).unwrap_or_default(),
            })
            .unwrap_or_default()
            .into_bytes()),
        Some(other) => Err(format!(
            "config: is a {other}, which reaches the module as protobuf, not JSON (put the JSON \
             in a google.protobuf.StringValue)"
        )),
        None => Err("config: @type missing (put the JSON in a google.protobuf.StringValue)".into()),
    }
}

/// A free-form YAML configuration (`pluginConfig`, `config`) as the JSON the module is handed.
fn json_bytes(v: &Yaml) -> Result<Vec<u8>, String> {
    let json = to_json(v)?;
    serde_json::to_vec(&json).map_err(|e| format!("config: {e}"))
}

/// YAML as JSON, as Kubernetes and Istio convert it: integral floats as integers, scalar keys as
/// strings.
fn to_json(v: &Yaml) -> Result<Json, String> {
    Ok(match v {
        Yaml::Null => Json::Null,
        Yaml::Bool(b) => Json::Bool(*b),
        Yaml::Number(n) => {
            if let Some(u) = n.as_u64() {
                Json::from(u)
            } else if let Some(i) = n.as_i64() {
                Json::from(i)
            } else {
                let f = n.as_f64().unwrap_or(f64::NAN);
                if f.fract() == 0.0 && f.abs() < 1e21 {
                    // An integral float is written as an integer (protojson's Struct, and
                    // sigs.k8s.io/yaml's conversion): `5.0` arrives as `5`.
                    if f >= 0.0 {
                        Json::from(f as u64)
                    } else {
                        Json::from(f as i64)
                    }
                } else {
                    serde_json::Number::from_f64(f)
                        .map(Json::Number)
                        .ok_or_else(|| format!("config: {f} is not a JSON number"))?
                }
            }
        }
        Yaml::String(s) => Json::String(s.clone()),
        Yaml::Sequence(items) => Json::Array(items.iter().map(to_json).collect::<Result<_, _>>()?),
        Yaml::Mapping(m) => {
            let mut out = serde_json::Map::new();
            for (k, child) in m {
                let key =
                    scalar(k).ok_or_else(|| format!("config: a key is not a scalar: {k:?}"))?;
                out.insert(key, to_json(child)?);
            }
            Json::Object(out)
        }
        Yaml::Tagged(t) => to_json(&t.value)?,
    })
}

/// A scalar as text (a mapping key, a StringValue's value written unquoted).
fn scalar(v: &Yaml) -> Option<String> {
    match v {
        Yaml::String(s) => Some(s.clone()),
        Yaml::Bool(b) => Some(b.to_string()),
        Yaml::Number(n) => Some(n.to_string()),
        Yaml::Null => Some("null".into()),
        _ => None,
    }
}

/// A file that cannot be checked: it cannot be read, or holds nothing to check.
#[derive(Debug)]
pub struct Unusable(pub String);

/// Every finding in one `--filter` file.
pub fn check_filter_file(path: &Path) -> Result<Vec<Finding>, Unusable> {
    let bytes = std::fs::read(path)
        .map_err(|e| Unusable(format!("{}: cannot read: {e}", path.display())))?;
    let json = path
        .extension()
        .is_some_and(|x| x.eq_ignore_ascii_case("json"));
    let configs = plugin_configs(&bytes, json)
        .map_err(|e| Unusable(format!("{}: not YAML: {e}", path.display())))?;
    if configs.is_empty() {
        return Err(Unusable(format!(
            "{}: no filter configuration in it (a WasmPlugin, an EnvoyExtensionPolicy, or a wasm \
             filter's typed config; a plugin configuration itself is a .json file)",
            path.display()
        )));
    }
    Ok(configs
        .into_iter()
        .map(|c| Finding {
            at: c.at,
            verdict: match c.bytes {
                Ok(b) => check_plugin(&b),
                Err(why) => Verdict::Refused(vec![why]),
            },
        })
        .collect())
}

/// Every finding in one `--limits` file.
pub fn check_limits_file(path: &Path) -> Result<Vec<Finding>, Unusable> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Unusable(format!("{}: cannot read: {e}", path.display())))?;
    Ok(limits_files(&text)
        .into_iter()
        .map(|(at, text)| Finding {
            at,
            verdict: check_limits(&text),
        })
        .collect())
}

/// Checks every file, writes a line per accepted configuration and per refusal to `out` (and per
/// unusable file, and the summary, to `err`), and returns the exit status: 0 all accepted, 1 one
/// refused, 2 a file unusable.
pub fn run(args: &CheckArgs, out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let files = args
        .filters
        .iter()
        .map(|p| (p, check_filter_file(p)))
        .chain(args.limits.iter().map(|p| (p, check_limits_file(p))));
    let mut count = Count::default();
    for (path, result) in files {
        match result {
            Ok(findings) => {
                for f in findings {
                    count.configurations += 1;
                    let at = if f.at.is_empty() {
                        String::new()
                    } else {
                        format!(": {}", f.at)
                    };
                    match &f.verdict {
                        Verdict::Accepted(what) if what.is_empty() => {
                            let _ = writeln!(out, "{}{at}: ok", path.display());
                        }
                        Verdict::Accepted(what) => {
                            let _ = writeln!(out, "{}{at}: ok ({what})", path.display());
                        }
                        Verdict::Refused(all) => {
                            count.refused += 1;
                            count.refusals += all.len();
                            for why in all {
                                let _ = writeln!(out, "{}{at}: refused: {why}", path.display());
                            }
                        }
                    }
                }
            }
            Err(Unusable(why)) => {
                count.unusable += 1;
                let _ = writeln!(err, "{why}");
            }
        }
    }
    if let Some(dir) = &args.write_configs {
        if let Err(why) = write_configs(dir, &args.filters) {
            count.unusable += 1;
            let _ = writeln!(err, "{why}");
        }
    }
    let _ = writeln!(err, "{count}");
    if count.unusable > 0 {
        2
    } else {
        u8::from(count.refused > 0)
    }
}

/// What [`run`] checked, for its summary.
#[derive(Debug, Default)]
struct Count {
    /// Configurations checked.
    configurations: usize,
    /// Those refused.
    refused: usize,
    /// Their refusals.
    refusals: usize,
    /// Files that could not be checked (and a `--write-configs` that failed).
    unusable: usize,
}

impl std::fmt::Display for Count {
    /// `check: 3 configurations, 1 refused (4 refusals)` or `check: 3 configurations, none
    /// refused`, then `; 1 file not checked` when one is.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
        write!(f, "check: {}, ", n(self.configurations, "configuration"))?;
        match self.refused {
            0 => write!(f, "none refused")?,
            r => write!(f, "{r} refused ({})", n(self.refusals, "refusal"))?,
        }
        if self.unusable > 0 {
            write!(f, "; {} not checked", n(self.unusable, "file"))?;
        }
        Ok(())
    }
}

/// Writes every plugin configuration of the `filters` files (those the module is handed as JSON)
/// to `dir/000.json`, `001.json`, ... in the order [`run`] reports them.
fn write_configs(dir: &Path, filters: &[PathBuf]) -> Result<(), String> {
    let mut n = 0;
    for path in filters {
        let Ok(text) = std::fs::read(path) else {
            continue;
        };
        let json = path
            .extension()
            .is_some_and(|x| x.eq_ignore_ascii_case("json"));
        for config in plugin_configs(&text, json).unwrap_or_default() {
            let Ok(bytes) = config.bytes else { continue };
            let file = dir.join(format!("{n:03}.json"));
            std::fs::write(&file, bytes).map_err(|e| format!("{}: {e}", file.display()))?;
            n += 1;
        }
    }
    Ok(())
}

/// `tollgate-server check`, on stdout and stderr.
pub fn main(args: &CheckArgs) -> ExitCode {
    ExitCode::from(run(
        args,
        &mut std::io::stdout().lock(),
        &mut std::io::stderr().lock(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn configs(yaml: &str) -> Vec<PluginConfig> {
        plugin_configs(yaml.as_bytes(), false).unwrap_or_else(|e| unreachable!("{e}"))
    }

    #[test]
    fn a_wasm_plugin_config_is_read_as_istio_hands_it_over() {
        let found = configs(
            "apiVersion: extensions.istio.io/v1alpha1\nkind: WasmPlugin\n\
             metadata: {name: t, namespace: ns}\n\
             spec:\n  pluginConfig:\n    service: {cluster: c}\n    rules:\n\
             \x20   - {name: r, key: [client_ip], capacity: 5.0, period_ms: 1000}\n",
        );
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].at, "WasmPlugin ns/t: spec.pluginConfig");
        let bytes = found[0].bytes.clone().unwrap_or_default();
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            r#"{"rules":[{"capacity":5,"key":["client_ip"],"name":"r","period_ms":1000}],"service":{"cluster":"c"}}"#
        );
        assert_eq!(check_plugin(&bytes), Verdict::Accepted(String::new()));
    }

    #[test]
    fn every_wasm_filter_of_a_bootstrap_is_found_with_its_place() {
        let found = configs(
            "filters:\n- name: a\n  typed_config:\n    \"@type\": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm\n\
             \x20   config:\n      configuration:\n        \"@type\": type.googleapis.com/google.protobuf.StringValue\n\
             \x20       value: '{}'\n\
             - name: b\n  typed_config:\n    \"@type\": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm\n\
             \x20   config:\n      configuration:\n        \"@type\": type.googleapis.com/google.protobuf.Struct\n\
             \x20       value: {a: 1}\n",
        );
        assert_eq!(found.len(), 2, "{found:?}");
        assert_eq!(
            found[0].at,
            "document 1: filters[0].typed_config.config.configuration"
        );
        assert_eq!(found[0].bytes, Ok(b"{}".to_vec()));
        assert!(found[1].bytes.is_err(), "{found:?}");
    }

    #[test]
    fn an_empty_configuration_is_refused_as_the_module_refuses_it() {
        assert_eq!(check_plugin(b""), Verdict::Refused(vec![MISSING.into()]));
        let Verdict::Refused(why) = check_plugin(br#"{"rules": []}"#) else {
            unreachable!()
        };
        assert_eq!(
            why,
            [
                "service: missing (required)",
                "rules: must hold between 1 and 16 rules"
            ]
        );
    }

    #[test]
    fn a_configmap_holds_limits_files() {
        let files = limits_files(
            "kind: ConfigMap\nmetadata: {name: l}\ndata:\n  a.yaml: |\n    domain: d\n  b.yaml: \"domain: [\"\n  d.json: \"{}\"\n",
        );
        assert_eq!(files.len(), 2);
        assert_eq!(files[0].0, "ConfigMap l: data.a.yaml");
        assert!(matches!(check_limits(&files[0].1), Verdict::Accepted(_)));
        assert!(matches!(check_limits(&files[1].1), Verdict::Refused(_)));
        assert_eq!(limits_files("domain: d\n")[0].0, "");
    }
}
