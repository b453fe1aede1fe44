#!/usr/bin/env bash
# The newcomer's path, checked: README command 1 in a fresh copy of the tree (runtime dependencies
# only), then what a new user does next. Run by .ci/run before the test extras are installed, and by
# the Dockerfile's last build step (with --installed: the image's dpsql on PATH, no setup).
#
#   scripts/smoke.sh               copy the tracked tree to a temp dir, run `bash scripts/setup.sh` there
#   scripts/smoke.sh --installed   use `dpsql`/`python3` from PATH as they are
#
# Checks: `dpsql --version`; every module under dpsql/ imports (optional stacks such as pyspark are
# imported lazily, so a module that needs a test-only package fails here); `dpsql query` prints a
# noisy count on the embedded demo; `dpsql serve` on a free port answers one query through psql.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
say() { echo "smoke: $*"; }

work="$(mktemp -d)"
server_pid=""
cleanup() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2> /dev/null; then
    kill -TERM "$server_pid" 2> /dev/null || true
    for _ in $(seq 50); do kill -0 "$server_pid" 2> /dev/null || break; sleep 0.1; done
    kill -KILL "$server_pid" 2> /dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

if [ "${1:-}" = "--installed" ]; then
  dpsql="$(command -v dpsql)"
  python="$(command -v python3)"
  tree="$PWD"
else
  # A fresh clone's files (tracked and untracked-but-not-ignored, as in the working tree), no .venv.
  tree="$work/tree"
  mkdir -p "$tree"
  git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
    [ -e "$f" ] && printf '%s\0' "$f"
  done | xargs -0 cp --parents -t "$tree"
  say "README command 1 (setup) in a fresh copy: bash scripts/setup.sh"
  (cd "$tree" && bash scripts/setup.sh)
  dpsql="$tree/.venv/bin/dpsql"
  python="$tree/.venv/bin/python"
fi
export DPSQL_HOME="$work/home"  # a ledger of its own: never the user's budget

say "$("$dpsql" --version)"

say "importing every dpsql module with runtime dependencies only"
(cd "$work" && "$python" - "$tree" << 'EOF'
import importlib, pkgutil, sys
import dpsql
failed = []
for mod in pkgutil.walk_packages(dpsql.__path__, "dpsql."):
    try:
        importlib.import_module(mod.name)
    except Exception as exc:  # noqa: BLE001 - report every module, then fail
        failed.append(f"{mod.name}: {type(exc).__name__}: {exc}")
if failed:
    print("smoke: modules that do not import with runtime dependencies only:", *failed, sep="\n  ", file=sys.stderr)
    sys.exit(1)
EOF
)

say "dpsql query on the embedded demo"
out="$(cd "$tree" && "$dpsql" query "SELECT COUNT(*) FROM patients")"
echo "$out"
echo "$out" | grep -qE '^\(1 row\)$' || { say "dpsql query printed no row" >&2; exit 1; }

port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
say "dpsql serve on 127.0.0.1:$port"
(cd "$tree" && exec "$dpsql" serve --port "$port") > "$work/serve.log" 2>&1 &
server_pid=$!
for _ in $(seq 600); do
  if ! kill -0 "$server_pid" 2> /dev/null; then cat "$work/serve.log" >&2; say "dpsql serve exited" >&2; exit 1; fi
  if PGCONNECT_TIMEOUT=2 psql -h 127.0.0.1 -p "$port" -U analyst -d health -Atc 'SELECT 1' > /dev/null 2>&1; then break; fi
  sleep 0.2
done
answer="$(psql -h 127.0.0.1 -p "$port" -U analyst -d health -Atc 'SELECT COUNT(*) FROM patients' 2> "$work/psql.err")" || {
  cat "$work/serve.log" "$work/psql.err" >&2
  say "psql got no answer" >&2
  exit 1
}
echo "$answer"
echo "$answer" | grep -qE '^-?[0-9]+$' || { say "psql's answer is not a count" >&2; exit 1; }
kill -TERM "$server_pid"
wait "$server_pid" || true
server_pid=""
say "ok"
