"""How a Ray actor starts its child on its node: the same commands a local job runs, as the
same `core.children.Child`.

`EngineLaunch` starts `python -m engine serve` through `orchestrator.engines.launch.start_engine`,
bound to the node's own address so other nodes reach it; a restart reuses the port the first
start got (the replica keeps its URL) and serves the newest weights the store lists as
published (every node reaches the one PostgreSQL store). `CommandLaunch` starts any
`python -m ...` child (the learner's `serve`).

Both are small picklable values: the driver builds them, Ray ships them to the actor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from config.engine import EngineServerConfig
from core.children import Child, python_command


class Launch(Protocol):
    """Starts one child on this node; `previous` is the child it replaces (None at first)."""

    name: str
    exit_ok: bool  # exit code 0 ends the role's work (the learner after its steps)

    def start(self, host: str, previous: Child | None, env: dict[str, str],
              weights: tuple[str, int] | None = None) -> Child: ...


@dataclass(frozen=True)
class EngineLaunch:
    name: str
    model_dir: str
    server: EngineServerConfig
    initial_version: int
    seed: int
    config_path: str
    log_path: str
    startup_timeout_s: float
    db_url: str | None = None  # with run_id: restarts serve the newest published weights
    run_id: str | None = None
    exit_ok: bool = False

    def start(self, host: str, previous: Child | None, env: dict[str, str],
              weights: tuple[str, int] | None = None) -> Child:
        """`weights` (checkpoint, version) when the driver names them; else a restart serves
        the newest published version and a first start `initial_version`."""
        from orchestrator.engines.launch import start_engine

        model_dir, version = self.model_dir, self.initial_version
        if weights is not None:
            model_dir, version = weights
        elif previous is not None and self.db_url and self.run_id:
            model_dir, version = self._newest_published(model_dir, version)
        port = urlsplit(previous.url).port if previous is not None and previous.url else 0
        return start_engine(
            model_dir, self.server, host=host, port=port or 0, initial_version=version,
            seed=self.seed, config_path=self.config_path, log_path=self.log_path,
            startup_timeout=self.startup_timeout_s, env=env)

    def _newest_published(self, model_dir: str, version: int) -> tuple[str, int]:
        from core.store.store import Store

        store = Store.open(self.db_url)
        try:
            published, path, _, _ = store.learner_progress(self.run_id)
        finally:
            store.close()
        return (path, published) if path else (model_dir, version)


@dataclass(frozen=True)
class CommandLaunch:
    name: str
    argv: list[str]  # after `python -P`
    log_path: str
    exit_ok: bool = True
    env: dict[str, str] = field(default_factory=dict)

    def start(self, host: str, previous: Child | None, env: dict[str, str],
              weights: tuple[str, int] | None = None) -> Child:
        return Child.start(self.name, python_command(*self.argv), Path(self.log_path),
                           env={**self.env, **env})
