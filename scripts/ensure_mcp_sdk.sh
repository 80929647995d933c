#!/usr/bin/env bash
# The official MCP Python SDK as a plain folder (var/mcp-sdk), for images whose MCP servers run
# inside the sandbox (the tests COPY it into a task image; the sandbox has no network to pip).
# Idempotent: returns at once when the folder is complete. Usage: scripts/ensure_mcp_sdk.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${1:-.venv/bin/python}"
TARGET=var/mcp-sdk
VERSION=2.3.0
if [ -f "$TARGET/.complete-$VERSION" ]; then
  exit 0
fi
rm -rf "$TARGET"
"$PYTHON" -m pip install -q --no-compile --target "$TARGET" "mcp==$VERSION"
touch "$TARGET/.complete-$VERSION"
