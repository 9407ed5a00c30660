//! docs/migrating.md, checked: its limits files load as the service loads them and mean what the
//! page says (that every flag its tables name is one the service accepts is checked in
//! server/tests/integration/docs.rs, beside the command line).

use super::config::Limits;

const PAGE: &str = include_str!("../../../docs/migrating.md");

/// The page's limits files, in order: the fenced blocks whose info string is `yaml limits` (the
/// docs test parses every such block too; these tests check what they mean).
const BLOCKS: [&str; 2] = ["migrating:ratelimit", "migrating:limitador"];

/// The limits file `tag` of [`BLOCKS`].
fn block(tag: &str) -> Option<String> {
    let n = BLOCKS.iter().position(|t| *t == tag)?;
    let open = "```yaml limits\n";
    let mut rest = PAGE;
    for _ in 0..n {
        rest = rest.get(rest.find(open)? + open.len()..)?;
    }
    let start = rest.find(open)? + open.len();
    let len = rest.get(start..)?.find("```")?;
    rest.get(start..start + len).map(str::to_string)
}

fn limits(tag: &str) -> Limits {
    let text = block(tag).unwrap_or_default();
    match Limits::parse(&text) {
        Ok(l) => l,
        Err(e) => unreachable!("docs/migrating.md, block {tag}: {e}"),
    }
}

/// `(requests_per_unit, period_ms)` of the limit for `entries` in `domain`.
fn limit(l: &Limits, domain: &str, entries: &[(&str, &str)]) -> Option<(u64, u64)> {
    l.lookup(domain, entries.iter().copied())
        .map(|f| (f.limit.requests_per_unit, f.limit.period_ms()))
}

#[test]
fn the_envoyproxy_ratelimit_file_loads_as_written() {
    let l = limits("migrating:ratelimit");
    assert_eq!(l.domains(), vec!["edge", "internal"]);
    assert_eq!(
        limit(&l, "edge", &[("remote_address", "10.0.0.1")]),
        Some((100, 60_000))
    );
    let login = l.lookup(
        "edge",
        [("path", "/login"), ("remote_address", "a")].into_iter(),
    );
    assert_eq!(
        login
            .as_ref()
            .map(|f| (f.limit.requests_per_unit, f.limit.detailed_metric)),
        Some((20, true))
    );
    assert_eq!(
        limit(&l, "edge", &[("plan", "free")]),
        Some((1000, 7 * 86_400_000))
    );
    let paid = l.lookup("edge", [("plan", "paid")].into_iter());
    assert_eq!(paid.map(|f| f.limit.unlimited), Some(true));
    let shadow = l.lookup("internal", [("client", "c")].into_iter());
    assert_eq!(shadow.map(|f| f.limit.shadow_mode), Some(true));
}

#[test]
fn the_limitador_conversion_loads_and_keys_per_user() {
    let l = limits("migrating:limitador");
    assert_eq!(
        limit(&l, "api", &[("path", "/login"), ("user", "u1")]),
        Some((5, 60_000))
    );
    assert_eq!(limit(&l, "api", &[("user", "u1")]), Some((1000, 3_600_000)));
    assert_eq!(
        limit(&l, "api", &[("path", "/other"), ("user", "u1")]),
        None
    );
}
