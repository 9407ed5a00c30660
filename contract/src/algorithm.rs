//! How a bucket counts: the contract's algorithms and every name and code each goes by.
//!
//! Adding an algorithm starts here: a variant, its JSON name, its `tollgate.v1.Algorithm` code
//! (contract/tollgate.proto) and its store tag. The filter's configuration, both JSON codecs and
//! the protobuf codec read them from [`Algorithm::ALL`].

/// How a bucket counts (contract/README.md, "Request").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// Refills continuously at `rate / period_ms`, holds at most `capacity`, starts full.
    #[default]
    TokenBucket,
    /// At most `capacity` tokens per window `floor(now / period_ms)`; `rate` is ignored.
    FixedWindow,
    /// At most `capacity` tokens within any `period_ms`, estimated from the current window's
    /// count and the previous one's, weighted; `rate` is ignored.
    SlidingWindow,
    /// At most `capacity` tokens per calendar period (the bucket's `calendar`: a day, a week, a
    /// month or a year from midnight in a zone); `rate` and `period_ms` are ignored.
    CalendarWindow,
}

impl Algorithm {
    /// Every algorithm, in the order of their protobuf codes.
    pub const ALL: &'static [Algorithm] = &[
        Algorithm::TokenBucket,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::CalendarWindow,
    ];

    /// The JSON name (`"algorithm"` of a bucket, and of a rule in the filter's configuration).
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::CalendarWindow => "calendar_window",
        }
    }

    /// The algorithm a JSON name stands for.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|a| a.name() == name)
    }

    /// The `tollgate.v1.Algorithm` value. The default algorithm is 0, which proto3 does not
    /// encode: a bucket that names none and one that names the default are the same bytes.
    pub const fn code(self) -> i32 {
        match self {
            Algorithm::TokenBucket => 0,
            Algorithm::FixedWindow => 1,
            Algorithm::SlidingWindow => 2,
            Algorithm::CalendarWindow => 3,
        }
    }

    /// The algorithm a `tollgate.v1.Algorithm` value stands for.
    pub fn from_code(code: i32) -> Option<Self> {
        Self::ALL.iter().copied().find(|a| a.code() == code)
    }

    /// The short tag in the service's store keys and scripts.
    pub const fn tag(self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "tb",
            Algorithm::FixedWindow => "fw",
            Algorithm::SlidingWindow => "sw",
            Algorithm::CalendarWindow => "cw",
        }
    }

    /// The JSON names for an error message: `"token_bucket" or "fixed_window"`.
    pub fn expected() -> String {
        let mut out = String::new();
        for (i, a) in Self::ALL.iter().enumerate() {
            if i > 0 {
                out.push_str(if i + 1 == Self::ALL.len() {
                    " or "
                } else {
                    ", "
                });
            }
            out.push('"');
            out.push_str(a.name());
            out.push('"');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_codes_and_tags_are_each_one_to_one() {
        for (i, a) in Algorithm::ALL.iter().enumerate() {
            assert_eq!(Algorithm::from_name(a.name()), Some(*a));
            assert_eq!(Algorithm::from_code(a.code()), Some(*a));
            assert_eq!(usize::try_from(a.code()).ok(), Some(i), "codes follow ALL");
            for b in &Algorithm::ALL[i + 1..] {
                assert_ne!(a.tag(), b.tag());
            }
        }
        assert_eq!(Algorithm::default().code(), 0);
        assert_eq!(Algorithm::from_name("gcra"), None);
        assert_eq!(Algorithm::from_code(-1), None);
        assert_eq!(
            Algorithm::expected(),
            "\"token_bucket\", \"fixed_window\", \"sliding_window\" or \"calendar_window\""
        );
    }

    #[test]
    fn the_proto_enum_agrees() {
        let proto = include_str!("../tollgate.proto");
        for a in Algorithm::ALL {
            let line = format!("{} = {};", a.name().to_uppercase(), a.code());
            assert!(proto.contains(&line), "tollgate.proto lacks `{line}`");
        }
    }
}
