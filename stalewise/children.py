"""Child processes die with their parent: a pre-exec hook for `subprocess.Popen` (Linux)."""

from __future__ import annotations

import signal
import threading
from typing import Callable


def death_signal_hook() -> Callable[[], None] | None:
    """A pre-exec hook that makes the kernel SIGTERM the child when its parent dies (Linux).

    prctl is looked up here, in the parent: the hook runs between fork and exec, where it must
    not import or take locks. The kernel sends the signal when the *thread* that forked exits,
    so only the main thread can use it; a child started from a worker thread (anyio.to_thread)
    would die when the pool retires that thread.
    """
    if threading.current_thread() is not threading.main_thread():
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
