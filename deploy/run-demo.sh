#!/usr/bin/env bash
# Starts the bundled mock upstream and Sluice on conf/demo.yaml; Ctrl-C stops both.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=./target/release
: "${SLUICE_ADMIN_TOKEN:=demo-admin-token}" "${DEMO_MOCK_KEY_1:=demo-key-1}" "${DEMO_MOCK_KEY_2:=demo-key-2}"
export SLUICE_ADMIN_TOKEN DEMO_MOCK_KEY_1 DEMO_MOCK_KEY_2

"$BIN/sluice-mock" --listen 127.0.0.1:9100 --name demo-mock >/dev/null &
MOCK=$!
trap 'kill $MOCK 2>/dev/null || true' EXIT INT TERM

cat <<MSG

  Sluice is starting on http://127.0.0.1:8080 (admin on 127.0.0.1:9090), upstream: sluice-mock.
  Try it in another terminal:

    curl -s http://127.0.0.1:8080/v1/chat/completions \\
      -H 'content-type: application/json' \\
      -d '{"model":"demo","messages":[{"role":"user","content":"Hello"}]}'

    curl -sN http://127.0.0.1:8080/v1/chat/completions \\
      -d '{"model":"demo","stream":true,"messages":[{"role":"user","content":"Hello"}]}'

    curl -s http://127.0.0.1:9090/metrics | grep sluice_requests_total

  Ctrl-C stops the gateway and the mock.

MSG
"$BIN/sluice" run --config conf/demo.yaml
