//! The limits file: envoyproxy/ratelimit's YAML format, parsed and checked once into a lookup tree.
//!
//! A file holds one or more YAML documents (`---`), each one domain:
//!
//! ```yaml
//! domain: edge
//! descriptors:
//!   - key: remote_address          # empty value: any value, each its own bucket
//!     rate_limit: {unit: minute, requests_per_unit: 100, burst: 20}
//!   - key: path
//!     value: "/api/*"              # wildcard: `*` matches any run of characters
//!     rate_limit: {unit: second, requests_per_unit: 10, algorithm: fixed_window}
//! ```
//!
//! Every key envoyproxy/ratelimit accepts is accepted (`domain`, `key`, `value`, `descriptors`,
//! `rate_limit` with `unit`, `unit_multiplier`, `requests_per_unit`, `unlimited`, `name`,
//! `replaces`; `shadow_mode`, `quota_mode`, `detailed_metric`, `value_to_metric`,
//! `share_threshold`, `metadata`), plus Tollgate's own in `rate_limit`: `algorithm`
//! (`token_bucket`, the default, `fixed_window`, `sliding_window` or `calendar_window`: the
//! contract's names, `contract::Algorithm`), `burst` (token bucket: the capacity, default
//! `requests_per_unit`), `time_zone` (a calendar window's: UTC, `+HH:MM` or an IANA name) and
//! `charge` (`request`, the default, or `response`: see [`Limit::charge_response`]). Any other key
//! is an error, and every error names the domain and the descriptor path.
//!
//! `unit: month` keeps upstream's meaning by default, 30 days (a year 365), windows counted from
//! the Unix epoch; with `algorithm: calendar_window` a `day`, `week`, `month` or `year` is the
//! calendar's instead, from midnight in `time_zone` ([`Limit::calendar`]).
//!
//! The lookup follows envoyproxy/ratelimit's: per request entry, the exact `key`+`value` first,
//! then the first wildcard value of that key that matches, then the key alone; a limit applies only
//! when it sits at the request's last entry.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use serde::Deserialize;

use crate::domain::{Algorithm, MAX_AMOUNT, MAX_PERIOD_MS};

/// A time unit of `rate_limit.unit` (case-insensitive in the file). Month and year are 30 and
/// 365 days, as in envoyproxy/ratelimit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    /// One second.
    Second,
    /// 60 s.
    Minute,
    /// 3,600 s.
    Hour,
    /// 86,400 s.
    Day,
    /// 7 days.
    Week,
    /// 30 days.
    Month,
    /// 365 days.
    Year,
}

impl Unit {
    /// From the file's spelling (any case) or the protobuf enum's name.
    pub fn parse(s: &str) -> Option<Unit> {
        Some(match s.to_ascii_lowercase().as_str() {
            "second" => Unit::Second,
            "minute" => Unit::Minute,
            "hour" => Unit::Hour,
            "day" => Unit::Day,
            "week" => Unit::Week,
            "month" => Unit::Month,
            "year" => Unit::Year,
            _ => return None,
        })
    }

    /// From `envoy.service.ratelimit.v3.RateLimitResponse.RateLimit.Unit` (0 = UNKNOWN: none).
    pub fn from_proto(v: i32) -> Option<Unit> {
        Some(match v {
            1 => Unit::Second,
            2 => Unit::Minute,
            3 => Unit::Hour,
            4 => Unit::Day,
            5 => Unit::Month,
            6 => Unit::Year,
            7 => Unit::Week,
            _ => return None,
        })
    }

    /// The protobuf enum value.
    pub fn to_proto(self) -> i32 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 2,
            Unit::Hour => 3,
            Unit::Day => 4,
            Unit::Month => 5,
            Unit::Year => 6,
            Unit::Week => 7,
        }
    }

    /// The unit's length in seconds.
    pub fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 30 * 86_400,
            Unit::Year => 365 * 86_400,
        }
    }
}

/// One limit of the file (or one sent by Envoy as a descriptor's `limit`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    /// `requests_per_unit`; 0 denies every request (envoyproxy/ratelimit's "banned" idiom).
    pub requests_per_unit: u64,
    /// `unit`.
    pub unit: Unit,
    /// `unit_multiplier` (1 unless given): the window is this many units.
    pub unit_multiplier: u64,
    /// `unlimited: true`: never limited, never counted.
    pub unlimited: bool,
    /// `shadow_mode: true`: counted, reported OK even when over.
    pub shadow_mode: bool,
    /// `rate_limit.name`, for `replaces` (and the policy name in headers).
    pub name: String,
    /// Names of the limits this one switches off for the same request.
    pub replaces: Vec<String>,
    /// `algorithm`.
    pub algorithm: Algorithm,
    /// Token bucket capacity (`burst`, default `requests_per_unit`).
    pub capacity: u64,
    /// Where it sits: `domain.key_value.key` (logs, the default policy name).
    pub path: String,
    /// `detailed_metric` on its descriptor: its statistics are keyed on every value of the
    /// request (`/metrics`, `tollgate_rls_hits_total`), not on the file's; see [`Found::stat`].
    pub detailed_metric: bool,
    /// `charge: response`: the limit is priced by what responses used, in Envoy's response-cost
    /// pattern (a check with `hits_addend: 0` when the request arrives, the real cost sent with
    /// `apply_on_stream_done` when it ends). A descriptor with a cost is then charged in full
    /// even past the limit, into debt, since the work was done already; the checks deny until
    /// the debt is repaid.
    pub charge_response: bool,
    /// `algorithm: calendar_window`: the calendar period `unit` names (day, week, month, year)
    /// and `time_zone` (UTC when absent); the window is then the calendar's, not `unit` seconds.
    pub calendar: Option<contract::calendar::Calendar>,
}

impl Limit {
    /// The window's length in seconds: the unit times `unit_multiplier`.
    pub fn window_seconds(&self) -> u64 {
        self.unit.seconds().saturating_mul(self.unit_multiplier)
    }

    /// The bucket's period in milliseconds (a calendar window's longest).
    pub fn period_ms(&self) -> u64 {
        match &self.calendar {
            Some(c) => c.unit.nominal_ms(),
            None => self.window_seconds().saturating_mul(1000),
        }
    }
}

/// A checked limits file: domains to descriptor trees.
#[derive(Debug, Default)]
pub struct Limits {
    domains: HashMap<String, Node>,
}

#[derive(Debug, Default)]
struct Node {
    /// Children by `(key, value)`; value `""` is "any value of this key".
    children: HashMap<(String, String), Node>,
    /// Wildcard values, by key, in file order: the value split on `*`, and the child's value.
    wildcards: Vec<Wildcard>,
    limit: Option<Arc<Limit>>,
    /// `share_threshold`: every value the wildcard matches shares one bucket.
    share_threshold: bool,
    /// `value_to_metric`: statistics name the request's value at this level, not the file's.
    value_to_metric: bool,
}

#[derive(Debug)]
struct Wildcard {
    key: String,
    value: String,
    parts: Vec<String>,
}

/// A limit that applies to one request descriptor, and the values its bucket is keyed on.
#[derive(Debug, Clone)]
pub struct Found {
    /// The limit.
    pub limit: Arc<Limit>,
    /// `(key, value)` per request entry; under `share_threshold`, the wildcard instead of the
    /// value.
    pub entries: Vec<(String, String)>,
    /// The key of its statistics, without the domain, as envoyproxy/ratelimit builds it: with
    /// `detailed_metric` every entry's `key_value` (the wildcard under `share_threshold`);
    /// otherwise the path through the file (`key_value`, `key_wildcard*` or `key` per level),
    /// where a level matched by its key alone or by a wildcard names the request's value
    /// instead if its descriptor has `value_to_metric` (`share_threshold` wins over it).
    pub stat: String,
}

impl Limits {
    /// Parses and checks a whole file: every refusal ([`Limits::parse_all`]) on one line, joined
    /// by `; `, as the service logs a refused file.
    pub fn parse(text: &str) -> Result<Limits, String> {
        Limits::parse_all(text).map_err(|all| all.join("; "))
    }

    /// Parses and checks a whole file: every refusal (at least one), in the file's order, each
    /// naming the document, domain and descriptor at fault. A document that does not fit the
    /// schema (an unknown key, a value of the wrong type) is refused by that first error alone:
    /// the schema is serde's derive, which stops there; the other documents are still read. YAML
    /// that does not parse ends the reading: the documents after it cannot be found.
    pub fn parse_all(text: &str) -> Result<Limits, Vec<String>> {
        // The first document that does not parse, found by reading each as anything at all: the
        // parser answers its error again for every document asked for after it, without end.
        let unparsed = serde_yaml_ng::Deserializer::from_str(text)
            .enumerate()
            .find_map(|(i, doc)| {
                serde::de::IgnoredAny::deserialize(doc)
                    .err()
                    .map(|e| (i, e))
            });
        let readable = unparsed.as_ref().map_or(usize::MAX, |(i, _)| *i);
        let mut limits = Limits::default();
        let mut refusals = Vec::new();
        for (i, doc) in serde_yaml_ng::Deserializer::from_str(text)
            .take(readable)
            .enumerate()
        {
            // Straight from the text (not through a Value), so an error carries its line.
            let root = match Option::<YamlRoot>::deserialize(doc) {
                Ok(Some(root)) => root,
                Ok(None) => continue,
                Err(e) => {
                    refusals.push(format!("document {}: {e}", i + 1));
                    continue;
                }
            };
            if root.domain.is_empty() {
                // Its descriptors are named by their domain: checked once it has one.
                refusals.push(format!("document {}: domain: must not be empty", i + 1));
                continue;
            }
            let twice = limits.domains.contains_key(&root.domain);
            if twice {
                refusals.push(format!(
                    "document {}: domain {:?} appears twice",
                    i + 1,
                    root.domain
                ));
            }
            let mut node = Node::default();
            let mut found = Vec::new();
            load(&mut node, &root.domain, &root.descriptors, &mut found);
            refusals.extend(
                found
                    .into_iter()
                    .map(|e| format!("domain {:?}: {e}", root.domain)),
            );
            if !twice {
                limits.domains.insert(root.domain, node);
            }
        }
        if let Some((i, e)) = unparsed {
            refusals.push(format!("document {}: {e}", i + 1));
        }
        if refusals.is_empty() && limits.domains.is_empty() {
            refusals.push("no domain: the file holds no document".into());
        }
        if refusals.is_empty() {
            Ok(limits)
        } else {
            Err(refusals)
        }
    }

    /// Whether the file has a document for `domain` (a descriptor's own `limit` applies only
    /// there, as in envoyproxy/ratelimit).
    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    /// The domains, sorted (logs).
    pub fn domains(&self) -> Vec<&str> {
        let mut d: Vec<&str> = self.domains.keys().map(String::as_str).collect();
        d.sort_unstable();
        d
    }

    /// The limit for one descriptor of `domain`, if any.
    pub fn lookup<'a>(
        &self,
        domain: &str,
        entries: impl ExactSizeIterator<Item = (&'a str, &'a str)>,
    ) -> Option<Found> {
        let mut node = self.domains.get(domain)?;
        let n = entries.len();
        let mut keyed = Vec::with_capacity(n);
        let mut path = Vec::with_capacity(n);
        let mut found = None;
        for (i, (key, value)) in entries.enumerate() {
            let exact = node.children.get(&(key.to_string(), value.to_string()));
            // The node, the wildcard it was matched by if any, and whether by the key alone.
            let (next, wildcard) = match exact {
                Some(next) => (Some(next), None),
                None => match node
                    .wildcards
                    .iter()
                    .find(|w| w.key == key && wildcard_match(&w.parts, value))
                {
                    Some(w) => (
                        node.children.get(&(w.key.clone(), w.value.clone())),
                        Some(w.value.as_str()),
                    ),
                    None => (
                        node.children.get(&(key.to_string(), String::new())),
                        Some(""),
                    ),
                },
            };
            let next = next?;
            let shared = wildcard.filter(|_| next.share_threshold);
            keyed.push((key.to_string(), shared.unwrap_or(value).to_string()));
            path.push(match wildcard {
                Some(w) if next.share_threshold || !next.value_to_metric => stat_step(key, w),
                _ => stat_step(key, value),
            });
            if i + 1 == n {
                found = next.limit.clone();
            }
            if next.children.is_empty() {
                break;
            }
            node = next;
        }
        found.filter(|_| keyed.len() == n).map(|limit| {
            let stat = if limit.detailed_metric {
                let steps: Vec<String> = keyed.iter().map(|(k, v)| stat_step(k, v)).collect();
                steps.join(".")
            } else {
                path.join(".")
            };
            Found {
                limit,
                entries: keyed,
                stat,
            }
        })
    }
}

/// One level of a statistics key: `key_value`, or `key` for an empty value.
pub fn stat_step(key: &str, value: &str) -> String {
    if value.is_empty() {
        key.to_string()
    } else {
        format!("{key}_{value}")
    }
}

/// `*` matches any run of characters (also none); `parts` is the pattern split on `*`.
fn wildcard_match(parts: &[String], value: &str) -> bool {
    let (Some(first), Some(last)) = (parts.first(), parts.last()) else {
        return false;
    };
    if parts.len() == 1 {
        return first == value;
    }
    let fixed: usize = parts.iter().map(String::len).sum();
    if value.len() < fixed || !value.starts_with(first.as_str()) || !value.ends_with(last.as_str())
    {
        return false;
    }
    let mut rest = &value[first.len()..value.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part.as_str()) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

/// Loads `descriptors` under `node`, every refusal kept in `refusals`: a descriptor refused is
/// still walked, its descriptors checked.
fn load(node: &mut Node, parent: &str, descriptors: &[YamlDescriptor], refusals: &mut Vec<String>) {
    for (i, d) in descriptors.iter().enumerate() {
        let path = format!("{parent}.{}", stat_step(&d.key, &d.value));
        let at = |m: &str| format!("descriptor {path} (descriptors[{i}]): {m}");
        if d.key.is_empty() {
            refusals.push(at("key: must not be empty"));
        }
        let id = (d.key.clone(), d.value.clone());
        if node.children.contains_key(&id) {
            refusals.push(at("appears twice at this level"));
        }
        if d.share_threshold && !d.value.contains('*') {
            refusals.push(at("share_threshold: needs a wildcard value (with '*')"));
        }
        let limit = match &d.rate_limit {
            None => None,
            Some(r) => match limit_of(r, d.shadow_mode, &path) {
                Ok(mut l) => {
                    l.detailed_metric = d.detailed_metric;
                    Some(Arc::new(l))
                }
                Err(all) => {
                    refusals.extend(all.iter().map(|m| at(&format!("rate_limit.{m}"))));
                    None
                }
            },
        };
        let mut child = Node {
            limit,
            share_threshold: d.share_threshold,
            value_to_metric: d.value_to_metric,
            ..Node::default()
        };
        load(&mut child, &path, &d.descriptors, refusals);
        if d.value.contains('*') {
            node.wildcards.push(Wildcard {
                key: d.key.clone(),
                value: d.value.clone(),
                parts: d.value.split('*').map(str::to_string).collect(),
            });
        }
        node.children.entry(id).or_insert(child);
    }
}

/// A descriptor's `rate_limit`: the limit, or every refusal of it (each field read whatever the
/// others' refusals; what depends on a refused one, the window on the unit, `burst` on the
/// algorithm, is skipped).
fn limit_of(r: &YamlRateLimit, shadow_mode: bool, path: &str) -> Result<Limit, Vec<String>> {
    let mut refusals: Vec<String> = Vec::new();
    let unit = match (&r.unit, r.unlimited) {
        (Some(u), true) if Unit::parse(u).is_some() => {
            refusals.push("unit: must not be given with unlimited: true".into());
            None
        }
        (_, true) => Some(Unit::Second),
        (Some(u), false) => {
            let unit = Unit::parse(u);
            if unit.is_none() {
                refusals.push(format!(
                    "unit: {u:?} is not one of second, minute, hour, day, week, month, year"
                ));
            }
            unit
        }
        (None, false) => {
            refusals.push("unit: is required (or unlimited: true)".into());
            None
        }
    };
    let unit_multiplier = match r.unit_multiplier {
        None => Some(1),
        Some(0) => {
            refusals.push("unit_multiplier: must be at least 1".into());
            None
        }
        Some(m) => Some(u64::from(m)),
    };
    if let (Some(unit), Some(unit_multiplier)) = (unit, unit_multiplier) {
        let window_ms = unit
            .seconds()
            .saturating_mul(unit_multiplier)
            .saturating_mul(1000);
        if window_ms > MAX_PERIOD_MS {
            refusals.push(format!(
                "unit_multiplier: {unit_multiplier} x {} s is longer than the longest window (one year)",
                unit.seconds()
            ));
        }
    }
    // Read only to be refused by name: a plain "unknown field" would not say why.
    for (name, given) in [
        ("shape", r.shape.is_some()),
        ("max_delay", r.max_delay.is_some()),
        ("max_delay_ms", r.max_delay_ms.is_some()),
    ] {
        if given {
            refusals.push(format!(
                "{name}: shaping (holding a request until its tokens are there) needs the \
                 Tollgate filter; Envoy's rate limit filter cannot hold a request, so an RLS \
                 limit is never shaped"
            ));
        }
    }
    let charge_response = match r.charge.as_deref() {
        None | Some("request") => false,
        Some("response") => true,
        Some(other) => {
            refusals.push(format!(
                "charge: {other:?} is not one of \"request\", \"response\""
            ));
            false
        }
    };
    let rpu = u64::from(r.requests_per_unit);
    if rpu > MAX_AMOUNT {
        refusals.push(format!(
            "requests_per_unit: must be at most {MAX_AMOUNT}, got {rpu}"
        ));
    }
    let algorithm = match r.algorithm.as_deref() {
        None => Some(Algorithm::TokenBucket),
        Some(name) => {
            let algorithm = Algorithm::from_name(name);
            if algorithm.is_none() {
                refusals.push(format!(
                    "algorithm: {name:?} is not one of {}",
                    Algorithm::expected()
                ));
            }
            algorithm
        }
    };
    let capacity = match (r.burst, algorithm) {
        (None, _) => rpu,
        // `burst` is for one algorithm: skipped with the algorithm refused.
        (Some(b), None) => b,
        (Some(b), Some(a)) if a != Algorithm::TokenBucket => {
            refusals.push("burst: applies to token_bucket only".into());
            b
        }
        (Some(b), _) if b == 0 || b > MAX_AMOUNT => {
            refusals.push(format!("burst: must be 1..={MAX_AMOUNT}, got {b}"));
            b
        }
        (Some(b), _) => b,
    };
    let calendar = calendar_of(r, unit, unit_multiplier, algorithm, &mut refusals);
    for rep in &r.replaces {
        if rep.name.is_empty() {
            refusals.push("replaces: an entry has an empty name".into());
        } else if rep.name == r.name {
            refusals.push(format!("replaces: names this limit itself ({:?})", r.name));
        }
    }
    match (unit, unit_multiplier, algorithm) {
        (Some(unit), Some(unit_multiplier), Some(algorithm)) if refusals.is_empty() => Ok(Limit {
            requests_per_unit: rpu,
            unit,
            unit_multiplier,
            unlimited: r.unlimited,
            shadow_mode,
            name: r.name.clone(),
            replaces: r.replaces.iter().map(|x| x.name.clone()).collect(),
            algorithm,
            capacity,
            path: path.to_string(),
            detailed_metric: false,
            charge_response,
            calendar,
        }),
        _ => Err(refusals),
    }
}

/// A calendar window's period and zone (`algorithm: calendar_window`): `unit` one of day, week,
/// month, year, one of them (`unit_multiplier` 1), and `time_zone` a zone this service knows;
/// `time_zone` is refused with any other algorithm.
fn calendar_of(
    r: &YamlRateLimit,
    unit: Option<Unit>,
    unit_multiplier: Option<u64>,
    algorithm: Option<Algorithm>,
    refusals: &mut Vec<String>,
) -> Option<contract::calendar::Calendar> {
    use contract::calendar::{Calendar, Unit as Period};
    if algorithm != Some(Algorithm::CalendarWindow) {
        if r.time_zone.is_some() && algorithm.is_some() {
            refusals.push("time_zone: applies to calendar_window only".into());
        }
        return None;
    }
    if unit_multiplier.is_some_and(|m| m != 1) {
        refusals.push("unit_multiplier: a calendar window is one day, week, month or year".into());
    }
    let period = match unit? {
        Unit::Day => Period::Day,
        Unit::Week => Period::Week,
        Unit::Month => Period::Month,
        Unit::Year => Period::Year,
        other => {
            refusals.push(format!(
                "unit: a calendar window is a day, week, month or year, not {other:?}"
            ));
            return None;
        }
    };
    let zone = r
        .time_zone
        .clone()
        .unwrap_or_else(|| contract::calendar::UTC.to_string());
    if let Err(why) = crate::calendar::check_zone(&zone) {
        refusals.push(format!("time_zone: {why}"));
    }
    Some(Calendar { unit: period, zone })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlRoot {
    #[serde(default)]
    domain: String,
    #[serde(default)]
    descriptors: Vec<YamlDescriptor>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlDescriptor {
    #[serde(default)]
    key: String,
    #[serde(default, deserialize_with = "scalar_string")]
    value: String,
    #[serde(default)]
    rate_limit: Option<YamlRateLimit>,
    #[serde(default)]
    descriptors: Vec<YamlDescriptor>,
    #[serde(default)]
    shadow_mode: bool,
    /// Accepted; counted as an ordinary limit (docs/rls.md, "What differs from envoyproxy/ratelimit").
    #[serde(default)]
    #[allow(dead_code)]
    quota_mode: bool,
    #[serde(default)]
    detailed_metric: bool,
    #[serde(default)]
    value_to_metric: bool,
    #[serde(default)]
    share_threshold: bool,
    #[serde(default)]
    #[allow(dead_code)]
    metadata: Option<BTreeMap<String, serde_yaml_ng::Value>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlRateLimit {
    #[serde(default)]
    requests_per_unit: u32,
    #[serde(default)]
    unit: Option<String>,
    #[serde(default)]
    unit_multiplier: Option<u32>,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    name: String,
    #[serde(default)]
    replaces: Vec<YamlReplaces>,
    #[serde(default)]
    algorithm: Option<String>,
    #[serde(default)]
    burst: Option<u64>,
    #[serde(default)]
    charge: Option<String>,
    #[serde(default)]
    time_zone: Option<String>,
    /// Shaping options, refused by name (`limit_of`).
    #[serde(default)]
    shape: Option<serde_yaml_ng::Value>,
    #[serde(default)]
    max_delay: Option<serde_yaml_ng::Value>,
    #[serde(default)]
    max_delay_ms: Option<serde_yaml_ng::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlReplaces {
    #[serde(default)]
    name: String,
}

/// A descriptor value written as a number or a boolean (`value: 200`) is its text, as with
/// envoyproxy/ratelimit's YAML decoder.
fn scalar_string<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    use serde_yaml_ng::Value;
    match Value::deserialize(d)? {
        Value::String(s) => Ok(s),
        Value::Number(n) => Ok(n.to_string()),
        Value::Bool(b) => Ok(b.to_string()),
        Value::Null => Ok(String::new()),
        _ => Err(serde::de::Error::custom("value: must be a string")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn find(l: &Limits, domain: &str, entries: &[(&str, &str)]) -> Option<Found> {
        l.lookup(domain, entries.iter().copied())
    }

    fn rpu(l: &Limits, domain: &str, entries: &[(&str, &str)]) -> Option<u64> {
        find(l, domain, entries).map(|f| f.limit.requests_per_unit)
    }

    const DOC: &str = r#"
domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 100, burst: 20}
  - key: path
    value: "/api/*"
    rate_limit: {unit: second, requests_per_unit: 10, algorithm: fixed_window}
  - key: path
    value: "/api/special"
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: path
    value: "/api/sliding"
    rate_limit: {unit: minute, requests_per_unit: 6, algorithm: sliding_window}
  - key: path
    value: "/files/*/raw"
    share_threshold: true
    rate_limit: {unit: hour, requests_per_unit: 7}
  - key: code
    value: 429
    rate_limit: {unit: day, requests_per_unit: 1}
  - key: user
    descriptors:
      - key: plan
        value: free
        rate_limit: {unit: HOUR, requests_per_unit: 5}
"#;

    #[test]
    fn lookup_follows_envoyproxy_ratelimit() {
        let l = Limits::parse(DOC).unwrap_or_default();
        assert_eq!(
            rpu(&l, "edge", &[("remote_address", "10.0.0.1")]),
            Some(100)
        );
        let f = find(&l, "edge", &[("remote_address", "10.0.0.1")]);
        assert_eq!(f.map(|f| f.limit.capacity), Some(20));
        // Exact value before wildcard; wildcard before nothing.
        assert_eq!(rpu(&l, "edge", &[("path", "/api/special")]), Some(3));
        let f = find(&l, "edge", &[("path", "/api/sliding")]);
        assert_eq!(f.map(|f| f.limit.algorithm), Some(Algorithm::SlidingWindow));
        assert_eq!(rpu(&l, "edge", &[("path", "/api/x")]), Some(10));
        assert_eq!(rpu(&l, "edge", &[("path", "/other")]), None);
        // Middle wildcard, shared bucket.
        let f = find(&l, "edge", &[("path", "/files/a/b/raw")]);
        assert_eq!(
            f.map(|f| f.entries),
            Some(vec![("path".into(), "/files/*/raw".into())])
        );
        assert_eq!(rpu(&l, "edge", &[("path", "/files/a/raw.txt")]), None);
        // Numbers as values.
        assert_eq!(rpu(&l, "edge", &[("code", "429")]), Some(1));
        // Nested: only at the request's last entry.
        assert_eq!(
            rpu(&l, "edge", &[("user", "u1"), ("plan", "free")]),
            Some(5)
        );
        assert_eq!(rpu(&l, "edge", &[("user", "u1")]), None);
        assert_eq!(rpu(&l, "edge", &[("user", "u1"), ("plan", "pro")]), None);
        // Deeper requests than the tree.
        assert_eq!(
            rpu(&l, "edge", &[("remote_address", "a"), ("x", "y")]),
            None
        );
        assert_eq!(rpu(&l, "other", &[("remote_address", "a")]), None);
    }

    #[test]
    fn errors_name_the_place() {
        let cases = [
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: minutes, requests_per_unit: 1}\n", "descriptor d.a (descriptors[0]): rate_limit.unit"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limt: {unit: minute}\n", "rate_limt"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: true, unit: minute}\n", "unit: must not be given"),
            ("domain: d\ndescriptors:\n  - key: a\n  - key: a\n", "appears twice"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, burst: 0}\n", "burst"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, algorithm: leaky}\n", "algorithm"),
            ("domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - value: x\n", "descriptor d.a._x (descriptors[0]): key: must not be empty"),
            ("descriptors: []\n", "domain: must not be empty"),
            ("domain: d\n---\ndomain: d\n", "appears twice"),
            ("", "no domain"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, unit_multiplier: 0}\n", "rate_limit.unit_multiplier: must be at least 1"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: month, requests_per_unit: 1, unit_multiplier: 13}\n", "rate_limit.unit_multiplier: 13 x 2592000 s"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, charge: later}\n", "rate_limit.charge: \"later\""),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, shape: true}\n", "rate_limit.shape: shaping (holding a request until its tokens are there) needs the Tollgate filter"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, max_delay: 1s}\n", "rate_limit.max_delay: shaping"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, max_delay_ms: 500}\n", "rate_limit.max_delay_ms: shaping"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: hour, requests_per_unit: 1, algorithm: calendar_window}\n", "rate_limit.unit: a calendar window is a day, week, month or year"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: day, unit_multiplier: 2, requests_per_unit: 1, algorithm: calendar_window}\n", "rate_limit.unit_multiplier: a calendar window is one"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: month, requests_per_unit: 1, algorithm: calendar_window, time_zone: Mars/Olympus}\n", "rate_limit.time_zone: \"Mars/Olympus\" is not a time zone"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: month, requests_per_unit: 1, time_zone: UTC}\n", "rate_limit.time_zone: applies to calendar_window only"),
        ];
        for (text, want) in cases {
            let got = Limits::parse(text).err().unwrap_or_default();
            assert!(got.contains(want), "{text:?}: {got:?}");
        }
    }

    #[test]
    fn every_refusal_is_reported_in_the_files_order() {
        let text = [
            "domain: d",
            "descriptors:",
            "  - key: a",
            "    rate_limit: {unit: minutes, requests_per_unit: 1, burst: 0, charge: later}",
            "  - key: ''",
            "    descriptors:",
            "      - {key: b, rate_limit: {unit: second, unit_multiplier: 0}}",
            "  - key: c",
            "    rate_limit: {unit: second, requests_per_unit: 1, algorithm: leaky, burst: 5}",
            "---",
            "domain: e",
            "bogus: 1",
            "---",
            "domain: d",
            "---",
            "domain: [",
            "---",
            "domain: f",
        ]
        .join("\n");
        let text = text.as_str();
        let all = Limits::parse_all(text).err().unwrap_or_default();
        let want = [
            "domain \"d\": descriptor d.a (descriptors[0]): rate_limit.unit: \"minutes\"",
            "domain \"d\": descriptor d.a (descriptors[0]): rate_limit.charge: \"later\"",
            "domain \"d\": descriptor d.a (descriptors[0]): rate_limit.burst: must be 1..=",
            "domain \"d\": descriptor d. (descriptors[1]): key: must not be empty",
            "domain \"d\": descriptor d..b (descriptors[0]): rate_limit.unit_multiplier: must be at least 1",
            // No complaint of `burst` beside an algorithm that is refused.
            "domain \"d\": descriptor d.c (descriptors[2]): rate_limit.algorithm: \"leaky\"",
            "document 2: unknown field `bogus`",
            "document 3: domain \"d\" appears twice",
            // YAML that does not parse ends the reading.
            "document 4: ",
        ];
        assert_eq!(all.len(), want.len(), "{all:#?}");
        for (got, want) in all.iter().zip(want) {
            assert!(got.starts_with(want), "{got:?} / {want:?}\n{all:#?}");
        }
        // The service's one line holds them all.
        assert_eq!(Limits::parse(text).err(), Some(all.join("; ")));
    }

    #[test]
    fn windows_of_every_unit_and_multiplier() {
        let doc = "domain: d\ndescriptors:\n\
          - {key: k, value: w, rate_limit: {unit: week, requests_per_unit: 7}}\n\
          - {key: k, value: m, rate_limit: {unit: month, requests_per_unit: 30}}\n\
          - {key: k, value: y, rate_limit: {unit: year, requests_per_unit: 365}}\n\
          - {key: k, value: five, rate_limit: {unit: minute, unit_multiplier: 5, requests_per_unit: 10}}\n\
          - {key: k, value: zero, rate_limit: {unit: minute, requests_per_unit: 0}}\n\
          - {key: k, value: resp, rate_limit: {unit: minute, requests_per_unit: 2, charge: response}}\n";
        let l = Limits::parse(doc);
        assert!(l.is_ok(), "{l:?}");
        let l = l.unwrap_or_default();
        let period = |v: &str| find(&l, "d", &[("k", v)]).map(|f| f.limit.period_ms());
        assert_eq!(period("w"), Some(7 * 86_400_000));
        assert_eq!(period("m"), Some(30 * 86_400_000));
        assert_eq!(period("y"), Some(365 * 86_400_000));
        assert_eq!(period("five"), Some(300_000));
        assert_eq!(rpu(&l, "d", &[("k", "zero")]), Some(0));
        let resp = find(&l, "d", &[("k", "resp")]).map(|f| f.limit.charge_response);
        assert_eq!(resp, Some(true));
        assert!(l.has_domain("d") && !l.has_domain("e"));
        // Upstream's month (30 days) stays the default; the calendar's is asked for by name.
        let cal = Limits::parse(
            "domain: d\ndescriptors:\n  - {key: k, rate_limit: {unit: month, requests_per_unit: 500, \
             algorithm: calendar_window, time_zone: Europe/Berlin}}\n",
        )
        .unwrap_or_default();
        let c = find(&cal, "d", &[("k", "x")]).and_then(|f| f.limit.calendar.clone());
        assert_eq!(
            c.map(|c| (c.unit, c.zone)),
            Some((contract::calendar::Unit::Month, "Europe/Berlin".to_string()))
        );
    }

    #[test]
    fn wildcards() {
        let p = |s: &str| s.split('*').map(str::to_string).collect::<Vec<_>>();
        assert!(wildcard_match(&p("foo*"), "foo"));
        assert!(wildcard_match(&p("foo*"), "foobar"));
        assert!(!wildcard_match(&p("foo*"), "fo"));
        assert!(wildcard_match(&p("a*b*c"), "a-b-c"));
        assert!(!wildcard_match(&p("a*b*c"), "a-c"));
        assert!(!wildcard_match(&p("ab*ba"), "aba"));
        assert!(wildcard_match(&p("*"), ""));
    }
}
