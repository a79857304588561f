#!/usr/bin/env bash
# 1,000 concurrent SSE streams through Sluice (SPEC §10): gateway RSS and chunk gaps.
# The mock sends 20 chunks 500 ms apart, so the expected client-side gap is 500 ms;
# anything above that is buffering or scheduling delay added on the way.
#   BENCH_STREAMS=1000 ./bench/streams.sh
set -euo pipefail
cd "$(dirname "$0")/.."
N=${BENCH_STREAMS:-1000}
. bench/lib.sh
start_mock --chunks 20 --chunk-interval 500ms
SLUICE_LOG=${SLUICE_LOG:-warn} start_sluice
echo "## $(date -u +%Y-%m-%dT%H:%M:%SZ) — $N SSE streams, $(nproc) cores"
echo "### direct to the mock (baseline gaps)"
python3 bench/streams.py "$MOCK" "$MOCK_PID" "$N"
echo "### through Sluice"
python3 bench/streams.py "$SLUICE" "$SLUICE_PID" "$N"
