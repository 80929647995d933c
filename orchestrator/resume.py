"""Recovering a run after a crash or SIGKILL of the orchestrator (`stalewise run --resume RUN`).

What was in flight cannot be continued (its engine sessions and containers are gone), so it is
closed with a reason: trajectories still queued or running become `aborted`, groups still open
become `aborted` (members already admitted stay in the learner stream, which is append-only),
and live sandbox rows become `orphaned`. The run is marked running again under this process.
The learner resumes by itself from its last published version and sequence number.
"""

from __future__ import annotations

import os
import socket

from core.store.store import Store

REASON = "aborted: the orchestrator stopped before this finished (resumed run)"


class ResumeError(ValueError):
    """The run cannot be resumed: it does not exist, it finished, or it is still running."""


def _alive_here(pid: int | None) -> bool:
    """Is `pid` a live (not zombie) process on this machine?"""
    if not pid or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def check_resumable(store: Store, run_id: str) -> None:
    """Raise `ResumeError`, saying what to do instead, unless `run_id` can be resumed here."""
    run = store.run(run_id)
    if run is None:
        raise ResumeError(f"no run {run_id!r} in {store.url}; list runs with: stalewise audit "
                          f"runs --url {store.url}")
    if run.status == "finished":
        raise ResumeError(f"run {run_id} already finished; start a new run instead")
    if run.status == "running" and run.host == socket.gethostname() and _alive_here(run.pid):
        raise ResumeError(f"run {run_id} is still running (pid {run.pid} on this machine); stop "
                          f"it first (kill -TERM {run.pid}) or let it finish")


def recover_run(store: Store, run_id: str) -> dict[str, int]:
    check_resumable(store, run_id)
    closed = store.close_in_flight(run_id, reason=REASON)
    store.set_run_status(run_id, "running", pid=os.getpid(), host=socket.gethostname())
    return closed
