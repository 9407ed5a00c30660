//! The protobuf form of a take and its answer (contract/tollgate.proto: `TakeRequest`,
//! `TakeResponse`, `TakeBatchRequest`, `TakeBatchResponse`), hand-written: a varint and
//! length-delimited writer and a bounds-checked, skipping reader. The messages are tiny and fixed,
//! and a generated codec would cost the filter's module more bytes than its whole logic. The
//! service serves gRPC with prost; its tests check this codec against prost on the fixtures.

use crate::take::{
    BucketResult, DecodeError, MessageError, Sender, StreamAnswer, TakeRequest, TakeResponse,
};

/// Appends a base-128 varint.
pub fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_tag(out: &mut Vec<u8>, field: u32, wire_type: u8) {
    put_varint(out, (u64::from(field) << 3) | u64::from(wire_type));
}

/// Appends a length-delimited field (bytes, a string or a message).
pub fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_tag(out, field, 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// Appends a proto3 scalar: zero is not encoded.
pub fn put_u64(out: &mut Vec<u8>, field: u32, v: u64) {
    if v != 0 {
        put_tag(out, field, 0);
        put_varint(out, v);
    }
}

/// Appends a proto3 `optional` scalar: encoded whenever present, even if zero.
pub fn put_opt_u64(out: &mut Vec<u8>, field: u32, v: Option<u64>) {
    if let Some(v) = v {
        put_tag(out, field, 0);
        put_varint(out, v);
    }
}

/// Encodes a `TakeRequest`; the sender's instance id (field 2) and rule names (bucket field 8)
/// are added when it has them.
pub fn encode_take(req: &TakeRequest, sender: &Sender<'_>) -> Vec<u8> {
    let mut out = take_message(req, sender);
    put_instance(&mut out, sender);
    out
}

/// Encodes a `TakeBatchRequest { repeated TakeRequest takes = 1; string instance = 2; }`.
pub fn encode_batch(takes: &[&TakeRequest], sender: &Sender<'_>) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + 96 * takes.len());
    for t in takes {
        put_bytes(&mut out, 1, &take_message(t, sender));
    }
    put_instance(&mut out, sender);
    out
}

/// Encodes a message of a TakeStream: a `TakeBatchRequest` with its `id` (field 3, 1..), which
/// its answer carries back ([`decode_stream_answer`]).
pub fn encode_stream_message(takes: &[&TakeRequest], sender: &Sender<'_>, id: u64) -> Vec<u8> {
    let mut out = encode_batch(takes, sender);
    put_u64(&mut out, 3, id);
    out
}

fn put_instance(out: &mut Vec<u8>, sender: &Sender<'_>) {
    if let Some(id) = sender.instance {
        put_bytes(out, 2, id.as_bytes());
    }
}

/// A `TakeRequest` without its instance id.
fn take_message(req: &TakeRequest, sender: &Sender<'_>) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + 64 * req.buckets.len());
    let mut b = Vec::with_capacity(64);
    for bucket in &req.buckets {
        b.clear();
        if !bucket.key.is_empty() {
            put_bytes(&mut b, 1, bucket.key.as_bytes());
        }
        put_u64(&mut b, 2, bucket.capacity);
        put_opt_u64(&mut b, 3, bucket.rate);
        put_u64(&mut b, 4, bucket.period_ms);
        put_opt_u64(&mut b, 5, bucket.cost);
        if let Some(a) = bucket.algorithm {
            put_u64(&mut b, 6, u64::from(a.code().unsigned_abs()));
        }
        put_opt_u64(&mut b, 7, bucket.lease);
        if let Some(r) = (sender.rule)(bucket) {
            put_bytes(&mut b, 8, r.as_bytes());
        }
        put_u64(&mut b, 9, bucket.max_delay_ms);
        if let Some(c) = &bucket.calendar {
            put_u64(&mut b, 10, c.unit.code());
            if c.zone != crate::calendar::UTC {
                put_bytes(&mut b, 11, c.zone.as_bytes());
            }
        }
        put_bytes(&mut out, 1, &b);
    }
    out
}

/// A protobuf reader over a byte slice; every read is bounds-checked.
pub struct Reader<'a> {
    buf: &'a [u8],
}

/// A decoded field value.
pub enum Field<'a> {
    /// Wire type 0.
    Varint(u64),
    /// Wire type 2: bytes, a string or a message.
    Bytes(&'a [u8]),
    /// Wire types 1 and 5, skipped.
    Fixed,
}

impl<'a> Reader<'a> {
    /// A reader of `buf`, from its start.
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf }
    }

    fn varint(&mut self) -> Result<u64, DecodeError> {
        let mut v: u64 = 0;
        for i in 0..10 {
            let (&byte, rest) = self
                .buf
                .split_first()
                .ok_or_else(|| DecodeError("truncated varint".into()))?;
            self.buf = rest;
            v |= u64::from(byte & 0x7f) << (7 * i);
            if byte < 0x80 {
                return Ok(v);
            }
        }
        Err(DecodeError("varint too long".into()))
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8], DecodeError> {
        let n = usize::try_from(n).map_err(|_| DecodeError("length too large".into()))?;
        if n > self.buf.len() {
            return Err(DecodeError("truncated field".into()));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    /// The next (field number, value), or `None` at the end.
    pub fn field(&mut self) -> Result<Option<(u64, Field<'a>)>, DecodeError> {
        if self.buf.is_empty() {
            return Ok(None);
        }
        let tag = self.varint()?;
        let value = match tag & 7 {
            0 => Field::Varint(self.varint()?),
            1 => {
                self.take(8)?;
                Field::Fixed
            }
            2 => {
                let n = self.varint()?;
                Field::Bytes(self.take(n)?)
            }
            5 => {
                self.take(4)?;
                Field::Fixed
            }
            t => return Err(DecodeError(format!("unsupported wire type {t}"))),
        };
        Ok(Some((tag >> 3, value)))
    }
}

fn bucket_result(buf: &[u8]) -> Result<BucketResult, DecodeError> {
    let mut r = Reader::new(buf);
    let mut out = BucketResult::default();
    while let Some((field, value)) = r.field()? {
        if let Field::Varint(v) = value {
            match field {
                1 => out.allowed = v != 0,
                2 => out.limit = v,
                3 => out.remaining = v,
                4 => out.reset_ms = v,
                5 => out.retry_after_ms = v,
                6 => out.granted = v,
                7 => out.delay_ms = v,
                8 => out.window = v,
                _ => {}
            }
        } else if (1..=8).contains(&field) {
            return Err(DecodeError(format!(
                "BucketResult field {field}: wrong wire type"
            )));
        }
    }
    Ok(out)
}

/// Decodes a `TakeResponse`. Unknown fields are skipped, as protobuf requires.
pub fn decode_answer(body: &[u8]) -> Result<TakeResponse, DecodeError> {
    let mut r = Reader::new(body);
    let mut out = TakeResponse::default();
    while let Some((field, value)) = r.field()? {
        match (field, value) {
            (1, Field::Varint(v)) => out.allowed = v != 0,
            (2, Field::Bytes(b)) => out.buckets.push(bucket_result(b)?),
            (3, Field::Varint(n)) => out.instances = n,
            (4, Field::Varint(n)) => out.delay_ms = n,
            (1 | 2, _) => {
                return Err(DecodeError(format!(
                    "TakeResponse field {field}: wrong wire type"
                )))
            }
            _ => {}
        }
    }
    Ok(out)
}

/// Decodes a `TakeBatchResponse { repeated TakeResponse results = 1; }`.
pub fn decode_batch_answer(body: &[u8]) -> Result<Vec<TakeResponse>, DecodeError> {
    let answer = decode_stream_answer(body)?;
    match answer.answer {
        Ok(results) => Ok(results),
        Err(e) => Err(DecodeError(format!(
            "TakeBatchResponse: an error ({}) where results were due",
            e.code
        ))),
    }
}

/// Decodes a `TakeBatchResponse` as a TakeStream answers one message: the message's `id` (field
/// 2) and either its results (field 1) or its error (field 3, a `MessageError`). An answer with
/// both is not valid.
pub fn decode_stream_answer(body: &[u8]) -> Result<StreamAnswer, DecodeError> {
    let mut r = Reader::new(body);
    let mut results = Vec::new();
    let mut id = 0;
    let mut error = None;
    while let Some((field, value)) = r.field()? {
        match (field, value) {
            (1, Field::Bytes(b)) => results.push(decode_answer(b)?),
            (2, Field::Varint(n)) => id = n,
            (3, Field::Bytes(b)) => error = Some(message_error(b)?),
            (1..=3, _) => {
                return Err(DecodeError(format!(
                    "TakeBatchResponse field {field}: wrong wire type"
                )))
            }
            _ => {}
        }
    }
    let answer = match error {
        None => Ok(results),
        Some(e) if results.is_empty() => Err(e),
        Some(_) => {
            return Err(DecodeError(
                "TakeBatchResponse: both results and an error".into(),
            ))
        }
    };
    Ok(StreamAnswer { id, answer })
}

fn message_error(buf: &[u8]) -> Result<MessageError, DecodeError> {
    let mut r = Reader::new(buf);
    let mut e = MessageError::default();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    while let Some((field, value)) = r.field()? {
        match (field, value) {
            (1, Field::Varint(c)) => e.code = u32::try_from(c).unwrap_or(u32::MAX),
            (2, Field::Bytes(b)) => e.message = text(b),
            (3, Field::Bytes(b)) => e.field = text(b),
            (1..=3, _) => {
                return Err(DecodeError(format!(
                    "MessageError field {field}: wrong wire type"
                )))
            }
            _ => {}
        }
    }
    Ok(e)
}
