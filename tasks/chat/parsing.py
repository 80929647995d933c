"""Hermes/Qwen-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

`parse_tool_calls` finds every call in the decoded text of a sampled turn, in order. A call is
well-formed when its body is a JSON object with a string `name` naming an available tool and an
object `arguments` (a JSON string holding an object is accepted too, as OpenAI sends it). Every
other case becomes a `ParsedCall` with an `error` that says what is wrong, short enough to show
to the model: unclosed or stray tags, bad JSON, a missing or unknown name, non-object arguments,
arguments holding half of a UTF-16 surrogate pair (a JSON escape such as `\ud800`: no text
can hold one, so no tool, tokenizer or store could take it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from core.text import SURROGATES
from tasks.chat.base import ParsedCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_TAG = re.compile(re.escape(OPEN) + "|" + re.escape(CLOSE))
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def parse_tool_calls(text: str, tool_names: Sequence[str]) -> tuple[ParsedCall, ...]:
    calls: list[ParsedCall] = []
    open_at: int | None = None
    for match in _TAG.finditer(text):
        if match.group(0) == OPEN:
            if open_at is not None:
                calls.append(ParsedCall(raw=text[open_at:match.start()],
                                        error=f"{OPEN} opened again before {CLOSE}"))
            open_at = match.start()
        elif open_at is None:
            calls.append(ParsedCall(raw=CLOSE, error=f"{CLOSE} without {OPEN}"))
        else:
            body = text[open_at + len(OPEN):match.start()]
            calls.append(parse_call_body(body, tool_names))
            open_at = None
    if open_at is not None:
        calls.append(ParsedCall(raw=text[open_at:], error=f"{OPEN} is never closed by {CLOSE}"))
    return tuple(calls)


def parse_call_body(body: str, tool_names: Sequence[str]) -> ParsedCall:
    raw = body.strip()
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError as err:
        return ParsedCall(raw=raw, error=f"tool call is not valid JSON ({err.msg} at {err.pos})")
    return named_call(raw, value, tool_names)


def named_call(raw: str, value: Any, tool_names: Sequence[str],
               argument_keys: Sequence[str] = ("arguments",)) -> ParsedCall:
    """The call in a decoded JSON `value`: a known tool's name and a JSON-object argument
    (under the first of `argument_keys` present; a JSON string there is decoded), or the error
    that says what is wrong. `raw` is the text the call came from."""
    if not isinstance(value, dict):
        return ParsedCall(raw=raw, error="tool call must be a JSON object with name and "
                                         f"{argument_keys[0]}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return ParsedCall(raw=raw, error='tool call needs a "name" string')
    if name not in tool_names:
        available = ", ".join(tool_names) or "none"
        return ParsedCall(raw=raw, name=name, error=f"unknown tool {name!r}; tools: {available}")
    key = next((k for k in argument_keys if k in value), argument_keys[0])
    arguments = value.get(key, {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            return ParsedCall(raw=raw, name=name, error=f"{key} string is not valid JSON "
                                                        f"({err.msg})")
    if not isinstance(arguments, dict):
        return ParsedCall(raw=raw, name=name, error=f'"{key}" must be a JSON object')
    if "\\u" in raw and (bad := _lone_surrogate(arguments)) is not None:
        return ParsedCall(raw=raw, name=name, error=(
            f"{key} hold \\u{ord(bad):04x}, half of a UTF-16 surrogate pair, which no text "
            "can hold; write the character itself, or both halves of its pair"))
    return ParsedCall(raw=raw, name=name, arguments=arguments)


_SURROGATE = re.compile("[" + SURROGATES + "]")


def _lone_surrogate(value: Any) -> str | None:
    """The first lone surrogate in the strings (keys too) of a decoded JSON value, else None.
    Only a JSON escape makes one (decoded text never holds one), hence the caller's check for
    a \\u in the raw text first."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        return None if found is None else found.group(0)
    if isinstance(value, dict):
        parts = [part for item in value.items() for part in item]
    elif isinstance(value, list):
        parts = value
    else:
        return None
    for part in parts:
        bad = _lone_surrogate(part)
        if bad is not None:
            return bad
    return None


def extract_answer(text: str) -> str | None:
    """The content of the last `<answer>…</answer>` in `text`, stripped; None if there is none."""
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None
