#!/usr/bin/env bash
# A second, private Docker engine on this machine, standing in for a remote sandbox host.
#
#   scripts/second_dockerd.sh start DIR   start it (idempotent) and print its URL: unix://DIR/docker.sock
#   scripts/second_dockerd.sh kill DIR    lose the host: SIGKILL its dockerd, containerd, shims
#                                         and container processes (state in DIR is kept)
#   scripts/second_dockerd.sh stop DIR    kill it, unmount what it mounted, delete its bridge and DIR
#
# Everything it owns lives under DIR: --data-root DIR/data, --exec-root DIR/exec, --pidfile
# DIR/dockerd.pid, the API socket DIR/docker.sock, its log DIR/dockerd.log, and its containers'
# cgroups under the parent "swd-$(basename DIR)". Its default network is a bridge of its own
# (created here, deleted by stop; named from DIR, on a 10.213.N.0/24 subnet) and it leaves
# iptables and ip forwarding alone, so it never touches the first engine's docker0 or NAT
# rules. Never give it --bridge=none: dockerd then DELETES the interface docker0, which is the
# first engine's bridge. Keep DIR short (unix socket paths are limited to 107 bytes), e.g.
# DIR=$(mktemp -d /tmp/swd-XXXX). Needs root, iproute2 and the dockerd binary
# (scripts/ensure_docker.sh installs it). Images: copy them in with
#   docker save stalewise-base:latest | docker -H unix://DIR/docker.sock load
# (a pool with [sandbox] hosts copies missing images by itself).
set -euo pipefail

die() { echo "second_dockerd: ERROR: $*" >&2; exit 1; }
[ $# -eq 2 ] || die "usage: $0 start|kill|stop DIR"
action="$1"
dir="$(realpath -m "$2")"
sock="$dir/docker.sock"
cgroup_parent="swd-$(basename "$dir")"
name_sum="$(printf '%s' "$dir" | cksum | cut -d' ' -f1)"
bridge="swbr$(printf '%08x' "$name_sum" | cut -c1-8)"   # at most 15 bytes
subnet_n=$(( name_sum % 250 + 1 ))
[ ${#sock} -lt 100 ] || die "DIR is too long for a unix socket path ($sock); use a short one under /tmp"

up() { docker -H "unix://$sock" version --format '{{.Server.Version}}' >/dev/null 2>&1; }

running() {  # is process $1 alive and not a zombie (an unreaped one keeps its pid)?
    local state
    state="$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null || true)"
    [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

pid_of() {  # the pid in file $1 if that process is alive
    local pid
    pid="$(cat "$1" 2>/dev/null || true)"
    [ -n "$pid" ] && running "$pid" && echo "$pid"
    return 0
}

owned_pids() {  # processes whose command line names DIR (its containerd and shims)
    local p
    for p in /proc/[0-9]*; do
        if tr '\0' ' ' 2>/dev/null <"$p/cmdline" | grep -qF -- "$dir/"; then
            basename "$p"
        fi
    done
}

container_pids() {  # processes in this engine's container cgroups
    local procs
    for procs in /sys/fs/cgroup/pids/"$cgroup_parent"/*/cgroup.procs \
                 /sys/fs/cgroup/"$cgroup_parent"/*/cgroup.procs; do
        [ -f "$procs" ] && cat "$procs"
    done
    return 0
}

kill_all() {  # SIGKILL everything it runs and wait until dockerd itself is gone
    local pid daemon
    daemon="$(pid_of "$dir/dockerd.pid")"
    [ -n "$daemon" ] && kill -KILL "$daemon" 2>/dev/null || true
    for pid in $(owned_pids) $(container_pids); do
        [ "$pid" != "$$" ] && kill -KILL "$pid" 2>/dev/null || true
    done
    if [ -n "$daemon" ]; then
        for _ in $(seq 1 60); do running "$daemon" || break; sleep 0.5; done
    fi
    remove_stale_pid_files
    return 0
}

remove_stale_pid_files() {
    # a killed dockerd and its containerd leave their pid files behind; the next start refuses
    # to run (dockerd) or waits on a dead socket (containerd) while a file names a process that
    # still exists, and an unreaped zombie does
    local file
    for file in "$dir/dockerd.pid" $(find "$dir/exec" -name '*.pid' 2>/dev/null); do
        [ -f "$file" ] && [ -z "$(pid_of "$file")" ] && rm -f "$file"
    done
    return 0
}

case "$action" in
start)
    if up; then echo "unix://$sock"; exit 0; fi
    command -v dockerd >/dev/null 2>&1 || die "no dockerd binary; run scripts/ensure_docker.sh first"
    [ "$(id -u)" = 0 ] || die "a second dockerd needs root"
    mkdir -p "$dir/data" "$dir/exec"
    remove_stale_pid_files  # left by a killed one
    rm -f "$sock"
    if ! ip link show "$bridge" >/dev/null 2>&1; then
        ip link add "$bridge" type bridge || die "could not create the bridge $bridge"
        ip addr add "10.213.$subnet_n.1/24" dev "$bridge"
        ip link set "$bridge" up
    fi
    setsid nohup dockerd \
        --data-root "$dir/data" --exec-root "$dir/exec" --pidfile "$dir/dockerd.pid" \
        --host "unix://$sock" --bridge "$bridge" --iptables=false --ip-masq=false \
        --ip-forward=false --userland-proxy=false --cgroup-parent "$cgroup_parent" \
        --shutdown-timeout 2 \
        >>"$dir/dockerd.log" 2>&1 </dev/null &
    for _ in $(seq 1 "${STALEWISE_DOCKER_WAIT_S:-60}"); do
        if up; then echo "unix://$sock"; exit 0; fi
        sleep 1
    done
    tail -n 20 "$dir/dockerd.log" >&2 || true
    die "the second dockerd did not answer within ${STALEWISE_DOCKER_WAIT_S:-60}s (log: $dir/dockerd.log)"
    ;;
kill)
    kill_all
    ;;
stop)
    kill_all  # its state is deleted below, so there is nothing to shut down gracefully
    for _ in $(seq 1 20); do [ -z "$(owned_pids)$(container_pids)" ] && break; sleep 0.5; done
    # unmount what is left under DIR (overlay layers, shm, netns), deepest first
    { grep -F " $dir/" /proc/self/mounts || true; } | awk '{print $2}' | sort -r |
        while read -r mnt; do umount -l "$mnt" 2>/dev/null || true; done
    for cg in /sys/fs/cgroup/*/"$cgroup_parent" /sys/fs/cgroup/"$cgroup_parent"; do
        [ -d "$cg" ] && find "$cg" -depth -type d -exec rmdir {} \; 2>/dev/null || true
    done
    ip link del "$bridge" 2>/dev/null || true
    rm -rf "$dir"
    ;;
*)
    die "unknown action '$action': use start, kill or stop"
    ;;
esac
