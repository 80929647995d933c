#!/usr/bin/env bash
# Start a local PostgreSQL server for the store's PostgreSQL tests (idempotent).
# Installs Debian's postgresql if missing, keeps its data in /var/tmp/stalewise-pg, listens on
# 127.0.0.1:${STALEWISE_PG_PORT:-54329} with trust auth, and creates the database stalewise_test.
set -euo pipefail
PORT="${STALEWISE_PG_PORT:-54329}"
DATA="${STALEWISE_PG_DATA:-/var/tmp/stalewise-pg}"

find_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1; }

if [ -z "$(find_bin)" ]; then
  echo "ensure_postgres: installing postgresql (Debian package)" >&2
  if [ -z "$(ls -A /var/lib/apt/lists 2>/dev/null | grep -v lock)" ]; then apt-get update -qq; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; }
fi
BIN="$(find_bin)"
[ -n "$BIN" ] || { echo "ensure_postgres: postgresql binaries not found after install" >&2; exit 1; }

if "$BIN/pg_isready" -q -h 127.0.0.1 -p "$PORT"; then
  exit 0
fi
if [ ! -f "$DATA/PG_VERSION" ]; then
  mkdir -p "$DATA"
  chown postgres:postgres "$DATA"
  su postgres -s /bin/sh -c "$BIN/initdb -D '$DATA' -U postgres --auth=trust -E UTF8" >/dev/null
fi
su postgres -s /bin/sh -c "$BIN/pg_ctl -D '$DATA' -l '$DATA/server.log' -w -t 60 \
  -o '-p $PORT -k /tmp -c listen_addresses=127.0.0.1 -c fsync=off' start" >/dev/null
if ! "$BIN/psql" -h 127.0.0.1 -p "$PORT" -U postgres -tAc \
    "SELECT 1 FROM pg_database WHERE datname='stalewise_test'" | grep -q 1; then
  "$BIN/psql" -h 127.0.0.1 -p "$PORT" -U postgres -qc "CREATE DATABASE stalewise_test" >/dev/null
fi
echo "ensure_postgres: postgresql+psycopg://postgres@127.0.0.1:$PORT/stalewise_test" >&2
