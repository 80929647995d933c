"""Chat messages: the role/content pairs a chat format renders to token ids.

A tool message carries the raw observation text; the chat format decides how it is wrapped
(`<tool_response>…</tool_response>` for Hermes/Qwen style), so the same transcript renders
correctly for every format. An assistant message may carry structured `tool_calls` (set by a
chat format whose template renders calls from structure, such as Mistral's); its `content`
then keeps the sampled text, and the template writes the calls from the structure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ToolCallRequest:
    """One tool call of an assistant message, as a chat template's `tool_calls` entry."""

    name: str
    arguments_json: str  # a JSON object, key order as the model wrote it
    call_id: str

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.call_id, "type": "function",
                "function": {"name": self.name, "arguments": json.loads(self.arguments_json)}}


@dataclass(frozen=True)
class ChatMessage:
    role: Role
    content: str
    name: str | None = None  # the tool's name, on tool messages
    tool_calls: tuple[ToolCallRequest, ...] = ()  # structured calls (content: the sampled text)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"message role {self.role!r} is not one of {ROLES}")
        if not isinstance(self.content, str):
            raise TypeError(f"message content must be str, got {type(self.content).__name__}")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [call.to_dict() for call in self.tool_calls]
        return out


def system(content: str) -> ChatMessage:
    return ChatMessage("system", content)


def user(content: str) -> ChatMessage:
    return ChatMessage("user", content)


def assistant(content: str) -> ChatMessage:
    return ChatMessage("assistant", content)
