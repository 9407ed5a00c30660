//! A script's reply as the integers it holds: an array of integers, or a take's packed string.

use redis::{FromRedisValue, ParsingError, Value};

/// The integers a script answered: an array of integers, or one string of 8-byte little-endian
/// integers (the takes' replies, `packed()` in take_one.lua: one bulk string is one value for the
/// client to parse, an array one per integer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Ints(pub Vec<i64>);

impl FromRedisValue for Ints {
    fn from_redis_value(v: Value) -> Result<Self, ParsingError> {
        match v {
            Value::BulkString(b) if b.len() % 8 == 0 => Ok(Ints(
                b.chunks_exact(8)
                    .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                    .collect(),
            )),
            Value::BulkString(b) => Err(format!(
                "a script's packed reply is {} bytes, not a multiple of 8",
                b.len()
            )
            .into()),
            v => Vec::<i64>::from_redis_value(v).map(Ints),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_integers_packed_in_a_string_or_as_an_array() {
        let ints = |v: Value| Ints::from_redis_value(v).map(|i| i.0).ok();
        let packed: Vec<u8> = [1i64, 0, -3, 9007199254740991]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(
            ints(Value::BulkString(packed.clone())),
            Some(vec![1, 0, -3, 9007199254740991])
        );
        assert_eq!(ints(Value::BulkString(vec![])), Some(vec![]));
        assert_eq!(ints(Value::BulkString(packed[..31].to_vec())), None);
        assert_eq!(
            ints(Value::Array(vec![Value::Int(1), Value::Int(-2)])),
            Some(vec![1, -2])
        );
    }
}
