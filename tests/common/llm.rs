//! An upstream that answers like an LLM API: an OpenAI-style JSON completion, or the same as a
//! Server-Sent Events stream whose final event carries `usage`. Each request says what to do in its
//! headers, so one server serves every case of a test:
//!
//! - `x-llm-usage: N`: the tokens the response reports (default 100); prompt N/4, completion the rest;
//! - `x-llm-stream: 1`: stream it (`text/event-stream`, chunked), `x-llm-chunks: K` content events
//!   (default 4) `x-llm-chunk-ms: D` apart (default 0), then the usage event and `[DONE]`;
//! - `x-llm-report: body | header | none`: usage in the body (default), in the response header
//!   `x-usage-tokens` (the body then carries none), or nowhere;
//! - `x-llm-reset: before | after`: drop the connection mid-stream, before or after the usage event;
//! - `x-llm-format: anthropic`: stream as Anthropic's Messages API does: `message_start` carrying
//!   the input tokens (N/4, and 1 output token so far), `content_block_delta` events, then
//!   `message_delta` with the output tokens (the rest) and `message_stop`.
//!
//! It records what every response reported and whether it was sent whole ([`Llm::served`]).

use super::process::accept_on_free_port;
use super::upstream::{header_value as header, next_request};
use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

/// One response: the usage it reported (if any) and whether all of it reached the socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Served {
    pub usage: Option<u64>,
    pub whole: bool,
}

pub struct Llm {
    pub port: u16,
    state: Arc<State>,
}

#[derive(Default)]
struct State {
    stop: AtomicBool,
    served: Mutex<Vec<Served>>,
}

impl Llm {
    pub fn start() -> Llm {
        let state = Arc::new(State::default());
        let (st, stop) = (state.clone(), state.clone());
        let port = accept_on_free_port(
            "llm upstream",
            move || stop.stop.load(Ordering::SeqCst),
            move |conn| {
                let st = st.clone();
                thread::spawn(move || serve(conn, &st));
            },
        );
        Llm { port, state }
    }

    /// Every response so far, in the order they ended.
    pub fn served(&self) -> Vec<Served> {
        self.state
            .served
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default()
    }
}

impl Drop for Llm {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn serve(mut conn: TcpStream, st: &State) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let mut buf: Vec<u8> = Vec::new();
    while let Some((head, _)) = next_request(&mut conn, &mut buf, || false) {
        if !answer(&mut conn, &head, st) {
            return;
        }
    }
}

fn usage_json(n: u64) -> String {
    let prompt = n / 4;
    format!(
        r#"{{"prompt_tokens":{prompt},"completion_tokens":{},"total_tokens":{n}}}"#,
        n - prompt
    )
}

/// Answers one request as its headers ask; whether the connection stays usable.
fn answer(conn: &mut TcpStream, head: &str, st: &State) -> bool {
    let usage: u64 = header(head, "x-llm-usage")
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let report = header(head, "x-llm-report").unwrap_or("body").to_string();
    let stream = header(head, "x-llm-stream") == Some("1");
    let chunks: u64 = header(head, "x-llm-chunks")
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let gap = Duration::from_millis(
        header(head, "x-llm-chunk-ms")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
    );
    let reset = header(head, "x-llm-reset").map(str::to_string);
    let anthropic = header(head, "x-llm-format") == Some("anthropic");
    let in_body = report == "body";
    let reported = (report != "none").then_some(usage);
    let usage_header = if report == "header" {
        format!("x-usage-tokens: {usage}\r\n")
    } else {
        String::new()
    };
    let record = |whole: bool| {
        if let Ok(mut s) = st.served.lock() {
            s.push(Served {
                usage: reported,
                whole,
            });
        }
    };
    if !stream {
        let body = if in_body {
            format!(
                r#"{{"id":"cmpl-1","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"ok"}}}}],"usage":{}}}"#,
                usage_json(usage)
            )
        } else {
            r#"{"id":"cmpl-1","object":"chat.completion","choices":[]}"#.to_string()
        };
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n{usage_header}content-length: {}\r\n\r\n{body}",
            body.len()
        );
        let ok = conn.write_all(resp.as_bytes()).is_ok();
        record(ok);
        return ok;
    }
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n{usage_header}transfer-encoding: chunked\r\n\r\n"
    );
    let send = |conn: &mut TcpStream, data: &str| {
        let event = format!("data: {data}\n\n");
        let framed = format!("{:x}\r\n{event}\r\n", event.len());
        conn.write_all(framed.as_bytes())
            .and_then(|()| conn.flush())
    };
    if conn.write_all(head.as_bytes()).is_err() {
        record(false);
        return false;
    }
    let prompt = usage / 4;
    if anthropic && in_body {
        let start = format!(
            r#"{{"type":"message_start","message":{{"id":"msg_1","type":"message","role":"assistant","content":[],"usage":{{"input_tokens":{prompt},"output_tokens":1}}}}}}"#
        );
        if send(conn, &start).is_err() {
            record(false);
            return false;
        }
    }
    for i in 0..chunks {
        let content = if anthropic {
            format!(
                r#"{{"type":"content_block_delta","index":0,"delta":{{"type":"text_delta","text":"t{i}"}}}}"#
            )
        } else {
            format!(
                r#"{{"id":"c","object":"chat.completion.chunk","choices":[{{"index":0,"delta":{{"content":"t{i}"}}}}],"usage":null}}"#
            )
        };
        if send(conn, &content).is_err() {
            record(false);
            return false;
        }
        thread::sleep(gap);
    }
    if reset.as_deref() == Some("before") {
        record(false);
        let _ = conn.shutdown(std::net::Shutdown::Both);
        return false;
    }
    if in_body {
        let last = if anthropic {
            format!(
                r#"{{"type":"message_delta","delta":{{"stop_reason":"end_turn"}},"usage":{{"output_tokens":{}}}}}"#,
                usage - prompt
            )
        } else {
            format!(
                r#"{{"id":"c","object":"chat.completion.chunk","choices":[],"usage":{}}}"#,
                usage_json(usage)
            )
        };
        if send(conn, &last).is_err() {
            record(false);
            return false;
        }
    }
    if reset.as_deref() == Some("after") {
        thread::sleep(Duration::from_millis(50));
        record(false);
        let _ = conn.shutdown(std::net::Shutdown::Both);
        return false;
    }
    let end = if anthropic {
        r#"{"type":"message_stop"}"#
    } else {
        "[DONE]"
    };
    let ok = send(conn, end).is_ok() && conn.write_all(b"0\r\n\r\n").is_ok();
    record(ok);
    ok
}
