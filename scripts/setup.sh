#!/usr/bin/env bash
# Set-up for `make demo` (no argument), `make demo-real` (`--real`) and `make test` (`--all`),
# idempotent and fast on a second run: a virtualenv in .venv with the project installed (CPU
# torch where there is no GPU), a Docker engine answering `docker info`, and the sandbox base
# image. `--real` adds the GGUF reader and SmolLM2 (var/models); `--all` adds what the tests use
# as well: the MCP SDK folder, chat-template fixtures, Chromium and .venv-vllm.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  ""|--all|--real) ;;
  *) echo "setup: unknown argument $1 (none: what make demo needs; --real: what make demo-real" \
          "needs; --all: what make test needs)" >&2
     exit 2 ;;
esac
PY="${PYTHON:-python3}"
VENV=.venv
# The demos need the core dependencies only; the tests add the extras (Ray, GGUF, the test
# tools), which take most of the install time. Each level has its own stamp.
if [ "${1:-}" = "--all" ]; then
  TARGET=".[test,gguf,ray]" STAMP="$VENV/.stalewise-installed-all"
elif [ "${1:-}" = "--real" ]; then
  TARGET=".[gguf]" STAMP="$VENV/.stalewise-installed-real"
  [ -f "$VENV/.stalewise-installed-all" ] && STAMP="$VENV/.stalewise-installed-all"
else
  TARGET="." STAMP="$VENV/.stalewise-installed"
  [ -f "$VENV/.stalewise-installed-real" ] && STAMP="$VENV/.stalewise-installed-real"
  [ -f "$VENV/.stalewise-installed-all" ] && STAMP="$VENV/.stalewise-installed-all"
fi

if [ "${1:-}" = "--all" ]; then
  # A fresh clone's set-up for the tests took 7.4 GB (two venvs, the models, the images) and
  # the suite 3-3.5 GB more at its peak (one SmolLM2 job's checkpoints), plus the Debian packages
  # on a fresh machine. A full disk fails tests in scattered ways; say so before they start.
  free_gb=$(df -Pk . "${TMPDIR:-/tmp}" | awk 'NR > 1 { if (min == "" || $4 < min) min = $4 } END { print int(min / 1048576) }')
  if [ "$free_gb" -lt 12 ]; then
    echo "setup: WARNING: only ${free_gb} GB free here or under ${TMPDIR:-/tmp}; a fresh set-up" \
         "and the test suite need about 12 GB (free some, or expect tests that write" \
         "checkpoints or images to fail with 'No space left on device')" >&2
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: GPU found, installing torch" >&2
    "$VENV/bin/python" -m pip install -q "torch>=2.4"
  else
    echo "setup: no GPU, installing the CPU torch wheel" >&2
    "$VENV/bin/python" -m pip install -q torch==2.13.0
  fi
fi

if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ requirements.lock -nt "$STAMP" ]; then
  echo "setup: installing stalewise ($TARGET) (versions from requirements.lock)" >&2
  "$VENV/bin/python" -m pip install -q -c requirements.lock -e "$TARGET" \
    --config-settings editable_mode=compat
  touch "$STAMP"
fi

if [ "${1:-}" = "--all" ]; then
  bash scripts/ensure_mcp_sdk.sh "$VENV/bin/python"  # MCP SDK folder for in-sandbox MCP servers
  bash scripts/fetch_chat_fixtures.sh "$VENV/bin/python"
  bash scripts/setup_browser.sh
  bash scripts/fetch_models.sh "$VENV/bin/python"
  bash scripts/setup_vllm.sh  # .venv-vllm: vLLM for the `vllm` tests (STALEWISE_SKIP_VLLM=1 skips)
elif [ "${1:-}" = "--real" ]; then
  bash scripts/fetch_models.sh "$VENV/bin/python"
fi

if [ "${STALEWISE_SKIP_DOCKER:-0}" != "1" ]; then
  bash scripts/sandbox_setup.sh "$VENV/bin/stalewise"
fi
