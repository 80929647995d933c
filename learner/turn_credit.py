"""Per-turn credit for multi-turn agents: each sampled token gets the advantage of its turn.

A trajectory's turn t earns the rewards its tools granted during t (`TrainingSample.
turn_rewards`, from `ToolResult.reward`), and its last turn earns the outcome reward as well.
`token_turn_advantages` computes the per-turn advantages of `learner.advantages.turn_advantages`
over the trajectories of a batch, group by group, and lays them on the tokens of each turn's
model call (`call_spans` / `call_turns`).

Guarantees:
- a trajectory that spans several rows (template-forced segments) is one group member: its
  turns and rewards are gathered from all its rows, and each row's tokens get that member's
  advantages;
- a row without call turns is a one-turn trajectory (all its loss tokens are turn 0; a
  loss-masked admission's placeholder still counts in its group as such a member);
- with no tool rewards, `leave_one_out` gives every token of member i the reward-to-go
  leave-one-out difference, which on turns every member reached is RLOO's R_i - mean_{j != i} R_j;
- members of a group outside the batch are not seen (a streamed group's earlier members):
  the baseline averages the members present, which keeps it unbiased with fewer members;
- a member alone in its group, and every demonstration, gets 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from learner.advantages import turn_advantages
from learner.batch import TrainingSample

TURN_ESTIMATORS = {"turn_leave_one_out": "leave_one_out",
                   "turn_index_normalised": "turn_index_normalised"}


def token_turn_advantages(samples: Sequence[TrainingSample], length: int, estimator: str,
                          eps: float = 1e-6) -> torch.Tensor:
    """(B, length) float32: row i's position p holds the advantage of the turn whose model call
    sampled token p of sample i (0 where no call sampled it)."""
    mode = TURN_ESTIMATORS[estimator]
    members: dict[object, int] = {}
    last: list[int] = []
    for sample in samples:
        index = members.setdefault(sample.member, len(members))
        if index == len(last):
            last.append(0)
        last[index] = max(last[index], max(sample.call_turns, default=0),
                          len(sample.turn_rewards) - 1)
    width = max(last, default=0) + 1
    rewards = torch.zeros(len(members), width, dtype=torch.float64)
    mask = torch.arange(width).unsqueeze(0) <= torch.tensor(last).unsqueeze(1)
    groups: list[object] = [None] * len(members)
    seen: set[int] = set()
    for sample in samples:
        index = members[sample.member]
        if index in seen:
            continue
        seen.add(index)
        rewards[index, :len(sample.turn_rewards)] = torch.tensor(sample.turn_rewards,
                                                                 dtype=torch.float64)
        rewards[index, last[index]] += sample.reward
        # a demonstration (or placeholder) is its own group: nothing to compare it with
        groups[index] = sample.group_id if sample.kind == "rollout" else sample.member
    per_turn = turn_advantages(rewards, mask, groups, mode, eps).float()
    out = torch.zeros(len(samples), length, dtype=torch.float32)
    for row, sample in enumerate(samples):
        index = members[sample.member]
        turns = sample.call_turns or (0,) * len(sample.call_spans)
        if sample.call_spans:
            for (start, stop), turn in zip(sample.call_spans, turns):
                out[row, start:stop] = per_turn[index, turn]
        else:  # no call record: its loss tokens are one turn
            out[row, :sample.length][torch.from_numpy(sample.loss_mask)] = per_turn[index, 0]
    return out
