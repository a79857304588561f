# Sluice — developer entry points. `make run` and `make test` work on a fresh machine.
CARGO ?= cargo

# Placeholder credentials for the demo config (conf/demo.yaml) and the bundled mock.
# They are not secrets: the mock accepts any key.
export SLUICE_ADMIN_TOKEN ?= demo-admin-token
export DEMO_MOCK_KEY_1 ?= demo-key-1
export DEMO_MOCK_KEY_2 ?= demo-key-2

.PHONY: all build run test lint check bench fmt clean

all: build

build:
	$(CARGO) build --release --bins

## Start the mock upstream and the gateway on conf/demo.yaml (Ctrl-C stops both).
run: build
	./deploy/run-demo.sh

## Unit, property and integration tests (integration tests spawn the real binaries).
## Benchmarks are linted by `make lint` and run by `make bench`, not here.
test:
	$(CARGO) test --lib --bins --tests

## Formatting and lints, warnings are errors; the pure layers stay pure (the check
## proves it catches each kind of violation first).
lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings
	./scripts/check-purity.sh --self-test
	./scripts/check-purity.sh

## Validate the shipped configs and the operator kit: the Kubernetes manifest, the
## dashboard and the alert rules against what the gateway exports (tests/deploy.rs), and
## the rules with promtool (syntax and their unit tests) when it is installed.
check:
	$(CARGO) run --quiet --bin sluice -- check --config conf/demo.yaml
	SLUICE_KEY_TEAM_A=example OPENAI_KEY_1=example OPENAI_KEY_2=example ANTHROPIC_KEY=example \
		$(CARGO) run --quiet --bin sluice -- check --config conf/sluice.yaml
	$(CARGO) test --quiet --test deploy
	@if command -v promtool >/dev/null; then \
		promtool check rules deploy/prometheus/alerts.yaml && \
		promtool test rules deploy/prometheus/alerts_test.yaml; \
	else echo "check: promtool not installed; alert rules checked by tests/deploy.rs only"; fi

## Side-by-side benchmark: direct mock vs the bare floor (no layers) vs Sluice (vs nginx when
## installed), CPU µs per request for each gateway, medians of 3 interleaved rounds per
## cell; then 1,000 and 8,000
## concurrent SSE streams (RSS per stream, added chunk gap), 1,000 again opened over one
## chunk interval instead of at once (the delay one chunk gets), then the selection
## micro-benchmark (bench/RESULTS.md has the recorded runs).
bench: build
	$(CARGO) build --release --example floor --example streams
	BENCH_ROUNDS=$${BENCH_ROUNDS:-3} BENCH_DURATION=$${BENCH_DURATION:-4s} ./bench/run.sh
	BENCH_STREAM_SPREAD_MS=0 ./bench/streams.sh
	BENCH_STREAMS=1000 BENCH_STREAM_SPREAD_MS=500 ./bench/streams.sh
	$(CARGO) bench --bench selection

## User-space instructions per request of the floor and Sluice, then per streamed chunk,
## counted by callgrind (needs valgrind): the steady measure of the request path's own work.
.PHONY: bench-instructions
bench-instructions: build
	$(CARGO) build --release --example floor --example streams
	./bench/instructions.sh
	./bench/chunks.sh

## A release build optimised with a profile of the request path (PGO; needs llvm-profdata,
## e.g. `apt-get install -y llvm-19`): binaries in target/pgo/release. Bench them with
## `BENCH_BIN=target/pgo/release ./bench/run.sh` (docs/decisions.md, "Profile-guided builds").
.PHONY: pgo
pgo:
	./scripts/pgo-build.sh

## Release binaries laid out by BOLT from a profile of the request path (needs llvm-bolt,
## e.g. `apt-get install -y bolt-19`): in target/bolt/opt (`make bolt`), or on top of
## the profile-guided build in target/pgo-bolt (`make pgo-bolt`). Bench them with
## `BENCH_BIN=target/bolt/opt ./bench/run.sh` (docs/decisions.md, "Post-link layout with BOLT").
.PHONY: bolt pgo-bolt
bolt:
	./scripts/bolt-build.sh
pgo-bolt:
	./scripts/bolt-build.sh --pgo

## The redis state backend against redb in one run (uncapped, and with a cluster-wide
## cap), needs redis-server (bench/RESULTS.md has the recorded runs).
.PHONY: bench-shared
bench-shared: build
	./bench/shared.sh

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean

## Standing reliability runs, never part of `make test` (docs/RELIABILITY.md).
## chaos: ~4 min of random upstream faults and a kill -9 under load
## (CHAOS_SECS, CHAOS_SEED, CHAOS_CLIENTS).
## soak: 10 min of mildly faulty traffic, gateway RSS and fds sampled every 10 s
## (SOAK_SECS, SOAK_CLIENTS, SOAK_SEED).
.PHONY: chaos soak
chaos:
	$(CARGO) test --release --test chaos -- --ignored --nocapture

soak:
	$(CARGO) test --release --test soak -- --ignored --nocapture
