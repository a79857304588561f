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
SLUICE_LOG=error SLUICE_SERVER_EXTRA=", client_header_timeout: \"${T}s\"" start_sluice
echo "slowloris: $N connections against $SLUICE (client_header_timeout ${T}s)"
python3 bench/slowloris.py "$SLUICE" "$SLUICE_PID" "$N" "$T"
