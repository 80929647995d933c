"""Chat formats: render conversations to token ids, parse tool calls out of sampled ids."""

from __future__ import annotations

from typing import Any, Literal

from tasks.chat.base import ChatFormat, ParsedCall, ParsedTurn, ToolListing
from tasks.chat.hermes import HermesChatFormat
from tasks.chat.parsing import extract_answer, parse_tool_calls
from tasks.chat.template import TemplateChatFormat

__all__ = ["ChatFormat", "HermesChatFormat", "ParsedCall", "ParsedTurn", "TemplateChatFormat",
           "ToolListing", "extract_answer", "make_chat_format", "parse_tool_calls"]


def make_chat_format(tokenizer: Any, kind: Literal["auto", "hermes", "template"] = "auto",
                     **options: Any) -> ChatFormat:
    """`hermes`: the built-in Hermes/Qwen layout; `template`: the tokenizer's chat template;
    `auto`: the checkpoint's own template when it has one (most faithful), else hermes."""
    if kind == "hermes":
        return HermesChatFormat(tokenizer, **options)
    if kind == "template":
        return TemplateChatFormat(tokenizer, **options)
    if kind != "auto":
        raise ValueError(f"chat format kind {kind!r} is not one of auto, hermes, template")
    if getattr(tokenizer, "chat_template", None):
        return TemplateChatFormat(tokenizer, **options)
    return HermesChatFormat(tokenizer, **options)
