#!/usr/bin/env bash
# Side-by-side benchmark (SPEC §10): the same mock upstream called directly, through the
# bare floor (bench/floor.rs: Sluice's I/O path and Pingora's connector, no layers, no logging), through
# Sluice, and through nginx (when installed), non-streaming and streaming, at several
# concurrencies, in one run on one machine. Prints requests/s, p50/p99 latency, gateway
# CPU µs per request (utime+stime from /proc ÷ requests) and the ratios; writes the
# table to bench/out/<timestamp>.md as well.
#
#   BENCH_DURATION=10s BENCH_CONNS="1 32 128" ./bench/run.sh
#
# Needs: wrk (apt-get install wrk); nginx is optional (apt-get install nginx).
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${BENCH_DURATION:-10s}
CONNS=${BENCH_CONNS:-"1 32 128"}
. bench/lib.sh
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

ratio() { awk -v a="$1" -v b="$2" 'BEGIN{ if (b == "-" || b == 0) print "-"; else printf "%.2f", a/b }'; }

STAMP=$(date -u +%Y-%m-%dT%H:%M:%SZ)
mkdir -p bench/out
REPORT="bench/out/$(date -u +%Y%m%d-%H%M%S).md"
{
  echo "## $STAMP — $(uname -m), $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
  echo
  echo "Command: \`BENCH_DURATION=$DUR BENCH_CONNS=\"$CONNS\" ./bench/run.sh\` (wrk $(wrk -v 2>&1 | awk 'NR==1{print $2}'), mock: 8 SSE chunks, no delay)"
  echo
  echo "| mode | conns | direct rps | floor rps | sluice rps | nginx rps | sluice/nginx | sluice/floor | floor/nginx | p50/p99 ms direct | floor | sluice | nginx | sluice added p50/p99 ms | CPU µs/req floor | sluice | nginx | sluice CPU ÷ nginx |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
} | tee "$REPORT"
for stream in 0 1; do
  mode=$([ "$stream" = 1 ] && echo stream || echo json)
  for c in $CONNS; do
    read -r d_rps d_p50 d_p99 _ <<<"$(run_wrk "$MOCK" "$stream" "$c")"
    read -r f_rps f_p50 f_p99 f_us <<<"$(run_wrk "$FLOOR" "$stream" "$c" "$FLOOR_PID")"
    read -r s_rps s_p50 s_p99 s_us <<<"$(run_wrk "$SLUICE" "$stream" "$c" "$SLUICE_PID")"
    n_rps="-"; n_p50="-"; n_p99="-"; n_us="-"
    if [ -n "$NGINX" ]; then
      read -r n_rps n_p50 n_p99 n_us <<<"$(run_wrk "$NGINX" "$stream" "$c" "${NGINX_PIDS[@]}")"
    fi
    add50=$(awk -v a="$s_p50" -v b="$d_p50" 'BEGIN{printf "%.3f", a-b}')
    add99=$(awk -v a="$s_p99" -v b="$d_p99" 'BEGIN{printf "%.3f", a-b}')
    echo "| $mode | $c | $d_rps | $f_rps | $s_rps | $n_rps | $(ratio "$s_rps" "$n_rps") | $(ratio "$s_rps" "$f_rps") | $(ratio "$f_rps" "$n_rps") | $d_p50 / $d_p99 | $f_p50 / $f_p99 | $s_p50 / $s_p99 | $n_p50 / $n_p99 | $add50 / $add99 | $f_us | $s_us | $n_us | $(ratio "$s_us" "$n_us") |" | tee -a "$REPORT"
  done
done
echo
echo "Sluice RSS after the run: $(ps -o rss= -p "$SLUICE_PID" | awk '{printf "%.1f MB", $1/1024}')" | tee -a "$REPORT"
echo "report: $REPORT"
