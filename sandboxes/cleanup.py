"""Removing stalewise containers: orphans on start, and by run or wholesale on request.

Guarantees: only containers labelled with this installation's id are ever touched; an orphan is
removed only for a reason given by `labels.orphan_reason` (owner provably dead, or TTL
passed) or because it has already stopped (exited or dead), and each removal is returned with
that reason; a container the engine is already removing is left to it. Removal failures of
single containers are reported in the result, not raised, so one stuck container does not stop
the rest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from sandboxes import labels as lab
from sandboxes.engine import connect

if TYPE_CHECKING:
    import docker


@dataclass(frozen=True)
class Removal:
    container_id: str
    name: str
    run_id: str
    reason: str
    error: str = ""


def list_containers(client: "docker.DockerClient", *, installation: str | None = None,
                    run_id: str | None = None) -> list[dict]:
    """Raw engine records (running or not) of this installation's containers."""
    filters = [f"{lab.INSTALLATION}={installation or lab.installation_id()}"]
    if run_id is not None:
        filters.append(f"{lab.RUN_ID}={run_id}")
    return list(client.api.containers(all=True, filters={"label": filters}))


def _remove(client: "docker.DockerClient", record: dict, reason: str) -> Removal:
    import docker.errors

    labels = record.get("Labels") or {}
    name = (record.get("Names") or ["?"])[0].lstrip("/")
    error = ""
    try:
        client.api.remove_container(record["Id"], force=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as exc:
        if exc.status_code != 409:  # 409: already being removed
            error = str(exc)
    return Removal(record["Id"], name, labels.get(lab.RUN_ID, ""), reason, error)


def remove_orphans(client: "docker.DockerClient | None" = None, *,
                   installation: str | None = None) -> list[Removal]:
    """Remove this installation's containers whose owner is gone or whose TTL has passed."""
    client = client or connect()
    me = lab.Owner.current()
    now = time.time()
    removed = []
    for record in list_containers(client, installation=installation):
        state = record.get("State")
        if state == "removing":  # its owner (or the engine's auto-remove) is already ending it
            continue
        reason = lab.orphan_reason(record.get("Labels") or {}, me=me, now=now)
        if reason is None and state not in ("running", "created", "restarting"):
            reason = f"container is {state}"  # exited or dead: debris whatever its owner
        if reason is not None:
            removed.append(_remove(client, record, reason))
    return removed


def remove_all(client: "docker.DockerClient | None" = None, *, run_id: str | None = None,
               installation: str | None = None) -> list[Removal]:
    """Remove every container of this installation, or of one run when `run_id` is given."""
    client = client or connect()
    reason = f"run {run_id} cleanup requested" if run_id is not None else "cleanup --all"
    return [_remove(client, record, reason)
            for record in list_containers(client, installation=installation, run_id=run_id)]


async def remove_orphans_async(client: "docker.DockerClient | None" = None) -> list[Removal]:
    """`remove_orphans` off the event loop (for `SandboxPool(on_start=...)`)."""
    return await anyio.to_thread.run_sync(lambda: remove_orphans(client))
