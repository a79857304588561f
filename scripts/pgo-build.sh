#!/usr/bin/env bash
# A release build optimised with a profile of Sluice's own request path (PGO): build
# with instrumentation, proxy JSON and SSE requests (and a few refused ones) through it
# on the bundled mock, merge the counts, build again with them. The binaries land in
# target/pgo/release (sluice, sluice-mock, and the bench's floor and streams examples,
# which share the profile of the library code they run). The profile is made from the
# current source every time, so it is never stale; nothing of it is committed.
#
#   ./scripts/pgo-build.sh        # or: make pgo
#
# Needs wrk, curl and an llvm-profdata that reads the raw profiles of rustc's LLVM
# (found as below): rustup's `rustup component add llvm-tools` always does; Debian's
# llvm-19 reads rustc 1.95's (`apt-get install -y llvm-19`).
# RUSTFLAGS from the environment are kept (and, as with any RUSTFLAGS, replace
# `build.rustflags` of a cargo config). Takes about three release builds' time.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v wrk >/dev/null || { echo "pgo: wrk is required (apt-get install wrk)" >&2; exit 2; }

. scripts/profiling.sh

# llvm-profdata: $LLVM_PROFDATA, else rustup's llvm-tools (rustc's own LLVM), else the
# Debian llvm-N nearest below rustc's LLVM (a newer one may write an indexed profile
# rustc cannot read).
find_profdata() {
  if [ -n "${LLVM_PROFDATA:-}" ]; then echo "$LLVM_PROFDATA"; return; fi
  local tools major
  tools="$(rustc --print sysroot)/lib/rustlib/$(rustc -vV | awk '/^host:/ {print $2}')/bin/llvm-profdata"
  if [ -x "$tools" ]; then echo "$tools"; return; fi
  major=$(rustc -vV | awk '/^LLVM version:/ {split($3, v, "."); print v[1]}')
  debian_llvm llvm-profdata "${major:-0}"
}
PROFDATA=$(find_profdata || true)
[ -n "$PROFDATA" ] && [ -x "$PROFDATA" ] || {
  echo "pgo: llvm-profdata not found: set LLVM_PROFDATA, or rustup component add llvm-tools, or apt-get install -y llvm-19" >&2
  exit 2
}
command -v curl >/dev/null || { echo "pgo: curl is required (apt-get install curl)" >&2; exit 2; }
echo "pgo: llvm-profdata: $PROFDATA"

OUT=target/pgo
PROF=$PWD/$OUT/profile
rm -rf "$PROF"
mkdir -p "$PROF/raw"

echo "pgo: 1/3 instrumented build ($OUT/gen)"
# The build scripts are instrumented too; their counts go to a directory of their own.
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-generate=$PROF/build" CARGO_TARGET_DIR=$OUT/gen \
  cargo build --release --bins

echo "pgo: 2/3 training run"
BENCH_BIN=$OUT/gen/release . bench/lib.sh
LLVM_PROFILE_FILE=$WORK/mock-%p.profraw start_mock --chunks 8 --chunk-interval 0ms
LLVM_PROFILE_FILE=$PROF/raw/sluice-%p.profraw start_sluice
train "http://$SLUICE/v1/chat/completions" refusals | sed 's/^/pgo:/'
# The counts are written when the process exits.
kill "$SLUICE_PID"
wait "$SLUICE_PID" 2>/dev/null || true
ls "$PROF"/raw/*.profraw >/dev/null 2>&1 || { echo "pgo: the training run wrote no profile" >&2; exit 1; }
"$PROFDATA" merge -o "$PROF/merged.profdata" "$PROF"/raw/*.profraw
# Named by its content: cargo rebuilds a registry crate when RUSTFLAGS change, not when a
# file they name does, so a new profile must come with a new path.
USE=$PROF/sluice-$(sha256sum "$PROF/merged.profdata" | cut -c1-16).profdata
mv "$PROF/merged.profdata" "$USE"

echo "pgo: 3/3 optimised build ($OUT/release)"
# The binaries exactly as instrumented (the examples, built apart, may turn on
# dev-dependency features of shared crates, whose code the profile did not see).
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-use=$USE" CARGO_TARGET_DIR=$OUT cargo build --release --bins
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-use=$USE" CARGO_TARGET_DIR=$OUT \
  cargo build --release --example floor --example streams
echo "pgo: done: $OUT/release/sluice"
