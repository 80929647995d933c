"""A job's roles on Ray: engine replicas and learner workers, shaped like the local children.

`RayEngines` answers what the job asks of its local engine process (`url`, `poll`, `log_tail`,
`stop`) and adds `urls` (one per replica) and `statuses`; `RayLearners` answers what it asks
of the supervised learner (`run(expected_exit=...)`, `stop`). Restarts happen on the nodes (the
actors supervise their children); the driver sees a role fail only when an actor has used up
its restarts or is gone, and then gets every failure line with its log tail.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio

from config.job import JobConfig
from core.engine_api import EngineClient
from orchestrator.cluster.launch import CommandLaunch, EngineLaunch
from orchestrator.cluster.placement import PlacementError, RoleGroup, connect
from orchestrator.engines.embedded import DEFAULT_CONNECTIONS, engine_client
from orchestrator.engines.launch import hold_checkpoint
from orchestrator.processes import ChildDied

BROKEN = ("failed", "lost", "stopped")


def _failure_text(statuses: list[dict]) -> str:
    lines = []
    for s in statuses:
        if s["state"] in BROKEN:
            where = s.get("node_ip", "?")
            lines.append(f"{s['role']} on {where} is {s['state']} after "
                         f"{s.get('restarts', 0)} restarts; last failure: "
                         f"{(s.get('failures') or ['(none recorded)'])[-1]}")
    return "\n".join(lines)


class RayEngines:
    def __init__(self, group: RoleGroup, *, model_dir: Path, version: int,
                 startup_timeout_s: float, run_dir: Path | None = None,
                 connections: int = DEFAULT_CONNECTIONS) -> None:
        self.group, self.model_dir, self.version = group, model_dir, version
        self.run_dir, self.connections = run_dir, connections
        self.startup_timeout_s = startup_timeout_s
        self.urls: list[str] = [s["url"] for s in group.statuses()]

    @classmethod
    def place(cls, job: JobConfig, model_dir: Path, version: int, run_dir: Path,
              run_id: str, *, connections: int = DEFAULT_CONNECTIONS) -> "RayEngines":
        if job.engine.kind != "embedded":
            raise PlacementError("cluster.backend = 'ray' places embedded engines only; for "
                                 "vLLM run `vllm serve` on the GPU nodes yourself and set "
                                 "engine.url (docs/scale-out.md)")
        connect(job.cluster)
        launches = [EngineLaunch(
            name=f"engine-{i}", model_dir=str(model_dir.resolve()),
            server=job.engine.server_fields(), initial_version=version, seed=job.engine.seed + i,
            config_path=str((run_dir / f"engine-{i}.json").resolve()),
            log_path=str((run_dir / f"engine-{i}.log").resolve()),
            startup_timeout_s=job.engine.startup_timeout_s, db_url=job.run.db_url,
            run_id=run_id) for i in range(job.engine.replicas)]
        group = RoleGroup.place("engine", job.cluster.engine, launches,
                                timeout_s=job.cluster.startup_timeout_s)
        return cls(group, model_dir=model_dir, version=version,
                   startup_timeout_s=job.engine.startup_timeout_s, run_dir=run_dir,
                   connections=connections)

    @property
    def url(self) -> str:
        return self.urls[0]

    def statuses(self) -> list[dict]:
        return self.group.statuses()

    def poll(self) -> int | None:
        """None while every replica runs (restarts included); else a broken one's exit code."""
        for s in self.group.statuses():
            if s["state"] in BROKEN:
                return s.get("exit_code") if s.get("exit_code") is not None else -1
        return None

    def log_tail(self, chars: int = 4000) -> str:
        return _failure_text(self.group.statuses())[-chars:]

    async def restart(self, index: int, newest: tuple[str, int] | None) -> EngineClient:
        """Restart replica `index` on its node with the newest weights the caller applied
        (the same shape as the local replicas' restart, for a replica router); a client."""
        model_dir, version = newest if newest else (str(self.model_dir), self.version)
        if self.run_dir is not None:  # the nodes read the run directory (docs/scale-out.md)
            model_dir = hold_checkpoint(Path(model_dir),
                                        self.run_dir / f"engine-{index}-weights").resolve()
        status = await anyio.to_thread.run_sync(lambda: self.group.call(
            index, "replace", str(model_dir), int(version),
            timeout_s=self.startup_timeout_s + 60))
        if status["state"] != "running":
            raise ChildDied(f"engine replica {index} could not be restarted:\n"
                            f"{_failure_text([status])}")
        self.urls[index] = status["url"]
        client = engine_client(status["url"], initial_version=int(version),
                               max_connections=self.connections)
        await client.wait_ready(self.startup_timeout_s)
        return client

    def stop(self, timeout: float = 15.0) -> None:
        self.group.stop(timeout)


class RayLearners:
    def __init__(self, group: RoleGroup) -> None:
        self.group = group

    @classmethod
    def place(cls, job: JobConfig, argv: list[str], run_dir: Path) -> "RayLearners":
        connect(job.cluster)
        workers = job.learner.workers
        launches = [CommandLaunch(name=f"learner-{rank}", argv=list(argv),
                                  log_path=str((run_dir / f"learner-{rank}.log").resolve()))
                    for rank in range(workers)]
        return cls(RoleGroup.place("learner", job.cluster.learner, launches,
                                   timeout_s=job.cluster.startup_timeout_s, rendezvous=True))

    async def run(self, *, expected_exit: Callable[[], bool], interval_s: float = 0.5) -> None:
        """Return once every worker has finished and the job expected it; raise `ChildDied`
        when a worker has failed for good. A worker that finished before the job expected it
        is started again (it resumes from its last published checkpoint), as locally."""
        while True:
            statuses = await anyio.to_thread.run_sync(self.group.statuses)
            broken = _failure_text(statuses)
            if broken:
                raise ChildDied(f"the learner failed on the cluster:\n{broken}")
            if all(s["state"] == "exited" for s in statuses):
                if expected_exit():
                    return
                for i in range(len(statuses)):
                    await anyio.to_thread.run_sync(self.group.call, i, "restart")
            await anyio.sleep(interval_s)

    def stop(self, timeout: float = 15.0) -> None:
        self.group.stop(timeout)
