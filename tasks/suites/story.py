"""`story`: a short word problem; write the arithmetic for a `python` tool, answer the result.

    user:      Mia has 4 boxes with 12 pencils in each. She gives away 5 pencils. How many
               pencils does Mia have now? Use python.
    assistant: <tool_call>{"name":"python","arguments":{"code":"print(4*12-5)"}}</tool_call>
    tool:      43
    assistant: <answer>43</answer>

Unlike `arith`, the expression is not in the prompt: the model has to read the story, pick the
numbers that matter (some stories carry one that does not) and the operations between them.
A real model's mistakes here are its own (a wrong operation, a wrong number, the distractor),
not planted ones, which is what a task for a real checkpoint needs. Reward 1 for exactly the
right integer; the difficulty bucket is the story's shape (`shape=0` .. `shape=11`), so the
bias ledger shows which kinds of story admission favours.

The story shapes and their wordings are fixed; the names, items and numbers are drawn. The
splits are disjoint by the story's text (`validation_share`, `test_share` of all texts by a
fixed hash), so a test story is never a demonstration, while every shape appears in every
split.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tasks.api import SplitShares, TaskFamily, TaskInstance, draw_in_split
from tasks.builtin_tools import python
from tasks.demos import Demonstration, DemoTurn
from tasks.messages import ChatMessage
from tasks.suites.common import (answer_text, call_text, computed_answer_failure, exact_answer,
                                 instance_rng, sandbox_spec, task_limits, used_python)
from tasks.verify import Component, Rubric

NAME = "story"
LIMIT_DEFAULTS: dict[str, Any] = dict(
    max_turns=4, max_generated_tokens=256, context_length=1024, wall_time_s=120.0,
    max_malformed_calls=2, max_tool_calls_per_turn=2, max_observation_chars=256,
    tool_timeout_s=20.0, verify_timeout_s=20.0)
SANDBOX_DEFAULTS: dict[str, Any] = dict(memory_mb=256, exec_timeout_s=20.0, pids=32)
NAMES = (("Mia", "She"), ("Leo", "He"), ("Ana", "She"), ("Sam", "He"), ("Ivy", "She"),
         ("Ben", "He"), ("Zoe", "She"), ("Max", "He"), ("Eva", "She"), ("Tom", "He"))
ITEMS = ("pencils", "apples", "stickers", "cards", "marbles", "cookies", "stamps", "shells")


@dataclass(frozen=True)
class Shape:
    """One kind of story: its wordings, the expression over its numbers, their constraints."""

    wordings: tuple[str, ...]      # str.format over name, pronoun, item, a, b, c, extra
    expression: str                # over a, b, c (str.format), e.g. "{a}*{b}-{c}"
    valid: Callable[[int, int, int], bool] = lambda a, b, c: True


SHAPES = (
    Shape(("{name} has {a} boxes with {b} {item} in each. {pronoun} gives away {c} {item}. "
           "How many {item} does {name} have now?",
           "There are {b} {item} in each of {name}'s {a} boxes, and {name} gives {c} of them to "
           "a friend. How many {item} are left?"),
          "{a}*{b}-{c}", lambda a, b, c: a * b > c),
    Shape(("{name} had {a} {item}, found {b} more and then lost {c}. How many {item} does "
           "{name} have?",
           "{name} starts the day with {a} {item}. {pronoun} finds {b} {item} and loses {c}. "
           "How many {item} does {pronoun_lower} end the day with?"),
          "{a}+{b}-{c}", lambda a, b, c: a + b > c),
    Shape(("{name} reads {a} pages a day for {b} days and then {c} more pages. How many "
           "pages does {name} read in all?",),
          "{a}*{b}+{c}"),
    Shape(("A shop sells {item} at {a} dollars each. {name} buys {b} of them and pays with "
           "{c} dollars. How much change does {name} get?",
           "{name} pays {c} dollars for {b} {item} that cost {a} dollars each. How many dollars "
           "come back as change?"),
          "{c}-{a}*{b}", lambda a, b, c: c > a * b),
    Shape(("{name} is {extra} years old and has {a} bags of {b} {item}. {pronoun} buys {c} "
           "more bags. How many {item} does {name} have?",
           "{name}, who is {extra}, owns {a} bags with {b} {item} each and gets {c} more bags "
           "of the same size. How many {item} are there now?"),
          "({a}+{c})*{b}"),
    Shape(("A baker makes {a} trays of {b} cookies and sells {c} of the trays. How many "
           "cookies are left?",),
          "({a}-{c})*{b}", lambda a, b, c: a > c),
    Shape(("{name} saves {a} dollars every week. After {b} weeks {pronoun_lower} spends {c} "
           "dollars. How many dollars are saved?",
           "Every week {name} puts {a} dollars aside. {pronoun} does this for {b} weeks, then "
           "spends {c} dollars. How much is left?"),
          "{a}*{b}-{c}", lambda a, b, c: a * b > c),
    Shape(("{a} friends share {b} {item} each with {name}, who already has {c}. How many "
           "{item} does {name} have now?",),
          "{a}*{b}+{c}"),
    Shape(("A bus carries {a} people. At the first stop {b} get off and {c} get on. How many "
           "people are on the bus?",
           "{a} people ride a bus; {b} leave it at a stop where {c} new riders board. How "
           "many people ride on?"),
          "{a}-{b}+{c}", lambda a, b, c: a > b),
    Shape(("{name} has {a} {item} and {extra} friends. {pronoun} buys {b} packs of {c} "
           "{item}. How many {item} does {name} have?",),
          "{a}+{b}*{c}"),
    Shape(("{name} splits {a} {item} into {b} equal piles and keeps one pile plus {c} more "
           "{item}. How many {item} does {name} keep?",),
          "{a}//{b}+{c}", lambda a, b, c: a % b == 0 and a >= b),
    Shape(("There are {a} rows of {b} chairs in a hall, and {c} chairs are taken. How many "
           "chairs are free?",),
          "{a}*{b}-{c}", lambda a, b, c: a * b > c),
)


@dataclass(frozen=True)
class Story:
    text: str
    expression: str
    shape: int   # index in SHAPES: the difficulty bucket


def _story(rng: random.Random, max_value: int) -> Story:
    index = rng.randrange(len(SHAPES))
    shape = SHAPES[index]
    name, pronoun = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    while True:
        a, b, c = (rng.randint(2, max_value) for _ in range(3))
        if shape.valid(a, b, c):
            break
    if shape.expression.startswith("{a}//"):  # a multiple of b, so the piles are equal
        a = b * rng.randint(1, max_value)
    words = dict(name=name, pronoun=pronoun, pronoun_lower=pronoun.lower(), item=item,
                 a=a, b=b, c=c, extra=rng.randint(6, 12))
    expression = shape.expression.format(a=a, b=b, c=c)
    return Story(rng.choice(shape.wordings).format(**words), expression, index)


def _misread(expression: str) -> str:
    """A wrong demonstration's expression: its last operation read as another one."""
    swap = {"+": "-", "-": "+", "*": "+"}
    for i in range(len(expression) - 1, -1, -1):
        if expression[i] in swap and expression[i - 1] not in "*/":
            return expression[:i] + swap[expression[i]] + expression[i + 1:]
    return expression


VERIFIER = Rubric(Component("exact", exact_answer, 1.0),
                  Component("used_python", used_python, 0.0))


def diagnose(task: TaskInstance, messages: Sequence[ChatMessage]) -> str:
    """The failure mode of an unsolved story trajectory."""
    return computed_answer_failure(task, messages, wrong_output="the code computes another quantity")


def family(*, max_value: int = 20, seed: int = 0, validation_share: float = 0.1,
           test_share: float = 0.2, image: str = "stalewise-base:latest",
           limits: Mapping[str, Any] | None = None,
           sandbox_limits: Mapping[str, Any] | None = None) -> TaskFamily:
    """The story family; numbers are drawn from 2..max_value (module docstring)."""
    if max_value < 4:
        raise ValueError(f"story needs max_value >= 4, got {max_value}")
    shares = SplitShares(validation_share, test_share)
    task_limits_ = task_limits(LIMIT_DEFAULTS, limits)
    spec = sandbox_spec(image, SANDBOX_DEFAULTS, sandbox_limits)

    def make(index: int, split: str) -> TaskInstance:
        rng = instance_rng(NAME, seed, split, index)
        story = draw_in_split(NAME, split, shares, rng, lambda r: _story(r, max_value),
                              key=lambda s: s.text)
        value = int(eval(story.expression, {"__builtins__": {}}, {}))
        return TaskInstance(
            prompt=f"{story.text} Use python.", tools=(python,), verifier=VERIFIER,
            sandbox=spec, limits=task_limits_,
            data={"story": story.text, "expression": story.expression, "value": value},
            difficulty=f"shape={story.shape}")

    def demonstrate(task: TaskInstance, correct: bool) -> Demonstration:
        expression = task.data["expression"] if correct else _misread(task.data["expression"])
        value = int(eval(expression, {"__builtins__": {}}, {}))
        if not correct and value == task.data["value"]:
            value += 1  # the misreading happened to give the right number: answer off by one
        return Demonstration(task, (
            DemoTurn(call_text("python", {"code": f"print({expression})"}),
                     (str(int(eval(expression, {"__builtins__": {}}, {}))),)),
            DemoTurn(answer_text(str(value))),
        ), correct=correct)

    return TaskFamily(NAME, make, demonstrate=demonstrate,
                      description="word problems turned into python arithmetic",
                      options=dict(max_value=max_value, seed=seed,
                                   validation_share=validation_share, test_share=test_share,
                                   image=image),
                      split_key=lambda task: task.data["story"], shares=shares,
                      diagnose=diagnose)
