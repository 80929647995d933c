"""The learner's side of the admission log: SQL stream entries become `TrainingSample`s.

Guarantees: `read` returns the entries after a sequence number in order, each trajectory's
tokens rebuilt exactly from its stored model calls by the one path (`core.samples`: the
concatenation, per segment, of each call's prompt delta and sampled tokens; loss mask 1 on
sampled tokens only; each sample keeps its calls' ids and offsets); a loss-masked
admission becomes a one-token sample with no loss tokens, so it counts in its group's baseline
and nowhere else. Each sample carries its entry's selection weight, its calls' turns and its
trajectory's per-turn tool rewards (`tool_calls.reward`, summed per turn). A trajectory whose chat
template forced several segments yields one sample per segment, all in the trajectory's group;
the trainer counts them as one group member (`learner.advantages.trajectory_advantages`).
"""

from __future__ import annotations

from collections.abc import Sequence

from core.store.store import Store
from learner.batch import TrainingSample, samples_from_calls


class StoreSource:
    """`SampleSource` over a run's `learner_stream` table."""

    def __init__(self, store: Store, run_id: str, pad_id: int = 0) -> None:
        self.store, self.run_id, self.pad_id = store, run_id, pad_id

    def read(self, after_sequence: int, limit: int) -> list[TrainingSample]:
        entries = self.store.stream_after(self.run_id, after_sequence, limit)
        trained = [e.trajectory_id for e in entries if not e.loss_masked]
        calls = self.store.model_calls_for(trained)
        turn_rewards = self.store.turn_rewards_for(trained)
        samples: list[TrainingSample] = []
        for entry in entries:
            if entry.loss_masked:
                samples.append(TrainingSample(
                    token_ids=[self.pad_id], loss_mask=[0], sampler_logprobs=[0.0],
                    weights_versions=[-1], reward=entry.reward, group_id=entry.group_id,
                    trajectory_id=entry.trajectory_id, sequence=entry.seq))
                continue
            built = samples_from_calls(calls[entry.trajectory_id], reward=entry.reward,
                                       group_id=entry.group_id,
                                       trajectory_id=entry.trajectory_id, sequence=entry.seq,
                                       selection_weight=entry.weight,
                                       turn_rewards=turn_rewards[entry.trajectory_id])
            if not built:
                raise ValueError(f"admitted trajectory {entry.trajectory_id} (seq {entry.seq}) "
                                 f"has no stored model calls")
            samples.extend(built)
        return samples

    def finished(self, after_sequence: int) -> bool:
        return self.store.run_is_finished(self.run_id) and not self.store.stream_after(
            self.run_id, after_sequence, 1)

    def peers(self, batch: Sequence[TrainingSample]) -> list[tuple[int, float]]:
        groups = sorted({s.group_id for s in batch if s.group_id is not None})
        if not groups:
            return []
        return self.store.stream_peers(self.run_id, groups, [s.sequence for s in batch])
