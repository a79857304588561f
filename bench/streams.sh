#!/usr/bin/env bash
# Concurrent SSE streams through Sluice (SPEC §10): gateway RSS per open stream and the
# chunk gaps the clients saw, directly against the mock and through Sluice, for each
# count in BENCH_STREAMS. The mock sends 20 chunks 500 ms apart, so the expected gap is
# 500 ms; a proxy's added delay is its p99 gap minus the direct p99 gap in the same run,
# over the whole run and over the steady state (once every stream is open). The mock
# also stamps each chunk with the time it wrote it, so each chunk's delivery time (the
# client's clock minus the stamp) is measured too: the added delivery p99 leaves out
# the jitter of the mock's own timer, which the gaps carry twice. The bare pass-through
# (bench/floor.rs) holds the same streams, to tell the delay any gateway on this code
# adds from what Sluice's layers add; nginx, when installed, as a plain-proxy reference.
# The client holding the streams is bench/streams.rs (`cargo build --release --example
# streams`; `make bench` builds it and the floor), on tokio so that its own delay stays
# small.
#   BENCH_STREAMS="1000 8000" ./bench/streams.sh   (BENCH_BODY_KIB=64: agent-sized request bodies)
#   BENCH_STREAM_ROUNDS=3 BENCH_STREAMS=1000 ./bench/streams.sh
#   BENCH_STREAM_SPREAD_MS=500 BENCH_STREAMS=1000 ./bench/streams.sh
# By default every stream is opened at once, so the mock's chunks come in a burst of a
# thousand every 500 ms: the delay it adds is then mostly how long the gateway takes to
# work through the burst on cores it shares with the client and the mock. With
# BENCH_STREAM_SPREAD_MS=S stream i opens at i·S/N ms (S=500: evenly over one chunk
# interval, as independent agents' streams would be), and the added delay is what the
# gateway adds to one chunk passing through it.
# With BENCH_STREAM_ROUNDS=N each count is measured N times (direct, then each proxy, per
# round), and a last table gives each proxy's median added delays: the tail of a
# thousand streams on two shared cores moves by milliseconds from one run to the next,
# the direct figure the added delay is taken from as much as the proxy's.
# 8,000 streams hold 16,000 gateway sockets: the file limit must allow it (ulimit -n).
set -euo pipefail
cd "$(dirname "$0")/.."
COUNTS=${BENCH_STREAMS:-"1000 8000"}
ROUNDS=${BENCH_STREAM_ROUNDS:-1}
CLIENT=${BENCH_STREAMS_CLIENT:-target/release/examples/streams}
[ -x "$CLIENT" ] || { echo "bench: build the client first (cargo build --release --example streams --example floor)" >&2; exit 2; }
. bench/lib.sh
[ -x "${FLOOR_BIN:-$BIN/examples/floor}" ] || { echo "bench: build the floor first (cargo build --release --example streams --example floor)" >&2; exit 2; }
rounds_or_exit BENCH_STREAM_ROUNDS "$ROUNDS"
start_mock --chunks 20 --chunk-interval 500ms --stamp-chunks
SLUICE_LOG=${SLUICE_LOG:-warn} start_sluice
start_floor
start_nginx 20000
SPREAD=${BENCH_STREAM_SPREAD_MS:-0}
# A stream lasts 20 chunks × 500 ms: spread wider, the first would end before the last opens.
[[ "$SPREAD" =~ ^[0-9]{1,5}$ ]] && [ "$SPREAD" -lt 10000 ] || {
  echo "bench: BENCH_STREAM_SPREAD_MS must be a whole number of ms below 10000 (a stream's length)" >&2
  exit 2
}
export BENCH_STREAM_SPREAD_MS=$SPREAD
OPENED="all opened at once"
[ "$SPREAD" -gt 0 ] && OPENED="opened evenly over $SPREAD ms"
echo "## $(date -u +%Y-%m-%dT%H:%M:%SZ) — SSE streams ($OPENED), $(nproc) cores, file limit $(ulimit -n)"
# added A B [DECIMALS] -> A - B, with one decimal unless told
added() { awk -v a="$1" -v b="$2" -v f="%.${3:-1}f" 'BEGIN{printf f, a-b}'; }
rows=()
# Per proxy and round: count, path, steady added gap p99 and steady added delivery p99
# (for the medians).
SUMS=$WORK/sums
: >"$SUMS"
for n in $COUNTS; do
  for ((round = 1; round <= ROUNDS; round++)); do
    echo "### $n streams direct to the mock (baseline gaps), round $round of $ROUNDS"
    d=$("$CLIENT" "$MOCK" "$MOCK_PID" "$n" | tee -a /dev/stderr | awk '/^RESULT/')
    read -r _ _ ddone _ _ _ _ d99 d999 _ ds99 ds999 dd99 dd999 dds99 dds999 <<<"$d"
    rows+=("| $n | $round | direct | $ddone | - | - | - | $d99 / $d999 | - | $ds99 / $ds999 | - | $dd99 / $dd999 | - | $dds99 / $dds999 | - |")
    paths=("Sluice $SLUICE $SLUICE_PID" "floor $FLOOR $FLOOR_PID")
    [ -n "$NGINX" ] && paths+=("nginx $NGINX $(IFS=,; echo "${NGINX_PIDS[*]}")")
    for p in "${paths[@]}"; do
      read -r name addr pids <<<"$p"
      echo "### $n streams through $name, round $round of $ROUNDS"
      r=$("$CLIENT" "$addr" "$pids" "$n" | tee -a /dev/stderr | awk '/^RESULT/')
      read -r _ _ done idle peak per _ p99 p999 _ s99 s999 e99 e999 es99 es999 <<<"$r"
      rows+=("| $n | $round | $name | $done | $idle | $peak | $per | $p99 / $p999 | $(added "$p99" "$d99") / $(added "$p999" "$d999") | $s99 / $s999 | $(added "$s99" "$ds99") / $(added "$s999" "$ds999") | $e99 / $e999 | $(added "$e99" "$dd99" 2) / $(added "$e999" "$dd999" 2) | $es99 / $es999 | $(added "$es99" "$dds99" 2) / $(added "$es999" "$dds999" 2) |")
      echo "$n $name $(added "$s99" "$ds99") $(added "$es99" "$dds99" 2)" >>"$SUMS"
    done
  done
done
echo
echo "Gaps and deliveries in ms; \"steady\": gaps that began (chunks that arrived) once every stream was open; \"added\": minus the direct figure of the same count."
echo
echo "| streams | round | path | completed | RSS idle MB | peak MB | KiB per stream | gap p99 / p99.9 | added p99 / p99.9 | steady gap p99 / p99.9 | steady added p99 / p99.9 | delivery p99 / p99.9 | added delivery p99 / p99.9 | steady delivery p99 / p99.9 | steady added delivery p99 / p99.9 |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
[ "$ROUNDS" -gt 1 ] || exit 0
# col N PATH FIELD -> the rounds' values of one figure
col() { awk -v n="$1" -v p="$2" -v f="$3" '$1 == n && $2 == p { print $f }' "$SUMS"; }
echo
echo "Medians over $ROUNDS rounds (ms; added: minus the direct figure of the same round). RSS per"
echo "stream is round 1's: later rounds start on memory the gateway kept from the earlier ones."
echo
echo "| streams | path | steady added gap p99 | steady added delivery p99 |"
echo "|---|---|---|---|"
for n in $COUNTS; do
  for name in $(awk -v n="$n" '$1 == n { print $2 }' "$SUMS" | awk '!seen[$0]++'); do
    # shellcheck disable=SC2046 # one value per round
    echo "| $n | $name | $(fmt 2 "$(median $(col "$n" "$name" 3))") | $(fmt 2 "$(median $(col "$n" "$name" 4))") |"
  done
done
