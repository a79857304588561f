#!/usr/bin/env bash
# The pure layers (ARCHITECTURE §1, §3.1): `src/policy` and `src/routing` are plain Rust
# state machines with `now` passed in. This fails (exit 1, naming file:line) when one of
# them imports a runtime or I/O crate (tokio, pingora, redb, prometheus, tracing,
# arc_swap), reaches into the glue (proxy, engine, store, admin, metrics, server, cli —
# grouped `use crate::{…}` imports on one line included),
# reads a clock, sleeps, or touches the file system or network. Comment lines are skipped.
#
#   scripts/check-purity.sh [SRC_DIR]     check SRC_DIR (default: src)
#   scripts/check-purity.sh --self-test   prove the check catches each kind of violation
set -euo pipefail

FORBIDDEN='\b(tokio|pingora[a-z_]*|redb|prometheus|tracing|arc_swap)::|\buse\s+(::)?(tokio|pingora[a-z_]*|redb|prometheus|tracing|arc_swap)\b|\bextern\s+crate\s+(tokio|pingora[a-z_]*|redb|prometheus|tracing|arc_swap)\b|crate::(proxy|engine|store|admin|metrics|server|cli)\b|crate::\{[^}]*\b(proxy|engine|store|admin|metrics|server|cli)\b|super::super::(proxy|engine|store|admin|metrics|server|cli)\b|\bInstant::now\b|\bSystemTime::now\b|\bthread::sleep\b|\bstd::(fs|net|process)\b|\bstd::\{[^}]*\b(fs|net|process|thread)\b'

check() {
  local src="$1" found=0 dir hits
  for dir in "$src/policy" "$src/routing"; do
    [ -d "$dir" ] || { echo "check-purity: $dir does not exist" >&2; return 2; }
    hits=$(grep -rnE --include='*.rs' "$FORBIDDEN" "$dir" | grep -vE '^[^:]+:[0-9]+:\s*//' || true)
    if [ -n "$hits" ]; then
      echo "$hits" | sed 's/^/impure: /' >&2
      found=1
    fi
  done
  if [ "$found" -ne 0 ]; then
    echo "check-purity: src/policy and src/routing must stay pure (ARCHITECTURE §1); move I/O and time into engine/ or proxy/" >&2
    return 1
  fi
}

self_test() {
  local tmp rc=0 line
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  mkdir -p "$tmp/policy" "$tmp/routing"
  printf '//! doc mentioning tokio:: and Instant::now is fine\npub fn f(now: u64) -> u64 { now }\n' >"$tmp/policy/ok.rs"
  printf 'pub fn g() {}\n' >"$tmp/routing/ok.rs"
  check "$tmp" 2>/dev/null || { echo "self-test: a clean tree was rejected" >&2; return 1; }
  for line in 'use tokio::time::sleep;' 'use pingora::proxy::Session;' 'fn x() { let _ = std::time::Instant::now(); }' \
      'fn y() -> u64 { SystemTime::now(); 0 }' 'use crate::engine::Engine;' 'use prometheus::IntCounter;' \
      'fn z() { tracing::info!("x"); }' 'fn w() { std::thread::sleep(d); }' 'fn v() { std::fs::read("x"); }' \
      'use crate::{config::Config, engine::Engine};' 'use super::super::store::Table;' 'use std::{fs, io};'; do
    printf '%s\n' "$line" >"$tmp/routing/bad.rs"
    if check "$tmp" 2>/dev/null; then
      echo "self-test: not caught: $line" >&2
      rc=1
    fi
  done
  rm -f "$tmp/routing/bad.rs"
  [ "$rc" -eq 0 ] && echo "check-purity self-test: ok"
  return "$rc"
}

if [ "${1:-}" = "--self-test" ]; then
  self_test
else
  check "${1:-src}" && echo "check-purity: src/policy and src/routing are pure"
fi
