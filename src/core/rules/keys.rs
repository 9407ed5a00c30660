//! Bucket keys: `<rule>|<part>|<part>...`, built so that distinct inputs never give equal keys.
//!
//! Why each step:
//! - Every part is percent-escaped: bytes outside a small safe set (the separator `|`, `%`, `#`,
//!   braces, spaces, controls, non-ASCII and non-UTF-8 bytes) become `%XX`. Escaping is injective
//!   and never produces `|`, so joining with `|` is unambiguous: `a:b`+`c` ≠ `a`+`b:c`, and any
//!   header value yields valid UTF-8 (the contract requires it).
//! - A part whose escaped form exceeds [`MAX_PART_BYTES`] is replaced by `#` + SHA-256 (hex) of
//!   the raw bytes; `#` never starts an escaped value, so a hashed part cannot equal a plain one.
//!   With at most [`crate::core::config::MAX_KEY_PARTS`] parts and a 64-byte rule name a key stays
//!   under the contract's 4096 bytes whatever the client sends.
//! - An absent part (with `on_missing: shared`) is `%-`, which escaping never produces, so "header
//!   missing" differs from "header empty" and from every value.
//! - The rule name leads, so two rules never share a bucket by accident.

use crate::core::base::hash::{hex_digit, sha256_hex};
use crate::core::config::{
    Attribute, Cost, HeaderMatch, KeyPart, Match, OnMissing, RateLimit, Rule, Source,
    MAX_PART_BYTES,
};
use crate::core::rules::Request;
use std::net::{IpAddr, SocketAddr};

/// The contract's bound on a key.
pub use contract::bounds::MAX_KEY_BYTES;
/// Marker of an absent part.
const MISSING: &str = "%-";

fn is_safe(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~/:@!$&'()*+,;=".contains(&b)
}

/// Appends the escaped (or hashed, when long) form of one part.
pub fn push_part(out: &mut String, value: &[u8]) {
    let escaped_len: usize = value.iter().map(|&b| if is_safe(b) { 1 } else { 3 }).sum();
    if escaped_len > MAX_PART_BYTES {
        out.push('#');
        out.push_str(&sha256_hex(value));
        return;
    }
    for &b in value {
        if is_safe(b) {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(hex_digit(b >> 4, true));
            out.push(hex_digit(b, true));
        }
    }
}

/// The client address: with `trusted_hops == 0` the peer address (port stripped); otherwise the
/// `trusted_hops`-th x-forwarded-for entry from the right (the rightmost entries were written by
/// the trusted proxies in front of Envoy, the one they saw connect is the client). Returned in
/// canonical form, so `::1` and `0:0::1` are one client. `None` when absent or not an address.
pub fn client_ip(req: &Request, trusted_hops: u32) -> Option<String> {
    if trusted_hops == 0 {
        return parse_addr(req.peer.as_deref()?.as_bytes());
    }
    let hops = usize::try_from(trusted_hops).ok()?;
    let mut entries: Vec<&[u8]> = Vec::new();
    for v in req.header_all("x-forwarded-for") {
        entries.extend(v.split(|&b| b == b','));
    }
    let idx = entries.len().checked_sub(hops)?;
    parse_addr(entries.get(idx)?)
}

fn parse_addr(raw: &[u8]) -> Option<String> {
    let s = std::str::from_utf8(raw).ok()?.trim();
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip.to_string());
    }
    s.parse::<SocketAddr>().ok().map(|a| a.ip().to_string())
}

/// The raw value of one key part for `req` (`None` when absent).
pub fn part_value(part: &KeyPart, req: &Request, trusted_hops: u32) -> Option<Vec<u8>> {
    match part {
        KeyPart::Literal(s) => Some(s.as_bytes().to_vec()),
        KeyPart::Header(h) => req.header(h).map(<[u8]>::to_vec),
        KeyPart::ClientIp => client_ip(req, trusted_hops).map(String::into_bytes),
        KeyPart::Path => Some(req.path().to_vec()),
        KeyPart::Method => Some(req.method().to_vec()),
        KeyPart::Authority => req.authority().map(<[u8]>::to_vec),
        KeyPart::Model => req.model.as_ref().map(|m| m.as_bytes().to_vec()),
    }
}

/// The RLS descriptor of a rate rule's bucket (`l`: its limit) for `req`: its entries with their
/// values. A value that is not UTF-8 or is long is escaped (or hashed) as in keys; an absent one is
/// `%-`.
pub fn descriptor(l: &RateLimit, req: &Request, trusted_hops: u32) -> Vec<(String, String)> {
    l.descriptor
        .iter()
        .map(|(k, part)| {
            let v = match part_value(part, req, trusted_hops) {
                Some(v) => match String::from_utf8(v) {
                    Ok(s) if s.len() <= MAX_PART_BYTES => s,
                    Ok(s) => {
                        let mut out = String::new();
                        push_part(&mut out, s.as_bytes());
                        out
                    }
                    Err(e) => {
                        let mut out = String::new();
                        push_part(&mut out, e.as_bytes());
                        out
                    }
                },
                None => MISSING.to_string(),
            };
            (k.clone(), v)
        })
        .collect()
}

/// The key of `rule` for `req`, or `None` when a part is absent and the rule says `skip`.
pub fn build_key(rule: &Rule, req: &Request, trusted_hops: u32) -> Option<String> {
    let mut key = String::with_capacity(64);
    key.push_str(&rule.name);
    for part in &rule.key {
        key.push('|');
        match part_value(part, req, trusted_hops) {
            Some(v) => push_part(&mut key, &v),
            None => match rule.on_missing {
                OnMissing::Skip => return None,
                OnMissing::Shared => key.push_str(MISSING),
            },
        }
    }
    // Cannot happen with validated rules (64 + 8 × 65 < 4096), kept as a last guard.
    if key.len() > MAX_KEY_BYTES {
        let h = sha256_hex(key.as_bytes());
        key = format!("{}|#{h}", rule.name);
    }
    Some(key)
}

/// The cost of `req` under a rate rule's limit `l`: fixed, or read from a header (`default` when
/// absent or not a positive decimal integer, clamped to `min ..= max`).
pub fn cost(l: &RateLimit, req: &Request) -> u64 {
    match &l.cost {
        Cost::Fixed(c) => *c,
        Cost::Header {
            name,
            default,
            min,
            max,
        } => match req.header(name).and_then(parse_u64) {
            Some(0) | None => *default,
            Some(c) => c.clamp(*min, *max),
        },
    }
}

fn parse_u64(raw: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(raw).ok()?.trim();
    if s.is_empty() || s.len() > 20 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // Values above u64::MAX saturate: they are clamped to `max` anyway.
    Some(s.parse::<u64>().unwrap_or(u64::MAX))
}

/// Adds to `names` every request header `rule` can read: its conditions, key and descriptor parts,
/// cost and tier headers (`:path`, `:method`, `:authority` and `host` for those parts). `false`
/// when it needs every value of a header (the client address from `x-forwarded-for`, with
/// `trusted_hops` > 0), which only the whole header map gives: reading a header by name gives its
/// first value, as [`Request::header`] does. The peer address is not a header: see
/// `Config::needs_peer_address`.
pub fn headers_read(rule: &Rule, trusted_hops: u32, names: &mut Vec<String>) -> bool {
    fn add(names: &mut Vec<String>, n: &str) {
        if !names.iter().any(|x| x == n) {
            names.push(n.to_string());
        }
    }
    fn part(p: &KeyPart, hops: u32, names: &mut Vec<String>) -> bool {
        match p {
            KeyPart::Literal(_) => {}
            KeyPart::Header(h) => add(names, h),
            KeyPart::ClientIp => return hops == 0,
            KeyPart::Path => add(names, ":path"),
            KeyPart::Method => add(names, ":method"),
            KeyPart::Authority => {
                add(names, ":authority");
                add(names, "host");
            }
            // Read where the configuration's `model` says, by the adapter.
            KeyPart::Model => {}
        }
        true
    }
    fn conditions(m: &Match, hops: u32, names: &mut Vec<String>) -> bool {
        if !m.client_ip.is_empty() && hops > 0 {
            return false;
        }
        if m.path.is_some() {
            add(names, ":path");
        }
        if !m.methods.is_empty() {
            add(names, ":method");
        }
        for h in &m.headers {
            match h {
                HeaderMatch::Present(n, _) | HeaderMatch::Equals(n, _) => add(names, n),
            }
        }
        m.not.as_deref().is_none_or(|n| conditions(n, hops, names))
    }
    if !conditions(&rule.matcher, trusted_hops, names) {
        return false;
    }
    let rate = rule.rate_limit();
    for p in rule.key.iter().chain(
        rate.iter()
            .flat_map(|l| l.descriptor.iter().map(|(_, p)| p)),
    ) {
        if !part(p, trusted_hops, names) {
            return false;
        }
    }
    if let Some(l) = rate {
        if let Cost::Header { name, .. } = &l.cost {
            add(names, name);
        }
        if let Some(t) = &l.tiers {
            add(names, &t.header);
        }
        for a in l
            .from_request
            .iter()
            .flat_map(|f| [&f.capacity, &f.rate, &f.cost])
        {
            if let Some(Attribute {
                source: Source::Header(h),
                ..
            }) = a
            {
                add(names, h);
            }
        }
    }
    true
}

/// The property paths `rule`'s `from_request` reads (its dynamic metadata), added to `paths`.
pub fn properties_read(rule: &Rule, paths: &mut Vec<Vec<String>>) {
    let Some(f) = rule.rate_limit().and_then(|l| l.from_request.as_ref()) else {
        return;
    };
    for a in [&f.capacity, &f.rate, &f.cost].into_iter().flatten() {
        if let Some(p) = a.source.property() {
            if !paths.iter().any(|x| x.as_slice() == p) {
                paths.push(p.to_vec());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::collections::HashSet;

    fn rule(parts: Vec<KeyPart>, on_missing: OnMissing) -> Rule {
        Rule {
            key: parts,
            on_missing,
            ..Rule::for_test("r", 10)
        }
    }

    fn req(pairs: &[(&str, &[u8])]) -> Request {
        Request {
            headers: pairs
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_vec()))
                .collect(),
            peer: None,
            properties: Vec::new(),
            ..Default::default()
        }
    }

    fn two_headers() -> Rule {
        rule(
            vec![KeyPart::Header("a".into()), KeyPart::Header("b".into())],
            OnMissing::Shared,
        )
    }

    fn key2(a: Option<&[u8]>, b: Option<&[u8]>) -> String {
        let mut h: Vec<(&str, &[u8])> = Vec::new();
        if let Some(a) = a {
            h.push(("a", a));
        }
        if let Some(b) = b {
            h.push(("b", b));
        }
        build_key(&two_headers(), &req(&h), 0).unwrap()
    }

    #[test]
    fn crafted_pairs_never_collide() {
        let long_a = vec![b'a'; 300];
        let long_b = vec![b'a'; 301];
        let huge = vec![b'{'; 70_000];
        type Pair<'a> = (Option<&'a [u8]>, Option<&'a [u8]>);
        let pairs: Vec<Pair> = vec![
            (Some(b"a:b"), Some(b"c")),
            (Some(b"a"), Some(b"b:c")),
            (Some(b"a|b"), Some(b"c")),
            (Some(b"a"), Some(b"b|c")),
            (Some(b"a%7Cb"), Some(b"c")),
            (Some(b"a%"), Some(b"7Cb|c")),
            (Some(b""), Some(b"")),
            (None, Some(b"")),
            (Some(b""), None),
            (None, None),
            (Some(b"%-"), None),
            (Some(b"{x}"), Some(b"}")),
            (Some(b"{x"), Some(b"}}")),
            (Some(&[0xff, 0xfe]), Some(b"")),
            (Some(&[0xff]), Some(&[0xfe])),
            (Some("é".as_bytes()), Some(b"")),
            (Some(&long_a), Some(b"")),
            (Some(&long_b), Some(b"")),
            (Some(b"#"), Some(b"")),
            (Some(&huge), Some(&huge)),
            (Some(&huge), None),
            (Some(b"a b"), Some(b"")),
            (Some(b"a\nb"), Some(b"")),
        ];
        let mut seen = HashSet::new();
        for (a, b) in &pairs {
            let k = key2(*a, *b);
            assert!(k.len() <= MAX_KEY_BYTES, "{} bytes", k.len());
            assert!(!k.contains('{') && !k.contains('}') && !k.contains('\n'));
            assert!(seen.insert(k.clone()), "collision on {k}");
        }
    }

    #[test]
    fn separators_and_braces_are_escaped() {
        assert_eq!(key2(Some(b"a:b"), Some(b"c")), "r|a:b|c");
        assert_eq!(key2(Some(b"a|b"), Some(b"{c}")), "r|a%7Cb|%7Bc%7D");
        assert_eq!(key2(Some(&[0xff]), None), "r|%FF|%-");
    }

    #[test]
    fn long_parts_are_hashed_and_the_key_is_bounded() {
        let long = vec![b'x'; 10_000];
        let r = rule(vec![KeyPart::Header("a".into()); 8], OnMissing::Skip);
        let k = build_key(&r, &req(&[("a", &long)]), 0).unwrap();
        assert!(k.len() <= MAX_KEY_BYTES);
        assert!(k.starts_with("r|#"));
        // Exactly at the limit: verbatim; one more: hashed.
        let mut s = String::new();
        push_part(&mut s, &[b'x'; MAX_PART_BYTES]);
        assert_eq!(s.len(), MAX_PART_BYTES);
        let mut s = String::new();
        push_part(&mut s, &[b'x'; MAX_PART_BYTES + 1]);
        assert_eq!(s.len(), 65);
    }

    #[test]
    fn missing_part_skips_or_shares() {
        let skip = rule(vec![KeyPart::Header("x-api-key".into())], OnMissing::Skip);
        assert_eq!(build_key(&skip, &req(&[]), 0), None);
        let shared = rule(vec![KeyPart::Header("x-api-key".into())], OnMissing::Shared);
        assert_eq!(build_key(&shared, &req(&[]), 0).as_deref(), Some("r|%-"));
        assert_eq!(
            build_key(&shared, &req(&[("x-api-key", b"")]), 0).as_deref(),
            Some("r|")
        );
    }

    #[test]
    fn all_part_kinds() {
        let r = rule(
            vec![
                KeyPart::Literal("api".into()),
                KeyPart::Method,
                KeyPart::Authority,
                KeyPart::Path,
                KeyPart::ClientIp,
            ],
            OnMissing::Skip,
        );
        let mut q = req(&[
            (":method", b"GET"),
            (":authority", b"ex.com"),
            (":path", b"/a/b?q=1"),
        ]);
        q.peer = Some("10.1.2.3:4567".into());
        assert_eq!(
            build_key(&r, &q, 0).unwrap(),
            "r|api|GET|ex.com|/a/b|10.1.2.3"
        );
        let empty = rule(vec![], OnMissing::Skip);
        assert_eq!(build_key(&empty, &q, 0).unwrap(), "r");
    }

    #[test]
    fn client_ip_from_peer_and_forwarded_for() {
        let mut q = req(&[("x-forwarded-for", b"6.6.6.6, 1.1.1.1 , 2.2.2.2")]);
        q.peer = Some("[::0:1]:80".into());
        assert_eq!(client_ip(&q, 0).as_deref(), Some("::1"));
        assert_eq!(client_ip(&q, 1).as_deref(), Some("2.2.2.2"));
        assert_eq!(client_ip(&q, 2).as_deref(), Some("1.1.1.1"));
        assert_eq!(client_ip(&q, 3).as_deref(), Some("6.6.6.6"));
        assert_eq!(client_ip(&q, 4), None, "fewer entries than trusted hops");
        let bad = req(&[("x-forwarded-for", b"not-an-ip")]);
        assert_eq!(client_ip(&bad, 1), None);
        let two = req(&[
            ("x-forwarded-for", b"1.1.1.1"),
            ("x-forwarded-for", b"2.2.2.2"),
        ]);
        assert_eq!(client_ip(&two, 2).as_deref(), Some("1.1.1.1"));
        let mut p = req(&[]);
        p.peer = Some("10.0.0.1".into());
        assert_eq!(client_ip(&p, 0).as_deref(), Some("10.0.0.1"));
    }

    #[test]
    fn cost_from_header_is_bounded() {
        let mut r = RateLimit::for_test(10);
        r.cost = Cost::Header {
            name: "x-cost".into(),
            default: 2,
            min: 1,
            max: 50,
        };
        let c = |v: &[u8]| cost(&r, &req(&[("x-cost", v)]));
        assert_eq!(cost(&r, &req(&[])), 2);
        assert_eq!(c(b"7"), 7);
        assert_eq!(c(b" 7 "), 7);
        assert_eq!(c(b"51"), 50);
        assert_eq!(
            c(b"99999999999999999999999"),
            2,
            "too long: not a number we accept"
        );
        assert_eq!(c(b"18446744073709551616"), 50, "saturates, then clamps");
        assert_eq!(c(b"0"), 2);
        assert_eq!(c(b"-3"), 2);
        assert_eq!(c(b"1e3"), 2);
        assert_eq!(c(&[0xff]), 2);
        // A floor: a client's hint below it reserves the floor.
        r.cost = Cost::Header {
            name: "x-cost".into(),
            default: 20,
            min: 10,
            max: 50,
        };
        let c = |v: &[u8]| cost(&r, &req(&[("x-cost", v)]));
        assert_eq!((c(b"1"), c(b"10"), c(b"30"), c(b"0")), (10, 10, 30, 20));
    }
    /// A request of only the headers `headers_read` names (first values, as the host's by-name
    /// read gives them) decides exactly as the whole request does.
    #[test]
    fn the_headers_read_decide_as_the_whole_request() {
        use crate::core::config::Config;
        use crate::core::decide::decide;
        let rules = [
            r#"{"name":"a","match":{"path_prefix":"/api","methods":["GET"],"headers":[{"name":"x-plan","equals":"free"}]},"key":["header:x-user","path","method","authority"],"capacity":5,"period_ms":1000}"#,
            r#"{"name":"b","match":{"headers":[{"name":"x-on","present":true}],"not":{"headers":[{"name":"x-off","present":true}]}},"key":["literal:k","header:x-user"],"capacity":5,"period_ms":1000,"cost":{"header":"x-cost","default":1,"max":9}}"#,
            r#"{"name":"c","key":["header:x-user"],"capacity":5,"period_ms":1000,"overrides":[{"value":"vip","capacity":1000}],"tiers":{"header":"x-tier","limits":{"gold":{"capacity":100}}}}"#,
            r#"{"name":"d","key":["client_ip"],"capacity":5,"period_ms":1000}"#,
        ];
        let full: Vec<(&str, &[u8])> = vec![
            (":path", b"/api/x?q=1"),
            (":method", b"GET"),
            (":authority", b"example.com"),
            ("x-user", b"vip"),
            ("x-user", b"second"),
            ("x-plan", b"free"),
            ("x-on", b""),
            ("x-cost", b"4"),
            ("x-tier", b"gold"),
            ("x-noise", b"n"),
        ];
        for r in rules {
            let c = Config::parse(
                format!(r#"{{"service":{{"cluster":"c"}},"rules":[{r}]}}"#).as_bytes(),
            )
            .unwrap();
            let mut names = Vec::new();
            assert!(headers_read(&c.rules[0], c.trusted_hops, &mut names), "{r}");
            assert!(!names.iter().any(|n| n == "x-noise"), "{r}: {names:?}");
            let mut whole = req(&full);
            whole.peer = Some("10.1.2.3:4".into());
            let mut part = req(&[]);
            part.peer = whole.peer.clone();
            for n in &names {
                if let Some(v) = whole.header(n) {
                    part.headers.push((n.clone(), v.to_vec()));
                }
            }
            let step = decide(&c, &whole).step;
            assert_ne!(step, crate::core::wire::plan::Step::Continue, "{r} matches");
            assert_eq!(decide(&c, &part).step, step, "{r}: {names:?}");
        }
        // The client address from x-forwarded-for needs every value: the whole map.
        let c = Config::parse(
            br#"{"service":{"cluster":"c"},"trusted_hops":1,"rules":[{"name":"e","key":["client_ip"],"capacity":5,"period_ms":1000}]}"#,
        )
        .unwrap();
        assert!(!headers_read(&c.rules[0], c.trusted_hops, &mut Vec::new()));
    }
}
