#!/usr/bin/env bash
# Everything sandboxes need on this machine, idempotent and fast the second time:
# a running Docker engine (scripts/ensure_docker.sh) and the stalewise-base image.
# Usage: scripts/sandbox_setup.sh [path/to/stalewise]   (default: .venv/bin/stalewise)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
stalewise="${1:-$here/../.venv/bin/stalewise}"
"$here/ensure_docker.sh"
"$stalewise" sandbox build-base
