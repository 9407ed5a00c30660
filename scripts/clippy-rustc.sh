#!/usr/bin/env bash
# RUSTC_WORKSPACE_WRAPPER for `make test`: the workspace's own crates are compiled by clippy-driver
# (rustc with Clippy's lints), warnings denied, so building the tests also lints them: the
# dependencies are compiled once, for the tests, instead of once more in check mode for a separate
# `cargo clippy` pass. Cargo calls it as `clippy-rustc.sh <rustc> <args...>`, and only for
# workspace members; dependencies go to plain rustc. `make lint` still runs `cargo clippy` alone.
set -euo pipefail
driver=${CLIPPY_DRIVER:-$(rustup which clippy-driver 2>/dev/null || command -v clippy-driver || true)}
if [ -z "$driver" ]; then
  echo "clippy-driver not found: rustup component add clippy" >&2
  exit 1
fi
exec "$driver" "$@" -D warnings
