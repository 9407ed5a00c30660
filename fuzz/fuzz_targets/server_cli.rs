//! The service's flags (`cli::Cli`, clap) over any argument list: the input split at NUL bytes,
//! each piece one argument (any bytes, not only UTF-8); the `TOLLGATE_*` environment is cleared.
//!
//! Properties: no panic (clap's own checks of the flag definitions run in this build); what
//! parses is shown by `Debug` (which the service logs at startup) without the bearer token and
//! without the password of any Redis URL; the settings derived from it are usable (their tokens
//! pass `check_token`); a key prefix
//! that passes its check keeps every bucket's keys in the bucket's Cluster slot.
#![no_main]

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::sync::{Once, OnceLock};

use clap::{CommandFactory, FromArgMatches};
use libfuzzer_sys::fuzz_target;
use tollgate_server::cli::{check_token, Cli};
use tollgate_server::domain::{Algorithm, BucketSpec};
use tollgate_server::store::keys::{check_prefix, redis_key, slot};

/// Where the password of a URL is, as RFC 3986 reads it: after a scheme (a letter, then letters,
/// digits, `+`, `-`, `.`; leading controls and spaces skipped, as URL parsers do) comes `://`, the
/// authority runs to the first `/`, `?` or `#`, its user information to the last `@`, and the
/// password follows the first `:` of that.
fn password(url: &str) -> Option<std::ops::Range<usize>> {
    let begin = url.len() - url.trim_start_matches(|c: char| c <= ' ').len();
    let colon = begin + url[begin..].find(':')?;
    let scheme = &url[begin..colon];
    let scheme_ok = scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
    if !scheme_ok || !url[colon..].starts_with("://") {
        return None;
    }
    let start = colon + 3;
    let rest = &url[start..];
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let userinfo = &authority[..authority.rfind('@')?];
    Some(start + userinfo.find(':')? + 1..start + userinfo.len())
}

/// `secret` must not show in `shown` unless it shows in `without` too (the same output with the
/// secret taken out: then it is just text that happens to be there). Secrets with a `*` are left
/// out: the redaction mark itself could contain them.
fn hidden(secret: &str, shown: &str, without: &str, what: &str) {
    if secret.len() >= 4 && !secret.contains('*') && !without.contains(secret) {
        assert!(!shown.contains(secret), "{what} {secret:?} shown: {shown}");
    }
}

fuzz_target!(|data: &[u8]| {
    static CLEAR: Once = Once::new();
    CLEAR.call_once(|| {
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("TOLLGATE_") {
                std::env::remove_var(k);
            }
        }
    });
    let args = std::iter::once(OsString::from("tollgate-server")).chain(
        data.split(|&b| b == 0)
            .filter(|a| !data.is_empty() || !a.is_empty())
            .map(|a| OsString::from_vec(a.to_vec())),
    );
    // The command is built (and checked by clap's debug assertions) once; parsing a clone of it
    // is what `Cli::try_parse_from` does, without building it again for every input.
    static COMMAND: OnceLock<clap::Command> = OnceLock::new();
    let command = COMMAND.get_or_init(|| {
        let mut c = Cli::command();
        c.build();
        c
    });
    let Ok(matches) = command.clone().try_get_matches_from(args) else {
        return;
    };
    let cli = Cli::from_arg_matches(&matches).expect("matches of its own command");
    let shown = format!("{cli:?}");

    if let Some(token) = &cli.token {
        let mut without = cli.clone();
        without.token = None;
        hidden(token, &shown, &format!("{without:?}"), "token");
    }
    // Each URL's password, with that one URL blanked in the comparison (another flag may hold
    // the same text where it is no password, e.g. in a URL without an authority).
    let n_url = usize::from(cli.redis_url.is_some());
    let urls: Vec<&String> = cli.redis_url.iter().chain(&cli.redis_cluster).collect();
    for (i, url) in urls.into_iter().enumerate() {
        let Some(at) = password(url) else { continue };
        let pw = &url[at.clone()];
        let mut without = cli.clone();
        let blanked = format!("{}{}", &url[..at.start], &url[at.end..]);
        match i.checked_sub(n_url) {
            None => without.redis_url = Some(blanked),
            Some(j) => without.redis_cluster[j] = blanked,
        }
        hidden(pw, &shown, &format!("{without:?}"), "Redis password");
    }

    // The token file is not read here: its path could be anything.
    if cli.token_file.is_none() {
        if let Ok(cfg) = cli.service_config() {
            for t in cfg.token.iter().chain(&cfg.admin_token) {
                assert!(!t.is_empty() && !t.bytes().any(|b| b.is_ascii_control()));
                assert!(check_token(t).is_ok(), "a token the service refuses: {t:?}");
            }
            for d in [
                cfg.header_timeout,
                cfg.body_timeout,
                cfg.idle_timeout,
                cfg.ready_interval,
            ] {
                assert!(!d.is_zero());
            }
        }
    }

    if check_prefix(&cli.key_prefix).is_ok() {
        let spec = BucketSpec {
            key: "per-ip|203.0.113.7".into(),
            capacity: 10,
            rate: 10,
            period_ms: 1000,
            cost: 1,
            algorithm: Algorithm::FixedWindow,
            lease: 1,
            max_delay_ms: 0,
        };
        let key = redis_key(&cli.key_prefix, &spec);
        assert_eq!(slot(&key), slot("{per-ip|203.0.113.7}"), "{key:?}");
    }
});
