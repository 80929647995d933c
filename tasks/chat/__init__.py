"""Chat formats: render conversations to token ids, parse tool calls out of sampled ids."""

from __future__ import annotations

from typing import Any

from tasks.chat.base import ChatFormat, ParsedCall, ParsedTurn, SegmentBreak, ToolListing
from tasks.chat.families import FAMILY_NAMES, ChatFamily, detect_family, family
from tasks.chat.hermes import HermesChatFormat
from tasks.chat.parsing import extract_answer, parse_tool_calls
from tasks.chat.template import TemplateChatFormat

__all__ = ["FAMILY_NAMES", "FORMAT_KINDS", "ChatFamily", "ChatFormat", "HermesChatFormat",
           "ParsedCall", "ParsedTurn", "SegmentBreak", "TemplateChatFormat", "ToolListing",
           "detect_family", "extract_answer", "make_chat_format", "parse_tool_calls"]

FORMAT_KINDS = ("auto", "hermes", "template", *FAMILY_NAMES)


def make_chat_format(tokenizer: Any, kind: str = "auto", **options: Any) -> ChatFormat:
    """`hermes`: the project's own layout (the tiny demo model's); `template`: the tokenizer's
    chat template with Hermes-style calls; a family name (`qwen2.5`, `qwen3`, `llama3.1`,
    `mistral-v0.3`): the template with that family's native calls, roles and ids; `auto`: the
    family the template is recognised as, else the template, else hermes."""
    if kind == "hermes":
        return HermesChatFormat(tokenizer, **options)
    if kind == "template":
        return TemplateChatFormat(tokenizer, **options)
    if kind in FAMILY_NAMES:
        return TemplateChatFormat(tokenizer, family=family(kind), **options)
    if kind != "auto":
        raise ValueError(f"chat format kind {kind!r} is not one of {', '.join(FORMAT_KINDS)}")
    template = getattr(tokenizer, "chat_template", None)
    detected = detect_family(template if isinstance(template, str) else None)
    if detected is not None:
        return TemplateChatFormat(tokenizer, family=family(detected), **options)
    if template:
        return TemplateChatFormat(tokenizer, **options)
    return HermesChatFormat(tokenizer, **options)
