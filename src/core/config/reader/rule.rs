//! A rule: its kind, name, `match`, key, and the fields of its kind (a rate rule's limit, cost,
//! lease, overrides, tiers, descriptor and charge; a concurrency rule's slots), each object in it
//! read by its table (`config::fields`), the rule itself by the rule table (`config::rules`).

use super::super::fields;
use super::super::model::*;
use super::super::rules;
use super::matcher;
use super::obj::{header_name, int_value, Obj, Refusals};
use crate::core::rules::model::MAX_MODEL_BYTES;
use contract::calendar::{self, Calendar, Unit, Zone};
use serde_json::Value;

/// Whether rule `at` is a concurrency rule (its `kind`, read before the rest).
pub(super) fn concurrency(at: &str, v: &Value, refusals: &Refusals) -> Option<bool> {
    match v.get("kind").filter(|v| !v.is_null()) {
        None => Some(false),
        Some(v) if v.as_str() == Some("rate") => Some(false),
        Some(v) if v.as_str() == Some("concurrency") => Some(true),
        Some(_) => refusals.refuse(
            format!("{at}.kind"),
            "must be one of \"rate\", \"concurrency\"",
        ),
    }
}

/// Rule `at` of the kind [`concurrency`] read: its fields, each checked against the rule table
/// for the kind it belongs to, each read whatever the others' refusals (`None`: one is refused).
pub(super) fn read_rule(
    at: &str,
    v: &Value,
    concurrency: bool,
    global_shadow: bool,
    global_response: &Response,
    refusals: &Refusals,
) -> Option<Rule> {
    // Not an object: none of its fields can be read.
    let r = Obj::named(v, at, &rules::names(), refusals)?;
    let mut other_kind = false;
    for f in rules::of_the_other_kind(concurrency) {
        if r.get(f).is_some() {
            other_kind = true;
            let why = if concurrency {
                "not for a concurrency rule"
            } else {
                "only for a rule of kind \"concurrency\""
            };
            r.refuse::<()>(f, why);
        }
    }
    let name = match r.required("name") {
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => Some(String::new()),
        None => None,
    };
    let name = match name {
        Some(n)
            if n.is_empty()
                || n.len() > MAX_RULE_BYTES
                || !n
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.:/".contains(&b)) =>
        {
            r.refuse(
                "name",
                format!("must be 1..={MAX_RULE_BYTES} characters from A-Z a-z 0-9 - _ . : /"),
            )
        }
        n => n,
    };
    let matcher = match r.get("match") {
        None => Some(Match::default()),
        Some(m) => matcher::read_match(&r.path("match"), m, true, refusals),
    };
    let raw_key = r.array("key").map(|k| k.map(Vec::as_slice).unwrap_or(&[]));
    let key = match raw_key {
        None => None,
        Some(raw) if raw.len() > MAX_KEY_PARTS => {
            r.refuse("key", format!("must hold at most {MAX_KEY_PARTS} parts"))
        }
        Some(raw) => {
            let mut key = Vec::with_capacity(raw.len());
            for (j, p) in raw.iter().enumerate() {
                let at = format!("{}[{j}]", r.path("key"));
                let part = match p.as_str() {
                    Some(p) => matcher::parse_key_part(&at, p, refusals),
                    None => refusals.refuse(at, "must be a string"),
                };
                key.extend(part);
            }
            (key.len() == raw.len()).then_some(key)
        }
    };
    let on_missing = match r.pick("on_missing", &["skip", "shared"], Some(0)) {
        Some(0) => Some(OnMissing::Skip),
        Some(_) => Some(OnMissing::Shared),
        None => None,
    };
    // A concurrency rule (crate::core::inflight) has its own limit and no rate fields.
    let slots = concurrency.then(|| read_slots(&r));
    // The overrides name the key's parts: skipped with the key refused.
    let rate = (!concurrency).then(|| read_rate(&r, raw_key.zip(key.as_deref())));
    let shadow = r.boolean_or("shadow", global_shadow);
    let response = match r.get("response") {
        None => Some(global_response.clone()),
        Some(v) => Obj::new(Some(v), &r.path("response"), fields::RESPONSE, refusals)
            .and_then(|o| super::read_response(&o, Some(global_response))),
    };
    let kind = match (slots, rate) {
        (Some(slots), _) => {
            // `charge` and `usage` are checked as for any rule; a slot charges nothing.
            let charge = read_charge(&r);
            slots.zip(charge).map(|(c, _)| RuleKind::Concurrency(c))
        }
        (None, rate) => {
            // The default descriptor is the rule's name and key: skipped with either refused.
            let rest = finish_rate(&r, name.as_deref().zip(key.as_deref()));
            rate.flatten().zip(rest).map(|(l, (descriptor, charge))| {
                RuleKind::Rate(RateLimit {
                    descriptor,
                    charge,
                    ..l
                })
            })
        }
    };
    if other_kind {
        return None;
    }
    Some(Rule {
        name: name?,
        matcher: matcher?,
        key: key?,
        on_missing: on_missing?,
        shadow: shadow?,
        response: response?,
        kind: kind?,
    })
}

/// A concurrency rule's `max_in_flight` and `deadline_ms`.
fn read_slots(r: &Obj<'_>) -> Option<Concurrency> {
    let (lo, hi) = DEADLINE_MS;
    let max_in_flight = r.int_within("max_in_flight", None, 1, MAX_IN_FLIGHT);
    let deadline_ms = r.int_within("deadline_ms", Some(DEFAULT_DEADLINE_MS), lo, hi);
    Some(Concurrency {
        max_in_flight: max_in_flight?,
        deadline_ms: deadline_ms?,
    })
}

/// A rate rule's `capacity`, `rate`, `period_ms`, `cost`, `algorithm`, `lease`, `shape`,
/// `overrides` and `tiers` (`key`: the rule's key as written and as read, `None` when it is
/// refused), read before the rule's `shadow` and `response` (its `descriptor` and `charge` after
/// them, by [`finish_rate`]).
fn read_rate(r: &Obj<'_>, key: Option<(&[Value], &[KeyPart])>) -> Option<RateLimit> {
    let refusals = r.refusals();
    let capacity = r.int_within("capacity", None, 1, MAX_AMOUNT);
    // What is bounded by the capacity, or defaults to it, is checked against the largest amount
    // when the capacity is refused: refused then only if no capacity could hold it.
    let cap = capacity.unwrap_or(MAX_AMOUNT);
    let rate = r.int_within("rate", Some(cap), 1, MAX_AMOUNT);
    // A calendar window's period is its calendar's: `period_ms` is refused, and set below.
    let calendar_window =
        r.get("algorithm").and_then(Value::as_str) == Some(Algorithm::CalendarWindow.name());
    let period_ms = match (calendar_window, r.get("period_ms")) {
        (true, Some(_)) => r.refuse(
            "period_ms",
            "a calendar window's period is its `calendar` (day, week, month or year)",
        ),
        (true, None) => Some(MAX_PERIOD_MS),
        (false, _) => r.int_within("period_ms", None, 1, MAX_PERIOD_MS),
    };
    let cost = match r.get("cost") {
        None => Some(Cost::Fixed(1)),
        Some(v @ Value::Object(_)) => Obj::new(Some(v), &r.path("cost"), fields::COST, refusals)
            .and_then(|c| read_cost(&c, cap)),
        Some(v) => int_value(&r.path("cost"), v, 1, MAX_AMOUNT, refusals).map(Cost::Fixed),
    };
    let algorithms: Vec<&str> = Algorithm::ALL.iter().map(|a| a.name()).collect();
    let default = Algorithm::ALL
        .iter()
        .position(|a| *a == Algorithm::default());
    let algorithm = r
        .pick("algorithm", &algorithms, default)
        .map(|i| Algorithm::ALL.get(i).copied().unwrap_or_default());
    let lease = match r.get("lease") {
        None => Some(None),
        Some(v) => Obj::new(Some(v), &r.path("lease"), fields::LEASE, refusals).and_then(|l| {
            let size = match l.get("size") {
                None => Some(None),
                Some(v) => int_value(&l.path("size"), v, 1, cap, refusals).map(Some),
            };
            let max_age_ms = l.int("max_age_ms");
            Some(Some(Lease {
                size: size?,
                max_age_ms: max_age_ms?,
            }))
        }),
    };
    // A shape is for one algorithm: skipped with the algorithm refused.
    let shape = algorithm.and_then(|a| read_shape(r, a));
    let calendar = read_calendar(r, calendar_window);
    let period_ms = match &calendar {
        Some(Some(c)) => Some(c.unit.nominal_ms()),
        _ => period_ms,
    };
    // An override's or a tier's period defaults to the rule's: with it refused, checked against
    // the longest.
    let rule_period_ms = period_ms.unwrap_or(MAX_PERIOD_MS);
    let overrides = match r.array("overrides") {
        None => None,
        Some(raw) => {
            let raw = raw.map(Vec::as_slice).unwrap_or(&[]);
            if raw.len() > MAX_OVERRIDES {
                r.refuse(
                    "overrides",
                    format!("must hold at most {MAX_OVERRIDES} entries"),
                )
            } else {
                let read: Vec<Override> = match key {
                    None => Vec::new(),
                    Some((raw_key, key)) => raw
                        .iter()
                        .enumerate()
                        .filter_map(|(k, o)| {
                            let at = format!("{}[{k}]", r.path("overrides"));
                            read_override(&at, o, raw_key, key, rule_period_ms, refusals)
                        })
                        .collect(),
                };
                (read.len() == raw.len()).then_some(read)
            }
        }
    };
    let tiers = match r.get("tiers") {
        None => Some(None),
        Some(v) => read_tiers(&r.path("tiers"), v, rule_period_ms, refusals).map(Some),
    };
    let from_request = read_from_request(r);
    Some(RateLimit {
        capacity: capacity?,
        rate: rate?,
        period_ms: period_ms?,
        cost: cost?,
        algorithm: algorithm?,
        lease: lease?,
        overrides: overrides?,
        tiers: tiers?,
        descriptor: Vec::new(),
        charge: None,
        shape: shape?,
        from_request: from_request?,
        calendar: calendar?,
    })
}

/// A rate rule's `calendar` and `time_zone`: required with algorithm `calendar_window`
/// (`calendar_window`), refused with any other; the zone is `UTC` when absent. An override or a
/// tier of a calendar window names no period of its own.
fn read_calendar(r: &Obj<'_>, calendar_window: bool) -> Option<Option<Calendar>> {
    if !calendar_window {
        for f in ["calendar", "time_zone"] {
            if r.get(f).is_some() {
                r.refuse::<()>(
                    f,
                    format!(
                        "only with algorithm \"{}\"",
                        Algorithm::CalendarWindow.name()
                    ),
                );
            }
        }
        return (r.get("calendar").is_none() && r.get("time_zone").is_none()).then_some(None);
    }
    let units = Unit::ALL.map(Unit::name);
    let unit = r
        .pick("calendar", &units, None)
        .and_then(|i| Unit::ALL.get(i).copied());
    let zone = match r.get("time_zone") {
        None => Some(calendar::UTC.to_string()),
        Some(Value::String(z)) => match Zone::parse(z) {
            Ok(_) => Some(z.clone()),
            Err(why) => r.refuse("time_zone", why),
        },
        Some(_) => r.refuse("time_zone", "must be a string"),
    };
    let mut own_period = false;
    if let Some(Value::Array(list)) = r.get("overrides") {
        for (k, o) in list.iter().enumerate() {
            if o.get("period_ms").is_some() {
                own_period = true;
                r.refuse::<()>(
                    &format!("overrides[{k}].period_ms"),
                    "a calendar window's period is the rule's `calendar`",
                );
            }
        }
    }
    if let Some(Value::Object(tiers)) = r.get("tiers").and_then(|t| t.get("limits")) {
        for (name, t) in tiers {
            if t.get("period_ms").is_some() {
                own_period = true;
                r.refuse::<()>(
                    &format!("tiers.limits.{name}.period_ms"),
                    "a calendar window's period is the rule's `calendar`",
                );
            }
        }
    }
    let calendar = Calendar {
        unit: unit?,
        zone: zone?,
    };
    (!own_period).then_some(Some(calendar))
}

/// Most field names after the namespace in a `from_request` metadata path.
const MAX_METADATA_FIELDS: usize = 4;

/// A rate rule's `from_request`: at least one of `capacity`, `rate` and `cost` (`Some(None)`: no
/// `from_request`).
fn read_from_request(r: &Obj<'_>) -> Option<Option<FromRequest>> {
    let Some(v) = r.get("from_request") else {
        return Some(None);
    };
    let refusals = r.refusals();
    let f = Obj::new(
        Some(v),
        &r.path("from_request"),
        fields::FROM_REQUEST,
        refusals,
    )?;
    let read = |name: &str| match f.get(name) {
        None => Some(None),
        Some(v) => Obj::new(Some(v), &f.path(name), fields::ATTRIBUTE, refusals)
            .and_then(|a| read_attribute(&a))
            .map(Some),
    };
    let (capacity, rate, cost) = (read("capacity"), read("rate"), read("cost"));
    let (capacity, rate, cost) = (capacity?, rate?, cost?);
    if capacity.is_none() && rate.is_none() && cost.is_none() {
        return r.refuse(
            "from_request",
            "must name at least one of `capacity`, `rate` and `cost`",
        );
    }
    if cost.is_some() && matches!(r.get("cost"), Some(Value::Object(_))) {
        return f.refuse(
            "cost",
            "not with a `cost` object (that cost is read from a header already)",
        );
    }
    if cost.is_some() && r.get("charge").and_then(Value::as_str) == Some("response") {
        return f.refuse(
            "cost",
            "not with \"charge\": \"response\" (the response settles what a request costs)",
        );
    }
    Some(Some(FromRequest {
        rate_follows_capacity: capacity.is_some() && rate.is_none() && r.get("rate").is_none(),
        capacity,
        rate,
        cost,
    }))
}

/// A number read from the request: exactly one of `header` (a lower-case name) and `metadata`
/// (the filter's namespace, then 1..=4 field names into its struct), within `min..=max`.
/// `o`'s `metadata`: the filter's namespace, then 1..=[`MAX_METADATA_FIELDS`] field names, as the
/// host property path of that dynamic metadata (`metadata.filter_metadata.<namespace>.<fields>`).
pub(super) fn metadata_path(o: &Obj<'_>) -> Option<Vec<String>> {
    let Some(Value::Array(parts)) = o.get("metadata") else {
        return o.refuse("metadata", "must be a list of strings");
    };
    if parts.len() < 2 || parts.len() > MAX_METADATA_FIELDS + 1 {
        return o.refuse(
            "metadata",
            format!("must be the filter's namespace then 1..={MAX_METADATA_FIELDS} field names"),
        );
    }
    let mut path = vec!["metadata".to_string(), "filter_metadata".to_string()];
    for (i, p) in parts.iter().enumerate() {
        match p.as_str() {
            Some(s) if !s.is_empty() && s.len() <= 256 => path.push(s.to_string()),
            _ => {
                return o.refusals().refuse(
                    format!("{}[{i}]", o.path("metadata")),
                    "must be a string of 1..=256 bytes",
                )
            }
        }
    }
    Some(path)
}

fn read_attribute(a: &Obj<'_>) -> Option<Attribute> {
    let source = match (a.get("header"), a.get("metadata")) {
        (Some(_), None) => Source::Header(header_name(
            &a.path("header"),
            &a.text("header")?,
            a.refusals(),
        )?),
        (None, Some(_)) => Source::Property(metadata_path(a)?),
        _ => return a.refuse("header", "exactly one of `header` and `metadata`"),
    };
    let max = a.int_within("max", None, 1, MAX_AMOUNT)?;
    let min = a.int_within("min", Some(1), 1, max)?;
    Some(Attribute { source, min, max })
}

/// A rate rule's `shape`: token buckets only (a window's tokens come back all at once, at its
/// end: there is no moment a token will be there to grant a take for). `Some(None)`: none.
fn read_shape(r: &Obj<'_>, algorithm: Algorithm) -> Option<Option<Shape>> {
    let Some(v) = r.get("shape") else {
        return Some(None);
    };
    let s = Obj::new(Some(v), &r.path("shape"), fields::SHAPE, r.refusals());
    if algorithm != Algorithm::TokenBucket {
        return r.refuse(
            "shape",
            format!(
                "only for algorithm \"{}\" (a window's tokens all come back at its end)",
                Algorithm::TokenBucket.name()
            ),
        );
    }
    if r.get("lease").is_some() {
        return r.refuse(
            "shape",
            "not with `lease` (tokens spent from a pool are there or not: nothing to wait for)",
        );
    }
    let s = s?;
    let max_held = s.int_within("max_held", Some(u64::from(DEFAULT_MAX_HELD)), 1, MAX_HELD);
    let max_delay_ms = s.int_within("max_delay_ms", None, 1, MAX_DELAY_MS);
    Some(Some(Shape {
        max_delay_ms: max_delay_ms?,
        max_held: u32::try_from(max_held?).unwrap_or(u32::MAX),
    }))
}

/// A rate rule's `descriptor` and `charge` (`name_key`: the rule's name and key, `None` when
/// either is refused; the default descriptor is made of them).
#[allow(clippy::type_complexity)]
fn finish_rate(
    r: &Obj<'_>,
    name_key: Option<(&str, &[KeyPart])>,
) -> Option<(Vec<(String, KeyPart)>, Option<Charge>)> {
    let refusals = r.refusals();
    let descriptor = match r.array("descriptor") {
        None => None,
        Some(None) => name_key.map(|(name, key)| default_descriptor(name, key)),
        Some(Some(entries)) => {
            if entries.is_empty() || entries.len() > MAX_KEY_PARTS + 1 {
                r.refuse(
                    "descriptor",
                    format!("must hold 1..={} entries", MAX_KEY_PARTS + 1),
                )
            } else {
                let read: Vec<(String, KeyPart)> = entries
                    .iter()
                    .enumerate()
                    .filter_map(|(k, e)| {
                        let eat = format!("{}[{k}]", r.path("descriptor"));
                        read_descriptor_entry(&eat, e, refusals)
                    })
                    .collect();
                (read.len() == entries.len()).then_some(read)
            }
        }
    };
    let charge = read_charge(r);
    if let (Some(Some(_)), Some(_)) = (&charge, r.get("lease")) {
        return r.refuse(
            "lease",
            "not with \"charge\": \"response\" (a lease spends tokens no response settles)",
        );
    }
    Some((descriptor?, charge?))
}

/// An entry of a rule's `descriptor`.
fn read_descriptor_entry(at: &str, e: &Value, refusals: &Refusals) -> Option<(String, KeyPart)> {
    let o = Obj::new(Some(e), at, fields::DESCRIPTOR, refusals)?;
    let key = match o.string("key") {
        Some(k) => {
            let k = k.unwrap_or_default();
            if k.is_empty() || k.len() > 256 {
                o.refuse("key", "must be 1..=256 bytes")
            } else {
                Some(k)
            }
        }
        None => None,
    };
    let value = o
        .string("value")
        .and_then(|v| matcher::parse_key_part(&o.path("value"), &v.unwrap_or_default(), refusals));
    Some((key?, value?))
}

/// A `cost` object: a header's value bounded by `min` and `max` (`reserve: "hint"`, the default),
/// or `max` for every request (`reserve: "max"`: the header, its default and floor mean nothing
/// then, and are refused; `max` is required). A hint's `max` defaults to the rule's capacity.
fn read_cost(c: &Obj, capacity: u64) -> Option<Cost> {
    // What the other fields mean depends on `reserve`: skipped with it refused.
    let by_max = c.choice("reserve", &[false, true])?;
    if by_max {
        let mut meaningless = false;
        for f in ["header", "default", "min"] {
            if c.get(f).is_some() {
                meaningless = true;
                c.refuse::<()>(
                    f,
                    "not with \"reserve\": \"max\" (every request reserves `max`)",
                );
            }
        }
        let max = c.int_within("max", None, 1, MAX_AMOUNT);
        if meaningless {
            return None;
        }
        return Some(Cost::Fixed(max?));
    }
    let name = c
        .text("header")
        .and_then(|h| header_name(&c.path("header"), &h, c.refusals()));
    let max = c.int_or("max", capacity);
    // `min` is bounded by `max`, and `default` by both: skipped with what bounds them refused.
    let min = max.and_then(|max| c.int_within("min", Some(1), 1, max));
    let default = max
        .zip(min)
        .and_then(|(max, min)| c.int_within("default", Some(min), min, max));
    Some(Cost::Header {
        name: name?,
        default: default?,
        min: min?,
        max: max?,
    })
}

/// A rule's `charge` and `usage`: `Some(None)` for `"charge": "request"` (the default).
fn read_charge(r: &Obj) -> Option<Option<Charge>> {
    // What `usage` may hold depends on `charge`: skipped with it refused.
    let by_response = r.pick("charge", &["request", "response"], Some(0))? == 1;
    if !by_response {
        if r.get("usage").is_some() {
            return r.refuse("usage", "only with \"charge\": \"response\"");
        }
        return Some(None);
    }
    let u = Obj::new(
        r.get("usage"),
        &r.path("usage"),
        fields::USAGE,
        r.refusals(),
    )?;
    let header = match u.string("header") {
        None => None,
        Some(None) => Some(None),
        Some(Some(h)) => header_name(&u.path("header"), &h, r.refusals()).map(Some),
    };
    let body = match (u.boolean("body"), &header) {
        (Some(false), Some(None)) => {
            u.refuse("body", "false leaves no usage to read: name a header")
        }
        (b, _) => b,
    };
    let weights = match u.get("weights") {
        None => Some(None),
        Some(v) => {
            Obj::new(Some(v), &u.path("weights"), fields::WEIGHTS, r.refusals()).and_then(|w| {
                let prompt = w.int("prompt");
                let completion = w.int("completion");
                Some(Some(Weights {
                    prompt: prompt?,
                    completion: completion?,
                }))
            })
        }
    };
    let prices = match u.get("prices") {
        None => Some(Vec::new()),
        Some(Value::Object(map)) if map.len() <= MAX_PRICES => {
            let mut read = Vec::with_capacity(map.len());
            for (model, v) in map {
                let at = format!("{}.{model}", u.path("prices"));
                if model.is_empty() || model.len() > MAX_MODEL_BYTES {
                    r.refusals().refuse::<()>(
                        &at,
                        format!("a model's name is 1..={MAX_MODEL_BYTES} bytes"),
                    );
                    continue;
                }
                let w = Obj::new(Some(v), &at, fields::WEIGHTS, r.refusals()).and_then(|w| {
                    let prompt = w.int("prompt");
                    let completion = w.int("completion");
                    Some(Weights {
                        prompt: prompt?,
                        completion: completion?,
                    })
                });
                read.extend(w.map(|w| (model.clone(), w)));
            }
            (read.len() == map.len()).then_some(read)
        }
        Some(_) => u.refuse(
            "prices",
            format!("must be an object of at most {MAX_PRICES} model names → prices"),
        ),
    };
    let max = u.int("max");
    let cut = u.choice("cut", &[Cut::Bound, Cut::Reserved]);
    Some(Some(Charge {
        header: header?,
        body: body?,
        weights: weights?,
        prices: prices?,
        max: max?,
        cut: cut?,
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
            KeyPart::Model => "model".to_string(),
            KeyPart::Authority => "authority".to_string(),
        };
        d.push((k, p.clone()));
    }
    d
}

/// The limit fields of an override or a tier: `unlimited: true`, or `capacity` (with `rate`
/// defaulting to it and `period_ms` to the rule's).
fn read_limit(o: &Obj<'_>, rule_period_ms: u64) -> Option<Limit> {
    // What the other fields may be depends on `unlimited`: skipped with it refused.
    if o.boolean("unlimited")? {
        let mut limited = false;
        for f in ["capacity", "rate", "period_ms"] {
            if o.get(f).is_some() {
                limited = true;
                o.refuse::<()>(f, "unlimited takes no limits");
            }
        }
        return (!limited).then_some(Limit::Unlimited);
    }
    let capacity = o.int_within("capacity", None, 1, MAX_AMOUNT);
    // With the capacity refused, the rate is checked against the largest amount.
    let rate = o.int_or("rate", capacity.unwrap_or(MAX_AMOUNT));
    let period_ms = o.int_or("period_ms", rule_period_ms);
    Some(Limit::Tokens {
        capacity: capacity?,
        rate: rate?,
        period_ms: period_ms?,
    })
}

fn read_override(
    at: &str,
    v: &Value,
    raw_key: &[Value],
    key: &[KeyPart],
    rule_period_ms: u64,
    refusals: &Refusals,
) -> Option<Override> {
    let o = Obj::new(Some(v), at, fields::OVERRIDE, refusals)?;
    // Which key part: named as in `key`, or the rule's only part that is not a literal.
    let variable: Vec<usize> = key
        .iter()
        .enumerate()
        .filter(|(_, p)| !matches!(p, KeyPart::Literal(_)))
        .map(|(i, _)| i)
        .collect();
    let part = match o.string("key_part") {
        None => None,
        Some(Some(name)) => match raw_key
            .iter()
            .position(|p| p.as_str() == Some(name.as_str()))
        {
            Some(i) => Some(i),
            None => o.refuse("key_part", "must be one of the rule's `key` parts"),
        },
        Some(None) => match variable.as_slice() {
            [i] => Some(*i),
            _ => o.refuse(
                "key_part",
                "missing: the rule's key has more or fewer than one non-literal part",
            ),
        },
    };
    let given = (o.string("value"), o.string("prefix"), o.string("cidr"));
    let when = match given {
        (Some(Some(v)), Some(None), Some(None)) => Some(ValueMatch::Equals(v)),
        (Some(None), Some(Some(p)), Some(None)) => Some(ValueMatch::Prefix(p)),
        (Some(None), Some(None), Some(Some(c))) => {
            // Which part a network is for depends on `key_part`: skipped with it refused.
            match part.map(|part| key.get(part) == Some(&KeyPart::ClientIp)) {
                None => None,
                Some(false) => o.refuse("cidr", "only for a client_ip key part"),
                Some(true) => match Cidr::parse(&c) {
                    Some(c) => Some(ValueMatch::Cidr(c)),
                    None => o.refuse(
                        "cidr",
                        "must be an address with a prefix length, e.g. 10.0.0.0/8",
                    ),
                },
            }
        }
        (Some(_), Some(_), Some(_)) => {
            refusals.refuse(at, "needs exactly one of `value`, `prefix` or `cidr`")
        }
        _ => None,
    };
    let limit = read_limit(&o, rule_period_ms);
    Some(Override {
        part: part?,
        when: when?,
        limit: limit?,
    })
}

fn read_tiers(at: &str, v: &Value, rule_period_ms: u64, refusals: &Refusals) -> Option<Tiers> {
    let t = Obj::new(Some(v), at, fields::TIERS, refusals)?;
    let header = t
        .text("header")
        .and_then(|h| header_name(&t.path("header"), &h, refusals));
    let limits = match t.required("limits") {
        None => None,
        Some(Value::Object(map)) if map.is_empty() || map.len() > MAX_OVERRIDES => {
            t.refuse("limits", format!("must hold 1..={MAX_OVERRIDES} tiers"))
        }
        Some(Value::Object(map)) => {
            let mut limits = Vec::with_capacity(map.len());
            for (name, lv) in map {
                let lat = format!("{}.{name}", t.path("limits"));
                if name.is_empty() || name.len() > MAX_RULE_BYTES {
                    refusals
                        .refuse::<()>(lat, format!("tier names are 1..={MAX_RULE_BYTES} bytes"));
                    continue;
                }
                let limit = Obj::new(Some(lv), &lat, fields::LIMIT, refusals)
                    .and_then(|o| read_limit(&o, rule_period_ms));
                limits.extend(limit.map(|l| (name.clone(), l)));
            }
            (limits.len() == map.len()).then_some(limits)
        }
        Some(_) => t.refuse("limits", "must be an object of tier name → limit"),
    };
    Some(Tiers {
        header: header?,
        limits: limits?,
    })
}
