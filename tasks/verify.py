"""Verifiers: async scoring of a finished trajectory, a reward plus a named breakdown.

A `Rubric` is a list of named `Component`s, each a function of the `VerifyContext` (sync or
async) returning a float. The reward is the weighted sum of the components; a component with
weight 0 is a metric: it appears in the breakdown and never moves the reward. Components run
one after another in declaration order (they may share the sandbox). Any async callable
returning a `Reward` can serve as a verifier too; a plain number (a bool too: 1 or 0) is taken as
`Reward(number)`, and anything else (None from a verifier that forgot its `return`, a string, a
dict) is a bug in the verifier, said in one line (`as_reward`).

A verifier raises `VerifierError` when it cannot score at all (an external test script that
crashed or wrote no reward); any other exception is a bug in the verifier.

Hidden files of the task are written into the sandbox by the agent loop right before the
verifier runs, never earlier, so the agent cannot see them.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from core.sandbox import Sandbox
from tasks.messages import ChatMessage

if TYPE_CHECKING:
    from tasks.api import TaskInstance


class VerifierError(Exception):
    """The verifier could not score (its script crashed, timed out, or wrote no reward).

    Not the policy's failure and not reward 0: the agent loop records the trajectory as an
    infrastructure error (`error_type = verifier_error`) and admission keeps it out of training.
    """


@dataclass(frozen=True)
class Reward:
    value: float
    breakdown: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not math.isfinite(self.value):
            raise ValueError(f"reward must be finite, got {self.value}")


@dataclass(frozen=True)
class VerifyContext:
    """What a verifier sees: the sandbox after the agent stopped, the task and the transcript."""

    sandbox: Sandbox
    task: TaskInstance
    messages: tuple[ChatMessage, ...]
    final_text: str  # the last assistant message
    answer: str | None  # the content of its last <answer>...</answer>, if any
    stop_reason: str
    turns: int
    tool_calls: int


def as_reward(result: Any) -> Reward:
    """A verifier's result as a `Reward`: a `Reward` as it is, a real number as its value;
    anything else raises TypeError saying what came back and what to return."""
    if isinstance(result, Reward):
        return result
    if isinstance(result, numbers.Real):
        return Reward(float(result))
    shown = repr(result)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise TypeError(f"the verifier returned {type(result).__name__} {shown}, not a Reward; "
                    "return Reward(score) or a number"
                    + (" (a verifier without a return statement returns None)"
                       if result is None else ""))


class Verifier(Protocol):
    async def __call__(self, ctx: VerifyContext) -> Reward: ...

    def describe(self) -> str: ...


ScoreFn = Callable[[VerifyContext], "float | Awaitable[float]"]


@dataclass(frozen=True)
class Component:
    name: str
    fn: ScoreFn
    weight: float = 1.0


class Rubric:
    """Weighted sum of named components; weight 0 components are reported metrics."""

    def __init__(self, *components: Component) -> None:
        if not components:
            raise ValueError("a Rubric needs at least one Component")
        names = [c.name for c in components]
        if len(set(names)) != len(names):
            raise ValueError(f"Rubric component names must be unique, got {names}")
        self.components = components

    async def __call__(self, ctx: VerifyContext) -> Reward:
        breakdown: dict[str, float] = {}
        total = 0.0
        for component in self.components:
            score = component.fn(ctx)
            if inspect.isawaitable(score):
                score = await score
            score = float(score)
            if not math.isfinite(score):
                raise ValueError(f"verifier component {component.name!r} returned {score}")
            breakdown[component.name] = score
            total += component.weight * score
        return Reward(total, breakdown)

    def describe(self) -> str:
        return " + ".join(f"{c.weight:g}*{c.name}" for c in self.components)


def describe_verifier(verifier: Any) -> str:
    describe = getattr(verifier, "describe", None)
    if callable(describe):
        return str(describe())
    return getattr(verifier, "__qualname__", type(verifier).__qualname__)
