//! The one builder of the filter's plugin configuration (docs/filter-config.md), for everything
//! that runs the filter: the end-to-end tests, the checked-in Envoy configurations
//! ([`crate::envoy_files`]), and through `tollgate-envoy-config` the demo and the benchmarks.
//!
//! Values are JSON text, as the filter reads them (a rule as written in the docs, a number, a
//! quoted string): the builder places them, the filter's reader checks them.

use std::fmt;

/// A plugin configuration: its `service` section (always the `tollgate` cluster), its rules in
/// order, and its other top-level fields in the order they were first set (those set before the
/// first rule written before the rules).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plugin {
    service: Vec<(String, String)>,
    rules: Vec<String>,
    fields: Vec<(String, String)>,
    /// How many of `fields` were set before the first rule.
    before_rules: usize,
}

impl Plugin {
    /// Calls the `tollgate` cluster over `transport` (`http`, `grpc`, `rls`), a callout timing out
    /// after `timeout_ms`.
    pub fn new(transport: &str, timeout_ms: u64) -> Plugin {
        Plugin::defaults()
            .service("transport", quoted(transport))
            .service("timeout_ms", timeout_ms)
    }

    /// Calls the `tollgate` cluster, every other service field the filter's default.
    pub fn defaults() -> Plugin {
        Plugin {
            service: Vec::new(),
            rules: Vec::new(),
            fields: Vec::new(),
            before_rules: 0,
        }
        .service("cluster", quoted("tollgate"))
    }

    /// Sets the service field `name` to `json` (a field set again keeps its place).
    pub fn service(mut self, name: &str, json: impl ToString) -> Plugin {
        set(&mut self.service, name, json.to_string());
        self
    }

    /// `service.stream`: takes as messages on a stream per worker (transport `grpc`'s default).
    pub fn stream(self, on: bool) -> Plugin {
        self.service("stream", on)
    }

    /// `service.batch`: at most this many requests of a worker wait for one callout.
    pub fn batch(self, n: u64) -> Plugin {
        self.service("batch", n)
    }

    /// `service.remember_denials_ms` (`0`: denials are not remembered).
    pub fn remember_denials_ms(self, ms: u64) -> Plugin {
        self.service("remember_denials_ms", ms)
    }

    /// Adds a rule, as JSON.
    pub fn rule(mut self, json: impl ToString) -> Plugin {
        self.rules.push(json.to_string());
        self
    }

    /// Sets the top-level field `name` (`response`, `trusted_hops`, ...) to `json`; `service` and
    /// `rules` have their own methods.
    pub fn field(mut self, name: &str, json: impl ToString) -> Plugin {
        set(&mut self.fields, name, json.to_string());
        if self.rules.is_empty() {
            self.before_rules = self.fields.len();
        }
        self
    }

    /// `failure_mode`: `fallback`, `allow` or `deny`.
    pub fn failure_mode(self, mode: &str) -> Plugin {
        self.field("failure_mode", quoted(mode))
    }

    /// `fallback`: this proxy's share is one of `instances`, in a table of `max_keys` buckets.
    pub fn fallback(self, instances: u64, max_keys: u64) -> Plugin {
        let json = format!(r#"{{"instances": {instances}, "max_keys": {max_keys}}}"#);
        self.field("fallback", json)
    }

    /// `breaker`: opens after `failures` in a row, for `open_ms` doubling up to `max_open_ms`.
    pub fn breaker(self, failures: u64, open_ms: u64, max_open_ms: u64) -> Plugin {
        let json = format!(
            r#"{{"failures": {failures}, "open_ms": {open_ms}, "max_open_ms": {max_open_ms}}}"#
        );
        self.field("breaker", json)
    }

    /// `response`: the denial and the rate limit headers, as JSON.
    pub fn response(self, json: impl ToString) -> Plugin {
        self.field("response", json)
    }

    /// The configuration's JSON: one field a line, one rule a line (a rule written on several
    /// lines keeps them, indented).
    pub fn json(&self) -> String {
        let service: Vec<String> = self
            .service
            .iter()
            .map(|(k, v)| format!("{}: {v}", quoted(k)))
            .collect();
        let field = |(k, v): &(String, String)| format!("  {}: {}", quoted(k), v.trim());
        let (before, after) = self.fields.split_at(self.before_rules);
        let mut lines = vec![format!("  \"service\": {{{}}}", service.join(", "))];
        lines.extend(before.iter().map(field));
        let rules: Vec<String> = self
            .rules
            .iter()
            .map(|r| format!("    {}", r.trim().replace('\n', "\n    ")))
            .collect();
        lines.push(match rules.is_empty() {
            true => "  \"rules\": []".to_string(),
            false => format!("  \"rules\": [\n{}\n  ]", rules.join(",\n")),
        });
        lines.extend(after.iter().map(field));
        format!("{{\n{}\n}}\n", lines.join(",\n"))
    }
}

impl fmt::Display for Plugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.json())
    }
}

/// `s` as a JSON string (the names and values given here need no escape but `"` and `\`).
pub fn quoted(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

fn set(fields: &mut Vec<(String, String)>, name: &str, json: String) {
    match fields.iter_mut().find(|(k, _)| k == name) {
        Some(field) => field.1 = json,
        None => fields.push((name.to_string(), json)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_each_part_in_its_place() {
        let p = Plugin::new("grpc", 50)
            .field("trusted_hops", 0)
            .remember_denials_ms(0)
            .rule(r#"{"name": "a", "capacity": 5, "period_ms": 1000}"#)
            .rule("{\"name\": \"b\",\n \"capacity\": 1, \"period_ms\": 1000}")
            .failure_mode("fallback")
            .fallback(2, 100)
            .service("timeout_ms", 20);
        assert_eq!(
            p.json(),
            "{\n  \"service\": {\"cluster\": \"tollgate\", \"transport\": \"grpc\", \
             \"timeout_ms\": 20, \"remember_denials_ms\": 0},\n  \"trusted_hops\": 0,\n  \
             \"rules\": [\n    \
             {\"name\": \"a\", \"capacity\": 5, \"period_ms\": 1000},\n    {\"name\": \"b\",\n     \
             \"capacity\": 1, \"period_ms\": 1000}\n  ],\n  \"failure_mode\": \"fallback\",\n  \
             \"fallback\": {\"instances\": 2, \"max_keys\": 100}\n}\n"
        );
        assert_eq!(
            Plugin::defaults().json(),
            "{\n  \"service\": {\"cluster\": \"tollgate\"},\n  \"rules\": []\n}\n"
        );
    }
}
