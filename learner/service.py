"""The learner process of a job (`stalewise learner serve`): admission log in, versions out.

Loop: read the next batch from the run's learner stream (whole groups, in sequence order),
train one RL step, record it; every `publish_every` steps publish the weights (checkpoint and
optimizer state written completely, then the step row and the version row in one transaction).

Resume (after a crash or SIGKILL of this process or of the orchestrator): the learner restarts
from the latest published version, with its optimizer state, at the step and stream position
recorded with that version; step rows beyond it (steps whose weights were never published) are
deleted and redone, so the steps in the store consume sequence numbers 1, 2, 3, ... contiguously,
each exactly once. Unmarked version directories left by a crash are removed.

Disk: once a version is marked, older versions lose their optimizer state and only the newest
`keep_checkpoints` version directories stay (the engine always loads the newest).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from config.learner import LearnerConfig
from core.children import Child
from core.store.store import Store
from learner.distributed import (
    SINGLE,
    Workers,
    exit_when_a_peer_dies,
    init_process_group,
    launch_peers,
    leave_process_group,
    log_line,
    workers_from_env,
)
from learner.metrics import ConsoleSink, StepReport
from learner.store_source import StoreSource
from learner.trainer import Learner
from learner.trainer_logprobs import TrainerLogprobRecorder

OPTIMIZER_FILE = "optimizer.pt"
PEER_EXIT_S = 120.0
DEATH_REAP_S = 5.0


class StoreSink:
    """Writes each step report (and the version it published) to the store."""

    def __init__(self, store: Store, run_id: str) -> None:
        self.store, self.run_id = store, run_id

    def write(self, report: StepReport) -> None:
        step = dict(step=report.step, mode=report.mode, first_seq=report.first_seq,
                    last_seq=report.last_seq, num_samples=report.num_samples,
                    num_tokens=report.num_tokens, loss=report.loss,
                    policy_version=report.policy_version, mean_lag=report.mean_lag,
                    max_lag=report.max_lag, metrics=_finite(report.metrics),
                    started_at=report.started_at, finished_at=report.finished_at)
        version = None
        if report.published_version is not None:
            version = dict(version=report.published_version, path=report.published_path,
                           learner_step=report.step, last_seq=report.last_seq)
        self.store.record_learner_step_and_version(self.run_id, step, version)

    def close(self) -> None:
        pass


def _finite(metrics: dict[str, float]) -> dict[str, float | None]:
    return {k: (v if v == v and abs(v) != float("inf") else None) for k, v in metrics.items()}


def _remove_unmarked(publish_root: Path, version: int) -> None:
    if not publish_root.exists():
        return
    for path in publish_root.iterdir():
        name = path.name
        unmarked = name.startswith(".tmp-") or (name.startswith("v") and name[1:].isdigit()
                                                and int(name[1:]) > version)
        if unmarked:
            shutil.rmtree(path, ignore_errors=True)


def prune_versions(publish_root: Path, newest: int, keep: int) -> list[Path]:
    """After `newest` is marked: drop the optimizer state of older versions (only the newest is
    resumed from) and, with `keep` > 0, every version directory older than the newest `keep`.
    Returns the directories deleted."""
    deleted = []
    for path in sorted(publish_root.glob("v[0-9]*")):
        number = path.name[1:]
        if not number.isdigit() or int(number) >= newest:
            continue
        if keep and int(number) <= newest - keep:
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(path)
        else:
            (path / OPTIMIZER_FILE).unlink(missing_ok=True)
    return deleted


def _resume_point(store: Store, run_id: str, model_dir: Path, publish_root: Path) -> dict:
    """Where training resumes: the latest published version (or the starting checkpoint); step
    rows beyond it are forgotten and unmarked version directories removed."""
    latest = store.latest_version(run_id)
    version = latest.version if latest else 0
    step = (latest.learner_step or 0) if latest else 0
    forgotten = store.forget_learner_steps_after(run_id, step)
    _remove_unmarked(publish_root, version)
    return dict(version=version, step=step, last_seq=(latest.last_seq or 0) if latest else 0,
                start_dir=str(Path(latest.path) if latest else model_dir), redo_steps=forgotten)


def _fingerprint(optimizer: torch.optim.Optimizer) -> float:
    """A number that differs between two optimizer states (0.0 before the first step)."""
    total = 0.0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += float(value.double().abs().sum())
    return total


@dataclass
class _Peers:
    """The ranks this process started (rank 0 of a local job) and the watch over them."""

    processes: list[Child] = field(default_factory=list)
    watch: threading.Event | None = None

    def name_the_dead(self, log) -> None:
        """After a failed collective: say which peer died (the watch may not have seen it yet;
        a peer whose socket closed is reaped within moments)."""
        for peer in self.processes:
            try:
                code = peer.wait(DEATH_REAP_S)
            except subprocess.TimeoutExpired:
                continue
            log(f'{{"event": "learner worker {peer.pid} exited with code {code}"}}', flush=True)

    def wait_for_orderly_exit(self) -> None:
        if self.watch is not None:  # their exit now is the end of the run, not a death
            self.watch.set()
        for peer in self.processes:  # they finished the same last step
            peer.wait(PEER_EXIT_S)


def _join_workers(cfg: LearnerConfig, argv: list[str] | None, log
                  ) -> tuple[Workers, str, _Peers]:
    """This process's place among the data-parallel workers (learner.distributed), its device
    and the peers it started: with `workers` > 1 and no launcher environment, it starts them."""
    if cfg.workers == 1:
        return SINGLE, cfg.device, _Peers()
    workers, peers = workers_from_env(cfg.workers), _Peers()
    if workers is None:
        if argv is None:
            raise ValueError("learner serve: workers > 1 needs the command line to start the "
                             "other workers with, or RANK/WORLD_SIZE/MASTER_* from a launcher")
        workers, processes = launch_peers(argv, cfg.workers)
        peers = _Peers(processes, exit_when_a_peer_dies(processes, log))
    return workers, init_process_group(workers, cfg.device), peers


def serve(*, db_url: str, run_id: str, cfg: LearnerConfig, model_dir: Path, publish_root: Path,
          steps: int, poll_s: float = 0.2, log=log_line, argv: list[str] | None = None) -> int:
    """Run the learner; with `[learner] workers` > 1 this is one rank of several, and only
    rank 0 opens the store (`argv`: this command, to start the peers with)."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    workers, device, peers = _join_workers(cfg, argv, log)
    store = Store.open(db_url) if workers.is_main else None
    start = workers.broadcast(
        _resume_point(store, run_id, model_dir, publish_root) if store is not None else None)
    version, step, last_seq = start["version"], start["step"], start["last_seq"]
    start_dir = Path(start["start_dir"])
    cfg = cfg.model_copy(update={"reference_model": cfg.reference_model or str(model_dir),
                                 "device": device})

    def save_optimizer(_version: int, path: Path) -> None:
        target = Path(path) / OPTIMIZER_FILE
        torch.save(learner.optimizer.state_dict(), target)
        with open(target, "rb") as handle:
            os.fsync(handle.fileno())

    sinks: list = []
    recorder = None
    if store is not None:
        recorder = TrainerLogprobRecorder(store, run_id, every=cfg.trainer_logprobs_every)
        sinks = [StoreSink(store, run_id), ConsoleSink(),
                 *([recorder] if cfg.record_trainer_logprobs else [])]
    learner = Learner(start_dir, cfg, publish_root=publish_root,
                      mark_published=save_optimizer if workers.is_main else None, sinks=sinks,
                      version=version, step=step, last_sequence=last_seq, workers=workers)
    if recorder is not None and cfg.record_trainer_logprobs:
        learner.logprob_observers.append(recorder.observe)
    if (start_dir / OPTIMIZER_FILE).exists():  # every rank: the optimizer state is replicated
        learner.optimizer.load_state_dict(
            torch.load(start_dir / OPTIMIZER_FILE, map_location=learner.device))
    if workers.parallel:  # every rank: what it resumed from, to compare across ranks
        log(json.dumps({"event": "learner worker ready", "rank": workers.rank,
                        "version": version, "optimizer_state": _fingerprint(learner.optimizer)}),
            flush=True)
    if workers.is_main:
        log(json.dumps({"event": "learner started", "run_id": run_id, "version": version,
                        "step": step, "last_seq": last_seq, "redo_steps": start["redo_steps"],
                        "from": str(start_dir), "workers": workers.world_size,
                        "threads": torch.get_num_threads()}), flush=True)
    source = StoreSource(store, run_id, pad_id=learner.pad_id) if store is not None else None

    def prune(report: StepReport) -> None:
        if report.published_version is not None:  # its row is in the store: older may go
            prune_versions(publish_root, report.published_version, cfg.keep_checkpoints)

    try:
        learner.run(source, until_step=steps, train_partial_last_batch=False, poll_s=poll_s,
                    on_report=prune if workers.is_main else None,
                    log=lambda event: log(json.dumps({"event": event}), flush=True))
    except Exception:
        peers.name_the_dead(log)  # a peer's death often surfaces first as a gloo error here
        raise
    if store is not None:
        store.close()
    learner.close()
    if workers.parallel:
        leave_process_group()
    peers.wait_for_orderly_exit()
    return 0
