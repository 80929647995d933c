"""Job log lines are JSON off a terminal and carry the run id, and the trajectory id where known."""

from __future__ import annotations

import json

import anyio
import structlog

from core.log import bind_run, bind_trajectory, configure_logging, get_logger


def test_lines_carry_run_and_trajectory_ids(capsys):
    configure_logging("json")
    structlog.contextvars.clear_contextvars()
    bind_run("run-1")
    log = get_logger("test")

    async def trajectory(tid: int) -> None:
        with bind_trajectory(tid):
            await anyio.sleep(0)
            log.info("turn", n=tid)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for tid in (7, 8):
                tg.start_soon(trajectory, tid)
        log.info("between trajectories")

    anyio.run(main)
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    turns = [line for line in lines if line["event"] == "turn"]
    assert sorted((t["trajectory_id"], t["n"]) for t in turns) == [(7, 7), (8, 8)]
    assert all(line["run_id"] == "run-1" for line in lines)
    assert "trajectory_id" not in next(x for x in lines if x["event"] == "between trajectories")
    structlog.contextvars.clear_contextvars()
