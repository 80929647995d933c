"""A chat format driven by a checkpoint's own Hugging Face chat template (`apply_chat_template`).

Rendering: the template renders the messages to text, the tokenizer encodes that text, exactly
as `apply_chat_template(..., tokenize=True)` does. Tool schemas are passed with `tools=` when the
template renders them, else listed in the system prompt; tool results are wrapped in
`<tool_response>` unless the template already does it (both detected with a probe render).

Extension guarantee: after a sampled turn, the template renders the whole longer conversation;
the continuation is the part after the sampled turn's stop token, and it is used only if the
text of the history (prompt, sampled ids and earlier continuations, decoded) is exactly the
template's own text up to that point. Templates that rewrite earlier turns (for example ones that
drop past reasoning) fail that check and `continuation` returns None: the agent loop then starts
a new training sample from the full render rather than pretend the old ids are a prefix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tasks.chat.base import (
    ParsedTurn,
    Tokenizer,
    ToolListing,
    single_token_id,
    tool_listing_text,
    with_tool_listing,
)
from tasks.chat.parsing import parse_tool_calls
from tasks.messages import ChatMessage
from tasks.tools import Tool

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_PROBE = "zq_probe_tool"


class TemplateChatFormat:
    """Chat format of any HF tokenizer with a chat template; tool calls in Hermes style."""

    def __init__(self, tokenizer: Any, *, tool_listing: ToolListing = "json",
                 stop_tokens: Sequence[str] | None = None, tool_role: str = "tool",
                 template_kwargs: Mapping[str, Any] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template; set one or use HermesChatFormat")
        self.tokenizer: Tokenizer = tokenizer
        self.tool_listing: ToolListing = tool_listing
        self.tool_role = tool_role
        self.template_kwargs = dict(template_kwargs or {})
        names = list(stop_tokens) if stop_tokens else [tokenizer.eos_token]
        ids = [single_token_id(tokenizer, name) for name in names if name]
        if not ids or any(i is None for i in ids):
            raise ValueError(f"stop tokens {names!r} must each be a single token of the tokenizer")
        self._stop = tuple(int(i) for i in ids if i is not None)
        self.native_tools = self._probe_native_tools()
        self.wraps_responses = self._probe_wraps_responses()

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stop

    def render_text(self, messages: Sequence[ChatMessage], tools: Sequence[Tool], *,
                    add_generation_prompt: bool = True) -> str:
        extra: dict[str, Any] = {}
        if self.native_tools and tools:
            extra["tools"] = [t.openai_schema() for t in tools]
            listed = list(messages)
        else:
            listed = with_tool_listing(messages, tool_listing_text(tools, self.tool_listing))
        dicts = [self._message_dict(m) for m in listed]
        return self.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            dicts, tokenize=False, add_generation_prompt=add_generation_prompt,
            **extra, **self.template_kwargs)

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[Tool], *,
               add_generation_prompt: bool = True) -> list[int]:
        text = self.render_text(messages, tools, add_generation_prompt=add_generation_prompt)
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def continuation(self, history_ids: Sequence[int], messages: Sequence[ChatMessage],
                     new_messages: Sequence[ChatMessage],
                     tools: Sequence[Tool]) -> list[int] | None:
        history = [int(i) for i in history_ids]
        if not history or history[-1] not in self._stop:
            return None
        full = self.render([*messages, *new_messages], tools, add_generation_prompt=True)
        cut = _after_nth_stop(full, self._stop, sum(1 for i in history if i in self._stop))
        if cut is None or self.decode(full[:cut]) != self.decode(history):
            return None
        return full[cut:]

    def parse(self, sampled_ids: Sequence[int], tools: Sequence[Tool]) -> ParsedTurn:
        ids = [int(i) for i in sampled_ids]
        ended = bool(ids) and ids[-1] in self._stop
        text = self.decode(ids[:-1] if ended else ids)
        return ParsedTurn(text=text, calls=parse_tool_calls(text, [t.name for t in tools]),
                          ended=ended)

    def encode_assistant(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return [int(i) for i in ids] + [self._stop[0]]

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in token_ids], skip_special_tokens=False)

    def _message_dict(self, message: ChatMessage) -> dict[str, Any]:
        if message.role != "tool":
            return message.to_dict()
        content = message.content
        if not self.wraps_responses:
            content = f"{RESPONSE_OPEN}{content}{RESPONSE_CLOSE}"
        out: dict[str, Any] = {"role": self.tool_role, "content": content}
        if message.name is not None and self.tool_role == "tool":
            out["name"] = message.name
        return out

    def _probe_native_tools(self) -> bool:
        schema = {"type": "function", "function": {
            "name": _PROBE, "description": "probe",
            "parameters": {"type": "object", "properties": {}}}}
        try:
            text = self.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
                [{"role": "user", "content": "x"}], tools=[schema], tokenize=False,
                add_generation_prompt=True, **self.template_kwargs)
        except Exception:  # a template that rejects tools= cannot render them natively
            return False
        return _PROBE in text

    def _probe_wraps_responses(self) -> bool:
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                 {"role": self.tool_role, "content": _PROBE}]
        try:
            text = self.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
                probe, tokenize=False, add_generation_prompt=True, **self.template_kwargs)
        except Exception as err:
            raise ValueError(
                f"the chat template cannot render a {self.tool_role!r} message ({err}); "
                "pass tool_role='user' or use HermesChatFormat") from err
        return RESPONSE_OPEN in text


def _after_nth_stop(ids: Sequence[int], stops: tuple[int, ...], n: int) -> int | None:
    seen = 0
    for position, token in enumerate(ids):
        if token in stops:
            seen += 1
            if seen == n:
                return position + 1
    return None
