//! The rate limit headers both sides write (the filter on its 429s and admitted requests, the
//! service's RLS answers for Envoy's native filter), in one form:
//! draft-ietf-httpapi-ratelimit-headers, structured-field form (drafts 09+):
//! `RateLimit-Policy: "per-ip";q=100;w=60` (quota `q` per window of `w` seconds) and
//! `RateLimit: "per-ip";r=99;t=1` (`r` remaining, `t` seconds until the quota is restored), one
//! list member per limit; and `Retry-After` in delay-seconds (RFC 9110).

/// Appends `n` in decimal, without the formatting machinery (`write!` cost a 429 from a
/// remembered denial about 2,000 instructions in the filter, natively).
pub fn push_u64(out: &mut String, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        if let Some(d) = digits.get_mut(i) {
            *d = b'0' + (n % 10) as u8;
        }
        n /= 10;
        if n == 0 || i == 0 {
            break;
        }
    }
    for &d in digits.get(i..).unwrap_or_default() {
        out.push(char::from(d));
    }
}

/// `n` in decimal ([`push_u64`]).
pub fn u64_string(n: u64) -> String {
    let mut s = String::with_capacity(20);
    push_u64(&mut s, n);
    s
}

/// Milliseconds as whole seconds, rounded up.
pub fn ceil_secs(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

/// `Retry-After` for a wait of `ms`: seconds, rounded up, at least 1.
pub fn retry_after_secs(ms: u64) -> u64 {
    ceil_secs(ms).max(1)
}

/// A limit's name as a structured-field string (RFC 8941 §3.3.3): quoted, `"` and `\` escaped,
/// any character outside printable ASCII written as `?`.
pub fn push_name(out: &mut String, name: &str) {
    out.push('"');
    if name
        .bytes()
        .all(|b| matches!(b, b' '..=b'~') && b != b'"' && b != b'\\')
    {
        out.push_str(name);
        out.push('"');
        return;
    }
    for c in name.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('?'),
        }
    }
    out.push('"');
}

/// One member of `RateLimit-Policy`: `"name";q=<quota>;w=<window_secs>`.
pub fn push_policy(out: &mut String, name: &str, quota: u64, window_secs: u64) {
    push_name(out, name);
    out.push_str(";q=");
    push_u64(out, quota);
    out.push_str(";w=");
    push_u64(out, window_secs);
}

/// One member of `RateLimit`: `"name";r=<remaining>;t=<reset_secs>` (no `t` when the quota is
/// never restored).
pub fn push_state(out: &mut String, name: &str, remaining: u64, reset_secs: Option<u64>) {
    push_name(out, name);
    out.push_str(";r=");
    push_u64(out, remaining);
    if let Some(t) = reset_secs {
        out.push_str(";t=");
        push_u64(out, t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_are_structured_field_strings_and_parameters() {
        let mut p = String::new();
        push_policy(&mut p, "per-ip", 100, 60);
        assert_eq!(p, "\"per-ip\";q=100;w=60");
        let mut s = String::new();
        push_state(&mut s, "a\"b\\c é", 9, Some(2));
        assert_eq!(s, "\"a\\\"b\\\\c ?\";r=9;t=2");
        let mut s = String::new();
        push_state(&mut s, "ban", 0, None);
        assert_eq!(s, "\"ban\";r=0");
    }

    #[test]
    fn numbers_are_written_as_display_writes_them() {
        for n in [
            0,
            1,
            9,
            10,
            99,
            100,
            12_345,
            u64::from(u32::MAX),
            u64::MAX - 1,
            u64::MAX,
        ] {
            assert_eq!(u64_string(n), n.to_string());
        }
    }

    #[test]
    fn seconds_round_up_and_retry_after_is_at_least_one() {
        assert_eq!(retry_after_secs(41_250), 42);
        assert_eq!(retry_after_secs(1_000), 1);
        assert_eq!(retry_after_secs(0), 1);
        assert_eq!(ceil_secs(0), 0);
        assert_eq!(ceil_secs(1_001), 2);
    }
}
