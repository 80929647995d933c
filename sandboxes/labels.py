"""Container labels that make orphan cleanup safe, and the identity of the owning process.

Every container stalewise starts carries the labels below. A container is an orphan when its
owner process is provably gone (same host and boot, and the pid is dead or now belongs to a
process with a different start time) or when its hard TTL has passed. Nothing else makes one:
in particular not its run's state in some database, since the jobs of one installation may
each have a store of their own (another `db_url`, `stalewise tasks check`, ad-hoc sandboxes),
and a store that never saw a run cannot say it is over. Containers of another installation are
never touched.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

PREFIX = "org.stalewise."
INSTALLATION = PREFIX + "installation"
RUN_ID = PREFIX + "run_id"
TRAJECTORY_ID = PREFIX + "trajectory_id"
OWNER_PID = PREFIX + "owner_pid"
OWNER_START = PREFIX + "owner_start"
OWNER_HOST = PREFIX + "owner_host"
OWNER_BOOT = PREFIX + "owner_boot"
CREATED_AT = PREFIX + "created_at"
TTL_S = PREFIX + "ttl_s"
TTL_GRACE_S = 30.0


def stalewise_home() -> Path:
    """Where per-user state lives: $STALEWISE_HOME or ~/.local/share/stalewise."""
    env = os.environ.get("STALEWISE_HOME")
    return Path(env) if env else Path.home() / ".local" / "share" / "stalewise"


def installation_id() -> str:
    """A stable id for this installation ($STALEWISE_INSTALLATION_ID, else a persisted uuid)."""
    env = os.environ.get("STALEWISE_INSTALLATION_ID")
    if env:
        return env
    path = stalewise_home() / "installation_id"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fresh = uuid.uuid4().hex[:16]
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(fresh)
        try:
            os.link(tmp, path)  # atomic create-if-absent: a concurrent writer wins cleanly
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        return path.read_text().strip()


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start_ticks(pid: int) -> str | None:
    """The start time of `pid` in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2:].split()[19].decode()


@dataclass(frozen=True)
class Owner:
    pid: int
    start: str
    host: str
    boot: str

    @staticmethod
    def current() -> "Owner":
        pid = os.getpid()
        return Owner(pid, process_start_ticks(pid) or "", socket.gethostname(), boot_id())


def container_labels(*, run_id: str, trajectory_id: str | None, ttl_s: float,
                     installation: str | None = None, owner: Owner | None = None,
                     now: float | None = None) -> dict[str, str]:
    owner = owner or Owner.current()
    return {
        INSTALLATION: installation or installation_id(),
        RUN_ID: run_id,
        TRAJECTORY_ID: trajectory_id or "",
        OWNER_PID: str(owner.pid),
        OWNER_START: owner.start,
        OWNER_HOST: owner.host,
        OWNER_BOOT: owner.boot,
        CREATED_AT: f"{time.time() if now is None else now:.3f}",
        TTL_S: f"{ttl_s:.3f}",
    }


def owner_is_dead(labels: Mapping[str, str], me: Owner) -> bool:
    """True only when the owner is provably gone; an owner on another host is presumed alive."""
    if labels.get(OWNER_HOST) != me.host:
        return False
    if labels.get(OWNER_BOOT) and me.boot and labels[OWNER_BOOT] != me.boot:
        return True  # the machine rebooted since
    try:
        pid = int(labels.get(OWNER_PID, ""))
    except ValueError:
        return False
    start = process_start_ticks(pid)
    return start is None or start != labels.get(OWNER_START, start)


def orphan_reason(labels: Mapping[str, str], *, me: Owner, now: float) -> str | None:
    """Why a container of this installation should be removed, or None to keep it."""
    if owner_is_dead(labels, me):
        return f"owner process {labels.get(OWNER_PID)} is gone"
    try:
        expires = float(labels[CREATED_AT]) + float(labels[TTL_S]) + TTL_GRACE_S
    except (KeyError, ValueError):
        return None
    if now > expires:
        return "its time to live has passed"
    return None
