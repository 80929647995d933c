"""Static checks of a task family, without a sandbox or a model.

`check_family` builds instances of every split and reports problems as sentences: keys that do
not rebuild the same content, tool schemas that are not valid JSON Schema, demonstrations whose
tool calls do not parse, name unknown tools, fail the tool's schema, or do not match the number
of observations, and demonstration sets whose correctness flags are not what was asked for.
"""

from __future__ import annotations

import jsonschema

from tasks.api import TaskFamily, TaskInstance
from tasks.chat.parsing import parse_tool_calls
from tasks.demos import Demonstration
from tasks.tools import ToolArgumentError


def check_family(family: TaskFamily, count: int) -> list[str]:
    problems: list[str] = []
    for split in family.splits:
        for task in family.instances(split, count=count):
            problems += check_instance(family, task)
            if family.has_demonstrations:
                for correct in (True, False):
                    problems += check_demonstration(family.demonstration(task, correct), correct)
    return problems


def check_instance(family: TaskFamily, task: TaskInstance) -> list[str]:
    problems = []
    if family.by_key(task.key).content_hash != task.content_hash:
        problems.append(f"{task.key}: rebuilding from the key gives different content "
                        "(make() must be deterministic in index and split)")
    for tool in task.tools:
        try:
            jsonschema.Draft202012Validator.check_schema(tool.parameters)
        except jsonschema.SchemaError as err:
            problems.append(f"{task.key}: tool {tool.name} schema is invalid: {err.message}")
    return problems


def check_demonstration(demo: Demonstration, correct: bool) -> list[str]:
    key = demo.task.key
    problems = []
    if demo.correct != correct:
        problems.append(f"{key}: asked for a {'correct' if correct else 'wrong'} demonstration, "
                        f"got correct={demo.correct}")
    names = [t.name for t in demo.task.tools]
    for number, turn in enumerate(demo.turns):
        calls = parse_tool_calls(turn.assistant, names)
        for call in calls:
            tool = demo.task.tool(call.name or "")
            if call.error or tool is None:
                problems.append(f"{key} turn {number}: malformed call: {call.error}")
                continue
            try:
                tool.validate(call.arguments)
            except ToolArgumentError as err:
                problems.append(f"{key} turn {number}: {err}")
        if len(calls) != len(turn.observations):
            problems.append(f"{key} turn {number}: {len(calls)} calls, "
                            f"{len(turn.observations)} observations")
    if demo.turns and demo.turns[-1].observations:
        problems.append(f"{key}: the last turn must be the answer (no tool calls)")
    return problems
