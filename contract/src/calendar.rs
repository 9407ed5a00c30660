//! Calendar periods (algorithm `calendar_window`, contract/README.md, "Calendar windows"): a day,
//! a week from Monday, a month or a year, each starting at midnight in a time zone (UTC, a fixed
//! offset or a named zone), and the [`Span`] a store counts one bucket's windows by.
//!
//! The dates are proleptic Gregorian, counted in days since 1970-01-01 ([`days_from_civil`],
//! [`civil_from_days`]). A period's bounds in UTC need the zone's offset at its midnights: a fixed
//! offset's are computed here ([`Span::fixed`]); a named zone's need a time zone database, which
//! only the service has. The store's clock picks the window from the span ([`Span::window`]).

/// How long a calendar window lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    /// From midnight to midnight.
    Day,
    /// From Monday's midnight to the next Monday's (ISO 8601).
    Week,
    /// From the 1st's midnight to the next month's 1st.
    Month,
    /// From January 1st's midnight to the next year's.
    Year,
}

impl Unit {
    /// Every unit, in the order of their protobuf codes (1 to 4).
    pub const ALL: [Unit; 4] = [Unit::Day, Unit::Week, Unit::Month, Unit::Year];

    /// The JSON name (`"calendar"` of a bucket and of a rule).
    pub const fn name(self) -> &'static str {
        match self {
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
            Unit::Year => "year",
        }
    }

    /// The unit a JSON name stands for.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|u| u.name() == name)
    }

    /// The `tollgate.v1.CalendarUnit` value (0 is none: the bucket is no calendar window).
    pub const fn code(self) -> u64 {
        match self {
            Unit::Day => 1,
            Unit::Week => 2,
            Unit::Month => 3,
            Unit::Year => 4,
        }
    }

    /// The unit a `tollgate.v1.CalendarUnit` value stands for.
    pub fn from_code(code: u64) -> Option<Self> {
        Self::ALL.into_iter().find(|u| u.code() == code)
    }

    /// The `period_ms` a calendar bucket is sent with: its longest length within the contract's
    /// bounds (31 days for a month, 365 for a year). Stores do not count with it; the
    /// `RateLimit-Policy` header names it as the window.
    pub const fn nominal_ms(self) -> u64 {
        match self {
            Unit::Day => 86_400_000,
            Unit::Week => 7 * 86_400_000,
            Unit::Month => 31 * 86_400_000,
            Unit::Year => crate::bounds::MAX_PERIOD_MS,
        }
    }

    /// The local day (days since 1970-01-01) the period `k` periods after the one holding local
    /// day `day` starts on (`k` = 0: the period of `day` itself; negative: earlier ones).
    pub fn start(self, day: i64, k: i64) -> i64 {
        match self {
            Unit::Day => day + k,
            // 1970-01-01 was a Thursday: Monday is 0.
            Unit::Week => day - (day + 3).rem_euclid(7) + 7 * k,
            Unit::Month => {
                let (y, m, _) = civil_from_days(day);
                let months = y * 12 + i64::from(m) - 1 + k;
                days_from_civil(months.div_euclid(12), months.rem_euclid(12) as u32 + 1, 1)
            }
            Unit::Year => days_from_civil(civil_from_days(day).0 + k, 1, 1),
        }
    }
}

/// A bucket's calendar: its unit and the zone its midnights are in.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Calendar {
    /// How long a window lasts.
    pub unit: Unit,
    /// `UTC`, a fixed offset (`+05:30`, `-08:00`) or a named zone (`Europe/Berlin`); see [`Zone`].
    pub zone: String,
}

/// The zone a calendar names, read by [`Zone::parse`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Zone<'a> {
    /// A fixed offset east of UTC, in minutes (`UTC` is 0).
    Fixed(i32),
    /// A zone of the IANA time zone database, by name: whether it exists is the service's to say.
    Named(&'a str),
}

/// The zone a calendar without one is in.
pub const UTC: &str = "UTC";
/// Longest zone name, in bytes (the database's longest is 32).
pub const MAX_ZONE_BYTES: usize = 64;
/// The largest fixed offset either way, in minutes (14 hours: Pacific/Kiritimati's).
pub const MAX_OFFSET_MINUTES: i32 = 14 * 60;

impl<'a> Zone<'a> {
    /// Reads `UTC`, `+HH:MM` or `-HH:MM` (at most 14:00 either way), or a name of 1 to
    /// [`MAX_ZONE_BYTES`] bytes of ASCII letters, digits, `/`, `_`, `+` and `-` that starts with
    /// a letter. Returns what is wrong with anything else.
    pub fn parse(zone: &'a str) -> Result<Zone<'a>, &'static str> {
        if zone == UTC {
            return Ok(Zone::Fixed(0));
        }
        let b = zone.as_bytes();
        if let Some(&sign @ (b'+' | b'-')) = b.first() {
            let digits = |s: &[u8]| -> Option<i32> {
                let ok = s.len() == 2 && s.iter().all(u8::is_ascii_digit);
                ok.then(|| i32::from(s[0] - b'0') * 10 + i32::from(s[1] - b'0'))
            };
            let (h, m) = match (b.len(), b.get(3)) {
                (6, Some(b':')) => (digits(&b[1..3]), digits(&b[4..6])),
                _ => (None, None),
            };
            let (Some(h), Some(m)) = (h, m) else {
                return Err("an offset is written +HH:MM or -HH:MM");
            };
            let minutes = h * 60 + m;
            if m >= 60 || minutes > MAX_OFFSET_MINUTES {
                return Err("an offset is at most 14:00 either way, with minutes under 60");
            }
            return Ok(Zone::Fixed(if sign == b'-' { -minutes } else { minutes }));
        }
        let named = !b.is_empty()
            && b.len() <= MAX_ZONE_BYTES
            && b[0].is_ascii_alphabetic()
            && b.iter()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'/' | b'_' | b'+' | b'-'));
        if named {
            Ok(Zone::Named(zone))
        } else {
            Err("a zone is UTC, an offset (+HH:MM, -HH:MM) or a time zone's name (Europe/Berlin)")
        }
    }
}

/// Milliseconds in a day.
pub const DAY_MS: i64 = 86_400_000;

/// Days since 1970-01-01 of year `y`, month `m` (1..=12), day `d` (1..=31), in the proleptic
/// Gregorian calendar (H. Hinnant's `days_from_civil`).
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The year, month (1..=12) and day (1..=31) of day `z` since 1970-01-01.
pub fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// The windows around a moment, as the service sends them to its store: the period boundary
/// nearest that moment (on the service's clock) and the lengths of the windows either side. The
/// store's own clock then picks one of the two ([`Span::window`]), so replicas whose clocks differ
/// by less than half a window agree with the store on which window a take counts in.
///
/// In the store's integers it is carried in a bucket's `rate` and `period_ms` slots
/// ([`Span::pack`]); lengths are whole seconds, as every zone's offsets are today.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// The boundary, in ms since 1970-01-01 UTC.
    pub boundary: u64,
    /// Length of the window that ends at the boundary, in ms.
    pub before: u64,
    /// Length of the window that starts at it, in ms.
    pub after: u64,
}

/// Packing two lengths in seconds (a year is under 2^25 s) into one integer below 2^53.
const SECONDS_SHIFT: u64 = 1 << 26;

impl Span {
    /// From four consecutive period starts in ms since the epoch, `now_ms` in the window of the
    /// middle two: the nearer of those two boundaries.
    pub fn around(starts: [u64; 4], now_ms: u64) -> Span {
        let [s0, s1, s2, s3] = starts;
        if now_ms.saturating_sub(s1) <= s2.saturating_sub(now_ms) {
            Span {
                boundary: s1,
                before: s1 - s0,
                after: s2 - s1,
            }
        } else {
            Span {
                boundary: s2,
                before: s2 - s1,
                after: s3 - s2,
            }
        }
    }

    /// The span around `now_ms` of `unit`'s windows at a fixed offset (minutes east of UTC).
    pub fn fixed(unit: Unit, offset_minutes: i32, now_ms: u64) -> Span {
        let off = i64::from(offset_minutes) * 60_000;
        let now = i64::try_from(now_ms).unwrap_or(i64::MAX / 2);
        let day = (now + off).div_euclid(DAY_MS);
        let at = |k: i64| (unit.start(day, k) * DAY_MS - off).max(0) as u64;
        Span::around([at(-1), at(0), at(1), at(2)], now_ms)
    }

    /// The window `[start, end)` that `now_ms`, on the store's clock, counts in.
    pub fn window(&self, now_ms: u64) -> (u64, u64) {
        if now_ms < self.boundary {
            (self.boundary.saturating_sub(self.before), self.boundary)
        } else {
            (self.boundary, self.boundary.saturating_add(self.after))
        }
    }

    /// The span as two store integers: the boundary in ms, and both lengths in seconds
    /// (`before × 2^26 + after`).
    pub fn pack(&self) -> (u64, u64) {
        (
            self.boundary,
            (self.before / 1000) * SECONDS_SHIFT + self.after / 1000,
        )
    }

    /// The span [`Span::pack`] wrote.
    pub fn unpack(boundary: u64, lengths: u64) -> Span {
        Span {
            boundary,
            before: (lengths / SECONDS_SHIFT) * 1000,
            after: (lengths % SECONDS_SHIFT) * 1000,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(y: i64, m: u32, d: u32, hour: i64) -> u64 {
        (days_from_civil(y, m, d) * DAY_MS + hour * 3_600_000) as u64
    }

    #[test]
    fn civil_days_round_trip_and_known_dates() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(days_from_civil(1969, 12, 31), -1);
        for z in (-800_000..800_000).step_by(997) {
            let (y, m, d) = civil_from_days(z);
            assert_eq!(days_from_civil(y, m, d), z);
        }
        assert_eq!(civil_from_days(days_from_civil(2024, 2, 29)), (2024, 2, 29));
    }

    #[test]
    fn units_start_on_their_first_day() {
        let d = days_from_civil(2026, 12, 6); // a Sunday
        assert_eq!(Unit::Day.start(d, 1), d + 1);
        assert_eq!(civil_from_days(Unit::Week.start(d, 0)), (2026, 11, 30));
        assert_eq!(civil_from_days(Unit::Week.start(d, 1)), (2026, 12, 7));
        assert_eq!(civil_from_days(Unit::Month.start(d, 0)), (2026, 12, 1));
        assert_eq!(civil_from_days(Unit::Month.start(d, 1)), (2027, 1, 1));
        assert_eq!(civil_from_days(Unit::Month.start(d, -12)), (2025, 12, 1));
        assert_eq!(civil_from_days(Unit::Year.start(d, -1)), (2025, 1, 1));
    }

    #[test]
    fn a_span_is_around_the_nearest_boundary_and_picks_by_the_store_s_clock() {
        // 2026-12-06 10:00 UTC, monthly in UTC: December's start is nearer than January's.
        let now = ms(2026, 12, 6, 10);
        let s = Span::fixed(Unit::Month, 0, now);
        assert_eq!(s.boundary, ms(2026, 12, 1, 0));
        assert_eq!(
            (s.before, s.after),
            (30 * DAY_MS as u64, 31 * DAY_MS as u64)
        );
        assert_eq!(s.window(now), (ms(2026, 12, 1, 0), ms(2027, 1, 1, 0)));
        // A store whose clock is still in November counts in November.
        assert_eq!(s.window(s.boundary - 1).0, ms(2026, 11, 1, 0));
        // Late in the month, January's start is the nearer.
        let late = Span::fixed(Unit::Month, 0, ms(2026, 12, 30, 0));
        assert_eq!(late.boundary, ms(2027, 1, 1, 0));
        // At +05:30 a day starts at 18:30 UTC the day before.
        let ist = Span::fixed(Unit::Day, 330, ms(2026, 12, 6, 20));
        assert_eq!(
            ist.window(ms(2026, 12, 6, 20)).0,
            ms(2026, 12, 6, 18) + 1_800_000
        );
        assert_eq!(Span::unpack(ist.pack().0, ist.pack().1), ist);
        let y = Span::fixed(Unit::Year, -600, ms(2028, 7, 1, 0));
        assert_eq!(Span::unpack(y.pack().0, y.pack().1), y);
        assert!(y.pack().1 < 1 << 53);
    }

    #[test]
    fn zones_read() {
        assert_eq!(Zone::parse("UTC"), Ok(Zone::Fixed(0)));
        assert_eq!(Zone::parse("+05:30"), Ok(Zone::Fixed(330)));
        assert_eq!(Zone::parse("-08:00"), Ok(Zone::Fixed(-480)));
        assert_eq!(Zone::parse("+14:00"), Ok(Zone::Fixed(840)));
        assert_eq!(
            Zone::parse("America/Argentina/Buenos_Aires"),
            Ok(Zone::Named("America/Argentina/Buenos_Aires"))
        );
        assert_eq!(Zone::parse("Etc/GMT+5"), Ok(Zone::Named("Etc/GMT+5")));
        for bad in [
            "",
            "+14:01",
            "+5:30",
            "+05:60",
            "+0530",
            "/etc",
            "Europe/Ber lin",
            "1UTC",
        ] {
            assert!(Zone::parse(bad).is_err(), "{bad:?}");
        }
        assert!(Zone::parse(&"A".repeat(MAX_ZONE_BYTES + 1)).is_err());
    }
}
