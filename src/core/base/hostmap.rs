//! The host's serialised header map (proxy-wasm ABI): a count, then a (name length, value length)
//! pair of little-endian u32 per entry, then each name and value followed by a NUL byte.
//!
//! Parsed here rather than by the SDK, whose parser indexes without bounds checks and unwraps
//! `String::from_utf8` on names: a malformed map or an odd header name must not panic the VM.
//! Values stay bytes; names are decoded lossily.

fn u32_at(b: &[u8], at: usize) -> Option<usize> {
    let s = b.get(at..at.checked_add(4)?)?;
    let mut a = [0u8; 4];
    a.copy_from_slice(s);
    usize::try_from(u32::from_le_bytes(a)).ok()
}

/// Parses the host's serialised map: count, then (name length, value length) pairs, then the
/// NUL-terminated names and values. `None` if it is malformed.
pub fn parse(b: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
    if b.is_empty() {
        return Some(Vec::new());
    }
    let n = u32_at(b, 0)?;
    let mut p = n.checked_mul(8)?.checked_add(4)?;
    let mut out = Vec::with_capacity(n.min(1024));
    for i in 0..n {
        let s = 4 + i * 8;
        let klen = u32_at(b, s)?;
        let vlen = u32_at(b, s + 4)?;
        let k = b.get(p..p.checked_add(klen)?)?;
        p = p.checked_add(klen)?.checked_add(1)?;
        let v = b.get(p..p.checked_add(vlen)?)?;
        p = p.checked_add(vlen)?.checked_add(1)?;
        out.push((String::from_utf8_lossy(k).into_owned(), v.to_vec()));
    }
    Some(out)
}

/// Serialises header pairs in the host's map format.
pub fn serialize(pairs: &[(String, String)]) -> Vec<u8> {
    let size: usize = 4 + pairs
        .iter()
        .map(|(k, v)| 10 + k.len() + v.len())
        .sum::<usize>();
    let mut out = Vec::with_capacity(size);
    let len = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
    out.extend_from_slice(&len(pairs.len()));
    for (k, v) in pairs {
        out.extend_from_slice(&len(k.len()));
        out.extend_from_slice(&len(v.len()));
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serialise(pairs: &[(&[u8], &[u8])]) -> Vec<u8> {
        let mut out = (pairs.len() as u32).to_le_bytes().to_vec();
        for (k, v) in pairs {
            out.extend_from_slice(&(k.len() as u32).to_le_bytes());
            out.extend_from_slice(&(v.len() as u32).to_le_bytes());
        }
        for (k, v) in pairs {
            out.extend_from_slice(k);
            out.push(0);
            out.extend_from_slice(v);
            out.push(0);
        }
        out
    }

    #[test]
    fn round_trip_with_binary_values_and_odd_names() {
        let b = serialise(&[
            (b":path", b"/x"),
            (b"x-bin", &[0xff, 0, 0xfe]),
            (&[0xc3], b""),
        ]);
        let m = parse(&b).unwrap();
        assert_eq!(m[0], (":path".to_string(), b"/x".to_vec()));
        assert_eq!(m[1].1, vec![0xff, 0, 0xfe]);
        assert_eq!(m[2].0, "\u{fffd}");
        assert_eq!(parse(&[]).unwrap(), vec![]);
    }

    #[test]
    fn serialize_round_trips_through_parse() {
        let pairs = vec![
            ("retry-after".to_string(), "3".to_string()),
            ("ratelimit".to_string(), "\"a\";r=0;t=3".to_string()),
            (String::new(), String::new()),
        ];
        let back = parse(&serialize(&pairs)).unwrap();
        let back: Vec<(String, String)> = back
            .into_iter()
            .map(|(k, v)| (k, String::from_utf8(v).unwrap()))
            .collect();
        assert_eq!(back, pairs);
    }

    #[test]
    fn malformed_maps_are_none_not_panics() {
        let good = serialise(&[(b"a", b"b"), (b"cc", b"dd")]);
        // Every truncation short of the final NUL (which is not needed) is detected.
        for n in 1..good.len() - 1 {
            assert!(parse(&good[..n]).is_none(), "prefix {n}");
        }
        assert!(parse(&[0xff, 0xff, 0xff, 0xff]).is_none());
        let mut lying = good.clone();
        lying[4] = 0xff; // first name length far beyond the buffer
        assert!(parse(&lying).is_none());
    }
}
