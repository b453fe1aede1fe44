#!/usr/bin/env bash
# Apache Superset 6.1 in its own venv, for the optional BI tests (pytest -m bi, tests/bi/) and for
# trying Superset against `dpsql serve` by hand. Superset pins its own SQLAlchemy 1.4, pandas and sqlglot,
# so it never shares dpsql's .venv.
#
#   scripts/superset.sh            install into .superset-venv (or $DPSQL_SUPERSET_VENV) with dpsql's
#                                  engine spec (contrib/superset: `pip install ./contrib/superset`) and
#                                  prepare a metadata template (superset db upgrade + init + an admin user,
#                                  its password in .superset-venv/dpsql/admin-password)
#   scripts/superset.sh web [PORT] the same, then Superset's web UI on http://127.0.0.1:PORT (default 8088)
#                                  over a copy of the template in .superset-venv/dpsql/web (user admin)
#
# Idempotent: pip runs only when the requirements below changed, the template is rebuilt only then;
# contrib/superset is reinstalled whenever one of its files changed.
# Measured on the development machine (2 cores): ~2 min for pip with a cold cache (40 s warm), 20–60 s
# for the template; a re-run with nothing to do takes ~2 s (one import of superset.cli).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="${DPSQL_SUPERSET_VENV:-.superset-venv}"
say() { echo "superset: $*"; }

# Superset 6.1.0's published metadata is looser than what it runs with: it imports rich
# (superset/cli/test_db.py, loaded by every `superset` command) and cachetools
# (db_engine_specs/aws_iam.py, loaded whenever Superset lists its engine specs) without declaring
# them, and allows flask-caching<3 although 2.5 breaks app creation (SupersetMetastoreCache gets
# an unexpected `ignore_delete_many_errors`; apache/superset#43860; Superset's own requirements
# files pin 2.4.1). The versions below are the ones the tests ran with. psycopg2 is the driver of
# Superset's postgresql:// URIs.
requirements=(
  "apache-superset==6.1.0"
  "rich==15.0.0"
  "cachetools==8.0.1"
  "flask-caching==2.3.1"
  "psycopg2-binary==2.9.13"
)
stamp="$venv/.dpsql-requirements"
wanted="$(printf '%s\n' "${requirements[@]}")"

python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  say "creating $venv with $("$python" --version)"
  "$python" -m venv "$venv"
fi
if [ "$(cat "$stamp" 2> /dev/null)" != "$wanted" ]; then
  say "installing ${requirements[*]}"
  start=$SECONDS
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "${requirements[@]}"
  printf '%s\n' "$wanted" > "$stamp"
  rm -f "$venv/dpsql/superset.db"
  say "pip done in $((SECONDS - start)) s"
fi

# dpsql's Superset package (dialect `dpsql://` + DpsqlEngineSpec, found through entry points). It does
# not depend on dpsql (Superset's sqlglot is too old for it); its own dependency, psycopg2, is above.
contrib_stamp="$venv/.dpsql-superset-contrib"
contrib_hash="$(find contrib/superset -type f \( -name '*.py' -o -name '*.toml' -o -name '*.md' \) \
  -not -path '*/build/*' -not -path '*.egg-info/*' | LC_ALL=C sort | xargs sha256sum | sha256sum)"
if [ "$(cat "$contrib_stamp" 2> /dev/null)" != "$contrib_hash" ]; then
  say "installing ./contrib/superset (dpsql-superset)"
  "$venv/bin/python" -m pip install -q --force-reinstall --no-deps ./contrib/superset
  rm -rf contrib/superset/build contrib/superset/*.egg-info # setuptools builds in the tree
  printf '%s\n' "$contrib_hash" > "$contrib_stamp"
fi

# A metadata database (SQLite) with Superset's schema, roles and an `admin` user: the tests copy it
# into a temporary directory instead of spending ~80 s on `db upgrade` + `init` every run.
mkdir -p "$venv/dpsql"
template="$(cd "$venv/dpsql" && pwd)/superset.db"
if [ ! -s "$template" ]; then
  say "preparing the metadata template $template"
  start=$SECONDS
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  cat > "$work/superset_config.py" << EOF
SECRET_KEY = "$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')"
SQLALCHEMY_DATABASE_URI = "sqlite:///$work/superset.db"
EOF
  export SUPERSET_CONFIG_PATH="$work/superset_config.py" SUPERSET_HOME="$work" FLASK_APP=superset
  quiet() { "$@" > "$work/log" 2>&1 || { cat "$work/log" >&2; say "failed: $*" >&2; return 1; }; }
  quiet "$venv/bin/superset" db upgrade
  quiet "$venv/bin/superset" init
  password="$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"
  quiet "$venv/bin/superset" fab create-admin --username admin --firstname Ada --lastname Admin \
    --email admin@example.invalid --password "$password"
  (umask 077 && printf '%s\n' "$password" > "$venv/dpsql/admin-password")
  cp "$work/superset.db" "$template.tmp" && mv "$template.tmp" "$template"
  say "template ready in $((SECONDS - start)) s"
fi
if [ -s "$venv/dpsql/admin-password" ]; then
  say "admin login: user admin, password in $venv/dpsql/admin-password"
else # a template from before the password was kept: rebuild it to get one
  say "the template's admin password was not kept: rm $template and run this script again for a new one"
fi

"$venv/bin/python" -c 'import importlib.metadata as m, superset.cli.main; print("superset:", m.version("apache-superset"), "imports, dpsql-superset", m.version("dpsql-superset"))'
say "ready: $venv/bin/superset (metadata template $template)"

if [ "${1:-}" = "web" ]; then
  # The web UI over its own copy of the template (the databases and charts added there are kept).
  port="${2:-8088}"
  web="$(cd "$venv/dpsql" && pwd)/web"
  mkdir -p "$web"
  [ -s "$web/superset.db" ] || cp "$template" "$web/superset.db"
  if [ ! -s "$web/superset_config.py" ]; then
    cat > "$web/superset_config.py" << EOF
SECRET_KEY = "$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')"
SQLALCHEMY_DATABASE_URI = "sqlite:///$web/superset.db"
EOF
  fi
  export SUPERSET_CONFIG_PATH="$web/superset_config.py" SUPERSET_HOME="$web" FLASK_APP=superset
  say "web UI on http://127.0.0.1:$port (user admin, password in $venv/dpsql/admin-password); Ctrl-C stops it"
  say "then Settings > Database Connections > + Database > dpsql: dpsql://alice@127.0.0.1:6543/clinic"
  exec "$venv/bin/superset" run -h 127.0.0.1 -p "$port" --with-threads
fi
