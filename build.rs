//! Stamps the filter with the git commit it was built from, logged at VM start.
//!
//! `TOLLGATE_GIT_HASH` in the environment wins (builds from a source tarball or a container
//! context without `.git`); otherwise `git rev-parse`, with `-dirty` when the tree has local
//! changes; otherwise `unknown`.
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    Command::new("git")
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
}

fn main() {
    println!("cargo:rerun-if-env-changed=TOLLGATE_GIT_HASH");
    // Only paths that exist: cargo counts a missing one as changed on every build, which rebuilt
    // the filter, the service that links its reader, and every test binary each time (a fresh
    // clone has no `.git/packed-refs`).
    for path in [
        ".git/HEAD",
        ".git/refs/heads",
        ".git/packed-refs",
        ".git/index",
    ] {
        if std::path::Path::new(path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=Cargo.toml");
    let hash = std::env::var("TOLLGATE_GIT_HASH")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            let head = git(&["rev-parse", "--short=12", "HEAD"])?;
            // Only files of the filter count: a change elsewhere does not make the module dirty.
            // `--no-optional-locks`: `git status` would otherwise refresh and rewrite the index,
            // which this script watches: the next build would run it again and rebuild the
            // filter, the service and every test binary.
            let dirty = git(&[
                "--no-optional-locks",
                "status",
                "--porcelain",
                "--",
                "src",
                "Cargo.toml",
                "build.rs",
            ])
            .is_some_and(|s| !s.is_empty());
            Some(if dirty { format!("{head}-dirty") } else { head })
        })
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=TOLLGATE_GIT_HASH={hash}");
}
