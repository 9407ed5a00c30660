#!/usr/bin/env bash
# Builds Tollgate's OCI images as OCI image layouts, without a container engine:
#
#   OUT/tollgate-filter-compat  the filter as images/filter.Dockerfile makes it (`FROM scratch`,
#                               `COPY plugin.wasm ./`): one tar+gzip layer holding plugin.wasm
#   OUT/tollgate-filter         the filter as a Wasm OCI artifact: config and two layers typed
#                               application/vnd.module.wasm.{config.v1+json,content.layer.v1+wasm}
#   OUT/tollgate-native         the filter's native build (an Envoy 1.40 dynamic module), as
#                               images/native.Dockerfile makes it: one layer holding
#                               libtollgate.so at the root (an image volume, or a COPY into an
#                               Envoy 1.40 image); the Envoy version it fits is in its annotations
#   OUT/tollgate-server         the service as images/server.Dockerfile makes it: static binary,
#                               /etc/passwd, uid 65532, port 8081, no shell
#   OUT/digests.txt             "<name> <manifest digest> <manifest size>" per image: the digest is
#                               what WasmPlugin.spec.sha256 pins (without the "sha256:" prefix)
#
# Each layout holds one manifest tagged with the crate version. Push one with
#   skopeo copy oci:OUT/tollgate-filter:0.1.0 docker://REGISTRY/tollgate-filter:0.1.0
# skopeo keeps the manifest bytes, so the digest in the registry is the one in digests.txt.
#
# Why by hand: every byte is decided here (file order, owners, modes, mtimes = SOURCE_DATE_EPOCH,
# gzip without name or time, compact JSON), so two builds of the same inputs give the same digests.
#
#   scripts/image.sh [OUT]      OUT defaults to dist/images
# Inputs (env): TOLLGATE_WASM (dist/tollgate.wasm), TOLLGATE_NATIVE (dist/libtollgate.so),
# TOLLGATE_SERVER_STATIC
# (dist/tollgate-server-static, a static musl build), SOURCE_DATE_EPOCH (default: the HEAD commit
# time, or 0 outside git), TOLLGATE_IMAGE_TAG (default: the workspace version).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-$ROOT/dist/images}"
WASM="${TOLLGATE_WASM:-$ROOT/dist/tollgate.wasm}"
SERVER="${TOLLGATE_SERVER_STATIC:-$ROOT/dist/tollgate-server-static}"
NATIVE="${TOLLGATE_NATIVE:-$ROOT/dist/libtollgate.so}"
# The Envoy the native build is built against and tested with (its dynamic module ABI, v0.2.0).
NATIVE_ENVOY=1.40.0

die() { printf 'image: %s\n' "$*" >&2; exit 1; }
[ -f "$WASM" ] || die "missing $WASM (make wasm)"
[ -f "$SERVER" ] || die "missing $SERVER (make image builds it with the musl target)"
[ -f "$NATIVE" ] || die "missing $NATIVE (make native)"
[ "$(head -c 4 "$WASM" | od -An -tx1 | tr -d ' ')" = 0061736d ] || die "$WASM is not a wasm module"
# A dynamically linked binary would not start in an image without libc.
if LC_ALL=C readelf -l "$SERVER" 2>/dev/null | grep -q 'Requesting program interpreter'; then
  die "$SERVER is dynamically linked; build it for x86_64-unknown-linux-musl"
fi

if [ -z "${SOURCE_DATE_EPOCH:-}" ]; then
  SOURCE_DATE_EPOCH="$(git -C "$ROOT" log -1 --format=%ct 2>/dev/null || echo 0)"
fi
CREATED="$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)"
TAG="${TOLLGATE_IMAGE_TAG:-$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -1)}"
REVISION="$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
[ -n "$TAG" ] || die "no version found in Cargo.toml"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"

MT_MANIFEST=application/vnd.oci.image.manifest.v1+json
MT_INDEX=application/vnd.oci.image.index.v1+json
MT_CONFIG=application/vnd.oci.image.config.v1+json
MT_LAYER=application/vnd.oci.image.layer.v1.tar+gzip
MT_WASM_CONFIG=application/vnd.module.wasm.config.v1+json
MT_WASM_LAYER=application/vnd.module.wasm.content.layer.v1+wasm

# new_layout DIR: an empty OCI image layout.
new_layout() {
  rm -rf "$1"
  mkdir -p "$1/blobs/sha256"
  printf '{"imageLayoutVersion":"1.0.0"}' > "$1/oci-layout"
}

# add_blob LAYOUT FILE: stores FILE as a blob; sets DIGEST (sha256:...) and SIZE.
add_blob() {
  local hex
  hex="$(sha256sum "$2" | cut -d' ' -f1)"
  cp "$2" "$1/blobs/sha256/$hex"
  DIGEST="sha256:$hex"
  SIZE="$(stat -c %s "$2")"
}

# descriptor MEDIATYPE [ANNOTATIONS_JSON]: a descriptor for the last add_blob.
descriptor() {
  if [ -n "${2:-}" ]; then
    printf '{"mediaType":"%s","digest":"%s","size":%s,"annotations":%s}' "$1" "$DIGEST" "$SIZE" "$2"
  else
    printf '{"mediaType":"%s","digest":"%s","size":%s}' "$1" "$DIGEST" "$SIZE"
  fi
}

# tar_layer ROOTFS TAR_OUT GZ_OUT: a reproducible layer from a directory; sets DIFF_ID.
tar_layer() {
  (cd "$1" && find . -mindepth 1 -printf '%P\n' | LC_ALL=C sort) > "$WORK/files"
  tar --create --file="$2" --directory="$1" --format=ustar --no-recursion \
    --owner=0 --group=0 --numeric-owner --mtime="@$SOURCE_DATE_EPOCH" \
    --verbatim-files-from --files-from="$WORK/files"
  DIFF_ID="sha256:$(sha256sum "$2" | cut -d' ' -f1)"
  gzip -n -9 -c "$2" > "$3"
}

# finish LAYOUT NAME MANIFEST_FILE: stores the manifest, writes index.json, records the digest.
finish() {
  add_blob "$1" "$3"
  printf '{"schemaVersion":2,"mediaType":"%s","manifests":[%s]}' "$MT_INDEX" \
    "$(descriptor "$MT_MANIFEST" "{\"org.opencontainers.image.ref.name\":\"$TAG\"}")" > "$1/index.json"
  printf '%s %s %s\n' "$2" "$DIGEST" "$SIZE" >> "$WORK/digests.txt"
  printf 'image: %-24s %s  (manifest %s bytes)\n' "$2" "$DIGEST" "$SIZE" >&2
}

ANNOTATIONS="\"org.opencontainers.image.created\":\"$CREATED\",\"org.opencontainers.image.version\":\"$TAG\",\"org.opencontainers.image.revision\":\"$REVISION\",\"org.opencontainers.image.source\":\"tollgate\""

# 1. The compat image: FROM scratch, COPY plugin.wasm ./
L="$OUT/tollgate-filter-compat"
new_layout "$L"
mkdir -p "$WORK/filter-root"
install -m 0644 "$WASM" "$WORK/filter-root/plugin.wasm"
tar_layer "$WORK/filter-root" "$WORK/filter.tar" "$WORK/filter.tar.gz"
add_blob "$L" "$WORK/filter.tar.gz"
LAYER="$(descriptor "$MT_LAYER")"
printf '{"created":"%s","architecture":"amd64","os":"linux","config":{},"rootfs":{"type":"layers","diff_ids":["%s"]},"history":[{"created":"%s","created_by":"COPY plugin.wasm ./"}]}' \
  "$CREATED" "$DIFF_ID" "$CREATED" > "$WORK/filter-config.json"
add_blob "$L" "$WORK/filter-config.json"
printf '{"schemaVersion":2,"mediaType":"%s","config":%s,"layers":[%s],"annotations":{%s,"module.wasm.image/variant":"compat"}}' \
  "$MT_MANIFEST" "$(descriptor "$MT_CONFIG")" "$LAYER" "$ANNOTATIONS" > "$WORK/filter-manifest.json"
finish "$L" tollgate-filter-compat "$WORK/filter-manifest.json"

# 2. The Wasm OCI artifact: the runtime config (as config and as first layer) and the raw module.
L="$OUT/tollgate-filter"
new_layout "$L"
printf '{"type":"envoy_proxy","abiVersions":["proxy_abi_version_0_2_1"],"config":{"root_ids":[]}}' > "$WORK/runtime-config.json"
add_blob "$L" "$WORK/runtime-config.json"
CONFIG="$(descriptor "$MT_WASM_CONFIG")"
CONFIG_LAYER="$(descriptor "$MT_WASM_CONFIG" '{"org.opencontainers.image.title":"runtime-config.json"}')"
add_blob "$L" "$WASM"
WASM_LAYER="$(descriptor "$MT_WASM_LAYER" '{"org.opencontainers.image.title":"plugin.wasm"}')"
printf '{"schemaVersion":2,"mediaType":"%s","config":%s,"layers":[%s,%s],"annotations":{%s}}' \
  "$MT_MANIFEST" "$CONFIG" "$CONFIG_LAYER" "$WASM_LAYER" "$ANNOTATIONS" > "$WORK/artifact-manifest.json"
finish "$L" tollgate-filter "$WORK/artifact-manifest.json"

# 3. The native build: FROM scratch, COPY libtollgate.so ./ (for an image volume mounted where
# ENVOY_DYNAMIC_MODULES_SEARCH_PATH points, or a COPY into an Envoy image of the version it fits).
L="$OUT/tollgate-native"
new_layout "$L"
mkdir -p "$WORK/native-root"
install -m 0644 "$NATIVE" "$WORK/native-root/libtollgate.so"
tar_layer "$WORK/native-root" "$WORK/native.tar" "$WORK/native.tar.gz"
add_blob "$L" "$WORK/native.tar.gz"
LAYER="$(descriptor "$MT_LAYER")"
printf '{"created":"%s","architecture":"amd64","os":"linux","config":{"Labels":{"org.opencontainers.image.version":"%s","io.tollgate.envoy-version":"%s"}},"rootfs":{"type":"layers","diff_ids":["%s"]},"history":[{"created":"%s","created_by":"COPY libtollgate.so ./"}]}' \
  "$CREATED" "$TAG" "$NATIVE_ENVOY" "$DIFF_ID" "$CREATED" > "$WORK/native-config.json"
add_blob "$L" "$WORK/native-config.json"
printf '{"schemaVersion":2,"mediaType":"%s","config":%s,"layers":[%s],"annotations":{%s,"io.tollgate.envoy-version":"%s"}}' \
  "$MT_MANIFEST" "$(descriptor "$MT_CONFIG")" "$LAYER" "$ANNOTATIONS" "$NATIVE_ENVOY" > "$WORK/native-manifest.json"
finish "$L" tollgate-native "$WORK/native-manifest.json"

# 4. The service: static binary, passwd/group for uid 65532, nothing else (no shell, no libc).
L="$OUT/tollgate-server"
new_layout "$L"
R="$WORK/server-root"
mkdir -p "$R/etc" "$R/usr/local/bin"
chmod 0755 "$R" "$R/etc" "$R/usr" "$R/usr/local" "$R/usr/local/bin"
printf 'nonroot:x:65532:65532:nonroot:/nonexistent:/sbin/nologin\n' > "$R/etc/passwd"
printf 'nonroot:x:65532:\n' > "$R/etc/group"
chmod 0644 "$R/etc/passwd" "$R/etc/group"
install -m 0755 "$SERVER" "$R/usr/local/bin/tollgate-server"
tar_layer "$R" "$WORK/server.tar" "$WORK/server.tar.gz"
add_blob "$L" "$WORK/server.tar.gz"
LAYER="$(descriptor "$MT_LAYER")"
printf '{"created":"%s","architecture":"amd64","os":"linux","config":{"User":"65532:65532","ExposedPorts":{"8081/tcp":{}},"Env":["PATH=/usr/local/bin","TOLLGATE_LISTEN=0.0.0.0:8081"],"Entrypoint":["/usr/local/bin/tollgate-server"],"WorkingDir":"/","Labels":{"org.opencontainers.image.version":"%s"}},"rootfs":{"type":"layers","diff_ids":["%s"]},"history":[{"created":"%s","created_by":"COPY tollgate-server-static /usr/local/bin/tollgate-server (+ /etc/passwd, /etc/group)"}]}' \
  "$CREATED" "$TAG" "$DIFF_ID" "$CREATED" > "$WORK/server-config.json"
add_blob "$L" "$WORK/server-config.json"
printf '{"schemaVersion":2,"mediaType":"%s","config":%s,"layers":[%s],"annotations":{%s}}' \
  "$MT_MANIFEST" "$(descriptor "$MT_CONFIG")" "$LAYER" "$ANNOTATIONS" > "$WORK/server-manifest.json"
finish "$L" tollgate-server "$WORK/server-manifest.json"

cp "$WORK/digests.txt" "$OUT/digests.txt"
printf 'image: tag %s, created %s, layouts in %s\n' "$TAG" "$CREATED" "$OUT" >&2
