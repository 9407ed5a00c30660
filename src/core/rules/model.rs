//! The model a request asks for, read from its JSON body as the body arrives: the top-level
//! `model` string of an OpenAI- or Anthropic-style request (`{"model": "gpt-4o", ...}`). The scan
//! keeps a few bytes of state, never the body: Envoy holds the body while the request waits, and
//! the scan gives up after `max_bytes` of it, when the document is not a JSON object, when its
//! top level ends without a `model` string, or when the body ends.

/// Longest model name kept, in bytes (longer: no model).
pub const MAX_MODEL_BYTES: usize = 128;

/// What the scan has found so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// Not yet: more of the body may tell.
    Reading,
    /// The model (its JSON string value, unescaped).
    Model(String),
    /// No model: not a JSON object, no top-level `model` string, an unreadable or too long one,
    /// or `max_bytes` read without finding it.
    Absent,
}

/// A streaming scan of a JSON body for its top-level `model` string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelScan {
    max_bytes: usize,
    seen: usize,
    depth: u32,
    started: bool,
    in_string: bool,
    escape: bool,
    /// At depth 1 the next string is a key.
    expect_key: bool,
    reading_key: bool,
    /// The key being read, while it can still be `model`.
    key: Vec<u8>,
    key_long: bool,
    /// The last key read at depth 1 was `model` and its value has not started.
    model_next: bool,
    /// Reading the model's string value (raw, escapes undone at its end).
    value: Option<Vec<u8>>,
    found: Found,
}

impl ModelScan {
    /// A scan that gives up after `max_bytes` of body.
    pub fn new(max_bytes: usize) -> ModelScan {
        ModelScan {
            max_bytes,
            seen: 0,
            depth: 0,
            started: false,
            in_string: false,
            escape: false,
            expect_key: false,
            reading_key: false,
            key: Vec::new(),
            key_long: false,
            model_next: false,
            value: None,
            found: Found::Reading,
        }
    }

    /// How many bytes of the body were read.
    pub fn seen(&self) -> usize {
        self.seen
    }

    /// The next piece of the body (`end`: it was the last); what is known after it.
    pub fn feed(&mut self, chunk: &[u8], end: bool) -> &Found {
        for &b in chunk {
            if self.found != Found::Reading {
                break;
            }
            if self.seen >= self.max_bytes {
                self.found = Found::Absent;
                break;
            }
            self.seen += 1;
            self.byte(b);
        }
        if end && self.found == Found::Reading {
            self.found = Found::Absent;
        }
        &self.found
    }

    fn byte(&mut self, b: u8) {
        if self.in_string {
            self.string_byte(b);
            return;
        }
        if b.is_ascii_whitespace() {
            return;
        }
        if !self.started {
            self.started = true;
            if b != b'{' {
                self.found = Found::Absent;
                return;
            }
        }
        let top = self.depth == 1;
        match b {
            b'"' => {
                self.in_string = true;
                if top && self.expect_key {
                    self.expect_key = false;
                    self.reading_key = true;
                    self.key.clear();
                    self.key_long = false;
                } else if top && self.model_next {
                    self.model_next = false;
                    self.value = Some(Vec::new());
                }
            }
            b'{' | b'[' => {
                self.model_next = false;
                self.depth = self.depth.saturating_add(1);
                if self.depth == 1 {
                    self.expect_key = true;
                }
            }
            b'}' | b']' => {
                self.depth = self.depth.saturating_sub(1);
                if self.depth == 0 {
                    // The top-level object ended without a model.
                    self.found = Found::Absent;
                }
            }
            b',' if top => {
                self.expect_key = true;
                self.model_next = false;
            }
            b':' => {}
            // A value that is not a string (a number, `null`): no model.
            _ if top => self.model_next = false,
            _ => {}
        }
    }

    fn string_byte(&mut self, b: u8) {
        if self.escape {
            self.escape = false;
            self.push(b);
            return;
        }
        if b == b'\\' {
            self.escape = true;
            self.push(b);
            return;
        }
        if b != b'"' {
            self.push(b);
            return;
        }
        self.in_string = false;
        if self.reading_key {
            self.reading_key = false;
            self.model_next = !self.key_long && self.key == b"model";
        } else if let Some(raw) = self.value.take() {
            self.found = unescape(&raw).map_or(Found::Absent, Found::Model);
        }
    }

    fn push(&mut self, b: u8) {
        if self.reading_key {
            if self.key.len() < b"model".len() {
                self.key.push(b);
            } else {
                self.key_long = true;
            }
        } else if let Some(v) = &mut self.value {
            if v.len() < MAX_MODEL_BYTES * 6 {
                v.push(b);
            } else {
                self.value = None;
                self.found = Found::Absent;
            }
        }
    }
}

/// A JSON string's raw bytes (between the quotes) unescaped; `None` when it is not valid, not
/// UTF-8, empty, or longer than [`MAX_MODEL_BYTES`].
fn unescape(raw: &[u8]) -> Option<String> {
    let mut out: Vec<u8> = Vec::with_capacity(raw.len());
    let mut i = 0;
    while let Some(&b) = raw.get(i) {
        i += 1;
        if b != b'\\' {
            if b < 0x20 {
                return None;
            }
            out.push(b);
            continue;
        }
        let e = *raw.get(i)?;
        i += 1;
        let c = match e {
            b'"' | b'\\' | b'/' => e,
            b'b' => 8,
            b'f' => 12,
            b'n' => b'\n',
            b'r' => b'\r',
            b't' => b'\t',
            b'u' => {
                let hex = std::str::from_utf8(raw.get(i..i + 4)?).ok()?;
                i += 4;
                let ch = char::from_u32(u32::from_str_radix(hex, 16).ok()?)?;
                let mut buf = [0u8; 4];
                out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                continue;
            }
            _ => return None,
        };
        out.push(c);
    }
    let s = String::from_utf8(out).ok()?;
    (!s.is_empty() && s.len() <= MAX_MODEL_BYTES).then_some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(body: &[u8], max: usize) -> Found {
        let mut s = ModelScan::new(max);
        s.feed(body, true).clone()
    }

    #[test]
    fn the_top_level_model_is_found_whatever_comes_around_it() {
        let model = |m: &str| Found::Model(m.to_string());
        assert_eq!(
            scan(br#"{"model":"gpt-4o","messages":[]}"#, 1024),
            model("gpt-4o")
        );
        assert_eq!(
            scan(
                br#" { "messages": [{"model": "no", "content": "{\"model\":\"no\"}"}], "stream" : true, "model" : "claude-3-5" } "#,
                1024
            ),
            model("claude-3-5")
        );
        assert_eq!(scan(br#"{"modelx":"a","model":"b"}"#, 1024), model("b"));
        assert_eq!(
            scan(br#"{"mode":"a","model":"m\u00e9\/1"}"#, 1024),
            model("mé/1")
        );
    }

    #[test]
    fn anything_else_is_no_model() {
        for body in [
            &b"not json"[..],
            b"[{\"model\":\"a\"}]",
            b"{\"model\":4}",
            b"{\"model\":null,\"x\":\"y\"}",
            b"{\"model\":\"\"}",
            b"{\"a\":{\"model\":\"nested\"}}",
            b"{\"model\":\"bad\\q\"}",
            b"",
        ] {
            assert_eq!(
                scan(body, 1024),
                Found::Absent,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        let long = format!(r#"{{"model":"{}"}}"#, "m".repeat(MAX_MODEL_BYTES + 1));
        assert_eq!(scan(long.as_bytes(), 4096), Found::Absent);
    }

    #[test]
    fn it_reads_in_pieces_and_gives_up_at_its_bound() {
        let body = br#"{"messages":[{"role":"user","content":"hello"}],"model":"gpt-4o-mini"}"#;
        // The value's closing quote is the last byte but one: a piece that holds it decides.
        for cut in 1..body.len() - 1 {
            let mut s = ModelScan::new(1024);
            assert_eq!(s.feed(&body[..cut], false), &Found::Reading, "cut {cut}");
            assert_eq!(
                s.feed(&body[cut..], false),
                &Found::Model("gpt-4o-mini".into()),
                "cut {cut}"
            );
        }
        // Past the bound before the model: no model, and no more is read.
        let mut s = ModelScan::new(20);
        assert_eq!(s.feed(body, false), &Found::Absent);
        assert_eq!(s.seen(), 20);
        // The body ended first.
        let mut s = ModelScan::new(1024);
        assert_eq!(s.feed(br#"{"messages":[]"#, false), &Found::Reading);
        assert_eq!(s.feed(b"", true), &Found::Absent);
        // Found before the bound: what follows is not read.
        let mut s = ModelScan::new(1024);
        assert_eq!(
            s.feed(br#"{"model":"m","x":"#, false),
            &Found::Model("m".into())
        );
        assert_eq!(s.seen(), 12);
    }
}
