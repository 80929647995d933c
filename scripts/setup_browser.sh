#!/usr/bin/env bash
# Headless Chromium and its WebDriver from Debian's packages, for the viewer's browser tests.
# Idempotent: does nothing when both are installed. Never downloads a browser from elsewhere.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
echo "setup: installing chromium and chromium-driver (Debian packages)" >&2
$SUDO apt-get install -y -q chromium chromium-driver >/dev/null \
  || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q chromium chromium-driver >/dev/null; }
