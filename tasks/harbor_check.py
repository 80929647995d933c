"""Check Harbor tasks with their own verifiers: the oracle must score 1, a no-op agent 0.

For every task of a Harbor family, two fresh sandboxes: one where `solution/solve.sh` runs
(copied to /solution, never part of the task instance) and one where nothing happens; in each,
the tests are copied to /tests and the task's verifier scores the result exactly as after a
real episode. A task whose solution, sandbox or verifier fails gets its problem in the row
(one line), never an exception, so one bad task does not hide the others.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

import anyio

from core.sandbox import Sandbox, SandboxError, SandboxSpec
from tasks.api import TaskFamily, TaskInstance
from tasks.harbor import HarborTaskError, run_oracle, task_of
from tasks.verify import VerifierError, VerifyContext

OpenSandbox = Callable[[SandboxSpec], AbstractAsyncContextManager[Sandbox]]


@dataclass(frozen=True)
class CheckRow:
    task: str
    oracle: float | None  # None when it could not be scored (see problems)
    noop: float | None
    problems: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return self.oracle is not None and self.oracle >= 1.0 and self.noop is not None \
            and self.noop <= 0.0 and not self.problems


async def check_harbor_family(family: TaskFamily, open_sandbox: OpenSandbox,
                              concurrency: int = 2) -> list[CheckRow]:
    """One row per task, in family order."""
    instances = list(family.instances("train"))
    rows: list[CheckRow | None] = [None] * len(instances)
    limiter = anyio.CapacityLimiter(concurrency)

    async def one(index: int, instance: TaskInstance) -> None:
        async with limiter:
            rows[index] = await check_instance(instance, open_sandbox)

    async with anyio.create_task_group() as group:
        for index, instance in enumerate(instances):
            group.start_soon(one, index, instance)
    return [row for row in rows if row is not None]


async def check_instance(instance: TaskInstance, open_sandbox: OpenSandbox) -> CheckRow:
    name = str(instance.data.get("harbor_task", instance.key))
    oracle, oracle_problem = await _score(instance, open_sandbox, oracle=True)
    noop, noop_problem = await _score(instance, open_sandbox, oracle=False)
    problems = tuple(dict.fromkeys(p for p in (oracle_problem, noop_problem) if p))
    if oracle is not None and oracle < 1.0:
        problems += (f"harbor task {name}: the oracle (solution/solve.sh) scored {oracle:g}, "
                     "not 1; fix the solution or the tests",)
    if noop is not None and noop > 0.0:
        problems += (f"harbor task {name}: doing nothing scored {noop:g}, not 0; make the "
                     "tests check the work, not only the starting state",)
    return CheckRow(name, oracle, noop, problems)


async def _score(instance: TaskInstance, open_sandbox: OpenSandbox,
                 oracle: bool) -> tuple[float | None, str | None]:
    who = "oracle" if oracle else "no-op"
    name = str(instance.data.get("harbor_task", instance.key))
    try:
        async with open_sandbox(instance.sandbox) as sandbox:
            await _put(sandbox, instance.sandbox.workdir, instance.sandbox.files)
            if oracle:
                result = await run_oracle(sandbox, task_of(instance))
                if result.timed_out or result.error_type is not None:
                    return None, (f"harbor task {name}: solution/solve.sh failed "
                                  f"({result.error_type}); fix it or raise [agent] timeout_sec")
            await _put(sandbox, instance.sandbox.workdir, instance.hidden_files)
            reward = await instance.verifier(VerifyContext(
                sandbox=sandbox, task=instance, messages=tuple(instance.prompt), final_text="",
                answer=None, stop_reason="answered", turns=0, tool_calls=0))
            return reward.value, None
    except (VerifierError, HarborTaskError) as err:
        return None, f"{who}: {err}"
    except SandboxError as err:
        return None, f"harbor task {name}: {str(err).splitlines()[0]}"


async def _put(sandbox: Sandbox, workdir: str, files: Mapping[str, str]) -> None:
    for path, text in files.items():
        await sandbox.write_file(path if path.startswith("/") else f"{workdir}/{path}", text)


def format_table(rows: list[CheckRow]) -> str:
    def score(value: float | None) -> str:
        return "error" if value is None else f"{value:g}"

    width = max([len("task")] + [len(row.task) for row in rows])
    lines = [f"{'task':<{width}}  oracle  no-op  ok"]
    for row in rows:
        lines.append(f"{row.task:<{width}}  {score(row.oracle):<6}  {score(row.noop):<5}  "
                     f"{'yes' if row.passed else 'NO'}")
    return "\n".join(lines)
