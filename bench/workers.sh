#!/usr/bin/env bash
# What a second client worker costs per request: Sluice and the bare floor, each with one
# worker and then two, loaded in turn on one mock (8 SSE chunks, no delay) at
# BENCH_CONNS (default 32) for BENCH_DURATION (default 5s). Prints user and kernel µs per
# request (from /proc/PID/stat). A cost that Sluice pays for a second worker and the
# floor does not is work on memory both workers write (shared counters, locks, reference
# counts) or time spent parking, not the I/O path.
#
#   BENCH_DURATION=5s BENCH_CONNS=32 ./bench/workers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${BENCH_DURATION:-5s}
CONNS=${BENCH_CONNS:-32}
. bench/lib.sh
require wrk
start_mock --chunks 8 --chunk-interval 0ms

# measure NAME ADDR PID -> one line: user and kernel µs per request
measure() {
  local b a out n
  wrk -t2 -c"$CONNS" -d2s -s bench/post.lua "http://$2/v1/chat/completions" >/dev/null
  b=$(awk '{print $14, $15}' "/proc/$3/stat")
  out=$(wrk -t2 -c"$CONNS" -d"$DUR" -s bench/post.lua "http://$2/v1/chat/completions" 2>&1)
  a=$(awk '{print $14, $15}' "/proc/$3/stat")
  echo "$out" | grep -q "Non-2xx" && { echo "bench: non-2xx answers from $1" >&2; exit 1; }
  n=$(echo "$out" | awk '/requests in/ {print $1}')
  echo "$b $a" | awk -v name="$1" -v n="$n" -v hz="$TICKS" \
    '{printf "| %s | %.2f | %.2f | %d |\n", name, ($3 - $1) * 1e6 / hz / n, ($4 - $2) * 1e6 / hz / n, n}'
}

echo "## $(date -u +%Y-%m-%dT%H:%M:%SZ) — client workers, $(nproc) cores, $CONNS connections, $DUR"
echo
echo "| gateway | user µs/req | kernel µs/req | requests |"
echo "|---|---|---|---|"
for t in 1 2; do
  SLUICE_THREADS=$t start_sluice "workers$t"
  measure "Sluice, $t worker(s)" "$SLUICE" "$SLUICE_PID"
  kill "$SLUICE_PID"
  FLOOR_THREADS=$t start_floor
  measure "floor, $t worker(s)" "$FLOOR" "$FLOOR_PID"
  kill "$FLOOR_PID"
done
