# Shared by the profile-driven builds (scripts/pgo-build.sh, bolt-build.sh): finding
# an LLVM tool, and the training run. Sourced, not run, from the repository's root
# (wrk's request script is bench/post.lua).

# debian_llvm TOOL [MAX] -> TOOL of the newest Debian /usr/lib/llvm-N (N ≤ MAX when
# given); prints nothing when there is none.
debian_llvm() {
  local n
  for n in $(ls -d /usr/lib/llvm-* 2>/dev/null | sed 's|.*/llvm-||' | grep -E '^[0-9]+$' | sort -rn || true); do
    if [ "$n" -le "${2:-$n}" ] && [ -x "/usr/lib/llvm-$n/bin/$1" ]; then
      echo "/usr/lib/llvm-$n/bin/$1"
      return
    fi
  done
}

# train URL [refusals] -> proxies JSON and SSE chat requests to URL at 1, 32 and 128
# connections for 4 s each (one line per run on stdout); with `refusals`, also the
# refused requests a client meets most (unknown model, broken JSON, wrong method), so
# their paths are not laid out as never taken. Needs wrk and curl.
train() {
  local url=$1 stream conns
  for stream in 0 1; do
    for conns in 1 32 128; do
      BENCH_STREAM=$stream wrk -t"$(( conns < 2 ? 1 : 2 ))" -c"$conns" -d4s -s bench/post.lua "$url" |
        awk -v s="$stream" -v c="$conns" '/Requests\/sec/ {print "  stream=" s " conns=" c ": " $2 " req/s"}'
    done
  done
  [ "${2:-}" = refusals ] || return 0
  for _ in $(seq 1 50); do
    curl -s -o /dev/null "$url" -H 'content-type: application/json' -d '{"model":"nope","messages":[]}'
    curl -s -o /dev/null "$url" -H 'content-type: application/json' -d '{"model":'
    curl -s -o /dev/null "$url"
  done
}
