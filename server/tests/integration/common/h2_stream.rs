//! `TakeStream` streams over a bare HTTP/2 connection (the `h2` crate), for what a gRPC client
//! will not send: a message's bytes in parts, a length prefix with less behind it, bytes trickled.
//! Answers are read back as they come, then the stream's status.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use axum::body::Bytes;
use axum::http::{HeaderMap, Request};
use h2::client::SendRequest;
use prost::Message;
use tokio::net::TcpStream;
use tollgate_server::api::grpc::pb;
use tonic::{Code, Status};

const PATH: &str = "/tollgate.v1.RateLimiter/TakeStream";

/// An HTTP/2 connection to `addr`, driven by a task of its own.
pub async fn connect(addr: &str) -> SendRequest<Bytes> {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    tcp.set_nodelay(true).unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.expect("HTTP/2 handshake");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

/// `message` framed as gRPC frames a message: flag 0, its length, its bytes.
pub fn framed(message: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(5 + message.len());
    out.push(0);
    out.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    out.extend_from_slice(message);
    Bytes::from(out)
}

/// A length prefix announcing a message of `len` bytes, none of which follow.
pub fn prefix(len: u32) -> Bytes {
    let mut out = vec![0];
    out.extend_from_slice(&len.to_be_bytes());
    Bytes::from(out)
}

/// One open stream.
pub struct H2Stream {
    send: h2::SendStream<Bytes>,
    response: Option<h2::client::ResponseFuture>,
    body: Option<h2::RecvStream>,
    /// Answer bytes received and not yet a whole answer.
    buf: Vec<u8>,
    /// The status the response's headers carried (a stream refused as it opened).
    early: Option<Status>,
}

impl H2Stream {
    /// Opens a stream on `client` (waiting for a free stream slot of the connection).
    pub async fn open(client: &SendRequest<Bytes>, token: Option<&str>) -> Result<Self, h2::Error> {
        let mut ready = client.clone().ready().await?;
        let mut req = Request::builder()
            .method("POST")
            .uri(format!("http://tollgate{PATH}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers");
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let (response, send) = ready.send_request(req.body(()).unwrap(), false)?;
        Ok(H2Stream {
            send,
            response: Some(response),
            body: None,
            buf: Vec::new(),
            early: None,
        })
    }

    /// Queues `bytes` on the stream (h2 sends them as the flow-control windows allow); an error
    /// once the stream was ended or reset.
    pub fn send(&mut self, bytes: Bytes) -> Result<(), h2::Error> {
        self.send.send_data(bytes, false)
    }

    /// Sends `m` as one framed message.
    pub fn send_message(&mut self, m: &pb::TakeBatchRequest) {
        self.send(framed(&m.encode_to_vec()))
            .expect("the stream is open");
    }

    /// Ends the client's side.
    pub fn half_close(&mut self) {
        let _ = self.send.send_data(Bytes::new(), true);
    }

    /// The next answer, `Ok(None)` once the stream ended `OK`, or the status it ended with.
    /// Cancel-safe (it may lose a race against a timer and be called again).
    pub async fn next(&mut self) -> Result<Option<pb::TakeBatchResponse>, Status> {
        if let Some(response) = self.response.as_mut() {
            let response = response
                .await
                .map_err(|e| Status::unknown(format!("response: {e}")))?;
            self.response = None;
            self.early = Status::from_header_map(response.headers());
            self.body = Some(response.into_body());
        }
        if let Some(s) = self.early.take() {
            return ended(s);
        }
        loop {
            if let Some(answer) = take_answer(&mut self.buf) {
                return Ok(Some(answer));
            }
            let body = self.body.as_mut().expect("a body");
            match body.data().await {
                Some(Ok(data)) => {
                    let _ = body.flow_control().release_capacity(data.len());
                    self.buf.extend_from_slice(&data);
                }
                Some(Err(e)) => return Err(Status::unknown(format!("body: {e}"))),
                None => break,
            }
        }
        let body = self.body.as_mut().expect("a body");
        let trailers: Option<HeaderMap> = body
            .trailers()
            .await
            .map_err(|e| Status::unknown(format!("trailers: {e}")))?;
        let status = trailers
            .as_ref()
            .and_then(Status::from_header_map)
            .unwrap_or_else(|| Status::unknown("no grpc-status"));
        ended(status)
    }
}

/// A whole answer from the front of `buf`, if it holds one.
fn take_answer(buf: &mut Vec<u8>) -> Option<pb::TakeBatchResponse> {
    let len = u32::from_be_bytes(buf.get(1..5)?.try_into().unwrap()) as usize;
    if buf.len() < 5 + len {
        return None;
    }
    let answer = pb::TakeBatchResponse::decode(&buf[5..5 + len]).expect("an answer");
    buf.drain(..5 + len);
    Some(answer)
}

fn ended(s: Status) -> Result<Option<pb::TakeBatchResponse>, Status> {
    if s.code() == Code::Ok {
        Ok(None)
    } else {
        Err(s)
    }
}
