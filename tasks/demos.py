"""Demonstrations: scripted trajectories in the chat format, for supervised warm starts.

A `Demonstration` is the assistant turn texts of one task instance with the tool observations
each turn is expected to get back. `render_demonstration` turns it into training samples with the
same `Conversation` code the agent loop uses, so the SFT layout equals the RL layout: loss mask 1
exactly on the assistant turns (including their stop token), 0 elsewhere. A demonstration whose
turns call a different number of tools than it has observations is rejected.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tasks.api import TaskInstance
from tasks.chat.base import ChatFormat
from tasks.chat.conversation import Conversation, SegmentTokens
from tasks.messages import ChatMessage


@dataclass(frozen=True)
class DemoTurn:
    assistant: str
    observations: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False)
class Demonstration:
    task: TaskInstance
    turns: tuple[DemoTurn, ...]
    correct: bool = True

    @property
    def assistant_texts(self) -> list[str]:
        return [turn.assistant for turn in self.turns]


@dataclass(frozen=True)
class SFTSample:
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    task_key: str
    correct: bool


def render_demonstration(demo: Demonstration, chat_format: ChatFormat) -> list[SegmentTokens]:
    conversation = Conversation(chat_format, demo.task.prompt, demo.task.tools)
    for number, turn in enumerate(demo.turns):
        conversation.take_prompt()
        parsed = conversation.add_sampled(chat_format.encode_assistant(turn.assistant))
        calls = [call.name or "" for call in parsed.calls]
        if len(calls) != len(turn.observations):
            raise ValueError(
                f"demonstration of {demo.task.key}, turn {number}: {len(calls)} tool calls but "
                f"{len(turn.observations)} observations")
        if turn.observations:
            messages = [ChatMessage("tool", obs, name=name)
                        for name, obs in zip(calls, turn.observations)]
            conversation.add_messages(messages)
    return conversation.segments


def demonstration_samples(demos: Iterable[Demonstration],
                          chat_format: ChatFormat) -> list[SFTSample]:
    samples: list[SFTSample] = []
    for demo in demos:
        for segment in render_demonstration(demo, chat_format):
            samples.append(SFTSample(tuple(segment.token_ids), tuple(segment.loss_mask),
                                     demo.task.key, demo.correct))
    return samples

