"""Child processes of a job: the learner, SFT and model creation (the engine has its own
launcher in `orchestrator.engines.launch`).

Guarantees: a child started from the main thread dies with the job (SIGTERM on parent death,
so a SIGKILLed orchestrator leaves no learner or engine behind); a child's output goes to a log
file in the run directory; `stop` sends SIGTERM,
waits, then SIGKILLs and always reaps it; `watch` raises `ChildDied` with the log's tail as soon
as a child exits on its own, which fails the job's task group and so stops everything else.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Callable

import anyio

from core.children import child_env, death_signal_hook, python_command


class ChildDied(RuntimeError):
    """A child process exited while the job still needed it."""


class ChildProcess:
    def __init__(self, name: str, process: subprocess.Popen, log_path: Path) -> None:
        self.name, self.process, self.log_path = name, process, log_path

    @classmethod
    def start(cls, name: str, argv: list[str], log_path: Path,
              env: dict[str, str] | None = None) -> "ChildProcess":
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            process = subprocess.Popen(python_command(*argv), stdout=log,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=child_env(env), preexec_fn=death_signal_hook())
        return cls(name, process, log_path)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


async def run_to_end(child: ChildProcess, *, poll_s: float = 0.2) -> int:
    """Wait for a one-shot child (model creation, SFT) without blocking the event loop; if the
    job is cancelled meanwhile (SIGTERM, Ctrl-C), the child is stopped too. Returns its code."""
    try:
        while (code := child.process.poll()) is None:
            await anyio.sleep(poll_s)
        return code
    finally:
        if child.process.poll() is None:
            child.stop(timeout=5.0)


async def watch(name: str, poll: Callable[[], int | None], log_tail: Callable[[], str],
                *, interval_s: float = 0.5, expected_exit: Callable[[], bool] = lambda: False
                ) -> None:
    """Return when the child exits as expected; raise `ChildDied` when it exits otherwise."""
    while True:
        code = poll()
        if code is not None:
            if code == 0 and expected_exit():
                return
            raise ChildDied(f"the {name} process exited with code {code}; last log lines:\n"
                            f"{log_tail()}")
        await anyio.sleep(interval_s)


class RestartBudget:
    """At most `max_restarts` restarts within any `window_s` seconds: a child that dies now and
    then over a long job is always restarted, one that keeps dying is given up on."""

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


class Supervised:
    """A child that is restarted when it dies unexpectedly (the learner: it resumes from its
    last published checkpoint), within a `RestartBudget`; beyond it `ChildDied` is raised."""

    def __init__(self, name: str, start: Callable[[], ChildProcess], *,
                 budget: RestartBudget | None = None,
                 log: Callable[..., None] | None = None) -> None:
        self.name, self._start = name, start
        self.budget = budget or RestartBudget()
        self._log = log
        self.process = start()

    @property
    def restarts(self) -> int:
        return self.budget.restarts

    async def run(self, *, expected_exit: Callable[[], bool], interval_s: float = 0.5) -> None:
        while True:
            code = self.process.process.poll()
            if code is not None:
                if code == 0 and expected_exit():
                    return
                if not self.budget.allow():
                    raise ChildDied(f"the {self.name} process exited with code {code}; it "
                                    f"died {self.budget.max_restarts + 1} times within "
                                    f"{self.budget.window_s:.0f} s, more than the "
                                    f"{self.budget.max_restarts} restarts allowed in that time "
                                    f"({self.restarts} restarts in all); last log lines:\n"
                                    f"{self.process.log_tail()}")
                if self._log is not None:
                    self._log(f"{self.name} exited; restarting", code=code, restart=self.restarts)
                self.process = self._start()
            await anyio.sleep(interval_s)

    def stop(self, timeout: float = 15.0) -> int | None:
        return self.process.stop(timeout)
