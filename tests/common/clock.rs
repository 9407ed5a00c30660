//! The wall clock, for tests of windows: Redis `TIME` on this machine is the system clock, so a
//! window of `period_ms` is `floor(now / period_ms)` on both.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is after 1970");
    u64::try_from(since.as_millis()).expect("milliseconds fit in u64")
}

/// Sleeps until `at_ms` into the next window of `period_ms`.
pub fn sleep_into_next_window(period_ms: u64, at_ms: u64) {
    let now = now_ms();
    let next = (now / period_ms + 1) * period_ms;
    std::thread::sleep(Duration::from_millis(next + at_ms - now));
}
