"""Native tool-call syntaxes of model families, parsed from the decoded text of a sampled turn.

- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`,
  any number per turn (`tasks.chat.parsing.parse_tool_calls`).
- `llama3` (Llama 3.1/3.2 custom tools): the turn is one JSON object
  `{"name": …, "parameters": {…}}` (`arguments` accepted too), optionally after
  `<|python_tag|>`; several objects separated by `;` or newlines are parallel calls. A turn that
  does not start with `{` (after the tag) is a plain answer.
- `mistral` (Mistral v0.3 / Nemo, tokenizer v3): `[TOOL_CALLS]` then a JSON list of
  `{"name": …, "arguments": {…}, "id": "<9 alphanumerics>"}`. A call without a valid id is
  well-formed but gets one generated (`call_id_for`); the template will then not reproduce the
  sampled text, so the loop starts a new segment there.

Every parser returns `ParsedCall`s; malformed ones carry an `error` short enough for the model.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from collections.abc import Callable, Sequence

from tasks.chat.base import ParsedCall
from tasks.chat.parsing import named_call, parse_tool_calls

CallParser = Callable[[str, Sequence[str]], tuple[ParsedCall, ...]]
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS = "[TOOL_CALLS]"
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_ALPHANUMERIC = string.ascii_letters + string.digits


def parse_llama3_calls(text: str, tool_names: Sequence[str]) -> tuple[ParsedCall, ...]:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return ()
    calls: list[ParsedCall] = []
    decoder = json.JSONDecoder()
    at = 0
    while at < len(body):
        try:
            value, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError as err:
            calls.append(ParsedCall(raw=body[at:], error=f"tool call is not valid JSON "
                                                          f"({err.msg} at {err.pos - at})"))
            break
        calls.append(named_call(body[at:end], value, tool_names, ("parameters", "arguments")))
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return tuple(calls)


def parse_mistral_calls(text: str, tool_names: Sequence[str]) -> tuple[ParsedCall, ...]:
    body = text.strip()
    if not body.startswith(TOOL_CALLS):
        return ()
    raw = body[len(TOOL_CALLS):].strip()
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        return (ParsedCall(raw=raw, error=f"{TOOL_CALLS} must be followed by a JSON list "
                                          f"({err.msg} at {err.pos})"),)
    if not isinstance(value, list) or not value:
        return (ParsedCall(raw=raw, error=f"{TOOL_CALLS} must be followed by a non-empty JSON "
                                          "list of calls"),)
    calls = []
    for item in value:
        call = named_call(json.dumps(item, ensure_ascii=False), item, tool_names, ("arguments",))
        given = item.get("id") if isinstance(item, dict) else None
        if isinstance(given, str) and MISTRAL_ID.fullmatch(given):
            call = ParsedCall(call.raw, call.name, call.arguments, call.error, call_id=given)
        calls.append(call)
    return tuple(calls)


def call_id_for(position: int, index: int) -> str:
    """A 9-character alphanumeric call id (what Mistral's template accepts), fixed by the call's
    place in the conversation (message `position`, call `index`), so re-renders agree."""
    digest = int.from_bytes(hashlib.sha256(f"{position}:{index}".encode()).digest()[:8], "big")
    chars = []
    for _ in range(9):
        digest, rest = divmod(digest, len(_ALPHANUMERIC))
        chars.append(_ALPHANUMERIC[rest])
    return "".join(chars)


PARSERS: dict[str, CallParser] = {"hermes": parse_tool_calls, "llama3": parse_llama3_calls,
                                  "mistral": parse_mistral_calls}
