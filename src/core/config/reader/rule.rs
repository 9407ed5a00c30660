//! A rule: its kind, name, `match`, key, and the fields of its kind (a rate rule's limit, cost,
//! lease, overrides, tiers, descriptor and charge; a concurrency rule's slots), each object in it
//! read by its table (`config::fields`), the rule itself by the rule table (`config::rules`).

use super::super::fields;
use super::super::model::*;
use super::super::rules;
use super::matcher;
use super::obj::{err, header_name, int_value, Obj};
use serde_json::Value;

/// Whether rule `at` is a concurrency rule (its `kind`, read before the rest).
pub(super) fn concurrency(at: &str, v: &Value) -> Result<bool, ConfigError> {
    match v.get("kind").filter(|v| !v.is_null()) {
        None => Ok(false),
        Some(v) if v.as_str() == Some("rate") => Ok(false),
        Some(v) if v.as_str() == Some("concurrency") => Ok(true),
        Some(_) => err(
            format!("{at}.kind"),
            "must be one of \"rate\", \"concurrency\"",
        ),
    }
}

/// Rule `at` of the kind [`concurrency`] read: its fields, each checked against the rule table
/// for the kind it belongs to.
pub(super) fn read_rule(
    at: &str,
    v: &Value,
    concurrency: bool,
    global_shadow: bool,
    global_response: &Response,
) -> Result<Rule, ConfigError> {
    let r = Obj::named(v, at, &rules::names())?;
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
        Some(m) => matcher::read_match(&r.path("match"), m, true)?,
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
            Some(p) => key.push(matcher::parse_key_part(&at, p)?),
            None => return err(at, "must be a string"),
        }
    }
    let on_missing = match r.pick("on_missing", &["skip", "shared"], Some(0))? {
        0 => OnMissing::Skip,
        _ => OnMissing::Shared,
    };
    let mut kind = if concurrency {
        // A concurrency rule (crate::core::inflight) has its own limit and no rate fields.
        let (lo, hi) = DEADLINE_MS;
        RuleKind::Concurrency(Concurrency {
            max_in_flight: r.int_within("max_in_flight", None, 1, MAX_IN_FLIGHT)?,
            deadline_ms: r.int_within("deadline_ms", Some(DEFAULT_DEADLINE_MS), lo, hi)?,
        })
    } else {
        for f in rules::of_the_other_kind(false) {
            if r.get(f).is_some() {
                return err(r.path(f), "only for a rule of kind \"concurrency\"");
            }
        }
        RuleKind::Rate(read_rate(&r, raw_key, &key)?)
    };
    let shadow = r.boolean_or("shadow", global_shadow)?;
    let response = match r.get("response") {
        None => global_response.clone(),
        Some(v) => super::read_response(
            &Obj::new(Some(v), &r.path("response"), fields::RESPONSE)?,
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
    let capacity = r.int_within("capacity", None, 1, MAX_AMOUNT)?;
    let rate = r.int_within("rate", Some(capacity), 1, MAX_AMOUNT)?;
    let period_ms = r.int_within("period_ms", None, 1, MAX_PERIOD_MS)?;
    let cost = match r.get("cost") {
        None => Cost::Fixed(1),
        Some(v @ Value::Object(_)) => {
            read_cost(&Obj::new(Some(v), &r.path("cost"), fields::COST)?, capacity)?
        }
        Some(v) => Cost::Fixed(int_value(&r.path("cost"), v, 1, MAX_AMOUNT)?),
    };
    let algorithms: Vec<&str> = Algorithm::ALL.iter().map(|a| a.name()).collect();
    let default = Algorithm::ALL
        .iter()
        .position(|a| *a == Algorithm::default());
    let algorithm = r.pick("algorithm", &algorithms, default)?;
    let algorithm = Algorithm::ALL.get(algorithm).copied().unwrap_or_default();
    let lease = match r.get("lease") {
        None => None,
        Some(v) => {
            let l = Obj::new(Some(v), &r.path("lease"), fields::LEASE)?;
            Some(Lease {
                size: match l.get("size") {
                    None => None,
                    Some(v) => Some(int_value(&l.path("size"), v, 1, capacity)?),
                },
                max_age_ms: l.int("max_age_ms")?,
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
    let from_request = read_from_request(r)?;
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
        shape: read_shape(r, algorithm)?,
        from_request,
    })
}

/// Most field names after the namespace in a `from_request` metadata path.
const MAX_METADATA_FIELDS: usize = 4;

/// A rate rule's `from_request`: at least one of `capacity`, `rate` and `cost`.
fn read_from_request(r: &Obj<'_>) -> Result<Option<FromRequest>, ConfigError> {
    let Some(v) = r.get("from_request") else {
        return Ok(None);
    };
    let f = Obj::new(Some(v), &r.path("from_request"), fields::FROM_REQUEST)?;
    let read = |name: &str| match f.get(name) {
        None => Ok(None),
        Some(v) => read_attribute(&Obj::new(Some(v), &f.path(name), fields::ATTRIBUTE)?).map(Some),
    };
    let capacity = read("capacity")?;
    let rate = read("rate")?;
    let cost = read("cost")?;
    if capacity.is_none() && rate.is_none() && cost.is_none() {
        return err(
            r.path("from_request"),
            "must name at least one of `capacity`, `rate` and `cost`",
        );
    }
    if cost.is_some() && matches!(r.get("cost"), Some(Value::Object(_))) {
        return err(
            f.path("cost"),
            "not with a `cost` object (that cost is read from a header already)",
        );
    }
    Ok(Some(FromRequest {
        rate_follows_capacity: capacity.is_some() && rate.is_none() && r.get("rate").is_none(),
        capacity,
        rate,
        cost,
    }))
}

/// A number read from the request: exactly one of `header` (a lower-case name) and `metadata`
/// (the filter's namespace, then 1..=4 field names into its struct), within `min..=max`.
fn read_attribute(a: &Obj<'_>) -> Result<Attribute, ConfigError> {
    let source = match (a.get("header"), a.get("metadata")) {
        (Some(_), None) => Source::Header(header_name(&a.path("header"), &a.text("header")?)?),
        (None, Some(Value::Array(parts))) => {
            if parts.len() < 2 || parts.len() > MAX_METADATA_FIELDS + 1 {
                return err(
                    a.path("metadata"),
                    format!(
                        "must be the filter's namespace then 1..={MAX_METADATA_FIELDS} field names"
                    ),
                );
            }
            let mut path = vec!["metadata".to_string(), "filter_metadata".to_string()];
            for (i, p) in parts.iter().enumerate() {
                match p.as_str() {
                    Some(s) if !s.is_empty() && s.len() <= 256 => path.push(s.to_string()),
                    _ => {
                        return err(
                            format!("{}[{i}]", a.path("metadata")),
                            "must be a string of 1..=256 bytes",
                        )
                    }
                }
            }
            Source::Property(path)
        }
        (None, Some(_)) => return err(a.path("metadata"), "must be a list of strings"),
        _ => return err(a.path("header"), "exactly one of `header` and `metadata`"),
    };
    let max = a.int_within("max", None, 1, MAX_AMOUNT)?;
    let min = a.int_within("min", Some(1), 1, max)?;
    Ok(Attribute { source, min, max })
}

/// A rate rule's `shape`: token buckets only (a window's tokens come back all at once, at its
/// end: there is no moment a token will be there to grant a take for).
fn read_shape(r: &Obj<'_>, algorithm: Algorithm) -> Result<Option<Shape>, ConfigError> {
    let Some(v) = r.get("shape") else {
        return Ok(None);
    };
    let s = Obj::new(Some(v), &r.path("shape"), fields::SHAPE)?;
    if algorithm != Algorithm::TokenBucket {
        return err(
            r.path("shape"),
            format!(
                "only for algorithm \"{}\" (a window's tokens all come back at its end)",
                Algorithm::TokenBucket.name()
            ),
        );
    }
    if r.get("lease").is_some() {
        return err(
            r.path("shape"),
            "not with `lease` (tokens spent from a pool are there or not: nothing to wait for)",
        );
    }
    let max_held = s.int_within("max_held", Some(u64::from(DEFAULT_MAX_HELD)), 1, MAX_HELD)?;
    Ok(Some(Shape {
        max_delay_ms: s.int_within("max_delay_ms", None, 1, MAX_DELAY_MS)?,
        max_held: u32::try_from(max_held).unwrap_or(u32::MAX),
    }))
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
                let o = Obj::new(Some(e), &eat, fields::DESCRIPTOR)?;
                let ek = o.string("key")?.unwrap_or_default();
                if ek.is_empty() || ek.len() > 256 {
                    return err(o.path("key"), "must be 1..=256 bytes");
                }
                let value = o.string("value")?.unwrap_or_default();
                d.push((ek, matcher::parse_key_part(&o.path("value"), &value)?));
            }
            d
        }
    };
    l.charge = read_charge(r)?;
    if l.charge.is_some() && l.from_request.as_ref().is_some_and(|f| f.cost.is_some()) {
        return err(
            r.path("from_request.cost"),
            "not with \"charge\": \"response\" (the response settles what a request costs)",
        );
    }
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
    let by_max = c.choice("reserve", &[false, true])?;
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
        return Ok(Cost::Fixed(c.int_within("max", None, 1, MAX_AMOUNT)?));
    }
    let name = header_name(&c.path("header"), &c.text("header")?)?;
    let max = c.int_or("max", capacity)?;
    let min = c.int_within("min", Some(1), 1, max)?;
    let default = c.int_within("default", Some(min), min, max)?;
    Ok(Cost::Header {
        name,
        default,
        min,
        max,
    })
}

/// A rule's `charge` and `usage`: `None` for `"charge": "request"` (the default).
fn read_charge(r: &Obj) -> Result<Option<Charge>, ConfigError> {
    let by_response = r.pick("charge", &["request", "response"], Some(0))? == 1;
    if !by_response {
        if r.get("usage").is_some() {
            return err(r.path("usage"), "only with \"charge\": \"response\"");
        }
        return Ok(None);
    }
    let u = Obj::new(r.get("usage"), &r.path("usage"), fields::USAGE)?;
    let header = match u.string("header")? {
        None => None,
        Some(h) => Some(header_name(&u.path("header"), &h)?),
    };
    let body = u.boolean("body")?;
    if header.is_none() && !body {
        return err(
            u.path("body"),
            "false leaves no usage to read: name a header",
        );
    }
    let weights = match u.get("weights") {
        None => None,
        Some(v) => {
            let w = Obj::new(Some(v), &u.path("weights"), fields::WEIGHTS)?;
            Some(Weights {
                prompt: w.int("prompt")?,
                completion: w.int("completion")?,
            })
        }
    };
    Ok(Some(Charge {
        header,
        body,
        weights,
        max: u.int("max")?,
        cut: u.choice("cut", &[Cut::Bound, Cut::Reserved])?,
    }))
}

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
    let capacity = o.int_within("capacity", None, 1, MAX_AMOUNT)?;
    Ok(Limit::Tokens {
        capacity,
        rate: o.int_or("rate", capacity)?,
        period_ms: o.int_or("period_ms", rule_period_ms)?,
    })
}

fn read_override(
    at: &str,
    v: &Value,
    raw_key: &[Value],
    key: &[KeyPart],
    rule_period_ms: u64,
) -> Result<Override, ConfigError> {
    let o = Obj::new(Some(v), at, fields::OVERRIDE)?;
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
    let t = Obj::new(Some(v), at, fields::TIERS)?;
    let header = header_name(&t.path("header"), &t.text("header")?)?;
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
        let o = Obj::new(Some(lv), &lat, fields::LIMIT)?;
        limits.push((name.clone(), read_limit(&o, rule_period_ms)?));
    }
    Ok(Tiers { header, limits })
}
