"""Child supervision (orchestrator.processes): a learner that dies now and then over a long job
is restarted every time; one that keeps dying is given up on, saying how often it died."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from orchestrator.processes import ChildDied, ChildProcess, RestartBudget, Supervised


def test_the_restart_budget_counts_restarts_within_its_window_only():
    now = [0.0]
    budget = RestartBudget(max_restarts=2, window_s=100.0, clock=lambda: now[0])
    assert budget.allow() and budget.allow() and not budget.allow()
    now[0] = 101.0  # both earlier restarts are out of the window
    assert budget.allow() and budget.allow() and not budget.allow()
    assert budget.restarts == 4


def test_a_child_that_keeps_dying_is_given_up_on_with_its_log(tmp_path: Path):
    def start() -> ChildProcess:
        return ChildProcess.start("crasher", ["-c", "import sys; print('boom'); sys.exit(3)"],
                                  tmp_path / "crasher.log")

    supervised = Supervised("crasher", start, budget=RestartBudget(max_restarts=2))

    async def main():
        await supervised.run(expected_exit=lambda: False, interval_s=0.05)

    with pytest.raises(ChildDied, match=r"exited with code 3; it died 3 times within 600 s, "
                                        r"more than the 2 restarts allowed in that time "
                                        r"\(2 restarts in all\); last log lines:\n(boom\n)+"):
        anyio.run(main)
    assert supervised.restarts == 2
