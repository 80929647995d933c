"""Helpers shared by the built-in suites: compact tool-call text, options to limits and specs."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from typing import Any

from core.sandbox import SandboxLimits, SandboxSpec
from tasks.api import TaskLimits


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
