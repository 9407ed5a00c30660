//! Which limit a rule's bucket has for one request: the first `overrides` entry whose condition the
//! key's value meets, else the tier named in the trusted tier header (if the rule has tiers and the
//! name is configured), else the rule's own limit, with what `from_request` reads in place of its
//! capacity and rate. `Unlimited` means the rule takes no bucket.

use crate::core::config::{Attribute, FromRequest, Limit, RateLimit, Rule, Source, ValueMatch};
use crate::core::rules::keys::part_value;
use crate::core::rules::Request;
use crate::core::wire::plan::RuleCount;
use std::net::IpAddr;

/// The limit of the bucket of `rule` (a rate rule, limited by `l`) for `req`; a number
/// `from_request` read that was clamped or absent is noted in `noted`.
pub fn limit_for(
    rule: &Rule,
    l: &RateLimit,
    req: &Request,
    trusted_hops: u32,
    noted: &mut Vec<RuleCount>,
) -> Limit {
    for o in &l.overrides {
        let Some(p) = rule.key.get(o.part) else {
            continue;
        };
        let Some(v) = part_value(p, req, trusted_hops) else {
            continue;
        };
        let hit = match &o.when {
            ValueMatch::Equals(e) => v == e.as_bytes(),
            ValueMatch::Prefix(pre) => v.starts_with(pre.as_bytes()),
            ValueMatch::Cidr(c) => std::str::from_utf8(&v)
                .ok()
                .and_then(|s| s.parse::<IpAddr>().ok())
                .is_some_and(|ip| c.contains(&ip)),
        };
        if hit {
            return o.limit;
        }
    }
    if let Some(t) = &l.tiers {
        if let Some(name) = req.header(&t.header) {
            if let Some((_, l)) = t.limits.iter().find(|(n, _)| n.as_bytes() == name) {
                return *l;
            }
        }
    }
    let (capacity, rate) = match &l.from_request {
        None => (l.capacity, l.rate),
        Some(f) => from_request(f, l, req, noted),
    };
    Limit::Tokens {
        capacity,
        rate,
        period_ms: l.period_ms,
    }
}

/// The capacity and rate of `l` with what `f` reads of `req` in their place.
fn from_request(
    f: &FromRequest,
    l: &RateLimit,
    req: &Request,
    noted: &mut Vec<RuleCount>,
) -> (u64, u64) {
    let mut read = |a: &Option<Attribute>, own: u64| match a {
        None => own,
        Some(a) => read_number(a, own, req, noted),
    };
    let capacity = read(&f.capacity, l.capacity);
    let rate = if f.rate_follows_capacity {
        capacity
    } else {
        read(&f.rate, l.rate)
    };
    (capacity, rate)
}

/// What a request costs under `l`: its `from_request.cost` if it has one (the rule's own cost the
/// default), else [`keys::cost`](crate::core::rules::keys::cost).
pub fn cost_for(l: &RateLimit, req: &Request, noted: &mut Vec<RuleCount>) -> u64 {
    let own = crate::core::rules::keys::cost(l, req);
    match l.from_request.as_ref().and_then(|f| f.cost.as_ref()) {
        Some(a) => read_number(a, own, req, noted),
        None => own,
    }
}

/// The number `a` names in `req`, within its bounds (clamped, noted); `own` when it is absent or
/// not a number (noted).
fn read_number(a: &Attribute, own: u64, req: &Request, noted: &mut Vec<RuleCount>) -> u64 {
    let n = match &a.source {
        Source::Header(h) => req.header(h).and_then(text),
        Source::Property(p) => req.property(p).and_then(number),
    };
    match n {
        None => {
            noted.push(RuleCount::LimitDefaulted);
            own
        }
        Some(n) if n < a.min || n > a.max => {
            noted.push(RuleCount::LimitClamped);
            n.clamp(a.min, a.max)
        }
        Some(n) => n,
    }
}

/// A number written as decimal text (a header, or a string in metadata): digits, a sign, a
/// fraction (rounded down); a negative number is 0. `None`: not a number. Read by hand: the
/// standard float parser would add about 25 KB of tables to the module.
fn text(raw: &[u8]) -> Option<u64> {
    let t = std::str::from_utf8(raw).ok()?.trim();
    let (negative, t) = match t.as_bytes().first() {
        Some(b'-') => (true, t.get(1..)?),
        Some(b'+') => (false, t.get(1..)?),
        _ => (false, t),
    };
    let (whole, fraction) = t.split_once('.').unwrap_or((t, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || whole.len() > 20 || !digits(whole) || !digits(fraction) {
        return None;
    }
    if negative {
        return Some(0);
    }
    // Above u64::MAX: the largest, clamped to `max` anyway.
    Some(whole.parse::<u64>().unwrap_or(u64::MAX))
}

/// A number in dynamic metadata: a string of decimal text ([`text`]), or a number, which Envoy
/// hands over as the 8 bytes of a double in the host's byte order. Eight printable bytes are
/// text: a double a limit could be (100.0 is `40 59 00 ..`) has bytes outside that range.
fn number(raw: &[u8]) -> Option<u64> {
    if raw.iter().all(|b| (0x20..0x7f).contains(b)) {
        return text(raw);
    }
    let bytes: [u8; 8] = raw.try_into().ok()?;
    whole(f64::from_ne_bytes(bytes))
}

/// A finite number rounded down to a whole one (negatives 0, beyond `u64` its largest).
fn whole(f: f64) -> Option<u64> {
    // `as` rounds toward zero and saturates: a negative number is 0, a huge one u64::MAX.
    f.is_finite().then_some(f as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::config::Config;

    fn cfg(rule: &str) -> Config {
        Config::parse(format!(r#"{{"service":{{"cluster":"c"}},"rules":[{rule}]}}"#).as_bytes())
            .unwrap()
    }

    fn req(headers: &[(&str, &str)], peer: Option<&str>) -> Request {
        Request {
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
                .collect(),
            peer: peer.map(str::to_string),
            properties: Vec::new(),
            ..Default::default()
        }
    }

    fn tokens(capacity: u64, rate: u64, period_ms: u64) -> Limit {
        Limit::Tokens {
            capacity,
            rate,
            period_ms,
        }
    }

    #[test]
    fn first_override_wins_then_tier_then_the_rule() {
        let c = cfg(
            r#"{"name":"r","key":["header:x-key"],"capacity":10,"period_ms":1000,
                "overrides":[{"value":"vip","capacity":1000},
                             {"prefix":"test-","unlimited":true},
                             {"prefix":"t","capacity":5,"rate":1,"period_ms":60000}],
                "tiers":{"header":"x-tier","limits":{"gold":{"capacity":100},"free":{"capacity":2}}}}"#,
        );
        let r = &c.rules[0];
        let rl = r.rate_limit().unwrap();
        let l = |h: &[(&str, &str)]| limit_for(r, rl, &req(h, None), 0, &mut Vec::new());
        assert_eq!(l(&[("x-key", "vip")]), tokens(1000, 1000, 1000));
        assert_eq!(l(&[("x-key", "test-1")]), Limit::Unlimited);
        assert_eq!(l(&[("x-key", "tx")]), tokens(5, 1, 60_000));
        assert_eq!(
            l(&[("x-key", "vip"), ("x-tier", "free")]),
            tokens(1000, 1000, 1000),
            "an override before the tier"
        );
        assert_eq!(
            l(&[("x-key", "a"), ("x-tier", "gold")]),
            tokens(100, 100, 1000)
        );
        assert_eq!(
            l(&[("x-key", "a"), ("x-tier", "1000000")]),
            tokens(10, 10, 1000),
            "an unknown tier (or a number) gets the rule's limit"
        );
        assert_eq!(l(&[("x-key", "a")]), tokens(10, 10, 1000));
    }

    #[test]
    fn cidr_overrides_read_the_client_address() {
        let c = cfg(
            r#"{"name":"r","key":["literal:x","client_ip"],"capacity":10,"period_ms":1000,
                "overrides":[{"cidr":"10.0.0.0/8","unlimited":true},
                             {"cidr":"2001:db8::/32","capacity":1}]}"#,
        );
        let r = &c.rules[0];
        let rl = r.rate_limit().unwrap();
        let l = |peer: &str| limit_for(r, rl, &req(&[], Some(peer)), 0, &mut Vec::new());
        assert_eq!(l("10.1.2.3:5000"), Limit::Unlimited);
        assert_eq!(l("11.1.2.3:5000"), tokens(10, 10, 1000));
        assert_eq!(l("[2001:db8::7]:80"), tokens(1, 1, 1000));
        assert_eq!(l("[2001:db9::7]:80"), tokens(10, 10, 1000));
    }

    #[test]
    fn bad_overrides_and_tiers_name_their_field() {
        for (rule, field) in [
            (
                r#"{"name":"r","key":["header:a","header:b"],"capacity":1,"period_ms":1,"overrides":[{"value":"x","capacity":2}]}"#,
                "rules[0].overrides[0].key_part",
            ),
            (
                r#"{"name":"r","key":["header:a"],"capacity":1,"period_ms":1,"overrides":[{"key_part":"header:b","value":"x","capacity":2}]}"#,
                "rules[0].overrides[0].key_part",
            ),
            (
                r#"{"name":"r","key":["header:a"],"capacity":1,"period_ms":1,"overrides":[{"cidr":"10.0.0.0/8","capacity":2}]}"#,
                "rules[0].overrides[0].cidr",
            ),
            (
                r#"{"name":"r","key":["client_ip"],"capacity":1,"period_ms":1,"overrides":[{"cidr":"10.0.0.0/33","capacity":2}]}"#,
                "rules[0].overrides[0].cidr",
            ),
            (
                r#"{"name":"r","key":["client_ip"],"capacity":1,"period_ms":1,"overrides":[{"value":"a","prefix":"b","capacity":2}]}"#,
                "rules[0].overrides[0]",
            ),
            (
                r#"{"name":"r","key":["client_ip"],"capacity":1,"period_ms":1,"overrides":[{"value":"a","unlimited":true,"capacity":2}]}"#,
                "rules[0].overrides[0].capacity",
            ),
            (
                r#"{"name":"r","key":["client_ip"],"capacity":1,"period_ms":1,"overrides":[{"value":"a"}]}"#,
                "rules[0].overrides[0].capacity",
            ),
            (
                r#"{"name":"r","key":["client_ip"],"capacity":1,"period_ms":1,"tiers":{"header":"x-t","limits":{"gold":{"capacity":0}}}}"#,
                "rules[0].tiers.limits.gold.capacity",
            ),
            (
                r#"{"name":"r","key":["client_ip"],"capacity":1,"period_ms":1,"tiers":{"header":"x-t","limits":{}}}"#,
                "rules[0].tiers.limits",
            ),
        ] {
            let e = Config::parse(
                format!(r#"{{"service":{{"cluster":"c"}},"rules":[{rule}]}}"#).as_bytes(),
            )
            .unwrap_err();
            assert_eq!(e.field, field, "{rule}: {e}");
        }
    }

    #[test]
    fn rls_descriptors_default_and_written_out() {
        let c = Config::parse(
            br#"{"service":{"cluster":"rl","transport":"rls","domain":"edge"},"rules":[
                {"name":"per-ip","key":["client_ip","header:x-api-key","literal:v1"],"capacity":5,"period_ms":1000},
                {"name":"custom","capacity":5,"period_ms":1000,
                 "descriptor":[{"key":"generic_key","value":"literal:all"},{"key":"verb","value":"method"}]}]}"#,
        )
        .unwrap();
        assert!(c.needs_peer_address);
        let r = req(
            &[(":method", "GET"), ("x-api-key", "k1")],
            Some("10.0.0.7:1"),
        );
        let plan = match crate::core::decide::decide(&c, &r).step {
            crate::core::wire::plan::Step::Callout(p) => p,
            _ => panic!(),
        };
        let rls = plan.rls.unwrap();
        assert_eq!(rls.domain, "edge");
        let d: Vec<Vec<(&str, &str)>> = rls
            .descriptors
            .iter()
            .map(|d| d.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect())
            .collect();
        assert_eq!(
            d,
            vec![
                vec![
                    ("rule", "per-ip"),
                    ("remote_address", "10.0.0.7"),
                    ("x-api-key", "k1"),
                    ("generic_key", "v1")
                ],
                vec![("generic_key", "all"), ("verb", "GET")]
            ]
        );
        for (json, field) in [
            (
                r#"{"service":{"cluster":"rl","transport":"rls"},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#,
                "service.domain",
            ),
            (
                r#"{"service":{"cluster":"rl","domain":"x"},"rules":[{"name":"a","capacity":1,"period_ms":1}]}"#,
                "service.domain",
            ),
            (
                r#"{"service":{"cluster":"rl","transport":"rls","domain":"x"},"rules":[{"name":"a","capacity":4,"period_ms":1,"lease":{"size":2}}]}"#,
                "rules[0].lease",
            ),
            (
                r#"{"service":{"cluster":"rl","transport":"rls","domain":"x"},"rules":[{"name":"a","capacity":1,"period_ms":1,"descriptor":[{"key":"k","value":"cookie"}]}]}"#,
                "rules[0].descriptor[0].value",
            ),
            (
                r#"{"service":{"cluster":"rl","transport":"rls","domain":"x"},"rules":[{"name":"a","capacity":1,"period_ms":1,"descriptor":[]}]}"#,
                "rules[0].descriptor",
            ),
        ] {
            assert_eq!(
                Config::parse(json.as_bytes()).unwrap_err().field,
                field,
                "{json}"
            );
        }
    }

    #[test]
    fn cidr_edges() {
        let c = crate::core::config::Cidr::parse("0.0.0.0/0").unwrap();
        assert!(c.contains(&"255.1.2.3".parse().unwrap()));
        assert!(
            !c.contains(&"::1".parse().unwrap()),
            "v4 network, v6 address"
        );
        let c = crate::core::config::Cidr::parse("192.168.1.7").unwrap();
        assert!(c.contains(&"192.168.1.7".parse().unwrap()));
        assert!(!c.contains(&"192.168.1.8".parse().unwrap()));
        assert!(crate::core::config::Cidr::parse("1.2.3.4/-1").is_none());
    }

    const AUTHZ: &str = "envoy.filters.http.ext_authz";

    fn from_request(f: &str, rate: &str) -> Config {
        cfg(&format!(
            r#"{{"name":"r","key":["header:x-key"],"capacity":10,{rate}"period_ms":1000,
                "overrides":[{{"value":"vip","capacity":1000}}],
                "from_request":{f}}}"#
        ))
    }

    /// The request with dynamic metadata `envoy.filters.http.ext_authz.limit` = `v` (if any), and
    /// headers `h`.
    fn with_metadata(h: &[(&str, &str)], v: Option<Vec<u8>>) -> Request {
        let mut r = req(h, None);
        if let Some(v) = v {
            let path = ["metadata", "filter_metadata", AUTHZ, "limit"];
            r.properties
                .push((path.iter().map(|s| s.to_string()).collect(), v));
        }
        r
    }

    #[test]
    fn a_limit_from_the_request_is_bounded_and_counted() {
        let c = from_request(
            &format!(r#"{{"capacity":{{"metadata":["{AUTHZ}","limit"],"min":5,"max":500}}}}"#),
            "",
        );
        let r = &c.rules[0];
        let rl = r.rate_limit().unwrap();
        let l = |h: &[(&str, &str)], v: Option<&[u8]>| {
            let mut noted = Vec::new();
            let limit = limit_for(
                r,
                rl,
                &with_metadata(h, v.map(<[u8]>::to_vec)),
                0,
                &mut noted,
            );
            (limit, noted)
        };
        // A string of decimal text (ext_authz's headers to metadata), the rate following it (the
        // rule has no rate of its own).
        assert_eq!(l(&[], Some(b"50")), (tokens(50, 50, 1000), vec![]));
        // A number (a JWT claim, a gRPC authorization server's struct): a double's 8 bytes.
        assert_eq!(
            l(&[], Some(&120.0f64.to_ne_bytes())),
            (tokens(120, 120, 1000), vec![])
        );
        assert_eq!(l(&[], Some(b" 7.9 ")), (tokens(7, 7, 1000), vec![]));
        // Out of bounds: clamped, counted.
        assert_eq!(
            l(&[], Some(b"100000")),
            (tokens(500, 500, 1000), vec![RuleCount::LimitClamped])
        );
        assert_eq!(
            l(&[], Some(&(-3.0f64).to_ne_bytes())),
            (tokens(5, 5, 1000), vec![RuleCount::LimitClamped])
        );
        // Absent, or not a number: the rule's own, counted.
        for v in [
            None,
            Some(&b"lots"[..]),
            Some(&f64::NAN.to_ne_bytes()),
            Some(b""),
        ] {
            assert_eq!(
                l(&[], v),
                (tokens(10, 10, 1000), vec![RuleCount::LimitDefaulted]),
                "{v:?}"
            );
        }
        // A client's header of the same name is not metadata.
        assert_eq!(l(&[("limit", "400")], None).0, tokens(10, 10, 1000));
        // An override still comes first, and reads nothing.
        assert_eq!(
            l(&[("x-key", "vip")], Some(b"50")),
            (tokens(1000, 1000, 1000), vec![])
        );
    }

    #[test]
    fn a_rate_from_a_header_and_the_rules_own_rate_kept() {
        let c = from_request(
            r#"{"capacity":{"header":"x-cap","max":100},"rate":{"header":"x-rate","min":2,"max":50}}"#,
            r#""rate":3,"#,
        );
        let r = &c.rules[0];
        let rl = r.rate_limit().unwrap();
        let l = |h: &[(&str, &str)]| limit_for(r, rl, &req(h, None), 0, &mut Vec::new());
        assert_eq!(
            l(&[("x-cap", "40"), ("x-rate", "20")]),
            tokens(40, 20, 1000)
        );
        assert_eq!(
            l(&[("x-cap", "40")]),
            tokens(40, 3, 1000),
            "the rule's rate"
        );
        assert_eq!(l(&[("x-rate", "1")]), tokens(10, 2, 1000));
        // Only the capacity read: the rule's explicit rate stays.
        let c = from_request(
            r#"{"capacity":{"header":"x-cap","max":100}}"#,
            r#""rate":3,"#,
        );
        let r = &c.rules[0];
        let l = limit_for(
            r,
            r.rate_limit().unwrap(),
            &req(&[("x-cap", "40")], None),
            0,
            &mut Vec::new(),
        );
        assert_eq!(l, tokens(40, 3, 1000));
    }

    #[test]
    fn from_request_is_checked_naming_the_field() {
        for (f, field) in [
            (r#"{}"#, "rules[0].from_request"),
            (
                r#"{"capacity":{"max":10}}"#,
                "rules[0].from_request.capacity.header",
            ),
            (
                r#"{"capacity":{"header":"x","metadata":["a","b"],"max":10}}"#,
                "rules[0].from_request.capacity.header",
            ),
            (
                r#"{"capacity":{"header":"x"}}"#,
                "rules[0].from_request.capacity.max",
            ),
            (
                r#"{"capacity":{"header":"x","max":10,"min":11}}"#,
                "rules[0].from_request.capacity.min",
            ),
            (
                r#"{"rate":{"metadata":["only-the-namespace"],"max":10}}"#,
                "rules[0].from_request.rate.metadata",
            ),
            (
                r#"{"rate":{"metadata":["a",""],"max":10}}"#,
                "rules[0].from_request.rate.metadata[1]",
            ),
            (
                r#"{"rate":{"metadata":"a.b","max":10}}"#,
                "rules[0].from_request.rate.metadata",
            ),
        ] {
            let json = format!(
                r#"{{"service":{{"cluster":"c"}},"rules":[{{"name":"r","capacity":10,"period_ms":1000,"from_request":{f}}}]}}"#
            );
            assert_eq!(
                Config::parse(json.as_bytes()).unwrap_err().field,
                field,
                "{f}"
            );
        }
        // The cost read twice, or settled by the response.
        for (rule, field) in [
            (
                r#""cost":{"header":"x-cost"},"from_request":{"cost":{"header":"y","max":9}}"#,
                "rules[0].from_request.cost",
            ),
            (
                r#""charge":"response","from_request":{"cost":{"header":"y","max":9}}"#,
                "rules[0].from_request.cost",
            ),
        ] {
            let json = format!(
                r#"{{"service":{{"cluster":"c"}},"rules":[{{"name":"r","capacity":10,"period_ms":1000,{rule}}}]}}"#
            );
            assert_eq!(
                Config::parse(json.as_bytes()).unwrap_err().field,
                field,
                "{rule}"
            );
        }
        let rls = r#"{"service":{"cluster":"c","transport":"rls","domain":"d"},"rules":[{"name":"r","capacity":10,"period_ms":1000,"from_request":{"capacity":{"header":"x","max":10}}}]}"#;
        let e = Config::parse(rls.as_bytes()).unwrap_err();
        assert_eq!(e.field, "rules[0].from_request");
        assert!(e.message.contains("rls"), "{e:?}");
    }

    #[test]
    fn a_cost_from_the_request_is_bounded_and_counted() {
        let c = cfg(&format!(
            r#"{{"name":"r","capacity":100,"period_ms":1000,"cost":2,
                "from_request":{{"cost":{{"metadata":["{AUTHZ}","limit"],"min":1,"max":50}}}}}}"#
        ));
        let rl = c.rules[0].rate_limit().unwrap();
        let cost = |v: Option<&[u8]>| {
            let mut noted = Vec::new();
            let n = cost_for(rl, &with_metadata(&[], v.map(<[u8]>::to_vec)), &mut noted);
            (n, noted)
        };
        assert_eq!(cost(Some(b"7")), (7, vec![]));
        assert_eq!(cost(Some(b"70")), (50, vec![RuleCount::LimitClamped]));
        assert_eq!(
            cost(None),
            (2, vec![RuleCount::LimitDefaulted]),
            "the rule's cost"
        );
    }
}
