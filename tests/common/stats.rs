//! Envoy's admin `/stats` text, read as numbers.

use super::envoy_process::Envoy;
use super::http::http_get;
use std::collections::BTreeMap;

/// The prefix Envoy gives the module's stats.
pub const TOLLGATE_STATS: &str = "wasmcustom.tollgate.";

/// Admin `/stats` text as name -> value; lines that are not a plain number (histograms) are skipped.
pub fn parse_stats(text: &str) -> BTreeMap<String, u64> {
    text.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(": ")?;
            Some((k.trim().to_string(), v.trim().parse().ok()?))
        })
        .collect()
}

/// The Tollgate stats among `stats`, by their names without [`TOLLGATE_STATS`].
pub fn tollgate_stats(stats: BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    stats
        .into_iter()
        .filter_map(|(k, v)| Some((k.strip_prefix(TOLLGATE_STATS)?.to_string(), v)))
        .collect()
}

/// The Tollgate stats of several Envoys, summed name by name.
pub fn tg_total(envoys: &[Envoy]) -> BTreeMap<String, u64> {
    let mut sum: BTreeMap<String, u64> = BTreeMap::new();
    for e in envoys {
        for (k, v) in e.tg_all() {
            *sum.entry(k).or_default() += v;
        }
    }
    sum
}

/// The Tollgate stats of the Envoy whose admin listens on `admin_port`; `None` on an admin hiccup
/// (for samplers that leave a gap rather than fail the test).
pub fn tollgate_stats_at(admin_port: u16) -> Option<BTreeMap<String, u64>> {
    let reply = http_get(admin_port, &format!("/stats?filter=^{TOLLGATE_STATS}"))?;
    (reply.status == 200).then(|| tollgate_stats(parse_stats(&reply.body)))
}
