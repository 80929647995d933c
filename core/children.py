"""Child processes: one type, `Child`, for every process we start (the engine and vLLM, the
learner, SFT and model creation, the data-parallel learner's peers, a Ray host's child), and
one restart policy, `RestartBudget`, for everything that restarts one.

Guarantees:
- a Python child runs in its parent's working directory with this project first on its import
  path (`python_command`, `child_env`); a child started from the main thread or from a
  `ChildOwnerThread` gets SIGTERM when its parent dies (`death_signal_hook`, Linux);
- its output goes to a log file (without one, to this process's own stdout and stderr);
- `ready(probe)` returns once `probe()` answers (a port file written, a health check passed)
  and fails at once, with the log's tail, when the child exits first; a child that is not ready
  in time is stopped;
- `stop` sends SIGTERM, waits, then SIGKILLs, and always reaps the child; a child that leads a
  process group of its own has the rest of the group ended too (helpers it leaves behind when
  it dies, such as vLLM's engine core); its scratch directory goes, its log stays readable
  through `log_tail`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)
NOT_READY_STOP_S = 10.0  # how long a child that failed to become ready gets to exit on SIGTERM
GROUP_KILL_WAIT_S = 10.0


class ChildOwnerThread(threading.Thread):
    """A thread that outlives every child it starts (so their parent-death signal is right)."""


class LaunchError(RuntimeError):
    """A child did not become ready; the message carries the tail of its log."""


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


class Child:
    """One child process (see module docstring). `url` is where it serves, once its launcher
    knows (an engine's, after `ready`); None for a child that serves nothing."""

    def __init__(self, name: str, process: subprocess.Popen, log_path: Path | None, *,
                 own_group: bool = False, scratch: Path | None = None) -> None:
        self.name, self.process, self.log_path = name, process, log_path
        self.own_group, self.scratch = own_group, scratch
        self.url: str | None = None
        self._final_log: str | None = None

    @classmethod
    def start(cls, name: str, command: Sequence[str], log_path: Path | None, *,
              env: Mapping[str, str] | None = None, own_group: bool = False,
              scratch: Path | None = None) -> Child:
        """Fork `command` (`python_command(...)`, or another interpreter's command line) with
        `child_env(env)`, its output appended to `log_path` (None: this process's own output).
        `own_group`: it leads a new process group, which its helpers join and `stop` ends
        whole. `scratch`: the launcher's temporary directory, removed by `stop` (at once when
        the fork fails). From the main thread or a `ChildOwnerThread`, the child dies with
        this process."""
        options = dict(stdin=subprocess.DEVNULL, env=child_env(env),
                       preexec_fn=death_signal_hook(), start_new_session=own_group)
        try:
            if log_path is None:
                process = subprocess.Popen(list(command), **options)
            else:
                log_path.parent.mkdir(parents=True, exist_ok=True)
                with open(log_path, "ab") as log:
                    process = subprocess.Popen(list(command), stdout=log,
                                               stderr=subprocess.STDOUT, **options)
        except BaseException:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
            raise
        return cls(name, process, log_path, own_group=own_group, scratch=scratch)

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        """The exit code once it has exited, else None."""
        return self.process.poll()

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, once it exits; `subprocess.TimeoutExpired` after `timeout`."""
        return self.process.wait(timeout)

    def ready(self, probe: Callable[[], T], *, timeout: float, before: str, within: str,
              interval_s: float = 0.1) -> T:
        """The first truthy `probe()` (a port read from a file, a health check that passed),
        asked every `interval_s`. Raises `LaunchError` with the log's tail as soon as the child
        exits ("NAME exited with code C before BEFORE") or once `timeout` has passed ("NAME did
        not WITHIN within T s"); the child is stopped then, as on any other error."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                code = self.process.poll()
                if code is not None:
                    raise LaunchError(f"{self.name} exited with code {code} before {before}; "
                                      f"log tail:\n{self.log_tail()}")
                value = probe()
                if value:
                    return value
                if time.monotonic() >= deadline:
                    raise LaunchError(f"{self.name} did not {within} within {timeout:.0f}s; "
                                      f"log tail:\n{self.log_tail()}")
                time.sleep(interval_s)
        except BaseException:
            self.stop(NOT_READY_STOP_S)
            raise

    def log_tail(self, chars: int = 4000) -> str:
        """The last `chars` characters of its log (kept after `stop` removed a scratch log)."""
        if self._final_log is not None:
            return self._final_log[-chars:]
        if self.log_path is None:
            return "(no log: its output went to the parent's)"
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(log.seek(0, os.SEEK_END) - 4 * chars, 0))
                return log.read().decode(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, up to `timeout` s to exit, then SIGKILL; always reaped. A group leader's
        group is ended too. Returns the exit code; stopping again changes nothing."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.own_group:
            end_group(self.process.pid, timeout)
        if self.scratch is not None and self._final_log is None:
            if self.log_path is not None and self.log_path.parent == self.scratch:
                self._final_log = self.log_tail(100_000)
            shutil.rmtree(self.scratch, ignore_errors=True)
        return self.process.returncode

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def port_file(path: Path) -> Callable[[], int | None]:
    """A `Child.ready` probe: the port a child wrote to `path` (atomically), once it has."""
    return lambda: int(path.read_text()) if path.is_file() else None


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` has used so far (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`, from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def end_group(pgid: int, timeout: float) -> None:
    """SIGTERM every process left in group `pgid`, then SIGKILL what is still there."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + (timeout if sig == signal.SIGTERM else GROUP_KILL_WAIT_S)
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)


class RestartBudget:
    """The one restart policy: at most `max_restarts` restarts within any `window_s` seconds.
    With a window (the default, the learner's: 3 within 10 minutes) a child that dies now and
    then over a long job is always restarted and one that keeps dying is given up on; with
    `window_s = math.inf` it is `max_restarts` in all (each engine replica, each Ray host's
    child)."""

    def __init__(self, max_restarts: int = 3, window_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_restarts, self.window_s, self.clock = max_restarts, window_s, clock
        self._recent: list[float] = []
        self.restarts = 0  # in all

    def allow(self) -> bool:
        """Whether one more restart is within the budget; counts it when it is."""
        now = self.clock()
        self._recent = [t for t in self._recent if now - t < self.window_s]
        if len(self._recent) >= self.max_restarts:
            return False
        self._recent.append(now)
        self.restarts += 1
        return True
