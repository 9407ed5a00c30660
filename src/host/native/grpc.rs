//! gRPC over the HTTP/2 streams and callouts a dynamic module has: Envoy's dynamic module ABI
//! offers plain HTTP callouts and streams to a cluster, no gRPC client, so the adapter speaks
//! gRPC's framing itself (a message is a 5-byte prefix, flag 0 and a big-endian length, then the
//! protobuf bytes; the status is the `grpc-status` header or trailer).

use contract::bounds::MAX_ANSWER_BYTES;

/// gRPC's status codes the adapter reports for what is not the service's own status.
#[cfg_attr(not(feature = "dynamic-module"), allow(dead_code))]
pub mod status {
    /// Nothing went wrong.
    pub const OK: u32 = 0;
    /// An answer the adapter could not read (a malformed frame, a status it could not parse).
    pub const UNKNOWN: u32 = 2;
    /// The answer was larger than Envoy buffers for a callout.
    pub const RESOURCE_EXHAUSTED: u32 = 8;
    /// The stream or call was reset, the connection failed or the timeout passed.
    pub const UNAVAILABLE: u32 = 14;
}

/// `message` framed: the 5-byte prefix (not compressed, its length big-endian), then the bytes.
pub fn frame(message: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + message.len());
    out.push(0);
    out.extend_from_slice(
        &u32::try_from(message.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    out.extend_from_slice(message);
    out
}

/// Why frames could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameError {
    /// A compressed message (never asked for), or one longer than any valid answer.
    Refused,
}

/// A stream's bytes, turned into whole messages as they arrive (a frame may come in pieces, or
/// several in one piece). It keeps at most one frame's bytes.
#[derive(Default)]
pub struct Deframer {
    partial: Vec<u8>,
}

impl Deframer {
    /// Adds `bytes`, and hands each whole message to `each`, oldest first.
    pub fn push(&mut self, bytes: &[u8], mut each: impl FnMut(&[u8])) -> Result<(), FrameError> {
        self.partial.extend_from_slice(bytes);
        let mut at = 0;
        let result = loop {
            let Some(&[flag, a, b, c, d]) = self.partial.get(at..at + 5) else {
                break Ok(());
            };
            let len = u32::from_be_bytes([a, b, c, d]) as usize;
            if flag != 0 || len > MAX_ANSWER_BYTES {
                break Err(FrameError::Refused);
            }
            let Some(message) = self.partial.get(at + 5..at + 5 + len) else {
                break Ok(());
            };
            each(message);
            at += 5 + len;
        };
        if result.is_err() {
            self.partial.clear();
        } else {
            self.partial.drain(..at);
        }
        result
    }
}

/// The cluster a gRPC callout goes to: `service` is what the core hands the host, a serialised
/// `GrpcService { envoy_grpc: EnvoyGrpc { cluster_name } }` (`core::wire::callout::grpc_service`)
/// or a plain cluster name.
pub fn cluster_of(service: &[u8]) -> Option<String> {
    fn field1(b: &[u8]) -> Option<&[u8]> {
        let (&tag, mut rest) = b.split_first()?;
        if tag != 0x0a {
            return None;
        }
        let mut len = 0usize;
        let mut shift = 0;
        loop {
            let (&byte, r) = rest.split_first()?;
            rest = r;
            len |= usize::from(byte & 0x7f).checked_shl(shift)?;
            if byte & 0x80 == 0 {
                break;
            }
            shift += 7;
            if shift > 28 {
                return None;
            }
        }
        (rest.len() == len).then_some(rest)
    }
    let name = field1(service).and_then(field1).unwrap_or(service);
    let name = std::str::from_utf8(name).ok()?;
    (!name.is_empty()).then(|| name.to_string())
}

/// The gRPC status a response's headers (or trailers) carry: `grpc-status` if present, else, for
/// response headers with an HTTP status other than 200, what gRPC maps it to (Unavailable for a
/// gateway's 502/503/504, Unknown otherwise). `None`: the headers say nothing (the status comes
/// in the trailers).
pub fn status_of<'a>(headers: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) -> Option<u32> {
    let mut http = None;
    for (name, value) in headers {
        match name {
            b"grpc-status" => {
                return Some(
                    std::str::from_utf8(value)
                        .ok()
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(status::UNKNOWN),
                )
            }
            b":status" => http = std::str::from_utf8(value).ok()?.parse::<u32>().ok(),
            _ => {}
        }
    }
    match http {
        None | Some(200) => None,
        Some(502..=504) => Some(status::UNAVAILABLE),
        Some(_) => Some(status::UNKNOWN),
    }
}

/// A unary call's outcome from its whole response (headers and body; Envoy's callout hands no
/// trailers): the status, and the message when it is 0.
pub fn unary_answer<'a>(
    headers: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
    body: &[u8],
) -> (u32, Vec<u8>) {
    if let Some(s) = status_of(headers) {
        if s != status::OK {
            return (s, Vec::new());
        }
    }
    let mut first = None;
    let mut d = Deframer::default();
    let read = d.push(body, |m| {
        if first.is_none() {
            first = Some(m.to_vec());
        }
    });
    match (read, first) {
        (Ok(()), Some(m)) => (status::OK, m),
        _ => (status::UNKNOWN, Vec::new()),
    }
}

/// Whether a response is Envoy's own for a call that never reached the service (its router
/// found no connection: `upstream connect error ...`, `no healthy upstream`), which may go again.
/// A gRPC request gets that answer as gRPC: `grpc-status: 14` and the text as `grpc-message`.
pub fn unconnected(headers: &[(Vec<u8>, Vec<u8>)], body: &[u8]) -> bool {
    let header = |name: &[u8]| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_slice())
    };
    let envoys = |text: &[u8]| {
        text.starts_with(b"upstream connect error") || text.starts_with(b"no healthy upstream")
    };
    match header(b"grpc-status") {
        Some(b"14") => header(b"grpc-message").is_some_and(envoys),
        Some(_) => false,
        None => header(b":status") == Some(b"503") && envoys(body),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::wire::callout::grpc_service;

    #[test]
    fn frames_arrive_split_and_joined() {
        let mut bytes = frame(b"one");
        bytes.extend(frame(b""));
        bytes.extend(frame(&[7u8; 300]));
        let mut d = Deframer::default();
        let mut got: Vec<Vec<u8>> = Vec::new();
        for piece in bytes.chunks(4) {
            assert_eq!(d.push(piece, |m| got.push(m.to_vec())), Ok(()));
        }
        assert_eq!(got, vec![b"one".to_vec(), Vec::new(), vec![7u8; 300]]);
        assert!(d.partial.is_empty());
    }

    #[test]
    fn a_frame_longer_than_any_answer_is_refused_and_forgotten() {
        let mut d = Deframer::default();
        let mut head = vec![0u8];
        head.extend_from_slice(
            &u32::try_from(MAX_ANSWER_BYTES + 1)
                .unwrap_or(0)
                .to_be_bytes(),
        );
        assert_eq!(d.push(&head, |_| {}), Err(FrameError::Refused));
        assert!(d.partial.is_empty());
        assert_eq!(
            d.push(&[1, 0, 0, 0, 1, 9], |_| {}),
            Err(FrameError::Refused)
        );
    }

    #[test]
    fn the_cluster_is_read_from_the_service_the_core_serialises() {
        assert_eq!(
            cluster_of(&grpc_service("tollgate")).as_deref(),
            Some("tollgate")
        );
        let long = "c".repeat(200);
        assert_eq!(cluster_of(&grpc_service(&long)), Some(long));
        assert_eq!(cluster_of(b"plain").as_deref(), Some("plain"));
        assert_eq!(cluster_of(b""), None);
    }

    #[test]
    fn a_unary_answer_is_its_first_message_or_its_status() {
        let ok: [(&[u8], &[u8]); 1] = [(b":status", b"200")];
        assert_eq!(unary_answer(ok, &frame(b"m")), (0, b"m".to_vec()));
        let only: [(&[u8], &[u8]); 2] = [(b":status", b"200"), (b"grpc-status", b"14")];
        assert_eq!(unary_answer(only, b""), (14, Vec::new()));
        let gateway: [(&[u8], &[u8]); 1] = [(b":status", b"503")];
        assert_eq!(
            unary_answer(gateway, b""),
            (status::UNAVAILABLE, Vec::new())
        );
        assert_eq!(unary_answer(ok, b"\0\0\0"), (status::UNKNOWN, Vec::new()));
    }

    #[test]
    fn only_envoys_own_connect_failures_go_again() {
        let h = |status: &[u8]| vec![(b":status".to_vec(), status.to_vec())];
        assert!(unconnected(
            &h(b"503"),
            b"upstream connect error or disconnect/reset before headers. reset reason: connection failure"
        ));
        assert!(unconnected(&h(b"503"), b"no healthy upstream"));
        assert!(!unconnected(
            &h(b"503"),
            br#"{"error":"redis unavailable"}"#
        ));
        assert!(!unconnected(&h(b"200"), b"upstream connect error"));
        let grpc = |status: &[u8], message: &[u8]| {
            vec![
                (b":status".to_vec(), b"200".to_vec()),
                (b"grpc-status".to_vec(), status.to_vec()),
                (b"grpc-message".to_vec(), message.to_vec()),
            ]
        };
        assert!(unconnected(
            &grpc(b"14", b"upstream connect error or disconnect/reset before headers. reset reason: remote connection failure"),
            b""
        ));
        assert!(!unconnected(&grpc(b"14", b"shed: at the take limit"), b""));
        assert!(!unconnected(&grpc(b"8", b"no healthy upstream"), b""));
    }
}
