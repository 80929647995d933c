"""The project's own ChatML/Hermes-style layout, rendered without a template engine.

Layout of one message: `<|im_start|>{role}\n{content}<|im_end|>\n`; a tool message keeps the
`tool` role and its content is wrapped as `<tool_response>{observation}</tool_response>`; the
generation prompt is `<|im_start|>assistant\n`; the model ends its turn by sampling
`<|im_end|>`. This is the layout of the tiny demo tokenizer's chat template, and nothing else:
it is NOT Qwen2.5's layout (Qwen2.5's template renders a tool result as a `user` turn with
`<tool_response>\n…\n</tool_response>` on their own lines, groups consecutive results, and adds a
default system prompt). For a real checkpoint use its own template: the `qwen2.5`, `qwen3`,
`llama3.1` and `mistral-v0.3` formats (`tasks.chat.families`).

Guarantee: the format is append-only. After a sampled turn that ends with `<|im_end|>`, the
continuation is the `\n` that closes the turn, the new messages and the next generation prompt,
so the token sequence always extends exactly; `render` of the same conversation gives the same
text. A turn that did not end with `<|im_end|>` (cut by a length limit) has no continuation.

Cost: texts are encoded with `tasks.chat.codec.SplitEncoder`, cut before the layout's marker
tokens where that is checked to give the same ids, with the pieces remembered: the static system
prompt with its tool listing and the turn scaffolding are encoded once, and a turn encodes only
its observations. The ids are always those of encoding the whole rendered text.
"""

from __future__ import annotations

from collections.abc import Sequence

from tasks.chat.base import (
    ParsedTurn,
    SegmentBreak,
    Tokenizer,
    ToolListing,
    single_token_id,
    tool_listing_text,
    with_tool_listing,
)
from tasks.chat.codec import LRU, SplitEncoder, TokenCodec, int_list
from tasks.chat.parsing import parse_tool_calls
from tasks.messages import ChatMessage
from tasks.tools import Tool

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


class HermesChatFormat:
    """The project's ChatML/Hermes layout (the tiny demo model's) for any tokenizer with single-id
    `<|im_start|>`/`<|im_end|>`; not a real checkpoint's template (see the module docstring)."""

    name = "hermes"

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
        self.codec = TokenCodec(tokenizer)
        self.encoder = SplitEncoder(self.codec, (IM_START, IM_END, RESPONSE_OPEN, RESPONSE_CLOSE))
        self._listings: LRU[tuple[Tool, ...], str] = LRU(64)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.im_end_id,)

    @property
    def wraps_tool_results(self) -> bool:
        return True

    def message_text(self, message: ChatMessage) -> str:
        content = message.content
        if message.role == "tool":
            content = f"{RESPONSE_OPEN}{content}{RESPONSE_CLOSE}"
        return f"{IM_START}{message.role}\n{content}{IM_END}\n"

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[Tool], *,
               add_generation_prompt: bool = True) -> list[int]:
        listed = with_tool_listing(messages, self._listing(tools))
        text = "".join(self.message_text(message) for message in listed)
        if add_generation_prompt:
            text += f"{IM_START}assistant\n"
        return self._encode(text)

    def continuation(self, history_ids: Sequence[int], messages: Sequence[ChatMessage],
                     new_messages: Sequence[ChatMessage],
                     tools: Sequence[Tool]) -> list[int] | SegmentBreak:
        if not history_ids or int(history_ids[-1]) != self.im_end_id:
            return SegmentBreak("turn_not_ended", f"the sampled turn does not end with {IM_END}")
        text = "\n" + "".join(self.message_text(m) for m in new_messages)
        return self._encode(text + f"{IM_START}assistant\n")

    def parse(self, sampled_ids: Sequence[int], tools: Sequence[Tool]) -> ParsedTurn:
        ids = int_list(sampled_ids)
        ended = bool(ids) and ids[-1] == self.im_end_id
        text = self.decode(ids[:-1] if ended else ids)
        return ParsedTurn(text=text, calls=parse_tool_calls(text, [t.name for t in tools]),
                          ended=ended)

    def assistant_message(self, parsed: ParsedTurn) -> ChatMessage:
        return ChatMessage("assistant", parsed.text)

    def encode_assistant(self, text: str) -> list[int]:
        return self._encode(text) + [self.im_end_id]

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.codec.decode(token_ids)

    def _encode(self, text: str) -> list[int]:
        return self.encoder.encode(text)

    def _listing(self, tools: Sequence[Tool]) -> str:
        key = tuple(tools)
        text = self._listings.get(key)
        if text is None:
            text = self._listings.put(key, tool_listing_text(key, self.tool_listing))
        return text
