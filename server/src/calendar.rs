//! Calendar windows (algorithm `calendar_window`, contract/README.md "Calendar windows"): the span
//! a take's bucket is counted by, from its unit, its zone and the service's clock. A fixed offset
//! is the contract's arithmetic ([`Span::fixed`]); a named zone's midnights come from the IANA
//! database bundled into the binary (jiff): each period starts at the first instant of its first
//! day (a midnight a daylight-saving change skips starts the day at the change, one it repeats at
//! the earlier). The store then picks the window of the span by Redis's clock.

use contract::calendar::{civil_from_days, days_from_civil, Span, Unit, Zone};
use jiff::civil::Date;
use jiff::tz::TimeZone;
use jiff::Timestamp;

/// The span of `unit`'s windows in `zone` around `now_ms`, or why the zone is not one.
pub fn span(unit: Unit, zone: &str, now_ms: u64) -> Result<Span, String> {
    match Zone::parse(zone)? {
        Zone::Fixed(minutes) => Ok(Span::fixed(unit, minutes, now_ms)),
        Zone::Named(name) => {
            let tz = named(name)?;
            named_span(unit, &tz, now_ms)
                .ok_or_else(|| format!("{name}: no span around {now_ms} ms"))
        }
    }
}

/// The zone of the database called `name`.
pub fn named(name: &str) -> Result<TimeZone, String> {
    TimeZone::get(name).map_err(|_| format!("{name:?} is not a time zone of the IANA database"))
}

/// Whether `zone` names a zone this service can count in (UTC, an offset, or a known name).
pub fn check_zone(zone: &str) -> Result<(), String> {
    match Zone::parse(zone)? {
        Zone::Fixed(_) => Ok(()),
        Zone::Named(name) => named(name).map(|_| ()),
    }
}

/// `ms` since the epoch as RFC 3339 in `zone` (`2026-12-01T00:00:00+01:00`), or why not.
pub fn format(ms: u64, zone: &str) -> Result<String, String> {
    let tz = match Zone::parse(zone)? {
        Zone::Fixed(minutes) => jiff::tz::Offset::from_seconds(minutes * 60)
            .map(TimeZone::fixed)
            .map_err(|e| e.to_string())?,
        Zone::Named(name) => named(name)?,
    };
    let at = Timestamp::from_millisecond(i64::try_from(ms).map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    Ok(at.to_zoned(tz).strftime("%Y-%m-%dT%H:%M:%S%:z").to_string())
}

fn named_span(unit: Unit, tz: &TimeZone, now_ms: u64) -> Option<Span> {
    let now = Timestamp::from_millisecond(i64::try_from(now_ms).ok()?).ok()?;
    let local = tz.to_datetime(now).date();
    let day = days_from_civil(
        i64::from(local.year()),
        u32::try_from(local.month()).ok()?,
        u32::try_from(local.day()).ok()?,
    );
    let mut starts = [0u64; 4];
    for (slot, k) in starts.iter_mut().zip(-1..=2) {
        let (y, m, d) = civil_from_days(unit.start(day, k));
        let date = Date::new(
            i16::try_from(y).ok()?,
            i8::try_from(m).ok()?,
            i8::try_from(d).ok()?,
        )
        .ok()?;
        let at = tz.to_ambiguous_timestamp(date.to_datetime(jiff::civil::Time::midnight()));
        // Before the epoch (a period of 1970 east of UTC): 0, as `Span::fixed` clamps.
        *slot = u64::try_from(at.compatible().ok()?.as_millisecond().max(0)).ok()?;
    }
    Some(Span::around(starts, now_ms))
}

#[cfg(test)]
mod tests {
    use super::*;
    use contract::calendar::DAY_MS;

    const DAY: u64 = DAY_MS as u64;

    fn utc(y: i64, m: u32, d: u32) -> u64 {
        days_from_civil(y, m, d) as u64 * DAY
    }

    #[test]
    fn a_month_in_berlin_starts_at_its_midnight_whatever_the_offset() -> Result<(), String> {
        // 2027-03-10: March began at +01:00 (23:00 UTC on Feb 28), April begins at +02:00
        // (22:00 UTC on March 31): 31 days less an hour.
        let s = span(Unit::Month, "Europe/Berlin", utc(2027, 3, 10))?;
        assert_eq!(s.boundary, utc(2027, 3, 1) - 3_600_000);
        assert_eq!(s.after, 31 * DAY - 3_600_000);
        assert_eq!(
            s.window(utc(2027, 3, 31) + 22 * 3_600_000 - 1).0,
            s.boundary
        );
        let late = span(Unit::Month, "Europe/Berlin", utc(2027, 3, 30))?;
        assert_eq!(late.boundary, utc(2027, 3, 31) + 22 * 3_600_000);
        Ok(())
    }

    #[test]
    fn a_day_whose_midnight_is_skipped_starts_at_the_change() -> Result<(), String> {
        // America/Santiago moved its clocks from 24:00 to 01:00 on 2024-09-08 (-04:00 to
        // -03:00): that day starts at 04:00 UTC and lasts 23 hours.
        let s = span(
            Unit::Day,
            "America/Santiago",
            utc(2024, 9, 8) + 12 * 3_600_000,
        )?;
        let (start, end) = s.window(utc(2024, 9, 8) + 12 * 3_600_000);
        assert_eq!(start, utc(2024, 9, 8) + 4 * 3_600_000);
        assert_eq!(end - start, 23 * 3_600_000);
        Ok(())
    }

    /// The period of `t` in `zone` by jiff's own calendar (its dates, month and year ends, the
    /// weekday), the reference the contract's arithmetic is held to.
    fn reference(unit: Unit, zone: &str, t: u64) -> Result<(u64, u64), String> {
        use jiff::ToSpan;
        let e = |x: jiff::Error| x.to_string();
        let tz = match Zone::parse(zone)? {
            Zone::Fixed(m) => TimeZone::fixed(jiff::tz::Offset::from_seconds(m * 60).map_err(e)?),
            Zone::Named(name) => named(name)?,
        };
        let t_ms = i64::try_from(t).map_err(|x| x.to_string())?;
        let d = Timestamp::from_millisecond(t_ms)
            .map_err(e)?
            .to_zoned(tz.clone())
            .date();
        let (start, next) = match unit {
            Unit::Day => (d, d.tomorrow().map_err(e)?),
            Unit::Week => {
                let back = i64::from(d.weekday().to_monday_zero_offset());
                let monday = d.checked_sub(back.days()).map_err(e)?;
                (monday, monday.checked_add(7.days()).map_err(e)?)
            }
            Unit::Month => (d.first_of_month(), d.last_of_month().tomorrow().map_err(e)?),
            Unit::Year => (d.first_of_year(), d.last_of_year().tomorrow().map_err(e)?),
        };
        let at = |d: Date| -> Result<u64, String> {
            let ms = d
                .to_zoned(tz.clone())
                .map_err(e)?
                .timestamp()
                .as_millisecond();
            u64::try_from(ms).map_err(|x| x.to_string())
        };
        Ok((at(start)?, at(next)?))
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        /// Every unit in fixed offsets and in zones with daylight saving (Santiago's and Lord Howe's
        /// half hour among them), over 1972..2100, leap years and month ends included (1970's
        /// periods east of UTC start before the epoch, which the spans clamp to 0).
        #[test]
        fn periods_are_the_reference_calendar_s(
            t in 63_072_000_000u64..4_102_444_800_000,
            unit in proptest::sample::select(Unit::ALL.to_vec()),
            zone in proptest::sample::select(vec![
                "UTC", "+05:30", "-08:00", "+14:00", "-12:00", "+05:45",
                "Europe/Berlin", "America/New_York", "America/Santiago",
                "Australia/Lord_Howe", "Asia/Kathmandu", "Pacific/Apia", "Africa/Casablanca",
            ]),
        ) {
            let fail = proptest::test_runner::TestCaseError::fail;
            let got = span(unit, zone, t).map_err(fail)?.window(t);
            let want = reference(unit, zone, t).map_err(fail)?;
            proptest::prop_assert_eq!(got, want, "{:?} in {} at {}", unit, zone, t);
        }
    }

    #[test]
    fn offsets_and_names_are_checked() -> Result<(), String> {
        assert_eq!(
            span(Unit::Week, "+05:30", utc(2026, 12, 6))?,
            Span::fixed(Unit::Week, 330, utc(2026, 12, 6))
        );
        assert!(check_zone("UTC").is_ok() && check_zone("Asia/Kolkata").is_ok());
        assert!(check_zone("Mars/Olympus").is_err_and(|e| e.contains("IANA")));
        assert!(check_zone("+15:00").is_err());
        let dec1 = utc(2026, 12, 1) - 3_600_000;
        assert_eq!(format(dec1, "Europe/Berlin")?, "2026-12-01T00:00:00+01:00");
        assert_eq!(format(dec1, "+05:30")?, "2026-12-01T04:30:00+05:30");
        Ok(())
    }
}
