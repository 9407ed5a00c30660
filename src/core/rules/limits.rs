//! Which limit a rule's bucket has for one request: the first `overrides` entry whose condition the
//! key's value meets, else the tier named in the trusted tier header (if the rule has tiers and the
//! name is configured), else the rule's own limit. `Unlimited` means the rule takes no bucket.

use crate::core::config::{Limit, RateLimit, Rule, ValueMatch};
use crate::core::rules::keys::part_value;
use crate::core::rules::Request;
use std::net::IpAddr;

/// The limit of the bucket of `rule` (a rate rule, limited by `l`) for `req`.
pub fn limit_for(rule: &Rule, l: &RateLimit, req: &Request, trusted_hops: u32) -> Limit {
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
    Limit::Tokens {
        capacity: l.capacity,
        rate: l.rate,
        period_ms: l.period_ms,
    }
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
        let l = |h: &[(&str, &str)]| limit_for(r, rl, &req(h, None), 0);
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
        let l = |peer: &str| limit_for(r, rl, &req(&[], Some(peer)), 0);
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
}
