# Shared by the bench scripts (sourced, not run): a private work dir cleaned up on exit,
# the mock and the gateway started on OS-chosen ports, and their addresses read from
# their `LISTENING <name> <addr>` lines.

# Every request a bench makes goes to 127.0.0.1: never through a proxy set in the
# environment (a container build may pass one in).
export no_proxy=127.0.0.1,localhost NO_PROXY=127.0.0.1,localhost
BIN=${BENCH_BIN:-target/release}
[ -x "$BIN/sluice" ] && [ -x "$BIN/sluice-mock" ] || { echo "bench: build first (make build)" >&2; exit 2; }
# The request's header set (post.lua): the bench's three, or an SDK client's sixteen.
case ${BENCH_HEADERS:-} in
  "" | sdk) ;;
  *) echo "bench: BENCH_HEADERS takes sdk (or nothing, for the bench's three headers)" >&2; exit 2 ;;
esac
# The request's body (post.lua): the bench's small one (98 bytes), or a coding agent's of
# at least N KiB.
case ${BENCH_BODY_KB:-} in
  "" | [1-9] | [1-9][0-9] | [1-9][0-9][0-9]) ;;
  *) echo "bench: BENCH_BODY_KB takes a whole number of KiB from 1 to 999 (or nothing, for the bench's small body)" >&2; exit 2 ;;
esac
WORK=$(mktemp -d /tmp/sluice-bench.XXXXXX)
PIDS=()
# Stops what the bench started and removes its directory once they have exited (up to
# 5 s): a process still exiting may write into it (an instrumented build's profile).
bench_cleanup() {
  local p i alive
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for ((i = 0; i < 50; i++)); do
    alive=0
    for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  rm -rf "$WORK"
}
trap bench_cleanup EXIT INT TERM

# require COMMAND... -> exits (status 2) naming the first COMMAND that is not installed
# (each is also its Debian package's name)
require() {
  local c
  for c in "$@"; do
    command -v "$c" >/dev/null || { echo "bench: $c is required (apt-get install $c)" >&2; exit 2; }
  done
}

# wait_listen FILE NAME -> prints the address from "LISTENING NAME addr"
wait_listen() {
  for _ in $(seq 1 300); do
    local a; a=$(awk -v n="$2" '$1=="LISTENING" && $2==n {print $3}' "$1" 2>/dev/null | head -1)
    [ -n "$a" ] && { echo "$a"; return 0; }
    sleep 0.1
  done
  echo "bench: $2 did not start" >&2; cat "${1%.out}.log" >&2 2>/dev/null; exit 1
}

# start_mock ARGS... -> sets MOCK (address) and MOCK_PID
start_mock() {
  "$BIN/sluice-mock" --listen 127.0.0.1:0 --threads 2 "$@" >"$WORK/mock.out" 2>&1 &
  MOCK_PID=$!
  PIDS+=("$MOCK_PID")
  MOCK=$(wait_listen "$WORK/mock.out" mock)
}

# start_sluice [NAME] -> one model `bench` on the mock; sets SLUICE (client address) and
# SLUICE_PID. NAME (default `sluice`) keeps the files of several gateways apart;
# SLUICE_SERVER_EXTRA (", key: value, …") is appended to the `server:` mapping,
# SLUICE_CONN_EXTRA to the connection's; SLUICE_STATE replaces the `state:` mapping;
# SLUICE_THREADS sets `server.threads` (default 2, this machine's core count).
start_sluice() {
  local n=${1:-sluice}
  mkdir -p "$WORK/$n"
  local state=${SLUICE_STATE:-"{ path: \"$WORK/$n/state.redb\" }"}
  cat >"$WORK/$n.yaml" <<YAML
server: { listen: "127.0.0.1:0", admin_listen: "127.0.0.1:0", threads: ${SLUICE_THREADS:-2}${SLUICE_SERVER_EXTRA:-} }
admin: { token_env: SLUICE_ADMIN_TOKEN }
state: $state
rules_dir: "$WORK/$n/rules"
providers:
  - id: mock
    base_url: "http://$MOCK"
    api: openai
    class: local
    connections:
      - { id: key-1, api_key_env: BENCH_KEY${SLUICE_CONN_EXTRA:-} }
models:
  - name: bench
    targets:
      - { provider: mock, model: mock-model }
YAML
  SLUICE_ADMIN_TOKEN=bench BENCH_KEY=bench-key BENCH_REDIS_URL=${BENCH_REDIS_URL:-} SLUICE_LOG=${SLUICE_LOG:-info} \
    "$BIN/sluice" run --config "$WORK/$n.yaml" >"$WORK/$n.out" 2>"$WORK/$n.log" &
  SLUICE_PID=$!
  PIDS+=("$SLUICE_PID")
  SLUICE=$(wait_listen "$WORK/$n.out" client)
}

# start_floor -> the bare pass-through (bench/floor.rs) on the mock; sets FLOOR
# (client address) and FLOOR_PID. The binary is BENCH_BIN's examples/floor (built the
# same way as the gateway measured beside it), or FLOOR_BIN; FLOOR_THREADS sets its
# client workers (default 2).
start_floor() {
  local bin=${FLOOR_BIN:-$BIN/examples/floor}
  [ -x "$bin" ] || { echo "bench: no floor at $bin: build it (cargo build --release --example floor) or set FLOOR_BIN" >&2; exit 2; }
  "$bin" --upstream "$MOCK" --threads "${FLOOR_THREADS:-2}" >"$WORK/floor.out" 2>"$WORK/floor.log" &
  FLOOR_PID=$!
  PIDS+=("$FLOOR_PID")
  FLOOR=$(wait_listen "$WORK/floor.out" client)
}

# start_side_by_side -> what the side-by-side scripts load in turn: the mock (8 SSE
# chunks, no delay), Sluice, the floor and nginx (when installed)
start_side_by_side() {
  require wrk
  start_mock --chunks 8 --chunk-interval 0ms
  start_sluice
  start_floor
  start_nginx 4096
}

# median V... -> the median of the values that are not "-" ("-" when none is)
median() {
  printf '%s\n' "$@" | { grep -v -e '^-$' -e '^$' || true; } | sort -g | awk '{ v[NR] = $1 }
    END { if (NR == 0) print "-"; else if (NR % 2) print v[(NR + 1) / 2]; else printf "%.6f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

# median_ratio A B -> the median of the rounds' ratios B[i] ÷ A[i] of the arrays named A
# and B, rounds paired by index ("-" when no round gives one): loaded one after the other,
# a round's two sides share the machine's stretch, which a ratio of the two medians
# would mix up. An empty figure (a round wrk gave no rate for) gives no ratio.
median_ratio() {
  local -n _mr_a=$1 _mr_b=$2
  local i r=()
  for i in "${!_mr_a[@]}"; do r+=("$(ratio "${_mr_b[$i]:--}" "${_mr_a[$i]:--}")"); done
  median "${r[@]}"
}

# ratio A B -> A ÷ B to four places ("-" when either is "-" or B is 0)
ratio() { awk -v a="$1" -v b="$2" 'BEGIN{ if (a == "-" || b == "-" || b == 0) print "-"; else printf "%.4f", a/b }'; }

# callgrind_wrap NAME BINARY OUT [VALGRIND_OPTION...] -> a directory holding NAME, which
# runs BINARY under callgrind (results in OUT) with the instrumentation off until
# `callgrind_control -i on PID` switches it on
callgrind_wrap() {
  local name=$1 bin=$2 out=$3
  shift 3
  mkdir -p "$WORK/wrap-$name"
  printf '#!/bin/sh\nexec valgrind --tool=callgrind --instr-atstart=no %s --callgrind-out-file=%s %s "$@"\n' \
    "$*" "$out" "$(realpath "$bin")" >"$WORK/wrap-$name/$name"
  chmod +x "$WORK/wrap-$name/$name"
  echo "$WORK/wrap-$name"
}

# rounds_or_exit NAME VALUE -> exits (status 2) unless VALUE, the setting NAME's, is a
# whole number ≥ 1
rounds_or_exit() {
  [[ "$2" =~ ^[1-9][0-9]*$ ]] || { echo "bench: $1 must be a whole number ≥ 1" >&2; exit 2; }
}

# fmt DECIMALS V -> V rounded ("-" stays)
fmt() { awk -v f="%.$1f" -v v="$2" 'BEGIN{ if (v == "-") print "-"; else printf f, v }'; }

TICKS=$(getconf CLK_TCK)
# cpu_ticks PID... -> utime+stime of those processes, in clock ticks
cpu_ticks() { local t=0 p; for p in "$@"; do t=$(( t + $(awk '{print $14 + $15}' "/proc/$p/stat") )); done; echo "$t"; }

# start_nginx WORKER_CONNECTIONS -> when nginx is installed, a plain proxy to the mock
# (2 workers, upstream keepalive 256, response buffering off, request bodies in memory):
# sets NGINX (address) and NGINX_PIDS (master and workers); NGINX stays empty without
# nginx.
NGINX=""
NGINX_PIDS=()
start_nginx() {
  command -v nginx >/dev/null || return 0
  local port
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()')
  mkdir -p "$WORK/nginx"
  cat >"$WORK/nginx.conf" <<NGX
worker_processes 2;
worker_rlimit_nofile $(ulimit -n);
pid $WORK/nginx.pid;
error_log $WORK/nginx/error.log warn;
events { worker_connections $1; }
http {
  access_log off;
  # A request body is held in memory as Sluice holds it (BENCH_BODY_KB's bodies pass
  # nginx's default buffer, two pages here, above which a worker writes it to a file).
  client_body_buffer_size 1m;
  client_body_temp_path $WORK/nginx; proxy_temp_path $WORK/nginx;
  fastcgi_temp_path $WORK/nginx; uwsgi_temp_path $WORK/nginx; scgi_temp_path $WORK/nginx;
  upstream mock { server $MOCK; keepalive 256; }
  server {
    listen 127.0.0.1:$port;
    location / {
      proxy_pass http://mock;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
}
NGX
  nginx -c "$WORK/nginx.conf" -g 'daemon off;' >/dev/null 2>&1 &
  local master=$!
  PIDS+=("$master")
  for _ in $(seq 1 100); do
    curl -s -o /dev/null "http://127.0.0.1:$port/__stats" && break; sleep 0.1
  done
  NGINX="127.0.0.1:$port"
  NGINX_PIDS=("$master" $(pgrep -P "$master"))
}
