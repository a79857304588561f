#!/usr/bin/env bash
# User-space instructions per proxied request, counted by valgrind's callgrind: the floor
# (bench/floor.rs) and Sluice, on one mock, JSON (or SSE with BENCH_STREAM=1) at 4
# connections (BENCH_CONNS). Unlike the timings of run.sh and ab.sh, the count hardly moves from run
# to run or with what else the machine is doing, so it shows a change of a few percent
# in the request path's own work; it does not see lock contention, nor cache misses
# unless asked (BENCH_CACHE, below).
# Every thread of the gateway is counted (the access log's writer included); the warm-up
# is not.
#
#   ./bench/instructions.sh                  # both, the build in target/release
#   BENCH_WHICH=sluice BENCH_KEEP=/tmp/cg ./bench/instructions.sh
#   BENCH_HEADERS=sdk ./bench/instructions.sh   # sixteen request headers, as an SDK sends (post.lua)
#   BENCH_BODY_KB=64 ./bench/instructions.sh    # a coding agent's 64 KiB body (post.lua)
#
# BENCH_KEEP keeps the callgrind files (PREFIX-sluice.out, PREFIX-floor.out) for
# `callgrind_annotate --inclusive=yes FILE`. BENCH_CACHE=1 simulates the caches too and
# adds first-level instruction and data misses and last-level data misses per request
# (valgrind's model of the caches, not the machine's counters, which this VM lacks);
# BENCH_LL=524288,8,64 (with BENCH_CACHE=1) sizes the last level like one core's
# 512 KiB L2 instead of the L3. valgrind runs the gateway's threads one at a time
# through one simulated cache, so the misses are a model's, not any real core's.
# Needs valgrind (apt-get install valgrind).
set -euo pipefail
cd "$(dirname "$0")/.."
WHICH=${BENCH_WHICH:-"floor sluice"}
STREAM=${BENCH_STREAM:-0}
CONNS=${BENCH_CONNS:-4}
SIM=""
[ "${BENCH_CACHE:-0}" = 1 ] && SIM="--cache-sim=yes ${BENCH_LL:+--LL=$BENCH_LL}"
. bench/lib.sh
require valgrind wrk
start_mock --chunks 8 --chunk-interval 0ms
KEEP=${BENCH_KEEP:-$WORK/cg}

# wrap NAME BINARY -> a directory holding NAME: BINARY under callgrind, into $KEEP-NAME.out
# shellcheck disable=SC2086 # SIM holds zero to two options
wrap() { callgrind_wrap "$1" "$2" "$KEEP-$1.out" $SIM; }

# count NAME ADDR PID -> a table row: NAME, requests, Ir, Ir per request (and, with the
# cache simulated, I1, D1 and last-level data misses per request)
count() {
  local out n
  BENCH_STREAM=$STREAM wrk -t1 -c"$CONNS" -d3s -s bench/post.lua "http://$2/v1/chat/completions" >/dev/null
  callgrind_control -i on "$3" >/dev/null 2>&1
  out=$(BENCH_STREAM=$STREAM wrk -t1 -c"$CONNS" -d6s -s bench/post.lua "http://$2/v1/chat/completions")
  callgrind_control -i off "$3" >/dev/null 2>&1
  callgrind_control -d "$3" >/dev/null 2>&1
  sleep 1
  n=$(echo "$out" | awk '/requests in/ {print $1}')
  # The dump on request is the first part (.1); the one at exit would hold nothing more.
  # With the cache simulated, the totals are Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw.
  callgrind_annotate "$KEEP-$1.out.1" 2>/dev/null | awk -v name="$1" -v n="$n" '
    /PROGRAM TOTALS/ {
      gsub(/\([0-9.]+%\)/, ""); gsub(",", "")
      printf "| %s | %d | %d | %.0f |", name, n, $1, $1 / n
      if ($9 ~ /^[0-9]+$/) printf " %.0f | %.0f | %.0f |", $4 / n, ($5 + $6) / n, ($8 + $9) / n
      printf "\n" }'
}

echo "user-space instructions per request ($(date -u +%Y-%m-%dT%H:%M:%SZ), mode $([ "$STREAM" = 1 ] && echo stream || echo json), $CONNS connections, $([ -n "${BENCH_HEADERS:-}" ] && echo "BENCH_HEADERS=$BENCH_HEADERS" || echo "3 request headers"), $([ -n "${BENCH_BODY_KB:-}" ] && echo "BENCH_BODY_KB=$BENCH_BODY_KB" || echo "the small body"))"
if [ -n "$SIM" ]; then
  echo "| gateway | requests | instructions | per request | I1 misses per request | D1 misses per request | LL data misses per request |"
  echo "|---|---|---|---|---|---|---|"
else
  echo "| gateway | requests | instructions | per request |"
  echo "|---|---|---|---|"
fi
for w in $WHICH; do
  case $w in
    floor)
      FLOOR_BIN=$(wrap floor "${FLOOR_BIN:-$BIN/examples/floor}")/floor start_floor
      count floor "$FLOOR" "$FLOOR_PID" ;;
    sluice)
      BIN=$(wrap sluice "$BIN/sluice") start_sluice
      count sluice "$SLUICE" "$SLUICE_PID" ;;
  esac
done
