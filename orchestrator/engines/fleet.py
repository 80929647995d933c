"""The job's engines, whatever their topology, as one `EngineFleet`.

Topologies (`[engine]`, `[cluster]`):
- one engine started here (the default): an embedded engine process, or `vllm serve` from
  `.venv-vllm` (`kind = "vllm"`); it is watched, and the job fails when it dies;
- `replicas = N` (N > 1): N embedded engine processes (`LocalReplicas`), each on a free port of
  its own with its own log (`RUN/engine-r<i>.log`), behind a router that restarts one that dies;
- `cluster.backend = "ray"`: the replicas as Ray actors on their nodes (`RayEngines`);
- `url = ...` or `urls = [...]`: servers someone else runs; nothing is started.

`EngineFleet.start` starts what the topology needs, `client()` is the one `EngineClient` the
pipeline uses (a plain client for one engine, an `orchestrator.engines.replicas.ReplicaRouter`
for several), `supervise` is the task that watches them, and `stop` stops what was started.

Guarantees: every replica process is forked from the event loop's (main) thread, so it dies
with the job; waiting for one to answer happens in a worker thread and never blocks the loop.
A replica restarted by the router serves the newest weights the router applied (it starts
from that checkpoint, at that version); the process it replaces is stopped first. The restart
loads a hold of that checkpoint (its files hard-linked into `RUN/engine-r<i>-weights/` before
anything else happens), so the learner deleting the version meanwhile (`keep_checkpoints`; a
restart takes seconds, a step a fraction of one) cannot pull it from under the starting engine. `stop`
stops every replica the job started, restarted ones included.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskStatus

from config.engine import EngineConfig
from config.job import JobConfig
from core.children import Child
from core.engine_api import EngineClient
from core.log import get_logger
from orchestrator.engines.embedded import DEFAULT_CONNECTIONS, engine_client
from orchestrator.engines.launch import (
    engine_ready,
    hold_checkpoint,
    spawn_engine,
    start_engine,
    start_vllm,
)
from orchestrator.engines.replicas import ReplicaRouter

if TYPE_CHECKING:
    from orchestrator.cluster.roles import RayEngines

log = get_logger("stalewise.replicas")


class LocalReplicas:
    """N embedded engine processes of one job (see module docstring)."""

    def __init__(self, cfg: EngineConfig, *, model_dir: Path, version: int, seed: int,
                 run_dir: Path) -> None:
        self.cfg, self.model_dir, self.version, self.seed = cfg, model_dir, version, seed
        self.run_dir = run_dir
        self.processes: list[Child] = []
        self._starting: list[Child] = []  # restarts forked, not answering yet (`stop` ends them)

    def start(self) -> LocalReplicas:
        """Fork every replica, then wait for all (blocking: call before the job's loop runs
        its tasks, from the main thread)."""
        forked = [self._spawn(i, self.model_dir, self.version) for i in range(self.cfg.replicas)]
        try:
            for child in forked:
                self.processes.append(engine_ready(child, self.cfg.startup_timeout_s))
        except BaseException:
            for child in forked:
                child.stop(0)
            raise
        return self

    def _spawn(self, index: int, model_dir: Path, version: int) -> Child:
        return spawn_engine(model_dir, self.cfg.server_fields(),
                            config_path=self.run_dir / "engine.json", initial_version=version,
                            seed=self.seed + index, log_path=self.run_dir / f"engine-r{index}.log")

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.processes]

    async def restart(self, index: int, newest: tuple[str, int] | None) -> EngineClient:
        """Stop replica `index` and start it again at the newest weights; a ready client."""
        model_dir, version = (Path(newest[0]), newest[1]) if newest else (self.model_dir,
                                                                          self.version)
        model_dir = hold_checkpoint(model_dir, self.run_dir / f"engine-r{index}-weights")
        old = self.processes[index]
        await anyio.to_thread.run_sync(old.stop, 10.0)
        forked = self._spawn(index, model_dir, version)  # forked on the loop's thread
        self._starting.append(forked)
        try:
            process = await anyio.to_thread.run_sync(engine_ready, forked,
                                                     self.cfg.startup_timeout_s)
        finally:
            self._starting.remove(forked)
        self.processes[index] = process
        log.info("engine replica restarted", replica=index, url=process.url, version=version)
        client = _client(self.cfg, process.url, version)
        await client.wait_ready(self.cfg.startup_timeout_s)
        return client

    def stop(self) -> None:
        for forked in self._starting:
            forked.stop(0)
        for process in self.processes:
            process.stop()
        for hold in self.run_dir.glob("engine-r*-weights"):
            shutil.rmtree(hold, ignore_errors=True)


def _client(cfg: EngineConfig, url: str, version: int) -> EngineClient:
    """A client for one of the job's engines: `engine.max_connections` connections to it, and
    vLLM's `engine.stream_interval` tokens per event (the job sets both:
    `JobConfig.engine_connections`, `JobConfig.engine_stream_interval`)."""
    return engine_client(url, kind=cfg.kind, initial_version=version,
                         max_connections=cfg.max_connections or DEFAULT_CONNECTIONS,
                         stream_interval=cfg.stream_interval or 1)


def _start_one(job: JobConfig, model_dir: Path, version: int, run_dir: Path) -> Child:
    """The one engine process of a default job (blocking: from the main thread)."""
    if job.engine.kind == "vllm":
        return start_vllm(model_dir, port=job.engine.port, initial_version=version,
                          extra_args=tuple(job.engine.extra_args),
                          log_path=run_dir / "engine.log",
                          startup_timeout=job.engine.startup_timeout_s)
    return start_engine(model_dir, job.engine.server_fields(),
                        config_path=run_dir / "engine.json", port=job.engine.port,
                        initial_version=version, seed=job.engine.seed,
                        log_path=run_dir / "engine.log",
                        startup_timeout=job.engine.startup_timeout_s)


class EngineFleet:
    """The job's engines (see module docstring)."""

    def __init__(self, cfg: EngineConfig, *, version: int, single: Child | None = None,
                 replicas: "LocalReplicas | RayEngines | None" = None) -> None:
        self.cfg, self.version = cfg, version
        self.single = single          # the one engine process started here
        self.replicas = replicas      # replicas started here or on Ray (each restartable)

    @classmethod
    def start(cls, job: JobConfig, *, model_dir: Path, version: int, run_dir: Path,
              run_id: str) -> "EngineFleet":
        """Start the engines the topology needs, serving `model_dir` as `version` (blocking,
        from the main thread, so every process started here dies with the job)."""
        cfg = job.engine.model_copy(update={"max_connections": job.engine_connections(),
                                            "stream_interval": job.engine_stream_interval()})
        if cfg.url is not None or cfg.urls:
            return cls(cfg, version=version)
        if job.cluster.backend == "ray":
            from orchestrator.cluster.roles import RayEngines

            engines = RayEngines.place(job, model_dir, version, run_dir, run_id,
                                       connections=cfg.max_connections)
            log.info("engine replicas placed", urls=engines.urls)
            return cls(cfg, version=version, replicas=engines)
        if cfg.replicas == 1:
            return cls(cfg, version=version, single=_start_one(job, model_dir, version, run_dir))
        return cls(cfg, version=version, replicas=LocalReplicas(
            cfg, model_dir=model_dir, version=version, seed=job.engine.seed,
            run_dir=run_dir).start())

    def client(self) -> EngineClient:
        """The pipeline's one engine: the engine's own client, or a router over the replicas
        (which restarts one that dies, when the fleet started them)."""
        urls = ([self.single.url] if self.single is not None else
                self.replicas.urls if self.replicas is not None else
                [self.cfg.url] if self.cfg.url is not None else list(self.cfg.urls))
        if self.cfg.replica_count == 1:  # one engine: its own client, no router
            return _client(self.cfg, urls[0], self.version)
        return ReplicaRouter(
            [_client(self.cfg, u, self.version) for u in urls],
            restart=self.replicas.restart if self.replicas is not None else None,
            max_restarts=self.cfg.replica_max_restarts,
            health_interval_s=self.cfg.replica_health_interval_s,
            health_failures=self.cfg.replica_health_failures, initial_version=self.version)

    async def supervise(self, client: EngineClient, *,
                        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The fleet's watch, for the job's task group: the router's probes, failovers and
        restarts; or `ChildDied` as soon as the one engine the fleet started (here, or one
        Ray replica that used up its restarts on its node) exits."""
        from orchestrator.processes import watch

        if isinstance(client, ReplicaRouter):
            await client.run(task_status=task_status)
            return
        task_status.started()
        started = self.single or self.replicas
        if started is not None:
            await watch("engine", started.poll, started.log_tail)

    def stop(self) -> None:
        for started in (self.single, self.replicas):
            if started is not None:
                started.stop()
