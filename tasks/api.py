"""Tasks: instances with a prompt, a sandbox, tools, limits and a verifier; families that yield them.

Guarantees:
- a `TaskInstance` is frozen; its `content_hash` is the SHA-256 of a canonical JSON of everything
  that defines it (prompt, tool schemas, sandbox spec, limits, hidden files, data, verifier,
  difficulty), so a changed task under an old key is detected;
- a `TaskFamily` makes instance `index` of a split deterministically and names it with the
  stable key `family/split/index`; `by_key` rebuilds the same instance from its key;
- three splits, disjoint by construction: `train` (RL and demonstrations), `validation`
  (checkpoint selection and every tuning decision) and `test` (only the figures a job
  reports). A family with a `split_key` (what makes two instances the same task, e.g. arith's
  expression) puts every split key in exactly one split by a fixed hash (`SplitShares.of`),
  and `instance` refuses an instance whose key belongs to another split; families draw
  candidates until one fits with `draw_in_split`. Demonstrations come from `train` only. A
  family without a split key (a folder of Harbor tasks, a user's family) is not held out:
  `held_out` says so, and the job's summary with it;
- `hidden_files` reach the sandbox only at verification (the agent loop writes them then);
  `data` holds facts for tools and verifiers (an expected answer) and is never shown to the model.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from core.sandbox import SandboxSpec
from tasks.messages import ChatMessage
from tasks.tools import Tool
from tasks.verify import Verifier, describe_verifier

if TYPE_CHECKING:
    from tasks.demos import Demonstration


class TaskLimits(BaseModel):
    """Per-trajectory limits; the agent loop enforces each one with a precise stop reason."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_turns: int = Field(8, ge=1, description="model calls at most")
    max_generated_tokens: int = Field(2048, ge=1, description="sampled tokens over all turns")
    context_length: int = Field(4096, ge=16, description="tokens of one training sample at most")
    wall_time_s: float = Field(1800.0, gt=0, description="seconds from sandbox ready to the end")
    working_time_s: float | None = Field(
        None, gt=0, description="seconds in engine calls and tools (no queueing); None = off")
    max_malformed_calls: int = Field(
        2, ge=0, description="malformed tool calls allowed; one more fails the trajectory")
    max_tool_calls_per_turn: int = Field(4, ge=1, description="extra calls count as malformed")
    max_observation_chars: int = Field(
        8192, ge=64, description="tool output shown to the model (head and tail kept)")
    tool_timeout_s: float = Field(120.0, gt=0, description="per tool call, unless the tool sets one")
    verify_timeout_s: float = Field(300.0, gt=0, description="the verifier's time limit")
    verify_truncated: bool = Field(
        False, description="also verify trajectories stopped by a limit (else reward is None)")


@dataclass(frozen=True, eq=False)
class TaskInstance:
    prompt: tuple[ChatMessage, ...]
    tools: tuple[Tool, ...]
    verifier: Verifier
    sandbox: SandboxSpec = field(default_factory=SandboxSpec)
    limits: TaskLimits = field(default_factory=TaskLimits)
    hidden_files: Mapping[str, str] = field(default_factory=dict)
    data: Mapping[str, Any] = field(default_factory=dict)
    difficulty: str = "all"
    family: str = ""
    key: str = ""

    def __post_init__(self) -> None:
        prompt = self.prompt
        if isinstance(prompt, str):
            prompt = (ChatMessage("user", prompt),)
        prompt = tuple(prompt) if isinstance(prompt, Iterable) else None
        if prompt is None or not all(isinstance(m, ChatMessage) for m in prompt):
            raise TypeError(f"TaskInstance.prompt must be a string or a sequence of "
                            f"ChatMessage, got {_shown(self.prompt)}")
        object.__setattr__(self, "prompt", prompt)
        if isinstance(self.tools, (str, Mapping)) or not isinstance(self.tools, Iterable):
            raise TypeError(f"TaskInstance.tools must be a sequence of @tool functions, got "
                            f"{_shown(self.tools)}")
        object.__setattr__(self, "tools", tuple(self.tools))
        for name, kind, hint in (("sandbox", SandboxSpec, "SandboxSpec(image=...)"),
                                 ("limits", TaskLimits, "TaskLimits(max_turns=...)")):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"TaskInstance.{name} must be a {kind.__name__}, got "
                                f"{_shown(getattr(self, name))}; build it with {hint}")
        if not callable(self.verifier):
            raise TypeError(f"TaskInstance.verifier must be callable (a Rubric or an async "
                            f"function of VerifyContext), got {_shown(self.verifier)}")
        if not self.prompt:
            raise ValueError("a task needs a prompt (a string or chat messages)")
        bad = [t for t in self.tools if not isinstance(t, Tool)]
        if bad:
            raise TypeError(f"task tools must be built with @tool, got {bad!r}")
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError(f"task tools must have unique names, got {names}")
        try:  # the hash itself waits until it is read; bad data is refused here
            json.dumps({"data": dict(self.data), "hidden_files": dict(self.hidden_files)})
        except TypeError as err:
            raise TypeError(f"task data and hidden files must be JSON-serialisable: {err}") from err

    @functools.cached_property
    def content_hash(self) -> str:
        """SHA-256 of `canonical()`, computed once, when first read (a dispatch builds and
        replaces an instance more than once, and only the last one is stored)."""
        return self._hash()

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)

    def canonical(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "prompt": [m.to_dict() for m in self.prompt],
            "tools": [t.openai_schema() for t in self.tools],
            "sandbox": self.sandbox.model_dump(mode="json"),
            "limits": self.limits.model_dump(mode="json"),
            "hidden_files": dict(self.hidden_files),
            "data": dict(self.data),
            "verifier": describe_verifier(self.verifier),
            "difficulty": self.difficulty,
        }

    def _hash(self) -> str:
        try:
            text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        except TypeError as err:
            raise TypeError(f"task data and hidden files must be JSON-serialisable: {err}") from err
        return hashlib.sha256(text.encode()).hexdigest()


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80] + '...' if len(text) > 80 else text}"


MakeFn = Callable[[int, str], TaskInstance]
DemoFn = Callable[[TaskInstance, bool], "Demonstration"]
SplitKeyFn = Callable[[TaskInstance], str]
DiagnoseFn = Callable[[TaskInstance, Sequence[ChatMessage]], str]
T = TypeVar("T")
MAX_SPLIT_DRAWS = 10_000


SPLITS = ("train", "validation", "test")


@dataclass(frozen=True)
class SplitShares:
    """Which share of all task identities is validation-only and which test-only (the rest is
    train). The assignment is a fixed hash of (family, split key), so an identity lands in the
    same split on every machine and in every run, and changing one share never moves an
    identity between the other two."""

    validation: float = 0.1
    test: float = 0.2

    def __post_init__(self) -> None:
        if not (0.0 < self.validation < 1.0 and 0.0 < self.test < 1.0
                and self.validation + self.test < 1.0):
            raise ValueError(f"split shares need 0 < validation_share, 0 < test_share and "
                             f"validation_share + test_share < 1 (the rest is train), got "
                             f"{self.validation}, {self.test}")

    def of(self, family: str, split_key: str) -> str:
        """The split of a task identity: "train", "validation" or "test"."""
        digest = hashlib.sha256(f"{family}\0{split_key}".encode()).digest()
        u = int.from_bytes(digest[:8], "big") / 2**64
        return "test" if u < self.test else "validation" if u < self.test + self.validation \
            else "train"


def draw_in_split(family: str, split: str, shares: SplitShares, rng: random.Random,
                  candidate: Callable[[random.Random], T], key: Callable[[T], str]) -> T:
    """The first candidate drawn from `rng` whose split key belongs to `split`."""
    for _ in range(MAX_SPLIT_DRAWS):
        made = candidate(rng)
        if shares.of(family, key(made)) == split:
            return made
    raise ValueError(f"family {family}: no {split} instance in {MAX_SPLIT_DRAWS} draws; the "
                     f"task space is too small for {shares}")


class TaskFamily:
    """A deterministic, indexable source of task instances (and their demonstrations)."""

    def __init__(self, name: str, make: MakeFn, *, demonstrate: DemoFn | None = None,
                 size: int | None = None, splits: Sequence[str] = SPLITS,
                 description: str = "", options: Mapping[str, Any] | None = None,
                 split_key: SplitKeyFn | None = None,
                 shares: SplitShares = SplitShares(),
                 diagnose: DiagnoseFn | None = None) -> None:
        if not name or "/" in name:
            raise ValueError(f"family name {name!r} must be non-empty and contain no '/'")
        self.name = name
        self._make = make
        self._demonstrate = demonstrate
        self.size = size
        self.splits = tuple(splits)
        self.description = description
        self.options = dict(options or {})
        if split_key is not None and self.splits != SPLITS:
            raise ValueError(f"family {name}: a split_key needs the splits {SPLITS}, got "
                             f"{self.splits}")
        self.split_key = split_key
        self.shares = shares
        self.diagnose = diagnose

    def instance(self, index: int, split: str = "train") -> TaskInstance:
        if split not in self.splits:
            raise ValueError(f"family {self.name} has splits {self.splits}, not {split!r}")
        if index < 0 or (self.size is not None and index >= self.size):
            raise IndexError(f"family {self.name} has instances 0..{self.size}, not {index}")
        made = self._make(index, split)
        if not isinstance(made, TaskInstance):
            raise TypeError(f"family {self.name}: make() returned {type(made).__name__}, "
                            "expected a TaskInstance")
        if self.split_key is not None:
            home = self.shares.of(self.name, self.split_key(made))
            if home != split:
                raise ValueError(
                    f"family {self.name}: {split} instance {index} has split key "
                    f"{self.split_key(made)!r}, which belongs to the {home} split; draw "
                    f"instances with tasks.api.draw_in_split so the splits stay disjoint")
        return dataclasses.replace(made, family=self.name, key=f"{self.name}/{split}/{index}")

    def failure_mode(self, task: TaskInstance, messages: Sequence[ChatMessage]) -> str:
        """What went wrong in an unsolved trajectory, in a few words (the family's `diagnose`;
        "unsolved" for a family without one). Evaluations count these, so a summary can say
        what RL changed."""
        return self.diagnose(task, messages) if self.diagnose is not None else "unsolved"

    @property
    def held_out(self) -> bool:
        """Whether the splits are disjoint by construction (the family has a split key)."""
        return self.split_key is not None

    def instances(self, split: str = "train", start: int = 0,
                  count: int | None = None) -> Iterator[TaskInstance]:
        index = start
        while (count is None or index < start + count) and (self.size is None or index < self.size):
            yield self.instance(index, split)
            index += 1

    def by_key(self, key: str) -> TaskInstance:
        parts = key.split("/")
        if len(parts) != 3 or parts[0] != self.name or not parts[2].isdigit():
            raise ValueError(f"key {key!r} is not of the form {self.name}/<split>/<index>")
        return self.instance(int(parts[2]), parts[1])

    @property
    def has_demonstrations(self) -> bool:
        return self._demonstrate is not None

    def demonstration(self, instance: TaskInstance, correct: bool = True) -> Demonstration:
        if self._demonstrate is None:
            raise ValueError(f"family {self.name} has no demonstration generator; pass "
                             f"demonstrate=... to TaskFamily to warm-start on it")
        return self._demonstrate(instance, correct)

    def demonstrations(self, count: int, *, wrong_fraction: float = 0.0, start: int = 0,
                       seed: int = 0) -> list[Demonstration]:
        """`count` demonstrations of train instances start.., exactly
        round(count*wrong_fraction) of them deliberately wrong (chosen at random with `seed`);
        never of validation or test instances."""
        split = "train"
        if not 0.0 <= wrong_fraction <= 1.0:
            raise ValueError(f"wrong_fraction must be in [0, 1], got {wrong_fraction}")
        wrong = set(random.Random(seed).sample(range(count), round(count * wrong_fraction)))
        return [self.demonstration(task, correct=i not in wrong)
                for i, task in enumerate(self.instances(split, start, count))]
