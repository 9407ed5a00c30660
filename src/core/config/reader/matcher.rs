//! A rule's `match` (paths, methods, headers, client networks, `not`) and its key parts.

use super::super::fields;
use super::super::model::*;
use super::obj::{header_name, is_token_char, Obj, Refusals};
use serde_json::Value;

/// A `match` (or, not `outer`, its `not`) at `at`: each condition read whatever the others'
/// refusals (`None`: one is refused).
pub(super) fn read_match(at: &str, v: &Value, outer: bool, refusals: &Refusals) -> Option<Match> {
    let table = if outer { fields::MATCH } else { fields::NOT };
    // Not an object: none of its conditions can be read.
    let m = Obj::new(Some(v), at, table, refusals)?;
    let path = match (m.string("path_exact"), m.string("path_prefix")) {
        (Some(Some(_)), Some(Some(_))) => m.refuse(
            "path_prefix",
            "path_exact and path_prefix exclude each other",
        ),
        (Some(Some(p)), Some(None)) => {
            if !p.starts_with('/') {
                m.refuse("path_exact", "must start with '/'")
            } else {
                Some(Some(PathMatch::Exact(p)))
            }
        }
        (Some(None), Some(Some(p))) => {
            if !p.starts_with('/') {
                m.refuse("path_prefix", "must start with '/'")
            } else {
                Some(Some(PathMatch::Prefix(p)))
            }
        }
        (Some(None), Some(None)) => Some(None),
        _ => None,
    };
    let methods = match m.array("methods") {
        None => None,
        Some(None) => Some(Vec::new()),
        Some(Some(ms)) if ms.is_empty() => {
            m.refuse("methods", "must not be empty (omit it to match any method)")
        }
        Some(Some(ms)) => {
            let mut methods = Vec::with_capacity(ms.len());
            for (k, method) in ms.iter().enumerate() {
                let method = method.as_str().unwrap_or_default();
                if method.is_empty() || method.len() > 32 || !method.bytes().all(is_token_char) {
                    refusals.refuse::<()>(
                        format!("{}[{k}]", m.path("methods")),
                        "must be an HTTP method",
                    );
                    continue;
                }
                methods.push(method.to_ascii_uppercase());
            }
            (methods.len() == ms.len()).then_some(methods)
        }
    };
    let headers = m.array("headers").map(|hs| {
        let hs = hs.map(Vec::as_slice).unwrap_or(&[]);
        let read: Vec<HeaderMatch> = hs
            .iter()
            .enumerate()
            .filter_map(|(k, h)| read_header(&format!("{}[{k}]", m.path("headers")), h, refusals))
            .collect();
        (read.len() == hs.len()).then_some(read)
    });
    let client_ip = match m.array("client_ip") {
        None => None,
        Some(None) => Some(Vec::new()),
        Some(Some(nets)) if nets.is_empty() || nets.len() > MAX_OVERRIDES => m.refuse(
            "client_ip",
            format!("must hold 1..={MAX_OVERRIDES} networks"),
        ),
        Some(Some(nets)) => {
            let mut client_ip = Vec::with_capacity(nets.len());
            for (k, n) in nets.iter().enumerate() {
                match n.as_str().and_then(Cidr::parse) {
                    Some(c) => client_ip.push(c),
                    None => {
                        refusals.refuse::<()>(
                            format!("{}[{k}]", m.path("client_ip")),
                            "must be an address with a prefix length, e.g. 10.0.0.0/8",
                        );
                    }
                }
            }
            (client_ip.len() == nets.len()).then_some(client_ip)
        }
    };
    let not = match m.get("not") {
        None => Some(None),
        Some(n) => match read_match(&m.path("not"), n, false, refusals) {
            Some(inner) if inner == Match::default() => {
                m.refuse("not", "must hold at least one condition")
            }
            inner => inner.map(|i| Some(Box::new(i))),
        },
    };
    Some(Match {
        path: path?,
        methods: methods?,
        headers: headers??,
        client_ip: client_ip?,
        not: not?,
    })
}

/// An entry of a `match`'s `headers`.
fn read_header(at: &str, v: &Value, refusals: &Refusals) -> Option<HeaderMatch> {
    let o = Obj::new(Some(v), at, fields::HEADER_MATCH, refusals)?;
    let name = o
        .text("name")
        .and_then(|n| header_name(&o.path("name"), &n, refusals));
    let present = match o.get("present") {
        None => Some(None),
        Some(Value::Bool(b)) => Some(Some(*b)),
        Some(_) => o.refuse("present", "must be true or false"),
    };
    let equals = o.string("equals");
    let (name, present, equals) = (name?, present?, equals?);
    match (present, equals) {
        (Some(p), None) => Some(HeaderMatch::Present(name, p)),
        (None, Some(v)) => Some(HeaderMatch::Equals(name, v)),
        _ => refusals.refuse(at, "needs exactly one of `present` or `equals`"),
    }
}

pub(super) fn parse_key_part(at: &str, p: &str, refusals: &Refusals) -> Option<KeyPart> {
    if let Some(lit) = p.strip_prefix("literal:") {
        if lit.len() > MAX_PART_BYTES {
            return refusals.refuse(at, "literal too long (at most 256 bytes)");
        }
        return Some(KeyPart::Literal(lit.to_string()));
    }
    if let Some(h) = p.strip_prefix("header:") {
        return Some(KeyPart::Header(header_name(at, h, refusals)?));
    }
    match p {
        "client_ip" => Some(KeyPart::ClientIp),
        "path" => Some(KeyPart::Path),
        "method" => Some(KeyPart::Method),
        "model" => Some(KeyPart::Model),
        "authority" => Some(KeyPart::Authority),
        _ => refusals.refuse(
            at,
            format!(
                "unknown key part {p:?} (expected literal:<text>, header:<name>, client_ip, path, method, authority or model)"
            ),
        ),
    }
}
