//! Reading the JSON plugin configuration into a [`Config`]: the top level and the sections
//! (`service`, `fallback`, `breaker`, `response`) here, each by its table (`config::fields`);
//! a rule in `rule`, its `match` and key parts in `matcher`; `obj` reads one object by its table.
//! What `service` and each rule ask of the transport is checked against the transport table
//! (`config::transports`) once each is read.

mod matcher;
mod obj;
mod rule;

use super::fields::{self, DEFAULT_REMEMBER_DENIALS_MS};
use super::model::*;
use super::transports::{self, Feature, TRANSPORTS};
use obj::{header_safe, pick_value, Obj, Refusals};
use serde_json::Value;

// The document is parsed into a `serde_json::Value` and walked by hand: each object is checked
// against its table of known fields, and each value is read with its full path at hand, so every
// error (unknown field, wrong type, out of range) names the field. A derive with
// `deny_unknown_fields` plus a path-tracking wrapper did the same for about 60 KiB more module,
// and would stop at the first error.
//
// Every refusal is kept (`Refusals`) and the walk goes on: a reader answers `None` for a value it
// refused, and what depends on that value is skipped rather than refused again.

impl Config {
    /// Parses and validates the plugin configuration (JSON bytes): the configuration, or its first
    /// refusal (in the order of [`Config::parse_all`], which has them all).
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        Config::parse_all(bytes).map_err(|all| {
            all.into_iter().next().unwrap_or_else(|| ConfigError {
                field: "config".into(),
                message: "refused".into(),
            })
        })
    }

    /// Parses and validates the plugin configuration (JSON bytes): the configuration, or every
    /// refusal (at least one), in document order.
    ///
    /// Document order is the document's structure: serde_json's objects keep no order (keeping
    /// the text's would add to the module), so the top-level fields come in their table's order
    /// (`fields::ROOT`, unknown ones first), a list's items by index, and in each object its
    /// unknown fields first, then its fields as the reader reads them (a rule's in
    /// `rules::RULE_FIELDS`' order).
    pub fn parse_all(bytes: &[u8]) -> Result<Config, Vec<ConfigError>> {
        let refusals = Refusals::default();
        let config = read(bytes, &refusals);
        let all = refusals.into_inner();
        match config {
            Some(config) if all.is_empty() => Ok(config),
            _ => {
                // The reader reads the global `shadow` and `response` before the rules (each
                // rule's defaults): each refusal goes back under its section, in the order found
                // (a few refusals: not worth a sort's code in the module).
                let mut ordered = Vec::with_capacity(all.len());
                for s in 0..=fields::ROOT.len() {
                    ordered.extend(all.iter().filter(|e| section(&e.field) == s).cloned());
                }
                Err(ordered)
            }
        }
    }
}

/// The place of the top-level field `field` is under in `fields::ROOT`, counted from 1 (0: not
/// one of them, an unknown field or the document as a whole).
fn section(field: &str) -> usize {
    let name = field.split(['.', '[']).next().unwrap_or(field);
    fields::ROOT
        .iter()
        .position(|f| f.name == name)
        .map_or(0, |i| i + 1)
}

/// The configuration, every refusal kept in `refusals` (`None`: at least one is).
fn read(bytes: &[u8], refusals: &Refusals) -> Option<Config> {
    let doc: Value = match serde_json::from_slice(bytes) {
        Ok(v) => v,
        Err(e) => return refusals.refuse("config", format!("not valid JSON: {e}")),
    };
    // Not an object: there is nothing more to read.
    let root = Obj::new(Some(&doc), "", fields::ROOT, refusals)?;
    let (transport, service) = read_service(&root);
    let trusted_hops = root.int("trusted_hops").map(|n| n as u32);
    let shadow = root.boolean("shadow");
    let response = Obj::new(root.get("response"), "response", fields::RESPONSE, refusals)
        .and_then(|r| read_response(&r, None));
    // The rules are read whatever `service`, `shadow` and `response` say: a refused `shadow` or
    // `response` leaves each rule its own read over the defaults, whose refusals do not depend on
    // them.
    let defaults = match &response {
        Some(r) => r.clone(),
        None => read_response(
            &Obj::new(None, "response", fields::RESPONSE, refusals)?,
            None,
        )?,
    };
    let rules = read_rules(&root, transport, shadow.unwrap_or(false), &defaults);
    let failure_mode = root.choice(
        "failure_mode",
        &[FailureMode::Fallback, FailureMode::Allow, FailureMode::Deny],
    );
    let fallback = Obj::new(root.get("fallback"), "fallback", fields::FALLBACK, refusals)
        .and_then(|fb| read_fallback(&fb, rules.as_deref().unwrap_or(&[])));
    let breaker = Obj::new(root.get("breaker"), "breaker", fields::BREAKER, refusals)
        .and_then(|br| read_breaker(&br));
    let near_limit_left_permille = match root.get("near_limit") {
        None => Some(200),
        Some(v) => match v.as_f64() {
            Some(f) if (0.0..=1.0).contains(&f) => Some(1000 - (f * 1000.0).round() as u64),
            _ => root.refuse("near_limit", "must be a number between 0 and 1"),
        },
    };
    let model = read_model(&root, rules.as_deref());
    let (service, trusted_hops, rules) = (service?, trusted_hops?, rules?);
    let sends_descriptors = service.transport.supports(Feature::Descriptor);
    let needs_peer_address = trusted_hops == 0
        && rules.iter().any(|r| {
            r.key.contains(&KeyPart::ClientIp)
                || r.matcher.reads_client_ip()
                || (sends_descriptors
                    && r.rate_limit()
                        .is_some_and(|l| l.descriptor.iter().any(|(_, p)| *p == KeyPart::ClientIp)))
        });
    Some(Config {
        service,
        trusted_hops,
        rules,
        failure_mode: failure_mode?,
        fallback: fallback?,
        breaker: breaker?,
        shadow: shadow?,
        response: response?,
        needs_peer_address,
        near_limit_left_permille: near_limit_left_permille?,
        model: model?,
    })
}

/// `model`: exactly one of `header` and `body: true`; `max_body_bytes` only with `body`. Every
/// rule that keys or prices by the model needs it (each refused at its field without it).
fn read_model(root: &Obj<'_>, rules: Option<&[Rule]>) -> Option<Option<ModelSource>> {
    let refusals = root.refusals();
    let source = match root.get("model") {
        None => None,
        Some(v) => {
            let m = Obj::new(Some(v), "model", fields::MODEL, refusals)?;
            let header = match m.string("header") {
                None => None,
                Some(None) => Some(None),
                Some(Some(h)) => obj::header_name(&m.path("header"), &h, refusals).map(Some),
            };
            let body = m.boolean("body");
            let max = m.int("max_body_bytes");
            let metadata = match m.get("metadata") {
                None => Some(None),
                Some(_) => rule::metadata_path(&m).map(Some),
            };
            match (header?, body?, max?, metadata?) {
                (_, false, _, _) if m.get("max_body_bytes").is_some() => {
                    return m.refuse("max_body_bytes", "only with \"body\": true")
                }
                (Some(h), false, _, None) => Some(ModelSource::Header(h)),
                (None, false, _, Some(path)) => Some(ModelSource::Metadata(path)),
                (None, true, max, None) => Some(ModelSource::Body(
                    usize::try_from(max).unwrap_or(usize::MAX),
                )),
                _ => {
                    return m.refuse(
                        "header",
                        "exactly one of `header`, `metadata` and `\"body\": true`",
                    )
                }
            }
        }
    };
    if source.is_none() {
        let mut asked = false;
        for (i, r) in rules.unwrap_or(&[]).iter().enumerate() {
            if let Some(k) = r.key.iter().position(|p| *p == KeyPart::Model) {
                asked = true;
                refusals.refuse::<()>(
                    format!("rules[{i}].key[{k}]"),
                    "the model is read where the top-level `model` says: it is missing",
                );
            }
            let prices = r.rate_limit().and_then(|l| l.charge.as_ref());
            if prices.is_some_and(|c| !c.prices.is_empty()) {
                asked = true;
                refusals.refuse::<()>(
                    format!("rules[{i}].usage.prices"),
                    "the model is read where the top-level `model` says: it is missing",
                );
            }
        }
        if asked {
            return None;
        }
    }
    Some(source)
}

/// `rules`, each read whatever the others' refusals; a refused rule is left out (its refusals
/// kept, so the configuration is refused). `None`: the list itself is refused.
fn read_rules(
    root: &Obj<'_>,
    transport: Option<Transport>,
    shadow: bool,
    response: &Response,
) -> Option<Vec<Rule>> {
    let refusals = root.refusals();
    let Some(raw_rules) = root.array("rules")? else {
        return root.refuse("rules", "missing (required)");
    };
    let counted = !raw_rules.is_empty() && raw_rules.len() <= MAX_BUCKETS;
    if !counted {
        // Too many rules are still read, each: their refusals do not depend on their number.
        root.refuse::<()>(
            "rules",
            format!("must hold between 1 and {MAX_BUCKETS} rules"),
        );
    }
    let mut rules: Vec<Rule> = Vec::with_capacity(raw_rules.len());
    for (i, r) in raw_rules.iter().enumerate() {
        let at = format!("rules[{i}]");
        // A rule whose `kind` is refused is skipped: which of its fields belong to it, and which
        // of them are required, depends on its kind.
        let Some(concurrency) = rule::concurrency(&at, r, refusals) else {
            continue;
        };
        // With `service.transport` refused the transport is not known: what a rule asks of it
        // is not checked.
        if let Some(t) = transport {
            carried(
                refusals,
                t,
                &at,
                &[(concurrency, Feature::Concurrency, "kind")],
            );
        }
        let Some(rule) = rule::read_rule(&at, r, concurrency, shadow, response, refusals) else {
            continue;
        };
        if let Some(t) = transport {
            let asks = |f: fn(&RateLimit) -> bool| rule.rate_limit().is_some_and(f);
            carried(
                refusals,
                t,
                &at,
                &[
                    (asks(|l| l.lease.is_some()), Feature::Lease, "lease"),
                    (asks(|l| l.shape.is_some()), Feature::Shape, "shape"),
                    (
                        asks(|l| l.from_request.is_some()),
                        Feature::FromRequest,
                        "from_request",
                    ),
                    (
                        asks(|l| l.charge.is_some()),
                        Feature::ChargeByResponse,
                        "charge",
                    ),
                    (
                        asks(|l| l.calendar.is_some()),
                        Feature::Calendar,
                        "calendar",
                    ),
                ],
            );
        }
        if rules.iter().any(|o| o.name == rule.name) {
            refusals.refuse::<()>(
                format!("{at}.name"),
                format!("duplicate rule name {:?}", rule.name),
            );
            continue;
        }
        rules.push(rule);
    }
    counted.then_some(rules)
}

/// Refuses each of `asked` that `transport` does not carry (`transports::check`); whether it
/// carries them all.
fn carried(
    refusals: &Refusals,
    transport: Transport,
    at: &str,
    asked: &[(bool, Feature, &str)],
) -> bool {
    let mut all = true;
    for e in transports::check(transport, at, asked) {
        refusals.keep(e);
        all = false;
    }
    all
}

/// `service`, then what it asks of its transport (`transports::check`); the defaults that depend
/// on the transport are the transport table's. Each field is read whatever the others' refusals;
/// with `transport` refused, what depends on it (the defaults it decides, `domain`, and what the
/// transport must carry) is skipped. The transport is answered apart, for the rules' checks
/// against it: it may be read when another field of `service` is refused.
fn read_service(root: &Obj<'_>) -> (Option<Transport>, Option<Service>) {
    let s = root
        .required("service")
        .and_then(|v| Obj::new(Some(v), "service", fields::SERVICE, root.refusals()));
    let Some(s) = s else {
        return (None, None);
    };
    let transport = s.choice("transport", &TRANSPORTS.map(|(_, t)| t));
    (
        transport,
        transport.and_then(|t| read_service_fields(&s, t)),
    )
}

/// The fields of `service` `s` but its transport, `transport`.
fn read_service_fields(s: &Obj<'_>, transport: Transport) -> Option<Service> {
    let cluster = match s.text("cluster") {
        Some(c) if c.is_empty() || !header_safe(&c) => {
            s.refuse("cluster", "must be a non-empty cluster name")
        }
        c => c,
    };
    // Absent, the authority is the cluster's name: skipped with the cluster refused.
    let authority = match s.string("authority")? {
        Some(a) => Some(a),
        None => cluster.clone(),
    };
    let authority = match authority {
        Some(a) if a.is_empty() || !header_safe(&a) => {
            s.refuse("authority", "must be a non-empty host name")
        }
        a => a,
    };
    let domain = match s.text("domain") {
        Some(d) if transport.supports(Feature::Domain) && (d.is_empty() || d.len() > 256) => s
            .refuse(
                "domain",
                format!(
                    "required with transport {}: the RLS domain, 1..=256 bytes",
                    transport.name()
                ),
            ),
        d => d,
    };
    let timeout_ms = s.int("timeout_ms");
    let path = match s.text("path") {
        Some(p) if !p.starts_with('/') || !header_safe(&p) || p.contains(' ') => s.refuse(
            "path",
            "must start with '/' and hold no spaces or control characters",
        ),
        p => p,
    };
    let token = match s.string("token") {
        Some(Some(t)) if t.is_empty() || t.len() > 4096 || !header_safe(&t) => {
            s.refuse("token", "must be 1..=4096 printable characters")
        }
        t => t,
    };
    let trace = s.boolean("trace");
    let on = |feature, value| {
        if transport.supports(feature) {
            value
        } else {
            0
        }
    };
    let batch = s
        .int_or("batch", on(Feature::Batch, MAX_BATCH_TAKES as u64))
        .map(|n| n as usize);
    let stream = s.boolean_or("stream", transport.supports(Feature::Stream));
    let remember_denials_ms = s.int_or(
        "remember_denials_ms",
        on(Feature::RememberDenials, DEFAULT_REMEMBER_DENIALS_MS),
    );
    let domain = domain?;
    let (batch, stream, remember_denials_ms) = (batch?, stream?, remember_denials_ms?);
    carried(
        s.refusals(),
        transport,
        "service",
        &[
            (stream, Feature::Stream, "stream"),
            (batch > 0, Feature::Batch, "batch"),
            (
                remember_denials_ms > 0,
                Feature::RememberDenials,
                "remember_denials_ms",
            ),
            (!domain.is_empty(), Feature::Domain, "domain"),
        ],
    );
    Some(Service {
        cluster: cluster?,
        authority: authority?,
        transport,
        timeout_ms: timeout_ms?,
        path: path?,
        token: token?,
        domain,
        batch,
        stream,
        remember_denials_ms,
        trace: trace?,
    })
}

/// `fallback`; a debt lapses after the longest time a rule's bucket takes to fill (within 10 s
/// and an hour).
fn read_fallback(fb: &Obj<'_>, rules: &[Rule]) -> Option<Fallback> {
    let fill_ms = rules
        .iter()
        .filter_map(Rule::rate_limit)
        .map(|r| {
            let ms = u128::from(r.capacity) * u128::from(r.period_ms) / u128::from(r.rate.max(1));
            u64::try_from(ms + 1).unwrap_or(u64::MAX)
        })
        .max()
        .unwrap_or(0);
    let instances = fb.int("instances");
    let min_instances = fb.int("min_instances");
    let max_keys = fb.int("max_keys");
    Some(Fallback {
        instances: instances?,
        min_instances: min_instances?,
        max_keys: max_keys? as u32,
        debt_horizon_ms: fill_ms.clamp(10_000, 3_600_000),
    })
}

/// `breaker`: `max_open_ms` at least `open_ms`, by default 5 s or `open_ms` if longer (skipped
/// with `open_ms` refused).
fn read_breaker(br: &Obj<'_>) -> Option<Breaker> {
    let failures = br.int("failures");
    let open_ms = br.int("open_ms");
    let max_open_ms = open_ms.and_then(|o| br.int_at_least("max_open_ms", o.max(5_000), o));
    Some(Breaker {
        failures: failures? as u32,
        open_ms: open_ms?,
        max_open_ms: max_open_ms?,
    })
}

/// The denial response: each field given in `r`, else `base`'s (a rule's `response` over the
/// global one), else the default.
fn read_response(r: &Obj<'_>, base: Option<&Response>) -> Option<Response> {
    let status = match base {
        Some(b) => r.int_or("status", u64::from(b.status)),
        None => r.int("status"),
    };
    let body = match (r.string("body"), base) {
        (Some(Some(b)), _) => Some(b),
        (Some(None), Some(b)) => Some(b.body.clone()),
        (Some(None), None) => r.text("body"),
        (None, _) => None,
    };
    let body = match body {
        Some(b) if b.len() > 65_536 => r.refuse("body", "must be at most 65536 bytes"),
        b => b,
    };
    let content_type = match (r.string("content_type"), base) {
        (Some(Some(c)), _) => Some(c),
        (Some(None), Some(b)) => Some(b.content_type.clone()),
        (Some(None), None) => r.text("content_type"),
        (None, _) => None,
    };
    let content_type = match content_type {
        Some(c) if c.is_empty() || !header_safe(&c) => {
            r.refuse("content_type", "must be a non-empty printable header value")
        }
        c => c,
    };
    let headers = match r.array("headers") {
        None => None,
        Some(None) => Some(match base {
            Some(b) => b.headers.clone(),
            None => vec![HeaderStyle::Draft],
        }),
        Some(Some(list)) => {
            let mut headers = Vec::new();
            let mut all = true;
            for (i, v) in list.iter().enumerate() {
                let at = format!("{}[{i}]", r.path("headers"));
                let style = match pick_value(&at, v, &["draft", "x-ratelimit"], r.refusals()) {
                    Some(0) => HeaderStyle::Draft,
                    Some(_) => HeaderStyle::XRateLimit,
                    None => {
                        all = false;
                        continue;
                    }
                };
                if !headers.contains(&style) {
                    headers.push(style);
                }
            }
            all.then_some(headers)
        }
    };
    let on_allowed = match (r.get("on_allowed"), base) {
        (None, Some(b)) => Some(b.on_allowed),
        _ => r.boolean("on_allowed"),
    };
    Some(Response {
        status: status? as u32,
        body: body?,
        content_type: content_type?,
        headers: headers?,
        on_allowed: on_allowed?,
    })
}
