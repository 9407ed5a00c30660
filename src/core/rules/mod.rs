//! Rules: which rules a request matches ([`matches()`]) and the request view they read ([`Request`]).
//! Key building lives in [`keys`]; the limit a rule's bucket gets for one request (overrides,
//! tiers, the rule's own) in [`limits`]; the model a request's JSON body asks for, read as the body
//! arrives, in [`model`].

pub mod keys;
pub mod limits;
pub mod model;

use crate::core::config::{HeaderMatch, Match, PathMatch};
use std::net::IpAddr;

/// What the core sees of a request: its headers as bytes (pseudo-headers `:method`, `:path`,
/// `:authority` included) and, when some rule needs it, the peer address.
///
/// Header values are bytes, not strings: a hostile client can send any octet, and the filter must
/// neither fail on nor confuse them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Request {
    /// Header (name, value) pairs; names are lower case as Envoy delivers them.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The `source.address` property (`ip:port` or `[ipv6]:port`), when read.
    pub peer: Option<String>,
    /// The properties the rules' `from_request` read (path, value), those present.
    pub properties: Vec<(Vec<String>, Vec<u8>)>,
    /// The model the request asks for (the configuration's `model`: a header's value, or the
    /// JSON body's top-level `model` once it was read); `None` when absent.
    pub model: Option<String>,
    /// No body follows the headers.
    pub end_of_stream: bool,
}

impl Request {
    /// The first value of a header.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    /// Every value of a header, in order.
    pub fn header_all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.headers
            .iter()
            .filter(move |(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    /// The path without its query string (and without a fragment, should a client send one).
    pub fn path(&self) -> &[u8] {
        path_of(self)
    }

    /// The method.
    pub fn method(&self) -> &[u8] {
        self.header(":method").unwrap_or(b"")
    }

    /// The authority (host).
    pub fn authority(&self) -> Option<&[u8]> {
        self.header(":authority").or_else(|| self.header("host"))
    }

    /// A property's value, if it was read and present.
    pub fn property(&self, path: &[String]) -> Option<&[u8]> {
        self.properties
            .iter()
            .find(|(p, _)| p.as_slice() == path)
            .map(|(_, v)| v.as_slice())
    }
}

/// The first value of a header, by name: a whole [`Request`], or the adapter's view of only the
/// headers some conditions name (no copy of the request needed to decide that no rule matches).
pub trait Headers {
    /// The first value of header `name` (lower case), if present.
    fn first(&self, name: &str) -> Option<&[u8]>;
}

impl Headers for Request {
    fn first(&self, name: &str) -> Option<&[u8]> {
        self.header(name)
    }
}

/// The `:path` without its query string or fragment (`/` when absent).
fn path_of(req: &impl Headers) -> &[u8] {
    let p = req.first(":path").unwrap_or(b"/");
    let end = p
        .iter()
        .position(|&b| b == b'?' || b == b'#')
        .unwrap_or(p.len());
    p.get(..end).unwrap_or(p)
}

/// Whether every condition of `m` holds for `req` (`trusted_hops` says where the client address
/// comes from, as for `client_ip` key parts).
pub fn matches(m: &Match, req: &Request, trusted_hops: u32) -> bool {
    if !m.client_ip.is_empty() {
        let ip = keys::client_ip(req, trusted_hops).and_then(|s| s.parse::<IpAddr>().ok());
        match ip {
            Some(ip) if m.client_ip.iter().any(|c| c.contains(&ip)) => {}
            _ => return false,
        }
    }
    if let Some(not) = &m.not {
        if matches(not, req, trusted_hops) {
            return false;
        }
    }
    header_conditions(m, req)
}

/// [`matches()`] for conditions that do not read the client address (`!m.reads_client_ip()`),
/// over any view of the headers they name.
pub fn matches_headers(m: &Match, req: &impl Headers) -> bool {
    if let Some(not) = &m.not {
        if matches_headers(not, req) {
            return false;
        }
    }
    header_conditions(m, req)
}

/// The path, method and header conditions of `m` (not `client_ip`, not `not`).
fn header_conditions(m: &Match, req: &impl Headers) -> bool {
    if let Some(pm) = &m.path {
        let path = path_of(req);
        let ok = match pm {
            PathMatch::Exact(p) => path == p.as_bytes(),
            PathMatch::Prefix(p) => path.starts_with(p.as_bytes()),
        };
        if !ok {
            return false;
        }
    }
    if !m.methods.is_empty() {
        let method = req.first(":method").unwrap_or(b"");
        if !m.methods.iter().any(|x| x.as_bytes() == method) {
            return false;
        }
    }
    m.headers.iter().all(|h| match h {
        HeaderMatch::Present(name, want) => req.first(name).is_some() == *want,
        HeaderMatch::Equals(name, value) => req.first(name) == Some(value.as_bytes()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn req(pairs: &[(&str, &[u8])]) -> Request {
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

    #[test]
    fn path_ignores_query_string() {
        let r = req(&[(":path", b"/login?next=/x")]);
        assert_eq!(r.path(), b"/login");
        let m = Match {
            path: Some(PathMatch::Exact("/login".into())),
            ..Match::default()
        };
        assert!(matches(&m, &r, 0));
        let r2 = req(&[(":path", b"/login/x")]);
        assert!(!matches(&m, &r2, 0));
    }

    #[test]
    fn client_networks_and_negation() {
        let c = crate::core::config::Config::parse(
            br#"{"service":{"cluster":"c"},"rules":[{"name":"r","capacity":1,"period_ms":1,
                "match":{"path_prefix":"/api","client_ip":["10.0.0.0/8","2001:db8::/32"],
                         "not":{"headers":[{"name":"x-internal","present":true}],
                                "client_ip":["10.9.0.0/16"]}}}]}"#,
        )
        .unwrap();
        assert!(
            c.needs_peer_address,
            "a match that reads the client address"
        );
        let m = &c.rules[0].matcher;
        let at = |peer: &str, internal: bool| {
            let mut r = req(&[(":path", b"/api/x")]);
            if internal {
                r.headers.push(("x-internal".into(), b"1".to_vec()));
            }
            r.peer = Some(peer.into());
            matches(m, &r, 0)
        };
        assert!(at("10.1.2.3:1", false));
        assert!(
            at("[2001:db8::1]:1", true),
            "the `not` needs all of its conditions"
        );
        assert!(!at("11.1.2.3:1", false), "outside the networks");
        assert!(at("10.9.2.3:1", false));
        assert!(
            !at("10.9.2.3:1", true),
            "inside the negated network, with the header"
        );
        let mut r = req(&[(":path", b"/api/x")]);
        r.peer = None;
        assert!(
            !matches(m, &r, 0),
            "no address: a client_ip condition fails"
        );
        for (cfg, field) in [
            (r#"{"client_ip":[]}"#, "rules[0].match.client_ip"),
            (
                r#"{"client_ip":["10.0.0.0/40"]}"#,
                "rules[0].match.client_ip[0]",
            ),
            (r#"{"not":{}}"#, "rules[0].match.not"),
            (
                r#"{"not":{"not":{"path_prefix":"/"}}}"#,
                "rules[0].match.not.not",
            ),
        ] {
            let e = crate::core::config::Config::parse(
                format!(
                    r#"{{"service":{{"cluster":"c"}},"rules":[{{"name":"r","capacity":1,"period_ms":1,"match":{cfg}}}]}}"#
                )
                .as_bytes(),
            )
            .unwrap_err();
            assert_eq!(e.field, field, "{cfg}: {e}");
        }
    }

    #[test]
    fn prefix_methods_and_headers_all_must_hold() {
        let m = Match {
            path: Some(PathMatch::Prefix("/api/".into())),
            methods: vec!["GET".into(), "POST".into()],
            headers: vec![
                HeaderMatch::Present("x-tenant".into(), true),
                HeaderMatch::Equals("x-plan".into(), "free".into()),
                HeaderMatch::Present("x-internal".into(), false),
            ],
            ..Match::default()
        };
        let good: Vec<(&str, &[u8])> = vec![
            (":path", b"/api/v1"),
            (":method", b"POST"),
            ("x-tenant", b"t1"),
            ("x-plan", b"free"),
        ];
        assert!(matches(&m, &req(&good), 0));
        for (i, bad) in [
            (":path", &b"/apix"[..]),
            (":method", b"DELETE"),
            ("x-plan", b"Free"),
        ]
        .iter()
        .enumerate()
        {
            let mut h = good.clone();
            h.retain(|(n, _)| *n != bad.0);
            h.push(*bad);
            assert!(!matches(&m, &req(&h), 0), "case {i}");
        }
        let mut h = good.clone();
        h.push(("x-internal", b"1"));
        assert!(!matches(&m, &req(&h), 0));
        let mut h = good.clone();
        h.retain(|(n, _)| *n != "x-tenant");
        assert!(!matches(&m, &req(&h), 0));
    }

    #[test]
    fn empty_match_matches_everything() {
        assert!(matches(&Match::default(), &req(&[]), 0));
    }
}
