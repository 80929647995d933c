"""Child processes of a job: the learner, SFT and model creation (the engine has its own
launcher in `engine.launch`).

Guarantees: a child started from the main thread dies with the job (SIGTERM on parent death,
so a SIGKILLed orchestrator leaves no learner or engine behind); a child's output goes to a log
file in the run directory; `stop` sends SIGTERM,
waits, then SIGKILLs and always reaps it; `watch` raises `ChildDied` with the log's tail as soon
as a child exits on its own, which fails the job's task group and so stops everything else.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Callable

import anyio

from stalewise.children import child_env, death_signal_hook, python_command


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


class Supervised:
    """A child that is restarted when it dies unexpectedly (the learner: it resumes from its
    last published checkpoint), at most `max_restarts` times; then `ChildDied` is raised."""

    def __init__(self, name: str, start: Callable[[], ChildProcess], *,
                 max_restarts: int = 3, log: Callable[..., None] | None = None) -> None:
        self.name, self._start, self.max_restarts = name, start, max_restarts
        self._log = log
        self.restarts = 0
        self.process = start()

    async def run(self, *, expected_exit: Callable[[], bool], interval_s: float = 0.5) -> None:
        while True:
            code = self.process.process.poll()
            if code is not None:
                if code == 0 and expected_exit():
                    return
                if self.restarts >= self.max_restarts:
                    raise ChildDied(f"the {self.name} process exited with code {code} after "
                                    f"{self.restarts} restarts; last log lines:\n"
                                    f"{self.process.log_tail()}")
                self.restarts += 1
                if self._log is not None:
                    self._log(f"{self.name} exited; restarting", code=code, restart=self.restarts)
                self.process = self._start()
            await anyio.sleep(interval_s)

    def stop(self, timeout: float = 15.0) -> int | None:
        return self.process.stop(timeout)
