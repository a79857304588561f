#!/usr/bin/env bash
# Concurrent SSE streams through Sluice (SPEC §10): gateway RSS per open stream and the
# chunk gaps the clients saw, directly against the mock and through Sluice, for each
# count in BENCH_STREAMS. The mock sends 20 chunks 500 ms apart, so the expected gap is
# 500 ms; Sluice's added delay is its p99 gap minus the direct p99 gap in the same run.
#   BENCH_STREAMS="1000 8000" ./bench/streams.sh   (BENCH_BODY_KIB=64: agent-sized request bodies)
# 8,000 streams hold 16,000 gateway sockets: the file limit must allow it (ulimit -n).
set -euo pipefail
cd "$(dirname "$0")/.."
COUNTS=${BENCH_STREAMS:-"1000 8000"}
. bench/lib.sh
start_mock --chunks 20 --chunk-interval 500ms
SLUICE_LOG=${SLUICE_LOG:-warn} start_sluice
echo "## $(date -u +%Y-%m-%dT%H:%M:%SZ) — SSE streams, $(nproc) cores, file limit $(ulimit -n)"
rows=()
for n in $COUNTS; do
  echo "### $n streams direct to the mock (baseline gaps)"
  d=$(python3 bench/streams.py "$MOCK" "$MOCK_PID" "$n" | tee /dev/stderr | awk '/^RESULT/')
  echo "### $n streams through Sluice"
  s=$(python3 bench/streams.py "$SLUICE" "$SLUICE_PID" "$n" | tee /dev/stderr | awk '/^RESULT/')
  read -r _ _ done _ _ _ _ d99 <<<"$d"
  read -r _ _ sdone sidle speak sper _ s99 <<<"$s"
  rows+=("| $n | $sdone | $sidle | $speak | $sper | $d99 | $s99 | $(awk -v a="$s99" -v b="$d99" 'BEGIN{printf "%.1f", a-b}') |")
done
echo
echo "| streams | completed via Sluice | Sluice RSS idle MB | peak MB | KiB per stream | p99 gap direct ms | p99 gap Sluice ms | added p99 ms |"
echo "|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
