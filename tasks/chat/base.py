"""The chat-format boundary: messages to token ids, sampled ids to tool calls.

A `ChatFormat` renders a conversation to token ids and, after the model sampled a turn, says
which ids to append so that the sequence equals what the format renders for the longer
conversation (`continuation`). It never re-encodes sampled ids: they stay as sampled, and the
continuation starts right after them. When a format cannot extend the previous sequence exactly
(a template that rewrites history), `continuation` returns None and the caller starts a new
training sample from a full render instead of faking a prefix. Formats say why with a
`SegmentBreak` (the loop records the reason on the new segment's first model call); a bare None
is read as a break with an unnamed reason.

Tool calls are parsed from the decoded text of the sampled ids; decoding is one-way, nothing is
tokenized again.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from tasks.messages import ChatMessage
from tasks.tools import Tool

ToolListing = Literal["none", "names", "json"]


class Tokenizer(Protocol):
    """What the chat formats need from a Hugging Face tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Any, skip_special_tokens: bool = ...) -> str: ...

    def convert_tokens_to_ids(self, tokens: Any) -> Any: ...


@dataclass(frozen=True)
class ParsedCall:
    """One tool call found in an assistant turn: well-formed (`error is None`) or not."""

    raw: str
    name: str | None = None
    arguments: dict[str, Any] | None = None
    error: str | None = None
    call_id: str | None = None  # the id the model wrote with the call (Mistral), if any

    @property
    def ok(self) -> bool:
        return self.error is None

    def arguments_json(self) -> str:
        return json.dumps(self.arguments if self.arguments is not None else None,
                          separators=(",", ":"), sort_keys=True)


@dataclass(frozen=True)
class ParsedTurn:
    """What a sampled assistant turn says: its text (without the stop token) and its calls."""

    text: str
    calls: tuple[ParsedCall, ...]
    ended: bool  # the turn ended with a stop token (not cut by a length limit)

    @property
    def malformed(self) -> tuple[ParsedCall, ...]:
        return tuple(call for call in self.calls if not call.ok)


@dataclass(frozen=True)
class SegmentBreak:
    """Why a format cannot extend the previous token sequence exactly (a new segment starts).

    `kind` is one of `turn_not_ended` (the sampled turn has no stop token), `turn_rewritten`
    (the template renders the sampled turn differently from the sampled text),
    `history_rewritten` (it renders earlier messages differently once more follow: dropped
    reasoning, a system prompt that moves); `detail` shows where, in a few characters."""

    kind: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}" if self.detail else self.kind


def first_difference(expected: str, actual: str, context: int = 24) -> str:
    """Where two texts first differ, as `at char N: expected '…' got '…'` ('' when equal)."""
    if expected == actual:
        return ""
    at = next((i for i, (a, b) in enumerate(zip(expected, actual)) if a != b),
              min(len(expected), len(actual)))
    start = max(0, at - context // 2)
    return (f"at char {at}: template {expected[start:at + context]!r}, "
            f"tokens {actual[start:at + context]!r}")


class ChatFormat(Protocol):
    """Renders conversations to token ids and parses sampled turns. See the module docstring."""

    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[Tool], *,
               add_generation_prompt: bool = True) -> list[int]: ...

    def continuation(self, history_ids: Sequence[int], messages: Sequence[ChatMessage],
                     new_messages: Sequence[ChatMessage],
                     tools: Sequence[Tool]) -> list[int] | SegmentBreak | None:
        """Ids to append after `history_ids` (which end with a sampled turn and its stop token)
        so that the sequence renders `messages + new_messages` with a generation prompt;
        `messages` already includes that assistant turn. A `SegmentBreak` (or None): no exact
        extension exists, and why."""
        ...

    def parse(self, sampled_ids: Sequence[int], tools: Sequence[Tool]) -> ParsedTurn: ...

    def assistant_message(self, parsed: ParsedTurn) -> ChatMessage:
        """The assistant message a sampled turn becomes in the conversation."""
        ...

    def encode_assistant(self, text: str) -> list[int]:
        """Ids of an assistant turn with this text, ending with the stop token (for
        demonstrations and scripted engines; never applied to sampled output)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


def tool_listing_text(tools: Sequence[Tool], listing: ToolListing) -> str:
    """The system-prompt text that tells the model which tools exist ('' when none)."""
    if not tools or listing == "none":
        return ""
    if listing == "names":
        parts = [f"{t.name}({','.join(t.parameters.get('properties', {}))})" for t in tools]
        return "Tools: " + " ".join(parts)
    lines = [json.dumps(t.openai_schema()["function"], separators=(",", ":")) for t in tools]
    return ("You may call tools. Write each call as <tool_call>{\"name\": NAME, \"arguments\": "
            "{...}}</tool_call>. Tools:\n<tools>\n" + "\n".join(lines) + "\n</tools>")


def with_tool_listing(messages: Sequence[ChatMessage], listing_text: str) -> list[ChatMessage]:
    """`messages` with the tool listing added to the first system message (or a new one)."""
    out = list(messages)
    if not listing_text:
        return out
    if out and out[0].role == "system":
        out[0] = ChatMessage("system", f"{out[0].content}\n\n{listing_text}")
    else:
        out.insert(0, ChatMessage("system", listing_text))
    return out


def single_token_id(tokenizer: Tokenizer, token: str) -> int | None:
    """The id of `token` if the tokenizer encodes it as exactly one id, else None."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1 or tokenizer.decode([int(ids[0])], skip_special_tokens=False) != token:
        return None  # split, or mapped to the unknown token
    return int(ids[0])
