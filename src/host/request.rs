//! What the adapter reads of a request for the core: first only the headers the rules' match
//! conditions name (a request no rule matches is passed after that), then what the rules can read
//! (by name, or the whole header map), the peer address when a rule needs it, and the dynamic
//! metadata the rules' `from_request` reads.

use super::abi::{Abi, HeaderMap};
use crate::core::config::{Config, HeaderMatch, ModelSource};
use crate::core::rules::{keys, matches_headers, Headers, Request};

/// What a configuration's requests are read for, worked out once when it loads.
pub(super) struct Reads {
    /// The headers whose first values decide whether any rule matches; `None` when some rule
    /// matches every request. Lets a request no rule matches be passed after reading only these.
    pub(super) match_headers: Option<Vec<String>>,
    /// The headers the rules can read, each read by name for a request some rule may match;
    /// `None`: the whole header map is read (a rule needs every value of a header, or reads so
    /// many that one read of the map is cheaper).
    pub(super) request_headers: Option<Vec<String>>,
    /// The properties the rules' `from_request` read (dynamic metadata), each read once per
    /// request some rule may match.
    pub(super) properties: Vec<Vec<String>>,
}

impl Reads {
    /// What `cfg`'s rules read.
    pub(super) fn of(cfg: &Config) -> Reads {
        Reads {
            match_headers: match_headers(cfg),
            request_headers: request_headers(cfg),
            properties: {
                let mut paths = Vec::new();
                for r in &cfg.rules {
                    keys::properties_read(r, &mut paths);
                }
                if let Some(ModelSource::Metadata(p)) = &cfg.model {
                    if !paths.contains(p) {
                        paths.push(p.clone());
                    }
                }
                paths
            },
        }
    }
}

/// The header names the rules' match conditions read, or `None` if a rule matches everything.
pub(super) fn match_headers(cfg: &Config) -> Option<Vec<String>> {
    let mut names: Vec<String> = Vec::new();
    let mut add = |n: &str| {
        if !names.iter().any(|x| x == n) {
            names.push(n.to_string());
        }
    };
    for r in &cfg.rules {
        let m = &r.matcher;
        // A rule for every request, or one whose conditions read the client address or negate
        // (a partial view of the request could not tell): read the request whole.
        if (m.path.is_none() && m.methods.is_empty() && m.headers.is_empty())
            || m.reads_client_ip()
            || m.not.is_some()
        {
            return None;
        }
        if m.path.is_some() {
            add(":path");
        }
        if !m.methods.is_empty() {
            add(":method");
        }
        for h in &m.headers {
            match h {
                HeaderMatch::Present(n, _) | HeaderMatch::Equals(n, _) => add(n),
            }
        }
    }
    Some(names)
}

/// The headers `match_headers` names, as read for one request (`values[i]` is `names[i]`'s).
struct Probe<'a> {
    names: &'a [String],
    values: &'a [Option<Vec<u8>>],
}

impl Headers for Probe<'_> {
    fn first(&self, name: &str) -> Option<&[u8]> {
        let i = self.names.iter().position(|n| n == name)?;
        self.values.get(i)?.as_deref()
    }
}

/// Whether some rule may match, reading only the headers the conditions name into `values`, which
/// is kept from request to request: the only allocations are the host's copies of the values.
pub(super) fn may_match(
    abi: &impl Abi,
    cfg: &Config,
    reads: &Reads,
    values: &mut Vec<Option<Vec<u8>>>,
) -> bool {
    let Some(names) = &reads.match_headers else {
        return true;
    };
    values.clear();
    values.extend(names.iter().map(|n| abi.header(HeaderMap::Request, n)));
    let view = Probe { names, values };
    // `match_headers` is `None` when a condition reads the client address: not here.
    cfg.rules.iter().any(|r| matches_headers(&r.matcher, &view))
}

/// Most headers read one by one; a configuration whose rules read more gets the whole map in one
/// host call instead.
const MAX_HEADERS_BY_NAME: usize = 8;

/// The headers [`read_request`] reads by name ([`keys::headers_read`] over every rule), or `None`
/// for the whole map.
fn request_headers(cfg: &Config) -> Option<Vec<String>> {
    let mut names = Vec::new();
    for r in &cfg.rules {
        if !keys::headers_read(r, cfg.trusted_hops, &mut names) {
            return None;
        }
    }
    (names.len() <= MAX_HEADERS_BY_NAME).then_some(names)
}

/// What the core reads of a request: the headers its rules can read (by name, or the whole map),
/// and the peer address when a rule needs it.
///
/// `probed` holds what [`may_match`] read (the match headers' values, in their order): those are
/// taken from it rather than asked of the host again (a header read is a host call that calls
/// back into the module to copy the value: on a request that matches, reading `:path` twice was
/// one such round trip too many).
pub(super) fn read_request(
    abi: &impl Abi,
    cfg: &Config,
    reads: &Reads,
    probed: &mut [Option<Vec<u8>>],
) -> Request {
    let headers = match &reads.request_headers {
        Some(names) => names
            .iter()
            .filter_map(|n| {
                let at = reads
                    .match_headers
                    .as_ref()
                    .and_then(|m| m.iter().position(|x| x == n));
                let value = match at.and_then(|i| probed.get_mut(i)) {
                    Some(read) => read.take(),
                    None => abi.header(HeaderMap::Request, n),
                };
                value.map(|v| (n.clone(), v))
            })
            .collect(),
        None => abi.headers(HeaderMap::Request).unwrap_or_default(),
    };
    let peer = if cfg.needs_peer_address {
        abi.property(&["source", "address"])
            .and_then(|b| String::from_utf8(b).ok())
    } else {
        None
    };
    let properties: Vec<(Vec<String>, Vec<u8>)> = reads
        .properties
        .iter()
        .filter_map(|path| {
            let parts: Vec<&str> = path.iter().map(String::as_str).collect();
            abi.property(&parts).map(|v| (path.clone(), v))
        })
        .collect();
    // A header a gateway set, or metadata a filter in front wrote; the body's model is read by
    // the flow, before the request is decided.
    let model = match &cfg.model {
        Some(ModelSource::Header(name)) => abi.header(HeaderMap::Request, name),
        Some(ModelSource::Metadata(path)) => properties
            .iter()
            .find(|(p, _)| p == path)
            .map(|(_, v)| v.clone()),
        _ => None,
    }
    .and_then(|v| String::from_utf8(v).ok())
    .filter(|m| !m.is_empty() && m.len() <= crate::core::rules::model::MAX_MODEL_BYTES);
    Request {
        headers,
        peer,
        properties,
        model,
        end_of_stream: false,
    }
}
