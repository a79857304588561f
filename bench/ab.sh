#!/usr/bin/env bash
# A/B of two Sluice builds against one mock, in one run: the builds' gateways run side by
# side and are loaded in alternation (A, B, A, B, …), so machine drift falls on both.
# Prints requests/s and gateway CPU µs per request (utime+stime from /proc ÷ requests)
# per round, their medians and the median of the rounds' B ÷ A. Use it to show a change
# does not slow the hot path.
#
#   BENCH_BIN_A=/path/to/old/release BENCH_BIN_B=target/release \
#     BENCH_ROUNDS=5 BENCH_DURATION=8s BENCH_CONNS=32 ./bench/ab.sh
#
# BENCH_MOCK sets the mock's arguments (default "--chunks 8 --chunk-interval 0ms"), e.g.
# "--chunks 6 --chunk-interval 25ms" for streams that wait between chunks.
set -euo pipefail
cd "$(dirname "$0")/.."
A=${BENCH_BIN_A:?set BENCH_BIN_A to the release dir of build A}
B=${BENCH_BIN_B:-target/release}
ROUNDS=${BENCH_ROUNDS:-5}
DUR=${BENCH_DURATION:-8s}
CONNS=${BENCH_CONNS:-32}
BENCH_BIN=$B . bench/lib.sh
require wrk
rounds_or_exit BENCH_ROUNDS "$ROUNDS"
# shellcheck disable=SC2086 # BENCH_MOCK holds several arguments
start_mock ${BENCH_MOCK:---chunks 8 --chunk-interval 0ms}
BIN=$A start_sluice a; SA=$SLUICE; PA=$SLUICE_PID
BIN=$B start_sluice b; SB=$SLUICE; PB=$SLUICE_PID
THREADS=$(( CONNS < 2 ? 1 : 2 ))

# one ADDR PID STREAM -> "rps cpu_us_per_request"
one() {
  local before after out rps n
  before=$(cpu_ticks "$2")
  out=$(BENCH_STREAM=$3 wrk -t"$THREADS" -c"$CONNS" -d"$DUR" -s bench/post.lua "http://$1/v1/chat/completions" 2>&1)
  after=$(cpu_ticks "$2")
  echo "$out" | grep -q "Non-2xx" && { echo "bench: non-2xx from $1" >&2; echo "$out" >&2; exit 1; }
  rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
  n=$(echo "$out" | awk '/requests in/ {print $1}')
  echo "$rps $(awk -v t=$((after - before)) -v hz="$TICKS" -v n="$n" 'BEGIN{printf "%.1f", t / hz * 1e6 / n}')"
}

echo "A=$A  B=$B  rounds=$ROUNDS  duration=$DUR  conns=$CONNS  ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) cores)"
for stream in 0 1; do
  mode=$([ "$stream" = 1 ] && echo stream || echo json)
  ra=(); rb=(); ca=(); cb=()
  for r in $(seq 1 "$ROUNDS"); do
    read -r x y <<<"$(one "$SA" "$PA" "$stream")"; ra+=("$x"); ca+=("$y")
    read -r x y <<<"$(one "$SB" "$PB" "$stream")"; rb+=("$x"); cb+=("$y")
    echo "$mode round $r: A ${ra[-1]} rps ${ca[-1]} µs/req | B ${rb[-1]} rps ${cb[-1]} µs/req"
  done
  mra=$(fmt 2 "$(median "${ra[@]}")"); mrb=$(fmt 2 "$(median "${rb[@]}")")
  mca=$(fmt 1 "$(median "${ca[@]}")"); mcb=$(fmt 1 "$(median "${cb[@]}")")
  echo "| $mode | $CONNS | $mra | $mrb | $(fmt 2 "$(median_ratio ra rb)") | $mca | $mcb |"
done
