#!/usr/bin/env bash
# Refresh requirements.lock: resolve the project's dependencies (every extra that `make test`
# installs) afresh in a throw-away venv, then record the exact versions. Set-up installs from
# this file, so a fresh machine gets the versions the figures in README were measured with.
# torch is not in the file: set-up installs it itself (the CPU wheel where there is no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --upgrade pip
"$tmp/venv/bin/python" -m pip install -q torch==2.13.0
"$tmp/venv/bin/python" -m pip install -q -e ".[test,ray]" --config-settings editable_mode=compat
{
  echo "# Exact versions set-up installs (scripts/lock.sh writes this file; torch is set-up's)."
  "$tmp/venv/bin/python" -m pip freeze --exclude-editable | grep -viE '^(torch|nvidia-|triton)'
} > requirements.lock
echo "requirements.lock: $(grep -vc '^#' requirements.lock) pinned packages"
