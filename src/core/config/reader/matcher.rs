//! A rule's `match` (paths, methods, headers, client networks, `not`) and its key parts.

use super::super::fields;
use super::super::model::*;
use super::obj::{err, header_name, is_token_char, Obj};
use serde_json::Value;

pub(super) fn read_match(at: &str, v: &Value, outer: bool) -> Result<Match, ConfigError> {
    let table = if outer { fields::MATCH } else { fields::NOT };
    let m = Obj::new(Some(v), at, table)?;
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
        let o = Obj::new(Some(h), &hat, fields::HEADER_MATCH)?;
        let name = header_name(&o.path("name"), &o.text("name")?)?;
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

pub(super) fn parse_key_part(at: &str, p: &str) -> Result<KeyPart, ConfigError> {
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
