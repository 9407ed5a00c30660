//! Reading the JSON plugin configuration into a [`Config`].

use super::model::*;
use super::rules;
use serde_json::{Map, Value};

fn err<T>(field: impl Into<String>, message: impl Into<String>) -> Result<T, ConfigError> {
    Err(ConfigError {
        field: field.into(),
        message: message.into(),
    })
}

// The document is parsed into a `serde_json::Value` and walked by hand: each object is checked
// against its list of known fields, and each value is read with its full path at hand, so every
// error (unknown field, wrong type, out of range) names the field. A derive with
// `deny_unknown_fields` plus a path-tracking wrapper did the same for about 60 KiB more module.

/// One JSON object being read, with its path and its known fields.
struct Obj<'a> {
    at: String,
    map: &'a Map<String, Value>,
}

fn join(at: &str, field: &str) -> String {
    if at.is_empty() {
        field.to_string()
    } else {
        format!("{at}.{field}")
    }
}

impl<'a> Obj<'a> {
    /// `v` must be an object whose fields are all in `known`.
    fn new(v: &'a Value, at: &str, known: &[&str]) -> Result<Obj<'a>, ConfigError> {
        let Value::Object(map) = v else {
            return err(
                if at.is_empty() { "config" } else { at },
                "must be an object",
            );
        };
        for k in map.keys() {
            if !known.contains(&k.as_str()) {
                // An empty key still gets a name in the error.
                let name = if k.is_empty() { "\"\"" } else { k.as_str() };
                return err(
                    join(at, name),
                    format!("unknown field (expected one of: {})", listed(known, "")),
                );
            }
        }
        Ok(Obj {
            at: at.to_string(),
            map,
        })
    }

    fn path(&self, f: &str) -> String {
        join(&self.at, f)
    }

    /// A field's value; JSON `null` counts as absent.
    fn get(&self, f: &str) -> Option<&'a Value> {
        self.map.get(f).filter(|v| !v.is_null())
    }

    fn required(&self, f: &str) -> Result<&'a Value, ConfigError> {
        match self.get(f) {
            Some(v) => Ok(v),
            None => err(self.path(f), "missing (required)"),
        }
    }

    /// An integer in `lo..=hi`, or `default` when absent.
    fn int(&self, f: &str, default: Option<u64>, lo: u64, hi: u64) -> Result<u64, ConfigError> {
        let v = match (self.get(f), default) {
            (Some(v), _) => v,
            (None, Some(d)) => return Ok(d),
            (None, None) => return err(self.path(f), "missing (required)"),
        };
        int_value(&self.path(f), v, lo, hi)
    }

    fn string(&self, f: &str) -> Result<Option<String>, ConfigError> {
        match self.get(f) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => err(self.path(f), "must be a string"),
        }
    }

    fn boolean(&self, f: &str) -> Result<bool, ConfigError> {
        self.boolean_or(f, false)
    }

    /// A boolean field, `default` when absent.
    fn boolean_or(&self, f: &str, default: bool) -> Result<bool, ConfigError> {
        match self.get(f) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => err(self.path(f), "must be true or false"),
        }
    }

    fn array(&self, f: &str) -> Result<Option<&'a Vec<Value>>, ConfigError> {
        match self.get(f) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(_) => err(self.path(f), "must be a list"),
        }
    }

    /// One of fixed names, or `default` when absent.
    fn choice<T: Copy>(
        &self,
        f: &str,
        options: &[(&str, T)],
        default: T,
    ) -> Result<T, ConfigError> {
        match self.get(f) {
            None => Ok(default),
            Some(v) => choice_value(&self.path(f), v, options),
        }
    }
}

fn int_value(at: &str, v: &Value, lo: u64, hi: u64) -> Result<u64, ConfigError> {
    match v.as_u64() {
        Some(n) if (lo..=hi).contains(&n) => Ok(n),
        _ => err(at, format!("must be between {lo} and {hi}")),
    }
}

fn choice_value<T: Copy>(at: &str, v: &Value, options: &[(&str, T)]) -> Result<T, ConfigError> {
    if let Some(s) = v.as_str() {
        if let Some((_, t)) = options.iter().find(|(name, _)| *name == s) {
            return Ok(*t);
        }
    }
    let names: Vec<&str> = options.iter().map(|(n, _)| *n).collect();
    err(at, format!("must be one of {}", listed(&names, "\"")))
}

/// `names` separated by `, `, each between `quote`s (one loop, not `join`'s code per type).
fn listed(names: &[&str], quote: &str) -> String {
    let mut out = String::new();
    for (i, n) in names.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str(quote);
        out.push_str(n);
        out.push_str(quote);
    }
    out
}

impl Config {
    /// Parses and validates the plugin configuration (JSON bytes).
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        let doc: Value = match serde_json::from_slice(bytes) {
            Ok(v) => v,
            Err(e) => return err("config", format!("not valid JSON: {e}")),
        };
        let root = Obj::new(
            &doc,
            "",
            &[
                "service",
                "trusted_hops",
                "rules",
                "failure_mode",
                "fallback",
                "breaker",
                "shadow",
                "response",
                "near_limit",
            ],
        )?;
        let service = read_service(&root)?;
        let trusted_hops = root.int("trusted_hops", Some(0), 0, 16)? as u32;
        let raw_rules = root.array("rules")?.ok_or_else(|| ConfigError {
            field: "rules".into(),
            message: "missing (required)".into(),
        })?;
        if raw_rules.is_empty() || raw_rules.len() > MAX_BUCKETS {
            return err(
                "rules",
                format!("must hold between 1 and {MAX_BUCKETS} rules"),
            );
        }
        let shadow = root.boolean("shadow")?;
        let empty = Value::Object(Map::new());
        let response = read_response(
            &Obj::new(
                root.get("response").unwrap_or(&empty),
                "response",
                RESPONSE_FIELDS,
            )?,
            None,
        )?;
        let mut rules: Vec<Rule> = Vec::with_capacity(raw_rules.len());
        for (i, r) in raw_rules.iter().enumerate() {
            let at = format!("rules[{i}]");
            let concurrency = match r.get("kind").filter(|v| !v.is_null()) {
                None => false,
                Some(v) if v.as_str() == Some("rate") => false,
                Some(v) if v.as_str() == Some("concurrency") => true,
                Some(_) => {
                    return err(
                        format!("{at}.kind"),
                        "must be one of \"rate\", \"concurrency\"",
                    )
                }
            };
            if concurrency && service.transport == Transport::Rls {
                return err(
                    format!("{at}.kind"),
                    "concurrency is not available with transport rls (an RLS server holds no slots)",
                );
            }
            let rule = read_rule(&at, r, shadow, &response, concurrency)?;
            if let (Transport::Rls, Some(l)) = (service.transport, rule.rate_limit()) {
                if l.lease.is_some() {
                    return err(
                        format!("{at}.lease"),
                        "not available with transport rls (an RLS server grants no leases)",
                    );
                }
                if l.charge.is_some() {
                    return err(
                        format!("{at}.charge"),
                        "\"response\" is not available with transport rls (an RLS server settles nothing)",
                    );
                }
            }
            if rules.iter().any(|o| o.name == rule.name) {
                return err(
                    format!("{at}.name"),
                    format!("duplicate rule name {:?}", rule.name),
                );
            }
            rules.push(rule);
        }
        let failure_mode = root.choice(
            "failure_mode",
            &[
                ("fallback", FailureMode::Fallback),
                ("allow", FailureMode::Allow),
                ("deny", FailureMode::Deny),
            ],
            FailureMode::Fallback,
        )?;
        let fb = Obj::new(
            root.get("fallback").unwrap_or(&empty),
            "fallback",
            &["instances", "max_keys", "min_instances"],
        )?;
        let fill_ms = rules
            .iter()
            .filter_map(Rule::rate_limit)
            .map(|r| {
                let ms =
                    u128::from(r.capacity) * u128::from(r.period_ms) / u128::from(r.rate.max(1));
                u64::try_from(ms + 1).unwrap_or(u64::MAX)
            })
            .max()
            .unwrap_or(0);
        let fallback = Fallback {
            instances: fb.int("instances", Some(1), 1, 10_000)?,
            min_instances: fb.int("min_instances", Some(1), 1, 10_000)?,
            max_keys: fb.int("max_keys", Some(10_000), 1, 1_000_000)? as u32,
            debt_horizon_ms: fill_ms.clamp(10_000, 3_600_000),
            previous_max_keys: [0; 3],
        };
        let br = Obj::new(
            root.get("breaker").unwrap_or(&empty),
            "breaker",
            &["failures", "open_ms", "max_open_ms"],
        )?;
        let failures = br.int("failures", Some(5), 0, 10_000)? as u32;
        let open_ms = br.int("open_ms", Some(250), 1, 3_600_000)?;
        let max_open_ms = br.int("max_open_ms", Some(open_ms.max(5_000)), open_ms, 3_600_000)?;

        let near_limit_left_permille = match root.get("near_limit") {
            None => 200,
            Some(v) => match v.as_f64() {
                Some(f) if (0.0..=1.0).contains(&f) => 1000 - (f * 1000.0).round() as u64,
                _ => return err("near_limit", "must be a number between 0 and 1"),
            },
        };
        let needs_peer_address = trusted_hops == 0
            && rules.iter().any(|r| {
                r.key.contains(&KeyPart::ClientIp)
                    || r.matcher.reads_client_ip()
                    || (service.transport == Transport::Rls
                        && r.rate_limit().is_some_and(|l| {
                            l.descriptor.iter().any(|(_, p)| *p == KeyPart::ClientIp)
                        }))
            });
        Ok(Config {
            service,
            trusted_hops,
            rules,
            failure_mode,
            fallback,
            breaker: Breaker {
                failures,
                open_ms,
                max_open_ms,
            },
            shadow,
            response,
            needs_peer_address,
            near_limit_left_permille,
            instance: None,
        })
    }
}

/// Text that goes into a header value or a header name must not smuggle a line break or other
/// control characters into the response.
fn header_safe(s: &str) -> bool {
    s.bytes().all(|b| (0x20..0x7f).contains(&b) || b == b'\t')
}

fn is_token_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn header_name(field: &str, name: &str) -> Result<String, ConfigError> {
    if name.is_empty() || name.len() > 256 || !name.bytes().all(is_token_char) {
        return err(field, "must be a header name (1..=256 token characters)");
    }
    Ok(name.to_ascii_lowercase())
}

fn read_service(root: &Obj<'_>) -> Result<Service, ConfigError> {
    let s = Obj::new(
        root.required("service")?,
        "service",
        &[
            "cluster",
            "authority",
            "transport",
            "timeout_ms",
            "path",
            "token",
            "domain",
            "batch",
            "stream",
            "remember_denials_ms",
            "trace",
        ],
    )?;
    let cluster = s.string("cluster")?.unwrap_or_default();
    if cluster.is_empty() || !header_safe(&cluster) {
        return err("service.cluster", "must be a non-empty cluster name");
    }
    let authority = s.string("authority")?.unwrap_or_else(|| cluster.clone());
    if authority.is_empty() || !header_safe(&authority) {
        return err("service.authority", "must be a non-empty host name");
    }
    let transport = s.choice(
        "transport",
        &[
            ("http", Transport::Http),
            ("grpc", Transport::Grpc),
            ("rls", Transport::Rls),
        ],
        Transport::Grpc,
    )?;
    let domain = s.string("domain")?.unwrap_or_default();
    match transport {
        Transport::Rls if domain.is_empty() || domain.len() > 256 => {
            return err(
                "service.domain",
                "required with transport rls: the RLS domain, 1..=256 bytes",
            )
        }
        Transport::Http | Transport::Grpc if !domain.is_empty() => {
            return err("service.domain", "only with transport rls")
        }
        _ => {}
    }
    let timeout_ms = s.int("timeout_ms", Some(20), 1, 60_000)?;
    let path = s.string("path")?.unwrap_or_else(|| "/v1/take".to_string());
    if !path.starts_with('/') || !header_safe(&path) || path.contains(' ') {
        return err(
            "service.path",
            "must start with '/' and hold no spaces or control characters",
        );
    }
    let token = s.string("token")?;
    if let Some(t) = &token {
        if t.is_empty() || t.len() > 4096 || !header_safe(t) {
            return err("service.token", "must be 1..=4096 printable characters");
        }
    }
    let batch = s.int(
        "batch",
        Some(if transport == Transport::Rls {
            0
        } else {
            MAX_BATCH_TAKES as u64
        }),
        0,
        MAX_BATCH_TAKES as u64,
    )? as usize;
    if batch > 0 && transport == Transport::Rls {
        return err("service.batch", "not available with transport rls");
    }
    let stream = s.boolean_or("stream", transport == Transport::Grpc)?;
    if stream && transport != Transport::Grpc {
        return err("service.stream", "only with transport grpc");
    }
    let remember_denials_ms = s.int(
        "remember_denials_ms",
        Some(if transport == Transport::Rls {
            0
        } else {
            DEFAULT_REMEMBER_DENIALS_MS
        }),
        0,
        MAX_REMEMBER_DENIALS_MS,
    )?;
    if remember_denials_ms > 0 && transport == Transport::Rls {
        return err(
            "service.remember_denials_ms",
            "not available with transport rls (another server's retry times are not known)",
        );
    }
    let trace = s.boolean("trace")?;
    Ok(Service {
        cluster,
        authority,
        transport,
        timeout_ms,
        path,
        token,
        domain,
        batch,
        stream,
        remember_denials_ms,
        trace,
    })
}

fn read_rule(
    at: &str,
    v: &Value,
    global_shadow: bool,
    global_response: &Response,
    concurrency: bool,
) -> Result<Rule, ConfigError> {
    let r = Obj::new(v, at, &rules::names())?;
    if concurrency {
        for f in rules::of_the_other_kind(true) {
            if r.get(f).is_some() {
                return err(r.path(f), "not for a concurrency rule");
            }
        }
    }
    let name = match r.required("name")? {
        Value::String(s) => s.clone(),
        _ => String::new(),
    };
    let name_ok = !name.is_empty()
        && name.len() <= MAX_RULE_BYTES
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:/".contains(&b));
    if !name_ok {
        return err(
            r.path("name"),
            format!("must be 1..={MAX_RULE_BYTES} characters from A-Z a-z 0-9 - _ . : /"),
        );
    }
    let matcher = match r.get("match") {
        None => Match::default(),
        Some(m) => read_match(&r.path("match"), m, true)?,
    };
    let raw_key = r.array("key")?.map(Vec::as_slice).unwrap_or(&[]);
    if raw_key.len() > MAX_KEY_PARTS {
        return err(
            r.path("key"),
            format!("must hold at most {MAX_KEY_PARTS} parts"),
        );
    }
    let mut key = Vec::with_capacity(raw_key.len());
    for (j, p) in raw_key.iter().enumerate() {
        let at = format!("{}[{j}]", r.path("key"));
        match p.as_str() {
            Some(p) => key.push(parse_key_part(&at, p)?),
            None => return err(at, "must be a string"),
        }
    }
    let on_missing = r.choice(
        "on_missing",
        &[("skip", OnMissing::Skip), ("shared", OnMissing::Shared)],
        OnMissing::Skip,
    )?;
    let mut kind = if concurrency {
        // A concurrency rule (crate::core::inflight) has its own limit and no rate fields.
        let (lo, hi) = DEADLINE_MS;
        RuleKind::Concurrency(Concurrency {
            max_in_flight: r.int("max_in_flight", None, 1, MAX_IN_FLIGHT)?,
            deadline_ms: r.int("deadline_ms", Some(DEFAULT_DEADLINE_MS), lo, hi)?,
        })
    } else {
        for f in rules::of_the_other_kind(false) {
            if r.get(f).is_some() {
                return err(r.path(f), "only for a rule of kind \"concurrency\"");
            }
        }
        RuleKind::Rate(read_rate(&r, raw_key, &key)?)
    };
    let shadow = match r.get("shadow") {
        None => global_shadow,
        Some(_) => r.boolean("shadow")?,
    };
    let response = match r.get("response") {
        None => global_response.clone(),
        Some(v) => read_response(
            &Obj::new(v, &r.path("response"), RESPONSE_FIELDS)?,
            Some(global_response),
        )?,
    };
    match &mut kind {
        RuleKind::Rate(l) => finish_rate(&r, l, &name, &key)?,
        RuleKind::Concurrency(_) => {
            // `charge` and `usage` are checked as for any rule; a slot charges nothing.
            read_charge(&r)?;
        }
    }
    Ok(Rule {
        name,
        matcher,
        key,
        on_missing,
        shadow,
        response,
        kind,
    })
}

/// A rate rule's `capacity`, `rate`, `period_ms`, `cost`, `algorithm`, `lease`, `overrides` and
/// `tiers`, read before the rule's `shadow` and `response` (its `descriptor` and `charge` after
/// them, by [`finish_rate`]).
fn read_rate(r: &Obj<'_>, raw_key: &[Value], key: &[KeyPart]) -> Result<RateLimit, ConfigError> {
    let capacity = r.int("capacity", None, 1, MAX_AMOUNT)?;
    let rate = r.int("rate", Some(capacity), 1, MAX_AMOUNT)?;
    let period_ms = r.int("period_ms", None, 1, MAX_PERIOD_MS)?;
    let cost = match r.get("cost") {
        None => Cost::Fixed(1),
        Some(Value::Object(_)) => read_cost(
            &Obj::new(
                r.required("cost")?,
                &r.path("cost"),
                &["header", "default", "min", "max", "reserve"],
            )?,
            capacity,
        )?,
        Some(v) => Cost::Fixed(int_value(&r.path("cost"), v, 1, MAX_AMOUNT)?),
    };
    let algorithms: Vec<_> = Algorithm::ALL.iter().map(|&a| (a.name(), a)).collect();
    let algorithm = r.choice("algorithm", &algorithms, Algorithm::default())?;
    let lease = match r.get("lease") {
        None => None,
        Some(v) => {
            let l = Obj::new(v, &r.path("lease"), &["size", "max_age_ms"])?;
            Some(Lease {
                size: match l.get("size") {
                    None => None,
                    Some(v) => Some(int_value(&l.path("size"), v, 1, capacity)?),
                },
                max_age_ms: l.int("max_age_ms", Some(1000), 1, MAX_LEASE_AGE_MS)?,
            })
        }
    };
    let mut overrides = Vec::new();
    let raw = r.array("overrides")?.map(Vec::as_slice).unwrap_or(&[]);
    if raw.len() > MAX_OVERRIDES {
        return err(
            r.path("overrides"),
            format!("must hold at most {MAX_OVERRIDES} entries"),
        );
    }
    for (k, o) in raw.iter().enumerate() {
        overrides.push(read_override(
            &format!("{}[{k}]", r.path("overrides")),
            o,
            raw_key,
            key,
            period_ms,
        )?);
    }
    let tiers = match r.get("tiers") {
        None => None,
        Some(v) => Some(read_tiers(&r.path("tiers"), v, period_ms)?),
    };
    Ok(RateLimit {
        capacity,
        rate,
        period_ms,
        cost,
        algorithm,
        lease,
        overrides,
        tiers,
        descriptor: Vec::new(),
        charge: None,
    })
}

/// A rate rule's `descriptor` and `charge`, read into `l`.
fn finish_rate(
    r: &Obj<'_>,
    l: &mut RateLimit,
    name: &str,
    key: &[KeyPart],
) -> Result<(), ConfigError> {
    l.descriptor = match r.array("descriptor")? {
        None => default_descriptor(name, key),
        Some(entries) => {
            if entries.is_empty() || entries.len() > MAX_KEY_PARTS + 1 {
                return err(
                    r.path("descriptor"),
                    format!("must hold 1..={} entries", MAX_KEY_PARTS + 1),
                );
            }
            let mut d = Vec::with_capacity(entries.len());
            for (k, e) in entries.iter().enumerate() {
                let eat = format!("{}[{k}]", r.path("descriptor"));
                let o = Obj::new(e, &eat, &["key", "value"])?;
                let ek = o.string("key")?.unwrap_or_default();
                if ek.is_empty() || ek.len() > 256 {
                    return err(o.path("key"), "must be 1..=256 bytes");
                }
                let value = o.string("value")?.unwrap_or_default();
                d.push((ek, parse_key_part(&o.path("value"), &value)?));
            }
            d
        }
    };
    l.charge = read_charge(r)?;
    if l.charge.is_some() && l.lease.is_some() {
        return err(
            r.path("lease"),
            "not with \"charge\": \"response\" (a lease spends tokens no response settles)",
        );
    }
    Ok(())
}

/// A `cost` object: a header's value bounded by `min` and `max` (`reserve: "hint"`, the default),
/// or `max` for every request (`reserve: "max"`: the header, its default and floor mean nothing
/// then, and are refused; `max` is required). A hint's `max` defaults to the rule's capacity.
fn read_cost(c: &Obj, capacity: u64) -> Result<Cost, ConfigError> {
    let by_max = c.choice("reserve", &[("hint", false), ("max", true)], false)?;
    if by_max {
        if let Some(f) = ["header", "default", "min"]
            .into_iter()
            .find(|f| c.get(f).is_some())
        {
            return err(
                c.path(f),
                "not with \"reserve\": \"max\" (every request reserves `max`)",
            );
        }
        return Ok(Cost::Fixed(c.int("max", None, 1, MAX_AMOUNT)?));
    }
    let name = header_name(&c.path("header"), &c.string("header")?.unwrap_or_default())?;
    let max = c.int("max", Some(capacity), 1, MAX_AMOUNT)?;
    let min = c.int("min", Some(1), 1, max)?;
    let default = c.int("default", Some(min), min, max)?;
    Ok(Cost::Header {
        name,
        default,
        min,
        max,
    })
}

/// A rule's `charge` and `usage`: `None` for `"charge": "request"` (the default).
fn read_charge(r: &Obj) -> Result<Option<Charge>, ConfigError> {
    let by_response = r.choice("charge", &[("request", false), ("response", true)], false)?;
    if !by_response {
        if r.get("usage").is_some() {
            return err(r.path("usage"), "only with \"charge\": \"response\"");
        }
        return Ok(None);
    }
    let empty = Value::Object(serde_json::Map::new());
    let u = Obj::new(
        r.get("usage").unwrap_or(&empty),
        &r.path("usage"),
        &["header", "body", "weights", "max", "cut"],
    )?;
    let header = match u.string("header")? {
        None => None,
        Some(h) => Some(header_name(&u.path("header"), &h)?),
    };
    let body = match u.get("body") {
        None => true,
        Some(_) => u.boolean("body")?,
    };
    if header.is_none() && !body {
        return err(
            u.path("body"),
            "false leaves no usage to read: name a header",
        );
    }
    let weights = match u.get("weights") {
        None => None,
        Some(v) => {
            let w = Obj::new(v, &u.path("weights"), &["prompt", "completion"])?;
            Some(Weights {
                prompt: w.int("prompt", Some(1), 0, MAX_WEIGHT)?,
                completion: w.int("completion", Some(1), 0, MAX_WEIGHT)?,
            })
        }
    };
    Ok(Some(Charge {
        header,
        body,
        weights,
        max: u.int("max", Some(MAX_AMOUNT), 1, MAX_AMOUNT)?,
        cut: u.choice(
            "cut",
            &[("bound", Cut::Bound), ("reserved", Cut::Reserved)],
            Cut::Bound,
        )?,
    }))
}

/// Largest price of one prompt or completion token (`usage.weights`).
pub const MAX_WEIGHT: u64 = 1000;

/// How long a denial is remembered at most by default (`service.remember_denials_ms`): short
/// enough that a bucket reset or a refund is seen within a second, long enough that a flood of
/// denied requests costs about one callout per key and second.
pub const DEFAULT_REMEMBER_DENIALS_MS: u64 = 1000;
/// The longest `service.remember_denials_ms`.
pub const MAX_REMEMBER_DENIALS_MS: u64 = 60_000;

/// The RLS descriptor a rule gets without `descriptor`: `("rule", <name>)`, then per key part the
/// entry Envoy's own rate limit actions would use (`remote_address`, the header's name, `path`,
/// `method`, `authority`, `generic_key` for a literal).
fn default_descriptor(name: &str, key: &[KeyPart]) -> Vec<(String, KeyPart)> {
    let mut d = vec![("rule".to_string(), KeyPart::Literal(name.to_string()))];
    for p in key {
        let k = match p {
            KeyPart::Literal(_) => "generic_key".to_string(),
            KeyPart::Header(h) => h.clone(),
            KeyPart::ClientIp => "remote_address".to_string(),
            KeyPart::Path => "path".to_string(),
            KeyPart::Method => "method".to_string(),
            KeyPart::Authority => "authority".to_string(),
        };
        d.push((k, p.clone()));
    }
    d
}

/// The limit fields of an override or a tier: `unlimited: true`, or `capacity` (with `rate`
/// defaulting to it and `period_ms` to the rule's).
fn read_limit(o: &Obj<'_>, rule_period_ms: u64) -> Result<Limit, ConfigError> {
    if o.boolean("unlimited")? {
        for f in ["capacity", "rate", "period_ms"] {
            if o.get(f).is_some() {
                return err(o.path(f), "unlimited takes no limits");
            }
        }
        return Ok(Limit::Unlimited);
    }
    let capacity = o.int("capacity", None, 1, MAX_AMOUNT)?;
    Ok(Limit::Tokens {
        capacity,
        rate: o.int("rate", Some(capacity), 1, MAX_AMOUNT)?,
        period_ms: o.int("period_ms", Some(rule_period_ms), 1, MAX_PERIOD_MS)?,
    })
}

fn read_override(
    at: &str,
    v: &Value,
    raw_key: &[Value],
    key: &[KeyPart],
    rule_period_ms: u64,
) -> Result<Override, ConfigError> {
    let o = Obj::new(
        v,
        at,
        &[
            "key_part",
            "value",
            "prefix",
            "cidr",
            "unlimited",
            "capacity",
            "rate",
            "period_ms",
        ],
    )?;
    // Which key part: named as in `key`, or the rule's only part that is not a literal.
    let variable: Vec<usize> = key
        .iter()
        .enumerate()
        .filter(|(_, p)| !matches!(p, KeyPart::Literal(_)))
        .map(|(i, _)| i)
        .collect();
    let part = match o.string("key_part")? {
        Some(name) => match raw_key
            .iter()
            .position(|p| p.as_str() == Some(name.as_str()))
        {
            Some(i) => i,
            None => return err(o.path("key_part"), "must be one of the rule's `key` parts"),
        },
        None => match variable.as_slice() {
            [i] => *i,
            _ => {
                return err(
                    o.path("key_part"),
                    "missing: the rule's key has more or fewer than one non-literal part",
                )
            }
        },
    };
    let when = match (o.string("value")?, o.string("prefix")?, o.string("cidr")?) {
        (Some(v), None, None) => ValueMatch::Equals(v),
        (None, Some(p), None) => ValueMatch::Prefix(p),
        (None, None, Some(c)) => {
            if key.get(part) != Some(&KeyPart::ClientIp) {
                return err(o.path("cidr"), "only for a client_ip key part");
            }
            match Cidr::parse(&c) {
                Some(c) => ValueMatch::Cidr(c),
                None => {
                    return err(
                        o.path("cidr"),
                        "must be an address with a prefix length, e.g. 10.0.0.0/8",
                    )
                }
            }
        }
        _ => return err(at, "needs exactly one of `value`, `prefix` or `cidr`"),
    };
    Ok(Override {
        part,
        when,
        limit: read_limit(&o, rule_period_ms)?,
    })
}

fn read_tiers(at: &str, v: &Value, rule_period_ms: u64) -> Result<Tiers, ConfigError> {
    let t = Obj::new(v, at, &["header", "limits"])?;
    let header = header_name(&t.path("header"), &t.string("header")?.unwrap_or_default())?;
    let Value::Object(map) = t.required("limits")? else {
        return err(t.path("limits"), "must be an object of tier name → limit");
    };
    if map.is_empty() || map.len() > MAX_OVERRIDES {
        return err(
            t.path("limits"),
            format!("must hold 1..={MAX_OVERRIDES} tiers"),
        );
    }
    let mut limits = Vec::with_capacity(map.len());
    for (name, lv) in map {
        let lat = format!("{}.{name}", t.path("limits"));
        if name.is_empty() || name.len() > MAX_RULE_BYTES {
            return err(lat, format!("tier names are 1..={MAX_RULE_BYTES} bytes"));
        }
        let o = Obj::new(lv, &lat, &["unlimited", "capacity", "rate", "period_ms"])?;
        limits.push((name.clone(), read_limit(&o, rule_period_ms)?));
    }
    Ok(Tiers { header, limits })
}

fn read_match(at: &str, v: &Value, outer: bool) -> Result<Match, ConfigError> {
    let known: &[&str] = if outer {
        &[
            "path_exact",
            "path_prefix",
            "methods",
            "headers",
            "client_ip",
            "not",
        ]
    } else {
        &[
            "path_exact",
            "path_prefix",
            "methods",
            "headers",
            "client_ip",
        ]
    };
    let m = Obj::new(v, at, known)?;
    let path = match (m.string("path_exact")?, m.string("path_prefix")?) {
        (Some(_), Some(_)) => {
            return err(
                m.path("path_prefix"),
                "path_exact and path_prefix exclude each other",
            )
        }
        (Some(p), None) => {
            if !p.starts_with('/') {
                return err(m.path("path_exact"), "must start with '/'");
            }
            Some(PathMatch::Exact(p))
        }
        (None, Some(p)) => {
            if !p.starts_with('/') {
                return err(m.path("path_prefix"), "must start with '/'");
            }
            Some(PathMatch::Prefix(p))
        }
        (None, None) => None,
    };
    let mut methods = Vec::new();
    if let Some(ms) = m.array("methods")? {
        if ms.is_empty() {
            return err(
                m.path("methods"),
                "must not be empty (omit it to match any method)",
            );
        }
        for (k, method) in ms.iter().enumerate() {
            let method = method.as_str().unwrap_or_default();
            if method.is_empty() || method.len() > 32 || !method.bytes().all(is_token_char) {
                return err(
                    format!("{}[{k}]", m.path("methods")),
                    "must be an HTTP method",
                );
            }
            methods.push(method.to_ascii_uppercase());
        }
    }
    let mut headers = Vec::new();
    for (k, h) in m
        .array("headers")?
        .map(Vec::as_slice)
        .unwrap_or(&[])
        .iter()
        .enumerate()
    {
        let hat = format!("{}[{k}]", m.path("headers"));
        let o = Obj::new(h, &hat, &["name", "present", "equals"])?;
        let name = header_name(&o.path("name"), &o.string("name")?.unwrap_or_default())?;
        let present = match o.get("present") {
            None => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(_) => return err(o.path("present"), "must be true or false"),
        };
        headers.push(match (present, o.string("equals")?) {
            (Some(p), None) => HeaderMatch::Present(name, p),
            (None, Some(v)) => HeaderMatch::Equals(name, v),
            _ => return err(hat, "needs exactly one of `present` or `equals`"),
        });
    }
    let mut client_ip = Vec::new();
    if let Some(nets) = m.array("client_ip")? {
        if nets.is_empty() || nets.len() > MAX_OVERRIDES {
            return err(
                m.path("client_ip"),
                format!("must hold 1..={MAX_OVERRIDES} networks"),
            );
        }
        for (k, n) in nets.iter().enumerate() {
            match n.as_str().and_then(Cidr::parse) {
                Some(c) => client_ip.push(c),
                None => {
                    return err(
                        format!("{}[{k}]", m.path("client_ip")),
                        "must be an address with a prefix length, e.g. 10.0.0.0/8",
                    )
                }
            }
        }
    }
    let not = match m.get("not") {
        None => None,
        Some(n) => {
            let inner = read_match(&m.path("not"), n, false)?;
            if inner == Match::default() {
                return err(m.path("not"), "must hold at least one condition");
            }
            Some(Box::new(inner))
        }
    };
    Ok(Match {
        path,
        methods,
        headers,
        client_ip,
        not,
    })
}

fn parse_key_part(at: &str, p: &str) -> Result<KeyPart, ConfigError> {
    if let Some(lit) = p.strip_prefix("literal:") {
        if lit.len() > MAX_PART_BYTES {
            return err(at, "literal too long (at most 256 bytes)");
        }
        return Ok(KeyPart::Literal(lit.to_string()));
    }
    if let Some(h) = p.strip_prefix("header:") {
        return Ok(KeyPart::Header(header_name(at, h)?));
    }
    match p {
        "client_ip" => Ok(KeyPart::ClientIp),
        "path" => Ok(KeyPart::Path),
        "method" => Ok(KeyPart::Method),
        "authority" => Ok(KeyPart::Authority),
        _ => err(
            at,
            format!(
                "unknown key part {p:?} (expected literal:<text>, header:<name>, client_ip, path, method or authority)"
            ),
        ),
    }
}

const RESPONSE_FIELDS: &[&str] = &["status", "body", "content_type", "headers", "on_allowed"];

/// The denial response: each field given in `r`, else `base`'s (a rule's `response` over the
/// global one), else the default.
fn read_response(r: &Obj<'_>, base: Option<&Response>) -> Result<Response, ConfigError> {
    let status = r.int(
        "status",
        Some(base.map_or(429, |b| u64::from(b.status))),
        400,
        599,
    )? as u32;
    let body = match (r.string("body")?, base) {
        (Some(b), _) => b,
        (None, Some(b)) => b.body.clone(),
        (None, None) => "rate limited\n".to_string(),
    };
    if body.len() > 65_536 {
        return err(r.path("body"), "must be at most 65536 bytes");
    }
    let content_type = match (r.string("content_type")?, base) {
        (Some(c), _) => c,
        (None, Some(b)) => b.content_type.clone(),
        (None, None) => "text/plain".to_string(),
    };
    if content_type.is_empty() || !header_safe(&content_type) {
        return err(
            r.path("content_type"),
            "must be a non-empty printable header value",
        );
    }
    let mut headers = Vec::new();
    match r.array("headers")? {
        None => match base {
            Some(b) => headers.clone_from(&b.headers),
            None => headers.push(HeaderStyle::Draft),
        },
        Some(list) => {
            for (i, v) in list.iter().enumerate() {
                let style = choice_value(
                    &format!("{}[{i}]", r.path("headers")),
                    v,
                    &[
                        ("draft", HeaderStyle::Draft),
                        ("x-ratelimit", HeaderStyle::XRateLimit),
                    ],
                )?;
                if !headers.contains(&style) {
                    headers.push(style);
                }
            }
        }
    }
    let on_allowed = match (r.get("on_allowed"), base) {
        (None, Some(b)) => b.on_allowed,
        _ => r.boolean("on_allowed")?,
    };
    Ok(Response {
        status,
        body,
        content_type,
        headers,
        on_allowed,
    })
}
