# syntax=docker/dockerfile:1
# tollgate-server: one static (musl) binary, no shell, no libc, runs as an unprivileged numeric uid.
# `make image` builds the equivalent OCI image without a container engine (scripts/image.sh).
# The Redis client trusts the webpki root store compiled into the binary, so rediss:// needs no CA
# bundle in the image (a private CA is not trusted: terminate TLS with a public certificate).
#   docker build -f images/server.Dockerfile -t tollgate-server dist/   # needs dist/tollgate-server-static
FROM scratch
COPY --chmod=0644 <<PASSWD /etc/passwd
nonroot:x:65532:65532:nonroot:/nonexistent:/sbin/nologin
PASSWD
COPY --chmod=0644 <<GROUP /etc/group
nonroot:x:65532:
GROUP
COPY --chmod=0755 tollgate-server-static /usr/local/bin/tollgate-server
USER 65532:65532
ENV TOLLGATE_LISTEN=0.0.0.0:8081
EXPOSE 8081
ENTRYPOINT ["/usr/local/bin/tollgate-server"]
