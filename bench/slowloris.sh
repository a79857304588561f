#!/usr/bin/env bash
# Slowloris measurement (issue #8): N connections (default 3,000) send their request
# header one byte per second; the gateway must cut them at client_header_timeout
# (default here 30 s, as in SPEC §6) and give their memory and descriptors back.
#   bench/slowloris.sh [CONNECTIONS] [HEADER_TIMEOUT]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
N=${1:-3000}
T=${2:-30}
start_mock
SLUICE_LOG=error start_sluice
# the header timeout is the default unless asked otherwise
if [ "$T" != 30 ]; then
  kill "$SLUICE_PID"; sleep 0.5
  sed -i "s/threads: 2 }/threads: 2, client_header_timeout: \"${T}s\" }/" "$WORK/sluice.yaml"
  SLUICE_ADMIN_TOKEN=bench BENCH_KEY=bench-key SLUICE_LOG=error \
    "$BIN/sluice" run --config "$WORK/sluice.yaml" >"$WORK/sluice.out" 2>"$WORK/sluice.log" &
  SLUICE_PID=$!; PIDS+=("$SLUICE_PID")
  SLUICE=$(wait_listen "$WORK/sluice.out" client)
fi
echo "slowloris: $N connections against $SLUICE (client_header_timeout ${T}s)"
python3 bench/slowloris.py "$SLUICE" "$SLUICE_PID" "$N" "$T"
