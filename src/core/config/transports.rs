//! What each transport carries: one table of the features a configuration may ask of its
//! transport ([`Feature`]), which of `http`, `grpc` and `rls` carries each, and why one does not.
//! The reader takes the defaults that depend on the transport from it ([`Transport::supports`]),
//! and refuses what the transport cannot carry ([`check`]: once `service` is read, a rule's kind
//! before the rule, its lease and charge after it; each field that asks), naming the field and
//! the transport.

use super::model::{ConfigError, Transport};

/// What a configuration may ask of its transport, by the field that asks for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feature {
    /// `service.stream`: every take a message on one stream per worker.
    Stream,
    /// `service.batch` above 0: several takes in one callout.
    Batch,
    /// `service.remember_denials_ms` above 0: a denial remembered until the bucket could pay.
    RememberDenials,
    /// `service.domain`: the RLS domain (required where it is carried).
    Domain,
    /// `kind: "concurrency"`: slots the service holds.
    Concurrency,
    /// `charge: "response"`: a settlement once the response ends.
    ChargeByResponse,
    /// `lease`: tokens granted in batches.
    Lease,
    /// `shape`: a take granted for a later moment, the request held until then.
    Shape,
    /// `from_request`: a limit read from the request, sent with the take.
    FromRequest,
    /// `calendar`: a calendar window, whose span the service computes.
    Calendar,
    /// `descriptor`: the rule's RLS descriptor (read by an RLS server; ignored elsewhere).
    Descriptor,
}

/// The transports in [`SUPPORT`]'s column order, by their names in `service.transport`.
pub const TRANSPORTS: [(&str, Transport); 3] = [
    ("http", Transport::Http),
    ("grpc", Transport::Grpc),
    ("rls", Transport::Rls),
];

/// Per feature: whether `http`, `grpc` and `rls` carry it, and why a transport that does not
/// cannot (said when more than one carries it; else the refusal names the one that does).
#[rustfmt::skip]
const SUPPORT: [(Feature, [bool; 3], &str); 11] = [
    //                            http   grpc   rls
    (Feature::Stream,           [false, true,  false], "takes stream over grpc only"),
    (Feature::Batch,            [true,  true,  false], "an RLS server takes one request at a time"),
    (Feature::RememberDenials,  [true,  true,  false], "another server's retry times are not known"),
    (Feature::Domain,           [false, false, true],  "an RLS domain"),
    (Feature::Concurrency,      [true,  true,  false], "\"concurrency\": an RLS server holds no slots"),
    (Feature::ChargeByResponse, [true,  true,  false], "\"response\": an RLS server settles nothing"),
    (Feature::Lease,            [true,  true,  false], "an RLS server grants no leases"),
    (Feature::Shape,            [true,  true,  false], "an RLS answer grants nothing for later"),
    (Feature::FromRequest,      [true,  true,  false], "an RLS server keeps its own limits"),
    (Feature::Calendar,         [true,  true,  false], "an RLS server keeps its own limits (its limits file's `unit`)"),
    (Feature::Descriptor,       [false, false, true],  "only an RLS server reads descriptors"),
];

impl Transport {
    /// Its name in `service.transport`.
    pub fn name(self) -> &'static str {
        TRANSPORTS
            .iter()
            .find(|(_, t)| *t == self)
            .map_or("", |(name, _)| name)
    }

    /// Whether it carries `feature`.
    pub fn supports(self, feature: Feature) -> bool {
        SUPPORT
            .iter()
            .find(|(f, _, _)| *f == feature)
            .and_then(|(_, by, _)| by.get(self as usize).copied())
            .unwrap_or(false)
    }
}

/// Refuses each of `asked` (whether it is asked, the feature, the field of `at` asking for it)
/// that `transport` does not carry: "only with transport X" for a feature one transport carries,
/// else "not available with transport Y (why)".
pub fn check<'a>(
    transport: Transport,
    at: &'a str,
    asked: &'a [(bool, Feature, &'a str)],
) -> impl Iterator<Item = ConfigError> + 'a {
    let refused = asked
        .iter()
        .filter(move |(asks, feature, _)| *asks && !transport.supports(*feature));
    refused.filter_map(move |&(_, feature, field)| {
        let (_, by, why) = SUPPORT.iter().find(|(f, _, _)| *f == feature)?;
        let carriers: Vec<&str> = TRANSPORTS
            .iter()
            .zip(by)
            .filter(|(_, carries)| **carries)
            .map(|((name, _), _)| *name)
            .collect();
        let message = match carriers.as_slice() {
            [only] => format!("only with transport {only}"),
            _ => format!("not available with transport {} ({why})", transport.name()),
        };
        Some(ConfigError {
            field: format!("{at}.{field}"),
            message,
        })
    })
}
