"""The Hermes/Qwen chat format, rendered by the project itself (no template engine).

Layout of one message: `<|im_start|>{role}\n{content}<|im_end|>\n`; a tool message's content is
wrapped as `<tool_response>{observation}</tool_response>`; the generation prompt is
`<|im_start|>assistant\n`; the model ends its turn by sampling `<|im_end|>`. This is the layout
of the tiny tokenizer's chat template and of Qwen2.5-style checkpoints.

Guarantee: the format is append-only. After a sampled turn that ends with `<|im_end|>`, the
continuation is the `\n` that closes the turn, the new messages and the next generation prompt,
so the token sequence always extends exactly; `render` of the same conversation gives the same
text. A turn that did not end with `<|im_end|>` (cut by a length limit) has no continuation.
"""

from __future__ import annotations

from collections.abc import Sequence

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

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


class HermesChatFormat:
    """Hermes/Qwen-style chat format for any tokenizer with single-id `<|im_start|>`/`<|im_end|>`."""

    def __init__(self, tokenizer: Tokenizer, *, tool_listing: ToolListing = "json") -> None:
        self.tokenizer = tokenizer
        self.tool_listing: ToolListing = tool_listing
        start_id = single_token_id(tokenizer, IM_START)
        end_id = single_token_id(tokenizer, IM_END)
        if start_id is None or end_id is None:
            raise ValueError(
                f"HermesChatFormat needs {IM_START} and {IM_END} as single tokens of the "
                "tokenizer; for other checkpoints use TemplateChatFormat (the HF chat template)")
        self.im_end_id = end_id

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.im_end_id,)

    def message_text(self, message: ChatMessage) -> str:
        content = message.content
        if message.role == "tool":
            content = f"{RESPONSE_OPEN}{content}{RESPONSE_CLOSE}"
        return f"{IM_START}{message.role}\n{content}{IM_END}\n"

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[Tool], *,
               add_generation_prompt: bool = True) -> list[int]:
        listed = with_tool_listing(messages, tool_listing_text(tools, self.tool_listing))
        text = "".join(self.message_text(message) for message in listed)
        if add_generation_prompt:
            text += f"{IM_START}assistant\n"
        return self._encode(text)

    def continuation(self, history_ids: Sequence[int], messages: Sequence[ChatMessage],
                     new_messages: Sequence[ChatMessage],
                     tools: Sequence[Tool]) -> list[int] | None:
        if not history_ids or int(history_ids[-1]) != self.im_end_id:
            return None
        text = "\n" + "".join(self.message_text(m) for m in new_messages)
        return self._encode(text + f"{IM_START}assistant\n")

    def parse(self, sampled_ids: Sequence[int], tools: Sequence[Tool]) -> ParsedTurn:
        ids = [int(i) for i in sampled_ids]
        ended = bool(ids) and ids[-1] in self.stop_token_ids
        text = self.decode(ids[:-1] if ended else ids)
        return ParsedTurn(text=text, calls=parse_tool_calls(text, [t.name for t in tools]),
                          ended=ended)

    def encode_assistant(self, text: str) -> list[int]:
        return self._encode(text) + [self.im_end_id]

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in token_ids], skip_special_tokens=False)

    def _encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]
