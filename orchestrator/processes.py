"""How the job waits on and supervises its children (each a `core.children.Child`): the
learner, SFT and model creation here; the engines through `orchestrator.engines.fleet`.

Guarantees: `run_to_end` waits for a one-shot child without blocking the event loop and stops
it if the job is cancelled meanwhile; `watch` raises `ChildDied` with the log's tail as soon as
a child exits on its own, which fails the job's task group and so stops everything else;
`Supervised` restarts a child that dies within its `RestartBudget` (the learner's: 3 restarts
within 10 minutes) and raises `ChildDied` beyond it.
"""

from __future__ import annotations

from typing import Callable

import anyio

from core.children import Child, RestartBudget


class ChildDied(RuntimeError):
    """A child process exited while the job still needed it."""


async def run_to_end(child: Child, *, poll_s: float = 0.2) -> int:
    """Wait for a one-shot child (model creation, SFT) without blocking the event loop; if the
    job is cancelled meanwhile (SIGTERM, Ctrl-C), the child is stopped too. Returns its code."""
    try:
        while (code := child.poll()) is None:
            await anyio.sleep(poll_s)
        return code
    finally:
        if child.poll() is None:
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
    last published checkpoint), within a `RestartBudget`; beyond it `ChildDied` is raised."""

    def __init__(self, name: str, start: Callable[[], Child], *,
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
            code = self.process.poll()
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
