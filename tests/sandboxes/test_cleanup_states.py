"""Which container states a start-up sweep acts on, without a Docker engine.

A job tearing down its own sandbox leaves the container in state `removing` for a moment; a
second job's sweep that reported it as an orphan would claim a live job's container (CI saw
"removed orphan sandbox ...: container is removing" for a live run's container).
"""

from __future__ import annotations

from types import SimpleNamespace

from sandboxes import labels as lab
from sandboxes.cleanup import remove_orphans


class _Api:
    def __init__(self, records: list[dict]) -> None:
        self.records = records
        self.removed: list[str] = []

    def containers(self, all: bool, filters: dict) -> list[dict]:  # noqa: A002 (docker's name)
        return self.records

    def remove_container(self, container_id: str, force: bool) -> None:
        self.removed.append(container_id)


def _record(container_id: str, state: str) -> dict:
    labels = lab.container_labels(run_id="live", trajectory_id=container_id, ttl_s=3600,
                                  owner=lab.Owner.current())
    return {"Id": container_id, "Names": [f"/sw-live-{container_id}"], "State": state,
            "Labels": labels}


def test_a_live_owners_container_being_removed_is_not_an_orphan() -> None:
    api = _Api([_record("running", "running"), _record("removing", "removing"),
                _record("exited", "exited"), _record("dead", "dead")])
    removed = remove_orphans(SimpleNamespace(api=api))
    assert {r.container_id: r.reason for r in removed} == {
        "exited": "container is exited", "dead": "container is dead"}
    assert api.removed == ["exited", "dead"]
