//! Calendar windows (algorithm `calendar_window`): a take names its unit and zone, the service
//! computes the span from its clock, the store counts by its own; over HTTP, on both stores.

use crate::common::{self, post_take, Service};

use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tollgate_server::store::Store;

use contract::calendar::{days_from_civil, DAY_MS};

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// The next local midnight at a fixed offset (minutes east), in ms since the epoch.
fn next_midnight(offset_minutes: i64) -> u64 {
    let off = offset_minutes * 60_000;
    let day = (now_ms() as i64 + off).div_euclid(DAY_MS);
    ((day + 1) * DAY_MS - off) as u64
}

/// The first of next month at UTC midnight.
fn next_month_utc() -> u64 {
    let (y, m, _) = contract::calendar::civil_from_days(now_ms() as i64 / DAY_MS);
    let (y, m) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
    (days_from_civil(y, m, 1) * DAY_MS) as u64
}

fn calendar_bucket(key: &str, capacity: u64, cost: u64, unit: &str, zone: Option<&str>) -> Value {
    let mut b = json!({"key": key, "capacity": capacity, "period_ms": 2_678_400_000u64,
        "cost": cost, "algorithm": "calendar_window", "calendar": unit});
    if let Some(z) = zone {
        b["time_zone"] = json!(z);
    }
    b
}

/// A day at +05:30: its capacity, then denials whose `Retry-After` is that midnight; a month in
/// UTC resets on the 1st.
async fn counts_until_the_calendar_says(store: Arc<dyn Store>) {
    let svc = Service::start(store, None).await;
    let client = reqwest::Client::new();
    let key = common::unique("cal-day");
    for left in [2, 0] {
        let (s, body) = post_take(
            &client,
            &svc,
            &json!({"buckets": [calendar_bucket(&key, 4, 2, "day", Some("+05:30"))]}),
        )
        .await;
        assert_eq!(s, 200, "{body}");
        assert_eq!(body["allowed"], true, "{body}");
        assert_eq!(body["buckets"][0]["remaining"], left, "{body}");
    }
    let asked = now_ms();
    let (_, body) = post_take(
        &client,
        &svc,
        &json!({"buckets": [calendar_bucket(&key, 4, 1, "day", Some("+05:30"))]}),
    )
    .await;
    assert_eq!(body["allowed"], false, "{body}");
    let retry = body["buckets"][0]["retry_after_ms"].as_u64().unwrap();
    let midnight = next_midnight(330);
    let expect = midnight - asked;
    assert!(
        retry <= expect + 50 && retry + 2_000 >= expect,
        "retry {retry} ms, the midnight at +05:30 is {expect} ms away"
    );
    assert_eq!(body["buckets"][0]["reset_ms"].as_u64(), Some(retry));

    // A month in UTC, as a named zone: its reset is the 1st.
    let key = common::unique("cal-month");
    let (_, body) = post_take(
        &client,
        &svc,
        &json!({"buckets": [calendar_bucket(&key, 500, 20, "month", Some("Etc/UTC"))]}),
    )
    .await;
    assert_eq!(body["allowed"], true, "{body}");
    let reset = body["buckets"][0]["reset_ms"].as_u64().unwrap();
    let expect = next_month_utc() - now_ms();
    assert!(
        reset.abs_diff(expect) < 2_000,
        "reset {reset}, the 1st is {expect} ms away"
    );
    svc.stop().await;
}

/// What is not a calendar is refused with its field named.
async fn refuses_what_is_not_a_calendar(store: Arc<dyn Store>) {
    let svc = Service::start(store, None).await;
    let client = reqwest::Client::new();
    let key = common::unique("cal-bad");
    for (bucket, field) in [
        (calendar_bucket(&key, 4, 1, "fortnight", None), "calendar"),
        (
            calendar_bucket(&key, 4, 1, "day", Some("Mars/Olympus")),
            "time_zone",
        ),
        (
            calendar_bucket(&key, 4, 1, "day", Some("+15:00")),
            "time_zone",
        ),
        (
            json!({"key": key, "capacity": 4, "period_ms": 1000, "algorithm": "calendar_window"}),
            "calendar",
        ),
        (
            json!({"key": key, "capacity": 4, "period_ms": 1000, "calendar": "day"}),
            "calendar",
        ),
        (
            json!({"key": key, "capacity": 4, "period_ms": 1000, "time_zone": "UTC"}),
            "time_zone",
        ),
    ] {
        let (s, body) = post_take(&client, &svc, &json!({ "buckets": [bucket] })).await;
        assert_eq!(s, 400, "{bucket}: {body}");
        assert_eq!(
            body["error"]["field"],
            format!("buckets[0].{field}"),
            "{bucket}: {body}"
        );
    }
    svc.stop().await;
}

/// A month's reservation settled: the unused part comes back to that month, given its window.
async fn a_reservation_settles_in_its_month(store: Arc<dyn Store>) {
    let svc = Service::start(store, None).await;
    let client = reqwest::Client::new();
    let key = common::unique("cal-settle");
    let b = calendar_bucket(&key, 100, 80, "month", Some("Europe/Berlin"));
    let (_, body) = post_take(&client, &svc, &json!({ "buckets": [b.clone()] })).await;
    assert_eq!(body["buckets"][0]["remaining"], 20, "{body}");
    let window = body["buckets"][0]["window"].as_u64();
    assert!(
        window.is_some_and(|w| w > 0),
        "the answer names the month charged: {body}"
    );
    let mut sb = b.clone();
    let o = sb.as_object_mut().unwrap();
    o.remove("cost");
    o.insert("estimate".into(), json!(80));
    o.insert("used".into(), json!(30));
    if let Some(w) = window {
        o.insert("window".into(), json!(w));
    }
    let resp = client
        .post(svc.url("/v1/settle"))
        .json(&json!({"id": common::unique("s"), "buckets": [sb]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["buckets"][0]["remaining"], 70, "{body}");
    svc.stop().await;
}

crate::store_suite!(
    counts_until_the_calendar_says,
    refuses_what_is_not_a_calendar,
    a_reservation_settles_in_its_month,
);
