"""`arith`: compute an integer expression with a `python` tool; answer in `<answer>N</answer>`.

Prompts, calls and answers are deliberately short, so a ~1M-parameter model on 2 CPU cores can
learn the suite from a warm start:

    user:      Compute 3*(4+5) with python.
    assistant: <tool_call>{"name":"python","arguments":{"code":"print(3*(4+5))"}}</tool_call>
    tool:      27
    assistant: <answer>27</answer>

Reward 1 if the answer is exactly the integer value, else 0; zero-weight metrics report whether
the python tool was used and whether an answer tag was given. The difficulty bucket is the
number of operators (`ops=1` … `ops=max_ops`).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from tasks.api import SplitShares, TaskFamily, TaskInstance, draw_in_split
from tasks.builtin_tools import python
from tasks.demos import Demonstration, DemoTurn
from tasks.messages import ChatMessage
from tasks.suites.common import (answer_text, call_text, computed_answer_failure, exact_answer,
                                 instance_rng, sandbox_spec, task_limits, used_python)
from tasks.verify import Component, Rubric, VerifyContext

NAME = "arith"
OPS = ("+", "-", "*")
_PRECEDENCE = {"+": 1, "-": 1, "*": 2}
LIMIT_DEFAULTS: dict[str, Any] = dict(
    max_turns=4, max_generated_tokens=256, context_length=1024, wall_time_s=120.0,
    max_malformed_calls=2, max_tool_calls_per_turn=2, max_observation_chars=256,
    tool_timeout_s=20.0, verify_timeout_s=20.0)
SANDBOX_DEFAULTS: dict[str, Any] = dict(memory_mb=256, exec_timeout_s=20.0, pids=32)


def expression(rng: random.Random, ops: int, max_value: int) -> tuple[str, int]:
    """A random expression with `ops` operators over 0..max_value: (text, precedence)."""
    if ops == 0:
        return str(rng.randint(0, max_value)), 3
    left_ops = rng.randint(0, ops - 1)
    op = rng.choice(OPS)
    left, left_prec = expression(rng, left_ops, max_value)
    right, right_prec = expression(rng, ops - 1 - left_ops, max_value)
    if left_prec < _PRECEDENCE[op]:
        left = f"({left})"
    if right_prec < _PRECEDENCE[op] or (right_prec == _PRECEDENCE[op] and op == "-"):
        right = f"({right})"
    return f"{left}{op}{right}", _PRECEDENCE[op]


def evaluate(text: str) -> int:
    """The value of an expression made by `expression` (digits, + - * and parentheses only)."""
    if not set(text) <= set("0123456789+-*() "):
        raise ValueError(f"not an arith expression: {text!r}")
    return int(eval(text, {"__builtins__": {}}, {}))


def gave_answer(ctx: VerifyContext) -> float:
    return 0.0 if ctx.answer is None else 1.0


def diagnose(task: TaskInstance, messages: Sequence[ChatMessage]) -> str:
    """The failure mode of an unsolved arith trajectory."""
    return computed_answer_failure(task, messages, wrong_output="tool code does not compute the expression")


VERIFIER = Rubric(Component("exact", exact_answer, 1.0),
                  Component("used_python", used_python, 0.0),
                  Component("answer_tag", gave_answer, 0.0))


def family(*, max_ops: int = 3, max_value: int = 9, seed: int = 0, validation_share: float = 0.1, test_share: float = 0.2,
           image: str = "stalewise-base:latest", limits: Mapping[str, Any] | None = None,
           sandbox_limits: Mapping[str, Any] | None = None) -> TaskFamily:
    """The arith family. `limits` / `sandbox_limits` override TaskLimits / SandboxLimits fields.

    The splits are disjoint by expression: `validation_share` of all expressions (by a fixed
    hash of the text) are validation-only, `test_share` test-only, the rest train-only."""
    if max_ops < 1 or max_value < 1:
        raise ValueError(f"arith needs max_ops >= 1 and max_value >= 1, got {max_ops}, {max_value}")
    shares = SplitShares(validation_share, test_share)
    task_limits_ = task_limits(LIMIT_DEFAULTS, limits)
    spec = sandbox_spec(image, SANDBOX_DEFAULTS, sandbox_limits)

    def make(index: int, split: str) -> TaskInstance:
        rng = instance_rng(NAME, seed, split, index)
        ops, text = draw_in_split(NAME, split, shares, rng,
                                  lambda r: _draw(r, max_ops, max_value), key=lambda c: c[1])
        return TaskInstance(
            prompt=f"Compute {text} with python.", tools=(python,), verifier=VERIFIER,
            sandbox=spec, limits=task_limits_, data={"expression": text, "value": evaluate(text)},
            difficulty=f"ops={ops}")

    def demonstrate(task: TaskInstance, correct: bool) -> Demonstration:
        value = int(task.data["value"])
        answer = value
        if not correct:
            answer = value + random.Random(task.key).choice([-3, -2, -1, 1, 2, 3, 10])
        code = f"print({task.data['expression']})"
        return Demonstration(task, (
            DemoTurn(call_text("python", {"code": code}), (str(value),)),
            DemoTurn(answer_text(str(answer))),
        ), correct=correct)

    return TaskFamily(NAME, make, demonstrate=demonstrate,
                      description="integer expressions computed with a python tool",
                      options=dict(max_ops=max_ops, max_value=max_value, seed=seed,
                                   validation_share=validation_share, test_share=test_share, image=image),
                      split_key=lambda task: task.data["expression"], shares=shares,
                      diagnose=diagnose)


def _draw(rng: random.Random, max_ops: int, max_value: int) -> tuple[int, str]:
    ops = rng.randint(1, max_ops)
    return ops, expression(rng, ops, max_value)[0]
