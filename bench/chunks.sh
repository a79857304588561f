#!/usr/bin/env bash
# User-space instructions per streamed chunk, counted by valgrind's callgrind: the floor
# (bench/floor.rs) and Sluice each carry N SSE streams (BENCH_STREAMS, default 200, all
# opened at once) of 20 chunks, then N of 10 chunks, the mock's chunks 500 ms apart (each
# one read, guarded and written on its own, as an LLM's tokens are). The difference of
# the two counts divided by N × 10 is what one more chunk costs, the streams' requests
# and connections taken out. A long stream is mostly chunks: this is the figure its
# user-space CPU follows. Like instructions.sh, the count hardly moves from run to run;
# it does not see the system calls and wake-ups, which cost a chunk more than this does.
#
#   ./bench/chunks.sh                          # both, the build in target/release
#   BENCH_WHICH=sluice BENCH_STREAMS=100 ./bench/chunks.sh
#   BENCH_KEEP=/tmp/ch ./bench/chunks.sh       # keeps /tmp/ch-NAME-20.out, /tmp/ch-NAME-10.out
#
# The mock stamps each chunk (a comment line the streams client reads its send time from,
# as in streams.sh): Sluice's stream guards read it like any other line.
#
# Needs valgrind (apt-get install valgrind), the streams client and the floor (cargo
# build --release --example streams --example floor).
set -euo pipefail
cd "$(dirname "$0")/.."
WHICH=${BENCH_WHICH:-"floor sluice"}
N=${BENCH_STREAMS:-200}
[[ "$N" =~ ^[1-9][0-9]{0,3}$ ]] || { echo "bench: BENCH_STREAMS must be a whole number from 1 to 9999" >&2; exit 2; }
CLIENT=${BENCH_STREAMS_CLIENT:-target/release/examples/streams}
[ -x "$CLIENT" ] || { echo "bench: build the client first (cargo build --release --example streams)" >&2; exit 2; }
. bench/lib.sh
require valgrind
export BENCH_STREAM_SPREAD_MS=0
for w in $WHICH; do
  case $w in floor | sluice) ;; *) echo "bench: BENCH_WHICH takes floor and sluice" >&2; exit 2 ;; esac
done
case " $WHICH " in *" floor "*)
  [ -x "${FLOOR_BIN:-$BIN/examples/floor}" ] || { echo "bench: build the floor first (cargo build --release --example floor)" >&2; exit 2; } ;;
esac

# carried NAME CHUNKS -> sets CARRIED: the user-space instructions of gateway NAME (floor
# or sluice) while N streams of CHUNKS chunks pass through it, on a mock and a gateway of
# their own (started here, not in a subshell, so the exit's cleanup stops them)
carried() {
  local name=$1 chunks=$2 out=$WORK/cg-$1-$2.out dir addr pid
  rm -f "$WORK/mock.out"
  start_mock --chunks "$chunks" --chunk-interval 500ms --stamp-chunks
  case $name in
    floor)
      rm -f "$WORK/floor.out"
      dir=$(callgrind_wrap "floor-$chunks" "${FLOOR_BIN:-$BIN/examples/floor}" "$out")
      FLOOR_BIN=$dir/floor-$chunks start_floor
      addr=$FLOOR pid=$FLOOR_PID ;;
    sluice)
      dir=$(callgrind_wrap "sluice-$chunks" "$BIN/sluice" "$out")
      mv "$dir/sluice-$chunks" "$dir/sluice"
      BIN=$dir SLUICE_LOG=warn start_sluice "sluice-$chunks"
      addr=$SLUICE pid=$SLUICE_PID ;;
  esac
  # A first round unmeasured: connections, pools and allocator warm.
  "$CLIENT" "$addr" "$pid" 20 >/dev/null 2>&1
  callgrind_control -i on "$pid" >/dev/null 2>&1
  "$CLIENT" "$addr" "$pid" "$N" 2>/dev/null | awk -v n="$N" '/^RESULT/ { seen = 1; if ($3 != n) { print "bench: not every stream completed: " $0 > "/dev/stderr"; exit 1 } }
    END { if (!seen) { print "bench: the streams client gave no result" > "/dev/stderr"; exit 1 } }'
  callgrind_control -i off "$pid" >/dev/null 2>&1
  callgrind_control -d "$pid" >/dev/null 2>&1
  sleep 1
  CARRIED=$(callgrind_annotate "$out.1" 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", ""); print $1 }' || true)
  [ -n "$CARRIED" ] || { echo "bench: no callgrind totals in $out.1" >&2; exit 1; }
  [ -z "${BENCH_KEEP:-}" ] || cp "$out.1" "$BENCH_KEEP-$name-$chunks.out"
  # Gone before the next gateway starts, so the two never share the cores.
  kill "$pid" "$MOCK_PID" 2>/dev/null || true
  wait "$pid" "$MOCK_PID" 2>/dev/null || true
}

echo "user-space instructions per streamed chunk ($(date -u +%Y-%m-%dT%H:%M:%SZ), $N streams opened at once, chunks 500 ms apart)"
echo "| gateway | instructions, 20 chunks | instructions, 10 chunks | per chunk |"
echo "|---|---|---|---|"
for w in $WHICH; do
  carried "$w" 20
  long=$CARRIED
  carried "$w" 10
  short=$CARRIED
  echo "| $w | $long | $short | $(awk -v a="$long" -v b="$short" -v n="$N" 'BEGIN { printf "%.0f", (a - b) / (n * 10) }') |"
done
