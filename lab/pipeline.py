"""Learning per compute: train the tractable policy under a pipeline mode's lag and throughput.

A fixed "machine" of `slots` generation workers and one learner runs in discrete time (one
unit = one token at full speed). Each trajectory decodes one token per `per_token x slowdown`
time units, the slowdown drawn from `lab.durations` (long tail, harder prompts slower). The
learner needs `batch_size` responses (whole groups of `group_size`) per update and is busy
`train_time` units per update. Modes:

- `sync`:     generate one batch with the current version, wait for its slowest trajectory,
              train (generation idle), publish, repeat. No lag; idle hardware.
- `async`:    generation never stops; each trajectory is sampled entirely with the version it
              started with; the learner takes the oldest complete groups and drops groups
              whose lag (learner version - version of their oldest token) exceeds `max_lag`.
- `inflight`: `async`, plus weight updates reach trajectories in progress: later tokens are
              sampled with the newest version, optionally still `kv_residual` of the way
              towards the version the trajectory started with (retained KV).

Every token records the log-prob of the processed distribution it was drawn from, so each
estimator corrects with the true behaviour probabilities, exactly as with the real engine.
Updates use the real learner losses via `lab.estimators.estimate_gradients` and Adam or SGD.
After every update the exact J is recorded with the simulated time.

Guarantees: a run is a deterministic function of (config, estimator, mode, seed); every
generated trajectory is either admitted once, dropped as stale, or still unfinished at the end
(`generated = admitted + dropped + leftover`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from lab.config import LearningSection, ModeSection
from lab.durations import DurationModel
from lab.estimator_spec import EstimatorSpec
from lab.estimators import estimate_gradients
from lab.policy import exact_objective, sequence_rewards
from lab.sampler import Processing, SampledBatch, processed_logprobs
from lab.world import World


@dataclass
class RunResult:
    estimator: str
    mode: str
    seed: int
    times: list[float] = field(default_factory=list)
    updates: list[int] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)
    generated: int = 0
    admitted: int = 0
    dropped_stale: int = 0
    lags: list[int] = field(default_factory=list)
    spanning: int = 0
    busy_slot_time: float = 0.0
    sim_time: float = 0.0
    wall_seconds: float = 0.0

    def summary(self) -> dict[str, float]:
        slots_time = max(self.sim_time, 1e-9)
        return {
            "final_return": self.returns[-1],
            "sim_time": self.sim_time,
            "throughput": self.generated / slots_time,
            "admitted_per_time": self.admitted / slots_time,
            "dropped_frac": self.dropped_stale / max(1, self.admitted + self.dropped_stale),
            "mean_lag": sum(self.lags) / len(self.lags) if self.lags else 0.0,
            "max_lag": float(max(self.lags)) if self.lags else 0.0,
            "spanning_frac": self.spanning / max(1, self.admitted),
        }


@dataclass
class _Trajectory:
    prompt: int
    group: int
    tokens_T: torch.Tensor
    states_T: torch.Tensor
    sampler_lp_T: torch.Tensor
    topk_ids_T_K: torch.Tensor
    topk_lp_T_K: torch.Tensor
    versions_T: torch.Tensor
    length: int
    stopped: bool
    first_version: int


@dataclass
class _Group:
    prompt: int
    size: int
    started: int = 0
    members: list[_Trajectory] = field(default_factory=list)

    @property
    def oldest_version(self) -> int:
        return min(t.first_version for t in self.members)


class _Slots:
    """Per-slot state of the trajectories in progress, as tensors over the K slots."""

    def __init__(self, k: int, horizon: int, topk: int, start_state: int) -> None:
        self.active = torch.zeros(k, dtype=torch.bool)
        self.prompt = torch.zeros(k, dtype=torch.long)
        self.group = torch.zeros(k, dtype=torch.long)
        self.state = torch.full((k,), start_state, dtype=torch.long)
        self.pos = torch.zeros(k, dtype=torch.long)
        self.speed = torch.ones(k, dtype=torch.float64)
        self.progress = torch.zeros(k, dtype=torch.float64)
        self.start_version = torch.zeros(k, dtype=torch.long)
        self.first_version = torch.zeros(k, dtype=torch.long)
        self.tokens = torch.zeros(k, horizon, dtype=torch.long)
        self.states = torch.full((k, horizon), start_state, dtype=torch.long)
        self.sampler_lp = torch.zeros(k, horizon, dtype=torch.float64)
        self.topk_ids = torch.zeros(k, horizon, topk, dtype=torch.long)
        self.topk_lp = torch.zeros(k, horizon, topk, dtype=torch.float64)
        self.token_versions = torch.zeros(k, horizon, dtype=torch.long)
        self.start_state = start_state


class PipelineSimulation:
    """One training run of one estimator under one pipeline mode."""

    def __init__(self, world: World, estimator_name: str, estimator: EstimatorSpec,
                 mode: ModeSection, cfg: LearningSection, durations: DurationModel,
                 seed: int) -> None:
        self.world, self.spec = world, world.spec
        self.estimator, self.mode, self.cfg = estimator, mode, cfg
        self.durations = durations
        self.gen = torch.Generator().manual_seed(seed)
        self.theta = world.theta_P_S_V.detach().clone().requires_grad_(True)
        self.optimizer = (torch.optim.Adam([self.theta], lr=cfg.lr) if cfg.optimizer == "adam"
                          else torch.optim.SGD([self.theta], lr=cfg.lr))
        self.version = 0
        self.versions: dict[int, torch.Tensor] = {0: self.theta.detach().clone()}
        self.processing = Processing(cfg.sampler.temperature, cfg.sampler.top_k, cfg.sampler.top_p)
        noise_gen = torch.Generator().manual_seed(seed + 7919)
        self.noise_P_S_V = cfg.sampler.logit_noise * torch.randn(
            self.spec.shape, generator=noise_gen, dtype=torch.float64)
        self.topk = cfg.topk or self.spec.vocab_size
        self.slots = _Slots(cfg.slots, self.spec.horizon, self.topk, self.spec.start_state)
        self.prompt_factors_P = durations.prompt_factors(
            exact_objective(world.theta_P_S_V, self.spec, world.reward))
        self.groups: dict[int, _Group] = {}
        self.complete: list[int] = []
        self.open_group: int | None = None
        self.next_group_id = 0
        self.round_started = 0
        self.time = 0.0
        self.learner_until: float | None = None
        self.pending_grad: torch.Tensor | None = None
        self.result = RunResult(estimator_name, mode.title, seed)

    # ------------------------------------------------------------------ dispatch
    def _new_member(self) -> tuple[int, int]:
        """(prompt, group) of the next trajectory: the open group's, or a new group's."""
        group = self.groups.get(self.open_group) if self.open_group is not None else None
        if group is None or group.started >= group.size:
            self.open_group = self.next_group_id
            self.next_group_id += 1
            prompt = int(torch.randint(self.spec.num_prompts, (1,), generator=self.gen))
            group = self.groups[self.open_group] = _Group(prompt, self.cfg.group_size)
        group.started += 1
        return group.prompt, self.open_group

    def _dispatch(self) -> None:
        s = self.slots
        for k in (~s.active).nonzero().flatten().tolist():
            if self.mode.name == "sync":
                if self.round_started >= self.cfg.batch_size or self.learner_until is not None:
                    return
                self.round_started += 1
            prompt, gid = self._new_member()
            slowdown = float(self.durations.slowdowns(torch.tensor([prompt]), self.prompt_factors_P,
                                                      self.gen)[0])
            s.active[k], s.prompt[k], s.group[k] = True, prompt, gid
            s.state[k], s.pos[k], s.progress[k] = s.start_state, 0, 0.0
            s.speed[k] = 1.0 / (self.durations.per_token * slowdown)
            s.start_version[k] = s.first_version[k] = self.version
            s.states[k] = s.start_state
            self.result.generated += 1

    # ------------------------------------------------------------------ generation
    def _logits_of_versions(self, versions: torch.Tensor, prompts: torch.Tensor,
                            states: torch.Tensor) -> torch.Tensor:
        used, which = torch.unique(versions, return_inverse=True)
        stack = torch.stack([self.versions[v] for v in used.tolist()])
        return stack[which, prompts, states]

    def _sampler_logits(self, idx: torch.Tensor) -> torch.Tensor:
        s = self.slots
        prompts, states = s.prompt[idx], s.state[idx]
        if self.mode.name == "inflight":
            logits = self.versions[self.version][prompts, states]
            if self.mode.kv_residual:
                old = self._logits_of_versions(s.start_version[idx], prompts, states)
                logits = logits + self.mode.kv_residual * (old - logits)
        else:
            logits = self._logits_of_versions(s.start_version[idx], prompts, states)
        return logits + self.noise_P_S_V[prompts, states]

    def _emit(self, idx: torch.Tensor) -> None:
        s = self.slots
        logprobs = processed_logprobs(self._sampler_logits(idx), self.processing)
        uniform = torch.rand(logprobs.shape, generator=self.gen, dtype=logprobs.dtype)
        token = (logprobs - torch.log(-torch.log(uniform.clamp_min(1e-300)))).argmax(-1)
        pos = s.pos[idx]
        s.tokens[idx, pos] = token
        s.states[idx, pos] = s.state[idx]
        s.sampler_lp[idx, pos] = logprobs.gather(1, token.unsqueeze(1)).squeeze(1)
        top = logprobs.topk(self.topk, dim=-1)
        s.topk_ids[idx, pos], s.topk_lp[idx, pos] = top.indices, top.values
        if self.mode.name == "inflight":
            s.first_version[idx] = torch.where(pos == 0, self.version, s.first_version[idx])
            s.token_versions[idx, pos] = self.version
        else:
            s.token_versions[idx, pos] = s.start_version[idx]
        s.pos[idx] = pos + 1
        s.state[idx] = token
        stopped = (token == self.spec.stop_id) if self.spec.stop_id is not None else \
            torch.zeros_like(token, dtype=torch.bool)
        done = stopped | (s.pos[idx] >= self.spec.horizon)
        for k, was_stopped in zip(idx[done].tolist(), stopped[done].tolist()):
            self._finish(k, bool(was_stopped))

    def _finish(self, k: int, stopped: bool) -> None:
        s = self.slots
        length = int(s.pos[k])
        traj = _Trajectory(int(s.prompt[k]), int(s.group[k]), s.tokens[k].clone(),
                           s.states[k].clone(), s.sampler_lp[k].clone(), s.topk_ids[k].clone(),
                           s.topk_lp[k].clone(), s.token_versions[k].clone(), length, stopped,
                           int(s.first_version[k]))
        s.active[k] = False
        group = self.groups[traj.group]
        group.members.append(traj)
        if len(group.members) == group.size:
            self.complete.append(traj.group)

    def _advance(self, dt: float) -> None:
        s = self.slots
        self.result.busy_slot_time += dt * float(s.active.sum())
        s.progress += s.speed * dt * s.active
        due = s.active & (s.progress >= 1.0 - 1e-9)
        s.progress[due] -= 1.0
        if due.any():
            self._emit(due.nonzero().flatten())

    def _time_to_next_token(self) -> float:
        s = self.slots
        if not s.active.any():
            return math.inf
        remaining = ((1.0 - s.progress[s.active]) / s.speed[s.active]).clamp_min(0.0)
        return max(1.0, math.ceil(float(remaining.min()) - 1e-9))

    # ------------------------------------------------------------------ learner
    def _take_batch(self) -> list[_Group] | None:
        needed = self.cfg.batch_size // self.cfg.group_size
        if self.mode.name != "sync":
            fresh = []
            for gid in self.complete:
                lag = self.version - self.groups[gid].oldest_version
                if lag > self.mode.max_lag:
                    self.result.dropped_stale += self.groups[gid].size
                    del self.groups[gid]
                else:
                    fresh.append(gid)
            self.complete = fresh
        if len(self.complete) < needed:
            return None
        taken, self.complete = self.complete[:needed], self.complete[needed:]
        return [self.groups.pop(gid) for gid in taken]

    def _batch(self, groups: list[_Group]) -> SampledBatch:
        members = [t for g in groups for t in g.members]
        stack = lambda name: torch.stack([getattr(t, name) for t in members])
        lengths = torch.tensor([t.length for t in members])
        mask = torch.arange(self.spec.horizon).unsqueeze(0) < lengths.unsqueeze(1)
        return SampledBatch(
            prompt_ids_N=torch.tensor([t.prompt for t in members]),
            group_ids_N=torch.tensor([t.group for t in members]),
            states_N_T=stack("states_T"), tokens_N_T=stack("tokens_T"), mask_N_T=mask,
            lengths_N=lengths, stopped_N=torch.tensor([t.stopped for t in members]),
            sampler_logprobs_N_T=stack("sampler_lp_T"),
            sampler_topk_ids_N_T_K=stack("topk_ids_T_K"),
            sampler_topk_logprobs_N_T_K=stack("topk_lp_T_K"),
            table_ids_N_T=torch.zeros(len(members), self.spec.horizon, dtype=torch.long))

    def _start_step(self) -> bool:
        groups = self._take_batch()
        if groups is None:
            return False
        for g in groups:
            self.result.lags += [self.version - t.first_version for t in g.members]
            self.result.spanning += sum(
                int(t.versions_T[:t.length].unique().numel() > 1) for t in g.members)
        self.result.admitted += sum(g.size for g in groups)
        batch = self._batch(groups)
        rewards = sequence_rewards(self.spec, self.world.reward, batch.prompt_ids_N,
                                   batch.states_N_T, batch.tokens_N_T, batch.lengths_N,
                                   batch.stopped_N)
        estimate = estimate_gradients(self.spec, self.theta.detach(), batch, rewards,
                                      self.estimator, replicate_size=batch.size)
        self.pending_grad = estimate.gradients_M_D[0].reshape(self.spec.shape)
        self.learner_until = self.time + self.cfg.train_time
        return True

    def _finish_step(self) -> None:
        self.optimizer.zero_grad()
        self.theta.grad = -self.pending_grad.to(self.theta.dtype)
        self.optimizer.step()
        self.version += 1
        self.versions[self.version] = self.theta.detach().clone()
        in_use = set(self.slots.start_version[self.slots.active].tolist()) | {self.version}
        for v in [v for v in self.versions if v not in in_use]:
            del self.versions[v]
        self.learner_until, self.pending_grad = None, None
        self.round_started = 0
        self._record()

    def _record(self) -> None:
        value = exact_objective(self.theta.detach(), self.spec, self.world.reward).mean()
        self.result.times.append(self.time)
        self.result.updates.append(self.version)
        self.result.returns.append(float(value))

    # ------------------------------------------------------------------ main loop
    def run(self, updates: int) -> RunResult:
        started = time.perf_counter()
        self._record()
        while self.version < updates:
            if self.learner_until is not None and self.time >= self.learner_until - 1e-9:
                self._finish_step()
                continue
            self._dispatch()
            if self.learner_until is None and self._start_step():
                continue
            dt = self._time_to_next_token()
            if self.learner_until is not None:
                dt = min(dt, max(self.learner_until - self.time, 0.0))
            if math.isinf(dt):
                raise RuntimeError("pipeline simulation stalled: no trajectory in progress and "
                                   "the learner is idle; check slots and batch_size")
            self.time += dt
            self._advance(dt)
        self.result.sim_time = self.time
        self.result.wall_seconds = time.perf_counter() - started
        return self.result
