"""A tiny task family and fakes for pipeline tests: no engine process, no Docker, real store."""

from __future__ import annotations

import random
import zlib
from contextlib import asynccontextmanager

from core.tiny_tokenizer import build_tiny_tokenizer
from orchestrator.engines.scripted import LatencyModel, ScriptedEngine, ScriptedTurn
from tasks import Component, Rubric, TaskFamily, TaskInstance, TaskLimits, ToolContext, tool
from tasks.api import SplitShares, draw_in_split
from tasks.chat import make_chat_format
from tasks.testing import FakeSandbox
from tasks.tools import ToolResult


@tool(read_only=True, idempotent=True)
async def flip(ctx: ToolContext, n: int) -> str:
    """Flip a coin.

    Args:
        n: the flip's number.
    """
    return "flipped"


@tool(name="flip", read_only=True, idempotent=True)
async def rewarded_flip(ctx: ToolContext, n: int) -> ToolResult:
    """Flip a coin, for a per-turn reward (`ctx.task.data["flip_reward"]`).

    Args:
        n: the flip's number.
    """
    return ToolResult(text="flipped", reward=ctx.task.data["flip_reward"])


def heads(ctx) -> float:
    return 1.0 if ctx.answer == "heads" else 0.0


def coin_family(size: int | None = None) -> TaskFamily:
    def make(index: int, split: str) -> TaskInstance:
        return TaskInstance(prompt=f"coin {index}", tools=(flip,),
                            verifier=Rubric(Component("heads", heads, 1.0)),
                            limits=TaskLimits(max_turns=4, max_generated_tokens=256),
                            difficulty=f"d{index % 2}")
    return TaskFamily("coin", make, size=size)


def rewarded_coin_family(flip_reward: float) -> TaskFamily:
    """The coin family whose flip grants `flip_reward` (a per-turn tool reward)."""
    def make(index: int, split: str) -> TaskInstance:
        return TaskInstance(prompt=f"coin {index}", tools=(rewarded_flip,),
                            verifier=Rubric(Component("heads", heads, 1.0)),
                            limits=TaskLimits(max_turns=4, max_generated_tokens=256),
                            data={"flip_reward": flip_reward}, difficulty=f"d{index % 2}")
    return TaskFamily("coin", make)


CHAT = make_chat_format(build_tiny_tokenizer(), "hermes", tool_listing="none")
TOOL_TURN = ScriptedTurn(tuple(CHAT.encode_assistant(
    '<tool_call>{"name":"flip","arguments":{"n":1}}</tool_call>')))
HEADS = ScriptedTurn(tuple(CHAT.encode_assistant("<answer>heads</answer>")))
TAILS = ScriptedTurn(tuple(CHAT.encode_assistant("<answer>tails</answer>")))


def coin_script(key: str, index: int) -> ScriptedTurn:
    """One tool call, then heads or tails decided by the trajectory id (reward 1 or 0)."""
    if index == 0:
        return TOOL_TURN
    return HEADS if zlib.crc32(key.encode()) % 2 else TAILS


def coin_engine(latency: LatencyModel | None = None) -> ScriptedEngine:
    return ScriptedEngine(coin_script, latency=latency, keep_requests=False)


@asynccontextmanager
async def fake_sandbox(spec, trajectory_id):
    yield FakeSandbox()


def held_out_coin_family() -> TaskFamily:
    """The coin family with three disjoint splits (its identity: the coin's number)."""
    shares = SplitShares(validation=0.2, test=0.3)

    def make(index: int, split: str) -> TaskInstance:
        number = draw_in_split("held-coin", split, shares, random.Random(f"{split}:{index}"),
                               lambda rng: rng.randrange(10**6), key=str)
        return TaskInstance(prompt=f"coin {number}", tools=(flip,),
                            verifier=Rubric(Component("heads", heads, 1.0)),
                            limits=TaskLimits(max_turns=4, max_generated_tokens=256),
                            data={"number": number}, difficulty=f"d{number % 2}")
    return TaskFamily("held-coin", make, split_key=lambda task: str(task.data["number"]),
                      shares=shares)
