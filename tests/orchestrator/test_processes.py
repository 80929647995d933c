"""Child supervision (orchestrator.processes): a learner that dies now and then over a long job
is restarted every time; one that keeps dying is given up on, saying how often it died (the
restart budget itself: tests/core/test_children.py)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from core.children import Child, RestartBudget, python_command
from orchestrator.processes import ChildDied, Supervised


def test_a_child_that_keeps_dying_is_given_up_on_with_its_log(tmp_path: Path):
    def start() -> Child:
        code = "import sys; print('boom'); sys.exit(3)"
        return Child.start("crasher", python_command("-c", code), tmp_path / "crasher.log")

    supervised = Supervised("crasher", start, budget=RestartBudget(max_restarts=2))

    async def main():
        await supervised.run(expected_exit=lambda: False, interval_s=0.05)

    with pytest.raises(ChildDied, match=r"exited with code 3; it died 3 times within 600 s, "
                                        r"more than the 2 restarts allowed in that time "
                                        r"\(2 restarts in all\); last log lines:\n(boom\n)+"):
        anyio.run(main)
    assert supervised.restarts == 2
