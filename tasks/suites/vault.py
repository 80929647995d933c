"""`vault`: a long-horizon suite; walk a chain of doors kept in the sandbox, answer the gold.

The sandbox holds a maze of rooms as files (`maze/<door>`), the agent's position
(`.vault/here`) and its move count (`.vault/moves`). The `go` tool opens a door of the current
room: it succeeds only for the one door there, moves the agent (the state lives in the sandbox
between calls) and shows what is behind it, the next door or the gold. Success therefore needs
exactly `depth` sequential tool calls (at least 6), each depending on the last observation:

    user:      Go through door 3fa, then every door behind it; answer the gold.
    assistant: <tool_call>{"name":"go","arguments":{"door":"3fa"}}</tool_call>
    tool:      door 91c
    ... (depth calls in all)
    tool:      gold 4821
    assistant: <answer>4821</answer>

Reward 1 if the answer is the gold and the sandbox says the agent stands in the gold room, else
0; `depth_reached`, the share of doors opened, is a zero-weight metric unless `progress_reward`
pays that share of the reward for it (partial credit for a long walk; success is still reward
1). Difficulty levels (`depth=6`, `depth=10`, ... from `depths`) differ in the number of
calls; each door also waits a heavy-tailed time inside the sandbox (lognormal,
`delay_median_s`, `delay_sigma`, capped at `delay_max_s`, a pure function of the task and the
door), so durations differ by orders of magnitude between levels and within one.

The train, validation and test splits are disjoint by construction: the split key is the first
door, and a door belongs to exactly one split (`tasks.api.SplitShares`: a fixed hash,
`validation_share` of the doors validation-only, `test_share` test-only).
Demonstrations come from the train split only; a deliberately wrong one stops early and answers
the last door it saw, which is the mistake RL has to unlearn.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tasks.api import SplitShares, TaskFamily, TaskInstance, draw_in_split
from tasks.chat.parsing import extract_answer
from tasks.demos import Demonstration, DemoTurn
from tasks.messages import ChatMessage
from tasks.suites.common import answer_text, call_text, instance_rng, sandbox_spec, task_limits
from tasks.suites.longhaul import stable_normal
from tasks.tools import Tool, ToolContext, ToolError, tool
from tasks.verify import Component, Rubric, VerifyContext

NAME = "vault"
CODE_CHARS = 3
_CODE = re.compile(r"^[0-9a-f]{3}$")
STATE = ".vault"
SANDBOX_DEFAULTS: dict[str, Any] = dict(memory_mb=128, exec_timeout_s=60.0, pids=32)
# Move only through the one door of the current room; the state stays in the sandbox.
GO_SCRIPT = r"""
set -e
door="$1"; delay="$2"
here=$(cat .vault/here)
ahead=$(cat "maze/$here")
if [ "$ahead" != "door $door" ]; then echo "no door $door here" >&2; exit 3; fi
if [ "$delay" != "0" ]; then sleep "$delay"; fi
printf '%s' "$door" > .vault/here
echo $(( $(cat .vault/moves) + 1 )) > .vault/moves
cat "maze/$door"
"""


def code(rng: random.Random) -> str:
    return f"{rng.getrandbits(4 * CODE_CHARS):0{CODE_CHARS}x}"


def doors_for(rng: random.Random, split: str, depth: int, shares: SplitShares) -> list[str]:
    """`depth` distinct doors, the first of them (the split key) in `split`."""
    doors = [draw_in_split(NAME, split, shares, rng, code, key=lambda door: door)]
    while len(doors) < depth:
        candidate = code(rng)
        if candidate not in doors:
            doors.append(candidate)
    return doors


def door_delay(task_key: str, position: int, median_s: float, sigma: float,
               max_s: float) -> float:
    """Seconds door `position` of a task waits: lognormal, capped, a pure function of both."""
    if median_s <= 0:
        return 0.0
    return min(max_s, median_s * math.exp(sigma * stable_normal(f"{task_key}:{position}")))


def maze_files(doors: Sequence[str], gold: str) -> dict[str, str]:
    files = {"maze/start": f"door {doors[0]}", f"{STATE}/here": "start", f"{STATE}/moves": "0"}
    for here, ahead in zip(doors, doors[1:]):
        files[f"maze/{here}"] = f"door {ahead}"
    files[f"maze/{doors[-1]}"] = f"gold {gold}"
    return files


def make_go_tool(median_s: float, sigma: float, max_s: float) -> Tool:
    @tool(name="go")
    async def go(ctx: ToolContext, door: str) -> str:
        """Open a door of the room you are in and walk through it; says what is behind it.

        Args:
            door: the door's code (three hex characters).
        """
        if not _CODE.match(door):
            raise ToolError(f"a door is three hex characters, got {door!r}")
        doors = list(ctx.task.data["doors"])
        position = doors.index(door) if door in doors else 0
        delay = door_delay(ctx.task.key, position, median_s, sigma, max_s)
        result = await ctx.sandbox.exec(["sh", "-c", GO_SCRIPT, "go", door, f"{delay:.3f}"],
                                        timeout=ctx.timeout_s)
        if result.exit_code == 3:
            raise ToolError(result.stderr.strip())
        if not result.ok:
            raise ToolError(f"go failed: {result.stderr.strip() or result.error_type}")
        return result.stdout.strip()
    return go


async def found_gold(ctx: VerifyContext) -> float:
    if ctx.answer is None or ctx.answer.strip() != ctx.task.data["gold"]:
        return 0.0
    here = await ctx.sandbox.exec(["cat", f"{STATE}/here"], timeout=10.0)
    return 1.0 if here.ok and here.stdout.strip() == ctx.task.data["doors"][-1] else 0.0


async def depth_reached(ctx: VerifyContext) -> float:
    moves = await ctx.sandbox.exec(["cat", f"{STATE}/moves"], timeout=10.0)
    if not moves.ok or not moves.stdout.strip().isdigit():
        return 0.0
    return min(1.0, int(moves.stdout.strip()) / len(ctx.task.data["doors"]))


def diagnose(task: TaskInstance, messages: Sequence[ChatMessage]) -> str:
    """The failure mode of an unsolved vault walk (from the transcript: what the `go` calls
    showed and what the model answered)."""
    shown = [m.content.strip() for m in messages if m.role == "tool"]
    final = next((m.content for m in reversed(messages) if m.role == "assistant"), "")
    if not shown:
        return "no door opened"
    if any(not text.startswith(("door ", "gold ")) for text in shown):
        return "a door that was not there"
    if not any(text.startswith("gold ") for text in shown):
        return "stopped before the gold"
    if extract_answer(final) is None:
        return "no answer after the gold"
    return "wrong answer after the gold"


def verifier(progress_reward: float) -> Rubric:
    """Reward = (1 - progress_reward) * gold + progress_reward * depth_reached: 1 exactly when
    the walk is complete and the gold right (success), partial credit per door opened else."""
    return Rubric(Component("gold", found_gold, 1.0 - progress_reward),
                  Component("depth_reached", depth_reached, progress_reward))


def family(*, depths: Sequence[int] = (6, 10, 16), delay_median_s: float = 0.0,
           delay_sigma: float = 1.0, delay_max_s: float = 10.0, seed: int = 0,
           validation_share: float = 0.1, test_share: float = 0.25, progress_reward: float = 0.0,
           image: str = "stalewise-base:latest", limits: Mapping[str, Any] | None = None,
           sandbox_limits: Mapping[str, Any] | None = None) -> TaskFamily:
    """The vault family: `depths` are the difficulty levels (doors per instance, each >= 6),
    drawn uniformly; `delay_*` set each door's wait inside the sandbox (median 0 = none);
    `progress_reward` is the share of the reward paid for doors opened (0 = only the gold
    counts; success, reward 1, always needs the whole walk and the gold)."""
    levels = sorted(set(int(d) for d in depths))
    if not levels or levels[0] < 6:
        raise ValueError(f"vault depths must be at least 6 (success needs 6+ tool calls), "
                         f"got {list(depths)}")
    if delay_median_s < 0 or delay_sigma < 0 or delay_max_s <= 0:
        raise ValueError("vault delays must be >= 0 (median, sigma) and > 0 (max)")
    if not 0.0 <= progress_reward < 1.0:
        raise ValueError(f"vault progress_reward is the share of the reward paid per door "
                         f"opened, in [0, 1); got {progress_reward}")
    shares = SplitShares(validation_share, test_share)
    rubric = verifier(progress_reward)
    deepest = levels[-1]
    defaults = dict(max_turns=deepest + 3, max_generated_tokens=64 * (deepest + 3),
                    context_length=max(1024, 96 * (deepest + 3)),
                    wall_time_s=300.0 + deepest * delay_max_s, max_malformed_calls=1,
                    max_tool_calls_per_turn=1, max_observation_chars=128,
                    tool_timeout_s=delay_max_s + 30.0, verify_timeout_s=30.0)
    task_limits_ = task_limits(defaults, limits)
    go = make_go_tool(delay_median_s, delay_sigma, delay_max_s)

    def make(index: int, split: str) -> TaskInstance:
        rng = instance_rng(NAME, seed, split, index)
        depth = rng.choice(levels)
        doors = doors_for(rng, split, depth, shares)
        gold = f"{rng.randrange(10000):04d}"  # four digits: never a door
        spec = sandbox_spec(image, SANDBOX_DEFAULTS, sandbox_limits,
                            files=maze_files(doors, gold))
        return TaskInstance(
            prompt=f"Go through door {doors[0]}, then every door behind it; answer the gold.",
            tools=(go,), verifier=rubric, sandbox=spec, limits=task_limits_,
            data={"doors": doors, "gold": gold, "depth": depth, "split_key": doors[0]},
            difficulty=f"depth={depth}")

    def demonstrate(task: TaskInstance, correct: bool) -> Demonstration:
        doors, gold = list(task.data["doors"]), str(task.data["gold"])
        seen = [f"door {d}" for d in doors[1:]] + [f"gold {gold}"]
        # A wrong demonstration gives up after fewer doors and answers the last door it saw.
        walked = len(doors) if correct else random.Random(task.key).randint(2, len(doors) - 1)
        turns = [DemoTurn(call_text("go", {"door": door}), (seen[i],))
                 for i, door in enumerate(doors[:walked])]
        answer = gold if correct else doors[walked]
        turns.append(DemoTurn(answer_text(answer)))
        return Demonstration(task, tuple(turns), correct=correct)

    return TaskFamily(NAME, make, demonstrate=demonstrate,
                      description="walk depth doors kept in the sandbox, answer the gold",
                      options=dict(depths=levels, delay_median_s=delay_median_s,
                                   delay_sigma=delay_sigma, delay_max_s=delay_max_s, seed=seed,
                                   validation_share=validation_share, test_share=test_share, progress_reward=progress_reward,
                                   image=image),
                      split_key=lambda task: str(task.data["doors"][0]), shares=shares,
                      diagnose=diagnose)
