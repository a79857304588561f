# The training run of the profile-driven builds (scripts/pgo-build.sh, bolt-build.sh):
# sourced, not run, from the repository's root (wrk's request script is bench/post.lua).
# Needs wrk and curl.

# train URL [refusals] -> proxies JSON and SSE chat requests to URL at 1, 32 and 128
# connections for 4 s each (one line per run on stdout); with `refusals`, also the
# refused requests a client meets most (unknown model, broken JSON, wrong method), so
# their paths are not laid out as never taken.
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
