# The filter's native build (an Envoy 1.40 dynamic module, `make native`): one layer, one file,
# `libtollgate.so` at the root, for a Kubernetes image volume mounted where
# ENVOY_DYNAMIC_MODULES_SEARCH_PATH points (docs/deploy.md, 3g) or a COPY --from into an Envoy 1.40
# image. `make image` builds the same image without a container engine (scripts/image.sh):
#   docker build -f images/native.Dockerfile -t tollgate-native dist/   # needs dist/libtollgate.so
FROM scratch
LABEL io.tollgate.envoy-version="1.40.0"
COPY libtollgate.so ./
