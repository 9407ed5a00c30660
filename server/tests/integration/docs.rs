//! The limits files shown in README.md and docs/*.md (blocks marked `yaml limits`, the convention
//! in testkit's `docs` module) are accepted by the service's reader of the RLS limits file. The
//! filter's and Envoy's blocks are checked in tests/docs.rs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use tollgate_server::rls::config::Limits;
use tollgate_testkit::docs::{self, Kind};

#[test]
fn limits_files_are_accepted_by_the_service() {
    let blocks = docs::blocks_of(Kind::Limits);
    assert!(!blocks.is_empty(), "no `yaml limits` block in the docs");
    let refused: Vec<String> = blocks
        .iter()
        .filter_map(|b| {
            Limits::parse(&b.text)
                .err()
                .map(|e| format!("{}: the service refuses it: {e}\n{}", b.place(), b.text))
        })
        .collect();
    assert!(refused.is_empty(), "{}", refused.join("\n\n"));
}

/// The check can fail: a limits file with an unknown unit is refused.
#[test]
fn a_wrong_limits_file_is_refused() {
    let doc = "```yaml limits\ndomain: edge\ndescriptors:\n  - key: path\n    rate_limit: {unit: fortnight, requests_per_unit: 5}\n```\n";
    let blocks = docs::blocks("sample.md", doc);
    assert_eq!(blocks[0].kind(), Ok(Kind::Limits));
    assert!(Limits::parse(&blocks[0].text).is_err());
}

/// docs/migrating.md's tables name only flags the service accepts.
#[test]
fn every_flag_the_page_names_exists() {
    use clap::CommandFactory;
    let page = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/migrating.md"),
    )
    .expect("read docs/migrating.md");
    let cmd = tollgate_server::cli::Cli::command();
    let known: Vec<String> = cmd
        .get_arguments()
        .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
        .collect();
    // Every inline `--flag` (a backtick, two dashes, a letter), up to its value or its end.
    let named: Vec<&str> = page
        .match_indices("`--")
        .filter_map(|(at, _)| page.get(at + 1..))
        .filter(|rest| rest.chars().nth(2).is_some_and(|c| c.is_ascii_lowercase()))
        .filter_map(|rest| rest.split(['`', ' ', '=']).next())
        .collect();
    assert!(named.len() >= 8, "{named:?}");
    for flag in named {
        assert!(
            known.iter().any(|k| k == flag),
            "docs/migrating.md names {flag}"
        );
    }
}
