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
use obj::{err, header_safe, pick_value, Obj};
use serde_json::Value;

// The document is parsed into a `serde_json::Value` and walked by hand: each object is checked
// against its table of known fields, and each value is read with its full path at hand, so every
// error (unknown field, wrong type, out of range) names the field. A derive with
// `deny_unknown_fields` plus a path-tracking wrapper did the same for about 60 KiB more module.

impl Config {
    /// Parses and validates the plugin configuration (JSON bytes).
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        let doc: Value = match serde_json::from_slice(bytes) {
            Ok(v) => v,
            Err(e) => return err("config", format!("not valid JSON: {e}")),
        };
        let root = Obj::new(Some(&doc), "", fields::ROOT)?;
        let service = read_service(&root)?;
        let trusted_hops = root.int("trusted_hops")? as u32;
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
        let response = read_response(
            &Obj::new(root.get("response"), "response", fields::RESPONSE)?,
            None,
        )?;
        let mut rules: Vec<Rule> = Vec::with_capacity(raw_rules.len());
        for (i, r) in raw_rules.iter().enumerate() {
            let at = format!("rules[{i}]");
            let concurrency = rule::concurrency(&at, r)?;
            let transport = service.transport;
            transports::check(
                transport,
                &at,
                &[(concurrency, Feature::Concurrency, "kind")],
            )?;
            let rule = rule::read_rule(&at, r, concurrency, shadow, &response)?;
            let asks = |f: fn(&RateLimit) -> bool| rule.rate_limit().is_some_and(f);
            transports::check(
                transport,
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
                ],
            )?;
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
            &[FailureMode::Fallback, FailureMode::Allow, FailureMode::Deny],
        )?;
        let fallback = read_fallback(
            &Obj::new(root.get("fallback"), "fallback", fields::FALLBACK)?,
            &rules,
        )?;
        let breaker = read_breaker(&Obj::new(root.get("breaker"), "breaker", fields::BREAKER)?)?;
        let near_limit_left_permille = match root.get("near_limit") {
            None => 200,
            Some(v) => match v.as_f64() {
                Some(f) if (0.0..=1.0).contains(&f) => 1000 - (f * 1000.0).round() as u64,
                _ => return err("near_limit", "must be a number between 0 and 1"),
            },
        };
        let sends_descriptors = service.transport.supports(Feature::Descriptor);
        let needs_peer_address = trusted_hops == 0
            && rules.iter().any(|r| {
                r.key.contains(&KeyPart::ClientIp)
                    || r.matcher.reads_client_ip()
                    || (sends_descriptors
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
            breaker,
            shadow,
            response,
            needs_peer_address,
            near_limit_left_permille,
        })
    }
}

/// `service`, then what it asks of its transport (`transports::check`); the defaults that depend
/// on the transport are the transport table's.
fn read_service(root: &Obj<'_>) -> Result<Service, ConfigError> {
    let s = Obj::new(Some(root.required("service")?), "service", fields::SERVICE)?;
    let cluster = s.text("cluster")?;
    if cluster.is_empty() || !header_safe(&cluster) {
        return err("service.cluster", "must be a non-empty cluster name");
    }
    let authority = s.string("authority")?.unwrap_or_else(|| cluster.clone());
    if authority.is_empty() || !header_safe(&authority) {
        return err("service.authority", "must be a non-empty host name");
    }
    let transport = s.choice("transport", &TRANSPORTS.map(|(_, t)| t))?;
    let domain = s.text("domain")?;
    if transport.supports(Feature::Domain) && (domain.is_empty() || domain.len() > 256) {
        return err(
            "service.domain",
            format!(
                "required with transport {}: the RLS domain, 1..=256 bytes",
                transport.name()
            ),
        );
    }
    let timeout_ms = s.int("timeout_ms")?;
    let path = s.text("path")?;
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
    let on = |feature, value| {
        if transport.supports(feature) {
            value
        } else {
            0
        }
    };
    let batch = s.int_or("batch", on(Feature::Batch, MAX_BATCH_TAKES as u64))? as usize;
    let stream = s.boolean_or("stream", transport.supports(Feature::Stream))?;
    let remember_denials_ms = s.int_or(
        "remember_denials_ms",
        on(Feature::RememberDenials, DEFAULT_REMEMBER_DENIALS_MS),
    )?;
    let trace = s.boolean("trace")?;
    transports::check(
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
    )?;
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

/// `fallback`; a debt lapses after the longest time a rule's bucket takes to fill (within 10 s
/// and an hour).
fn read_fallback(fb: &Obj<'_>, rules: &[Rule]) -> Result<Fallback, ConfigError> {
    let fill_ms = rules
        .iter()
        .filter_map(Rule::rate_limit)
        .map(|r| {
            let ms = u128::from(r.capacity) * u128::from(r.period_ms) / u128::from(r.rate.max(1));
            u64::try_from(ms + 1).unwrap_or(u64::MAX)
        })
        .max()
        .unwrap_or(0);
    Ok(Fallback {
        instances: fb.int("instances")?,
        min_instances: fb.int("min_instances")?,
        max_keys: fb.int("max_keys")? as u32,
        debt_horizon_ms: fill_ms.clamp(10_000, 3_600_000),
    })
}

/// `breaker`: `max_open_ms` at least `open_ms`, by default 5 s or `open_ms` if longer.
fn read_breaker(br: &Obj<'_>) -> Result<Breaker, ConfigError> {
    let failures = br.int("failures")? as u32;
    let open_ms = br.int("open_ms")?;
    let max_open_ms = br.int_at_least("max_open_ms", open_ms.max(5_000), open_ms)?;
    Ok(Breaker {
        failures,
        open_ms,
        max_open_ms,
    })
}

/// The denial response: each field given in `r`, else `base`'s (a rule's `response` over the
/// global one), else the default.
fn read_response(r: &Obj<'_>, base: Option<&Response>) -> Result<Response, ConfigError> {
    let status = match base {
        Some(b) => r.int_or("status", u64::from(b.status))?,
        None => r.int("status")?,
    } as u32;
    let body = match (r.string("body")?, base) {
        (Some(b), _) => b,
        (None, Some(b)) => b.body.clone(),
        (None, None) => r.text("body")?,
    };
    if body.len() > 65_536 {
        return err(r.path("body"), "must be at most 65536 bytes");
    }
    let content_type = match (r.string("content_type")?, base) {
        (Some(c), _) => c,
        (None, Some(b)) => b.content_type.clone(),
        (None, None) => r.text("content_type")?,
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
                let at = format!("{}[{i}]", r.path("headers"));
                let style = match pick_value(&at, v, &["draft", "x-ratelimit"])? {
                    0 => HeaderStyle::Draft,
                    _ => HeaderStyle::XRateLimit,
                };
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
