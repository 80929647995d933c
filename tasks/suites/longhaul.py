"""`longhaul`: a synthetic long-horizon suite for throughput studies.

Each instance hides a chain of k+1 four-character keys (k varies per instance, log-uniformly in
[min_k, max_k]). The `step` tool maps a key to the next one and says how many steps are left, so
the answer (the last key) needs exactly k sequential tool calls:

    user:      Follow the chain from 3fa0 with step; answer the last key.
    assistant: <tool_call>{"name":"step","arguments":{"key":"3fa0"}}</tool_call>
    tool:      91c2 (1 left)
    assistant: <tool_call>{"name":"step","arguments":{"key":"91c2"}}</tool_call>
    tool:      07be (0 left)
    assistant: <answer>07be</answer>

Every step call takes a heavy-tailed time: lognormal with the given median and sigma, capped at
`latency_max_s`, drawn deterministically per (instance, step), so trajectory durations span
orders of magnitude. The wait happens in the tool (`latency_in="tool"`, an `anyio.sleep`) or
inside the sandbox (`latency_in="sandbox"`, a `sleep` command). Difficulty buckets group k
(`k=1-2`, `k=3-7`, ... from `bucket_edges`). Reward 1 for the last key, else 0.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
import struct
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import anyio

from tasks.api import SplitShares, TaskFamily, TaskInstance, draw_in_split
from tasks.demos import Demonstration, DemoTurn
from tasks.suites.common import answer_text, call_text, instance_rng, sandbox_spec, task_limits
from tasks.tools import Tool, ToolContext, ToolError, tool
from tasks.verify import Component, Rubric, VerifyContext

NAME = "longhaul"
SANDBOX_DEFAULTS: dict[str, Any] = dict(memory_mb=128, exec_timeout_s=300.0, pids=32)


def chain(salt: str, start: str, k: int) -> list[str]:
    keys = [start]
    while len(keys) < k + 1:
        candidate = hashlib.sha256(f"{salt}:{keys[-1]}".encode()).hexdigest()[:4]
        salt_round = 0
        while candidate in keys:  # keep keys unique so a key names its position
            salt_round += 1
            candidate = hashlib.sha256(f"{salt}:{keys[-1]}:{salt_round}".encode()).hexdigest()[:4]
        keys.append(candidate)
    return keys


def step_latency(task_key: str, position: int, median_s: float, sigma: float,
                 max_s: float) -> float:
    """The delay of step `position` of a task: lognormal(log median_s, sigma), capped at max_s,
    a pure function of the task key and the position."""
    z = stable_normal(f"{task_key}:{position}")
    return min(max_s, median_s * math.exp(sigma * z))


def stable_normal(label: str) -> float:
    """A standard normal draw that depends only on `label` (Box-Muller on two uniforms from one
    hash; far cheaper than seeding a generator per step)."""
    first, second = struct.unpack("<2Q", hashlib.blake2b(label.encode(), digest_size=16).digest())
    u1 = ((first >> 11) + 1) * 2.0 ** -53  # (0, 1]
    u2 = (second >> 11) * 2.0 ** -53
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def buckets(edges: Sequence[int], max_k: int) -> list[tuple[int, int]]:
    bounds = sorted(set(edges)) + [max_k + 1]
    return [(lo, hi - 1) for lo, hi in itertools.pairwise(bounds) if lo <= hi - 1]


def bucket_of(k: int, ranges: Sequence[tuple[int, int]]) -> str:
    for lo, hi in ranges:
        if lo <= k <= hi:
            return f"k={lo}-{hi}" if lo != hi else f"k={lo}"
    return f"k={k}"


def make_step_tool(median_s: float, sigma: float, max_s: float,
                   latency_in: Literal["tool", "sandbox"]) -> Tool:
    @tool(name="step", idempotent=True, read_only=True)
    async def step(ctx: ToolContext, key: str) -> str:
        """Return the key that follows `key` in the chain and how many steps are left.

        Args:
            key: the current key (four hex characters).
        """
        keys = list(ctx.task.data["chain"])
        if key not in keys[:-1]:
            hint = " (that is the last key)" if key == keys[-1] else ""
            raise ToolError(f"unknown key {key!r}{hint}")
        position = keys.index(key)
        delay = step_latency(ctx.task.key, position, median_s, sigma, max_s)
        if latency_in == "sandbox":
            result = await ctx.sandbox.exec(["sleep", f"{delay:.3f}"], timeout=max_s + 30)
            if not result.ok:
                raise ToolError(f"step failed: {result.stderr.strip() or result.error_type}")
        else:
            await anyio.sleep(delay)
        left = len(keys) - 2 - position
        return f"{keys[position + 1]} ({left} left)"
    return step


def last_key(ctx: VerifyContext) -> float:
    return 1.0 if ctx.answer == ctx.task.data["chain"][-1] else 0.0


def steps_done(ctx: VerifyContext) -> float:
    return min(1.0, ctx.tool_calls / max(1, int(ctx.task.data["k"])))


VERIFIER = Rubric(Component("last_key", last_key, 1.0), Component("steps", steps_done, 0.0))


def family(*, min_k: int = 1, max_k: int = 30, latency_median_s: float = 0.5,
           latency_sigma: float = 1.0, latency_max_s: float = 60.0,
           latency_in: Literal["tool", "sandbox"] = "tool",
           bucket_edges: Sequence[int] = (1, 3, 8, 16), seed: int = 0,
           validation_share: float = 0.1, test_share: float = 0.2,
           image: str = "stalewise-base:latest", limits: Mapping[str, Any] | None = None,
           sandbox_limits: Mapping[str, Any] | None = None) -> TaskFamily:
    """The longhaul family; see the module docstring for the options."""
    if not 1 <= min_k <= max_k:
        raise ValueError(f"longhaul needs 1 <= min_k <= max_k, got {min_k}, {max_k}")
    if latency_median_s < 0 or latency_sigma < 0 or latency_max_s <= 0:
        raise ValueError("longhaul latencies must be >= 0 (median, sigma) and > 0 (max)")
    if latency_in not in ("tool", "sandbox"):
        raise ValueError(f"latency_in must be 'tool' or 'sandbox', got {latency_in!r}")
    defaults = dict(max_turns=max_k + 3, max_generated_tokens=64 * (max_k + 3),
                    context_length=max(1024, 128 * (max_k + 3)),
                    wall_time_s=600.0 + (max_k + 3) * latency_max_s,
                    tool_timeout_s=latency_max_s + 60.0, max_observation_chars=256)
    shares = SplitShares(validation_share, test_share)
    task_limits_ = task_limits(defaults, limits)
    spec = sandbox_spec(image, SANDBOX_DEFAULTS, sandbox_limits)
    step = make_step_tool(latency_median_s, latency_sigma, latency_max_s, latency_in)
    ranges = buckets(bucket_edges, max_k)
    latency = {"median_s": latency_median_s, "sigma": latency_sigma, "max_s": latency_max_s,
               "in": latency_in}

    def make(index: int, split: str) -> TaskInstance:
        rng = instance_rng(NAME, seed, split, index)
        k, keys = draw_in_split(NAME, split, shares, rng, draw, key=lambda c: c[1][0])
        return TaskInstance(
            prompt=f"Follow the chain from {keys[0]} with step; answer the last key.",
            tools=(step,), verifier=VERIFIER, sandbox=spec, limits=task_limits_,
            data={"k": k, "chain": keys, "latency": latency}, difficulty=bucket_of(k, ranges))

    def draw(rng: random.Random) -> tuple[int, list[str]]:
        k = min(max_k, int(math.exp(rng.uniform(math.log(min_k), math.log(max_k + 1)))))
        salt = f"{rng.getrandbits(32):08x}"
        return k, chain(salt, f"{rng.getrandbits(16):04x}", k)

    def demonstrate(task: TaskInstance, correct: bool) -> Demonstration:
        keys = list(task.data["chain"])
        turns = [DemoTurn(call_text("step", {"key": key}),
                          (f"{keys[i + 1]} ({len(keys) - 2 - i} left)",))
                 for i, key in enumerate(keys[:-1])]
        answer = keys[-1] if correct else keys[-2]
        turns.append(DemoTurn(answer_text(answer)))
        return Demonstration(task, tuple(turns), correct=correct)

    return TaskFamily(NAME, make, demonstrate=demonstrate,
                      description="k sequential tool calls with heavy-tailed latency",
                      options=dict(min_k=min_k, max_k=max_k, latency_median_s=latency_median_s,
                                   latency_sigma=latency_sigma, latency_max_s=latency_max_s,
                                   latency_in=latency_in, bucket_edges=list(bucket_edges),
                                   seed=seed, validation_share=validation_share, test_share=test_share, image=image),
                      split_key=lambda task: task.data["chain"][0], shares=shares)
