"""A conversation as token ids: the single place where training samples are assembled.

`Conversation` keeps the messages and, per training sample ("segment"), the token ids and the
loss mask. Guarantees:

- sampled ids are appended exactly as given (loss mask 1) and never re-encoded; every other
  token (prompt, tool results, turn scaffolding) has loss mask 0;
- within a segment every model call's prompt is the previous call's prompt plus its sampled ids
  plus the format's continuation: an exact prefix extension, asserted on every append;
- when the format cannot extend exactly, a new segment starts from a full render of the
  conversation, and the old segment is kept unchanged; `segment_breaks[i]` says why segment i
  started (None for the first).

The agent loop and the demonstration renderer both use this class, so SFT samples and RL
samples have the same layout by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tasks.chat.base import ChatFormat, ParsedTurn, SegmentBreak
from tasks.chat.codec import int_list
from tasks.messages import ChatMessage
from tasks.tools import Tool


@dataclass
class SegmentTokens:
    """One training sample's tokens: ids, loss mask, and where each model call's ids are."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    sampled_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) per call

    def append(self, ids: Sequence[int], sampled: bool) -> None:
        start = len(self.token_ids)
        self.token_ids.extend(int_list(ids))
        self.loss_mask.extend([1 if sampled else 0] * (len(self.token_ids) - start))
        if sampled:
            self.sampled_spans.append((start, len(self.token_ids)))


@dataclass(frozen=True)
class PromptDelta:
    """The prompt of one model call: `token_ids` are new since the previous call of the segment;
    `context_len` tokens of the segment came before them."""

    segment: int
    context_len: int
    token_ids: tuple[int, ...]


class Conversation:
    def __init__(self, chat_format: ChatFormat, messages: Sequence[ChatMessage],
                 tools: Sequence[Tool]) -> None:
        self.format = chat_format
        self.tools = tuple(tools)
        self.messages: list[ChatMessage] = list(messages)
        self.segments: list[SegmentTokens] = []
        self.segment_breaks: list[SegmentBreak | None] = []
        self._sent = 0
        self._start_segment(None)

    @property
    def segment_index(self) -> int:
        return len(self.segments) - 1

    @property
    def token_ids(self) -> list[int]:
        """The current segment's ids: what the next model call sees as its whole context."""
        return self.segments[-1].token_ids

    def take_prompt(self) -> PromptDelta:
        """The tokens the next model call adds to the segment (and mark them as sent)."""
        current = self.segments[-1]
        delta = PromptDelta(self.segment_index, self._sent, tuple(current.token_ids[self._sent:]))
        self._sent = len(current.token_ids)
        return delta

    def add_sampled(self, sampled_ids: Sequence[int]) -> ParsedTurn:
        """Append a model call's sampled ids (mask 1) and its assistant message."""
        current = self.segments[-1]
        if self._sent != len(current.token_ids):
            raise RuntimeError("add_sampled before take_prompt: the prompt was never sent")
        before = len(current.token_ids)
        sampled_ids = int_list(sampled_ids)
        current.append(sampled_ids, sampled=True)
        assert current.token_ids[before:] == sampled_ids, "prefix property violated"
        self._sent = len(current.token_ids)
        parsed = self.format.parse(sampled_ids, self.tools)
        self.messages.append(self.format.assistant_message(parsed))
        return parsed

    def add_messages(self, new_messages: Sequence[ChatMessage]) -> bool:
        """Append messages after a sampled turn. True: the segment was extended exactly;
        False: the format could not, and a new segment started from a full render."""
        current = self.segments[-1]
        extension = self.format.continuation(current.token_ids, self.messages, new_messages,
                                             self.tools)
        self.messages.extend(new_messages)
        if extension is None or isinstance(extension, SegmentBreak):
            self._start_segment(extension or SegmentBreak("unnamed", "the format gave no reason"))
            return False
        before = len(current.token_ids)
        current.append(extension, sampled=False)
        assert len(current.token_ids) == before + len(extension), "prefix property violated"
        return True

    def _start_segment(self, reason: SegmentBreak | None) -> None:
        segment = SegmentTokens()
        segment.append(self.format.render(self.messages, self.tools), sampled=False)
        self.segments.append(segment)
        self.segment_breaks.append(reason)
        self._sent = 0
