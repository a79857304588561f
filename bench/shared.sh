#!/usr/bin/env bash
# The redis state backend against redb, in one run (SPEC §7.1, issue #11): two gateways of
# the same build, one on an embedded redb file and one on a private redis-server, loaded
# in alternation (A, B, A, B, …) so machine drift falls on both. Two cases:
#   - uncapped: the hot path is local-first, no Redis round-trip per request;
#   - capped (`max_concurrent`): every attempt takes a cluster-wide permit (one script
#     call) and gives it back (one ZREM), the strongly consistent cost.
# Prints requests/s and gateway CPU µs per request per round, their medians and the
# median of the rounds' redis ÷ redb (Redis's own CPU is shown apart: it is a separate
# process, often a separate machine).
#
#   BENCH_ROUNDS=5 BENCH_DURATION=8s BENCH_CONNS=32 ./bench/shared.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${BENCH_ROUNDS:-5}
DUR=${BENCH_DURATION:-8s}
CONNS=${BENCH_CONNS:-32}
CAP=${BENCH_CAP:-64}
. bench/lib.sh
require wrk redis-server
rounds_or_exit BENCH_ROUNDS "$ROUNDS"
start_mock --chunks 8 --chunk-interval 0ms
RPORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
redis-server --port "$RPORT" --bind 127.0.0.1 --save "" --appendonly no >"$WORK/redis.log" 2>&1 &
RPID=$!; PIDS+=("$RPID")
for _ in $(seq 1 100); do redis-cli -p "$RPORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
export BENCH_REDIS_URL="redis://127.0.0.1:$RPORT/"
REDIS_STATE='{ backend: redis, redis: { url_env: BENCH_REDIS_URL, key_prefix: "bench:" } }'
THREADS=$(( CONNS < 2 ? 1 : 2 ))

one() {
  local before after rbefore rafter out rps n
  before=$(cpu_ticks "$2"); rbefore=$(cpu_ticks "$RPID")
  out=$(BENCH_STREAM=0 wrk -t"$THREADS" -c"$CONNS" -d"$DUR" -s bench/post.lua "http://$1/v1/chat/completions" 2>&1)
  after=$(cpu_ticks "$2"); rafter=$(cpu_ticks "$RPID")
  echo "$out" | grep -q "Non-2xx" && { echo "bench: non-2xx from $1" >&2; echo "$out" >&2; exit 1; }
  rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
  n=$(echo "$out" | awk '/requests in/ {print $1}')
  echo "$rps $(awk -v t=$((after - before)) -v hz="$TICKS" -v n="$n" 'BEGIN{printf "%.1f", t / hz * 1e6 / n}') $(awk -v t=$((rafter - rbefore)) -v hz="$TICKS" -v n="$n" 'BEGIN{printf "%.1f", t / hz * 1e6 / n}')"
}

echo "redb (A) vs redis (B)  rounds=$ROUNDS  duration=$DUR  conns=$CONNS  ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) cores, $(redis-server --version | awk '{print $3}'))"
echo "| case | c | redb req/s | redis req/s | redis ÷ redb | redb µs/req | redis µs/req | redis-server µs/req |"
echo "|---|---|---|---|---|---|---|---|"
for case in uncapped capped; do
  extra=""; [ "$case" = capped ] && extra=", max_concurrent: $CAP"
  SLUICE_CONN_EXTRA=$extra start_sluice "redb-$case"; SA=$SLUICE; PA=$SLUICE_PID
  SLUICE_CONN_EXTRA=$extra SLUICE_STATE=$REDIS_STATE start_sluice "redis-$case"; SB=$SLUICE; PB=$SLUICE_PID
  ra=(); rb=(); ca=(); cb=(); cr=()
  for r in $(seq 1 "$ROUNDS"); do
    read -r x y _ <<<"$(one "$SA" "$PA")"; ra+=("$x"); ca+=("$y")
    read -r x y z <<<"$(one "$SB" "$PB")"; rb+=("$x"); cb+=("$y"); cr+=("$z")
    echo "$case round $r: redb ${ra[-1]} rps ${ca[-1]} µs/req | redis ${rb[-1]} rps ${cb[-1]} µs/req (+ redis-server ${cr[-1]})" >&2
  done
  mra=$(fmt 2 "$(median "${ra[@]}")"); mrb=$(fmt 2 "$(median "${rb[@]}")")
  mca=$(fmt 1 "$(median "${ca[@]}")"); mcb=$(fmt 1 "$(median "${cb[@]}")")
  mcr=$(fmt 1 "$(median "${cr[@]}")")
  echo "| $case | $CONNS | $mra | $mrb | $(fmt 2 "$(median_ratio ra rb)") | $mca | $mcb | $mcr |"
  kill "$PA" "$PB" 2>/dev/null || true
done
