"""Advantage estimators: group baselines (GRPO, Dr.GRPO, RLOO), GAE, DAPO's reward shaping.

Pure functions of tensors; nothing here carries a gradient (outputs are detached).

Guarantees:
- `outcome_advantages`: a group of one member gets advantage exactly 0 under every estimator;
  GRPO's std is the unbiased (n - 1) group std; `dr_grpo` = (n - 1) / n * `rloo` for a group
  of size n. With `baseline_weights` (VCPO's minimum-variance baseline for off-policy data,
  the weights being squared importance ratios) each baseline is the weighted mean instead of
  the plain one (leave-one-out for `rloo`); equal weights give the plain estimators exactly.
- `trajectory_advantages`: rows of one trajectory (template-forced segments) are one group
  member and share its advantage.
- `gae`: positions with mask 0 (tool output, prompt, padding) are skipped, not treated as
  steps: the TD error of a loss token bootstraps from the value of the next loss token of the
  same row, and the last loss token of a row is terminal. Advantages and returns are 0 at
  masked positions. Whitening uses the masked mean and the unbiased masked variance.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from config.learner import OutcomeEstimator

GroupIds = torch.Tensor | Sequence[object]


def group_index(
    group_ids_B: GroupIds, device: torch.device | None = None
) -> tuple[torch.Tensor, int]:
    """Dense group index (B,) in [0, G) and G, from a tensor or a sequence of hashable ids."""
    if isinstance(group_ids_B, torch.Tensor):
        if group_ids_B.dim() != 1:
            raise ValueError(f"group_ids_B must be 1-D, got shape {tuple(group_ids_B.shape)}")
        _, index = torch.unique(group_ids_B, return_inverse=True)
        index = index.to(device) if device is not None else index
        return index, int(index.max().item()) + 1 if index.numel() else 0
    dense: dict[object, int] = {}
    index_list = [dense.setdefault(g, len(dense)) for g in group_ids_B]
    return torch.tensor(index_list, dtype=torch.long, device=device), len(dense)


def _group_sums(values_B: torch.Tensor, index_B: torch.Tensor, groups: int) -> torch.Tensor:
    return torch.zeros(groups, dtype=values_B.dtype, device=values_B.device).index_add_(
        0, index_B, values_B
    )


def outcome_advantages(
    rewards_B: torch.Tensor,
    group_ids_B: GroupIds,
    estimator: OutcomeEstimator | str,
    eps: float = 1e-6,
    baseline_weights_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sequence advantages from outcome rewards and group membership.

    grpo:    (r - group mean) / (unbiased group std + eps)
    dr_grpo: r - group mean
    rloo:    r_i - mean of the other members of i's group
    With `baseline_weights_B` (>= 0) the means are weighted by them (GRPO's std stays the
    plain one); a leave-one-out baseline whose other members all weigh 0 falls back to their
    plain mean.
    """
    if estimator not in ("grpo", "dr_grpo", "rloo"):
        hint = (
            " (gae needs per-token values: call learner.advantages.gae)"
            if estimator == "gae"
            else ""
        )
        raise ValueError(
            f"unknown outcome estimator '{estimator}'; use grpo, dr_grpo or rloo{hint}"
        )
    if rewards_B.dim() != 1:
        raise ValueError(f"rewards_B must be 1-D, got shape {tuple(rewards_B.shape)}")
    rewards_B = rewards_B.detach().to(
        torch.float64 if rewards_B.dtype == torch.float64 else torch.float32
    )
    index_B, groups = group_index(group_ids_B, rewards_B.device)
    if index_B.shape != rewards_B.shape:
        raise ValueError(
            f"group_ids_B has {index_B.numel()} entries, rewards_B has {rewards_B.numel()}"
        )
    counts_G = _group_sums(torch.ones_like(rewards_B), index_B, groups)
    sums_G = _group_sums(rewards_B, index_B, groups)
    n_B = counts_G[index_B]
    mean_B = (sums_G / counts_G)[index_B]
    singleton_B = n_B < 2
    others_mean_B = (sums_G[index_B] - rewards_B) / (n_B - 1).clamp(min=1)
    if baseline_weights_B is not None:
        w_B = baseline_weights_B.detach().to(rewards_B.dtype).clamp(min=0.0)
        if w_B.shape != rewards_B.shape:
            raise ValueError(f"baseline_weights_B has shape {tuple(w_B.shape)}, rewards_B "
                             f"{tuple(rewards_B.shape)}")
        w_G = _group_sums(w_B, index_B, groups)
        wr_G = _group_sums(w_B * rewards_B, index_B, groups)
        mean_B = torch.where(w_G[index_B] > 0, wr_G[index_B] / w_G[index_B].clamp(min=1e-300),
                             mean_B)
        others_w_B = w_G[index_B] - w_B
        others_mean_B = torch.where(
            others_w_B > 0, (wr_G[index_B] - w_B * rewards_B) / others_w_B.clamp(min=1e-300),
            others_mean_B)
    if estimator == "dr_grpo":
        advantages_B = rewards_B - mean_B
    elif estimator == "rloo":
        advantages_B = rewards_B - others_mean_B
    else:
        squares_G = _group_sums((rewards_B - mean_B) ** 2, index_B, groups)
        std_B = torch.sqrt(squares_G / (counts_G - 1).clamp(min=1))[index_B]
        advantages_B = (rewards_B - mean_B) / (std_B + eps)
    return torch.where(singleton_B, torch.zeros_like(advantages_B), advantages_B)


def trajectory_advantages(
    rewards_B: torch.Tensor,
    group_ids_B: Sequence[object],
    trajectory_ids_B: Sequence[object],
    estimator: OutcomeEstimator | str,
    eps: float = 1e-6,
    peers: Sequence[tuple[object, float]] = (),
    baseline_weights_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """`outcome_advantages` where each trajectory is one group member, whatever its rows.

    A trajectory whose chat template forced several training segments spans several rows
    (same trajectory id, same reward); the group baseline counts it once and every one of its
    rows gets its advantage. `peers` are (group_id, reward) of admitted members outside the
    batch (streamed groups): they enter the baselines of groups present in the batch only,
    with weight 1 under `baseline_weights_B` (a trajectory's weight is its first row's).
    """
    first_row: dict[object, int] = {}
    for row, trajectory in enumerate(trajectory_ids_B):
        first_row.setdefault(trajectory, row)
    member = {trajectory: i for i, trajectory in enumerate(first_row)}
    rows = list(first_row.values())
    in_batch = set(group_ids_B)
    outside = [(g, r) for g, r in peers if g in in_batch]
    rewards = torch.cat([
        rewards_B[rows],
        torch.tensor([r for _, r in outside], dtype=rewards_B.dtype, device=rewards_B.device),
    ])
    groups = [group_ids_B[row] for row in rows] + [g for g, _ in outside]
    weights = None
    if baseline_weights_B is not None:
        weights = torch.cat([baseline_weights_B[rows].to(rewards.dtype),
                             torch.ones(len(outside), dtype=rewards.dtype,
                                        device=rewards.device)])
    advantages = outcome_advantages(rewards, groups, estimator, eps, weights)
    member_of_row = torch.tensor([member[t] for t in trajectory_ids_B], device=rewards_B.device)
    return advantages[member_of_row]


def masked_whiten(
    values_B_T: torch.Tensor, mask_B_T: torch.Tensor, eps: float = 1e-8
) -> torch.Tensor:
    """(x - masked mean) / sqrt(unbiased masked variance + eps); 0 at masked positions."""
    mask = mask_B_T.to(values_B_T.dtype)
    count = mask.sum()
    mean = (values_B_T * mask).sum() / count.clamp(min=1)
    centered = (values_B_T - mean) * mask
    if count < 2:
        return centered
    variance = (centered**2).sum() / (count - 1)
    return centered * torch.rsqrt(variance + eps)


@torch.no_grad()
def gae(
    token_rewards_B_T: torch.Tensor,
    values_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the loss tokens of each row.

    values_B_T[b, t] is V(state before token t). Returns (advantages_B_T, returns_B_T) where
    returns are the unwhitened advantages plus values, the critic's regression target.
    Rewards placed on masked positions would be silently lost, so they are an error.
    """
    if not (token_rewards_B_T.shape == values_B_T.shape == mask_B_T.shape):
        raise ValueError(
            f"gae: token_rewards {tuple(token_rewards_B_T.shape)}, values "
            f"{tuple(values_B_T.shape)} and mask {tuple(mask_B_T.shape)} must match"
        )
    mask = mask_B_T.to(torch.bool)
    rewards = token_rewards_B_T.to(values_B_T.dtype)
    if bool((rewards[~mask] != 0).any()):
        raise ValueError(
            "gae: a non-zero reward sits on a masked position; put each reward on a "
            "loss token (e.g. the last sampled token of the trajectory)"
        )
    batch, length = values_B_T.shape
    advantages = torch.zeros_like(values_B_T)
    next_value = torch.zeros(batch, dtype=values_B_T.dtype, device=values_B_T.device)
    running = torch.zeros_like(next_value)
    for t in range(length - 1, -1, -1):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values_B_T[:, t]
        step = delta + gamma * lam * running
        running = torch.where(m, step, running)
        next_value = torch.where(m, values_B_T[:, t], next_value)
        advantages[:, t] = torch.where(m, step, torch.zeros_like(step))
    returns = torch.where(mask, advantages + values_B_T, torch.zeros_like(advantages))
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def zero_variance_groups(rewards_B: torch.Tensor, group_ids_B: GroupIds) -> torch.Tensor:
    """keep_B: True for members of groups whose rewards are not all equal.

    A group of one member has zero variance and is not kept (its advantage is 0 anyway).
    Equality is exact, as verifiers' rewards are.
    """
    index_B, groups = group_index(group_ids_B, rewards_B.device)
    rewards = rewards_B.detach().to(torch.float64)
    high = torch.full((groups,), -torch.inf, dtype=rewards.dtype, device=rewards.device)
    low = torch.full((groups,), torch.inf, dtype=rewards.dtype, device=rewards.device)
    high = high.scatter_reduce(0, index_B, rewards, reduce="amax")
    low = low.scatter_reduce(0, index_B, rewards, reduce="amin")
    return (high > low)[index_B]


def turn_advantages(
    turn_rewards_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    group_ids_B: GroupIds,
    mode: str = "leave_one_out",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-turn advantages (B, T) from per-turn rewards, one turn per masked position.

    leave_one_out (unbiased): A_{i,t} = G_{i,t} - mean_{j != i in i's group} G_{j,t}, with
    G_{i,t} = sum_{s >= t} r_{i,s} the reward still to come, and G_{j,t} = 0 for a member that
    ended before t. The baseline depends on the other members only, never on i's own
    actions, so it adds no bias.
    turn_index_normalised (the biased variant verl RFC 7244 describes): each turn's reward is
    z-scored among the group members that reached that turn, r'_{i,t} = (r_{i,t} - mean_t) /
    (std_t + eps), and A_{i,t} = sum_{s >= t} r'_{i,s}. Who reaches turn t depends on earlier
    actions, so the normalisation is an action-dependent baseline; it hides a length bonus
    (the lab measures it: `lab/turns.py`).
    Zero off the mask; a member alone in its group gets 0.
    """
    mask = mask_B_T.to(torch.bool)
    zero = torch.zeros((), dtype=torch.float64)
    rewards = torch.where(mask, turn_rewards_B_T.detach().double(), zero)
    index_B, groups = group_index(group_ids_B, rewards.device)
    counts_G = _group_sums(torch.ones(rewards.shape[0], dtype=torch.float64,
                                      device=rewards.device), index_B, groups)
    n_B = counts_G[index_B]
    if mode == "leave_one_out":
        to_go = rewards.flip(-1).cumsum(-1).flip(-1)
        sums_G_T = torch.zeros(groups, rewards.shape[1], dtype=torch.float64,
                               device=rewards.device).index_add_(0, index_B, to_go)
        others = (sums_G_T[index_B] - to_go) / (n_B - 1).clamp(min=1).unsqueeze(1)
        advantages = to_go - others
    elif mode == "turn_index_normalised":
        m = mask.double()
        alive_G_T = torch.zeros(groups, rewards.shape[1], dtype=torch.float64,
                                device=rewards.device).index_add_(0, index_B, m)
        sum_G_T = torch.zeros_like(alive_G_T).index_add_(0, index_B, rewards)
        mean = (sum_G_T / alive_G_T.clamp(min=1))[index_B]
        sq_G_T = torch.zeros_like(alive_G_T).index_add_(0, index_B, ((rewards - mean) * m) ** 2)
        std = torch.sqrt(sq_G_T / (alive_G_T - 1).clamp(min=1))[index_B]
        normalised = torch.where(mask, (rewards - mean) / (std + eps), zero)
        advantages = normalised.flip(-1).cumsum(-1).flip(-1)
    else:
        raise ValueError(f"unknown turn advantage {mode!r}; use leave_one_out or "
                         "turn_index_normalised")
    return torch.where(mask & (n_B >= 2).unsqueeze(1), advantages, zero)
