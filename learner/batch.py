"""What the trainer consumes: frozen per-trajectory samples and the sources that yield them.

A `TrainingSample` is one admitted trajectory laid out as the model sees it: the full token
sequence (prompt, sampled tokens, tool output, later turns) with, at every position t, whether
token t is trained on and the behaviour log-probability the sampler gave it. Arrays all have
length T (top-k arrays (T, K)), checked at construction; the record never changes.

A `SampleSource` yields samples in admission-log order, each exactly once, resumable from a
sequence number. `InMemorySource` and `JsonlSource` are here; the SQL admission-log source
implements the same Protocol. No torch is imported here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from numbers import Integral
from typing import Any, Literal, Protocol, get_args

import numpy as np

from core.samples import ModelCallTokens, segment_samples

GroupId = str | int
SampleKind = Literal["rollout", "demonstration", "placeholder"]
SAMPLE_KINDS: tuple[SampleKind, ...] = get_args(SampleKind)


def _frozen(array: Any, dtype: Any, name: str) -> np.ndarray:
    try:
        out = np.array(array, dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"TrainingSample.{name}: cannot convert to {np.dtype(dtype).name}: {exc}"
        ) from None
    out.setflags(write=False)
    return out


@dataclass(frozen=True, eq=False)
class TrainingSample:
    """One trajectory for the learner; every per-token array is aligned to token positions.

    token_ids (T,)              the whole sequence, exactly as sampled / observed
    loss_mask (T,)              1 where token t was sampled by the policy and is trained on
    sampler_logprobs (T,)       log mu(token_ids[t] | token_ids[:t]) where loss_mask is 1
    weights_versions (T,)       policy version that sampled token t (-1 off the mask)
    sampler_topk_ids/_logprobs  (T, K) the sampler's top-k at position t, optional
    reward                      outcome reward of the trajectory
    group_id                    samples of the same task instance share it (group baselines)
    trajectory_id, sequence     provenance; `sequence` is the admission-log number (>= 1)
    model_call_ids, call_spans  the stored model calls it was built from and [start, stop) of
                                each call's sampled tokens (empty when it has none)
    kind                        "rollout" (trajectory_id is the store's, or a synthetic one's),
                                "demonstration" (its index) or "placeholder" (a data-parallel
                                rank's filler row); rows of one trajectory share (kind, id)
    selection_weight            admission's selection-bias weight (core.selection; 1 unless
                                [admission] reweight is on): scales the trajectory's advantage
    call_turns                  the agent-loop turn of each call span (empty: unknown, one turn)
    turn_rewards                the trajectory's per-turn rewards from its tools, index = turn
                                (ToolResult.reward; 0 where none), the same on all its rows;
                                the outcome `reward` is not in it (per-turn estimators add it
                                at the last turn)
    """

    token_ids: np.ndarray
    loss_mask: np.ndarray
    sampler_logprobs: np.ndarray
    weights_versions: np.ndarray
    reward: float
    group_id: GroupId
    trajectory_id: int
    sequence: int = 0
    sampler_topk_ids: np.ndarray | None = None
    sampler_topk_logprobs: np.ndarray | None = None
    model_call_ids: tuple[int, ...] = ()
    call_spans: tuple[tuple[int, int], ...] = ()
    kind: SampleKind = "rollout"
    selection_weight: float = 1.0
    call_turns: tuple[int, ...] = ()
    turn_rewards: tuple[float, ...] = ()
    length: int = field(init=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if isinstance(self.trajectory_id, bool) or not isinstance(self.trajectory_id, Integral):
            raise ValueError(
                f"TrainingSample: trajectory_id {self.trajectory_id!r} is not an int (a "
                "demonstration or placeholder says so with kind, not with its id)"
            )
        set_(self, "trajectory_id", int(self.trajectory_id))
        if self.kind not in SAMPLE_KINDS:
            raise ValueError(
                f"TrainingSample {self.trajectory_id}: kind {self.kind!r} is not one of "
                f"{', '.join(SAMPLE_KINDS)}"
            )
        set_(self, "token_ids", _frozen(self.token_ids, np.int64, "token_ids"))
        set_(self, "loss_mask", _frozen(self.loss_mask, np.bool_, "loss_mask"))
        set_(
            self, "sampler_logprobs", _frozen(self.sampler_logprobs, np.float32, "sampler_logprobs")
        )
        set_(self, "weights_versions", _frozen(self.weights_versions, np.int64, "weights_versions"))
        length = int(self.token_ids.shape[0]) if self.token_ids.ndim == 1 else -1
        if length < 1:
            raise ValueError(
                f"TrainingSample {self.trajectory_id}: token_ids must be a non-empty "
                f"1-D sequence, got shape {self.token_ids.shape}"
            )
        for name in ("loss_mask", "sampler_logprobs", "weights_versions"):
            if getattr(self, name).shape != (length,):
                raise ValueError(
                    f"TrainingSample {self.trajectory_id}: {name} has shape "
                    f"{getattr(self, name).shape}, expected ({length},) like token_ids"
                )
        if self.loss_mask[0]:
            raise ValueError(
                f"TrainingSample {self.trajectory_id}: loss_mask[0] is 1, but the first "
                "token has no prefix to be predicted from; start with the prompt"
            )
        if not np.all(np.isfinite(self.sampler_logprobs[self.loss_mask])):
            raise ValueError(
                f"TrainingSample {self.trajectory_id}: sampler_logprobs must be finite "
                "on every loss token (the engine records log mu of each sampled token)"
            )
        if not math.isfinite(float(self.reward)):
            raise ValueError(
                f"TrainingSample {self.trajectory_id}: reward {self.reward} is not finite"
            )
        set_(self, "reward", float(self.reward))
        weight = float(self.selection_weight)
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(
                f"TrainingSample {self.trajectory_id}: selection_weight {self.selection_weight} "
                "must be a finite number > 0"
            )
        set_(self, "selection_weight", weight)
        if (self.sampler_topk_ids is None) != (self.sampler_topk_logprobs is None):
            raise ValueError(
                f"TrainingSample {self.trajectory_id}: sampler_topk_ids and "
                "sampler_topk_logprobs must be given together"
            )
        if self.sampler_topk_ids is not None:
            ids = _frozen(self.sampler_topk_ids, np.int64, "sampler_topk_ids")
            lps = _frozen(self.sampler_topk_logprobs, np.float32, "sampler_topk_logprobs")
            if ids.ndim != 2 or ids.shape[0] != length or ids.shape != lps.shape:
                raise ValueError(
                    f"TrainingSample {self.trajectory_id}: sampler top-k ids {ids.shape} "
                    f"and log-probs {lps.shape} must both be ({length}, K)"
                )
            set_(self, "sampler_topk_ids", ids)
            set_(self, "sampler_topk_logprobs", lps)
        self._check_calls(length)
        set_(self, "length", length)

    def _check_calls(self, length: int) -> None:
        set_ = object.__setattr__
        set_(self, "model_call_ids", tuple(int(i) for i in self.model_call_ids))
        set_(self, "call_spans", tuple((int(a), int(b)) for a, b in self.call_spans))
        if len(self.model_call_ids) != len(self.call_spans):
            raise ValueError(
                f"TrainingSample {self.trajectory_id}: {len(self.model_call_ids)} model call "
                f"ids for {len(self.call_spans)} call spans"
            )
        end = 0
        for start, stop in self.call_spans:
            if not end <= start <= stop <= length:
                raise ValueError(
                    f"TrainingSample {self.trajectory_id}: call spans {list(self.call_spans)} "
                    f"must be ordered, disjoint and within its {length} tokens"
                )
            end = stop
        set_(self, "call_turns", tuple(int(turn) for turn in self.call_turns))
        if self.call_turns and (len(self.call_turns) != len(self.call_spans)
                                or min(self.call_turns) < 0):
            raise ValueError(
                f"TrainingSample {self.trajectory_id}: call_turns {list(self.call_turns)} must "
                f"give a turn >= 0 for each of its {len(self.call_spans)} call spans"
            )
        set_(self, "turn_rewards", tuple(float(r) for r in self.turn_rewards))
        if not all(math.isfinite(r) for r in self.turn_rewards):
            raise ValueError(
                f"TrainingSample {self.trajectory_id}: turn_rewards {list(self.turn_rewards)} "
                "must all be finite"
            )

    @property
    def member(self) -> tuple[str, int]:
        """The trajectory this row belongs to: the rows (segments) of one trajectory share it,
        and no demonstration or placeholder shares a rollout's."""
        return self.kind, self.trajectory_id

    @property
    def topk(self) -> int:
        return 0 if self.sampler_topk_ids is None else int(self.sampler_topk_ids.shape[1])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "token_ids": self.token_ids.tolist(),
            "loss_mask": self.loss_mask.astype(int).tolist(),
            "sampler_logprobs": self.sampler_logprobs.tolist(),
            "weights_versions": self.weights_versions.tolist(),
            "reward": self.reward,
            "group_id": self.group_id,
            "trajectory_id": self.trajectory_id,
            "sequence": self.sequence,
            "kind": self.kind,
        }
        if self.selection_weight != 1.0:
            out["selection_weight"] = self.selection_weight
        if self.model_call_ids:
            out["model_call_ids"] = list(self.model_call_ids)
            out["call_spans"] = [list(span) for span in self.call_spans]
        if self.call_turns:
            out["call_turns"] = list(self.call_turns)
        if self.turn_rewards:
            out["turn_rewards"] = list(self.turn_rewards)
        if self.sampler_topk_ids is not None:
            out["sampler_topk_ids"] = self.sampler_topk_ids.tolist()
            out["sampler_topk_logprobs"] = [
                [x if math.isfinite(x) else None for x in row]
                for row in self.sampler_topk_logprobs.tolist()
            ]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainingSample:
        required = (
            "token_ids",
            "loss_mask",
            "sampler_logprobs",
            "weights_versions",
            "reward",
            "group_id",
            "trajectory_id",
        )
        missing = [k for k in required if k not in data]
        if missing:
            raise ValueError(
                f"sample is missing {', '.join(missing)}; every sample needs "
                f"{', '.join(required)} (sequence, sampler_topk_*, model_call_ids, "
                "call_spans, call_turns, turn_rewards, kind and selection_weight optional)"
            )
        optional = {"sequence", "sampler_topk_ids", "sampler_topk_logprobs", "model_call_ids",
                    "call_spans", "kind", "selection_weight", "call_turns", "turn_rewards"}
        unknown = set(data) - set(required) - optional
        if unknown:
            raise ValueError(f"sample has unknown keys {sorted(unknown)}")
        topk_lp = data.get("sampler_topk_logprobs")
        if topk_lp is not None:
            topk_lp = [[-math.inf if x is None else x for x in row] for row in topk_lp]
        return cls(
            token_ids=data["token_ids"],
            loss_mask=data["loss_mask"],
            sampler_logprobs=data["sampler_logprobs"],
            weights_versions=data["weights_versions"],
            reward=data["reward"],
            group_id=data["group_id"],
            trajectory_id=data["trajectory_id"],
            sequence=int(data.get("sequence", 0)),
            sampler_topk_ids=data.get("sampler_topk_ids"),
            sampler_topk_logprobs=topk_lp,
            model_call_ids=tuple(data.get("model_call_ids", ())),
            call_spans=tuple(tuple(span) for span in data.get("call_spans", ())),
            kind=data.get("kind", "rollout"),
            selection_weight=float(data.get("selection_weight", 1.0)),
            call_turns=tuple(data.get("call_turns", ())),
            turn_rewards=tuple(data.get("turn_rewards", ())),
        )


class StoredCall(ModelCallTokens, Protocol):
    """A stored model call as the one path reads it, with its row id (`StoredModelCall`)."""

    @property
    def id(self) -> int: ...

    @property
    def turn(self) -> int: ...


def samples_from_calls(
    calls: Sequence[StoredCall],
    *,
    reward: float,
    group_id: GroupId,
    trajectory_id: int,
    sequence: int = 0,
    trainable: bool = True,
    selection_weight: float = 1.0,
    turn_rewards: Mapping[int, float] | None = None,
) -> list[TrainingSample]:
    """A trajectory's samples, one per segment, from its stored model calls by the one path
    (`core.samples.segment_samples`): loss mask 1 on sampled tokens, with their sampler
    log-probs, versions and top-k; each sample keeps its calls' ids, offsets and turns, and the
    trajectory's per-turn tool rewards (`turn_rewards`: {turn: reward}, up to its last turn).
    `trainable=False` zeroes the whole mask (the reward still counts in its group's baseline)."""
    last_turn = max((call.turn for call in calls), default=0)
    per_turn = tuple(float((turn_rewards or {}).get(turn, 0.0)) for turn in range(last_turn + 1)) \
        if turn_rewards else ()
    return [
        TrainingSample(
            token_ids=segment.token_ids,
            loss_mask=segment.loss_mask & trainable,
            sampler_logprobs=segment.sampler_logprobs,
            weights_versions=segment.weights_versions,
            reward=reward,
            group_id=group_id,
            trajectory_id=trajectory_id,
            sequence=sequence,
            sampler_topk_ids=segment.topk_ids,
            sampler_topk_logprobs=segment.topk_logprobs,
            model_call_ids=tuple(calls[i].id for i in segment.calls),
            call_spans=segment.call_spans,
            selection_weight=selection_weight,
            call_turns=tuple(calls[i].turn for i in segment.calls),
            turn_rewards=per_turn,
        )
        for segment in segment_samples(calls)
        if segment.length
    ]


def demonstration(
    token_ids: Sequence[int] | np.ndarray, loss_mask: Sequence[int] | np.ndarray, index: int = 0
) -> TrainingSample:
    """A supervised demonstration as a sample (kind "demonstration", its index as trajectory id;
    no sampler data, reward 0, its own group)."""
    n = len(token_ids)
    return TrainingSample(
        token_ids=token_ids,
        loss_mask=loss_mask,
        sampler_logprobs=np.zeros(n, np.float32),
        weights_versions=np.full(n, -1),
        reward=0.0,
        group_id=f"demo-{index}",
        trajectory_id=index,
        sequence=index + 1,
        kind="demonstration",
    )


class SampleSource(Protocol):
    """Admitted trajectories in admission-log order, each exactly once."""

    def read(self, after_sequence: int, limit: int) -> Sequence[TrainingSample]:
        """Up to `limit` samples with sequence > after_sequence, in order; [] if none yet."""
        ...

    def finished(self, after_sequence: int) -> bool:
        """True when no sample with sequence > after_sequence will ever be available."""
        ...

    def peers(self, batch: Sequence[TrainingSample]) -> Sequence[tuple[GroupId, float]]:
        """(group_id, reward) of admitted members of the batch's groups outside the batch."""
        ...


class InMemorySource:
    """A fixed list of samples; sequence numbers 0 are replaced by positions 1, 2, ..."""

    def __init__(self, samples: Iterable[TrainingSample]) -> None:
        items = list(samples)
        if items and all(s.sequence == 0 for s in items):
            items = [replace(s, sequence=i + 1) for i, s in enumerate(items)]
        sequences = [s.sequence for s in items]
        if any(b <= a for a, b in zip(sequences, sequences[1:])) or any(q < 1 for q in sequences):
            raise ValueError(
                "InMemorySource: sequence numbers must be >= 1 and strictly increasing "
                "(or all 0, to number the samples by position)"
            )
        self._samples = items
        self._sequences = sequences

    def read(self, after_sequence: int, limit: int) -> list[TrainingSample]:
        start = int(
            np.searchsorted(
                np.asarray(self._sequences, dtype=np.int64), after_sequence, side="right"
            )
        )
        return self._samples[start : start + limit]

    def finished(self, after_sequence: int) -> bool:
        return not self._sequences or after_sequence >= self._sequences[-1]

    def peers(self, batch: Sequence[TrainingSample]) -> list[tuple[GroupId, float]]:
        groups = {s.group_id for s in batch}
        inside = {s.sequence for s in batch}
        return [(s.group_id, s.reward) for s in self._samples
                if s.group_id in groups and s.sequence not in inside]

    def __len__(self) -> int:
        return len(self._samples)


class JsonlSource(InMemorySource):
    """Samples from a JSON-lines file, one `TrainingSample.to_json()` object per line."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        samples = []
        with path.open() as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    samples.append(TrainingSample.from_json(json.loads(line)))
                except (ValueError, TypeError) as exc:
                    raise ValueError(f"{path}:{number}: {exc}") from None
        super().__init__(samples)


def write_jsonl(samples: Iterable[TrainingSample], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for sample in samples:
            fh.write(json.dumps(sample.to_json()) + "\n")
    return path


def take_batch(source: SampleSource, after_sequence: int, batch_size: int) -> list[TrainingSample]:
    """Up to batch_size samples after `after_sequence`, extended so that the run of samples
    sharing the last sample's group_id is not split across two batches."""
    batch = list(source.read(after_sequence, batch_size))
    while batch and len(batch) >= batch_size:
        more = source.read(batch[-1].sequence, batch_size)
        same = [s for s in _prefix_of_group(more, batch[-1].group_id)]
        batch.extend(same)
        if len(same) < len(more) or not same:
            break
    return batch


def _prefix_of_group(samples: Sequence[TrainingSample], group_id: GroupId) -> list[TrainingSample]:
    out = []
    for sample in samples:
        if sample.group_id != group_id:
            break
        out.append(sample)
    return out
