#!/usr/bin/env bash
# Idempotent bootstrap for a fresh Debian/Ubuntu machine (root, or a user with sudo).
#
#   scripts/setup.sh        runtime: psql, .venv + `pip install -e '.[serve]'`
#   scripts/setup.sh test   also test extras (and the spark and pld extras) and the Debian packages the tests
#                           use (PostgreSQL server + psql, a JDK, Java 17+ for Spark, the PostgreSQL
#                           JDBC driver, Chromium and its WebDriver for tests/dashboard)
#
# Re-running is cheap: pip is skipped while pyproject.toml is unchanged, apt while everything is present.
set -euo pipefail

mode="${1:-runtime}"
case "$mode" in
  runtime | test) ;;
  *) echo "usage: $0 [test]" >&2; exit 2 ;;
esac

cd "$(dirname "${BASH_SOURCE[0]}")/.."
say() { echo "setup: $*"; }
# Run quietly; show the captured output only when the command fails.
quiet() {
  local log rc=0
  log="$(mktemp)"
  "$@" > "$log" 2>&1 || rc=$?
  [ "$rc" -eq 0 ] || { cat "$log" >&2; say "failed ($rc): $*" >&2; }
  rm -f "$log"
  return "$rc"
}

if [ "$(id -u)" -eq 0 ]; then
  as_root() { "$@"; }
elif command -v sudo > /dev/null; then
  as_root() { sudo "$@"; }
else
  as_root() { echo "setup: need root or sudo to run: $*" >&2; return 1; }
fi

# --- Debian packages --------------------------------------------------------------
apt_missing=()
apt_updated=0
need_pkg() { apt_missing+=("$1"); }
apt_install() {
  [ "${#apt_missing[@]}" -eq 0 ] && return 0
  say "installing Debian packages: ${apt_missing[*]}"
  if [ "$apt_updated" -eq 0 ]; then
    quiet as_root env DEBIAN_FRONTEND=noninteractive apt-get update
    apt_updated=1
  fi
  quiet as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    "${apt_missing[@]}"
  apt_missing=()
}
installed() { dpkg -s "$1" > /dev/null 2>&1; }

if ! command -v python3 > /dev/null; then need_pkg python3; fi
if [ ! -x .venv/bin/python ] && ! python3 -c 'import ensurepip' > /dev/null 2>&1; then
  need_pkg python3-venv
fi

# psql, so the served demo can be queried right away
installed postgresql-client || command -v psql > /dev/null || need_pkg postgresql-client

if [ "$mode" = test ]; then
  has_pg_server() {
    local d
    d="$(pg_config --bindir 2> /dev/null || true)"
    [ -n "$d" ] && [ -x "$d/initdb" ] && [ -x "$d/postgres" ] && return 0
    compgen -G "/usr/lib/postgresql/*/bin/initdb" > /dev/null
  }
  installed postgresql || has_pg_server || need_pkg postgresql
  command -v javac > /dev/null || need_pkg default-jdk-headless
  # Spark 4 (the spark extra; tests/backends/test_spark.py runs a local Spark) needs Java 17+.
  java_major() { java -version 2>&1 | sed -n 's/.* version "\(1\.\)\{0,1\}\([0-9]*\).*/\2/p' | head -n 1; }
  if ! command -v java > /dev/null || [ "$(java_major)" -lt 17 ] 2> /dev/null; then
    need_pkg openjdk-17-jre-headless
  fi
  installed libpostgresql-jdbc-java || need_pkg libpostgresql-jdbc-java
  # tests/dashboard drive the curator's dashboard in a real headless Chromium (Selenium + chromedriver)
  installed chromium || need_pkg chromium
  installed chromium-driver || need_pkg chromium-driver
fi
apt_install

# --- Python virtualenv ------------------------------------------------------------
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  python3 -m venv .venv
fi

extras=".[serve]"  # serve: PostgreSQL binaries for the schema-only catalog psql's \d reads
[ "$mode" = test ] && extras=".[test,serve,spark,pld]"  # spark: pyspark for tests/backends/test_spark.py; pld: dp-accounting
stamp=".venv/.dpsql-setup-$mode"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
up_to_date() {  # the test extras include the runtime ones
  local f
  for f in "$stamp" .venv/.dpsql-setup-test; do
    [ "$(cat "$f" 2> /dev/null || true)" = "$want" ] && return 0
  done
  return 1
}
if ! up_to_date || ! .venv/bin/python -P -c 'import dpsql' 2> /dev/null; then
  say "pip install -e '$extras'"
  quiet .venv/bin/python -m pip install -q --disable-pip-version-check -e "$extras"
  echo "$want" > "$stamp"
fi
