"""Data-parallel learner workers (`[learner] workers = W`): W processes, one torch.distributed
process group (gloo on CPU, NCCL on CUDA), one replica of the policy and its optimizer state
per process, gradients summed by DDP.

How the W processes start. A worker learns its place from torch's standard environment:
`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` (and `LOCAL_RANK` for the GPU on a node).
When `learner serve` starts without `WORLD_SIZE` and with W > 1 (the local job), it becomes
rank 0, picks a free port on 127.0.0.1 and starts ranks 1..W-1 itself as the same command
with that environment (`launch_peers`); the peers die with it. Any other launcher (torchrun,
Ray actors, a cluster scheduler) starts the W processes with the environment set, and none
spawns peers. Every rank must see the same model and publish directories (a shared disk).

Guarantees:
- rank 0 alone reads the admission log and the store; it sends every rank the same batch, and
  every rank takes a disjoint share of it made of whole groups (`shard_groups`), so group
  baselines are computed on complete groups;
- loss denominators (tokens, sequences) are summed over the ranks before any backward, and DDP
  sums (not averages) gradients, so each optimizer step's gradient is the single-process
  gradient of the same batch, whatever the aggregation mode;
- a rank whose share is smaller than the number of optimizer steps gets placeholder rows with
  no loss tokens, so every rank runs the same collectives; they add nothing to any gradient;
- rank 0 alone writes the store and publishes checkpoints (publish-then-mark unchanged); every
  rank resumes from the published version rank 0 names, with its optimizer state.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from core.children import Child, free_port, python_command
from learner.batch import TrainingSample

ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class Workers:
    """This process's place among the learner's data-parallel workers."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.world_size > 1

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over every rank (a new tensor; itself when single)."""
        if not self.parallel:
            return values
        out = values.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value`, on every rank."""
        if not self.parallel:
            return value
        box = [value if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank."""
        if not self.parallel:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out


SINGLE = Workers()


def workers_from_env(configured: int) -> Workers | None:
    """The place that a launcher put in the environment, or None when there is none."""
    if "WORLD_SIZE" not in os.environ:
        return None
    try:
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "-1"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError as exc:
        raise ValueError(f"learner workers: RANK/WORLD_SIZE/LOCAL_RANK must be integers ({exc})")
    if world != configured:
        raise ValueError(
            f"learner workers: the environment says WORLD_SIZE={world} but [learner] workers = "
            f"{configured}; start exactly `workers` processes, or set workers = {world}")
    if not 0 <= rank < world:
        raise ValueError(f"learner workers: RANK={rank} is outside 0..{world - 1}; the launcher "
                         "must give each process its own RANK")
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise ValueError(f"learner workers: {key} is not set; every rank needs rank 0's "
                             "address (MASTER_ADDR) and a free port on it (MASTER_PORT)")
    return Workers(rank=rank, world_size=world, local_rank=local)


def launch_peers(argv: Sequence[str], world_size: int) -> tuple[Workers, list[Child]]:
    """Make this process rank 0 of `world_size` on 127.0.0.1 and start ranks 1.. as
    `python argv` with the environment; they write to its stdout/stderr (its log) and die
    with it."""
    port = free_port()
    base = {"WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    os.environ.update({**base, "RANK": "0", "LOCAL_RANK": "0"})
    peers = [Child.start(f"learner worker {r}", python_command(*argv), None,
                         env={**base, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(1, world_size)]
    return Workers(rank=0, world_size=world_size), peers


def log_line(text: str, flush: bool = True) -> None:
    """Print `text` as one write: the ranks of a data-parallel learner share one log file, and
    `print` under PYTHONUNBUFFERED writes the text and its newline separately, so two ranks'
    lines could run together."""
    sys.stdout.write(text + "\n")
    if flush:
        sys.stdout.flush()


def exit_when_a_peer_dies(peers: Sequence[Child], log=log_line) -> threading.Event:
    """Rank 0 exits (code 1) as soon as a peer it started exits on its own: its collectives
    would otherwise wait for the dead peer until the timeout. Set the returned event before
    the peers' orderly exit at the end of the run, or their code 0 would read as a death."""
    finished = threading.Event()

    def watch() -> None:
        while not finished.is_set():
            for peer in peers:
                code = peer.poll()
                if code is not None and not finished.is_set():
                    log(f'{{"event": "learner worker {peer.pid} exited with code {code}"}}',
                        flush=True)
                    os._exit(1)
            finished.wait(0.5)

    threading.Thread(target=watch, name="learner-peers", daemon=True).start()
    return finished


def init_process_group(workers: Workers, device: str) -> str:
    """Join the process group; returns the device this rank trains on. End with
    `leave_process_group` once every `Learner` of this process is closed."""
    cuda = device.startswith("cuda")
    if cuda and device == "cuda":
        device = f"cuda:{workers.local_rank}"
    if cuda:
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl" if cuda else "gloo", rank=workers.rank,
                            world_size=workers.world_size, timeout=COLLECTIVE_TIMEOUT)
    return device


def live_ddp_wrappers() -> int:
    """How many `DistributedDataParallel` wrappers this process still holds (after a collection)."""
    gc.collect()
    return sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())


def leave_process_group() -> None:
    """The orderly end of a rank: every rank arrives (so none tears its side down while another
    still talks to it), then the group is destroyed while the interpreter is whole.

    Call it only after `Learner.close()`: a DDP wrapper holds the group's backend, so with one
    alive `destroy_process_group` only unregisters the group, and the backend (gloo's worker
    threads and their pending work) is torn down later, during interpreter finalisation, where
    it can abort the process (SIGABRT, "terminate called without an active exception") after
    a successful run. Raises `RuntimeError`, before any collective, if a wrapper is alive.
    After a failure, skip this: the other ranks may never reach the barrier."""
    alive = live_ddp_wrappers()
    if alive:
        raise RuntimeError(f"leave_process_group: {alive} DistributedDataParallel wrapper(s) "
                           "still alive; close every Learner (Learner.close()) first")
    dist.barrier()
    dist.destroy_process_group()


def _group_key(sample: TrainingSample) -> object:
    if sample.group_id is not None:
        return ("group", sample.group_id)
    return ("trajectory", *sample.member)


def shard_groups(samples: Sequence[TrainingSample], rank: int, world_size: int
                 ) -> list[TrainingSample]:
    """Rank `rank`'s share of `samples`: whole groups (a sample without a group is its own),
    balanced by token count (largest group to the least loaded rank), in batch order.
    Deterministic, so every rank computes the same partition from the same batch."""
    groups: dict[object, int] = {}
    for sample in samples:
        key = _group_key(sample)
        groups[key] = groups.get(key, 0) + sample.length
    loads = [0] * world_size
    owner: dict[object, int] = {}
    for key in sorted(groups, key=lambda k: -groups[k]):  # stable: ties keep batch order
        target = min(range(world_size), key=lambda r: (loads[r], r))
        owner[key] = target
        loads[target] += groups[key]
    return [s for s in samples if owner[_group_key(s)] == rank]


def placeholder(like: TrainingSample, pad_id: int, index: int, rank: int) -> TrainingSample:
    """A one-token row with no loss token, in a group of its own: it keeps a rank's collective
    calls in step with the others when its share is short, and adds nothing to any loss."""
    return replace(like, token_ids=[pad_id], loss_mask=[0], sampler_logprobs=[0.0],
                   weights_versions=[-1], reward=0.0, group_id=("placeholder", rank, index),
                   trajectory_id=index, kind="placeholder",
                   sampler_topk_ids=_first_row(like.sampler_topk_ids),
                   sampler_topk_logprobs=_first_row(like.sampler_topk_logprobs),
                   model_call_ids=(), call_spans=())


def _first_row(values: Any) -> Any:
    return None if values is None else values[:1]


def split_rows(rows: int, parts: int) -> list[slice]:
    """`rows` rows in `parts` contiguous, nearly equal slices (every one non-empty when
    rows >= parts)."""
    size, extra = divmod(rows, parts)
    out, start = [], 0
    for part in range(parts):
        stop = start + size + (1 if part < extra else 0)
        out.append(slice(start, stop))
        start = stop
    return out


SUMMED_METRICS = ("learner/samples", "learner/loss_tokens", "learner/tokens",
                  "perf/tokens_per_s")


def combine_metrics(per_rank: Sequence[dict[str, float]], summed: Sequence[str]
                    ) -> dict[str, float]:
    """One step's metrics from every rank's: losses and counts add up (each rank's loss is its
    share of the global sum), `*_max` and times take the maximum, the rest is a mean weighted by
    each rank's loss tokens."""
    if len(per_rank) == 1:
        return dict(per_rank[0])
    weights = [max(m.get("learner/loss_tokens", 0.0), 0.0) for m in per_rank]
    total_weight = sum(weights)
    out: dict[str, float] = {}
    for key in {k for m in per_rank for k in m}:
        values = [(m[key], w) for m, w in zip(per_rank, weights) if key in m]
        if key in summed or key in SUMMED_METRICS:
            out[key] = sum(v for v, _ in values)
        elif key.endswith(("_max", "/max")) or key.startswith("time/"):
            out[key] = max(v for v, _ in values)
        elif total_weight > 0 and sum(w for _, w in values) > 0:
            out[key] = sum(v * w for v, w in values) / sum(w for _, w in values)
        else:
            out[key] = sum(v for v, _ in values) / len(values)
    return out
