"""The job's engines when there are several: local replica processes, or a list of URLs.

`[engine] replicas = N` (N > 1) starts N embedded engine processes (`LocalReplicas`), each on
a free port of its own with its own log (`RUN/engine-r<i>.log`); `[engine] urls = [...]`
attaches to running servers. `job_engine_client` turns either, or the single engine of
today's jobs, into the one client the pipeline uses: a plain engine client for one engine
(behaviour unchanged), an `orchestrator.engines.replicas.ReplicaRouter` for several.

Guarantees: every replica process is forked from the event loop's (main) thread, so it dies
with the job; waiting for one to answer happens in a worker thread and never blocks the loop.
A replica restarted by the router serves the newest weights the router applied (it starts
from that checkpoint, at that version); the process it replaces is stopped first. `stop`
stops every replica the job started, restarted ones included.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from config.engine import EngineConfig
from core.engine_api import EngineClient
from core.log import get_logger
from orchestrator.engines.embedded import engine_client
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
        self.processes: list = []
        self._starting: list = []  # restarts forked but not answering yet (stopped by `stop`)

    def start(self) -> LocalReplicas:
        """Fork every replica, then wait for all (blocking: call before the job's loop runs
        its tasks, from the main thread)."""
        pending = [self._spawn(i, self.model_dir, self.version)
                   for i in range(self.cfg.replicas)]
        try:
            for p in pending:
                self.processes.append(p.ready(self.cfg.startup_timeout_s))
        except BaseException:
            for p in pending:
                if p.process.poll() is None:
                    p.process.kill()
                    p.process.wait()
            raise
        return self

    def _spawn(self, index: int, model_dir: Path, version: int):
        from orchestrator.engines.launch import EngineProcess

        return EngineProcess.spawn(model_dir, self.cfg.server_fields(),
                                   config_path=self.run_dir / "engine.json",
                                   initial_version=version, seed=self.seed + index,
                                   log_path=self.run_dir / f"engine-r{index}.log")

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.processes]

    async def restart(self, index: int, newest: tuple[str, int] | None) -> EngineClient:
        """Stop replica `index` and start it again at the newest weights; a ready client."""
        old = self.processes[index]
        await anyio.to_thread.run_sync(old.stop, 10.0)
        model_dir, version = (Path(newest[0]), newest[1]) if newest else (self.model_dir,
                                                                          self.version)
        pending = self._spawn(index, model_dir, version)  # forked on the loop's thread
        self._starting.append(pending)
        try:
            process = await anyio.to_thread.run_sync(pending.ready, self.cfg.startup_timeout_s)
        finally:
            self._starting.remove(pending)
        self.processes[index] = process
        log.info("engine replica restarted", replica=index, url=process.url, version=version)
        client = engine_client(process.url, initial_version=version)
        await client.wait_ready(self.cfg.startup_timeout_s)
        return client

    def stop(self) -> None:
        for pending in self._starting:
            if pending.process.poll() is None:
                pending.process.kill()
                pending.process.wait()
        for process in self.processes:
            process.stop()


def job_engine_client(cfg: EngineConfig, *, single_url: str | None,
                      local: "LocalReplicas | RayEngines | None",
                      version: int) -> EngineClient:
    """The pipeline's engine client: `single_url`'s client for one engine, else a router over
    the replicas the job started (`local`: processes here, or Ray actors; either restarts a
    replica at the newest weights) or over `cfg.urls`."""
    if single_url is not None:
        return engine_client(single_url, kind=cfg.kind, initial_version=version)
    urls = local.urls if local is not None else list(cfg.urls)
    clients = [engine_client(u, kind=cfg.kind, initial_version=version) for u in urls]
    return ReplicaRouter(clients, restart=local.restart if local is not None else None,
                         max_restarts=cfg.replica_max_restarts,
                         health_interval_s=cfg.replica_health_interval_s,
                         health_failures=cfg.replica_health_failures, initial_version=version)
