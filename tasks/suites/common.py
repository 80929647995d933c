"""Helpers shared by the built-in suites: compact tool-call text, options to limits and specs."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from typing import Any

from collections.abc import Sequence

from core.sandbox import SandboxLimits, SandboxSpec
from tasks.api import TaskInstance, TaskLimits
from tasks.chat.parsing import extract_answer
from tasks.messages import ChatMessage
from tasks.verify import VerifyContext


def call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """`<tool_call>{"name":...,"arguments":{...}}</tool_call>` in the compact form demos use."""
    body = json.dumps({"name": name, "arguments": dict(arguments)}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


def answer_text(answer: str) -> str:
    return f"<answer>{answer}</answer>"


def instance_rng(family: str, seed: int, split: str, index: int) -> random.Random:
    return random.Random(f"{family}:{seed}:{split}:{index}")


def task_limits(defaults: Mapping[str, Any], overrides: Mapping[str, Any] | None) -> TaskLimits:
    """Suite defaults updated with the user's `limits = {...}` option (validated)."""
    return TaskLimits(**{**defaults, **dict(overrides or {})})


def sandbox_spec(image: str, defaults: Mapping[str, Any],
                 overrides: Mapping[str, Any] | None, files: Mapping[str, str] | None = None
                 ) -> SandboxSpec:
    limits = SandboxLimits(**{**defaults, **dict(overrides or {})})
    return SandboxSpec(image=image, limits=limits, files=dict(files or {}))


def exact_answer(ctx: VerifyContext) -> float:
    """1 if the answer is exactly the task's `value`, else 0 (arith, story)."""
    expected = str(ctx.task.data["value"])
    return 1.0 if ctx.answer is not None and ctx.answer.strip() == expected else 0.0


def used_python(ctx: VerifyContext) -> float:
    return 1.0 if ctx.tool_calls > 0 else 0.0


def computed_answer_failure(task: TaskInstance, messages: Sequence[ChatMessage], *,
                            wrong_output: str) -> str:
    """The failure mode of an unsolved trajectory whose tool should print the task's `value`
    and whose answer should repeat it; `wrong_output` names the case where no tool output was
    the value (what the family calls that mistake)."""
    value = str(task.data["value"])
    outputs = [m.content.strip() for m in messages if m.role == "tool"]
    final = next((m.content for m in reversed(messages) if m.role == "assistant"), "")
    if not outputs:
        return "no tool call"
    if value not in outputs:
        return wrong_output
    if extract_answer(final) is None:
        return "no answer after the right tool output"
    return "wrong answer after the right tool output"
