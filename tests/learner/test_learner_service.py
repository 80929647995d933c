"""The learner service's disk policy: older versions lose optimizer state, then their weights."""

from __future__ import annotations

from learner.service import OPTIMIZER_FILE, prune_versions


def _publish(root, version: int) -> None:
    path = root / f"v{version:06d}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"w")
    (path / OPTIMIZER_FILE).write_bytes(b"o")


def test_only_the_newest_keeps_optimizer_state_and_old_versions_go(tmp_path):
    for version in range(1, 7):
        _publish(tmp_path, version)
    (tmp_path / ".tmp-unmarked").mkdir()  # not a version: left to the crash cleanup
    deleted = prune_versions(tmp_path, newest=6, keep=3)
    assert sorted(p.name for p in deleted) == ["v000001", "v000002", "v000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-unmarked", "v000004",
                                                          "v000005", "v000006"]
    assert [v for v in (4, 5, 6) if (tmp_path / f"v{v:06d}" / OPTIMIZER_FILE).exists()] == [6]
    assert all((tmp_path / f"v{v:06d}" / "model.safetensors").exists() for v in (4, 5, 6))


def test_keep_zero_keeps_every_version_and_newer_unmarked_ones_are_untouched(tmp_path):
    for version in range(1, 5):
        _publish(tmp_path, version)
    assert prune_versions(tmp_path, newest=3, keep=0) == []
    assert len(list(tmp_path.iterdir())) == 4
    assert (tmp_path / "v000004" / OPTIMIZER_FILE).exists()  # newer than the marked one
    assert not (tmp_path / "v000002" / OPTIMIZER_FILE).exists()
