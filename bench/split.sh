#!/usr/bin/env bash
# Where a proxied request's CPU goes, per process, for the bare floor (bench/floor.rs), Sluice and
# nginx (when installed) on one mock, in one run: user and kernel µs per request and
# voluntary / involuntary context switches per request, per thread that did any work
# (from /proc/PID/task/*/{stat,status} before and after a wrk run). With strace
# installed and BENCH_SYSCALLS=1, a second run under `strace -c -f` counts the system
# calls per request (strace slows the process; the counts, not the times, are the point).
#
#   BENCH_DURATION=5s BENCH_CONNS=32 BENCH_STREAM=0 ./bench/split.sh
#
# The user/kernel split is what tells a gap in our code (user) from one in how the bytes
# move (kernel: sends, receives, wake-ups), which the totals of run.sh cannot.
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${BENCH_DURATION:-5s}
CONNS=${BENCH_CONNS:-32}
STREAM=${BENCH_STREAM:-0}
. bench/lib.sh
start_side_by_side
THREADS=$(( CONNS < 2 ? 1 : 2 ))

# threads PID... -> "tid comm voluntary involuntary utime stime" per thread
threads() {
  local p t
  for p in "$@"; do
    for t in /proc/"$p"/task/*; do
      printf '%s %s %s %s\n' "$(basename "$t")" "$(tr ' ' _ <"$t/comm")" \
        "$(awk '/^voluntary_ctxt/ {v=$2} /^nonvoluntary_ctxt/ {n=$2} END {print v, n}' "$t/status")" \
        "$(awk '{print $14, $15}' "$t/stat")"
    done
  done | sort
}

# load ADDR -> requests completed (exits on a non-2xx answer)
load() {
  local out
  out=$(BENCH_STREAM=$STREAM wrk -t"$THREADS" -c"$CONNS" -d"$DUR" -s bench/post.lua "http://$1/v1/chat/completions" 2>&1)
  echo "$out" | grep -q "Non-2xx" && { echo "bench: non-2xx answers from $1:" >&2; echo "$out" >&2; exit 1; }
  echo "$out" | awk '/requests in/ {print $1}'
}

# measure NAME ADDR PID... -> one table row per busy thread and a total row
measure() {
  local name=$1 addr=$2 n
  shift 2
  load "$addr" >/dev/null # warm: connections pooled, code paged in
  threads "$@" >"$WORK/before"
  n=$(load "$addr")
  threads "$@" >"$WORK/after"
  join "$WORK/before" "$WORK/after" | awk -v name="$name" -v n="$n" -v hz="$TICKS" '
    { v = $8 - $3; iv = $9 - $4; u = $10 - $5; s = $11 - $6
      if (u + s == 0 && v + iv < n / 1000) next
      printf "| %s | %s | %d | %.1f | %.1f | %.1f | %.3f | %.3f |\n", name, $2, n, u * 1e6 / hz / n, s * 1e6 / hz / n, (u + s) * 1e6 / hz / n, v / n, iv / n
      tu += u; ts += s; tv += v; tiv += iv }
    END { printf "| %s | **all** | %d | **%.1f** | **%.1f** | **%.1f** | %.3f | %.3f |\n", name, n, tu * 1e6 / hz / n, ts * 1e6 / hz / n, (tu + ts) * 1e6 / hz / n, tv / n, tiv / n }'
}

# syscalls NAME ADDR PID... -> "| name | calls per request: top ones |"
syscalls() {
  local name=$1 addr=$2 n p args=() sp
  shift 2
  for p in "$@"; do args+=(-p "$p"); done
  strace -c -f "${args[@]}" -o "$WORK/strace" 2>/dev/null &
  sp=$!
  sleep 1
  n=$(load "$addr")
  kill -INT "$sp"; wait "$sp" || true
  # strace -c columns: % time, seconds, usecs/call, calls, [errors], syscall
  awk -v name="$name" -v n="$n" '
    $NF == "total" { total = $4 }
    NR > 2 && $1 ~ /^[0-9.]+$/ && $NF != "total" { calls[$NF] = $4 }
    END { line = sprintf("| %s | %.2f |", name, total / n)
          k = 0
          while (k < 5) { best = ""; for (c in calls) if (best == "" || calls[c] > calls[best]) best = c
                          if (best == "") break
                          line = line sprintf(" %s %.2f", best, calls[best] / n); delete calls[best]; k++ }
          print line " |" }' "$WORK/strace"
}

mode=$([ "$STREAM" = 1 ] && echo stream || echo json)
echo "## $(date -u +%Y-%m-%dT%H:%M:%SZ) — $mode, c=$CONNS, $DUR per run ($(nproc) cores)"
echo
echo "| gateway | thread | requests | user µs/req | kernel µs/req | CPU µs/req | voluntary switches/req | involuntary/req |"
echo "|---|---|---|---|---|---|---|---|"
measure floor "$FLOOR" "$FLOOR_PID"
measure sluice "$SLUICE" "$SLUICE_PID"
[ -n "$NGINX" ] && measure nginx "$NGINX" "${NGINX_PIDS[@]}"
if [ "${BENCH_SYSCALLS:-0}" = 1 ] && command -v strace >/dev/null; then
  echo
  echo "| gateway | system calls per request | the most frequent, per request |"
  echo "|---|---|---|"
  syscalls floor "$FLOOR" "$FLOOR_PID"
  syscalls sluice "$SLUICE" "$SLUICE_PID"
  [ -n "$NGINX" ] && syscalls nginx "$NGINX" "${NGINX_PIDS[@]:1}"
fi
