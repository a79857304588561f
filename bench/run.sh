#!/usr/bin/env bash
# Side-by-side benchmark (SPEC §10): the same mock upstream called directly, through the
# bare floor (bench/floor.rs: Sluice's I/O path and Pingora's connector, no layers, no logging), through
# Sluice, and through nginx (when installed), non-streaming and streaming, at several
# concurrencies, in one run on one machine. Prints requests/s, p50/p99 latency, gateway
# CPU µs per request (utime+stime from /proc ÷ requests) and the ratios; writes the
# table to bench/out/<timestamp>.md as well, and every round's own figures to
# bench/out/<timestamp>.rounds.tsv (mode, conns, round, target, rps, p50 and p99 ms, CPU
# µs per request), so a cell's median can be traced back to its rounds.
#
#   BENCH_DURATION=10s BENCH_CONNS="1 32 128" ./bench/run.sh
#   BENCH_ROUNDS=3 BENCH_DURATION=4s ./bench/run.sh   # each cell measured in 3 rounds
#
# With BENCH_ROUNDS=N every cell is measured N times, the targets taking turns (each
# round starts with the next one, so none is always first after a pause); the table
# shows the median of each figure, and each ratio is the median of the ratios of the
# same round, so a slow stretch of the machine moves both sides of a ratio together.
#
# Needs: wrk (apt-get install wrk); nginx is optional (apt-get install nginx).
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${BENCH_DURATION:-10s}
CONNS=${BENCH_CONNS:-"1 32 128"}
ROUNDS=${BENCH_ROUNDS:-1}
. bench/lib.sh
rounds_or_exit BENCH_ROUNDS "$ROUNDS"
start_side_by_side

# to_ms "123.45us" -> milliseconds
to_ms() { awk -v v="$1" 'BEGIN{ n=v+0; if (v ~ /us$/) n/=1000; else if (v ~ /ms$/) n=n; else if (v ~ /s$/) n*=1000; printf "%.3f", n }'; }


# run_wrk ADDR STREAM CONNS [PID...] -> "rps p50ms p99ms cpu_us_per_request" (CPU of
# the PIDs, "-" without any)
run_wrk() {
  local addr=$1 stream=$2 c=$3 out threads=2 before=0 after
  shift 3
  [ "$c" -lt 2 ] && threads=1
  [ $# -gt 0 ] && before=$(cpu_ticks "$@")
  out=$(BENCH_STREAM=$stream wrk -t"$threads" -c"$c" -d"$DUR" --latency -s bench/post.lua "http://$addr/v1/chat/completions" 2>&1)
  if echo "$out" | grep -q "Non-2xx"; then echo "bench: non-2xx answers from $addr:" >&2; echo "$out" >&2; exit 1; fi
  local rps p50 p99 n us="-"
  rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
  p50=$(echo "$out" | awk '$1=="50%" {print $2}')
  p99=$(echo "$out" | awk '$1=="99%" {print $2}')
  n=$(echo "$out" | awk '/requests in/ {print $1}')
  if [ $# -gt 0 ]; then
    after=$(cpu_ticks "$@")
    us=$(awk -v t=$(( after - before )) -v hz="$TICKS" -v n="$n" 'BEGIN{printf "%.1f", t * 1e6 / hz / n}')
  fi
  echo "$rps $(to_ms "$p50") $(to_ms "$p99") $us"
}

STAMP=$(date -u +%Y-%m-%dT%H:%M:%SZ)
mkdir -p bench/out
REPORT="bench/out/$(date -u +%Y%m%d-%H%M%S).md"
ROUNDS_TSV="${REPORT%.md}.rounds.tsv"
printf 'mode\tconns\tround\ttarget\trps\tp50_ms\tp99_ms\tcpu_us_per_req\n' >"$ROUNDS_TSV"
{
  echo "## $STAMP — $(uname -m), $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
  echo
  # Every setting that picks what is measured, so the line reruns the same comparison.
  extra=""
  for v in BENCH_HEADERS BENCH_BODY_KB FLOOR_BIN FLOOR_THREADS SLUICE_THREADS SLUICE_LOG SLUICE_SERVER_EXTRA SLUICE_CONN_EXTRA SLUICE_STATE; do
    if [ -n "${!v:-}" ]; then extra="$extra $(printf '%s=%q' "$v" "${!v}")"; fi
  done
  echo "Command: \`BENCH_BIN=$BIN$extra BENCH_DURATION=$DUR BENCH_CONNS=\"$CONNS\" BENCH_ROUNDS=$ROUNDS ./bench/run.sh\` (checkout $(git describe --always --dirty 2>/dev/null || echo unknown), wrk $(wrk -v 2>&1 | awk 'NR==1{print $2}'), mock: 8 SSE chunks, no delay)"
  [ "$ROUNDS" -gt 1 ] && echo && echo "Each figure is the median of $ROUNDS rounds; each ratio the median of the rounds' ratios."
  echo
  echo "| mode | conns | direct rps | floor rps | sluice rps | nginx rps | sluice/nginx | sluice/floor | floor/nginx | p50/p99 ms direct | floor | sluice | nginx | sluice added p50/p99 ms | CPU µs/req floor | sluice | nginx | sluice CPU ÷ nginx |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
} | tee "$REPORT"
TARGETS=(direct floor sluice nginx)
# The figures of one cell, F[TARGET,FIELD,ROUND] (FIELD: rps p50 p99 us), read by:
# each NAME TARGET FIELD -> the values of every round, into the array NAME
each() { local -n into=$1; into=(); for ((r = 0; r < ROUNDS; r++)); do into+=("${F[$2,$3,$r]:--}"); done; }
# med TARGET FIELD -> the median over the rounds
med() { local v; each v "$1" "$2"; median "${v[@]}"; }
# per_round OP A FIELD B FIELD -> the median over the rounds of A's FIELD op B's
per_round() {
  local v=() x y
  for ((r = 0; r < ROUNDS; r++)); do
    x=${F[$2,$3,$r]:--}; y=${F[$4,$5,$r]:--}
    case $1 in
      ratio) v+=("$(ratio "$x" "$y")") ;;
      minus) v+=("$(awk -v a="$x" -v b="$y" 'BEGIN{ if (a == "-" || b == "-") print "-"; else printf "%.3f", a - b }')") ;;
    esac
  done
  median "${v[@]}"
}
ms() { fmt 3 "$(med "$1" "$2")"; }
for stream in 0 1; do
  mode=$([ "$stream" = 1 ] && echo stream || echo json)
  for c in $CONNS; do
    declare -A F=()
    for ((r = 0; r < ROUNDS; r++)); do
      for ((k = 0; k < ${#TARGETS[@]}; k++)); do
        t=${TARGETS[$(( (r + k) % ${#TARGETS[@]} ))]}
        case $t in
          direct) v=$(run_wrk "$MOCK" "$stream" "$c") ;;
          floor) v=$(run_wrk "$FLOOR" "$stream" "$c" "$FLOOR_PID") ;;
          sluice) v=$(run_wrk "$SLUICE" "$stream" "$c" "$SLUICE_PID") ;;
          nginx) [ -n "$NGINX" ] || continue; v=$(run_wrk "$NGINX" "$stream" "$c" "${NGINX_PIDS[@]}") ;;
        esac
        read -r "F[$t,rps,$r]" "F[$t,p50,$r]" "F[$t,p99,$r]" "F[$t,us,$r]" <<<"$v"
        printf '%s\t%s\t%s\t%s\t%s\n' "$mode" "$c" "$(( r + 1 ))" "$t" "${v// /$'\t'}" >>"$ROUNDS_TSV"
      done
    done
    echo "| $mode | $c | $(fmt 2 "$(med direct rps)") | $(fmt 2 "$(med floor rps)") | $(fmt 2 "$(med sluice rps)") | $(fmt 2 "$(med nginx rps)") | $(fmt 2 "$(per_round ratio sluice rps nginx rps)") | $(fmt 2 "$(per_round ratio sluice rps floor rps)") | $(fmt 2 "$(per_round ratio floor rps nginx rps)") | $(ms direct p50) / $(ms direct p99) | $(ms floor p50) / $(ms floor p99) | $(ms sluice p50) / $(ms sluice p99) | $(ms nginx p50) / $(ms nginx p99) | $(fmt 3 "$(per_round minus sluice p50 direct p50)") / $(fmt 3 "$(per_round minus sluice p99 direct p99)") | $(fmt 1 "$(med floor us)") | $(fmt 1 "$(med sluice us)") | $(fmt 1 "$(med nginx us)") | $(fmt 2 "$(per_round ratio sluice us nginx us)") |" | tee -a "$REPORT"
    unset F
  done
done
echo
echo "Sluice RSS after the run: $(ps -o rss= -p "$SLUICE_PID" | awk '{printf "%.1f MB", $1/1024}')" | tee -a "$REPORT"
echo "report: $REPORT (rounds: $ROUNDS_TSV)"
