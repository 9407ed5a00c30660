//! What a response says it used: the token counts LLM APIs report, read from the body as it
//! streams past, in bounded memory.
//!
//! Two body formats:
//! - **JSON** (`Format::Json`): one object, as an OpenAI chat completion or an Anthropic message
//!   answers; its top-level `usage` object is the report.
//! - **Server-Sent Events** (`Format::Sse`): a stream of `data:` events, each a JSON object. A
//!   report is the top-level `usage` object of an event, or the `usage` of its top-level `message`
//!   (Anthropic's `message_start`). Reports are merged count by count, the later one winning:
//!   OpenAI sends one, in the final chunk, when asked with `stream_options.include_usage` (earlier
//!   chunks carry `"usage": null`); Anthropic sends the input tokens in `message_start` and the
//!   (cumulative) output tokens in `message_delta`, and both are charged.
//!
//! Prompt tokens are `prompt_tokens` (OpenAI's count includes cached tokens), or Anthropic's
//! `input_tokens` plus `cache_creation_input_tokens` and `cache_read_input_tokens` (which its
//! `input_tokens` leaves out). Fixtures of each provider's format are in `usage/fixtures/`.
//!
//! The reader is fed the body in whatever pieces Envoy hands over and never keeps more than
//! [`MAX_USAGE_BYTES`] of it: a byte-at-a-time tokenizer tracks only nesting depth, string state
//! and the current key at the levels it reads, and copies out nothing but the `usage` object
//! itself. A body that is not JSON, or a `usage` object larger than the bound, reports nothing
//! (the caller's estimate stands). How the bytes are split never changes the result (a property
//! test checks it).

use crate::core::config::Weights;
use serde_json::Value;

/// Largest `usage` object kept (bytes); a larger one is ignored.
pub const MAX_USAGE_BYTES: usize = 4096;

/// Longest top-level key compared against `usage` (longer keys are skipped without copying).
const MAX_KEY: usize = 8;

/// Longest SSE field name kept (`data`, `event`, `id`, `retry` all fit).
const MAX_FIELD: usize = 8;

/// How the response body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// One JSON object.
    Json,
    /// `text/event-stream`: `data:` events, each one JSON object.
    Sse,
}

/// The counts of one `usage` report (or of several, merged). Field names of both OpenAI
/// (`prompt_tokens`, `completion_tokens`, `total_tokens`) and Anthropic (`input_tokens`,
/// `cache_creation_input_tokens`, `cache_read_input_tokens`, `output_tokens`) are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Tokens of the prompt (`prompt_tokens` or `input_tokens`).
    pub prompt: Option<u64>,
    /// Prompt tokens written to Anthropic's cache (`cache_creation_input_tokens`).
    pub cache_write: Option<u64>,
    /// Prompt tokens read from Anthropic's cache (`cache_read_input_tokens`).
    pub cache_read: Option<u64>,
    /// Tokens generated (`completion_tokens` or `output_tokens`).
    pub completion: Option<u64>,
    /// `total_tokens`.
    pub total: Option<u64>,
}

impl Usage {
    fn from_object(bytes: &[u8]) -> Option<Usage> {
        let v: Value = serde_json::from_slice(bytes).ok()?;
        let obj = v.as_object()?;
        let field = |names: &[&str]| names.iter().find_map(|n| obj.get(*n)?.as_u64());
        let u = Usage {
            prompt: field(&["prompt_tokens", "input_tokens"]),
            cache_write: field(&["cache_creation_input_tokens"]),
            cache_read: field(&["cache_read_input_tokens"]),
            completion: field(&["completion_tokens", "output_tokens"]),
            total: field(&["total_tokens"]),
        };
        (u != Usage::default()).then_some(u)
    }

    /// `self` updated by a later report: each count it carries replaces the earlier one (the
    /// providers' counts are cumulative).
    fn then(self, later: Usage) -> Usage {
        Usage {
            prompt: later.prompt.or(self.prompt),
            cache_write: later.cache_write.or(self.cache_write),
            cache_read: later.cache_read.or(self.cache_read),
            completion: later.completion.or(self.completion),
            total: later.total.or(self.total),
        }
    }

    /// Every prompt token: `prompt` and both cache counts (each absent one as 0); `None` when
    /// none is reported.
    fn prompt_tokens(&self) -> Option<u64> {
        let parts = [self.prompt, self.cache_write, self.cache_read];
        parts.iter().any(Option::is_some).then(|| {
            parts
                .iter()
                .map(|p| p.unwrap_or(0))
                .fold(0, u64::saturating_add)
        })
    }

    /// The amount to charge: weighted prompt and completion tokens when `weights` is given and
    /// either count is reported; otherwise `total_tokens`, or else prompt + completion.
    pub fn tokens(&self, weights: Option<Weights>) -> Option<u64> {
        let (p, c) = (self.prompt_tokens(), self.completion);
        if let Some(w) = weights {
            if p.is_some() || c.is_some() {
                let p = p.unwrap_or(0).saturating_mul(w.prompt);
                return Some(p.saturating_add(c.unwrap_or(0).saturating_mul(w.completion)));
            }
        }
        self.total.or_else(|| Some(p?.saturating_add(c?)))
    }
}

/// A streaming scan of one JSON document for its reports: the top-level `usage` object, and the
/// `usage` object of a top-level `message` object. Keys are read at those two levels only.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct JsonScan {
    depth: u32,
    /// Whether the document (depth 1) is an object; only then are its keys read.
    top_object: bool,
    /// Whether any non-whitespace byte was seen (the first one decides `top_object`).
    started: bool,
    in_string: bool,
    escape: bool,
    /// At a keyed level the next string is a key.
    expect_key: bool,
    reading_key: bool,
    key: [u8; MAX_KEY],
    key_len: usize,
    key_long: bool,
    /// The last key read at a keyed level was `usage` and its value has not started yet.
    usage_next: bool,
    /// The last key read at depth 1 was `message` and its value has not started yet.
    message_next: bool,
    /// Inside the top-level `message` object (depth 2 is keyed).
    in_message: bool,
    capturing: bool,
    /// The depth the captured `usage` object was opened at (it ends back there).
    capture_at: u32,
    capture: Vec<u8>,
    capture_long: bool,
    found: Option<Usage>,
}

impl JsonScan {
    /// Whether keys are read at the current depth.
    fn keyed(&self) -> bool {
        self.top_object && (self.depth == 1 || (self.depth == 2 && self.in_message))
    }

    fn feed(&mut self, b: u8) {
        if self.capturing {
            if self.capture.len() < MAX_USAGE_BYTES {
                self.capture.push(b);
            } else {
                self.capture_long = true;
            }
        }
        if self.in_string {
            if self.escape {
                self.escape = false;
            } else if b == b'\\' {
                self.escape = true;
            } else if b == b'"' {
                self.in_string = false;
                if self.reading_key {
                    self.reading_key = false;
                    let key = if self.key_long {
                        None
                    } else {
                        self.key.get(..self.key_len)
                    };
                    self.usage_next = key == Some(b"usage");
                    self.message_next = self.depth == 1 && key == Some(b"message");
                }
                return;
            }
            if self.reading_key {
                match self.key.get_mut(self.key_len) {
                    Some(slot) => {
                        *slot = b;
                        self.key_len += 1;
                    }
                    None => self.key_long = true,
                }
            }
            return;
        }
        if b.is_ascii_whitespace() {
            return;
        }
        if !self.started {
            self.started = true;
            self.top_object = b == b'{';
        }
        let keyed = self.keyed();
        match b {
            b'"' => {
                self.in_string = true;
                if keyed && self.expect_key {
                    self.expect_key = false;
                    self.reading_key = true;
                    self.key_len = 0;
                    self.key_long = false;
                } else if keyed {
                    self.value_started();
                }
            }
            b'{' | b'[' => {
                if keyed {
                    if self.usage_next && b == b'{' && !self.capturing {
                        self.capturing = true;
                        self.capture_at = self.depth;
                        self.capture.clear();
                        self.capture.push(b);
                        self.capture_long = false;
                    }
                    if self.message_next && b == b'{' {
                        self.in_message = true;
                    }
                    self.value_started();
                }
                self.depth = self.depth.saturating_add(1);
                if self.keyed() && b == b'{' {
                    self.expect_key = true;
                }
            }
            b'}' | b']' => {
                self.depth = self.depth.saturating_sub(1);
                if self.capturing && self.depth == self.capture_at {
                    self.capturing = false;
                    if !self.capture_long {
                        if let Some(u) = Usage::from_object(&self.capture) {
                            self.found = Some(self.found.unwrap_or_default().then(u));
                        }
                    }
                    self.capture = Vec::new();
                }
                if self.depth <= 1 {
                    self.in_message = false;
                }
            }
            b',' if keyed => {
                self.expect_key = true;
                self.value_started();
            }
            b':' => {}
            _ if keyed => self.value_started(),
            _ => {}
        }
    }

    /// A value (or the next member) began at a keyed level: a key read before no longer waits.
    fn value_started(&mut self) {
        self.usage_next = false;
        self.message_next = false;
    }

    /// The document's report, if it had one; the scan starts over for the next document.
    fn take(&mut self) -> Option<Usage> {
        let found = self.found.take();
        *self = JsonScan::default();
        found
    }
}

/// Reads a response body as it streams and keeps the last usage report it contained.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageReader {
    format: Format,
    json: JsonScan,
    /// SSE: no byte of the current line seen yet.
    line_start: bool,
    /// SSE: the previous byte was `\r` (a following `\n` belongs to the same line end).
    after_cr: bool,
    field: [u8; MAX_FIELD],
    field_len: usize,
    field_long: bool,
    /// SSE: past the line's `:`.
    in_value: bool,
    /// SSE: the line is a `data:` line.
    is_data: bool,
    /// SSE: the single space after `:` is not part of the value.
    skip_space: bool,
    /// SSE: the current event has data (a second data line adds a newline first).
    event_has_data: bool,
    last: Option<Usage>,
}

impl UsageReader {
    /// A reader for a body in `format`.
    pub fn new(format: Format) -> UsageReader {
        UsageReader {
            format,
            json: JsonScan::default(),
            line_start: true,
            after_cr: false,
            field: [0; MAX_FIELD],
            field_len: 0,
            field_long: false,
            in_value: false,
            is_data: false,
            skip_space: false,
            event_has_data: false,
            last: None,
        }
    }

    /// The next piece of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        match self.format {
            Format::Json => chunk.iter().for_each(|&b| self.json.feed(b)),
            Format::Sse => chunk.iter().for_each(|&b| self.sse_byte(b)),
        }
    }

    /// The body ended: the last report seen, if any. An SSE event cut off without its closing
    /// blank line still counts (some servers end the stream right after the last event).
    pub fn finish(&mut self) -> Option<Usage> {
        match self.format {
            Format::Json => self.json.take(),
            Format::Sse => {
                self.end_event();
                self.last
            }
        }
    }

    /// The reports seen so far, merged (what a stream cut off now would be settled with).
    pub fn so_far(&self) -> Option<Usage> {
        match (self.format, self.last, self.json.found) {
            (Format::Json, _, found) => found,
            (Format::Sse, Some(last), Some(found)) => Some(last.then(found)),
            (Format::Sse, last, found) => last.or(found),
        }
    }

    fn end_event(&mut self) {
        if self.event_has_data {
            if let Some(u) = self.json.take() {
                self.last = Some(self.last.unwrap_or_default().then(u));
            }
            self.event_has_data = false;
        }
    }

    fn sse_byte(&mut self, b: u8) {
        let after_cr = std::mem::replace(&mut self.after_cr, false);
        if b == b'\n' && after_cr {
            return;
        }
        if b == b'\r' || b == b'\n' {
            self.after_cr = b == b'\r';
            if self.line_start {
                self.end_event();
            }
            self.line_start = true;
            self.in_value = false;
            self.is_data = false;
            self.field_len = 0;
            self.field_long = false;
            return;
        }
        self.line_start = false;
        if !self.in_value {
            if b == b':' {
                self.in_value = true;
                self.skip_space = true;
                self.is_data =
                    !self.field_long && self.field.get(..self.field_len) == Some(b"data");
                if self.is_data {
                    if self.event_has_data {
                        self.json.feed(b'\n');
                    }
                    self.event_has_data = true;
                }
            } else {
                match self.field.get_mut(self.field_len) {
                    Some(slot) => {
                        *slot = b;
                        self.field_len += 1;
                    }
                    None => self.field_long = true,
                }
            }
            return;
        }
        if std::mem::replace(&mut self.skip_space, false) && b == b' ' {
            return;
        }
        if self.is_data {
            self.json.feed(b);
        }
    }
}

/// The usage a response header reports: a plain decimal count (surrounding spaces allowed).
pub fn from_header(value: &str) -> Option<u64> {
    let v = value.trim();
    if v.is_empty() || v.len() > 20 || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    v.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(format: Format, body: &str) -> Option<Usage> {
        let mut r = UsageReader::new(format);
        r.feed(body.as_bytes());
        r.finish()
    }

    fn usage(p: u64, c: u64, t: u64) -> Option<Usage> {
        Some(Usage {
            prompt: Some(p),
            completion: Some(c),
            total: Some(t),
            ..Usage::default()
        })
    }

    /// Each provider's format, as its API documents it, read whole and a byte at a time.
    #[test]
    fn each_providers_report_is_read() {
        let w = Some(Weights {
            prompt: 1,
            completion: 3,
        });
        for (name, format, body, plain, weighted) in [
            // total_tokens; weighted: 1,117 + 3 × 46.
            (
                "openai-chat.json",
                Format::Json,
                include_str!("usage/fixtures/openai-chat.json"),
                1163,
                1255,
            ),
            // The final chunk (stream_options.include_usage): 19 + 3 × 10.
            (
                "openai-chat-stream.sse",
                Format::Sse,
                include_str!("usage/fixtures/openai-chat-stream.sse"),
                29,
                49,
            ),
            // input + cache writes + cache reads, and output: 2,095 + 2,051 + 503.
            (
                "anthropic-messages.json",
                Format::Json,
                include_str!("usage/fixtures/anthropic-messages.json"),
                4649,
                5655,
            ),
            // message_start's input (472 + 1,800 read from the cache), message_delta's output
            // (89, replacing message_start's 2).
            (
                "anthropic-messages-stream.sse",
                Format::Sse,
                include_str!("usage/fixtures/anthropic-messages-stream.sse"),
                2361,
                2539,
            ),
        ] {
            let whole = read(format, body);
            assert_eq!(whole.and_then(|u| u.tokens(None)), Some(plain), "{name}");
            assert_eq!(whole.and_then(|u| u.tokens(w)), Some(weighted), "{name}");
            let mut r = UsageReader::new(format);
            for b in body.as_bytes() {
                r.feed(std::slice::from_ref(b));
            }
            assert_eq!(r.finish(), whole, "{name}, a byte at a time");
        }
    }

    #[test]
    fn an_anthropic_stream_cut_after_message_start_has_seen_its_input() {
        let body = include_str!("usage/fixtures/anthropic-messages-stream.sse");
        let cut = body.find("event: message_delta").unwrap_or(0);
        let mut r = UsageReader::new(Format::Sse);
        r.feed(body.as_bytes().get(..cut).unwrap_or(&[]));
        assert_eq!(r.so_far().and_then(|u| u.tokens(None)), Some(2274));
    }

    #[test]
    fn only_the_top_level_message_carries_a_report() {
        let deep = r#"{"x":{"message":{"usage":{"total_tokens":5}}}}"#;
        assert_eq!(read(Format::Json, deep), None);
        let text = r#"{"message":"usage","usage":null}"#;
        assert_eq!(read(Format::Json, text), None);
        let inner =
            r#"{"message":{"content":[{"usage":{"total_tokens":6}}],"usage":{"total_tokens":7}}}"#;
        assert_eq!(read(Format::Json, inner).and_then(|u| u.total), Some(7));
    }

    const COMPLETION: &str = r#"{"id":"chatcmpl-1","object":"chat.completion",
        "choices":[{"index":0,"message":{"role":"assistant","content":"a \"usage\": {} b"}}],
        "usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42}}"#;

    #[test]
    fn a_json_completion_reports_its_top_level_usage() {
        assert_eq!(read(Format::Json, COMPLETION), usage(12, 30, 42));
    }

    #[test]
    fn nested_or_quoted_usage_is_not_the_report() {
        let nested =
            r#"{"choices":[{"usage":{"total_tokens":5}}],"meta":{"usage":{"total_tokens":6}}}"#;
        assert_eq!(read(Format::Json, nested), None);
        let quoted = r#"{"text":"\"usage\":{\"total_tokens\":7}","usage":null}"#;
        assert_eq!(read(Format::Json, quoted), None);
        let array = r#"[{"usage":{"total_tokens":8}}]"#;
        assert_eq!(read(Format::Json, array), None);
        assert_eq!(read(Format::Json, "not json at all"), None);
    }

    #[test]
    fn the_last_usage_key_wins_and_an_oversized_report_is_ignored() {
        let twice = r#"{"usage":{"total_tokens":1},"x":1,"usage":{"total_tokens":2}}"#;
        assert_eq!(read(Format::Json, twice).and_then(|u| u.total), Some(2));
        let pad = "x".repeat(MAX_USAGE_BYTES);
        let big = format!(r#"{{"usage":{{"pad":"{pad}","total_tokens":3}}}}"#);
        assert_eq!(read(Format::Json, &big), None);
    }

    const STREAM: &str =
        "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\r\n\r\n\
        : a comment\n\
        event: chunk\n\
        data: {\"choices\":[{\"delta\":{\"content\":\"data: {\\\"usage\\\"\"}}],\"usage\":null}\n\n\
        data: {\"choices\":[],\n\
        data: \"usage\":{\"prompt_tokens\":7,\"completion_tokens\":9,\"total_tokens\":16}}\n\n\
        data: [DONE]\n\n";

    #[test]
    fn a_stream_reports_the_final_chunks_usage_once() {
        assert_eq!(read(Format::Sse, STREAM), usage(7, 9, 16));
    }

    #[test]
    fn a_stream_cut_off_keeps_what_it_saw() {
        let cut = STREAM.find("data: [DONE]").unwrap_or(0);
        let mut r = UsageReader::new(Format::Sse);
        r.feed(STREAM.as_bytes().get(..cut).unwrap_or(&[]));
        assert_eq!(r.so_far(), usage(7, 9, 16));
        let early = STREAM.find("\"usage\":{").unwrap_or(0);
        let mut r = UsageReader::new(Format::Sse);
        r.feed(STREAM.as_bytes().get(..early).unwrap_or(&[]));
        assert_eq!(r.finish(), None);
        let unterminated = "data: {\"usage\":{\"total_tokens\":4}}";
        assert_eq!(
            read(Format::Sse, unterminated).and_then(|u| u.total),
            Some(4)
        );
    }

    #[test]
    fn tokens_are_weighted_or_totalled() {
        let u = Usage {
            prompt: Some(10),
            completion: Some(5),
            total: Some(15),
            ..Usage::default()
        };
        let w = Weights {
            prompt: 1,
            completion: 4,
        };
        assert_eq!(u.tokens(None), Some(15));
        assert_eq!(u.tokens(Some(w)), Some(30));
        let anthropic = read(
            Format::Json,
            r#"{"usage":{"input_tokens":3,"output_tokens":2}}"#,
        );
        assert_eq!(anthropic.and_then(|u| u.tokens(None)), Some(5));
        let total_only = Usage {
            total: Some(9),
            ..Usage::default()
        };
        assert_eq!(total_only.tokens(Some(w)), Some(9));
        assert_eq!(Usage::default().tokens(None), None);
    }

    #[test]
    fn headers_carry_plain_counts_only() {
        assert_eq!(from_header(" 120 "), Some(120));
        assert_eq!(from_header("-1"), None);
        assert_eq!(from_header("1e3"), None);
        assert_eq!(from_header("99999999999999999999"), None);
        assert_eq!(from_header(""), None);
    }

    mod props {
        use super::super::*;
        use proptest::prelude::*;

        proptest! {
            /// However the body is cut into pieces, the report is the same.
            #[test]
            fn pieces_do_not_change_the_report(cuts in proptest::collection::vec(0usize..400, 0..12),
                                               sse in any::<bool>()) {
                let (format, body) = if sse {
                    (Format::Sse, super::STREAM)
                } else {
                    (Format::Json, super::COMPLETION)
                };
                let whole = super::read(format, body);
                let bytes = body.as_bytes();
                let mut points: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
                points.sort_unstable();
                let mut r = UsageReader::new(format);
                let mut at = 0;
                for p in points {
                    r.feed(bytes.get(at..p).unwrap_or(&[]));
                    at = p;
                }
                r.feed(bytes.get(at..).unwrap_or(&[]));
                prop_assert_eq!(r.finish(), whole);
            }

            /// Arbitrary bytes never panic and never report more than the bound lets through.
            #[test]
            fn any_bytes_are_read_safely(body in proptest::collection::vec(any::<u8>(), 0..600),
                                         sse in any::<bool>()) {
                let mut r = UsageReader::new(if sse { Format::Sse } else { Format::Json });
                r.feed(&body);
                let _ = r.finish();
            }
        }
    }
}
