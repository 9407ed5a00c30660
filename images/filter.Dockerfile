# The filter as the "compat" Wasm image Istio's agent and Envoy Gateway accept: one layer, one file,
# `plugin.wasm` at the root. `make image` builds the same image without a container engine
# (scripts/image.sh writes the OCI layout directly, with fixed timestamps so the digest is reproducible):
#   docker build -f images/filter.Dockerfile -t tollgate-filter dist/   # needs dist/plugin.wasm
FROM scratch
COPY plugin.wasm ./
