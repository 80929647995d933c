"""Python child processes of ours: how they are started, and that they die with their parent.

`python_command` and `child_env` give every child the parent's working directory and this
project on its import path; `death_signal_hook` is a pre-exec hook for `subprocess.Popen` (Linux).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Callable


class ChildOwnerThread(threading.Thread):
    """A thread that outlives every child it starts (so their parent-death signal is right)."""


def death_signal_hook() -> Callable[[], None] | None:
    """A pre-exec hook that makes the kernel SIGTERM the child when its parent dies (Linux).

    prctl is looked up here, in the parent: the hook runs between fork and exec, where it must
    not import or take locks. The kernel sends the signal when the *thread* that forked exits,
    so only the main thread can use it; a child started from a worker thread (anyio.to_thread)
    would die when the pool retires that thread. A `ChildOwnerThread` lives as long as the
    children it starts (a supervisor's own thread), so it may use the hook as well.
    """
    thread = threading.current_thread()
    if thread is not threading.main_thread() and not isinstance(thread, ChildOwnerThread):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    sigterm = int(signal.SIGTERM)

    def hook() -> None:
        prctl(1, sigterm)  # PR_SET_PDEATHSIG

    return hook


PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)


def python_command(*args: str) -> list[str]:
    """`python -P ...` with this interpreter. A child runs in its parent's working directory, so
    relative paths in a job config (model, database, run directory) mean the same thing in
    both; `-P` keeps that directory off the child's import path, so a user's own `tasks/` or
    `learner/` folder cannot shadow ours."""
    return [sys.executable, "-P", *args]


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The parent's environment plus `extra`, with this project importable (PYTHONPATH)."""
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PROJECT_ROOT, env.get("PYTHONPATH", "")) if p)
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on `host` now, for a child that must be told its port (vLLM,
    a data-parallel rank 0, the viewer); there is a small window before the child binds it."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
