#!/usr/bin/env bash
# Release binaries whose machine code is laid out by LLVM BOLT from a profile of
# Sluice's own request path: the code a proxied request runs is packed together and
# what it never runs is moved aside, so a request touches fewer instruction-cache lines
# (docs/decisions.md, "Post-link layout with BOLT"). Link with relocations kept, run an
# instrumented copy through the training run of the profile-guided build (JSON and SSE
# at 1, 32 and 128 connections, and the common refusals), then rewrite the binaries
# with the counts. The bench's floor gets the same treatment from its own run, so the
# bench compares like with like. The profile is made from the current source every
# time and never committed.
#
#   ./scripts/bolt-build.sh         # or: make bolt      -> target/bolt/opt/
#   ./scripts/bolt-build.sh --pgo   # or: make pgo-bolt  -> target/pgo-bolt/ (runs make pgo, then BOLT)
#
# With --pgo, the profile-guided build is made here (its binaries in target/pgo/release
# then keep their relocation sections: larger files, the same code).
#
# Bench the result with `BENCH_BIN=target/bolt/opt ./bench/run.sh` (the floor is taken
# from BENCH_BIN/examples). Needs llvm-bolt (`apt-get install -y bolt-19`, or
# LLVM_BOLT=path), wrk and curl. No hardware counters are needed: the profile comes
# from BOLT's own instrumentation.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v wrk >/dev/null || { echo "bolt: wrk is required (apt-get install wrk)" >&2; exit 2; }
command -v curl >/dev/null || { echo "bolt: curl is required (apt-get install curl)" >&2; exit 2; }

. scripts/profiling.sh

# llvm-bolt: $LLVM_BOLT, else one on the PATH, else the newest Debian /usr/lib/llvm-N's.
find_bolt() {
  if [ -n "${LLVM_BOLT:-}" ]; then echo "$LLVM_BOLT"; return; fi
  if command -v llvm-bolt >/dev/null; then command -v llvm-bolt; return; fi
  debian_llvm llvm-bolt
}
BOLT=$(find_bolt || true)
[ -n "$BOLT" ] && [ -x "$BOLT" ] || {
  echo "bolt: llvm-bolt not found: set LLVM_BOLT, or apt-get install -y bolt-19" >&2
  exit 2
}

case "${1:-}" in
  "" | --pgo) ;;
  *) echo "bolt: unknown argument '$1' (usage: scripts/bolt-build.sh [--pgo])" >&2; exit 2 ;;
esac
# BOLT can move whole functions only in a binary linked with its relocations.
RELOCS="-C link-arg=-Wl,--emit-relocs"
if [ "${1:-}" = --pgo ]; then
  echo "bolt: 1/4 profile-guided build with relocations (make pgo)"
  RUSTFLAGS="${RUSTFLAGS:-} $RELOCS" ./scripts/pgo-build.sh
  SRC=target/pgo/release
  OUT=target/pgo-bolt
else
  echo "bolt: 1/4 release build with relocations (target/bolt)"
  RUSTFLAGS="${RUSTFLAGS:-} $RELOCS" CARGO_TARGET_DIR=target/bolt cargo build --release --bins
  RUSTFLAGS="${RUSTFLAGS:-} $RELOCS" CARGO_TARGET_DIR=target/bolt \
    cargo build --release --example floor
  SRC=target/bolt/release
  OUT=target/bolt/opt
fi
PROF=$PWD/$OUT/profile
rm -rf "$OUT"
mkdir -p "$OUT/examples" "$OUT/instrumented" "$PROF"

echo "bolt: 2/4 instrumented copies"
# The counts are written every second (a killed process writes none at its end).
for b in sluice examples/floor; do
  "$BOLT" "$SRC/$b" -instrument -o "$OUT/instrumented/${b#examples/}" \
    --instrumentation-file="$PROF/${b#examples/}.fdata" \
    --instrumentation-sleep-time=1 --instrumentation-no-counters-clear >"$PROF/${b#examples/}-instrument.log" 2>&1 ||
    { cat "$PROF/${b#examples/}-instrument.log" >&2; exit 1; }
done
cp "$SRC/sluice-mock" "$OUT/instrumented/"

echo "bolt: 3/4 training run"
(
  BENCH_BIN=$OUT/instrumented . bench/lib.sh
  start_mock --chunks 8 --chunk-interval 0ms
  start_sluice
  FLOOR_BIN=$OUT/instrumented/floor start_floor
  echo "bolt:  sluice"
  train "http://$SLUICE/v1/chat/completions" refusals
  echo "bolt:  floor"
  train "http://$FLOOR/v1/chat/completions"
  # Each instrumented process forked a writer that rewrites its profile every second
  # and once more after the process is gone: let them finish before the file is read.
  sleep 2
  writers=$(pgrep -P "$SLUICE_PID" -d ' ' || true; pgrep -P "$FLOOR_PID" -d ' ' || true)
  kill "$SLUICE_PID" "$FLOOR_PID" 2>/dev/null || true
  wait "$SLUICE_PID" "$FLOOR_PID" 2>/dev/null || true
  for w in $writers; do
    for _ in $(seq 1 100); do
      kill -0 "$w" 2>/dev/null || break
      sleep 0.1
    done
  done
)
for p in sluice floor; do
  [ -s "$PROF/$p.fdata" ] || { echo "bolt: the training run wrote no profile for $p" >&2; exit 1; }
done

echo "bolt: 4/4 optimised binaries ($OUT)"
# As rustc's own build lays out LLVM: blocks by ext-TSP, functions by cache-directed
# sort, hot and cold parts of each function split apart, identical functions folded.
OPTS=(-reorder-blocks=ext-tsp -reorder-functions=cdsort -split-functions -split-strategy=cdsplit
  -split-all-cold -split-eh -icf=1 -use-gnu-stack -dyno-stats)
for b in sluice examples/floor; do
  "$BOLT" "$SRC/$b" -o "$OUT/$b" -data="$PROF/${b#examples/}.fdata" "${OPTS[@]}" \
    >"$PROF/${b#examples/}-optimise.log" 2>&1 || { cat "$PROF/${b#examples/}-optimise.log" >&2; exit 1; }
done
cp "$SRC/sluice-mock" "$OUT/"
rm -rf "$OUT/instrumented"

# The rewritten gateway and floor must still answer: a JSON and an SSE request on the mock.
(
  BENCH_BIN=$OUT . bench/lib.sh
  start_mock --chunks 8 --chunk-interval 0ms
  start_sluice
  start_floor
  body='{"model":"bench","messages":[{"role":"user","content":"hi"}]'
  for target in "Sluice $SLUICE" "floor $FLOOR"; do
    read -r name addr <<<"$target"
    url="http://$addr/v1/chat/completions"
    code=$(curl -s -m 10 -o "$WORK/json" -w '%{http_code}' "$url" -H 'content-type: application/json' -d "$body}" || true)
    [ "$code" = 200 ] || { echo "bolt: the optimised $name answered '$code'" >&2; exit 1; }
    { curl -s -m 10 "$url" -H 'content-type: application/json' -d "$body,\"stream\":true}" || true; } |
      grep -q '\[DONE\]' || { echo "bolt: the optimised $name's SSE answer did not end with [DONE]" >&2; exit 1; }
  done
)
{ grep -h "executed instructions\|taken branches" "$PROF/sluice-optimise.log" || true; } | tail -2 | sed 's/^/bolt: sluice /'
echo "bolt: done: $OUT/sluice"
