#!/usr/bin/env bash
# 1,000 concurrent SSE streams through Sluice (SPEC §10): gateway RSS and chunk gaps.
# The mock sends 20 chunks 500 ms apart, so the expected client-side gap is 500 ms;
# anything above that is buffering or scheduling delay added on the way.
#   BENCH_STREAMS=1000 ./bench/streams.sh
set -euo pipefail
cd "$(dirname "$0")/.."
N=${BENCH_STREAMS:-1000}
BIN=${BENCH_BIN:-target/release}
WORK=$(mktemp -d /tmp/sluice-streams.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$WORK"; }
trap cleanup EXIT INT TERM
wait_listen() {
  for _ in $(seq 1 300); do
    local a; a=$(awk -v n="$2" '$1=="LISTENING" && $2==n {print $3}' "$1" 2>/dev/null | head -1)
    [ -n "$a" ] && { echo "$a"; return 0; }
    sleep 0.1
  done
  echo "streams: $2 did not start" >&2; exit 1
}
"$BIN/sluice-mock" --listen 127.0.0.1:0 --threads 2 --chunks 20 --chunk-interval 500ms >"$WORK/mock.out" 2>&1 &
PIDS+=($!)
MOCK=$(wait_listen "$WORK/mock.out" mock)
cat >"$WORK/sluice.yaml" <<YAML
server: { listen: "127.0.0.1:0", admin_listen: "127.0.0.1:0", threads: 2 }
admin: { token_env: SLUICE_ADMIN_TOKEN }
state: { path: "$WORK/state.redb" }
rules_dir: "$WORK/rules"
providers:
  - id: mock
    base_url: "http://$MOCK"
    api: openai
    class: local
    connections: [ { id: key-1 } ]
models:
  - name: bench
    targets: [ { provider: mock, model: mock-model } ]
YAML
SLUICE_ADMIN_TOKEN=bench SLUICE_LOG=${SLUICE_LOG:-warn} "$BIN/sluice" run --config "$WORK/sluice.yaml" >"$WORK/sluice.out" 2>"$WORK/sluice.log" &
SPID=$!
PIDS+=($SPID)
SLUICE=$(wait_listen "$WORK/sluice.out" client)
echo "## $(date -u +%Y-%m-%dT%H:%M:%SZ) — $N SSE streams, $(nproc) cores"
MPID=${PIDS[0]}
echo "### direct to the mock (baseline gaps)"
python3 bench/streams.py "$MOCK" "$MPID" "$N"
echo "### through Sluice"
python3 bench/streams.py "$SLUICE" "$SPID" "$N"
