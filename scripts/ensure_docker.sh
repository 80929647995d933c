#!/usr/bin/env bash
# Make sure a Docker engine answers `docker info`, installing and starting one if needed.
#
# Idempotent: returns at once when the engine already answers. Otherwise installs docker.io
# from apt when no dockerd binary exists (apt-get update runs at most once per call), starts
# dockerd in the background with its log in $STALEWISE_DOCKERD_LOG (default
# /var/log/stalewise-dockerd.log), and waits up to $STALEWISE_DOCKER_WAIT_S seconds (default
# 60) for `docker info` to succeed. Exits non-zero with a message saying what failed and what
# to do about it.
set -euo pipefail

LOG="${STALEWISE_DOCKERD_LOG:-/var/log/stalewise-dockerd.log}"
WAIT_S="${STALEWISE_DOCKER_WAIT_S:-60}"

say() { echo "ensure_docker: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

engine_up() { docker info >/dev/null 2>&1; }

if command -v docker >/dev/null 2>&1 && engine_up; then
    say "Docker engine is reachable."
    exit 0
fi

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"
    elif command -v sudo >/dev/null 2>&1; then sudo -n "$@"
    else die "need root to run '$*' (run this script as root or install sudo)"; fi
}

if ! command -v dockerd >/dev/null 2>&1; then
    command -v apt-get >/dev/null 2>&1 \
        || die "no dockerd and no apt-get: install a Docker engine by hand, or use the local backend (--backend local)"
    say "dockerd not found: installing docker.io from apt"
    as_root apt-get update -qq || die "apt-get update failed (is the Debian mirror reachable?)"
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq docker.io >/dev/null \
        || die "apt-get install docker.io failed (see the apt output above)"
fi
command -v docker >/dev/null 2>&1 || die "docker client missing after install"

if [ -S /var/run/docker.sock ] && [ ! -w /var/run/docker.sock ] && [ "$(id -u)" != 0 ]; then
    die "dockerd runs but /var/run/docker.sock is not writable by $(id -un): add the user to the docker group (sudo usermod -aG docker $(id -un)) and log in again"
fi

if ! pgrep -x dockerd >/dev/null 2>&1; then
    say "starting dockerd (log: $LOG)"
    as_root mkdir -p "$(dirname "$LOG")"
    # setsid + nohup: the daemon outlives this shell and its session.
    as_root setsid nohup dockerd >>"$LOG" 2>&1 </dev/null &
fi

for _ in $(seq 1 "$WAIT_S"); do
    if engine_up; then
        say "Docker engine is up."
        exit 0
    fi
    sleep 1
done
say "last lines of $LOG:"
tail -n 20 "$LOG" >&2 2>/dev/null || true
die "dockerd did not answer 'docker info' within ${WAIT_S}s; read $LOG for the reason"
