"""A user-defined task family in one file: count the lines of a log that mention a word.

Point a job at it with

    [tasks]
    family = "examples/my_task.py:family"
    options = { max_lines = 20 }

Everything a task needs is here: a custom tool (typed, documented, using the sandbox), the
sandbox files, limits, a hidden answer key that reaches the sandbox only at verification, a
rubric with a scored component and a zero-weight metric, difficulty buckets, and a
demonstration generator for supervised warm starts.
"""

from __future__ import annotations

import random

from core.sandbox import SandboxLimits, SandboxSpec
from tasks import (
    Component,
    Demonstration,
    DemoTurn,
    Rubric,
    TaskFamily,
    TaskInstance,
    TaskLimits,
    ToolContext,
    ToolError,
    VerifyContext,
    tool,
)
from tasks.builtin_tools import bash

WORDS = ("error", "warn", "info")


@tool(read_only=True, idempotent=True)
async def count_lines(ctx: ToolContext, path: str, word: str) -> str:
    """Count the lines of a file that contain a word.

    Args:
        path: the file, relative to the work directory.
        word: the word to look for (case-sensitive).
    """
    result = await ctx.sandbox.exec(["grep", "-c", "--", word, path], timeout=ctx.timeout_s)
    if result.exit_code not in (0, 1):  # grep: 0 found, 1 none found, 2 trouble
        raise ToolError(result.stderr.strip() or f"cannot read {path}")
    return result.stdout.strip()


async def correct(ctx: VerifyContext) -> float:
    key = (await ctx.sandbox.read_file("/work/answer_key.txt")).decode().strip()
    return 1.0 if ctx.answer == key else 0.0


def used_tool(ctx: VerifyContext) -> float:
    return 1.0 if ctx.tool_calls else 0.0


def family(max_lines: int = 12, seed: int = 0) -> TaskFamily:
    if max_lines < 3:
        raise ValueError(f"max_lines must be at least 3, got {max_lines}")

    def make(index: int, split: str) -> TaskInstance:
        rng = random.Random(f"logcount:{seed}:{split}:{index}")
        word = rng.choice(WORDS)
        lines = [f"{rng.choice(WORDS)}: event {i}" for i in range(rng.randint(3, max_lines))]
        count = sum(1 for line in lines if word in line)
        return TaskInstance(
            prompt=f"How many lines of app.log contain {word}? Answer as <answer>N</answer>.",
            tools=(count_lines, bash),
            verifier=Rubric(Component("correct", correct, 1.0),
                            Component("used_tool", used_tool, 0.0)),
            sandbox=SandboxSpec(files={"app.log": "\n".join(lines) + "\n"},
                                limits=SandboxLimits(memory_mb=128, exec_timeout_s=10)),
            limits=TaskLimits(max_turns=4, max_generated_tokens=512, context_length=1024),
            hidden_files={"answer_key.txt": str(count)},
            data={"word": word, "count": count},
            difficulty="short" if len(lines) < 8 else "long",
        )

    def demonstrate(task: TaskInstance, correct_answer: bool) -> Demonstration:
        count = int(task.data["count"])
        answer = count if correct_answer else count + 1
        call = ('<tool_call>{"name":"count_lines","arguments":{"path":"app.log","word":"'
                + str(task.data["word"]) + '"}}</tool_call>')
        return Demonstration(task, (DemoTurn(call, (str(count),)),
                                    DemoTurn(f"<answer>{answer}</answer>")),
                             correct=correct_answer)

    return TaskFamily("logcount", make, demonstrate=demonstrate,
                      options={"max_lines": max_lines, "seed": seed})
